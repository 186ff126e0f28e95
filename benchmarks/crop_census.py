"""How often a crop is exact, how often it is refused and why, per preset; and whether every copy decodes like its
original (docs/exactness.md).

For every preset (scaled down so that a tiny random model compresses within a few dozen tokens), a cache decodes
one token at a time; at several points it is copied (`copy.deepcopy`) and each copy is cropped by 1 to 12 tokens.
A crop that is accepted is checked against a fresh cache fed only the tokens before the crop point (the same
greedy continuation, logits within float rounding, the same kept positions); a refused one is counted by its
reason. Then each preset's cache is copied with `copy.deepcopy`, `pickle` and `torch.save` and both continue.

    python benchmarks/crop_census.py            # about 2 minutes on an idle 2-core CPU
"""

from __future__ import annotations

import argparse
import copy
import io
import pickle
import time
from collections import Counter

import torch

from kvcompose import KVComposeCache, KVComposeError
from kvcompose.block import EventTrigger
from kvcompose.testing import TINY_PRESETS, greedy_steps as greedy, tiny_model

PRESETS = {name: TINY_PRESETS[name] for name in TINY_PRESETS if name != "vase_query_free"}  # the census's 13
REASONS = {"compression event": "event since", "keeps state": "observer state", "queries": "query window"}


@torch.no_grad()
def feed(model, cache, ids, start, prompt=None):
    t = start
    if prompt:
        model(input_ids=ids[:, t : t + prompt], past_key_values=cache)
        t += prompt
    for j in range(t, ids.shape[1]):
        model(input_ids=ids[:, j : j + 1], past_key_values=cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=10)
    ap.add_argument("--points", type=int, nargs="+", default=[27, 34, 41], help="tokens seen when a copy is cropped")
    ap.add_argument("--max-crop", type=int, default=12)
    ap.add_argument("--steps", type=int, default=8, help="greedy steps compared after a crop or a copy")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    ids = torch.randint(3, 128, (1, max(args.points) + 1), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    print(f"budget {args.budget}, interval {args.interval}, prompt {args.prompt}, crops of 1-{args.max_crop} tokens "
          f"at {args.points} tokens seen; {args.steps} greedy steps compared\n")
    print("| preset | crops | exact | refused: event since | observer state | query window | wrong |"
          " copies equal (deepcopy, pickle, torch.save) |")
    print("|---|---|---|---|---|---|---|---|")
    totals = Counter()
    for name, make in PRESETS.items():
        pipe = make()
        budget = args.budget if pipe.compresses else None
        # the interval only for a pipeline that follows the schedule (the full cache never compresses; GrowPage
        # compresses when a row's pages are full)
        interval = args.interval if pipe.compresses and not isinstance(pipe.allocator, EventTrigger) else None

        def new():
            return KVComposeCache(model, pipe, budget=budget, interval=interval)

        c = Counter()
        base = new()
        fed = 0
        for point in args.points:
            feed(model, base, ids[:, :point], fed, args.prompt if fed == 0 else None)
            fed = point
            for n in range(1, args.max_crop + 1):
                trial = copy.deepcopy(base)
                c["crops"] += 1
                try:
                    trial.crop(-n)
                except KVComposeError as e:
                    c[next((v for k, v in REASONS.items() if k in str(e)), "other")] += 1
                    continue
                end = point - n
                fresh = new()
                feed(model, fresh, ids[:, :end], 0, min(args.prompt, end))
                a, la = greedy(model, trial, ids[:, end : end + 1], args.steps)
                b, lb = greedy(model, fresh, ids[:, end : end + 1], args.steps)
                same = torch.equal(a, b) and torch.allclose(la, lb, rtol=1e-4, atol=1e-4) and all(
                    torch.equal(trial.kept_positions(i), fresh.kept_positions(i)) for i in range(len(trial.layers)))
                c["exact" if same else "wrong"] += 1
        copies = []
        for how in ("deepcopy", "pickle", "torch.save"):
            if how == "deepcopy":
                twin = copy.deepcopy(base)
            elif how == "pickle":
                twin = pickle.loads(pickle.dumps(base)).bind(model)
            else:
                buf = io.BytesIO()
                torch.save(base, buf)
                buf.seek(0)
                twin = torch.load(buf, weights_only=False).bind(model)
            ref = copy.deepcopy(base)
            a = greedy(model, twin, ids[:, -1:], args.steps)
            b = greedy(model, ref, ids[:, -1:], args.steps)
            copies.append("yes" if torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) else "NO")
        totals.update(c)
        print(f"| {name} | {c['crops']} | {c['exact']} | {c['event since']} | {c['observer state']} | "
              f"{c['query window']} | {c['wrong']} | {', '.join(copies)} |")
    print(f"\n{totals['crops']} crops: {totals['exact']} exact, {totals['crops'] - totals['exact'] - totals['wrong']} "
          f"refused, {totals['wrong']} wrong; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
