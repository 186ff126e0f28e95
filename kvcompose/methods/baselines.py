"""Classic eviction baselines as presets."""

from __future__ import annotations

from ..pipeline import Pipeline
from ..protectors import ProtectRecent, ProtectSinks
from ..scorers import AccumulatedAttention, KeyNorm, LastQueryAttention, Recency, WindowedAttention
from ..selectors import TopK


def full() -> Pipeline:
    """No compression: the full cache (the reference every method is measured against)."""
    return Pipeline(name="full")


def streaming_llm(sinks: int = 4) -> Pipeline:
    """StreamingLLM: `sinks` attention-sink tokens plus the most recent `budget - sinks`.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024 (arXiv 2309.17453).
    Defaults: 4 sinks (paper). Kept tokens stay in time order, so the sinks really are the first tokens.
    """
    return Pipeline(ProtectSinks(sinks), Recency(), TopK(), name=f"streaming_llm(sinks={sinks})")


def h2o(recent: int | float = 0.5) -> Pipeline:
    """H2O: heavy hitters by accumulated attention of every query so far, plus a recent window.

    Zhang et al., NeurIPS 2023 (arXiv 2306.14048). Default: half the budget recent, half heavy hitters
    (the paper's equal split).
    """
    return Pipeline(ProtectRecent(recent), AccumulatedAttention(), TopK(), name=f"h2o(recent={recent})")


def snapkv(window: int = 32, kernel: int = 5) -> Pipeline:
    """SnapKV: attention from an observation window of the last 32 queries, average pooling (kernel 5),
    mean over the GQA group, top-(C - w) per KV head plus the window.

    Li et al., arXiv 2404.14469 (prefill-only in the original; here it runs at every compression event).
    """
    return Pipeline(
        ProtectRecent(window), WindowedAttention(window, gqa="mean", pool="avg", kernel=kernel), TopK(),
        name=f"snapkv(window={window})",
    )


def tova() -> Pipeline:
    """TOVA: keep the tokens with the highest attention from the newest query, averaged over heads
    (one keep-set per layer). Oren et al., arXiv 2401.06104."""
    return Pipeline(LastQueryAttention(per_head=False), TopK(), name="tova")


def knorm(sinks: int = 0) -> Pipeline:
    """Knorm: keep low-L2-norm keys (Devoto et al., EMNLP 2024, arXiv 2406.11430; kvpress's KnormPress)."""
    blocks = [ProtectSinks(sinks)] if sinks else []
    return Pipeline(*blocks, KeyNorm(), TopK(), name="knorm")
