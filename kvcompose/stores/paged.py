"""`PagedStore`: ragged storage, a length per (row, KV head), with memory that follows their sum.

With per-head (ReasonAlloc's head utility) or per-request (GrowPage) budgets, a dense `[B, H, T, D]` buffer
must be as long as the *largest* head; masking the rest (what kvpress does) frees nothing. Here every store
owns a `PagePool` of fixed-size pages and every (row, KV head) a page table:

```
PagePool                                     PagedStore
  keys      [n_pages, P, D]                    page_table [B, H, M]   page ids, -1 = none
  values    [n_pages, P, Dv]                   lengths    [B, H]      tokens held by each (row, head)
  positions [n_pages, P] (original index)    logical token t of (b, h) lives in page
  valid     [n_pages, P] (False = padding)     page_table[b, h, t // P], slot t % P
  channels  [n_pages, P, C] float32 (token-aligned block state)
  free      stack of free page ids (LIFO: a returned page is the next one handed out)
```

- Append: every head writes its new tokens after its own length; a head that crosses a page boundary takes
  a page from the free stack. The pool grows (one copy) only when the stack is empty, by
  `max(needed, slack * capacity)` pages.
- Compaction: each head's kept tokens move to the front of its own pages (gather, then scatter: a copy, so
  overlapping moves are safe); pages past the new length go back to the free stack; when more than
  `ceil(used * (1 + slack))` pages are allocated, the pool is defragmented (used pages renumbered to the
  front) and reallocated at `ceil(used * (1 + slack / 2))` pages, which is what really frees memory. So
  after every compaction `allocated <= ceil((1 + slack) * used pages)` and `used pages * P <= held + P - 1`
  per head (slack = 1/32).
- Reading: `view()` gathers each head's tokens into a transient padded `[B, H, Tmax, D]` view (memoised until
  the next change); the stored memory stays paged. On CUDA the Triton paged decode kernel reads the pages
  directly (`kvcompose.kernels.paged_decode_attention`, driven by the layer core).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..view import KVComposeError
from .base import FAR_POSITION, StoreView

__all__ = ["PagePool", "PagedStore", "POOL_SLACK"]

POOL_SLACK = 1 / 32
"""A pool grows by this share of its size (at least what is needed) when its free stack runs out, and is
defragmented and shrunk to `used * (1 + POOL_SLACK / 2)` pages when more than this share of it is free."""


class PagePool:
    """A layer's pool of fixed-size KV pages with a LIFO free stack.

    Attributes:
        keys: `[n_pages, P, D]`; values: `[n_pages, P, Dv]`; positions: Long `[n_pages, P]`;
        valid: Bool `[n_pages, P]`; channels: float32 `[n_pages, P, C]` (token-aligned block state).
        free: Long `[n_free]` free page ids; the last one is handed out first.
        grows, shrinks: how often the pool tensors were reallocated; handed_out, reused: pages handed out in
            total and pages handed out again after being returned.

    Args:
        page_size: tokens per page (P).
        head_dim: D, the key width.
        value_dim: Dv, the value width.
        dtype: of keys and values.
        device: of every pool tensor.
        slack: free share tolerated (and growth step), see the module docstring.
    """

    def __init__(self, page_size: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device | str, slack: float = POOL_SLACK, channels: int = 0):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise KVComposeError(f"bad page size {page_size!r}: a positive int of tokens")
        if not 0.0 <= slack < 1.0:
            raise KVComposeError(f"pool slack must be in [0, 1), got {slack}")
        self.page_size, self.head_dim, self.value_dim = page_size, head_dim, value_dim
        self.dtype, self.device, self.slack = dtype, torch.device(device), slack
        p = page_size
        self.keys = torch.zeros(0, p, head_dim, dtype=dtype, device=self.device)
        self.values = torch.zeros(0, p, value_dim, dtype=dtype, device=self.device)
        self.positions = torch.zeros(0, p, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(0, p, dtype=torch.bool, device=self.device)
        self.channels = torch.zeros(0, p, channels, dtype=torch.float32, device=self.device)
        self.free = torch.zeros(0, dtype=torch.long, device=self.device)
        self._returned = torch.zeros(0, dtype=torch.bool, device=self.device)  # page was returned at least once
        self.grows = self.shrinks = self.handed_out = self.reused = 0

    # -- sizes ----------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Pages allocated (used + free)."""
        return self.keys.shape[0]

    @property
    def n_free(self) -> int:
        return self.free.shape[0]

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

    # -- pages ----------------------------------------------------------------------------------------
    def _reallocate(self, capacity: int, keep: Int[Tensor, " N"] | None = None) -> None:
        """New tensors of `capacity` pages holding the old pages `keep` (default: the first min(cap) ones)
        at ids 0..len(keep)-1."""
        for name, t in self.tensors().items():
            new = t.new_zeros((capacity, *t.shape[1:]))
            if keep is None:
                n = min(capacity, t.shape[0])
                new[:n] = t[:n]
            elif keep.numel():
                new[: keep.numel()] = t[keep]
            setattr(self, name, new)
        ret = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        if keep is None:
            n = min(capacity, self._returned.shape[0])
            ret[:n] = self._returned[:n]
        elif keep.numel():
            ret[: keep.numel()] = self._returned[keep]
        self._returned = ret

    def alloc(self, n: int) -> Int[Tensor, " n"]:
        """Hand out `n` page ids (most recently returned first); grows the pool if the stack is short."""
        if n <= 0:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        if n > self.n_free:
            old = self.capacity
            new = old + max(n - self.n_free, math.ceil(self.slack * old), 1)
            self._reallocate(new)
            fresh = torch.arange(new - 1, old - 1, -1, device=self.device)  # lower ids on top of the stack
            self.free = torch.cat([fresh, self.free])
            self.grows += 1
        ids = self.free[self.n_free - n:].flip(0)
        self.free = self.free[: self.n_free - n]
        self.handed_out += n
        self.reused += int(self._returned[ids].sum())
        return ids

    def release(self, ids: Int[Tensor, " n"]) -> None:
        """Return pages to the free stack (they are the next ones handed out)."""
        if ids.numel():
            self._returned[ids] = True
            self.free = torch.cat([self.free, ids])

    def fit(self, page_table: Int[Tensor, "B H M"]) -> Int[Tensor, "B H M"]:
        """If more than `ceil(used * (1 + slack))` pages are allocated, move the used pages to the front
        (renumbering them in `page_table`) and reallocate the pool at `ceil(used * (1 + slack / 2))` pages; the
        free pages kept count as returned ones (reused memory). Returns the page table."""
        used = self.n_used
        if self.capacity <= math.ceil(used * (1 + self.slack)):
            return page_table
        target = math.ceil(used * (1 + self.slack / 2))
        has = page_table >= 0
        old_ids = page_table[has]
        if old_ids.numel() != used:  # pragma: no cover - an internal invariant
            raise KVComposeError(f"page pool out of step: {old_ids.numel()} pages in tables, {used} in use")
        new_table = torch.full_like(page_table, -1)
        new_table[has] = torch.arange(used, device=self.device)
        self._reallocate(target, keep=old_ids)
        self.free = torch.arange(target - 1, used - 1, -1, device=self.device)
        self._returned[used:] = True
        self.shrinks += 1
        return new_table


class PagedStore:
    """Ragged KV storage of one layer: a `PagePool` plus a page table and a length per (row, KV head).

    Attributes:
        pool: the store's `PagePool`.
        page_table: Long `[B, H, M]` page ids of each (row, head), -1 where none; M = most pages of any head.
        lengths: Long `[B, H]` tokens held by each (row, head). Logical token `t < lengths[b, h]` is at
            `page_table[b, h, t // P] * P + t % P` of the pool's flattened slot axis.

    Args:
        batch: B rows.
        heads: H KV heads.
        head_dim: D, the key width.
        value_dim: Dv, the value width.
        dtype: of keys and values.
        device: of keys and values (every other tensor lives on the same device).
        page_size: tokens per page (P, default 16).
        channels: C, float32 channels of token-aligned block state.
        slack: the pool's tolerated free share.
    """

    def __init__(self, batch: int, heads: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device | str, page_size: int = 16, channels: int = 0, slack: float = POOL_SLACK):
        self.pool = PagePool(page_size, head_dim, value_dim, dtype, device, slack, channels)
        self.batch, self.heads, self.channels = batch, heads, channels
        self.head_dim, self.value_dim, self.dtype = head_dim, value_dim, dtype
        self.page_table = torch.full((batch, heads, 0), -1, dtype=torch.long, device=self.pool.device)
        self._lengths = torch.zeros(batch, heads, dtype=torch.long, device=self.pool.device)
        self._padding = False
        self._dirty()

    # -- sizes ----------------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def lengths(self) -> Int[Tensor, "B H"]:
        return self._lengths

    @property
    def held(self) -> int:
        if self._held is None:
            self._held = int(self._lengths.max()) if self._lengths.numel() else 0
        return self._held

    @property
    def ragged(self) -> bool:
        if self._ragged is None:
            n = self._lengths
            self._ragged = self._padding or (n.numel() > 0 and int(n.min()) != int(n.max()))
        return self._ragged

    def _dirty(self) -> None:
        self._view: StoreView | None = None
        self._held: int | None = None
        self._ragged: bool | None = None

    def held_tokens(self) -> int:
        """Tokens held, summed over rows and heads."""
        return int(self._lengths.sum())

    def pages_per_head(self) -> Int[Tensor, "B H"]:
        return (self.page_table >= 0).sum(-1)

    def nbytes(self) -> int:
        """`sum(lengths) * (D + Dv) * itemsize`: the K/V of the tokens held."""
        return self.held_tokens() * (self.head_dim + self.value_dim) * self.pool.keys.element_size()

    def allocated_bytes(self) -> int:
        """Bytes of the K/V page pool (used and free pages)."""
        return self.pool.nbytes()

    # -- addressing -----------------------------------------------------------------------------------
    def slots(self, idx: Int[Tensor, "B H K"]) -> tuple[Int[Tensor, "B H K"], Bool[Tensor, "B H K"]]:
        """Flat pool slots of logical indices `idx` (and which of them are held: `0 <= idx < length`)."""
        p = self.page_size
        inside = (idx >= 0) & (idx < self._lengths[..., None])
        safe = torch.where(inside, idx, torch.zeros_like(idx))
        if self.page_table.shape[-1] == 0:
            return torch.zeros_like(idx), inside
        page = self.page_table.gather(-1, (safe // p).clamp(max=self.page_table.shape[-1] - 1))
        slot = page * p + safe % p
        return torch.where(inside & (page >= 0), slot, torch.zeros_like(slot)), inside

    @staticmethod
    def _flat(t: Tensor) -> Tensor:
        return t.view(t.shape[0] * t.shape[1], *t.shape[2:])

    def _ensure_pages(self, new_lengths: Int[Tensor, "B H"]) -> None:
        """Give every (row, head) enough pages for `new_lengths` tokens."""
        p = self.page_size
        have = self.pages_per_head()
        need = (new_lengths + p - 1) // p
        add = (need - have).clamp(min=0)
        total = int(add.sum())
        if total == 0:
            return
        m = int(need.max())
        if m > self.page_table.shape[-1]:
            pad = torch.full((self.batch, self.heads, m - self.page_table.shape[-1]), -1, dtype=torch.long,
                             device=self.device)
            self.page_table = torch.cat([self.page_table, pad], dim=-1)
        col = torch.arange(self.page_table.shape[-1], device=self.device)
        where = (col >= have[..., None]) & (col < (have + add)[..., None])
        self.page_table[where] = self.pool.alloc(total)

    def _write(self, idx: Int[Tensor, "B H Q"], data: dict[str, Tensor]) -> None:
        """Write `data[name]` (`[B, H, Q, ...]`) at logical indices `idx` (all `< lengths`)."""
        slot, inside = self.slots(idx)
        s = slot[inside]
        tensors = self.pool.tensors()
        for name, x in data.items():
            flat = self._flat(tensors[name])
            flat[s] = x[inside].to(flat.dtype)

    def _release_past(self, lengths: Int[Tensor, "B H"]) -> None:
        """Return the pages past `lengths` to the pool and defragment it if too much of it is free."""
        p = self.page_size
        keep_pages = (lengths + p - 1) // p
        col = torch.arange(self.page_table.shape[-1], device=self.device)
        drop = (col >= keep_pages[..., None]) & (self.page_table >= 0)
        self.pool.release(self.page_table[drop])
        self.page_table = self.page_table.masked_fill(drop, -1)
        self.page_table = self.page_table[..., : int(keep_pages.max()) if keep_pages.numel() else 0].contiguous()
        self.page_table = self.pool.fit(self.page_table)

    # -- reading --------------------------------------------------------------------------------------
    def view(self) -> StoreView:
        """A transient padded view, `T = max length`; slots past a head's length hold zeros, position
        `FAR_POSITION + t` and valid False. Memoised until the next change."""
        if self._view is None:
            t = self.held
            idx = torch.arange(t, device=self.device).expand(self.batch, self.heads, t)
            slot, inside = self.slots(idx)
            s = slot.reshape(-1)
            zero = torch.zeros((), dtype=self.pool.keys.dtype, device=self.device)
            b, h = self.batch, self.heads
            k = torch.where(inside[..., None], self._flat(self.pool.keys)[s].view(b, h, t, -1), zero)
            v = torch.where(inside[..., None], self._flat(self.pool.values)[s].view(b, h, t, -1), zero)
            pos = torch.where(inside, self._flat(self.pool.positions)[s].view(b, h, t), FAR_POSITION + idx)
            valid = inside & self._flat(self.pool.valid)[s].view(b, h, t)
            self._view = StoreView(k, v, pos, valid)
        return self._view

    def read_channels(self) -> Float[Tensor, "B H T C"]:
        t = self.held
        if not self.channels:
            return torch.zeros(self.batch, self.heads, t, 0, device=self.device)
        idx = torch.arange(t, device=self.device).expand(self.batch, self.heads, t)
        slot, inside = self.slots(idx)
        x = self._flat(self.pool.channels)[slot.reshape(-1)].view(self.batch, self.heads, t, self.channels)
        return torch.where(inside[..., None], x, torch.zeros_like(x))

    def write_channels(self, x: Float[Tensor, "B H T C"]) -> None:
        idx = torch.arange(x.shape[2], device=self.device).expand(self.batch, self.heads, x.shape[2])
        self._write(idx, {"channels": x})

    # -- mutation -------------------------------------------------------------------------------------
    def append(self, keys: Float[Tensor, "B H Q D"], values: Float[Tensor, "B H Q Dv"],
               positions: Int[Tensor, " Q"], valid: Bool[Tensor, "B Q"] | None = None) -> None:
        b, h, q, _ = keys.shape
        if (b, h) != (self.batch, self.heads):
            raise KVComposeError(f"append: got {b} rows x {h} heads, the store holds {self.batch} x {self.heads}")
        start = self._lengths
        self._ensure_pages(start + q)
        self._lengths = start + q
        idx = start[..., None] + torch.arange(q, device=self.device)
        ok = torch.ones(b, q, dtype=torch.bool, device=self.device) if valid is None else valid
        data = {"keys": keys, "values": values, "positions": positions.to(self.device).expand(b, h, q),
                "valid": ok[:, None, :].expand(b, h, q)}
        if self.channels:
            data["channels"] = torch.zeros(b, h, q, self.channels, device=self.device)
        self._write(idx, data)
        self._padding = self._padding or (valid is not None and not bool(valid.all()))
        self._dirty()

    def set_tail_valid(self, valid: Bool[Tensor, "B Q"]) -> None:
        b, q = valid.shape
        idx = self._lengths[..., None] - q + torch.arange(q, device=self.device)
        self._write(idx, {"valid": valid[:, None, :].expand(b, self.heads, q)})
        self._padding = self._padding or not bool(valid.all())
        self._dirty()

    def compact(self, kept: Int[Tensor, "B H K"]) -> None:
        """Keep, per (row, head), the logical indices `kept` (ascending; -1 and indices past the head's
        length are ignored); they move to the front of the head's pages; freed pages return to the pool."""
        ok = (kept >= 0) & (kept < self._lengths[..., None])
        new_len = ok.sum(-1)
        dst_logical = ok.long().cumsum(-1) - 1
        src, _ = self.slots(torch.where(ok, kept, torch.zeros_like(kept)))
        old = self._lengths
        dst, _ = self.slots(torch.where(ok, dst_logical, torch.zeros_like(kept)))
        s, d = src[ok], dst[ok]
        for t in self.pool.tensors().values():
            flat = self._flat(t)
            flat[d] = flat[s]  # the right-hand side is a gathered copy: overlapping moves are safe
        self._lengths = torch.minimum(new_len, old)
        self._release_past(self._lengths)
        self._padding = self._padding and not bool(self.view().valid.sum(-1).eq(self._lengths).all())
        self._dirty()

    def assign(self, view: StoreView, channels: Float[Tensor, "B H T C"] | None,
               lengths: Int[Tensor, "B H"]) -> None:
        self._lengths = torch.zeros_like(self._lengths)
        self._release_past(self._lengths)
        self._ensure_pages(lengths)
        self._lengths = lengths.clone()
        t = view.keys.shape[2]
        idx = torch.arange(t, device=self.device).expand(self.batch, self.heads, t)
        data = {"keys": view.keys, "values": view.values, "positions": view.positions, "valid": view.valid}
        if self.channels and channels is not None:
            data["channels"] = channels
        self._write(idx, data)
        self._dirty()
        self._padding = not bool(self.view().valid.sum(-1).eq(self._lengths).all())
        self._dirty()

    def trim(self) -> None:
        """Free spare pages (the pool is defragmented when too much of it is free)."""
        self.page_table = self.pool.fit(self.page_table)

    def crop(self, n: int) -> None:
        if n > int(self._lengths.min()):
            raise KVComposeError(f"cannot crop {n} tokens: a head holds only {int(self._lengths.min())}")
        self._lengths = self._lengths - n
        self._release_past(self._lengths)
        self._dirty()

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> None:
        v = self.view()
        ch = self.read_channels() if self.channels else None
        lengths = fn(self._lengths)
        new = PagedStore(lengths.shape[0], self.heads, self.head_dim, self.value_dim, self.dtype, self.device,
                         self.page_size, self.channels, self.pool.slack)
        new.assign(StoreView(*(fn(x) for x in v)), None if ch is None else fn(ch), lengths)
        self.__dict__.update(new.__dict__)

    def __repr__(self) -> str:
        return f"PagedStore(held={self.held}, pages={self.pool.n_used}/{self.pool.capacity}, P={self.page_size})"
