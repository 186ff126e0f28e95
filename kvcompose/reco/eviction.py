"""ReCo step-attributed eviction: tokens carry the reasoning step they belong to, and a scorer ranks them by
their step's reward, so the tokens of high-reward steps are the first to go.

ReCo (arXiv "ReCo", reward-coordinated compression; abstract only, no reference code) claims that deleting
the tokens of high-reward steps beats deleting the same number of tokens at random. The blocks here are our
reading of that claim:

- `StepRewardScore(source)`: a `Scorer` with one token-state channel (the token's step index) and the
  `Observer` capability. Its `observe` writes the current step index into the channel of the new tokens
  and corrects the tokens of the step still open (the segmenter learns where a step ends a token late, and
  attributes a separator token to the step it opens); once a step is closed its tokens' ids never change.
  The step index and the rewards come from the ReCo reward tracker (`RewardTracker`), a reference to which
  the block holds: the tracker is the driver's state (fed by a logits processor), the per-token step ids
  are cache state (they live in the layer's token channel and follow their tokens through compaction,
  tiers and batch reordering).
- `Lexicographic(first, then)`: ranks tokens by one scorer and breaks its ties with another (here: the step
  reward first, the base method's score inside a step).
- `StepReplay`: the tracker's view of a fixed trace (steps and rewards computed once, from given
  distributions, revealed token by token), for teacher-forced evaluation.

The rule (`order="reward"`, ReCo): at a compression event, a generated token of a *completed* step `k`
of row `b` scores `-reward_b[k]` (higher score = kept first), so among completed steps the tokens of the
highest-reward step are deleted first. Prompt tokens and tokens of the step still being written have no
reward yet: they score `+2`, above every completed step. Controls: `order="inverse"` (`+reward`: the
lowest-reward steps go first) and `order="random"` (a fixed pseudo-random key per (row, step), the same at
every event and layer: whole steps go in a random order).
"""

from __future__ import annotations

import random
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..block import Block, require_role
from ..scorers import Scorer
from ..seeding import SEED_STRIDE  # a per (row, step) draw under the cache seed, not the per-layer rule
from ..view import FAR_POSITION, AttentionStep, KVComposeError, LayerView
from .tracker import RewardTracker

__all__ = ["StepSource", "StepRewardScore", "Lexicographic", "StepReplay", "UNREWARDED"]

UNREWARDED = 2.0
"""Score of prompt tokens and of tokens of the step in progress (rewards lie in [0, 1], so completed steps
score in [-1, 1]): they are ranked above every completed step."""

Order = Literal["reward", "inverse", "random"]


@runtime_checkable
class StepSource(Protocol):
    """What `StepRewardScore` reads of the reward tracker (a `RewardTracker`, or a `StepReplay`).

    `batch_size` (rows followed, 0 before the generation starts), `prompt_length` (generated token i of a
    row sits at position `prompt_length + i`), `step_ends(row)` (token ends of the completed steps) and
    `rewards_of(row)` (their rewards, one per completed step)."""

    @property
    def batch_size(self) -> int: ...

    @property
    def prompt_length(self) -> int: ...

    def step_ends(self, row: int) -> list[int]: ...

    def rewards_of(self, row: int) -> list[float]: ...


def _padded(rows: list[list[float]] | list[list[int]], fill: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    """`[B, S + 1]` rows padded with `fill` (one extra column so that S = 0 works)."""
    width = max((len(r) for r in rows), default=0) + 1
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for b, r in enumerate(rows):
        if r:
            out[b, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.to(device)


class StepRewardScore(Scorer):
    """ReCo step-attributed eviction: each held token carries its reasoning step (token state); the score
    is its step's reward, negated, so the tokens of high-reward steps are evicted first.

    ReCo (arXiv, abstract only): "deleting the tokens of high-reward steps beats deleting the same number at
    random". Scores, per (row, KV head, token), higher = kept first:

    - `order="reward"` (ReCo): a generated token of completed step k of row b scores `-reward_b[k]`;
    - `order="inverse"` (control): `+reward_b[k]` (the lowest-reward steps go first);
    - `order="random"` (control): `-u(b, k)`, `u` a fixed pseudo-random number in [0, 1) per (row, step)
      drawn from `seed` (the same at every event and layer): whole steps go in a random order;
    - prompt tokens and tokens of the step still being written: `UNREWARDED` (2.0), above every
      completed step.

    Compose it with the base method's score to order tokens inside a step: `Lexicographic(StepRewardScore(t),
    base.scorer)` (`kvcompose.methods.reco_evict` does it).

    Token state: one float32 channel = the step index (0-based, per row) of every generated token. `observe`
    (every attention call) writes the tracker's step index of every held generated token from the start of
    the step before the one holding the first new token on (new tokens, the open step, and one closed step
    of margin); earlier tokens keep the index they were given. Step k spans generated tokens
    `[ends[k-1], ends[k])` of the tracker (`RewardTracker.step_ends`). Timing: the tracker is fed by a
    logits processor after each forward pass, so during the pass that feeds token i it has read tokens
    `< i`: a token's step becomes final once the tracker has closed its step, at the latest one pass later.
    Exact unless three step boundaries are resolved within one forward call before its first new token.

    Args:
        source: the reward tracker (`kvcompose.reco.RewardTracker`, shared with the logits processor that
            feeds it) or a `StepReplay`. The block only reads it.
        order: "reward" (ReCo), "inverse" or "random" (controls).
        seed: seed of the random step keys (`order="random"`).

    Shapes: `observe(state [B, H, T], step) -> [B, H, T]`; `score(view, state [B, H, T]) -> [B, H, T]`.
    """

    token_state = 1

    def __init__(self, source: Any, order: str = "reward", seed: int = 0):
        if not isinstance(source, StepSource):
            raise KVComposeError(
                "StepRewardScore needs a step source with batch_size, prompt_length, step_ends(row) and "
                f"rewards_of(row) (a kvcompose.reco.RewardTracker), got {type(source).__name__}"
            )
        if order not in ("reward", "inverse", "random"):
            raise KVComposeError(f"StepRewardScore: order must be 'reward', 'inverse' or 'random', got {order!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise KVComposeError(f"StepRewardScore: seed must be an int, got {seed!r}")
        self.source, self.order, self.seed = source, order, seed

    # -- reading the tracker ----------------------------------------------------------------------
    def _rows(self, batch: int) -> int:
        """Rows the source follows (0: not started); refuses a source that follows another batch."""
        n = int(self.source.batch_size)
        if n not in (0, batch):
            raise KVComposeError(
                f"the reward tracker follows {n} rows but the cache holds {batch}: reset the tracker (Reco.reset()) "
                "before each generate() call"
            )
        return n

    def step_ids(self, positions: Int[Tensor, "B H T"], prompt_length: int) -> Int[Tensor, "B H T"]:
        """The tracker's step index of each position (`-1` for prompt and padding slots): the number of
        completed steps that end at or before the token."""
        b = positions.shape[0]
        gen = positions - prompt_length
        ends = _padded([self.source.step_ends(r) for r in range(b)], float(FAR_POSITION), positions.device,
                       torch.float64)
        ids = torch.searchsorted(ends, gen.reshape(b, -1).double(), right=True).reshape(gen.shape)
        return torch.where((gen >= 0) & (positions < FAR_POSITION), ids, torch.full_like(ids, -1))

    # -- the block ------------------------------------------------------------------------------------
    def observe(self, state: Float[Tensor, "B H T"], step: AttentionStep) -> Float[Tensor, "B H T"]:
        """Write the step index of the new tokens and of the open step (one closed step of margin)."""
        b = state.shape[0]
        if not self._rows(b):
            return state  # prefill: the tracker has not started; prompt tokens carry no step
        p0 = int(self.source.prompt_length)
        pos = step.positions
        real = pos < FAR_POSITION
        seen = pos.masked_fill(~real, -1).amax(dim=(1, 2)) + 1  # [B]
        first_new = (seen - step.queries.shape[2] - p0).double()  # generated index of the first new token
        ends = [self.source.step_ends(r) for r in range(b)]
        e = _padded(ends, float(FAR_POSITION), pos.device, torch.float64)  # [B, S + 1]
        k = torch.searchsorted(e, first_new[:, None], right=True)[:, 0]  # step of the first new token
        starts = torch.cat([torch.zeros(b, 1, dtype=e.dtype, device=e.device), e], dim=1)  # start of step j
        lo = starts.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0]  # start of the step before it
        ids = self.step_ids(pos, p0)
        rewrite = (ids >= 0) & ((pos - p0).double() >= lo[:, None, None])
        return torch.where(rewrite, ids.to(state.dtype), state)

    def _keys(self, rows: int) -> list[list[float]]:
        """Per row, the score of each completed step (higher = kept first)."""
        out = []
        for r in range(rows):
            rewards = [float(x) for x in self.source.rewards_of(r)]
            if self.order == "reward":
                out.append([-x for x in rewards])
            elif self.order == "inverse":
                out.append(rewards)
            else:
                out.append([-random.Random(self.seed * SEED_STRIDE + r * 7_919 + k).random() for k in range(len(rewards))])
        return out

    def score(self, view: LayerView, state: Float[Tensor, "B H T"]) -> Float[Tensor, "B H T"]:
        b, h, t = view.shape
        out = torch.full((b, h, t), UNREWARDED, dtype=torch.float32, device=view.device)
        if not self._rows(b):
            return out
        keys = _padded(self._keys(b), UNREWARDED, view.device, torch.float32)  # [B, S + 1]
        count = torch.tensor([len(self.source.rewards_of(r)) for r in range(b)], device=view.device)
        ids = state.round().long()
        gen = (view.positions >= view.prompt_length) & (view.positions < FAR_POSITION) & view.valid
        done = gen & (ids >= 0) & (ids < count[:, None, None])
        per = keys.gather(1, ids.clamp(min=0, max=keys.shape[1] - 1).reshape(b, -1)).reshape(b, h, t)
        return torch.where(done, per, out)

    def __repr__(self) -> str:
        return f"StepRewardScore(order={self.order!r})"


class Lexicographic(Scorer):
    """Ranks tokens by `first` and breaks its ties with `then` (e.g. ReCo's step reward first, the base
    method's score inside a step). The score is the rank, `0 .. T - 1` per (row, KV head), higher = kept
    first; exact ties of both keep the older token lower.

    Shapes: `score(view, (state_first, state_then)) -> [B, H, T]`.
    """

    def __init__(self, first: Scorer, then: Scorer):
        require_role(first, Scorer, "Lexicographic (first)", ": it ranks by two scorers")
        require_role(then, Scorer, "Lexicographic (then)", ": it ranks by two scorers")
        self.first, self.then = first, then

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return max(self.first.query_window, self.then.query_window)

    def children(self) -> tuple[Block, ...]:
        return (self.first, self.then)

    def score(self, view: LayerView, state: tuple | None = None) -> Float[Tensor, "B H T"]:
        s1, s2 = state if state is not None else (None, None)
        a = self.first(view, s1)
        z = self.then(view, s2)
        o = torch.sort(z, dim=-1, stable=True).indices
        o = o.gather(-1, torch.sort(a.gather(-1, o), dim=-1, stable=True).indices)
        rank = torch.empty_like(o)
        rank.scatter_(-1, o, torch.arange(o.shape[-1], device=o.device).expand_as(o).contiguous())
        return rank.float()

    def __repr__(self) -> str:
        return f"Lexicographic({self.first!r}, then {self.then!r})"


class StepReplay:
    """The reward tracker's state along a fixed trace, revealed token by token (for teacher forcing).

    A `RewardTracker` reads the trace once, token by token, with the distribution each token was drawn from
    (e.g. the full cache's), and records after every token which steps it has closed. `advance(n)` then
    shows what a live tracker shows after reading `n` generated tokens: during the forward pass that feeds
    generated tokens up to index i, a live tracker has read `i` of them, so call `advance(i)` before a
    teacher-forced chunk that ends at index i. One row.

    Build it with `StepReplay.from_logits(tokenizer, prompt_ids, trace_ids, logits)` (`logits[i]`: the
    distribution that predicted `trace_ids[i]`, `[N, V]`).
    """

    def __init__(self, ends: list[int], rewards: list[float], closed_after: list[int], prompt_length: int):
        if len(ends) != len(rewards) or any(c > len(ends) for c in closed_after):
            raise KVComposeError("StepReplay: inconsistent steps")
        self.ends, self.rewards, self.closed_after = list(ends), list(rewards), list(closed_after)
        self._prompt_length = int(prompt_length)
        self.n = -1  # not started

    @classmethod
    @torch.no_grad()
    def from_logits(cls, tokenizer: Any, prompt_ids: list[int], trace_ids: list[int],
                    logits: Float[Tensor, "N V"], tracker: RewardTracker | None = None) -> "StepReplay":
        """Run a `RewardTracker` (default settings unless given) over the trace with these distributions."""
        if logits.shape[0] != len(trace_ids):
            raise KVComposeError(f"StepReplay: {logits.shape[0]} distributions for {len(trace_ids)} trace tokens")
        tr = tracker if tracker is not None else RewardTracker(tokenizer)
        tr.reset()
        ids = torch.tensor([list(prompt_ids) + list(trace_ids)], dtype=torch.long)
        p0 = len(prompt_ids)
        closed = []
        for i in range(len(trace_ids)):
            tr.observe(ids[:, : p0 + i], logits[i : i + 1])  # reads tokens < i, then sees token i's distribution
            closed.append(len(tr.step_ends(0)))
        tr.sync(ids)
        closed.append(len(tr.step_ends(0)))  # closed_after[n]: steps closed after reading n tokens
        return cls(tr.step_ends(0), tr.rewards_of(0), closed, p0)

    def advance(self, n: int) -> None:
        """Show the state after `n` generated tokens were read (0 <= n <= len(trace))."""
        if not 0 <= n < len(self.closed_after):
            raise KVComposeError(f"StepReplay.advance: n must be in [0, {len(self.closed_after) - 1}], got {n}")
        self.n = n

    def reset(self) -> None:
        self.n = -1

    @property
    def batch_size(self) -> int:
        return 0 if self.n < 0 else 1

    @property
    def prompt_length(self) -> int:
        return 0 if self.n < 0 else self._prompt_length

    def step_ends(self, row: int) -> list[int]:
        return [] if self.n < 0 else self.ends[: self.closed_after[self.n]]

    def rewards_of(self, row: int) -> list[float]:
        return [] if self.n < 0 else self.rewards[: self.closed_after[self.n]]
