"""Tokenizer helpers shared by the ReCo modules (tolerant of minimal tokenizer objects)."""

from __future__ import annotations

from typing import Any

from torch import Tensor


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
