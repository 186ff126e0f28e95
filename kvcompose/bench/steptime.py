"""The cost of one decode step: does it grow with tokens seen, and what does the cache add per layer?

`kvcompose bench steptime` answers two questions of issue 14 with medians of many single steps, measured
interleaved (one step of each contender in turn), so that load on a shared machine hits all alike:

1. **Flat in tokens seen.** A compressed cache holds about `budget` tokens whatever it has seen, so a decode
   step after 16k tokens should cost what it costs after 1k (within 5%). For each preset, one cache per
   checkpoint (default 1k, 4k, 16k tokens seen) is brought there cheaply, by feeding random tokens in chunks
   of the preset's interval (each chunk is one forward; the cache compresses after every chunk as it would
   after every `interval` decoded tokens), then the caches decode in turn and the step time is the median.
   Reported: `step(4k) / step(1k)` and `step(16k) / step(1k)`; anything that grows with tokens seen (masks
   or padding bookkeeping over all seen positions, index tensors, Python lists) shows up here.
2. **Per-layer overhead.** On a deep, narrow random model (default 30 layers of width 64, where the weights
   cost almost nothing and what is left is per-layer Python and kernel-launch overhead, the regime a GPU
   exposes), the step time of kvcompose's `full` pipeline against `DynamicCache` with sdpa at equal held
   tokens, and of each preset against the ideal sliding-window cache of its budget, in microseconds per layer.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..view import KVComposeError
from .speed import _set_attn, _sync, full_cache, held_tokens, ideal_cache

__all__ = ["StepTimeConfig", "fill", "time_steps", "run_steptime", "steptime_markdown", "deep_model"]


def deep_model(layers: int = 30, width: int = 64, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    """The deep, narrow random Llama of the per-layer overhead measurement (`kvcompose.testing.tiny_model`)."""
    from ..testing import tiny_model

    if width % heads:
        raise KVComposeError(f"width {width} is not a multiple of heads {heads}")
    return tiny_model("llama", layers=layers, heads=heads, kv_heads=kv_heads, head_dim=width // heads, vocab=128,
                      seed=seed)


@torch.no_grad()
def fill(model, cache, tokens: int, chunk: int, attn: str, *, generator: torch.Generator,
         vocab: int | None = None) -> torch.Tensor:
    """Feed `tokens` random token ids into `cache`, `chunk` tokens per forward; returns the next token `[1, 1]`.

    Positions and the 2-D attention mask are the ones `generate` would pass."""
    if tokens < 1 or chunk < 1:
        raise KVComposeError(f"tokens and chunk must be >= 1, got {tokens}, {chunk}")
    vocab = vocab or model.config.get_text_config(decoder=True).vocab_size
    device = next(model.parameters()).device
    _set_attn(model, attn)
    seen = 0
    out = None
    while seen < tokens:
        n = min(chunk, tokens - seen)
        ids = torch.randint(3, vocab, (1, n), generator=generator).to(device)
        out = model(input_ids=ids, attention_mask=torch.ones(1, seen + n, dtype=torch.long, device=device),
                    position_ids=torch.arange(seen, seen + n, device=device)[None], past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        seen += n
    return out.logits[:, -1].argmax(-1, keepdim=True)


@dataclass
class _State:
    name: str
    cache: Any
    attn: str
    tok: torch.Tensor
    seen: int
    times: list[float] = field(default_factory=list)
    held: list[int] = field(default_factory=list)


@torch.no_grad()
def time_steps(model, states: list[_State], steps: int, warmup: int = 3) -> None:
    """Decode `warmup + steps` greedy steps with every state in turn (the order rotates every round); the last
    `steps` step times (seconds) go to `state.times`, the held lengths after them to `state.held`."""
    device = next(model.parameters()).device
    n = len(states)
    for i in range(warmup + steps):
        for s in states[i % n:] + states[: i % n]:  # rotate the order: no state always runs first or last
            _set_attn(model, s.attn)
            am = torch.ones(1, s.seen + 1, dtype=torch.long, device=device)
            pos = torch.tensor([[s.seen]], device=device)
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=s.tok, attention_mask=am, position_ids=pos, past_key_values=s.cache, use_cache=True,
                        logits_to_keep=1)
            s.tok = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            dt = time.perf_counter() - t0
            s.seen += 1
            if i >= warmup:
                s.times.append(dt)
                s.held.append(held_tokens(s.cache))


def _stats(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {"median_ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.fmean(times),
            "p10_ms": 1e3 * q[0], "p90_ms": 1e3 * q[-1], "steps": len(times)}


@dataclass
class StepTimeConfig:
    """Settings of `kvcompose bench steptime` (see `run_steptime`)."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    methods: list[str] | None = None
    budget: int = 512
    interval: int | None = None
    seen: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    steps: int = 100
    warmup: int = 3
    ideal: bool = True
    tiny: bool = False
    deep: bool = True
    deep_layers: int = 30
    deep_width: int = 64
    deep_held: int = 512
    deep_steps: int = 300
    tolerance: float = 0.05
    seed: int = 0
    threads: int | None = None
    out: str = "runs/steptime"
    command: str = ""


def _kvc(model, method: str, budget: int | None, interval: int | None, seed: int):
    from ..cache import KVComposeCache
    from ..methods import preset

    kw = {} if interval is None else {"interval": interval}
    cache = KVComposeCache(model, preset(method, budget=budget), budget=budget, seed=seed, **kw)
    return cache, model.config._attn_implementation


def _sweep(model, cfg: StepTimeConfig, log, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Step time at each tokens-seen checkpoint, for the ideal cache and each preset."""
    gen = torch.Generator().manual_seed(cfg.seed)
    rows: list[dict[str, Any]] = []
    contenders: list[tuple[str, str, str | None, Callable]] = []
    if cfg.ideal:
        contenders.append((f"ideal (sliding window {cfg.budget}, sdpa)", "ideal", None,
                           lambda: (ideal_cache(model, cfg.budget), "sdpa")))
    for m in cfg.methods:
        contenders.append((m, "kvcompose", m, lambda m=m: _kvc(model, m, None if m == "full" else cfg.budget,
                                                                 cfg.interval, cfg.seed)))
    for name, kind, method, make in contenders:
        progress(f"steptime: filling {name} to {', '.join(map(str, cfg.seen))} tokens")
        try:
            states = []
            for s in cfg.seen:
                cache, attn = make()
                chunk = getattr(cache, "interval", None) or 512
                tok = fill(model, cache, s, chunk, attn, generator=gen)
                states.append(_State(f"{name}@{s}", cache, attn, tok, s))
            time_steps(model, states, cfg.steps, cfg.warmup)
        except Exception as e:  # noqa: BLE001 - one failing preset must not lose the others
            rows.append({"name": name, "kind": kind, "method": method, "error": f"{type(e).__name__}: {e}"})
            log(f"{name}: {type(e).__name__}: {e}")
            continue
        points = [{"seen": s, "held": held_tokens(st.cache), "held_min": min(st.held), "held_max": max(st.held),
                   **_stats(st.times)} for s, st in zip(cfg.seen, states)]
        base = points[0]["median_ms"]
        ratios = {str(p["seen"]): p["median_ms"] / base for p in points[1:]}
        rows.append({"name": name, "kind": kind, "method": method,
                     "interval": getattr(states[0].cache, "interval", None), "points": points, "ratios": ratios,
                     "flat": all(abs(r - 1) <= cfg.tolerance for r in ratios.values())})
        log(f"{name}: " + ", ".join(f"step({k})/step({cfg.seen[0]}) = {v:.3f}" for k, v in ratios.items()))
    return rows


def _deep(cfg: StepTimeConfig, log) -> dict[str, Any]:
    """Per-layer overhead on the deep, narrow model: kvcompose `full` vs DynamicCache at equal held tokens,
    each preset vs the ideal of its budget."""
    model = deep_model(cfg.deep_layers, cfg.deep_width, seed=cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    h = cfg.deep_held
    states: list[_State] = []
    meta: dict[str, dict[str, Any]] = {}

    def add(name: str, kind: str, cache, attn: str, tokens: int, chunk: int, vs: str | None, method=None):
        tok = fill(model, cache, tokens, chunk, attn, generator=gen)
        states.append(_State(name, cache, attn, tok, tokens))
        meta[name] = {"kind": kind, "vs": vs, "method": method}

    add("DynamicCache (sdpa)", "full", full_cache(model), "sdpa", h, 512, None)
    kc, attn = _kvc(model, "full", None, None, cfg.seed)
    add("full (kvcompose)", "kvcompose", kc, attn, h, 512, "DynamicCache (sdpa)", "full")
    ideal_name = f"ideal (sliding window {h}, sdpa)"
    add(ideal_name, "ideal", ideal_cache(model, h), "sdpa", 4 * h, 512, None)
    for m in cfg.methods:
        if m == "full":
            continue
        try:
            kc, attn = _kvc(model, m, h, cfg.interval, cfg.seed)
            add(m, "kvcompose", kc, attn, 4 * h, kc.interval, ideal_name, m)
        except Exception as e:  # noqa: BLE001
            log(f"deep {m}: {type(e).__name__}: {e}")
    time_steps(model, states, cfg.deep_steps, cfg.warmup)
    L = cfg.deep_layers
    by_name = {s.name: _stats(s.times) for s in states}
    rows = []
    for s in states:
        st = by_name[s.name]
        row = {"name": s.name, **meta[s.name], "held": held_tokens(s.cache), "held_min": min(s.held),
               "held_max": max(s.held), **st,
               "median_us_per_layer": 1e3 * st["median_ms"] / L}
        if meta[s.name]["vs"]:
            ref = by_name[meta[s.name]["vs"]]
            row["ratio"] = st["median_ms"] / ref["median_ms"]
            row["overhead_us_per_layer"] = 1e3 * (st["median_ms"] - ref["median_ms"]) / L
        rows.append(row)
    return {"layers": L, "width": cfg.deep_width, "heads": 4, "kv_heads": 2, "held": h, "steps": cfg.deep_steps,
            "rows": rows}


def run_steptime(cfg: StepTimeConfig, log=print) -> dict[str, Any]:
    """`kvcompose bench steptime`: writes `steptime.json` and `steptime.md` to `cfg.out`."""
    from .. import methods as _methods
    from .common import load_model, versions

    if cfg.methods is None:
        cfg.methods = [m for m in _methods.PRESETS if m != "full"]
    for m in cfg.methods:
        if m not in _methods.PRESETS:
            raise KVComposeError(f"unknown method {m!r}; presets: {', '.join(_methods.PRESETS)}")
    if len(cfg.seen) < 2 or sorted(cfg.seen) != list(cfg.seen) or cfg.seen[0] < 1:
        raise KVComposeError(f"seen must be at least two increasing token counts, got {cfg.seen}")
    if cfg.steps < 1 or cfg.deep_steps < 1:
        raise KVComposeError("steps and deep_steps must be >= 1")
    threads = cfg.threads or (1 if cfg.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if cfg.tiny:
        model, label = deep_model(cfg.deep_layers, cfg.deep_width, seed=cfg.seed), \
            f"random Llama, {cfg.deep_layers} layers of width {cfg.deep_width}"
    else:
        model, _ = load_model(cfg.model, cfg.dtype, cfg.device)
        label = cfg.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
    data: dict[str, Any] = {"config": {**cfg.__dict__, "model": label, "threads": torch.get_num_threads()},
                            "versions": versions(), "sweep": [], "deep": None,
                            "notes": ["Medians of single decode steps, the contenders of a table measured in turn "
                                      "(one step each) in one process; only ratios are claimed."]}
    data["sweep"] = _sweep(model, cfg, log, log)
    (out / "steptime.json").write_text(json.dumps(data, indent=1, default=str))
    if cfg.deep:
        log("steptime: per-layer overhead on the deep narrow model")
        data["deep"] = _deep(cfg, log)
    data["elapsed_s"] = time.perf_counter() - t0
    (out / "steptime.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "steptime.md").write_text(steptime_markdown(data))
    log(f"wrote {out}/steptime.json and steptime.md in {data['elapsed_s']:.0f}s")
    return data


def _held(p: dict[str, Any]) -> str:
    lo, hi = p.get("held_min", p["held"]), p.get("held_max", p["held"])
    return str(lo) if lo == hi else f"{lo}-{hi}"


def steptime_markdown(data: dict[str, Any]) -> str:
    """The Markdown report of a `steptime.json`."""
    cfg = data.get("config", {})
    seen = cfg.get("seen", [])
    lines = [f"# Decode step time against tokens seen: {cfg.get('model')}", "",
             f"Budget {cfg.get('budget')}; median of {cfg.get('steps')} steps per point; {cfg.get('threads')} "
             f"thread(s). Target: flat within {100 * cfg.get('tolerance', 0.05):.0f}%.", ""]
    head = "| row | interval | " + " | ".join(f"ms @ {s}" for s in seen) + " | " + \
        " | ".join(f"step({s})/step({seen[0]})" for s in seen[1:]) + " | flat |"
    lines += [head, "|" + "---|" * (3 + 2 * len(seen) - 1)]
    for r in data.get("sweep", []):
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} |")
            continue
        ms = " | ".join(f"{p['median_ms']:.2f} (held {_held(p)})" for p in r["points"])
        rat = " | ".join(f"{r['ratios'][str(s)]:.3f}" for s in seen[1:])
        lines.append(f"| {r['name']} | {r.get('interval') or '-'} | {ms} | {rat} | {'yes' if r['flat'] else 'no'} |")
    d = data.get("deep")
    if d:
        lines += ["", f"## Per-layer overhead: random Llama, {d['layers']} layers of width {d['width']} "
                      f"({d['heads']} heads, {d['kv_heads']} KV heads), {d['steps']} steps", "",
                  "| row | held | median step ms | us per layer | vs | ratio | overhead us per layer |",
                  "|---|---|---|---|---|---|---|"]
        for r in d["rows"]:
            lines.append(f"| {r['name']} | {_held(r)} | {r['median_ms']:.3f} | {r['median_us_per_layer']:.1f} | "
                         f"{r.get('vs') or '-'} | {r['ratio']:.3f} | {r['overhead_us_per_layer']:+.1f} |"
                         if r.get("vs") else
                         f"| {r['name']} | {_held(r)} | {r['median_ms']:.3f} | {r['median_us_per_layer']:.1f} | - | - | - |")
    lines += [""] + [f"- {n}" for n in data.get("notes", [])]
    if cfg.get("command"):
        lines += ["", f"Command: `{cfg['command']}`"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ command line
def add_parser(sub, add_model_flags: Callable, methods: list[str]) -> None:
    """Add `kvcompose bench steptime` to the `bench` subparsers `sub`."""
    p = sub.add_parser(
        "steptime", help="time of one decode step after 1k/4k/16k tokens seen; per-layer overhead",
        description="For each preset at --budget: the median time of one decode step after each --seen count of "
        "tokens (reached by feeding random tokens in chunks of the preset's interval), as ratios to the first "
        "(it should be flat within 5%); and on a deep narrow random model, kvcompose's per-layer overhead against "
        "DynamicCache (sdpa) at equal held tokens and against the ideal sliding-window cache. One torch thread on "
        "CPU unless --threads.")
    p.add_argument("--methods", nargs="+", default=[m for m in methods if m != "full"], choices=methods,
                   help="presets (default: all compressing)")
    p.add_argument("--budget", type=int, default=512, help="budget (default 512)")
    p.add_argument("--interval", type=int, default=None, help="compression interval (default: each preset's own)")
    p.add_argument("--seen", nargs="+", type=int, default=[1024, 4096, 16384],
                   help="tokens-seen checkpoints (default 1024 4096 16384)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per checkpoint (default 100)")
    p.add_argument("--no-ideal", action="store_true", help="skip the ideal cache in the sweep")
    p.add_argument("--tiny", action="store_true",
                   help="run the sweep on the deep narrow random model instead of --model (fast)")
    p.add_argument("--no-deep", action="store_true", help="skip the per-layer overhead measurement")
    p.add_argument("--deep-layers", type=int, default=30, help="layers of the deep narrow model (default 30)")
    p.add_argument("--deep-width", type=int, default=64, help="hidden size of the deep narrow model (default 64)")
    p.add_argument("--deep-held", type=int, default=512, help="held tokens in the overhead measurement (default 512)")
    p.add_argument("--deep-steps", type=int, default=300, help="timed steps in the overhead measurement (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/steptime", help="output folder (default runs/steptime)")
    add_model_flags(p)


def main(args, command: str = "") -> int:
    """Run `kvcompose bench steptime` from parsed arguments."""
    run_steptime(StepTimeConfig(
        model=args.model, dtype=args.dtype, device=args.device, methods=args.methods, budget=args.budget,
        interval=args.interval, seen=args.seen, steps=args.steps, ideal=not args.no_ideal, tiny=args.tiny,
        deep=not args.no_deep, deep_layers=args.deep_layers, deep_width=args.deep_width, deep_held=args.deep_held,
        deep_steps=args.deep_steps, seed=args.seed, threads=args.threads, out=args.out, command=command))
    return 0
