"""Every preset of `kvcompose.methods`, scaled down so that a tiny model compresses within a few dozen tokens,
over both stores (dense; paged through a per-head allocator or a block-granular selector) and with or without
a tier: the cases of the exactness properties (crop, copy) and of the protection properties."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from kvcompose import BlockGranular, HeadUtility, HostTier, Hierarchy, CompressedTier, Pipeline, methods

PRESETS = {
    "full": lambda: methods.full(),
    "streaming_llm": lambda: methods.streaming_llm(sinks=2),
    "h2o": lambda: methods.h2o(),
    "snapkv": lambda: methods.snapkv(window=4, kernel=3),
    "tova": lambda: methods.tova(),
    "knorm": lambda: methods.knorm(sinks=2),
    "rkv": lambda: methods.rkv(window=2, kernel=3),
    "random_attention": lambda: methods.random_attention(recent=4),
    "vase": lambda: methods.vase(recent=4, window=8, kernel=3),
    "vase_query_free": lambda: methods.vase(recent=4, query_free=True, rank=4),
    "memory_hierarchy": lambda: methods.memory_hierarchy(0.5, 0.2, 0.1, recent=4),
    "pyramid_rkv": lambda: methods.pyramid_rkv(methods.rkv(window=2, kernel=3), beta=2),
    "reason_alloc": lambda: methods.reason_alloc(methods.rkv(window=2, kernel=3), profile=None, window=4,
                                                 page_size=4, floor=0.5),
    "growpage": lambda: methods.growpage(methods.rkv(window=2, kernel=3), page=4, window=4, initial=0.5),
}
"""name -> a preset with windows small enough for budgets of 16-24 tokens (each one is in `methods.PRESETS`)."""


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


@torch.no_grad()
def greedy(model, cache, first: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode `n` tokens greedily after feeding `first` (`[B, 1]`): (tokens `[B, n]`, logits `[B, n, vocab]`)."""
    toks, logits = [], []
    x = first
    for _ in range(n):
        lg = model(input_ids=x, past_key_values=cache).logits[:, -1]
        x = lg.argmax(-1, keepdim=True)
        toks.append(x)
        logits.append(lg)
    return torch.cat(toks, 1), torch.stack(logits, 1)
