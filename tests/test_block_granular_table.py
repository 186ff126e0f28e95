"""benchmarks/block_granular_table.py (issue 17): the variants wrap the presets as documented (the blocks
themselves are tested in test_paged_blocks.py); pooled numbers are token-weighted."""

import importlib.util
import math
from pathlib import Path

import pytest

from kvcompose import BlockGranular, ProtectRecent, methods
from kvcompose.bench.paged_blocks import BlockProtectValueNorm, RequestBlocks, VotingValueProtect
from kvcompose.bench.paged_blocks import RequestSchedule

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "block_granular_table.py"
_spec = importlib.util.spec_from_file_location("block_granular_table", _PATH)
bgt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bgt)


def test_variants_wrap_the_presets():
    assert repr(bgt.build_pipeline("h2o", 256, "token", 16)) == repr(methods.h2o())
    p = bgt.build_pipeline("rkv", 256, "layer-max", 16)
    assert isinstance(p.selector, BlockGranular) and not p.selector.per_head and p.selector.reduce == "max"
    assert p.interval == methods.rkv().interval == 128
    v = bgt.build_pipeline("vase", 256, "head-mean", 16)
    assert any(isinstance(x, BlockProtectValueNorm) for x in v.protectors)
    assert any(isinstance(x, ProtectRecent) for x in v.protectors)
    t = bgt.build_pipeline("vase-tokenprot", 256, "head-mean", 16)
    assert not any(isinstance(x, BlockProtectValueNorm) for x in t.protectors)
    r, event = bgt.build_request_pipeline("vase", 256, 16)
    assert isinstance(r.selector, RequestBlocks) and r.selector.event is event and event.interval == 64
    assert any(isinstance(x, VotingValueProtect) for x in r.protectors) and r.interval == 64
    assert isinstance(r.allocator, RequestSchedule)  # the layers' own schedule is off
    r, _ = bgt.build_request_pipeline("vase-tokenprot", 256, 16, "layer")
    assert not any(isinstance(x, BlockProtectValueNorm) for x in r.protectors)
    with pytest.raises(ValueError):
        bgt.build_pipeline("h2o", 256, "pages", 16)


def test_aggregate_is_token_weighted():
    base = {"method": "h2o", "budget": 128, "variant": "token", "recall_delta": None, "peak_held_tokens": 1}
    runs = [{**base, "kind": "sampled", "trace": "a", "n_tokens": 100, "top1_sum": 90.0, "kl_sum": 10.0,
             "nll_sum": 200.0, "nll_full_sum": 190.0},
            {**base, "kind": "worked", "trace": "b", "n_tokens": 300, "top1_sum": 150.0, "kl_sum": 3.0,
             "nll_sum": 600.0, "nll_full_sum": 600.0, "recall_delta": -1.0}]
    agg = bgt.aggregate(runs)
    both = agg[("h2o", 128, "token", "all")]
    assert both["n_tokens"] == 400 and both["top1"] == pytest.approx(240 / 400)
    assert both["kl_mean"] == pytest.approx(13 / 400) and both["ppl_ratio"] == pytest.approx(math.exp(10 / 400))
    assert both["recall_delta"] == -1.0
    assert agg[("h2o", 128, "token", "sampled")]["top1"] == pytest.approx(0.9)
