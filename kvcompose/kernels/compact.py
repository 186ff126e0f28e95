"""Fused gather of the kept KV rows (the compaction step of every eviction policy:
SnapKV arXiv 2404.14469, R-KV arXiv 2505.24133, VaSE)."""

from typing import Optional, no_type_check

import torch
from jaxtyping import Float, Int
from torch import Tensor

from . import _checks as C
from . import ref
from .dispatch import HAS_TRITON, launch, select_backend

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    @no_type_check
    def _gather_block(src, dst, idx_row, si_k, k0, K, offs_d, dmask,
                      s_t, s_d, d_t, d_d, BLOCK_K: tl.constexpr):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        rows = tl.load(idx_row + offs_k.to(tl.int64) * si_k, mask=kmask, other=0).to(tl.int64)
        m = kmask[:, None] & dmask[None, :]
        x = tl.load(src + rows[:, None] * s_t + offs_d[None, :] * s_d, mask=m)
        # Every load of this block is done before any store: needed for in-place use.
        tl.debug_barrier()
        tl.store(dst + offs_k[:, None].to(tl.int64) * d_t + offs_d[None, :] * d_d, x, mask=m)

    @triton.jit
    @no_type_check
    def _compact_kernel(
        k_src, v_src, idx, k_dst, v_dst,
        H, K, D,
        sk_b, sk_h, sk_t, sk_d,
        sv_b, sv_h, sv_t, sv_d,
        si_b, si_h, si_k,
        dk_b, dk_h, dk_t, dk_d,
        dv_b, dv_h, dv_t, dv_d,
        SEQUENTIAL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        pid_d = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        idx_row = idx + b * si_b + h * si_h
        ks = k_src + b * sk_b + h * sk_h
        vs = v_src + b * sv_b + h * sv_h
        kd = k_dst + b * dk_b + h * dk_h
        vd = v_dst + b * dv_b + h * dv_h
        if SEQUENTIAL:
            # In place: one program walks K in ascending blocks; safe when idx[k] >= k.
            for k0 in range(0, K, BLOCK_K):
                _gather_block(ks, kd, idx_row, si_k, k0, K, offs_d, dmask, sk_t, sk_d, dk_t, dk_d, BLOCK_K)
                _gather_block(vs, vd, idx_row, si_k, k0, K, offs_d, dmask, sv_t, sv_d, dv_t, dv_d, BLOCK_K)
        else:
            k0 = tl.program_id(2) * BLOCK_K
            _gather_block(ks, kd, idx_row, si_k, k0, K, offs_d, dmask, sk_t, sk_d, dk_t, dk_d, BLOCK_K)
            _gather_block(vs, vd, idx_row, si_k, k0, K, offs_d, dmask, sv_t, sv_d, dv_t, dv_d, BLOCK_K)


def _extent(t: Tensor) -> tuple[int, int]:
    """Byte range [start, end) spanned by ``t``."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


def _overlaps(a: Tensor, b: Tensor) -> bool:
    a0, a1 = _extent(a)
    b0, b1 = _extent(b)
    return a0 < b1 and b0 < a1


def _compact_triton(keys, values, idx, out_keys, out_values, sequential):
    B, H, T, D = keys.shape
    K = idx.shape[2]
    if K == 0 or B * H == 0 or D == 0:
        return out_keys, out_values
    # In place, each (b, h) is walked by one program per D-tile: narrow D-tiles give
    # more programs to hide the sequential loop's latency.
    BLOCK_D = min(triton.next_power_of_2(D), 32 if sequential else 128)
    BLOCK_K = 64
    grid = (B * H, triton.cdiv(D, BLOCK_D), 1 if sequential else triton.cdiv(K, BLOCK_K))
    launch(
        _compact_kernel, grid,
        keys, values, idx, out_keys, out_values,
        H, K, D,
        *keys.stride(), *values.stride(), *idx.stride(),
        *out_keys.stride(), *out_values.stride(),
        SEQUENTIAL=sequential, BLOCK_K=BLOCK_K, BLOCK_D=BLOCK_D,
    )
    return out_keys, out_values


def compact(
    keys: Float[Tensor, "B H T D"],
    values: Float[Tensor, "B H T D"],
    idx: Int[Tensor, "B H K"],
    out_keys: Optional[Float[Tensor, "B H K D"]] = None,
    out_values: Optional[Float[Tensor, "B H K D"]] = None,
    *,
    check_indices: bool = True,
) -> tuple[Float[Tensor, "B H K D"], Float[Tensor, "B H K D"]]:
    """Gather the kept rows of keys and values in one pass.

    ``keys``/``values`` [B,H,T,D] (fp16/bf16/fp32, any strides), ``idx`` integer
    [B,H,K] with 0 <= idx < T.  Returns ``(keys[b,h,idx[b,h,k]], values[...])`` as
    [B,H,K,D] tensors: new contiguous ones, or ``out_keys``/``out_values`` (each
    [B,H,K,D], same dtype/device, any strides) when given.  One output buffer may be
    given without the other.

    In place: ``out_keys`` may alias ``keys`` only as a leading slice of it
    (``keys[:, :, :K]``, same data pointer and strides) and likewise for values — this
    compacts a layer's own storage.  That is correct only if ``idx[b,h,k] >= k`` for
    every k, which holds for sorted, duplicate-free kept indices; the Triton kernel then
    walks K in ascending blocks with one program per (b, h, D-tile).  Any other overlap
    between an output and its source is rejected.

    ``check_indices`` (default True) validates 0 <= idx < T and, in place, idx[k] >= k;
    it costs one device->host sync, so hot loops that guarantee it may pass False
    (then out-of-range indices are undefined behaviour on the Triton path).
    """
    op = "compact"
    C.tensor(op, "keys", keys, "B H T D", C.FLOAT_DTYPES, "a float tensor (fp16/bf16/fp32)")
    C.tensor(op, "values", values, "B H T D", C.FLOAT_DTYPES, "a float tensor (fp16/bf16/fp32)")
    C.tensor(op, "idx", idx, "B H K", C.INT_DTYPES, "an integer tensor")
    B, H, T, D = keys.shape
    C.shape(op, "values", values, keys.shape, "B H T D")
    C.shape(op, "idx", idx, (B, H, idx.shape[2]), "B H K")
    K = idx.shape[2]
    C.same_device(op, keys=keys, values=values, idx=idx, out_keys=out_keys, out_values=out_values)
    inplace = False
    for oname, out, sname, src in (("out_keys", out_keys, "keys", keys), ("out_values", out_values, "values", values)):
        if out is None:
            continue
        C.tensor(op, oname, out, "B H K D", C.FLOAT_DTYPES, "a float tensor (fp16/bf16/fp32)")
        C.shape(op, oname, out, (B, H, K, D), "B H K D")
        if out.dtype != src.dtype:
            raise ValueError(f"{op}: {oname} dtype {out.dtype} must equal {sname} dtype {src.dtype}")
        if _overlaps(out, src):
            if out.data_ptr() != src.data_ptr() or (K > 1 and out.stride() != src.stride()):
                raise ValueError(
                    f"{op}: {oname} overlaps {sname}; in-place compaction needs {oname} to be "
                    f"{sname}[:, :, :K] (same data pointer and strides) or a separate buffer"
                )
            inplace = True
    if check_indices and idx.numel() > 0:
        bad = (idx < 0) | (idx >= T)
        if inplace:
            bad = bad | (idx < torch.arange(K, device=idx.device))
        if bool(bad.any()):
            raise ValueError(
                f"{op}: idx must satisfy 0 <= idx < T={T}"
                + (" and idx[..., k] >= k (sorted, duplicate-free) for in-place use" if inplace else "")
            )
    if select_backend(keys, values, idx, out_keys, out_values) == "reference":
        return ref.compact(keys, values, idx, out_keys, out_values)
    if out_keys is None:
        out_keys = torch.empty((B, H, K, D), dtype=keys.dtype, device=keys.device)
    if out_values is None:
        out_values = torch.empty((B, H, K, D), dtype=values.dtype, device=values.device)
    return _compact_triton(keys, values, idx, out_keys, out_values, inplace)
