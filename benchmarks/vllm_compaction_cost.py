"""Per-step cost of the vLLM prototype's worker-side work: `compact_block_table` on a `[requests, blocks]`
table, without freed blocks (a step with nothing to do) and with half of each row freed.

    python benchmarks/vllm_compaction_cost.py

No vLLM needed. One thread; the median of `--repeats` timings of `--calls` calls each.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1x64", "8x64", "64x256"], help="REQUESTSxBLOCKS")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    from kvcompose.integrations.vllm import compact_block_table

    torch.set_num_threads(1)
    rows = []
    for shape in args.shapes:
        R, M = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        table = torch.randint(1, 1_000_000, (R, M), dtype=torch.int32, generator=g)
        lens = torch.full((R,), M * args.block_size - 5, dtype=torch.int32)
        holes = table.clone()
        holes[:, 1: M // 2] = 0
        for name, t in (("no freed blocks", table), ("half the blocks freed", holes)):
            for _ in range(10):
                compact_block_table(t, lens, args.block_size)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    compact_block_table(t, lens, args.block_size)
                times.append((time.perf_counter() - t0) / args.calls)
            us = 1e6 * statistics.median(times)
            rows.append({"requests": R, "blocks": M, "case": name, "us_per_call": us})
            print(f"{R:4d} requests x {M:4d} blocks, {name:22s}: {us:7.1f} us")
    return rows


if __name__ == "__main__":
    main()
