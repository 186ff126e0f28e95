"""`PagedStore`: ragged storage, a length per (row, KV head), with memory that follows their sum.

With per-head (ReasonAlloc's head utility) or per-request (GrowPage) budgets, a dense `[B, H, T, D]` buffer
must be as long as the *largest* head; masking the rest (what kvpress does) frees nothing. Here every store
owns a `PagePool` of fixed-size pages and every (row, KV head) a page table:

```
PagePool (kvcompose.stores.pool)             PagedStore
  keys      [n_pages, P, D]                    page_table [B, H, M]   page ids, -1 = none (device + host copy)
  values    [n_pages, P, Dv]                   lengths    [B, H]      tokens held by each (row, head)
  positions [n_pages, P] (original index)                             (device + host copy)
  valid     [n_pages, P] (False = padding)   logical token t of (b, h) lives in page
  channels  [n_pages, P, C] float32          page_table[b, h, t // P], slot t % P
  free      host stack of free page ids
```

- Host bookkeeping: the page table and the lengths are mirrored on the host, where every decision about
  pages is made (which head crosses a page boundary, which page it gets, what a compaction frees). An
  ordinary decode step therefore never waits for the device: new page ids reach the device table as one
  small asynchronous copy, and the new tokens are written with `index_copy_` at slots computed on the device.
- Append: every head writes its new tokens after its own length; a head that crosses a page boundary takes
  a page from the free stack; the pool grows geometrically when the stack is empty.
- Compaction (a compression event, where host syncs are allowed): each head's kept tokens move to the
  front of its own pages (gather, then scatter: a copy, so overlapping moves are safe); pages past the new
  length go back to the free stack. Then `fit(room)` sizes the pool once (defragmenting it when too much of
  it is free) to the pages the heads hold plus room for what the layer appends until its next event, so a
  layer at its steady state reallocates its pool neither between events nor at them; `trim()` frees every
  spare page.
- Attention (`attend`): on CUDA a decode step runs the Triton paged decode kernel over the pages directly
  (`kvcompose.kernels.paged_decode_attention`: no padded copy); a prefill (more than `KERNEL_MAX_QUERIES` new
  queries) and every call elsewhere gather the pages into a transient padded view for masked SDPA (the
  PyTorch reference). The store never keeps a padded view.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..attention_math import attend, attend_tokens
from ..kernels import paged_decode_attention, select_backend
from ..view import KVComposeError
from .base import FAR_POSITION, StoreView
from .pool import POOL_GROWTH, POOL_SLACK, PagePool

__all__ = ["PagePool", "PagedStore", "POOL_SLACK", "POOL_GROWTH", "KERNEL_MAX_QUERIES"]

#: New queries up to which `PagedStore.attend` runs the paged decode kernel on CUDA (decode steps, short
#: continuations); a prefill takes the padded view and SDPA.
KERNEL_MAX_QUERIES = 4


class PagedStore:
    """Ragged KV storage of one layer: a `PagePool` plus a page table and a length per (row, KV head).

    Attributes:
        pool: the store's `PagePool`.
        page_table: Long `[B, H, M]` page ids of each (row, head) on the device, -1 where none (M >= the most
            pages of any head).
        lengths: Long `[B, H]` tokens held by each (row, head), on the device; `host_lengths` the same on the
            host. Logical token `t < lengths[b, h]` is at `page_table[b, h, t // P] * P + t % P` of the pool's
            flattened slot axis.

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
        self._table = np.full((batch, heads, 0), -1, dtype=np.int64)  # host page table
        self.page_table = torch.full((batch, heads, 0), -1, dtype=torch.long, device=self.pool.device)
        self._lens = np.zeros((batch, heads), dtype=np.int64)  # host lengths
        self._pages = np.zeros((batch, heads), dtype=np.int64)  # host: pages held by each (row, head)
        self._room = 0  # host: tokens every (row, head) can append before one of them needs a page
        self._lengths = torch.zeros(batch, heads, dtype=torch.long, device=self.pool.device)
        self._padding = False
        self._reserve = 0  # pages the pool keeps for the tokens appended until the next event (see `fit`)

    # -- sizes (host) ---------------------------------------------------------------------------------
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
    def host_lengths(self) -> np.ndarray:
        return self._lens

    @property
    def held(self) -> int:
        return int(self._lens.max()) if self._lens.size else 0

    @property
    def capacity(self) -> int:
        return self.pool.capacity * self.page_size

    @property
    def ragged(self) -> bool:
        return self._padding or (self._lens.size > 0 and int(self._lens.min()) != int(self._lens.max()))

    @property
    def padded(self) -> bool:
        return self._padding

    def held_tokens(self) -> int:
        """Tokens held, summed over rows and heads."""
        return int(self._lens.sum())

    def pages_per_head(self) -> Int[Tensor, "B H"]:
        return (self.page_table >= 0).sum(-1)

    def nbytes(self) -> int:
        """`sum(lengths) * (D + Dv) * itemsize`: the K/V of the tokens held."""
        return self.held_tokens() * (self.head_dim + self.value_dim) * self.pool.keys.element_size()

    def allocated_bytes(self) -> int:
        """Bytes of the K/V page pool (used and free pages)."""
        return self.pool.nbytes()

    # -- addressing (device) --------------------------------------------------------------------------
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

    def _upload_table(self) -> None:
        self.page_table = torch.from_numpy(self._table.copy()).to(self.device, non_blocking=True)

    def _take_pages(self, new_lengths: np.ndarray) -> None:
        """Give every (row, head) enough pages for `new_lengths` tokens: decided on the host, the new table
        entries copied to the device table asynchronously (never a host sync)."""
        p = self.page_size
        have = self._pages
        need = (new_lengths + p - 1) // p
        if not (need > have).any():
            self._sync_room()
            return
        m, width = int(need.max()), self._table.shape[-1]
        if m > width:  # more columns (geometrically, so the device table is rarely reallocated)
            grow = max(m, width + width // 2) - width
            self._table = np.concatenate([self._table, np.full((self.batch, self.heads, grow), -1, np.int64)], -1)
            self.page_table = torch.cat([self.page_table, torch.full((self.batch, self.heads, grow), -1,
                                                                     dtype=torch.long, device=self.device)], -1)
        col = np.arange(self._table.shape[-1])
        where = np.flatnonzero((col >= have[..., None]) & (col < need[..., None]))  # row-major (b, h, column)
        ids = self.pool.alloc(where.size)
        self._table.reshape(-1)[where] = ids
        self._pages = np.maximum(have, need)
        self._sync_room()
        new = torch.from_numpy(np.stack([where, ids])).to(self.device, non_blocking=True)
        self.page_table.view(-1).index_copy_(0, new[0], new[1])

    def _write(self, idx: Int[Tensor, "B H Q"], data: dict[str, Tensor], all_inside: bool) -> None:
        """Write `data[name]` (`[B, H, Q, ...]`) at logical indices `idx` with `index_copy_` (no boolean
        masks, no host sync). Unless `all_inside`, `idx` is `arange(Q)` per head and entries past a head's
        length are redirected to entry `(b0, h0, 0)` of a head that holds tokens, with that entry's own
        value, so the duplicates write identical values to one slot."""
        n = idx.numel()
        if all_inside:  # every index is held: no masking needed
            p = self.page_size
            dst = (self.page_table.gather(-1, idx // p) * p + idx % p).reshape(-1)
        else:
            slot, inside = self.slots(idx)
            dst = slot.reshape(-1)
        src = None
        if not all_inside:
            if not (self._lens > 0).any():
                return
            b0, h0 = np.unravel_index(int(np.argmax(self._lens)), self._lens.shape)
            anchor = (int(b0) * self.heads + int(h0)) * idx.shape[-1]
            ok = inside.reshape(-1)
            src = torch.where(ok, torch.arange(n, device=self.device), torch.full_like(dst, anchor))
            dst = torch.where(ok, dst, dst[anchor])
        tensors = self.pool.tensors()
        for name, x in data.items():
            flat = self._flat(tensors[name])
            rows = x.reshape(n, *x.shape[3:]).to(flat.dtype)
            flat.index_copy_(0, dst, rows if src is None else rows.index_select(0, src))

    def _release_past(self) -> None:
        """Return the pages past the host lengths to the pool's free stack (the pool's size changes only in
        `fit` / `trim`)."""
        p = self.page_size
        keep_pages = (self._lens + p - 1) // p
        drop = (np.arange(self._table.shape[-1]) >= keep_pages[..., None]) & (self._table >= 0)
        self.pool.release(self._table[drop])
        self._table[drop] = -1
        self._table = self._table[..., : int(keep_pages.max()) if keep_pages.size else 0].copy()
        self._pages = np.minimum(self._pages, keep_pages)
        self._sync_room()
        self._upload_table()

    def _sync_room(self) -> None:
        """Tokens every (row, head) can still append without a new page (host)."""
        self._room = int((self._pages * self.page_size - self._lens).min()) if self._lens.size else 0

    def _fit_pool(self, reserve: int) -> None:
        moved = self.pool.fit(self._table, reserve)
        if moved is not None:
            self._table = moved
            self._upload_table()

    def _set_lengths(self, lengths: Int[Tensor, "B H"], host: np.ndarray | None = None) -> None:
        """New lengths from a device tensor and its host copy (without one: a host sync)."""
        self._lengths = lengths
        self._lens = lengths.cpu().numpy().astype(np.int64) if host is None else np.asarray(host, dtype=np.int64)

    # -- reading --------------------------------------------------------------------------------------
    def _held_slots(self) -> tuple[Int[Tensor, "B H T"], Bool[Tensor, "B H T"], Int[Tensor, " T"]]:
        """Flat pool slots of every view slot `t < T` (T = max length; slots past a head's length point at
        slot 0), which of them hold a token, and `arange(T)`: the column arithmetic is shared by all heads."""
        t, p = self.held, self.page_size
        ar = torch.arange(t, device=self.device)
        if self.page_table.shape[-1] == 0:
            return torch.zeros(self.batch, self.heads, t, dtype=torch.long, device=self.device), \
                ar < self._lengths[..., None], ar
        page = self.page_table.index_select(-1, ar // p)
        slot = (page * p + ar % p).clamp_(min=0)
        inside = ar < self._lengths[..., None]
        return slot, inside, ar

    def view(self) -> StoreView:
        """A transient padded view, `T = max length`; slots past a head's length hold zeros, position
        `FAR_POSITION + t` and valid False. A copy, never kept by the store."""
        t = self.held
        b, h = self.batch, self.heads
        slot, inside, ar = self._held_slots()
        s = slot.reshape(-1)
        flat = self.pool.flat()
        zero = torch.zeros((), dtype=self.pool.keys.dtype, device=self.device)
        k = torch.where(inside[..., None], flat["keys"].index_select(0, s).view(b, h, t, -1), zero)
        v = torch.where(inside[..., None], flat["values"].index_select(0, s).view(b, h, t, -1), zero)
        pos = torch.where(inside, flat["positions"].index_select(0, s).view(b, h, t), FAR_POSITION + ar)
        valid = inside & flat["valid"].index_select(0, s).view(b, h, t)
        return StoreView(k, v, pos, valid)

    def valid_counts(self) -> Int[Tensor, "B H"]:
        if not self._padding:
            return self._lengths
        t = self.held
        slot, inside = self.slots(torch.arange(t, device=self.device).expand(self.batch, self.heads, t))
        return (inside & self._flat(self.pool.valid)[slot.reshape(-1)].view(self.batch, self.heads, t)).sum(-1)

    def read_channels(self) -> Float[Tensor, "B H T C"]:
        t = self.held
        if not self.channels:
            return torch.zeros(self.batch, self.heads, t, 0, device=self.device)
        idx = torch.arange(t, device=self.device).expand(self.batch, self.heads, t)
        slot, inside = self.slots(idx)
        x = self._flat(self.pool.channels)[slot.reshape(-1)].view(self.batch, self.heads, t, self.channels)
        return torch.where(inside[..., None], x, torch.zeros_like(x))

    def write_channels(self, x: Float[Tensor, "B H T C"]) -> None:
        t = x.shape[2]
        idx = torch.arange(t, device=self.device).expand(self.batch, self.heads, t)
        self._write(idx, {"channels": x}, all_inside=self._lens.size > 0 and int(self._lens.min()) >= t)

    def attend(self, query: Float[Tensor, "B Hq Q D"], seen: int, scale: float, sliding_window: int | None = None,
               softcap: float | None = None, sinks: Float[Tensor, " Hq"] | None = None) -> Float[Tensor, "B Q Hq Dv"]:
        """On CUDA a decode step (at most `KERNEL_MAX_QUERIES` new queries) runs the paged decode kernel over the
        pages directly (no padded copy); a prefill, or soft-capping or sinks, or a CPU, runs masked SDPA over a
        transient padded view (the PyTorch reference): the decode kernel's tiles are sized for a few query rows
        (many queries would stream every page once per 16 rows)."""
        if (softcap is None and sinks is None and query.shape[2] <= KERNEL_MAX_QUERIES
                and select_backend(query, self.pool.keys) == "triton"):
            q = query.shape[2]
            qpos = torch.arange(seen - q, seen, device=self.device)
            p = self.pool
            return paged_decode_attention(query, p.keys, p.values, p.positions, p.valid, self.page_table,
                                          self._lengths, qpos, float(scale), sliding_window, check_indices=False)
        if query.shape[2] == 1 and not self._padding and (sliding_window is None or seen <= sliding_window):
            # a decode step over real tokens: every held key is visible, the mask is "slot < length" (the
            # mask build_mask gives, from the lengths alone); slots past a head's length stay unread
            slot, inside, _ = self._held_slots()
            b, h, t = slot.shape
            flat, s = self.pool.flat(), slot.reshape(-1)
            keys = flat["keys"].index_select(0, s).view(b, h, t, -1)
            values = flat["values"].index_select(0, s).view(b, h, t, -1)
            return attend(query, keys, values, inside[:, :, None, :] if self.ragged else None, scale, softcap, sinks)
        v = self.view()
        out, _ = attend_tokens(query, v.keys, v.values, v.positions, v.valid, self.ragged, seen, scale,
                               sliding_window, softcap, sinks)
        return out

    # -- mutation -------------------------------------------------------------------------------------
    def append(self, keys: Float[Tensor, "B H Q D"], values: Float[Tensor, "B H Q Dv"],
               start: int | Int[Tensor, " Q"], valid: Bool[Tensor, "B Q"] | None = None) -> None:
        b, h, q, _ = keys.shape
        if (b, h) != (self.batch, self.heads):
            raise KVComposeError(f"append: got {b} rows x {h} heads, the store holds {self.batch} x {self.heads}")
        if q > self._room:
            self._take_pages(self._lens + q)
        idx = self._lengths[..., None] if q == 1 else self._lengths[..., None] + torch.arange(q, device=self.device)
        self._lens = self._lens + q
        self._lengths = self._lengths + q
        self._room -= q
        p, n = self.page_size, b * h * q
        dst = (self.page_table.gather(-1, idx // p) * p + idx % p).view(n)  # every new slot is held
        flat = self.pool.flat()
        flat["keys"].index_copy_(0, dst, keys.reshape(n, -1))
        flat["values"].index_copy_(0, dst, values.reshape(n, -1))
        if isinstance(start, Tensor):
            flat["positions"].index_copy_(0, dst, start.to(self.device).expand(b, h, q).reshape(n))
        elif q == 1:
            flat["positions"].index_fill_(0, dst, int(start))
        else:
            flat["positions"].index_copy_(0, dst, torch.arange(start, start + q, device=self.device).expand(b, h, q)
                                          .reshape(n))
        if valid is None:
            flat["valid"].index_fill_(0, dst, True)
        else:
            flat["valid"].index_copy_(0, dst, valid[:, None, :].expand(b, h, q).reshape(n))
            self._padding = self._padding or not bool(valid.all())
        if self.channels:
            flat["channels"].index_fill_(0, dst, 0.0)

    def set_tail_valid(self, valid: Bool[Tensor, "B Q"]) -> None:
        b, q = valid.shape
        idx = self._lengths[..., None] - q + torch.arange(q, device=self.device)
        self._write(idx, {"valid": valid[:, None, :].expand(b, self.heads, q)}, all_inside=True)
        self._padding = True

    def kept_counts(self, kept: Int[Tensor, "B H K"]) -> Int[Tensor, "B H"]:
        return ((kept >= 0) & (kept < self._lengths[..., None])).sum(-1)

    def compact(self, kept: Int[Tensor, "B H K"], counts: np.ndarray | None = None) -> None:
        """Keep, per (row, head), the logical indices `kept` (ascending; -1 and indices past the head's
        length are ignored); they move to the front of the head's pages; freed pages return to the pool.
        `counts`: `kept_counts(kept)` on the host (else read here: one host sync)."""
        ok = (kept >= 0) & (kept < self._lengths[..., None])
        new_len = ok.sum(-1)
        dst_logical = ok.long().cumsum(-1) - 1
        src, _ = self.slots(torch.where(ok, kept, torch.zeros_like(kept)))
        old = self._lengths
        dst, _ = self.slots(torch.where(ok, dst_logical, torch.zeros_like(kept)))
        host = new_len.cpu().numpy().astype(np.int64) if counts is None else np.asarray(counts, dtype=np.int64)
        host = np.minimum(host, self._lens)
        if host.sum() > 0:
            # no boolean mask (a data-dependent shape waits for the device): the entries that move nothing
            # repeat the move of the first kept token of a head that keeps any (its first entry: kept is
            # ascending), so duplicates write that same value to that same slot
            b0, h0 = np.unravel_index(int(np.argmax(host > 0)), host.shape)
            anchor = (int(b0) * self.heads + int(h0)) * kept.shape[-1]
            okf, s, d = ok.reshape(-1), src.reshape(-1), dst.reshape(-1)
            s = torch.where(okf, s, s[anchor])
            d = torch.where(okf, d, d[anchor])
            for t in self.pool.tensors().values():
                flat = self._flat(t)
                flat.index_copy_(0, d, flat.index_select(0, s))  # a gathered copy: overlapping moves are safe
        self._set_lengths(torch.minimum(new_len, old), host)
        self._release_past()
        self._padding = self._padding and not bool(self.valid_counts().eq(self._lengths).all())

    def assign(self, view: StoreView, channels: Float[Tensor, "B H T C"] | None,
               lengths: Int[Tensor, "B H"], host_lengths: np.ndarray | None = None,
               padded: bool | None = None) -> None:
        self._lens = np.zeros_like(self._lens)
        self._lengths = torch.zeros_like(self._lengths)
        self._release_past()
        lens = lengths.cpu().numpy().astype(np.int64) if host_lengths is None else \
            np.asarray(host_lengths, dtype=np.int64).copy()
        self._take_pages(lens)
        self._lens, self._lengths = lens, lengths.clone()
        self._sync_room()
        t = view.keys.shape[2]
        idx = torch.arange(t, device=self.device).expand(self.batch, self.heads, t)
        data = {"keys": view.keys, "values": view.values, "positions": view.positions, "valid": view.valid}
        if self.channels and channels is not None:
            data["channels"] = channels
        self._write(idx, data, all_inside=lens.size > 0 and int(lens.min()) >= t)
        if padded is None:
            self._padding = True
            self._padding = not bool(self.valid_counts().eq(self._lengths).all())
        else:
            self._padding = padded

    def fit(self, room: int) -> None:
        """Size the pool after a compression event: the pages its heads hold plus room for `room` more tokens
        each (what the layer appends until its next event), shrinking (and defragmenting) or growing it once,
        so it is not reallocated before the next event."""
        p, n = self.page_size, self._lens.size
        # at most the pages needed: page rounding costs < 1 page per head, and this bound stays put while
        # per-head budgets move and their total does not
        self._reserve = -(-(int(self._lens.sum()) + n * room) // p) + n - 1 if room else 0
        self._fit_pool(self._reserve)
        self.pool.ensure(self._reserve)

    def trim(self) -> None:
        """Free spare pages (the pool is defragmented when too much of it is free)."""
        self._reserve = 0
        self._fit_pool(0)

    def crop(self, n: int) -> None:
        least = int(self._lens.min()) if self._lens.size else 0
        if n > least:
            raise KVComposeError(f"cannot crop {n} tokens: a head holds only {least}")
        self._lens = self._lens - n
        self._lengths = self._lengths - n
        self._release_past()

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> None:
        v = self.view()
        ch = self.read_channels() if self.channels else None
        lengths = fn(self._lengths)
        new = PagedStore(lengths.shape[0], self.heads, self.head_dim, self.value_dim, self.dtype, self.device,
                         self.page_size, self.channels, self.pool.slack)
        new._reserve = self._reserve
        new.assign(StoreView(*(fn(x) for x in v)), None if ch is None else fn(ch), lengths)
        self.__dict__.update(new.__dict__)

    def __repr__(self) -> str:
        return f"PagedStore(held={self.held}, pages={self.pool.n_used}/{self.pool.capacity}, P={self.page_size})"
