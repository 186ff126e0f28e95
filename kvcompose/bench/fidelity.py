"""Fidelity to the full cache: teacher forcing of reference traces through a compressing cache, and free generation.

The pieces live in three modules: `kvcompose.data` (questions), `kvcompose.traces` (reference
traces), `kvcompose.bench.metrics` (KL, top-1, perplexity ratio, answer extraction); this module is the runner.
Their public names stay importable from here and from `kvcompose.bench`.

The protocol (what `kvcompose bench fidelity` runs):

1. **Reference traces** (`make_traces`): for each question, a full-cache continuation of the chat prompt,
   `new_tokens` long. Three kinds:
   - `"sampled"`: seeded sampling (temperature 0.7, top-p 0.95) with a repetition guard (see
     `RepetitionGuard`); end-of-sequence and other special tokens are suppressed so every trace has
     exactly `new_tokens` tokens (after its answer the model goes on writing; that is still its own text).
   - `"greedy"`: greedy decoding with the same guard.
   - `"worked"`: natural multi-step text written by people: the question's own GSM8K worked solution, then
     other GSM8K problems with their worked solutions, chained ("Next problem: ..."), calculator
     annotations `<<...>>` removed. It is teacher-forced like the others; the model never wrote it.
2. **Teacher forcing** (`evaluate`): each trace goes through a fresh cache from `make_cache()`: prefill the
   prompt, then feed the trace in chunks of `chunk` tokens (default: the cache's compression interval).
   In kvcompose a chunk of `interval` tokens between two compression events is *exactly* the same
   computation as `interval` one-token decoding steps, because every mask is built from original token
   positions and the schedule counts decoded tokens: the compression event after a chunk sees the same
   held tokens, the same query window and the same accumulated statistics as after the last of the
   one-token steps (tests/test_bench_metrics.py checks this for H2O and SnapKV). Chunks start at decoded
   count 0, so chunk boundaries fall on every multiple of the interval.
3. **Metrics**, against one full-cache forward over prompt + trace (cached per trace in this process):
   top-1 agreement, mean KL(full || method) in nats, perplexity ratio `exp(NLL_method - NLL_full)` of the
   trace tokens, KL along the trace (mean per position bucket), peak held tokens and peak HBM KV bytes
   (`cache.memory()`), and a prompt-recall probe: after the trace, a user turn "Restate the original
   question word for word." and the assistant prefix; the mean per-token log-probability of the original
   question's tokens under the method's cache minus the same under the full cache.

`free_generation` is the end-to-end check: greedy answers with the full cache and with the method,
final-number agreement and exact match against GSM8K's `#### <number>`.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..view import KVComposeError
from ..data import load_questions
from .metrics import (
    BOOTSTRAP_RESAMPLES, bootstrap_mean, extract_answer, gsm8k_answer, kl_divergence, perplexity_ratio, top1_agreement,
)
from .freegen import FreeGenResult, FreeGenRow, free_generation
from .scoring import HiddenReference, ReferenceStats, RowScores, head_logits, linear_head
from ..traces import RECALL_INSTRUCTION, RepetitionGuard, Trace, _device, make_traces, prompt_ids, recall_ids

__all__ = [
    "Trace", "TraceScore", "FidelityResult", "FreeGenResult", "FreeGenRow", "RepetitionGuard",
    "load_questions", "make_traces", "evaluate", "free_generation", "extract_answer", "gsm8k_answer",
    "kl_divergence", "top1_agreement", "perplexity_ratio", "recall_ids", "teacher_force_logits", "evaluate_trace",
    "clear_reference_cache", "RECALL_INSTRUCTION", "evaluate_batch", "hidden_references", "HiddenReference",
    "head_logits", "RowScores", "ReferenceStats", "linear_head",
]

_prompt_ids = prompt_ids  # the old private name, still used by benchmark scripts




# ------------------------------------------------------------------------------------ full-cache reference
@dataclass
class _Reference:
    logp: Tensor  # [T, V] float32 log-probs predicting trace[t]
    nll: Tensor  # [T]
    recall: float | None  # mean log-prob of the question tokens in the recall probe

    @property
    def nbytes(self) -> int:
        return self.logp.numel() * self.logp.element_size()


_REFS: "OrderedDict[tuple, _Reference]" = OrderedDict()
REFERENCE_CACHE_BYTES = int(os.environ.get("KVCOMPOSE_REFERENCE_CACHE_BYTES", 1_500_000_000))


def clear_reference_cache() -> None:
    """Forget the cached full-cache references (they are kept per trace for this process)."""
    _REFS.clear()


def _ref_key(model, trace: Trace) -> tuple:
    return (id(model), getattr(model.config, "_name_or_path", ""), str(model.dtype), trace.id,
            hash(tuple(trace.prompt_ids)), hash(tuple(trace.trace_ids)), hash(tuple(trace.recall_ids)),
            hash(tuple(trace.recall_target_ids)))


def _forward(model, ids: list[int], cache, keep_last: bool = False) -> Tensor:
    x = torch.tensor([ids], dtype=torch.long, device=_device(model))
    kw = {"logits_to_keep": 1} if keep_last else {}
    out = model(input_ids=x, past_key_values=cache, use_cache=True, **kw)
    return out.logits[0].float()


def _recall_logprob(model, trace: Trace, cache) -> float | None:
    if not trace.recall_ids or not trace.recall_target_ids:
        return None
    seq = [trace.trace_ids[-1], *trace.recall_ids, *trace.recall_target_ids[:-1]]
    logits = _forward(model, seq, cache)
    start = len(trace.recall_ids)
    lp = torch.log_softmax(logits[start : start + len(trace.recall_target_ids)], dim=-1)
    tgt = torch.tensor(trace.recall_target_ids, device=lp.device)
    return float(lp.gather(1, tgt[:, None]).mean())


@torch.no_grad()
def _reference(model, trace: Trace, chunk: int = 512) -> _Reference:
    key = _ref_key(model, trace)
    if key in _REFS:
        _REFS.move_to_end(key)
        return _REFS[key]
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = [*trace.prompt_ids, *trace.trace_ids[:-1]]
    p = len(trace.prompt_ids)
    parts = [_forward(model, trace.prompt_ids, cache, keep_last=True)]
    for s in range(p, len(ids), chunk):
        parts.append(_forward(model, ids[s : s + chunk], cache))
    logits = torch.cat(parts)
    logp = torch.log_softmax(logits, dim=-1).cpu()
    del logits, parts
    tgt = torch.tensor(trace.trace_ids)
    nll = -logp.gather(1, tgt[:, None])[:, 0]
    ref = _Reference(logp=logp, nll=nll, recall=_recall_logprob(model, trace, cache))
    _REFS[key] = ref
    while len(_REFS) > 1 and sum(r.nbytes for r in _REFS.values()) > REFERENCE_CACHE_BYTES:
        _REFS.popitem(last=False)
    return ref


# ------------------------------------------------------------------------------------ teacher forcing
@dataclass
class TraceScore:
    """Per-token results of one trace through one cache (lists are per trace token)."""

    id: str
    kind: str
    top1: list[float]
    kl: list[float]
    nll: list[float]
    nll_full: list[float]
    max_held_tokens: int
    max_kv_bytes: int
    full_kv_bytes: int
    recall_logprob: float | None = None
    recall_logprob_full: float | None = None
    seconds: float = 0.0


@dataclass
class FidelityResult:
    """Scores of a cache on a set of traces; tokens are pooled over traces for the means.

    Attributes / properties: `top1`, `kl_mean` (nats), `ppl_ratio`, `max_held_tokens`, `max_kv_bytes`,
    `kv_ratio` (peak held KV bytes / full-cache bytes at the end of the trace), `recall_delta` (mean over
    traces of the per-token log-prob difference method - full in the recall probe; 0 = as good as the
    full cache, negative = the question is harder to restate), `kl_curve(bucket)`.
    """

    traces: list[TraceScore]

    def _all(self, name: str) -> list[float]:
        return [x for t in self.traces for x in getattr(t, name)]

    @property
    def n_tokens(self) -> int:
        return sum(len(t.top1) for t in self.traces)

    @property
    def top1(self) -> float:
        xs = self._all("top1")
        return sum(xs) / len(xs) if xs else float("nan")

    @property
    def kl_mean(self) -> float:
        xs = self._all("kl")
        return sum(xs) / len(xs) if xs else float("nan")

    @property
    def ppl_ratio(self) -> float:
        return perplexity_ratio(self._all("nll"), self._all("nll_full")) if self.traces else float("nan")

    @property
    def max_held_tokens(self) -> int:
        return max((t.max_held_tokens for t in self.traces), default=0)

    @property
    def max_kv_bytes(self) -> int:
        return max((t.max_kv_bytes for t in self.traces), default=0)

    @property
    def kv_ratio(self) -> float:
        rs = [t.max_kv_bytes / t.full_kv_bytes for t in self.traces if t.full_kv_bytes]
        return sum(rs) / len(rs) if rs else float("nan")

    @property
    def recall_delta(self) -> float | None:
        ds = [t.recall_logprob - t.recall_logprob_full for t in self.traces
              if t.recall_logprob is not None and t.recall_logprob_full is not None]
        return sum(ds) / len(ds) if ds else None

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.traces)

    def kl_curve(self, bucket: int = 64) -> list[float]:
        """Mean KL per bucket of `bucket` trace positions (pooled over traces)."""
        sums: list[float] = []
        counts: list[int] = []
        for t in self.traces:
            for i, v in enumerate(t.kl):
                b = i // bucket
                while len(sums) <= b:
                    sums.append(0.0)
                    counts.append(0)
                sums[b] += v
                counts[b] += 1
        return [s / c for s, c in zip(sums, counts)]

    @classmethod
    def merge(cls, results: Iterable["FidelityResult"]) -> "FidelityResult":
        return cls([t for r in results for t in r.traces])

    def intervals(self, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict[str, Any]:
        """Percentile bootstrap intervals over traces (prompts) of the pooled mean KL and top-1
        (`kvcompose.bench.metrics.bootstrap_mean`, seeded): `{"kl_ci": [lo, hi], "top1_ci": [lo, hi], ...}`."""
        if not self.traces:
            return {}
        counts = [len(t.kl) for t in self.traces]
        return {"kl_ci": list(bootstrap_mean([sum(t.kl) for t in self.traces], counts, level, resamples, seed)),
                "top1_ci": list(bootstrap_mean([sum(t.top1) for t in self.traces], counts, level, resamples, seed)),
                "ci_level": level, "ci_resamples": resamples, "ci_seed": seed}

    def summary(self, bucket: int = 64) -> dict[str, Any]:
        """The numbers as a JSON-ready dict (with 95% bootstrap intervals over traces, `intervals`)."""
        return {
            "top1": self.top1, "kl_mean": self.kl_mean, **self.intervals(), "ppl_ratio": self.ppl_ratio,
            "max_held_tokens": self.max_held_tokens, "max_kv_bytes": self.max_kv_bytes, "kv_ratio": self.kv_ratio,
            "recall_delta": self.recall_delta, "n_traces": len(self.traces), "n_tokens": self.n_tokens,
            "kl_curve": self.kl_curve(bucket), "kl_curve_bucket": bucket, "seconds": round(self.seconds, 3),
        }


def _cache_interval(cache) -> int | None:
    from ..cache import KVComposeCache

    if isinstance(cache, KVComposeCache) and cache.pipeline.compresses:
        return cache.interval
    return None


def _peak(cache, seen: int) -> tuple[int, int, int]:
    """(peak held tokens over layers, peak held KV bytes, full-cache KV bytes now)."""
    from ..cache import KVComposeCache

    if isinstance(cache, KVComposeCache):
        mem = cache.memory()
        held = max((l.peak_held_bytes // l.bytes_per_token() for l in cache.layers if l.bytes_per_token()), default=0)
        return held, int(mem.peak.get("hbm", mem.total)), int(mem.full_cache)
    nbytes = 0
    for layer in getattr(cache, "layers", []):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(k, Tensor) and isinstance(v, Tensor):
            nbytes += k.numel() * k.element_size() + v.numel() * v.element_size()
    return seen, nbytes, nbytes


def _check_chunk(cache, chunk: int | None) -> int:
    interval = _cache_interval(cache)
    if chunk is None:
        chunk = interval or 256
    if chunk <= 0:
        raise KVComposeError(f"chunk must be positive, got {chunk}")
    if interval is not None and interval % chunk:
        raise KVComposeError(
            f"chunk {chunk} does not divide the cache's interval {interval}: a chunk would straddle a "
            "compression event and differ from one-token decoding"
        )
    return chunk


def _teacher_force(model, trace: Trace, cache, chunk: int):
    """Yield `(start, logits[n, V])`: logits[i] predicts `trace_ids[start + i]`. The prompt is prefilled,
    then `trace_ids[:-1]` is fed in chunks of `chunk` tokens starting at decoded count 0."""
    yield 0, _forward(model, trace.prompt_ids, cache, keep_last=True)
    ids = trace.trace_ids[:-1]
    for s in range(0, len(ids), chunk):
        yield s + 1, _forward(model, ids[s : s + chunk], cache)


@torch.no_grad()
def teacher_force_logits(model, trace: Trace, cache, chunk: int | None = None) -> Tensor:
    """All `[T, V]` logits (float32) of a trace teacher-forced through `cache` (small models / tests)."""
    chunk = _check_chunk(cache, chunk)
    return torch.cat([lg.cpu() for _, lg in _teacher_force(model, trace, cache, chunk)])


@torch.no_grad()
def evaluate_trace(model, trace: Trace, cache, chunk: int | None = None) -> TraceScore:
    """Teacher-force one trace through `cache` and score it against the full-cache reference."""
    if len(trace.trace_ids) < 1 or len(trace.prompt_ids) < 1:
        raise KVComposeError(f"trace {trace.id!r} needs a non-empty prompt and trace")
    chunk = _check_chunk(cache, chunk)
    ref = _reference(model, trace)
    t0 = time.perf_counter()
    tgt_all = torch.tensor(trace.trace_ids)
    top1: list[float] = []
    kl: list[float] = []
    nll: list[float] = []
    for start, logits in _teacher_force(model, trace, cache, chunk):
        lp = torch.log_softmax(logits, dim=-1).cpu()
        n = lp.shape[0]
        lr = ref.logp[start : start + n]
        top1.extend(top1_agreement(lr, lp).tolist())
        kl.extend(kl_divergence(lr, lp).tolist())
        nll.extend((-lp.gather(1, tgt_all[start : start + n, None])[:, 0]).tolist())
    held, kv, full = _peak(cache, len(trace.prompt_ids) + len(trace.trace_ids) - 1)
    recall = _recall_logprob(model, trace, cache)
    return TraceScore(
        id=trace.id, kind=trace.kind, top1=top1, kl=kl, nll=nll, nll_full=ref.nll.tolist(),
        max_held_tokens=int(held), max_kv_bytes=int(kv), full_kv_bytes=int(full),
        recall_logprob=recall, recall_logprob_full=ref.recall, seconds=time.perf_counter() - t0,
    )


def evaluate(model, traces: list[Trace], make_cache: Callable[[], Any], chunk: int | None = None,
             progress: bool = False) -> FidelityResult:
    """Teacher-force every trace through a fresh `make_cache()` and compare with the full cache.

    Args:
        model: the Hugging Face model (the same one that produced or is scored on the traces).
        traces: from `make_traces` (or `Trace.from_dict`).
        make_cache: returns a fresh cache per trace, e.g. `lambda: KVComposeCache(model, methods.h2o(), budget=128)`.
        chunk: tokens per forward call; default the cache's compression interval (exactly equivalent to
            one-token decoding, see the module docstring). Must divide the interval.
    """
    from tqdm.auto import tqdm

    scores = [evaluate_trace(model, t, make_cache(), chunk) for t in tqdm(traces, disable=not progress, leave=False)]
    return FidelityResult(scores)


# ------------------------------------------------------------------------------------ batched teacher forcing
def _decoder(model):
    """The model without its output head (its forward returns `last_hidden_state`)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or dec is model:
        raise KVComposeError(f"{type(model).__name__} has no separate decoder (get_decoder()): batched teacher "
                             "forcing needs one")
    return dec


def _pad_left(rows: list[list[int]], pad_id: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """(ids [B, W], 2-D mask [B, W], position ids [B, W]) of left-padded rows."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def _pad_right(rows: list[list[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([list(r) + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def _pad_id(model) -> int:
    pid = model.generation_config.pad_token_id
    if isinstance(pid, list):
        pid = pid[0] if pid else None
    return 0 if pid is None else int(pid)


class _BatchRun:
    """Left-padded rows fed through one cache: `prefill`, then `feed` chunks of one token column per row;
    `hidden` states come back per row, logits are computed by the caller (`head_logits`)."""

    def __init__(self, model, cache, prompts: list[list[int]]):
        self.model, self.cache = model, cache
        self.dec = _decoder(model)
        self.device = _device(model)
        self.lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        ids, self.mask, pos = _pad_left(prompts, _pad_id(model), self.device)
        self.width = ids.shape[1]
        self.pads = (self.width - self.lengths).tolist()
        self.fed = 0  # trace tokens fed after the prompt
        self.prefill_hidden = self._forward(ids, pos, keep_last=True)[:, -1]

    def _forward(self, ids: Tensor, pos: Tensor, keep_last: bool = False) -> Tensor:
        padded = bool((self.mask == 0).any())
        out = self.dec(input_ids=ids, attention_mask=self.mask if padded else None, position_ids=pos,
                       past_key_values=self.cache, use_cache=True)
        return out.last_hidden_state

    def feed(self, cols: Tensor, valid: Tensor | None = None) -> Tensor:
        """Feed `cols` `[B, n]` (right-padded where `valid` `[B, n]` is 0); returns hidden `[B, n, hidden]`."""
        n = cols.shape[1]
        add = torch.ones(cols.shape, dtype=torch.long, device=self.device) if valid is None else valid.long()
        self.mask = torch.cat([self.mask, add], dim=1)
        pos = self.lengths[:, None] + self.fed + torch.arange(n, device=self.device)
        self.fed += n
        return self._forward(cols.to(self.device), pos)


def _check_head(model, logits: Tensor, hidden: Tensor) -> None:
    """Refuse a model whose logits are not `head_logits` of its decoder's hidden states."""
    mine = head_logits(model, hidden)
    if not torch.allclose(mine, logits.float(), atol=1e-4, rtol=1e-4):
        raise KVComposeError(
            f"{type(model).__name__}: its logits are not the output embedding of the decoder's last hidden "
            f"state (max difference {float((mine - logits.float()).abs().max()):.2e}); batched teacher forcing "
            "does not support this model")


@torch.no_grad()
def hidden_references(model, traces: list[Trace], batch_size: int = 8, chunk: int = 256) -> list[HiddenReference]:
    """Full-cache references of `traces` (a `DynamicCache` per batch of `batch_size` left-padded rows, chunks
    of `chunk` tokens): final hidden states, the NLL of every trace token and the recall probe."""
    from transformers import DynamicCache

    out: list[HiddenReference] = []
    if traces:  # the head must be what the model applies to its decoder's output
        x = torch.tensor([traces[0].prompt_ids], dtype=torch.long, device=_device(model))
        _check_head(model, model(input_ids=x, logits_to_keep=1).logits[0, -1],
                    _decoder(model)(input_ids=x).last_hidden_state[0, -1])
    for s in range(0, len(traces), batch_size):
        group = traces[s : s + batch_size]
        _same_length(group)
        run = _BatchRun(model, DynamicCache(config=model.config), [t.prompt_ids for t in group])
        parts = [run.prefill_hidden[:, None]]
        ids = torch.tensor([t.trace_ids[:-1] for t in group], dtype=torch.long)
        for c in range(0, ids.shape[1], chunk):
            parts.append(run.feed(ids[:, c : c + chunk]))
        hidden = torch.cat(parts, dim=1).float()  # [B, T, hidden]
        recall = _recall_batch(model, run, group)
        for b, t in enumerate(group):
            h = hidden[b].cpu()
            nll = torch.cat([-torch.log_softmax(head_logits(model, h[c : c + chunk].to(run.device, model.dtype)), -1)
                             .cpu().gather(1, torch.tensor(t.trace_ids[c : c + chunk])[:, None])[:, 0]
                             for c in range(0, h.shape[0], chunk)])
            out.append(HiddenReference(hidden=h, nll=nll, recall=recall[b]))
    return out


def _same_length(group: list[Trace]) -> int:
    lens = {len(t.trace_ids) for t in group}
    if len(lens) != 1:
        raise KVComposeError(f"a batch of traces must have equally long traces, got lengths {sorted(lens)}")
    for t in group:
        if not t.trace_ids or not t.prompt_ids:
            raise KVComposeError(f"trace {t.id!r} needs a non-empty prompt and trace")
    return lens.pop()


def _recall_batch(model, run: _BatchRun, group: list[Trace]) -> list[float | None]:
    """The recall probe after each row's trace (rows right-padded to the longest probe)."""
    seqs = [[t.trace_ids[-1], *t.recall_ids, *t.recall_target_ids[:-1]] if t.recall_ids and t.recall_target_ids
            else [t.trace_ids[-1]] for t in group]
    if all(len(q) == 1 for q in seqs):
        return [None] * len(group)
    ids, valid = _pad_right(seqs, _pad_id(model), run.device)
    hidden = run.feed(ids, valid)
    out: list[float | None] = []
    for b, t in enumerate(group):
        if not (t.recall_ids and t.recall_target_ids):
            out.append(None)
            continue
        start = len(t.recall_ids)
        h = hidden[b, start : start + len(t.recall_target_ids)]
        lp = torch.log_softmax(head_logits(model, h), dim=-1)
        tgt = torch.tensor(t.recall_target_ids, device=lp.device)
        out.append(float(lp.gather(1, tgt[:, None]).mean()))
    return out


def _row_peak(cache, b: int, rows: int, seen: int) -> tuple[int, int, int]:
    held, kv, full = _peak(cache, seen)
    return held, kv // rows, full // rows


@torch.no_grad()
def evaluate_batch(model, traces: list[Trace], make_cache: Callable[[], Any], chunk: int | None = None,
                   references: list[HiddenReference] | None = None, on_chunk: Callable[[Any, int], None] | None = None
                   ) -> list[TraceScore]:
    """Teacher-force a batch of traces through ONE cache from `make_cache()`, one forward per chunk for all
    rows, and score each row against its full-cache reference.

    Rows are left-padded to the longest prompt (the 2-D padding mask and per-row position ids are passed to
    the model); the trace tokens then go in chunks of `chunk` tokens (default: the cache's compression
    interval), the same column of every row in one forward call. Every row's budget and compression events
    are those of the row alone: the schedule counts decoded tokens, which are the same for every row, and
    blocks skip padding slots (tests/test_bench_batched.py compares rows with single runs). Exceptions:
    random selectors and scorers (RandomDrop, Sample, RandomScore, ProjectedNorm's draws) draw one tensor
    for the whole batch from the layer's generator, so row `b`'s draws differ from its single run's (the
    same distribution, other numbers).

    Args:
        traces: equally long traces (`trace_ids`); any prompt lengths.
        make_cache: returns the cache for the whole batch.
        references: their `hidden_references` (computed here if None).
        on_chunk: called as `on_chunk(cache, fed)` after every chunk (tests read kept positions there).

    Returns one `TraceScore` per trace; peak KV bytes are the batch's divided by the number of rows, and
    `seconds` is the batch's time divided likewise.
    """
    n_steps = _same_length(traces)
    if references is None:
        references = hidden_references(model, traces, batch_size=len(traces))
    if len(references) != len(traces):
        raise KVComposeError(f"{len(references)} references for {len(traces)} traces")
    cache = make_cache()
    chunk = _check_chunk(cache, chunk)
    t0 = time.perf_counter()
    rows = len(traces)
    run = _BatchRun(model, cache, [t.prompt_ids for t in traces])
    score = RowScores(model, traces, references)
    score(0, run.prefill_hidden[:, None])
    ids = torch.tensor([t.trace_ids[:-1] for t in traces], dtype=torch.long)
    for s in range(0, n_steps - 1, chunk):
        score(s + 1, run.feed(ids[:, s : s + chunk]))
        if on_chunk is not None:
            on_chunk(cache, run.fed)
    seen = run.width + n_steps - 1
    peaks = [_row_peak(cache, b, rows, seen) for b in range(rows)]
    recall = _recall_batch(model, run, traces)
    seconds = (time.perf_counter() - t0) / rows
    if hasattr(cache, "close"):
        cache.close()
    return [TraceScore(id=t.id, kind=t.kind, top1=score.top1[b], kl=score.kl[b], nll=score.nll[b],
                       nll_full=references[b].nll.tolist(), max_held_tokens=int(peaks[b][0]),
                       max_kv_bytes=int(peaks[b][1]), full_kv_bytes=int(peaks[b][2]),
                       recall_logprob=recall[b], recall_logprob_full=references[b].recall, seconds=seconds)
            for b, t in enumerate(traces)]
