"""Which kvcompose files one ordinary decoded token crosses (docs/architecture.md, 'One decoded token, file by
file'): `sys.setprofile` over one decode step (no compression event) of a tiny 2-layer Llama, kvcompose's own
frames only, per preset.

    python benchmarks/decode_walk.py streaming_llm h2o
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

import kvcompose
from kvcompose import KVComposeCache, methods
from kvcompose.testing import tiny_model

ROOT = os.path.dirname(os.path.abspath(kvcompose.__file__)) + os.sep
# `kvcompose.attention.no_trace`'s wrapper only forwards the call (eager mode): its frames count as calls of
# attention.py, but an arrow goes from the wrapper's caller to the wrapped function, as if it were not there
PASS_THROUGH = (ROOT + "attention.py", "wrapper")  # (file, function name): no other `wrapper` there


def _passes_through(code) -> bool:
    return (code.co_filename, code.co_name) == PASS_THROUGH


def walk(name: str) -> dict:
    model = tiny_model("llama", layers=2)
    cache = KVComposeCache(model, methods.preset(name), budget=64, interval=64)
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    calls: collections.Counter = collections.Counter()
    arrows: set[tuple[str, str]] = set()

    def prof(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(ROOT):
            return
        here = frame.f_code.co_filename[len(ROOT):]
        calls[(here, frame.f_code.co_name)] += 1
        if _passes_through(frame.f_code):
            return
        back = frame.f_back
        while back is not None and (not back.f_code.co_filename.startswith(ROOT) or _passes_through(back.f_code)):
            back = back.f_back
        if back is not None and back.f_code.co_filename[len(ROOT):] != here:
            arrows.add((back.f_code.co_filename[len(ROOT):], here))

    with torch.no_grad():
        model(input_ids=ids[:, :10], past_key_values=cache)
        model(input_ids=ids[:, 10:11], past_key_values=cache)  # warm: first-step paths do not count
        sys.setprofile(prof)
        try:
            model(input_ids=ids[:, 11:12], past_key_values=cache)
        finally:
            sys.setprofile(None)
    files: dict[str, list[str]] = {}
    for (f, fn), _ in calls.items():
        files.setdefault(f, []).append(fn)
    return {"files": files, "calls": sum(calls.values()), "arrows": sorted(arrows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("presets", nargs="*", default=["streaming_llm", "h2o"])
    for name in ap.parse_args().presets:
        w = walk(name)
        print(f"{name}: {len(w['files'])} kvcompose files, {w['calls']} calls (2 layers)")
        for f, fns in w["files"].items():
            print(f"  {f:26s} {', '.join(sorted(set(fns)))}")
        print("  arrows (caller file -> callee file):", ", ".join(f"{a} -> {b}" for a, b in w["arrows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
