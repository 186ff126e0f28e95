"""Allocators: how many tokens each layer, (row, KV head) and request may keep.

Contract: `allocator(view, budget) -> Long[B, H]`, where `budget` is the layer's token budget
(`cache.layer_budget(i)`, i.e. `allocator.layer_budget(i, num_layers, cache_budget)`). Per-layer schedules
(`Pyramid`, `ReasoningWave`) only implement `layer_budget` and keep `uniform_per_layer = True`: every layer
keeps its own dense `[B, H, K_l, D]` buffers, so memory follows the per-layer budgets. Per-head and
per-request schedules (`HeadUtility`, `GrowPage`) set `uniform_per_layer = False`: the cache then stores
those layers in ragged paged storage (`kvcompose.storage`), where memory follows the *sum* of the per-head
budgets, not `B * H * max(budget)`.

Budget conservation (checked by tests/test_allocators.py):
- `Pyramid` and `ReasoningWave`: `sum_l layer_budget(l) == num_layers * budget` exactly.
- `HeadUtility`: per row, `sum_h budget[b, h] == H * layer_budget` and every head gets at least its floor.
- `GrowPage`: per layer, `sum_{b,h} budget[b, h] <= cap * B * H * budget` (the global cap across the batch)
  and every head keeps at least `floor` pages.

Stateful allocators (`GrowPage`) keep their state in the layer's cache state (`view.state[allocator.state_key]`,
a dict the ragged layer owns), never in the block object: one allocator serves every layer and row.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .kernels import window_attention_scores
from .view import KVComposeError, LayerView

__all__ = [
    "Allocator", "Uniform", "Pyramid", "ReasoningWave", "HeadUtility", "GrowPage",
    "round_to_total", "calibrate_reasoning_wave",
]


# ------------------------------------------------------------------------------------------- helpers
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _share(x: int | float, budget: int) -> int:
    """An absolute count (int) or a share of `budget` (float)."""
    return int(x * budget) if isinstance(x, float) else int(x)


def round_to_total(raw: Float[Tensor, "*batch N"], total: Int[Tensor, "*batch"]) -> Int[Tensor, "*batch N"]:
    """Round non-negative `raw` to integers whose sum over the last axis is exactly `total`
    (largest-remainder method; ties go to the lower index). `total` must lie in
    `[sum(floor(raw)), sum(floor(raw)) + N]`."""
    floors = raw.floor()
    rem = total - floors.sum(-1).long()
    frac = raw - floors
    n = raw.shape[-1]
    if bool((rem < 0).any()) or bool((rem > n).any()):
        raise KVComposeError("round_to_total: total out of reach of the raw shares")
    order = torch.sort(frac, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(n, device=raw.device).expand_as(order))
    return floors.long() + (rank < rem[..., None]).long()


def _round_list(raw: list[float], total: int) -> list[int]:
    t = torch.tensor(raw, dtype=torch.float64)
    return [int(x) for x in round_to_total(t, torch.tensor(total))]


def _check_budget(budget: Any, who: str) -> int:
    if not _is_int(budget) or budget <= 0:
        raise KVComposeError(f"{who}: budget must be a positive int, got {budget!r}")
    return budget


# ------------------------------------------------------------------------------------------- base
class Allocator:
    """Base class. Subclasses implement `allocate(view, budget) -> Long[B, H]` (budget per row and KV head).

    Class attributes:
        uniform_per_layer: True when all heads and rows of a layer always get the same budget, which lets
            the cache store the layer as one dense `[B, H, K, D]` tensor. False makes the cache use ragged
            paged storage (`kvcompose.storage.RaggedLayer`) for every layer.
        query_window: how many recent post-RoPE queries the allocator reads (the cache's ring buffer).
        page_size: tokens per page of the ragged storage (only read when `uniform_per_layer` is False).

    Optional hooks the cache calls:
        `layer_budget(layer_idx, num_layers, budget) -> int`: the per-layer budget (default: `budget`).
        `initial_limits(budget, batch, heads, device) -> Long[B, H]`: per-head limits before the first
            compression event of a ragged layer (a ragged layer compresses when some head holds more).
        `check(pipeline, budget, num_layers, num_heads)`: refuse impossible settings before decoding.
    """

    uniform_per_layer: bool = True
    query_window: int = 0
    page_size: int = 16

    @property
    def state_key(self) -> str:
        """Key of this allocator's state dict in the layer's cache state (ragged layers only)."""
        return f"{type(self).__name__}@{id(self):x}"

    def __call__(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        out = self.allocate(view, budget)
        b, h, _ = view.shape
        if out.shape != (b, h):
            raise KVComposeError(f"{type(self).__name__} returned budgets of shape {tuple(out.shape)}, expected {(b, h)}")
        if (out <= 0).any():
            raise KVComposeError(f"{type(self).__name__} gave a non-positive budget")
        return out

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:  # pragma: no cover - abstract
        raise NotImplementedError

    def layer_budget(self, layer_idx: int, num_layers: int, budget: int) -> int:
        """Token budget of layer `layer_idx` (per row and head) given the cache's per-layer budget."""
        return budget

    def layer_budgets(self, num_layers: int, budget: int) -> list[int]:
        """All layer budgets (their sum is the cache's total: `num_layers * budget` for every allocator here)."""
        return [self.layer_budget(i, num_layers, budget) for i in range(num_layers)]

    def initial_limits(self, budget: int, batch: int, heads: int, device: torch.device) -> Int[Tensor, "B H"]:
        """Per-head token limits of a ragged layer before its first compression event."""
        return torch.full((batch, heads), budget, dtype=torch.long, device=device)

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        """Raise `KVComposeError` if this allocator cannot work with the pipeline at this budget."""
        if budget is None:
            return
        for i, b in enumerate(self.layer_budgets(num_layers, budget)):
            if b <= 0:
                raise KVComposeError(f"{self!r} gives layer {i} a budget of {b} tokens")
            fixed = pipeline.fixed_protection(b)
            if fixed > b:
                raise KVComposeError(
                    f"{self!r} gives layer {i} a budget of {b} tokens, less than the {fixed} tokens the "
                    "protectors always keep: raise the budget or shrink the protected window"
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Uniform(Allocator):
    """The same budget for every layer, row and KV head (every reference method's default)."""

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        b, h, _ = view.shape
        return torch.full((b, h), budget, dtype=torch.long, device=view.keys.device)


class _PerLayer(Allocator):
    """A per-layer schedule: every head of layer l gets `layer_budget(l)`; dense storage per layer."""

    def __init__(self) -> None:
        self._memo: dict[tuple[int, int], list[int]] = {}

    def _budgets(self, num_layers: int, budget: int) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def layer_budgets(self, num_layers: int, budget: int) -> list[int]:
        key = (num_layers, budget)
        if key not in self._memo:
            _check_budget(budget, type(self).__name__)
            out = self._budgets(num_layers, budget)
            if sum(out) > num_layers * budget or min(out) <= 0:  # pragma: no cover - guarded by construction
                raise KVComposeError(f"{self!r}: layer budgets {out} break the total {num_layers * budget}")
            self._memo[key] = out
        return list(self._memo[key])

    def layer_budget(self, layer_idx: int, num_layers: int, budget: int) -> int:
        if not 0 <= layer_idx < num_layers:
            raise KVComposeError(f"layer {layer_idx} out of range for {num_layers} layers")
        return self.layer_budgets(num_layers, budget)[layer_idx]

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


class ReasoningWave(_PerLayer):
    """ReasonAlloc's offline layer-wise preallocation: layer budgets follow a calibrated demand profile.

    ReasonAlloc (abstract only, no public code; see /work/shared/METHODS.md): reasoning models need much
    context in shallow layers, less in the middle, more again in deep layers (the "Reasoning Wave").
    kvcompose measures it (`calibrate_reasoning_wave`): teacher-forcing sample reasoning traces with the full
    cache, each layer's demand is the number of keys a decoding query needs to cover `coverage` (0.9) of its
    attention mass, averaged over heads and queries. The profile is a JSON file; budgets are then
    `floor + (L * (C - floor)) * demand_l / sum(demand)`, rounded so the total equals `Uniform`'s
    (`L * C`). Layer budgets are per row and KV head and use dense per-layer storage.

    Args:
        profile: path of the JSON profile written by `calibrate_reasoning_wave` (or the dict itself).
        floor: the smallest layer budget, tokens (int) or a share of the average budget (float, default
            0.25): no layer starves, however flat its measured demand.
    """

    def __init__(self, profile: str | os.PathLike | dict, floor: int | float = 0.25):
        super().__init__()
        if isinstance(profile, dict):
            data, self.path = profile, None
        else:
            p = Path(profile)
            if not p.is_file():
                raise KVComposeError(
                    f"ReasoningWave: profile file {str(p)!r} not found; write one with "
                    "kvcompose.allocators.calibrate_reasoning_wave(model, prompts, path)"
                )
            try:
                data = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise KVComposeError(f"ReasoningWave: {p} is not valid JSON ({e})") from None
            self.path = str(p)
        demand = data.get("demand") if isinstance(data, dict) else None
        if (not isinstance(demand, list) or not demand
                or not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in demand)
                or sum(demand) <= 0):
            raise KVComposeError("ReasoningWave: the profile needs a 'demand' list of non-negative numbers per layer")
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or floor < 0 or (isinstance(floor, float) and floor > 1):
            raise KVComposeError(f"ReasoningWave: floor must be an int >= 0 or a share in [0, 1], got {floor!r}")
        self.profile = data
        self.demand = [float(x) for x in demand]
        self.floor = floor

    def _budgets(self, num_layers: int, budget: int) -> list[int]:
        if num_layers != len(self.demand):
            raise KVComposeError(
                f"ReasoningWave: the profile has {len(self.demand)} layers, the model {num_layers}; "
                "calibrate it on this model"
            )
        f = max(1, _share(self.floor, budget))
        if f > budget:
            raise KVComposeError(f"ReasoningWave: floor {f} exceeds the average budget {budget}")
        total = num_layers * budget
        s = sum(self.demand)
        raw = [f + (total - num_layers * f) * d / s for d in self.demand]
        return _round_list(raw, total)

    def __repr__(self) -> str:
        src = os.path.basename(self.path) if self.path else "dict"
        return f"ReasoningWave({src!r}, floor={self.floor})"


def _coverage_count(p: Float[Tensor, "*b T"], coverage: float) -> Int[Tensor, "*b"]:
    """How many of the largest entries of each row of `p` (non-negative) cover `coverage` of its sum."""
    s = p.sort(dim=-1, descending=True).values
    cum = s.cumsum(-1)
    need = coverage * cum[..., -1:]
    return ((cum - s) < need).sum(-1).clamp(min=1)


def _coverage_mask(p: Float[Tensor, "B H T"], coverage: float) -> Bool[Tensor, "B H T"]:
    """True for the smallest set of largest entries of each row that covers `coverage` of its mass."""
    s, idx = p.sort(dim=-1, descending=True)
    cum = s.cumsum(-1)
    inside = (cum - s) < coverage * cum[..., -1:]
    inside &= s > 0
    return torch.zeros_like(inside).scatter_(-1, idx, inside)


@torch.no_grad()
def calibrate_reasoning_wave(
    model,
    prompts: list[Tensor] | list[list[int]],
    path: str | os.PathLike | None = None,
    new_tokens: int = 256,
    coverage: int | float = 0.9,
    traces: list[Tensor] | list[list[int]] | None = None,
    query_chunk: int = 128,
) -> dict[str, Any]:
    """Measure each layer's attention demand on sample reasoning traces and save a ReasoningWave profile.

    For every prompt: a greedy continuation of `new_tokens` tokens with the full cache (or the given
    `traces`), then one full-cache forward over prompt + continuation that records every post-RoPE query.
    For each decoding query (continuation positions only) and query head, the demand is the number of keys
    covering `coverage` of its attention mass; a layer's demand is the mean over heads, queries and prompts.

    Args:
        model: a Hugging Face causal LM supported by `KVComposeCache` (use sample prompts that are not in
            your evaluation set).
        prompts: token id sequences (`[T]` or `[1, T]` tensors, or lists), one per prompt, unpadded.
        path: where to write the JSON profile (None: do not write).
        new_tokens: length of each greedy continuation (ignored for prompts that come with `traces`).
        coverage: the share of attention mass a layer's kept set should cover (0.9).
        traces: optional continuations (same count as prompts) to teacher-force instead of generating.
        query_chunk: queries scored at once (bounds the memory of the `[Hq, chunk, T]` attention block).

    Returns:
        The profile dict: `demand` (per layer), `head_demand` (per layer and KV head), `coverage`, counts.
    """
    from .cache import KVComposeCache
    from .pipeline import Pipeline

    if not prompts:
        raise KVComposeError("calibrate_reasoning_wave: give at least one prompt")
    if not 0.0 < coverage <= 1.0:
        raise KVComposeError(f"coverage must be in (0, 1], got {coverage}")
    if traces is not None and len(traces) != len(prompts):
        raise KVComposeError("calibrate_reasoning_wave: give one trace per prompt")
    device = next(model.parameters()).device
    sums: Tensor | None = None
    count = 0
    for i, prompt in enumerate(prompts):
        ids = torch.as_tensor(prompt, dtype=torch.long, device=device).reshape(1, -1)
        t0 = ids.shape[1]
        if traces is not None:
            cont = torch.as_tensor(traces[i], dtype=torch.long, device=device).reshape(1, -1)
            full = torch.cat([ids, cont], dim=1)
        else:
            full = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None,
                                  top_k=None)
        t = full.shape[1]
        if t <= t0:
            continue
        probe = _QueryProbe(t)
        cache = KVComposeCache(model, Pipeline(probe), budget=None, strict=False)
        model(input_ids=full, past_key_values=cache)
        per_layer = []
        for layer in cache.layers:
            q = layer.q_buf[0].float()  # [Hq, T, D]
            k = layer.keys[0].float()  # [H, T, D]
            hq, h = q.shape[0], k.shape[0]
            g = hq // h
            kk = k.repeat_interleave(g, dim=0)
            need = torch.zeros(hq, dtype=torch.float64, device=device)
            for s in range(t0, t, query_chunk):
                e = min(s + query_chunk, t)
                logits = torch.einsum("hqd,htd->hqt", q[:, s:e], kk) * layer.scale
                causal = torch.arange(t, device=device)[None, :] <= torch.arange(s, e, device=device)[:, None]
                p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
                need += _coverage_count(p, coverage).double().sum(-1)
            per_layer.append(need.reshape(h, g).mean(-1) / (t - t0))
        cur = torch.stack(per_layer)  # [L, H]
        sums = cur if sums is None else sums + cur
        count += 1
    if sums is None:
        raise KVComposeError("calibrate_reasoning_wave: no prompt produced decoding queries")
    head = (sums / count).tolist()
    profile = {
        "kind": PROFILE_KIND,
        "version": 1,
        "model": getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", ""),
        "num_layers": len(head),
        "coverage": coverage,
        "prompts": count,
        "new_tokens": new_tokens if traces is None else None,
        "demand": [float(sum(r) / len(r)) for r in head],
        "head_demand": head,
    }
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(profile, indent=1))
    return profile


class _QueryProbe(Allocator):
    """Internal: a never-compressing pipeline part whose only effect is a query ring buffer of `n`."""

    def __init__(self, n: int):
        self.query_window = n

    def allocate(self, view, budget):  # pragma: no cover - never called (the pipeline has no selector)
        raise NotImplementedError


class HeadUtility(Allocator):
    """ReasonAlloc's online head-wise reallocation: at each compression event a layer's total
    (`H * layer_budget` per row) moves toward the KV heads of high utility, with a floor per head.

    ReasonAlloc (abstract only): "head budgets are reassigned online to high-utility heads, with protection
    against starvation". Utility here is measured on the attention of the last `window` queries (mean over
    the GQA group and the queries, `[B, H, T]`):

    - `"mass"` (default): water-filling. Every head first gets the floor; the remaining slots of the row go,
      one by one, to the (head, token) pairs of largest attention among tokens each head does not yet keep.
      This maximises the attention mass the kept sets cover (the mass outside each head's top-k).
    - `"entropy"`: budgets in proportion to each head's effective support `exp(entropy)` of its attention.

    Per layer the budgets come from `layers` (e.g. `ReasoningWave`); heads of one row always sum to exactly
    `H * layer_budget`. Storage is ragged (memory follows the sum of per-head budgets).

    Args:
        layers: per-layer schedule (None: uniform layers).
        floor: per-head minimum, tokens (int) or a share of the layer budget (float, default 0.25).
        utility: "mass" or "entropy".
        window: queries the utility looks at (ring-buffer size).
        page_size: page size of the ragged storage, tokens.
    """

    uniform_per_layer = False

    def __init__(self, layers: Allocator | None = None, floor: int | float = 0.25,
                 utility: Literal["mass", "entropy"] = "mass", window: int = 32, page_size: int = 16):
        if layers is not None and (not isinstance(layers, Allocator) or not layers.uniform_per_layer):
            raise KVComposeError("HeadUtility: layers must be a per-layer Allocator (e.g. ReasoningWave, Pyramid)")
        if isinstance(floor, bool) or not isinstance(floor, (int, float)):
            raise KVComposeError(f"HeadUtility: floor must be an int or a float share, got {floor!r}")
        if (isinstance(floor, float) and not 0.0 < floor <= 1.0) or (isinstance(floor, int) and floor <= 0):
            raise KVComposeError(f"HeadUtility: floor must be a positive int or a share in (0, 1], got {floor!r}")
        if utility not in ("mass", "entropy"):
            raise KVComposeError(f"HeadUtility: utility must be 'mass' or 'entropy', got {utility!r}")
        if not _is_int(window) or window <= 0:
            raise KVComposeError(f"HeadUtility: window must be a positive int, got {window!r}")
        if not _is_int(page_size) or page_size <= 0:
            raise KVComposeError(f"HeadUtility: bad page size {page_size!r}: a positive int")
        self.layers, self.floor, self.utility, self.window = layers, floor, utility, window
        self.query_window = window
        self.page_size = page_size

    def layer_budget(self, layer_idx: int, num_layers: int, budget: int) -> int:
        if self.layers is None:
            return budget
        return self.layers.layer_budget(layer_idx, num_layers, budget)

    def floor_tokens(self, budget: int) -> int:
        """The per-head floor at a layer budget."""
        return max(1, _share(self.floor, budget))

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        super().check(pipeline, budget, num_layers, num_heads)
        if budget is None:
            return
        for i, b in enumerate(self.layer_budgets(num_layers, budget)):
            f = self.floor_tokens(b)
            if f * num_heads > b * num_heads:
                raise KVComposeError(
                    f"HeadUtility: floor * heads = {f} * {num_heads} > total {b * num_heads} of layer {i}"
                )
            fixed = pipeline.fixed_protection(f)
            if fixed > f:
                raise KVComposeError(
                    f"HeadUtility: a head at its floor ({f} tokens) cannot hold the {fixed} tokens the "
                    "protectors always keep: raise the floor"
                )

    def utilities(self, view: LayerView) -> Float[Tensor, "B H T"] | None:
        """Attention of the last `window` queries per KV head (mean over group and queries), or None."""
        if view.queries is None or view.queries.shape[2] == 0:
            return None
        return window_attention_scores(
            view.queries[:, :, -self.window:], view.keys, view.positions, view.valid,
            view.query_positions[-self.window:], view.query_valid[:, -self.window:], view.scale,
            gqa="mean", pool="none",
        )

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        b, h, t = view.shape
        dev = view.keys.device
        f = self.floor_tokens(budget)
        if f > budget:
            raise KVComposeError(f"HeadUtility: floor * heads = {f} * {h} > total {budget * h}")
        total = h * budget
        p = self.utilities(view)
        if p is None:
            return torch.full((b, h), budget, dtype=torch.long, device=dev)
        p = p.float() * view.valid
        if self.utility == "entropy":
            mass = p.sum(-1, keepdim=True).clamp(min=1e-30)
            q = p / mass
            ent = -(q * q.clamp(min=1e-30).log()).sum(-1)
            eff = ent.exp()  # [B, H], effective number of keys
            raw = f + (total - h * f) * eff / eff.sum(-1, keepdim=True)
            return round_to_total(raw.double(), torch.full((b,), total, dtype=torch.long, device=dev))
        extra = total - h * f
        counts = torch.zeros(b, h, dtype=torch.long, device=dev)
        if t > f and extra > 0:
            s = p.sort(dim=-1, descending=True).values[..., f:]  # [B, H, T - f]: tokens beyond the floor
            n_valid = view.valid.sum(-1, keepdim=True)
            rank = torch.arange(f, t, device=dev)
            s = torch.where(rank[None, None, :] < n_valid, s, torch.full_like(s, -1.0))  # no phantom tokens
            k = min(extra, s.shape[1] * s.shape[2])
            top = s.reshape(b, -1).topk(k, dim=-1)
            head = top.indices // (t - f)
            useful = top.values >= 0
            counts.scatter_add_(-1, head, useful.long())
        left = total - h * f - counts.sum(-1)  # slots no head can use yet: spread evenly (heads will grow)
        even = left // h
        rest = left - even * h
        bonus = (torch.arange(h, device=dev)[None, :] < rest[:, None]).long()
        return f + counts + even[:, None] + bonus

    def __repr__(self) -> str:
        layers = "" if self.layers is None else f"{self.layers!r}, "
        return f"HeadUtility({layers}floor={self.floor}, utility={self.utility!r}, window={self.window})"


# ------------------------------------------------------------------------------------------- GrowPage
class GrowPage(Allocator):
    """GrowPage: on-demand capacity; each (request, KV head) budget grows or shrinks one page at a time.

    GrowPage (abstract only, see /work/shared/METHODS.md): "per-request budgets grow by pages; fast and slow
    query summaries estimate the attention working set; at a capacity boundary, compress or take a page".
    kvcompose's reading, per layer:

    - State (in the layer's cache state): a fast and a slow exponential moving average of the post-RoPE
      queries of every query head (`[B, Hq, D]`, rates `fast` and `slow` per decoded token, updated at each
      compression event from the queries decoded since the last one, which the ring buffer of `window >=
      interval` queries holds exactly), the same EMAs of the squared query norms, and the pages of each
      (row, KV head).
    - Each timescale summarises the queries as a Gaussian `N(mu, sigma^2 I)` (mean and spread from the two
      EMAs). A query drawn from it gives key `k` the expected softmax numerator
      `exp(s mu.k + s^2 sigma^2 |k|^2 / 2)` (log-normal mean, s the attention scale): a broad query
      distribution reaches more keys than its mean query would (`spread=False` drops the variance term).
    - Working set of a head: the union of the keys covering `coverage` of the fast and of the slow
      expected attention (mean over the query group). When the fast summary drifts from the slow one (a
      new phase of the reasoning) or spreads, the union broadens.
    - At a compression event (the capacity boundary: some head holds more than its pages), every head whose
      working set needs more pages than it has asks for one more page; the layer's pool grants requests,
      largest deficit first, while the global cap `cap * B * H * budget` tokens across the batch allows;
      the others compress inside their allocation. With `shrink`, a head whose working set needs at least
      two pages fewer returns one page to the pool (it is reused by the next grant).
    - Budget of a head = its pages * page size; the storage is paged with the same page size.

    Args:
        page: tokens per page (16).
        initial: starting pages per head, as a share of the cache budget (0.5) rounded down to pages.
        cap: the layer's pool across the batch, as a multiple of the uniform total `B * H * budget` (1.0:
            never more than `Uniform` at the same budget).
        floor: fewest pages a head keeps (1).
        coverage: attention mass the working set must cover (0.9).
        fast: EMA rate of the fast query summary per decoded token (0.25).
        slow: EMA rate of the slow query summary per decoded token (0.01).
        shrink: return pages when the working set narrows.
        window: query ring-buffer size; at least the cache's interval for exact EMAs.
        spread: include the query spread (variance) in the expected attention.
    """

    uniform_per_layer = False

    def __init__(self, page: int = 16, initial: int | float = 0.5, cap: int | float = 1.0, floor: int = 1,
                 coverage: int | float = 0.9, fast: float = 0.25, slow: float = 0.01, shrink: bool = True,
                 window: int = 64, spread: bool = True):
        if not _is_int(page) or page <= 0:
            raise KVComposeError(f"GrowPage: bad page size {page!r}: a positive int of tokens")
        for name, v in (("initial", initial), ("cap", cap)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise KVComposeError(f"GrowPage: {name} must be a positive number, got {v!r}")
        if initial > cap:
            raise KVComposeError(f"GrowPage: initial {initial} exceeds the cap {cap}")
        if not _is_int(floor) or floor <= 0:
            raise KVComposeError(f"GrowPage: floor must be a positive int of pages, got {floor!r}")
        if not 0.0 < coverage <= 1.0:
            raise KVComposeError(f"GrowPage: coverage must be in (0, 1], got {coverage}")
        if not (0.0 < slow < 1.0 and 0.0 < fast < 1.0):
            raise KVComposeError(f"GrowPage: EMA rates must be in (0, 1), got fast={fast}, slow={slow}")
        if not _is_int(window) or window <= 0:
            raise KVComposeError(f"GrowPage: window must be a positive int, got {window!r}")
        self.page_size = page
        self.initial, self.cap, self.floor, self.coverage = float(initial), float(cap), floor, coverage
        self.fast, self.slow, self.shrink, self.window, self.spread = fast, slow, shrink, window, spread
        self.query_window = window

    # -- sizes ----------------------------------------------------------------------------------------
    def initial_pages(self, budget: int) -> int:
        return max(self.floor, int(self.initial * budget) // self.page_size)

    def cap_pages(self, budget: int, batch: int, heads: int) -> int:
        """The layer's page pool across the batch (the global cap)."""
        return int(self.cap * batch * heads * budget) // self.page_size

    def initial_limits(self, budget: int, batch: int, heads: int, device: torch.device) -> Int[Tensor, "B H"]:
        return torch.full((batch, heads), self.initial_pages(budget) * self.page_size, dtype=torch.long, device=device)

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        if budget is None:
            raise KVComposeError("GrowPage needs a budget: the cap is a multiple of the uniform total at that budget")
        _check_budget(budget, "GrowPage")
        if self.page_size > budget:
            raise KVComposeError(f"GrowPage: bad page size {self.page_size}: larger than the budget {budget}")
        init = self.initial_pages(budget)
        if init * num_heads > self.cap_pages(budget, 1, num_heads):
            raise KVComposeError(
                f"GrowPage: {init} initial pages x {num_heads} heads exceed the cap of "
                f"{self.cap_pages(budget, 1, num_heads)} pages per row at page size {self.page_size}"
            )
        fixed = pipeline.fixed_protection(self.floor * self.page_size)
        if fixed > self.floor * self.page_size:
            raise KVComposeError(
                f"GrowPage: a head at its floor ({self.floor} pages of {self.page_size}) cannot hold the {fixed} "
                "tokens the protectors always keep: raise floor or page"
            )

    # -- summaries --------------------------------------------------------------------------------------
    @staticmethod
    def _ema_update(state: dict[str, Tensor], name: str, rate: float, q: Float[Tensor, "B Hq W D"],
                    new: Bool[Tensor, "B W"]) -> None:
        """`ema <- (1 - r)^n ema + sum_i r (1 - r)^(n - 1 - i) q_i` over the n new valid queries of each row,
        with the same recursion on the squared query norms and on the total weight (bias correction)."""
        newf = new.float()
        after = newf.flip(-1).cumsum(-1).flip(-1) - newf  # valid new queries after each one
        w = rate * (1.0 - rate) ** after * newf  # [B, W]
        decay = (1.0 - rate) ** newf.sum(-1)  # [B]
        qf = q.float()
        s = torch.einsum("bw,bhwd->bhd", w, qf)
        n = torch.einsum("bw,bhw->bh", w, qf.pow(2).sum(-1))
        if name not in state:
            state[name] = torch.zeros_like(s)
            state[name + "_sq"] = torch.zeros_like(n)
            state[name + "_mass"] = torch.zeros_like(decay)
        state[name] = state[name] * decay[:, None, None] + s
        state[name + "_sq"] = state[name + "_sq"] * decay[:, None] + n
        state[name + "_mass"] = state[name + "_mass"] * decay + w.sum(-1)

    @staticmethod
    def summary(state: dict[str, Tensor], name: str) -> tuple[Float[Tensor, "B Hq D"], Float[Tensor, "B Hq"]]:
        """Mean `mu` and per-dimension variance `sigma^2` of the queries of one timescale (`"fast"`/`"slow"`)."""
        m = state[name + "_mass"].clamp(min=1e-12)[:, None]
        mu = state[name] / m[..., None]
        var = ((state[name + "_sq"] / m - mu.pow(2).sum(-1)) / mu.shape[-1]).clamp(min=0.0)
        return mu, var

    def expected_attention(self, view: LayerView, mu: Float[Tensor, "B Hq D"],
                           var: Float[Tensor, "B Hq"]) -> Float[Tensor, "B H T"]:
        """Attention a query drawn from `N(mu, var I)` gives each held key, in expectation of the softmax
        numerator: `exp(s mu.k + s^2 var |k|^2 / 2)` (log-normal mean), normalised over keys, mean over the
        query group."""
        b, h, t, d = view.keys.shape
        g = mu.shape[1] // h
        k = view.keys.float()
        s = view.scale
        logits = torch.einsum("bhgd,bhtd->bhgt", mu.reshape(b, h, g, d), k) * s
        logits = logits + 0.5 * s * s * var.reshape(b, h, g)[..., None] * k.pow(2).sum(-1)[:, :, None, :]
        ok = (view.valid & (view.positions < view.seen))[:, :, None, :]
        p = torch.softmax(logits.masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)
        return p.mean(2)

    def working_set(self, view: LayerView, state: dict[str, Tensor]) -> Int[Tensor, "B H"]:
        """Keys (per row and KV head) that cover `coverage` of the expected attention of the fast or of the
        slow query summary (the union of the two sets)."""
        b, h, t = view.shape
        union = torch.zeros(b, h, t, dtype=torch.bool, device=view.keys.device)
        if view.queries is None or "fast" not in state:
            return view.valid.sum(-1)
        for name in ("fast", "slow"):
            mu, var = self.summary(state, name)
            union |= _coverage_mask(self.expected_attention(view, mu, var if self.spread else var * 0), self.coverage)
        return union.sum(-1)

    # -- the decision -----------------------------------------------------------------------------------
    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        state = view.state.get(self.state_key)
        if not isinstance(state, dict):
            raise KVComposeError("GrowPage keeps per-layer state and needs the cache's ragged storage "
                                 "(uniform_per_layer = False); call it through KVComposeCache")
        b, h, _ = view.shape
        dev = view.keys.device
        pgs = self.page_size
        if view.queries is not None:
            last = state.get("last", -1)
            new = view.query_valid & (view.query_positions > last)[None, :]
            self._ema_update(state, "fast", self.fast, view.queries, new)
            self._ema_update(state, "slow", self.slow, view.queries, new)
            state["last"] = int(view.query_positions[-1])
        pages = state.get("pages")
        if pages is None or pages.shape != (b, h):
            pages = torch.full((b, h), self.initial_pages(budget), dtype=torch.long, device=dev)
        active = view.state.get("kvcompose.active")  # rows this event compresses (the others keep their pages)
        act = torch.ones(b, dtype=torch.bool, device=dev) if active is None else active.to(dev)
        ws = self.working_set(view, state)
        want = ((ws + pgs - 1) // pgs).clamp(min=self.floor)
        if self.shrink:
            give_back = (want <= pages - 2) & act[:, None]
            pages = torch.where(give_back, pages - 1, pages).clamp(min=self.floor)
            state["returned"] = state.get("returned", 0) + int(give_back.sum())
        deficit = (want - pages).clamp(min=0) * act[:, None]
        free = self.cap_pages(budget, b, h) - int(pages.sum())
        n_req = int((deficit > 0).sum())
        if n_req and free > 0:
            order = torch.sort(deficit.reshape(-1), descending=True, stable=True).indices
            grant = torch.zeros(b * h, dtype=torch.long, device=dev)
            grant[order[: min(free, n_req)]] = 1
            pages = pages + grant.reshape(b, h)
            state["granted"] = state.get("granted", 0) + int(grant.sum())
        state["denied"] = state.get("denied", 0) + max(0, n_req - max(free, 0))
        state["pages"] = pages
        return pages * pgs

    def __repr__(self) -> str:
        return (f"GrowPage(page={self.page_size}, initial={self.initial:g}, cap={self.cap:g}, "
                f"coverage={self.coverage:g}, fast={self.fast:g}, slow={self.slow:g}, shrink={self.shrink}, "
                f"spread={self.spread})")
