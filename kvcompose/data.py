"""Questions and their answers (library; calibration, `kvcompose generate` and the benchmarks read them here):
local JSONL files, Hugging Face datasets, and a few built-in demo questions.

One module serves `kvcompose bench fidelity`, `kvcompose bench accuracy`, `kvcompose generate` and the
benchmark scripts. Every record is a dict `{"id", "question", "answer"}` where `answer` is the reference: for
GSM8K its worked solution ending in `#### n` (graders read the number after `####`), for MATH-500 and AIME the
final answer itself (LaTeX or an integer).

Where questions come from (`resolve_questions`), in this order:

1. `data=FILE.jsonl`: a local JSONL file with a `question` (or `problem`) field per line and an optional
   `answer`; GSM8K's `test.jsonl` has this format.
2. `dataset=NAME`: one of `DATASETS` (`gsm8k`, `math500`, `aime24`, `aime25`), downloaded with Hugging Face
   `datasets` (`pip install kvcompose[eval]`; needs the hub, or the dataset already in the local HF cache).
3. `$KVCOMPOSE_GSM8K`: a GSM8K-style JSONL named by this environment variable (what CI sets).

With none of them, or offline without a cached copy, a `KVComposeError` says both ways (`--data` or
`--dataset` with network access). No path of any particular machine is built in.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

from .view import KVComposeError

__all__ = [
    "DEMO_QUESTIONS", "demo_question", "load_questions", "load_hf_dataset", "resolve_questions",
    "default_data_path", "DATASETS", "HFDataset", "ENV_GSM8K", "gsm8k_answer", "extract_answer", "norm_number",
]

ENV_GSM8K = "KVCOMPOSE_GSM8K"

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
"""A few GSM8K-style demo questions written for kvcompose (not from GSM8K), with worked answers in GSM8K's
format (`#### n`). Used by `kvcompose generate` without --question/--data, and by the examples."""


def demo_question(index: int = 0) -> dict[str, Any]:
    """One of the demo questions (index modulo their number)."""
    return dict(DEMO_QUESTIONS[index % len(DEMO_QUESTIONS)])


# ------------------------------------------------------------------------------------------ local JSONL
_QUESTION_KEYS = ("question", "problem", "Question", "Problem")
_ANSWER_KEYS = ("answer", "Answer", "final_answer")


def _record(rec: dict[str, Any], default_id: str, where: str) -> dict[str, Any]:
    q = next((rec[k] for k in _QUESTION_KEYS if k in rec), None)
    if q is None:
        raise KVComposeError(f"{where}: record has no 'question' (or 'problem') field")
    a = next((rec[k] for k in _ANSWER_KEYS if k in rec), None)
    rid = rec.get("id", rec.get("unique_id", rec.get("ID", default_id)))
    return {"id": str(rid), "question": str(q), "answer": None if a is None else str(a)}


def load_questions(path: str | os.PathLike, n: int | None = None, offset: int = 0) -> list[dict[str, Any]]:
    """Read `n` records (all with `n=None`) from line `offset` of a JSONL file with a `question` field (or
    MATH's `problem`) and an optional `answer`. GSM8K's test split has this format
    (`{"question": ..., "answer": "... #### 18"}`). Ids default to `<file stem>-<line>`."""
    if path is None:
        raise KVComposeError(f"no question file: pass --data FILE.jsonl (e.g. GSM8K's test.jsonl) or set ${ENV_GSM8K}")
    p = Path(path)
    if not p.exists():
        raise KVComposeError(
            f"question file {str(p)!r} not found: pass a JSONL file with a 'question' field per line "
            "(e.g. GSM8K's test.jsonl) with --data"
        )
    if (n is not None and n < 0) or offset < 0:
        raise KVComposeError(f"n and offset must be >= 0, got n={n}, offset={offset}")
    out: list[dict[str, Any]] = []
    with p.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < offset or not line.strip():
                continue
            if n is not None and len(out) >= n:
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise KVComposeError(f"{p}:{i + 1}: not a JSON line ({e.msg})") from None
            out.append(_record(rec, f"{p.stem}-{i}", f"{p}:{i + 1}"))
    return out


def default_data_path() -> str | None:
    """The GSM8K-style JSONL named by `$KVCOMPOSE_GSM8K`, if it exists; otherwise None."""
    p = os.environ.get(ENV_GSM8K)
    return p if p and Path(p).exists() else None


# ------------------------------------------------------------------------------------------ Hugging Face hub
@dataclass(frozen=True)
class HFDataset:
    """A public dataset on the Hugging Face hub and how to read it.

    Attributes:
        repo: the dataset id (`datasets.load_dataset(repo, config, split=split)`).
        config: its configuration name (None = default).
        split: the evaluation split.
        question: the field with the problem text; answer: the field with the reference answer.
        id_field: a field with a stable id (None = `<name>-<row>`).
        note: where the dataset comes from (for the docs).
    """

    repo: str
    config: str | None
    split: str
    question: str
    answer: str
    id_field: str | None = None
    note: str = ""


DATASETS: dict[str, HFDataset] = {
    "gsm8k": HFDataset("openai/gsm8k", "main", "test", "question", "answer",
                       note="GSM8K (Cobbe et al., 2021), 1319 test problems; answers end in `#### n`"),
    "math500": HFDataset("HuggingFaceH4/MATH-500", None, "test", "problem", "answer", "unique_id",
                         note="MATH-500 (Lightman et al., 2023, 'Let's Verify Step by Step'), 500 MATH test problems"),
    "aime24": HFDataset("HuggingFaceH4/aime_2024", None, "train", "problem", "answer", "id",
                        note="AIME 2024 I and II, 30 problems (the set lighteval uses)"),
    "aime25": HFDataset("yentinglin/aime_2025", None, "train", "problem", "answer", "id",
                        note="AIME 2025 I and II, 30 problems (the set lighteval uses)"),
}


def _default_hub_loader(spec: HFDataset):
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise KVComposeError(
            f"loading {spec.repo} needs Hugging Face `datasets` (pip install 'kvcompose[eval]'), or pass a local "
            "JSONL file with --data FILE.jsonl"
        ) from None
    from datasets import load_dataset

    return load_dataset(spec.repo, spec.config, split=spec.split)


def load_hf_dataset(name: str, n: int | None = None, offset: int = 0,
                    loader: Callable[[HFDataset], Any] | None = None) -> list[dict[str, Any]]:
    """`n` records (all with None) from row `offset` of one of `DATASETS`, as `{"id", "question", "answer"}`.

    Args:
        name: a key of `DATASETS` ("gsm8k", "math500", "aime24", "aime25").
        loader: `HFDataset -> iterable of dict rows`; default `datasets.load_dataset(repo, config, split=...)`
            (tests pass a fake one: the hub is not reachable from CI).
    Raises:
        KVComposeError: unknown name, `datasets` missing, or the hub unreachable and no cached copy (the
            message says to pass `--data FILE.jsonl` instead).
    """
    if name not in DATASETS:
        raise KVComposeError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)} or pass --data FILE.jsonl")
    if (n is not None and n < 0) or offset < 0:
        raise KVComposeError(f"n and offset must be >= 0, got n={n}, offset={offset}")
    spec = DATASETS[name]
    try:
        rows = (loader or _default_hub_loader)(spec)
    except KVComposeError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds of network / cache errors
        raise KVComposeError(
            f"could not load {spec.repo} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"Offline? Either pass a local JSONL file with --data FILE.jsonl ('question' and 'answer' per line), "
            f"or run with network access to the Hugging Face hub (or with {spec.repo} in the local datasets cache)."
        ) from None
    out = []
    for i, row in enumerate(rows):
        if i < offset:
            continue
        if n is not None and len(out) >= n:
            break
        row = dict(row)
        if spec.question not in row or spec.answer not in row:
            raise KVComposeError(f"{spec.repo}: row {i} lacks {spec.question!r} or {spec.answer!r} "
                                 f"(fields: {sorted(row)})")
        rid = row.get(spec.id_field) if spec.id_field else None
        out.append({"id": f"{name}-{rid if rid is not None else i}", "question": str(row[spec.question]),
                    "answer": str(row[spec.answer])})
    return out


def resolve_questions(data: str | os.PathLike | None = None, dataset: str | None = None, n: int | None = None,
                      offset: int = 0, loader: Callable[[HFDataset], Any] | None = None,
                      ) -> tuple[list[dict[str, Any]], str]:
    """Questions from `data` (a JSONL file), else `dataset` (hub), else `$KVCOMPOSE_GSM8K`.

    Returns `(records, source)` where `source` names where they came from (the file path or the dataset id).
    Raises `KVComposeError` when there is no source, saying both ways to give one.
    """
    if data is not None and dataset is not None:
        raise KVComposeError("pass either --data FILE.jsonl or --dataset NAME, not both")
    if data is not None:
        return load_questions(data, n, offset), str(data)
    if dataset is not None:
        return load_hf_dataset(dataset, n, offset, loader), DATASETS[dataset].repo
    env = default_data_path()
    if env is not None:
        return load_questions(env, n, offset), env
    raise KVComposeError(
        "no questions: pass a local JSONL file with --data FILE.jsonl (a 'question' and an 'answer' field per line, "
        f"e.g. GSM8K's test.jsonl), or --dataset {{{','.join(DATASETS)}}} to download one with Hugging Face "
        f"`datasets` (needs network access to the hub), or set ${ENV_GSM8K} to a GSM8K-style JSONL file"
    )


# ---- answers: the number a reference or a generated text ends with ----
_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def norm_number(s: str) -> str | None:
    """The last number in `s` as a plain string: commas removed, trailing zeros of decimals dropped."""
    m = _NUM.findall(s)
    if not m:
        return None
    x = m[-1].replace(",", "")
    if "." in x:
        x = x.rstrip("0").rstrip(".")
    return x


def gsm8k_answer(answer: str | None) -> str | None:
    """The number after GSM8K's `####` (commas removed), or None."""
    if not answer or "####" not in answer:
        return None
    return norm_number(answer.split("####")[-1].strip())


def extract_answer(text: str) -> str | None:
    """The last number in a generated answer (commas removed, trailing zeros of decimals dropped)."""
    return norm_number(text)
