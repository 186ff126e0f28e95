"""NVIDIA kvpress's `DecodingPress` side by side with `kvcompose bench speed`: it runs in its own virtualenv
(transformers 5.2, kvpress 0.5.5; docs/kvpress.md) through `kvpress_speed.py`, shipped in
`kvcompose.bench.external`, with the same prompt, budget and interval; its rows come back as `DecodeTrace`
dicts and its speed is a ratio to *its own* full cache (absolute times across processes are not comparable)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..view import KVComposeError
from .external import display_command

__all__ = ["KVPRESS_ANALOGUE", "default_kvpress_python", "default_kvpress_script", "kvpress_command",
           "start_kvpress", "finish_kvpress", "kvpress_traces"]

# kvcompose preset -> the closest kvpress base press inside DecodingPress
KVPRESS_ANALOGUE = {"streaming_llm": "streaming_llm", "tova": "tova", "random_attention": "random",
                    "knorm": "knorm", "snapkv": "snapkv"}


def default_kvpress_python() -> str | None:
    """`.venv-kvpress/bin/python` under the current directory, if it exists (the side-by-side venv)."""
    p = Path(".venv-kvpress") / "bin" / "python"
    return str(p) if p.exists() else None


def default_kvpress_script() -> Path:
    """`kvpress_speed.py`, shipped in `kvcompose.bench.external` (it runs in the kvpress virtualenv)."""
    from .external import script

    return script("kvpress_speed")


def kvpress_command(python: str, prompt_path, out_path, *, new_tokens: int, budget: int, presses: dict[str, int],
                    window: int, threads: int | None, script=None, model_dir: str | None = None,
                    ideal: bool = True, seed: int = 0) -> list[str]:
    """The command line of `kvpress_speed.py` (`presses`: kvpress press name -> interval)."""
    script = Path(script or default_kvpress_script())
    cmd = [str(python), str(script), "--prompt", str(prompt_path), "--out", str(out_path),
           "--new-tokens", str(new_tokens), "--budget", str(budget), "--window", str(window), "--seed", str(seed),
           "--presses", *[f"{k}:{v}" for k, v in presses.items()]]
    if threads:
        cmd += ["--threads", str(threads)]
    if model_dir:
        cmd += ["--model-dir", model_dir]
    if not ideal:
        cmd += ["--no-ideal"]
    return cmd


def start_kvpress(cmd: list[str], log_path) -> tuple[Any, str]:
    """Start the kvpress speed script: `(process, command)`, or `(None, why it was skipped)`."""
    import subprocess

    if not Path(cmd[0]).exists():
        return None, f"kvpress skipped: {cmd[0]} not found (create .venv-kvpress, see docs/kvpress.md)"
    if not Path(cmd[1]).exists():
        return None, f"kvpress skipped: {cmd[1]} not found"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the kvpress venv must not import this checkout through PYTHONPATH
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc._kvc_log = log  # closed in finish_kvpress
    return proc, display_command(cmd)  # the command in the report stays portable


def finish_kvpress(proc, out_path, command: str) -> tuple[dict | None, str | None]:
    """Wait for `start_kvpress`'s process: `(its JSON, None)` or `(None, why it failed)`."""
    code = proc.wait()
    proc._kvc_log.close()
    if code != 0 or not Path(out_path).exists():
        return None, f"kvpress failed (exit {code}); see its log. Command: {command}"
    return json.loads(Path(out_path).read_text()), None


def kvpress_traces(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a `kvpress_speed.py` JSON as `DecodeTrace` dicts (kind ideal / full / kvpress).

    Raises `KVComposeError` when the JSON is not such a file."""
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise KVComposeError("not a kvpress_speed.py result: no 'rows' list")
    out = []
    for r in result["rows"]:
        missing = {"name", "kind", "step_seconds"} - set(r)
        if missing:
            raise KVComposeError(f"kvpress row {r.get('name', '?')!r} lacks {sorted(missing)}")
        d = {k: r.get(k) for k in ("name", "kind", "batch", "first_seen", "prefill_seconds", "step_seconds", "held",
                                   "peak_kv_bytes", "peak_alloc_bytes", "interval", "budget", "error")}
        d["batch"] = d["batch"] or 1
        d["first_seen"] = d["first_seen"] or 0
        d["held"] = [tuple(h) for h in (d["held"] or [])]
        d["peak_kv_bytes"] = int(d["peak_kv_bytes"] or 0)
        d["peak_alloc_bytes"] = int(d["peak_alloc_bytes"] or d["peak_kv_bytes"])
        d["method"] = r.get("press")
        d["compress_seconds"], d["compress_calls"] = 0.0, 0
        out.append(d)
    return out
