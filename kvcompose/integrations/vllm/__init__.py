"""Any kvcompose `Pipeline` inside an unmodified vLLM (v1, 0.32): `pip install kvcompose[vllm]`.

    from vllm import LLM, SamplingParams
    from kvcompose import methods
    from kvcompose.integrations.vllm import engine_kwargs, request_kwargs

    llm = LLM(model=MODEL_DIR, **engine_kwargs(methods.rkv(), budget=512, block_size=32))
    llm.generate(prompts, SamplingParams(max_tokens=4096))                     # the engine's method
    llm.generate(prompts, SamplingParams(max_tokens=4096,                      # or a request's own
                 extra_args=request_kwargs(methods.snapkv(), budget=256)))

Every layer and KV head of a request keeps its own `budget` tokens (with a per-layer schedule, `Pyramid` or
`ReasoningWave`, each layer its own budget inside the blocks of the largest), selected by the pipeline's own
`Pipeline.select` over a `LayerView` of the request's paged keys and values, packed into its leading blocks
before the step's forward; vLLM's scheduler gives the blocks behind them back to the pool. vLLM's public
extension points carry it: `scheduler_cls` (`scheduler.KVComposeScheduler`), `worker_cls`
(`worker.KVComposeWorker`), `logits_processors` (`admission.KVComposeAdmission`: each request's settings
checked in the front end, a bad request refused alone before it enters the engine), `register_backend`
(`attention`), `additional_config` and, for `vllm serve`, the `vllm.general_plugins` entry point
(`plugin.register`). docs/serving.md has the design, the refusals, the vLLM internals it relies on and the
measurements. This module does not import vLLM.
"""

from __future__ import annotations

from typing import Any

import warnings

from ...pipeline import Pipeline
from ...view import KVComposeError, KVComposeWarning
from .rules import (CONFIG_KEY, Engine, Settings, blocks_to_free, check_blocks, check_pipeline, decode_pipeline,
                    encode_pipeline, engine_limits, event_due, keep_blocks, kept_row, layer_seed, request_settings)

__all__ = ["engine_kwargs", "request_kwargs", "engine_config", "serve_args", "Settings", "Engine", "check_pipeline",
           "check_blocks", "event_due", "keep_blocks", "blocks_to_free", "kept_row", "layer_seed", "encode_pipeline",
           "decode_pipeline", "request_settings", "CONFIG_KEY", "SCHEDULER_CLS", "WORKER_CLS", "ADMISSION_CLS"]

SCHEDULER_CLS = "kvcompose.integrations.vllm.scheduler.KVComposeScheduler"
WORKER_CLS = "kvcompose.integrations.vllm.worker.KVComposeWorker"
ADMISSION_CLS = "kvcompose.integrations.vllm.admission:KVComposeAdmission"
"""The front end's request check (a vLLM logits processor whose `validate_params` refuses a request with bad
kvcompose settings before it enters the engine core; its `apply` changes nothing)."""
DEFAULT_BLOCK_SIZE = 32  # the smallest block vLLM's CPU kernel takes (GPU backends take 16)


def _settings_dict(pipeline: Pipeline | str | None, budget: int | None, interval: int | None, seed: int | None,
                   preset_args: dict[str, Any] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if preset_args is not None and not isinstance(preset_args, dict):
        raise KVComposeError(f"preset_args must be a dict of the preset's keyword arguments, got "
                             f"{type(preset_args).__name__}")
    if isinstance(pipeline, str):
        cfg["preset"] = pipeline
        if preset_args:
            cfg["args"] = dict(preset_args)
    elif pipeline is not None:
        if preset_args:
            raise KVComposeError("preset_args go with a preset name, not with a Pipeline object")
        cfg["pipeline"] = encode_pipeline(pipeline)
    elif preset_args:
        raise KVComposeError("preset_args need a preset name")
    if budget is not None:
        cfg["budget"] = budget
    if interval is not None:
        cfg["interval"] = interval
    if seed is not None:
        cfg["seed"] = seed
    return cfg


def engine_config(pipeline: Pipeline | str = "full", budget: int | None = None, *, interval: int | None = None,
                  block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0, preset_args: dict[str, Any] | None = None,
                  query_window: int | None = None, log_file: str | None = None, reserve: bool = True
                  ) -> dict[str, Any]:
    """The checked `additional_config["kvcompose"]` dict of an engine (JSON-serialisable; see `engine_kwargs`)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise KVComposeError(f"block_size must be a positive int, got {block_size!r}")
    if pipeline is not None and not isinstance(pipeline, (str, Pipeline)):
        raise KVComposeError(f"pipeline must be a kvcompose Pipeline or a preset name, got {type(pipeline).__name__}")
    cfg = _settings_dict(pipeline, budget, interval, seed, preset_args)
    if query_window is not None:
        cfg["query_window"] = query_window
    if log_file is not None:
        cfg["log_file"] = str(log_file)
    if reserve is not True:
        cfg["reserve"] = reserve
    engine = engine_limits(cfg, block_size)  # raises on anything the engine would refuse
    for note in engine.notes:  # settings that cannot act, as KVComposeCache warns
        warnings.warn(note, KVComposeWarning, stacklevel=3)
    cfg["query_window"] = engine.query_window
    if engine.base.compresses:
        cfg["interval"] = engine.base.interval
    return cfg


def engine_kwargs(pipeline: Pipeline | str = "full", budget: int | None = None, *, interval: int | None = None,
                  block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0, preset_args: dict[str, Any] | None = None,
                  query_window: int | None = None, log_file: str | None = None, reserve: bool = True
                  ) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` (or `EngineArgs`) that run a kvcompose pipeline inside vLLM.

    Args:
        pipeline: a `Pipeline` (e.g. `methods.rkv()`; pickled into the engine's config, so custom blocks must
            be importable by the engine's processes) or a preset name of `kvcompose.methods.PRESETS` with
            `preset_args`. `"full"`: no compression (the engine still runs kvcompose's worker).
        budget: tokens every layer and KV head of a request keeps after an event; a whole number of blocks
            (a budget that is not is refused, with the block-aligned values around it).
        interval: decoded tokens between events (whole blocks; default: the pipeline's own, else 64).
        block_size: vLLM's block size (CPU: multiples of 32).
        seed: seeds each request's per-layer generators (`seed * 1_000_003 + layer`, as `KVComposeCache`), unless
            the request gives its own (`request_kwargs(seed=...)`).
        query_window: queries per layer and request kept for scorers with a window (default: the largest of 64
            and the pipeline's window); requests whose own pipeline reads more are refused.
        log_file: a JSONL the scheduler appends one line to per compression event and preemption.
        reserve: admit a waiting request only when the most blocks it can come to hold (a compressed request:
            `max(prompt, budget) + interval` tokens and one block) fit in the pool beside the running requests'
            (docs/serving.md, "Admission by bound"); False: vLLM's own admission (by the prompt's blocks, preempting
            when the pool runs out).

    Returns:
        `scheduler_cls`, `worker_cls`, `additional_config`, `block_size`, `enable_prefix_caching=False`,
        `async_scheduling=False` and `logits_processors=[ADMISSION_CLS]` (the front end's request check, which
        refuses a request with bad kvcompose settings before it enters the engine; merge it with your own
        logits processors if you pass any). Raises `KVComposeError` for anything the engine would refuse that
        can be checked without the model (docs/serving.md lists the rest) and warns (`KVComposeWarning`) for a
        setting that has no effect (a budget, interval or seed of a pipeline that never compresses, a seed of
        one that draws no random numbers). Does not import vLLM.
    """
    cfg = engine_config(pipeline, budget, interval=interval, block_size=block_size, seed=seed,
                        preset_args=preset_args, query_window=query_window, log_file=log_file, reserve=reserve)
    return {
        "scheduler_cls": SCHEDULER_CLS,
        "worker_cls": WORKER_CLS,
        "additional_config": {CONFIG_KEY: cfg},
        "block_size": block_size,
        "enable_prefix_caching": False,
        "async_scheduling": False,
        "logits_processors": [ADMISSION_CLS],
    }


def request_kwargs(pipeline: Pipeline | str | None = None, budget: int | None = None, *,
                   interval: int | None = None, seed: int | None = None, preset_args: dict[str, Any] | None = None,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, Any]:
    """`SamplingParams(extra_args=...)` that give one request its own pipeline, budget, interval or seed on a
    kvcompose engine (what is not given comes from the engine's settings). Checked here as far as the engine's
    settings are not needed (against `block_size`, the engine's); the engine checks the rest when the request
    arrives (`rules.request_settings`) and refuses that request alone."""
    if pipeline is not None and not isinstance(pipeline, (str, Pipeline)):
        raise KVComposeError(f"pipeline must be a kvcompose Pipeline or a preset name, got {type(pipeline).__name__}")
    cfg = _settings_dict(pipeline, budget, interval, seed, preset_args)
    if pipeline is not None:  # the request's own pipeline: checked as the engine will (its window: there)
        base = Settings(pipeline=Pipeline(), budget=None, interval=block_size, seed=0)
        request_settings({CONFIG_KEY: cfg}, Engine(base=base, block_size=block_size, query_window=2**62))
    else:
        if budget is not None or interval is not None:
            check_blocks(budget or block_size, interval or block_size, block_size)
        if seed is not None:
            from ...seeding import check_seed

            check_seed(seed, "seed")
    return {CONFIG_KEY: cfg}


def serve_args(pipeline: str = "full", budget: int | None = None, *, interval: int | None = None,
               block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0, preset_args: dict[str, Any] | None = None,
               query_window: int | None = None, log_file: str | None = None, reserve: bool = True) -> list[str]:
    """The `vllm serve` command-line flags of a kvcompose engine (a preset by name: the JSON names it)."""
    import json

    if not isinstance(pipeline, str):
        raise KVComposeError("vllm serve takes a preset name and its arguments (JSON), not a Pipeline object")
    kw = engine_kwargs(pipeline, budget, interval=interval, block_size=block_size, seed=seed,
                       preset_args=preset_args, query_window=query_window, log_file=log_file, reserve=reserve)
    return ["--scheduler-cls", kw["scheduler_cls"], "--worker-cls", kw["worker_cls"],
            "--logits-processors", ADMISSION_CLS,
            "--block-size", str(block_size), "--no-enable-prefix-caching", "--no-async-scheduling",
            "--additional-config", json.dumps(kw["additional_config"], sort_keys=True)]
