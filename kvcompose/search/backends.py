"""Where each search branch's KV lives: a `Backend` holds one handle per node; `SharedKV` keeps every branch
in one `BranchCache` (shared prefixes stored once, ArborKV-style), `CopiedKV` is the naive baseline (one
`DynamicCache` per branch, a deep copy at every fork)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..view import KVComposeError

__all__ = ["Backend", "SharedKV", "CopiedKV"]


class Backend:
    """Holds the KV of every search node. Handles are opaque; one is live per node until dropped.

    Implementations: `SharedKV` (ArborKV-style branch-aware cache, our design) and `CopiedKV` (baseline).
    """

    def start(self, model, prompt: Int[Tensor, "1 L"]) -> Any:
        """Prefill the prompt (all but its last token, which the first step feeds) and return the root's handle."""
        raise NotImplementedError  # pragma: no cover - abstract

    def fork(self, handle: Any) -> Any:
        """A new handle whose KV equals `handle`'s."""
        raise NotImplementedError  # pragma: no cover - abstract

    def cache(self, handle: Any):
        """The transformers `Cache` to decode `handle`'s branch with (makes it the active branch)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def drop(self, handle: Any) -> None:
        """Free what only `handle` held."""
        raise NotImplementedError  # pragma: no cover - abstract

    def after_step(self) -> None:
        """Called after each step (memory bookkeeping)."""

    def set_value(self, handle: Any, value: float) -> None:
        """The search's value estimate of a handle's path (called after each step; default: ignored)."""

    def memory(self) -> dict[str, int]:
        """Bytes: at least 'peak_device' (peak KV bytes on the compute device) and 'device' (now)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def close(self) -> None:
        """Release everything."""


class SharedKV(Backend):
    """Branches in one `BranchCache` (shared prefixes stored once; ArborKV-style tree-aware compression).

    ArborKV (abstract only): the active path gets budget priority, inactive subtrees keep a subset of their
    tokens, revisits rehydrate lazily. The mechanism (segment tree, compression of the lowest-value inactive
    nodes first, host tier, recomputation or resumption from the kept subset) is ours; see `kvcompose.branch`.
    Handles are `BranchCache` branch ids; the search's path values reach the cache through `set_value`.

    Args:
        **cache_kwargs: passed to `BranchCache` (budget, keep, min_keep, scorer, tier, rehydrate, priority,
            active_budget, host_limit, seed).
    """

    def __init__(self, **cache_kwargs):
        self.cache_kwargs = cache_kwargs
        self.branch_cache = None
        self._root_used = False

    def start(self, model, prompt):
        from ..branch import BranchCache

        self.close()
        self.branch_cache = BranchCache(model, **self.cache_kwargs)
        if prompt.shape[1] > 1:
            with torch.no_grad():
                model(input_ids=prompt[:, :-1], past_key_values=self.branch_cache, use_cache=True)
        return 0

    def fork(self, handle):
        return self.branch_cache.fork(handle)

    def cache(self, handle):
        self.branch_cache.switch(handle)
        return self.branch_cache

    def set_value(self, handle, value):
        if math.isfinite(value) or value == -math.inf:
            self.branch_cache.set_value(handle, value)

    def drop(self, handle):
        c = self.branch_cache
        if handle == c.active:  # the active branch cannot be dropped: park on another live branch first
            others = [b for b in c.branches if b != handle]
            if not others:
                return
            c.switch(others[0])
        c.drop(handle)

    def memory(self):
        m = self.branch_cache.memory()
        return {
            "device": m.device, "held": m.held, "host": m.host, "peak_device": m.peak_device,
            "peak_held": m.peak_held, "peak_host": m.peak_host, "peak_total": m.peak_total,
            "unique_tokens": m.unique_tokens, "copy_tokens": m.copy_tokens,
            "compressions": self.branch_cache.compressions,
            "rehydrated_host": self.branch_cache.rehydrations["host"],
            "recomputed": self.branch_cache.rehydrations["recomputed"],
            "recomputed_tokens": self.branch_cache.rehydrations["recomputed_tokens"],
            "resumed": self.branch_cache.rehydrations["resumed"],
        }

    def close(self):
        if self.branch_cache is not None:
            self.branch_cache.close()
            self.branch_cache = None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.cache_kwargs.items())
        return f"SharedKV({args})"


def _cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


class CopiedKV(Backend):
    """The naive baseline: one `DynamicCache` per branch, a deep copy of the parent's at every fork.

    This is what ArborKV's ~4x peak-memory reduction is measured against (per-branch full KV). Each
    branch holds `[1, H, L, D]` keys and values per layer for its whole path `L`.

    Args:
        attn_implementation: attention implementation to set on the model at `start` (e.g. "sdpa", stock
            transformers); None leaves the model as it is.
    """

    def __init__(self, attn_implementation: str | None = "sdpa"):
        self.attn_implementation = attn_implementation
        self.caches: dict[int, Any] = {}
        self._next = 0
        self._peak = 0

    def start(self, model, prompt):
        from transformers import DynamicCache

        if self.attn_implementation is not None and model.config._attn_implementation != self.attn_implementation:
            model.set_attn_implementation(self.attn_implementation)
        self.caches, self._next, self._peak = {}, 0, 0
        cache = DynamicCache(config=model.config)
        if prompt.shape[1] > 1:
            with torch.no_grad():
                model(input_ids=prompt[:, :-1], past_key_values=cache, use_cache=True)
        return self._add(cache)

    def _add(self, cache) -> int:
        h = self._next
        self._next += 1
        self.caches[h] = cache
        self.after_step()
        return h

    def fork(self, handle):
        if handle not in self.caches:
            raise KVComposeError(f"CopiedKV: no live branch {handle}")
        return self._add(copy.deepcopy(self.caches[handle]))

    def cache(self, handle):
        if handle not in self.caches:
            raise KVComposeError(f"CopiedKV: no live branch {handle}")
        return self.caches[handle]

    def drop(self, handle):
        self.caches.pop(handle, None)

    def _bytes(self) -> int:
        return sum(_cache_bytes(c) for c in self.caches.values())

    def after_step(self) -> None:
        self._peak = max(self._peak, self._bytes())

    def memory(self):
        now = self._bytes()
        return {"device": now, "held": now, "host": 0, "peak_device": self._peak, "peak_held": self._peak,
                "peak_host": 0, "peak_total": self._peak}

    def close(self):
        self.caches = {}

    def __repr__(self) -> str:
        return f"CopiedKV(attn_implementation={self.attn_implementation!r})"
