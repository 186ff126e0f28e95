"""Compactor: leverage of the pre-RoPE keys blended with non-causal chunked attention.

Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage
Scores", arXiv 2507.08143; kvpress's `CompactorPress`.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ..scorers import Scorer
from ..view import KVComposeError, LayerView
from ._util import first_real, last_real, protect_top, row_zscore
from .leverage import LeverageScore, leverage_scores
from .noncausal import NonCausalAttention
from .rotary import Rotary

__all__ = ["Compactor"]


class Compactor(Scorer):
    """`blending * leverage + attention` over the real tokens between the first `sinks_start` and the last
    `sinks_end` (each part z-scored there, as `LeverageScore` and `NonCausalAttention`); those sinks score
    above every other token.

    kvpress's `CompactorPress` with `blending=None` blends by the compression ratio of the call; here
    `blending=None` uses `1 - cache_budget / real tokens` of the (row, KV head) at the event (the same
    ratio kvpress's DecodingPress sets), or 0.35 (kvpress's fallback) without a cache budget. The same rule
    otherwise; the prefill/decoding notes of `NonCausalAttention` apply to its attention part, and the
    sketch is random (the layer's generator). kvpress pads its sinks with the maximum score (a tie);
    kvcompose puts them strictly above.

    Args:
        rope: the model's rotary embedding (`Rotary.from_model(model)`; None: leverage of post-RoPE keys).
        sinks_start: first real tokens kept (8). sinks_end: last real tokens kept (4).
        chunk: chunk of the attention part (256). sketch: sketch dimension of the leverage part (48).
        blending: weight of the leverage part (None: the compression ratio, see above).
        window: buffered queries of the attention part (None: all).

    Shapes: keys `[B, H, T, D]`, values `[B, H, T, Dv]`, queries `[B, Hq, W, D]` -> `[B, H, T]`.
    """

    draws_random = True  # the leverage part's sketch, at every event
    draws_per_row = True

    def __init__(self, rope: Rotary | None, sinks_start: int = 8, sinks_end: int = 4, chunk: int = 256,
                 sketch: int = 48, blending: float | None = None, window: int | None = 256):
        for name, v in (("sinks_start", sinks_start), ("sinks_end", sinks_end)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise KVComposeError(f"Compactor: {name} must be an int >= 0, got {v!r}")
        if blending is not None and (isinstance(blending, bool) or not isinstance(blending, (int, float))):
            raise KVComposeError(f"Compactor: blending must be a number or None, got {blending!r}")
        self.leverage = LeverageScore(rope, sketch)
        self.attention = NonCausalAttention(chunk, window)
        self.sinks_start, self.sinks_end = sinks_start, sinks_end
        self.blending = None if blending is None else float(blending)

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.attention.query_window

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        valid = view.valid
        sinks = first_real(valid, self.sinks_start) | last_real(valid, self.sinks_end)
        mid = valid & ~sinks
        lev = row_zscore(leverage_scores(self.leverage.pre_rope_keys(view), mid, self.leverage.sketch,
                                         view.generator), mid)
        att = self.attention.raw(view, mid)
        att = torch.zeros_like(lev) if att is None else row_zscore(att, mid)
        if self.blending is not None:
            w = torch.full_like(lev[..., :1], self.blending)
        elif view.cache_budget is not None:
            n = valid.sum(-1, keepdim=True).float()
            w = (1.0 - view.cache_budget / n.clamp(min=1)).clamp(min=0.0)
        else:
            w = torch.full_like(lev[..., :1], 0.35)
        s = (w * lev + att).masked_fill(~mid, 0.0)
        return protect_top(s, sinks, valid)

    def __repr__(self) -> str:
        return (f"Compactor({self.leverage.rope!r}, sinks_start={self.sinks_start}, sinks_end={self.sinks_end}, "
                f"chunk={self.attention.chunk}, sketch={self.leverage.sketch}, blending={self.blending})")
