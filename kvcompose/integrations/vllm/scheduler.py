"""Scheduler side of the vLLM prototype: a `Scheduler` subclass that runs a `BlockPolicy` as the compression
event of every running request, frees the chosen blocks, and re-sends the request's block table.

Where it runs: in vLLM's EngineCore process, at the start of `Scheduler.schedule()`, before the scheduler
allocates this step's new blocks (so the freed blocks are already available to every request of the step).
vLLM loads it through its public `scheduler_cls` setting (`engine_kwargs` sets it).

What it touches inside vLLM (v0.32; see docs/serving.md for why each is needed):

* `KVCacheManager.coordinator.single_type_managers[0].req_to_blocks[request_id]`: the request's block list;
  a freed entry becomes `BlockPool.null_block`, as vLLM's own sliding-window managers do;
* `BlockPool.free_blocks`: returns the freed blocks to the pool;
* `CachedRequestData.resumed_req_ids` / `new_block_ids` of the step's `SchedulerOutput`: a request whose
  blocks were freed is marked "resumed" with its whole block list, so the worker replaces its block-table row
  (otherwise the worker only ever appends, and would keep reading blocks now given to other requests).

Requirements it checks: one KV-cache group of full attention, prefix caching off (blocks written after an
eviction depend on it, so their hashes must not be published), synchronous scheduling, no speculative
decoding, no pipeline parallelism.
"""

from __future__ import annotations

import json
import time
from typing import Any

try:
    from vllm.logger import init_logger
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.request import RequestStatus
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"{__name__} needs vLLM (pip install kvcompose[vllm]; see docs/serving.md): {e}"
    ) from e

from ...view import KVComposeError
from .policy import BlockPolicy, request_rng

__all__ = ["KVComposeScheduler", "CONFIG_KEY"]

logger = init_logger(__name__)

CONFIG_KEY = "kvcompose"
"""Key of the policy's settings in vLLM's `additional_config`."""


def _user_id(request_id: str) -> str:
    """The id the user gave: vLLM's `InputProcessor.assign_request_id` appends "-" and 8 random characters,
    which would make the random policy's draws differ between two runs of the same requests."""
    head, _, tail = request_id.rpartition("-")
    return head if head and len(tail) == 8 and tail.isalnum() else request_id


class KVComposeScheduler(Scheduler):
    """vLLM's `Scheduler` plus a block-granular kvcompose policy (prototype; see the module docstring).

    Settings come from `vllm_config.additional_config["kvcompose"]`: the `BlockPolicy` fields and an optional
    `log_file` (JSONL, one line per compression event: request id, computed tokens, freed logical blocks,
    blocks held after the event, and the policy's wall time).
    """

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        cfg = dict((vllm_config.additional_config or {}).get(CONFIG_KEY) or {})
        if not cfg:
            raise KVComposeError(f"KVComposeScheduler needs additional_config[{CONFIG_KEY!r}] (use engine_kwargs)")
        self._kvc_log_file = cfg.pop("log_file", None)
        self.kvc_policy = BlockPolicy(**cfg)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            raise KVComposeError("the kvcompose vLLM prototype supports one KV-cache group of full attention")
        block_size = groups[0].kv_cache_spec.block_size
        if block_size != self.kvc_policy.block_size:
            raise KVComposeError(
                f"vLLM's block size is {block_size}, the policy's {self.kvc_policy.block_size}: pass the same"
            )
        if self.cache_config.enable_prefix_caching:
            raise KVComposeError("turn prefix caching off (enable_prefix_caching=False) with a kvcompose policy")
        if self.scheduler_config.async_scheduling:
            raise KVComposeError("the kvcompose vLLM prototype needs async_scheduling=False")
        if vllm_config.speculative_config is not None or self.use_pp:
            raise KVComposeError("the kvcompose vLLM prototype supports neither speculative decoding nor PP")
        pool = self.kv_cache_manager.block_pool
        if pool.null_block.block_id != 0:
            raise KVComposeError("vLLM's null block is expected to have id 0")
        self._kvc_manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        self._kvc_pending: set[str] = set()
        self._kvc_rngs: dict[str, Any] = {}
        self.kvc_events = 0
        self.kvc_blocks_freed = 0
        self.kvc_seconds = 0.0
        logger.info("kvcompose block policy: %s", self.kvc_policy)

    # ------------------------------------------------------------------ compression event
    def _kvc_compress(self) -> None:
        pool = self.kv_cache_manager.block_pool
        null = pool.null_block
        lines = []
        for req in self.running:
            rid = req.request_id
            blocks = self._kvc_manager.req_to_blocks.get(rid)
            if not blocks:
                continue
            t0 = time.perf_counter()
            resident = [i for i, b in enumerate(blocks) if not b.is_null]
            rng = None
            if self.kvc_policy.policy == "random":
                rng = self._kvc_rngs.get(rid)
                if rng is None:
                    rng = self._kvc_rngs[rid] = request_rng(self.kvc_policy.seed, _user_id(rid))
            evict = self.kvc_policy.plan(resident, req.num_computed_tokens, req.num_prompt_tokens, rng)
            if not evict:
                continue
            freed = []
            for i in evict:
                freed.append(blocks[i])
                blocks[i] = null
            pool.free_blocks(freed)
            dt = time.perf_counter() - t0
            self._kvc_pending.add(rid)
            self.kvc_events += 1
            self.kvc_blocks_freed += len(freed)
            self.kvc_seconds += dt
            if self._kvc_log_file:
                lines.append(json.dumps({
                    "request_id": rid, "num_computed_tokens": req.num_computed_tokens,
                    "num_prompt_tokens": req.num_prompt_tokens, "freed": evict,
                    "held_blocks": len(resident) - len(evict), "seconds": dt,
                }))
        if lines:
            with open(self._kvc_log_file, "a") as f:
                f.write("\n".join(lines) + "\n")

    def _kvc_resend(self, out) -> None:
        """Mark the requests whose blocks were freed as resumed, with their whole block list, so that the
        worker replaces their block-table row."""
        if not self._kvc_pending:
            return
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._kvc_pending or rid in cached.resumed_req_ids:
                self._kvc_pending.discard(rid)
                continue
            req = self.requests[rid]
            cached.resumed_req_ids.add(rid)
            cached.new_block_ids[i] = self.kv_cache_manager.get_block_ids(rid)
            cached.all_token_ids[rid] = req.all_token_ids.copy()
            self._kvc_pending.discard(rid)
        # requests that were preempted get their whole (fresh) block list when they resume
        for rid in list(self._kvc_pending):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                self._kvc_pending.discard(rid)

    def schedule(self, *args, **kwargs):
        """Run the compression event of every running request, then vLLM's own scheduling step."""
        self._kvc_compress()
        out = super().schedule(*args, **kwargs)
        self._kvc_resend(out)
        for rid in [r for r in self._kvc_rngs if r not in self.requests]:
            del self._kvc_rngs[rid]
        return out
