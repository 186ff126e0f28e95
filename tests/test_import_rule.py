"""The line between the library and its experiments: no module of the library (kvcompose/ minus kvcompose/bench)
imports the benchmark code (kvcompose.bench, the top-level benchmarks/ scripts), at module level or inside a
function, by an import statement or by `importlib.import_module("...")`. The benchmarks import the library, never
the other way round (docs/architecture.md, 'The library and its experiments')."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "kvcompose"
EXPERIMENTS = ("kvcompose.bench", "benchmarks")


def _module(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _targets(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path` (or in `source` as if it were `path`), relative
    ones resolved."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod[:-1]
    out = []
    for node in ast.walk(ast.parse(source if source is not None else path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]  # `from kvcompose import bench`
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return out


def _library() -> list[Path]:
    return [p for p in sorted(PKG.rglob("*.py")) if "bench" not in p.relative_to(PKG).parts[:1]]


def violations(files: list[Path], source: str | None = None) -> list[str]:
    bad = []
    for path in files:
        for line, target in _targets(path, source):
            if any(target == e or target.startswith(e + ".") for e in EXPERIMENTS):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return bad


def test_the_library_never_imports_the_experiments():
    files = _library()
    assert len(files) > 50 and not any("bench" in p.relative_to(PKG).parts[:1] for p in files)
    assert not violations(files), "\n".join(violations(files))


@pytest.mark.parametrize("source,target", [
    ("from .bench import run\n", "kvcompose.bench"),
    ("from .bench.data import load_questions\n", "kvcompose.bench.data"),
    ("import kvcompose.bench.speed\n", "kvcompose.bench.speed"),
    ("from kvcompose.bench import cli\n", "kvcompose.bench"),
    ("from . import bench\n", "kvcompose.bench"),
    ("from benchmarks import core_identity\n", "benchmarks"),
    ("def f():\n    import importlib\n    return importlib.import_module('kvcompose.bench.cli')\n", "kvcompose.bench.cli"),
])
def test_the_check_sees_every_kind_of_import(source, target):
    """The rule can fail: each way of reaching the benchmarks from a library module is caught (lazy ones too)."""
    found = violations([PKG / "probe.py"], source)
    assert found and found[0].endswith(f"imports {target}"), found


def test_the_check_lets_the_library_import_itself():
    source = "from .data import load_questions\nfrom . import methods\nfrom .blocks import benchmarky\n"
    assert violations([PKG / "probe.py"], source) == []
    assert violations([PKG / "integrations" / "probe.py"], "from ..methods import preset\n") == []
    assert violations([PKG / "integrations" / "probe.py"], "from ..bench.run import x\n") != []
