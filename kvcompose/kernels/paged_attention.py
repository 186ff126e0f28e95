"""Paged decode attention over unequal per-head lengths (ragged paged KV storage).

Each (batch row b, KV head h) owns its own list of fixed-size pages in one pool per layer::

    pool_keys      [N, P, D]     pool_values [N, P, Dv]
    pool_positions [N, P]        original token index of every slot
    pool_valid     [N, P]        False = padding token
    page_table     [B, H, M]     page ids of (b, h); logical token t lives in page
                                 page_table[b, h, t // P], slot t % P
    lengths        [B, H]        tokens held by (b, h); only t < lengths[b, h] exist

The attention of the new queries ``query[B, Hq, Q, D]`` (Hq = G * H, query head
``h * G + g`` reads KV head ``h``) at positions ``query_positions[Q]`` attends, per
(b, h), over the head's own tokens t < lengths[b, h] where::

    allowed = (key_pos <= query_pos and valid [and key_pos > query_pos - sliding_window])
              or key_pos == query_pos

which is ``kvcompose.attention.build_mask`` (a query always sees its own key, so a
padding query never gets an empty row).  Output ``[B, Q, Hq, Dv]`` in the query dtype,
the layout of ``kvcompose.attention.attend``.  A (row, query) with no allowed key gets 0.

Triton path (flash-decoding, FlashAttention-2 style online softmax, arXiv 2307.08691):
one program per (b, KV head, tile of the G * Q folded query rows[, KV split]); the G
query heads of a KV head share every K/V tile it loads (GQA folded, no repeat).  The
program walks the head's logical tokens in blocks of ``BLOCK_N`` (gathering slots
through the page table, so any page size works, also P < 16), with fp32 running
max / sum / accumulator.  With ``num_splits > 1`` each head's tokens are cut into that
many contiguous chunks processed by separate programs (more parallelism at batch 1);
their partial (max, sum, accumulator) are merged with a few torch ops.

Reference path (CPU, and the oracle of the tests): gather each head's pages into a
padded ``[B, H, T, D]`` view and run masked SDPA with the query group folded, exactly
as ``kvcompose.attention.attend`` over ``build_mask``.
"""

import math
from typing import Optional, no_type_check

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from . import _checks as C
from .dispatch import HAS_TRITON, TRITON_INTERPRETED, launch, multiprocessor_count, select_backend

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "gather_pages"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    @no_type_check
    def _paged_decode_kernel(
        q, kp, vp, posp, okp, pt, lens, qpos, out, m_part, l_part, acc_part,
        H, G, Q, R, D, DV, P, S, scale, window,
        q_b, q_h, q_q, q_d,
        k_n, k_p, k_d,
        v_n, v_p, v_d,
        pos_n, pos_p, ok_n, ok_p,
        pt_b, pt_h, pt_m, len_b, len_h, qp_q,
        o_b, o_q, o_h, o_d,
        HAS_WINDOW: tl.constexpr, ONE_SPLIT: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        # Grid (B*H, cdiv(R, BLOCK_R), S); R = G*Q folded rows, row r -> (g = r // Q, q = r % Q).
        pid_bh = tl.program_id(0)
        pid_r = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)

        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = offs_r < R
        g = offs_r // Q
        qi = offs_r % Q
        offs_d = tl.arange(0, BLOCK_D)
        dm = offs_d < D
        offs_dv = tl.arange(0, BLOCK_DV)
        dvm = offs_dv < DV

        qptr = q + b * q_b + (h * G + g).to(tl.int64)[:, None] * q_h + qi[:, None] * q_q + offs_d[None, :] * q_d
        qv = tl.load(qptr, mask=rm[:, None] & dm[None, :], other=0.0)
        if UPCAST:
            qv = qv.to(tl.float32)
        qp = tl.load(qpos + qi * qp_q, mask=rm, other=0)  # [BLOCK_R] int64

        n_tok = tl.load(lens + b * len_b + h * len_h)
        # this program's chunk of the head's logical tokens (whole BLOCK_N blocks)
        n_blk = tl.cdiv(n_tok, BLOCK_N)
        per = tl.cdiv(n_blk, S)
        t_lo = pid_s * per * BLOCK_N
        t_hi = tl.minimum((pid_s + 1) * per * BLOCK_N, n_tok)

        m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
        pt_row = pt + b * pt_b + h * pt_h
        for t0 in range(t_lo, t_hi, BLOCK_N):
            offs_t = t0 + tl.arange(0, BLOCK_N)
            tm = offs_t < t_hi
            page = tl.load(pt_row + (offs_t // P) * pt_m, mask=tm, other=0).to(tl.int64)
            slot = offs_t % P
            kt = tl.load(kp + page[None, :] * k_n + slot[None, :] * k_p + offs_d[:, None] * k_d,
                         mask=dm[:, None] & tm[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
            vt = tl.load(vp + page[:, None] * v_n + slot[:, None] * v_p + offs_dv[None, :] * v_d,
                         mask=tm[:, None] & dvm[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
            kpos = tl.load(posp + page * pos_n + slot * pos_p, mask=tm, other=0)
            kok = tl.load(okp + page * ok_n + slot * ok_p, mask=tm, other=0) != 0
            if UPCAST:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            s = tl.dot(qv, kt, input_precision=PRECISION) * scale  # [BLOCK_R, BLOCK_N] fp32
            allowed = (kpos[None, :] <= qp[:, None]) & kok[None, :]
            if HAS_WINDOW:
                allowed = allowed & (kpos[None, :] > qp[:, None] - window)
            allowed = (allowed | (kpos[None, :] == qp[:, None])) & tm[None, :] & rm[:, None]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.where(allowed, tl.exp(s - m_use[:, None]), 0.0)
            alpha = tl.exp(m_i - m_use)  # m_i = -inf -> 0
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            m_i = m_new

        if ONE_SPLIT:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            optr = (out + b * o_b + qi.to(tl.int64)[:, None] * o_q + (h * G + g).to(tl.int64)[:, None] * o_h
                    + offs_dv[None, :] * o_d)
            tl.store(optr, o, mask=rm[:, None] & dvm[None, :])
        else:
            row = (pid_s * tl.num_programs(0) + pid_bh).to(tl.int64) * R + offs_r  # [S, B*H, R]
            tl.store(m_part + row, m_i, mask=rm)
            tl.store(l_part + row, l_i, mask=rm)
            tl.store(acc_part + row[:, None] * DV + offs_dv[None, :], acc, mask=rm[:, None] & dvm[None, :])


# ============================================================================ reference
def gather_pages(
    pool: Tensor, page_table: Tensor, lengths: Tensor, T: int, fill: object = 0
) -> tuple[Tensor, Tensor]:
    """Padded ``[B, H, T, ...]`` view of a pool ``[N, P, ...]`` through ``page_table``
    [B, H, M] and ``lengths`` [B, H]; slots ``t >= lengths[b, h]`` hold ``fill``.
    Returns ``(view, inside)`` with ``inside`` Bool [B, H, T]."""
    B, H, M = page_table.shape
    P = pool.shape[1]
    t = torch.arange(T, device=pool.device)
    inside = t < lengths[..., None]  # [B, H, T]
    if M == 0 or T == 0:
        view = pool.new_full((B, H, T, *pool.shape[2:]), fill)
        return view, inside & False
    col = (t // P).clamp(max=M - 1).expand(B, H, T)
    page = torch.where(inside, page_table.gather(-1, col), torch.zeros_like(col))
    slot = page.long() * P + (t % P)
    flat = pool.reshape(-1, *pool.shape[2:])
    view = flat[slot.reshape(-1)].view(B, H, T, *pool.shape[2:])
    keep = inside.view(B, H, T, *([1] * (pool.dim() - 2)))
    return torch.where(keep, view, torch.full_like(view, fill)), inside


def paged_decode_attention_reference(
    query: Tensor,
    pool_keys: Tensor,
    pool_values: Tensor,
    pool_positions: Tensor,
    pool_valid: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    query_positions: Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
) -> Tensor:
    """The PyTorch path: gather the pages to a padded view, masked SDPA (query group folded).

    Same arithmetic as ``kvcompose.attention.attend(query, keys, values,
    build_mask(pos, valid, query_positions, sliding_window), scale)`` over the padded
    view, with padding slots masked out; rows with no allowed key are 0."""
    B, Hq, Q, D = query.shape
    H = page_table.shape[1]
    G = Hq // H
    Dv = pool_values.shape[-1]
    T = int(lengths.max()) if lengths.numel() else 0
    if B * Hq * Q == 0 or T == 0:
        return query.new_zeros((B, Q, Hq, Dv))
    keys, inside = gather_pages(pool_keys, page_table, lengths, T)
    values, _ = gather_pages(pool_values, page_table, lengths, T)
    pos, _ = gather_pages(pool_positions, page_table, lengths, T)
    valid, _ = gather_pages(pool_valid, page_table, lengths, T, False)
    kp = pos[:, :, None, :]
    qp = query_positions.to(pos.dtype)[None, None, :, None]
    mask = (kp <= qp) & valid[:, :, None, :]
    if sliding_window is not None:
        mask &= kp > qp - sliding_window
    mask = (mask | (kp == qp)) & inside[:, :, None, :]  # [B, H, Q, T]
    qg = query.reshape(B, H, G * Q, D)
    m = mask[:, :, None].expand(B, H, G, Q, T).reshape(B, H, G * Q, T)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=m, scale=scale)
    out = torch.where(m.any(-1, keepdim=True), out, torch.zeros_like(out))  # empty rows: 0 on every backend
    return out.reshape(B, Hq, Q, Dv).transpose(1, 2)


# ============================================================================ public
_FLOAT = "a float tensor (fp16/bf16/fp32)"


#: Tokens a KV split holds at least (automatic splits).
MIN_SPLIT_TOKENS = 256
#: Query rows (G * Q folded) per program: the tensor-core tile's M; more rows take more programs.
BLOCK_R = 16


def decode_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` of the paged kernel for a head dim (the larger of the key's and
    the value's) and a dtype, chosen from the compiled kernels' resource use (``kvcompose.bench.aot``:
    no spill and at most 128 registers per thread at 4 warps on sm_80 and sm_90). The K^T and V tiles are
    gathered through the page table, so every element carries its own address: the tile width is what
    registers allow. fp32 inputs (exact fp32 products on CUDA cores) use one stage."""
    bd = max(16, triton.next_power_of_2(head_dim)) if HAS_TRITON else head_dim
    wide = 4 if bd <= 128 else 8
    if dtype == torch.float32:
        return 16, wide, 1
    return (32 if bd <= 64 else 16), wide, 2


def _auto_splits(device: torch.device, programs: int, max_tokens: int) -> int:
    """KV splits so that about two waves of programs fill the GPU, each split at least
    ``MIN_SPLIT_TOKENS`` tokens; 1 under the interpreter (every program costs ~1 ms there)."""
    if device.type != "cuda" or TRITON_INTERPRETED:
        return 1
    sms = multiprocessor_count(device)
    want = math.ceil(2 * sms / max(1, programs))
    cap = max(1, max_tokens // MIN_SPLIT_TOKENS)
    return int(max(1, min(want, cap, 64)))


def paged_decode_attention(
    query: Float[Tensor, "B Hq Q D"],
    pool_keys: Float[Tensor, "N P D"],
    pool_values: Float[Tensor, "N P Dv"],
    pool_positions: Int[Tensor, "N P"],
    pool_valid: Bool[Tensor, "N P"],
    page_table: Int[Tensor, "B H M"],
    lengths: Int[Tensor, "B H"],
    query_positions: Int[Tensor, " Q"],
    scale: float,
    sliding_window: Optional[int] = None,
    *,
    num_splits: Optional[int] = None,
    check_indices: bool = True,
) -> Float[Tensor, "B Q Hq Dv"]:
    """Attention of ``query`` over each (row, KV head)'s own paged tokens -> ``[B, Q, Hq, Dv]``.

    Args:
        query: ``[B, Hq, Q, D]`` (post-RoPE), Hq a multiple of H; fp16/bf16/fp32, the
            dtype of ``pool_keys`` and ``pool_values``.
        pool_keys / pool_values: ``[N, P, D]`` / ``[N, P, Dv]`` pages (any strides).
        pool_positions: integer ``[N, P]`` original position of each slot.
        pool_valid: Bool ``[N, P]`` (False = padding token).
        page_table: integer ``[B, H, M]`` page ids (entries past a head's pages are ignored).
        lengths: integer ``[B, H]`` tokens held per (row, KV head), ``<= M * P``.
        query_positions: integer ``[Q]`` positions of the new queries.
        scale: softmax scale; sliding_window: optional window (keys with
            ``key_pos <= query_pos - sliding_window`` are masked).
        num_splits: Triton path only: KV chunks per head processed by separate programs
            (None = automatic: enough programs for the GPU, 1 under the interpreter).
        check_indices: validate lengths and the used page ids (one device->host sync);
            hot loops that guarantee them may pass False (bad ids are then undefined
            behaviour on the Triton path).

    Masking is ``kvcompose.attention.build_mask`` restricted to ``t < lengths[b, h]``
    (see the module docstring); a query with no allowed key gets 0.  Softmax statistics
    and the accumulator are fp32 on both paths; the output has the query dtype.
    """
    op = "paged_decode_attention"
    C.tensor(op, "query", query, "B Hq Q D", C.FLOAT_DTYPES, _FLOAT)
    C.tensor(op, "pool_keys", pool_keys, "N P D", C.FLOAT_DTYPES, _FLOAT)
    C.tensor(op, "pool_values", pool_values, "N P Dv", C.FLOAT_DTYPES, _FLOAT)
    C.tensor(op, "pool_positions", pool_positions, "N P", C.INT_DTYPES, "an integer tensor")
    C.tensor(op, "pool_valid", pool_valid, "N P", (torch.bool,), "a bool tensor")
    C.tensor(op, "page_table", page_table, "B H M", C.INT_DTYPES, "an integer tensor")
    C.tensor(op, "lengths", lengths, "B H", C.INT_DTYPES, "an integer tensor")
    C.tensor(op, "query_positions", query_positions, "Q", C.INT_DTYPES, "an integer tensor")
    B, Hq, Q, D = query.shape
    N, P, Dk = pool_keys.shape
    _, H, M = page_table.shape
    Dv = pool_values.shape[-1]
    if Dk != D:
        raise ValueError(f"{op}: pool_keys [N, P, D] must have D={D} like query, got {tuple(pool_keys.shape)}")
    C.shape(op, "pool_values", pool_values, (N, P, Dv), "N P Dv")
    C.shape(op, "pool_positions", pool_positions, (N, P), "N P")
    C.shape(op, "pool_valid", pool_valid, (N, P), "N P")
    if page_table.shape[0] != B:
        raise ValueError(f"{op}: page_table [B, H, M] must have B={B} like query, got {tuple(page_table.shape)}")
    C.shape(op, "lengths", lengths, (B, H), "B H")
    C.shape(op, "query_positions", query_positions, (Q,), "Q")
    if H == 0 or Hq % H != 0:
        raise ValueError(f"{op}: query heads Hq={Hq} must be a positive multiple of kv heads H={H}")
    if not (query.dtype == pool_keys.dtype == pool_values.dtype):
        raise ValueError(
            f"{op}: query, pool_keys and pool_values must share one dtype, got "
            f"{query.dtype}, {pool_keys.dtype}, {pool_values.dtype}"
        )
    C.same_device(op, query=query, pool_keys=pool_keys, pool_values=pool_values, pool_positions=pool_positions,
                  pool_valid=pool_valid, page_table=page_table, lengths=lengths, query_positions=query_positions)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be a finite float, got {scale!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0
    ):
        raise ValueError(f"{op}: sliding_window must be None or a positive int, got {sliding_window!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"{op}: num_splits must be None or a positive int, got {num_splits!r}")
    if check_indices and lengths.numel():
        if bool(((lengths < 0) | (lengths > M * P)).any()):
            raise ValueError(f"{op}: lengths must satisfy 0 <= lengths <= M * P = {M * P}")
        if M:
            used = torch.arange(M, device=page_table.device) * P < lengths[..., None]  # [B, H, M]
            ids = page_table[used]
            if bool(((ids < 0) | (ids >= N)).any()):
                raise ValueError(f"{op}: page_table ids of the pages in use must be in [0, N={N})")

    backend = select_backend(query, pool_keys, pool_values, pool_positions, pool_valid, page_table, lengths,
                             query_positions)
    if backend == "reference" or B * Hq * Q == 0 or M == 0 or N == 0:
        return paged_decode_attention_reference(query, pool_keys, pool_values, pool_positions, pool_valid,
                                                page_table, lengths, query_positions, float(scale), sliding_window)
    return _paged_triton(query, pool_keys, pool_values, pool_positions, pool_valid, page_table, lengths,
                         query_positions, float(scale), sliding_window, num_splits)


def _paged_triton(query, keys, values, positions, valid, page_table, lengths, qpos, scale, window, num_splits):
    B, Hq, Q, D = query.shape
    N, P, _ = keys.shape
    H, M = page_table.shape[1], page_table.shape[2]
    Dv = values.shape[-1]
    G = Hq // H
    R = G * Q
    dev = query.device
    BLOCK_N, num_warps, num_stages = decode_config(max(D, Dv), query.dtype)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_DV = max(16, triton.next_power_of_2(Dv))
    n_rt = triton.cdiv(R, BLOCK_R)
    S = num_splits if num_splits is not None else _auto_splits(dev, B * H * n_rt, M * P)
    one = S == 1
    # the interpreter truncates fp32 -> 16-bit stores where torch rounds: store fp32 there, cast with torch
    out_dtype = torch.float32 if TRITON_INTERPRETED else query.dtype
    out = torch.empty((B, Q, Hq, Dv), dtype=out_dtype, device=dev)
    if one:
        m_part = l_part = acc_part = out  # unused
    else:
        m_part = torch.empty((S, B * H, R), dtype=torch.float32, device=dev)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((S, B * H, R, Dv), dtype=torch.float32, device=dev)
    ok8 = valid.view(torch.uint8)
    grid = (B * H, n_rt, S)
    launch(
        _paged_decode_kernel, grid,
        query, keys, values, positions, ok8, page_table, lengths, qpos, out, m_part, l_part, acc_part,
        H, G, Q, R, D, Dv, P, S, scale, int(window) if window is not None else 0,
        *query.stride(), *keys.stride(), *values.stride(), *positions.stride(), *ok8.stride(),
        *page_table.stride(), *lengths.stride(), qpos.stride(0), *out.stride(),
        HAS_WINDOW=window is not None, ONE_SPLIT=one,
        # the interpreter mis-handles 16-bit arithmetic: upcast there; on GPU 16-bit inputs use
        # tensor cores (fp32 accumulation), fp32 inputs exact fp32 products
        UPCAST=TRITON_INTERPRETED,
        PRECISION="ieee" if (query.dtype == torch.float32 or TRITON_INTERPRETED) else "tf32",
        BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not one:
        # merge the splits: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)
        mx = m_part.amax(0)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        w = torch.exp(m_part - mx)  # -inf (empty split) -> 0
        den = (l_part * w).sum(0)
        num = (acc_part * w[..., None]).sum(0)  # [B*H, R, Dv]
        o = num / torch.where(den > 0, den, torch.ones_like(den))[..., None]
        o = o.view(B, H, G, Q, Dv).permute(0, 3, 1, 2, 4).reshape(B, Q, Hq, Dv)
        return o.to(query.dtype)
    return out.to(query.dtype)
