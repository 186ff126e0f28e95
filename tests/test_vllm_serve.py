"""`vllm serve` with kvcompose: the flags `serve_args` prints parse with vLLM's own `vllm serve` parser into an
engine whose settings kvcompose's scheduler accepts, kvcompose's plugin entry point is installed, and a real
`vllm serve` (a subprocess on 127.0.0.1, a tiny model) serves 16 concurrent OpenAI completions, some naming
their own pipeline through `vllm_xargs`, one malformed: that one gets an HTTP 400 naming the problem, the
others the tokens of an offline `LLM.generate` run of the same settings; the server keeps serving and shuts
down on SIGINT. Skipped without vLLM (its own virtualenv: docs/serving.md)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from vllm_support import VLLM_CLI, free_port, tiny_llama  # noqa: E402


def _parse(flags: list[str]):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", *flags])
    return AsyncEngineArgs.from_cli_args(args)


def test_serve_flags_parse_into_a_kvcompose_engine():
    from kvcompose.integrations.vllm import ADMISSION_CLS, SCHEDULER_CLS, WORKER_CLS, serve_args
    from kvcompose.integrations.vllm.rules import CONFIG_KEY, engine_settings

    ea = _parse(serve_args("rkv", 512, preset_args={"window": 8}))
    assert ea.scheduler_cls == SCHEDULER_CLS and ea.worker_cls == WORKER_CLS
    assert ea.logits_processors == [ADMISSION_CLS]  # the front end's request check
    assert ea.block_size == 32 and ea.enable_prefix_caching is False and ea.async_scheduling is False
    cfg = ea.additional_config[CONFIG_KEY]
    s = engine_settings(cfg, ea.block_size)
    assert repr(s.pipeline) == "rkv(lam=0.1)" and (s.budget, s.interval) == (512, 128)


def test_plugin_entry_point_is_installed():
    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kvcompose"]
    assert eps and eps[0].value == "kvcompose.integrations.vllm.plugin:register"
    eps[0].load()()  # registers kvcompose's backends in this process (idempotent)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CPU_ATTN.get_path().endswith("KVComposeCPUAttentionBackend")


# -- a real server ---------------------------------------------------------------------------------------
ENGINE = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16",
          "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", "--skip-tokenizer-init"]
NEW = 48
BAD = 11  # the malformed request of `_jobs`


def _jobs():
    """16 requests: prompts of 9-84 tokens; the engine's rkv (budget 64, interval 32), their own snapkv,
    streaming_llm and seeded random_attention as JSON text in `vllm_xargs`, and one malformed (its budget is not
    whole blocks)."""
    own = [None, {"preset": "snapkv", "budget": 64, "interval": 32},
           {"preset": "streaming_llm", "budget": 96, "interval": 32},
           {"preset": "random_attention", "budget": 64, "interval": 32, "seed": 7}]
    jobs = []
    for i in range(16):
        prompt = [(11 * i + 5 * j) % 500 + 3 for j in range(9 + 5 * i)]
        cfg = {"budget": 100} if i == BAD else own[i % 4]
        jobs.append((prompt, None if cfg is None else json.dumps(cfg)))
    return jobs


def _offline(model: str, jobs) -> list[list[int]]:
    """The good jobs' tokens from `LLM.generate` with the same settings (the same JSON text in `extra_args`), and
    the malformed one refused by the front end before it enters the engine. The engine is shut down after."""
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    from kvcompose.integrations.vllm import engine_kwargs

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=16,
              kv_cache_memory_bytes=64 << 20, seed=0, skip_tokenizer_init=True,
              **engine_kwargs("rkv", 64, interval=32))
    try:
        sp = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                             extra_args=None if x is None else {"kvcompose": x}) for _, x in jobs]
        good = [i for i in range(len(jobs)) if i != BAD]
        bad = [BAD]
        with pytest.raises(VLLMValidationError, match="budget=100 is not a whole number of vLLM blocks"):
            llm.generate([TokensPrompt(prompt_token_ids=jobs[i][0]) for i in bad], [sp[i] for i in bad],
                         use_tqdm=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=jobs[i][0]) for i in good], [sp[i] for i in good],
                            use_tqdm=False)
        assert llm.collective_rpc("kvcompose_stats")[0]["events"] > 0
        tokens: list = [None] * len(jobs)
        for i, o in zip(good, outs):
            tokens[i] = list(o.outputs[0].token_ids)
        return tokens
    finally:
        llm.llm_engine.engine_core.shutdown()  # one vLLM engine at a time: this one ends before the server starts
        del llm


def _wait_up(proc, url: str, log: str, timeout: float = 300.0) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            with open(log) as f:
                raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{f.read()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"vllm serve did not come up in {timeout} s")


def test_vllm_serve_over_http(tmp_path):
    """The command docs/serving.md gives (`vllm serve MODEL` + `serve_args(...)` flags), 16 concurrent requests
    through the `openai` client, one of them malformed."""
    import httpx
    import openai

    from kvcompose.integrations.vllm import serve_args

    model = tiny_llama(str(tmp_path / "model"))
    jobs = _jobs()
    offline = _offline(model, jobs)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = str(tmp_path / "serve.log")
    cmd = [sys.executable, "-c", VLLM_CLI, "serve", model, "--host", "127.0.0.1", "--port", str(port), *ENGINE,
           *serve_args("rkv", 64, interval=32)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_up(proc, url, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

        def complete(job):
            prompt, cfg = job
            body = {"ignore_eos": True, "return_token_ids": True}
            if cfg is not None:
                body["vllm_xargs"] = {"kvcompose": cfg}
            try:
                r = client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0.0,
                                              extra_body=body)
            except openai.APIStatusError as e:
                return e
            return r.choices[0].token_ids

        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(complete, jobs))
        for i, (want, res) in enumerate(zip(offline, got)):
            if want is None:  # the malformed one: refused by the front end, the message names the problem
                assert isinstance(res, openai.BadRequestError) and res.status_code == 400, res
                assert "kvcompose: budget=100 is not a whole number of vLLM blocks of 32 tokens" in res.message, res
            else:
                assert res == want, (i, jobs[i][1])
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # still up, and still serving:
        assert complete(jobs[1]) == offline[1]
    finally:
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    assert code == 0, f"vllm serve did not exit cleanly on SIGINT within 60 s (exit {code})"
    assert time.time() - t0 < 60
