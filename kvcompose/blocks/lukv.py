"""LU-KV: head-wise budgets from a precomputed budget curve (global allocation over layers and KV heads).

"Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV Cache Eviction"
(LU-KV, arXiv 2602.08585); kvpress's `LUKVPress`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..allocators import Allocator
from ..fingerprint import check_fingerprint
from ..view import FAR_POSITION, KVComposeError, LayerView
from ._util import check_head_table, check_page_size, read_profile

__all__ = ["HeadCurves", "CURVES_KIND", "head_keep_counts", "RATIO_TOLERANCE"]

CURVES_KIND = "kvcompose.head_curves"
RATIO_TOLERANCE = 0.1
"""How far a curve's mean prune share may be from its ratio (row i: (i + 1) / 100) before `HeadCurves` refuses it."""


def head_keep_counts(prune: Float[Tensor, " H"], seq_len: int) -> Int[Tensor, " H"]:
    """kvpress LUKVPress's rounding: ideal keep counts `(1 - prune) * seq_len`, their rounded sum as the layer's
    total (at least one token per head), floors plus one for the largest fractional parts, clamped to
    `[1, seq_len]`."""
    h = prune.numel()
    ideal = (1.0 - prune.float()).clamp(0.0, 1.0) * seq_len
    total = int(torch.round(ideal.sum()).item())
    total = max(h, min(h * seq_len, total))
    base = torch.floor(ideal).long()
    rem = total - int(base.sum().item())
    if rem > 0:
        base[torch.topk(ideal - base, k=min(rem, h)).indices] += 1
    return base.clamp(min=1, max=seq_len)


class HeadCurves(Allocator):
    """LU-KV's allocation: a budget curve gives, for each global compression ratio `r` in 1%..99%, the share of
    its tokens each (layer, KV head) prunes; the layers' totals differ (the allocation is global).

    At an event of layer `l` whose row has seen `n` tokens (its left padding not counted) with cache budget `B`,
    `r = 1 - B / n` picks the curve's row
    `round(100 r) - 1` (clamped to 0..98), and head `h` keeps `(1 - prune[r, l, h]) * n` tokens, rounded as
    kvpress does (`head_keep_counts`) and never more than it holds. kvpress's `LUKVPress` runs at prefill, where
    `n` is the prompt: the same rule. During decoding `n` is every token seen, so a curve calibrated on full
    contexts keeps its meaning (the share of the sequence each head keeps); heads that hold fewer tokens than
    their share keep all of theirs. Paged storage (`uniform = False`).

    Curves: a `[99, layers, KV heads]` list in a profile (`kvcompose calibrate --target lukv`, which measures them on
    full-cache traces: for each ratio, the global top-k of every head's sorted attention mass) or LU-KV's own
    `.npy` curves loaded by the caller. Checked when given: finite shares in [0, 1], each row's mean within
    `RATIO_TOLERANCE` (0.1) of its ratio (curves that ignore their ratios are refused), and, when a cache is built,
    the shape `[99, layers, KV heads]` of its model and the fingerprint a calibrated profile records (architecture
    and a sample of the weights: curves of another model of the same shape are refused).

    Args:
        curves: a path or dict with `prune` `[99][L][H]`, or the array itself.
        floor: the fewest tokens a head keeps (kvpress: 1); at least what the pipeline's fixed protectors keep
            (checked when the cache is built: kvpress's sinks and window can be cut by a small head budget,
            kvcompose's protected tokens cannot).
        page_size: tokens per page of the paged storage.
    """

    uniform = False

    def __init__(self, curves: str | os.PathLike | dict | Any, floor: int = 1, page_size: int = 16):
        curves, self.path = read_profile("HeadCurves", curves, "lukv")
        data = curves.get("prune") if isinstance(curves, dict) else curves
        try:
            t = torch.as_tensor(data, dtype=torch.float32, device="cpu")
        except (TypeError, ValueError, RuntimeError):
            raise KVComposeError("HeadCurves: curves must be a [99, layers, KV heads] array of prune shares") from None
        if t.dim() != 3 or t.shape[0] != 99 or not bool(torch.isfinite(t).all()) or bool(((t < 0) | (t > 1)).any()):
            raise KVComposeError(f"HeadCurves: curves must be a [99, layers, KV heads] array of shares in [0, 1], "
                                 f"got shape {tuple(t.shape)}")
        # row i is the curve of the global ratio r = (i + 1) / 100: its heads prune r of the tokens on average (the
        # global top-k that calibrates it keeps 1 - r of them); curves that ignore their ratio would keep (or drop)
        # the same tokens whatever the budget
        ratios = torch.arange(1, 100, dtype=torch.float32, device="cpu") / 100
        off = (t.mean((1, 2)) - ratios).abs()
        if bool((off > RATIO_TOLERANCE).any()):
            i = int(off.argmax())
            raise KVComposeError(f"HeadCurves: the curves do not follow their ratios: row {i} (ratio {i + 1}%) prunes "
                                 f"{float(t[i].mean()):.0%} of the tokens on average, not about {i + 1}% (more than "
                                 f"{RATIO_TOLERANCE:.0%} off): the cache would not keep what the budget asks; "
                                 "calibrate them with `kvcompose calibrate --target lukv`")
        check_page_size("HeadCurves", page_size)
        if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
            raise KVComposeError(f"HeadCurves: floor must be a positive int, got {floor!r}")
        self.prune, self.page_size, self.floor = t, page_size, floor
        self.fingerprint = curves.get("fingerprint") if isinstance(curves, dict) else None
        self.model = curves.get("model") if isinstance(curves, dict) else None

    def bind_model(self, model: Any) -> None:
        """Refuse a model the curves were not calibrated on (their recorded fingerprint: architecture and weights)."""
        check_fingerprint("HeadCurves", {"fingerprint": self.fingerprint, "model": self.model}, model,
                          "calibrate curves with `kvcompose calibrate --target lukv`")

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        check_head_table("HeadCurves", tuple(self.prune.shape[1:]), num_layers, num_heads, "lukv")
        super().check(pipeline, budget, num_layers, num_heads)
        if budget is not None and pipeline.fixed_protection(budget) > self.floor:
            raise KVComposeError(f"HeadCurves: a head may keep only floor={self.floor} tokens, fewer than the "
                                 f"{pipeline.fixed_protection(budget)} its protectors keep: give floor >= that")

    def keep_counts(self, layer: int, budget: int, seen: int) -> Int[Tensor, " H"]:
        """Tokens each KV head of `layer` keeps at cache budget `budget` after `seen` tokens."""
        if seen <= budget:
            return torch.full((self.prune.shape[2],), max(seen, 1), dtype=torch.long, device=self.prune.device)
        idx = max(0, min(98, int(round((1.0 - budget / seen) * 100)) - 1))
        return head_keep_counts(self.prune[idx, layer], seen)

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        b, h, _ = view.shape
        if self.prune.shape[2] != h:
            raise KVComposeError(f"HeadCurves: the curves have {self.prune.shape[2]} KV heads, the layer {h}")
        # a row's own tokens: its left padding counts neither in the ratio nor among what a head holds, so a
        # padded row of a batch keeps what the row alone keeps
        seen = [view.seen] * b if view.padding is None else view.row_seen.tolist()  # a host read only when padded
        counts = {n: self.keep_counts(view.layer_idx, budget, n) for n in set(seen)}
        keep = torch.stack([counts[n] for n in seen]).to(view.device)  # [B, H]
        held = (view.valid & (view.positions < FAR_POSITION)).sum(-1).clamp(min=1)
        return torch.minimum(keep.clamp(min=min(self.floor, budget)), held)

    def __repr__(self) -> str:
        src = os.path.basename(self.path) if self.path else "array"
        return f"HeadCurves({src!r})"
