"""`PagePool`: one layer's fixed-size KV pages on the device, with their bookkeeping on the host.

```
PagePool
  keys      [n_pages, P, D]      device
  values    [n_pages, P, Dv]     device
  positions [n_pages, P]         device (original index of every slot)
  valid     [n_pages, P]         device (False = padding)
  channels  [n_pages, P, C]      device, float32 (token-aligned block state)
  free      host stack of free page ids (LIFO: a returned page is the next one handed out)
```

Which page is free, handed out or returned is host state: handing out and returning pages never waits for
the device. Between compression events the pool grows on demand, geometrically (`growth`, 1.5x, at least
what is needed), so appending N tokens copies it O(log N) times, never once per page. At an event the store
sizes it once (`fit` to shrink and defragment, `ensure` to grow) to the pages its heads hold plus room for
the tokens they append until the next event, so a layer at its steady state reallocates its pool neither
between events nor at them.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..view import KVComposeError

__all__ = ["PagePool", "POOL_SLACK", "POOL_GROWTH"]

POOL_SLACK = 1 / 32
"""A pool is defragmented and shrunk to `(used + reserve) * (1 + POOL_SLACK / 2)` pages when it holds more than
`(used + reserve) * (1 + POOL_SLACK)`."""

POOL_GROWTH = 1.5
"""A pool whose free stack runs out grows to `POOL_GROWTH` times its size (at least what is needed)."""


class PagePool:
    """A layer's pool of fixed-size KV pages with a LIFO free stack kept on the host.

    Attributes:
        keys: `[n_pages, P, D]`; values: `[n_pages, P, Dv]`; positions: Long `[n_pages, P]`;
        valid: Bool `[n_pages, P]`; channels: float32 `[n_pages, P, C]` (token-aligned block state).
        free: host list of free page ids; the last one is handed out first.
        grows, shrinks: how often the pool tensors were reallocated; handed_out, reused: pages handed out in
            total and pages handed out again after being returned.

    Args:
        page_size: tokens per page (P).
        head_dim: D, the key width.
        value_dim: Dv, the value width.
        dtype: of keys and values.
        device: of every pool tensor.
        slack: free share tolerated by `fit`, see the module docstring.
        channels: C, float32 channels per slot.
        growth: growth factor when the free stack runs out (> 1).
    """

    def __init__(self, page_size: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device | str, slack: float = POOL_SLACK, channels: int = 0,
                 growth: float = POOL_GROWTH):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise KVComposeError(f"bad page size {page_size!r}: a positive int of tokens")
        if not 0.0 <= slack < 1.0:
            raise KVComposeError(f"pool slack must be in [0, 1), got {slack}")
        if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not growth > 1.0:
            raise KVComposeError(f"pool growth must be a number > 1, got {growth!r}")
        self.page_size, self.head_dim, self.value_dim = page_size, head_dim, value_dim
        self.dtype, self.device, self.slack, self.growth = dtype, torch.device(device), slack, float(growth)
        p = page_size
        self.keys = torch.zeros(0, p, head_dim, dtype=dtype, device=self.device)
        self.values = torch.zeros(0, p, value_dim, dtype=dtype, device=self.device)
        self.positions = torch.zeros(0, p, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(0, p, dtype=torch.bool, device=self.device)
        self.channels = torch.zeros(0, p, channels, dtype=torch.float32, device=self.device)
        self.free: list[int] = []
        self._returned = np.zeros(0, dtype=bool)  # page was returned at least once
        self._flat: dict[str, Tensor] | None = None
        self.grows = self.shrinks = self.handed_out = self.reused = 0

    # -- sizes ----------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Pages allocated (used + free)."""
        return self.keys.shape[0]

    @property
    def n_free(self) -> int:
        return len(self.free)

    @property
    def n_used(self) -> int:
        return self.capacity - self.n_free

    def bytes_per_page(self) -> int:
        return self.page_size * (self.head_dim + self.value_dim) * self.keys.element_size()

    def nbytes(self) -> int:
        """Bytes of the K/V page tensors (what `MemoryReport.allocated` counts; metadata excluded)."""
        return self.capacity * self.bytes_per_page()

    def meta_nbytes(self) -> int:
        """Bytes of positions, validity and block state per slot (not K/V)."""
        return self.positions.nbytes + self.valid.nbytes + self.channels.nbytes

    def tensors(self) -> dict[str, Tensor]:
        """Every per-slot tensor of the pool, by name (keys, values, positions, valid, channels)."""
        return {"keys": self.keys, "values": self.values, "positions": self.positions, "valid": self.valid,
                "channels": self.channels}

    def flat(self) -> dict[str, Tensor]:
        """The same tensors viewed with one slot axis (`[n_pages * P, ...]`, views: writes land in the pool),
        kept until the pool is reallocated."""
        if self._flat is None:
            self._flat = {k: t.view(t.shape[0] * t.shape[1], *t.shape[2:]) for k, t in self.tensors().items()}
        return self._flat

    # -- pages ----------------------------------------------------------------------------------------
    def _reallocate(self, capacity: int, keep: np.ndarray | None = None) -> None:
        """New tensors of `capacity` pages holding the old pages `keep` (host ids; default: the first
        min(capacity, old) ones) at ids 0..len(keep)-1."""
        self._flat = None
        idx = None if keep is None or not len(keep) else torch.from_numpy(np.ascontiguousarray(keep, dtype=np.int64)).to(
            self.device, non_blocking=True)
        for name, t in self.tensors().items():
            new = t.new_zeros((capacity, *t.shape[1:]))
            if keep is None:
                n = min(capacity, t.shape[0])
                new[:n] = t[:n]
            elif idx is not None:
                new[: len(keep)] = t.index_select(0, idx)
            setattr(self, name, new)
        ret = np.zeros(capacity, dtype=bool)
        if keep is None:
            n = min(capacity, len(self._returned))
            ret[:n] = self._returned[:n]
        elif len(keep):
            ret[: len(keep)] = self._returned[keep]
        self._returned = ret

    def alloc(self, n: int) -> np.ndarray:
        """Hand out `n` page ids (host int64; most recently returned first); grows the pool (geometrically)
        if the stack is short."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        if n > self.n_free:
            old = self.capacity
            new = max(old + n - self.n_free, math.ceil(old * self.growth))
            self._reallocate(new)
            self.free = list(range(new - 1, old - 1, -1)) + self.free  # lower ids on top of the fresh ones
            self.grows += 1
        ids = np.array(self.free[self.n_free - n:][::-1], dtype=np.int64)
        del self.free[self.n_free - n:]
        self.handed_out += n
        self.reused += int(self._returned[ids].sum())
        return ids

    def ensure(self, pages: int) -> None:
        """Grow the pool to exactly `pages` pages now if it is smaller (one reallocation at a compression
        event: room for the tokens a layer appends until its next one)."""
        if pages > self.capacity:
            old = self.capacity
            self._reallocate(pages)
            self.free = list(range(pages - 1, old - 1, -1)) + self.free
            self.grows += 1

    def release(self, ids) -> None:
        """Return pages (host ids, or a tensor of ids) to the free stack (they are the next ones handed out)."""
        ids = np.asarray(ids.cpu() if isinstance(ids, Tensor) else ids, dtype=np.int64).reshape(-1)
        if len(ids):
            self._returned[ids] = True
            self.free.extend(ids.tolist())

    def fit(self, table: np.ndarray, reserve: int = 0) -> np.ndarray | None:
        """If more than `ceil(base * (1 + slack))` pages are allocated (`base` = pages in use, or `reserve`, the
        pages a layer needs until its next event, if more), move the used pages to the front (renumbering them
        in the host page `table [B, H, M]`) and reallocate the pool at `ceil(base * (1 + slack / 2))` pages;
        the free pages kept count as returned ones (reused memory). Returns the renumbered table, or None when
        nothing moved."""
        used = self.n_used
        base = max(used, reserve)
        if self.capacity <= math.ceil(base * (1 + self.slack)):
            return None
        target = max(math.ceil(base * (1 + self.slack / 2)), used)
        has = table >= 0
        old_ids = table[has]
        if old_ids.size != used:  # pragma: no cover - an internal invariant
            raise KVComposeError(f"page pool out of step: {old_ids.size} pages in tables, {used} in use")
        new_table = np.full_like(table, -1)
        new_table[has] = np.arange(used, dtype=np.int64)
        self._reallocate(target, keep=old_ids)
        self.free = list(range(target - 1, used - 1, -1))
        self._returned[used:] = True
        self.shrinks += 1
        return new_table

    def __repr__(self) -> str:
        return f"PagePool(pages={self.n_used}/{self.capacity}, P={self.page_size})"

