"""Allocators: how many tokens each layer, (row, KV head) and request may keep.

The allocator is the one source of budgets. Contract: `allocator(view, budget, state) -> (Long[B, H], state)`,
where `budget` is the layer's token budget: the cache's budget, or `allocator.layer_budget(i, num_layers,
budget, seen)` for an allocator with a per-layer schedule (the `LayerSchedule` capability: `Pyramid`,
`ReasoningWave`, `SeenShare`). Allocators with `uniform = True` give every head of a layer the same budget:
each layer keeps dense `[B, H, K_l, D]` buffers (`kvcompose.stores.DenseStore`), so memory follows the
per-layer budgets. Per-head and per-request allocators (`HeadUtility`, `GrowPage`) set `uniform = False`:
the layer then lives in paged storage (`kvcompose.stores.PagedStore`), where memory follows the *sum* of
the per-head budgets, not `B * H * max(budget)`.

Budget conservation (checked by tests/test_allocators.py):
- `Pyramid` and `ReasoningWave`: `sum_l layer_budget(l) == num_layers * budget` exactly.
- `HeadUtility`: per row, `sum_h budget[b, h] == H * layer_budget` and every head gets at least its floor.
- `GrowPage`: per layer and KV head, `sum_b pages[b] * page <= cap * B * budget` (the global cap across the
  batch), every row keeps at least `floor` pages and all KV heads of a row the same budget.

Stateful allocators (`GrowPage`) declare `init(spec)` and return their new state from each call; the
pipeline threads it per layer (and per tree node), never on the block object: one allocator serves every
layer and row. Calibration of ReasonAlloc profiles lives in `kvcompose.calibration`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..block import Block, LayerSchedule
from ..hostsync import host_of
from ..view import KVComposeError, LayerView

__all__ = ["Allocator", "Uniform", "round_to_total", "layer_budget"]


# ------------------------------------------------------------------------------------------- helpers
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _share(x: int | float, budget: int) -> int:
    """An absolute count (int) or a share of `budget` (float)."""
    return int(x * budget) if isinstance(x, float) else int(x)


def round_to_total(raw: Float[Tensor, "*batch N"], total: Int[Tensor, "*batch"]) -> Int[Tensor, "*batch N"]:
    """Round non-negative `raw` to integers whose sum over the last axis is exactly `total`
    (largest-remainder method; ties go to the lower index). `total` must lie in
    `[sum(floor(raw)), sum(floor(raw)) + N]`."""
    floors = raw.floor()
    rem = total - floors.sum(-1).long()
    frac = raw - floors
    n = raw.shape[-1]
    if bool((rem < 0).any()) or bool((rem > n).any()):
        raise KVComposeError("round_to_total: total out of reach of the raw shares")
    order = torch.sort(frac, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(n, device=raw.device).expand_as(order))
    return floors.long() + (rank < rem[..., None]).long()


def _round_list(raw: list[float], total: int) -> list[int]:
    t = torch.tensor(raw, dtype=torch.float64, device="cpu")  # host arithmetic on a schedule
    return [int(x) for x in round_to_total(t, torch.tensor(total, device="cpu"))]


def _check_budget(budget: Any, who: str) -> int:
    if not _is_int(budget) or budget <= 0:
        raise KVComposeError(f"{who}: budget must be a positive int, got {budget!r}")
    return budget


# ------------------------------------------------------------------------------------------- base
def layer_budget(allocator: "Allocator", layer_idx: int, num_layers: int, budget: int | None, seen: int) -> int | None:
    """The token budget of one layer: the allocator's schedule (`LayerSchedule`), else the cache's budget."""
    if isinstance(allocator, LayerSchedule):
        return allocator.layer_budget(layer_idx, num_layers, budget, seen)
    return budget


class Allocator(Block):
    """Base class. Subclasses implement `allocate(view, budget) -> Long[B, H]` (budget per row and KV head),
    or `allocate(view, budget, state) -> (Long[B, H], state)` when they keep state (`init`).

    Class attributes:
        uniform: True when all heads and rows of a layer always get the same budget, which lets the layer
            store its tokens as one dense `[B, H, K, D]` tensor. False: paged storage for every layer.
        needs_budget: False when the allocator derives budgets without the cache's `budget=` (`SeenShare`).
        query_window: how many recent post-RoPE queries the allocator reads (the layer's ring buffer).
        page_size: tokens per page of the paged storage (only read when `uniform` is False).
        constant: True when `allocate` gives every row and head exactly the `budget` it is called with, so
            the host knows the budgets without reading the device (`host_budgets`).
        static_schedule: True when `layer_budget` is a pure function of its arguments (no state, nothing
            observed while decoding: `Pyramid`, `ReasoningWave`), so an engine that cannot see the data (vLLM's
            scheduler) can compute every layer's budget itself.

    Optional: the `LayerSchedule` capability (`layer_budget(layer_idx, num_layers, budget, seen) -> int`);
    `initial_limits(budget, batch, heads, device) -> Long[B, H]`: per-head limits before the first event of a
    paged layer; `check(pipeline, budget, num_layers, num_heads)`: refuse impossible settings before decoding.
    """

    uniform: bool = True
    needs_budget: bool = True
    page_size: int = 16
    constant: bool = False
    static_schedule: bool = False

    def __call__(self, view: LayerView, budget: int, state: Any = None) -> tuple[Int[Tensor, "B H"], Any]:
        if self.takes_state:
            out, state = self.allocate(view, budget, state)
        else:
            out = self.allocate(view, budget)
        b, h, _ = view.shape
        if out.shape != (b, h):
            raise KVComposeError(f"{type(self).__name__} returned budgets of shape {tuple(out.shape)}, expected {(b, h)}")
        return out, state  # positive budgets: checked by the pipeline on the host copy (`host_budgets`)

    def host_budgets(self, budgets: Int[Tensor, "B H"], budget: int) -> np.ndarray:
        """The budgets `allocate` gave (`[B, H]`), on the host: `budget` everywhere for a `constant`
        allocator, else one device read (the event's second at most)."""
        if self.constant:
            return np.full(tuple(budgets.shape), budget, dtype=np.int64)
        host = host_of(budgets)  # an allocator that read its budgets already attaches them
        return host if host is not None else budgets.cpu().numpy().astype(np.int64)

    def allocate(self, view: LayerView, budget: int, *state: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def layer_budgets(self, num_layers: int, budget: int) -> list[int]:
        """All layer budgets at a cache budget (their sum is `num_layers * budget` for every schedule here)."""
        return [layer_budget(self, i, num_layers, budget, budget) or budget for i in range(num_layers)]

    def initial_limits(self, budget: int, batch: int, heads: int, device: torch.device) -> Int[Tensor, "B H"]:
        """Per-head token limits of a paged layer before its first compression event."""
        return torch.full((batch, heads), budget, dtype=torch.long, device=device)

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        """Raise `KVComposeError` if this allocator cannot work with the pipeline at this budget."""
        if budget is None:
            return
        for i, b in enumerate(self.layer_budgets(num_layers, budget)):
            if b <= 0:
                raise KVComposeError(f"{self!r} gives layer {i} a budget of {b} tokens")
            fixed = pipeline.fixed_protection(b)
            if fixed > b and not pipeline.tier.holds_tokens:
                raise KVComposeError(
                    f"{self!r} gives layer {i} a budget of {b} tokens, less than the {fixed} tokens the "
                    "protectors always keep: raise the budget or shrink the protected window"
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Uniform(Allocator):
    """The same budget for every layer, row and KV head (every reference method's default)."""

    constant = True

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        b, h, _ = view.shape
        return torch.full((b, h), budget, dtype=torch.long, device=view.keys.device)
