"""`benchmarks/vllm_pressure.py`, kvcompose inside vLLM against plain vLLM.

The pure parts (pools, ceilings, the table's ratios, the step recorder) on made-up numbers; then one tiny run
of the whole benchmark (a tiny random Llama with SmolLM2's tokenizer, 4 questions, 128 new tokens, every
mode: four engines, about two minutes on 2 cores) whose report must be computed from what the engines
measured: vLLM's per-step counts against the generated tokens, kvcompose's worker's own step and preemption
counts, the ratios against plain's row. A rerun must skip the finished parts. Skipped without vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
_PATH = os.path.join(ROOT, "benchmarks", "vllm_pressure.py")
QUESTIONS = os.path.join(os.path.dirname(__file__), "data", "tiny_math.jsonl")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vllm_pressure", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------- the pure parts
def test_pools_and_ceilings(bench):
    lens = [40, 100]
    assert bench.full_blocks(100, 92) == 6  # 192 tokens
    assert bench.full_blocks(100, 93) == 7
    # 8 of the LONGEST prompt at full length, and vLLM's null block
    assert bench.pool_blocks(lens, 92, "pressure", 8) == 8 * 6 + 1
    assert bench.pool_blocks(lens, 92, "agree", 8) == 8 * 6 + 1
    assert bench.pool_blocks(lens, 92, "ample", 8) == 5 + 6 + 1  # every request
    assert bench.compressed_blocks(256, 64) == 8 + 2 + 1


def _part(engine, mode, runs, pool=49, tokens=92):
    return {"mode": mode, "tokens": tokens, "engine": engine, "pool_blocks": pool, "block_size": 32,
            "prompt_tokens": [40, 100], "gold": ["1", "3"], "plain_requests": 8, "dtype": "bfloat16",
            "model": "m", "versions": {}, "loadavg_start": [1.0] * 3, "loadavg_end": [2.0] * 3, "runs": runs}


def _run(preset, budget, secs, gen, steps, peak, pre, answers=("1", "2"), stats=None):
    r = {"preset": preset, "budget": budget, "interval": None if budget is None else 64, "seconds": secs,
         "generated_tokens": gen, "answers": list(answers), "loadavg_after": [3.0] * 3,
         "steps": {"steps": steps, "producing_mean": gen / steps, "producing_peak": peak, "preemptions": pre}}
    if stats is not None:
        r["kvcompose_stats"] = stats
    return r


def test_rows_are_ratios_of_the_measured_numbers(bench):
    stats = {"events": 6, "event_seconds": 0.5, "plan_seconds": 0.1, "builder_seconds": 0.05,
             "record_seconds": 0.05, "step_seconds": 10.0}
    plain = _part("plain", "agree", [_run("plain", None, 10.0, 200, 100, 4, 7)])
    kvc = _part("kvcompose", "agree", [_run("rkv", 256, 5.0, 200, 40, 9, 1, answers=("1", "5"), stats=stats)])
    rows = bench.rows(plain, kvc)
    p, k = rows
    assert p["run"] == "plain vLLM" and k["run"] == "rkv 256"
    assert p["ceiling"] == pytest.approx(48 / 6) and k["ceiling"] == pytest.approx(48 / 11)
    assert k["producing mean"] == pytest.approx(5.0) and k["x producing"] == pytest.approx(2.5)
    assert k["x tok/s"] == pytest.approx(2.0) and k["x steps"] == pytest.approx(0.4)
    assert k["ms/step"] == pytest.approx(125.0) and k["x ms/step"] == pytest.approx(1.25)
    assert k["x seconds"] == pytest.approx(0.5) and k["preemptions"] == 1 and k["events"] == 6
    assert k["kvcompose share"] == pytest.approx(0.07) and p["kvcompose share"] is None
    assert p["same answer"] == 1.0 and k["same answer"] == 0.5
    assert p["accuracy"] == 0.5 and k["accuracy"] == 0.5
    md = bench.table({"plain": plain, "kvcompose": kvc, "rows": rows})
    assert "| rkv 256 | 5.00 | 9 | 4.36 | 2.50 | 40 | 0.40 | 125.00 | 1.25 | 40.00 | 2.00 |" in md


def test_per_layer_ceilings_count_the_blocks_of_the_largest_layer(bench, tmp_path):
    """A per-layer preset holds the largest layer's budget in every layer: its ceiling counts those blocks
    (pyramid_rkv at a mean of 256 on 30 layers keeps 492 tokens in its largest layer: 16 blocks)."""
    from kvcompose.integrations.vllm import engine_kwargs, request_kwargs

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    cfg = engine_kwargs("full", block_size=32)["additional_config"]
    assert bench.kept_bound(str(tmp_path), request_kwargs("pyramid_rkv", 256, block_size=32), cfg) == 512
    assert bench.kept_bound(str(tmp_path), request_kwargs("rkv", 256, block_size=32), cfg) == 256
    plain = _part("plain", "pressure", [_run("plain", None, 10.0, 200, 100, 4, 7)])
    pyr = {**_run("pyramid_rkv", 256, 5.0, 200, 40, 9, 1), "kept_bound": 512}
    rows = bench.rows(plain, _part("kvcompose", "pressure", [pyr, _run("rkv", 256, 5.0, 200, 40, 9, 1)]))
    assert rows[1]["ceiling"] == pytest.approx(48 / (16 + 2 + 1)) and rows[2]["ceiling"] == pytest.approx(48 / 11)


def test_step_recorder_counts_tokens_per_step_and_preemptions(bench):
    rec = bench.StepRecorder()

    def det(ctx, gen, ms=10.0):
        return SimpleNamespace(num_ctx_requests=ctx, num_generation_requests=gen, elapsed_ms=ms, is_dummy=False)

    rec.record(SimpleNamespace(iteration_details=det(3, 0), kv_cache_usage=0.5),
               SimpleNamespace(num_generation_tokens=3, num_preempted_reqs=0))
    rec.record(SimpleNamespace(iteration_details=det(0, 3, 30.0), kv_cache_usage=0.9),
               SimpleNamespace(num_generation_tokens=2, num_preempted_reqs=1))
    rec.record(SimpleNamespace(iteration_details=None, kv_cache_usage=0.0), None)  # no model step: not counted
    s = rec.summary()
    assert s["steps"] == 2 and s["produced_tokens"] == 5 and s["producing_mean"] == 2.5
    assert s["producing_peak"] == 3 and s["scheduled_peak"] == 3 and s["preemptions"] == 1
    assert s["engine_ms_mean"] == 20.0 and s["kv_usage_peak"] == 0.9


def test_questions_refused_clearly(bench, tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        bench.load_questions(str(tmp_path / "missing.jsonl"), 4)
    with pytest.raises(SystemExit, match="has only 4 questions"):
        bench.load_questions(QUESTIONS, 5)


def test_budgets_must_be_whole_blocks(bench):
    with pytest.raises(SystemExit):
        bench.main(["--budgets", "100", "--out", "unused"])


# ---------------------------------------------------------------------------------------- a tiny run
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama (float32) with SmolLM2's tokenizer and chat template, so that the benchmark's
    prompts are the real questions' token ids."""
    pytest.importorskip("vllm")
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvcompose.models import DEFAULT_EOS_ID, GGUF_FILE, default_model_path

    path = str(tmp_path_factory.mktemp("tiny_smol"))
    tok = AutoTokenizer.from_pretrained(default_model_path(), gguf_file=GGUF_FILE)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=DEFAULT_EOS_ID)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def check_report(bench, out: str) -> None:
    """The report of the tiny run, checked against what the engines measured."""
    tables = bench.report(out)
    assert sorted(tables) == ["agree_128", "ample_128", "pressure_128"]
    for stem, rows in tables.items():
        with open(os.path.join(out, f"{stem}.json")) as f:
            res = json.load(f)
        plain, kvc = res["plain"], res["kvcompose"]
        assert plain["pool_blocks"] == kvc["pool_blocks"]
        mode = plain["mode"]
        lens = plain["prompt_tokens"]
        want_pool = 1 + (sum(-(-(n + 128) // 32) for n in lens) if mode == "ample"
                         else 2 * -(-(max(lens) + 128) // 32))
        assert plain["pool_blocks"] == want_pool
        runs = plain["runs"] + kvc["runs"]
        assert [r["run"] for r in rows] == ["plain vLLM", "random_attention 64", "snapkv 64"]
        for row, r in zip(rows, runs):
            s = r["steps"]
            # vLLM's per-step counts add up to the tokens the requests returned
            assert s["produced_tokens"] == r["generated_tokens"] == sum(len(t) for t in r["token_ids"])
            if mode != "agree":
                assert r["generated_tokens"] == 4 * 128  # ignore_eos
            assert s["steps"] >= 128 and 1 <= s["producing_peak"] <= 4
            assert row["producing mean"] == pytest.approx(r["generated_tokens"] / s["steps"])
            assert row["tok/s"] == pytest.approx(r["generated_tokens"] / r["seconds"])
            assert row["ms/step"] == pytest.approx(1000 * r["seconds"] / s["steps"])
            assert row["x tok/s"] == pytest.approx(row["tok/s"] / rows[0]["tok/s"])
            assert row["x producing"] == pytest.approx(row["producing mean"] / rows[0]["producing mean"])
            assert row["x steps"] == pytest.approx(s["steps"] / rows[0]["steps"])
            assert row["preemptions"] == s["preemptions"]
            if "kvcompose_stats" in r:  # the worker counts the same steps and preemptions as vLLM's stats
                st = r["kvcompose_stats"]
                assert st["steps"] == s["steps"] and st["preemptions"] == s["preemptions"]
                assert st["request_steps"] == s["produced_tokens"]
                assert st["events"] > 0 and row["events"] == st["events"]
                assert 0 < row["kvcompose share"] < 1
                # the bound: max(prompt, budget 64) + interval 32, and a block = 4 blocks of 32
                assert row["ceiling"] == pytest.approx((plain["pool_blocks"] - 1) / (2 + 1 + 1))
                assert s["producing_peak"] <= int(row["ceiling"])  # admission by bound: never more than fit
            else:
                assert row["ceiling"] == pytest.approx((plain["pool_blocks"] - 1) / -(-(max(lens) + 128) // 32))
        if mode == "pressure":  # the pool holds 2 plain requests: vLLM overcommits it and preempts; kvcompose
            # admits a request only when its bound (max(prompt, budget 64) + interval 32, and a block) fits beside
            # the running ones', so it never preempts
            assert rows[0]["preemptions"] > 0
            assert all(r["preemptions"] == 0 for r in rows[1:])
        if mode == "ample":  # every request runs from the first step to its last
            assert all(r["preemptions"] == 0 and r["producing peak"] == 4 for r in rows)
        if mode == "agree":
            assert rows[0]["same answer"] == 1.0 and all(0 <= r["same answer"] <= 1 for r in rows)
    with open(os.path.join(out, "report.md")) as f:
        md = f.read()
    assert md.count("| plain vLLM |") == 3 and "### ample, prompt + 128 tokens" in md


def test_tiny_run_reports_what_the_engines_measured(bench, tiny_model, tmp_path):
    pytest.importorskip("vllm")
    out = str(tmp_path / "out")
    cmd = [sys.executable, _PATH, "--model", tiny_model, "--dtype", "float32", "--data", QUESTIONS, "--out", out,
           "--modes", "pressure", "ample", "agree", "--tokens", "128", "--budgets", "64", "--interval", "32",
           "--presets", "random_attention", "snapkv", "--prompts", "4", "--plain-requests", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "start: load average" in proc.stdout and "end: load average" in proc.stdout

    check_report(bench, out)
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)  # resumable: nothing reruns
    assert again.returncode == 0 and again.stdout.count("done before") == 4 and " start (load" not in again.stdout


# ------------------------------------------------------------------------------ the GPU model (not a run)
@pytest.fixture(scope="module")
def gpu():
    path = os.path.join(ROOT, "benchmarks", "vllm_gpu_model.py")
    spec = importlib.util.spec_from_file_location("vllm_gpu_model", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_gpu_model"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_gpu_model_decode_step_is_memory_bound_until_the_gemms_are_not(gpu):
    m, g, p = gpu.MODELS["qwen2.5-7b"], gpu.GPUS["H200"], gpu.Params()
    assert m.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # 56 KiB
    one, many = gpu.step_ms(m, g, 8, 300, p), gpu.step_ms(m, g, 64, 300, p)
    assert many / one < 1.1  # 8x the requests, hardly a longer step: the weights dominate what is read
    weights_ms = 1000 * m.weight_bytes / (g.bw_tbs * 1e12 * p.bw_eff) + p.overhead_ms
    assert one == pytest.approx(weights_ms + 1000 * 8 * 300 * m.kv_bytes_per_token / (g.bw_tbs * 1e12 * p.bw_eff))
    big = gpu.step_ms(m, g, 1024, 300, p)  # the GEMMs' FLOPs take over
    assert big >= 1000 * 1024 * 2 * m.params / (g.bf16_tflops * 1e12 * p.flops_eff)


def test_gpu_model_scenario_ratios_follow_the_pool(gpu):
    p = gpu.Params()
    r = gpu.scenario("qwen2.5-7b", "H200", 64, 2048, "8 plain", 256, p)
    held = 256 + p.interval + p.block
    assert r["pool_tokens"] == 8 * 2160  # 8 x (100 + 2048) rounded up to blocks of 16
    assert r["plain"]["running"] == 8 and r["kvcompose"]["running"] == r["pool_tokens"] // held
    assert r["x running"] == pytest.approx(r["kvcompose"]["running"] / 8)
    assert r["x tokens/s"] == pytest.approx(r["kvcompose"]["tokens_per_s"] / r["plain"]["tokens_per_s"])
    assert r["x tokens/s"] > 0.9 * r["x running"]  # on a GPU the concurrency is (almost) all tokens/s
    free = gpu.scenario("qwen2.5-7b", "H200", 64, 2048, "8 plain", 256, gpu.Params(event_share=0.0))
    assert r["kvcompose"]["step_ms"] == pytest.approx(free["kvcompose"]["step_ms"] / 0.95)
    with pytest.raises(ValueError, match="holds no request"):
        gpu.scenario("qwen2.5-7b", "H200", 64, 2048, 100, 256, p)
