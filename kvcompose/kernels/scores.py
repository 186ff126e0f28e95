"""Token-importance scoring kernels: value magnitude (VaSE), key redundancy (R-KV,
arXiv 2505.24133) and observation-window attention scores (SnapKV arXiv 2404.14469,
R-KV, VaSE)."""

import math
from typing import Optional, no_type_check

import torch
from jaxtyping import Bool, Float, Float32, Int
from torch import Tensor

from . import _checks as C
from . import ref
from .dispatch import HAS_TRITON, TRITON_INTERPRETED, launch, select_backend

if HAS_TRITON:
    import triton
    import triton.language as tl

    # ------------------------------------------------------------------ value magnitude
    @triton.jit
    @no_type_check
    def _value_magnitude_kernel(
        v, out, H, T, D, s_b, s_h, s_t, s_d,
        L2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        pid_t = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, BLOCK_D)
        tm = offs_t < T
        m = tm[:, None] & (offs_d < D)[None, :]
        ptr = v + b * s_b + h * s_h + offs_t[:, None].to(tl.int64) * s_t + offs_d[None, :] * s_d
        x = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
        if L2:
            r = tl.sqrt(tl.sum(x * x, 1))
        else:
            r = tl.max(tl.where(m, x, float("-inf")), 1) - tl.min(tl.where(m, x, float("inf")), 1)
        tl.store(out + pid_bh.to(tl.int64) * T + offs_t, r, mask=tm)

    # ------------------------------------------------------------------ key redundancy
    @triton.jit
    @no_type_check
    def _load_unit_rows(kb, offs, n_rows, offs_d, D, s_t, s_d, eps):
        m = (offs < n_rows)[:, None] & (offs_d < D)[None, :]
        x = tl.load(kb + offs[:, None].to(tl.int64) * s_t + offs_d[None, :] * s_d, mask=m, other=0.0)
        x = x.to(tl.float32)
        return x / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), eps)[:, None]

    @triton.jit
    @no_type_check
    def _redundancy_rows_kernel(
        k, valid, rowsum, last, s_last,
        H, T, D, s_b, s_h, s_t, s_d, v_b, v_h, v_t, threshold, eps,
        PRECISION: tl.constexpr, LOWP: tl.constexpr,
        BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One program = BLOCK_I rows of S for one (b, h); loops over column tiles. Rows are normalised in
        # fp32; with LOWP (16-bit keys, compiled) the unit rows go back to the keys' dtype for a tensor-core
        # dot with fp32 accumulation (the products of two 16-bit numbers are exact in fp32).
        pid_bh = tl.program_id(0)
        pid_i = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)
        kb = k + b * s_b + h * s_h
        vb = valid + b * v_b + h * v_h
        offs_d = tl.arange(0, BLOCK_D)
        offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
        ki = _load_unit_rows(kb, offs_i, T, offs_d, D, s_t, s_d, eps)
        if LOWP:
            ki = ki.to(k.dtype.element_ty)
        vi = tl.load(vb + offs_i * v_t, mask=offs_i < T, other=0) != 0
        acc = tl.zeros([BLOCK_I], dtype=tl.float32)
        lastj = tl.full([BLOCK_I], -1, dtype=tl.int32)
        sl = tl.zeros([BLOCK_I], dtype=tl.float32)
        for j0 in range(0, T, BLOCK_J):
            offs_j = j0 + tl.arange(0, BLOCK_J)
            kj = _load_unit_rows(kb, offs_j, T, offs_d, D, s_t, s_d, eps)
            if LOWP:
                kj = kj.to(k.dtype.element_ty)
            vj = tl.load(vb + offs_j * v_t, mask=offs_j < T, other=0) != 0
            s = tl.dot(ki, tl.trans(kj), input_precision=PRECISION)
            ok = vi[:, None] & vj[None, :] & (offs_i[:, None] != offs_j[None, :])
            s = tl.where(ok, s, 0.0)
            acc += tl.sum(s, 1)
            cand = tl.where(ok & (s > threshold), offs_j[None, :], -1)
            tile_last = tl.max(cand, 1)
            s_at = tl.sum(tl.where(offs_j[None, :] == tile_last[:, None], s, 0.0), 1)
            upd = tile_last >= 0  # columns only grow, so a hit here is the newest so far
            sl = tl.where(upd, s_at, sl)
            lastj = tl.where(upd, tile_last, lastj)
        o = pid_bh.to(tl.int64) * T + offs_i
        om = offs_i < T
        tl.store(rowsum + o, acc, mask=om)
        tl.store(last + o, lastj, mask=om)
        tl.store(s_last + o, sl, mask=om)

    # ------------------------------------------------------------------ window scores
    @triton.jit
    @no_type_check
    def _window_tile(
        q, kt, b, h, g, G, W, offs_w, wm, offs_d, dm, scale,
        q_b, q_h, q_w, q_d, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # scale * Q[b, h*G+g, offs_w] @ K_tile^T  -> [BLOCK_W, BLOCK_T] float32.
        qp = q + b * q_b + (h * G + g) * q_h + offs_w[:, None] * q_w + offs_d[None, :] * q_d
        qg = tl.load(qp, mask=wm[:, None] & dm[None, :], other=0.0)
        if UPCAST:
            qg = qg.to(tl.float32)
        return tl.dot(qg, kt, input_precision=PRECISION) * scale

    @triton.jit
    @no_type_check
    def _window_kernel(
        q, k, kpos, kok, qpos, qw, m_buf, l_buf, out,
        H, G, W, T, D, NT, scale,
        q_b, q_h, q_w, q_d, k_b, k_h, k_t, k_d, p_b, p_h, p_t, o_b, o_h, o_t, qp_w, qw_b, qw_w,
        SECOND_PASS: tl.constexpr, GQA_MAX: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # Grid (B*H, cdiv(T, BLOCK_T)).  First pass: per (group-row, query) softmax
        # statistics (max, sum of exp) of this key tile -> m_buf/l_buf[bh, gs, w, tile].
        # Second pass: probabilities with the combined statistics (m_buf = max,
        # l_buf = 1/sum), weighted by qw (1/n_valid queries), summed over queries.
        pid_bh = tl.program_id(0)
        pid_t = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = offs_t < T
        offs_d = tl.arange(0, BLOCK_D)
        dm = offs_d < D
        kp_ = k + b * k_b + h * k_h + offs_d[:, None] * k_d + offs_t[None, :].to(tl.int64) * k_t
        kt = tl.load(kp_, mask=dm[:, None] & tm[None, :], other=0.0)  # [BLOCK_D, BLOCK_T]
        if UPCAST:
            kt = kt.to(tl.float32)
        kpv = tl.load(kpos + b * p_b + h * p_h + offs_t * p_t, mask=tm, other=0)
        kov = tl.load(kok + b * o_b + h * o_h + offs_t * o_t, mask=tm, other=0) != 0
        if GQA_MAX:
            GS = 1
        else:
            GS = G
        acc = tl.zeros([BLOCK_T], dtype=tl.float32)
        for w0 in range(0, W, BLOCK_W):
            offs_w = w0 + tl.arange(0, BLOCK_W)
            wm = offs_w < W
            qpv = tl.load(qpos + offs_w * qp_w, mask=wm, other=0)
            qwv = tl.load(qw + b * qw_b + offs_w * qw_w, mask=wm, other=0.0)
            allowed = kov[None, :] & (kpv[None, :] <= qpv[:, None]) & (qwv > 0)[:, None]
            for gs in range(0, GS):
                if GQA_MAX:
                    logits = tl.full([BLOCK_W, BLOCK_T], float("-inf"), dtype=tl.float32)
                    for g in range(0, G):
                        logits = tl.maximum(
                            logits,
                            _window_tile(q, kt, b, h, g, G, W, offs_w, wm, offs_d, dm, scale,
                                         q_b, q_h, q_w, q_d, UPCAST, PRECISION),
                        )
                else:
                    logits = _window_tile(q, kt, b, h, gs, G, W, offs_w, wm, offs_d, dm, scale,
                                          q_b, q_h, q_w, q_d, UPCAST, PRECISION)
                logits = tl.where(allowed, logits, float("-inf"))
                row = (pid_bh.to(tl.int64) * GS + gs) * W + offs_w  # [BLOCK_W]
                if SECOND_PASS:
                    mx = tl.load(m_buf + row, mask=wm, other=0.0)
                    inv = tl.load(l_buf + row, mask=wm, other=0.0)
                    p = tl.where(allowed, tl.exp(logits - mx[:, None]) * inv[:, None], 0.0)
                    acc += tl.sum(p * qwv[:, None], 0)
                else:
                    mx = tl.max(logits, 1)
                    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
                    ls = tl.sum(tl.where(allowed, tl.exp(logits - mx_safe[:, None]), 0.0), 1)
                    tl.store(m_buf + row * NT + pid_t, mx, mask=wm)
                    tl.store(l_buf + row * NT + pid_t, ls, mask=wm)
        if SECOND_PASS:
            if not GQA_MAX:
                acc = acc / G
            tl.store(out + pid_bh.to(tl.int64) * T + offs_t, acc, mask=tm)



_FLOAT = "a float tensor (fp16/bf16/fp32)"


# ============================================================================ value_magnitude
def value_magnitude(values: Float[Tensor, "B H T D"], kind: str = "range") -> Float32[Tensor, "B H T"]:
    """Per-token value magnitude, float32 [B,H,T] (VaSE value-aware scoring).

    ``kind="range"``: max_d v - min_d v (VaSE); ``kind="l2"``: ||v||_2 over D.
    Computed in float32 whatever the input dtype (fp16/bf16/fp32).
    """
    op = "value_magnitude"
    C.tensor(op, "values", values, "B H T D", C.FLOAT_DTYPES, _FLOAT)
    C.choice(op, "kind", kind, ("range", "l2"))
    B, H, T, D = values.shape
    if select_backend(values) == "reference" or values.numel() == 0:
        return ref.value_magnitude(values, kind)
    out = torch.empty((B, H, T), dtype=torch.float32, device=values.device)
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_T = max(1, min(128, 4096 // BLOCK_D))
    launch(
        _value_magnitude_kernel, (B * H, triton.cdiv(T, BLOCK_T)),
        values, out, H, T, D, *values.stride(),
        L2=(kind == "l2"), BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
    )
    return out


def default_precision(device: torch.device) -> str:
    """``tl.dot`` input precision of the scoring kernels when none is given: tensor cores ("tf32") on a GPU,
    where a score promises no bit-exactness; "ieee" (exact fp32) under the CPU interpreter, which tests
    compare against the reference."""
    return "tf32" if device.type == "cuda" and not TRITON_INTERPRETED else "ieee"


# ============================================================================ key_redundancy
def key_redundancy(
    keys: Float[Tensor, "B H T D"],
    valid: Bool[Tensor, "B H T"],
    threshold: float = 0.5,
    *,
    precision: Optional[str] = None,
) -> Float32[Tensor, "B H T"]:
    """R-KV key redundancy (arXiv 2505.24133), float32 [B,H,T]; higher = more redundant.

    kn = keys / max(||keys||, 1e-12) in float32; S = kn kn^T per (b, h) with the
    diagonal and the rows/columns of invalid tokens zeroed.  For each row i, among
    the valid off-diagonal columns j with S[i,j] > threshold, the one with the largest
    j is zeroed (the most recent duplicate of i is not counted against it, so the
    newest copy of a repeated key survives).  r[j] = sum_i S[i,j] / n_valid (column
    mean over valid rows), then softmax of r over valid tokens (invalid -> 0; no valid
    token -> all 0).

    The Triton path tiles S (never materialised) in a single pass: each program owns a
    block of rows and records, per row, the row sum (= the column sum, S being
    symmetric), the excluded column and its value; the exclusion is scattered back and
    the masked softmax is applied with two small torch ops (the exclusion as a
    deterministic segment sum, never an atomic ``scatter_add_``).  ``precision`` is the
    ``tl.dot`` input precision on the Triton path: None (default) = ``default_precision``,
    tensor cores ("tf32") on a GPU, since a redundancy score promises no exactness (a pair
    within ~1e-3 of ``threshold`` may flip); "ieee" = exact fp32 products.
    """
    op = "key_redundancy"
    C.tensor(op, "keys", keys, "B H T D", C.FLOAT_DTYPES, _FLOAT)
    C.tensor(op, "valid", valid, "B H T", (torch.bool,), "a bool tensor")
    C.shape(op, "valid", valid, keys.shape[:3], "B H T")
    C.same_device(op, keys=keys, valid=valid)
    precision = default_precision(keys.device) if precision is None else precision
    C.choice(op, "precision", precision, ("ieee", "tf32", "tf32x3"))
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not math.isfinite(threshold):
        raise ValueError(f"{op}: threshold must be a finite float, got {threshold!r}")
    B, H, T, D = keys.shape
    if select_backend(keys, valid) == "reference" or keys.numel() == 0:
        return ref.key_redundancy(keys, valid, float(threshold))
    rowsum = torch.empty((B, H, T), dtype=torch.float32, device=keys.device)
    last = torch.empty((B, H, T), dtype=torch.int32, device=keys.device)
    s_last = torch.empty((B, H, T), dtype=torch.float32, device=keys.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    # tiles and stages from the compiled kernels' resource use (kvcompose.bench.aot): no spill on sm_80 or
    # sm_90, shared memory <= 96 KB (a 64-wide fp32 tile at head dim 128 asked 128 KB with 3 stages)
    wide = BLOCK_D <= (128 if keys.dtype != torch.float32 else 64)
    BLOCK = 64 if wide else 32
    vu8 = valid.view(torch.uint8)
    launch(
        _redundancy_rows_kernel, (B * H, triton.cdiv(T, BLOCK)),
        keys, vu8, rowsum, last, s_last,
        H, T, D, *keys.stride(), *vu8.stride(), float(threshold), ref.NORM_EPS,
        PRECISION=precision, LOWP=keys.dtype != torch.float32 and not TRITON_INTERPRETED,
        BLOCK_I=BLOCK, BLOCK_J=BLOCK, BLOCK_D=BLOCK_D, num_stages=2,
    )
    return ref.redundancy_from_rows(rowsum, last, s_last, valid)


# ============================================================================ window scores
def window_attention_scores(
    queries: Float[Tensor, "B Hq W D"],
    keys: Float[Tensor, "B H T D"],
    key_pos: Int[Tensor, "B H T"],
    key_valid: Bool[Tensor, "B H T"],
    query_pos: Int[Tensor, " W"],
    query_valid: Bool[Tensor, "B W"],
    scale: float,
    gqa: str = "mean",
    candidates: Optional[Bool[Tensor, "B H T"]] = None,
    pool: str = "none",
    kernel: int = 5,
    *,
    precision: Optional[str] = None,
) -> Float32[Tensor, "B H T"]:
    """Attention mass each key receives from an observation window of queries,
    float32 [B,H,T] (SnapKV arXiv 2404.14469, R-KV arXiv 2505.24133, VaSE).

    logits[b, hq, w, t] = scale * q . k in float32, with hq in the group of KV head
    h = hq // G (G = Hq / H).  Key t is *allowed* for query w when
    key_pos[b,h,t] <= query_pos[w] (causal), key_valid, query_valid[b,w] and (if
    ``candidates`` is given) candidates[b,h,t].

    * ``gqa="max"`` (R-KV): per KV head, max of the logits over the G query heads of
      the group *before* the softmax over allowed keys.
    * ``gqa="mean"`` (SnapKV/VaSE): softmax per query head, then mean over the group.

    Then the mean over the valid queries (denominator = number of valid queries; a
    valid query with no allowed key contributes 0; no valid query -> all 0).  Then 1-D
    pooling along the T (storage) axis, stride 1, same length, window
    [t - kernel//2, t + kernel//2] (``kernel`` must be odd), over the *valid candidate*
    keys only: out-of-range, invalid and non-candidate slots are all padding.
    ``"avg"`` averages the valid candidate neighbours (``count_include_pad=False``
    semantics, extended to masked slots), ``"max"`` takes their max (-inf padding),
    ``"none"`` skips pooling.  So a left-padded row scores exactly like the same row
    without padding, and an excluded recent window (R-KV, or SnapKV, which slices the
    window off before pooling) does not dilute its neighbours.  Finally keys that are
    invalid or not candidates are set to 0.

    Triton path: two kernels over a (B*H, T-tiles) grid that recompute q.k (first the
    per-tile softmax max/sum, combined across tiles with a small torch op, then the
    probabilities summed over queries); pooling and the final mask are torch ops
    shared with the reference.  ``queries`` and ``keys`` must share one float dtype.
    ``precision``: the ``tl.dot`` input precision for fp32 inputs on the Triton path (None =
    ``default_precision``: tensor cores on a GPU, as a score promises no exactness; "ieee"
    = exact fp32 products like the reference). 16-bit inputs always use tensor cores.
    """
    op = "window_attention_scores"
    C.tensor(op, "queries", queries, "B Hq W D", C.FLOAT_DTYPES, _FLOAT)
    C.tensor(op, "keys", keys, "B H T D", C.FLOAT_DTYPES, _FLOAT)
    B, H, T, D = keys.shape
    _, Hq, W, Dq = queries.shape
    if queries.shape[0] != B or Dq != D:
        raise ValueError(
            f"{op}: queries [B, Hq, W, D] must match keys [B, H, T, D] in B and D; "
            f"got queries {tuple(queries.shape)} and keys {tuple(keys.shape)}"
        )
    if H == 0 or Hq % H != 0 or Hq == 0:
        raise ValueError(f"{op}: query heads Hq={Hq} must be a positive multiple of kv heads H={H}")
    if queries.dtype != keys.dtype:
        raise ValueError(f"{op}: queries dtype {queries.dtype} must equal keys dtype {keys.dtype}")
    C.tensor(op, "key_pos", key_pos, "B H T", C.INT_DTYPES, "an integer tensor")
    C.shape(op, "key_pos", key_pos, (B, H, T), "B H T")
    C.tensor(op, "key_valid", key_valid, "B H T", (torch.bool,), "a bool tensor")
    C.shape(op, "key_valid", key_valid, (B, H, T), "B H T")
    C.tensor(op, "query_pos", query_pos, "W", C.INT_DTYPES, "an integer tensor")
    C.shape(op, "query_pos", query_pos, (W,), "W")
    C.tensor(op, "query_valid", query_valid, "B W", (torch.bool,), "a bool tensor")
    C.shape(op, "query_valid", query_valid, (B, W), "B W")
    if candidates is not None:
        C.tensor(op, "candidates", candidates, "B H T", (torch.bool,), "a bool tensor")
        C.shape(op, "candidates", candidates, (B, H, T), "B H T")
    C.same_device(op, queries=queries, keys=keys, key_pos=key_pos, key_valid=key_valid,
                  query_pos=query_pos, query_valid=query_valid, candidates=candidates)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be a finite float, got {scale!r}")
    C.choice(op, "gqa", gqa, ("mean", "max"))
    C.choice(op, "pool", pool, ("none", "avg", "max"))
    precision = default_precision(keys.device) if precision is None else precision
    C.choice(op, "precision", precision, ("ieee", "tf32", "tf32x3"))
    if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"{op}: kernel must be a positive odd int (same-length pooling), got {kernel!r}")

    backend = select_backend(queries, keys, key_pos, key_valid, query_pos, query_valid, candidates)
    if backend == "reference" or B * H * T == 0 or W == 0:
        return ref.window_attention_scores(
            queries, keys, key_pos, key_valid, query_pos, query_valid, float(scale),
            gqa, candidates, pool, kernel,
        )
    G = Hq // H
    key_ok = key_valid if candidates is None else key_valid & candidates
    qw = ref.query_weights(query_valid)  # float32 [B, W]
    BLOCK_T = 64
    BLOCK_D = max(16, triton.next_power_of_2(D))
    # query tiles of 16 rows and 2 stages: the key tile is loaded once per program, a query tile is small, and
    # 64-row tiles (W=64) spilled on sm_80 and asked 128 KB (fp32, head dim 128) to 256 KB (head dim 256) of
    # shared memory on sm_90; 32-row tiles still spilled at bf16 on sm_80 (kvcompose.bench.aot)
    BLOCK_W = 16
    NT = triton.cdiv(T, BLOCK_T)
    GS = 1 if gqa == "max" else G
    dev = keys.device
    m_part = torch.empty((B * H, GS, W, NT), dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    out = torch.empty((B, H, T), dtype=torch.float32, device=dev)
    ko8 = key_ok.view(torch.uint8)
    common = dict(
        # fp32 inputs: `precision`; 16-bit inputs use tensor cores (products exact in the
        # fp32 accumulator; the flag does not apply).
        GQA_MAX=(gqa == "max"), UPCAST=TRITON_INTERPRETED,
        PRECISION=precision if keys.dtype == torch.float32 else "tf32",
        BLOCK_W=BLOCK_W, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_stages=2,
    )
    strides = (*queries.stride(), *keys.stride(), *key_pos.stride(), *ko8.stride(),
               query_pos.stride(0), *qw.stride())
    grid = (B * H, NT)
    launch(
        _window_kernel, grid,
        queries, keys, key_pos, ko8, query_pos, qw, m_part, l_part, out,
        H, G, W, T, D, NT, float(scale), *strides, SECOND_PASS=False, **common,
    )
    mx = m_part.amax(-1)  # [BH, GS, W]
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    tot = (l_part * torch.exp(m_part - mx.unsqueeze(-1))).sum(-1)
    inv = torch.where(tot > 0, 1.0 / tot, torch.zeros_like(tot))
    launch(
        _window_kernel, grid,
        queries, keys, key_pos, ko8, query_pos, qw, mx.contiguous(), inv.contiguous(), out,
        H, G, W, T, D, NT, float(scale), *strides, SECOND_PASS=True, **common,
    )
    return ref.pool_scores(out, key_ok, pool, kernel)
