"""`python benchmarks/fidelity33.py estimate`: the timed sample behind the plan's cost estimates.

In one process, one thread: `--group-size` GSM8K prompts of one length with worked-solution traces of
`--sample-tokens` tokens (text the model reads; the cost of teacher forcing does not depend on who wrote it),
their references, then every pipeline's batched teacher forcing at B=128 (CPU seconds per row and processed
token: prompt + trace); with `--scaling`, H2O and SnapKV at B=128, 256 and 512 on 4 longer traces (the budget
factors); kvpress's SnapKV press when kvpress is installed, else a proxy (the decoder's one-token forwards at
the batch size plus the scoring); the results are merged into `--estimate` (JSON), so the sample can be taken
in pieces (`--methods`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _cpu(fn) -> float:
    c = time.process_time()
    fn()
    return time.process_time() - c


def estimate(args) -> int:
    import torch

    torch.set_num_threads(1)
    from fidelity33 import PIPELINE_FILES, method_lists

    from kvcompose import KVComposeCache
    from kvcompose.bench.common import load_model
    from kvcompose.data import load_questions
    from kvcompose.bench.fidelity import evaluate_batch, hidden_references
    from kvcompose.bench.run import _pipeline, load_pipelines, select_prompt_groups
    from kvcompose.traces import Trace, _worked_ids, prompt_ids

    data = args.data or os.environ.get("KVCOMPOSE_GSM8K")
    out = Path(args.estimate)
    est = json.loads(out.read_text()) if out.exists() else {}
    model, tok = load_model(args.model)
    qs = select_prompt_groups(tok, data, 1, args.group_size, seed=9)
    pool = load_questions(data, 100, 1100)

    def traces(n: int, tokens: int) -> list[Trace]:
        return [Trace(id=f"{q['id']}/worked", prompt_ids=prompt_ids(tok, q["question"]), question=q["question"],
                      trace_ids=_worked_ids(tok, q, pool, tokens, i), answer=None, kind="worked")
                for i, q in enumerate(qs[:n])]

    sample = traces(args.group_size, args.sample_tokens)
    p = len(sample[0].prompt_ids)
    rows = len(sample) * (p + args.sample_tokens)
    refs: list = []
    cpu = _cpu(lambda: refs.extend(hidden_references(model, sample, batch_size=len(sample))))
    cpu += _cpu(lambda: [r.reference_stats(model) for r in refs])
    est.update(refs_per_token=cpu / rows, prompt_tokens=p, group_size=args.group_size, threads=1)
    custom = {}
    for f in PIPELINE_FILES:
        custom.update(load_pipelines(f))
    lists = method_lists()
    names = [m for m in (args.methods or [m for v in lists.values() for m in v]) if m != "kvpress"]
    per = est.setdefault("per_token", {})
    load = est.setdefault("load", {})
    for m in names:
        try:
            make = lambda m=m, b=128: KVComposeCache(model, _pipeline(m, b, custom, model), budget=b,  # noqa: E731
                                                      interval=args.interval)
            cpu = _cpu(lambda: evaluate_batch(model, sample, make, references=refs))
        except Exception as e:  # noqa: BLE001 - a pipeline that cannot run here (a missing profile) is reported
            print(f"{m:40} not timed: {type(e).__name__}: {e}", flush=True)
            continue
        per[m] = cpu / rows
        load[m] = os.getloadavg()[0]
        print(f"{m:40} {per[m] * 1000:6.2f} ms per row-token ({cpu:5.1f} CPU s; load {load[m]:.1f})", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(est, indent=1))
    if args.scaling:
        long = traces(4, 896)
        lrefs = hidden_references(model, long, batch_size=4)
        for r in lrefs:
            r.reference_stats(model)
        factors: dict[str, list[float]] = {}
        for m in ("h2o", "snapkv"):
            base = None
            for b in args.budgets:
                make = lambda m=m, b=b: KVComposeCache(model, _pipeline(m, b, custom, model), budget=b,  # noqa: E731
                                                        interval=args.interval)
                cpu = _cpu(lambda: evaluate_batch(model, long, make, references=lrefs))
                base = base or cpu
                factors.setdefault(str(b), []).append(cpu / base)
                print(f"scaling {m} B={b}: {cpu:.1f} CPU s ({cpu / base:.2f}x B={args.budgets[0]})", flush=True)
        est["budget_factor"] = {b: sum(v) / len(v) for b, v in factors.items()}
    if args.methods is None or "kvpress" in (args.methods or []):
        est.update(_kvpress(model, sample, refs, args.group_size))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(est, indent=1))
    print(f"written {out}")
    return 0


def _kvpress(model, sample, refs, batch: int) -> dict:
    """kvpress's per row-token cost: measured on its SnapKV press when kvpress imports here, else the proxy."""
    import torch
    from transformers import DynamicCache

    from kvcompose.bench.scoring import RowScores

    n = 128
    try:
        from kvcompose.bench.kvpress_fidelity import evaluate_press_batch, make_press

        cut = [type(t)(**{**t.to_dict(), "trace_ids": t.trace_ids[:n]}) for t in sample]
        cpu = _cpu(lambda: evaluate_press_batch(model, cut, make_press("snapkv", 128), None))
        return {"kvpress_per_token": cpu / (len(cut) * n), "kvpress_source": "kvpress snapkv, measured"}
    except Exception as e:  # noqa: BLE001 - no kvpress here: the proxy
        why = f"{type(e).__name__}"
    dec = model.get_decoder()
    x = torch.tensor([t.prompt_ids for t in sample])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        dec(input_ids=x, past_key_values=cache, use_cache=True)
        ids = torch.tensor([t.trace_ids[:n] for t in sample])
        hidden = []
        score = RowScores(model, sample, refs)

        def steps():
            for i in range(n):
                hidden.append(dec(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True).last_hidden_state)
                if len(hidden) == 64:
                    score(i - 63, torch.cat(hidden, 1))
                    hidden.clear()

        cpu = _cpu(steps)
    per = cpu / (len(sample) * n)
    return {"kvpress_per_token": per, "generate_per_token": per,
            "kvpress_source": f"proxy ({why} importing kvpress): the decoder's one-token forwards at batch {batch} "
                              "over a full cache plus the scoring, without the press's own work"}
