"""The roofline model of a decode step (`kvcompose.bench.roofline`, docs/gpu.md) against cases computed by hand."""

import math

import pytest

from kvcompose.bench import roofline as R

M, HW = R.QWEN3_8B, R.H200
MB = 1e6


def test_qwen3_8b_weights_by_hand():
    # per layer: q and o 4096 x 4096, k and v 4096 x 1024, MLP 3 x 4096 x 12288, norms 2 x 4096 + 2 x 128
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    assert layer == 192_946_432
    total = 36 * layer + 4096 + 151_936 * 4096  # final norm, LM head (the embedding: one row)
    assert M.weight_params() == total == 7_568_405_504
    assert (M.weight_params() + 151_936 * 4096) / 1e9 == pytest.approx(8.19, abs=0.01)  # Qwen3-8B's 8.2B


def test_full_cache_step_by_hand():
    st = R.step_cost("full", 4096, 1024)
    k = {x.name: x for x in st.kernels}
    attn = k["attention (SDPA, dense store)"]
    # 36 layers x 4096 tokens x 8 KV heads x (128 key + 128 value) x 2 bytes, plus the query and output rows
    assert attn.hbm_bytes == 36 * (4096 * 8 * 256 * 2 + 2 * 32 * 128 * 2) == 604_569_600
    assert attn.flops == 36 * 4 * 32 * 4096 * 128
    w = k["weights (GEMV)"]
    assert w.hbm_bytes == 7_568_405_504 * 2 + 4096 * 2
    # memory bound: predicted = bytes / 4.8 TB/s, and the floor is the same (nothing else moves)
    want = (w.hbm_bytes + attn.hbm_bytes) / 4.8e12
    assert st.predicted_s(HW) == pytest.approx(want)
    assert st.floor_s == pytest.approx((w.hbm_bytes + 36 * 4096 * 8 * 256 * 2) / 4.8e12)
    assert 1e3 * st.predicted_s(HW) == pytest.approx(3.28, abs=0.01)


def test_paged_attention_bytes_and_splits_by_hand():
    # one row, 8 KV heads of 1000 tokens: 63 pages of 16 slots each; 4 query rows per KV head
    b, f, s = R.paged_attention_cost(M, 1, 1000)
    slots = 8 * 63 * 16
    partial_splits = 3  # two waves: ceil(2 * 132 / 8) = 33 programs wanted, but >= 256 tokens each: 1008 // 256
    assert s == partial_splits
    kv = slots * (2 * 128 * 2 + 8 + 1) + 8 * 63 * 8
    io = 2 * 32 * 128 * 2
    partial = 2 * 3 * 8 * 4 * (128 + 2) * 4
    assert b == kv + io + partial
    assert f == 4 * 4 * 8 * 1000 * 128
    # 64 rows fill the GPU without splits: no partials
    b64, _, s64 = R.paged_attention_cost(M, 64, 1000)
    assert s64 == 1 and b64 == 64 * 8 * 63 * 16 * (2 * 128 * 2 + 9) + 64 * 8 * 63 * 8 + 64 * io


def test_host_tier_transfers_by_hand():
    # memory_hierarchy: HBM holds half the tokens seen, capped by the budget; the host holds the rest and every
    # host token comes back over PCIe at every step (36 layers x 8 heads x 256 dims x 2 bytes per token)
    st = R.step_cost("memory_hierarchy", 32768, 1024)
    assert st.held == 1024 and st.host == 32768 - 1024
    fetch = next(k for k in st.kernels if k.name.startswith("host tier: fetch"))
    assert fetch.pcie_bytes == 36 * 31744 * 8 * 256 * 2 == 4_680_843_264
    assert st.pcie_s(HW) * 1e3 == pytest.approx(4_680_843_264 / 55e9 * 1e3 + 36 * 31744 * 4096 / 55e9 * 1e3 / 64,
                                                 rel=1e-9)  # + the event's store, spread over 64 steps
    assert st.predicted_s(HW) == st.pcie_s(HW) > st.hbm_s(HW)  # PCIe bound
    assert st.floor_s == pytest.approx(4_680_843_264 / 55e9)


def test_events_follow_the_preset():
    # R-KV: its own interval (128), window scores over W=8 and the key-redundancy kernel (2 T^2 D per head)
    st = R.step_cost("rkv", 4096, 1024)
    assert st.interval == 128 and st.held == 1024 + 64
    k = {x.name: x for x in st.kernels}
    t = 1024 + 64 + 64  # an event sees budget + interval tokens on average
    kr = k["key redundancy"]
    assert kr.per == "event/128"
    assert kr.flops == pytest.approx(36 / 128 * 2 * 8 * t * t * 128)
    assert kr.hbm_bytes == pytest.approx(36 / 128 * 8 * (math.ceil(t / 64) * t * 128 * 2 + 13 * t))
    assert "window scores (W=8)" in k
    # SnapKV has no key redundancy; the full cache has no event at all
    assert "key redundancy" not in {x.name for x in R.step_cost("snapkv", 4096, 1024).kernels}
    assert all(x.per == "step" for x in R.step_cost("full", 4096, 1024).kernels)
    # a paged preset attends with the paged kernel
    assert any(x.name == "paged decode attention" for x in R.step_cost("reason_alloc", 4096, 1024).kernels)


def test_the_table_covers_every_preset():
    from kvcompose import methods

    steps = R.table()
    assert {s.preset for s in steps} == set(methods.PRESETS)
    assert len(steps) == 4 * (len(methods.PRESETS) - 1) + 2
    for s in steps:
        assert s.floor_s <= s.predicted_s(HW) * (1 + 1e-12)
    md = R.markdown(steps)
    assert md.count("\n") == len(steps) + 2
