"""Accuracy against KV budget, the way the reasoning-model papers report it (`kvcompose bench accuracy`).

For every question, method, budget and sample the model generates a solution with a fresh `KVComposeCache`
(the full cache is `methods.full()` through the same attention path), and the answer is graded against the
reference by `kvcompose.bench.grading.grade` (math-verify + GSM8K's `#### n` + a last-number fallback).

Protocol:

- **Prompt**: the model's chat template (`kvcompose.models.chat_inputs`) around `prompt.format(question=...)`,
  by default DeepSeek-R1's recommendation: "Please reason step by step, and put your final answer within
  \\boxed{}." (the grader also accepts `#### n`). A tokenizer without a chat template gets the plain text.
- **Batches**: questions are cut into batches of `batch_size` in dataset order and generated together with
  LEFT padding. The batch is the unit of work: its composition is the same for every method, budget and
  sample, and under `accelerate launch` batch `k` goes to rank `k % world_size`, so a question's row sees the
  same padding and neighbours whatever the number of processes (results equal a 1-process run's).
- **Sampling**: greedy when `temperature == 0`. Otherwise each row samples with its own generator seeded by
  `(seed, question id, sample index)` (`row_seed`), inside a logits processor (`RowSampler`: temperature,
  top-p, inverse-CDF draw): the full cache and every compressed run of the same sample use the same random
  numbers (common random numbers), independently of batch composition.
- **Records**: one JSON line per (question, method, budget, sample), appended (and flushed) after each batch
  to `OUT/records/part-<rank>.jsonl`. A rerun reads every record already in `OUT` and skips them (resumable).
  When all ranks are done, the main process merges them into `OUT/records.jsonl`, adds the agreement with the
  full cache on the same sample, and writes `accuracy.json`, `accuracy.md` and two plots.
- **Peak KV per request**: `cache.memory().peak["hbm"]` covers the whole batch (buffers are `[B, H, T, D]`,
  left-padding slots included until the first compression drops them): the record holds that peak divided by
  the batch's rows, i.e. what the batch cost per request. `seconds` is likewise the batch's wall time divided
  by its rows; tokens/s of a (method, budget) is its generated tokens over the summed batch times.
- **Accuracy**: mean over samples of the share of questions answered correctly, with a 95% Wilson score
  interval taking the number of questions as n (several samples of one question are not independent; with
  more than one sample the interval is conservative).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..view import KVComposeError

__all__ = ["AccuracyConfig", "run_accuracy", "summarize", "merge_records", "wilson_interval", "row_seed",
           "RowSampler", "DEFAULT_PROMPT", "record_key"]

DEFAULT_PROMPT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


@dataclass
class AccuracyConfig:
    """Settings of `run_accuracy` (the flags of `kvcompose bench accuracy`)."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    device_map: str | None = None
    data: str | None = None
    dataset: str | None = None
    limit: int | None = None
    offset: int = 0
    methods: list[str] = field(default_factory=lambda: ["full", "rkv"])
    budgets: list[int] = field(default_factory=lambda: [128, 256, 512])
    interval: int | None = None
    samples: int = 1
    max_new_tokens: int = 1024
    batch_size: int = 8
    temperature: float = 0.0
    top_p: float = 0.95
    seed: int = 0
    prompt: str = DEFAULT_PROMPT
    save_text: bool = True
    threads: int | None = None
    progress: bool = True
    out: str = "runs/accuracy"
    command: str = ""


def record_key(rec: dict[str, Any]) -> tuple:
    """The identity of a record: (question id, method, budget or None, sample index)."""
    return (str(rec["id"]), rec["method"], rec["budget"], int(rec["sample"]))


def row_seed(seed: int, item_id: str, sample: int) -> int:
    """The sampling seed of one (question, sample): the same for the full cache and every method."""
    h = hashlib.sha256(f"{seed}/{item_id}/{sample}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


class RowSampler:
    """A transformers logits processor that samples every row with its own generator (temperature, nucleus
    top-p of Holtzman et al., 2020, then an inverse-CDF draw over the vocabulary in index order) and returns
    scores `[B, V]` that are 0 at the drawn token and -inf elsewhere, so that greedy decoding
    (`do_sample=False`) picks the drawn token.

    Two runs whose rows share a seed draw the same uniform numbers at every step; when their distributions
    are close they pick the same tokens (common random numbers), whatever the batch they are in.

    Args:
        seeds: one seed per batch row (`row_seed`).
        temperature: > 0.
        top_p: nucleus mass in (0, 1].
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float = 1.0):
        if temperature <= 0:
            raise KVComposeError(f"RowSampler needs temperature > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise KVComposeError(f"top_p must be in (0, 1], got {top_p}")
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature, self.top_p = float(temperature), float(top_p)

    def __call__(self, input_ids: Int[Tensor, "B T"] | None, scores: Float[Tensor, "B V"]) -> Float[Tensor, "B V"]:
        if scores.shape[0] != len(self.generators):
            raise KVComposeError(f"RowSampler has {len(self.generators)} seeds for {scores.shape[0]} rows")
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)
            drop_sorted = (sp.cumsum(-1) - sp) >= self.top_p  # keep the smallest prefix with mass >= top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, si, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        cdf = probs.cumsum(-1)
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in self.generators])
        target = (u.to(cdf.device, torch.float32) * cdf[:, -1])[:, None]
        idx = torch.searchsorted(cdf, target).clamp_max(cdf.shape[-1] - 1)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter(-1, idx, 0.0)


def wilson_interval(p: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (Wilson, 1927; 95% by default) of a proportion `p` observed on `n` trials.
    Unlike the normal approximation it stays inside [0, 1] and is not empty at p = 0 or 1."""
    if n <= 0 or math.isnan(p):
        return (float("nan"), float("nan"))
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, centre - half), min(1.0, centre + half))


# ------------------------------------------------------------------------------------------ records
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.exists():
        return out
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by an interrupted run: it will be redone
                continue
    return out


def _all_records(out: Path) -> list[dict[str, Any]]:
    recs = _read_jsonl(out / "records.jsonl")
    for p in sorted((out / "records").glob("part-*.jsonl")):
        recs += _read_jsonl(p)
    return recs


def merge_records(records: list[dict[str, Any]], order: list[str] | None = None) -> list[dict[str, Any]]:
    """Deduplicate by `record_key` (first wins), add `agree_full` (the answer agrees with the full cache's on
    the same question and sample; None for the full cache or when it has no record) and sort by method
    (in `order`), budget, question id order of first appearance, sample."""
    from .grading import answers_agree

    seen: dict[tuple, dict[str, Any]] = {}
    for r in records:
        seen.setdefault(record_key(r), dict(r))
    full = {(k[0], k[3]): r for k, r in seen.items() if k[1] == "full"}
    id_order: dict[str, int] = {}
    for r in sorted(seen.values(), key=lambda r: r.get("index", 0)):
        id_order.setdefault(str(r["id"]), len(id_order))
    for k, r in seen.items():
        f = full.get((k[0], k[3]))
        r["agree_full"] = None if k[1] == "full" or f is None else answers_agree(r.get("pred"), f.get("pred"))
    morder = {m: i for i, m in enumerate(order or [])}
    return sorted(seen.values(), key=lambda r: (morder.get(r["method"], len(morder)), r["method"],
                                                -1 if r["budget"] is None else r["budget"],
                                                id_order[str(r["id"])], r["sample"]))


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, budget): accuracy (mean over samples) with its Wilson interval, per-sample accuracies,
    agreement with the full cache, mean generated tokens, peak KV bytes per request, tokens/s.
    `records` are merged records (`merge_records`)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["method"], r["budget"]), []).append(r)
    full_kv = [r["peak_kv_bytes"] for r in records if r["method"] == "full"]
    full_kv_mean = sum(full_kv) / len(full_kv) if full_kv else float("nan")
    rows = []
    for (m, b), rs in groups.items():
        by_sample: dict[int, list[bool]] = {}
        for r in rs:
            by_sample.setdefault(int(r["sample"]), []).append(bool(r["correct"]))
        per_sample = [sum(v) / len(v) for _, v in sorted(by_sample.items())]
        acc = sum(per_sample) / len(per_sample)
        n_items = len({str(r["id"]) for r in rs})
        lo, hi = wilson_interval(acc, n_items)
        agree = [r["agree_full"] for r in rs if r.get("agree_full") is not None]
        secs = sum(r["seconds"] for r in rs)
        toks = sum(r["new_tokens"] for r in rs)
        kv = sum(r["peak_kv_bytes"] for r in rs) / len(rs)
        rows.append({
            "method": m, "budget": b, "n_items": n_items, "n_samples": len(per_sample), "n": len(rs),
            "accuracy": acc, "ci_low": lo, "ci_high": hi, "accuracy_per_sample": per_sample,
            "agreement": sum(agree) / len(agree) if agree else None,
            "mean_new_tokens": toks / len(rs), "eos_share": sum(bool(r["hit_eos"]) for r in rs) / len(rs),
            "peak_kv_bytes": kv, "peak_kv_bytes_max": max(r["peak_kv_bytes"] for r in rs),
            "kv_vs_full": kv / full_kv_mean if full_kv else None,
            "tokens_per_s": toks / secs if secs else None, "seconds": secs,
        })
    return rows


# ------------------------------------------------------------------------------------------ distributed
class _Dist:
    """Rank, world size and a barrier: `accelerate`'s PartialState under `accelerate launch` (gloo on CPU,
    NCCL on GPUs), a single process otherwise."""

    def __init__(self, device: str = "cpu"):
        self.state = None
        self.rank, self.world, self.local_rank = 0, 1, 0
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            try:
                from accelerate import PartialState
            except ImportError:
                raise KVComposeError("WORLD_SIZE > 1 needs `accelerate` (pip install 'kvcompose[eval]')") from None
            # accelerate picks gloo only when told the processes run on CPU (its env flag is not enough)
            cpu = device.startswith("cpu") or not torch.cuda.is_available()
            self.state = PartialState(cpu=cpu)
            if self.state.num_processes != int(os.environ["WORLD_SIZE"]):
                raise KVComposeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but accelerate set up "
                                     f"{self.state.num_processes} process(es) ({self.state.distributed_type})")
            self.rank, self.world = self.state.process_index, self.state.num_processes
            self.local_rank = self.state.local_process_index

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()


# ------------------------------------------------------------------------------------------ generation
def _load(cfg: AccuracyConfig, dist: _Dist):
    from .common import _DTYPES, load_model

    device = cfg.device
    if dist.world > 1 and device.startswith("cuda") and ":" not in device:
        device = f"cuda:{dist.local_rank}"
    if cfg.device_map is not None:
        if dist.world > 1:
            raise KVComposeError("--device-map spreads one model over all devices; with accelerate launch run one "
                                 "process (--num_processes 1) or drop --device-map")
        if cfg.model is None:
            raise KVComposeError("--device-map needs --model (a Hugging Face model name or directory)")
        if cfg.dtype not in _DTYPES:
            raise KVComposeError(f"dtype must be one of {sorted(_DTYPES)}, got {cfg.dtype!r}")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=_DTYPES[cfg.dtype], device_map=cfg.device_map)
        return model.eval(), AutoTokenizer.from_pretrained(cfg.model)
    return load_model(cfg.model, cfg.dtype, device)


def _input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def _encode(tok, prompts: list[str], device) -> dict[str, torch.Tensor]:
    from ..models import chat_inputs

    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if getattr(tok, "chat_template", None):
        return chat_inputs(tok, prompts, device=device)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    return {k: v.to(device) for k, v in enc.items()}


def _eos_ids(model, tok) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None and not ids:
        ids.add(tok.eos_token_id)
    return ids


@torch.no_grad()
def generate_batch(model, tok, questions: list[str], cache, max_new_tokens: int, prompt: str = DEFAULT_PROMPT,
                   seeds: list[int] | None = None, temperature: float = 0.0, top_p: float = 1.0) -> dict[str, Any]:
    """Generate solutions for a left-padded batch of questions with `cache` (greedy, or `RowSampler` with one
    seed per row). Returns texts, generated lengths (up to the first end-of-sequence token), whether each row
    ended at end-of-sequence, prompt lengths and the wall time of `generate`."""
    from transformers import LogitsProcessorList

    enc = _encode(tok, [prompt.format(question=q) for q in questions], _input_device(model))
    enc = {k: enc[k] for k in ("input_ids", "attention_mask")}
    width = enc["input_ids"].shape[1]
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else tok.pad_token_id
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                              top_k=None, pad_token_id=pad)
    if temperature > 0:
        if seeds is None or len(seeds) != len(questions):
            raise KVComposeError("sampling needs one seed per question")
        kw["logits_processor"] = LogitsProcessorList([RowSampler(seeds, temperature, top_p)])
    t0 = time.perf_counter()
    out = model.generate(**enc, past_key_values=cache, **kw)
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    seconds = time.perf_counter() - t0
    eos = _eos_ids(model, tok)
    texts, lens, hit = [], [], []
    for row in out[:, width:].tolist():
        n = next((i for i, t in enumerate(row) if t in eos), len(row))
        texts.append(tok.decode(row[:n], skip_special_tokens=True))
        lens.append(n)
        hit.append(n < len(row))
    prompt_lens = enc["attention_mask"].sum(-1).tolist()
    return {"texts": texts, "new_tokens": lens, "hit_eos": hit, "prompt_tokens": prompt_lens, "seconds": seconds}


def _make_cache(model, method: str, budget: int | None, cfg: AccuracyConfig, sample: int):
    from .. import methods as _methods
    from ..cache import KVComposeCache
    from ..methods import preset
    from ..seeding import derived_seed

    kw: dict[str, Any] = {"seed": derived_seed(cfg.seed, sample)}
    if method == "full":
        return KVComposeCache(model, _methods.full(), **kw)
    if cfg.interval is not None:  # otherwise the preset's own default interval
        kw["interval"] = cfg.interval
    return KVComposeCache(model, preset(method, budget=budget), budget=budget, **kw)


def _validate(cfg: AccuracyConfig) -> list[tuple[str, int | None]]:
    from .. import methods as _methods
    from ..methods import preset
    from ..seeding import derived_seed

    for name in ("samples", "max_new_tokens", "batch_size"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v <= 0:
            raise KVComposeError(f"{name.replace('_', '-')} must be a positive integer, got {v!r}")
    if cfg.limit is not None and cfg.limit <= 0:
        raise KVComposeError(f"limit must be positive, got {cfg.limit}")
    if cfg.temperature < 0:
        raise KVComposeError(f"temperature must be >= 0, got {cfg.temperature}")
    if cfg.temperature == 0 and cfg.samples > 1:
        raise KVComposeError("greedy decoding (temperature 0) gives the same answer for every sample: "
                             "pass --temperature > 0 (e.g. 0.6) with --samples > 1")
    if not 0 < cfg.top_p <= 1:
        raise KVComposeError(f"top-p must be in (0, 1], got {cfg.top_p}")
    if "{question}" not in cfg.prompt:
        raise KVComposeError("the prompt template must contain {question}")
    if not cfg.methods:
        raise KVComposeError("no methods given")
    for m in cfg.methods:
        if m not in _methods.PRESETS:
            raise KVComposeError(f"unknown method {m!r}; presets: {', '.join(_methods.PRESETS)}")
    compressing = [m for m in cfg.methods if m != "full"]
    if compressing and not cfg.budgets:
        raise KVComposeError("no budgets given for the compressing methods")
    for b in cfg.budgets:
        if not isinstance(b, int) or b <= 0:
            raise KVComposeError(f"budgets must be positive integers, got {b!r}")
        for m in compressing:
            preset(m, budget=b).validate(b)
    runs: list[tuple[str, int | None]] = [("full", None)] if "full" in cfg.methods else []
    return runs + [(m, b) for m in compressing for b in cfg.budgets]


_SETTINGS = ("model", "dtype", "dataset", "data", "offset", "max_new_tokens", "temperature", "top_p", "seed",
             "prompt", "interval")


def _check_settings(cfg: AccuracyConfig, out: Path, dist: _Dist) -> None:
    """Records of one output folder must come from the same generation settings (methods, budgets, samples
    and the number of questions may grow between runs; batch size and process count may change)."""
    path = out / "settings.json"
    mine = {k: getattr(cfg, k) for k in _SETTINGS}
    mine["data"] = None if cfg.data is None else Path(cfg.data).name
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in mine.items() if old.get(k) != v}
        if diff:
            raise KVComposeError(f"{out} holds records made with other settings "
                                 f"({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in diff.items())}); "
                                 "use another --out")
    elif dist.is_main:
        path.write_text(json.dumps(mine, indent=1))


def _source_label(cfg: AccuracyConfig, source: str) -> str:
    """Where the questions came from, without any local directory (results may be published)."""
    if cfg.dataset is not None:
        return f"{source} (Hugging Face datasets, {cfg.dataset})"
    how = "--data" if cfg.data is not None else "$KVCOMPOSE_GSM8K"
    return f"{Path(source).name} (local JSONL via {how})"


def run_accuracy(cfg: AccuracyConfig, log=print, loader=None) -> dict[str, Any] | None:
    """Run the accuracy benchmark (see the module docstring). Every rank generates its share; the main
    process merges and writes the results and returns them (other ranks return None).

    Args:
        cfg: the settings.
        loader: a fake hub loader for tests (see `kvcompose.data.load_hf_dataset`).
    """
    from tqdm.auto import tqdm

    from ..data import resolve_questions
    from .grading import grade

    runs = _validate(cfg)
    dist = _Dist(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    items, source = resolve_questions(cfg.data, cfg.dataset, cfg.limit, cfg.offset, loader)
    if not items:
        raise KVComposeError("no questions selected (check --limit / --offset and the data)")
    for i, it in enumerate(items):
        it["index"] = cfg.offset + i
    out = Path(cfg.out)
    (out / "records").mkdir(parents=True, exist_ok=True)
    _check_settings(cfg, out, dist)
    t_start = time.perf_counter()
    done = {record_key(r) for r in _all_records(out)}
    batches = [items[s : s + cfg.batch_size] for s in range(0, len(items), cfg.batch_size)]
    mine = [(k, b) for k, b in enumerate(batches) if k % dist.world == dist.rank]
    todo = sum(1 for m, b in runs for _, batch in mine for it in batch for s in range(cfg.samples)
               if (str(it["id"]), m, b, s) not in done)
    if dist.is_main:
        log(f"{len(items)} questions from {_source_label(cfg, source)}, {len(runs)} runs x {cfg.samples} samples, "
            f"{len(batches)} batches over {dist.world} process(es); {len(done)} records already in {out}")
    model = tok = None
    if todo:
        if dist.is_main:
            log(f"loading model {cfg.model or 'SmolLM2-135M-Instruct (GGUF)'} ...")
        model, tok = _load(cfg, dist)
    part = out / "records" / f"part-{dist.rank}.jsonl"
    with part.open("a", encoding="utf-8") as f:
        for method, budget in runs:
            label = "full" if budget is None else f"{method}@{budget}"
            n_mine = sum(len(b) for _, b in mine) * cfg.samples
            bar = tqdm(total=n_mine, desc=f"{label}" + (f" [rank {dist.rank}/{dist.world}]" if dist.world > 1 else ""),
                       unit="q", dynamic_ncols=True, disable=not cfg.progress, position=dist.rank, leave=True)
            for sample in range(cfg.samples):
                for k, batch in mine:
                    pending = {str(it["id"]) for it in batch if (str(it["id"]), method, budget, sample) not in done}
                    if not pending:
                        bar.update(len(batch))
                        continue
                    cache = _make_cache(model, method, budget, cfg, sample)
                    seeds = [row_seed(cfg.seed, str(it["id"]), sample) for it in batch]
                    res = generate_batch(model, tok, [it["question"] for it in batch], cache, cfg.max_new_tokens,
                                         cfg.prompt, seeds, cfg.temperature, cfg.top_p)
                    mem = cache.memory()
                    peak = int(mem.peak.get("hbm", mem.total))
                    rows = len(batch)
                    for j, it in enumerate(batch):
                        if str(it["id"]) not in pending:
                            continue
                        g = grade(res["texts"][j], it.get("answer"))
                        rec = {"id": str(it["id"]), "index": it["index"], "method": method, "budget": budget,
                               "sample": sample, "seed": seeds[j] if cfg.temperature > 0 else None,
                               "pred": g.predicted, "correct": g.correct, "graded_by": g.by,
                               "new_tokens": res["new_tokens"][j], "hit_eos": res["hit_eos"][j],
                               "prompt_tokens": int(res["prompt_tokens"][j]), "peak_kv_bytes": peak / rows,
                               "batch_peak_kv_bytes": peak, "batch": k, "batch_rows": rows,
                               "seconds": res["seconds"] / rows, "rank": dist.rank}
                        if cfg.save_text:
                            rec["text"] = res["texts"][j]
                        f.write(json.dumps(rec) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                    bar.update(len(batch))
            bar.close()
    dist.barrier()
    if not dist.is_main:
        return None
    return finish(cfg, out, runs, source, time.perf_counter() - t_start, log)


def finish(cfg: AccuracyConfig, out: Path, runs, source: str, elapsed: float, log=print) -> dict[str, Any]:
    """Merge every record in `out`, write `records.jsonl`, `accuracy.json`, `accuracy.md` and the plots."""
    from . import accuracy_report
    from .common import versions

    order = [m for m, _ in runs]
    records = merge_records(_all_records(out), order)
    with (out / "records.jsonl").open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    for p in (out / "records").glob("part-*.jsonl"):  # merged: the parts are now redundant
        p.unlink()
    rows = summarize(records)
    cfg_d = asdict(cfg)
    cfg_d["data"] = None if cfg.data is None else Path(cfg.data).name
    data = {
        "config": cfg_d, "command": cfg.command, "source": _source_label(cfg, source), "versions": versions(),
        "threads": torch.get_num_threads(), "elapsed_s": elapsed, "rows": rows,
        "n_records": len(records), "n_new_tokens": sum(r["new_tokens"] for r in records),
        "n_prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "notes": [
            "accuracy: mean over samples of the share of questions graded correct (math-verify + GSM8K '#### n' + "
            "last number); 95% Wilson score interval with n = number of questions.",
            "agreement: the answer equals the full cache's on the same question and sample seed.",
            "peak KV per request: the batch's peak HBM KV bytes (cache.memory().peak['hbm']) / its rows; "
            "tokens/s: generated tokens (up to EOS) / summed batch wall time.",
        ],
    }
    (out / "accuracy.json").write_text(json.dumps(data, indent=1, default=str))
    accuracy_report.render(out)
    log(f"wrote {out}/records.jsonl ({len(records)} records), accuracy.json, accuracy.md and plots")
    return data
