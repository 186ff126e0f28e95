"""The lm-evaluation-harness model `kvcompose` (kvcompose.integrations.lm_eval) on a local task
(tests/data/lm_eval_tasks: a task YAML over tests/data/tiny_math.jsonl, generate_until) with a tiny model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from kvcompose import KVComposeError  # noqa: E402
from kvcompose.testing import save_tiny_chat_model, tiny_chat_model  # noqa: E402
from kvcompose.integrations.lm_eval import KVComposeLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval_tasks"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)  # indexing lm-eval's own tasks takes ~30 s


def test_registered_under_kvcompose():
    from lm_eval.api.registry import get_model

    assert get_model("kvcompose") is KVComposeLM


def test_simple_evaluate_with_a_compressing_cache(task_manager):
    model, tok = tiny_chat_model()
    lm = KVComposeLM(pretrained=model, tokenizer=tok, method="h2o", budget=16, interval=8, batch_size=2)
    res = lm_eval.simple_evaluate(model=lm, tasks=["kvcompose_tiny_math"], limit=2, task_manager=task_manager,
                                  log_samples=True)
    r = res["results"]["kvcompose_tiny_math"]
    assert r["sample_len"] == 2 and 0.0 <= r["exact_match,none"] <= 1.0
    samples = res["samples"]["kvcompose_tiny_math"]
    assert len(samples) == 2 and all(isinstance(s["resps"][0][0], str) for s in samples)
    # one generate call for the batch of 2, through a compressing cache that did compress
    assert len(lm.cache_log) == 1 and lm.cache_log[0]["rows"] == 2
    assert lm.cache_log[0]["compress_calls"] > 0
    assert lm.cache_log[0]["peak_kv_bytes"] < lm.cache_log[0]["full_cache_bytes"]


def test_same_generations_as_hf_with_the_full_preset(task_manager):
    """method=full goes through the same lm-eval path as HFLM and gives the same greedy text."""
    from lm_eval.models.huggingface import HFLM

    model, tok = tiny_chat_model()
    ours = lm_eval.simple_evaluate(model=KVComposeLM(pretrained=model, tokenizer=tok, method="full", batch_size=1),
                                   tasks=["kvcompose_tiny_math"], limit=2, task_manager=task_manager, log_samples=True)
    model2, tok2 = tiny_chat_model()
    ref = lm_eval.simple_evaluate(model=HFLM(pretrained=model2, tokenizer=tok2, batch_size=1),
                                  tasks=["kvcompose_tiny_math"], limit=2, task_manager=task_manager, log_samples=True)
    texts = lambda r: [s["resps"][0][0] for s in r["samples"]["kvcompose_tiny_math"]]  # noqa: E731
    assert texts(ours) == texts(ref) and all(len(t) > 0 for t in texts(ours))


def test_loglikelihood_is_scored_with_the_full_cache():
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok = tiny_chat_model()
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=("Ann has 3 cats", " and 4 dogs"), idx=i)
            for i in range(2)]
    ours = KVComposeLM(pretrained=model, tokenizer=tok, method="h2o", budget=16, interval=8).loglikelihood(reqs)
    ref = HFLM(pretrained=model, tokenizer=tok).loglikelihood(reqs)
    assert [round(a[0], 4) for a in ours] == [round(b[0], 4) for b in ref] and ours[0][0] < 0


def test_bad_model_args():
    model, tok = tiny_chat_model()
    with pytest.raises(KVComposeError, match="unknown method"):
        KVComposeLM(pretrained=model, tokenizer=tok, method="nope", budget=16)
    with pytest.raises(KVComposeError, match="budget"):
        KVComposeLM(pretrained=model, tokenizer=tok, method="rkv")
    with pytest.raises(KVComposeError, match="integer"):
        KVComposeLM(pretrained=model, tokenizer=tok, method="rkv", budget="lots")
    with pytest.raises(KVComposeError, match="tokenizer"):
        KVComposeLM(pretrained=model, method="full")


@pytest.mark.slow  # lm-eval's CLI indexes all its built-in tasks first: ~30 s on 2 cores
def test_command_line_with_model_args(tmp_path):
    """`python -m kvcompose.integrations.lm_eval` = lm-eval's CLI with `--model kvcompose` registered."""
    tiny = save_tiny_chat_model(tmp_path / "tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvcompose.integrations.lm_eval", "--model", "kvcompose", "--model_args",
         f"pretrained={tiny},method=streaming_llm,budget=16,interval=8,dtype=float32", "--device", "cpu",
         "--include_path", str(TASKS), "--tasks", "kvcompose_tiny_math", "--limit", "2", "--batch_size", "2",
         "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvcompose_tiny_math" in proc.stdout and "exact_match" in proc.stdout
    results = list((tmp_path / "out").rglob("results_*.json"))
    assert len(results) == 1
    data = json.loads(results[0].read_text())
    assert data["config"]["model"] == "kvcompose"
    assert data["config"]["model_args"]["method"] == "streaming_llm" and data["config"]["model_args"]["budget"] == 16
    assert "exact_match,none" in data["results"]["kvcompose_tiny_math"]
