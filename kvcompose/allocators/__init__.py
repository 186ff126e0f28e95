"""Allocators: how many tokens each layer, (row, KV head) and request may keep (the one source of budgets).

- `base`: the `Allocator` contract, `Uniform`, `layer_budget`, `round_to_total`.
- `layers`: per-layer schedules (`SeenShare`, `Pyramid`, `ReasoningWave`).
- `heads`: per-head and per-request budgets (`HeadUtility`, `GrowPage`), in paged storage.
"""

from .base import Allocator, Uniform, layer_budget, round_to_total
from .heads import GrowPage, HeadUtility
from .layers import PROFILE_KIND, Pyramid, ReasoningWave, SeenShare, shipped_profiles, water_fill

__all__ = ["Allocator", "Uniform", "Pyramid", "ReasoningWave", "HeadUtility", "GrowPage", "SeenShare",
           "round_to_total", "layer_budget", "PROFILE_KIND", "shipped_profiles", "water_fill"]
