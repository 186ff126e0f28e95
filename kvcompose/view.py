"""The `LayerView`: what every block sees of one layer's cache at a compression event.

Shapes: B batch rows, H KV heads, Hq query heads (Hq = H * G for grouped-query attention),
T held tokens, D head dim, W buffered queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


class KVComposeError(ValueError):
    """Raised for bad input: a bad budget, incompatible blocks, an unsupported model, a device/dtype mix."""


@dataclass(frozen=True)
class LayerView:
    """A read-only snapshot of one layer's held tokens, handed to every block of a `Pipeline`.

    Attributes:
        layer_idx: index of the decoder layer.
        num_layers: number of decoder layers in the model.
        keys: `[B, H, T, D]` held keys, after RoPE.
        values: `[B, H, T, D]` held values.
        positions: `[B, H, T]` original token position (index in the sequence of all tokens seen,
            padding included), ascending along T.
        valid: `[B, H, T]` False for left-padding tokens (never worth keeping).
        prompt_length: number of tokens of the first forward call (the prompt, padding included).
        queries: `[B, Hq, W, D]` the last W post-RoPE queries of this layer, oldest first, or None.
        query_positions: `[W]` positions of those queries.
        query_valid: `[B, W]` False where a buffered query belongs to a padding token.
        seen: number of tokens seen so far (held + evicted).
        scale: attention scaling (1/sqrt(D) unless the model says otherwise).
        state: the layer's per-block state (e.g. accumulated attention), keyed by block key; token-aligned
            tensors are `[B, H, T]`.
        generator: the layer's random generator (seeded by the cache).
        event: how many compression events this layer has run before this one.
    """

    layer_idx: int
    num_layers: int
    keys: Float[Tensor, "B H T D"]
    values: Float[Tensor, "B H T D"]
    positions: Int[Tensor, "B H T"]
    valid: Bool[Tensor, "B H T"]
    prompt_length: int
    queries: Float[Tensor, "B Hq W D"] | None
    query_positions: Int[Tensor, " W"] | None
    query_valid: Bool[Tensor, "B W"] | None
    seen: int
    scale: float
    state: dict[str, Any] = field(default_factory=dict)
    generator: torch.Generator | None = None
    event: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        """`(B, H, T)`."""
        b, h, t, _ = self.keys.shape
        return b, h, t

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
