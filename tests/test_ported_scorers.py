"""The scorers ported from kvpress (`kvcompose.blocks`) against plain-loop references, one (row, KV head) and one
token at a time, on random ragged views with left padding; plus their invariants (padding never changes a real
token's score, a left-padded row scores as the row alone) and their argument checks."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from jaxtyping import TypeCheckError

from helpers import random_view, ratio_curves
from kvcompose import KeyNorm, KVComposeError, Pipeline, TopK
from kvcompose.blocks import (
    CAP, CUR, Compactor, CriticalKV, ExpectedAttention, KeyDiff, LagKV, LeverageScore, NonCausalAttention,
    OutputProjection, Rotary,
)
from kvcompose.testing import tiny_model

ROPE = Rotary.default(8, theta=100.0)


def _view(seed=0, t=40, pad=(3, 0), w=8, seen=None, ragged=False, **kw):
    v = random_view(b=2, h=2, t=t, d=8, g=2, w=w, seen=seen or t + 7, pad=list(pad), seed=seed, **kw)
    if ragged:  # head 1 of row 1 holds 5 tokens fewer: its last slots are padding past its length
        valid = v.valid.clone()
        pos = v.positions.clone()
        valid[1, 1, -5:] = False
        pos[1, 1, -5:] = 2**40 + torch.arange(5)
        v = replace(v, valid=valid, positions=pos)
    return v


def _real(view, b, h):
    """Indices of the real tokens of (row b, head h), in slot (= position) order."""
    return [t for t in range(view.shape[2]) if bool(view.valid[b, h, t])]


def _check(ours, ref, view, atol=1e-5, rtol=1e-5, mask=None):
    m = view.valid if mask is None else mask
    torch.testing.assert_close(ours[m], ref[m], atol=atol, rtol=rtol)


def _rot(p, d=8, rope=ROPE):
    """The RoPE matrix of position p, built entry by entry: R x = x cos + rotate_half(x) sin."""
    f = rope.inv_freq.double()
    r = torch.zeros(d, d, dtype=torch.float64)
    h = d // 2
    for i in range(h):
        a = float(p) * float(f[i])
        r[i, i], r[i, i + h] = math.cos(a), -math.sin(a)
        r[i + h, i + h], r[i + h, i] = math.cos(a), math.sin(a)
    return r


# ------------------------------------------------------------------------------------------ KeyDiff
def ref_keydiff(view):
    out = torch.zeros(view.shape)
    for b in range(view.shape[0]):
        for h in range(view.shape[1]):
            real = _real(view, b, h)
            unit = [view.keys[b, h, t].double() / view.keys[b, h, t].double().norm() for t in real]
            anchor = sum(unit) / len(unit)
            for t in real:
                k = view.keys[b, h, t].double()
                out[b, h, t] = -float(k @ anchor / (k.norm() * anchor.norm()))
    return out


# ------------------------------------------------------------------------------------------ LagKV
def ref_lagkv(view, sinks, lag, cross=False):
    out = torch.zeros(view.shape)
    for b in range(view.shape[0]):
        for h in range(view.shape[1]):
            real = _real(view, b, h)
            n = len(real)
            if n < sinks + 2 * lag:
                for i, t in enumerate(real):
                    out[b, h, t] = 1.0 if i < sinks else (i - sinks) / (n - sinks)
                continue
            for t in real:
                out[b, h, t] = 1.0
            parts = (n - sinks) // lag
            for p in range(parts - 1):
                cur = real[sinks + p * lag: sinks + (p + 1) * lag]
                ref = real[sinks + (p + 1) * lag: sinks + (p + 2) * lag]
                score = [0.0] * lag
                for x in (view.keys, view.values):
                    d = x.shape[-1]
                    lo = [min(float(x[b, h, r, c]) for r in ref) for c in range(d)]
                    hi = [max(float(x[b, h, r, c]) for r in ref) for c in range(d)]
                    stds = []
                    for t in cur:
                        z = [(float(x[b, h, t, c]) - lo[c]) / (hi[c] - lo[c]) for c in range(d)]
                        mean = sum(z) / d
                        stds.append(math.sqrt(sum((u - mean) ** 2 for u in z) / (d - 1)))
                    e = [math.exp(s - max(stds)) for s in stds]
                    for i in range(lag):
                        score[i] += e[i] / sum(e) / 2
                if cross:
                    for i, t in enumerate(cur):
                        out[b, h, t] = score[i]
                else:
                    for i, t in enumerate(cur):
                        out[b, h, t] = sum(1 for s in score if s < score[i]) / lag
    return out


# ------------------------------------------------------------------------------------------ CUR
def ref_cur(view, sinks, window, kind, local=True):
    out = torch.zeros(view.shape)
    for b in range(view.shape[0]):
        for h in range(view.shape[1]):
            real = _real(view, b, h)
            k2 = [float((view.keys[b, h, t].double() ** 2).sum()) for t in real]
            v2 = [float((view.values[b, h, t].double() ** 2).sum()) for t in real]
            if local:
                for arr in (k2, v2):
                    for s in range(0, len(real), window):
                        tot = sum(arr[s: s + window])
                        arr[s: s + window] = [a / tot for a in arr[s: s + window]]
            comb = {"key": k2, "value": v2, "kv_avg": [(a + c) / 2 for a, c in zip(k2, v2)],
                    "kv_product": [a * c for a, c in zip(k2, v2)]}[kind]
            tot = sum(comb)
            for i, t in enumerate(real):
                out[b, h, t] = 1.0 if i < sinks else comb[i] / tot
    return out


def test_keydiff_matches_loop_reference():
    for ragged in (False, True):
        view = _view(seed=1, ragged=ragged)
        _check(KeyDiff()(view), ref_keydiff(view), view)


@pytest.mark.parametrize("cross", [False, True])
def test_lagkv_matches_loop_reference(cross):
    for t, ragged in ((40, False), (40, True), (12, False)):  # 12 < sinks + 2 lag: the recency ramp
        view = _view(seed=2, t=t, w=4, ragged=ragged)
        _check(LagKV(sinks=2, lag=5, cross_scoring=cross, tiebreak=False)(view), ref_lagkv(view, 2, 5, cross), view)
        tb = LagKV(sinks=2, lag=5, cross_scoring=cross)(view)  # the tie-break never reorders distinct ranks
        plain = LagKV(sinks=2, lag=5, cross_scoring=cross, tiebreak=False)(view)
        assert bool(((tb - plain).abs() < 0.5 / 5 + 1e-6).all())


@pytest.mark.parametrize("kind", ["key", "value", "kv_avg", "kv_product"])
def test_cur_matches_loop_reference(kind):
    view = _view(seed=3, ragged=True)
    _check(CUR(sinks=3, window=6, kind=kind)(view), ref_cur(view, 3, 6, kind), view, rtol=1e-4)
    _check(CUR(sinks=3, kind=kind, local=False)(view), ref_cur(view, 3, 6, kind, local=False), view, rtol=1e-4)


# ------------------------------------------------------------------------------------------ leverage
def ref_leverage(view, rope, sketch, seed, mask=None):
    """Plain leverage with an explicit inverse (not a Cholesky solve), then a per-row z-score."""
    b_, h_, t_, d = view.keys.shape
    phi = torch.randn(b_, h_, d, sketch, generator=torch.Generator().manual_seed(seed)) * (1 / math.sqrt(sketch))
    valid = view.valid if mask is None else mask
    raw = torch.zeros(view.shape, dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            real = [t for t in range(t_) if bool(valid[b, h, t])]
            pre = [_rot(int(view.positions[b, h, t]), d, rope).T @ view.keys[b, h, t].double() for t in real]
            mean = sum(pre) / len(pre)
            xs = [(k - mean) @ phi[b, h].double() for k in pre]
            g = sum(torch.outer(x, x) for x in xs) + 1e-2 * torch.eye(sketch, dtype=torch.float64)
            gi = torch.linalg.inv(g)
            for t, x in zip(real, xs):
                raw[b, h, t] = max(0.0, float(x @ gi @ x))
    out = torch.zeros(view.shape)
    for b in range(b_):
        vals = [float(raw[b, h, t]) for h in range(h_) for t in range(t_) if bool(valid[b, h, t])]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for h in range(h_):
            for t in range(t_):
                if bool(valid[b, h, t]):
                    out[b, h, t] = (float(raw[b, h, t]) - mean) / max(std, 1e-6)
    return out


def test_leverage_matches_loop_reference():
    view = _view(seed=4, ragged=True)
    view = replace(view, generator=torch.Generator().manual_seed(11))
    _check(LeverageScore(ROPE, sketch=6)(view), ref_leverage(view, ROPE, 6, 11), view, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------ non-causal attention
def ref_noncausal(view, chunk, mask=None, window=None):
    b_, hq, w_all, d = view.queries.shape
    h_ = view.shape[1]
    g = hq // h_
    valid = view.valid if mask is None else mask
    qs = range(w_all - (window or w_all), w_all)
    out = torch.zeros(view.shape)
    for b in range(b_):
        for h in range(h_):
            real = [t for t in range(view.shape[2]) if bool(valid[b, h, t])]
            origin = min(int(view.positions[b, h, t]) for t in real)
            last = max(int(view.positions[b, h, t]) for t in real)
            att = {t: 0.0 for t in real}
            for j in range(g):
                for w in qs:
                    qp = int(view.query_positions[w])
                    if not bool(view.query_valid[b, w]) or not origin <= qp <= last:
                        continue
                    keys = [t for t in real if (int(view.positions[b, h, t]) - origin) // chunk == (qp - origin) // chunk]
                    logits = [float(view.queries[b, h * g + j, w].double() @ view.keys[b, h, t].double()) for t in keys]
                    if not logits:
                        continue
                    m = max(logits)
                    e = [math.exp(x - m) for x in logits]
                    for t, x in zip(keys, e):
                        att[t] += x / sum(e) / g
            s = [att.get(t, 0.0) * float(view.values[b, h, t].double().norm()) if t in att else 0.0
                 for t in range(view.shape[2])]
            for t in real:
                nb = [s[u] for u in (t - 1, t, t + 1) if 0 <= u < view.shape[2]]
                out[b, h, t] = sum(nb) / 3
    return out


def _zscore_rows(x, valid):
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        vals = x[b][valid[b]].double()
        out[b] = ((x[b].double() - vals.mean()) / vals.std().clamp(min=1e-6)).float()
    return out.masked_fill(~valid, 0.0)


def test_noncausal_attention_matches_loop_reference():
    view = _view(seed=5, t=30, w=30, seen=30, pad=(2, 0))  # prefill-like: every token's query is buffered
    ours = NonCausalAttention(chunk=8, window=None)(view)
    _check(ours, _zscore_rows(ref_noncausal(view, 8), view.valid), view, atol=1e-4, rtol=1e-4)
    dec = _view(seed=6, ragged=True)  # decoding: only the newest queries
    _check(NonCausalAttention(chunk=8, window=4)(dec), _zscore_rows(ref_noncausal(dec, 8, window=4), dec.valid), dec,
           atol=1e-4, rtol=1e-4)


def test_compactor_matches_loop_reference():
    view = _view(seed=7, t=30, w=30, seen=30, pad=(2, 0))
    view = replace(view, generator=torch.Generator().manual_seed(3))
    ours = Compactor(ROPE, sinks_start=3, sinks_end=2, chunk=8, sketch=6, blending=0.3, window=None)(view)
    mid = view.valid.clone()
    for b in range(2):
        for h in range(2):
            real = _real(view, b, h)
            for t in real[:3] + real[-2:]:
                mid[b, h, t] = False
    lev = ref_leverage(view, ROPE, 6, 3, mask=mid)
    att = _zscore_rows(ref_noncausal(view, 8, mask=mid), mid)
    _check(ours, 0.3 * lev + att, view, atol=1e-4, rtol=1e-4, mask=mid)
    sinks = view.valid & ~mid
    top = ours.masked_fill(~mid, -1e9).amax(-1, keepdim=True)
    assert bool((ours[sinks] > top.expand_as(ours)[sinks]).all())  # sinks above every other token


# ------------------------------------------------------------------------------------------ expected attention / CAP
def _pre_queries(view, window, sinks):
    """Per (row, query head): the pre-RoPE queries (explicit inverse rotations) that enter the statistics."""
    first = [min(int(view.positions[b][view.valid[b]].min()), 2**62) for b in range(view.shape[0])]
    w_all = view.queries.shape[2]
    out = {}
    for b in range(view.shape[0]):
        for hq in range(view.queries.shape[1]):
            out[b, hq] = [_rot(int(view.query_positions[w])).T @ view.queries[b, hq, w].double()
                          for w in range(w_all - window, w_all)
                          if bool(view.query_valid[b, w]) and int(view.query_positions[w]) >= first[b] + sinks]
    return out


def _mean_rotation(start, n):
    return sum(_rot(p) for p in range(start, start + n)) / n


def ref_expected(view, window, future, sinks, covariance=True, vnorm=True, eps=0.0):
    qs = _pre_queries(view, window, sinks)
    rbar = _mean_rotation(view.seen, future)
    b_, h_, t_, d = view.keys.shape
    g = view.queries.shape[1] // h_
    out = torch.zeros(view.shape)
    for b in range(b_):
        for h in range(h_):
            real = _real(view, b, h)
            cand = real[sinks:]
            acc = {t: 0.0 for t in cand}
            for j in range(g):
                q = qs[b, h * g + j]
                mu = sum(q) / len(q)
                cov = sum(torch.outer(x - mu, x - mu) for x in q) / len(q)
                mu, cov = rbar @ mu, rbar @ cov @ rbar.T
                logits = []
                for t in cand:
                    k = view.keys[b, h, t].double()
                    x = float(k @ mu) * view.scale
                    if covariance:
                        x += float(k @ cov @ k) * view.scale**2 / 2
                    logits.append(x)
                m = max(logits)
                e = [math.exp(x - m) for x in logits]
                for t, x in zip(cand, e):
                    acc[t] += x / sum(e) / g
            for t in cand:
                s = acc[t]
                out[b, h, t] = (s + eps) * float(view.values[b, h, t].double().norm()) if vnorm else s
    return out


def ref_cap(view, window, future, sinks, tau, eps=1e-6):
    qs = _pre_queries(view, window, sinks)
    rbar = _mean_rotation(view.seen, future)
    b_, h_, t_, d = view.keys.shape
    g = view.queries.shape[1] // h_
    out = torch.zeros(view.shape)
    for b in range(b_):
        for h in range(h_):
            cand = _real(view, b, h)[sinks:]
            acc = {t: 0.0 for t in cand}
            for j in range(g):
                a = rbar @ (sum(qs[b, h * g + j]) / len(qs[b, h * g + j]))
                logits = [tau * max(-1.0, min(1.0, float(view.keys[b, h, t].double() @ a
                                                         / (view.keys[b, h, t].double().norm() * a.norm()))))
                          for t in cand]
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                cap = torch.eye(d, dtype=torch.float64)
                for t, wt in zip(cand, w):
                    v = view.values[b, h, t].double()
                    cap += (wt + eps) * torch.outer(v, v)
                ci = torch.linalg.inv(cap)
                for t, wt in zip(cand, w):
                    v = view.values[b, h, t].double()
                    acc[t] += wt * float(v @ ci @ v) / g
            for t in cand:
                out[b, h, t] = acc[t]
    return out


def _non_sinks(view, sinks):
    m = view.valid.clone()
    for b in range(view.shape[0]):
        for h in range(view.shape[1]):
            for t in _real(view, b, h)[:sinks]:
                m[b, h, t] = False
    return m


@pytest.mark.parametrize("covariance,vnorm", [(True, True), (False, False)])
def test_expected_attention_matches_loop_reference(covariance, vnorm):
    for view in (_view(seed=8, ragged=True), _view(seed=9, t=24, w=24, seen=24, pad=(2, 0))):
        w = view.queries.shape[2]
        ours = ExpectedAttention(ROPE, window=w, future=16, sinks=2, covariance=covariance, value_norm=vnorm)(view)
        ns = _non_sinks(view, 2)
        _check(ours, ref_expected(view, w, 16, 2, covariance, vnorm), view, atol=1e-5, rtol=1e-4, mask=ns)
        sink = view.valid & ~ns
        assert bool((ours[sink] > ours.masked_fill(~ns, -1).amax(-1, keepdim=True).expand_as(ours)[sink]).all())


def test_cap_matches_loop_reference():
    for view in (_view(seed=10, ragged=True), _view(seed=11, t=24, w=24, seen=24, pad=(2, 0))):
        w = view.queries.shape[2]
        ours = CAP(ROPE, tau=3.0, window=w, future=16, sinks=2)(view)
        _check(ours, ref_cap(view, w, 16, 2, 3.0), view, atol=1e-5, rtol=1e-4, mask=_non_sinks(view, 2))


# ------------------------------------------------------------------------------------------ CriticalKV
def test_criticalkv_matches_loop_reference():
    torch.manual_seed(0)
    wo = [torch.randn(12, 4 * 8) for _ in range(4)]  # 4 layers, hidden 12, Hq = 4 heads of 8
    proj = OutputProjection(wo, heads=4)
    view = _view(seed=12, ragged=True, layer_idx=2, cache_budget=10)
    ours = CriticalKV(KeyNorm(), proj, epsilon=1e-3, first_stage=0.5)(view)
    inner = KeyNorm()(view)
    for b in range(2):
        for h in range(2):
            real = _real(view, b, h)
            top = sorted(real, key=lambda t: -float(inner[b, h, t]))[:5]
            for t in real:
                if t in top:
                    assert float(ours[b, h, t]) == torch.finfo(torch.float32).max
                    continue
                norm = 0.0
                for j in range(2):
                    v = view.values[b, h, t].double()
                    w = wo[2].t().double()[(h * 2 + j) * 8:(h * 2 + j + 1) * 8]  # [Dv, hidden]
                    norm += float((v @ w).abs().sum()) / 2
                ref = (float(inner[b, h, t]) + 1e-3) * norm
                assert math.isclose(float(ours[b, h, t]), ref, rel_tol=1e-4), (b, h, t)


# ------------------------------------------------------------------------------------------ invariants
def _blocks():
    proj = OutputProjection([torch.randn(12, 32) for _ in range(4)], heads=4)
    return {
        "keydiff": KeyDiff(), "lagkv": LagKV(sinks=2, lag=4), "cur": CUR(sinks=2, window=4),
        "noncausal": NonCausalAttention(chunk=8, window=8), "expected": ExpectedAttention(ROPE, window=8, future=8),
        "cap": CAP(ROPE, window=8, future=8), "critical": CriticalKV(KeyDiff(), proj),
    }


@pytest.mark.parametrize("name", sorted(_blocks()))
def test_padded_row_scores_as_the_row_alone(name):
    """Left padding of a row (and its position offset) never changes a real token's score."""
    block = _blocks()[name]
    view = _view(seed=13, t=40, seen=40, pad=(4, 0), cache_budget=12)  # every position held: slots = positions
    alone = replace(view, keys=view.keys[:1, :, 4:], values=view.values[:1, :, 4:], positions=view.positions[:1, :, 4:] - 4,
                    valid=view.valid[:1, :, 4:], queries=view.queries[:1], query_positions=view.query_positions - 4,
                    query_valid=view.query_valid[:1], seen=view.seen - 4, prompt_length=view.prompt_length - 4)
    # the padded row's first 4 slots must be its padding: drop them
    assert not bool(view.valid[0, :, :4].any()) and bool(view.valid[0, :, 4:].all())
    torch.testing.assert_close(block(view)[:1, :, 4:], block(alone), atol=1e-5, rtol=1e-4)


def test_query_scorers_without_queries_keep_their_sinks():
    view = replace(_view(seed=14), queries=None, query_positions=None, query_valid=None)
    for block in (ExpectedAttention(ROPE, window=8, sinks=3), CAP(ROPE, window=8, sinks=3)):
        s = block(view)
        assert torch.isfinite(s).all() and bool((s[view.valid & (torch.arange(40) < 10)] >= 0).all())
    assert torch.equal(NonCausalAttention()(view), torch.zeros(view.shape))


def test_rotary_matches_the_models_rope():
    model = tiny_model("llama", layers=1, heads=4, kv_heads=2, head_dim=16)
    rope = Rotary.from_model(model)
    x = torch.randn(1, 4, 10, 16)
    pos = torch.arange(5, 15)
    cos, sin = model.model.rotary_emb(x, pos[None])
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ref, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(rope.rotate(x, pos), ref)
    torch.testing.assert_close(rope.unrotate(ref, pos), x, atol=1e-5, rtol=1e-5)
    r = rope.mean_rotation(3, 4)
    torch.testing.assert_close(x[0, 0, 0] @ r.T, sum(rope.rotate(x[0, 0, :1], torch.tensor([p]))[0] for p in range(3, 7)) / 4)


def test_bad_arguments_are_refused():
    with pytest.raises(KVComposeError, match="lag"):
        LagKV(lag=0)
    # bad types: the session's type checker (jaxtyping + beartype) or the block's own check refuses them
    with pytest.raises((KVComposeError, TypeCheckError)):
        CUR(kind="nope")
    with pytest.raises((KVComposeError, TypeCheckError)):
        ExpectedAttention(None)
    with pytest.raises((KVComposeError, TypeCheckError)):
        CAP("rope")
    with pytest.raises(KVComposeError, match="first_stage"):
        CriticalKV(KeyNorm(), OutputProjection([torch.zeros(4, 8)], heads=2), first_stage=2.0)
    with pytest.raises((KVComposeError, TypeCheckError)):
        CriticalKV(KeyNorm(), None)
    with pytest.raises(KVComposeError, match="partial rotary"):
        ROPE.rotate(torch.zeros(1, 2, 6), torch.arange(2))
    with pytest.raises(KVComposeError, match="needs the model"):
        from kvcompose import methods

        methods.expected_attention()


def test_topk_over_a_ported_scorer_keeps_its_sinks():
    view = _view(seed=15)
    sel, _ = Pipeline(ExpectedAttention(ROPE, window=8, sinks=3), TopK()).select(view, 12)
    for b in range(2):
        for h in range(2):
            first = _real(view, b, h)[:3]
            assert set(first) <= set(sel.kept[b, h].tolist())


def test_scores_are_finite_float32_on_the_views_device():
    """Scores are float32 on the view's device and never NaN for real tokens."""
    view = _view(seed=16, ragged=True, cache_budget=12)
    for name, block in _blocks().items():
        s = block(view)
        assert s.dtype == torch.float32 and s.device == view.keys.device
        assert torch.isfinite(s[view.valid]).all(), name


# ------------------------------------------------------------------------------------------ presets
_PRESET_MODEL = {}


def _preset_model():
    if not _PRESET_MODEL:
        _PRESET_MODEL["m"] = tiny_model("qwen3", layers=2)
    return _PRESET_MODEL["m"]


@pytest.mark.parametrize("name", sorted(__import__("kvcompose").methods.PORTED))
def test_every_ported_preset_runs_in_generate(name):
    from kvcompose import KVComposeCache, methods

    model = _preset_model()
    kw = {"lagkv": {"lag": 8}, "chunkkv": {"base": methods.snapkv(window=8)}, "adakv": {"base": methods.snapkv(window=8)},
          "duo_attention": {"profile": {"head_scores": [[0.9, 0.1], [0.2, 0.8]]}},
          "lukv": {"curves": ratio_curves(2, 2, seed=0)}}.get(name, {})
    pipe = methods.preset(name, model=model, **kw)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = KVComposeCache(model, pipe, budget=24, interval=8)
    out = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=60, min_new_tokens=60, do_sample=False)
    assert out.shape == (1, 72) and cache.stats.compress_calls > 0
    if pipe.allocator.uniform:
        assert max(cache.held_lengths()) < 24 + 8
    if name in methods.NEEDS_MODEL:
        with pytest.raises(KVComposeError, match="model"):
            methods.preset(name, **kw)
    if name in methods.NEEDS_PROFILE:
        with pytest.raises(KVComposeError, match="calibrate"):
            methods.preset(name, model=model)
