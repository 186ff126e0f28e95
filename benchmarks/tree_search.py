"""Peak KV memory and wall time of a fixed tree search: per-branch copies vs kvcompose's BranchCache.

The same step-level beam (Tree-of-Thoughts BFS; width 4, 2 samples per frontier node, 4 for the root,
depth 4, fixed 64-token steps, temperature 0.7, seed 0) runs with four KV backends on the default model
(SmolLM2-135M-Instruct) and a GSM8K-style question:

- copies:        one `DynamicCache` per branch, deep-copied at every fork (stock sdpa attention);
- shared:        one `BranchCache`, prefixes shared, nothing compressed (exact);
- shared-host:   + `budget` device tokens per layer for the whole tree; inactive nodes keep 25% of their
                 tokens on the device, the rest go to the host tier (`HostTier`), rehydrated bit-exactly;
- shared-evict:  same, but the rest is evicted and recomputed from token ids on return.

Reported per backend: peak KV bytes on the device (allocated buffers) and in host memory, wall time, and
whether the search took the same decisions as `copies` (same kept nodes with the same tokens at every
depth). `--budget auto` = prompt + depth * step tokens (the longest active path fits; only inactive
branches are compressed).

    python benchmarks/tree_search.py --out benchmarks/results/tree_search.json      # ~15-60 min on 2 busy cores
    python benchmarks/tree_search.py --tiny                                         # seconds, a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from kvcompose.search import CopiedKV, SharedKV, TreeSearch
from kvcompose.tiers import Evict, HostTier

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")
SYSTEM = "Solve the math problem step by step, one short step per line. Finish with: The answer is <number>."
CONFIGS = ("copies", "shared", "shared-host", "shared-evict")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny random model (smoke test)")
    p.add_argument("--data", default=None, help="GSM8K jsonl; default: a built-in question")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--expand", type=int, default=2)
    p.add_argument("--root-expand", type=int, default=None)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--step-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", default="auto", help="device tokens per layer, or 'auto'")
    p.add_argument("--keep", type=float, default=0.25)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--baseline-attn", default="sdpa", help="attention implementation of the copies baseline")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core CPU)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def _backend(name: str, budget: int, keep: float, baseline_attn: str):
    if name == "copies":
        return CopiedKV(attn_implementation=baseline_attn)
    if name == "shared":
        return SharedKV()
    if name == "shared-host":
        return SharedKV(budget=budget, keep=keep, tier=HostTier())
    if name == "shared-evict":
        return SharedKV(budget=budget, keep=keep, tier=Evict())
    raise SystemExit(f"unknown config {name!r}; choose from {CONFIGS}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.tiny:
        from kvcompose.models import tiny_model

        model, tok = tiny_model("llama", layers=2), None
        prompt = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(args.seed))
        args.step_tokens = min(args.step_tokens, 8)
        model_name = "tiny llama (2 layers)"
    else:
        from kvcompose.models import chat_inputs, load_default_model

        model, tok = load_default_model()
        question = QUESTION
        if args.data:
            with open(args.data) as f:
                question = json.loads(f.readlines()[args.index])["question"]
        prompt = chat_inputs(tok, question, system=SYSTEM)["input_ids"]
        model_name = "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32)"
    budget = prompt.shape[1] + args.depth * args.step_tokens if args.budget == "auto" else int(args.budget)
    with torch.no_grad():  # warm-up (lazy imports, allocator), not timed
        model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)

    rows, ref = [], None
    out = {
        "model": model_name, "prompt_tokens": prompt.shape[1], "budget": budget, "keep": args.keep,
        "search": dict(strategy="bfs", width=args.width, expand=args.expand,
                       root_expand=args.root_expand or args.width, depth=args.depth, step_tokens=args.step_tokens,
                       temperature=args.temperature, seed=args.seed),
        "threads": args.threads, "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
        "rows": rows,
    }
    for name in args.configs.split(","):
        backend = _backend(name, budget, args.keep, args.baseline_attn)
        search = TreeSearch(model, tok, backend=backend, width=args.width, expand=args.expand,
                            root_expand=args.root_expand, depth=args.depth, step_tokens=args.step_tokens,
                            delimiter=None, temperature=args.temperature, seed=args.seed)
        t0 = time.perf_counter()
        res = search.run(prompt)
        wall = time.perf_counter() - t0
        backend.close()
        decisions = res.decision_tokens()
        if ref is None:
            ref = decisions
        m = res.memory
        row = {
            "config": name, "wall_s": round(wall, 1), "generated_tokens": res.generated_tokens,
            "tokens_per_s": round(res.generated_tokens / wall, 2),
            "peak_device_bytes": m["peak_device"], "peak_held_bytes": m["peak_held"],
            "peak_host_bytes": m["peak_host"], "peak_total_bytes": m["peak_total"],
            "same_decisions_as_first": decisions == ref,
            "same_decisions_per_depth": [a == b for a, b in zip(decisions, ref)],
            "best_node": res.best.id, "best_value": round(res.best.value, 4),
            "best_text": tok.decode(res.best_tokens(), skip_special_tokens=True) if tok is not None else None,
            **{k: m[k] for k in ("compressions", "rehydrated_host", "recomputed", "recomputed_tokens") if k in m},
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "best_text"}), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    base = rows[0]["peak_device_bytes"]
    mib = 2**20
    print(f"\n{model_name}; prompt {prompt.shape[1]} tokens; budget {budget}; search {out['search']}")
    print("| backend | peak KV device (MiB) | vs first | peak host (MiB) | wall (s) | tok/s | same decisions |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['peak_device_bytes'] / mib:.2f} | {base / r['peak_device_bytes']:.2f}x | "
              f"{r['peak_host_bytes'] / mib:.2f} | {r['wall_s']} | {r['tokens_per_s']} | {r['same_decisions_as_first']} |")
    return out


if __name__ == "__main__":
    main()
