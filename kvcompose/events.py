"""A compression event of one layer segment, and the rules that say when one is due.

An event is where the layer core may wait for the device (host syncs are allowed, counted by the tests):
the pipeline runs on a `LayerView` of the segment's tokens (HBM and tier, merged by position), the tier store
receives every candidate the selector did not keep (in its priority order), the store keeps the rest and is
sized for the next interval (`KVStore.fit`). The schedule itself (`rows_over`, `rows_due`) is decided from
host-side mirrors of lengths and limits, so asking whether an event is due costs no sync.

Shapes: B batch rows, H KV heads, T candidate tokens, K kept slots, C state channels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from .pipeline import Pipeline, Selection
from .prefetch import Merged
from .segment import Segment
from .selectors import _kept_first
from .stores import StoreView
from .tiers import TierTokens, take_tokens
from .view import FAR_POSITION, KVComposeError, LayerView

__all__ = ["run_event", "leaving", "rows_over", "rows_due", "host_rows"]

# `layer` below is the `kvcompose.layer.ComposeLayer` that owns the segment (not imported: the layer imports us)


def host_rows(rows, device: torch.device) -> Bool[Tensor, " B"] | None:
    """Rows an event cuts, from a host answer (numpy or a list) or a device tensor; None: no row."""
    if isinstance(rows, Tensor):  # an allocator that answers on the device (one host sync)
        return rows if bool(rows.any()) else None
    rows = np.asarray(rows, dtype=bool)
    return torch.from_numpy(rows).to(device, non_blocking=True) if rows.any() else None


def rows_over(layer: Any, seg: Segment) -> Bool[Tensor, " B"] | None:
    """Rows in which some head holds more real tokens than its limit (or too many slots); None: no row.
    Decided on the host from the mirrored lengths and limits unless the store holds padding."""
    budget = layer.layer_budget()
    if budget is None:
        return None
    store, interval = seg.store, layer.config.interval
    if not store.padded:
        lens = store.host_lengths
        limits = seg.host_limits if seg.host_limits is not None else budget
        return host_rows(((lens > limits) | (lens >= limits + interval)).any(-1), layer.device)
    real = store.valid_counts()
    limits = seg.limits if seg.limits is not None else torch.full_like(real, budget)
    return host_rows(((real > limits) | (store.lengths >= limits + interval)).any(-1), layer.device)


def rows_due(layer: Any, seg: Segment, decoded: int) -> Bool[Tensor, " B"] | None:
    """Rows the allocator's `EventTrigger.due` says need an event now (None: no row), asked with the
    host-side lengths and limits."""
    if layer.layer_budget() is None or seg.store is None:
        return None
    pipe = layer.config.pipeline
    state = seg.blocks[pipe.leaves.index(pipe.allocator)]
    rows = pipe.allocator.due(state, seg.store.host_lengths, seg.host_limits, decoded, layer.config.interval)
    return host_rows(rows, layer.device)


def run_event(layer: Any, seg: Segment, rows: Tensor | None, budget: int | None, pipe: Pipeline,
              merged: Merged | None) -> Selection:
    """One compression event of `seg` (see `ComposeLayer.compress`)."""
    if budget is None:
        budget = layer.layer_budget(seg.start + seg.n)
    if budget is None:
        raise KVComposeError(f"layer {layer.layer_idx}: compressing needs a budget")
    layer._track_peak()  # the peak is reached just before a compaction
    view, channels, merged = layer.view(seg, rows, merged)
    sel, seg.blocks = pipe.select(view, budget, seg.blocks, channels)
    kept, order = sel.kept, sel.order
    b, h, t = view.shape
    dev = view.device
    partial = rows is not None and not bool(rows.all())
    if partial:
        # a row outside the event keeps what it held: its HBM tokens stay in HBM and, when the view merged the
        # tier's tokens in, those go back to the tier (kept as every candidate, they were all promoted to HBM: a
        # GrowPage row with a CompressedTier then held 39 tokens against a 16-slot page ceiling)
        width = max(kept.shape[-1], t)
        slot = torch.arange(t, device=dev).expand(b, h, t)
        hot = view.positions < FAR_POSITION
        if merged is not None:
            hot = hot & (merged.order[..., :t] < merged.held)
        every = torch.where(hot, slot, torch.full_like(slot, t)).sort(-1).values
        every = torch.where(every < t, every, torch.full_like(every, -1))
        every = torch.cat([every, torch.full((b, h, width - t), -1, dtype=every.dtype, device=dev)], dim=-1)
        pad = torch.full((b, h, width - kept.shape[-1]), -1, dtype=kept.dtype, device=dev)
        kept = torch.where(rows[:, None, None], torch.cat([kept, pad], dim=-1), every)
        if order is not None and merged is not None:
            order = torch.where(rows[:, None, None], order, _kept_first(order, kept))
    n_kept = (kept >= 0).sum(-1)
    if pipe.tier.holds_tokens:
        # with the tier's tokens merged in, a row outside the event hands its tier tokens back (rows=None)
        seg.tier = pipe.tier.store(seg.tier, leaving(view, channels, order, n_kept,
                                                     None if partial and merged is not None else rows),
                                   view.row_seen[:, None], n_kept, sel.protected)
    if merged is not None or sel.values is not None:  # tier tokens merged in, or a Merger gave new values
        safe = kept.clamp(min=0)
        g = lambda x: take_tokens(x, safe)  # noqa: E731
        values = view.values if sel.values is None else sel.values
        seg.store.assign(StoreView(g(view.keys), g(values), g(view.positions), g(view.valid) & (kept >= 0)),
                         g(channels), n_kept)
    else:
        seg.store.compact(kept)
    if seg.limits is not None:
        seg.limits = sel.budget if rows is None else torch.where(rows[:, None], sel.budget, seg.limits)
    seg.store.fit(layer.room())
    seg.events += 1
    layer._track_peak()
    return sel


def leaving(view: LayerView, channels: Tensor, order: Int[Tensor, "B H T"], n_kept: Int[Tensor, "B H"],
            rows: Tensor | None) -> TierTokens:
    """The candidates not kept, in priority order: `order[b, h, n_kept[b, h]:]`, padded per head (rows
    outside `rows` keep every token: nothing of theirs leaves)."""
    b, h, t = view.shape
    rest = t - n_kept
    m = int(rest.max()) if rest.numel() else 0
    j = torch.arange(m, device=view.device)
    idx = (n_kept[..., None] + j).clamp(max=max(t - 1, 0))
    slots = order.gather(-1, idx)
    inside = j < rest[..., None]
    if rows is not None:
        inside = inside & rows[:, None, None]
    g = lambda x: take_tokens(x, slots)  # noqa: E731
    pos = torch.where(inside, g(view.positions), torch.full_like(slots, FAR_POSITION) + j)
    return TierTokens(g(view.keys), g(view.values), pos, g(view.valid) & inside, g(channels))
