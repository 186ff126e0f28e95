"""The ported presets that read a calibrated file, for the fidelity bench (`kvcompose bench fidelity --pipelines
benchmarks/profiled.py --methods duo_attention lukv`): `methods.preset("duo_attention")` and `"lukv"` refuse to
run without one, so this file builds them from the files that `kvcompose calibrate --target duo|lukv` wrote,
named by two environment variables (`benchmarks/fidelity33.py` sets them):

- `KVCOMPOSE_DUO_PROFILE`: the JSON of `kvcompose calibrate --target duo` (DuoAttention's head types);
- `KVCOMPOSE_LUKV_CURVES`: the JSON of `kvcompose calibrate --target lukv` (LU-KV's head budget curves).

Each preset runs at its kvpress defaults otherwise (`methods.duo_attention`, `methods.lukv`). Calibrate on
questions the tables do not score (the calibration's default, GSM8K test lines 1000-1003, which
`benchmarks/fidelity33.py` excludes from every prompt set).
"""

from __future__ import annotations

import os

from kvcompose import KVComposeError, methods


def _file(var: str, target: str) -> str:
    path = os.environ.get(var)
    if not path or not os.path.exists(path):
        raise KVComposeError(f"set ${var} to the JSON of `kvcompose calibrate --target {target} --out FILE`"
                             + (f" ({path!r} does not exist)" if path else ""))
    return path


def duo_attention(budget: int | None = None):
    """DuoAttention with the head types of `$KVCOMPOSE_DUO_PROFILE`."""
    return methods.duo_attention(profile=_file("KVCOMPOSE_DUO_PROFILE", "duo"))


def lukv(budget: int | None = None, model=None):
    """LU-KV (ExpectedAttention base, which needs the model) with the curves of `$KVCOMPOSE_LUKV_CURVES`."""
    return methods.lukv(curves=_file("KVCOMPOSE_LUKV_CURVES", "lukv"), model=model)


PIPELINES = {"duo_attention": duo_attention, "lukv": lukv}
