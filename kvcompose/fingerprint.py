"""Which model a profile or a block's model data was made for: an architecture fingerprint and a weights digest.

A calibrated profile (ReasonAlloc's `ReasoningWave` demand, DuoAttention's head scores, LU-KV's budget curves)
and a block that reads the model's weights (`CriticalKV`'s output projections) are only right for the model they
were measured on. Two models of the same shape (layers, heads, widths) differ in their weights, so the architecture
alone cannot tell them apart: `model_fingerprint(model, weights=True)` adds `weights`, a digest of a strided
sample of every parameter (about 1024 values per tensor: cheap on a 7B model, and different for any two trained
or random models). `check_fingerprint` refuses a model whose fingerprint differs from the one a profile records;
a profile without a fingerprint (a hand-written dict) is taken as it is.

Pure functions of the model's config and parameters; no kvcompose module below the caches is imported here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .view import KVComposeError

__all__ = ["FINGERPRINT_KEYS", "model_fingerprint", "weights_digest", "profile_matches", "check_fingerprint"]

FINGERPRINT_KEYS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                    "head_dim", "intermediate_size", "vocab_size")
"""The architecture facts a profile is valid for (layers, heads, widths, vocabulary)."""

_SAMPLE = 1024  # values per tensor in a weights digest


def _text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def weights_digest(tensors: Iterable[Tensor]) -> str:
    """A short hex digest of tensors: their shapes and a strided sample of about 1024 values of each (float32)."""
    h = hashlib.sha1()
    for w in tensors:
        flat = w.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLE)
        sample = flat[::step][:_SAMPLE].to(device="cpu", dtype=torch.float32).contiguous()
        h.update(repr(tuple(w.shape)).encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:20]


def model_fingerprint(model_or_config: Any, weights: bool = False) -> dict[str, Any]:
    """The architecture facts (`FINGERPRINT_KEYS`) of a model or config; with `weights`, also `weights`: the digest
    of the model's parameters in name order (`weights_digest`), which tells apart two models of one shape."""
    config = _text_config(model_or_config)
    out = {k: getattr(config, k, None) for k in FINGERPRINT_KEYS}
    if out["head_dim"] is None and out["hidden_size"] and out["num_attention_heads"]:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if weights and hasattr(model_or_config, "named_parameters"):
        out["weights"] = weights_digest(p for _, p in sorted(model_or_config.named_parameters(), key=lambda x: x[0]))
    return out


def profile_matches(theirs: dict[str, Any] | None, ours: dict[str, Any]) -> bool:
    """True when every architecture fact a recorded fingerprint `theirs` states equals `ours` (facts it leaves out,
    or records as None, match anything). The weights digest is not compared here (`check_fingerprint` does)."""
    theirs = theirs or {}
    return all(theirs.get(k) == ours.get(k) for k in FINGERPRINT_KEYS if theirs.get(k) is not None)


def check_fingerprint(who: str, profile: Any, model: Any, redo: str) -> None:
    """Refuse `model` when the fingerprint a profile records (`profile["fingerprint"]`) names another model: an
    architecture fact differs, or the weights digest does (a model of the same shape). `redo` says how to make a
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
        digest = model_fingerprint(model, weights=True)["weights"]
        if digest != theirs["weights"]:
            raise KVComposeError(f"{who}: the profile{named} was calibrated on another model of the same shape (its "
                                 f"weights digest {theirs['weights']} is not this model's {digest}): {redo} on this "
                                 "model, or remove the profile's 'fingerprint' entry to use it anyway")
