"""The worker of a kvcompose vLLM engine: vLLM's worker class for the platform (`CPUWorker` on CPU, `Worker` on
CUDA), loaded through vLLM's public `worker_cls` setting (`engine_kwargs` sets it), with kvcompose's steps
mixed into its model runner.

Per step, in vLLM's `GPUModelRunner.execute_model` (the V1 runner, which `CPUModelRunner` extends):

1. `_update_states` (kvcompose first, then vLLM's): new requests get their settings; finished ones go;
   preempted ones restart; every scheduled request's physical count advances by what the previous step
   wrote; a request whose event is due is compressed (`Runtime.compress`: every layer's kept tokens
   packed into its leading blocks) and its block-table row cut, in the persistent batch and in the runner's
   request state. All of it before vLLM's own update, which may zero newly allocated blocks, and before the
   forward.
2. After vLLM's update the batch order is final: `Runtime.plan` gives the attention builder the physical
   positions and lengths of the step, and the attention impls the ring indices of the queries to record.
3. The forward runs with kvcompose's backend (`attention.py`); the plan is dropped afterwards, so dummy runs
   see vLLM's path.

Each request's work in step 1 runs on its own: when it raises (a block of the request's pipeline failing,
say), the request's counts and block-table row are left as the scheduler's (the row cut as the scheduler
cut it), it runs no further event, and the step's output names it (`rules.FAILED_ATTR`) so that the
scheduler finishes it alone with an error; the other requests are untouched.

What it relies on inside vLLM 0.32 that is not a stable API (docs/serving.md lists them all):
`GPUModelRunner._update_states` / `execute_model` (overridden through a subclass swapped onto the runner
object, `__class__`), `runner.requests[req_id].block_ids`, `runner.input_batch` (`req_id_to_index`,
`req_ids`, `num_computed_tokens_cpu`, `block_table[0].block_table.np` / `num_blocks_per_row`),
`SchedulerOutput` / `CachedRequestData` / `NewRequestData` fields, `runner.attn_groups[..][..]
.metadata_builders`, `compilation_config.static_forward_context[layer].kv_cache` / `.impl`.
"""

from __future__ import annotations

import copy
import time
from typing import Any

try:
    from vllm.logger import init_logger
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"{__name__} needs vLLM (pip install kvcompose[vllm]; see docs/serving.md): {e}") from e

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
elif current_platform.is_cuda_alike():
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker
else:  # pragma: no cover - other platforms
    raise ImportError(f"kvcompose's vLLM worker supports the CPU and CUDA platforms, not {current_platform!r}")

from ...view import KVComposeError
from .attention import backend_kind, register
from .rules import CONFIG_KEY, FAILED_ATTR, TRACKED_ATTR, engine_limits, request_settings
from .runtime import PagedLayout, Runtime

__all__ = ["KVComposeWorker", "KVComposeRunner"]

logger = init_logger(__name__)

register()  # kvcompose's attention backends, in this worker process, before the model is built


class KVComposeRunner:
    """Mixed into vLLM's V1 model runner (see the module docstring). State: `_kvc` (`Runtime`)."""

    _kvc: Runtime | None = None

    def _kvc_setup(self, vllm_config, kv_cache_config) -> None:
        cfg = dict((vllm_config.additional_config or {}).get(CONFIG_KEY) or {})
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise KVComposeError(f"kvcompose's vLLM route supports one KV-cache group, the model has {len(groups)}")
        spec = groups[0].kv_cache_spec
        block_size = spec.block_size
        self._kvc_engine = engine_limits(cfg, block_size, vllm_config.model_config.max_model_len)
        self._kvc_base = self._kvc_engine.base
        ctx = self.compilation_config.static_forward_context
        names = sorted(groups[0].layer_names, key=extract_layer_index)
        layers = [ctx[n] for n in names]
        impls = [layer.impl for layer in layers]
        for i, (layer, impl) in enumerate(zip(layers, impls)):
            if getattr(impl, "sliding_window", None) not in (None, -1) or getattr(impl, "alibi_slopes", None) is not None:
                raise KVComposeError(f"layer {names[i]} uses a sliding window or ALiBi: both read positions from the "
                                     "physical index, which compression changes")
            impl._kvc, impl._kvc_layer = None, i
        kinds = {g.backend.get_name() for gs in self.attn_groups for g in gs}
        if len(kinds) != 1:
            raise KVComposeError(f"kvcompose's vLLM route needs one attention backend, the model uses {sorted(kinds)}")
        kind = backend_kind(kinds.pop())
        kv = [layer.kv_cache for layer in layers]
        maps = None
        if kind == "CPU_ATTN":
            maps = cpu_layout_maps(layers[0], spec.num_kv_heads, block_size, spec.head_size, kv[0].dtype)
        tp = vllm_config.parallel_config.tensor_parallel_size
        tp_rank, gather = 0, None
        if tp > 1:
            from vllm.distributed import get_tp_group

            group = get_tp_group()
            total = vllm_config.model_config.get_total_num_kv_heads()
            if total % tp or spec.num_kv_heads * tp != total:
                raise KVComposeError(f"tensor_parallel_size={tp} does not divide the model's {total} KV heads (vLLM "
                                     "replicates them then; kvcompose needs each head on one rank)")
            tp_rank, gather = group.rank_in_group, group.all_gather
        self._kvc = Runtime(
            num_layers=len(layers), num_kv_heads=spec.num_kv_heads, num_q_heads=impls[0].num_heads,
            head_dim=spec.head_size, block_size=block_size, device=kv[0].device, dtype=kv[0].dtype,
            scales=[float(impl.scale) for impl in impls], max_seqs=self.scheduler_config.max_num_seqs,
            query_window=self._kvc_engine.query_window,
            layout=PagedLayout(kind, spec.head_size, block_size, maps), tp_rank=tp_rank, tp_size=tp, gather=gather,
        )
        self._kvc.hf_config = vllm_config.model_config.hf_config
        odd = [n for n, impl in zip(names, impls) if getattr(impl, "logits_soft_cap", None) or
               getattr(impl, "sinks", None) is not None]
        if odd:  # `Runtime.head_attention` is plain softmax attention
            self._kvc.per_head_refused = (f"layer {odd[0]} soft-caps its logits or has attention sinks, which "
                                          "kvcompose's attention for per-head counts does not implement")
        hidden = vllm_config.model_config.get_total_num_hidden_layers()
        if hidden != len(layers):  # per-layer schedules count the model's layers; the scheduler uses `hidden`
            self._kvc.per_layer_refused = (f"the model has {hidden} layers, {len(layers)} of them attention layers: "
                                           "per-layer budgets would not count the same layers in the scheduler")
        self._kvc_kv = kv
        for impl in impls:
            impl._kvc = self._kvc
        for gs in self.attn_groups:
            for g in gs:
                for b in g.metadata_builders:
                    b._kvc = self._kvc
        logger.info("kvcompose: %s, budget %s, interval %s, %d layers x %d KV heads, ring window %d",
                    self._kvc_base.pipeline, self._kvc_base.budget, self._kvc_base.interval, len(layers),
                    spec.num_kv_heads, self._kvc.W)

    # -- per step ---------------------------------------------------------------------------------
    def _kvc_before(self, so) -> None:
        rt = self._kvc
        for rid in so.finished_req_ids:
            rt.remove(rid)
        for rid in getattr(so, "preempted_req_ids", None) or ():
            rt.restart(rid, preempted=True)
        tracked = getattr(so, TRACKED_ATTR, None)
        if tracked is not None:
            rt.scheduler_tracked = tracked
        for new in so.scheduled_new_reqs:
            if new.req_id not in rt.requests:
                self._kvc_guard(new.req_id, self._kvc_new, new)
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        due: list = []
        for i, rid in enumerate(cached.req_ids):
            self._kvc_guard(rid, self._kvc_cached, rid, cached.num_computed_tokens[i], rid in resumed, due)
        if due:
            self._kvc_compress(due)

    def _kvc_guard(self, rid: str, fn, *args) -> None:
        """Run one request's work; if it raises, that request alone is reported as failed (see the module
        docstring) and the step goes on."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - whatever it is, it concerns this request alone
            self._kvc_failed(rid, e)

    def _kvc_failed(self, rid: str, e: BaseException) -> None:
        why = f"kvcompose: the worker's work on this request failed: {type(e).__name__}: {e}"
        logger.warning("kvcompose: request %s: %s", rid, why)
        self._kvc.fail(rid, why)

    def _kvc_new(self, new) -> None:
        settings = request_settings(new.sampling_params.extra_args if new.sampling_params else None,
                                    self._kvc_engine)
        n_prompt = len(new.prompt_token_ids) if new.prompt_token_ids is not None else len(new.prompt_embeds)
        st = self._kvc.add(new.req_id, settings, n_prompt)
        st.last = new.num_computed_tokens
        st.held = new.num_computed_tokens

    def _kvc_cached(self, rid: str, c: int, resumed: bool, due: list) -> None:
        rt = self._kvc
        if resumed:
            rt.restart(rid)
        st = rt.advance(rid, c)
        if st is None:
            return
        if rt.due(st, c):
            due.append((rid, st, c, self.requests[rid].block_ids[0]))
        else:
            st.last = c

    def _kvc_compress(self, due: list) -> None:
        """The events due at this step, run together (`Runtime.compress_many`), then each request's row cut. A
        request whose event failed still has its row cut by the scheduler's rule (the scheduler freed those
        blocks), then fails alone."""
        rt = self._kvc
        try:
            kept = rt.compress_many(due, self._kvc_kv)
        except Exception as e:  # noqa: BLE001 - compress_many returns failures; this is a bug around it
            kept = {rid: e for rid, *_ in due}
        for rid, st, c, row in due:
            keep = kept.get(rid)
            err = KVComposeError("the event returned nothing") if keep is None else (
                keep if isinstance(keep, BaseException) else None)
            if err is not None:
                try:
                    keep = rt.cut(st, c, row)
                    st.c_event = c
                except Exception:  # noqa: BLE001 - the scheduler's rule failed too: it freed nothing
                    keep = None
            st.last = c
            if keep is not None:
                try:
                    self._kvc_cut(rid, row, keep)
                except Exception as e:  # noqa: BLE001 - this request alone
                    err = err or e
            if err is not None:
                self._kvc_failed(rid, err)

    def _kvc_cut(self, rid: str, row: list[int], keep: list[int]) -> None:
        """A request's block-table row after its event, in the runner's request state and the persistent batch."""
        row[:] = keep  # the runner's copy (rebuilds the batch row if the request leaves and returns)
        bt = self.input_batch.block_table[0]
        idx = self.input_batch.req_id_to_index.get(rid)
        if idx is not None:
            n_old = int(bt.num_blocks_per_row[idx])
            bt.block_table.np[idx, :len(keep)] = keep
            bt.block_table.np[idx, len(keep):n_old] = 0
            bt.num_blocks_per_row[idx] = len(keep)

    def _kvc_after(self, so) -> None:
        rt = self._kvc
        ib = self.input_batch
        n = ib.num_reqs
        ids = ib.req_ids[:n]
        sched = so.num_scheduled_tokens
        rt.plan_arrays(ids, ib.num_computed_tokens_cpu[:n], [sched[r] for r in ids])
        blocks = int(ib.block_table[0].num_blocks_per_row[:n].sum())
        rt.stats.peak_requests = max(rt.stats.peak_requests, n)
        rt.stats.request_steps += n
        rt.stats.peak_blocks = max(rt.stats.peak_blocks, blocks)

    @property
    def _kvc_block_size(self) -> int:
        return self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size

    def _update_states(self, scheduler_output):
        rt = self._kvc
        if rt is None:
            return super()._update_states(scheduler_output)
        ev0, t0 = rt.stats.event_seconds, time.perf_counter()
        self._kvc_before(scheduler_output)
        rt.stats.plan_seconds += time.perf_counter() - t0 - (rt.stats.event_seconds - ev0)  # events count their own
        out = super()._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens:
            t1 = time.perf_counter()
            self._kvc_after(scheduler_output)
            rt.stats.plan_seconds += time.perf_counter() - t1
        return out

    def execute_model(self, scheduler_output, *args, **kwargs):
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            if self._kvc is not None:
                self._kvc.step = None


def cpu_layout_maps(layer, heads: int, block_size: int, head_size: int, dtype) -> tuple:
    """Where vLLM's CPU kernel keeps each (slot, dim) of a block's keys and values, measured with its own
    cache-write op (`cpu_attn_reshape_and_cache`, with the layer's ISA): two probes write the slot index and
    the dim index of every element into a scratch block, whose regions then name each element's offset.
    Returns `(kmap, vmap)`, `[block_size, D]` offsets (see `runtime.PagedLayout`)."""
    import torch
    from vllm import _custom_ops as ops

    n = block_size * head_size
    found = []
    for probe in ("slot", "dim"):
        kv = torch.zeros(1, heads, block_size, 2 * head_size, dtype=dtype)
        kc, vc = kv.view(1, heads, 2 * block_size, head_size).chunk(2, dim=2)
        s = torch.arange(block_size)[:, None].expand(block_size, head_size)
        d = torch.arange(head_size)[None, :].expand(block_size, head_size)
        mark = (s if probe == "slot" else d) + 1  # small integers: exact in bf16 up to 256
        x = mark[:, None, :].expand(block_size, heads, head_size).to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(x, x, kc, vc, torch.arange(block_size), layer.isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        flat = kv.view(1, heads, 2 * n)[0, 0].float().round().long() - 1
        found.append((flat[:n], flat[n:]))
    maps = []
    for part in (0, 1):
        slot_of, dim_of = found[0][part], found[1][part]
        m = torch.full((block_size, head_size), -1, dtype=torch.long)
        ok = (slot_of >= 0) & (slot_of < block_size) & (dim_of >= 0) & (dim_of < head_size)
        m[slot_of[ok], dim_of[ok]] = torch.arange(n)[ok]
        if int(ok.sum()) != n or bool((m < 0).any()):
            raise KVComposeError(f"kvcompose could not read vLLM's CPU KV layout (ISA {layer.isa!r}, block "
                                 f"{block_size}, head size {head_size}, {dtype})")
        maps.append(m.to(layer.kv_cache.device))
    return maps[0], maps[1]


_RUNNERS: dict[type, type] = {}


def _runner_class(cls: type) -> type:
    """vLLM's runner class with `KVComposeRunner` mixed in (one per class)."""
    if cls not in _RUNNERS:
        _RUNNERS[cls] = type(f"KVCompose{cls.__name__}", (KVComposeRunner, cls), {})
    return _RUNNERS[cls]


class KVComposeWorker(_PlatformWorker):
    """vLLM's worker for this platform, whose model runner runs kvcompose's steps; `kvcompose_stats()` (through
    `LLM.collective_rpc("kvcompose_stats")`) returns the worker's counters."""

    def init_device(self):
        super().init_device()
        runner = self.model_runner
        if type(runner).__module__.startswith("vllm.v1.worker.gpu.") or not isinstance(runner, GPUModelRunner):
            raise KVComposeError(
                f"kvcompose's vLLM route runs in vLLM's V1 model runner; this engine built {type(runner).__name__} "
                "(model runner V2): set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        runner.__class__ = _runner_class(type(runner))

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        self.model_runner._kvc_setup(self.vllm_config, kv_cache_config)

    def execute_model(self, scheduler_output):
        t0 = time.perf_counter()
        try:
            return self._kvc_report(super().execute_model(scheduler_output))
        finally:
            self._kvc_time(t0, count=scheduler_output.total_num_scheduled_tokens > 0)

    def sample_tokens(self, grammar_output):
        t0 = time.perf_counter()
        try:
            return self._kvc_report(super().sample_tokens(grammar_output))
        finally:
            self._kvc_time(t0, count=False)

    def _kvc_report(self, out):
        """The step's output, naming the requests whose kvcompose work failed (`rules.FAILED_ATTR`)."""
        rt = getattr(self.model_runner, "_kvc", None)
        if out is None or rt is None or not rt.failed:
            return out
        out = copy.copy(out)  # vLLM's empty output is a shared constant
        setattr(out, FAILED_ATTR, dict(rt.failed))
        rt.failed.clear()
        return out

    def _kvc_time(self, t0: float, count: bool) -> None:
        rt = getattr(self.model_runner, "_kvc", None)
        if rt is not None:
            rt.stats.step_seconds += time.perf_counter() - t0
            rt.stats.steps += int(count)

    def kvcompose_state(self) -> dict[str, Any]:
        """What the worker keeps per request (`LLM.collective_rpc("kvcompose_state")`): the requests it knows,
        the query ring's free and total slots, the requests it will report failed, and the number of requests
        the scheduler kept state for after the last step it sent. On an idle engine all requests are gone."""
        import kvcompose

        rt = getattr(self.model_runner, "_kvc", None)
        if rt is None:
            return {}
        return {"requests": sorted(rt.requests), "free_slots": len(rt.free_slots), "slots": rt.S,
                "failed": sorted(rt.failed), "scheduler_requests": rt.scheduler_tracked,
                "kvcompose": kvcompose.__file__}

    def kvcompose_stats(self, reset: bool = False) -> dict[str, Any]:
        """The worker's kvcompose counters (`runtime.Stats`), for `LLM.collective_rpc("kvcompose_stats")`;
        `reset=True` (`collective_rpc("kvcompose_stats", kwargs={"reset": True})`) starts them over after
        reading, so that one engine can measure several batches."""
        rt = getattr(self.model_runner, "_kvc", None)
        if rt is None:
            return {}
        out = rt.stats.as_dict()
        if reset:
            rt.stats = type(rt.stats)()
        return out
