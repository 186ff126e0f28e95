"""Token-granular vs block-granular eviction: how much of each method survives in a paged engine (issue 17).

A paged serving engine (vLLM, SGLang) stores the KV cache in blocks of 16 positions behind block tables, so
an eviction policy there can only free whole blocks. `kvcompose.selectors.BlockGranular` wraps a preset's
selector so that it keeps or evicts whole blocks (`position // block`; block priority = mean or max of its
tokens' priorities; a protected token protects its block). This script measures what that costs, on the
fidelity bench's protocol (`docs/benchmarks.md`): reference traces of the full-cache model (sampled, and
GSM8K worked text), teacher-forced through a fresh cache per (method, budget, variant) in chunks of the
preset's own compression interval (exactly one-token decoding), scored per token against one full-cache
forward: top-1 agreement, mean KL(full || method), perplexity ratio, and the prompt-recall probe after the
trace. Budgets below the prompt (`--short-budgets`) are scored on the first `--short-tokens` trace tokens,
as in `kvcompose bench fidelity`.

Variants (`--variants`):
    token        the preset as it is (token-granular)
    head-mean    BlockGranular(selector, block, reduce="mean", per_head=True): blocks chosen per KV head
    layer-mean   BlockGranular(..., reduce="mean", per_head=False): one block set per layer row (all KV
                 heads keep the same blocks, one block table per layer as in vLLM)
    head-max     BlockGranular(..., reduce="max", per_head=True)
    layer-max    BlockGranular(..., reduce="max", per_head=False)
    request-mean one block set for every layer and KV head of the request (`kvcompose.bench.paged_blocks`:
                 `request_pipeline`, `RequestEvent`; VaSE's protection by `VotingValueProtect`)

The blocks (`BlockProtectValueNorm`, `RequestBlocks`, `VotingValueProtect`, `RequestEvent`) live in
`kvcompose.bench.paged_blocks`; this script only runs and tabulates them.

Besides fidelity, every compression event's kept tokens per (row, KV head) are recorded (the pipeline's
`Selection.kept`, wrapped), so the table also says how many tokens each variant really holds after an event
relative to its budget: block granularity can hold fewer (the last block that does not fit is dropped) or
more (a protected token keeps its whole block, up to `block - 1` extra tokens per protected run).

Resumable: results go to `<out>.json` after every run; rerunning the same command skips what is there
(another `--variants` list adds rows to the same file). `<out>.md` is rewritten from the JSON at the end
(`--render` only re-renders).

    KVCOMPOSE_GSM8K=path/to/gsm8k/test.jsonl python benchmarks/block_granular_table.py \\
        --n-prompts 3 --min-prompt-tokens 129 --traces runs/block_granular/traces.json \\
        --out docs/results/block_granular
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvcompose import KVComposeCache, KVComposeError  # noqa: E402
from kvcompose.data import default_data_path, load_questions  # noqa: E402
from kvcompose.bench.fidelity import evaluate_trace  # noqa: E402
from kvcompose.bench.run import load_model, select_questions, versions  # noqa: E402
from kvcompose.methods import preset  # noqa: E402
from kvcompose.traces import RepetitionGuard, Trace, make_traces  # noqa: E402
from kvcompose.bench.paged_blocks import RequestEvent, block_granular, request_pipeline  # noqa: E402
from kvcompose.pipeline import Pipeline  # noqa: E402

METHODS = ["h2o", "snapkv", "tova", "rkv", "vase", "random_attention"]
# "vase-tokenprot": VaSE wrapped as it is (its budget/4 value-protected tokens, scattered, each protect their
# whole block: the cache holds far more than the budget); "vase" wraps it with BlockProtectValueNorm instead
EXTRA_METHODS = ["vase-tokenprot"]
# token-granular reference rows: StreamingLLM (sinks + recent window) is block-aligned by nature, what a paged
# engine gets for free
REFERENCE_METHODS = ["streaming_llm"]
VARIANTS: dict[str, tuple[str, bool] | None] = {
    "token": None,
    "head-mean": ("mean", True),
    "layer-mean": ("mean", False),
    "head-max": ("max", True),
    "layer-max": ("max", False),
    "request-mean": ("mean", "request"),
    "layer-sync": ("mean", "layer"),  # harness check: RequestEvent with per-layer decisions == layer-mean
}
LABELS = {"token": "token", "head-mean": "block/head", "layer-mean": "block/layer", "head-max": "block/head (max)",
          "layer-max": "block/layer (max)", "request-mean": "block/request",
          "layer-sync": "block/layer (event check)"}


def build_pipeline(method: str, budget: int, variant: str, block: int) -> Pipeline:
    """The preset at the fidelity bench's settings (`methods.preset(name, budget=...)`), token-granular or wrapped in
    `BlockGranular` for a block variant (`kvcompose.bench.paged_blocks.block_granular`). VaSE's block variants
    also protect by blocks (`BlockProtectValueNorm`); "vase-tokenprot" keeps VaSE's token protector inside
    the block selector."""
    if variant not in VARIANTS:
        raise KVComposeError(f"unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")
    base = preset("vase" if method == "vase-tokenprot" else method, budget=budget)
    spec = VARIANTS[variant]
    if spec is None:
        return base
    reduce, per_head = spec
    if per_head in ("request", "layer"):
        raise KVComposeError("the request-wide variant is built by build_request_pipeline")
    return block_granular(base, block, reduce, per_head, block_protection=method == "vase")


def build_request_pipeline(method: str, budget: int, block: int, scope: str = "request",
                           interval: int | None = None) -> tuple[Pipeline, RequestEvent]:
    """(pipeline, event) of the request-wide variant (`kvcompose.bench.paged_blocks.request_pipeline`);
    `scope="layer"` is the harness check. `interval`: decoded tokens between events (default the preset's,
    else 64, as `KVComposeCache`)."""
    base = preset("vase" if method == "vase-tokenprot" else method, budget=budget)
    return request_pipeline(base, budget, block, scope, interval, block_protection=method == "vase")


class KeptRecorder:
    """Records the kept tokens per (row, KV head) of every compression event of one pipeline (all layers),
    by wrapping its `select`. `summary()`: events, mean kept / budget, max kept - budget, share of
    (event, layer, head) cells above / below the budget. Events with more than `max_seen` tokens seen (after
    the trace: the recall probe's forward can end an interval) and those for which `skip()` is true are not
    counted."""

    def __init__(self, pipe: Pipeline, skip=None, max_seen: int | None = None):
        self.cells = 0
        self.kept_sum = 0.0
        self.budget_sum = 0.0
        self.max_over = -10**9
        self.min_kept_minus_budget = 10**9
        self.above = 0
        self.below = 0
        self.events = 0
        inner = pipe.select

        def select(view, budget, states=None, channels=None):
            sel, new = inner(view, budget, states, channels)
            if (skip is not None and skip()) or (max_seen is not None and view.seen > max_seen):
                return sel, new  # a record pass, or the event after the recall probe (not part of the trace)
            n = (sel.kept >= 0).sum(-1)  # [B, H]
            rows = view.valid.any(-1)  # heads of a row hold tokens; every row is real here (batch 1)
            n, bud = n[rows].float(), sel.budget.expand_as(rows)[rows].float()
            self.events += 1
            self.cells += n.numel()
            self.kept_sum += float(n.sum())
            self.budget_sum += float(bud.sum())
            self.max_over = max(self.max_over, int((n - bud).max()))
            self.min_kept_minus_budget = min(self.min_kept_minus_budget, int((n - bud).min()))
            self.above += int((n > bud).sum())
            self.below += int((n < bud).sum())
            return sel, new

        pipe.select = select  # instance attribute: the layers call pipeline.select

    def summary(self) -> dict[str, Any]:
        if not self.cells:
            return {"events": 0}
        return {"events": self.events, "cells": self.cells, "kept_sum": self.kept_sum, "budget_sum": self.budget_sum,
                "kept_over_budget_max": self.max_over, "kept_under_budget_max": -self.min_kept_minus_budget,
                "cells_above": self.above, "cells_below": self.below}


def traces_digest(traces: list[Trace]) -> dict[str, str]:
    """A short hash of each trace's tokens, by trace id (a results file only merges runs on equal traces)."""
    return {t.id: hashlib.sha256(json.dumps([t.prompt_ids, t.trace_ids, t.recall_ids, t.recall_target_ids]).encode())
            .hexdigest()[:16] for t in traces}


def record(score, method: str, budget: int, variant: str, kept: dict[str, Any], pipe: Pipeline,
           interval: int) -> dict[str, Any]:
    n = len(score.top1)
    rec = None
    if score.recall_logprob is not None and score.recall_logprob_full is not None:
        rec = score.recall_logprob - score.recall_logprob_full
    return {
        "method": method, "budget": budget, "variant": variant, "kind": score.kind, "trace": score.id,
        "interval": interval, "pipeline": repr(pipe), "n_tokens": n,
        "top1_sum": float(sum(score.top1)), "kl_sum": float(sum(score.kl)),
        "nll_sum": float(sum(score.nll)), "nll_full_sum": float(sum(score.nll_full)),
        "recall_delta": rec, "peak_held_tokens": score.max_held_tokens, "peak_kv_bytes": score.max_kv_bytes,
        "full_kv_bytes": score.full_kv_bytes, "seconds": round(score.seconds, 2), **kept,
    }


# ------------------------------------------------------------------------------------------ aggregation
def aggregate(runs: list[dict[str, Any]], kinds: list[str] | None = None) -> dict[tuple, dict[str, Any]]:
    """Pool the per-trace records per (method, budget, variant, kind) (kind "all" pools the kinds):
    token-weighted top-1 and KL, perplexity ratio over all tokens, mean recall over traces, kept tokens."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if kinds is not None and r["kind"] not in kinds:
            continue
        for kind in (r["kind"], "all"):
            groups.setdefault((r["method"], r["budget"], r["variant"], kind), []).append(r)
    out = {}
    for key, rs in groups.items():
        n = sum(r["n_tokens"] for r in rs)
        recs = [r["recall_delta"] for r in rs if r["recall_delta"] is not None]
        cells = sum(r.get("cells", 0) for r in rs)
        out[key] = {
            "n_traces": len(rs), "n_tokens": n,
            "top1": sum(r["top1_sum"] for r in rs) / n, "kl_mean": sum(r["kl_sum"] for r in rs) / n,
            "ppl_ratio": math.exp((sum(r["nll_sum"] for r in rs) - sum(r["nll_full_sum"] for r in rs)) / n),
            "recall_delta": sum(recs) / len(recs) if recs else None,
            "kept_per_budget": (sum(r.get("kept_sum", 0) for r in rs) / sum(r.get("budget_sum", 0) for r in rs))
            if cells else None,
            "kept_over_budget_max": max((r.get("kept_over_budget_max", 0) for r in rs), default=0) if cells else None,
            "kept_under_budget_max": max((r.get("kept_under_budget_max", 0) for r in rs), default=0) if cells else None,
            "share_above": sum(r.get("cells_above", 0) for r in rs) / cells if cells else None,
            "peak_held_tokens": max(r["peak_held_tokens"] for r in rs),
            "per_trace": [{"trace": r["trace"], "top1": r["top1_sum"] / r["n_tokens"], "kl": r["kl_sum"] / r["n_tokens"]}
                          for r in rs],
        }
    return out


def rows_of(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pooled rows (`aggregate`) as a JSON-ready list."""
    return [{"method": m, "budget": b, "variant": v, "kind": k, **a} for (m, b, v, k), a in aggregate(runs).items()]


def _f(x: float | None, d: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if d and x != 0 and abs(x) < 10 ** (-d):
        return f"{x:.1e}"
    return f"{x:.{d}f}"


def _signed(x: float | None, d: int = 2) -> str:
    return "-" if x is None else f"{x:+.{d}f}"


MAIN_VARIANTS = ["token", "head-mean", "layer-mean", "request-mean"]


def base_id(trace_id: str) -> str:
    """The trace a (possibly truncated, "<id>[:512]") trace comes from."""
    return trace_id.split("[:")[0]


def complete_traces(runs: list[dict[str, Any]], methods: list[str], budgets: list[int], variants: list[str]) -> list[str]:
    """Trace ids with a run for every (method, budget, variant): the main tables pool exactly these."""
    have: dict[str, set] = {}
    for r in runs:
        have.setdefault(base_id(r["trace"]), set()).add((r["method"], r["budget"], r["variant"]))
    need = {(m, b, v) for m in methods for b in budgets for v in variants}
    return [t for t, got in have.items() if need <= got]


def _grid(agg, methods, budgets, variants, kind, cell) -> list[str]:
    lines = ["| method | " + " | ".join(f"B={b} {LABELS[v]}" for b in budgets for v in variants) + " |",
             "|---|" + "---|" * (len(budgets) * len(variants))]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(cell(agg.get((m, b, v, kind))) for b in budgets for v in variants) + " |")
    return lines


def _fid(a) -> str:
    return f"{_f(a['top1'])} / {_f(a['kl_mean'], 4)}" if a else "-"


def _kept(a) -> str:
    if not a or a["kept_per_budget"] is None:
        return "-"
    return f"{a['kept_per_budget']:.3f} (+{max(0, a['kept_over_budget_max'])}, {100 * a['share_above']:.0f}%)"


def render(data: dict[str, Any]) -> str:
    """Markdown tables of a results dict (the JSON this script writes). The main tables pool the traces that
    have every (method, budget, variant) of the main variants; other variants follow, each on its traces."""
    runs = data["runs"]
    cfg = data["config"]
    budgets = sorted({r["budget"] for r in runs})
    main_v = [v for v in MAIN_VARIANTS if any(r["variant"] == v and r["method"] in METHODS for r in runs)]
    methods = [m for m in METHODS if any(r["method"] == m and r["variant"] in main_v for r in runs)]
    done = complete_traces(runs, methods, budgets, main_v)
    main_runs = [r for r in runs if base_id(r["trace"]) in done and r["variant"] in main_v and r["method"] in methods]
    agg = aggregate(main_runs)
    refs = [m for m in REFERENCE_METHODS if set(done) <= set(complete_traces(runs, [m], budgets, ["token"]))]
    agg.update(aggregate([r for r in runs if r["method"] in refs and r["variant"] == "token"
                          and base_id(r["trace"]) in done]))
    kinds = [k for k in ("sampled", "worked", "greedy") if any(r["kind"] == k for r in main_runs)]
    short = set(cfg.get("short_budgets", []))
    plen = dict(zip(data["trace_ids"], data["prompt_lengths"]))
    lens = [plen[t] for t in done if t in plen] or [0]
    questions = sorted({t.split("/")[0] for t in done})
    intervals = ", ".join(f"{m} {i}" for m, i in sorted({(r["method"], r["interval"]) for r in main_runs
                                                         if r["variant"] == "token"}))
    ntok = {b: (agg.get((methods[0], b, main_v[0], "all")) or {}).get("n_tokens") for b in budgets} if methods else {}
    lines = [
        f"Model: {data['model']}. {len(questions)} GSM8K test questions ({', '.join(questions)}; chat prompts of "
        f"{min(lens)}-{max(lens)} tokens), {len(done)} traces ({', '.join(kinds)}). "
        f"Budgets {', '.join(str(b) for b in budgets if b in short) or '-'} (below every prompt) are scored on the "
        f"first {cfg['short_tokens']} trace tokens, the others on all {cfg['new_tokens']}: "
        + ", ".join(f"{ntok[b]} scored tokens per cell at B={b}" for b in budgets) + " (both kinds pooled). "
        f"Block = {cfg['block']} positions. Each preset at its own compression interval ({intervals}).",
        "",
        "Commands (one results file; each adds its rows):",
        "",
        "```bash",
        *[f"KVCOMPOSE_GSM8K=path/to/gsm8k/test.jsonl {c}" for c in data.get("commands", [data["command"]])],
        "```",
        "",
        "Variants: token = the preset; block/head = `BlockGranular(selector, 16)` (blocks per KV head); "
        "block/layer = `per_head=False` (one block set per layer row); block/request = one block set for every "
        "layer and KV head of the request (a post-step event over all layers, block priority averaged over "
        "layers and heads). Block VaSE protects its budget/4 value-range tokens as whole blocks. "
        + (f"{', '.join(refs)}: token-granular reference (sinks + recent window, block-aligned by nature)." if refs else ""),
        "",
    ]
    for kind in kinds + ["all"]:
        lines += [f"### Top-1 agreement / mean KL(full ‖ method), {kind if kind != 'all' else 'both kinds pooled'}", ""]
        lines += _grid(agg, methods + refs, budgets, main_v, kind, _fid) + [""]
    blocks = [v for v in main_v if v != "token"]
    if "token" in main_v and blocks:
        lines += ["### What block granularity costs (both kinds pooled)", "",
                  "Top-1 change in points (block − token) / KL ratio (block ÷ token); +0.0 / 1.00x = nothing lost.", ""]

        def cost(m, b, v):
            a, t = agg.get((m, b, v, "all")), agg.get((m, b, "token", "all"))
            if not a or not t:
                return "-"
            return f"{100 * (a['top1'] - t['top1']):+.1f} / {a['kl_mean'] / t['kl_mean']:.2f}x"

        lines += ["| method | " + " | ".join(f"B={b} {LABELS[v]}" for b in budgets for v in blocks) + " |",
                  "|---|" + "---|" * (len(budgets) * len(blocks))]
        lines += [f"| {m} | " + " | ".join(cost(m, b, v) for b in budgets for v in blocks) + " |" for m in methods]
        lines.append("")
    lines += ["### Prompt recall (method − full, nats per question token; both kinds pooled)", ""]
    lines += _grid(agg, methods + refs, budgets, main_v, "all", lambda a: _signed((a or {}).get("recall_delta")))
    lines += ["", "Budgets below the prompt: the probe follows the short trace "
              f"({cfg['short_tokens']} tokens), not the whole one.", ""]
    lines += ["### Kept tokens after a compression event", "",
              "Mean kept tokens per (layer, KV head) / budget, over every event of every trace; in brackets the "
              "largest excess of one head over the budget (tokens) and the share of (event, layer, head) cells "
              "above the budget.", ""]
    lines += _grid(agg, methods, budgets, main_v, "all", _kept) + [""]
    # other variants / methods, each with the token row on the same traces
    extra = [r for r in runs if (r["variant"] not in main_v or r["method"] not in methods)
             and not (r["method"] in refs and r["variant"] == "token")]
    if extra:
        lines += ["### Other rows (each on the traces it was run on, next to the token row on the same traces)", "",
                  "| method | variant | budget | traces | top-1 / KL | token top-1 / KL | recall | token recall | "
                  "kept / budget |", "|---|---|---|---|---|---|---|---|---|"]
        keys = sorted({(r["method"], r["variant"], r["budget"]) for r in extra},
                      key=lambda k: (k[0], list(VARIANTS).index(k[1]), k[2]))
        for m, v, b in keys:
            rs = [r for r in extra if (r["method"], r["variant"], r["budget"]) == (m, v, b)]
            ids = {r["trace"] for r in rs}
            tok_m = "vase" if m == "vase-tokenprot" else m
            tok = [r for r in runs if r["method"] == tok_m and r["variant"] == "token" and r["budget"] == b
                   and r["trace"] in ids]
            a = aggregate(rs)[(m, b, v, "all")]
            t = aggregate(tok).get((tok_m, b, "token", "all")) if len(tok) == len(rs) else None
            lines.append(f"| {m} | {LABELS[v]} | {b} | {len(rs)} | {_fid(a)} | {_fid(t)} | "
                         f"{_signed(a['recall_delta'])} | {_signed((t or {}).get('recall_delta'))} | {_kept(a)} |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="GSM8K-style JSONL (default: $KVCOMPOSE_GSM8K)")
    ap.add_argument("--model", default=None, help="Hugging Face model (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--min-prompt-tokens", type=int, default=129,
                    help="only questions whose chat prompt has at least this many tokens (129: B=128 is below it)")
    ap.add_argument("--new-tokens", type=int, default=1536)
    ap.add_argument("--kinds", nargs="+", default=["sampled", "worked"], choices=["sampled", "worked", "greedy"])
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + EXTRA_METHODS + REFERENCE_METHODS)
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--short-budgets", type=int, nargs="*", default=[128],
                    help="budgets scored on the first --short-tokens tokens (below the prompt)")
    ap.add_argument("--short-tokens", type=int, default=512)
    ap.add_argument("--variants", nargs="+", default=MAIN_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--interval", type=int, default=None,
                    help="compression interval for every preset (default: each preset's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=int, default=200, help="other questions chained into the worked traces")
    ap.add_argument("--traces", default=None, help="reference traces JSON: loaded if it exists, else written")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/block_granular/block_granular",
                    help="output stem: <out>.json and <out>.md")
    ap.add_argument("--render", action="store_true", help="only rewrite <out>.md from <out>.json")
    args = ap.parse_args(argv)

    out_json, out_md = Path(args.out + ".json"), Path(args.out + ".md")
    if args.render:
        data = json.loads(out_json.read_text())
        data["rows"] = rows_of(data["runs"])
        out_json.write_text(json.dumps(data, indent=1))
        out_md.write_text(render(data))
        print(f"wrote {out_md}")
        return data
    torch.set_num_threads(args.threads)
    for m in args.methods:
        for b in args.budgets:
            for v in args.variants:
                if VARIANTS[v] is not None and VARIANTS[v][1] in ("request", "layer"):
                    build_request_pipeline(m, b, args.block, VARIANTS[v][1])[0].validate(b)
                else:
                    build_pipeline(m, b, v, args.block).validate(b)
    data_path = args.data or default_data_path()
    if data_path is None:
        raise KVComposeError("no questions: pass --data or set $KVCOMPOSE_GSM8K to a GSM8K test.jsonl")

    t_start = time.perf_counter()
    model, tok = load_model(args.model, args.dtype, args.device)
    model_name = args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)"
    if args.traces and Path(args.traces).exists():
        saved = [Trace.from_dict(d) for d in json.loads(Path(args.traces).read_text())["items"]]
        traces = [t for kind in args.kinds for t in saved if t.kind == kind]
        traces = [t for kind in args.kinds for t in [x for x in traces if x.kind == kind][: args.n_prompts]]
        print(f"reusing {len(traces)} traces from {args.traces}")
    else:
        questions = select_questions(tok, data_path, args.n_prompts, args.offset, args.min_prompt_tokens)
        chosen = {q["question"] for q in questions}
        pool = [q for q in load_questions(data_path, args.pool + len(questions), args.offset)
                if q["question"] not in chosen][: args.pool]
        traces = []
        for kind in args.kinds:
            traces += make_traces(model, tok, questions, new_tokens=args.new_tokens, kind=kind, seed=args.seed,
                                  repetition_guard=RepetitionGuard(1.1, 0), pool=pool, progress=True)
        if args.traces:
            Path(args.traces).parent.mkdir(parents=True, exist_ok=True)
            Path(args.traces).write_text(json.dumps(
                {"model": model_name, "items": [t.to_dict() | {"text": tok.decode(t.trace_ids)} for t in traces]}))
        print(f"{len(traces)} traces in {time.perf_counter() - t_start:.0f}s")
    digest = traces_digest(traces)

    # the same command line, without machine paths (the data file is named by the environment variable)
    cmd_args = [a for a in (argv if argv is not None else sys.argv[1:])]
    command = "python benchmarks/block_granular_table.py " + " ".join(cmd_args)
    data: dict[str, Any] = {
        "model": model_name, "config": {k: v for k, v in vars(args).items() if k not in ("data", "render")},
        "data": "$KVCOMPOSE_GSM8K" if not args.data else Path(args.data).name,
        "versions": versions(), "device": args.device, "threads": torch.get_num_threads(),
        "traces_digest": digest, "n_traces": len(traces),
        "prompt_lengths": [len(t.prompt_ids) for t in traces], "trace_ids": [t.id for t in traces],
        "command": command, "runs": [],
    }
    if out_json.exists():
        old = json.loads(out_json.read_text())
        clash = [i for i, d in digest.items() if old.get("traces_digest", {}).get(i, d) != d]
        if clash:
            raise KVComposeError(f"{out_json} was measured on other traces with the ids {clash}; use another --out "
                                 "or the same --traces")
        data["traces_digest"] = {**old["traces_digest"], **digest}
        data["trace_ids"] = list(dict.fromkeys([*old["trace_ids"], *data["trace_ids"]]))
        data["prompt_lengths"] = old["prompt_lengths"] if len(old["trace_ids"]) >= len(traces) else data["prompt_lengths"]
        data["n_traces"] = len(data["trace_ids"])
        data["runs"] = old["runs"]
        data["config"]["methods"] = list(dict.fromkeys([*old["config"]["methods"], *args.methods]))
        data["config"]["variants"] = list(dict.fromkeys([*old["config"]["variants"], *args.variants]))
        data["commands"] = list(dict.fromkeys([*old.get("commands", [old.get("command", "")]), command]))
    else:
        data["commands"] = [command]
    done = {(r["method"], r["budget"], r["variant"], r["trace"]) for r in data["runs"]}
    out_json.parent.mkdir(parents=True, exist_ok=True)

    short = {t.id: t if len(t.trace_ids) <= args.short_tokens else
             Trace(**{**t.to_dict(), "id": f"{t.id}[:{args.short_tokens}]", "trace_ids": t.trace_ids[: args.short_tokens]})
             for t in traces}
    by_kind = [[t for t in traces if t.kind == k] for k in args.kinds]
    order = [t for group in zip(*by_kind) for t in group]  # sampled-0, worked-0, sampled-1, ...
    combos = [(m, b, v) for m in args.methods for b in args.budgets for v in args.variants]
    total = len(order) * len(combos)
    k = 0
    for trace in order:
        for m, b, v in combos:
            k += 1
            tr = short[trace.id] if b in args.short_budgets else trace
            if (m, b, v, tr.id) in done:
                continue
            t0 = time.perf_counter()
            max_seen = len(tr.prompt_ids) + len(tr.trace_ids) - 1  # tokens fed before the recall probe
            if VARIANTS[v] is not None and VARIANTS[v][1] in ("request", "layer"):
                pipe, event = build_request_pipeline(m, b, args.block, VARIANTS[v][1], args.interval)
                recorder = KeptRecorder(pipe, skip=lambda: event.mode == "record", max_seen=max_seen)
                cache = KVComposeCache(model, pipe, budget=b, seed=args.seed)
                with event.attached(model, cache):
                    score = evaluate_trace(model, tr, cache, chunk=event.interval)
                interval = event.interval
            else:
                pipe = build_pipeline(m, b, v, args.block)
                recorder = KeptRecorder(pipe, max_seen=max_seen)
                cache = KVComposeCache(model, pipe, budget=b, interval=args.interval, seed=args.seed)
                score = evaluate_trace(model, tr, cache)
                interval = cache.interval
            data["runs"].append(record(score, m, b, v, recorder.summary(), pipe, interval))
            data["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            out_json.write_text(json.dumps(data, indent=1))
            r = data["runs"][-1]
            print(f"[{k}/{total}] {tr.id} {m}@{b} {v}: top1 {r['top1_sum'] / r['n_tokens']:.3f} "
                  f"KL {r['kl_sum'] / r['n_tokens']:.4f} recall {_signed(r['recall_delta'])} "
                  f"kept/budget {r.get('kept_sum', 0) / max(1, r.get('budget_sum', 1)):.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    data["rows"] = rows_of(data["runs"])
    out_json.write_text(json.dumps(data, indent=1))
    out_md.write_text(render(data))
    print(f"wrote {out_json} and {out_md} in {time.perf_counter() - t_start:.0f}s")
    return data


if __name__ == "__main__":
    main()
