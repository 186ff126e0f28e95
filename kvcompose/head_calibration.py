"""Calibration of per-head allocators on full-cache reasoning traces: DuoAttention's head types (`DuoHeads`) and
LU-KV's head-wise budget curves (`HeadCurves`).

Like `kvcompose.calibration` (ReasonAlloc's layer profile), one full-cache forward over each prompt + trace
records every post-RoPE query; then, per layer and KV head:

- `kind="duo"`: the attention mass each decoding query puts *outside* a streaming window (the first `sinks`
  tokens and the newest `recent`), averaged over the queries and the query group: the share of attention a head
  would lose as a streaming head. High = a retrieval head. (DuoAttention trains a gate per head on synthetic
  retrieval; kvpress loads those trained patterns from the hub or uses a mean-query heuristic on BookSum; this
  is a direct, training-free measure on the user's own traces.)
- `kind="lukv"`: every head's attention from the last `window` decoding queries over all keys, sorted
  descending and averaged: the mass its k-th best token carries. For each global compression ratio 1%..99%,
  the global top-k of those masses over all layers and heads (the optimal split of the total for an additive
  utility, since each sorted curve is concave) gives each head's kept share; `prune = 1 - share`, averaged over
  prompts: the `[99, layers, KV heads]` curves LU-KV's allocation reads.

`kvcompose calibrate --target duo|lukv --out FILE` runs it for a model (`calibrate_heads_from_data`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from .blocks.duo import DUO_KIND
from .blocks.lukv import CURVES_KIND
from .cache import KVComposeCache
from .calibration import _QueryProbe, model_fingerprint, model_id
from .pipeline import Pipeline
from .view import KVComposeError

__all__ = ["calibrate_heads", "calibrate_heads_from_data", "lukv_prune_curves"]


def _layer_probs(layer, s: int, e: int) -> Tensor:
    """`[Hq, e - s, T]` causal softmax attention of the queries at positions s..e-1 over every key."""
    q = layer.segment.ring.queries[0].float()  # [Hq, T, D]
    k = layer.keys[0].float()  # [H, T, D]
    g = q.shape[0] // k.shape[0]
    t = k.shape[1]
    logits = torch.einsum("hqd,htd->hqt", q[:, s:e], k.repeat_interleave(g, dim=0)) * layer.scale
    causal = torch.arange(t, device=q.device)[None, :] <= torch.arange(s, e, device=q.device)[:, None]
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def lukv_prune_curves(curves: Tensor) -> Tensor:
    """`[99, L, H]` prune shares from per-head sorted attention curves `[L, H, T]`: for ratio r = (i+1)/100, the
    global top-`round((1 - r) L H T)` entries decide each head's kept count."""
    n_l, n_h, t = curves.shape
    flat = curves.reshape(-1)
    order = torch.argsort(flat, descending=True, stable=True)
    head_of = order // t
    out = torch.zeros(99, n_l, n_h, dtype=torch.float64)
    for i in range(99):
        n = round((1.0 - (i + 1) / 100) * flat.numel())
        cnt = torch.bincount(head_of[:n], minlength=n_l * n_h).reshape(n_l, n_h).double()
        out[i] = 1.0 - cnt / t
    return out


@torch.no_grad()
def calibrate_heads(model, prompts: list[Tensor] | list[list[int]], traces: list[Tensor] | list[list[int]],
                    kind: Literal["duo", "lukv"] = "duo", path: str | os.PathLike | None = None, sinks: int = 4,
                    recent: int = 64, window: int = 32, query_chunk: int = 128) -> dict[str, Any]:
    """Measure a head-wise profile on full-cache traces (see the module docstring) and optionally write it.

    Args:
        model: a Hugging Face causal LM supported by `KVComposeCache`.
        prompts: token ids of each prompt (held-out questions).
        traces: token ids of each prompt's continuation (one per prompt).
        kind: "duo" (DuoHeads' `head_scores`) or "lukv" (HeadCurves' `prune` curves).
        sinks: the sink tokens of the streaming window that "duo" measures against.
        recent: the recent tokens of that streaming window.
        path: where to write the profile as JSON (None: not written).
        query_chunk: queries per forward of the measurement (memory, not results).
        window: the decoding queries whose attention "lukv" sorts (the last `window` of each trace).

    Returns:
        The profile dict (`kind`, `model`, `fingerprint`, and `head_scores` `[L][H]` or `prune` `[99][L][H]`).
    """
    if kind not in ("duo", "lukv"):
        raise KVComposeError(f"calibrate_heads: kind must be 'duo' or 'lukv', got {kind!r}")
    if not prompts or len(prompts) != len(traces):
        raise KVComposeError("calibrate_heads: give one trace per prompt (at least one)")
    device = next(model.parameters()).device
    total: Tensor | None = None
    count = 0
    for prompt, trace in zip(prompts, traces):
        ids = torch.as_tensor(prompt, dtype=torch.long, device=device).reshape(1, -1)
        cont = torch.as_tensor(trace, dtype=torch.long, device=device).reshape(1, -1)
        full = torch.cat([ids, cont], dim=1)
        t0, t = ids.shape[1], full.shape[1]
        if t <= t0:
            continue
        if kind == "duo" and t <= sinks + recent:  # no query sees a token outside its streaming window
            raise KVComposeError(
                f"calibrate_heads: trace {count + 1} has {t} tokens (prompt and trace), not more than the streaming "
                f"window of {sinks} sinks + {recent} recent tokens: no query attends a token outside it, so every "
                "head would score 0; give longer traces (--new-tokens) or a smaller --recent")
        cache = KVComposeCache(model, Pipeline(_QueryProbe(t)), budget=None, strict=False)
        model(input_ids=full, past_key_values=cache)
        per_layer = []
        for layer in cache.layers:
            h = layer.keys.shape[1]
            if kind == "duo":
                out = torch.zeros(layer.segment.ring.queries.shape[1], dtype=torch.float64, device=device)
                keys = torch.arange(t, device=device)
                for s in range(t0, t, query_chunk):
                    e = min(s + query_chunk, t)
                    p = _layer_probs(layer, s, e)
                    qpos = torch.arange(s, e, device=device)[:, None]
                    outside = (keys[None, :] >= sinks) & (keys[None, :] <= qpos - recent)  # [Q, T]
                    out += (p * outside).sum(-1).double().sum(-1)
                per_layer.append((out / (t - t0)).reshape(h, -1).mean(-1))
            else:
                s = max(t0, t - window)
                p = _layer_probs(layer, s, t).sort(dim=-1, descending=True).values  # [Hq, W, T]
                per_layer.append(p.double().mean(1).reshape(h, -1, t).mean(1))  # [H, T]
        cur = torch.stack(per_layer)
        if kind == "lukv":
            cur = lukv_prune_curves(cur.float())
        total = cur if total is None else total + cur
        count += 1
    if total is None:
        raise KVComposeError("calibrate_heads: no prompt produced decoding queries")
    if kind == "duo" and not bool((total != 0).any()):
        raise KVComposeError(f"calibrate_heads: every head scored 0 (no decoding query put attention outside the "
                             f"first {sinks} and the newest {recent} tokens): give longer traces or a smaller --recent")
    avg = (total / count).tolist()
    profile: dict[str, Any] = {"kind": DUO_KIND if kind == "duo" else CURVES_KIND, "version": 1, "model": model_id(model),
                               "fingerprint": model_fingerprint(model, weights=True), "prompts": count}
    if kind == "duo":
        profile.update({"head_scores": avg, "sinks": sinks, "recent": recent,
                        "measure": "attention mass outside the first `sinks` and the newest `recent` tokens"})
    else:
        profile.update({"prune": avg, "window": window,
                        "measure": "global top-k of every head's sorted attention from the last `window` queries"})
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(profile))
    return profile


def calibrate_heads_from_data(model, tokenizer, data: str | os.PathLike | list[dict[str, Any]], out=None,
                              kind: Literal["duo", "lukv"] = "duo", n: int = 4, offset: int = 1000,
                              new_tokens: int = 512, trace_kind: str = "sampled", seed: int = 1,
                              progress: bool = False, **kw: Any) -> dict[str, Any]:
    """From questions to a head-wise profile (what `kvcompose calibrate --target duo|lukv` runs): `n` questions of a
    JSONL file from line `offset` (use questions you do not evaluate on), full-cache reference traces of
    `new_tokens` tokens (`kvcompose.traces.make_traces`), then `calibrate_heads`."""
    from .data import load_questions
    from .traces import make_traces

    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise KVComposeError(f"calibrate: n must be a positive int, got {n!r}")
    questions = load_questions(data, n, offset) if isinstance(data, (str, os.PathLike)) else list(data)[:n]
    if not questions:
        raise KVComposeError(f"calibrate: no question at line {offset} of {data}")
    traces = make_traces(model, tokenizer, questions, new_tokens=new_tokens, kind=trace_kind, seed=seed,
                         progress=progress)
    prof = calibrate_heads(model, [tr.prompt_ids for tr in traces], [tr.trace_ids for tr in traces], kind=kind, **kw)
    source = f"{Path(data).name} lines {offset}-{offset + len(questions) - 1}" if isinstance(data, (str, os.PathLike)) \
        else f"{len(questions)} given questions"
    prof["calibration"] = {"questions": source, "kind": trace_kind, "seed": seed, "traces": len(traces),
                           "trace_tokens": new_tokens}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(prof))
    return prof
