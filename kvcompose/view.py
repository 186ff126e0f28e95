"""What blocks see: the `LayerView` of one layer at a compression event, the `AttentionStep` an observer
sees at every attention call, and the `LayerSpec` a block's state is initialised from.

Shapes: B batch rows, H KV heads, Hq query heads (Hq = H * G for grouped-query attention), T held tokens,
D head dim, W buffered queries, Q new queries.
"""

from __future__ import annotations

import warnings
from typing import Any
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

__all__ = ["KVComposeError", "KVComposeWarning", "warn_unused", "RowGenerators", "LayerView", "LayerSpec", "AttentionStep",
           "FAR_POSITION"]

FAR_POSITION = 2**40
"""Position of a padding slot of a ragged view (past a (row, head)'s tokens): later than any query, so causal
masks hide it, and every row's positions stay ascending."""


class KVComposeError(ValueError):
    """Raised for bad input: a bad budget, incompatible blocks, an unsupported model, a device/dtype mix."""


class KVComposeWarning(UserWarning):
    """Warned for an argument that has no effect: a budget for a pipeline that never compresses, a seed for a
    pipeline without random blocks, a preset option another option switches off, ..."""


def warn_unused(what: str, why: str, stacklevel: int = 3) -> None:
    """Warn (`KVComposeWarning`) that `what` (e.g. "budget=128") has no effect, and why."""
    warnings.warn(f"{what} has no effect: {why}", KVComposeWarning, stacklevel=stacklevel)


class RowGenerators(tuple):
    """One seeded generator per row of a `LayerView` (its `generator`), for rows that stand for separate
    requests (the vLLM route's grouped events): a draw whose shape leads with the rows (`seeding.draw`) takes row
    `r`'s part from generator `r`, so each row draws exactly what it draws alone (at the same width)."""


@dataclass(frozen=True)
class LayerSpec:
    """Static facts about one layer's cache, given to `Block.init` (state is built from them).

    Attributes:
        layer_idx, num_layers: which decoder layer, of how many.
        batch: B rows; heads: H KV heads; head_dim: D; value_dim: Dv.
        device, dtype: of the layer's keys and values (state should live on `device`).
    """

    layer_idx: int
    num_layers: int
    batch: int
    heads: int
    head_dim: int
    value_dim: int
    device: torch.device
    dtype: torch.dtype


@dataclass(frozen=True)
class LayerView:
    """A read-only snapshot of one layer's held tokens, handed to every block of a `Pipeline`.

    Attributes:
        layer_idx: index of the decoder layer.
        num_layers: number of decoder layers in the model.
        keys: `[B, H, T, D]` held keys, after RoPE.
        values: `[B, H, T, Dv]` held values.
        positions: `[B, H, T]` original token position (index in the sequence of all tokens seen,
            padding included), ascending along T.
        valid: `[B, H, T]` False for left-padding tokens and empty slots (never worth keeping).
        prompt_length: number of tokens of the first forward call (the prompt, padding included).
        queries: `[B, Hq, W, D]` the last W post-RoPE queries of this layer, oldest first, or None.
        query_positions: `[W]` positions of those queries.
        query_valid: `[B, W]` False where a buffered query belongs to a padding token.
        seen: number of tokens seen so far (held + evicted).
        scale: attention scaling (1/sqrt(D) unless the model says otherwise).
        generator: the layer's random generator (seeded by the cache, on the layer's device), or one per row
            (`RowGenerators`, rows of separate requests): blocks draw through `seeding.draw`.
        event: how many compression events this layer has run before this one.
        rows: `[B]` the rows this event compresses (None: all of them); the other rows keep every token.
        cache_budget: the budget the cache was given, before any per-layer schedule (None: none).
        host_real: int64 numpy `[B, H]`: the real slots (positions before `FAR_POSITION`) per (row, head),
            known on the host (the store's and the tier's mirrored counts), or None.
        padding: `[B]` left-padding tokens among the tokens seen of each row (None: no row was padded). A
            left-padded row's own tokens start at position `padding[b]`: `row_positions` and `row_seen` count
            from there, so a rule defined by counts or positions (LU-KV's ratio, ChunkKV's chunks) treats the
            row as it would treat the row alone.
    """

    layer_idx: int
    num_layers: int
    keys: Float[Tensor, "B H T D"]
    values: Float[Tensor, "B H T Dv"]
    positions: Int[Tensor, "B H T"]
    valid: Bool[Tensor, "B H T"]
    prompt_length: int
    queries: Float[Tensor, "B Hq W D"] | None
    query_positions: Int[Tensor, " W"] | None
    query_valid: Bool[Tensor, "B W"] | None
    seen: int
    scale: float
    generator: torch.Generator | RowGenerators | None = None
    event: int = 0
    rows: Bool[Tensor, " B"] | None = None
    cache_budget: int | None = None
    host_real: Any = None
    padding: Int[Tensor, " B"] | None = None

    @property
    def row_positions(self) -> Int[Tensor, "B H T"]:
        """`[B, H, T]` positions counted from each row's first token (left padding not counted; padding slots get
        negative positions)."""
        if self.padding is None:
            return self.positions
        return self.positions - self.padding.to(self.positions.device)[:, None, None]

    @property
    def row_seen(self) -> Int[Tensor, " B"]:
        """`[B]` tokens each row has seen, its left padding not counted."""
        seen = torch.full((self.keys.shape[0],), self.seen, dtype=torch.long, device=self.keys.device)
        return seen if self.padding is None else seen - self.padding.to(seen.device)

    @property
    def shape(self) -> tuple[int, int, int]:
        """`(B, H, T)`."""
        b, h, t, _ = self.keys.shape
        return b, h, t

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def is_prompt(self) -> Bool[Tensor, "B H T"]:
        """`[B, H, T]` True for tokens of the prompt (the first forward call)."""
        return self.positions < self.prompt_length

    @property
    def groups(self) -> int:
        """Query heads per KV head (G)."""
        if self.queries is None:
            return 1
        return self.queries.shape[1] // self.keys.shape[1]


@dataclass(frozen=True)
class AttentionStep:
    """One attention call of a layer, as an observer (e.g. H2O's accumulated attention) sees it.

    Attributes:
        queries: `[B, Hq, Q, D]` the new post-RoPE queries.
        keys: `[B, H, T, D]` every key they attended (held and fetched from tiers), in position order.
        positions: `[B, H, T]` their original positions; valid: `[B, H, T]`.
        mask: `[B, H, Q, T]` True where a query attended a key (None: every query saw every key).
        scale: the attention scaling.
        softcap: logit soft-capping of the model (Gemma 2), or None.
        sinks: `[Hq]` learned sink logits of the model (gpt-oss), or None.
    """

    queries: Float[Tensor, "B Hq Q D"]
    keys: Float[Tensor, "B H T D"]
    positions: Int[Tensor, "B H T"]
    valid: Bool[Tensor, "B H T"]
    mask: Bool[Tensor, "B H Q T"] | None
    scale: float
    softcap: float | None = None
    sinks: Float[Tensor, " Hq"] | None = None

    def full_mask(self) -> Bool[Tensor, "B H Q T"]:
        """The mask, or an all-True one when every query saw every key."""
        if self.mask is not None:
            return self.mask
        b, h, t, _ = self.keys.shape
        return torch.ones(b, h, self.queries.shape[2], t, dtype=torch.bool, device=self.keys.device)
