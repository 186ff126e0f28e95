"""ReCo: reward-coordinated compression and stopping (the self-contained parts).

ReCo ("reward-coordinated compression", arXiv) couples three decoding-time controls of a long
chain-of-thought to one step-level process-reward estimate:

1. **compression strength**: the KV budget of the next compression event shrinks as the reward of the
   latest reasoning step grows (a confident trajectory can afford a harder squeeze; a shaky one keeps
   more context) -> `RewardBudgetSchedule`;
2. **reflection penalty**: logits of reflection tokens ("wait", "hmm", "alternatively", ...) are lowered
   by an amount banded by reward, to curb redundant re-checking when the model is already confident
   -> `ReflectionPenalty`;
3. **confidence early stopping**: decoding stops (or is steered into a final answer) once the last `k`
   steps are all confident -> `ConfidenceStopping` + `ForcePrefix`.

Only the paper's abstract was available; there is no reference code. Everything below (the step
segmentation rules, the no-training confidence proxy, the linear budget schedule, the band semantics,
the stop/force protocol) is **our design**, documented at each class.

How the pieces talk during `model.generate` (greedy or sampling; beam search is not supported):

* `RewardTracker` is the shared state. It is fed by a logits processor: at each decoding step the
  processor hands it `(input_ids, scores)`. The tracker first ingests the token(s) appended since the
  last call (their log-probability and the entropy come from the distribution it saw at the previous
  call), decodes them incrementally, segments the text into steps with a `StepSegmenter`, and scores
  every step that just completed with a `StepReward`. Then it stores the new distribution for the token
  about to be sampled.
* Which processor feeds it: `RewardTrackingProcessor` (observe-only, returns the scores unchanged) is the
  intended feeder; put it FIRST in your `LogitsProcessorList` so it sees the model's logits before any
  penalty. `ReflectionPenalty` also feeds the tracker (`update_tracker=True`), so it works on its own;
  feeding is idempotent per sequence length, so whichever ReCo processor runs first in a step wins and
  the rest are no-ops. (In transformers 5 user processors run after the built-in ones such as the
  repetition penalty, and before the sampling warpers temperature/top-k/top-p.)
* `ConfidenceStopping` runs after the new token is appended; it calls `tracker.sync(input_ids)` so the
  step that this very token completed is scored before the stop decision. Stopping is therefore exact:
  it fires on the call where the criterion first holds.

Batch: every object keeps per-row state (row b of `input_ids`); `B > 1` works, each row is segmented and
rewarded on its own.
"""

from __future__ import annotations

import bisect
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformers import LogitsProcessor, StoppingCriteria

__all__ = [
    "Boundary",
    "BLANK_LINES",
    "step_marker",
    "DEFAULT_DELIMITERS",
    "DEFAULT_ABBREVIATIONS",
    "StepSegmenter",
    "StepStream",
    "CompletedStep",
    "split_steps",
    "StepInfo",
    "StepReward",
    "ConfidenceReward",
    "PRMReward",
    "RewardTracker",
    "RewardTrackingProcessor",
    "RewardBudgetSchedule",
    "reward_to_budget",
    "DEFAULT_REFLECTION_WORDS",
    "DEFAULT_PENALTY_BANDS",
    "ReflectionPenalty",
    "DEFAULT_ANSWER_PATTERN",
    "ForcePrefix",
    "ConfidenceStopping",
]


# --------------------------------------------------------------------------------------------------
# Step segmentation
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Boundary:
    """One step-boundary rule of a `StepSegmenter`.

    Attributes:
        pattern: compiled regex, searched on the whole text (so `^` with `re.M` and look-behinds see the
            real context).
        kind: `"separator"`: the match ends the current step and belongs to no step's text (blank lines).
            `"marker"`: the match begins the next step and stays in it ("Step 3: ...").

    A rule must be *prefix-stable*: once it matches in a text, it matches at the same place in every
    extension of that text (the incremental segmenter relies on it). The built-in rules are; for
    markers this is why "Step 1" at the very end of the text is not yet a marker (it could become
    "Step 10"): the character after the number must have been generated.
    """

    pattern: re.Pattern[str]
    kind: Literal["separator", "marker"] = "separator"


#: One or more blank lines (also "\r\n\r\n", lines holding only spaces, any run of them).
BLANK_LINES = Boundary(re.compile(r"\n[ \t\r\f\v]*\n\s*"), "separator")


def step_marker(word: str = "Step") -> Boundary:
    """A numbered step marker at the start of a line: `Step 3:`, `**Step 3.**`, `### Step 12 -`.

    The marker starts a new step. It needs the character after the number to exist and not be a digit,
    so "Step 1" is never mistaken for the first part of "Step 10".
    """
    return Boundary(
        re.compile(rf"^[ \t]*(?:[#>*_]+[ \t]*)?{re.escape(word)}[ \t]+\d+(?=\D)", re.M),
        "marker",
    )


#: Default boundaries: blank lines and "Step k" markers.
DEFAULT_DELIMITERS: tuple[str, ...] = ("\n\n", "Step ")

#: Lower-cased words (without the final ".") after which a period does not end a sentence.
DEFAULT_ABBREVIATIONS: frozenset[str] = frozenset(
    {
        "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "vs", "v", "e.g", "i.e", "cf", "viz",
        "approx", "fig", "figs", "eq", "eqs", "eqn", "thm", "lem", "prop", "cor", "sec", "ch", "pp",
        "resp", "al", "u.s", "u.k",
    }
)  # fmt: skip

_SENTENCE_END = re.compile(r"(?<![.])[.!?](?![.])[\"'\u201d\u2019)\]]*\s+")
_LAST_WORD = re.compile(r"\S+$")
_ENUMERATOR = re.compile(r"[ \t]*(?:[#>*_-]+[ \t]*)?(?:[Ss]tep[ \t]+)?\d{1,3}")


def _coerce_boundary(d: str | re.Pattern[str] | Boundary) -> Boundary:
    if isinstance(d, Boundary):
        return d
    if isinstance(d, re.Pattern):
        return Boundary(d, "separator")
    if not isinstance(d, str) or d == "":
        raise ValueError(f"bad step delimiter {d!r}: give a non-empty str, a compiled regex or a Boundary")
    if d.strip() == "" and d.count("\n") >= 2:
        return BLANK_LINES
    m = re.fullmatch(r"([A-Za-z]+) ", d)
    if m:
        return step_marker(m.group(1))
    return Boundary(re.compile(re.escape(d)), "separator")


@dataclass
class _ScanState:
    sentence_floor: int = 0


@dataclass(frozen=True)
class CompletedStep:
    """A step found by `StepStream`: its stripped text, token span `[tok_lo, tok_hi)` into the stream's
    generated tokens, and char span `[char_lo, char_hi)` into the stream's text (unstripped)."""

    text: str
    tok_lo: int
    tok_hi: int
    char_lo: int
    char_hi: int


class StepSegmenter:
    """Splits chain-of-thought text into reasoning steps (ReCo needs a reward per *step*).

    ReCo (arXiv "ReCo", reward-coordinated compression) scores reasoning steps, but its abstract does not
    define a step; these rules are our choice: blank lines and "Step k" markers by default, optionally
    sentence ends.

    Args:
        delimiters: boundary rules. Each entry is
            * a string of blank lines, e.g. `"\\n\\n"`: one or more blank lines end a step (consecutive
              blank lines collapse, never making empty steps);
            * one word followed by one space, e.g. `"Step "`: a numbered marker (`Step 7`) at the start of a
              line begins a new step (see `step_marker`);
            * any other string: a literal separator (e.g. `"<step>"`, `"\\n"`);
            * a compiled `re.Pattern` (separator) or a `Boundary` (separator or marker).
        sentence_ends: also end a step at `.`, `!`, `?` (plus closing quotes/brackets) followed by
            whitespace, except: decimals and amounts (`3.5`, `$1,000.50`: no whitespace after the dot),
            ellipses (`...`), abbreviations (`e.g.`, `Mr.`, see `abbreviations`), single-capital initials
            (`J. Smith`) and list enumerators at line start (`1.`, `Step 2.`).
        abbreviations: lower-cased words (without their final dot) that a period does not end.

    Steps are stripped of surrounding whitespace; empty steps are dropped. The text after the last
    boundary is the *partial* step. Every rule is prefix-stable, so streaming a text token by token
    (`stream`) yields exactly the complete steps of `split(text, include_partial=False)`.

    Shapes: none (pure text). `stream(tokenizer)` gives the token-level incremental version.
    """

    def __init__(
        self,
        delimiters: Sequence[str | re.Pattern[str] | Boundary] = DEFAULT_DELIMITERS,
        sentence_ends: bool = False,
        abbreviations: frozenset[str] | set[str] | None = None,
    ):
        self.boundaries: tuple[Boundary, ...] = tuple(_coerce_boundary(d) for d in delimiters)
        self.sentence_ends = bool(sentence_ends)
        self.abbreviations = frozenset(a.lower().rstrip(".") for a in (DEFAULT_ABBREVIATIONS if abbreviations is None else abbreviations))
        if not self.boundaries and not self.sentence_ends:
            raise ValueError("StepSegmenter needs at least one delimiter or sentence_ends=True")

    def __repr__(self) -> str:
        return f"StepSegmenter(boundaries={len(self.boundaries)}, sentence_ends={self.sentence_ends})"

    # -- pure text -------------------------------------------------------------------------------

    def _is_sentence_end(self, text: str, i: int) -> bool:
        """`text[i]` is a `.`/`!`/`?` already known to be followed by closers + whitespace."""
        if text[i] != ".":
            return True
        m = _LAST_WORD.search(text, max(0, i - 48), i)
        if m is None:
            return True
        word = m.group().lstrip("([{\"'`*_").lower()
        if word in self.abbreviations:
            return False
        if len(word) == 1 and text[m.end() - 1].isupper():  # initials: "J. Smith"
            return False
        line_start = text.rfind("\n", 0, i) + 1
        if _ENUMERATOR.fullmatch(text, line_start, i):  # "1. ", "Step 2. "
            return False
        return True

    def _next_sentence_cut(self, text: str, pos: int, state: _ScanState | None) -> tuple[int, int] | None:
        start = pos if state is None else max(pos, state.sentence_floor)
        for m in _SENTENCE_END.finditer(text, start):
            if self._is_sentence_end(text, m.start()):
                return m.start() + len(m.group().rstrip()), m.end()
            if state is not None:  # a rejected candidate stays rejected in every extension of the text
                state.sentence_floor = m.end()
        return None

    def iter_cuts(self, text: str, pos: int = 0, state: _ScanState | None = None) -> Iterator[tuple[int, int]]:
        """Yields `(content_end, next_start)` for each boundary at or after `pos`, in order.

        The step before the boundary is `text[start:content_end]`; the next one begins at `next_start`.
        For a marker both are the marker's start. Cuts whose step would be empty are yielded too.
        `state` (used by `StepStream`) remembers rejected sentence-end candidates across calls on
        growing text, so streaming stays linear.
        """
        while True:
            best: tuple[int, int] | None = None
            for b in self.boundaries:
                start = pos if b.kind == "separator" else pos + 1  # a marker at pos opens the current step
                if start > len(text):
                    continue
                m = b.pattern.search(text, start)
                if m is None:
                    continue
                cut = (m.start(), m.end()) if b.kind == "separator" else (m.start(), m.start())
                if best is None or cut[0] < best[0] or (cut[0] == best[0] and cut[1] > best[1]):
                    best = cut
            if self.sentence_ends:
                cut = self._next_sentence_cut(text, pos, state)
                if cut is not None and (best is None or cut[0] < best[0] or (cut[0] == best[0] and cut[1] > best[1])):
                    best = cut
            if best is None:
                return
            yield best
            pos = best[1]

    def split(self, text: str, include_partial: bool = True) -> list[str]:
        """The steps of `text` (stripped, non-empty). `include_partial=False` drops the trailing step
        that no boundary has closed yet."""
        steps: list[str] = []
        start = 0
        for content_end, next_start in self.iter_cuts(text, 0):
            s = text[start:content_end].strip()
            if s:
                steps.append(s)
            start = next_start
        if include_partial:
            s = text[start:].strip()
            if s:
                steps.append(s)
        return steps

    # -- incremental -----------------------------------------------------------------------------

    def stream(self, tokenizer: Any, context_ids: Sequence[int] = ()) -> StepStream:
        """An incremental segmenter over generated token ids (see `StepStream`)."""
        return StepStream(self, tokenizer, context_ids)


def split_steps(
    text: str,
    delimiters: Sequence[str | re.Pattern[str] | Boundary] = DEFAULT_DELIMITERS,
    sentence_ends: bool = False,
    include_partial: bool = True,
    abbreviations: frozenset[str] | set[str] | None = None,
) -> list[str]:
    """Pure function: `StepSegmenter(delimiters, sentence_ends, abbreviations).split(text, include_partial)`."""
    return StepSegmenter(delimiters, sentence_ends, abbreviations).split(text, include_partial)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:  # minimal tokenizer objects
        return tokenizer.decode(ids)


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    if isinstance(ids, Tensor):
        ids = ids.flatten().tolist()
    return [int(i) for i in ids]


class StepStream:
    """Incremental step segmentation of one generated sequence, token by token (used per batch row by
    `RewardTracker`; our design, the ReCo abstract leaves it open).

    Text is decoded incrementally the way vLLM/TGI stream detokenization does: the delta of a new token
    is `decode(ids[prefix:]) - decode(ids[prefix:read])` over a small window, held back while it ends in
    an incomplete UTF-8 character (U+FFFD), and seeded with the last prompt tokens (`context_ids`) so
    SentencePiece leading spaces come out right. This costs O(1) decodes per token.

    After each token the segmenter scans from the start of the current (partial) step; every step that a
    boundary has closed is returned once, with its token span. Token attribution: a token belongs to the
    step in which its first character lies, measured against each step's content end, so separator
    tokens ("\\n\\n") count towards the following step and a merged ".\\n\\n" token to the one it ends.

    Attributes:
        token_ids: generated token ids pushed so far.
        char_starts: char offset in `text` where each token's text starts.
        text: decoded generated text so far.
    """

    def __init__(self, segmenter: StepSegmenter, tokenizer: Any, context_ids: Sequence[int] = ()):
        self.segmenter = segmenter
        self.tokenizer = tokenizer
        ctx = [int(i) for i in context_ids][-6:]
        self._all: list[int] = list(ctx)
        self._n_ctx = len(ctx)
        self._prefix_off = 0
        self._read_off = len(ctx)
        self.char_starts: list[int] = []
        self.text: str = ""
        self._region = 0  # char offset where the current (partial) step's region starts
        self._last_end = 0  # content end of the last emitted step (token attribution)
        self._tok_lo = 0  # first token of the current step
        self._scan_state = _ScanState()

    @property
    def token_ids(self) -> list[int]:
        return self._all[self._n_ctx :]

    def push(self, token_id: int) -> list[CompletedStep]:
        """Appends one token; returns the steps it completed (usually none, sometimes one)."""
        self.char_starts.append(len(self.text))
        self._all.append(int(token_id))
        prefix_text = _decode(self.tokenizer, self._all[self._prefix_off : self._read_off])
        new_text = _decode(self.tokenizer, self._all[self._prefix_off :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix_off = self._read_off
            self._read_off = len(self._all)
        return self._scan()

    def _scan(self) -> list[CompletedStep]:
        out: list[CompletedStep] = []
        for content_end, next_start in self.segmenter.iter_cuts(self.text, self._region, self._scan_state):
            content = self.text[self._region : content_end].strip()
            if content:
                hi = bisect.bisect_left(self.char_starts, content_end)
                hi = max(hi, self._tok_lo)
                out.append(CompletedStep(content, self._tok_lo, hi, self._region, content_end))
                self._tok_lo = hi
                self._last_end = content_end
            self._region = next_start
        return out

    def partial(self) -> CompletedStep | None:
        """The trailing step not yet closed by a boundary (None when it is empty)."""
        content = self.text[self._region :].strip()
        if not content:
            return None
        return CompletedStep(content, self._tok_lo, len(self.char_starts), self._region, len(self.text))

    def close(self) -> CompletedStep | None:
        """Treats the partial step as complete (end of generation) and returns it."""
        p = self.partial()
        if p is not None:
            self._tok_lo = p.tok_hi
            self._region = len(self.text)
            self._last_end = len(self.text)
        return p


# --------------------------------------------------------------------------------------------------
# Step rewards
# --------------------------------------------------------------------------------------------------


@dataclass
class StepInfo:
    """One completed reasoning step, as handed to a `StepReward` (the unit ReCo rewards).

    Attributes:
        text: the step's text (stripped).
        token_ids: its generated token ids, length n.
        logprobs: `Float[n]` log-probability of each chosen token under the distribution the tracker saw
            (NaN where unknown).
        entropies: `Float[n]` entropy (nats) of that distribution at each token (NaN where unknown).
        index: 0-based step number within its row.
        row: batch row.
        prefix_text: prompt text + generated text before this step (what a PRM conditions on).
        vocab_size: size of the distribution (normalises entropy); None when unknown.
        reward: filled in by the tracker after scoring.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: Float[Tensor, " n"] | Sequence[float] = field(default_factory=list)
    entropies: Float[Tensor, " n"] | Sequence[float] = field(default_factory=list)
    index: int = 0
    row: int = 0
    prefix_text: str = ""
    vocab_size: int | None = None
    reward: float | None = None

    def __post_init__(self) -> None:
        self.logprobs = torch.as_tensor(self.logprobs, dtype=torch.float32).reshape(-1)
        self.entropies = torch.as_tensor(self.entropies, dtype=torch.float32).reshape(-1)


class StepReward(ABC):
    """Interface: `reward(step: StepInfo) -> float in [0, 1]`, higher = better / more confident step.

    ReCo (arXiv, abstract only) drives compression, the reflection penalty and stopping from a
    step-level process reward; implementations: `ConfidenceReward` (training-free proxy, default) and
    `PRMReward` (a real, user-supplied PRM).
    """

    @abstractmethod
    def __call__(self, step: StepInfo) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


class ConfidenceReward(StepReward):
    """Default step reward: a training-free CONFIDENCE PROXY, not a process reward model.

    It only looks at the policy model's own token distribution over the step:

        reward = w * mean_t p(chosen_t) + (1 - w) * (1 - mean_t H_t / log V)

    where `p(chosen_t) = exp(logprob_t)` and `H_t` is the entropy of the distribution at token t,
    normalised by its maximum `log V`. Both terms lie in [0, 1], so does the reward. A step the model
    wrote with peaked, agreeing distributions scores high; hesitant steps score low. It says nothing
    about *correctness*: a confidently wrong step scores high. Use `PRMReward` with a trained PRM for a
    real process reward.

    Args:
        weight: `w`, weight of the mean chosen-token probability (the rest goes to the entropy term).
        vocab_size: used when the `StepInfo` carries none; without either, only the probability term.
        empty_reward: returned for steps with no usable token statistics.
    """

    def __init__(self, weight: float = 0.5, vocab_size: int | None = None, empty_reward: float = 0.5):
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight must be in [0, 1], got {weight}")
        self.weight = float(weight)
        self.vocab_size = vocab_size
        self.empty_reward = float(empty_reward)

    def __call__(self, step: StepInfo) -> float:
        lp = torch.as_tensor(step.logprobs, dtype=torch.float32)
        ent = torch.as_tensor(step.entropies, dtype=torch.float32)
        lp = lp[~torch.isnan(lp)]
        ent = ent[torch.isfinite(ent)]
        if lp.numel() == 0:
            return self.empty_reward
        prob = lp.exp().clamp(0.0, 1.0).mean().item()
        v = step.vocab_size or self.vocab_size
        if v is None or v < 2 or ent.numel() == 0:
            return float(min(1.0, max(0.0, prob)))
        h = (ent / math.log(v)).clamp(0.0, 1.0).mean().item()
        r = self.weight * prob + (1.0 - self.weight) * (1.0 - h)
        return float(min(1.0, max(0.0, r)))

    def __repr__(self) -> str:
        return f"ConfidenceReward(weight={self.weight})"


class PRMReward(StepReward):
    """Adapter for a user-supplied process reward model (what ReCo's "process reward" means literally).

    Args:
        fn: `fn(prefix_text, step_text) -> float`: the PRM's score of `step_text` given the partial
            solution (prompt + earlier steps) `prefix_text`.
        transform: optional map of the raw score into [0, 1] (e.g. a sigmoid for logits). The result is
            clamped to [0, 1]; a NaN score raises.

    `PRMReward.from_hf(model, tokenizer, positive_label=...)` wraps a Hugging Face
    sequence-classification model that scores a partial solution. Note the PRM runs synchronously inside
    `generate` at each completed step.
    """

    def __init__(self, fn: Callable[[str, str], float], transform: Callable[[float], float] | None = None):
        self.fn = fn
        self.transform = transform

    def __call__(self, step: StepInfo) -> float:
        r = float(self.fn(step.prefix_text, step.text))
        if self.transform is not None:
            r = float(self.transform(r))
        if math.isnan(r):
            raise ValueError("PRM returned NaN")
        return min(1.0, max(0.0, r))

    @classmethod
    def from_hf(
        cls,
        model: Any,
        tokenizer: Any,
        positive_label: int | str = 1,
        template: str = "{prefix}{step}",
        max_length: int | None = None,
    ) -> PRMReward:
        """A PRM from an HF `*ForSequenceClassification` model and its tokenizer.

        The partial solution `template.format(prefix=..., step=...)` is classified; the reward is the
        softmax probability of `positive_label` (an index, or a name looked up in
        `model.config.label2id`); a one-logit head gives `sigmoid(logit)`. With `max_length`, the input
        keeps its LAST `max_length` tokens (the newest step matters most).
        """
        if isinstance(positive_label, str):
            label2id = getattr(model.config, "label2id", None) or {}
            if positive_label not in label2id:
                raise ValueError(f"label {positive_label!r} not in model.config.label2id {label2id}")
            idx = int(label2id[positive_label])
        else:
            idx = int(positive_label)

        def fn(prefix: str, step: str) -> float:
            text = template.format(prefix=prefix, step=step)
            enc = tokenizer(text, return_tensors="pt")
            ids = enc["input_ids"]
            mask = enc.get("attention_mask", torch.ones_like(ids))
            if max_length is not None:
                ids, mask = ids[:, -max_length:], mask[:, -max_length:]
            device = next(model.parameters()).device
            with torch.no_grad():
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[0].float()
            if logits.numel() == 1:
                return torch.sigmoid(logits).item()
            return torch.softmax(logits, dim=-1)[idx].item()

        return cls(fn)


# --------------------------------------------------------------------------------------------------
# Reward tracking
# --------------------------------------------------------------------------------------------------


class _Row:
    def __init__(self, stream: StepStream, prompt_text: str):
        self.stream = stream
        self.prompt_text = prompt_text
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.steps: list[StepInfo] = []
        self.rewards: list[float] = []


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
    (history), `steps` (all completed `StepInfo`s, in completion order, each with `.row`),
    `steps_of(row)`, `generated_text(row)`, `partial_text(row)`, `finalize()`.
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
        low, high: reward thresholds, `0 <= low <= high <= 1`.
        min_scale, max_scale: budget fractions at high and low reward, `0 < min_scale <= max_scale`.
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


# --------------------------------------------------------------------------------------------------
# Reflection penalty
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# Early stopping
# --------------------------------------------------------------------------------------------------

#: "answer is", GSM8K's "####", LaTeX "\boxed".
DEFAULT_ANSWER_PATTERN = r"answer is|####|\\boxed"


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
