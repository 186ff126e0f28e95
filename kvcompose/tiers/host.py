"""`HostTier`: full-precision tokens in host memory, prefetched back before attention (bit-exact)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from .base import TierStore, TierTokens, bump, check_device, map_host_rows, mirror, resolve_device, track
from .transfer import HostStash, PendingCopy

__all__ = ["HostTier"]


class HostTier(TierStore):
    """Full-precision tokens in host memory, prefetched back before attention (bit-exact).

    The "DDR" tier of "Not All Thoughts Need HBM" (abstract only): a token in host memory contributes
    exactly what it would contribute from HBM. On CUDA the keys and values live in reusable pinned buffers
    and move on a side stream with events (`HostStash`); positions, padding flags and block state of the
    held tokens (4-8 bytes per token and head) stay on the device. On CPU the store keeps its own copy.

    Alone, `HostTier()` keeps every token the selector does not keep: nothing is ever evicted, HBM holds the
    budget, host memory holds the rest (use it with any pipeline: `with_tier(methods.vase(), HostTier())`).

    Args:
        device: the compute device whose tokens it holds (None: whatever device the layer is on). A CUDA
            device that does not exist raises `KVComposeError` at construction.
        copy_thread: on CPU only, bring the tokens back with a real copy on a background thread (a stand-in
            for the CUDA transfer stream, to measure what the layer-ahead prefetch hides without a GPU). By
            default a CPU tier hands out its own copy and nothing moves.

    Shapes: holds `[B, H, N, D]` keys and `[B, H, N, Dv]` values per layer (ragged heads padded to N).
    """

    holds_tokens = True
    tier_names = ("host",)

    def __init__(self, device: str | torch.device | None = None, copy_thread: bool = False):
        self.device = resolve_device(device, "HostTier")
        self.copy_thread = bool(copy_thread)

    def retained(self, candidates: Int[Tensor, "B H"], kept: Int[Tensor, "B H"], seen: int | Int[Tensor, "B 1"],
                 protected: Int[Tensor, "B H"] | None = None) -> Int[Tensor, "B H"]:
        return (candidates - kept).clamp(min=0)

    def store(self, state, tokens, seen, kept, protected=None):
        dev = tokens.keys.device
        check_device(self.device, dev, "HostTier")
        state = dict(state)
        tokens = tokens.sorted()
        stash = state.get("stash")
        if stash is None or stash.device != dev:
            stash = HostStash(dev, copy_thread=self.copy_thread)
        stash.put({"keys": tokens.keys.contiguous(), "values": tokens.values.contiguous()})
        state.update(stash=stash, positions=tokens.positions, valid=tokens.valid, channels=tokens.channels,
                     n=tokens.n)
        mirror(state, tokens.positions, tokens.valid, tokens.counts, tokens.padded)
        bump(state)
        track(state, {"host": stash.nbytes()})
        return state

    def _assemble(self, state: dict[str, Any], kv: dict[str, Tensor]) -> TierTokens:
        return TierTokens(kv["keys"], kv["values"], state["positions"], state["valid"], state["channels"])

    def fetch(self, state):
        if not state.get("n"):
            return None
        return self._assemble(state, state["stash"].get())

    def start_fetch(self, state):
        if not state.get("n") or not state["stash"].asynchronous:
            return None
        return _PendingTier(self, state, state["stash"].start())

    def write_channels(self, state, channels):
        if not state.get("n"):
            return state
        return {**state, "channels": channels}

    def nbytes(self, state) -> dict[str, int]:
        return {"host": state["stash"].nbytes() if state.get("n") else 0, "compressed": 0}

    def map_rows(self, state, fn, batch):
        if not state.get("n"):
            return state
        state = dict(state)
        stash = HostStash(state["stash"].device, copy_thread=self.copy_thread)
        stash.put({k: fn(v) for k, v in state["stash"].get().items()})
        state.update(stash=stash, positions=fn(state["positions"]), valid=fn(state["valid"]),
                     channels=fn(state["channels"]), counts=map_host_rows(state.get("counts"), fn))
        bump(state)
        return state

    def __repr__(self) -> str:
        args = [] if self.device is None else [f"device={str(self.device)!r}"]
        if self.copy_thread:
            args.append("copy_thread=True")
        return f"HostTier({', '.join(args)})"


class _PendingTier:
    """A tier fetch in flight; `wait()` assembles the tokens once the copies are ordered before use."""

    def __init__(self, store: Any, state: dict[str, Any], pending: PendingCopy):
        self.store, self.state, self.pending = store, state, pending

    def wait(self) -> TierTokens | None:
        return self.store._assemble(self.state, self.pending.wait())
