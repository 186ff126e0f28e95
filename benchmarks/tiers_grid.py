#!/usr/bin/env python3
"""The 3x3 grid of "Not All Thoughts Need HBM" (abstract only): HBM share x eviction share, fidelity to
the full cache and HBM bytes, on SmolLM2-135M-Instruct over GSM8K prompts with long generations.

Protocol (kvcompose.bench.fidelity): full-cache reference traces (`--kind`, default "sampled": the full
cache's own seeded continuation, temperature 0.7, top-p 0.95, repetition penalty 1.1) of `--new-tokens`
tokens per question; each trace is teacher-forced through `KVComposeCache(model,
methods.memory_hierarchy(hbm, evict_ratio=evict))` (no token budget; shares of all tokens seen, host memory
takes the rest) in chunks of the compression interval (exactly equivalent to one-token decoding), and
compared token by token with the full cache: top-1 agreement and mean KL(full || method) in nats.

Columns: top-1, KL, perplexity ratio, peak HBM KV bytes (sum over layers of each layer's peak, mean over
traces) as a share of the full cache's KV bytes at the end of the trace, the same share at the end of
the trace (after the last compression event plus up to one interval), peak host and compressed bytes,
and whether every per-token KL and top-1 value is identical across the HBM shares of the same evict
share (`same` column: the central claim, bit-identical fidelity along the HBM axis).

Extra rows: pure eviction down to the smallest HBM share (hbm=0.25, evict=0.75: what the same HBM bytes
cost without a host tier) and the compressed tier (int8 / int4, 25% of the tokens).

Usage (3 prompts x 1024 tokens takes about 15-25 min on one core of a shared 2-core CPU):
    nohup python benchmarks/tiers_grid.py --data path/to/gsm8k/test.jsonl --n 3 --new-tokens 1024 \
        --out runs/tiers_grid.json > runs/tiers_grid.log 2>&1 &
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
from kvcompose.bench.fidelity import Trace, evaluate, load_questions, make_traces  # noqa: E402


def run_config(model, traces, pipeline_fn, interval):
    caches = []

    def make_cache():
        c = KVComposeCache(model, pipeline_fn(), interval=interval)
        caches.append(c)
        return c

    t0 = time.perf_counter()
    res = evaluate(model, traces, make_cache, chunk=interval)
    reps = [c.memory() for c in caches]
    n = len(reps)
    row = {
        "top1": res.top1, "kl": res.kl_mean, "ppl_ratio": res.ppl_ratio,
        "hbm_peak_bytes": sum(r.peak["hbm"] for r in reps) / n,
        "host_peak_bytes": sum(r.peak.get("host", 0) for r in reps) / n,
        "compressed_peak_bytes": sum(r.peak.get("compressed", 0) for r in reps) / n,
        "hbm_end_bytes": sum(r.by_tier["hbm"] for r in reps) / n,
        "host_end_bytes": sum(r.by_tier.get("host", 0) for r in reps) / n,
        "compressed_end_bytes": sum(r.by_tier.get("compressed", 0) for r in reps) / n,
        "full_bytes": sum(r.full_cache for r in reps) / n,
        "seconds": time.perf_counter() - t0,
    }
    row["hbm_share"] = row["hbm_peak_bytes"] / row["full_bytes"]
    row["hbm_end_share"] = row["hbm_end_bytes"] / row["full_bytes"]
    return row, [(t.top1, t.kl) for t in res.traces]


@torch.no_grad()
def quant_error(model, trace, interval: int) -> list[dict]:
    """The compressed tier's reconstruction error on real KV (every layer of one trace): max error / the
    per-element bound (<= 1 expected), and RMS error relative to the RMS of the tensor. Then the same after
    a teacher-forced run with a compressed share, on layer 0 (whose keys and values depend on the tokens
    only, not on upstream compression): the tokens compressed at the end, with codes kept (default) or
    re-quantized at every event (`keep_codes=False`)."""
    from kvcompose import CompressedTier, Hierarchy, TierTokens
    from kvcompose.tiers import quantization_error_bound

    ids = torch.tensor([trace.prompt_ids + trace.trace_ids[:-1]])
    full = KVComposeCache(model, methods.full())
    model(input_ids=ids, past_key_values=full)
    out = []
    for bits in (8, 4):
        worst, rel_k, rel_v = 0.0, [], []
        for layer in full.layers:
            k, v = layer.keys.float(), layer.values.float()
            b, h, t, _ = k.shape
            pos = torch.arange(t).expand(b, h, t)
            tier = CompressedTier(bits=bits)
            tokens = TierTokens(k, v, pos, torch.ones_like(pos, dtype=torch.bool), torch.zeros(b, h, t, 0))
            st = tier.store({}, tokens, t, torch.zeros(b, h, dtype=torch.long))
            got = tier.fetch(st)
            for x, y, g, ax, rel in ((k, got.keys, tier.key_group, "channel", rel_k),
                                     (v, got.values, tier.value_group, "token", rel_v)):
                bound = quantization_error_bound(x, bits, g, ax)
                err = (x - y).abs()
                worst = max(worst, float((err / (bound + 1e-12)).max()))
                rel.append(float(err.pow(2).mean().sqrt() / x.pow(2).mean().sqrt()))
        out.append({"test": "one round trip, all layers", "bits": bits, "max_err_over_bound": worst,
                    "rel_rms_keys": sum(rel_k) / len(rel_k), "rel_rms_values": sum(rel_v) / len(rel_v),
                    "bytes_per_fp32_byte": tier.nbytes(st)["compressed"] / (k.numel() * 4 + v.numel() * 4)})
    p = len(trace.prompt_ids)
    for keep in (True, False):
        tier = Hierarchy(0.5, 0.1, compressed=CompressedTier(bits=8, keep_codes=keep))
        pipe = methods.memory_hierarchy(0.25, compressed_ratio=0.5, evict_ratio=0.1).replace(tier)
        cache = KVComposeCache(model, pipe, interval=interval)
        model(input_ids=ids[:, :p], past_key_values=cache)
        for s in range(p, ids.shape[1], interval):
            model(input_ids=ids[:, s : s + interval], past_key_values=cache)
        rel_k, rel_v, requant = [], [], 0
        for fl, cl in zip(full.layers[:1], cache.layers[:1]):  # layer 0: its KV depend on the tokens only
            st = cl.segment.tier["compressed"]
            got = tier.compressed.fetch(st)
            requant += st.get("requantized", 0)
            idx = got.positions[..., None].expand(*got.positions.shape, fl.keys.shape[-1])
            for x, y, rel in ((fl.keys.gather(2, idx), got.keys, rel_k), (fl.values.gather(2, idx), got.values, rel_v)):
                rel.append(float((x - y).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()))
        out.append({"test": f"layer 0 after {ids.shape[1] - p} teacher-forced tokens, compressed share 0.5",
                    "bits": 8, "keep_codes": keep, "rel_rms_keys": sum(rel_k) / len(rel_k),
                    "rel_rms_values": sum(rel_v) / len(rel_v), "requantizations": requant,
                    "compressed_bytes": cache.memory().by_tier["compressed"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("KVCOMPOSE_GSM8K"), help="GSM8K-style JSONL, never copied (default: $KVCOMPOSE_GSM8K)")
    ap.add_argument("--n", type=int, default=3, help="questions")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--kind", default="sampled", choices=["sampled", "greedy", "worked"])
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--hbm", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--evict", type=float, nargs="+", default=[0.03, 0.1, 0.25])
    ap.add_argument("--no-extra", action="store_true", help="skip the eviction-only and compressed rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--traces", default=None, help="cache the reference traces in this JSON file")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--quant-error", action="store_true", help="only measure the compressed tier's error")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvcompose.models import load_default_model

    t0 = time.time()
    model, tok = load_default_model()
    print(f"model loaded in {time.time() - t0:.0f}s", flush=True)
    if args.traces and os.path.exists(args.traces):
        traces = [Trace.from_dict(d) for d in json.loads(Path(args.traces).read_text())]
    else:
        qs = load_questions(args.data, args.n, offset=args.offset)
        t0 = time.time()
        traces = make_traces(model, tok, qs, new_tokens=args.new_tokens, kind=args.kind, batch_size=args.n)
        print(f"{len(traces)} traces of {args.new_tokens} tokens in {time.time() - t0:.0f}s", flush=True)
        if args.traces:
            Path(args.traces).write_text(json.dumps([t.to_dict() for t in traces]))

    if args.quant_error:
        res = quant_error(model, traces[0], args.interval)
        for r in res:
            print(json.dumps(r), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        return

    grid: list[tuple[str, float, float, float, int]] = []
    for e in args.evict:
        for h in args.hbm:
            if h + e <= 1.0 + 1e-9:
                grid.append(("grid", h, 0.0, e, 8))
    if not args.no_extra:
        h0 = min(args.hbm)
        grid.append(("evict only", h0, 0.0, 1.0 - h0, 8))
        e0 = sorted(args.evict)[len(args.evict) // 2]
        grid.append(("compressed", h0, 0.25, e0, 8))
        grid.append(("compressed", h0, 0.25, e0, 4))

    rows, per_token = [], {}
    for kind, h, c, e, bits in grid:
        fn = lambda h=h, c=c, e=e, bits=bits: methods.memory_hierarchy(h, compressed_ratio=c, evict_ratio=e, bits=bits)  # noqa: E731
        row, tokens = run_config(model, traces, fn, args.interval)
        row.update(kind=kind, hbm_ratio=h, compressed_ratio=c, evict_ratio=e, bits=bits if c else None,
                   host_ratio=round(max(0.0, 1 - h - c - e), 6))
        per_token[(kind, h, c, e, bits)] = tokens
        rows.append(row)
        print(json.dumps(row), flush=True)
    # the central claim: along the HBM axis (same evict share) every per-token value is identical
    for row in rows:
        if row["kind"] != "grid":
            continue
        same_e = [k for k in per_token if k[0] == "grid" and k[3] == row["evict_ratio"]]
        row["same_as_other_hbm"] = all(per_token[k] == per_token[same_e[0]] for k in same_e)

    meta = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 -> fp32)", "data": args.data, "n": len(traces),
        "new_tokens": args.new_tokens, "kind": args.kind, "interval": args.interval,
        "prompt_tokens": [len(t.prompt_ids) for t in traces], "threads": args.threads,
        "cpu": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(json.dumps(meta))
    print("| rows | hbm | host | compressed | evict | top-1 | KL (nats) | ppl ratio | peak HBM / full | "
          "HBM / full at end | peak HBM MiB | peak host MiB | peak compr. MiB | identical along HBM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    mib = 2**20
    for r in rows:
        comp = f"{r['compressed_ratio']:g} (int{r['bits']})" if r["compressed_ratio"] else "0"
        print(f"| {r['kind']} | {r['hbm_ratio']:g} | {r['host_ratio']:g} | {comp} | {r['evict_ratio']:g} | "
              f"{r['top1']:.4f} | {r['kl']:.4f} | {r['ppl_ratio']:.4f} | {r['hbm_share']:.3f} | {r['hbm_end_share']:.3f} | "
              f"{r['hbm_peak_bytes'] / mib:.2f} | {r['host_peak_bytes'] / mib:.2f} | "
              f"{r['compressed_peak_bytes'] / mib:.2f} | {r.get('same_as_other_hbm', '')} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
