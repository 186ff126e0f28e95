"""kvcompose's hook into transformers: a scoped attention function and its mask function (the exact math is
`kvcompose.attention_math`, re-exported here).

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
  not pass the cache to it (checked on 5.2 and 5.23). But transformers' mask builders (`create_causal_mask`
  & co.) ask the cache for the mask sizes (`get_mask_sizes`) right before they call the mask function, in
  the same thread: a kvcompose cache's `get_mask_sizes` therefore notes in the hook state that the next
  mask call is its own (`expect_mask`), with the sizes it returned. `kvcompose_mask` consumes that note:
  if it is there and the call's `kv_length` / `kv_offset` match, it returns the 2-D padding mask
  (`[B, seen + new]`, True = real token) unchanged; otherwise it returns exactly what the previous
  implementation's mask function returns (`sdpa_mask`, `eager_mask`, `flash_attention_mask` (None or 2-D),
  `flex_attention_mask`, or None for an implementation with no mask function). It takes any keyword
  arguments, so it serves transformers 5.2 (`cache_position=`) and 5.23 (`q_length=`, `q_offset=`) alike.
- **Hand-off ("the cache knows whether its attention ran").** A kvcompose cache's `update` calls its layer's
  `update`, then `hand_off(layer, keys, values)` with the tensors the layer returned (a cache of other layers
  may call it from the layer instead), and returns those same tensors; the model passes them straight to the
  attention function, which recognises them by identity and calls
  `layer.attend(query, mask2d, scale, sliding_window, [softcap=..., sinks=...])`. If the attention function
  does not consume a hand-off (the model's implementation was changed after the cache was built, or the
  cache was passed to another model), the next `hand_off` of that cache raises `KVComposeError` naming the
  layer, instead of letting the cache grow without ever compressing. `check_consumed(cache)` does the same
  check on demand (e.g. after a forward). The verdict is kept on the cache itself (`kvcompose_missed`).
- **State.** Both notes live in one small object, `HookState` (`hook_state()`, one per thread: a forward runs
  in one thread, and two threads may decode with two caches): the pending hand-off (weak references to the
  layer and its cache, and the keys/values it returned) and the pending mask note. Nothing else is global
  but the registry of previous implementations per config (`install` / `restore`).
- **Delegation.** A call without a kvcompose hand-off goes to the previous implementation with the
  arguments transformers gave. Flash-attention style integrations (and hub kernels) read the
  implementation's name from the config during the call; for them (not for sdpa, eager or flex) the
  config's name is the previous one for the duration of the call, the one rewrite that cannot be avoided.
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

from torch import Tensor

from .attention_math import attend, attention_probs, build_mask  # re-exported: the math lives there
from .compat import ASSISTED_MESSAGE, SUPPORTED_FEATURES, assisted_signal, in_assisted_generation
from .view import KVComposeError

__all__ = [
    "ATTN_IMPLEMENTATION", "register", "install", "release", "restore", "is_installed", "previous_implementation",
    "hand_off", "check_consumed", "check_open", "expect_mask", "hook_state", "HookState", "attend", "attention_probs",
    "build_mask", "kvcompose_attention", "kvcompose_mask", "is_kvcompose_cache", "SUPPORTED_FEATURES", "no_trace",
]


def no_trace(fn):
    """Run `fn` eagerly under `torch.compile` (a graph break: dynamo never traces kvcompose's bookkeeping),
    at the cost of one `is_compiling()` check in eager mode (`torch.compiler.disable`'s own wrapper costs tens
    of microseconds per call, which a decode step pays once per layer). The decorator of every kvcompose
    method transformers calls (the cache's, its layers' and this hook's); it lives here, beside the hook, so
    a decoded token's walk through kvcompose's files adds no file for it."""
    import functools

    import torch

    disabled = torch.compiler.disable(fn)
    try:  # dynamo's frame hook: set while a compiled function runs, including the eager parts after a graph break
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # pragma: no cover - older torch
        def get_eval_frame_callback():
            return True

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling() or get_eval_frame_callback() not in (None, False):
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


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
_READS_NO_CONFIG_NAME = frozenset({"sdpa", "flex_attention"})  # implementations that never read the config's name


# ------------------------------------------------------------------------------------------------------
# hand-off between a cache's update and the attention function
# ------------------------------------------------------------------------------------------------------
@dataclass
class _HandOff:
    layer: weakref.ref
    keys: Tensor
    values: Tensor
    owner: weakref.ref


@dataclass
class _MaskNote:
    owner: weakref.ref
    kv_length: int
    kv_offset: int


class HookState(threading.local):
    """The hook's state, one per thread (see the module docstring):

    Attributes:
        pending: the last kvcompose layer update whose attention has not run yet (`layer`, `owner`: weak
            references; `keys`, `values`: the tensors `update` returned, recognised by identity).
        mask: the last kvcompose cache's `get_mask_sizes` whose mask function call has not come yet
            (`owner`: a weak reference; `kv_length`, `kv_offset`: the sizes it returned).
    """

    pending: _HandOff | None = None
    mask: _MaskNote | None = None


_state = HookState()

MISSED = "kvcompose_missed"
"""The attribute of a cache (an owner of hand-offs) that holds the message of a hand-off no attention call
consumed (None while every update was attended)."""


def hook_state() -> HookState:
    """This thread's `HookState`."""
    return _state


def _owner(layer) -> object:
    return getattr(layer, "cache", layer)


def _missed_message(p: _HandOff) -> str:
    idx = getattr(p.layer(), "layer_idx", "?")
    return (
        f"layer {idx} of a kvcompose cache was updated, but kvcompose's attention did not run for it: the "
        f"model that ran it does not use the '{ATTN_IMPLEMENTATION}' attention implementation (it was changed "
        "after the cache was built, e.g. by set_attn_implementation() or kvcompose.attention.restore(), or the "
        "cache was passed to another model). The cache now holds tokens it never compressed; build a new cache "
        "for the model you generate with and leave its attention implementation alone while the cache is used."
    )


def _mark(owner: object, msg: str) -> None:
    try:
        setattr(owner, MISSED, msg)
    except (AttributeError, TypeError):  # pragma: no cover - an owner without a __dict__
        pass


def hand_off(layer, keys: Tensor, values: Tensor, owner=None) -> None:
    """Called by a kvcompose cache's `update` with the keys/values its layer returns to the model (`[B, H, Q, D]`).

    The attention function consumes the hand-off when the model passes those same tensors to it and calls
    `layer.attend(...)`. `owner` is one object shared by all layers of a cache (default `layer.cache`, else
    the layer). Raises `KVComposeError` if that owner has a hand-off that no kvcompose attention call
    consumed (see the module docstring); a stale hand-off of another owner marks that owner instead, which
    then raises at its own next `hand_off` (or `check_consumed`).
    """
    owner = _owner(layer) if owner is None else owner
    msg = getattr(owner, MISSED, None)
    if msg is not None:
        raise KVComposeError(msg)
    p = _state.pending
    if p is not None:
        _state.pending = None
        stale = p.owner()
        if stale is not None:
            msg = _missed_message(p)
            _mark(stale, msg)
            if stale is owner:
                raise KVComposeError(msg)
    _state.pending = _HandOff(weakref.ref(layer), keys, values, weakref.ref(owner))


def check_consumed(cache) -> None:
    """Raise `KVComposeError` if a layer of `cache` (an owner given to `hand_off`) was updated and kvcompose's
    attention never saw it."""
    p = _state.pending
    if p is not None and p.owner() is cache:
        _state.pending = None
        _mark(cache, _missed_message(p))
    msg = getattr(cache, MISSED, None)
    if msg is not None:
        raise KVComposeError(msg)


def expect_mask(cache, sizes: tuple[int, int]) -> tuple[int, int]:
    """Note that the next mask function call of this thread is `cache`'s (called by a kvcompose cache's
    `get_mask_sizes` with the `(kv_length, kv_offset)` it returns, which it returns unchanged)."""
    _state.mask = _MaskNote(weakref.ref(cache), int(sizes[0]), int(sizes[1]))
    return sizes


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


def check_open(cache, model) -> None:
    """Refuse to use a kvcompose cache that was closed, or whose model no longer runs kvcompose's attention,
    before the model's attention runs: the model's own implementation would otherwise attend the new tokens
    alone with a mask sized for the whole cache, and end in a shape error of its own (eager, flex, and sdpa for
    a multi-token step) or, for sdpa's single-token step, run before the next update names the problem."""
    cls = type(cache).__name__
    if getattr(cache, "kvcompose_closed", False):
        raise KVComposeError(f"this {cls} was closed (close() gave the model its previous attention implementation "
                             "back): build a new cache, or call cache.bind(model) to use this one again")
    if model is not None and not is_installed(model):
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        raise KVComposeError(
            f"the model of this {cls} no longer uses kvcompose's attention implementation (it is now "
            f"{text._attn_implementation!r}: changed by set_attn_implementation() or kvcompose.attention.restore() "
            "after the cache was built): build a new cache for the model, or call cache.bind(model) to switch it "
            "back to kvcompose's attention")


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
    if config is None or prev in _READS_NO_CONFIG_NAME:
        return fn(module, query, key, value, attention_mask, **kwargs)
    # flash (and hub-kernel) integrations read the implementation's name from the config during the call
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
    if query.shape[2] > 1 and not assisted_signal() and in_assisted_generation():  # a frame walk on 5.2 only
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
    p = _state.pending
    if p is not None and p.keys is key and p.values is value:
        _state.pending = None
        layer = p.layer()
        if layer is not None:
            return _kvcompose_call(layer, module, query, attention_mask, kwargs)
    return _delegate(module, query, key, value, attention_mask, kwargs)


def _note_matches(note: _MaskNote, kwargs: dict) -> bool:
    """Whether a mask call is the one a kvcompose cache's `get_mask_sizes` announced."""
    if note.owner() is None:
        return False
    for name, want in (("kv_length", note.kv_length), ("kv_offset", note.kv_offset)):
        got = kwargs.get(name)
        if got is not None and not isinstance(got, Tensor) and int(got) != want:
            return False
    return True


@no_trace  # never traced (graph break, runs eagerly)
def kvcompose_mask(*args, **kwargs):
    """The registered mask function: the 2-D padding mask for a kvcompose cache, else exactly the mask of
    the model's previous implementation (any transformers mask-interface signature)."""
    note, _state.mask = _state.mask, None
    if note is not None and _note_matches(note, kwargs):
        return kwargs.get("attention_mask")  # transformers passes every argument by keyword
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    prev = _previous_for(kwargs.get("config"))
    if prev not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return None  # transformers returns no mask for an implementation without a mask function
    return ALL_MASK_ATTENTION_FUNCTIONS[prev](*args, **kwargs)
