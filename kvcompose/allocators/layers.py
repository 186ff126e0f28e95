"""Per-layer budget schedules: `SeenShare` (a share of the tokens seen), `Pyramid` (PyramidKV) and
`ReasoningWave` (ReasonAlloc's calibrated layer profile). Every layer keeps dense storage."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..fingerprint import check_fingerprint, model_fingerprint, profile_matches
from ..tiers.hierarchy import check_ratio, floor_share
from ..view import KVComposeError, LayerView
from .base import Allocator, _check_budget, _is_int, _round_list, _share

__all__ = ["SeenShare", "Pyramid", "ReasoningWave", "PROFILE_KIND", "shipped_profiles", "water_fill"]


class SeenShare(Allocator):
    """HBM holds a share of the tokens seen so far: the HBM tier of "Not All Thoughts Need HBM" (abstract
    only), where host memory, a compressed tier and eviction take the rest (`kvcompose.tiers.Hierarchy`).

    The layer budget is `seen - floor(host * seen) - floor(compressed * seen) - floor(evict * seen)` (about
    `hbm_ratio * seen`), at least 1, with `host = 1 - hbm - compressed - evict`; with a cache `budget=` too,
    at most that. Needs no cache budget (`needs_budget = False`).

    Args:
        hbm_ratio: share of seen tokens held in HBM, in (0, 1].
        compressed_ratio: the share the tier quantizes (so that the four shares are floored exactly as the
            tier floors them).
        evict_ratio: the share the tier evicts (likewise).
    """

    needs_budget = False
    static_schedule = True
    padded_rows = ("SeenShare's HBM share is of the layer's tokens seen, left padding included, one budget for "
                   "every row of the layer")

    def __init__(self, hbm_ratio: int | float, compressed_ratio: int | float = 0.0, evict_ratio: int | float = 0.0):
        self.hbm_ratio = check_ratio(hbm_ratio, "hbm_ratio")
        self.compressed_ratio = check_ratio(compressed_ratio, "compressed_ratio")
        self.evict_ratio = check_ratio(evict_ratio, "evict_ratio")
        if self.hbm_ratio <= 0.0:
            raise KVComposeError("hbm_ratio must be > 0 (attention needs the newest token in HBM)")
        total = self.hbm_ratio + self.compressed_ratio + self.evict_ratio
        if total > 1.0 + 1e-9:
            raise KVComposeError(
                f"hbm_ratio + compressed_ratio + evict_ratio must sum to at most 1 (host memory takes the rest), "
                f"got {self.hbm_ratio} + {self.compressed_ratio} + {self.evict_ratio} = {total:g}"
            )
        self.host_ratio = max(0.0, 1.0 - total)

    def layer_budget(self, layer_idx: int, num_layers: int, budget: int | None, seen: int) -> int:
        rest = sum(floor_share(r, seen) for r in (self.host_ratio, self.compressed_ratio, self.evict_ratio))
        k = max(1, seen - rest)
        return k if budget is None else max(1, min(budget, k))

    constant = True  # allocate gives every head the layer budget

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        b, h, _ = view.shape
        return torch.full((b, h), budget, dtype=torch.long, device=view.device)

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        if not pipeline.tier.holds_tokens and self.host_ratio + self.compressed_ratio > 0:
            raise KVComposeError(
                f"{self!r} leaves {self.host_ratio + self.compressed_ratio:g} of the tokens to host memory or a "
                "compressed tier, but the pipeline has no tier store that holds tokens (add Hierarchy or HostTier)"
            )

    def __repr__(self) -> str:
        return f"SeenShare(hbm={self.hbm_ratio:g}, compressed={self.compressed_ratio:g}, evict={self.evict_ratio:g})"


class _PerLayer(Allocator):
    """A per-layer schedule: every head of layer l gets `layer_budget(l)`; dense storage per layer."""

    constant = True
    static_schedule = True  # budgets from (layer, layers, budget, seen) and the profile alone

    def __init__(self) -> None:
        self._memo: dict[tuple[int, int], list[int]] = {}

    def _budgets(self, num_layers: int, budget: int) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _schedule(self, num_layers: int, budget: int) -> list[int]:
        key = (num_layers, budget)
        if key not in self._memo:
            _check_budget(budget, type(self).__name__)
            out = self._budgets(num_layers, budget)
            if sum(out) > num_layers * budget or min(out) <= 0:  # pragma: no cover - guarded by construction
                raise KVComposeError(f"{self!r}: layer budgets {out} break the total {num_layers * budget}")
            self._memo[key] = out
        return self._memo[key]

    def layer_budgets(self, num_layers: int, budget: int) -> list[int]:
        return list(self._schedule(num_layers, budget))

    def layer_budget(self, layer_idx: int, num_layers: int, budget: int | None, seen: int) -> int:
        if not 0 <= layer_idx < num_layers:
            raise KVComposeError(f"layer {layer_idx} out of range for {num_layers} layers")
        if budget is None:
            raise KVComposeError(f"{self!r} shares a per-layer token budget between layers and got none: give the cache "
                                 "a budget (KVComposeCache(budget=...), BranchCache(active_budget=...))")
        return self._schedule(num_layers, budget)[layer_idx]

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        b, h, _ = view.shape
        return torch.full((b, h), budget, dtype=torch.long, device=view.keys.device)


# ------------------------------------------------------------------------------------------- PyramidKV
class Pyramid(_PerLayer):
    """PyramidKV's per-layer budgets: a linear fall from the first layer to the last.

    Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
    arXiv 2406.02069. With average budget `C` and recent window `w` (counted inside every layer's budget),
    layer `l` of `L` keeps `w + hi - (hi - lo) * l / (L - 1)` tokens, `lo = (C - w) / beta`,
    `hi = 2 (C - w) - lo`, beta = 20. The mean over layers is exactly `C`, so the total equals `Uniform`'s.

    Differences from the reference code (`pyramidkv_utils.py`), on purpose: the reference steps by the
    integer `(hi - lo) // (L - 1)` and so overshoots the uniform total by up to `(L - 1) / 2` tokens per
    layer on average; here the linear schedule is rounded with the largest-remainder method so the total is
    exact. The reference also clamps `hi` to the prompt length at prefill; kvcompose compresses during
    decoding, where that clamp does not apply.

    Args:
        window: the recent window `w` inside each layer's budget (PyramidKV/SnapKV: 64 at prefill; R-KV: 8).
            Use the pipeline's own protected window so every layer can hold it.
        beta: the ratio between the average and the smallest budget (paper: 20).
    """

    def __init__(self, window: int = 8, beta: int | float = 20.0):
        super().__init__()
        if not _is_int(window) or window < 0:
            raise KVComposeError(f"Pyramid: window must be an int >= 0, got {window!r}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta < 1:
            raise KVComposeError(f"Pyramid: beta must be a number >= 1, got {beta!r}")
        self.window, self.beta = window, float(beta)

    def _budgets(self, num_layers: int, budget: int) -> list[int]:
        c = budget - self.window
        if c <= 0:
            raise KVComposeError(f"Pyramid: budget {budget} must exceed the window {self.window}")
        if num_layers == 1:
            return [budget]
        lo = c / self.beta
        hi = 2 * c - lo
        raw = [hi - (hi - lo) * i / (num_layers - 1) for i in range(num_layers)]
        out = [self.window + x for x in _round_list(raw, num_layers * c)]
        # a very small budget with no window could round the last layer to 0: lend it a token
        while min(out) < 1:
            out[out.index(max(out))] -= 1
            out[out.index(min(out))] += 1
        return out

    def __repr__(self) -> str:
        return f"Pyramid(window={self.window}, beta={self.beta:g})"


# ------------------------------------------------------------------------------------------- ReasonAlloc
PROFILE_KIND = "kvcompose.reasoning_wave"


def shipped_profiles() -> list[dict[str, Any]]:
    """The ReasoningWave profiles shipped with kvcompose (`kvcompose/profiles/*.json`), each with its file name
    under `"file"`."""
    from importlib.resources import files

    out = []
    root = files("kvcompose").joinpath("profiles")
    if not root.is_dir():
        return out
    for f in sorted(root.iterdir(), key=lambda x: x.name):
        if f.name.endswith(".json"):
            data = json.loads(f.read_text())
            if isinstance(data, dict) and data.get("kind") == PROFILE_KIND:
                out.append({**data, "file": f.name})
    return out


def _profile_shape(data: dict[str, Any]) -> tuple[int, int | None]:
    fp = data.get("fingerprint") or {}
    layers = fp.get("num_hidden_layers", len(data.get("demand") or []))
    return int(layers), fp.get("num_key_value_heads")


def water_fill(static: list[int], cap: int) -> list[int]:
    """Layer budgets capped at `cap` tokens with the surplus spread over the uncapped layers in proportion
    to their static budgets (the same total, `sum(static)`, while `len(static) * cap >= sum(static)`;
    otherwise every layer gets `cap`). Rounded to integers with the exact total."""
    total, n = sum(static), len(static)
    if cap * n <= total:
        return [cap] * n
    capped = [s >= cap for s in static]
    while True:
        rest = sum(s for s, c in zip(static, capped) if not c)
        lam = (total - cap * sum(capped)) / rest
        grown = [c or lam * s >= cap for s, c in zip(static, capped)]
        if grown == capped:
            break
        capped = grown
    return _round_list([float(cap) if c else lam * s for s, c in zip(static, capped)], total)


class ReasoningWave(_PerLayer):
    """ReasonAlloc's offline layer-wise preallocation: layer budgets follow a calibrated demand profile.

    ReasonAlloc (abstract only, no public code): reasoning models need much
    context in shallow layers, less in the middle, more again in deep layers (the "Reasoning Wave").
    kvcompose measures it (`kvcompose calibrate`, or `kvcompose.calibration.calibrate_reasoning_wave`):
    teacher-forcing sample reasoning traces with the full cache, each layer's demand is the number of keys a
    decoding query needs to cover `coverage` (0.9) of its attention mass, averaged over heads and queries.
    The profile is a JSON file; the static budgets are `floor + (L * (C - floor)) * demand_l / sum(demand)`,
    rounded so the total equals `Uniform`'s (`L * C`). Layer budgets are per row and KV head and use dense
    per-layer storage.

    Cap at the sequence length (`cap=True`, default): a layer cannot use more tokens than it has seen. When
    `seen` is below a layer's static budget, that layer's budget is `seen` and the surplus goes to the
    other layers in proportion to their static budgets (`water_fill`), so the total stays `L * C` (while
    `L * seen >= L * C`; below that every layer simply holds everything). As `seen` grows the capped layers
    take their budget back and the others fall to their static budgets. `cap=False`: the static budgets
    (a layer's unused share is lost). `layer_budgets(L, C)` (used by the checks) returns the static budgets.

    Args:
        profile: path of the JSON profile written by `kvcompose calibrate` (or the dict itself), or "auto":
            the profile shipped with kvcompose for the model (`kvcompose/profiles/`), found when the cache
            is built by the model's layer and KV-head counts (`methods.reason_alloc(model=...)` matches the
            model's name and config instead); without one, layers stay uniform (with a warning).
        floor: the smallest layer budget, tokens (int) or a share of the average budget (float, default
            0.25): no layer starves, however flat its measured demand.
        cap: cap each layer's budget at the tokens seen and give the surplus to the other layers.
    """

    def __init__(self, profile: str | os.PathLike | dict, floor: int | float = 0.25, cap: bool = True):
        super().__init__()
        self.auto = isinstance(profile, str) and profile == "auto"
        self._auto: dict[int, dict[str, Any] | None] = {}
        if self.auto:
            data, self.path = None, None
        elif isinstance(profile, dict):
            data, self.path = profile, None
        else:
            p = Path(profile)
            if not p.is_file():
                raise KVComposeError(
                    f"ReasoningWave: profile file {str(p)!r} not found; write one with `kvcompose calibrate` or "
                    "kvcompose.calibration.calibrate_reasoning_wave(model, prompts, path)"
                )
            try:
                data = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise KVComposeError(f"ReasoningWave: {p} is not valid JSON ({e})") from None
            self.path = str(p)
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or floor < 0 or (isinstance(floor, float) and floor > 1):
            raise KVComposeError(f"ReasoningWave: floor must be an int >= 0 or a share in [0, 1], got {floor!r}")
        self.profile = data
        self.demand = None if data is None else self._demand_of(data)
        self.floor = floor
        self.cap = bool(cap)
        self._capped: dict[tuple[int, int, int], list[int]] = {}

    @staticmethod
    def _demand_of(data: Any) -> list[float]:
        demand = data.get("demand") if isinstance(data, dict) else None
        if (not isinstance(demand, list) or not demand
                or not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in demand)
                or sum(demand) <= 0):
            raise KVComposeError("ReasoningWave: the profile needs a 'demand' list of non-negative numbers per layer")
        return [float(x) for x in demand]

    # -- the automatic profile ----------------------------------------------------------------------
    def resolve(self, num_layers: int, num_heads: int | None = None) -> dict[str, Any] | None:
        """`profile="auto"`: the shipped profile for a model with `num_layers` layers and `num_heads` KV heads
        (None when there is none, or more than one: layers then stay uniform, with a warning)."""
        if not self.auto:
            return self.profile
        if num_layers not in self._auto:
            hits = [d for d in shipped_profiles() if _profile_shape(d)[0] == num_layers
                    and (num_heads is None or _profile_shape(d)[1] in (None, num_heads))]
            found = hits[0] if len(hits) == 1 else None
            if found is None:
                warnings.warn(
                    f"ReasoningWave(profile='auto'): no shipped ReasoningWave profile for a model with {num_layers} "
                    f"layers and {num_heads} KV heads ({len(hits)} candidates); layers stay uniform, only the "
                    "head-wise part of ReasonAlloc runs. Calibrate one with `kvcompose calibrate --model M --data "
                    "F --out profile.json` and pass profile='profile.json'.", stacklevel=3)
            self._auto[num_layers] = found
        return self._auto[num_layers]

    def bind(self, data: dict[str, Any] | None, num_layers: int) -> None:
        """`profile="auto"` resolved by the caller (e.g. `reason_alloc(model=...)`, by name and config)."""
        if data is not None:
            self._demand_of(data)
        self._auto[num_layers] = data
        self._memo.clear()
        self._capped.clear()

    def bind_model(self, model: Any) -> None:
        """The model a cache decodes with: `profile="auto"` takes the shipped profile whose fingerprint matches the
        model's whole architecture (not only its layer and KV-head counts: another model of that shape gets none);
        a given profile that records a fingerprint must match it (architecture, and weights when it records them)."""
        if not self.auto:
            check_fingerprint("ReasoningWave", self.profile, model, "calibrate a profile with `kvcompose calibrate`")
            return
        ours = model_fingerprint(model)
        hits = [d for d in shipped_profiles() if d.get("fingerprint") and profile_matches(d["fingerprint"], ours)]
        layers = int(ours["num_hidden_layers"])
        if not hits:
            if self._auto.get(layers) is not None or layers not in self._auto:
                warnings.warn(
                    f"ReasoningWave(profile='auto'): no shipped ReasoningWave profile matches this model's architecture "
                    f"({ours['model_type']}, {layers} layers, hidden size {ours['hidden_size']}); layers stay uniform, "
                    "only the head-wise part of ReasonAlloc runs. Calibrate one with `kvcompose calibrate --model M "
                    "--data F --out profile.json` and pass profile='profile.json'.", stacklevel=4)
        self.bind(hits[0] if hits else None, layers)

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        self.resolve(num_layers, num_heads)
        super().check(pipeline, budget, num_layers, num_heads)

    # -- budgets ----------------------------------------------------------------------------------------
    def _budgets(self, num_layers: int, budget: int) -> list[int]:
        data = self.resolve(num_layers)
        if data is None:  # auto without a profile: uniform layers
            return [budget] * num_layers
        demand = self._demand_of(data)
        if num_layers != len(demand):
            raise KVComposeError(
                f"ReasoningWave: the profile has {len(demand)} layers, the model {num_layers}; "
                "calibrate it on this model"
            )
        f = max(1, _share(self.floor, budget))
        if f > budget:
            raise KVComposeError(f"ReasoningWave: floor {f} exceeds the average budget {budget}")
        total = num_layers * budget
        s = sum(demand)
        raw = [f + (total - num_layers * f) * d / s for d in demand]
        return _round_list(raw, total)

    def layer_budget(self, layer_idx: int, num_layers: int, budget: int | None, seen: int) -> int:
        static = super().layer_budget(layer_idx, num_layers, budget, seen)
        if not self.cap or seen is None or seen <= 0:
            return static  # seen unknown (e.g. a caller without a sequence): the static schedule
        sched = self._schedule(num_layers, budget)
        if seen >= max(sched):
            return static
        key = (num_layers, budget, seen)
        if key not in self._capped:
            if len(self._capped) > 4096:
                self._capped.clear()
            self._capped[key] = water_fill(sched, seen)
        return self._capped[key][layer_idx]

    @property
    def resolved(self) -> bool:
        """False for `profile="auto"` while no shipped profile was found (uniform layers)."""
        return not self.auto or any(v is not None for v in self._auto.values())

    def __repr__(self) -> str:
        if self.auto:
            names = sorted({v.get("model", v.get("file", "?")) for v in self._auto.values() if v})
            src = f"auto: {', '.join(names)}" if names else "auto"
        else:
            src = os.path.basename(self.path) if self.path else "dict"
        return f"ReasoningWave({src!r}, floor={self.floor}, cap={self.cap})"
