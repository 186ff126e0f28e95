"""The one seed rule of kvcompose: a cache's (or a vLLM request's) `seed` and a layer index give that layer's
generator seed, `seed * SEED_STRIDE + index`. `KVComposeCache`, `BranchCache`, fixed projections, the tree
search and the vLLM route all use `derived_seed`, and every place that accepts a seed checks it with
`check_seed`, so a seed that the formula would push past a 64-bit generator seed is refused where it is given
(not at the first forward, or inside a serving engine)."""

from __future__ import annotations

from typing import Any

from .view import KVComposeError

__all__ = ["SEED_STRIDE", "MAX_SEED", "check_seed", "derived_seed"]

SEED_STRIDE = 1_000_003
"""Seeds of consecutive layers (or nodes) of one cache are `SEED_STRIDE` apart from another cache's."""

MAX_SEED = (2**63 - 1) // SEED_STRIDE - 1
"""The largest seed accepted: `MAX_SEED * SEED_STRIDE + index` fits a signed 64-bit generator seed for every
index below `SEED_STRIDE` (about 9.2e12)."""


def check_seed(seed: Any, where: str = "seed") -> int:
    """`seed` as an int in `[0, MAX_SEED]`, or a `KVComposeError` naming `where` and the range."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise KVComposeError(f"{where} must be an int, got {seed!r} ({type(seed).__name__})")
    if not 0 <= seed <= MAX_SEED:
        raise KVComposeError(f"{where} must be in [0, {MAX_SEED}] (seed * {SEED_STRIDE} + layer must fit a 64-bit "
                             f"generator seed), got {seed}")
    return int(seed)


def derived_seed(seed: int, index: int) -> int:
    """The generator seed of layer (or node) `index` under `seed`: `seed * SEED_STRIDE + index`."""
    if not 0 <= index < SEED_STRIDE:
        raise KVComposeError(f"a seed index must be in [0, {SEED_STRIDE}), got {index}")
    return seed * SEED_STRIDE + index
