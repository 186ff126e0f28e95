"""Helpers every benchmark shares: package versions for the results files and the model loader (`load_model`).
A method by name is `kvcompose.methods.preset(name, budget=...)`, the one factory a user calls too."""

from __future__ import annotations

import importlib.metadata
import platform

from .. import methods as _methods
from ..models import _DTYPES, load_model  # noqa: F401  (one copy, in the library)

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


