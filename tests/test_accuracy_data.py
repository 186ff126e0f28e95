"""Where the benchmarks' questions come from (kvcompose.data): local JSONL, the Hugging Face hub (a fake
loader here: the hub is not reachable from CI), $KVCOMPOSE_GSM8K, and the error when there is none."""

import json
import os
import subprocess
import sys

import pytest

from kvcompose import KVComposeError
from kvcompose import data


@pytest.fixture
def jsonl(tmp_path):
    p = tmp_path / "q.jsonl"
    rows = [{"question": "Q0?", "answer": "#### 1"}, {"problem": "P1?", "answer": "\\frac{1}{2}", "id": "x1"},
            {"question": "Q2?"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return p


def test_load_questions_fields_ids_and_slices(jsonl):
    qs = data.load_questions(jsonl)
    assert [q["id"] for q in qs] == ["q-0", "x1", "q-2"]
    assert [q["question"] for q in qs] == ["Q0?", "P1?", "Q2?"]
    assert [q["answer"] for q in qs] == ["#### 1", "\\frac{1}{2}", None]
    assert [q["id"] for q in data.load_questions(jsonl, 1, offset=1)] == ["x1"]
    with pytest.raises(KVComposeError, match="--data"):
        data.load_questions(jsonl.parent / "missing.jsonl")
    bad = jsonl.parent / "bad.jsonl"
    bad.write_text('{"text": "no question"}\n')
    with pytest.raises(KVComposeError, match="question"):
        data.load_questions(bad)
    bad.write_text("not json\n")
    with pytest.raises(KVComposeError, match="not a JSON line"):
        data.load_questions(bad)


def _fake_hub(rows_by_repo):
    calls = []

    def loader(spec):
        calls.append((spec.repo, spec.config, spec.split))
        return rows_by_repo[spec.repo]

    return loader, calls


def test_hub_datasets_are_mapped_with_a_fake_loader():
    loader, calls = _fake_hub({
        "HuggingFaceH4/MATH-500": [{"problem": f"p{i}", "answer": f"{i}/2", "unique_id": f"test/x/{i}.json",
                                    "solution": "..."} for i in range(5)],
        "openai/gsm8k": [{"question": "q", "answer": "w\n#### 3"}],
        "HuggingFaceH4/aime_2024": [{"problem": "a", "answer": "204", "id": 60}],
        "yentinglin/aime_2025": [{"problem": "b", "answer": "70", "id": "I-1"}],
    })
    qs = data.load_hf_dataset("math500", n=2, offset=1, loader=loader)
    assert qs == [{"id": "math500-test/x/1.json", "question": "p1", "answer": "1/2"},
                  {"id": "math500-test/x/2.json", "question": "p2", "answer": "2/2"}]
    assert data.load_hf_dataset("gsm8k", loader=loader) == [{"id": "gsm8k-0", "question": "q", "answer": "w\n#### 3"}]
    assert data.load_hf_dataset("aime24", loader=loader)[0]["id"] == "aime24-60"
    assert data.load_hf_dataset("aime25", loader=loader)[0]["answer"] == "70"
    assert calls[:2] == [("HuggingFaceH4/MATH-500", None, "test"), ("openai/gsm8k", "main", "test")]
    qs, source = data.resolve_questions(dataset="aime25", loader=loader)
    assert source == "yentinglin/aime_2025" and qs[0]["question"] == "b"
    with pytest.raises(KVComposeError, match="unknown dataset"):
        data.load_hf_dataset("mmlu", loader=loader)
    with pytest.raises(KVComposeError, match="lacks"):
        data.load_hf_dataset("gsm8k", loader=lambda spec: [{"text": "x"}])


def test_offline_hub_error_says_both_ways():
    def offline(spec):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    with pytest.raises(KVComposeError) as e:
        data.resolve_questions(dataset="gsm8k", loader=offline)
    msg = str(e.value)
    assert "--data FILE.jsonl" in msg and "network access" in msg and "openai/gsm8k" in msg


def test_no_source_error_and_env(monkeypatch, jsonl):
    monkeypatch.delenv(data.ENV_GSM8K, raising=False)
    with pytest.raises(KVComposeError) as e:
        data.resolve_questions()
    assert "--data" in str(e.value) and "--dataset" in str(e.value) and data.ENV_GSM8K in str(e.value)
    with pytest.raises(KVComposeError, match="not both"):
        data.resolve_questions(data=jsonl, dataset="gsm8k")
    monkeypatch.setenv(data.ENV_GSM8K, str(jsonl))
    qs, source = data.resolve_questions(n=2)
    assert source == str(jsonl) and len(qs) == 2
    monkeypatch.setenv(data.ENV_GSM8K, str(jsonl.parent / "gone.jsonl"))
    assert data.default_data_path() is None


def test_real_datasets_loader_offline_gives_the_clear_error(tmp_path):
    """The real `datasets.load_dataset` with the hub switched off and an empty cache (as on CI)."""
    pytest.importorskip("datasets")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = ("from kvcompose.data import resolve_questions\n"
            "from kvcompose import KVComposeError\n"
            "try:\n    resolve_questions(dataset='math500')\nexcept KVComposeError as e:\n    print('ERR', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ERR could not load HuggingFaceH4/MATH-500") and "--data FILE.jsonl" in proc.stdout


@pytest.mark.skipif(not os.environ.get("KVCOMPOSE_GSM8K"), reason="set KVCOMPOSE_GSM8K to GSM8K's test.jsonl")
def test_gsm8k_from_the_environment():
    qs, source = data.resolve_questions(n=5, offset=10)
    assert source == os.environ["KVCOMPOSE_GSM8K"] and len(qs) == 5
    assert qs[0]["id"].endswith("-10") and all("####" in q["answer"] for q in qs)
