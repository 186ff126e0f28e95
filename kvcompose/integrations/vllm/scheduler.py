"""The scheduler of a kvcompose vLLM engine: vLLM's `Scheduler`, loaded through its public `scheduler_cls`
setting (`engine_kwargs` sets it), which frees the blocks behind each compressed request's kept tokens.

At the end of every `schedule()`, for each request the step runs, it applies the worker's own rule to the
same counts (`rules.event_due` on the prompt length and the `num_computed_tokens` the step sends the worker):
when the worker will compress the request before this step's forward, the scheduler keeps the request's
first `budget / block_size` real blocks (the worker packs every layer's and KV head's kept tokens there) and
every block from the logical block of `num_computed_tokens` on, and returns the others to vLLM's pool. They
serve other requests from the next step on; the worker's packing is done by then. Positions stay logical:
the freed entries of the request's block list become vLLM's null block, as its sliding-window managers do.

It also refuses, at start-up, every setting the route cannot honour (`check_engine`), and each request's
settings (`SamplingParams.extra_args["kvcompose"]`) when the request arrives.

What it relies on inside vLLM 0.32 that is not a stable API: `KVCacheManager.coordinator
.single_type_managers[0].req_to_blocks`, `BlockPool.null_block` / `free_blocks`, `KVCacheBlock.is_null`,
`SchedulerOutput.scheduled_cached_reqs` (`req_ids`, `num_computed_tokens`, `resumed_req_ids`),
`Request.num_prompt_tokens` / `sampling_params`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

try:
    from vllm.logger import init_logger
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"{__name__} needs vLLM (pip install kvcompose[vllm]; see docs/serving.md): {e}") from e

from ...view import KVComposeError
from .rules import CONFIG_KEY, Settings, blocks_to_free, engine_settings, event_due, request_settings

__all__ = ["KVComposeScheduler", "check_engine"]

logger = init_logger(__name__)


def check_engine(vllm_config, kv_cache_config=None) -> None:
    """Refuse, with the reason, an engine whose settings the vLLM route cannot honour."""
    cache, sched, par = vllm_config.cache_config, vllm_config.scheduler_config, vllm_config.parallel_config
    model = vllm_config.model_config
    if not (vllm_config.additional_config or {}).get(CONFIG_KEY):
        raise KVComposeError(f"a kvcompose engine needs additional_config[{CONFIG_KEY!r}] (use engine_kwargs)")
    problems = []
    if cache.enable_prefix_caching:
        problems.append("prefix caching (blocks written after an eviction depend on it: enable_prefix_caching=False)")
    if sched.async_scheduling:
        problems.append("async scheduling (async_scheduling=False: the worker and the scheduler count the same steps)")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding")
    if par.pipeline_parallel_size > 1 or par.tensor_parallel_size > 1:
        problems.append("pipeline or tensor parallelism (untested; head-coupled scorers would see one rank's heads)")
    if getattr(par, "decode_context_parallel_size", 1) > 1 or getattr(par, "prefill_context_parallel_size", 1) > 1:
        problems.append("context parallelism")
    if vllm_config.kv_transfer_config is not None:
        problems.append("KV connectors (offloading / disaggregation move blocks kvcompose packs)")
    if cache.cache_dtype not in ("auto", None):
        problems.append(f"a quantized KV cache (kv_cache_dtype={cache.cache_dtype!r}; scorers read raw keys)")
    if model is not None:
        if model.is_encoder_decoder:
            problems.append("encoder-decoder models")
        if getattr(model, "uses_mrope", False):
            problems.append("M-RoPE models (positions are computed from token counts here)")
        if getattr(model, "use_mla", False):
            problems.append("MLA attention")
    if vllm_config.use_v2_model_runner:
        problems.append("model runner V2 (set VLLM_USE_V2_MODEL_RUNNER=0: kvcompose hooks the V1 runner)")
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        problems.append(f"full CUDA graphs (cudagraph_mode={mode.name}: the builder's lengths change per step; use "
                        "PIECEWISE or enforce_eager=True)")
    if kv_cache_config is not None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            problems.append(f"{len(groups)} KV-cache groups (kvcompose packs one block table)")
        elif not isinstance(groups[0].kv_cache_spec, FullAttentionSpec) or isinstance(
                groups[0].kv_cache_spec, SlidingWindowSpec) or getattr(groups[0].kv_cache_spec, "sliding_window", None):
            problems.append(f"{type(groups[0].kv_cache_spec).__name__} KV caches (full attention only)")
    if problems:
        raise KVComposeError("kvcompose's vLLM route cannot run with: " + "; ".join(problems))


@dataclass
class _State:
    settings: Settings
    prompt_len: int
    last: int = 0
    held: int = 0
    events: int = 0


class KVComposeScheduler(Scheduler):
    """vLLM's `Scheduler` plus the block side of kvcompose's compression events (see the module docstring).

    Settings come from `vllm_config.additional_config["kvcompose"]` (see `engine_kwargs`); `log_file` there
    names a JSONL written with one line per event (request id, counts, blocks freed, blocks and requests
    running, free blocks) and one per preemption.
    """

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs) -> None:
        check_engine(vllm_config, kv_cache_config)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        cfg = dict(vllm_config.additional_config[CONFIG_KEY])
        self._kvc_block = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self._kvc_base = engine_settings(cfg, self._kvc_block)
        self._kvc_log = cfg.get("log_file")
        self._kvc_manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        self._kvc: dict[str, _State] = {}
        self.kvc_events = 0
        self.kvc_blocks_freed = 0
        self.kvc_peak_running = 0
        logger.info("kvcompose scheduler: %s, budget %s, interval %s, block size %d", self._kvc_base.pipeline,
                    self._kvc_base.budget, self._kvc_base.interval, self._kvc_block)

    def add_request(self, request) -> None:
        """vLLM's, after the request's own kvcompose settings (`extra_args`) are checked."""
        sp = request.sampling_params
        settings = request_settings(sp.extra_args if sp is not None else None, self._kvc_block, self._kvc_base)
        self._kvc[request.request_id] = _State(settings=settings, prompt_len=request.num_prompt_tokens)
        super().add_request(request)

    def _preempt_request(self, request, *args, **kwargs):
        st = self._kvc.get(request.request_id)
        if st is not None:
            st.last = st.held = 0
            self._kvc_write({"preempted": request.request_id, "num_computed_tokens": request.num_computed_tokens})
        return super()._preempt_request(request, *args, **kwargs)

    def schedule(self, *args, **kwargs):
        """vLLM's scheduling step, then the blocks of this step's compression events go back to the pool."""
        out = super().schedule(*args, **kwargs)
        self._kvc_events(out)
        self.kvc_peak_running = max(self.kvc_peak_running, len(self.running))
        for rid in [r for r in self._kvc if r not in self.requests]:
            del self._kvc[rid]
        return out

    def _kvc_events(self, out) -> None:
        cached = out.scheduled_cached_reqs
        pool = self.kv_cache_manager.block_pool
        lines = []
        for i, rid in enumerate(cached.req_ids):
            st = self._kvc.get(rid)
            if st is None:
                continue
            c = cached.num_computed_tokens[i]
            if rid in cached.resumed_req_ids or c < st.last:
                st.last = st.held = 0
            st.held += c - st.last
            s = st.settings
            due = s.compresses and event_due(st.prompt_len, st.last, c, s.interval, st.held, s.budget)
            st.last = c
            if not due:
                continue
            t0 = time.perf_counter()
            blocks = self._kvc_manager.req_to_blocks[rid]
            real = [j for j, b in enumerate(blocks) if not b.is_null]
            freed = blocks_to_free(real, c, s.budget, self._kvc_block)
            null = pool.null_block
            gone = []
            for j in freed:
                gone.append(blocks[j])
                blocks[j] = null
            pool.free_blocks(gone)
            st.held = s.budget
            st.events += 1
            self.kvc_events += 1
            self.kvc_blocks_freed += len(gone)
            if self._kvc_log:
                lines.append({"request_id": rid, "num_computed_tokens": c, "num_prompt_tokens": st.prompt_len,
                              "num_scheduled_tokens": out.num_scheduled_tokens.get(rid), "freed": len(gone), "held_blocks": len(real) - len(gone),
                              "running": len(self.running), "free_blocks": pool.get_num_free_blocks(),
                              "seconds": time.perf_counter() - t0})
        for line in lines:
            self._kvc_write(line)

    def _kvc_write(self, line: dict) -> None:
        if self._kvc_log:
            with open(self._kvc_log, "a") as f:
                f.write(json.dumps(line) + "\n")
