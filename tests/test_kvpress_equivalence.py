"""kvcompose's ported blocks against NVIDIA kvpress 0.5.5's presses on the same inputs, where the rule is the same.

Runs in CI's second environment (transformers 5.2 + kvpress 0.5.5, `.ci/run`); skipped where kvpress is not
installed. Three levels, on a tiny random Llama:
- scores: `press.score(module, hidden_states, keys, values, ...)` (a prefill: every token's query exists) against
  the block's scores on a `LayerView` of the same post-RoPE keys, values and queries;
- kept sets: the tokens `press.compress` keeps against the kept set of the kvcompose pipeline at the same budget;
- traces: a token trace teacher-forced through the model with kvpress's press active and through a
  `KVComposeCache` with the matching preset: the logits agree at every step (attention does not depend on the
  order of the kept tokens, so kvpress's top-k order and kvcompose's time order give the same outputs while the
  rule itself never reads slot order).
Where the rules differ on purpose (docs/methods.md), the test pins the difference instead.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from transformers import DynamicCache  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from kvcompose import KeyNorm, KVComposeCache, Pipeline, TopK, methods  # noqa: E402
from kvcompose.blocks import (  # noqa: E402
    CAP, CUR, Compactor, CriticalKV, ExpectedAttention, KeyDiff, LagKV, LeverageScore, NonCausalAttention,
    OutputProjection, Rotary,
)
from kvcompose.testing import tiny_model  # noqa: E402
from kvcompose.view import LayerView  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
H, HQ, D = 2, 4, 16


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", layers=2, heads=HQ, kv_heads=H, head_dim=D)
    for layer in m.model.layers:  # kvpress's presses read the rotary embedding from the attention module
        layer.self_attn.rotary_emb = m.model.rotary_emb
    return m


class Prefill:
    """One layer's prefill: hidden states, post-RoPE queries / keys, values and kvpress's kwargs."""

    def __init__(self, model, t: int, layer: int = 1, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.attn = model.model.layers[layer].self_attn
        self.layer, self.t = layer, t
        self.hidden = torch.randn(1, t, model.config.hidden_size, generator=g)
        cos, sin = model.model.rotary_emb(self.hidden, torch.arange(t)[None])
        with torch.no_grad():
            q = self.attn.q_proj(self.hidden).view(1, t, HQ, D).transpose(1, 2)
            k = self.attn.k_proj(self.hidden).view(1, t, H, D).transpose(1, 2)
            self.values = self.attn.v_proj(self.hidden).view(1, t, H, D).transpose(1, 2)
            self.queries, self.keys = apply_rotary_pos_emb(q, k, cos, sin)
        self.kwargs = {"position_embeddings": (cos, sin)}

    def view(self, budget: int | None = None, seed: int = 0) -> LayerView:
        t = self.t
        return LayerView(layer_idx=self.layer, num_layers=2, keys=self.keys, values=self.values,
                         positions=torch.arange(t).expand(1, H, t), valid=torch.ones(1, H, t, dtype=torch.bool),
                         prompt_length=t, queries=self.queries, query_positions=torch.arange(t),
                         query_valid=torch.ones(1, t, dtype=torch.bool), seen=t, scale=D**-0.5,
                         generator=torch.Generator().manual_seed(seed), cache_budget=budget)

    @torch.no_grad()
    def press_scores(self, press, seed: int | None = None):
        if seed is not None:
            torch.manual_seed(seed)
        return press.score(self.attn, self.hidden, self.keys, self.values, None, self.kwargs)

    @torch.no_grad()
    def press_kept(self, press, ratio: float, seed: int | None = None) -> list[list[int]]:
        """The slots `press.compress` keeps per KV head, found by matching its output keys."""
        if seed is not None:
            torch.manual_seed(seed)
        press.compression_ratio = ratio
        keys, _ = press.compress(self.attn, self.hidden, self.keys, self.values, None, self.kwargs)
        out = []
        for h in range(H):
            same = (keys[0, h][:, None] == self.keys[0, h][None]).all(-1)  # [kept, T]
            out.append(sorted(int(i) for i in same.float().argmax(-1)))
        return out


def _ours_kept(scorer, prefill: Prefill, budget: int, seed: int = 0) -> list[list[int]]:
    sel, _ = Pipeline(scorer, TopK()).select(prefill.view(budget, seed), budget)
    return [sel.kept[0, h].tolist() for h in range(H)]


def _close(a, b, mask=None, tol=1e-6):
    a, b = a.float(), b.float()
    if mask is not None:
        a, b = a[mask], b[mask]
    err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    assert err < tol, f"relative error {err:.2e} > {tol:.0e}"


def _not_first(t: int, n: int, last: int = 0):
    m = torch.ones(1, H, t, dtype=torch.bool)
    m[..., :n] = False
    if last:
        m[..., t - last:] = False
    return m


# ------------------------------------------------------------------------------------------ scores and kept sets
CASES = {
    # name: (kvcompose block factory(model), kvpress press factory, T, compare mask factory, random)
    "keydiff": (lambda m: KeyDiff(), lambda: kvpress.KeyDiffPress(), 64, None, False),
    "lagkv": (lambda m: LagKV(sinks=4, lag=16, tiebreak=False), lambda: kvpress.LagKVPress(lag_size=16), 70, None, False),
    "lagkv-cross": (lambda m: LagKV(sinks=4, lag=16, cross_scoring=True),
                    lambda: kvpress.LagKVPress(lag_size=16, cross_scoring=True), 70, None, False),
    "cur": (lambda m: CUR(), lambda: kvpress.CURPress(), 64, None, False),
    "cur-projected": (lambda m: CUR(random_projection=True, local=False, kind="kv_avg"),
                      lambda: kvpress.CURPress(use_random_leverage=True, use_local_approximation=False,
                                               leverage_type="kv_avg"), 64, None, True),
    "leverage": (lambda m: LeverageScore(Rotary.from_model(m)), lambda: kvpress.LeverageScorePress(), 64, None, True),
    "noncausal": (lambda m: NonCausalAttention(chunk=16, window=None), lambda: kvpress.NonCausalAttnPress(chunk_size=16),
                  64, None, False),
    "compactor": (lambda m: Compactor(Rotary.from_model(m), chunk=16, blending=0.4, window=None),
                  lambda: kvpress.CompactorPress(chunk_size=16, blending=0.4), 76, lambda t: _not_first(t, 8, 4), True),
    "expected_attention": (lambda m: ExpectedAttention(Rotary.from_model(m), window=None),
                           lambda: kvpress.ExpectedAttentionPress(), 64, lambda t: _not_first(t, 4), False),
    "expected_attention-mean": (lambda m: ExpectedAttention(Rotary.from_model(m), window=None, covariance=False,
                                                            value_norm=False),
                                lambda: kvpress.ExpectedAttentionPress(use_covariance=False, use_vnorm=False), 64,
                                lambda t: _not_first(t, 4), False),
    "cap": (lambda m: CAP(Rotary.from_model(m), window=None), lambda: kvpress.CapPress(), 64,
            lambda t: _not_first(t, 4), False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scores_match_kvpress(model, name):
    block, press, t, mask, random = CASES[name]
    pre = Prefill(model, t)
    ours = block(model)(pre.view(seed=5))
    theirs = pre.press_scores(press(), seed=5 if random else None)
    _close(ours, theirs, None if mask is None else mask(t))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_kept_sets_match_kvpress(model, name, ratio):
    block, press, t, _, random = CASES[name]
    pre = Prefill(model, t, seed=1)
    budget = int(t * (1 - ratio))
    ours = _ours_kept(block(model), pre, budget, seed=5)
    theirs = pre.press_kept(press(), ratio, seed=5 if random else None)
    _same_top_k(ours, theirs, block(model)(pre.view(budget, seed=5)))


def _same_top_k(ours: list[list[int]], theirs: list[list[int]], scores: torch.Tensor) -> None:
    """The same kept set per head, or sets that differ only among tokens of equal score: kvpress takes
    `torch.topk`, whose order among equal scores is undefined (it changes with the width of the row), while
    kvcompose keeps the newest of them (the same tokens for a left-padded row as for the row alone). The kept
    scores must then be the same multiset (up to float rounding)."""
    for h, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        assert len(a) == len(b), (h, a, b)
        sa, sb = scores[0, h, a].float().sort().values, scores[0, h, b].float().sort().values
        torch.testing.assert_close(sa, sb, rtol=1e-6, atol=0.0, msg=lambda m: f"head {h}: {a} != {b}: {m}")


def test_criticalkv_matches_kvpress(model):
    pre = Prefill(model, 64, seed=2)
    proj = OutputProjection.from_model(model)
    press = kvpress.CriticalKVPress(kvpress.KnormPress())
    press.compression_ratio = 0.5
    _close(CriticalKV(KeyNorm(), proj)(pre.view(budget=32)), pre.press_scores(press))
    inner = kvpress.ExpectedAttentionPress(use_vnorm=False)
    ours = CriticalKV(ExpectedAttention(Rotary.from_model(model), window=None, value_norm=False), proj)
    assert _ours_kept(ours, pre, 16) == pre.press_kept(kvpress.CriticalKVPress(inner), 0.75)


def test_noncausal_padding_differs_on_purpose(model):
    """kvpress gives the padding of its last chunk a logit of ~0 (it takes mass from the real keys there);
    kvcompose masks it: equal scores when the length is a multiple of the chunk, not otherwise."""
    pre = Prefill(model, 72)
    ours = NonCausalAttention(chunk=16, window=None)(pre.view())
    theirs = pre.press_scores(kvpress.NonCausalAttnPress(chunk_size=16))
    assert float((ours - theirs).abs().max()) > 1e-2


# ------------------------------------------------------------------------------------------ traces
def _teacher_force(model, prompt, trace, cache, ctx):
    out = []
    with torch.no_grad(), ctx:
        p = prompt.shape[1]
        o = model(input_ids=prompt, past_key_values=cache, position_ids=torch.arange(p)[None], use_cache=True)
        out.append(o.logits[0, -1])
        for i in range(trace.shape[1] - 1):
            o = model(input_ids=trace[:, i:i + 1], past_key_values=cache, position_ids=torch.tensor([[p + i]]),
                      use_cache=True)
            out.append(o.logits[0, -1])
    return torch.stack(out)


def _trace(n_prompt=20, n=60, seed=0):
    """A prompt and a trace of distinct tokens: a repeated token has the same key norm and value in layer 0 (its
    input is the embedding; the norm ignores RoPE), an exact tie that kvpress (top-k order) and kvcompose (time
    order) break differently."""
    ids = torch.randperm(125, generator=torch.Generator().manual_seed(seed))[: n_prompt + n] + 3
    return ids[None, :n_prompt], ids[None, n_prompt:]


def _decoding_pair(model, press, pipe, budget, interval, seed=0):
    prompt, trace = _trace(seed=seed)
    full = _teacher_force(model, prompt, trace, DynamicCache(), contextlib.nullcontext())
    theirs = _teacher_force(model, prompt, trace, DynamicCache(),
                            kvpress.DecodingPress(base_press=press, compression_interval=interval, target_size=budget)(model))
    cache = KVComposeCache(model, pipe, budget=budget, interval=interval)
    ours = _teacher_force(model, prompt, trace, cache, contextlib.nullcontext())
    assert cache.stats.compress_calls > 0 and float((theirs - full).abs().max()) > 1e-3  # it really compressed
    return ours, theirs


@pytest.mark.parametrize("name", ["keydiff", "criticalkv-knorm"])
def test_decoding_traces_match_kvpress(model, name):
    """DecodingPress(press, interval, target) against the kvcompose preset at the same budget and interval."""
    if name == "keydiff":
        press, pipe = kvpress.KeyDiffPress(), methods.keydiff()
    else:
        press = kvpress.CriticalKVPress(kvpress.KnormPress())
        pipe = Pipeline(CriticalKV(KeyNorm(), OutputProjection.from_model(model)), TopK())
    ours, theirs = _decoding_pair(model, press, pipe, budget=24, interval=8)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["expected_attention", "cap", "lagkv", "cur", "noncausal"])
def test_prefill_compression_traces_match_kvpress(model, name):
    """kvpress's press compressing the prompt (its own prefill mode) against kvcompose with `compress_prefill`
    at the same budget (no decoding event before the trace ends)."""
    rope = Rotary.from_model(model)
    press, block = {
        "expected_attention": (kvpress.ExpectedAttentionPress(), ExpectedAttention(rope, window=64)),
        "cap": (kvpress.CapPress(), CAP(rope, window=64)),
        "lagkv": (kvpress.LagKVPress(lag_size=8), LagKV(lag=8, tiebreak=False)),
        "cur": (kvpress.CURPress(), CUR()),
        "noncausal": (kvpress.NonCausalAttnPress(chunk_size=16), NonCausalAttention(chunk=16, window=64)),
    }[name]
    prompt, trace = _trace(n_prompt=48, n=12, seed=3)
    press.compression_ratio = 0.5
    theirs = _teacher_force(model, prompt, trace, DynamicCache(), press(model))
    cache = KVComposeCache(model, Pipeline(block, TopK()), budget=24, interval=1000, compress_prefill=True)
    ours = _teacher_force(model, prompt, trace, cache, contextlib.nullcontext())
    assert cache.stats.compress_calls == 2  # one prefill event per layer
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ merging
def _match_values(pre: Prefill, keys, values, kept: torch.Tensor, merged: torch.Tensor):
    """kvpress's gathered (keys, values) against kvcompose's merged values at the same kept slots."""
    for h in range(H):
        slots = (keys[0, h][:, None] == pre.keys[0, h][None]).all(-1).float().argmax(-1)  # kvpress order -> slots
        assert sorted(slots.tolist()) == kept[0, h].tolist()
        torch.testing.assert_close(merged[0, h, slots], values[0, h], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("threshold", [0.0, 0.2])
def test_merging_press_matches_kvpress(model, threshold):
    from kvcompose.blocks import MergeSimilar

    pre = Prefill(model, 64, seed=4)
    press = kvpress.MergingPress(press=kvpress.KnormPress(), similarity_threshold=threshold)
    press.compression_ratio = 0.5
    with torch.no_grad():
        keys, values = press.compress(pre.attn, pre.hidden, pre.keys, pre.values, None, pre.kwargs)
    sel, _ = Pipeline(KeyNorm(), TopK(), MergeSimilar(threshold=threshold)).select(pre.view(), 32)
    assert not torch.allclose(sel.values, pre.values)
    _match_values(pre, keys, values, sel.kept, sel.values)


class _HeadMean(KeyNorm):
    """Knorm averaged over the KV heads: the one kept set for all heads that kvpress's CAMPress uses."""

    def score(self, view):
        return super().score(view).mean(1, keepdim=True).expand(view.shape)


def test_cam_press_matches_kvpress(model):
    from kvcompose.blocks import CAM

    pre = Prefill(model, 64, seed=5)
    attn = torch.rand(1, H, 64, generator=torch.Generator().manual_seed(1))  # accumulated attention
    k = 12  # decoding steps since the last compression
    press = kvpress.CAMPress(base_press=kvpress.KnormPress(), target_size=40, merge_budget=8)
    press.layer_step_counts[pre.layer] = k
    press._running_attn_sum[pre.layer] = attn.clone()
    torch.manual_seed(9)
    with torch.no_grad():
        keys, values = press.compress(pre.attn, pre.hidden, pre.keys, pre.values.clone(), attn.clone(), pre.kwargs)
    view = pre.view(seed=9)
    view = type(view)(**{**view.__dict__, "prompt_length": view.seen - k})
    sel, _ = Pipeline(_HeadMean(), TopK(), CAM(window=8)).select(view, 40, channels=attn[..., None])
    assert not torch.allclose(sel.values, pre.values)
    _match_values(pre, keys, values, sel.kept, sel.values)


# ------------------------------------------------------------------------------------------ ChunkKV, KVCompose
@pytest.mark.parametrize("t,budget", [(60, 30), (65, 30), (65, 40)])
def test_chunkkv_matches_kvpress(model, t, budget):
    pre = Prefill(model, t, seed=6)
    ratio = 1 - budget / t
    theirs = pre.press_kept(kvpress.ChunkKVPress(press=kvpress.KnormPress(), chunk_length=10), ratio)
    sel, _ = methods.chunkkv(Pipeline(KeyNorm(), TopK()), chunk=10).select(pre.view(), budget)
    assert [sel.kept[0, h][sel.kept[0, h] >= 0].tolist() for h in range(H)] == theirs


def test_chunkkv_overshoot_differs_on_purpose(model):
    """kvpress keeps int(chunks * (1 - ratio)) chunks: 3 of 5 at 41 tokens and a target of 25, up to 30 tokens;
    kvcompose keeps chunks while they fit in the budget."""
    pre = Prefill(model, 41, seed=7)
    theirs = pre.press_kept(kvpress.ChunkKVPress(press=kvpress.KnormPress(), chunk_length=10), 1 - 25 / 41)
    sel, _ = methods.chunkkv(Pipeline(KeyNorm(), TopK()), chunk=10).select(pre.view(), 25)
    assert max(len(x) for x in theirs) > 25 >= int((sel.kept >= 0).sum(-1).max())


@pytest.mark.parametrize("structured", [True, False])
def test_kvcompose_paper_matches_kvpress(structured):
    """KVComposePress on a one-layer model (its cross-layer allocation is then the layer's own): the attention of
    a question over a context, max over queries, mean over the group, + the head mean; composite counts."""
    from kvcompose.blocks import AggregatedAttention, CompositeTokens
    from kvcompose.calibration import _QueryProbe

    m = tiny_model("llama", layers=1, heads=HQ, kv_heads=H, head_dim=D, attn_implementation="eager")
    g = torch.Generator().manual_seed(8)
    ctx, question = torch.randint(3, 128, (1, 48), generator=g), torch.randint(3, 128, (1, 8), generator=g)
    press = kvpress.KVComposePress(structured=structured, compression_ratio=0.5)
    press._register_model(m)
    press.register_context_ids(ctx)
    with torch.no_grad():
        cache = DynamicCache()
        m(input_ids=ctx, past_key_values=cache)
        att = m(input_ids=question, past_key_values=cache, output_attentions=True).attentions[0]
    for head in range(HQ):
        press.task_aggregators[0][head].partial_fit(att[:, head, :, :48])
    press._register_cache(cache)
    press.prepare_important_masks()
    # kvcompose: the same tokens through a kvcompose cache that records the question's queries
    ours_cache = KVComposeCache(m, Pipeline(_QueryProbe(8)), budget=None)
    with torch.no_grad():
        m(input_ids=ctx, past_key_values=ours_cache)
        m(input_ids=question, past_key_values=ours_cache)
    view, _, _ = ours_cache.layers[0].view()
    scores = AggregatedAttention(window=8)(view)[..., :48]
    torch.testing.assert_close(scores[0], press.scores[0], atol=1e-6, rtol=1e-5)
    budget = torch.full((1, H), int(press.important_per_layer[0]) if structured else 48 * H // 2 // H)
    if not structured:
        assert int(press.important_per_head.sum()) == int(budget.sum())
    kept, _ = CompositeTokens(structured=structured)(scores, torch.zeros(1, H, 48, dtype=torch.bool),
                                                     torch.ones(1, H, 48, dtype=torch.bool), budget)
    for h in range(H):
        want = press.important_mask_per_kv_head[0][h].nonzero().flatten().tolist()
        assert kept[0, h][kept[0, h] >= 0].tolist() == want


# ------------------------------------------------------------------------------------------ DuoAttention, LU-KV
def test_duo_attention_matches_kvpress(model, monkeypatch):
    """The same head scores (DuoAttention's pattern) give the same streaming heads and, at prefill, the same kept
    tokens: streaming heads keep their sinks and recent tokens, retrieval heads everything."""
    import numpy as np

    from kvcompose import ProtectSinks, Recency
    from kvcompose.blocks import DuoHeads

    scores = np.random.default_rng(0).random((2, H))
    monkeypatch.setattr(kvpress.DuoAttentionPress, "load_attention_pattern", staticmethod(lambda m: (4, 12, scores)))
    press = kvpress.DuoAttentionPress(head_compression_ratio=0.5)
    press.post_init_from_model(model)
    duo = DuoHeads({"head_scores": scores.tolist()}, streaming=0.5)
    assert torch.equal(duo.mask, press.streaming_mask.cpu())
    pre = Prefill(model, 40, layer=1)
    with torch.no_grad():
        pre.attn.config._attn_implementation = "sdpa"
        press.compress(pre.attn, pre.hidden, pre.keys, pre.values, None, pre.kwargs)
    masked = torch.zeros(1, H, 40, dtype=torch.bool)
    if getattr(pre.attn, "masked_key_indices", None) is not None:
        masked[pre.attn.masked_key_indices] = True
        del pre.attn.masked_key_indices
    sel, _ = Pipeline(ProtectSinks(4), Recency(), TopK(), duo).select(pre.view(), 16)
    for h in range(H):
        assert sel.kept[0, h][sel.kept[0, h] >= 0].tolist() == (~masked[0, h]).nonzero().flatten().tolist()


def test_lukv_matches_kvpress(model):
    import numpy as np

    from kvcompose import ProtectRecent, ProtectSinks
    from kvcompose.blocks import HeadCurves

    # random curves that follow their ratios (HeadCurves refuses others): row i prunes (i + 1) % of the tokens on average
    u = np.random.default_rng(1).random((99, 2, H)) * 2 - 1
    u = (u - u.mean((1, 2), keepdims=True)) / np.abs(u - u.mean((1, 2), keepdims=True)).max((1, 2), keepdims=True)
    r = np.arange(1, 100)[:, None, None] / 100
    curves = np.clip(r + np.minimum(r, 1 - r) * u, 0, 1)
    press = kvpress.LUKVPress(press=kvpress.KnormPress(), compression_ratio=0.5, sink=4, window=1)
    press._budget_curves = curves
    pre = Prefill(model, 64, layer=1, seed=3)
    pipe = Pipeline(ProtectSinks(4), ProtectRecent(1), KeyNorm(), TopK(), HeadCurves({"prune": curves.tolist()}))
    kept = _kept_lists(pipe, pre, 32)
    assert kept == _masking_press_kept(press, pre)
    assert len(kept[0]) != len(kept[1])  # really head-wise


def _masking_press_kept(press, pre: Prefill) -> list[list[int]]:
    """The slots a head-wise press (it masks keys instead of removing them) keeps per KV head of one prefill."""
    with torch.no_grad():
        pre.attn.config._attn_implementation = "sdpa"
        press.compress(pre.attn, pre.hidden, pre.keys, pre.values, None, pre.kwargs)
    masked = torch.zeros(1, H, pre.keys.shape[2], dtype=torch.bool)
    masked[pre.attn.masked_key_indices] = True
    del pre.attn.masked_key_indices
    return [(~masked[0, h]).nonzero().flatten().tolist() for h in range(H)]


def _kept_lists(pipe: Pipeline, pre: Prefill, budget: int) -> list[list[int]]:
    sel, _ = pipe.select(pre.view(), budget)
    return [sel.kept[0, h][sel.kept[0, h] >= 0].tolist() for h in range(H)]


def test_adakv_matches_kvpress(model):
    pre = Prefill(model, 64, layer=1, seed=9)
    press = kvpress.AdaKVPress(press=kvpress.KnormPress(), alpha_safeguard=0.2)
    press.compression_ratio = 0.5
    kept = _kept_lists(methods.adakv(Pipeline(KeyNorm(), TopK())), pre, 32)
    assert kept == _masking_press_kept(press, pre) and len(kept[0]) != len(kept[1])


def test_observed_attention_matches_kvpress(model):
    """ObservedAttentionPress (average attention over the queries that could see each token, at prefill) is
    kvcompose's AccumulatedAttention(normalize=True) fed the same attention step."""
    from kvcompose import AccumulatedAttention, AttentionStep

    pre = Prefill(model, 48, seed=10)
    t = 48
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    logits = torch.einsum("bhqd,bhtd->bhqt", pre.queries, pre.keys.repeat_interleave(HQ // H, dim=1)) * D**-0.5
    attentions = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    theirs = kvpress.ObservedAttentionPress().score(pre.attn, pre.hidden, pre.keys, pre.values, attentions, pre.kwargs)
    acc = AccumulatedAttention(normalize=True)
    view = pre.view()
    step = AttentionStep(queries=pre.queries, keys=pre.keys, positions=view.positions, valid=view.valid,
                         mask=causal.expand(1, H, t, t), scale=D**-0.5)
    ours = acc.score(view, acc.observe(torch.zeros(1, H, t), step))
    _close(ours, theirs)


def test_tova_and_knorm_match_kvpress(model):
    """The two presses kvcompose had before this port: TOVA (the newest query's attention averaged over every
    query head; kvpress pads the newest token with its maximum) and Knorm."""
    from kvcompose import LastQueryAttention

    pre = Prefill(model, 48, seed=11)
    view = pre.view()
    _close(LastQueryAttention()(view), pre.press_scores(kvpress.TOVAPress()), _not_first(48, 0, last=1), tol=1e-6)
    _close(KeyNorm()(view), pre.press_scores(kvpress.KnormPress()), tol=1e-7)
    # kvpress always keeps the newest token (TOVA does not force it): kvcompose's TOVA with ProtectRecent(1)
    from kvcompose import ProtectRecent

    sel, _ = Pipeline(ProtectRecent(1), LastQueryAttention(), TopK()).select(view, 24)
    assert [sel.kept[0, h].tolist() for h in range(H)] == pre.press_kept(kvpress.TOVAPress(), 0.5)
