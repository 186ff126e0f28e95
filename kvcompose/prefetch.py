"""Prefetchers: bring a layer's host-tier / compressed-tier tokens back before its attention.

"Not All Thoughts Need HBM" (abstract only): tokens in host memory are prefetched at full precision
before attention, so they contribute exactly the terms they would have contributed from HBM.

Exactness: `Prefetcher.merge` puts hot (HBM) and fetched tokens together sorted by original position.
Every store holds its tokens in position order too, so the merged keys / values are, element for element
and in the same order, what an all-HBM cache holding the same token set would hold, and attention over
them is bit-identical (tests check `torch.equal` on outputs and logits).

Overlap: when layer i needs its tokens, the prefetcher takes the copy started earlier (or fetches now);
the layer then asks it to start the copies of the next `lookahead` layers, wrapping around after the last
layer to the next step's first ones, so every transfer overlaps the compute of the layers before it,
layer 0's included. On CUDA the copies run on the side transfer stream and the compute stream waits on the
copy's event, never the host; on CPU a tier may run them on a copy thread (`HostTier(copy_thread=True)`)
to measure the overlap. Each copy in flight is tagged with the store's content version and state object
and is dropped if the content changed (compression event, beam reorder) before use.

A prefetcher is a replaceable part: pass `prefetcher=` to `KVComposeCache`. It sees tier stores and
their states only, never a layer or a cache.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .tiers import TierStore, TierTokens, flat_index, take_tokens
from .view import FAR_POSITION, KVComposeError

__all__ = ["Prefetcher", "Merged"]


@dataclass
class Merged:
    """Hot and fetched tokens of one layer, merged in position order.

    Attributes:
        keys: `[B, H, T, D]`, values `[B, H, T, Dv]`, positions / valid `[B, H, T]`, channels
            `[B, H, T, C]`, with T = hot + N.
        order: `[B, H, F]` for each merged slot before the cut (F = `full`), its index in `cat(hot, fetched)`;
            `flat` the same as rows of the flattened `[B * H * F]` concatenation.
        held: hot (HBM) slots, the first `held` of that concatenation.
        fetched: the tier tokens (N per row and head), in the store's `fetch` order.
        stamp: what the merge was built from; the layer reuses a merge only while it matches.
        full: slots of the whole concatenation; the merged tensors keep only the first T (padding slots of
            ragged heads, past every real token, are cut where no head needs them), so attention over a set
            whose heads all hold the same tokens has no padding columns and is bit-identical to an all-HBM
            cache's.
    """

    keys: Float[Tensor, "B H T D"]
    values: Float[Tensor, "B H T Dv"]
    positions: Int[Tensor, "B H T"]
    valid: Bool[Tensor, "B H T"]
    channels: Float[Tensor, "B H T C"]
    order: Int[Tensor, "B H F"]  # F = full: every slot of the concatenation (T <= F after the cut)
    flat: Int[Tensor, " BHF"]
    held: int
    fetched: TierTokens
    stamp: tuple
    full: int

    def split(self, merged: Float[Tensor, "B H T C"]) -> tuple[Tensor, Tensor]:
        """Undo the merge on channels: `(hot part [B, H, held, C], tier part [B, H, N, C] in fetch order)`."""
        b, h, t, c = merged.shape
        if t < self.full:
            merged = torch.cat([merged, merged.new_zeros(b, h, self.full - t, c)], dim=2)
        t = self.full
        out = torch.empty(b * h * t, c, dtype=merged.dtype, device=merged.device)
        out.index_copy_(0, self.flat, merged.reshape(-1, c))
        out = out.view(b, h, t, c)
        return out[:, :, : self.held], out[:, :, self.held :]


class Prefetcher:
    """Brings tier tokens back before attention and merges them with the hot tokens by position, the
    prefetch of "Not All Thoughts Need HBM" (abstract only). Hot `[B, H, K, D]` + fetched `[B, H, N, D]`
    -> merged `[B, H, K + N, D]` (see `Merged`).

    Args:
        lookahead: layers whose copies are started ahead (1 = the next layer's copy overlaps this layer's
            compute, the last layer starts the next step's layer 0; 0 = no overlap, fetch when needed). Only
            tiers with an asynchronous transfer (CUDA, or a CPU copy thread) start copies ahead.
    """

    def __init__(self, lookahead: int = 1):
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise KVComposeError(f"lookahead must be an int >= 0, got {lookahead!r}")
        self.lookahead = lookahead
        self._pending: dict[Hashable, tuple[Any, int, Any]] = {}

    def fetch(self, tier: TierStore, state: Any, key: Hashable,
              ahead: Sequence[tuple[Hashable, Any]] = ()) -> TierTokens | None:
        """The tokens `tier` holds in `state` (a layer's tier state, `key` naming it), using a copy started
        earlier if its content is still current; then `start` the first `lookahead` of `ahead` (the next
        layers' `(key, state)`, in the order they will be needed)."""
        fetched = None
        p = self._pending.pop(key, None)
        if p is not None and p[0] is state and p[1] == tier.version(state):
            fetched = p[2].wait()
        elif state:
            fetched = tier.fetch(state)
        for k, st in list(ahead)[: self.lookahead]:
            self.start(tier, st, k)
        return fetched

    def start(self, tier: TierStore, state: Any, key: Hashable) -> None:
        """Begin the copy of `state`'s tokens now (if the tier can overlap it and none is in flight)."""
        if not state or key in self._pending:
            return
        handle = tier.start_fetch(state)
        if handle is not None:
            self._pending[key] = (state, tier.version(state), handle)

    @property
    def in_flight(self) -> int:
        """Copies started and not yet used."""
        return len(self._pending)

    def clear(self) -> None:
        """Drop every copy in flight (their memory is released once the copies finish)."""
        self._pending.clear()

    @staticmethod
    def merge(keys: Float[Tensor, "B H K D"], values: Float[Tensor, "B H K Dv"], positions: Int[Tensor, "B H K"],
              valid: Bool[Tensor, "B H K"], channels: Float[Tensor, "B H K C"], fetched: TierTokens,
              stamp: tuple = (), width: int | None = None) -> Merged:
        """Hot + fetched tokens sorted by original position (exact copies, no arithmetic). `width`: the most
        real tokens of any (row, head) (from host-side counts; None: counted on the device, a host sync)."""
        dev = keys.device
        fk, fv = fetched.keys.to(dev, non_blocking=True), fetched.values.to(dev, non_blocking=True)
        pos = torch.cat([positions, fetched.positions.to(dev)], dim=2)
        order = pos.argsort(dim=-1, stable=True)
        full = order.shape[-1]
        if width is None:
            width = int((pos < FAR_POSITION).sum(-1).max()) if pos.numel() else 0
        flat = flat_index(order, full)
        cut = order[..., :width]
        cut_flat = flat_index(cut, full)
        g = lambda x: take_tokens(x, cut, cut_flat)  # noqa: E731
        return Merged(
            keys=g(torch.cat([keys, fk], dim=2)),
            values=g(torch.cat([values, fv], dim=2)),
            positions=g(pos),
            valid=g(torch.cat([valid, fetched.valid.to(dev)], dim=2)),
            channels=g(torch.cat([channels, fetched.channels.to(dev)], dim=2)),
            order=order,
            flat=flat,
            held=keys.shape[2],
            fetched=fetched,
            stamp=stamp,
            full=full,
        )

    def __repr__(self) -> str:
        return f"Prefetcher(lookahead={self.lookahead})"
