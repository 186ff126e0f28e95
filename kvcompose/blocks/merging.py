"""Merging: a pipeline part that folds the values of evicted tokens into kept ones instead of dropping them.

The `Merger` role runs after the selector (and after the tier store decided what it keeps off HBM), on the
tokens that leave the layer for good: `merger(view, kept, evicted, order, state) -> (values, state)`, where
`values` is `[B, H, T, Dv]`: the view's values with new values at kept slots (the other slots are ignored).
The layer then writes the kept tokens with those values, so any selector, allocator and tier can merge. Keys
are never changed (they carry RoPE and the positions the model attends with). Tokens that a tier keeps
(host memory, the compressed tier) are not merged: they are still there, and come back exactly.

Rules: `MergeSimilar` (kvpress's `MergingPress`: each evicted value into its most key-similar kept token) and
`CAM` in `kvcompose.blocks.cam` (kvpress's `CAMPress`: into the kept tokens that follow it, with a Bernoulli
draw from accumulated attention).

Shapes: B batch rows, H KV heads, T slots of the view, K kept slots per head (-1 padded), Dv value dim.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..block import Block
from ..view import KVComposeError, LayerView

__all__ = ["Merger", "MergeSimilar", "kept_mask", "evicted_slots"]

_EPS = 1e-6


def evicted_slots(evicted: Bool[Tensor, "B H T"]) -> tuple[Int[Tensor, "B H E"], Bool[Tensor, "B H E"]]:
    """The evicted slots of each (row, head), ascending, padded to the largest count E (with a mask)."""
    n = evicted.sum(-1)
    e = int(n.max()) if n.numel() else 0
    idx = torch.sort((~evicted).to(torch.int8), dim=-1, stable=True).indices[..., :e]
    return idx, torch.arange(e, device=evicted.device) < n[..., None]


def kept_mask(kept: Int[Tensor, "B H K"], t: int) -> Bool[Tensor, "B H T"]:
    """`[B, H, T]` True at the kept slots. The -1 padding of a head that keeps fewer goes to a spare slot past the
    end (scattered onto slot 0, its False could overwrite slot 0's True: a merge into a head's first token was lost
    when that head kept fewer tokens than another)."""
    b, h, _ = kept.shape
    out = torch.zeros(b, h, t + 1, dtype=torch.bool, device=kept.device)
    if kept.numel():
        out.scatter_(-1, torch.where(kept >= 0, kept, torch.full_like(kept, t)), True)
    return out[..., :t]


class Merger(Block):
    """Base class of the merging part. Subclasses implement `merge(view, kept, evicted, order[, state])`
    returning the new values (and the new state when the merger has state: `init`, or token state)."""

    def merge(self, view: LayerView, kept: Int[Tensor, "B H K"], evicted: Bool[Tensor, "B H T"],
              order: Int[Tensor, "B H T"], *state: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, view: LayerView, kept: Int[Tensor, "B H K"], evicted: Bool[Tensor, "B H T"],
                 order: Int[Tensor, "B H T"], state: Any = None) -> tuple[Float[Tensor, "B H T Dv"], Any]:
        """The merged values `[B, H, T, Dv]` (in the values' dtype; unchanged outside kept slots and outside
        `view.rows`) and the new state."""
        if self.takes_state and not self.token_state:
            values, state = self.merge(view, kept, evicted, order, state)
        elif self.token_state:
            values = self.merge(view, kept, evicted, order, state)
        else:
            values = self.merge(view, kept, evicted, order)
        if values.shape != view.values.shape:
            raise KVComposeError(f"{type(self).__name__} returned values of shape {tuple(values.shape)}, expected "
                                 f"{tuple(view.values.shape)}")
        keep = kept_mask(kept, view.shape[2])
        if view.rows is not None:
            keep = keep & view.rows[:, None, None]
        return torch.where(keep[..., None], values.to(view.values.dtype), view.values), state

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


class MergeSimilar(Merger):
    """Each evicted token's value is folded into the kept token of the same (row, KV head) whose key is most
    cosine-similar: with `s` that similarity, weight `w = max(s, 0) |v_e| / (|v_e| + |v_k| + 1e-6)`, and every
    kept token that receives weights becomes `(v_k + sum w v_e) / (1 + sum w)`. Merges below
    `threshold` are skipped; with `fraction < 1` only the most similar `ceil(fraction * n)` of the `n`
    eligible evicted tokens of the (row, head) merge.

    Token Merging (Bolya et al., ICLR 2023, arXiv 2210.09461) and D2O (Wan et al., arXiv 2406.13035) inspired
    kvpress's `MergingPress`, whose rule this is (the same at `fraction=1`; kvpress's fraction gate is a
    quantile over all evicted tokens, failed ones at -inf, which can turn into NaN: here it ranks the eligible
    ones). Deterministic, stateless.

    Args:
        threshold: minimum cosine similarity for a merge (0.0).
        fraction: share of the eligible evicted tokens that merge (1.0).
    """

    def __init__(self, threshold: float = 0.0, fraction: float = 1.0):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise KVComposeError(f"MergeSimilar: threshold must be in [0, 1], got {threshold!r}")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise KVComposeError(f"MergeSimilar: fraction must be in (0, 1], got {fraction!r}")
        self.threshold, self.fraction = float(threshold), float(fraction)

    def merge(self, view, kept, evicted, order):
        b, h, t, dv = view.values.shape
        e_idx, e_ok = evicted_slots(evicted)  # [B, H, E]
        k_ok = kept >= 0
        k_idx = kept.clamp(min=0)
        keys = view.keys.float()
        unit = keys / keys.norm(dim=-1, keepdim=True).clamp(min=_EPS)
        g = lambda x, i: x.gather(2, i[..., None].expand(*i.shape, x.shape[-1]))  # noqa: E731
        sim = torch.einsum("bhed,bhkd->bhek", g(unit, e_idx), g(unit, k_idx))
        sim = sim.masked_fill(~k_ok[:, :, None, :], float("-inf"))
        best, target = sim.max(-1)  # [B, H, E]: the most similar kept token of each evicted one
        ok = e_ok & k_ok.any(-1, keepdim=True) & (best >= self.threshold)
        if self.fraction < 1.0:
            limit = torch.ceil(self.fraction * ok.sum(-1, keepdim=True).float()).long()
            rank = torch.sort(torch.sort(best.masked_fill(~ok, float("-inf")), dim=-1, descending=True,
                                         stable=True).indices, dim=-1).indices
            ok = ok & (rank < limit)
        values = view.values.float()
        vnorm = values.norm(dim=-1)
        slot = k_idx.gather(-1, target)  # target slots [B, H, E]
        ve, vn_e = g(values, e_idx), vnorm.gather(-1, e_idx)
        w = best.clamp(min=0) * vn_e / (vn_e + vnorm.gather(-1, slot) + _EPS)
        w = torch.where(ok, w, torch.zeros_like(w))
        slot = torch.where(ok, slot, torch.zeros_like(slot))
        acc = torch.zeros(b, h, t, dv, device=values.device).scatter_add_(2, slot[..., None].expand(*slot.shape, dv),
                                                                          w[..., None] * ve)
        wacc = torch.zeros(b, h, t, device=values.device).scatter_add_(2, slot, w)
        return torch.where((wacc > 0)[..., None], (values + acc) / (1.0 + wacc)[..., None], values)
