import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import kvcompose.kernels as K
from kernel_testutil import (
    DEVICE, DTYPES, FAST, SCORE_TOL, TRITON_OK, both, gen, rand_bool, randn, requires_triton,
)

seeds = st.integers(0, 2**31 - 1)


# ============================================================================ naive loops
def naive_value_magnitude(values, kind):
    B, H, T, D = values.shape
    out = torch.zeros(B, H, T)
    v = values.float().cpu()
    for b in range(B):
        for h in range(H):
            for t in range(T):
                row = [float(x) for x in v[b, h, t]]
                out[b, h, t] = (max(row) - min(row)) if kind == "range" else math.sqrt(sum(x * x for x in row))
    return out


def naive_key_redundancy(keys, valid, threshold):
    B, H, T, D = keys.shape
    k = keys.double().cpu()
    out = torch.zeros(B, H, T, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            ok = [bool(valid[b, h, t]) for t in range(T)]
            kn = []
            for t in range(T):
                row = [float(x) for x in k[b, h, t]]
                nrm = max(math.sqrt(sum(x * x for x in row)), 1e-12)
                kn.append([x / nrm for x in row])
            S = [[0.0] * T for _ in range(T)]
            for i in range(T):
                for j in range(T):
                    if i != j and ok[i] and ok[j]:
                        S[i][j] = sum(a * c for a, c in zip(kn[i], kn[j]))
            for i in range(T):
                hits = [j for j in range(T) if i != j and ok[i] and ok[j] and S[i][j] > threshold]
                if hits:
                    S[i][max(hits)] = 0.0  # the newest duplicate of i is not counted
            n = max(sum(ok), 1)
            r = [sum(S[i][j] for i in range(T)) / n for j in range(T)]
            vals = [r[j] for j in range(T) if ok[j]]
            if vals:
                m = max(vals)
                z = sum(math.exp(x - m) for x in vals)
                for j in range(T):
                    out[b, h, j] = math.exp(r[j] - m) / z if ok[j] else 0.0
    return out


def naive_pool(s, ok, pool, kernel):
    """Pool over the in-range neighbours u with ok[u]; masked/out-of-range = zero padding for "avg"
    (window sum / kernel, as SnapKV's and VaSE's avg_pool1d with count_include_pad=True), -inf for "max"."""
    if pool == "none":
        return list(s)
    T, r = len(s), kernel // 2
    out = []
    for t in range(T):
        win = [s[u] for u in range(t - r, t + r + 1) if 0 <= u < T and ok[u]]
        if not win:
            out.append(0.0)
        else:
            out.append(sum(win) / kernel if pool == "avg" else max(win))
    return out


def naive_window_scores(q, k, kpos, kvalid, qpos, qvalid, scale, gqa, cand, pool, kernel):
    B, Hq, W, D = q.shape
    H, T = k.shape[1], k.shape[2]
    G = Hq // H
    qd, kd = q.double().cpu(), k.double().cpu()
    out = torch.zeros(B, H, T, dtype=torch.float64)
    for b in range(B):
        nq = sum(bool(qvalid[b, w]) for w in range(W))
        for h in range(H):
            ok = [bool(kvalid[b, h, t]) and (cand is None or bool(cand[b, h, t])) for t in range(T)]
            s = [0.0] * T
            for w in range(W):
                if not qvalid[b, w]:
                    continue
                allowed = [t for t in range(T) if ok[t] and int(kpos[b, h, t]) <= int(qpos[w])]
                if not allowed:
                    continue
                logit = [[scale * float(qd[b, h * G + g, w] @ kd[b, h, t]) for t in range(T)] for g in range(G)]
                groups = [[max(logit[g][t] for g in range(G)) for t in range(T)]] if gqa == "max" else logit
                for L in groups:
                    m = max(L[t] for t in allowed)
                    z = sum(math.exp(L[t] - m) for t in allowed)
                    for t in allowed:
                        s[t] += math.exp(L[t] - m) / z / len(groups) / nq
            pooled = naive_pool(s, ok, pool, kernel)
            for t in range(T):
                out[b, h, t] = pooled[t] if ok[t] else 0.0
    return out


# ============================================================================ value_magnitude
@requires_triton
@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 90), D=st.sampled_from([1, 8, 24, 64, 130]),
       dtype=st.sampled_from(DTYPES), kind=st.sampled_from(["range", "l2"]), seed=seeds)
def test_value_magnitude_parity(B, H, T, D, dtype, kind, seed):
    v = randn(gen(seed), B, H, T, D, dtype=dtype) * 3
    a, b = both(K.value_magnitude, v, kind)
    assert a.dtype == torch.float32 and a.shape == (B, H, T)
    torch.testing.assert_close(a, b, **SCORE_TOL[dtype])


@pytest.mark.parametrize("kind", ["range", "l2"])
def test_value_magnitude_reference_vs_naive(kind):
    v = randn(gen(1), 2, 2, 5, 7, dtype=torch.bfloat16)
    with K.force_reference():
        r = K.value_magnitude(v, kind)
    torch.testing.assert_close(r.cpu(), naive_value_magnitude(v, kind), atol=1e-5, rtol=1e-5)


def test_value_magnitude_strided_input():
    v = randn(gen(2), 2, 9, 3, 16).transpose(1, 2)  # [B, H, T, D] view of [B, T, H, D]
    for path in (True, False):
        if path and not K.HAS_TRITON:
            continue
        try:
            with K.use_triton(path):
                r = K.value_magnitude(v, "range")
        except RuntimeError:
            continue  # Triton path unavailable here
        torch.testing.assert_close(r, v.amax(-1) - v.amin(-1))


# ============================================================================ key_redundancy
def _keys_with_duplicates(g, B, H, T, D, dtype, dup):
    k = torch.randn(B, H, T, D, generator=g)
    if T > 1 and dup > 0:
        src = torch.randint(0, T, (dup,), generator=g)
        dst = torch.randint(0, T, (dup,), generator=g)
        k[:, :, dst] = k[:, :, src] * (0.5 + torch.rand(dup, 1, generator=g))  # same direction: cos = 1
        k[:, :, dst] += 0.05 * torch.randn(B, H, dup, D, generator=g)  # near-duplicates
    return k.to(dtype=dtype, device=DEVICE)


@requires_triton
@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 2), T=st.integers(1, 140), D=st.sampled_from([4, 8, 24, 64]),
       dtype=st.sampled_from(DTYPES), thr=st.floats(-0.2, 0.95), p_valid=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
       dup=st.integers(0, 12), seed=seeds)
def test_key_redundancy_parity(B, H, T, D, dtype, thr, p_valid, dup, seed):
    g = gen(seed)
    keys = _keys_with_duplicates(g, B, H, T, D, dtype, dup)
    valid = rand_bool(g, B, H, T, p=p_valid)
    # The rule is discontinuous at S == threshold: keep float noise away from it.
    kn = K.ref.normalize_keys(keys)
    S = kn @ kn.transpose(-1, -2)
    pair = valid[..., :, None] & valid[..., None, :] & ~torch.eye(T, dtype=torch.bool, device=DEVICE)
    assume(not bool(((S - thr).abs() < 1e-4)[pair].any()))
    a, b = both(K.key_redundancy, keys, valid, thr)
    assert a.dtype == torch.float32 and a.shape == (B, H, T)
    torch.testing.assert_close(a, b, **SCORE_TOL[dtype])
    assert bool((a[~valid] == 0).all())
    sums = a.sum(-1)
    has = valid.any(-1)
    torch.testing.assert_close(sums[has], torch.ones_like(sums[has]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("thr", [0.5, 0.0, 0.9])
def test_key_redundancy_reference_vs_naive(thr):
    g = gen(3)
    keys = _keys_with_duplicates(g, 2, 2, 9, 4, torch.float32, dup=4)
    valid = rand_bool(g, 2, 2, 9, p=0.8)
    valid[1, 1] = False  # a head with nothing valid -> all zero
    with K.force_reference():
        r = K.key_redundancy(keys, valid, thr)
    torch.testing.assert_close(r.cpu().double(), naive_key_redundancy(keys, valid, thr), atol=1e-6, rtol=1e-5)


def test_key_redundancy_reference_chunking_is_invisible():
    g = gen(4)
    keys = _keys_with_duplicates(g, 1, 2, 50, 8, torch.float32, dup=10)
    valid = rand_bool(g, 1, 2, 50)
    a = K.ref.key_redundancy(keys, valid, 0.5, chunk=7)
    b = K.ref.key_redundancy(keys, valid, 0.5, chunk=4096)
    torch.testing.assert_close(a, b)


def _masked_key_redundancy(keys, valid, threshold, chunk):
    """The reference as it was written first (full masks: diagonal, valid pairs, the last candidate by an int64
    search, then `masked_fill`), kept as the oracle of the in-place version, which must equal it bit for bit."""
    B, H, T, _ = keys.shape
    kn = K.ref.normalize_keys(keys) * valid.unsqueeze(-1)
    ar = torch.arange(T, device=keys.device)
    col = torch.zeros(B, H, T, device=keys.device)
    for i0 in range(0, T, chunk):
        i1 = min(T, i0 + chunk)
        S = kn[:, :, i0:i1] @ kn.transpose(-1, -2)
        offdiag = ar[i0:i1, None] != ar[None, :]
        S = S * offdiag
        pair_ok = valid[:, :, i0:i1, None] & valid[:, :, None, :] & offdiag
        cand = (S > threshold) & pair_ok
        last = torch.where(cand, ar, torch.full_like(ar, -1)).amax(-1)
        drop = (ar == last.unsqueeze(-1)) & (last.unsqueeze(-1) >= 0)
        col += S.masked_fill(drop, 0.0).sum(-2)
    n = valid.sum(-1, keepdim=True).clamp_min(1).float()
    return K.ref.masked_softmax(col / n, valid)


@pytest.mark.parametrize("thr", [0.5, 0.0, -0.3, 0.95])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_key_redundancy_reference_equals_its_masked_form_bit_for_bit(thr, chunk):
    g = torch.Generator().manual_seed(int(thr * 100) + chunk)
    for dtype, dup in ((torch.float32, 0), (torch.float32, 12), (torch.bfloat16, 12)):
        keys = _keys_with_duplicates(g, 2, 3, 45, 8, dtype, dup)
        valid = (torch.rand(2, 3, 45, generator=g) < 0.7).to(keys.device)
        want = _masked_key_redundancy(keys, valid, thr, chunk)
        assert torch.equal(K.ref.key_redundancy(keys, valid, thr, chunk=chunk), want), (dtype, dup)


def _masked_window_scores(queries, keys, key_pos, key_valid, query_pos, query_valid, scale, gqa, cand, pool, kernel):
    """The window-score reference as first written (fresh buffers for the scaled logits, the mask and the zeroing),
    the oracle of the in-place version, which must equal it bit for bit."""
    B, Hq, W, D = queries.shape
    H = keys.shape[1]
    q = queries.float().reshape(B, H, Hq // H, W, D)
    logits = torch.einsum("bhgwd,bhtd->bhgwt", q, keys.float()) * scale
    key_ok = key_valid if cand is None else key_valid & cand
    allowed = (key_ok[:, :, None, :] & (key_pos[:, :, None, :] <= query_pos[None, None, :, None])
               & query_valid[:, None, :, None])
    if gqa == "max":
        L = logits.amax(2).masked_fill(~allowed, float("-inf"))
        p = torch.where(allowed, torch.softmax(L, -1), torch.zeros_like(L))
    else:
        a = allowed[:, :, None]
        p = torch.softmax(logits.masked_fill(~a, float("-inf")), -1)
        p = torch.where(a, p, torch.zeros_like(p)).mean(2)
    s = (p * K.ref.query_weights(query_valid)[:, None, :, None]).sum(2)
    return K.ref.pool_scores(s, key_ok, pool, kernel)


@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("pool,kernel", [("none", 1), ("avg", 5), ("max", 3)])
def test_window_scores_reference_equals_its_masked_form_bit_for_bit(gqa, pool, kernel):
    g = torch.Generator().manual_seed(11)
    for trial in range(12):
        B, H, G, W, T, D = 2, 2, 1 + trial % 3, 1 + 3 * trial, 5 + 6 * trial, 8
        dtype = torch.bfloat16 if trial % 4 == 0 else torch.float32
        q = torch.randn(B, H * G, W, D, generator=g).to(dtype)
        k = torch.randn(B, H, T, D, generator=g).to(dtype)
        kpos = torch.sort(torch.randint(0, 90, (B, H, T), generator=g), -1).values
        kv = torch.rand(B, H, T, generator=g) < 0.8
        qpos = torch.sort(torch.randint(0, 90, (W,), generator=g)).values
        qv = torch.rand(B, W, generator=g) < (0.0 if trial == 5 else 0.8)  # trial 5: every query masked
        cand = (torch.rand(B, H, T, generator=g) < 0.7) if trial % 2 else None
        args = [x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in (q, k, kpos, kv, qpos, qv)]
        cand = None if cand is None else cand.to(DEVICE)
        want = _masked_window_scores(*args, 0.3, gqa, cand, pool, kernel)
        got = K.ref.window_attention_scores(*args, 0.3, gqa, cand, pool, kernel)
        assert torch.equal(got, want), trial


def test_key_redundancy_newest_duplicate_survives():
    """Three copies of one key (tokens 0, 2, 3): each row drops its newest duplicate, so
    the oldest copy counts as the most redundant and the newest as the least."""
    D = 8
    g = gen(5)
    base = torch.randn(3, D, generator=g)
    k = torch.stack([base[0], base[1], base[0], 2 * base[0], base[2]])[None, None].to(DEVICE)
    valid = torch.ones(1, 1, 5, dtype=torch.bool, device=DEVICE)
    r = naive_key_redundancy(k, valid, 0.99)
    with K.force_reference():
        got = K.key_redundancy(k, valid, 0.99)
    torch.testing.assert_close(got.cpu().double(), r, atol=1e-6, rtol=1e-5)
    # Row 0 drops col 3, row 2 drops col 3, row 3 drops col 2: col 0 keeps 2 hits, col 2
    # one, col 3 none.
    assert got[0, 0, 0] > got[0, 0, 2] > got[0, 0, 3]


# ============================================================================ window scores
def _window_inputs(g, B, H, G, W, T, D, dtype, p_kv=0.9, p_qv=0.9, with_cand=True):
    q = randn(g, B, H * G, W, D, dtype=dtype)
    k = randn(g, B, H, T, D, dtype=dtype)
    # Increasing positions with gaps (what a compacted cache holds), window at the end.
    kpos = torch.cumsum(torch.randint(1, 3, (B, H, T), generator=g), -1).to(DEVICE)
    top = int(kpos.max()) + 1
    qpos = torch.sort(torch.randint(max(0, top - T), top + W, (W,), generator=g)).values.to(DEVICE)
    kvalid = rand_bool(g, B, H, T, p=p_kv)
    qvalid = rand_bool(g, B, W, p=p_qv)
    cand = rand_bool(g, B, H, T, p=0.7) if with_cand else None
    return q, k, kpos, kvalid, qpos, qvalid, cand


@requires_triton
@FAST
@given(B=st.integers(1, 2), H=st.integers(1, 2), G=st.sampled_from([1, 2, 4, 8]), W=st.integers(1, 20),
       T=st.integers(1, 100), D=st.sampled_from([8, 16, 24, 64]), dtype=st.sampled_from(DTYPES),
       gqa=st.sampled_from(["mean", "max"]), pool=st.sampled_from(["none", "avg", "max"]),
       kernel=st.sampled_from([1, 3, 5, 7]), with_cand=st.booleans(), p_qv=st.sampled_from([0.0, 0.6, 1.0]),
       scale=st.floats(0.05, 1.0), seed=seeds)
def test_window_scores_parity(B, H, G, W, T, D, dtype, gqa, pool, kernel, with_cand, p_qv, scale, seed):
    q, k, kpos, kvalid, qpos, qvalid, cand = _window_inputs(gen(seed), B, H, G, W, T, D, dtype,
                                                            p_qv=p_qv, with_cand=with_cand)
    a, b = both(K.window_attention_scores, q, k, kpos, kvalid, qpos, qvalid, scale,
                gqa=gqa, candidates=cand, pool=pool, kernel=kernel)
    assert a.dtype == torch.float32 and a.shape == (B, H, T)
    torch.testing.assert_close(a, b, **SCORE_TOL[dtype])
    key_ok = kvalid if cand is None else kvalid & cand
    assert bool((a[~key_ok] == 0).all())


@requires_triton
@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_window_scores_parity_long_window(gqa):
    """W > 64 exercises the loop over query tiles; T > 64 the loop over key tiles."""
    q, k, kpos, kvalid, qpos, qvalid, cand = _window_inputs(gen(6), 1, 2, 2, 70, 130, 16, torch.bfloat16)
    a, b = both(K.window_attention_scores, q, k, kpos, kvalid, qpos, qvalid, 0.25, gqa=gqa, candidates=cand,
                pool="avg", kernel=5)
    torch.testing.assert_close(a, b, **SCORE_TOL[torch.bfloat16])


@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("pool,kernel", [("none", 5), ("avg", 3), ("max", 5), ("avg", 1)])
@pytest.mark.parametrize("with_cand", [True, False])
def test_window_scores_reference_vs_naive(gqa, pool, kernel, with_cand):
    q, k, kpos, kvalid, qpos, qvalid, cand = _window_inputs(gen(7), 2, 2, 2, 3, 8, 4, torch.float32,
                                                            p_kv=0.8, p_qv=0.7, with_cand=with_cand)
    qpos[0] = -5  # a query that sees no key
    with K.force_reference():
        r = K.window_attention_scores(q, k, kpos, kvalid, qpos, qvalid, 0.5, gqa=gqa, candidates=cand,
                                      pool=pool, kernel=kernel)
    expect = naive_window_scores(q, k, kpos, kvalid, qpos, qvalid, 0.5, gqa, cand, pool, kernel)
    torch.testing.assert_close(r.cpu().double(), expect, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("pool", ["avg", "max", "none"])
@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_window_scores_padding_invariance(pool, gqa):
    """Left-padding a row (invalid slots in front) leaves its scores unchanged."""
    q, k, kpos, kvalid, qpos, qvalid, cand = _window_inputs(gen(10), 1, 2, 2, 4, 12, 8, torch.float32)
    kvalid[:] = True
    pad = 5
    kp = torch.cat([torch.randn(1, 2, pad, 8, device=DEVICE), k], 2)
    pp = torch.cat([torch.zeros(1, 2, pad, dtype=kpos.dtype, device=DEVICE), kpos], 2)
    vp = torch.cat([torch.zeros(1, 2, pad, dtype=torch.bool, device=DEVICE), kvalid], 2)
    cp = torch.cat([torch.ones(1, 2, pad, dtype=torch.bool, device=DEVICE), cand], 2)
    for path in ([True] if TRITON_OK else []) + [False]:
        with K.use_triton(path):
            a = K.window_attention_scores(q, k, kpos, kvalid, qpos, qvalid, 0.4, gqa=gqa, candidates=cand,
                                          pool=pool, kernel=5)
            b = K.window_attention_scores(q, kp, pp, vp, qpos, qvalid, 0.4, gqa=gqa, candidates=cp,
                                          pool=pool, kernel=5)
        torch.testing.assert_close(b[..., pad:], a, atol=1e-7, rtol=1e-6)
        assert bool((b[..., :pad] == 0).all())


def test_window_scores_no_valid_query_is_zero():
    q, k, kpos, kvalid, qpos, qvalid, cand = _window_inputs(gen(8), 1, 1, 2, 4, 10, 8, torch.float32)
    qvalid[:] = False
    for path in ([True] if K.HAS_TRITON else []) + [False]:
        try:
            with K.use_triton(path):
                r = K.window_attention_scores(q, k, kpos, kvalid, qpos, qvalid, 1.0, pool="max")
        except RuntimeError:
            continue
        assert bool((r == 0).all())


def test_window_scores_unpooled_sums_to_one_per_head():
    """Without pooling, every valid query that sees a key spreads mass 1 over keys."""
    q, k, kpos, kvalid, qpos, qvalid, _ = _window_inputs(gen(9), 2, 2, 4, 5, 30, 8, torch.float32)
    qpos[:] = int(kpos.max())  # every query sees every key
    qvalid[:] = True
    kvalid[..., 0] = True
    for gqa in ("mean", "max"):
        with K.force_reference():
            r = K.window_attention_scores(q, k, kpos, kvalid, qpos, qvalid, 0.3, gqa=gqa)
        torch.testing.assert_close(r.sum(-1), torch.ones(2, 2, device=DEVICE), atol=1e-5, rtol=0)
