"""ReCo reward tracking and the reward -> budget schedule.

`RewardTracker` is the per-row step/reward state that the ReCo processors share during `generate()`;
`RewardBudgetSchedule` (and its functional form `reward_to_budget`) maps the latest reward to the KV
budget of the next compression event (ReCo, arXiv "ReCo", reward-coordinated compression; abstract
only, the schedule is our design).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._tokens import _decode
from .rewards import ConfidenceReward, StepInfo, StepReward
from .segment import CompletedStep, StepSegmenter, StepStream

__all__ = ["RewardTracker", "RewardBudgetSchedule", "reward_to_budget"]


class _Row:
    def __init__(self, stream: StepStream, prompt_text: str):
        self.stream = stream
        self.prompt_text = prompt_text
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.steps: list[StepInfo] = []
        self.rewards: list[float] = []
        self.ends: list[int] = []  # token end (exclusive) of each completed step, in generated-token indices


class RewardTracker:
    """Per-row step/reward state shared by the ReCo processors during `generate()`.

    ReCo (arXiv, abstract only, no reference code) coordinates compression, reflection and stopping
    through one step-reward signal; this object is that signal. Our design: rewards are computed
    synchronously when a step completes, and "current reward" = the latest completed step's reward.

    Fed by `observe(input_ids, scores)` from a logits processor (`RewardTrackingProcessor`, or
    `ReflectionPenalty` with `update_tracker=True`) and by `sync(input_ids)` from `ConfidenceStopping`.
    For each generated token it keeps the chosen token's log-probability and the entropy of the
    distribution it was drawn from (as seen by the feeding processor, i.e. before the sampling
    warpers), decodes and segments text with a `StepSegmenter`, and scores each completed step with the
    `StepReward`.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens=True)` (an HF tokenizer).
        reward: the step reward (default `ConfidenceReward()`, a confidence proxy, not a trained PRM).
        segmenter: default `StepSegmenter()` (blank lines and "Step k" markers).
        default_reward: the reward reported before any step completed.

    A new generation is detected (state reset) when the batch size changes, the sequence gets shorter
    or jumps by more than one token, or the prompt's first/last tokens differ; call `reset()` between
    `generate` calls to be certain.

    Exposes: `current_reward` (float), `current_rewards` (per row), `reward_of(row)`, `rewards_of(row)`
    (history), `step_ends(row)` (token spans of the completed steps), `prompt_length`, `steps` (all
    completed `StepInfo`s, in completion order, each with `.row`), `steps_of(row)`, `generated_text(row)`,
    `partial_text(row)`, `finalize()`.
    """

    def __init__(
        self,
        tokenizer: Any,
        reward: StepReward | None = None,
        segmenter: StepSegmenter | None = None,
        default_reward: float = 0.5,
    ):
        self.tokenizer = tokenizer
        self.reward = reward if reward is not None else ConfidenceReward()
        self.segmenter = segmenter if segmenter is not None else StepSegmenter()
        self.default_reward = float(default_reward)
        self.generation = 0  # bumped on every (re)start; other objects use it to reset their state
        self.reset()

    def reset(self) -> None:
        """Forgets everything (call between `generate` calls)."""
        self._rows: list[_Row] = []
        self._all_steps: list[StepInfo] = []
        self._prompt_len = 0
        self._seq_len = 0
        self._fingerprint: list[tuple[int, int]] = []
        self._pending_logp: Tensor | None = None
        self._pending_ent: list[float] | None = None
        self._pending_len = -1
        self._vocab: int | None = None

    # -- feeding ---------------------------------------------------------------------------------

    def _fp(self, input_ids: Tensor, plen: int) -> list[tuple[int, int]]:
        return [tuple(x) for x in input_ids[:, [0, plen - 1]].tolist()]

    def _maybe_start(self, input_ids: Int[Tensor, "B T"]) -> None:
        b, t = input_ids.shape
        fresh = (
            not self._rows
            or b != len(self._rows)
            or t < self._seq_len
            or t > self._seq_len + 1
            or self._fp(input_ids, self._prompt_len) != self._fingerprint
        )
        if not fresh:
            return
        self.reset()
        self.generation += 1
        self._prompt_len = t
        self._seq_len = t
        self._fingerprint = self._fp(input_ids, t)
        prompts = input_ids.tolist()
        for row in prompts:
            stream = self.segmenter.stream(self.tokenizer, row[-6:])
            self._rows.append(_Row(stream, _decode(self.tokenizer, row)))

    def sync(self, input_ids: Int[Tensor, "B T"]) -> None:
        """Ingests tokens appended since the last call (idempotent); scores steps they complete."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        self._maybe_start(input_ids)
        t = input_ids.shape[1]
        if t <= self._seq_len:
            return
        new = input_ids[:, self._seq_len : t].tolist()
        nan = float("nan")
        lp: list[float] = [nan] * len(new)
        ent: list[float] = [nan] * len(new)
        if self._pending_logp is not None and self._pending_ent is not None and self._pending_len == self._seq_len:
            chosen = input_ids[:, self._seq_len].to(self._pending_logp.device)
            lp = self._pending_logp.gather(1, chosen[:, None]).squeeze(1).tolist()
            ent = self._pending_ent
            self._vocab = int(self._pending_logp.shape[-1])
        # only the first new token has a known distribution (normally there is exactly one new token)
        for b, toks in enumerate(new):
            for j, tok in enumerate(toks):
                self._push(b, tok, lp[b] if j == 0 else nan, ent[b] if j == 0 else nan)
        self._seq_len = t

    def observe(self, input_ids: Int[Tensor, "B T"], scores: Float[Tensor, "B V"]) -> None:
        """Called by a logits processor before the next token is drawn: `sync`, then remember the
        distribution `softmax(scores)` for that token. A second call at the same length is a no-op."""
        self.sync(input_ids)
        t = input_ids.shape[1]
        if self._pending_len == t:
            return
        logp = torch.log_softmax(scores.detach().float(), dim=-1)
        self._pending_logp = logp
        self._pending_ent = torch.special.entr(logp.exp()).sum(-1).tolist()
        self._pending_len = t

    def _push(self, b: int, tok: int, lp: float, ent: float) -> None:
        row = self._rows[b]
        row.logprobs.append(lp)
        row.entropies.append(ent)
        for cs in row.stream.push(tok):
            self._record(b, cs)

    def _record(self, b: int, cs: CompletedStep) -> None:
        row = self._rows[b]
        step = StepInfo(
            text=cs.text,
            token_ids=row.stream.token_ids[cs.tok_lo : cs.tok_hi],
            logprobs=row.logprobs[cs.tok_lo : cs.tok_hi],
            entropies=row.entropies[cs.tok_lo : cs.tok_hi],
            index=len(row.steps),
            row=b,
            prefix_text=row.prompt_text + row.stream.text[: cs.char_lo],
            vocab_size=self._vocab,
        )
        r = float(self.reward(step))
        r = self.default_reward if math.isnan(r) else min(1.0, max(0.0, r))
        step.reward = r
        row.steps.append(step)
        row.rewards.append(r)
        row.ends.append(int(cs.tok_hi))
        self._all_steps.append(step)

    def finalize(self) -> list[StepInfo]:
        """Scores each row's trailing partial step as a completed step (end of generation)."""
        out = []
        for b, row in enumerate(self._rows):
            cs = row.stream.close()
            if cs is not None:
                self._record(b, cs)
                out.append(row.steps[-1])
        return out

    # -- reading ---------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Rows being tracked (0 before the first call)."""
        return len(self._rows)

    def reward_of(self, row: int) -> float:
        """Latest completed step's reward of `row`, `default_reward` before its first step."""
        if row >= len(self._rows) or not self._rows[row].rewards:
            return self.default_reward
        return self._rows[row].rewards[-1]

    @property
    def current_rewards(self) -> list[float]:
        """`reward_of(b)` for every row."""
        return [self.reward_of(b) for b in range(len(self._rows))] or [self.default_reward]

    @property
    def current_reward(self) -> float:
        """Latest completed step's reward; with `B > 1` the minimum over rows (the most cautious
        value: gentlest compression, least penalty). `default_reward` before any step."""
        return min(self.current_rewards)

    @property
    def prompt_length(self) -> int:
        """Length of the prompt (left padding included) of the generation being tracked (0 before the first
        call): generated token i of a row sits at sequence position `prompt_length + i`."""
        return self._prompt_len if self._rows else 0

    def step_ends(self, row: int) -> list[int]:
        """Token end (exclusive, in generated-token indices) of each completed step of `row`: step k spans
        generated tokens `[ends[k-1], ends[k])` (`ends[-1]` = 0). Tokens from `ends[-1]` on belong to the
        step in progress (`StepStream`'s attribution: a separator token counts toward the step it opens)."""
        return list(self._rows[row].ends) if row < len(self._rows) else []

    def rewards_of(self, row: int) -> list[float]:
        """Reward history of `row`, one per completed step."""
        return list(self._rows[row].rewards) if row < len(self._rows) else []

    @property
    def reward_history(self) -> list[list[float]]:
        return [list(r.rewards) for r in self._rows]

    @property
    def steps(self) -> list[StepInfo]:
        """All completed steps of all rows, in completion order (`StepInfo.row` tells the row)."""
        return list(self._all_steps)

    def steps_of(self, row: int) -> list[StepInfo]:
        return list(self._rows[row].steps) if row < len(self._rows) else []

    def generated_text(self, row: int) -> str:
        """Decoded generated text of `row` (prompt excluded)."""
        return self._rows[row].stream.text if row < len(self._rows) else ""

    def partial_text(self, row: int) -> str:
        """The current, not yet completed step of `row`."""
        if row >= len(self._rows):
            return ""
        p = self._rows[row].stream.partial()
        return p.text if p is not None else ""

    def __repr__(self) -> str:
        return f"RewardTracker(rows={len(self._rows)}, steps={len(self._all_steps)}, reward={self.reward!r})"


@runtime_checkable
class _RewardSource(Protocol):
    """What the reward consumers read of a `RewardTracker` (runtime-checkable: beartype checks it)."""

    def reward_of(self, row: int) -> float: ...

    @property
    def current_reward(self) -> float: ...

    @property
    def current_rewards(self) -> list[float]: ...


# --------------------------------------------------------------------------------------------------
# Budget schedule
# --------------------------------------------------------------------------------------------------


class RewardBudgetSchedule:
    """Reward -> KV budget of the next compression event (ReCo's reward-coordinated compression).

    Our schedule (the paper's abstract gives only the direction): a piecewise-linear scale

        scale(r) = max_scale                     for r <= low
                 = min_scale                     for r >= high
                 = linear interpolation          in between

    and `budget = clamp(floor(scale(r) * base_budget), min_budget, base_budget)`. It is monotone
    non-increasing in the reward: high reward (confident trajectory) -> smaller budget -> harder
    compression; low reward -> gentler. A NaN reward counts as "no information": `max_scale`.

    Args:
        base_budget: the nominal budget (tokens). Can be overridden per call (the cache's own budget).
        low: reward at or below which the budget is `max_scale * base_budget`; `0 <= low <= high <= 1`.
        high: reward at or above which the budget is `min_scale * base_budget`.
        min_scale: budget fraction at high reward, `0 < min_scale <= max_scale`.
        max_scale: budget fraction at low reward.
        min_budget: lower clamp (at least 1).

    This is a plain class with no kvcompose imports; an Allocator wrapper can call
    `budget(tracker, base_budget=cache_budget)` or `budgets(tracker, ...)` (per row).
    """

    def __init__(
        self,
        base_budget: int,
        low: float = 0.3,
        high: float = 0.9,
        min_scale: float = 0.5,
        max_scale: float = 1.0,
        min_budget: int = 1,
    ):
        if base_budget < 1:
            raise ValueError(f"base_budget must be >= 1, got {base_budget}")
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"need 0 <= low <= high <= 1, got low={low}, high={high}")
        if not 0.0 < min_scale <= max_scale:
            raise ValueError(f"need 0 < min_scale <= max_scale, got {min_scale}, {max_scale}")
        if min_budget < 1:
            raise ValueError(f"min_budget must be >= 1, got {min_budget}")
        self.base_budget = int(base_budget)
        self.low, self.high = float(low), float(high)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.min_budget = int(min_budget)

    def scale(self, reward: float) -> float:
        """Budget fraction for `reward` (non-increasing)."""
        r = float(reward)
        if math.isnan(r) or r <= self.low:
            return self.max_scale
        if r >= self.high:
            return self.min_scale
        frac = (r - self.low) / (self.high - self.low)
        return self.max_scale + frac * (self.min_scale - self.max_scale)

    def __call__(self, reward: float, base_budget: int | None = None) -> int:
        """Budget for `reward`, in `[min(min_budget, base), base]`."""
        base = self.base_budget if base_budget is None else int(base_budget)
        raw = math.floor(self.scale(reward) * base + 1e-9)
        return int(max(min(self.min_budget, base), min(raw, base)))

    def budget(self, tracker: _RewardSource, row: int | None = None, base_budget: int | None = None) -> int:
        """Budget from the tracker's latest reward: `row`'s, or `tracker.current_reward` (the minimum over
        rows, i.e. the largest per-row budget) when `row` is None."""
        r = tracker.current_reward if row is None else tracker.reward_of(row)
        return self(r, base_budget)

    def budgets(self, tracker: _RewardSource, base_budget: int | None = None) -> list[int]:
        """Per-row budgets."""
        return [self(r, base_budget) for r in tracker.current_rewards]

    def __repr__(self) -> str:
        return (
            f"RewardBudgetSchedule(base_budget={self.base_budget}, low={self.low}, high={self.high}, "
            f"min_scale={self.min_scale}, max_scale={self.max_scale}, min_budget={self.min_budget})"
        )


def reward_to_budget(
    reward: float,
    base_budget: int,
    min_scale: float = 0.5,
    max_scale: float = 1.0,
    low: float = 0.0,
    high: float = 1.0,
    min_budget: int = 1,
) -> int:
    """Functional form of `RewardBudgetSchedule` (default: linear from `max_scale` at reward 0 to
    `min_scale` at reward 1)."""
    return RewardBudgetSchedule(base_budget, low, high, min_scale, max_scale, min_budget)(reward)
