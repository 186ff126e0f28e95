"""Helpers every benchmark shares: package versions for the results files, a preset at its published
defaults (`make_pipeline`), and the model loader (`load_model`)."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from .. import methods as _methods
from ..pipeline import Pipeline
from ..view import KVComposeError

__all__ = ["versions", "make_pipeline", "load_model", "COMPRESSING"]

COMPRESSING = [m for m in _methods.PRESETS if m != "full"]


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "kvcompose"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    if out["kvcompose"] is None:
        from .. import __version__

        out["kvcompose"] = __version__
    return out


def make_pipeline(name: str, budget: int | None) -> Pipeline:
    """The preset `name` at its published defaults (its own compression interval included: R-KV 128,
    the others 64), except that the fixed recent window of random_attention and VaSE (64) is capped at
    budget/4 below budget 256, where 64 recent tokens (plus VaSE's budget/4 value-protected tokens) would
    fill or overflow the budget.

    With random_attention's `random_pp` rule (the first `K - 1` prompt tokens kept, K = budget - recent)
    the cap decides how a budget below the prompt splits between the head of the prompt and the recent
    window: at budget 64 it is 47 prompt tokens + 1 drawn + 16 recent, at 128 it is 95 + 1 + 32 (without
    the cap, budget 64 would leave no room at all and 128 would be 63 + 1 + 64). Either way only one slot
    is drawn at random while the prompt is longer than K - 1."""
    if name not in _methods.PRESETS:
        raise KVComposeError(f"unknown method {name!r}; presets: {', '.join(_methods.PRESETS)}")
    fn = _methods.PRESETS[name]
    if name in ("random_attention", "vase") and budget is not None and budget < 256:
        return fn(recent=max(1, min(64, budget // 4)))
    return fn()


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def load_model(model: str | None = None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer): the default SmolLM2-135M-Instruct GGUF, or any Hugging Face model path/name."""
    from ..models import load_default_model

    if dtype not in _DTYPES:
        raise KVComposeError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    m, tok = load_default_model(model, dtype=_DTYPES[dtype])
    m = m.to(device)
    return m, tok
