"""Reference traces (library: the fidelity benchmark and calibration read them): the full cache's own continuations (sampled or greedy) or
worked GSM8K solutions, each with its chat prompt and a prompt-recall probe. See `kvcompose.bench.fidelity`
for the protocol; questions come from `kvcompose.data`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from .seeding import derived_seed
from .view import KVComposeError

__all__ = ["Trace", "RepetitionGuard", "make_traces", "recall_ids", "prompt_ids", "RECALL_INSTRUCTION"]

RECALL_INSTRUCTION = "Restate the original question word for word."
TraceKind = Literal["sampled", "greedy", "worked"]


@dataclass
class Trace:
    """One teacher-forcing item.

    Attributes:
        id: stable identifier (e.g. `"gsm8k-3/sampled"`).
        prompt_ids: the chat prompt's token ids (system/user turn and assistant prefix).
        trace_ids: the continuation to teacher-force (the full-cache reference or worked text).
        question: the user question.
        answer: the reference answer text (GSM8K worked solution ending in `#### n`) or None.
        kind: "sampled", "greedy" or "worked".
        recall_ids: token ids appended after the trace for the prompt-recall probe (end of the assistant
            turn, a user turn with `RECALL_INSTRUCTION`, the assistant prefix); empty = no probe.
        recall_target_ids: the question's token ids, scored after `recall_ids`.
    """

    id: str
    prompt_ids: list[int]
    trace_ids: list[int]
    question: str
    answer: str | None
    kind: str
    recall_ids: list[int] = field(default_factory=list)
    recall_target_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trace":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})



def _clean_worked(answer: str) -> str:
    """A GSM8K worked solution as plain text: calculator annotations removed, `#### n` -> `The answer is n.`"""
    text = re.sub(r"<<[^>]*>>", "", answer)
    if "####" in text:
        body, final = text.rsplit("####", 1)
        text = body.rstrip() + f"\nThe answer is {final.strip()}."
    return text.strip()



@dataclass(frozen=True)
class RepetitionGuard:
    """Keeps a small model's sampled reference from looping (a looping trace makes every method look good).

    Default: `no_repeat_ngram_size=0` and `repetition_penalty=1.1`, the mild penalty of CTRL (Keskar et al.,
    2019) that many chat front ends use; `no_repeat_ngram_size` (ban any repeated n-gram) is available but
    harsher on math text, where phrases legitimately repeat. Both are passed to `model.generate`.
    """

    repetition_penalty: float = 1.1
    no_repeat_ngram_size: int = 0

    def generate_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self.repetition_penalty != 1.0:
            kw["repetition_penalty"] = self.repetition_penalty
        if self.no_repeat_ngram_size > 0:
            kw["no_repeat_ngram_size"] = self.no_repeat_ngram_size
        return kw


def _device(model) -> torch.device:
    return next(model.parameters()).device


def prompt_ids(tok, question: str, system: str | None = None) -> list[int]:
    """Token ids of the chat prompt for one user `question` (optional `system` turn), with the assistant
    prefix, built with the tokenizer's chat template (no extra special tokens)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def recall_ids(tok, question: str) -> tuple[list[int], list[int]]:
    """Token ids of the prompt-recall probe: (end of turn + user turn with the instruction + assistant
    prefix, the question's tokens). Built with the tokenizer's chat template."""
    msgs = [{"role": "user", "content": "X"}, {"role": "assistant", "content": "Y"},
            {"role": "user", "content": RECALL_INSTRUCTION}]
    full = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    start = full.index("Y") + 1
    suffix = full[start:]
    ids = list(tok(suffix, add_special_tokens=False)["input_ids"])
    target = list(tok(question, add_special_tokens=False)["input_ids"])
    return ids, target


def _special_ids(tok, model) -> list[int]:
    ids = set(getattr(tok, "all_special_ids", []) or [])
    eos = model.generation_config.eos_token_id
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(i for i in ids if i is not None and i >= 0)


@torch.no_grad()
def make_traces(
    model,
    tok,
    questions: list[dict[str, Any]],
    new_tokens: int = 1536,
    kind: str = "sampled",
    seed: int = 0,
    temperature: float = 0.7,
    top_p: float = 0.95,
    repetition_guard: RepetitionGuard = RepetitionGuard(),
    pool: list[dict[str, Any]] | None = None,
    batch_size: int = 8,
    system: str | None = None,
    progress: bool = False,
    done: dict[int, list[Trace]] | None = None,
    on_batch: Callable[[int, list[Trace]], None] | None = None,
) -> list[Trace]:
    """Full-cache reference traces of `new_tokens` tokens for each question (see the module docstring).

    Args:
        questions: records with 'question' (and optional 'answer', 'id'), e.g. from `load_questions`.
        kind: "sampled" (seeded, `temperature`, `top_p`), "greedy", or "worked" (GSM8K worked solutions
            chained: the question's own, then others from `pool`, default `questions`; needs 'answer').
        repetition_guard: passed to `generate` for "sampled" and "greedy".
        batch_size: questions generated together (left padding); the seed is set once per batch.
        done: traces of batches made before (batch index -> its traces, e.g. from a run that was stopped):
            those batches are not generated again. Each batch draws from its own seed, so the result is the
            same as one run's.
        on_batch: called with (batch index, its traces) after each batch is generated (to save them).
    """
    if kind not in ("sampled", "greedy", "worked"):
        raise KVComposeError(f"kind must be 'sampled', 'greedy' or 'worked', got {kind!r}")
    if new_tokens <= 0:
        raise KVComposeError(f"new_tokens must be positive, got {new_tokens}")
    if not questions:
        return []
    base = []
    for i, q in enumerate(questions):
        rid, target = recall_ids(tok, q["question"])
        base.append(dict(id=f"{q.get('id', i)}/{kind}", prompt_ids=prompt_ids(tok, q["question"], system),
                         question=q["question"], answer=q.get("answer"), kind=kind,
                         recall_ids=rid, recall_target_ids=target))
    if kind == "worked":
        return [Trace(trace_ids=_worked_ids(tok, q, pool if pool is not None else questions, new_tokens, seed + i), **b)
                for i, (q, b) in enumerate(zip(questions, base))]

    from tqdm.auto import tqdm

    device = _device(model)
    suppress = _special_ids(tok, model)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = suppress[0] if suppress else 0
    traces: list[Trace] = []
    batches = [list(range(s, min(s + batch_size, len(base)))) for s in range(0, len(base), batch_size)]
    for bi, idx in enumerate(tqdm(batches, desc=f"{kind} traces", disable=not progress, unit="batch")):
        if done and bi in done:
            got = done[bi]
            if [(t.id, t.question) for t in got] != [(base[i]["id"], base[i]["question"]) for i in idx]:
                raise KVComposeError(f"the saved traces of batch {bi} are of other questions than this run's")
            traces += got
            continue
        prompts = [base[i]["prompt_ids"] for i in idx]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        torch.manual_seed(derived_seed(seed, bi))
        gen_kw: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, suppress_tokens=suppress,
                                      pad_token_id=pad_id, **repetition_guard.generate_kwargs())
        if kind == "sampled":
            gen_kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            gen_kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = model.generate(input_ids=ids, attention_mask=mask, **gen_kw)
        made = [Trace(trace_ids=out[row, width:].tolist(), **base[i]) for row, i in enumerate(idx)]
        if on_batch is not None:
            on_batch(bi, made)
        traces += made
    return traces


def _worked_ids(tok, q: dict[str, Any], pool: list[dict[str, Any]], new_tokens: int, seed: int) -> list[int]:
    if not q.get("answer"):
        raise KVComposeError("kind='worked' needs an 'answer' (a worked solution) for every question")
    others = [p for p in pool if p.get("answer") and p["question"] != q["question"]]
    if not others:
        raise KVComposeError("kind='worked' needs other questions with worked solutions in `pool`")
    rng = random.Random(seed)
    order = others[:]
    rng.shuffle(order)
    text = _clean_worked(q["answer"])
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    k = 0
    while len(ids) < new_tokens:
        p = order[k % len(order)]
        k += 1
        more = f"\n\nNext problem: {p['question'].strip()}\n{_clean_worked(p['answer'])}"
        ids += list(tok(more, add_special_tokens=False)["input_ids"])
    return ids[:new_tokens]
