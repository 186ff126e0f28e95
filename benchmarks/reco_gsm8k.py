#!/usr/bin/env python3
"""ReCo vs full chain-of-thought vs a fixed-budget method on GSM8K, end to end in `model.generate`.

For each question (batch size 1, greedy) and each method, in turn (so load changes on a shared machine hit
every method alike):

- `full`: the full cache (`KVComposeCache(model, methods.full())`, the same attention code path as the
  others, nothing evicted);
- `rkv`: R-KV at a fixed budget (`--fixed-budget`, default 128);
- `reco`: `methods.reco(tok, base=methods.rkv(), budget=--reco-budget)` with its default schedule,
  reflection penalty and confidence stopping (force mode), unless flags change them.

Per (question, method) it records: generated tokens (up to and excluding the end-of-turn token), wall time
of the `generate` call, the final number (last number of the text, `kvcompose.bench.fidelity.extract_answer`),
agreement with the full cache's number, exact match with GSM8K's `#### n`, peak held KV tokens (max over
layers), and for ReCo the step rewards, whether stopping fired, and the number of compression events.
Results go to `--out` (JSON lines, one per question and method) and a markdown summary is printed.

Usage:
    python benchmarks/reco_gsm8k.py --data /path/to/gsm8k/test.jsonl --n 2 --max-new-tokens 384 --out out.jsonl
    python benchmarks/reco_gsm8k.py --summarize out.jsonl      # the table again, from the JSON lines
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompose import KVComposeCache, methods  # noqa: E402
from kvcompose.bench.fidelity import extract_answer, gsm8k_answer, load_questions  # noqa: E402
from kvcompose.models import chat_inputs, load_default_model  # noqa: E402
from kvcompose.reco import DEFAULT_PENALTY_BANDS, ConfidenceReward, RewardBudgetSchedule  # noqa: E402

REFLECTION = re.compile(r"\b(wait|hmm|alternatively|let me (?:check|verify)|double-check)\b", re.I)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="GSM8K test.jsonl (never copied into the repo)")
    ap.add_argument("--summarize", metavar="JSONL", nargs="+",
                    help="only print the summary table of earlier --out files (questions every method finished)")
    ap.add_argument("--n", type=int, default=2, help="number of questions")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--methods", nargs="+", default=["full", "rkv", "reco"], choices=["full", "rkv", "reco"])
    ap.add_argument("--fixed-budget", type=int, default=128, help="R-KV's fixed budget")
    ap.add_argument("--reco-budget", type=int, default=256, help="ReCo's base budget (scaled by the reward)")
    ap.add_argument("--interval", type=int, default=64, help="decoded tokens between compression events")
    ap.add_argument("--low", type=float, default=0.3, help="schedule: reward at or below which the budget is full")
    ap.add_argument("--high", type=float, default=0.9, help="schedule: reward at or above which it is min-scale")
    ap.add_argument("--min-scale", type=float, default=0.5)
    ap.add_argument("--stop-k", type=int, default=2, help="0 = no early stopping")
    ap.add_argument("--stop-threshold", type=float, default=0.8)
    ap.add_argument("--no-force", action="store_true", help="stop outright (after an answer pattern) instead of forcing it")
    ap.add_argument("--no-penalty", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    ap.add_argument("--out", default=None, help="JSON lines output")
    return ap.parse_args(argv)


def held_peak(cache: KVComposeCache) -> int:
    """Peak held KV tokens of the largest layer, from the peak bytes the layers track."""
    return max((layer.peak_held_bytes // max(1, layer.bytes_per_token()) for layer in cache.layers), default=0)


def label(method: str, args: argparse.Namespace) -> str:
    """The name a method's records carry: its budget and any ablation flags (`rkv@128`, `reco@256-nostop`)."""
    if method == "rkv":
        return f"rkv@{args.fixed_budget}"
    if method == "reco":
        tags = ["-nostop" if not args.stop_k else "", "-nopenalty" if args.no_penalty else "",
                "-noforce" if args.no_force and args.stop_k else ""]
        return f"reco@{args.reco_budget}" + "".join(tags)
    return method


def run_one(model, tok, q: dict[str, Any], method: str, args: argparse.Namespace, eos: int) -> dict[str, Any]:
    inputs = chat_inputs(tok, q["question"])
    plen = inputs["input_ids"].shape[1]
    kw: dict[str, Any] = {}
    r = None
    if method == "full":
        cache = KVComposeCache(model, methods.full(), interval=args.interval)
    elif method == "rkv":
        cache = KVComposeCache(model, methods.rkv(), budget=args.fixed_budget, interval=args.interval)
    else:
        sched = RewardBudgetSchedule(args.reco_budget, low=args.low, high=args.high, min_scale=args.min_scale)
        r = methods.reco(
            tok, base=methods.rkv(), budget=sched, reward=ConfidenceReward(),
            bands=() if args.no_penalty else DEFAULT_PENALTY_BANDS,
            stop_k=args.stop_k or None, stop_threshold=args.stop_threshold, force_answer=not args.no_force,
        )
        cache = r.cache(model, interval=args.interval)
        kw = r.generate_kwargs()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=args.max_new_tokens, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=eos, **kw)
    wall = time.perf_counter() - t0
    gen = out[0, plen:].tolist()
    n = next((i for i, t in enumerate(gen) if t == eos), len(gen))
    text = tok.decode(gen[:n], skip_special_tokens=True)
    rec: dict[str, Any] = {
        "id": q["id"], "method": label(method, args), "tokens": n, "wall_s": wall, "answer": extract_answer(text),
        "gold": gsm8k_answer(q.get("answer")), "hit_max": n >= args.max_new_tokens,
        "peak_held_tokens": held_peak(cache), "events": cache.layers[0].events,
        "reflections": len(REFLECTION.findall(text)), "text": text,
    }
    if r is not None:
        r.tracker.finalize()
        rec["rewards"] = [round(x, 4) for x in r.tracker.rewards_of(0)]
        rec["stopped"] = 0 in (r.stopping.fired_at if r.stopping is not None else {})
        rec["budgets_seen"] = sorted({r.allocator.budget_for(x, args.reco_budget) for x in rec["rewards"]})
    return rec


def summarize(rows: list[dict[str, Any]], methods_: list[str]) -> str:
    by = {m: [r for r in rows if r["method"] == m] for m in methods_}
    full = {r["id"]: r for r in by.get("full", [])}
    lines = [
        "| method | N | mean gen. tokens | tokens vs full | mean wall s | wall vs full | agree w/ full | exact match | peak held KV tokens | hit max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ft = sum(r["tokens"] for r in by.get("full", [])) or None
    fw = sum(r["wall_s"] for r in by.get("full", [])) or None
    for m in methods_:
        rs = by[m]
        if not rs:
            continue
        tok = sum(r["tokens"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        agree = [r["answer"] == full[r["id"]]["answer"] for r in rs if r["id"] in full]
        em = [r["answer"] == r["gold"] for r in rs if r["gold"] is not None]
        lines.append(
            f"| {m} | {len(rs)} | {tok / len(rs):.1f} | {tok / ft:.2f}x | {wall / len(rs):.1f} | "
            f"{(wall / fw if fw else float('nan')):.2f}x | {sum(agree)}/{len(agree)} | {sum(em)}/{len(em)} | "
            f"{statistics.mean(r['peak_held_tokens'] for r in rs):.0f} | {sum(r['hit_max'] for r in rs)} |"
            if ft else f"| {m} | {len(rs)} | {tok / len(rs):.1f} | - | {wall / len(rs):.1f} | - | - | {sum(em)}/{len(em)} | - | - |"
        )
    reco = [r for m in methods_ if m.startswith("reco") for r in by[m] if "rewards" in r]
    if reco:
        rewards = [x for r in reco for x in r.get("rewards", [])]
        lines.append("")
        lines.append(
            f"ReCo runs: {sum(r.get('stopped', False) for r in reco)}/{len(reco)} stopped early; "
            f"{len(rewards)} steps, reward mean {statistics.mean(rewards):.3f} "
            f"(min {min(rewards):.3f}, max {max(rewards):.3f}); "
            f"reflection words: full {sum(r['reflections'] for r in by.get('full', []))}, "
            f"reco {sum(r['reflections'] for r in reco)}"
            if rewards else "ReCo: no completed steps"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.summarize:
        rows = [json.loads(line) for f in args.summarize for line in open(f) if line.strip()]
        names = list(dict.fromkeys(r["method"] for r in rows))
        ids = list(dict.fromkeys(r["id"] for r in rows))
        done = [i for i in ids if {r["method"] for r in rows if r["id"] == i} >= set(names)]
        rows = [r for r in rows if r["id"] in done]  # questions every method finished
        print(f"{len(done)} questions with all of {names}")
        print(summarize(rows, names))
        return
    if not args.data:
        raise SystemExit("--data is required (GSM8K test.jsonl)")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    qs = load_questions(args.data, args.n, args.offset)
    t0 = time.perf_counter()
    model, tok = load_default_model()
    eos = int(model.generation_config.eos_token_id)
    print(f"loaded model in {time.perf_counter() - t0:.1f}s; {len(qs)} questions; methods {args.methods}", flush=True)
    print("args: " + json.dumps(vars(args)), flush=True)
    rows: list[dict[str, Any]] = []
    out = open(args.out, "w") if args.out else None
    try:
        for i, q in enumerate(qs):
            for m in args.methods:
                rec = run_one(model, tok, q, m, args, eos)
                rows.append(rec)
                if out:
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                extra = f" stopped={rec['stopped']} rewards={rec['rewards']}" if m == "reco" else ""
                print(f"[{i + 1}/{len(qs)}] {q['id']} {m}: {rec['tokens']} tok, {rec['wall_s']:.1f}s, "
                      f"answer {rec['answer']} (gold {rec['gold']}), peak held {rec['peak_held_tokens']}{extra}",
                      flush=True)
    finally:
        if out:
            out.close()
    print(f"\ntotal {time.perf_counter() - t0:.0f}s\n")
    print(summarize(rows, list(dict.fromkeys(r["method"] for r in rows))))


if __name__ == "__main__":
    main()
