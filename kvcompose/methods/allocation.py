"""Budget-allocation methods as presets: an `Allocator` added to any compressing pipeline.

Each preset takes a `base` pipeline (any Scorer/Selector/Protectors, R-KV by default, as the ReasonAlloc
paper compares) and returns the same blocks with a different allocator:

- `pyramid_rkv`: PyramidKV's linear per-layer schedule (Cai et al., arXiv 2406.02069) over R-KV scoring
  ("Pyramid-RKV" in the ReasonAlloc comparison). Dense per-layer storage.
- `reason_alloc`: ReasonAlloc's calibrated layer profile (`ReasoningWave`) plus online head-wise reallocation
  (`HeadUtility`). Ragged paged storage.
- `growpage`: GrowPage's page-granular, on-demand per-request budgets under a global cap, triggered when a
  request's pages are full. Ragged paged storage.
"""

from __future__ import annotations

import os
from typing import Literal

from ..allocators import Allocator, GrowPage, HeadUtility, Pyramid, ReasoningWave, Uniform
from ..block import Block, require_role, role_of
from ..tiers import TierStore
from ..pipeline import Pipeline
from ..protectors import ProtectRecent
from ..view import KVComposeError, warn_unused
from .reasoning import rkv

__all__ = ["with_allocator", "pyramid_rkv", "reason_alloc", "growpage"]


def with_allocator(base: Pipeline, allocator: Allocator, name: str | None = None) -> Pipeline:
    """The blocks of `base` (protectors, scorer, selector, tier) with `allocator` instead of `Uniform`."""
    if not isinstance(base, Pipeline):
        raise KVComposeError(f"with_allocator: base must be a kvcompose Pipeline, got {role_of(base)}")
    require_role(allocator, Allocator, "with_allocator",
                 ": a tier goes in with methods.with_tier(pipeline, tier)" if isinstance(allocator, TierStore) else "")
    if not base.compresses:
        raise KVComposeError(f"{base!r} never compresses: an allocator needs a pipeline with a selector")
    if not isinstance(base.allocator, Uniform):
        raise KVComposeError(f"{base!r} already has the allocator {base.allocator!r}; give a base with the default one")
    return base.replace(allocator, name=name or f"{base!r} + {allocator!r}")


def _base(base: Pipeline | None, who: str) -> Pipeline:
    """The base pipeline of an allocation preset (R-KV by default), refused by name when it is not one."""
    if base is None:
        return rkv()
    if not isinstance(base, Pipeline):
        raise KVComposeError(f"{who}: base must be a kvcompose Pipeline (e.g. methods.rkv()), got {role_of(base)}"
                             + (f" {base!r}" if isinstance(base, Block) else ""))
    return base


def _recent_window(base: Pipeline, default: int = 8) -> int:
    counts = [p.n for p in base.protectors if isinstance(p, ProtectRecent) and isinstance(p.n, int)]
    return max(counts) if counts else default


def pyramid_rkv(base: Pipeline | None = None, window: int | None = None, beta: int | float = 20.0) -> Pipeline:
    """PyramidKV's per-layer budgets (linear from `2(C-w) - min` down to `min = (C-w)/beta`, plus the window
    `w`; same total as uniform) over `base` scoring, R-KV by default ("Pyramid-RKV").

    Cai et al., "PyramidKV", arXiv 2406.02069. `window` defaults to the base's protected recent window (R-KV: 8).
    """
    base = _base(base, "pyramid_rkv")
    w = _recent_window(base) if window is None else window
    return with_allocator(base, Pyramid(window=w, beta=beta), name=f"pyramid({base!r}, w={w}, beta={beta:g})")


def reason_alloc(base: Pipeline | None = None, profile: str | os.PathLike | dict | None = "auto",
                 floor: int | float = 0.25, utility: Literal["mass", "entropy"] = "mass", window: int = 32,
                 layer_floor: int | float = 0.25, page_size: int = 16, model=None, cap: bool = True) -> Pipeline:
    """ReasonAlloc over `base` scoring (R-KV by default, as the paper): layer budgets follow a calibrated
    Reasoning-Wave profile (`ReasoningWave`, written by `kvcompose calibrate`), capped at the tokens seen
    with the surplus spread over the other layers (`cap`), and head budgets are reassigned at every
    compression event toward heads of high utility (`HeadUtility`, floor `floor` per head).

    `profile="auto"` (default) uses the profile shipped with kvcompose for the model (`kvcompose/profiles/`,
    SmolLM2-135M-Instruct today): matched by the model's name and config with `model=`, else by its
    architecture fingerprint (`kvcompose.fingerprint`) when the cache is built. Without a profile for the model, layers stay uniform and only
    the head-wise part runs (a warning says so). `profile=None`: head-wise only; a path or dict: that profile.

    Example:
        >>> methods.reason_alloc(base=methods.rkv())                       # the shipped profile, if any
        >>> methods.reason_alloc(base=methods.snapkv(), profile="my_model.json")
    """
    base = _base(base, "reason_alloc")
    if model is not None and not (isinstance(profile, str) and profile == "auto"):
        warn_unused("reason_alloc(model=...)", "the model only picks the shipped profile of profile='auto'")
    if profile is None:
        for k, v, d in (("layer_floor", layer_floor, 0.25), ("cap", cap, True)):
            if v != d:
                warn_unused(f"reason_alloc({k}={v!r})", "profile=None gives layers no profile (head-wise only)")
    layers = None
    tag = "heads"
    if isinstance(profile, str) and profile == "auto":
        layers = ReasoningWave("auto", floor=layer_floor, cap=cap)
        tag = "wave(auto)+heads"
        if model is not None:
            from ..calibration import find_profile, model_fingerprint

            found = find_profile(model)
            layers.bind(found, int(model_fingerprint(model)["num_hidden_layers"]))
            if found is None:
                import warnings

                warnings.warn("reason_alloc: no shipped ReasoningWave profile matches this model's config; layers "
                              "stay uniform, only the head-wise part runs (calibrate one with `kvcompose calibrate`)",
                              stacklevel=2)
                layers, tag = None, "heads"
            else:
                tag = f"wave({found.get('model', 'auto')})+heads"
    elif profile is not None:
        layers = ReasoningWave(profile, floor=layer_floor, cap=cap)
        tag = "wave+heads"
    alloc = HeadUtility(layers=layers, floor=floor, utility=utility, window=window, page_size=page_size)
    return with_allocator(base, alloc, name=f"reason_alloc({base!r}, {tag})")


def growpage(base: Pipeline | None = None, page: int = 16, initial: int | float = 0.5, cap: int | float = 1.0,
             coverage: int | float = 0.9, fast: float = 0.25, slow: float = 0.01, shrink: bool = True,
             window: int = 64, spread: bool = True, floor: int = 2, room: int | None = None,
             heads: Literal["max", "mean"] = "max") -> Pipeline:
    """GrowPage over `base` scoring (R-KV by default): per-request (batch row) budgets start at
    `initial * budget` and, each time a request's pages are full, it takes one more page (when fast/slow query
    summaries say its attention working set needs it and the layer's cap of `cap * B * budget` tokens per KV
    head allows) or compresses, leaving `room` free slots (one page). See `GrowPage`."""
    base = _base(base, "growpage")
    alloc = GrowPage(page=page, initial=initial, cap=cap, floor=floor, room=room, coverage=coverage, fast=fast,
                     slow=slow, shrink=shrink, window=window, spread=spread, heads=heads)
    return with_allocator(base, alloc, name=f"growpage({base!r}, page={page}, cap={cap:g})")
