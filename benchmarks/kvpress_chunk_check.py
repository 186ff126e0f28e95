#!/usr/bin/env python3
"""Does feeding kvpress's presses in chunks change what the fidelity bench measures? On the real model and
real traces, each press in `kvpress_fidelity.CHUNKABLE` (and SnapKV, the control that must differ) is scored
both ways: one trace token per forward call at `compression_interval=interval` (kvpress's protocol) and
`interval` tokens per call at `compression_interval=1` (the bench's default for `CHUNKABLE`). Prints, per
press and budget, the largest difference of a trace's mean KL and top-1 between the two, and the cost ratio.

    python benchmarks/kvpress_chunk_check.py --traces runs/f33/explore/traces.json --prompts 8 --tokens 256

Runs where kvpress is installed (`.venv-tf52`); one torch thread. Exact ties (KnormPress at layer 0: RoPE keeps
a key's norm, so repeats of one token tie) are broken by float rounding, which the two protocols round
differently: such a press may keep another of the tied tokens, the source of what differences remain.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True, help="a traces.json of the fidelity bench (its `items`)")
    ap.add_argument("--prompts", type=int, default=8, help="traces of one equal-length group (default 8)")
    ap.add_argument("--tokens", type=int, default=256, help="trace tokens scored (default 256)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[128])
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--presses", nargs="+", default=None, help="default: CHUNKABLE and snapkv")
    ap.add_argument("--model", default=None)
    ap.add_argument("--alone", action="store_true",
                    help="also score each prompt alone, one token per call: how far kvpress's own protocol moves "
                         "with the batch (the yardstick for the chunks' differences)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)

    import torch

    from kvcompose.bench.common import load_model, versions
    from kvcompose.bench.fidelity import FidelityResult, hidden_references
    from kvcompose.bench.kvpress_fidelity import CHUNKABLE, evaluate_press_batch, make_press, press_batches
    from kvcompose.traces import Trace

    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    model, _ = load_model(a.model)
    items = [Trace.from_dict(d) for d in json.loads(Path(a.traces).read_text())["items"]]
    items = [replace(t, trace_ids=t.trace_ids[: a.tokens]) for t in items if len(t.trace_ids) >= a.tokens]
    group = max(press_batches(items, a.prompts), key=len)
    refs = hidden_references(model, group, batch_size=len(group))
    presses = a.presses or sorted(CHUNKABLE) + ["snapkv"]
    rows = []
    for name in presses:
        for b in a.budgets:
            out = {}
            for chunked in (False, True):
                ok = chunked and name in CHUNKABLE
                press = make_press(name, b, interval=a.interval, chunked=ok)
                if chunked and not ok:  # the control: the refused mode, built by hand
                    press.compression_interval = 1
                t0 = time.perf_counter()
                out[chunked] = (evaluate_press_batch(model, group, press, refs, chunk=a.interval if chunked else 1),
                                time.perf_counter() - t0)
            (one, t1), (many, t2) = out[False], out[True]
            per = [(FidelityResult([x]), FidelityResult([y])) for x, y in zip(one, many)]  # each prompt's means
            kl = [x.kl_mean for x, _ in per]
            dkl = max(abs(x.kl_mean - y.kl_mean) for x, y in per)
            dtop = max(abs(x.top1 - y.top1) for x, y in per)
            row = {"press": name, "budget": b, "chunkable": name in CHUNKABLE, "prompts": len(group),
                   "tokens": a.tokens, "mean_kl": sum(kl) / len(kl), "max_trace_kl_diff": dkl,
                   "max_trace_kl_rel_diff": dkl / max(min(kl), 1e-12), "max_trace_top1_diff": dtop,
                   "seconds_one_token": t1, "seconds_chunks": t2, "cost_ratio": t2 / t1}
            if a.alone:
                alone = [FidelityResult(evaluate_press_batch(model, [t], make_press(name, b, interval=a.interval),
                                                             [r])) for t, r in zip(group, refs)]
                row["max_trace_kl_diff_alone"] = max(abs(x.kl_mean - y.kl_mean) for (x, _), y in zip(per, alone))
            rows.append(row)
            print(f"{name:20s} B={b:4d} {'chunkable' if row['chunkable'] else 'control  '} mean KL {row['mean_kl']:.5f}  "
                  f"max |dKL| per trace {dkl:.2e} ({row['max_trace_kl_rel_diff']:.1e} rel)  max |dtop1| {dtop:.5f}  "
                  f"cost {t2:.1f} s / {t1:.1f} s = {t2 / t1:.2f}x"
                  + (f"  (one token per call, alone vs batched: {row['max_trace_kl_diff_alone']:.2e})" if a.alone else ""),
                  flush=True)
    res = {"command": "python benchmarks/kvpress_chunk_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "load_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)], "versions": versions(), "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
