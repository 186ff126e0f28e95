"""kvcompose hot-path kernels: Triton kernels with plain PyTorch references.

Public functions (each dispatches per call, see :mod:`kvcompose.kernels.dispatch`:
CUDA tensors -> Triton when importable, otherwise the reference in
:mod:`kvcompose.kernels.ref`; ``KVCOMPOSE_FORCE_REFERENCE=1`` or
``force_reference(True)`` force the reference; ``use_triton(True)`` is the test hook):

* :func:`compact` — gather kept KV rows (optionally in place).
* :func:`value_magnitude` — per-token value range / L2 norm (VaSE).
* :func:`key_redundancy` — R-KV key redundancy (arXiv 2505.24133).
* :func:`window_attention_scores` — observation-window attention mass (SnapKV arXiv
  2404.14469, R-KV, VaSE).
* :func:`quantize` / :func:`dequantize` / :class:`QTensor` — KIVI group quantization
  (arXiv 2402.02750).
* :func:`paged_decode_attention` — attention over ragged paged KV storage (unequal
  per-head lengths), flash-decoding style, GQA folded.

This package imports nothing from the rest of kvcompose.
"""

from . import ref
from .compact import compact
from .dispatch import (
    HAS_TRITON,
    TRITON_INTERPRETED,
    backend_for_device,
    force_reference,
    select_backend,
    use_triton,
)
from .paged_attention import paged_decode_attention, paged_decode_attention_reference
from .quant import QTensor, dequantize, quantize
from .scores import key_redundancy, value_magnitude, window_attention_scores

__all__ = [
    "HAS_TRITON",
    "TRITON_INTERPRETED",
    "QTensor",
    "backend_for_device",
    "compact",
    "dequantize",
    "force_reference",
    "key_redundancy",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "quantize",
    "ref",
    "select_backend",
    "use_triton",
    "value_magnitude",
    "window_attention_scores",
]
