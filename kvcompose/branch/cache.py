"""`BranchCache`: a branch-aware KV cache for tree search (ArborKV-style), usable with `model.generate`.

Paper: ArborKV (abstract only, no public code). What the abstract says: in tree-structured reasoning the
next tokens depend only on the active branch and its ancestors; inactive subtrees are rarely reused soon
but must stay recoverable for backtracking. A value estimator scores tokens, the active path gets budget
priority, inactive subtrees keep a subset of their real tokens, revisits rehydrate lazily; about 4x lower
peak KV memory at near-full accuracy.

Our design (everything below is ours, the abstract gives no mechanism), on kvcompose's one layer core:

- **A tree of segments.** The cache is a tree of nodes; a node holds, per layer, a `kvcompose.layer.Segment`
  (a store of a contiguous run of tokens, its tier state and its pipeline state). A *branch* is a handle
  that points at a node; its tokens are the node's path from the root. `fork(b)` makes a new handle on the
  same node and seals the node (no copy). The first write through a handle on a sealed node opens a fresh
  child node (copy-on-write at node granularity), so a write never changes what another branch sees.
- **Attention over the active path.** Each decoder layer is a `ComposeLayer` whose path is the active
  branch's nodes: the same update / attend / observe code as `KVComposeCache`, over the path's stores
  (and whatever their tiers hold, merged by position).
- **Tree-aware allocation.** `budget` caps the tokens held on the device per layer for the whole tree. When
  it is exceeded, nodes off the active path are compressed, lowest search value first (`set_value(branch,
  v)`: a node is worth the best value of the live branches that pass through it; least recently used breaks
  ties and is the whole order with `priority="lru"` or when no values are given): each keeps
  `ceil(keep * n)` of its tokens (per layer, row and KV head), chosen by any kvcompose `Pipeline` (default
  H2O-style `AccumulatedAttention` + `TopK`: attention each token received from every query of any branch
  that passed through it); per-head budgets and tiers work as in `KVComposeCache`. The rest goes to the
  tier (`HostTier`: host memory, pinned buffers and a side stream on CUDA; `CompressedTier`; or `Evict()`).
  With `active_budget`, the node being written is compressed on the pipeline's schedule too.
- **Rehydration.** `switch(b)` only marks the new path. With `rehydrate="exact"` (default), before the next
  forward on it (a forward pre-hook on the model, or at the first layer's `update`), tier-held tokens are
  copied back and merged by position (bit-exact), then each node that lost tokens is recomputed from its
  recorded token ids, position ids and padding over its restored ancestors (one prefill of the node's
  tail). With `rehydrate="resume"`, the branch resumes from what its nodes still hold (approximate, no
  recomputation: tier tokens are still attended where the tier holds them).

Shapes: B batch rows (all rows share one tree), H KV heads, Hq query heads, n tokens of a node, D head dim.
"""

from __future__ import annotations

import inspect
import math
import weakref
from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor
from transformers.cache_utils import Cache

from .. import attention as _attn
from .. import compat
from .. import copying as _copying
from ..block import Block, require_role, role_of
from ..cache import check_budget, check_interval, check_model
from ..layer import CacheStats, CoreConfig
from ..pipeline import Pipeline
from ..prefetch import Prefetcher
from ..scorers import AccumulatedAttention, Scorer
from ..selectors import TopK
from ..stores import StoreView
from ..tiers import Evict, HostTier, TierStore
from ..view import FAR_POSITION, KVComposeError, warn_unused
from .tree import BranchLayer, BranchMemory, _Node

__all__ = ["BranchCache"]

_UNCOPIED = ("model", "_hooks", "_finalizer")  # shared (the model) or registered again for a copy (its hooks)


def _remove_handles(handles: list) -> None:
    for h in handles:
        h.remove()


def _check_unused(pipeline: Pipeline, attention, interval, active_budget, host_limit, tier, seed) -> None:
    """Warn (`KVComposeWarning`) about arguments that cannot change what the tree cache does."""
    if interval is not None and active_budget is None and not attention.sliding_layers:
        warn_unused(f"BranchCache(interval={interval})", "without active_budget the active path is never compressed "
                    "on a schedule (inactive nodes are compressed when the tree exceeds budget)", stacklevel=4)
    if host_limit is not None and not tier.holds_tokens:
        warn_unused(f"BranchCache(host_limit={host_limit})", f"the tier {tier!r} holds no tokens", stacklevel=4)
    if seed and not pipeline.draws_random:
        warn_unused(f"BranchCache(seed={seed})", f"no block of {pipeline!r} draws random numbers", stacklevel=4)


def _install_hooks(cache: "BranchCache", model) -> None:
    """Forward hooks on the model: capture token ids / position ids, rehydrate lazily, enforce the budget after
    each forward. Removed when the cache goes (or `close()`); a copy of the cache installs its own."""
    ref = weakref.ref(cache)

    # A dead cache's finalizer may remove these hooks while torch is already iterating over them (garbage
    # collection inside a forward); torch then calls them without kwargs, so both accept that and do nothing.
    def pre(module, args, kwargs=None):
        c = ref()
        if c is not None and kwargs is not None and compat.forward_cache(kwargs) is c:
            c._before_forward(kwargs)

    def post(module, args, *rest):
        c = ref()
        kwargs = rest[0] if len(rest) == 2 else None
        if c is not None and kwargs is not None and compat.forward_cache(kwargs) is c:
            c._after_forward()

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(post, with_kwargs=True)]
    cache._hooks = handles
    cache._finalizer = weakref.finalize(cache, _remove_handles, handles)


class BranchCache(Cache):
    """A branch-aware KV cache for tree search: shared prefixes stored once, inactive branches compressed.

    Example:
        >>> cache = BranchCache(model, budget=512, keep=0.25)          # tokens per layer on the device
        >>> model(input_ids=prompt[:, :-1], past_key_values=cache)    # the root branch (id 0)
        >>> a, b = cache.fork(0), cache.fork(0)                       # two children, no copy
        >>> cache.switch(a)
        >>> out_a = model.generate(input_ids=prompt, past_key_values=cache, max_new_tokens=64)
        >>> cache.switch(b)                                           # a may now be compressed
        >>> out_b = model.generate(input_ids=prompt, past_key_values=cache, max_new_tokens=64)
        >>> cache.switch(a)                                           # lazily rehydrated before decoding
        >>> cache.drop(b)                                             # frees what only b held

    `model.generate(past_key_values=cache)` decodes the active branch; `get_seq_length()` is the active
    path's length, so pass the whole path's token ids as `input_ids` (generate feeds the unseen tail).
    See the module docstring for the design (ArborKV, abstract only; the mechanism is ours).

    Args:
        model: a Hugging Face decoder-only model (Llama, Qwen2, Qwen3, Mistral). Its attention implementation
            is set to kvcompose's registered function; forward hooks on it capture token ids (for
            recomputation) and rehydrate lazily. Hooks go away with the cache (or `close()`).
        budget: tokens held on the device per layer (per row and KV head) for the whole tree; when exceeded,
            inactive nodes are compressed in `priority` order. None: never compress (exact sharing).
        keep: fraction of an inactive node's tokens it keeps on the device when compressed.
        min_keep: a compressed node keeps at least this many tokens (nodes this short are left whole).
        scorer: the value estimator: a kvcompose `Scorer` (used with `TopK`) or any `Pipeline` that
            `KVComposeCache` takes (per-head allocators and tiers included; default `AccumulatedAttention()`
            with `TopK()`, observed only when `budget`, `active_budget` or `scorer` is given).
        tier: where the non-kept tokens of a compressed node go (default: the pipeline's tier if it holds
            tokens, else `HostTier()`; `CompressedTier()` stores them quantized, so its rehydration is
            approximate; `Evict()` frees them, and they are recomputed on return).
        active_budget: tokens the node being written keeps per layer on the pipeline's schedule (None: the
            active path is never compressed). interval: its compression interval.
        rehydrate: "exact" (restore and recompute before decoding a compressed branch) or "resume" (decode
            from what the branch still holds: the kept tokens, plus the tier's tokens, attended in place, if
            the tier holds them; nothing is restored or recomputed; with `Evict()` this is approximate).
        priority: which inactive nodes are compressed first: "value" (the lowest search value, from
            `set_value`; a node is worth the best value of the live branches through it, branches without a
            value inherit the value of the branch they were forked from, or count as the most valuable;
            ties: least recently used) or "lru" (least recently used only). The active path (the active
            branch's node and all its ancestors) is never compressed.
        host_limit: bytes the tier may hold; a node whose tokens would exceed it is evicted instead.
        seed: seed of the per-layer random generators handed to the pipeline.
        strict: also refuse model types that are not among the tested ones.
    """

    def __init__(
        self,
        model,
        *,
        budget: int | None = None,
        keep: float = 0.25,
        min_keep: int = 4,
        scorer: Scorer | Pipeline | None = None,
        tier: TierStore | None = None,
        active_budget: int | None = None,
        interval: int | None = None,
        rehydrate: Literal["exact", "resume"] = "exact",
        priority: Literal["value", "lru"] = "value",
        host_limit: int | None = None,
        seed: int = 0,
        strict: bool = False,
    ):
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise KVComposeError(f"budget must be a non-negative int or None, got {budget!r}")
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 <= keep < 1.0:
            raise KVComposeError(f"keep must be a fraction in [0, 1), got {keep!r}")
        if isinstance(min_keep, bool) or not isinstance(min_keep, int) or min_keep < 1:
            raise KVComposeError(f"min_keep must be a positive int, got {min_keep!r}")
        if host_limit is not None and (not isinstance(host_limit, int) or host_limit < 0):
            raise KVComposeError(f"host_limit must be a non-negative int (bytes) or None, got {host_limit!r}")
        if rehydrate not in ("exact", "resume"):
            raise KVComposeError(f"rehydrate must be 'exact' or 'resume', got {rehydrate!r}")
        if priority not in ("value", "lru"):
            raise KVComposeError(f"priority must be 'value' or 'lru', got {priority!r}")
        if active_budget is not None and (isinstance(active_budget, bool) or not isinstance(active_budget, int)
                                          or active_budget <= 0):
            raise KVComposeError(f"active_budget must be a positive int or None, got {active_budget!r}")
        if scorer is None:
            pipeline = Pipeline(AccumulatedAttention(), TopK())
        elif isinstance(scorer, Pipeline):
            if not scorer.compresses:
                raise KVComposeError("the value pipeline needs a selector (e.g. Pipeline(KeyNorm(), TopK()))")
            pipeline = scorer
        elif isinstance(scorer, Scorer):
            pipeline = Pipeline(scorer, TopK())
        else:
            what = f"{scorer!r}, {role_of(scorer)}" if isinstance(scorer, Block) else type(scorer).__name__
            raise KVComposeError(f"scorer must be a kvcompose Scorer or Pipeline, got {what}"
                                 + (": give a selector inside a Pipeline, e.g. Pipeline(KeyNorm(), TopK())"
                                    if isinstance(scorer, Block) else ""))
        if tier is None:
            tier = pipeline.tier if pipeline.tier.holds_tokens else HostTier()
        require_role(tier, TierStore, "BranchCache(tier=...)", " (HostTier(), CompressedTier(), Evict(), ...)")
        if tier is not pipeline.tier:
            pipeline = pipeline.replace(tier, name=pipeline.name)
        if active_budget is not None:
            pipeline.validate(active_budget)
        config, self.attention = check_model(model, strict)
        check_budget(active_budget, "active_budget")
        _check_unused(pipeline, self.attention, interval, active_budget, host_limit, tier, seed)
        self.model = model
        self.budget = budget
        self.keep = float(keep)
        self.min_keep = min_keep
        self.pipeline = pipeline
        self.tier = tier
        self.host_limit = host_limit
        self.seed = seed
        self.rehydrate_mode = rehydrate
        self.priority = priority
        self._values: dict[int, float] = {}
        self.num_layers = config.num_hidden_layers
        self._kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self._fit_cache: dict[int, bool] = {}
        self.stats = CacheStats()
        observe = budget is not None or scorer is not None or active_budget is not None
        self.core = CoreConfig(pipeline=pipeline, budget=active_budget,
                               interval=check_interval(interval if interval is not None
                                                       else (pipeline.interval or 64)),
                               num_layers=self.num_layers, seed=seed, prefetcher=Prefetcher(), stats=self.stats,
                               observe=observe)
        _attn.install(model, owner=self)
        windows = {a.index: a.sliding_window for a in self.attention.layers if a.kind == "sliding"}
        layers = [BranchLayer(self.core, i, self, sliding_window=windows.get(i)) for i in range(self.num_layers)]
        _copying.link_layers(self, layers, tree=True)
        super().__init__(layers=layers)
        # the tree
        self._next_node = 0
        self._next_branch = 1
        self._tick = 0
        self._root = self._new_node(None)
        self._branches: dict[int, _Node] = {0: self._root}
        self._lineage: dict[int, int | None] = {0: None}
        self._root.branches.add(0)
        self._active = 0
        self._path_cache: list[_Node] | None = None
        self._pending = False
        self._recompute_path: list[_Node] | None = None
        self._incoming: dict[str, Tensor | None] = {}
        self.rehydrations = {"host": 0, "recomputed": 0, "recomputed_tokens": 0, "resumed": 0}
        self._resuming = False
        self.compressions = 0
        self._peak = {"device": 0, "held": 0, "host": 0, "total": 0}
        _install_hooks(self, model)

    # -- public API ---------------------------------------------------------------------------------
    @property
    def active(self) -> int:
        """Id of the active branch (the one `generate` decodes)."""
        return self._active

    @property
    def branches(self) -> list[int]:
        """Ids of the live branches."""
        return sorted(self._branches)

    def fork(self, branch: int | None = None) -> int:
        """A new branch sharing all tokens of `branch` (default: the active one); nothing is copied.

        Returns the new branch's id. The first write through either branch opens a fresh node.
        """
        b = self._active if branch is None else branch
        node = self._node_of(b, "fork")
        node.sealed = True
        self._trim(node)
        new = self._next_branch
        self._next_branch += 1
        self._branches[new] = node
        self._lineage[new] = b
        if b in self._values:
            self._values[new] = self._values[b]
        node.branches.add(new)
        return new

    def switch(self, branch: int) -> None:
        """Make `branch` active. Its compressed nodes are rehydrated lazily, before the next forward."""
        node = self._node_of(branch, "switch to")
        if self._recompute_path is not None:
            raise KVComposeError("cannot switch branches during a recomputation")
        if branch == self._active:
            return
        self._tick += 1
        old = self._path()
        for n in old:
            n.last_used = self._tick
        self._trim(old[-1])
        self._active = branch
        self._path_cache = None
        self.core.prefetcher.clear()
        compressed = any(n.compressed for n in node.path())
        self._pending = self.rehydrate_mode == "exact" and compressed
        self._resuming = self.rehydrate_mode == "resume" and compressed
        self._enforce_budget()

    def drop(self, branch: int) -> None:
        """Drop a branch handle and free what only it held (nodes no other live branch passes through).

        Dropping a branch whose tokens other branches share (e.g. the parent of live children, even of the
        active branch) frees only its private tail; shared nodes stay. Use `prune` to drop a whole subtree.
        """
        node = self._node_of(branch, "drop")
        if branch == self._active:
            raise KVComposeError(f"cannot drop branch {branch}: it is the active branch; switch to another one first")
        del self._branches[branch]
        node.branches.discard(branch)
        for child, parent in list(self._lineage.items()):
            if parent == branch:
                self._lineage[child] = self._lineage[branch]
        del self._lineage[branch]
        self._values.pop(branch, None)
        self._free_up(node)

    def prune(self, branch: int) -> list[int]:
        """Drop `branch` and every branch forked from it (transitively); returns the dropped ids.

        Raises `KVComposeError` when the active branch is among them (the active branch's ancestor is in use).
        """
        self._node_of(branch, "prune")
        subtree, frontier = [branch], [branch]
        while frontier:
            p = frontier.pop()
            kids = [c for c, par in self._lineage.items() if par == p]
            subtree += kids
            frontier += kids
        if self._active in subtree:
            raise KVComposeError(
                f"cannot prune branch {branch}: the active branch {self._active} descends from it and is in use; "
                "switch to a branch outside that subtree first"
            )
        for b in reversed(subtree):
            self.drop(b)
        return subtree

    def path_length(self, branch: int | None = None) -> int:
        """Tokens on a branch's path (default: the active branch)."""
        return self._node_of(self._active if branch is None else branch, "measure").end

    def tokens(self, branch: int | None = None) -> Int[Tensor, "B L"]:
        """The token ids recorded on a branch's path `[B, L]` (raises when some were fed as embeddings)."""
        node = self._node_of(self._active if branch is None else branch, "read")
        path = [n for n in node.path() if n.n]
        if any(not n.ids_known for n in path):
            raise KVComposeError("some tokens of this branch were fed without input_ids; their ids are unknown")
        if not path:
            return torch.empty(1, 0, dtype=torch.long)
        return torch.cat([torch.cat(n.ids, dim=1) for n in path], dim=1)

    def is_compressed(self, branch: int) -> bool:
        """True when some node on the branch's path holds only part of its tokens on the device."""
        return any(n.compressed for n in self._node_of(branch, "inspect").path())

    def set_value(self, branch: int, value: int | float) -> None:
        """Give a branch the search's value estimate (higher = more likely to be decoded again).

        With `priority="value"`, inactive nodes are compressed lowest value first: a node is worth the best
        value of the live branches that pass through it (its own handles and its descendants'), so a prefix
        shared by a good branch is kept. A fork inherits its parent's value until it gets its own. Checked
        against the budget at the next switch or forward.
        """
        self._node_of(branch, "set the value of")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise KVComposeError(f"a branch value must be a number (not NaN), got {value!r}")
        self._values[branch] = float(value)

    def value(self, branch: int) -> float:
        """The value estimate of a branch (`math.inf` when neither it nor its fork ancestors got one)."""
        self._node_of(branch, "read the value of")
        return self._values.get(branch, math.inf)

    def node_values(self) -> dict[int, float]:
        """Value of every live node (node id -> the best value of the live branches through it)."""
        return {n.id: v for n, v in self._node_values().items()}

    def compress(self, branch: int) -> int:
        """Compress now every node of `branch` that is off the active path; returns the tokens freed (layer 0).

        With `budget=None` and the default scorer, attention is not observed (nothing would be compressed
        automatically), so the default estimator has no data: pass `scorer=` to use this then.
        """
        active = set(self._path())
        freed = 0
        for n in self._node_of(branch, "compress").path():
            if n not in active and n.segs[0].held() > self._keep_target(n):
                freed += self._compress_node(n)
        return freed

    def rehydrate(self) -> None:
        """Restore the active path now (otherwise done lazily before the next forward on it)."""
        if not self._pending:
            return
        self._pending = False
        path = self._path()
        missing = sum(n.n - n.segs[0].held() for n in path if n.compressed)
        self._enforce_budget(extra=missing)
        for i, node in enumerate(path):
            if node.compressed:
                self._restore_node(node, path[: i + 1])
        self._track()

    def memory(self) -> BranchMemory:
        """Bytes on the device and on the host now, their peaks, and what per-branch copies would hold."""
        layer0 = self.layers[0]
        bpt = self.num_layers * layer0.bytes_per_token() if layer0.is_initialized else 0
        device, held, host = self._totals()
        return BranchMemory(
            device=device, held=held, host=host,
            peak_device=self._peak["device"], peak_held=self._peak["held"], peak_host=self._peak["host"],
            peak_total=self._peak["total"],
            nodes=len(self._all_nodes()), branches=len(self._branches),
            unique_tokens=sum(n.n for n in self._all_nodes()), held_tokens=self._held_tokens(0),
            copy_tokens=sum(n.end for n in self._branches.values()), bytes_per_token=bpt,
        )

    def close(self) -> None:
        """Remove the forward hooks from the model and give it its previous attention implementation back
        (both also done when the cache is garbage-collected)."""
        if self._finalizer is not None:  # None: a loaded cache that was never bound
            self._finalizer()
        _attn.release(self)

    kvcompose_attention = True  # kvcompose.attention routes calls that carry this cache to its layers
    is_croppable = False  # crop is refused (branch with fork()); transformers' deferred stop check must not use it

    def activate_past_recording(self, *args, **kwargs):
        """Called by transformers (5.23+) before assisted / prompt-lookup decoding: refused."""
        raise KVComposeError(compat.ASSISTED_MESSAGE)

    def __repr__(self) -> str:
        return (f"BranchCache(budget={self.budget}, keep={self.keep}, scorer={self.pipeline!r}, tier={self.tier!r}, "
                f"branches={len(self._branches)}, active={self._active})")

    # -- copying: copy.deepcopy, pickle, torch.save (kvcompose.copying) ----------------------------------
    def __copy__(self):
        raise KVComposeError("copy.copy(cache) would share the tree with the original; use copy.deepcopy(cache) "
                             "for an independent copy that shares the model (or fork() a branch: no copy at all)")

    def __deepcopy__(self, memo: dict) -> "BranchCache":
        """An independent tree (every branch, node, tier and value) that shares the model and decodes exactly as
        this one would from here."""
        return _copying.deepcopy_cache(self, memo, drop=_UNCOPIED)

    def __getstate__(self) -> dict:
        """Pickle / torch.save: the tree without the model and its hooks; the loaded cache needs `bind(model)`."""
        _copying.check_picklable(self)
        state = _copying.cache_state(self, drop=_UNCOPIED)
        state["_incoming"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._hooks, self._finalizer = [], None
        _copying.link_layers(self, self.layers, tree=True)

    def bound_model(self):
        """The model this cache decodes with (None for a cache loaded from a pickle before `bind`)."""
        return self.model

    def bind(self, model) -> "BranchCache":
        """Attach a cache loaded with pickle / `torch.load` to its model (the one it was built for, or one of the
        same architecture and weights): kvcompose's attention and the cache's forward hooks. Returns the cache."""
        if self.model is model and self._finalizer is not None:
            return self
        if self.model is not None and self._finalizer is not None:
            raise KVComposeError("this cache is bound to another model; copy.deepcopy(cache) shares its model")
        config, attention = check_model(model)
        _copying.check_same_model(self, model, config)
        _attn.install(model, owner=self)
        _install_hooks(self, model)
        self.model, self.attention = model, attention
        return self

    def update(self, *args, **kwargs):
        if self._finalizer is None:
            raise KVComposeError(_copying.UNBOUND.format(cls=type(self).__name__))
        return super().update(*args, **kwargs)

    # -- transformers Cache API -----------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._finalizer is None:
            raise KVComposeError(_copying.UNBOUND.format(cls=type(self).__name__))
        return self._seq_length()

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def reset(self) -> None:
        raise KVComposeError("a BranchCache cannot be reset; create a new one")

    # -- internals: tree ----------------------------------------------------------------------------
    def _new_node(self, parent: _Node | None) -> _Node:
        node = _Node(self._next_node, parent, self.num_layers)
        self._next_node += 1
        node.last_used = self._tick
        return node

    def _all_nodes(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children)
        return out

    def _node_of(self, branch: int, verb: str) -> _Node:
        if isinstance(branch, bool) or not isinstance(branch, int):
            raise KVComposeError(f"cannot {verb} branch {branch!r}: branch ids are ints")
        node = self._branches.get(branch)
        if node is None:
            state = "was dropped" if 0 <= branch < self._next_branch else "does not exist"
            raise KVComposeError(f"cannot {verb} branch {branch}: it {state} (live branches: {self.branches})")
        return node

    def _path(self) -> list[_Node]:
        if self._recompute_path is not None:
            return self._recompute_path
        if self._path_cache is None:
            self._path_cache = self._branches[self._active].path()
        return self._path_cache

    def _seq_length(self) -> int:
        return self._path()[-1].end

    def _trim(self, node: _Node) -> None:
        for seg in node.segs:
            if seg.store is not None:
                seg.store.trim()

    def _free_up(self, node: _Node) -> None:
        while node is not None and node is not self._root and not node.children and not node.branches:
            for seg in node.segs:
                seg.store, seg.tier, seg.blocks, seg.n = None, None, None, 0
            parent = node.parent
            parent.children.discard(node)
            node.parent = None
            node = parent

    # -- internals: forward -------------------------------------------------------------------------
    def _before_forward(self, kwargs: dict) -> None:
        if self._recompute_path is not None:
            return
        self._incoming = {"input_ids": kwargs.get("input_ids"), "position_ids": kwargs.get("position_ids")}
        if self._pending:
            self.rehydrate()

    def _after_forward(self) -> None:
        _attn.check_consumed(self)  # a layer whose attention never ran (implementation switched) raises now
        if self._recompute_path is not None:
            return
        self._incoming = {}
        self._track()
        self._enforce_budget()

    def _begin_write(self, q: int) -> None:
        """Layer 0 of a forward: restore the path if needed, open a node (copy-on-write), record ids."""
        if self._recompute_path is not None:
            self._recompute_path[-1].n += q
            return
        if self._pending:  # a forward that bypassed the model's hooks (e.g. called on model.model)
            self.rehydrate()
        if self._resuming:  # the first forward on a compressed branch in "resume" mode: decoded as it is
            self._resuming = False
            self.rehydrations["resumed"] += 1
        node = self._branches[self._active]
        if node.sealed:
            child = self._new_node(node)
            self._branches[self._active] = child
            node.branches.discard(self._active)
            child.branches.add(self._active)
            self._path_cache = None
            node = child
        ids = self._incoming.get("input_ids")
        pos_ids = self._incoming.get("position_ids")
        b = self.layers[0].batch_size if self.layers[0].is_initialized else 1
        if isinstance(ids, Tensor) and ids.dim() == 2 and ids.shape[1] == q and node.ids_known:
            node.ids.append(ids.detach().to("cpu", torch.long).expand(max(b, ids.shape[0]), q))
        else:
            node.ids_known = False
        if isinstance(pos_ids, Tensor) and pos_ids.dim() == 2 and pos_ids.shape[-1] == q:
            node.pos_ids.append(pos_ids.detach().to("cpu", torch.long).expand(max(b, pos_ids.shape[0]), q))
        else:
            node.pos_ids.append(torch.arange(node.end, node.end + q).expand(max(b, 1), q))
        node.n += q
        self._incoming = {}

    # -- internals: accounting ----------------------------------------------------------------------
    def _totals(self) -> tuple[int, int, int]:
        device = held = host = 0
        for node in self._all_nodes():
            for seg in node.segs:
                if seg.store is not None:
                    device += seg.store.allocated_bytes()
                    held += seg.store.nbytes()
                if seg.tier:
                    host += sum(self.tier.nbytes(seg.tier).values())
        return device, held, host

    def _held_tokens(self, layer_idx: int) -> int:
        return sum(n.segs[layer_idx].held() for n in self._all_nodes())

    def _track(self) -> None:
        device, held, host = self._totals()
        self._peak["device"] = max(self._peak["device"], device)
        self._peak["held"] = max(self._peak["held"], held)
        self._peak["host"] = max(self._peak["host"], host)
        self._peak["total"] = max(self._peak["total"], device + host)

    # -- internals: compression and rehydration -----------------------------------------------------
    def _node_values(self) -> dict[_Node, float]:
        """Per live node, the best value of the live branches whose path passes through it."""
        out: dict[_Node, float] = {}
        for b, node in self._branches.items():
            v = self._values.get(b, math.inf)
            while node is not None:
                if out.get(node, -math.inf) < v:
                    out[node] = v
                node = node.parent
        return out

    def _keep_target(self, node: _Node) -> int:
        """Tokens a compressed node keeps on the device (per layer, row and KV head): `ceil(keep * n)`, at
        least `min_keep` and at least what the pipeline's fixed-count protectors keep."""
        k = max(self.min_keep, math.ceil(self.keep * node.n))
        while k < node.n and not self._fits(k):
            k += 1
        return k

    def _fits(self, k: int) -> bool:
        """True when the pipeline can compress a node to `k` tokens: the fixed-count protectors fit, and so do
        the allocator's per-layer and per-head shares of `k` (e.g. `HeadUtility`'s floor per head)."""
        fits = self._fit_cache.get(k)
        if fits is None:
            fits = self.pipeline.fixed_protection(k) <= k
            if fits:
                try:
                    self.pipeline.allocator.check(self.pipeline.replace(Evict(), name=self.pipeline.name), k,
                                                  self.num_layers, self._kv_heads)
                except KVComposeError:
                    fits = False
            self._fit_cache[k] = fits
        return fits

    def compression_order(self) -> list[int]:
        """Ids of the inactive nodes that can still be compressed, in the order the budget would compress
        them (the active path never appears)."""
        return [n.id for n in self._candidates()]

    def _candidates(self) -> list[_Node]:
        active = set(self._path())
        nodes = [n for n in self._all_nodes()
                 if n not in active and n.n > self.min_keep and n.segs[0].held() > self._keep_target(n)]
        if self.priority == "value":
            values = self._node_values()
            nodes.sort(key=lambda n: (values.get(n, -math.inf), n.last_used, n.id))
        else:
            nodes.sort(key=lambda n: (n.last_used, n.id))
        return nodes

    def _enforce_budget(self, extra: int = 0) -> None:
        """Compress inactive nodes in `priority` order until the device holds at most `budget` tokens."""
        if self.budget is None or self._recompute_path is not None:
            return
        over = max(self._held_tokens(i) for i in range(self.num_layers)) + extra - self.budget
        if over <= 0:
            return
        for node in self._candidates():
            over -= self._compress_node(node)
            if over <= 0:
                break
        self._track()

    def _compress_node(self, node: _Node) -> int:
        """Keep `ceil(keep * n)` tokens of every layer of an inactive node; the rest go to the tier. Returns
        the tokens freed in layer 0."""
        k = self._keep_target(node)
        if k >= node.n or node.segs[0].held() <= k:
            return 0
        holds = self.tier.holds_tokens
        if holds and self.host_limit is not None:
            bytes_out = (node.n - k) * self.layers[0].bytes_per_token() * self.num_layers
            if self._totals()[2] + bytes_out > self.host_limit:
                holds = False
        if not holds and not node.ids_known and self.rehydrate_mode == "exact":
            return 0  # cannot be recomputed: leave it whole
        if not holds and node.compressed and self.tier.holds_tokens:
            return 0  # its tier already holds some of its tokens: evicting the rest would leave copies there
        pipeline = self.pipeline if holds else self.pipeline.replace(Evict(), name=self.pipeline.name)
        freed = 0
        for layer_idx, seg in enumerate(node.segs):
            before = seg.held()
            self.layers[layer_idx].compress(seg, budget=k, pipeline=pipeline)
            seg.store.trim()
            if layer_idx == 0:
                freed = before - seg.held()
        node.compressed = True
        self.compressions += 1
        self._track()
        return freed

    def _restore_node(self, node: _Node, path: list[_Node]) -> None:
        """Bring a node of the active path back whole: tier tokens merged by position, evicted ones recomputed."""
        fetched_any = False
        for layer_idx, seg in enumerate(node.segs):
            layer = self.layers[layer_idx]
            fetched = self.tier.fetch(seg.tier) if seg.tier else None
            if fetched is None or not fetched.n:
                continue
            fetched_any = True
            v = seg.store.view()
            m = Prefetcher.merge(v.keys, v.values, v.positions, v.valid, seg.store.read_channels(), fetched)
            lengths = (m.positions < FAR_POSITION).sum(-1)
            seg.store.assign(StoreView(m.keys, m.values, m.positions, m.valid), m.channels, lengths)
            seg.tier = self.tier.init(layer.spec)
        if fetched_any:
            self.rehydrations["host"] += 1
        if any(seg.held() < node.n or bool((seg.store.lengths < node.n).any()) for seg in node.segs):
            self._recompute(node, path)
        node.compressed = False

    def _recompute(self, node: _Node, path: list[_Node]) -> None:
        """Recompute a node's tokens from the first missing one, from their token ids over the restored path."""
        if not node.ids_known:
            raise KVComposeError(f"cannot recompute node {node.id}: its tokens were fed without input_ids")
        e = node.n
        for seg in node.segs:
            pos = seg.store.view().positions - node.start
            ar = torch.arange(pos.shape[-1], device=pos.device)
            contiguous = (pos == ar).to(torch.int64).cumprod(dim=-1).sum(dim=-1)
            e = min(e, int(contiguous.min()) if contiguous.numel() else 0)
        total = node.n
        for seg in node.segs:
            store = seg.store
            keep = torch.arange(e, device=store.lengths.device).expand(*store.lengths.shape, e)
            store.compact(keep.contiguous())
            store.trim()
            seg.n = e
            seg.ring.crop(node.start + e)
        ids = torch.cat(node.ids, dim=1)[:, e:]
        pos_ids = torch.cat(node.pos_ids, dim=1)[:, e:]
        valid = [torch.cat(n.tok_valid, dim=1) for n in path if n.tok_valid]
        mask = torch.cat(valid, dim=1)[:, : node.end] if valid else None
        dev = self.layers[0].device
        node.n = e
        self._recompute_path = path
        try:
            kwargs: dict[str, Any] = dict(input_ids=ids.to(dev), position_ids=pos_ids.to(dev), use_cache=True,
                                          **{compat.cache_argument(self.model): self})
            if mask is not None and mask.shape[1] == total + node.start:
                kwargs["attention_mask"] = mask.to(dev, torch.long)
            if "logits_to_keep" in inspect.signature(self.model.forward).parameters:
                kwargs["logits_to_keep"] = 1
            with torch.no_grad():
                self.model(**kwargs)
        finally:
            self._recompute_path = None
        if node.n != total:
            raise KVComposeError(f"recomputation of node {node.id} ended at {node.n} tokens, expected {total}")
        self._trim(node)
        self.rehydrations["recomputed"] += 1
        self.rehydrations["recomputed_tokens"] += total - e
