"""What per-layer and per-head budgets save in vLLM's paged pool, against a uniform budget (docs/serving.md,
"Per-layer and per-head budgets").

vLLM gives every layer and KV head of a request the same block table (one KV-cache group), so a request holds,
in every layer and head, the blocks of the largest budget any (layer, head) may keep: the scheduler frees by
that count. Per-head budgets (`HeadUtility`: a floor per head, the rest of the layer's `H * b_l` moved to heads
of high utility, decided from the data at each event) can reach `H * b_l - (H - 1) * floor_l` in one head (a
ragged selector, AdaKV's: the layer's total `H * b_l` less the other heads' floors), and the scheduler, which never sees the data, must
reserve that bound (`rules.Settings.held_bound`). If vLLM gave each budget class its own
blocks (a KV-cache group per layer, per-head block tables), a request would hold the sum of its classes'
budgets, each rounded up to whole blocks. This prints, per method and mean budget, the tokens per KV head a
request holds (summed over layers) in both cases, as ratios to the uniform budget `L * B` (block aligned). No
model is loaded: the schedules are the allocators' own (`Pyramid.layer_budgets`, `ReasoningWave` with the
profile kvcompose ships for SmolLM2-135M-Instruct, its static budgets: the long-run case, after the tokens seen
exceed every layer's budget).

    python benchmarks/vllm_budget_classes.py [--layers 30] [--heads 3] [--block 32] [--budgets 256 512]
"""

from __future__ import annotations

import argparse
import json


def _up(n: int, bs: int) -> int:
    return -(-n // bs) * bs


def classes(method: str, layers: int, heads: int, budget: int, block: int) -> dict:
    """The layer budgets and per-(layer, head) bounds of `method` at mean `budget`, and the tokens per KV head
    a request holds with one KV-cache group and with one group per budget class."""
    from kvcompose import methods
    from kvcompose.integrations.vllm.rules import head_bounds

    pipe = methods.preset(method)
    per_layer = [int(b) for b in pipe.allocator.layer_budgets(layers, budget)]  # the static schedule vLLM runs
    head_max = head_bounds(pipe, layers, budget, heads)  # what the vLLM scheduler reserves for, per layer
    uniform = layers * _up(budget, block)
    one_group = layers * _up(max(head_max), block)  # every layer and head holds the largest bound's blocks
    layers_only = layers * _up(max(per_layer), block)  # the same if heads kept their layer's budget
    # own blocks per class: each (layer, head) its own budget, rounded up to blocks (head budgets average b_l)
    own = sum(_up(b, block) for b in per_layer)
    return {"method": method, "budget": budget, "layer_min": min(per_layer), "layer_max": max(per_layer),
            "head_bound_max": max(head_max), "uniform_tokens": uniform, "one_group_tokens": one_group,
            "own_blocks_tokens": own, "layers_only_x": round(layers_only / uniform, 2), "one_group_x": round(one_group / uniform, 2), "own_blocks_x": round(own / uniform, 2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    ap.add_argument("--heads", type=int, default=3, help="KV heads (SmolLM2-135M: 3)")
    ap.add_argument("--block", type=int, default=32, help="vLLM block size")
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--methods", nargs="+", default=["pyramid_rkv", "reason_alloc", "adakv"])
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    a = ap.parse_args(argv)
    rows = [classes(m, a.layers, a.heads, b, a.block) for m in a.methods for b in a.budgets]
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return
    print("| method | mean budget | layer budgets | largest (layer, head) bound | one KV group, largest layer "
          "(x uniform) | one KV group, largest head bound (x uniform) | own blocks per class (x uniform) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['budget']} | {r['layer_min']}-{r['layer_max']} | {r['head_bound_max']} | "
              f"{r['layers_only_x']:.2f}x | {r['one_group_x']:.2f}x | {r['own_blocks_x']:.2f}x |")


if __name__ == "__main__":
    main()
