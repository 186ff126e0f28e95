"""Free generation: greedy answers with the full cache and with a method's cache, compared by their final
numbers (agreement) and against GSM8K's `####` answers. Re-exported by `kvcompose.bench.fidelity`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .metrics import extract_answer, gsm8k_answer
from ..traces import _device, prompt_ids


# ------------------------------------------------------------------------------------ free generation
@dataclass
class FreeGenRow:
    id: str
    gold: str | None
    full_answer: str | None
    answer: str | None
    full_text: str
    text: str
    new_tokens: int
    full_new_tokens: int


@dataclass
class FreeGenResult:
    """Greedy answers with the full cache and with the method: agreement of the final numbers and exact match
    against GSM8K's `####` number (for both)."""

    rows: list[FreeGenRow]

    @property
    def agreement(self) -> float:
        """Share of questions where both runs end with the same number (a run without a number never agrees)."""
        if not self.rows:
            return float("nan")
        return sum(r.answer is not None and r.answer == r.full_answer for r in self.rows) / len(self.rows)

    @property
    def text_agreement(self) -> float:
        return sum(r.text == r.full_text for r in self.rows) / len(self.rows) if self.rows else float("nan")

    @property
    def exact_match(self) -> float:
        rs = [r for r in self.rows if r.gold is not None]
        return sum(r.answer == r.gold for r in rs) / len(rs) if rs else float("nan")

    @property
    def full_exact_match(self) -> float:
        rs = [r for r in self.rows if r.gold is not None]
        return sum(r.full_answer == r.gold for r in rs) / len(rs) if rs else float("nan")

    def summary(self) -> dict[str, Any]:
        return {"answer_agreement": self.agreement, "text_agreement": self.text_agreement,
                "full_has_number": sum(r.full_answer is not None for r in self.rows) / max(1, len(self.rows)),
                "exact_match": self.exact_match, "full_exact_match": self.full_exact_match, "n": len(self.rows),
                "mean_new_tokens": sum(r.new_tokens for r in self.rows) / max(1, len(self.rows))}


_FULL_GEN: "OrderedDict[tuple, tuple[list[str], list[int]]]" = OrderedDict()


@torch.no_grad()
def _greedy_answers(model, tok, questions: list[dict[str, Any]], cache_factory, max_new_tokens: int,
                    batch_size: int) -> tuple[list[str], list[int]]:
    device = _device(model)
    pad_id = model.generation_config.pad_token_id
    eos = model.generation_config.eos_token_id
    eos_set = set(eos if isinstance(eos, list) else [eos])
    texts, lens = [], []
    for s in range(0, len(questions), batch_size):
        prompts = [prompt_ids(tok, q["question"]) for q in questions[s : s + batch_size]]
        width = max(len(p) for p in prompts)
        pid = pad_id if pad_id is not None else 0
        ids = torch.tensor([[pid] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        kw = {"past_key_values": cache_factory()} if cache_factory is not None else {}
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=pid, **kw)
        for row in out[:, width:].tolist():
            n = next((i for i, t in enumerate(row) if t in eos_set), len(row))
            texts.append(tok.decode(row[:n], skip_special_tokens=True))
            lens.append(n)
    return texts, lens


def free_generation(model, tok, questions: list[dict[str, Any]], make_cache: Callable[[], Any],
                    max_new_tokens: int = 384, batch_size: int = 8) -> FreeGenResult:
    """Greedy generation with the full cache (cached per question set in this process) and with
    `make_cache()`; compares the last number of each answer with the full cache's and with GSM8K's `####`.

    `make_cache` is called once per batch of `batch_size` questions (left-padded batch).
    """
    key = (id(model), tuple(q["question"] for q in questions), max_new_tokens, batch_size)
    if key not in _FULL_GEN:
        _FULL_GEN[key] = _greedy_answers(model, tok, questions, None, max_new_tokens, batch_size)
        while len(_FULL_GEN) > 4:
            _FULL_GEN.popitem(last=False)
    full_texts, full_lens = _FULL_GEN[key]
    texts, lens = _greedy_answers(model, tok, questions, make_cache, max_new_tokens, batch_size)
    rows = [
        FreeGenRow(id=str(q.get("id", i)), gold=gsm8k_answer(q.get("answer")), full_answer=extract_answer(ft),
                   answer=extract_answer(t), full_text=ft, text=t, new_tokens=n, full_new_tokens=fn)
        for i, (q, ft, t, n, fn) in enumerate(zip(questions, full_texts, texts, lens, full_lens))
    ]
    return FreeGenResult(rows)
