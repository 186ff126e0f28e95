"""Selectors: `(scores, protected, valid, budget[B, H]) -> Long[B, H, K]` kept slot indices.

The returned indices are sorted ascending, i.e. in chronological order (slots are held in position
order), so recency-based rules never see a shuffled cache (kvpress keeps top-k order). `K` is the
largest budget; a head with a smaller budget pads its row with -1 at the end. Protected tokens are
always kept; padding tokens are never kept in place of a real one.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .view import KVComposeError

__all__ = ["Selector", "TopK", "Sample", "RandomDrop", "indices_from_priority"]


def indices_from_priority(
    priority: Float[Tensor, "B H T"], budget: Int[Tensor, "B H"]
) -> Int[Tensor, "B H K"]:
    """Keep the `budget[b, h]` slots of highest priority; return them sorted ascending, -1 padded."""
    b, h, t = priority.shape
    kmax = int(budget.max().clamp(max=t))
    top = priority.topk(kmax, dim=-1).indices  # [B, H, K]
    rank = torch.arange(kmax, device=priority.device)
    keep = rank[None, None, :] < budget[..., None].clamp(max=t)
    idx = torch.where(keep, top, torch.full_like(top, t))  # dropped -> sentinel t, sorts last
    idx = idx.sort(dim=-1).values
    return torch.where(idx >= t, torch.full_like(idx, -1), idx)


class Selector:
    """Base class. `needs_scores` says whether the pipeline must supply a scorer."""

    needs_scores: bool = True

    def priority(
        self,
        scores: Float[Tensor, "B H T"] | None,
        valid: Bool[Tensor, "B H T"],
        generator: torch.Generator | None,
    ) -> Float[Tensor, "B H T"]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(
        self,
        scores: Float[Tensor, "B H T"] | None,
        protected: Bool[Tensor, "B H T"],
        valid: Bool[Tensor, "B H T"],
        budget: Int[Tensor, "B H"],
        generator: torch.Generator | None = None,
    ) -> Int[Tensor, "B H K"]:
        if self.needs_scores and scores is None:
            raise KVComposeError(f"{type(self).__name__} needs scores but the pipeline has no scorer")
        if (budget <= 0).any():
            raise KVComposeError(f"budget must be positive, got min {int(budget.min())}")
        n_protected = protected.sum(-1)
        if (n_protected > budget).any():
            raise KVComposeError(
                f"{int(n_protected.max())} protected tokens do not fit in a budget of {int(budget.min())}"
            )
        pri = self.priority(scores, valid, generator).float()
        # order: protected > other valid tokens (by priority) > padding
        finite = torch.nan_to_num(pri, nan=-3e38, posinf=3e38, neginf=-3e38).clamp(-1e30, 1e30)
        pri = torch.where(protected, torch.full_like(finite, 3e38), finite)
        pri = torch.where(valid, pri, torch.full_like(finite, -3e38))
        return indices_from_priority(pri, budget)

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

    def __init__(self, temperature: float = 1.0, eps: float = 1e-12):
        if temperature <= 0:
            raise KVComposeError(f"temperature must be positive, got {temperature}")
        self.temperature, self.eps = temperature, eps

    def priority(self, scores, valid, generator):
        if (scores < 0).any():
            raise KVComposeError("Sample needs non-negative scores (it samples in proportion to them)")
        u = torch.rand(scores.shape, generator=generator, device="cpu").to(scores.device)
        gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))
        return torch.log(scores.float() + self.eps) / self.temperature + gumbel

    def __repr__(self) -> str:
        return f"Sample(temperature={self.temperature})"


class RandomDrop(Selector):
    """Keep a uniform random subset of the unprotected tokens (Random Attention).

    Independent per row, layer and KV head, redrawn at every compression event from the layer's seeded
    generator (kvpress's random press reseeds on every call and so draws the same scores each time).
    """

    needs_scores = False

    def priority(self, scores, valid, generator):
        return torch.rand(valid.shape, generator=generator, device="cpu").to(valid.device)
