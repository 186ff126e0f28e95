"""The one seed rule of kvcompose: a cache's (or a vLLM request's) `seed` and a layer index give that layer's
generator seed, `seed * SEED_STRIDE + index`. `KVComposeCache`, `BranchCache`, fixed projections, the tree
search and the vLLM route all use `derived_seed`, and every place that accepts a seed checks it with
`check_seed`, so a seed that the formula would push past a 64-bit generator seed is refused where it is given
(not at the first forward, or inside a serving engine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .view import KVComposeError, RowGenerators

__all__ = ["SEED_STRIDE", "MAX_SEED", "check_seed", "derived_seed", "draw", "bernoulli"]

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


def _rows(generator: RowGenerators, n: int, what: str) -> None:
    if n != len(generator):
        raise KVComposeError(f"{what} is not one draw per row of the view's {len(generator)} rows (each row has its "
                             "own generator): a block that draws so cannot run rows of separate requests together")


def draw(fn: Callable[..., Tensor], shape: tuple[int, ...], generator: torch.Generator | RowGenerators | None,
         device: torch.device, **kw: Any) -> Tensor:
    """`fn(shape, generator=generator, **kw)` (`torch.rand`, `torch.randn`) on the generator's device, moved to
    `device`. With `RowGenerators` the shape must lead with the rows: row `r` is drawn as `(1, *shape[1:])` from
    generator `r`, what it draws alone."""
    shape = tuple(shape)
    if isinstance(generator, RowGenerators):
        _rows(generator, shape[0] if shape else -1, f"a draw of shape {shape}")
        return torch.cat([fn((1, *shape[1:]), generator=g, device=g.device, **kw).to(device) for g in generator])
    dev = generator.device if generator is not None else device
    return fn(shape, generator=generator, device=dev, **kw).to(device)


def bernoulli(p: Tensor, generator: torch.Generator | RowGenerators | None) -> Tensor:
    """`torch.bernoulli(p, generator=generator)` on the generator's device, moved back to `p`'s; with
    `RowGenerators`, row `r` of `p` (its first axis) from generator `r`."""
    if isinstance(generator, RowGenerators):
        _rows(generator, p.shape[0] if p.dim() else -1, f"a Bernoulli draw of shape {tuple(p.shape)}")
        return torch.cat([torch.bernoulli(p[r:r + 1].to(g.device), generator=g).to(p.device)
                          for r, g in enumerate(generator)])
    return torch.bernoulli(p if generator is None else p.to(generator.device), generator=generator).to(p.device)
