"""A few GSM8K-style demo questions written for kvcompose (not from GSM8K), with worked answers in GSM8K's
format (`#### n`). Used by `kvcompose generate` without --question/--data, and by the examples."""

from __future__ import annotations

from typing import Any

__all__ = ["DEMO_QUESTIONS", "demo_question"]

DEMO_QUESTIONS: list[dict[str, Any]] = [
    {
        "id": "demo-0",
        "question": "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them "
        "and gives 5 to her neighbour. How many muffins does she have left?",
        "answer": "She makes 24 + 18 = 42 muffins.\nShe sells or gives away 30 + 5 = 35 muffins.\n"
        "She has 42 - 35 = 7 muffins left.\n#### 7",
    },
    {
        "id": "demo-1",
        "question": "Tom reads 12 pages of his book every day. The book has 180 pages and he has already "
        "read for 5 days. How many more days does he need to finish the book?",
        "answer": "He has read 12 * 5 = 60 pages.\n180 - 60 = 120 pages are left.\n"
        "He needs 120 / 12 = 10 more days.\n#### 10",
    },
    {
        "id": "demo-2",
        "question": "A garden has 6 rows of tomato plants with 8 plants in each row. Each plant gives 3 "
        "tomatoes. The gardener keeps 20 tomatoes and sells the rest for $2 each. How much money does he make?",
        "answer": "There are 6 * 8 = 48 plants.\nThey give 48 * 3 = 144 tomatoes.\n"
        "He sells 144 - 20 = 124 tomatoes.\nHe makes 124 * 2 = $248.\n#### 248",
    },
    {
        "id": "demo-3",
        "question": "Maria buys 3 notebooks for $4 each and 2 pens for $1.50 each. She pays with a $20 bill. "
        "How much change does she get?",
        "answer": "The notebooks cost 3 * 4 = $12.\nThe pens cost 2 * 1.50 = $3.\n"
        "She spends 12 + 3 = $15.\nHer change is 20 - 15 = $5.\n#### 5",
    },
]


def demo_question(index: int = 0) -> dict[str, Any]:
    """One of the demo questions (index modulo their number)."""
    return dict(DEMO_QUESTIONS[index % len(DEMO_QUESTIONS)])
