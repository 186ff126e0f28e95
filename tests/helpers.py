"""Shared test helpers: random layer views and a naive per-head reference attention."""

from __future__ import annotations

import torch

from kvcompose.view import LayerView


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
