"""The merging part (`kvcompose.blocks.merging`): MergeSimilar and CAM against plain-loop references, and the
pipeline / layer contract: only the tokens that leave for good are merged, only kept values change, keys never,
rows outside an event are untouched, any selector and tier works, a merger needs a selector."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from helpers import random_view
from kvcompose import (
    AccumulatedAttention, BlockGranular, HeadUtility, Hierarchy, HostTier, KeyNorm, KVComposeCache, KVComposeError,
    Pipeline, ProtectRecent, RandomDrop, TopK, methods,
)
from kvcompose.blocks import CAM, EventClock, MergeSimilar
from kvcompose.blocks.merging import kept_mask
from kvcompose.testing import tiny_model


def _select(view, budget, merger, selector=None, scorer=None, channels=None):
    parts = [scorer if scorer is not None else KeyNorm(), selector or TopK()] if not isinstance(selector, RandomDrop) \
        else [selector]
    pipe = Pipeline(*parts, merger)
    sel, _ = pipe.select(view, budget, channels=channels)
    return pipe, sel


def _evicted(view, sel):
    keep = kept_mask(sel.kept, view.shape[2])
    return view.valid & ~keep


# ------------------------------------------------------------------------------------------ MergeSimilar
def ref_merge_similar(view, kept, evicted, threshold=0.0, fraction=1.0):
    out = view.values.clone().double()
    b_, h_, t_, _ = view.values.shape
    for b in range(b_):
        for h in range(h_):
            ks = [int(k) for k in kept[b, h] if k >= 0]
            es = [t for t in range(t_) if bool(evicted[b, h, t])]
            unit = lambda t: view.keys[b, h, t].double() / max(float(view.keys[b, h, t].double().norm()), 1e-6)  # noqa: E731
            cands = []
            for e in es:
                sims = [float(unit(e) @ unit(k)) for k in ks]
                j = max(range(len(ks)), key=lambda i: sims[i])
                if sims[j] >= threshold:
                    cands.append((sims[j], e, ks[j]))
            cands.sort(key=lambda c: -c[0])
            cands = cands[: math.ceil(fraction * len(cands))]
            acc = {k: (torch.zeros(view.values.shape[-1], dtype=torch.float64), 0.0) for k in ks}
            for s, e, k in cands:
                ve, vk = view.values[b, h, e].double(), view.values[b, h, k].double()
                w = max(s, 0.0) * float(ve.norm()) / (float(ve.norm()) + float(vk.norm()) + 1e-6)
                acc[k] = (acc[k][0] + w * ve, acc[k][1] + w)
            for k, (v, w) in acc.items():
                if w > 0:
                    out[b, h, k] = (view.values[b, h, k].double() + v) / (1 + w)
    return out.float()


@pytest.mark.parametrize("threshold,fraction", [(0.0, 1.0), (0.3, 1.0), (0.0, 0.5)])
def test_merge_similar_matches_loop_reference(threshold, fraction):
    view = random_view(b=2, h=2, t=30, d=8, seen=36, pad=[3, 0], seed=1)
    _, sel = _select(view, 12, MergeSimilar(threshold=threshold, fraction=fraction))
    ref = ref_merge_similar(view, sel.kept, _evicted(view, sel), threshold, fraction)
    keep = kept_mask(sel.kept, 30)
    torch.testing.assert_close(sel.values[keep], ref[keep], atol=1e-5, rtol=1e-5)
    assert not torch.equal(sel.values[keep], view.values[keep])  # something really merged


# ------------------------------------------------------------------------------------------ CAM
def ref_cam(view, kept, evicted, order, attn, k, window, seed):
    """Candidates, windows and probabilities by loops; the Bernoulli draws in the block's layout ([B, H, C], the
    candidates of each head ascending), from a generator seeded the same way."""
    b_, h_, t_, dv = view.values.shape
    cands, probs, wins = {}, {}, {}
    c = 0
    for b in range(b_):
        for h in range(h_):
            rank = {int(s): i for i, s in enumerate(order[b, h])}
            ev = sorted((t for t in range(t_) if bool(evicted[b, h, t])), key=lambda t: rank[t])[:k]
            cands[b, h] = sorted(ev)
            c = max(c, len(ev))
            ks = [int(x) for x in kept[b, h] if x >= 0]
            for i in cands[b, h]:
                after = [x for x in ks if x > i][:window]
                wins[b, h, i] = after
                if not after:
                    probs[b, h, i] = 0.0
                    continue
                mean = sum(float(attn[b, h, x]) for x in after) / len(after)
                p = float(attn[b, h, i]) / mean if mean > 0 else (0.0 if float(attn[b, h, i]) == 0 else 1.0)
                probs[b, h, i] = min(max(p, 0.0), 1.0)
    p = torch.zeros(b_, h_, c)
    for (b, h), cs in cands.items():
        for j, i in enumerate(cs):
            p[b, h, j] = probs[b, h, i]
    draw = torch.bernoulli(p, generator=torch.Generator().manual_seed(seed))
    out = view.values.clone().double()
    for (b, h), cs in cands.items():
        for j, i in enumerate(cs):
            if draw[b, h, j] and wins[b, h, i]:
                for x in wins[b, h, i]:
                    out[b, h, x] += view.values[b, h, i].double() / len(wins[b, h, i])
    return out.float()


def test_cam_matches_loop_reference():
    view = random_view(b=2, h=2, t=40, d=8, seen=46, prompt=30, pad=[3, 0], seed=2)
    view = replace(view, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(3)
    attn = torch.rand(2, 2, 40, generator=gen) * view.valid
    pipe, sel = _select(view, 16, CAM(window=5), channels=attn[..., None])
    k = 46 - 30  # tokens since the prompt: the first event
    ref = ref_cam(view, sel.kept, _evicted(view, sel), sel.order, attn, k, 5, 7)
    keep = kept_mask(sel.kept, 40)
    torch.testing.assert_close(sel.values[keep], ref[keep], atol=1e-5, rtol=1e-5)
    assert not torch.equal(sel.values[keep], view.values[keep])


def test_cam_candidates_follow_the_event_clock():
    """k = tokens seen since the layer's last event: the clock ticks at every event (per row)."""
    view = random_view(b=2, h=2, t=40, d=8, seen=46, prompt=30, seed=3)
    clock = torch.tensor([40, -1])
    assert EventClock.since(clock, view).tolist() == [6, 16]
    assert EventClock.tick(clock, replace(view, rows=torch.tensor([False, True]))).tolist() == [40, 46]
    cam = CAM(window=4)
    kept = torch.arange(10, 26).expand(2, 2, 16)
    evicted = torch.zeros(2, 2, 40, dtype=torch.bool)
    evicted[..., :10] = True
    order = torch.cat([torch.arange(10, 26), torch.arange(9, -1, -1), torch.arange(26, 40)]).expand(2, 2, 40)
    cand, ok = cam.candidates(kept, evicted, order, torch.tensor([3, 20]))
    assert cand[0, 0][ok[0, 0]].tolist() == [7, 8, 9] and cand[1, 0][ok[1, 0]].tolist() == list(range(10))


# ------------------------------------------------------------------------------------------ the contract
def test_only_kept_values_change_and_keys_never():
    view = random_view(b=2, h=2, t=30, d=8, seen=36, seed=4)
    for merger in (MergeSimilar(), CAM(window=3)):
        _, sel = _select(view, 12, merger, channels=torch.rand(2, 2, 30, 1))
        keep = kept_mask(sel.kept, 30)
        assert torch.equal(sel.values[~keep], view.values[~keep])


def test_rows_outside_the_event_are_untouched():
    view = random_view(b=2, h=2, t=30, d=8, seen=36, seed=5, rows=torch.tensor([True, False]))
    _, sel = _select(view, 12, MergeSimilar())
    assert torch.equal(sel.values[1], view.values[1]) and not torch.equal(sel.values[0], view.values[0])


def test_no_eviction_no_merge():
    view = random_view(b=1, h=2, t=20, d=8, seed=6)
    _, sel = _select(view, 20, MergeSimilar())
    assert torch.equal(sel.values, view.values)


def test_merger_needs_a_selector_and_comes_once():
    with pytest.raises(KVComposeError, match="no selector"):
        Pipeline(MergeSimilar())
    with pytest.raises(KVComposeError, match="mergers"):
        Pipeline(KeyNorm(), TopK(), MergeSimilar(), CAM())
    with pytest.raises(KVComposeError, match="already merges"):
        methods.with_merger(methods.merging(), CAM())
    with pytest.raises(KVComposeError):
        MergeSimilar(fraction=0.0)
    with pytest.raises(KVComposeError):
        CAM(window=0)


MODEL = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _gen(pipe, budget=20, interval=4, new=40, rows=1):
    ids = torch.randint(3, 128, (rows, 10), generator=torch.Generator().manual_seed(0))
    cache = KVComposeCache(MODEL, pipe, budget=budget, interval=interval)
    out = MODEL.generate(input_ids=ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return torch.stack(out.logits, 1), cache


def test_merging_changes_decoding_and_keeps_the_kept_set():
    """With a merger the same tokens are kept (the selector decides), the logits differ (values were merged)."""
    base = Pipeline(ProtectRecent(4), AccumulatedAttention(), TopK())
    for merger in (MergeSimilar(), CAM(window=4)):
        a, ca = _gen(base)
        b, cb = _gen(base.replace(merger))
        assert ca.stats.compress_calls > 0 and not torch.allclose(a, b)
        held_a = [layer.segment.store.view().keys for layer in ca.layers]
        assert all(x.shape == layer.segment.store.view().keys.shape for x, layer in zip(held_a, cb.layers))


def test_a_tier_that_keeps_everything_merges_nothing():
    """HostTier keeps every token it receives: nothing leaves for good, so nothing is merged (bit-identical)."""
    base = Pipeline(ProtectRecent(4), KeyNorm(), TopK(), HostTier())
    a, _ = _gen(base)
    b, cache = _gen(base.replace(MergeSimilar()))
    assert torch.equal(a, b) and cache.memory().by_tier["host"] > 0


def test_merging_with_hierarchy_paged_and_block_granular():
    for pipe in (methods.merging().replace(Hierarchy(0.2, 0.1)),
                 methods.cam().replace(HeadUtility(floor=0.5, window=4)),
                 Pipeline(KeyNorm(), BlockGranular(TopK(), block=4), MergeSimilar()),
                 Pipeline(RandomDrop(), CAM(window=4))):
        logits, cache = _gen(pipe, rows=2)
        assert torch.isfinite(logits).all() and cache.stats.compress_calls > 0


# ------------------------------------------------------------------------------------------ DecodeAttention
def _steps(seed=0, b=2, h=2, g=2, d=8, prompt=(5, 3), decoded=4):
    """A left-padded batch (prompts of `prompt` tokens, padded to the longest) decoding `decoded` tokens: the
    attention steps of the prompt, of the decoded tokens as one chunk, and of each decoded token alone."""
    from kvcompose.view import AttentionStep

    gen = torch.Generator().manual_seed(seed)
    w = max(prompt)
    t = w + decoded
    keys = torch.randn(b, h, t, d, generator=gen)
    queries = torch.randn(b, h * g, t, d, generator=gen)
    pos = torch.arange(t).expand(b, h, t)
    valid = torch.stack([torch.arange(t) >= w - p for p in prompt])[:, None].expand(b, h, t)

    def step(lo, hi):  # queries lo..hi-1 over keys 0..hi-1, causal, padding masked
        mask = (pos[:, :, None, :hi] <= torch.arange(lo, hi)[:, None]) & valid[:, :, None, :hi]
        return AttentionStep(queries[:, :, lo:hi], keys[:, :, :hi], pos[:, :, :hi], valid[:, :, :hi], mask, d**-0.5)

    return step(0, w), step(w, t), [step(i, i + 1) for i in range(w, t)], w


def test_decode_attention_skips_the_prompt_and_sums_a_chunk_as_one_token_steps():
    from kvcompose.blocks import DecodeAttention

    obs = DecodeAttention()
    prefill, chunk, singles, w = _steps()
    b, h, t = prefill.valid.shape
    assert torch.equal(obs.observe(torch.zeros(b, h, t), prefill), torch.zeros(b, h, t))  # padded rows too
    state = torch.zeros(b, h, w)
    for s in singles:  # one token per forward: the state grows by the new token's slot (0) each time
        state = obs.observe(torch.cat([state, torch.zeros(b, h, 1)], -1), s)
    chunked = obs.observe(torch.zeros(b, h, chunk.keys.shape[2]), chunk)
    assert torch.allclose(chunked, state, atol=1e-6)
    assert state.sum() > 1.0  # every decoded query added its attention
    assert torch.allclose(chunked.sum(-1), torch.full((b, h), float(len(singles))), atol=1e-5)
