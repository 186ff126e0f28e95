"""The exact attention math of kvcompose: masks over held tokens by their original positions, attention with
the query group folded, and the probabilities observers read.

Pure PyTorch and imported by blocks (scorers), stores (each store attends over its own layout) and the
transformers hook (`kvcompose.attention`), which re-exports these names. It knows nothing of caches, layers
or transformers.

The mask rule (`needs_mask`): a decode step of one query over held tokens that are all real and equally long
per (row, KV head) attends with no mask at all (the kernel SDPA picks then is the one an uncompressed cache
gets); a mask is built only for several queries, ragged or padded tokens, or a sliding window the held
tokens exceed.

Shapes: B batch rows, H KV heads, Hq query heads (Hq = H * G), Q new queries, T attended tokens, D head dim,
Dv value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .view import KVComposeError

__all__ = ["build_mask", "needs_mask", "attend", "attend_tokens", "attention_probs"]


def build_mask(
    key_pos: Int[Tensor, "B H T"],
    key_valid: Bool[Tensor, "B H T"],
    query_pos: Int[Tensor, " Q"],
    sliding_window: int | None = None,
) -> Bool[Tensor, "B H Q T"]:
    """Causal mask over held tokens by their original positions (True = attend).

    A sliding window keeps keys with `query_pos - key_pos < sliding_window`, the rule of transformers'
    `sliding_window_overlay` (5.2 to 5.24). A query always sees its own key, so a padding query never gets
    an empty (NaN) row.
    """
    kp = key_pos[:, :, None, :]
    qp = query_pos[None, None, :, None]
    mask = (kp <= qp) & key_valid[:, :, None, :]
    if sliding_window is not None:
        mask &= kp > qp - sliding_window
    return mask | (kp == qp)


def needs_mask(queries: int, ragged: bool, seen: int, sliding_window: int | None) -> bool:
    """Whether attention over held tokens needs a mask: several queries, ragged or padded tokens (host-side
    facts of the store), or a sliding window shorter than the tokens seen. One query that sees every held
    key attends unmasked."""
    return queries != 1 or ragged or (sliding_window is not None and seen > sliding_window)


def _fold(query: Tensor, mask: Tensor | None, h: int) -> tuple[Tensor, Tensor | None]:
    """Fold the G query heads of each KV head into the query axis: `[B, H, G*Q, D]` and `[B, H, G*Q, T]`."""
    b, hq, q, d = query.shape
    g = hq // h
    qg = query.reshape(b, h, g * q, d)
    if mask is None:
        return qg, None
    m = mask[:, :, None].expand(b, h, g, q, mask.shape[-1]).reshape(b, h, g * q, mask.shape[-1])
    return qg, m


def _logits(qg: Tensor, keys: Tensor, m: Tensor | None, scale: float, softcap: float | None) -> Tensor:
    """Scaled (and soft-capped) logits with masked entries at the dtype's minimum, in the order of
    transformers' eager attention (Gemma2: scale, divide by the cap, tanh, multiply, then add the mask)."""
    w = torch.matmul(qg, keys.transpose(2, 3)) * scale
    if softcap is not None:
        w = w / softcap
        w = torch.tanh(w)
        w = w * softcap
    return w if m is None else torch.where(m, w, torch.finfo(w.dtype).min)


def _probs(qg: Tensor, keys: Tensor, m: Tensor | None, scale: float, softcap: float | None, sinks: Tensor | None,
           h: int, g: int, q: int) -> Tensor:
    w = _logits(qg, keys, m, scale, softcap)
    if sinks is None:  # Gemma2 / Llama eager: softmax in float32, back to the query dtype
        return F.softmax(w, dim=-1, dtype=torch.float32).to(qg.dtype)
    # gpt-oss eager: one extra logit per query head, max-subtracted softmax in the logits' dtype, sink dropped
    b = qg.shape[0]
    s = sinks.to(w.dtype).reshape(h, g, 1).expand(h, g, q).reshape(1, h, g * q, 1).expand(b, h, g * q, 1)
    combined = torch.cat([w, s], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


def attend(
    query: Float[Tensor, "B Hq Q D"],
    keys: Float[Tensor, "B H T D"],
    values: Float[Tensor, "B H T Dv"],
    mask: Bool[Tensor, "B H Q T"] | None,
    scale: float,
    softcap: float | None = None,
    sinks: Float[Tensor, " Hq"] | None = None,
) -> Float[Tensor, "B Q Hq Dv"]:
    """Attention of the new queries over the given tokens with a per-KV-head mask (True = attend; None =
    every query sees every key).

    The G query heads of a group are folded into the query axis, so keys and values are never repeated.
    Without soft-capping or sinks this is `F.scaled_dot_product_attention`. With `softcap` (Gemma 2,
    Team Gemma 2024, arXiv 2408.00118: logits `c * tanh(logits / c)`) or `sinks` (gpt-oss, OpenAI 2025: a
    learned per-head logit that joins the softmax and is then dropped; cf. attention sinks, Xiao et al. 2023,
    arXiv 2309.17453) it follows transformers' eager implementation of those models step by step.
    """
    b, hq, q, _ = query.shape
    h = keys.shape[1]
    if hq % h:
        raise KVComposeError(f"{hq} query heads are not a multiple of {h} KV heads")
    g = hq // h
    qg, m = _fold(query, mask, h)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=m, scale=scale)
    else:
        p = _probs(qg, keys, m, scale, softcap, sinks, h, g, q).to(values.dtype)
        out = torch.matmul(p, values)
    return out.reshape(b, hq, q, values.shape[-1]).transpose(1, 2)


def attend_tokens(
    query: Float[Tensor, "B Hq Q D"],
    keys: Float[Tensor, "B H T D"],
    values: Float[Tensor, "B H T Dv"],
    positions,
    valid,
    ragged: bool,
    seen: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: Float[Tensor, " Hq"] | None = None,
) -> tuple[Float[Tensor, "B Q Hq Dv"], Bool[Tensor, "B H Q T"] | None]:
    """`attend` over held tokens with the mask rule of `needs_mask`; returns the output and the mask used
    (None: unmasked). The queries sit at positions `seen - Q .. seen - 1`. `positions` and `valid` (`[B, H, T]`)
    may be zero-argument callables, called only when a mask is built (a dense store writes positions lazily)."""
    q = query.shape[2]
    mask = None
    if needs_mask(q, ragged, seen, sliding_window):
        pos = positions() if callable(positions) else positions
        ok = valid() if callable(valid) else valid
        mask = build_mask(pos, ok, torch.arange(seen - q, seen, device=pos.device), sliding_window)
    return attend(query, keys, values, mask, scale, softcap, sinks), mask


def attention_probs(
    query: Float[Tensor, "B Hq Q D"],
    keys: Float[Tensor, "B H T D"],
    mask: Bool[Tensor, "B H Q T"] | None,
    scale: float,
    softcap: float | None = None,
    sinks: Float[Tensor, " Hq"] | None = None,
) -> Float[Tensor, "B Hq Q T"]:
    """The attention probabilities `attend` uses (float32; soft-capping and sinks as in `attend`), for
    observers such as accumulated attention (H2O, Zhang et al. 2023, arXiv 2306.14048) that must see what
    the model attended to. Sink mass is not a token's: rows then sum to less than one."""
    b, hq, q, _ = query.shape
    h = keys.shape[1]
    g = hq // h
    qg, m = _fold(query, mask, h)
    p = _probs(qg.float(), keys.float(), m, scale, softcap, sinks, h, g, q)
    return p.reshape(b, hq, q, keys.shape[2])
