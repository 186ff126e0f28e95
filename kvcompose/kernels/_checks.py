"""Input validation shared by the public kernels.  Every failure is a ``ValueError``
whose message starts with the kernel name and says what was expected and what came."""

from collections.abc import Sequence
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def tensor(
    op: str,
    name: str,
    t: object,
    dims: str,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    kind: str = "",
    min_rank: bool = False,
) -> torch.Tensor:
    """Check ``t`` is a tensor with ``len(dims.split())`` dims (at least, if ``min_rank``)."""
    names = dims.split()
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor [{', '.join(names)}], got {type(t).__name__}")
    if (t.dim() < len(names)) if min_rank else (t.dim() != len(names)):
        need = f"at least {len(names)}" if min_rank else f"{len(names)}"
        raise ValueError(
            f"{op}: {name} must have {need} dims [{', '.join(names)}], got shape {tuple(t.shape)}"
        )
    if dtypes is not None and t.dtype not in dtypes:
        what = kind or ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{op}: {name} must be {what}, got dtype {t.dtype}")
    return t


def shape(op: str, name: str, t: torch.Tensor, expected: Sequence[int], dims: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(
            f"{op}: {name} must have shape [{', '.join(dims.split())}] = {tuple(expected)}, "
            f"got {tuple(t.shape)}"
        )


def same_device(op: str, **tensors: Optional[torch.Tensor]) -> torch.device:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    dev = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev:
            raise ValueError(
                f"{op}: all tensors must be on one device; {items[0][0]} is on {dev} but {k} is on {v.device}"
            )
    return dev


def choice(op: str, name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ValueError(f"{op}: {name} must be one of {list(allowed)}, got {value!r}")
