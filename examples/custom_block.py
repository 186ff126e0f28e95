"""Write your own blocks: a Scorer and a Protector, composed with built-in blocks into a Pipeline.

    python examples/custom_block.py                  # SmolLM2-135M-Instruct
    python examples/custom_block.py --tiny           # a tiny random model (seconds)

A block is a small class with a pure function of the `LayerView` (one layer's held keys, values, original
positions, padding mask and recent queries). It never touches the cache; the cache never names it.
"""

import os
import sys

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from kvcompose import KVComposeCache, LayerView, Pipeline, ProtectRecent, ProtectSinks, Protector, Scorer, TopK
from kvcompose.models import chat_inputs
from kvcompose.protectors import resolve_count


class AttentionTimesValue(Scorer):
    """Attention from the last `window` queries (mean over queries and the GQA group) times the value norm:
    a token is worth keeping if it is attended to AND moves the output (cf. VATP, Guo et al. 2024)."""

    def __init__(self, window: int = 16):
        self.window = window

    @property
    def query_window(self) -> int:  # the cache keeps this many recent post-RoPE queries per layer
        return self.window

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        b, h, t, d = view.keys.shape
        if view.queries is None:
            return torch.zeros(b, h, t)
        q = view.queries[:, :, -self.window:].float()                      # [B, Hq, W, D]
        g = q.shape[1] // h
        q = q.reshape(b, h, g * q.shape[2], d)                             # fold the GQA group
        logits = q @ view.keys.float().transpose(-1, -2) * view.scale      # [B, H, G*W, T]
        qpos = view.query_positions[-self.window:].repeat(g)               # causal: no query sees the future
        mask = (view.positions[:, :, None, :] <= qpos[None, None, :, None]) & view.valid[:, :, None, :]
        attn = logits.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0).mean(2)
        return attn * view.values.float().norm(dim=-1)


class ProtectEvery(Protector):
    """Keep every `stride`-th token of the sequence as a landmark (at most `share` of the budget)."""

    def __init__(self, stride: int = 16, share: float = 0.25):
        self.stride, self.share = stride, share

    def max_count(self, budget: int) -> int:                                # the pipeline checks this fits
        return resolve_count(self.share, budget)

    def protect(self, view: LayerView, budget: int, room: int) -> Bool[Tensor, "B H T"]:
        landmark = (view.positions % self.stride == 0) & view.valid
        # keep only the newest `max_count` landmarks so the bound always holds
        rank = landmark.flip(-1).cumsum(-1).flip(-1)                        # 1 = newest landmark
        return landmark & (rank <= self.max_count(budget))


pipeline = Pipeline(ProtectSinks(4), ProtectRecent(16), ProtectEvery(16), AttentionTimesValue(16), TopK(),
                    name="attention x value + landmarks")

if "--tiny" in sys.argv[1:] or os.environ.get("KVCOMPOSE_EXAMPLE_TINY"):
    from kvcompose.testing import tiny_chat_model

    model, tok = tiny_chat_model()
    budget, interval, max_new = 32, 8, 48
else:
    from kvcompose.models import load_default_model

    model, tok = load_default_model()
    budget, interval, max_new = 128, 64, 256

pipeline.validate(budget)  # 4 sinks + 16 recent + budget/4 landmarks fit in the budget
inputs = chat_inputs(tok, "Tom reads 12 pages a day. The book has 180 pages and he has read for 5 days. "
                          "How many more days does he need?")
cache = KVComposeCache(model, pipeline, budget=budget, interval=interval)
out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new, min_new_tokens=max_new,
                     do_sample=False)
print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
print(cache.memory())

kept = cache.kept_positions(0)[0, 0]                 # original positions kept by layer 0, KV head 0
print("layer 0 / head 0 keeps positions:", kept.tolist())
assert kept[:4].tolist() == [0, 1, 2, 3]             # the sinks survived every compression event
assert cache.layers[0].events > 0                    # and there were compression events
