"""CurDKV's approximate leverage scores of keys and values (query-free).

Sengupta et al., "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition" (CurDKV),
arXiv 2509.15038; kvpress's `CURPress`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ..scorers import Scorer
from ..view import KVComposeError, LayerView
from ._util import first_real, real_rank

__all__ = ["CUR"]

_KINDS = ("key", "value", "kv_avg", "kv_product")


class CUR(Scorer):
    """Approximate leverage: `k2 = |k|^2`, `v2 = |v|^2` per token (after an optional Gaussian projection `G`,
    `D x 20`, entries N(0, 1/20), drawn from the layer's generator at each event), each normalised within
    local windows of `window` consecutive real tokens (`local=True`), combined by `kind` (`k2 * v2` by
    default), normalised to sum 1 over the (row, KV head); the first `sinks` real tokens score 1.

    The same rule as kvpress's `CURPress` (windows and sinks over the real tokens of each (row, KV head) in
    position order, where kvpress counts slots; identical on a contiguous cache). VaSE's query-free mode is
    the projected, non-local variant with a product (`kvcompose.ProjectedNorm`). Query-free.

    Args:
        sinks: leading tokens set to 1 (4).
        kind: "key", "value", "kv_avg" or "kv_product".
        random_projection: project keys and values with a fresh Gaussian `G` (`rank` columns) first.
        local: normalise within local windows of `window` tokens (True).
        window: the local window (16).
        rank: columns of `G` (20, as kvpress).

    Shapes: keys `[B, H, T, D]`, values `[B, H, T, Dv]` -> `[B, H, T]`.
    """

    def __init__(self, sinks: int = 4, kind: Literal["key", "value", "kv_avg", "kv_product"] = "kv_product",
                 random_projection: bool = False, local: bool = True, window: int = 16, rank: int = 20):
        if kind not in _KINDS:
            raise KVComposeError(f"CUR: kind must be one of {_KINDS}, got {kind!r}")
        for name, v, lo in (("sinks", sinks, 0), ("window", window, 1), ("rank", rank, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise KVComposeError(f"CUR: {name} must be an int >= {lo}, got {v!r}")
        self.sinks, self.kind, self.random_projection = sinks, kind, bool(random_projection)
        self.local, self.window, self.rank = bool(local), window, rank

    @property
    def draws_random(self) -> bool:  # type: ignore[override]
        """True with `random_projection` (a fresh Gaussian `G` from the layer's generator at every event)."""
        return self.random_projection

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        keys, values, valid = view.keys.float(), view.values.float(), view.valid
        if self.random_projection:
            gen = view.generator
            d = keys.shape[-1]
            g = torch.randn(d, self.rank, generator=gen, device=gen.device if gen is not None else view.device)
            g = g.to(view.device) / math.sqrt(self.rank)
            keys, values = keys @ g, values @ g[: values.shape[-1]]
        m = valid.float()
        k2 = (keys**2).sum(-1) * m
        v2 = (values**2).sum(-1) * m
        if self.local:
            b, h, t = valid.shape
            win = real_rank(valid) // self.window
            win = torch.where(valid, win, torch.full_like(win, t))  # padding: a bucket of its own
            tot_k = torch.zeros(b, h, t + 1, device=view.device).scatter_add(2, win, k2).gather(2, win)
            tot_v = torch.zeros(b, h, t + 1, device=view.device).scatter_add(2, win, v2).gather(2, win)
            k2, v2 = k2 / tot_k, v2 / tot_v
        if self.kind == "key":
            s = k2
        elif self.kind == "value":
            s = v2
        elif self.kind == "kv_avg":
            s = (k2 + v2) / 2
        else:
            s = k2 * v2
        s = s.masked_fill(~valid, 0.0)
        s = s / s.sum(-1, keepdim=True)
        s = torch.where(first_real(valid, self.sinks), torch.ones_like(s), s)
        return s.masked_fill(~valid, 0.0)

    def __repr__(self) -> str:
        return (f"CUR(sinks={self.sinks}, kind={self.kind!r}, random_projection={self.random_projection}, "
                f"local={self.local}, window={self.window})")
