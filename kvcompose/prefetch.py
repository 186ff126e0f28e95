"""Prefetchers: bring a layer's host-tier / compressed-tier tokens back before its attention.

`Prefetcher.merge` puts hot (HBM) and fetched tokens together in their original order, so attention
over the merged set is bit-identical to attention over a cache that held all of them in HBM.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Prefetcher"]


class Prefetcher:
    """Synchronous prefetch: fetched tokens are moved to the layer's device and merged by position."""

    def merge(self, layer, fetched) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        fk, fv, fpos = fetched
        dev = layer.device
        keys = torch.cat([layer.keys, fk.to(dev, non_blocking=True)], dim=2)
        values = torch.cat([layer.values, fv.to(dev, non_blocking=True)], dim=2)
        pos = torch.cat([layer.positions, fpos.to(dev)], dim=2)
        valid = torch.cat([layer.valid, torch.ones_like(fpos, dtype=torch.bool, device=dev)], dim=2)
        order = pos.argsort(dim=-1, stable=True)
        g = lambda x: x.gather(2, order[..., None].expand(*order.shape, x.shape[-1]))  # noqa: E731
        return g(keys), g(values), pos.gather(-1, order), valid.gather(-1, order)
