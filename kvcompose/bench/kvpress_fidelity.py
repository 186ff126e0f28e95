"""NVIDIA kvpress's decoding-time presses teacher-forced in this process, batched, on the fidelity bench's
traces and full-cache references: both libraries in one environment (kvpress 0.5.5 pins transformers < 5.3,
so that environment has transformers 5.2; `pip install "transformers==5.2.*" kvpress==0.5.5`).

Protocol (what kvpress's `DecodingPress` is built for): prefill the prompt, then one forward call per trace
token, inside `with DecodingPress(base_press, compression_interval, target_size)(model):`; a batch of rows
shares each forward call. The press counts forward calls, not tokens, so for the presses in `CHUNKABLE`
(whose scores do not depend on how the tokens since the last compression were fed) the bench feeds a chunk
of `compression_interval` tokens per call to the same press built with `compression_interval=1`: the same
compressions at the same tokens, with the same scores (to float rounding), at a fraction of the cost of one
call per token (`evaluate_press_batch(..., chunk=...)`); the others run one token per call.

Batching: kvpress's presses score every slot of the cache, padding included, and keep the same number of
slots in every row, so a left-padded batch is not the same computation as its rows alone. Rows are
therefore batched only with rows of the same prompt length (no padding at all); `press_batches` groups
them (`kvcompose.bench.run.select_prompt_groups` picks questions in such groups). Within a batch every row
is scored as when alone (tests/test_kvpress_fidelity.py checks rows against single runs), except for
quantities a press takes over the whole batch: `RandomPress` draws one tensor (other numbers, same
distribution), and the window or sink score that `SnapKVPress`, `TOVAPress`, `ExpectedAttentionPress` and
`CapPress` pad with (`scores.max() + 1`) is the batch's maximum, which only has to exceed every other score.

Scores are the bench's (`TraceScore`): per-token KL(full || press), top-1 agreement and NLL against the
same `HiddenReference` as kvcompose's rows, so both engines are compared with one full-cache run.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..view import KVComposeError
from .fidelity import HiddenReference, RowScores, TraceScore, _decoder, _device, hidden_references
from ..traces import Trace

__all__ = ["PRESSES", "CHUNKABLE", "press_names", "base_press", "sorted_press", "make_press", "press_batches", "evaluate_press_batch",
           "kvpress_version"]


def _kvpress():
    try:
        import kvpress
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise KVComposeError(
            "kvpress is not installed: pip install \"transformers==5.2.*\" kvpress==0.5.5 (kvpress 0.5.5 needs "
            f"transformers < 5.3) ({e})") from None
    return kvpress


def kvpress_version() -> str | None:
    try:
        return importlib.metadata.version("kvpress")
    except importlib.metadata.PackageNotFoundError:
        return None


# name -> base ScorerPress (compression_ratio left at 0: DecodingPress sets it at every compression).
# SnapKV's default window (64) asserts inside DecodingPress at interval 64 (its buffer holds exactly
# `interval` hidden states, and the window must be shorter): window 16, as in issue 23's comparison.
PRESSES: dict[str, Callable[[Any, int], Any]] = {
    "streaming_llm": lambda kp, seed: kp.StreamingLLMPress(),
    "knorm": lambda kp, seed: kp.KnormPress(),
    "random": lambda kp, seed: kp.RandomPress(seed=seed),
    "snapkv": lambda kp, seed: kp.SnapKVPress(window_size=16),
    "tova": lambda kp, seed: kp.TOVAPress(),
    "expected_attention": lambda kp, seed: kp.ExpectedAttentionPress(),
    "keydiff": lambda kp, seed: kp.KeyDiffPress(),
    "lagkv": lambda kp, seed: kp.LagKVPress(),
    "cur": lambda kp, seed: kp.CURPress(),
    # LeverageScorePress, CompactorPress and NonCausalAttnPress assert "only supports prefill" in 0.5.5: they
    # cannot run inside DecodingPress, so they are listed for prefill use only
    "leverage": lambda kp, seed: kp.LeverageScorePress(),
    "compactor": lambda kp, seed: kp.CompactorPress(),
    "criticalkv": lambda kp, seed: kp.CriticalKVPress(kp.SnapKVPress(window_size=16)),
    "cap": lambda kp, seed: kp.CapPress(),
    "noncausal": lambda kp, seed: kp.NonCausalAttnPress(),
    "pyramidkv": lambda kp, seed: kp.PyramidKVPress(window_size=16),
}


def sorted_press(press):
    """`press` (a kvpress `ScorerPress`) whose kept slots are put back in their cache order after `topk`
    (kvpress leaves them in descending score order). Only for analysis (docs/results.md, SnapKV): with every
    compression sorted, the cache stays in time order, as kvcompose keeps it."""
    from dataclasses import fields

    from kvpress.utils import compute_n_kept

    base = type(press)

    class Sorted(base):  # type: ignore[misc, valid-type]
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            if self.compression_ratio == 0:
                return keys, values
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
            idx = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values
            g = idx.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
            return keys.gather(2, g).contiguous(), values.gather(2, g).contiguous()

    Sorted.__name__ = Sorted.__qualname__ = f"Sorted{base.__name__}"
    return Sorted(**{f.name: getattr(press, f.name) for f in fields(press) if f.init})


PRESSES["snapkv(sorted)"] = lambda kp, seed: sorted_press(kp.SnapKVPress(window_size=16))


# Presses whose decoding compression gives the same scores when the trace is fed `interval` tokens per forward
# call to a `DecodingPress(compression_interval=1)` as when it is fed one token per call at
# `compression_interval=interval` (the protocol kvpress is built for): their scores read the cache's keys and
# values, the buffered hidden states and at most the last position's rotary angles, which are the same either
# way. SnapKV's window (and PyramidKV's and CriticalKV's, built on it) rotates its buffered queries by the call's
# `position_embeddings[:, -window:]`: one token per call gives one position, so kvpress rotates every window
# query by the last token's angle, and a chunk would rotate each by its own: other scores, so those presses run
# one token per call. tests/test_kvpress_fidelity.py holds both halves (equal scores at every compression for
# these, different scores for SnapKV).
CHUNKABLE = frozenset({"streaming_llm", "knorm", "random", "tova", "expected_attention", "keydiff", "lagkv", "cur", "cap"})


def press_names() -> list[str]:
    return list(PRESSES)


def base_press(name: str, seed: int = 0):
    """The kvpress `ScorerPress` called `name` in `PRESSES`."""
    if name not in PRESSES:
        raise KVComposeError(f"unknown kvpress press {name!r}; known: {', '.join(PRESSES)}")
    return PRESSES[name](_kvpress(), seed)


def make_press(name: str, budget: int, interval: int = 64, seed: int = 0, hidden_states_buffer_size: int = 256,
               chunked: bool = False):
    """`DecodingPress(base_press(name), compression_interval=interval, target_size=budget)`; `chunked=True`
    builds it with `compression_interval=1` for `evaluate_press_batch(..., chunk=interval)` (only presses in
    `CHUNKABLE`: refused otherwise)."""
    kp = _kvpress()
    if chunked and name not in CHUNKABLE:
        raise KVComposeError(f"kvpress's {name} cannot be fed in chunks (its decoding compression reads the forward "
                             f"call's positions or queries); chunkable: {', '.join(sorted(CHUNKABLE))}")
    if chunked and hidden_states_buffer_size < interval:
        raise KVComposeError(f"hidden_states_buffer_size {hidden_states_buffer_size} < interval {interval}")
    return kp.DecodingPress(base_press=base_press(name, seed), compression_interval=1 if chunked else interval,
                            target_size=budget, hidden_states_buffer_size=hidden_states_buffer_size)


def press_batches(traces: list[Trace], batch_size: int) -> list[list[Trace]]:
    """Batches of at most `batch_size` traces with the same prompt length and trace length (kvpress cannot
    batch padding), in the order the traces come."""
    groups: dict[tuple[int, int], list[Trace]] = {}
    for t in traces:
        groups.setdefault((len(t.prompt_ids), len(t.trace_ids)), []).append(t)
    out = []
    for g in groups.values():
        out += [g[i : i + batch_size] for i in range(0, len(g), batch_size)]
    return out


def _held(cache) -> tuple[int, int]:
    held, nbytes = 0, 0
    for layer in cache.layers:
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(k, Tensor) and k.dim() == 4:
            held = max(held, int(k.shape[-2]))
            nbytes += k.numel() * k.element_size() + v.numel() * v.element_size()
    return held, nbytes


@torch.no_grad()
def evaluate_press_batch(model, traces: list[Trace], press, references: list[HiddenReference] | None = None,
                         score_every: int = 64, on_step: Callable[[Any, int], None] | None = None,
                         chunk: int = 1) -> list[TraceScore]:
    """Teacher-force a batch of traces (equal prompt and trace lengths) through a `DynamicCache` under
    `press` (a `DecodingPress`), one token per forward call for all rows, and score every row against its
    full-cache reference. `on_step(cache, t)` is called after the forward that fed trace token `t - 1`
    (t >= 1; with `chunk > 1`, after each chunk). Returns one `TraceScore` per row (peak bytes and seconds
    per row: the batch's / rows).

    `chunk > 1` feeds `chunk` trace tokens per forward call to a press built with `compression_interval=1`
    (`make_press(..., chunked=True)`): the same computation as one token per call at `compression_interval=chunk`
    for the presses in `CHUNKABLE` only (see there), and `chunk` times fewer forward calls. The peak held
    count is reported as the one-token protocol sees it (after each token's forward)."""
    from transformers import DynamicCache

    if not traces:
        return []
    if len({(len(t.prompt_ids), len(t.trace_ids)) for t in traces}) != 1:
        raise KVComposeError("kvpress batches need equal prompt and trace lengths (kvpress scores padding slots as "
                             "tokens); group them with press_batches")
    if chunk < 1:
        raise KVComposeError(f"chunk must be at least 1, got {chunk}")
    if chunk > 1:
        every = getattr(press, "compression_interval", None)
        if every != 1:
            raise KVComposeError(f"chunk={chunk} needs a DecodingPress with compression_interval=1 (it compresses after "
                                 f"every chunk), got {every}: make_press(..., chunked=True)")
    if references is None:
        references = hidden_references(model, traces, batch_size=len(traces))
    dev = _device(model)
    dec = _decoder(model)
    rows, p, n = len(traces), len(traces[0].prompt_ids), len(traces[0].trace_ids)
    score = RowScores(model, traces, references)
    cache = DynamicCache()
    t0 = time.perf_counter()
    peak_held = peak_bytes = 0
    with press(model):
        ids = torch.tensor([t.prompt_ids for t in traces], dtype=torch.long, device=dev)
        pos = torch.arange(p, device=dev).expand(rows, p)
        buf = [dec(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).last_hidden_state[:, -1:]]
        start = 0
        trace = torch.tensor([t.trace_ids for t in traces], dtype=torch.long, device=dev)
        for t in range(1, n, chunk):
            e = min(n, t + chunk)  # feeds trace tokens t-1 .. e-2
            x = trace[:, t - 1 : e - 1]
            pos = torch.arange(p + t - 1, p + e - 1, dtype=torch.long, device=dev).expand(rows, e - t)
            before = _held(cache)[0] if chunk > 1 else 0
            if chunk > 1 and e - t < chunk:  # a last partial chunk: one token per call would not compress
                press.compression_interval = chunk + 1
            buf.append(dec(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True).last_hidden_state)
            held, nbytes = _held(cache)
            if chunk > 1:  # the one-token protocol's count after each token: the chunk's last one compresses,
                # a last partial chunk does not (one token per call would not reach the interval)
                seen = before + (e - t) - (1 if e - t == chunk else 0)
                nbytes, held = (nbytes // max(held, 1)) * max(held, seen), max(held, seen)
            peak_held, peak_bytes = max(peak_held, held), max(peak_bytes, nbytes)
            if on_step is not None:
                on_step(cache, e - 1)
            if sum(b.shape[1] for b in buf) >= score_every:
                h = torch.cat(buf, dim=1)
                score(start, h)
                start += h.shape[1]
                buf = []
        if buf:
            score(start, torch.cat(buf, dim=1))
    if chunk > 1:
        press.compression_interval = 1
    seconds = (time.perf_counter() - t0) / rows
    full_bytes = peak_bytes and (peak_bytes // max(peak_held, 1)) * (p + n - 1)  # bytes per slot x tokens seen
    return [TraceScore(id=t.id, kind=t.kind, top1=score.top1[b], kl=score.kl[b], nll=score.nll[b],
                       nll_full=references[b].nll.tolist(), max_held_tokens=peak_held,
                       max_kv_bytes=peak_bytes // rows, full_kv_bytes=full_bytes // rows,
                       seconds=seconds)
            for b, t in enumerate(traces)]
