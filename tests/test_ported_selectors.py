"""KVCompose's composite tokens (`CompositeTokens`, `AggregatedAttention`) and ChunkKV (`methods.chunkkv`, a
`BlockGranular` preset) against plain-loop references, with their storage and budget contracts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from helpers import random_view
from kvcompose import HeadUtility, KeyNorm, KVComposeCache, KVComposeError, PagedStore, Pipeline, TopK, methods
from kvcompose.blocks import AggregatedAttention, CompositeTokens
from kvcompose.testing import tiny_model


def _real(view, b, h):
    return [t for t in range(view.shape[2]) if bool(view.valid[b, h, t])]


def ref_aggregated(view, window, task="max", group="mean", vnorm=False, head_mean=True):
    b_, h_, t_, d = view.keys.shape
    hq, w_all = view.queries.shape[1], view.queries.shape[2]
    g = hq // h_
    out = torch.zeros(view.shape, dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            real = _real(view, b, h)
            per_head = []
            for j in range(g):
                rows = []
                for w in range(w_all - window, w_all):
                    if not bool(view.query_valid[b, w]):
                        continue
                    qp = int(view.query_positions[w])
                    keys = [t for t in real if int(view.positions[b, h, t]) <= qp]
                    logit = {t: float(view.queries[b, h * g + j, w].double() @ view.keys[b, h, t].double()) * view.scale
                             for t in keys}
                    m = max(logit.values())
                    z = sum(math.exp(x - m) for x in logit.values())
                    rows.append({t: math.exp(logit[t] - m) / z if t in logit else 0.0 for t in real})
                agg = {t: (max(r[t] for r in rows) if task == "max" else sum(r[t] for r in rows) / len(rows)) for t in real}
                per_head.append(agg)
            for t in real:
                vals = [a[t] for a in per_head]
                s = sum(vals) / g if group == "mean" else max(vals)
                out[b, h, t] = s * (float(view.values[b, h, t].double().norm()) if vnorm else 1.0)
    if head_mean:
        out = out + out.mean(1, keepdim=True)
    return out.float().masked_fill(~view.valid, 0.0)


@pytest.mark.parametrize("task,group,vnorm", [("max", "mean", False), ("mean", "max", True)])
def test_aggregated_attention_matches_loop_reference(task, group, vnorm):
    view = random_view(b=2, h=2, t=24, d=8, w=6, seen=30, pad=[2, 0], seed=1)
    ours = AggregatedAttention(window=6, task=task, group=group, value_norm=vnorm)(view)
    torch.testing.assert_close(ours[view.valid], ref_aggregated(view, 6, task, group, vnorm)[view.valid], atol=1e-5,
                               rtol=1e-5)


def ref_composite(scores, valid, budget, structured, floor=0):
    """Kept slots per (row, head): structured = each head its top-(min budget); unstructured = a global top over
    the row's (head, token) pairs after each head's first max(floor, 1)."""
    b_, h_, t_ = scores.shape
    out = {}
    for b in range(b_):
        ranked = {h: sorted(_idx(valid, b, h), key=lambda t: -float(scores[b, h, t])) for h in range(h_)}
        if structured:
            k = int(budget[b].min())
            for h in range(h_):
                out[b, h] = sorted(ranked[h][:k])
            continue
        lo = max(floor, 1)
        first = [(h, t) for h in range(h_) for t in ranked[h][:lo]]
        rest = sorted(((h, t) for h in range(h_) for t in ranked[h][lo:]), key=lambda p: -float(scores[b, p[0], p[1]]))
        take = first + rest[: int(budget[b].sum()) - len(first)]
        for h in range(h_):
            out[b, h] = sorted(t for hh, t in take if hh == h)
    return out


def _idx(valid, b, h):
    return [t for t in range(valid.shape[-1]) if bool(valid[b, h, t])]


@pytest.mark.parametrize("structured", [True, False])
def test_composite_tokens_match_loop_reference(structured):
    view = random_view(b=2, h=3, t=30, d=8, seen=36, pad=[4, 0], seed=2)
    scores = KeyNorm()(view)
    budget = torch.tensor([[10, 12, 8], [9, 9, 9]])
    kept, _ = CompositeTokens(structured=structured)(scores, torch.zeros_like(view.valid), view.valid, budget)
    ref = ref_composite(scores, view.valid, budget, structured)
    for (b, h), slots in ref.items():
        assert [int(x) for x in kept[b, h] if x >= 0] == slots, (b, h)
    counts = (kept >= 0).sum(-1)
    if structured:
        assert bool((counts == counts[:, :1]).all())  # whole composite tokens: the same count per head
    else:
        assert counts.sum(-1).tolist() == budget.sum(-1).tolist() and not bool((counts == counts[:, :1]).all())


def test_composite_tokens_keep_protected_and_floor():
    view = random_view(b=1, h=2, t=20, d=8, seed=3)
    scores = torch.zeros(1, 2, 20)
    scores[0, 0] = torch.arange(20.0)
    scores[0, 1] = -1000.0  # head 1 never wins the global top-k
    prot = torch.zeros(1, 2, 20, dtype=torch.bool)
    prot[0, 1, 3] = True
    kept, order = CompositeTokens(structured=False, floor=2)(scores, prot, view.valid, torch.full((1, 2), 6),
                                                             need_order=True)
    k1 = set(kept[0, 1][kept[0, 1] >= 0].tolist())
    assert 3 in k1 and len(k1) == 2  # the floor of 2 counts the protected token (issue 28: the row keeps its total)
    assert (kept[0, 0] >= 0).sum() == 10 and order.shape == (1, 2, 20)
    with pytest.raises(KVComposeError):
        CompositeTokens(floor=-1)


@given(b=st.integers(1, 3), h=st.integers(1, 4), t=st.integers(8, 48), budget=st.integers(1, 24),
       floor=st.sampled_from([0, 1, 3, 0.1, 0.2, 0.5, 1.0]), n_prot=st.integers(0, 3), seed=st.integers(0, 500))
@example(b=1, h=3, t=40, budget=12, floor=0.2, n_prot=0, seed=0)
@example(b=1, h=2, t=8, budget=5, floor=0, n_prot=0, seed=0)  # the winning head holds fewer than the bound
@example(b=1, h=2, t=8, budget=2, floor=0, n_prot=2, seed=0)  # the other heads' protected tokens exceed the floor
def test_composite_tokens_one_head_keeps_at_most_its_bound(b, h, t, budget, floor, n_prot, seed):
    """The unstructured selection gives one head at most the layer's total less the floor every other head keeps
    (`head_bound`, what vLLM's scheduler holds blocks for), whenever each head holds at least its floor; the
    structured one the budget."""
    g = torch.Generator().manual_seed(seed)
    budget = min(budget, t)
    scores = torch.randn(b, h, t, generator=g)
    scores[..., : t // 4] = scores[..., :1]  # ties
    scores[0, 0] += 100.0  # one head wins every global comparison: the bound's worst case
    valid = torch.ones(b, h, t, dtype=torch.bool)
    prot = torch.zeros(b, h, t, dtype=torch.bool)
    prot[..., : min(n_prot, budget)] = True
    for structured in (False, True):
        sel = CompositeTokens(structured=structured, floor=0 if structured else floor)
        kept, _ = sel(scores, prot, valid, torch.full((b, h), budget))
        counts = (kept >= 0).sum(-1)
        assert int(counts.max()) <= sel.head_bound(budget, h)
        if not structured:
            assert (counts >= sel.floor_count(budget)).all()
            if h > 1:  # the bound is reached: the winning head takes all but what the others keep at least, their
                # floor or their protected tokens (or all it holds)
                least = max(sel.floor_count(budget), min(n_prot, budget))
                assert int(counts[0, 0]) == min(h * budget - (h - 1) * least, t)


MODEL = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _gen(pipe, budget=24, interval=8, new=60):
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    cache = KVComposeCache(MODEL, pipe, budget=budget, interval=interval)
    MODEL.generate(input_ids=ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return cache


def test_kvcompose_paper_storage():
    """Structured: dense storage, budget + interval slots per head; unstructured: paged storage, head counts
    differ, each row's heads hold at most the layer total plus an interval each."""
    dense = _gen(methods.kvcompose_paper(structured=True))
    assert dense.stats.compress_calls > 0 and all(not isinstance(la.segment.store, PagedStore) for la in dense.layers)
    assert max(dense.held_lengths()) < 24 + 8
    paged = _gen(methods.kvcompose_paper(structured=False))
    for layer in paged.layers:
        assert isinstance(layer.segment.store, PagedStore)
        lengths = layer.lengths
        assert bool((lengths.sum(-1) < 2 * (24 + 8)).all())
    assert any(bool((la.lengths != la.lengths[:, :1]).any()) for la in paged.layers)  # really ragged
    # with per-head budgets, structured keeps the smallest head budget in every head of the row
    per_head = _gen(methods.kvcompose_paper(structured=True).replace(HeadUtility(floor=0.5, window=4)))
    assert all(bool((la.lengths == la.lengths[:, :1]).all()) for la in per_head.layers)


# ------------------------------------------------------------------------------------------ ChunkKV
def ref_chunkkv(scores, positions, valid, budget, chunk):
    """Chunks of `chunk` positions ranked by the mean over the row's heads of their mean score, kept while the
    kept tokens fit in the budget (every head keeps the same chunks)."""
    b_, h_, t_ = scores.shape
    out = {}
    for b in range(b_):
        blocks = {}
        for h in range(h_):
            for t in _idx(valid, b, h):
                blocks.setdefault(int(positions[b, h, t]) // chunk, {}).setdefault(h, []).append(t)
        worth = {c: sum(sum(float(scores[b, h, t]) for t in ts) / len(ts) for h, ts in hs.items()) / len(hs)
                 for c, hs in blocks.items()}
        room = [int(budget[b, h]) for h in range(h_)]
        keep = {h: [] for h in range(h_)}
        stop = [False] * h_
        for c in sorted(worth, key=lambda c: (-worth[c], c)):
            for h in range(h_):
                ts = blocks[c].get(h, [])
                if stop[h] or len(ts) > room[h]:
                    stop[h] = True
                    continue
                room[h] -= len(ts)
                keep[h] += ts
        for h in range(h_):
            out[b, h] = sorted(keep[h])
    return out


def test_chunkkv_matches_loop_reference():
    view = random_view(b=2, h=2, t=40, d=8, seen=40, pad=[3, 0], seed=4)  # every position held
    pipe = methods.chunkkv(Pipeline(KeyNorm(), TopK()), chunk=6)
    sel, _ = pipe.select(view, 20)
    ref = ref_chunkkv(KeyNorm()(view), view.positions, view.valid, torch.full((2, 2), 20), 6)
    for (b, h), slots in ref.items():
        assert [int(x) for x in sel.kept[b, h] if x >= 0] == slots, (b, h)
    assert pipe.paged and isinstance(pipe.selector.inner, TopK)


def test_head_bounds_per_layer_are_what_each_block_promises():
    """`rules.head_bounds` (what vLLM's scheduler reserves for, per layer) is the layer budget for a uniform
    pipeline, the selector's `head_bound` for a ragged one (AdaKV) and the allocator's for a head-wise one."""
    from kvcompose import methods
    from kvcompose.integrations.vllm.rules import head_bounds

    layers, heads, budget = 30, 3, 256  # SmolLM2-135M's shape (ReasonAlloc ships its profile)
    assert head_bounds(methods.preset("rkv"), layers, budget, heads) == [budget] * layers
    ada = methods.preset("adakv")
    floor = ada.selector.floor_count(budget)
    assert floor == int(budget * ada.selector.floor) and head_bounds(ada, layers, budget, heads) == \
        [heads * budget - (heads - 1) * floor] * layers
    pyr = methods.preset("pyramid_rkv")
    assert head_bounds(pyr, layers, budget, heads) == [int(b) for b in pyr.allocator.layer_budgets(layers, budget)]
    ra = methods.preset("reason_alloc")
    got = head_bounds(ra, layers, budget, heads)
    assert got == [ra.allocator.head_bound(int(b), heads) for b in ra.allocator.layer_budgets(layers, budget)]
    assert max(got) > max(int(b) for b in ra.allocator.layer_budgets(layers, budget))  # one head may take more
