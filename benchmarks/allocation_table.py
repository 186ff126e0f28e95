"""Fidelity to the full cache of budget allocators at equal total KV bytes (docs/allocation.md).

Uniform, Pyramid, ReasoningWave+HeadUtility (ReasonAlloc; the wave capped at the tokens seen, and uncapped)
and HeadUtility alone, over R-KV scoring (the ReasonAlloc paper's comparison), plus Uniform and ReasonAlloc
over SnapKV scoring, at several average budgets per layer and KV head. Every method's total is
`num_layers * heads * budget` tokens per row. (GrowPage, triggered by page fills, is measured token by
token in a batch by `benchmarks/growpage_batch.py`; `--methods "GrowPage (R-KV)"` still runs it here,
chunked.) Reference traces are sampled with the full cache (`kvcompose.bench.fidelity.make_traces`) and teacher-forced through each
cache in chunks of the compression interval (`evaluate`), which equals one-token decoding.

The ReasoningWave profile is calibrated first (if `--profile` does not exist) on *other* GSM8K questions
(`--calib-offset`) than the evaluated ones.

    python benchmarks/allocation_table.py --data path/to/gsm8k/test.jsonl \
        --n 3 --new-tokens 1024 --budgets 128 256 512 --out runs/alloc.json --md runs/alloc.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvcompose import KVComposeCache, methods  # noqa: E402
from kvcompose.calibration import calibrate  # noqa: E402
from kvcompose.bench.fidelity import Trace, evaluate, load_questions, make_traces  # noqa: E402
from kvcompose.models import load_default_model  # noqa: E402

METHODS = {
    "Uniform (R-KV)": lambda profile: methods.rkv(),
    "Pyramid (R-KV)": lambda profile: methods.pyramid_rkv(methods.rkv()),
    "ReasoningWave+HeadUtility (R-KV)": lambda profile: methods.reason_alloc(methods.rkv(), profile=profile),
    "ReasoningWave uncapped+HeadUtility (R-KV)": lambda profile: methods.reason_alloc(methods.rkv(), profile=profile,
                                                                                       cap=False),
    "HeadUtility only (R-KV)": lambda profile: methods.reason_alloc(methods.rkv(), profile=None),
    "Uniform (SnapKV)": lambda profile: methods.snapkv(),
    # SnapKV protects its 32-query window: every head's floor must hold it (32 tokens, not 25% of small layers)
    "ReasoningWave+HeadUtility (SnapKV)": lambda profile: methods.reason_alloc(methods.snapkv(), profile=profile,
                                                                                floor=32),
    "HeadUtility only (SnapKV)": lambda profile: methods.reason_alloc(methods.snapkv(), profile=None, floor=32),
    # GrowPage is triggered by page fills, not by the 64-token chunks of this harness: measured token by token
    # in a left-padded batch by benchmarks/growpage_batch.py instead (still selectable here)
    "GrowPage (R-KV)": lambda profile: methods.growpage(methods.rkv()),
}
DEFAULT_METHODS = [m for m in METHODS if not m.startswith("GrowPage")]


def alloc_state(cache: KVComposeCache, layer) -> dict:
    """The allocator's layer state (GrowPage: pages, grants), threaded by the pipeline per layer."""
    pipe = cache.pipeline
    return layer.segment.blocks[pipe.leaves.index(pipe.allocator)] or {}


class HeldTracker:
    """Samples `cache.memory().total` (KV bytes held) after every forward call through a KVComposeCache
    (i.e. after every teacher-forced chunk, right after its compression event); the last call of each cache
    (the harness's prompt-recall probe) is dropped."""

    def __init__(self, model):
        self.samples: dict[int, list[int]] = {}
        self.caches: list[KVComposeCache] = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, KVComposeCache):
            if id(cache) not in self.samples:
                self.caches.append(cache)
            self.samples.setdefault(id(cache), []).append(cache.memory().total)

    def reset(self) -> None:
        self.samples, self.caches = {}, []

    def mean_held(self) -> float:
        xs = [x for v in self.samples.values() for x in v[:-1]]
        return sum(xs) / len(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="GSM8K test.jsonl (a 'question' field per line)")
    ap.add_argument("--n", type=int, default=3, help="evaluated questions")
    ap.add_argument("--offset", type=int, default=0, help="first evaluated question")
    ap.add_argument("--new-tokens", type=int, default=1024, help="tokens per reference trace")
    ap.add_argument("--kind", default="sampled", choices=["sampled", "greedy", "worked"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--interval", type=int, default=64, help="decoded tokens between compression events")
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    ap.add_argument("--extra-uniform", type=int, nargs="*", default=[],
                    help="more Uniform budgets, to compare methods that hold less than their cap at matched memory")
    ap.add_argument("--extra-method", default="Uniform (R-KV)", choices=list(METHODS),
                    help="the method run at the --extra-uniform budgets")
    ap.add_argument("--traces", default=None, help="JSON file of reference traces: loaded if it exists, else written")
    ap.add_argument("--profile", default="kvcompose/profiles/smollm2-135m-instruct.json",
                    help="ReasoningWave profile (calibrated and written here if missing; default: the one shipped "
                    "with kvcompose, made by `kvcompose calibrate` with its defaults)")
    ap.add_argument("--calib-n", type=int, default=4, help="calibration questions")
    ap.add_argument("--calib-offset", type=int, default=1000, help="first calibration question (not evaluated)")
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--md", default=None, help="Markdown table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tok = load_default_model()
    print(f"model loaded in {time.time() - t0:.1f}s", flush=True)

    if not os.path.exists(args.profile):
        t = time.time()
        calibrate(model, tok, args.data, args.profile, n=args.calib_n, offset=args.calib_offset,
                  new_tokens=args.calib_tokens, kind=args.kind, seed=args.seed + 1, coverage=0.9)
        print(f"calibrated {args.profile} on {args.calib_n} traces in {time.time() - t:.1f}s", flush=True)
    with open(args.profile) as f:
        profile = json.load(f)

    if args.traces and os.path.exists(args.traces):
        with open(args.traces) as f:
            traces = [Trace.from_dict(d) for d in json.load(f)]
        print(f"{len(traces)} traces loaded from {args.traces}", flush=True)
    else:
        questions = load_questions(args.data, args.n, args.offset)
        t = time.time()
        traces = make_traces(model, tok, questions, new_tokens=args.new_tokens, kind=args.kind, seed=args.seed)
        print(f"{len(traces)} traces of {args.new_tokens} tokens in {time.time() - t:.1f}s", flush=True)
        if args.traces:
            with open(args.traces, "w") as f:
                json.dump([t.to_dict() for t in traces], f)

    rows = []
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes_per_layer_token = cfg.num_key_value_heads * 2 * head_dim * next(model.parameters()).element_size()
    tracker = HeldTracker(model)
    runs = [(b, name) for b in args.budgets for name in args.methods]
    runs += [(b, args.extra_method) for b in args.extra_uniform]
    for budget, name in runs:
        def make_cache(name=name, budget=budget):
            return KVComposeCache(model, METHODS[name](args.profile), budget=budget, interval=args.interval)

        probe = make_cache()
        total = sum(probe.pipeline.allocator.layer_budgets(probe.num_layers, budget))
        t = time.time()
        tracker.reset()
        res = evaluate(model, traces, make_cache, chunk=args.interval)
        s = res.summary()
        row = {"budget": budget, "method": name, "layer_tokens_total": total, **s,
               "mean_kv_bytes": tracker.mean_held(), "budget_kv_bytes": total * kv_bytes_per_layer_token}
        alloc = probe.pipeline.allocator
        if hasattr(alloc, "cap_pages"):  # GrowPage: pages held at the end of each trace vs the cap
            states = [alloc_state(c, layer) for c in tracker.caches for layer in c.layers]
            pages = [int(st["pages"].sum()) for st in states if "pages" in st]
            row["growpage_mean_tokens_per_head_end"] = sum(pages) / len(pages) * alloc.page_size if pages else None
            row["growpage_granted"] = sum(st.get("granted", 0) for st in states)
            row["growpage_denied"] = sum(st.get("denied", 0) for st in states)
            row["growpage_returned"] = sum(st.get("returned", 0) for st in states)
        row.pop("kl_curve", None)
        rows.append(row)
        print(f"B={budget:4d} {name:34s} top1={s['top1']:.4f} KL={s['kl_mean']:.4f} ppl={s['ppl_ratio']:.4f} "
              f"peakKV={s['max_kv_bytes'] / 2**20:.2f}MiB meanKV={row['mean_kv_bytes'] / 2**20:.2f}MiB "
              f"kv_ratio={s['kv_ratio']:.3f} ({time.time() - t:.0f}s)", flush=True)

    out = {
        "command": "python benchmarks/allocation_table.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, fp32)", "n": args.n, "new_tokens": args.new_tokens,
        "kind": args.kind, "interval": args.interval, "profile": args.profile,
        "profile_demand": profile["demand"], "rows": rows, "seconds": round(time.time() - t0, 1),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    md = markdown(out)
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return out


def markdown(out: dict) -> str:
    lines = [
        "| budget | method | top-1 | KL (nats) | ppl ratio | mean KV held (MiB) | peak KV held (MiB) | recall delta |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["rows"]:
        rd = "" if r["recall_delta"] is None else f"{r['recall_delta']:+.3f}"
        lines.append(f"| {r['budget']} | {r['method']} | {r['top1']:.4f} | {r['kl_mean']:.4f} | {r['ppl_ratio']:.4f} | "
                     f"{r['mean_kv_bytes'] / 2**20:.2f} | {r['max_kv_bytes'] / 2**20:.2f} | {rd} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
