#!/usr/bin/env python3
"""Moved into the package: `kvcompose/bench/external/kvpress_side.py` (an installed kvcompose ships it; print its
path with `python -m kvcompose.bench.external kvpress_side`). This file keeps the commands recorded in docs/results
working in a checkout: it runs the shipped script with the same arguments, in the kvpress virtualenv."""

import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "kvcompose" / "bench" / "external" / "kvpress_side.py"

if __name__ == "__main__":
    sys.argv[0] = str(SCRIPT)
    runpy.run_path(str(SCRIPT), run_name="__main__")
