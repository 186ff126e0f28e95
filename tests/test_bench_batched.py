"""Batched teacher forcing (`kvcompose.bench.fidelity.evaluate_batch`): every row of a left-padded batch is
scored as if it ran alone: the same kept positions after every chunk, the same held tokens, and the same
per-token KL / top-1 within float tolerance."""

import pytest
import torch

from kvcompose import KVComposeCache, KVComposeError, methods
from kvcompose.bench.fidelity import (
    Trace, clear_reference_cache, evaluate_batch, evaluate_trace, hidden_references,
)
from kvcompose.models import tiny_model
from kvcompose.view import FAR_POSITION

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET, INTERVAL = 16, 8


def _trace(seed: int, prompt: int, n: int = 40, vocab: int = 128) -> Trace:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (prompt + n + 10,), generator=g).tolist()
    return Trace(id=f"t{seed}", prompt_ids=ids[:prompt], trace_ids=ids[prompt : prompt + n], question="q",
                 answer=None, kind="sampled", recall_ids=ids[prompt + n : prompt + n + 4],
                 recall_target_ids=ids[prompt + n + 4 :])


def _kept(cache, row: int, pad: int) -> list[list[list[int]]]:
    """Kept positions of one row, per layer and KV head, with the row's left padding taken off."""
    out = []
    for layer in cache.layers:
        pos, valid = layer.positions[row], layer.valid[row]
        out.append([(p[v & (p < FAR_POSITION)] - pad).tolist() for p, v in zip(pos, valid)])
    return out


# deterministic presets (random selectors draw one tensor for the whole batch: their rows differ by design)
PRESETS = {
    "h2o": lambda: methods.h2o(),
    "snapkv": lambda: methods.snapkv(window=4),
    "tova": lambda: methods.tova(),
    "rkv": lambda: methods.rkv(window=4, interval=INTERVAL),
    "streaming_llm": lambda: methods.streaming_llm(),
    "knorm": lambda: methods.knorm(),
    "pyramid_rkv": lambda: methods.pyramid_rkv(),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_rows_of_a_padded_batch_equal_single_runs(name):
    model = tiny_model("llama", layers=2, seed=4)
    clear_reference_cache()
    traces = [_trace(1, 10), _trace(2, 21), _trace(3, 14)]  # budget 16 is below one prompt, above two
    width = max(len(t.prompt_ids) for t in traces)
    make = lambda: KVComposeCache(model, PRESETS[name](), budget=BUDGET, interval=INTERVAL)  # noqa: E731

    batch_kept: list[list] = []
    scores = evaluate_batch(model, traces, make,
                            on_chunk=lambda c, fed: batch_kept.append(
                                [_kept(c, b, width - len(t.prompt_ids)) for b, t in enumerate(traces)]))
    events = held = 0
    for b, t in enumerate(traces):
        single_kept: list = []
        cache = make()
        single = evaluate_trace(model, t, cache)
        # replay the single run chunk by chunk to read its kept positions at the same points
        from kvcompose.bench.fidelity import _teacher_force  # the single-trace path's own loop

        replay = make()
        for i, _ in enumerate(_teacher_force(model, t, replay, INTERVAL)):
            if i:
                single_kept.append(_kept(replay, 0, 0))
        assert [k[b] for k in batch_kept] == single_kept, f"{name}: row {b} kept other tokens than alone"
        events = max(events, cache.layers[0].events)
        assert scores[b].kl == pytest.approx(single.kl, abs=2e-5, rel=1e-3)
        assert scores[b].top1 == single.top1
        assert scores[b].nll == pytest.approx(single.nll, abs=1e-4)
        assert scores[b].recall_logprob == pytest.approx(single.recall_logprob, abs=1e-4)
        assert scores[b].recall_logprob_full == pytest.approx(single.recall_logprob_full, abs=1e-4)
        held = max(held, single.max_held_tokens)
    # the batch holds as many slots as its longest row alone (shorter rows hold padding until the first event)
    assert {s.max_held_tokens for s in scores} == {held}
    assert events >= 3  # the method really compressed, several times
    assert max(max(s.kl) for s in scores) > 1e-4  # and it changed the output


def test_full_cache_batch_is_exact():
    model = tiny_model("llama", layers=2, seed=5)
    traces = [_trace(4, 9, n=24), _trace(5, 17, n=24)]
    scores = evaluate_batch(model, traces, lambda: KVComposeCache(model, methods.full()))
    for s in scores:
        assert max(s.kl) < 1e-6 and min(s.top1) == 1.0
        assert abs(s.recall_logprob - s.recall_logprob_full) < 1e-5


def test_hidden_references_match_the_full_cache_forward():
    model = tiny_model("llama", layers=2, seed=6)
    clear_reference_cache()
    t = _trace(6, 12, n=30)
    ref = hidden_references(model, [t, _trace(7, 20, n=30)], batch_size=2)[0]
    x = torch.tensor([t.prompt_ids + t.trace_ids[:-1]])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=x).logits[0, len(t.prompt_ids) - 1 :].float(), -1)
    assert torch.allclose(ref.logp(model, 0, 30), lp, atol=1e-5)
    assert torch.allclose(ref.nll, -lp.gather(1, torch.tensor(t.trace_ids)[:, None])[:, 0], atol=1e-5)


def test_batch_refuses_unequal_traces():
    model = tiny_model("llama", layers=2)
    with pytest.raises(KVComposeError, match="equally long"):
        evaluate_batch(model, [_trace(1, 10, n=20), _trace(2, 10, n=24)], lambda: KVComposeCache(model))
