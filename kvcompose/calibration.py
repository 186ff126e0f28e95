"""Calibration of ReasonAlloc's layer profile (the "Reasoning Wave"): measure each layer's attention demand
on sample reasoning traces and write the JSON profile `kvcompose.allocators.ReasoningWave` reads.

ReasonAlloc (abstract only, no public code): layer budgets follow a calibrated demand profile; shallow layers
need much context, middle layers less, deep layers more again.

One command does it for a model (`kvcompose calibrate --model M --data questions.jsonl --out profile.json`),
the same as `calibrate(model, tokenizer, "questions.jsonl", "profile.json")`: sampled full-cache reasoning
traces of held-out questions, then `calibrate_reasoning_wave`. A profile records the model's name and
architecture (`model_fingerprint`); `find_profile(model)` finds a shipped one (`kvcompose/profiles/`), which
`methods.reason_alloc(profile="auto")` uses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .allocators import PROFILE_KIND, Allocator
from .allocators.layers import shipped_profiles
from .cache import KVComposeCache
from .pipeline import Pipeline
from .fingerprint import FINGERPRINT_KEYS, model_fingerprint, profile_matches
from .view import KVComposeError

__all__ = ["calibrate_reasoning_wave", "calibrate", "coverage_count", "model_id", "model_fingerprint",
           "find_profile", "FINGERPRINT_KEYS"]


def _text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_id(model_or_config: Any) -> str:
    """A model's name without machine paths: the hub id (`org/name`), the last part of a local directory, or,
    for the default GGUF model, `SmolLM2-135M-Instruct`."""
    from .models import GGUF_FILE

    config = _text_config(model_or_config)
    name = str(getattr(config, "_name_or_path", "") or getattr(getattr(model_or_config, "config", None),
                                                                  "_name_or_path", "") or "")
    if name and os.path.isdir(name):
        if os.path.exists(os.path.join(name, GGUF_FILE)):
            return GGUF_FILE.split(".")[0]
        return os.path.basename(os.path.normpath(name))
    if name and os.path.isabs(name):
        return os.path.basename(os.path.normpath(name))
    return name or str(getattr(config, "model_type", "") or "model")


def find_profile(model_or_config: Any, profiles: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The shipped ReasoningWave profile (`kvcompose/profiles/*.json`) for a model: its architecture must
    match the profile's fingerprint exactly; among several, the one whose recorded model name matches.
    None when there is none."""
    fp = model_fingerprint(model_or_config)
    name = model_id(model_or_config).lower().split("/")[-1]
    hits = []
    for prof in shipped_profiles() if profiles is None else profiles:
        theirs = prof.get("fingerprint") or {}
        if theirs and profile_matches(theirs, fp):
            hits.append(prof)
    if len(hits) > 1:
        named = [p for p in hits if str(p.get("model", "")).lower().split("/")[-1] == name]
        hits = named or hits
    return hits[0] if hits else None


def coverage_count(p: Float[Tensor, "*b T"], coverage: float) -> Int[Tensor, "*b"]:
    """How many of the largest entries of each row of `p` (non-negative) cover `coverage` of its sum."""
    s = p.sort(dim=-1, descending=True).values
    cum = s.cumsum(-1)
    need = coverage * cum[..., -1:]
    return ((cum - s) < need).sum(-1).clamp(min=1)


class _QueryProbe(Allocator):
    """Internal: a never-compressing pipeline part whose only effect is a query ring buffer of `n`."""

    def __init__(self, n: int):
        self.query_window = n

    def allocate(self, view, budget):  # pragma: no cover - never called (the pipeline has no selector)
        raise NotImplementedError


@torch.no_grad()
def calibrate_reasoning_wave(
    model,
    prompts: list[Tensor] | list[list[int]],
    path: str | os.PathLike | None = None,
    new_tokens: int = 256,
    coverage: int | float = 0.9,
    traces: list[Tensor] | list[list[int]] | None = None,
    query_chunk: int = 128,
) -> dict[str, Any]:
    """Measure each layer's attention demand on sample reasoning traces and save a ReasoningWave profile.

    For every prompt: a greedy continuation of `new_tokens` tokens with the full cache (or the given
    `traces`), then one full-cache forward over prompt + continuation that records every post-RoPE query.
    For each decoding query (continuation positions only) and query head, the demand is the number of keys
    covering `coverage` of its attention mass; a layer's demand is the mean over heads, queries and prompts.

    Args:
        model: a Hugging Face causal LM supported by `KVComposeCache` (use sample prompts that are not in
            your evaluation set).
        prompts: token id sequences (`[T]` or `[1, T]` tensors, or lists), one per prompt, unpadded.
        path: where to write the JSON profile (None: do not write).
        new_tokens: length of each greedy continuation (ignored for prompts that come with `traces`).
        coverage: the share of attention mass a layer's kept set should cover (0.9).
        traces: optional continuations (same count as prompts) to teacher-force instead of generating.
        query_chunk: queries scored at once (bounds the memory of the `[Hq, chunk, T]` attention block).

    Returns:
        The profile dict: `demand` (per layer), `head_demand` (per layer and KV head), `coverage`, counts.
    """
    if not prompts:
        raise KVComposeError("calibrate_reasoning_wave: give at least one prompt")
    if not 0.0 < coverage <= 1.0:
        raise KVComposeError(f"coverage must be in (0, 1], got {coverage}")
    if traces is not None and len(traces) != len(prompts):
        raise KVComposeError("calibrate_reasoning_wave: give one trace per prompt")
    device = next(model.parameters()).device
    sums: Tensor | None = None
    count = 0
    for i, prompt in enumerate(prompts):
        ids = torch.as_tensor(prompt, dtype=torch.long, device=device).reshape(1, -1)
        t0 = ids.shape[1]
        if traces is not None:
            cont = torch.as_tensor(traces[i], dtype=torch.long, device=device).reshape(1, -1)
            full = torch.cat([ids, cont], dim=1)
        else:
            full = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None,
                                  top_k=None)
        t = full.shape[1]
        if t <= t0:
            continue
        probe = _QueryProbe(t)
        cache = KVComposeCache(model, Pipeline(probe), budget=None, strict=False)
        model(input_ids=full, past_key_values=cache)
        per_layer = []
        for layer in cache.layers:
            q = layer.segment.ring.queries[0].float()  # [Hq, T, D]
            k = layer.keys[0].float()  # [H, T, D]
            hq, h = q.shape[0], k.shape[0]
            g = hq // h
            kk = k.repeat_interleave(g, dim=0)
            need = torch.zeros(hq, dtype=torch.float64, device=device)
            for s in range(t0, t, query_chunk):
                e = min(s + query_chunk, t)
                logits = torch.einsum("hqd,htd->hqt", q[:, s:e], kk) * layer.scale
                causal = torch.arange(t, device=device)[None, :] <= torch.arange(s, e, device=device)[:, None]
                p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
                need += coverage_count(p, coverage).double().sum(-1)
            per_layer.append(need.reshape(h, g).mean(-1) / (t - t0))
        cur = torch.stack(per_layer)  # [L, H]
        sums = cur if sums is None else sums + cur
        count += 1
    if sums is None:
        raise KVComposeError("calibrate_reasoning_wave: no prompt produced decoding queries")
    head = (sums / count).tolist()
    profile = {
        "kind": PROFILE_KIND,
        "version": 2,
        "model": model_id(model),
        "fingerprint": model_fingerprint(model, weights=True),
        "num_layers": len(head),
        "coverage": coverage,
        "prompts": count,
        "new_tokens": new_tokens if traces is None else None,
        "demand": [float(sum(r) / len(r)) for r in head],
        "head_demand": head,
    }
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(profile, indent=1))
    return profile


def calibrate(
    model,
    tokenizer,
    data: str | os.PathLike | list[dict[str, Any]],
    out: str | os.PathLike | None = None,
    n: int = 4,
    offset: int = 1000,
    new_tokens: int = 512,
    kind: str = "sampled",
    seed: int = 1,
    coverage: int | float = 0.9,
    progress: bool = False,
) -> dict[str, Any]:
    """One call from questions to a ReasoningWave profile (what `kvcompose calibrate` runs).

    Reads `n` questions from line `offset` of a JSONL file (a 'question' field per line, e.g. GSM8K's
    test.jsonl; use questions you do not evaluate on), writes full-cache reference traces of `new_tokens`
    tokens (`kvcompose.traces.make_traces`, `kind` "sampled" with `seed`, "greedy" or "worked"), and
    measures each layer's demand on them with `calibrate_reasoning_wave` (keys covering `coverage` of a
    decoding query's attention). The defaults reproduce the shipped SmolLM2-135M-Instruct profile (GSM8K
    test questions 1000-1003, 4 sampled traces of 512 tokens, seed 1).

    Args:
        model: a Hugging Face causal LM supported by `KVComposeCache`.
        tokenizer: its tokenizer.
        data: the JSONL path, or records with a 'question' field (and 'answer' for `kind="worked"`).
        out: where to write the JSON profile (None: do not write).

    Returns:
        The profile dict (also written to `out`): `demand` per layer, `head_demand` per layer and KV head,
        `model` (name), `fingerprint` (architecture), and how it was calibrated (`calibration`).
    """
    from .data import load_questions
    from .traces import make_traces

    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise KVComposeError(f"calibrate: n must be a positive int, got {n!r}")
    if isinstance(data, (str, os.PathLike)):
        questions = load_questions(data, n, offset)
        source = f"{Path(data).name} lines {offset}-{offset + len(questions) - 1}"
    else:
        questions = list(data)[:n]
        source = f"{len(questions)} given questions"
    if not questions:
        raise KVComposeError(f"calibrate: no question at line {offset} of {data}")
    traces = make_traces(model, tokenizer, questions, new_tokens=new_tokens, kind=kind, seed=seed, progress=progress)
    profile = calibrate_reasoning_wave(model, [t.prompt_ids for t in traces], None, new_tokens=new_tokens,
                                       coverage=coverage, traces=[t.trace_ids for t in traces])
    profile["new_tokens"] = new_tokens
    profile["calibration"] = {"questions": source, "kind": kind, "seed": seed, "traces": len(traces),
                              "trace_tokens": new_tokens}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(profile, indent=1))
    return profile
