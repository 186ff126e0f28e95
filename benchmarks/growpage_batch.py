#!/usr/bin/env python3
"""GrowPage vs Uniform at equal KV bytes, on a left-padded batch of requests of different lengths
(docs/allocation.md).

A batch of `--batch` GSM8K questions whose chat prompts have different lengths (picked at even quantiles
of the prompt lengths among `--pool` questions) is left-padded and teacher-forced *token by token* with
sampled full-cache reference traces (`make_traces(kind="sampled")`), through every cache in lockstep:
the full cache (the reference), Uniform R-KV at several budgets (compression every `--interval` decoded
tokens) and GrowPage over R-KV (events when a request's pages fill; its cap is `cap * B * budget` tokens
per layer and KV head). Token by token matters: GrowPage's events fall on page fills, between the chunk
boundaries of the chunked harness.

Per method: top-1 agreement and KL(full || method) over every (row, trace token), per-row KL, and the KV
memory: `cache.memory().total` (held bytes) after every step, averaged over the steps (the time average a
server pays), its peak, and the peak of the allocated buffers; compression events and their wall time.

    python benchmarks/growpage_batch.py --data path/to/gsm8k/test.jsonl --batch 4 --new-tokens 512 \\
        --uniform 64 96 128 192 256 --growpage 128 256 --out runs/growpage_batch
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompose import KVComposeCache, methods  # noqa: E402
from kvcompose.bench.fidelity import Trace, load_questions, make_traces  # noqa: E402
from kvcompose.traces import prompt_ids  # noqa: E402
from kvcompose.models import load_default_model  # noqa: E402


def pick_questions(tok, data: str, pool: int, offset: int, batch: int) -> list[dict]:
    """`batch` questions whose prompts span the range of lengths among `pool` questions (even quantiles)."""
    qs = load_questions(data, pool, offset)
    qs = sorted(qs, key=lambda q: len(prompt_ids(tok, q["question"])))
    idx = sorted({round(i * (len(qs) - 1) / max(1, batch - 1)) for i in range(batch)})
    return [qs[i] for i in idx]


def methods_to_run(args) -> dict:
    out = {"full": lambda: (methods.full(), None, args.interval)}
    for b in args.uniform:
        out[f"Uniform R-KV B={b}"] = lambda b=b: (methods.rkv(), b, args.interval)
    for b in args.uniform_fine:
        out[f"Uniform R-KV B={b} interval={args.page}"] = lambda b=b: (methods.rkv(), b, args.page)
    for b in args.growpage:
        out[f"GrowPage R-KV B={b}"] = lambda b=b: (methods.growpage(methods.rkv(), page=args.page, cap=args.cap,
                                                                      heads=args.heads), b, args.interval)
    return out


@torch.no_grad()
def run(model, traces: list[Trace], specs: dict, seed: int) -> dict:
    b = len(traces)
    plen = max(len(t.prompt_ids) for t in traces)
    pad = model.generation_config.pad_token_id or 0
    ids = torch.full((b, plen), pad, dtype=torch.long)
    mask = torch.zeros(b, plen, dtype=torch.long)
    for r, t in enumerate(traces):
        ids[r, plen - len(t.prompt_ids):] = torch.tensor(t.prompt_ids)
        mask[r, plen - len(t.prompt_ids):] = 1
    steps = min(len(t.trace_ids) for t in traces) - 1
    caches = {}
    for name, make in specs.items():
        pipe, budget, interval = make()
        caches[name] = KVComposeCache(model, pipe, budget=budget, interval=interval, seed=seed)
    stats = {name: {"kl": [[] for _ in range(b)], "top1": [[] for _ in range(b)], "held": [], "seconds": 0.0}
             for name in specs}
    logp = {}
    for name, cache in caches.items():
        t0 = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1).logits[:, -1]
        stats[name]["seconds"] += time.perf_counter() - t0
        logp[name] = torch.log_softmax(out.float(), -1)
    for i in range(steps + 1):
        ref = logp["full"]
        for name in specs:
            lp = logp[name]
            kl = (ref.exp() * (ref - lp)).sum(-1)
            top = (ref.argmax(-1) == lp.argmax(-1)).float()
            for r in range(b):
                stats[name]["kl"][r].append(float(kl[r]))
                stats[name]["top1"][r].append(float(top[r]))
        if i == steps:
            break
        x = torch.tensor([[t.trace_ids[i]] for t in traces])
        mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], 1)
        for name, cache in caches.items():
            t0 = time.perf_counter()
            out = model(input_ids=x, attention_mask=mask, past_key_values=cache).logits[:, -1]
            stats[name]["seconds"] += time.perf_counter() - t0
            logp[name] = torch.log_softmax(out.float(), -1)
            stats[name]["held"].append(cache.memory().total)
        if i % 64 == 0:
            print(f"  step {i}/{steps}", flush=True)
    rows = []
    for name, cache in caches.items():
        st = stats[name]
        mem = cache.memory()
        alloc = cache.pipeline.allocator
        kl_all = [x for r in st["kl"] for x in r]
        top_all = [x for r in st["top1"] for x in r]
        row = {"method": name, "budget": cache.budget, "interval": cache.interval,
               "top1": sum(top_all) / len(top_all), "kl": sum(kl_all) / len(kl_all),
               "kl_per_row": [sum(r) / len(r) for r in st["kl"]],
               "mean_held_bytes": sum(st["held"]) / len(st["held"]), "peak_held_bytes": max(st["held"]),
               "peak_allocated_bytes": mem.peak["allocated"], "full_bytes_end": mem.full_cache,
               "events": sum(layer.events for layer in cache.layers), "compress_seconds": cache.stats.compress_seconds,
               "seconds": st["seconds"], "tokens_scored": len(kl_all)}
        if hasattr(alloc, "cap_pages"):
            leaf = cache.pipeline.leaves.index(alloc)
            states = [layer.segment.blocks[leaf] for layer in cache.layers]
            row["pages_end_per_row"] = [sum(int(s["pages"][r]) for s in states) / len(states) for r in range(b)]
            for k in ("granted", "denied", "returned", "compressed"):
                row[k] = sum(s.get(k, 0) for s in states)
        rows.append(row)
    return {"rows": rows, "prompt_lengths": [len(t.prompt_ids) for t in traces], "steps": steps + 1, "batch": b}


def markdown(res: dict) -> str:
    mib = 2**20
    lines = ["| method | top-1 | KL (nats) | KL per request | mean KV held (MiB) | peak KV held (MiB) | "
             "peak allocated (MiB) | events |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if r["method"] == "full":
            continue
        per = " / ".join(f"{x:.3f}" for x in r["kl_per_row"])
        lines.append(f"| {r['method']} | {r['top1']:.4f} | {r['kl']:.4f} | {per} | {r['mean_held_bytes'] / mib:.2f} | "
                     f"{r['peak_held_bytes'] / mib:.2f} | {r['peak_allocated_bytes'] / mib:.2f} | {r['events']} |")
    full = next(r for r in res["rows"] if r["method"] == "full")
    lines.append(f"| full cache | 1 | 0 | | {full['mean_held_bytes'] / mib:.2f} | {full['peak_held_bytes'] / mib:.2f} | "
                 f"{full['peak_allocated_bytes'] / mib:.2f} | 0 |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("KVCOMPOSE_GSM8K"), help="GSM8K test.jsonl (default $KVCOMPOSE_GSM8K)")
    ap.add_argument("--batch", type=int, default=4, help="requests in the batch")
    ap.add_argument("--pool", type=int, default=24, help="questions the batch is picked from (by prompt length)")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=512, help="tokens per reference trace")
    ap.add_argument("--uniform", type=int, nargs="*", default=[64, 96, 128, 192, 256])
    ap.add_argument("--uniform-fine", type=int, nargs="*", default=[],
                    help="Uniform budgets compressed every --page tokens (GrowPage's event granularity)")
    ap.add_argument("--growpage", type=int, nargs="*", default=[128, 256])
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--cap", type=float, default=1.0)
    ap.add_argument("--heads", default="max", choices=["max", "mean"])
    ap.add_argument("--interval", type=int, default=64, help="Uniform's compression interval")
    ap.add_argument("--traces", default=None, help="JSON of reference traces: loaded if it exists, else written")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/growpage_batch")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    model, tok = load_default_model()
    if args.traces and os.path.exists(args.traces):
        traces = [Trace.from_dict(d) for d in json.load(open(args.traces))]
    else:
        qs = pick_questions(tok, args.data, args.pool, args.offset, args.batch)
        traces = make_traces(model, tok, qs, new_tokens=args.new_tokens, kind="sampled", seed=args.seed)
        if args.traces:
            json.dump([t.to_dict() for t in traces], open(args.traces, "w"))
    print(f"{len(traces)} traces, prompts {[len(t.prompt_ids) for t in traces]} tokens ({time.time() - t0:.0f}s)",
          flush=True)
    res = run(model, traces, methods_to_run(args), args.seed)
    res["command"] = "python benchmarks/growpage_batch.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res["ids"] = [t.id for t in traces]
    res["seconds"] = round(time.time() - t0)
    json.dump(res, open(os.path.join(args.out, "results.json"), "w"), indent=1)
    md = markdown(res)
    open(os.path.join(args.out, "table.md"), "w").write(md)
    print(md)
    return res


if __name__ == "__main__":
    main()
