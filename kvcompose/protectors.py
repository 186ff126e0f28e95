"""Protectors: `LayerView -> Bool[B, H, T]`, True = the token must stay in HBM.

Protected tokens count inside the budget. Each protector states an upper bound on how many tokens it
protects (`max_count(budget)`), so a `Pipeline` can refuse, before any decoding, a set of protectors
that could not fit. `ProtectPrompt` is adaptive by design: it protects the prompt only up to the room the
other protectors leave (`room`), keeping the first `sinks` and the newest prompt tokens when the prompt is
longer than that room, so protection always leaves space for recent tokens; its first `sinks` are a fixed
count like the others (they are kept whatever room is left).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from .block import Block, accepts, with_state
from .kernels import value_magnitude
from .kernels.ref import top_last
from .view import KVComposeError, LayerView, warn_unused

__all__ = ["Protector", "ProtectPrompt", "ProtectSinks", "ProtectRecent", "ProtectValueNorm", "resolve_count"]


def resolve_count(n: int | float, budget: int) -> int:
    """An absolute count (int) or a share of the budget (float in (0, 1])."""
    if isinstance(n, float):
        return int(n * budget)
    return int(n)


def _check_count(n: int | float, name: str) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        raise KVComposeError(f"{name}: count must be an int or a float share of the budget, got {n!r}")
    if isinstance(n, float) and not 0.0 < n <= 1.0:
        raise KVComposeError(f"{name}: a float count is a share of the budget and must be in (0, 1], got {n}")
    if isinstance(n, int) and n < 0:
        raise KVComposeError(f"{name}: count must be >= 0, got {n}")


def _rank_mask(order_key: Tensor, count: int, eligible: Bool[Tensor, "B H T"]) -> Bool[Tensor, "B H T"]:
    """True for the `count` eligible tokens with the largest `order_key` in each (row, head)."""
    t = order_key.shape[-1]
    count = min(count, t)
    if count <= 0:
        return torch.zeros_like(eligible)
    key = order_key.float().masked_fill(~eligible, float("-inf"))
    idx = top_last(key, count)  # ties: the newest, whatever the row's padded width
    out = torch.zeros_like(eligible)
    out.scatter_(-1, idx, True)
    return out & eligible


class Protector(Block):
    """Base class. `__call__(view, budget, room)` returns the keep mask; `max_count(budget)` bounds its size.

    `protect(view, budget, room)` may take a `state` (its layer state, from `init`) and return `(mask,
    new_state)` (optax's shape, as an Allocator or a Merger). `fills_room = True` marks a protector that
    takes the room the others leave (`ProtectPrompt`): the pipeline runs it after the others, with that room,
    and accepts at most one."""

    _hook = "protect(view, budget, room) and max_count(budget)"

    fills_room: bool = False

    def max_count(self, budget: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def prefix_count(self, budget: int) -> int:
        """How many of its `max_count` tokens are the first valid tokens of a row (sinks): protectors of a prefix
        overlap, so a pipeline counts only the longest prefix once (`Pipeline.fixed_protection`)."""
        return 0

    def protect(self, view: LayerView, budget: int, room: int) -> Bool[Tensor, "B H T"]:  # pragma: no cover
        raise NotImplementedError

    def apply(self, view: LayerView, budget: int, room: int | None = None, state: Any = None
              ) -> tuple[Bool[Tensor, "B H T"], Any]:
        """`(mask, new_state)`: the one call shape of every leaf role (the pipeline calls this)."""
        room = budget if room is None else room
        if accepts(type(self).protect, "state"):
            out = with_state(self.protect(view, budget, room, state=state), state)
        else:
            out = (self.protect(view, budget, room), state)
        mask, new = out
        if not isinstance(mask, Tensor) or mask.shape != view.valid.shape or mask.dtype != torch.bool:
            raise KVComposeError(f"{type(self).__name__} must return a bool mask of shape {tuple(view.valid.shape)}")
        return mask & view.valid, new

    def __call__(self, view: LayerView, budget: int, room: int | None = None) -> Bool[Tensor, "B H T"]:
        return self.apply(view, budget, room)[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class ProtectSinks(Protector):
    """Keep the first `n` tokens of the sequence (attention sinks).

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024 (arXiv 2309.17453):
    4 sinks. With left padding, the sinks are the first `n` *valid* tokens of each row.
    """

    def __init__(self, n: int = 4):
        _check_count(n, "ProtectSinks")
        self.n = n

    def max_count(self, budget: int) -> int:
        return resolve_count(self.n, budget)

    def prefix_count(self, budget: int) -> int:
        return self.max_count(budget)

    def protect(self, view, budget, room):
        return _rank_mask(-view.positions, self.max_count(budget), view.valid)


class ProtectRecent(Protector):
    """Keep the newest `n` tokens (int) or a share of the budget (float); every reference counts this
    recent window inside the budget (R-KV 8, SnapKV 32, VaSE / Random Attention 64)."""

    def __init__(self, n: int | float = 64):
        _check_count(n, "ProtectRecent")
        self.n = n

    def max_count(self, budget: int) -> int:
        return resolve_count(self.n, budget)

    def protect(self, view, budget, room):
        return _rank_mask(view.positions, self.max_count(budget), view.valid)


class ProtectPrompt(Protector):
    """Keep the prompt (the tokens of the first forward call), inside the budget.

    Random Attention (SalesforceAIResearch/Random-Attention, `random_pp`) keeps the prompt, up to K-1
    tokens (K = budget - recent window), and finds the prompt is the fragile part of a reasoning trace. The
    prompt is protected only up to the room the other protectors of the pipeline leave (`room`, minus
    `leave`). A longer prompt keeps, with `keep="first"`, its first `room - leave` tokens (the reference's
    rule: `leave=1` leaves at least one slot to the random draw), or, with `keep="ends"` (default), its first
    `sinks` tokens and its newest ones, since the question usually ends the prompt. The first `sinks` are
    kept whatever room the other protectors leave: they count in `max_count`, so a budget that cannot hold
    them next to the other protectors is refused when the cache is built.

    Args:
        limit: at most this many prompt tokens (int) or this share of the budget (float); None = the room.
        sinks: tokens at the start of the prompt kept first when the prompt does not fit (`keep="ends"`).
        leave: slots left free for non-protected tokens when the prompt is longer than the room.
        keep: "ends" or "first" (which prompt tokens a prompt longer than the room keeps).
    """

    fills_room = True  # the pipeline hands it the room the other protectors leave

    def __init__(self, limit: int | float | None = None, sinks: int = 4, leave: int = 0,
                 keep: Literal["ends", "first"] = "ends"):
        if limit is not None:
            _check_count(limit, "ProtectPrompt")
        if sinks < 0 or leave < 0:
            raise KVComposeError("ProtectPrompt: sinks and leave must be >= 0")
        if keep not in ("ends", "first"):
            raise KVComposeError(f"ProtectPrompt: keep must be 'ends' or 'first', got {keep!r}")
        if keep == "first" and sinks != 4:
            warn_unused(f"ProtectPrompt(sinks={sinks})", "keep='first' keeps the first tokens of a long prompt, not "
                        "its ends (sinks applies to keep='ends')")
        self.limit, self.sinks, self.leave, self.keep = limit, sinks, leave, keep

    def max_count(self, budget: int) -> int:
        """The tokens it always keeps: the first `sinks` of a prompt that does not fit (`keep="ends"`); the rest
        of the prompt is adaptive and fills only the room the other protectors leave (see `protect`)."""
        if self.keep != "ends":
            return 0
        return self.sinks if self.limit is None else min(self.sinks, resolve_count(self.limit, budget))

    def prefix_count(self, budget: int) -> int:
        return self.max_count(budget)  # the prompt's first tokens are the row's first valid tokens

    def protect(self, view, budget, room):
        # the room left, but never less than the sinks it promises (counted in `max_count`, so a pipeline that
        # validates its budget has room for them, and a tier that holds tokens keeps the overflow)
        cap = max(room - self.leave, self.max_count(budget), 0)
        if self.limit is not None:
            cap = min(cap, resolve_count(self.limit, budget))
        prompt = view.is_prompt & view.valid
        if view.prompt_length <= cap:  # decided on the host: no (row, head) holds more prompt tokens
            return prompt
        if self.keep == "first":
            return _rank_mask(-view.positions, cap, prompt)
        n_sinks = min(self.sinks, cap)
        first = _rank_mask(-view.positions, n_sinks, prompt)
        last = _rank_mask(view.positions, cap - n_sinks, prompt & ~first)
        return first | last


class ProtectValueNorm(Protector):
    """Keep the `k` tokens of largest value magnitude (VaSE: k = budget/4 by value range, the 4 sinks
    counted as infinitely large and so always inside the k). The sinks are a fixed count: when `k` resolves to
    fewer tokens than `sinks` (a small budget), `sinks` tokens are protected, so the constructor's budget check
    counts them and every sink is kept (before, `k = 1` kept one of the sinks, not necessarily the first).

    Args:
        k: count (int) or share of the budget (float, VaSE 0.25).
        kind: "range" (max - min over the head dim, VaSE) or "l2".
        sinks: first tokens treated as infinitely large (VaSE: 4).
        exclude_recent: newest tokens that are not candidates (VaSE protects among all but the newest 64,
            which are kept anyway).
    """

    def __init__(self, k: int | float = 0.25, kind: Literal["range", "l2"] = "range", sinks: int = 4,
                 exclude_recent: int = 0):
        _check_count(k, "ProtectValueNorm")
        if kind not in ("range", "l2"):
            raise KVComposeError(f"ProtectValueNorm: kind must be 'range' or 'l2', got {kind!r}")
        self.k, self.kind, self.sinks, self.exclude_recent = k, kind, sinks, exclude_recent

    def max_count(self, budget: int) -> int:
        return max(resolve_count(self.k, budget), self.sinks)

    def magnitudes(self, view: LayerView) -> tuple[Float[Tensor, "B H T"], Bool[Tensor, "B H T"]]:
        """`(magnitude of every slot, the first `sinks` real tokens at +inf; the candidate slots)`: real tokens
        older than the `exclude_recent` newest."""
        mag = value_magnitude(view.values, self.kind)
        valid = view.valid
        rank = torch.argsort(torch.argsort(view.positions.masked_fill(~valid, 2**62), dim=-1), dim=-1)
        mag = mag.masked_fill((rank < self.sinks) & valid, float("inf"))
        eligible = valid
        if self.exclude_recent:
            eligible = eligible & (view.positions < view.seen - self.exclude_recent)
        return mag, eligible

    def protect(self, view, budget, room):
        mag, eligible = self.magnitudes(view)
        return _rank_mask(mag, self.max_count(budget), eligible)
