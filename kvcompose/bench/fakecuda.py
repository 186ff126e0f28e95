"""A fake CUDA device on a CPU-only torch: device discipline and host syncs of GPU code, checked without a GPU.

`install_cuda_guard()` registers c10's `FakeGuardImpl<CUDA>` as the CUDA device guard of a CPU-only torch
build (which has none: indexing a fake CUDA tensor, or `.to("cuda")`, would raise "PyTorch is not linked with
support for cuda devices"). torch's own `torch._C._ensureCUDADeviceGuardSet()` only does this for CUDA builds
without devices, so a three-line C++ shim is compiled once (a C++ compiler and torch's headers are needed;
the `.so` is cached in the temp directory, keyed by the torch version).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["install_cuda_guard", "cuda_guard_available", "FakeCuda", "Twin", "Sync"]

_SHIM = r"""
#include <c10/core/impl/FakeGuardImpl.h>
static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> kvc_fake_cuda_guard;
extern "C" int kvc_install_fake_cuda_guard() {
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  if (slot.load() != nullptr) return 0;
  slot.store(&kvc_fake_cuda_guard);
  return 1;
}
"""
_STATE: dict = {"installed": None}


def _build() -> str | None:
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        return None
    root = os.path.dirname(torch.__file__)
    tag = hashlib.sha1(f"{torch.__version__}:{root}:{_SHIM}".encode()).hexdigest()[:16]
    so = os.path.join(tempfile.gettempdir(), f"kvcompose_fake_cuda_guard_{tag}.so")
    if os.path.exists(so):
        return so
    d = tempfile.mkdtemp(prefix="kvc_guard_")
    src, tmp = os.path.join(d, "guard.cpp"), os.path.join(d, "guard.so")
    with open(src, "w") as fh:
        fh.write(_SHIM)
    lib = os.path.join(root, "lib")
    cmd = [cxx, "-O1", "-shared", "-fPIC", "-std=c++17", f"-I{os.path.join(root, 'include')}", src, "-o", tmp,
           f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        return None
    os.replace(tmp, so)  # atomic: concurrent builders leave one complete file
    return so


def install_cuda_guard() -> bool:
    """Make sure a CUDA device guard exists (a real one on CUDA builds; else the fake one). Returns whether
    one is installed (False: no compiler; indexing fake CUDA tensors will then raise)."""
    if _STATE["installed"] is not None:
        return _STATE["installed"]
    if torch.cuda.is_available() or torch.version.cuda is not None:
        torch._C._ensureCUDADeviceGuardSet()
        _STATE["installed"] = True
        return True
    so = _build()
    if so is None:
        _STATE["installed"] = False
        return False
    ctypes.CDLL(so).kvc_install_fake_cuda_guard()
    _STATE["installed"] = True
    return True


def cuda_guard_available() -> bool:
    """Whether `install_cuda_guard()` can succeed here."""
    return install_cuda_guard()


# ============================================================================ the twin device
class Twin(torch.Tensor):
    """A fake CUDA tensor (`FakeTensor` on `cuda:0`: shape, dtype, strides, device) paired with a real CPU
    tensor holding its values. Only meaningful inside `FakeCuda`, which runs every op on both halves."""

    twin_fake: torch.Tensor
    twin_real: torch.Tensor

    @staticmethod
    def __new__(cls, fake: torch.Tensor, real: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, fake.shape, strides=fake.stride(),
                                                storage_offset=fake.storage_offset(), dtype=fake.dtype,
                                                device=fake.device, requires_grad=False)
        t.twin_fake, t.twin_real = fake, real
        return t

    def data_ptr(self) -> int:  # type: ignore[override]  (address arithmetic of the wrappers: the real one)
        return self.twin_real.data_ptr()

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"Twin({tuple(self.shape)}, {self.dtype}, {self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"Twin tensors work only inside FakeCuda (got {func})")


@dataclass
class Sync:
    """One host sync: what made it, where (the innermost kvcompose frame, else the innermost frame outside
    torch), and at which phase of the run (set by `FakeCuda.phase`)."""

    kind: str      # "item" (a value read on the host), "shape" (a data-dependent shape), "d2h" (blocking copy)
    op: str
    where: str
    phase: str
    kvcompose: bool

    def __str__(self) -> str:
        return f"{self.kind} {self.op} at {self.where}"


_TORCH_DIRS = (os.sep + "torch" + os.sep, os.sep + "jaxtyping" + os.sep, os.sep + "beartype" + os.sep,
               "contextlib.py", "functools.py", "typing.py", os.sep + "fakecuda.py", os.sep + "_python_dispatch")


def _caller() -> tuple[str, bool]:
    f = sys._getframe(2)
    outer = None
    while f is not None:
        name = f.f_code.co_filename
        if not any(s in name for s in _TORCH_DIRS):
            if outer is None:
                outer = f
            if os.sep + "kvcompose" + os.sep in name and os.sep + "bench" + os.sep not in name:
                rel = name.split(os.sep + "kvcompose" + os.sep)[-1]
                return f"{rel}:{f.f_code.co_name}:{f.f_lineno}", True
        f = f.f_back
    if outer is None:
        return "?", False
    return f"{os.path.basename(outer.f_code.co_filename)}:{outer.f_code.co_name}:{outer.f_lineno}", False


class _FakeStream:
    """torch.cuda.Stream / Event stand-in: ordering calls are no-ops (the fake device runs nothing)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        self.device = torch.device("cuda", 0)

    def wait_stream(self, *a: Any) -> None: ...
    def wait_event(self, *a: Any) -> None: ...
    def record(self, *a: Any) -> None: ...
    def record_event(self, *a: Any) -> "_FakeStream":
        return _FakeStream()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:  # a host wait: counted by FakeCuda's patch of the class
        _ACTIVE[-1]._sync("sync", "Stream/Event.synchronize")


_ACTIVE: list["FakeCuda"] = []


class _Gen(torch._C.Generator):
    """`torch.Generator(device="cuda")` stand-in: a CPU generator (the real halves run on the CPU)."""

    def __new__(cls, device: Any = "cpu") -> "_Gen":
        return super().__new__(cls, device="cpu")


class FakeCuda(TorchDispatchMode):
    """Run torch code on a fake CUDA device, every op twice: on `FakeTensor`s on `cuda:0` (device rules:
    a tensor on another device raises `FakeTensorDeviceMismatchError`) and on real CPU tensors (the values,
    so data-dependent control flow follows the real run). Counts every host sync: a value read on the host
    (`item`, `bool`, `int`, `tolist`...), an op whose output shape depends on data (`nonzero`, boolean-mask
    indexing, `unique`...), and a blocking device-to-host copy (`.cpu()`, `.to("cpu")`, `copy_` into host
    memory without `non_blocking` into a pinned buffer); each with its kvcompose frame.

    Inside: `torch.cuda.is_available()` is True, streams and events are no-ops, `torch.Generator(device=
    "cuda")` gives a CPU generator, and Triton launches through `kvcompose.kernels.dispatch.launch` run on the
    real halves (the Triton interpreter). `to_device(module)` moves a model's weights to the fake device.
    `phase` (a string) labels the syncs recorded from then on."""

    def __init__(self) -> None:
        super().__init__()
        from torch._subclasses.fake_tensor import FakeTensorMode

        if not install_cuda_guard():
            raise RuntimeError("FakeCuda needs a CUDA device guard: a C++ compiler to build c10's FakeGuardImpl shim")
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.syncs: list[Sync] = []
        self.async_d2h = 0
        self.launches: list[tuple[str, str]] = []
        self.phase = ""
        self._pinned: set[int] = set()  # storage addresses of the pinned host buffers
        self._patches: list[tuple[Any, str, Any]] = []
        self._intercept = None

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _sync(self, kind: str, op: str) -> None:
        where, ours = _caller()
        self.syncs.append(Sync(kind, op, where, self.phase, ours))

    def count(self, phase: str | None = None, kvcompose_only: bool = True) -> int:
        return sum(1 for s in self.syncs if (phase is None or s.phase == phase) and (s.kvcompose or not kvcompose_only))

    # -- conversion ----------------------------------------------------------------------------------
    def _fake_of(self, x: Any) -> Any:
        if isinstance(x, Twin):
            return x.twin_fake
        if isinstance(x, torch.Tensor):
            return self.fake_mode.from_tensor(x)
        if isinstance(x, torch.Generator):
            return None
        return x

    @staticmethod
    def _real_of(x: Any) -> Any:
        if isinstance(x, Twin):
            return x.twin_real
        if isinstance(x, torch.device) and x.type == "cuda":
            return torch.device("cpu")
        if isinstance(x, str) and x.startswith("cuda"):
            return "cpu"
        return x

    def to_device(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move `module`'s parameters and buffers to the fake device (as `module.to("cuda:0")` would)."""
        old = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)  # new Parameters holding twins
        try:
            with self, torch.no_grad():
                return module.to("cuda:0")
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(old)

    # -- dispatch ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
        from torch.utils._pytree import tree_flatten, tree_map

        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        flat, _ = tree_flatten((args, kwargs))
        twins = [x for x in flat if isinstance(x, Twin)]
        if name in ("record_stream",):
            return None
        if name == "_local_scalar_dense":
            if twins:
                self._sync("item", "item/bool/int/float")
            return func(*tree_map(self._real_of, args), **tree_map(self._real_of, kwargs))
        if name in ("_pin_memory", "pin_memory"):
            out = tree_map(self._real_of, args)[0].clone()
            self._pinned.add(out.untyped_storage().data_ptr())
            return out
        if name == "is_pinned":
            return args[0].untyped_storage().data_ptr() in self._pinned
        rkwargs = tree_map(self._real_of, kwargs)
        pin = bool(rkwargs.pop("pin_memory", False))
        rargs = tree_map(self._real_of, args)
        fkwargs = {k: v for k, v in tree_map(self._fake_of, kwargs).items() if k != "pin_memory"}
        if "generator" in fkwargs:
            fkwargs["generator"] = None  # the fake half draws nothing
        fargs = tree_map(self._fake_of, args)
        try:
            with self.fake_mode:
                fout = func(*fargs, **fkwargs)
            dynamic = False
        except (DataDependentOutputException, DynamicOutputShapeException):
            fout, dynamic = None, True
            if twins:
                self._sync("shape", name)
        rout = func(*rargs, **rkwargs)
        if pin and isinstance(rout, torch.Tensor):
            self._pinned.add(rout.untyped_storage().data_ptr())
        if twins and not dynamic:  # a device -> host copy: blocking unless non_blocking into pinned memory
            fo = tree_flatten(fout)[0]
            if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in fo):
                nb = bool(kwargs.get("non_blocking", False) or (len(args) > 2 and name == "copy_" and args[2]))
                dst = args[0] if name == "copy_" else None
                if nb and (dst is None or dst.untyped_storage().data_ptr() in self._pinned):
                    self.async_d2h += 1
                else:
                    self._sync("d2h", name)
        dev = twins[0].device if twins else torch.device("cuda", 0)
        # pair the outputs: an output that is a real input returns that input (in-place ops, out=)
        real_in = {id(x.twin_real): x for x in twins}
        for x in flat:
            if isinstance(x, torch.Tensor) and not isinstance(x, Twin):
                real_in.setdefault(id(x), x)
        fflat = tree_flatten(fout)[0] if fout is not None else None

        def wrap(r: Any, f: Any) -> Any:
            if not isinstance(r, torch.Tensor):
                return r
            if id(r) in real_in:
                return real_in[id(r)]
            if f is None:  # data-dependent shape: build the fake half from the real result
                if not twins:
                    return r
                with self.fake_mode:
                    f = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=dev)
            if f.device.type != "cuda":
                return r
            return Twin(f, r)

        rflat, spec = tree_flatten(rout)
        if fflat is None or len(fflat) != len(rflat):
            fflat = [None] * len(rflat)
        return spec.unflatten([wrap(r, f) for r, f in zip(rflat, fflat)]) if spec is not None else rout

    # -- the CUDA runtime stand-ins --------------------------------------------------------------------
    def _patch(self, obj: Any, name: str, value: Any) -> None:
        self._patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def _launch(self, kernel, grid, args, kwargs):
        from torch.utils._python_dispatch import _disable_current_modes

        self.launches.append((getattr(kernel, "__name__", None) or kernel.fn.__name__, self.phase))
        real = tuple(a.twin_real if isinstance(a, Twin) else a for a in args)
        with _disable_current_modes():
            kernel[grid](*real, **kwargs)

    def __enter__(self):
        from ..kernels.dispatch import intercept_launches

        c = torch.cuda
        mode = self

        def synchronize(*a: Any, **k: Any) -> None:
            mode._sync("sync", "torch.cuda.synchronize")

        for name, value in (("is_available", lambda: True), ("device_count", lambda: 1), ("_lazy_init", lambda: None),
                            ("current_device", lambda: 0), ("Stream", _FakeStream), ("Event", _FakeStream),
                            ("current_stream", lambda *a, **k: _FakeStream()),
                            ("stream", lambda *a, **k: contextlib.nullcontext()), ("synchronize", synchronize),
                            ("device", lambda *a, **k: contextlib.nullcontext())):
            self._patch(c, name, value)
        self._patch(torch, "Generator", _Gen)
        self._patch(torch.Tensor, "record_stream", lambda t, stream: None)
        self._intercept = intercept_launches(self._launch)
        self._intercept.__enter__()
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any):
        out = super().__exit__(*exc)
        _ACTIVE.pop()
        self._intercept.__exit__(*exc)
        while self._patches:
            obj, name, old = self._patches.pop()
            setattr(obj, name, old)
        return out
