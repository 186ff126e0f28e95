"""What a layer of kvcompose's one core owns, per segment and per cache: `Segment` (one store's worth of a
layer: the whole plain cache, or one tree node), its `QueryRing`, the `CoreConfig` every layer of a cache
shares, and the `CacheStats` counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .block import EventTrigger
from .pipeline import Pipeline
from .prefetch import Prefetcher
from .stores import KVStore

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
    padding_warned: bool = False  # the pipeline's `padded_rows_note` was warned at a padded forward

    @property
    def paged(self) -> bool:
        """Per-head budgets live in paged storage; uniform ones in dense buffers."""
        return self.pipeline.paged

    @cached_property
    def trigger(self) -> bool:
        """The allocator decides when rows are compressed (`kvcompose.block.EventTrigger`, paged layouts)."""
        return self.paged and isinstance(self.pipeline.allocator, EventTrigger)


class QueryRing:
    """The last W post-RoPE queries of a segment, oldest first: `queries [B, Hq, W, D]`, `positions [W]`,
    `valid [B, W]` (fewer than W until W queries were seen; None before the first).

    A circular buffer: recording one decoded query writes one slot in place (no concatenation per step);
    reading (at a compression event or an observer) returns the queries in time order as new tensors."""

    __slots__ = ("_q", "_p", "_v", "_n", "_head")

    def __init__(self) -> None:
        self._q: Tensor | None = None  # [B, Hq, W, D]
        self._p: Tensor | None = None  # [W]
        self._v: Tensor | None = None  # [B, W]
        self._n = 0  # filled slots
        self._head = 0  # next slot to write (the oldest once full)

    def _ordered(self, t: Tensor | None, dim: int) -> Tensor | None:
        if t is None:
            return None
        w = t.shape[dim]
        if self._n < w:
            return t.narrow(dim, 0, self._n).clone()
        if self._head == 0:
            return t.clone()
        return torch.cat([t.narrow(dim, self._head, w - self._head), t.narrow(dim, 0, self._head)], dim=dim)

    @property
    def queries(self) -> Tensor | None:
        return self._ordered(self._q, 2)

    @property
    def positions(self) -> Tensor | None:
        return self._ordered(self._p, 0)

    @property
    def valid(self) -> Tensor | None:
        return self._ordered(self._v, 1)

    def _reset(self, queries: Tensor, positions: Tensor, valid: Tensor, window: int) -> None:
        """Hold exactly these (time-ordered, at most `window`) queries."""
        n = queries.shape[2]
        b, h, _, d = queries.shape
        self._q = queries.new_zeros(b, h, window, d)
        self._p = positions.new_zeros(window)
        self._v = valid.new_zeros(b, window)
        self._q[:, :, :n] = queries
        self._p[:n] = positions
        self._v[:, :n] = valid
        self._n, self._head = n, n % window

    def record(self, query: Float[Tensor, "B Hq Q D"], positions: Int[Tensor, " Q"], valid: Bool[Tensor, "B Q"],
               window: int) -> None:
        q = query.shape[2]
        buf = self._q
        if (buf is None or q != 1 or buf.shape[2] != window or buf.shape[:2] != query.shape[:2]
                or buf.dtype != query.dtype or buf.device != query.device):
            old = self.queries
            if old is not None and old.shape[:2] == query.shape[:2] and old.dtype == query.dtype:
                queries = torch.cat([old, query], dim=2)[:, :, -window:]
                positions = torch.cat([self.positions, positions])[-window:]
                valid = torch.cat([self.valid, valid], dim=1)[:, -window:]
            else:
                queries, positions, valid = query[:, :, -window:], positions[-window:], valid[:, -window:]
            self._reset(queries, positions, valid, window)
            return
        self.record_one(query, positions, valid)

    def record_one(self, query: Float[Tensor, "B Hq 1 D"], position: Int[Tensor, " 1"] | int,
                   valid: Bool[Tensor, "B 1"] | None) -> None:
        """Write one decoded query into the next slot (the buffer must exist: see `ready`)."""
        h = self._head
        self._q[:, :, h] = query[:, :, 0]
        self._p[h] = position if isinstance(position, int) else position[0]
        if valid is None:
            self._v[:, h] = True
        else:
            self._v[:, h] = valid[:, 0]
        w = self._q.shape[2]
        self._head = (h + 1) % w
        self._n = min(self._n + 1, w)

    def ready(self, query: Tensor, window: int) -> bool:
        """True when `record_one` can take this query (a buffer of this window, rows, heads and dtype)."""
        buf = self._q
        return (buf is not None and buf.shape[2] == window and buf.shape[:2] == query.shape[:2]
                and buf.dtype == query.dtype and buf.device == query.device)

    def crop(self, end: int) -> None:
        """Forget queries at positions `>= end`."""
        if self._q is not None:
            pos = self.positions
            keep = pos < end
            if bool(keep.all()):
                return
            self._reset(self.queries[:, :, keep], pos[keep], self.valid[:, keep], self._q.shape[2])

    def map_rows(self, fn) -> None:
        """Apply a batch-row operation (beam reordering, row selection) to the queries and their validity."""
        if self._q is not None:
            self._q, self._v = fn(self._q), fn(self._v)


class Segment:
    """One store's worth of a layer: a whole plain cache, or one node of a search tree.

    Attributes:
        start: position of its first token; n: tokens written into it (held or not).
        store: the `KVStore` (None until the first token); tier: the tier store's state; blocks: the
        pipeline's state (one entry per leaf); ring: its query ring; events: compression events run on it;
        limits: `[B, H]` per-head token limits (paged layouts).
    """

    __slots__ = ("start", "n", "store", "tier", "blocks", "ring", "events", "_limits", "host_limits")

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.n = 0
        self.store: KVStore | None = None
        self.tier: Any = None
        self.blocks: tuple | None = None
        self.ring = QueryRing()
        self.events = 0
        self._limits: Tensor | None = None
        self.host_limits: np.ndarray | None = None  # the same limits on the host (set with `limits`)

    @property
    def limits(self) -> Tensor | None:
        """`[B, H]` per-head token limits of the last event (paged layouts), mirrored in `host_limits`."""
        return self._limits

    @limits.setter
    def limits(self, value: Tensor | None) -> None:  # batch operations: one host sync
        self._limits = value
        self.host_limits = None if value is None else value.cpu().numpy().astype(np.int64)

    def set_limits(self, value: Tensor, host: np.ndarray) -> None:
        """Set the limits with their host copy (the caller has it: no host sync)."""
        self._limits = value
        self.host_limits = np.asarray(host, dtype=np.int64)

    def held(self) -> int:
        return 0 if self.store is None else self.store.held
