"""The segment tree of a `BranchCache` (ArborKV-style, abstract only): nodes, the per-layer view of the active
path (`BranchLayer`, a `ComposeLayer` whose path is the active branch's nodes) and the memory report."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..attention import no_trace
from ..layer import ComposeLayer, CoreConfig, Segment, check_incoming
from ..view import KVComposeError

__all__ = ["BranchLayer", "BranchMemory"]


class _Node:
    """A node of the segment tree: `n` tokens at positions `[start, start + n)` of every path through it.

    A node holds its children; its parent only weakly (no reference cycle: a dropped cache frees its stores
    without waiting for the garbage collector)."""

    def __init__(self, nid: int, parent: "_Node | None", num_layers: int):
        self.id = nid
        self._parent = None
        self.parent = parent
        self.start = 0 if parent is None else parent.end
        self.n = 0
        self.ids: list[Tensor] = []  # [B, q] chunks of token ids (on the model's device)
        self.pos_ids: list[Tensor] = []  # [B, q] chunks of model position ids
        self.tok_valid: list[Tensor] = []  # [B, q] chunks, False = padding
        self.ids_known = True
        self.children: set[_Node] = set()
        self.branches: set[int] = set()
        self.sealed = False
        self.segs = [Segment(self.start) for _ in range(num_layers)]
        self.compressed = False
        self.merged = False  # a Merger rewrote held values when it compressed this node: recompute it whole
        self.last_used = 0
        if parent is not None:
            parent.children.add(self)

    @property
    def parent(self) -> "_Node | None":
        return None if self._parent is None else self._parent()

    @parent.setter
    def parent(self, node: "_Node | None") -> None:
        self._parent = None if node is None else weakref.ref(node)

    def __getstate__(self) -> dict:
        """For copy.deepcopy / pickle of the tree: the parent by a plain reference (a weak reference would be
        shared with the original by deepcopy, and pickle cannot store one); weak again once loaded."""
        state = dict(self.__dict__)
        state["_parent"] = self.parent
        return state

    def __setstate__(self, state: dict) -> None:
        parent = state.pop("_parent")
        self.__dict__.update(state)
        self.parent = parent

    @property
    def end(self) -> int:
        return self.start + self.n

    def path(self) -> list["_Node"]:
        out, node = [], self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def __repr__(self) -> str:
        return f"_Node({self.id}, start={self.start}, n={self.n}, compressed={self.compressed})"


@dataclass
class BranchMemory:
    """KV memory of a `BranchCache`, in bytes (keys + values; positions and flags are not counted).

    ArborKV (abstract only) reports peak KV memory; `peak_device` is ours to compare with per-branch copies.

    Attributes:
        device: bytes of the device buffers (held tokens + spare slots of the node being written).
        held: bytes of the tokens held on the device.
        host: bytes held by the tier (host memory or compressed copies).
        peak_device, peak_held, peak_host, peak_total: peaks over the cache's life (total = device
            allocated + host at one time).
        nodes, branches: live segment-tree nodes and branch handles.
        unique_tokens: tokens stored once in the tree (sum of node lengths).
        held_tokens: tokens held on the device in layer 0 (the longest (row, head) of each node).
        copy_tokens: tokens that per-branch full copies would hold (sum of live branches' path lengths).
        bytes_per_token: bytes of one token over all layers (all rows and heads).
    """

    device: int
    held: int
    host: int
    peak_device: int
    peak_held: int
    peak_host: int
    peak_total: int
    nodes: int
    branches: int
    unique_tokens: int
    held_tokens: int
    copy_tokens: int
    bytes_per_token: int

    @property
    def copy_bytes(self) -> int:
        """Bytes that per-branch full copies of the live branches would hold now."""
        return self.copy_tokens * self.bytes_per_token

    def __str__(self) -> str:
        mib = 2**20
        rows = [
            ("branches / nodes", f"{self.branches} / {self.nodes}"),
            ("tokens: copies / unique / held", f"{self.copy_tokens} / {self.unique_tokens} / {self.held_tokens}"),
            ("KV on device (held)", f"{self.held / mib:.2f} MiB"),
            ("KV on device (allocated)", f"{self.device / mib:.2f} MiB"),
            ("KV on host", f"{self.host / mib:.2f} MiB"),
            ("per-branch copies would hold", f"{self.copy_bytes / mib:.2f} MiB"),
            ("peak device / held / host / total", f"{self.peak_device / mib:.2f} / {self.peak_held / mib:.2f} / "
             f"{self.peak_host / mib:.2f} / {self.peak_total / mib:.2f} MiB"),
        ]
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


class BranchLayer(ComposeLayer):
    """One decoder layer of a `BranchCache`: a `ComposeLayer` whose path is the active branch's nodes
    (`[B, H, n, D]` segments, oldest first); it writes into the active branch's node."""

    def __init__(self, config: CoreConfig, layer_idx: int, tree: Any, sliding_window: int | None = None):
        self._tree = weakref.ref(tree)
        super().__init__(config, layer_idx, owner=tree, sliding_window=sliding_window)

    @property
    def tree(self) -> Any:
        """The `BranchCache` this layer belongs to."""
        t = self._tree()
        if t is None:  # pragma: no cover - the cache owns its layers
            raise KVComposeError("the BranchCache of this layer is gone")
        return t

    def path(self) -> list[Segment]:
        return [node.segs[self.layer_idx] for node in self.tree._path()]

    def write_segment(self) -> Segment:
        return self.tree._path()[-1].segs[self.layer_idx]

    def scheduled(self) -> bool:
        return super().scheduled() and self.config.budget is not None

    def layer_budget(self, seen: int | None = None) -> int | None:
        """The active node's budget on the pipeline's schedule: None without `active_budget` (inactive nodes are
        compressed to the sizes the tree chooses, whatever the pipeline's allocator)."""
        if self.config.budget is None:
            return None
        return super().layer_budget(seen)

    @no_trace
    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append the new tokens to the active branch's node (the cache's `update` then hands this layer to
        the attention function)."""
        tree = self.tree
        if self.is_initialized:
            check_incoming(self, key_states, " (all rows share one tree: generate's beams and "
                           "num_return_sequences are not supported; branch with fork())")
        q = key_states.shape[2]
        if self.layer_idx == 0:
            tree.begin_write(q)
        node = tree._path()[-1]
        seg = node.segs[self.layer_idx]
        if seg.n + q != node.n:
            raise KVComposeError(
                f"layer {self.layer_idx} is out of step with layer 0 ({seg.n + q} vs {node.n} tokens in node "
                f"{node.id}); every forward must run all layers"
            )
        return super().update(key_states, value_states)

    def attend(self, query: Float[Tensor, "B Hq Q D"], mask2d: Tensor | None, scale: float,
               sliding_window: int | None = None, **features: Any) -> Float[Tensor, "B Q Hq D"]:
        if self.layer_idx == 0:  # the padding flags of the forward's tokens, kept on the device
            q = query.shape[2]
            self.tree.record_padding(torch.ones(query.shape[0], q, dtype=torch.bool, device=self.device)
                                     if mask2d is None else mask2d[:, -q:].to(self.device, torch.bool))
        return super().attend(query, mask2d, scale, sliding_window, **features)

    def row_padding(self, seg: Segment) -> Tensor | None:
        """`[B]` padding tokens of each row on the path of the node that holds `seg`, up to its end (from the
        padding flags layer 0 records for every forward; None: none)."""
        node = next((n for n in self.tree._all_nodes() if n.segs[self.layer_idx] is seg), None)
        flags = [] if node is None else [v for n in node.path() for v in n.tok_valid]
        if not flags:
            return None
        pad = sum((~v).sum(-1) for v in flags)
        return pad.to(self.device) if bool(pad.any()) else None

    def get_seq_length(self, *args, **kwargs) -> int:
        """Tokens on the active path (held or not): transformers derives positions from it."""
        return self.tree._seq_length()

    def reset(self) -> None:
        if getattr(self, "is_initialized", False):
            raise KVComposeError("a BranchCache cannot be reset; create a new one")
        super().reset()

    def _refuse(self, what: str) -> None:
        raise KVComposeError(f"BranchCache does not support {what}: all rows share one tree; branch with fork()")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._refuse("reorder_cache (generate's beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("batch_repeat_interleave (num_return_sequences / beams)")

    def batch_select_indices(self, indices: Tensor) -> None:
        self._refuse("batch_select_indices")

    def crop(self, tokens_to_remove: int) -> None:
        raise KVComposeError("BranchCache does not crop (nor assisted decoding, which crops): to come back to a point "
                             "of a branch, fork() there (nothing is copied) and switch() to that branch later")

    def offload(self):
        raise KVComposeError("BranchCache manages its own host tier; pass tier=HostTier()")
