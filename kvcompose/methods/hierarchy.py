"""The memory-hierarchy policy of "Not All Thoughts Need HBM: Semantics-Aware Memory Hierarchy for LLM
Reasoning" (abstract only; no code found) as a preset, and `with_tier` to give any pipeline a tier.

The paper's claim: reasoning accuracy depends on how many tokens are permanently discarded, not on how
many stay in GPU memory. Its policy ranks tokens by cumulative attention and places them HBM -> host
memory (DDR) -> compressed -> evicted. Choices made here where the abstract is silent (configurable):
per-KV-head cumulative attention (H2O's sum over the query group and every query so far, kept up to date
while a token is attended from a tier), reassignment of every tier at each compression event, the prompt
and the newest `recent` tokens ranked first, and int8 KIVI quantization for the compressed tier.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ..pipeline import Pipeline
from ..scorers import AccumulatedAttention, Scorer
from ..selectors import TopK
from ..tiers import CompressedTier, Hierarchy, HostTier, TierStore
from ..view import KVComposeError, LayerView

__all__ = ["memory_hierarchy", "with_tier", "Prioritized"]


class Prioritized(Scorer):
    """A scorer whose protected tokens rank above all others: ONE total order for every tier.

    Protectors decide what stays in HBM; a tier store ranks what does not by score. If the prompt were
    protected by a `ProtectPrompt` block, a smaller HBM share would protect fewer prompt tokens and the
    evicted set would change with the HBM share. Folding protection into the score keeps the order of
    all tokens the same whatever the HBM share, so only `evict_ratio` decides what is evicted.

    Score: the token's rank (0 = least worth keeping) in the order (protected, `s`, position), per row
    and KV head, as float32 (exact below 2^24 tokens). Ranks are all distinct, so the selector's top-k and
    the tier store's sort agree on every tie (adding an offset to `s` would round close scores into ties
    that the two break differently, and the evicted set would then depend on the HBM share).

    Args:
        base: the ranking scorer (default `AccumulatedAttention()`, the paper's cumulative attention).
        prompt: rank the prompt (the first forward call) first.
        recent: rank the newest `recent` tokens first (raw cumulative attention is low for new tokens,
            which few queries have seen yet; H2O keeps a recent window for the same reason).
    """

    def __init__(self, base: Scorer | None = None, prompt: bool = True, recent: int = 64):
        if base is not None and not isinstance(base, Scorer):
            raise KVComposeError(f"Prioritized needs a Scorer, got {type(base).__name__}")
        if isinstance(recent, bool) or not isinstance(recent, int) or recent < 0:
            raise KVComposeError(f"recent must be an int >= 0, got {recent!r}")
        self.base = base if base is not None else AccumulatedAttention()
        self.prompt, self.recent = bool(prompt), recent

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.base.query_window

    def blocks(self) -> list[Scorer]:
        return self.base.blocks()

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        s = self.base(view)
        protected = torch.zeros_like(view.valid)
        if self.prompt:
            protected |= view.is_prompt
        if self.recent:
            protected |= view.positions >= view.seen - self.recent
        protected &= view.valid
        rank = s.argsort(dim=-1, stable=True).argsort(dim=-1)  # ties: the older token ranks lower
        return (rank + protected.long() * s.shape[-1]).float()

    def __repr__(self) -> str:
        return f"Prioritized({self.base!r}, prompt={self.prompt}, recent={self.recent})"


def memory_hierarchy(hbm_ratio: int | float = 0.5, compressed_ratio: int | float = 0.0, evict_ratio: int | float = 0.0, *,
                     bits: int = 8, recent: int = 64, prompt: bool = True, normalize: bool = False) -> Pipeline:
    """The paper's policy: rank by cumulative attention (prompt and newest `recent` first), fill HBM, then
    host memory, then the compressed tier, and evict the rest.

    Shares are of all tokens seen so far, re-applied at every compression event; host memory gets
    `1 - hbm_ratio - compressed_ratio - evict_ratio`. Works without a token budget:
    `KVComposeCache(model, methods.memory_hierarchy(0.25, evict_ratio=0.1))`; with a budget, HBM holds at
    most that many tokens per layer (the rest of the retained share goes to host memory).

    Args:
        hbm_ratio: share of seen tokens in HBM; compressed_ratio: share quantized (KIVI, `bits`);
        evict_ratio: share evicted for good. Ratios must be >= 0 and sum to at most 1.
        bits: 8 or 4 for the compressed tier. recent / prompt: see `Prioritized`.
        normalize: rank by mean instead of summed attention (`AccumulatedAttention(normalize=True)`).
    """
    tier = Hierarchy(hbm_ratio, compressed_ratio, evict_ratio, host=HostTier(), compressed=CompressedTier(bits=bits))
    name = f"memory_hierarchy(hbm={hbm_ratio:g}, compressed={compressed_ratio:g}, evict={evict_ratio:g}"
    name += f", bits={bits})" if compressed_ratio else ")"
    return Pipeline(
        Prioritized(AccumulatedAttention(normalize=normalize), prompt=prompt, recent=recent),
        TopK(),
        tier,
        name=name,
    )


def with_tier(pipeline: Pipeline, tier: TierStore) -> Pipeline:
    """The same method, with `tier` receiving what it does not keep in HBM instead of deleting it.

    Example: VaSE whose drops go to host memory (nothing is ever evicted; HBM holds the budget):
        >>> p = with_tier(methods.vase(), HostTier())
    """
    if not isinstance(pipeline, Pipeline):
        raise KVComposeError(f"with_tier needs a Pipeline, got {type(pipeline).__name__}")
    if not isinstance(tier, TierStore):
        raise KVComposeError(f"with_tier needs a TierStore, got {type(tier).__name__}")
    blocks = [*pipeline.protectors, pipeline.scorer, pipeline.selector, pipeline.allocator, tier]
    name = f"{pipeline.name} + {tier!r}" if pipeline.name else None
    return Pipeline(*[b for b in blocks if b is not None], name=name)
