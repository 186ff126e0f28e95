"""CAP: query-weighted leverage of the values in a capacity matrix.

CAPKV (arXiv 2604.25975 as cited by kvpress 0.5.5); kvpress's `CapPress`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from ..scorers import Scorer
from ..view import LayerView
from ._util import group_mean, protect_top
from .expected_attention import check_future_args, future_queries
from .rotary import Rotary

__all__ = ["CAP"]


class CAP(Scorer):
    """CAP's score `s_t = w_t v_t^T A^-1 v_t`, `A = I + sum_t w_t v_t v_t^T`, `w_t = exp(tau cos(k_t, a))` (shifted
    by its maximum), per query head, with `a` the mean of the buffered pre-RoPE queries rotated by the mean
    RoPE matrix of the next `future` positions; sums over the non-sink real tokens, mean over the query
    group; the first `sinks` real tokens score above every other.

    The same rule as kvpress's `CapPress` at prefill; during decoding the future positions start at the
    tokens seen and the queries are the last `window` decoded ones (the notes of `ExpectedAttention` on
    kvpress's DecodingPress apply here too).

    Args:
        rope: the model's rotary embedding (`Rotary.from_model(model)`).
        tau: temperature of the query-key alignment (5.0). window: buffered queries (64).
        future: future positions averaged (512). sinks: leading tokens kept and excluded (4).
        epsilon: added to `w` inside the capacity matrix (1e-6).

    Shapes: queries `[B, Hq, W, D]`, keys `[B, H, T, D]`, values `[B, H, T, D]` -> `[B, H, T]`.
    """

    def __init__(self, rope: Rotary, tau: float = 5.0, window: int | None = 64, future: int = 512, sinks: int = 4,
                 epsilon: float = 1e-6):
        check_future_args("CAP", rope, window, future, sinks)
        self.rope, self.tau, self.window, self.future, self.sinks = rope, float(tau), window, future, sinks
        self.epsilon = float(epsilon)

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window or 0

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        sink, stats = future_queries(view, self.rope, self.window, self.sinks, self.future, covariance=False)
        if stats is None:
            return protect_top(torch.zeros(view.shape, device=view.device), sink, view.valid)
        anchor = stats[0]
        b, h, t, d = view.keys.shape
        g = anchor.shape[1] // h
        rep = lambda x: x[:, :, None].expand(b, h, g, t, x.shape[-1]).reshape(b, h * g, t, x.shape[-1])  # noqa: E731
        keys, values = rep(view.keys.float()), rep(view.values.float())
        cand = (view.valid & ~sink)[:, :, None].expand(b, h, g, t).reshape(b, h * g, t)
        stat = torch.einsum("bhd,bhtd->bht", F.normalize(anchor, p=2, dim=-1), F.normalize(keys, p=2, dim=-1))
        logits = (self.tau * stat.clamp(-1.0, 1.0)).masked_fill(~cand, float("-inf"))
        w = torch.exp(logits - logits.amax(-1, keepdim=True)).nan_to_num(0.0)
        scaled = values * torch.sqrt(w + self.epsilon)[..., None] * cand[..., None]
        eye = torch.eye(values.shape[-1], device=view.device).view(1, 1, values.shape[-1], values.shape[-1])
        cap = eye + torch.einsum("bhtd,bhte->bhde", scaled, scaled)
        vt = values.transpose(2, 3)
        lev = (vt * torch.linalg.solve(cap, vt)).sum(2)
        s = group_mean(w * lev, h).masked_fill(~(view.valid & ~sink), 0.0)
        return protect_top(s, sink, view.valid)

    def __repr__(self) -> str:
        return f"CAP({self.rope!r}, tau={self.tau:g}, window={self.window}, future={self.future}, sinks={self.sinks})"
