#!/usr/bin/env python3
"""What the layer-ahead prefetch of the host tier hides, measured on CPU with a copy thread.

On a GPU the host tier copies every layer's host-held keys and values back to the device at every step, on a
side stream, and the prefetcher starts layer i+1's copy (and, after the last layer, the next step's layer 0)
while layer i computes. On CPU "host" and "device" are the same DRAM, so by default nothing is copied; with
`HostTier(copy_thread=True)` the tier really copies its tokens at every step, on a background thread that
stands in for the copy stream, and the prefetcher overlaps it exactly as it would on a GPU. This script times
decode steps of four caches holding the same tokens (a quarter in HBM, the rest in the host tier), interleaved
step by step so machine load hits all alike:

- `no_copy`:   HostTier(), the CPU default: the tier hands out its own copy (bookkeeping only, no transfer)
- `copy_la0`:  HostTier(copy_thread=True), Prefetcher(lookahead=0): every copy waited for when the layer needs it
- `copy_la1`:  the same, lookahead 1: the next layer's copy overlaps this layer's compute
- `copy_la2`:  lookahead 2

and reports `exposed = copy_la0 - no_copy` (the transfer the step waits for without prefetch) and, for each
lookahead, the share of it hidden: `(copy_la0 - copy_laK) / exposed`. Logits of the four are identical
(checked). The model is a random Llama of SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads, head dim 64,
float32): no download.

    python benchmarks/tiers_prefetch.py --tokens 4096 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompose import HostTier, KVComposeCache, Pipeline, Recency, TopK  # noqa: E402
from kvcompose.testing import tiny_model  # noqa: E402
from kvcompose.prefetch import Prefetcher  # noqa: E402


def _caches(model, budget: int, interval: int):
    def cache(copy: bool, lookahead: int):
        pipe = Pipeline(Recency(), TopK(), HostTier(copy_thread=copy), name="recency + host")
        return KVComposeCache(model, pipe, budget=budget, interval=interval, prefetcher=Prefetcher(lookahead))

    return {"no_copy": cache(False, 1), "copy_la0": cache(True, 0), "copy_la1": cache(True, 1),
            "copy_la2": cache(True, 2)}


@torch.no_grad()
def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model = tiny_model("llama", layers=args.layers, heads=9, kv_heads=3, head_dim=64, vocab=512, seed=0)
    budget = args.tokens // 4
    caches = _caches(model, budget, args.interval)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (1, args.tokens + args.steps + args.warmup + 1), generator=g)
    for c in caches.values():  # fill in chunks of the interval: each chunk ends in a compression event
        for s in range(0, args.tokens, args.interval):
            model(input_ids=ids[:, s : s + args.interval], past_key_values=c, use_cache=True, logits_to_keep=1)
    times = {k: [] for k in caches}
    logits = {k: [] for k in caches}
    names = list(caches)
    for i in range(args.warmup + args.steps):
        t = args.tokens + i
        order = names[i % len(names):] + names[: i % len(names)]
        for k in order:
            t0 = time.perf_counter()
            out = model(input_ids=ids[:, t : t + 1], past_key_values=caches[k], use_cache=True, logits_to_keep=1)
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times[k].append(dt)
                logits[k].append(out.logits[0, -1])
    same = all(torch.equal(torch.stack(logits[k]), torch.stack(logits["no_copy"])) for k in names)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    c0 = caches["no_copy"]
    rep = c0.memory()
    exposed = med["copy_la0"] - med["no_copy"]
    out = {
        "tokens": args.tokens, "budget_hbm": budget, "layers": args.layers, "steps": args.steps,
        "host_bytes": rep.by_tier["host"], "hbm_bytes": rep.by_tier["hbm"],
        "median_ms": med, "exposed_copy_ms": exposed,
        "hidden_share": {k: (med["copy_la0"] - med[k]) / exposed if exposed > 0 else None
                         for k in ("copy_la1", "copy_la2")},
        "logits_identical": same,
        "loadavg_before": args.load, "loadavg_after": os.getloadavg()[0],
        "threads": args.threads, "python": platform.python_version(), "torch": torch.__version__,
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens held (a quarter in HBM, the rest in host memory)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per cache")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the compute (the copy thread is extra)")
    ap.add_argument("--out", default="tiers_prefetch.json")
    args = ap.parse_args()
    args.load = os.getloadavg()[0]
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=1))
    m = res["median_ms"]
    print(f"{res['tokens']} tokens, {res['host_bytes'] / 2**20:.1f} MiB in the host tier over {res['layers']} layers")
    for k, v in m.items():
        print(f"  {k:9s} {v:8.2f} ms/step")
    print(f"  exposed copy {res['exposed_copy_ms']:.2f} ms/step; hidden by lookahead 1: "
          f"{res['hidden_share']['copy_la1']:.0%}, by 2: {res['hidden_share']['copy_la2']:.0%}; "
          f"logits identical: {res['logits_identical']}; load {res['loadavg_before']:.1f} -> {res['loadavg_after']:.1f}")
    return 0 if res["logits_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
