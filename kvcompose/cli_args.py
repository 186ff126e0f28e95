"""The command line's argument checks, shared by every `kvcompose` subcommand: numbers, paths, the model and the
device are checked while the arguments are parsed, before anything is loaded or written, and a bad one ends the
command with exit code 2 and one line naming it.

- `Parser` is the `argparse.ArgumentParser` of every (sub)command: its errors are one line (no usage dump), and
  `add_argument` gives every option a checked type from its name (`RULES`): counts, budgets, token numbers
  and steps are positive ints, offsets and seeds non-negative, probabilities in (0, 1], input files must exist
  and be readable, output folders must be creatable. An option declared with its own `type=` keeps it.
- `model_arg`, `device_arg`, `data_file`, `json_file`, `output_dir`, `output_file`, `results_dir` are the
  checked types themselves.
- `preflight(command, args)` does the checks that look at several options (the questions a run needs are in
  the data file, a saved result parses) once parsing is done, still before a model loads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

__all__ = ["Parser", "RULES", "model_arg", "device_arg", "data_file", "json_file", "output_dir", "output_file",
           "results_dir", "preflight", "one_line"]

LIMIT = 2**31  # budgets, intervals and token counts are int32 indices inside kvcompose


def one_line(msg: object) -> str:
    """A message on one line (an exception's text may span several)."""
    text = " ".join(str(msg).split())
    return text if len(text) <= 600 else text[:597] + "..."


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line (exit code 2) and whose options get checked types."""

    def error(self, message: str):  # argparse's contract: print and exit with code 2
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")

    def add_argument(self, *names: str, **kw: Any):
        """`argparse`'s `add_argument`, with the checked type of `RULES` for an option given without one, and a
        checked int / float (positive unless the name says otherwise) for `type=int` / `type=float`."""
        return super().add_argument(*names, **_checked(names, kw))

    def add_argument_group(self, *args: Any, **kw: Any):
        return _checking(super().add_argument_group(*args, **kw))

    def add_mutually_exclusive_group(self, **kw: Any):
        return _checking(super().add_mutually_exclusive_group(**kw))


def _checked(names: tuple[str, ...], kw: dict[str, Any]) -> dict[str, Any]:
    if names and names[0].startswith("-") and kw.get("action") in (None, "store", "append"):
        dest = kw.get("dest") or next((n for n in names if n.startswith("--")), names[0]).lstrip("-")
        dest = dest.replace("-", "_")
        if "type" not in kw and dest in RULES:
            kw["type"] = RULES[dest]
        elif kw.get("type") in (int, float):
            kw["type"] = _rule(dest, kw["type"], kw.get("default"))
    return kw


def _checking(group):
    """An argument group (or mutually exclusive group) whose options get checked types too."""
    add = group.add_argument
    group.add_argument = lambda *names, **kw: add(*names, **_checked(names, kw))
    group.add_argument_group = lambda *a, **k: _checking(type(group).add_argument_group(group, *a, **k))
    group.add_mutually_exclusive_group = lambda **k: _checking(type(group).add_mutually_exclusive_group(group, **k))
    return group


# ------------------------------------------------------------------------------------------ numbers
def _number(kind: type, lo: int | float | None, hi: int | float | None, lo_open: bool = False, what: str = "") -> Callable:
    def convert(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and v != v:
            raise argparse.ArgumentTypeError("NaN is not a number here")
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v

    convert.__name__ = f"{kind.__name__} ({what})"
    return convert


POSITIVE_INT = _number(int, 1, LIMIT - 1, what="a positive integer below 2**31")
NONNEGATIVE_INT = _number(int, 0, LIMIT - 1, what="an integer >= 0")
POSITIVE_FLOAT = _number(float, 0.0, None, lo_open=True, what="a number > 0")
NONNEGATIVE_FLOAT = _number(float, 0.0, None, what="a number >= 0")
UNIT_FLOAT = _number(float, 0.0, 1.0, lo_open=True, what="a number in (0, 1]")

_NONNEGATIVE_INTS = {"seed", "offset", "index", "min_prompt_tokens", "short_tokens", "free_gen_prompts",
                     "no_repeat_ngram_size"}
_UNIT_FLOATS = {"top_p", "coverage"}
_NONNEGATIVE_FLOATS = {"temperature"}


# ------------------------------------------------------------------------------------------ paths
def _readable_file(text: str, what: str) -> Path:
    p = Path(text).expanduser()
    if not p.exists():
        raise argparse.ArgumentTypeError(f"{what} {text!r} does not exist")
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"{what} {text!r} is not a file")
    if not os.access(p, os.R_OK):
        raise argparse.ArgumentTypeError(f"{what} {text!r} is not readable")
    return p


def data_file(text: str) -> str:
    """A JSONL file of questions: it exists and every non-empty line is a JSON object with a 'question' (or
    'problem') field."""
    p = _readable_file(text, "data file")
    check_questions(p)
    return str(p)


def check_questions(p: Path) -> int:
    """Number of question records of a JSONL file; raises `ArgumentTypeError` at the first bad line."""
    n = 0
    try:
        with p.open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise argparse.ArgumentTypeError(f"{p}:{i} is not a JSON line ({e.msg})") from None
                if not isinstance(rec, dict) or not any(k in rec for k in ("question", "problem", "Question", "Problem")):
                    raise argparse.ArgumentTypeError(f"{p}:{i} has no 'question' (or 'problem') field")
                n += 1
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{p} is not a UTF-8 text file") from None
    if n == 0:
        raise argparse.ArgumentTypeError(f"{p} holds no question")
    return n


def json_file(text: str) -> str:
    """A readable JSON file (a saved result: --traces, --kvpress-json)."""
    p = _readable_file(text, "JSON file")
    try:
        json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON file ({getattr(e, 'msg', e)})") from None
    return str(p)


def script_file(text: str) -> str:
    return str(_readable_file(text, "script"))


def _creatable(p: Path, what: str) -> None:
    """Raise unless `p` could be created: its nearest existing ancestor is a writable folder."""
    a = p.parent
    while not a.exists():
        a = a.parent
    if not a.is_dir():
        raise argparse.ArgumentTypeError(f"{what} {str(p)!r}: {str(a)!r} is a file, not a folder")
    if not os.access(a, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{what} {str(p)!r}: {str(a)!r} is not writable")


def output_dir(text: str) -> str:
    """An output folder: an existing folder, or one that can be created (nothing is created while checking)."""
    p = Path(text).expanduser()
    if p.exists():
        if not p.is_dir():
            raise argparse.ArgumentTypeError(f"output folder {text!r} is a file")
        if not os.access(p, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"output folder {text!r} is not writable")
    else:
        _creatable(p, "output folder")
    return text


def output_file(text: str) -> str:
    """An output file: not a folder, in a folder that exists or can be created."""
    p = Path(text).expanduser()
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"output file {text!r} is a folder")
    if p.exists() and not os.access(p, os.W_OK):
        raise argparse.ArgumentTypeError(f"output file {text!r} is not writable")
    if not p.exists():
        _creatable(p, "output file")
    return text


def results_dir(text: str) -> str:
    """A folder of results JSON (`bench report`)."""
    p = Path(text).expanduser()
    if not p.exists():
        raise argparse.ArgumentTypeError(f"results folder {text!r} does not exist")
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"results folder {text!r} is not a folder")
    if not any(p.glob("*.json")):
        raise argparse.ArgumentTypeError(f"results folder {text!r} holds no results JSON")
    return text


# ------------------------------------------------------------------------------------------ model and device
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def model_arg(text: str) -> str:
    """A model folder (with a config.json or the default GGUF) or a Hugging Face hub id ("org/name")."""
    p = Path(text).expanduser()
    if p.exists():
        if p.is_file():
            raise argparse.ArgumentTypeError(f"model {text!r} is a file: pass the folder that holds the model")
        from .models import GGUF_FILE

        if not (p / "config.json").is_file() and not (p / GGUF_FILE).is_file():
            raise argparse.ArgumentTypeError(f"model folder {text!r} holds no model (no config.json)")
        return text
    if text.startswith(("/", ".", "~")) or "\\" in text or not _HUB_ID.match(text):
        raise argparse.ArgumentTypeError(f"model folder {text!r} does not exist")
    return text  # a hub id: resolved (downloaded or from the local cache) when the model loads


def device_arg(text: str) -> str:
    """A torch device that exists on this machine (e.g. cpu, cuda, cuda:1, mps)."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (e.g. cpu, cuda, cuda:0)") from None
    if dev.type == "cpu":
        return text
    if dev.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise argparse.ArgumentTypeError(f"device {text!r}: this torch is built without CUDA")
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"device {text!r}: no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"device {text!r}: only {torch.cuda.device_count()} CUDA devices")
        return text
    backend = getattr(torch.backends, dev.type, None) or getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise argparse.ArgumentTypeError(f"device {text!r} is not available on this machine")
    return text


# ------------------------------------------------------------------------------------------ the rule table
RULES: dict[str, Callable[[str], Any]] = {
    "model": model_arg,
    "device": device_arg,
    "data": data_file,
    "traces": json_file,
    "kvpress_json": json_file,
    "kvpress_script": script_file,
    "exclude": json_file,
    "references": output_dir,
    "out": output_dir,
}
"""Option name -> checked type, for options declared without a type (paths, the model, the device). `--kvpress-python`
is not checked: a missing kvpress environment skips the kvpress side by side with a note, by design."""


def _rule(dest: str, kind: type, default: Any = None) -> Callable[[str], Any]:
    """The checked number type of an option: positive unless its name is one of the non-negative or unit ones,
    ends in `seed`, or its default is 0 (an option whose default is 0 accepts 0 given explicitly)."""
    zero = any(d == 0 for d in (default if isinstance(default, (list, tuple)) else [default])
               if isinstance(d, (int, float)) and not isinstance(d, bool))
    if kind is int:
        return NONNEGATIVE_INT if dest in _NONNEGATIVE_INTS or dest.endswith("seed") or zero else POSITIVE_INT
    if zero:
        return NONNEGATIVE_FLOAT
    if dest in _UNIT_FLOATS:
        return UNIT_FLOAT
    return NONNEGATIVE_FLOAT if dest in _NONNEGATIVE_FLOATS else POSITIVE_FLOAT


# ------------------------------------------------------------------------------------------ preflight
def _data_path(args, env: bool = True) -> Path | None:
    from .data import ENV_GSM8K

    if getattr(args, "data", None):
        return Path(args.data)
    if not env:
        return None
    p = os.environ.get(ENV_GSM8K)
    if not p:
        return None
    try:
        return Path(data_file(p))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"${ENV_GSM8K}: {e}; pass --data FILE.jsonl or set ${ENV_GSM8K} to a "
                                         "JSONL file of questions") from None


def _need(path: Path | None, n: int, offset: int, what: str) -> None:
    from .data import ENV_GSM8K

    if path is None:
        raise argparse.ArgumentTypeError(f"{what} needs questions: pass --data FILE.jsonl (a 'question' field per "
                                         f"line, e.g. GSM8K's test.jsonl) or set ${ENV_GSM8K}")
    have = check_questions(path)
    if have < offset + n:
        raise argparse.ArgumentTypeError(f"{what}: {path} holds {have} questions, fewer than --offset {offset} + {n}")


def preflight(command: str, args) -> None:
    """Checks across options, before any model loads; raises `argparse.ArgumentTypeError` (one line)."""
    if command == "generate" and args.data:
        _need(Path(args.data), 1, args.index, "generate --index")
    elif command == "bench fidelity":
        _need(_data_path(args), max(args.n_prompts, args.free_gen_prompts), args.offset, "bench fidelity")
    elif command == "calibrate":
        _need(_data_path(args), args.n, args.offset, "calibrate")
    elif command in ("bench speed", "bench throughput"):
        _methods_fit(args.methods, args.budget)
    elif command == "bench accuracy" and args.data is None and args.dataset is None:
        from .data import DATASETS

        path = _data_path(args)
        if path is None:
            raise argparse.ArgumentTypeError(
                f"bench accuracy needs questions: --data FILE.jsonl, --dataset {{{','.join(DATASETS)}}} or $KVCOMPOSE_GSM8K")


def _methods_fit(names: list[str] | None, budget: int) -> None:
    """Every method of a benchmark must work at its budget (its protectors fit): a method that cannot is refused
    before the model loads, instead of a report without it."""
    from . import methods as _methods
    from .view import KVComposeError

    for name in names if names is not None else [m for m in _methods.PRESETS if m != "full"]:
        pipe = _methods.preset(name, budget=budget)
        try:
            pipe.validate(budget)
        except KVComposeError as e:
            raise argparse.ArgumentTypeError(f"--budget {budget} is too small for {name}: {e}") from None


def fail(prog: str, message: object) -> int:
    """Print the one-line error of a command and return its exit code (2)."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return 2
