"""benchmarks/fidelity_tables.py and the bootstrap intervals it rests on (kvcompose.bench.metrics)."""

import json
import os
import sys

import pytest
import torch

from kvcompose import KVComposeError
from kvcompose.bench.metrics import bootstrap_mean, bootstrap_ratio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import fidelity_tables  # noqa: E402


def test_bootstrap_mean_covers_the_mean_and_shrinks_with_prompts():
    g = torch.Generator().manual_seed(0)
    few = (torch.rand(8, generator=g) * 0.02).tolist()
    many = (torch.rand(128, generator=g) * 0.02).tolist()
    lo, hi = bootstrap_mean(few, [1] * 8)
    assert lo < sum(few) / 8 < hi
    lo2, hi2 = bootstrap_mean(many, [1] * 128)
    assert hi2 - lo2 < (hi - lo) * 0.6  # about 1/sqrt(16) as wide
    assert bootstrap_mean(few, [1] * 8, seed=3) == bootstrap_mean(few, [1] * 8, seed=3)
    # token-pooled: a prompt with twice the tokens weighs twice
    lo, hi = bootstrap_mean([1.0, 0.0], [1, 1], resamples=4000)
    assert lo == 0.0 and hi == 1.0
    with pytest.raises(KVComposeError):
        bootstrap_mean([1.0], [1, 2])


def test_paired_ratio_sees_a_uniform_improvement_that_unpaired_intervals_miss():
    g = torch.Generator().manual_seed(1)
    base = (torch.rand(32, generator=g) * 0.05 + 0.001).tolist()  # prompts differ a lot
    better = [0.8 * x for x in base]  # every prompt 20% better
    r, lo, hi = bootstrap_ratio(better, [1] * 32, base, [1] * 32)
    assert r == pytest.approx(0.8) and lo == pytest.approx(0.8) and hi == pytest.approx(0.8)
    a_lo, a_hi = bootstrap_mean(better, [1] * 32)
    b_lo, b_hi = bootstrap_mean(base, [1] * 32)
    assert a_hi > b_lo  # the unpaired intervals overlap


def _run(folder, rows):
    folder.mkdir()
    out = []
    for engine, method, budget, kls in rows:
        out.append({"engine": engine, "method": method, "budget": budget, "kind": "sampled",
                    "per_trace": [{"id": f"p{i}", "kl_mean": k, "top1": 1 - 10 * k} for i, k in enumerate(kls)]})
    (folder / "fidelity.json").write_text(json.dumps({"config": {"command": "kvcompose bench fidelity"}, "rows": out}))
    return str(folder)


def test_tables_verdicts(tmp_path, capsys):
    kvp = "kvpress 0.5.5 / transformers 5.2.0"
    base = [0.010, 0.020, 0.015, 0.030, 0.012, 0.018, 0.025, 0.011]
    scaled = lambda f: [f * x for x in base]  # noqa: E731
    run = _run(tmp_path / "a", [
        ("kvcompose", "h2o", 256, scaled(1.0)), ("kvcompose", "random_attention", 256, scaled(3.0)),
        ("kvcompose", "h2o+prompt", 256, scaled(0.6)),  # beats both parents
        ("kvcompose", "vase", 256, scaled(0.9)), ("kvcompose", "h2o+value", 256, [x * (1 + (-1) ** i * 0.2)
                                                                                  for i, x in enumerate(scaled(0.9))]),
        (kvp, "snapkv", 256, scaled(0.95)), (kvp, "tova", 256, scaled(1.2)),
    ])
    held = _run(tmp_path / "h", [("kvcompose", "h2o+prompt", 256, scaled(0.75)), (kvp, "snapkv", 256, scaled(1.0))])
    assert fidelity_tables.main(["--runs", run, "--heldout", held, "--target", "h2o+prompt", "--budgets", "256",
                                 "--out", str(tmp_path / "out")]) == 0
    comp = {r["composition"]: r for r in json.loads((tmp_path / "out" / "compositions.json").read_text())["rows"]}
    assert comp["h2o+prompt"]["verdict"] == "beats both" and comp["h2o+prompt"]["ratio"] == pytest.approx(0.6)
    assert comp["h2o+value"]["verdict"] == "tie"  # noisy, around the better parent (vase)
    target = json.loads((tmp_path / "out" / "target.json").read_text())["rows"]
    assert [(t["prompts"], t["press"], t["met"]) for t in target] == [("chosen", "snapkv", "yes"),
                                                                     ("held out", "snapkv", "no")]
    assert target[0]["ratio"] == pytest.approx(0.6 / 0.95)
    main = (tmp_path / "out" / "main.md").read_text()
    assert "| kvpress | snapkv |" in main and "[" in main


def test_leaders_choose_one_pipeline_for_every_budget(tmp_path):
    """Three budgets: `a` leads at 128 and 256 but trails at 512, `b` is at 0.65x kvpress's best everywhere: `b`
    is the choice (lowest worst ratio; the kvpress-snapkv emulation, lower still, is listed but not a
    candidate), the leaders table says who leads where, the target table says yes at every budget, and the
    composition table has a 512 column."""
    kvp = "kvpress 0.5.5 / transformers 5.2.0"
    base = [0.010, 0.020, 0.015, 0.030, 0.012, 0.018, 0.025, 0.011]
    sc = lambda f: [f * x for x in base]  # noqa: E731
    rows = []
    for b, a in ((128, 0.5), (256, 0.5), (512, 0.9)):
        rows += [("kvcompose", "a", b, sc(a)), ("kvcompose", "b", b, sc(0.65)), (kvp, "snapkv", b, sc(1.0)),
                 (kvp, "tova", b, sc(1.3)), ("kvcompose", "h2o", b, sc(1.0)), ("kvcompose", "snapkv", b, sc(1.1)),
                 ("kvcompose", "h2o+snapkv", b, sc(0.8)), ("kvcompose", "kvpress-snapkv", b, sc(0.4)),
                 ("kvcompose", "memory_hierarchy", b, sc(1e-5)),  # exact (its tiers keep every token): not ranked
                 ("kvcompose", "duo_attention", b, sc(0.3))]  # holds beyond the budget: not ranked
    run = _run(tmp_path / "r", rows)
    choice = tmp_path / "choice.json"
    assert fidelity_tables.main(["--runs", run, "--target", "b", "--out", str(tmp_path / "out"),
                                 "--choose", str(choice)]) == 0
    assert json.loads(choice.read_text())["target"] == "b"
    lead = (tmp_path / "out" / "leaders.md").read_text()
    assert "B=128: kvpress-snapkv leads (0.40x snapkv)" in lead and "| 128 | a | 0.50" in lead  # listed, not chosen
    assert "B=512: kvpress-snapkv leads" in lead and "| 512 | b | 0.65" in lead
    assert "**b** (worst ratio 0.65x" in lead
    for unranked in ("memory_hierarchy", "duo_attention"):
        assert unranked not in lead and unranked in (tmp_path / "out" / "main.md").read_text()
    target = (tmp_path / "out" / "target.md").read_text()
    assert "**yes**" in target and "at 3 of 3 budgets" in target
    comp = json.loads((tmp_path / "out" / "compositions.json").read_text())["rows"]
    assert {(r["composition"], r["budget"]) for r in comp} >= {("h2o+snapkv", 512)}
    assert "(n=" not in (tmp_path / "out" / "main.md").read_text()  # 8 prompts is every prompt of these rows
