"""Helpers every benchmark shares: package versions for the results files and the model loader (`load_model`).
A method by name is `kvcompose.methods.preset(name, budget=...)`, the one factory a user calls too."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from .. import methods as _methods
from ..view import KVComposeError

__all__ = ["versions", "load_model", "COMPRESSING"]

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
