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
- NVIDIA kvpress's `DecodingPress` runs in its own virtualenv (`benchmarks/kvpress_speed.py`, transformers
  5.2) with the same prompt, budget and interval; its speed is reported as a ratio to *its own* full cache
  measured in its process (absolute times across processes are not comparable).

A decode step here is what `model.generate` does for greedy decoding without logits processors: one
forward of the new token with the growing 2-D attention mask and the position ids generate would pass,
`logits_to_keep=1`, then argmax (end-of-sequence suppressed, as with `min_new_tokens`).
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..view import KVComposeError

__all__ = [
    "TokenClock", "SpeedResult", "measure_decode", "ideal_cache", "full_cache", "kv_bytes", "held_tokens", "Contender", "DecodeTrace",
    "decode_interleaved", "summarize", "with_ratios", "SpeedConfig", "run_speed", "speed_markdown",
    "plot_speed", "KVPRESS_ANALOGUE", "kvpress_traces", "default_kvpress_python",
]

# kvcompose preset -> the closest kvpress base press inside DecodingPress
KVPRESS_ANALOGUE = {"streaming_llm": "streaming_llm", "tova": "tova", "random_attention": "random",
                    "knorm": "knorm", "snapkv": "snapkv"}
MODEL_LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TokenClock:
    """A `generate` streamer that stamps each generated token (and can tick a tqdm bar).

    `decode_seconds` runs from the first generated token (after the prefill) to the last, so the prefill
    is not counted; `decode_tokens_per_s` is per sequence (multiply by the batch size for a batch)."""

    def __init__(self, device: torch.device, bar=None):
        self.device, self.bar = device, bar
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first hands over the prompt
            self._prompt_seen = True
            return
        _sync(self.device)
        self.stamps.append(time.perf_counter())
        if self.bar is not None:
            self.bar.update(1)

    def end(self) -> None:
        pass

    @property
    def decode_seconds(self) -> float:
        return self.stamps[-1] - self.stamps[0] if len(self.stamps) > 1 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.stamps) - 1) / self.decode_seconds if len(self.stamps) > 1 else float("nan")


# ------------------------------------------------------------------------------------------ caches
def ideal_cache(model, window: int):
    """The ideal compressed cache: transformers' `DynamicSlidingWindowLayer` of `window` tokens on every layer.

    Between steps it holds the last `window - 1` tokens and each decode step attends over exactly `window`
    (the held ones plus the new one), with no work to choose them. Its `get_mask_sizes` announces
    `(window - 1 + new, seen - window + 1)`, so the mask transformers builds has the width of what is held:
    with sdpa the single-query decode mask is skipped, and eager attention (which applies the mask) gives
    the same logits (checked in the tests). Use it with `model.set_attn_implementation("sdpa")`.
    A model config with `sliding_window` set is not needed (and Llama ignores it)."""
    from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise KVComposeError(f"window must be an int >= 2, got {window!r}")
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[DynamicSlidingWindowLayer(sliding_window=window) for _ in range(n)])


def full_cache(model):
    """The full cache of transformers (`DynamicCache`); use it with sdpa attention."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def kv_bytes(cache) -> int:
    """Bytes of keys and values a transformers cache holds now (all layers)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, Tensor) and t.dim() == 4:
                total += t.numel() * t.element_size()
    return total


def held_tokens(cache) -> int:
    """Tokens held now, max over layers (`memory().held` for a kvcompose cache)."""
    if hasattr(cache, "memory"):
        return int(cache.memory().held)
    return max((int(layer.keys.shape[-2]) for layer in getattr(cache, "layers", [])
                if isinstance(getattr(layer, "keys", None), Tensor) and layer.keys.dim() == 4), default=0)


# ------------------------------------------------------------------------------------------ decoding
@dataclass
class Contender:
    """One row of an interleaved run: a cache and the attention implementation its steps run with.

    `kind` is "ideal", "full" (transformers' `DynamicCache`), or "kvcompose". `input_ids` / `attention_mask`
    (`[B, P]`, optional) give this row its own (batched, left-padded) prompt."""

    name: str
    kind: str
    cache: Any
    attn: str
    method: str | None = None
    budget: int | None = None
    interval: int | None = None
    input_ids: Tensor | None = None
    attention_mask: Tensor | None = None


@dataclass
class DecodeTrace:
    """What `decode_interleaved` measured for one contender.

    `step_seconds[i]` is the wall time of decode step i (which takes the sequence from `first_seen + i` to
    `first_seen + i + 1` tokens seen); `held` samples `(tokens seen, tokens held)` every `sample_every`
    steps; bytes are over all layers (and all rows of the batch)."""

    name: str
    kind: str
    batch: int = 1
    first_seen: int = 0
    prefill_seconds: float = math.nan
    step_seconds: list[float] = field(default_factory=list)
    held: list[tuple[int, int]] = field(default_factory=list)
    peak_kv_bytes: int = 0
    peak_alloc_bytes: int = 0
    compress_seconds: float = 0.0
    compress_calls: int = 0
    method: str | None = None
    budget: int | None = None
    interval: int | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step_seconds"] = [round(s, 7) for s in self.step_seconds]
        return d


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _set_attn(model, impl: str) -> None:
    if getattr(model.config, "_attn_implementation", None) != impl:
        model.set_attn_implementation(impl)


def _track(c: Contender, tr: DecodeTrace) -> None:
    """Peak bytes and held length, outside the timed region."""
    if hasattr(c.cache, "memory"):
        mem = c.cache.memory()
        tr.peak_kv_bytes = int(mem.peak.get("hbm", mem.total))
        tr.peak_alloc_bytes = int(mem.peak.get("allocated", mem.allocated))
    else:
        b = kv_bytes(c.cache)
        tr.peak_kv_bytes = max(tr.peak_kv_bytes, b)
        tr.peak_alloc_bytes = max(tr.peak_alloc_bytes, b)


@torch.no_grad()
def decode_interleaved(
    model,
    input_ids: Int[Tensor, "B P"] | None,
    contenders: list[Contender],
    new_tokens: int,
    *,
    attention_mask: Int[Tensor, "B P"] | None = None,
    sample_every: int = 64,
    suppress_eos: bool = True,
    progress: bool = False,
    desc: str = "decode",
    on_sample: Callable[[int, list[DecodeTrace]], None] | None = None,
) -> list[DecodeTrace]:
    """Prefill every contender with its prompt (left-padded rows allowed), then decode `new_tokens` greedy
    tokens with all of them in turn, one step each per round (the order rotates every round), timing every
    step.

    Args:
        model: a Hugging Face causal LM (used by every contender; the attention implementation is switched
            to each contender's `attn` before its step, outside the timed region).
        input_ids: `[B, P]` prompt ids for every contender that has no `input_ids` of its own.
        contenders: caches to compare; each must be empty.
        new_tokens: decode steps per contender.
        attention_mask: `[B, P]` 1 for real tokens, 0 for left padding (default: all ones); goes with `input_ids`.
        sample_every: steps between samples of the held length.
        suppress_eos: never pick an end-of-sequence token (like `min_new_tokens`), so every row runs to the end.
        on_sample: called with the round number and the traces so far every `sample_every` rounds (e.g. to
            write partial results).

    Returns:
        One `DecodeTrace` per contender; a contender that raises keeps its error and leaves the rotation.
    """
    if new_tokens < 1:
        raise KVComposeError(f"new_tokens must be >= 1, got {new_tokens}")
    if not contenders:
        raise KVComposeError("no contenders to decode")
    from tqdm.auto import tqdm

    eos = _eos_ids(model) if suppress_eos else []
    traces: list[DecodeTrace] = []
    state: list[dict[str, Any]] = []
    for c in contenders:
        ids = c.input_ids if c.input_ids is not None else input_ids
        am0 = c.attention_mask if c.input_ids is not None else attention_mask
        if ids is None:
            raise KVComposeError(f"contender {c.name!r} has no prompt and no input_ids were given")
        device = ids.device
        b, p = ids.shape
        mask = torch.ones(b, p + new_tokens, dtype=torch.long, device=device)
        if am0 is not None:
            if am0.shape != ids.shape:
                raise KVComposeError(f"attention_mask {tuple(am0.shape)} != input_ids {tuple(ids.shape)}")
            mask[:, :p] = am0.to(device=device, dtype=torch.long)
        prompt_mask = mask[:, :p]
        prompt_pos = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)
        tr = DecodeTrace(name=c.name, kind=c.kind, batch=b, first_seen=p, method=c.method, budget=c.budget,
                         interval=c.interval)
        st: dict[str, Any] = {"alive": True, "mask": mask, "p": p, "device": device}
        try:
            _set_attn(model, c.attn)
            gc.collect()
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=ids, attention_mask=prompt_mask, position_ids=prompt_pos,
                        past_key_values=c.cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1]
            if eos:
                logits[:, eos] = -math.inf
            st["tok"] = logits.argmax(-1, keepdim=True)
            _sync(device)
            tr.prefill_seconds = time.perf_counter() - t0
            st["pos"] = prompt_pos[:, -1:] + 1
            _track(c, tr)
            tr.held.append((p, held_tokens(c.cache)))
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
            tr.error = f"prefill: {type(e).__name__}: {e}"
            st["alive"] = False
        traces.append(tr)
        state.append(st)
    gc.collect()
    bar = tqdm(total=new_tokens, desc=desc, unit="tok", dynamic_ncols=True, disable=not progress)
    rows = list(zip(contenders, traces, state))
    for i in range(new_tokens):
        for c, tr, st in rows[i % len(rows):] + rows[: i % len(rows)]:  # rotate: no row always runs first
            if not st["alive"]:
                continue
            seen = st["p"] + i  # tokens seen before this step
            am = st["mask"][:, : seen + 1]
            device = st["device"]
            try:
                _set_attn(model, c.attn)
                _sync(device)
                t0 = time.perf_counter()
                out = model(input_ids=st["tok"], attention_mask=am, position_ids=st["pos"], past_key_values=c.cache,
                            use_cache=True, logits_to_keep=1)
                logits = out.logits[:, -1]
                if eos:
                    logits[:, eos] = -math.inf
                st["tok"] = logits.argmax(-1, keepdim=True)
                _sync(device)
                tr.step_seconds.append(time.perf_counter() - t0)
                st["pos"] = st["pos"] + 1
            except Exception as e:  # noqa: BLE001
                tr.error = f"step {i}: {type(e).__name__}: {e}"
                st["alive"] = False
                continue
            # held length: every `sample_every` steps, and on both sides of every drop (a compression event)
            _track(c, tr)
            h = held_tokens(c.cache)
            prev = st.get("prev")
            if prev is not None and h < prev[1] and (not tr.held or tr.held[-1] != prev):
                tr.held.append(prev)
            if (prev is not None and h < prev[1]) or (i + 1) % sample_every == 0 or i + 1 == new_tokens:
                tr.held.append((seen + 1, h))
            st["prev"] = (seen + 1, h)
        if (i + 1) % sample_every == 0 or i + 1 == new_tokens:
            _stats_into(contenders, traces)
            if on_sample is not None:
                on_sample(i + 1, traces)
            if progress:
                bar.set_postfix_str(" ".join(f"{tr.name.split(' ')[0]}:{tr.held[-1][1]}" for tr in traces[:4]
                                             if tr.held), refresh=False)
        bar.update(1)
    bar.close()
    _stats_into(contenders, traces)
    return traces


def _stats_into(contenders: list[Contender], traces: list[DecodeTrace]) -> None:
    """Copy each kvcompose cache's event counters (`cache.stats`) into its trace."""
    for c, tr in zip(contenders, traces):
        stats = getattr(c.cache, "stats", None)
        if stats is not None:
            tr.compress_seconds = float(stats.compress_seconds)
            tr.compress_calls = int(stats.compress_calls)


# ------------------------------------------------------------------------------------------ one generate run
@dataclass
class SpeedResult:
    """One `measure_decode` run: decode time and rate, compression events (`cache.stats`) and KV bytes."""

    name: str
    budget: int | None
    new_tokens: int
    decode_seconds: float
    tokens_per_s: float
    compress_seconds: float
    compress_calls: int
    compress_share: float
    peak_kv_bytes: int
    peak_alloc_bytes: int
    full_kv_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def measure_decode(model, input_ids: Int[Tensor, "B P"], cache, new_tokens: int, name: str = "",
                   progress: bool = False) -> SpeedResult:
    """Greedy-decode exactly `new_tokens` tokens with `model.generate` into `cache` (a `KVComposeCache` or a
    transformers cache) and time the decode steps (prefill excluded). Compression time comes from
    `cache.stats` (wall time of every compression event, all layers). For side-by-side comparisons prefer
    `decode_interleaved`, which times every step of several caches in turn."""
    from tqdm.auto import tqdm

    bar = tqdm(total=new_tokens, desc=f"speed {name}", unit="tok", leave=False, disable=not progress)
    clock = TokenClock(input_ids.device, bar)
    model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), past_key_values=cache,
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, temperature=None,
                   top_p=None, top_k=None, streamer=clock, pad_token_id=model.generation_config.pad_token_id)
    bar.close()
    stats = getattr(cache, "stats", None)
    comp = float(stats.compress_seconds) if stats is not None else 0.0
    calls = int(stats.compress_calls) if stats is not None else 0
    if hasattr(cache, "memory"):
        mem = cache.memory()
        peak, alloc, full = int(mem.peak["hbm"]), int(mem.peak["allocated"]), int(mem.full_cache)
    else:
        full = peak = alloc = kv_bytes(cache)
    dec = clock.decode_seconds
    return SpeedResult(
        name=name, budget=getattr(cache, "budget", None), new_tokens=len(clock.stamps), decode_seconds=dec,
        tokens_per_s=clock.decode_tokens_per_s, compress_seconds=comp, compress_calls=calls,
        compress_share=comp / dec if dec and dec == dec else float("nan"),
        peak_kv_bytes=peak, peak_alloc_bytes=alloc, full_kv_bytes=full,
    )


# ------------------------------------------------------------------------------------------ summaries
def summarize(step_seconds: list[float], first_seen: int, *, batch: int = 1, window: int = 128,
              steady_fraction: float = 0.5) -> dict[str, Any]:
    """Tokens/s of a run of decode steps: overall, per window of `window` steps (labelled by tokens seen at
    the window's end), and in the steady state (the last `steady_fraction` of the steps).

    Rates are total tokens over total time (`batch` tokens per step), so compression events count."""
    if window < 1 or not 0 < steady_fraction <= 1:
        raise KVComposeError(f"bad window {window} or steady_fraction {steady_fraction}")
    n = len(step_seconds)
    if n == 0:
        return {"steps": 0, "decode_seconds": 0.0, "tokens_per_s": math.nan, "steady_tokens_per_s": math.nan,
                "steady_from_seen": None, "steady_median_step_ms": math.nan, "windows": []}
    windows = []
    for s in range(0, n, window):
        chunk = step_seconds[s : s + window]
        if len(chunk) < max(1, window // 2) and windows:  # a short tail: fold it out
            break
        windows.append({"seen": first_seen + s + len(chunk), "tokens_per_s": batch * len(chunk) / sum(chunk)})
    s0 = min(n - 1, int(round(n * (1 - steady_fraction))))
    steady = step_seconds[s0:]
    return {
        "steps": n,
        "decode_seconds": sum(step_seconds),
        "tokens_per_s": batch * n / sum(step_seconds),
        "steady_from_seen": first_seen + s0,
        "steady_tokens_per_s": batch * len(steady) / sum(steady),
        "steady_median_step_ms": 1e3 * statistics.median(steady),
        "windows": windows,
    }


def _row(tr: DecodeTrace | dict[str, Any], window: int, steady_fraction: float, engine: str) -> dict[str, Any]:
    d = tr.to_dict() if isinstance(tr, DecodeTrace) else dict(tr)
    steps = d.pop("step_seconds", []) or []
    s = summarize(steps, d.get("first_seen", 0), batch=d.get("batch", 1), window=window,
                  steady_fraction=steady_fraction) if steps else summarize([], 0)
    d.update(s)
    d["engine"] = engine
    d["compress_share"] = d.get("compress_seconds", 0.0) / s["decode_seconds"] if s["decode_seconds"] else math.nan
    held = [h for seen, h in d.get("held", []) if s["steady_from_seen"] is not None and seen >= s["steady_from_seen"]]
    d["steady_held_max"] = max(held) if held else None
    d["steady_held_min"] = min(held) if held else None
    return d


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add `vs_ideal` / `vs_full` (steady tokens/s over the ideal's / the full cache's) to rows of one process
    (one engine), and the per-window ratio to the full cache (`windows[i]["vs_full"]`)."""
    by_kind = {r["kind"]: r for r in rows if r.get("kind") in ("ideal", "full") and not r.get("error")}
    ideal, full = by_kind.get("ideal"), by_kind.get("full")
    for r in rows:
        r["vs_ideal"] = r["steady_tokens_per_s"] / ideal["steady_tokens_per_s"] if ideal else math.nan
        r["vs_full"] = r["steady_tokens_per_s"] / full["steady_tokens_per_s"] if full else math.nan
        r["kv_vs_full"] = r["peak_kv_bytes"] / full["peak_kv_bytes"] if full and full["peak_kv_bytes"] else math.nan
        if full:
            fw = {w["seen"]: w["tokens_per_s"] for w in full["windows"]}
            for w in r["windows"]:
                w["vs_full"] = w["tokens_per_s"] / fw[w["seen"]] if w["seen"] in fw else math.nan
            st = [w["vs_full"] for w in r["windows"] if r["steady_from_seen"] is not None
                  and w["seen"] > r["steady_from_seen"] and w["vs_full"] == w["vs_full"]]
            r["vs_full_window_min"] = min(st) if st else math.nan
            r["vs_full_window_max"] = max(st) if st else math.nan
    return rows


# ------------------------------------------------------------------------------------------ kvpress
def default_kvpress_python() -> str | None:
    """`.venv-kvpress/bin/python` under the current directory, if it exists (the side-by-side venv)."""
    p = Path(".venv-kvpress") / "bin" / "python"
    return str(p) if p.exists() else None


def default_kvpress_script() -> Path:
    """`benchmarks/kvpress_speed.py` of the source checkout this package is imported from."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "kvpress_speed.py"


def kvpress_command(python: str, prompt_path, out_path, *, new_tokens: int, budget: int, presses: dict[str, int],
                    window: int, threads: int | None, script=None, model_dir: str | None = None,
                    ideal: bool = True, seed: int = 0) -> list[str]:
    """The command line of `benchmarks/kvpress_speed.py` (`presses`: kvpress press name -> interval)."""
    script = Path(script or default_kvpress_script())
    rel = os.path.relpath(script)
    script = rel if not rel.startswith("..") else str(script)  # the command in the report stays portable
    cmd = [str(python), str(script), "--prompt", str(prompt_path), "--out", str(out_path),
           "--new-tokens", str(new_tokens), "--budget", str(budget), "--window", str(window), "--seed", str(seed),
           "--presses", *[f"{k}:{v}" for k, v in presses.items()]]
    if threads:
        cmd += ["--threads", str(threads)]
    if model_dir:
        cmd += ["--model-dir", model_dir]
    if not ideal:
        cmd += ["--no-ideal"]
    return cmd


def start_kvpress(cmd: list[str], log_path) -> tuple[Any, str]:
    """Start the kvpress speed script: `(process, command)`, or `(None, why it was skipped)`."""
    import subprocess

    if not Path(cmd[0]).exists():
        return None, f"kvpress skipped: {cmd[0]} not found (create .venv-kvpress, see benchmarks/README_kvpress.md)"
    if not Path(cmd[1]).exists():
        return None, f"kvpress skipped: {cmd[1]} not found"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the kvpress venv must not import this checkout through PYTHONPATH
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc._kvc_log = log  # closed in finish_kvpress
    return proc, " ".join(cmd)


def finish_kvpress(proc, out_path, command: str) -> tuple[dict | None, str | None]:
    """Wait for `start_kvpress`'s process: `(its JSON, None)` or `(None, why it failed)`."""
    code = proc.wait()
    proc._kvc_log.close()
    if code != 0 or not Path(out_path).exists():
        return None, f"kvpress failed (exit {code}); see its log. Command: {command}"
    return json.loads(Path(out_path).read_text()), None


def kvpress_traces(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a `benchmarks/kvpress_speed.py` JSON as `DecodeTrace` dicts (kind ideal / full / kvpress).

    Raises `KVComposeError` when the JSON is not such a file."""
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise KVComposeError("not a kvpress_speed.py result: no 'rows' list")
    out = []
    for r in result["rows"]:
        missing = {"name", "kind", "step_seconds"} - set(r)
        if missing:
            raise KVComposeError(f"kvpress row {r.get('name', '?')!r} lacks {sorted(missing)}")
        d = {k: r.get(k) for k in ("name", "kind", "batch", "first_seen", "prefill_seconds", "step_seconds", "held",
                                   "peak_kv_bytes", "peak_alloc_bytes", "interval", "budget", "error")}
        d["batch"] = d["batch"] or 1
        d["first_seen"] = d["first_seen"] or 0
        d["held"] = [tuple(h) for h in (d["held"] or [])]
        d["peak_kv_bytes"] = int(d["peak_kv_bytes"] or 0)
        d["peak_alloc_bytes"] = int(d["peak_alloc_bytes"] or d["peak_kv_bytes"])
        d["method"] = r.get("press")
        d["compress_seconds"], d["compress_calls"] = 0.0, 0
        out.append(d)
    return out


# ------------------------------------------------------------------------------------------ the benchmark
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
    from .common import make_pipeline

    rows: list[Contender] = []
    errors: dict[str, str] = {}
    if cfg.ideal:
        rows.append(Contender(f"ideal (sliding window {cfg.budget}, sdpa)", "ideal", ideal_cache(model, cfg.budget),
                              "sdpa", budget=cfg.budget))
    rows.append(Contender("full (DynamicCache, sdpa)", "full", full_cache(model), "sdpa"))
    for m in cfg.methods:
        try:
            pipe = make_pipeline(m, None if m == "full" else cfg.budget)
            kw = {} if cfg.interval is None else {"interval": cfg.interval}
            budget = None if m == "full" else cfg.budget
            cache = KVComposeCache(model, pipe, budget=budget, seed=cfg.seed, **kw)
            attn = model.config._attn_implementation
            rows.append(Contender("full (kvcompose)" if m == "full" else m, "kvcompose", cache, attn, method=m,
                                  budget=budget, interval=None if m == "full" else cache.interval))
        except Exception as e:  # noqa: BLE001
            errors[m] = f"{type(e).__name__}: {e}"
            log(f"{m}: cannot build its cache: {errors[m]}")
    return rows, errors


def run_speed(cfg: SpeedConfig, log=print) -> dict[str, Any]:
    """`kvcompose bench speed`: decode `cfg.new_tokens` greedy tokens with the ideal cache, the full cache and
    each preset, interleaved in one process; kvpress side by side in its own process. Writes `speed.json`,
    `speed.md` and `speed.png` to `cfg.out` and returns the JSON-ready dict."""
    from .. import methods as _methods
    from ..models import chat_inputs
    from .data import demo_question
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


# ------------------------------------------------------------------------------------------ report
def _f(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "-"
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return str(x)
    return f"{x:.{digits}f}"


def speed_markdown(data: dict[str, Any]) -> str:
    """The Markdown report of a `speed.json`."""
    cfg = data.get("config", {})
    lines = [
        f"# Decode speed against tokens seen: {cfg.get('model')}",
        "",
        f"{cfg.get('new_tokens')} greedy tokens after a {cfg.get('prompt_tokens')}-token prompt, budget "
        f"{cfg.get('budget')}, {cfg.get('threads')} thread(s), device {cfg.get('device')}. "
        f"Steady state = the last {cfg.get('steady_fraction', 0.5):.0%} of the steps.",
        "",
        "| row | held (steady) | peak KV MiB | tok/s overall | tok/s steady | vs ideal | vs full | events share "
        "| events | kvpress analogue: vs its ideal / its full | kvcompose / kvpress |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data.get("rows", []):
        if r.get("error") and not r.get("steps"):
            lines.append(f"| {r['name']} | error: {r['error']} |||||||||")
            continue
        held = "-" if r.get("steady_held_min") is None else (
            f"{r['steady_held_min']}" if r["steady_held_min"] == r["steady_held_max"]
            else f"{r['steady_held_min']}-{r['steady_held_max']}")
        kp = "-" if "kvpress_vs_full" not in r else \
            f"{_f(r.get('kvpress_vs_ideal'))} / {_f(r['kvpress_vs_full'])} ({r['kvpress_press']})"
        share = "-" if r["kind"] != "kvcompose" or r.get("method") == "full" else f"{100 * r['compress_share']:.1f}%"
        lines.append(
            f"| {r['name']} | {held} | {_f(r['peak_kv_bytes'] / 2**20)} | {_f(r['tokens_per_s'], 1)} | "
            f"{_f(r['steady_tokens_per_s'], 1)} | {_f(r.get('vs_ideal'))} | {_f(r.get('vs_full'))} | {share} | "
            f"{r.get('compress_calls', 0) if r['kind'] == 'kvcompose' else '-'} | {kp} | {_f(r.get('vs_kvpress'))} |")
    kp = data.get("kvpress")
    if kp:
        v = kp.get("versions") or {}
        lines += ["", f"kvpress's own process (kvpress {v.get('kvpress', '?')}, transformers {v.get('transformers', '?')}):",
                  "", "| row | held (steady) | peak KV MiB | tok/s steady | vs its ideal | vs its full |", "|---|---|---|---|---|---|"]
        for r in kp["rows"]:
            if r.get("error") and not r.get("steps"):
                lines.append(f"| {r['name']} | error: {r['error']} |||||")
                continue
            held = "-" if r.get("steady_held_min") is None else f"{r['steady_held_min']}-{r['steady_held_max']}"
            lines.append(f"| {r['name']} | {held} | {_f(r['peak_kv_bytes'] / 2**20)} | {_f(r['steady_tokens_per_s'], 1)} "
                         f"| {_f(r.get('vs_ideal'))} | {_f(r.get('vs_full'))} |")
        lines += ["", f"kvpress command: `{kp.get('command')}`"]
    for name, e in (data.get("errors") or {}).items():
        lines.append(f"\n- {name} could not run: {e}")
    lines += [""] + [f"- {n}" for n in data.get("notes", [])]
    load = [v for _, v in data.get("loadavg_1min", [])]
    if load:
        lines.append(f"- Load average (1 min) during the run: median {statistics.median(load):.1f}, max {max(load):.1f} "
                     f"on {cfg.get('cpus', '?')} cores.")
    if cfg.get("command"):
        lines += ["", f"Command: `{cfg['command']}`"]
    return "\n".join(lines) + "\n"


def plot_speed(data: dict[str, Any], path) -> None:
    """Tokens/s against tokens seen (left) and the ratio to the full cache of the same process (right); a
    kvpress row is drawn dashed in the colour of its kvcompose analogue."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    cmap = plt.get_cmap("tab10")
    base = {"ideal": dict(color="black", ls=":", lw=2), "full": dict(color="grey", ls="--", lw=2)}
    colors: dict[str, Any] = {}
    rows = [r for r in data.get("rows", []) if r.get("windows")]
    for r in rows:
        if r["kind"] in base:
            style = base[r["kind"]]
        else:
            colors[r.get("method") or r["name"]] = cmap(len(colors) % 10)
            style = dict(color=colors[r.get("method") or r["name"]], lw=1.4)
        xs = [w["seen"] for w in r["windows"]]
        axes[0].plot(xs, [w["tokens_per_s"] for w in r["windows"]], label=r["name"], **style)
        axes[1].plot(xs, [w.get("vs_full", math.nan) for w in r["windows"]], label=r["name"], **style)
    back = {v: k for k, v in KVPRESS_ANALOGUE.items()}
    kp = (data.get("kvpress") or {}).get("rows", [])
    for r in [r for r in kp if r.get("windows") and r["kind"] != "full"]:
        if r["kind"] == "ideal":
            style = dict(color="black", ls=(0, (1, 3)), lw=1)
        else:
            c = colors.get(back.get(r.get("method") or ""), None)
            style = dict(color=c if c is not None else cmap((len(colors) + 1) % 10), ls="--", lw=1.2)
        axes[1].plot([w["seen"] for w in r["windows"]], [w.get("vs_full", math.nan) for w in r["windows"]],
                     label=f"kvpress: {r['name']}", **style)
    axes[0].set(xlabel="tokens seen", ylabel="tokens/s (window)", title="decode speed (one process, interleaved)")
    axes[1].set(xlabel="tokens seen", ylabel="speed / full cache of the same process",
                title="ratio to the full cache (kvpress dashed: to its own)")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    s.add_argument("--kvpress-script", default=None, help="default: benchmarks/kvpress_speed.py of this checkout")
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
