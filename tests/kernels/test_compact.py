import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcompose.kernels as K
from kernel_testutil import DEVICE, DTYPES, FAST, TRITON_OK, both, gen, randn, requires_triton


def _sorted_idx(g, B, H, T, Kk):
    """Sorted, duplicate-free kept indices per (b, h) — the in-place precondition."""
    rows = [torch.sort(torch.randperm(T, generator=g)[:Kk]).values for _ in range(B * H)]
    return torch.stack(rows).reshape(B, H, Kk).to(DEVICE)


def naive_compact(keys, values, idx):
    B, H, Kk = idx.shape
    ok = torch.empty(B, H, Kk, keys.shape[-1], dtype=keys.dtype)
    ov = torch.empty(B, H, Kk, values.shape[-1], dtype=values.dtype)
    for b in range(B):
        for h in range(H):
            for k in range(Kk):
                ok[b, h, k] = keys[b, h, int(idx[b, h, k])].cpu()
                ov[b, h, k] = values[b, h, int(idx[b, h, k])].cpu()
    return ok, ov


shapes = st.tuples(
    st.integers(1, 2), st.integers(1, 3), st.integers(1, 80), st.sampled_from([1, 8, 24, 64, 130])
)


@requires_triton
@FAST
@given(shape=shapes, frac=st.floats(0, 1), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1),
       idx32=st.booleans())
def test_compact_parity(shape, frac, dtype, seed, idx32):
    B, H, T, D = shape
    g = gen(seed)
    Kk = int(round(frac * T))
    keys, values = randn(g, B, H, T, D, dtype=dtype), randn(g, B, H, T, D, dtype=dtype)
    idx = torch.randint(0, T, (B, H, Kk), generator=g).to(DEVICE)  # any order, repeats allowed
    if idx32:
        idx = idx.int()
    (tk, tv), (rk, rv) = both(K.compact, keys, values, idx)
    assert tk.shape == (B, H, Kk, D) and tk.dtype == dtype
    assert torch.equal(tk, rk) and torch.equal(tv, rv)  # a gather is exact


def test_reference_matches_naive_loop():
    g = gen(0)
    keys, values = randn(g, 2, 3, 9, 5), randn(g, 2, 3, 9, 5)
    idx = torch.randint(0, 9, (2, 3, 4), generator=g).to(DEVICE)
    with K.force_reference():
        k, v = K.compact(keys, values, idx)
    nk, nv = naive_compact(keys, values, idx)
    assert torch.equal(k.cpu(), nk) and torch.equal(v.cpu(), nv)


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_out_buffers_and_strided_inputs(path):
    if path == "triton" and not TRITON_OK:
        pytest.skip("no Triton path")
    g = gen(1)
    B, H, T, D, Kk = 2, 3, 40, 24, 13
    # Non-contiguous sources: [B, T, H, D] storage viewed as [B, H, T, D].
    keys = randn(g, B, T, H, D).transpose(1, 2)
    values = randn(g, B, T, H, D, dtype=torch.float16).transpose(1, 2)
    idx = _sorted_idx(g, B, H, T, Kk)
    out_k = torch.zeros(B, Kk, H, D, device=DEVICE).transpose(1, 2)  # strided output
    out_v = torch.zeros(B, H, Kk, D, device=DEVICE, dtype=torch.float16)
    with K.use_triton(path == "triton"):
        rk, rv = K.compact(keys, values, idx, out_keys=out_k, out_values=out_v)
    assert rk is out_k and rv is out_v
    nk, nv = naive_compact(keys, values, idx)
    assert torch.equal(out_k.cpu(), nk) and torch.equal(out_v.cpu(), nv)
    # Only one buffer given.
    with K.use_triton(path == "triton"):
        rk2, rv2 = K.compact(keys, values, idx, out_values=torch.empty_like(out_v))
    assert torch.equal(rk2.cpu(), nk) and torch.equal(rv2.cpu(), nv)


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("T,Kk", [(1, 1), (70, 0), (70, 70), (150, 77), (150, 3)])
def test_in_place_compaction(path, T, Kk):
    if path == "triton" and not TRITON_OK:
        pytest.skip("no Triton path")
    g = gen(T * 1000 + Kk)
    B, H, D = 2, 2, 24
    keys, values = randn(g, B, H, T, D, dtype=torch.bfloat16), randn(g, B, H, T, D, dtype=torch.bfloat16)
    idx = _sorted_idx(g, B, H, T, Kk)
    expect_k, expect_v = naive_compact(keys, values, idx)
    ok, ov = keys[:, :, :Kk], values[:, :, :Kk]
    with K.use_triton(path == "triton"):
        rk, rv = K.compact(keys, values, idx, out_keys=ok, out_values=ov)
    assert rk is ok and rv is ov
    assert torch.equal(keys[:, :, :Kk].cpu(), expect_k) and torch.equal(values[:, :, :Kk].cpu(), expect_v)


def test_in_place_matches_sequential_naive_loop():
    """The in-place contract: equal to a row-by-row ascending copy when idx[k] >= k."""
    g = gen(5)
    keys = randn(g, 1, 1, 30, 4)
    idx = _sorted_idx(g, 1, 1, 30, 12)
    seq = keys.clone().cpu()
    for k in range(12):
        seq[0, 0, k] = seq[0, 0, int(idx[0, 0, k])]
    values = keys.clone()
    K.compact(keys, values, idx, out_keys=keys[:, :, :12], out_values=values[:, :, :12])
    assert torch.equal(keys[:, :, :12].cpu(), seq[:, :, :12])


def test_in_place_precondition_is_checked():
    g = gen(2)
    keys, values = randn(g, 1, 2, 10, 8), randn(g, 1, 2, 10, 8)
    idx = torch.tensor([[[0, 3, 5], [2, 1, 9]]], device=DEVICE)  # second row: idx[1] = 1 ok, but unsorted
    idx[0, 1, 1] = 0  # idx[1] = 0 < 1 -> would read an overwritten row
    with pytest.raises(ValueError, match=r"idx\[..., k\] >= k"):
        K.compact(keys, values, idx, out_keys=keys[:, :, :3], out_values=values[:, :, :3])
    # Not in place: any order is fine.
    K.compact(keys, values, idx)


def test_overlapping_out_rejected():
    g = gen(3)
    keys, values = randn(g, 1, 2, 10, 8), randn(g, 1, 2, 10, 8)
    idx = torch.tensor([[[4, 5, 6], [7, 8, 9]]], device=DEVICE)
    with pytest.raises(ValueError, match="overlaps keys"):
        K.compact(keys, values, idx, out_keys=keys[:, :, 1:4])


def test_out_of_range_idx_rejected():
    g = gen(4)
    keys, values = randn(g, 1, 1, 5, 8), randn(g, 1, 1, 5, 8)
    for bad in (5, -1):
        with pytest.raises(ValueError, match="0 <= idx < T=5"):
            K.compact(keys, values, torch.tensor([[[0, bad]]], device=DEVICE))


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("inplace", [False, True])
def test_non_contiguous_index(path, inplace):
    """An index whose last dimension is strided (a view of a wider [B, H, K, 2] tensor, and a transposed
    [B, K, H] one) gathers the rows it names: the kernel reads the index through all its strides (it once
    read `idx[b, h] + k` whatever the stride of k)."""
    if path == "triton" and not TRITON_OK:
        pytest.skip("no Triton path")
    g = gen(7)
    B, H, T, D, Kk = 2, 3, 50, 24, 17
    for make in ("every_other", "transposed"):
        keys, values = randn(g, B, H, T, D), randn(g, B, H, T, D, dtype=torch.bfloat16)
        want = _sorted_idx(g, B, H, T, Kk)
        if make == "every_other":  # [B, H, K] with stride 2 along K: the odd columns are garbage
            wide = torch.full((B, H, Kk, 2), T + 5, dtype=torch.long, device=DEVICE)
            wide[..., 0] = want
            idx = wide[..., 0]
        else:  # [B, H, K] over a [B, K, H] buffer
            idx = want.transpose(1, 2).contiguous().transpose(1, 2)
        assert idx.stride(-1) != 1 and torch.equal(idx, want)
        nk, nv = naive_compact(keys, values, want)
        out = dict(out_keys=keys[:, :, :Kk], out_values=values[:, :, :Kk]) if inplace else {}
        with K.use_triton(path == "triton"):
            rk, rv = K.compact(keys, values, idx, **out)
        assert torch.equal(rk.cpu(), nk) and torch.equal(rv.cpu(), nv), make
