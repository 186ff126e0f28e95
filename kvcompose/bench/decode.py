"""Decoding instruments shared by `kvcompose bench speed`, `steptime` and `throughput`: greedy decoding of
several caches interleaved one step at a time with every step timed (`decode_interleaved`), one timed
`generate` run (`measure_decode`), the reference caches (the ideal sliding window, the full `DynamicCache`)
and byte/held-token counters that work for kvcompose and transformers caches alike.

A decode step here is what `model.generate` does for greedy decoding without logits processors: one
forward of the new token with the growing 2-D attention mask and the position ids generate would pass,
`logits_to_keep=1`, then argmax (end-of-sequence suppressed, as with `min_new_tokens`).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..models import TokenClock  # noqa: F401  (re-exported; one copy, in the library)
from ..view import KVComposeError

__all__ = ["TokenClock", "ideal_cache", "full_cache", "kv_bytes", "held_tokens", "Contender", "DecodeTrace",
           "decode_interleaved", "SpeedResult", "measure_decode"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------ caches
def ideal_cache(model, window: int):
    """The ideal compressed cache: transformers' `DynamicSlidingWindowLayer` of `window` tokens on every layer.

    Between steps it holds the last `window - 1` tokens and each decode step attends over exactly `window`
    (the held ones plus the new one), with no work to choose them. Its `get_mask_sizes` announces
    `(window - 1 + new, seen - window + 1)`, so the mask transformers builds has the width of what is held:
    with sdpa the single-query decode mask is skipped, and eager attention (which applies the mask) gives
    the same logits (checked in the tests). Use it with `model.set_attn_implementation("sdpa")`.
    A model config with `sliding_window` set is not needed (and Llama ignores it)."""
    from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise KVComposeError(f"window must be an int >= 2, got {window!r}")
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[DynamicSlidingWindowLayer(sliding_window=window) for _ in range(n)])


def full_cache(model):
    """The full cache of transformers (`DynamicCache`); use it with sdpa attention."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def kv_bytes(cache) -> int:
    """Bytes of keys and values a transformers cache holds now (all layers)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, Tensor) and t.dim() == 4:
                total += t.numel() * t.element_size()
    return total


def held_tokens(cache) -> int:
    """Tokens held now, max over layers (`memory().held` for a kvcompose cache)."""
    if hasattr(cache, "memory"):
        return int(cache.memory().held)
    return max((int(layer.keys.shape[-2]) for layer in getattr(cache, "layers", [])
                if isinstance(getattr(layer, "keys", None), Tensor) and layer.keys.dim() == 4), default=0)


# ------------------------------------------------------------------------------------------ decoding
@dataclass
class Contender:
    """One row of an interleaved run: a cache and the attention implementation its steps run with.

    `kind` is "ideal", "full" (transformers' `DynamicCache`), or "kvcompose". `input_ids` / `attention_mask`
    (`[B, P]`, optional) give this row its own (batched, left-padded) prompt."""

    name: str
    kind: str
    cache: Any
    attn: str
    method: str | None = None
    budget: int | None = None
    interval: int | None = None
    input_ids: Tensor | None = None
    attention_mask: Tensor | None = None


@dataclass
class DecodeTrace:
    """What `decode_interleaved` measured for one contender.

    `step_seconds[i]` is the wall time of decode step i (which takes the sequence from `first_seen + i` to
    `first_seen + i + 1` tokens seen); `held` samples `(tokens seen, tokens held)` every `sample_every`
    steps; bytes are over all layers (and all rows of the batch)."""

    name: str
    kind: str
    batch: int = 1
    first_seen: int = 0
    prefill_seconds: float = math.nan
    step_seconds: list[float] = field(default_factory=list)
    held: list[tuple[int, int]] = field(default_factory=list)
    peak_kv_bytes: int = 0
    peak_alloc_bytes: int = 0
    compress_seconds: float = 0.0
    compress_calls: int = 0
    method: str | None = None
    budget: int | None = None
    interval: int | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step_seconds"] = [round(s, 7) for s in self.step_seconds]
        return d


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _set_attn(model, impl: str) -> None:
    if getattr(model.config, "_attn_implementation", None) != impl:
        model.set_attn_implementation(impl)


def _track(c: Contender, tr: DecodeTrace) -> None:
    """Peak bytes and held length, outside the timed region."""
    if hasattr(c.cache, "memory"):
        mem = c.cache.memory()
        tr.peak_kv_bytes = int(mem.peak.get("hbm", mem.total))
        tr.peak_alloc_bytes = int(mem.peak.get("allocated", mem.allocated))
    else:
        b = kv_bytes(c.cache)
        tr.peak_kv_bytes = max(tr.peak_kv_bytes, b)
        tr.peak_alloc_bytes = max(tr.peak_alloc_bytes, b)


@torch.no_grad()
def decode_interleaved(
    model,
    input_ids: Int[Tensor, "B P"] | None,
    contenders: list[Contender],
    new_tokens: int,
    *,
    attention_mask: Int[Tensor, "B P"] | None = None,
    sample_every: int = 64,
    suppress_eos: bool = True,
    progress: bool = False,
    desc: str = "decode",
    on_sample: Callable[[int, list[DecodeTrace]], None] | None = None,
) -> list[DecodeTrace]:
    """Prefill every contender with its prompt (left-padded rows allowed), then decode `new_tokens` greedy
    tokens with all of them in turn, one step each per round (the order rotates every round), timing every
    step.

    Args:
        model: a Hugging Face causal LM (used by every contender; the attention implementation is switched
            to each contender's `attn` before its step, outside the timed region).
        input_ids: `[B, P]` prompt ids for every contender that has no `input_ids` of its own.
        contenders: caches to compare; each must be empty.
        new_tokens: decode steps per contender.
        attention_mask: `[B, P]` 1 for real tokens, 0 for left padding (default: all ones); goes with `input_ids`.
        sample_every: steps between samples of the held length.
        suppress_eos: never pick an end-of-sequence token (like `min_new_tokens`), so every row runs to the end.
        on_sample: called with the round number and the traces so far every `sample_every` rounds (e.g. to
            write partial results).

    Returns:
        One `DecodeTrace` per contender; a contender that raises keeps its error and leaves the rotation.
    """
    if new_tokens < 1:
        raise KVComposeError(f"new_tokens must be >= 1, got {new_tokens}")
    if not contenders:
        raise KVComposeError("no contenders to decode")
    from tqdm.auto import tqdm

    eos = _eos_ids(model) if suppress_eos else []
    traces: list[DecodeTrace] = []
    state: list[dict[str, Any]] = []
    for c in contenders:
        ids = c.input_ids if c.input_ids is not None else input_ids
        am0 = c.attention_mask if c.input_ids is not None else attention_mask
        if ids is None:
            raise KVComposeError(f"contender {c.name!r} has no prompt and no input_ids were given")
        device = ids.device
        b, p = ids.shape
        mask = torch.ones(b, p + new_tokens, dtype=torch.long, device=device)
        if am0 is not None:
            if am0.shape != ids.shape:
                raise KVComposeError(f"attention_mask {tuple(am0.shape)} != input_ids {tuple(ids.shape)}")
            mask[:, :p] = am0.to(device=device, dtype=torch.long)
        prompt_mask = mask[:, :p]
        prompt_pos = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)
        tr = DecodeTrace(name=c.name, kind=c.kind, batch=b, first_seen=p, method=c.method, budget=c.budget,
                         interval=c.interval)
        st: dict[str, Any] = {"alive": True, "mask": mask, "p": p, "device": device}
        try:
            _set_attn(model, c.attn)
            gc.collect()
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=ids, attention_mask=prompt_mask, position_ids=prompt_pos,
                        past_key_values=c.cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1]
            if eos:
                logits[:, eos] = -math.inf
            st["tok"] = logits.argmax(-1, keepdim=True)
            _sync(device)
            tr.prefill_seconds = time.perf_counter() - t0
            st["pos"] = prompt_pos[:, -1:] + 1
            _track(c, tr)
            tr.held.append((p, held_tokens(c.cache)))
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
            tr.error = f"prefill: {type(e).__name__}: {e}"
            st["alive"] = False
        traces.append(tr)
        state.append(st)
    gc.collect()
    bar = tqdm(total=new_tokens, desc=desc, unit="tok", dynamic_ncols=True, disable=not progress)
    rows = list(zip(contenders, traces, state))
    for i in range(new_tokens):
        for c, tr, st in rows[i % len(rows):] + rows[: i % len(rows)]:  # rotate: no row always runs first
            if not st["alive"]:
                continue
            seen = st["p"] + i  # tokens seen before this step
            am = st["mask"][:, : seen + 1]
            device = st["device"]
            try:
                _set_attn(model, c.attn)
                _sync(device)
                t0 = time.perf_counter()
                out = model(input_ids=st["tok"], attention_mask=am, position_ids=st["pos"], past_key_values=c.cache,
                            use_cache=True, logits_to_keep=1)
                logits = out.logits[:, -1]
                if eos:
                    logits[:, eos] = -math.inf
                st["tok"] = logits.argmax(-1, keepdim=True)
                _sync(device)
                tr.step_seconds.append(time.perf_counter() - t0)
                st["pos"] = st["pos"] + 1
            except Exception as e:  # noqa: BLE001
                tr.error = f"step {i}: {type(e).__name__}: {e}"
                st["alive"] = False
                continue
            # held length: every `sample_every` steps, and on both sides of every drop (a compression event)
            _track(c, tr)
            h = held_tokens(c.cache)
            prev = st.get("prev")
            if prev is not None and h < prev[1] and (not tr.held or tr.held[-1] != prev):
                tr.held.append(prev)
            if (prev is not None and h < prev[1]) or (i + 1) % sample_every == 0 or i + 1 == new_tokens:
                tr.held.append((seen + 1, h))
            st["prev"] = (seen + 1, h)
        if (i + 1) % sample_every == 0 or i + 1 == new_tokens:
            _stats_into(contenders, traces)
            if on_sample is not None:
                on_sample(i + 1, traces)
            if progress:
                bar.set_postfix_str(" ".join(f"{tr.name.split(' ')[0]}:{tr.held[-1][1]}" for tr in traces[:4]
                                             if tr.held), refresh=False)
        bar.update(1)
    bar.close()
    _stats_into(contenders, traces)
    return traces


def _stats_into(contenders: list[Contender], traces: list[DecodeTrace]) -> None:
    """Copy each kvcompose cache's event counters (`cache.stats`) into its trace."""
    for c, tr in zip(contenders, traces):
        stats = getattr(c.cache, "stats", None)
        if stats is not None:
            tr.compress_seconds = float(stats.compress_seconds)
            tr.compress_calls = int(stats.compress_calls)


# ------------------------------------------------------------------------------------------ one generate run
@dataclass
class SpeedResult:
    """One `measure_decode` run: decode time and rate, compression events (`cache.stats`) and KV bytes."""

    name: str
    budget: int | None
    new_tokens: int
    decode_seconds: float
    tokens_per_s: float
    compress_seconds: float
    compress_calls: int
    compress_share: float
    peak_kv_bytes: int
    peak_alloc_bytes: int
    full_kv_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def measure_decode(model, input_ids: Int[Tensor, "B P"], cache, new_tokens: int, name: str = "",
                   progress: bool = False) -> SpeedResult:
    """Greedy-decode exactly `new_tokens` tokens with `model.generate` into `cache` (a `KVComposeCache` or a
    transformers cache) and time the decode steps (prefill excluded). Compression time comes from
    `cache.stats` (wall time of every compression event, all layers). For side-by-side comparisons prefer
    `decode_interleaved`, which times every step of several caches in turn."""
    from tqdm.auto import tqdm

    bar = tqdm(total=new_tokens, desc=f"speed {name}", unit="tok", leave=False, disable=not progress)
    clock = TokenClock(input_ids.device, bar)
    model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), past_key_values=cache,
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, temperature=None,
                   top_p=None, top_k=None, streamer=clock, pad_token_id=model.generation_config.pad_token_id)
    bar.close()
    stats = getattr(cache, "stats", None)
    comp = float(stats.compress_seconds) if stats is not None else 0.0
    calls = int(stats.compress_calls) if stats is not None else 0
    if hasattr(cache, "memory"):
        mem = cache.memory()
        peak, alloc, full = int(mem.peak["hbm"]), int(mem.peak["allocated"]), int(mem.full_cache)
    else:
        full = peak = alloc = kv_bytes(cache)
    dec = clock.decode_seconds
    return SpeedResult(
        name=name, budget=getattr(cache, "budget", None), new_tokens=len(clock.stamps), decode_seconds=dec,
        tokens_per_s=clock.decode_tokens_per_s, compress_seconds=comp, compress_calls=calls,
        compress_share=comp / dec if dec and dec == dec else float("nan"),
        peak_kv_bytes=peak, peak_alloc_bytes=alloc, full_kv_bytes=full,
    )
