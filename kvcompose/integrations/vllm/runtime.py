"""The worker side of kvcompose inside vLLM, in plain torch (nothing here imports vLLM): per-request state, the
query ring, the compression event (a `LayerView` of the request's paged keys and values per layer,
`Pipeline.select`, the kept tokens packed into the leading blocks in place) and the per-step plan that turns
logical positions into physical slots and lengths. `worker.py` calls it from vLLM's model runner.

Shapes: L attention layers, H KV heads, Hq query heads, D head dim, S ring slots (the engine's `max_num_seqs`),
W ring window, h tokens a request holds, B its budget.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...pipeline import Pipeline
from ...view import FAR_POSITION, KVComposeError, LayerSpec, LayerView, RowGenerators
from .rules import Settings, event_due, kept_row, layer_seed

__all__ = ["PagedLayout", "RequestState", "Runtime", "StepPlan", "Stats"]


def _bits(x: Tensor) -> Tensor:
    """A 16-bit float tensor seen as int16 (the same bits; moves by index are several times faster than in
    bfloat16 on CPU), any other unchanged."""
    return x.view(torch.int16) if x.dtype in (torch.bfloat16, torch.float16) else x


def _words(x: Tensor) -> Tensor:
    """Rows (the last axis) seen as 8-byte words when their bytes allow (the same bits; whole rows moved by
    index are about 1.5x faster in int64 than in int16 or float32 on CPU), else `_bits(x)`. `.view(dtype)`
    turns a result back."""
    if x.element_size() < 8 and x.shape[-1] * x.element_size() % 8 == 0:
        try:
            return x.view(torch.int64)
        except RuntimeError:  # a stride or offset that is not whole words
            pass
    return _bits(x)


class PagedLayout:
    """Where one layer's vLLM KV-cache tensor keeps the key and the value of (block, KV head, slot):
    `gather(kv, blk, off) -> (keys, values)` of shape `[H, n, D]` for the slots `(blk[i], off[i])`, and
    `scatter(kv, blk, off, keys, values)` writes them back in place.

    vLLM 0.32 gives every attention backend a per-layer tensor of logical shape `[num_blocks, H, block_size,
    2 * D]`. The GPU backends (`FLASH_ATTN`, `TRITON_ATTN`) read it as it says: a token's key and value side by
    side on the last axis (written from vLLM's source, untested here). `CPU_ATTN` splits each (block, head)
    into a key region and a value region of `block_size * D` elements and lays a block's keys out for its
    kernel's ISA (for `vec`, transposed: `[D, block_size]`); `maps=(kmap, vmap)`, `[block_size, D]` element
    offsets inside those regions, say where each (slot, dim) lives. The worker measures them with vLLM's own
    cache-write op at start-up (`worker.cpu_layout_maps`), so they follow whatever ISA the kernel uses.
    """

    KINDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN")

    def __init__(self, backend: str, head_size: int, block_size: int, maps: tuple[Tensor, Tensor] | None = None):
        if backend not in self.KINDS:
            raise KVComposeError(f"kvcompose's vLLM route knows the KV layouts of {self.KINDS}, not {backend!r}")
        if backend == "CPU_ATTN" and maps is None:
            raise KVComposeError("the CPU_ATTN layout needs the measured (kmap, vmap) element maps")
        self.backend, self.D, self.bs = backend, head_size, block_size
        self.kmap, self.vmap = (None, None) if maps is None else maps

    def _check(self, kv: Tensor) -> None:
        if kv.dim() != 4 or kv.shape[2] != self.bs or kv.shape[3] != 2 * self.D:
            raise KVComposeError(f"a {self.backend} KV cache of shape {tuple(kv.shape)} does not hold blocks of "
                                 f"{self.bs} keys and values of head size {self.D} (padded head sizes are not supported)")

    def index(self, kv: Tensor, blk: Tensor, off: Tensor) -> tuple[Tensor, Tensor]:
        """Flat element offsets `[H, n, D]` of the keys and values of slots `(blk[i], off[i])` in `kv`'s storage
        (from its strides: one index serves every layer of the same shape)."""
        self._check(kv)
        st = kv.stride()
        h = torch.arange(kv.shape[1], device=kv.device)
        d = torch.arange(self.D, device=kv.device)
        base = (blk * st[0])[None, :, None] + (h * st[1])[:, None, None]  # [H, n, 1]
        if self.kmap is None:  # [.., slot, k | v] on the last axis
            slot = (off * st[2])[None, :, None]
            k = base + slot + d * st[3]
            return k, k + self.D * st[3]
        if not kv.is_contiguous():
            raise KVComposeError("the CPU_ATTN KV cache is expected to be contiguous")
        n = self.bs * self.D
        return base + self.kmap[off][None], base + n + self.vmap[off][None]

    def _kinds(self) -> tuple[str, str]:
        """How each measured map lays a block's (slot, dim) out: "rows" (`[block_size, D]`, as the values of the
        `vec` ISA), "cols" (`[D, block_size]`, its keys) or "perm" (any other permutation: moved by index)."""
        if getattr(self, "_kind", None) is None:
            bs, D = self.bs, self.D
            rows = torch.arange(bs * D, device=self.kmap.device).view(bs, D)
            cols = torch.arange(bs * D, device=self.kmap.device).view(D, bs).t()
            self._kind = tuple("rows" if torch.equal(m, rows) else "cols" if torch.equal(m, cols) else "perm"
                               for m in (self.kmap, self.vmap))
        return self._kind

    def by_blocks(self, kv: Tensor) -> bool:
        """Whether whole blocks move faster than slots: a contiguous cache whose blocks lay their keys and values
        out in rows or columns (any other permutation is moved slot by slot, by index: faster on CPU)."""
        return kv.is_contiguous() and (self.kmap is None or "perm" not in self._kinds())

    @staticmethod
    def _flat(kv: Tensor) -> Tensor:
        return kv.as_strided((kv.untyped_storage().nbytes() // kv.element_size() - kv.storage_offset(),), (1,),
                             kv.storage_offset())

    def gather(self, kv: Tensor, blk: Tensor, off: Tensor, index: tuple[Tensor, Tensor] | None = None
               ) -> tuple[Tensor, Tensor]:
        ki, vi = self.index(kv, blk, off) if index is None else index
        flat = self._flat(kv)
        return flat.index_select(0, ki.reshape(-1)).view(ki.shape), flat.index_select(0, vi.reshape(-1)).view(vi.shape)

    def gather_blocks(self, kv: Tensor, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values `[n, H, block_size, D]` of whole blocks (`blocks`: `[n]` block ids, views of one copy):
        one `index_select` of the blocks, then the layout's map inside a block (a view for rows or columns, an
        index only for another permutation)."""
        self._check(kv)
        raw = kv.index_select(0, blocks)  # [n, H, bs, 2D] as stored
        n, H, bs, D = raw.shape[0], raw.shape[1], self.bs, self.D
        if self.kmap is None:
            return raw[..., :D], raw[..., D:]
        flat = raw.reshape(n, H, 2 * bs * D)
        out = []
        for part, kind, m in ((flat[..., :bs * D], self._kinds()[0], self.kmap),
                              (flat[..., bs * D:], self._kinds()[1], self.vmap)):
            if kind == "rows":  # [bs, D] as the logical shape says
                out.append(part.view(n, H, bs, D))
            elif kind == "cols":  # [D, bs]: the vec ISA's keys
                out.append(part.view(n, H, D, bs).transpose(2, 3))
            else:  # any other permutation: by index (slower)
                out.append(part.index_select(2, m.reshape(-1).to(kv.device)).view(n, H, bs, D))
        return out[0], out[1]

    def scatter(self, kv: Tensor, blk: Tensor, off: Tensor, keys: Tensor, values: Tensor,
                index: tuple[Tensor, Tensor] | None = None) -> None:
        ki, vi = self.index(kv, blk, off) if index is None else index
        flat = self._flat(kv)
        flat.index_copy_(0, ki.reshape(-1), keys.reshape(-1).to(flat.dtype))
        flat.index_copy_(0, vi.reshape(-1), values.reshape(-1).to(flat.dtype))


def _pick(x: Tensor, own: Tensor, bs: int | None = None) -> Tensor:
    """`[n, H, B, D]`: `x[r, h, own[r, h, b]]` of `x` `[n, H, T, D]` (the held tokens, often a slice or a strided
    view of a wider buffer), one `index_select` over the D-wide rows of its storage: no copy of what is held (a
    gather along T is slower on CPU, a reshape of a slice copies it). With `bs`, the picked rows come in block
    order instead, `[n, B // bs, H, bs, D]` (a paged cache's `[block, head, slot]`), contiguous."""
    n, H, B = own.shape
    D = x.shape[-1]
    if x.stride(-1) != 1 or any(st % D for st in x.stride()[:-1]):
        x = x.contiguous()
    s0, s1, s2 = (st // D for st in x.stride()[:-1])
    dev = x.device
    rows = (torch.arange(n, device=dev) * s0).view(n, 1, 1) + (torch.arange(H, device=dev) * s1).view(1, H, 1) + own * s2
    if bs is not None:
        rows = rows.view(n, H, B // bs, bs).transpose(1, 2)
    span = (n - 1) * s0 + (H - 1) * s1 + (x.shape[2] - 1) * s2 + 1  # rows of D elements from x's first to its last
    out = _words(x.as_strided((span, D), (D, 1))).index_select(0, rows.reshape(-1)).view(x.dtype)
    return out.view(n, H, B, D) if bs is None else out.view(n, B // bs, H, bs, D)


class _GroupIO:
    """Reads the held keys and values of a group's rows and writes their kept ones, per layer: whole blocks when
    the cache is contiguous, else slot by slot.

    Whole blocks: each (block, KV head) of a contiguous cache is one run of memory (`FLASH_ATTN`: `[block_size,
    2 * D]`, key and value side by side; `CPU_ATTN`: a key region and a value region of `block_size * D`, each
    in rows `[block_size, D]` or columns `[D, block_size]`). `load` reads them in the order `[row, head, block]`
    (one `index_select`), so a region in rows is already the `[n, H, T, D]` the `LayerView` takes (no copy; a
    region in columns is transposed, and `FLASH_ATTN`'s key and value halves are made contiguous for the
    scorers, which read strided halves slower). `store_kept` picks the kept tokens straight into the block order
    of the destination and writes each region with one `index_copy_`. Whole rows move as 8-byte words.

    `blocks`: `[n, nbT]` each row's blocks covering `T` slots (padded with its first block); `blk`, `off`: `[n, T]`
    the block and offset of every slot (padded slots point at the row's first slot; they are masked)."""

    def __init__(self, layout: PagedLayout, kv0: Tensor, blocks: Tensor, blk: Tensor, off: Tensor, n: int, H: int,
                 T: int, B: int, D: int):
        self.layout, self.blk, self.off = layout, blk, off
        self.n, self.H, self.T, self.B, self.D = n, H, T, B, D
        self.whole = layout.by_blocks(kv0)
        bs, dev = layout.bs, blocks.device
        h = torch.arange(H, device=dev)
        self.parts = 1 if layout.kmap is None else 2  # runs of memory per (block, head)
        lead = blocks[:, : B // bs]  # [n, B // bs]: the blocks the kept tokens fill, whole
        # source runs in [row, head, block] order, destination runs in [row, block, head] order
        self.src = (blocks[:, None, :] * H + h[None, :, None]) * self.parts  # [n, H, nbT]
        self.dst = ((lead[:, :, None] * H + h[None, None, :]) * self.parts).reshape(-1)  # [n * lead * H]
        self.kinds = layout._kinds() if self.whole and self.parts == 2 else ()  # CPU_ATTN: each region's order
        self._src = self._dst = None

    def _runs(self, kv: Tensor) -> Tensor:
        """The cache as its runs of memory, `[num_blocks * H * parts, run]`, as 8-byte words (`_words`)."""
        return _words(kv.view(kv.shape[0] * self.H * self.parts, -1))

    def load(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        n, H, T, D, bs = self.n, self.H, self.T, self.D, self.layout.bs
        if self.whole:
            self.layout._check(kv)
            runs, nb = self._runs(kv), self.src.shape[-1]
            if self.parts == 1:  # [.., slot, k | v]: one read, then each half contiguous (what scorers read fastest)
                x = runs.index_select(0, self.src.reshape(-1)).view(kv.dtype).view(n, H, nb * bs, 2 * D)[:, :, :T]
                k, v = x[..., :D].contiguous(), x[..., D:].contiguous()
            else:
                got = []
                for part, kind in enumerate(self.kinds):
                    x = runs.index_select(0, (self.src + part).reshape(-1)).view(kv.dtype)
                    if kind == "rows":
                        got.append(x.view(n, H, nb * bs, D)[:, :, :T])
                    else:  # "cols"
                        got.append(x.view(n, H, nb, D, bs).transpose(-1, -2).reshape(n, H, nb * bs, D)[:, :, :T])
                k, v = got
            return k, v
        if self._src is None:
            src = self.layout.index(kv, self.blk.reshape(-1), self.off.reshape(-1))  # [H, n * T, D] each
            self._src = tuple(x.view(H, n, T, D).transpose(0, 1).reshape(-1) for x in src)
        flat = self.layout._flat(kv)
        return (flat.index_select(0, self._src[0]).view(n, H, T, D),
                flat.index_select(0, self._src[1]).view(n, H, T, D))

    def store_kept(self, kv: Tensor, own: Tensor, keys: Tensor, values: Tensor) -> None:
        """Write the tokens `own` `[n, H, B]` (indices into T, per row and head) of `keys`, `values` `[n, H, T, D]`
        into the leading slots of each row, in order (they fill the leading blocks exactly)."""
        n, H, B, D, bs = self.n, self.H, self.B, self.D, self.layout.bs
        if self.whole:
            runs = self._runs(kv)
            if self.parts == 1:
                x = torch.cat([_pick(keys, own, bs), _pick(values, own, bs)], dim=-1)
                runs.index_copy_(0, self.dst, x.to(kv.dtype).reshape(self.dst.shape[0], -1).view(runs.dtype))
                return
            for part, (kind, x) in enumerate(zip(self.kinds, (keys, values))):
                picked = _pick(x, own, bs).to(kv.dtype)  # [n, lead, H, bs, D]
                if kind == "cols":
                    picked = picked.transpose(-1, -2)
                runs.index_copy_(0, self.dst + part, picked.contiguous().view(self.dst.shape[0], -1).view(runs.dtype))
            return
        new_k, new_v = _pick(keys, own), _pick(values, own)
        if self._dst is None:
            dst = self.layout.index(kv, self.blk[:, :B].reshape(-1), self.off[:, :B].reshape(-1))
            self._dst = tuple(x.view(H, n, B, D).transpose(0, 1).reshape(-1) for x in dst)
        flat = self.layout._flat(kv)
        flat.index_copy_(0, self._dst[0], new_k.reshape(-1).to(flat.dtype))
        flat.index_copy_(0, self._dst[1], new_v.reshape(-1).to(flat.dtype))


@dataclass
class Stats:
    """Counters of one worker (all in seconds of wall time, host side)."""

    events: int = 0  # request events (each runs every layer)
    event_groups: int = 0  # groups of requests whose events ran as rows of one LayerView (one select per layer)
    event_seconds: float = 0.0  # LayerView + Pipeline.select + packing, every layer
    plan_seconds: float = 0.0  # per-step bookkeeping: counts, block-table rows, physical positions, ring plan
    builder_seconds: float = 0.0  # slot mapping and lengths rewritten in the attention metadata builder
    record_seconds: float = 0.0  # queries recorded into the ring (every layer)
    head_seconds: float = 0.0  # kvcompose's attention of rows whose heads hold their own counts (every layer)
    steps: int = 0
    step_seconds: float = 0.0  # vLLM's execute_model + sample_tokens, kvcompose included
    peak_requests: int = 0  # most requests in one step's batch
    request_steps: int = 0  # sum over steps of the batch's requests (mean running = request_steps / steps)
    peak_blocks: int = 0  # most blocks held by one step's batch (sum of its block-table rows)
    compressed_requests: int = 0  # requests that ran at least one event
    preemptions: int = 0  # requests seen coming back from a preemption

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


@dataclass
class RequestState:
    """What the worker knows of one request (see `Runtime`)."""

    settings: Settings
    prompt_len: int
    last: int = 0  # vLLM's num_computed_tokens at the last step the request was scheduled in
    held: int = 0  # tokens in its blocks (physical), the kept ones first
    c_event: int = 0  # its logical count at its last event
    kept_pos: Tensor | None = None  # [L, H, B] logical positions of the tokens kept at the last event
    events: int = 0
    slot: int | None = None  # ring slot
    ring_n: int = 0  # queries in the ring (<= W)
    ring_head: int = 0  # next ring index written
    gens: list[torch.Generator] | None = None
    states: list[Any] | None = None  # per layer: the pipeline's state tuple
    failed: bool = False  # its kvcompose work failed: no further event (the scheduler finishes it)
    key: tuple[bytes, bool] | None = None  # its pipeline's pickle and whether it runs alone (`Runtime._group_key`)
    # per-layer budgets (`Settings.per_layer`), from its first event on (None before: every layer holds `held`):
    lheld: np.ndarray | None = None  # [L] tokens each layer holds (physical); `held` is the scheduler's bound
    lpos: list[Tensor | None] | None = None  # per layer [Hg, k] logical positions kept at its last event
    lc_event: np.ndarray | None = None  # [L] logical count at each layer's last event
    levents: np.ndarray | None = None  # [L] events of each layer
    # per-head counts (`Settings.per_head`), from its first event on: a compressed layer `i` holds, in head `h`,
    # its kept tokens in slots [0, hcount[i, h]) and the newer ones from slot htop[i] on (the slots between are
    # masked: attention over them runs in `Runtime.head_attention`)
    htop: np.ndarray | None = None  # [L] the slot the newer tokens start at (0: the layer was never compressed)
    hcount: np.ndarray | None = None  # [L, Hg] tokens each head kept at the layer's last event
    hlimit: np.ndarray | None = None  # [L, Hg] each head's limit (`KVComposeCache`'s per-head limits)

    @property
    def offset(self) -> int:
        """Logical minus physical count: how far its positions run ahead of its slots."""
        return self.last - self.held


@dataclass
class StepPlan:
    """One step's kvcompose facts, in the batch's row order, for the attention builder and impls.

    `physical` is False when no request of the batch was ever compressed (vLLM's own slots and lengths are
    right, nothing is rewritten)."""

    physical: bool
    num_tokens: int = 0
    tok_row: Tensor | None = None  # [N] batch row of each scheduled token
    tok_phys: Tensor | None = None  # [N] its physical position
    seq_lens: Tensor | None = None  # [R] held + scheduled, int32
    seq_lens_cpu: Tensor | None = None
    max_seq_len: int = 0
    ring_src: Tensor | None = None  # [M] token indices whose queries are recorded
    ring_dst: Tensor | None = None  # [M] flat ring index (slot * W + i)
    # per-layer counts (a request of the batch keeps per-layer budgets): the layers fall into classes of equal
    # counts in every row; `seq_lens`, `tok_phys` above are the class of layer 0's
    layer_class: np.ndarray | None = None  # [L] class of each layer
    class_phys: list[Tensor] | None = None  # per class [N] physical positions
    class_seq_lens: list[tuple[Tensor, Tensor, int]] | None = None  # per class (seq_lens, on the host, max)
    class_slots: list[Tensor] | None = None  # per class: the slot mapping (the builder fills it)
    class_meta: list[Any] | None = None  # per class: the attention metadata (the builder fills it)
    # per-head counts: the rows whose heads hold their own counts (`Runtime._head_rows`), and the step's block
    # table (the builder fills it)
    head_rows: dict[str, Any] | None = None
    block_table: Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Runtime:
    """kvcompose's state in one vLLM worker.

    Args:
        num_layers, num_kv_heads, num_q_heads, head_dim: the model's attention (per layer, all the same).
        block_size: vLLM's block size. device, dtype: of the KV cache. scales: each layer's attention scale.
        max_seqs: ring slots (vLLM's `max_num_seqs`). query_window: ring window W (the largest window a
            request's pipeline may read). layout: `PagedLayout` of the backend.
        tp_rank, tp_size, gather: tensor parallelism. `num_kv_heads` and `num_q_heads` are this rank's (KV heads
            `tp_rank * H ... (tp_rank + 1) * H - 1` of the model's `tp_size * H`); `gather(x, dim)` concatenates
            every rank's `x` along `dim` in rank order (vLLM's `get_tp_group().all_gather`). At an event every
            rank gathers the held keys, values and recorded queries of all heads and runs the pipeline on all of
            them, exactly as one rank would (the same generator draws, head-coupled scorers see every head), then
            packs its own heads: every head keeps `budget` tokens, so one block table serves every rank.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, num_q_heads: int, head_dim: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype, scales: list[float], max_seqs: int, query_window: int,
                 layout: PagedLayout, tp_rank: int = 0, tp_size: int = 1, gather=None):
        if tp_size > 1 and gather is None:
            raise KVComposeError("tensor parallelism needs a gather across the ranks")
        if not 0 <= tp_rank < tp_size:
            raise KVComposeError(f"tensor-parallel rank {tp_rank} of {tp_size}")
        if num_q_heads % num_kv_heads:
            raise KVComposeError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        self.L, self.H, self.Hq, self.D = num_layers, num_kv_heads, num_q_heads, head_dim
        self.tp_rank, self.tp_size, self.gather = tp_rank, tp_size, gather
        self.Hg = num_kv_heads * tp_size  # the model's KV heads (kept positions are known for all of them)
        self.heads = slice(tp_rank * num_kv_heads, (tp_rank + 1) * num_kv_heads)  # this rank's, globally
        self.block_size = block_size
        self.device, self.dtype = torch.device(device), dtype
        self.scales = list(scales)
        self.S, self.W = max_seqs, query_window
        self.layout = layout
        self.requests: dict[str, RequestState] = {}
        self.free_slots = list(range(max_seqs))[::-1]
        self.ring: list[Tensor] | None = None  # per layer [S * W, Hq, D]
        self.ring_pos: Tensor | None = None  # [S * W] logical positions
        self.step: StepPlan | None = None
        self.stats = Stats()
        self.failed: dict[str, str] = {}  # request id -> why, reported with the step's output, then cleared
        self.scheduler_tracked: int | None = None  # the scheduler's count of requests it keeps state for
        self.per_layer_refused: str | None = None  # why per-layer budgets cannot run in this engine (None: they can)
        self.hf_config: Any = None  # the served model's config (per-layer profiles are checked against it)
        self.per_head_refused: str | None = None  # why per-head counts cannot run in this engine (None: they can)

    # -- requests ---------------------------------------------------------------------------------
    def add(self, req_id: str, settings: Settings, prompt_len: int) -> RequestState:
        if settings.query_window > self.W:
            raise KVComposeError(f"request {req_id}: {settings.pipeline!r} reads {settings.query_window} queries, the "
                                 f"engine's ring holds {self.W} (raise query_window in engine_kwargs)")
        if settings.query_window > 0:
            self._ensure_ring()  # here, so that a ring that cannot be allocated fails this request alone
        if settings.per_head and self.per_head_refused:
            raise KVComposeError(f"request {req_id}: {settings.pipeline!r} gives the KV heads of a layer their own "
                                 f"counts, and {self.per_head_refused}")
        if settings.per_layer and self.per_layer_refused:
            raise KVComposeError(f"request {req_id}: {settings.pipeline!r} gives each layer its own budget, and "
                                 f"{self.per_layer_refused}")
        settings.check_layers(self.hf_config, self.L, self.Hg)  # per-layer budgets: as KVComposeCache's first forward
        st = RequestState(settings=settings, prompt_len=prompt_len)
        self.requests[req_id] = st
        return st

    def fail(self, req_id: str, why: str) -> None:
        """Note that a request's kvcompose work failed: it runs no further event, and the step's output names it
        (the scheduler then finishes it alone with an error)."""
        self.failed[req_id] = why
        st = self.requests.get(req_id)
        if st is not None:
            st.failed = True

    def remove(self, req_id: str) -> None:
        st = self.requests.pop(req_id, None)
        if st is not None:
            self._free_slot(st)

    def _free_slot(self, st: RequestState) -> None:
        if st.slot is not None:
            self.free_slots.append(st.slot)
            st.slot = None
        st.ring_n = st.ring_head = 0

    def restart(self, req_id: str, preempted: bool = False) -> None:
        """A preempted request: vLLM recomputes it from its tokens with the full cache (counts from 0)."""
        st = self.requests.get(req_id)
        if st is None:
            return
        self._free_slot(st)
        st.last = st.held = st.c_event = 0
        st.kept_pos = st.lheld = st.lpos = st.lc_event = st.levents = None
        st.htop = st.hcount = st.hlimit = None
        self.stats.preemptions += int(preempted)

    def advance(self, req_id: str, n_computed: int) -> RequestState | None:
        """Account for the tokens the previous step wrote (they sit at the physical end) and return the
        request's state (None for a request kvcompose does not know, e.g. a dummy run's)."""
        st = self.requests.get(req_id)
        if st is None:
            return None
        if n_computed < st.last:  # recomputed after a preemption vLLM did not announce to us
            self.restart(req_id, preempted=True)
        st.held += n_computed - st.last
        if st.lheld is not None:
            st.lheld += n_computed - st.last
        return st

    def due(self, st: RequestState, n_computed: int) -> bool:
        """Whether the request runs an event before this step's forward: `rules.event_due`; with per-layer
        budgets, at the same boundaries, when some layer holds more than its own budget (`KVComposeCache`'s
        rule, per layer) or the scheduler cuts its blocks (`cut`)."""
        s = st.settings
        if st.failed or not s.compresses:
            return False
        if not s.per_layer:
            return event_due(st.prompt_len, st.last, n_computed, s.interval, st.held, s.budget)
        if not event_due(st.prompt_len, st.last, n_computed, s.interval, 1, 0):  # not at a boundary
            return False
        lheld = np.full(self.L, st.held) if st.lheld is None else st.lheld
        if s.per_head:
            return any(self._head_due(st, i, int(lheld[i])) for i in range(self.L)) or self.cut_due(st, n_computed)
        return bool((lheld > np.asarray(s.layer_budgets(self.L, n_computed))).any()) or self.cut_due(st, n_computed)

    def _head_due(self, st: RequestState, i: int, held: int) -> bool:
        """`KVComposeCache`'s rule for a layer whose heads keep their own counts (`events.rows_over`): some head
        holds more than its limit (the budgets of the layer's last event; before it, the layer's budget when its
        store opened), or a whole interval past it."""
        s = st.settings
        if st.htop is None or not st.htop[i]:
            lim = s.layer_budgets(self.L, 0)[i]  # a paged store's limits before its first event
            return held > lim or held >= lim + s.interval
        lens = st.hcount[i] + (held - int(st.htop[i]))
        lim = st.hlimit[i]
        return bool(((lens > lim) | (lens >= lim + s.interval)).any())

    def cut_due(self, st: RequestState, n_computed: int) -> bool:
        """Whether the scheduler frees the request's blocks behind its kept tokens at this step (its rule, on
        its counts: `held` and `Settings.held_bound`)."""
        s = st.settings
        return s.compresses and event_due(st.prompt_len, st.last, n_computed, s.interval, st.held,
                                          s.held_bound(self.L, self.block_size, self.Hg))

    def cut(self, st: RequestState, n_computed: int, row: list[int]) -> list[int]:
        """The request's block-table row after this step's cut (the scheduler's), `held` set to the bound; the
        row unchanged when nothing is cut."""
        if not self.cut_due(st, n_computed):
            return list(row)
        bound = st.settings.held_bound(self.L, self.block_size, self.Hg)
        st.held = bound
        return kept_row(row, n_computed, bound, self.block_size)

    # -- the ring ---------------------------------------------------------------------------------
    def _ensure_ring(self) -> None:
        if self.ring is None:
            self.ring = [torch.zeros(self.S * self.W, self.Hq, self.D, dtype=self.dtype, device=self.device)
                         for _ in range(self.L)]
            self.ring_pos = torch.zeros(self.S * self.W, dtype=torch.long, device=self.device)

    def record(self, layer_idx: int, query: Tensor) -> None:
        """Write this step's planned queries of one layer into its ring (`query`: `[tokens, Hq, D]`, post-RoPE)."""
        plan = self.step
        if plan is None or plan.ring_src is None or self.ring is None:
            return
        t0 = time.perf_counter()
        q = query.view(query.shape[0], self.Hq, self.D)
        self.ring[layer_idx].index_copy_(0, plan.ring_dst, q.index_select(0, plan.ring_src).to(self.dtype))
        self.stats.record_seconds += time.perf_counter() - t0

    # -- the event --------------------------------------------------------------------------------
    def _continued(self, kept: Tensor | None, c_event: int, width: int, lead: tuple[int, ...]) -> Tensor:
        """`[*lead, width]` logical positions of held tokens: the kept ones (`kept`: `[*lead, b]`, None before the
        first event), then the newer ones from `c_event` on, continued up to `width`."""
        if kept is None:
            return torch.arange(width, device=self.device).expand(*lead, width)
        newer = c_event + torch.arange(width - kept.shape[-1], device=self.device)
        return torch.cat([kept, newer.expand(*lead, -1)], dim=-1)

    def _all_positions(self, st: RequestState, width: int) -> Tensor:
        """`[L, Hg, width]`: `_positions` of every layer at once."""
        return self._continued(st.kept_pos, st.c_event, width, (self.L, self.Hg))

    def _positions(self, st: RequestState, layer_idx: int, width: int | None = None) -> Tensor:
        """`[Hg, width]` logical positions of the tokens a layer holds in each of the model's KV heads (the kept
        ones, then the newer ones), continued past the held count up to `width` (default: the held count)."""
        kept = None if st.kept_pos is None else st.kept_pos[layer_idx]
        return self._continued(kept, st.c_event, st.held if width is None else width, (self.Hg,))

    def _ring_index(self, st: RequestState, window: int) -> Tensor:
        """`[window]` flat ring indices of the request's last `window` queries, oldest first (the ring must hold
        at least `window`: `_group_key` groups by the count)."""
        if st.ring_n < self.W:
            idx = torch.arange(st.ring_n, device=self.device)
        else:
            idx = (st.ring_head + torch.arange(self.W, device=self.device)) % self.W
        return st.slot * self.W + idx[-window:]

    def compress(self, req_id: str, st: RequestState, n_computed: int, row: list[int],
                 kv_caches: list[Tensor]) -> list[int]:
        """Run the event of one request before the step's forward (`compress_many` with one request); returns
        the row it keeps. Raises what the event raised."""
        out = self.compress_many([(req_id, st, n_computed, row)], kv_caches)[req_id]
        if isinstance(out, BaseException):
            raise out
        return out

    def _group_key(self, st: RequestState, n_computed: int) -> tuple:
        """Requests whose events can run as rows of one `LayerView`: the same pipeline (its pickle), budget and
        window, the same decoded count (so one `prompt_length` marks every row's prompt once the rows are aligned
        on their last token), event count and queries in the ring. A pipeline that draws random numbers groups
        rows of the same held count when every drawing block draws per row (`Pipeline.draws_per_row`): each row
        draws from its own generators (`RowGenerators`), what it draws alone. A pipeline that keeps state, draws
        otherwise or has per-layer budgets runs alone."""
        s = st.settings
        if st.key is None:
            spec = LayerSpec(0, self.L, 1, self.Hg, self.D, self.D, self.device, self.dtype)
            p = s.pipeline
            alone = (s.per_layer or (p.draws_random and not p.draws_per_row)
                     or any(x is not None for x in p.init(spec)))
            st.key = (pickle.dumps(p), alone, p.draws_random)
        w = min(st.ring_n, s.query_window) if st.slot is not None else 0
        return (st.key[0], s.budget, n_computed - st.prompt_len, st.events, w, st.held if st.key[2] else None,
                id(st) if st.key[1] else None)

    def compress_many(self, items: list[tuple[str, RequestState, int, list[int]]], kv_caches: list[Tensor]
                      ) -> dict[str, list[int] | BaseException]:
        """Run the events due at this step, before its forward: every layer keeps `budget` tokens per KV head of
        each request, packed in place into the first `budget / block_size` blocks of its row (its physical block
        list), with the merged values when the pipeline has a `Merger`. Requests that can share a `LayerView`
        (`_group_key`) run as its rows, one `Pipeline.select` per layer for the group (rows right-padded to the
        longest with invalid slots at `FAR_POSITION`, positions shifted so that every row's last token is at the
        same place: `LayerView.padding`). Returns, per request id, the row it keeps (`rules.keep_blocks`) or the
        exception its group raised (that group's requests wrote nothing, or only into their leading blocks)."""
        t0 = time.perf_counter()
        groups: dict[tuple, list] = {}
        out: dict[str, Any] = {}
        for it in items:
            try:
                groups.setdefault(self._group_key(it[1], it[2]), []).append(it)
            except Exception as e:  # noqa: BLE001 - that request alone
                out[it[0]] = e
        todo = list(groups.values())
        while todo:
            group = todo.pop(0)
            try:
                self.stats.event_groups += 1
                out.update(self._compress_group(group, kv_caches))
            except Exception as e:  # noqa: BLE001 - the group's requests fail, the others go on
                if len(group) > 1 and not getattr(e, "kvc_written", False):
                    todo[:0] = [[it] for it in group]  # nothing was written: each request again, alone
                    continue
                for it in group:
                    out[it[0]] = e
        self.stats.event_seconds += time.perf_counter() - t0
        return out

    def _init_request(self, st: RequestState) -> None:
        """A request's per-layer generators and pipeline states, at its first event."""
        if st.gens is not None:
            return
        dev, L = self.device, self.L
        st.gens = []
        for i in range(L):
            g = torch.Generator(device=dev)
            g.manual_seed(layer_seed(st.settings.seed, i))
            st.gens.append(g)
        st.states = [st.settings.pipeline.init(LayerSpec(i, L, 1, self.Hg, self.D, self.D, dev, self.dtype))
                     for i in range(L)]
        self.stats.compressed_requests += 1

    def _compress_group(self, group: list, kv_caches: list[Tensor]) -> dict[str, list[int]]:
        dev, bs, D, H, L, Hg = self.device, self.block_size, self.D, self.H, self.L, self.Hg
        s0: Settings = group[0][1].settings
        pipe: Pipeline = s0.pipeline
        if s0.per_layer:
            return self._compress_layers(group[0], kv_caches)
        B, w = s0.budget, s0.query_window
        n = len(group)
        new_rows, blks = [], []
        held = [it[1].held for it in group]
        seen = [it[2] for it in group]
        T, C = max(held), max(seen)
        for rid, st, c, row in group:
            new_rows.append(kept_row(row, c, B, bs))
            need = -(-st.held // bs)
            if len(row) < need:
                raise KVComposeError(f"request {rid} holds {st.held} tokens in {len(row)} blocks of {bs}")
            blks.append(row[:need])
        for kv in kv_caches[1:]:
            if kv.shape != kv_caches[0].shape or kv.stride() != kv_caches[0].stride():
                raise KVComposeError("kvcompose expects every layer's KV cache to have the same shape and strides")
        # slots of every row, right-padded to T with the row's first slot (masked invalid below)
        hv = torch.tensor(held, dtype=torch.long)
        q = torch.arange(T)
        ok = q[None, :] < hv[:, None]  # [n, T]
        width = max(len(b) for b in blks)
        table = torch.tensor([b + [b[0]] * (width - len(b)) for b in blks], dtype=torch.long)  # [n, nb]
        qq = torch.where(ok, q[None, :], 0)
        nbT = -(-T // bs)
        io = _GroupIO(self.layout, kv_caches[0], table[:, :nbT].to(dev), table.gather(1, qq // bs).to(dev),
                      (qq % bs).to(dev), n, H, T, B, D)
        valid = ok.to(dev)[:, None, :].expand(n, Hg, T)
        shift = torch.tensor([C - c for c in seen], dtype=torch.long, device=dev)  # left padding per row
        padded = bool((shift != 0).any())
        sts = [it[1] for it in group]
        for st in sts:
            self._init_request(st)
        kept_pos = torch.empty(n, L, Hg, B, dtype=torch.long, device=dev)
        far = torch.tensor(FAR_POSITION, dtype=torch.long, device=dev)
        ring_idx = None
        wq = min(sts[0].ring_n, w) if sts[0].slot is not None else 0  # the same for every row (`_group_key`)
        if wq:
            ring_idx = torch.stack([self._ring_index(st, wq) for st in sts])  # [n, wq]
        positions = torch.stack([self._all_positions(st, T) for st in sts])  # [n, L, Hg, T] (past held: masked)
        vpositions = torch.where(valid[:, None], positions + shift[:, None, None, None], far)
        self._select_layers(group, kv_caches, pipe, B, T, C, seen, io, valid, shift, padded, sts, ring_idx,
                            positions, vpositions, kept_pos)
        out = {}
        for r, (rid, st, c, row) in enumerate(group):
            st.kept_pos, st.c_event, st.held = kept_pos[r], c, B
            st.events += 1
            self.stats.events += 1
            out[rid] = new_rows[r]
        return out

    def _compress_layers(self, item: tuple, kv_caches: list[Tensor]) -> dict[str, list[int]]:
        """One request's event with per-layer budgets (`Settings.per_layer`): each layer that holds more than
        its own budget keeps that budget, packed into its leading slots (its kept count need not be whole
        blocks: slot by slot); the others are untouched. Then the scheduler's cut (`cut`): blocks are freed by
        the largest layer's bound, which every layer fits in. An exception carries `kvc_written`."""
        rid, st, c, row = item
        dev, bs, D, L, Hg = self.device, self.block_size, self.D, self.L, self.Hg
        s: Settings = st.settings
        pipe = s.pipeline
        tp = self.tp_size > 1
        budgets = s.layer_budgets(L, c)
        self._init_request(st)
        if st.lheld is None:  # the first event since the request (re)started (`restart` clears the head counts too)
            st.lheld = np.full(L, st.held, dtype=np.int64)
            st.lpos, st.lc_event, st.levents = [None] * L, np.zeros(L, dtype=np.int64), np.zeros(L, dtype=np.int64)
        if s.per_head and st.htop is None:
            st.htop, st.hcount = np.zeros(L, dtype=np.int64), np.zeros((L, Hg), dtype=np.int64)
            st.hlimit = np.zeros((L, Hg), dtype=np.int64)
        w = min(st.ring_n, s.query_window) if st.slot is not None else 0
        ring_idx = self._ring_index(st, w) if w else None
        table = torch.tensor(row, dtype=torch.long)
        written = False
        try:
            for i in range(L):
                T, b = int(st.lheld[i]), budgets[i]
                if s.per_head:
                    if self._head_due(st, i, T):
                        written = True
                        self._compress_heads(st, i, b, c, table, ring_idx, kv_caches[i], rid, len(row))
                    continue
                if T <= b:
                    continue
                if len(row) * bs < T:
                    raise KVComposeError(f"request {rid} holds {T} tokens in layer {i} in {len(row)} blocks of {bs}")
                p = torch.arange(T)
                blk, off = table[p // bs].to(dev), (p % bs).to(dev)
                k, v = self.layout.gather(kv_caches[i], blk, off)  # [H, T, D] each
                pos = self._continued(st.lpos[i], int(st.lc_event[i]), T, (Hg,))
                kept, keys, values, st.states[i] = self._select_layer(
                    i, pipe, k[None], v[None], b, None if ring_idx is None else ring_idx[None], 0, st.states[i],
                    positions=pos[None], valid=torch.ones(1, Hg, T, dtype=torch.bool, device=dev),
                    prompt_length=st.prompt_len, seen=c, generator=st.gens[i], event=int(st.levents[i]),
                    cache_budget=s.budget)
                kept = kept[0]  # [Hg, b]
                if bool((kept < 0).any()):
                    raise KVComposeError(f"{pipe!r} kept an invalid token at layer {i}'s budget {b}")
                own = kept[self.heads] if tp else kept
                idx = own[..., None].expand(-1, -1, D)
                written = True
                self.layout.scatter(kv_caches[i], blk[:b], off[:b], keys[0].gather(1, idx), values[0].gather(1, idx))
                st.lpos[i] = pos.gather(1, kept)
                st.lc_event[i], st.lheld[i] = c, b
                st.levents[i] += 1
        except Exception as e:
            e.kvc_written = written
            raise
        new_row = self.cut(st, c, row)
        st.c_event = c
        st.events += 1
        self.stats.events += 1
        return {rid: new_row}

    def _compress_heads(self, st: RequestState, i: int, b: int, c: int, table: Tensor, ring_idx: Tensor | None,
                        kv: Tensor, rid: str, nblocks: int) -> None:
        """Layer `i`'s event when its KV heads keep their own counts (`Settings.per_head`). The held tokens of
        every head are read in `KVComposeCache`'s ragged order (the kept ones, then the newer ones, then padding
        slots: zeros at `FAR_POSITION + t`, invalid), the pipeline selects, and each head's kept tokens are packed
        into its leading slots; the layer's newer tokens then start at the largest head's count (`htop`)."""
        dev, bs, D, Hg = self.device, self.block_size, self.D, self.Hg
        s = st.settings
        T = int(st.lheld[i])
        if nblocks * bs < T:
            raise KVComposeError(f"request {rid} holds {T} tokens in layer {i} in {nblocks} blocks of {bs}")
        p = torch.arange(T)
        blk, off = table[p // bs].to(dev), (p % bs).to(dev)
        k, v = self.layout.gather(kv, blk, off)  # [H, T, D]: this rank's heads, physical slots
        pos = self._continued(st.lpos[i], int(st.lc_event[i]), T, (Hg,))  # [Hg, T]
        top = int(st.htop[i])
        slot = torch.arange(T, device=dev)
        if top:  # head h holds slots [0, hcount) and [top, T)
            cnt = torch.from_numpy(st.hcount[i]).to(dev)
            ok = (slot[None] < cnt[:, None]) | (slot[None] >= top)
            order = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices  # the held slots first
            n_ok = st.hcount[i] + (T - top)
            width = int(n_ok.max())
            order = order[:, :width]
            inside = torch.arange(width, device=dev)[None] < torch.from_numpy(n_ok).to(dev)[:, None]
        else:
            width, order = T, slot.expand(Hg, T)
            inside = torch.ones(Hg, T, dtype=torch.bool, device=dev)
        mine = order[self.heads] if self.tp_size > 1 else order
        idx = mine[..., None].expand(-1, -1, D)
        zero = torch.zeros((), dtype=k.dtype, device=dev)
        mask = (inside[self.heads] if self.tp_size > 1 else inside)[..., None]
        keys = torch.where(mask, k.gather(1, idx), zero)
        values = torch.where(mask, v.gather(1, idx), zero)
        far = FAR_POSITION + torch.arange(width, device=dev)
        vpos = torch.where(inside, pos.gather(1, order), far[None])
        kept, keys, values, st.states[i] = self._select_layer(
            i, s.pipeline, keys[None], values[None], b, None if ring_idx is None else ring_idx[None], 0, st.states[i],
            ragged=True, positions=vpos[None], valid=inside[None], prompt_length=st.prompt_len, seen=c,
            generator=st.gens[i], event=int(st.levents[i]), cache_budget=s.budget)
        kept = kept[0]  # [Hg, K], ascending, -1 padded
        kc = kept.clamp(min=0)
        ok_kept = (kept >= 0) & inside.gather(1, kc)  # a head given more than it holds keeps what it holds
        counts = ok_kept.sum(1).cpu().numpy().astype(np.int64)
        K = int(counts.max())
        kc, ok_kept = kc[:, :K], ok_kept[:, :K]  # the real picks come first (padding slots sort after them)
        bound = s.held_bound(self.L, bs, Hg)
        if K > min(bound, nblocks * bs):
            raise KVComposeError(f"{s.pipeline!r} kept {K} tokens in one head of layer {i}, more than the {bound} "
                                 "the scheduler keeps blocks for")
        own = kc[self.heads] if self.tp_size > 1 else kc
        gi = own[..., None].expand(-1, -1, D)
        self.layout.scatter(kv, blk[:K], off[:K], keys[0].gather(1, gi), values[0].gather(1, gi))
        st.lpos[i] = torch.where(ok_kept, vpos.gather(1, kc), -1)
        st.hcount[i], st.hlimit[i], st.htop[i] = counts, self.last_budget[0], K
        st.lc_event[i], st.lheld[i] = c, K
        st.levents[i] += 1

    def _ring_queries(self, i: int, ring_idx: Tensor | None, shift: Any) -> tuple[Tensor | None, Tensor | None,
                                                                            Tensor | None]:
        """Layer `i`'s recorded queries of `n` requests for their `LayerView` (`ring_idx`: `[n, w]` flat ring
        indices, None for none): queries `[n, Hq, w, D]` (every head under tensor parallelism), their positions
        `[w]` (shifted by `shift`) and validity `[n, w]`."""
        if ring_idx is None:
            return None, None, None
        n, w = ring_idx.shape
        qs = self.ring[i].index_select(0, ring_idx.reshape(-1)).view(n, -1, self.Hq, self.D).transpose(1, 2)
        if self.tp_size > 1:
            qs = self.gather(qs.contiguous(), 1)
        qpos = self.ring_pos.index_select(0, ring_idx[0]) + shift
        return qs, qpos, torch.ones(n, w, dtype=torch.bool, device=self.device)

    def _select_layer(self, i: int, pipe: Pipeline, keys: Tensor, values: Tensor, budget: int, ring_idx: Tensor | None,
                      shift: Any, state: Any, ragged: bool = False, **view: Any) -> tuple[Tensor, Tensor, Tensor, Any]:
        """Layer `i`'s selection for `n` rows, what both events share: every head gathered under tensor
        parallelism (rank order = the model's head order), the recorded queries, one `Pipeline.select` over a
        `LayerView` (`view`: its other fields), the merged values of a `Merger`, the count checked. `keys`,
        `values`: `[n, H, T, D]` (this rank's heads). Returns `kept` `[n, Hg, budget]` (every head; -1 marks an
        invalid pick, checked by the caller), this rank's keys and values to pack from, and the new state. With
        `ragged` (heads keep their own counts) `kept` is `[n, Hg, K]`, -1 padded, and `self.last_budget` holds
        the heads' budgets `[n, Hg]` on the host."""
        tp = self.tp_size > 1
        if tp:
            keys, values = self.gather(keys, 1), self.gather(values, 1)
        qs, qpos, qv = self._ring_queries(i, ring_idx, shift)
        sel, state = pipe.select(LayerView(layer_idx=i, num_layers=self.L, keys=keys, values=values, queries=qs,
                                           query_positions=qpos, query_valid=qv, scale=self.scales[i], rows=None,
                                           **view), budget, state)
        if sel.values is not None:  # a Merger: the kept tokens take the merged values (keys never change)
            values = sel.values
        if ragged:
            hb = sel.host_budget
            self.last_budget = np.asarray(hb if hb is not None else sel.budget.cpu().numpy(), dtype=np.int64)
        elif sel.kept.shape[-1] != budget:
            raise KVComposeError(f"{pipe!r} kept {sel.kept.shape[-1]} tokens per head at layer {i}'s budget {budget}; "
                                 "the vLLM route needs exactly the budget (the scheduler frees blocks by that count)")
        if tp:  # this rank packs its own heads
            keys, values = keys[:, self.heads], values[:, self.heads]
        return sel.kept, keys, values, state

    def _select_layers(self, group, kv_caches, pipe, B, T, C, seen, io, valid, shift, padded, sts, ring_idx,
                       positions, vpositions, kept_pos) -> None:
        """The per-layer part of `_compress_group` (one `Pipeline.select` per layer for the group's rows). An
        exception carries `kvc_written`: whether the cache was written (if not, the requests can run alone)."""
        dev, L = self.device, self.L
        tp = self.tp_size > 1
        n = len(group)
        alone = n == 1
        bad = torch.zeros((), dtype=torch.bool, device=dev)
        written = False
        try:
            for i in range(L):
                keys, values = io.load(kv_caches[i])  # [n, H, T, D]
                pos, vpos = positions[:, i], vpositions[:, i]  # [n, Hg, T]: logical, and the view's
                kept, keys, values, state = self._select_layer(
                    i, pipe, keys, values, B, ring_idx, shift[0], sts[0].states[i] if alone else None,
                    positions=vpos, valid=valid, prompt_length=sts[0].prompt_len + C - seen[0], seen=C,
                    generator=sts[0].gens[i] if alone else RowGenerators(st.gens[i] for st in sts),
                    event=sts[0].events, cache_budget=B, padding=shift if padded else None)
                if alone:
                    sts[0].states[i] = state
                bad |= (kept < 0).any()
                kc = kept.clamp(min=0)
                own = kc[:, self.heads] if tp else kc
                written = True
                io.store_kept(kv_caches[i], own, keys, values)
                kept_pos[:, i] = pos.gather(2, kc)
            if bool(bad):  # one host sync per group's event, not per layer
                raise KVComposeError(f"{pipe!r} kept fewer than {B} tokens in some head (padded selection)")
        except Exception as e:
            e.kvc_written = written
            raise

    # -- the step ---------------------------------------------------------------------------------
    def plan(self, batch: list[tuple[str, int, int]]) -> StepPlan:
        """The step's plan from its batch, in row order: `(req_id, num_computed_tokens, scheduled tokens)`."""
        return self.plan_arrays([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])

    def plan_arrays(self, ids: list[str], computed, scheduled) -> StepPlan:
        """`plan` from the batch's columns (`computed`: vLLM's `num_computed_tokens` per row, a list or int
        array; `scheduled`: tokens per row): one pass over the rows for their held counts and ring slots, then
        the per-token tensors built at once (no tensor per row)."""
        R = len(ids)
        c = np.asarray(computed, dtype=np.int64)[:R]
        n = np.asarray(scheduled, dtype=np.int64)
        reqs = self.requests
        sts = [reqs.get(rid) for rid in ids]
        held = np.fromiter((ci if st is None else st.held for st, ci in zip(sts, c.tolist())), dtype=np.int64,
                           count=R)
        lrows = [r for r, st in enumerate(sts) if st is not None and st.lheld is not None]
        physical = bool(lrows) or bool((held != c).any())
        t = int(n.sum())
        plan = StepPlan(physical=physical, num_tokens=t)
        dev = self.device
        starts = np.cumsum(n) - n
        if physical:
            tok_row = np.repeat(np.arange(R), n)
            within = np.arange(t) - starts[tok_row]
            plan.tok_row = torch.from_numpy(tok_row).to(dev, non_blocking=True)
            if lrows:  # per-layer counts: one class of layers per distinct column of counts
                counts = np.repeat(held[:, None], self.L, axis=1)
                for r in lrows:
                    counts[r] = sts[r].lheld
                cols, inv = np.unique(counts, axis=1, return_inverse=True)
                plan.layer_class = np.asarray(inv).reshape(-1)
                plan.class_phys, plan.class_seq_lens = [], []
                for k in range(cols.shape[1]):
                    hk = cols[:, k]
                    plan.class_phys.append(torch.from_numpy(hk[tok_row] + within).to(dev, non_blocking=True))
                    seq = torch.from_numpy((hk + n).astype(np.int32))
                    plan.class_seq_lens.append((seq.to(dev, non_blocking=True), seq, int(seq.max())))
                held = cols[:, plan.layer_class[0]]
                plan.tok_phys = plan.class_phys[plan.layer_class[0]]
                hrows = [r for r in lrows if sts[r].htop is not None and sts[r].htop.any()]
                if hrows:
                    plan.head_rows = self._head_rows(sts, hrows, starts, n)
            else:
                plan.tok_phys = torch.from_numpy(held[tok_row] + within).to(dev, non_blocking=True)
            seq = held + n
            plan.seq_lens_cpu = torch.from_numpy(seq.astype(np.int32))
            plan.seq_lens = plan.seq_lens_cpu.to(dev, non_blocking=True)
            plan.max_seq_len = int(seq.max())
        if self.W > 0:
            ring_rows, slots, heads = [], [], []
            for r, st in enumerate(sts):
                if st is None or st.settings.query_window <= 0:
                    continue
                if st.slot is None:
                    if self.free_slots:
                        st.slot = self.free_slots.pop()
                    else:
                        if not st.failed:  # never expected (one slot per running request): this request alone fails
                            self.fail(ids[r], f"kvcompose: the query ring's {self.S} slots are all in use")
                        continue
                m = min(int(n[r]), self.W)
                ring_rows.append(r)
                slots.append(st.slot)
                heads.append(st.ring_head)
                st.ring_head = (st.ring_head + m) % self.W
                st.ring_n = min(st.ring_n + m, self.W)
            if ring_rows:
                rr = np.asarray(ring_rows)
                m = np.minimum(n[rr], self.W)
                row_of = np.repeat(np.arange(len(rr)), m)
                i = np.arange(int(m.sum())) - (np.cumsum(m) - m)[row_of]
                src = (starts[rr] + n[rr] - m)[row_of] + i
                dst = np.asarray(slots)[row_of] * self.W + (np.asarray(heads)[row_of] + i) % self.W
                pos = (c[rr] + n[rr] - m)[row_of] + i
                self._ensure_ring()
                plan.ring_src = torch.from_numpy(src).to(dev, non_blocking=True)
                plan.ring_dst = torch.from_numpy(dst).to(dev, non_blocking=True)
                self.ring_pos.index_copy_(0, plan.ring_dst, torch.from_numpy(pos).to(dev, non_blocking=True))
        self.step = plan
        return plan

    def slots(self, block_table: Tensor, slot_mapping: Tensor, phys: Tensor | None = None) -> None:
        """Rewrite the step's slot mapping in place from physical positions (`phys`, default the plan's
        `tok_phys`): `slot = table[row, p // bs] * bs + p % bs` (vLLM's own formula, on the held count instead
        of the logical one)."""
        plan = self.step
        n, bs = plan.num_tokens, self.block_size
        p = plan.tok_phys if phys is None else phys
        blk = block_table[plan.tok_row, p // bs].to(torch.long)
        slot_mapping[:n].copy_(blk * bs + p % bs)

    def _head_rows(self, sts: list, rows: list[int], starts: np.ndarray, n: np.ndarray) -> dict[str, Any]:
        """What `head_attention` reads, for the batch rows `rows` whose heads hold their own counts, built once per
        step: their tokens (`tok` `[M]` batch token index, `tok_row` `[M]` index into `rows`, `tok_j` `[M]` index
        among the row's tokens), and per layer their held counts `held` `[L, R]`, where the newer tokens start
        `top` `[L, R]` and each head's kept count `cnt` `[L, R, H]` (this rank's heads)."""
        dev = self.device
        rr = np.asarray(rows)
        m = n[rr]
        tok_row = np.repeat(np.arange(len(rr)), m)
        tok_j = np.arange(int(m.sum())) - (np.cumsum(m) - m)[tok_row]
        held = np.stack([sts[r].lheld for r in rows], axis=1)  # [L, R]
        top = np.stack([sts[r].htop for r in rows], axis=1)
        cnt = np.stack([sts[r].hcount for r in rows], axis=1)[..., self.heads]  # [L, R, H]
        t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(dev, non_blocking=True)  # noqa: E731
        return {"rows": t(rr), "tok": t(starts[rr][tok_row] + tok_j), "tok_row": t(tok_row), "tok_j": t(tok_j),
                "held": t(held), "top": t(top), "cnt": t(cnt), "width": (held.max(1) + int(m.max())).tolist(),
                "active": top.any(1).tolist()}

    def head_attention(self, layer_idx: int, query: Tensor, kv: Tensor, output: Tensor) -> None:
        """Attention of this step's rows whose KV heads hold their own counts, in layer `layer_idx`, written over
        what vLLM's kernel wrote for them (it reads one length for every head: the slots between a head's kept
        tokens and the layer's newer ones are masked here). `query`: `[N, Hq, D]` (post-RoPE, this rank's
        heads); `kv`: the layer's cache, this step's keys and values already written; `output`: `[N, Hq * D]`
        or `[N, Hq, D]`. PyTorch's SDPA with a mask (float accumulation); no sliding window, soft-capping or
        sinks (`per_head_refused`)."""
        plan = self.step
        hr = None if plan is None else plan.head_rows
        if hr is None or not hr["active"][layer_idx]:
            return
        i, bs, D, H, Hq = layer_idx, self.block_size, self.D, self.H, self.Hq
        G = Hq // H
        dev = kv.device
        t0 = time.perf_counter()
        R, nb = hr["rows"].shape[0], -(-hr["width"][i] // bs)
        T = nb * bs
        p = torch.arange(T, device=dev)
        blk = plan.block_table[hr["rows"], :nb].to(torch.long)  # [R, nb] (past a row's count: masked)
        k, v = self.layout.gather_blocks(kv, blk.reshape(-1))  # [R * nb, H, bs, D] (views)
        k = k.view(R, nb, H, bs, D).transpose(1, 2).reshape(R, H, T, D)
        v = v.view(R, nb, H, bs, D).transpose(1, 2).reshape(R, H, T, D)
        tr, held, top = hr["tok_row"], hr["held"][i], hr["top"][i]  # [M], [R], [R]
        cnt = hr["cnt"][i]  # [R, H]
        last = (held[tr] + hr["tok_j"])[:, None, None]  # [M, 1, 1]: each query's own slot (causal)
        pt = p[None, None]
        see = torch.where((top[tr] > 0)[:, None, None],
                          (pt < cnt[tr][:, :, None]) | ((pt >= top[tr][:, None, None]) & (pt <= last)),
                          pt <= last)  # [M, H, T]: the head's kept tokens and the layer's newer ones
        M = tr.shape[0]
        if M != R:  # a row with several tokens: its keys once per token
            k, v = k.index_select(0, tr), v.index_select(0, tr)
        q = query.index_select(0, hr["tok"]).view(M, Hq, 1, D).to(k.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=see.repeat_interleave(G, 1)[:, :, None], scale=self.scales[i], enable_gqa=True)
        out = output.view(output.shape[0], Hq, D)
        out.index_copy_(0, hr["tok"], o.view(M, Hq, D).to(out.dtype))
        self.stats.head_seconds += time.perf_counter() - t0

    def layer_slots(self, layer_idx: int) -> Tensor | None:
        """The slot mapping of one layer at this step when layers hold their own counts (None: the step's)."""
        plan = self.step
        if plan is None or plan.class_slots is None:
            return None
        return plan.class_slots[plan.layer_class[layer_idx]]

    def layer_metadata(self, layer_idx: int) -> Any:
        """The attention metadata of one layer at this step when layers hold their own counts (None: the
        step's)."""
        plan = self.step
        if plan is None or plan.class_meta is None:
            return None
        return plan.class_meta[plan.layer_class[layer_idx]]
