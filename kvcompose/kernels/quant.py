"""KIVI-style asymmetric group quantization of KV tensors (KIVI, arXiv 2402.02750):
keys per channel (groups of ``group`` tokens along T for each channel), values per
token (groups of ``group`` channels along D for each token)."""

from dataclasses import dataclass
from typing import Optional, no_type_check

import torch
from jaxtyping import Float
from torch import Tensor

from . import _checks as C
from . import ref
from .dispatch import HAS_TRITON, launch, select_backend

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    @no_type_check
    def _codes(x, m, mn, inv, QMAX: tl.constexpr):
        q = tl.floor((x - mn) * inv + 0.5)
        q = tl.minimum(tl.maximum(q, 0.0), QMAX)
        return tl.where(m, q, 0.0).to(tl.uint8)

    # ---------------------------------------------------------------- axis="token"
    @triton.jit
    @no_type_check
    def _quant_token_kernel(
        x, codes, scale, zero, T, D, NG, x_n, x_t, x_d,
        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        # Grid (N, cdiv(T, BLOCK_T)); groups of GROUP channels of one token.
        QMAX: tl.constexpr = (1 << BITS) - 1
        n = tl.program_id(0).to(tl.int64)
        offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = offs_t < T
        xrow = x + n * x_n + offs_t[:, None].to(tl.int64) * x_t
        srow = n * T * NG + offs_t.to(tl.int64) * NG
        if BITS == 4:
            DC = (D + 1) // 2
        else:
            DC = D
        crow = codes + n * T * DC + offs_t[:, None].to(tl.int64) * DC
        for g in range(0, NG):
            if BITS == 4:
                ce = g * GROUP + 2 * tl.arange(0, GROUP // 2)
                co = ce + 1
                me = tm[:, None] & (ce < D)[None, :]
                mo = tm[:, None] & (co < D)[None, :]
                xe = tl.load(xrow + ce[None, :] * x_d, mask=me, other=0.0).to(tl.float32)
                xo = tl.load(xrow + co[None, :] * x_d, mask=mo, other=0.0).to(tl.float32)
                mn = tl.minimum(tl.min(tl.where(me, xe, float("inf")), 1),
                                tl.min(tl.where(mo, xo, float("inf")), 1))
                mx = tl.maximum(tl.max(tl.where(me, xe, float("-inf")), 1),
                                tl.max(tl.where(mo, xo, float("-inf")), 1))
            else:
                cols = g * GROUP + tl.arange(0, GROUP)
                mk = tm[:, None] & (cols < D)[None, :]
                xv = tl.load(xrow + cols[None, :] * x_d, mask=mk, other=0.0).to(tl.float32)
                mn = tl.min(tl.where(mk, xv, float("inf")), 1)
                mx = tl.max(tl.where(mk, xv, float("-inf")), 1)
            mn = tl.where(tm, mn, 0.0)  # rows past T: keep the arithmetic finite
            mx = tl.where(tm, mx, 0.0)
            s = (mx - mn) / QMAX
            inv = tl.where(s > 0, 1.0 / tl.where(s > 0, s, 1.0), 0.0)
            tl.store(scale + srow + g, s, mask=tm)
            tl.store(zero + srow + g, mn, mask=tm)
            if BITS == 4:
                qe = _codes(xe, me, mn[:, None], inv[:, None], QMAX)
                qo = _codes(xo, mo, mn[:, None], inv[:, None], QMAX)
                byte = qe | (qo << 4)
                bc = g * (GROUP // 2) + tl.arange(0, GROUP // 2)
                tl.store(crow + bc[None, :], byte, mask=tm[:, None] & (bc < DC)[None, :])
            else:
                q = _codes(xv, mk, mn[:, None], inv[:, None], QMAX)
                tl.store(crow + cols[None, :], q, mask=mk)

    @triton.jit
    @no_type_check
    def _dequant_token_kernel(
        codes, scale, zero, out, T, D, NG,
        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = offs_t < T
        srow = n * T * NG + offs_t.to(tl.int64) * NG
        orow = out + n * T * D + offs_t[:, None].to(tl.int64) * D
        if BITS == 4:
            DC = (D + 1) // 2
        else:
            DC = D
        crow = codes + n * T * DC + offs_t[:, None].to(tl.int64) * DC
        for g in range(0, NG):
            s = tl.load(scale + srow + g, mask=tm, other=0.0)[:, None]
            z = tl.load(zero + srow + g, mask=tm, other=0.0)[:, None]
            if BITS == 4:
                bc = g * (GROUP // 2) + tl.arange(0, GROUP // 2)
                byte = tl.load(crow + bc[None, :], mask=tm[:, None] & (bc < DC)[None, :], other=0)
                ce = 2 * bc
                xe = (byte & 0xF).to(tl.float32) * s + z
                xo = (byte >> 4).to(tl.float32) * s + z
                tl.store(orow + ce[None, :], xe.to(out.dtype.element_ty), mask=tm[:, None] & (ce < D)[None, :])
                tl.store(orow + ce[None, :] + 1, xo.to(out.dtype.element_ty),
                         mask=tm[:, None] & (ce + 1 < D)[None, :])
            else:
                cols = g * GROUP + tl.arange(0, GROUP)
                mk = tm[:, None] & (cols < D)[None, :]
                q = tl.load(crow + cols[None, :], mask=mk, other=0)
                tl.store(orow + cols[None, :], (q.to(tl.float32) * s + z).to(out.dtype.element_ty), mask=mk)

    @triton.jit
    @no_type_check
    def _quant_channel_cols(xb, c, tm, D, x_d, scale, zero, sb, QMAX: tl.constexpr):
        # Quantize columns ``c`` of a [GROUP, len(c)] token group; store their stats.
        mk = tm[:, None] & (c < D)[None, :]
        xv = tl.load(xb + c[None, :] * x_d, mask=mk, other=0.0).to(tl.float32)
        mn = tl.min(tl.where(mk, xv, float("inf")), 0)
        mx = tl.max(tl.where(mk, xv, float("-inf")), 0)
        mn = tl.where(c < D, mn, 0.0)  # channels past D: keep the arithmetic finite
        mx = tl.where(c < D, mx, 0.0)
        s = (mx - mn) / QMAX
        inv = tl.where(s > 0, 1.0 / tl.where(s > 0, s, 1.0), 0.0)
        tl.store(scale + sb + c, s, mask=c < D)
        tl.store(zero + sb + c, mn, mask=c < D)
        return _codes(xv, mk, mn[None, :], inv[None, :], QMAX)

    # ---------------------------------------------------------------- axis="channel"
    @triton.jit
    @no_type_check
    def _quant_channel_kernel(
        x, codes, scale, zero, T, D, NG, x_n, x_t, x_d,
        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # Grid (N, NG, cdiv(D, BLOCK_D)); one group of GROUP tokens x BLOCK_D channels.
        QMAX: tl.constexpr = (1 << BITS) - 1
        n = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        d0 = tl.program_id(2) * BLOCK_D
        offs_t = g * GROUP + tl.arange(0, GROUP)
        tm = offs_t < T
        xb = x + n * x_n + offs_t[:, None].to(tl.int64) * x_t
        sb = n * NG * D + g * D
        if BITS == 4:
            DC = (D + 1) // 2
            ce = d0 + 2 * tl.arange(0, BLOCK_D // 2)
            q_lo = _quant_channel_cols(xb, ce, tm, D, x_d, scale, zero, sb, QMAX)
            q_hi = _quant_channel_cols(xb, ce + 1, tm, D, x_d, scale, zero, sb, QMAX)
            bc = d0 // 2 + tl.arange(0, BLOCK_D // 2)
            cb = codes + n * T * DC + offs_t[:, None].to(tl.int64) * DC
            tl.store(cb + bc[None, :], q_lo | (q_hi << 4), mask=tm[:, None] & (bc < DC)[None, :])
        else:
            c = d0 + tl.arange(0, BLOCK_D)
            q = _quant_channel_cols(xb, c, tm, D, x_d, scale, zero, sb, QMAX)
            cb = codes + n * T * D + offs_t[:, None].to(tl.int64) * D
            tl.store(cb + c[None, :], q, mask=tm[:, None] & (c < D)[None, :])

    @triton.jit
    @no_type_check
    def _dequant_channel_cols(q, c, tm, D, scale, zero, sb, ob):
        s = tl.load(scale + sb + c, mask=c < D, other=0.0)
        z = tl.load(zero + sb + c, mask=c < D, other=0.0)
        xv = q.to(tl.float32) * s[None, :] + z[None, :]
        tl.store(ob + c[None, :], xv.to(ob.dtype.element_ty), mask=tm[:, None] & (c < D)[None, :])

    @triton.jit
    @no_type_check
    def _dequant_channel_kernel(
        codes, scale, zero, out, T, D, NG,
        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        d0 = tl.program_id(2) * BLOCK_D
        offs_t = g * GROUP + tl.arange(0, GROUP)
        tm = offs_t < T
        sb = n * NG * D + g * D
        ob = out + n * T * D + offs_t[:, None].to(tl.int64) * D
        if BITS == 4:
            DC = (D + 1) // 2
            bc = d0 // 2 + tl.arange(0, BLOCK_D // 2)
            cb = codes + n * T * DC + offs_t[:, None].to(tl.int64) * DC
            byte = tl.load(cb + bc[None, :], mask=tm[:, None] & (bc < DC)[None, :], other=0)
            _dequant_channel_cols(byte & 0xF, 2 * bc, tm, D, scale, zero, sb, ob)
            _dequant_channel_cols(byte >> 4, 2 * bc + 1, tm, D, scale, zero, sb, ob)
        else:
            c = d0 + tl.arange(0, BLOCK_D)
            mk = tm[:, None] & (c < D)[None, :]
            cb = codes + n * T * D + offs_t[:, None].to(tl.int64) * D
            q = tl.load(cb + c[None, :], mask=mk, other=0)
            s = tl.load(scale + sb + c, mask=c < D, other=0.0)
            z = tl.load(zero + sb + c, mask=c < D, other=0.0)
            xv = q.to(tl.float32) * s[None, :] + z[None, :]
            tl.store(ob + c[None, :], xv.to(out.dtype.element_ty), mask=mk)


@dataclass(frozen=True)
class QTensor:
    """A group-quantized tensor (KIVI, arXiv 2402.02750).

    Fields (``*`` = the leading batch dims of the original ``x[..., T, D]``):

    * ``codes``: uint8 ``[*, T, D]`` (8 bits) or ``[*, T, ceil(D/2)]`` (4 bits, two
      codes per byte: channel 2c in the low nibble, 2c+1 in the high nibble).
    * ``scale``, ``zero``: float32, ``[*, ceil(T/group), D]`` for ``axis="channel"``
      and ``[*, T, ceil(D/group)]`` for ``axis="token"``.  ``zero`` is the group min.
    * ``bits``, ``group``, ``axis``, ``shape`` (original), ``dtype`` (original).

    Dequantized value: ``code * scale + zero``.
    """

    codes: Tensor
    scale: Tensor
    zero: Tensor
    bits: int
    group: int
    axis: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        return dequantize(self, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))



def quantize(
    x: Float[Tensor, "*batch T D"], bits: int = 8, group: int = 32, axis: str = "channel"
) -> QTensor:
    """Asymmetric min/max group quantization (KIVI, arXiv 2402.02750).

    ``axis="channel"`` (keys): each channel d gets one (scale, zero) per group of
    ``group`` consecutive tokens; ``axis="token"`` (values): each token gets one per
    group of ``group`` consecutive channels.  ``bits`` is 8 or 4 (4-bit codes are packed
    two per uint8 along D).  ``group`` must be a power of two in [2, 1024].  A T (or D)
    that is not a multiple of ``group`` gives a shorter, ragged last group whose
    min/max cover only the elements that exist.

    Per group: zero = min, scale = (max - min) / (2^bits - 1) (float32, stored as
    float32), code = clamp(floor((x - zero) / scale + 0.5), 0, 2^bits - 1) (code 0 when
    scale == 0).  Error bound: |x - dequantize(q)| <= scale / 2 per element, up to
    float32 rounding (a few ulps of max(|min|, |max|) of the group).
    """
    op = "quantize"
    C.tensor(op, "x", x, "T D", C.FLOAT_DTYPES, "a float tensor (fp16/bf16/fp32)", min_rank=True)
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (4, 8):
        raise ValueError(f"{op}: bits must be 4 or 8, got {bits!r}")
    if not isinstance(group, int) or isinstance(group, bool) or group < 2 or group > 1024 or group & (group - 1):
        raise ValueError(f"{op}: group must be a power of two in [2, 1024], got {group!r}")
    C.choice(op, "axis", axis, ("channel", "token"))
    shape = tuple(x.shape)
    T, D = shape[-2], shape[-1]
    lead = shape[:-2]
    x3 = x.reshape(-1, T, D)
    N = x3.shape[0]
    if select_backend(x) == "reference" or x.numel() == 0:
        codes, scale, zero = ref.quantize(x3, bits, group, axis)
    else:
        DC = (D + 1) // 2 if bits == 4 else D
        codes = torch.empty((N, T, DC), dtype=torch.uint8, device=x.device)
        if axis == "channel":
            NG = triton.cdiv(T, group)
            sshape = (N, NG, D)
        else:
            NG = triton.cdiv(D, group)
            sshape = (N, T, NG)
        scale = torch.empty(sshape, dtype=torch.float32, device=x.device)
        zero = torch.empty_like(scale)
        if axis == "channel":
            BLOCK_D = max(2, min(triton.next_power_of_2(D), max(2, 4096 // group), 128))
            launch(
                _quant_channel_kernel, (N, NG, triton.cdiv(D, BLOCK_D)),
                x3, codes, scale, zero, T, D, NG, *x3.stride(),
                BITS=bits, GROUP=group, BLOCK_D=BLOCK_D,
            )
        else:
            BLOCK_T = max(1, min(64, 4096 // group))
            launch(
                _quant_token_kernel, (N, triton.cdiv(T, BLOCK_T)),
                x3, codes, scale, zero, T, D, NG, *x3.stride(),
                BITS=bits, GROUP=group, BLOCK_T=BLOCK_T,
            )
    return QTensor(
        codes=codes.reshape(*lead, *codes.shape[1:]),
        scale=scale.reshape(*lead, *scale.shape[1:]),
        zero=zero.reshape(*lead, *zero.shape[1:]),
        bits=bits, group=group, axis=axis, shape=shape, dtype=x.dtype,
    )


def dequantize(q: QTensor, dtype: Optional[torch.dtype] = None) -> Float[Tensor, "..."]:
    """Inverse of :func:`quantize`: ``code * scale + zero`` in float32, cast to ``dtype``
    (default: the original dtype), shaped like the original tensor."""
    op = "dequantize"
    if not isinstance(q, QTensor):
        raise ValueError(f"{op}: expected a QTensor, got {type(q).__name__}")
    dtype = q.dtype if dtype is None else dtype
    if dtype not in C.FLOAT_DTYPES:
        raise ValueError(f"{op}: dtype must be fp16/bf16/fp32, got {dtype}")
    C.same_device(op, codes=q.codes, scale=q.scale, zero=q.zero)
    shape = tuple(q.shape)
    T, D = shape[-2], shape[-1]
    DC = (D + 1) // 2 if q.bits == 4 else D
    ng_shape = (-(-T // q.group), D) if q.axis == "channel" else (T, -(-D // q.group))
    lead = shape[:-2]
    if tuple(q.codes.shape) != (*lead, T, DC) or q.codes.dtype != torch.uint8:
        raise ValueError(f"{op}: codes must be uint8 {(*lead, T, DC)}, got {q.codes.dtype} {tuple(q.codes.shape)}")
    for name, t in (("scale", q.scale), ("zero", q.zero)):
        if tuple(t.shape) != (*lead, *ng_shape) or t.dtype != torch.float32:
            raise ValueError(f"{op}: {name} must be float32 {(*lead, *ng_shape)}, got {t.dtype} {tuple(t.shape)}")
    codes = q.codes.reshape(-1, T, DC).contiguous()
    scale = q.scale.reshape(-1, *ng_shape).contiguous()
    zero = q.zero.reshape(-1, *ng_shape).contiguous()
    N = codes.shape[0]
    if select_backend(q.codes) == "reference" or codes.numel() == 0:
        out = ref.dequantize(codes, scale, zero, q.bits, q.group, q.axis, D, dtype)
    else:
        out = torch.empty((N, T, D), dtype=dtype, device=codes.device)
        if q.axis == "channel":
            BLOCK_D = max(2, min(triton.next_power_of_2(D), max(2, 4096 // q.group), 128))
            launch(
                _dequant_channel_kernel, (N, ng_shape[0], triton.cdiv(D, BLOCK_D)),
                codes, scale, zero, out, T, D, ng_shape[0],
                BITS=q.bits, GROUP=q.group, BLOCK_D=BLOCK_D,
            )
        else:
            BLOCK_T = max(1, min(64, 4096 // q.group))
            launch(
                _dequant_token_kernel, (N, triton.cdiv(T, BLOCK_T)),
                codes, scale, zero, out, T, D, ng_shape[1],
                BITS=q.bits, GROUP=q.group, BLOCK_T=BLOCK_T,
            )
    return out.reshape(shape)
