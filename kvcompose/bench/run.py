"""Orchestration behind `kvcompose bench fidelity` and `kvcompose bench speed` (`kvcompose bench accuracy`
is in `kvcompose.bench.accuracy`): load the model, build
traces, loop over methods and budgets with progress bars, write JSON + Markdown + PNG to an output folder.

The fidelity JSON is rewritten after every trace, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import methods as _methods
from ..cache import KVComposeCache
from ..view import KVComposeError
from . import report
from .common import _DTYPES, COMPRESSING, load_model, versions  # noqa: F401
from ..data import default_data_path, load_questions, resolve_questions
from .cells import _cell_path, _load_scores, _read_cell, _save_scores, references_for  # noqa: F401
from .fidelity import FidelityResult, evaluate_trace, free_generation
from .kvpress_fidelity import CHUNKABLE
from ..traces import RepetitionGuard, Trace, make_traces, prompt_ids

__all__ = ["FidelityConfig", "run_fidelity", "select_questions", "load_model",
           "default_data_path", "versions", "render"]

# ------------------------------------------------------------------------------------------ fidelity
@dataclass
class FidelityConfig:
    data: str | None = None
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    n_prompts: int = 2
    offset: int = 0
    min_prompt_tokens: int = 0
    new_tokens: int = 1536
    kinds: list[str] = field(default_factory=lambda: ["sampled", "worked"])
    methods: list[str] = field(default_factory=lambda: list(COMPRESSING))
    budgets: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    interval: int | None = None  # None: each preset's own (R-KV 128, the others 64)
    short_budgets: list[int] = field(default_factory=lambda: [64, 128])
    short_tokens: int = 512
    seed: int = 0
    temperature: float = 0.7
    top_p: float = 0.95
    repetition_penalty: float = 1.1
    no_repeat_ngram_size: int = 0
    pool: int = 200
    free_gen_prompts: int = 4
    free_gen_tokens: int = 256
    free_gen_budgets: list[int] = field(default_factory=lambda: [64, 128])
    kvpress_python: str | None = None
    kvpress_script: str | None = None
    kvpress_presses: list[str] | None = None
    kvpress_budgets: list[int] | None = None
    kvpress_kinds: list[str] = field(default_factory=lambda: ["sampled"])
    kvpress_max_steps: int | None = None
    kvpress_max_items: int | None = None
    kvpress_parallel: bool = True
    kvpress_json: str | None = None
    kvpress_inprocess: bool = False  # run kvpress_presses in this process (kvpress installed here), batched
    kvpress_chunks: bool = True  # in process: feed CHUNKABLE presses `interval` tokens per forward (same scores)
    traces: str | None = None
    batch_size: int = 1  # > 1: batched teacher forcing (kvcompose: left padding; kvpress: equal prompt lengths)
    groups: int = 0  # > 0: select_prompt_groups(groups, group_size, select_seed) instead of n_prompts/offset
    group_size: int = 8
    select_seed: int = 0
    exclude: list[str] | None = None  # traces.json files whose questions are not selected (held-out sets)
    pipelines: list[str] | str | None = None  # Python files with PIPELINES = {name: callable(budget) -> Pipeline}
    references: str | None = None  # folder of full-cache references (hidden states), reused across runs
    recall: bool = True  # False: skip the prompt-recall probe after each trace (kvcompose rows; kvpress has none)
    kl_bucket: int = 64
    threads: int | None = None
    out: str = "runs/fidelity"
    command: str = ""


def _write(out: Path, data: dict[str, Any], name: str = "fidelity") -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, allow_nan=True, default=str))


def render(out: str | os.PathLike) -> list[Path]:
    """(Re)write the Markdown and PNG files of the JSON results in `out`."""
    out = Path(out)
    written = []
    if (out / "fidelity.json").exists():
        data = json.loads((out / "fidelity.json").read_text())
        (out / "fidelity.md").write_text(report.fidelity_markdown(data))
        report.plot_fidelity(data, out / "fidelity_vs_budget.png")
        written += [out / "fidelity.md", out / "fidelity_vs_budget.png"]
        for kind in sorted({r["kind"] for r in data["rows"]}):
            path = out / f"kl_along_trace_{report.slug(kind)}.png"
            report.plot_kl_curves(data, path, kind=kind)
            written.append(path)
    if (out / "accuracy.json").exists():
        from . import accuracy_report

        written += accuracy_report.render(out)
    from .perf_report import render as _render_perf  # speed.json, steptime.json, throughput.json

    written += _render_perf(out)
    return written


def _portable(value: Any) -> Any:
    """A config value without machine paths: an absolute path (or a list of them) becomes its file name."""
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return Path(value).name
    return value


def _press_rows(results: dict, engine: str, cfg: FidelityConfig, prompt_lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    for (m, b, kind), scores in results.items():
        if scores:
            r = FidelityResult(scores).summary(cfg.kl_bucket)
            per_trace = [{"id": t.id, "top1": round(FidelityResult([t]).top1, 5),
                          "kl_mean": round(FidelityResult([t]).kl_mean, 6)} for t in scores]
            rows.append({"engine": engine, "method": m, "budget": b, "kind": kind, "regime": _regime(b, prompt_lengths),
                         "pipeline": f"DecodingPress({m}, compression_interval={cfg.interval or 64}, target_size={b})",
                         "fed": (f"{cfg.interval or 64} tokens per call" if cfg.kvpress_chunks and m in CHUNKABLE
                                 else "one token per call"),
                         "interval": cfg.interval or 64, **r, "per_trace": per_trace})
    return rows


def _truncate(score, n: int):
    from dataclasses import replace

    # the prefix of a teacher-forced trace is exactly what a shorter trace would give (causality); the recall
    # probe, which follows the whole trace, is not, so it is dropped
    return replace(score, top1=score.top1[:n], kl=score.kl[:n], nll=score.nll[:n], nll_full=score.nll_full[:n],
                   recall_logprob=None, recall_logprob_full=None)


def _regime(budget: int | None, prompt_lengths: list[int]) -> str:
    if budget is None or not prompt_lengths:
        return "-"
    if budget < min(prompt_lengths):
        return "budget < prompt"
    if budget > max(prompt_lengths):
        return "budget > prompt"
    return "mixed"


def _rows(results: dict[tuple[str, int | None, str], list], pipelines: dict, bucket: int,
          prompt_lengths: list[int], intervals: dict | None = None) -> list[dict[str, Any]]:
    rows = []
    for (m, b, kind), scores in results.items():
        if not scores:
            continue
        r = FidelityResult(scores).summary(bucket)
        per_trace = [{"id": t.id, "top1": round(FidelityResult([t]).top1, 5), "kl_mean": round(FidelityResult([t]).kl_mean, 6)}
                     for t in scores]
        rows.append({"engine": "kvcompose", "method": m, "budget": b, "kind": kind, "regime": _regime(b, prompt_lengths),
                     "pipeline": pipelines.get((m, b), ""), "interval": (intervals or {}).get((m, b)), **r,
                     "per_trace": per_trace})
    return rows


def select_questions(tok, path: str, n: int, offset: int, min_prompt_tokens: int) -> list[dict[str, Any]]:
    """The first `n` questions from `offset` whose chat prompt has at least `min_prompt_tokens` tokens (the
    selection of `kvcompose bench fidelity --min-prompt-tokens`)."""
    if min_prompt_tokens <= 0:
        return load_questions(path, n, offset)
    out: list[dict[str, Any]] = []
    start = offset
    while len(out) < n:
        batch = load_questions(path, 256, start)
        if not batch:
            break
        out += [q for q in batch if len(prompt_ids(tok, q["question"])) >= min_prompt_tokens]
        start += 256
    return out[:n]


def select_prompt_groups(tok, path: str, n_groups: int = 4, group_size: int = 8, seed: int = 0,
                         exclude: set[str] | frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """A seeded, length-grouped sample of questions: `n_groups` groups of `group_size` questions whose chat
    prompts have the same token length (the selection of `kvcompose bench fidelity --groups`).

    The rule: shuffle every record of `path` with `random.Random(seed)`; walk the shuffled order, skipping
    ids in `exclude`; put each question in the group of its chat-prompt length (`prompt_ids`); a group
    that reaches `group_size` questions is complete and its length takes no more questions; stop at
    `n_groups` complete groups. Returned group by group, in the order the groups completed, each group in
    walk order.

    Why groups of equal length: kvpress's presses score every slot of the cache, padding included, so a
    left-padded batch is not the same computation as its rows alone; a group of equal-length prompts needs
    no padding, and kvpress can score it in one forward per step exactly as it scores each prompt alone.
    kvcompose's batches need no such grouping (its blocks skip padding), but use the same questions.
    """
    import random

    if n_groups <= 0 or group_size <= 0:
        raise KVComposeError(f"n_groups and group_size must be positive, got {n_groups} and {group_size}")
    records = load_questions(path)
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    groups: dict[int, list[dict[str, Any]]] = {}
    done: list[int] = []
    for i in order:
        q = records[i]
        if q["id"] in exclude:
            continue
        n = len(prompt_ids(tok, q["question"]))
        if n in done:
            continue
        groups.setdefault(n, []).append(q)
        if len(groups[n]) == group_size:
            done.append(n)
            if len(done) == n_groups:
                break
    if len(done) < n_groups:
        raise KVComposeError(f"{path} has only {len(done)} prompt lengths with {group_size} unused questions, "
                             f"{n_groups} groups were asked for")
    return [q for n in done for q in groups[n]]


class _TracePartial:
    """The batches of reference traces made so far (`traces.partial.jsonl` in the output folder, one line per
    batch), so a run stopped while generating resumes at its next batch: a batch's line is used again only when
    the settings that made it (`key`: model, tokens, seed, sampling, repetition guard, batch size) are this run's
    and its questions are the batch's (checked by `make_traces`); a torn last line is ignored."""

    def __init__(self, path: Path, settings: dict[str, Any]):
        self.path, self.key = path, json.dumps(settings, sort_keys=True)

    def done(self, kind: str) -> dict[int, list[Trace]]:
        got: dict[int, list[Trace]] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if d.get("key") == self.key and d.get("kind") == kind:
                    got[int(d["batch"])] = [Trace.from_dict(t) for t in d["items"]]
        return got

    def add(self, kind: str, batch: int, traces: list[Trace]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"key": self.key, "kind": kind, "batch": batch,
                                "items": [t.to_dict() for t in traces]}) + "\n")


def _start_kvpress(cfg: FidelityConfig, traces: list[Trace], model_name: str, out: Path, log) -> dict[str, Any]:
    from . import kvpress

    kp_traces = [t for t in traces if t.kind in cfg.kvpress_kinds][: cfg.kvpress_max_items or None]
    if cfg.kvpress_max_steps:
        kp_traces = [Trace(**{**t.to_dict(), "trace_ids": t.trace_ids[: cfg.kvpress_max_steps]}) for t in kp_traces]
    if cfg.kvpress_json:
        res = json.loads(Path(cfg.kvpress_json).read_text())
        got = (res.get("config", {}).get("n_items"), res.get("config", {}).get("n_steps"))
        want = (len(kp_traces), sum(len(t.trace_ids) for t in kp_traces))
        if got != (None, None) and got != want:
            raise KVComposeError(f"{cfg.kvpress_json} was run on {got[0]} traces / {got[1]} tokens, these kvpress "
                                 f"settings select {want[0]} / {want[1]}")
        log(f"kvpress results reused from {cfg.kvpress_json}")
        return {"result": (res, None), "cmd": res.get("command", f"(reused {cfg.kvpress_json})"), "traces": kp_traces}
    kp_path = out / "kvpress_traces.json"
    kvpress.write_traces(kp_path, model_name, kp_traces)
    logf = open(out / "kvpress.log", "w")
    proc, cmd = kvpress.start_kvpress(
        cfg.kvpress_python, kp_path, out / "kvpress.json", budgets=cfg.kvpress_budgets or cfg.budgets,
        presses=cfg.kvpress_presses, interval=cfg.interval or 64, script=cfg.kvpress_script, model_dir=cfg.model,
        threads=cfg.threads, log=logf)
    if proc is None:
        logf.close()
        log(cmd)
    else:
        log(f"kvpress side by side started on {len(kp_traces)} traces "
            f"({'in parallel' if cfg.kvpress_parallel else 'now'}); log: {out / 'kvpress.log'}")
    return {"proc": proc, "cmd": cmd, "log": logf, "traces": kp_traces, "out": out / "kvpress.json"}


def _wait_kvpress(kp: dict[str, Any]) -> tuple[dict | None, str | None]:
    from . import kvpress

    if kp["proc"] is None:
        return None, kp["cmd"]
    res = kvpress.finish_kvpress(kp["proc"], kp["out"], kp["cmd"])
    kp["log"].close()
    return res


def _finish_kvpress(kp: dict[str, Any], cfg: FidelityConfig, results, pipelines, data, out: Path, log,
                    intervals: dict | None = None) -> list[dict]:
    """Wait for kvpress and return its rows plus kvcompose's rows on exactly the same tokens."""
    from . import kvpress

    res, why = kp["result"] if "result" in kp else _wait_kvpress(kp)
    if res is None:
        data["notes"].append(why)
        log(why)
        return []
    ids = {t.id for t in kp["traces"]}
    n = max((len(t.trace_ids) for t in kp["traces"]), default=0)
    kinds = "+".join(sorted({t.kind for t in kp["traces"]}))
    label = f"{kinds}, {len(ids)} traces x {n} tokens"
    rows = kvpress.kvpress_rows(res, label, cfg.kl_bucket)
    same = {}
    for (m, b, kind), scores in results.items():
        # short-regime scores carry the id of their truncated trace ("<id>[:512]")
        sel = [_truncate(s, n) for s in scores if s.id.split("[:")[0] in ids and len(s.top1) >= n]
        if len(sel) == len(ids):
            same[(m, b, label)] = sel
    rows = _rows(same, pipelines, cfg.kl_bucket, data["prompt_lengths"], intervals) + rows
    data["kvpress"] = {k: v for k, v in res.items() if k != "results"}
    data["kvpress"]["command"] = kp["cmd"]
    data["kvpress"]["label"] = label
    data["notes"].append(f"kvpress side by side: kvpress ({kvpress.engine_label(res)}, DecodingPress every "
                         f"{cfg.interval or 64} steps, one token per forward call) and kvcompose on the same {len(ids)} "
                         f"traces, first {n} tokens, each against its own full-cache run.")
    return rows


def load_pipelines(path: str | os.PathLike) -> dict[str, Any]:
    """The `PIPELINES` dict of a Python file: `{name: callable(budget) -> Pipeline}` (how `kvcompose bench
    fidelity --pipelines FILE` adds compositions to the presets; see benchmarks/compositions.py)."""
    import importlib.util

    p = Path(path)
    if not p.exists():
        raise KVComposeError(f"pipelines file {str(p)!r} not found")
    spec = importlib.util.spec_from_file_location(f"kvcompose_pipelines_{p.stem}", p)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    table = getattr(mod, "PIPELINES", None)
    if not isinstance(table, dict) or not all(callable(v) for v in table.values()):
        raise KVComposeError(f"{p} must define PIPELINES = {{name: callable(budget) -> Pipeline}}")
    return table


def _known(name: str, custom: dict[str, Any]) -> bool:
    return name in _methods.PRESETS or name in getattr(_methods, "PORTED", {}) or name in custom


def _pipeline(name: str, budget: int | None, custom: dict[str, Any], model=None):
    """The pipeline `name`: from a pipelines file (`fn(budget)`, or `fn(budget, model=model)` when it takes a
    `model`), a preset ported from kvpress (`methods.preset(name, model=model)`: some need the model's rotary
    embedding or output projections), or a preset (`methods.preset(name, budget=budget)`)."""
    import inspect

    from ..pipeline import Pipeline

    if name in custom:
        fn = custom[name]
        try:
            takes_model = "model" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            takes_model = False
        pipe = fn(budget, model=model) if takes_model else fn(budget)
        if not isinstance(pipe, Pipeline):
            raise KVComposeError(f"pipeline {name!r} returned {type(pipe).__name__}, not a kvcompose Pipeline")
        return pipe
    return _methods.preset(name, budget=budget, model=model)


def _kvpress_engine() -> str:
    import importlib.metadata as md

    from .kvpress_fidelity import kvpress_version

    return f"kvpress {kvpress_version()} / transformers {md.version('transformers')}"


def run_fidelity(cfg: FidelityConfig, log=print) -> dict[str, Any]:
    """Run the fidelity benchmark described by `cfg`; returns the JSON-ready result (also written to cfg.out).

    With `batch_size > 1` traces are teacher-forced in batches (`evaluate_batch`; kvpress presses with
    `kvpress_inprocess`, `evaluate_press_batch`), against full-cache references kept as hidden states
    (`references` folder, reused across runs). Every finished (engine, method, budget, batch) is appended to
    `out/cells/*.jsonl`: rerunning the same command resumes where a killed run stopped."""
    from tqdm.auto import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.batch_size < 1:
        raise KVComposeError(f"batch_size must be >= 1, got {cfg.batch_size}")
    data_path = cfg.data or default_data_path()
    if data_path is None and not cfg.traces:
        resolve_questions(None, None)  # raises the error that names --data, --dataset and $KVCOMPOSE_GSM8K
    custom: dict[str, Any] = {}
    for f in [cfg.pipelines] if isinstance(cfg.pipelines, str) else (cfg.pipelines or []):
        custom.update(load_pipelines(f))
    for m in cfg.methods:
        if not _known(m, custom):
            raise KVComposeError(f"unknown method {m!r}; presets: "
                                 f"{', '.join([*_methods.PRESETS, *getattr(_methods, 'PORTED', {})])}"
                                 + (f"; from {cfg.pipelines}: {', '.join(custom)}" if custom else ""))
    presses = list(cfg.kvpress_presses or []) if cfg.kvpress_inprocess else []
    if presses:
        from .kvpress_fidelity import PRESSES

        bad = [p for p in presses if p not in PRESSES]
        if bad:
            raise KVComposeError(f"unknown kvpress presses {bad}; known: {', '.join(PRESSES)}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    log(f"loading model {cfg.model or 'SmolLM2-135M-Instruct (GGUF)'} ...")
    model, tok = load_model(cfg.model, cfg.dtype, cfg.device)
    model_name = cfg.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
    for b in cfg.budgets:
        for m in cfg.methods:
            if m != "full":
                _pipeline(m, b, custom, model).validate(b)
    exclude: set[str] = set()
    for f in cfg.exclude or []:
        exclude |= {d["id"].split("/")[0] for d in json.loads(Path(f).read_text())["items"]}
    selected: list[dict[str, Any]] = []
    if data_path is not None and not (cfg.traces and not cfg.free_gen_prompts):
        if cfg.groups:
            selected = select_prompt_groups(tok, data_path, cfg.groups, cfg.group_size, cfg.select_seed, exclude)
        else:
            want = max(cfg.n_prompts, cfg.free_gen_prompts)
            selected = select_questions(tok, data_path, want, cfg.offset, cfg.min_prompt_tokens)
            if len(selected) < want:
                log(f"note: only {len(selected)} usable questions in {data_path}")
    n_prompts = cfg.groups * cfg.group_size if cfg.groups else cfg.n_prompts
    questions = selected[:n_prompts]
    chosen = {q["question"] for q in selected}
    pool = [q for q in load_questions(data_path, cfg.pool + len(selected), cfg.offset) if q["question"] not in chosen][: cfg.pool] \
        if "worked" in cfg.kinds and data_path is not None else None

    traces: list[Trace] = []
    t0 = time.perf_counter()
    guard = RepetitionGuard(cfg.repetition_penalty, cfg.no_repeat_ngram_size)
    if cfg.traces:  # reuse the references of an earlier run (same model): the first n_prompts of each kind
        saved = [Trace.from_dict(d) for d in json.loads(Path(cfg.traces).read_text())["items"]]
        for kind in cfg.kinds:
            traces += [t for t in saved if t.kind == kind][: n_prompts]
        # a saved trace longer than --new-tokens is scored on its first new_tokens tokens: teacher forcing is
        # causal, so that prefix is the computation a shorter trace gives (the recall probe follows the prefix)
        cut = [t for t in traces if len(t.trace_ids) > cfg.new_tokens]
        traces = [Trace(**{**t.to_dict(), "id": f"{t.id}[:{cfg.new_tokens}]", "trace_ids": t.trace_ids[: cfg.new_tokens]})
                  if len(t.trace_ids) > cfg.new_tokens else t for t in traces]
        log(f"reusing {len(traces)} traces from {cfg.traces}" + (f" ({len(cut)} cut to their first {cfg.new_tokens} "
                                                                 "tokens)" if cut else ""))
    else:
        bsz = cfg.group_size if cfg.groups else 8
        partial = _TracePartial(out / "traces.partial.jsonl", dict(
            model=model_name, new_tokens=cfg.new_tokens, seed=cfg.seed, temperature=cfg.temperature,
            top_p=cfg.top_p, guard=[cfg.repetition_penalty, cfg.no_repeat_ngram_size], batch_size=bsz))
        for kind in cfg.kinds:
            done = partial.done(kind)
            if done:
                log(f"{kind} traces: {len(done)} batches from {partial.path.name} (a stopped run), not generated again")
            traces += make_traces(model, tok, questions, new_tokens=cfg.new_tokens, kind=kind, seed=cfg.seed,
                                  temperature=cfg.temperature, top_p=cfg.top_p, repetition_guard=guard, pool=pool,
                                  batch_size=bsz, progress=True, done=done,
                                  on_batch=lambda bi, made, k=kind: partial.add(k, bi, made))
    trace_seconds = time.perf_counter() - t0
    if not cfg.traces or not (out / "traces.json").exists():
        (out / "traces.json").write_text(json.dumps(
            {"model": model_name, "items": [t.to_dict() | {"text": tok.decode(t.trace_ids)} for t in traces]}, indent=1))
        if not cfg.traces:
            partial.path.unlink(missing_ok=True)
    log(f"{len(traces)} traces of {max((len(t.trace_ids) for t in traces), default=0)} tokens in "
        f"{trace_seconds:.0f}s -> {out / 'traces.json'}")

    kp = _start_kvpress(cfg, traces, model_name, out, log) if (cfg.kvpress_python or cfg.kvpress_json) else None
    if kp is not None and not cfg.kvpress_parallel and "result" not in kp:
        kp["result"] = _wait_kvpress(kp)

    combos: list[tuple[str, str, int | None]] = [("kvcompose", "full", None)] if "full" in cfg.methods else []
    combos += [("kvcompose", m, b) for m in cfg.methods if m != "full" for b in cfg.budgets]
    kv_engine = _kvpress_engine() if presses else ""
    combos += [(kv_engine, p, b) for p in presses for b in (cfg.kvpress_budgets or cfg.budgets)]
    pipelines: dict[tuple[str, int | None], str] = {}
    intervals: dict[tuple[str, int | None], int | None] = {}  # the interval each row ran at
    results: dict[tuple[str, int | None, str], list] = {}
    press_results: dict[tuple[str, int | None, str], list] = {}
    data: dict[str, Any] = {
        "config": {**{k: _portable(v) for k, v in cfg.__dict__.items()}, "data": data_path and Path(data_path).name,
                   "command": " ".join(_portable(x) for x in cfg.command.split()),
                   "model": model_name},
        "versions": versions(), "device": str(cfg.device), "threads": torch.get_num_threads(),
        "prompt_lengths": [len(t.prompt_ids) for t in traces],
        "trace_seconds": trace_seconds, "rows": [], "notes": [],
    }
    if presses:
        from .kvpress_fidelity import kvpress_version

        data["versions"]["kvpress"] = kvpress_version()
    if cfg.groups:
        data["selection"] = {"rule": "select_prompt_groups", "groups": cfg.groups, "group_size": cfg.group_size,
                             "seed": cfg.select_seed, "excluded": len(exclude),
                             "questions": sorted({t.id.split("/")[0] for t in traces})}
    errors: dict[tuple[str, str, int | None], str] = {}
    # the short regime (budgets below the prompt length) is scored on the first `short_tokens` trace tokens
    short = {t.id: t if not cfg.short_tokens or len(t.trace_ids) <= cfg.short_tokens else
             Trace(**{**t.to_dict(), "id": f"{t.id}[:{cfg.short_tokens}]", "trace_ids": t.trace_ids[: cfg.short_tokens]})
             for t in traces}
    # interleave kinds (sampled-0, worked-0, sampled-1, ...) so a partial run covers every kind
    by_kind = [[t for t in traces if t.kind == k] for k in cfg.kinds]
    traces = [t for group in zip(*by_kind) for t in group] + [t for g in by_kind for t in g[min(map(len, by_kind)):]]
    refs: dict[str, Any] = {}
    if cfg.batch_size > 1 or presses:
        needed = {b in cfg.short_budgets for _, _, b in combos}
        refs = references_for(model, (list(traces) if False in needed or not combos else [])
                              + ([short[t.id] for t in traces if short[t.id] is not t] if True in needed else []),
                              cfg.references, model_name, cfg.dtype, batch_size=max(cfg.batch_size, 8), log=log)
    if not cfg.recall:  # the references stay keyed by the whole trace; the probe is just not run
        from dataclasses import replace as _replace

        traces = [_replace(t, recall_ids=[], recall_target_ids=[]) for t in traces]
        short = {k: _replace(t, recall_ids=[], recall_target_ids=[]) for k, t in short.items()}

    from .fidelity import evaluate_batch
    from .kvpress_fidelity import evaluate_press_batch, make_press, press_batches

    def batches(engine: str, budget: int | None) -> list[list[Trace]]:
        items = [short[t.id] if budget in cfg.short_budgets else t for t in traces]
        if engine == "kvcompose" and cfg.batch_size == 1:
            return [[t] for t in items]
        return press_batches(items, cfg.batch_size)

    def refresh() -> None:
        data["rows"] = _rows(results, pipelines, cfg.kl_bucket, data["prompt_lengths"], intervals) + \
            _press_rows(press_results, kv_engine, cfg, data["prompt_lengths"]) + [
            {"engine": e, "method": m, "budget": b, "kind": "-", "error": err} for (e, m, b), err in errors.items()]
        data["elapsed_s"] = time.perf_counter() - t_start
        _write(out, data)

    # cells of earlier invocations into the same folder (other methods or budgets) stay in the tables
    ids = {t.id for t in traces} | {short[t.id].id for t in traces}
    for path in sorted((out / "cells").glob("*.jsonl")):
        cell, done = _read_cell(path)
        if cell is None or cell in combos or cell[0] is None:
            continue
        sink = results if cell[0] == "kvcompose" else press_results
        for sc in done.values():
            if sc.id in ids:
                sink.setdefault((cell[1], cell[2], sc.kind), []).append(sc)
        if cell[0] != "kvcompose":
            kv_engine = kv_engine or cell[0]
    refresh()

    total = sum(len(batches(e, b)) for e, _, b in combos)
    bar = tqdm(total=total, desc="fidelity", unit="batch", dynamic_ncols=True)
    for engine, m, b in combos:
        cell = _cell_path(out, engine, m, b)
        done = _load_scores(cell)
        sink = results if engine == "kvcompose" else press_results
        if engine == "kvcompose":
            pipe = _pipeline(m, b, custom, model) if m != "full" else _methods.full()
            pipelines[(m, b)] = repr(pipe)
            intervals[(m, b)] = (cfg.interval or pipe.interval or 64) if pipe.compresses else None
        for group in batches(engine, b):
            bar.set_postfix_str(f"{m}@{b} {group[0].id}" + (f" +{len(group) - 1}" if len(group) > 1 else ""))
            if (engine, m, b) in errors:
                bar.update(1)
                continue
            try:
                if all(t.id in done for t in group):
                    scores = [done[t.id] for t in group]
                elif engine == "kvcompose":
                    # a fresh pipeline per cache: a pipeline file may hold per-cache state (an emulation)
                    make = lambda: KVComposeCache(model, _pipeline(m, b, custom, model) if m != "full" else pipe,  # noqa: E731
                                                  budget=b, interval=cfg.interval, seed=cfg.seed)
                    if len(group) == 1 and cfg.batch_size == 1:
                        cache = make()
                        scores = [evaluate_trace(model, group[0], cache)]
                        cache.close()
                    else:
                        scores = evaluate_batch(model, group, make, references=[refs[t.id] for t in group])
                    _save_scores(cell, scores, (engine, m, b))
                else:
                    iv = cfg.interval or 64
                    chunked = cfg.kvpress_chunks and m in CHUNKABLE
                    press = make_press(m, b, interval=iv, seed=cfg.seed, chunked=chunked)
                    scores = evaluate_press_batch(model, group, press, [refs[t.id] for t in group],
                                                  chunk=iv if chunked else 1)
                    _save_scores(cell, scores, (engine, m, b))
                for t, sc in zip(group, scores):
                    sink.setdefault((m, b, t.kind), []).append(sc)
            except Exception as e:  # noqa: BLE001 - one failing method must not lose the others' results
                errors[(engine, m, b)] = f"{type(e).__name__}: {e}"
                log(f"{m}@{b} failed on {group[0].id}: {errors[(engine, m, b)]}")
            bar.update(1)
            refresh()
    bar.close()
    refresh()

    # ---- free generation
    if cfg.free_gen_prompts > 0 and cfg.free_gen_budgets and selected:
        fq = selected[: cfg.free_gen_prompts]
        fg_rows = []
        fcombos = [(m, b) for m in cfg.methods if m != "full" for b in cfg.free_gen_budgets]
        for m, b in tqdm(fcombos, desc="free generation", unit="run", dynamic_ncols=True):
            if ("kvcompose", m, b) in errors:
                continue
            pipe = _pipeline(m, b, custom, model)
            try:
                res = free_generation(model, tok, fq, lambda: KVComposeCache(model, pipe, budget=b, interval=cfg.interval,
                                                                              seed=cfg.seed),
                                      max_new_tokens=cfg.free_gen_tokens)
            except Exception as e:  # noqa: BLE001
                log(f"free generation {m}@{b} failed: {type(e).__name__}: {e}")
                continue
            fg_rows.append({"method": m, "budget": b, **res.summary(),
                            # model answers and correctness only: the GSM8K reference answers stay out of the results
                            "answers": [{"full": r.full_answer, "method": r.answer, "full_correct": r.full_answer == r.gold,
                                         "correct": r.answer == r.gold} for r in res.rows]})
            data["free_generation"] = fg_rows
            _write(out, data)

    # ---- kvpress side by side (started before the main loop when kvpress_parallel)
    if kp is not None:
        data["rows"] += _finish_kvpress(kp, cfg, results, pipelines, data, out, log, intervals)
    data["elapsed_s"] = time.perf_counter() - t_start
    _write(out, data)
    render(out)
    log(f"wrote {out}/fidelity.json, fidelity.md and plots in {data['elapsed_s']:.0f}s")
    return data

