"""Every block composes with every storage layout, tier and cache: a hypothesis test over the product of
pipelines (presets and random compositions) x allocators x tiers x plain / branch cache x left-padded batches,
on a tiny model, with the invariants the one layer core promises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvcompose import (
    AccumulatedAttention, BranchCache, CompressedTier, Evict, GrowPage, HeadUtility, Hierarchy, HostTier,
    KeyNorm, KeyRedundancy, KVComposeCache, LastQueryAttention, PagedStore, Pipeline, ProtectPrompt,
    ProtectRecent, ProtectSinks, Pyramid, RandomDrop, RandomScore, Recency, Sample, TopK, Uniform, ValueNorm,
    WindowedAttention, methods,
)
from kvcompose.block import EventTrigger
from kvcompose.blocks import (
    CAM, AggregatedAttention, CompositeTokens, DuoHeads, HeadCurves, CAP, CUR, Compactor, CriticalKV, ExpectedAttention, KeyDiff, LagKV, LeverageScore, MergeSimilar,
    NonCausalAttention, OutputProjection, Rotary,
)
from kvcompose.testing import tiny_model
from helpers import examples, ratio_curves

MODEL = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
MERGERS = [None, None, MergeSimilar(), MergeSimilar(threshold=0.2, fraction=0.5), CAM(window=4)]  # optional part
ROPE, PROJ = Rotary.from_model(MODEL), OutputProjection.from_model(MODEL)
# the scorers ported from kvpress (kvcompose.blocks), at sizes this tiny model reaches
PORTED_SCORERS = [KeyDiff(), LagKV(sinks=2, lag=4), CUR(sinks=2, window=4), ExpectedAttention(ROPE, window=4, future=16),
                  CAP(ROPE, window=4, future=16), CriticalKV(KeyNorm(), PROJ), NonCausalAttention(chunk=8, window=8),
                  LeverageScore(ROPE, sketch=8), Compactor(ROPE, sinks_start=2, sinks_end=2, chunk=8, sketch=8, window=8)]


def _presets(recent: int) -> dict:
    return {
        "streaming_llm": lambda: methods.streaming_llm(),
        "h2o": lambda: methods.h2o(),
        "snapkv": lambda: methods.snapkv(window=recent),
        "tova": lambda: methods.tova(),
        "knorm": lambda: methods.knorm(),
        "rkv": lambda: methods.rkv(window=recent),
        "random_attention": lambda: methods.random_attention(recent=recent),
        "vase": lambda: methods.vase(recent=recent, window=2 * recent),
    }


@st.composite
def pipelines(draw):
    """A preset or a random composition of blocks: (pipeline, protected recent count, protected sinks)."""
    recent = draw(st.integers(1, 4))
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(_presets(recent))))
        pipe = _presets(recent)[name]()
        rec = max((p.n for p in pipe.protectors if isinstance(p, ProtectRecent) and isinstance(p.n, int)), default=0)
        sinks = max((p.n for p in pipe.protectors if isinstance(p, ProtectSinks)), default=0)
        return pipe, rec, sinks
    protectors, rec, sinks = [], 0, 0
    if draw(st.booleans()):
        rec = recent
        protectors.append(ProtectRecent(rec))
    if draw(st.booleans()):
        sinks = draw(st.integers(1, 3))
        protectors.append(ProtectSinks(sinks))
    if draw(st.booleans()):
        protectors.append(ProtectPrompt(limit=4))
    merger = draw(st.sampled_from(MERGERS))
    if merger is not None:
        protectors.append(merger)  # the merging part folds evicted values into kept tokens, with any selector
    kind = draw(st.sampled_from(["random", "topk", "sample"]))
    if kind == "random":
        return Pipeline(*protectors, RandomDrop()), rec, sinks
    if kind == "sample":
        scorer = draw(st.sampled_from([WindowedAttention(4), AccumulatedAttention(), ValueNorm()]))
        return Pipeline(*protectors, scorer, Sample()), rec, sinks
    scorer = draw(st.sampled_from([Recency(), KeyNorm(), ValueNorm(), AccumulatedAttention(), WindowedAttention(4),
                                   LastQueryAttention(), 0.5 * KeyNorm() - 0.5 * KeyRedundancy(), RandomScore(),
                                   0.3 * AccumulatedAttention() + 0.7 * ValueNorm(), *PORTED_SCORERS,
                                   0.5 * KeyDiff() + 0.5 * AccumulatedAttention()]))
    return Pipeline(*protectors, scorer, TopK()), rec, sinks


ALLOCATORS = {
    "uniform": lambda w: Uniform(),
    "pyramid": lambda w: Pyramid(window=w, beta=2),
    "heads": lambda w: HeadUtility(floor=0.5, window=4),
    "growpage": lambda w: GrowPage(page=8, initial=0.5, window=8),
    # ported from kvpress: DuoAttention's head types (heads (0, 1) and (1, 0) stream) and LU-KV's budget curves
    "duo": lambda w: DuoHeads({"head_scores": [[0.9, 0.1], [0.2, 0.8]]}, streaming=0.5),
    "lukv": lambda w: HeadCurves({"prune": ratio_curves(2, 2, seed=0)},
                                 floor=12),
}
TIERS = {
    "evict": lambda: Evict(),
    "host": lambda: HostTier(),
    "compressed": lambda: CompressedTier(bits=8, key_group=4, value_group=4),
    "hierarchy": lambda: Hierarchy(0.2, 0.1, compressed=CompressedTier(bits=8, key_group=4, value_group=4)),
}


def _inputs(rows: int, t: int, pad: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (rows, t), generator=g)
    mask = torch.ones(rows, t, dtype=torch.long)
    if rows > 1:
        ids[0, :pad] = 0
        mask[0, :pad] = 0
    return ids, mask


def _run(pipe, budget, interval, ids, mask, new, seed=0, logits=False):
    cache = KVComposeCache(MODEL, pipe, budget=budget, interval=interval, seed=seed)
    out = MODEL.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, output_logits=logits, return_dict_in_generate=True)
    if logits:
        return out.sequences, cache, torch.stack(out.logits, 1)
    return out.sequences, cache


def _teacher_forced(pipe, budget, interval, seq, prompt, seed):
    """Logits of one row decoded alone, one token at a time, on given tokens (after its prompt)."""
    cache = KVComposeCache(MODEL, pipe, budget=budget, interval=interval, seed=seed)
    out = []
    with torch.no_grad():
        o = MODEL(input_ids=seq[:, :prompt], past_key_values=cache)
        out.append(o.logits[:, -1])
        for t in range(prompt, seq.shape[1] - 1):
            out.append(MODEL(input_ids=seq[:, t : t + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1)


def _check_cache(cache, pipe, budget, interval, rec, sinks, mask, seen):
    mem = cache.memory()
    assert mem.total == sum(layer.segment.store.nbytes() for layer in cache.layers)  # memory = the stores
    assert mem.allocated == sum(layer.segment.store.allocated_bytes() for layer in cache.layers)
    for i, layer in enumerate(cache.layers):
        pos = cache.kept_positions(i)
        real = pos >= 0
        # kept positions sorted and unique per (row, head); -1 padding only at the end
        assert bool(((pos[..., 1:] > pos[..., :-1]) | ~real[..., 1:]).all())
        assert bool((real[..., :-1] | ~real[..., 1:]).all())
        if not layer.events:
            continue
        lengths = layer.lengths
        if pipe.selector.ragged and not isinstance(pipe.allocator, EventTrigger):
            # ragged selectors (whole blocks, KVCompose's unstructured split) move counts between a row's heads: a
            # row holds at most its heads' budgets plus an interval each, and a protected run may round up to whole
            # blocks
            limits = layer.segment.limits if layer.segment.limits is not None else torch.full_like(lengths, layer.layer_budget())
            slack = 2 * (getattr(pipe.selector, "block", 1) - 1)
            assert bool((lengths.sum(-1) < limits.sum(-1) + lengths.shape[-1] * (interval + slack)).all())
        elif pipe.allocator.uniform:
            b = layer.layer_budget()
            assert b <= layer.held < b + interval  # held within [budget, budget + interval) per head
            assert bool((lengths == layer.held).all())
        elif isinstance(pipe.allocator, EventTrigger):
            # GrowPage: below each row's page ceiling after every step (with the Hierarchy tier, whose shares are
            # of all tokens seen, a request can overshoot its ceiling between events: a known open issue, see
            # docs/allocation.md "What is weak")
            if not isinstance(pipe.tier, Hierarchy):
                st_ = layer.segment.blocks[pipe.leaves.index(pipe.allocator)]
                assert bool((lengths.amax(-1) < st_["pages"] * pipe.allocator.page_size).all())
        else:
            limits = layer.segment.limits
            assert bool((lengths < limits + interval).all())
        # protected tokens are kept: the newest `rec` tokens and the first `sinks` real tokens of each row; in
        # HBM, or, with a tier that holds tokens, in HBM or that tier (protected = never evicted: a head whose
        # budget is below what its protectors keep moves the overflow to the tier, as memory_hierarchy does)
        if pipe.tier.holds_tokens and layer.segment.tier:
            tt = pipe.tier.fetch(layer.segment.tier)
            if tt is not None:
                tier_pos = torch.where(tt.valid, tt.positions, torch.full_like(tt.positions, -1))
                pos = torch.cat([pos, tier_pos], dim=-1)
        for row in range(pos.shape[0]):
            first = int((mask[row] == 0).sum())
            held = set(pos[row].reshape(-1).tolist())
            for p in range(seen - rec, seen):
                assert bool((pos[row] == p).any(-1).all()), f"recent token {p} lost in layer {i}"
            for p in range(first, first + sinks):
                assert bool((pos[row] == p).any(-1).all()), f"sink {p} lost in layer {i}"
            assert held
        if not pipe.allocator.uniform:
            assert isinstance(layer.segment.store, PagedStore)


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipes=pipelines(), alloc=st.sampled_from(sorted(ALLOCATORS)), tier=st.sampled_from(sorted(TIERS)),
       budget=st.integers(16, 24), interval=st.integers(3, 6), rows=st.integers(1, 2), pad=st.integers(1, 4),
       prompt=st.integers(8, 16), seed=st.integers(0, 3))
# a repeated token has the same value vector (exact score ties): a padded row must break them as the row alone does
@example(pipes=(Pipeline(ProtectSinks(1), ValueNorm(kind="range"), TopK()), 0, 1), alloc="duo", tier="evict",
         budget=16, interval=3, rows=2, pad=1, prompt=9, seed=0)
@example(pipes=(Pipeline(ProtectSinks(3), LagKV(sinks=2, lag=4), TopK()), 0, 3), alloc="pyramid", tier="evict",
         budget=16, interval=6, rows=2, pad=3, prompt=9, seed=0)
# a share-sized protector (H2O's recent half) counted with the batch's smallest head budget, so with per-head budgets a
# padded row protected what another row's head allowed (found by HYPOTHESIS_PROFILE=explore once HeadUtility was in
# the padded-row check; logits up to 4.5 apart)
@example(pipes=(methods.h2o(recent=0.5), 0, 0), alloc="heads", tier="evict", budget=16, interval=3, rows=2, pad=1,
         prompt=8, seed=0)
def test_plain_cache_product(pipes, alloc, tier, budget, interval, rows, pad, prompt, seed):
    _product_case(*pipes, alloc, tier, budget, interval, rows, pad, prompt, seed)


def _product_case(pipe0, rec, sinks, alloc, tier, budget, interval, rows, pad, prompt, seed):
    pipe = pipe0.replace(ALLOCATORS[alloc](max(rec, 1)), TIERS[tier]())
    ids, mask = _inputs(rows, prompt, pad, seed)
    new = budget + 3 * interval  # seen > budget + interval: every combination compresses at least twice
    out, cache, logits = _run(pipe, budget, interval, ids, mask, new, seed, logits=True)
    seen = prompt + new - 1
    assert cache.get_seq_length() == seen and out.shape == (rows, prompt + new)
    assert max(layer.events for layer in cache.layers) > 0  # it really compressed
    _check_cache(cache, pipe, budget, interval, rec, sinks, mask, seen)
    # same seed, same result
    out2, cache2 = _run(pipe, budget, interval, ids, mask, new, seed)
    assert torch.equal(out, out2)
    for i in range(len(cache.layers)):
        assert torch.equal(cache.kept_positions(i), cache2.kept_positions(i))
    # a padded row equals that row alone (every pipeline whose `padded_rows_note()` is None: not GrowPage, whose
    # pool is shared by the batch, nor random draws, which follow the batch's shape): the row alone, teacher-forced
    # on the batch's tokens, gives the same logits at every step (the padded batch attends over other shapes, so
    # equal up to float rounding; the compressed tier's quantization turns rounding into whole steps, so it is
    # left out here and checked bit-exactly in tests/test_tiers.py). HeadUtility (its top-k over the padded width
    # now breaks ties as the row alone does), LU-KV (its ratio of the row's own tokens), block-granular selectors
    # (ChunkKV: blocks from the row's first token) are in since issue 28; tests/test_block_rules.py has the rule
    if rows == 2 and pipe.padded_rows_note() is None and tier not in ("hierarchy", "compressed"):
        alone = _teacher_forced(pipe, budget, interval, out[:1, pad:], prompt - pad, seed)
        torch.testing.assert_close(logits[:1], alone, atol=2e-3, rtol=1e-3)


# every scorer ported from kvpress with TopK, and every merger with a scored and a random selector
PORTED_CASES = [(type(sc).__name__, (lambda sc: lambda prot: Pipeline(*prot, sc, TopK()))(sc)) for sc in PORTED_SCORERS] + [
    ("MergeSimilar+h2o", lambda prot: Pipeline(*prot, AccumulatedAttention(), TopK(), MergeSimilar())),
    ("MergeSimilar+random", lambda prot: Pipeline(*prot, RandomDrop(), MergeSimilar(fraction=0.5))),
    ("CAM+keydiff", lambda prot: Pipeline(*prot, KeyDiff(), TopK(), CAM(window=4))),
    ("CAM+random", lambda prot: Pipeline(*prot, RandomDrop(), CAM(window=4))),
    ("KVCompose-structured", lambda prot: Pipeline(*prot, AggregatedAttention(window=4), CompositeTokens())),
    ("KVCompose-unstructured", lambda prot: Pipeline(*prot, AggregatedAttention(window=4), CompositeTokens(False))),
    ("ChunkKV", lambda prot: methods.chunkkv(Pipeline(*prot, KeyDiff(), TopK()), chunk=4)),
]


@pytest.mark.parametrize("case", range(len(PORTED_CASES)), ids=[c[0] for c in PORTED_CASES])
@settings(max_examples=examples(1), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(alloc=st.sampled_from(sorted(ALLOCATORS)), tier=st.sampled_from(sorted(TIERS)), rows=st.integers(1, 2),
       seed=st.integers(0, 3), protect=st.booleans())
@example(alloc="uniform", tier="host", rows=2, seed=0, protect=True)  # the padded-row check runs for every case
# found by HYPOTHESIS_PROFILE=explore (issue 28): a merger lost its merge into a head's first token when that head kept
# fewer tokens than another (`kept_mask` scattered the -1 padding onto slot 0: MergeSimilar+h2o with DuoHeads, a padded
# row 0.16 apart from the row alone); a paged event of some rows promoted the other rows' tier tokens to HBM (GrowPage
# with a CompressedTier held 39 tokens against a 16-slot page ceiling, ChunkKV and KVCompose-unstructured)
@example(alloc="duo", tier="evict", rows=2, seed=2, protect=False)
@example(alloc="growpage", tier="compressed", rows=2, seed=0, protect=False)
def test_ported_blocks_in_the_product(case, alloc, tier, rows, seed, protect):
    """Every scorer and merger ported from kvpress, in the product above (some allocator and tier each run), with
    and without protection: the same invariants (protected kept, held within budget, sorted unique positions,
    same seed same result, a padded row equal to the row alone)."""
    prot = [ProtectRecent(2), ProtectSinks(1)] if protect else []
    _product_case(PORTED_CASES[case][1](prot), 2 if protect else 0, 1 if protect else 0, alloc, tier, 16, 4, rows, 2, 12,
                  seed)


@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipes=pipelines(), alloc=st.sampled_from(["uniform", "pyramid", "heads"]), rows=st.integers(1, 2),
       seed=st.integers(0, 3))
def test_tiers_without_eviction_are_bit_identical(pipes, alloc, rows, seed):
    """With tiers that keep every token exactly (host memory; a hierarchy with no compressed or evicted
    share), the logits are bit-identical to the all-HBM run of the same pipeline."""
    pipe0, rec, _ = pipes
    ids, mask = _inputs(rows, 12, 3, seed)
    logits = []
    for tier in (None, HostTier(), Hierarchy(0.0, 0.0)):
        pipe = pipe0.replace(ALLOCATORS[alloc](max(rec, 1)), *([tier] if tier is not None else []))
        budget = 4096 if tier is None else 16
        cache = KVComposeCache(MODEL, pipe, budget=budget, interval=4, seed=seed)
        out = MODEL.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=20,
                             min_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True)
        logits.append(torch.stack(out.logits))
        if tier is not None:
            assert max(layer.events for layer in cache.layers) > 0
            assert cache.memory().by_tier["host"] > 0
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipes=pipelines(), alloc=st.sampled_from(["uniform", "heads"]), tier=st.sampled_from(["evict", "host"]),
       rows=st.integers(1, 2), seed=st.integers(0, 3), active=st.booleans())
# HeadUtility's floor doubles what the protectors keep of a node: branch a must be long enough to compress
@example(pipes=(Pipeline(ProtectRecent(4), ProtectPrompt(limit=4), RandomDrop()), 4, 0), alloc="heads", tier="evict",
         rows=1, seed=0, active=False)
# a Merger rewrote the values of the node's held prefix (the sinks), and the recomputation started after that prefix:
# the continuation after switching back differed (logits up to 7.8 apart); now a merged node is recomputed whole
@example(pipes=(Pipeline(ProtectSinks(2), MergeSimilar(), RandomDrop()), 0, 2), alloc="uniform", tier="evict",
         rows=1, seed=0, active=False)
@example(pipes=(Pipeline(ProtectSinks(2), MergeSimilar(threshold=0.2, fraction=0.5), KeyNorm(), TopK()), 0, 2),
         alloc="heads", tier="evict", rows=2, seed=1, active=False)
def test_branch_cache_product(pipes, alloc, tier, rows, seed, active):
    """The tree cache takes the same pipelines (per-head budgets, tiers and mergers included) for its inactive
    nodes and, with `active_budget`, for the active path; exact rehydration gives back the branch it left (the
    same tokens and, within float rounding of the recomputation, the same logits)."""
    pipe0, rec, _ = pipes
    pipe = pipe0.replace(ALLOCATORS[alloc](max(rec, 1)), TIERS[tier]())
    ids, mask = _inputs(rows, 10, 3, seed)

    def make():
        return BranchCache(MODEL, budget=40, keep=0.25, scorer=pipe, tier=TIERS[tier](),
                           active_budget=24 if active else None, interval=4, seed=seed)

    cache = make()
    # branch a: more tokens than the pipeline must keep of a node (HeadUtility's floor per head can double what the
    # protectors keep), so that the budget can compress it
    n_a = max(16, 4 + next(k for k in range(1, 41) if cache._fits(k)))

    def gen(cache, inp, m, n=n_a, logits=False):
        out = MODEL.generate(input_ids=inp, attention_mask=m, past_key_values=cache, max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, output_logits=logits, return_dict_in_generate=True)
        return (out.sequences, torch.stack(out.logits, 1)) if logits else out.sequences

    with torch.no_grad():
        MODEL(input_ids=ids, attention_mask=mask, past_key_values=cache)
    a, b = cache.fork(0), cache.fork(0)
    cache.switch(a)
    full = torch.ones(rows, 1, dtype=torch.long)
    nxt = torch.cat([ids, ids[:, -1:]], 1)
    nm = torch.cat([mask, full], 1)
    out_a = gen(cache, nxt, nm)
    cache.switch(b)
    gen(cache, nxt, nm, n=20)
    assert cache.compressions > 0  # the inactive branch was compressed
    cache.switch(a)
    am = torch.cat([nm, torch.ones(rows, out_a.shape[1] - nxt.shape[1], dtype=torch.long)], 1)
    cont, cont_logits = gen(cache, out_a, am, n=4, logits=True)
    mem = cache.memory()
    stores = [s.store for n in cache._all_nodes() for s in n.segs if s.store is not None]
    assert mem.held == sum(s.nbytes() for s in stores) and mem.device == sum(s.allocated_bytes() for s in stores)
    # exact rehydration: continuing branch a equals decoding it without the detour, on a fresh tree
    ref = make()
    with torch.no_grad():
        MODEL(input_ids=ids, attention_mask=mask, past_key_values=ref)
    ref.switch(ref.fork(0))
    ref_a = gen(ref, nxt, nm)
    assert torch.equal(out_a, ref_a)
    if not active:
        ref_cont, ref_logits = gen(ref, ref_a, am, n=4, logits=True)
        assert torch.equal(cont, ref_cont)
        torch.testing.assert_close(cont_logits, ref_logits, atol=1e-4, rtol=1e-4)
