"""Layer storage layouts behind one protocol (`KVStore`): `DenseStore` (one length per layer) and
`PagedStore` (a length per (row, KV head), pages from a pool). Stores import nothing from blocks, the
pipeline, the layer core or the cache."""

from .base import FAR_POSITION, KVStore, StoreView
from .dense import DenseStore
from .paged import POOL_SLACK, PagePool, PagedStore

__all__ = ["KVStore", "StoreView", "DenseStore", "PagedStore", "PagePool", "FAR_POSITION", "POOL_SLACK"]
