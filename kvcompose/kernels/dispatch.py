"""Backend selection for the kvcompose hot-path kernels.

Every public kernel in :mod:`kvcompose.kernels` has two implementations: a Triton
kernel and a plain PyTorch reference (:mod:`kvcompose.kernels.ref`).  The reference is
the CPU path and the test oracle.  :func:`select_backend` picks one per call:

1. ``use_triton(True)`` / ``use_triton(False)`` (test hook) wins over everything.
   ``use_triton(True)`` on CPU tensors needs the Triton interpreter, i.e.
   ``TRITON_INTERPRET=1`` set in the environment *before* ``kvcompose.kernels`` is
   imported (Triton chooses interpreter vs. compiler when ``@triton.jit`` runs).
2. ``force_reference(True)`` forces the reference; ``force_reference(False)`` forces
   the automatic rule (it also overrides the environment variable).
3. Environment variable ``KVCOMPOSE_FORCE_REFERENCE=1`` (read at every call) forces
   the reference.
4. Automatic rule: all tensors on CUDA and Triton importable -> ``"triton"``;
   anything else -> ``"reference"``.

``force_reference`` and ``use_triton`` work both as plain calls (the setting stays
until changed) and as context managers (the previous setting is restored on exit)::

    with force_reference():          # reference inside the block
        ...
    force_reference(True)            # reference from now on
    force_reference(None)            # back to "unset" (env var / automatic rule)

The state is process-global (not thread-local).
"""

import os
from typing import Any, Literal, Optional, no_type_check

import torch

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton missing or broken
    triton = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "TRITON_INTERPRETED",
    "Backend",
    "force_reference",
    "use_triton",
    "select_backend",
    "backend_for_device",
    "triton_usable_on",
]

Backend = Literal["triton", "reference"]

if HAS_TRITON:

    @triton.jit
    @no_type_check
    def _probe_kernel(x):  # never launched; only used to see how @triton.jit decorates
        pass

    #: True when ``@triton.jit`` produced interpreter functions (TRITON_INTERPRET=1 was
    #: set when this module was imported).  Kernels then run on CPU tensors.
    TRITON_INTERPRETED: bool = type(_probe_kernel).__name__ == "InterpretedFunction"
else:  # pragma: no cover
    TRITON_INTERPRETED = False

_STATE: dict = {"use_triton": None, "force_reference": None}


class _Setting:
    """Sets a global switch on construction; restores the old value as a context manager."""

    _key = ""

    def __init__(self, flag: Optional[bool] = True) -> None:
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"{type(self).__name__}: flag must be True, False or None, got {flag!r}")
        self._prev = _STATE[self._key]
        _STATE[self._key] = flag

    def __enter__(self) -> "_Setting":
        return self

    def __exit__(self, *exc: Any) -> None:
        _STATE[self._key] = self._prev


class force_reference(_Setting):
    """Force (``True``), un-force (``False``) or reset to the env-var default (``None``)
    the PyTorch reference path.  Usable as a call or as a context manager."""

    _key = "force_reference"

    @staticmethod
    def current() -> Optional[bool]:
        return _STATE["force_reference"]


class use_triton(_Setting):
    """Test hook: ``True`` forces the Triton path (also on CPU tensors when the Triton
    interpreter is active), ``False`` forces the reference, ``None`` restores the
    normal rule.  Usable as a call or as a context manager."""

    _key = "use_triton"

    @staticmethod
    def current() -> Optional[bool]:
        return _STATE["use_triton"]


def _env_forces_reference() -> bool:
    v = os.environ.get("KVCOMPOSE_FORCE_REFERENCE", "").strip().lower()
    return v not in ("", "0", "false", "no", "off")


def triton_usable_on(device: torch.device) -> bool:
    """Whether a Triton kernel can be launched on tensors living on ``device``."""
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return True  # compiled kernels, or the interpreter (which copies to host)
    if device.type == "cpu":
        return TRITON_INTERPRETED
    return False


def backend_for_device(device: torch.device) -> Backend:
    """The backend a call on tensors living on ``device`` gets (rules in the module doc)."""
    forced = _STATE["use_triton"]
    if forced is True:
        if not HAS_TRITON:
            raise RuntimeError("use_triton(True): triton is not importable")
        if not triton_usable_on(device):
            raise RuntimeError(
                f"use_triton(True) on {device.type} tensors needs the Triton interpreter: "
                "set TRITON_INTERPRET=1 before kvcompose.kernels is imported"
            )
        return "triton"
    if forced is False:
        return "reference"
    fr = _STATE["force_reference"]
    if fr is True or (fr is None and _env_forces_reference()):
        return "reference"
    if HAS_TRITON and device.type == "cuda":
        return "triton"
    return "reference"


def select_backend(*tensors: Optional[torch.Tensor]) -> Backend:
    """Pick ``"triton"`` or ``"reference"`` for a call on ``tensors`` (``None`` ignored;
    the public kernels have already checked that they share one device)."""
    ts = [t for t in tensors if t is not None]
    return backend_for_device(ts[0].device if ts else torch.device("cpu"))
