"""The tier-store contract and the token bundle tiers move: where a token that leaves HBM goes.

The memory hierarchy of "Not All Thoughts Need HBM: Semantics-Aware Memory Hierarchy for LLM Reasoning"
(abstract only; no code found): HBM -> host memory (DDR) -> compressed -> evicted. Tokens in host memory
come back at full precision before attention, so they contribute exactly the terms they would have had
they never left HBM; only evicted tokens change what the model computes.

Contract (shapes: B batch rows, H KV heads, N tokens, D / Dv key / value head dims, C state channels):

- A store that holds tokens sets `holds_tokens = True`. At a compression event the layer builds the
  candidate set from ALL non-evicted tokens (HBM + the store's, merged by position, token state included),
  runs the pipeline on it and hands the store every candidate the selector did not keep, in the selector's
  priority order (most worth keeping first): `store(state, tokens, seen, kept) -> state`. The store
  REPLACES its content with (a prefix of) them; what it does not keep is evicted. So a token's tier can
  change at every event, up (promotion) or down, and every tier follows the one ranking of the pipeline.
- `retained(candidates, kept, seen) -> Long[B, H]`: how many of the non-kept candidates the store will keep
  (0 for `Evict`); protectors may then promise tokens beyond the HBM budget (they are kept off HBM).
- `fetch(state) -> TierTokens | None`: the held tokens in position order, on the compute device (keys and
  values at full precision, or dequantized). `start_fetch(state)` may begin that transfer early (the
  layer-ahead prefetch, `kvcompose.prefetch.Prefetcher`: a CUDA side stream, or a copy thread on CPU);
  `version(state)` changes whenever the content changes, so a stale prefetch is never used.
- `counts(state) -> int64 [B, H] | None` and `padded(state) -> bool`: real tokens held per (row, head) and
  whether some of them are padding, mirrored on the host when the content changes (`mirror`), so the
  layer sizes and masks attention over HBM + tier tokens without waiting for the device.
- `write_channels(state, channels) -> state`: token-aligned block state of the held tokens, in `fetch` order
  (attention from a tier keeps updating e.g. accumulated attention).
- `nbytes(state)` -> bytes per tier name ('host', 'compressed'); `state["peak"]` the peak per tier.
- `map_rows(state, fn, batch) -> state`: reorder / select batch rows (beam search), `fn` acts on dim 0.

A store's state is a dict made by `init` and returned by every call that changes it; it lives with the
layer (one per layer, and one per tree node and layer), never in the store, so one store object serves
every layer, row and branch. Token bundles may be ragged across heads: slots past a head's real tokens are
padding (`valid` False, position past every real one) and are never attended or kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..block import Block
from ..hostsync import read_later
from ..view import FAR_POSITION, KVComposeError, LayerSpec

__all__ = ["TierStore", "TierTokens", "Evict", "take_tokens", "flat_index", "bump", "track", "mirror",
           "map_host_rows"]

_versions = itertools.count(1)


def flat_index(idx: Int[Tensor, "B H K"], t: int) -> Int[Tensor, " BHK"]:
    """Row numbers of `x.reshape(B * H * T, ...)` for per-(row, head) slot indices `idx` into T slots."""
    b, h, _ = idx.shape
    return (idx + torch.arange(b * h, device=idx.device).view(b, h, 1) * t).reshape(-1)


def take_tokens(x: Tensor, idx: Int[Tensor, "B H K"], flat: Tensor | None = None) -> Tensor:
    """`x[b, h, idx[b, h, k]]` for `x` `[B, H, T, *]`: exact row copies (index_select is ~10x faster than an
    expanded `gather` on CPU). `flat` may pass a precomputed `flat_index(idx, T)`."""
    b, h, t = x.shape[:3]
    if flat is None:
        flat = flat_index(idx, t)
    rest = x.shape[3:]
    return x.reshape(b * h * t, *rest).index_select(0, flat).view(b, h, idx.shape[-1], *rest)


@dataclass
class TierTokens:
    """A bundle of tokens of one layer: what a store holds, or the candidates that leave HBM at an event
    (the unit the memory hierarchy of "Not All Thoughts Need HBM" moves between tiers).

    Attributes:
        keys: `[B, H, N, D]` keys after RoPE.
        values: `[B, H, N, Dv]` values.
        positions: `[B, H, N]` original positions.
        valid: `[B, H, N]` False for padding (left padding, or slots past a head's real tokens).
        channels: `[B, H, N, C]` float32 token-aligned block state (C may be 0).
        counts: the real tokens (positions before `FAR_POSITION`) per (row, head) on the host (int64 numpy
            `[B, H]`), when the event that made the bundle knows them without reading the device; else None.
        padded: whether some real token is padding (valid False), when known on the host; else None.
    """

    keys: Float[Tensor, "B H N D"]
    values: Float[Tensor, "B H N Dv"]
    positions: Int[Tensor, "B H N"]
    valid: Bool[Tensor, "B H N"]
    channels: Float[Tensor, "B H N C"]
    counts: Any = None
    padded: bool | None = None

    @property
    def n(self) -> int:
        """Tokens (slots) per (row, head)."""
        return self.keys.shape[2]

    def take(self, idx: Int[Tensor, "B H M"]) -> "TierTokens":
        """The tokens at slots `idx` (per row and head), in that order."""
        flat = flat_index(idx, self.n)
        g = lambda x: take_tokens(x, idx, flat)  # noqa: E731
        return TierTokens(g(self.keys), g(self.values), g(self.positions), g(self.valid), g(self.channels))

    def sorted(self) -> "TierTokens":
        """The same tokens in position order (padding slots keep their positions past every real one). On
        CPU an ordered bundle is returned as is; on a GPU the bundle is always permuted (asking whether it is
        ordered would wait for the device; a stable sort of an ordered bundle is the identity)."""
        if self.n < 2:
            return self
        if not self.positions.is_cuda and not bool((self.positions[..., 1:] < self.positions[..., :-1]).any()):
            return self
        out = self.take(self.positions.argsort(dim=-1, stable=True))
        out.counts, out.padded = self.counts, self.padded
        return out

    def apply(self, fn: Callable[[Tensor], Tensor]) -> "TierTokens":
        """Apply a batch operation (`fn` acts on dim 0) to every tensor."""
        return TierTokens(fn(self.keys), fn(self.values), fn(self.positions), fn(self.valid), fn(self.channels))

    @staticmethod
    def cat(parts: list["TierTokens"]) -> "TierTokens":
        """Concatenate bundles along N."""
        return TierTokens(*(torch.cat([getattr(p, f) for p in parts], dim=2)
                            for f in ("keys", "values", "positions", "valid", "channels")))


def bump(state: dict[str, Any]) -> None:
    """Give a store state a new content version."""
    state["version"] = next(_versions)


def mirror(state: dict[str, Any], positions: Int[Tensor, "B H N"], valid: Bool[Tensor, "B H N"],
           counts: np.ndarray | None = None, padded: bool | None = None) -> None:
    """Record on the host the real tokens per (row, head) of a store's new content (`state["counts"]`, int64
    `[B, H]`) and whether some are padding (`state["padded"]`). Given `counts` and `padded` (the event knows
    them: `TierTokens.counts` / `.padded`) no host sync; else they are read with the event's other host values
    (`kvcompose.hostsync.read_later`; at once outside an event)."""
    if counts is not None and padded is not None:
        state["counts"], state["padded"] = np.asarray(counts, dtype=np.int64), bool(padded)
        return
    real = positions < FAR_POSITION

    def fill(got: list[np.ndarray]) -> None:
        state["counts"] = got[0].astype(np.int64)
        state["padded"] = bool(got[1].any())

    read_later([real.sum(-1), (real & ~valid).any()], fill)


def map_host_rows(counts: np.ndarray | None, fn: Callable[[Tensor], Tensor]) -> np.ndarray | None:
    """Apply a batch-row operation to a host mirror (`fn` acts on dim 0 of a tensor; here a CPU one)."""
    if counts is None:
        return None
    return fn(torch.from_numpy(counts)).cpu().numpy().astype(np.int64)


def track(state: dict[str, Any], sizes: dict[str, int]) -> None:
    """Record the peak bytes per tier name in `state["peak"]`."""
    peak = dict(state.get("peak", {}))
    for k, v in sizes.items():
        peak[k] = max(peak.get(k, 0), v)
    state["peak"] = peak


class TierStore(Block):
    """Base class for where non-kept tokens go (a tier of the memory hierarchy of "Not All Thoughts Need
    HBM"). See the module docstring for the contract. Class attributes: `holds_tokens` (the store keeps
    tokens that attention must see), `tier_names` (names reported by `nbytes`); property `evicts` (some
    candidate the selector does not keep may leave for good, which is what a `Merger` folds).
    """

    holds_tokens: bool = False
    tier_names: tuple[str, ...] = ()

    @property
    def evicts(self) -> bool:
        """True when a non-kept token may leave for good (a store that holds tokens and keeps every one it is
        given says False)."""
        return not self.holds_tokens

    def init(self, spec: LayerSpec) -> dict[str, Any]:
        return {}

    def retained(self, candidates: Int[Tensor, "B H"], kept: Int[Tensor, "B H"], seen: int | Int[Tensor, "B 1"],
                 protected: Int[Tensor, "B H"] | None = None) -> Int[Tensor, "B H"]:
        """How many of the `candidates - kept` non-kept candidates of each (row, head) the store keeps
        (`candidates`: real tokens; `seen`: the tokens each row has seen, its left padding not counted, or one
        count for all rows; `protected`: protected tokens per head, which a store that keeps tokens never
        evicts)."""
        return torch.zeros_like(kept)

    def store(self, state: dict[str, Any], tokens: TierTokens, seen: int | Int[Tensor, "B 1"], kept: Int[Tensor, "B H"],
              protected: Int[Tensor, "B H"] | None = None) -> dict[str, Any]:
        """The store's new state after receiving `tokens`, the candidates not kept in HBM in priority
        order (protected ones first; `kept[b, h]` candidates stayed in HBM, `protected[b, h]` tokens were
        protected in all; `seen` tokens seen by the layer)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def fetch(self, state: dict[str, Any]) -> TierTokens | None:
        """Tokens held outside HBM for this layer, on the compute device, or None when there are none."""
        return None

    def start_fetch(self, state: dict[str, Any]) -> Any | None:
        """Begin an asynchronous fetch (an object with `wait() -> TierTokens | None`), or None if the store
        has nothing to overlap (the prefetcher then calls `fetch` when the layer needs it)."""
        return None

    def version(self, state: dict[str, Any]) -> int:
        """Changes whenever the content (which tokens, where) changes."""
        return int(state.get("version", 0))

    def counts(self, state: dict[str, Any] | None) -> np.ndarray | None:
        """Real tokens held per (row, head), on the host (int64 `[B, H]`; None when nothing was stored)."""
        return state.get("counts") if state else None

    def padded(self, state: dict[str, Any] | None) -> bool:
        """Whether some held token is padding (host)."""
        return bool(state.get("padded", False)) if state else False

    def write_channels(self, state: dict[str, Any], channels: Float[Tensor, "B H N C"]) -> dict[str, Any]:
        """Set token-aligned block state for the held tokens, in `fetch` order."""
        return state

    def nbytes(self, state: dict[str, Any]) -> dict[str, int]:
        """Bytes held per tier name (always reports 'host' and 'compressed', 0 when unused)."""
        return {"host": 0, "compressed": 0}

    def map_rows(self, state: Any, fn: Callable[[Tensor], Tensor], batch: int) -> Any:
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Evict(TierStore):
    """Plain eviction: non-kept tokens are freed (the last tier of "Not All Thoughts Need HBM", and every
    eviction method's only one). Holds nothing, so attention sees HBM tokens `[B, H, T, D]` only."""

    def store(self, state, tokens, seen, kept, protected=None):
        return state


def resolve_device(device: str | torch.device | None, who: str) -> torch.device | None:
    """A compute device a tier was built for (None: the layer's), or a `KVComposeError` naming the problem."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise KVComposeError(f"{who}: bad device {device!r}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise KVComposeError(f"{who}: device {dev} requested but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise KVComposeError(f"{who}: device {dev} does not exist ({torch.cuda.device_count()} CUDA devices)")
    elif dev.type != "cpu":
        raise KVComposeError(f"{who}: only 'cpu' and 'cuda' devices are supported, got {dev}")
    return dev


def check_device(want: torch.device | None, got: torch.device, who: str) -> None:
    """Refuse a layer on another device than the one a tier was built for."""
    if want is None:
        return
    if want.type != got.type or (want.index is not None and got.index is not None and want.index != got.index):
        raise KVComposeError(f"{who} was built for device {want} but the cache layer is on {got}")
