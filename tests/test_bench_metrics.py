"""The fidelity benchmark's metrics and its teacher-forcing protocol (kvcompose.bench.fidelity)."""

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcompose import KVComposeCache, KVComposeError, methods
from kvcompose.bench.fidelity import (
    FidelityResult, Trace, TraceScore, clear_reference_cache, evaluate, extract_answer, gsm8k_answer,
    kl_divergence, load_questions, perplexity_ratio, teacher_force_logits, top1_agreement,
)
from kvcompose.testing import tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


# ------------------------------------------------------------------------------ metrics on synthetic data
@given(st.integers(0, 2**31 - 1), st.integers(2, 40))
def test_kl_of_identical_distributions_is_zero(seed, v):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(5, v, generator=g) * 3, dim=-1)
    assert torch.allclose(kl_divergence(lp, lp.clone()), torch.zeros(5), atol=1e-7)
    assert top1_agreement(lp, lp.clone()).mean().item() == 1.0


def test_kl_known_value():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL(p||q) = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
    p = torch.tensor([[0.5, 0.5]]).log()
    q = torch.tensor([[0.25, 0.75]]).log()
    assert kl_divergence(p, q).item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-6)
    # a known perturbation: adding a constant to one logit of a uniform distribution over V tokens
    v, d = 10, 1.0
    ref = torch.full((1, v), -math.log(v))
    logits = torch.zeros(1, v)
    logits[0, 0] = d
    other = torch.log_softmax(logits, dim=-1)
    z = math.exp(d) + v - 1
    # KL(uniform || q) = sum 1/v (ln(1/v) - ln q_i) = -ln v - (1/v)(d - v ln z)
    expected = -math.log(v) - (d - v * math.log(z)) / v
    assert kl_divergence(ref, other).item() == pytest.approx(expected, abs=1e-6)
    logits[0, 3] = 2 * d  # move the maximum: the argmax no longer agrees
    assert top1_agreement(other, torch.log_softmax(logits, dim=-1)).item() == 0.0


def test_top1_agreement_counts_rows():
    a = torch.log_softmax(torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]), -1)
    b = torch.log_softmax(torch.tensor([[2.0, 0.0], [2.0, 0.0], [2.0, 1.0]]), -1)
    assert top1_agreement(a, b).tolist() == [1.0, 0.0, 1.0]


def test_perplexity_ratio():
    assert perplexity_ratio([1.0, 2.0], [1.0, 2.0]) == 1.0
    assert perplexity_ratio([2.0, 2.0], [1.0, 1.0]) == pytest.approx(math.e)
    with pytest.raises(KVComposeError):
        perplexity_ratio([1.0], [1.0, 2.0])


def test_result_pooling_and_curve():
    a = TraceScore("a", "sampled", [1.0, 0.0], [0.0, 0.2], [1.0, 1.0], [1.0, 1.0], 10, 100, 200, -1.0, -0.5)
    b = TraceScore("b", "sampled", [1.0, 1.0, 1.0], [0.1, 0.1, 0.4], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], 12, 120, 240)
    r = FidelityResult.merge([FidelityResult([a]), FidelityResult([b])])
    assert r.top1 == pytest.approx(4 / 5)
    assert r.kl_mean == pytest.approx(0.8 / 5)
    assert r.ppl_ratio == 1.0
    assert r.max_held_tokens == 12 and r.max_kv_bytes == 120
    assert r.kl_curve(bucket=2) == pytest.approx([(0.0 + 0.2 + 0.1 + 0.1) / 4, 0.4])
    assert r.recall_delta == pytest.approx(-0.5)
    json.dumps(r.summary())


def test_answer_extraction():
    assert gsm8k_answer("so 9 * 2 = 18\n#### 1,018") == "1018"
    assert extract_answer("She makes 9 * 2 = $18.00 every day.") == "18"
    assert extract_answer("no number") is None
    assert gsm8k_answer(None) is None


def test_free_generation_agreement_needs_a_number():
    from kvcompose.bench.fidelity import FreeGenResult, FreeGenRow

    rows = [FreeGenRow("a", "7", "7", "7", "x", "x", 10, 10),      # agree, correct
            FreeGenRow("b", "3", None, None, "y", "z", 10, 10),   # neither has a number: no agreement
            FreeGenRow("c", "5", "4", "5", "u", "v", 10, 10)]     # disagree; the method is right
    r = FreeGenResult(rows)
    assert r.agreement == pytest.approx(1 / 3)
    assert r.text_agreement == pytest.approx(1 / 3)
    assert r.exact_match == pytest.approx(2 / 3) and r.full_exact_match == pytest.approx(1 / 3)


def test_load_questions(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(5)))
    qs = load_questions(p, 2, offset=1)
    assert [q["question"] for q in qs] == ["q1", "q2"]
    with pytest.raises(KVComposeError, match="not found"):
        load_questions(tmp_path / "missing.jsonl", 2)


# ------------------------------------------------------------------------------ teacher forcing on a model
def _trace(seed=0, prompt=20, n=96, vocab=128) -> Trace:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (prompt + n + 12,), generator=g).tolist()
    return Trace(id=f"t{seed}", prompt_ids=ids[:prompt], trace_ids=ids[prompt : prompt + n], question="q",
                 answer=None, kind="sampled", recall_ids=ids[prompt + n : prompt + n + 4],
                 recall_target_ids=ids[prompt + n + 4 :])


def test_full_cache_is_exact():
    model = tiny_model("llama")
    clear_reference_cache()
    traces = [_trace(0, n=48), _trace(1, n=24)]
    res = evaluate(model, traces, lambda: KVComposeCache(model, methods.full()))
    assert res.top1 == 1.0
    assert res.kl_mean < 1e-6
    assert res.ppl_ratio == pytest.approx(1.0, abs=1e-5)
    assert abs(res.recall_delta) < 1e-5
    assert res.n_tokens == 48 + 24
    assert res.max_held_tokens == 20 + 48 - 1


@pytest.mark.parametrize("name,kwargs", [("h2o", {}), ("snapkv", {"window": 4})])
def test_chunked_teacher_forcing_equals_one_token_steps(name, kwargs):
    model = tiny_model("llama", seed=1)
    trace = _trace(2, prompt=10, n=40)
    budget, interval = 12, 6

    def make():
        return KVComposeCache(model, methods.PRESETS[name](**kwargs), budget=budget, interval=interval)

    chunked_cache, step_cache = make(), make()
    chunked = teacher_force_logits(model, trace, chunked_cache)  # chunk = interval
    steps = teacher_force_logits(model, trace, step_cache, chunk=1)
    assert chunked_cache.layers[0].events == step_cache.layers[0].events > 3
    assert torch.equal(chunked_cache.kept_positions(1), step_cache.kept_positions(1))
    assert torch.allclose(chunked, steps, atol=1e-4, rtol=1e-4)
    # and the compression really changed the output relative to the full cache
    full = teacher_force_logits(model, trace, KVComposeCache(model, methods.full()))
    assert (full - steps).abs().max() > 1e-3


def test_cam_merges_in_chunks_as_in_one_token_steps():
    """CaM's decoding attention (DecodeAttention) accumulates over a chunk of decoded tokens what one-token
    steps accumulate: the same kept positions and logits; and it merges (its logits are not those of H2O, its
    base: before the fix a chunked run never merged and gave exactly H2O's numbers)."""
    model = tiny_model("llama", seed=1)
    trace = _trace(3, prompt=10, n=40)

    def make(pipe):
        return KVComposeCache(model, pipe, budget=12, interval=6, seed=2)

    chunked_cache, step_cache, h2o_cache = make(methods.cam(window=4)), make(methods.cam(window=4)), make(methods.h2o())
    chunked = teacher_force_logits(model, trace, chunked_cache)  # chunk = interval
    steps = teacher_force_logits(model, trace, step_cache, chunk=1)
    h2o = teacher_force_logits(model, trace, h2o_cache)
    assert chunked_cache.layers[0].events == step_cache.layers[0].events > 3
    assert torch.equal(chunked_cache.kept_positions(1), step_cache.kept_positions(1))
    assert torch.allclose(chunked, steps, atol=1e-4, rtol=1e-4)
    assert (chunked - h2o).abs().max() > 1e-3


def test_chunk_must_divide_interval():
    model = tiny_model("llama")
    cache = KVComposeCache(model, methods.h2o(), budget=16, interval=8)
    with pytest.raises(KVComposeError, match="divide"):
        teacher_force_logits(model, _trace(0), cache, chunk=3)


def test_compressing_method_reports_memory_and_divergence():
    model = tiny_model("llama", seed=3)
    clear_reference_cache()
    res = evaluate(model, [_trace(4, n=48)], lambda: KVComposeCache(model, methods.streaming_llm(), budget=16, interval=8))
    assert res.max_held_tokens == 20 + 8  # the prompt (20 > budget) is first cut after one interval
    assert 0 < res.kv_ratio < 0.5
    assert res.kl_mean > 0
    assert len(res.kl_curve(bucket=16)) == 3
