"""Allocators: the budget of each (row, KV head) of a layer at a compression event.

Contract: `allocator(view, budget) -> Long[B, H]`, where `budget` is the cache's per-layer token
budget. `Uniform` gives every head of every layer the same budget; per-layer and per-head schedules
(PyramidKV, ReasonAlloc, GrowPage) are further `Allocator` classes, not branches in the cache.
"""

from __future__ import annotations

import torch
from jaxtyping import Int
from torch import Tensor

from .view import KVComposeError, LayerView

__all__ = ["Allocator", "Uniform"]


class Allocator:
    """Base class. `uniform_per_layer` is True when all heads of a layer always get the same budget,
    which lets the cache store the layer as one dense `[B, H, K, D]` tensor."""

    uniform_per_layer: bool = True

    def __call__(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        out = self.allocate(view, budget)
        b, h, _ = view.shape
        if out.shape != (b, h):
            raise KVComposeError(f"{type(self).__name__} returned budgets of shape {tuple(out.shape)}, expected {(b, h)}")
        if (out <= 0).any():
            raise KVComposeError(f"{type(self).__name__} gave a non-positive budget")
        return out

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Uniform(Allocator):
    """The same budget for every layer, row and KV head."""

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        b, h, _ = view.shape
        return torch.full((b, h), budget, dtype=torch.long, device=view.keys.device)
