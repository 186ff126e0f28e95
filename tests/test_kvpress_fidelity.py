"""kvpress's DecodingPress teacher-forced in a batch (kvcompose.bench.kvpress_fidelity): rows of equal prompt
length score as when alone. Runs where kvpress is installed (CI's transformers 5.2 environment)."""

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from kvcompose import KVComposeError  # noqa: E402
from kvcompose.bench.fidelity import Trace, hidden_references  # noqa: E402
from kvcompose.bench.kvpress_fidelity import evaluate_press_batch, make_press, press_batches  # noqa: E402
from kvcompose.testing import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _trace(seed: int, prompt: int, n: int = 40, vocab: int = 128) -> Trace:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (prompt + n,), generator=g).tolist()
    return Trace(id=f"t{seed}", prompt_ids=ids[:prompt], trace_ids=ids[prompt:], question="q", answer=None,
                 kind="sampled")


PRESSES = {
    "snapkv": lambda: kvpress.SnapKVPress(window_size=4),
    "tova": lambda: kvpress.TOVAPress(),
    "knorm": lambda: kvpress.KnormPress(),
    "streaming_llm": lambda: kvpress.StreamingLLMPress(),
    "expected_attention": lambda: kvpress.ExpectedAttentionPress(),
    "keydiff": lambda: kvpress.KeyDiffPress(),
}


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_press_rows_equal_single_runs(name):
    model = tiny_model("llama", layers=2, seed=7)
    traces = [_trace(11, 14), _trace(12, 14), _trace(13, 14)]
    refs = hidden_references(model, traces, batch_size=3)
    press = lambda: kvpress.DecodingPress(base_press=PRESSES[name](), compression_interval=8, target_size=16)  # noqa: E731
    held: list[int] = []
    batch = evaluate_press_batch(model, traces, press(), refs, on_step=lambda c, t: held.append(c.layers[0].keys.shape[-2]))
    assert held[6] == 14 + 7 and held[7::8] == [16] * len(held[7::8]) and max(held) == 16 + 7  # target every 8 steps
    for b, t in enumerate(traces):
        alone = evaluate_press_batch(model, [t], press(), [refs[b]])[0]
        assert batch[b].kl == pytest.approx(alone.kl, abs=2e-5, rel=1e-3), name
        assert batch[b].top1 == alone.top1
    assert max(max(s.kl) for s in batch) > 1e-4


def test_press_batches_group_equal_lengths_and_refuse_padding():
    a, b, c = _trace(1, 10), _trace(2, 12), _trace(3, 10)
    assert [[t.id for t in g] for g in press_batches([a, b, c], 8)] == [["t1", "t3"], ["t2"]]
    model = tiny_model("llama", layers=2)
    with pytest.raises(KVComposeError, match="equal prompt"):
        evaluate_press_batch(model, [a, b], make_press("tova", 16, interval=8))


def test_cli_runs_kvpress_in_process_on_the_same_references(tmp_path):
    import json

    from kvcompose.bench import cli  # the `kvcompose` script: library commands + bench
    from kvcompose.testing import save_tiny_chat_model

    model_dir = save_tiny_chat_model(tmp_path / "model")
    data = tmp_path / "q.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"Ann has {i} red pens. How many?", "answer": "#### 1"})
                              for i in range(4)))
    out = tmp_path / "out"
    assert cli.main(["bench", "fidelity", "--model", model_dir, "--data", str(data), "--groups", "1", "--group-size",
                     "3", "--new-tokens", "24", "--kinds", "sampled", "--methods", "knorm", "--budgets", "40",
                     "--interval", "8", "--short-budgets", "--free-gen-prompts", "0", "--batch-size", "3",
                     "--kvpress-inprocess", "--kvpress-presses", "tova", "knorm", "--out", str(out)]) == 0
    rows = {(r["engine"].split()[0], r["method"]): r for r in json.loads((out / "fidelity.json").read_text())["rows"]}
    kp, kc = rows[("kvpress", "knorm")], rows[("kvcompose", "knorm")]
    assert kp["n_traces"] == 3 and "kl_ci" in kp and kp["kl_mean"] > 1e-4
    # kvcompose's knorm is kvpress's KnormPress rule (kept in time order, which attention does not see), and both
    # engines are scored against the same full-cache references
    assert [p["kl_mean"] for p in kp["per_trace"]] == pytest.approx([p["kl_mean"] for p in kc["per_trace"]], rel=0.01)
    assert rows[("kvpress", "tova")]["kl_mean"] > 0
    assert kp["fed"] == rows[("kvpress", "tova")]["fed"] == "8 tokens per call"  # both in CHUNKABLE
    # kvpress's own protocol, one token per forward call: the same rows
    one = tmp_path / "one"
    assert cli.main(["bench", "fidelity", "--model", model_dir, "--data", str(data), "--groups", "1", "--group-size",
                     "3", "--new-tokens", "24", "--kinds", "sampled", "--methods", "--budgets", "40", "--interval", "8",
                     "--short-budgets", "--free-gen-prompts", "0", "--batch-size", "3", "--kvpress-inprocess",
                     "--kvpress-presses", "knorm", "--kvpress-one-token", "--traces", str(out / "traces.json"),
                     "--out", str(one)]) == 0
    (row,) = [r for r in json.loads((one / "fidelity.json").read_text())["rows"] if r["engine"].startswith("kvpress")]
    assert row["fed"] == "one token per call"
    assert [p["kl_mean"] for p in row["per_trace"]] == pytest.approx([p["kl_mean"] for p in kp["per_trace"]], abs=1e-5)


def _distinct_trace(seed: int, prompt: int, n: int, vocab: int = 128) -> Trace:
    ids = (3 + torch.randperm(vocab - 3, generator=torch.Generator().manual_seed(seed))[: prompt + n]).tolist()
    return Trace(id=f"d{seed}", prompt_ids=ids[:prompt], trace_ids=ids[prompt:], question="q", answer=None,
                 kind="sampled")


def _recorded_scores(model, traces, refs, name: str, chunked: bool, interval: int = 32, budget: int = 16):
    """Every compression's scores (`score` of the base press, wrapped) and the rows, one token per call or in
    chunks of `interval`."""
    from kvcompose.bench.kvpress_fidelity import base_press

    seen: list[torch.Tensor] = []
    bp = base_press(name)
    inner = bp.score if name != "criticalkv" else bp.press.score

    def score(*args, **kwargs):
        s = inner(*args, **kwargs)
        seen.append(s.detach().clone())
        return s

    object.__setattr__(bp if name != "criticalkv" else bp.press, "score", score)
    press = kvpress.DecodingPress(base_press=bp, compression_interval=1 if chunked else interval, target_size=budget)
    rows = evaluate_press_batch(model, traces, press, refs, score_every=interval, chunk=interval if chunked else 1)
    return seen, rows


@pytest.mark.parametrize("name", ["streaming_llm", "knorm", "random", "tova", "expected_attention", "keydiff", "lagkv",
                                  "cur", "cap", "snapkv", "pyramidkv"])
def test_chunked_feeding_gives_the_one_token_protocols_scores_exactly_where_claimed(name):
    from kvcompose.bench.kvpress_fidelity import CHUNKABLE

    model = tiny_model("llama", layers=2, seed=7)
    # 14 + 100 tokens: three whole chunks of 32 and a partial one of 3 (which must not compress); no token twice in a
    # trace, since a repeated token ties exactly under KnormPress at layer 0 (RoPE keeps the norm) and the two
    # protocols break exact ties by their own float rounding
    traces = [_distinct_trace(21, 14, 100), _distinct_trace(22, 14, 100)]
    refs = hidden_references(model, traces, batch_size=2)
    one, rows1 = _recorded_scores(model, traces, refs, name, chunked=False)
    if name not in CHUNKABLE:  # SnapKV's window rotation reads the call's positions: refused, and truly different
        with pytest.raises(KVComposeError, match="cannot be fed in chunks"):
            make_press(name, 16, interval=32, chunked=True)
        many, _ = _recorded_scores(model, traces, refs, name, chunked=True)
        assert len(many) == len(one) == 2 * 3
        assert max((a - b).abs().max().item() for a, b in zip(one, many)) > 1e-3
        return
    many, rows2 = _recorded_scores(model, traces, refs, name, chunked=True)
    assert len(one) == len(many) == 2 * 3  # 2 layers x 3 compressions: the partial last chunk did not compress
    for a, b in zip(one, many):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for r1, r2 in zip(rows1, rows2):
        assert r1.kl == pytest.approx(r2.kl, abs=2e-5, rel=1e-4) and r1.top1 == r2.top1 and len(r1.kl) == 100
        assert (r1.max_held_tokens, r1.max_kv_bytes) == (r2.max_held_tokens, r2.max_kv_bytes)
    assert rows1[0].max_held_tokens == 16 + 31  # the one-token protocol's peak: budget + interval - 1


def test_chunked_feeding_refuses_a_press_that_would_compress_every_token():
    model = tiny_model("llama", layers=2)
    t = _trace(5, 10, 20)
    with pytest.raises(KVComposeError, match="compression_interval=1"):
        evaluate_press_batch(model, [t], make_press("knorm", 16, interval=8), chunk=8)
    with pytest.raises(KVComposeError, match="at least 1"):
        evaluate_press_batch(model, [t], make_press("knorm", 16, interval=8), chunk=0)
