"""ArborKV-style mechanisms of BranchCache (issue 16): resuming a compressed branch from its kept subset
(no secret rehydration), exact rehydration equal to never compressing, and budgets that follow the search's
value estimates (lowest-value inactive nodes first, the active path never), each against a loop-level
reference of the rule."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import DynamicCache

from kvcompose import Evict, KVComposeError
from kvcompose.branch import BranchCache
from kvcompose.testing import tiny_model
from kvcompose.search import SharedKV, TreeSearch
from kvcompose.tiers import HostTier
from helpers import feed as _feed
from helpers import full_reference as _full
from helpers import rand_ids as _ids
from helpers import tree_model as _model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


def _tree(model, tier, rehydrate, budget=24, **kw):
    """Root (16 tokens) + branch a (12) + branch b (12): writing b compresses a to ceil(0.25 * 12) = 3 tokens."""
    prompt = _ids(16, seed=7)
    cache = BranchCache(model, budget=budget, keep=0.25, min_keep=1, tier=tier, rehydrate=rehydrate, **kw)
    _feed(model, cache, prompt)
    a, b = cache.fork(0), cache.fork(0)
    cache.switch(a)
    _feed(model, cache, _ids(12, seed=8))
    cache.switch(b)
    _feed(model, cache, _ids(12, seed=9))
    return cache, torch.cat([prompt, _ids(12, seed=8)], dim=1), a, b


@torch.no_grad()
def _subset_reference(model, cache, path_ids, new_ids):
    """Loop-level reference of resuming: a DynamicCache holding, per layer and KV head, exactly the keys and
    values (those of the full computation) at the positions the branch cache holds on its active path;
    the new tokens are fed at their true positions."""
    _, full = _full(model, path_ids)
    ref = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        pos, valid = layer.positions, layer.valid
        assert bool(valid.all())  # dense storage, every head keeps the same count: no padding
        k, v = full.layers[i].keys, full.layers[i].values
        idx = pos[..., None].expand(*pos.shape, k.shape[-1])
        ref.update(k.gather(2, idx), v.gather(2, idx), i)
    n = path_ids.shape[1]
    pos_ids = torch.arange(n, n + new_ids.shape[1])[None]
    return model(input_ids=new_ids, position_ids=pos_ids, past_key_values=ref).logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_resume_decodes_from_the_kept_subset_without_rehydrating(arch):
    model = _model(arch)
    cache, path, a, b = _tree(model, Evict(), "resume")
    node_a = cache._branches[a]
    assert cache.is_compressed(a) and node_a.segs[0].held() == 3
    cache.switch(a)
    held_path = [layer.positions.clone() for layer in cache.layers]  # what resuming may use: root + 3 of a
    assert all(p.shape[-1] == 16 + 3 for p in held_path)
    new = _ids(2, seed=11)
    want = _subset_reference(model, cache, path, new)
    got = _feed(model, cache, new)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    full, _ = _full(model, torch.cat([path, new], dim=1))
    assert (got - full).abs().max() > 1e-3  # a secret rehydration (or recomputation) would give this instead
    assert cache.rehydrations == {"host": 0, "recomputed": 0, "recomputed_tokens": 0, "resumed": 1}
    assert node_a.compressed and node_a.segs[0].held() == 3 + 2  # the kept subset plus the new tokens
    assert cache.memory().host == 0
    # generate goes on from the subset too: nothing restored, the node just grows (1 fed + 3 of 4 generated)
    out = model.generate(input_ids=torch.cat([path, new, _ids(1, seed=12)], dim=1), past_key_values=cache,
                         max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert cache.rehydrations["recomputed"] == 0 and node_a.segs[0].held() == 3 + 2 + 4
    assert out.shape[1] == path.shape[1] + 2 + 1 + 4


def test_resume_with_a_host_tier_attends_tier_tokens_in_place():
    model = _model()
    cache, path, a, b = _tree(model, HostTier(), "resume")
    node_a = cache._branches[a]
    cache.switch(a)
    new = _ids(2, seed=11)
    got = _feed(model, cache, new)
    # the uncompressed tree: bit-identical (tier tokens are merged by position, exact copies)
    ref = BranchCache(model)
    _feed(model, ref, path[:, :16])
    ra = ref.fork(0)
    ref.switch(ra)
    _feed(model, ref, path[:, 16:])
    assert torch.equal(got, _feed(model, ref, new))
    # ... yet nothing came back to the device: a keeps 3 tokens there, the host still holds the other 9
    assert node_a.compressed and node_a.segs[0].held() == 3 + 2
    assert cache.rehydrations["host"] == 0 and cache.rehydrations["resumed"] == 1
    assert cache.memory().host > 0


@pytest.mark.parametrize("tier", ["host", "evict"])
def test_exact_rehydration_equals_never_compressing(tier):
    model = _model()
    cache, path, a, b = _tree(model, HostTier() if tier == "host" else Evict(), "exact")
    assert cache.is_compressed(a)
    cache.switch(a)
    inp = torch.cat([path, _ids(1, seed=13)], dim=1)
    out = model.generate(input_ids=inp, past_key_values=cache, max_new_tokens=6, min_new_tokens=6,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = BranchCache(model)  # the exact shared-prefix tree: nothing is ever compressed
    _feed(model, ref, path[:, :16])
    ra = ref.fork(0)
    ref.switch(ra)
    _feed(model, ref, path[:, 16:])
    want = model.generate(input_ids=inp, past_key_values=ref, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want.sequences)
    got_l, want_l = torch.stack(out.logits), torch.stack(want.logits)
    if tier == "host":
        assert cache.rehydrations["host"] == 1 and torch.equal(got_l, want_l)
    else:  # recomputed from token ids: equal up to float rounding
        assert cache.rehydrations["recomputed"] == 1
        torch.testing.assert_close(got_l, want_l, atol=1e-4, rtol=1e-4)
    assert not cache.is_compressed(a) and cache.rehydrations["resumed"] == 0


# -- budgets that follow the search's values ------------------------------------------------------------
def _reference_order(cache, priority):
    """Loop-level reference of the compression order: every node off the active path that holds more than
    its keep target, by (value, last use, id) where a node's value is the best value of the live branches
    whose path passes through it (no value: +inf); "lru": by (last use, id)."""
    active_ids = set()
    node = cache._branches[cache.active]
    while node is not None:
        active_ids.add(node.id)
        node = node.parent
    rows = []
    for n in cache._all_nodes():
        target = max(cache.min_keep, math.ceil(cache.keep * n.n))
        if n.id in active_ids or n.n <= cache.min_keep or n.segs[0].held() <= target:
            continue
        best = -math.inf
        for b, leaf in cache._branches.items():
            m = leaf
            while m is not None:
                if m is n:
                    best = max(best, cache.value(b))
                    break
                m = m.parent
        rows.append(((best, n.last_used, n.id) if priority == "value" else (n.last_used, n.id), n.id))
    return [i for _, i in sorted(rows)]


def test_budget_compresses_the_lowest_value_branch_not_the_oldest():
    model = _model()
    got = {}
    for priority in ("value", "lru"):
        cache = BranchCache(model, budget=42, keep=0.25, min_keep=1, tier=Evict(), priority=priority)
        _feed(model, cache, _ids(16, seed=1))
        branches = []
        for j, v in enumerate((0.0, -2.0, -1.0)):  # a (oldest, best), b (worst), c
            br = cache.fork(0)
            cache.switch(br)
            _feed(model, cache, _ids(8, seed=20 + j))
            cache.set_value(br, v)
            branches.append(br)
        d = cache.fork(0)
        cache.set_value(d, -10.0)  # the active branch is never compressed, whatever its value
        cache.switch(d)
        assert not any(cache.is_compressed(br) for br in branches)  # 40 tokens <= 42
        _feed(model, cache, _ids(8, seed=30))  # 48 > 42: one node of 8 must shrink to 2
        got[priority] = [cache.is_compressed(br) for br in branches]
        assert not cache.is_compressed(d) and cache.memory().held_tokens <= 42
        if priority == "value":
            _feed(model, cache, _ids(8, seed=31))  # 50 > 42: next c (-1) frees 6, then a (0)
            assert [cache.is_compressed(br) for br in branches] == [True, True, True]
            assert not cache.is_compressed(d)
    assert got["value"] == [False, True, False]  # b, the lowest value
    assert got["lru"] == [True, False, False]  # a, the least recently used


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("visit"), st.integers(0, 7), st.integers(1, 3)),
        st.tuples(st.just("value"), st.integers(0, 7), st.integers(-3, 3)),
        st.tuples(st.just("drop"), st.integers(0, 7), st.just(0)),
    ),
    min_size=4,
    max_size=14,
)


@given(ops=_OPS, priority=st.sampled_from(["value", "lru"]), budget=st.sampled_from([None, 20, 40]),
       rehydrate=st.sampled_from(["exact", "resume"]))
def test_compression_order_matches_the_reference(ops, priority, budget, rehydrate):
    """After every operation the cache's compression order equals the loop-level reference, the active path
    is never compressed in exact mode, and the held tokens respect the budget unless nothing is left to
    compress."""
    model = _model()
    cache = BranchCache(model, budget=budget, keep=0.3, min_keep=1, tier=Evict(), priority=priority,
                        rehydrate=rehydrate)
    gen = torch.Generator().manual_seed(len(ops))
    _feed(model, cache, torch.randint(3, 128, (1, 5), generator=gen))
    for op, arg, n in ops:
        live = cache.branches
        b = live[arg % len(live)]
        if op == "value":
            cache.set_value(b, float(n))
        elif op == "drop":
            if b != cache.active:
                cache.drop(b)
        else:
            if op == "grow":
                b = cache.fork(b)
            cache.switch(b)
            _feed(model, cache, torch.randint(3, 128, (1, n), generator=gen))
            if rehydrate == "exact":
                assert not cache.is_compressed(cache.active)
        assert cache.compression_order() == _reference_order(cache, priority)
        if budget is not None:
            assert cache.memory().held_tokens <= budget or not cache.compression_order()


def test_values_are_inherited_by_forks_and_checked():
    model = _model()
    cache = BranchCache(model, budget=0)
    _feed(model, cache, _ids(6))
    assert cache.value(0) == math.inf
    cache.set_value(0, -1.5)
    child = cache.fork(0)
    assert cache.value(child) == -1.5
    cache.set_value(child, 2)
    assert cache.value(0) == -1.5 and cache.node_values()[cache._root.id] == 2.0
    with pytest.raises(KVComposeError, match="number"):
        cache.set_value(child, float("nan"))
    with pytest.raises(KVComposeError, match="does not exist"):
        cache.set_value(99, 1.0)
    with pytest.raises((KVComposeError, TypeError)):  # beartype under the test hook, or our own check
        BranchCache(model, priority="fifo")


class _Recording(SharedKV):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.values = {}

    def set_value(self, handle, value):
        self.values[handle] = value
        super().set_value(handle, value)


def test_tree_search_hands_its_values_to_the_cache_and_resume_never_rehydrates():
    model = tiny_model("llama", layers=2)
    prompt = _ids(20, seed=0)
    kw = dict(width=3, expand=2, depth=3, step_tokens=6, delimiter=None, temperature=1.0, eos_token_id=2, seed=1)
    rec = _Recording(budget=20 + 3 * 6, keep=0.25, tier=HostTier())
    res = TreeSearch(model, backend=rec, **kw).run(prompt)
    for node in res.nodes[1:]:  # every step's path value reached the backend under the node's handle
        assert any(v == node.value for v in rec.values.values())
    assert len(rec.values) == len(res.nodes) - 1
    exact = TreeSearch(model, backend=SharedKV(), **kw).run(prompt)
    assert res.decision_tokens() == exact.decision_tokens()  # host rehydration is exact
    resume = TreeSearch(model, backend=SharedKV(budget=0, keep=0.25, tier=Evict(), rehydrate="resume"), **kw).run(prompt)
    m = resume.memory
    assert m["resumed"] > 0 and m["recomputed"] == 0 and m["rehydrated_host"] == 0 and m["peak_host"] == 0
    assert m["peak_device"] < exact.memory["peak_device"]
