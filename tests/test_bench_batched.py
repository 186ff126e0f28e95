"""Batched teacher forcing (`kvcompose.bench.fidelity.evaluate_batch`): every row of a left-padded batch is
scored as if it ran alone: the same kept positions after every chunk, the same held tokens, and the same
per-token KL / top-1 within float tolerance."""

import pytest
import torch

from kvcompose import KVComposeCache, KVComposeError, methods
from kvcompose.bench.fidelity import (
    Trace, clear_reference_cache, evaluate_batch, evaluate_trace, hidden_references,
)
from kvcompose.testing import tiny_model
from kvcompose.view import FAR_POSITION

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET, INTERVAL = 16, 8


def _trace(seed: int, prompt: int, n: int = 40, vocab: int = 128) -> Trace:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (prompt + n + 10,), generator=g).tolist()
    return Trace(id=f"t{seed}", prompt_ids=ids[:prompt], trace_ids=ids[prompt : prompt + n], question="q",
                 answer=None, kind="sampled", recall_ids=ids[prompt + n : prompt + n + 4],
                 recall_target_ids=ids[prompt + n + 4 :])


def _kept(cache, row: int, pad: int) -> list[list[list[int]]]:
    """Kept positions of one row, per layer and KV head, with the row's left padding taken off."""
    out = []
    for layer in cache.layers:
        pos, valid = layer.positions[row], layer.valid[row]
        out.append([(p[v & (p < FAR_POSITION)] - pad).tolist() for p, v in zip(pos, valid)])
    return out


# deterministic presets (random selectors draw one tensor for the whole batch: their rows differ by design)
PRESETS = {
    "h2o": lambda: methods.h2o(),
    "snapkv": lambda: methods.snapkv(window=4),
    "tova": lambda: methods.tova(),
    "rkv": lambda: methods.rkv(window=4, interval=INTERVAL),
    "streaming_llm": lambda: methods.streaming_llm(),
    "knorm": lambda: methods.knorm(),
    "pyramid_rkv": lambda: methods.pyramid_rkv(),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_rows_of_a_padded_batch_equal_single_runs(name):
    model = tiny_model("llama", layers=2, seed=4)
    clear_reference_cache()
    traces = [_trace(1, 10), _trace(2, 21), _trace(3, 14)]  # budget 16 is below one prompt, above two
    width = max(len(t.prompt_ids) for t in traces)
    make = lambda: KVComposeCache(model, PRESETS[name](), budget=BUDGET, interval=INTERVAL)  # noqa: E731

    batch_kept: list[list] = []
    scores = evaluate_batch(model, traces, make,
                            on_chunk=lambda c, fed: batch_kept.append(
                                [_kept(c, b, width - len(t.prompt_ids)) for b, t in enumerate(traces)]))
    events = held = 0
    for b, t in enumerate(traces):
        single_kept: list = []
        cache = make()
        single = evaluate_trace(model, t, cache)
        # replay the single run chunk by chunk to read its kept positions at the same points
        from kvcompose.bench.fidelity import _teacher_force  # the single-trace path's own loop

        replay = make()
        for i, _ in enumerate(_teacher_force(model, t, replay, INTERVAL)):
            if i:
                single_kept.append(_kept(replay, 0, 0))
        assert [k[b] for k in batch_kept] == single_kept, f"{name}: row {b} kept other tokens than alone"
        events = max(events, cache.layers[0].events)
        assert scores[b].kl == pytest.approx(single.kl, abs=2e-5, rel=1e-3)
        assert scores[b].top1 == single.top1
        assert scores[b].nll == pytest.approx(single.nll, abs=1e-4)
        assert scores[b].recall_logprob == pytest.approx(single.recall_logprob, abs=1e-4)
        assert scores[b].recall_logprob_full == pytest.approx(single.recall_logprob_full, abs=1e-4)
        held = max(held, single.max_held_tokens)
    # the batch holds as many slots as its longest row alone (shorter rows hold padding until the first event)
    assert {s.max_held_tokens for s in scores} == {held}
    assert events >= 3  # the method really compressed, several times
    assert max(max(s.kl) for s in scores) > 1e-4  # and it changed the output


def test_full_cache_batch_is_exact():
    model = tiny_model("llama", layers=2, seed=5)
    traces = [_trace(4, 9, n=24), _trace(5, 17, n=24)]
    scores = evaluate_batch(model, traces, lambda: KVComposeCache(model, methods.full()))
    for s in scores:
        assert max(s.kl) < 1e-6 and min(s.top1) == 1.0
        assert abs(s.recall_logprob - s.recall_logprob_full) < 1e-5


def test_hidden_references_match_the_full_cache_forward():
    model = tiny_model("llama", layers=2, seed=6)
    clear_reference_cache()
    t = _trace(6, 12, n=30)
    ref = hidden_references(model, [t, _trace(7, 20, n=30)], batch_size=2)[0]
    x = torch.tensor([t.prompt_ids + t.trace_ids[:-1]])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=x).logits[0, len(t.prompt_ids) - 1 :].float(), -1)
    assert torch.allclose(ref.logp(model, 0, 30), lp, atol=1e-5)
    assert torch.allclose(ref.nll, -lp.gather(1, torch.tensor(t.trace_ids)[:, None])[:, 0], atol=1e-5)


def test_batch_refuses_unequal_traces():
    model = tiny_model("llama", layers=2)
    with pytest.raises(KVComposeError, match="equally long"):
        evaluate_batch(model, [_trace(1, 10, n=20), _trace(2, 10, n=24)], lambda: KVComposeCache(model))


# ------------------------------------------------------------------------------ the CLI: batches, resume, held out
@pytest.fixture(scope="module")
def grouped_questions(tmp_path_factory):
    """Ten questions, character-tokenized: three of 31 characters, three of 40, four of 34 (lengths repeat)."""
    import json

    qs = [f"Ann has {i} red pens. How many?" for i in range(3)] + \
         [f"Bob has {i} blue cups and {i} mugs. Total?" for i in range(3)] + \
         [f"Cy owns {i} cats, {i} dogs. Pets?" + "!" * (i % 2) for i in range(4)]
    p = tmp_path_factory.mktemp("data") / "q.jsonl"
    p.write_text("\n".join(json.dumps({"question": q, "answer": "#### 1"}) for q in qs))
    return str(p)


def _fid(tiny_dir, data, out, *extra):
    from kvcompose.bench import cli  # the `kvcompose` script: library commands + bench

    return cli.main(["bench", "fidelity", "--model", tiny_dir, "--data", data, "--new-tokens", "24", "--kinds", "sampled",
                     "--budgets", "40", "--interval", "8", "--short-budgets", "--free-gen-prompts", "0",
                     "--out", str(out), *extra])


def test_cli_batches_resumes_and_holds_out(tiny_dir, grouped_questions, tmp_path, monkeypatch):
    import json

    from kvcompose.bench import fidelity, run
    from kvcompose.testing import tiny_chat_model
    from kvcompose.traces import prompt_ids

    pipes = tmp_path / "pipes.py"
    pipes.write_text("from kvcompose import Pipeline, ProtectPrompt, KeyNorm, TopK\n"
                     "PIPELINES = {'knorm+prompt': lambda budget: Pipeline(ProtectPrompt(), KeyNorm(), TopK())}\n")
    out = tmp_path / "a"
    args = ["--groups", "2", "--group-size", "2", "--select-seed", "3", "--batch-size", "2", "--methods", "full",
            "h2o", "knorm+prompt", "--pipelines", str(pipes), "--references", str(tmp_path / "refs")]
    assert _fid(tiny_dir, grouped_questions, out, *args) == 0
    data = json.loads((out / "fidelity.json").read_text())
    traces = json.loads((out / "traces.json").read_text())["items"]
    _, tok = tiny_chat_model()
    lens = [len(prompt_ids(tok, t["question"])) for t in traces]
    assert len(traces) == 4 and lens[0] == lens[1] and lens[2] == lens[3] and lens[0] != lens[2]
    rows = {(r["method"], r["budget"]): r for r in data["rows"]}
    assert rows[("full", None)]["kl_mean"] < 1e-6
    h2o = rows[("h2o", 40)]
    assert h2o["n_traces"] == 4 and h2o["kl_mean"] > 1e-4
    assert h2o["kl_ci"][0] <= h2o["kl_mean"] <= h2o["kl_ci"][1] and h2o["kl_ci"][0] < h2o["kl_ci"][1]
    assert rows[("knorm+prompt", 40)]["pipeline"].startswith("Pipeline(ProtectPrompt")
    assert data["selection"]["seed"] == 3 and len(list((tmp_path / "refs").glob("*.pt"))) == 4

    # one trace at a time on the same traces: the same per-trace numbers
    single = tmp_path / "single"
    assert _fid(tiny_dir, grouped_questions, single, "--traces", str(out / "traces.json"), "--methods", "h2o",
                "--groups", "2", "--group-size", "2") == 0
    s_row = next(r for r in json.loads((single / "fidelity.json").read_text())["rows"] if r["method"] == "h2o")
    assert [p["kl_mean"] for p in s_row["per_trace"]] == pytest.approx([p["kl_mean"] for p in h2o["per_trace"]],
                                                                        abs=1e-5)

    # a killed run: the last batch of h2o lost; the rerun computes only that batch and gives the same numbers
    cell = next((out / "cells").glob("kvcompose__h2o__40.jsonl"))
    lines = cell.read_text().splitlines()
    cell.write_text("\n".join(lines[:2]) + "\n" + lines[2][:30])  # two traces kept, the third cut mid-line
    calls = []
    real = fidelity.evaluate_batch
    monkeypatch.setattr(fidelity, "evaluate_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert _fid(tiny_dir, grouped_questions, out, *args, "--traces", str(out / "traces.json")) == 0
    assert len(calls) == 1  # the lost batch only
    assert len(run._read_cell(cell)[1]) == 4  # the rerun's lines start on a line of their own: every trace reads back
    again = {(r["method"], r["budget"]): r for r in json.loads((out / "fidelity.json").read_text())["rows"]}
    assert [p["kl_mean"] for p in again[("h2o", 40)]["per_trace"]] == pytest.approx(
        [p["kl_mean"] for p in h2o["per_trace"]], abs=1e-6)

    # another method into the same folder: the earlier rows stay in fidelity.json
    assert _fid(tiny_dir, grouped_questions, out, "--groups", "2", "--group-size", "2", "--batch-size", "2",
                "--traces", str(out / "traces.json"), "--methods", "tova", "--references", str(tmp_path / "refs")) == 0
    assert {r["method"] for r in json.loads((out / "fidelity.json").read_text())["rows"]} == {
        "full", "h2o", "knorm+prompt", "tova"}

    # a held-out set: other questions, chosen by the same rule with another seed
    held = tmp_path / "held"
    assert _fid(tiny_dir, grouped_questions, held, "--groups", "1", "--group-size", "2", "--select-seed", "4",
                "--exclude", str(out / "traces.json"), "--batch-size", "2", "--methods", "h2o") == 0
    ids = {t["id"] for t in json.loads((held / "traces.json").read_text())["items"]}
    assert len(ids) == 2 and not ids & {t["id"] for t in traces}
    assert run.select_prompt_groups(tok, grouped_questions, 2, 2, 3) == run.select_prompt_groups(
        tok, grouped_questions, 2, 2, 3)


def test_reused_traces_are_cut_to_new_tokens(tiny_dir, grouped_questions, tmp_path):
    """`--traces` with a shorter `--new-tokens`: each saved trace is scored on its first new_tokens tokens, and
    the per-token KL equals the first new_tokens per-token KL of the whole trace (teacher forcing is causal)."""
    import json

    full, cut = tmp_path / "full", tmp_path / "cut"
    args = ["--groups", "1", "--group-size", "2", "--batch-size", "2", "--methods", "h2o"]
    assert _fid(tiny_dir, grouped_questions, full, *args) == 0
    from kvcompose.bench import cli  # the `kvcompose` script: library commands + bench

    assert cli.main(["bench", "fidelity", "--model", tiny_dir, "--data", grouped_questions, "--new-tokens", "16",
                     "--kinds", "sampled", "--budgets", "40", "--interval", "8", "--short-budgets",
                     "--free-gen-prompts", "0", "--out", str(cut), "--traces", str(full / "traces.json"), *args]) == 0
    items = json.loads((cut / "traces.json").read_text())["items"]
    assert [len(t["trace_ids"]) for t in items] == [16, 16] and all(t["id"].endswith("[:16]") for t in items)
    read = lambda p: {json.loads(x)["id"]: json.loads(x)["kl"]  # noqa: E731
                      for x in next((p / "cells").glob("*h2o*")).read_text().splitlines()}
    whole, part = read(full), read(cut)
    assert len(part) == 2
    for tid, kl in part.items():
        assert len(kl) == 16 and max(kl) > 1e-6  # h2o at 40 compresses inside the first 16 tokens
        assert kl == pytest.approx(whole[tid.removesuffix("[:16]")][:16], abs=1e-5)


def test_no_recall_skips_the_probe_only(tiny_dir, grouped_questions, tmp_path):
    """`--no-recall`: the rows have no recall numbers, and the same per-token KL as with the probe."""
    import json

    args = ["--groups", "1", "--group-size", "2", "--batch-size", "2", "--methods", "h2o",
            "--references", str(tmp_path / "refs")]
    assert _fid(tiny_dir, grouped_questions, tmp_path / "with", *args) == 0
    assert _fid(tiny_dir, grouped_questions, tmp_path / "without", *args, "--no-recall",
                "--traces", str(tmp_path / "with" / "traces.json")) == 0
    rows = [next(r for r in json.loads((tmp_path / d / "fidelity.json").read_text())["rows"] if r["method"] == "h2o")
            for d in ("with", "without")]
    assert rows[0]["recall_delta"] is not None and rows[1]["recall_delta"] is None
    assert [p["kl_mean"] for p in rows[1]["per_trace"]] == pytest.approx([p["kl_mean"] for p in rows[0]["per_trace"]],
                                                                          abs=1e-6)


# ------------------------------------------------------------------------------ scoring from reference statistics
@pytest.mark.parametrize("top", [3, 64])
def test_scores_from_reference_statistics_equal_the_direct_scores(monkeypatch, top):
    """RowScores with a linear head scores from `ReferenceStats` (the reference's log-probs are never
    recomputed) and gives the direct computation's KL, top-1 and NLL; with a head bias, and with few top
    tokens (`top` 3: most of the distribution goes through the tail term)."""
    from kvcompose.bench import scoring

    model = tiny_model("llama", layers=2, seed=8, vocab=256)
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.copy_(torch.randn(head.out_features, generator=torch.Generator().manual_seed(0)))
    model.set_output_embeddings(biased)
    traces = [_trace(11, 10, vocab=256), _trace(12, 15, vocab=256)]
    make = lambda: KVComposeCache(model, methods.h2o(), budget=BUDGET, interval=INTERVAL)  # noqa: E731
    monkeypatch.setattr(scoring, "TOP", top)
    refs = hidden_references(model, traces, batch_size=2)
    with monkeypatch.context() as m:
        m.setattr(scoring.HiddenReference, "logp", lambda *a: pytest.fail("reference log-probs recomputed"))
        fast = evaluate_batch(model, traces, make, references=refs)
    assert refs[0].stats is not None and refs[0].stats.idx.shape == (40, top)
    monkeypatch.setattr(scoring, "linear_head", lambda model: None)
    direct = evaluate_batch(model, traces, make, references=refs)
    for f, d in zip(fast, direct):
        assert f.kl == pytest.approx(d.kl, abs=1e-6)
        assert f.top1 == d.top1
        assert f.nll == pytest.approx(d.nll, abs=1e-5)
    assert max(max(f.kl) for f in fast) > 1e-3  # h2o at budget 16 changed the output


def test_reference_files_keep_their_statistics(tmp_path):
    """`references_for` saves each reference with its statistics and reloads both; a file of an older run
    (hidden states only) gets its statistics added."""
    from kvcompose.bench.cells import references_for

    model = tiny_model("llama", layers=2, seed=9)
    traces = [_trace(13, 10, n=24), _trace(14, 10, n=24)]
    first = references_for(model, traces, tmp_path, "tiny", "float32", log=lambda *a: None)
    files = sorted(tmp_path.glob("*.pt"))
    assert len(files) == 2 and all("stats_expect" in torch.load(f, weights_only=True) for f in files)
    again = references_for(model, traces, tmp_path, "tiny", "float32", log=lambda *a: pytest.fail("recomputed"))
    for t in traces:
        assert torch.equal(again[t.id].stats.expect, first[t.id].stats.expect)
        assert torch.equal(again[t.id].hidden, first[t.id].hidden)
    d = torch.load(files[0], weights_only=True)
    torch.save({k: d[k] for k in ("hidden", "nll", "recall")}, files[0])  # as an older run wrote it
    references_for(model, traces, tmp_path, "tiny", "float32", log=lambda *a: pytest.fail("recomputed"))
    assert "stats_expect" in torch.load(files[0], weights_only=True)


def test_a_stopped_trace_run_resumes_at_its_next_batch(tiny_dir, grouped_questions, tmp_path, monkeypatch):
    """Reference traces are saved batch by batch (`traces.partial.jsonl`): a run stopped in its second batch
    generates only that batch when run again, and its traces equal an uninterrupted run's."""
    import json

    import transformers

    real = transformers.GenerationMixin.generate
    calls = []

    def counting(self, *a, **k):
        calls.append(1)
        if stop_at and len(calls) == stop_at:
            raise KeyboardInterrupt("stopped")
        return real(self, *a, **k)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", counting)
    args = ("--groups", "2", "--group-size", "2", "--methods")
    stop_at = 0
    assert _fid(tiny_dir, grouped_questions, tmp_path / "whole", *args) == 0
    whole = json.loads((tmp_path / "whole" / "traces.json").read_text())["items"]
    assert len(calls) == 2 and not (tmp_path / "whole" / "traces.partial.jsonl").exists()

    calls.clear()
    stop_at = 2
    with pytest.raises(KeyboardInterrupt):
        _fid(tiny_dir, grouped_questions, tmp_path / "stopped", *args)
    partial = tmp_path / "stopped" / "traces.partial.jsonl"
    assert len(partial.read_text().splitlines()) == 1  # the first batch
    partial.write_text(partial.read_text() + '{"key": "torn')  # and a line torn by the stop
    calls.clear()
    stop_at = 0
    assert _fid(tiny_dir, grouped_questions, tmp_path / "stopped", *args) == 0
    assert len(calls) == 1  # the second batch only
    again = json.loads((tmp_path / "stopped" / "traces.json").read_text())["items"]
    assert [(t["id"], t["trace_ids"]) for t in again] == [(t["id"], t["trace_ids"]) for t in whole]
    assert not partial.exists()


def test_saved_traces_of_other_questions_are_refused():
    from kvcompose.testing import tiny_chat_model
    from kvcompose.traces import Trace, make_traces
    from kvcompose.view import KVComposeError

    model, tok = tiny_chat_model()
    qs = [{"question": "Ann has 2 pens?", "id": 0}, {"question": "Bob has 3 cups?", "id": 1}]
    other = Trace(id="0/sampled", prompt_ids=[1, 2], question="Cy has 4 cats?", answer=None, kind="sampled",
                  trace_ids=[5, 6])
    with pytest.raises(KVComposeError, match="other questions"):
        make_traces(model, tok, qs, new_tokens=4, batch_size=1, done={0: [other]})
