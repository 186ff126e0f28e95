"""The memory hierarchy's benchmark and preset: benchmarks/tiers_grid.py's mean and peak HBM bytes for
chunked teacher forcing equal those of one-token decoding (the loop-level reference), for the memory
hierarchy and for R-KV; a tiny grid row runs end to end; and `methods.memory_hierarchy` never evicts the
prompt's first tokens (attention sinks) when the prompt does not fit in the retained share."""

import importlib.util
from pathlib import Path

import pytest
import torch

from kvcompose import KVComposeCache, methods
from kvcompose.bench.fidelity import Trace
from kvcompose.testing import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _grid():
    spec = importlib.util.spec_from_file_location("tiers_grid", ROOT / "benchmarks" / "tiers_grid.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


@torch.no_grad()
def _mean_one_token(model, pipeline, budget, ids, prompt, interval):
    """Reference: decode one token at a time; during step t the layer holds what it held after step t-1
    plus the new token (compression runs after attention)."""
    cache = KVComposeCache(model, pipeline, budget=budget, interval=interval)
    model(input_ids=ids[:, :prompt], past_key_values=cache)
    bpt = sum(layer.bytes_per_token() for layer in cache.layers)
    held, total = cache.memory().total, []
    peak = held
    for t in range(prompt, ids.shape[1]):
        total.append(held + bpt)
        peak = max(peak, held + bpt)
        model(input_ids=ids[:, t : t + 1], past_key_values=cache)
        held = cache.memory().total
    return sum(total) / len(total), peak


@pytest.mark.parametrize("which", ["hierarchy", "rkv"])
def test_mean_hbm_of_chunks_equals_one_token_decoding(which):
    grid = _grid()
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    ids = torch.randint(3, 128, (1, 20 + 64), generator=torch.Generator().manual_seed(0))
    if which == "hierarchy":
        pipe_fn, budget, interval = (lambda: methods.memory_hierarchy(0.25, evict_ratio=0.1, recent=4)), None, 8
    else:
        pipe_fn, budget, interval = methods.rkv, 24, 16
    want_mean, want_peak = _mean_one_token(model, pipe_fn(), budget, ids, 20, interval)
    cache = KVComposeCache(model, pipe_fn(), budget=budget, interval=interval)
    rec = grid.HeldRecorder(model, cache)
    with torch.no_grad():
        model(input_ids=ids[:, :20], past_key_values=cache)
        for s in range(20, ids.shape[1], 8):
            model(input_ids=ids[:, s : s + 8], past_key_values=cache)
    rec.close()
    assert cache.layers[0].events > 2  # compression happened: the mean is not just the full cache's
    assert rec.mean_held_bytes(20, ids.shape[1]) == pytest.approx(want_mean, rel=1e-12)
    assert rec.peak_held_bytes(20, ids.shape[1]) == want_peak == cache.memory().peak["hbm"]
    with torch.no_grad():  # a later forward (e.g. the recall probe) does not count in the trace's peak
        model(input_ids=ids[:, :40], past_key_values=cache)
    assert rec.peak_held_bytes(20, ids.shape[1]) == want_peak < cache.memory().peak["hbm"]
    full_mean = sum(t * sum(layer.bytes_per_token() for layer in cache.layers) for t in range(21, 85)) / 64
    assert want_mean < 0.8 * full_mean


def test_run_traces_reports_fidelity_and_hbm_of_a_grid_row():
    grid = _grid()
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(1)
    traces = [Trace(id=f"t{i}", prompt_ids=torch.randint(3, 128, (12,), generator=g).tolist(),
                    trace_ids=torch.randint(3, 128, (40,), generator=g).tolist(), question="q", answer=None,
                    kind="sampled") for i in range(2)]
    fn = lambda: methods.memory_hierarchy(0.25, evict_ratio=0.1, recent=4)  # noqa: E731
    row, tokens = grid.run_traces(model, traces, fn, 8, 8)
    assert 0.0 < row["hbm_mean_share"] < row["hbm_peak_share"] <= 1.0
    assert row["host_peak_bytes"] > 0 and len(tokens) == 2 and 0.0 <= row["top1"] <= 1.0
    budgets = [max(16, round(t["peak_tokens"]) - 16) for t in row["traces"]]
    rkv, _ = grid.run_traces(model, traces, methods.rkv, 16, 8, budgets)
    assert [t["budget"] for t in rkv["traces"]] == budgets and rkv["host_peak_bytes"] == 0


@torch.no_grad()
def _evicted(model, pipe, ids, prompt, interval=8):
    """Positions evicted for good by the end (in no layer's HBM or tier), per layer and KV head: loop level."""
    cache = KVComposeCache(model, pipe, interval=interval)
    model(input_ids=ids[:, :prompt], past_key_values=cache)
    for t in range(prompt, ids.shape[1]):
        model(input_ids=ids[:, t : t + 1], past_key_values=cache)
    out = []
    for layer in cache.layers:
        tier = cache.pipeline.tier.fetch(layer.segment.tier)
        for h in range(layer.num_heads):
            have = set(layer.positions[0, h].tolist()) | set(tier.positions[0, h].tolist() if tier is not None else [])
            out.append(set(range(layer.seen)) - have)
    return out


def test_hierarchy_keeps_the_prompts_first_tokens_when_the_prompt_does_not_fit():
    """A 40-token prompt, 4 recent tokens protected, 25% evicted: at the first event (48 tokens seen) the
    retained 36 cannot hold the prompt, so some prompt tokens go; the first `sinks` never do."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    ids = torch.randint(3, 128, (1, 40 + 24), generator=torch.Generator().manual_seed(3))
    with_sinks = _evicted(model, methods.memory_hierarchy(0.25, evict_ratio=0.25, recent=4), ids, 40)
    no_sinks = _evicted(model, methods.memory_hierarchy(0.25, evict_ratio=0.25, recent=4, sinks=0), ids, 40)
    assert all(len(ev) == 16 for ev in with_sinks)  # floor(0.25 * 64) evicted per layer and head
    assert all(not (ev & {0, 1, 2, 3}) for ev in with_sinks)
    assert all(any(p < 40 for p in ev) for ev in with_sinks)  # the prompt did not fit: some of it went
    assert any(ev & {0, 1, 2, 3} for ev in no_sinks)  # without sinks the first tokens are evicted
