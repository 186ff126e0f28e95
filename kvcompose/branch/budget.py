"""The memory side of `BranchCache`: which inactive nodes are compressed when the tree exceeds its budget,
how a node is compressed (the cache's pipeline, one event per layer, on the one layer core), and how a
compressed node of the active path is brought back (tier tokens merged by position, evicted ones
recomputed, `kvcompose.branch.forward`). Accounting of device and host bytes lives here too."""

from __future__ import annotations

import math

from ..prefetch import Prefetcher
from ..stores import StoreView
from ..tiers import Evict
from ..view import FAR_POSITION, KVComposeError
from .tree import _Node

__all__ = ["BudgetMixin"]


class BudgetMixin:
    """Compression and rehydration of tree nodes (see the module docstring). Expects the cache's tree
    attributes (`_branches`, `_values`, `_root`, `layers`, `pipeline`, `tier`, ...) and `_path`,
    `_all_nodes`, `_recompute` (from `ForwardMixin`)."""

    # -- accounting ---------------------------------------------------------------------------------
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

    # -- which nodes ----------------------------------------------------------------------------------
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
        if self.budget is None or self.is_recomputing:
            return
        over = max(self._held_tokens(i) for i in range(self.num_layers)) + extra - self.budget
        if over <= 0:
            return
        for node in self._candidates():
            over -= self._compress_node(node)
            if over <= 0:
                break
        self._track()

    # -- compression and restoration of one node ------------------------------------------------------
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
        # a merger folds the values of the tokens that leave for good into kept ones: the held prefix a
        # recomputation would start after is no longer what the model wrote (`_recompute` starts at 0 then)
        node.merged = getattr(node, "merged", False) or pipeline.merger is not None
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
            seg.store.trim()  # a restored node holds what it held: no room kept for appends it will not get
            seg.tier = self.tier.init(layer.spec)
        if fetched_any:
            self.rehydrations["host"] += 1
        if any(seg.held() < node.n or bool((seg.store.host_lengths < node.n).any()) for seg in node.segs):
            self._recompute(node, path)
        node.compressed = False
        node.merged = False

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
