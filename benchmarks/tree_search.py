"""ArborKV-style tree search: peak KV of kvcompose's BranchCache against the exact shared-prefix tree, with
search decisions and answer agreement.

The same search (default: a step-level beam, Tree-of-Thoughts BFS; `--width` frontier, `--expand` samples
per frontier node, `--width` for the root, `--depth` steps of `--step-tokens` tokens, temperature 0.7,
per-node seeds; or `--strategy best_first`, which backtracks) runs with several KV backends on the default model (SmolLM2-135M-Instruct) for each question:

- shared:             one `BranchCache`, prefixes shared, nothing compressed: the EXACT tree, the baseline;
- copies:             one `DynamicCache` per branch, deep-copied at every fork (stock sdpa): the naive layout;
- host / host-lru:    `budget` device tokens per layer for the whole tree; inactive nodes keep `keep` of their
                      tokens on the device, the rest go to host memory (`HostTier`) and come back bit-exactly;
                      compressed lowest search value first (the search hands each branch's path value to the
                      cache), or least recently used first (`-lru`);
- evict / evict-lru:  the same, the rest evicted and recomputed from token ids when the branch is revisited;
- evict-resume(-lru): the rest evicted, and a revisited branch is decoded from what it still holds (no
                      restoration, no recomputation: approximate);
- host-resume:        the rest in host memory, attended in place when the branch is revisited (exact).

Per backend and question: peak KV bytes on the device (allocated buffers; for copies the live caches) and in
host memory, their ratio to the exact tree's, whether the search took the same decisions as the exact tree
(the same kept nodes with the same tokens at every depth), the best path's answer (the number after "The
answer is", else its last number) and whether it equals the exact tree's, and GSM8K exact match.
`--budget auto` = prompt + depth * step tokens (the longest active path always fits; only inactive branches
are compressed); `auto+N` leaves N more tokens per layer to inactive branches (then the compression order
matters: with `auto`, nearly every inactive node is compressed as soon as it is left).

    python benchmarks/tree_search.py --n 4 --out benchmarks/results/tree_search.json   # $KVCOMPOSE_GSM8K
    python benchmarks/tree_search.py                    # the built-in question
    python benchmarks/tree_search.py --tiny             # seconds, a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time

import torch

from kvcompose.bench.metrics import extract_answer, gsm8k_answer
from kvcompose.search import CopiedKV, SharedKV, TreeSearch
from kvcompose.tiers import Evict, HostTier

QUESTION = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether in April and May?",
    "answer": "#### 72",
}
SYSTEM = "Solve the math problem step by step, one short step per line. Finish with: The answer is <number>."
CONFIGS = ("shared", "copies", "host", "host-lru", "evict", "evict-lru", "evict-resume", "evict-resume-lru",
           "host-resume")
DEFAULT = "shared,host,evict,evict-lru,evict-resume,evict-resume-lru"
_ANSWER = re.compile(r"(?:answer is|####)\s*:?\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny random model (smoke test)")
    p.add_argument("--data", default=os.environ.get("KVCOMPOSE_GSM8K"),
                   help="GSM8K-style JSONL, read in place (default: $KVCOMPOSE_GSM8K; without it, a built-in question)")
    p.add_argument("--n", type=int, default=1, help="questions from --data")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--strategy", choices=["bfs", "best_first"], default="bfs")
    p.add_argument("--max-expansions", type=int, default=None, help="best-first: expansions (default depth * width)")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--expand", type=int, default=2)
    p.add_argument("--root-expand", type=int, default=None)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--step-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", default="auto",
                   help="device tokens per layer, 'auto' (prompt + depth * step tokens) or 'auto+N' (N more)")
    p.add_argument("--keep", type=float, default=0.25)
    p.add_argument("--configs", default=DEFAULT, help=f"comma-separated, from {', '.join(CONFIGS)}; the first is the reference")
    p.add_argument("--baseline-attn", default="sdpa", help="attention implementation of the copies baseline")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core CPU)")
    p.add_argument("--out", default=None, help="write the results as JSON here (rewritten after every run)")
    return p.parse_args(argv)


def backend_for(name: str, budget: int, keep: float, baseline_attn: str):
    if name == "copies":
        return CopiedKV(attn_implementation=baseline_attn)
    if name == "shared":
        return SharedKV()
    tier, *rest = name.split("-")
    if tier not in ("host", "evict") or any(r not in ("lru", "resume") for r in rest):
        raise SystemExit(f"unknown config {name!r}; choose from {CONFIGS}")
    return SharedKV(budget=budget, keep=keep, tier=HostTier() if tier == "host" else Evict(),
                    priority="lru" if "lru" in rest else "value", rehydrate="resume" if "resume" in rest else "exact")


def answer_of(text: str | None) -> str | None:
    """The number after the first "The answer is" (or "####"), else the text's last number."""
    if not text:
        return None
    m = _ANSWER.search(text)
    return extract_answer(m.group(1)) if m else extract_answer(text)


def load_items(args) -> list[dict]:
    if not args.data:
        return [QUESTION]
    from kvcompose.data import load_questions

    return load_questions(args.data, args.n, offset=args.offset)


def summarize(rows: list[dict], configs: list[str]) -> list[dict]:
    out = []
    for name in configs:
        rs = [r for r in rows if r["config"] == name]
        if not rs:
            continue
        n = len(rs)
        out.append({
            "config": name, "questions": n,
            "peak_device_mib": sum(r["peak_device_bytes"] for r in rs) / n / 2**20,
            "peak_host_mib": sum(r["peak_host_bytes"] for r in rs) / n / 2**20,
            "device_ratio": sum(r["device_ratio"] for r in rs) / n,
            "device_ratio_min": min(r["device_ratio"] for r in rs),
            "device_ratio_max": max(r["device_ratio"] for r in rs),
            "total_ratio": sum(r["total_ratio"] for r in rs) / n,
            "same_decisions": sum(r["same_decisions"] for r in rs),
            "same_depths": sum(sum(r["same_decisions_per_depth"]) for r in rs),
            "depths": sum(len(r["same_decisions_per_depth"]) for r in rs),
            "same_answer": sum(r["same_answer"] for r in rs),
            "correct": sum(r["correct"] for r in rs if r["correct"] is not None),
            "wall_s": sum(r["wall_s"] for r in rs),
            **{k: sum(r.get(k, 0) for r in rs) for k in ("compressions", "rehydrated_host", "recomputed",
                                                          "recomputed_tokens", "resumed")},
        })
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    configs = args.configs.split(",")
    if args.tiny:
        from kvcompose.testing import tiny_model

        model, tok = tiny_model("llama", layers=2), None
        prompts = [(torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(args.seed)), None)]
        args.step_tokens = min(args.step_tokens, 8)
        model_name = "tiny llama (2 layers)"
    else:
        from kvcompose.models import chat_inputs, load_default_model

        model, tok = load_default_model()
        prompts = [(chat_inputs(tok, it["question"], system=SYSTEM)["input_ids"], it) for it in load_items(args)]
        model_name = "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32)"
    with torch.no_grad():  # warm-up (lazy imports, allocator), not timed
        model.generate(input_ids=prompts[0][0], max_new_tokens=4, do_sample=False)

    rows: list[dict] = []
    out = {
        "model": model_name, "keep": args.keep, "budget": args.budget, "configs": configs,
        "search": dict(strategy=args.strategy, max_expansions=args.max_expansions, width=args.width, expand=args.expand,
                       root_expand=args.root_expand or args.width, depth=args.depth, step_tokens=args.step_tokens,
                       temperature=args.temperature, seed=args.seed),
        "questions": len(prompts), "offset": args.offset, "threads": args.threads,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}", "rows": rows,
    }
    for qi, (prompt, item) in enumerate(prompts):
        if args.budget.startswith("auto"):
            budget = prompt.shape[1] + args.depth * args.step_tokens + int(args.budget[4:] or 0)
        else:
            budget = int(args.budget)
        ref = None
        for name in configs:
            backend = backend_for(name, budget, args.keep, args.baseline_attn)
            search = TreeSearch(model, tok, backend=backend, strategy=args.strategy,
                                max_expansions=args.max_expansions, width=args.width, expand=args.expand,
                                root_expand=args.root_expand, depth=args.depth, step_tokens=args.step_tokens,
                                delimiter=None, temperature=args.temperature, seed=args.seed)
            t0 = time.perf_counter()
            res = search.run(prompt)
            wall = time.perf_counter() - t0
            backend.close()
            m = res.memory
            text = tok.decode(res.best_tokens(), skip_special_tokens=True) if tok is not None else None
            row = {
                "question": qi + args.offset if item is not QUESTION else "built-in", "config": name,
                "prompt_tokens": prompt.shape[1], "budget": budget if name not in ("shared", "copies") else None,
                "wall_s": round(wall, 1), "generated_tokens": res.generated_tokens,
                "peak_device_bytes": m["peak_device"], "peak_host_bytes": m["peak_host"],
                "peak_total_bytes": m["peak_total"], "decisions": res.decision_tokens(),
                "best_node": res.best.id, "best_value": round(res.best.value, 4), "best_text": text,
                "answer": answer_of(text), "gold": gsm8k_answer(item.get("answer")) if item else None,
                **{k: m[k] for k in ("compressions", "rehydrated_host", "recomputed", "recomputed_tokens", "resumed")
                   if k in m},
            }
            row["correct"] = None if row["gold"] is None else row["answer"] == row["gold"]
            if ref is None:
                ref = row
            row["device_ratio"] = ref["peak_device_bytes"] / row["peak_device_bytes"]
            row["total_ratio"] = ref["peak_total_bytes"] / row["peak_total_bytes"]
            row["same_decisions_per_depth"] = [a == b for a, b in zip(row["decisions"], ref["decisions"])]
            row["same_decisions"] = row["decisions"] == ref["decisions"]
            row["same_answer"] = row["answer"] == ref["answer"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("best_text", "decisions")}), flush=True)
            out["summary"] = summarize(rows, configs)
            if args.out:
                os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
    print(f"\n{model_name}; {len(prompts)} question(s); budget {args.budget}; keep {args.keep}; search {out['search']}")
    print(f"| backend | peak KV device (MiB) | exact tree / this (mean, min-max) | peak host (MiB) | same decisions "
          f"(questions; depths) | same answer as {configs[0]} | correct | compressions / host rehydrations / "
          "recomputations (tokens) / resumptions | wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in out["summary"]:
        q = s["questions"]
        print(f"| {s['config']} | {s['peak_device_mib']:.2f} | {s['device_ratio']:.2f}x "
              f"({s['device_ratio_min']:.2f}-{s['device_ratio_max']:.2f}) | {s['peak_host_mib']:.2f} | "
              f"{s['same_decisions']}/{q}; {s['same_depths']}/{s['depths']} | {s['same_answer']}/{q} | "
              f"{s['correct']}/{q} | {s['compressions']} / {s['rehydrated_host']} / {s['recomputed']} "
              f"({s['recomputed_tokens']}) / {s['resumed']} | {s['wall_s']:.0f} |")
    return out


if __name__ == "__main__":
    main()
