"""Prefetchers: bring a layer's host-tier / compressed-tier tokens back before its attention.

"Not All Thoughts Need HBM" (abstract only): tokens in host memory are prefetched at full precision
before attention, so they contribute exactly the terms they would have contributed from HBM.

Exactness: `Prefetcher.merge` puts hot (HBM) and fetched tokens together sorted by original position.
Every layer holds its HBM tokens in position order too, so the merged keys / values are, element for
element and in the same order, what an all-HBM cache holding the same token set would hold, and
attention over them is bit-identical (tests/test_tiers.py checks `torch.equal` on outputs and logits).

Overlap (CUDA only, `device.type == "cuda"`): when layer i needs its tokens, the prefetcher takes the
copy started during layer i-1 (or fetches now), then starts layer i+1's host-to-device copy on the side
transfer stream, so the next layer's transfer overlaps this layer's compute. At most `lookahead` copies
are in flight beyond the one being consumed; each is tagged with the store's content version and the
layer's state object and is dropped if the content changed (compression event, beam reorder, reset)
before use. The compute stream waits on the copy's event (never the host), and the copied tensors are
`record_stream`-ed on the compute stream; see `kvcompose.tiers.HostStash` for the device-to-host side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .tiers import TierTokens, flat_index, take_tokens
from .view import KVComposeError

__all__ = ["Prefetcher", "Merged"]


@dataclass
class Merged:
    """Hot and fetched tokens of one layer, merged in position order ("Not All Thoughts Need HBM": tokens
    prefetched from host memory contribute exactly what they would from HBM).

    Attributes:
        keys: `[B, H, T, D]`, values `[B, H, T, Dv]`, positions / valid `[B, H, T]` with T = held + N.
        order: `[B, H, T]` for each merged slot, its index in `cat(hot, fetched)`; `flat` the same as rows
            of the flattened `[B * H * T]` concatenation.
        held: hot (HBM) tokens, the first `held` of that concatenation.
        fetched: the tier tokens (N per row and head), in the store's `fetch` order.
        stamp: `(seen, held, tier version)` when it was built; the cache reuses a merge only if it matches.
    """

    keys: Float[Tensor, "B H T D"]
    values: Float[Tensor, "B H T Dv"]
    positions: Int[Tensor, "B H T"]
    valid: Bool[Tensor, "B H T"]
    order: Int[Tensor, "B H T"]
    flat: Int[Tensor, " BHT"]
    held: int
    fetched: TierTokens
    stamp: tuple

    def merge_state(self, hot: Float[Tensor, "B H K"], name: str) -> Float[Tensor, "B H T"]:
        """Block state for the merged set: `hot` for HBM tokens, the store's state for fetched ones."""
        tier = self.fetched.state.get(name)
        if tier is None:
            tier = torch.zeros(self.fetched.positions.shape, dtype=hot.dtype, device=hot.device)
        return take_tokens(torch.cat([hot, tier.to(hot.device, hot.dtype)], dim=2), self.order, self.flat)

    def split(self, merged: Float[Tensor, "B H T"]) -> tuple[Tensor, Tensor]:
        """Undo the merge: `(hot part [B, H, held], tier part [B, H, N] in fetch order)`."""
        out = torch.empty(merged.numel(), dtype=merged.dtype, device=merged.device)
        out.index_copy_(0, self.flat, merged.reshape(-1))
        out = out.view(merged.shape)
        return out[..., : self.held], out[..., self.held :]

    def write_back(self, tier, tier_state: dict, name: str, merged: Float[Tensor, "B H T"]) -> Float[Tensor, "B H K"]:
        """Store the tier part of updated block state (`tier.write_state`, and this merge's snapshot, which a
        compression event of the same step reuses); return the hot part `[B, H, held]`."""
        hot, tier_part = self.split(merged)
        tier.write_state(tier_state, name, tier_part)
        self.fetched.state[name] = tier_part
        return hot


class Prefetcher:
    """Brings tier tokens back before attention and merges them with the hot tokens by position, the
    prefetch of "Not All Thoughts Need HBM" (abstract only). Hot `[B, H, K, D]` + fetched `[B, H, N, D]`
    -> merged `[B, H, K + N, D]` (see `Merged`).

    One per cache. `gather(layer)` is the cache's single entry point (attention and compression events);
    `merge(layer, fetched)` is the exact merge.

    Args:
        lookahead: layers fetched ahead on CUDA (1 = the next layer's copy overlaps this layer's compute;
            0 = no overlap, fetch when needed). Ignored off CUDA.
    """

    def __init__(self, lookahead: int = 1):
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise KVComposeError(f"lookahead must be an int >= 0, got {lookahead!r}")
        self.lookahead = lookahead
        self._pending: dict[int, tuple[dict, int, Any]] = {}

    def gather(self, layer) -> Merged | None:
        """The layer's hot + tier tokens in position order, or None when no tier holds any for it."""
        tier = layer.cache.pipeline.tier
        if not tier.holds_tokens:
            return None
        fetched = self._take(layer, tier)
        if self.lookahead and layer.device.type == "cuda":
            self._ahead(layer, tier)
        if fetched is None or fetched.n == 0:
            return None
        return self.merge(layer, fetched)

    def _take(self, layer, tier) -> TierTokens | None:
        p = self._pending.pop(layer.layer_idx, None)
        if p is not None:
            state, version, handle = p
            if state is layer.tier_state and version == tier.version(layer.tier_state):
                return handle.wait()
        return tier.fetch(layer.tier_state)

    def _ahead(self, layer, tier) -> None:
        layers = layer.cache.layers
        for j in range(1, self.lookahead + 1):
            nxt = layers[(layer.layer_idx + j) % len(layers)]
            if nxt is layer or not nxt.is_initialized or nxt.layer_idx in self._pending:
                continue
            handle = tier.start_fetch(nxt.tier_state)
            if handle is not None:
                self._pending[nxt.layer_idx] = (nxt.tier_state, tier.version(nxt.tier_state), handle)

    def clear(self) -> None:
        """Drop every copy in flight (their memory is released once the copies finish)."""
        self._pending.clear()

    def merge(self, layer, fetched: TierTokens) -> Merged:
        """Hot + fetched tokens sorted by original position (exact copies, no arithmetic)."""
        dev = layer.device
        fk, fv = fetched.keys.to(dev, non_blocking=True), fetched.values.to(dev, non_blocking=True)
        fpos, fvalid = fetched.positions.to(dev), fetched.valid.to(dev)
        pos = torch.cat([layer.positions, fpos], dim=2)
        order = pos.argsort(dim=-1, stable=True)
        flat = flat_index(order, order.shape[-1])
        g = lambda x: take_tokens(x, order, flat)  # noqa: E731
        return Merged(
            keys=g(torch.cat([layer.keys, fk], dim=2)),
            values=g(torch.cat([layer.values, fv], dim=2)),
            positions=g(pos),
            valid=g(torch.cat([layer.valid, fvalid], dim=2)),
            order=order,
            flat=flat,
            held=layer.held,
            fetched=fetched,
            stamp=(layer.seen, layer.held, layer.cache.pipeline.tier.version(layer.tier_state)),
        )

    def __repr__(self) -> str:
        return f"Prefetcher(lookahead={self.lookahead})"
