"""Rolling a cache back (`crop`) is exact or refused: after a crop the cache is what a fresh cache fed only the
tokens before the crop point holds, so decoding on gives the same tokens, logits and kept sets; when that is not
possible the crop raises `KVComposeError` naming why and changes nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcompose import BranchCache, KVComposeCache, KVComposeError, methods
from zoo import PORTED, PRESETS, build, cases, decode, greedy, ids, variant

from helpers import examples, tree_model

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = tree_model()


def _cache(pipe, budget, interval, seed=0):
    return KVComposeCache(MODEL, pipe, budget=budget if pipe.compresses else None, interval=interval, seed=seed)


def _state(cache):
    return cache.get_seq_length(), cache.held_lengths(), [layer.events for layer in cache.layers]


def _check_exact(cache, pipe, budget, interval, seq, prompt, end, seed=0, steps=8):
    """Continue the cropped cache and a fresh cache fed `seq[:, :end]` (prompt, then one token per step)."""
    fresh = _cache(pipe, budget, interval, seed)
    if end:
        decode(MODEL, fresh, seq[:, :end], 0, min(prompt, end))
    assert cache.get_seq_length() == fresh.get_seq_length() == end
    assert cache.held_lengths() == fresh.held_lengths()
    a_tok, a_log = greedy(MODEL, cache, seq[:, end : end + 1], steps)
    b_tok, b_log = greedy(MODEL, fresh, seq[:, end : end + 1], steps)
    assert torch.equal(a_tok, b_tok)
    # equal up to float rounding: a token the cropped cache computed inside a longer forward (a prompt cut short)
    # comes from a matmul of another shape than the fresh run's
    torch.testing.assert_close(a_log, b_log, rtol=1e-4, atol=1e-4)
    for i in range(len(cache.layers)):
        assert torch.equal(cache.kept_positions(i), fresh.kept_positions(i))
    assert [layer.events for layer in cache.layers] == [layer.events for layer in fresh.layers] or end == 0


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), budget=st.integers(12, 16), interval=st.integers(2, 6), prompt=st.integers(2, 12),
       new=st.integers(6, 20), crop=st.one_of(st.integers(1, 8), st.integers(1, 32)), seed=st.integers(0, 3))
def test_crop_then_continue_is_a_fresh_run_or_refused(case, budget, interval, prompt, new, crop, seed):
    _crop_case(build(case), budget, interval, prompt, new, crop, seed)


@pytest.mark.parametrize("name", sorted(PORTED))
@settings(max_examples=examples(2), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(store=st.sampled_from(["dense", "paged"]), tier=st.sampled_from(["evict", "host", "hierarchy"]),
       budget=st.integers(12, 16), interval=st.integers(2, 6), prompt=st.integers(2, 12), new=st.integers(6, 20),
       crop=st.one_of(st.integers(1, 8), st.integers(1, 32)), seed=st.integers(0, 3))
def test_ported_presets_crop_exact_or_refused(name, store, tier, budget, interval, prompt, new, crop, seed):
    """The same property for every preset ported from kvpress (`methods.PORTED`), on both stores and each tier."""
    _crop_case(variant(PORTED[name](MODEL), store, tier), budget, interval, prompt, new, crop, seed)


def _crop_case(pipe, budget, interval, prompt, new, crop, seed):
    try:
        cache = _cache(pipe, budget, interval, seed)
    except KVComposeError:
        event("constructor refuses")
        return  # the constructor refuses this budget for the pipeline (its protectors do not fit)
    seq = ids(prompt + new + 1, seed)
    decode(MODEL, cache, seq[:, : prompt + new], 0, prompt)
    seen = prompt + new
    n = min(crop, seen)
    before = _state(cache)
    try:
        cache.crop(-n)
    except KVComposeError as e:
        assert str(e).startswith(f"cannot crop {n} tokens: ")
        assert _state(cache) == before  # a refused crop changes nothing
        event("crop refused")
        return
    event("crop exact")
    _check_exact(cache, pipe, budget, interval, seq, prompt, seen - n, seed)


@pytest.mark.parametrize("name", ["full", "streaming_llm", "rkv", "snapkv", "random_attention", "vase", "tova",
                                  "knorm", "pyramid_rkv", "reason_alloc"])
def test_crop_since_the_last_event_is_exact(name):
    """Not vacuous: every preset without observer state crops exactly back to its last compression event (and a
    query-window preset as far as its next event still reads only queries it holds)."""
    pipe = PRESETS[name]()
    budget, interval, prompt = 16, 8, 10
    cache = _cache(pipe, budget, interval)
    seq = ids(prompt + 30, 1)
    decode(MODEL, cache, seq[:, : prompt + 28], 0, prompt)  # events at seen 18, 26, 34 (decoded multiples of 8)
    assert not pipe.compresses or max(layer.events for layer in cache.layers) >= 2
    cache.crop(-2)  # back to 36, after the last event at 34
    _check_exact(cache, pipe, budget, interval, seq, prompt, prompt + 26)


@pytest.mark.parametrize("store", ["dense", "paged"])
def test_full_cache_crops_anywhere(store):
    pipe = variant(methods.full(), store, "evict")
    cache = _cache(pipe, None, 4)
    seq = ids(30, 2)
    decode(MODEL, cache, seq[:, :29], 0, 9)
    cache.crop(-25)  # into the prompt
    assert all(layer.prompt_length == 4 for layer in cache.layers)
    _check_exact(cache, pipe, None, 4, seq, 9, 4)
    cache.crop(-cache.get_seq_length() - 3)  # everything
    assert cache.get_seq_length() == 0
    _check_exact(cache, pipe, None, 4, seq, 9, 0)
    cache.crop(0)
    cache.crop(cache.get_seq_length() + 5)  # the legacy form: keep at most that many tokens


def test_crop_after_h2o_is_refused():
    """Issue item 1: with H2O (budget 16, interval 8), generate 13, crop(-3), continue 20: the tokens differed from
    a cache that never saw those 3 tokens (the per-token accumulated attention was not rolled back)."""
    cache = _cache(methods.h2o(), 16, 8)
    prompt = ids(12, 3)
    out = MODEL.generate(input_ids=prompt, past_key_values=cache, max_new_tokens=13, min_new_tokens=13, do_sample=False)
    before = _state(cache)
    with pytest.raises(KVComposeError, match="AccumulatedAttention.*cannot be taken back.*deepcopy"):
        cache.crop(-3)
    assert _state(cache) == before
    # what to do instead: a copy at the point to come back to decodes exactly like a fresh run from there
    ref = _cache(methods.h2o(), 16, 8)
    MODEL.generate(input_ids=prompt, past_key_values=ref, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    import copy

    saved = copy.deepcopy(ref)
    MODEL.generate(input_ids=out[:, :-3], past_key_values=ref, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    a = MODEL.generate(input_ids=out[:, :-3], past_key_values=saved, max_new_tokens=20, min_new_tokens=20,
                       do_sample=False)
    fresh = _cache(methods.h2o(), 16, 8)
    MODEL.generate(input_ids=prompt, past_key_values=fresh, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    c = MODEL.generate(input_ids=out[:, :-3], past_key_values=fresh, max_new_tokens=20, min_new_tokens=20,
                       do_sample=False)
    assert torch.equal(a, c)


def test_crop_across_a_compression_event_is_refused():
    """Issue item 2: R-KV, budget 16, interval 8, generate 10, crop(-3): the cache held 14 tokens at 26 seen (a run
    that never fed them holds 26) and the continuation differed."""
    cache = _cache(methods.rkv(), 16, 8)
    prompt = ids(17, 4)
    MODEL.generate(input_ids=prompt, past_key_values=cache, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert max(layer.events for layer in cache.layers) == 1  # the event at 25 seen (8 decoded)
    before = _state(cache)
    with pytest.raises(KVComposeError, match="compression event at token 25.*crop at most 1 "):
        cache.crop(-3)
    assert _state(cache) == before


def test_query_window_refusal_names_the_limit():
    """A query-window preset whose ring dropped queries that the next event of the cropped cache would read."""
    cache = _cache(methods.snapkv(window=4, kernel=3), 20, 8)
    seq = ids(40, 5)
    decode(MODEL, cache, seq[:, :23], 0, 10)  # schedule points at 18 (18 held: no event) and 26; ring: 19-22
    assert max(layer.events for layer in cache.layers) == 0
    before = _state(cache)
    with pytest.raises(KVComposeError, match="last 4 queries.*event \\(token 18\\).*crop at most 5 "):
        cache.crop(-6)  # back to 17: its next event (18) would read queries 14-17, dropped here
    assert _state(cache) == before
    cache.crop(-4)  # back to 19: the next event (26) reads queries 22-25 only
    _check_exact(cache, methods.snapkv(window=4, kernel=3), 20, 8, seq, 10, 19)
    assert max(layer.events for layer in cache.layers) == 1  # the continuation ran the event at 26


def test_branch_cache_crop_is_refused_with_the_alternative():
    cache = BranchCache(MODEL)
    decode(MODEL, cache, ids(8, 6), 0, 8)
    with pytest.raises(KVComposeError, match="fork"):
        cache.crop(-1)


def test_deferred_stop_check_does_not_rely_on_crop():
    """transformers' deferred stop check (5.23, MPS) decodes one token too many and crops it when the cache says it
    is croppable; a kvcompose crop may be refused, so the caches say they are not (generate then stops exactly)."""
    gen_utils = pytest.importorskip("transformers.generation.utils")
    check = getattr(gen_utils, "DeferredStopCheck", None)
    if check is None:
        pytest.skip("this transformers has no deferred stop check")
    for cache in (_cache(methods.rkv(), 16, 8), BranchCache(MODEL)):
        assert cache.is_croppable is False
        assert not check.is_supported(torch.device("mps"), cache, True, False)
