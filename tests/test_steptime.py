"""`kvcompose bench steptime`: step time against tokens seen and the per-layer overhead, on tiny random models."""

import json

import pytest
import torch

from kvcompose import KVComposeError
from kvcompose.bench import steptime
from kvcompose.bench.speed import full_cache


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


def test_fill_reaches_the_seen_count():
    model = steptime.deep_model(layers=2, width=32)
    cache = full_cache(model)
    tok = steptime.fill(model, cache, 70, 32, "sdpa", generator=torch.Generator().manual_seed(0))
    assert tok.shape == (1, 1) and cache.get_seq_length() == 70
    with pytest.raises(KVComposeError):
        steptime.fill(model, cache, 0, 8, "sdpa", generator=torch.Generator())


def test_run_steptime_ratios_and_overhead(tmp_path):
    cfg = steptime.StepTimeConfig(methods=["tova", "streaming_llm"], budget=32, interval=16, seen=[64, 256],
                                  steps=6, tiny=True, deep_layers=3, deep_width=32, deep_held=32, deep_steps=6,
                                  out=str(tmp_path))
    data = steptime.run_steptime(cfg, log=lambda *a: None)
    sweep = {r["name"]: r for r in data["sweep"]}
    assert set(sweep) == {"ideal (sliding window 32, sdpa)", "tova", "streaming_llm"}
    for r in sweep.values():
        assert "error" not in r, r
        assert [p["seen"] for p in r["points"]] == [64, 256]
        # the ratio is step(256) / step(64) of this row's own medians (not a timing claim)
        first, last = r["points"]
        assert set(r["ratios"]) == {"256"}
        assert r["ratios"]["256"] == pytest.approx(last["median_ms"] / first["median_ms"])
        assert r["flat"] == (abs(r["ratios"]["256"] - 1) <= cfg.tolerance)
    # a compressed cache holds about its budget whatever it has seen
    assert all(32 <= p["held"] < 32 + 16 for p in sweep["tova"]["points"])
    deep = {r["name"]: r for r in data["deep"]["rows"]}
    kvc, dyn = deep["full (kvcompose)"], deep["DynamicCache (sdpa)"]
    # kvcompose's full cache is compared with DynamicCache at equal held tokens, a preset with the ideal of
    # its budget; the ratio and the per-layer overhead are those of the two rows' medians
    assert kvc["vs"] == "DynamicCache (sdpa)" and kvc["held"] == dyn["held"] >= 32
    assert kvc["ratio"] == pytest.approx(kvc["median_ms"] / dyn["median_ms"])
    assert kvc["overhead_us_per_layer"] == pytest.approx(1e3 * (kvc["median_ms"] - dyn["median_ms"]) / 3)
    ideal = deep[deep["tova"]["vs"]]
    assert deep["tova"]["vs"].startswith("ideal") and ideal["held"] < 32 <= deep["tova"]["held"] < 32 + 16
    assert "ratio" not in dyn and "ratio" not in ideal  # the references are not compared with themselves
    saved = json.loads((tmp_path / "steptime.json").read_text())
    assert saved["sweep"][0]["ratios"] == data["sweep"][0]["ratios"]
    md = (tmp_path / "steptime.md").read_text()
    assert "step(256)/step(64)" in md and "Per-layer overhead" in md


def test_steptime_rejects_bad_checkpoints(tmp_path):
    with pytest.raises(KVComposeError):
        steptime.run_steptime(steptime.StepTimeConfig(seen=[1024], tiny=True, out=str(tmp_path)))
    with pytest.raises(KVComposeError):
        steptime.run_steptime(steptime.StepTimeConfig(methods=["nope"], tiny=True, out=str(tmp_path)))
