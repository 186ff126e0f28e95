"""Small helpers the ported blocks share: ranks among real tokens, sink and tail masks, query groups.

Every rule that kvpress defines by index into a contiguous prefill (sinks = the first slots, windows and
partitions of consecutive slots) is applied here to the *real* tokens of each (row, KV head), in position
order: slots of left padding and the padding past a ragged head's tokens are skipped, so a left-padded row
scores exactly as that row alone.

Shapes: B batch rows, H KV heads, Hq query heads, G = Hq / H, T held slots, W buffered queries, D head dim.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..view import KVComposeError, LayerView

__all__ = ["sink_end", "real_rank", "first_real", "last_real", "protect_top", "window_queries", "group_mean",
           "row_zscore", "read_profile", "check_page_size", "check_head_table"]


def real_rank(valid: Bool[Tensor, "B H T"]) -> Int[Tensor, "B H T"]:
    """Index of every slot among the real tokens of its (row, head) (0 for the first real one; padding slots get
    the rank of the next real token, use `valid` to mask them)."""
    return valid.long().cumsum(-1) - valid.long()


def first_real(valid: Bool[Tensor, "B H T"], n: int) -> Bool[Tensor, "B H T"]:
    """True for the first `n` real tokens of each (row, head)."""
    return valid & (real_rank(valid) < n)


def last_real(valid: Bool[Tensor, "B H T"], n: int) -> Bool[Tensor, "B H T"]:
    """True for the last `n` real tokens of each (row, head)."""
    count = valid.sum(-1, keepdim=True)
    return valid & (real_rank(valid) >= count - n)


def protect_top(scores: Float[Tensor, "B H T"], mask: Bool[Tensor, "B H T"], valid: Bool[Tensor, "B H T"]
                ) -> Float[Tensor, "B H T"]:
    """`scores` with the `mask` slots set above every other real token of their (row, head) (max + 1): kvpress
    pads its sinks and windows with `scores.max() + 1`; per (row, head) here, so rows stay independent."""
    others = scores.masked_fill(mask | ~valid, float("-inf")).amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(others), others, torch.zeros_like(others)) + 1.0
    return torch.where(mask, top.expand_as(scores), scores)


def window_queries(view: LayerView, window: int | None
                   ) -> tuple[Float[Tensor, "B Hq W D"], Int[Tensor, " W"], Bool[Tensor, "B W"]] | None:
    """The last `window` buffered queries (all with None), their positions and padding flags; None when the
    view has no query."""
    if view.queries is None or view.queries.shape[2] == 0:
        return None
    q, pos, ok = view.queries, view.query_positions, view.query_valid
    if window is not None:
        q, pos, ok = q[:, :, -window:], pos[-window:], ok[:, -window:]
    return q, pos, ok


def group_mean(x: Float[Tensor, "B Hq *R"], heads: int) -> Float[Tensor, "B H *R"]:
    """Mean over the query heads of each KV head's group."""
    b, hq = x.shape[:2]
    return x.reshape(b, heads, hq // heads, *x.shape[2:]).mean(2)


def row_zscore(x: Float[Tensor, "B H T"], valid: Bool[Tensor, "B H T"]) -> Float[Tensor, "B H T"]:
    """`(x - mean) / std` over the real tokens of each row (all its heads), std unbiased and floored at 1e-6;
    kvpress z-scores over the whole tensor, which is the same for one row."""
    m = valid.float()
    n = m.sum((1, 2), keepdim=True).clamp(min=1)
    mean = (x * m).sum((1, 2), keepdim=True) / n
    var = (((x - mean) * m) ** 2).sum((1, 2), keepdim=True) / (n - 1).clamp(min=1)
    return ((x - mean) / var.sqrt().clamp(min=1e-6)).masked_fill(~valid, 0.0)


def sink_end(view: LayerView, sinks: int) -> Int[Tensor, "B 1"]:
    """Per row, the first position after its `sinks` sink tokens: the first real position held (over the row's
    heads) plus `sinks`. Queries before it are the sinks' own (kvpress drops them from its query statistics)."""
    pos = torch.where(view.valid, view.positions, torch.full_like(view.positions, torch.iinfo(view.positions.dtype).max))
    return pos.amin((1, 2))[:, None] + sinks


# ------------------------------------------------------------------------ per-head tables (DuoHeads, HeadCurves)
def read_profile(who: str, source: str | os.PathLike | Any, target: str) -> tuple[Any, str | None]:
    """`(data, path)`: the JSON in file `source` (with the `kvcompose calibrate --target <target>` that writes one
    named when it is missing), or `source` itself when it is not a path (path None)."""
    if not isinstance(source, (str, os.PathLike)):
        return source, None
    p = Path(source)
    if not p.is_file():
        raise KVComposeError(f"{who}: profile file {str(p)!r} not found; write one with "
                             f"`kvcompose calibrate --target {target} --out FILE`")
    try:
        return json.loads(p.read_text()), str(p)
    except json.JSONDecodeError as e:
        raise KVComposeError(f"{who}: {p} is not valid JSON ({e})") from None


def check_page_size(who: str, page_size: Any) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise KVComposeError(f"{who}: bad page size {page_size!r}: a positive int")


def check_head_table(who: str, shape: tuple[int, ...], num_layers: int, num_heads: int, target: str) -> None:
    """A calibrated `(layers, KV heads)` table must match the model it is used on."""
    if tuple(shape) != (num_layers, num_heads):
        raise KVComposeError(f"{who}: the profile has {tuple(shape)} (layers, KV heads), the model "
                             f"{(num_layers, num_heads)}: calibrate it on this model (`kvcompose calibrate --target "
                             f"{target}`)")
