"""The layer core, written once: update, attend, observe, schedule, compress, tier and prefetch for one
decoder layer, over any `KVStore` layout. `KVComposeCache` holds one `ComposeLayer` per decoder layer; the
tree cache (`kvcompose.branch`) holds the same layers, whose path is the active branch's nodes.

```
ComposeLayer (one per decoder layer)
  path() -> [Segment, ...]      one for a plain cache; the active branch's nodes for a tree
  Segment: store (a KVStore), tier state, pipeline state, query ring, events, limits
update(k, v)   -> the write segment's store appends; the layer is handed to the attention function
attend(q, ...) -> record queries -> gather the path (tier tokens merged) -> attend -> observe -> schedule
compress(seg)  -> LayerView -> Pipeline.select -> TierStore.store(the rest, by priority) -> store.compact
```

`attend` is one sequence for every layout: the tokens it attends are the write segment's store itself
when the path is that one store with nothing in its tier and no observer needs the padded view (the
store then attends over its own layout: unmasked SDPA for a dense decode step, the paged kernel on CUDA),
else a `kvcompose.path.PathTokens` view of the whole path (tier tokens merged by position). Every size it
needs comes from host-side mirrors, so an ordinary decode step never waits for the device; host syncs
happen only at compression events (and at most once per forward to see whether the new tokens include
padding).

Shapes: B batch rows, H KV heads, Hq query heads, Q new tokens, T held tokens, D head dim, C state channels.
"""

from __future__ import annotations

import time
import warnings
import weakref
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from . import copying as _copying
from . import crop as _crop
from .allocators import layer_budget as _layer_budget
from .attention import no_trace
from .events import rows_due, rows_over, run_event
from .path import PathTokens, gather, has_tier_tokens, segment_part
from .pipeline import Pipeline, Selection
from .prefetch import Merged
from .seeding import derived_seed
from .segment import CacheStats, CoreConfig, QueryRing, Segment
from .stores import KVStore, StoreView, make_store
from .view import AttentionStep, KVComposeError, KVComposeWarning, LayerSpec, LayerView

__all__ = ["ComposeLayer", "Segment", "QueryRing", "CoreConfig", "CacheStats", "check_incoming"]

_no_trace = no_trace  # the cache's bookkeeping is never traced: under torch.compile it runs eagerly


def check_incoming(layer: "ComposeLayer", key_states: Tensor, hint: str = "") -> None:
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


def _cat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class ComposeLayer(CacheLayerMixin):
    """One decoder layer's compressed cache. Built by `KVComposeCache` (one per decoder layer) or by the
    tree cache; see the module docstring.

    Public attributes: `seen` (tokens seen), `prompt_length`, `held` / `lengths` (tokens held on the device),
    `events` (compression events of the write segment), `keys` / `values` / `positions` / `valid` (the held
    tokens of the path as a padded view), `generator`, `peers` (the cache's layers, held weakly).
    """

    is_compileable = False
    is_croppable = True
    attention_features = frozenset({"softcap", "sinks"})  # applied by kvcompose.attention_math.attend

    def __init__(self, config: CoreConfig, layer_idx: int, owner: Any = None, sliding_window: int | None = None):
        # CacheLayerMixin.__init__ would assign self.keys/self.values, which are properties here.
        self.config = config
        self.layer_idx = layer_idx
        self._owner = weakref.ref(owner) if owner is not None else (lambda: config)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None  # keeps its own window; never compressed beyond it
        self._compresses = config.pipeline.compresses  # read on every step: kept here, not asked of the pipeline
        self.reset()

    # -- copying (the cache re-links a copy's layers: kvcompose.copying.link_layers) ------------------------
    def __getstate__(self) -> dict:
        return _copying.layer_state(self)

    def __setstate__(self, state: dict) -> None:
        _copying.restore_layer(self, state)

    @property
    def peers(self) -> list["ComposeLayer"]:
        """Every layer of this layer's cache (through a weak reference to the cache: no reference cycle)."""
        owner = self._owner()
        layers = getattr(owner, "layers", None)
        return layers if isinstance(layers, list) else [self]

    # -- state ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.prompt_length = 0
        self.segment = Segment(0)
        self.generator: torch.Generator | None = None
        self.scale: float | None = None
        self._peak_held = 0
        self._peak_alloc = 0
        self.compacted_at = 0  # tokens seen when a compaction last removed tokens of this layer (crop's limit)
        self.padding: Tensor | None = None  # [B] padding tokens seen per row (None: none so far)
        self.is_initialized = False

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, self.head_dim, self.value_dim = b, h, d, value_states.shape[-1]
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(derived_seed(self.config.seed, self.layer_idx))
        self.spec = LayerSpec(self.layer_idx, self.config.num_layers, b, h, d, self.value_dim, self.device, self.dtype)
        pipe = self.config.pipeline
        self._window = pipe.query_window if self.sliding_window is None else 0
        self._observes = bool(pipe.observers) and self.config.observe and self.sliding_window is None
        self._tiered = pipe.tier.holds_tokens
        self.is_initialized = True

    @property
    def seen(self) -> int:
        """Tokens seen on the path (held, in a tier, or evicted): the write segment's end."""
        seg = self.write_segment()
        return seg.start + seg.n

    def path(self) -> list[Segment]:
        """The segments attention runs over, oldest first; the last one is written."""
        return [self.segment]

    def write_segment(self) -> Segment:
        return self.segment

    def scheduled(self) -> bool:
        """Whether the write segment follows the compression schedule (sliding-window layers only keep
        their window)."""
        return self._compresses and self.sliding_window is None

    def layer_budget(self, seen: int | None = None) -> int | None:
        """The token budget of this layer (the allocator may vary it by layer and by tokens seen)."""
        return _layer_budget(self.config.pipeline.allocator, self.layer_idx, self.config.num_layers,
                             self.config.budget, self.seen if seen is None else seen)

    def target_capacity(self) -> int:
        """Slots a store keeps room for between events: the budget plus one interval (0: no cap)."""
        if not self.config.pipeline.compresses:
            return 0
        budget = self.layer_budget()
        return 0 if budget is None else budget + self.config.interval

    def room(self) -> int:
        """Tokens a (row, head) gains until its next compression event, the room a store keeps after one: the
        interval, or for an allocator that triggers events itself the room it leaves (GrowPage: one page)."""
        if self.config.trigger:
            return int(getattr(self.config.pipeline.allocator, "room", self.config.interval))
        return self.config.interval

    def open(self, seg: Segment) -> None:
        """Give a segment its store, tier state and pipeline state."""
        cfg, s = self.config, self.spec
        pipe = cfg.pipeline
        seg.store = make_store(cfg.paged, s.batch, s.heads, s.head_dim, s.value_dim, s.dtype, s.device,
                               channels=pipe.channels, page_size=pipe.allocator.page_size,
                               target=self.target_capacity(), reserve=cfg.reserve)
        budget = self.layer_budget()
        if cfg.paged and budget is not None and pipe.compresses:
            # made on the host, copied to the device without waiting (no blocking copy at prefill)
            host = pipe.allocator.initial_limits(budget, s.batch, s.heads, torch.device("cpu"))
            seg.set_limits(host.to(s.device, non_blocking=True), host.numpy())
        seg.tier = pipe.tier.init(s)
        seg.blocks = pipe.init(s)

    # -- views ----------------------------------------------------------------------------------------
    def _hot(self) -> StoreView | None:
        views = [seg.store.view() for seg in self.path() if seg.store is not None and seg.store.held]
        if not views:
            return None
        return StoreView(*(_cat([getattr(v, f) for v in views]) for f in StoreView._fields))

    @property
    def keys(self) -> Tensor | None:
        v = self._hot()
        return None if v is None else v.keys

    @property
    def values(self) -> Tensor | None:
        v = self._hot()
        return None if v is None else v.values

    @property
    def positions(self) -> Tensor | None:
        v = self._hot()
        return None if v is None else v.positions

    @property
    def valid(self) -> Tensor | None:
        v = self._hot()
        return None if v is None else v.valid

    @property
    def held(self) -> int:
        """Slots held on the device along the path (the longest (row, head))."""
        return sum(seg.store.held for seg in self.path() if seg.store is not None)

    @property
    def lengths(self) -> Int[Tensor, "B H"] | None:
        """Tokens held on the device per (row, KV head), along the path."""
        ls = [seg.store.lengths for seg in self.path() if seg.store is not None]
        return None if not ls else sum(ls[1:], ls[0])

    @property
    def events(self) -> int:
        return self.write_segment().events

    @property
    def capacity(self) -> int:
        """Token slots of the write segment's device buffers (pages x page size for paged storage)."""
        store = self.write_segment().store
        return 0 if store is None else store.capacity

    # -- writing --------------------------------------------------------------------------------------
    @_no_trace
    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append new tokens (keys after RoPE) to the write segment. Returns the new keys and values, which
        the cache's `update` hands to the attention function with this layer (`kvcompose.attention.hand_off`:
        kvcompose's attention recognises them and reads the layer)."""
        if self.is_initialized:
            check_incoming(self, key_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        if self.seen == 0:
            self.prompt_length = q
        seg = self.write_segment()
        if seg.store is None:
            self.open(seg)
        seg.store.append(key_states, value_states, seg.start + seg.n)
        seg.n += q
        return key_states, value_states

    # -- attention ------------------------------------------------------------------------------------
    def attend(self, query: Float[Tensor, "B Hq Q D"], mask2d: Tensor | None, scale: float,
               sliding_window: int | None = None, **features: Any) -> Float[Tensor, "B Q Hq D"]:
        """Attention of the new queries over the path's held tokens (and tier tokens), then the schedule:
        record queries -> gather the path -> attend -> observe -> schedule."""
        q = query.shape[2]
        self.scale = scale
        if query.shape[1] % self.num_heads:
            raise KVComposeError(f"{query.shape[1]} query heads are not a multiple of {self.num_heads} KV heads")
        seg = self.write_segment()
        seen = seg.start + seg.n
        qvalid = self._new_valid(mask2d, q)  # None: the new tokens are all real (one host sync per forward)
        if qvalid is not None:
            seg.store.set_tail_valid(qvalid)
            pad = (~qvalid).sum(-1)
            self.padding = pad if self.padding is None else self.padding + pad
            if not self.config.padding_warned:
                self._warn_padded()
        if self._window:
            self._record(seg, query, seen, qvalid)
        tokens = self._gather()
        out = tokens.attend(query, seen, scale, sliding_window, **features)
        if self._observes:
            self._observe(seg, tokens, AttentionStep(query, tokens.keys, tokens.positions, tokens.valid, tokens.mask,
                                                     scale, features.get("softcap"), features.get("sinks")))
        if self.scheduled():
            self._schedule(q, tokens)
        elif self.sliding_window is not None:
            self._keep_window(seg)
        return out

    def _gather(self) -> KVStore | PathTokens:
        """What this call attends: the write segment's store itself when it is the whole path, its tier
        holds nothing and no observer needs the padded view; else a `PathTokens` view of the path."""
        path = self.path()
        tier = self.config.pipeline.tier
        ahead = self._ahead() if self._tiered else ()
        if len(path) == 1 and not self._observes and not (self._tiered and has_tier_tokens(tier, path[0].tier)):
            if ahead:  # nothing to fetch here, but the next layers' copies start now
                for key, state in ahead[: self.config.prefetcher.lookahead]:
                    self.config.prefetcher.start(tier, state, key)
            return path[0].store
        segs = [s for s in path if s.store is not None and s.store.held]
        return gather(segs, tier, self.config.prefetcher, self._observes, ahead)

    def _ahead(self) -> list[tuple[Segment, Any]]:
        """The write segments (and tier states) of the next layers, in the order they attend: after the last
        layer, the next step's first ones (the prefetch wraps around)."""
        peers = self.peers
        n = len(peers)
        out = []
        for k in range(1, min(self.config.prefetcher.lookahead, n - 1) + 1):
            p = peers[(self.layer_idx + k) % n]
            if p.is_initialized:
                s = p.write_segment()
                if s.tier:
                    out.append((s, s.tier))
        return out

    def _new_valid(self, mask2d: Tensor | None, q: int) -> Bool[Tensor, "B Q"] | None:
        """The padding flags of the q new tokens if some are padding, else None. Checked once per forward
        (one host sync per step, not one per layer): every layer of a forward receives the same 2-D mask."""
        if mask2d is None:
            return None
        key = (mask2d.data_ptr(), mask2d.shape, self.seen)
        cached = self.config.step_padding
        if self.layer_idx > 0 and cached is not None and cached[0] == key:  # layer 0 starts every forward
            pad = cached[1]
        else:
            pad = not bool(mask2d[:, -q:].all())
            self.config.step_padding = (key, pad)
        return mask2d[:, -q:].to(device=self.device, dtype=torch.bool) if pad else None

    def _warn_padded(self) -> None:
        """Once per cache, at the first forward with padding: say why a padded row may keep other tokens than the
        row alone with this pipeline (`Pipeline.padded_rows_note`), if it may."""
        self.config.padding_warned = True
        note = self.config.pipeline.padded_rows_note()
        if note and self.config.pipeline.compresses:
            warnings.warn(f"{self.config.pipeline!r} on a batch with left padding: a padded row may keep other tokens "
                          f"than the same row alone: {note} (docs/methods.md, 'Batches with left padding')",
                          KVComposeWarning, stacklevel=6)

    def _record(self, seg: Segment, query: Tensor, seen: int, qvalid: Tensor | None) -> None:
        """Keep the newest `query_window` queries (a decoded query is one in-place write of the ring)."""
        q, w = query.shape[2], self._window
        if q == 1 and seg.ring.ready(query, w):
            seg.ring.record_one(query, seen - 1, qvalid)
            return
        if qvalid is None:
            qvalid = torch.ones(query.shape[0], q, dtype=torch.bool, device=self.device)
        seg.ring.record(query, torch.arange(seen - q, seen, device=self.device), qvalid, w)

    def _observe(self, seg: Segment, tokens: PathTokens, step: AttentionStep) -> None:
        pipe = self.config.pipeline
        seg.blocks, channels = pipe.observe(seg.blocks, tokens.channels, step)
        if pipe.channels:
            tokens.write_channels(channels, pipe.tier)

    def _keep_window(self, seg: Segment) -> None:
        """A sliding-window layer keeps the tokens the next queries can see (the newest `window - 1`), cut back
        once it holds an interval more (exact: the mask hides every older token). Its held tokens are
        contiguous up to the newest, so the cut is known on the host."""
        w = self.sliding_window
        store = seg.store
        t = store.held
        if t < w - 1 + self.config.interval:
            return
        self._track_peak()
        k = w - 1
        kept = torch.arange(t - k, t, device=self.device).expand(self.batch_size, self.num_heads, k).contiguous()
        store.compact(kept)
        store.fit(self.config.interval)
        self.compacted_at = max(self.compacted_at, self.seen)
        self._track_peak()

    # -- compression ----------------------------------------------------------------------------------
    def _schedule(self, q: int, tokens: KVStore | PathTokens | None = None) -> None:
        """Compress at every `interval`-th decoded token the rows that hold more real tokens than the budget.

        The schedule counts decoded tokens, not held slots, so every row of a left-padded batch compresses at
        the same steps as it would alone (padding slots never trigger or survive a compression). `tokens`
        (what this step attended) hands its tier merge to the event, so the tier is not fetched twice."""
        cfg = self.config
        seg = self.write_segment()
        decoded = self.seen - self.prompt_length
        if decoded == 0 and not cfg.compress_prefill:
            return
        if cfg.trigger:  # the allocator decides which rows are due (GrowPage: a request's pages are full)
            rows = cut = rows_due(self, seg, decoded)
        elif decoded and decoded // cfg.interval == (decoded - q) // cfg.interval:
            return
        else:
            rows = rows_over(self, seg)
            cut = rows if cfg.paged else None  # a dense layer cuts every row
        if rows is not None:
            merged = tokens.merged_of(seg) if isinstance(tokens, PathTokens) else None
            self.compress(seg, cut, merged=merged)

    def view(self, seg: Segment | None = None, rows: Tensor | None = None, merged: Merged | None = None
             ) -> tuple[LayerView, Tensor, Merged | None]:
        """A snapshot of a segment for the pipeline: its held tokens and, with a tier that holds tokens, every
        non-evicted token of it (HBM and tier, in position order); plus their channels and the merge
        (`merged`: one this step already built for the segment)."""
        seg = self.write_segment() if seg is None else seg
        if merged is not None:
            v, channels = StoreView(merged.keys, merged.values, merged.positions, merged.valid), merged.channels
        else:
            v, channels, part = segment_part(seg, self.config.pipeline.tier, self.config.prefetcher, True)
            merged = part.merged
        ring = seg.ring
        view = LayerView(
            layer_idx=self.layer_idx, num_layers=self.config.num_layers,
            keys=v.keys, values=v.values, positions=v.positions, valid=v.valid,
            prompt_length=self.prompt_length, queries=ring.queries, query_positions=ring.positions,
            query_valid=ring.valid, seen=seg.start + seg.n,
            scale=self.scale if self.scale is not None else self.head_dim**-0.5,
            generator=self.generator, event=seg.events, rows=rows, cache_budget=self.config.budget,
            host_real=self._host_real(seg), padding=self.row_padding(seg),
        )
        return view, channels, merged

    def _host_real(self, seg: Segment) -> np.ndarray | None:
        """Real slots per (row, head) of the segment's event view, from the host mirrors: the store's lengths
        plus the tier's counts (None when the tier's counts are not mirrored)."""
        if seg.store is None:
            return None
        tier = self.config.pipeline.tier
        extra = tier.counts(seg.tier) if tier.holds_tokens else None
        if tier.holds_tokens and seg.tier and extra is None and tier.version(seg.tier):
            return None
        return seg.store.host_lengths + (0 if extra is None else extra)

    def row_padding(self, seg: Segment) -> Int[Tensor, " B"] | None:
        """`[B]` padding tokens of each row among the tokens up to the end of `seg` (None: none)."""
        return self.padding

    def compress(self, seg: Segment | None = None, rows: Tensor | None = None, budget: int | None = None,
                 pipeline: Pipeline | None = None, merged: Merged | None = None) -> Selection:
        """Run the pipeline once on a segment (default: the write segment) and keep only what it selects.

        The candidates are all non-evicted tokens; the tier store receives every candidate not kept in HBM,
        in the pipeline's priority order, and replaces its content (promotion and demotion at every event).
        With `rows`, only those rows are cut (paged layouts); the others keep every token. `budget` and
        `pipeline` override the layer's (a pipeline with the same blocks and another tier, e.g. `Evict()`);
        `merged` is the segment's merge with its tier tokens when the caller already has it."""
        stats = self.config.stats
        if stats.sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            return self._compress(self.write_segment() if seg is None else seg, rows, budget,
                                  self.config.pipeline if pipeline is None else pipeline, merged)
        finally:
            if stats.sync and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            stats.compress_seconds += time.perf_counter() - t0
            stats.compress_calls += 1

    def _compress(self, seg: Segment, rows: Tensor | None, budget: int | None, pipe: Pipeline,
                  merged: Merged | None) -> Selection:
        sel = run_event(self, seg, rows, budget, pipe, merged)
        self.compacted_at = max(self.compacted_at, seg.start + seg.n)  # crop's limit
        return sel

    # -- transformers Cache API -------------------------------------------------------------------------
    @_no_trace
    def get_seq_length(self, *args, **kwargs) -> int:
        """Tokens seen (held + evicted): transformers derives positions from it."""
        return self.seen

    @_no_trace
    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        """`(held + new, seen - held)`; accepts an int (transformers >= 5.3) or a cache_position tensor."""
        q = query_length.shape[0] if isinstance(query_length, Tensor) else int(query_length)
        held = self.held
        return held + q, self.seen - held

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def map_rows(self, fn) -> None:
        """Apply a batch-row operation to every segment: store, tier, block states, queries, limits."""
        if not self.is_initialized:
            return
        pipe = self.config.pipeline
        b = self.batch_size
        for seg in self.path():
            if seg.store is None:
                continue
            seg.store.map_rows(fn)
            seg.tier = pipe.tier.map_rows(seg.tier, fn, b)
            seg.blocks = pipe.map_rows(seg.blocks, fn, b)
            seg.ring.map_rows(fn)
            if seg.limits is not None:
                seg.limits = fn(seg.limits)
            self.batch_size = seg.store.batch
        if self.padding is not None:
            self.padding = fn(self.padding)
        self.spec = LayerSpec(self.layer_idx, self.config.num_layers, self.batch_size, self.num_heads, self.head_dim,
                              self.value_dim, self.device, self.dtype)
        self.config.prefetcher.clear()

    @_no_trace
    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    @_no_trace
    def batch_repeat_interleave(self, repeats: int) -> None:
        self.map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    @_no_trace
    def batch_select_indices(self, indices: Tensor) -> None:
        self.map_rows(lambda t: t[indices.to(t.device)])

    # -- rolling back (crop) ----------------------------------------------------------------------------
    def crop_count(self, tokens_to_remove: int) -> int:
        """How many of the newest tokens `crop(tokens_to_remove)` removes (`kvcompose.crop.crop_count`)."""
        return _crop.crop_count(self, tokens_to_remove)

    def crop_refusal(self, n: int) -> str | None:
        """Why removing the newest `n` tokens would not be exact, or None (`kvcompose.crop.crop_refusal`)."""
        return _crop.crop_refusal(self, n)

    @_no_trace
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest `-tokens_to_remove` tokens (a positive value is the legacy form: keep that many
        tokens seen), exactly: afterwards the layer is what a fresh cache fed only the tokens before them holds,
        so decoding on gives the same tokens. Raises `KVComposeError` (and changes nothing) when that is not
        possible (see `crop_refusal`)."""
        n = self.crop_count(tokens_to_remove)
        reason = self.crop_refusal(n)
        if reason is not None:
            raise KVComposeError(f"cannot crop {n} tokens: {reason}")
        self.apply_crop(n)

    def apply_crop(self, n: int) -> None:
        """Remove the newest `n` tokens of the write segment (`crop_refusal(n)` must be None)."""
        _crop.apply_crop(self, n)

    def offload(self):
        raise KVComposeError("KVComposeCache manages its own tiers; use a HostTier instead of offloading")

    def prefetch(self):
        return None

    # -- accounting -----------------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Bytes of one token position over all rows and heads (the full-cache unit)."""
        if not self.is_initialized:
            return 0
        item = self.dtype.itemsize
        return self.batch_size * self.num_heads * (self.head_dim + self.value_dim) * item

    def held_bytes(self) -> int:
        """Bytes of the K/V held on the device along the path."""
        return sum(seg.store.nbytes() for seg in self.path() if seg.store is not None)

    def allocated_bytes(self) -> int:
        """Bytes of the device K/V buffers along the path."""
        return sum(seg.store.allocated_bytes() for seg in self.path() if seg.store is not None)

    def tier_bytes(self) -> dict[str, int]:
        """Bytes the tier holds for this layer's path, per tier name."""
        out = {"host": 0, "compressed": 0}
        for seg in self.path():
            if seg.tier:
                for k, v in self.config.pipeline.tier.nbytes(seg.tier).items():
                    out[k] = out.get(k, 0) + v
        return out

    def tier_peak(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for seg in self.path():
            for k, v in (seg.tier or {}).get("peak", {}).items():
                out[k] = out.get(k, 0) + v
        return out

    def _track_peak(self) -> None:
        """Note the bytes held and allocated now. Both only grow between compaction events, so noting them
        before every compaction (and reading the current ones) gives the exact peaks without a per-step cost."""
        self._peak_held = max(self._peak_held, self.held_bytes())
        self._peak_alloc = max(self._peak_alloc, self.allocated_bytes())

    @property
    def peak_held_bytes(self) -> int:
        """The most K/V bytes this layer held on the device at any time."""
        return max(self._peak_held, self.held_bytes())

    @property
    def peak_alloc_bytes(self) -> int:
        """The most bytes of device buffers this layer had at any time."""
        return max(self._peak_alloc, self.allocated_bytes())

