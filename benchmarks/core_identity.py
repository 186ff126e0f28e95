"""Fingerprint every preset's teacher-forced logits and kept positions on SmolLM2-135M, to check that a
refactor of the core changes nothing a user sees.

Run it on two checkouts (e.g. `git worktree add ../old <commit>`) and compare the JSON files:

    python benchmarks/core_identity.py --data GSM8K.jsonl --out new.json
    (cd ../old && PYTHONPATH=. python ../kvcompose/benchmarks/core_identity.py --data GSM8K.jsonl --out old.json)
    python benchmarks/core_identity.py --compare old.json new.json

`--tiny` fingerprints every preset on a tiny random Llama instead (no data, no download; a few minutes on a
CPU): two rows, the second left-padded by 5 tokens, a 100-token prefill and 100 teacher-forced tokens at
budget 96 and interval 16, each preset with and without the padding mask.

    (cd ../old && PYTHONPATH=. python ../kvcompose/benchmarks/core_identity.py --tiny --out old.json)

The trace is the full cache's greedy continuation of one GSM8K question (test line `--index`); each preset
then decodes it one token at a time (teacher forcing) at each budget, with `--interval` (explicit, so a
change of a preset's default interval does not show up as a difference).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch


DEFAULT_METHODS = ["streaming_llm", "h2o", "snapkv", "tova", "knorm", "rkv", "random_attention", "vase",
                   "memory_hierarchy", "pyramid_rkv", "reason_alloc", "growpage"]


def fingerprint(args) -> dict:
    from kvcompose import KVComposeCache
    import importlib
    import inspect

    from kvcompose import methods

    if "budget" in inspect.signature(methods.preset).parameters:
        build = lambda name, budget: methods.preset(name, budget=budget)  # noqa: E731
    else:  # a checkout from before the one factory: the benchmark's own
        build = importlib.import_module("kvcompose.bench.run").make_pipeline
    from kvcompose.models import chat_inputs, load_default_model

    torch.set_num_threads(args.threads)
    model, tok = load_default_model()
    model.eval()
    lines = open(args.data, encoding="utf-8").read().splitlines()
    question = json.loads(lines[args.index])["question"]
    inputs = chat_inputs(tok, [question])
    with torch.no_grad():
        seq = model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False)[0]
    p = inputs["input_ids"].shape[1]
    out = {"prompt_tokens": p, "tokens": int(seq.shape[0]), "interval": args.interval}
    for name in args.methods:
        for budget in args.budgets:
            cache = KVComposeCache(model, build(name, budget), budget=budget, interval=args.interval)
            logits = []
            with torch.no_grad():
                o = model(input_ids=seq[None, :p], past_key_values=cache, use_cache=True)
                logits.append(o.logits[:, -1].float())
                for t in range(p, seq.shape[0] - 1):
                    o = model(input_ids=seq[None, t : t + 1], past_key_values=cache, use_cache=True)
                    logits.append(o.logits[:, -1].float())
            x = torch.cat(logits)
            kept = [cache.kept_positions(i).tolist() for i in range(0, cache.num_layers, 7)]
            out[f"{name}@{budget}"] = {
                "logits_sha1": hashlib.sha1(x.numpy().tobytes()).hexdigest(),
                "kept_sha1": hashlib.sha1(json.dumps(kept).encode()).hexdigest(),
                "held_bytes": cache.memory().total,
            }
            print(name, budget, out[f"{name}@{budget}"], flush=True)
    return out


def _tiny_model():
    try:
        from kvcompose.testing import tiny_model
    except ImportError:  # a checkout from before the test models moved out of the core
        from kvcompose.models import tiny_model
    return tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16)


def fingerprint_tiny(args) -> dict:
    from kvcompose import KVComposeCache, methods

    torch.set_num_threads(args.threads)
    model = _tiny_model()
    ids = torch.randint(3, 128, (2, 200), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :5] = 0
    out = {"tiny": True, "tokens": 200, "interval": 16}
    for name in args.methods:
        for pad in (False, True):
            pipe = methods.preset(name)  # no budget: each preset at its plain defaults, on old checkouts too
            cache = KVComposeCache(model, pipe, 96 if pipe.compresses else None, interval=16)
            kw = (lambda t: {"attention_mask": mask[:, :t]}) if pad else (lambda t: {})
            logits = []
            with torch.no_grad():
                logits.append(model(input_ids=ids[:, :100], past_key_values=cache, **kw(100)).logits[:, -1])
                for t in range(100, 200):
                    logits.append(model(input_ids=ids[:, t : t + 1], past_key_values=cache, **kw(t + 1)).logits[:, -1])
            x = torch.cat(logits)
            kept = [cache.kept_positions(i).tolist() for i in range(3)]
            out[f"{name}@{'pad' if pad else 'nopad'}"] = {
                "logits_sha1": hashlib.sha1(x.numpy().tobytes()).hexdigest(),
                "kept_sha1": hashlib.sha1(str(kept).encode()).hexdigest(),
                "held_bytes": cache.memory().total,
            }
            print(name, "pad" if pad else "nopad", out[f"{name}@{'pad' if pad else 'nopad'}"], flush=True)
    return out


def compare(a: dict, b: dict) -> int:
    diff = 0
    for key in sorted(set(a) & set(b)):
        if not isinstance(a[key], dict):
            continue
        same = a[key]["logits_sha1"] == b[key]["logits_sha1"] and a[key]["kept_sha1"] == b[key]["kept_sha1"]
        diff += not same
        print(f"{key:28s} {'identical' if same else 'DIFFERENT'}")
    print(f"{diff} of {sum(isinstance(v, dict) for k, v in a.items() if k in b)} runs differ")
    return 1 if diff else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="GSM8K-style JSONL with a 'question' field")
    ap.add_argument("--index", type=int, default=4, help="question line (default 4: a 140-token chat prompt)")
    ap.add_argument("--new-tokens", type=int, default=320)
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (no --data)")
    ap.add_argument("--budgets", nargs="+", type=int, default=[64, 160])
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="core_identity.json")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files and exit")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        return compare(a, b)
    if args.tiny:
        if args.methods == DEFAULT_METHODS:
            args.methods = ["full", *DEFAULT_METHODS]
        json.dump(fingerprint_tiny(args), open(args.out, "w"), indent=1)
        return 0
    if not args.data:
        ap.error("--data is required (a GSM8K-style JSONL)")
    json.dump(fingerprint(args), open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
