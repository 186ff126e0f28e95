"""kvcompose's registered attention function and mask function.

Transformers builds one attention mask from the first full-attention layer and shares it across layers;
with compression, every layer (and later every head) holds a different set of tokens, so that shared mask
is wrong. kvcompose therefore registers its own attention implementation through the public
`AttentionInterface` / `AttentionMaskInterface` and sets it on the model it compresses
(`model.set_attn_implementation("kvcompose")`); no transformers code is patched.

- The mask function hands the 2-D padding mask (`[B, seen]`, True = real token) through unchanged.
- `KVComposeLayer.update` (always called just before attention in the same layer) leaves the layer in a
  thread-local hand-off slot; the attention function takes it, builds the per-head mask from the held
  tokens' original positions and padding, records the post-RoPE queries and runs SDPA.
- Without a kvcompose layer in the slot (e.g. the same model later used with a `DynamicCache`) it falls
  back to plain causal SDPA over all keys, which is what any standard cache needs.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

__all__ = ["ATTN_IMPLEMENTATION", "register", "attend", "build_mask", "handoff"]

ATTN_IMPLEMENTATION = "kvcompose"


class _Handoff(threading.local):
    layer = None


handoff = _Handoff()


def build_mask(
    key_pos: Int[Tensor, "B H T"],
    key_valid: Bool[Tensor, "B H T"],
    query_pos: Int[Tensor, " Q"],
    sliding_window: int | None = None,
) -> Bool[Tensor, "B H Q T"]:
    """Causal mask over held tokens by their original positions (True = attend).

    A query always sees its own key, so a padding query never gets an empty (NaN) row.
    """
    kp = key_pos[:, :, None, :]
    qp = query_pos[None, None, :, None]
    mask = (kp <= qp) & key_valid[:, :, None, :]
    if sliding_window is not None:
        mask &= kp > qp - sliding_window
    return mask | (kp == qp)


def attend(
    query: Float[Tensor, "B Hq Q D"],
    keys: Float[Tensor, "B H T D"],
    values: Float[Tensor, "B H T D"],
    mask: Bool[Tensor, "B H Q T"],
    scale: float,
) -> Float[Tensor, "B Q Hq D"]:
    """SDPA with a per-KV-head mask; the query heads of a group are folded into the query axis, so keys
    and values are never repeated."""
    b, hq, q, d = query.shape
    h = keys.shape[1]
    g = hq // h
    qg = query.reshape(b, h, g * q, d)
    m = mask[:, :, None].expand(b, h, g, q, mask.shape[-1]).reshape(b, h, g * q, mask.shape[-1])
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=m, scale=scale)
    return out.reshape(b, hq, q, values.shape[-1]).transpose(1, 2)


def _fallback(query, key, value, attention_mask, scale, sliding_window):
    b, _, q, _ = query.shape
    t = key.shape[2]
    pos = torch.arange(t, device=key.device)
    valid = torch.ones(b, 1, t, dtype=torch.bool, device=key.device)
    if attention_mask is not None:
        valid = attention_mask[:, None, -t:].to(torch.bool)
    mask = build_mask(pos.expand(b, 1, t), valid, pos[t - q:], sliding_window)
    mask = mask.expand(b, key.shape[1], q, t)
    return attend(query, key, value, mask, scale)


def kvcompose_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function (signature of transformers' attention interface)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sliding_window = kwargs.get("sliding_window")
    layer = handoff.layer
    handoff.layer = None
    if layer is None or layer.layer_idx != getattr(module, "layer_idx", None):
        return _fallback(query, key, value, attention_mask, scale, sliding_window), None
    return layer.attend(query, attention_mask, scale, sliding_window), None


def kvcompose_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, **kwargs):
    """The registered mask function: pass the 2-D padding mask through (None when there is no padding)."""
    return attention_mask


_registered = False


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvcompose_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvcompose_mask)
    _registered = True
