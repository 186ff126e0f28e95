"""Decode speed against tokens seen: the instruments behind `kvcompose bench speed`.

Compression exists so that, once the cache holds a fixed budget, every further token costs what a short
context costs. This module measures exactly that, in one process, as ratios (the machine is shared and
noisy; absolute tokens/s move by +-10% between runs, ratios measured side by side do not):

- every contender (the ideal cache, the full cache, each kvcompose preset) is prefilled with the same prompt,
  then all of them decode **interleaved, one greedy step each in turn** (`decode_interleaved`), so a burst
  of load on the machine hits every row alike;
- each step is timed on its own: tokens/s against tokens seen in windows (default 128 tokens), and the
  steady state over the last half of the run, after the held length has plateaued (`summarize`);
- the ideal is transformers' own sliding-window cache (`ideal_cache`: `DynamicSlidingWindowLayer` of
  `budget` tokens on every layer, sdpa): a cache that only ever attends over `budget` tokens and does no
  work to choose them. The full cache is `DynamicCache` with sdpa;
- time in compression events comes from `cache.stats` (wall time of every `compress()`, all layers), peak
  KV bytes from `cache.memory().peak`;
- NVIDIA kvpress's `DecodingPress` runs in its own virtualenv (`kvpress_speed.py`, shipped in
  `kvcompose.bench.external`; transformers 5.2) with the same prompt, budget and interval; its speed is reported as a ratio to *its own* full cache
  measured in its process (absolute times across processes are not comparable).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..view import KVComposeError
from .decode import (  # noqa: F401  (_set_attn, _sync: kvcompose.bench.steptime imports them from here)
    Contender, DecodeTrace, SpeedResult, TokenClock, _set_attn, _sync, decode_interleaved, full_cache,
    held_tokens, ideal_cache, kv_bytes, measure_decode,
)
from .speed_kvpress import (  # noqa: F401  (default_kvpress_script: importable from here as before)
    KVPRESS_ANALOGUE, default_kvpress_python, default_kvpress_script, finish_kvpress, kvpress_command,
    kvpress_traces, start_kvpress,
)
from .speed_report import _row, plot_speed, speed_markdown, summarize, with_ratios

__all__ = [
    "TokenClock", "SpeedResult", "measure_decode", "ideal_cache", "full_cache", "kv_bytes", "held_tokens", "Contender", "DecodeTrace",
    "decode_interleaved", "summarize", "with_ratios", "SpeedConfig", "run_speed", "speed_markdown",
    "plot_speed", "KVPRESS_ANALOGUE", "kvpress_traces", "default_kvpress_python",
]

MODEL_LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"


@dataclass
class SpeedConfig:
    """Settings of `kvcompose bench speed` (see `run_speed`). `interval=None` leaves each preset at its
    own default interval; `threads=None` means 1 on CPU (the ratios are cleaner without thread contention)."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    methods: list[str] | None = None
    budget: int = 512
    interval: int | None = None
    new_tokens: int = 4096
    window: int = 128
    steady_fraction: float = 0.5
    question: str | None = None
    ideal: bool = True
    seed: int = 0
    threads: int | None = None
    kvpress_python: str | None = "auto"
    kvpress_script: str | None = None
    kvpress_presses: list[str] | None = None
    kvpress_json: str | None = None
    kvpress_parallel: bool = True
    out: str = "runs/speed"
    command: str = ""


def _contenders(model, cfg: SpeedConfig, log) -> tuple[list[Contender], dict[str, str]]:
    from ..cache import KVComposeCache
    from ..methods import preset

    rows: list[Contender] = []
    errors: dict[str, str] = {}
    if cfg.ideal:
        rows.append(Contender(f"ideal (sliding window {cfg.budget}, sdpa)", "ideal", ideal_cache(model, cfg.budget),
                              "sdpa", budget=cfg.budget))
    rows.append(Contender("full (DynamicCache, sdpa)", "full", full_cache(model), "sdpa"))
    for m in cfg.methods:
        pipe = preset(m, budget=None if m == "full" else cfg.budget)
        kw = {} if cfg.interval is None else {"interval": cfg.interval}
        budget = None if m == "full" else cfg.budget
        try:  # a method that cannot work at this budget (or on this model) ends the run before any decoding
            cache = KVComposeCache(model, pipe, budget=budget, seed=cfg.seed, **kw)
        except KVComposeError as e:
            raise KVComposeError(f"{m} at budget {budget}: {e}") from None
        attn = model.config._attn_implementation
        rows.append(Contender("full (kvcompose)" if m == "full" else m, "kvcompose", cache, attn, method=m,
                              budget=budget, interval=None if m == "full" else cache.interval))
    return rows, errors


def run_speed(cfg: SpeedConfig, log=print) -> dict[str, Any]:
    """`kvcompose bench speed`: decode `cfg.new_tokens` greedy tokens with the ideal cache, the full cache and
    each preset, interleaved in one process; kvpress side by side in its own process. Writes `speed.json`,
    `speed.md` and `speed.png` to `cfg.out` and returns the JSON-ready dict."""
    from .. import methods as _methods
    from ..models import chat_inputs
    from ..data import demo_question
    from .common import load_model, versions

    if cfg.methods is None:
        cfg.methods = [m for m in _methods.PRESETS if m != "full"]
    for m in cfg.methods:
        if m not in _methods.PRESETS:
            raise KVComposeError(f"unknown method {m!r}; presets: {', '.join(_methods.PRESETS)}")
    if cfg.budget < 2 or cfg.new_tokens < 2 or cfg.window < 1:
        raise KVComposeError("budget and new_tokens must be >= 2 and window >= 1")
    threads = cfg.threads or (1 if cfg.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    model, tok = load_model(cfg.model, cfg.dtype, cfg.device)
    q = cfg.question or demo_question(0)["question"]
    ids = chat_inputs(tok, q, device=cfg.device)["input_ids"]
    contenders, errors = _contenders(model, cfg, log)
    notes = [
        "Measured in one process, all rows interleaved one decode step at a time; the machine is shared and noisy, "
        "so only the ratios are claimed (absolute tokens/s move between runs).",
        f"Steady state: the last {cfg.steady_fraction:.0%} of the decode steps. Ideal: transformers' "
        f"DynamicSlidingWindowLayer of {cfg.budget} tokens on every layer (sdpa). Full: DynamicCache (sdpa).",
    ]
    # ---- kvpress, in its own process, started before our loop (side by side) or after it
    kp_proc = kp_cmd = None
    kp_res = None
    kp_out = out / "kvpress_speed.json"
    presses: dict[str, int] = {}
    for c in contenders:
        if c.kind == "kvcompose" and c.method in KVPRESS_ANALOGUE:
            presses.setdefault(KVPRESS_ANALOGUE[c.method], c.interval)
    default_interval = next((c.interval for c in contenders if c.interval), cfg.interval or 64)
    for p in cfg.kvpress_presses or []:
        name, _, iv = p.partition(":")
        presses[name] = int(iv) if iv else presses.get(name, default_interval)
    if cfg.kvpress_presses is not None:
        presses = {k: v for k, v in presses.items() if k in {p.partition(":")[0] for p in cfg.kvpress_presses}}
    python = default_kvpress_python() if cfg.kvpress_python == "auto" else cfg.kvpress_python
    if cfg.kvpress_json:
        kp_res = json.loads(Path(cfg.kvpress_json).read_text())
        kp_cmd = kp_res.get("command", f"(reused {cfg.kvpress_json})")
    elif python and presses:
        prompt_path = out / "kvpress_prompt.json"
        prompt_path.write_text(json.dumps({"model": cfg.model or MODEL_LABEL, "prompt_ids": ids[0].tolist()}))
        cmd = kvpress_command(python, prompt_path, kp_out, new_tokens=cfg.new_tokens, budget=cfg.budget,
                              presses=presses, window=cfg.window, threads=threads, script=cfg.kvpress_script,
                              model_dir=cfg.model, ideal=cfg.ideal, seed=cfg.seed)
        if cfg.kvpress_parallel:
            kp_proc, kp_cmd = start_kvpress(cmd, out / "kvpress_speed.log")
            log(kp_cmd if kp_proc is None else f"kvpress started side by side: {kp_cmd}")
        else:
            kp_proc, kp_cmd = start_kvpress(cmd, out / "kvpress_speed.log")
            if kp_proc is not None:
                kp_res, why = finish_kvpress(kp_proc, kp_out, kp_cmd)
                kp_proc = None
                if kp_res is None:
                    notes.append(why)
    elif not presses:
        notes.append("kvpress: no preset with a kvpress analogue among the methods; skipped.")
    else:
        notes.append("kvpress skipped: no .venv-kvpress/bin/python here and no --kvpress-python given.")
    data: dict[str, Any] = {
        "config": {**{k: v for k, v in cfg.__dict__.items()}, "model": cfg.model or MODEL_LABEL,
                   "prompt_tokens": int(ids.shape[1]), "threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        "versions": versions(), "rows": [], "kvpress": None, "notes": notes,
        "errors": errors,
    }

    def partial(done: int, traces: list[DecodeTrace]) -> None:  # an interrupted run keeps what it measured
        if hasattr(os, "getloadavg"):  # how busy the machine was: the noise behind the ratios
            data.setdefault("loadavg_1min", []).append([done, round(os.getloadavg()[0], 2)])
        if done % 512 == 0 and done < cfg.new_tokens:
            data["rows"] = with_ratios([_row(t, cfg.window, cfg.steady_fraction, "kvcompose") for t in traces])
            data["partial_steps"] = done
            (out / "speed.json").write_text(json.dumps(data, indent=1, default=str))

    try:
        traces = decode_interleaved(model, ids, contenders, cfg.new_tokens, progress=True,
                                    desc="speed (interleaved)", on_sample=partial)
    except BaseException:
        if kp_proc is not None:  # do not leave the kvpress process running alone
            kp_proc.terminate()
        raise
    data.pop("partial_steps", None)
    data["rows"] = with_ratios([_row(t, cfg.window, cfg.steady_fraction, "kvcompose") for t in traces])
    if kp_proc is not None:
        log("waiting for kvpress ...")
        kp_res, why = finish_kvpress(kp_proc, kp_out, kp_cmd)
        if kp_res is None:
            notes.append(why)
            log(why)
    if kp_res is not None:
        kp_rows = with_ratios([_row(t, cfg.window, cfg.steady_fraction, "kvpress") for t in kvpress_traces(kp_res)])
        data["kvpress"] = {"versions": kp_res.get("versions"), "config": kp_res.get("config"), "command": kp_cmd,
                           "rows": kp_rows}
        by_press = {r.get("method"): r for r in kp_rows if r["kind"] == "kvpress"}
        for r in data["rows"]:
            kp = by_press.get(KVPRESS_ANALOGUE.get(r.get("method") or ""))
            if kp is not None:
                r["kvpress_press"] = kp["name"]
                r["kvpress_vs_full"] = kp["vs_full"]
                r["kvpress_vs_ideal"] = kp.get("vs_ideal", math.nan)
                r["vs_kvpress"] = r["vs_full"] / kp["vs_full"] if kp["vs_full"] else math.nan
        notes.append("kvpress rows: DecodingPress(base press, compression_interval, target_size=budget) in its own "
                     "process (transformers 5.2), each as a ratio to the full cache (and ideal) of that process; "
                     "'kvcompose / kvpress' divides the two ratios to the full cache.")
    data["elapsed_s"] = time.perf_counter() - t_start
    (out / "speed.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "speed.md").write_text(speed_markdown(data))
    plot_speed(data, out / "speed.png")
    log(f"wrote {out}/speed.json, speed.md, speed.png in {data['elapsed_s']:.0f}s")
    return data


# ------------------------------------------------------------------------------------------ command line
def add_parser(sub, add_model_flags: Callable, methods: list[str]) -> None:
    """Add `kvcompose bench speed` to the `bench` subparsers `sub`."""
    s = sub.add_parser(
        "speed", help="decode tokens/s against tokens seen vs the ideal cache, the full cache and kvpress",
        description="Greedy-decode --new-tokens tokens with the ideal cache (a sliding window of --budget tokens), "
        "the full cache (DynamicCache, sdpa) and each preset, all interleaved one step at a time in one process; "
        "report tokens/s against tokens seen (windows and a plot), the steady-state rate as ratios to the ideal "
        "and the full cache, the share of decode time in compression events and the peak KV bytes. kvpress's "
        "DecodingPress runs side by side in its own virtualenv. Only ratios are claimed: the machine is noisy. "
        "Defaults: all compressing presets, budget 512, 4096 tokens (hours on a 2-core CPU; narrow --methods). "
        "One torch thread per process on CPU unless --threads.")
    s.add_argument("--methods", nargs="+", default=[m for m in methods if m != "full"], choices=methods,
                   help="presets ('full' adds kvcompose's own attention without eviction; default: all compressing)")
    s.add_argument("--budget", type=int, default=512, help="tokens kept per layer and the ideal's window (default 512)")
    s.add_argument("--interval", type=int, default=None, help="compression interval (default: each preset's own)")
    s.add_argument("--new-tokens", type=int, default=4096, help="decoded tokens per row (default 4096)")
    s.add_argument("--window", type=int, default=128, help="decode steps per tokens/s window (default 128)")
    s.add_argument("--question", default=None, help="prompt question (default: a built-in demo question)")
    s.add_argument("--no-ideal", action="store_true", help="skip the ideal (sliding window) row")
    s.add_argument("--seed", type=int, default=0, help="seed of random selectors (default 0)")
    s.add_argument("--kvpress-python", default="auto",
                   help="python of the kvpress virtualenv; 'auto' (default): .venv-kvpress/bin/python if it exists "
                   "here; 'none': skip kvpress")
    s.add_argument("--kvpress-script", default=None, help="default: kvpress_speed.py shipped in kvcompose.bench.external")
    s.add_argument("--kvpress-presses", nargs="+", default=None,
                   help="kvpress presses as name[:interval] (default: the analogues of --methods: "
                   + ", ".join(f"{k}->{v}" for k, v in KVPRESS_ANALOGUE.items()) + ")")
    s.add_argument("--kvpress-json", default=None, help="reuse the kvpress_speed.json of an earlier run")
    s.add_argument("--kvpress-sequential", action="store_true", help="run kvpress before kvcompose, not side by side")
    s.add_argument("--out", default="runs/speed", help="output folder (default runs/speed)")
    add_model_flags(s)


def main(args, command: str = "") -> int:
    """Run `kvcompose bench speed` from parsed arguments."""
    kp = None if str(args.kvpress_python).lower() == "none" else args.kvpress_python
    run_speed(SpeedConfig(
        model=args.model, dtype=args.dtype, device=args.device, methods=args.methods, budget=args.budget,
        interval=args.interval, new_tokens=args.new_tokens, window=args.window, question=args.question,
        ideal=not args.no_ideal, seed=args.seed, threads=args.threads, kvpress_python=kp,
        kvpress_script=args.kvpress_script, kvpress_presses=args.kvpress_presses, kvpress_json=args.kvpress_json,
        kvpress_parallel=not args.kvpress_sequential, out=args.out, command=command))
    return 0
