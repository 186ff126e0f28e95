"""DuoAttention's head types (`DuoHeads`) and LU-KV's budget curves (`HeadCurves`) against plain-loop references,
their calibration (`kvcompose.head_calibration`, `kvcompose calibrate --target duo|lukv`) against the model's own
eager attention weights, and the memory they really free in generate."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import random_view, ratio_curves
from kvcompose import KVComposeCache, KVComposeError, PagedStore, cli, methods
from kvcompose.blocks import DuoHeads, HeadCurves
from kvcompose.blocks.duo import streaming_mask
from kvcompose.blocks.lukv import head_keep_counts
from kvcompose.head_calibration import calibrate_heads, lukv_prune_curves
from kvcompose.testing import save_tiny_chat_model
from kvcompose.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ DuoHeads
def test_streaming_mask_and_budgets_match_loop_reference():
    scores = [[0.9, 0.1, 0.5], [0.2, 0.8, 0.05], [0.7, 0.3, 0.6]]
    mask = streaming_mask(scores, 0.5)  # round(9 * 0.5) = 4 (Python rounds half to even) lowest heads stream
    flat = sorted(((s, (l, h)) for l, row in enumerate(scores) for h, s in enumerate(row)))[: round(9 * 0.5)]
    want = {lh for _, lh in flat}
    assert {(l, h) for l in range(3) for h in range(3) if bool(mask[l, h])} == want
    duo = DuoHeads({"head_scores": scores}, streaming=0.5)
    view = random_view(b=2, h=3, t=30, d=8, seen=40, layer_idx=1, seed=0)
    got = duo.allocate(view, 12)
    for b in range(2):
        for h in range(3):
            held = int((view.positions[b, h] < 2**40).sum())
            assert int(got[b, h]) == (12 if (1, h) in want else max(held, 12))
    capped = DuoHeads({"head_scores": scores}, streaming=0.5, retrieval=20).allocate(view, 12)
    assert capped[0].tolist() == [12, 20, 12]  # layer 1: heads 0 (0.2) and 2 (0.05) stream, head 1 keeps at most 20


def test_duo_profile_checks(tmp_path):
    with pytest.raises(KVComposeError, match="not found"):
        DuoHeads(str(tmp_path / "none.json"))
    with pytest.raises(KVComposeError, match="head_scores"):
        DuoHeads({"head_scores": [[0.1], [0.2, 0.3]]})
    with pytest.raises(KVComposeError, match="streaming"):
        DuoHeads({"head_scores": [[0.1]]}, streaming=1.5)
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(KVComposeError, match="calibrate it on this model"):
        KVComposeCache(model, methods.duo_attention({"head_scores": [[0.1, 0.2, 0.3]] * 2}), budget=16)
    tsv = tmp_path / "full_attention_heads.tsv"
    tsv.write_text("0.1\t0.9\n0.8\t0.2\n")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"sink_size": 64, "recent_size": 256}))
    d = DuoHeads.from_pattern(tsv, cfg, streaming=0.5)
    assert d.mask.tolist() == [[True, False], [False, True]] and d.profile["sinks"] == 64


# ------------------------------------------------------------------------------------------ HeadCurves
def ref_keep_counts(prune, seq_len):
    ideal = [(1 - p) * seq_len for p in prune]
    total = max(len(prune), min(len(prune) * seq_len, round(sum(ideal))))
    base = [math.floor(x) for x in ideal]
    rem = total - sum(base)
    for i in sorted(range(len(ideal)), key=lambda i: -(ideal[i] - base[i]))[: max(rem, 0)]:
        base[i] += 1
    return [min(max(x, 1), seq_len) for x in base]


def test_head_keep_counts_match_loop_reference():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        prune = torch.rand(5, generator=g)
        n = int(torch.randint(10, 200, (1,), generator=g))
        assert head_keep_counts(prune, n).tolist() == ref_keep_counts(prune.tolist(), n)


def test_head_curves_allocate():
    curves = torch.tensor(ratio_curves(4, 2, seed=1))
    alloc = HeadCurves({"prune": curves.tolist()})
    view = random_view(b=2, h=2, t=40, d=8, seen=100, layer_idx=3, seed=1)
    got = alloc.allocate(view, 25)
    idx = round((1 - 25 / 100) * 100) - 1
    want = ref_keep_counts(curves[idx, 3].tolist(), 100)
    assert got.tolist() == [[min(w, 40) for w in want]] * 2
    assert alloc.keep_counts(0, 25, 20).tolist() == [20, 20]  # nothing to prune yet
    with pytest.raises(KVComposeError, match=r"\[99, layers"):
        HeadCurves({"prune": [[[0.5]]]})
    with pytest.raises(KVComposeError, match="calibrate it on this model"):
        KVComposeCache(tiny_model("llama", layers=2), methods.lukv(curves.tolist(), base=methods.keydiff()), budget=16)


def test_lukv_prune_curves_match_greedy_reference():
    curves = torch.rand(3, 2, 10, generator=torch.Generator().manual_seed(2)).sort(-1, descending=True).values
    got = lukv_prune_curves(curves)
    for i in (0, 24, 49, 98):
        n = round((1 - (i + 1) / 100) * 60)
        entries = sorted(((float(curves[l, h, j]), l, h) for l in range(3) for h in range(2) for j in range(10)),
                         reverse=True)[:n]
        for l in range(3):
            for h in range(2):
                kept = sum(1 for _, a, b in entries if (a, b) == (l, h))
                assert math.isclose(float(got[i, l, h]), 1 - kept / 10)


# ------------------------------------------------------------------------------------------ calibration
def _eager_attentions(model, ids):
    eager = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        return eager(input_ids=ids, output_attentions=True).attentions  # per layer [1, Hq, T, T]


def test_calibrate_heads_matches_eager_attention():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(3)
    prompt, trace = torch.randint(3, 128, (12,), generator=g), torch.randint(3, 128, (20,), generator=g)
    att = _eager_attentions(model, torch.cat([prompt, trace])[None])
    duo = calibrate_heads(model, [prompt], [trace], kind="duo", sinks=2, recent=5)
    t = 32
    for layer in range(2):
        for h in range(2):
            tot = 0.0
            for hq in (2 * h, 2 * h + 1):
                for p in range(12, t):
                    tot += sum(float(att[layer][0, hq, p, k]) for k in range(t) if 2 <= k <= p - 5) / (t - 12) / 2
            assert math.isclose(duo["head_scores"][layer][h], tot, rel_tol=1e-4, abs_tol=1e-6)
    lu = calibrate_heads(model, [prompt], [trace], kind="lukv", window=4)
    curves = torch.stack([torch.stack([att[layer][0, hq, t - 4:].sort(-1, descending=True).values.mean(0)
                                       for hq in range(4)]).reshape(2, 2, t).mean(1) for layer in range(2)])
    torch.testing.assert_close(torch.tensor(lu["prune"]), lukv_prune_curves(curves).float(), atol=1e-6, rtol=0)
    assert lu["fingerprint"]["num_hidden_layers"] == 2 and duo["kind"] == "kvcompose.duo_heads"


def test_duo_attention_frees_streaming_heads_memory():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    prof = {"head_scores": [[0.9, 0.1], [0.2, 0.8]]}  # heads (0, 1) and (1, 0) stream
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(4))
    cache = KVComposeCache(model, methods.duo_attention(prof, streaming=0.5, sinks=2), budget=12, interval=4)
    model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    seen = cache.get_seq_length()
    for i, layer in enumerate(cache.layers):
        assert isinstance(layer.segment.store, PagedStore)
        lengths = layer.lengths[0].tolist()
        stream = [1, 0][i]
        assert lengths[stream] < 12 + 4 and lengths[1 - stream] == seen  # retrieval heads keep every token
        pos = cache.kept_positions(i)[0, stream]
        assert {0, 1} <= set(pos.tolist())  # the sinks
    full = KVComposeCache(model, None)
    model.generate(input_ids=ids, past_key_values=full, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    assert cache.memory().total < 0.75 * full.memory().total  # half the heads really freed


def test_calibrate_cli_duo_and_lukv(tmp_path, capsys):
    tiny = save_tiny_chat_model(tmp_path / "model")
    data = tmp_path / "q.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"What is {i} plus {i}?", "answer": "#### 2"}) for i in range(3)))
    for target in ("duo", "lukv"):
        out = tmp_path / f"{target}.json"
        code = cli.main(["calibrate", "--target", target, "--model", tiny, "--data", str(data), "--n", "1", "--offset", "0",
                         "--new-tokens", "8", "--kind", "greedy", "--recent", "4", "--window", "4", "--out", str(out)])
        assert code == 0 and out.exists()
        assert f"{target} profile for" in capsys.readouterr().out
    prof = json.loads((tmp_path / "duo.json").read_text())
    assert prof["calibration"]["trace_tokens"] == 8 and all(0 <= x <= 1 for row in prof["head_scores"] for x in row)
    methods.duo_attention(str(tmp_path / "duo.json"))
    methods.lukv(str(tmp_path / "lukv.json"), base=methods.keydiff())
    assert cli.main(["calibrate", "--target", "duo", "--model", tiny, "--data", str(data), "--n", "1", "--offset", "0",
                     "--new-tokens", "8", "--recent", "-1", "--out", str(tmp_path / "x.json")]) == 2
