#!/usr/bin/env python3
"""ReCo's step-attributed eviction at equal budget (docs/reco.md): delete the tokens of high-reward steps
vs the same number of tokens at random, vs the plain base method, on SmolLM2-135M-Instruct and GSM8K.

Every variant keeps the same budget per layer and KV head, protects the same 8 newest tokens (R-KV's
window) and compresses at the same events (`--interval`), so each event deletes the same number of tokens;
only which tokens differs:

- `rkv`: R-KV's ranking (importance minus redundancy);
- `reco`: ReCo's rule (`methods.reco_evict`, order "reward"): tokens of the completed step of highest
  reward first, R-KV's score inside a step; prompt and the step being written rank above completed steps;
- `reco-inverse`: the same, lowest reward first (does the sign matter?);
- `reco-random-steps`: the same, whole steps in a random order (does the reward matter, or only evicting
  whole steps while keeping the prompt?);
- `random`: uniform random tokens (the paper's "same number at random": `RandomDrop`, same protection).

Two measurements:

1. Teacher-forced fidelity: sampled full-cache traces (`make_traces(kind="sampled")`) fed in chunks of the
   interval; top-1 agreement and KL(full || method) per trace token. Steps and rewards come from one
   `RewardTracker` pass over the trace with the full cache's distributions (`StepReplay`), revealed as a live
   tracker would have them at each event, so every variant sees the same steps and rewards.
2. Free generation: greedy answers (batch 1) with a live `RewardTracker` fed by `RewardTrackingProcessor`
   (rewards from each method's own distributions); final-number agreement with the full cache, exact match
   with GSM8K's answer, generated tokens.

    python benchmarks/reco_eviction.py --data path/to/gsm8k/test.jsonl --n 4 --new-tokens 768 \\
        --budgets 128 256 --free-n 6 --free-tokens 256 --free-budget 128 --out runs/reco_eviction
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompose import KVComposeCache, Pipeline, ProtectRecent, RandomDrop, methods  # noqa: E402
from kvcompose.bench.fidelity import Trace, extract_answer, gsm8k_answer, load_questions, make_traces  # noqa: E402
from kvcompose.models import chat_inputs, load_default_model  # noqa: E402
from kvcompose.reco import RewardTracker, RewardTrackingProcessor, StepReplay, StepSegmenter  # noqa: E402

SEGMENTERS = {
    "default": lambda: StepSegmenter(),  # blank lines and "Step k" markers (the library default)
    "sentences": lambda: StepSegmenter(sentence_ends=True),  # also sentence ends
}

VARIANTS = ["rkv", "reco", "reco-inverse", "reco-random-steps", "random"]


def reco_pipeline(name: str, source, seed: int = 0) -> Pipeline:
    base = methods.rkv()
    if name == "rkv":
        return base
    if name == "random":
        return Pipeline(ProtectRecent(8), RandomDrop(), name="random(recent=8)")
    order = {"reco": "reward", "reco-inverse": "inverse", "reco-random-steps": "random"}[name]
    return methods.reco_evict(source, base, order=order, seed=seed)


@torch.no_grad()
def full_logits(model, trace: Trace, chunk: int = 256) -> torch.Tensor:
    """`[N, V]` float32 log-probs of the full cache predicting each trace token."""
    cache = DynamicCache(config=model.config)
    ids = [*trace.prompt_ids, *trace.trace_ids[:-1]]
    p = len(trace.prompt_ids)
    out = [model(input_ids=torch.tensor([trace.prompt_ids]), past_key_values=cache, logits_to_keep=1).logits[0]]
    for s in range(p, len(ids), chunk):
        out.append(model(input_ids=torch.tensor([ids[s: s + chunk]]), past_key_values=cache).logits[0])
    return torch.log_softmax(torch.cat(out).float(), dim=-1)


@torch.no_grad()
def teacher_force(model, trace: Trace, ref: torch.Tensor, pipe: Pipeline, replay: StepReplay | None, budget: int,
                  interval: int, seed: int) -> dict:
    """Prefill, then the trace in chunks ending at multiples of `interval` decoded tokens (what one-token
    decoding would compress at); the replay shows the tracker's state of the chunk's last forward pass."""
    cache = KVComposeCache(model, pipe, budget=budget, interval=interval, seed=seed)
    if replay is not None:
        replay.reset()
    logits = [model(input_ids=torch.tensor([trace.prompt_ids]), past_key_values=cache, logits_to_keep=1).logits[0]]
    ids = trace.trace_ids[:-1]
    for s in range(0, len(ids), interval):
        e = min(s + interval, len(ids))
        if replay is not None:
            replay.advance(e - 1)  # feeding token e-1, a live tracker has read tokens < e-1
        logits.append(model(input_ids=torch.tensor([ids[s:e]]), past_key_values=cache).logits[0])
    logp = torch.log_softmax(torch.cat(logits).float(), dim=-1)
    kl = (ref.exp() * (ref - logp)).sum(-1)
    top1 = (ref.argmax(-1) == logp.argmax(-1)).float()
    mem = cache.memory()
    return {"kl": kl.tolist(), "top1": top1.tolist(), "events": sum(layer.events for layer in cache.layers),
            "peak_kv_bytes": mem.peak["hbm"]}


@torch.no_grad()
def free_generate(model, tok, question: str, pipe: Pipeline | None, tracker: RewardTracker, budget: int,
                  interval: int, max_new: int, seed: int) -> dict:
    inputs = chat_inputs(tok, question)
    tracker.reset()
    cache = KVComposeCache(model, pipe if pipe is not None else methods.full(), budget=None if pipe is None else budget,
                           interval=interval, seed=seed)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new, do_sample=False, temperature=None,
                         top_p=None, top_k=None, logits_processor=LogitsProcessorList([RewardTrackingProcessor(tracker)]),
                         pad_token_id=model.generation_config.pad_token_id)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    n = next((i for i, t in enumerate(new) if t == eos), len(new))
    text = tok.decode(new[:n], skip_special_tokens=True)
    return {"text": text, "answer": extract_answer(text), "tokens": n, "steps": len(tracker.rewards_of(0)),
            "events": sum(layer.events for layer in cache.layers)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("KVCOMPOSE_GSM8K"), help="GSM8K test.jsonl (default $KVCOMPOSE_GSM8K)")
    ap.add_argument("--n", type=int, default=4, help="teacher-forced questions")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=768, help="tokens per reference trace")
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--interval", type=int, default=64, help="decoded tokens between events (the same for all)")
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--free-n", type=int, default=6, help="free-generation questions (0: skip)")
    ap.add_argument("--free-offset", type=int, default=0)
    ap.add_argument("--free-tokens", type=int, default=256)
    ap.add_argument("--free-budget", type=int, default=128)
    ap.add_argument("--steps", default="sentences", choices=sorted(SEGMENTERS),
                    help="step segmentation: 'sentences' (blank lines, Step markers and sentence ends; default: "
                    "SmolLM2 writes few blank lines) or 'default' (the library's: blank lines and Step markers)")
    ap.add_argument("--traces", default=None, help="JSON of reference traces: loaded if it exists, else written")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/reco_eviction", help="output folder (results.json, table.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    model, tok = load_default_model()
    print(f"model loaded in {time.time() - t0:.0f}s", flush=True)
    res: dict = {"command": "python benchmarks/reco_eviction.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "teacher_forced": [], "free": []}

    if args.n:
        if args.traces and os.path.exists(args.traces):
            traces = [Trace.from_dict(d) for d in json.load(open(args.traces))]
        else:
            traces = make_traces(model, tok, load_questions(args.data, args.n, args.offset), new_tokens=args.new_tokens,
                                 kind="sampled", seed=args.seed)
            if args.traces:
                json.dump([t.to_dict() for t in traces], open(args.traces, "w"))
        for tr in traces:
            ref = full_logits(model, tr)
            replay = StepReplay.from_logits(tok, tr.prompt_ids, tr.trace_ids, ref,
                                            tracker=RewardTracker(tok, segmenter=SEGMENTERS[args.steps]()))
            other = StepReplay.from_logits(tok, tr.prompt_ids, tr.trace_ids, ref)  # the default segmentation
            res.setdefault("steps_default_segmenter", {})[tr.id] = len(other.ends)
            print(f"{tr.id}: prompt {len(tr.prompt_ids)}, trace {len(tr.trace_ids)}, {len(replay.ends)} steps, "
                  f"rewards {min(replay.rewards, default=0):.3f}-{max(replay.rewards, default=0):.3f}", flush=True)
            for budget in args.budgets:
                for v in args.variants:
                    t = time.time()
                    r = teacher_force(model, tr, ref, reco_pipeline(v, replay, args.seed), replay, budget,
                                      args.interval, args.seed)
                    rec = {"trace": tr.id, "budget": budget, "variant": v, "prompt": len(tr.prompt_ids),
                           "steps": len(replay.ends), **r}
                    res["teacher_forced"].append(rec)
                    print(f"  B={budget} {v:18s} top1={sum(r['top1']) / len(r['top1']):.4f} "
                          f"KL={sum(r['kl']) / len(r['kl']):.4f} events={r['events']} ({time.time() - t:.0f}s)", flush=True)
            json.dump(res, open(os.path.join(args.out, "results.json"), "w"))

    if args.free_n:
        qs = load_questions(args.data, args.free_n, args.free_offset)
        tracker = RewardTracker(tok, segmenter=SEGMENTERS[args.steps]())
        for q in qs:
            gold = gsm8k_answer(q.get("answer"))
            full = free_generate(model, tok, q["question"], None, tracker, args.free_budget, args.interval,
                                 args.free_tokens, args.seed)
            res["free"].append({"id": q["id"], "variant": "full", "gold": gold, **full})
            print(f"{q['id']}: full {full['tokens']} tokens -> {full['answer']} (gold {gold}), {full['steps']} steps",
                  flush=True)
            for v in args.variants:
                t = time.time()
                r = free_generate(model, tok, q["question"], reco_pipeline(v, tracker, args.seed), tracker,
                                  args.free_budget, args.interval, args.free_tokens, args.seed)
                res["free"].append({"id": q["id"], "variant": v, "gold": gold, **r})
                print(f"  {v:18s} {r['tokens']} tokens -> {r['answer']} events={r['events']} ({time.time() - t:.0f}s)",
                      flush=True)
            json.dump(res, open(os.path.join(args.out, "results.json"), "w"))
    res["seconds"] = round(time.time() - t0)
    json.dump(res, open(os.path.join(args.out, "results.json"), "w"))
    md = markdown(res)
    open(os.path.join(args.out, "table.md"), "w").write(md)
    print(md)
    return res


def markdown(res: dict) -> str:
    lines = []
    tf = res["teacher_forced"]
    if tf:
        one = [r for r in tf if r["budget"] == tf[0]["budget"] and r["variant"] == tf[0]["variant"]]
        lines += [f"Teacher-forced ({len(one)} traces, {sum(len(r['kl']) for r in one)} scored tokens per row):", "",
                  "| budget | variant | top-1 | KL (nats) | KL vs R-KV | events |", "|---:|---|---:|---:|---:|---:|"]
        for b in sorted({r["budget"] for r in tf}):
            base = None
            for v in VARIANTS:
                rs = [r for r in tf if r["budget"] == b and r["variant"] == v]
                if not rs:
                    continue
                top1 = sum(sum(r["top1"]) for r in rs) / sum(len(r["top1"]) for r in rs)
                kl = sum(sum(r["kl"]) for r in rs) / sum(len(r["kl"]) for r in rs)
                base = kl if v == "rkv" else base
                rel = f"{kl / base:.2f}x" if base else ""
                lines.append(f"| {b} | {v} | {top1:.4f} | {kl:.4f} | {rel} | {sum(r['events'] for r in rs)} |")
        lines.append("")
    fr = res["free"]
    if fr:
        ids = sorted({r["id"] for r in fr}, key=lambda x: int(x.split("-")[-1]) if x.split("-")[-1].isdigit() else 0)
        full = {r["id"]: r for r in fr if r["variant"] == "full"}
        lines += [f"Free generation ({len(ids)} questions, greedy):", "",
                  "| variant | agree w/ full | exact match | mean tokens | events |", "|---|---:|---:|---:|---:|"]
        for v in ["full", *VARIANTS]:
            rs = [r for r in fr if r["variant"] == v]
            if not rs:
                continue
            agree = sum(r["answer"] is not None and r["answer"] == full[r["id"]]["answer"] for r in rs)
            exact = sum(r["answer"] is not None and r["gold"] is not None and r["answer"] == r["gold"] for r in rs)
            lines.append(f"| {v} | {agree}/{len(rs)} | {exact}/{len(rs)} | {sum(r['tokens'] for r in rs) / len(rs):.1f} | "
                         f"{sum(r['events'] for r in rs)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
