"""Each preset's kept set equals a straightforward, loop-level reference of the paper's rule on random
inputs (no padding; all tokens valid)."""

import math

import pytest
import torch

from helpers import random_view
from kvcompose import KVComposeCache, methods
from kvcompose.testing import tiny_model


def kept_positions(pipeline, view, budget):
    sel, _ = pipeline.select(view, budget)
    return view.positions.gather(-1, sel.kept)


def topk_sorted(score_row, k, forced):
    """Reference: keep `forced` slots, fill the rest with the highest scores; return sorted slots."""
    s = score_row.clone().double()
    s[forced] = float("inf")
    return sorted(torch.topk(s, k).indices.tolist())


def ref_window_logits(view, b, h, window):
    g = view.groups
    q = view.queries[b, h * g : (h + 1) * g, -window:].double()  # [G, W, D]
    k = view.keys[b, h].double()
    return torch.einsum("gwd,td->gwt", q, k) * view.scale  # [G, W, T]


def test_streaming_llm():
    view = random_view(b=2, h=2, t=40, seen=60)
    got = kept_positions(methods.streaming_llm(), view, 12)
    for b in range(2):
        for h in range(2):
            pos = view.positions[b, h].tolist()
            assert got[b, h].tolist() == pos[:4] + pos[-8:]


def test_tova():
    view = random_view(b=1, h=3, t=30, seen=30, g=2)
    got = kept_positions(methods.tova(), view, 10)
    # reference: last query's softmax attention, averaged over all query heads of the layer
    probs = []
    for h in range(3):
        logits = ref_window_logits(view, 0, h, 1)[:, 0]  # [G, T]
        probs.append(torch.softmax(logits, -1))
    avg = torch.cat(probs).mean(0)
    expect = sorted(torch.topk(avg, 10).indices.tolist())
    for h in range(3):
        assert got[0, h].tolist() == view.positions[0, h, expect].tolist()


def test_snapkv():
    window, budget = 8, 16
    view = random_view(b=1, h=2, t=40, seen=40, w=window, g=2)
    got = kept_positions(methods.snapkv(window=window), view, budget)
    t = 40
    for h in range(2):
        logits = ref_window_logits(view, 0, h, window)  # [G, W, T]
        qpos = view.query_positions[-window:]
        causal = view.positions[0, h][None, :] <= qpos[:, None]
        logits = logits.masked_fill(~causal[None], -math.inf)
        s = torch.softmax(logits, -1).mean(0).mean(0)  # mean over group, then over queries
        pooled = [sum(s[j] for j in range(i - 2, i + 3) if 0 <= j < t) / 5 for i in range(t)]
        recent = list(range(t - window, t))
        expect = topk_sorted(torch.tensor(pooled), budget, recent)
        assert got[0, h].tolist() == view.positions[0, h, expect].tolist()


def test_h2o_accumulated_attention_matches_bruteforce():
    """H2O through a real cache: the accumulated score equals the brute-force sum of every query's softmax."""
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 128, (1, 20))
    cache = KVComposeCache(model, methods.h2o(recent=4), budget=64, interval=4)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        for i in range(6):
            model(input_ids=ids[:, i : i + 1], past_key_values=cache)
    layer = cache.layers[0]
    pipe = cache.pipeline
    leaf = pipe.leaves.index(pipe.scorer)
    acc = layer.segment.store.read_channels()[..., pipe._slices[leaf]][..., 0]  # [B, H, T]: its one channel
    assert acc.shape == (1, 2, layer.held)
    # brute force: replay all queries of the layer over the full sequence (no eviction happened: budget 64)
    assert layer.events == 0
    attn = model.model.layers[0].self_attn
    seq = torch.cat([ids, ids[:, :6]], dim=1)
    with torch.no_grad():
        h = model.model.embed_tokens(seq)
        x = model.model.layers[0].input_layernorm(h)
        cos, sin = model.model.rotary_emb(h, torch.arange(seq.shape[1])[None])
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        q = attn.q_proj(x).view(1, -1, 4, 16).transpose(1, 2)
        k = attn.k_proj(x).view(1, -1, 2, 16).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        t = seq.shape[1]
        logits = torch.einsum("bhqd,bhtd->bhqt", q, k.repeat_interleave(2, 1)) * attn.scaling
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        p = torch.softmax(logits.masked_fill(~causal, -math.inf), -1)  # [1, 4, T, T]
        ref = p.sum(2).reshape(1, 2, 2, t).sum(2)
    assert torch.allclose(acc, ref, atol=1e-4)


def test_rkv_against_reference_algorithm():
    window, budget, lam, thr = 8, 20, 0.1, 0.5
    view = random_view(b=1, h=2, t=48, seen=48, w=window, g=2)
    # make some keys near-duplicates so the redundancy term matters
    keys = view.keys.clone()
    keys[:, :, 10:20] = keys[:, :, 0:1] + 0.05 * keys[:, :, 10:20]
    from dataclasses import replace

    view = replace(view, keys=keys)
    got = kept_positions(methods.rkv(window=window, lam=lam, threshold=thr), view, budget)
    t = 48
    for h in range(2):
        logits = ref_window_logits(view, 0, h, window).amax(0)  # max over GQA group before softmax [W, T]
        att = torch.softmax(logits[:, : t - window], -1).mean(0)  # candidates only
        pooled = torch.nn.functional.max_pool1d(att[None, None], 7, 1, 3)[0, 0]
        kn = view.keys[0, h].double()
        kn = kn / kn.norm(dim=-1, keepdim=True)
        sim = kn @ kn.T
        sim.fill_diagonal_(0)
        for i in range(t):
            js = [j for j in range(t) if sim[i, j] > thr]
            if js:
                sim[i, max(js)] = 0
        red = torch.softmax(sim.mean(0), -1)[: t - window]
        score = lam * pooled - (1 - lam) * red
        top = torch.topk(score, budget - window).indices.tolist()
        expect = sorted(top + list(range(t - window, t)))
        assert got[0, h].tolist() == view.positions[0, h, expect].tolist()


def test_random_attention_rule():
    view = random_view(b=2, h=2, t=60, seen=80, w=8, prompt=10)
    pipe = methods.random_attention(recent=8)
    got = kept_positions(pipe, view, 24)
    for b in range(2):
        for h in range(2):
            kept = set(got[b, h].tolist())
            prompt = {p for p in view.positions[b, h].tolist() if p < 10}
            assert prompt <= kept  # the prompt fits inside the budget: all of it is kept
            assert set(range(72, 80)) <= kept  # newest 8
            assert len(kept) == 24
    # redrawn per layer/head/row: different heads keep different random middles
    assert got[0, 0].tolist() != got[0, 1].tolist()


def test_vase_rule():
    recent, budget = 8, 32
    view = random_view(b=1, h=2, t=60, seen=60, w=recent, g=2)
    pipe = methods.vase(recent=recent, window=recent)
    got = kept_positions(pipe, view, budget)
    k_large = budget // 4
    for h in range(2):
        kept = set(got[0, h].tolist())
        pos = view.positions[0, h]
        cand = [i for i in range(60) if pos[i] < 60 - recent]
        v = view.values[0, h].float()
        mag = (v.amax(-1) - v.amin(-1))
        mag[:4] = float("inf")
        large = torch.tensor(cand)[torch.topk(mag[cand], k_large).indices].tolist()
        assert {pos[i].item() for i in large} <= kept  # sinks + largest value ranges
        assert set(range(60 - recent, 60)) <= kept  # newest window
        assert len(kept) == budget


def test_vase_samples_in_proportion_to_attention():
    """Over many seeds, how often a candidate is drawn grows with its attention score."""
    view = random_view(b=1, h=1, t=40, seen=40, w=4, g=2)
    pipe = methods.vase(recent=4, window=4, protect=4)
    from dataclasses import replace

    counts = torch.zeros(40)
    for seed in range(200):
        v = replace(view, generator=torch.Generator().manual_seed(seed))
        counts[pipe.select(v, 16)[0].kept[0, 0]] += 1
    scores = pipe.scorer(view)[0, 0]
    protected = counts == 200
    free = (~protected) & (scores > 0)
    order = scores[free].argsort()
    low, high = counts[free][order[:5]].mean(), counts[free][order[-5:]].mean()
    assert high > low


@pytest.mark.parametrize("name", sorted(methods.PRESETS))
def test_every_preset_runs_in_generate(name):
    model = tiny_model("qwen3", layers=2)
    ids = torch.randint(3, 128, (1, 12))
    budget = {"vase": 100, "random_attention": 80, "snapkv": 40, "reason_alloc": 64, "growpage": 48}.get(name, 24)
    cache = KVComposeCache(model, methods.PRESETS[name](), budget=None if name == "full" else budget, interval=8)
    out = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=120, min_new_tokens=120,
                         do_sample=False)
    assert out.shape == (1, 132)
    if name == "full":
        assert cache.stats.compress_calls == 0 and min(cache.held_lengths()) == 131
    else:  # every preset really compresses at these budgets (131 tokens seen)
        assert cache.stats.compress_calls > 0
        assert max(cache.held_lengths()) < 131
    if name not in ("full", "growpage", "reason_alloc"):  # per-layer budgets (pyramid) bound each layer; head-wise
        # allocators (GrowPage, ReasonAlloc's HeadUtility) move budget between heads and are checked in test_allocators
        for i, held in enumerate(cache.held_lengths()):
            assert held < cache.layer_budget(i) + 8
    assert cache.get_seq_length() == 131


# ---- the one factory: methods.preset(name, budget=..., model=..., **args) ----

def _recent(pipe) -> int:
    from kvcompose.protectors import ProtectRecent

    return next(p.n for p in pipe.protectors if isinstance(p, ProtectRecent))


@pytest.mark.parametrize("name", ["random_attention", "vase"])
def test_preset_decides_its_budget_defaults(name):
    # below budget 256 the recent window is budget // 4 (capped at 64); at 256 and without a budget it is 64
    assert [methods.recent_window(b) for b in (None, 2, 64, 128, 255, 256, 4096)] == [64, 1, 16, 32, 63, 64, 64]
    assert _recent(methods.preset(name, budget=64)) == 16
    assert _recent(methods.preset(name, budget=128)) == 32
    assert _recent(methods.preset(name, budget=512)) == 64
    assert _recent(methods.preset(name)) == 64
    # the same pipeline as the function called with the window the budget asks for
    assert repr(methods.preset(name, budget=64)) == repr(methods.PRESETS[name](recent=16))
    # an explicit argument wins over the budget's default
    assert _recent(methods.preset(name, budget=64, recent=8)) == 8


def test_preset_without_budget_defaults_ignores_the_budget():
    assert repr(methods.preset("rkv", budget=64)) == repr(methods.rkv())
    assert repr(methods.preset("snapkv", budget=64, window=16)) == repr(methods.snapkv(window=16))


def test_preset_refuses_bad_input_by_name(unchecked):
    from kvcompose import KVComposeError

    with pytest.raises(KVComposeError, match="unknown preset 'nope'"):
        methods.preset("nope")
    with pytest.raises(KVComposeError, match=r"preset 'rkv' takes no argument 'bogus'.*window"):
        methods.preset("rkv", bogus=1)
    with pytest.raises(KVComposeError, match="preset 'keydiff' takes no argument 'bogus'"):
        methods.preset("keydiff", bogus=1)
    for bad in (0, -3, 1.5, "64", True):
        with pytest.raises(KVComposeError, match="budget must be a positive int"):
            methods.preset("h2o", budget=bad)


def test_every_entry_point_uses_the_one_factory():
    """The CLI, lm-eval and the benchmarks build a method through `methods.preset` (no second factory)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    files = [*root.joinpath("kvcompose").rglob("*.py"), *root.joinpath("benchmarks").glob("*.py")]
    offenders = []
    for f in files:
        if "vllm" in f.parts or f.name.startswith("vllm_"):
            continue  # the vLLM route moves with the serving issues
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name == "make_pipeline":
                offenders.append(f"{f.relative_to(root)}: def make_pipeline")
            if isinstance(node, ast.ImportFrom) and any(a.name == "make_pipeline" for a in node.names):
                offenders.append(f"{f.relative_to(root)}: imports make_pipeline")
    assert not offenders, offenders
