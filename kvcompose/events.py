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

from .hostsync import event_reads, with_host
from .pipeline import Pipeline, Selection
from .prefetch import Merged
from .segment import Segment
from .selectors import Selector, _kept_first
from .stores import StoreView
from .tiers import TierTokens, take_tokens
from .view import FAR_POSITION, KVComposeError, LayerView

__all__ = ["run_event", "leaving", "rows_over", "rows_due", "host_rows"]

# `layer` below is the `kvcompose.layer.ComposeLayer` that owns the segment (not imported: the layer imports us)


def host_rows(rows, device: torch.device) -> Bool[Tensor, " B"] | None:
    """Rows an event cuts, from a host answer (numpy or a list) or a device tensor; None: no row. The device
    tensor carries its host copy (`rows.host`), so the event does not read it back."""
    if isinstance(rows, Tensor):  # an allocator that answers on the device (one host sync)
        h = rows.cpu().numpy().astype(bool)
        if not h.any():
            return None
        rows.host = h
        return rows
    rows = np.asarray(rows, dtype=bool)
    if not rows.any():
        return None
    out = torch.from_numpy(rows).to(device, non_blocking=True)
    out.host = rows
    return out


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
    """One compression event of `seg` (see `ComposeLayer.compress`). Its host syncs are batched
    (`kvcompose.hostsync`): one read after the selection (every pending check, the kept counts when the host
    cannot derive them), before anything changes; a per-head allocator's budgets and a compressed tier's
    counts are the only other reads."""
    if budget is None:
        budget = layer.layer_budget(seg.start + seg.n)
    if budget is None:
        raise KVComposeError(f"layer {layer.layer_idx}: compressing needs a budget")
    layer._track_peak()  # the peak is reached just before a compaction
    with event_reads() as reads:
        view, channels, merged = layer.view(seg, rows, merged)
        sel, seg.blocks = pipe.select(view, budget, seg.blocks, channels)
        kept, order = sel.kept, sel.order
        b, h, t = view.shape
        dev = view.device
        rows_host = None if rows is None else getattr(rows, "host", None)
        if rows is not None and rows_host is None:
            rows_host = rows.cpu().numpy().astype(bool)  # a caller's device rows (one host sync)
        some_rows = rows_host is not None and not rows_host.all()
        if some_rows:
            # a row outside the event keeps what it held: its HBM tokens stay in HBM and, when the view merged
            # the tier's tokens in, those go back to the tier (kept as every candidate, they were all promoted to
            # HBM: a GrowPage row with a CompressedTier then held 39 tokens against a 16-slot page ceiling)
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
        tiered = pipe.tier.holds_tokens
        assign = merged is not None or sel.values is not None  # tier tokens merged in, or new values
        # the host values the rest needs: without padding the base selection over every row keeps
        # min(budget, T) slots per head, real ones first; else the counts are read, with every pending
        # check, before anything changes
        padded = seg.store.padded or (tiered and pipe.tier.padded(seg.tier))
        derive = sel.host_budget is not None and not some_rows and not padded and \
            type(pipe.selector).choose is Selector.choose  # the base rule keeps min(budget, T) per head
        want = []
        if not derive:
            want.append(n_kept)
        if not assign and not derive:
            want.append(seg.store.kept_counts(kept))
        got = reads.flush(*want)
        host_kept = np.minimum(sel.host_budget, t) if derive else got.pop(0)
        host_counts = host_kept if assign or derive else got.pop(0)
        with_host(n_kept, host_kept)
        if derive and not assign:
            host_counts = np.minimum(host_kept, seg.store.host_lengths)  # a head keeps at most what it holds
        if tiered:
            real = None  # real (non-padding-slot) candidates per head: the store's and the tier's
            if not padded:
                tc = pipe.tier.counts(seg.tier)
                real = seg.store.host_lengths + (0 if tc is None else tc)
            # with the tier's tokens merged in, a row outside the event hands its tier tokens back (rows=None)
            back = some_rows and merged is not None
            tokens = leaving(view, channels, order, n_kept, None if back else rows, host_kept,
                             None if back else rows_host, real)
            seen = seg.start + seg.n if view.padding is None else view.row_seen[:, None]
            seg.tier = pipe.tier.store(seg.tier, tokens, seen, n_kept, sel.protected)
        if assign:
            safe = kept.clamp(min=0)
            g = lambda x: take_tokens(x, safe)  # noqa: E731
            values = view.values if sel.values is None else sel.values
            seg.store.assign(StoreView(g(view.keys), g(values), g(view.positions), g(view.valid) & (kept >= 0)),
                             g(channels), n_kept, host_kept, None if padded else False)
        else:
            seg.store.compact(kept, host_counts)
        if seg.limits is not None:
            hb = sel.host_budget if sel.host_budget is not None else sel.budget.cpu().numpy()
            if rows is None:
                seg.set_limits(sel.budget, hb)
            else:
                seg.set_limits(torch.where(rows[:, None], sel.budget, seg.limits),
                               np.where(rows_host[:, None], hb, seg.host_limits))
    seg.store.fit(layer.room())
    seg.events += 1
    layer._track_peak()
    return sel


def leaving(view: LayerView, channels: Tensor, order: Int[Tensor, "B H T"], n_kept: Int[Tensor, "B H"],
            rows: Tensor | None, host_kept: np.ndarray | None = None, host_rows: np.ndarray | None = None,
            host_real: np.ndarray | None = None) -> TierTokens:
    """The candidates not kept, in priority order: `order[b, h, n_kept[b, h]:]`, padded per head (rows
    outside `rows` keep every token: nothing of theirs leaves). With `host_kept` (`n_kept` on the host, and
    `host_rows` with `rows`) the width is known without a host sync; with `host_real` too (the real candidates
    per head, when none is padding: the kept come first, then the real ones, then the view's padding slots)
    so are the real tokens that leave (`TierTokens.counts`)."""
    b, h, t = view.shape
    rest = t - n_kept
    counts = None
    if host_kept is not None:
        r = t - host_kept
        if rows is not None:
            r = np.where(host_rows[:, None], r, 0)
        m = int(r.max()) if r.size else 0
        if host_real is not None:
            counts = np.maximum(host_real - host_kept, 0)
            if rows is not None:
                counts = np.where(host_rows[:, None], counts, 0)
            counts = counts.astype(np.int64)
    else:
        m = int(rest.max()) if rest.numel() else 0
    j = torch.arange(m, device=view.device)
    idx = (n_kept[..., None] + j).clamp(max=max(t - 1, 0))
    slots = order.gather(-1, idx)
    inside = j < rest[..., None]
    if rows is not None:
        inside = inside & rows[:, None, None]
    g = lambda x: take_tokens(x, slots)  # noqa: E731
    pos = torch.where(inside, g(view.positions), torch.full_like(slots, FAR_POSITION) + j)
    return TierTokens(g(view.keys), g(view.values), pos, g(view.valid) & inside, g(channels), counts=counts,
                      padded=None if counts is None else False)
