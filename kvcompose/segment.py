"""What a layer of kvcompose's one core owns, per segment and per cache: `Segment` (one store's worth of a
layer: the whole plain cache, or one tree node), its `QueryRing`, the `CoreConfig` every layer of a cache
shares, and the `CacheStats` counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .block import EventTrigger
from .pipeline import Pipeline
from .prefetch import Prefetcher
from .stores import DenseStore, PagedStore

__all__ = ["CacheStats", "CoreConfig", "QueryRing", "Segment"]


@dataclass
class CacheStats:
    """Counters of a cache's compression events: wall time spent in them and how many ran (all layers).

    With `sync=True` the device is synchronised around each event (exact on CUDA, slower)."""

    compress_seconds: float = 0.0
    compress_calls: int = 0
    sync: bool = False


@dataclass
class CoreConfig:
    """What every layer of one cache shares (built by the cache).

    Attributes:
        pipeline: the compression method. budget: the cache's token budget (None: the allocator's own).
        interval: decoded tokens between compression events. compress_prefill: compress right after prefill.
        seed: seeds each layer's generator (`seed * 1_000_003 + layer_idx`). num_layers: decoder layers.
        prefetcher: brings tier tokens back. stats: event counters. reserve: allocate fixed-capacity buffers.
        observe: run the pipeline's observers at every attention call (off when nothing will be compressed).
    """

    pipeline: Pipeline
    budget: int | None
    interval: int
    num_layers: int
    compress_prefill: bool = False
    seed: int = 0
    prefetcher: Prefetcher = field(default_factory=Prefetcher)
    stats: CacheStats = field(default_factory=CacheStats)
    reserve: bool = False
    observe: bool = True
    step_padding: tuple | None = None  # (key of a forward's 2-D mask, whether its new tokens include padding)

    @property
    def paged(self) -> bool:
        """Per-head budgets live in paged storage; uniform ones in dense buffers."""
        return self.pipeline.paged

    @cached_property
    def trigger(self) -> bool:
        """The allocator decides when rows are compressed (`kvcompose.block.EventTrigger`, paged layouts)."""
        return self.paged and isinstance(self.pipeline.allocator, EventTrigger)


class QueryRing:
    """The last W post-RoPE queries of a segment: `queries [B, Hq, W, D]`, `positions [W]`, `valid [B, W]`."""

    __slots__ = ("queries", "positions", "valid")

    def __init__(self) -> None:
        self.queries: Tensor | None = None
        self.positions: Tensor | None = None
        self.valid: Tensor | None = None

    def record(self, query: Float[Tensor, "B Hq Q D"], positions: Int[Tensor, " Q"], valid: Bool[Tensor, "B Q"],
               window: int) -> None:
        if self.queries is None:
            self.queries, self.positions, self.valid = query[:, :, -window:], positions[-window:], valid[:, -window:]
        else:
            self.queries = torch.cat([self.queries, query], dim=2)[:, :, -window:]
            self.positions = torch.cat([self.positions, positions])[-window:]
            self.valid = torch.cat([self.valid, valid], dim=1)[:, -window:]

    def crop(self, end: int) -> None:
        """Forget queries at positions `>= end`."""
        if self.positions is not None:
            keep = self.positions < end
            self.queries, self.positions, self.valid = self.queries[:, :, keep], self.positions[keep], self.valid[:, keep]

    def map_rows(self, fn) -> None:
        if self.queries is not None:
            self.queries, self.valid = fn(self.queries), fn(self.valid)


class Segment:
    """One store's worth of a layer: a whole plain cache, or one node of a search tree.

    Attributes:
        start: position of its first token; n: tokens written into it (held or not).
        store: the `KVStore` (None until the first token); tier: the tier store's state; blocks: the
        pipeline's state (one entry per leaf); ring: its query ring; events: compression events run on it;
        limits: `[B, H]` per-head token limits (paged layouts).
    """

    __slots__ = ("start", "n", "store", "tier", "blocks", "ring", "events", "limits")

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.n = 0
        self.store: DenseStore | PagedStore | None = None
        self.tier: Any = None
        self.blocks: tuple | None = None
        self.ring = QueryRing()
        self.events = 0
        self.limits: Tensor | None = None

    def held(self) -> int:
        return 0 if self.store is None else self.store.held
