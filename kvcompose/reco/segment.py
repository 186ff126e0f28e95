"""ReCo step segmentation: splitting chain-of-thought text into reasoning steps, whole or token by token.

ReCo (arXiv "ReCo", reward-coordinated compression; abstract only) rewards reasoning *steps* but does not
define one. The rules here (blank lines and "Step k" markers by default, optionally sentence ends) and
the incremental, token-level `StepStream` used by `RewardTracker` are our design.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ._tokens import _decode

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
]


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
