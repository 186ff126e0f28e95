#!/usr/bin/env python3
"""What batched teacher forcing saves: cost per prompt of `kvcompose bench fidelity` with one trace at a time
(`evaluate_trace`, today's `--batch-size 1`) against batches (`evaluate_batch`), and the same for kvpress's
`DecodingPress` (one trace vs a batch of equal-length prompts, `evaluate_press_batch`), measured in one
process on the same traces, interleaved (single, batch, single, ...), with the 1-minute load average noted.

CPU seconds per prompt (`time.process_time`, what the run costs the machine whatever else runs on it) and
wall seconds per prompt are both reported; ratios are against the single-trace run of the same round, and
against the single run plus its own full-cache reference (`_reference`, which the single-trace bench recomputes
in every cell once 32 long traces overflow its 1.5 GB cache). `--direct` adds the batch scored the way it was
before issue 33 (the references' log-probs recomputed per chunk, row by row); `--profile` writes the top of a
cProfile of one single run and one batch to OUT.profile.txt.

    KVCOMPOSE_GSM8K=... python benchmarks/fidelity_cost.py --traces runs/traces_chosen.json --batch 8 \\
        --rounds 2 --out docs/results/fidelity_cost
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvcompose import KVComposeCache  # noqa: E402
from kvcompose.bench.common import load_model, versions  # noqa: E402
from kvcompose.methods import preset  # noqa: E402
from kvcompose.bench.fidelity import (  # noqa: E402
    Trace, _reference, clear_reference_cache, evaluate_batch, evaluate_trace, hidden_references,
)


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else float("nan")


def _timed(fn):
    c0, w0, l0 = time.process_time(), time.perf_counter(), _load()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0, (l0 + _load()) / 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", required=True, help="traces.json of kvcompose bench fidelity (equal prompt lengths "
                   "for the first --batch traces, as --groups selects them)")
    p.add_argument("--method", default="snapkv")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="traces in the batch (default 8)")
    p.add_argument("--single", type=int, default=2, help="traces run one at a time per round (default 2)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kvpress", action="store_true", help="also kvpress's DecodingPress(SnapKVPress(16))")
    p.add_argument("--one-token", action="store_true", help="also kvcompose one token per forward (chunk 1)")
    p.add_argument("--tokens", type=int, default=0, help="score the first N trace tokens of each trace (0 = all)")
    p.add_argument("--direct", action="store_true", help="also the batch scored the pre-issue-33 way (direct)")
    p.add_argument("--profile", action="store_true", help="write OUT.profile.txt (cProfile, top entries)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True, help="output path without suffix (.json and .md are written)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model()
    items = [Trace.from_dict(d) for d in json.loads(Path(args.traces).read_text())["items"]][: args.batch]
    if args.tokens:
        items = [Trace(**{**t.to_dict(), "id": f"{t.id}[:{args.tokens}]", "trace_ids": t.trace_ids[: args.tokens]})
                 for t in items]
    if len({len(t.prompt_ids) for t in items}) != 1:
        sys.exit("the first --batch traces must have one prompt length (kvpress cannot batch padding)")
    refs = hidden_references(model, items, batch_size=len(items))
    for r in refs:  # the scoring statistics, computed once per trace (saved with --references in the bench)
        r.reference_stats(model)
    pipe = preset(args.method, budget=args.budget)
    make = lambda: KVComposeCache(model, pipe, budget=args.budget)  # noqa: E731
    rows = []

    def record(engine, mode, n, cpu, wall, load):
        rows.append({"engine": engine, "mode": mode, "prompts": n, "cpu_s_per_prompt": cpu / n,
                     "wall_s_per_prompt": wall / n, "load1": round(load, 2)})
        print(f"{engine:10} {mode:28} {n} prompts: {cpu / n:7.1f} CPU s/prompt {wall / n:7.1f} wall s/prompt "
              f"(load {load:.1f})", flush=True)

    for r in range(args.rounds):
        clear_reference_cache()
        for t in items[: args.single]:  # today's path, chunked; its full-cache reference (cached per process
            # and reused by every method) is timed apart, as the batch's references are
            _, cpu, wall, load = _timed(lambda t=t: _reference(model, t))
            record("kvcompose", "references, single", 1, cpu, wall, load)
            _, cpu, wall, load = _timed(lambda t=t: evaluate_trace(model, t, make()))
            record("kvcompose", "single (chunk = interval)", 1, cpu, wall, load)
        _, cpu, wall, load = _timed(lambda: evaluate_batch(model, items, make, references=refs))
        record("kvcompose", f"batch of {len(items)} (chunk = interval)", len(items), cpu, wall, load)
        if args.direct:
            from kvcompose.bench import scoring

            head, scoring.linear_head = scoring.linear_head, lambda model: None
            _, cpu, wall, load = _timed(lambda: evaluate_batch(model, items, make, references=refs))
            scoring.linear_head = head
            record("kvcompose", f"direct: batch of {len(items)}, scored as before", len(items), cpu, wall, load)
        _, cpu, wall, load = _timed(lambda: [r.reference_stats(model) for r in
                                             hidden_references(model, items, batch_size=len(items))])
        record("kvcompose", f"references, batch of {len(items)}", len(items), cpu, wall, load)
        if args.one_token:
            _, cpu, wall, load = _timed(lambda: evaluate_trace(model, items[0], make(), chunk=1))
            record("kvcompose", "single (one token per forward)", 1, cpu, wall, load)
            _, cpu, wall, load = _timed(lambda: evaluate_batch(model, items, make, chunk=1, references=refs))
            record("kvcompose", f"batch of {len(items)} (one token per forward)", len(items), cpu, wall, load)
        if args.kvpress:
            from kvcompose.bench.kvpress_fidelity import evaluate_press_batch, make_press

            press = lambda: make_press("snapkv", args.budget)  # noqa: E731
            _, cpu, wall, load = _timed(lambda: evaluate_press_batch(model, items[:1], press(), refs[:1]))
            record("kvpress", "single", 1, cpu, wall, load)
            _, cpu, wall, load = _timed(lambda: evaluate_press_batch(model, items, press(), refs))
            record("kvpress", f"batch of {len(items)}", len(items), cpu, wall, load)

    def mean(engine, prefix):
        xs = [r for r in rows if r["engine"] == engine and r["mode"].startswith(prefix)]
        return {k: sum(r[k] for r in xs) / len(xs) for k in ("cpu_s_per_prompt", "wall_s_per_prompt", "load1")} if xs else None

    summary = {}
    for engine, single, batch in (("kvcompose", "single (chunk", "batch of"), ("kvpress", "single", "batch of")):
        s, b = mean(engine, single), mean(engine, batch)
        if s and b:
            summary[engine] = {"single": s, "batch": b, "cpu_ratio": b["cpu_s_per_prompt"] / s["cpu_s_per_prompt"],
                               "wall_ratio": b["wall_s_per_prompt"] / s["wall_s_per_prompt"]}
    s, ref, b = mean("kvcompose", "single (chunk"), mean("kvcompose", "references, single"), mean("kvcompose", "batch of")
    if s and ref and b:
        both = s["cpu_s_per_prompt"] + ref["cpu_s_per_prompt"]
        summary["kvcompose vs single + its reference"] = {"cpu_ratio": b["cpu_s_per_prompt"] / both}
    d = mean("kvcompose", "direct")
    if s and d:
        summary["kvcompose, scored as before issue 33"] = {"cpu_ratio": d["cpu_s_per_prompt"] / s["cpu_s_per_prompt"]}
    if args.one_token:
        s, b = mean("kvcompose", "single (one"), [r for r in rows if "one token" in r["mode"] and "batch" in r["mode"]]
        if s and b:
            summary["kvcompose one token per forward"] = {
                "single": s, "cpu_ratio": (sum(r["cpu_s_per_prompt"] for r in b) / len(b)) / s["cpu_s_per_prompt"]}
    if args.profile:
        import cProfile
        import io
        import pstats

        text = []
        for name, fn in (("single", lambda: evaluate_trace(model, items[0], make())),
                         (f"batch of {len(items)}", lambda: evaluate_batch(model, items, make, references=refs))):
            prof = cProfile.Profile()
            prof.enable()
            fn()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
            text.append(f"===== {name} (load {_load():.1f})\n{buf.getvalue()}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.profile.txt").write_text("\n".join(text))
    out = {"command": "python benchmarks/fidelity_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "versions": versions(), "method": args.method, "budget": args.budget, "batch": len(items),
           "trace_tokens": len(items[0].trace_ids), "prompt_tokens": len(items[0].prompt_ids), "threads": args.threads,
           "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(out, indent=1))
    md = [f"`{out['command']}`: {args.method} at B={args.budget}, {len(items)} traces of "
          f"{out['trace_tokens']} tokens (prompts {out['prompt_tokens']} tokens), {args.threads} thread(s).", "",
          "| engine | mode | prompts | CPU s / prompt | wall s / prompt | load (1 min) |", "|---|---|---|---|---|---|"]
    md += [f"| {r['engine']} | {r['mode']} | {r['prompts']} | {r['cpu_s_per_prompt']:.1f} | {r['wall_s_per_prompt']:.1f} "
           f"| {r['load1']} |" for r in rows]
    md += ["", "| engine | batch / single, CPU per prompt | batch / single, wall per prompt |", "|---|---|---|"]
    md += [f"| {e} | {v['cpu_ratio']:.3f} | {v.get('wall_ratio', float('nan')):.3f} |" for e, v in summary.items()]
    Path(f"{args.out}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
