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

from ..allocators import Allocator, SeenShare
from ..block import require_role, role_of
from ..pipeline import Pipeline
from ..protectors import ProtectPrompt, ProtectRecent
from ..scorers import AccumulatedAttention
from ..selectors import TopK
from ..tiers import CompressedTier, Hierarchy, HostTier, TierStore
from ..view import KVComposeError, warn_unused

__all__ = ["memory_hierarchy", "with_tier"]


def memory_hierarchy(hbm_ratio: int | float = 0.5, compressed_ratio: int | float = 0.0, evict_ratio: int | float = 0.0, *,
                     bits: int = 8, recent: int = 64, prompt: bool = True, sinks: int = 4,
                     normalize: bool = False) -> Pipeline:
    """The paper's policy: rank by cumulative attention (the prompt and the newest `recent` tokens
    protected: never evicted), fill HBM, then host memory, then the compressed tier, and evict the rest.

    A plain composition: `SeenShare` gives HBM its share of the tokens seen, `AccumulatedAttention` + `TopK`
    rank the tokens, and `Hierarchy` places what HBM does not keep by that same ranking. Shares are of all
    tokens seen so far, re-applied at every compression event; host memory gets
    `1 - hbm_ratio - compressed_ratio - evict_ratio`. Works without a token budget:
    `KVComposeCache(model, methods.memory_hierarchy(0.25, evict_ratio=0.1))`; with a budget, HBM holds at
    most that many tokens per layer (the rest of the retained share goes to host memory).

    Args:
        hbm_ratio: share of seen tokens in HBM; compressed_ratio: share quantized (KIVI, `bits`);
        evict_ratio: share evicted for good. Ratios must be >= 0 and sum to at most 1.
        bits: 8 or 4 for the compressed tier. recent: newest tokens protected; prompt: protect the prompt
            (up to what fits without eviction); sinks: when the whole prompt does not fit, its first `sinks`
            tokens are among the protected ones (the attention sinks: with none, the first events of a short
            trace evict the very first tokens, and SmolLM2-135M's KL to the full cache jumps from ~0.001 to
            ~0.6 at a 3% evict share), the rest of the room goes to its newest tokens.
        normalize: rank by mean instead of summed attention (`AccumulatedAttention(normalize=True)`).
    """
    if hbm_ratio == 1:
        warn_unused("memory_hierarchy(hbm_ratio=1)", "every token stays in HBM: nothing reaches another tier")
    if not compressed_ratio and bits != 8:
        warn_unused(f"memory_hierarchy(bits={bits})", "compressed_ratio=0 leaves the compressed tier empty")
    if not prompt and sinks != 4:
        warn_unused(f"memory_hierarchy(sinks={sinks})", "prompt=False protects no prompt token (sinks are the prompt's)")
    alloc = SeenShare(hbm_ratio, compressed_ratio, evict_ratio)
    tier = Hierarchy(compressed_ratio, evict_ratio, host=HostTier(), compressed=CompressedTier(bits=bits))
    name = f"memory_hierarchy(hbm={hbm_ratio:g}, compressed={compressed_ratio:g}, evict={evict_ratio:g}"
    name += f", bits={bits})" if compressed_ratio else ")"
    protect = ([ProtectRecent(recent)] if recent else []) + ([ProtectPrompt(sinks=sinks)] if prompt else [])
    return Pipeline(*protect, AccumulatedAttention(normalize=normalize), TopK(), alloc, tier, name=name)


def with_tier(pipeline: Pipeline, tier: TierStore) -> Pipeline:
    """The same method, with `tier` receiving what it does not keep in HBM instead of deleting it.

    Example: VaSE whose drops go to host memory (nothing is ever evicted; HBM holds the budget):
        >>> p = with_tier(methods.vase(), HostTier())
    """
    if not isinstance(pipeline, Pipeline):
        raise KVComposeError(f"with_tier: pipeline must be a kvcompose Pipeline, got {role_of(pipeline)}")
    require_role(tier, TierStore, "with_tier",
                 ": an allocator goes in with methods.with_allocator(pipeline, allocator)"
                 if isinstance(tier, Allocator) else "")
    return pipeline.replace(tier, name=f"{pipeline.name} + {tier!r}" if pipeline.name else None)
