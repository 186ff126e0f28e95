"""The command line checks its arguments and paths before loading a model: a bad one ends the command with exit
code 2, one line naming it, and no output left behind (issue item 7). The observed cases run the real entry
point (`kvcompose ...` in a subprocess, all at once: each one starts Python, torch and transformers); the checks
of every subcommand's numbers and paths run in-process through the `kvcompose` script's `main` (kvcompose.bench.cli)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompose.bench import cli  # the `kvcompose` script: library commands + bench


def _entry_point() -> list[str]:
    import importlib.metadata as md
    import tomllib

    want = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    installed = [e.value for e in md.entry_points(group="console_scripts", name="kvcompose")]
    if installed and installed[0] != want["kvcompose"]:  # installed from an older checkout: run what it now names
        return [sys.executable, "-m", want["kvcompose"].split(":")[0]]
    exe = Path(sys.executable).with_name("kvcompose")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("kvcompose")
    if found is None:
        pytest.skip("the kvcompose entry point is not installed")
    return [found]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "empty_model").mkdir()
    (d / "bad.jsonl").write_text('{"question": "ok"}\nnot json\n')
    (d / "noq.jsonl").write_text('{"text": "no question here"}\n')
    (d / "good.jsonl").write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(3)))
    (d / "no_results").mkdir()
    return d


def test_observed_cases_through_the_entry_point(files, tmp_path):
    """Each of these loaded a model first (or exited 0) and ended in a traceback or left an empty folder."""
    out = tmp_path / "fid"
    cases = {
        "generate --model /nonexistent": (["generate", "--model", str(files / "missing_model")], "does not exist"),
        "generate --model <folder with no model>": (["generate", "--model", str(files / "empty_model")],
                                                    "holds no model"),
        "generate --device cuda (CPU-only torch)": (["generate", "--device", "cuda:0"], "cuda"),
        "bench report <missing folder>": (["bench", "report", str(files / "missing")], "does not exist"),
        "bench fidelity --data <missing file>": (["bench", "fidelity", "--data", str(files / "missing.jsonl"),
                                                 "--out", str(out)], "does not exist"),
        "bench fidelity --data <malformed file>": (["bench", "fidelity", "--data", str(files / "bad.jsonl"),
                                                   "--out", str(out)], "bad.jsonl:2 is not a JSON line"),
        "calibrate --data <file without questions>": (["calibrate", "--data", str(files / "noq.jsonl"), "--out",
                                                      str(tmp_path / "p.json")], "no 'question'"),
    }
    if "cuda" in cases["generate --device cuda (CPU-only torch)"][0][-1]:
        import torch

        if torch.cuda.is_available():
            del cases["generate --device cuda (CPU-only torch)"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("KVCOMPOSE_GSM8K", None)
    procs = {name: subprocess.Popen(_entry_point() + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env, cwd=tmp_path)
             for name, (argv, _) in cases.items()}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        lines = [line for line in stderr.splitlines() if line.strip() and "Warning" not in line]
        assert p.returncode == 2, (name, p.returncode, stderr[-2000:])
        assert len(lines) == 1 and "error:" in lines[0], (name, stderr[-2000:])
        assert cases[name][1] in lines[0], (name, lines[0])
        assert "loading" not in stderr and not stdout.strip(), name  # refused before any model loaded
    assert not out.exists() and not (tmp_path / "p.json").exists()


def _main(argv, capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return code, err


BAD_NUMBERS = [
    (["generate", "--budget", "0"], "--budget"),
    (["generate", "--budget", "2147483648"], "--budget"),
    (["generate", "--interval", "-4"], "--interval"),
    (["generate", "--max-new-tokens", "x"], "--max-new-tokens"),
    (["generate", "--index", "-1"], "--index"),
    (["generate", "--threads", "0"], "--threads"),
    (["generate", "--dtype", "float8"], "--dtype"),
    (["bench", "fidelity", "--n-prompts", "0"], "--n-prompts"),
    (["bench", "fidelity", "--budgets", "64", "-1"], "--budgets"),
    (["bench", "fidelity", "--top-p", "0"], "--top-p"),
    (["bench", "fidelity", "--temperature", "-0.5"], "--temperature"),
    (["bench", "fidelity", "--short-budgets", "nan"], "--short-budgets"),
    (["bench", "accuracy", "--batch-size", "0"], "--batch-size"),
    (["bench", "accuracy", "--samples", "-2"], "--samples"),
    (["bench", "accuracy", "--limit", "0"], "--limit"),
    (["bench", "speed", "--window", "0"], "--window"),
    (["bench", "steptime", "--seen", "1024", "0"], "--seen"),
    (["bench", "steptime", "--deep-layers", "-1"], "--deep-layers"),
    (["bench", "throughput", "--kv-memory", "0"], "--kv-memory"),
    (["bench", "throughput", "--prompt-lengths", "64", "x"], "--prompt-lengths"),
    (["calibrate", "--out", "p.json", "--coverage", "1.5"], "--coverage"),
    (["calibrate", "--out", "p.json", "--n", "0"], "--n"),
]


@pytest.mark.parametrize("argv,option", BAD_NUMBERS, ids=[" ".join(a) for a, _ in BAD_NUMBERS])
def test_every_numeric_option_is_checked(argv, option, capsys):
    code, err = _main(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and "error:" in lines[0], err


def test_every_path_option_is_checked(files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVCOMPOSE_GSM8K", raising=False)
    (tmp_path / "a_file").write_text("x")
    cases = [
        (["bench", "fidelity", "--data", str(files / "good.jsonl"), "--traces", str(files / "bad.jsonl")], "JSON"),
        (["bench", "fidelity", "--data", str(files / "good.jsonl"), "--kvpress-json", "nope.json"], "does not exist"),
        (["bench", "fidelity", "--data", str(files / "good.jsonl"), "--kvpress-script", "nope.py"], "does not exist"),
        (["bench", "fidelity", "--data", str(files / "good.jsonl"), "--out", "a_file"], "is a file"),
        (["bench", "fidelity", "--data", str(files / "good.jsonl"), "--out", "a_file/sub"], "is a file"),
        (["bench", "fidelity", "--data", str(files / "good.jsonl"), "--n-prompts", "3", "--offset", "1"], "holds 3 questions"),
        (["bench", "fidelity"], "needs questions"),  # no --data and no $KVCOMPOSE_GSM8K
        (["bench", "accuracy", "--data", str(files / "noq.jsonl")], "no 'question'"),
        (["bench", "accuracy"], "needs questions"),
        (["bench", "speed", "--out", "a_file"], "is a file"),
        (["bench", "steptime", "--out", "a_file"], "is a file"),
        (["bench", "throughput", "--out", "a_file"], "is a file"),
        (["bench", "report", str(files / "no_results")], "holds no results"),
        (["calibrate", "--out", str(tmp_path)], "is a folder"),
        (["calibrate", "--out", "p.json"], "needs questions"),
        (["calibrate", "--out", "p.json", "--data", str(files / "good.jsonl")], "fewer than --offset 1000"),
        (["generate", "--data", str(files / "good.jsonl"), "--index", "5"], "holds 3 questions"),
        (["generate", "--model", "a_file"], "is a file"),
        (["generate", "--model", "./relative/missing"], "does not exist"),
        (["generate", "--device", "mps"], "mps"),
        (["generate", "--device", "bogus:x"], "not a torch device"),
    ]
    import torch

    if torch.backends.mps.is_available():
        cases = [c for c in cases if c[1] != "mps"]
    for argv, what in cases:
        code, err = _main(argv, capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and what in lines[0], (argv, code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written


def test_a_failed_run_leaves_no_empty_output_folder(files, tmp_path, capsys, monkeypatch):
    """A run that fails after it started (here: the fidelity loop raising) removes the output folder it created
    when nothing was written into it; the error is one line and the exit code 2."""
    from kvcompose.bench import run as bench_run
    from kvcompose.view import KVComposeError

    def fails(cfg):
        Path(cfg.out, "sub").mkdir(parents=True)
        raise KVComposeError("the run failed\nafter it started")

    monkeypatch.setattr(bench_run, "run_fidelity", fails)
    out = tmp_path / "fid"
    code, err = _main(["bench", "fidelity", "--data", str(files / "good.jsonl"), "--n-prompts", "1",
                       "--free-gen-prompts", "0", "--out", str(out)], capsys)
    assert code == 2 and err.strip() == "kvcompose bench fidelity: error: the run failed after it started"
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("an earlier run's file")
    code, _ = _main(["bench", "fidelity", "--data", str(files / "good.jsonl"), "--n-prompts", "1",
                     "--free-gen-prompts", "0", "--out", str(out)], capsys)
    assert code == 2 and (out / "keep.txt").exists()  # a folder that existed before is left alone


def _options(parser, prefix=()):
    """Every option of every (sub)command: (command words, argparse action)."""
    import argparse

    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _options(sub, (*prefix, name))
        elif a.option_strings:
            yield prefix, a


def test_every_number_option_has_a_checked_type_that_accepts_its_default():
    """A numeric option added later (the batched fidelity bench's --groups, --select-seed, ...) gets a checked type
    from the shared layer, and that type accepts the option's own default given explicitly (--groups 0 is "off")."""
    seen = 0
    for words, a in _options(cli.build_parser()):
        assert a.type not in (int, float), (words, a.option_strings)  # an unchecked number would reach a model
        if a.type is None or a.default is None or isinstance(a.default, bool) or not callable(a.type):
            continue
        for d in a.default if isinstance(a.default, (list, tuple)) else [a.default]:
            if isinstance(d, (int, float)):
                seen += 1
                assert a.type(str(d)) == d, (words, a.option_strings, d)
    assert seen > 50


def test_input_files_of_later_options_are_checked(files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x")
    good = str(files / "good.jsonl")
    for argv, what in [
        (["bench", "fidelity", "--data", good, "--exclude", "missing_traces.json"], "does not exist"),
        (["bench", "fidelity", "--data", good, "--exclude", str(files / "bad.jsonl")], "not a JSON file"),
        (["bench", "fidelity", "--data", good, "--references", "a_file"], "is a file"),
        (["bench", "fidelity", "--data", good, "--groups", "-1"], "--groups"),
        (["bench", "fidelity", "--data", good, "--select-seed", "-3"], "--select-seed"),
    ]:
        code, err = _main(argv, capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and what in lines[0], (argv, code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_valid_arguments_still_parse(files, tmp_path):
    p = cli.build_parser()
    a = p.parse_args(["generate", "--budget", "64", "--interval", "8", "--seed", "0", "--device", "cpu",
                      "--data", str(files / "good.jsonl"), "--index", "2", "--model", "HuggingFaceTB/SmolLM2-135M"])
    assert a.budget == 64 and a.interval == 8 and a.index == 2 and a.model == "HuggingFaceTB/SmolLM2-135M"
    a = p.parse_args(["bench", "fidelity", "--temperature", "0", "--top-p", "1", "--free-gen-prompts", "0",
                      "--short-tokens", "0", "--out", str(tmp_path / "new" / "folder")])
    assert a.temperature == 0.0 and a.top_p == 1.0 and a.free_gen_prompts == 0
    assert not (tmp_path / "new").exists()  # checking creates nothing
    from kvcompose.cli_args import one_line

    assert one_line("a\n  b") == "a b"


def test_bench_refuses_a_method_whose_budget_is_too_small(tmp_path):
    """`bench speed` and `bench throughput` printed an error for a method whose protectors do not fit the budget
    (snapkv keeps 32 recent tokens: budget 16), then exited 0 and wrote a report without it (issue 28); now the
    real entry point exits 2 with one line naming the method, before any model loads, and writes nothing."""
    from kvcompose.testing import save_tiny_chat_model

    tiny = save_tiny_chat_model(tmp_path / "model")
    common = ["--model", tiny, "--budget", "16", "--new-tokens", "4", "--threads", "1"]
    cases = {
        "speed": ["bench", "speed", "--methods", "rkv", "snapkv", "--kvpress-python", "none", *common,
                  "--out", str(tmp_path / "speed")],
        "throughput": ["bench", "throughput", "--methods", "rkv", "snapkv", "--kv-memory", "1", *common,
                       "--out", str(tmp_path / "throughput")],
    }
    # the entry point imports this checkout's kvcompose (an installed copy elsewhere would be tested instead)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(
        [root, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])}
    procs = {name: subprocess.Popen(_entry_point() + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env, cwd=tmp_path) for name, argv in cases.items()}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        lines = [line for line in stderr.splitlines() if line.strip() and "Warning" not in line]
        assert p.returncode == 2, (name, p.returncode, stderr[-2000:])
        assert len(lines) == 1 and "error:" in lines[0] and "snapkv" in lines[0] and "16" in lines[0], (name, stderr)
        assert "loading" not in stderr, name
        assert not (tmp_path / name).exists(), name
