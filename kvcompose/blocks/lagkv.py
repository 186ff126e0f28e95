"""LagKV: score each partition of tokens against the next one (lag-relative, query-free).

Liang et al., "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important",
arXiv 2504.04704; kvpress's `LagKVPress`.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..scorers import Scorer
from ..view import KVComposeError, LayerView
from ._util import real_rank

__all__ = ["LagKV"]


def _partition_minmax(x: Float[Tensor, "B H T D"], part: Int[Tensor, "B H T"], inside: Bool[Tensor, "B H T"],
                      n_parts: int) -> tuple[Float[Tensor, "B H P D"], Float[Tensor, "B H P D"]]:
    """Per partition and channel, the min and max of `x` over the slots `inside` it."""
    b, h, t, d = x.shape
    idx = torch.where(inside, part, torch.full_like(part, n_parts))[..., None].expand(b, h, t, d)
    lo = torch.full((b, h, n_parts + 1, d), float("inf"), device=x.device).scatter_reduce(2, idx, x, "amin")
    hi = torch.full((b, h, n_parts + 1, d), float("-inf"), device=x.device).scatter_reduce(2, idx, x, "amax")
    return lo[:, :, :n_parts], hi[:, :, :n_parts]


class LagKV(Scorer):
    """LagKV's score: the real tokens after `sinks` are cut into partitions of `lag` consecutive tokens; each
    partition is scored against the next one (its reference): keys and values are min-max normalised per
    channel by the reference's range, the per-token standard deviation over channels is soft-maxed within the
    partition, keys and values averaged, and the token's rank within its partition (divided by `lag`) is the
    score. The sinks and the last full partition with the remainder (no reference yet) score 1, so they are
    kept; with fewer than `sinks + 2 lag` real tokens the score rises with recency (kvpress: "no compression").

    The same rule as kvpress's `LagKVPress` (`cross_scoring=True` returns the soft-maxed score instead of the
    rank, as there). kvpress cuts partitions by slot index; kvcompose by index among the *real* tokens of each
    (row, KV head), in position order (identical on a contiguous cache; padding is skipped). Query-free.

    Ranks repeat across partitions (every partition has a token of rank 0, 1/lag, ...), so many tokens tie:
    `tiebreak=True` (default) adds less than half a rank step growing with recency, so among equal ranks the
    newest token is kept, whatever the width of the view (kvpress leaves ties to `torch.topk`, whose order is
    unspecified; a left-padded row then could keep other tokens than the row alone).

    Args:
        sinks: leading tokens always kept (4).
        lag: partition size (128).
        cross_scoring: return the partition softmax instead of the rank (comparable across partitions).
        tiebreak: break equal ranks by recency (True; False: kvpress's scores exactly).

    Shapes: keys `[B, H, T, D]`, values `[B, H, T, Dv]` -> `[B, H, T]`.
    """

    def __init__(self, sinks: int = 4, lag: int = 128, cross_scoring: bool = False, tiebreak: bool = True):
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise KVComposeError(f"LagKV: sinks must be an int >= 0, got {sinks!r}")
        if isinstance(lag, bool) or not isinstance(lag, int) or lag <= 0:
            raise KVComposeError(f"LagKV: lag must be a positive int, got {lag!r}")
        self.sinks, self.lag, self.cross_scoring, self.tiebreak = sinks, lag, bool(cross_scoring), bool(tiebreak)

    def _states_score(self, x: Float[Tensor, "B H T E"], part: Int[Tensor, "B H T"],
                      scored: Bool[Tensor, "B H T"], member: Bool[Tensor, "B H T"], n_parts: int
                      ) -> Float[Tensor, "B H T"]:
        lo, hi = _partition_minmax(x, part, member, n_parts)
        ref = (part + 1).clamp(max=n_parts - 1)[..., None].expand(*part.shape, x.shape[-1])
        lo_r, hi_r = lo.gather(2, ref), hi.gather(2, ref)
        s = ((x - lo_r) / (hi_r - lo_r)).std(dim=-1)
        s = torch.where(scored, s, torch.full_like(s, float("-inf")))
        # softmax within each partition (stable: minus the partition's max)
        b, h, t = part.shape
        idx = torch.where(scored, part, torch.full_like(part, n_parts))
        mx = torch.full((b, h, n_parts + 1), float("-inf"), device=x.device).scatter_reduce(2, idx, s, "amax")
        e = torch.where(scored, (s - mx.gather(2, idx)).exp(), torch.zeros_like(s))
        tot = torch.zeros(b, h, n_parts + 1, device=x.device).scatter_add(2, idx, e)
        return e / tot.gather(2, idx).clamp(min=1e-38)

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        valid = view.valid
        rank = real_rank(valid)
        n = valid.sum(-1, keepdim=True)  # [B, H, 1]
        sink = valid & (rank < self.sinks)
        # fewer than sinks + 2 lag real tokens: ascending with recency after the sinks (kvpress's "no compression")
        ramp = (rank - self.sinks).float() / (n - self.sinks).clamp(min=1).float()
        short = n < self.sinks + 2 * self.lag
        n_full = ((n - self.sinks) // self.lag).clamp(min=0)  # full partitions
        end = self.sinks + n_full * self.lag
        part = ((rank - self.sinks).clamp(min=0)) // self.lag
        member = valid & ~sink & (rank < end)  # inside a full partition
        scored = member & (part < n_full - 1) & ~short  # partitions that have a reference
        n_parts = max(int(n_full.max()), 1)
        keys, values = view.keys.float(), view.values.float()
        s = (self._states_score(keys, part, scored, member, n_parts)
             + self._states_score(values, part, scored, member, n_parts)) / 2
        if not self.cross_scoring:
            # rank of each token within its partition (ascending score), divided by lag
            b, h, t = part.shape
            key = torch.where(scored, s, torch.full_like(s, float("inf")))
            o = torch.sort(key, dim=-1, stable=True).indices
            o = o.gather(-1, torch.sort(torch.where(scored, part, torch.full_like(part, n_parts)).gather(-1, o),
                                        dim=-1, stable=True).indices)
            pos_in_sorted = torch.empty_like(o).scatter_(-1, o, torch.arange(t, device=o.device).expand(b, h, t))
            start = torch.where(scored, part, torch.zeros_like(part)) * self.lag  # partitions are full
            # scored tokens of partition p occupy sorted slots [p * lag, (p + 1) * lag) (sinks have no rank here)
            s = (pos_in_sorted - start).float() / self.lag
            if self.tiebreak:  # newer wins among equal ranks: < half a rank step, so ranks never swap
                s = s + (0.5 / self.lag) * rank.float() / n.clamp(min=1).float()
        out = torch.where(scored, s, torch.ones_like(s))
        out = torch.where(short & ~sink, ramp, out)
        return out.masked_fill(~valid, 0.0)

    def __repr__(self) -> str:
        extra = (", cross_scoring=True" if self.cross_scoring else "") + ("" if self.tiebreak else ", tiebreak=False")
        return f"LagKV(sinks={self.sinks}, lag={self.lag}{extra})"
