"""Expected attention of future queries, from the mean and covariance of recent pre-RoPE queries.

Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution", arXiv 2510.00636; kvpress's `ExpectedAttentionPress`.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..scorers import Scorer
from ..view import KVComposeError, LayerView
from ._util import first_real, sink_end, group_mean, protect_top, window_queries
from .rotary import Rotary

__all__ = ["ExpectedAttention", "query_statistics", "future_queries", "check_future_args"]


def query_statistics(queries: Float[Tensor, "B Hq W D"], positions: Int[Tensor, " W"], ok: Bool[Tensor, "B W"],
                     rope: Rotary, start: int, future: int, covariance: bool = True
                     ) -> tuple[Float[Tensor, "B Hq D"], Float[Tensor, "B Hq D D"] | None]:
    """Mean (and biased covariance) of the pre-RoPE queries `ok`, rotated by the mean RoPE matrix of positions
    `start .. start + future - 1`: `(R mu, R cov R^T)`."""
    pre = rope.unrotate(queries, positions)  # [B, Hq, W, D]
    m = ok[:, None, :, None].float()
    n = m.sum(2).clamp(min=1)  # [B, 1, 1]
    mu = (pre * m).sum(2) / n
    cov = None
    if covariance:
        c = (pre - mu[:, :, None]) * m
        cov = torch.einsum("bnsi,bnsj->bnij", c, c) / n[..., None]
    r = rope.mean_rotation(start, future, queries.device)
    mu = mu @ r.T
    if cov is not None:
        cov = r @ cov @ r.T
    return mu, cov


def check_future_args(who: str, rope: Rotary, window: int | None, future: int, sinks: int) -> None:
    """The arguments every scorer of future queries takes (ExpectedAttention, CAP), checked with `who` named."""
    if not isinstance(rope, Rotary):
        raise KVComposeError(f"{who} needs the model's rotary embedding: Rotary.from_model(model)")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise KVComposeError(f"{who}: window must be a positive int or None, got {window!r}")
    for name, v, lo in (("future", future, 1), ("sinks", sinks, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise KVComposeError(f"{who}: {name} must be an int >= {lo}, got {v!r}")


Stats = tuple[Float[Tensor, "B Hq D"], Float[Tensor, "B Hq D D"] | None]


def future_queries(view: LayerView, rope: Rotary, window: int | None, sinks: int, future: int, covariance: bool
                   ) -> tuple[Bool[Tensor, "B H T"], Stats | None]:
    """`(sink, stats)`: the first `sinks` real tokens of each row, and `query_statistics` of the last `window`
    buffered queries (those at sink positions left out) for the `future` positions after the tokens seen, or
    None when no query is buffered."""
    got = window_queries(view, window)
    sink = first_real(view.valid, sinks)
    if got is None:
        return sink, None
    q, qpos, qok = got
    qok = qok & (qpos[None, :] >= sink_end(view, sinks))
    return sink, query_statistics(q, qpos, qok, rope, view.seen, future, covariance)


class ExpectedAttention(Scorer):
    """The attention future queries are expected to give each key: with `mu`, `Sigma` the mean and covariance of
    the buffered pre-RoPE queries (those of the first `sinks` positions left out), both rotated by the mean
    RoPE matrix of the next `future` positions, `E[A] = softmax_t(k_t . mu * s + k_t^T Sigma k_t * s^2 / 2)`
    (s the attention scaling) over the non-sink keys, mean over the query group, times `(E[A] + epsilon) |v|`;
    the first `sinks` real tokens score above every other.

    The same rule as kvpress's `ExpectedAttentionPress` at prefill (where its query buffer is the whole
    prompt). During decoding kvcompose's rule is the paper's: the future positions start at the tokens seen
    and the queries are the last `window` decoded ones, de-rotated at their own positions. kvpress's
    DecodingPress instead counts the future positions from the length of its hidden-state buffer (not from
    the sequence position: its rotation average is off by every token before that buffer) and drops the
    first 4 queries of that buffer as if they were sinks.

    Args:
        rope: the model's rotary embedding (`Rotary.from_model(model)`): the rule needs pre-RoPE queries.
        window: buffered queries whose statistics are used (64: kvpress's DecodingPress sees the queries since
            its last compression, one interval).
        future: future positions averaged (512). sinks: leading tokens kept and excluded (4).
        covariance: use the covariance term (True). value_norm: rescale by `|v|` (True). epsilon: 0.

    Shapes: queries `[B, Hq, W, D]`, keys `[B, H, T, D]`, values `[B, H, T, Dv]` -> `[B, H, T]`.
    """

    def __init__(self, rope: Rotary, window: int | None = 64, future: int = 512, sinks: int = 4,
                 covariance: bool = True, value_norm: bool = True, epsilon: float = 0.0):
        check_future_args("ExpectedAttention", rope, window, future, sinks)
        self.rope, self.window, self.future, self.sinks = rope, window, future, sinks
        self.covariance, self.value_norm, self.epsilon = bool(covariance), bool(value_norm), float(epsilon)

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window or 0

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        sink, stats = future_queries(view, self.rope, self.window, self.sinks, self.future, self.covariance)
        if stats is None:
            return protect_top(torch.zeros(view.shape, device=view.device), sink, view.valid)
        mu, cov = stats
        b, h, t, d = view.keys.shape
        g = mu.shape[1] // h
        keys = view.keys.float()
        kk = keys[:, :, None].expand(b, h, g, t, d).reshape(b, h * g, t, d)
        logits = torch.einsum("bhtd,bhd->bht", kk, mu) * view.scale
        if cov is not None:
            logits = logits + torch.einsum("bhtd,bhde,bhte->bht", kk, cov, kk) * (view.scale**2) / 2
        cand = (view.valid & ~sink)[:, :, None].expand(b, h, g, t).reshape(b, h * g, t)
        p = torch.softmax(logits.masked_fill(~cand, float("-inf")), dim=-1).nan_to_num(0.0)
        s = group_mean(p, h)
        if self.value_norm:
            s = (s + self.epsilon) * view.values.float().norm(dim=-1)
        s = s.masked_fill(~(view.valid & ~sink), 0.0)
        return protect_top(s, sink, view.valid)

    def __repr__(self) -> str:
        return (f"ExpectedAttention({self.rope!r}, window={self.window}, future={self.future}, sinks={self.sinks}"
                f"{'' if self.covariance else ', covariance=False'}{'' if self.value_norm else ', value_norm=False'})")
