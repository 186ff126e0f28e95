"""KVComposeCache inside `generate`: identity with the full cache, exact attention over the kept set,
the schedule, padding, batch operations and clear errors."""

import pytest
from beartype.roar import BeartypeCallHintParamViolation
from jaxtyping import TypeCheckError
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import DynamicCache

from kvcompose import (
    KVComposeCache, KVComposeError, Pipeline, ProtectRecent, ProtectSinks, RandomDrop, TopK, ValueNorm, methods,
)
from kvcompose.testing import tiny_model
from helpers import greedy_n as _greedy, padded_inputs as _inputs

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("arch", ARCHS)
def test_large_budget_matches_dynamic_cache(arch):
    model = tiny_model(arch, kv_heads=2 if arch != "qwen2" else 4)
    ids, mask = _inputs()
    ref = _greedy(model, ids, mask, DynamicCache(config=model.config))
    cache = KVComposeCache(model, methods.rkv(), budget=4096)
    out = _greedy(model, ids, mask, cache)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == ids.shape[1] + 24 - 1
    # the model, now on kvcompose attention, still works with a plain DynamicCache (fallback path)
    again = _greedy(model, ids, mask, DynamicCache(config=model.config))
    assert torch.equal(again, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    model = tiny_model("llama", dtype=dtype)
    ids, mask = _inputs()
    cache = KVComposeCache(model, methods.vase(recent=4, window=4), budget=16, interval=4)
    out = _greedy(model, ids, mask, cache, n=20)
    assert out.shape == (2, 32)
    assert cache.layers[0].keys.dtype == dtype
    assert max(cache.held_lengths()) < 16 + 4


def _reference_logits(model, ids, kept_pos_per_layer, seen):
    """Run the model on all `seen` tokens with eager attention, masking per layer and head the tokens
    not in the kept set (plus the new token itself), and return the last token's logits."""
    from kvcompose.attention import attend

    cfg = model.config
    n_kv, n_q = cfg.num_key_value_heads, cfg.num_attention_heads
    # Reimplement the forward of each attention layer with an explicit per-head mask over the full sequence.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hidden = model.model.embed_tokens(ids)
    pos_ids = torch.arange(ids.shape[1])[None]
    cos, sin = model.model.rotary_emb(hidden, pos_ids)
    for i, layer in enumerate(model.model.layers):
        res = hidden
        x = layer.input_layernorm(hidden)
        att = layer.self_attn
        b, t, _ = x.shape
        q = att.q_proj(x).view(b, t, n_q, -1).transpose(1, 2)
        k = att.k_proj(x).view(b, t, n_kv, -1).transpose(1, 2)
        v = att.v_proj(x).view(b, t, n_kv, -1).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        allowed = torch.zeros(b, n_kv, t, t, dtype=torch.bool)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        allowed[:] = causal
        # last query: only kept positions + itself
        kp = kept_pos_per_layer[i]  # [B, H, K]
        last = torch.zeros(b, n_kv, t, dtype=torch.bool)
        last.scatter_(-1, kp, True)
        last[..., t - 1] = True
        allowed[:, :, t - 1] = last
        out = attend(q, k, v, allowed, att.scaling)
        hidden = res + att.o_proj(out.reshape(b, t, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    hidden = model.model.norm(hidden)
    return model.lm_head(hidden[:, -1])


@pytest.mark.parametrize("pipeline", [methods.rkv(), methods.random_attention(recent=4),
                                      Pipeline(ProtectSinks(2), ValueNorm(), TopK())])
def test_logits_equal_reference_over_kept_set(pipeline):
    """Under eviction, the next-token logits equal attention over exactly each head's kept set.

    The cache compresses once right after a full-attention prefill (compress_prefill) and then decodes one
    token; the reference replays the sequence with a per-layer, per-head mask that lets the last query see
    only the kept positions (and itself)."""
    model = tiny_model("llama", layers=2)
    ids, _ = _inputs(b=2, t=30, pad=(0, 0))
    cache = KVComposeCache(model, pipeline, budget=12, compress_prefill=True, interval=64)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache)
        kept = [cache.kept_positions(i) for i in range(2)]
        assert all(k.shape[-1] == 12 for k in kept)
        logits = model(input_ids=ids[:, -1:], past_key_values=cache).logits[:, -1]
        ref = _reference_logits(model, ids, kept, ids.shape[1])
    assert torch.allclose(logits, ref, atol=1e-5, rtol=1e-4)


@given(budget=st.integers(6, 40), interval=st.integers(1, 12), prompt=st.integers(3, 30), steps=st.integers(1, 40))
def test_schedule_bounds(budget, interval, prompt, steps):
    model = tiny_model("llama", layers=1)
    ids, _ = _inputs(b=1, t=prompt, pad=(0,))
    cache = KVComposeCache(model, methods.random_attention(recent=2), budget=budget, interval=interval)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        for s in range(steps):
            model(input_ids=ids[:, -1:], past_key_values=cache)
            layer = cache.layers[0]
            if layer.events:
                assert budget <= layer.held < budget + interval
            pos = cache.kept_positions(0)
            assert (pos[..., 1:] > pos[..., :-1]).all()  # sorted and unique
            assert int(pos.max()) == cache.get_seq_length() - 1
    assert cache.get_seq_length() == prompt + steps
    layer = cache.layers[0]
    # events fire exactly at every interval-th decoded token once the budget is exceeded
    expected = sum(1 for s in range(1, steps + 1) if s % interval == 0 and prompt + s > budget)
    assert layer.events == expected
    if layer.events:
        assert layer.capacity <= budget + interval  # buffers shrink back: memory follows the budget


def test_padded_rows_match_rows_run_alone():
    model = tiny_model("llama")
    ids, mask = _inputs(b=2, t=14, pad=(4, 0))
    pipe = lambda: methods.snapkv(window=4)  # noqa: E731
    batch = _greedy(model, ids, mask, KVComposeCache(model, pipe(), budget=10, interval=4), n=20)
    for row, n in enumerate((4, 0)):
        alone = _greedy(model, ids[row : row + 1, n:], mask[row : row + 1, n:],
                        KVComposeCache(model, pipe(), budget=10, interval=4), n=20)
        assert torch.equal(batch[row, 14:], alone[0, 14 - n :])


def test_padding_never_kept_over_real_tokens():
    model = tiny_model("llama")
    ids, mask = _inputs(b=2, t=14, pad=(6, 0))
    cache = KVComposeCache(model, Pipeline(ValueNorm(), TopK()), budget=8, interval=2)
    _greedy(model, ids, mask, cache, n=10)
    for i in range(len(cache.layers)):
        assert (cache.kept_positions(i)[0] >= 6).all()


def test_memory_report_and_real_freeing():
    model = tiny_model("llama", layers=2)
    ids, mask = _inputs(b=1, t=20, pad=(0,))
    full = KVComposeCache(model, methods.full())
    _greedy(model, ids, mask, full, n=60)
    comp = KVComposeCache(model, methods.streaming_llm(), budget=16, interval=8)
    _greedy(model, ids, mask, comp, n=60)
    rf, rc = full.memory(), comp.memory()
    assert rf.total == rf.full_cache
    assert rc.full_cache == rf.full_cache
    assert rc.total < 0.4 * rf.total
    # the buffers themselves shrink: allocated bytes are at most budget + interval slots, not the sequence
    per_token = comp.layers[0].bytes_per_token()
    assert rc.allocated <= 2 * (16 + 8) * per_token < rf.allocated
    assert rc.by_layer == [comp.layers[i].held * per_token for i in range(2)]
    text = str(rc)
    assert "KV held in HBM" in text and "full cache" in text


def test_streaming_llm_keeps_sinks_and_recent():
    model = tiny_model("llama", layers=1)
    ids, mask = _inputs(b=1, t=10, pad=(0,))
    cache = KVComposeCache(model, methods.streaming_llm(), budget=12, interval=3)
    _greedy(model, ids, mask, cache, n=30)
    pos = cache.kept_positions(0)[0, 0].tolist()
    seen = cache.get_seq_length()
    held = len(pos)
    assert pos[:4] == [0, 1, 2, 3]
    assert pos[4:] == list(range(seen - (held - 4), seen))


def test_seeds():
    model = tiny_model("llama", layers=1)
    ids, mask = _inputs(b=1, t=10, pad=(0,))

    def run(seed):
        c = KVComposeCache(model, Pipeline(ProtectRecent(2), RandomDrop()), budget=8, interval=4, seed=seed)
        _greedy(model, ids, mask, c, n=20)
        return c.kept_positions(0)

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))


def test_reorder_and_beam_search():
    model = tiny_model("llama")
    ids, mask = _inputs(b=1, t=10, pad=(0,))
    full = model.generate(input_ids=ids, attention_mask=mask, past_key_values=KVComposeCache(model, budget=None),
                          max_new_tokens=12, num_beams=3, do_sample=False)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, num_beams=3, do_sample=False)
    assert torch.equal(full, ref)


@pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread
@pytest.mark.parametrize("preset", ["h2o", "snapkv"])  # token state (accumulated attention); a query window
def test_compressed_beam_search_equals_beams_over_fresh_caches(preset):
    """Beam search with a compressing cache reorders every layer's rows, positions and pipeline state (H2O's
    accumulated attention, SnapKV's window of recent queries) at every step. Reference: the same beam search in which each beam's next-token
    log-probabilities come from a fresh cache fed only that beam's own tokens, one per forward (so no cache
    is ever reordered). The returned beams must be the same tokens with the same scores."""
    model = tiny_model("llama")
    ids, mask = _inputs(b=1, t=10, pad=(0,))
    beams, n = 3, 12

    def make():
        pipe = methods.h2o() if preset == "h2o" else methods.snapkv(window=4)
        return KVComposeCache(model, pipe, budget=8, interval=4)

    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=make(), max_new_tokens=n,
                         num_beams=beams, num_return_sequences=beams, do_sample=False, length_penalty=0.0,
                         output_scores=True, return_dict_in_generate=True)
    held = []

    @torch.no_grad()
    def logprobs(tokens: tuple[int, ...]) -> torch.Tensor:
        cache = make()
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits[0, -1]
        for i, t in enumerate(tokens):
            am = torch.ones(1, ids.shape[1] + i + 1, dtype=torch.long)
            logits = model(input_ids=torch.tensor([[t]]), attention_mask=am, past_key_values=cache).logits[0, -1]
        held.append((cache.get_seq_length(), max(cache.held_lengths())))
        return torch.log_softmax(logits.float(), -1)

    running: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    for _ in range(n):  # transformers' rule without an end-of-sequence token: the best `beams` continuations
        cands = []
        for toks, score in running:
            top = logprobs(toks).topk(2 * beams)
            cands += [(toks + (int(i),), score + float(v)) for v, i in zip(top.values, top.indices)]
        running = sorted(cands, key=lambda c: -c[1])[:beams]
    assert any(h < seen for seen, h in held if seen > 10 + 4)  # the reference caches did compress
    got = [tuple(row[ids.shape[1]:].tolist()) for row in out.sequences]
    assert got == [toks for toks, _ in running]
    assert out.sequences_scores.tolist() == pytest.approx([score for _, score in running], abs=1e-4)
    assert len(set(got)) == beams


def test_crop():
    model = tiny_model("llama", layers=1)
    ids, _ = _inputs(b=1, t=10, pad=(0,))
    cache = KVComposeCache(model, methods.full())
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    cache.crop(-3)
    assert cache.get_seq_length() == 7 and cache.layers[0].held == 7
    rnd = KVComposeCache(model, Pipeline(RandomDrop()), budget=4, compress_prefill=True)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=rnd)
    if rnd.kept_positions(0)[0, :, -1].eq(9).all() and rnd.kept_positions(0)[0, :, -2].eq(8).all():
        pytest.skip("random draw kept the tail")
    with pytest.raises(KVComposeError, match="evicted"):
        rnd.crop(-2)


def test_bad_input_errors():
    model = tiny_model("llama", layers=1)
    with pytest.raises(KVComposeError, match="budget"):
        KVComposeCache(model, methods.rkv(), budget=0)
    with pytest.raises(KVComposeError, match="budget"):
        KVComposeCache(model, methods.rkv(), budget=-5)
    with pytest.raises(KVComposeError, match="interval"):
        KVComposeCache(model, methods.rkv(), budget=64, interval=0)
    with pytest.raises(KVComposeError, match="needs a token budget"):
        KVComposeCache(model, methods.rkv())
    with pytest.raises(KVComposeError, match="more than the budget"):
        KVComposeCache(model, methods.vase(), budget=32)
    with pytest.raises((TypeCheckError, BeartypeCallHintParamViolation)):  # the checker is on for the session
        KVComposeCache(model, "rkv", budget=64)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(KVComposeError, match="not among the tested ones"):  # accepted unless strict
        KVComposeCache(gpt2, methods.rkv(), budget=64, strict=True)
    for bad in (2**31, 2**40):
        with pytest.raises(KVComposeError, match="below 2\\*\\*31"):
            KVComposeCache(model, methods.rkv(), budget=bad)
        with pytest.raises(KVComposeError, match="below 2\\*\\*31"):
            KVComposeCache(model, methods.rkv(), budget=64, interval=bad)
    cache = KVComposeCache(model, methods.rkv(), budget=64)
    ids, _ = _inputs(b=1, t=5, pad=(0,))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    with pytest.raises(KVComposeError, match="float16"):
        cache.layers[0].update(torch.zeros(1, 2, 1, 16, dtype=torch.float16), torch.zeros(1, 2, 1, 16, dtype=torch.float16))
    with pytest.raises(KVComposeError, match="holds nothing"):
        KVComposeCache(model, methods.rkv(), budget=64).kept_positions(0)
