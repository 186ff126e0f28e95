"""The pure parts of `benchmarks/vllm_pressure.py` (no vLLM): the batches of a suite, the pool sizes and the
table's ratios (against the mean of the same engine's full-cache batches) and running counts."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "vllm_pressure.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vllm_pressure", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_suites_put_the_full_cache_first_and_last(bench):
    runs = bench._configs("pressure", [128, 256], ["rkv", "snapkv"])
    assert [r["name"] for r in runs] == ["full", "rkv_128", "snapkv_128", "rkv_256", "snapkv_256", "full#2"]
    roomy = bench._configs("roomy", [128, 256], ["rkv"])
    assert [r["name"] for r in roomy] == ["full", "rkv_256", "full#2"]


def test_pool_holds_the_full_cache_of_the_shortest_requests(bench):
    prompts = [[0] * 40, [0] * 100]
    assert bench._pool(prompts, 88, 8) == 8 * 4  # ceil((40 + 88) / 32) = 4 blocks each
    assert bench._pool(prompts, 88, None) == 4 + 6 + 16  # every request, plus slack


def test_report_ratios_are_against_the_mean_full_batch(bench, tmp_path, capsys):
    def run(name, preset, tps, steps, request_steps, events=0):
        return {"name": name, "preset": preset, "budget": None if preset == "full" else 128,
                "tokens_per_s": tps, "seconds": 100.0 / tps, "answers": ["1", "2"], "loadavg_after": [3.0, 3.0, 3.0],
                "stats": {"steps": steps, "request_steps": request_steps, "peak_requests": 4, "preemptions": 2,
                          "events": events, "step_seconds": 10.0, "event_seconds": 0.5, "plan_seconds": 0.1,
                          "builder_seconds": 0.0, "record_seconds": 0.0}}

    res = {"suite": "pressure", "pool_blocks": 64, "block_size": 32, "prompt_tokens": [40, 100], "gold": ["1", "3"],
           "new_tokens": 88, "n": 2, "full_requests": 8, "versions": {},
           "runs": [run("full", "full", 10.0, 100, 200), run("rkv_128", "rkv", 30.0, 50, 200, events=6),
                    run("full#2", "full", 20.0, 100, 200)]}
    with open(tmp_path / "pressure.json", "w") as f:
        json.dump(res, f)
    rows = {r["run"]: r for r in bench.report(str(tmp_path))["pressure"]}
    assert rows["rkv_128"]["x full"] == pytest.approx(2.0)  # 30 / mean(10, 20)
    assert rows["full"]["x full"] == pytest.approx(10 / 15)
    assert rows["rkv_128"]["mean running"] == pytest.approx(4.0) and rows["full"]["mean running"] == 2.0
    assert rows["rkv_128"]["kvcompose share"] == pytest.approx(0.06)
    assert "| rkv_128 | 30.00 | 2.00 |" in capsys.readouterr().out
