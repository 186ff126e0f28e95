"""kvcompose.bench.paged_blocks: VaSE's value protection by whole blocks stays inside the budget where the token
protector inside a block selector does not; a request-wide event keeps one block set for every layer and KV
head, ranks blocks by their priority averaged over layers and heads, and with per-layer decisions
reproduces the per-layer-row variant exactly; bad use is refused by name."""

import pytest
import torch
from beartype.roar import BeartypeCallHintParamViolation
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError

from helpers import examples, random_view
from kvcompose import (
    BlockGranular, KVComposeCache, KVComposeError, Pipeline, ProtectRecent, ProtectValueNorm, Pyramid, Sample, TopK,
    ValueNorm, methods,
)
from kvcompose.bench.paged_blocks import BlockProtectValueNorm, RequestBlocks, RequestEvent, VotingValueProtect
from kvcompose.bench.fidelity import teacher_force_logits
from kvcompose.testing import tiny_model
from kvcompose.traces import Trace
from kvcompose.kernels import value_magnitude
from kvcompose.bench.paged_blocks import block_granular, request_pipeline

# a wrong type is caught by the session's type checker, or (without it) by the block's own check
WRONG_TYPE = (KVComposeError, TypeCheckError, BeartypeCallHintParamViolation)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


def _arange_view(b=2, h=3, t=96, seed=0, pad=None):
    view = random_view(b=b, h=h, t=t, seen=t, w=8, seed=seed, pad=pad)
    return type(view)(**{**view.__dict__, "positions": torch.arange(t).expand(b, h, t).contiguous()})


# ------------------------------------------------------------------------------------------ BlockProtectValueNorm
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_value_protection_picks_whole_blocks_by_max_range(per_head, seed):
    view = _arange_view(seed=seed)
    prot = BlockProtectValueNorm(ProtectValueNorm(0.25, sinks=4, exclude_recent=16), block=8, per_head=per_head)
    mask = prot(view, 64)  # k = 16 tokens -> 2 blocks of 8
    mag = value_magnitude(view.values)
    for b in range(2):
        for h in range(3):
            blocks = sorted({i // 8 for i in range(96) if mask[b, h, i]})
            assert len(blocks) == 2 and 0 in blocks  # the sinks' block is infinitely large
            for blk in blocks:  # whole blocks
                assert mask[b, h, blk * 8:(blk + 1) * 8].all()
            # reference: the non-sink block with the largest max range among eligible tokens (not the newest 16)
            m = mag[b] if not per_head else mag[b, h][None]
            best = max(range(1, 10), key=lambda i: float(m[:, i * 8:(i + 1) * 8].max()))
            assert blocks[1] == best
    if not per_head:
        assert torch.equal(mask[:, 0], mask[:, 1]) and torch.equal(mask[:, 0], mask[:, 2])


@settings(max_examples=examples(40), deadline=None)
@given(block=st.integers(2, 12), k=st.integers(0, 40), sinks=st.integers(0, 6), recent=st.integers(0, 20),
       per_head=st.booleans(), pad=st.integers(0, 30), seed=st.integers(0, 1000))
def test_block_value_protection_stays_within_k_whole_blocks(block, k, sinks, recent, per_head, pad, seed):
    view = _arange_view(b=2, h=2, t=64, seed=seed, pad=(pad, 0))
    prot = BlockProtectValueNorm(ProtectValueNorm(k, sinks=sinks, exclude_recent=recent), block=block,
                                 per_head=per_head)
    mask = prot(view, 256)
    assert not (mask & ~view.valid).any()  # padding is never protected
    n_blocks = k // block
    for b in range(2):
        for h in range(2):
            held = view.valid[b, h]
            blocks = {int(p) // block for p in view.positions[b, h][mask[b, h]]}
            assert len(blocks) <= n_blocks
            for blk in blocks:  # every held token of a protected block is protected
                inside = held & (view.positions[b, h] // block == blk)
                assert mask[b, h][inside].all()
            assert int(mask[b, h].sum()) <= n_blocks * block
        if not per_head:
            assert torch.equal(mask[b, 0] | ~view.valid[b, 0], mask[b, 1] | ~view.valid[b, 1])


def test_block_protection_keeps_vase_inside_its_budget_the_token_protector_does_not():
    view = _arange_view(t=160, seed=3)
    budget = 64
    token_prot = ProtectValueNorm(0.25, sinks=4, exclude_recent=16)
    naive, _ = Pipeline(ProtectRecent(16), token_prot, ValueNorm(), BlockGranular(Sample(), block=8)).select(view, budget)
    fair, _ = Pipeline(ProtectRecent(16), BlockProtectValueNorm(token_prot, block=8), ValueNorm(),
                       BlockGranular(Sample(), block=8)).select(view, budget)
    assert int((fair.kept >= 0).sum(-1).max()) <= budget
    assert int((naive.kept >= 0).sum(-1).max()) > budget  # 16 scattered protected tokens each keep their block of 8


def test_block_granular_wraps_a_preset():
    vase = methods.vase()
    p = block_granular(vase, 16, "max", per_head=False)
    assert isinstance(p.selector, BlockGranular) and p.selector.inner is vase.selector
    assert p.selector.reduce == "max" and not p.selector.per_head and p.interval == vase.interval
    prots = [type(x) for x in p.protectors]
    assert prots.count(BlockProtectValueNorm) == 1 and ProtectValueNorm not in prots
    assert [type(x) for x in block_granular(vase, block_protection=False).protectors] == [type(x) for x in vase.protectors]
    assert repr(block_granular(methods.h2o()).scorer) == repr(methods.h2o().scorer)


def test_bad_use_is_refused():
    with pytest.raises(WRONG_TYPE):
        BlockProtectValueNorm(ProtectRecent(4))
    with pytest.raises(KVComposeError, match="block must be a positive int"):
        BlockProtectValueNorm(ProtectValueNorm(), block=0)
    with pytest.raises(KVComposeError, match="interval must be a positive int"):
        RequestEvent(budget=64, interval=0)
    with pytest.raises(WRONG_TYPE):
        RequestEvent(budget=64, interval=8, scope="head")
    ev = RequestEvent(budget=64, interval=8, block=16)
    with pytest.raises(KVComposeError, match="block 8 differs"):
        RequestBlocks(TopK(), 8, ev)
    with pytest.raises(WRONG_TYPE):
        RequestBlocks(TopK(), 16, None)
    with pytest.raises(KVComposeError, match="nothing was recorded"):
        ev.decide()
    with pytest.raises(KVComposeError, match="already"):
        request_pipeline(block_granular(methods.h2o()), 64)
    with pytest.raises(KVComposeError, match="no selector"):
        request_pipeline(methods.full(), 64)
    with pytest.raises(KVComposeError, match="one budget for every layer"):
        request_pipeline(methods.h2o().replace(Pyramid()), 64)
    # outside an event the selector refuses instead of evicting something else
    pipe, event = request_pipeline(methods.h2o(), 64, block=16)
    view = _arange_view(t=96)
    with pytest.raises(KVComposeError, match="only inside a RequestEvent"):
        pipe.select(view, 64)
    model = tiny_model("llama", layers=1)
    with pytest.raises(KVComposeError, match="does not run this event's pipeline"):
        with event.attached(model, KVComposeCache(model, methods.h2o(), budget=64)):
            pass
    with pytest.raises(KVComposeError, match="no pipeline"):
        with RequestEvent(64, 8).attached(model, KVComposeCache(model, pipe, budget=64)):
            pass


# ------------------------------------------------------------------------------------------ the request event
def test_request_decision_ranks_blocks_by_their_priority_averaged_over_layers_and_heads():
    ev = RequestEvent(budget=32, interval=64, block=16)
    pos = torch.arange(64).expand(1, 2, 64)
    valid = torch.ones(1, 2, 64, dtype=torch.bool)
    none = torch.zeros(1, 2, 64, dtype=torch.bool)
    # block means per (layer, head): layer 0 likes block 1, layer 1 likes block 2 more; block 3 is second overall
    per_block = [torch.tensor([[0.0, 5.0, 1.0, 3.0], [0.0, 5.0, 1.0, 3.0]]),
                 torch.tensor([[0.0, 0.0, 9.0, 3.0], [0.0, 0.0, 9.0, 3.0]])]
    for pb in per_block:
        ev.records.append((pb.repeat_interleave(16, dim=-1)[None], none, valid, pos))
    assert ev.decide().tolist() == [[False, False, True, True]]  # means over layers: [0, 2.5, 5, 3]
    prot = none.clone()
    prot[0, 1, 5] = True  # one head of one layer protects a token of block 0: block 0 is kept everywhere
    ev.records[0] = (ev.records[0][0], prot, valid, pos)
    assert ev.decide().tolist() == [[True, False, True, False]]
    # VaSE's votes: the most-voted value block is protected (3 layers vote block 1, one votes block 3)
    ev.records[0] = (ev.records[0][0], none, valid, pos)
    ev.votes = [torch.tensor([[0.0, 1.0, 0.0, 0.0]])] * 3 + [torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])]
    ev.vote_blocks = 1
    assert ev.decide().tolist() == [[False, True, True, False]]


def test_voting_protector_votes_in_the_record_pass_and_protects_nothing_itself():
    ev = RequestEvent(budget=64, interval=8, block=8)
    vote = VotingValueProtect(ProtectValueNorm(0.25, sinks=4), 8, ev)
    view = _arange_view(t=96, seed=5)
    assert not vote(view, 64).any() and ev.votes == []  # outside an event: no vote, no protection
    ev.mode = "record"
    assert not vote(view, 64).any()
    want = BlockProtectValueNorm(ProtectValueNorm(0.25, sinks=4), 8, per_head=False)(view, 64)  # [B, H, T]
    (v,) = ev.votes
    assert v.shape == (2, 96 // 8) and ev.vote_blocks == 16 // 8
    for b in range(2):
        assert {i for i in range(12) if v[b, i] > 0} == {int(p) // 8 for p in view.positions[b, 0][want[b, 0]]}


def _trace(prompt=20, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (prompt + n,), generator=g).tolist()
    return Trace(id="t", prompt_ids=ids[:prompt], trace_ids=ids[prompt:], question="q", answer=None, kind="sampled")


def _request_logits(model, pipe, budget, scope, trace):
    pipe, event = request_pipeline(pipe, budget, 16, scope)
    cache = KVComposeCache(model, pipe, budget=budget, seed=0)
    with event.attached(model, cache):
        logits = teacher_force_logits(model, trace, cache, chunk=event.interval)
    return logits, cache, event


@pytest.mark.parametrize("preset", ["h2o", "vase", "random_attention"])
def test_request_event_with_layer_decisions_equals_the_per_layer_events(preset):
    """The post-step event machinery (cache schedule off, a forward hook compresses every layer) reproduces
    the cache's own per-layer events exactly when it decides per layer."""
    model = tiny_model("llama", layers=3)
    trace = _trace()
    pipe = getattr(methods, preset)(recent=8) if preset != "h2o" else methods.h2o()
    ref = teacher_force_logits(model, trace, KVComposeCache(model, block_granular(pipe, 16, "mean", per_head=False),
                                                            budget=64, seed=0))
    got, cache, event = _request_logits(model, pipe, 64, "layer", trace)
    assert event.events >= 2
    assert torch.equal(ref, got)


@pytest.mark.parametrize("preset", ["h2o", "snapkv", "vase"])
def test_request_event_keeps_one_block_set_for_every_layer_and_head(preset):
    model = tiny_model("llama", layers=3)
    pipe = methods.vase(recent=8) if preset == "vase" else getattr(methods, preset)()
    trace = _trace(seed=1)
    _, cache, event = _request_logits(model, pipe, 64, "request", trace)
    assert event.events >= 2 and event.cache is None  # detached after the `with`
    first = cache.kept_positions(0)
    seen = cache.get_seq_length()
    for i in range(3):
        pos = cache.kept_positions(i)
        assert torch.equal(pos, first)  # the same positions in every layer and KV head
        assert torch.equal(pos, pos[:, :1].expand_as(pos))
    held = [p for p in first[0, 0].tolist() if p >= 0]
    newest = (seen - 1) // 16
    for blk in {p // 16 for p in held}:  # whole blocks (the newest may be partial)
        assert blk == newest or sum(1 for p in held if p // 16 == blk) == 16
    # the last event (at the last multiple of the interval) kept at most the budget plus the partial blocks
    # of the protected runs; tokens decoded after it are all held
    last_event = 20 + (len(trace.trace_ids) - 1) // event.interval * event.interval
    assert sum(1 for p in held if p < last_event) <= 64 + 16
    assert len(held) < seen  # it compressed
