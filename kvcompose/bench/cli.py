"""`kvcompose bench ...`: the benchmarks' command, added to the library's command line (`kvcompose.cli`).

    kvcompose bench fidelity [--data PATH] [--n-prompts 2] [--new-tokens 1536] [--budgets 64 128 256 512] ...
    kvcompose bench accuracy (--dataset gsm8k | --data FILE.jsonl) [--methods full rkv] [--budgets 128 256 512] ...
    kvcompose bench speed [--methods tova rkv] [--budget 512] [--new-tokens 4096]   # vs ideal, full, kvpress
    kvcompose bench steptime [--seen 1024 4096 16384]  # step time vs tokens seen; per-layer overhead
    kvcompose bench throughput --kv-memory MIB         # largest batch in a KV budget, tokens/s
    kvcompose bench report DIR          # re-render Markdown + plots from the JSON in DIR

`main` is the `kvcompose` script (pyproject.toml): every library command plus `bench`. Without an installed entry
point: `python -m kvcompose.bench.cli ...`. The benchmarks import the library, never the other way round.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable

from .. import cli, cli_args
from ..view import KVComposeError

__all__ = ["main", "build_parser", "add_parser", "run", "BENCH", "NEEDS", "EXTRAS"]


def add_parser(sub, add_model_flags: Callable[[argparse.ArgumentParser], None], methods: list[str]) -> None:
    """Add `bench` and its sub-commands to the script's subparsers."""
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
    f.add_argument("--kvpress-one-token", action="store_true",
                   help="in process: feed every press one trace token per forward call (default: the presses whose "
                   "scores do not depend on it, kvpress_fidelity.CHUNKABLE, get `--interval` tokens per call)")
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
    add_model_flags(f)

    from . import speed, steptime, throughput  # speed instruments: their flags live with them

    speed.add_parser(b, add_model_flags, methods)
    steptime.add_parser(b, add_model_flags, methods)
    throughput.add_parser(b, add_model_flags, methods)

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
    add_model_flags(a)

    r = b.add_parser("report", help="re-render Markdown and plots from the JSON in a results folder")
    r.add_argument("dir", type=cli_args.results_dir)


def run(args, argv: list[str]) -> int:
    """Run `kvcompose bench ...` (the parsed `args`; `argv` is recorded in the results as the command)."""
    from . import run as fidelity_run

    command = "kvcompose " + " ".join(shlex.quote(a) for a in argv)
    if args.bench == "report":
        written = fidelity_run.render(args.dir)
        if not written:
            raise KVComposeError(f"{args.dir} holds no results kvcompose can render (fidelity.json, accuracy.json, "
                                 "speed.json, steptime.json, throughput.json)")
        for p in written:
            print(p)
        return 0
    if args.bench == "accuracy":
        from .accuracy import DEFAULT_PROMPT, AccuracyConfig, run_accuracy

        run_accuracy(AccuracyConfig(
            model=args.model, dtype=args.dtype, device=args.device, device_map=args.device_map, data=args.data,
            dataset=args.dataset, limit=args.limit, offset=args.offset, methods=args.methods, budgets=args.budgets,
            interval=args.interval, samples=args.samples, max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
            prompt=args.prompt or DEFAULT_PROMPT, save_text=not args.no_text, threads=args.threads,
            progress=not args.no_progress, out=args.out, command=command))
        return 0
    if args.bench == "fidelity":
        cfg = fidelity_run.FidelityConfig(
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
            kvpress_chunks=not args.kvpress_one_token,
            batch_size=args.batch_size, groups=args.groups, group_size=args.group_size, select_seed=args.select_seed,
            exclude=args.exclude, pipelines=args.pipelines, references=args.references, recall=not args.no_recall,
            threads=args.threads, out=args.out, command=command,
        )
        fidelity_run.run_fidelity(cfg)
        return 0
    if args.bench in ("speed", "steptime", "throughput"):
        from . import speed, steptime, throughput

        return {"speed": speed, "steptime": steptime, "throughput": throughput}[args.bench].main(args, command)
    return 1


BENCH = cli.Command(
    "bench", add_parser, run,
    needs={"bench fidelity": ("matplotlib",), "bench accuracy": ("matplotlib", "math_verify"),
           "bench speed": ("matplotlib",), "bench throughput": ("matplotlib",), "bench report": ("matplotlib",)})


NEEDS = BENCH.needs
EXTRAS = cli.EXTRAS


def build_parser() -> argparse.ArgumentParser:
    """The `kvcompose` script's parser: the library's commands and `bench`."""
    return cli.build_parser([BENCH])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvcompose` script: the library's commands and `bench`."""
    return cli.main(argv, commands=[BENCH])


if __name__ == "__main__":
    sys.exit(main())
