"""Kernel tests.  Without CUDA the Triton kernels run under the Triton interpreter,
which must be switched on before anything decorates a ``@triton.jit`` function,
i.e. before ``kvcompose.kernels`` is imported (so: right here, at the very top)."""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for _p in (_ROOT, _HERE):  # repo root (no install needed) and the helpers module
    if _p not in sys.path:
        sys.path.insert(0, _p)

import kvcompose.kernels  # noqa: E402,F401  (decorate the kernels now, with the env set)
