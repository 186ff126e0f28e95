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
  tail; of the whole node when the pipeline's `Merger` folded evicted values into the tokens it kept, since
  those no longer hold what the model wrote). With `rehydrate="resume"`, the branch resumes from what its nodes still hold (approximate, no
  recomputation: tier tokens are still attended where the tier holds them).

Shapes: B batch rows (all rows share one tree), H KV heads, Hq query heads, n tokens of a node, D head dim.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from jaxtyping import Int
from torch import Tensor
from transformers.cache_utils import Cache

from .. import attention as _attn
from .. import copying as _copying
from ..block import Block, require_role, role_of
from ..cache import CacheGlue, check_budget, check_interval, check_model
from ..layer import CacheStats, CoreConfig
from ..pipeline import Pipeline
from ..prefetch import Prefetcher
from ..scorers import AccumulatedAttention, Scorer
from ..seeding import check_seed
from ..selectors import TopK
from ..tiers import Evict, HostTier, TierStore
from ..view import KVComposeError, warn_unused
from .budget import BudgetMixin
from .forward import ForwardHooks, ForwardMixin
from .tree import BranchLayer, BranchMemory, _Node

__all__ = ["BranchCache"]

_UNCOPIED = ("model", "_hooks")  # shared (the model) or registered again for a copy (its forward hooks)


def _check_unused(pipeline: Pipeline, attention, interval, active_budget, host_limit, tier, seed) -> None:
    """Warn (`KVComposeWarning`) about arguments that cannot change what the tree cache does."""
    if interval is not None and active_budget is None and not attention.sliding_layers:
        warn_unused(f"BranchCache(interval={interval})", "without active_budget the active path is never compressed "
                    "on a schedule (inactive nodes are compressed when the tree exceeds budget)", stacklevel=4)
    if host_limit is not None and not tier.holds_tokens:
        warn_unused(f"BranchCache(host_limit={host_limit})", f"the tier {tier!r} holds no tokens", stacklevel=4)
    # a node that would exceed host_limit is evicted instead (its merger, if any, then draws)
    draws = pipeline.draws_random or (host_limit is not None and pipeline.replace(Evict(), name=pipeline.name).draws_random)
    if seed and not draws:
        warn_unused(f"BranchCache(seed={seed})", f"no block of {pipeline!r} draws random numbers", stacklevel=4)


class BranchCache(ForwardMixin, BudgetMixin, CacheGlue, Cache):
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
        pipeline.bind_model(model)
        check_budget(active_budget, "active_budget")
        seed = check_seed(seed, "BranchCache(seed=...)")
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
        # capture token ids / position ids, rehydrate lazily, enforce the budget after each forward
        self._hooks = ForwardHooks(model, self)

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
        if self.is_recomputing:
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
            dev = self.layers[0].device if self.layers[0].is_initialized else "cpu"
            return torch.empty(1, 0, dtype=torch.long, device=dev)
        return torch.cat([torch.cat(n.ids, dim=1) for n in path], dim=1)  # on the model's device

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
        (both also done when the cache is garbage-collected). The closed cache refuses to decode by name until
        `bind(model)` opens it again."""
        if self._hooks is not None:  # None: a loaded cache that was never bound
            self._hooks.remove()
            self._hooks = None
        _attn.release(self)
        self.kvcompose_closed = True

    # -- CacheGlue (kvcompose.cache): the Cache API answers of the active path --------------------------
    def _bound(self) -> bool:
        return self._hooks is not None

    def _seen_length(self, layer_idx: int = 0) -> int:
        return self._seq_length()

    def _layer_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

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
        self._hooks = None
        _copying.link_layers(self, self.layers, tree=True)

    def bound_model(self):
        """The model this cache decodes with (None for a cache loaded from a pickle before `bind`)."""
        return self.model

    def bind(self, model) -> "BranchCache":
        """Attach a cache loaded with pickle / `torch.load` to its model (the one it was built for, or one of the
        same architecture and weights): kvcompose's attention and the cache's forward hooks; also opens a closed
        cache again, and switches its model back after `set_attn_implementation()` /
        `kvcompose.attention.restore()`. Returns the cache."""
        if self.model is model and self._hooks is not None and not self.kvcompose_closed and _attn.is_installed(model):
            return self
        if self.model is not None and self.model is not model and self._hooks is not None:
            raise KVComposeError("this cache is bound to another model; copy.deepcopy(cache) shares its model")
        config, attention = check_model(model)
        _copying.check_same_model(self, model, config)
        self.pipeline.bind_model(model)  # a copy holds no weights: its blocks take the model's again
        if self.model is model:
            _attn.release(self)  # re-opened: one hold on the model's attention switch, not two
        _attn.install(model, owner=self)
        if self._hooks is None:
            self._hooks = ForwardHooks(model, self)
        self.model, self.attention = model, attention
        self.kvcompose_closed = False
        return self

    # -- transformers Cache API (update, get_seq_length, get_mask_sizes: CacheGlue) ---------------------
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
