"""A fake CUDA device on a CPU-only torch: device discipline and host syncs of GPU code, checked without a GPU.

`install_cuda_guard()` registers c10's `FakeGuardImpl<CUDA>` as the CUDA device guard of a CPU-only torch
build (which has none: indexing a fake CUDA tensor, or `.to("cuda")`, would raise "PyTorch is not linked with
support for cuda devices"). torch's own `torch._C._ensureCUDADeviceGuardSet()` only does this for CUDA builds
without devices, so a three-line C++ shim is compiled once (a C++ compiler and torch's headers are needed;
the `.so` is cached in the temp directory, keyed by the torch version).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

__all__ = ["install_cuda_guard", "cuda_guard_available"]

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
