"""Every preset of `kvcompose.methods`, scaled down so that a tiny model compresses within a few dozen tokens,
over both stores (dense; paged through a per-head allocator or a block-granular selector) and with or without
a tier: the cases of the exactness properties (crop, copy) and of the protection properties."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from kvcompose import BlockGranular, HostTier, Hierarchy, CompressedTier, Pipeline, TopK, methods
from kvcompose.testing import TINY_PRESETS, greedy_steps
from kvcompose.blocks import ExpectedAttention, Rotary

from helpers import ratio_curves

PRESETS = TINY_PRESETS
"""name -> a preset with windows small enough for budgets of 16-24 tokens (each one is in `methods.PRESETS`)."""


def _expected(model, **kw) -> ExpectedAttention:
    return ExpectedAttention(Rotary.from_model(model), window=4, future=16, sinks=2, **kw)


_DUO = {"head_scores": [[0.9, 0.1], [0.2, 0.8]]}  # 2 layers x 2 KV heads: heads (0, 1) and (1, 0) stream
_LUKV = {"prune": ratio_curves(2, 2, seed=0)}

PORTED = {
    "keydiff": lambda model: methods.keydiff(),
    "lagkv": lambda model: methods.lagkv(sinks=2, lag=4),
    "cur": lambda model: methods.cur(sinks=2, window=4),
    "leverage": lambda model: methods.leverage(model, sketch=8),
    "noncausal_attention": lambda model: methods.noncausal_attention(chunk=8, window=8),
    "compactor": lambda model: methods.compactor(model, sinks_start=2, sinks_end=2, chunk=8, window=8),
    "expected_attention": lambda model: methods.expected_attention(model, window=4, future=16, sinks=2),
    "cap": lambda model: methods.cap(model, window=4, future=16, sinks=2),
    "criticalkv": lambda model: methods.criticalkv(model, inner=_expected(model)),
    "cam": lambda model: methods.cam(methods.snapkv(window=4, kernel=3), window=4),
    "merging": lambda model: methods.merging(methods.snapkv(window=4, kernel=3), fraction=0.5),
    "chunkkv": lambda model: methods.chunkkv(methods.snapkv(window=4, kernel=3), chunk=4),
    "kvcompose_paper": lambda model: methods.kvcompose_paper(window=4),
    "kvcompose_paper_unstructured": lambda model: methods.kvcompose_paper(structured=False, window=4),
    "duo_attention": lambda model: methods.duo_attention(_DUO, sinks=2),
    "lukv": lambda model: methods.lukv(_LUKV, Pipeline(_expected(model, epsilon=2e-2), TopK()), sinks=2),
    "adakv": lambda model: methods.adakv(methods.snapkv(window=4, kernel=3)),
}
"""name -> a preset ported from kvpress (`methods.PORTED`), scaled down like `PRESETS`, built from the tests'
tiny model (2 layers, 2 KV heads)."""


def variant(pipe: Pipeline, store: str, tier: str) -> Pipeline:
    """`pipe` on the paged store (a block-granular selector) and/or with a tier that holds tokens."""
    if pipe.compresses and store == "paged" and pipe.allocator.uniform and pipe.selector.__class__ is not BlockGranular:
        pipe = pipe.replace(BlockGranular(pipe.selector, block=4), name=pipe.name)
    if pipe.compresses and tier != "evict" and not pipe.tier.holds_tokens:
        t = HostTier() if tier == "host" else Hierarchy(0.2, 0.1, compressed=CompressedTier(key_group=4, value_group=4))
        pipe = methods.with_tier(pipe, t)
    return pipe


def cases(presets=tuple(PRESETS)):
    """`(preset, store, tier)` names over presets x store x tier (`build` makes the pipeline)."""
    return st.tuples(st.sampled_from(sorted(presets)), st.sampled_from(["dense", "paged"]),
                     st.sampled_from(["evict", "evict", "host", "hierarchy"]))


def build(case: tuple[str, str, str]) -> Pipeline:
    name, store, tier = case
    return variant(PRESETS[name](), store, tier)


def ids(n: int, seed: int = 0, rows: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (rows, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def decode(model, cache, tokens: torch.Tensor, start: int, prompt: int | None = None) -> torch.Tensor:
    """Feed `tokens[:, start:]` through `cache` as a run would: the first `prompt` tokens (from `start`) in one
    forward, then one token per forward. Returns the logits of every fed token after the first forward's last
    `[B, n, vocab]`."""
    out = []
    t = start
    if prompt:
        out.append(model(input_ids=tokens[:, t : t + prompt], past_key_values=cache).logits[:, -1])
        t += prompt
    for j in range(t, tokens.shape[1]):
        out.append(model(input_ids=tokens[:, j : j + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1)


greedy = greedy_steps
