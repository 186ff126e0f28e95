"""The scheduler of a kvcompose vLLM engine: vLLM's `Scheduler`, loaded through its public `scheduler_cls`
setting (`engine_kwargs` sets it), which frees the blocks behind each compressed request's kept tokens.

At the end of every `schedule()`, for each request the step runs, it applies the worker's own rule to the
same counts (`rules.event_due` on the prompt length and the `num_computed_tokens` the step sends the worker):
when the worker will compress the request before this step's forward, the scheduler keeps the request's
first `budget / block_size` real blocks (the worker packs every layer's and KV head's kept tokens there; with
per-layer budgets, the largest layer's rounded up to whole blocks; with per-head counts, the most one head can
keep: `Settings.held_bound`) and
every block from the logical block of `num_computed_tokens` on, and returns the others to vLLM's pool. They
serve other requests from the next step on; the worker's packing is done by then. Positions stay logical:
the freed entries of the request's block list become vLLM's null block, as its sliding-window managers do.

Admission by what a request can come to hold. vLLM admits a waiting request when its prompt's blocks are
free, and preempts a running one (which starts over from its prompt) when a later step finds no block for
it: under memory pressure a plain engine overcommits its pool and pays in recomputation. A compressed
request's footprint is bounded: it never holds more than `max(prompt, budget) + interval` tokens plus the
block its next token goes to. Before each `schedule()` the scheduler sums that bound over the running
requests (a request that does not compress counts the blocks it will hold after this step, as vLLM counts
it) and lets vLLM admit only the waiting requests, in queue order, whose bound still fits in the pool
(`Scheduler.max_num_active_reqs`, set per step; never above the configured `max_num_seqs`, and at least one
request when none runs): compressed requests are then never preempted for want of blocks.

It also refuses, at start-up, every setting the route cannot honour (`check_engine`). A request whose own
settings (`SamplingParams.extra_args["kvcompose"]`) the engine would not honour is refused alone: the front
end's check (`admission.py`) normally stops it before it gets here; one that arrives anyway is added and at
once finished with vLLM's error status, its output naming the problem (`stop_reason`), and the engine goes on.
Nothing raised by kvcompose's per-request work escapes for one request's sake (vLLM would kill the engine for
all): a request whose event fails here or in the worker (which reports it in its output) finishes alone with
an error.

What it relies on inside vLLM 0.32 that is not a stable API: `KVCacheManager.coordinator
.single_type_managers[0].req_to_blocks`, `BlockPool.null_block` / `free_blocks`, `KVCacheBlock.is_null`,
`SchedulerOutput.scheduled_cached_reqs` (`req_ids`, `num_computed_tokens`, `resumed_req_ids`),
`Request.num_prompt_tokens` / `sampling_params` / `client_index`, `Scheduler.requests`, `finish_requests` with
`RequestStatus.FINISHED_ERROR`, `update_from_output` returning `{client_index: EngineCoreOutputs}`, and
`EngineCoreOutput(request_id, new_token_ids, finish_reason=FinishReason.ERROR, stop_reason=...)`; for
admission, `Scheduler.max_num_active_reqs` (read by `schedule()` when it admits waiting requests),
`Scheduler.running` / `waiting`, `BlockPool.num_gpu_blocks`, `Request.num_tokens` / `max_tokens`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

try:
    from vllm.logger import init_logger
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.request import RequestStatus
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"{__name__} needs vLLM (pip install kvcompose[vllm]; see docs/serving.md): {e}") from e

from ...view import KVComposeError
from .rules import (CONFIG_KEY, FAILED_ATTR, TRACKED_ATTR, Settings, blocks_to_free, engine_limits, event_due,
                    request_settings)

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
    if par.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism (each stage's worker holds some layers and the engine steps several "
                        "batches in flight, so the stages would compress at different steps than the scheduler "
                        "frees: docs/serving.md, 'Pipeline parallelism')")
    if par.tensor_parallel_size > 1 and model is not None and model.get_total_num_kv_heads() % par.tensor_parallel_size:
        problems.append(f"tensor_parallel_size={par.tensor_parallel_size} with {model.get_total_num_kv_heads()} KV "
                        "heads (vLLM then replicates heads across ranks; kvcompose needs each head on one rank)")
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
        self._kvc_engine = engine_limits(cfg, self._kvc_block, vllm_config.model_config.max_model_len)
        self._kvc_base = self._kvc_engine.base
        self._kvc_layers = vllm_config.model_config.get_total_num_hidden_layers()  # per-layer budgets' schedule
        self._kvc_heads = vllm_config.model_config.get_total_num_kv_heads()
        self._kvc_hf = vllm_config.model_config.hf_config
        self._kvc_log = cfg.get("log_file")
        self._kvc_manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        self._kvc: dict[str, _State] = {}
        self._kvc_failed: dict[str, str] = {}  # request id -> why, finished with an error after this step
        self._kvc_errors: list = []  # error outputs of refused requests, sent with the next step's outputs
        self.kvc_events = 0
        self.kvc_blocks_freed = 0
        self.kvc_peak_running = 0
        self.kvc_refused = 0
        self._kvc_max_active = self.max_num_active_reqs  # the configured admission limit (max_num_seqs)
        for note in self._kvc_engine.notes:
            logger.warning("kvcompose: %s", note)
        procs = [p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}"
                 for p in (vllm_config.model_config.logits_processors or ())]
        if not any(p.endswith("KVComposeAdmission") for p in procs):
            logger.warning("kvcompose: the front end does not check requests' kvcompose settings (no "
                           "KVComposeAdmission logits processor: use engine_kwargs / serve_args); a request with bad "
                           "settings is refused here instead, finishing with an error (HTTP 500, not 400)")
        logger.info("kvcompose scheduler: %s, budget %s, interval %s, block size %d, query ring %d",
                    self._kvc_base.pipeline, self._kvc_base.budget, self._kvc_base.interval, self._kvc_block,
                    self._kvc_engine.query_window)

    def add_request(self, request) -> None:
        """vLLM's, after the request's own kvcompose settings (`extra_args`) are checked; a request they refuse
        is added and finished at once with an error naming the problem (the others go on)."""
        sp = request.sampling_params
        try:
            settings = request_settings(sp.extra_args if sp is not None else None, self._kvc_engine)
            settings.check_layers(self._kvc_hf, self._kvc_layers, self._kvc_heads)  # per-layer budgets
        except Exception as e:  # noqa: BLE001 - whatever it is, it concerns this request alone
            super().add_request(request)
            self._kvc_refuse(request, f"kvcompose: {e}" if isinstance(e, KVComposeError) else
                             f"kvcompose could not read this request's settings ({type(e).__name__}: {e})")
            return
        self._kvc[request.request_id] = _State(settings=settings, prompt_len=request.num_prompt_tokens)
        super().add_request(request)

    def _kvc_refuse(self, request, why: str) -> None:
        """Finish `request` alone with vLLM's error status; its output (sent with the next step's) names why."""
        rid = request.request_id
        logger.warning("kvcompose: request %s finished with an error: %s", rid, why)
        self._kvc.pop(rid, None)
        self.finish_requests(rid, RequestStatus.FINISHED_ERROR)
        self._kvc_errors.append((request.client_index, EngineCoreOutput(
            request_id=rid, new_token_ids=[], finish_reason=FinishReason.ERROR, stop_reason=why[:2000])))
        self.kvc_refused += 1

    def _preempt_request(self, request, *args, **kwargs):
        st = self._kvc.get(request.request_id)
        if st is not None:
            st.last = st.held = 0
            self._kvc_write({"preempted": request.request_id, "num_computed_tokens": request.num_computed_tokens})
        return super()._preempt_request(request, *args, **kwargs)

    def _kvc_bound(self, request, running: bool = False) -> int:
        """The most blocks `request` can hold from now on: for a compressed request, `max(prompt, budget) +
        interval` tokens and the block of its next token, capped by its whole length, and at least what it needs
        now (`running` and decoding: the blocks it holds and one more; otherwise its logical length, e.g. a
        preempted request's recomputation, which prefills its tokens before its next event); otherwise the blocks
        its tokens need after this step."""
        b = self._kvc_block
        now = -(-(request.num_tokens + 1) // b)
        st = self._kvc.get(request.request_id)
        if st is None or not st.settings.compresses or st.settings.budget is None:
            return now
        if running and request.num_computed_tokens >= request.num_tokens - 1:  # decoding: its events freed the
            # blocks behind its kept tokens, so what it holds, not its logical length
            blocks = self._kvc_manager.req_to_blocks.get(request.request_id, ())
            now = sum(1 for blk in blocks if not blk.is_null) + 1
        s = st.settings
        kept = s.held_bound(self._kvc_layers, b, self._kvc_heads)
        bound = -(-(max(st.prompt_len, kept) + s.interval) // b) + 1
        if request.max_tokens is not None:
            bound = min(bound, -(-(st.prompt_len + request.max_tokens) // b))
        return max(now, bound)

    def _kvc_admission(self) -> int:
        """How many requests may run after this step's admissions: the running ones plus the waiting ones, in
        queue order, whose bound fits in the pool beside the running ones' bounds."""
        usable = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # vLLM's null block is never free
        held = sum(self._kvc_bound(r, running=True) for r in self.running)
        n = len(self.running) + getattr(self, "num_waiting_for_streaming_input", 0)
        for r in list(self.waiting):
            if n >= self._kvc_max_active:
                break
            bound = self._kvc_bound(r)
            if held + bound > usable and n > 0:
                break
            held, n = held + bound, n + 1
        return max(1, min(n, self._kvc_max_active))

    def schedule(self, *args, **kwargs):
        """vLLM's scheduling step (admitting only the waiting requests whose bound fits), then the blocks of this
        step's compression events go back to the pool."""
        if self._kvc_engine.reserve and self.waiting:
            self.max_num_active_reqs = self._kvc_admission()
        out = super().schedule(*args, **kwargs)
        self._kvc_events(out)
        self.kvc_peak_running = max(self.kvc_peak_running, len(self.running))
        for rid in [r for r in self._kvc if r not in self.requests]:
            del self._kvc[rid]
        setattr(out, TRACKED_ATTR, len(self._kvc))
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        """vLLM's, then the requests whose kvcompose work failed in this step (here or in the worker) finish
        alone with an error, and the error outputs of refused requests are sent."""
        failed = dict(getattr(model_runner_output, FAILED_ATTR, None) or {})
        failed.update(self._kvc_failed)
        self._kvc_failed = {}
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for rid, why in failed.items():
            client = None
            for c, eco in outputs.items():  # the step's token came from a cache the failure left undefined
                kept = [o for o in eco.outputs if o.request_id != rid]
                if len(kept) != len(eco.outputs):
                    client, eco.outputs = c, kept
            request = self.requests.get(rid)
            if request is not None and not request.is_finished():
                self._kvc_refuse(request, why)
            elif client is not None:  # it finished in this very step: its last output becomes the error
                logger.warning("kvcompose: request %s finished with an error: %s", rid, why)
                self._kvc_errors.append((client, EngineCoreOutput(
                    request_id=rid, new_token_ids=[], finish_reason=FinishReason.ERROR, stop_reason=why[:2000])))
            self._kvc.pop(rid, None)
        for client, out in self._kvc_errors:
            eco = outputs.get(client)
            if eco is None:
                outputs[client] = eco = EngineCoreOutputs(outputs=[])
            eco.outputs.append(out)
        self._kvc_errors = []
        return outputs

    def _kvc_events(self, out) -> None:
        cached = out.scheduled_cached_reqs
        lines = []
        for i, rid in enumerate(cached.req_ids):
            st = self._kvc.get(rid)
            if st is None:
                continue
            try:
                line = self._kvc_event(out, st, rid, cached.num_computed_tokens[i], rid in cached.resumed_req_ids)
            except Exception as e:  # noqa: BLE001 - this request alone finishes with an error after the step
                self._kvc_failed[rid] = f"kvcompose: the scheduler's compression event failed: {type(e).__name__}: {e}"
                self._kvc.pop(rid, None)
                continue
            if line is not None and self._kvc_log:
                lines.append(line)
        for line in lines:
            self._kvc_write(line)

    def _kvc_event(self, out, st: _State, rid: str, c: int, resumed: bool) -> dict | None:
        """One request's counts at this step and, when its event is due, the blocks behind its kept tokens
        freed; returns the event's log line."""
        if resumed or c < st.last:
            st.last = st.held = 0
        st.held += c - st.last
        s = st.settings
        kept = s.held_bound(self._kvc_layers, self._kvc_block, self._kvc_heads) if s.compresses else None
        due = s.compresses and event_due(st.prompt_len, st.last, c, s.interval, st.held, kept)
        st.last = c
        if not due:
            return None
        t0 = time.perf_counter()
        pool = self.kv_cache_manager.block_pool
        blocks = self._kvc_manager.req_to_blocks[rid]
        real = [j for j, b in enumerate(blocks) if not b.is_null]
        freed = blocks_to_free(real, c, kept, self._kvc_block)
        null = pool.null_block
        gone = []
        for j in freed:
            gone.append(blocks[j])
            blocks[j] = null
        pool.free_blocks(gone)
        st.held = kept
        st.events += 1
        self.kvc_events += 1
        self.kvc_blocks_freed += len(gone)
        return {"request_id": rid, "num_computed_tokens": c, "num_prompt_tokens": st.prompt_len,
                "num_scheduled_tokens": out.num_scheduled_tokens.get(rid), "freed": len(gone),
                "held_blocks": len(real) - len(gone), "running": len(self.running),
                "free_blocks": pool.get_num_free_blocks(), "seconds": time.perf_counter() - t0}

    def _kvc_write(self, line: dict) -> None:
        if self._kvc_log:
            try:
                with open(self._kvc_log, "a") as f:
                    f.write(json.dumps(line) + "\n")
            except OSError as e:  # the log is a convenience: it never stops the engine
                logger.warning("kvcompose: cannot write the event log %s (%s); logging stops", self._kvc_log, e)
                self._kvc_log = None
