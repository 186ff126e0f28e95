"""The layer core, written once: update, attend, observe, schedule, compress, tier and prefetch for one
decoder layer, over any `KVStore` layout. `KVComposeCache` holds one `ComposeLayer` per decoder layer; the
tree cache (`kvcompose.branch`) holds the same layers, whose path is the active branch's nodes.

```
ComposeLayer (one per decoder layer)
  path() -> [Segment, ...]      one for a plain cache; the active branch's nodes for a tree
  Segment: store (DenseStore | PagedStore), tier state, pipeline state, query ring, events, limits
update(k, v)   -> the write segment's store appends; the layer is handed to the attention function
attend(q, ...) -> held tokens of every segment (+ tier tokens, merged by position) -> masked SDPA
               -> observers (token state follows its tokens) -> schedule -> compress(segment)
compress(seg)  -> LayerView -> Pipeline.select -> TierStore.store(the rest, by priority) -> store.compact
```

Shapes: B batch rows, H KV heads, Hq query heads, Q new tokens, T held tokens, D head dim, C state channels.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from . import attention as _attn
from .compat import no_trace
from .allocators import layer_budget as _layer_budget
from .kernels import paged_decode_attention, select_backend
from .pipeline import Pipeline, Selection
from .prefetch import Merged, Prefetcher
from .segment import CacheStats, CoreConfig, QueryRing, Segment
from .stores import DenseStore, PagedStore, StoreView
from .tiers import TierTokens, take_tokens
from .view import FAR_POSITION, AttentionStep, KVComposeError, LayerSpec, LayerView

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
    tokens of the path as a padded view), `generator`.
    """

    is_compileable = False
    is_croppable = True
    attention_features = frozenset({"softcap", "sinks"})  # applied by kvcompose.attention.attend

    def __init__(self, config: CoreConfig, layer_idx: int, owner: Any = None, sliding_window: int | None = None):
        # CacheLayerMixin.__init__ would assign self.keys/self.values, which are properties here.
        self.config = config
        self.layer_idx = layer_idx
        self.peers: list[ComposeLayer] = []
        self._owner = weakref.ref(owner) if owner is not None else (lambda: config)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None  # keeps its own window; never compressed beyond it
        self.reset()

    # -- state ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.prompt_length = 0
        self.segment = Segment(0)
        self.generator: torch.Generator | None = None
        self.scale: float | None = None
        self._peak_held = 0
        self._peak_alloc = 0
        self._merged: Merged | None = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, self.head_dim, self.value_dim = b, h, d, value_states.shape[-1]
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.config.seed * 1_000_003 + self.layer_idx)
        self.spec = LayerSpec(self.layer_idx, self.config.num_layers, b, h, d, self.value_dim, self.device, self.dtype)
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
        return self.config.pipeline.compresses and self.sliding_window is None

    def layer_budget(self, seen: int | None = None) -> int | None:
        """The token budget of this layer (the allocator may vary it by layer and by tokens seen)."""
        return _layer_budget(self.config.pipeline.allocator, self.layer_idx, self.config.num_layers,
                             self.config.budget, self.seen if seen is None else seen)

    def target_capacity(self) -> int:
        """Slots a dense store grows up to and shrinks back to: the budget plus one interval (0: no cap)."""
        if not self.config.pipeline.compresses:
            return 0
        budget = self.layer_budget()
        return 0 if budget is None else budget + self.config.interval

    def open(self, seg: Segment) -> None:
        """Give a segment its store, tier state and pipeline state."""
        cfg, s = self.config, self.spec
        pipe = cfg.pipeline
        if cfg.paged:
            seg.store = PagedStore(s.batch, s.heads, s.head_dim, s.value_dim, s.dtype, s.device,
                                   page_size=pipe.allocator.page_size, channels=pipe.channels)
            budget = self.layer_budget()
            if budget is not None and pipe.compresses:
                seg.limits = pipe.allocator.initial_limits(budget, s.batch, s.heads, s.device)
        else:
            seg.store = DenseStore(s.batch, s.heads, s.head_dim, s.value_dim, s.dtype, s.device,
                                   channels=pipe.channels, target=self.target_capacity(), reserve=cfg.reserve)
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
        return sum(seg.held() for seg in self.path())

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
        if store is None:
            return 0
        return store.capacity if isinstance(store, DenseStore) else store.pool.capacity * store.page_size

    # -- writing --------------------------------------------------------------------------------------
    @_no_trace
    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append new tokens (keys after RoPE) to the write segment and hand this layer to the attention
        function. Returns the new keys and values (kvcompose's attention recognises them and reads the layer).
        Raises `KVComposeError` when the previous update of this cache was never seen by kvcompose's
        attention (the model's attention implementation was changed, or the cache went to another model)."""
        if self.is_initialized:
            check_incoming(self, key_states)
        _attn.hand_off(self, key_states, value_states, owner=self._owner())
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        if self.seen == 0:
            self.prompt_length = q
        seg = self.write_segment()
        if seg.store is None:
            self.open(seg)
        start = seg.start + seg.n
        if isinstance(seg.store, DenseStore):  # positions written only when a view needs them
            seg.store.append(key_states, value_states, None, start=start)
        else:
            seg.store.append(key_states, value_states, torch.arange(start, start + q, device=self.device))
        seg.n += q
        return key_states, value_states

    # -- attention ------------------------------------------------------------------------------------
    def _segment_set(self, seg: Segment, need_channels: bool) -> tuple[StoreView, Tensor | None, Merged | None]:
        """A segment's held tokens plus what its tier holds, merged by position."""
        pipe = self.config.pipeline
        view = seg.store.view()
        if pipe.tier.holds_tokens and seg.tier:
            stamp = (id(seg), self.seen, seg.store.held, pipe.tier.version(seg.tier))
            m = self._merged
            if m is not None and m.stamp == stamp:
                return StoreView(m.keys, m.values, m.positions, m.valid), m.channels, m
            ahead = [(p.write_segment(), p.write_segment().tier) for p in self.peers[self.layer_idx + 1:]]
            fetched = self.config.prefetcher.fetch(pipe.tier, seg.tier, seg, self.device, ahead)
            if fetched is not None and fetched.n:
                m = Prefetcher.merge(view.keys, view.values, view.positions, view.valid, seg.store.read_channels(),
                                     fetched, stamp)
                return StoreView(m.keys, m.values, m.positions, m.valid), m.channels, m
        return view, (seg.store.read_channels() if need_channels else None), None

    def attend(self, query: Float[Tensor, "B Hq Q D"], mask2d: Tensor | None, scale: float,
               sliding_window: int | None = None, **features: Any) -> Float[Tensor, "B Q Hq D"]:
        """Attention of the new queries over the path's held tokens (and tier tokens), then the schedule."""
        q = query.shape[2]
        self.scale = scale
        if query.shape[1] % self.num_heads:
            raise KVComposeError(f"{query.shape[1]} query heads are not a multiple of {self.num_heads} KV heads")
        cfg = self.config
        pipe = cfg.pipeline
        seg = self.write_segment()
        seen = seg.start + seg.n
        pad = mask2d is not None and self._has_padding(mask2d, q)
        if pad:
            seg.store.set_tail_valid(mask2d[:, -q:].to(device=self.device, dtype=torch.bool))
        w = pipe.query_window if self.sliding_window is None else 0
        observers = bool(pipe.observers) and cfg.observe and self.sliding_window is None
        path = self.path()
        if (q == 1 and len(path) == 1 and not observers and not seg.store.ragged and not features
                and type(seg.store) is DenseStore and not (pipe.tier.holds_tokens and seg.tier)
                and (sliding_window is None or seen <= sliding_window)):
            # the common decode step: one new token that sees every held key; scorers that read queries at
            # the next event (a query window) only get this query recorded
            if w > 0:
                qvalid = mask2d[:, -1:].to(device=self.device, dtype=torch.bool) if pad else None
                if seg.ring.ready(query, w):
                    seg.ring.record_one(query, seen - 1, qvalid)
                else:
                    if qvalid is None:
                        qvalid = torch.ones(query.shape[0], 1, dtype=torch.bool, device=self.device)
                    seg.ring.record(query, torch.arange(seen - 1, seen, device=self.device), qvalid, w)
            keys, values = seg.store.kv()
            out = _attn.attend(query, keys, values, None, scale)
            if self.scheduled():
                self._schedule(q)
            elif self.sliding_window is not None:
                self._keep_window(seg)
            return out
        qpos = torch.arange(seen - q, seen, device=self.device)
        if w > 0:
            qvalid = (mask2d[:, -q:].to(device=self.device, dtype=torch.bool) if pad
                      else torch.ones(query.shape[0], q, dtype=torch.bool, device=self.device))
            seg.ring.record(query, qpos, qvalid, w)
        segs = [s for s in path if s.store is not None and s.store.held]
        parts = [self._segment_set(s, observers) for s in segs]
        keys, values = _cat([p[0].keys for p in parts]), _cat([p[0].values for p in parts])
        pos, valid = _cat([p[0].positions for p in parts]), _cat([p[0].valid for p in parts])
        ragged = any(p[2] is not None or s.store.ragged for p, s in zip(parts, segs))
        if q == 1 and not ragged and (sliding_window is None or self.seen <= sliding_window):
            mask = None  # one new token that sees every held key
        else:
            mask = _attn.build_mask(pos, valid, qpos, sliding_window)
        if (len(segs) == 1 and parts[0][2] is None and isinstance(segs[0].store, PagedStore) and not observers
                and not features and select_backend(query, segs[0].store.pool.keys) == "triton"):
            st = segs[0].store  # the paged decode kernel reads the pages directly: no padded copy
            out = paged_decode_attention(query, st.pool.keys, st.pool.values, st.pool.positions, st.pool.valid,
                                         st.page_table, st.lengths, qpos, float(scale), sliding_window,
                                         check_indices=False)
        else:
            out = _attn.attend(query, keys, values, mask, scale, **features)
        if observers:
            self._observe(seg, segs, parts, AttentionStep(query, keys, pos, valid, mask, scale,
                                                          features.get("softcap"), features.get("sinks")))
        self._merged = next((p[2] for p, s in zip(parts, segs) if s is seg), None)
        if self.scheduled():
            self._schedule(q)
        elif self.sliding_window is not None:
            self._keep_window(seg)
        self._merged = None  # fetched copies are not kept between steps
        return out

    def _has_padding(self, mask2d: Tensor, q: int) -> bool:
        """Whether the q new tokens include padding; checked once per forward (one host sync per step, not
        one per layer): every layer of a forward receives the same 2-D mask."""
        key = (mask2d.data_ptr(), mask2d.shape, self.seen)
        cached = self.config.step_padding
        if self.layer_idx > 0 and cached is not None and cached[0] == key:  # layer 0 starts every forward
            return cached[1]
        out = not bool(mask2d[:, -q:].all())
        self.config.step_padding = (key, out)
        return out

    def _observe(self, seg: Segment, segs: list[Segment], parts: list, step: AttentionStep) -> None:
        pipe = self.config.pipeline
        channels = _cat([p[1] for p in parts])
        seg.blocks, channels = pipe.observe(seg.blocks, channels, step)
        if not pipe.channels:
            return
        off = 0
        for s, (v, _, merged) in zip(segs, parts):
            n = v.keys.shape[2]
            ch = channels[:, :, off : off + n]
            off += n
            if merged is None:
                s.store.write_channels(ch)
            else:
                hot, tier_part = merged.split(ch)
                s.store.write_channels(hot)
                s.tier = pipe.tier.write_channels(s.tier, tier_part)
                merged.channels = ch

    def _keep_window(self, seg: Segment) -> None:
        """A sliding-window layer keeps the tokens the next queries can see (the newest `window - 1`), cut back
        once it holds an interval more (exact: the mask hides every older token)."""
        w = self.sliding_window
        store = seg.store
        if store.held < w - 1 + self.config.interval:
            return
        self._track_peak()
        pos = store.view().positions
        keep = pos >= self.seen - (w - 1)
        t = keep.shape[-1]
        k = int(keep[0, 0].sum())
        kept = torch.arange(t - k, t, device=self.device).expand(*keep.shape[:2], k).contiguous()
        store.compact(kept)
        if isinstance(store, DenseStore):
            store.fit()
        self._track_peak()

    # -- compression ----------------------------------------------------------------------------------
    def _over(self, seg: Segment) -> Bool[Tensor, " B"] | None:
        """Rows in which some head holds more real tokens than its limit (or too many slots); None: no row."""
        budget = self.layer_budget()
        if budget is None:
            return None
        store = seg.store
        real = store.view().valid.sum(-1)
        limits = seg.limits if seg.limits is not None else torch.full_like(real, budget)
        over = ((real > limits) | (store.lengths >= limits + self.config.interval)).any(-1)
        return over if bool(over.any()) else None

    def _due(self, seg: Segment, decoded: int) -> Bool[Tensor, " B"] | None:
        """Rows the allocator's `EventTrigger.due` says need an event now (None: no row)."""
        if self.layer_budget() is None or seg.store is None:
            return None
        pipe = self.config.pipeline
        state = seg.blocks[pipe.leaves.index(pipe.allocator)]
        rows = pipe.allocator.due(state, seg.store.lengths, seg.limits, decoded, self.config.interval)
        return rows if bool(rows.any()) else None

    def _schedule(self, q: int) -> None:
        """Compress at every `interval`-th decoded token the rows that hold more real tokens than the budget.

        The schedule counts decoded tokens, not held slots, so every row of a left-padded batch compresses at
        the same steps as it would alone (padding slots never trigger or survive a compression)."""
        cfg = self.config
        seg = self.write_segment()
        decoded = self.seen - self.prompt_length
        if decoded == 0 and not cfg.compress_prefill:
            return
        if cfg.trigger:  # the allocator decides which rows are due (GrowPage: a request's pages are full)
            rows = self._due(seg, decoded)
            if rows is not None:
                self.compress(seg, rows)
            return
        if decoded and decoded // cfg.interval == (decoded - q) // cfg.interval:
            return
        rows = self._over(seg)
        if rows is not None:
            self.compress(seg, rows if cfg.paged else None)

    def view(self, seg: Segment | None = None, rows: Tensor | None = None) -> tuple[LayerView, Tensor, Merged | None]:
        """A snapshot of a segment for the pipeline: its held tokens and, with a tier that holds tokens, every
        non-evicted token of it (HBM and tier, in position order); plus their channels and the merge."""
        seg = self.write_segment() if seg is None else seg
        v, channels, merged = self._segment_set(seg, True)
        ring = seg.ring
        view = LayerView(
            layer_idx=self.layer_idx, num_layers=self.config.num_layers,
            keys=v.keys, values=v.values, positions=v.positions, valid=v.valid,
            prompt_length=self.prompt_length, queries=ring.queries, query_positions=ring.positions,
            query_valid=ring.valid, seen=seg.start + seg.n,
            scale=self.scale if self.scale is not None else self.head_dim**-0.5,
            generator=self.generator, event=seg.events, rows=rows, cache_budget=self.config.budget,
        )
        return view, channels, merged

    def compress(self, seg: Segment | None = None, rows: Tensor | None = None, budget: int | None = None,
                 pipeline: Pipeline | None = None) -> Selection:
        """Run the pipeline once on a segment (default: the write segment) and keep only what it selects.

        The candidates are all non-evicted tokens; the tier store receives every candidate not kept in HBM,
        in the pipeline's priority order, and replaces its content (promotion and demotion at every event).
        With `rows`, only those rows are cut (paged layouts); the others keep every token. `budget` and
        `pipeline` override the layer's (a pipeline with the same blocks and another tier, e.g. `Evict()`)."""
        stats = self.config.stats
        if stats.sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            return self._compress(self.write_segment() if seg is None else seg, rows, budget,
                                  self.config.pipeline if pipeline is None else pipeline)
        finally:
            if stats.sync and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            stats.compress_seconds += time.perf_counter() - t0
            stats.compress_calls += 1

    def _compress(self, seg: Segment, rows: Tensor | None, budget: int | None, pipe: Pipeline) -> Selection:
        if budget is None:
            budget = self.layer_budget(seg.start + seg.n)
        if budget is None:
            raise KVComposeError(f"layer {self.layer_idx}: compressing needs a budget")
        self._track_peak()  # the peak is reached just before a compaction
        view, channels, merged = self.view(seg, rows)
        sel, seg.blocks = pipe.select(view, budget, seg.blocks, channels)
        kept = sel.kept
        b, h, t = view.shape
        if rows is not None and not bool(rows.all()):
            width = max(kept.shape[-1], t)
            every = torch.arange(width, device=self.device).expand(b, h, width)
            every = torch.where(every < (view.positions < FAR_POSITION).sum(-1, keepdim=True), every,
                                torch.full_like(every, -1))
            pad = torch.full((b, h, width - kept.shape[-1]), -1, dtype=kept.dtype, device=self.device)
            kept = torch.where(rows[:, None, None], torch.cat([kept, pad], dim=-1), every)
        n_kept = (kept >= 0).sum(-1)
        if pipe.tier.holds_tokens:
            seg.tier = pipe.tier.store(seg.tier, self._leaving(view, channels, sel.order, n_kept, rows),
                                       seg.start + seg.n, n_kept, sel.protected)
        if merged is not None or sel.values is not None:  # tier tokens merged in, or a Merger gave new values
            safe = kept.clamp(min=0)
            g = lambda x: take_tokens(x, safe)  # noqa: E731
            values = view.values if sel.values is None else sel.values
            seg.store.assign(StoreView(g(view.keys), g(values), g(view.positions), g(view.valid) & (kept >= 0)),
                             g(channels), n_kept)
            self._merged = None
        else:
            seg.store.compact(kept)
        if seg.limits is not None:
            seg.limits = sel.budget if rows is None else torch.where(rows[:, None], sel.budget, seg.limits)
        if isinstance(seg.store, DenseStore):
            seg.store.target = self.target_capacity()
            seg.store.fit()
        seg.events += 1
        self._track_peak()
        return sel

    def _leaving(self, view: LayerView, channels: Tensor, order: Int[Tensor, "B H T"], n_kept: Int[Tensor, "B H"],
                 rows: Tensor | None) -> TierTokens:
        """The candidates not kept, in priority order: `order[b, h, n_kept[b, h]:]`, padded per head (rows
        outside `rows` keep every token: nothing of theirs leaves)."""
        b, h, t = view.shape
        rest = t - n_kept
        m = int(rest.max()) if rest.numel() else 0
        j = torch.arange(m, device=self.device)
        idx = (n_kept[..., None] + j).clamp(max=max(t - 1, 0))
        slots = order.gather(-1, idx)
        inside = j < rest[..., None]
        if rows is not None:
            inside = inside & rows[:, None, None]
        g = lambda x: take_tokens(x, slots)  # noqa: E731
        pos = torch.where(inside, g(view.positions), torch.full_like(slots, FAR_POSITION) + j)
        return TierTokens(g(view.keys), g(view.values), pos, g(view.valid) & inside, g(channels))

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

    @_no_trace
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest `-tokens_to_remove` tokens (a positive value is the legacy form: keep that many
        tokens seen); only possible while every one of them is still held in the write segment."""
        if not self.is_initialized:
            return
        n = -tokens_to_remove if tokens_to_remove <= 0 else self.seen - tokens_to_remove
        if n <= 0:
            return
        seg = self.write_segment()
        lengths = seg.store.lengths
        if n > int(lengths.min()) or n > seg.n:
            raise KVComposeError(f"cannot crop {n} tokens: layer {self.layer_idx} holds only {int(lengths.min())} "
                                 "of its newest tokens")
        idx = lengths[..., None] - n + torch.arange(n, device=self.device)
        tail = seg.store.view().positions.gather(-1, idx)
        want = torch.arange(self.seen - n, self.seen, device=self.device)
        if not bool((tail == want).all()):
            raise KVComposeError(f"cannot crop {n} tokens: some of the newest tokens were already evicted")
        seg.store.crop(n)
        seg.n -= n
        seg.ring.crop(self.seen)

    def offload(self):
        raise KVComposeError("KVComposeCache manages its own tiers; use a HostTier instead of offloading")

    def prefetch(self):
        return None

    # -- accounting -----------------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Bytes of one token position over all rows and heads (the full-cache unit)."""
        if not self.is_initialized:
            return 0
        item = torch.empty((), dtype=self.dtype).element_size()
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

