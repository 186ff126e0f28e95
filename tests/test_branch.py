"""BranchCache: shared prefixes stored once, copy-on-write, exact host rehydration, recomputation,
freeing on drop, budgets, and clear errors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import DynamicCache

from kvcompose import Evict, KVComposeError, KeyNorm, Pipeline, TopK, WindowedAttention
from kvcompose.branch import BranchCache
from kvcompose.tiers import HostTier
from kvcompose.testing import tiny_model
from helpers import feed as _feed
from helpers import full_reference
from helpers import rand_ids as _ids
from helpers import tree_model as _model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


def _full_logits(model, path_ids):
    """Reference: a fresh full cache over the whole path, logits of the last token."""
    return full_reference(model, path_ids)[0]


def _stored_bytes(cache):
    """Bytes of K/V tensors actually held by the tree's nodes (measured on the tensors, held slots only)."""
    total = 0
    for node in cache._all_nodes():
        for seg in node.segs:
            if seg.store is not None and seg.store.held:
                view = seg.store.view()
                total += view.keys.nbytes + view.values.nbytes
    return total


def _dynamic_bytes(c):
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in c.layers if layer.is_initialized)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_branches_generate_like_independent_full_caches(arch):
    model = _model(arch)
    prompt = _ids(16, seed=1)
    cache = BranchCache(model)
    _feed(model, cache, prompt[:, :-1])
    a, b = cache.fork(0), cache.fork(0)
    outs = {}
    for br, seed in ((a, 5), (b, 6)):
        cache.switch(br)
        torch.manual_seed(seed)
        outs[br] = model.generate(input_ids=prompt, past_key_values=cache, max_new_tokens=12, min_new_tokens=12,
                                  do_sample=True, temperature=1.0, top_k=0)
    for br, seed in ((a, 5), (b, 6)):
        torch.manual_seed(seed)
        ref = model.generate(input_ids=prompt, past_key_values=DynamicCache(config=model.config), max_new_tokens=12,
                             min_new_tokens=12, do_sample=True, temperature=1.0, top_k=0)
        assert torch.equal(outs[br], ref)
        assert cache.path_length(br) == ref.shape[1] - 1
        assert torch.equal(cache.tokens(br), ref[:, :-1])
    assert not torch.equal(outs[a], outs[b])  # the test can tell branches apart


def test_shared_prefix_is_stored_once():
    model = _model()
    prompt = _ids(48, seed=2)
    cache = BranchCache(model)
    _feed(model, cache, prompt[:, :-1])
    naive = []
    base = DynamicCache(config=model.config)
    _feed(model, base, prompt[:, :-1])
    import copy

    for j in range(4):
        br = cache.fork(0)
        cache.switch(br)
        _feed(model, cache, torch.cat([prompt[:, -1:], _ids(7, seed=10 + j)], dim=1))
        c = copy.deepcopy(base)
        _feed(model, c, torch.cat([prompt[:, -1:], _ids(7, seed=10 + j)], dim=1))
        naive.append(c)
    mem = cache.memory()
    per_token = mem.bytes_per_token
    assert mem.unique_tokens == 47 + 4 * 8
    assert mem.copy_tokens == 47 + 4 * (47 + 8)  # the root handle + 4 children
    stored = _stored_bytes(cache)
    assert stored == mem.held == (47 + 4 * 8) * per_token  # counters match the tensors
    naive_bytes = sum(_dynamic_bytes(c) for c in naive)
    assert naive_bytes == 4 * (47 + 8) * per_token
    assert stored < 0.5 * naive_bytes
    # the root's tokens exist once: every child's path starts with the very same storage
    root_k = cache._root.segs[0].store.view().keys
    assert sum(1 for n in cache._all_nodes()
               if n.segs[0].store is not None and n.segs[0].store.held
               and n.segs[0].store.view().keys.data_ptr() == root_k.data_ptr()) == 1


def test_copy_on_write_never_changes_another_branch():
    model = _model()
    prompt = _ids(20, seed=3)
    cache = BranchCache(model)
    _feed(model, cache, prompt)
    parent = cache.active
    before = [layer.keys.clone() for layer in cache.layers], [layer.values.clone() for layer in cache.layers]
    child = cache.fork(parent)
    cache.switch(child)
    _feed(model, cache, _ids(9, seed=4))
    cache.switch(parent)  # the parent writes after the fork: it gets a new node, the shared one is untouched
    logits_parent = _feed(model, cache, _ids(5, seed=5))
    cache.switch(child)
    keys_child = [layer.keys for layer in cache.layers]
    for i, layer in enumerate(cache.layers):
        assert torch.equal(keys_child[i][:, :, :20], before[0][i])
        assert torch.equal(layer.values[:, :, :20], before[1][i])
    ref_parent = _full_logits(model, torch.cat([prompt, _ids(5, seed=5)], dim=1))
    torch.testing.assert_close(logits_parent, ref_parent, atol=1e-4, rtol=1e-4)
    ref_child = _full_logits(model, torch.cat([prompt, _ids(9, seed=4), _ids(1, seed=6)], dim=1))
    torch.testing.assert_close(_feed(model, cache, _ids(1, seed=6)), ref_child, atol=1e-4, rtol=1e-4)


def _tree_with_compressed_branch(model, tier, scorer=None, budget=24):
    """Root (16 tokens) + branch a (12 tokens) + branch b (12 tokens); switching to b compresses a."""
    prompt = _ids(16, seed=7)
    cache = BranchCache(model, budget=budget, keep=0.25, tier=tier, scorer=scorer)
    _feed(model, cache, prompt)
    a, b = cache.fork(0), cache.fork(0)
    cache.switch(a)
    _feed(model, cache, _ids(12, seed=8))
    cache.switch(b)
    _feed(model, cache, _ids(12, seed=9))
    return cache, prompt, a, b


@pytest.mark.parametrize("scorer", [None, KeyNorm(), Pipeline(WindowedAttention(window=4, pool="none"), TopK())])
def test_rehydration_from_host_is_bit_exact(scorer):
    model = _model()
    cache, prompt, a, b = _tree_with_compressed_branch(model, HostTier(), scorer)
    assert cache.is_compressed(a) and not cache.is_compressed(b)
    if cache.pipeline.query_window:  # the value estimator saw a's own queries
        assert cache._branches[a].segs[0].ring.queries.shape[2] == 4
    mem = cache.memory()
    assert mem.host > 0 and mem.held_tokens <= 16 + 12 + 3 + 12 + 3  # a keeps ceil(0.25 * 12) = 3 on device
    cache.switch(a)
    got = _feed(model, cache, _ids(3, seed=11))
    assert cache.rehydrations["host"] == 1 and cache.rehydrations["recomputed"] == 0
    # the same tree, never compressed (budget None): the branch never left the device
    ref_cache = BranchCache(model)
    _feed(model, ref_cache, prompt)
    ra = ref_cache.fork(0)
    ref_cache.switch(ra)
    _feed(model, ref_cache, _ids(12, seed=8))
    want = _feed(model, ref_cache, _ids(3, seed=11))
    assert torch.equal(got, want)


def test_recomputation_reproduces_full_cache_logits():
    model = _model("qwen3")
    cache, prompt, a, b = _tree_with_compressed_branch(model, Evict())
    assert cache.is_compressed(a) and cache.memory().host == 0
    held_before = cache.memory().held_tokens
    cache.switch(a)
    got = _feed(model, cache, _ids(2, seed=12))
    assert cache.rehydrations["recomputed"] == 1 and cache.rehydrations["recomputed_tokens"] > 0
    assert cache.memory().held_tokens > held_before - 3  # a is whole again (b may be compressed now)
    ref = _full_logits(model, torch.cat([prompt, _ids(12, seed=8), _ids(2, seed=12)], dim=1))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert cache.layers[0].keys.shape[2] == 16 + 12 + 2


def test_host_limit_falls_back_to_eviction():
    model = _model()
    prompt = _ids(16, seed=7)
    cache = BranchCache(model, budget=24, keep=0.25, host_limit=0)
    _feed(model, cache, prompt)
    a, b = cache.fork(0), cache.fork(0)
    cache.switch(a)
    _feed(model, cache, _ids(12, seed=8))
    cache.switch(b)
    _feed(model, cache, _ids(12, seed=9))
    assert cache.is_compressed(a) and cache.memory().host == 0
    cache.switch(a)
    got = _feed(model, cache, _ids(2, seed=12))
    assert cache.rehydrations["recomputed"] == 1
    ref = _full_logits(model, torch.cat([prompt, _ids(12, seed=8), _ids(2, seed=12)], dim=1))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_generate_after_switch_rehydrates_lazily_and_matches():
    model = _model()
    cache, prompt, a, b = _tree_with_compressed_branch(model, Evict())
    cache.switch(a)
    assert cache.is_compressed(a)  # lazy: nothing restored yet
    path = torch.cat([prompt, _ids(12, seed=8), _ids(1, seed=13)], dim=1)
    out = model.generate(input_ids=path, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert not cache.is_compressed(a)
    ref = model.generate(input_ids=path, past_key_values=DynamicCache(config=model.config), max_new_tokens=8,
                         do_sample=False)
    assert torch.equal(out, ref)


def test_drop_frees_memory():
    model = _model()
    prompt = _ids(16, seed=14)
    cache = BranchCache(model, budget=30, keep=0.25)
    _feed(model, cache, prompt)
    root_only = cache.memory()
    kids = []
    for j in range(3):
        kids.append(cache.fork(0))
        cache.switch(kids[-1])
        _feed(model, cache, _ids(10, seed=20 + j))
        grandchild = cache.fork()
        cache.switch(grandchild)
        _feed(model, cache, _ids(6, seed=30 + j))
        kids.append(grandchild)
    cache.switch(0)
    grown = cache.memory()
    assert grown.held > root_only.held and grown.host > 0
    # dropping a parent whose child lives frees only its private part (nothing here): shared tokens stay
    cache.drop(kids[0])
    assert cache.memory().unique_tokens == grown.unique_tokens
    for br in kids[1:]:
        cache.drop(br)
    mem = cache.memory()
    assert mem.held == root_only.held == _stored_bytes(cache)
    assert mem.device == mem.held and mem.host == 0  # the root was shrunk to exact size at the first fork
    assert mem.nodes == 1 and mem.branches == 1
    assert mem.peak_device >= grown.device


def test_prune_drops_a_subtree():
    model = _model()
    cache = BranchCache(model)
    _feed(model, cache, _ids(8))
    a = cache.fork(0)
    cache.switch(a)
    _feed(model, cache, _ids(4, seed=1))
    a1, a2 = cache.fork(a), cache.fork(a)
    b = cache.fork(0)
    cache.switch(a1)
    with pytest.raises(KVComposeError, match="active branch .* descends"):
        cache.prune(a)
    cache.switch(b)
    assert sorted(cache.prune(a)) == sorted([a, a1, a2])
    assert cache.branches == sorted([0, b])
    assert cache.memory().unique_tokens == 8


def test_budget_is_enforced_off_the_active_path():
    model = _model()
    cache = BranchCache(model, budget=40, keep=0.25, min_keep=2)
    _feed(model, cache, _ids(16))
    for j in range(5):
        br = cache.fork(0)
        cache.switch(br)
        _feed(model, cache, _ids(12, seed=40 + j))
        active, held = cache.path_length(), cache.memory().held_tokens
        # within the budget, or everything off the active path is compressed (12 tokens -> 3)
        assert held <= 40 or held == active + 3 * j
        assert not cache.is_compressed(br)
    assert cache.compressions >= 3


def test_batch_with_padding_matches_full_cache():
    model = _model()
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(50))
    mask = torch.ones(2, 10, dtype=torch.long)
    ids[0, :3], mask[0, :3] = 0, 0
    cache = BranchCache(model, budget=16, keep=0.25, tier=Evict())
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1, do_sample=False)
    a, b = cache.fork(0), cache.fork(0)
    cache.switch(a)
    cont = torch.randint(3, 128, (2, 1), generator=torch.Generator().manual_seed(51))
    path = torch.cat([ids, cont], dim=1)
    pmask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    out_a = model.generate(input_ids=path, attention_mask=pmask, past_key_values=cache, max_new_tokens=10,
                           min_new_tokens=10, do_sample=False)
    cache.switch(b)
    model.generate(input_ids=path, attention_mask=pmask, past_key_values=cache, max_new_tokens=12, min_new_tokens=12,
                   do_sample=False)
    assert cache.is_compressed(a)
    cache.switch(a)  # a is recomputed with its padding and position ids
    full = torch.cat([out_a, cont], dim=1)
    fmask = torch.ones_like(full)
    fmask[0, :3] = 0
    got = model.generate(input_ids=full, attention_mask=fmask, past_key_values=cache, max_new_tokens=6,
                         min_new_tokens=6, do_sample=False)
    ref = model.generate(input_ids=full, attention_mask=fmask, past_key_values=DynamicCache(config=model.config),
                         max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert cache.rehydrations["recomputed"] >= 1
    assert torch.equal(got, ref)


def test_errors():
    model = _model()
    cache = BranchCache(model)
    _feed(model, cache, _ids(6))
    a = cache.fork(0)
    with pytest.raises(KVComposeError, match="does not exist"):
        cache.fork(99)
    with pytest.raises(KVComposeError, match="active branch"):
        cache.drop(0)
    cache.switch(a)
    cache.drop(0)
    with pytest.raises(KVComposeError, match="was dropped"):
        cache.switch(0)
    with pytest.raises((KVComposeError, TypeError)):  # beartype (under the test hook) or our own check
        cache.switch("a")
    for kwargs in ({"budget": -1}, {"keep": 1.5}, {"min_keep": 0}, {"host_limit": -3}, {"scorer": Pipeline()}):
        with pytest.raises(KVComposeError):
            BranchCache(model, **kwargs)
    for kwargs in ({"scorer": "h2o"}, {"tier": "host"}):  # wrong types: beartype under the test hook, or ours
        with pytest.raises((KVComposeError, TypeError)):
            BranchCache(model, **kwargs)
    with pytest.raises(KVComposeError, match="fork"):
        cache.crop(-1)
    with pytest.raises(KVComposeError, match="fork"):
        model.generate(input_ids=_ids(8), past_key_values=cache, max_new_tokens=2, num_beams=2, do_sample=False)
    with pytest.raises(KVComposeError, match="reset"):
        cache.reset()


def test_changed_attention_implementation_is_refused():
    model = tiny_model("llama", layers=1)
    cache = BranchCache(model)
    model.set_attn_implementation("sdpa")
    with pytest.raises(KVComposeError, match="attention implementation"):
        _feed(model, cache, _ids(4))


def test_hooks_go_away_with_the_cache():
    model = tiny_model("llama", layers=1)
    n = len(model._forward_pre_hooks)
    cache = BranchCache(model)
    assert len(model._forward_pre_hooks) == n + 1
    cache.close()
    assert len(model._forward_pre_hooks) == n
    cache = BranchCache(model)
    del cache
    import gc

    gc.collect()
    assert len(model._forward_pre_hooks) == n


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 6)),  # fork a branch, switch to it, feed
        st.tuples(st.just("visit"), st.integers(0, 7), st.integers(1, 4)),  # switch to a branch, feed
        st.tuples(st.just("drop"), st.integers(0, 7), st.just(0)),
    ),
    min_size=3,
    max_size=12,
)


@given(ops=_OPS, tier=st.sampled_from(["host", "evict"]), budget=st.sampled_from([None, 0, 12]),
       seed=st.integers(0, 1000))
def test_random_trees_match_full_recomputation(ops, tier, budget, seed):
    """Invariant: whatever forks, switches, drops, compressions and rehydrations happened, every live branch
    holds the tokens fed to it, the device holds exactly the counted bytes, and the active branch's
    next-token logits equal a full forward over its path."""
    model = _model()
    cache = BranchCache(model, budget=budget, keep=0.3, min_keep=1, tier=HostTier() if tier == "host" else Evict(),
                        seed=seed)
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(3, 128, (1, 4), generator=gen)
    _feed(model, cache, first)
    paths = {0: first}
    for op, arg, n in ops:
        live = cache.branches
        b = live[arg % len(live)]
        if op == "drop":
            if b == cache.active:
                with pytest.raises(KVComposeError):
                    cache.drop(b)
            else:
                cache.drop(b)
                del paths[b]
            continue
        if op == "grow":
            child = cache.fork(b)
            paths[child] = paths[b]
            b = child
        cache.switch(b)
        new = torch.randint(3, 128, (1, n), generator=gen)
        got = _feed(model, cache, new)
        paths[b] = torch.cat([paths[b], new], dim=1)
        torch.testing.assert_close(got, _full_logits(model, paths[b]), atol=2e-4, rtol=2e-4)
        assert _stored_bytes(cache) == cache.memory().held
        if budget is not None:  # over budget only when everything off the active path is compressed
            off = [nd for nd in cache._all_nodes() if nd not in set(cache._path())]
            assert cache.memory().held_tokens <= budget or all(nd.compressed or nd.n <= 1 for nd in off)
    for b in cache.branches:
        assert torch.equal(cache.tokens(b), paths[b])


@pytest.mark.parametrize("kind", ["flat", "branch"])
def test_an_update_whose_attention_never_ran_is_refused_by_both_caches(kind):
    """KVComposeCache and BranchCache share one glue (kvcompose.cache.CacheGlue): a layer updated without
    kvcompose's attention seeing it (here: update called by hand) is named at the next step's
    get_seq_length, by both caches (BranchCache had no such check before the glue was shared)."""
    from kvcompose import KVComposeCache

    model = tiny_model("llama", layers=2)
    cache = KVComposeCache(model) if kind == "flat" else BranchCache(model)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 6  # an ordinary step: nothing missed
    cfg = model.config
    kv = torch.zeros(1, cfg.num_key_value_heads, 1, cfg.hidden_size // cfg.num_attention_heads)
    cache.update(kv, kv.clone(), 0)
    with pytest.raises(KVComposeError, match="layer 0 of a kvcompose cache was updated, but kvcompose's attention "
                                             "did not run for it"):
        cache.get_seq_length()
    with pytest.raises(KVComposeError, match="did not run for it"):  # and stays refused
        cache.get_seq_length()
