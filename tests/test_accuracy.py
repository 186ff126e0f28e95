"""`kvcompose bench accuracy` (kvcompose.bench.accuracy): sampling with per-question seeds, statistics, the
resumable JSONL, the table and plots, a 2-process `accelerate launch` equal to one process, device_map."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcompose import KVComposeError, methods
from kvcompose.bench import cli
from kvcompose.bench import accuracy as acc

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "q.jsonl"
    rows = [{"question": f"Sam has {i} apples and buys {i + 2} more{' and more' * i}. How many?",
             "answer": f"{i}+{i + 2}\n#### {2 * i + 2}"} for i in range(5)]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    return str(p)


# ------------------------------------------------------------------------------------------ pieces
def test_wilson_interval_known_values():
    lo, hi = acc.wilson_interval(0.5, 10)
    assert math.isclose(lo, 0.2366, abs_tol=1e-4) and math.isclose(hi, 0.7634, abs_tol=1e-4)
    lo, hi = acc.wilson_interval(0.0, 30)
    assert lo == 0.0 and math.isclose(hi, 0.1135, abs_tol=1e-4)
    assert all(math.isnan(x) for x in acc.wilson_interval(0.5, 0))


def test_row_sampler_rows_are_independent_of_their_batch():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 50, generator=g) * 2
    seeds = [acc.row_seed(0, f"q{i}", 0) for i in range(3)]
    batch = acc.RowSampler(seeds, 0.8, 0.9)
    alone = acc.RowSampler(seeds[1:2], 0.8, 0.9)
    for _ in range(20):  # 20 decoding steps: each row draws from its own stream
        a = batch(None, scores).argmax(-1)
        b = alone(None, scores[1:2]).argmax(-1)
        assert a[1] == b[0]
    out = batch(None, scores)
    assert torch.isneginf(out).sum(-1).tolist() == [49, 49, 49] and (out.max(-1).values == 0).all()
    assert acc.row_seed(0, "q1", 0) != acc.row_seed(0, "q1", 1) != acc.row_seed(1, "q1", 0)
    with pytest.raises(KVComposeError):
        acc.RowSampler(seeds, 0.0)
    with pytest.raises(KVComposeError):
        batch(None, scores[:2])


def test_row_sampler_follows_the_distribution_and_top_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    counts = torch.zeros(4)
    sampler = acc.RowSampler([123], temperature=1.0, top_p=1.0)
    for _ in range(4000):
        counts[sampler(None, logits).argmax(-1)] += 1
    assert torch.allclose(counts / counts.sum(), probs[0], atol=0.03)
    nucleus = acc.RowSampler([7], temperature=1.0, top_p=0.75)  # keeps {0.5, 0.3}: mass 0.8 >= 0.75
    picks = {int(nucleus(None, logits).argmax(-1)) for _ in range(300)}
    assert picks == {0, 1}


def _rec(i, method, budget, sample, pred, correct, kv=100.0, n=10):
    return {"id": f"q{i}", "index": i, "method": method, "budget": budget, "sample": sample, "pred": pred,
            "correct": correct, "new_tokens": n, "hit_eos": True, "peak_kv_bytes": kv, "seconds": 0.5,
            "prompt_tokens": 5}


def test_merge_and_summarize():
    recs = [_rec(0, "full", None, 0, "1", True, kv=200), _rec(1, "full", None, 0, "2", False, kv=200),
            _rec(0, "h2o", 8, 0, "1", True), _rec(1, "h2o", 8, 0, "5", False),
            _rec(0, "h2o", 8, 0, "9", False)]  # a duplicate key: the first record wins
    merged = acc.merge_records(recs, ["full", "h2o"])
    assert len(merged) == 4 and [r["method"] for r in merged] == ["full", "full", "h2o", "h2o"]
    assert [r["agree_full"] for r in merged] == [None, None, True, False]
    rows = {(r["method"], r["budget"]): r for r in acc.summarize(merged)}
    h = rows[("h2o", 8)]
    assert h["accuracy"] == 0.5 and h["agreement"] == 0.5 and h["kv_vs_full"] == 0.5 and h["tokens_per_s"] == 20.0
    assert (h["ci_low"], h["ci_high"]) == acc.wilson_interval(0.5, 2)
    # two samples: accuracy is the mean over samples of the per-sample accuracy
    two = acc.summarize(acc.merge_records([_rec(0, "full", None, 0, "1", True), _rec(1, "full", None, 0, "1", True),
                                           _rec(0, "full", None, 1, "1", False), _rec(1, "full", None, 1, "1", True)]))
    assert two[0]["accuracy_per_sample"] == [1.0, 0.5] and two[0]["accuracy"] == 0.75 and two[0]["n_items"] == 2


def test_config_errors(tiny_dir, questions, tmp_path):
    base = dict(model=tiny_dir, data=questions, out=str(tmp_path / "x"), progress=False)
    for bad, msg in [(dict(samples=2), "temperature"), (dict(methods=["nope"]), "unknown method"),
                     (dict(budgets=[0], methods=["h2o"]), "positive"), (dict(batch_size=0), "batch-size"),
                     (dict(prompt="no placeholder"), "question"), (dict(top_p=0.0), "top-p")]:
        with pytest.raises(KVComposeError, match=msg):
            acc.run_accuracy(acc.AccuracyConfig(**base, **bad))


# ------------------------------------------------------------------------------------------ end to end
def _records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "records.jsonl").read_text().splitlines()]


def _strip(recs):
    return [{k: v for k, v in r.items() if k not in ("seconds", "rank")} for r in recs]


ARGS = ["--methods", "full", "h2o", "--budgets", "16", "--interval", "8", "--max-new-tokens", "24",
        "--batch-size", "2", "--no-progress"]


def test_cli_accuracy_end_to_end_and_resume(tiny_dir, questions, tmp_path, capsys):
    out = tmp_path / "acc"
    assert cli.main(["bench", "accuracy", "--model", tiny_dir, "--data", questions, "--limit", "4", *ARGS,
                     "--out", str(out)]) == 0
    recs = _records(out)
    assert len(recs) == 4 * 2 and {(r["method"], r["budget"]) for r in recs} == {("full", None), ("h2o", 16)}
    h2o = [r for r in recs if r["method"] == "h2o"]
    full = [r for r in recs if r["method"] == "full"]
    # compression really ran: a smaller peak than the full cache on the same batches
    assert all(h["peak_kv_bytes"] < f["peak_kv_bytes"] for h, f in zip(h2o, full))
    assert all(r["batch_rows"] == 2 and r["peak_kv_bytes"] == r["batch_peak_kv_bytes"] / 2 for r in recs)
    assert all(isinstance(r["agree_full"], bool) for r in h2o) and all(r["agree_full"] is None for r in full)
    data = json.loads((out / "accuracy.json").read_text())
    assert {(r["method"], r["budget"]) for r in data["rows"]} == {("full", None), ("h2o", 16)}
    assert data["n_records"] == 8 and "kvcompose bench accuracy" in data["command"]
    md = (out / "accuracy.md").read_text()
    assert "| h2o | 16 |" in md and "| full | - |" in md and "Wilson" in md
    assert (out / "accuracy_vs_budget.png").stat().st_size > 5000 and (out / "accuracy_vs_kv.png").exists()
    assert not list((out / "records").glob("part-*.jsonl"))  # merged into records.jsonl

    # rerun with one more budget and question: only the missing records are generated, old ones are kept
    capsys.readouterr()
    assert cli.main(["bench", "accuracy", "--model", tiny_dir, "--data", questions, "--limit", "5",
                     *ARGS[:5], "32", *ARGS[5:], "--out", str(out)]) == 0
    assert "8 records already" in capsys.readouterr().out
    again = _records(out)
    assert len(again) == 5 * 3
    old = {(r["id"], r["method"], r["budget"]): r for r in _strip(recs)}
    for r in _strip(again):
        k = (r["id"], r["method"], r["budget"])
        if k in old:
            assert {**r, "agree_full": None} == {**old[k], "agree_full": None}

    # an interrupted run: a cut line in a part file is ignored and its record redone
    (out / "records" / "part-0.jsonl").write_text('{"id": "q-0", "meth')
    assert cli.main(["bench", "accuracy", "--model", tiny_dir, "--data", questions, "--limit", "5",
                     *ARGS[:5], "32", *ARGS[5:], "--out", str(out)]) == 0
    assert len(_records(out)) == 15
    # other generation settings in the same folder are refused
    assert cli.main(["bench", "accuracy", "--model", tiny_dir, "--data", questions, *ARGS[:-3], "--max-new-tokens",
                     "30", "--batch-size", "2", "--no-progress", "--out", str(out)]) == 2
    assert "other settings" in capsys.readouterr().err
    (out / "accuracy.md").unlink()
    assert cli.main(["bench", "report", str(out)]) == 0 and (out / "accuracy.md").exists()


def test_sampled_records_do_not_depend_on_the_batch(tiny_dir, questions, tmp_path):
    runs = []
    for bs in (1, 3):
        out = tmp_path / f"s{bs}"
        cfg = acc.AccuracyConfig(model=tiny_dir, data=questions, limit=3, methods=["full"], samples=2,
                                 temperature=0.9, top_p=0.95, max_new_tokens=16, batch_size=bs, out=str(out),
                                 progress=False)
        acc.run_accuracy(cfg, log=lambda *a: None)
        runs.append({(r["id"], r["sample"]): r["text"] for r in _records(out)})
    assert runs[0] == runs[1]
    texts = runs[0]
    assert texts[("q-0", 0)] != texts[("q-0", 1)]  # two samples of one question differ


def test_no_questions_gives_the_error_with_both_ways(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KVCOMPOSE_GSM8K", raising=False)
    assert cli.main(["bench", "accuracy", "--model", tiny_dir, "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--data FILE.jsonl" in err and "--dataset" in err


def test_accelerate_two_processes_equal_one(tiny_dir, questions, tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo): batches sharded by rank, merged by rank 0."""
    pytest.importorskip("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["bench", "accuracy", "--model", tiny_dir, "--data", questions, "--methods", "full", "h2o", "--budgets",
            "16", "--interval", "8", "--max-new-tokens", "20", "--batch-size", "2", "--temperature", "0.8",
            "--samples", "2", "--threads", "1", "--no-progress"]
    assert cli.main([*args, "--out", str(tmp_path / "one")]) == 0  # one process, in this one
    # `--multi_gpu` is accelerate's multi-process (torchrun) launcher; with no GPU, kvcompose picks gloo on CPU
    two = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          "-m", "kvcompose.bench.cli", *args, "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "over 2 process(es)" in two.stdout
    a, b = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert {r["rank"] for r in b} == {0, 1} and len(a) == 5 * 2 * 2
    assert _strip(a) == _strip(b)
    ra = json.loads((tmp_path / "one" / "accuracy.json").read_text())["rows"]
    rb = json.loads((tmp_path / "two" / "accuracy.json").read_text())["rows"]
    keys = ["method", "budget", "accuracy", "agreement", "mean_new_tokens", "peak_kv_bytes"]
    assert [[r[k] for k in keys] for r in ra] == [[r[k] for k in keys] for r in rb]


def test_device_map_model_keeps_each_layer_kv_on_its_device(tiny_dir, questions, tmp_path):
    """Loaded with device_map (CPU only here: every layer on cpu); the cache builds each layer's buffers from
    the incoming keys, so on several GPUs each layer's KV is on its layer's device (see docs/scale.md)."""
    pytest.importorskip("accelerate")
    from kvcompose import KVComposeCache

    cfg = acc.AccuracyConfig(model=tiny_dir, data=questions, device_map="auto", methods=["h2o"], budgets=[16],
                             interval=8, max_new_tokens=24, limit=2, batch_size=2, out=str(tmp_path / "dm"),
                             progress=False)
    model, tok = acc._load(cfg, acc._Dist())
    cache = KVComposeCache(model, methods.preset("h2o", budget=16), budget=16, interval=8)
    res = acc.generate_batch(model, tok, ["Ann has 3 cats.", "Bob has 2 dogs and 1 cat."], cache, 24)
    assert len(res["texts"]) == 2 and max(res["new_tokens"]) > 8
    for i, layer in enumerate(cache.layers):
        assert layer.device == model.model.layers[i].self_attn.k_proj.weight.device
    assert cache.stats.compress_calls > 0
    acc.run_accuracy(cfg, log=lambda *a: None)
    assert len(_records(tmp_path / "dm")) == 2
    with pytest.raises(KVComposeError, match="needs --model"):
        acc._load(acc.AccuracyConfig(device_map="auto"), acc._Dist())
