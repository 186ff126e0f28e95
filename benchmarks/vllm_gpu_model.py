"""A MODEL, not a run: what the concurrency kvcompose wins in a fixed KV pool would be worth on a GPU, where a
decode step's cost hardly grows with the batch.

    python benchmarks/vllm_gpu_model.py                 # the tables of docs/serving.md
    python benchmarks/vllm_gpu_model.py --json out.json

On a CPU (benchmarks/vllm_pressure.py) a decode step costs roughly in proportion to the requests in it, so
running 3x the requests buys far less than 3x the tokens/s. On a GPU, decoding a 7B model is bound by memory
bandwidth: every step reads all the weights once whatever the batch, plus each running request's KV cache. The
model (stated, with its parameters in `Params`):

    step time = max(bytes read / (HBM bandwidth x bw_eff), FLOPs / (peak bf16 FLOP/s x flops_eff)) + overhead
    bytes read = weight bytes + sum over running requests of (tokens held x KV bytes per token)
    FLOPs      = 2 x parameters x running requests   (+ attention, 4 x layers x q heads x head dim x tokens)
    tokens/s   = running requests / step time  (one token each per step)

Concurrency is limited by the pool as in the benchmark's "ceiling" column: a plain request needs its full
length (prompt + new tokens) in the pool; a compressed one at most budget + interval + one block. A plain
request reads on average prompt + new / 2 tokens per step over its life; a compressed one budget + interval / 2
(after its first event; before it, it reads as plain). kvcompose's events and bookkeeping are charged as a
fixed share of the compressed engine's step time (`event_share`, 5% by default: the issue's target; 17.9% is
what R-KV measured on the CPU before it). Not modelled: prefill (a GSM8K prompt is ~100 tokens), preemption
and re-prefill (they cost plain more), the scheduler's own CPU time beyond `overhead_ms`, quality. A batch of
`requests` finishes in ceil(requests / running) waves of `new` steps each.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_gb: float  # memory, GB (1e9 bytes)
    bw_tbs: float  # HBM bandwidth, TB/s
    bf16_tflops: float  # dense bf16 peak, TFLOP/s


@dataclass(frozen=True)
class Model:
    name: str
    params: float  # parameters
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16 weights and KV cache

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """Keys and values of one token, every layer and KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


GPUS = {"H100": Gpu("H100 SXM 80GB", 80.0, 3.35, 989.0), "H200": Gpu("H200 141GB", 141.0, 4.8, 989.0)}
MODELS = {"qwen2.5-7b": Model("Qwen2.5-7B", 7.62e9, 28, 4, 28, 128),
          "qwen2.5-32b": Model("Qwen2.5-32B", 32.8e9, 64, 8, 40, 128)}


@dataclass(frozen=True)
class Params:
    bw_eff: float = 0.75  # fraction of peak HBM bandwidth a decode step reaches
    flops_eff: float = 0.6  # fraction of peak bf16 FLOP/s the GEMMs reach at large batch
    overhead_ms: float = 2.0  # per step, independent of the batch (launches, scheduler, sampling)
    event_share: float = 0.05  # kvcompose's events + bookkeeping, a share of the compressed step time
    prompt: int = 100  # tokens per prompt (GSM8K questions with a chat template: 56-200, mean ~100)
    interval: int = 64  # decoded tokens between events
    block: int = 16  # vLLM's GPU block size
    max_num_seqs: int = 1024  # vLLM's cap on running requests


def step_ms(model: Model, gpu: Gpu, running: int, tokens_read: float, p: Params) -> float:
    """One decode step of `running` requests that read `tokens_read` KV tokens each (in total
    running x tokens_read), in milliseconds."""
    read = model.weight_bytes + running * tokens_read * model.kv_bytes_per_token
    flops = running * (2 * model.params + 4 * model.layers * model.q_heads * model.head_dim * tokens_read)
    t_mem = read / (gpu.bw_tbs * 1e12 * p.bw_eff)
    t_cmp = flops / (gpu.bf16_tflops * 1e12 * p.flops_eff)
    return 1000 * max(t_mem, t_cmp) + p.overhead_ms


def pool_tokens(model: Model, gpu: Gpu, mem_util: float = 0.9, activations_gb: float = 4.0) -> int:
    """Tokens of a KV pool that takes the GPU's memory left after the weights (vLLM's gpu_memory_utilization
    of HBM, less the weights and an activation reserve)."""
    free = gpu.hbm_gb * 1e9 * mem_util - model.weight_bytes - activations_gb * 1e9
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on {gpu.name} with {mem_util:.0%} of its memory")
    return int(free // model.kv_bytes_per_token)


def engine(model: Model, gpu: Gpu, requests: int, new: int, pool: int, budget: int | None, p: Params) -> dict:
    """Plain (`budget` None) or compressed, for `requests` of `new` tokens in a pool of `pool` tokens."""
    if budget is None:
        held, read, share = p.prompt + new, p.prompt + new / 2, 0.0
    else:
        held = budget + p.interval + p.block
        first = max(budget - p.prompt, 0)  # decoded tokens before the first event: read as plain
        later = max(new - first, 0)
        read = ((p.prompt + first / 2) * min(first, new) + (budget + p.interval / 2) * later) / new
        share = p.event_share
    held = math.ceil(held / p.block) * p.block
    running = min(requests, p.max_num_seqs, pool // held)
    if running < 1:
        raise ValueError(f"a pool of {pool} tokens holds no request of {held} tokens")
    ms = step_ms(model, gpu, running, read, p) / (1 - share)
    waves = math.ceil(requests / running)
    return {"running": running, "ceiling": pool / held, "kv_read_per_request": read, "step_ms": ms,
            "tokens_per_s": 1000 * running / ms, "steps": waves * new, "seconds": waves * new * ms / 1000}


def scenario(model: str, gpu: str, requests: int, new: int, pool: int | str, budget: int,
             p: Params = Params()) -> dict:
    """Plain against budget `budget` at one setting. `pool`: tokens, "full" (the GPU's memory after the
    weights) or "8 plain" (8 plain requests at full length, as the CPU benchmark's pressure pool)."""
    m, g = MODELS[model], GPUS[gpu]
    if pool == "full":
        toks = pool_tokens(m, g)
    elif isinstance(pool, str):
        k = int(pool.split()[0])
        toks = k * math.ceil((p.prompt + new) / p.block) * p.block
    else:
        toks = int(pool)
    plain = engine(m, g, requests, new, toks, None, p)
    comp = engine(m, g, requests, new, toks, budget, p)
    return {"model": m.name, "gpu": g.name, "requests": requests, "new_tokens": new, "pool": str(pool),
            "pool_tokens": toks, "budget": budget, "plain": plain, "kvcompose": comp,
            "x running": comp["running"] / plain["running"], "x step time": comp["step_ms"] / plain["step_ms"],
            "x tokens/s": comp["tokens_per_s"] / plain["tokens_per_s"], "x seconds": comp["seconds"] / plain["seconds"]}


SCENARIOS = [  # (model, gpu, requests, new tokens, pool, budget)
    ("qwen2.5-7b", "H200", 64, 1024, "8 plain", 256),
    ("qwen2.5-7b", "H200", 64, 2048, "8 plain", 256),
    ("qwen2.5-7b", "H100", 256, 1024, "8 plain", 256),
    ("qwen2.5-7b", "H100", 256, 1024, "full", 256),
    ("qwen2.5-7b", "H200", 256, 1024, "full", 256),
    ("qwen2.5-7b", "H200", 1024, 2048, "full", 256),
    ("qwen2.5-7b", "H200", 1024, 32768, "full", 256),
    ("qwen2.5-32b", "H200", 1024, 32768, "full", 256),
]


def table(results: list[dict]) -> str:
    head = ("| model, GPU | requests x new tokens | pool (tokens) | running: plain / budget 256 (ceiling) "
            "| step ms: plain / kvcompose | tokens/s: plain / kvcompose | x running | x tokens/s | x time to finish |")
    lines = [head, "|" + "---|" * 9]
    for r in results:
        pl, kv = r["plain"], r["kvcompose"]
        lines.append(f"| {r['model']}, {r['gpu'].split()[0]} | {r['requests']} x {r['new_tokens']} | "
                     f"{r['pool']} ({r['pool_tokens']:,}) | {pl['running']} / {kv['running']} ({kv['ceiling']:.0f}) | "
                     f"{pl['step_ms']:.1f} / {kv['step_ms']:.1f} | {pl['tokens_per_s']:,.0f} / "
                     f"{kv['tokens_per_s']:,.0f} | {r['x running']:.2f} | {r['x tokens/s']:.2f} | "
                     f"{r['x seconds']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in Params.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    p = Params(**{k: getattr(args, k) for k in Params.__dataclass_fields__})
    res = [scenario(*s, p=p) for s in SCENARIOS]
    print(f"A model, not a run. Parameters: {asdict(p)}")
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": asdict(p), "gpus": {k: asdict(v) for k, v in GPUS.items()},
                       "models": {k: asdict(v) for k, v in MODELS.items()}, "results": res}, f, indent=1)
    return res


if __name__ == "__main__":
    main()
