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

Every wrapper launches its Triton kernels through :func:`launch` (the one place that
enters the CUDA device and calls ``kernel[grid](...)``).  :class:`intercept_launches`
replaces the launch by a callable for checks without a GPU: the ahead-of-time compile
check (``kvcompose.bench.aot``) records each launch's signature and constexprs (the
wrappers see a GPU with ``sms`` multiprocessors), and the fake-CUDA decode test runs
each launch on the real halves of its tensors.  While one is active the backend is
``"triton"`` for tensors on CUDA (also fake ones), whatever the device can do.

``force_reference`` and ``use_triton`` work both as plain calls (the setting stays
until changed) and as context managers (the previous setting is restored on exit)::

    with force_reference():          # reference inside the block
        ...
    force_reference(True)            # reference from now on
    force_reference(None)            # back to "unset" (env var / automatic rule)

The state is process-global (not thread-local).
"""

import contextlib
import os
from collections.abc import Callable
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
    "launch",
    "intercept_launches",
    "multiprocessor_count",
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

_STATE: dict = {"use_triton": None, "force_reference": None, "intercept": None}


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
    if _STATE["intercept"] is not None and device.type == "cuda":
        return "triton"  # launches are intercepted: nothing runs on a device
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


# ============================================================================ launches
LaunchHook = Callable[[Any, tuple, tuple, dict], Any]


class intercept_launches:
    """Context manager: every :func:`launch` calls ``hook(kernel, grid, args, kwargs)`` instead of
    launching (``kernel`` the ``@triton.jit`` function, ``grid`` a tuple of ints, ``args`` /
    ``kwargs`` exactly what ``kernel[grid](*args, **kwargs)`` would get), and
    :func:`multiprocessor_count` answers ``sms``.  While it is active, tensors on CUDA take the
    Triton path even where no CUDA runtime exists (fake CUDA tensors).  Not reentrant across
    threads (the state is process-global, like the other switches)."""

    def __init__(self, hook: LaunchHook, sms: int = 132) -> None:
        if not callable(hook):
            raise ValueError(f"intercept_launches: hook must be callable, got {hook!r}")
        if isinstance(sms, bool) or not isinstance(sms, int) or sms < 1:
            raise ValueError(f"intercept_launches: sms must be a positive int, got {sms!r}")
        self.hook, self.sms = hook, sms
        self._prev = None

    def __enter__(self) -> "intercept_launches":
        self._prev = _STATE["intercept"]
        _STATE["intercept"] = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _STATE["intercept"] = self._prev


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a CUDA device; under :class:`intercept_launches`,
    its ``sms``)."""
    hook = _STATE["intercept"]
    if hook is not None:
        return hook.sms
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)`` on the device of the first tensor argument (entered as the
    current CUDA device), or the active :class:`intercept_launches` hook instead."""
    hook = _STATE["intercept"]
    if hook is not None:
        return hook.hook(kernel, tuple(grid), args, kwargs)
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    ctx = torch.cuda.device(dev) if dev is not None and dev.type == "cuda" else contextlib.nullcontext()
    with ctx:
        return kernel[grid](*args, **kwargs)
