"""`kvcompose bench speed`: the ideal cache, interleaved decoding, summaries and ratios, the report, and the
kvpress side runner (its JSON parsed from a fixture; the real runner only where `.venv-kvpress` exists)."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from kvcompose import KVComposeError, methods
from kvcompose.bench import speed
from kvcompose.cache import KVComposeCache
from kvcompose.testing import tiny_model

ROOT = Path(__file__).resolve().parents[1]
KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


@torch.no_grad()
def _decode_logits(model, cache, ids, prompt):
    model(ids[:, :prompt], past_key_values=cache, use_cache=True)
    rows = []
    for t in range(prompt, ids.shape[1]):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True,
                    attention_mask=torch.ones(1, t + 1, dtype=torch.long))
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


def test_ideal_cache_holds_the_window_and_its_mask_matches():
    """The sliding-window cache attends over exactly `window` tokens: sdpa (mask skipped) and eager (mask applied)
    agree, it equals the full cache until the window is exceeded and differs after."""
    model = tiny_model("llama", layers=2, vocab=128)
    w, prompt = 16, 5
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    model.set_attn_implementation("sdpa")
    cache = speed.ideal_cache(model, w)
    sdpa = _decode_logits(model, cache, ids, prompt)
    assert speed.held_tokens(cache) == w - 1
    full = _decode_logits(model, speed.full_cache(model), ids, prompt)
    model.set_attn_implementation("eager")
    eager = _decode_logits(model, speed.ideal_cache(model, w), ids, prompt)
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(sdpa, eager, atol=1e-4, rtol=1e-4)
    n_inside = w - prompt  # steps whose sequence (prompt + decoded) still fits in the window
    torch.testing.assert_close(sdpa[:n_inside], full[:n_inside])
    assert (sdpa[-8:] - full[-8:]).abs().max() > 1e-2
    with pytest.raises(KVComposeError):
        speed.ideal_cache(model, 1)


def test_summarize_windows_and_steady_state():
    steps = [0.1] * 8 + [0.05] * 8  # 10 tok/s, then 20 tok/s
    s = speed.summarize(steps, first_seen=100, window=4, steady_fraction=0.5)
    assert s["steps"] == 16 and s["steady_from_seen"] == 108
    assert [w["seen"] for w in s["windows"]] == [104, 108, 112, 116]
    assert s["windows"][0]["tokens_per_s"] == pytest.approx(10.0)
    assert s["windows"][-1]["tokens_per_s"] == pytest.approx(20.0)
    assert s["steady_tokens_per_s"] == pytest.approx(20.0)
    assert s["tokens_per_s"] == pytest.approx(16 / 1.2)
    assert speed.summarize(steps, 0, batch=4)["steady_tokens_per_s"] == pytest.approx(80.0)
    with pytest.raises(KVComposeError):
        speed.summarize(steps, 0, window=0)


def test_decode_interleaved_rows_and_ratios():
    model = tiny_model("llama", layers=2, vocab=128)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    tova = KVComposeCache(model, methods.tova(), budget=16, interval=8)
    cs = [speed.Contender("ideal", "ideal", speed.ideal_cache(model, 16), "sdpa", budget=16),
          speed.Contender("full", "full", speed.full_cache(model), "sdpa"),
          speed.Contender("tova", "kvcompose", tova, model.config._attn_implementation, method="tova", budget=16,
                          interval=8)]
    traces = speed.decode_interleaved(model, ids, cs, 64, sample_every=16)
    assert all(len(t.step_seconds) == 64 and t.error is None for t in traces)
    rows = speed.with_ratios([speed._row(t, 16, 0.5, "kvcompose") for t in traces])
    ideal, full, tv = rows
    # ratios are the steady rates of this process's reference rows, per window against the full cache's window
    assert tv["vs_ideal"] == pytest.approx(tv["steady_tokens_per_s"] / ideal["steady_tokens_per_s"])
    assert tv["vs_full"] == pytest.approx(tv["steady_tokens_per_s"] / full["steady_tokens_per_s"])
    assert ideal["vs_full"] == pytest.approx(ideal["steady_tokens_per_s"] / full["steady_tokens_per_s"])
    fw = {w["seen"]: w["tokens_per_s"] for w in full["windows"]}
    assert [w["vs_full"] for w in tv["windows"]] == pytest.approx([w["tokens_per_s"] / fw[w["seen"]]
                                                                    for w in tv["windows"]])
    # the row is built from the trace as saved, steps rounded to 0.1 us (DecodeTrace.to_dict)
    assert tv["steady_tokens_per_s"] == pytest.approx(32 / sum(round(s, 7) for s in traces[2].step_seconds[32:]))
    assert tv["compress_calls"] > 0 and 0 < tv["compress_share"] < 1
    assert 16 <= tv["steady_held_min"] <= tv["steady_held_max"] < 16 + 8
    assert full["steady_held_max"] == 12 + 64 and ideal["steady_held_max"] == 15
    assert tv["peak_kv_bytes"] < full["peak_kv_bytes"] and tv["kv_vs_full"] < 1
    assert all("vs_full" in w for w in tv["windows"])


def test_bench_speed_cli_report_and_plot(tmp_path):
    from kvcompose.bench import cli  # the `kvcompose` script: library commands + bench
    from kvcompose.testing import save_tiny_chat_model

    model_dir = save_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "speed"
    assert cli.main(["bench", "speed", "--model", model_dir, "--methods", "tova", "streaming_llm", "--budget", "16",
                     "--interval", "8", "--new-tokens", "48", "--window", "8", "--kvpress-python", "none",
                     "--out", str(out)]) == 0
    data = json.loads((out / "speed.json").read_text())
    names = [r["name"] for r in data["rows"]]
    assert names[0].startswith("ideal") and names[1].startswith("full") and "tova" in names
    for r in data["rows"]:
        for key in ("vs_ideal", "vs_full", "steady_tokens_per_s", "compress_share", "peak_kv_bytes", "windows"):
            assert key in r
    tv = data["rows"][names.index("tova")]
    assert tv["compress_calls"] > 0 and tv["peak_kv_bytes"] < data["rows"][1]["peak_kv_bytes"]
    assert (out / "speed.png").stat().st_size > 1000
    md = (out / "speed.md").read_text()
    assert "| tova |" in md and "vs ideal" in md and "only the ratios are claimed" in md
    (out / "speed.md").unlink()
    assert cli.main(["bench", "report", str(out)]) == 0
    assert (out / "speed.md").exists()


def _fixture(tmp_path) -> Path:
    rows = [
        {"name": "ideal (sliding window 16, sdpa)", "kind": "ideal", "press": None, "batch": 1, "first_seen": 10,
         "prefill_seconds": 0.01, "step_seconds": [0.04] * 8, "held": [[10, 10], [18, 15]], "peak_kv_bytes": 100},
        {"name": "full (DynamicCache, sdpa)", "kind": "full", "press": None, "batch": 1, "first_seen": 10,
         "prefill_seconds": 0.01, "step_seconds": [0.1] * 8, "held": [[10, 10], [18, 18]], "peak_kv_bytes": 400},
        {"name": "DecodingPress(TOVAPress, interval 4)", "kind": "kvpress", "press": "tova", "interval": 4,
         "batch": 1, "first_seen": 10, "prefill_seconds": 0.01, "step_seconds": [0.05] * 8,
         "held": [[10, 10], [14, 16], [15, 16]], "peak_kv_bytes": 200, "error": None},
    ]
    p = tmp_path / "kvpress_speed.json"
    p.write_text(json.dumps({"versions": {"kvpress": "0.5.5", "transformers": "5.2.0"}, "rows": rows}))
    return p


def test_kvpress_json_parsing(tmp_path):
    res = json.loads(_fixture(tmp_path).read_text())
    traces = speed.kvpress_traces(res)
    assert [t["kind"] for t in traces] == ["ideal", "full", "kvpress"] and traces[2]["method"] == "tova"
    rows = speed.with_ratios([speed._row(t, 4, 0.5, "kvpress") for t in traces])
    assert rows[2]["vs_full"] == pytest.approx(2.0) and rows[2]["vs_ideal"] == pytest.approx(0.8)
    assert rows[1]["vs_ideal"] == pytest.approx(0.4)
    with pytest.raises(KVComposeError):
        speed.kvpress_traces({"no": "rows"})
    with pytest.raises(KVComposeError):
        speed.kvpress_traces({"rows": [{"name": "x"}]})


def test_bench_speed_merges_reused_kvpress_json(tmp_path):
    """--kvpress-json: kvpress's rows are merged and each analogue row gets kvpress's ratio and ours over it."""
    from kvcompose.bench import cli  # the `kvcompose` script: library commands + bench
    from kvcompose.testing import save_tiny_chat_model

    model_dir = save_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "speed"
    assert cli.main(["bench", "speed", "--model", model_dir, "--methods", "tova", "--budget", "16", "--interval", "8",
                     "--new-tokens", "24", "--window", "8", "--kvpress-json", str(_fixture(tmp_path)),
                     "--out", str(out)]) == 0
    data = json.loads((out / "speed.json").read_text())
    tv = next(r for r in data["rows"] if r["name"] == "tova")
    assert tv["kvpress_vs_full"] == pytest.approx(2.0)
    assert tv["vs_kvpress"] == pytest.approx(tv["vs_full"] / 2.0)
    assert "kvpress's own process" in (out / "speed.md").read_text()


def _kvpress_available() -> bool:
    if not KVPRESS_PYTHON.exists():
        return False
    return subprocess.run([str(KVPRESS_PYTHON), "-c", "import kvpress"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _kvpress_available(), reason="no .venv-kvpress with kvpress (see docs/kvpress.md)")
def test_kvpress_speed_runner(tmp_path):
    from kvcompose.testing import save_tiny_chat_model

    model_dir = save_tiny_chat_model(tmp_path / "model")
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps({"prompt_ids": list(range(3, 30))}))
    cmd = speed.kvpress_command(str(KVPRESS_PYTHON), prompt, tmp_path / "kp.json", new_tokens=24, budget=16,
                                presses={"tova": 8, "random": 8}, window=8, threads=1, model_dir=model_dir)
    proc, why = speed.start_kvpress(cmd, tmp_path / "kp.log")
    assert proc is not None, why
    res, why = speed.finish_kvpress(proc, tmp_path / "kp.json", why)
    assert res is not None, (why, (tmp_path / "kp.log").read_text()[-2000:])
    traces = speed.kvpress_traces(res)
    assert [t["kind"] for t in traces] == ["ideal", "full", "kvpress", "kvpress"]
    tv = traces[2]
    assert tv["error"] is None and len(tv["step_seconds"]) == 24
    assert tv["held"][-1][1] < 16 + 8 < tv["held"][0][1] + 8  # it compressed a 27-token cache to the budget
