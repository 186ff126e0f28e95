"""The `kvcompose` command line on a tiny random chat model saved as a Hugging Face directory."""

import json

import pytest

from kvcompose.bench import cli  # the `kvcompose` script: library commands + bench
from kvcompose.bench import run as bench_run


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "q.jsonl"
    rows = [{"question": f"Sam has {i} apples and buys {i + 2} more{' and more' * i}. How many?",
             "answer": f"{i}+{i + 2}\n#### {2 * i + 2}"} for i in range(6)]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    return str(p)


def test_help_and_methods(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert cli.main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in ["full", "streaming_llm", "h2o", "snapkv", "tova", "knorm", "rkv", "random_attention", "vase"]:
        assert name in out
    assert cli.main(["generate", "--method", "no_such_method"]) == 2  # argparse's one-line error, exit code 2


def test_generate_compare(tiny_dir, capsys):
    code = cli.main(["generate", "--model", tiny_dir, "--question", "Ann has 3 cats and 4 dogs. How many pets?",
                     "--method", "h2o", "--budget", "16", "--interval", "8", "--max-new-tokens", "40", "--compare",
                     "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "=== full cache ===" in out and "=== h2o B=16 ===" in out
    assert "tokens held" in out and "side by side" in out and "tokens/s" in out


def test_generate_from_data_and_bad_budget(tiny_dir, questions, capsys):
    assert cli.main(["generate", "--model", tiny_dir, "--data", questions, "--index", "2", "--method", "streaming_llm",
                     "--budget", "16", "--interval", "8", "--max-new-tokens", "12", "--no-progress"]) == 0
    assert "Sam has 2 apples" in capsys.readouterr().out
    # VaSE at budget 8: its protectors cannot fit -> a clear error, exit code 2
    assert cli.main(["generate", "--model", tiny_dir, "--method", "snapkv", "--budget", "8", "--no-progress"]) == 2
    assert "budget" in capsys.readouterr().err


FAKE_KVPRESS = """
import argparse, json
p = argparse.ArgumentParser()
for a in ["--traces", "--out", "--interval", "--model-dir", "--threads", "--max-items"]:
    p.add_argument(a)
p.add_argument("--budgets", nargs="+")
p.add_argument("--presses", nargs="+", default=["tova"])
a = p.parse_args()
items = json.load(open(a.traces))["items"]
n = len(items[0]["trace_ids"])
res = {p: {b: {"top1": 0.5, "kl_mean": 0.25, "ppl_ratio": 1.5, "kl_curve": [0.25] * n, "max_held_tokens": int(b),
               "n_steps": n, "seconds": 1.0} for b in a.budgets} for p in a.presses}
cfg = {"n_items": len(items), "n_steps": sum(len(i["trace_ids"]) for i in items)}
json.dump({"versions": {"kvpress": "0.5.5", "transformers": "5.2.0"}, "config": cfg, "results": res}, open(a.out, "w"))
"""


def test_bench_fidelity_small(tiny_dir, questions, tmp_path):
    import sys

    out = tmp_path / "fid"
    fake = tmp_path / "fake_kvpress.py"
    fake.write_text(FAKE_KVPRESS)
    code = cli.main(["bench", "fidelity", "--model", tiny_dir, "--data", questions, "--n-prompts", "1",
                     "--new-tokens", "40", "--kinds", "sampled", "worked", "--methods", "full", "h2o", "streaming_llm",
                     "--budgets", "24", "--interval", "8", "--free-gen-prompts", "2", "--free-gen-tokens", "12",
                     "--free-gen-budgets", "24", "--kvpress-python", sys.executable, "--kvpress-script", str(fake),
                     "--kvpress-presses", "tova", "--kvpress-max-steps", "16", "--short-budgets", "24",
                     "--short-tokens", "16", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "fidelity.json").read_text())
    rows = {(r["method"], r["budget"], r["kind"]): r for r in data["rows"]}
    assert rows[("full", None, "sampled")]["kl_mean"] < 1e-6
    assert rows[("full", None, "worked")]["top1"] == 1.0
    assert rows[("h2o", 24, "sampled")]["max_held_tokens"] <= max(data["prompt_lengths"]) + 8
    assert len(data["free_generation"]) == 2
    kp = [r for r in data["rows"] if r["engine"].startswith("kvpress 0.5.5")]
    assert [(r["method"], r["budget"], r["kl_mean"]) for r in kp] == [("tova", 24, 0.25)]
    # kvcompose rows on exactly the tokens kvpress saw
    same = [r for r in data["rows"] if r["kind"] == kp[0]["kind"] and r["engine"] == "kvcompose"]
    assert {r["method"] for r in same} == {"full", "h2o", "streaming_llm"}  # short-regime rows matched too
    assert all(r["n_tokens"] == 16 for r in same)
    # rerun on the same references and kvpress results: identical numbers, nothing regenerated
    again = tmp_path / "again"
    assert cli.main(["bench", "fidelity", "--model", tiny_dir, "--data", questions, "--n-prompts", "1",
                     "--kinds", "sampled", "--methods", "h2o", "--budgets", "24", "--interval", "8",
                     "--free-gen-prompts", "0", "--traces", str(out / "traces.json"),
                     "--kvpress-json", str(out / "kvpress.json"), "--kvpress-max-steps", "16", "--short-budgets", "24",
                     "--short-tokens", "16", "--out", str(again)]) == 0
    redo = json.loads((again / "fidelity.json").read_text())
    pick = lambda d: [(r["engine"], r["kind"], r["top1"], r["kl_mean"]) for r in d["rows"]
                      if r["method"] in ("h2o", "tova") and r["kind"] != "worked"]
    assert pick(redo) == pick(data)
    md = (out / "fidelity.md").read_text()
    assert "| h2o |" in md and "B=24" in md
    assert (out / "fidelity_vs_budget.png").stat().st_size > 1000
    assert (out / "kl_along_trace_sampled.png").exists()
    assert len(json.loads((out / "traces.json").read_text())["items"][0]["trace_ids"]) == 40


def test_bench_fidelity_kvpress_missing(tiny_dir, questions, tmp_path):
    out = tmp_path / "fid2"
    assert cli.main(["bench", "fidelity", "--model", tiny_dir, "--data", questions, "--n-prompts", "1",
                     "--new-tokens", "16", "--kinds", "worked", "--methods", "h2o", "--budgets", "24", "--interval", "8",
                     "--free-gen-prompts", "0", "--kvpress-python", str(tmp_path / "no-venv" / "python"),
                     "--kvpress-kinds", "worked", "--short-budgets", "24", "--short-tokens", "8",
                     "--min-prompt-tokens", "90", "--out", str(out)]) == 0
    data = json.loads((out / "fidelity.json").read_text())
    assert data["prompt_lengths"] and min(data["prompt_lengths"]) >= 90  # long-prompt questions were selected
    assert [r["n_tokens"] for r in data["rows"]] == [8]  # the short regime scores the first 8 tokens only
    assert any("kvpress side-by-side skipped" in n for n in data["notes"])
    assert "skipped" in (out / "fidelity.md").read_text()


def test_bench_fidelity_needs_data(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCOMPOSE_GSM8K", str(tmp_path / "missing.jsonl"))  # set but absent: no default file
    assert bench_run.default_data_path() is None
    assert cli.main(["bench", "fidelity", "--model", tiny_dir, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "KVCOMPOSE_GSM8K" in err


def test_bench_speed_and_report(tiny_dir, tmp_path):
    out = tmp_path / "speed"
    assert cli.main(["bench", "speed", "--model", tiny_dir, "--methods", "h2o", "vase", "--budget", "16",
                     "--interval", "8", "--new-tokens", "48", "--window", "8", "--kvpress-python", "none",
                     "--out", str(out)]) == 0
    data = json.loads((out / "speed.json").read_text())
    names = [r["name"] for r in data["rows"]]
    assert names[0].startswith("ideal") and names[1].startswith("full (DynamicCache") and "h2o" in names
    h2o = data["rows"][names.index("h2o")]
    assert h2o["compress_calls"] > 0 and 0 < h2o["compress_share"] < 1
    full = data["rows"][1]
    assert h2o["kv_vs_full"] == pytest.approx(h2o["peak_kv_bytes"] / full["peak_kv_bytes"]) and h2o["kv_vs_full"] < 1
    assert h2o["vs_full"] == pytest.approx(h2o["steady_tokens_per_s"] / full["steady_tokens_per_s"])
    assert "| h2o |" in (out / "speed.md").read_text()
    (out / "speed.md").unlink()
    assert cli.main(["bench", "report", str(out)]) == 0
    assert (out / "speed.md").exists()
