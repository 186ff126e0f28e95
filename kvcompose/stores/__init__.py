"""Layer storage layouts behind one protocol (`KVStore`): `DenseStore` (one length per layer) and
`PagedStore` (a length per (row, KV head), pages from a `PagePool`). Each store attends over its own layout.
Stores import nothing from blocks, the pipeline, the layer core or the cache."""

from .base import FAR_POSITION, KVStore, StoreView
from .dense import DenseStore
from .paged import PagedStore
from .pool import POOL_GROWTH, POOL_SLACK, PagePool

__all__ = ["KVStore", "StoreView", "DenseStore", "PagedStore", "PagePool", "FAR_POSITION", "POOL_SLACK",
           "POOL_GROWTH"]
