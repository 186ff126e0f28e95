"""`KVComposeCache`: a transformers `Cache` that compresses the KV cache during decoding.

One `KVComposeLayer` per decoder layer holds the layer's tokens in a reusable buffer
(`[B, H, capacity, D]`, capacity about `budget + interval`): eviction frees real memory, the held length
never grows with the sequence. `get_seq_length()` counts tokens *seen*; the layer holds fewer.

Schedule: after the attention of every `interval`-th decoded token, a layer whose rows hold more real
tokens than its budget is cut back to exactly the budget. So once the first compression has run,
`budget <= held < budget + interval` after every step. The prompt itself is compressed at prefill only
with `compress_prefill=True`; otherwise a long prompt is first cut at decoded token `interval`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from . import attention as _attn
from .pipeline import Pipeline, Selection
from .tiers import TierTokens
from .view import KVComposeError, LayerView

__all__ = ["KVComposeCache", "KVComposeLayer", "MemoryReport", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class MemoryReport:
    """KV memory of a `KVComposeCache`, in bytes.

    Attributes:
        total: bytes of KV held in HBM (the device) over all layers.
        allocated: bytes of the device buffers (held + free slots of the reusable buffers).
        by_layer: held HBM bytes per layer.
        full_cache: bytes a full (uncompressed) cache would hold for the tokens seen.
        by_tier: bytes per tier ('hbm', 'host', 'compressed').
        by_tier_layer: per tier, bytes per layer.
        peak: peak bytes over the run per tier, plus 'allocated'.
        seen, held: tokens seen and tokens held (max over layers) by row 0.
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


@dataclass
class CacheStats:
    """Counters of a cache's compression events: wall time spent in them and how many ran (all layers).

    With `sync=True` the device is synchronised around each event (exact on CUDA, slower)."""

    compress_seconds: float = 0.0
    compress_calls: int = 0
    sync: bool = False


def timed_compress(fn):
    """Decorator of a layer's `compress()` that adds its wall time to `layer.cache.stats`."""
    import functools
    import time

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        stats = self.cache.stats
        if stats.sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            if stats.sync and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            stats.compress_seconds += time.perf_counter() - t0
            stats.compress_calls += 1

    return wrapper


def check_model(model, strict: bool = True):
    """The text config of a supported decoder-only model, or a `KVComposeError` naming the problem."""
    config = getattr(model, "config", None)
    if config is None:
        raise KVComposeError("model has no config: pass a Hugging Face PreTrainedModel")
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", None)
    if strict and model_type not in SUPPORTED_MODEL_TYPES:
        raise KVComposeError(
            f"unsupported model type {model_type!r}: kvcompose is tested on {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(pass strict=False to try anyway)"
        )
    layer_types = getattr(config, "layer_types", None) or []
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        raise KVComposeError(f"unsupported layer types {sorted(set(layer_types))}: only attention layers are supported")
    return config


def check_incoming(layer, key_states: Tensor, hint: str = "") -> None:
    """Refuse new keys whose device, dtype, batch or head count differ from what an initialised layer holds."""
    if key_states.device != layer.device or key_states.dtype != layer.dtype:
        raise KVComposeError(
            f"layer {layer.layer_idx}: got keys on {key_states.device}/{key_states.dtype}, "
            f"the cache holds {layer.device}/{layer.dtype}"
        )
    if key_states.shape[0] != layer.batch_size or key_states.shape[1] != layer.num_heads:
        raise KVComposeError(
            f"layer {layer.layer_idx}: got keys of shape {tuple(key_states.shape)}, the cache holds "
            f"batch {layer.batch_size} x {layer.num_heads} heads{hint}"
        )


class KVComposeLayer(CacheLayerMixin):
    """One decoder layer's compressed cache. Not built by users: `KVComposeCache` makes one per layer."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: "KVComposeCache", layer_idx: int):
        # CacheLayerMixin.__init__ would assign self.keys/self.values, which are properties here.
        self.cache = cache
        self.layer_idx = layer_idx
        self.is_initialized = False
        self.reset()

    # -- storage ----------------------------------------------------------------------------------
    def reset(self) -> None:
        self.seen = 0
        self.held = 0
        self.prompt_length = 0
        self.events = 0
        self._k = self._v = self._pos = self._valid = None
        self.token_state: dict[str, Tensor] = {}
        self.tier_state: dict[str, Any] = {}
        self._merged = None  # hot + tier tokens of the current step (kvcompose.prefetch.Merged)
        self.q_buf = self.q_pos = self.q_valid = None
        self.generator: torch.Generator | None = None
        self.peak_held_bytes = 0
        self.peak_alloc_bytes = 0
        self.is_initialized = False

    @property
    def keys(self) -> Tensor | None:
        return None if self._k is None else self._k[:, :, : self.held]

    @property
    def values(self) -> Tensor | None:
        return None if self._v is None else self._v[:, :, : self.held]

    @property
    def positions(self) -> Tensor | None:
        return None if self._pos is None else self._pos[:, :, : self.held]

    @property
    def valid(self) -> Tensor | None:
        return None if self._valid is None else self._valid[:, :, : self.held]

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, self.head_dim, self.value_dim = b, h, d, value_states.shape[-1]
        self._k = key_states.new_empty(b, h, 0, d)
        self._v = value_states.new_empty(b, h, 0, self.value_dim)
        self._pos = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
        self._valid = torch.empty(b, h, 0, dtype=torch.bool, device=self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.cache.seed * 1_000_003 + self.layer_idx)
        self.is_initialized = True

    def _resize(self, capacity: int) -> None:
        """Move the held tokens into fresh buffers of `capacity` slots (grow, or shrink to free memory)."""
        n = self.held

        def grow(t: Tensor) -> Tensor:
            new = t.new_empty((*t.shape[:2], capacity, *t.shape[3:]))
            new[:, :, :n] = t[:, :, :n]
            return new

        self._k, self._v = grow(self._k), grow(self._v)
        self._pos, self._valid = grow(self._pos), grow(self._valid)
        self.token_state = {k: grow(v) for k, v in self.token_state.items()}

    def _append(self, key_states: Tensor, value_states: Tensor) -> None:
        q = key_states.shape[2]
        need = self.held + q
        if need > self.capacity:
            target = self.cache.target_capacity(self.layer_idx)
            self._resize(target if target >= need else max(need, math.ceil(self.capacity * 1.5)))
        sl = slice(self.held, need)
        self._k[:, :, sl] = key_states
        self._v[:, :, sl] = value_states
        self._pos[:, :, sl] = torch.arange(self.seen, self.seen + q, device=self.device)
        self._valid[:, :, sl] = True
        for v in self.token_state.values():
            v[:, :, sl] = 0
        self.held = need
        self.seen += q

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append new tokens (keys after RoPE) and hand this layer to the attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            check_incoming(self, key_states)
        if self.seen == 0:
            self.prompt_length = key_states.shape[2]
        self._append(key_states, value_states)
        self._new = key_states.shape[2]
        _attn.handoff.layer = self
        self._track_peak()
        return self.keys, self.values

    # -- attention ----------------------------------------------------------------------------------
    def attend(self, query: Float[Tensor, "B Hq Q D"], mask2d: Tensor | None, scale: float,
               sliding_window: int | None = None) -> Float[Tensor, "B Q Hq D"]:
        """Attention of the new queries over held (+ prefetched) tokens; then the compression schedule."""
        q = query.shape[2]
        self.scale = scale
        if query.shape[1] % self.num_heads:
            raise KVComposeError(f"{query.shape[1]} query heads are not a multiple of {self.num_heads} KV heads")
        qpos = torch.arange(self.seen - q, self.seen, device=self.device)
        if mask2d is not None:
            new_valid = mask2d[:, -q:].to(device=self.device, dtype=torch.bool)
            self._valid[:, :, self.held - q : self.held] = new_valid[:, None, :]
        else:
            new_valid = torch.ones(query.shape[0], q, dtype=torch.bool, device=self.device)
        self._record_queries(query, qpos, new_valid)
        keys, values, pos, valid = self.attention_set()
        mask = _attn.build_mask(pos, valid, qpos, sliding_window)
        out = _attn.attend(query, keys, values, mask, scale)
        merged = self._merged
        for s in self.cache.pipeline.observers():
            st = self.token_state.get(s.state_key)
            cur = None if st is None else st[:, :, : self.held]
            if merged is not None:  # observers see every attended token, wherever it lives
                zeros = torch.zeros(self.positions.shape, dtype=torch.float32, device=self.device)
                cur = merged.merge_state(zeros if cur is None else cur, s.state_key)
            new = s.observe(cur, query, keys, mask, scale)
            if st is None:
                st = torch.zeros(self._pos.shape, dtype=torch.float32, device=self.device)
                self.token_state[s.state_key] = st
            if merged is not None:
                new = merged.write_back(self.cache.pipeline.tier, self.tier_state, s.state_key, new)
            st[:, :, : self.held] = new
        self._schedule(q)
        self._merged = None  # fetched copies are not kept between steps
        return out

    def attention_set(self):
        """Held tokens plus any tokens a tier brings back, in original order: (keys, values, positions, valid)."""
        self._merged = self.cache.prefetcher.gather(self)
        if self._merged is None:
            return self.keys, self.values, self.positions, self.valid
        m = self._merged
        return m.keys, m.values, m.positions, m.valid

    def _record_queries(self, query: Tensor, qpos: Tensor, qvalid: Tensor) -> None:
        w = self.cache.query_window
        if w <= 0:
            return
        if self.q_buf is None:
            self.q_buf, self.q_pos, self.q_valid = query[:, :, -w:], qpos[-w:], qvalid[:, -w:]
        else:
            self.q_buf = torch.cat([self.q_buf, query], dim=2)[:, :, -w:]
            self.q_pos = torch.cat([self.q_pos, qpos])[-w:]
            self.q_valid = torch.cat([self.q_valid, qvalid], dim=1)[:, -w:]

    # -- compression ------------------------------------------------------------------------------
    def view(self, merged=None) -> LayerView:
        """A snapshot of this layer for the pipeline's blocks: the HBM tokens, or with `merged` (a
        `kvcompose.prefetch.Merged`) every non-evicted token, HBM and tiers, in position order."""
        state = {k: v[:, :, : self.held] for k, v in self.token_state.items()}
        if merged is not None:
            state = {k: merged.merge_state(v, k) for k, v in state.items()}
        src = self if merged is None else merged
        return LayerView(
            layer_idx=self.layer_idx,
            num_layers=len(self.cache.layers),
            keys=src.keys,
            values=src.values,
            positions=src.positions,
            valid=src.valid,
            prompt_length=self.prompt_length,
            queries=self.q_buf,
            query_positions=self.q_pos,
            query_valid=self.q_valid,
            seen=self.seen,
            scale=getattr(self, "scale", self.head_dim**-0.5),
            state=state,
            generator=self.generator,
            event=self.events,
        )

    def _schedule(self, q: int) -> None:
        """Compress at every `interval`-th decoded token, if some row holds more real tokens than the budget.

        The schedule counts decoded tokens, not held slots, so every row of a left-padded batch compresses
        at the same steps as it would alone (padding slots never trigger or survive a compression).
        """
        cache = self.cache
        if not cache.pipeline.compresses:
            return
        budget = cache.layer_budget(self.layer_idx)
        decoded = self.seen - self.prompt_length
        if decoded == 0:  # the prefill call
            if cache.compress_prefill and self.held > budget:
                self.compress()
            return
        if decoded // cache.interval == (decoded - q) // cache.interval:
            return
        if int(self.valid.sum(-1).max()) > budget or self.held >= budget + cache.interval:
            self.compress()

    def candidates(self):
        """For a tier that holds tokens: every non-evicted token (HBM + tiers) merged by position, reusing
        this step's fetch when it is still current; None when only HBM holds tokens."""
        tier = self.cache.pipeline.tier
        if not tier.holds_tokens:
            return None
        m = self._merged
        if m is None or m.stamp != (self.seen, self.held, tier.version(self.tier_state)):
            m = self.cache.prefetcher.gather(self)
        return m

    @timed_compress
    def compress(self) -> Selection:
        """Run the pipeline once on this layer and keep only what it selects.

        The candidates are all non-evicted tokens (see `candidates`); the tier store receives every
        candidate not kept in HBM and replaces its content (promotion and demotion at every event)."""
        cache = self.cache
        tier = cache.pipeline.tier
        merged = self.candidates()
        view = self.view(merged)
        sel = cache.pipeline.select(view, cache.layer_budget(self.layer_idx))
        kept = sel.kept
        if (kept < 0).any():  # unequal per-head budgets: this layer moves onto ragged paged storage
            from .storage import RaggedLayer

            return RaggedLayer.adopt(self).apply_selection(sel)
        k = kept.shape[-1]
        if tier.holds_tokens:
            drop = torch.ones_like(view.valid)
            drop.scatter_(-1, kept, False)
            n_drop = view.valid.shape[-1] - k
            didx = torch.sort(drop.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :n_drop]
            didx = didx.sort(dim=-1).values
            tier.store(
                self.tier_state,
                TierTokens(_gather(view.keys, didx), _gather(view.values, didx), view.positions.gather(-1, didx),
                           view.valid.gather(-1, didx), {n: s.gather(-1, didx) for n, s in view.state.items()}),
                None if sel.scores is None else sel.scores.gather(-1, didx),
                self.seen,
                k,
            )
        if merged is not None:
            if k > self.capacity:
                self._resize(max(k, cache.target_capacity(self.layer_idx)))
            self._k[:, :, :k] = _gather(view.keys, kept)
            self._v[:, :, :k] = _gather(view.values, kept)
            self._pos[:, :, :k] = view.positions.gather(-1, kept)
            self._valid[:, :, :k] = view.valid.gather(-1, kept)
            for name, v in self.token_state.items():
                v[:, :, :k] = view.state[name].gather(-1, kept)
            self.held = k
            self._merged = None
            return self._after_compress(sel)
        from .kernels import compact

        compact(self._k[:, :, : self.held], self._v[:, :, : self.held], kept,
                out_keys=self._k[:, :, :k], out_values=self._v[:, :, :k])
        self._pos[:, :, :k] = self._pos[:, :, : self.held].gather(-1, kept)
        self._valid[:, :, :k] = self._valid[:, :, : self.held].gather(-1, kept)
        for v in self.token_state.values():
            v[:, :, :k] = v[:, :, : self.held].gather(-1, kept)
        self.held = k
        return self._after_compress(sel)

    def _after_compress(self, sel: Selection) -> Selection:
        self.events += 1
        target = self.cache.target_capacity(self.layer_idx)
        if self.capacity > target:
            self._resize(target)
        return sel

    # -- transformers Cache API -------------------------------------------------------------------
    def get_seq_length(self, *args, **kwargs) -> int:
        """Tokens seen (held + evicted): transformers derives positions from it."""
        return self.seen

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        """`(held + new, seen - held)`; accepts an int (transformers >= 5.3) or a cache_position tensor."""
        q = query_length.shape[0] if isinstance(query_length, Tensor) else int(query_length)
        return self.held + q, self.seen - self.held

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def _batch_apply(self, fn) -> None:
        if not self.is_initialized:
            return
        self._k, self._v, self._pos, self._valid = fn(self._k), fn(self._v), fn(self._pos), fn(self._valid)
        self.token_state = {k: fn(v) for k, v in self.token_state.items()}
        if self.q_buf is not None:
            self.q_buf, self.q_valid = fn(self.q_buf), fn(self.q_valid)
        if self.tier_state:
            self.cache.pipeline.tier.batch_apply(self.tier_state, fn)
        self.batch_size = self._k.shape[0]

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._batch_apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch_apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._batch_apply(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest `-tokens_to_remove` tokens; only possible while all of them are still held."""
        if tokens_to_remove > 0:
            raise KVComposeError("crop takes a negative count of newest tokens to remove")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.held:
            raise KVComposeError(f"cannot crop {n} tokens: layer {self.layer_idx} holds only {self.held}")
        tail = self._pos[:, :, self.held - n : self.held]
        want = torch.arange(self.seen - n, self.seen, device=self.device)
        if not bool((tail == want).all()):
            raise KVComposeError(f"cannot crop {n} tokens: some of the newest tokens were already evicted")
        self.held -= n
        self.seen -= n
        if self.q_pos is not None:
            keep = self.q_pos < self.seen
            self.q_buf, self.q_pos, self.q_valid = self.q_buf[:, :, keep], self.q_pos[keep], self.q_valid[:, keep]

    def offload(self):
        raise KVComposeError("KVComposeCache manages its own tiers; use a HostTier instead of offloading")

    def prefetch(self):
        return None

    # -- accounting -------------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        if not self.is_initialized:
            return 0
        item = self._k.element_size()
        return self.batch_size * self.num_heads * (self.head_dim + self.value_dim) * item

    def held_bytes(self) -> int:
        return self.held * self.bytes_per_token()

    def allocated_bytes(self) -> int:
        return self.capacity * self.bytes_per_token()

    def _track_peak(self) -> None:
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes())
        self.peak_alloc_bytes = max(self.peak_alloc_bytes, self.allocated_bytes())


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    return x.gather(2, idx[..., None].expand(*idx.shape, x.shape[-1]))


class KVComposeCache(Cache):
    """A compressing KV cache for `model.generate(past_key_values=cache)`.

    Example:
        >>> cache = KVComposeCache(model, Pipeline(ProtectPrompt(), ProtectValueNorm(), RandomDrop()), budget=1024)
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=8192)
        >>> print(cache.memory())

    Args:
        model: a Hugging Face decoder-only model (Llama, Qwen2, Qwen3, Mistral architectures are tested).
            Its attention implementation is set to kvcompose's registered function (this model only).
        pipeline: the compression method (a `Pipeline` or a preset from `kvcompose.methods`); None = full cache.
        budget: tokens kept per layer (per row and KV head) after each compression event.
        interval: decoded tokens between compression events (R-KV uses 128, VaSE 64).
        compress_prefill: also compress the prompt right after prefill (off by default).
        seed: seed of the per-layer random generators (random selectors are reproducible).
        strict: refuse model types that are not tested (set False to try others).
    """

    def __init__(
        self,
        model,
        pipeline: Pipeline | None = None,
        budget: int | None = None,
        *,
        interval: int = 64,
        compress_prefill: bool = False,
        seed: int = 0,
        strict: bool = True,
    ):
        pipeline = pipeline if pipeline is not None else Pipeline()
        if not isinstance(pipeline, Pipeline):
            raise KVComposeError(f"pipeline must be a kvcompose Pipeline, got {type(pipeline).__name__}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise KVComposeError(f"budget must be a positive int, got {budget!r}")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise KVComposeError(f"interval must be a positive int, got {interval!r}")
        if not isinstance(seed, int):
            raise KVComposeError(f"seed must be an int, got {seed!r}")
        pipeline.validate(budget)
        config = check_model(model, strict)
        model_type = getattr(config, "model_type", None)
        self.model_type = model_type
        self.pipeline = pipeline
        self.budget = budget
        self.interval = interval
        self.compress_prefill = compress_prefill
        self.seed = seed
        self.stats = CacheStats()
        self.query_window = pipeline.query_window
        self.num_layers = config.num_hidden_layers
        from .prefetch import Prefetcher

        self.prefetcher = Prefetcher()
        _attn.register()
        if getattr(model.config, "_attn_implementation", None) != _attn.ATTN_IMPLEMENTATION:
            model.set_attn_implementation(_attn.ATTN_IMPLEMENTATION)
        layer_cls = KVComposeLayer
        if not pipeline.allocator.uniform_per_layer:  # per-head / per-request budgets: ragged paged storage
            from .storage import RaggedLayer

            layer_cls = RaggedLayer.for_pipeline(pipeline)
        if pipeline.compresses:
            heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            pipeline.allocator.check(pipeline, budget, self.num_layers, heads)
        super().__init__(layers=[layer_cls(self, i) for i in range(self.num_layers)])

    # -- budgets ----------------------------------------------------------------------------------
    def layer_budget(self, layer_idx: int) -> int:
        """The token budget of one layer (the allocator may vary it by layer). A `budget_free` tier or
        allocator derives it from the tokens the layer has seen: `hbm_budget(seen, budget) -> int`."""
        budget = self.budget
        for part in (self.pipeline.tier, self.pipeline.allocator):
            if getattr(part, "budget_free", False) and hasattr(part, "hbm_budget"):
                budget = part.hbm_budget(self.layers[layer_idx].seen, budget)
        fn = getattr(self.pipeline.allocator, "layer_budget", None)
        return fn(layer_idx, self.num_layers, budget) if fn is not None else budget

    def target_capacity(self, layer_idx: int) -> int:
        """Buffer slots a layer keeps allocated: its budget plus one interval of growth."""
        budget_free = any(getattr(p, "budget_free", False) for p in (self.pipeline.tier, self.pipeline.allocator))
        if (self.budget is None and not budget_free) or not self.pipeline.compresses:
            return 0
        return self.layer_budget(layer_idx) + self.interval

    # -- public helpers ---------------------------------------------------------------------------
    def kept_positions(self, layer_idx: int) -> Int[Tensor, "B H K"]:
        """Original positions of the tokens a layer holds in HBM, `[batch, kv_heads, kept]`, ascending.

        On ragged storage (per-head budgets, `kvcompose.storage.RaggedLayer`) heads hold different counts:
        `kept` is the largest, and each shorter head's row ends with -1 padding."""
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            raise KVComposeError(f"layer {layer_idx} holds nothing yet")
        if hasattr(layer, "kept_positions"):  # ragged storage: [B, H, max length], -1 past a head's length
            return layer.kept_positions()
        return layer.positions.clone()

    def held_lengths(self) -> list[int]:
        """Tokens held in HBM per layer."""
        return [layer.held for layer in self.layers]

    def memory(self) -> MemoryReport:
        """Bytes held, allocated, per layer, per tier, and the full-cache equivalent."""
        by_layer = [layer.held_bytes() for layer in self.layers]
        full = sum(layer.seen * layer.bytes_per_token() for layer in self.layers)
        by_tier_layer: dict[str, list[int]] = {"hbm": by_layer}
        for i, layer in enumerate(self.layers):
            for tier, b in self.pipeline.tier.nbytes(layer.tier_state).items():
                by_tier_layer.setdefault(tier, [0] * len(self.layers))[i] = b
        by_tier = {k: sum(v) for k, v in by_tier_layer.items()}
        peak = {
            "hbm": sum(layer.peak_held_bytes for layer in self.layers),
            "allocated": sum(layer.peak_alloc_bytes for layer in self.layers),
        }
        for k, v in self.pipeline.tier.peak_bytes(self.layers).items() if hasattr(self.pipeline.tier, "peak_bytes") else []:
            peak[k] = v
        first = self.layers[0]
        return MemoryReport(
            total=sum(by_layer),
            allocated=sum(layer.allocated_bytes() for layer in self.layers),
            by_layer=by_layer,
            full_cache=full,
            by_tier=by_tier,
            by_tier_layer=by_tier_layer,
            peak=peak,
            seen=first.seen,
            held=max((layer.held for layer in self.layers), default=0),
        )

    def __repr__(self) -> str:
        return f"KVComposeCache({self.pipeline!r}, budget={self.budget}, interval={self.interval}, layers={len(self.layers)})"
