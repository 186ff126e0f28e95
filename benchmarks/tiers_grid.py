#!/usr/bin/env python3
"""The 3x3 grid of "Not All Thoughts Need HBM" (abstract only): HBM share x eviction share, and the
paper's comparison with R-KV at equal HBM bytes, on SmolLM2-135M-Instruct over GSM8K prompts.

Two measures per configuration:

1. **Teacher-forced fidelity** (kvcompose.bench.fidelity): full-cache reference traces (`--kind`, default
   "sampled": the full cache's own seeded continuation, temperature 0.7, top-p 0.95, repetition penalty 1.1)
   of `--new-tokens` tokens per question, teacher-forced through the method's cache in chunks of `--chunk`
   tokens (exactly equivalent to one-token decoding; the chunk divides every interval) and compared token
   by token with the full cache: top-1 agreement, mean KL(full || method) in nats, perplexity ratio.
2. **Free generation** (`--free-gen N` questions, greedy, `--free-tokens` new tokens, one left-padded batch
   of `--free-batch`): the final number of each answer compared with the full cache's (answer agreement),
   whole-text agreement, and GSM8K exact match.

HBM bytes: the held KV bytes of all layers, measured (`cache.memory()` from a forward hook after every
forward): the peak and the mean over the teacher-forced trace (exact for dense storage: within a chunk the
held bytes grow by one token per step, and compression events only happen at a chunk's last token; the
prompt-recall probe after the trace is excluded), both as shares of the full cache's bytes at the end of
the trace. Free generation reports `cache.memory().peak` (the sum over layers of each layer's peak).

Grid: `methods.memory_hierarchy(hbm, evict_ratio=evict)` (no token budget; shares of all tokens seen,
host memory takes the rest), every `--hbm` x `--evict`, at its preset interval (64). Extra rows: pure
eviction down to the smallest HBM share (with 16 protected recent tokens instead of 64, which would not
fit in the retained 25% at the first event) and the compressed tier (int8 / int4, 25% of the tokens).

R-KV at equal HBM bytes (`--rkv-against h:e ...`): for each hierarchy configuration, `methods.rkv()` at its
own interval (128) with a budget per trace chosen from the hierarchy's measured HBM on that trace:
"peak" = the hierarchy's peak held tokens minus R-KV's interval (R-KV's held tokens peak at budget +
interval), "mean" = the hierarchy's mean held tokens over the decoded tokens minus half of R-KV's interval.
Both budgets are reported with R-KV's measured peak and mean HBM. In free generation R-KV's budget is the
"peak" one, from the hierarchy's free-generation run.

Usage (3 prompts x 1024 tokens, 8 free-generation questions: a few hours on one core of a loaded 2-core CPU):
    nohup python benchmarks/tiers_grid.py --n 3 --new-tokens 1024 --free-gen 8 --free-tokens 384 \
        --traces runs/traces.json --out runs/tiers_grid.json > runs/tiers_grid.log 2>&1 &
    python benchmarks/tiers_grid.py --quant-error          # the compressed tier's error on real KV
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
from kvcompose.bench.fidelity import (FidelityResult, Trace, evaluate_trace, free_generation,  # noqa: E402
                                      load_questions, make_traces)

MIB = 2**20


class HeldRecorder:
    """Records `(tokens seen, held KV bytes of all layers, tier bytes)` after every forward that uses `cache`.

    Chunks of teacher forcing end with the compression event (if any) at their last token, so during step i
    of a chunk the layers hold the bytes recorded after the previous forward plus i tokens: the mean and
    the peak below equal those of one-token decoding (tests/test_tiers_grid.py checks both)."""

    def __init__(self, model, cache):
        self.cache, self.points = cache, []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        if kwargs.get("past_key_values") is self.cache:
            rep = self.cache.memory()
            self.points.append((self.cache.layers[0].seen, rep.total, dict(rep.by_tier)))

    def _steps(self, prompt: int, end: int):
        bpt = sum(layer.bytes_per_token() for layer in self.cache.layers)
        for (s0, m0, _), (s1, _, _) in zip(self.points, self.points[1:]):
            if s0 < prompt or s1 > end:
                continue
            for i in range(1, s1 - s0 + 1):  # step i of the chunk holds the previous bytes + i tokens
                yield m0 + i * bpt

    def mean_held_bytes(self, prompt: int, end: int) -> float:
        """Mean held bytes over the decoded tokens `prompt < seen <= end` (one-token decoding equivalent)."""
        steps = list(self._steps(prompt, end))
        return sum(steps) / max(len(steps), 1)

    def peak_held_bytes(self, prompt: int, end: int) -> int:
        """Peak held bytes from the prefill to `seen == end` (later forwards, e.g. a recall probe, excluded)."""
        first = [m for s, m, _ in self.points if s == prompt]
        return int(max([*first, *self._steps(prompt, end)]))

    def peak_tier_bytes(self, end: int, tier: str) -> int:
        """Peak bytes of a tier up to `seen == end` (tiers change only at events, recorded after a forward)."""
        return max((t.get(tier, 0) for s, _, t in self.points if s <= end), default=0)

    def close(self):
        self.handle.remove()


def cache_kwargs(interval):
    return {} if interval is None else {"interval": interval}


def run_traces(model, traces, pipeline_fn, interval, chunk, budgets=None):
    """Teacher-force every trace through a fresh cache; fidelity, peak and mean HBM per trace."""
    scores, per_trace = [], []
    t0 = time.perf_counter()
    for i, tr in enumerate(traces):
        cache = KVComposeCache(model, pipeline_fn(), budget=None if budgets is None else budgets[i],
                               **cache_kwargs(interval))
        rec = HeldRecorder(model, cache)
        try:
            sc = evaluate_trace(model, tr, cache, chunk)
        finally:
            rec.close()
        p, end = len(tr.prompt_ids), len(tr.prompt_ids) + len(tr.trace_ids) - 1
        rep = cache.memory()
        bpt = sum(layer.bytes_per_token() for layer in cache.layers)
        full_end = end * bpt  # full cache's bytes at the end of the trace (the recall probe excluded)
        mean, peak = rec.mean_held_bytes(p, end), rec.peak_held_bytes(p, end)
        per_trace.append({"id": tr.id, "budget": None if budgets is None else budgets[i],
                          "peak_hbm_bytes": peak, "mean_hbm_bytes": mean, "full_bytes": full_end,
                          "peak_tokens": peak / bpt, "mean_tokens": mean / bpt, "interval": cache.interval,
                          "peak_host_bytes": rec.peak_tier_bytes(end, "host"),
                          "peak_compressed_bytes": rec.peak_tier_bytes(end, "compressed"),
                          "peak_hbm_bytes_with_probe": rep.peak["hbm"]})
        scores.append(sc)
    res = FidelityResult(scores)
    n = len(traces)
    full = sum(t["full_bytes"] for t in per_trace) / n
    row = {
        "top1": res.top1, "kl": res.kl_mean, "ppl_ratio": res.ppl_ratio,
        "hbm_peak_bytes": sum(t["peak_hbm_bytes"] for t in per_trace) / n,
        "hbm_mean_bytes": sum(t["mean_hbm_bytes"] for t in per_trace) / n,
        "host_peak_bytes": sum(t["peak_host_bytes"] for t in per_trace) / n,
        "compressed_peak_bytes": sum(t["peak_compressed_bytes"] for t in per_trace) / n,
        "full_bytes": full, "seconds": time.perf_counter() - t0, "traces": per_trace,
    }
    row["hbm_peak_share"] = row["hbm_peak_bytes"] / full
    row["hbm_mean_share"] = row["hbm_mean_bytes"] / full
    return row, [(t.top1, t.kl) for t in scores]


def run_free(model, tok, questions, pipeline_fn, interval, max_new, batch, budgets=None):
    """Greedy free generation with the full cache and with the method; answer agreement and HBM peaks."""
    if not questions:
        return None, None
    caches = []

    def make_cache():
        b = None if budgets is None else budgets[len(caches)]
        c = KVComposeCache(model, pipeline_fn(), budget=b, **cache_kwargs(interval))
        caches.append(c)
        return c

    t0 = time.perf_counter()
    res = free_generation(model, tok, questions, make_cache, max_new_tokens=max_new, batch_size=batch)
    peaks = []
    for c in caches:
        bpt = sum(layer.bytes_per_token() for layer in c.layers)
        peaks.append({"peak_tokens": c.memory().peak["hbm"] / bpt, "seen": c.layers[0].seen,
                      "budget": c.budget})
    out = {**res.summary(), "seconds": time.perf_counter() - t0, "batches": peaks}
    return out, [r.text for r in res.rows]


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
    ap.add_argument("--data", default=os.environ.get("KVCOMPOSE_GSM8K"),
                    help="GSM8K-style JSONL, read in place (default: $KVCOMPOSE_GSM8K)")
    ap.add_argument("--n", type=int, default=3, help="questions for the teacher-forced traces")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--kind", default="sampled", choices=["sampled", "greedy", "worked"])
    ap.add_argument("--interval", type=int, default=None,
                    help="compression interval of every method (default: each preset's own: hierarchy 64, R-KV 128)")
    ap.add_argument("--chunk", type=int, default=64, help="teacher-forcing chunk (must divide every interval)")
    ap.add_argument("--hbm", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--evict", type=float, nargs="+", default=[0.03, 0.1, 0.25])
    ap.add_argument("--no-extra", action="store_true", help="skip the eviction-only and compressed rows")
    ap.add_argument("--rkv-against", nargs="*", default=["0.25:0.03", "0.5:0.03"],
                    help="hierarchy configurations hbm:evict to compare with R-KV at equal HBM bytes")
    ap.add_argument("--free-gen", type=int, default=0, help="questions for free generation (0: skip)")
    ap.add_argument("--no-fidelity", action="store_true", help="free generation only (no teacher-forced traces)")
    ap.add_argument("--free-tokens", type=int, default=384)
    ap.add_argument("--free-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--traces", default=None, help="cache the reference traces in this JSON file")
    ap.add_argument("--out", default=None, help="write the results as JSON here (rewritten after every row)")
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
        res = quant_error(model, traces[0], args.interval or 64)
        for r in res:
            print(json.dumps(r), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        return

    free_qs = load_questions(args.data, args.free_gen, offset=args.offset) if args.free_gen else []
    grid: list[tuple[str, float, float, float, int]] = []
    for h in args.hbm:  # the smallest HBM share of every evict share first (the rest repeat it, see below)
        for e in args.evict:
            if h + e <= 1.0 + 1e-9:
                grid.append(("grid", h, 0.0, e, 8))
    if not args.no_extra:
        h0 = min(args.hbm)
        grid.append(("evict only", h0, 0.0, 1.0 - h0, 8))
        e0 = sorted(args.evict)[len(args.evict) // 2]
        grid.append(("compressed", h0, 0.25, e0, 8))
        grid.append(("compressed", h0, 0.25, e0, 4))
    against = []
    for spec in args.rkv_against:
        h, e = (float(x) for x in spec.split(":"))
        against.append((h, e))
        if ("grid", h, 0.0, e, 8) not in grid:
            grid.insert(0, ("grid", h, 0.0, e, 8))

    meta = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 -> fp32)", "n": 0 if args.no_fidelity else len(traces),
        "offset": args.offset, "new_tokens": len(traces[0].trace_ids) if traces and not args.no_fidelity else 0,
        "kind": args.kind, "chunk": args.chunk,
        "interval": args.interval, "prompt_tokens": [] if args.no_fidelity else [len(t.prompt_ids) for t in traces],
        "free_gen": len(free_qs), "free_tokens": args.free_tokens, "free_batch": args.free_batch,
        "threads": args.threads, "cpu": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv[1:]),
    }
    rows, per_token, texts = [], {}, {}

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def mark_identical():  # the central claim: along the HBM axis (same evict share) every value is identical
        for row in rows:
            if row["kind"] != "grid":
                continue
            same_e = [k for k in per_token if k[0] == "grid" and k[3] == row["evict_ratio"]]
            if not args.no_fidelity and len(same_e) > 1:
                row["same_as_other_hbm"] = all(per_token[k] == per_token[same_e[0]] for k in same_e)
            same_t = [k for k in texts if k[0] == "grid" and k[3] == row["evict_ratio"] and texts[k] is not None]
            if free_qs and len(same_t) > 1:
                row["free_same_as_other_hbm"] = all(texts[k] == texts[same_t[0]] for k in same_t)

    for kind, h, c, e, bits in grid:
        # the retained share must hold the protected recent window at the first event (prompt + 64 tokens):
        # with 75% evicted, 64 recent tokens do not fit, so that row protects the newest 16
        recent = 16 if kind == "evict only" else 64
        fn = lambda h=h, c=c, e=e, bits=bits, r=recent: methods.memory_hierarchy(  # noqa: E731
            h, compressed_ratio=c, evict_ratio=e, bits=bits, recent=r)
        row, tokens = ({}, None) if args.no_fidelity else run_traces(model, traces, fn, args.interval, args.chunk)
        free, free_texts = run_free(model, tok, free_qs, fn, args.interval, args.free_tokens, args.free_batch)
        row.update(kind=kind, method="memory_hierarchy", hbm_ratio=h, compressed_ratio=c, evict_ratio=e,
                   bits=bits if c else None, host_ratio=round(max(0.0, 1 - h - c - e), 6), free=free, recent=recent)
        if tokens is not None:
            per_token[(kind, h, c, e, bits)] = tokens
        texts[(kind, h, c, e, bits)] = free_texts
        rows.append(row)
        mark_identical()
        print(json.dumps({k: v for k, v in row.items() if k != "traces"}), flush=True)
        save()
        if kind == "grid" and (h, e) in against:  # R-KV at the same HBM bytes, trace by trace
            rkv_interval = args.interval or methods.rkv().interval
            for match in ("peak", "mean"):
                if args.no_fidelity and match == "mean":
                    continue
                r2 = {}
                if not args.no_fidelity:
                    budgets = [max(16, round(t[f"{match}_tokens"]) - (rkv_interval if match == "peak" else rkv_interval // 2))
                               for t in row["traces"]]
                    r2, _ = run_traces(model, traces, methods.rkv, args.interval, args.chunk, budgets)
                free2 = None
                if match == "peak" and free is not None:
                    fb = [max(16, round(b["peak_tokens"]) - rkv_interval) for b in free["batches"]]
                    free2, _ = run_free(model, tok, free_qs, methods.rkv, args.interval, args.free_tokens,
                                        args.free_batch, fb)
                r2.update(kind=f"R-KV, {match} HBM of hierarchy {h:g}/{e:g}", method="rkv", hbm_ratio=None,
                          compressed_ratio=0.0, evict_ratio=None, bits=None, host_ratio=0.0, free=free2,
                          matched=match, against=[h, e])
                rows.append(r2)
                print(json.dumps({k: v for k, v in r2.items() if k != "traces"}), flush=True)
                save()
    save()
    print(json.dumps(meta))
    print_table(rows)


def print_table(rows):
    print("| rows | HBM | host | compressed | evicted | top-1 | KL (nats) | ppl ratio | peak HBM / full | "
          "mean HBM / full | peak HBM MiB | peak host MiB | peak compr. MiB | identical along HBM | "
          "answer agreement | text agreement | exact match (full) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        comp = f"{r['compressed_ratio']:g} (int{r['bits']})" if r["compressed_ratio"] else "0"
        if r["method"] == "rkv":
            budgets = [t["budget"] for t in r.get("traces", [])] or [b["budget"] for b in (r.get("free") or {}).get("batches", [])]
            share = f"budget {min(budgets)}-{max(budgets)}" if budgets else ""
            host, ev = "0", "rest"
        else:
            share, host, ev = f"{r['hbm_ratio']:g}", f"{r['host_ratio']:g}", f"{r['evict_ratio']:g}"
        f = r.get("free") or {}
        same = r.get("same_as_other_hbm", "")
        if "free_same_as_other_hbm" in r:
            same = f"{same} / {r['free_same_as_other_hbm']}"
        fa = (f"{f['answer_agreement']:.3f} ({f['n']})" if f else "")
        ft = (f"{f['text_agreement']:.3f}" if f else "")
        fe = (f"{f['exact_match']:.3f} ({f['full_exact_match']:.3f})" if f else "")
        if "top1" in r:
            fid = (f"{r['top1']:.4f} | {r['kl']:.4f} | {r['ppl_ratio']:.4f} | {r['hbm_peak_share']:.3f} | "
                   f"{r['hbm_mean_share']:.3f} | {r['hbm_peak_bytes'] / MIB:.1f} | {r['host_peak_bytes'] / MIB:.1f} | "
                   f"{r['compressed_peak_bytes'] / MIB:.1f}")
        else:
            fid = " | ".join([""] * 8)
        print(f"| {r['kind']} | {share} | {host} | {comp} | {ev} | {fid} | {same} | {fa} | {ft} | {fe} |")


if __name__ == "__main__":
    main()
