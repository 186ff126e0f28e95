"""Helpers of the local lm-eval task `kvcompose_tiny_math` (loaded by lm-eval through `!function`)."""

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "tiny_math.jsonl"


def load_tiny_math(**kwargs):
    """The four questions of ../tiny_math.jsonl as a `datasets.DatasetDict` with one `test` split."""
    import datasets

    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc, results):
    """exact_match = 1 when kvcompose's grader finds the generated answer equivalent to the reference."""
    from kvcompose.bench.grading import grade

    return {"exact_match": float(grade(results[0], doc["answer"]).correct)}
