"""CaM: cache merging, evicted values folded into the kept tokens that follow them, by a Bernoulli draw.

Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024
(openreview LCTmppB165); kvpress's `CAMPress`.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..block import Block
from ..seeding import bernoulli
from ..view import AttentionStep, KVComposeError, LayerSpec, LayerView
from .merging import Merger, evicted_slots

__all__ = ["CAM", "DecodeAttention", "EventClock"]


class DecodeAttention(Block):
    """Token state: the softmax attention every decoding query gave each held key, averaged over its query group
    and summed over the steps (CaM's `A`). The prompt's forward is skipped, as kvpress's CAMPress starts its
    running sum at the first decoding step.

    A forward of Q queries adds what Q one-token forwards would (each query's softmax over the keys its mask
    lets it see), so a chunk of decoded tokens, as the fidelity bench feeds them, accumulates the same state
    as decoding them one by one. The prompt is told apart per row without a host sync: it is the forward
    whose attended keys are all its own new tokens (no valid key older than the step's Q newest positions)."""

    token_state = 1

    def observe(self, state: Float[Tensor, "B H T"], step: AttentionStep) -> Float[Tensor, "B H T"]:
        queries, keys = step.queries, step.keys
        b, hq, q, d = queries.shape
        h = keys.shape[1]
        g = hq // h
        logits = torch.einsum("bhgqd,bhtd->bhgqt", queries.float().reshape(b, h, g, q, d), keys.float()) * step.scale
        seen = step.valid[:, :, None, :] if step.mask is None else step.valid[:, :, None, :] & step.mask  # [B, H, Q|1, T]
        logits = logits.masked_fill(~seen[:, :, None], float("-inf"))
        add = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(2).sum(2)  # [B, H, T]
        # decoding iff some valid key is older than the step's own q tokens (positions q below the newest)
        newest = torch.where(step.valid, step.positions, torch.full_like(step.positions, -1)).amax(-1, keepdim=True)
        decoding = (step.valid & (step.positions <= newest - q)).any(-1, keepdim=True)  # [B, H, 1]
        return state + add * decoding

class EventClock(Block):
    """Layer state: per row, the tokens seen at the layer's last compression event (the prompt length before the
    first), so a block knows how many tokens arrived since."""

    def init(self, spec: LayerSpec) -> Int[Tensor, " B"]:
        return torch.full((spec.batch,), -1, dtype=torch.long, device=spec.device)

    @staticmethod
    def since(state: Int[Tensor, " B"], view: LayerView) -> Int[Tensor, " B"]:
        last = torch.where(state < 0, torch.full_like(state, view.prompt_length), state)
        return (view.seen - last).clamp(min=0)

    @staticmethod
    def tick(state: Int[Tensor, " B"], view: LayerView) -> Int[Tensor, " B"]:
        now = torch.full_like(state, view.seen)
        return now if view.rows is None else torch.where(view.rows, now, state)

    def __repr__(self) -> str:
        return "EventClock()"


class CAM(Merger):
    """CaM's merge, per (row, KV head): of the tokens evicted at this event, the `k` most worth keeping (by the
    selector's priority order, newest first among equals; `k` = tokens seen since the layer's last event)
    are merge candidates. A candidate's window is the `window` kept tokens right after it in time order; it
    merges with probability `clamp(A_i / mean(A_window), 0, 1)` (A: accumulated decoding attention,
    `DecodeAttention`), drawn from the layer's generator; a merging candidate adds `v_i / |window|` to the value
    of every token of its window.

    The same rule as kvpress's `CAMPress` (which extends the per-step original to one merge per interval), on
    kvcompose's kept set: kvpress's press keeps one set for all heads of a layer (its base press's scores
    averaged over the heads) and ranks candidates by that mean; here the pipeline's selector decides the kept
    set and the ranking, per head unless the selector shares them.

    Args:
        window: kept tokens each candidate merges into (kvpress's `merge_budget`, 32).

    Shapes: values `[B, H, T, Dv]`; state `(A [B, H, T], last event [B])`.
    """

    draws_random = True  # the Bernoulli merge decisions
    # draws_per_row stays False: the draw's width is the rows' largest candidate count, so a row grouped with
    # others may draw another shape than alone

    def __init__(self, window: int = 32):
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise KVComposeError(f"CAM: window must be a positive int, got {window!r}")
        self.window = window
        self._parts = (DecodeAttention(), EventClock())

    def children(self) -> tuple[Block, ...]:
        return self._parts

    def candidates(self, kept: Int[Tensor, "B H K"], evicted: Bool[Tensor, "B H T"], order: Int[Tensor, "B H T"],
                   k: Int[Tensor, " B"]) -> tuple[Int[Tensor, "B H C"], Bool[Tensor, "B H C"]]:
        """The merge candidates of each (row, head), ascending by slot: the first `k[b]` evicted slots of `order`."""
        b, h, t = evicted.shape
        rank_of = torch.empty_like(order).scatter_(-1, order, torch.arange(t, device=order.device).expand(b, h, t))
        e_idx, e_ok = evicted_slots(evicted)
        key = torch.where(e_ok, rank_of.gather(-1, e_idx), torch.full_like(e_idx, t))
        by_rank = key.sort(-1).indices  # evicted, most worth keeping first
        c = min(int(k.max()) if k.numel() else 0, e_idx.shape[-1])
        pick = by_rank[..., :c]
        ok = (torch.arange(c, device=order.device) < k[:, None, None]) & e_ok.gather(-1, pick)
        slots = torch.where(ok, e_idx.gather(-1, pick), torch.full_like(pick, t))
        slots, o = slots.sort(-1)
        return slots.clamp(max=t - 1), ok.gather(-1, o)

    def merge(self, view, kept, evicted, order, state: Any = None):
        attn, clock = state if state is not None else (None, None)
        b, h, t, dv = view.values.shape
        if attn is None:
            attn = torch.zeros(b, h, t, device=view.device)
        if clock is None:
            clock = torch.full((b,), -1, dtype=torch.long, device=view.device)
        cand, c_ok = self.candidates(kept, evicted, order, EventClock.since(clock, view))
        values = view.values.float()
        if cand.shape[-1] and kept.shape[-1]:
            n_kept = (kept >= 0).sum(-1, keepdim=True)
            kept_sorted = torch.where(kept >= 0, kept, torch.full_like(kept, t)).contiguous()
            start = torch.searchsorted(kept_sorted, cand.contiguous(), right=True)  # [B, H, C]
            win = start[..., None] + torch.arange(self.window, device=view.device)  # [B, H, C, M] into kept
            win_ok = win < n_kept[..., None]
            slots = kept.clamp(min=0).gather(-1, win.clamp(max=kept.shape[-1] - 1).reshape(b, h, -1)).reshape(win.shape)
            size = win_ok.sum(-1)  # [B, H, C]
            mean = (attn.gather(-1, slots.reshape(b, h, -1)).reshape(win.shape) * win_ok).sum(-1) / size.clamp(min=1)
            p = attn.gather(-1, cand) / mean
            p = torch.where(torch.isnan(p), torch.zeros_like(p), p)
            p = torch.where(torch.isinf(p), torch.ones_like(p), p).clamp(0, 1)
            draw = bernoulli(p, view.generator).to(view.device)
            scale = draw * (c_ok & (size > 0)).float() / size.clamp(min=1).float()
            ve = values.gather(2, cand[..., None].expand(*cand.shape, dv))
            contrib = (ve * scale[..., None])[:, :, :, None, :] * win_ok[..., None]  # [B, H, C, M, Dv]
            values = values.clone().scatter_add_(2, slots.reshape(b, h, -1, 1).expand(b, h, win.shape[2] * win.shape[3], dv),
                                                 contrib.reshape(b, h, -1, dv))
        return values, (attn, EventClock.tick(clock, view))

    def __repr__(self) -> str:
        return f"CAM(window={self.window})"
