"""The answer grader of the accuracy benchmark (kvcompose.bench.grading): tricky answers, and properties."""

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcompose.data import load_questions
from kvcompose.bench.grading import answers_agree, as_number, extract_final_answer, grade

mv = pytest.importorskip("math_verify")  # the eval extra; CI installs it

# (generated text, reference, correct?)
TABLE = [
    # thousands separators
    ("The total is 1,000 apples.", "#### 1,000", True),
    ("The total is 1,000 apples.", "#### 1000", True),
    ("\\boxed{1,000,000}", "1000000", True),
    ("The answer is 1,2", "12", False),  # a list, not twelve
    # dollar signs, escaped or not
    ("So she pays $18.", "She pays 18\n#### 18", True),
    ("He pays \\$18.", "#### 18", True),
    ("The answer is \\$18.00", "#### 18", True),
    # units
    ("It is 5 cm long. The answer is 5 cm.", "5", True),
    ("\\boxed{10\\text{ dollars}}", "10", True),
    ("The answer is 18 dollars.", "#### 18", True),
    # fractions vs decimals
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("The answer is 0.5", "\\frac{1}{2}", True),
    ("Final answer: $\\dfrac{3}{4}$", "0.75", True),
    ("The answer is 1/2.", "0.5", True),
    ("\\boxed{\\frac{1}{3}}", "0.33", False),
    # negative numbers
    ("The answer is -3.", "#### -3", True),
    ("The answer is 3.", "#### -3", False),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", True),
    # trailing period, last number
    ("So 7.", "#### 7", True),
    ("First 3 then 4 so 12.", "#### 12", True),
    # several boxed answers: the last one counts
    ("First \\boxed{3}, then corrected: \\boxed{5}", "5", True),
    ("First \\boxed{5}, then corrected: \\boxed{3}", "5", False),
    # GSM8K's own convention in the generation
    ("3 + 4 = 7\n#### 7", "#### 7", True),
    ("#### 10\nthat is all", "10", True),
    # reasoning models: the answer after </think> wins over numbers inside it
    ("<think>maybe 4, or 9</think> The answer is \\boxed{12}", "12", True),
    # LaTeX equivalences only math-verify knows
    ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}", True),
    ("\\boxed{(1, 2)}", "(1,2)", True),
    ("\\boxed{x = 2}", "2", True),
    # nothing to grade
    ("no number here", "5", False),
    ("", "5", False),
]


@pytest.mark.parametrize("text,reference,correct", TABLE)
def test_grade_table(text, reference, correct):
    g = grade(text, reference)
    assert g.correct is correct, g


def test_extract_final_answer_rules():
    assert extract_final_answer("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"  # nested braces
    assert extract_final_answer("\\boxed 5 and more") == "5"
    assert extract_final_answer("x \\boxed{1} y \\boxed{2}") == "2"
    assert extract_final_answer("step 1: 3 apples\n#### 42") == "42"
    assert extract_final_answer("The answer is $\\frac{7}{2}$.") == "\\frac{7}{2}"
    assert extract_final_answer("The answer is 42 apples because 6 * 7.") == "42"
    assert extract_final_answer("I think it is 8, no wait, 9.") == "9"
    assert extract_final_answer("nothing") is None
    assert extract_final_answer(None) is None


def test_as_number():
    assert as_number("1,234") == 1234
    assert as_number("$-1,234.50") == as_number("-1234.5")
    assert as_number("\\frac{1}{2}") == as_number("0.5") == as_number("1/2")
    assert as_number("5 cm") == 5
    assert as_number("1,2") is None
    assert as_number("x + 1") is None
    assert as_number("1/0") is None


def test_reference_forms_and_agreement():
    assert grade("so \\boxed{7}", "She has \\boxed{7} muffins").correct  # boxed reference
    assert grade("7", None).correct is False  # no reference: never correct
    assert answers_agree("0.5", "\\frac{1}{2}") and answers_agree("12", "12")
    assert not answers_agree("12", "13") and not answers_agree(None, None) and not answers_agree("3", None)


def _formats(n: int) -> list[str]:
    s = f"{n:,}"
    return [
        f"The answer is {n}.", f"The answer is {s}.", f"#### {s}", f"\\boxed{{{s}}}", f"\\boxed{{{n}}}",
        f"So the total is ${s}.", f"It costs \\${n}.00 in all.", f"Final answer: {n}", f"\\boxed{{{n}.0}}",
        f"We get {n} apples",
    ]


@given(st.integers(-10**9, 10**9), st.sampled_from(["plain", "gsm8k", "boxed"]))
def test_integer_in_any_format_grades_equal_to_itself(n, ref_kind):
    ref = {"plain": str(n), "gsm8k": f"work\n#### {n:,}", "boxed": f"\\boxed{{{n}}}"}[ref_kind]
    for text in _formats(n):
        assert grade(text, ref).correct, (text, ref)


@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))
def test_a_different_integer_is_wrong(n, m):
    if n == m:
        return
    for text in _formats(m):
        assert not grade(text, f"#### {n:,}").correct, (text, n)


@pytest.mark.skipif(not os.environ.get("KVCOMPOSE_GSM8K"), reason="set KVCOMPOSE_GSM8K to GSM8K's test.jsonl")
def test_gsm8k_worked_solutions_grade_correct_against_themselves():
    qs = load_questions(os.environ["KVCOMPOSE_GSM8K"], 200)
    assert len(qs) == 200
    for q in qs:
        assert grade(q["answer"], q["answer"]).correct, q["id"]
    # and a worked solution is wrong against the next question's reference (when the numbers differ)
    wrong = [grade(a["answer"], b["answer"]).correct for a, b in zip(qs, qs[1:])
             if a["answer"].split("####")[-1].strip() != b["answer"].split("####")[-1].strip()]
    assert wrong and not any(wrong)
