"""KVCompose's composite tokens: per-head selections aligned into composite tokens, the same count per head.

Akulov et al., "KVCompose: Efficient Structured KV Cache Compression with Composite Tokens", arXiv 2509.05165;
kvpress's `KVComposePress`. (Not to be confused with this library, kvcompose: see docs/methods.md.)
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..scorers import Scorer
from ..selectors import Selector, _kept_first, indices_from_priority, priority_order
from ..kernels.ref import top_last
from ..view import KVComposeError, LayerView, warn_unused
from ._util import window_queries

__all__ = ["CompositeTokens", "AggregatedAttention"]


class AggregatedAttention(Scorer):
    """KVCompose's token score: the softmax attention (causal, over every held key) of each of the last `window`
    queries, aggregated over the queries (`task`: "max" or "mean") and over the query group (`group`: "mean"
    or "max"), optionally times `|v|`, plus the mean of the layer's heads (`head_mean`, for stability).

    kvpress's `KVComposePress` takes the attention of a separate question over the context at prefill (eager
    attention, max over queries, mean over the group, + mean over heads); during decoding kvcompose takes the
    last `window` queries of the reasoning trace. The same aggregation rule.

    Args:
        window: buffered queries (32). task: "max" or "mean" over queries. group: "mean" or "max" over the group.
        value_norm: multiply by `|v|` (False). head_mean: add the mean over the layer's KV heads (True).

    Shapes: queries `[B, Hq, W, D]`, keys `[B, H, T, D]` -> `[B, H, T]`.
    """

    def __init__(self, window: int = 32, task: Literal["max", "mean"] = "max", group: Literal["mean", "max"] = "mean",
                 value_norm: bool = False, head_mean: bool = True):
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise KVComposeError(f"AggregatedAttention: window must be a positive int, got {window!r}")
        if task not in ("max", "mean") or group not in ("max", "mean"):
            raise KVComposeError(f"AggregatedAttention: task and group must be 'max' or 'mean', got {task!r}, {group!r}")
        self.window, self.task, self.group = window, task, group
        self.value_norm, self.head_mean = bool(value_norm), bool(head_mean)

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        got = window_queries(view, self.window)
        if got is None:
            return torch.zeros(view.shape, device=view.device)
        q, qpos, qok = got
        b, h, t, d = view.keys.shape
        g = q.shape[1] // h
        logits = torch.einsum("bhgwd,bhtd->bhgwt", q.float().reshape(b, h, g, -1, d), view.keys.float()) * view.scale
        seen = (view.positions[:, :, None, :] <= qpos[None, None, :, None]) & view.valid[:, :, None, :]  # [B, H, W, T]
        p = torch.softmax(logits.masked_fill(~seen[:, :, None], float("-inf")), dim=-1).nan_to_num(0.0)
        ok = qok[:, None, None, :, None]
        if self.task == "max":
            s = p.masked_fill(~ok, 0.0).amax(3)
        else:
            s = (p * ok).sum(3) / ok.sum(3).clamp(min=1)
        s = s.mean(2) if self.group == "mean" else s.amax(2)  # [B, H, T]
        if self.value_norm:
            s = s * view.values.float().norm(dim=-1)
        s = s.masked_fill(~view.valid, 0.0)
        if self.head_mean:
            s = s + s.mean(1, keepdim=True)
        return s.masked_fill(~view.valid, 0.0)

    def __repr__(self) -> str:
        return (f"AggregatedAttention(window={self.window}, task={self.task!r}, group={self.group!r}"
                f"{', value_norm=True' if self.value_norm else ''}{'' if self.head_mean else ', head_mean=False'})")


class CompositeTokens(Selector):
    """KVCompose's selection within a layer. Each head sorts its tokens by score; the j-th composite token of a
    row is made of every head's j-th best token (positions differ per head; each head's kept tokens stay in
    time order in its own slots).

    - `structured=True`: every KV head of a row keeps the same number of tokens, the smallest budget of the
      row's heads (each head stays within its own budget): whole composite tokens, the shape a dense cache or a
      paged engine with one block table per layer holds.
    - `structured=False`: the row's total `sum_h budget[b, h]` goes to the (head, token) pairs of highest score
      across the layer's heads (each head keeps at least `floor` tokens): head counts differ, so the layer lives
      in paged storage (`ragged = True`).

    The same rule as kvpress's `KVComposePress` within one layer. The unstructured variant with a floor is also
    AdaKV's rule (Feng et al., arXiv 2407.11550; kvpress's `AdaKVPress`: each head first keeps its top
    `alpha_safeguard = 0.2` share of the budget, then a top-k over the layer's heads): `floor=0.2`. kvpress also allocates *across layers* at
    prefill (a global top-k over every layer's composite scores, the first layer at least the largest); kvcompose
    compresses a layer at a time during decoding, with the layer's budget from the allocator: pair it with a
    per-layer schedule (`Pyramid`, `ReasoningWave`, `HeadCurves`' layer totals) for a cross-layer split.

    Protected tokens are kept first (a head whose protected tokens exceed the structured count keeps them all).

    Args:
        structured: composite (equal per-head counts) or unstructured (per-head counts from a global top-k).
        floor: unstructured only: tokens every head keeps at least, an int (kvpress KVCompose's
            `keep_token_lower_bound`, 0; at least 1 is always kept) or a share of the head's budget (AdaKV's
            `alpha_safeguard`, e.g. 0.2). The floor counts the head's protected tokens and is capped at its
            budget, so what the heads are forced to keep fits in the row's total `sum_h budget[b, h]`.
    """

    def __init__(self, structured: bool = True, floor: int | float = 0):
        if (isinstance(floor, bool) or not isinstance(floor, (int, float)) or floor < 0
                or (isinstance(floor, float) and floor > 1)):
            raise KVComposeError(f"CompositeTokens: floor must be an int >= 0 or a share in [0, 1], got {floor!r}")
        self.structured, self.floor = bool(structured), floor
        if self.structured and floor:
            warn_unused(f"CompositeTokens(floor={floor})", "structured=True keeps the same count in every head "
                        "(the floor is for the unstructured variant)")
        self.ragged = not self.structured

    def priority(self, scores, valid, generator):
        return scores

    def _floor(self, budget: Int[Tensor, "*S"]) -> Int[Tensor, "*S"]:
        """The floor before the cap at the budget: a share of `budget` (truncated) or a count, at least 1 (the one
        rule `counts` and `floor_count` both use)."""
        if isinstance(self.floor, float):
            return (budget.double() * self.floor).long().clamp(min=1)
        return torch.full_like(budget, max(int(self.floor), 1))

    def floor_count(self, budget: int) -> int:
        """Tokens every head keeps at least when its budget is `budget` and it holds that many (unstructured): the
        floor (a share of `budget`, or a count), at least 1, at most `budget`."""
        return min(int(self._floor(torch.tensor(int(budget)))), int(budget))

    def head_bound(self, budget: int, heads: int) -> int:
        """Unstructured: the layer's total less the floor every other head keeps, `heads * budget - (heads - 1) *
        floor_count(budget)` (AdaKV at `alpha=0.2`, 3 heads: 2.6x the budget instead of 3x); structured: the
        budget."""
        if self.structured:
            return budget
        return heads * budget - (heads - 1) * self.floor_count(budget)

    def counts(self, scores: Float[Tensor, "B H T"], protected: Bool[Tensor, "B H T"], valid: Bool[Tensor, "B H T"],
               budget: Int[Tensor, "B H"]) -> Int[Tensor, "B H"]:
        """Tokens each (row, head) keeps."""
        b, h, t = valid.shape
        total = budget.sum(-1)  # [B]
        n_real = valid.sum(-1)
        if self.structured:
            # like TopK, a head with fewer real tokens than its budget keeps padding slots too (dense rows stay equal)
            return budget.amin(-1, keepdim=True).expand(b, h).clamp(min=1, max=t)
        # unstructured: a global top-(total) over the row's (head, token) pairs, protected and floor first
        lo = self._floor(budget)
        # the floor counts the head's protected tokens and never exceeds its budget: what every head is forced to
        # keep then fits in the row's total (a floor on top of the protected tokens kept 13 of a total of 12)
        n_prot = (protected & valid).sum(-1)
        lo = (torch.minimum(torch.minimum(lo, budget), n_real) - n_prot).clamp(min=0)
        free = scores.masked_fill(~valid | protected, float("-inf"))
        rank = torch.sort(torch.sort(free, dim=-1, descending=True, stable=True).indices, dim=-1).indices
        key = torch.nan_to_num(scores.float(), nan=-3e38, posinf=3e38, neginf=-3e38).clamp(-1e30, 1e30)
        key = torch.where(protected | (rank < lo[..., None]), torch.full_like(key, 3e38), key)
        key = torch.where(valid, key, torch.full_like(key, -3.4e38)).reshape(b, h * t)
        n = int(total.max().clamp(max=h * t))
        top = top_last(key, n)  # [B, n]
        take = torch.arange(n, device=valid.device)[None, :] < total[:, None]
        head = torch.where(take, top // t, torch.full_like(top, h))
        cnt = torch.zeros(b, h + 1, dtype=torch.long, device=valid.device).scatter_add_(1, head, torch.ones_like(head))
        return torch.minimum(cnt[:, :h], n_real)

    def choose(self, scores, protected, valid, budget, generator=None, need_order=False, positions=None, *,
               host_budget=None, may_overflow=True):
        if scores is None:
            raise KVComposeError("CompositeTokens needs scores but the pipeline has no scorer")
        if (budget <= 0).any():
            raise KVComposeError(f"budget must be positive, got min {int(budget.min())}")
        per_head = torch.maximum(self.counts(scores, protected, valid, budget), (protected & valid).sum(-1))
        finite = torch.nan_to_num(scores.float(), nan=-3e38, posinf=3e38, neginf=-3e38).clamp(-1e30, 1e30)
        pri = torch.where(protected, torch.full_like(finite, 3e38), finite)
        pri = torch.where(valid, pri, torch.full_like(finite, -3e38))
        kept = indices_from_priority(pri, per_head)
        if not need_order:
            return kept, None
        return kept, _kept_first(priority_order(scores.float(), protected, valid), kept)

    def __repr__(self) -> str:
        return f"CompositeTokens(structured={self.structured}{f', floor={self.floor}' if self.floor else ''})"
