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
