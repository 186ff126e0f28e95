"""`Hierarchy`: the memory hierarchy of "Not All Thoughts Need HBM" (abstract only): HBM, host,
compressed, evicted, all by one ranking."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from ..block import require_role
from ..hostsync import host_of
from ..view import FAR_POSITION, KVComposeError
from .base import TierStore, TierTokens, bump, track
from .compressed import CompressedTier
from .host import HostTier

__all__ = ["Hierarchy", "floor_share", "check_ratio"]


def floor_share(ratio: float, seen: int | Int[Tensor, "*B"]) -> int | Int[Tensor, "*B"]:
    """`floor(ratio * seen)` (with a tolerance for binary fractions such as 0.1 * 30); elementwise for a tensor of
    per-row counts."""
    if isinstance(seen, Tensor):
        return torch.floor(ratio * seen.double() + 1e-9).long()
    return int((ratio * seen + 1e-9) // 1)


def _at_most(x: Tensor, cap: int | Tensor) -> Tensor:
    """`min(x, cap)` for an int cap (no device tensor made) or a per-row tensor cap."""
    return x.clamp(max=cap) if isinstance(cap, int) else torch.minimum(x, cap.to(x.device))


def check_ratio(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0 or x != x:
        raise KVComposeError(f"{name} must be a number in [0, 1], got {x!r}")
    return float(x)


def _slice(tokens: TierTokens, start: Int[Tensor, "B H"], count: Int[Tensor, "B H"],
           host_count: np.ndarray | None = None) -> TierTokens:
    """Per (row, head), the `count` tokens from slot `start` on; heads with fewer are padded (valid False,
    positions past every real one). `host_count`: `count` on the host (then no host sync); the slice's
    tokens are real, so it becomes the slice's `counts`."""
    b, h, n = tokens.positions.shape
    if host_count is not None:
        m = int(host_count.max()) if host_count.size and n else 0
    else:
        m = int(count.max()) if count.numel() and n else 0
    j = torch.arange(m, device=start.device)
    idx = (start[..., None] + j).clamp(max=max(n - 1, 0))
    out = tokens.take(idx)
    inside = j < count[..., None]
    full = bool((host_count == m).all()) if host_count is not None else bool(inside.all())
    if not full:
        pad_pos = torch.full_like(out.positions, FAR_POSITION) + j
        out = TierTokens(out.keys, out.values, torch.where(inside, out.positions, pad_pos), out.valid & inside,
                         out.channels)
    if host_count is not None:
        out.counts, out.padded = host_count.astype(np.int64), tokens.padded
    return out


class Hierarchy(TierStore):
    """The memory hierarchy of "Not All Thoughts Need HBM" (abstract only): HBM, host, compressed, evicted.

    HBM holds what the pipeline keeps (its allocator gives the budget; `SeenShare(hbm_ratio, ...)` holds a
    share of the tokens seen, as the paper does). The other candidates arrive in the pipeline's priority
    order and fill, in that order, host memory, then the compressed tier (`floor(compressed_ratio * seen)`
    tokens), and the last `floor(evict_ratio * seen)` of all candidates are evicted. Shares are of the tokens
    each row has seen so far (its left padding not counted, so a padded row of a batch keeps what the row alone
    keeps) and are re-applied at every compression event. The number
    evicted depends on `evict_ratio` and `seen` only, and with one ranking so does the evicted set: the HBM
    share changes where a token lives, never what attention computes (host tokens come back exact).

    Args:
        compressed_ratio: share held quantized; evict_ratio: share evicted (both of the tokens seen).
        host: the host store (default `HostTier()`); compressed: the compressed store (default
            `CompressedTier(bits=8)`).

    Raises `KVComposeError` for a ratio outside [0, 1] or ratios that sum to more than 1.
    """

    holds_tokens = True
    tier_names = ("host", "compressed")

    def __init__(self, compressed_ratio: int | float = 0.0, evict_ratio: int | float = 0.0, *,
                 host: HostTier | None = None, compressed: CompressedTier | None = None):
        self.compressed_ratio = check_ratio(compressed_ratio, "compressed_ratio")
        self.evict_ratio = check_ratio(evict_ratio, "evict_ratio")
        if self.compressed_ratio + self.evict_ratio > 1.0 + 1e-9:
            raise KVComposeError(f"compressed_ratio + evict_ratio must be at most 1, got "
                                 f"{self.compressed_ratio} + {self.evict_ratio}")
        if host is not None:
            require_role(host, HostTier, "Hierarchy(host=...)")
        if compressed is not None:
            require_role(compressed, CompressedTier, "Hierarchy(compressed=...)")
        self.host = host if host is not None else HostTier()
        self.compressed = compressed if compressed is not None else CompressedTier(bits=8)

    @property
    def evicts(self) -> bool:  # type: ignore[override]
        return self.evict_ratio > 0

    def retained(self, candidates: Int[Tensor, "B H"], kept: Int[Tensor, "B H"], seen: int | Int[Tensor, "B 1"],
                 protected: Int[Tensor, "B H"] | None = None) -> Int[Tensor, "B H"]:
        keep_total = seen - floor_share(self.evict_ratio, seen)
        out = (_at_most(candidates, keep_total) - kept).clamp(min=0)
        if protected is not None:  # protected tokens are never evicted: fewer go than the share asks
            out = torch.maximum(out, (protected - kept).clamp(min=0))
        return out

    def split(self, candidates: Int[Tensor, "B H"], kept: Int[Tensor, "B H"], seen: int | Int[Tensor, "B 1"],
              protected: Int[Tensor, "B H"] | None = None) -> tuple[Int[Tensor, "B H"], Int[Tensor, "B H"]]:
        """`(host, compressed)` counts of the non-kept candidates of each (row, head); the rest is evicted."""
        retain = self.retained(candidates, kept, seen, protected)
        n_comp = _at_most(retain, floor_share(self.compressed_ratio, seen))
        return retain - n_comp, n_comp

    def store(self, state, tokens, seen, kept, protected=None):
        state = dict(state)
        real = tokens.valid.sum(-1)  # the candidates' real tokens: left padding never counts in the shares
        n_host, n_comp = self.split(kept + real, kept, seen, protected)
        hh = hc = None
        hk, hp = host_of(kept), host_of(protected)
        bound = getattr(protected, "max_host", None) if hp is None else None
        if tokens.counts is not None and hk is not None and (protected is None or hp is not None or bound is not None):
            # the same split on the host, from the event's host copies (no host sync); with only a bound on
            # the protected counts, when the split is the same for none and for the bound
            cpu = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))  # noqa: E731
            cand, k = cpu(hk) + cpu(tokens.counts), cpu(hk)
            if protected is None or hp is not None:
                a, c = self.split(cand, k, seen, None if protected is None else cpu(hp))
            else:
                a, c = self.split(cand, k, seen, torch.zeros_like(k))
                a2, c2 = self.split(cand, k, seen, torch.full_like(k, bound))
                if not (torch.equal(a, a2) and torch.equal(c, c2)):
                    a = c = None
            if a is not None:
                hh, hc = a.numpy(), c.numpy()
        # padding slots come last in the priority order: when every real token is retained they stay too (as
        # HostTier keeps them), so a hierarchy that evicts nothing attends exactly the slots HBM alone would
        pad = torch.where(n_host + n_comp == real, (tokens.positions < FAR_POSITION).sum(-1) - real, 0)
        n_host, n_comp = n_host + torch.where(n_comp > 0, 0, pad), n_comp + torch.where(n_comp > 0, pad, 0)
        zero = torch.zeros_like(n_host)
        state["host"] = self.host.store(state.get("host", {}), _slice(tokens, zero, n_host, hh), seen, kept)
        state["compressed"] = self.compressed.store(state.get("compressed", {}),
                                                    _slice(tokens, n_host, n_comp, hc), seen, kept)
        bump(state)
        sizes = self.nbytes(state)
        track(state, sizes)
        return state

    def _parts(self, state) -> list[tuple[TierStore, dict[str, Any]]]:
        return [(self.host, state.get("host", {})), (self.compressed, state.get("compressed", {}))]

    def fetch(self, state):
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

    def counts(self, state):
        parts = [c for s, st in self._parts(state) if (c := s.counts(st)) is not None] if state else []
        return None if not parts else sum(parts[1:], parts[0])

    def padded(self, state) -> bool:
        return bool(state) and any(s.padded(st) for s, st in self._parts(state))

    def write_channels(self, state, channels):
        nh = int(state.get("host", {}).get("n", 0))
        return {**state, "host": self.host.write_channels(state.get("host", {}), channels[:, :, :nh]),
                "compressed": self.compressed.write_channels(state.get("compressed", {}), channels[:, :, nh:])}

    def nbytes(self, state) -> dict[str, int]:
        return {"host": self.host.nbytes(state.get("host", {}))["host"],
                "compressed": self.compressed.nbytes(state.get("compressed", {}))["compressed"]}

    def map_rows(self, state, fn, batch):
        if not state:
            return state
        state = {**state, "host": self.host.map_rows(state.get("host", {}), fn, batch),
                 "compressed": self.compressed.map_rows(state.get("compressed", {}), fn, batch)}
        bump(state)
        return state

    def __repr__(self) -> str:
        return (f"Hierarchy(compressed_ratio={self.compressed_ratio:g}, evict_ratio={self.evict_ratio:g}, "
                f"bits={self.compressed.bits})")


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
