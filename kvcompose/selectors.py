"""Selectors: `(scores, protected, valid, budget[B, H]) -> (kept Long[B, H, K], order Long[B, H, T] | None)`.

`kept` is sorted ascending, i.e. in chronological order (slots are held in position order), so
recency-based rules never see a shuffled cache (kvpress keeps top-k order). `K` is the largest budget; a
head with a smaller budget pads its row with -1 at the end. Protected tokens are kept first; padding
tokens are never kept in place of a real one.

`order` (asked for with `need_order=True`, e.g. when a tier store will hold what is not kept) is the full
priority order of the slots: the kept ones first, then the others from most to least worth keeping
(protected, then real tokens by priority, newest first among equal priorities, padding last). A tier store
places the tokens that leave HBM by that same order, so HBM, host memory, the compressed tier and eviction
all follow one ranking.
"""

from __future__ import annotations

import numpy as np
import torch
from typing import Any, Literal

from jaxtyping import Bool, Float, Int
from torch import Tensor

from .block import Block, accepts, require_role, with_state
from .hostsync import check_later
from .kernels.ref import run_sums, top_last
from .seeding import draw
from .view import KVComposeError, RowGenerators

__all__ = ["Selector", "TopK", "Sample", "RandomDrop", "BlockGranular", "indices_from_priority", "priority_order"]


def _rand(shape: tuple[int, ...], generator: Any, device: torch.device) -> Tensor:
    """Uniform draws from `generator` (or one per row: `RowGenerators`) on its own device, moved to `device`."""
    return draw(torch.rand, shape, generator, device)


def priority_order(
    priority: Float[Tensor, "B H T"], protected: Bool[Tensor, "B H T"], valid: Bool[Tensor, "B H T"]
) -> Int[Tensor, "B H T"]:
    """Slots from most to least worth keeping: protected, then real tokens by `priority` (newest first among
    equal priorities), then padding."""
    t = priority.shape[-1]
    key = torch.nan_to_num(priority.float(), nan=-3e38, posinf=3e38, neginf=-3e38).flip(-1)
    o = torch.sort(key, dim=-1, descending=True, stable=True).indices
    group = (valid.long() + (protected & valid).long()).flip(-1).gather(-1, o)
    o = o.gather(-1, torch.sort(group, dim=-1, descending=True, stable=True).indices)
    return (t - 1) - o


def _kmax(budget: Int[Tensor, "B H"], t: int, host_budget: np.ndarray | None) -> int:
    """The kept width: the largest budget (at most `t`), from the host copy when there is one (no sync)."""
    if host_budget is not None:
        return int(min(int(host_budget.max()) if host_budget.size else 0, t))
    return int(budget.max().clamp(max=t))


def _kept_from_order(order: Int[Tensor, "B H T"], budget: Int[Tensor, "B H"],
                     host_budget: np.ndarray | None = None) -> Int[Tensor, "B H K"]:
    t = order.shape[-1]
    kmax = _kmax(budget, t, host_budget)
    idx = order[..., :kmax]
    keep = torch.arange(kmax, device=order.device)[None, None, :] < budget[..., None].clamp(max=t)
    idx = torch.where(keep, idx, torch.full_like(idx, t)).sort(dim=-1).values
    return torch.where(idx >= t, torch.full_like(idx, -1), idx)


def _kept_first(order: Int[Tensor, "B H T"], kept: Int[Tensor, "B H K"]) -> Int[Tensor, "B H T"]:
    """`order` with the kept slots moved to the front (both parts keep their relative order)."""
    t = order.shape[-1]
    is_kept = torch.zeros((*order.shape[:-1], t + 1), dtype=torch.bool, device=order.device)
    is_kept.scatter_(-1, torch.where(kept >= 0, kept, torch.full_like(kept, t)), True)  # padding: slot t, dropped
    first = is_kept[..., :t].gather(-1, order).to(torch.int8)
    return order.gather(-1, torch.sort(first, dim=-1, descending=True, stable=True).indices)


def indices_from_priority(
    priority: Float[Tensor, "B H T"], budget: Int[Tensor, "B H"], host_budget: np.ndarray | None = None
) -> Int[Tensor, "B H K"]:
    """Keep the `budget[b, h]` slots of highest priority (newest first among equal priorities, as in
    `priority_order`, so that ties break the same way whatever the width of the batch); return them sorted
    ascending, -1 padded. `host_budget`: the same budgets on the host (then no host sync)."""
    b, h, t = priority.shape
    kmax = _kmax(budget, t, host_budget)
    top = top_last(priority, kmax)  # [B, H, K]; not topk, whose tie-break depends on T and the device
    rank = torch.arange(kmax, device=priority.device)
    keep = rank[None, None, :] < budget[..., None].clamp(max=t)
    idx = torch.where(keep, top, torch.full_like(top, t))  # dropped -> sentinel t, sorts last
    idx = idx.sort(dim=-1).values
    return torch.where(idx >= t, torch.full_like(idx, -1), idx)


class Selector(Block):
    """Base class. Subclasses implement `priority(scores, valid, generator) -> Float[B, H, T]` (adding a
    `positions` parameter, `[B, H, T]` positions counted from each row's first token, when the rule reads them;
    a `state` parameter, and a `(priority, new_state)` return, when it keeps layer state); `needs_scores` says
    whether the pipeline must supply a scorer. A selector whose kept set is not "the top of one priority"
    (whole blocks, per-head counts) overrides `choose`, which gets every argument; `__call__` and `apply` stay
    the base class's, so every selector has one call shape."""

    _hook = "priority(scores, valid, generator) (or choose)"

    needs_scores: bool = True
    ragged: bool = False  # True when kept counts may differ between rows and heads (paged storage)

    def head_bound(self, budget: int, heads: int) -> int:
        """The most tokens one of a layer's `heads` KV heads can keep when every head's budget is `budget`:
        `budget`, or for a ragged selector the layer's total `heads * budget` (what vLLM's scheduler keeps blocks
        for, `Settings.held_bound`). A ragged selector that guarantees every head a floor states less."""
        return heads * budget if self.ragged else budget

    def priority(
        self,
        scores: Float[Tensor, "B H T"] | None,
        valid: Bool[Tensor, "B H T"],
        generator: torch.Generator | RowGenerators | None,
    ) -> Float[Tensor, "B H T"]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(
        self,
        scores: Float[Tensor, "B H T"] | None,
        protected: Bool[Tensor, "B H T"],
        valid: Bool[Tensor, "B H T"],
        budget: Int[Tensor, "B H"],
        generator: torch.Generator | RowGenerators | None = None,
        need_order: bool = False,
        positions: Int[Tensor, "B H T"] | None = None,
        *,
        host_budget: np.ndarray | None = None,
        may_overflow: bool = True,
    ) -> tuple[Int[Tensor, "B H K"], Int[Tensor, "B H T"] | None]:
        """`(kept, order)`: see the module docstring. Protected tokens beyond a head's budget (allowed only
        when a tier store keeps what HBM does not) are ranked by priority among themselves.

        `host_budget`: `budget` on the host (the pipeline has it), so the selection needs no host sync;
        `may_overflow=False`: the caller knows no head protects more tokens than its budget."""
        return self.apply(scores, protected, valid, budget, generator, need_order, positions,
                          host_budget=host_budget, may_overflow=may_overflow)[0]

    def apply(
        self,
        scores: Float[Tensor, "B H T"] | None,
        protected: Bool[Tensor, "B H T"],
        valid: Bool[Tensor, "B H T"],
        budget: Int[Tensor, "B H"],
        generator: torch.Generator | RowGenerators | None = None,
        need_order: bool = False,
        positions: Int[Tensor, "B H T"] | None = None,
        state: Any = None,
        *,
        host_budget: np.ndarray | None = None,
        may_overflow: bool = True,
    ) -> tuple[tuple[Int[Tensor, "B H K"], Int[Tensor, "B H T"] | None], Any]:
        """`((kept, order), new_state)`: the one call shape of every leaf role (the pipeline calls this)."""
        extra = {"state": state} if accepts(type(self).choose, "state") else {}
        out = self.choose(scores, protected, valid, budget, generator, need_order, positions,
                          host_budget=host_budget, may_overflow=may_overflow, **extra)
        return with_state(out, state, result_is_pair=True)

    def _priority(self, scores, valid, generator, positions, state):
        """`(priority, new_state)` of `priority`, given the positions and state where it takes them."""
        kw = {}
        if accepts(type(self).priority, "positions"):
            kw["positions"] = positions
        if accepts(type(self).priority, "state"):
            kw["state"] = state
        return with_state(self.priority(scores, valid, generator, **kw), state)

    def choose(
        self,
        scores: Float[Tensor, "B H T"] | None,
        protected: Bool[Tensor, "B H T"],
        valid: Bool[Tensor, "B H T"],
        budget: Int[Tensor, "B H"],
        generator: torch.Generator | RowGenerators | None = None,
        need_order: bool = False,
        positions: Int[Tensor, "B H T"] | None = None,
        *,
        host_budget: np.ndarray | None = None,
        may_overflow: bool = True,
        state: Any = None,
    ) -> tuple[tuple[Int[Tensor, "B H K"], Int[Tensor, "B H T"] | None], Any]:
        """The kept set: the top of `priority`, protected tokens first (see `__call__`); returns
        `((kept, order), new_state)`."""
        if self.needs_scores and scores is None:
            raise KVComposeError(f"{type(self).__name__} needs scores but the pipeline has no scorer")
        if host_budget is not None:
            if (host_budget <= 0).any():
                raise KVComposeError(f"budget must be positive, got min {int(host_budget.min())}")
        elif (budget <= 0).any():
            raise KVComposeError(f"budget must be positive, got min {int(budget.min())}")
        raw, state = self._priority(scores, valid, generator, positions, state)
        raw = raw.float()
        if host_budget is None:  # a standalone call: decide on the host, as always
            overflow: bool | Tensor = bool((protected.sum(-1) > budget).any())
        else:  # decided on the device (no host sync): both selections, one picked by the flag
            overflow = (protected.sum(-1) > budget).any() if may_overflow else False
        if overflow is not False or need_order:
            order = priority_order(raw, protected, valid)
        if overflow is True:
            kept = _kept_from_order(order, budget, host_budget)
        else:
            # order: protected > other valid tokens (by priority) > padding
            finite = torch.nan_to_num(raw, nan=-3e38, posinf=3e38, neginf=-3e38).clamp(-1e30, 1e30)
            pri = torch.where(protected, torch.full_like(finite, 3e38), finite)
            pri = torch.where(valid, pri, torch.full_like(finite, -3e38))
            kept = indices_from_priority(pri, budget, host_budget)
            if isinstance(overflow, Tensor):
                kept = torch.where(overflow, _kept_from_order(order, budget, host_budget), kept)
        return (kept, (_kept_first(order, kept) if need_order else None)), state

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TopK(Selector):
    """Keep the highest-scoring tokens (H2O, SnapKV, R-KV, TOVA, StreamingLLM with `Recency`)."""

    def priority(self, scores, valid, generator):
        return scores


class Sample(Selector):
    """Sample tokens without replacement in proportion to their (non-negative) scores (VaSE).

    Gumbel-top-k on log-scores, which is equivalent to sequential sampling without replacement
    (Kool et al., ICML 2019). Draws come from the layer's seeded generator.

    Args:
        temperature: scores are raised to `1 / temperature` before sampling (1.0 = proportional).
        eps: floor added to scores so zero-score tokens can still be drawn last.
    """

    draws_random = True
    draws_per_row = True

    def __init__(self, temperature: float = 1.0, eps: float = 1e-12):
        if temperature <= 0:
            raise KVComposeError(f"temperature must be positive, got {temperature}")
        self.temperature, self.eps = temperature, eps

    def priority(self, scores, valid, generator):
        check_later(scores < 0, "Sample needs non-negative scores (it samples in proportion to them)")
        u = _rand(tuple(scores.shape), generator, scores.device)
        gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))
        return torch.log(scores.float() + self.eps) / self.temperature + gumbel

    def __repr__(self) -> str:
        return f"Sample(temperature={self.temperature})"


class RandomDrop(Selector):
    """Keep a uniform random subset of the unprotected tokens (Random Attention).

    Independent per row, layer and KV head, redrawn at every compression event from the layer's seeded
    generator (kvpress's random press reseeds on every call and so draws the same scores each time).

    Args:
        shared_heads: one draw per row shared by every KV head of the layer (the paper's per-head
            independence ablation: all heads then keep the same positions).
    """

    needs_scores = False
    draws_random = True
    draws_per_row = True

    def __init__(self, shared_heads: bool = False):
        self.shared_heads = bool(shared_heads)

    def priority(self, scores, valid, generator):
        b, h, t = valid.shape
        if self.shared_heads:
            return _rand((b, 1, t), generator, valid.device).expand(b, h, t)
        return _rand((b, h, t), generator, valid.device)

    def __repr__(self) -> str:
        return "RandomDrop(shared_heads=True)" if self.shared_heads else "RandomDrop()"


class BlockGranular(Selector):
    """Keep or evict whole blocks of `block` consecutive positions, as a paged serving engine must (vLLM,
    SGLang: 16-token blocks behind block tables). Wraps any selector: its token priorities are reduced per
    block (`mean` or `max` over the block's real tokens), a block with a protected token is protected, and
    blocks are kept from most to least worth keeping while the kept tokens fit in the budget (protected
    blocks are always kept, so a head may hold up to `block - 1` tokens more per protected run).

    A block is `position // block`, with positions counted from the row's first token (`LayerView.row_positions`:
    a left-padded row cuts the blocks the row alone cuts, as a request's blocks start at its first token in a
    paged engine): with block-granular eviction from the start, every held block is whole except the newest one. `per_head=False` ranks blocks by their mean priority over the KV heads of the
    row, so every head keeps the same blocks (one block table per layer, as in vLLM).

    Kept counts differ between rows and heads, so a pipeline with this selector stores its layers in paged
    storage (`ragged = True`).

    Args:
        inner: the token-level selector whose priorities are pooled (TopK, Sample, RandomDrop).
        block: positions per block (16).
        reduce: "mean" or "max" of the block's token priorities.
        per_head: separate blocks per KV head (True) or one set per layer row (False).
    """

    ragged = True

    def __init__(self, inner: Selector, block: int = 16, reduce: Literal["mean", "max"] = "mean",
                 per_head: bool = True):
        require_role(inner, Selector, "BlockGranular", ": it wraps a token-level selector (TopK, Sample, RandomDrop)")
        if isinstance(inner, BlockGranular):
            raise KVComposeError(f"BlockGranular wraps a token-level Selector, got {inner!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise KVComposeError(f"BlockGranular: block must be a positive int, got {block!r}")
        if reduce not in ("mean", "max"):
            raise KVComposeError(f"BlockGranular: reduce must be 'mean' or 'max', got {reduce!r}")
        self.inner, self.block, self.reduce, self.per_head = inner, block, reduce, bool(per_head)
        self.needs_scores = inner.needs_scores

    def children(self) -> tuple[Block, ...]:
        return (self.inner,)

    @property
    def draws_random(self) -> bool:  # type: ignore[override]
        return self.inner.draws_random

    def priority(self, scores, valid, generator):
        return self.inner.priority(scores, valid, generator)

    def blocks_of(self, positions: Int[Tensor, "B H T"], valid: Bool[Tensor, "B H T"]) -> Int[Tensor, "B H T"]:
        """Block number of every slot (`position // block`, positions counted from the row's first token, as the
        pipeline passes them); padding slots get -1."""
        return torch.where(valid, positions // self.block, torch.full_like(positions, -1))

    def choose(self, scores, protected, valid, budget, generator=None, need_order=False, positions=None, *,
               host_budget=None, may_overflow=True):
        if self.needs_scores and scores is None:
            raise KVComposeError(f"{type(self.inner).__name__} needs scores but the pipeline has no scorer")
        if positions is None:
            raise KVComposeError("BlockGranular needs the tokens' positions (call it through a Pipeline)")
        b, h, t = valid.shape
        raw = torch.nan_to_num(self.inner._priority(scores, valid, generator, positions, None)[0].float(), nan=-3e38,
                               posinf=3e38, neginf=-3e38)
        blk = self.blocks_of(positions, valid)
        # segment id of each slot: slots of one block are consecutive (positions ascend along T)
        start = torch.ones_like(blk, dtype=torch.bool)
        start[..., 1:] = blk[..., 1:] != blk[..., :-1]
        seg = start.long().cumsum(-1) - 1  # [B, H, T] in [0, T)
        ok = valid.float()
        # per-segment sums, deterministic (a block holds at most `block` slots: fixed-order run sums)
        size = run_sums(ok, seg, self.block)
        if self.reduce == "mean":
            val = run_sums(raw.clamp(-1e30, 1e30) * ok, seg, self.block)
            val = val / size.clamp(min=1)
        else:
            val = torch.full((b, h, t), -3e38, device=valid.device).scatter_reduce_(
                -1, seg, raw.masked_fill(~valid, -3e38), "amax")
        prot = run_sums((protected & valid).float(), seg, self.block) > 0
        real = size > 0
        if not self.per_head:  # one ranking per row: a block's value is its mean over the heads that hold it
            shared = torch.where(real, val, torch.zeros_like(val)).sum(1, keepdim=True)
            val = (shared / real.float().sum(1, keepdim=True).clamp(min=1)).expand_as(val)
            prot = prot.any(1, keepdim=True).expand_as(prot)
        key = torch.where(prot & real, torch.full_like(val, 3e38), val.clamp(-1e30, 1e30))
        key = torch.where(real, key, torch.full_like(val, -3.4e38))
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # segments by worth
        sizes = size.gather(-1, order)
        room = budget[..., None].float() - torch.cumsum(sizes, -1)
        take = ((room >= 0) | prot.gather(-1, order)) & real.gather(-1, order)
        keep_seg = torch.zeros(b, h, t, dtype=torch.bool, device=valid.device).scatter_(-1, order, take)
        keep = keep_seg.gather(-1, seg) & valid
        kmax = int(keep.sum(-1).max()) if keep.numel() else 0  # the kept width: one host read
        idx = torch.where(keep, torch.arange(t, device=valid.device).expand(b, h, t), torch.full_like(seg, t))
        kept = idx.sort(-1).values[..., :kmax]
        kept = torch.where(kept >= t, torch.full_like(kept, -1), kept)
        if not need_order:
            return kept, None
        pri = torch.where(keep, torch.full_like(raw, 3e38), key.gather(-1, seg))
        return kept, _kept_first(priority_order(pri, protected, valid), kept)

    def __repr__(self) -> str:
        return (f"BlockGranular({self.inner!r}, block={self.block}, reduce={self.reduce!r}"
                f"{'' if self.per_head else ', per_head=False'})")
