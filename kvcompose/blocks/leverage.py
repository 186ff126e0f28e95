"""Approximate statistical leverage of the pre-RoPE keys (Compactor's geometry score, query-free).

Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage
Scores", arXiv 2507.08143; kvpress's `LeverageScorePress`.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ..scorers import Scorer
from ..seeding import draw
from ..view import KVComposeError, LayerView, RowGenerators
from ._util import row_zscore
from .rotary import Rotary

__all__ = ["LeverageScore", "leverage_scores"]


def _chol_with_jitter(g: Float[Tensor, "*B K K"], jitter: float = 1e-2, tries: int = 5) -> Float[Tensor, "*B K K"]:
    eye = torch.eye(g.shape[-1], device=g.device, dtype=g.dtype)
    cur = float(jitter)
    for _ in range(tries):
        low, info = torch.linalg.cholesky_ex(g + cur * eye, upper=False)
        if bool((info == 0).all()):
            return low
        cur = max(1e-8, 1e-2 if cur == 0.0 else 10.0 * cur)
    raise KVComposeError(f"LeverageScore: Cholesky failed after {tries} tries")


def leverage_scores(keys: Float[Tensor, "B H T D"], valid: Bool[Tensor, "B H T"], sketch: int,
                    generator: torch.Generator | RowGenerators | None) -> Float[Tensor, "B H T"]:
    """`diag(X (X^T X)^-1 X^T)` of the centred keys `X` (over the real tokens) after a right Gaussian sketch
    `D x sketch` (N(0, 1/sketch), one per row and head, from `generator`), through a Cholesky solve with
    jitter 1e-2 (as kvpress); 0 for padding."""
    b, h, t, d = keys.shape
    phi = draw(torch.randn, (b, h, d, sketch), generator, keys.device) * (1 / math.sqrt(sketch))
    m = valid[..., None].float()
    mean = (keys * m).sum(2, keepdim=True) / m.sum(2, keepdim=True).clamp(min=1)
    x = ((keys - mean) * m) @ phi  # [B, H, T, k]; padding rows are zero and add nothing to X^T X
    xt = x.transpose(-2, -1)
    g = xt @ x
    low = _chol_with_jitter(0.5 * (g + g.transpose(-2, -1)))
    inv_xt = torch.cholesky_solve(xt, low, upper=False)
    return (x * inv_xt.transpose(-2, -1)).sum(-1).clamp_min(0).masked_fill(~valid, 0.0)


class LeverageScore(Scorer):
    """Compactor's leverage score of the keys *before* RoPE (kvcompose holds keys after RoPE: they are
    un-rotated at their positions with the model's `Rotary`), z-scored over the real tokens of each row
    (kvpress z-scores over the whole batch: the same for one row, and a z-score never changes a head's
    ranking). Random: the sketch is drawn from the layer's generator at every event (kvpress draws from
    torch's global generator). Query-free.

    The same rule as kvpress's `LeverageScorePress` (which is prefill-only; kvcompose scores whatever the
    layer holds at each event).

    Args:
        rope: the model's rotary embedding (`Rotary.from_model(model)`); None scores the post-RoPE keys (a
            different rule: rotation mixes positions into the geometry).
        sketch: sketch dimension (48).

    Shapes: keys `[B, H, T, D]` -> `[B, H, T]`.
    """

    draws_random = True  # the sketch, at every event
    draws_per_row = True

    def __init__(self, rope: Rotary | None, sketch: int = 48):
        if rope is not None and not isinstance(rope, Rotary):
            raise KVComposeError(f"LeverageScore: rope must be a kvcompose Rotary or None, got {type(rope).__name__}")
        if isinstance(sketch, bool) or not isinstance(sketch, int) or sketch <= 0:
            raise KVComposeError(f"LeverageScore: sketch must be a positive int, got {sketch!r}")
        self.rope, self.sketch = rope, sketch

    def pre_rope_keys(self, view: LayerView) -> Float[Tensor, "B H T D"]:
        keys = view.keys.float()
        if self.rope is None:
            return keys
        pos = torch.where(view.valid, view.positions, torch.zeros_like(view.positions))
        return self.rope.unrotate(keys, pos)

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        s = leverage_scores(self.pre_rope_keys(view), view.valid, self.sketch, view.generator)
        return row_zscore(s, view.valid)

    def __repr__(self) -> str:
        return f"LeverageScore({self.rope!r}, sketch={self.sketch})"
