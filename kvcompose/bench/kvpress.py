"""The side-by-side with NVIDIA kvpress: kvpress 0.5.5 pins transformers < 5.3, so it runs in its own
virtualenv (`.venv-kvpress`, docs/kvpress.md) through `kvpress_side.py` (shipped in `kvcompose.bench.external`)
as a subprocess. kvcompose writes the traces it teacher-forces (`{"model", "items": [{"id", "prompt_ids",
"trace_ids"}]}`), the script teacher-forces the same tokens one decoding step at a time under
`kvpress.DecodingPress` and reports, per press and budget, top-1 / mean KL / perplexity ratio against its own
full-cache run, which are merged into kvcompose's tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .external import display_command
from .fidelity import Trace

__all__ = ["default_script", "write_traces", "start_kvpress", "finish_kvpress", "run_kvpress", "kvpress_rows",
           "engine_label"]


def default_script() -> Path:
    """`kvpress_side.py`, shipped in `kvcompose.bench.external` (it runs in the kvpress virtualenv)."""
    from .external import script

    return script("kvpress_side")


def write_traces(path: str | os.PathLike, model: str, traces: list[Trace]) -> None:
    items = [{"id": t.id, "prompt_ids": list(t.prompt_ids), "trace_ids": list(t.trace_ids)} for t in traces]
    Path(path).write_text(json.dumps({"model": model, "items": items}))


def _command(python: str, traces_path, out_path, budgets: list[int], presses: list[str] | None, interval: int,
             script: Path, model_dir: str | None, threads: int | None, max_items: int | None) -> list[str]:
    cmd = [str(python), str(script), "--traces", str(traces_path), "--out", str(out_path),
           "--budgets", *map(str, budgets), "--interval", str(interval)]
    if presses:
        cmd += ["--presses", *presses]
    if model_dir:
        cmd += ["--model-dir", model_dir]
    if threads:
        cmd += ["--threads", str(threads)]
    if max_items:
        cmd += ["--max-items", str(max_items)]
    return cmd


def start_kvpress(python: str, traces_path: str | os.PathLike, out_path: str | os.PathLike, *, budgets: list[int],
                  presses: list[str] | None, interval: int, script: str | os.PathLike | None = None,
                  model_dir: str | None = None, threads: int | None = None, max_items: int | None = None,
                  log=None) -> tuple[subprocess.Popen | None, str]:
    """Start the kvpress side script in the background: `(process, command)` or `(None, why it was skipped)`."""
    script = Path(script) if script else default_script()
    if not Path(python).exists():
        return None, (f"kvpress side-by-side skipped: {python} not found (create the .venv-kvpress virtualenv, "
                      "see docs/kvpress.md)")
    if not script.exists():
        return None, f"kvpress side-by-side skipped: {script} not found"
    cmd = _command(python, traces_path, out_path, budgets, presses, interval, script, model_dir, threads, max_items)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the kvpress venv must not import this checkout's kvcompose
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    proc = subprocess.Popen(cmd, env=env, stdout=log or sys.stderr, stderr=subprocess.STDOUT)
    return proc, display_command(cmd)


def finish_kvpress(proc: subprocess.Popen, out_path: str | os.PathLike, command: str) -> tuple[dict | None, str | None]:
    """Wait for a `start_kvpress` process: `(result JSON, None)` or `(None, why it failed)`."""
    code = proc.wait()
    if code != 0 or not Path(out_path).exists():
        return None, f"kvpress side-by-side failed (exit {code}): {command}"
    return json.loads(Path(out_path).read_text()), None


def run_kvpress(python: str, traces_path: str | os.PathLike, out_path: str | os.PathLike, **kwargs) -> tuple[dict | None, str | None]:
    """Run the kvpress side script to completion (see `start_kvpress` for the arguments)."""
    proc, cmd = start_kvpress(python, traces_path, out_path, **kwargs)
    if proc is None:
        return None, cmd
    return finish_kvpress(proc, out_path, cmd)


def engine_label(result: dict[str, Any]) -> str:
    v = result.get("versions", {})
    tf = v.get("transformers") or "?"
    return f"kvpress {v.get('kvpress', '?')} / transformers {tf}"


def kvpress_rows(result: dict[str, Any], kind: str, bucket: int = 64) -> list[dict[str, Any]]:
    """kvpress results as rows of kvcompose's fidelity table (KL curve rebucketed to `bucket` positions)."""
    eng = engine_label(result)
    rows = []
    for press, by_budget in result.get("results", {}).items():
        for b, r in by_budget.items():
            row: dict[str, Any] = {"engine": eng, "method": press, "budget": int(b), "kind": kind}
            if "error" in r:
                row["error"] = r["error"]
            else:
                curve = r.get("kl_curve", [])
                row.update(top1=r["top1"], kl_mean=r["kl_mean"], ppl_ratio=r["ppl_ratio"],
                           max_held_tokens=r.get("max_held_tokens"), max_kv_bytes=None, kv_ratio=None,
                           recall_delta=None, n_tokens=r.get("n_steps"),
                           kl_curve=[sum(curve[i : i + bucket]) / len(curve[i : i + bucket])
                                     for i in range(0, len(curve), bucket)],
                           kl_curve_bucket=bucket, seconds=r.get("seconds"))
            rows.append(row)
    return rows
