"""Tree-of-Thoughts search on a GSM8K-style question, with branch-aware KV caching (kvcompose.search).

Runs a step-level beam (BFS) or best-first search with SmolLM2-135M-Instruct (the default model); steps end
at a newline. Branches share their prefix's KV in one `BranchCache`; with `--budget`, inactive branches are
compressed, lowest search value first (a quarter of their tokens stay, the rest go to host memory or are
evicted and recomputed on return; `--rehydrate resume` decodes a revisited branch from what it still holds).

    python examples/tree_search_gsm8k.py                      # the built-in question
    python examples/tree_search_gsm8k.py --data path/to/gsm8k/test.jsonl --index 3 --budget 256
    python examples/tree_search_gsm8k.py --tiny               # a tiny random model: seconds, for CI

The GSM8K file is read from the path given (one JSON object per line with "question" and "answer");
nothing is copied into the repository.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch

from kvcompose.search import CopiedKV, SharedKV, TreeSearch

BUILTIN = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n#### 72",
}
SYSTEM = "Solve the math problem step by step, one short step per line. Finish with: The answer is <number>."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny random Llama, no tokenizer, token-count steps (CI)")
    p.add_argument("--data", default=None, help="GSM8K-style JSONL, e.g. GSM8K's test.jsonl (default: a built-in question)")
    p.add_argument("--index", type=int, default=0, help="line of the jsonl to solve")
    p.add_argument("--strategy", choices=["bfs", "best_first"], default="bfs")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--expand", type=int, default=2)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--step-tokens", type=int, default=48)
    p.add_argument("--delimiter", default="\n", help="text that ends a step; 'none' = fixed-length steps")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["shared", "copies"], default="shared")
    p.add_argument("--budget", type=int, default=None, help="device tokens per layer for the whole tree")
    p.add_argument("--keep", type=float, default=0.25, help="share of an inactive node kept on the device")
    p.add_argument("--tier", choices=["host", "evict"], default="host")
    p.add_argument("--rehydrate", choices=["exact", "resume"], default="exact",
                   help="revisiting a compressed branch: restore it exactly, or resume from what it still holds")
    p.add_argument("--priority", choices=["value", "lru"], default="value",
                   help="compress the lowest-value inactive branches first, or the least recently used")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p.parse_args(argv)


def load_question(path: str | None, index: int) -> dict:
    if path is None:
        return BUILTIN
    with open(path) as f:
        for i, line in enumerate(f):
            if i == index:
                return json.loads(line)
    raise SystemExit(f"{path} has no line {index}")


def last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        from kvcompose.testing import tiny_model

        model, tok = tiny_model("llama", layers=2), None
        prompt = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(args.seed))
        delimiter, step_tokens, depth, item = None, min(args.step_tokens, 8), min(args.depth, 3), None
        eos = 2
    else:
        from kvcompose.models import chat_inputs, load_default_model

        model, tok = load_default_model()
        item = load_question(args.data, args.index)
        prompt = chat_inputs(tok, item["question"], system=SYSTEM)["input_ids"]
        delimiter = None if args.delimiter.lower() == "none" else args.delimiter.encode().decode("unicode_escape")
        step_tokens, depth, eos = args.step_tokens, args.depth, None
    if args.backend == "shared":
        from kvcompose.tiers import Evict, HostTier

        backend = SharedKV(budget=args.budget, keep=args.keep, tier=HostTier() if args.tier == "host" else Evict(),
                           rehydrate=args.rehydrate, priority=args.priority)
    else:
        backend = CopiedKV()
    search = TreeSearch(
        model, tok, backend=backend, strategy=args.strategy, width=args.width, expand=args.expand, depth=depth,
        step_tokens=step_tokens, min_step_tokens=2, delimiter=delimiter, temperature=args.temperature,
        seed=args.seed, eos_token_id=eos,
    )
    t0 = time.perf_counter()
    result = search.run(prompt)
    wall = time.perf_counter() - t0

    by_id = {n.id: n for n in result.nodes}
    for depth_i, ids in enumerate(result.decisions, 1):
        print(f"-- {'depth' if args.strategy == 'bfs' else 'expansion'} {depth_i}: kept {ids}")
        for i in ids:
            n = by_id[i]
            text = n.step.text if n.step and n.step.text is not None else (n.step.token_ids.tolist() if n.step else "")
            print(f"   #{i:<3} value {n.value:+.3f}  step {n.score:+.3f}  {text!r}")
    best = result.best
    answer = tok.decode(result.best_tokens(), skip_special_tokens=True) if tok is not None else None
    print("\n== best path (node", best.id, f"value {best.value:+.3f}) ==")
    print(answer if answer is not None else result.best_tokens().tolist())
    summary = {
        "best_node": best.id, "best_value": best.value, "generated_tokens": result.generated_tokens,
        "wall_s": round(wall, 2), "memory": result.memory,
    }
    if item is not None and answer is not None:
        gold = item["answer"].split("####")[-1].strip().replace(",", "")
        got = last_number(answer)
        summary.update(predicted=got, gold=gold, correct=got == gold)
        print(f"\npredicted {got}  gold {gold}  {'correct' if got == gold else 'wrong'}")
    mib = 2**20
    m = result.memory
    print(f"\npeak KV on device {m['peak_device'] / mib:.2f} MiB, host {m.get('peak_host', 0) / mib:.2f} MiB; "
          f"{result.generated_tokens} tokens generated in {wall:.1f} s ({backend!r})")
    return summary


if __name__ == "__main__":
    main()
