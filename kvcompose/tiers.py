"""TierStores: where a token that leaves HBM goes (host memory, a compressed copy, or nowhere).

Contract: at a compression event the cache hands the store the tokens the selector did not keep
(`store(state, keys, values, positions, scores)`); before the layer's next attention a `Prefetcher`
asks the store for what it holds (`fetch(state)`) and the attention sees hot and fetched tokens in
their original order. `Evict` is plain eviction: nothing is stored, nothing comes back.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Float, Int
from torch import Tensor

__all__ = ["TierStore", "Evict"]


class TierStore:
    """Base class for where non-kept tokens go. State lives in the layer's cache state (`state` dict)."""

    holds_tokens: bool = False

    def store(
        self,
        state: dict[str, Any],
        keys: Float[Tensor, "B H N D"],
        values: Float[Tensor, "B H N D"],
        positions: Int[Tensor, "B H N"],
        scores: Float[Tensor, "B H N"] | None,
    ) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def fetch(self, state: dict[str, Any]):
        """Tokens held outside HBM for this layer, as `(keys, values, positions)` or None."""
        return None

    def nbytes(self, state: dict[str, Any]) -> dict[str, int]:
        """Bytes held per tier name (e.g. {'host': ..., 'compressed': ...})."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Evict(TierStore):
    """Plain eviction: non-kept tokens are freed."""

    def store(self, state, keys, values, positions, scores) -> None:
        return None
