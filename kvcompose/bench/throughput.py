"""Batched throughput under a KV memory limit: where compression pays in serving.

`kvcompose bench throughput --kv-memory MIB` gives every method the same KV memory and lets it fill it:

1. **Plan.** A sequence needs `bytes_per_token x held` bytes of KV (`bytes_per_token` = layers x KV heads x
   (key + value head dims) x element size, from the model config). The full cache holds the padded prompt
   plus every generated token; a compressing cache holds at most `max(budget, prompt) + interval` (its
   reusable buffer: the budget plus one interval of growth), or what a one-sequence calibration run with the
   longest prompt through two compression events allocated, whichever is larger. The largest batch is
   `floor(kv_memory / (bytes_per_token x held bound))`, capped by `--max-batch`.
2. **Run.** Each method decodes `--new-tokens` greedy tokens for its batch of left-padded random-token
   prompts of different lengths (spread evenly over `--prompt-lengths MIN MAX`), all methods interleaved
   one step at a time in one process (`kvcompose.bench.speed.decode_interleaved`).
3. **Verify.** The measured peak KV bytes of each run (`cache.memory().peak["allocated"]`, the buffers, for
   kvcompose; the held tensors for `DynamicCache`) must fit in `--kv-memory`; the report says if not.

Reported: total tokens/s (batch x steps / decode time; and including the prefill) and its ratio to the full
cache's at its own largest batch.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..view import KVComposeError
from .decode import Contender, decode_interleaved, full_cache
from .speed_report import summarize

__all__ = ["ThroughputConfig", "bytes_per_token", "held_bound", "plan_batch", "batch_prompts", "run_throughput",
           "throughput_markdown", "plot_throughput"]

MIB = 2**20


def bytes_per_token(config, dtype: torch.dtype = torch.float32) -> int:
    """KV bytes of one token over all layers of a model with this config (keys and values, all KV heads)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    item = torch.empty((), dtype=dtype).element_size()
    return int(cfg.num_hidden_layers * heads * 2 * head_dim * item)


def held_bound(method: str, prompt_tokens: int, new_tokens: int, budget: int | None, interval: int | None) -> int:
    """Most tokens a sequence's cache holds (allocates) during the run: the padded prompt plus every new token
    for the full cache, `max(budget, prompt) + interval` for a compressing cache."""
    if prompt_tokens < 1 or new_tokens < 1:
        raise KVComposeError(f"prompt_tokens and new_tokens must be >= 1, got {prompt_tokens}, {new_tokens}")
    if method == "full" or budget is None:
        return prompt_tokens + new_tokens
    if interval is None or interval < 1:
        raise KVComposeError(f"a compressing method needs its interval, got {interval!r}")
    return min(prompt_tokens + new_tokens, max(budget, prompt_tokens) + interval)


def plan_batch(kv_memory_bytes: int, per_token_bytes: int, held: int, max_batch: int | None = None) -> int:
    """The largest batch whose KV (`held` tokens per sequence) fits in `kv_memory_bytes` (0 if none fits)."""
    if per_token_bytes <= 0 or held <= 0:
        raise KVComposeError("per_token_bytes and held must be positive")
    n = int(kv_memory_bytes // (per_token_bytes * held))
    return min(n, max_batch) if max_batch else n


def batch_prompts(batch: int, lengths: tuple[int, int], vocab: int, pad_id: int, *, seed: int = 0,
                  device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random-token prompts with lengths spread evenly over `[min, max]`, left-padded:
    `(input_ids [batch, max], attention_mask [batch, max])`."""
    lo, hi = lengths
    if batch < 1 or lo < 1 or hi < lo:
        raise KVComposeError(f"bad batch {batch} or prompt lengths {lengths}")
    g = torch.Generator().manual_seed(seed)
    lens = [hi] if batch == 1 else [round(lo + (hi - lo) * i / (batch - 1)) for i in range(batch)]
    ids = torch.full((batch, hi), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, hi, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, hi - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[r, hi - n:] = 1
    return ids.to(device), mask.to(device)


@dataclass
class ThroughputConfig:
    """Settings of `kvcompose bench throughput` (see `run_throughput`)."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    methods: list[str] = field(default_factory=lambda: ["streaming_llm", "tova", "rkv"])
    budget: int = 256
    interval: int | None = None
    kv_memory_mib: float | int = 128.0
    new_tokens: int = 1024
    prompt_lengths: tuple[int, int] = (64, 192)
    max_batch: int = 32
    seed: int = 0
    threads: int | None = None
    out: str = "runs/throughput"
    command: str = ""


def run_throughput(cfg: ThroughputConfig, log=print, model_and_tokenizer=None) -> dict[str, Any]:
    """`kvcompose bench throughput`: writes `throughput.json`, `throughput.md` and `throughput.png` to `cfg.out`.

    `model_and_tokenizer` may hand in an already loaded `(model, tokenizer)` (tests); otherwise `cfg.model`
    is loaded."""
    from .. import methods as _methods
    from ..cache import KVComposeCache
    from .common import load_model, versions
    from ..methods import preset

    for m in cfg.methods:
        if m not in _methods.PRESETS or m == "full":
            raise KVComposeError(f"unknown compressing method {m!r}; presets: {', '.join(_methods.PRESETS)} "
                                 "(the full cache is always measured)")
    if cfg.kv_memory_mib <= 0 or cfg.new_tokens < 2:
        raise KVComposeError("kv_memory_mib must be > 0 and new_tokens >= 2")
    threads = cfg.threads or (1 if cfg.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, _tok = model_and_tokenizer or load_model(cfg.model, cfg.dtype, cfg.device)
    dtype = next(model.parameters()).dtype
    per_tok = bytes_per_token(model.config, dtype)
    mem = int(cfg.kv_memory_mib * MIB)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad if not isinstance(pad, list) else pad[0])
    p_max = cfg.prompt_lengths[1]

    plans: list[dict[str, Any]] = []
    contenders: list[Contender] = []
    errors: dict[str, str] = {}
    kw = {} if cfg.interval is None else {"interval": cfg.interval}
    for m in cfg.methods:  # a method that cannot work at this budget (or on this model) ends the run before decoding
        try:
            KVComposeCache(model, preset(m, budget=cfg.budget), budget=cfg.budget, seed=cfg.seed, **kw)
        except KVComposeError as e:
            raise KVComposeError(f"{m} at budget {cfg.budget}: {e}") from None
    # the full cache first
    hb = held_bound("full", p_max, cfg.new_tokens, None, None)
    bf = plan_batch(mem, per_tok, hb, cfg.max_batch)
    if bf < 1:
        raise KVComposeError(f"{cfg.kv_memory_mib} MiB of KV does not hold one full-cache sequence of {hb} tokens "
                             f"({hb * per_tok / MIB:.1f} MiB): raise --kv-memory or lower --new-tokens")
    plans.append({"name": "full (DynamicCache, sdpa)", "method": "full", "held_bound": hb, "batch": bf})
    ids, am = batch_prompts(bf, cfg.prompt_lengths, vocab, pad, seed=cfg.seed, device=cfg.device)
    contenders.append(Contender("full (DynamicCache, sdpa)", "full", full_cache(model), "sdpa", input_ids=ids,
                                attention_mask=am))
    for m in cfg.methods:
        try:
            probe = KVComposeCache(model, preset(m, budget=cfg.budget), budget=cfg.budget, seed=cfg.seed, **kw)
            interval = probe.interval
            formula = held_bound(m, p_max, cfg.new_tokens, cfg.budget, interval)
            # calibrate: one sequence with the longest prompt through two compression events; the buffers it
            # allocates (cache.memory().peak['allocated']) may exceed the formula (e.g. a prompt longer than
            # budget + interval is first held in a larger buffer)
            ids1, _ = batch_prompts(1, (p_max, p_max), vocab, pad, seed=cfg.seed, device=cfg.device)
            steps = min(cfg.new_tokens, 2 * interval + 2)
            cal = decode_interleaved(model, ids1, [Contender(m, "kvcompose", probe, model.config._attn_implementation)],
                                     steps)[0]
            if cal.error:
                raise KVComposeError(cal.error)
            measured = math.ceil(cal.peak_alloc_bytes / per_tok)
            hb = max(formula, measured)
            b = plan_batch(mem, per_tok, hb, cfg.max_batch)
            plans.append({"name": m, "method": m, "held_bound": hb, "held_formula": formula,
                          "held_calibrated": measured, "batch": b, "interval": interval})
            probe = KVComposeCache(model, preset(m, budget=cfg.budget), budget=cfg.budget, seed=cfg.seed, **kw)
            if b < 1:
                errors[m] = f"no sequence fits: {hb} tokens need {hb * per_tok / MIB:.1f} MiB"
                continue
            ids, am = batch_prompts(b, cfg.prompt_lengths, vocab, pad, seed=cfg.seed, device=cfg.device)
            contenders.append(Contender(m, "kvcompose", probe, model.config._attn_implementation, method=m,
                                        budget=cfg.budget, interval=interval, input_ids=ids, attention_mask=am))
        except Exception as e:  # noqa: BLE001
            errors[m] = f"{type(e).__name__}: {e}"
            log(f"{m}: {errors[m]}")
    for p in plans:
        log(f"plan: {p['name']}: held <= {p['held_bound']} tokens/sequence -> batch {p['batch']}")
    traces = decode_interleaved(model, None, contenders, cfg.new_tokens, progress=True, desc="throughput")
    rows = []
    for p, tr in zip([p for p in plans if p["batch"] >= 1 and p["method"] not in errors], traces):
        s = summarize(tr.step_seconds, tr.first_seen, batch=tr.batch, window=max(1, cfg.new_tokens // 16))
        total = tr.batch * len(tr.step_seconds) / (sum(tr.step_seconds) + tr.prefill_seconds) \
            if tr.step_seconds else math.nan
        rows.append({**p, "error": tr.error, "steps": s["steps"], "tokens_per_s": s["tokens_per_s"],
                     "tokens_per_s_with_prefill": total, "prefill_seconds": tr.prefill_seconds,
                     "decode_seconds": s["decode_seconds"], "windows": s["windows"],
                     "peak_kv_bytes": tr.peak_kv_bytes, "peak_alloc_bytes": tr.peak_alloc_bytes,
                     "planned_bytes": p["batch"] * p["held_bound"] * per_tok,
                     "fits": tr.peak_alloc_bytes <= mem, "compress_seconds": tr.compress_seconds,
                     "compress_share": tr.compress_seconds / s["decode_seconds"] if s["decode_seconds"] else math.nan})
    full = rows[0] if rows and rows[0]["method"] == "full" and not rows[0]["error"] else None
    for r in rows:
        r["vs_full"] = r["tokens_per_s"] / full["tokens_per_s"] if full else math.nan
        r["batch_vs_full"] = r["batch"] / full["batch"] if full else math.nan
    data = {
        "config": {**cfg.__dict__, "model": cfg.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
                   "threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", "")},
        "versions": versions(), "bytes_per_token": per_tok, "kv_memory_bytes": mem, "rows": rows, "errors": errors,
        "notes": ["All methods decode interleaved one step at a time in one process; only ratios are claimed "
                  "(the machine is noisy).",
                  "Peak KV: for kvcompose the allocated buffers (cache.memory().peak['allocated']), for DynamicCache "
                  "the held keys and values; 'fits' compares it with --kv-memory."],
        "elapsed_s": time.perf_counter() - t0,
    }
    (out / "throughput.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "throughput.md").write_text(throughput_markdown(data))
    plot_throughput(data, out / "throughput.png")
    log(f"wrote {out}/throughput.json, throughput.md, throughput.png in {data['elapsed_s']:.0f}s")
    return data


def throughput_markdown(data: dict[str, Any]) -> str:
    """The Markdown report of a `throughput.json`."""
    cfg = data.get("config", {})
    lo, hi = cfg.get("prompt_lengths", (0, 0))
    lines = [f"# Batched throughput in {cfg.get('kv_memory_mib')} MiB of KV: {cfg.get('model')}", "",
             f"{cfg.get('new_tokens')} greedy tokens per sequence, left-padded random prompts of {lo}-{hi} tokens, "
             f"budget {cfg.get('budget')}, {data.get('bytes_per_token')} KV bytes per token ({cfg.get('dtype')}), "
             f"{cfg.get('threads')} thread(s), batch cap {cfg.get('max_batch')}.", "",
             "| method | held bound / seq | batch | peak KV MiB (planned) | fits | tokens/s | with prefill | "
             "vs full | events share |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data.get("rows", []):
        share = "-" if r["method"] == "full" else f"{100 * r['compress_share']:.1f}%"
        lines.append(f"| {r['name']} | {r['held_bound']} | {r['batch']} | {r['peak_alloc_bytes'] / MIB:.1f} "
                     f"({r['planned_bytes'] / MIB:.1f}) | {'yes' if r['fits'] else 'NO'} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s_with_prefill']:.1f} | {r['vs_full']:.2f} | {share} |"
                     + (f" error: {r['error']}" if r.get("error") else ""))
    for m, e in (data.get("errors") or {}).items():
        lines.append(f"\n- {m}: {e}")
    lines += [""] + [f"- {n}" for n in data.get("notes", [])]
    if cfg.get("command"):
        lines += ["", f"Command: `{cfg['command']}`"]
    return "\n".join(lines) + "\n"


def plot_throughput(data: dict[str, Any], path) -> None:
    """Total tokens/s per method (bars, batch in the label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data.get("rows", [])
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.5 * max(1, len(rows))))
    names = [f"{r['name']} (batch {r['batch']})" for r in rows]
    vals = [r["tokens_per_s"] for r in rows]
    ax.barh(names, vals, color=["grey" if r["method"] == "full" else "tab:blue" for r in rows])
    for i, r in enumerate(rows):
        ax.text(vals[i], i, f" {r['vs_full']:.2f}x", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="total decode tokens/s", title=f"throughput in {data['config'].get('kv_memory_mib')} MiB of KV")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ command line
def add_parser(sub, add_model_flags: Callable, methods: list[str]) -> None:
    """Add `kvcompose bench throughput` to the `bench` subparsers `sub`."""
    p = sub.add_parser(
        "throughput", help="largest batch in a KV memory limit and its total tokens/s, full cache vs presets",
        description="For the full cache and each preset: the largest batch whose KV fits in --kv-memory MiB "
        "(from bytes per token and the held-length bound), then --new-tokens greedy tokens for that batch of "
        "left-padded prompts of different lengths, all methods interleaved in one process; total tokens/s and its "
        "ratio to the full cache's, with the measured peak KV checked against the limit. The defaults took 35 "
        "minutes on a busy 2-core CPU. One torch thread on CPU unless --threads.")
    p.add_argument("--kv-memory", type=float, default=128.0, help="KV memory per method in MiB (default 128)")
    p.add_argument("--methods", nargs="+", default=["streaming_llm", "tova", "rkv"],
                   choices=[m for m in methods if m != "full"], help="presets (default: streaming_llm tova rkv)")
    p.add_argument("--budget", type=int, default=256, help="budget (default 256)")
    p.add_argument("--interval", type=int, default=None, help="compression interval (default: each preset's own)")
    p.add_argument("--new-tokens", type=int, default=1024, help="generated tokens per sequence (default 1024)")
    p.add_argument("--prompt-lengths", nargs=2, type=int, default=[64, 192], metavar=("MIN", "MAX"),
                   help="prompt lengths spread over the batch (default 64 192)")
    p.add_argument("--max-batch", type=int, default=32, help="batch cap (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/throughput", help="output folder (default runs/throughput)")
    add_model_flags(p)


def main(args, command: str = "") -> int:
    """Run `kvcompose bench throughput` from parsed arguments."""
    run_throughput(ThroughputConfig(
        model=args.model, dtype=args.dtype, device=args.device, methods=args.methods, budget=args.budget,
        interval=args.interval, kv_memory_mib=args.kv_memory, new_tokens=args.new_tokens,
        prompt_lengths=tuple(args.prompt_lengths), max_batch=args.max_batch, seed=args.seed, threads=args.threads,
        out=args.out, command=command))
    return 0
