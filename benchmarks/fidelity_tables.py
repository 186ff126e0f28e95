#!/usr/bin/env python3
"""The 32-prompt fidelity tables of docs/results.md from the `fidelity.json` of `kvcompose bench fidelity` runs.

Reads the rows (engine, method, budget, per-trace top-1 / KL) of every run folder given, and writes, under
`--out` (a folder; JSON next to each Markdown table):

- `main.md/json`: every method (kvcompose presets, compositions, kvpress presses in DecodingPress) x budget:
  mean KL and top-1 with 95% percentile bootstrap intervals over prompts (seeded).
- `compositions.md/json`: each composition against its two parents (`benchmarks/compositions.py` PARENTS):
  the paired bootstrap ratio of mean KL to the better parent; "beats both" when the whole interval is below 1.
- `snapkv.md/json`: kvcompose's snapkv, the steps to kvpress's rule, kvpress's SnapKV as shipped and sorted.
- `target.md/json`: the chosen pipeline against kvpress's best decode press per budget, on the prompt set it
  was chosen on and on the held-out set (`--heldout` run folders), with paired ratio intervals; the target
  is met at a budget when the whole interval is at or below `--goal` (0.7).
- `leaders.md/json`: per budget, kvpress's best decode press and every kvcompose pipeline's KL ratio to it
  (the best first, with intervals), which pipeline leads where, and the one pipeline whose worst ratio over
  the budgets is lowest (`choose`: how the target is picked on the exploration set; `--choose FILE` writes
  its name there as JSON).

    python benchmarks/fidelity_tables.py --runs runs/main-kvc runs/main-kvp ... --heldout runs/held-kvc \\
        runs/held-kvp --target "h2o+prompt" --out docs/results/fidelity32
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from kvcompose.bench.metrics import bootstrap_mean, bootstrap_ratio  # noqa: E402
from kvcompose.bench.report import fmt  # noqa: E402

BUDGETS = [128, 256, 512]


def _engine(e: str) -> str:
    return "kvcompose" if e == "kvcompose" else "kvpress"


def load_rows(folders: list[str]) -> tuple[dict[tuple[str, str, int | None], dict], list[dict]]:
    """`{(engine, method, budget): row}` (engine "kvcompose" or "kvpress") and the runs' metadata. A folder is a
    `kvcompose bench fidelity` run (its `fidelity.json`, or its `cells/*.jsonl` when it has them) or a kept
    record of one (`run.json` and one summary per cell: `benchmarks/fidelity33.py --keep`)."""
    rows: dict[tuple[str, str, int | None], dict] = {}
    meta = []
    for f in folders:
        if (Path(f) / "run.json").exists() and not (Path(f) / "fidelity.json").exists():
            d = json.loads((Path(f) / "run.json").read_text())
            d["rows"] = kept_rows(Path(f))
        else:
            d = json.loads((Path(f) / "fidelity.json").read_text())
            if (Path(f) / "cells").is_dir():  # the cells are the record (processes writing into one folder at once
                d["rows"] = cell_rows(Path(f) / "cells")  # each rewrite fidelity.json with the rows they know)
        meta.append({"folder": Path(f).name, "command": d.get("config", {}).get("command", ""),
                     "versions": d.get("versions", {}), "selection": d.get("selection"),
                     "engines": sorted({r["engine"] for r in d["rows"]})})
        for r in d["rows"]:
            if "error" in r or r.get("kind") not in ("sampled",):
                continue
            rows[(_engine(r["engine"]), r["method"], r["budget"])] = r
    return rows, meta


def cell_row(path: Path) -> dict | None:
    """The row (engine, method, budget, per-trace KL and top-1) of one `cells/*.jsonl` file of a fidelity run: one
    line per finished trace, so an unfinished cell gives the prompts its finished batches scored; None if empty."""
    per, head = {}, None
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a killed run
            continue
        head = d
        per[d["id"]] = {"id": d["id"], "kl_mean": sum(d["kl"]) / len(d["kl"]), "top1": sum(d["top1"]) / len(d["top1"])}
    if head is None:
        return None
    return {"engine": head["engine"], "method": head["method"], "budget": head["budget"],
            "kind": head.get("kind", "sampled"), "per_trace": list(per.values())}


def cell_rows(cells: Path) -> list[dict]:
    """The rows of every `cells/*.jsonl` of a fidelity run (`cell_row`)."""
    return [r for path in sorted(cells.glob("*.jsonl")) if (r := cell_row(path)) is not None]


def kept_summary(row: dict) -> dict:
    """A row as the kept record stores it: `per_trace` as `{trace id: [mean KL, top-1]}` (what the tables read)."""
    return {k: row[k] for k in ("engine", "method", "budget", "kind")} | {
        "per_trace": {p["id"]: [p["kl_mean"], p["top1"]] for p in row["per_trace"]}}


def kept_rows(folder: Path) -> list[dict]:
    """The rows of a kept record (one `kept_summary` per `*.json` file but `run.json` and `traces.json`)."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        if path.name in ("run.json", "traces.json"):
            continue
        d = json.loads(path.read_text())
        rows.append({k: d[k] for k in ("engine", "method", "budget", "kind")} | {
            "per_trace": [{"id": i, "kl_mean": v[0], "top1": v[1]} for i, v in d["per_trace"].items()]})
    return rows


def _per(row: dict) -> dict[str, float]:
    return {p["id"]: p["kl_mean"] for p in row["per_trace"]}


def _per_top1(row: dict) -> dict[str, float]:
    return {p["id"]: p["top1"] for p in row["per_trace"]}


def stats(row: dict, seed: int = 0) -> dict[str, Any]:
    kl, t1 = _per(row), _per_top1(row)
    ids = sorted(kl)
    n = [1.0] * len(ids)  # equal trace lengths: the pooled mean is the mean of per-trace means
    return {"n": len(ids), "kl": sum(kl.values()) / len(ids), "kl_ci": bootstrap_mean([kl[i] for i in ids], n, seed=seed),
            "top1": sum(t1.values()) / len(ids), "top1_ci": bootstrap_mean([t1[i] for i in ids], n, seed=seed)}


def shared(a: dict, b: dict) -> list[str]:
    """The prompts both rows have (a row of an unfinished run holds the batches that finished)."""
    return sorted(set(_per(a)) & set(_per(b)))


def ratio(a: dict, b: dict, seed: int = 0) -> tuple[float, float, float]:
    """Paired bootstrap ratio of mean KL a / b over the prompts both rows have (`shared`)."""
    ka, kb = _per(a), _per(b)
    ids = shared(a, b)
    if not ids:
        raise SystemExit("rows compared on disjoint prompts")
    ones = [1.0] * len(ids)
    return bootstrap_ratio([ka[i] for i in ids], ones, [kb[i] for i in ids], ones, seed=seed)


FULL_N = 32  # prompts of a finished cell (main() sets the largest count of the rows); a cell with fewer says how many


def _cell(s: dict | None, key: str, digits: int) -> str:
    if s is None:
        return "-"
    lo, hi = s[f"{key}_ci"]
    n = f" (n={s['n']})" if s["n"] != FULL_N else ""
    return f"{fmt(s[key], digits)} [{fmt(lo, digits)}, {fmt(hi, digits)}]{n}"


def main_table(rows, budgets) -> tuple[str, list[dict]]:
    order: list[tuple[str, str]] = []
    for (e, m, _b) in rows:
        if (e, m) not in order and m != "full":
            order.append((e, m))
    order.sort(key=lambda x: (x[0] != "kvcompose", x[1]))
    out_rows = []
    kl_lines = ["| engine | method | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|---|" + "---|" * len(budgets)]
    t1_lines = list(kl_lines)
    for e, m in order:
        cells = {b: (stats(rows[(e, m, b)]) if (e, m, b) in rows else None) for b in budgets}
        if all(c is None for c in cells.values()):
            continue
        kl_lines.append(f"| {e} | {m} | " + " | ".join(_cell(cells[b], "kl", 4) for b in budgets) + " |")
        t1_lines.append(f"| {e} | {m} | " + " | ".join(_cell(cells[b], "top1", 3) for b in budgets) + " |")
        for b, c in cells.items():
            if c is not None:
                out_rows.append({"engine": e, "method": m, "budget": b, **c,
                                 "pipeline": rows[(e, m, b)].get("pipeline", "")})
    md = ["Mean KL(full ‖ method) in nats [95% percentile bootstrap interval over prompts]:", "", *kl_lines, "",
          "Top-1 agreement with the full cache [95% interval]:", "", *t1_lines, ""]
    return "\n".join(md), out_rows


def best_press(rows, budget: int, exclude=("snapkv(sorted)",)) -> tuple[str, dict] | None:
    cands = [(m, r) for (e, m, b), r in rows.items() if e == "kvpress" and b == budget and m not in exclude]
    return min(cands, key=lambda x: stats(x[1])["kl"]) if cands else None


def composition_table(rows, parents: dict[str, tuple[str, str]], budgets) -> tuple[str, list[dict]]:
    lines = ["| composition | parents | " + " | ".join(f"B={b}: KL / ÷ better parent [95%]" for b in budgets) + " |",
             "|---|---|" + "---|" * len(budgets)]
    out = []
    for comp, (pa, pb) in parents.items():
        cells = []
        for b in budgets:
            c, a, bb = (rows.get(("kvcompose", x, b)) for x in (comp, pa, pb))
            if c is None or a is None or bb is None:
                cells.append("-")
                continue
            better = a if stats(a)["kl"] <= stats(bb)["kl"] else bb
            r, lo, hi = ratio(c, better)
            verdict = "beats both" if hi < 1 and ratio(c, a if better is bb else bb)[2] < 1 else (
                "worse" if lo > 1 else "tie" if lo <= 1 <= hi else "beats the better parent only")
            n = len(shared(c, better))
            cells.append(f"{fmt(stats(c)['kl'], 4)} / {r:.2f} [{lo:.2f}, {hi:.2f}] {verdict}"
                         + (f" (n={n})" if n != FULL_N else ""))
            out.append({"composition": comp, "parents": [pa, pb], "budget": b, "kl": stats(c)["kl"],
                        "better_parent": pa if better is a else pb, "ratio": r, "ratio_ci": [lo, hi], "verdict": verdict})
        lines.append(f"| {comp} | {pa}, {pb} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", out


SNAPKV_ROWS = [
    ("kvcompose", "snapkv", "kvcompose snapkv (window 32, own positions, pooling over all, time order)"),
    ("kvcompose", "snapkv(window=16)", "window 16"),
    ("kvcompose", "kvpress-snapkv(own rope, time order)", "+ window sliced off after the softmax (kvpress's pooling edge)"),
    ("kvcompose", "kvpress-snapkv(time order)", "+ queries re-rotated to the newest position (kvpress)"),
    ("kvcompose", "kvpress-snapkv", "+ pooling in top-k slot order = kvpress's rule"),
    ("kvpress", "snapkv", "kvpress DecodingPress(SnapKVPress(16)) as shipped"),
    ("kvpress", "snapkv(sorted)", "kvpress, kept slots sorted back into time order"),
]


def snapkv_table(rows, budgets) -> tuple[str, list[dict]]:
    ref = {b: rows.get(("kvpress", "snapkv", b)) for b in budgets}
    lines = ["| engine | variant | " + " | ".join(f"B={b}: KL [95%] / ÷ kvpress" for b in budgets) + " |",
             "|---|---|" + "---|" * len(budgets)]
    out = []
    for e, m, label in SNAPKV_ROWS:
        cells = []
        for b in budgets:
            r = rows.get((e, m, b))
            if r is None:
                cells.append("-")
                continue
            s = stats(r)
            txt = _cell(s, "kl", 4)
            item = {"engine": e, "method": m, "budget": b, **s}
            if ref[b] is not None and not (e == "kvpress" and m == "snapkv"):
                q, lo, hi = ratio(r, ref[b])
                txt += f" / {q:.2f} [{lo:.2f}, {hi:.2f}]"
                item.update(ratio_to_kvpress=q, ratio_ci=[lo, hi])
            cells.append(txt)
            out.append(item)
        lines.append(f"| {e} | {label} (`{m}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", out


def target_table(sets: dict[str, dict], target: str, budgets, goal: float = 0.7) -> tuple[str, list[dict]]:
    lines = ["| prompts | budget | kvpress's best decode press | its KL [95%] | " + target + f" KL [95%] | ratio [95%] | ≤ {goal:g}x |",
             "|---|---|---|---|---|---|---|"]
    out = []
    for name, rows in sets.items():
        for b in budgets:
            mine = rows.get(("kvcompose", target, b))
            presses = [(m, r) for (e, m, bb), r in rows.items() if e == "kvpress" and bb == b and m != "snapkv(sorted)"]
            if not presses or mine is None:
                continue
            # kvpress's best press on the prompts it shares with the pipeline (the largest ratio: the strictest)
            best = max(presses, key=lambda x: ratio(mine, x[1])[0])
            r, lo, hi = ratio(mine, best[1])
            met = "yes" if hi <= goal else ("point estimate only" if r <= goal else "no")
            n = len(shared(mine, best[1]))
            others = ", ".join(f"{m} {ratio(mine, r)[0]:.2f}" for m, r in presses if m != best[0])
            lines.append(f"| {name} | {b} | {best[0]}{f' (ratio to {others})' if others else ''} | {_cell(stats(best[1]), 'kl', 4)} | {_cell(stats(mine), 'kl', 4)} | "
                         f"{r:.2f} [{lo:.2f}, {hi:.2f}] (n={n}) | {met} |")
            out.append({"prompts": name, "budget": b, "press": best[0], "press_kl": stats(best[1]), "pipeline": target,
                        "kl": stats(mine), "ratio": r, "ratio_ci": [lo, hi], "met": met})
    verdicts = {}
    for o in out:
        verdicts.setdefault(o["prompts"], []).append(o["met"] == "yes")
    lines.append("")
    for name, ok in verdicts.items():
        every = len(ok) == len(budgets) and all(ok)
        lines.append(f"On the {name} prompts: **{'yes' if every else 'no'}**, {target} is at or below {goal:g}x kvpress's best "
                     f"decode press with its whole interval at {sum(ok)} of {len(budgets)} budgets.")
    return "\n".join(lines) + "\n", out


def _point_ratio(a: dict, b: dict) -> float:
    ka, kb = _per(a), _per(b)
    ids = shared(a, b)
    return sum(ka[i] for i in ids) / max(sum(kb[i] for i in ids), 1e-300) if ids else float("inf")


# Pipelines whose held memory the budget does not bound, measured on the exploration set (peak KV bytes of the
# first prompt against a budget-bounded pipeline's 8.8 / 14.7 / 26.5 MB at B = 128 / 256 / 512):
HOLDS_BEYOND_BUDGET = {
    "duo_attention": "its retrieval heads (half of all) keep every token: 29.9 / 32.9 / 38.8 MB, 3.4x / 2.2x / 1.5x",
}


@functools.lru_cache(maxsize=None)
def keeps_every_token(name: str) -> bool:
    """A kvcompose preset whose tier store lets no token leave for good (`memory_hierarchy` without an evict share:
    its tiers keep every token and bring them back), so the budget does not bound what attention sees: listed in
    the main table, not ranked against kvpress's eviction presses."""
    from kvcompose import methods

    make = methods.PRESETS.get(name)
    return make is not None and not make().tier.evicts


def ranked(name: str) -> bool:
    """Whether a kvcompose pipeline is ranked against kvpress's presses at a budget: not one that keeps every token
    (`keeps_every_token`) nor one whose held memory the budget does not bound (`HOLDS_BEYOND_BUDGET`); both stay
    in the main table."""
    return name not in HOLDS_BEYOND_BUDGET and not keeps_every_token(name)


def leaders(rows, budgets) -> dict[str, Any]:
    """Per budget, every kvcompose pipeline's point ratio of mean KL to kvpress's best decode press on the prompts
    they share (the press giving the largest ratio: the strictest); and the pipeline whose worst ratio over
    `budgets` is lowest (only pipelines with a row at every budget, not the `kvpress-*` emulations of kvpress's
    rule). Only `ranked` pipelines are ranked. `{"by_budget": {b: [(name, ratio, press),
    ...] best first}, "choice": name or None, "worst": {name: worst ratio}}`."""
    by_budget: dict[int, list] = {}
    for b in budgets:
        presses = [(m, r) for (e, m, bb), r in rows.items() if e == "kvpress" and bb == b and m != "snapkv(sorted)"]
        mine = [(m, r) for (e, m, bb), r in rows.items() if e == "kvcompose" and bb == b and m != "full"
                and ranked(m)]
        if not presses:
            continue
        scored = []
        for m, r in mine:
            press, q = max(((pm, _point_ratio(r, pr)) for pm, pr in presses), key=lambda x: x[1])
            scored.append((m, q, press))
        by_budget[b] = sorted(scored, key=lambda x: x[1])
    worst: dict[str, float] = {}
    if by_budget and len(by_budget) == len(budgets):
        # kvpress's own SnapKV rule rebuilt from kvcompose blocks (benchmarks/snapkv_kvpress.py) is not a candidate
        names = set.intersection(*({m for m, _, _ in v if not m.startswith("kvpress-")} for v in by_budget.values()))
        worst = {m: max(q for v in by_budget.values() for mm, q, _ in v if mm == m) for m in names}
    return {"by_budget": by_budget, "choice": min(worst, key=worst.get) if worst else None, "worst": worst}


def leaders_table(rows, budgets, top: int = 8) -> tuple[str, list[dict]]:
    """`leaders` as Markdown: per budget the `top` pipelines with paired bootstrap intervals, then the choice."""
    res = leaders(rows, budgets)
    lines = ["| budget | kvcompose pipeline | KL ÷ kvpress's best [95%] | that press |", "|---|---|---|---|"]
    out = []
    for b, scored in res["by_budget"].items():
        for m, _, press in scored[:top]:
            q, lo, hi = ratio(rows[("kvcompose", m, b)], rows[("kvpress", press, b)])
            lines.append(f"| {b} | {m} | {q:.2f} [{lo:.2f}, {hi:.2f}] | {press} |")
            out.append({"budget": b, "pipeline": m, "press": press, "ratio": q, "ratio_ci": [lo, hi]})
    lines.append("")
    for b, scored in res["by_budget"].items():
        if scored:
            lines.append(f"- B={b}: {scored[0][0]} leads ({scored[0][1]:.2f}x {scored[0][2]}).")
    if res["choice"]:
        c = res["choice"]
        lines.append(f"- One pipeline for every budget: **{c}** (worst ratio {res['worst'][c]:.2f}x over B="
                     + ", ".join(map(str, budgets)) + ").")
    out.append({"choice": res["choice"], "worst": res["worst"]})
    return "\n".join(lines) + "\n", out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", required=True, help="run folders on the chosen prompts")
    p.add_argument("--heldout", nargs="*", default=[], help="run folders on the held-out prompts")
    p.add_argument("--target", default=None, help="the composition to compare with kvpress's best press")
    p.add_argument("--label", default="chosen", help="name of the --runs prompt set in the target table")
    p.add_argument("--budgets", nargs="+", type=int, default=BUDGETS)
    p.add_argument("--target-budgets", nargs="+", type=int, default=None,
                   help="budgets of the target and leaders tables (default: --budgets)")
    p.add_argument("--goal", type=float, default=0.7, help="the target ratio to kvpress's best press (default 0.7)")
    p.add_argument("--choose", default=None,
                   help="write the pipeline with the lowest worst ratio over the target budgets to this JSON file")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from compositions import PARENTS

    global FULL_N
    rows, meta = load_rows(args.runs)
    FULL_N = max((len(r["per_trace"]) for r in rows.values()), default=FULL_N)
    tb = args.target_budgets or args.budgets
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    md, data = main_table(rows, args.budgets)
    written["main"] = (md, data)
    md, data = composition_table(rows, PARENTS, args.budgets)
    written["compositions"] = (md, data)
    md, data = snapkv_table(rows, args.budgets)
    written["snapkv"] = (md, data)
    md, data = leaders_table(rows, tb)
    written["leaders"] = (md, data)
    if args.choose:
        choice = leaders(rows, tb)["choice"]
        Path(args.choose).write_text(json.dumps({"target": choice, "budgets": tb, "runs": [m["folder"] for m in meta]}))
    if args.target:
        sets = {args.label: rows}
        if args.heldout:
            sets["held out"], hmeta = load_rows(args.heldout)
            meta += hmeta
        md, data = target_table(sets, args.target, tb, args.goal)
        written["target"] = (md, data)
    sets = {args.label: rows} | ({"held out": load_rows(args.heldout)[0]} if args.heldout else {})
    (out / "per_trace.json").write_text(json.dumps(
        {name: {f"{e} | {m} | {b}": {p["id"]: [round(p["kl_mean"], 6), round(p["top1"], 5)] for p in r["per_trace"]}
                for (e, m, b), r in rs.items()} for name, rs in sets.items()}, indent=0))
    for name, (md, data) in written.items():
        (out / f"{name}.md").write_text(md)
        (out / f"{name}.json").write_text(json.dumps({"runs": meta, "rows": data}, indent=1))
        print(f"## {name}\n\n{md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
