"""Architectures: tiny random configs of every decoder family kvcompose claims, their attention features
(`kvcompose.compat.check_model`), `kvcompose.attention.attend` against each model's own eager attention
(soft-capping, sinks, sliding windows, scaling, q/k norms), and the compressing cache against DynamicCache
(budget above the length) and against a masked full-sequence reference (with compression).

`ReferenceCache` is a cache that speaks kvcompose's hand-off protocol but keeps every token: it exercises
`kvcompose.attention` (scoped dispatch, mask pass-through, hand-off, `attend` with every feature) without
the layer core, and it is the masked reference of the compression tests (`restrict=`: the last query of
each layer sees only the given positions).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcompose import KVComposeCache, KVComposeError, methods
from kvcompose import attention as kattn
from kvcompose import compat

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "olmo2", "gpt_oss", "granite",
         "smollm3"]
WINDOW = 6  # sliding window of the tiny configs that have one (shorter than every test sequence)

_EXTRA = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": WINDOW},
    "phi3": {"sliding_window": None},
    "gemma2": {"sliding_window": WINDOW, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 24},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24},
    "olmo2": {},
    "gpt_oss": {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
                "max_position_embeddings": 131072},
    "granite": {"attention_multiplier": 0.3, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                "logits_scaling": 4.0},
    "smollm3": {},
}

# the attention features each tiny config uses (layers 0..3): what check_model must report
FEATURES = {
    #            sliding layers   softcap  sinks  qk-norm  scaling
    "llama": ((), None, False, False, 0.25),
    "qwen2": ((), None, False, False, 0.25),
    "qwen3": ((), None, False, True, 0.25),
    "mistral": ((0, 1, 2, 3), None, False, False, 0.25),
    "phi3": ((), None, False, False, 0.25),
    "gemma2": ((0, 2), 5.0, False, False, 24**-0.5),
    "gemma3_text": ((0, 2), None, False, True, 24**-0.5),
    "olmo2": ((), None, False, True, 0.25),
    "gpt_oss": ((0, 2), None, True, False, 0.25),
    "granite": ((), None, False, False, 0.3),
    "smollm3": ((), None, False, False, 0.25),
}


def tiny_arch(arch: str, *, layers: int = 4, impl: str = "eager", seed: int = 0, dropout: float = 0.0):
    """A tiny randomly initialised causal LM of `arch` (4 layers, 4 query / 2 KV heads of 16, vocab 128)."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=None,
                  pad_token_id=0, attention_dropout=dropout)
    kw = {**common, **_EXTRA[arch]}
    if arch == "gemma3_text":
        kw["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    cfg = AutoConfig.for_model(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class ReferenceLayer(CacheLayerMixin):
    """Keeps every token; attends through `kvcompose.attention` like a kvcompose layer (hand-off protocol)."""

    is_compileable = False
    is_sliding = False
    attention_features = kattn.SUPPORTED_FEATURES

    def __init__(self, cache: "ReferenceCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.keys = self.values = None
        self.is_initialized = False
        self.attended = 0

    def lazy_initialization(self, key_states, value_states):
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        kattn.hand_off(self, key_states, value_states)
        return key_states, value_states

    def attend(self, query, mask2d, scale, sliding_window=None, softcap=None, sinks=None):
        b, h, t, _ = self.keys.shape
        q = query.shape[2]
        pos = torch.arange(t).expand(b, h, t)
        valid = torch.ones(b, h, t, dtype=torch.bool)
        if mask2d is not None:
            valid = mask2d[:, None, -t:].to(torch.bool).expand(b, h, t)
        mask = kattn.build_mask(pos, valid, torch.arange(t - q, t), sliding_window)
        restrict = self.cache.restrict
        if restrict is not None:  # the last query sees only these positions (and itself)
            r = restrict[self.layer_idx]  # -1 pads a short (row, head) of ragged storage
            last = torch.zeros(b, h, t, dtype=torch.long).scatter_add_(-1, r.clamp(min=0), (r >= 0).long()) > 0
            last[..., t - 1] = True
            mask[:, :, -1] &= last
        self.attended += 1
        return kattn.attend(query, self.keys, self.values, mask, scale, softcap=softcap, sinks=sinks)

    def get_seq_length(self, *args, **kwargs):
        return 0 if self.keys is None else self.keys.shape[2]

    def get_mask_sizes(self, query_length, *args, **kwargs):
        return self.get_seq_length() + compat.query_length(query_length), 0

    def get_max_length(self):
        return -1

    def get_max_cache_shape(self):
        return -1


class ReferenceCache(Cache):
    """A full cache on kvcompose's attention path. `restrict[layer]` (`[B, H, K]` positions): the last query
    of that layer attends only to them and itself (the masked reference of a compressed cache)."""

    kvcompose_attention = True

    def __init__(self, model, restrict=None):
        n = model.config.get_text_config().num_hidden_layers
        self.restrict = restrict
        super().__init__(layers=[ReferenceLayer(self, i) for i in range(n)])

    def get_mask_sizes(self, *args, **kwargs):
        # a kvcompose cache announces that the mask call which follows is its own (kvcompose.attention)
        return kattn.expect_mask(self, super().get_mask_sizes(*args, **kwargs))


def left_padded(b=2, t=10, pad=(3, 0), vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    for row, n in enumerate(pad[:b]):
        ids[row, :n] = 0
        mask[row, :n] = 0
    return ids, mask


def greedy_logits(model, ids, mask, cache, n=12):
    """Greedy tokens and the per-step logits `[steps, B, V]`."""
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


# --------------------------------------------------------------------------------------------------
# the features table
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_check_model_reports_each_architectures_features(arch):
    model = tiny_arch(arch)
    desc = compat.check_model(model)
    sliding, softcap, sinks, qk_norm, scaling = FEATURES[arch]
    assert len(desc.layers) == 4
    assert desc.sliding_layers == sliding
    for layer in desc.layers:
        assert layer.sliding_window == (WINDOW if layer.index in sliding else None)
        assert layer.softcap == softcap
        assert layer.sinks is sinks
        assert layer.qk_norm is qk_norm
        assert layer.scaling == pytest.approx(scaling)
    assert str(desc).count("\n") == 5  # header lines + one row per layer


def test_check_model_refuses_features_by_name():
    with pytest.raises(KVComposeError, match="soft-capping"):
        compat.check_model(tiny_arch("gemma2"), features=frozenset())
    with pytest.raises(KVComposeError, match="sinks"):
        compat.check_model(tiny_arch("gpt_oss"), features={"softcap"})
    model = tiny_arch("llama")
    text = model.config
    for attr, value, what in [("attention_chunk_size", 8, "chunked attention"),
                              ("num_kv_shared_layers", 2, "KV sharing"),
                              ("use_bidirectional_attention", True, "bidirectional"),
                              ("layer_types", ["full_attention", "linear_attention"] * 2, "linear_attention"),
                              ("is_encoder_decoder", True, "encoder-decoder")]:
        old = text.__dict__.get(attr, None)
        text.__dict__[attr] = value
        try:
            with pytest.raises(KVComposeError, match=what):
                compat.check_model(model)
        finally:
            if old is None:
                text.__dict__.pop(attr, None)
            else:
                text.__dict__[attr] = old
    assert compat.check_model(model).features == frozenset()


def test_check_model_refuses_models_without_the_attention_interface():
    from transformers import LlamaForCausalLM

    class NoInterface(LlamaForCausalLM):
        @classmethod
        def _can_set_attn_implementation(cls):
            return False

    model = NoInterface(tiny_arch("llama").config)
    with pytest.raises(KVComposeError, match="AttentionInterface"):
        compat.check_model(model)


# --------------------------------------------------------------------------------------------------
# attend() against the models' own eager attention
# --------------------------------------------------------------------------------------------------
class _Stub(torch.nn.Module):
    def __init__(self, groups, head_dim, sinks=None):
        super().__init__()
        self.eval()
        self.num_key_value_groups, self.head_dim = groups, head_dim
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)


def _random_attention(seed, b=2, h=2, g=3, q=5, t=11, d=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, h * g, q, d, generator=gen).to(dtype) * 2
    keys = torch.randn(b, h, t, d, generator=gen).to(dtype) * 2
    values = torch.randn(b, h, t, d, generator=gen).to(dtype)
    pos = torch.arange(t).expand(b, h, t)
    valid = torch.rand(b, 1, t, generator=gen).expand(b, h, t) > 0.3
    mask = kattn.build_mask(pos, valid, torch.arange(t - q, t), sliding_window=4 if seed % 2 else None)
    return query, keys, values, mask


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_softcap_equals_gemma2_eager(seed, dtype):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    query, keys, values, mask = _random_attention(seed, dtype=dtype)
    out = kattn.attend(query, keys, values, mask, 0.3, softcap=2.0)
    # eager takes one mask for all heads: compare KV head by KV head (the mask is shared by a head's group)
    for h in range(keys.shape[1]):
        additive = torch.where(mask[:, h : h + 1], 0.0, torch.finfo(dtype).min).to(dtype)
        ref, _ = eager_attention_forward(_Stub(3, 8), query[:, 3 * h : 3 * h + 3], keys[:, h : h + 1],
                                         values[:, h : h + 1], additive, scaling=0.3, softcap=2.0)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[:, :, 3 * h : 3 * h + 3], ref, atol=tol, rtol=tol)
    plain = kattn.attend(query, keys, values, mask, 0.3)
    assert (plain.float() - out.float()).abs().max() > 1e-2  # soft-capping at 2 changes these logits


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_attend_sinks_equal_gpt_oss_eager(seed):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    query, keys, values, mask = _random_attention(seed)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(seed + 10))
    out = kattn.attend(query, keys, values, mask, 0.3, sinks=sinks)
    for h in range(keys.shape[1]):
        additive = torch.where(mask[:, h : h + 1], 0.0, torch.finfo(torch.float32).min)
        ref, _ = eager_attention_forward(_Stub(3, 8, sinks[3 * h : 3 * h + 3]), query[:, 3 * h : 3 * h + 3],
                                         keys[:, h : h + 1], values[:, h : h + 1], additive, scaling=0.3)
        torch.testing.assert_close(out[:, :, 3 * h : 3 * h + 3], ref, atol=1e-6, rtol=1e-6)
    probs = kattn.attention_probs(query, keys, mask, 0.3, sinks=sinks)
    assert bool((probs.sum(-1) < 1).all())  # the sink takes part of every row's mass
    plain = kattn.attend(query, keys, values, mask, 0.3)
    assert (plain - out).abs().max() > 1e-3


def test_attend_plain_equals_dense_softmax():
    query, keys, values, mask = _random_attention(5)
    out = kattn.attend(query, keys, values, mask, 0.3)
    p = kattn.attention_probs(query, keys, mask, 0.3)
    ref = torch.einsum("bhqt,bhtd->bqhd", p, values.repeat_interleave(3, dim=1))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kattn.attend(query, keys, values, None, 0.3),
                               kattn.attend(query, keys, values, torch.ones_like(mask), 0.3))


# --------------------------------------------------------------------------------------------------
# every architecture through kvcompose's attention path (no layer core): equal to its own eager forward
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_kvcompose_attention_path_matches_eager(arch):
    """Left-padded batch, 12 greedy steps (22 tokens > the 6-token windows): kvcompose's attention function
    and `attend` (softcap, sinks, windows, scaling) give the logits of the model's own eager forward."""
    model = tiny_arch(arch)
    ids, mask = left_padded()
    ref_tokens, ref_logits = greedy_logits(model, ids, mask, DynamicCache(config=model.config))
    kattn.install(model)
    try:
        cache = ReferenceCache(model)
        tokens, logits = greedy_logits(model, ids, mask, cache)
    finally:
        kattn.restore(model)
    assert all(layer.attended == 12 for layer in cache.layers)  # every call took kvcompose's path
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)
    assert model.config._attn_implementation == "eager"


# --------------------------------------------------------------------------------------------------
# the compressing cache (the layer core)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_budget_above_length_matches_dynamic_cache(arch):
    """A compressing cache whose budget exceeds the sequence gives the model's own logits (eager reference),
    on a left-padded batch, sliding-window layers included."""
    model = tiny_arch(arch)
    ids, mask = left_padded()
    ref_tokens, ref_logits = greedy_logits(model, ids, mask, DynamicCache(config=model.config))
    cache = KVComposeCache(model, methods.rkv(), budget=4096)
    tokens, logits = greedy_logits(model, ids, mask, cache)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_compressed_logits_match_masked_reference(arch):
    """Decode one token at a time until every layer holds fewer tokens than it has seen (full-attention
    layers after a compression event; sliding-window layers, which only keep their window, after a cut), then
    one more: its logits equal a full-sequence forward whose last query sees, per layer and KV head, exactly
    the positions the cache holds (and itself)."""
    model = tiny_arch(arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 16), generator=g)
    cache = KVComposeCache(model, methods.rkv(), budget=10, interval=4)
    n = len(cache.layers)
    held = None
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        for _ in range(64):
            nxt = out.logits[:, -1:].argmax(-1)
            ids = torch.cat([ids, nxt], dim=1)
            if all(layer.held < layer.seen for layer in cache.layers):  # what the next query will see
                held = [cache.kept_positions(i) for i in range(n)]
                out = model(input_ids=nxt, past_key_values=cache)
                break
            out = model(input_ids=nxt, past_key_values=cache)
        assert held is not None, "no layer evicted anything"
        full = [layer for layer in cache.layers if not layer.is_sliding]
        assert all(layer.events > 0 for layer in full)  # full-attention layers compressed
        assert all(layer.events == 0 for layer in cache.layers if layer.is_sliding)  # windows are never compressed
        assert max(k.shape[-1] for k in held) < ids.shape[1] - 1  # something was evicted
        kattn.install(model)
        try:
            ref = model(input_ids=ids, past_key_values=ReferenceCache(model, restrict=held)).logits[:, -1]
        finally:
            kattn.restore(model)
    torch.testing.assert_close(out.logits[:, -1], ref, atol=2e-4, rtol=1e-4)
