"""The key experiments of two seed papers as fidelity tables (issue 16): Random Attention's matched-protection
table and VaSE's ablation, on the fidelity benchmark's traces.

**Random Attention** (SalesforceAIResearch/Random-Attention, `kvcompress/engine/cache_utils.py`): uniform
random retention vs scored top-k eviction (SnapKV-like attention, R-KV, recency), each with and without the
prompt protection of `random_pp` (the reference's `*_pp` modes), and `random_pp` with one keep-set shared by
all KV heads (`random_unified`, the per-head independence ablation).

**VaSE** (terarachang/VaSE, `eval/reasoning_tasks/modified/transformers/cache_utils.py`): attention top-k
(`attn`) -> + value-range protection (`range_attn`) -> + sampling (`range_sample_attn`) -> + sinks (VaSE,
`range_sink_sample_attn`), the query-free variant (`cur_fixed_gauss`), and the control that keeps the
smallest value ranges, i.e. evicts the largest (`evict_large_range` / VaSE's `small_range`), which the paper
says collapses into loops; free generation measures the loops (distinct n-grams, looping tails).

Every row uses the reference engine's common protocol, scaled to small budgets: the newest `r` tokens are
always kept and are not candidates, `K = budget - r` slots are chosen among the rest, compression every 64
decoded tokens, attention from the last 64 queries (softmax over the candidates, mean over the queries,
average pooling with kernel 5, mean over the GQA group). The reference's `r` is 64; below budget 256 it is
capped at `budget // 4` (`engine_recent`, the same cap as `kvcompose bench fidelity` applies to the
random_attention and vase presets), so that budget 64 still leaves room for anything but the window.

Run `python benchmarks/faithful_tables.py --table random_attention` (or `vase`); the traces of a
`kvcompose bench fidelity` run can be reused with `--traces`, so the tables share tokens with the results page.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import methods
from ..cache import KVComposeCache
from ..pipeline import Pipeline
from ..protectors import ProtectPrompt, ProtectRecent, ProtectValueNorm
from ..scorers import KeyRedundancy, Recency, ValueNorm, WindowedAttention
from ..selectors import RandomDrop, Sample, TopK
from ..view import KVComposeError
from .fidelity import FidelityResult, evaluate_trace, free_generation
from .report import fmt
from ..traces import RepetitionGuard, Trace, make_traces

__all__ = ["Variant", "engine_recent", "random_attention_rows", "vase_rows", "TABLES", "repetition_stats",
           "FaithfulConfig", "run_table", "table_markdown", "main"]

ENGINE_INTERVAL = 64  # the reference engine compresses when the length is a multiple of its 64-token buffer
QUERY_WINDOW = 64  # ... and scores with its 64-query ring buffer


def engine_recent(budget: int) -> int:
    """The always-kept recent window at `budget`: 64 (the reference's residual buffer), capped at
    `budget // 4` (at least 1) below budget 256."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 1:
        raise KVComposeError(f"budget must be an int > 1, got {budget!r}")
    return max(1, min(64, budget // 4))


@dataclass(frozen=True)
class Variant:
    """One row of a table: `build(budget) -> Pipeline` (None = the row does not run at this budget).

    Attributes:
        key: short name used in the JSON and the tables.
        mode: the reference implementation's eviction mode this row reproduces.
        label: a one-line description.
        build: the pipeline at a budget.
    """

    key: str
    mode: str
    label: str
    build: Callable[[int], Pipeline | None]


def _attention(r: int) -> WindowedAttention:
    """The reference engine's `compute_attention_scores` with `--smooth`: 64 queries, softmax over the
    candidates (the newest `r` excluded), mean over queries, average pool kernel 5, mean over the GQA group."""
    return WindowedAttention(QUERY_WINDOW, gqa="mean", pool="avg", kernel=5, exclude_recent=r)


def _prompt() -> ProtectPrompt:
    """`*_pp`: the first `min(prompt, K - 1)` prompt tokens (K = budget - recent), one slot left to the rest."""
    return ProtectPrompt(keep="first", leave=1)


def _topk(budget: int, scorer, *, pp: bool, name: str) -> Pipeline:
    r = engine_recent(budget)
    extra = [_prompt()] if pp else []
    return Pipeline(ProtectRecent(r), *extra, scorer, TopK(), name=name, interval=ENGINE_INTERVAL)


def random_attention_rows() -> list[Variant]:
    """Random Attention's matched-protection table (paper Table 2 and its head-sharing ablation).

    R-KV here is the reference's `attn_rkv` with lambda 0.5 (its `rkv` and `rkv_pp` cells): 0.5 * the
    attention score - 0.5 * the softmax of the column-mean cosine similarity of the candidate keys (no
    threshold). `rkv_official` (kvcompose's `rkv` preset rule) has no protected form in the reference.
    """
    def rkv_scorer(r: int):
        return 0.5 * _attention(r) - 0.5 * KeyRedundancy(threshold=1.0, exclude_recent=r)

    return [
        Variant("random", "random", "uniform random per KV head, no prompt protection",
                lambda b: methods.random_attention(recent=engine_recent(b), protect_prompt=False)),
        Variant("random_pp", "random_pp", "Random Attention: prompt kept, uniform random per KV head",
                lambda b: methods.random_attention(recent=engine_recent(b))),
        Variant("random_pp_shared", "random_unified", "random_pp with one keep-set shared by all KV heads",
                lambda b: methods.random_attention(recent=engine_recent(b), shared_heads=True)),
        Variant("random_pp_r64", "random_pp", "random_pp with the reference's 64-token window, not capped "
                "(budget 128 only: the check of the cap)",
                lambda b: methods.random_attention(recent=64) if 64 < b < 256 else None),
        Variant("snapkv", "attn", "attention top-k (SnapKV-like)",
                lambda b: _topk(b, _attention(engine_recent(b)), pp=False, name="snapkv(attn)")),
        Variant("snapkv_pp", "attn_pp", "attention top-k, prompt kept",
                lambda b: _topk(b, _attention(engine_recent(b)), pp=True, name="snapkv_pp(attn_pp)")),
        Variant("rkv", "attn_rkv", "R-KV as the paper ran it (lambda 0.5)",
                lambda b: _topk(b, rkv_scorer(engine_recent(b)), pp=False, name="rkv(attn_rkv)")),
        Variant("rkv_pp", "attn_rkv_pp", "R-KV (lambda 0.5), prompt kept",
                lambda b: _topk(b, rkv_scorer(engine_recent(b)), pp=True, name="rkv_pp(attn_rkv_pp)")),
        Variant("recency", "recency", "the newest tokens only",
                lambda b: _topk(b, Recency(), pp=False, name="recency")),
        Variant("recency_pp", "recency_pp", "prompt kept, then the newest tokens",
                lambda b: _topk(b, Recency(), pp=True, name="recency_pp")),
    ]


def vase_rows() -> list[Variant]:
    """VaSE's ablation: each step adds one ingredient; `n_large` = budget / 4 (the reference's K/4)."""
    def protect(b: int, sinks: int) -> ProtectValueNorm:
        return ProtectValueNorm(0.25, kind="range", sinks=sinks, exclude_recent=engine_recent(b))

    def build(b: int, steps: str) -> Pipeline:
        r = engine_recent(b)
        blocks: list = [ProtectRecent(r)]
        if "range" in steps:
            blocks.append(protect(b, 4 if "sink" in steps else 0))
        blocks += [_attention(r), Sample() if "sample" in steps else TopK()]
        return Pipeline(*blocks, name=steps, interval=ENGINE_INTERVAL)

    def control(b: int) -> Pipeline:
        return Pipeline(ProtectRecent(engine_recent(b)), -1.0 * ValueNorm("range"), TopK(),
                        name="evict_large_range", interval=ENGINE_INTERVAL)

    return [
        Variant("attn", "attn", "attention top-k", lambda b: build(b, "attn")),
        Variant("range_attn", "range_attn", "+ the budget/4 largest value ranges protected",
                lambda b: build(b, "range_attn")),
        Variant("range_sample_attn", "range_sample_attn", "+ sampling in proportion to attention",
                lambda b: build(b, "range_sample_attn")),
        Variant("vase", "range_sink_sample_attn", "+ 4 sinks counted as largest = VaSE",
                lambda b: methods.vase(recent=engine_recent(b))),
        Variant("vase_query_free", "cur_fixed_gauss", "query-free: |kG|^2 |vG|^2, fixed Gaussian G, sinks",
                lambda b: methods.vase(query_free=True, recent=engine_recent(b))),
        Variant("evict_large_range", "evict_large_range", "control: keep the smallest value ranges", control),
    ]


TABLES: dict[str, Callable[[], list[Variant]]] = {"random_attention": random_attention_rows, "vase": vase_rows}


# ------------------------------------------------------------------------------------------ loops
def repetition_stats(ids: Sequence[int], n: int = 4, tail: int = 64, max_period: int = 32) -> dict[str, float]:
    """How repetitive one continuation is.

    Args:
        ids: token ids of the continuation.
        n: n-gram size.
        tail: length of the tail checked for a loop.
        max_period: longest loop period counted.

    Returns:
        `distinct`: unique n-grams / n-grams (1 = no repeated n-gram; NaN below n + 1 tokens);
        `loop`: 1.0 when the last `tail` tokens repeat with a period of at most `max_period` tokens
        (`ids[i] == ids[i - p]` throughout the tail), else 0.0 (a continuation shorter than `tail + max_period`
        tokens is checked on what it has).
    """
    ids = list(ids)
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    distinct = len(set(grams)) / len(grams) if len(grams) > 1 else float("nan")
    loop = 0.0
    t = min(tail, len(ids) - 1)
    if t >= 2 * n:
        for p in range(1, max_period + 1):
            if p < len(ids) and len(ids) - t >= p and all(ids[i] == ids[i - p] for i in range(len(ids) - t, len(ids))):
                loop = 1.0
                break
    return {"distinct": distinct, "loop": loop}


# ------------------------------------------------------------------------------------------ runner
@dataclass
class FaithfulConfig:
    """Settings of `run_table` (the flags of `benchmarks/faithful_tables.py`)."""

    table: str = "random_attention"
    rows: list[str] | None = None
    data: str | None = None
    model: str | None = None
    n_prompts: int = 2
    min_prompt_tokens: int = 129
    new_tokens: int = 1536
    kinds: list[str] = field(default_factory=lambda: ["sampled", "worked"])
    budgets: list[int] = field(default_factory=lambda: [64, 128, 256])
    short_budgets: list[int] = field(default_factory=lambda: [64, 128])
    short_tokens: int = 512
    seeds: list[int] = field(default_factory=lambda: [0])
    traces: str | None = None
    free_gen_prompts: int = 0
    free_gen_tokens: int = 256
    free_gen_budgets: list[int] = field(default_factory=lambda: [64, 128])
    threads: int | None = None
    out: str = "runs/faithful"
    command: str = ""


def _stochastic(pipe: Pipeline) -> bool:
    return any(isinstance(leaf, (RandomDrop, Sample)) for leaf in pipe.leaves)


def _references(cfg: FaithfulConfig, model, tok, log) -> tuple[list[dict], list[Trace]]:
    """(the questions of free generation, the traces): reused from `cfg.traces` (a fidelity run's traces.json)
    or made exactly as `kvcompose bench fidelity` makes them (same question choice, seed and repetition guard)."""
    from ..data import default_data_path, load_questions, resolve_questions
    from .run import select_questions

    path = cfg.data or default_data_path()
    if path is None:
        resolve_questions(None, None)  # raises the error that names --data and $KVCOMPOSE_GSM8K
    want = max(cfg.n_prompts, cfg.free_gen_prompts)
    selected = select_questions(tok, path, want, 0, cfg.min_prompt_tokens)
    if cfg.traces:
        saved = [Trace.from_dict(d) for d in json.loads(Path(cfg.traces).read_text())["items"]]
        traces = [t for kind in cfg.kinds for t in [s for s in saved if s.kind == kind][: cfg.n_prompts]]
        log(f"reusing {len(traces)} traces from {cfg.traces}")
        return selected, traces
    questions = selected[: cfg.n_prompts]
    chosen = {q["question"] for q in selected}
    pool = [q for q in load_questions(path, 200 + want, 0) if q["question"] not in chosen][:200]
    traces = []
    for kind in cfg.kinds:
        traces += make_traces(model, tok, questions, new_tokens=cfg.new_tokens, kind=kind, seed=0,
                              repetition_guard=RepetitionGuard(), pool=pool, progress=True)
    return selected, traces


def run_table(cfg: FaithfulConfig, log=print) -> dict[str, Any]:
    """Teacher-force every trace through every row of `cfg.table` at every budget (and seed, for rows that
    draw at random); optional free generation. Writes `<out>/<table>.json` and `.md`; returns the data."""
    from tqdm.auto import tqdm

    from .common import load_model, versions

    if cfg.table not in TABLES:
        raise KVComposeError(f"unknown table {cfg.table!r}; tables: {', '.join(TABLES)}")
    variants = TABLES[cfg.table]()
    if cfg.rows:
        unknown = set(cfg.rows) - {v.key for v in variants}
        if unknown:
            raise KVComposeError(f"unknown rows {sorted(unknown)}; {cfg.table} rows: {[v.key for v in variants]}")
        variants = [v for v in variants if v.key in cfg.rows]
    for v in variants:
        for b in cfg.budgets:
            p = v.build(b)
            if p is not None:
                p.validate(b)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(cfg.model)
    selected, traces = _references(cfg, model, tok, log)
    short = {t.id: t if not cfg.short_tokens or len(t.trace_ids) <= cfg.short_tokens else
             Trace(**{**t.to_dict(), "id": f"{t.id}[:{cfg.short_tokens}]", "trace_ids": t.trace_ids[: cfg.short_tokens]})
             for t in traces}
    data: dict[str, Any] = {
        "table": cfg.table, "config": {**cfg.__dict__}, "versions": versions(), "threads": torch.get_num_threads(),
        "model": cfg.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "prompt_lengths": [len(t.prompt_ids) for t in traces],
        "trace_ids": [t.id for t in traces], "trace_tokens": [len(t.trace_ids) for t in traces],
        "rows": [], "free_generation": [],
    }
    scores: dict[tuple[str, int, str], list] = {}
    seeds_of: dict[tuple[str, int], list[int]] = {}
    pipes: dict[tuple[str, int], Pipeline] = {}
    for v in variants:
        for b in cfg.budgets:
            p = v.build(b)
            if p is not None:
                pipes[(v.key, b)] = p
                seeds_of[(v.key, b)] = list(cfg.seeds) if _stochastic(p) else list(cfg.seeds[:1])
    jobs = [(t, v, b, s) for t in traces for v in variants for b in cfg.budgets if (v.key, b) in pipes
            for s in seeds_of[(v.key, b)]]
    for t, v, b, s in tqdm(jobs, desc=cfg.table, unit="run", dynamic_ncols=True):
        cache = KVComposeCache(model, pipes[(v.key, b)], budget=b, seed=s)
        tr = short[t.id] if b in cfg.short_budgets else t
        scores.setdefault((v.key, b, t.kind), []).append((s, evaluate_trace(model, tr, cache)))
        data["rows"] = _summaries(scores, pipes, variants)
        data["elapsed_s"] = time.perf_counter() - t_start
        (out / f"{cfg.table}.json").write_text(json.dumps(data, indent=1, default=str))

    if cfg.free_gen_prompts > 0 and cfg.free_gen_budgets:
        fq = selected[: cfg.free_gen_prompts]
        fjobs = [(v, b) for v in variants for b in cfg.free_gen_budgets if v.build(b) is not None]
        full_added = False
        for v, b in tqdm(fjobs, desc="free generation", unit="run", dynamic_ncols=True):
            pipe = v.build(b)
            res = free_generation(model, tok, fq, lambda: KVComposeCache(model, pipe, budget=b, seed=cfg.seeds[0]),
                                  max_new_tokens=cfg.free_gen_tokens)
            if not full_added:
                data["free_generation"].append(_free_row("full", None, res, tok, full=True))
                full_added = True
            data["free_generation"].append(_free_row(v.key, b, res, tok))
            data["elapsed_s"] = time.perf_counter() - t_start
            (out / f"{cfg.table}.json").write_text(json.dumps(data, indent=1, default=str))
    data["elapsed_s"] = time.perf_counter() - t_start
    (out / f"{cfg.table}.json").write_text(json.dumps(data, indent=1, default=str))
    (out / f"{cfg.table}.md").write_text(table_markdown(data))
    log(f"wrote {out / (cfg.table + '.json')} and .md in {data['elapsed_s']:.0f}s")
    return data


def _summaries(scores, pipes, variants) -> list[dict[str, Any]]:
    rows = []
    order = {v.key: i for i, v in enumerate(variants)}
    modes = {v.key: v.mode for v in variants}
    for (key, b, kind), items in sorted(scores.items(), key=lambda x: (order[x[0][0]], x[0][1], x[0][2])):
        res = FidelityResult([sc for _, sc in items])
        per_seed = {}
        for s in sorted({s for s, _ in items}):
            r = FidelityResult([sc for s2, sc in items if s2 == s])
            per_seed[str(s)] = {"top1": round(r.top1, 5), "kl_mean": round(r.kl_mean, 6)}
        pipe = pipes[(key, b)]
        rows.append({
            "method": key, "mode": modes[key], "budget": b, "kind": kind, "pipeline": repr(pipe),
            "interval": pipe.interval, "recent": next((p.n for p in pipe.protectors if isinstance(p, ProtectRecent)), None),
            **res.summary(),
            "per_trace": [{"id": sc.id, "seed": s, "top1": round(FidelityResult([sc]).top1, 5),
                           "kl_mean": round(FidelityResult([sc]).kl_mean, 6)} for s, sc in items],
            "per_seed": per_seed,
        })
    return rows


def _free_row(key: str, budget: int | None, res, tok, full: bool = False) -> dict[str, Any]:
    texts = [r.full_text if full else r.text for r in res.rows]
    stats = [repetition_stats(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    ok = [s["distinct"] for s in stats if s["distinct"] == s["distinct"]]
    summ = res.summary()
    return {
        "method": key, "budget": budget, "n": len(texts),
        "distinct4": sum(ok) / len(ok) if ok else float("nan"),
        "loop_share": sum(s["loop"] for s in stats) / max(1, len(stats)),
        "mean_new_tokens": (sum(r.full_new_tokens for r in res.rows) / max(1, len(res.rows))) if full
        else summ["mean_new_tokens"],
        "answer_agreement": None if full else summ["answer_agreement"],
        "per_prompt": [{"distinct4": s["distinct"], "loop": s["loop"]} for s in stats],
        "texts": texts,
    }


def _cell(r: dict | None, key: str, digits: int) -> str:
    return "-" if r is None else fmt(r.get(key), digits)


def table_markdown(data: dict[str, Any]) -> str:
    """The tables of one `run_table` result: top-1 / KL per trace kind, prompt recall, free generation."""
    rows = data["rows"]
    cfg = data["config"]
    budgets = sorted({r["budget"] for r in rows})
    keys: list[str] = []
    for r in rows:
        if r["method"] not in keys:
            keys.append(r["method"])
    mode = {r["method"]: r["mode"] for r in rows}
    kinds = [k for k in ("sampled", "worked", "greedy") if any(r["kind"] == k for r in rows)]
    n_tok = {}
    for r in rows:  # the most runs of any row per (budget, kind); rows with fewer say how many
        if r["n_traces"] > n_tok.get((r["budget"], r["kind"]), (0, 0))[0]:
            n_tok[(r["budget"], r["kind"])] = (r["n_traces"], r["n_tokens"])
    recent = {b: engine_recent(b) for b in budgets}
    out = [f"Model `{data['model']}`; traces {', '.join(sorted(set(data['trace_ids'])))}; "
           f"prompts of {min(data['prompt_lengths'])}-{max(data['prompt_lengths'])} tokens. "
           f"Every row compresses every {ENGINE_INTERVAL} decoded tokens (the reference engine's schedule) and "
           f"keeps the newest r tokens ({', '.join(f'r={recent[b]} at B={b}' for b in budgets)}). "
           f"Budgets in {cfg.get('short_budgets')} are scored on the first {cfg.get('short_tokens')} trace tokens. "
           f"Seeds {cfg.get('seeds')} for rows that draw at random (numbers pooled over seeds).", ""]
    for kind in kinds:
        counts = ", ".join(f"B={b}: {n_tok[(b, kind)][0]} runs / {n_tok[(b, kind)][1]} tokens"
                           for b in budgets if (b, kind) in n_tok)
        out += [f"#### {kind} traces: top-1 agreement / mean KL(full || method) in nats", "",
                f"({counts} per row, unless a cell says fewer; a run = one trace at one seed.)", "",
                "| row | reference mode | " + " | ".join(f"B={b}" for b in budgets) + " |",
                "|---|---|" + "---|" * len(budgets)]
        for k in keys:
            cells = []
            for b in budgets:
                r = next((x for x in rows if x["method"] == k and x["budget"] == b and x["kind"] == kind), None)
                few = "" if r is None or r["n_traces"] == n_tok[(b, kind)][0] else f" ({r['n_traces']} run)"
                cells.append("-" if r is None else f"{fmt(r['top1'])} / {fmt(r['kl_mean'], 4)}{few}")
            out.append(f"| {k} | `{mode[k]}` | " + " | ".join(cells) + " |")
        out.append("")
    out += ["#### Prompt recall (mean per-token log-prob of the restated question, minus the full cache's)", "",
            "| row | " + " | ".join(f"{kind} B={b}" for kind in kinds for b in budgets) + " |",
            "|---|" + "---|" * (len(kinds) * len(budgets))]
    for k in keys:
        cells = []
        for kind in kinds:
            for b in budgets:
                r = next((x for x in rows if x["method"] == k and x["budget"] == b and x["kind"] == kind), None)
                cells.append(_cell(r, "recall_delta", 2))
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    multi = [r for r in rows if len(r.get("per_seed", {})) > 1]
    if multi:
        out += ["", "#### Seed spread (top-1 / KL per seed)", "", "| row | budget | trace | per seed |", "|---|---|---|---|"]
        for r in multi:
            seeds = "; ".join(f"{s}: {fmt(v['top1'])} / {fmt(v['kl_mean'], 4)}" for s, v in r["per_seed"].items())
            out.append(f"| {r['method']} | {r['budget']} | {r['kind']} | {seeds} |")
    fg = data.get("free_generation") or []
    if fg:
        out += ["", f"#### Free generation ({fg[0]['n']} GSM8K questions, greedy, at most "
                f"{cfg.get('free_gen_tokens')} new tokens)", "",
                "distinct-4 = unique / all 4-grams of the continuation's tokens (mean over questions); looping = share "
                "of continuations whose last 64 tokens repeat with a period of at most 32 tokens.", "",
                "| row | budget | distinct-4 | looping | mean new tokens | answer agrees with full |",
                "|---|---|---|---|---|---|"]
        for r in fg:
            out.append(f"| {r['method']} | {fmt(r['budget'])} | {fmt(r['distinct4'])} | {fmt(r['loop_share'], 2)} | "
                       f"{fmt(r['mean_new_tokens'], 0)} | {fmt(r['answer_agreement'], 2)} |")
    out += ["", f"Command: `{cfg.get('command', '')}`"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line of `benchmarks/faithful_tables.py`."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", default="random_attention", choices=list(TABLES))
    ap.add_argument("--rows", nargs="+", default=None, help="a subset of the table's rows (default: all)")
    ap.add_argument("--data", default=None, help="GSM8K-style JSONL (default: $KVCOMPOSE_GSM8K)")
    ap.add_argument("--model", default=None, help="model path or name (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--n-prompts", type=int, default=2, help="questions (default 2)")
    ap.add_argument("--min-prompt-tokens", type=int, default=129,
                    help="only questions whose chat prompt has at least this many tokens (default 129)")
    ap.add_argument("--new-tokens", type=int, default=1536, help="trace tokens (default 1536)")
    ap.add_argument("--kinds", nargs="+", default=["sampled", "worked"], choices=["sampled", "greedy", "worked"])
    ap.add_argument("--budgets", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--short-budgets", nargs="+", type=int, default=[64, 128],
                    help="budgets scored on the first --short-tokens trace tokens (default 64 128)")
    ap.add_argument("--short-tokens", type=int, default=512)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds of rows that draw at random (default 0)")
    ap.add_argument("--traces", default=None, help="reuse the traces.json of a `kvcompose bench fidelity` run")
    ap.add_argument("--free-gen-prompts", type=int, default=0, help="questions for free generation (0 = none)")
    ap.add_argument("--free-gen-tokens", type=int, default=256)
    ap.add_argument("--free-gen-budgets", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="runs/faithful")
    args = ap.parse_args(argv)
    cfg = FaithfulConfig(**{k: v for k, v in vars(args).items()},
                         command="python benchmarks/faithful_tables.py " + " ".join(shlex.quote(a) for a in argv))
    return run_table(cfg)
