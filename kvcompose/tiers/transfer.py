"""Host <-> device transfers of the memory tiers: one side CUDA stream per device, reusable pinned host
buffers, and events that order copies before use ("Not All Thoughts Need HBM": host-held tokens are
prefetched back before attention, and the transfer should overlap compute). On CPU, an optional copy thread
stands in for the side stream (`HostStash(copy_thread=True)`), so the overlap can be measured without a GPU.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from ..view import KVComposeError

__all__ = ["transfer_stream", "copy_thread", "PendingCopy", "HostStash"]

_streams: dict[torch.device, Any] = {}
_copier: ThreadPoolExecutor | None = None
_copier_lock = threading.Lock()


def copy_thread() -> ThreadPoolExecutor:
    """The one background thread that carries CPU stand-in copies (serial, like a CUDA copy stream)."""
    global _copier
    with _copier_lock:
        if _copier is None:
            _copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcompose-copy")
        return _copier


def transfer_stream(device: torch.device):
    """The side CUDA stream that carries every host <-> device copy of kvcompose's tiers on `device`.

    One stream per device: copies issued on it run in order, so a host buffer is never overwritten by a
    device-to-host copy while an earlier host-to-device copy still reads it.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise KVComposeError(f"transfer streams exist only for CUDA devices, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    s = _streams.get(device)
    if s is None:
        s = torch.cuda.Stream(device=device)
        _streams[device] = s
    return s


class PendingCopy:
    """Device tensors being filled by host-to-device copies on the transfer stream (the prefetch of
    "Not All Thoughts Need HBM": host tokens come back before attention). `tensors`: name -> tensor of any
    shape, e.g. keys `[B, H, N, D]`.

    `wait()` makes the current (compute) stream wait on the copy event (never the host) and marks the
    tensors as used by the compute stream (`record_stream`), so the caching allocator cannot hand their
    memory to another tensor while the compute stream still reads them.
    """

    def __init__(self, tensors: dict[str, Tensor] | Future, event: Any | None):
        self.tensors = tensors
        self.event = event

    def wait(self) -> dict[str, Tensor]:
        if isinstance(self.tensors, Future):  # a CPU copy thread's result
            self.tensors = self.tensors.result()
        if self.event is not None:
            dev = next(iter(self.tensors.values())).device
            cur = torch.cuda.current_stream(dev)
            cur.wait_event(self.event)
            for t in self.tensors.values():
                t.record_stream(cur)
            self.event = None
        return self.tensors


class HostStash:
    """Named tensors kept in host memory for one layer and one tier (e.g. keys `[B, H, N, D]` and values
    `[B, H, N, Dv]` of the host tier of "Not All Thoughts Need HBM", or a compressed tier's codes).

    On CUDA (`device.type == "cuda"`): one reusable pinned buffer per name (grown by 1.5x when too small,
    never reallocated per step). `put` copies device tensors into them on the side transfer stream after
    that stream waits for the compute stream (the sources are produced there), marks the sources with
    `record_stream(side)` so their memory is not reused mid-copy, and records an event. `start` issues the
    host-to-device copies on the same stream after waiting on that event, into fresh device tensors
    allocated on the side stream, and records an event; the consumer's `PendingCopy.wait()` makes the
    compute stream wait on it. The compute stream never blocks on a device-to-host copy.

    On CPU (or any non-CUDA device) `put` keeps a copy of the tensors and `start` hands out views of it: a
    synchronous, exact round trip that never aliases the caller's tensors. With `copy_thread=True`, `start`
    instead copies the content on the background copy thread (`copy_thread()`) and the handle's `wait()`
    joins it: the transfer a GPU would make, run beside the compute so a prefetcher can overlap it.
    """

    def __init__(self, device: torch.device, copy_thread: bool = False):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.threaded = bool(copy_thread) and not self.cuda
        self._buf: dict[str, Tensor] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._data: dict[str, Tensor] = {}
        self._ready: Any | None = None

    def put(self, tensors: dict[str, Tensor]) -> None:
        """Replace the stash content with `tensors` (all on `self.device`)."""
        if not self.cuda:
            self._data = {k: v.clone() for k, v in tensors.items()}  # host memory holds its own copy
            self._meta = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
            return
        side = transfer_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        meta = {}
        with torch.cuda.stream(side):
            for name, src in tensors.items():
                n = src.numel()
                buf = self._buf.get(name)
                if buf is None or buf.dtype != src.dtype or buf.numel() < n:
                    old = 0 if buf is None or buf.dtype != src.dtype else buf.numel()
                    buf = torch.empty(max(n, math.ceil(1.5 * old), 1), dtype=src.dtype, device="cpu",
                                      pin_memory=True)
                    self._buf[name] = buf
                buf[:n].view(src.shape).copy_(src, non_blocking=True)
                src.record_stream(side)
                meta[name] = (tuple(src.shape), src.dtype)
            ev = torch.cuda.Event()
            ev.record(side)
        self._meta = meta
        self._ready = ev

    @property
    def asynchronous(self) -> bool:
        """Whether `start` runs beside the compute (CUDA side stream or CPU copy thread)."""
        return self.cuda or self.threaded

    def start(self) -> PendingCopy:
        """Begin bringing the content to the device; returns a handle whose `wait()` gives the tensors."""
        if self.threaded:
            data = dict(self._data)
            return PendingCopy(copy_thread().submit(lambda: {k: v.clone() for k, v in data.items()}), None)
        if not self.cuda:
            return PendingCopy(dict(self._data), None)
        side = transfer_stream(self.device)
        out = {}
        with torch.cuda.stream(side):
            if self._ready is not None:
                side.wait_event(self._ready)
            for name, (shape, dtype) in self._meta.items():
                n = math.prod(shape)
                dst = torch.empty(shape, dtype=dtype, device=self.device)
                dst.copy_(self._buf[name][:n].view(shape), non_blocking=True)
                out[name] = dst
            ev = torch.cuda.Event()
            ev.record(side)
        return PendingCopy(out, ev)

    def get(self) -> dict[str, Tensor]:
        """The content on the device, ready for the current stream."""
        return self.start().wait()

    def apply(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Apply a batch operation to every tensor (via the device on CUDA)."""
        self.put({k: fn(v) for k, v in self.get().items()})

    def nbytes(self) -> int:
        """Bytes of the content (not of the buffers' spare capacity)."""
        return sum(math.prod(s) * d.itemsize for s, d in self._meta.values())

    def allocated(self) -> int:
        """Bytes of the pinned buffers (CUDA) or of the content (CPU)."""
        if not self.cuda:
            return self.nbytes()
        return sum(b.numel() * b.element_size() for b in self._buf.values())
