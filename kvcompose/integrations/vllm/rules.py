"""What the vLLM scheduler and worker agree on, without a message: the settings of a request, the refusals, the
compression-event rule and which blocks survive an event. Pure Python (and pickle for pipelines): nothing here
imports vLLM, so both engine processes and the user's process use the same functions.

Settings: `engine_limits` reads an engine's `additional_config["kvcompose"]` into an `Engine` (its default
`Settings`, block size, query ring and `max_model_len`); `request_settings` checks a request's own settings
against it and raises `KVComposeError` naming the problem for anything the engine would not honour exactly.
The front end (`admission.py`), the scheduler and the worker all run that same check, so a request the front
end accepts is accepted everywhere, and one refused anywhere is refused with the same message.

Two counts per request (docs/serving.md, "Design"): vLLM's logical `num_computed_tokens` (tokens seen; the
positions RoPE uses) and the physical `held` (tokens in the request's blocks, the kept ones packed first).
The rule is `KVComposeCache`'s schedule: an event is due when the decoded count crosses a multiple of
`interval` and the request holds more than `budget` tokens; it cuts every layer and KV head to exactly
`budget`. With per-layer budgets (an allocator with a `LayerSchedule`: PyramidKV, ReasonAlloc's layer
profile) each layer keeps its own count inside the blocks of the largest (`Settings.held_bound`): the
scheduler frees by that bound with the same rule, and the worker compresses each layer at the same boundaries
when it holds more than its own budget, as `KVComposeCache` does. With per-head counts (`HeadUtility`, a ragged
selector) each KV head keeps its own count inside the blocks of the most one head can keep (`held_bound` with
the model's KV heads).
"""

from __future__ import annotations

import base64
import json
import pickle
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ...allocators.base import layer_budget
from ...block import EventTrigger, LayerSchedule
from ...pipeline import Pipeline
from ...seeding import check_seed, derived_seed
from ...view import KVComposeError

__all__ = ["CONFIG_KEY", "Settings", "Engine", "engine_settings", "engine_limits", "request_settings",
           "runnable_presets", "check_pipeline", "check_blocks", "event_due", "keep_blocks", "blocks_to_free", "kept_row",
           "encode_pipeline", "decode_pipeline", "layer_seed", "DEFAULT_INTERVAL", "DEFAULT_QUERY_WINDOW",
           "MAX_SETTINGS_TEXT", "FAILED_ATTR", "TRACKED_ATTR"]

CONFIG_KEY = "kvcompose"
"""Key of kvcompose's settings in vLLM's `additional_config` and in a request's `SamplingParams.extra_args`."""

FAILED_ATTR = "kvcompose_failed"
"""Attribute the worker sets on a step's `ModelRunnerOutput`: `{request id: message}` of the requests whose
kvcompose work failed in that step (the scheduler finishes each alone with an error)."""
TRACKED_ATTR = "kvcompose_tracked"
"""Attribute the scheduler sets on a `SchedulerOutput`: how many requests it keeps kvcompose state for after
that step (the worker reports the last one in `kvcompose_state`)."""

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
        raise KVComposeError(f"could not rebuild the kvcompose pipeline from its settings: {_show(str(e))[1:-1]}") from e
    if not isinstance(p, Pipeline):
        raise KVComposeError(f"the engine settings hold a {type(p).__name__}, not a kvcompose Pipeline")
    return p


def _show(x: Any, n: int = 80) -> str:
    """A bounded repr of a value a client sent (error messages never echo more than `n` characters)."""
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


@lru_cache(maxsize=None)
def runnable_presets() -> dict[str, str | None]:
    """Every preset of `kvcompose.methods.PRESETS` with None when the vLLM route runs it (built with its
    defaults), else the reason it is refused. A preset is refused by name before it is built with a request's
    arguments: a client's arguments never reach a preset the engine cannot run (e.g. a profile path)."""
    from ...methods import PRESETS

    out: dict[str, str | None] = {}
    for name, fn in sorted(PRESETS.items()):
        try:
            p = fn()
            if p.compresses:
                check_pipeline(p)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - any reason makes the preset unrunnable here
            out[name] = str(e)
    return out


def _preset(name: Any, args: Any) -> Pipeline:
    if not isinstance(name, str):
        raise KVComposeError(f"`preset` must be a preset name (a str), got {_show(name)} ({type(name).__name__})")
    presets = runnable_presets()
    if name not in presets:
        raise KVComposeError(f"unknown kvcompose preset {_show(name)}; choose one of "
                             f"{sorted(k for k, v in presets.items() if v is None)}")
    if presets[name] is not None:
        raise KVComposeError(f"preset {name!r} cannot run in vLLM: {presets[name]}")
    if args is not None and not isinstance(args, dict):
        raise KVComposeError(f"`args` of preset {name!r} must be a dict of its keyword arguments, got "
                             f"{_show(args)} ({type(args).__name__})")
    if args and not all(isinstance(k, str) for k in args):
        raise KVComposeError(f"`args` of preset {name!r} must have str keys, got {_show(list(args))}")
    from ...methods import PRESETS

    try:
        p = PRESETS[name](**(args or {}))
    except Exception as e:  # noqa: BLE001 - a preset refusing its arguments refuses the settings
        raise KVComposeError(f"preset {name!r} does not take the arguments {_show(args, 200)}: "
                             f"{_show(str(e), 300)[1:-1]}") from e
    if not isinstance(p, Pipeline):  # pragma: no cover - every preset returns a Pipeline
        raise KVComposeError(f"preset {name!r} returned a {type(p).__name__}, not a Pipeline")
    return p


def check_pipeline(pipeline: Pipeline) -> None:
    """Refuse, with the reason, a pipeline whose blocks need what a vLLM engine cannot give them. Mergers run:
    the worker packs the merged values the pipeline returns (`Selection.values`)."""
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
    if isinstance(alloc, EventTrigger):
        raise KVComposeError(
            f"{name} gives requests their own budgets that grow while decoding ({alloc!r}); vLLM's scheduler frees "
            "blocks by a bound it computes itself, and this allocator decides from the data when a request takes "
            "more (docs/serving.md, 'Memory tiers, GrowPage: what vLLM would need')"
        )
    if not alloc.uniform and not hasattr(alloc, "head_bound"):
        raise KVComposeError(
            f"{name} gives heads their own budgets ({alloc!r}) without a bound on what one head can keep "
            "(`head_bound`); the vLLM scheduler frees blocks by that bound (docs/serving.md, 'Per-layer and "
            "per-head budgets')"
        )
    if isinstance(alloc, LayerSchedule) and not getattr(alloc, "static_schedule", False):
        raise KVComposeError(
            f"{name} gives layers budgets that depend on what it observes while decoding ({alloc!r}); vLLM's "
            "scheduler frees blocks by rules it computes itself, so per-layer budgets must be a static schedule "
            "(Pyramid, ReasoningWave)"
        )
    if not alloc.needs_budget:
        raise KVComposeError(f"{name} derives budgets without one ({alloc!r}); the vLLM route needs a fixed budget")


def head_bounds(pipeline: Pipeline, num_layers: int, budget: int, heads: int | None) -> list[int]:
    """The most tokens one KV head can keep, per layer (`num_layers` ints), at mean budget `budget`: the layer's
    budget; for a ragged selector (`Selector.head_bound`) the layer's total less the other heads' floors when every
    head's budget is the layer's, else the layer's total `heads * b`; for a head-wise allocator its `head_bound`.
    What the vLLM scheduler reserves blocks for (`Settings.held_bound`, rounded up to blocks)."""
    alloc = pipeline.allocator
    budgets = [int(b) for b in alloc.layer_budgets(num_layers, budget)]
    if pipeline.selector is not None and pipeline.selector.ragged:
        return [int(pipeline.selector.head_bound(b, heads)) if alloc.uniform else heads * b for b in budgets]
    if not alloc.uniform:
        return [int(alloc.head_bound(b, heads)) for b in budgets]
    return budgets


def _held_bound(pipeline: Pipeline, num_layers: int, budget: int, block_size: int, heads: int | None) -> int:
    top = max(head_bounds(pipeline, num_layers, budget, heads))
    return -(-top // block_size) * block_size


def check_blocks(budget: Any, interval: Any, block_size: int, max_model_len: int | None = None) -> None:
    """Budgets and intervals must be whole blocks (name the block-aligned values around a bad one) and, when the
    engine's `max_model_len` is known, below it (a larger one could never act)."""
    for what, n in (("budget", budget), ("interval", interval)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise KVComposeError(f"{what} must be a positive int, got {_show(n)}")
        if n % block_size:
            lo = n // block_size * block_size
            alt = f"{lo} or {lo + block_size}" if lo else f"{block_size}"
            raise KVComposeError(
                f"{what}={n} is not a whole number of vLLM blocks of {block_size} tokens: kvcompose does not round "
                f"it for you; use {alt}"
            )
        if max_model_len is not None and n >= max_model_len:
            raise KVComposeError(
                f"{what}={n} cannot act: the engine's requests hold at most max_model_len={max_model_len} tokens, "
                f"so {'no event would ever cut them' if what == 'budget' else 'no event would ever be due'}; use "
                f"less than {max_model_len}"
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

    @property
    def per_layer(self) -> bool:
        """Whether the layers (or heads) keep their own budgets: the allocator is a `LayerSchedule`, or heads keep
        their own counts (`per_head`)."""
        return self.compresses and (isinstance(self.pipeline.allocator, LayerSchedule) or self.per_head)

    @property
    def per_head(self) -> bool:
        """Whether the KV heads of a layer keep their own counts: a head-wise allocator (`HeadUtility`) or a
        ragged selector (AdaKV's `CompositeTokens(structured=False)`)."""
        p = self.pipeline
        return self.compresses and (not p.allocator.uniform or (p.selector is not None and p.selector.ragged))

    def layer_budgets(self, num_layers: int, seen: int) -> list[int]:
        """Every layer's budget after `seen` tokens, as `KVComposeCache` computes it at an event."""
        if not self.per_layer:
            return [self.budget] * num_layers
        alloc = self.pipeline.allocator
        return [int(layer_budget(alloc, i, num_layers, self.budget, seen)) for i in range(num_layers)]

    def check_layers(self, hf_config: Any, num_layers: int, num_kv_heads: int) -> None:
        """Per-layer budgets: bind the allocator to the served model (a profile calibrated on another
        architecture is refused, `profile="auto"` takes the shipped profile of this architecture; vLLM's side
        has no weights to compare, so two models of one shape are not told apart here) and check that every
        layer's budget holds what the protectors keep (`KVComposeCache`'s checks). Nothing without them."""
        if not self.per_layer:
            return
        alloc = self.pipeline.allocator
        if hf_config is not None and hasattr(alloc, "bind_model"):
            alloc.bind_model(hf_config)
        alloc.check(self.pipeline, self.budget, num_layers, num_kv_heads)

    def held_bound(self, num_layers: int, block_size: int, heads: int | None = None) -> int:
        """The tokens a request keeps in its blocks after an event (whole blocks): the budget, or with
        per-layer budgets the largest layer's static budget rounded up to whole blocks (a layer's budget never
        exceeds its static one: ReasonAlloc's cap only lowers budgets while fewer tokens were seen), or with
        per-head counts the most one head can keep in any layer (`heads`: the model's KV heads; `HeadUtility`:
        `heads * b - (heads - 1) * floor`; a ragged selector: `Selector.head_bound`, the layer's total `heads * b`
        less the floor every other head keeps, AdaKV's `CompositeTokens(structured=False, floor=0.2)`)."""
        if not self.per_layer:
            return self.budget
        if self.per_head and heads is None:
            raise KVComposeError("per-head budgets: the bound needs the model's number of KV heads")
        return _held_bound(self.pipeline, num_layers, self.budget, block_size, heads)


@dataclass(frozen=True)
class Engine:
    """What a request's settings are checked against: the engine's own settings and its limits.

    Attributes:
        base: the engine's `Settings` (what a request does not name).
        block_size: vLLM's block size (budgets and intervals are whole blocks).
        query_window: W, the queries per layer and request the worker's ring keeps (a request's pipeline may
            read at most W).
        max_model_len: the engine's longest request (None when unknown: `engine_kwargs` has no model).
        notes: engine settings that have no effect (each "what has no effect: why"); the engine warns.
        reserve: the scheduler admits by each request's bound (see `KVComposeScheduler`), else as vLLM does.
    """

    base: Settings
    block_size: int
    query_window: int
    max_model_len: int | None = None
    notes: tuple[str, ...] = ()
    reserve: bool = True


_KEYS = ("pipeline", "preset", "args", "budget", "interval", "seed")
_ENGINE_KEYS = ("query_window", "log_file", "block_size", "reserve")
MAX_SETTINGS_TEXT = 1 << 16
"""Longest JSON text of a request's settings (characters): a preset, its arguments and four numbers."""


def _build(cfg: dict[str, Any], block_size: int, base: Settings | None, max_model_len: int | None = None,
           notes: list[str] | None = None) -> Settings:
    """Settings from `cfg` on top of `base` (None: the engine's own). A setting that has no effect is refused
    for a request (a client cannot see a warning) and noted in `notes` for the engine (which warns)."""
    if not all(isinstance(k, str) for k in cfg):
        raise KVComposeError(f"kvcompose settings have non-str keys: {_show([k for k in cfg if not isinstance(k, str)])}")
    unknown = set(cfg) - set(_KEYS)
    if unknown:
        raise KVComposeError(f"unknown kvcompose settings {_show(sorted(unknown))}; the settings are {list(_KEYS)}")
    if "pipeline" in cfg and "preset" in cfg:
        raise KVComposeError("give either a pipeline or a preset name, not both")
    if "args" in cfg and "preset" not in cfg:
        raise KVComposeError("`args` are the arguments of a preset: give `preset` too")
    if "pipeline" in cfg:
        if not isinstance(cfg["pipeline"], str):
            raise KVComposeError(f"`pipeline` must be the text of encode_pipeline, got {type(cfg['pipeline']).__name__}")
        pipeline = decode_pipeline(cfg["pipeline"])
    elif "preset" in cfg:
        pipeline = _preset(cfg["preset"], cfg.get("args"))
    elif base is not None:
        pipeline = base.pipeline
    else:
        raise KVComposeError("kvcompose settings name no pipeline: give `preset` (and `args`) or a Pipeline")
    new = "pipeline" in cfg or "preset" in cfg
    whose = "its" if new or base is None else "the engine's"
    if "seed" in cfg and (isinstance(cfg["seed"], bool) or not isinstance(cfg["seed"], int)):
        raise KVComposeError(f"seed must be an int, got {_show(cfg['seed'])} ({type(cfg['seed']).__name__})")
    seed = check_seed(cfg["seed"], "seed") if "seed" in cfg else (base.seed if base is not None else 0)
    if not pipeline.compresses:
        lost = [f"{k}={_show(cfg[k])}" for k in ("budget", "interval") if k in cfg and cfg[k] is not None]
        if seed and (base is None or "seed" in cfg):
            lost.append(f"seed={seed}")
        if lost:
            why = f"{whose} pipeline {pipeline!r} never compresses (it keeps every token)"
            if base is not None:  # a request: refused, with the reason
                raise KVComposeError(f"{', '.join(lost)} cannot act: {why}")
            if notes is not None:
                notes.extend(f"{x} has no effect: {why}" for x in lost)
        return Settings(pipeline=pipeline, budget=None, interval=base.interval if base is not None else DEFAULT_INTERVAL,
                        seed=seed)
    budget = cfg.get("budget", base.budget if base is not None else None)
    interval = cfg.get("interval")
    if interval is None:  # as KVComposeCache: the pipeline's own; a request that keeps the engine's pipeline
        interval = base.interval if base is not None and not new else (pipeline.interval or DEFAULT_INTERVAL)
    check_pipeline(pipeline)
    if budget is None:
        raise KVComposeError(f"{pipeline!r} compresses and needs a token budget")
    check_blocks(budget, interval, block_size, max_model_len)
    pipeline.validate(budget)
    if seed and not pipeline.draws_random and (base is None or "seed" in cfg):
        why = f"no block of {whose} pipeline {pipeline!r} draws random numbers"
        if base is not None:  # a request: refused, with the reason
            raise KVComposeError(f"seed={seed} cannot act: {why}")
        if notes is not None:
            notes.append(f"seed={seed} has no effect: {why}")
    return Settings(pipeline=pipeline, budget=int(budget), interval=int(interval), seed=int(seed))


def engine_settings(cfg: dict[str, Any], block_size: int, max_model_len: int | None = None,
                    notes: list[str] | None = None) -> Settings:
    """The engine's default `Settings` from `additional_config["kvcompose"]` (less its engine-only keys);
    settings that have no effect are appended to `notes`."""
    if not isinstance(cfg, dict):
        raise KVComposeError(f"additional_config[{CONFIG_KEY!r}] must be a dict, got {type(cfg).__name__}")
    cfg = {k: v for k, v in cfg.items() if k not in _ENGINE_KEYS}
    return _build(cfg, block_size, None, max_model_len, notes)


def engine_limits(cfg: dict[str, Any], block_size: int, max_model_len: int | None = None) -> Engine:
    """The engine's `Engine` (settings and limits) from `additional_config["kvcompose"]`: what the scheduler,
    the worker and the front end's request check all derive from the same config."""
    notes: list[str] = []
    base = engine_settings(cfg, block_size, max_model_len, notes)
    window = cfg.get("query_window")
    if window is None:
        window = max(DEFAULT_QUERY_WINDOW, base.query_window)
    if isinstance(window, bool) or not isinstance(window, int) or window < base.query_window:
        raise KVComposeError(f"query_window must be an int >= the pipeline's window {base.query_window}, got "
                             f"{_show(window)}")
    if max_model_len is not None and window > max_model_len:
        raise KVComposeError(f"query_window={window} is more queries than a request of max_model_len={max_model_len} "
                             f"has: use at most {max_model_len}")
    log = cfg.get("log_file")
    if log is not None and not isinstance(log, str):
        raise KVComposeError(f"log_file must be a path (str), got {type(log).__name__}")
    reserve = cfg.get("reserve", True)
    if not isinstance(reserve, bool):
        raise KVComposeError(f"reserve must be True or False, got {_show(reserve)}")
    return Engine(base=base, block_size=block_size, query_window=window, max_model_len=max_model_len,
                  notes=tuple(notes), reserve=reserve)


def request_settings(extra_args: Any, engine: Engine) -> Settings:
    """A request's `Settings`: its `SamplingParams.extra_args["kvcompose"]` on top of the engine's. The settings
    are a dict (Python callers: `request_kwargs`) or its JSON text (the OpenAI server's `vllm_xargs` take flat
    values). Raises `KVComposeError` naming the problem for anything the engine would not honour exactly: a
    wrong type or range, an unknown key or preset, a budget or interval that is not whole blocks or cannot act,
    a pipeline the engine cannot run, a query window larger than the engine's ring. A pickled pipeline
    (`pipeline`) is taken from a dict only: JSON text is what a network client sends, and unpickling it would
    run the client's code in the engine."""
    if extra_args is None:
        return engine.base
    if not isinstance(extra_args, dict):
        raise KVComposeError(f"SamplingParams.extra_args must be a dict, got {type(extra_args).__name__}")
    if CONFIG_KEY not in extra_args or extra_args[CONFIG_KEY] is None:
        return engine.base
    cfg = extra_args[CONFIG_KEY]
    text = isinstance(cfg, str)
    if text:
        if len(cfg) > MAX_SETTINGS_TEXT:
            raise KVComposeError(f"extra_args[{CONFIG_KEY!r}] is {len(cfg)} characters of JSON; kvcompose settings "
                                 f"take at most {MAX_SETTINGS_TEXT}")
        try:
            cfg = json.loads(cfg)
        except (ValueError, RecursionError) as e:
            raise KVComposeError(f"extra_args[{CONFIG_KEY!r}] is not JSON: {_show(str(e))[1:-1]}") from None
    if not isinstance(cfg, dict):
        raise KVComposeError(f"extra_args[{CONFIG_KEY!r}] must be a dict (or its JSON text) of kvcompose settings, "
                             f"got {type(cfg).__name__} {_show(cfg, 40)}")
    if text and "pipeline" in cfg:
        raise KVComposeError("a pickled pipeline is taken only from Python (extra_args as a dict), not from JSON "
                             "text, which is what a network client sends: name a preset")
    s = _build(dict(cfg), engine.block_size, engine.base, engine.max_model_len)
    if s.query_window > engine.query_window:
        raise KVComposeError(f"{s.pipeline!r} reads the last {s.query_window} queries; the engine's query ring holds "
                             f"{engine.query_window} (raise query_window in engine_kwargs)")
    return s


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
