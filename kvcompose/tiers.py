"""TierStores: where a token that leaves HBM goes (host memory, a compressed copy, or nowhere).

The memory hierarchy of "Not All Thoughts Need HBM: Semantics-Aware Memory Hierarchy for LLM Reasoning"
(abstract only; no code found): HBM -> host memory (DDR) -> compressed -> evicted. Tokens in host memory
come back at full precision before attention, so they contribute exactly the terms they would have had
they never left HBM; only evicted tokens change what the model computes.

Contract (shapes: B batch rows, H KV heads, N tokens held by the store, D / Dv key / value head dims):

- A store that holds tokens sets `holds_tokens = True`. At a compression event the cache builds the
  candidate set from ALL non-evicted tokens (HBM + every tier, merged by position, token state included),
  runs the pipeline on it, and hands the store every candidate the selector did not keep:
  `store(state, tokens, scores, seen)`. The store REPLACES its content with (a subset of) them; what it
  does not keep is evicted. So a token's tier can change at every event, up (promotion) or down.
- `fetch(state) -> TierTokens | None`: the tokens the store holds, ready on the compute device (keys and
  values at full precision, or dequantized). `start_fetch(state)` may begin that transfer early (CUDA
  layer-ahead prefetch, see `kvcompose.prefetch.Prefetcher`); `version(state)` changes whenever the
  content changes, so a stale prefetch is never used.
- `write_state(state, name, values)`: token-aligned block state (e.g. accumulated attention) for the
  store's tokens, in `fetch` order; attention from a tier keeps updating it.
- `nbytes(state)` -> bytes per tier name ('host', 'compressed'); `peak_bytes(layers)` -> peak per tier.
- `batch_apply(state, fn)`: reorder / select batch rows (beam search), `fn` acts on dim 0.
- A store with `budget_free = True` derives the HBM budget itself: `hbm_budget(seen, budget) -> int`.

The state of a store lives in the layer's cache state (`KVComposeLayer.tier_state`), never in the store,
so one store object serves every layer and every row.

Stores: `Evict` (default: nothing kept), `HostTier` (full precision in host memory; pinned buffers and a
side CUDA stream on GPU), `CompressedTier` (KIVI int8 / int4 group quantization), `Hierarchy` (the
paper's policy: HBM share, then host, then compressed, the rest evicted).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .kernels import QTensor, dequantize, quantize
from .view import KVComposeError

__all__ = [
    "TierStore",
    "TierTokens",
    "Evict",
    "HostTier",
    "CompressedTier",
    "Hierarchy",
    "HostStash",
    "PendingCopy",
    "quantization_error_bound",
    "transfer_stream",
    "take_tokens",
    "flat_index",
]

_versions = itertools.count(1)


# ------------------------------------------------------------------------------------------------
# token bundles
# ------------------------------------------------------------------------------------------------
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
    """A bundle of tokens of one layer, e.g. the tokens a store holds or the non-kept candidates at a
    compression event (the unit the memory hierarchy of "Not All Thoughts Need HBM" moves between tiers).

    Attributes:
        keys: `[B, H, N, D]` keys after RoPE.
        values: `[B, H, N, Dv]` values.
        positions: `[B, H, N]` original positions (ascending along N when produced by the cache).
        valid: `[B, H, N]` False for left-padding tokens.
        state: block state aligned with the tokens, name -> `[B, H, N]` float32 (e.g. accumulated attention).
    """

    keys: Float[Tensor, "B H N D"]
    values: Float[Tensor, "B H N Dv"]
    positions: Int[Tensor, "B H N"]
    valid: Bool[Tensor, "B H N"]
    state: dict[str, Tensor] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """Tokens per (row, head)."""
        return self.keys.shape[2]

    def take(self, idx: Int[Tensor, "B H M"]) -> "TierTokens":
        """The tokens at slots `idx` (per row and head), in that order."""
        flat = flat_index(idx, self.n)
        g = lambda x: take_tokens(x, idx, flat)  # noqa: E731
        return TierTokens(keys=g(self.keys), values=g(self.values), positions=g(self.positions),
                          valid=g(self.valid), state={k: g(v) for k, v in self.state.items()})

    def apply(self, fn: Callable[[Tensor], Tensor]) -> "TierTokens":
        """Apply a batch operation (`fn` acts on dim 0) to every tensor."""
        return TierTokens(fn(self.keys), fn(self.values), fn(self.positions), fn(self.valid),
                          {k: fn(v) for k, v in self.state.items()})

    @staticmethod
    def cat(parts: list["TierTokens"]) -> "TierTokens":
        """Concatenate bundles along N (state names missing from a part are filled with zeros)."""
        names = sorted({k for p in parts for k in p.state})

        def st(p: TierTokens, k: str) -> Tensor:
            v = p.state.get(k)
            return v if v is not None else torch.zeros(p.positions.shape, dtype=torch.float32, device=p.positions.device)

        return TierTokens(
            keys=torch.cat([p.keys for p in parts], dim=2),
            values=torch.cat([p.values for p in parts], dim=2),
            positions=torch.cat([p.positions for p in parts], dim=2),
            valid=torch.cat([p.valid for p in parts], dim=2),
            state={k: torch.cat([st(p, k) for p in parts], dim=2) for k in names},
        )


# ------------------------------------------------------------------------------------------------
# host transfers (pinned buffers, side stream, events)
# ------------------------------------------------------------------------------------------------
_streams: dict[torch.device, Any] = {}


def transfer_stream(device: torch.device):
    """The side CUDA stream that carries every host <-> device copy of kvcompose's tiers on `device`.

    One stream per device: copies issued on it run in order, so a host buffer is never overwritten by a
    device-to-host copy while an earlier host-to-device copy still reads it.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise KVComposeError(f"transfer streams exist only for CUDA devices, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    s = _streams.get(device)
    if s is None:
        s = torch.cuda.Stream(device=device)
        _streams[device] = s
    return s


class PendingCopy:
    """Device tensors being filled by host-to-device copies on the transfer stream (the prefetch of
    "Not All Thoughts Need HBM": host tokens come back before attention). `tensors`: name -> tensor of any
    shape, e.g. keys `[B, H, N, D]`.

    `wait()` makes the current (compute) stream wait on the copy event (never the host) and marks the
    tensors as used by the compute stream (`record_stream`), so the caching allocator cannot hand their
    memory to another tensor while the compute stream still reads them.
    """

    def __init__(self, tensors: dict[str, Tensor], event: Any | None):
        self.tensors = tensors
        self.event = event

    def wait(self) -> dict[str, Tensor]:
        if self.event is not None:
            dev = next(iter(self.tensors.values())).device
            cur = torch.cuda.current_stream(dev)
            cur.wait_event(self.event)
            for t in self.tensors.values():
                t.record_stream(cur)
            self.event = None
        return self.tensors


class HostStash:
    """Named tensors kept in host memory for one layer and one tier (e.g. keys `[B, H, N, D]` and values
    `[B, H, N, Dv]` of the host tier of "Not All Thoughts Need HBM", or a compressed tier's codes).

    On CUDA (`device.type == "cuda"`): one reusable pinned buffer per name (grown by 1.5x when too small,
    never reallocated per step). `put` copies device tensors into them on the side transfer stream after
    that stream waits for the compute stream (the sources are produced there), marks the sources with
    `record_stream(side)` so their memory is not reused mid-copy, and records an event. `start` issues the
    host-to-device copies on the same stream after waiting on that event, into fresh device tensors
    allocated on the side stream, and records an event; the consumer's `PendingCopy.wait()` makes the
    compute stream wait on it. The compute stream never blocks on a device-to-host copy.

    On CPU (or any non-CUDA device) the tensors are simply kept (the store owns what it is given) and
    returned as they are: a synchronous, exact round trip.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._buf: dict[str, Tensor] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._data: dict[str, Tensor] = {}
        self._ready: Any | None = None

    def put(self, tensors: dict[str, Tensor]) -> None:
        """Replace the stash content with `tensors` (all on `self.device`)."""
        if not self.cuda:
            self._data = dict(tensors)
            self._meta = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
            return
        side = transfer_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        meta = {}
        with torch.cuda.stream(side):
            for name, src in tensors.items():
                n = src.numel()
                buf = self._buf.get(name)
                if buf is None or buf.dtype != src.dtype or buf.numel() < n:
                    old = 0 if buf is None or buf.dtype != src.dtype else buf.numel()
                    buf = torch.empty(max(n, math.ceil(1.5 * old), 1), dtype=src.dtype, pin_memory=True)
                    self._buf[name] = buf
                buf[:n].view(src.shape).copy_(src, non_blocking=True)
                src.record_stream(side)
                meta[name] = (tuple(src.shape), src.dtype)
            ev = torch.cuda.Event()
            ev.record(side)
        self._meta = meta
        self._ready = ev

    def start(self) -> PendingCopy:
        """Begin bringing the content to the device; returns a handle whose `wait()` gives the tensors."""
        if not self.cuda:
            return PendingCopy(dict(self._data), None)
        side = transfer_stream(self.device)
        out = {}
        with torch.cuda.stream(side):
            if self._ready is not None:
                side.wait_event(self._ready)
            for name, (shape, dtype) in self._meta.items():
                n = math.prod(shape)
                dst = torch.empty(shape, dtype=dtype, device=self.device)
                dst.copy_(self._buf[name][:n].view(shape), non_blocking=True)
                out[name] = dst
            ev = torch.cuda.Event()
            ev.record(side)
        return PendingCopy(out, ev)

    def get(self) -> dict[str, Tensor]:
        """The content on the device, ready for the current stream."""
        return self.start().wait()

    def apply(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Apply a batch operation to every tensor (via the device on CUDA)."""
        self.put({k: fn(v) for k, v in self.get().items()})

    def nbytes(self) -> int:
        """Bytes of the content (not of the buffers' spare capacity)."""
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in self._meta.values())

    def allocated(self) -> int:
        """Bytes of the pinned buffers (CUDA) or of the content (CPU)."""
        if not self.cuda:
            return self.nbytes()
        return sum(b.numel() * b.element_size() for b in self._buf.values())


# ------------------------------------------------------------------------------------------------
# stores
# ------------------------------------------------------------------------------------------------
def _resolve_device(device: str | torch.device | None, who: str) -> torch.device | None:
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


def _check_device(want: torch.device | None, got: torch.device, who: str) -> None:
    if want is None:
        return
    if want.type != got.type or (want.index is not None and got.index is not None and want.index != got.index):
        raise KVComposeError(f"{who} was built for device {want} but the cache layer is on {got}")


def _bump(state: dict[str, Any]) -> None:
    state["version"] = next(_versions)


def _track(state: dict[str, Any], sizes: dict[str, int]) -> None:
    peak = state.setdefault("peak", {})
    for k, v in sizes.items():
        peak[k] = max(peak.get(k, 0), v)


class TierStore:
    """Base class for where non-kept tokens go (a tier of the memory hierarchy of "Not All Thoughts Need
    HBM"). State lives in the layer's cache state (`state` dict); tokens move as `TierTokens` bundles
    (`[B, H, N, D]` keys, `[B, H, N, Dv]` values, `[B, H, N]` positions / valid / block state).

    See the module docstring for the contract. Class attributes: `holds_tokens` (the store keeps tokens
    that attention must see), `budget_free` (the store derives the HBM budget, no token budget needed),
    `tier_names` (names reported by `nbytes`).
    """

    holds_tokens: bool = False
    budget_free: bool = False
    tier_names: tuple[str, ...] = ()

    def store(
        self,
        state: dict[str, Any],
        tokens: TierTokens,
        scores: Float[Tensor, "B H N"] | None,
        seen: int,
        kept: int = 0,
    ) -> None:
        """Replace the store's content with (a subset of) `tokens`, the candidates not kept in HBM.

        `scores` are the pipeline's scores of those tokens (higher = more worth keeping; None for
        score-free selectors); `seen` is the number of tokens the layer has seen; `kept` the number of
        candidates kept in HBM at this event (so the candidates numbered `tokens.n + kept`).
        """
        raise NotImplementedError  # pragma: no cover - abstract

    def fetch(self, state: dict[str, Any]) -> TierTokens | None:
        """Tokens held outside HBM for this layer, on the compute device, or None when there are none."""
        return None

    def start_fetch(self, state: dict[str, Any]) -> Any | None:
        """Begin an asynchronous fetch (an object with `wait() -> TierTokens | None`), or None if the store
        has nothing to overlap (then the prefetcher calls `fetch` when the layer needs it)."""
        return None

    def version(self, state: dict[str, Any]) -> int:
        """Changes whenever the content (which tokens, where) changes."""
        return int(state.get("version", 0))

    def write_state(self, state: dict[str, Any], name: str, values: Float[Tensor, "B H N"]) -> None:
        """Set token-aligned block state for the held tokens, in `fetch` order."""
        return None

    def nbytes(self, state: dict[str, Any]) -> dict[str, int]:
        """Bytes held per tier name (always reports 'host' and 'compressed', 0 when unused)."""
        return {"host": 0, "compressed": 0}

    def peak_bytes(self, layers: list) -> dict[str, int]:
        """Peak bytes per tier over the run, summed over layers (each layer's own peak)."""
        out = {"host": 0, "compressed": 0}
        for layer in layers:
            for k, v in layer.tier_state.get("peak", {}).items():
                out[k] = out.get(k, 0) + v
        return out

    def batch_apply(self, state: dict[str, Any], fn: Callable[[Tensor], Tensor]) -> None:
        """Reorder / select batch rows of the held tokens (`fn` acts on dim 0)."""
        return None

    def hbm_budget(self, seen: int, budget: int | None) -> int | None:
        """The HBM budget of a layer that has seen `seen` tokens (default: the cache's budget)."""
        return budget

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Evict(TierStore):
    """Plain eviction: non-kept tokens are freed (the last tier of "Not All Thoughts Need HBM", and every
    eviction method's only one). Holds nothing, so attention sees HBM tokens `[B, H, T, D]` only."""

    def store(self, state, tokens, scores, seen, kept=0) -> None:
        return None


class HostTier(TierStore):
    """Full-precision tokens in host memory, prefetched back before attention (bit-exact).

    The "DDR" tier of "Not All Thoughts Need HBM" (abstract only): a token in host memory contributes
    exactly what it would contribute from HBM. On CUDA the keys and values live in reusable pinned
    buffers and move on a side stream with events (`HostStash`); positions, padding flags and block state
    of the held tokens (4-8 bytes per token and head) stay on the device. On CPU the copies are plain and
    synchronous.

    Alone, `HostTier()` keeps every token the selector does not keep: nothing is ever evicted, HBM holds
    the budget, host memory holds the rest (use it with any pipeline: `with_tier(methods.vase(), HostTier())`).

    Args:
        device: the compute device whose tokens it holds (None: whatever device the layer is on). A CUDA
            device that does not exist raises `KVComposeError` at construction.

    Shapes: holds `[B, H, N, D]` keys and `[B, H, N, Dv]` values per layer.
    """

    holds_tokens = True
    tier_names = ("host",)

    def __init__(self, device: str | torch.device | None = None):
        self.device = _resolve_device(device, "HostTier")

    def store(self, state, tokens, scores, seen, kept=0) -> None:
        dev = tokens.keys.device
        _check_device(self.device, dev, "HostTier")
        stash = state.get("stash")
        if stash is None or stash.device != dev:
            stash = HostStash(dev)
            state["stash"] = stash
        stash.put({"keys": tokens.keys.contiguous(), "values": tokens.values.contiguous()})
        state["positions"], state["valid"] = tokens.positions, tokens.valid
        state["tstate"] = dict(tokens.state)
        state["n"] = tokens.n
        _bump(state)
        _track(state, {"host": stash.nbytes()})

    def _assemble(self, state, kv: dict[str, Tensor]) -> TierTokens:
        return TierTokens(kv["keys"], kv["values"], state["positions"], state["valid"], state["tstate"])

    def fetch(self, state) -> TierTokens | None:
        if not state.get("n"):
            return None
        return self._assemble(state, state["stash"].get())

    def start_fetch(self, state):
        if not state.get("n") or not state["stash"].cuda:
            return None
        return _PendingTier(self, state, state["stash"].start())

    def write_state(self, state, name, values) -> None:
        if state.get("n"):
            state["tstate"][name] = values

    def nbytes(self, state) -> dict[str, int]:
        return {"host": state["stash"].nbytes() if state.get("n") else 0, "compressed": 0}

    def batch_apply(self, state, fn) -> None:
        if not state.get("n"):
            return
        state["stash"].apply(fn)
        state["positions"], state["valid"] = fn(state["positions"]), fn(state["valid"])
        state["tstate"] = {k: fn(v) for k, v in state["tstate"].items()}
        _bump(state)

    def __repr__(self) -> str:
        return "HostTier()" if self.device is None else f"HostTier(device={str(self.device)!r})"


class _PendingTier:
    """A host-tier fetch in flight; `wait()` assembles the tokens once the copies are ordered before use."""

    def __init__(self, store: TierStore, state: dict[str, Any], pending: PendingCopy):
        self.store, self.state, self.pending = store, state, pending

    def wait(self) -> TierTokens | None:
        return self.store._assemble(self.state, self.pending.wait())


def quantization_error_bound(
    x: Float[Tensor, "*batch T D"], bits: int, group: int, axis: Literal["channel", "token"]
) -> Float[Tensor, "*batch T D"]:
    """Per-element bound on `|x - dequantize(quantize(x))|` for KIVI min/max group quantization.

    Each group of `group` tokens of one channel (`axis="channel"`, keys) or `group` channels of one token
    (`axis="token"`, values) is mapped to `2^bits` evenly spaced levels between its min and max, so the
    rounding error is at most half a step: `(max - min) / (2^bits - 1) / 2`. Float32 arithmetic adds a few
    ulps, and a half-precision output adds half an ulp of the value (not included here; see docs/tiers.md).
    """
    xf = x.float()
    t, d = xf.shape[-2], xf.shape[-1]
    qmax = float(2**bits - 1)
    if axis == "channel":
        ng = -(-t // group)
        pad = ng * group - t
        xp = torch.cat([xf, xf[..., -1:, :].expand(*xf.shape[:-2], pad, d)], -2) if pad else xf
        xp = xp.reshape(*xf.shape[:-2], ng, group, d)
        step = (xp.amax(-2) - xp.amin(-2)) / qmax
        return (step.repeat_interleave(group, -2)[..., :t, :] / 2)
    ng = -(-d // group)
    pad = ng * group - d
    xp = torch.cat([xf, xf[..., -1:].expand(*xf.shape[:-1], pad)], -1) if pad else xf
    xp = xp.reshape(*xf.shape[:-1], ng, group)
    step = (xp.amax(-1) - xp.amin(-1)) / qmax
    return step.repeat_interleave(group, -1)[..., :d] / 2


class CompressedTier(TierStore):
    """Tokens kept as int8 / int4 group-quantized copies, dequantized before attention.

    KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750):
    keys per channel (one min/max per channel and per group of `key_group` token slots, which tames
    outlier channels), values per token (one min/max per token and per group of `value_group` channels),
    via `kvcompose.kernels.quantize` / `dequantize` (Triton on CUDA). The compressed tier of "Not All
    Thoughts Need HBM" (abstract only: its quantization is not described; this is our choice).

    Layout: `S` quantized slots per row and head, `S` a multiple of `key_group`. At a compression event
    the tokens that were already compressed and stay compressed KEEP their codes (no re-quantization, so
    no drift); newcomers are quantized as a new group-aligned segment (the last group padded with copies
    of a newcomer, which never widen a group's range) appended to the slots; groups whose slots are all
    dead are dropped per row and head (an exact gather). Only if dead slots still pile up
    (`S > slack * N + 2 * key_group`) are the live tokens re-quantized from their dequantized values
    (counted in `state['requantized']`).

    Error: every element is within half a quantization step of its group, `(max - min) / (2^bits - 1) / 2`
    (`quantization_error_bound`), of the value it had when it entered the tier. A promoted token keeps its
    dequantized value; if it is compressed again it is quantized again.

    Args:
        bits: 8 or 4.
        key_group: token slots per key group (power of two, 2..1024); KIVI uses 32-128.
        value_group: channels per value group (power of two, 2..1024).
        location: "host" keeps the codes in host memory (pinned on CUDA, moved compressed, dequantized on
            the device: the hierarchy's order HBM -> host -> compressed); "device" keeps them on the compute
            device. On CPU both are the same memory.
        device: the compute device (None: the layer's device).
        slack: dead-slot tolerance before re-quantizing (see Layout).
        keep_codes: False re-quantizes every held token at every event (compact, but keys drift by up to a
            half-step per event when their group changes).

    Shapes: holds codes `[B, H, S, D]` (8 bits) or `[B, H, S, ceil(D/2)]` (4 bits), float32 key scales and
    zeros `[B, H, S / key_group, D]`, value codes `[B, H, S, Dv or ceil(Dv/2)]` with scales and zeros
    `[B, H, S, ceil(Dv / value_group)]`; fetch returns `[B, H, N, D]` dequantized, in position order.
    """

    holds_tokens = True
    tier_names = ("compressed",)

    def __init__(self, bits: int = 8, key_group: int = 32, value_group: int = 32,
                 location: str = "host", device: str | torch.device | None = None,
                 slack: float = 1.5, keep_codes: bool = True):
        if isinstance(bits, bool) or bits not in (4, 8):
            raise KVComposeError(f"CompressedTier: bits must be 4 or 8, got {bits!r}")
        for name, g in (("key_group", key_group), ("value_group", value_group)):
            if isinstance(g, bool) or not isinstance(g, int) or g < 2 or g > 1024 or g & (g - 1):
                raise KVComposeError(f"CompressedTier: {name} must be a power of two in [2, 1024], got {g!r}")
        if location not in ("host", "device"):
            raise KVComposeError(f"CompressedTier: location must be 'host' or 'device', got {location!r}")
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or slack < 1.0:
            raise KVComposeError(f"CompressedTier: slack must be >= 1, got {slack!r}")
        self.bits, self.key_group, self.value_group, self.location = bits, key_group, value_group, location
        self.slack, self.keep_codes = float(slack), bool(keep_codes)
        self.device = _resolve_device(device, "CompressedTier")

    # -- quantization ------------------------------------------------------------------------------
    def _quantize(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]:
        kq = quantize(keys.contiguous(), bits=self.bits, group=self.key_group, axis="channel")
        vq = quantize(values.contiguous(), bits=self.bits, group=self.value_group, axis="token")
        return {"k_codes": kq.codes, "k_scale": kq.scale, "k_zero": kq.zero,
                "v_codes": vq.codes, "v_scale": vq.scale, "v_zero": vq.zero}

    def _dequantize(self, state, parts: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        d, dv, dtype = state["dims"]
        b, h, s = parts["k_codes"].shape[:3]
        kq = QTensor(parts["k_codes"], parts["k_scale"], parts["k_zero"], self.bits, self.key_group, "channel",
                     (b, h, s, d), dtype)
        vq = QTensor(parts["v_codes"], parts["v_scale"], parts["v_zero"], self.bits, self.value_group, "token",
                     (b, h, s, dv), dtype)
        return dequantize(kq), dequantize(vq)

    def _parts(self, state) -> dict[str, Tensor]:
        return state["q"] if "q" in state else state["stash"].get()

    # -- slot bookkeeping ----------------------------------------------------------------------------
    @staticmethod
    def _take_slots(parts: dict[str, Tensor], sidx: Tensor, group: int) -> dict[str, Tensor]:
        """Keep whole key groups: `sidx` [B, H, S'] slot indices made of complete, aligned groups."""
        gidx = sidx[..., ::group] // group
        g = lambda x, i: x.gather(2, i[..., None].expand(*i.shape, x.shape[-1]))  # noqa: E731
        return {"k_codes": g(parts["k_codes"], sidx), "k_scale": g(parts["k_scale"], gidx),
                "k_zero": g(parts["k_zero"], gidx), "v_codes": g(parts["v_codes"], sidx),
                "v_scale": g(parts["v_scale"], sidx), "v_zero": g(parts["v_zero"], sidx)}

    def store(self, state, tokens, scores, seen, kept=0) -> None:
        dev = tokens.keys.device
        _check_device(self.device, dev, "CompressedTier")
        if tokens.n and bool((tokens.positions[..., 1:] <= tokens.positions[..., :-1]).any()):
            tokens = tokens.take(tokens.positions.argsort(dim=-1))
        G = self.key_group
        b, h, n = tokens.positions.shape
        ar = lambda k: torch.arange(k, device=dev)  # noqa: E731
        old = self._parts(state) if state.get("n") and self.keep_codes else None
        parts: dict[str, Tensor] | None = None
        slot_pos = alive = None
        covered = torch.zeros(b, h, n + 1, dtype=torch.bool, device=dev)
        if old is not None and n:
            # slots whose token stays compressed keep their codes
            sp, al = state["slot_pos"], state["alive"]
            idx = torch.searchsorted(tokens.positions.contiguous(), sp.contiguous()).clamp(max=n - 1)
            hit = al & (tokens.positions.gather(-1, idx) == sp)
            covered.scatter_(-1, idx.masked_fill(~hit, n), True)
            parts, slot_pos, alive = old, sp, hit
        newcomer = ~covered[..., :n]
        c = newcomer.sum(-1)
        m = int(c.max()) if n else 0
        if m:
            m_pad = -(-m // G) * G
            first = torch.where(newcomer, ar(n), n + ar(n)).argsort(dim=-1)[..., :m]  # newcomers first, in order
            last = first.gather(-1, (c - 1).clamp(min=0)[..., None])
            src = torch.cat([first, last.expand(b, h, m_pad - m)], dim=-1)
            src = torch.where(ar(m_pad) < c[..., None], src, last)
            new = self._quantize(_gather_slots(tokens.keys, src), _gather_slots(tokens.values, src))
            new_pos, new_alive = tokens.positions.gather(-1, src), ar(m_pad).expand(b, h, m_pad) < c[..., None]
            if parts is None:
                parts, slot_pos, alive = new, new_pos, new_alive
            else:
                parts = {k: torch.cat([parts[k], new[k]], dim=2) for k in parts}
                slot_pos, alive = torch.cat([slot_pos, new_pos], -1), torch.cat([alive, new_alive], -1)
        if parts is None or n == 0:
            for k in ("q", "stash", "slot_pos", "alive", "order"):
                state.pop(k, None)
            state.update(n=0, positions=tokens.positions, valid=tokens.valid, tstate=dict(tokens.state))
            _bump(state)
            return
        # drop groups with no live slot (per row and head: an exact gather of whole groups)
        s = alive.shape[-1]
        live_g = alive.view(b, h, s // G, G).any(-1)
        n_live = int(live_g.sum(-1).max())
        if n_live < s // G:
            gidx = torch.sort((~live_g).to(torch.int8), dim=-1, stable=True).indices[..., :n_live].sort(-1).values
            sidx = (gidx[..., None] * G + ar(G)).reshape(b, h, n_live * G)
            parts = self._take_slots(parts, sidx, G)
            slot_pos, alive = slot_pos.gather(-1, sidx), alive.gather(-1, sidx)
        state["dims"] = (tokens.keys.shape[-1], tokens.values.shape[-1], tokens.keys.dtype)
        if alive.shape[-1] > self.slack * n + 2 * G:
            # too many dead slots: re-quantize the live tokens (their current, dequantized values)
            order = self._order(tokens.positions, slot_pos, alive)
            k, v = self._dequantize(state, parts)
            n_pad = -(-n // G) * G
            src = torch.cat([ar(n).expand(b, h, n), torch.full((b, h, n_pad - n), n - 1, device=dev)], -1)
            sl = order.gather(-1, src)
            parts = self._quantize(_gather_slots(k, sl), _gather_slots(v, sl))
            slot_pos, alive = tokens.positions.gather(-1, src), ar(n_pad).expand(b, h, n_pad) < n
            state["requantized"] = state.get("requantized", 0) + 1
        state["slot_pos"], state["alive"] = slot_pos, alive
        state["order"] = self._order(tokens.positions, slot_pos, alive)
        state.update(n=n, positions=tokens.positions, valid=tokens.valid, tstate=dict(tokens.state))
        if self.location == "host" and dev.type == "cuda":
            stash = state.get("stash")
            if stash is None or stash.device != dev:
                stash = HostStash(dev)
                state["stash"] = stash
            stash.put(parts)
            state.pop("q", None)
        else:
            state["q"] = parts
            state.pop("stash", None)
        _bump(state)
        _track(state, {"compressed": self._nbytes(state)})

    @staticmethod
    def _order(positions: Tensor, slot_pos: Tensor, alive: Tensor) -> Tensor:
        """`[B, H, N]`: the slot of each held token (tokens in position order)."""
        b, h, n = positions.shape
        tok = torch.searchsorted(positions.contiguous(), slot_pos.contiguous()).clamp(max=n - 1)
        out = torch.zeros(b, h, n + 1, dtype=torch.long, device=positions.device)
        slots = torch.arange(slot_pos.shape[-1], device=positions.device).expand_as(slot_pos)
        out.scatter_(-1, tok.masked_fill(~alive, n), slots)
        return out[..., :n]

    @staticmethod
    def _nbytes(state) -> int:
        if not state.get("n"):
            return 0
        if "q" in state:
            return sum(t.numel() * t.element_size() for t in state["q"].values())
        return state["stash"].nbytes()

    def _assemble(self, state, parts: dict[str, Tensor]) -> TierTokens:
        k, v = self._dequantize(state, parts)
        order = state["order"]
        return TierTokens(_gather_slots(k, order), _gather_slots(v, order), state["positions"], state["valid"],
                          state["tstate"])

    def fetch(self, state) -> TierTokens | None:
        if not state.get("n"):
            return None
        return self._assemble(state, self._parts(state))

    def start_fetch(self, state):
        if not state.get("n") or "stash" not in state:
            return None
        return _PendingTier(self, state, state["stash"].start())

    def write_state(self, state, name, values) -> None:
        if state.get("n"):
            state["tstate"][name] = values

    def nbytes(self, state) -> dict[str, int]:
        return {"host": 0, "compressed": self._nbytes(state)}

    def batch_apply(self, state, fn) -> None:
        if not state.get("n"):
            return
        # Quantization groups never span rows, so selecting / reordering rows of the codes is exact.
        if "q" in state:
            state["q"] = {k: fn(v) for k, v in state["q"].items()}
        else:
            state["stash"].apply(fn)
        for k in ("positions", "valid", "slot_pos", "alive", "order"):
            state[k] = fn(state[k])
        state["tstate"] = {k: fn(v) for k, v in state["tstate"].items()}
        _bump(state)

    def __repr__(self) -> str:
        return f"CompressedTier(bits={self.bits}, key_group={self.key_group}, value_group={self.value_group})"


def _gather_slots(x: Tensor, idx: Tensor) -> Tensor:
    return take_tokens(x, idx)


def _check_ratio(x: float, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise KVComposeError(f"{name} must be a number in [0, 1], got {x!r}")
    if not 0.0 <= x <= 1.0:
        raise KVComposeError(f"{name} must be in [0, 1], got {x}")
    return float(x)


class Hierarchy(TierStore):
    """The memory hierarchy of "Not All Thoughts Need HBM" (abstract only): HBM, host, compressed, evicted.

    Shares are of all tokens seen so far by the layer (`seen`, padding included), re-applied at every
    compression event: the pipeline keeps `seen - floor(host_ratio * seen) - floor(compressed_ratio * seen)
    - floor(evict_ratio * seen)` (about `hbm_ratio * seen`) tokens in HBM (this store is
    `budget_free`: it gives the cache that budget; with a cache budget too, HBM gets the smaller of the
    two); the other candidates, ranked by the pipeline's scores (padding last, ties to the older token),
    fill host memory, then the compressed tier (`floor(compressed_ratio * seen)` tokens), and the last
    `floor(evict_ratio * seen)` are evicted. Host gets the rest: `host_ratio = 1 - hbm - compressed - evict`.
    The number evicted depends on `evict_ratio` and `seen` only, and with one total order of the tokens
    (e.g. `methods.memory_hierarchy`) so does the evicted set: HBM and host shares then change where a token
    lives, never what attention computes. Without scores (score-free selectors), newer tokens rank higher.

    Args:
        hbm_ratio: share of seen tokens held in HBM (in (0, 1]).
        compressed_ratio: share held quantized.
        evict_ratio: share evicted.
        host: the host store (default `HostTier()`); compressed: the compressed store (default
            `CompressedTier(bits=8)`).

    Raises `KVComposeError` for a negative ratio, hbm_ratio 0, or ratios that sum to more than 1.
    """

    holds_tokens = True
    budget_free = True
    tier_names = ("host", "compressed")

    def __init__(self, hbm_ratio: int | float, compressed_ratio: int | float = 0.0, evict_ratio: int | float = 0.0, *,
                 host: HostTier | None = None, compressed: CompressedTier | None = None):
        self.hbm_ratio = _check_ratio(hbm_ratio, "hbm_ratio")
        self.compressed_ratio = _check_ratio(compressed_ratio, "compressed_ratio")
        self.evict_ratio = _check_ratio(evict_ratio, "evict_ratio")
        if self.hbm_ratio <= 0.0:
            raise KVComposeError("hbm_ratio must be > 0 (attention needs the newest token in HBM)")
        total = self.hbm_ratio + self.compressed_ratio + self.evict_ratio
        if total > 1.0 + 1e-9:
            raise KVComposeError(
                f"hbm_ratio + compressed_ratio + evict_ratio must sum to at most 1 (host memory takes the rest), "
                f"got {self.hbm_ratio} + {self.compressed_ratio} + {self.evict_ratio} = {total:g}"
            )
        self.host_ratio = max(0.0, 1.0 - total)
        if host is not None and not isinstance(host, HostTier):
            raise KVComposeError(f"host must be a HostTier, got {type(host).__name__}")
        if compressed is not None and not isinstance(compressed, CompressedTier):
            raise KVComposeError(f"compressed must be a CompressedTier, got {type(compressed).__name__}")
        self.host = host if host is not None else HostTier()
        self.compressed = compressed if compressed is not None else CompressedTier(bits=8)

    @staticmethod
    def _count(ratio: float, seen: int) -> int:
        return int(math.floor(ratio * seen + 1e-9))

    def hbm_budget(self, seen: int, budget: int | None) -> int:
        """`seen` minus the floored host, compressed and evicted counts (so `hbm_ratio = 1 - evict_ratio`
        leaves host memory empty), at least 1; at most `budget` when the cache has one."""
        rest = sum(self._count(r, seen) for r in (self.host_ratio, self.compressed_ratio, self.evict_ratio))
        k = max(1, seen - rest)
        return k if budget is None else max(1, min(budget, k))

    def split(self, n_candidates: int, n_kept: int, seen: int) -> tuple[int, int, int]:
        """`(host, compressed, evicted)` counts for the `n_candidates - n_kept` non-kept candidates."""
        rest = n_candidates - n_kept
        retain = max(0, min(n_candidates, seen - self._count(self.evict_ratio, seen)) - n_kept)
        n_comp = min(self._count(self.compressed_ratio, seen), retain)
        n_host = retain - n_comp
        return n_host, n_comp, rest - n_host - n_comp

    def store(self, state, tokens, scores, seen, kept=0) -> None:
        hs, cs = state.setdefault("host", {}), state.setdefault("compressed", {})
        n = tokens.n
        n_host, n_comp, _ = self.split(n + kept, kept, seen)
        b, h = tokens.positions.shape[:2]
        dev = tokens.positions.device
        if n:
            key = scores.float() if scores is not None else tokens.positions.float()
            key = torch.nan_to_num(key, nan=-3e38).masked_fill(~tokens.valid, float("-inf"))
            # tokens arrive in position order: a stable descending sort breaks ties towards the older token
            rank = torch.sort(key, dim=-1, descending=True, stable=True).indices
        else:
            rank = torch.empty(b, h, 0, dtype=torch.long, device=dev)
        host_idx = rank[..., :n_host].sort(dim=-1).values
        comp_idx = rank[..., n_host : n_host + n_comp].sort(dim=-1).values
        self.host.store(hs, tokens.take(host_idx), None, seen, kept)
        self.compressed.store(cs, tokens.take(comp_idx), None, seen, kept)
        state["n_host"], state["n_comp"] = n_host, n_comp
        _bump(state)
        _track(state, {"host": self.host.nbytes(hs)["host"], "compressed": self.compressed.nbytes(cs)["compressed"]})

    def _parts(self, state) -> list[tuple[TierStore, dict[str, Any]]]:
        return [(self.host, state.get("host", {})), (self.compressed, state.get("compressed", {}))]

    def fetch(self, state) -> TierTokens | None:
        got = [t for s, st in self._parts(state) if (t := s.fetch(st)) is not None]
        if not got:
            return None
        return got[0] if len(got) == 1 else TierTokens.cat(got)

    def start_fetch(self, state):
        parts = self._parts(state)
        pend = [s.start_fetch(st) for s, st in parts]
        if all(p is None for p in pend):
            return None
        return _PendingHierarchy([(s, st, p) for (s, st), p in zip(parts, pend)])

    def write_state(self, state, name, values) -> None:
        nh = int(state.get("n_host", 0))
        self.host.write_state(state.get("host", {}), name, values[..., :nh])
        self.compressed.write_state(state.get("compressed", {}), name, values[..., nh:])

    def nbytes(self, state) -> dict[str, int]:
        return {"host": self.host.nbytes(state.get("host", {}))["host"],
                "compressed": self.compressed.nbytes(state.get("compressed", {}))["compressed"]}

    def batch_apply(self, state, fn) -> None:
        for s, st in self._parts(state):
            s.batch_apply(st, fn)
        _bump(state)

    def __repr__(self) -> str:
        return (f"Hierarchy(hbm_ratio={self.hbm_ratio:g}, compressed_ratio={self.compressed_ratio:g}, "
                f"evict_ratio={self.evict_ratio:g}, bits={self.compressed.bits})")


class _PendingHierarchy:
    def __init__(self, parts):
        self.parts = parts

    def wait(self) -> TierTokens | None:
        got = []
        for s, st, p in self.parts:
            t = p.wait() if p is not None else s.fetch(st)
            if t is not None:
                got.append(t)
        if not got:
            return None
        return got[0] if len(got) == 1 else TierTokens.cat(got)
