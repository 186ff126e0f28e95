"""ReCo confidence early stopping: stop (or force a final answer) once the last `k` steps are confident.

ReCo (arXiv "ReCo", reward-coordinated compression; abstract only) stops decoding on confidence; the
k-consecutive-steps rule, the answer-pattern gate and the force mode (with `ForcePrefix`) are our design.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor
from transformers import StoppingCriteria

from .processors import ForcePrefix

__all__ = ["DEFAULT_ANSWER_PATTERN", "ConfidenceStopping"]

#: "answer is", GSM8K's "####", LaTeX "\boxed".
DEFAULT_ANSWER_PATTERN = r"answer is|####|\\boxed"


class ConfidenceStopping(StoppingCriteria):
    """Stops a row once its last `k` completed steps all have reward >= `threshold` (and, optionally,
    a final-answer pattern has appeared in its generated text).

    ReCo's confidence-based early stopping (arXiv, abstract only); the k-consecutive-steps rule, the
    answer-pattern gate and the force mode are our design.

    Exactness: each call first `tracker.sync(input_ids)`s, so a step completed by the token just
    appended is scored before deciding; the row's flag becomes True on exactly the call where the
    criterion first holds (and stays True). `fired_at[row]` records the sequence length at that call.

    Force mode (`force=ForcePrefix(...)`): when the criterion first holds the row is not stopped;
    `force.trigger` is called instead, the prefix is forced (add the `ForcePrefix` to the logits
    processors), and the row stops when `force.answer_done` (answer number + newline, or N tokens).

    Args:
        tracker: the `RewardTracker` (anything with `sync`, `rewards_of`, `generated_text`, `generation`).
        k: number of consecutive confident steps required (>= 1).
        threshold: reward threshold.
        answer_pattern: regex that must have appeared in the generated text, or None. Searched
            incrementally (only the last `answer_lookback` chars are rescanned), and once seen stays seen.
        force: optional `ForcePrefix`.

    Returns `BoolTensor[B]` (transformers 5 `StoppingCriteria.__call__(input_ids, scores, **kwargs)`).
    """

    def __init__(
        self,
        tracker: Any,
        k: int = 2,
        threshold: float = 0.8,
        answer_pattern: str | re.Pattern[str] | None = DEFAULT_ANSWER_PATTERN,
        force: ForcePrefix | None = None,
        answer_lookback: int = 256,
    ):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.tracker = tracker
        self.k = int(k)
        self.threshold = float(threshold)
        self.answer_pattern = re.compile(answer_pattern) if isinstance(answer_pattern, str) else answer_pattern
        self.force = force
        self.answer_lookback = int(answer_lookback)
        self.reset()

    def reset(self) -> None:
        self._gen = getattr(self.tracker, "generation", None)
        self._stopped: dict[int, bool] = {}
        self._answer_seen: dict[int, bool] = {}
        self._scanned: dict[int, int] = {}
        self.fired_at: dict[int, int] = {}
        if self.force is not None:
            self.force.reset()

    def _answer_in(self, row: int) -> bool:
        if self.answer_pattern is None:
            return True
        if self._answer_seen.get(row, False):
            return True
        text = self.tracker.generated_text(row)
        start = max(0, self._scanned.get(row, 0) - self.answer_lookback)
        self._scanned[row] = len(text)
        if self.answer_pattern.search(text, start):
            self._answer_seen[row] = True
        return self._answer_seen.get(row, False)

    def criterion(self, row: int) -> bool:
        """The ReCo stop criterion for `row` on the tracker's current state."""
        answer = self._answer_in(row)  # always advance the incremental scan
        r = self.tracker.rewards_of(row)
        return len(r) >= self.k and all(x >= self.threshold for x in r[-self.k :]) and answer

    def __call__(self, input_ids: Int[Tensor, "B T"], scores: Any = None, **kwargs: Any) -> Bool[Tensor, " B"]:
        self.tracker.sync(input_ids)
        if getattr(self.tracker, "generation", None) != self._gen:
            self.reset()
        t = input_ids.shape[1]
        out: list[bool] = []
        for row in range(input_ids.shape[0]):
            if self._stopped.get(row, False):
                out.append(True)
                continue
            if self.force is not None and self.force.is_active(row):
                done = self.force.answer_done(row, input_ids)
            elif self.criterion(row):
                self.fired_at[row] = t
                if self.force is not None:
                    self.force.trigger(row, t)
                    done = False
                else:
                    done = True
            else:
                done = False
            self._stopped[row] = done
            out.append(done)
        return torch.tensor(out, dtype=torch.bool, device=input_ids.device)

    def __repr__(self) -> str:
        return f"ConfidenceStopping(k={self.k}, threshold={self.threshold}, force={self.force is not None})"
