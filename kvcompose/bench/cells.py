"""Storage of the fidelity bench: full-cache references kept on disk (one file per trace, keyed by model,
dtype and the trace's tokens) and the per-cell score files (`out/cells/*.jsonl`) that a rerun resumes from."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..traces import Trace


# ------------------------------------------------------------------------------------------ references
def _trace_key(model_name: str, dtype: str, t: Trace) -> str:
    import hashlib

    h = hashlib.sha256(json.dumps([model_name, dtype, t.prompt_ids, t.trace_ids, t.recall_ids, t.recall_target_ids]
                                  ).encode()).hexdigest()
    return h[:24]


def references_for(model, traces: list[Trace], store: str | os.PathLike | None, model_name: str, dtype: str,
                   batch_size: int = 8, log=print) -> dict[str, Any]:
    """`{trace id: HiddenReference}`: loaded from `store` (one file per trace, keyed by model, dtype and the
    trace's tokens) or computed with `hidden_references` (batched over equal prompt lengths) and saved there."""
    from .fidelity import HiddenReference, hidden_references
    from .kvpress_fidelity import press_batches
    from .scoring import ReferenceStats, linear_head

    out: dict[str, Any] = {}
    todo = []
    folder = Path(store) if store else None
    for t in traces:
        f = folder / f"{_trace_key(model_name, dtype, t)}.pt" if folder else None
        if f is not None and f.exists():
            d = torch.load(f, weights_only=True)
            stats = ReferenceStats.from_dict(d)
            out[t.id] = HiddenReference(hidden=d["hidden"], nll=d["nll"], recall=d["recall"], stats=stats)
            if stats is None and linear_head(model) is not None:  # a file of an older run: add its statistics
                _save(f, out[t.id], model)
        else:
            todo.append(t)
    if todo:
        t0 = time.perf_counter()
        for group in press_batches(todo, batch_size):
            for t, ref in zip(group, hidden_references(model, group, batch_size=len(group))):
                out[t.id] = ref
                if folder is not None:
                    folder.mkdir(parents=True, exist_ok=True)
                    _save(folder / f"{_trace_key(model_name, dtype, t)}.pt", ref, model)
        log(f"full-cache references of {len(todo)} traces in {time.perf_counter() - t0:.0f}s")
    return out


def _save(f: Path, ref, model) -> None:
    """Write a reference (and, for a model with a linear head, its `ReferenceStats`: computed once, reused by
    every later run) atomically."""
    from .scoring import linear_head

    d = {"hidden": ref.hidden, "nll": ref.nll, "recall": ref.recall}
    if linear_head(model) is not None:
        d.update(ref.reference_stats(model).to_dict())
    tmp = f.with_suffix(f".{os.getpid()}.tmp")  # processes sharing the folder never write one file
    torch.save(d, tmp)
    os.replace(tmp, f)


# ------------------------------------------------------------------------------------------ cells (resume)
def _cell_path(out: Path, engine: str, method: str, budget: int | None) -> Path:
    import re

    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{engine}__{method}__{budget}")
    return out / "cells" / f"{safe}.jsonl"


def _round(xs: list[float]) -> list[float]:
    return [float(f"{x:.7g}") for x in xs]


def _save_scores(path: Path, scores: list, cell: tuple[str, str, int | None]) -> None:
    from dataclasses import asdict

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size:  # a run killed mid-line left no newline: start a fresh line
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
        if cut:
            with path.open("a") as f:
                f.write("\n")
    with path.open("a") as f:
        for sc in scores:
            d = asdict(sc)
            for k in ("top1", "kl", "nll", "nll_full"):
                d[k] = _round(d[k])
            f.write(json.dumps({"engine": cell[0], "method": cell[1], "budget": cell[2], **d}) + "\n")


def _read_cell(path: Path) -> tuple[tuple[str, str, int | None] | None, dict[str, Any]]:
    """`((engine, method, budget), {trace id: TraceScore})` of a cell file (lines cut by a killed run are skipped:
    their batch runs again)."""
    from dataclasses import fields

    from .fidelity import TraceScore

    names = {f.name for f in fields(TraceScore)}
    done: dict[str, Any] = {}
    cell = None
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                cell = (d.get("engine"), d.get("method"), d.get("budget"))
                done[d["id"]] = TraceScore(**{k: v for k, v in d.items() if k in names})
    return cell, done


def _load_scores(path: Path) -> dict[str, Any]:
    return _read_cell(path)[1]
