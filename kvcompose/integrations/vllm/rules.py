"""What the vLLM scheduler and worker agree on, without a message: the settings of a request, the refusals, the
compression-event rule and which blocks survive an event. Pure Python (and pickle for pipelines): nothing here
imports vLLM, so both engine processes and the user's process use the same functions.

Two counts per request (docs/serving.md, "Design"): vLLM's logical `num_computed_tokens` (tokens seen; the
positions RoPE uses) and the physical `held` (tokens in the request's blocks, the kept ones packed first).
The rule is `KVComposeCache`'s schedule: an event is due when the decoded count crosses a multiple of
`interval` and the request holds more than `budget` tokens; it cuts every layer and KV head to exactly
`budget`.
"""

from __future__ import annotations

import base64
import json
import pickle
from dataclasses import dataclass
from typing import Any

from ...block import EventTrigger, LayerSchedule
from ...pipeline import Pipeline
from ...seeding import check_seed, derived_seed
from ...view import KVComposeError

__all__ = ["CONFIG_KEY", "Settings", "engine_settings", "request_settings", "check_pipeline", "check_blocks",
           "event_due", "keep_blocks", "blocks_to_free", "kept_row", "encode_pipeline", "decode_pipeline", "layer_seed", "DEFAULT_INTERVAL",
           "DEFAULT_QUERY_WINDOW"]

CONFIG_KEY = "kvcompose"
"""Key of kvcompose's settings in vLLM's `additional_config` and in a request's `SamplingParams.extra_args`."""

DEFAULT_INTERVAL = 64  # as KVComposeCache, when the pipeline names no interval of its own
DEFAULT_QUERY_WINDOW = 64  # the largest window of a shipped preset (VaSE); the ring must hold what requests ask


def encode_pipeline(pipeline: Pipeline) -> str:
    """A pipeline as text for vLLM's `additional_config` / `extra_args` (base64 of its pickle: the engine's
    processes rebuild the same blocks; custom blocks must be importable there)."""
    if not isinstance(pipeline, Pipeline):
        raise KVComposeError(f"pipeline must be a kvcompose Pipeline, got {type(pipeline).__name__}")
    return base64.b64encode(pickle.dumps(pipeline)).decode("ascii")


def decode_pipeline(text: str) -> Pipeline:
    """Inverse of `encode_pipeline`."""
    try:
        p = pickle.loads(base64.b64decode(text.encode("ascii")))
    except Exception as e:  # noqa: BLE001 - any decoding failure is a bad setting
        raise KVComposeError(f"could not rebuild the kvcompose pipeline from the engine settings: {e}") from e
    if not isinstance(p, Pipeline):
        raise KVComposeError(f"the engine settings hold a {type(p).__name__}, not a kvcompose Pipeline")
    return p


def _preset(name: str, args: dict[str, Any] | None) -> Pipeline:
    from ...methods import PRESETS

    if name not in PRESETS:
        raise KVComposeError(f"unknown kvcompose preset {name!r}; choose one of {sorted(PRESETS)}")
    try:
        return PRESETS[name](**(args or {}))
    except TypeError as e:
        raise KVComposeError(f"preset {name!r} does not take the arguments {args}: {e}") from e


def check_pipeline(pipeline: Pipeline) -> None:
    """Refuse, with the reason, a pipeline whose blocks need what a vLLM engine cannot give them."""
    name = repr(pipeline)
    if pipeline.observers:
        kinds = ", ".join(type(pipeline.leaves[i]).__name__ for i in pipeline.observers)
        raise KVComposeError(
            f"{name} observes every attention step ({kinds}: e.g. H2O's accumulated attention of every query); "
            "vLLM's fused attention kernels return no attention weights, so kvcompose's vLLM route cannot run it"
        )
    if pipeline.channels:
        raise KVComposeError(f"{name} keeps per-token state; kvcompose's vLLM route holds none")
    if pipeline.tier.holds_tokens:
        raise KVComposeError(
            f"{name} keeps evicted tokens in a tier ({pipeline.tier!r}); vLLM can only reload host blocks as the "
            "prefix of a new request (docs/serving.md, 'The host tier'): use Evict()"
        )
    alloc = pipeline.allocator
    if isinstance(alloc, EventTrigger) or not alloc.uniform:
        raise KVComposeError(
            f"{name} gives heads or requests their own budgets ({alloc!r}); in vLLM every layer and KV head of a "
            "request keeps the same number of tokens (one block table), so use a uniform allocator"
        )
    if isinstance(alloc, LayerSchedule):
        raise KVComposeError(
            f"{name} gives each layer its own budget ({alloc!r}); vLLM's attention reads one length per request "
            "for every layer, so the block table would hold the largest layer's budget and save nothing over a "
            "uniform budget at that size: refused (docs/serving.md, 'Per-layer budgets')"
        )
    if not alloc.needs_budget:
        raise KVComposeError(f"{name} derives budgets without one ({alloc!r}); the vLLM route needs a fixed budget")
    if pipeline.selector is not None and pipeline.selector.ragged:
        raise KVComposeError(
            f"{name} keeps different counts per head ({pipeline.selector!r}); the vLLM route packs exactly the "
            "budget per head, token by token, so whole blocks buy nothing there: use the token-level selector"
        )


def check_blocks(budget: int, interval: int, block_size: int) -> None:
    """Budgets and intervals must be whole blocks; name the block-aligned values around a bad one."""
    for what, n in (("budget", budget), ("interval", interval)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise KVComposeError(f"{what} must be a positive int, got {n!r}")
        if n % block_size:
            lo = n // block_size * block_size
            alt = f"{lo} or {lo + block_size}" if lo else f"{block_size}"
            raise KVComposeError(
                f"{what}={n} is not a whole number of vLLM blocks of {block_size} tokens: kvcompose does not round "
                f"it for you; use {alt}"
            )


@dataclass(frozen=True)
class Settings:
    """One request's compression settings (the engine's, or the request's own `extra_args` override).

    Attributes:
        pipeline: the method (a `Pipeline`; `compresses` False: the full cache).
        budget: tokens every layer and KV head keeps after an event (whole blocks); None without compression.
        interval: decoded tokens between events (whole blocks).
        seed: seeds the request's per-layer generators (`layer_seed`).
    """

    pipeline: Pipeline
    budget: int | None
    interval: int
    seed: int

    @property
    def compresses(self) -> bool:
        return self.pipeline.compresses

    @property
    def query_window(self) -> int:
        return self.pipeline.query_window if self.compresses else 0


def _build(cfg: dict[str, Any], block_size: int, base: Settings | None) -> Settings:
    unknown = set(cfg) - {"pipeline", "preset", "args", "budget", "interval", "seed"}
    if unknown:
        raise KVComposeError(f"unknown kvcompose settings {sorted(unknown)}")
    if "pipeline" in cfg and "preset" in cfg:
        raise KVComposeError("give either a pipeline or a preset name, not both")
    if "pipeline" in cfg:
        pipeline = decode_pipeline(cfg["pipeline"])
    elif "preset" in cfg:
        pipeline = _preset(cfg["preset"], cfg.get("args"))
    elif base is not None:
        pipeline = base.pipeline
    else:
        raise KVComposeError("kvcompose settings name no pipeline: give `preset` (and `args`) or a Pipeline")
    if "args" in cfg and "preset" not in cfg:
        raise KVComposeError("`args` are the arguments of a preset: give `preset` too")
    budget = cfg.get("budget", base.budget if base is not None else None)
    interval = cfg.get("interval")
    if interval is None:  # as KVComposeCache: the pipeline's own; a request that keeps the engine's pipeline
        new = "pipeline" in cfg or "preset" in cfg  # keeps the engine's interval too
        interval = base.interval if base is not None and not new else (pipeline.interval or DEFAULT_INTERVAL)
    seed = cfg.get("seed", base.seed if base is not None else 0)
    seed = check_seed(seed, "kvcompose seed")
    if pipeline.compresses:
        check_pipeline(pipeline)
        if budget is None:
            raise KVComposeError(f"{pipeline!r} compresses and needs a token budget")
        check_blocks(budget, interval, block_size)
        pipeline.validate(budget)
    else:
        budget = None
    return Settings(pipeline=pipeline, budget=budget, interval=int(interval), seed=int(seed))


def engine_settings(cfg: dict[str, Any], block_size: int) -> Settings:
    """The engine's default `Settings` from `additional_config["kvcompose"]` (less its engine-only keys)."""
    cfg = {k: v for k, v in cfg.items() if k not in ("query_window", "log_file", "block_size")}
    return _build(cfg, block_size, None)


def request_settings(extra_args: dict[str, Any] | None, block_size: int, base: Settings) -> Settings:
    """A request's `Settings`: its `extra_args["kvcompose"]` override (a dict, or its JSON text) on top of the
    engine's `base`."""
    cfg = (extra_args or {}).get(CONFIG_KEY)
    if not cfg:
        return base
    if isinstance(cfg, str):  # the OpenAI server's `vllm_xargs` take flat values: the settings as JSON text
        try:
            cfg = json.loads(cfg)
        except ValueError as e:
            raise KVComposeError(f"extra_args[{CONFIG_KEY!r}] is not JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise KVComposeError(f"extra_args[{CONFIG_KEY!r}] must be a dict (or its JSON), got {type(cfg).__name__}")
    return _build(dict(cfg), block_size, base)


def layer_seed(seed: int, layer_idx: int) -> int:
    """The seed of a request's generator for one layer: `KVComposeCache(seed=seed)`'s rule."""
    return derived_seed(seed, layer_idx)


def event_due(prompt_len: int, before: int, now: int, interval: int, held: int, budget: int | None) -> bool:
    """Whether a compression event runs at the start of a step, before its forward.

    `before` and `now` are the request's logical counts (vLLM's `num_computed_tokens`) at the previous step
    it was scheduled in and at this one; `held` the tokens it holds now. `KVComposeCache` evaluates the same
    after each forward: the decoded count `seen - prompt` crossed a multiple of `interval` in that forward
    (never in the prompt's own), and a row holds more than `budget`.
    """
    if budget is None or held <= budget:
        return False
    decoded = now - prompt_len
    if decoded <= 0:
        return False
    return decoded // interval != (before - prompt_len) // interval


def keep_blocks(n_real: int, n_computed: int, budget: int, block_size: int) -> tuple[int, bool]:
    """Which of a request's real (non-null) blocks survive an event, in logical order: the first
    `budget / block_size` (they receive the kept tokens) and, when `n_computed` is not block aligned, the
    last one (the block of logical position `n_computed`, which the step writes into at physical position
    `budget`). Returns `(leading, keep_last)`.

    Blocks allocated for this step after the event (vLLM's `allocate_slots`) are kept as well; the scheduler
    sees them already, the worker appends them after the event.
    """
    lead = budget // block_size
    keep_last = n_computed % block_size != 0
    if n_real < lead + (1 if keep_last else 0):
        raise KVComposeError(
            f"kvcompose: a request holds {n_real} blocks at an event, fewer than the {lead} the budget needs "
            "(the scheduler and the worker disagree on its counts)"
        )
    return lead, keep_last


def blocks_to_free(real: list[int], n_computed: int, budget: int, block_size: int) -> list[int]:
    """The scheduler's side of `keep_blocks`: of a request's real blocks (their logical indices, ascending,
    this step's new ones included), those to return to the pool at an event."""
    lead, _ = keep_blocks(len(real), n_computed, budget, block_size)
    first_written = n_computed // block_size
    return [j for j in real[lead:] if j < first_written]


def kept_row(row: list[int], n_computed: int, budget: int, block_size: int) -> list[int]:
    """The worker's side of `keep_blocks`: its block-table row (physical order, before this step's new blocks
    are appended) after an event."""
    lead, keep_last = keep_blocks(len(row), n_computed, budget, block_size)
    return row[:lead] + (row[-1:] if keep_last else [])


def dumps(cfg: dict[str, Any]) -> str:
    """The settings as JSON (what `vllm serve --additional-config` takes)."""
    return json.dumps({CONFIG_KEY: cfg}, sort_keys=True)
