"""How a `BranchCache` follows the model's forward calls: the forward hooks, the write of each forward, and
the recomputation mode.

A plain `KVComposeCache` needs nothing around a forward: every layer's `update` appends and its attention
attends. A tree cache adds three things, each in one place here:

- **Before a forward** (a pre-hook on the model): remember the forward's `input_ids` / `position_ids` (a
  node's tokens are recomputed from them if its keys are evicted) and restore the active path if a switch
  made it compressed (`rehydrate`, lazily).
- **At layer 0's update** (`begin_write`): open a fresh child node if the active branch's node is shared
  (copy-on-write at node granularity) and record the ids. Layer 0's attention records the padding flags.
- **After a forward** (a post-hook): check that every layer's attention ran, note the peaks and enforce the
  budget off the active path.

**Recomputation** is one forward of the model run *inside* another operation (a switch's rehydration): the
tokens of a node whose keys were evicted are fed again, over the restored ancestors, into that same node.
It is an explicit mode (`with cache.recomputing(path):`): while it lasts the path is fixed to `path`, the
hooks and `begin_write` only count the node's tokens (no ids, no copy-on-write, no budget), and switching
is refused. Nothing else in the cache needs to know.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from .. import attention as _hook
from .. import compat
from ..view import KVComposeError
from .tree import _Node

__all__ = ["ForwardHooks", "ForwardMixin"]


def _remove_handles(handles: list) -> None:
    for h in handles:
        h.remove()


class ForwardHooks:
    """A pre- and a post-forward hook on the model that call `cache.before_forward(kwargs)` and
    `cache.after_forward()` for forwards that carry `cache`. They hold the cache weakly and are removed when
    it is garbage-collected (or by `remove()`)."""

    def __init__(self, model, cache):
        ref = weakref.ref(cache)

        # A dead cache's finalizer may remove these hooks while torch is already iterating over them (garbage
        # collection inside a forward); torch then calls them without kwargs, so both accept that and do nothing.
        def pre(module, args, kwargs=None):
            c = ref()
            if c is not None and kwargs is not None and compat.forward_cache(kwargs) is c:
                c.before_forward(kwargs)

        def post(module, args, *rest):
            c = ref()
            kwargs = rest[0] if len(rest) == 2 else None
            if c is not None and kwargs is not None and compat.forward_cache(kwargs) is c:
                c.after_forward()

        self.handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
                        model.register_forward_hook(post, with_kwargs=True)]
        self._finalizer = weakref.finalize(cache, _remove_handles, self.handles)

    def remove(self) -> None:
        self._finalizer()


class ForwardMixin:
    """The forward side of `BranchCache` (see the module docstring). Expects the cache's tree attributes:
    `_branches`, `_active`, `_path_cache`, `layers`, `model`, and `_new_node` / `_path` / `rehydrate`."""

    _recompute_path: list[_Node] | None = None
    _incoming: dict[str, Tensor | None]

    # -- the recomputation mode ---------------------------------------------------------------------
    @property
    def is_recomputing(self) -> bool:
        """True during a recomputation forward (the path is fixed, nothing is recorded or enforced)."""
        return self._recompute_path is not None

    @contextmanager
    def recomputing(self, path: list[_Node]) -> Iterator[None]:
        """Run forwards that recompute the last node of `path` (its ancestors restored)."""
        if self._recompute_path is not None:
            raise KVComposeError("a recomputation is already running")
        self._recompute_path = path
        try:
            yield
        finally:
            self._recompute_path = None

    # -- hooks ----------------------------------------------------------------------------------------
    def before_forward(self, kwargs: dict) -> None:
        if self.is_recomputing:
            return
        self._incoming = {"input_ids": kwargs.get("input_ids"), "position_ids": kwargs.get("position_ids")}
        if self._pending:
            self.rehydrate()

    def after_forward(self) -> None:
        _hook.check_consumed(self)  # a layer whose attention never ran (implementation switched) raises now
        if self.is_recomputing:
            return
        self._incoming = {}
        self._track()
        self._enforce_budget()

    # -- the write of one forward (layer 0) -----------------------------------------------------------
    def begin_write(self, q: int) -> None:
        """Layer 0 of a forward: restore the path if needed, open a node (copy-on-write), record ids."""
        if self.is_recomputing:
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
        # kept where they are (the model's device): recorded at every forward, read only to recompute
        if isinstance(ids, Tensor) and ids.dim() == 2 and ids.shape[1] == q and node.ids_known:
            node.ids.append(ids.detach().to(torch.long).expand(max(b, ids.shape[0]), q))
        else:
            node.ids_known = False
        if isinstance(pos_ids, Tensor) and pos_ids.dim() == 2 and pos_ids.shape[-1] == q:
            node.pos_ids.append(pos_ids.detach().to(torch.long).expand(max(b, pos_ids.shape[0]), q))
        else:
            dev = ids.device if isinstance(ids, Tensor) else None
            node.pos_ids.append(torch.arange(node.end, node.end + q, device=dev).expand(max(b, 1), q))
        node.n += q
        self._incoming = {}

    def record_padding(self, valid: Tensor) -> None:
        """Layer 0's attention: the padding flags `[B, q]` of the forward's new tokens (True = real)."""
        if not self.is_recomputing:
            self._path()[-1].tok_valid.append(valid)

    # -- recomputation --------------------------------------------------------------------------------
    def _recompute(self, node: _Node, path: list[_Node]) -> None:
        """Recompute a node's tokens from the first missing one, from their token ids over the restored path
        (from its first token when a Merger rewrote the values of the tokens it kept: `node.merged`)."""
        if not node.ids_known:
            raise KVComposeError(f"cannot recompute node {node.id}: its tokens were fed without input_ids")
        e = 0 if getattr(node, "merged", False) else node.n
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
        dev = self.layers[0].device
        ids = torch.cat(node.ids, dim=1)[:, e:].to(dev)
        pos_ids = torch.cat(node.pos_ids, dim=1)[:, e:].to(dev)
        valid = [torch.cat(n.tok_valid, dim=1).to(dev) for n in path if n.tok_valid]
        mask = torch.cat(valid, dim=1)[:, : node.end] if valid else None
        node.n = e
        kwargs: dict[str, Any] = dict(input_ids=ids, position_ids=pos_ids, use_cache=True,
                                      **{compat.cache_argument(self.model): self})
        if mask is not None and mask.shape[1] == total + node.start:
            kwargs["attention_mask"] = mask.to(torch.long)
        if "logits_to_keep" in inspect.signature(self.model.forward).parameters:
            kwargs["logits_to_keep"] = 1
        with self.recomputing(path), torch.no_grad():
            self.model(**kwargs)
        if node.n != total:
            raise KVComposeError(f"recomputation of node {node.id} ended at {node.n} tokens, expected {total}")
        self._trim(node)
        self.rehydrations["recomputed"] += 1
        self.rehydrations["recomputed_tokens"] += total - e
