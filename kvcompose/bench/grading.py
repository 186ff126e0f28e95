"""Grading of generated math answers against a reference, the way the reasoning-model papers grade.

`grade(prediction, reference)`:

1. The reference: GSM8K's worked solution gives the number after its last `####` (Cobbe et al., 2021); a
   reference with `\\boxed{...}` gives the box's content; anything else (MATH-500, AIME) is used as is.
2. The prediction's final answer (`extract_final_answer`): text after the last `</think>` when there is any
   (R1-style reasoning models), then in this order: the content of the last `\\boxed{...}` (so of several boxed
   answers the last one counts), the text after the last `####`, the rest of the line after the last
   "answer is" / "Answer:", and last of all the last number of the text.
3. Equivalence: Hugging Face `math-verify` (`parse` + `verify`: LaTeX, fractions, `\\frac{1}{2}` = 0.5, sets,
   intervals, units in `\\text{}`, percentages), or, when the reference is a plain number, numeric equality
   after removing `$`, thousands separators, a trailing period and trailing unit words (`18 dollars`,
   `5 cm`). Either one suffices. Without `math-verify` installed only the numeric and exact-string checks run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .metrics import gsm8k_answer, norm_number

__all__ = ["grade", "extract_final_answer", "answers_agree", "Grade", "has_math_verify", "as_number"]


@dataclass(frozen=True)
class Grade:
    """The outcome of `grade`.

    Attributes:
        correct: the prediction's final answer is equivalent to the reference's.
        predicted: the final answer extracted from the prediction (None when there is none).
        reference: the reference's final answer.
        by: which check decided: "math_verify", "number", "string", or "none" (no answer found).
    """

    correct: bool
    predicted: str | None
    reference: str | None
    by: str


def has_math_verify() -> bool:
    """Whether Hugging Face `math-verify` can be imported (`pip install 'kvcompose[eval]'`)."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def _last_braced(text: str, command: str) -> str | None:
    """The content of the last `\\command{...}` (balanced braces), or of `\\command x` (one token)."""
    start = text.rfind(command)
    while start >= 0:
        i = start + len(command)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
                j += 1
        elif i > start + len(command):  # "\boxed 5"
            m = re.match(r"[^\s$]+", text[i:])
            if m:
                return m.group(0).strip()
        start = text.rfind(command, 0, start)
    return None


_FIRST_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*(.+)", re.I)


def _clean(s: str) -> str:
    s = s.strip()
    s = re.sub(r"^\$+|\$+$", "", s).strip()  # $...$ math delimiters
    s = re.sub(r"^\\\(|\\\)$", "", s).strip()
    s = s.rstrip(".").rstrip()
    return s


def extract_final_answer(text: str | None) -> str | None:
    """The final answer of a generated solution (see the module docstring for the order of the rules).

    Returns the answer's text (LaTeX kept, a trailing period and `$...$` delimiters removed), or None.
    """
    if not text:
        return None
    parts = [text.rsplit("</think>", 1)[1], text] if "</think>" in text else [text]
    for t in parts:
        for cmd in ("\\boxed", "\\fbox"):
            got = _last_braced(t, cmd)
            if got:
                return _clean(got)
        if "####" in t:
            tail = t.rsplit("####", 1)[1].strip().splitlines()
            if tail and tail[0].strip():
                return _clean(tail[0])
        m = None
        for m in _ANSWER_IS.finditer(t):
            pass
        if m is not None:
            line = m.group(1).strip().splitlines()[0] if m.group(1).strip() else ""
            line = re.split(r"(?<=[^\d])\.\s|\.$", line)[0]
            if line.strip():
                first = _FIRST_NUM.search(line)
                cleaned = _clean(line)
                # "The answer is 42 apples because 6 * 7" -> the first number when the line is prose
                if first is not None and not re.search(r"\\[a-zA-Z]|[{}^]", cleaned) and re.search(r"[a-zA-Z]{3,}", cleaned):
                    return norm_number(first.group(0))
                return cleaned
    num = norm_number(parts[0]) or norm_number(text)
    return num


_UNIT_TAIL = re.compile(r"^(-?[\d.,]+)\s*(?:%|\\%|[a-zA-Z][a-zA-Z .]*)?$")


def as_number(s: str | None) -> Fraction | None:
    """`s` as an exact number when it is one: `1,000`, `$18`, `\\$18.00`, `18.`, `-3`, `0.5`, `1/2`,
    `\\frac{1}{2}`, `5 cm`, `18 dollars`, `\\text{5 cm}`; otherwise None."""
    if s is None:
        return None
    t = s.strip()
    t = re.sub(r"\\text\{([^{}]*)\}", r" \1", t)
    t = re.sub(r"\\(?:mbox|mathrm)\{([^{}]*)\}", r" \1", t)
    t = t.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", ",").replace("\\ ", " ").strip()
    t = t.rstrip(".").strip()
    m = re.fullmatch(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", t) or re.fullmatch(r"(-?)(\d+)\s*/\s*(\d+)", t)
    if m:
        sign, a, b = m.groups()
        if int(b) == 0:
            return None
        x = Fraction(int(a), int(b))
        return -x if sign else x
    m = _UNIT_TAIL.match(t)
    if not m:
        return None
    num = m.group(1).rstrip(".,")
    if "," in num:
        if not re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", num):
            return None  # "1,2" is a list, not a number
        num = num.replace(",", "")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+", num):
        return None
    return Fraction(num)


def _reference_answer(reference: str) -> str:
    ref = reference.strip()
    if "####" in ref:
        return gsm8k_answer(ref) or _clean(ref.rsplit("####", 1)[1])
    if "\\boxed" in ref:
        return _last_braced(ref, "\\boxed") or ref
    return _clean(ref)


def _latex(s: str) -> str:
    t = s.replace("\\$", "")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", t.strip()):
        t = t.replace(",", "")
    return f"${t}$"


def _math_verify(ref: str, pred: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    try:
        g, p = parse(_latex(ref)), parse(_latex(pred))
        return bool(g) and bool(p) and bool(verify(g, p))
    except Exception:  # noqa: BLE001 - math-verify can time out or fail on odd LaTeX: then not equal
        return False


def answers_agree(a: str | None, b: str | None) -> bool:
    """Two extracted final answers are equivalent (numerically, by math-verify, or as equal strings).
    A missing answer never agrees."""
    if a is None or b is None:
        return False
    if a.strip() == b.strip():
        return True
    na, nb = as_number(a), as_number(b)
    if na is not None and nb is not None:
        return na == nb
    return _math_verify(a, b)


def grade(prediction: str | None, reference: str | None) -> Grade:
    """Grade one generated solution against a reference answer (see the module docstring).

    Args:
        prediction: the model's generated text (the whole solution).
        reference: GSM8K worked solution (`... #### 18`), a boxed solution, or a final answer (`\\frac{1}{2}`).
    """
    if reference is None or not str(reference).strip():
        return Grade(False, extract_final_answer(prediction), None, "none")
    ref = _reference_answer(str(reference))
    pred = extract_final_answer(prediction)
    if pred is None:
        return Grade(False, None, ref, "none")
    nr, np_ = as_number(ref), as_number(pred)
    if nr is not None and np_ is not None:
        if nr == np_:
            return Grade(True, pred, ref, "number")
    if pred.strip() == ref.strip():
        return Grade(True, pred, ref, "string")
    if _math_verify(ref, pred):
        return Grade(True, pred, ref, "math_verify")
    return Grade(False, pred, ref, "number" if nr is not None and np_ is not None else "math_verify")
