"""What kvcompose runs on: the transformers versions it supports, a capability check of a model's attention
(`check_model`), and small shims over the API differences between those transformers versions.

Transformers API differences that matter to a cache (all checked in the installed packages):

| | 5.2 | 5.23 | 5.24 |
|---|---|---|---|
| mask interface keywords | `cache_position=`, `kv_length=`, `kv_offset=` | `q_length=`, `q_offset=`, `device=` | = 5.23 |
| `Cache.get_mask_sizes` | `(cache_position: Tensor, layer_idx)` | `(query_length: int, layer_idx)` | as 5.23 |
| `Cache.update` from attention | `(k, v, idx, cache_kwargs)` | `(k, v, idx)` | `(k, v, idx, kwargs=...)` |
| max length | `get_max_cache_shape()` | `get_max_length()` | as 5.23 |
| forward / generate cache argument | `past_key_values` | `past_key_values` | `cache` (`past_key_values` deprecated) |
| assisted decoding | `crop` only | `activate_past_recording()` first, then `crop` | as 5.23 |

`query_length`, `forward_cache`, `cache_argument` and `output_cache` hide them.
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass

from torch import Tensor

from .view import KVComposeError

__all__ = [
    "MIN_TRANSFORMERS", "MAX_TRANSFORMERS", "TESTED_TRANSFORMERS", "TESTED_MODEL_TYPES", "transformers_version",
    "check_transformers", "query_length", "forward_cache", "cache_argument", "output_cache",
    "in_assisted_generation", "assisted_signal", "ASSISTED_MESSAGE", "LayerAttention", "ModelAttention", "check_model",
]

SUPPORTED_FEATURES = frozenset({"softcap", "sinks"})
"""Attention features `kvcompose.attention.attend` implements beyond scaling and sliding windows (a layer
declares the ones it passes on in its `attention_features`)."""

MIN_TRANSFORMERS = (5, 2)
"""Oldest supported transformers (inclusive); must equal the lower bound in pyproject.toml (tested)."""
MAX_TRANSFORMERS = (5, 24)
"""First unsupported transformers (exclusive); must equal the upper bound in pyproject.toml (tested)."""
TESTED_TRANSFORMERS = ("5.2.0", "5.23.0")
"""Versions the test suite runs on (CI: the oldest and the newest supported)."""
TESTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "olmo2", "gpt_oss",
                      "granite", "smollm3")
"""Architectures whose tiny random configs the test suite runs (tests/test_architectures.py)."""

ASSISTED_MESSAGE = (
    "assisted and prompt-lookup decoding (generate(assistant_model=...) / prompt_lookup_num_tokens=...) are not "
    "supported with a kvcompose cache: their speculative tokens would be counted as prompt and compressed "
    "before being rejected. Decode without an assistant, or use a transformers DynamicCache for assisted decoding."
)


def _parse(version: str) -> tuple[int, ...]:
    """`"5.24.0rc1"` -> `(5, 24, 0)`: the leading numeric release parts."""
    parts = []
    for p in version.split("+")[0].split("."):
        m = re.match(r"\d+", p)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(p):  # 5.24.0rc1
            break
    return tuple(parts)


def transformers_version() -> tuple[int, ...]:
    """The installed transformers version as a tuple, e.g. `(5, 23, 0)`."""
    import transformers

    return _parse(transformers.__version__)


def check_transformers(version: str | None = None) -> tuple[int, ...]:
    """Raise `KVComposeError` below the supported range; warn at or above its (exclusive) upper bound.

    Returns the parsed version. `version` defaults to the installed one.
    """
    if version is None:
        import transformers

        version = transformers.__version__
    v = _parse(version)
    lo = ".".join(map(str, MIN_TRANSFORMERS))
    hi = ".".join(map(str, MAX_TRANSFORMERS))
    if v[:2] < MIN_TRANSFORMERS:
        raise KVComposeError(f"kvcompose needs transformers>={lo},<{hi}; found {version}")
    if v[:2] >= MAX_TRANSFORMERS:
        warnings.warn(f"kvcompose is tested with transformers>={lo},<{hi}; found {version}", stacklevel=2)
    return v


# ------------------------------------------------------------------------------------------------------
# shims
# ------------------------------------------------------------------------------------------------------
def query_length(query_length_or_cache_position) -> int:
    """The new-token count `get_mask_sizes` receives: an int (5.23+) or a `cache_position` tensor (5.2)."""
    if isinstance(query_length_or_cache_position, Tensor):
        return int(query_length_or_cache_position.shape[0])
    return int(query_length_or_cache_position)


def forward_cache(kwargs: dict | None):
    """The cache in a model forward's keyword arguments (a forward hook's `kwargs`): `cache` (5.24+; what
    generate passes there) or `past_key_values` (up to 5.23, and deprecated callers on 5.24)."""
    if not kwargs:
        return None
    c = kwargs.get("cache")
    return c if c is not None else kwargs.get("past_key_values")


def cache_argument(model) -> str:
    """The name of the cache argument of `model.forward`: "cache" (5.24+) or "past_key_values"."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(outputs):
    """The cache of a model or generate output (`outputs.cache` on 5.24+, `outputs.past_key_values` before)."""
    c = getattr(outputs, "cache", None)
    return c if c is not None else getattr(outputs, "past_key_values", None)


def assisted_signal() -> bool:
    """True where transformers itself signals assisted / prompt-lookup decoding to the cache (5.23+: generate
    calls `cache.activate_past_recording()` before the first forward, which a kvcompose cache refuses). Only
    without that signal (5.2) does the attention function look for `_assisted_decoding` on the stack
    (`in_assisted_generation`)."""
    global ASSISTED_SIGNAL
    if ASSISTED_SIGNAL is None:
        ASSISTED_SIGNAL = transformers_version() >= (5, 23)
    return ASSISTED_SIGNAL


ASSISTED_SIGNAL: bool | None = None
"""Cached answer of `assisted_signal()` (None until first asked)."""


def in_assisted_generation(max_depth: int = 256) -> bool:
    """True when called (at any depth) from transformers' `_assisted_decoding` (assisted generation and
    prompt lookup, all versions). The attention function calls it only where transformers gives no signal of
    its own (`assisted_signal()` False: 5.2), on multi-token forwards: the first forward of assisted decoding
    carries the prompt plus the first speculative tokens, so this refuses before any token is produced."""
    f = sys._getframe(1)
    for _ in range(max_depth):
        if f is None:
            return False
        code = f.f_code
        if code.co_name == "_assisted_decoding" and "transformers" in code.co_filename:
            return True
        f = f.f_back
    return False


# ------------------------------------------------------------------------------------------------------
# architectures
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerAttention:
    """The attention features of one decoder layer, as its attention module passes them to the attention
    function.

    Attributes:
        index: the layer index.
        kind: "full" or "sliding".
        sliding_window: keys with `query_pos - key_pos < sliding_window` are visible (None = all).
        softcap: logit soft-capping `c * tanh(logits / c)` (Gemma 2), None when absent.
        sinks: a learned per-head sink logit joins the softmax (gpt-oss `s_aux`).
        scaling: the logit scale the module passes (`query_pre_attn_scalar ** -0.5` in Gemma, Granite's
            `attention_multiplier`, else `head_dim ** -0.5`).
        qk_norm: queries and keys are normalised before RoPE (Qwen3, OLMo2, Gemma3); nothing for the cache
            to do (the keys it receives are already normalised), listed for information.
    """

    index: int
    kind: str
    sliding_window: int | None
    softcap: float | None
    sinks: bool
    scaling: float | None
    qk_norm: bool

    @property
    def features(self) -> frozenset[str]:
        """The features of `SUPPORTED_FEATURES` this layer uses."""
        return frozenset(n for n, on in (("softcap", self.softcap is not None), ("sinks", self.sinks)) if on)


@dataclass(frozen=True)
class ModelAttention:
    """`check_model`'s description of a model's attention: its type and one `LayerAttention` per layer."""

    model_type: str
    layers: tuple[LayerAttention, ...]

    @property
    def features(self) -> frozenset[str]:
        """Every soft-capping / sinks feature some layer uses."""
        return frozenset().union(*(layer.features for layer in self.layers)) if self.layers else frozenset()

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if layer.kind == "sliding")

    def __str__(self) -> str:
        head = "layer  kind     window  softcap  sinks  scaling  qk-norm"
        rows = [f"{self.model_type}: {len(self.layers)} attention layers", head]
        for a in self.layers:
            rows.append(f"{a.index:>5}  {a.kind:<7}  {a.sliding_window if a.sliding_window is not None else '-':>6}  "
                        f"{a.softcap if a.softcap is not None else '-':>7}  {'yes' if a.sinks else '-':>5}  "
                        f"{a.scaling if a.scaling is not None else '-':>7.4}  {'yes' if a.qk_norm else '-':>7}")
        return "\n".join(rows)


# config attributes that change attention in ways kvcompose does not implement: (attribute, what it is)
_REFUSED_CONFIG = (
    ("attention_chunk_size", "chunked attention (Llama 4)"),
    ("num_kv_shared_layers", "KV sharing across layers (Gemma 3n)"),
    ("use_alibi", "ALiBi position biases"),
    ("alibi", "ALiBi position biases"),
    ("use_bidirectional_attention", "bidirectional attention"),
    ("sliding_window_pattern_bidirectional", "bidirectional sliding attention"),
)
_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


def _attention_modules(model) -> dict[int, object]:
    out: dict[int, object] = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and type(m).__name__.endswith("Attention") and idx not in out:
            out[idx] = m
    return out


def check_model(model, features: frozenset[str] | set[str] | None = None) -> ModelAttention:
    """Describe a decoder-only model's attention per layer, or raise `KVComposeError` naming what kvcompose
    cannot honour.

    Accepted: any causal decoder whose attention goes through transformers' `AttentionInterface`, with
    full and sliding-window layers, any scaling, q/k norms, and the features in `features` (default: all
    that `kvcompose.attention.attend` implements, soft-capping and sinks; a layer core passes the ones it
    applies). Refused by name: encoder-decoders, bidirectional attention, linear-attention / recurrent /
    chunked layer types, chunked attention, KV sharing across layers, ALiBi, and models that do not use
    the attention interface.
    """
    features = SUPPORTED_FEATURES if features is None else frozenset(features)
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "modules"):
        raise KVComposeError("model has no config: pass a Hugging Face PreTrainedModel")
    if getattr(config, "is_encoder_decoder", False):
        raise KVComposeError(
            "encoder-decoder models are not supported: kvcompose compresses a decoder's self-attention")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", "?")
    if getattr(text, "is_causal", True) is False:
        raise KVComposeError(f"{model_type}: non-causal attention is not supported")
    for attr, what in _REFUSED_CONFIG:
        value = getattr(text, attr, None)
        if value not in (None, False, 0):
            raise KVComposeError(f"{model_type} uses {what} ({attr}={value!r}), which kvcompose does not support")
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise KVComposeError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, so "
            "kvcompose cannot run its attention"
        )
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 0:
        raise KVComposeError(f"{model_type}: config has no num_hidden_layers")
    layer_types = list(getattr(text, "layer_types", None) or [])
    bad = sorted({t for t in layer_types if t not in _LAYER_KINDS})
    if bad:
        raise KVComposeError(
            f"{model_type} has layer types {bad}: only full and sliding-window attention layers are supported"
        )
    modules = _attention_modules(model)
    missing = [i for i in range(n) if i not in modules]
    if missing:
        raise KVComposeError(
            f"{model_type}: no attention module found for layers {missing[:8]}: only decoders whose every layer is "
            "an attention layer are supported"
        )
    layers = []
    for i in range(n):
        m = modules[i]
        if hasattr(m, "sliding_window"):
            window = m.sliding_window
        elif layer_types:
            window = getattr(text, "sliding_window", None) if layer_types[i] == "sliding_attention" else None
        else:  # Mistral / Phi-3 pass config.sliding_window on every layer
            window = getattr(text, "sliding_window", None)
        softcap = getattr(m, "attn_logit_softcapping", getattr(text, "attn_logit_softcapping", None))
        layers.append(LayerAttention(
            index=i, kind="sliding" if window is not None else "full",
            sliding_window=int(window) if window is not None else None,
            softcap=float(softcap) if softcap is not None else None,
            sinks=isinstance(getattr(m, "sinks", None), Tensor),
            scaling=float(m.scaling) if isinstance(getattr(m, "scaling", None), (int, float)) else None,
            qk_norm=hasattr(m, "q_norm") or hasattr(m, "k_norm"),
        ))
    desc = ModelAttention(model_type, tuple(layers))
    unsupported = desc.features - features
    if unsupported:
        names = {"softcap": "attention logit soft-capping (attn_logit_softcapping)",
                 "sinks": "attention sinks (s_aux)"}
        raise KVComposeError(
            f"{model_type} uses {', '.join(names[u] for u in sorted(unsupported))}, which this kvcompose cache does "
            "not apply"
        )
    return desc
