"""The rows of the issue-16 paper tables (`kvcompose.bench.faithful`) against loop-level ports of the reference
engines' eviction modes (SalesforceAIResearch/Random-Attention and terarachang/VaSE `cache_utils.py`:
`attn`, `attn_pp`, `attn_rkv`, `attn_rkv_pp`, `recency`, `recency_pp`, `range_attn`, `range_sample_attn`,
`evict_large_range`), plus the loop statistics of free generation and a tiny end-to-end run."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from kvcompose.bench import faithful
from kvcompose.bench.faithful import engine_recent, random_attention_rows, repetition_stats, vase_rows
from kvcompose.view import KVComposeError, LayerView

BUDGET = 32  # engine_recent(32) = 8 = the view's query window, so the reference's residual == query buffer
R = engine_recent(BUDGET)


def engine_view(prompt=12, t=80, seen=120, b=2, h=2, g=2, d=8, seed=0) -> LayerView:
    """Held tokens as the reference engine holds them: the prompt's first tokens in the first slots, a sorted
    random subset of the decoded ones, the newest R tokens; the last R post-RoPE queries."""
    gen = torch.Generator().manual_seed(seed)
    pos = []
    for _ in range(b * h):
        mid = torch.randperm(seen - R - prompt, generator=gen)[: t - R - prompt].sort().values + prompt
        pos.append(torch.cat([torch.arange(prompt), mid, torch.arange(seen - R, seen)]))
    return LayerView(
        layer_idx=0, num_layers=2, keys=torch.randn(b, h, t, d, generator=gen),
        values=torch.randn(b, h, t, d, generator=gen), positions=torch.stack(pos).reshape(b, h, t),
        valid=torch.ones(b, h, t, dtype=torch.bool), prompt_length=prompt,
        queries=torch.randn(b, h * g, R, d, generator=gen), query_positions=torch.arange(seen - R, seen),
        query_valid=torch.ones(b, R, dtype=torch.bool), seen=seen, scale=d**-0.5,
        generator=torch.Generator().manual_seed(seed + 1),
    )


# ---------------------------------------------------------------- loop-level ports of the reference engine
def ref_attention(q, k):
    """`compute_attention_scores` with `--smooth` for one row: q [Hq, Q, D], candidate keys k [H, n, D]."""
    hq, nq, d = q.shape
    h, n, _ = k.shape
    g = hq // h
    w = torch.softmax(q.reshape(h, g, nq, d) @ k[:, None].transpose(-1, -2) / math.sqrt(d), dim=-1)
    s = w.mean(-2)  # [H, g, n]: mean over the queries
    s = F.avg_pool1d(s.reshape(1, hq, n), kernel_size=5, padding=2, stride=1).reshape(h, g, n)
    return s.mean(1)  # mean over the GQA group


def ref_redundancy(k):
    """`cal_redundancy` (the VaSE port of R-KV): cosine similarity, diagonal zeroed, column mean, softmax."""
    kn = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    cs = kn @ kn.transpose(-1, -2)
    cs = cs.masked_fill(torch.eye(k.shape[1], dtype=torch.bool), 0.0)
    return cs.mean(dim=-2).softmax(dim=-1)


def ref_kept(view: LayerView, mode: str, budget: int = BUDGET, n_large: int | None = None) -> list[list[set]]:
    """Kept positions per (row, KV head) after one `_run_eviction` of `mode`."""
    k_total = budget - R
    out = []
    for b in range(view.shape[0]):
        n = view.shape[2] - R  # candidates: every slot but the newest R (the residual)
        keys, values = view.keys[b, :, :n], view.values[b, :, :n]
        pl = min(view.prompt_length, k_total - 1)
        attn = ref_attention(view.queries[b], keys)
        vmag = values.amax(-1) - values.amin(-1)
        rows = []
        for h in range(view.shape[1]):
            if mode in ("attn", "attn_pp", "attn_rkv", "attn_rkv_pp"):
                s = attn[h].clone()
                if "rkv" in mode:
                    s = 0.5 * s - 0.5 * ref_redundancy(keys)[h]
                if mode.endswith("_pp"):
                    s[:pl] = math.inf
                ids = s.topk(k_total).indices.tolist()
            elif mode in ("recency", "recency_pp"):
                s = torch.arange(n, dtype=torch.float)
                if mode == "recency_pp":
                    s[:pl] = math.inf
                ids = s.topk(k_total).indices.tolist()
            elif mode == "range_attn":
                large = vmag[h].topk(n_large).indices
                s = attn[h].clone()
                s[large] = -math.inf
                ids = large.tolist() + s.topk(k_total - n_large).indices.tolist()
            elif mode == "evict_large_range":
                ids = vmag[h].topk(k_total, largest=False).indices.tolist()
            else:  # pragma: no cover
                raise ValueError(mode)
            pos = view.positions[b, h]
            rows.append({int(pos[i]) for i in ids} | set(range(view.seen - R, view.seen)))
        out.append(rows)
    return out


def kept(pipe, view, budget=BUDGET) -> list[list[set]]:
    sel, _ = pipe.select(view, budget)
    got = view.positions.gather(-1, sel.kept.clamp(min=0))
    return [[set(got[b, h].tolist()) for h in range(view.shape[1])] for b in range(view.shape[0])]


def row(table, key):
    return next(v for v in table() if v.key == key)


@pytest.mark.parametrize("key,mode", [("snapkv", "attn"), ("snapkv_pp", "attn_pp"), ("rkv", "attn_rkv"),
                                      ("rkv_pp", "attn_rkv_pp"), ("recency", "recency"), ("recency_pp", "recency_pp")])
@pytest.mark.parametrize("prompt", [6, 40])  # shorter than K - 1 (kept whole), longer (its first K - 1 kept)
def test_random_attention_table_rows_match_the_reference(key, mode, prompt):
    v = row(random_attention_rows, key)
    assert v.mode == mode
    for seed in range(3):
        view = engine_view(prompt=prompt, seed=seed)
        got, want = kept(v.build(BUDGET), view), ref_kept(view, mode)
        assert got == want
        if mode.endswith("_pp"):  # and protection changed something: the unprotected row keeps less prompt
            bare = kept(row(random_attention_rows, key.removesuffix("_pp")).build(BUDGET), view)
            n_prompt = lambda ks: sum(len({p for p in s if p < prompt}) for r in ks for s in r)  # noqa: E731
            assert n_prompt(got) > n_prompt(bare)
            assert n_prompt(got) >= 2 * 2 * min(prompt, BUDGET - R - 1)  # the free slot may take one more


@pytest.mark.parametrize("key,mode", [("attn", "attn"), ("range_attn", "range_attn"),
                                      ("evict_large_range", "evict_large_range")])
def test_vase_ablation_rows_match_the_reference(key, mode):
    v = row(vase_rows, key)
    assert v.mode == mode
    for seed in range(3):
        view = engine_view(seed=seed)
        assert kept(v.build(BUDGET), view) == ref_kept(view, mode, n_large=BUDGET // 4)


def test_vase_ablation_sampling_rows():
    """`range_sample_attn`: the budget/4 largest value ranges always kept (no sinks), the rest drawn in
    proportion to attention; VaSE adds the sinks to the value-protected set."""
    view = engine_view(prompt=12, seed=3)
    n = view.shape[2] - R
    vmag = view.values[:, :, :n].amax(-1) - view.values[:, :, :n].amin(-1)
    attn = torch.stack([ref_attention(view.queries[b], view.keys[b, :, :n]) for b in range(2)])
    sample = row(vase_rows, "range_sample_attn").build(BUDGET)
    counts = torch.zeros(2, 2, n)
    draws = 120
    for s in range(draws):
        v = LayerView(**{**view.__dict__, "generator": torch.Generator().manual_seed(s)})
        sel, _ = sample.select(v, BUDGET)
        assert (sel.kept >= 0).all() and sel.kept.shape[-1] == BUDGET
        hit = torch.zeros(2, 2, view.shape[2]).scatter_(-1, sel.kept, 1.0)
        counts += hit[..., :n]
    for b in range(2):
        for h in range(2):
            large = vmag[b, h].topk(BUDGET // 4).indices
            assert (counts[b, h, large] == draws).all()  # value-protected: kept at every draw
            rest = torch.ones(n, dtype=torch.bool)
            rest[large] = False
            freq, a = counts[b, h, rest] / draws, attn[b, h, rest]
            assert 0 < freq.min() < 1 or freq.max() < 1  # a real draw, not a fixed set
            # higher attention -> kept more often (rank correlation of frequency and attention)
            rf, ra = freq.argsort().argsort().float(), a.argsort().argsort().float()
            assert torch.corrcoef(torch.stack([rf, ra]))[0, 1] > 0.5
    # VaSE's sinks: the first 4 tokens are always kept, whatever their value range
    vase = row(vase_rows, "vase").build(BUDGET)
    low = LayerView(**{**view.__dict__, "values": view.values.clone()})
    low.values[..., :4, :] = 0.0  # zero value range: the sink-free row has no reason to keep them
    for s in range(20):
        v = LayerView(**{**low.__dict__, "generator": torch.Generator().manual_seed(s)})
        assert {0, 1, 2, 3} <= set().union(*kept(vase, v)[0])
        assert all({0, 1, 2, 3} <= s_ for r in kept(vase, v) for s_ in r)


def test_every_row_fits_its_budget_and_shares_the_engine_protocol():
    for table in (random_attention_rows, vase_rows):
        for v in table():
            for b in (64, 128, 256, 512):
                pipe = v.build(b)
                if pipe is None:  # a row that only runs at some budgets (the uncapped window at 128)
                    assert v.key == "random_pp_r64" and b != 128
                    continue
                pipe.validate(b)
                assert pipe.interval == 64
    assert [engine_recent(b) for b in (8, 64, 128, 256, 512, 4096)] == [2, 16, 32, 64, 64, 64]
    with pytest.raises(KVComposeError):
        engine_recent(1)


def test_repetition_stats_detects_loops():
    loop = list(range(20)) + [7, 8, 9] * 40
    s = repetition_stats(loop)
    assert s["loop"] == 1.0 and s["distinct"] < 0.3
    fresh = list(range(200))
    s = repetition_stats(fresh)
    assert s["loop"] == 0.0 and s["distinct"] == 1.0
    # a long period (> 32 tokens) is not counted as a loop, a short text is checked on what it has
    assert repetition_stats(list(range(40)) * 4)["loop"] == 0.0
    assert repetition_stats([5] * 12)["loop"] == 1.0
    assert math.isnan(repetition_stats([1, 2, 3])["distinct"])


def test_run_table_tiny(tmp_path):
    """End to end on a tiny chat model: every row compresses (events at 64 and 128 decoded tokens), the JSON
    and Markdown are written, free generation reports loop statistics."""
    torch.set_num_threads(1)
    from kvcompose.testing import save_tiny_chat_model

    model_dir = save_tiny_chat_model(tmp_path / "model")
    q = tmp_path / "q.jsonl"
    q.write_text("\n".join(json.dumps({"question": f"Sam has {i} apples and buys {i + 2} more. How many?",
                                       "answer": f"#### {2 * i + 2}"}) for i in range(4)))
    data = faithful.main(["--table", "vase", "--rows", "attn", "vase", "evict_large_range", "--model", str(model_dir),
                          "--data", str(q), "--n-prompts", "1", "--min-prompt-tokens", "0", "--new-tokens", "160",
                          "--kinds", "worked", "--budgets", "16", "--short-budgets", "16", "--short-tokens", "0",
                          "--seeds", "0", "1", "--free-gen-prompts", "2", "--free-gen-tokens", "80",
                          "--free-gen-budgets", "16", "--out", str(tmp_path / "out")])
    rows = {(r["method"], r["budget"]): r for r in data["rows"]}
    assert set(rows) == {("attn", 16), ("vase", 16), ("evict_large_range", 16)}
    assert rows[("vase", 16)]["n_traces"] == 2 and rows[("attn", 16)]["n_traces"] == 1  # seeds only where random
    for r in rows.values():
        # at most prompt + 64 before the first event, never the full prompt + 160 tokens
        assert r["interval"] == 64 and r["max_held_tokens"] <= max(data["prompt_lengths"]) + 64
        assert r["n_tokens"] == 160 * r["n_traces"]
        assert 0.0 <= r["top1"] <= 1.0 and r["kl_mean"] > 0  # compressed: not the full cache
    fg = {(r["method"], r["budget"]): r for r in data["free_generation"]}
    assert set(fg) == {("full", None), ("attn", 16), ("vase", 16), ("evict_large_range", 16)}
    assert all(0.0 <= r["loop_share"] <= 1.0 for r in fg.values())
    md = (tmp_path / "out" / "vase.md").read_text()
    assert "| evict_large_range | `evict_large_range` |" in md and "distinct-4" in md
    with pytest.raises(KVComposeError):
        faithful.main(["--table", "vase", "--rows", "no_such_row", "--data", str(q), "--out", str(tmp_path / "x")])
