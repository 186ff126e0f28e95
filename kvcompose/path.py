"""The tokens one attention call of a layer sees, when they are more than one store alone: `PathTokens`.

A layer's path is its segments (one for a plain cache, the active branch's nodes for a tree), and a
segment's tokens are its store's plus what its tier holds. When the path is one store with nothing in a
tier and no observer needs the padded view, the store itself attends (over its own layout: unmasked SDPA,
or the paged kernel). Otherwise `gather` builds one padded view: each segment's held tokens, merged by
position with its tier's tokens (exact copies, so the result is element for element what an all-HBM cache
holding the same tokens holds), the segments concatenated oldest first, and `PathTokens.attend` runs the
exact math of `kvcompose.attention_math` over it. Masking follows the same rule as the stores: a mask only
when the view is really ragged, decided from host-side counts (store lengths, tier counts), so tiered and
all-HBM decoding attend identically and neither waits for the device.

The view is transient: built for one attention call (and, when that call ends in a compression event, the
event of the same step, which receives it explicitly), never kept by the layer.

Shapes: B batch rows, H KV heads, T slots of the view, D / Dv head dims, C state channels.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from .attention_math import attend_tokens
from .prefetch import Merged, Prefetcher
from .stores import StoreView
from .tiers import TierStore

__all__ = ["PathTokens", "Part", "gather", "segment_part"]


@dataclass
class Part:
    """One segment's share of a `PathTokens` view: `width` slots, from its store alone or merged with its
    tier's tokens (`merged`)."""

    segment: Any
    width: int
    merged: Merged | None
    ragged: bool


class PathTokens:
    """A padded view of every token one attention call sees: `keys [B, H, T, D]`, `values [B, H, T, Dv]`,
    `positions` / `valid [B, H, T]`, `channels [B, H, T, C]` (None unless asked for), built by `gather`.

    Attributes:
        ragged: host-side: some slot is not a real token (padding, or (row, head)s of unequal length).
        parts: the segments it was built from, oldest first.
        mask: the mask of the last `attend` (None: unmasked).
    """

    __slots__ = ("keys", "values", "positions", "valid", "channels", "ragged", "parts", "mask", "__weakref__")

    def __init__(self, view: StoreView, channels: Tensor | None, ragged: bool, parts: list[Part]):
        self.keys, self.values, self.positions, self.valid = view
        self.channels = channels
        self.ragged = ragged
        self.parts = parts
        self.mask: Tensor | None = None

    def attend(self, query: Float[Tensor, "B Hq Q D"], seen: int, scale: float, sliding_window: int | None = None,
               softcap: float | None = None, sinks: Float[Tensor, " Hq"] | None = None) -> Float[Tensor, "B Q Hq Dv"]:
        """Exact attention over the view (`kvcompose.attention_math`); remembers the mask it used."""
        out, self.mask = attend_tokens(query, self.keys, self.values, self.positions, self.valid, self.ragged, seen,
                                       scale, sliding_window, softcap, sinks)
        return out

    def write_channels(self, channels: Float[Tensor, "B H T C"], tier: TierStore) -> None:
        """Hand new token state back to where each token lives: its segment's store, or its tier."""
        off = 0
        for p in self.parts:
            ch = channels[:, :, off : off + p.width]
            off += p.width
            if p.merged is None:
                p.segment.store.write_channels(ch)
            else:
                hot, tier_part = p.merged.split(ch)
                p.segment.store.write_channels(hot)
                p.segment.tier = tier.write_channels(p.segment.tier, tier_part)
                p.merged.channels = ch
        self.channels = channels

    def merged_of(self, segment: Any) -> Merged | None:
        """The merge of `segment` with its tier tokens, if this view is that segment alone."""
        if len(self.parts) == 1 and self.parts[0].segment is segment:
            return self.parts[0].merged
        return None


def has_tier_tokens(tier: TierStore, state: Any) -> bool:
    """Whether a segment's tier state holds tokens attention must see (host-side; a tier that does not
    mirror its counts, `TierStore.counts` None, is assumed to hold some: it is fetched and counted)."""
    if not tier.holds_tokens or not state:
        return False
    counts = tier.counts(state)
    return counts is None or bool(counts.any())


def segment_part(segment: Any, tier: TierStore, prefetcher: Prefetcher, channels: bool,
                 ahead: Sequence[tuple[Hashable, Any]] = ()) -> tuple[StoreView, Tensor | None, Part]:
    """A segment's tokens: its store's view, merged by position with its tier's tokens when it holds some
    (fetched through `prefetcher`, which then starts the copies of `ahead`)."""
    store = segment.store
    view = store.view()
    if has_tier_tokens(tier, segment.tier):
        fetched = prefetcher.fetch(tier, segment.tier, segment, ahead)
        if fetched is not None and fetched.n:
            counts = tier.counts(segment.tier)
            if counts is None:  # a tier without host-side counts: sized on the device (a host sync), masked
                m = Prefetcher.merge(view.keys, view.values, view.positions, view.valid, store.read_channels(),
                                     fetched)
                width, ragged = m.keys.shape[2], True
            else:
                totals = store.host_lengths + counts
                width = int(totals.max())
                m = Prefetcher.merge(view.keys, view.values, view.positions, view.valid, store.read_channels(),
                                     fetched, width=width)
                ragged = store.padded or tier.padded(segment.tier) or int(totals.min()) != width
            return StoreView(m.keys, m.values, m.positions, m.valid), m.channels, Part(segment, width, m, ragged)
    elif ahead:
        for key, state in list(ahead)[: prefetcher.lookahead]:
            prefetcher.start(tier, state, key)
    ch = store.read_channels() if channels else None
    return view, ch, Part(segment, view.keys.shape[2], None, store.ragged)


def gather(segments: Sequence[Any], tier: TierStore, prefetcher: Prefetcher, channels: bool,
           ahead: Sequence[tuple[Hashable, Any]] = ()) -> PathTokens:
    """One padded view of the segments' tokens (each merged with its tier's), oldest first."""
    views, chans, parts = [], [], []
    for i, seg in enumerate(segments):
        v, ch, part = segment_part(seg, tier, prefetcher, channels, ahead if i == len(segments) - 1 else ())
        views.append(v)
        chans.append(ch)
        parts.append(part)
    if len(views) == 1:
        view, ch = views[0], chans[0]
    else:
        view = StoreView(*(torch.cat([getattr(v, f) for v in views], dim=2) for f in StoreView._fields))
        ch = torch.cat(chans, dim=2) if channels else None
    # parts that are each real and equally long per head concatenate into a view that is too
    return PathTokens(view, ch, any(p.ragged for p in parts), parts)
