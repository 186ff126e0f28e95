"""Blocks for paged engines: protection by whole blocks, and one block set per request.

A paged serving engine (vLLM, SGLang) stores the KV cache in blocks of 16 positions behind block tables, so
it can only free whole blocks. `kvcompose.selectors.BlockGranular` makes any selector keep or evict whole
blocks (per KV head, or one set per layer row). This module adds what the block-granular rows of a method
need beyond the selector (measured in `docs/results/block_granular.md`):

- `BlockProtectValueNorm`: VaSE's value protection (Chang et al., terarachang/VaSE: the budget/4 tokens of
  largest value range, the 4 sinks counted as infinitely large) by whole blocks, so that protection stays
  inside VaSE's `k` tokens. A token protector inside `BlockGranular` protects up to `k` scattered blocks,
  i.e. up to `k * block` tokens.
- `RequestEvent`, `RequestBlocks`, `VotingValueProtect`: ONE block set for every layer and KV head of a
  request, what an engine with one block table per request (vLLM v1 unchanged) can do. The compression event
  runs over all layers at once after the forward that ends an interval: a record pass runs every layer's
  pipeline and keeps the token priorities (and VaSE's protection votes), the event ranks blocks by their
  priority averaged over tokens, KV heads and layers, and an apply pass compacts every layer to the chosen
  blocks.
- `block_granular(pipe, ...)` and `request_pipeline(pipe, ...)` turn a token-granular pipeline (any preset)
  into its per-head / per-layer-row and its per-request variant.

```python
pipe, event = request_pipeline(methods.h2o(), budget=256, block=16)
cache = KVComposeCache(model, pipe, budget=256)
with event.attached(model, cache):
    model.generate(**inputs, past_key_values=cache, max_new_tokens=512)
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..allocators import Uniform
from ..block import require_role
from ..compat import forward_cache
from ..kernels.ref import sums_by_index
from ..pipeline import Pipeline
from ..protectors import ProtectValueNorm, resolve_count
from ..selectors import BlockGranular
from ..view import KVComposeError, LayerView

__all__ = ["BlockProtectValueNorm", "RequestEvent", "RequestBlocks", "VotingValueProtect", "RequestSchedule",
           "block_granular", "request_pipeline"]

_BIG = 3e38  # priority of a protected block; real priorities are clamped to +-1e30


def _check_block(block: Any, name: str) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise KVComposeError(f"{name}: block must be a positive int, got {block!r}")
    return block


def _block_ids(positions: Int[Tensor, "B H T"], valid: Bool[Tensor, "B H T"], block: int) -> Int[Tensor, "B H T"]:
    """Block number of every slot (`position // block`); padding slots get block 0 (mask them with `valid`)."""
    return torch.where(valid, positions // block, torch.zeros_like(positions))


class BlockProtectValueNorm(ProtectValueNorm):
    """VaSE's value protection by whole blocks (a Protector: `LayerView -> Bool[B, H, T]`).

    The `k // block` blocks (`position // block`) holding the largest value range are protected, all their
    held tokens, where a block's value is the max over its eligible tokens (`value_magnitude`, "range" =
    max - min over the head dim) and the first `sinks` tokens count as infinitely large; `exclude_recent`
    newest tokens are not candidates. Protection thus stays within VaSE's `k` tokens (budget/4) at block
    granularity. With `per_head=False` a block's value is its max over the KV heads, so every head of a row
    protects the same blocks (one block table per layer row).

    VaSE: Chang et al., terarachang/VaSE (value-range protection of budget/4 tokens, 4 sinks).

    Args:
        base: the token-level `ProtectValueNorm` whose `k`, `kind`, `sinks` and `exclude_recent` are used.
        block: positions per block (16, vLLM's block size).
        per_head: separate blocks per KV head (True) or one set per layer row (False).
    """

    def __init__(self, base: ProtectValueNorm, block: int = 16, per_head: bool = True):
        require_role(base, ProtectValueNorm, "BlockProtectValueNorm(base)", ": it wraps VaSE's value protection")
        super().__init__(base.k, base.kind, base.sinks, base.exclude_recent)
        self.block, self.per_head = _check_block(block, "BlockProtectValueNorm"), bool(per_head)

    def block_values(self, view: LayerView) -> tuple[Float[Tensor, "B H NB"], Int[Tensor, "B H T"]]:
        """`(value of every block [B, H, NB] (-inf: no eligible token), block id of every slot [B, H, T])`."""
        mag, eligible = self.magnitudes(view)  # [B, H, T] each
        blk = _block_ids(view.row_positions, view.valid, self.block)
        nb = int(blk.max()) + 1 if blk.numel() else 1
        val = torch.full((*blk.shape[:2], nb), float("-inf"), device=mag.device, dtype=mag.dtype).scatter_reduce_(
            -1, blk, mag.masked_fill(~eligible, float("-inf")), "amax")  # [B, H, NB]
        if not self.per_head:
            val = val.amax(1, keepdim=True).expand_as(val)
        return val, blk

    def max_count(self, budget: int) -> int:
        """Whole blocks within `k` tokens (the sinks count inside them, not as a floor as for the token version)."""
        return resolve_count(self.k, budget)

    def protect(self, view: LayerView, budget: int, room: int) -> Bool[Tensor, "B H T"]:
        n_blocks = self.max_count(budget) // self.block
        if n_blocks <= 0 or view.valid.shape[-1] == 0:
            return torch.zeros_like(view.valid)
        val, blk = self.block_values(view)
        top = val.topk(min(n_blocks, val.shape[-1]), dim=-1)
        chosen = torch.zeros_like(val, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
        return chosen.gather(-1, blk) & view.valid


class RequestEvent:
    """A compression event over all layers at once that keeps ONE set of blocks for every layer and KV head of
    a row (one block table per request).

    Run by a forward hook on the model (`attached(model, cache)`) after every forward whose tokens end an
    interval of `interval` decoded tokens (like the per-layer events it replaces, after the chunk's
    attention); the layers' own schedule is off (`request_pipeline` gives the pipeline a `RequestSchedule`
    allocator). Two passes over the layers:

    1. record: each layer's pipeline runs on its current view (scorer, protectors, the selector's priority);
       `RequestBlocks` records `(priority, protected, valid, positions)`, `VotingValueProtect` its votes;
    2. decide (`decide()`): a block's value is its priority averaged over its tokens, then over the KV heads
       and the layers that hold it; protected blocks (any layer, any head, or the most-voted value blocks)
       come first; blocks are kept from best to worst while their largest per-head size fits in `budget`;
    3. apply: every layer is compressed (`compress(budget=)`) to exactly the chosen blocks.

    `scope="layer"` runs the same machinery with the ordinary per-layer decision (`RequestBlocks` acts as
    `BlockGranular(inner, block, "mean", per_head=False)`): it reproduces the per-layer-row variant exactly,
    which checks the event machinery.

    Args:
        budget: tokens kept per layer and KV head (the largest block set that fits).
        interval: decoded tokens between events.
        block: positions per block.
        scope: "request" (one block set per row) or "layer" (per-layer decisions; the check).
    """

    def __init__(self, budget: int, interval: int, block: int = 16, scope: Literal["request", "layer"] = "request"):
        for name, v in (("budget", budget), ("interval", interval)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise KVComposeError(f"RequestEvent: {name} must be a positive int, got {v!r}")
        if scope not in ("request", "layer"):
            raise KVComposeError(f"RequestEvent: scope must be 'request' or 'layer', got {scope!r}")
        self.budget, self.interval, self.scope = budget, interval, scope
        self.block = _check_block(block, "RequestEvent")
        self.pipe: Pipeline | None = None
        self.mode: str | None = None  # None outside an event; "record" / "apply" / "layer" inside one
        self.cache = None
        self.records: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
        self.votes: list[Tensor] = []
        self.vote_blocks = 0
        self.chosen: Bool[Tensor, "B NB"] | None = None
        self.events = 0

    @contextlib.contextmanager
    def attached(self, model, cache) -> Iterator[RequestEvent]:
        """Run this event for `cache` after every forward of `model` inside the `with` block."""
        if self.pipe is None:
            raise KVComposeError("RequestEvent has no pipeline: build it with request_pipeline(...)")
        if getattr(cache, "pipeline", None) is not self.pipe:
            raise KVComposeError("the cache does not run this event's pipeline (pass the pipeline that "
                                 "request_pipeline returned to KVComposeCache)")
        self.cache = cache
        handle = model.register_forward_hook(self.hook, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()
            self.cache = None

    def hook(self, module, args, kwargs, output) -> None:
        """Forward hook: run the event when the attached cache has just ended an interval."""
        cache = forward_cache(kwargs)
        if cache is None or cache is not self.cache:
            return
        l0 = cache.layers[0]
        decoded = l0.seen - l0.prompt_length
        if decoded <= 0 or decoded % self.interval:
            return
        if all(int(layer.lengths.max()) <= self.budget for layer in cache.layers):
            return
        self.run(cache)

    def run(self, cache) -> None:
        """One event over every layer of `cache` (see the class docstring)."""
        layers = cache.layers
        self.events += 1
        try:
            if self.scope == "layer":
                self.mode = "layer"
                for layer in layers:
                    layer.compress(budget=self.budget)
                return
            self.mode, self.records, self.votes = "record", [], []
            for layer in layers:
                view, channels, _ = layer.view()
                self.pipe.select(view, self.budget, layer.write_segment().blocks, channels)
            self.chosen = self.decide()
            self.mode = "apply"
            for layer in layers:
                layer.compress(budget=self.budget)
        finally:
            self.mode = None

    def decide(self) -> Bool[Tensor, "B NB"]:
        """`[B, NB]`: the blocks kept in every layer and KV head of each row, from the recorded passes."""
        if not self.records:
            raise KVComposeError("RequestEvent.decide: nothing was recorded (no layer ran RequestBlocks)")
        nb = 1 + max(int(_block_ids(p, v, self.block).max()) for _, _, v, p in self.records)
        total = present = prot = size = None
        for raw, protected, valid, positions in self.records:
            b, h, _ = valid.shape
            dev = valid.device
            blk = _block_ids(positions, valid, self.block)
            ok = valid.float()
            cnt = torch.zeros(b, h, nb, device=dev).scatter_add_(-1, blk, ok)
            sm = sums_by_index(raw.clamp(-1e30, 1e30) * ok, blk, nb)  # deterministic (no atomic scatter_add_)
            real = cnt > 0
            head_mean = sm / cnt.clamp(min=1)
            layer_val = torch.where(real, head_mean, torch.zeros_like(head_mean)).sum(1) / real.float().sum(1).clamp(min=1)
            layer_real = real.any(1)
            p = torch.zeros(b, h, nb, device=dev).scatter_add_(-1, blk, (protected & valid).float()).gt(0).any(1)
            total = layer_val * layer_real if total is None else total + layer_val * layer_real
            present = layer_real.float() if present is None else present + layer_real.float()
            prot = p if prot is None else prot | p
            size = cnt.amax(1) if size is None else torch.maximum(size, cnt.amax(1))
        if self.votes:  # VaSE: the blocks most layers would protect by value range
            votes = torch.zeros_like(total)
            for v in self.votes:
                n = min(nb, v.shape[-1])
                votes[..., :n] += v[..., :n]
            k = min(self.vote_blocks, nb)
            if k > 0:
                top = votes.topk(k, dim=-1)
                prot = prot | torch.zeros_like(prot).scatter_(-1, top.indices, top.values > 0)
        real = present > 0
        val = total / present.clamp(min=1)
        key = torch.where(prot & real, torch.full_like(val, _BIG), val)
        key = torch.where(real, key, torch.full_like(val, -3.4e38))
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices
        room = self.budget - torch.cumsum(size.gather(-1, order), -1)
        take = ((room >= 0) | prot.gather(-1, order)) & real.gather(-1, order)
        return torch.zeros_like(real).scatter_(-1, order, take)


class RequestBlocks(BlockGranular):
    """The selector of a `RequestEvent` (`(scores, protected, valid, budget) -> Long[B, H, K]` kept indices).

    In the event's record pass it records the inner selector's token priorities and keeps everything; in
    the apply pass it keeps exactly the tokens of the blocks the event chose (the same blocks in every layer
    and head); with `scope="layer"` it is `BlockGranular(inner, block, "mean", per_head=False)`. Outside an
    event (the cache's own schedule, or an ordered selection for a holding tier) it refuses: the event
    evicts, it does not rank.

    Args:
        inner: the token-level selector whose priorities are pooled (TopK, Sample, RandomDrop).
        block: positions per block.
        event: the `RequestEvent` that drives it.
    """

    def __init__(self, inner, block: int, event: RequestEvent):
        super().__init__(inner, block=block, reduce="mean", per_head=False)
        if not isinstance(event, RequestEvent):
            raise KVComposeError(f"RequestBlocks needs its RequestEvent, got {type(event).__name__}")
        if event.block != block:
            raise KVComposeError(f"RequestBlocks: block {block} differs from the event's {event.block}")
        self.event = event

    def choose(self, scores, protected, valid, budget, generator=None, need_order=False, positions=None, *,
               host_budget=None, may_overflow=True):
        ev = self.event
        if ev.mode == "layer":
            return super().choose(scores, protected, valid, budget, generator, need_order, positions)
        if ev.mode not in ("record", "apply") or need_order:
            raise KVComposeError("RequestBlocks runs only inside a RequestEvent, with an evicting tier")
        if positions is None:
            raise KVComposeError("RequestBlocks needs the tokens' positions (call it through a Pipeline)")
        b, h, t = valid.shape
        if ev.mode == "record":
            raw = torch.nan_to_num(self.priority(scores, valid, generator).float(), nan=-_BIG, posinf=_BIG,
                                   neginf=-_BIG)
            ev.records.append((raw, protected, valid, positions))
            keep = valid
        else:
            blk = _block_ids(positions, valid, self.block)
            nb = ev.chosen.shape[-1]
            keep = valid & (blk < nb) & ev.chosen[:, None, :].expand(b, h, nb).gather(-1, blk.clamp(max=nb - 1))
        kmax = int(keep.sum(-1).max()) if keep.numel() else 0
        idx = torch.where(keep, torch.arange(t, device=valid.device).expand(b, h, t), torch.full_like(positions, t))
        kept = idx.sort(-1).values[..., :kmax]
        return torch.where(kept >= t, torch.full_like(kept, -1), kept), None


class RequestSchedule(Uniform):
    """The allocator of a `request_pipeline`: the same budget for every layer, row and KV head, and the layers'
    own compression schedule switched off, so that only the `RequestEvent` compresses. It is an
    `EventTrigger` (`kvcompose.block`) that never names a row; `room` (what a paged store keeps free after
    an event) is the event's interval.

    Args:
        interval: decoded tokens between the request's events.
    """

    def __init__(self, interval: int):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise KVComposeError(f"RequestSchedule: interval must be a positive int, got {interval!r}")
        self.room = interval

    def due(self, state: Any, lengths: Any, limits: Any, decoded: int, interval: int) -> Bool[Tensor, " B"]:
        return torch.zeros(len(lengths), dtype=torch.bool)  # on the host: asking costs no device sync


class VotingValueProtect(BlockProtectValueNorm):
    """VaSE's block value protection decided request-wide (a Protector that returns no protection itself).

    In a `RequestEvent`'s record pass each layer votes for the `k // block` blocks it would protect
    (`BlockProtectValueNorm` with one set per row); the event protects the `k // block` blocks with the most
    votes over the layers. Outside the record pass it protects nothing (the apply pass keeps the chosen
    blocks). VaSE: Chang et al., terarachang/VaSE.
    """

    def __init__(self, base: ProtectValueNorm, block: int, event: RequestEvent):
        super().__init__(base, block, per_head=False)
        if not isinstance(event, RequestEvent):
            raise KVComposeError(f"VotingValueProtect needs its RequestEvent, got {type(event).__name__}")
        self.event = event

    def protect(self, view: LayerView, budget: int, room: int) -> Bool[Tensor, "B H T"]:
        ev = self.event
        if ev.mode == "record":
            mask = super().protect(view, budget, room)  # [B, H, T], the same blocks in every head
            blk = _block_ids(view.row_positions, view.valid, self.block)
            nb = int(blk.max()) + 1 if blk.numel() else 1
            vote = torch.zeros(blk.shape[0], nb, device=mask.device).scatter_reduce_(
                -1, blk[:, 0], mask[:, 0].float(), "amax")  # [B, NB]
            ev.votes.append(vote)
            ev.vote_blocks = self.max_count(budget) // self.block
        return torch.zeros_like(view.valid)

    def __repr__(self) -> str:
        return (f"VotingValueProtect(k={self.k!r}, kind={self.kind!r}, sinks={self.sinks!r}, "
                f"exclude_recent={self.exclude_recent!r}, block={self.block!r})")


def _token_value_protector(p) -> bool:
    return isinstance(p, ProtectValueNorm) and not isinstance(p, BlockProtectValueNorm)


def block_granular(pipe: Pipeline, block: int = 16, reduce: Literal["mean", "max"] = "mean", per_head: bool = True,
                   block_protection: bool = True) -> Pipeline:
    """`pipe` keeping whole blocks: its selector wrapped in `BlockGranular(selector, block, reduce, per_head)`
    and (with `block_protection`) every `ProtectValueNorm` replaced by `BlockProtectValueNorm`; everything
    else (scorer, other protectors, allocator, tier, interval) unchanged."""
    if pipe.selector is None:
        raise KVComposeError("block_granular: the pipeline has no selector (the full cache keeps everything)")
    if isinstance(pipe.selector, BlockGranular):
        raise KVComposeError("block_granular: the pipeline's selector is block-granular already")
    blocks: list = [BlockGranular(pipe.selector, block=block, reduce=reduce, per_head=per_head)]
    if block_protection:
        blocks += [BlockProtectValueNorm(p, block, per_head) if _token_value_protector(p) else p
                   for p in pipe.protectors]
    return pipe.replace(*blocks)


def request_pipeline(pipe: Pipeline, budget: int, block: int = 16, scope: Literal["request", "layer"] = "request",
                     interval: int | None = None, block_protection: bool = True) -> tuple[Pipeline, RequestEvent]:
    """`(pipeline, event)`: `pipe` with one block set per request, driven by a `RequestEvent` every `interval`
    decoded tokens (default: the pipeline's own, else 64, as `KVComposeCache`). Its selector becomes
    `RequestBlocks`, a `ProtectValueNorm` becomes `VotingValueProtect` (`scope="layer"`: a per-row
    `BlockProtectValueNorm`; `block_protection=False` keeps the token protector), and its allocator a
    `RequestSchedule`, so that only the event compresses (the pipeline's interval is the event's).
    Attach the event to the model and the cache with `event.attached(model, cache)`."""
    if pipe.selector is None:
        raise KVComposeError("request_pipeline: the pipeline has no selector (the full cache keeps everything)")
    if isinstance(pipe.selector, BlockGranular):
        raise KVComposeError("request_pipeline: the pipeline's selector is block-granular already")
    if type(pipe.allocator) is not Uniform:
        raise KVComposeError(f"request_pipeline: one block set per request means one budget for every layer and "
                             f"KV head; the pipeline's allocator {pipe.allocator!r} varies it")
    interval = interval or pipe.interval or 64
    event = RequestEvent(budget, interval, block, scope)
    blocks: list = [RequestBlocks(pipe.selector, block, event)]
    if block_protection:
        blocks += [(VotingValueProtect(p, block, event) if scope == "request" else BlockProtectValueNorm(p, block, False))
                   if _token_value_protector(p) else p for p in pipe.protectors]
    out = pipe.replace(*blocks, RequestSchedule(interval), interval=interval)
    event.pipe = out
    return out, event
