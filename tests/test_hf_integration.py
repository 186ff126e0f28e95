"""kvcompose inside transformers: the seven cases of issue 13, each a test that failed before it.

1. the model is left as it was (no cache, DynamicCache, StaticCache with a left-padded batch, a custom 4-D
   mask, training mode with dropout: identical logits to a fresh copy), per model and per previous
   implementation, and it is restored when the cache goes;
2. a cache whose attention stopped running (implementation switched, or another model) raises at the step;
3. assisted / prompt-lookup decoding equals plain decoding or is refused;
4. `torch.compile` equals eager (tokens and events) or is refused;
5. soft-capping / sliding windows / sinks are honoured or refused by name (the per-architecture tests are
   in test_architectures.py);
6. the declared transformers range is the tested one, and the installed version runs;
7. buffers grow with the sequence; bad budgets, intervals and layer indices are clear errors.

Tests use the layer core (`KVComposeCache`) or exercise `kvcompose.attention` through the core-free
`ReferenceCache` of test_architectures.py.
"""

from __future__ import annotations

import copy
import gc
import re
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvcompose import KVComposeCache, KVComposeError, methods
from kvcompose import attention as kattn
from kvcompose import compat
from kvcompose.testing import tiny_model
from test_architectures import ReferenceCache, greedy_logits, left_padded, tiny_arch

ROOT = Path(__file__).resolve().parents[1]


def _use_kvcompose(model, n=16):
    """Build a compressing cache on `model` and decode with it (compression runs)."""
    ids, mask = left_padded()
    cache = KVComposeCache(model, methods.rkv(), budget=12, interval=4)
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                   do_sample=False)
    assert cache.stats.compress_calls > 0
    return cache


def _behaviour(model) -> dict[str, torch.Tensor]:
    """What a user would compare: plain forward, DynamicCache and StaticCache decoding of a left-padded
    batch, a custom 4-D mask, and a training-mode forward with attention dropout (seeded)."""
    ids, mask = left_padded()
    out = {}
    with torch.no_grad():
        out["no cache"] = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out["dynamic"] = greedy_logits(model, ids, mask, DynamicCache(config=model.config), n=6)[1]
        static = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                do_sample=False, cache_implementation="static", disable_compile=True,
                                output_logits=True, return_dict_in_generate=True)
        out["static, padded"] = torch.stack(static.logits)
        t = ids.shape[1]
        g = torch.Generator().manual_seed(3)
        allowed = torch.tril(torch.ones(t, t, dtype=torch.bool)) & (torch.rand(2, 1, t, t, generator=g) > 0.2)
        allowed |= torch.eye(t, dtype=torch.bool)
        mask4 = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        out["custom 4-D mask"] = model(input_ids=ids, attention_mask=mask4, use_cache=False).logits
    model.train()
    try:
        torch.manual_seed(7)
        out["train, dropout"] = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.detach()
    finally:
        model.eval()
    return out


def _assert_same(a: dict, b: dict) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: differs by {(a[k] - b[k]).abs().max():.3g}"


# --------------------------------------------------------------------------------------------------
# 1. the model is left as it was
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_model_behaves_as_before_after_a_kvcompose_cache(impl):
    model = tiny_arch("llama", impl=impl, dropout=0.2)
    fresh = copy.deepcopy(model)
    cache = _use_kvcompose(model)
    _assert_same(_behaviour(model), _behaviour(fresh))
    del cache


def test_model_is_restored_when_its_cache_is_gone():
    model = tiny_arch("llama", impl="eager")
    cache = _use_kvcompose(model)
    assert kattn.is_installed(model) and kattn.previous_implementation(model) == "eager"
    del cache
    gc.collect()
    assert model.config._attn_implementation == "eager"
    assert kattn.previous_implementation(model) is None


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_scoped_attention_delegates_bit_for_bit(impl):
    """kvcompose's attention path (here through the core-free ReferenceCache) is taken only for calls that
    carry a kvcompose cache; every other call is the previous implementation's, bit for bit."""
    model = tiny_arch("llama", impl=impl, dropout=0.2)
    fresh = copy.deepcopy(model)
    kattn.install(model)
    try:
        assert model.config._attn_implementation == "kvcompose"
        assert kattn.previous_implementation(model) == impl
        ids, mask = left_padded()
        cache = ReferenceCache(model)
        greedy_logits(model, ids, mask, cache, n=4)
        assert all(layer.attended == 4 for layer in cache.layers)
        _assert_same(_behaviour(model), _behaviour(fresh))
    finally:
        kattn.restore(model)
    assert model.config._attn_implementation == impl
    assert kattn.previous_implementation(model) is None


def test_two_models_keep_their_own_previous_implementation():
    a, b = tiny_arch("llama", impl="sdpa"), tiny_arch("llama", impl="eager", seed=1)
    fa, fb = copy.deepcopy(a), copy.deepcopy(b)
    kattn.install(a)
    kattn.install(b)
    kattn.install(a)  # twice: the first previous implementation stays
    try:
        assert (kattn.previous_implementation(a), kattn.previous_implementation(b)) == ("sdpa", "eager")
        ids, mask = left_padded()
        for m in (a, b):
            greedy_logits(m, ids, mask, ReferenceCache(m), n=3)
        for m, f in ((a, fa), (b, fb)):
            with torch.no_grad():
                assert torch.equal(m(input_ids=ids, attention_mask=mask).logits,
                                   f(input_ids=ids, attention_mask=mask).logits)
    finally:
        kattn.restore(a)
        kattn.restore(b)
    assert (a.config._attn_implementation, b.config._attn_implementation) == ("sdpa", "eager")


def test_owners_restore_the_model_when_the_last_one_goes():
    class Owner:
        pass

    model = tiny_arch("llama", impl="eager")
    first, second = Owner(), Owner()
    kattn.install(model, owner=first)
    kattn.install(model, owner=second)
    del first
    gc.collect()
    assert kattn.is_installed(model)
    kattn.release(second)
    assert model.config._attn_implementation == "eager" and kattn.previous_implementation(model) is None
    pinned = Owner()
    kattn.install(model, owner=pinned)
    kattn.install(model)  # a user's own install pins it: only restore() puts it back
    del pinned
    gc.collect()
    assert kattn.is_installed(model)
    kattn.restore(model)
    assert model.config._attn_implementation == "eager"


def test_kvcompose_calls_refuse_what_they_cannot_honour():
    model = tiny_arch("llama", impl="sdpa", dropout=0.2)
    ids, mask = left_padded()
    kattn.install(model)
    try:
        t = ids.shape[1]
        mask4 = torch.zeros(2, 1, t, t)
        with pytest.raises(KVComposeError, match="4-D"):
            model(input_ids=ids, attention_mask=mask4, past_key_values=ReferenceCache(model))
        model.train()
        with pytest.raises(KVComposeError, match="dropout"):
            model(input_ids=ids, attention_mask=mask, past_key_values=ReferenceCache(model))
    finally:
        model.eval()
        kattn.restore(model)


# --------------------------------------------------------------------------------------------------
# 2. a cache whose attention stopped running raises at that step
# --------------------------------------------------------------------------------------------------
def test_switched_implementation_raises_at_the_step_reference_cache():
    model = tiny_arch("llama", impl="sdpa")
    ids, _ = left_padded(pad=(0, 0))
    kattn.install(model)
    cache = ReferenceCache(model)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        kattn.restore(model)
        with pytest.raises(KVComposeError, match="did not run"):
            model(input_ids=ids[:, :1], past_key_values=cache)
        with pytest.raises(KVComposeError, match="did not run"):  # and stays refused
            kattn.check_consumed(cache)


def test_switched_implementation_raises_at_the_step():
    model = tiny_model("llama", layers=2)
    ids, _ = left_padded(pad=(0, 0))
    cache = KVComposeCache(model, methods.rkv(), budget=8, interval=4)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        model.set_attn_implementation("sdpa")
        with pytest.raises(KVComposeError, match="no longer uses kvcompose's attention implementation"):
            model(input_ids=ids[:, :1], past_key_values=cache)


def test_cache_passed_to_another_model_raises():
    model, other = tiny_model("llama", layers=2), tiny_model("llama", layers=2, seed=1)
    ids, _ = left_padded(pad=(0, 0))
    cache = KVComposeCache(model, methods.rkv(), budget=8, interval=4)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        with pytest.raises(KVComposeError, match="did not run"):
            other(input_ids=ids[:, :1], past_key_values=cache)


# --------------------------------------------------------------------------------------------------
# 3. assisted / prompt-lookup decoding
# --------------------------------------------------------------------------------------------------
def _greedy_tokens(model, ids, cache, n=24, **kw):
    return model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, **kw)


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
def test_assisted_decoding_equals_plain_decoding_or_is_refused(mode):
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([ids, ids[:, :6]], dim=1)  # a repeated n-gram for prompt lookup
    # transformers 5.2's prompt lookup needs an eos id (min_new_tokens keeps it from stopping), and its assisted
    # decoding refuses min_new_tokens once an eos id is set
    eos = {"eos_token_id": 2} if mode == "prompt_lookup" else {}
    plain = _greedy_tokens(model, ids, KVComposeCache(model, methods.rkv(), budget=12, interval=4), **eos)
    kw = ({"assistant_model": tiny_model("llama", layers=1, seed=1)} if mode == "assistant"
          else {"prompt_lookup_num_tokens": 3})
    try:
        out = _greedy_tokens(model, ids, KVComposeCache(model, methods.rkv(), budget=12, interval=4), **kw, **eos)
    except KVComposeError as e:
        assert "assisted" in str(e)
        return
    assert torch.equal(out, plain)


def test_assisted_decoding_with_a_dynamic_cache_is_untouched():
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([ids, ids[:, :6]], dim=1)
    plain = _greedy_tokens(model, ids, DynamicCache(config=model.config), n=12, eos_token_id=2)
    kattn.install(model)
    try:
        out = _greedy_tokens(model, ids, DynamicCache(config=model.config), n=12, prompt_lookup_num_tokens=3,
                             eos_token_id=2)
    finally:
        kattn.restore(model)
    assert torch.equal(out, plain)


# --------------------------------------------------------------------------------------------------
# 4. torch.compile
# --------------------------------------------------------------------------------------------------
def test_torch_compile_equals_eager_or_is_refused():
    """Dynamo (backend "eager": graph capture without code generation, the part that changed the cache's
    behaviour) over a model's forward with a compressing cache: same tokens and events as eager, or a
    clear refusal."""
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))

    def run():
        cache = KVComposeCache(model, methods.rkv(), budget=12, interval=4)
        return _greedy_tokens(model, ids, cache, n=16), cache.stats.compress_calls

    ref, events = run()
    assert events > 0
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        out, compiled_events = run()
    except KVComposeError as e:
        assert "compile" in str(e)
        return
    finally:
        del model.forward
        torch._dynamo.reset()
    assert compiled_events == events
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------------------------------
# 6. transformers versions
# --------------------------------------------------------------------------------------------------
def _declared_range() -> tuple[tuple[int, ...], tuple[int, ...]]:
    text = (ROOT / "pyproject.toml").read_text()
    spec = re.search(r'"transformers\s*([^"]+)"', text).group(1)
    lo = re.search(r">=\s*([0-9.]+)", spec).group(1)
    hi = re.search(r"<\s*([0-9.]+)", spec).group(1)
    return compat._parse(lo), compat._parse(hi)


def test_declared_transformers_range_is_compat_range_and_holds_the_installed_version():
    lo, hi = _declared_range()
    assert lo == compat.MIN_TRANSFORMERS and hi == compat.MAX_TRANSFORMERS
    v = compat.transformers_version()
    assert lo <= v[: len(lo)] and v[: len(hi)] < hi, f"transformers {v} outside the declared range {lo}..{hi}"
    assert compat.check_transformers() == v
    with pytest.raises(KVComposeError, match="needs transformers"):
        compat.check_transformers("5.1.0")
    with pytest.warns(UserWarning, match="tested with"):
        compat.check_transformers(".".join(map(str, hi)) + ".0")
    for tested in compat.TESTED_TRANSFORMERS:
        assert lo <= compat._parse(tested) < hi


def test_installed_transformers_runs_a_compressing_cache():
    """On every supported transformers (CI runs the oldest, 5.2, and the newest): a left-padded batch
    through a compressing cache, prefill and decode (5.2 failed at the first forward)."""
    model = tiny_model("llama", layers=2)
    ids, mask = left_padded()
    cache = KVComposeCache(model, methods.rkv(), budget=8, interval=4)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                         min_new_tokens=12, do_sample=False)
    assert out.shape == (2, 22) and cache.stats.compress_calls > 0
    assert max(cache.kept_positions(0).shape[-1], cache.kept_positions(1).shape[-1]) < 21


def test_version_shims():
    assert compat.query_length(torch.arange(3, 7)) == 4 and compat.query_length(5) == 5
    sentinel = object()
    assert compat.forward_cache({"cache": sentinel}) is sentinel
    assert compat.forward_cache({"past_key_values": sentinel}) is sentinel
    assert compat.forward_cache(None) is None
    model = tiny_model("llama", layers=1)
    assert compat.cache_argument(model) in ("cache", "past_key_values")
    out = model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True)
    assert isinstance(compat.output_cache(out), DynamicCache)
    assert compat._parse("5.24.0rc1") == (5, 24, 0) and compat._parse("5.3.0.dev0") == (5, 3, 0)


# --------------------------------------------------------------------------------------------------
# 7. memory and errors
# --------------------------------------------------------------------------------------------------
def test_buffers_grow_with_the_sequence():
    """Budget 100000 with a 24-token prompt: the buffers hold about the 24 tokens, not budget + interval."""
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    cache = KVComposeCache(model, methods.rkv(), budget=100000)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    mem = cache.memory()
    assert mem.full_cache > 0
    assert mem.allocated <= 4 * mem.full_cache, f"{mem.allocated} bytes allocated for {mem.full_cache} seen"


@pytest.mark.parametrize("arg", ["budget", "interval"])
def test_huge_budget_or_interval_is_a_clear_error(arg):
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    kw = {"budget": 2**40} if arg == "budget" else {"budget": 16, "interval": 2**40}
    with pytest.raises(KVComposeError, match=arg):
        cache = KVComposeCache(model, methods.rkv(), **kw)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)


def test_bad_layer_index_is_a_clear_error():
    model = tiny_model("llama", layers=2)
    cache = KVComposeCache(model, methods.rkv(), budget=16)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6]]), past_key_values=cache)
    assert cache.kept_positions(1).shape[-1] == 4
    for bad in (2, 5):
        with pytest.raises(KVComposeError, match="layer"):
            cache.kept_positions(bad)


def test_the_frame_walk_runs_only_without_transformers_signal(monkeypatch):
    """On transformers 5.23+ generate signals assisted decoding to the cache (`activate_past_recording`, refused),
    so kvcompose's attention never walks the stack; on 5.2 it does, on multi-token forwards only."""
    from kvcompose import attention as kattn_mod, compat

    calls = []
    monkeypatch.setattr(kattn_mod, "in_assisted_generation", lambda: calls.append(1) or False)
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    _greedy_tokens(model, ids, KVComposeCache(model, methods.rkv(), budget=12, interval=4), n=4)
    assert compat.assisted_signal() == (compat.transformers_version() >= (5, 23))
    if compat.assisted_signal():
        assert calls == []
        with pytest.raises(KVComposeError, match="assisted"):
            KVComposeCache(model).activate_past_recording()
    else:
        assert len(calls) == model.config.num_hidden_layers  # the prefill's layers; single-token steps never walk
