"""An argument a pipeline cannot use (a budget, interval, ratio or seed that has no effect) is accepted with a
`KVComposeWarning` naming why, never silently; every default and every argument that does change something
stays silent."""

from __future__ import annotations

import warnings

import pytest

from kvcompose import (
    BranchCache, Evict, KVComposeCache, KVComposeWarning, Pipeline, Prefetcher, ProjectedNorm, ProtectPrompt,
    RandomDrop, TopK, WindowedAttention, methods,
)
from kvcompose.scorers import KeyNorm

from helpers import ratio_curves, tree_model

MODEL = tree_model()


def _warns(match: str, fn):
    with pytest.warns(KVComposeWarning, match=match):
        return fn()


def _silent(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVComposeWarning)
        return fn()


def test_cache_arguments_without_effect_warn():
    _warns("budget=64\\) has no effect: full never compresses", lambda: KVComposeCache(MODEL, methods.full(), budget=64))
    _warns("interval=8\\) has no effect", lambda: KVComposeCache(MODEL, methods.full(), interval=8))
    _warns("compress_prefill=True\\) has no effect", lambda: KVComposeCache(MODEL, methods.full(), compress_prefill=True))
    _warns("reserve=True\\) has no effect", lambda: KVComposeCache(MODEL, methods.full(), reserve=True))
    _warns("seed=3\\) has no effect: no block of rkv", lambda: KVComposeCache(MODEL, methods.rkv(), budget=64, seed=3))
    _warns("seed=1\\) has no effect", lambda: KVComposeCache(MODEL, methods.full(), seed=1))
    _warns("interval=8\\) has no effect: GrowPage", lambda: KVComposeCache(MODEL, methods.growpage(), budget=64, interval=8))
    _warns("reserve=True\\) has no effect.*pages", lambda: KVComposeCache(MODEL, methods.reason_alloc(profile=None),
                                                                        budget=64, reserve=True))
    _warns("prefetcher=...\\) has no effect", lambda: KVComposeCache(MODEL, methods.rkv(), budget=64,
                                                                     prefetcher=Prefetcher()))


def test_cache_arguments_with_effect_are_silent():
    _silent(lambda: KVComposeCache(MODEL, methods.full()))
    _silent(lambda: KVComposeCache(MODEL, methods.rkv(), budget=64, interval=8, compress_prefill=True, reserve=True))
    _silent(lambda: KVComposeCache(MODEL, methods.random_attention(), budget=128, seed=3))
    _silent(lambda: KVComposeCache(MODEL, methods.vase(), budget=128, seed=3))  # Sample draws
    _silent(lambda: KVComposeCache(MODEL, methods.memory_hierarchy(0.5), prefetcher=Prefetcher(lookahead=0)))
    _silent(lambda: KVComposeCache(MODEL, methods.growpage(), budget=64))


def test_tree_cache_arguments_without_effect_warn():
    _warns("interval=8\\) has no effect: without active_budget", lambda: BranchCache(MODEL, budget=64, interval=8))
    _warns("host_limit=100\\) has no effect", lambda: BranchCache(MODEL, budget=64, tier=Evict(), host_limit=100))
    _warns("seed=2\\) has no effect", lambda: BranchCache(MODEL, budget=64, seed=2))
    _silent(lambda: BranchCache(MODEL, budget=64, active_budget=32, interval=8, host_limit=100,
                                scorer=Pipeline(RandomDrop()), seed=2))


def test_preset_and_block_options_switched_off_warn():
    _warns("bits=4\\) has no effect: compressed_ratio=0", lambda: methods.memory_hierarchy(0.5, bits=4))
    _warns("sinks=2\\) has no effect: prompt=False", lambda: methods.memory_hierarchy(0.5, prompt=False, sinks=2))
    _warns("protect=0.5\\) has no effect: the query-free", lambda: methods.vase(query_free=True, protect=0.5))
    _warns("window=32\\) has no effect", lambda: methods.vase(query_free=True, window=32))
    _warns("rank=8\\) has no effect", lambda: methods.vase(rank=8))
    _warns("layer_floor=0.5\\) has no effect: profile=None", lambda: methods.reason_alloc(profile=None, layer_floor=0.5))
    _warns("model=...\\) has no effect", lambda: methods.reason_alloc(profile=None, model=MODEL))
    _warns("interval=8\\) has no effect", lambda: Pipeline(interval=8))
    _warns("kernel=7\\) has no effect: pool='none'", lambda: WindowedAttention(8, pool="none", kernel=7))
    _warns("sinks=2\\) has no effect: keep='first'", lambda: ProtectPrompt(keep="first", sinks=2))
    _warns("seed=3\\) has no effect", lambda: ProjectedNorm(fixed=False, seed=3))
    _warns("hbm_ratio=1\\) has no effect", lambda: methods.memory_hierarchy(1.0))
    _warns("AccumulatedAttention.*at budget=32 has no effect: the protectors keep the whole budget",
           lambda: KVComposeCache(MODEL, methods.h2o(recent=1.0), budget=32))
    _warns("Recency.*at budget=8 has no effect", lambda: KVComposeCache(MODEL, methods.streaming_llm(sinks=8), budget=8))
    _silent(lambda: [fn() for fn in methods.PRESETS.values()])  # every default is silent
    _silent(lambda: (methods.memory_hierarchy(0.5, 0.2, bits=4), methods.vase(query_free=True, rank=8),
                     methods.reason_alloc(profile={"demand": [1.0, 2.0]}, layer_floor=0.5),
                     Pipeline(KeyNorm(), TopK(), interval=8), ProtectPrompt(sinks=2), ProjectedNorm(seed=3)))


_DUO = {"head_scores": [[0.9, 0.1], [0.2, 0.8]]}
_LUKV = {"prune": ratio_curves(2, 2)}


def test_ported_preset_arguments_without_effect_warn():
    from kvcompose.blocks import CompositeTokens, DuoHeads, OutputProjection, Rotary

    rope = Rotary.from_model(MODEL)
    for name in ("keydiff", "lagkv", "cur", "noncausal_attention", "kvcompose_paper", "cam", "merging", "chunkkv",
                 "adakv"):
        _warns(f"{name}\\(model=...\\) has no effect", lambda: getattr(methods, name)(model=MODEL))
    _warns("duo_attention\\(model=...\\) has no effect", lambda: methods.duo_attention(_DUO, model=MODEL))
    _warns("expected_attention\\(model=...\\) has no effect: rope= is given",
           lambda: methods.expected_attention(MODEL, rope=rope))
    _warns("lukv\\(model=...\\) has no effect: base= is given",
           lambda: methods.lukv(_LUKV, base=methods.snapkv(), model=MODEL))
    _warns("criticalkv\\(model=...\\) has no effect", lambda: methods.criticalkv(
        MODEL, inner=KeyNorm(), projection=OutputProjection.from_model(MODEL)))
    _warns("CompositeTokens\\(floor=2\\) has no effect: structured=True", lambda: CompositeTokens(floor=2))
    _warns("CompositeTokens\\(floor=2\\) has no effect", lambda: methods.kvcompose_paper(floor=2))
    _warns("DuoHeads\\(retrieval=8\\) has no effect: streaming=1", lambda: DuoHeads(_DUO, streaming=1.0, retrieval=8))


def test_ported_presets_are_silent_where_every_argument_counts():
    from kvcompose.blocks import CompositeTokens, DuoHeads

    need = {"duo_attention": {"profile": _DUO}, "lukv": {"curves": _LUKV}}
    # methods.preset passes the model only where the rule reads it: one call builds any ported preset, silently
    _silent(lambda: [methods.preset(name, model=MODEL, **need.get(name, {})) for name in methods.PORTED])
    _silent(lambda: [methods.preset(name, **need.get(name, {})) for name in methods.PORTED
                     if name not in methods.NEEDS_MODEL])
    _silent(lambda: (methods.kvcompose_paper(structured=False, floor=2), CompositeTokens(structured=False, floor=0.2),
                     DuoHeads(_DUO, streaming=0.5, retrieval=8), methods.lukv(_LUKV, model=MODEL),
                     methods.expected_attention(MODEL), methods.criticalkv(MODEL)))


def test_seed_of_a_block_that_draws_is_silent():
    """`leverage`, `compactor`, `cam` and `CUR(random_projection=True)` draw from the layer's generator (the seed
    changes what they keep); the cache warned that their seed had no effect. A merger draws only on tokens that
    leave for good: with a tier that keeps every token, `cam`'s seed has no effect (and says so)."""
    from kvcompose import HostTier
    from kvcompose.blocks import CUR

    for pipe in (methods.leverage(MODEL), methods.compactor(MODEL), methods.cam(), Pipeline(CUR(random_projection=True),
                                                                                          TopK())):
        _silent(lambda: KVComposeCache(MODEL, pipe, budget=64, seed=3))
        _silent(lambda: BranchCache(MODEL, budget=64, scorer=pipe, tier=Evict(), seed=3))
    _warns("seed=3\\) has no effect", lambda: KVComposeCache(MODEL, methods.with_tier(methods.cam(), HostTier()),
                                                             budget=64, seed=3))
    _silent(lambda: BranchCache(MODEL, budget=64, scorer=methods.cam(), host_limit=10**6, seed=3))  # may evict
