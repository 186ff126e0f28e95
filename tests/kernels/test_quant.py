import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcompose.kernels as K
from kernel_testutil import DEVICE, DTYPE_TOL, DTYPES, FAST, TRITON_OK, both, gen, randn, requires_triton

EPS32 = 2.0**-23


def expand_stats(qt):
    """Per-element (scale, zero) of a QTensor, shaped like the original tensor."""
    T, D = qt.shape[-2], qt.shape[-1]
    if qt.axis == "channel":
        s = qt.scale.repeat_interleave(qt.group, -2)[..., :T, :]
        z = qt.zero.repeat_interleave(qt.group, -2)[..., :T, :]
    else:
        s = qt.scale.repeat_interleave(qt.group, -1)[..., :D]
        z = qt.zero.repeat_interleave(qt.group, -1)[..., :D]
    return s, z


def assert_error_bound(x, qt):
    """|x - deq(q(x))| <= scale/2 of the element's group, + float32 rounding slack."""
    deq = K.dequantize(qt, torch.float32)
    s, z = expand_stats(qt)
    qmax = 2**qt.bits - 1
    slack = 4 * EPS32 * (z.abs() + s * qmax) + 1e-6 * s  # rounding of (x-z)*inv and q*s+z
    err = (x.float() - deq).abs()
    assert bool((err <= s / 2 + slack).all()), float((err - s / 2 - slack).max())


def naive_quantize(x, bits, group, axis):
    """Element-by-element KIVI quantization of a float32 [T, D] matrix -> codes [T, D]."""
    T, D = x.shape
    qmax = 2**bits - 1
    codes = torch.zeros(T, D, dtype=torch.int64)
    for t in range(T):
        for d in range(D):
            if axis == "channel":
                grp = [float(x[u, d]) for u in range((t // group) * group, min(T, (t // group + 1) * group))]
            else:
                grp = [float(x[t, c]) for c in range((d // group) * group, min(D, (d // group + 1) * group))]
            mn, mx = min(grp), max(grp)
            s = torch.tensor((mx - mn) / qmax, dtype=torch.float32)
            inv = 1.0 / s if s > 0 else torch.tensor(0.0)
            v = torch.floor((x[t, d] - torch.tensor(mn)) * inv + 0.5)
            codes[t, d] = int(v.clamp(0, qmax))
    return codes


def unpack(qt):
    c = qt.codes.long()
    if qt.bits == 8:
        return c
    return torch.stack([c & 0xF, c >> 4], -1).flatten(-2)[..., : qt.shape[-1]]


leads = st.sampled_from([(), (2,), (1, 3)])


@requires_triton
@FAST
@given(lead=leads, T=st.integers(1, 100), D=st.integers(1, 70), bits=st.sampled_from([4, 8]),
       group=st.sampled_from([2, 4, 8, 32, 64]), axis=st.sampled_from(["channel", "token"]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_quant_parity_and_bound(lead, T, D, bits, group, axis, dtype, seed):
    x = randn(gen(seed), *lead, T, D, dtype=dtype) * 2 + 0.5
    qa, qb = both(K.quantize, x, bits, group, axis)
    for q in (qa, qb):
        assert q.codes.dtype == torch.uint8 and q.scale.dtype == torch.float32
        assert q.codes.shape == (*lead, T, D if bits == 8 else (D + 1) // 2)
        assert q.scale.shape == ((*lead, -(-T // group), D) if axis == "channel" else (*lead, T, -(-D // group)))
        assert_error_bound(x, q)
    torch.testing.assert_close(qa.scale, qb.scale, atol=0, rtol=1e-6)
    torch.testing.assert_close(qa.zero, qb.zero, atol=0, rtol=0)
    diff = (unpack(qa) - unpack(qb)).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 1e-3  # ties may round apart on GPU
    da, db = both(K.dequantize, qa)
    assert da.dtype == dtype and da.shape == x.shape
    torch.testing.assert_close(da, db, **DTYPE_TOL[dtype])
    # Cross-path round trip: a Triton QTensor dequantized by the reference and vice versa.
    with K.use_triton(True):
        dba = K.dequantize(qb, torch.float32)
    with K.use_triton(False):
        dab = K.dequantize(qa, torch.float32)
    s, _ = expand_stats(qa)
    assert bool(((dba - dab).abs() <= s * 1.001 + 1e-6).all())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("T,D,group", [(5, 7, 4), (6, 6, 2), (3, 9, 8)])
def test_reference_vs_naive(bits, axis, T, D, group):
    x = randn(gen(T * D + bits), T, D, dtype=torch.float16)
    with K.force_reference():
        q = K.quantize(x, bits, group, axis)
    assert torch.equal(unpack(q).cpu(), naive_quantize(x.float().cpu(), bits, group, axis))


@pytest.mark.parametrize("use", [False, True])
def test_ragged_last_group_uses_only_real_elements(use):
    if use and not TRITON_OK:
        pytest.skip("no Triton path")
    x = randn(gen(11), 2, 9, 10)  # T = 9 = 2 groups of 4 + 1 token; D = 10 = 2 of 4 + 2 channels
    with K.use_triton(use):
        qc = K.quantize(x, 4, 4, "channel")
        qt = K.quantize(x, 4, 4, "token")
        dc = K.dequantize(qc)
    # Channel axis: the last group is token 8 alone -> scale 0, zero = x, exact.
    assert bool((qc.scale[:, 2] == 0).all()) and torch.equal(qc.zero[:, 2], x[:, 8])
    assert torch.equal(dc[:, 8], x[:, 8])
    # Token axis: the last group holds channels 8, 9 only.
    torch.testing.assert_close(qt.zero[..., 2], x[..., 8:].amin(-1), atol=0, rtol=0)
    torch.testing.assert_close(qt.scale[..., 2], (x[..., 8:].amax(-1) - x[..., 8:].amin(-1)) / 15, atol=0, rtol=1e-6)


@pytest.mark.parametrize("use", [False, True])
def test_constant_groups_are_exact(use):
    if use and not TRITON_OK:
        pytest.skip("no Triton path")
    x = torch.full((3, 16, 8), 0.375, device=DEVICE)
    with K.use_triton(use):
        for axis in ("channel", "token"):
            q = K.quantize(x, 4, 8, axis)
            assert bool((q.scale == 0).all())
            assert torch.equal(K.dequantize(q), x)


def test_qtensor_metadata_and_default_dtype():
    x = randn(gen(12), 2, 3, 33, 16, dtype=torch.bfloat16)
    q = K.quantize(x, bits=4, group=32, axis="token")
    assert (q.bits, q.group, q.axis, q.shape, q.dtype) == (4, 32, "token", (2, 3, 33, 16), torch.bfloat16)
    assert q.dequantize().dtype == torch.bfloat16
    assert q.nbytes == 2 * 3 * 33 * 8 + 2 * (2 * 3 * 33 * 1 * 4)
    assert K.dequantize(q, torch.float16).dtype == torch.float16


def test_four_bit_packing_layout():
    """Channel 2c in the low nibble, 2c+1 in the high nibble; odd D pads a zero nibble."""
    x = torch.tensor([[0.0, 15.0, 15.0]], device=DEVICE).expand(2, 3).contiguous()  # T=2, D=3
    x[1] = torch.tensor([15.0, 0.0, 0.0])
    q = K.quantize(x, 4, 2, "channel")  # per channel: min 0, max 15 -> scale 1
    assert q.codes.tolist() == [[0xF0, 0x0F], [0x0F, 0x00]]
