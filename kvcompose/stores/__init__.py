"""Layer storage layouts behind one protocol (`KVStore`): `DenseStore` (one length per layer) and
`PagedStore` (a length per (row, KV head), pages from a `PagePool`). Each store attends over its own layout.
Stores import nothing from blocks, the pipeline, the layer core or the cache."""

import torch

from .base import FAR_POSITION, KVStore, StoreView
from .dense import DenseStore
from .paged import PagedStore
from .pool import POOL_GROWTH, POOL_SLACK, PagePool

__all__ = ["KVStore", "StoreView", "DenseStore", "PagedStore", "PagePool", "FAR_POSITION", "POOL_SLACK",
           "POOL_GROWTH", "make_store"]


def make_store(paged: bool, batch: int, heads: int, head_dim: int, value_dim: int, dtype: torch.dtype,
               device: torch.device, *, channels: int = 0, page_size: int = 16, target: int = 0,
               reserve: bool = False) -> KVStore:
    """A store for one layer segment: `PagedStore` (a length per (row, KV head), pages of `page_size`) when
    `paged`, else `DenseStore` (one length; buffers grow up to `target` slots, all at once with `reserve`)."""
    if paged:
        return PagedStore(batch, heads, head_dim, value_dim, dtype, device, page_size=page_size, channels=channels)
    return DenseStore(batch, heads, head_dim, value_dim, dtype, device, channels=channels, target=target,
                      reserve=reserve)
