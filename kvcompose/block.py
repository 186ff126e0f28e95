"""The base of every block, and the optional capabilities a block may have.

A block is a small transformation with explicit state, as in optax: `init(spec)` builds the block's state
for one layer (None for a stateless block) and every call that changes state returns the new state. The
state never lives on the block object, so one block (and one `Pipeline`) serves every layer, row and
branch; the `Pipeline` threads each part's state and checks that state and parts match.

Two kinds of state:
- **layer state**: whatever `init` returns (e.g. GrowPage's page counts and query summaries), threaded by
  the pipeline per layer and per tree node. Tensors with a batch axis keep it first (`map_rows` reorders
  them for beam search).
- **token state**: `token_state = C > 0` float32 channels per held token (e.g. H2O's accumulated attention,
  C = 1). The layer's store carries them with their tokens through every append, compaction, tier move and
  batch operation; the block sees them as `[B, H, T]` (C = 1) or `[B, H, T, C]`.

Composite blocks (a weighted sum of scorers, a block-granular selector around another selector) list their
parts in `children()`; their state is the tuple of their children's states.

Optional capabilities are `typing.Protocol` classes checked with `isinstance`: `Observer` (sees every
attention step), `LayerSchedule` (gives each layer its own budget) and `EventTrigger` (an allocator that
decides itself which rows of a paged layer need a compression event, instead of the interval rule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from .view import AttentionStep, KVComposeError, LayerSpec

__all__ = ["Block", "Observer", "LayerSchedule", "EventTrigger", "map_row_tensors", "role_of", "require_role"]


def map_row_tensors(state: Any, fn: Callable[[Tensor], Tensor], batch: int) -> Any:
    """Apply a batch-row operation to every tensor with a leading batch axis of size `batch` inside nested
    tuples, lists, dicts and dataclasses (other leaves are returned as they are)."""
    if isinstance(state, Tensor):
        return fn(state) if state.dim() >= 1 and state.shape[0] == batch else state
    if isinstance(state, dict):
        return {k: map_row_tensors(v, fn, batch) for k, v in state.items()}
    if isinstance(state, (tuple, list)):
        return type(state)(map_row_tensors(v, fn, batch) for v in state)
    if is_dataclass(state) and not isinstance(state, type):
        return replace(state, **{f.name: map_row_tensors(getattr(state, f.name), fn, batch) for f in fields(state)
                                 if f.init})
    return state


def accepts(fn: Callable, name: str) -> bool:
    """Whether `fn` takes a parameter `name` (cached per function): a block method that takes `state` or
    `positions` is given them; one written without them is called as before."""
    key = (fn, name)
    if key not in _ACCEPTS:
        import inspect

        try:
            _ACCEPTS[key] = name in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            _ACCEPTS[key] = False
    return _ACCEPTS[key]


_ACCEPTS: dict[tuple[Callable, str], bool] = {}


def with_state(out: Any, state: Any, result_is_pair: bool = False) -> tuple[Any, Any]:
    """`(result, new_state)` from what a leaf's method returned: `result` alone (its state unchanged) or
    `(result, new_state)` (optax's shape). `result_is_pair`: the result itself is a pair (a selector's
    `(kept, order)`), so only `((kept, order), new_state)` carries a state."""
    if isinstance(out, tuple) and len(out) == 2 and (not result_is_pair or isinstance(out[0], tuple)):
        return out[0], out[1]
    return out, state


def role_of(obj: Any) -> str:
    """The block role of `obj` ("Scorer", "Protector", "Selector", "Allocator", "TierStore": the class right
    below `Block` in its MRO), else its type name ("Pipeline", "float", ...)."""
    for cls in type(obj).__mro__:
        if Block in cls.__bases__:
            return cls.__name__
    return type(obj).__name__


def _short(obj: Any) -> str:
    """`repr` of a block (they are short), the type name of anything else (a model's repr is pages long)."""
    if isinstance(obj, Block):
        return repr(obj)
    if isinstance(obj, (int, float, str, type(None))):
        return repr(obj)
    return f"a {type(obj).__name__}"


def require_role(obj: Any, role: type, where: str, hint: str = "") -> Any:
    """Return `obj` if it is a block of `role`; else raise `KVComposeError` naming what it is instead, e.g.
    "with_allocator: HostTier() is a TierStore, not an Allocator". Every place that accepts a block checks
    its argument with this, so a block in the wrong slot is refused with the same words everywhere."""
    if isinstance(obj, role):
        return obj
    what = role_of(obj)
    article = "an" if what[:1].lower() in "aeiou" else "a"
    raise KVComposeError(f"{where}: {_short(obj)} is {article} {what}, not {'an' if role.__name__[0] in 'AEIOU' else 'a'} "
                         f"{role.__name__}{hint}")


class Block:
    """Base of Scorer, Protector, Selector, Allocator and TierStore.

    Class attributes:
        token_state: float32 channels per held token this block keeps (0: none).
        query_window: how many recent post-RoPE queries the block reads (the layer keeps a ring buffer).
        draws_random: the block draws from the layer's seeded generator (`LayerView.generator`), so the
            cache's `seed` changes what it does (a cache warns about a seed for a pipeline without one).
        draws_per_row: every draw of the block leads with the view's rows (`seeding.draw`) and a row's part has
            the shape it has when the row is alone at the same width, so rows of separate requests can each draw
            from their own generator in one view (`RowGenerators`: the vLLM route's grouped events) and draw
            exactly what they draw alone; False (the default) runs such requests one at a time.
        padded_rows: why a left-padded row of a batch may keep other tokens than the same row alone with this
            block (e.g. a budget shared by the batch's rows), or None: it keeps the same (the rule every block
            states, checked by tests/test_block_rules.py; a cache warns the reason at a padded forward).
    """

    token_state: int = 0
    query_window: int = 0
    draws_random: bool = False  # True: draws from the layer's seeded generator (the cache's `seed` matters)
    draws_per_row: bool = False  # True: its draws lead with the rows (one generator per row can serve them)
    padded_rows: str | None = None  # why a left-padded row may keep other tokens than the row alone (None: same)

    _hook: str | None = None  # what a subclass of the role implements (set by the role's base class)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls._hook and "_hook" not in cls.__dict__ and "__call__" in cls.__dict__:
            base = next(b for b in cls.__mro__[1:] if "_hook" in b.__dict__)
            raise TypeError(f"{cls.__name__} overrides __call__, which the pipeline never calls (it calls "
                            f"apply): a {base.__name__} implements {cls._hook}")

    def init(self, spec: LayerSpec) -> Any:
        """The block's layer state for a fresh layer (None: stateless, or token state only)."""
        return None

    def children(self) -> tuple["Block", ...]:
        """Parts of a composite block (their states form this block's state, in order)."""
        return ()

    def bind_model(self, model: Any) -> None:
        """Called by a cache with the model it decodes with: when it is built, and by `bind` for a copied or
        loaded cache (`Pipeline.bind_model` reaches every block of a pipeline). A block that reads the model's
        weights takes references to them here (a copy of a cache never copies them: `CriticalKV`), and a block
        made for one model (a calibrated profile, weights taken earlier) refuses another one with a
        `KVComposeError`. Default: nothing."""
        return None

    def map_rows(self, state: Any, fn: Callable[[Tensor], Tensor], batch: int) -> Any:
        """Reorder / select batch rows of this block's layer state (beam search, `batch_select_indices`)."""
        return map_row_tensors(state, fn, batch)

    # arithmetic is for scorers only (`kvcompose.scorers.Scorer` overrides these): any other block in an
    # expression such as `0.5 * Recency() - TopK()` is refused by name instead of Python's operand TypeError
    def _not_a_scorer(self, *_: Any) -> Any:
        raise KVComposeError(f"{self!r} is {'an' if role_of(self)[0] in 'AEIOU' else 'a'} {role_of(self)}, not a "
                             "Scorer: only scorers combine with arithmetic (e.g. 0.5 * Recency() - 0.5 * KeyNorm()); "
                             "give the other blocks to the Pipeline")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __neg__ = _not_a_scorer

    @property
    def takes_state(self) -> bool:
        """True when the block's calls take its state (it has token state, layer state or parts)."""
        return bool(self.token_state) or type(self).init is not Block.init or bool(self.children())


@runtime_checkable
class Observer(Protocol):
    """A block that sees every attention call of its layer and updates its state (e.g. H2O's
    accumulated attention): `observe(state, step) -> state`."""

    def observe(self, state: Any, step: AttentionStep) -> Any: ...


@runtime_checkable
class LayerSchedule(Protocol):
    """An allocator that gives each layer its own budget: `layer_budget(layer_idx, num_layers, budget,
    seen) -> int` (PyramidKV, ReasonAlloc's wave, a share of the tokens seen)."""

    def layer_budget(self, layer_idx: int, num_layers: int, budget: int | None, seen: int) -> int: ...


@runtime_checkable
class EventTrigger(Protocol):
    """An allocator of a paged layer that decides itself when rows need a compression event (GrowPage: when a
    request's pages are full), instead of the layer's rule "every `interval`-th decoded token, rows that hold
    more than their limit".

    `due(state, lengths, limits, decoded, interval) -> bool [B]`, asked by the layer core after the attention
    of every forward call (prefill only with `compress_prefill=True`): `state` is the allocator's layer state
    (what `init` / the last `allocate` returned; the allocator must be a leaf of the pipeline), `lengths`
    `[B, H]` the slots each (row, KV head) holds (padding included: it occupies pages too), `limits` `[B, H]`
    the kept budgets of the last event (`initial_limits` before the first), `decoded` the tokens decoded so
    far and `interval` the cache's interval. It runs at every step, so `lengths` and `limits` are host-side
    (numpy int64) mirrors and the answer is a host bool array: asking must never wait for the device (an
    answer on the device is accepted, at the cost of one host sync per step). The rows it returns go through
    one event (`ComposeLayer.compress(rows=...)`), where `allocate` decides for each of them (take a page, or
    compress).
    """

    def due(self, state: Any, lengths: Any, limits: Any | None, decoded: int, interval: int) -> Any: ...
