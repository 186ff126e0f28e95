"""Ragged, paged KV storage: per-(row, KV head) kept lengths that differ, with memory that follows their sum.

Why: with per-head (HeadUtility) or per-request (GrowPage) budgets, a dense `[B, H, T, D]` buffer must be
as long as the *largest* head; masking the rest (what kvpress does) frees nothing. Here every layer owns a
`PagePool` of fixed-size pages and every (row, KV head) a page table:

```
PagePool (one per layer)                     PagedKV
  keys      [n_pages, P, D]                    page_table [B, H, M]   page ids, -1 = none
  values    [n_pages, P, Dv]                   lengths    [B, H]      tokens held by each (row, head)
  positions [n_pages, P] (original index)    logical token t of (b, h) lives in page
  valid     [n_pages, P] (False = padding)     page_table[b, h, t // P], slot t % P
  extras    name -> [n_pages, P] float32 (token-aligned block state, e.g. H2O's accumulated attention)
  free      stack of free page ids (LIFO: a returned page is the next one handed out)
```

- Append (one decoding step or a prefill): every head writes its new tokens after its own length; a head
  that crosses a page boundary takes a page from the free stack. The pool grows (one copy) only when the
  free stack is empty, by `max(needed, slack * capacity)` pages.
- Compaction (a compression event): each head's kept tokens move to the front of its own pages (gather,
  then scatter: a copy, so overlapping moves are safe); pages past the new length go back to the free stack;
  when more than `ceil(used * (1 + slack))` pages are allocated, the pool is defragmented (used pages
  renumbered to the front, page tables rewritten) and reallocated at `ceil(used * (1 + slack / 2))` pages,
  which is what really frees memory; the few free pages left are handed out first by the next appends.
  So after every compaction `allocated <= ceil((1 + slack) * used pages)`, between compactions the pool grows
  by `slack` steps, and `used pages * P <= held tokens + (P - 1)` per head (slack = 1/32).
- Attention (`ragged_attention`): on CUDA the Triton paged decode kernel
  (`kvcompose.kernels.paged_decode_attention`) reads the pages directly; on CPU the PyTorch reference gathers
  each head's tokens into a transient padded `[B, H, Tmax, D]` view with a validity mask for the attention
  call only; the stored memory stays paged. (The blocks' `LayerView` at a compression event, and the
  observers of H2O-style scorers, also see that padded view.) `kvcompose.storage.ragged_attention` is
  looked up at call time, so assigning a new function swaps it.

`RaggedLayer` is the `KVComposeLayer` that uses this storage; `KVComposeCache` builds it for every layer
when the pipeline's allocator has `uniform_per_layer = False`, and a dense layer whose selection comes
back with unequal per-head budgets moves itself onto it (`RaggedLayer.adopt`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from . import attention as _attn
from .cache import KVComposeLayer, check_incoming, timed_compress
from .pipeline import Selection
from .view import KVComposeError, LayerView

__all__ = ["PagePool", "PagedKV", "RaggedLayer", "ragged_attention", "POOL_SLACK", "FAR_POSITION"]

POOL_SLACK = 1 / 32
"""A pool grows by this share of its size (at least what is needed) when its free stack runs out, and is
defragmented and shrunk to `used * (1 + POOL_SLACK / 2)` pages when more than this share of it is free."""

FAR_POSITION = 2**40
"""Position given to the padding slots of a padded view (beyond a head's length): later than any query,
so causal masks hide them, and the positions of every row stay ascending."""


class PagePool:
    """A layer's pool of fixed-size KV pages with a LIFO free stack.

    Attributes:
        keys: `[n_pages, P, D]`; values: `[n_pages, P, Dv]`; positions: Long `[n_pages, P]`;
        valid: Bool `[n_pages, P]`; extras: name -> float32 `[n_pages, P]` (token-aligned block state).
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
                 device: torch.device | str, slack: float = POOL_SLACK):
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
        self.extras: dict[str, Tensor] = {}
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
        n = self.positions.nbytes + self.valid.nbytes
        return n + sum(x.nbytes for x in self.extras.values())

    def tensors(self) -> dict[str, Tensor]:
        """Every per-slot tensor of the pool, by name (keys, values, positions, valid, extras)."""
        out = {"keys": self.keys, "values": self.values, "positions": self.positions, "valid": self.valid}
        out.update({f"extra:{k}": v for k, v in self.extras.items()})
        return out

    def _set(self, name: str, t: Tensor) -> None:
        if name.startswith("extra:"):
            self.extras[name[6:]] = t
        else:
            setattr(self, name, t)

    def add_extra(self, name: str) -> None:
        if name not in self.extras:
            self.extras[name] = torch.zeros(self.capacity, self.page_size, dtype=torch.float32, device=self.device)

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
            self._set(name, new)
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


class PagedKV:
    """Ragged KV storage of one layer: a `PagePool` plus a page table and a length per (row, KV head).

    Attributes:
        pool: the layer's `PagePool`.
        page_table: Long `[B, H, M]` page ids of each (row, head), -1 where none; M = most pages of any head.
        lengths: Long `[B, H]` tokens held by each (row, head). Logical token `t < lengths[b, h]` is at
            `page_table[b, h, t // P] * P + t % P` of the pool's flattened slot axis.

    Args:
        batch: rows (B).
        heads: KV heads (H).
        head_dim: key width (D).
        value_dim: value width (Dv).
        dtype: of keys and values.
        device: of every tensor.
        page_size: tokens per page (P, default 16).
        slack: the pool's tolerated free share.
    """

    def __init__(self, batch: int, heads: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device | str, page_size: int = 16, slack: float = POOL_SLACK):
        self.pool = PagePool(page_size, head_dim, value_dim, dtype, device, slack)
        self.batch, self.heads = batch, heads
        self.page_table = torch.full((batch, heads, 0), -1, dtype=torch.long, device=self.pool.device)
        self.lengths = torch.zeros(batch, heads, dtype=torch.long, device=self.pool.device)

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def max_length(self) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def held_tokens(self) -> int:
        """Tokens held, summed over rows and heads."""
        return int(self.lengths.sum())

    def pages_per_head(self) -> Int[Tensor, "B H"]:
        return (self.page_table >= 0).sum(-1)

    # -- addressing -----------------------------------------------------------------------------------
    def slots(self, idx: Int[Tensor, "B H K"]) -> tuple[Int[Tensor, "B H K"], Bool[Tensor, "B H K"]]:
        """Flat pool slots of logical indices `idx` (and which of them are held: `0 <= idx < length`)."""
        p = self.page_size
        inside = (idx >= 0) & (idx < self.lengths[..., None])
        safe = torch.where(inside, idx, torch.zeros_like(idx))
        if self.page_table.shape[-1] == 0:
            return torch.zeros_like(idx), inside
        page = self.page_table.gather(-1, (safe // p).clamp(max=self.page_table.shape[-1] - 1))
        slot = page * p + safe % p
        return torch.where(inside & (page >= 0), slot, torch.zeros_like(slot)), inside

    def _flat(self, t: Tensor) -> Tensor:
        return t.view(-1, *t.shape[2:])

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

    # -- mutation -------------------------------------------------------------------------------------
    def append(self, keys: Float[Tensor, "B H Q D"], values: Float[Tensor, "B H Q Dv"],
               positions: Int[Tensor, " Q"], valid: Bool[Tensor, "B Q"] | None = None) -> None:
        """Append Q new tokens to every (row, head), each after its own length."""
        b, h, q, _ = keys.shape
        if (b, h) != (self.batch, self.heads):
            raise KVComposeError(f"append: got {b} rows x {h} heads, the storage holds {self.batch} x {self.heads}")
        start = self.lengths
        self._ensure_pages(start + q)
        self.lengths = start + q
        idx = start[..., None] + torch.arange(q, device=self.device)
        data: dict[str, Tensor] = {
            "keys": keys, "values": values,
            "positions": positions.to(self.device).expand(b, h, q),
            "valid": (torch.ones(b, q, dtype=torch.bool, device=self.device) if valid is None else valid)[:, None, :].expand(b, h, q),
        }
        for name in self.pool.extras:
            data[f"extra:{name}"] = torch.zeros(b, h, q, device=self.device)
        self._write(idx, data)

    def set_tail_valid(self, valid: Bool[Tensor, "B Q"]) -> None:
        """Set the padding flag of the newest Q tokens of every head (`valid[b, i]` for all heads of row b)."""
        b, q = valid.shape
        idx = self.lengths[..., None] - q + torch.arange(q, device=self.device)
        self._write(idx, {"valid": valid[:, None, :].expand(b, self.heads, q)})

    def compact(self, kept: Int[Tensor, "B H K"]) -> None:
        """Keep, per (row, head), the logical indices `kept` (ascending; -1 and indices past the head's
        length are ignored); they move to the front of the head's pages; freed pages return to the pool."""
        ok = (kept >= 0) & (kept < self.lengths[..., None])
        new_len = ok.sum(-1)
        dst_logical = ok.long().cumsum(-1) - 1
        src, _ = self.slots(torch.where(ok, kept, torch.zeros_like(kept)))
        old = self.lengths
        dst, _ = self.slots(torch.where(ok, dst_logical, torch.zeros_like(kept)))
        s, d = src[ok], dst[ok]
        for name, t in self.pool.tensors().items():
            flat = self._flat(t)
            flat[d] = flat[s]  # the right-hand side is a gathered copy: overlapping moves are safe
        self.lengths = torch.minimum(new_len, old)
        p = self.page_size
        keep_pages = (self.lengths + p - 1) // p
        col = torch.arange(self.page_table.shape[-1], device=self.device)
        drop = (col >= keep_pages[..., None]) & (self.page_table >= 0)
        self.pool.release(self.page_table[drop])
        self.page_table = self.page_table.masked_fill(drop, -1)
        self.page_table = self.page_table[..., : int(keep_pages.max()) if keep_pages.numel() else 0].contiguous()
        self.page_table = self.pool.fit(self.page_table)

    # -- reading --------------------------------------------------------------------------------------
    def padded(self) -> tuple[Float[Tensor, "B H T D"], Float[Tensor, "B H T Dv"], Int[Tensor, "B H T"], Bool[Tensor, "B H T"]]:
        """A transient padded view `(keys, values, positions, valid)`, `T = max length`. Slots past a head's
        length hold zeros, position `FAR_POSITION + t` and valid False."""
        t = self.max_length
        idx = torch.arange(t, device=self.device).expand(self.batch, self.heads, t)
        slot, inside = self.slots(idx)
        s = slot.reshape(-1)
        zero = torch.zeros((), dtype=self.pool.keys.dtype, device=self.device)
        k = torch.where(inside[..., None], self._flat(self.pool.keys)[s].view(self.batch, self.heads, t, -1), zero)
        v = torch.where(inside[..., None], self._flat(self.pool.values)[s].view(self.batch, self.heads, t, -1), zero)
        pos = torch.where(inside, self._flat(self.pool.positions)[s].view(self.batch, self.heads, t), FAR_POSITION + idx)
        valid = inside & self._flat(self.pool.valid)[s].view(self.batch, self.heads, t)
        return k, v, pos, valid

    def read(self, name: str) -> Float[Tensor, "B H T"]:
        """A token-aligned extra (block state) as a padded `[B, H, T]` view, zeros past each length."""
        t = self.max_length
        idx = torch.arange(t, device=self.device).expand(self.batch, self.heads, t)
        slot, inside = self.slots(idx)
        x = self._flat(self.pool.extras[name])[slot.reshape(-1)].view(self.batch, self.heads, t)
        return torch.where(inside, x, torch.zeros_like(x))

    def write(self, name: str, x: Float[Tensor, "B H T"]) -> None:
        """Write a padded `[B, H, T]` token-aligned extra back (slots past each length are ignored)."""
        self.pool.add_extra(name)
        idx = torch.arange(x.shape[-1], device=self.device).expand(self.batch, self.heads, x.shape[-1])
        self._write(idx, {f"extra:{name}": x})

    # -- whole-storage rebuilds -----------------------------------------------------------------------
    @classmethod
    def from_padded(cls, keys: Float[Tensor, "B H T D"], values: Float[Tensor, "B H T Dv"],
                    positions: Int[Tensor, "B H T"], valid: Bool[Tensor, "B H T"], lengths: Int[Tensor, "B H"],
                    extras: dict[str, Tensor] | None = None, page_size: int = 16,
                    slack: float = POOL_SLACK) -> "PagedKV":
        """Storage holding, per (row, head), the first `lengths[b, h]` tokens of a padded view."""
        b, h, t, d = keys.shape
        kv = cls(b, h, d, values.shape[-1], keys.dtype, keys.device, page_size, slack)
        for name in extras or {}:
            kv.pool.add_extra(name)
        kv._ensure_pages(lengths)
        kv.lengths = lengths.clone()
        idx = torch.arange(t, device=keys.device).expand(b, h, t)
        data = {"keys": keys, "values": values, "positions": positions, "valid": valid}
        data.update({f"extra:{k}": v for k, v in (extras or {}).items()})
        kv._write(idx, data)
        return kv


def ragged_attention(
    query: Float[Tensor, "B Hq Q D"],
    storage: PagedKV,
    query_positions: Int[Tensor, " Q"],
    scale: float,
    sliding_window: int | None = None,
    padded: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> Float[Tensor, "B Q Hq Dv"]:
    """Attention of new queries over each (row, KV head)'s own held tokens -> `[B, Q, Hq, Dv]`.

    Where the kernels' dispatch picks Triton (CUDA tensors, see `kvcompose.kernels.dispatch`), this is
    `kvcompose.kernels.paged_decode_attention` straight over the pages (`storage.pool.keys/values`
    `[n_pages, P, D]`, `storage.pool.positions/valid` `[n_pages, P]`, `storage.page_table` `[B, H, M]`,
    `storage.lengths` `[B, H]`): no padded copy at all. Otherwise (CPU) the PyTorch reference: the heads'
    pages gathered into a transient padded `[B, H, Tmax, D]` view (`padded`, when the caller already has it),
    masked per head (original positions, padding, slots past each head's length) and SDPA with the query
    group folded (no `repeat_kv`). The stored KV stays paged either way.
    """
    from .kernels import paged_decode_attention, select_backend

    pool = storage.pool
    if select_backend(query, pool.keys) == "triton":
        return paged_decode_attention(query, pool.keys, pool.values, pool.positions, pool.valid, storage.page_table,
                                      storage.lengths, query_positions, float(scale), sliding_window,
                                      check_indices=False)
    keys, values, pos, valid = padded if padded is not None else storage.padded()
    mask = _attn.build_mask(pos, valid, query_positions, sliding_window)
    return _attn.attend(query, keys, values, mask, scale)


class RaggedLayer(KVComposeLayer):
    """A decoder layer's cache on ragged paged storage (`PagedKV`): per-(row, KV head) kept lengths differ.

    Same API as `KVComposeLayer` (update / attend / compress / the transformers Cache methods). `keys`,
    `values`, `positions`, `valid` are a transient padded view of width `held = max length` (memoised until
    the next change); slots past a head's length are invalid. Schedule: at every `interval`-th decoded token,
    the rows in which some head holds more real tokens than its limit (its budget at the last event, or
    `allocator.initial_limits` before the first one) are compressed; other rows keep everything.

    Not supported on ragged storage (clear `KVComposeError`): tier stores that hold tokens (host /
    compressed tiers).
    """

    @classmethod
    def for_pipeline(cls, pipeline) -> type["RaggedLayer"]:
        """The layer class for a pipeline with per-head budgets (refuses tiers that hold tokens)."""
        if pipeline.tier.holds_tokens:
            raise KVComposeError(
                f"{pipeline.allocator!r} needs ragged (per-head) storage, which does not support tier stores "
                f"that keep tokens outside HBM ({pipeline.tier!r}) yet: use a per-layer allocator or plain eviction"
            )
        return cls

    # -- storage --------------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.kv: PagedKV | None = None
        self.limits: Tensor | None = None
        self.alloc_state: dict[str, Any] = {}
        self._padded: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        self._active: Tensor | None = None

    def _dirty(self) -> None:
        self._padded = None
        self.held = self.kv.max_length if self.kv is not None else 0

    def _view_tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if self._padded is None:
            self._padded = self.kv.padded()
        return self._padded

    @property
    def keys(self) -> Tensor | None:
        return None if self.kv is None else self._view_tensors()[0]

    @property
    def values(self) -> Tensor | None:
        return None if self.kv is None else self._view_tensors()[1]

    @property
    def positions(self) -> Tensor | None:
        return None if self.kv is None else self._view_tensors()[2]

    @property
    def valid(self) -> Tensor | None:
        return None if self.kv is None else self._view_tensors()[3]

    @property
    def lengths(self) -> Tensor | None:
        """`[B, H]` tokens held per (row, KV head)."""
        return None if self.kv is None else self.kv.lengths

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv.pool.capacity * self.kv.page_size

    def _page_size(self) -> int:
        return int(getattr(self.cache.pipeline.allocator, "page_size", 16))

    def _check_tier(self) -> None:
        if self.cache.pipeline.tier.holds_tokens:
            raise KVComposeError(
                f"{self.cache.pipeline.tier!r} keeps tokens outside HBM, which ragged (per-head) storage does not "
                "support yet: use a per-layer allocator or plain eviction"
            )

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, h, _, d = key_states.shape
        self._check_tier()
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, self.head_dim, self.value_dim = b, h, d, value_states.shape[-1]
        self.kv = PagedKV(b, h, d, self.value_dim, self.dtype, self.device, page_size=self._page_size())
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.cache.seed * 1_000_003 + self.layer_idx)
        self.limits = self._initial_limits(b, h)
        self.is_initialized = True
        self._dirty()

    def _initial_limits(self, b: int, h: int) -> Tensor | None:
        if self.cache.budget is None:
            return None
        budget = self.cache.layer_budget(self.layer_idx)
        return self.cache.pipeline.allocator.initial_limits(budget, b, h, self.device)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append new tokens (keys after RoPE) to every head and hand this layer to the attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            check_incoming(self, key_states)
        q = key_states.shape[2]
        if self.seen == 0:
            self.prompt_length = q
        self.kv.append(key_states, value_states, torch.arange(self.seen, self.seen + q, device=self.device))
        self.seen += q
        self._dirty()
        self._new = q
        _attn.handoff.layer = self
        self._track_peak()
        # kvcompose's attention function reads this layer (handed off above), never the returned tensors:
        # return the new tokens rather than gathering a padded copy of every head here
        return key_states, value_states

    # -- attention ------------------------------------------------------------------------------------
    def attend(self, query: Float[Tensor, "B Hq Q D"], mask2d: Tensor | None, scale: float,
               sliding_window: int | None = None) -> Float[Tensor, "B Q Hq D"]:
        """Attention over each head's own held tokens through `ragged_attention`, then the schedule
        (mirrors `KVComposeLayer.attend`)."""
        q = query.shape[2]
        self.scale = scale
        if query.shape[1] % self.num_heads:
            raise KVComposeError(f"{query.shape[1]} query heads are not a multiple of {self.num_heads} KV heads")
        qpos = torch.arange(self.seen - q, self.seen, device=self.device)
        if mask2d is not None:
            new_valid = mask2d[:, -q:].to(device=self.device, dtype=torch.bool)
            if not bool(new_valid.all()):
                self.kv.set_tail_valid(new_valid)
                self._dirty()
        else:
            new_valid = torch.ones(query.shape[0], q, dtype=torch.bool, device=self.device)
        self._record_queries(query, qpos, new_valid)
        from .kernels import select_backend

        observers = self.cache.pipeline.observers()
        on_kernel = select_backend(query, self.kv.pool.keys) == "triton"
        padded = self._padded if on_kernel and not observers else self._view_tensors()
        # a module-global looked up at call time: assigning kvcompose.storage.ragged_attention swaps the kernel
        out = ragged_attention(query, self.kv, qpos, scale, sliding_window, padded=padded)
        if observers:
            keys, _, pos, valid = padded
            mask = _attn.build_mask(pos, valid, qpos, sliding_window)
            for s in observers:
                cur = self.kv.read(s.state_key) if s.state_key in self.kv.pool.extras else None
                new = s.observe(cur, query, keys, mask, scale)
                if new is not None:
                    self.kv.write(s.state_key, new.float())
        self._schedule(q)
        return out

    # -- compression ----------------------------------------------------------------------------------
    def view(self, merged=None) -> LayerView:
        """A padded snapshot for the blocks; `state` also holds the allocator's state dict (under
        `allocator.state_key`) and `"kvcompose.active"`: Bool `[B]`, the rows this event compresses."""
        keys, values, pos, valid = self._view_tensors()
        state: dict[str, Any] = {name: self.kv.read(name) for name in self.kv.pool.extras}
        state[self.cache.pipeline.allocator.state_key] = self.alloc_state
        if self._active is not None:
            state["kvcompose.active"] = self._active
        return LayerView(
            layer_idx=self.layer_idx,
            num_layers=len(self.cache.layers),
            keys=keys, values=values, positions=pos, valid=valid,
            prompt_length=self.prompt_length,
            queries=self.q_buf, query_positions=self.q_pos, query_valid=self.q_valid,
            seen=self.seen,
            scale=getattr(self, "scale", self.head_dim**-0.5),
            state=state,
            generator=self.generator,
            event=self.events,
        )

    def _over_limit(self) -> Bool[Tensor, " B"]:
        """Rows in which some head holds more real tokens than its limit (or more slots than limit + interval)."""
        limits = self.limits
        if limits is None:
            limits = torch.full_like(self.kv.lengths, self.cache.layer_budget(self.layer_idx))
        over = (self.valid.sum(-1) > limits) | (self.kv.lengths >= limits + self.cache.interval)
        return over.any(-1)

    def _schedule(self, q: int) -> None:
        cache = self.cache
        if not cache.pipeline.compresses:
            return
        decoded = self.seen - self.prompt_length
        if decoded == 0:
            if cache.compress_prefill and bool(self._over_limit().any()):
                self.compress()
            return
        if decoded // cache.interval == (decoded - q) // cache.interval:
            return
        if bool(self._over_limit().any()):
            self.compress()

    @timed_compress
    def compress(self) -> Selection:
        """Run the pipeline on this layer; compact the rows over their limits to the selected tokens."""
        cache = self.cache
        self._check_tier()
        self._active = self._over_limit()
        try:
            sel = cache.pipeline.select(self.view(), cache.layer_budget(self.layer_idx))
            return self.apply_selection(sel, self._active)
        finally:
            self._active = None

    def apply_selection(self, sel: Selection, active: Tensor | None = None) -> Selection:
        """Keep `sel.kept` (padded-view indices, -1 padded) in the `active` rows (default: all), everything
        in the others; the active rows' limits become their new budgets."""
        kept = sel.kept
        b, h = self.kv.batch, self.kv.heads
        if active is not None and not bool(active.all()):
            t = self.held
            width = max(kept.shape[-1], t)
            allk = torch.arange(width, device=self.device).expand(b, h, width)
            allk = torch.where(allk < self.kv.lengths[..., None], allk, torch.full_like(allk, -1))
            pad = torch.full((b, h, width - kept.shape[-1]), -1, dtype=kept.dtype, device=self.device)
            kept = torch.where(active[:, None, None], torch.cat([kept, pad], dim=-1), allk)
        self.kv.compact(kept)
        budget = sel.budget.to(self.device)
        if self.limits is None or active is None:
            self.limits = budget.clone()
        else:
            self.limits = torch.where(active[:, None], budget, self.limits)
        self.events += 1
        self._dirty()
        self._track_peak()
        return sel

    @classmethod
    def adopt(cls, layer: KVComposeLayer) -> "RaggedLayer":
        """Move a dense `KVComposeLayer` onto ragged storage in place (its class changes; held tokens,
        block state, queries and counters carry over; the dense buffers are freed)."""
        if isinstance(layer, RaggedLayer):
            return layer
        if layer.cache.pipeline.tier.holds_tokens:
            raise KVComposeError(
                f"{layer.cache.pipeline.allocator!r} gave heads of layer {layer.layer_idx} different budgets, which "
                "needs ragged storage, and ragged storage does not support tiers that hold tokens yet"
            )
        b, h = layer.batch_size, layer.num_heads
        page = int(getattr(layer.cache.pipeline.allocator, "page_size", 16))
        lengths = torch.full((b, h), layer.held, dtype=torch.long, device=layer.device)
        extras = {k: v[:, :, : layer.held].float() for k, v in layer.token_state.items()}
        kv = PagedKV.from_padded(layer.keys, layer.values, layer.positions, layer.valid, lengths, extras, page)
        layer.__class__ = cls
        layer._k = layer._v = layer._pos = layer._valid = None
        layer.token_state = {}
        layer.kv = kv
        layer.limits = None
        layer.alloc_state = {}
        layer._active = None
        layer._dirty()
        return layer  # type: ignore[return-value]

    # -- batch operations and crop --------------------------------------------------------------------
    def _batch_apply(self, fn) -> None:
        if not self.is_initialized:
            return
        old_b = self.kv.batch
        k, v, pos, valid = self._view_tensors()
        extras = {name: fn(self.kv.read(name)) for name in self.kv.pool.extras}
        self.kv = PagedKV.from_padded(fn(k), fn(v), fn(pos), fn(valid), fn(self.kv.lengths), extras,
                                      self.kv.page_size, self.kv.pool.slack)
        if self.limits is not None:
            self.limits = fn(self.limits)
        if self.q_buf is not None:
            self.q_buf, self.q_valid = fn(self.q_buf), fn(self.q_valid)
        self.alloc_state = _apply_rows(self.alloc_state, fn, old_b)
        self.batch_size = self.kv.batch
        self._dirty()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest `-tokens_to_remove` tokens; only while every head still holds all of them."""
        if tokens_to_remove > 0:
            raise KVComposeError("crop takes a negative count of newest tokens to remove")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        lengths = self.kv.lengths
        if n > int(lengths.min()):
            raise KVComposeError(f"cannot crop {n} tokens: a head of layer {self.layer_idx} holds only {int(lengths.min())}")
        idx = lengths[..., None] - n + torch.arange(n, device=self.device)
        tail = self.positions.gather(-1, idx)
        want = torch.arange(self.seen - n, self.seen, device=self.device)
        if not bool((tail == want).all()):
            raise KVComposeError(f"cannot crop {n} tokens: some of the newest tokens were already evicted")
        t = self.held
        keep = torch.arange(t, device=self.device).expand(self.kv.batch, self.kv.heads, t)
        self.kv.compact(torch.where(keep < (lengths - n)[..., None], keep, torch.full_like(keep, -1)))
        self.seen -= n
        self._dirty()
        if self.q_pos is not None:
            m = self.q_pos < self.seen
            self.q_buf, self.q_pos, self.q_valid = self.q_buf[:, :, m], self.q_pos[m], self.q_valid[:, m]

    # -- accounting -----------------------------------------------------------------------------------
    def kept_positions(self) -> Int[Tensor, "B H K"]:
        """Original positions held per (row, head), ascending, `[B, H, max length]`, -1 past each head's length."""
        pos = self.positions
        inside = torch.arange(pos.shape[-1], device=self.device) < self.kv.lengths[..., None]
        return torch.where(inside, pos, torch.full_like(pos, -1))

    def bytes_per_token(self) -> int:
        """Bytes of one token position over all rows and heads (the full-cache unit, as the dense layer)."""
        if not self.is_initialized:
            return 0
        item = torch.empty((), dtype=self.dtype).element_size()
        return self.batch_size * self.num_heads * (self.head_dim + self.value_dim) * item

    def held_bytes(self) -> int:
        """Bytes of the tokens held: `sum(lengths) * (D + Dv) * itemsize`."""
        if not self.is_initialized:
            return 0
        item = torch.empty((), dtype=self.dtype).element_size()
        return self.kv.held_tokens() * (self.head_dim + self.value_dim) * item

    def allocated_bytes(self) -> int:
        """Bytes of the layer's K/V page pool (used and free pages)."""
        return 0 if self.kv is None else self.kv.pool.nbytes()


def _apply_rows(obj: Any, fn, batch: int) -> Any:
    """Apply a batch-row operation to every tensor with a leading batch axis inside nested dicts."""
    if isinstance(obj, dict):
        return {k: _apply_rows(v, fn, batch) for k, v in obj.items()}
    if isinstance(obj, Tensor) and obj.dim() >= 1 and obj.shape[0] == batch:
        return fn(obj)
    return obj
