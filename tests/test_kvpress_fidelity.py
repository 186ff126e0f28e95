"""kvpress's DecodingPress teacher-forced in a batch (kvcompose.bench.kvpress_fidelity): rows of equal prompt
length score as when alone. Runs where kvpress is installed (CI's transformers 5.2 environment)."""

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from kvcompose import KVComposeError  # noqa: E402
from kvcompose.bench.fidelity import Trace, hidden_references  # noqa: E402
from kvcompose.bench.kvpress_fidelity import evaluate_press_batch, make_press, press_batches  # noqa: E402
from kvcompose.models import tiny_model  # noqa: E402

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
