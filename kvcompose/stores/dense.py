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

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

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
        self._padding = False
        self.resizes = 0

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
    def ragged(self) -> bool:
        return self._padding

    def _bytes_per_slot(self) -> int:
        return self.batch * self.heads * (self.head_dim + self.value_dim) * self._k.element_size()

    def nbytes(self) -> int:
        return self._n * self._bytes_per_slot()

    def allocated_bytes(self) -> int:
        return self.capacity * self._bytes_per_slot()

    def _resize(self, cap: int) -> None:
        n = self._n

        def move(t: Tensor) -> Tensor:
            new = t.new_empty((*t.shape[:2], cap, *t.shape[3:]))
            new[:, :, :n] = t[:, :, :n]
            return new

        self._k, self._v, self._pos, self._valid, self._ch = map(move, (self._k, self._v, self._pos, self._valid,
                                                                         self._ch))
        self.resizes += 1

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

    def fit(self) -> None:
        """Shrink the buffers back to `target` slots when they are larger and the tokens fit (frees memory)."""
        if self.target and self.capacity > self.target >= self._n:
            self._resize(self.target)

    # -- reading --------------------------------------------------------------------------------------
    def view(self) -> StoreView:
        n = self._n
        return StoreView(self._k[:, :, :n], self._v[:, :, :n], self._pos[:, :, :n], self._valid[:, :, :n])

    def read_channels(self) -> Float[Tensor, "B H T C"]:
        return self._ch[:, :, : self._n]

    def write_channels(self, x: Float[Tensor, "B H T C"]) -> None:
        self._ch[:, :, : self._n] = x

    # -- mutation -------------------------------------------------------------------------------------
    def append(self, keys: Float[Tensor, "B H Q D"], values: Float[Tensor, "B H Q Dv"],
               positions: Int[Tensor, " Q"], valid: Bool[Tensor, "B Q"] | None = None) -> None:
        q = keys.shape[2]
        need = self._n + q
        self._reserve(need)
        sl = slice(self._n, need)
        self._k[:, :, sl] = keys
        self._v[:, :, sl] = values
        self._pos[:, :, sl] = positions
        if valid is None:
            self._valid[:, :, sl] = True
        else:
            self._valid[:, :, sl] = valid[:, None, :]
            self._padding = self._padding or not bool(valid.all())
        if self.channels:
            self._ch[:, :, sl] = 0
        self._n = need

    def set_tail_valid(self, valid: Bool[Tensor, "B Q"]) -> None:
        q = valid.shape[1]
        self._valid[:, :, self._n - q : self._n] = valid[:, None, :]
        self._padding = self._padding or not bool(valid.all())

    def compact(self, kept: Int[Tensor, "B H K"]) -> None:
        k = kept.shape[-1]
        if k and bool((kept < 0).any()):
            raise KVComposeError(
                "dense storage holds one length per layer, but the selection gave heads different budgets: use "
                "an allocator with uniform = False (per-head budgets live in paged storage)"
            )
        n = self._n
        if k == 0:
            self._n, self._padding = 0, False
            return
        _compact_kernel(self._k[:, :, :n], self._v[:, :, :n], kept, out_keys=self._k[:, :, :k],
                        out_values=self._v[:, :, :k])
        self._pos[:, :, :k] = self._pos[:, :, :n].gather(-1, kept)
        self._valid[:, :, :k] = self._valid[:, :, :n].gather(-1, kept)
        if self.channels:
            self._ch[:, :, :k] = self._ch[:, :, :n].gather(2, kept[..., None].expand(*kept.shape, self.channels))
        self._n = k
        self._padding = self._padding and not bool(self._valid[:, :, :k].all())

    def assign(self, view: StoreView, channels: Float[Tensor, "B H T C"] | None,
               lengths: Int[Tensor, "B H"]) -> None:
        k = int(lengths.max()) if lengths.numel() else 0
        if lengths.numel() and int(lengths.min()) != k:
            raise KVComposeError(
                "dense storage holds one length per layer, but the selection gave heads different budgets: use "
                "an allocator with uniform = False (per-head budgets live in paged storage)"
            )
        if k > self.capacity:
            self._n = 0
            self._resize(max(k, self.target))
        self._k[:, :, :k] = view.keys[:, :, :k]
        self._v[:, :, :k] = view.values[:, :, :k]
        self._pos[:, :, :k] = view.positions[:, :, :k]
        self._valid[:, :, :k] = view.valid[:, :, :k]
        if self.channels and channels is not None:
            self._ch[:, :, :k] = channels[:, :, :k]
        self._n = k
        self._padding = not bool(self._valid[:, :, :k].all())

    def crop(self, n: int) -> None:
        if n > self._n:
            raise KVComposeError(f"cannot crop {n} tokens: the store holds {self._n}")
        self._n -= n

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> None:
        self._k, self._v, self._pos, self._valid, self._ch = map(fn, (self._k, self._v, self._pos, self._valid,
                                                                       self._ch))
        self.batch = self._k.shape[0]

    def __repr__(self) -> str:
        return f"DenseStore(held={self._n}, capacity={self.capacity}, target={self.target})"
