"""Small guarantees of the decode path (issue 21): selectors never write padding into a real slot, segment
sums are deterministic (no atomics), the page pool grows geometrically and is sized once per event, the
scoring kernels default to tensor cores only on a GPU, and the hook leaves no state behind a forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcompose import HeadUtility, KVComposeCache, methods
from kvcompose import attention as hook
from kvcompose.kernels.ref import run_sums, sums_by_index
from kvcompose.kernels.scores import default_precision
from kvcompose.testing import tiny_model
from kvcompose.selectors import _kept_first
from kvcompose.stores import PagedStore, PagePool


def test_kept_first_with_slot_zero_kept_and_padding():
    """A kept set `[0, 3, -1]` (one head with a smaller budget): slot 0 is kept and must come first; the -1
    padding must not mark slot 0 as not kept (the old scatter wrote False there after True)."""
    order = torch.tensor([[[2, 0, 3, 1]]])
    kept = torch.tensor([[[0, 3, -1]]])
    out = _kept_first(order, kept)
    assert out[0, 0, :2].tolist() == [0, 3] and sorted(out[0, 0].tolist()) == [0, 1, 2, 3]


@given(t=st.integers(1, 60), block=st.integers(1, 8), seed=st.integers(0, 999))
def test_run_sums_equal_a_sequential_scatter_add(t, block, seed):
    """Run sums over consecutive segments (at most `block` long) are bit-identical to CPU `scatter_add_`,
    which adds in index order; no atomics, so the same on every backend."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, t, generator=g)
    pos = torch.stack([torch.randperm(4 * t, generator=g)[:t].sort().values for _ in range(6)]).view(2, 3, t)
    blk = pos // block  # distinct positions: a block holds at most `block` of them
    start = torch.ones_like(blk, dtype=torch.bool)
    start[..., 1:] = blk[..., 1:] != blk[..., :-1]
    seg = start.long().cumsum(-1) - 1
    want = torch.zeros(2, 3, t).scatter_add_(-1, seg, x)
    assert torch.equal(run_sums(x, seg, block), want)


@given(k=st.integers(1, 80), n=st.integers(1, 40), seed=st.integers(0, 999))
def test_sums_by_index_is_deterministic_and_matches_scatter_add(k, n, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(2, 3, k, generator=g)
    idx = torch.randint(0, n, (2, 3, k), generator=g)
    got = sums_by_index(v, idx, n)
    torch.testing.assert_close(got, torch.zeros(2, 3, n).scatter_add_(-1, idx, v), atol=1e-5, rtol=1e-5)
    perm = torch.randperm(k, generator=g)
    again = sums_by_index(v[..., perm], idx[..., perm], n)  # the same multiset in another order
    torch.testing.assert_close(again, got, atol=1e-5, rtol=1e-5)
    assert torch.equal(sums_by_index(v, idx, n), got)


def test_pool_grows_geometrically_and_reuses_pages():
    """Appending one token at a time to 8 heads for 1,000 steps copies the pool a handful of times (1.5x
    growth), not once per page; returned pages are handed out again first."""
    kv = PagedStore(2, 4, 8, 8, torch.float32, "cpu", page_size=4)
    for t in range(1000):
        kv.append(torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8), t)
    assert kv.pool.n_used == 2 * 4 * 250
    assert kv.pool.grows <= 20  # log_1.5(2000) ~ 19; at 1/32 growth it was ~ 170
    pool = PagePool(4, 8, 8, torch.float32, "cpu", slack=0.0)
    ids = pool.alloc(10)
    pool.release(ids[:3])
    assert sorted(pool.alloc(3).tolist()) == sorted(ids[:3].tolist()) and pool.reused == 3


def test_pool_sized_once_per_event_in_a_steady_state():
    """A paged layer at its steady state (per-head budgets moving, their total fixed) reallocates its pool
    neither between events nor at them."""
    model = tiny_model("llama", layers=1, heads=4, kv_heads=4, head_dim=16)
    pipe = methods.with_allocator(methods.snapkv(window=8), HeadUtility(floor=0.5, window=8, page_size=8))
    cache = KVComposeCache(model, pipe, 64, interval=16)
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    reallocs = []
    with torch.no_grad():
        model(input_ids=ids[:, :80], past_key_values=cache)
        for t in range(80, 300):
            model(input_ids=ids[:, t : t + 1], past_key_values=cache)
            pool = cache.layers[0].segment.store.pool
            reallocs.append(pool.grows + pool.shrinks)
    assert cache.layers[0].events >= 10
    assert reallocs[-1] == reallocs[len(reallocs) // 3]  # flat over the last two thirds of the run


def test_scores_use_tensor_cores_only_on_a_gpu():
    assert default_precision(torch.device("cpu")) == "ieee"


def test_the_hook_keeps_nothing_after_a_forward():
    """After a forward every hand-off was consumed and the mask note used: the hook's one state object is
    empty, and the cache is not marked."""
    model = tiny_model("llama", layers=2)
    cache = KVComposeCache(model, methods.h2o(), 16, interval=4)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones(1, 20, dtype=torch.long), past_key_values=cache)
    state = hook.hook_state()
    assert state.pending is None and state.mask is None and cache.kvcompose_missed is None


def test_host_lengths_mirror_the_device():
    """The paged store's host mirrors follow the device through appends, compaction and crop."""
    kv = PagedStore(2, 3, 8, 8, torch.float32, "cpu", page_size=4)
    kv.append(torch.randn(2, 3, 13, 8), torch.randn(2, 3, 13, 8), 0)
    pad = torch.full((6, 13), -1)
    for i, k in enumerate((5, 9, 13, 2, 7, 11)):
        pad[i, :k] = torch.randperm(13)[:k].sort().values
    kv.compact(pad.view(2, 3, 13))
    assert np.array_equal(kv.host_lengths, kv.lengths.numpy()) and kv.held == int(kv.lengths.max())
    kv.append(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8), 13)
    kv.crop(1)
    assert np.array_equal(kv.host_lengths, kv.lengths.numpy())
    with pytest.raises(Exception):
        kv.crop(99)
