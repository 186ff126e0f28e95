"""Shared test helpers: random layer views, a naive per-head reference attention, and the tiny model, token
ids and full-cache references of the tree-cache tests."""

from __future__ import annotations

import os

import torch

from transformers import DynamicCache

from kvcompose.testing import tiny_model
from kvcompose.view import LayerView

_TREE_MODELS: dict = {}


def examples(n: int) -> int:
    """A property's example count: `n` in the deterministic default profile, `n` times
    `KVCOMPOSE_EXPLORE_FACTOR` (10) with `HYPOTHESIS_PROFILE=explore` (tests/conftest.py)."""
    if os.environ.get("HYPOTHESIS_PROFILE") == "explore":
        return n * int(os.environ.get("KVCOMPOSE_EXPLORE_FACTOR", "10"))
    return n


def ratio_curves(layers: int = 2, heads: int = 2, seed: int = 0) -> list:
    """Random LU-KV budget curves `[99][layers][heads]` that follow their ratios (what `HeadCurves` accepts): row i
    prunes `r = (i + 1) / 100` of the tokens on average, each (layer, head) within `min(r, 1 - r)` of it."""
    u = torch.rand(99, layers, heads, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    u = u - u.mean((1, 2), keepdim=True)
    u = u / u.abs().amax((1, 2), keepdim=True).clamp(min=1e-6)
    r = torch.arange(1, 100, dtype=torch.float32)[:, None, None] / 100
    return (r + torch.minimum(r, 1 - r) * u).clamp(0, 1).tolist()


def tree_model(arch: str = "llama"):
    """A tiny random model (2 layers, 4 heads, 2 KV heads, head dim 16), built once per architecture."""
    if arch not in _TREE_MODELS:
        _TREE_MODELS[arch] = tiny_model(arch, layers=2, heads=4, kv_heads=2, head_dim=16)
    return _TREE_MODELS[arch]


def rand_ids(n: int, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    """`[1, n]` random token ids (no special tokens)."""
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def feed(model, cache, ids):
    """Feed tokens through `cache`; the logits of the last one `[vocab]`."""
    return model(input_ids=ids, past_key_values=cache).logits[0, -1]


@torch.no_grad()
def full_reference(model, path_ids):
    """A fresh full cache over the whole path: (logits of the last token `[vocab]`, the DynamicCache)."""
    cache = DynamicCache(config=model.config)
    return model(input_ids=path_ids, past_key_values=cache).logits[0, -1], cache


def random_view(b=2, h=2, t=40, d=8, g=2, w=8, prompt=10, seen=None, pad=None, seed=0, layer_idx=0,
                dtype=torch.float32, rows=None, cache_budget=None) -> LayerView:
    gen = torch.Generator().manual_seed(seed)
    seen = t if seen is None else seen
    keys = torch.randn(b, h, t, d, generator=gen).to(dtype)
    values = torch.randn(b, h, t, d, generator=gen).to(dtype)
    # held positions: sorted random subset of range(seen) that always includes the newest w tokens
    pos = []
    for _ in range(b * h):
        older = torch.randperm(seen - w, generator=gen)[: t - w].sort().values
        pos.append(torch.cat([older, torch.arange(seen - w, seen)]))
    positions = torch.stack(pos).reshape(b, h, t)
    valid = torch.ones(b, h, t, dtype=torch.bool)
    if pad:
        for row, n in enumerate(pad):
            valid[row] &= positions[row] >= n
    queries = torch.randn(b, h * g, w, d, generator=gen).to(dtype)
    qpos = torch.arange(seen - w, seen)
    qvalid = torch.ones(b, w, dtype=torch.bool)
    return LayerView(
        layer_idx=layer_idx, num_layers=4, keys=keys, values=values, positions=positions, valid=valid,
        prompt_length=prompt, queries=queries, query_positions=qpos, query_valid=qvalid, seen=seen,
        scale=d**-0.5, generator=torch.Generator().manual_seed(seed + 1), event=0, rows=rows,
        cache_budget=cache_budget,
    )


def padded_inputs(b=2, t=12, vocab=128, pad=(3, 0), seed=0):
    """(ids, attention mask) `[b, t]`: random tokens, row r left-padded by `pad[r]` tokens (id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    for row, n in enumerate(pad[:b]):
        ids[row, :n] = 0
        mask[row, :n] = 0
    return ids, mask


def greedy_n(model, ids, mask, cache, n=24):
    """Exactly `n` greedy tokens through `cache`."""
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n,
                          do_sample=False, min_new_tokens=n)
