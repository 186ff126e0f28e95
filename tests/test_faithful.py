"""Presets against loop-level references of each reference implementation's rule (the fixes of the
"faithful to the seed systems" work): Random Attention's `random_pp`, its shared keep-set ablation, VaSE's
query-free variant and its ablation steps, and each preset's own compression interval."""

import math
from dataclasses import replace

import torch

from helpers import random_view
from kvcompose import KVComposeCache, LayerSpec, Pipeline, ProtectRecent, TopK, ValueNorm, methods
from kvcompose.testing import tiny_model


def kept_positions(pipeline, view, budget):
    sel, _ = pipeline.select(view, budget)
    return view.positions.gather(-1, sel.kept.clamp(min=0))


def test_random_pp_keeps_the_first_k_minus_1_prompt_tokens_and_draws_one():
    """Reference (`random_pp`): K = budget - recent; the first min(prompt, K - 1) prompt tokens are forced,
    the newest `recent` follow, and at least one slot is drawn at random among the rest."""
    recent, budget, prompt = 8, 24, 40  # prompt longer than the room: K - 1 = 15 prompt tokens kept
    view = random_view(b=2, h=2, t=60, seen=80, w=8, prompt=prompt)
    for seed in range(5):
        v = replace(view, generator=torch.Generator().manual_seed(seed))
        got = kept_positions(methods.random_attention(recent=recent), v, budget)
        for b in range(2):
            for h in range(2):
                pos = view.positions[b, h].tolist()
                kept = got[b, h].tolist()
                first_prompt = [p for p in pos if p < prompt][: budget - recent - 1]
                assert set(first_prompt) <= set(kept)
                assert set(range(80 - recent, 80)) <= set(kept)
                drawn = set(kept) - set(first_prompt) - set(range(80 - recent, 80))
                assert len(drawn) == 1 and len(kept) == budget
    # a short prompt is kept whole, and the rest of the room is drawn at random
    short = random_view(b=1, h=2, t=60, seen=80, w=8, prompt=6)
    got = kept_positions(methods.random_attention(recent=recent), short, budget)
    for h in range(2):
        assert {p for p in short.positions[0, h].tolist() if p < 6} <= set(got[0, h].tolist())


def test_random_attention_without_prompt_protection_and_with_a_shared_keep_set():
    view = random_view(b=1, h=4, t=50, seen=50, w=8, prompt=30)
    aligned = replace(view, positions=view.positions[:, :1].expand(1, 4, 50).contiguous())
    got = kept_positions(methods.random_attention(recent=8, shared_heads=True), aligned, 20)
    assert all(got[0, h].tolist() == got[0, 0].tolist() for h in range(4))  # one keep-set for the layer
    per_head = kept_positions(methods.random_attention(recent=8), aligned, 20)
    assert len({tuple(per_head[0, h].tolist()) for h in range(4)}) > 1  # independent per head
    bare = kept_positions(methods.random_attention(recent=8, protect_prompt=False), aligned, 20)
    prompt_kept = [(bare[0, h] < 30).sum().item() for h in range(4)]
    assert min(prompt_kept) < 12  # nothing forces the prompt: the random draw drops some of it


def test_query_free_vase_matches_the_reference_projection():
    """Reference (`cur_fixed_gauss`): G [D, r] ~ N(0, 1/r) fixed per row; score |kG|^2 |vG|^2 normalised;
    4 sinks and the newest window kept; top-(K - window) of the rest."""
    recent, budget, rank = 8, 24, 20
    view = random_view(b=1, h=2, t=60, seen=60, w=recent, g=2)
    pipe = methods.vase(query_free=True, recent=recent, rank=rank)
    scorer = pipe.scorer
    g = scorer.init(LayerSpec(0, 4, 1, 2, 8, 8, torch.device("cpu"), torch.float32))
    sel, _ = pipe.select(view, budget, states=tuple(g if leaf is scorer else None for leaf in pipe.leaves))
    for h in range(2):
        k, v = view.keys[0, h].double(), view.values[0, h].double()
        gg = g[0, 0].double()
        s = (k @ gg).pow(2).sum(-1) * (v @ gg).pow(2).sum(-1)
        s = s / s.sum()
        forced = [0, 1, 2, 3] + list(range(60 - recent, 60))
        s[forced] = math.inf
        expect = sorted(torch.topk(s, budget).indices.tolist())
        assert sel.kept[0, h].tolist() == expect
    assert pipe.query_window == 0  # no query buffer at all


def test_vase_ablation_steps_and_the_largest_value_control():
    """attention top-k -> + value-range protection -> + sampling (VaSE), and the control that keeps the
    smallest value ranges (evicting the largest) — the composition of each is one line."""
    recent, budget = 8, 32
    view = random_view(b=1, h=2, t=60, seen=60, w=recent, g=2)
    full = methods.vase(recent=recent, window=recent)
    topk = Pipeline(ProtectRecent(recent), full.scorer, TopK())
    protected = Pipeline(*full.protectors, full.scorer, TopK())
    control = Pipeline(ProtectRecent(recent), -1.0 * ValueNorm(), TopK())
    kept = {name: kept_positions(p, view, budget) for name, p in
            [("topk", topk), ("protected", protected), ("vase", full), ("control", control)]}
    mag = view.values.float().amax(-1) - view.values.float().amin(-1)
    for h in range(2):
        cand = [i for i in range(60) if view.positions[0, h, i] < 60 - recent]
        m = mag[0, h].clone()
        m[:4] = math.inf  # the 4 sinks count as infinitely large (VaSE)
        large = {int(view.positions[0, h, cand[i]]) for i in torch.topk(m[cand], budget // 4).indices}
        assert large <= set(kept["protected"][0, h].tolist()) and large <= set(kept["vase"][0, h].tolist())
        top_values = {int(view.positions[0, h, cand[i]]) for i in torch.topk(mag[0, h, cand], 8).indices}
        assert not top_values & set(kept["control"][0, h].tolist())  # the control drops the largest values


def test_presets_carry_their_own_interval():
    model = tiny_model("llama", layers=1)
    assert KVComposeCache(model, methods.rkv(), budget=64).interval == 128
    assert KVComposeCache(model, methods.vase(), budget=512).interval == 64
    assert KVComposeCache(model, methods.random_attention(), budget=512).interval == 64
    assert KVComposeCache(model, methods.rkv(), budget=64, interval=32).interval == 32  # the user's wins
