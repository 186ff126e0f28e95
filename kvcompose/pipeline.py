"""`Pipeline(...)`: composes typed blocks into one compression step, and threads their state.

Order at a compression event: Allocator (budget per head) -> Scorer (scores) -> Protectors (keep masks)
-> Selector (kept set and priority order) -> TierStore (where the rest goes, by that order). The pipeline
checks its parts at construction and against a budget (`validate(budget)`) and raises a clear
`KVComposeError` naming the problem.

State, as in optax's `chain`: the pipeline flattens its blocks (composites into their parts) into
`leaves`; `init(spec)` returns one state per leaf (a tuple), and every call that changes state takes the
tuple and returns the new one. Token state (`Block.token_state` channels) lives in the layer's store, as
one float32 tensor `[B, H, T, C]` whose channel ranges the pipeline assigns to its leaves. One pipeline
object thus serves every layer, row and branch; the layer (or tree node) owns the state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import functools
from functools import partial
from typing import Any

import inspect

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .allocators import Allocator, Uniform
from .hostsync import check_later
from .block import Block, Observer, role_of
from .blocks.merging import Merger
from .protectors import Protector
from .scorers import Scorer
from .selectors import Selector
from .tiers import Evict, TierStore
from .view import AttentionStep, KVComposeError, LayerSpec, LayerView, warn_unused

__all__ = ["Pipeline", "Selection"]

_ROLES = (Scorer, Protector, Selector, Allocator, TierStore, Merger)
_HINTS: dict[type, bool] = {}


def _takes_hints(cls: type) -> bool:
    """Whether a selector's `choose` takes the host budgets (`host_budget`, `may_overflow`)."""
    if cls not in _HINTS:
        _HINTS[cls] = "host_budget" in inspect.signature(cls.choose).parameters
    return _HINTS[cls]


@dataclass
class Selection:
    """The outcome of one compression event for one layer.

    Attributes:
        kept: `[B, H, K]` kept slot indices, ascending, -1 padded for heads with smaller budgets.
        order: `[B, H, T]` every slot, the kept ones first, then from most to least worth keeping (None
            unless a tier store holds tokens).
        budget: `[B, H]` the budget each head was given.
        scores: `[B, H, T]` the scores (None for score-free selectors).
        protected: `[B, H]` how many tokens the protectors protected.
        values: `[B, H, T, Dv]` the view's values with the merged values at kept slots, when the pipeline has a
            `Merger` (None: the kept tokens keep their values).
        host_budget: `budget` on the host (int64 numpy `[B, H]`).
    """

    kept: Int[Tensor, "B H K"]
    order: Int[Tensor, "B H T"] | None
    budget: Int[Tensor, "B H"]
    scores: Float[Tensor, "B H T"] | None
    protected: Int[Tensor, "B H"] | None = None
    values: Float[Tensor, "B H T Dv"] | None = None
    host_budget: Any = None


def _check_blocks(blocks: tuple, where: str) -> None:
    """Refuse anything that is not a block of one of the five roles, naming what it is."""
    for b in blocks:
        if isinstance(b, Pipeline):
            raise KVComposeError(f"{where}: got the pipeline {b!r}, which is not a block: a pipeline holds blocks "
                                 "(Scorer, Protector, Selector, Allocator, TierStore, Merger); use pipeline.replace(...) "
                                 "to change the blocks of a pipeline")
        if not isinstance(b, _ROLES):
            what = f"{role_of(b)} {b!r}" if isinstance(b, Block) else type(b).__name__
            raise KVComposeError(f"{where}: got {what[:120]}, which is not a kvcompose block of one of the roles "
                                 "Scorer, Protector, Selector, Allocator, TierStore, Merger")


def _by_row(view: LayerView, keys: list, make: Callable[[Any], Tensor]) -> Bool[Tensor, "B H T"]:
    """`make(key)` for each row's key (rows of one key share one call), each row taking its own key's mask."""
    distinct = list(dict.fromkeys(keys))
    if len(distinct) == 1:
        return make(distinct[0])
    out = torch.zeros_like(view.valid)
    for key in distinct:
        rows = torch.tensor([k == key for k in keys], device=view.device)
        out |= make(key) & rows[:, None, None]
    return out


def _flatten(block: Block, leaves: list[Block]) -> Any:
    """Append the leaves of `block` to `leaves`; return its index tree (an int for a leaf, a tuple else)."""
    kids = block.children()
    if not kids:
        leaves.append(block)
        return len(leaves) - 1
    return tuple(_flatten(k, leaves) for k in kids)


class Pipeline:
    """A compression method built from blocks.

    Example:
        >>> from kvcompose import Pipeline, ProtectPrompt, ProtectValueNorm, RandomDrop
        >>> p = Pipeline(ProtectPrompt(), ProtectValueNorm(0.25), RandomDrop())

    Accepts at most one Scorer (combine several with arithmetic), any number of Protectors, at most one
    Selector, Allocator, TierStore and Merger (which folds the values of the tokens that leave for good into
    kept ones, `kvcompose.blocks.merging`). A pipeline with no selector never compresses (the full cache).

    Args:
        name: shown by `repr` (presets name themselves).
        interval: the method's own compression interval (R-KV 128, VaSE 64), used by a cache that is not
            given one.
    """

    def __init__(self, *blocks: Scorer | Protector | Selector | Allocator | TierStore | Merger, name: str | None = None,
                 interval: int | None = None):
        _check_blocks(blocks, "Pipeline")
        scorers = [b for b in blocks if isinstance(b, Scorer)]
        protectors = [b for b in blocks if isinstance(b, Protector)]
        selectors = [b for b in blocks if isinstance(b, Selector)]
        allocators = [b for b in blocks if isinstance(b, Allocator)]
        tiers = [b for b in blocks if isinstance(b, TierStore)]
        mergers = [b for b in blocks if isinstance(b, Merger)]
        if len(scorers) > 1:
            raise KVComposeError(
                f"Pipeline got {len(scorers)} scorers ({', '.join(type(s).__name__ for s in scorers)}); "
                "combine them into one with arithmetic, e.g. 0.1 * A() - 0.9 * B()"
            )
        if len(selectors) > 1:
            raise KVComposeError(f"Pipeline got {len(selectors)} selectors; a pipeline keeps one kept set, give one selector")
        if len(allocators) > 1:
            raise KVComposeError(f"Pipeline got {len(allocators)} allocators; give at most one")
        if len(tiers) > 1:
            raise KVComposeError(f"Pipeline got {len(tiers)} tier stores; give at most one")
        if len(mergers) > 1:
            raise KVComposeError(f"Pipeline got {len(mergers)} mergers; give at most one")
        if mergers and not selectors:
            raise KVComposeError("Pipeline has a merger but no selector: nothing is ever evicted to merge")
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0):
            raise KVComposeError(f"interval must be a positive int, got {interval!r}")
        self.scorer: Scorer | None = scorers[0] if scorers else None
        self.protectors: list[Protector] = protectors
        self.selector: Selector | None = selectors[0] if selectors else None
        self.allocator: Allocator = allocators[0] if allocators else Uniform()
        self.tier: TierStore = tiers[0] if tiers else Evict()
        self.merger: Merger | None = mergers[0] if mergers else None
        self.name = name
        self.interval = interval
        if self.selector is None:
            if self.scorer is not None or self.protectors:
                raise KVComposeError("Pipeline has a scorer or protectors but no selector to use them; add TopK(), Sample() or RandomDrop()")
            if interval is not None:
                warn_unused(f"Pipeline(interval={interval})", "a pipeline without a selector never compresses")
        else:
            if self.selector.needs_scores and self.scorer is None:
                raise KVComposeError(f"{type(self.selector).__name__} needs scores but the pipeline has no scorer")
            if not self.selector.needs_scores and self.scorer is not None:
                raise KVComposeError(f"{type(self.selector).__name__} ignores scores; remove the scorer {self.scorer!r} or use TopK/Sample")
        if sum(p.fills_room for p in protectors) > 1:
            names = ", ".join(type(p).__name__ for p in protectors if p.fills_room)
            raise KVComposeError(f"Pipeline got {names}: at most one protector may fill the room the others leave "
                                 "(e.g. ProtectPrompt twice)")
        # the state layout: leaves in part order, channel ranges of token-state leaves (the tier's state is
        # threaded by the layer through `store` / `fetch`, not here)
        self.parts: tuple[Block, ...] = tuple(b for b in (self.allocator, self.scorer, *self.protectors, self.selector,
                                                          self.merger) if b is not None)
        self.leaves: list[Block] = []
        index = [_flatten(p, self.leaves) for p in self.parts]
        self._alloc_index = index[0]
        self._scorer_index = index[1] if self.scorer is not None else None
        first = 1 + (self.scorer is not None)
        self._protector_index = index[first:first + len(self.protectors)]
        self._selector_index = index[first + len(self.protectors)] if self.selector is not None else None
        self._merger_index = index[-1] if self.merger is not None else None
        self._slices: list[slice | None] = []
        c = 0
        for leaf in self.leaves:
            n = int(leaf.token_state)
            self._slices.append(slice(c, c + n) if n else None)
            c += n
        self.channels = c
        self.observers = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, Observer)]
        self._query_window = max([b.query_window for b in (*self.parts, *self.leaves, self.tier)], default=0)

    # -- properties -------------------------------------------------------------------------------
    @property
    def compresses(self) -> bool:
        """False for the full cache (no selector)."""
        return self.selector is not None

    @property
    def draws_random(self) -> bool:
        """True when some block draws from the layer's seeded generator at an event (the cache's `seed` then
        matters). A merger runs on the tokens that leave for good, so it draws only with a tier that evicts."""
        return bool(self._drawing())

    @property
    def draws_per_row(self) -> bool:
        """True when every block that draws declares `draws_per_row` (its draws lead with the view's rows), so
        rows of separate requests can run in one view, each drawing from its own generator (`RowGenerators`)."""
        return all(b.draws_per_row for b in self._drawing())

    def _drawing(self) -> list[Block]:
        """The blocks that draw at an event (a merger only with a tier that evicts: it runs on the tokens that
        leave for good)."""
        merging = self.merger is not None and self.tier.evicts
        skip = set() if merging or self.merger is None else {id(self.merger), *map(id, self._leaves_of(self._merger_index))}
        return [b for b in (*self.leaves, *self.parts, self.tier) if id(b) not in skip and b.draws_random]

    def _leaves_of(self, idx: Any) -> list[Block]:
        """The leaves of a part, from its index tree."""
        if isinstance(idx, int):
            return [self.leaves[idx]]
        return [leaf for i in idx for leaf in self._leaves_of(i)]

    def padded_rows_note(self) -> str | None:
        """Why a left-padded row of a batch may keep other tokens than the same row alone with this pipeline (None:
        it keeps the same): its blocks' `padded_rows` notes, and random draws (they follow the batch's shape)."""
        if not self.compresses:
            return None
        notes = []
        for b in (*self.parts, *self.leaves, self.tier):
            note = b.padded_rows
            if note and note not in notes:
                notes.append(note)
        if self.draws_random:
            notes.append("its random draws follow the batch's shape, so a row of a batch draws other numbers than "
                         "the row alone")
        return "; ".join(notes) or None

    @property
    def query_window(self) -> int:
        """How many recent queries per layer the blocks need (the layer's ring-buffer size)."""
        return self._query_window

    @property
    def paged(self) -> bool:
        """True when kept counts may differ between rows and heads (per-head allocators, block-granular
        selectors): the layers then use paged storage."""
        return not self.allocator.uniform or (self.selector is not None and self.selector.ragged)

    @property
    def needs_budget(self) -> bool:
        """True when the cache must be given a token budget."""
        return self.compresses and self.allocator.needs_budget

    def fixed_protection(self, budget: int) -> int:
        """Upper bound on tokens protected by the fixed-count protectors at this budget (protectors of the first
        tokens, such as `ProtectSinks` and the sinks of `ProtectPrompt`, overlap: the longest prefix counts once)."""
        prefix = max((p.prefix_count(budget) for p in self.protectors), default=0)
        return sum(p.max_count(budget) - p.prefix_count(budget) for p in self.protectors) + prefix

    def validate(self, budget: int | None) -> None:
        """Check the pipeline against a per-layer token budget; raise `KVComposeError` if it cannot work."""
        if not self.compresses:
            return
        if budget is None:
            if self.allocator.needs_budget:
                raise KVComposeError(f"pipeline {self!r} compresses and needs a token budget (budget=...)")
            return
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise KVComposeError(f"budget must be a positive int, got {budget!r}")
        if budget <= 0:
            raise KVComposeError(f"budget must be positive, got {budget}")
        fixed = self.fixed_protection(budget)
        parts = ", ".join(f"{p!r}: {p.max_count(budget)}" for p in self.protectors if p.max_count(budget))
        if fixed > budget and not self.tier.holds_tokens:
            raise KVComposeError(f"protectors may keep {fixed} tokens, more than the budget {budget} ({parts})")
        if fixed == budget and not self.tier.holds_tokens and len(self.protectors) == 1 and self.allocator.uniform:
            chooser = self.scorer if self.scorer is not None else self.selector
            warn_unused(f"{chooser!r} at budget={budget}", f"the protectors keep the whole budget ({parts}), so it "
                        "never chooses a token", stacklevel=4)

    def replace(self, *blocks: Block, name: str | None = None, interval: int | None = None) -> "Pipeline":
        """The same pipeline with parts swapped: each given Scorer, Selector, Allocator, TierStore or Merger
        replaces the part of its role; given Protectors replace all protectors."""
        _check_blocks(blocks, "Pipeline.replace")
        for role in (Scorer, Selector, Allocator, TierStore, Merger):
            same = [b for b in blocks if isinstance(b, role)]
            if len(same) > 1:
                raise KVComposeError(f"Pipeline.replace got {len(same)} blocks of the role {role.__name__} "
                                     f"({', '.join(map(repr, same))}); a pipeline has one {role.__name__}: give one")
        new_prot = [b for b in blocks if isinstance(b, Protector)]
        pick = lambda role, cur: next((b for b in blocks if isinstance(b, role)), cur)  # noqa: E731
        parts = [*(new_prot if new_prot else self.protectors), pick(Scorer, self.scorer), pick(Selector, self.selector),
                 pick(Allocator, self.allocator), pick(TierStore, self.tier), pick(Merger, self.merger)]
        return Pipeline(*[p for p in parts if p is not None], name=name,
                        interval=self.interval if interval is None else interval)

    def blocks(self) -> list[Block]:
        """Every block of the pipeline, once: its parts, their children and the blocks they hold as attributes
        (e.g. `Compactor`'s leverage part), and the tier."""
        out: list[Block] = []
        todo: list[Any] = [*self.parts, self.tier]
        while todo:
            b = todo.pop(0)
            if not isinstance(b, Block) or any(b is o for o in out):
                continue
            out.append(b)
            todo += list(b.children())
            for v in vars(b).values():
                todo += [v] if isinstance(v, Block) else [x for x in v if isinstance(x, Block)] if isinstance(
                    v, (tuple, list)) else []
        return out

    def bind_model(self, model: Any) -> None:
        """Give every block the model a cache decodes with (`Block.bind_model`): blocks that read the model's
        weights take them, and a block made for another model (a profile calibrated on it, its weights) refuses it
        with a `KVComposeError`."""
        for b in self.blocks():
            b.bind_model(model)

    # -- state ------------------------------------------------------------------------------------
    def init(self, spec: LayerSpec) -> tuple:
        """One fresh state per leaf for a layer (None for stateless and token-state leaves)."""
        return tuple(None if leaf.token_state else leaf.init(spec) for leaf in self.leaves)

    def check_state(self, states: Any) -> None:
        """Refuse a state tuple that was not made by this pipeline's `init`."""
        if not isinstance(states, tuple) or len(states) != len(self.leaves):
            n = len(states) if isinstance(states, tuple) else type(states).__name__
            raise KVComposeError(f"pipeline state has {n} entries, the pipeline {self!r} has {len(self.leaves)} "
                                 "stateful leaves: state and parts do not match")

    def _leaf_state(self, i: int, states: tuple, channels: Tensor | None) -> Any:
        sl = self._slices[i]
        if sl is None:
            return states[i]
        if channels is None:
            raise KVComposeError(f"{self.leaves[i]!r} keeps token state but no channels were given")
        x = channels[..., sl]
        return x[..., 0] if sl.stop - sl.start == 1 else x

    def _tree(self, idx: Any, states: tuple, channels: Tensor | None) -> Any:
        """A part's state: its leaf's state, or the tuple of its parts' states."""
        if isinstance(idx, int):
            return self._leaf_state(idx, states, channels)
        return tuple(self._tree(i, states, channels) for i in idx)

    def observe(self, states: tuple, channels: Float[Tensor, "B H T C"], step: AttentionStep
                ) -> tuple[tuple, Float[Tensor, "B H T C"]]:
        """Let every observer leaf see one attention step; returns the new states and channels."""
        if not self.observers:
            return states, channels
        out_states = list(states)
        out_ch = channels.clone() if self.channels else channels
        for i in self.observers:
            new = self.leaves[i].observe(self._leaf_state(i, states, channels), step)
            sl = self._slices[i]
            if sl is None:
                out_states[i] = new
            else:
                out_ch[..., sl] = new[..., None] if new.dim() == 3 else new
        return tuple(out_states), out_ch

    def map_rows(self, states: tuple, fn: Callable[[Tensor], Tensor], batch: int) -> tuple:
        """Reorder / select batch rows of every leaf's layer state."""
        return tuple(s if s is None else leaf.map_rows(s, fn, batch) for leaf, s in zip(self.leaves, states))

    # -- the step ---------------------------------------------------------------------------------
    def select(self, view: LayerView, budget: int, states: tuple | None = None,
               channels: Float[Tensor, "B H T C"] | None = None) -> tuple[Selection, tuple]:
        """Run Allocator -> Scorer -> Protectors -> Selector on one layer; returns the selection and the new
        states. Protected tokens must fit in the budget plus what the tier keeps off HBM.

        Without `states` (a standalone call), fresh states are made with `init` and token state starts at 0."""
        if self.selector is None:
            raise KVComposeError(f"pipeline {self!r} has no selector: it never compresses")
        if states is None:
            b, h, t, d = view.keys.shape
            states = self.init(LayerSpec(view.layer_idx, view.num_layers, b, h, d, view.values.shape[-1],
                                         view.device, view.keys.dtype))
        if channels is None and self.channels:
            channels = torch.zeros(*view.shape, self.channels, device=view.device)
        self.check_state(states)
        out_states = list(states)
        per_head, new_alloc = self.allocator(view, budget, self._tree(self._alloc_index, states, channels))
        if isinstance(self._alloc_index, int) and self._slices[self._alloc_index] is None:
            out_states[self._alloc_index] = new_alloc
        # the budgets on the host: known for a constant allocator, else one read (the event's host syncs are
        # batched: kvcompose.hostsync)
        host_budget = self.allocator.host_budgets(per_head, budget)
        if (host_budget <= 0).any():
            raise KVComposeError(f"{type(self.allocator).__name__} gave a non-positive budget")
        scores = None
        if self.scorer is not None:
            scores, new = self.scorer.apply(view, self._tree(self._scorer_index, states, channels))
            self._put(self._scorer_index, new, out_states)
        # every protector: (mask, new state), its state given (a protector called for several row groups keeps
        # the new state of its first call: each call sees the same state and the whole view)
        prot_state = {id(p): self._tree(i, states, channels) for p, i in zip(self.protectors, self._protector_index)}
        prot_new: dict[int, Any] = {}

        def protect(p: Protector, budget: int, room: int | None = None) -> Tensor:
            mask, new = p.apply(view, budget, room, prot_state[id(p)])
            prot_new.setdefault(id(p), new)
            return mask

        # protectors count with each row's smallest head budget (and room), never another row's: with per-head
        # budgets a share such as ProtectRecent(0.5) would otherwise protect what the batch's smallest head allows
        row_min = [int(x) for x in np.asarray(host_budget).min(-1)]
        bmin = min(row_min)
        fixed = [p for p in self.protectors if not p.fills_room]
        protected = _by_row(view, row_min, lambda b: functools.reduce(
            torch.logical_or, [protect(p, b) for p in fixed], torch.zeros_like(view.valid)))
        retain = None
        if self.tier.holds_tokens:
            seen = view.seen if view.padding is None else view.row_seen[:, None]  # left padding not counted
            retain = partial(self.tier.retained, view.valid.sum(-1), per_head, seen)
        limit = per_head if retain is None else per_head + retain(protected.sum(-1))
        fixed_row = [sum(p.max_count(rb) for p in fixed) for rb in row_min]
        fixed_max = max(fixed_row)
        prompt = [p for p in self.protectors if p.fills_room]  # it takes the room the others leave
        # the smallest limit per head the host can vouch for: the budget, plus what the tier keeps of the real
        # candidates when nothing is protected (retained grows with the protected count)
        lo = host_budget if retain is None else self._host_limit(view, host_budget, 0)
        rooms = [0] * len(row_min)
        if prompt:  # the room the other protectors leave (a host read only when the host cannot tell it)
            exact = lo is not None and (retain is None or np.array_equal(lo, self._host_limit(view, host_budget,
                                                                                                fixed_max)))
            lim_row = lo.min(-1).tolist() if exact and lo.size else limit.amin(-1).tolist()
            rooms = [int(lim) - f for lim, f in zip(lim_row, fixed_row)]
            protected = protected | _by_row(view, list(zip(row_min, rooms)), lambda key: functools.reduce(
                torch.logical_or, [protect(p, key[0], key[1]) for p in prompt], torch.zeros_like(view.valid)))
        for p, i in zip(self.protectors, self._protector_index):
            if id(p) in prot_new:
                self._put(i, prot_new[id(p)], out_states)
        n_prot = protected.sum(-1)
        if retain is not None:
            limit = per_head + retain(n_prot)
        # protectors promise at most their max_count (the prompt at most the room or its sinks): where that
        # bound fits the host's smallest limit nothing can overflow; else the check is read with the event's
        # other host values
        bounds = [f + (max([r] + [p.max_count(rb) for p in prompt]) if prompt else 0)
                  for f, r, rb in zip(fixed_row, rooms, row_min)]
        bound = max(bounds)
        may_overflow = any(bd > rb for bd, rb in zip(bounds, row_min))
        lo_row = None if lo is None else (lo.min(-1) if lo.size else np.zeros(len(row_min), dtype=np.int64))
        if lo_row is None or any(bd > int(lr) for bd, lr in zip(bounds, lo_row)):
            where = "" if limit is per_head else " plus what the tier keeps"
            check_later(n_prot > limit, lambda: (  # called only on failure: its reads cost nothing otherwise
                f"{int(n_prot.max())} protected tokens do not fit in a budget of {bmin}{where} (layer "
                f"{view.layer_idx}): raise the budget or protect fewer tokens"))
        n_prot.max_host = bound  # an upper bound on every head's count, for the tier (no host read)
        hints = {}
        if _takes_hints(type(self.selector)):  # the selection takes the host budgets: no host sync
            hints = dict(host_budget=host_budget, may_overflow=may_overflow)
        (kept, order), new = self.selector.apply(scores, protected, view.valid, per_head, view.generator,
                                                 need_order=self.tier.holds_tokens or self.merger is not None,
                                                 positions=view.row_positions,
                                                 state=self._tree(self._selector_index, states, channels), **hints)
        self._put(self._selector_index, new, out_states)
        values = None
        if self.merger is not None:
            values = self._merge(view, kept, order, n_prot, states, channels, out_states)
        return (Selection(kept=kept, order=order, budget=per_head, scores=scores, protected=n_prot, values=values,
                          host_budget=host_budget),
                tuple(out_states))

    def _host_limit(self, view: LayerView, host_budget: Any, protected: int) -> np.ndarray | None:
        """Per-head limits (budget plus what the tier keeps) on the host, from the mirrored real counts, as if
        every head protected `protected` tokens; None when the host does not know the counts."""
        if view.host_real is None or view.padding is not None:  # left padding: the mirrors count its slots
            return None
        ph = torch.from_numpy(np.asarray(host_budget, dtype=np.int64))
        cand = torch.from_numpy(np.asarray(view.host_real, dtype=np.int64))
        return (ph + self.tier.retained(cand, ph, view.seen, torch.full_like(ph, protected))).numpy()

    def _merge(self, view: LayerView, kept: Int[Tensor, "B H K"], order: Int[Tensor, "B H T"], n_prot: Int[Tensor, "B H"],
               states: tuple, channels: Tensor | None, out_states: list) -> Float[Tensor, "B H T Dv"]:
        """Run the merger on the tokens that leave for good: not kept, not held by the tier (the first ones of the
        priority order after the kept), real, in the event's rows; its new layer state goes to `out_states`."""
        t = view.shape[2]
        n_kept = (kept >= 0).sum(-1)
        stay = n_kept
        if self.tier.holds_tokens:
            stay = n_kept + self.tier.retained(view.valid.sum(-1), n_kept, view.seen if view.padding is None else view.row_seen[:, None], n_prot)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(t, device=order.device).expand_as(order))
        evicted = view.valid & (rank >= stay[..., None])
        if view.rows is not None:
            evicted = evicted & view.rows[:, None, None]
        values, new = self.merger(view, kept, evicted, order, self._tree(self._merger_index, states, channels))
        self._put(self._merger_index, new, out_states)
        return values

    def _put(self, idx: Any, st: Any, out_states: list) -> None:
        """Store a part's new state (a leaf's, or the tuple of its parts') in `out_states`; token state lives in
        the channels, not here."""
        if isinstance(idx, int):
            if self._slices[idx] is None:
                out_states[idx] = st
        else:
            for i, s in zip(idx, st):
                self._put(i, s, out_states)

    def __repr__(self) -> str:
        if self.name:
            return self.name
        parts = [repr(b) for b in [*self.protectors, self.scorer, self.selector] if b is not None]
        if not isinstance(self.allocator, Uniform):
            parts.append(repr(self.allocator))
        if not isinstance(self.tier, Evict):
            parts.append(repr(self.tier))
        if self.merger is not None:
            parts.append(repr(self.merger))
        return f"Pipeline({', '.join(parts)})"
