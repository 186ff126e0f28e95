"""Paged decode attention over unequal per-head lengths: Triton (interpreted on CPU) vs the
PyTorch reference, the reference vs naive loops and vs ``kvcompose.attention.attend`` on the
padded view, and the layer core's padded path on a real ``PagedStore``.

The interpreter costs tens of ms per program here, so grids stay small: B * H <= 4, at most
3 KV splits, lengths below 80 tokens."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcompose.kernels as K
from kernel_testutil import DEVICE, DTYPES, FAST, TRITON_OK, gen, requires_triton
from kvcompose.kernels import paged_attention as PA
from kvcompose.kernels.paged_attention import gather_pages

seeds = st.integers(0, 2**31 - 1)

#: Outputs are in the input dtype; the GPU kernel also rounds the probabilities to the value
#: dtype before the P @ V product (FlashAttention style), hence a few units in the last place.
PAGED_TOL = {
    torch.float16: dict(atol=2e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=3e-2),
    torch.float32: dict(atol=2e-5, rtol=1e-4),
}


# ============================================================================ inputs
def make_case(seed, B, H, G, Q, D, Dv, P, lengths, dtype=torch.float32, window=None, spare_pages=3,
              qmode="decode", p_valid=0.8, strided_query=False):
    """Random paged storage: shuffled page ids, garbage in unused slots and page-table columns,
    ascending positions with gaps per head, queries after (decode) or among (prefill) the keys."""
    g = gen(seed)
    lengths = torch.as_tensor(lengths, dtype=torch.long).view(B, H)
    pages = (lengths + P - 1) // P
    M = int(pages.max()) + int(torch.randint(0, 2, (1,), generator=g))
    n_used = int(pages.sum())
    N = n_used + spare_pages
    perm = torch.randperm(N, generator=g)
    # garbage everywhere first: page ids (some -1, some valid but foreign), positions, validity
    page_table = torch.randint(-1, N, (B, H, M), generator=g)
    keys = torch.randn(N, P, D, generator=g)
    values = torch.randn(N, P, Dv, generator=g)
    gaps = torch.randint(1, 3, (B, H, 200), generator=g)
    max_pos = 0
    positions = torch.randint(0, 300, (N, P), generator=g)
    valid = torch.rand(N, P, generator=g) < 0.5
    c = 0
    for b in range(B):
        for h in range(H):
            n, L = int(pages[b, h]), int(lengths[b, h])
            ids = perm[c:c + n]
            c += n
            page_table[b, h, :n] = ids
            pos = gaps[b, h, :L].cumsum(0) - 1
            if L:
                max_pos = max(max_pos, int(pos[-1]))
            flat = positions[ids].reshape(-1)
            flat[:L] = pos
            positions[ids] = flat.view(n, P)
            ok = valid[ids].reshape(-1)
            ok[:L] = torch.rand(L, generator=g) < p_valid
            valid[ids] = ok.view(n, P)
    if qmode == "decode":
        qpos = torch.arange(max_pos + 1, max_pos + 1 + Q)
    else:  # prefill-like: queries at random existing-or-not positions, ascending
        qpos = torch.sort(torch.randperm(max_pos + 3, generator=g)[:Q]).values
        if qpos.numel() < Q:
            qpos = torch.arange(Q)
    # put garbage slots at the query positions: they must be ignored (outside each head's length)
    positions[n_used:] = qpos[0]
    if strided_query:  # the model hands over query.transpose(1, 2) of a [B, Q, Hq, D] tensor
        query = torch.randn(B, Q, H * G, D, generator=g).transpose(1, 2)
    else:
        query = torch.randn(B, H * G, Q, D, generator=g)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    fl = lambda t: t.to(dtype=dtype, device=DEVICE)  # noqa: E731
    return dict(query=fl(query), pool_keys=fl(keys), pool_values=fl(values), pool_positions=to(positions),
                pool_valid=to(valid), page_table=to(page_table), lengths=to(lengths), query_positions=to(qpos),
                scale=D ** -0.5, sliding_window=window)


def call(args, fn=None, **kw):
    a = dict(args)
    fn = fn or K.paged_decode_attention
    return fn(a.pop("query"), a.pop("pool_keys"), a.pop("pool_values"), a.pop("pool_positions"),
                                    a.pop("pool_valid"), a.pop("page_table"), a.pop("lengths"),
                                    a.pop("query_positions"), a.pop("scale"), a.pop("sliding_window"), **kw)


def naive(args):
    """float64 loops over the definition (build_mask semantics per head, softmax, sum)."""
    q = args["query"].double().cpu()
    kp, vp = args["pool_keys"].double().cpu(), args["pool_values"].double().cpu()
    pos, ok = args["pool_positions"].cpu(), args["pool_valid"].cpu()
    pt, lens, qpos = args["page_table"].cpu(), args["lengths"].cpu(), args["query_positions"].cpu()
    scale, win = args["scale"], args["sliding_window"]
    B, Hq, Q, D = q.shape
    H = pt.shape[1]
    G, P = Hq // H, kp.shape[1]
    out = torch.zeros(B, Q, Hq, vp.shape[-1], dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            toks = [(int(pt[b, h, t // P]), t % P) for t in range(int(lens[b, h]))]
            for i in range(Q):
                qp = int(qpos[i])
                allowed = []
                for page, s in toks:
                    kpos = int(pos[page, s])
                    a = kpos <= qp and bool(ok[page, s]) and (win is None or kpos > qp - win)
                    if a or kpos == qp:
                        allowed.append((page, s))
                if not allowed:
                    continue
                logits = [scale * float(q[b, hq, i] @ kp[page, s]) for page, s in allowed]
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                z = sum(w)
                out[b, i, hq] = sum(wi / z * vp[page, s] for wi, (page, s) in zip(w, allowed))
    return out


# ============================================================================ Triton vs reference
shapes = dict(
    BH=st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2)]),
    G=st.sampled_from([1, 2, 4, 8]),
    Q=st.integers(1, 3),
    D=st.sampled_from([8, 24, 64]),
    P=st.sampled_from([4, 8, 16]),
    dtype=st.sampled_from(DTYPES),
    seed=seeds,
)


@requires_triton
@FAST
@given(**shapes, lens=st.lists(st.integers(0, 77), min_size=4, max_size=4), splits=st.sampled_from([None, 1, 2, 3]),
       window=st.sampled_from([None, None, 5, 24]), qmode=st.sampled_from(["decode", "prefill"]),
       strided=st.booleans(), dv_same=st.booleans())
def test_paged_parity(BH, G, Q, D, P, dtype, seed, lens, splits, window, qmode, strided, dv_same):
    B, H = BH
    Dv = D if dv_same else 16
    args = make_case(seed, B, H, G, Q, D, Dv, P, lens[: B * H], dtype, window, qmode=qmode, strided_query=strided)
    a, r = both(args, num_splits=splits)
    assert a.shape == r.shape == (B, Q, H * G, Dv) and a.dtype == r.dtype == dtype
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, r, **PAGED_TOL[dtype])


def both(args, **kw):
    with K.use_triton(True):
        a = call(args, **kw)
    with K.use_triton(False):
        r = call(args)
    return a, r


@requires_triton
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_parity_long_heads_and_empty_heads(splits):
    """Heads far apart in length (one empty, one across several BLOCK_N tiles), GQA 4."""
    args = make_case(7, 2, 2, 4, 1, 32, 32, 8, [0, 150, 3, 64], torch.float32)
    a, r = both(args, num_splits=splits)
    torch.testing.assert_close(a, r, **PAGED_TOL[torch.float32])
    assert (a[0, :, :4] == 0).all()  # row 0, KV head 0 holds nothing: its 4 query heads get 0


# ============================================================================ reference semantics
@pytest.mark.parametrize("case", [
    dict(B=1, H=2, G=2, Q=2, D=8, Dv=8, P=4, lengths=[9, 4], window=None, qmode="prefill"),
    dict(B=2, H=1, G=1, Q=1, D=8, Dv=6, P=8, lengths=[13, 0], window=3, qmode="decode"),
    dict(B=1, H=1, G=8, Q=3, D=4, Dv=4, P=4, lengths=[17], window=None, qmode="decode", p_valid=0.3),
])
def test_reference_vs_naive(case):
    args = make_case(3, **case)
    with K.use_triton(False):
        r = call(args)
    torch.testing.assert_close(r.double().cpu(), naive(args), atol=1e-5, rtol=1e-5)
    if TRITON_OK:
        with K.use_triton(True):
            a = call(args, num_splits=2)
        torch.testing.assert_close(a.double().cpu(), naive(args), atol=1e-5, rtol=1e-5)


def test_own_position_is_always_attended():
    """A key at the query's position is attended even when it is padding or outside the
    window (build_mask); a padding key at another position is not."""
    P, D = 4, 8
    keys = torch.randn(2, P, D, generator=gen(0)).to(DEVICE)
    values = torch.arange(2 * P * 1, dtype=torch.float32).view(2, P, 1).expand(2, P, D).contiguous().to(DEVICE)
    pos = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], device=DEVICE)
    valid = torch.zeros(2, P, dtype=torch.bool, device=DEVICE)  # everything is padding
    pt = torch.tensor([[[1, 0]]], device=DEVICE)  # logical tokens: positions 4..7 then 0..3
    lens = torch.tensor([[8]], device=DEVICE)
    q = torch.randn(1, 1, 1, D, generator=gen(1)).to(DEVICE)
    for backend in ([False, True] if TRITON_OK else [False]):
        with K.use_triton(backend):
            out = K.paged_decode_attention(q, keys, values, pos, valid, pt, lens, torch.tensor([6], device=DEVICE),
                                           0.3, sliding_window=1)
        assert torch.allclose(out[0, 0, 0], values[1, 2]), backend  # only the key at position 6
        with K.use_triton(backend):
            out = K.paged_decode_attention(q, keys, values, pos, valid, pt, lens, torch.tensor([9], device=DEVICE), 0.3)
        assert (out == 0).all(), backend  # nothing allowed -> 0


def padded_view_like_storage(args):
    """The transient padded view `kvcompose.storage.PagedKV.padded` builds (FAR positions past a head)."""
    lens, pt = args["lengths"], args["page_table"]
    T = int(lens.max())
    k, inside = gather_pages(args["pool_keys"], pt, lens, T)
    v, _ = gather_pages(args["pool_values"], pt, lens, T)
    pos, _ = gather_pages(args["pool_positions"], pt, lens, T)
    ok, _ = gather_pages(args["pool_valid"], pt, lens, T, False)
    far = 2**40 + torch.arange(T, device=pos.device)
    return k, v, torch.where(inside, pos, far), ok & inside


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 7])
def test_matches_attend_on_the_padded_view(dtype, window):
    """Both paths equal kvcompose.attention.attend(build_mask(...)) over the padded view."""
    from kvcompose.attention import attend, build_mask

    args = make_case(11, 2, 2, 4, 2, 16, 16, 4, [5, 31, 18, 1], dtype, window, qmode="prefill")
    k, v, pos, ok = padded_view_like_storage(args)
    mask = build_mask(pos, ok, args["query_positions"], window)
    want = attend(args["query"], k, v, mask, args["scale"])
    with K.use_triton(False):
        r = call(args)
    torch.testing.assert_close(r, want, atol=0, rtol=0)  # the reference *is* attend on CPU
    if TRITON_OK:
        with K.use_triton(True):
            a = call(args)
        torch.testing.assert_close(a, want, **PAGED_TOL[dtype])


@pytest.mark.skipif(not TRITON_OK, reason="no Triton path")
def test_on_kvcompose_paged_storage():
    """On a real `kvcompose.stores.PagedStore` after appends and per-head compactions, the kernel equals the
    layer core's padded path (padded gather + per-head mask + attend)."""
    from kvcompose.attention import attend, build_mask
    from kvcompose.stores import PagedStore

    g = gen(5)
    B, H, G, D, P = 2, 2, 2, 16, 4
    kv = PagedStore(B, H, D, D, torch.float32, DEVICE, page_size=P)
    seen = 0
    for step, n in enumerate((11, 1, 1, 6, 1)):
        kv.append(torch.randn(B, H, n, D, generator=g).to(DEVICE), torch.randn(B, H, n, D, generator=g).to(DEVICE),
                  torch.arange(seen, seen + n, device=DEVICE))
        seen += n
        if step in (1, 3):  # keep a random ascending subset per head, of different sizes
            t = kv.held
            keep = torch.rand(B, H, t, generator=gen(step)).to(DEVICE) < 0.6
            keep[..., -1] = True
            idx = torch.arange(t, device=DEVICE).expand(B, H, t)
            kv.compact(torch.where(keep, idx, torch.full_like(idx, -1)))
    assert kv.lengths.unique().numel() > 1
    q = torch.randn(B, H * G, 1, D, generator=g).to(DEVICE)
    qpos = torch.tensor([seen - 1], device=DEVICE)
    view = kv.view()
    want = attend(q, view.keys, view.values, build_mask(view.positions, view.valid, qpos), D ** -0.5)
    pool = kv.pool
    with K.use_triton(True):
        got = K.paged_decode_attention(q, pool.keys, pool.values, pool.positions, pool.valid, kv.page_table, kv.lengths,
                                       qpos, D ** -0.5)
    torch.testing.assert_close(got, want, **PAGED_TOL[torch.float32])


@pytest.mark.skipif(not TRITON_OK, reason="no Triton path")
def test_layer_core_calls_the_paged_kernel():
    """Where the dispatch picks Triton, a paged layer's decode attention runs the paged kernel straight on the
    pages, and gives what the padded path gives."""
    from kvcompose import KVComposeCache, methods
    from kvcompose.testing import tiny_model

    model = tiny_model("llama", layers=1).to(DEVICE)
    ids = torch.randint(3, 128, (2, 20), generator=gen(1)).to(DEVICE)
    calls = []
    orig = PA.paged_decode_attention

    def run(triton):
        cache = KVComposeCache(model, methods.reason_alloc(base=methods.snapkv(window=2), window=4), budget=12,
                               interval=4)
        with K.use_triton(triton), torch.no_grad():
            model(input_ids=ids[:, :16], past_key_values=cache)
            out = [model(input_ids=ids[:, i : i + 1], past_key_values=cache).logits for i in range(16, 20)]
        assert cache.layers[0].events > 0 and cache.layers[0].lengths.unique().numel() > 1
        return torch.cat(out, 1)

    import kvcompose.stores.paged as layer_mod  # the paged store owns its attention

    def spy(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    real = layer_mod.paged_decode_attention
    layer_mod.paged_decode_attention = spy
    try:
        ref = run(False)
        assert not calls
        got = run(True)
    finally:
        layer_mod.paged_decode_attention = real
    assert calls  # the kernel ran for the decode steps
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


# ============================================================================ dispatch, errors, annotations
def test_cpu_default_is_the_reference(monkeypatch):
    args = make_case(2, 1, 1, 2, 1, 8, 8, 4, [6])
    if DEVICE.type != "cpu":
        pytest.skip("CPU rule")
    monkeypatch.delenv("KVCOMPOSE_FORCE_REFERENCE", raising=False)
    calls = []
    orig = PA.paged_decode_attention_reference
    monkeypatch.setattr(PA, "paged_decode_attention_reference", lambda *a, **k: calls.append(1) or orig(*a, **k))
    call(args)
    assert calls == [1]
    if TRITON_OK:
        with K.use_triton(True):
            call(args)
        assert calls == [1]  # the Triton path does not touch the reference


def _bad(**over):
    args = make_case(4, 1, 2, 2, 1, 8, 8, 4, [5, 2])
    args.update(over)
    return args


@pytest.mark.parametrize("over, match", [
    (dict(query=torch.zeros(1, 3, 1, 8)), "multiple of kv heads"),
    (dict(query=torch.zeros(1, 4, 1, 6)), "D=6"),
    (dict(query=torch.zeros(1, 4, 1, 8, dtype=torch.float16)), "share one dtype"),
    (dict(pool_valid=torch.zeros(2, 4, dtype=torch.uint8)), "bool"),
    (dict(lengths=torch.tensor([[5, 99]])), "lengths"),
    (dict(page_table=torch.tensor([[[0, 1], [-1, 0]]])), "page_table ids"),
    (dict(page_table=torch.tensor([[[0, 99], [2, 0]]])), "page_table ids"),
    (dict(query_positions=torch.tensor([1, 2])), "query_positions"),
    (dict(scale=float("nan")), "scale"),
    (dict(sliding_window=0), "sliding_window"),
])
def test_errors(over, match):
    """The kernel's own ValueError (undecorated function); the public function, possibly
    wrapped by the jaxtyping hook of tests/conftest.py, raises it or a TypeCheckError."""
    import inspect

    args = _bad(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in over.items()})
    with pytest.raises(ValueError, match=match):
        call(args, fn=inspect.unwrap(K.paged_decode_attention))
    with pytest.raises((ValueError, TypeError)):
        call(args)


def test_bad_num_splits():
    with pytest.raises((ValueError, TypeError), match="num_splits"):
        call(_bad(), num_splits=0)


@pytest.mark.parametrize("triton", [False, True])
def test_annotations_accept_valid_calls(triton):
    import inspect

    from beartype import beartype
    from jaxtyping import jaxtyped

    if triton and not TRITON_OK:
        pytest.skip("no Triton path")
    fn = jaxtyped(typechecker=beartype)(inspect.unwrap(K.paged_decode_attention))
    for dtype in DTYPES:
        a = make_case(6, 1, 2, 2, 2, 16, 8, 4, [3, 9], dtype)
        with K.use_triton(triton):
            fn(a["query"], a["pool_keys"], a["pool_values"], a["pool_positions"], a["pool_valid"], a["page_table"],
               a["lengths"], a["query_positions"], 0.25, None)
