"""Allocators (Pyramid, ReasoningWave, HeadUtility, GrowPage) and the ragged paged storage under them:
budget conservation and floors (hypothesis), memory that follows the sum of kept tokens, page reuse,
exact attention over unequal per-head kept sets, and `generate` end to end."""

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import random_view
from kvcompose import (
    GrowPage, HeadUtility, KVComposeCache, KVComposeError, Pipeline, ProtectRecent, Pyramid, ReasoningWave, TopK,
    Uniform, ValueNorm, WindowedAttention, methods,
)
from kvcompose.allocators import Allocator, round_to_total
from kvcompose.calibration import calibrate_reasoning_wave, coverage_count
from kvcompose.testing import tiny_model
from kvcompose.stores import POOL_SLACK, PagedStore, PagePool
from kvcompose.view import LayerSpec, LayerView
from helpers import greedy_n as _greedy, padded_inputs as _inputs


def _pipe(alloc, recent=2, window=4):
    return Pipeline(ProtectRecent(recent), WindowedAttention(window), TopK(), alloc)


# ------------------------------------------------------------------------------------ per-layer schedules
@given(layers=st.integers(1, 40), window=st.integers(0, 64), extra=st.integers(1, 4000), beta=st.floats(1.0, 40.0))
def test_pyramid_total_and_shape(layers, window, extra, beta):
    budget = window + extra
    b = Pyramid(window=window, beta=beta).layer_budgets(layers, budget)
    assert sum(b) == layers * budget  # the same total as Uniform, never more
    assert min(b) >= 1
    if layers > 1:
        c = budget - window
        lo = c / beta
        hi = 2 * c - lo
        for i, x in enumerate(b):  # each layer within one token of PyramidKV's linear schedule
            assert abs(x - (window + hi - (hi - lo) * i / (layers - 1))) <= 1 + 1e-6 or min(b) == 1


def test_pyramid_matches_paper_endpoints():
    b = Pyramid(window=8, beta=20).layer_budgets(30, 264)  # C - w = 256: min 12.8, max 499.2
    assert b[0] in (507, 508) and b[-1] in (20, 21)
    assert all(x >= y for x, y in zip(b, b[1:]))


def _profile(tmp_path, demand):
    p = tmp_path / "wave.json"
    p.write_text(json.dumps({"demand": demand}))
    return p


@given(demand=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=32).filter(lambda d: sum(d) > 1e-3),
       budget=st.integers(1, 2048), floor=st.sampled_from([0, 1, 8, 0.1, 0.25, 1.0]))
def test_reasoning_wave_total_floor_order(demand, budget, floor):
    alloc = ReasoningWave({"demand": demand}, floor=floor)
    if isinstance(floor, int) and floor > budget:
        with pytest.raises(KVComposeError):
            alloc.layer_budgets(len(demand), budget)
        return
    b = alloc.layer_budgets(len(demand), budget)
    assert sum(b) == len(demand) * budget
    f = max(1, int(floor * budget) if isinstance(floor, float) else floor)
    assert min(b) >= f
    for i in range(len(b)):  # more demand never gets fewer tokens (beyond one of rounding)
        for j in range(len(b)):
            if demand[i] > demand[j]:
                assert b[i] >= b[j] - 1


def test_reasoning_wave_profile_file_and_errors(tmp_path):
    p = _profile(tmp_path, [3.0, 1.0, 1.0, 3.0])
    alloc = ReasoningWave(p, floor=10)
    assert alloc.layer_budgets(4, 100) == [145, 55, 55, 145]
    with pytest.raises(KVComposeError, match="not found"):
        ReasoningWave(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(KVComposeError, match="JSON"):
        ReasoningWave(bad)
    with pytest.raises(KVComposeError, match="demand"):
        ReasoningWave({"demand": []})
    with pytest.raises(KVComposeError, match="layers"):
        alloc.layer_budgets(5, 100)
    with pytest.raises(KVComposeError, match="budget"):
        alloc.layer_budgets(4, 0)


def test_calibration_writes_a_usable_profile(tmp_path):
    model = tiny_model("llama", layers=3)
    prompts = [torch.randint(3, 128, (10,), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    path = tmp_path / "p.json"
    prof = calibrate_reasoning_wave(model, prompts, path, new_tokens=6, coverage=0.9)  # greedy continuations
    assert len(prof["demand"]) == 3 and all(0 < d <= 16 for d in prof["demand"])
    assert len(prof["head_demand"][0]) == model.config.num_key_value_heads
    alloc = ReasoningWave(path)
    assert sum(alloc.layer_budgets(3, 16)) == 48
    # given traces: coverage 1.0 needs every visible key; coverage -> 0 needs one key per query
    trace = [list(range(3, 11))]
    full = calibrate_reasoning_wave(model, prompts[:1], None, traces=trace, coverage=1.0)
    one = calibrate_reasoning_wave(model, prompts[:1], None, traces=trace, coverage=1e-6)
    # queries at 10..17 see 11..18 keys (a key whose probability underflows to exactly 0 is never needed)
    assert all(14.0 < d <= (11 + 18) / 2 for d in full["demand"])
    assert all(abs(d - 1.0) < 1e-6 for d in one["demand"])


def test_round_to_total():
    raw = torch.tensor([[0.5, 0.5, 2.0], [1.2, 1.3, 0.5]], dtype=torch.float64)
    out = round_to_total(raw, torch.tensor([3, 3]))
    assert out.sum(-1).tolist() == [3, 3] and out[0].tolist() == [1, 0, 2]


# ------------------------------------------------------------------------------------ head-wise
@given(b=st.integers(1, 3), h=st.integers(1, 4), t=st.integers(8, 48), budget=st.integers(1, 40),
       floor=st.sampled_from([1, 2, 4, 0.1, 0.25, 0.5]), utility=st.sampled_from(["mass", "entropy"]),
       seed=st.integers(0, 500))
def test_head_utility_conserves_total_and_floor(b, h, t, budget, floor, utility, seed):
    view = random_view(b=b, h=h, t=t, w=min(8, t), seen=t + 3, pad=[seed % 5] + [0] * (b - 1), seed=seed)
    alloc = HeadUtility(floor=floor, utility=utility, window=8)
    f = max(1, int(floor * budget) if isinstance(floor, float) else floor)
    if f > budget:
        with pytest.raises(KVComposeError, match="floor"):
            alloc(view, budget)
        return
    out, state = alloc(view, budget)
    assert state is None  # HeadUtility keeps no layer state
    assert out.shape == (b, h)
    assert (out.sum(-1) == h * budget).all()  # the layer's total per row is fixed
    assert (out >= f).all()  # no head starves


def _peaked_view(t=32, budget=8):
    """Head 0 attends to one key, head 1 spreads its attention: utility must favour head 1."""
    v = random_view(b=1, h=2, t=t, w=4, seen=t, seed=1)
    keys = torch.zeros_like(v.keys)
    q = torch.zeros_like(v.queries)
    keys[0, 0, 3, 0] = 10.0  # head 0: one key matches the query strongly
    q[0, 0:2, :, 0] = 3.0
    keys[0, 1] = torch.randn(t, keys.shape[-1], generator=torch.Generator().manual_seed(0)) * 0.01
    return LayerView(**{**v.__dict__, "keys": keys, "queries": q})


@pytest.mark.parametrize("utility", ["mass", "entropy"])
def test_head_utility_moves_budget_to_broad_heads(utility):
    out, _ = HeadUtility(floor=2, utility=utility, window=4)(_peaked_view(), 8)
    assert out.sum() == 16 and out[0, 1] > out[0, 0] and out[0, 0] >= 2


# ------------------------------------------------------------------------------------ GrowPage
def _growpage_reference(pages, want, held, act, cap_pages, page, room, floor, shrink=True):
    """GrowPage's decision, one row at a time (the rule of its docstring, written as a loop)."""
    pages = list(pages)
    for r in range(len(pages)):
        if shrink and act[r] and want[r] <= pages[r] - 2:
            pages[r] = max(floor, pages[r] - 1)
    deficit = [max(0, want[r] - pages[r]) if act[r] and held[r] >= pages[r] * page else 0 for r in range(len(pages))]
    free = cap_pages - sum(pages)
    asking = sorted((r for r in range(len(pages)) if deficit[r] > 0), key=lambda r: (-deficit[r], r))
    for r in asking[:max(0, free)]:
        pages[r] += 1
    budgets = [pages[r] * page - room if act[r] and held[r] >= pages[r] * page else pages[r] * page
               for r in range(len(pages))]
    return pages, budgets


@given(b=st.integers(1, 4), h=st.integers(1, 3), budget=st.sampled_from([32, 48, 64]), page=st.sampled_from([4, 8, 16]),
       cap=st.sampled_from([0.75, 1.0, 1.5]), events=st.integers(1, 4), seed=st.integers(0, 500))
def test_growpage_matches_a_loop_reference(b, h, budget, page, cap, events, seed):
    """Per request (row): shrink, grants by largest deficit under the cap, then keep-all or compress to
    `pages * page - room`, checked against a per-row loop; every head of a row gets the same budget."""
    alloc = GrowPage(page=page, initial=min(0.5, cap), cap=cap, coverage=0.95, window=8)
    state = alloc.init(LayerSpec(0, 4, b, h, 8, 8, torch.device("cpu"), torch.float32))
    assert state == {}
    g = torch.Generator().manual_seed(seed)
    pages = [alloc.initial_pages(budget)] * b
    for e in range(events):
        t = 40 + 4 * e
        rows = torch.rand(b, generator=g) < 0.7
        v = random_view(b=b, h=h, t=t, w=8, seen=t + 10 * e, seed=seed + e, rows=rows)
        before = {k: (x.clone() if isinstance(x, torch.Tensor) else x) for k, x in state.items()}
        want = alloc.row_want(v, {**before, **_ema_probe(alloc, v, before)}).tolist()
        out, state = alloc(v, budget, state)
        ref_pages, ref_budgets = _growpage_reference(pages, want, [t] * b, rows.tolist(), alloc.cap_pages(budget, b),
                                                     page, alloc.room, alloc.floor)
        assert state["pages"].tolist() == ref_pages
        assert out.tolist() == [[x] * h for x in ref_budgets]
        assert (state["pages"] >= alloc.floor).all()
        assert int(state["pages"].sum()) <= max(alloc.cap_pages(budget, b), b * alloc.initial_pages(budget))
        pages = ref_pages


def _ema_probe(alloc, view, state):
    """The query summaries `allocate` will hold once it has absorbed the view's new queries."""
    st_ = dict(state)
    last = st_.get("last", -1)
    new = view.query_valid & (view.query_positions > last)[None, :]
    alloc._ema_update(st_, "fast", alloc.fast, view.queries, new)
    alloc._ema_update(st_, "slow", alloc.slow, view.queries, new)
    return st_


def test_growpage_grows_the_broad_request_and_returns_pages():
    """Row 1 attends broadly (it asks for pages), row 0 sharply (it compresses inside its pages, then gives
    pages back); the cap stops row 1."""
    v1 = _peaked_view(t=48)
    keys = torch.cat([v1.keys[:, :1], v1.keys[:, 1:]], 0).reshape(2, 1, 48, -1)  # row 0: peaked head, row 1: broad
    q = torch.cat([v1.queries[:, :2], v1.queries[:, 2:]], 0)
    v = LayerView(**{**v1.__dict__, "keys": keys, "values": keys.clone(), "positions": v1.positions[:, :1].expand(2, 1, 48),
                     "valid": v1.valid[:, :1].expand(2, 1, 48), "queries": q,
                     "query_valid": v1.query_valid.expand(2, -1)})
    alloc = GrowPage(page=4, initial=0.25, cap=0.5, floor=2, coverage=0.9, window=4)
    state: dict = {}
    first, state = alloc(v, 32, state)  # cap: 0.5 x 2 rows x 32 tokens = 8 pages; start at 2 pages each
    # both rows are full (48 slots): row 0 compresses inside its 2 pages, row 1 takes a page and compresses
    # inside 3 (a row that fills its pages one token at a time keeps everything after a grant)
    assert state["pages"].tolist() == [2, 3] and first[:, 0].tolist() == [4, 8]
    with pytest.raises(KVComposeError, match="Pipeline"):  # stateful: refuses a call without its state
        alloc(v, 32)
    for _ in range(20):
        out, state = alloc(v, 32, state)
    assert int(state["pages"].sum()) == 8 and state["pages"][1] > state["pages"][0]
    assert state["denied"] > 0  # the cap stopped the broad row
    shrink = GrowPage(page=4, initial=0.5, cap=1.0, floor=2, coverage=0.9, window=4)
    st2: dict = {}
    _, st2 = shrink(v, 32, st2)  # 4 pages each to start; row 0 needs 2 (its floor): it returns one
    assert st2["pages"][0] == 3 and st2["returned"] >= 1


def test_growpage_expected_attention_is_the_gaussian_query_mean():
    """The summary's expected attention equals a Monte Carlo average of softmax numerators of queries drawn from
    N(mu, var I); with var 0 it is the mean query's attention."""
    g = torch.Generator().manual_seed(0)
    v = random_view(b=1, h=1, t=12, d=8, g=1, w=4, seed=0)
    mu = torch.randn(1, 1, 8, generator=g) * 0.5
    var = torch.tensor([[0.5]])
    gp = GrowPage()
    p = gp.expected_attention(v, mu, var)
    q = mu[0, 0] + var.sqrt() * torch.randn(400_000, 8, generator=g)
    num = torch.exp((q @ v.keys[0, 0].T) * v.scale).mean(0)
    ok = (v.valid & (v.positions < v.seen))[0, 0]
    assert torch.allclose(p[0, 0], num * ok / (num * ok).sum(), rtol=0.03, atol=1e-3)
    sharp = gp.expected_attention(v, mu, var * 0)
    assert torch.allclose(sharp[0, 0], torch.softmax((v.keys[0, 0] @ mu[0, 0]) * v.scale, -1), atol=1e-6)
    # here the spread broadens the expected attention: more keys are needed to cover 90% of it
    assert int(coverage_count(p, 0.9)) >= int(coverage_count(sharp, 0.9))


# ------------------------------------------------------------------------------------ storage
@given(page=st.sampled_from([1, 2, 4, 16]), steps=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 99)), min_size=1,
                                                           max_size=8), seed=st.integers(0, 1000))
def test_paged_storage_matches_a_list_model(page, steps, seed):
    """Random appends and per-head compactions: the padded view equals a per-head Python list model, and
    pages return to the pool and are handed out again."""
    g = torch.Generator().manual_seed(seed)
    b, h, d = 2, 3, 4
    kv = PagedStore(b, h, d, d, torch.float32, "cpu", page_size=page)
    model = [[[] for _ in range(h)] for _ in range(b)]
    seen = 0
    for q, keep_pct in steps:
        k = torch.randn(b, h, q, d, generator=g)
        kv.append(k, -k, torch.arange(seen, seen + q))
        for i in range(b):
            for j in range(h):
                model[i][j] += [(seen + s, k[i, j, s]) for s in range(q)]
        seen += q
        # compact: each head keeps a random subset of its own size
        kmax = kv.held
        kept = torch.full((b, h, kmax), -1)
        for i in range(b):
            for j in range(h):
                n = len(model[i][j])
                m = max(1, n * keep_pct // 100)
                idx = torch.randperm(n, generator=g)[:m].sort().values
                kept[i, j, :m] = idx
                model[i][j] = [model[i][j][t] for t in idx.tolist()]
        before = kv.pool.handed_out
        kv.compact(kept)
        keys, values, pos, valid = kv.view()
        for i in range(b):
            for j in range(h):
                n = len(model[i][j])
                assert int(kv.lengths[i, j]) == n
                assert pos[i, j, :n].tolist() == [p for p, _ in model[i][j]]
                assert torch.equal(keys[i, j, :n], torch.stack([x for _, x in model[i][j]]))
                assert torch.equal(values[i, j, :n], -keys[i, j, :n])
                assert not valid[i, j, n:].any() and valid[i, j, :n].all()
        # every page in a table is distinct and in use; the pool holds exactly the used + free pages
        ids = kv.page_table[kv.page_table >= 0]
        assert ids.unique().numel() == ids.numel() == kv.pool.n_used
        assert ((kv.lengths + page - 1) // page == (kv.page_table >= 0).sum(-1)).all()
        assert kv.pool.handed_out == before
    # memory follows the sum of kept tokens once spare pages are freed (compaction moves tokens, trim / fit
    # size the pool): page rounding (< 1 page per head) plus the pool's slack
    kv.trim()
    used_tokens = int(((kv.lengths + page - 1) // page).sum()) * page
    assert used_tokens - kv.held_tokens() < b * h * page
    assert kv.pool.capacity <= max(1, -(-kv.pool.n_used * (1 + POOL_SLACK) // 1))


def test_pool_reuses_returned_pages():
    pool = PagePool(4, 8, 8, torch.float32, "cpu", slack=0.0)
    a = pool.alloc(10)
    assert pool.capacity == 10 and pool.grows == 1
    pool.release(a[2:6])
    again = pool.alloc(4)
    assert sorted(again.tolist()) == sorted(a[2:6].tolist())  # the returned pages, not new ones
    assert pool.capacity == 10 and pool.grows == 1 and pool.reused == 4
    with pytest.raises(KVComposeError, match="page size"):
        PagePool(0, 8, 8, torch.float32, "cpu")


@given(page=st.sampled_from([4, 8, 16]), per_head=st.lists(st.integers(1, 400), min_size=6, max_size=6),
       big=st.booleans())
def test_allocated_bytes_follow_kept_tokens(page, per_head, big):
    """After a compaction, bytes allocated are within page rounding (< 1 page per head) and the pool's slack of
    the kept tokens x bytes per token, so within 10% once every head keeps >= 20 pages; never the padded
    maximum when lengths differ."""
    b, h, d = 2, 3, 8
    n = 20 * page + 400
    if big:  # every head keeps at least 20 pages
        per_head = [20 * page + x for x in per_head]
    kv = PagedStore(b, h, d, d, torch.float32, "cpu", page_size=page)
    kv.append(torch.ones(b, h, n, d), torch.ones(b, h, n, d), torch.arange(n))
    lens = torch.tensor(per_head).reshape(b, h)
    idx = torch.arange(n).expand(b, h, n)
    kv.compact(torch.where(idx < lens[..., None], idx, torch.full_like(idx, -1)))
    kv.trim()  # compaction moves tokens; trim (or fit at a cache's event) frees the spare pages
    assert torch.equal(kv.lengths, lens)
    per_tok = 2 * d * 4
    kept_bytes = int(lens.sum()) * per_tok
    alloc = kv.pool.nbytes()
    used_pages = int(((lens + page - 1) // page).sum())
    assert alloc <= -(-used_pages * (1 + POOL_SLACK) // 1) * page * per_tok
    assert used_pages * page - int(lens.sum()) < b * h * page
    if big:
        assert alloc <= 1.10 * kept_bytes
    padded_max = b * h * int(lens.max()) * per_tok
    if int(lens.max()) - int(lens.min()) >= 2 * page + 40:
        assert alloc < padded_max


def _ragged_store(seed=0, page=4):
    g = torch.Generator().manual_seed(seed)
    b, h, d, n = 2, 2, 16, 23
    kv = PagedStore(b, h, d, d, torch.float32, "cpu", page_size=page)
    kv.append(torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g), torch.arange(n),
              torch.tensor([[False] * 3 + [True] * (n - 3), [True] * n]))
    kept = torch.full((b, h, n), -1)
    for i, m in enumerate([5, 23, 11, 17]):  # four different lengths, scattered kept sets
        kept[i // 2, i % 2, :m] = torch.randperm(n, generator=g)[:m].sort().values
    kv.compact(kept)
    return kv, g


def test_ragged_attention_equals_dense_masked_reference_and_kernel():
    """Attention over unequal per-head lengths (the store's padded view, masked as the layer core masks it)
    equals SDPA over each head's own kept tokens (one head at a time, no padding), and the Triton paged kernel
    (interpreted on CPU) reading the store's pages directly agrees with it."""
    from kvcompose.attention import attend, build_mask
    from kvcompose.kernels import paged_decode_attention, use_triton
    from kvcompose.kernels.dispatch import triton_usable_on

    kv, g = _ragged_store()
    assert kv.ragged
    q = torch.randn(2, 4, 1, 16, generator=g)
    qpos = torch.tensor([23])
    keys, values, pos, valid = kv.view()
    out = attend(q, keys, values, build_mask(pos, valid, qpos, None), 0.25)
    for b in range(2):
        for h in range(2):
            n = int(kv.lengths[b, h])
            k, v, ok = keys[b, h, :n], values[b, h, :n], valid[b, h, :n]
            for gq in range(2):
                logits = (q[b, h * 2 + gq, 0] @ k.T) * 0.25
                p = torch.softmax(logits.masked_fill(~ok, float("-inf")), -1)
                assert torch.allclose(out[b, 0, h * 2 + gq], p @ v, atol=1e-5)
    pool = kv.pool
    # the kernel runs where Triton can: these CPU tensors under the interpreter, else copies on the GPU (a
    # compiled kernel cannot read CPU tensors: use_triton(True) would raise there)
    dev = next((d for d in (torch.device("cpu"), torch.device("cuda")) if triton_usable_on(d)), None)
    if dev is None:
        pytest.skip("no Triton path (no interpreter, no GPU)")
    args = [t.to(dev) for t in (q, pool.keys, pool.values, pool.positions, pool.valid, kv.page_table, kv.lengths, qpos)]
    with use_triton(True):
        fast = paged_decode_attention(*args, 0.25, None)
    assert torch.allclose(fast.cpu(), out, atol=1e-4)


# ------------------------------------------------------------------------------------ inside the cache
def _reference_logits(model, ids, kept_pos_per_layer):
    """Replay the sequence with eager per-layer, per-head masks; the last query sees only each head's kept
    positions (-1 = none) and itself."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvcompose.attention import attend

    cfg = model.config
    n_kv, n_q = cfg.num_key_value_heads, cfg.num_attention_heads
    hidden = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(ids.shape[1])[None])
    for i, layer in enumerate(model.model.layers):
        res = hidden
        x = layer.input_layernorm(hidden)
        att = layer.self_attn
        b, t, _ = x.shape
        q = att.q_proj(x).view(b, t, n_q, -1).transpose(1, 2)
        k = att.k_proj(x).view(b, t, n_kv, -1).transpose(1, 2)
        v = att.v_proj(x).view(b, t, n_kv, -1).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        allowed = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, n_kv, t, t).clone()
        kp = kept_pos_per_layer[i]
        last = torch.zeros(b, n_kv, t + 1, dtype=torch.bool)
        last.scatter_(-1, torch.where(kp >= 0, kp, torch.full_like(kp, t)), True)
        last = last[..., :t]
        last[..., t - 1] = True
        allowed[:, :, t - 1] = last
        out = attend(q, k, v, allowed, att.scaling)
        hidden = res + att.o_proj(out.reshape(b, t, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.model.norm(hidden)[:, -1])


@pytest.mark.parametrize("alloc", [HeadUtility(floor=3, window=8, page_size=4), HeadUtility(floor=0.25, utility="entropy", window=8),
                                   GrowPage(page=4, initial=0.5, window=8)])
def test_logits_equal_reference_over_unequal_kept_sets(alloc):
    model = tiny_model("llama", layers=2)
    ids, _ = _inputs(b=2, t=30, pad=(0, 0), seed=3)
    cache = KVComposeCache(model, _pipe(alloc), budget=12, compress_prefill=True)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache)
        kept = [cache.kept_positions(i) for i in range(2)]
        lengths = torch.stack([cache.layers[i].lengths for i in range(2)])
        assert all(isinstance(layer.segment.store, PagedStore) for layer in cache.layers)
        logits = model(input_ids=ids[:, -1:], past_key_values=cache).logits[:, -1]
        ref = _reference_logits(model, ids, kept)
    if not isinstance(alloc, GrowPage):
        assert lengths.unique().numel() > 1  # heads really hold different numbers of tokens
    for k, n in zip(kept, lengths):
        assert ((k >= 0).sum(-1) == n).all()
    assert torch.allclose(logits, ref, atol=1e-5, rtol=1e-4)


class _Lopsided(Allocator):
    """A user allocator that claims uniform layers but gives head 0 twice the budget of the others."""

    def allocate(self, view, budget):
        b, h, _ = view.shape
        out = torch.full((b, h), max(1, budget // 2), dtype=torch.long)
        out[:, 0] = budget
        return out


class _LopsidedPaged(_Lopsided):
    """The same allocator, declaring per-head budgets (`uniform = False`): paged storage."""

    uniform = False


def test_unequal_heads_need_paged_storage():
    """No class swapping any more: a `uniform` allocator that gives heads different budgets is refused by the
    dense store with a clear error; declared per-head (`uniform = False`), the layer lives in paged storage
    from the start and heads keep their own lengths."""
    model = tiny_model("llama", layers=2)
    ids, mask = _inputs(b=2, t=14, pad=(3, 0))
    cache = KVComposeCache(model, _pipe(_Lopsided()), budget=10, interval=4)
    assert all(layer.segment.store is None for layer in cache.layers)
    with pytest.raises(KVComposeError, match="uniform = False"):
        _greedy(model, ids, mask, cache, n=20)
    cache = KVComposeCache(model, _pipe(_LopsidedPaged()), budget=10, interval=4)
    out = _greedy(model, ids, mask, cache, n=20)
    assert out.shape == (2, 34)
    assert all(isinstance(layer.segment.store, PagedStore) for layer in cache.layers)
    ln = cache.layers[0].lengths
    assert (ln[:, 0] > ln[:, 1]).all()


PRESET_CASES = {
    "uniform": lambda: _pipe(Uniform()),
    "pyramid": lambda: methods.pyramid_rkv(methods.rkv(window=4)),
    "reason_alloc": lambda: methods.reason_alloc(methods.rkv(window=4), profile={"demand": [2.0, 1.0]}, floor=4, window=8,
                                                 page_size=4),
    "growpage": lambda: methods.growpage(methods.rkv(window=4), page=4, window=8),
}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("name", sorted(PRESET_CASES))
def test_generate_end_to_end_with_padding(arch, name):
    model = tiny_model(arch, layers=2)
    ids, mask = _inputs(b=2, t=14, pad=(4, 0))
    cache = KVComposeCache(model, PRESET_CASES[name](), budget=16, interval=4)
    out = _greedy(model, ids, mask, cache, n=28)
    assert out.shape == (2, 42)
    assert cache.get_seq_length() == 14 + 28 - 1
    rep = cache.memory()
    assert rep.total < rep.full_cache
    for i in range(2):
        pos = cache.kept_positions(i)
        assert int(pos.max()) == cache.get_seq_length() - 1
        assert (pos[0][pos[0] >= 0] >= 4).all()  # padding is never kept over real tokens
        both = (pos[..., 1:] >= 0) & (pos[..., :-1] >= 0)
        assert (pos[..., 1:] > pos[..., :-1])[both].all()  # ascending, unique
        assert ((pos[..., 1:] < 0) | (pos[..., :-1] >= 0)).all()  # -1 only at the end of a head


def test_ragged_padded_rows_match_rows_run_alone():
    model = tiny_model("llama")
    ids, mask = _inputs(b=2, t=14, pad=(4, 0))
    pipe = lambda: _pipe(HeadUtility(floor=3, window=4, page_size=4))  # noqa: E731
    batch = _greedy(model, ids, mask, KVComposeCache(model, pipe(), budget=10, interval=4), n=20)
    for row, n in enumerate((4, 0)):
        alone = _greedy(model, ids[row: row + 1, n:], mask[row: row + 1, n:],
                        KVComposeCache(model, pipe(), budget=10, interval=4), n=20)
        assert torch.equal(batch[row, 14:], alone[0, 14 - n:])


def test_ragged_memory_is_sum_of_head_lengths_not_padded_max():
    model = tiny_model("llama", layers=2, kv_heads=4, heads=4)
    ids, mask = _inputs(b=1, t=20, pad=(0,))
    cache = KVComposeCache(model, _pipe(HeadUtility(floor=4, window=8, page_size=8), recent=4, window=8), budget=32, interval=8)
    _greedy(model, ids, mask, cache, n=44)
    rep = cache.memory()
    for i, layer in enumerate(cache.layers):
        per = (layer.head_dim + layer.value_dim) * 4
        assert rep.by_layer[i] == int(layer.lengths.sum()) * per
        assert isinstance(layer.segment.store, PagedStore)
        pool = layer.segment.store.pool
        used = int(((layer.lengths + 7) // 8).sum())
        assert pool.n_used == used
        # the pool keeps pages for the interval's tokens after each event (so it is not reallocated in
        # between): the pages of every head's tokens plus one interval (8 = one page) each, + page rounding
        room = -(-(int(layer.lengths.sum()) + 4 * 8) // 8) + 4
        assert pool.capacity <= math.ceil(max(used, room) * (1 + POOL_SLACK))
        assert pool.grows + pool.shrinks <= 4  # a few reallocations over the whole generation
        assert layer.allocated_bytes() == pool.capacity * 8 * per
        lengths = layer.lengths
        assert lengths.unique().numel() > 1
        # what masking inside dense buffers would keep: every head as long as the longest, plus the interval
        padded_max = lengths.numel() * (int(lengths.max()) + 8) * per
        assert layer.allocated_bytes() < padded_max
        assert pool.n_used * 8 * per < lengths.numel() * int(lengths.max()) * per + lengths.numel() * 8 * per
    assert rep.allocated < 1.4 * rep.total


def test_growpage_in_cache_cap_and_page_reuse():
    model = tiny_model("llama", layers=2)
    ids, mask = _inputs(b=2, t=14, pad=(3, 0))
    pipe = methods.growpage(methods.rkv(window=4), page=4, initial=0.25, cap=1.0, window=8, coverage=0.99)
    cache = KVComposeCache(model, pipe, budget=16, interval=4)
    _greedy(model, ids, mask, cache, n=40)
    alloc = pipe.allocator
    leaf = pipe.leaves.index(alloc)  # the allocator's state is threaded by the pipeline, per layer
    for layer in cache.layers:
        st_ = layer.segment.blocks[leaf]
        assert int(st_["pages"].sum()) <= alloc.cap_pages(16, 2)
        assert (layer.lengths.amax(-1) < st_["pages"] * 4).all()  # below the row's page ceiling after each step
        assert (layer.lengths == layer.lengths[:, :1]).all()  # per request: its heads hold the same count
        assert layer.segment.store.pool.reused > 0  # pages freed at compaction were handed out again
    assert sum(layer.segment.blocks[leaf].get("granted", 0) for layer in cache.layers) > 0


def test_growpage_events_follow_page_fills_not_the_interval():
    """Token by token: a row is compressed (or grows) exactly when its pages are full, whatever the interval;
    between events its held slots stay below its page ceiling, and memory follows the rows' pages."""
    model = tiny_model("llama", layers=2)
    ids, mask = _inputs(b=2, t=10, pad=(2, 0))
    pipe = methods.growpage(methods.rkv(window=2), page=4, initial=0.5, cap=1.0, floor=2, window=16)
    cache = KVComposeCache(model, pipe, budget=16, interval=1000)  # the interval rule would never fire
    leaf = pipe.leaves.index(pipe.allocator)
    events = [0, 0]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        x, m = ids[:, -1:], mask
        for _ in range(30):
            m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
            before = [layer.segment.store.lengths.amax(-1).clone() for layer in cache.layers]
            pages = [layer.segment.blocks[leaf].get("pages") for layer in cache.layers]
            logits = model(input_ids=x, attention_mask=m, past_key_values=cache).logits
            x = logits[:, -1:].argmax(-1)
            for i, layer in enumerate(cache.layers):
                st_ = layer.segment.blocks[leaf]
                full = before[i] + 1 >= (pages[i] * 4 if pages[i] is not None else layer.segment.limits.amax(-1))
                ran = layer.events > events[i]
                assert ran == bool(full.any())  # an event exactly when some row's pages filled
                events[i] = layer.events
                assert (layer.lengths.amax(-1) < st_["pages"] * 4).all() if "pages" in st_ else True
    assert min(events) >= 3
    for layer in cache.layers:
        assert layer.held_bytes() <= int(layer.segment.blocks[leaf]["pages"].sum()) * 4 * layer.num_heads * 2 * 16 * 4


def test_ragged_beam_search_and_crop():
    model = tiny_model("llama")
    ids, mask = _inputs(b=1, t=10, pad=(0,))
    cache = KVComposeCache(model, _pipe(HeadUtility(floor=2, window=4, page_size=4)), budget=8, interval=4)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                         num_beams=3, do_sample=False)
    assert out.shape[0] == 1
    c = KVComposeCache(model, _pipe(HeadUtility(floor=2, window=4, page_size=4)), budget=64)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=c)
    c.crop(-3)
    assert c.get_seq_length() == 7 and (c.layers[0].lengths == 7).all()


def test_bad_input_errors(tmp_path):
    model = tiny_model("llama", layers=2)
    with pytest.raises(KVComposeError, match="budget"):
        KVComposeCache(model, methods.reason_alloc(), budget=0)
    with pytest.raises(KVComposeError, match="floor \\* heads"):
        KVComposeCache(model, methods.reason_alloc(methods.rkv(window=2), floor=40), budget=32)
    with pytest.raises(KVComposeError, match="floor"):  # the floor cannot hold R-KV's 8 recent tokens
        KVComposeCache(model, methods.reason_alloc(floor=4), budget=32)
    with pytest.raises(KVComposeError, match="page size"):
        GrowPage(page=0)
    with pytest.raises(KVComposeError, match="page size"):
        KVComposeCache(model, methods.growpage(page=64), budget=32)
    with pytest.raises(KVComposeError, match="page size"):
        HeadUtility(page_size=-1)
    with pytest.raises(KVComposeError, match="not found"):
        methods.reason_alloc(profile=tmp_path / "nope.json")
    with pytest.raises(KVComposeError, match="exceed"):
        KVComposeCache(model, methods.pyramid_rkv(window=8), budget=8)
    with pytest.raises(KVComposeError, match="layers"):
        KVComposeCache(model, methods.reason_alloc(profile={"demand": [1.0, 2.0, 3.0]}), budget=64)
    with pytest.raises(KVComposeError, match="already has"):
        methods.growpage(methods.reason_alloc())
    with pytest.raises(KVComposeError, match="budget"):
        KVComposeCache(model, methods.growpage())
    with pytest.raises(KVComposeError, match="cap"):
        GrowPage(initial=2.0, cap=1.0)
    with pytest.raises(KVComposeError, match="protectors"):  # Pyramid's last layer is smaller than the window
        KVComposeCache(model, methods.pyramid_rkv(methods.rkv(window=8), window=2), budget=10)

def test_per_head_budgets_with_a_host_tier():
    """Per-head budgets and a tier that holds tokens now work together (they were refused on the old ragged
    layer): HBM follows each head's budget in paged storage, host memory keeps the rest, nothing is evicted."""
    from kvcompose import HostTier

    model = tiny_model("llama", layers=2)
    ids, mask = _inputs(b=2, t=14, pad=(3, 0))
    pipe = Pipeline(ProtectRecent(2), ValueNorm(), TopK(), HeadUtility(floor=2, window=4, page_size=4), HostTier())
    cache = KVComposeCache(model, pipe, budget=8, interval=4)
    _greedy(model, ids, mask, cache, n=16)
    seen = cache.get_seq_length()
    for layer in cache.layers:
        assert isinstance(layer.segment.store, PagedStore)
        assert layer.events > 0
        tier = layer.segment.tier
        hbm = layer.lengths
        # every token seen is in HBM or in host memory (left padding included), never both
        assert torch.equal(hbm + tier["positions"].lt(seen).sum(-1), torch.full_like(hbm, seen))
        assert (hbm.sum(-1) < 2 * (8 + 4)).all()  # HBM: the heads share 2 x 8 tokens, plus < one interval each
    assert cache.memory().by_tier["host"] > 0
