"""Run a kvcompose block policy inside vLLM (prototype, CPU only): `pip install kvcompose[vllm]`.

    from vllm import LLM
    from kvcompose.integrations.vllm import engine_kwargs

    llm = LLM(model=MODEL_DIR, **engine_kwargs(policy="streaming", budget=256, block_size=32))

Two public vLLM extension points carry it, no fork: `scheduler_cls` (the compression event runs in
`KVComposeScheduler.schedule`, EngineCore process) and `worker_extension_cls` (whose import overrides the
`CPU_ATTN` backend with one whose metadata builder compacts block tables). Policies: `streaming`
(StreamingLLM by blocks) and `random` (Random Attention by blocks); see `policy.BlockPolicy` and
docs/serving.md for what else would need a change in vLLM. vLLM is imported only by the `scheduler`,
`attention` and `worker` modules, never by this one.
"""

from __future__ import annotations

from typing import Any

from .policy import POLICIES, BlockPolicy, compact_block_table, request_rng

__all__ = ["engine_kwargs", "BlockPolicy", "POLICIES", "compact_block_table", "request_rng"]


def engine_kwargs(policy: str = "streaming", budget: int = 256, block_size: int = 32, interval: int | None = None,
                  sink_blocks: int = 1, recent: int = 64, protect_prompt: bool = True, seed: int = 0,
                  log_file: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` (or `EngineArgs`) that run a `BlockPolicy` inside vLLM.

    Validates the policy here (a `KVComposeError` for a bad budget, interval or name) and returns
    `scheduler_cls`, `worker_extension_cls`, `additional_config`, `block_size`, `enable_prefix_caching=False`
    and `async_scheduling=False`. Does not import vLLM.

    Args:
        policy, budget, block_size, interval, sink_blocks, recent, protect_prompt, seed: see `BlockPolicy`.
        log_file: optional JSONL written by the scheduler, one line per compression event.
    """
    p = BlockPolicy(policy=policy, budget=budget, block_size=block_size, interval=interval,
                    sink_blocks=sink_blocks, recent=recent, protect_prompt=protect_prompt, seed=seed)
    cfg: dict[str, Any] = {
        "policy": p.policy, "budget": p.budget, "block_size": p.block_size, "interval": p.interval,
        "sink_blocks": p.sink_blocks, "recent": p.recent, "protect_prompt": p.protect_prompt, "seed": p.seed,
    }
    if log_file is not None:
        cfg["log_file"] = str(log_file)
    return {
        "scheduler_cls": "kvcompose.integrations.vllm.scheduler.KVComposeScheduler",
        "worker_extension_cls": "kvcompose.integrations.vllm.worker.KVComposeWorkerExtension",
        "additional_config": {"kvcompose": cfg},
        "block_size": p.block_size,
        "enable_prefix_caching": False,
        "async_scheduling": False,
    }
