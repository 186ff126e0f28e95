"""kvpress 0.5.5's presses as kvcompose presets, at their papers' (and kvpress's) defaults.

Each preset is a few blocks from `kvcompose.blocks` (one press per file there). Presets whose rule needs
the model's data (its rotary embedding, its output projections) take `model=`; `methods.preset(name,
model=...)` builds any of them by name (`PORTED` lists them). `docs/methods.md` maps every kvpress press
to its kvcompose block or preset and says where the rule differs.
"""

from __future__ import annotations

from typing import Any

from ..blocks import (
    CAM, CAP, CUR, Compactor, CriticalKV, ExpectedAttention, KeyDiff, LagKV, LeverageScore, MergeSimilar, Merger,
    NonCausalAttention, OutputProjection, Rotary,
)
from ..block import require_role
from ..blocks.composite import AggregatedAttention, CompositeTokens
from ..blocks.duo import DuoHeads
from ..blocks.lukv import HeadCurves
from ..protectors import ProtectRecent, ProtectSinks
from ..scorers import Recency
from ..selectors import BlockGranular
from .baselines import h2o, snapkv
from ..pipeline import Pipeline
from ..scorers import Scorer
from ..selectors import TopK
from ..view import KVComposeError, warn_unused

__all__ = ["keydiff", "lagkv", "cur", "leverage", "noncausal_attention", "compactor", "expected_attention", "cap",
           "criticalkv", "with_merger", "cam", "merging", "chunkkv", "kvcompose_paper", "duo_attention", "lukv", "adakv", "PORTED", "NEEDS_MODEL", "NEEDS_PROFILE"]


def _unread(model: Any, who: str, why: str) -> None:
    """Warn that `model=` has no effect on the preset `who` (`methods.preset` passes it only where it is read)."""
    if model is not None:
        warn_unused(f"{who}(model=...)", why, stacklevel=4)


def _rope(model: Any, rope: Rotary | None, who: str) -> Rotary:
    if rope is not None:
        if not isinstance(rope, Rotary):
            raise KVComposeError(f"{who}: rope must be a kvcompose.blocks.Rotary, got {type(rope).__name__}")
        _unread(model, who, "rope= is given, and the rule reads nothing else of the model")
        return rope
    if model is None:
        raise KVComposeError(f"{who} needs the model (its rule is defined on pre-RoPE vectors): {who}(model=model)")
    return Rotary.from_model(model)


def keydiff(model: Any = None) -> Pipeline:
    """KeyDiff: keep the keys least similar to the mean key direction (Park et al., arXiv 2504.15364;
    kvpress's `KeyDiffPress`). Query-free: `model=` has no effect (it warns)."""
    _unread(model, "keydiff", "KeyDiff is query-free and reads nothing of the model")
    return Pipeline(KeyDiff(), TopK(), name="keydiff")


def lagkv(sinks: int = 4, lag: int = 128, model: Any = None) -> Pipeline:
    """LagKV: each partition of `lag` tokens scored against the next one, 4 sinks and the newest partition
    kept (Liang et al., arXiv 2504.04704; kvpress's `LagKVPress`, defaults 4 and 128). Query-free."""
    _unread(model, "lagkv", "LagKV is query-free and reads nothing of the model")
    return Pipeline(LagKV(sinks=sinks, lag=lag), TopK(), name=f"lagkv(lag={lag})")


def cur(sinks: int = 4, window: int = 16, model: Any = None) -> Pipeline:
    """CurDKV: approximate leverage `|k|^2 |v|^2` normalised in local windows of 16, 4 sinks
    (arXiv 2509.15038; kvpress's `CURPress` defaults). Query-free."""
    _unread(model, "cur", "CUR is query-free and reads nothing of the model")
    return Pipeline(CUR(sinks=sinks, window=window), TopK(), name="cur")


def leverage(model: Any = None, rope: Rotary | None = None, sketch: int = 48) -> Pipeline:
    """Compactor's leverage of the pre-RoPE keys alone (kvpress's `LeverageScorePress`, sketch 48). Query-free;
    needs the model's rotary embedding (`model=` or `rope=`)."""
    return Pipeline(LeverageScore(_rope(model, rope, "leverage"), sketch=sketch), TopK(), name="leverage")


def noncausal_attention(chunk: int = 256, window: int | None = 256, model: Any = None) -> Pipeline:
    """Compactor's non-causal chunked attention alone (kvpress's `NonCausalAttnPress`, chunk 256): a prefill
    rule (run it with `compress_prefill=True` and a window of at least the prompt)."""
    _unread(model, "noncausal_attention", "the rule reads only the cached keys and queries")
    return Pipeline(NonCausalAttention(chunk=chunk, window=window), TopK(), name="noncausal_attention")


def compactor(model: Any = None, rope: Rotary | None = None, sinks_start: int = 8, sinks_end: int = 4,
              chunk: int = 256, window: int | None = 256) -> Pipeline:
    """Compactor: leverage blended with non-causal chunked attention by the compression ratio, 8 leading and
    4 trailing tokens kept (Chari & Van Durme, arXiv 2507.08143; kvpress's `CompactorPress` defaults)."""
    scorer = Compactor(_rope(model, rope, "compactor"), sinks_start=sinks_start, sinks_end=sinks_end, chunk=chunk,
                       window=window)
    return Pipeline(scorer, TopK(), name="compactor")


def expected_attention(model: Any = None, rope: Rotary | None = None, window: int = 64, future: int = 512,
                       sinks: int = 4, epsilon: float = 0.0) -> Pipeline:
    """Expected Attention: the attention the next 512 queries are expected to pay, from the mean and
    covariance of the last `window` pre-RoPE queries, times `|v|`, 4 sinks (Devoto et al., arXiv 2510.00636;
    kvpress's `ExpectedAttentionPress` defaults; the window is kvpress's DecodingPress buffer at interval 64)."""
    scorer = ExpectedAttention(_rope(model, rope, "expected_attention"), window=window, future=future, sinks=sinks,
                               epsilon=epsilon)
    return Pipeline(scorer, TopK(), name=f"expected_attention(window={window})")


def cap(model: Any = None, rope: Rotary | None = None, tau: float = 5.0, window: int = 64, future: int = 512,
        sinks: int = 4) -> Pipeline:
    """CAP: query-weighted leverage of the values in a capacity matrix, tau 5, 4 sinks (kvpress's `CapPress`
    defaults)."""
    scorer = CAP(_rope(model, rope, "cap"), tau=tau, window=window, future=future, sinks=sinks)
    return Pipeline(scorer, TopK(), name="cap")


def criticalkv(model: Any = None, inner: Scorer | None = None, epsilon: float = 1e-4, first_stage: float = 0.5,
               rope: Rotary | None = None, projection: OutputProjection | None = None) -> Pipeline:
    """CriticalKV over `inner` (default: ExpectedAttention without its value norm, kvpress's recommended
    pairing): half the budget by the inner score, the rest by `(s + 1e-4) |v W_o|_1` (Feng et al.,
    arXiv 2502.03805; kvpress's `CriticalKVPress`). Needs the model (its output projections)."""
    if projection is not None and (inner is not None or rope is not None):
        _unread(model, "criticalkv", "projection= and the inner scorer (or rope=) are given")
    if projection is None:
        if model is None:
            raise KVComposeError("criticalkv needs the model's output projections: criticalkv(model=model)")
        projection = OutputProjection.from_model(model)
    if inner is None:
        inner = ExpectedAttention(_rope(model, rope, "criticalkv"), value_norm=False)
    return Pipeline(CriticalKV(inner, projection, epsilon=epsilon, first_stage=first_stage), TopK(),
                    name=f"criticalkv({inner!r})")


def with_merger(base: Pipeline, merger: Merger, name: str | None = None) -> Pipeline:
    """The blocks of `base` with `merger` folding the values of the tokens that leave for good into kept ones."""
    if not isinstance(base, Pipeline) or not base.compresses:
        raise KVComposeError(f"with_merger needs a compressing kvcompose Pipeline, got {base!r}")
    require_role(merger, Merger, "with_merger", " (MergeSimilar(), CAM())")
    if base.merger is not None:
        raise KVComposeError(f"{base!r} already merges with {base.merger!r}")
    return base.replace(merger, name=name or f"{base!r} + {merger!r}")


def cam(base: Pipeline | None = None, window: int = 32, model: Any = None) -> Pipeline:
    """CaM: evicted values merged into the 32 kept tokens after them with probability from accumulated attention
    (Zhang et al., ICML 2024; kvpress's `CAMPress`, `merge_budget=32`), over `base` eviction (H2O by default,
    one of the paper's base policies)."""
    _unread(model, "cam", "the base pipeline is built without it")
    base = base if base is not None else h2o()
    return with_merger(base, CAM(window=window), name=f"cam({base!r})")


def merging(base: Pipeline | None = None, threshold: float = 0.0, fraction: float = 1.0, model: Any = None) -> Pipeline:
    """MergingPress's rule: each evicted value folded into its most key-similar kept token, weighted by similarity
    and value norms (kvpress's `MergingPress` defaults), over `base` eviction (H2O by default)."""
    _unread(model, "merging", "the base pipeline is built without it")
    base = base if base is not None else h2o()
    return with_merger(base, MergeSimilar(threshold=threshold, fraction=fraction), name=f"merging({base!r})")


def chunkkv(base: Pipeline | None = None, chunk: int = 20, model: Any = None) -> Pipeline:
    """ChunkKV: whole chunks of 20 consecutive positions kept by their mean score summed over the KV heads (one
    set of chunks per layer row), over `base` scoring (SnapKV's by default, as the paper)
    (Liu et al., arXiv 2502.00299; kvpress's `ChunkKVPress`, `chunk_length=20`). This is `BlockGranular` over
    TopK with `per_head=False`: chunks are kept while they fit in the budget (kvpress keeps
    `int(chunks * (1 - ratio))` chunks, which can overshoot the target by up to one chunk)."""
    _unread(model, "chunkkv", "the base pipeline is built without it")
    base = base if base is not None else snapkv()
    if not base.compresses or base.scorer is None:
        raise KVComposeError(f"chunkkv needs a base pipeline with a scorer, got {base!r}")
    return base.replace(BlockGranular(TopK(), block=chunk, reduce="mean", per_head=False),
                        name=f"chunkkv({base!r}, chunk={chunk})")


def kvcompose_paper(structured: bool = True, window: int = 32, task: str = "max", value_norm: bool = False,
                    floor: int = 0, model: Any = None) -> Pipeline:
    """KVCompose, the paper (Akulov et al., arXiv 2509.05165; kvpress's `KVComposePress`), not this library:
    attention of the last `window` queries aggregated by max over queries and mean over the GQA group, plus the
    mean over heads; every head's sorted tokens aligned into composite tokens, the same count per head
    (`structured=True`, dense storage) or a per-head split of the layer's total by a global top-k
    (`structured=False`, paged storage)."""
    _unread(model, "kvcompose_paper", "the rule reads only the cached keys and queries")
    scorer = AggregatedAttention(window=window, task=task, value_norm=value_norm)  # type: ignore[arg-type]
    return Pipeline(scorer, CompositeTokens(structured=structured, floor=floor),
                    name=f"kvcompose_paper({'structured' if structured else 'unstructured'})")


def duo_attention(profile: Any = None, streaming: float = 0.5, sinks: int = 4, retrieval: int | None = None,
                  model: Any = None) -> Pipeline:
    """DuoAttention: the `streaming` share of (layer, KV head) pairs with the lowest calibrated scores keep
    `sinks` attention sinks plus the newest tokens (the cache's budget: `sinks + recent`); the others, retrieval
    heads, keep everything (Xiao et al., arXiv 2410.10819; kvpress's `DuoAttentionPress`,
    `head_compression_ratio=0.5`). `profile`: the JSON of `kvcompose calibrate --target duo` (or a `DuoHeads`
    profile dict). Paged storage: streaming heads really free their memory."""
    _unread(model, "duo_attention", "the head types come from the profile")
    if profile is None:
        raise KVComposeError("duo_attention needs a head profile: `kvcompose calibrate --target duo --out duo.json`, then "
                             "duo_attention(profile='duo.json')")
    return Pipeline(ProtectSinks(sinks), Recency(), TopK(), DuoHeads(profile, streaming=streaming, retrieval=retrieval),
                    name=f"duo_attention(streaming={streaming:g}, sinks={sinks})")


def lukv(curves: Any = None, base: Pipeline | None = None, sinks: int = 4, window: int = 1, model: Any = None) -> Pipeline:
    """LU-KV: head-wise budgets from a budget curve (`HeadCurves`, the JSON of `kvcompose calibrate --target lukv`),
    over `base` scoring (kvpress's default: ExpectedAttention with epsilon 0.02, which needs `model=`), with
    `sinks` first and `window` newest tokens protected ("Predicting Future Utility", arXiv 2602.08585; kvpress's
    `LUKVPress(ExpectedAttentionPress(epsilon=2e-2), sink=4, window=1)`)."""
    if curves is None:
        raise KVComposeError("lukv needs budget curves: `kvcompose calibrate --target lukv --out curves.json`, then "
                             "lukv(curves='curves.json', model=model)")
    if base is None:
        base = Pipeline(ExpectedAttention(_rope(model, None, "lukv"), epsilon=2e-2), TopK())
    else:
        _unread(model, "lukv", "base= is given (the model is read only for the default ExpectedAttention base)")
    prot = [*([ProtectSinks(sinks)] if sinks else []), *([ProtectRecent(window)] if window else [])]
    return base.replace(*base.protectors, *prot, HeadCurves(curves, floor=max(1, sinks + window)), name=f"lukv({base!r})")


def adakv(base: Pipeline | None = None, alpha: float = 0.2, model: Any = None) -> Pipeline:
    """AdaKV: every head first keeps its top `alpha` share of the budget, the rest of the layer's total goes to
    the best (head, token) pairs over all heads (Feng et al., arXiv 2407.11550; kvpress's `AdaKVPress`,
    `alpha_safeguard=0.2`), over `base` scoring (SnapKV's by default). `CompositeTokens(structured=False,
    floor=alpha)`: paged storage, head counts differ."""
    _unread(model, "adakv", "the base pipeline is built without it")
    base = base if base is not None else snapkv()
    if not base.compresses or base.scorer is None:
        raise KVComposeError(f"adakv needs a base pipeline with a scorer, got {base!r}")
    return base.replace(CompositeTokens(structured=False, floor=float(alpha)), name=f"adakv({base!r}, alpha={alpha:g})")


PORTED = {
    "keydiff": keydiff,
    "lagkv": lagkv,
    "cur": cur,
    "leverage": leverage,
    "noncausal_attention": noncausal_attention,
    "compactor": compactor,
    "expected_attention": expected_attention,
    "cap": cap,
    "criticalkv": criticalkv,
    "cam": cam,
    "merging": merging,
    "chunkkv": chunkkv,
    "kvcompose_paper": kvcompose_paper,
    "duo_attention": duo_attention,
    "lukv": lukv,
    "adakv": adakv,
}
"""Presets ported from kvpress, by name; every one takes `model=` (a `KVComposeWarning` where the rule does not read
it; `methods.preset` passes it only to the presets in `NEEDS_MODEL`)."""

NEEDS_MODEL = frozenset({"leverage", "compactor", "expected_attention", "cap", "criticalkv", "lukv"})
"""The ported presets whose rule needs the model's data (`model=` is required; `lukv` only for its default base)."""

NEEDS_PROFILE = {"duo_attention": "profile", "lukv": "curves"}
"""The ported presets that read a calibrated file (`kvcompose calibrate --target duo|lukv`), and its argument."""
