"""Copying a kvcompose cache: `copy.deepcopy`, `pickle` and `torch.save` of `KVComposeCache` and `BranchCache`.

A cache is plain state (stores, tier contents, pipeline state, query rings, generators, counters) plus three
kinds of references that a copy must not take over from the original: the model (shared, never copied), the
links of its layers back to the cache and to each other (weak references, re-created for the copy), and its
hold on the model's attention implementation and forward hooks (registered again for the copy). Each cache
class calls the functions here from `__deepcopy__`, `__getstate__` / `__setstate__` and `bind`:

- `copy.deepcopy(cache)` gives an independent cache that shares the model: it decodes exactly as the original
  would from the same point (same tokens, same compression events, same random draws), and either may be
  dropped first.
- `pickle.dumps(cache)` / `torch.save(cache, f)` store the state without the model; the loaded cache must be
  attached to a model of the same architecture with `cache.bind(model)` before it decodes (it refuses to
  until then). `torch.load` needs `weights_only=False` for it, as for any object that is not a tensor.
- `copy.copy(cache)` (a shallow copy would share the layers with the original) is refused.

The references are rebuilt explicitly (`link_layers`), never by copying the objects that hold them, so the
layer core may keep them in any form (weak references, a small state object) as long as `link_layers` sets them.
"""

from __future__ import annotations

import copy
import io
import pickle
import weakref
from typing import Any

import torch

from .view import KVComposeError

__all__ = ["UNBOUND", "link_layers", "layer_state", "restore_layer", "cache_state", "deepcopy_cache",
           "check_picklable", "check_same_model", "reduce_cache"]

UNBOUND = ("this {cls} was loaded from a pickle (or torch.load) and is not attached to a model: call "
           "cache.bind(model) with the model it was built for (or one of the same architecture) before decoding")
"""Message of a loaded cache used before `bind`."""

_LINKS = ("_owner", "_tree")  # a layer's references to its cache (which gives its peers) and to its tree


def _no_owner() -> None:
    return None


def link_layers(owner: Any, layers: list, tree: bool = False) -> None:
    """Point every layer of a cache at `owner` (its cache, through which a layer reaches its peers; with `tree`,
    also as the tree whose path the layer reads): what the cache's `__init__` sets up, done again for a copy or a
    loaded cache."""
    for layer in layers:
        layer._owner = weakref.ref(owner)
        if tree:
            layer._tree = weakref.ref(owner)


def layer_state(layer: Any) -> dict[str, Any]:
    """A layer's `__getstate__`: everything but its references to the cache, its peers and fetched copies."""
    return {k: v for k, v in layer.__dict__.items() if k not in _LINKS}


def restore_layer(layer: Any, state: dict[str, Any]) -> None:
    """A layer's `__setstate__`: the state, with no cache yet (`link_layers` gives it one)."""
    layer.__dict__.update(state)
    layer._owner = _no_owner


def cache_state(cache: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """A cache's state for a copy: its attributes without the model and the hooks (`drop` names them), with the
    prefetcher's copies in flight dropped (they are re-fetched) and the per-forward padding note cleared."""
    if getattr(cache, "_recompute_path", None) is not None:
        raise KVComposeError(f"cannot copy a {type(cache).__name__} during a recomputation")
    core = cache.core
    core.prefetcher.clear()
    core.step_padding = None
    return {k: (None if k in drop else v) for k, v in cache.__dict__.items()}


def deepcopy_cache(cache: Any, memo: dict, drop: tuple[str, ...]) -> Any:
    """`copy.deepcopy` of a cache: its state copied, the copy set up as a loaded cache (`__setstate__`: its layers
    re-linked to it) and bound to the same model (which is shared, never copied). Raises `KVComposeError` naming
    what could not be copied."""
    model = cache.bound_model()
    cls = type(cache)
    new = cls.__new__(cls)
    memo[id(cache)] = new
    if model is not None:
        memo[id(model)] = model  # the model is shared
    try:
        state = copy.deepcopy(cache_state(cache, drop), memo)
    except KVComposeError:
        raise
    except Exception as e:  # a block or a tier state that cannot be copied
        raise KVComposeError(f"cannot copy this {cls.__name__}: {type(e).__name__}: {e}") from e
    new.__setstate__(state)  # as a loaded cache: re-linked, not bound yet
    if model is not None:
        new.bind(model)
    return new


def reduce_cache(cache: Any) -> tuple:
    """A cache's `__reduce_ex__`: its `__getstate__` serialised with `torch.save`, which keeps tensors that are
    views of one storage (a store's buffer and its cached narrow or flat views) sharing it when loaded; plain
    pickle writes every tensor's storage separately, so a loaded store would write into a buffer its views no
    longer show. `pickle.dumps(cache)` and `torch.save(cache, f)` both go through here."""
    buf = io.BytesIO()
    torch.save(cache.__getstate__(), buf)
    return (_load_cache, (type(cache), buf.getvalue()))


def _load_cache(cls: type, data: bytes) -> Any:
    """Rebuild a cache pickled by `reduce_cache` (unbound: `bind(model)` attaches it)."""
    state = torch.load(io.BytesIO(data), weights_only=False, map_location=None)
    new = cls.__new__(cls)
    new.__setstate__(state)
    return new


def check_picklable(cache: Any) -> None:
    """Refuse to pickle a cache whose pipeline holds something pickle cannot store (e.g. a reward tracker with a
    tokenizer), naming it, instead of pickle's error from deep inside the state."""
    try:
        pickle.dumps(cache.pipeline)
    except Exception as e:
        raise KVComposeError(
            f"cannot pickle this {type(cache).__name__}: its pipeline {cache.pipeline!r} holds an object pickle cannot "
            f"store ({type(e).__name__}: {e}); copy.deepcopy(cache) copies it within this process"
        ) from e


def check_same_model(cache: Any, model: Any, config: Any) -> None:
    """Refuse to bind a cache to a model whose layers do not match the ones it holds tokens of."""
    n = config.num_hidden_layers
    if n != cache.num_layers:
        raise KVComposeError(f"cannot bind: the cache has {cache.num_layers} layers, the model {n}")
    mt = getattr(config, "model_type", None)
    if getattr(cache, "model_type", mt) not in (None, mt):
        raise KVComposeError(f"cannot bind: the cache was built for a {cache.model_type} model, got {mt}")
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and (layer.num_heads != heads or layer.head_dim != head_dim):
            raise KVComposeError(
                f"cannot bind: layer {layer.layer_idx} holds {layer.num_heads} KV heads of dim {layer.head_dim}, "
                f"the model has {heads} of dim {head_dim}"
            )
