#!/usr/bin/env python3
"""Share of decode time spent in compression events, and decode speed relative to the full cache, per preset.

For every method in `kvcompose.methods.PRESETS` this greedy-decodes `--new-tokens` tokens into a
`KVComposeCache(model, preset(), budget, interval)` and measures, in the same run:

- decode wall time (first to last generated token, prefill excluded; `kvcompose.bench.speed.measure_decode`);
- time inside compression events (the whole event: scoring, selection, tier store, compaction), from the
  cache's own counters `cache.stats.compress_seconds` / `compress_calls` (nothing is patched);
- compression share = compress time / decode time, and tokens/s as a ratio to the full cache.

The full cache runs first and last; its mean is the baseline and the drift between its two runs is
printed (the machine may be shared). Output: a Markdown table on stdout and JSON (+ .md) under `--out`.

    python benchmarks/compression_share.py                    # SmolLM2-135M (GGUF), budget 256, 1024 tokens
    python benchmarks/compression_share.py --tiny --new-tokens 128   # a tiny random model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompose import KVComposeCache, methods  # noqa: E402
from kvcompose.bench.speed import measure_decode  # noqa: E402


def time_compress(cache: KVComposeCache) -> KVComposeCache:
    """`cache` itself: every `KVComposeCache` now times its compression events in `cache.stats`
    (`compress_seconds`, `compress_calls`), which `measure_decode` reads. Kept for the scripts that call it."""
    return cache


def load(tiny: bool, data: str, index: int, device: torch.device):
    if tiny:
        from kvcompose.testing import tiny_model

        model = tiny_model("llama", layers=4, heads=8, kv_heads=2, head_dim=32, vocab=256).to(device)
        ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(0)).to(device)
        return model, ids, "tiny llama (4 layers, 8 heads, 2 KV heads, head dim 32; random weights)"
    from kvcompose.bench.fidelity import load_questions
    from kvcompose.models import chat_inputs, load_default_model

    model, tok = load_default_model()
    model = model.to(device)
    q = load_questions(data, 1, offset=index)[0]
    ids = chat_inputs(tok, q["question"], device=device)["input_ids"]
    return model, ids, "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--methods", default=",".join(methods.PRESETS), help="comma-separated PRESETS names")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2")
    ap.add_argument("--data", default=os.environ.get("KVCOMPOSE_GSM8K"), help="JSONL with a 'question' field (default: $KVCOMPOSE_GSM8K)")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="docs/results", help="directory for compression_share_<device>.json/.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    names = [n for n in args.methods.split(",") if n]
    unknown = [n for n in names if n not in methods.PRESETS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {sorted(methods.PRESETS)}")

    model, ids, model_name = load(args.tiny, args.data, args.index, dev)
    print(f"{model_name}; prompt {ids.shape[1]} tokens; {args.new_tokens} new; budget {args.budget}, "
          f"interval {args.interval}; {args.threads} thread(s) on {dev}", flush=True)

    def run(name: str):
        pipe = methods.preset(name, budget=None if name == "full" else args.budget)
        budget = None if name == "full" else args.budget
        cache = time_compress(KVComposeCache(model, pipe, budget, interval=args.interval))
        t0 = time.perf_counter()
        res = measure_decode(model, ids, cache, args.new_tokens, name=name)
        row = res.to_dict()
        row["wall_s"] = time.perf_counter() - t0
        row["loadavg_1min_after"] = os.getloadavg()[0]  # other processes on a shared machine skew tokens/s
        row["pipeline"] = repr(pipe)
        print(f"{name:18s} {res.tokens_per_s:8.2f} tok/s  compress {res.compress_seconds:7.2f} s in "
              f"{res.compress_calls:4d} calls = {100 * res.compress_share:5.1f}% of {res.decode_seconds:7.2f} s decode",
              flush=True)
        return row

    rows, errors = {}, {}
    full_runs = [run("full")]
    for name in names:
        if name == "full":
            continue
        try:
            rows[name] = run(name)
        except Exception as exc:  # keep going; report it
            errors[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name:18s} FAILED {errors[name]}", flush=True)
    full_runs.append(run("full"))
    base = sum(r["tokens_per_s"] for r in full_runs) / len(full_runs)
    drift = full_runs[1]["tokens_per_s"] / full_runs[0]["tokens_per_s"] - 1

    table = ["| method | tokens/s | ratio vs full | compress share of decode | compress calls | ms per call | peak KV (MiB) | load avg |",
             "|---|---|---|---|---|---|---|---|"]
    fk = max(r["peak_kv_bytes"] for r in full_runs)
    fl = "/".join(f"{r['loadavg_1min_after']:.1f}" for r in full_runs)
    table.append(f"| full (mean of 2 runs) | {base:.2f} | 1.00 | - | 0 | - | {fk / 2**20:.1f} | {fl} |")
    for name, r in rows.items():
        ms = 1e3 * r["compress_seconds"] / r["compress_calls"] if r["compress_calls"] else float("nan")
        table.append(f"| {name} | {r['tokens_per_s']:.2f} | {r['tokens_per_s'] / base:.2f} | "
                     f"{100 * r['compress_share']:.1f}% | {r['compress_calls']} | {ms:.1f} | "
                     f"{r['peak_kv_bytes'] / 2**20:.1f} | {r['loadavg_1min_after']:.1f} |")
    for name, e in errors.items():
        table.append(f"| {name} | failed: {e} | | | | | | |")
    meta = {
        "model": model_name, "device": str(dev), "threads": args.threads, "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "prompt_tokens": int(ids.shape[1]), "new_tokens": args.new_tokens,
        "budget": args.budget, "interval": args.interval, "full_tokens_per_s": [r["tokens_per_s"] for r in full_runs],
        "full_drift": drift, "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    md = "\n".join(table)
    print(json.dumps(meta, indent=1))
    print(f"full cache drift between its first and last run: {100 * drift:+.1f}%")
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = dev.type + ("_tiny" if args.tiny else "")
    (out / f"compression_share_{tag}.json").write_text(
        json.dumps({"meta": meta, "full": full_runs, "rows": rows, "errors": errors}, indent=1))
    (out / f"compression_share_{tag}.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
