"""kvcompose's hook into transformers: a scoped attention function, its mask function, and the exact math.

Transformers builds one attention mask from the first full-attention layer and shares it across layers;
with compression every layer (and head) holds a different set of tokens, so that mask is wrong for a
kvcompose cache. kvcompose therefore registers its own implementation, named `"kvcompose"`, with the public
`AttentionInterface` / `AttentionMaskInterface` and switches a model to it (`install`). No transformers code
is patched, and the switch is **scoped**:

- **Only calls that carry a kvcompose cache run kvcompose's attention.** Every other call (no cache, a
  `DynamicCache`, a `StaticCache`, a custom 4-D mask, training with dropout, ...) goes to the model's
  *previous* implementation (`sdpa`, `eager` (the model's own `eager_attention_forward`), flash, flex, ...)
  with exactly the arguments transformers gave, so its result is bit for bit what it was. The previous
  implementation is remembered per config object (two models, one in `sdpa` and one in `eager`, can both
  use kvcompose), and `restore(model)` puts it back; it is also put back automatically when the last cache
  that installed it is garbage-collected (`install(model, owner=cache)`).
- **Mask.** The mask interface is chosen by the same `_attn_implementation` string, and transformers does
  not pass the cache to it (checked on 5.2, 5.23 and 5.24). `kvcompose_mask` therefore looks at the caller
  (`create_causal_mask` & co., whose argument is named `past_key_values` up to 5.23 and `cache` from 5.24):
  with a kvcompose cache it returns the 2-D padding mask (`[B, seen + new]`, True = real token) unchanged;
  otherwise it returns exactly what the previous implementation's mask function returns (`sdpa_mask`,
  `eager_mask`, `flash_attention_mask` (None or 2-D), `flex_attention_mask`, or None for an
  implementation with no mask function). It takes any keyword arguments, so it serves transformers 5.2
  (`cache_position=`) and 5.23+ (`q_length=`, `q_offset=`) alike.
- **Hand-off ("the cache knows whether its attention ran").** A kvcompose layer's `update` calls
  `hand_off(layer, keys, values)` and returns those same tensors; the model passes them straight to the
  attention function, which recognises them by identity and calls
  `layer.attend(query, mask2d, scale, sliding_window, [softcap=..., sinks=...])`. If the attention function
  does not consume a hand-off (the model's implementation was changed after the cache was built, or the
  cache was passed to another model), the next `hand_off` of that cache raises `KVComposeError` naming the
  layer, instead of letting the cache grow without ever compressing. `check_consumed(cache)` does the same
  check on demand (e.g. after a forward).
- **Features.** The attention function honours scaling (`scaling`: Gemma's `query_pre_attn_scalar`,
  Granite's `attention_multiplier`), sliding windows (`sliding_window`), logit soft-capping (`softcap`,
  Gemma2) and attention sinks (`s_aux`, gpt-oss); `attend` computes soft-capping and sinks exactly as those
  models' eager attention does. A feature the layer does not declare in `layer.attention_features`, or an
  argument kvcompose does not know, is refused by name (never silently ignored).

Shapes: B batch rows, H KV heads, Hq query heads (Hq = H * G), Q new queries, T attended tokens, D head dim,
Dv value head dim.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .compat import ASSISTED_MESSAGE, SUPPORTED_FEATURES, in_assisted_generation, no_trace
from .view import KVComposeError

__all__ = [
    "ATTN_IMPLEMENTATION", "register", "install", "release", "restore", "is_installed", "previous_implementation",
    "hand_off", "check_consumed", "attend", "attention_probs", "build_mask", "kvcompose_attention",
    "kvcompose_mask", "is_kvcompose_cache", "SUPPORTED_FEATURES",
]

ATTN_IMPLEMENTATION = "kvcompose"
"""The name of kvcompose's implementation in transformers' attention and mask interfaces."""

DEFAULT_PREVIOUS = "sdpa"
"""Implementation assumed for a config switched to "kvcompose" without `install` (transformers' default)."""

# keyword arguments an attention module may pass that carry no attention semantics for a cached decode
_IGNORED_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "position_embeddings", "past_key_values", "cache",
    "output_router_logits", "token_type_ids", "layer_idx",
})
_KNOWN_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "softcap", "s_aux", "is_causal", "output_attentions"})
_unknown_kwargs: dict[frozenset, list[str]] = {}  # argument names seen -> the unknown ones (checked once)
_CACHE_LOCALS = ("past_key_values", "cache")  # the cache argument's name in transformers' mask builders


# ------------------------------------------------------------------------------------------------------
# the math
# ------------------------------------------------------------------------------------------------------
def build_mask(
    key_pos: Int[Tensor, "B H T"],
    key_valid: Bool[Tensor, "B H T"],
    query_pos: Int[Tensor, " Q"],
    sliding_window: int | None = None,
) -> Bool[Tensor, "B H Q T"]:
    """Causal mask over held tokens by their original positions (True = attend).

    A sliding window keeps keys with `query_pos - key_pos < sliding_window`, the rule of transformers'
    `sliding_window_overlay` (5.2 to 5.24). A query always sees its own key, so a padding query never gets
    an empty (NaN) row.
    """
    kp = key_pos[:, :, None, :]
    qp = query_pos[None, None, :, None]
    mask = (kp <= qp) & key_valid[:, :, None, :]
    if sliding_window is not None:
        mask &= kp > qp - sliding_window
    return mask | (kp == qp)


def _fold(query: Tensor, mask: Tensor | None, h: int) -> tuple[Tensor, Tensor | None]:
    """Fold the G query heads of each KV head into the query axis: `[B, H, G*Q, D]` and `[B, H, G*Q, T]`."""
    b, hq, q, d = query.shape
    g = hq // h
    qg = query.reshape(b, h, g * q, d)
    if mask is None:
        return qg, None
    m = mask[:, :, None].expand(b, h, g, q, mask.shape[-1]).reshape(b, h, g * q, mask.shape[-1])
    return qg, m


def _logits(qg: Tensor, keys: Tensor, m: Tensor | None, scale: float, softcap: float | None) -> Tensor:
    """Scaled (and soft-capped) logits with masked entries at the dtype's minimum, in the order of
    transformers' eager attention (Gemma2: scale, divide by the cap, tanh, multiply, then add the mask)."""
    w = torch.matmul(qg, keys.transpose(2, 3)) * scale
    if softcap is not None:
        w = w / softcap
        w = torch.tanh(w)
        w = w * softcap
    return w if m is None else torch.where(m, w, torch.finfo(w.dtype).min)


def _probs(qg: Tensor, keys: Tensor, m: Tensor | None, scale: float, softcap: float | None, sinks: Tensor | None,
           h: int, g: int, q: int) -> Tensor:
    w = _logits(qg, keys, m, scale, softcap)
    if sinks is None:  # Gemma2 / Llama eager: softmax in float32, back to the query dtype
        return F.softmax(w, dim=-1, dtype=torch.float32).to(qg.dtype)
    # gpt-oss eager: one extra logit per query head, max-subtracted softmax in the logits' dtype, sink dropped
    b = qg.shape[0]
    s = sinks.to(w.dtype).reshape(h, g, 1).expand(h, g, q).reshape(1, h, g * q, 1).expand(b, h, g * q, 1)
    combined = torch.cat([w, s], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


def attend(
    query: Float[Tensor, "B Hq Q D"],
    keys: Float[Tensor, "B H T D"],
    values: Float[Tensor, "B H T Dv"],
    mask: Bool[Tensor, "B H Q T"] | None,
    scale: float,
    softcap: float | None = None,
    sinks: Float[Tensor, " Hq"] | None = None,
) -> Float[Tensor, "B Q Hq Dv"]:
    """Attention of the new queries over the given tokens with a per-KV-head mask (True = attend; None =
    every query sees every key).

    The G query heads of a group are folded into the query axis, so keys and values are never repeated.
    Without soft-capping or sinks this is `F.scaled_dot_product_attention`. With `softcap` (Gemma 2,
    Team Gemma 2024, arXiv 2408.00118: logits `c * tanh(logits / c)`) or `sinks` (gpt-oss, OpenAI 2025: a
    learned per-head logit that joins the softmax and is then dropped; cf. attention sinks, Xiao et al. 2023,
    arXiv 2309.17453) it follows transformers' eager implementation of those models step by step.
    """
    b, hq, q, _ = query.shape
    h = keys.shape[1]
    if hq % h:
        raise KVComposeError(f"{hq} query heads are not a multiple of {h} KV heads")
    g = hq // h
    qg, m = _fold(query, mask, h)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=m, scale=scale)
    else:
        p = _probs(qg, keys, m, scale, softcap, sinks, h, g, q).to(values.dtype)
        out = torch.matmul(p, values)
    return out.reshape(b, hq, q, values.shape[-1]).transpose(1, 2)


def attention_probs(
    query: Float[Tensor, "B Hq Q D"],
    keys: Float[Tensor, "B H T D"],
    mask: Bool[Tensor, "B H Q T"] | None,
    scale: float,
    softcap: float | None = None,
    sinks: Float[Tensor, " Hq"] | None = None,
) -> Float[Tensor, "B Hq Q T"]:
    """The attention probabilities `attend` uses (float32; soft-capping and sinks as in `attend`), for
    observers such as accumulated attention (H2O, Zhang et al. 2023, arXiv 2306.14048) that must see what
    the model attended to. Sink mass is not a token's: rows then sum to less than one."""
    b, hq, q, _ = query.shape
    h = keys.shape[1]
    g = hq // h
    qg, m = _fold(query, mask, h)
    p = _probs(qg.float(), keys.float(), m, scale, softcap, sinks, h, g, q)
    return p.reshape(b, hq, q, keys.shape[2])


# ------------------------------------------------------------------------------------------------------
# hand-off between a layer's update and the attention function
# ------------------------------------------------------------------------------------------------------
@dataclass
class _HandOff:
    layer: object
    keys: Tensor
    values: Tensor
    owner: weakref.ref


class _Slot(threading.local):
    pending: _HandOff | None = None


_slot = _Slot()
_missed: "weakref.WeakKeyDictionary[object, str]" = weakref.WeakKeyDictionary()


def _owner(layer) -> object:
    return getattr(layer, "cache", layer)


def _missed_message(p: _HandOff) -> str:
    idx = getattr(p.layer, "layer_idx", "?")
    return (
        f"layer {idx} of a kvcompose cache was updated, but kvcompose's attention did not run for it: the "
        f"model that ran it does not use the '{ATTN_IMPLEMENTATION}' attention implementation (it was changed "
        "after the cache was built, e.g. by set_attn_implementation() or kvcompose.attention.restore(), or the "
        "cache was passed to another model). The cache now holds tokens it never compressed; build a new cache "
        "for the model you generate with and leave its attention implementation alone while the cache is used."
    )


def hand_off(layer, keys: Tensor, values: Tensor, owner=None) -> None:
    """Called by a kvcompose layer's `update` with the keys/values it returns to the model (`[B, H, Q, D]`).

    The attention function consumes the hand-off when the model passes those same tensors to it and calls
    `layer.attend(...)`. `owner` is one object shared by all layers of a cache (default `layer.cache`, else
    the layer). Raises `KVComposeError` if that owner has a hand-off that no kvcompose attention call
    consumed (see the module docstring); a stale hand-off of another owner marks that owner instead, which
    then raises at its own next `hand_off` (or `check_consumed`).
    """
    owner = _owner(layer) if owner is None else owner
    msg = _missed.get(owner)
    if msg is not None:
        raise KVComposeError(msg)
    p = _slot.pending
    if p is not None:
        _slot.pending = None
        stale = p.owner()
        if stale is not None:
            msg = _missed_message(p)
            _missed[stale] = msg
            if stale is owner:
                raise KVComposeError(msg)
    _slot.pending = _HandOff(layer, keys, values, weakref.ref(owner))


def check_consumed(cache) -> None:
    """Raise `KVComposeError` if a layer of `cache` (an owner given to `hand_off`) was updated and kvcompose's
    attention never saw it."""
    p = _slot.pending
    if p is not None and p.owner() is cache:
        _slot.pending = None
        _missed[cache] = _missed_message(p)
    msg = _missed.get(cache)
    if msg is not None:
        raise KVComposeError(msg)


def is_kvcompose_cache(obj) -> bool:
    """True for a `KVComposeCache`, a `BranchCache`, or any cache class with `kvcompose_attention = True`."""
    if obj is None:
        return False
    return getattr(type(obj), "kvcompose_attention", False) is True


# ------------------------------------------------------------------------------------------------------
# which implementation a config had before kvcompose
# ------------------------------------------------------------------------------------------------------
@dataclass
class _Entry:
    config: weakref.ref
    previous: str
    owners: int = 0
    pinned: bool = False  # installed without an owner: only restore() puts it back
    finalizers: list = field(default_factory=list)


_previous: dict[int, _Entry] = {}
_lock = threading.RLock()


def _forget(cid: int) -> None:
    e = _previous.get(cid)
    if e is not None and e.config() is None:  # the config is gone (its id may be reused later)
        _previous.pop(cid, None)


def _entry(config) -> _Entry | None:
    e = _previous.get(id(config))
    if e is not None and e.config() is config:
        return e
    return None


def previous_implementation(model_or_config) -> str | None:
    """The attention implementation a model (or config) had before kvcompose switched it; None if it is not
    switched by `install`."""
    config = getattr(model_or_config, "config", model_or_config)
    e = _entry(config)
    return None if e is None else e.previous


def _configs(model) -> list:
    """Every config object of a model: its config, their sub-configs, and the configs of its sub-models."""
    out, seen = [], set()
    stack = [model.config] + [getattr(m, "config", None) for m in model.modules()]
    while stack:
        c = stack.pop()
        if c is None or id(c) in seen or not hasattr(c, "_attn_implementation"):
            continue
        seen.add(id(c))
        out.append(c)
        for key in getattr(c, "sub_configs", {}) or {}:
            stack.append(getattr(c, key, None))
    return out


def register() -> None:
    """Register kvcompose's attention and mask functions under "kvcompose" (idempotent; adds a name, changes
    no existing one)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if AttentionInterface._global_mapping.get(ATTN_IMPLEMENTATION) is not kvcompose_attention:
        AttentionInterface.register(ATTN_IMPLEMENTATION, kvcompose_attention)
    if AttentionMaskInterface._global_mapping.get(ATTN_IMPLEMENTATION) is not kvcompose_mask:
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvcompose_mask)


def install(model, owner=None) -> None:
    """Switch `model` to kvcompose's scoped attention, remembering each config's previous implementation.

    With `owner` (a kvcompose cache), the previous implementation is put back automatically once every
    owner that installed it is garbage-collected or `release`d; without one, only `restore(model)` puts it
    back. Installing twice keeps the first previous implementation. Raises `KVComposeError` when the model
    does not dispatch attention through transformers' `AttentionInterface`.
    """
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise KVComposeError("kvcompose needs a Hugging Face PreTrainedModel (with set_attn_implementation)")
    register()
    with _lock:
        configs = _configs(model)
        before = [(c, c._attn_implementation) for c in configs]
        if any(impl != ATTN_IMPLEMENTATION for _, impl in before):
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if text._attn_implementation != ATTN_IMPLEMENTATION:
            raise KVComposeError(
                f"{type(model).__name__} did not switch to kvcompose's attention (its implementation stays "
                f"{text._attn_implementation!r}): kvcompose supports models whose attention goes through "
                "transformers' AttentionInterface"
            )
        for c, impl in before:
            if c._attn_implementation != ATTN_IMPLEMENTATION:
                continue
            e = _entry(c)
            if e is None:
                prev = impl if impl != ATTN_IMPLEMENTATION else DEFAULT_PREVIOUS
                e = _Entry(weakref.ref(c, lambda _r, cid=id(c): _forget(cid)), prev)
                _previous[id(c)] = e
            if owner is None:
                e.pinned = True
            else:
                e.owners += 1
                e.finalizers.append(weakref.finalize(owner, _drop_owner, id(c), e))


def _drop_owner(cid: int, e: _Entry) -> None:
    with _lock:
        e.owners -= 1
        if e.owners > 0 or e.pinned or _previous.get(cid) is not e:
            return
        c = e.config()
        if c is not None and c._attn_implementation == ATTN_IMPLEMENTATION:
            c._attn_implementation_internal = e.previous
        _previous.pop(cid, None)


def release(owner) -> None:
    """Drop `owner`'s hold on the models it installed on (as if it were garbage-collected)."""
    with _lock:
        for e in list(_previous.values()):
            for f in list(e.finalizers):
                if f.peek() is not None and f.peek()[0] is owner:
                    e.finalizers.remove(f)
                    f()


def restore(model) -> None:
    """Put back every config's previous attention implementation now (a config switched to "kvcompose"
    without `install` goes back to "sdpa"). A kvcompose cache still used with the model afterwards raises
    at its next step."""
    with _lock:
        for c in _configs(model):
            e = _entry(c)
            if c._attn_implementation == ATTN_IMPLEMENTATION:
                c._attn_implementation_internal = e.previous if e is not None else DEFAULT_PREVIOUS
            if e is not None:
                for f in e.finalizers:
                    f.detach()
                _previous.pop(id(c), None)


def is_installed(model) -> bool:
    """True when the model's (text) config is switched to kvcompose's attention."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config._attn_implementation == ATTN_IMPLEMENTATION


def _previous_for(config) -> str:
    e = _entry(config) if config is not None else None
    return DEFAULT_PREVIOUS if e is None else e.previous


# ------------------------------------------------------------------------------------------------------
# the registered functions
# ------------------------------------------------------------------------------------------------------
def _model_functions(module):
    """The interface and the eager function the module's own modeling file uses (as its forward does)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mod = sys.modules.get(type(module).__module__)
    iface = getattr(mod, "ALL_ATTENTION_FUNCTIONS", ALL_ATTENTION_FUNCTIONS)
    return iface, getattr(mod, "eager_attention_forward", None)


def _delegate(module, query, key, value, attention_mask, kwargs):
    config = getattr(module, "config", None)
    prev = _previous_for(config)
    iface, eager = _model_functions(module)
    if prev == "eager":
        if eager is None:
            raise KVComposeError(
                f"{type(module).__name__} was in 'eager' attention, but its modeling file has no "
                "eager_attention_forward; load the model with attn_implementation='sdpa'"
            )
        return eager(module, query, key, value, attention_mask, **kwargs)
    fn = iface.get_interface(prev, eager)
    if prev == "sdpa" or config is None:
        return fn(module, query, key, value, attention_mask, **kwargs)
    # flash kernels (and other integrations) read the implementation's name from the config during the call
    config._attn_implementation_internal = prev
    try:
        return fn(module, query, key, value, attention_mask, **kwargs)
    finally:
        config._attn_implementation_internal = ATTN_IMPLEMENTATION


def _kvcompose_call(layer, module, query, attention_mask, kwargs):
    """Run a kvcompose layer's attention with the features this call asks for, or refuse them by name."""
    if attention_mask is not None and (not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise KVComposeError(
            f"a kvcompose cache needs the 2-D padding mask ([batch, tokens], 1 = real token), got {shape}: custom "
            "4-D attention masks are not supported with a kvcompose cache"
        )
    dropout = kwargs.get("dropout", 0.0) or 0.0
    if dropout > 0:
        raise KVComposeError(
            f"attention dropout {dropout} is active (the model is in training mode): a kvcompose cache is for "
            "inference; call model.eval()"
        )
    if kwargs.get("is_causal", True) is False or getattr(module, "is_causal", True) is False:
        raise KVComposeError("bidirectional (non-causal) attention is not supported with a kvcompose cache")
    if kwargs.get("output_attentions"):
        raise KVComposeError("output_attentions is not supported with a kvcompose cache")
    names = frozenset(k for k, v in kwargs.items() if v is not None)
    unknown = _unknown_kwargs.get(names)
    if unknown is None:
        unknown = sorted(names - _IGNORED_KWARGS - _KNOWN_KWARGS)
        _unknown_kwargs[names] = unknown
    if unknown:
        raise KVComposeError(
            f"{type(module).__name__} passes attention arguments kvcompose does not implement: {unknown}; "
            "this architecture is not supported"
        )
    if query.shape[2] > 1 and in_assisted_generation():
        raise KVComposeError(ASSISTED_MESSAGE)
    scale = kwargs.get("scaling")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    features = {}
    if kwargs.get("softcap") is not None:
        features["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        features["sinks"] = kwargs["s_aux"]
    missing = set(features) - set(getattr(layer, "attention_features", ()))
    if missing:
        names = {"softcap": "attention logit soft-capping (softcap)", "sinks": "attention sinks (s_aux)"}
        model_type = getattr(getattr(module, "config", None), "model_type", "this model")
        raise KVComposeError(
            f"{model_type} uses {', '.join(names[m] for m in sorted(missing))}, which "
            f"{type(layer).__name__} does not apply; refusing instead of attending without it"
        )
    out = layer.attend(query, attention_mask, float(scale), kwargs.get("sliding_window"), **features)
    return out, None


@no_trace  # kvcompose's bookkeeping is never traced: under torch.compile it runs eagerly
def kvcompose_attention(module, query, key, value, attention_mask, **kwargs):
    """The registered attention function (transformers' attention interface signature).

    A call whose keys/values are the ones a kvcompose layer just handed off runs that layer's `attend`;
    every other call goes to the model's previous implementation with the same arguments.
    """
    p = _slot.pending
    if p is not None and p.keys is key and p.values is value:
        _slot.pending = None
        return _kvcompose_call(p.layer, module, query, attention_mask, kwargs)
    return _delegate(module, query, key, value, attention_mask, kwargs)


_WRAPPER_DIRS = ("/jaxtyping/", "/beartype/", "/kvcompose/", "/torch/_dynamo/", "/torch/compiler/")


def _is_wrapper_frame(f) -> bool:
    """Frames of kvcompose itself and of decorators around the mask function (torch.compiler.disable, and
    jaxtyping/beartype in the tests)."""
    fn = f.f_code.co_filename.replace("\\", "/")
    return any(d in fn for d in _WRAPPER_DIRS)


def _caller_cache() -> tuple[object, bool]:
    """The cache argument of the transformers function that called the mask function (and whether one was
    found): `create_causal_mask` & co. name it `past_key_values` (<= 5.23) or `cache` (5.24)."""
    f, looked = sys._getframe(1), 0
    while f is not None and looked < 2:  # the mask builder, or the model code that called the mask function
        if not _is_wrapper_frame(f):
            looked += 1
            names = f.f_code.co_varnames
            for name in _CACHE_LOCALS:
                if name in names:
                    loc = f.f_locals
                    if name in loc:
                        return loc[name], True
        f = f.f_back
    return None, False


@no_trace  # reads the caller's frame; never traced (graph break, runs eagerly)
def kvcompose_mask(*args, **kwargs):
    """The registered mask function: the 2-D padding mask for a kvcompose cache, else exactly the mask of
    the model's previous implementation (any transformers mask-interface signature)."""
    cache, _ = _caller_cache()
    if is_kvcompose_cache(cache):
        return kwargs.get("attention_mask")  # transformers passes every argument by keyword
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    prev = _previous_for(kwargs.get("config"))
    if prev not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return None  # transformers returns no mask for an implementation without a mask function
    return ALL_MASK_ATTENTION_FUNCTIONS[prev](*args, **kwargs)
