"""Which model a profile or a block's model data was made for: an architecture fingerprint and a sample of the weights.

A calibrated profile (ReasonAlloc's `ReasoningWave` demand, DuoAttention's head scores, LU-KV's budget curves)
and a block that reads the model's weights (`CriticalKV`'s output projections) are only right for the model they
were measured on. Two models of the same shape (layers, heads, widths) differ in their weights, so the architecture
alone cannot tell them apart: `model_fingerprint(model, weights=True)` adds `weights`, a sample of the weights
(`weights_sample`: 32 values, evenly strided, of each of up to 8 weight matrices spread over the model: cheap on a
7B model). Two samples match (`same_weights`) within 2% (plus 0.1% of their largest value), so the same checkpoint
loaded in float32, bfloat16 or float16 matches itself while any two random or separately trained models do not (a
light fine-tune of a model may still match it). `check_fingerprint` refuses a model whose fingerprint differs from
the one a profile records; a profile without a fingerprint (a hand-written dict) is taken as it is.

Pure functions of the model's config and parameters; no kvcompose module below the caches is imported here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .view import KVComposeError

__all__ = ["FINGERPRINT_KEYS", "model_fingerprint", "weights_sample", "same_weights", "profile_matches",
           "check_fingerprint"]

FINGERPRINT_KEYS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                    "head_dim", "intermediate_size", "vocab_size")
"""The architecture facts a profile is valid for (layers, heads, widths, vocabulary)."""

_VALUES, _TENSORS = 32, 8  # values per weight matrix, and matrices, in a weights sample
_RTOL, _ATOL = 2e-2, 1e-3  # a bfloat16 copy of float32 weights is within 2**-8 of them


def _text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def weights_sample(tensors: Iterable[Tensor]) -> list[list[float]]:
    """32 evenly strided values of each of up to 8 weight matrices (tensors of 2 or more dims, evenly spread over
    the given order; all tensors if none is a matrix), as floats of 6 significant digits (JSON-ready)."""
    tensors = list(tensors)
    mats = [t for t in tensors if t.dim() >= 2] or tensors
    if len(mats) > _TENSORS:
        mats = [mats[round(i * (len(mats) - 1) / (_TENSORS - 1))] for i in range(_TENSORS)]
    out = []
    for w in mats:
        flat = w.detach().reshape(-1)
        step = max(1, flat.numel() // _VALUES)
        out.append([float(f"{x:.6g}") for x in flat[::step][:_VALUES].to(device="cpu", dtype=torch.float32).tolist()])
    return out


def same_weights(a: list[list[float]], b: list[list[float]]) -> bool:
    """Whether two `weights_sample`s are of the same weights (within 2% plus 0.1% of the largest value: the same
    checkpoint in another float dtype matches)."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return False
    ta = torch.tensor([v for row in a for v in row], dtype=torch.float64, device="cpu")
    tb = torch.tensor([v for row in b for v in row], dtype=torch.float64, device="cpu")
    if not ta.numel():
        return True
    scale = float(tb.abs().max())
    return bool(((ta - tb).abs() <= _RTOL * tb.abs() + _ATOL * scale).all())


def model_fingerprint(model_or_config: Any, weights: bool = False) -> dict[str, Any]:
    """The architecture facts (`FINGERPRINT_KEYS`) of a model or config; with `weights`, also `weights`: a sample
    of the model's weight matrices in name order (`weights_sample`), which tells apart two models of one shape."""
    config = _text_config(model_or_config)
    out = {k: getattr(config, k, None) for k in FINGERPRINT_KEYS}
    if out["head_dim"] is None and out["hidden_size"] and out["num_attention_heads"]:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if weights and hasattr(model_or_config, "named_parameters"):
        out["weights"] = weights_sample(p for _, p in sorted(model_or_config.named_parameters(), key=lambda x: x[0]))
    return out


def profile_matches(theirs: dict[str, Any] | None, ours: dict[str, Any]) -> bool:
    """True when every architecture fact a recorded fingerprint `theirs` states equals `ours` (facts it leaves out,
    or records as None, match anything). The weights sample is not compared here (`check_fingerprint` does)."""
    theirs = theirs or {}
    return all(theirs.get(k) == ours.get(k) for k in FINGERPRINT_KEYS if theirs.get(k) is not None)


def check_fingerprint(who: str, profile: Any, model: Any, redo: str) -> None:
    """Refuse `model` when the fingerprint a profile records (`profile["fingerprint"]`) names another model: an
    architecture fact differs, or the weights sample does (a model of the same shape). `redo` says how to make a
    profile for this model (e.g. "kvcompose calibrate --target duo"). A profile without a fingerprint passes."""
    theirs = profile.get("fingerprint") if isinstance(profile, dict) else None
    if not isinstance(theirs, dict) or not theirs:
        return
    ours = model_fingerprint(model)
    named = f" (made for {profile['model']!r})" if isinstance(profile.get("model"), str) else ""
    for k in FINGERPRINT_KEYS:
        if theirs.get(k) is not None and theirs.get(k) != ours.get(k):
            raise KVComposeError(f"{who}: the profile{named} was calibrated on another model ({k} {theirs.get(k)!r}, "
                                 f"this model {ours.get(k)!r}): {redo} on this model")
    if theirs.get("weights") is not None and hasattr(model, "named_parameters"):
        if not same_weights(theirs["weights"], model_fingerprint(model, weights=True)["weights"]):
            raise KVComposeError(f"{who}: the profile{named} was calibrated on another model of the same shape (its "
                                 f"sample of the weights is not this model's): {redo} on this model, or remove the "
                                 "profile's 'fingerprint' entry to use it anyway")
