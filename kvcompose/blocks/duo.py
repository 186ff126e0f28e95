"""DuoAttention: retrieval heads keep every token, streaming heads keep attention sinks and recent tokens.

Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads",
arXiv 2410.10819; kvpress's `DuoAttentionPress`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from ..allocators import Allocator
from ..fingerprint import check_fingerprint
from ..view import FAR_POSITION, KVComposeError, LayerView, warn_unused
from ._util import check_head_table, check_page_size, read_profile

__all__ = ["DuoHeads", "DUO_KIND", "load_duo_profile", "streaming_mask"]

DUO_KIND = "kvcompose.duo_heads"


def load_duo_profile(profile: str | os.PathLike | dict) -> dict[str, Any]:
    """A head-type profile: a dict or the JSON written by `kvcompose calibrate --target duo`, with `head_scores`
    (`[layers][KV heads]`, higher = more of a retrieval head) and the `sinks` / `recent` it was measured for."""
    data, _ = read_profile("DuoHeads", profile, "duo")
    scores = data.get("head_scores") if isinstance(data, dict) else None
    if (not isinstance(scores, list) or not scores or not all(isinstance(r, list) and r for r in scores)
            or len({len(r) for r in scores}) != 1):
        raise KVComposeError("DuoHeads: the profile needs 'head_scores', one list of numbers per layer, of equal length")
    for i, row in enumerate(scores):
        for j, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise KVComposeError(f"DuoHeads: head_scores[{i}][{j}] is {x!r}, not a finite number: every (layer, KV "
                                     "head) needs a score (`kvcompose calibrate --target duo` writes them)")
    return data


def streaming_mask(head_scores: Any, streaming: float) -> Bool[Tensor, "L H"]:
    """True for the `round(L * H * streaming)` heads of lowest score (over all layers): the streaming heads,
    chosen exactly as kvpress's `DuoAttentionPress.post_init_from_model` does."""
    s = torch.as_tensor(head_scores, dtype=torch.float64, device="cpu").clamp(0, 1)
    n = round(s.numel() * streaming)
    mask = torch.zeros(s.numel(), dtype=torch.bool, device=s.device)
    if n > 0:
        mask[torch.argsort(s.reshape(-1), stable=True)[:n]] = True
    return mask.reshape(s.shape)


class DuoHeads(Allocator):
    """DuoAttention's head types as per-head budgets: a retrieval head keeps every token it holds (its budget is
    its real token count, or `retrieval` if given), a streaming head keeps the cache's budget, which the
    pipeline fills with sinks and recent tokens (`methods.duo_attention`: `ProtectSinks(sinks)`, `Recency()`,
    `TopK()`, so a streaming head's budget is `sinks + recent`).

    The head types come from a profile (`kvcompose calibrate --target duo`, or DuoAttention's own published
    patterns through `from_pattern`): the `streaming` share of all (layer, KV head) pairs with the lowest
    scores, over every layer at once, are streaming heads, as in kvpress's `DuoAttentionPress`. kvpress masks
    the streaming heads' middle tokens during attention (no memory is freed); kvcompose evicts them at every
    event, in paged storage (`uniform = False`), so a streaming head holds `sinks + recent` tokens plus at most
    one interval.

    Args:
        profile: a path or dict with `head_scores` `[layers][KV heads]` (see `load_duo_profile`).
        streaming: share of heads that stream (kvpress's `head_compression_ratio`; 0.5).
        retrieval: the most tokens a retrieval head keeps (None: all, as DuoAttention).
        page_size: tokens per page of the paged storage.
    """

    uniform = False

    def __init__(self, profile: str | os.PathLike | dict, streaming: float = 0.5, retrieval: int | None = None,
                 page_size: int = 16):
        if isinstance(streaming, bool) or not isinstance(streaming, (int, float)) or not 0.0 <= streaming <= 1.0:
            raise KVComposeError(f"DuoHeads: streaming must be a share in [0, 1], got {streaming!r}")
        if retrieval is not None and (isinstance(retrieval, bool) or not isinstance(retrieval, int) or retrieval <= 0):
            raise KVComposeError(f"DuoHeads: retrieval must be a positive int or None, got {retrieval!r}")
        check_page_size("DuoHeads", page_size)
        self.profile = load_duo_profile(profile)
        self.streaming, self.retrieval, self.page_size = float(streaming), retrieval, page_size
        self.mask = streaming_mask(self.profile["head_scores"], self.streaming)  # [L, H]
        if retrieval is not None and bool(self.mask.all()):
            warn_unused(f"DuoHeads(retrieval={retrieval})", f"streaming={streaming:g} makes every head a streaming head")
        self.path = None if isinstance(profile, dict) else str(profile)

    @staticmethod
    def from_pattern(head_scores_tsv: str | os.PathLike, config_json: str | os.PathLike | None = None,
                     streaming: float = 0.5, **kw: Any) -> "DuoHeads":
        """DuoAttention's published attention pattern (`full_attention_heads.tsv`, one row per layer, one column per
        KV head; its `config.json` gives `sink_size` / `recent_size`), as kvpress loads it."""
        rows = [[float(x) for x in line.split("\t")] for line in Path(head_scores_tsv).read_text().splitlines()
                if line.strip()]
        prof: dict[str, Any] = {"kind": DUO_KIND, "head_scores": rows, "source": Path(head_scores_tsv).name}
        if config_json is not None:
            cfg = json.loads(Path(config_json).read_text())
            prof["sinks"], prof["recent"] = cfg.get("sink_size"), cfg.get("recent_size")
        return DuoHeads(prof, streaming=streaming, **kw)

    def bind_model(self, model: Any) -> None:
        """Refuse a model the profile was not calibrated on (its recorded fingerprint: architecture and weights)."""
        check_fingerprint("DuoHeads", self.profile, model, "calibrate a profile with `kvcompose calibrate --target duo`")

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        check_head_table("DuoHeads", tuple(self.mask.shape), num_layers, num_heads, "duo")
        super().check(pipeline, budget, num_layers, num_heads)

    def heads(self, layer: int) -> Bool[Tensor, " H"]:
        """True for the streaming KV heads of a layer."""
        if not 0 <= layer < self.mask.shape[0]:
            raise KVComposeError(f"DuoHeads: layer {layer} out of the profile's {self.mask.shape[0]} layers")
        return self.mask[layer]

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        b, h, _ = view.shape
        stream = self.heads(view.layer_idx).to(view.device)
        if stream.numel() != h:
            raise KVComposeError(f"DuoHeads: the profile has {stream.numel()} KV heads, the layer {h}")
        # every real token the head holds (left padding does not count: a padded row keeps what the row alone keeps)
        held = (view.valid & (view.positions < FAR_POSITION)).sum(-1).clamp(min=1)
        keep = held if self.retrieval is None else held.clamp(max=self.retrieval)
        return torch.where(stream[None, :], torch.full_like(held, budget), torch.maximum(keep, torch.full_like(keep, budget)))

    def __repr__(self) -> str:
        src = os.path.basename(self.path) if self.path else "dict"
        return f"DuoHeads({src!r}, streaming={self.streaming:g}{'' if self.retrieval is None else f', retrieval={self.retrieval}'})"
