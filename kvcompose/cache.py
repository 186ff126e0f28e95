"""`KVComposeCache`: a transformers `Cache` that compresses the KV cache during decoding.

One `kvcompose.layer.ComposeLayer` per decoder layer holds the layer's tokens in a store whose memory
follows the tokens it holds (dense buffers of about `budget + interval` slots, or pages for per-head
budgets): eviction frees real memory, the held length never grows with the sequence. `get_seq_length()`
counts tokens *seen*; the layer holds fewer.

Schedule: after the attention of every `interval`-th decoded token, a layer whose rows hold more real
tokens than its budget is cut back to exactly the budget. So once the first compression has run,
`budget <= held < budget + interval` after every step. The prompt itself is compressed at prefill only
with `compress_prefill=True`; otherwise a long prompt is first cut at decoded token `interval`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from jaxtyping import Int
from torch import Tensor
from transformers.cache_utils import Cache

from . import attention as _attn
from . import compat
from . import copying as _copying
from .block import Block, EventTrigger, role_of
from .layer import CacheStats, ComposeLayer, CoreConfig
from .pipeline import Pipeline
from .prefetch import Prefetcher
from .seeding import check_seed
from .view import KVComposeError, warn_unused

__all__ = ["KVComposeCache", "MemoryReport", "CacheStats", "check_model", "check_interval", "check_budget",
           "check_unused"]

DEFAULT_INTERVAL = 64
LIMIT = 2**31  # budgets and intervals beyond this are refused (no memory is reserved ahead, but indices are int32)
_no_trace = _attn.no_trace  # cache bookkeeping is never traced: under torch.compile it runs eagerly


@dataclass
class MemoryReport:
    """KV memory of a `KVComposeCache`, in bytes.

    Attributes:
        total: bytes of KV held in HBM (the device) over all layers.
        allocated: bytes of the device buffers (held + free slots / pages).
        by_layer: held HBM bytes per layer.
        full_cache: bytes a full (uncompressed) cache would hold for the tokens seen.
        by_tier: bytes per tier ('hbm', 'host', 'compressed').
        by_tier_layer: per tier, bytes per layer.
        peak: peak bytes over the run per tier, plus 'allocated'.
        seen, held: tokens seen and tokens held (max over layers).
    """

    total: int
    allocated: int
    by_layer: list[int]
    full_cache: int
    by_tier: dict[str, int] = field(default_factory=dict)
    by_tier_layer: dict[str, list[int]] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    seen: int = 0
    held: int = 0

    @property
    def ratio(self) -> float:
        """Held HBM bytes / full-cache bytes."""
        return self.total / self.full_cache if self.full_cache else 1.0

    def __str__(self) -> str:
        mib = 2**20
        rows = [
            ("tokens seen", f"{self.seen}"),
            ("tokens held (max layer)", f"{self.held}"),
            ("KV held in HBM", f"{self.total / mib:.2f} MiB"),
            ("HBM buffers allocated", f"{self.allocated / mib:.2f} MiB"),
            ("full cache would hold", f"{self.full_cache / mib:.2f} MiB"),
            ("held / full", f"{self.ratio:.3f}"),
        ]
        for tier, b in self.by_tier.items():
            if tier != "hbm":
                rows.append((f"tier {tier}", f"{b / mib:.2f} MiB"))
        for k, v in self.peak.items():
            rows.append((f"peak {k}", f"{v / mib:.2f} MiB"))
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def check_model(model, strict: bool = False):
    """`(text config, compat.ModelAttention)` of a decoder-only model kvcompose can run, or a `KVComposeError`
    naming what it cannot honour (see `kvcompose.compat.check_model`). With `strict`, also refuse model
    types outside the tested ones (`compat.TESTED_MODEL_TYPES`)."""
    compat.check_transformers()
    config = getattr(model, "config", None)
    if config is None:
        raise KVComposeError("model has no config: pass a Hugging Face PreTrainedModel")
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", None)
    if strict and model_type not in compat.TESTED_MODEL_TYPES:
        raise KVComposeError(f"model type {model_type!r} is not among the tested ones "
                             f"({', '.join(compat.TESTED_MODEL_TYPES)}); strict=False accepts it")
    return config, compat.check_model(model, features=ComposeLayer.attention_features)


def check_interval(interval) -> int:
    if isinstance(interval, bool) or not isinstance(interval, int) or not 0 < interval < LIMIT:
        raise KVComposeError(f"interval must be a positive int below 2**31, got {interval!r}")
    return interval


def check_budget(budget, name: str = "budget") -> int | None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or not 0 < budget < LIMIT):
        raise KVComposeError(f"{name} must be a positive int below 2**31, got {budget!r}")
    return budget


def check_unused(pipeline: Pipeline, attention, *, budget=None, interval=None, seed=0, compress_prefill=False,
                 reserve=False, prefetcher=None, where: str = "KVComposeCache") -> None:
    """Warn (`KVComposeWarning`) about every cache argument that cannot change what this pipeline does: a budget,
    an interval or `compress_prefill` for a pipeline that never compresses, an interval for an allocator that
    decides itself when to compress (GrowPage), a seed for a pipeline with no random block, `reserve` for paged
    storage, a prefetcher for a pipeline whose tier holds no tokens. (A model with sliding-window layers uses
    the interval for their window cuts whatever the pipeline.)"""
    p = repr(pipeline)
    sliding = bool(attention is not None and attention.sliding_layers)
    if not pipeline.compresses:
        if budget is not None:
            warn_unused(f"{where}(budget={budget})", f"{p} never compresses (it keeps every token)", stacklevel=4)
        if compress_prefill:
            warn_unused(f"{where}(compress_prefill=True)", f"{p} never compresses", stacklevel=4)
        if interval is not None and not sliding:
            warn_unused(f"{where}(interval={interval})", f"{p} never compresses", stacklevel=4)
        if reserve:
            warn_unused(f"{where}(reserve=True)", f"{p} never compresses: its buffers grow with the sequence",
                        stacklevel=4)
    else:
        if interval is not None and not sliding and isinstance(pipeline.allocator, EventTrigger) and pipeline.paged:
            warn_unused(f"{where}(interval={interval})", f"{pipeline.allocator!r} decides itself when a row is "
                        "compressed (when its pages are full), not every interval tokens", stacklevel=4)
        if reserve and pipeline.paged:
            warn_unused(f"{where}(reserve=True)", f"{p} stores its layers in pages, which are allocated as needed",
                        stacklevel=4)
    if seed and not pipeline.draws_random:
        warn_unused(f"{where}(seed={seed})", f"no block of {p} draws random numbers", stacklevel=4)
    if prefetcher is not None and not pipeline.tier.holds_tokens:
        warn_unused(f"{where}(prefetcher=...)", f"the tier of {p} holds no tokens to bring back", stacklevel=4)


class CacheGlue:
    """What every kvcompose cache class says to transformers and to `kvcompose.attention`, written once
    (`KVComposeCache`, `BranchCache`): the routing flags, the usability check before each Cache API call (closed,
    unbound, or the model's attention switched away), the missed-attention check before each step, the mask note,
    and the refusals (assisted decoding, croppability). A subclass gives `_bound()` (the model is attached),
    `_seen_length(...)` (tokens seen, what `get_seq_length` answers) and `_layer_mask_sizes(...)` (a layer's
    `(held + new, seen - held)`)."""

    kvcompose_attention = True  # kvcompose.attention routes calls that carry this cache to its layers
    kvcompose_missed: str | None = None  # set by kvcompose.attention when an update's attention never ran
    kvcompose_closed = False  # set by close(); cleared by bind(model)
    # transformers' deferred stop check (MPS) decodes one token too many and crops it afterwards, for caches
    # that say they are croppable; a kvcompose crop may be refused, so generate must not count on it
    is_croppable = False

    def _bound(self) -> bool:
        raise NotImplementedError

    def _seen_length(self, *args, **kwargs) -> int:
        raise NotImplementedError

    def _layer_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        raise NotImplementedError

    def _check_usable(self) -> None:
        if not self._bound() and not self.kvcompose_closed:
            raise KVComposeError(_copying.UNBOUND.format(cls=type(self).__name__))
        _attn.check_open(self, self.bound_model())  # closed, or the model's attention was switched: refused by name
        if not self._bound():
            raise KVComposeError(_copying.UNBOUND.format(cls=type(self).__name__))

    # -- transformers Cache API, never traced by torch.compile -----------------------------------
    @_no_trace
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Append the new keys/values to layer `layer_idx` and hand that layer to kvcompose's attention, which
        recognises the returned tensors. Raises `KVComposeError` when the previous update of this cache was
        never seen by kvcompose's attention (the model's attention implementation was changed, or the cache
        went to another model)."""
        self._check_usable()
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        _attn.hand_off(self.layers[layer_idx], *out, owner=self)
        return out

    @_no_trace
    def get_seq_length(self, *args, **kwargs) -> int:
        self._check_usable()
        _attn.check_consumed(self)  # generate asks before every step: a layer whose attention never ran raises
        return self._seen_length(*args, **kwargs)

    @_no_trace
    def get_mask_sizes(self, *args, **kwargs):
        """`(held + new, seen - held)` of a layer; the mask function call that follows is this cache's
        (`kvcompose.attention.expect_mask`)."""
        self._check_usable()  # before the model builds a mask and attends: never a shape error of its attention
        return _attn.expect_mask(self, self._layer_mask_sizes(*args, **kwargs))

    def activate_past_recording(self, *args, **kwargs):
        """Called by transformers (5.23+) before assisted / prompt-lookup decoding: refused."""
        raise KVComposeError(compat.ASSISTED_MESSAGE)

    def __reduce_ex__(self, protocol):
        return _copying.reduce_cache(self)  # torch.save inside: views of one buffer stay views when loaded


class KVComposeCache(CacheGlue, Cache):
    """A compressing KV cache for `model.generate(past_key_values=cache)`.

    kvcompose's attention runs only for calls that carry this cache; the model keeps its previous attention
    implementation for every other call, and gets it back for good when the cache is gone
    (`kvcompose.attention`). Assisted and prompt-lookup decoding are refused; `torch.compile` runs the cache's
    bookkeeping eagerly (same tokens and events as eager decoding).

    Example:
        >>> cache = KVComposeCache(model, Pipeline(ProtectPrompt(), ProtectValueNorm(), RandomDrop()), budget=1024)
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=8192)
        >>> print(cache.memory())

    Args:
        model: a Hugging Face decoder-only model whose attention goes through transformers' attention interface
            (`docs/models.md` lists the tested architectures; soft-capping, sliding windows and sinks are
            honoured; a sliding-window layer keeps its own window and is not compressed beyond it).
        pipeline: the compression method (a `Pipeline` or a preset from `kvcompose.methods`); None = full cache.
        budget: tokens kept per layer (per row and KV head) after each compression event.
        interval: decoded tokens between compression events (default: the pipeline's own, e.g. R-KV 128,
            VaSE 64; else 64).
        compress_prefill: also compress the prompt right after prefill (off by default).
        seed: seed of the per-layer random generators (random selectors are reproducible).
        strict: also refuse model types that are not among the tested ones.
        prefetcher: brings tier tokens back before attention (default `Prefetcher()`).
        reserve: allocate each dense layer's `budget + interval` slots at once (fixed-capacity buffers, for
            CUDA graphs); by default buffers grow with the sequence.

    An argument that cannot change what the pipeline does (a budget for `methods.full()`, a seed for a pipeline
    without random blocks, ...) is accepted with a `KVComposeWarning` naming why (`check_unused`).
    """

    def __init__(
        self,
        model,
        pipeline: Pipeline | None = None,
        budget: int | None = None,
        *,
        interval: int | None = None,
        compress_prefill: bool = False,
        seed: int = 0,
        strict: bool = False,
        prefetcher: Prefetcher | None = None,
        reserve: bool = False,
    ):
        pipeline = pipeline if pipeline is not None else Pipeline()
        if not isinstance(pipeline, Pipeline):
            hint = f": wrap blocks in one, e.g. Pipeline({pipeline!r}, ...)" if isinstance(pipeline, Block) else ""
            raise KVComposeError(f"pipeline must be a kvcompose Pipeline, got {role_of(pipeline)}{hint}")
        check_budget(budget)
        interval_given = interval
        interval = check_interval(interval if interval is not None else (pipeline.interval or DEFAULT_INTERVAL))
        seed = check_seed(seed, "KVComposeCache(seed=...)")
        if prefetcher is not None and not isinstance(prefetcher, Prefetcher):
            raise KVComposeError(f"prefetcher must be a kvcompose Prefetcher, got {type(prefetcher).__name__}")
        pipeline.validate(budget)
        config, self.attention = check_model(model, strict)
        pipeline.bind_model(model)  # blocks that read the model take its weights; a profile for another model is refused
        check_unused(pipeline, self.attention, budget=budget, interval=interval_given, seed=seed,
                     compress_prefill=compress_prefill, reserve=reserve, prefetcher=prefetcher)
        self.model_type = getattr(config, "model_type", None)
        self.pipeline = pipeline
        self.budget = budget
        self.interval = interval
        self.compress_prefill = compress_prefill
        self.seed = seed
        self.num_layers = config.num_hidden_layers
        self.stats = CacheStats()
        self.prefetcher = prefetcher if prefetcher is not None else Prefetcher()
        if pipeline.compresses:
            heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            pipeline.allocator.check(pipeline, budget, self.num_layers, heads)
        self.core = CoreConfig(pipeline=pipeline, budget=budget, interval=interval, num_layers=self.num_layers,
                               compress_prefill=compress_prefill, seed=seed, prefetcher=self.prefetcher,
                               stats=self.stats, reserve=reserve)
        _attn.install(model, owner=self)
        self._model = weakref.ref(model)
        windows = {a.index: a.sliding_window for a in self.attention.layers if a.kind == "sliding"}
        layers = [ComposeLayer(self.core, i, owner=self, sliding_window=windows.get(i)) for i in range(self.num_layers)]
        super().__init__(layers=layers)  # layers reach their peers through a weak reference to the cache

    # -- CacheGlue: the Cache API answers of a flat list of layers ------------------------------------
    def _bound(self) -> bool:
        return self._model is not None

    def _seen_length(self, *args, **kwargs) -> int:
        return Cache.get_seq_length(self, *args, **kwargs)

    def _layer_mask_sizes(self, *args, **kwargs):
        return Cache.get_mask_sizes(self, *args, **kwargs)

    @_no_trace
    def get_query_offset(self, *args, **kwargs):
        return super().get_query_offset(*args, **kwargs)

    def close(self) -> None:
        """Give the model its previous attention implementation back now (also done when the cache is
        garbage-collected, if no other kvcompose cache uses the model). The closed cache refuses to decode by
        name (whatever the model's attention implementation) until `bind(model)` opens it again."""
        _attn.release(self)
        self.kvcompose_closed = True

    # -- copying: copy.deepcopy, pickle, torch.save (kvcompose.copying) ----------------------------------
    def __copy__(self):
        raise KVComposeError("copy.copy(cache) would share the cache's layers with the original; "
                             "use copy.deepcopy(cache) for an independent copy that shares the model")

    def __deepcopy__(self, memo: dict) -> "KVComposeCache":
        """An independent cache that shares the model and decodes exactly as this one would from here."""
        return _copying.deepcopy_cache(self, memo, drop=("_model",))

    def __getstate__(self) -> dict:
        """Pickle / torch.save: the state without the model; the loaded cache needs `bind(model)`."""
        _copying.check_picklable(self)
        return _copying.cache_state(self, drop=("_model",))

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._model = None  # unbound until bind(model)
        _copying.link_layers(self, self.layers)

    def bound_model(self):
        """The model this cache decodes with (None for a cache loaded from a pickle before `bind`)."""
        return None if self._model is None else self._model()

    def bind(self, model) -> "KVComposeCache":
        """Attach a cache loaded with pickle / `torch.load` to its model (the one it was built for, or one of the
        same architecture and weights: the cache holds that model's keys and values). Switches the model to
        kvcompose's attention as the constructor does; also opens a closed cache again, and switches its model back
        after `set_attn_implementation()` / `kvcompose.attention.restore()`. Returns the cache."""
        current = self.bound_model()
        if current is model and not self.kvcompose_closed and _attn.is_installed(model):
            return self
        if current is not None and current is not model:
            raise KVComposeError("this cache is bound to another model; copy.deepcopy(cache) shares its model")
        config, attention = check_model(model)
        _copying.check_same_model(self, model, config)
        self.pipeline.bind_model(model)  # a copy holds no weights: its blocks take the model's again
        if current is model:
            _attn.release(self)  # re-opened: one hold on the model's attention switch, not two
        _attn.install(model, owner=self)
        self.attention = attention
        self._model = weakref.ref(model)
        self.kvcompose_closed = False
        return self

    # -- rolling back --------------------------------------------------------------------------------
    @_no_trace
    def crop(self, max_length: int) -> None:
        """Remove the newest `-max_length` tokens (a positive value keeps that many tokens seen), exactly:
        afterwards the cache is what a fresh cache fed only the tokens before them would be, and decoding on
        gives the same tokens. When that is impossible (a compression event since the crop point evicted
        tokens a fresh run would still hold, an observer such as H2O's accumulated attention saw the removed
        tokens, or the query window dropped queries a fresh run would still read), raises `KVComposeError`
        naming the reason, and the cache is unchanged (every layer is checked before any is cropped). To come
        back to a point later whatever happens in between, `copy.deepcopy(cache)` there."""
        counts = {layer.crop_count(max_length) for layer in self.layers}
        n = max(counts)
        if n == 0:
            return
        for layer in self.layers:
            reason = layer.crop_refusal(n)
            if reason is not None:
                raise KVComposeError(f"cannot crop {n} tokens: {reason}")
        for layer in self.layers:
            layer.apply_crop(n)

    # -- budgets ----------------------------------------------------------------------------------
    def layer_budget(self, layer_idx: int) -> int | None:
        """The token budget of one layer now (the allocator may vary it by layer and by tokens seen)."""
        return self._layer(layer_idx).layer_budget()

    def _layer(self, layer_idx: int) -> ComposeLayer:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise KVComposeError(f"layer index {layer_idx!r} out of range: the cache has {len(self.layers)} layers")
        return self.layers[layer_idx]

    # -- public helpers ---------------------------------------------------------------------------
    def kept_positions(self, layer_idx: int) -> Int[Tensor, "B H K"]:
        """Original positions of the tokens a layer holds in HBM, `[batch, kv_heads, kept]`, ascending.

        With per-head budgets heads hold different counts: `kept` is the largest, and each shorter head's
        row ends with -1 padding."""
        layer = self._layer(layer_idx)
        if not layer.is_initialized or layer.positions is None:
            raise KVComposeError(f"layer {layer_idx} holds nothing yet")
        pos = layer.positions
        inside = torch.arange(pos.shape[-1], device=pos.device) < layer.lengths[..., None]
        return torch.where(inside, pos, torch.full_like(pos, -1))

    def held_lengths(self) -> list[int]:
        """Tokens held in HBM per layer (the longest (row, head))."""
        return [layer.held for layer in self.layers]

    def memory(self) -> MemoryReport:
        """Bytes held, allocated, per layer, per tier, and the full-cache equivalent."""
        by_layer = [layer.held_bytes() for layer in self.layers]
        full = sum(layer.seen * layer.bytes_per_token() for layer in self.layers)
        by_tier_layer: dict[str, list[int]] = {"hbm": by_layer}
        for i, layer in enumerate(self.layers):
            for tier, b in layer.tier_bytes().items():
                by_tier_layer.setdefault(tier, [0] * len(self.layers))[i] = b
        by_tier = {k: sum(v) for k, v in by_tier_layer.items()}
        peak = {
            "hbm": sum(layer.peak_held_bytes for layer in self.layers),
            "allocated": sum(layer.peak_alloc_bytes for layer in self.layers),
            "host": 0,
            "compressed": 0,
        }
        for layer in self.layers:
            for k, v in layer.tier_peak().items():
                peak[k] = peak.get(k, 0) + v
        return MemoryReport(
            total=sum(by_layer),
            allocated=sum(layer.allocated_bytes() for layer in self.layers),
            by_layer=by_layer,
            full_cache=full,
            by_tier=by_tier,
            by_tier_layer=by_tier_layer,
            peak=peak,
            seen=self.layers[0].seen,
            held=max((layer.held for layer in self.layers), default=0),
        )

    def __repr__(self) -> str:
        return f"KVComposeCache({self.pipeline!r}, budget={self.budget}, interval={self.interval}, layers={len(self.layers)})"
