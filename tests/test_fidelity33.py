"""benchmarks/fidelity33.py, issue 33's driver, end to end on a tiny chat model: two prompt sets, their
references, the cells at two budgets, the tables; a second run starts nothing; a cell that lost a batch is
the only job that runs again."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import fidelity33  # noqa: E402


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    """Nine character-tokenized questions, three of each of three lengths."""
    qs = [f"Ann has {i} red pens. How many?" for i in range(3)] + \
         [f"Bob has {i} blue cups and {i} mugs. Total?" for i in range(3)] + \
         [f"Cy owns {i} cats, {i} dogs. Pets?" for i in range(3)]
    p = tmp_path_factory.mktemp("data") / "q.jsonl"
    p.write_text("\n".join(json.dumps({"question": q, "answer": "#### 1"}) for q in qs))
    return str(p)


def test_driver_runs_every_stage_and_resumes(tiny_dir, questions, tmp_path, capsys):
    root, tables, keep = tmp_path / "root", tmp_path / "tables", tmp_path / "keep"
    args = ["--root", str(root), "--keep", str(keep), "--model", tiny_dir, "--data", questions, "--python", sys.executable, "--tokens", "24",
            "--budgets", "40", "48", "--interval", "8", "--group-size", "2", "--groups", "1", "--explore-groups", "0",
            "--select", "h2o", "snapkv", "--presses", "--target", "h2o", "--tables-out", str(tables),
            "--estimate", str(tmp_path / "none.json"), "--poll", "0.2"]
    assert fidelity33.main(["run", *args]) == 0
    ids = {s: {t["id"] for t in json.loads((root / s / "traces.json").read_text())["items"]} for s in ("reported", "heldout")}
    assert all(len(v) == 2 for v in ids.values()) and not ids["reported"] & ids["heldout"]
    main = (tables / "main.md").read_text()
    assert "| kvcompose | h2o |" in main and "| kvcompose | snapkv |" in main and "(n=" not in main
    heldout = {p.name for p in (root / "heldout" / "cells").glob("*.jsonl")}
    assert heldout == {"kvcompose__full__None.jsonl", "kvcompose__h2o__40.jsonl", "kvcompose__h2o__48.jsonl"}
    rows = {(r["method"], r["budget"]): r for r in json.loads((tables / "main.json").read_text())["rows"]}
    assert rows[("h2o", 40)]["kl"] > 1e-4 and rows[("h2o", 40)]["n"] == 2  # compressed, both prompts
    capsys.readouterr()

    assert fidelity33.main(["run", *args]) == 0  # everything done: nothing starts
    assert " start " not in capsys.readouterr().out

    cell = root / "reported" / "cells" / "kvcompose__snapkv__48.jsonl"
    first = json.loads(cell.read_text().splitlines()[0])
    cell.write_text(cell.read_text().splitlines()[0][:40])  # a run killed in the middle of the batch's line
    (keep / "reported" / "kvcompose__snapkv__48.json").unlink()  # ... before the driver kept it
    (tables / "target.md").unlink()
    assert fidelity33.main(["run", *args]) == 0
    out = capsys.readouterr().out
    assert [line.split(" start ")[1].split(" ")[0] for line in out.splitlines() if " start " in line] == [
        "reported:snapkv", "tables"]
    from kvcompose.bench.cells import _read_cell

    again = _read_cell(cell)[1]
    assert len(again) == 2 and again[first["id"]].kl == pytest.approx(first["kl"], abs=1e-6)

    # a fresh machine: ROOT gone, the kept record left. Nothing is scored again; the tables come from the record
    import shutil

    kept = {p.relative_to(keep): p.read_bytes() for p in keep.rglob("*.json")}
    assert keep / "reported" / "traces.json" in {keep / k for k in kept} and (keep / "heldout" / "run.json").exists()
    summary = json.loads((keep / "reported" / "kvcompose__snapkv__48.json").read_text())
    assert summary["per_trace"][first["id"]][0] == pytest.approx(sum(first["kl"]) / len(first["kl"]), rel=1e-9)
    scored = cell.read_text()
    full = (root / "reported" / "cells" / "kvcompose__full__None.jsonl").read_text()
    shutil.rmtree(root)
    shutil.rmtree(tables)
    assert fidelity33.main(["run", *args]) == 0
    out = capsys.readouterr().out
    assert [line.split(" start ")[1].split(" ")[0] for line in out.splitlines() if " start " in line] == [
        "tables"], out
    assert (tables / "main.md").read_text() == main
    assert (root / "reported" / "traces.json").read_bytes() == kept[keep.relative_to(keep) / "reported" / "traces.json"]

    # adopt: summaries of earlier tables' per_trace.json, only where a cell run here agrees with them
    per_trace = tables / "per_trace.json"
    h2o = keep / "reported" / "kvcompose__h2o__40.json"
    part = json.loads(h2o.read_text())
    part["per_trace"] = dict(list(part["per_trace"].items())[:1])  # a summary of a cell killed after one batch
    h2o.write_text(json.dumps(part))
    with pytest.raises(SystemExit, match="no complete cell"):  # nothing of ROOT's to compare
        fidelity33.main(["adopt", *args, "--per-trace", str(per_trace)])
    cell.parent.mkdir(parents=True, exist_ok=True)
    (cell.parent / "kvcompose__full__None.jsonl").write_text(full)  # KL ~0 on any traces: shows nothing
    with pytest.raises(SystemExit, match="no complete cell"):
        fidelity33.main(["adopt", *args, "--per-trace", str(per_trace)])
    d = json.loads(per_trace.read_text())
    cell.write_text(scored)  # ROOT's snapkv@48 cell as it was scored (a cell run again on the rebuilt traces)
    assert fidelity33.main(["adopt", *args, "--per-trace", str(per_trace)]) == 0
    back = json.loads((keep / "reported" / "kvcompose__h2o__40.json").read_text())
    assert back["per_trace"] == d["reported"]["kvcompose | h2o | 40"] and "adopted" in back
    (keep / "reported" / "kvcompose__h2o__40.json").unlink()
    d["reported"]["kvcompose | snapkv | 48"][first["id"]][0] += 1e-4  # another computation: refused
    per_trace.write_text(json.dumps(d))
    with pytest.raises(SystemExit, match="not the same computation"):
        fidelity33.main(["adopt", *args, "--per-trace", str(per_trace)])
    assert not (keep / "reported" / "kvcompose__h2o__40.json").exists()

    env = root / "environment.json"  # another transformers would mix its cells with these: refused
    env.write_text(json.dumps({**json.loads(env.read_text()), "transformers": "0.0"}))
    with pytest.raises(SystemExit, match="transformers 0.0"):
        fidelity33.main(["run", *args])


def test_plan_lists_every_cell(tiny_dir, questions, tmp_path, capsys):
    """Without a chosen target the held-out pipeline waits for `choose`; every preset, ported preset,
    composition and press has its job; duo_attention and lukv wait for their calibration."""
    assert fidelity33.main(["plan", "--root", str(tmp_path / "r"), "--keep", "", "--data", questions, "--python", sys.executable,
                            "--estimate", str(tmp_path / "none.json")]) == 0
    out = capsys.readouterr().out
    from kvcompose import methods

    for m in [*methods.PRESETS, *methods.PORTED]:
        if m != "full":
            assert f"reported:{m} " in out
    assert "reported:h2o+snapkv " in out and "explore:kvpress-snapkv " in out and "heldout:kvpress:tova " in out
    assert "calib-duo" in out and "calib-lukv" in out and "choose" in out
    assert "estimated CPU time" in out


def test_plan_prices_chunked_presses_at_their_own_cost(questions, tmp_path, capsys):
    """kvpress's presses fed in chunks (kvpress_fidelity.CHUNKABLE) cost `kvpress_chunks_per_token`, the others
    `kvpress_per_token`: 32 prompts x 1024 tokens x 3 budgets + 20 s."""
    import re

    est = tmp_path / "est.json"
    est.write_text(json.dumps({"kvpress_per_token": 0.02, "kvpress_chunks_per_token": 0.005}))
    assert fidelity33.main(["plan", "--root", str(tmp_path / "r"), "--keep", "", "--data", questions, "--python",
                            sys.executable, "--estimate", str(est)]) == 0
    out = capsys.readouterr().out
    minutes = {m: float(re.search(rf"reported:kvpress:{re.escape(m)}\s+\S+\s+([\d.]+) min", out).group(1))
               for m in ("knorm", "tova", "snapkv", "pyramidkv")}
    assert minutes["knorm"] == minutes["tova"] == pytest.approx((32 * 1024 * 0.005 * 3 + 20) / 60, abs=0.06)
    assert minutes["snapkv"] == minutes["pyramidkv"] == pytest.approx((32 * 1024 * 0.02 * 3 + 20) / 60, abs=0.06)


def test_profiled_presets_run_in_the_bench(tiny_dir, questions, tmp_path, monkeypatch):
    """benchmarks/profiled.py: duo_attention and lukv from `kvcompose calibrate --target duo|lukv` files named by
    $KVCOMPOSE_DUO_PROFILE / $KVCOMPOSE_LUKV_CURVES, run as bench methods; without the file, a clear error."""
    import profiled

    from kvcompose import KVComposeError

    from kvcompose.bench import cli

    with pytest.raises(KVComposeError, match="KVCOMPOSE_DUO_PROFILE"):
        monkeypatch.delenv("KVCOMPOSE_DUO_PROFILE", raising=False)
        profiled.duo_attention(64)
    for target in ("duo", "lukv"):
        assert cli.main(["calibrate", "--target", target, "--model", tiny_dir, "--data", questions, "--offset", "0",
                         "--n", "2", "--new-tokens", "32", "--out", str(tmp_path / f"{target}.json")]) == 0
    monkeypatch.setenv("KVCOMPOSE_DUO_PROFILE", str(tmp_path / "duo.json"))
    monkeypatch.setenv("KVCOMPOSE_LUKV_CURVES", str(tmp_path / "lukv.json"))
    out = tmp_path / "run"
    assert cli.main(["bench", "fidelity", "--model", tiny_dir, "--data", questions, "--new-tokens", "24", "--kinds",
                     "sampled", "--budgets", "40", "--interval", "8", "--short-budgets", "--free-gen-prompts", "0",
                     "--groups", "1", "--group-size", "2", "--batch-size", "2", "--no-recall",
                     "--pipelines", profiled.__file__, "--methods", "duo_attention", "lukv", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "fidelity.json").read_text())["rows"]}
    assert set(rows) == {"duo_attention", "lukv"} and all(r["n_traces"] == 2 and "error" not in r for r in rows.values())
    assert rows["duo_attention"]["pipeline"].startswith("duo_attention") and "lukv" in rows["lukv"]["pipeline"]
