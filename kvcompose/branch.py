"""`BranchCache`: a branch-aware KV cache for tree search (ArborKV-style), usable with `model.generate`.

Paper: ArborKV (abstract only, no public code). What the abstract says: in tree-structured reasoning the
next tokens depend only on the active branch and its ancestors; inactive subtrees are rarely reused soon
but must stay recoverable for backtracking. A value estimator scores tokens, the active path gets budget
priority, inactive subtrees keep a subset of their real tokens, revisits rehydrate lazily; about 4x lower
peak KV memory at near-full accuracy.

Our design (everything below is ours, the abstract gives no mechanism):

- **A tree of segments.** The cache is a tree of nodes; a node holds, per layer, the KV of a contiguous run
  of tokens (`[B, H, n, D]`, keys after RoPE, original positions `[B, H, n]`). A *branch* is a handle that
  points at a node; its tokens are the node's path from the root. `fork(b)` makes a new handle on the same
  node and seals the node (no copy). The first write through a handle on a sealed node opens a fresh child
  node (copy-on-write at node granularity), so a write never changes what another branch sees.
- **Attention over the active path.** The layer's `update` appends to the active branch's node; the
  registered kvcompose attention function calls `attend`, which concatenates the path's segments of this
  layer (materialised per attention call, one layer at a time, freed after the call) and runs kvcompose's
  masked SDPA by original positions.
- **Tree-aware allocation.** `budget` caps the tokens held on the device per layer for the whole tree. When
  it is exceeded, nodes off the active path are compressed, least recently used first: each keeps
  `ceil(keep * n)` of its real tokens (per layer and KV head), chosen by a kvcompose `Scorer` (default
  `AccumulatedAttention`: attention each token received from every query of any branch that passed
  through it, H2O-style) or any kvcompose `Pipeline`. The rest goes to the tier (`HostTier`: host
  memory, pinned buffers and a side stream on CUDA; `CompressedTier`; or `Evict()`). The active path is never compressed.
- **Lazy rehydration.** `switch(b)` only marks the new path; before the next forward on it (a forward
  pre-hook on the model, or at the first layer's `update`), host-held tokens are copied back and merged by
  position (bit-exact), then each node that lost tokens is recomputed from its recorded token ids,
  position ids and padding over its restored ancestors (one prefill of the node's tail).

Shapes: B batch rows (all rows share one tree), H KV heads, Hq query heads, n tokens of a node, D head dim.
"""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from . import attention as _attn
from .cache import check_incoming, check_model
from .pipeline import Pipeline
from .scorers import AccumulatedAttention, Scorer
from .selectors import TopK
from .tiers import Evict, HostTier, TierStore, TierTokens
from .view import KVComposeError, LayerView

__all__ = ["BranchCache", "BranchLayer", "BranchMemory"]

_CHUNK = 16  # growth step of a node's buffers while it is being written (tokens)
_TOKEN_BUFS = ("k", "v", "pos", "valid")  # the other buffers of a segment are observer states
_KV = ("k", "v")


class _Segment:
    """One node's tokens in one layer: token-axis buffers (dim 2) with spare capacity while written.

    `bufs['k'|'v']`: `[B, H, cap, D]`. Positions and padding flags are implicit while the segment is whole
    and unpadded (slot `i` is position `start + i`, every token real); `bufs['pos']` (`[B, H, cap]`
    original positions, ascending) and `bufs['valid']` (`[B, H, cap]`, False = padding) exist once the
    segment is compressed, restored or padded (`materialize`). Observer states (e.g. accumulated
    attention): `[B, H, cap]` float32. `m` slots are used. `tier_state`: the TierStore's state for
    offloaded tokens (keys, values, positions, padding and observer state travel together as `TierTokens`).
    """

    __slots__ = ("start", "bufs", "m", "tier_state", "q_buf", "q_pos", "q_valid")

    def __init__(self, start: int) -> None:
        self.start = start
        self.bufs: dict[str, Tensor] = {}
        self.m = 0
        self.tier_state: dict[str, Any] = {}
        self.q_buf: Tensor | None = None
        self.q_pos: Tensor | None = None
        self.q_valid: Tensor | None = None

    @property
    def cap(self) -> int:
        return 0 if "k" not in self.bufs else self.bufs["k"].shape[2]

    def get(self, name: str) -> Tensor:
        return self.bufs[name][:, :, : self.m]

    def pos(self) -> Tensor:
        """`[B, H, m]` original positions of the held tokens."""
        if "pos" in self.bufs:
            return self.bufs["pos"][:, :, : self.m]
        k = self.bufs["k"]
        return torch.arange(self.start, self.start + self.m, device=k.device).expand(k.shape[0], k.shape[1], self.m)

    def valid(self) -> Tensor:
        """`[B, H, m]` False for padding tokens."""
        if "valid" in self.bufs:
            return self.bufs["valid"][:, :, : self.m]
        k = self.bufs["k"]
        return torch.ones(1, 1, 1, dtype=torch.bool, device=k.device).expand(k.shape[0], k.shape[1], self.m)

    def states(self) -> dict[str, Tensor]:
        """Observer states of the held tokens, name -> `[B, H, m]`."""
        return {k: t[:, :, : self.m] for k, t in self.bufs.items() if k not in _TOKEN_BUFS}

    def materialize(self) -> None:
        """Store positions and padding flags explicitly (before compressing, or when padding appears)."""
        if "k" not in self.bufs or "pos" in self.bufs:
            return
        k, cap = self.bufs["k"], self.cap
        self.bufs["pos"] = torch.arange(self.start, self.start + cap, device=k.device).expand(
            k.shape[0], k.shape[1], cap).contiguous()
        self.bufs["valid"] = torch.ones(k.shape[0], k.shape[1], cap, dtype=torch.bool, device=k.device)

    def kv_bytes(self, slots: int) -> int:
        if "k" not in self.bufs:
            return 0
        k, v = self.bufs["k"], self.bufs["v"]
        per = (k.shape[0] * k.shape[1] * k.shape[3]) * k.element_size() + (v.shape[0] * v.shape[1] * v.shape[3]) * v.element_size()
        return slots * per

    def resize(self, cap: int) -> None:
        n = self.m

        def grow(t: Tensor) -> Tensor:
            new = t.new_empty((*t.shape[:2], cap, *t.shape[3:]))
            new[:, :, :n] = t[:, :, :n]
            return new

        self.bufs = {k: grow(t) for k, t in self.bufs.items()}

    def append(self, keys: Tensor, values: Tensor) -> int:
        """Append `[B, H, q, D]` keys and values (new tokens: next positions, real; states 0). Returns the
        change in allocated slots."""
        q = keys.shape[2]
        if not self.bufs:
            self.bufs = {"k": keys.new_empty((*keys.shape[:2], 0, keys.shape[3])),
                         "v": values.new_empty((*values.shape[:2], 0, values.shape[3]))}
        old_cap, need = self.cap, self.m + q
        if need > old_cap:
            self.resize(need + _CHUNK)
        sl = slice(self.m, need)
        self.bufs["k"][:, :, sl] = keys
        self.bufs["v"][:, :, sl] = values
        if len(self.bufs) > 2:
            for name, buf in self.bufs.items():
                if name == "pos":
                    buf[:, :, sl] = torch.arange(self.start + self.m, self.start + need, device=buf.device)
                elif name == "valid":
                    buf[:, :, sl] = True
                elif name not in _KV:
                    buf[:, :, sl] = 0
        self.m = need
        return self.cap - old_cap

    def take(self, idx: Int[Tensor, "B H K"]) -> None:
        """Keep the slots `idx` (ascending) in exactly-sized buffers."""
        self.materialize()
        self.bufs = {k: _gather(self.get(k), idx).contiguous() for k, t in self.bufs.items()}
        self.m = idx.shape[-1]

    def shrink(self) -> None:
        if self.cap > self.m:
            self.resize(self.m)

    def truncate(self, e: int, end: int) -> None:
        """Keep the first `e` slots (positions below `end`) and the queries of those positions."""
        self.m = min(self.m, e)
        if self.q_pos is not None:
            keep = self.q_pos < end
            self.q_buf, self.q_pos, self.q_valid = self.q_buf[:, :, keep], self.q_pos[keep], self.q_valid[:, keep]
            if self.q_pos.numel() == 0:
                self.q_buf = self.q_pos = self.q_valid = None
        self.shrink()


def _bhm(seg: _Segment) -> tuple[int, int, int]:
    """`(B, H, m)` of a segment."""
    k = seg.bufs["k"]
    return k.shape[0], k.shape[1], seg.m


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    """Gather along the token axis (2) of `[B, H, T]` or `[B, H, T, D]` with `idx [B, H, K]`."""
    if x.dim() == 3:
        return x.gather(2, idx)
    return x.gather(2, idx[..., None].expand(*idx.shape, x.shape[-1]))


class _Node:
    """A node of the segment tree: `n` tokens at positions `[start, start + n)` of every path through it."""

    def __init__(self, nid: int, parent: "_Node | None", num_layers: int):
        self.id = nid
        self.parent = parent
        self.start = 0 if parent is None else parent.end
        self.n = 0
        self.ids: list[Tensor] = []  # [B, q] chunks of token ids
        self.pos_ids: list[Tensor] = []  # [B, q] chunks of model position ids
        self.tok_valid: list[Tensor] = []  # [B, q] chunks, False = padding
        self.ids_known = True
        self.children: set[_Node] = set()
        self.branches: set[int] = set()
        self.sealed = False
        self.segs = [_Segment(self.start) for _ in range(num_layers)]
        self.compressed = False
        self.last_used = 0
        if parent is not None:
            parent.children.add(self)

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
        host: bytes held by the tier (host memory).
        peak_device, peak_held, peak_host, peak_total: peaks over the cache's life (total = device
            allocated + host at one time).
        nodes, branches: live segment-tree nodes and branch handles.
        unique_tokens: tokens stored once in the tree (sum of node lengths).
        held_tokens: tokens held on the device in layer 0 (all rows and heads count once).
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


class BranchLayer(CacheLayerMixin):
    """One decoder layer of a `BranchCache` (built by the cache; one per decoder layer).

    Holds no tokens itself: `update` appends the new keys/values (`[B, H, q, D]`, after RoPE) to the
    active branch's node and hands the layer to kvcompose's attention function, which calls `attend`
    (queries `[B, Hq, q, D]` over the concatenated segments of the active path; output `[B, q, Hq, D]`).
    The segment tree and its per-layer segments are our design for ArborKV's branch-aware cache (abstract
    only; see the module docstring).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: "BranchCache", layer_idx: int):
        # CacheLayerMixin.__init__ would assign self.keys/self.values, which are properties here.
        self.cache = cache
        self.layer_idx = layer_idx
        self.is_initialized = False
        self._qstart = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, self.head_dim, self.value_dim = b, h, d, value_states.shape[-1]
        self._bytes_per_token = b * h * (d * key_states.element_size() + value_states.shape[-1] * value_states.element_size())
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.cache.seed * 1_000_003 + self.layer_idx)
        self.is_initialized = True

    # -- the active path ----------------------------------------------------------------------------
    def _segments(self) -> list[_Segment]:
        return [node.segs[self.layer_idx] for node in self.cache._path() if node.segs[self.layer_idx].m]

    def attention_set(self, segs: list[_Segment] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The active path's tokens of this layer: `(keys [B,H,T,D], values, positions [B,H,T], valid [B,H,T])`.

        Keys and values are concatenated (one copy of this layer's path, freed after the attention call).
        The active path is always whole (rehydrated), so its positions are `0..T-1`; they and the padding
        flags are only concatenated when some node holds part of its tokens or some row has padding.
        """
        segs = self._segments() if segs is None else segs
        if not segs:
            raise KVComposeError(f"layer {self.layer_idx} holds nothing on the active path")
        if len(segs) == 1:
            s, m = segs[0], segs[0].m
            return s.bufs["k"][:, :, :m], s.bufs["v"][:, :, :m], s.pos(), s.valid()
        keys = torch.cat([s.bufs["k"][:, :, : s.m] for s in segs], dim=2)
        values = torch.cat([s.bufs["v"][:, :, : s.m] for s in segs], dim=2)
        b, h, t = keys.shape[:3]
        if t == self.cache._seq_length():
            pos = torch.arange(t, device=keys.device).expand(b, h, t)
        else:
            pos = torch.cat([s.pos() for s in segs], dim=2)
        if self.cache._padded:
            valid = torch.cat([s.valid() for s in segs], dim=2)
        else:
            valid = torch.ones(1, 1, 1, dtype=torch.bool, device=keys.device).expand(b, h, t)
        return keys, values, pos, valid

    @property
    def keys(self) -> Tensor | None:
        """Keys of the active path `[B, H, T, D]` (materialised on access)."""
        return self.attention_set()[0] if self.is_initialized and self._segments() else None

    @property
    def values(self) -> Tensor | None:
        """Values of the active path `[B, H, T, D]` (materialised on access)."""
        return self.attention_set()[1] if self.is_initialized and self._segments() else None

    # -- writing ------------------------------------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append the new tokens to the active branch's node and hand this layer to the attention function.

        Returns the new keys/values only (kvcompose's attention function ignores them and calls `attend`).
        """
        cache = self.cache
        if self.layer_idx == 0:
            cache._check_attention()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            check_incoming(self, key_states, " (all rows share one tree: generate's beams and "
                           "num_return_sequences are not supported; branch with fork())")
        q = key_states.shape[2]
        if self.layer_idx == 0:
            cache._begin_write(q)
        node = cache._write_node()
        seg = node.segs[self.layer_idx]
        if seg.m + q != node.n:
            raise KVComposeError(
                f"layer {self.layer_idx} is out of step with layer 0 ({seg.m + q} vs {node.n} tokens in node "
                f"{node.id}); every forward must run all layers"
            )
        self._qstart = node.start + seg.m
        grown = seg.append(key_states, value_states)
        per = self._bytes_per_token
        cache._account(self.layer_idx, grown * per, q * per, q)
        _attn.handoff.layer = self
        return key_states, value_states

    def attend(self, query: Float[Tensor, "B Hq Q D"], mask2d: Tensor | None, scale: float,
               sliding_window: int | None = None) -> Float[Tensor, "B Q Hq D"]:
        """Attention of the new queries over the active path (ancestors' segments + own), in position order."""
        cache = self.cache
        q = query.shape[2]
        if query.shape[1] % self.num_heads:
            raise KVComposeError(f"{query.shape[1]} query heads are not a multiple of {self.num_heads} KV heads")
        self.scale = scale
        tail = cache._write_node()
        seg = tail.segs[self.layer_idx]
        new_valid = None
        if self.layer_idx == 0:
            if mask2d is not None:
                new_valid = mask2d[:, -q:].to(device=self.device, dtype=torch.bool)
                cache._new_padding = not bool(new_valid.all())
                cache._padded = cache._padded or cache._new_padding
            else:
                cache._new_padding = False
            if cache._recompute_path is None:
                tail.tok_valid.append(torch.ones(query.shape[0], q, dtype=torch.bool) if new_valid is None
                                      else new_valid.cpu())
        if cache._new_padding:  # padding among the new tokens: store this segment's flags explicitly
            if new_valid is None:
                new_valid = mask2d[:, -q:].to(device=self.device, dtype=torch.bool)
            seg.materialize()
            seg.bufs["valid"][:, :, seg.m - q : seg.m] = new_valid[:, None, :]
        segs = self._segments()
        keys, values, pos, valid = self.attention_set(segs)
        observers = cache._observers
        t = keys.shape[2]
        qpos = None
        if q == 1 and not observers and not cache._padded and (sliding_window is None or t <= sliding_window):
            # one new token on a whole, unpadded path sees every key: no mask to build
            out = _attend_unmasked(query, keys, values, scale)
        else:
            qpos = torch.arange(self._qstart, self._qstart + q, device=self.device)
            mask = _attn.build_mask(pos, valid, qpos, sliding_window)
            out = _attn.attend(query, keys, values, mask, scale)
        for s in observers:
            key = s.state_key
            cur = torch.cat([sg.get(key) if key in sg.bufs else torch.zeros(_bhm(sg), device=self.device)
                             for sg in segs], dim=2)
            new = s.observe(cur, query, keys, mask, scale)
            off = 0
            for sg in segs:
                if key not in sg.bufs:
                    sg.bufs[key] = torch.zeros((*sg.bufs["k"].shape[:3],), dtype=torch.float32, device=self.device)
                sg.bufs[key][:, :, : sg.m] = new[:, :, off : off + sg.m]
                off += sg.m
        w = cache.pipeline.query_window
        if w > 0:
            if qpos is None:
                qpos = torch.arange(self._qstart, self._qstart + q, device=self.device)
            qvalid = (mask2d[:, -q:].to(device=self.device, dtype=torch.bool) if mask2d is not None
                      else torch.ones(query.shape[0], q, dtype=torch.bool, device=self.device))
            if seg.q_buf is None:
                seg.q_buf, seg.q_pos, seg.q_valid = query[:, :, -w:], qpos[-w:], qvalid[:, -w:]
            else:
                seg.q_buf = torch.cat([seg.q_buf, query], dim=2)[:, :, -w:]
                seg.q_pos = torch.cat([seg.q_pos, qpos])[-w:]
                seg.q_valid = torch.cat([seg.q_valid, qvalid], dim=1)[:, -w:]
        return out

    # -- transformers Cache API -----------------------------------------------------------------------
    def get_seq_length(self, *args, **kwargs) -> int:
        """Tokens on the active path (held or not): transformers derives positions from it."""
        return self.cache._seq_length()

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        """`(held + new, seen - held)` on the active path; accepts an int or a cache_position tensor."""
        q = query_length.shape[0] if isinstance(query_length, Tensor) else int(query_length)
        held = sum(node.segs[self.layer_idx].m for node in self.cache._path())
        return held + q, self.cache._seq_length() - held

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        raise KVComposeError("a BranchCache cannot be reset; create a new one")

    def _refuse(self, what: str) -> None:
        raise KVComposeError(f"BranchCache does not support {what}: all rows share one tree; branch with fork()")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._refuse("reorder_cache (generate's beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("batch_repeat_interleave (num_return_sequences / beams)")

    def batch_select_indices(self, indices: Tensor) -> None:
        self._refuse("batch_select_indices")

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse("crop (assisted decoding)")

    def offload(self):
        raise KVComposeError("BranchCache manages its own host tier; pass tier=HostTier()")

    def prefetch(self):
        return None


def _attend_unmasked(
    query: Float[Tensor, "B Hq Q D"], keys: Float[Tensor, "B H T D"], values: Float[Tensor, "B H T Dv"], scale: float
) -> Float[Tensor, "B Q Hq Dv"]:
    """SDPA of queries that see every key (GQA folded into the query axis, keys never repeated)."""
    b, hq, q, d = query.shape
    h = keys.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, h, (hq // h) * q, d), keys, values,
                                                           scale=scale)
    return out.reshape(b, hq, q, values.shape[-1]).transpose(1, 2)


def _remove_handles(handles: list) -> None:
    for h in handles:
        h.remove()


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
            inactive nodes are compressed, least recently used first. None: never compress (exact sharing).
        keep: fraction of an inactive node's tokens it keeps on the device when compressed.
        min_keep: a compressed node keeps at least this many tokens (nodes this short are left whole).
        scorer: the value estimator, a kvcompose `Scorer` (used with `TopK`) or a whole `Pipeline`
            (default `AccumulatedAttention()`, observed only when `budget` or `scorer` is given; `KeyNorm()`
            or `ValueNorm()` need no queries).
        tier: where the non-kept tokens of a compressed node go: a `TierStore` holding tokens (default
            `HostTier()`; `CompressedTier()` stores them quantized, so its rehydration is approximate), or
            `Evict()` to free them (then they are recomputed on return).
        host_limit: bytes the tier may hold; a node whose tokens would exceed it is evicted instead.
        seed: seed of the per-layer random generators handed to the pipeline.
        strict: refuse model types that are not tested.
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
        host_limit: int | None = None,
        seed: int = 0,
        strict: bool = True,
    ):
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise KVComposeError(f"budget must be a non-negative int or None, got {budget!r}")
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 <= keep < 1.0:
            raise KVComposeError(f"keep must be a fraction in [0, 1), got {keep!r}")
        if isinstance(min_keep, bool) or not isinstance(min_keep, int) or min_keep < 1:
            raise KVComposeError(f"min_keep must be a positive int, got {min_keep!r}")
        if host_limit is not None and (not isinstance(host_limit, int) or host_limit < 0):
            raise KVComposeError(f"host_limit must be a non-negative int (bytes) or None, got {host_limit!r}")
        if scorer is None:
            pipeline = Pipeline(AccumulatedAttention(), TopK())
        elif isinstance(scorer, Pipeline):
            if not scorer.compresses:
                raise KVComposeError("the value pipeline needs a selector (e.g. Pipeline(KeyNorm(), TopK()))")
            pipeline = scorer
        elif isinstance(scorer, Scorer):
            pipeline = Pipeline(scorer, TopK())
        else:
            raise KVComposeError(f"scorer must be a kvcompose Scorer or Pipeline, got {type(scorer).__name__}")
        if tier is None:
            tier = HostTier()
        if not isinstance(tier, TierStore):
            raise KVComposeError(f"tier must be a kvcompose TierStore (HostTier(), Evict(), ...), got {type(tier).__name__}")
        config = check_model(model, strict)
        self.model = model
        self.budget = budget
        self.keep = float(keep)
        self.min_keep = min_keep
        self.pipeline = pipeline
        self.tier = tier
        self.host_limit = host_limit
        self.seed = seed
        self.num_layers = config.num_hidden_layers
        _attn.register()
        if getattr(model.config, "_attn_implementation", None) != _attn.ATTN_IMPLEMENTATION:
            model.set_attn_implementation(_attn.ATTN_IMPLEMENTATION)
        super().__init__(layers=[BranchLayer(self, i) for i in range(self.num_layers)])
        # the tree
        self._next_node = 0
        self._next_branch = 1
        self._root = self._new_node(None)
        self._branches: dict[int, _Node] = {0: self._root}
        self._lineage: dict[int, int | None] = {0: None}
        self._root.branches.add(0)
        self._active = 0
        self._path_cache: list[_Node] | None = None
        self._pending = False
        self._padded = False  # some row has padding (then per-token padding flags are concatenated)
        self._new_padding = False  # the tokens of the current forward include padding
        # the value estimator observes attention only when something may be compressed
        self._observers = pipeline.observers() if budget is not None or scorer is not None else []
        self._recompute_path: list[_Node] | None = None
        self._incoming: dict[str, Tensor | None] = {}
        self._tick = 0
        self.rehydrations = {"host": 0, "recomputed": 0, "recomputed_tokens": 0}
        self.compressions = 0
        # accounting (bytes of K+V)
        self._dev_alloc = 0
        self._dev_held = 0
        self._held_tokens = [0] * self.num_layers
        self._host = 0
        self._peak = {"device": 0, "held": 0, "host": 0, "total": 0}
        # hooks: capture token ids / position ids, rehydrate lazily, enforce the budget after each forward
        ref = weakref.ref(self)

        # A dead cache's finalizer may remove these hooks while torch is already iterating over them (garbage
        # collection inside a forward); torch then calls them without kwargs, so both accept that and do nothing.
        def pre(module, args, kwargs=None):
            c = ref()
            if c is not None and kwargs is not None and kwargs.get("past_key_values") is c:
                c._before_forward(kwargs)

        def post(module, args, *rest):
            c = ref()
            kwargs = rest[0] if len(rest) == 2 else None
            if c is not None and kwargs is not None and kwargs.get("past_key_values") is c:
                c._after_forward()

        handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
                   model.register_forward_hook(post, with_kwargs=True)]
        self._hooks = handles
        self._finalizer = weakref.finalize(self, _remove_handles, handles)

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
        for seg in node.segs:
            self._shrink(seg)
        new = self._next_branch
        self._next_branch += 1
        self._branches[new] = node
        self._lineage[new] = b
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
        for seg in old[-1].segs:
            self._shrink(seg)
        self._active = branch
        self._path_cache = None
        self._pending = any(n.compressed for n in node.path())
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

    def compress(self, branch: int) -> int:
        """Compress now every node of `branch` that is off the active path; returns the tokens freed (layer 0).

        With `budget=None` and the default scorer, attention is not observed (nothing would be compressed
        automatically), so the default estimator has no data: pass `scorer=` to use this then.
        """
        active = set(self._path())
        freed = 0
        for n in self._node_of(branch, "compress").path():
            if n not in active and not n.compressed:
                freed += self._compress_node(n)
        return freed

    def rehydrate(self) -> None:
        """Restore the active path now (otherwise done lazily before the next forward on it)."""
        if not self._pending:
            return
        self._pending = False
        path = self._path()
        missing = sum(n.n - n.segs[0].m for n in path if n.compressed)
        self._enforce_budget(extra=missing)
        for i, node in enumerate(path):
            if node.compressed:
                self._restore_node(node, path[: i + 1])

    def memory(self) -> BranchMemory:
        """Bytes on the device and on the host now, their peaks, and what per-branch copies would hold."""
        layer0 = self.layers[0]
        bpt = 0
        if layer0.is_initialized:
            item = torch.empty(0, dtype=layer0.dtype).element_size()
            bpt = self.num_layers * layer0.batch_size * layer0.num_heads * (layer0.head_dim + layer0.value_dim) * item
        return BranchMemory(
            device=self._dev_alloc, held=self._dev_held, host=self._host,
            peak_device=self._peak["device"], peak_held=self._peak["held"], peak_host=self._peak["host"],
            peak_total=self._peak["total"],
            nodes=len(self._all_nodes()), branches=len(self._branches),
            unique_tokens=sum(n.n for n in self._all_nodes()), held_tokens=self._held_tokens[0],
            copy_tokens=sum(n.end for n in self._branches.values()), bytes_per_token=bpt,
        )

    def close(self) -> None:
        """Remove the forward hooks from the model (also done when the cache is garbage-collected)."""
        self._finalizer()

    def __repr__(self) -> str:
        return (f"BranchCache(budget={self.budget}, keep={self.keep}, scorer={self.pipeline!r}, tier={self.tier!r}, "
                f"branches={len(self._branches)}, active={self._active})")

    # -- transformers Cache API -----------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seq_length()

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def reset(self) -> None:
        raise KVComposeError("a BranchCache cannot be reset; create a new one")

    # -- internals: tree ----------------------------------------------------------------------------
    def _new_node(self, parent: _Node | None) -> _Node:
        node = _Node(self._next_node, parent, self.num_layers)
        self._next_node += 1
        node.last_used = getattr(self, "_tick", 0)
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

    def _write_node(self) -> _Node:
        return self._path()[-1]

    def _seq_length(self) -> int:
        return self._path()[-1].end

    def _free_up(self, node: _Node) -> None:
        while node is not None and node is not self._root and not node.children and not node.branches:
            for layer_idx, seg in enumerate(node.segs):
                self._account(layer_idx, -seg.kv_bytes(seg.cap), -seg.kv_bytes(seg.m), -seg.m)
                self._clear_tier(seg)
                seg.bufs, seg.m, seg.q_buf = {}, 0, None
            parent = node.parent
            parent.children.discard(node)
            node.parent = None
            node = parent

    # -- internals: forward -------------------------------------------------------------------------
    def _check_attention(self) -> None:
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl != _attn.ATTN_IMPLEMENTATION:
            raise KVComposeError(
                f"the model's attention implementation is {impl!r}; BranchCache needs kvcompose's "
                f"({_attn.ATTN_IMPLEMENTATION!r}): do not change it while the cache is in use"
            )

    def _before_forward(self, kwargs: dict) -> None:
        if self._recompute_path is not None:
            return
        self._incoming = {"input_ids": kwargs.get("input_ids"), "position_ids": kwargs.get("position_ids")}
        if self._pending:
            self.rehydrate()

    def _after_forward(self) -> None:
        if self._recompute_path is not None:
            return
        self._incoming = {}
        self._enforce_budget()

    def _begin_write(self, q: int) -> None:
        """Layer 0 of a forward: restore the path if needed, open a node (copy-on-write), record ids."""
        if self._recompute_path is not None:
            self._recompute_path[-1].n += q
            return
        if self._pending:  # a forward that bypassed the model's hooks (e.g. called on model.model)
            self.rehydrate()
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
        b = self.layers[0].batch_size
        if isinstance(ids, Tensor) and ids.dim() == 2 and ids.shape[1] == q and node.ids_known:
            node.ids.append(ids.detach().to("cpu", torch.long).expand(b, q))
        else:
            node.ids_known = False
        if isinstance(pos_ids, Tensor) and pos_ids.dim() == 2 and pos_ids.shape[-1] == q:
            node.pos_ids.append(pos_ids.detach().to("cpu", torch.long).expand(b, q))
        else:
            node.pos_ids.append(torch.arange(node.end, node.end + q).expand(b, q))
        node.n += q
        self._incoming = {}

    # -- internals: accounting ----------------------------------------------------------------------
    def _account(self, layer_idx: int, d_alloc: int, d_held: int, d_tokens: int) -> None:
        self._dev_alloc += d_alloc
        self._dev_held += d_held
        self._held_tokens[layer_idx] += d_tokens
        self._track()

    def _track(self) -> None:
        self._peak["device"] = max(self._peak["device"], self._dev_alloc)
        self._peak["held"] = max(self._peak["held"], self._dev_held)
        self._peak["host"] = max(self._peak["host"], self._host)
        self._peak["total"] = max(self._peak["total"], self._dev_alloc + self._host)

    def _shrink(self, seg: _Segment) -> None:
        before = seg.kv_bytes(seg.cap)
        seg.shrink()
        self._account(0, seg.kv_bytes(seg.cap) - before, 0, 0)

    def _clear_tier(self, seg: _Segment) -> None:
        if seg.tier_state:
            self._host -= sum(self.tier.nbytes(seg.tier_state).values())
            seg.tier_state.clear()

    # -- internals: compression and rehydration -----------------------------------------------------
    def _enforce_budget(self, extra: int = 0) -> None:
        """Compress inactive nodes, least recently used first, until the device holds at most `budget` tokens."""
        if self.budget is None or self._recompute_path is not None:
            return
        over = max(self._held_tokens) + extra - self.budget
        if over <= 0:
            return
        active = set(self._path())
        candidates = [n for n in self._all_nodes() if n not in active and not n.compressed and n.n > self.min_keep]
        candidates.sort(key=lambda n: (n.last_used, n.id))
        for node in candidates:
            over -= self._compress_node(node)
            if over <= 0:
                break

    def _compress_node(self, node: _Node) -> int:
        """Keep `ceil(keep * n)` tokens of every layer of an inactive node; the rest go to the tier. Returns
        the tokens freed in layer 0."""
        k = max(self.min_keep, math.ceil(self.keep * node.n))
        if k >= node.n or node.segs[0].m < node.n:
            return 0
        holds = self.tier.holds_tokens
        if holds and self.host_limit is not None:
            bytes_out = (node.n - k) * node.segs[0].kv_bytes(1) * self.num_layers
            if self._host + bytes_out > self.host_limit:
                holds = False
        if not holds and not node.ids_known:
            return 0  # cannot be recomputed: leave it whole
        freed = 0
        for layer_idx, seg in enumerate(node.segs):
            layer = self.layers[layer_idx]
            seg.materialize()
            view = LayerView(
                layer_idx=layer_idx, num_layers=self.num_layers,
                keys=seg.get("k"), values=seg.get("v"), positions=seg.get("pos"), valid=seg.get("valid"),
                prompt_length=self._root.n, queries=seg.q_buf, query_positions=seg.q_pos, query_valid=seg.q_valid,
                seen=node.end, scale=getattr(layer, "scale", layer.head_dim**-0.5),
                state=seg.states(), generator=layer.generator, event=self.compressions,
            )
            sel = self.pipeline.select(view, k)
            kept = sel.kept
            if (kept < 0).any():
                raise KVComposeError("the value pipeline gave heads different budgets; BranchCache needs one per layer")
            m = seg.m
            drop = torch.ones(seg.get("pos").shape, dtype=torch.bool, device=kept.device)
            drop.scatter_(-1, kept, False)
            didx = torch.sort(drop.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., : m - k]
            didx = didx.sort(dim=-1).values
            if holds:
                tokens = TierTokens(
                    keys=_gather(seg.get("k"), didx), values=_gather(seg.get("v"), didx),
                    positions=_gather(seg.get("pos"), didx), valid=_gather(seg.get("valid"), didx),
                    state={key: _gather(seg.get(key), didx) for key in seg.bufs if key not in _TOKEN_BUFS},
                )
                scores = None if sel.scores is None else sel.scores.gather(-1, didx)
                self.tier.store(seg.tier_state, tokens, scores, node.end, k)
            before_alloc, before_held = seg.kv_bytes(seg.cap), seg.kv_bytes(seg.m)
            seg.take(kept)
            self._account(layer_idx, seg.kv_bytes(seg.cap) - before_alloc, seg.kv_bytes(seg.m) - before_held, seg.m - m)
            if layer_idx == 0:
                freed = m - seg.m
        if holds:
            self._host = sum(sum(self.tier.nbytes(s.tier_state).values()) for n in self._all_nodes() for s in n.segs
                             if s.tier_state)
            self._track()
        node.compressed = True
        self.compressions += 1
        return freed

    def _restore_node(self, node: _Node, path: list[_Node]) -> None:
        """Bring a node of the active path back whole: host tokens merged by position, evicted ones recomputed."""
        fetched_any = False
        for layer_idx, seg in enumerate(node.segs):
            fetched = self.tier.fetch(seg.tier_state) if seg.tier_state else None
            if fetched is None:
                continue
            fetched_any = True
            dev = self.layers[layer_idx].device
            held = TierTokens(keys=seg.get("k"), values=seg.get("v"), positions=seg.pos(), valid=seg.valid(),
                              state=seg.states())
            back = TierTokens(keys=fetched.keys.to(dev), values=fetched.values.to(dev),
                              positions=fetched.positions.to(dev), valid=fetched.valid.to(dev),
                              state={key: v.to(dev) for key, v in fetched.state.items() if key in held.state})
            both = TierTokens.cat([held, back])
            both = both.take(both.positions.argsort(dim=-1, stable=True))
            new = {"k": both.keys, "v": both.values, "pos": both.positions, "valid": both.valid, **both.state}
            before_alloc, before_held, m = seg.kv_bytes(seg.cap), seg.kv_bytes(seg.m), seg.m
            seg.bufs = {name: t.contiguous() for name, t in new.items()}
            seg.m = new["pos"].shape[-1]
            self._clear_tier(seg)
            self._account(layer_idx, seg.kv_bytes(seg.cap) - before_alloc, seg.kv_bytes(seg.m) - before_held, seg.m - m)
        if fetched_any:
            self.rehydrations["host"] += 1
        if any(seg.m < node.n for seg in node.segs):
            self._recompute(node, path)
        node.compressed = False

    def _recompute(self, node: _Node, path: list[_Node]) -> None:
        """Recompute a node's tokens from the first missing one, from their token ids over the restored path."""
        if not node.ids_known:
            raise KVComposeError(f"cannot recompute node {node.id}: its tokens were fed without input_ids")
        e = node.n
        for seg in node.segs:
            pos = seg.pos() - node.start
            ar = torch.arange(pos.shape[-1], device=pos.device)
            contiguous = (pos == ar).to(torch.int64).cumprod(dim=-1).sum(dim=-1)
            e = min(e, int(contiguous.min()) if contiguous.numel() else 0)
        total = node.n
        for layer_idx, seg in enumerate(node.segs):
            before_alloc, before_held, m = seg.kv_bytes(seg.cap), seg.kv_bytes(seg.m), seg.m
            seg.truncate(e, node.start + e)
            self._account(layer_idx, seg.kv_bytes(seg.cap) - before_alloc, seg.kv_bytes(seg.m) - before_held, seg.m - m)
        ids = torch.cat(node.ids, dim=1)[:, e:]
        pos_ids = torch.cat(node.pos_ids, dim=1)[:, e:]
        valid = [torch.cat(n.tok_valid, dim=1) for n in path if n.tok_valid]
        mask = torch.cat(valid, dim=1)[:, : node.end] if valid else None
        dev = self.layers[0].device
        node.n = e
        self._recompute_path = path
        try:
            kwargs: dict[str, Any] = dict(input_ids=ids.to(dev), position_ids=pos_ids.to(dev), past_key_values=self,
                                          use_cache=True)
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
        for seg in node.segs:
            self._shrink(seg)
        self.rehydrations["recomputed"] += 1
        self.rehydrations["recomputed_tokens"] += total - e
