"""Shared helpers for tests/kernels (imported as a plain module; conftest puts this
directory on sys.path)."""

import contextlib
import os

import pytest
import torch

from helpers import examples
from hypothesis import HealthCheck, settings

import kvcompose.kernels as K

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: Whether the Triton path can run here: on CUDA, or on CPU under the interpreter.
TRITON_OK = K.HAS_TRITON and (DEVICE.type == "cuda" or K.TRITON_INTERPRETED)

requires_triton = pytest.mark.skipif(
    not TRITON_OK,
    reason="Triton path unavailable: no CUDA and TRITON_INTERPRET=1 was not set "
    "before kvcompose.kernels was imported",
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Tolerances for results *in the input dtype* (e.g. dequantized tensors): one unit in
#: the last place (the interpreter truncates fp32->bf16 where torch rounds).
DTYPE_TOL = {
    torch.float16: dict(atol=1e-3, rtol=2 ** -10),
    torch.bfloat16: dict(atol=1e-2, rtol=2 ** -7),
    torch.float32: dict(atol=1e-6, rtol=1e-6),
}

#: Tolerance for float32 score outputs.  Both paths upcast the (exactly representable)
#: inputs to float32 and differ only in summation order / exp, whatever the input
#: dtype; 16-bit inputs get slightly more room for the GPU's native 16-bit dot.
SCORE_TOL = {
    torch.float16: dict(atol=2e-6, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-6, rtol=1e-4),
    torch.float32: dict(atol=1e-6, rtol=1e-5),
}

#: Hypothesis settings for the parity tests: few, small examples (the interpreter costs
#: ~1 ms per program).  KV_KERNEL_EXAMPLES=200 runs a longer search.
FAST = settings(
    max_examples=int(os.environ["KV_KERNEL_EXAMPLES"]) if "KV_KERNEL_EXAMPLES" in os.environ else examples(20),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def rand_bool(g, *shape, p=0.8):
    return (torch.rand(*shape, generator=g) < p).to(DEVICE)


def both(fn, *args, **kwargs):
    """(Triton result, reference result) of ``fn(*args, **kwargs)``."""
    with K.use_triton(True):
        a = fn(*args, **kwargs)
    with K.use_triton(False):
        b = fn(*args, **kwargs)
    return a, b


@contextlib.contextmanager
def no_backend(name):
    """Make the reference implementation ``K.ref.<name>`` raise while active."""
    orig = getattr(K.ref, name)

    def boom(*a, **k):
        raise AssertionError(f"reference {name} called")

    setattr(K.ref, name, boom)
    try:
        yield
    finally:
        setattr(K.ref, name, orig)
