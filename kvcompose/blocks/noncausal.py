"""Non-causal, chunked attention summed over queries (Compactor's attention score).

Chari & Van Durme, "Compactor", arXiv 2507.08143; kvpress's `NonCausalAttnPress`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..scorers import Scorer
from ..view import KVComposeError, LayerView
from ._util import row_zscore, window_queries

__all__ = ["NonCausalAttention", "chunked_attention"]


def chunked_attention(queries: Float[Tensor, "B Hq W D"], qchunk: Int[Tensor, "B H W"], qok: Bool[Tensor, "B H W"],
                      keys: Float[Tensor, "B H T D"], kchunk: Int[Tensor, "B H T"], kok: Bool[Tensor, "B H T"]
                      ) -> Float[Tensor, "B H T"]:
    """Per KV head, the softmax attention (unscaled logits `q . k`, as kvpress) of every query over the keys of
    its own chunk, no causal mask, summed over the queries and averaged over the query group."""
    b, hq, w, d = queries.shape
    h = keys.shape[1]
    g = hq // h
    q = queries.float().reshape(b, h, g, w, d)
    logits = torch.einsum("bhgwd,bhtd->bhgwt", q, keys.float())
    same = (qchunk[..., :, None] == kchunk[..., None, :]) & qok[..., :, None] & kok[..., None, :]  # [B, H, W, T]
    logits = logits.masked_fill(~same[:, :, None], float("-inf"))
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return p.sum(3).mean(2)


class NonCausalAttention(Scorer):
    """Compactor's attention score: the tokens are cut into chunks of `chunk` positions; every buffered query
    attends, without a causal mask, over the keys of its own chunk (unscaled logits, as the reference);
    the attention each key receives is summed over the queries, averaged over the query group, multiplied
    by `|v|`, average-pooled over 3 neighbouring slots (zero padded) and z-scored over the real tokens of
    the row.

    The same rule as kvpress's `NonCausalAttnPress`, which only runs at prefill, where every token's query
    is there: use it with `compress_prefill=True` and a window of at least the prompt. During decoding the
    window holds only the newest queries, so only the chunks they fall in get attention (the rest score by
    their neighbours' pooling only): a recency-leaning score. Differences, on purpose: chunks start at the
    first real token of the (row, KV head) and follow positions (kvpress: slot index of the prefill, the
    same there); padding keys are masked out (kvpress gives the padding of its last chunk a logit of about
    0, which takes attention mass from the real keys of that chunk); z-scores per row (kvpress: per batch).

    Args:
        chunk: chunk size in positions (256).
        window: buffered queries used (None: the whole ring; at least the prompt for the prefill rule).

    Shapes: queries `[B, Hq, W, D]`, keys `[B, H, T, D]`, values `[B, H, T, Dv]` -> `[B, H, T]`.
    """

    def __init__(self, chunk: int = 256, window: int | None = 256):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise KVComposeError(f"NonCausalAttention: chunk must be a positive int, got {chunk!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise KVComposeError(f"NonCausalAttention: window must be a positive int or None, got {window!r}")
        self.chunk, self.window = chunk, window

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window or 0

    def raw(self, view: LayerView, candidates: Bool[Tensor, "B H T"]) -> Float[Tensor, "B H T"] | None:
        """Pooled `attention * |v|` over the `candidates` (0 elsewhere), before the z-score; None without queries.
        Queries count when they lie between the first and the last candidate position."""
        got = window_queries(view, self.window)
        if got is None:
            return None
        q, qpos, qvalid = got
        pos = view.positions
        big = torch.iinfo(pos.dtype).max
        origin = torch.where(candidates, pos, torch.full_like(pos, big)).amin(-1, keepdim=True)  # [B, H, 1]
        last = torch.where(candidates, pos, torch.full_like(pos, -1)).amax(-1, keepdim=True)
        kchunk = torch.div(pos - origin, self.chunk, rounding_mode="floor")
        qp = qpos[None, None, :].expand(*origin.shape[:2], -1)
        qchunk = torch.div(qp - origin, self.chunk, rounding_mode="floor")
        qok = qvalid[:, None, :] & (qp >= origin) & (qp <= last)
        a = chunked_attention(q, qchunk, qok, view.keys, kchunk, candidates)
        s = (a * view.values.float().norm(dim=-1)).masked_fill(~candidates, 0.0)
        return F.avg_pool1d(s, kernel_size=3, padding=1, stride=1)

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        s = self.raw(view, view.valid)
        if s is None:
            return torch.zeros(view.shape, device=view.device)
        return row_zscore(s, view.valid)

    def __repr__(self) -> str:
        return f"NonCausalAttention(chunk={self.chunk}, window={self.window})"
