"""Host reads of a compression event, batched: the device values an event needs on the host come back in as
few transfers as possible (one per layer and event, plus one where per-head budgets are made on the device).

An ordinary decode step never waits for the device; an event may, but each wait stalls the GPU's queue, so
an event collects what it must read: checks of device values (`check_later`: a flag and the error it stands
for) and host values (`read_later`: tensors and a callback that receives them as numpy arrays). The event
(`kvcompose.events.run_event`) reads them all in one transfer (`EventReads.flush`), where a failed check
raises its `KVComposeError`. Outside an event (a standalone `Pipeline.select`, a store used alone) both act at
once, as before: one host sync each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .view import KVComposeError

__all__ = ["EventReads", "event_reads", "check_later", "read_later", "active", "with_host", "host_of"]

_STACK: list["EventReads"] = []


class EventReads:
    """The pending host reads of one event (see the module docstring)."""

    def __init__(self) -> None:
        self._checks: list[tuple[Tensor, Any]] = []
        self._reads: list[tuple[list[Tensor], Callable[[list[np.ndarray]], None]]] = []
        self.transfers = 0  # device -> host transfers made by `flush`

    def check(self, bad: Tensor, error: Any) -> None:
        self._checks.append((bad, error))

    def read(self, tensors: Sequence[Tensor], fill: Callable[[list[np.ndarray]], None]) -> None:
        self._reads.append((list(tensors), fill))

    def flush(self, *tensors: Tensor) -> list[np.ndarray]:
        """Read every pending check and value, and `tensors`, in one transfer; raise the first failed check
        (before any callback runs); then run the callbacks; return `tensors` on the host."""
        checks, reads = self._checks, self._reads
        self._checks, self._reads = [], []
        flat: list[Tensor] = [b.reshape(-1) for b, _ in checks]
        for ts, _ in reads:
            flat += [t.reshape(-1) for t in ts]
        flat += [t.reshape(-1) for t in tensors]
        if not flat:
            return []
        dev = flat[0].device
        host = torch.cat([t.to(device=dev, dtype=torch.int64) for t in flat]).cpu().numpy()
        self.transfers += 1
        out, off = [], 0
        for t in flat:
            n = t.numel()
            out.append(host[off : off + n])
            off += n
        k = 0
        for _, error in checks:
            if out[k].any():
                raise error if isinstance(error, Exception) else KVComposeError(error() if callable(error) else error)
            k += 1
        for ts, fill in reads:
            fill([out[k + i].reshape(tuple(t.shape)) for i, t in enumerate(ts)])
            k += len(ts)
        return [out[k + i].reshape(tuple(t.shape)) for i, t in enumerate(tensors)]


@contextlib.contextmanager
def event_reads() -> Iterator[EventReads]:
    """Collect the host reads of one event; whatever is still pending at the end is read then (one
    transfer). An exception inside drops the pending reads."""
    reads = EventReads()
    _STACK.append(reads)
    try:
        yield reads
        reads.flush()
    finally:
        _STACK.remove(reads)


def active() -> EventReads | None:
    """The event collecting host reads now, if any."""
    return _STACK[-1] if _STACK else None


def check_later(bad: Tensor, error: Any) -> None:
    """Raise `error` (a message, a callable giving one, or an exception) if the device flag `bad` (any
    shape; any nonzero element fails) is set: at the event's read, or at once outside an event."""
    ev = active()
    if ev is not None:
        ev.check(bad, error)
    elif bool(bad.any()):
        raise error if isinstance(error, Exception) else KVComposeError(error() if callable(error) else error)


def read_later(tensors: Sequence[Tensor], fill: Callable[[list[np.ndarray]], None]) -> None:
    """Call `fill` with `tensors` as int64 numpy arrays (bool and integer tensors): at the event's read, or
    at once outside an event."""
    ev = active()
    if ev is not None:
        ev.read(tensors, fill)
    else:
        fill([t.to(torch.int64).cpu().numpy() for t in tensors])


def with_host(t: Tensor, host: np.ndarray | None) -> Tensor:
    """Attach a host copy to a device tensor (`host_of(t)` returns it): an event hands the counts it read to
    the blocks it calls with the device tensor, so they need not read it again."""
    if host is not None:
        t.host = host
    return t


def host_of(t: Tensor | None) -> np.ndarray | None:
    """The host copy attached to `t` by `with_host`, if any."""
    return getattr(t, "host", None) if t is not None else None
