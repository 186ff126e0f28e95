"""Copying a cache (`copy.deepcopy`, `pickle`, `torch.save`) gives an independent cache that shares the model and
decodes exactly like the original from there, plain and tree caches, dense and paged stores, with and without a
tier; what cannot be copied is refused by name (issue items 5 and 8)."""

from __future__ import annotations

import copy
import gc
import io
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompose import BranchCache, KVComposeCache, KVComposeError, Pipeline, Scorer, TopK, methods
from kvcompose import attention as kv_attention
from zoo import PORTED, build, cases, decode, greedy, ids, variant

from helpers import examples, tree_model

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = tree_model()


def _copy(cache, how: str):
    if how == "deepcopy":
        return copy.deepcopy(cache)
    if how == "pickle":
        out = pickle.loads(pickle.dumps(cache))
    else:
        buf = io.BytesIO()
        torch.save(cache, buf)
        buf.seek(0)
        out = torch.load(buf, weights_only=False)
    with pytest.raises(KVComposeError, match="bind\\(model\\)"):  # a loaded cache refuses to decode unbound
        greedy(MODEL, out, ids(1), 1)
    return out.bind(MODEL)


def _summary(cache):
    return ([layer.events for layer in cache.layers], cache.held_lengths(),
            [cache.kept_positions(i) for i in range(len(cache.layers))], cache.memory().by_tier)


def _same(a, b):
    ea, ha, ka, ta = a
    eb, hb, kb, tb = b
    assert ea == eb and ha == hb and ta == tb
    assert all(torch.equal(x, y) for x, y in zip(ka, kb))


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), how=st.sampled_from(["deepcopy", "pickle", "torch.save"]), budget=st.integers(12, 16),
       interval=st.integers(2, 6), prompt=st.integers(2, 12), new=st.integers(0, 14), seed=st.integers(0, 3))
def test_copy_then_continue_equals_original_then_continue(case, how, budget, interval, prompt, new, seed):
    _copy_case(build(case), how, budget, interval, prompt, new, seed)


@pytest.mark.parametrize("name", sorted(PORTED))
@settings(max_examples=examples(2), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(store=st.sampled_from(["dense", "paged"]), tier=st.sampled_from(["evict", "host", "hierarchy"]),
       how=st.sampled_from(["deepcopy", "pickle", "torch.save"]), budget=st.integers(12, 16),
       interval=st.integers(2, 6), prompt=st.integers(2, 12), new=st.integers(0, 14), seed=st.integers(0, 3))
def test_ported_presets_copy_then_continue(name, store, tier, how, budget, interval, prompt, new, seed):
    """The same property for every preset ported from kvpress (`methods.PORTED`), on both stores and each tier."""
    _copy_case(variant(PORTED[name](MODEL), store, tier), how, budget, interval, prompt, new, seed)


def _copy_case(pipe, how, budget, interval, prompt, new, seed):
    try:
        cache = KVComposeCache(MODEL, pipe, budget=budget if pipe.compresses else None, interval=interval, seed=seed)
    except KVComposeError:
        return  # the constructor refuses this budget for the pipeline
    seq = ids(prompt + new + 1, seed)
    decode(MODEL, cache, seq[:, : prompt + new], 0, prompt)
    twin = _copy(cache, how)
    assert twin.bound_model() is MODEL and twin.layers[0] is not cache.layers[0]
    # the copy decodes first: were anything shared, the original's continuation would change
    b_tok, b_log = greedy(MODEL, twin, seq[:, -1:], 10)
    a_tok, a_log = greedy(MODEL, cache, seq[:, -1:], 10)
    assert torch.equal(a_tok, b_tok) and torch.equal(a_log, b_log)
    _same(_summary(cache), _summary(twin))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copy_outlives_the_original(how):
    """Issue item 8: a deep copy whose original was collected raised an error blaming a changed attention
    implementation (the copy's layers still pointed at the original, which had released the model)."""
    pipe = methods.rkv(window=2)
    cache = KVComposeCache(MODEL, pipe, budget=12, interval=4)
    seq = ids(40, 1)
    decode(MODEL, cache, seq[:, :20], 0, 8)
    ref = copy.deepcopy(cache)
    twin = _copy(cache, how)
    del cache
    gc.collect()
    assert kv_attention.is_installed(MODEL)  # the copy holds the model's attention switch too
    a = greedy(MODEL, twin, seq[:, 20:21], 12)
    b = greedy(MODEL, ref, seq[:, 20:21], 12)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_pickle_after_decoding():
    """Issue item 5: `pickle.dumps(cache)` after decoding raised "cannot pickle 'weakref.ReferenceType' object"."""
    cache = KVComposeCache(MODEL, methods.h2o(), budget=12, interval=4)
    MODEL.generate(input_ids=ids(10, 2), past_key_values=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    data = pickle.dumps(cache)
    loaded = pickle.loads(data).bind(MODEL)
    assert loaded.get_seq_length() == cache.get_seq_length() and loaded.held_lengths() == cache.held_lengths()


def test_copy_refusals_name_the_problem():
    cache = KVComposeCache(MODEL, methods.rkv(), budget=64)
    with pytest.raises(KVComposeError, match="deepcopy"):
        copy.copy(cache)
    with pytest.raises(KVComposeError, match="deepcopy"):
        copy.copy(BranchCache(MODEL))

    class Hook(Scorer):  # a block holding something pickle cannot store (a local function)
        def __init__(self):
            self.fn = lambda view: view.positions.float()

        def score(self, view):
            return self.fn(view)

    odd = KVComposeCache(MODEL, Pipeline(Hook(), TopK()), budget=12, interval=4)
    decode(MODEL, odd, ids(16, 3), 0, 8)
    with pytest.raises(KVComposeError, match="cannot pickle this KVComposeCache.*Hook.*deepcopy"):
        pickle.dumps(odd)
    twin = copy.deepcopy(odd)  # in-process copies share the function
    assert twin.held_lengths() == odd.held_lengths()
    loaded = pickle.loads(pickle.dumps(KVComposeCache(MODEL, methods.rkv(), budget=64)))
    other = tree_model("qwen3")
    with pytest.raises(KVComposeError, match="cannot bind: the cache was built for a llama model"):
        loaded.bind(other)
    loaded.bind(MODEL)
    with pytest.raises(KVComposeError, match="bound to another model"):
        loaded.bind(other)
    tree = pickle.loads(pickle.dumps(BranchCache(MODEL)))
    tree.close()  # an unbound tree closes too (nothing to release)
    with pytest.raises(KVComposeError, match="bind\\(model\\)"):
        greedy(MODEL, tree, ids(1), 1)


def _tree(budget, active, tier, seed):
    return BranchCache(MODEL, budget=budget, keep=0.25, scorer=methods.h2o() if active else None, tier=tier,
                       active_budget=16 if active else None, interval=4, seed=seed)


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(how=st.sampled_from(["deepcopy", "pickle", "torch.save"]), tier=st.sampled_from(["host", "evict"]),
       active=st.booleans(), seed=st.integers(0, 3), switch_back=st.booleans())
def test_tree_copy_then_continue_equals_original(how, tier, active, seed, switch_back):
    """A tree with a compressed inactive branch: the copy continues (and switches, rehydrates, recomputes)
    exactly like the original."""
    from kvcompose import Evict, HostTier

    cache = _tree(40, active, HostTier() if tier == "host" else Evict(), seed)
    prompt = ids(12, seed)
    with torch.no_grad():
        MODEL(input_ids=prompt, past_key_values=cache)
    a, b = cache.fork(0), cache.fork(0)
    cache.switch(a)
    greedy(MODEL, cache, ids(1, seed + 1), 14)
    cache.switch(b)
    greedy(MODEL, cache, ids(1, seed + 2), 20)
    assert cache.compressions > 0
    twin = _copy(cache, how)
    mine, theirs = set(twin._all_nodes()), set(cache._all_nodes())
    assert all(n.parent is None or (n.parent in mine and n.parent not in theirs) for n in mine)  # its own tree
    runs = []
    for c in (twin, cache):
        if switch_back:
            c.switch(a)  # the compressed branch: rehydrated (host) or recomputed (evict) before decoding
        tok, log = greedy(MODEL, c, ids(1, seed + 3), 8)
        runs.append((tok, log, c.memory().held, c.rehydrations, c.compressions, c.path_length()))
    (t1, l1, *rest1), (t2, l2, *rest2) = runs
    assert torch.equal(t1, t2) and torch.equal(l1, l2) and rest1 == rest2
