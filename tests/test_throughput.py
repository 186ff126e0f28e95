"""`kvcompose bench throughput`: batch planning in a KV memory limit and a tiny batched run."""

import json

import pytest
import torch

from kvcompose import KVComposeError
from kvcompose.bench import throughput as tp
from kvcompose.testing import tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


def test_bytes_per_token_and_plan():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    per_tok = tp.bytes_per_token(model.config, torch.float32)
    assert per_tok == 2 * 2 * 2 * 16 * 4  # layers x kv heads x (k + v) x head dim x fp32
    assert tp.bytes_per_token(model.config, torch.bfloat16) == per_tok // 2
    full = tp.held_bound("full", 100, 1000, None, None)
    comp = tp.held_bound("tova", 100, 1000, 256, 64)
    assert (full, comp) == (1100, 320)
    assert tp.held_bound("tova", 400, 1000, 256, 64) == 464  # a prompt above the budget is held first
    mem = 10 * full * per_tok
    assert tp.plan_batch(mem, per_tok, full) == 10
    assert tp.plan_batch(mem, per_tok, comp) == 34 > tp.plan_batch(mem, per_tok, full)
    assert tp.plan_batch(mem, per_tok, comp, max_batch=16) == 16
    with pytest.raises(KVComposeError):
        tp.held_bound("tova", 100, 1000, 256, None)


def test_batch_prompts_are_left_padded():
    ids, mask = tp.batch_prompts(4, (5, 11), vocab=128, pad_id=0, seed=0)
    assert ids.shape == mask.shape == (4, 11)
    assert mask.sum(-1).tolist() == [5, 7, 9, 11]
    assert (mask[:, -1] == 1).all() and (ids[mask == 0] == 0).all()


def test_run_throughput_compressed_batch_is_larger_and_fits(tmp_path):
    model = tiny_model("llama", layers=2, vocab=128)
    cfg = tp.ThroughputConfig(methods=["tova", "streaming_llm"], budget=16, interval=8, kv_memory_mib=0.25,
                              new_tokens=48, prompt_lengths=(6, 14), max_batch=24, out=str(tmp_path))
    data = tp.run_throughput(cfg, log=lambda *a: None, model_and_tokenizer=(model, None))
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"full", "tova", "streaming_llm"}
    assert rows["tova"]["batch"] > rows["full"]["batch"] >= 1
    per_tok, mem = tp.bytes_per_token(model.config, torch.float32), data["kv_memory_bytes"]
    # the plan: the full cache holds the longest prompt plus every new token; a compressing cache its bound
    assert rows["full"]["held_bound"] == 14 + 48
    assert rows["tova"]["held_bound"] >= tp.held_bound("tova", 14, 48, 16, 8)
    for r in rows.values():
        assert r["error"] is None and r["fits"], r
        assert r["batch"] == tp.plan_batch(mem, per_tok, r["held_bound"], 24)
        assert r["peak_alloc_bytes"] <= r["planned_bytes"] == r["batch"] * r["held_bound"] * per_tok <= mem
        assert r["steps"] == 48
        # rates are tokens of the whole batch over decode time, ratios against the full cache's row
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 48 / r["decode_seconds"])
        assert r["vs_full"] == pytest.approx(r["tokens_per_s"] / rows["full"]["tokens_per_s"])
        assert r["batch_vs_full"] == pytest.approx(r["batch"] / rows["full"]["batch"])
    assert rows["tova"]["batch_vs_full"] > 1
    assert json.loads((tmp_path / "throughput.json").read_text())["rows"][1]["batch"] == rows["tova"]["batch"]
    assert (tmp_path / "throughput.png").stat().st_size > 1000
    assert "| tova |" in (tmp_path / "throughput.md").read_text()


def test_throughput_refuses_what_does_not_fit(tmp_path):
    model = tiny_model("llama", layers=2, vocab=128)
    with pytest.raises(KVComposeError, match="does not hold one full-cache sequence"):
        tp.run_throughput(tp.ThroughputConfig(methods=["tova"], budget=16, interval=8, kv_memory_mib=0.001,
                                              new_tokens=48, out=str(tmp_path)), model_and_tokenizer=(model, None))
    with pytest.raises(KVComposeError):
        tp.run_throughput(tp.ThroughputConfig(methods=["full"], out=str(tmp_path)), model_and_tokenizer=(model, None))
