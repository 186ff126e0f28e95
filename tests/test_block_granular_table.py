"""benchmarks/block_granular_table.py (issue 17): VaSE's value protection by whole blocks stays inside the
budget where the token protector inside a block selector does not; the variants wrap the presets as
documented; pooled numbers are token-weighted."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from helpers import random_view
from kvcompose import BlockGranular, Pipeline, ProtectRecent, ProtectValueNorm, Sample, ValueNorm, methods
from kvcompose.kernels import value_magnitude

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "block_granular_table.py"
_spec = importlib.util.spec_from_file_location("block_granular_table", _PATH)
bgt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bgt)


def _arange_view(t=96, seed=0):
    view = random_view(b=2, h=3, t=t, seen=t, w=8, seed=seed)
    return type(view)(**{**view.__dict__, "positions": torch.arange(t).expand(2, 3, t).contiguous()})


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_value_protection_picks_whole_blocks_by_max_range(per_head, seed):
    view = _arange_view(seed=seed)
    prot = bgt.BlockProtectValueNorm(ProtectValueNorm(0.25, sinks=4, exclude_recent=16), block=8, per_head=per_head)
    budget = 64  # k = 16 tokens -> 2 blocks of 8
    mask = prot(view, budget)
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


def test_block_protection_keeps_vase_inside_its_budget_the_token_protector_does_not():
    view = _arange_view(t=160, seed=3)
    budget = 64
    token_prot = ProtectValueNorm(0.25, sinks=4, exclude_recent=16)
    sel = BlockGranular(Sample(), block=8)
    naive, _ = Pipeline(ProtectRecent(16), token_prot, ValueNorm(), sel).select(view, budget)
    fair, _ = Pipeline(ProtectRecent(16), bgt.BlockProtectValueNorm(token_prot, block=8), ValueNorm(),
                       BlockGranular(Sample(), block=8)).select(view, budget)
    n_naive = (naive.kept >= 0).sum(-1)
    n_fair = (fair.kept >= 0).sum(-1)
    assert int(n_fair.max()) <= budget
    assert int(n_naive.max()) > budget  # 16 scattered protected tokens each keep their block of 8


def test_variants_wrap_the_presets():
    assert repr(bgt.build_pipeline("h2o", 256, "token", 16)) == repr(methods.h2o())
    p = bgt.build_pipeline("rkv", 256, "layer-max", 16)
    assert isinstance(p.selector, BlockGranular) and not p.selector.per_head and p.selector.reduce == "max"
    assert p.interval == methods.rkv().interval == 128
    v = bgt.build_pipeline("vase", 256, "head-mean", 16)
    assert any(isinstance(x, bgt.BlockProtectValueNorm) for x in v.protectors)
    assert any(isinstance(x, ProtectRecent) for x in v.protectors)
    t = bgt.build_pipeline("vase-tokenprot", 256, "head-mean", 16)
    assert not any(isinstance(x, bgt.BlockProtectValueNorm) for x in t.protectors)
    with pytest.raises(ValueError):
        bgt.build_pipeline("h2o", 256, "pages", 16)


def test_aggregate_is_token_weighted():
    base = {"method": "h2o", "budget": 128, "variant": "token", "recall_delta": None, "peak_held_tokens": 1}
    runs = [{**base, "kind": "sampled", "trace": "a", "n_tokens": 100, "top1_sum": 90.0, "kl_sum": 10.0,
             "nll_sum": 200.0, "nll_full_sum": 190.0},
            {**base, "kind": "worked", "trace": "b", "n_tokens": 300, "top1_sum": 150.0, "kl_sum": 3.0,
             "nll_sum": 600.0, "nll_full_sum": 600.0, "recall_delta": -1.0}]
    agg = bgt.aggregate(runs)
    both = agg[("h2o", 128, "token", "all")]
    assert both["n_tokens"] == 400 and both["top1"] == pytest.approx(240 / 400)
    assert both["kl_mean"] == pytest.approx(13 / 400) and both["ppl_ratio"] == pytest.approx(math.exp(10 / 400))
    assert both["recall_delta"] == -1.0
    assert agg[("h2o", 128, "token", "sampled")]["top1"] == pytest.approx(0.9)


def _trace(prompt=20, n=200, seed=0):
    from kvcompose.bench.traces import Trace

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (prompt + n,), generator=g).tolist()
    return Trace(id="t", prompt_ids=ids[:prompt], trace_ids=ids[prompt:], question="q", answer=None, kind="sampled")


def _request_logits(model, method, budget, scope, trace):
    from kvcompose import KVComposeCache
    from kvcompose.bench.fidelity import teacher_force_logits

    pipe, event = bgt.build_request_pipeline(method, budget, 16, scope)
    cache = KVComposeCache(model, pipe, budget=budget, seed=0)
    event.cache = cache
    handle = model.register_forward_hook(event.hook, with_kwargs=True)
    try:
        logits = teacher_force_logits(model, trace, cache, chunk=event.interval)
    finally:
        handle.remove()
    return logits, cache, event


@pytest.mark.parametrize("method", ["h2o", "vase", "random_attention"])
def test_request_event_with_layer_decisions_equals_the_per_layer_events(method):
    """The post-step event machinery (cache schedule off, a forward hook compresses every layer) reproduces
    the cache's own per-layer events exactly when it decides per layer."""
    from kvcompose import KVComposeCache
    from kvcompose.bench.fidelity import teacher_force_logits
    from kvcompose.bench.tiny import tiny_model

    model = tiny_model("llama", layers=3)
    trace = _trace()
    ref = teacher_force_logits(model, trace, KVComposeCache(model, bgt.build_pipeline(method, 64, "layer-mean", 16),
                                                            budget=64, seed=0))
    got, cache, event = _request_logits(model, method, 64, "layer", trace)
    assert event.events >= 2
    assert torch.equal(ref, got)


@pytest.mark.parametrize("method", ["h2o", "snapkv", "vase"])
def test_request_event_keeps_one_block_set_for_every_layer_and_head(method):
    from kvcompose.bench.tiny import tiny_model

    model = tiny_model("llama", layers=3)
    _, cache, event = _request_logits(model, method, 64, "request", _trace(seed=1))
    assert event.events >= 2
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
    last_event = 20 + (len(_trace().trace_ids) - 1) // event.interval * event.interval
    assert sum(1 for p in held if p < last_event) <= 64 + 16


def test_request_decision_ranks_blocks_by_their_priority_averaged_over_layers_and_heads():
    ev = bgt.RequestEvent(None, None, budget=32, interval=64, block=16)
    pos = torch.arange(64).expand(1, 2, 64)
    valid = torch.ones(1, 2, 64, dtype=torch.bool)
    none = torch.zeros(1, 2, 64, dtype=torch.bool)
    # block means per (layer, head): layer 0 likes block 1, layer 1 likes block 2 more; block 3 is second overall
    per_block = [torch.tensor([[0.0, 5.0, 1.0, 3.0], [0.0, 5.0, 1.0, 3.0]]),
                 torch.tensor([[0.0, 0.0, 9.0, 3.0], [0.0, 0.0, 9.0, 3.0]])]
    for pb in per_block:
        ev.records.append((pb.repeat_interleave(16, dim=-1)[None], none, valid, pos))
    chosen = ev.decide()  # means over layers: [0, 2.5, 5, 3] -> blocks 2 and 3
    assert chosen.tolist() == [[False, False, True, True]]
    prot = none.clone()
    prot[0, 1, 5] = True  # one head of one layer protects a token of block 0: block 0 is kept everywhere
    ev.records[0] = (ev.records[0][0], prot, valid, pos)
    assert ev.decide().tolist() == [[True, False, True, False]]
