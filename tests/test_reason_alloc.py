"""ReasonAlloc: layer budgets capped at the tokens seen (surplus to the other layers, against a loop-level
water-filling), the shipped profile found by the model's name and config (`profile="auto"`), and one-call
calibration (`kvcompose.calibration.calibrate`, `kvcompose calibrate`)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaConfig

import kvcompose.allocators.layers as layers_mod
from kvcompose import KVComposeCache, KVComposeError, ReasoningWave, methods
from kvcompose.allocators import water_fill
from kvcompose.calibration import calibrate, find_profile, model_fingerprint, model_id
from kvcompose.cli import build_parser
from kvcompose.testing import tiny_model

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64)


def _water_fill_loop(static, cap):
    """Give capped layers `cap`; share the rest over the others in proportion to their static budgets,
    repeating while a share exceeds the cap (a plain loop)."""
    total, n = sum(static), len(static)
    if cap * n <= total:
        return [float(cap)] * n
    out = [None] * n
    while True:
        free = [i for i in range(n) if out[i] is None]
        left = total - sum(x for x in out if x is not None)
        base = sum(static[i] for i in free)
        over = [i for i in free if left * static[i] / base >= cap]
        if not over:
            for i in free:
                out[i] = left * static[i] / base
            return out
        for i in over:
            out[i] = float(cap)


@given(static=st.lists(st.integers(1, 400), min_size=1, max_size=12), cap=st.integers(1, 500))
def test_water_fill_matches_a_loop(static, cap):
    got = water_fill(static, cap)
    ref = _water_fill_loop(static, cap)
    assert sum(got) == (sum(static) if cap * len(static) > sum(static) else cap * len(static))
    assert all(x <= cap for x in got)
    assert all(abs(g - r) < 1.0 for g, r in zip(got, ref))  # largest-remainder rounding of the same shares


def test_layer_budgets_are_capped_at_the_tokens_seen():
    wave = ReasoningWave({"demand": [40.0, 4.0, 4.0, 8.0]}, floor=4)
    static = wave.layer_budgets(4, 64)
    assert sum(static) == 256 and static[0] > 128
    seen = 120
    capped = [wave.layer_budget(i, 4, 64, seen) for i in range(4)]
    assert capped[0] == seen and sum(capped) == 256 and all(c >= s for c, s in zip(capped[1:], static[1:]))
    assert [wave.layer_budget(i, 4, 64, 10_000) for i in range(4)] == static  # long sequences: static
    assert [wave.layer_budget(i, 4, 64, 50) for i in range(4)] == [50] * 4  # short ones: everything held
    assert [wave.layer_budget(i, 4, 64, 0) for i in range(4)] == static  # seen unknown
    flat = ReasoningWave({"demand": [40.0, 4.0, 4.0, 8.0]}, floor=4, cap=False)
    assert [flat.layer_budget(i, 4, 64, seen) for i in range(4)] == static


def test_capped_wave_in_a_cache_uses_the_whole_total():
    model = tiny_model("llama", layers=4)
    wave = {"demand": [80.0, 2.0, 2.0, 4.0]}
    cache = KVComposeCache(model, methods.reason_alloc(methods.rkv(window=2), profile=wave, floor=2, window=4,
                                                       page_size=4), budget=32, interval=8)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=34, min_new_tokens=34, do_sample=False)
    seen = cache.get_seq_length()
    budgets = [cache.layer_budget(i) for i in range(4)]
    static = cache.pipeline.allocator.layer_budgets(4, 32)
    assert static[0] > seen and budgets[0] == seen and sum(budgets) == 4 * 32  # the surplus went to layers 1-3
    assert all(b > s for b, s in zip(budgets[1:], static[1:]))
    assert cache.layers[0].events == 0 and bool((cache.layers[0].lengths == seen).all())  # layer 0 holds all
    for i, layer in enumerate(cache.layers[1:], 1):  # heads share H x the layer budget (+ one interval, +-1 drift)
        assert layer.events > 0 and int(layer.lengths.sum()) <= layer.num_heads * (budgets[i] + 8 + 2)


def test_shipped_profile_is_found_by_name_and_config():
    shipped = layers_mod.shipped_profiles()
    assert any(p["model"] == "SmolLM2-135M-Instruct" for p in shipped)
    prof = next(p for p in shipped if p["model"] == "SmolLM2-135M-Instruct")
    assert len(prof["demand"]) == 30 and prof["fingerprint"]["num_key_value_heads"] == 3
    assert "/" not in json.dumps(prof.get("calibration", {}))  # no machine paths in package data
    cfg = LlamaConfig(**SMOLLM2)
    assert find_profile(cfg)["file"] == prof["file"]
    assert find_profile(LlamaConfig(**{**SMOLLM2, "num_hidden_layers": 24})) is None
    assert find_profile(tiny_model("llama", layers=2)) is None
    assert model_fingerprint(cfg)["num_hidden_layers"] == 30 and model_id(cfg) == "llama"


def test_auto_profile_resolution_and_the_note(monkeypatch):
    model = tiny_model("llama", layers=3, kv_heads=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cache = KVComposeCache(model, methods.reason_alloc(methods.rkv(window=2), floor=4, window=4), budget=32)
    assert any("no shipped ReasoningWave profile" in str(x.message) for x in w)
    assert [cache.layer_budget(i) for i in range(3)] == [32, 32, 32]  # head-wise only: uniform layers
    fake = {"kind": layers_mod.PROFILE_KIND, "model": "tiny", "demand": [9.0, 1.0, 2.0], "file": "tiny.json",
            "fingerprint": {**model_fingerprint(model)}}
    monkeypatch.setattr(layers_mod, "shipped_profiles", lambda: [fake])
    monkeypatch.setattr("kvcompose.calibration.shipped_profiles", lambda: [fake])
    for pipe in (methods.reason_alloc(methods.rkv(window=2), floor=4, window=4),  # by layer / KV-head count
                 methods.reason_alloc(methods.rkv(window=2), floor=4, window=4, model=model)):  # by config
        cache = KVComposeCache(model, pipe, budget=32)
        assert cache.pipeline.allocator.layer_budgets(3, 32) == ReasoningWave(fake).layer_budgets(3, 32)
        assert cache.pipeline.allocator.layer_budgets(3, 32)[0] > 32
    other = tiny_model("llama", layers=3, kv_heads=4, heads=4)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pipe = methods.reason_alloc(methods.rkv(window=2), floor=4, window=4, model=other)
    assert pipe.allocator.layers is None and any("no shipped" in str(x.message) for x in w)


class _Tok:
    """A one-character-per-token tokenizer with a chat template (for `calibrate` on a tiny model)."""

    eos_token_id, pad_token_id, eos_token = 2, 0, "\x02"

    def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in msgs) + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False, **kw):
        return {"input_ids": [3 + ord(c) % 120 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_calibrate_from_a_question_file(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(6)))
    model = tiny_model("llama", layers=3)
    out = tmp_path / "prof.json"
    prof = calibrate(model, _Tok(), data, out, n=2, offset=3, new_tokens=8, kind="greedy")
    saved = json.loads(out.read_text())
    assert saved["demand"] == prof["demand"] and len(prof["demand"]) == 3
    assert saved["calibration"]["questions"] == "q.jsonl lines 3-4" and saved["fingerprint"]["num_hidden_layers"] == 3
    assert str(tmp_path) not in out.read_text()
    assert sum(ReasoningWave(out).layer_budgets(3, 16)) == 48
    with pytest.raises(KVComposeError, match="n must"):
        calibrate(model, _Tok(), data, None, n=0)
    args = build_parser().parse_args(["calibrate", "--data", str(data), "--out", str(out), "--n", "2"])
    assert args.command == "calibrate" and args.n == 2 and args.offset == 1000 and args.new_tokens == 512
