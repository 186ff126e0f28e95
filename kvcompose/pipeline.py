"""`Pipeline(...)`: composes typed blocks into one compression step.

Order at a compression event: Allocator (budget per head) -> Scorer (scores) -> Protectors (keep
masks) -> Selector (kept set) -> TierStore (where the rest goes). The pipeline checks its parts at
construction (`Pipeline(...)`) and against a budget (`validate(budget)`), and raises a clear
`KVComposeError` naming the problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .allocators import Allocator, Uniform
from .protectors import Protector, ProtectPrompt
from .scorers import Scorer
from .selectors import Selector
from .tiers import Evict, TierStore
from .view import KVComposeError, LayerView

__all__ = ["Pipeline", "Selection"]


@dataclass
class Selection:
    """The outcome of one compression event for one layer.

    Attributes:
        kept: `[B, H, K]` kept slot indices, ascending, -1 padded for heads with smaller budgets.
        budget: `[B, H]` the budget each head was given.
        scores: `[B, H, T]` the scores (None for score-free selectors).
    """

    kept: Int[Tensor, "B H K"]
    budget: Int[Tensor, "B H"]
    scores: Float[Tensor, "B H T"] | None


class Pipeline:
    """A compression method built from blocks.

    Example:
        >>> from kvcompose import Pipeline, ProtectPrompt, ProtectValueNorm, RandomDrop
        >>> p = Pipeline(ProtectPrompt(), ProtectValueNorm(0.25), RandomDrop())

    Accepts at most one Scorer (combine several with arithmetic), any number of Protectors, at most one
    Selector, Allocator and TierStore. A pipeline with no selector never compresses (the full cache).
    """

    def __init__(self, *blocks: Scorer | Protector | Selector | Allocator | TierStore, name: str | None = None):
        scorers = [b for b in blocks if isinstance(b, Scorer)]
        protectors = [b for b in blocks if isinstance(b, Protector)]
        selectors = [b for b in blocks if isinstance(b, Selector)]
        allocators = [b for b in blocks if isinstance(b, Allocator)]
        tiers = [b for b in blocks if isinstance(b, TierStore)]
        known = len(scorers) + len(protectors) + len(selectors) + len(allocators) + len(tiers)
        if known != len(blocks):
            bad = [type(b).__name__ for b in blocks if not isinstance(b, (Scorer, Protector, Selector, Allocator, TierStore))]
            raise KVComposeError(f"Pipeline got objects that are not kvcompose blocks: {bad}")
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
        self.scorer: Scorer | None = scorers[0] if scorers else None
        self.protectors: list[Protector] = protectors
        self.selector: Selector | None = selectors[0] if selectors else None
        self.allocator: Allocator = allocators[0] if allocators else Uniform()
        self.tier: TierStore = tiers[0] if tiers else Evict()
        self.name = name
        if self.selector is None:
            if self.scorer is not None or self.protectors:
                raise KVComposeError("Pipeline has a scorer or protectors but no selector to use them; add TopK(), Sample() or RandomDrop()")
        else:
            if self.selector.needs_scores and self.scorer is None:
                raise KVComposeError(f"{type(self.selector).__name__} needs scores but the pipeline has no scorer")
            if not self.selector.needs_scores and self.scorer is not None:
                raise KVComposeError(f"{type(self.selector).__name__} ignores scores; remove the scorer {self.scorer!r} or use TopK/Sample")
        if sum(isinstance(p, ProtectPrompt) for p in protectors) > 1:
            raise KVComposeError("Pipeline got ProtectPrompt twice")

    # -- properties -------------------------------------------------------------------------------
    @property
    def compresses(self) -> bool:
        """False for the full cache (no selector)."""
        return self.selector is not None

    @property
    def query_window(self) -> int:
        """How many recent queries per layer the blocks need (the cache's ring-buffer size)."""
        w = self.scorer.query_window if self.scorer is not None else 0
        for b in [self.allocator, self.tier, *self.protectors]:
            w = max(w, getattr(b, "query_window", 0))
        return w

    def observers(self) -> list[Scorer]:
        """Scorer parts that must see every attention step (e.g. accumulated attention)."""
        return [b for b in (self.scorer.blocks() if self.scorer else []) if b.observes]

    def fixed_protection(self, budget: int) -> int:
        """Upper bound on tokens protected by the fixed-count protectors at this budget."""
        return sum(p.max_count(budget) for p in self.protectors)

    def validate(self, budget: int | None) -> None:
        """Check the pipeline against a per-layer token budget; raise `KVComposeError` if it cannot work."""
        if not self.compresses:
            return
        if budget is None:
            if not getattr(self.tier, "budget_free", False) and not getattr(self.allocator, "budget_free", False):
                raise KVComposeError(f"pipeline {self!r} compresses and needs a token budget (budget=...)")
            return
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise KVComposeError(f"budget must be a positive int, got {budget!r}")
        if budget <= 0:
            raise KVComposeError(f"budget must be positive, got {budget}")
        fixed = self.fixed_protection(budget)
        if fixed > budget:
            parts = ", ".join(f"{p!r}: {p.max_count(budget)}" for p in self.protectors if p.max_count(budget))
            raise KVComposeError(f"protectors may keep {fixed} tokens, more than the budget {budget} ({parts})")

    # -- the step ---------------------------------------------------------------------------------
    def select(self, view: LayerView, budget: int) -> Selection:
        """Run Allocator -> Scorer -> Protectors -> Selector on one layer."""
        assert self.selector is not None
        per_head = self.allocator(view, budget)
        scores = self.scorer(view) if self.scorer is not None else None
        protected = torch.zeros_like(view.valid)
        bmin = int(per_head.min())
        fixed = [p for p in self.protectors if not isinstance(p, ProtectPrompt)]
        for p in fixed:
            protected |= p(view, bmin)
        room = bmin - sum(p.max_count(bmin) for p in fixed)
        for p in self.protectors:
            if isinstance(p, ProtectPrompt):
                protected |= p(view, bmin, room)
        kept = self.selector(scores, protected, view.valid, per_head, view.generator)
        return Selection(kept=kept, budget=per_head, scores=scores)

    def __repr__(self) -> str:
        if self.name:
            return self.name
        parts = [repr(b) for b in [*self.protectors, self.scorer, self.selector] if b is not None]
        if not isinstance(self.allocator, Uniform):
            parts.append(repr(self.allocator))
        if not isinstance(self.tier, Evict):
            parts.append(repr(self.tier))
        return f"Pipeline({', '.join(parts)})"
