"""kvcompose reproduces kvpress's decoding-time SnapKV rule exactly: `DecodingPress(SnapKVPress(window), interval,
B)` and the pipeline `ProtectRecent(window) + KvpressSnapKV + TopK` (benchmarks/snapkv_kvpress.py) keep the same
positions at every compression event of every layer, row and KV head, and give the same logits. Each of
kvpress's three differences from kvcompose's `snapkv` (queries re-rotated to the newest position, the window
sliced off after the softmax, pooling in top-k slot order) is needed: without it the kept sets differ."""

import os
import sys

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from snapkv_kvpress import kvpress_snapkv  # noqa: E402

from kvcompose import KVComposeCache  # noqa: E402
from kvcompose.bench.fidelity import Trace, evaluate_batch, hidden_references  # noqa: E402
from kvcompose.bench.kvpress_fidelity import evaluate_press_batch  # noqa: E402
from kvcompose.testing import tiny_model  # noqa: E402
from kvcompose.view import FAR_POSITION  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW, INTERVAL, BUDGET, PROMPT, STEPS = 4, 8, 16, 14, 56


class RecordingSnapKV(kvpress.SnapKVPress):
    """kvpress's SnapKVPress, unchanged, that also notes which positions each compression keeps."""

    def __post_init__(self):
        super().__post_init__()
        self.slots: dict[int, torch.Tensor] = {}  # layer -> positions of the cache's slots [B, H, T]
        self.kept: dict[int, list] = {}

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        from kvpress.utils import compute_n_kept

        if self.compression_ratio == 0:
            return keys, values
        layer = module.layer_idx
        b, h, k_len, _ = keys.shape
        prev = self.slots.get(layer, torch.arange(PROMPT).expand(b, h, PROMPT))
        start = int(prev.max()) + 1 if layer in self.slots else PROMPT
        new = torch.arange(start, start + k_len - prev.shape[-1]).expand(b, h, -1)
        slots = torch.cat([prev, new], dim=-1)
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        idx = scores.topk(compute_n_kept(k_len, self.compression_ratio), dim=-1).indices  # ScorerPress.compress
        self.slots[layer] = slots.gather(-1, idx)
        self.kept.setdefault(layer, []).append([[sorted(x.tolist()) for x in row] for row in self.slots[layer]])
        g = idx.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        return keys.gather(2, g).contiguous(), values.gather(2, g).contiguous()


def _traces(n: int = 2) -> list[Trace]:
    out = []
    for s in range(n):
        ids = torch.randint(3, 128, (PROMPT + STEPS,), generator=torch.Generator().manual_seed(30 + s)).tolist()
        out.append(Trace(id=f"t{s}", prompt_ids=ids[:PROMPT], trace_ids=ids[PROMPT:], question="q", answer=None,
                         kind="sampled"))
    return out


def _kvcompose_events(model, traces, refs, **kw):
    kept: dict[int, list] = {}
    events = [0] * model.config.num_hidden_layers

    def note(cache, fed):
        for i, layer in enumerate(cache.layers):
            if layer.events > events[i]:
                events[i] = layer.events
                pos, valid = layer.positions, layer.valid
                kept.setdefault(i, []).append([[sorted(p[v & (p < FAR_POSITION)].tolist()) for p, v in zip(r, vr)]
                                               for r, vr in zip(pos, valid)])

    kw = {"rope_theta": 10000.0, **kw}  # the tiny model's RoPE base
    make = lambda: KVComposeCache(model, kvpress_snapkv(window=WINDOW, **kw),  # noqa: E731
                                  budget=BUDGET, interval=INTERVAL)
    scores = evaluate_batch(model, traces, make, chunk=1, references=refs, on_chunk=note)
    return kept, scores


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, seed=9)
    traces = _traces()
    refs = hidden_references(model, traces, batch_size=2)
    base = RecordingSnapKV(window_size=WINDOW)
    press = kvpress.DecodingPress(base_press=base, compression_interval=INTERVAL, target_size=BUDGET)
    scores = evaluate_press_batch(model, traces, press, refs)
    return model, traces, refs, base.kept, scores


def test_kvcompose_reproduces_kvpress_snapkv(setup):
    model, traces, refs, kvpress_kept, kvpress_scores = setup
    kept, scores = _kvcompose_events(model, traces, refs)
    assert len(kvpress_kept[0]) == (PROMPT + STEPS - BUDGET) // INTERVAL  # an event every interval once over B
    assert kept == kvpress_kept
    for a, b in zip(scores, kvpress_scores):
        assert a.kl == pytest.approx(b.kl, abs=1e-5, rel=1e-3)
        assert a.top1 == b.top1
    assert max(max(s.kl) for s in scores) > 1e-4


@pytest.mark.parametrize("change", [{"rope_theta": None}, {"drop_window": False}, {"slot_order": False}])
def test_each_difference_changes_what_is_kept(setup, change):
    model, traces, refs, kvpress_kept, _ = setup
    kept, _ = _kvcompose_events(model, traces, refs, **change)
    assert kept != kvpress_kept


def test_sorted_kvpress_is_the_time_order_rule(setup):
    """With its kept slots sorted back into cache order (time order), kvpress's SnapKV is the same pipeline
    without the slot-order emulation: the pooling order is the only thing the sorting changes."""
    from kvcompose.bench.kvpress_fidelity import sorted_press

    model, traces, refs, _, unsorted = setup
    press = kvpress.DecodingPress(base_press=sorted_press(kvpress.SnapKVPress(window_size=WINDOW)),
                                  compression_interval=INTERVAL, target_size=BUDGET)
    kvp = evaluate_press_batch(model, traces, press, refs)
    _, kvc = _kvcompose_events(model, traces, refs, slot_order=False)
    for a, b in zip(kvc, kvp):
        assert a.kl == pytest.approx(b.kl, abs=1e-5, rel=1e-3)
    assert any(a.kl != pytest.approx(b.kl, abs=1e-5, rel=1e-3) for a, b in zip(kvp, unsorted))
