"""Calibration of ReasonAlloc's layer profile (the "Reasoning Wave"): measure each layer's attention demand
on sample reasoning traces and write the JSON profile `kvcompose.allocators.ReasoningWave` reads.

ReasonAlloc (abstract only, no public code): layer budgets follow a calibrated demand profile; shallow layers
need much context, middle layers less, deep layers more again.
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
from .cache import KVComposeCache
from .pipeline import Pipeline
from .view import KVComposeError

__all__ = ["calibrate_reasoning_wave", "coverage_count"]


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
        "version": 1,
        "model": getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", ""),
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
