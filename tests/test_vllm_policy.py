"""The vLLM prototype's pure parts: block policies and block-table compaction (no vLLM needed)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcompose.integrations.vllm import BlockPolicy, compact_block_table, engine_kwargs, request_rng
from kvcompose.view import KVComposeError


def _simulate(policy: BlockPolicy, prompt: int, new: int, seed: str = "r0") -> tuple[list[int], list[tuple]]:
    """Decode `new` tokens after a `prompt`-token prompt as vLLM's scheduler does: an event before each
    step, then a block is allocated when the step's token does not fit. Returns the final resident blocks
    and the events (computed tokens, freed blocks, resident after)."""
    bs = policy.block_size
    resident = list(range(-(-prompt // bs)))
    rng = request_rng(policy.seed, seed)
    events = []
    for n in range(prompt, prompt + new):  # n = tokens already computed; this step writes position n
        freed = policy.plan(list(resident), n, prompt, rng)
        assert freed == sorted(freed)
        assert set(freed) <= set(resident)
        assert all(i < n // bs for i in freed), "only full blocks before the written one may be freed"
        resident = [i for i in resident if i not in freed]
        if freed:
            events.append((n, freed, len(resident)))
        if n // bs >= len(resident) and n // bs not in resident:
            resident.append(n // bs)
    return resident, events


def test_streaming_keeps_sinks_and_the_newest_blocks():
    p = BlockPolicy("streaming", budget=128, block_size=32)
    resident, events = _simulate(p, prompt=70, new=400)
    assert events, "the budget is far below the length: events must happen"
    assert resident[0] == 0  # the sink block
    last = (70 + 400 - 1) // 32
    assert resident[1:] == list(range(last - len(resident) + 2, last + 1))  # newest, contiguous
    for n, freed, held in events:
        assert held == p.budget_blocks
    assert len(resident) <= p.budget_blocks + p.interval_blocks


def test_no_event_during_prefill_or_under_budget():
    p = BlockPolicy("streaming", budget=256, block_size=32)
    assert p.plan(list(range(20)), num_computed_tokens=100, num_prompt_tokens=600) == []  # prefill running
    assert p.plan(list(range(8)), num_computed_tokens=250, num_prompt_tokens=50) == []  # 8 blocks = budget
    assert p.plan(list(range(9)), num_computed_tokens=270, num_prompt_tokens=50) == [1]


def test_interval_spaces_events():
    p = BlockPolicy("streaming", budget=128, block_size=32, interval=64)
    _, events = _simulate(p, prompt=40, new=500)
    gaps = [b[0] - a[0] for a, b in zip(events, events[1:])]
    assert gaps and all(g == 64 for g in gaps)
    assert all(len(freed) == 2 for _, freed, _ in events[1:])


def test_random_protects_sink_prompt_and_recent_and_differs_by_seed():
    p = BlockPolicy("random", budget=320, block_size=32, recent=64)  # 10 blocks
    prompt = 100  # blocks 0..3
    res_a, ev_a = _simulate(p, prompt, 600, seed="a")
    res_b, ev_b = _simulate(p, prompt, 600, seed="b")
    last = (prompt + 600 - 1) // 32
    for res in (res_a, res_b):
        assert res[0] == 0
        assert set(range(last - p.recent_blocks + 1, last + 1)) <= set(res)  # the recent window
        room = p.budget_blocks - 1 - p.recent_blocks
        assert set(range(1, min(4, room))) <= set(res)  # prompt blocks while they leave a free slot
    assert res_a != res_b, "two request ids must draw differently"
    assert _simulate(p, prompt, 600, seed="a")[0] == res_a, "same seed and id: same draws"


def test_random_draws_are_uniform_over_candidates():
    p = BlockPolicy("random", budget=192, block_size=32, recent=32, protect_prompt=False)
    counts = {}
    rng = random.Random(0)
    resident = list(range(12))  # 0 sink; 10, 11 recent; 1..9 candidates; 6 to free
    for _ in range(3000):
        for i in p.plan(resident, num_computed_tokens=11 * 32 + 5, num_prompt_tokens=10, rng=rng):
            counts[i] = counts.get(i, 0) + 1
    assert set(counts) == set(range(1, 10))
    expect = 3000 * 6 / 9
    assert all(abs(c - expect) < 0.1 * expect for c in counts.values())


@pytest.mark.parametrize("kw", [
    dict(policy="h2o", budget=128), dict(policy="streaming", budget=100), dict(policy="streaming", budget=0),
    dict(policy="streaming", budget=128, interval=48), dict(policy="random", budget=96, recent=64),
    dict(policy="streaming", budget=128, block_size=0),
])
def test_bad_settings_raise(kw):
    with pytest.raises(KVComposeError):
        BlockPolicy(**kw)
    with pytest.raises(KVComposeError):
        engine_kwargs(**kw)


def test_random_needs_a_generator():
    p = BlockPolicy("random", budget=192, block_size=32)
    with pytest.raises(KVComposeError):
        p.plan(list(range(10)), num_computed_tokens=300, num_prompt_tokens=10)


def test_engine_kwargs_do_not_import_vllm():
    import subprocess
    import sys

    code = ("import sys, kvcompose.integrations.vllm as v; kw = v.engine_kwargs('random', budget=256, seed=3); "
            "assert 'vllm' not in sys.modules, 'vllm imported'; print(kw['additional_config']['kvcompose']['seed'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
    kw = engine_kwargs("random", budget=256, block_size=32, seed=3, log_file="ev.jsonl")
    assert kw["enable_prefix_caching"] is False and kw["async_scheduling"] is False
    assert kw["block_size"] == 32 and kw["additional_config"]["kvcompose"]["log_file"] == "ev.jsonl"
    assert kw["scheduler_cls"] == "kvcompose.integrations.vllm.scheduler.KVComposeScheduler"
    assert kw["worker_extension_cls"] == "kvcompose.integrations.vllm.worker.KVComposeWorkerExtension"


def _reference_compaction(table, lens, bs):
    rows, new_lens = [], []
    for row, n in zip(table.tolist(), lens.tolist()):
        used = row[: -(-n // bs)]
        held = [b for b in used if b != 0]
        rows.append(held + [0] * (len(row) - len(held)))
        new_lens.append(n - (len(used) - len(held)) * bs)
    return rows, new_lens


@given(st.integers(1, 5), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_compaction_matches_a_loop(R, M, seed):
    bs = 4
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, M * bs + 1, (R,), generator=g, dtype=torch.int32)
    table = torch.zeros(R, M, dtype=torch.int32)
    for r in range(R):
        n = -(-int(lens[r]) // bs)
        table[r, :n] = torch.randperm(100, generator=g)[:n].to(torch.int32) + 1
        if n > 1:  # free some full blocks before the last one
            drop = torch.rand(n - 1, generator=g) < 0.4
            table[r, : n - 1][drop] = 0
    before = table.clone()
    out, new_lens, n_freed = compact_block_table(table, lens, bs)
    rows, ref_lens = _reference_compaction(table, lens, bs)
    for r in range(R):
        n_used = -(-int(new_lens[r]) // bs)
        assert out[r, :n_used].tolist() == rows[r][:n_used]
    assert new_lens.tolist() == ref_lens
    assert n_freed == int((lens - new_lens).sum()) // bs
    assert torch.equal(table, before), "the input table must not be modified"


def test_compaction_of_a_known_table():
    table = torch.tensor([[7, 0, 0, 9, 4, 0], [3, 5, 0, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([18, 6], dtype=torch.int32)  # row 0: 5 blocks used (2 freed), row 1: 2 used
    out, new_lens, n = compact_block_table(table, lens, 4)
    assert out[0, :3].tolist() == [7, 9, 4]
    assert new_lens.tolist() == [10, 6]
    assert n == 2
    same, same_lens, zero = compact_block_table(table[1:], lens[1:], 4)
    assert zero == 0 and torch.equal(same, table[1:]) and torch.equal(same_lens, lens[1:])


def test_vllm_modules_say_what_is_missing():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ImportError, match="kvcompose\\[vllm\\]"):
        import kvcompose.integrations.vllm.scheduler  # noqa: F401
