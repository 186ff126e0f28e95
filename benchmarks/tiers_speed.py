#!/usr/bin/env python3
"""Time cost of the memory tiers: decode time with tiers / decode time with the same tokens all in HBM.

"Not All Thoughts Need HBM" (abstract only) reports a 5-7% transfer overhead on GPU. This script measures
kvcompose's overhead in one process, interleaving the runs (A B C A B C ...) so that machine load hits them
alike, and reports the median decode time of each configuration as a ratio to the all-HBM run:

- `all_hbm`:    memory_hierarchy(hbm=1-evict, evict=evict)             every retained token in HBM
- `host`:       memory_hierarchy(hbm=--hbm, evict=evict)                the rest of the retained share in host memory
- `host+int8`:  memory_hierarchy(hbm=--hbm, compressed=--compressed, evict=evict, bits=8)
- `full`:       the full cache (for scale)

The first three evict the same tokens (same evict_ratio, same ranking), so `host` computes exactly what
`all_hbm` computes (bit-identical logits, checked here) and the ratio is the pure cost of the tier
(fetch + merge every step, store at each compression event). On CPU "host memory" is the same DRAM as
"HBM", so the CPU ratio measures bookkeeping (gathers, merges, quantization), not transfers; the GPU
figure (pinned host buffers, side-stream copies, layer-ahead prefetch) must be measured on a GPU.

Usage:
    python benchmarks/tiers_speed.py --data path/to/gsm8k/test.jsonl --new-tokens 512 --repeats 3
    python benchmarks/tiers_speed.py --tiny   # a tiny random model, seconds (smoke test)
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

from kvcompose import KVComposeCache, methods  # noqa: E402
from kvcompose.bench.speed import measure_decode  # noqa: E402


def configs(hbm: float, compressed: float, evict: float):
    return {
        "all_hbm": lambda: methods.memory_hierarchy(1.0 - evict, evict_ratio=evict),
        "host": lambda: methods.memory_hierarchy(hbm, evict_ratio=evict),
        "host+int8": lambda: methods.memory_hierarchy(hbm, compressed_ratio=compressed, evict_ratio=evict, bits=8),
        "full": lambda: methods.full(),
    }


@torch.no_grad()
def check_identical(model, ids, hbm, evict, interval, n=64) -> bool:
    """Greedy logits of `host` and `all_hbm` over `n` tokens are bit-identical."""
    out = []
    for h in (hbm, 1.0 - evict):
        cache = KVComposeCache(model, methods.memory_hierarchy(h, evict_ratio=evict), interval=interval)
        g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                           max_new_tokens=n, min_new_tokens=n, do_sample=False, temperature=None, top_p=None,
                           top_k=None, output_logits=True, return_dict_in_generate=True,
                           pad_token_id=model.generation_config.pad_token_id)
        out.append(torch.stack(g.logits))
    return bool(torch.equal(out[0], out[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("KVCOMPOSE_GSM8K"), help="JSONL with a 'question' field (default: $KVCOMPOSE_GSM8K)")
    ap.add_argument("--index", type=int, default=0, help="which question to use as the prompt")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hbm", type=float, default=0.25)
    ap.add_argument("--compressed", type=float, default=0.25)
    ap.add_argument("--evict", type=float, default=0.1)
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a loaded 2-core box)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="use a tiny random model instead of SmolLM2")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)

    if args.tiny:
        from kvcompose.testing import tiny_model

        model = tiny_model("llama", layers=4, heads=8, kv_heads=2, head_dim=32, vocab=256).to(dev)
        ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(0)).to(dev)
        model_name = "tiny llama (4 layers)"
    else:
        from kvcompose.bench.fidelity import load_questions
        from kvcompose.models import chat_inputs, load_default_model

        model, tok = load_default_model()
        model = model.to(dev)
        q = load_questions(args.data, 1, offset=args.index)[0]
        ids = chat_inputs(tok, q["question"], device=dev)["input_ids"]
        model_name = "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32)"

    identical = check_identical(model, ids, args.hbm, args.evict, args.interval)
    cfg = configs(args.hbm, args.compressed, args.evict)
    times: dict[str, list[float]] = {k: [] for k in cfg}
    mem: dict[str, dict] = {}
    for r in range(args.repeats):
        for name, make in cfg.items():
            cache = KVComposeCache(model, make(), interval=args.interval)
            res = measure_decode(model, ids, cache, args.new_tokens, name=name)
            times[name].append(res.decode_seconds)
            rep = cache.memory()
            mem[name] = {"by_tier": rep.by_tier, "peak": rep.peak, "full_cache": rep.full_cache,
                         "compress_share": res.compress_share}
            print(f"repeat {r} {name:10s} {res.decode_seconds:8.2f} s  {res.tokens_per_s:7.1f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["all_hbm"]
    rows = []
    for name in cfg:
        rows.append({"config": name, "median_decode_s": round(med[name], 3), "ratio_vs_all_hbm": round(med[name] / base, 3),
                     "min_ratio": round(min(times[name]) / min(times["all_hbm"]), 3), "runs": [round(t, 3) for t in times[name]],
                     **{f"{k}_bytes": v for k, v in mem[name]["by_tier"].items()}})
    meta = {
        "model": model_name, "device": str(dev), "threads": args.threads, "new_tokens": args.new_tokens,
        "prompt_tokens": int(ids.shape[1]), "interval": args.interval, "hbm": args.hbm,
        "compressed": args.compressed, "evict": args.evict, "repeats": args.repeats,
        "host_logits_identical_to_all_hbm": identical, "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(json.dumps(meta, indent=1))
    print("| config | median decode s | ratio vs all-HBM (median) | ratio (min) | HBM bytes | host bytes | compressed bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['median_decode_s']} | {r['ratio_vs_all_hbm']} | {r['min_ratio']} | "
              f"{r.get('hbm_bytes', 0)} | {r.get('host_bytes', 0)} | {r.get('compressed_bytes', 0)} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
