"""ReCo logits processors: the tracker's feeder, the reward-banded reflection penalty and the forced
answer prefix.

ReCo (arXiv "ReCo", reward-coordinated compression; abstract only) lowers the logits of reflection
tokens by an amount banded by the latest step reward (`ReflectionPenalty`); `RewardTrackingProcessor`
feeds the `RewardTracker` with the model's own distribution; `ForcePrefix` steers a row that
`ConfidenceStopping` found confident into stating its answer (our variant of ReCo's early stopping).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import LogitsProcessor

from ._tokens import _decode, _encode
from .tracker import RewardTracker, _RewardSource

__all__ = [
    "RewardTrackingProcessor",
    "DEFAULT_REFLECTION_WORDS",
    "DEFAULT_PENALTY_BANDS",
    "ReflectionPenalty",
    "ForcePrefix",
]


class RewardTrackingProcessor(LogitsProcessor):
    """Observe-only logits processor that feeds a `RewardTracker` (ReCo); returns `scores` unchanged.

    Put it first in the `LogitsProcessorList` so the tracker sees the model's own distribution.

    Shapes: `input_ids` `[B, T]`, `scores` `[B, V]`.
    """

    def __init__(self, tracker: RewardTracker):
        self.tracker = tracker

    def __call__(self, input_ids: Int[Tensor, "B T"], scores: Float[Tensor, "B V"]) -> Float[Tensor, "B V"]:
        self.tracker.observe(input_ids, scores)
        return scores


DEFAULT_REFLECTION_WORDS: tuple[str, ...] = (
    "wait", "Wait", "hmm", "Hmm", "alternatively", "Alternatively",
    "but wait", "But wait", "let me check", "Let me check", "let me verify", "Let me verify",
    "double-check", "Double-check",
)  # fmt: skip

#: (low, high, penalty): strong penalty when confident, mild in the middle, none when unsure.
DEFAULT_PENALTY_BANDS: tuple[tuple[float, float, float], ...] = ((0.7, 1.0, 5.0), (0.4, 0.7, 1.0))


class ReflectionPenalty(LogitsProcessor):
    """Subtracts a reward-banded penalty from the logits of reflection tokens (ReCo's reflection control).

    Token ids:
        * single words ("wait", "Hmm", "alternatively"): the FIRST token of the word as it appears after
          nothing, after a space and after a newline (`encode("word")`, `encode(" word")`,
          `encode("\\nword")`, skipping leading tokens that decode to whitespace only; this covers BPE `Ġ`
          and SentencePiece `▁` forms). These ids are penalised at every step in band. With coarse
          tokenizers the first token may be shared with other words (for a char-level vocabulary, "w");
          that is the price of a first-token rule.
        * phrases (entries with a space or a hyphen: "but wait", "let me check", "double-check"): their
          first token ("but", "let", "double") is too common to penalise; instead, when the row's last
          generated tokens equal a proper prefix of the phrase's tokenization, the phrase's next token is
          penalised ("check" after "let me").
        `token_ids` lists the first-token ids, `phrases` the phrase tokenizations.

    Bands: `bands = [(low, high, penalty), ...]`; a row whose current reward `r` (from the tracker)
    satisfies `low <= r < high` (or `r == high == 1.0`) gets `penalty` subtracted; the first matching
    band wins; outside every band the logits are unchanged. Penalties are per row.

    Tracker update: with `update_tracker=True` (default) this processor calls `tracker.observe` before
    penalising, so the reward used at this step includes a step completed by the token just appended
    (no-op if a `RewardTrackingProcessor` already observed this step: then the tracker saw the
    un-penalised logits).

    Shapes: `input_ids` `[B, T]`, `scores` `[B, V]` -> `[B, V]` (a new tensor).
    """

    def __init__(
        self,
        tokenizer: Any,
        tracker: _RewardSource,
        words: Sequence[str] = DEFAULT_REFLECTION_WORDS,
        bands: Sequence[tuple[float, float, float]] = DEFAULT_PENALTY_BANDS,
        update_tracker: bool = True,
    ):
        for band in bands:
            if len(band) != 3 or not band[0] < band[1]:
                raise ValueError(f"a band is (low, high, penalty) with low < high, got {band}")
        self.tracker = tracker
        self.bands = [(float(lo), float(hi), float(p)) for lo, hi, p in bands]
        self.update_tracker = update_tracker
        singles = [w for w in words if not re.search(r"[\s-]", w.strip())]
        multi = [w for w in words if re.search(r"[\s-]", w.strip())]
        ids = set(self.first_token_ids(tokenizer, singles))
        phrases: set[tuple[int, ...]] = set()
        for w in multi:
            for variant in (w, " " + w):
                seq = _encode(tokenizer, variant)
                while seq and _decode(tokenizer, seq[:1]).strip() == "":
                    seq = seq[1:]
                if len(seq) == 1:
                    ids.add(seq[0])
                elif len(seq) > 1:
                    phrases.add(tuple(seq))
        self.token_ids: list[int] = sorted(ids)
        self.phrases: list[tuple[int, ...]] = sorted(phrases)
        self._ids_t: Tensor | None = None

    @staticmethod
    def first_token_ids(tokenizer: Any, words: Sequence[str]) -> list[int]:
        """First-token ids of each word after nothing / a space / a newline (whitespace-only pieces
        skipped, and only pieces whose text starts the word)."""
        out: set[int] = set()
        for w in words:
            w = w.strip()
            for variant in (w, " " + w, "\n" + w):
                seq = _encode(tokenizer, variant)
                for tok in seq:
                    piece = _decode(tokenizer, [tok]).strip()
                    if piece == "":
                        continue
                    if w.startswith(piece) or piece.startswith(w):
                        out.add(tok)
                    break
        return sorted(out)

    def band_penalty(self, reward: float) -> float:
        """Penalty for one reward value (0.0 outside every band)."""
        r = float(reward)
        for lo, hi, p in self.bands:
            if lo <= r < hi or (r == hi and hi >= 1.0):
                return p
        return 0.0

    def __call__(self, input_ids: Int[Tensor, "B T"], scores: Float[Tensor, "B V"]) -> Float[Tensor, "B V"]:
        if self.update_tracker and hasattr(self.tracker, "observe"):
            self.tracker.observe(input_ids, scores)  # type: ignore[attr-defined]
        b, v = scores.shape
        pens = [self.band_penalty(self.tracker.reward_of(i)) for i in range(b)]
        if all(p == 0.0 for p in pens):
            return scores
        mask = torch.zeros((b, v), dtype=torch.bool, device=scores.device)
        valid = [i for i in self.token_ids if 0 <= i < v]
        if valid:
            if self._ids_t is None or self._ids_t.device != scores.device:
                self._ids_t = torch.tensor(valid, dtype=torch.long, device=scores.device)
            mask[:, self._ids_t] = True
        if self.phrases:
            longest = max(len(p) for p in self.phrases)
            tails = input_ids[:, -(longest - 1) :].tolist() if longest > 1 else [[] for _ in range(b)]
            for row in range(b):
                if pens[row] == 0.0:
                    continue
                tail = tails[row]
                for ph in self.phrases:
                    for k in range(1, len(ph)):
                        if len(tail) >= k and tuple(tail[len(tail) - k :]) == ph[:k] and 0 <= ph[k] < v:
                            mask[row, ph[k]] = True
        pen_t = torch.tensor(pens, dtype=scores.dtype, device=scores.device)
        return scores - mask.to(scores.dtype) * pen_t[:, None]

    def __repr__(self) -> str:
        return f"ReflectionPenalty(ids={len(self.token_ids)}, phrases={len(self.phrases)}, bands={self.bands})"


class ForcePrefix(LogitsProcessor):
    """Forces a final-answer prefix ("The answer is") token by token, on rows that were triggered.

    Our variant of ReCo's confidence-based stopping (arXiv, abstract only): instead of cutting the
    reasoning mid-air, a confident row is steered into stating its answer, then stopped.

    Protocol: `trigger(row, seq_len)` (called by `ConfidenceStopping` when its criterion first holds,
    with the sequence length at that moment `S`). At the processor call with sequence length `L`,
    `pos = L - S`; for `0 <= pos < len(prefix_ids)` every logit of that row but `prefix_ids[pos]` is set
    to `-inf` (so greedy and sampling both pick it). After the prefix the model answers freely;
    `answer_done(row, input_ids)` is True once the answer text (after the prefix) matches
    `answer_end_pattern` (default: a number then a newline) or has `max_answer_tokens` tokens.

    Put it LAST in the `LogitsProcessorList`. Greedy/sampling only.

    Shapes: `input_ids` `[B, T]`, `scores` `[B, V]`.
    """

    def __init__(
        self,
        tokenizer: Any,
        prefix: str = "\nThe answer is",
        max_answer_tokens: int = 16,
        answer_end_pattern: str | re.Pattern[str] = r"\d[^\n]*\n",
    ):
        self.tokenizer = tokenizer
        self.prefix = prefix
        self.prefix_ids: list[int] = _encode(tokenizer, prefix)
        if not self.prefix_ids:
            raise ValueError(f"prefix {prefix!r} encodes to no tokens")
        if max_answer_tokens < 1:
            raise ValueError("max_answer_tokens must be >= 1")
        self.max_answer_tokens = int(max_answer_tokens)
        self.answer_end = re.compile(answer_end_pattern) if isinstance(answer_end_pattern, str) else answer_end_pattern
        self.reset()

    def reset(self) -> None:
        self._start: dict[int, int] = {}
        self._last_len = -1

    def trigger(self, row: int, seq_len: int) -> None:
        """Start forcing the prefix on `row` from the next token on (`seq_len`: current length)."""
        self._start.setdefault(row, int(seq_len))

    def is_active(self, row: int) -> bool:
        return row in self._start

    def __call__(self, input_ids: Int[Tensor, "B T"], scores: Float[Tensor, "B V"]) -> Float[Tensor, "B V"]:
        t = input_ids.shape[1]
        if t <= self._last_len:  # a new generate() call
            self.reset()
        self._last_len = t
        rows = [(r, self.prefix_ids[t - s]) for r, s in self._start.items() if 0 <= t - s < len(self.prefix_ids) and r < scores.shape[0]]
        if not rows:
            return scores
        scores = scores.clone()
        for r, tok in rows:
            scores[r] = float("-inf")
            scores[r, tok] = 0.0
        return scores

    def answer_done(self, row: int, input_ids: Int[Tensor, "B T"]) -> bool:
        """True once the free answer after the forced prefix is finished (pattern or length)."""
        if row not in self._start:
            return False
        begin = self._start[row] + len(self.prefix_ids)
        n = input_ids.shape[1] - begin
        if n <= 0:
            return False
        if n >= self.max_answer_tokens:
            return True
        text = _decode(self.tokenizer, input_ids[row, begin:].tolist())
        return self.answer_end.search(text) is not None
