"""Compositions of kvcompose presets for the fidelity tables (`kvcompose bench fidelity --pipelines
benchmarks/compositions.py --methods NAME ...`; docs/results.md, "Compositions").

Each entry is `name -> callable(budget) -> Pipeline`. `PARENTS[name]` names the two presets (or compositions)
whose blocks it combines, so the table can say whether a combination beats both of its parents. The blocks
keep their presets' published defaults; where a protector could take the whole budget it is capped:
prompt protection takes at most half the budget (`ProtectPrompt(limit=0.5)`), so recent tokens and scored
tokens keep room (a prompt longer than that keeps its first 4 and its newest tokens, `keep="ends"`).
"""

from __future__ import annotations

from kvcompose import (
    AccumulatedAttention, LastQueryAttention, Pipeline, ProtectPrompt, ProtectRecent, ProtectSinks, ProtectValueNorm,
    TopK, WindowedAttention, methods,
)
from kvcompose.scorers import KeyNorm, KeyRedundancy


def _prompt() -> ProtectPrompt:
    return ProtectPrompt(limit=0.5)


def h2o_prompt(budget: int | None = None, recent: float = 0.25) -> Pipeline:
    """H2O's heavy hitters + Random Attention's prompt protection (recent window a quarter of the budget)."""
    return Pipeline(ProtectRecent(recent), _prompt(), AccumulatedAttention(), TopK(), name="h2o+prompt")


def h2o_value(budget: int | None = None) -> Pipeline:
    """H2O + VaSE's value protection (the budget/4 tokens of largest value range, 4 sinks among them)."""
    return Pipeline(ProtectRecent(0.25), ProtectValueNorm(0.25, sinks=4), AccumulatedAttention(), TopK(),
                    name="h2o+value")


def h2o_prompt_value(budget: int | None = None) -> Pipeline:
    """H2O + prompt protection + value protection (a budget/8 value-protected share)."""
    return Pipeline(ProtectRecent(0.25), _prompt(), ProtectValueNorm(0.125, sinks=4), AccumulatedAttention(), TopK(),
                    name="h2o+prompt+value")


def snapkv_prompt(budget: int | None = None) -> Pipeline:
    """SnapKV (window 32) + prompt protection."""
    return Pipeline(ProtectRecent(32), _prompt(), WindowedAttention(32, gqa="mean", pool="avg", kernel=5), TopK(),
                    name="snapkv+prompt")


def snapkv_value(budget: int | None = None) -> Pipeline:
    """SnapKV + VaSE's value protection."""
    return Pipeline(ProtectRecent(32), ProtectValueNorm(0.25, sinks=4),
                    WindowedAttention(32, gqa="mean", pool="avg", kernel=5), TopK(), name="snapkv+value")


def tova_prompt(budget: int | None = None) -> Pipeline:
    """TOVA + prompt protection."""
    return Pipeline(_prompt(), LastQueryAttention(per_head=False), TopK(), name="tova+prompt")


def knorm_prompt(budget: int | None = None) -> Pipeline:
    """Knorm + prompt protection (and 4 sinks, which the prompt's start holds anyway)."""
    return Pipeline(ProtectSinks(4), _prompt(), KeyNorm(), TopK(), name="knorm+prompt")


def rkv_prompt(budget: int | None = None) -> Pipeline:
    """R-KV + prompt protection."""
    base = methods.rkv()
    return Pipeline(ProtectRecent(8), _prompt(), base.scorer, TopK(), name="rkv+prompt", interval=128)


def h2o_redundancy(budget: int | None = None, lam: float = 0.5) -> Pipeline:
    """H2O's accumulated attention, normalised per query that could see the token, minus R-KV's redundancy."""
    return Pipeline(ProtectRecent(0.25), lam * AccumulatedAttention(normalize=True) - (1 - lam) * KeyRedundancy(),
                    TopK(), name="h2o+redundancy")


def streaming_prompt(budget: int | None = None) -> Pipeline:
    """StreamingLLM (4 sinks + recent) with the prompt protected instead of only its first 4 tokens."""
    from kvcompose.scorers import Recency

    return Pipeline(ProtectSinks(4), _prompt(), Recency(), TopK(), name="streaming_llm+prompt")


def h2o_recent(recent: int | float) -> callable:
    """H2O with another recent window (the preset keeps half the budget recent)."""
    return lambda budget=None: Pipeline(ProtectRecent(recent), AccumulatedAttention(), TopK(), name=f"h2o(recent={recent})")


def h2o_prompt_recent(recent: int | float) -> callable:
    return lambda budget=None: Pipeline(ProtectRecent(recent), _prompt(), AccumulatedAttention(), TopK(),
                                        name=f"h2o+prompt(recent={recent})")


def h2o_snapkv(budget: int | None = None, recent: int | float = 32) -> Pipeline:
    """H2O's accumulated attention per query that could see the token plus SnapKV's window attention (window 32,
    pooled): long-run and recent importance in one score."""
    return Pipeline(ProtectRecent(recent), AccumulatedAttention(normalize=True)
                    + WindowedAttention(32, gqa="mean", pool="avg", kernel=5), TopK(), name="h2o+snapkv")


def h2o_snapkv_prompt(budget: int | None = None) -> Pipeline:
    return Pipeline(ProtectRecent(32), _prompt(), AccumulatedAttention(normalize=True)
                    + WindowedAttention(32, gqa="mean", pool="avg", kernel=5), TopK(), name="h2o+snapkv+prompt")


def with_heads(base: callable, name: str, floor: float = 0.25) -> callable:
    """`base` with ReasonAlloc's head-wise budgets (`HeadUtility`, water-filling of the window's attention
    mass, a floor of `floor` of the layer budget per head; no layer profile): heads whose attention spreads
    get more slots, the per-row total unchanged (AdaKV's idea)."""
    from kvcompose.allocators import HeadUtility
    from kvcompose.methods.allocation import with_allocator

    return lambda budget=None: with_allocator(base(budget), HeadUtility(floor=floor), name=name)


PIPELINES = {
    "h2o+prompt": h2o_prompt,
    "h2o+value": h2o_value,
    "h2o+prompt+value": h2o_prompt_value,
    "snapkv+prompt": snapkv_prompt,
    "snapkv+value": snapkv_value,
    "tova+prompt": tova_prompt,
    "knorm+prompt": knorm_prompt,
    "rkv+prompt": rkv_prompt,
    "h2o+redundancy": h2o_redundancy,
    "streaming_llm+prompt": streaming_prompt,
    "h2o(recent=32)": h2o_recent(32),
    "h2o(recent=64)": h2o_recent(64),
    "h2o+prompt(recent=32)": h2o_prompt_recent(32),
    "h2o+snapkv": h2o_snapkv,
    "h2o+snapkv+prompt": h2o_snapkv_prompt,
    "h2o+heads": with_heads(lambda b: methods.h2o(), "h2o+heads"),
    "h2o+prompt+heads": with_heads(h2o_prompt, "h2o+prompt+heads"),
    "snapkv+heads": with_heads(lambda b: methods.snapkv(), "snapkv+heads"),
    "h2o+snapkv+heads": with_heads(h2o_snapkv, "h2o+snapkv+heads"),
}

PARENTS = {
    "h2o+prompt": ("h2o", "random_attention"),
    "h2o+value": ("h2o", "vase"),
    "h2o+prompt+value": ("h2o+prompt", "h2o+value"),
    "snapkv+prompt": ("snapkv", "random_attention"),
    "snapkv+value": ("snapkv", "vase"),
    "tova+prompt": ("tova", "random_attention"),
    "knorm+prompt": ("knorm", "random_attention"),
    "rkv+prompt": ("rkv", "random_attention"),
    "h2o+redundancy": ("h2o", "rkv"),
    "streaming_llm+prompt": ("streaming_llm", "random_attention"),
    "h2o+snapkv": ("h2o", "snapkv"),
    "h2o+snapkv+prompt": ("h2o+snapkv", "snapkv+prompt"),
    "h2o+heads": ("h2o", "reason_alloc"),
    "h2o+prompt+heads": ("h2o+prompt", "h2o+heads"),
    "snapkv+heads": ("snapkv", "reason_alloc"),
    "h2o+snapkv+heads": ("h2o+snapkv", "h2o+heads"),
}
