"""`DenseStore`: one length per layer, every (row, KV head) holds the same number of tokens.

Buffers `[B, H, capacity, D]` grow with the sequence (by half their size, never past `target` while the
tokens fit in it) and shrink back to `target` after a compaction, so a layer holds at most
`budget + interval` slots once compression runs and never reserves memory ahead of the tokens it holds.
Compaction moves the kept tokens to the front in place (`kvcompose.kernels.compact`); every slot keeps its
original position, so kept tokens stay in time order.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..attention_math import attend, attend_tokens, needs_mask
from ..kernels import compact as _compact_kernel
from ..view import KVComposeError
from .base import StoreView

__all__ = ["DenseStore"]


class DenseStore:
    """Dense per-layer storage: `keys [B, H, cap, D]`, `values [B, H, cap, Dv]`, `positions [B, H, cap]`,
    `valid [B, H, cap]`, channels `[B, H, cap, C]` float32; the first `held` slots are tokens.

    Args:
        batch: B rows.
        heads: H KV heads.
        head_dim: D, the key width.
        value_dim: Dv, the value width.
        dtype: of keys and values.
        device: of keys and values (positions, flags and channels live on the same device).
        channels: C, float32 channels of token-aligned block state.
        target: slots the buffers grow up to and shrink back to (the layer's `budget + interval`); 0 means
            no compression is expected (the buffers just grow).
        reserve: allocate `target` slots at once (fixed-capacity buffers for CUDA graphs / `torch.compile`).
    """

    def __init__(self, batch: int, heads: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device, channels: int = 0, target: int = 0, reserve: bool = False):
        self.batch, self.heads, self.channels = batch, heads, channels
        self.head_dim, self.value_dim = head_dim, value_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.target = target
        cap = target if reserve else 0
        self._k = torch.empty(batch, heads, cap, head_dim, dtype=dtype, device=self.device)
        self._v = torch.empty(batch, heads, cap, value_dim, dtype=dtype, device=self.device)
        self._pos = torch.empty(batch, heads, cap, dtype=torch.long, device=self.device)
        self._valid = torch.empty(batch, heads, cap, dtype=torch.bool, device=self.device)
        self._ch = torch.empty(batch, heads, cap, channels, dtype=torch.float32, device=self.device)
        self._n = 0
        self._m = 0  # slots whose positions and padding flags are written; the rest are implicit:
        self._tail_pos = 0  # slot m + i is at position tail_pos + i and is a real token (written on demand)
        self._padding = False
        self.resizes = 0
        self._slot_bytes = batch * heads * (head_dim + value_dim) * self._k.element_size()
        self._view: StoreView | None = None  # memoised until the next change

    # -- sizes ----------------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return self._k.shape[2]

    @property
    def lengths(self) -> Int[Tensor, "B H"]:
        return torch.full((self.batch, self.heads), self._n, dtype=torch.long, device=self.device)

    @property
    def host_lengths(self) -> np.ndarray:
        return np.full((self.batch, self.heads), self._n, dtype=np.int64)

    @property
    def ragged(self) -> bool:
        return self._padding

    @property
    def padded(self) -> bool:
        return self._padding

    def nbytes(self) -> int:
        return self._n * self._slot_bytes

    def allocated_bytes(self) -> int:
        return self.capacity * self._slot_bytes

    def _resize(self, cap: int) -> None:
        n = self._n

        def move(t: Tensor) -> Tensor:
            new = t.new_empty((*t.shape[:2], cap, *t.shape[3:]))
            new[:, :, :n] = t[:, :, :n]
            return new

        self._k, self._v, self._pos, self._valid, self._ch = map(move, (self._k, self._v, self._pos, self._valid,
                                                                         self._ch))
        self.resizes += 1
        self._view = None

    def _reserve(self, need: int) -> None:
        cap = self.capacity
        if need <= cap:
            return
        grown = max(need, math.ceil(cap * 1.5), 16)
        if self.target and need <= self.target:
            grown = min(grown, self.target)
        self._resize(grown)

    def trim(self) -> None:
        """Free the spare slots (buffers of exactly `held` slots)."""
        if self.capacity > self._n:
            self._resize(self._n)

    def fit(self, room: int | None = None) -> None:
        """Shrink the buffers to `held + room` slots (the new `target`; None: keep the current target) when
        they are larger (frees memory after a compaction; the buffers then grow back to `target` at most)."""
        if room is not None:
            self.target = self._n + room
        if self.target and self.capacity > self.target >= self._n:
            self._resize(self.target)

    def _materialize(self) -> None:
        """Write the positions and padding flags of the implicit tail (appended in one run, no padding)."""
        m, n = self._m, self._n
        if m < n:
            self._pos.narrow(2, m, n - m).copy_(
                torch.arange(self._tail_pos, self._tail_pos + n - m, device=self.device).expand(
                    self.batch, self.heads, n - m))
            self._valid.narrow(2, m, n - m).fill_(True)
            self._m = n

    # -- reading --------------------------------------------------------------------------------------
    def view(self) -> StoreView:
        if self._view is None:
            self._materialize()
            n = self._n
            self._view = StoreView(self._k.narrow(2, 0, n), self._v.narrow(2, 0, n), self._pos.narrow(2, 0, n),
                                   self._valid.narrow(2, 0, n))
        return self._view

    def attend(self, query: Float[Tensor, "B Hq Q D"], seen: int, scale: float, sliding_window: int | None = None,
               softcap: float | None = None, sinks: Float[Tensor, " Hq"] | None = None) -> Float[Tensor, "B Q Hq Dv"]:
        """SDPA over the held slots (views of the buffers, no copy); unmasked for one query over unpadded
        tokens, else masked by position (positions are written only then)."""
        n = self._n
        keys, values = self._k.narrow(2, 0, n), self._v.narrow(2, 0, n)
        if not needs_mask(query.shape[2], self._padding, seen, sliding_window):
            return attend(query, keys, values, None, scale, softcap, sinks)
        v = self.view()
        return attend_tokens(query, keys, values, v.positions, v.valid, True, seen, scale, sliding_window, softcap,
                             sinks)[0]

    def valid_counts(self) -> Int[Tensor, "B H"]:
        if not self._padding:
            return self.lengths
        return self.view().valid.sum(-1)

    def read_channels(self) -> Float[Tensor, "B H T C"]:
        return self._ch[:, :, : self._n]

    def write_channels(self, x: Float[Tensor, "B H T C"]) -> None:
        self._ch[:, :, : self._n] = x

    # -- mutation -------------------------------------------------------------------------------------
    def append(self, keys: Float[Tensor, "B H Q D"], values: Float[Tensor, "B H Q Dv"],
               start: int | Int[Tensor, " Q"], valid: Bool[Tensor, "B Q"] | None = None) -> None:
        """Append Q new tokens at positions `start, start + 1, ...` (or the given positions `[Q]`). Tokens
        that follow the previous append and have no padding get their positions and padding flags written
        only when a view needs them."""
        positions = start if isinstance(start, Tensor) else None
        start = None if positions is not None else int(start)
        q = keys.shape[2]
        n = self._n
        need = n + q
        self._reserve(need)
        self._k.narrow(2, n, q).copy_(keys)
        self._v.narrow(2, n, q).copy_(values)
        if valid is None and start is not None and (self._m == n or start == self._tail_pos + n - self._m):
            if self._m == n:
                self._tail_pos = start
        else:
            self._materialize()
            if positions is None:
                positions = torch.arange(start, start + q, device=self.device)
            self._pos.narrow(2, n, q).copy_(positions.expand(self.batch, self.heads, q))
            if valid is None:
                self._valid.narrow(2, n, q).fill_(True)
            else:
                self._valid.narrow(2, n, q).copy_(valid[:, None, :].expand(self.batch, self.heads, q))
                self._padding = self._padding or not bool(valid.all())
            self._m = need
        if self.channels:
            self._ch.narrow(2, n, q).zero_()
        self._n = need
        self._view = None

    def set_tail_valid(self, valid: Bool[Tensor, "B Q"]) -> None:
        q = valid.shape[1]
        self._materialize()
        self._valid[:, :, self._n - q : self._n] = valid[:, None, :]
        self._padding = True
        self._view = None

    def kept_counts(self, kept: Int[Tensor, "B H K"]) -> Int[Tensor, "B H"]:
        return (kept >= 0).sum(-1)

    def compact(self, kept: Int[Tensor, "B H K"], counts: np.ndarray | None = None) -> None:
        k = kept.shape[-1]
        ragged = (counts != k).any() if counts is not None else bool((kept < 0).any())
        if k and ragged:
            raise KVComposeError(
                "dense storage holds one length per layer, but the selection gave heads different budgets: use "
                "an allocator with uniform = False (per-head budgets live in paged storage)"
            )
        n = self._n
        self._materialize()
        if k == 0:
            self._n = self._m = 0
            self._padding, self._view = False, None
            return
        # the selection's indices are in range and ascending: no index check (it would wait for the device)
        _compact_kernel(self._k[:, :, :n], self._v[:, :, :n], kept, out_keys=self._k[:, :, :k],
                        out_values=self._v[:, :, :k], check_indices=False)
        self._pos[:, :, :k] = self._pos[:, :, :n].gather(-1, kept)
        self._valid[:, :, :k] = self._valid[:, :, :n].gather(-1, kept)
        if self.channels:
            self._ch[:, :, :k] = self._ch[:, :, :n].gather(2, kept[..., None].expand(*kept.shape, self.channels))
        self._n = self._m = k
        self._padding = self._padding and not bool(self._valid[:, :, :k].all())
        self._view = None

    def assign(self, view: StoreView, channels: Float[Tensor, "B H T C"] | None,
               lengths: Int[Tensor, "B H"], host_lengths: np.ndarray | None = None,
               padded: bool | None = None) -> None:
        if host_lengths is not None:
            k, least = (int(host_lengths.max()), int(host_lengths.min())) if host_lengths.size else (0, 0)
        else:
            k = int(lengths.max()) if lengths.numel() else 0
            least = int(lengths.min()) if lengths.numel() else 0
        if lengths.numel() and least != k:
            raise KVComposeError(
                "dense storage holds one length per layer, but the selection gave heads different budgets: use "
                "an allocator with uniform = False (per-head budgets live in paged storage)"
            )
        if k > self.capacity:
            self._n = self._m = 0
            self._resize(max(k, self.target))
        self._k[:, :, :k] = view.keys[:, :, :k]
        self._v[:, :, :k] = view.values[:, :, :k]
        self._pos[:, :, :k] = view.positions[:, :, :k]
        self._valid[:, :, :k] = view.valid[:, :, :k]
        if self.channels and channels is not None:
            self._ch[:, :, :k] = channels[:, :, :k]
        self._n = self._m = k
        self._padding = (not bool(self._valid[:, :, :k].all())) if padded is None else padded
        self._view = None

    def crop(self, n: int) -> None:
        if n > self._n:
            raise KVComposeError(f"cannot crop {n} tokens: the store holds {self._n}")
        self._n -= n
        self._m = min(self._m, self._n)
        self._view = None

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> None:
        self._materialize()
        self._k, self._v, self._pos, self._valid, self._ch = map(fn, (self._k, self._v, self._pos, self._valid,
                                                                       self._ch))
        self.batch = self._k.shape[0]
        self._slot_bytes = self.batch * self.heads * (self.head_dim + self.value_dim) * self._k.element_size()
        self._view = None

    def __repr__(self) -> str:
        return f"DenseStore(held={self._n}, capacity={self.capacity}, target={self.target})"
