"""Scripts that run in another engine's virtualenv, by path, and never import kvcompose.

NVIDIA kvpress 0.5.5 pins `transformers<5.3`, so the side-by-side runs in its own virtualenv
(`.venv-kvpress`, docs/kvpress.md). kvcompose writes the inputs (traces or a prompt), starts one of these
scripts with that virtualenv's python and reads the JSON it writes:

- `kvpress_side.py`: teacher-forced fidelity under `kvpress.DecodingPress` (`kvcompose bench fidelity`);
- `kvpress_speed.py`: decode speed under `DecodingPress` (`kvcompose bench speed`).

They ship inside the package so that an installed kvcompose finds them; `python -m kvcompose.bench.external
NAME` prints a script's path (for running one by hand).
"""

from __future__ import annotations

from pathlib import Path

from ...view import KVComposeError

__all__ = ["SCRIPTS", "script", "display_command"]

SCRIPTS = ("kvpress_side", "kvpress_speed")


def script(name: str) -> Path:
    """The path of the shipped script `name` (one of `SCRIPTS`, with or without `.py`)."""
    stem = name[:-3] if name.endswith(".py") else name
    if stem not in SCRIPTS:
        raise KVComposeError(f"no external script {name!r}; scripts: {', '.join(SCRIPTS)}")
    path = Path(__file__).resolve().parent / f"{stem}.py"
    if not path.exists():  # a broken installation, not a user error
        raise KVComposeError(f"{path} is missing from this kvcompose installation")
    return path


def display_command(cmd: list[str]) -> str:
    """`cmd` as a string for reports: a shipped script is named `$(python -m kvcompose.bench.external NAME)`
    instead of its path in this machine's site-packages or checkout."""
    shipped = {str(script(n)): f"$(python -m kvcompose.bench.external {n})" for n in SCRIPTS}
    return " ".join(shipped.get(str(Path(c).resolve()), c) if c.endswith(".py") else c for c in cmd)
