"""kvcompose's CUDA attention backends for vLLM: `FLASH_ATTN` and `TRITON_ATTN` with the mixins of
`attention.py`. Written from vLLM 0.32's source (logical KV shape `[num_blocks, H, block_size, 2 * D]`, keys
then values on the last axis, as `runtime.PagedLayout` reads it); no GPU has run them yet. Imported only on
CUDA platforms by `attention.register()`.
"""

from __future__ import annotations

from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from .backend import make_backend

__all__ = ["KVComposeFlashAttentionBackend", "KVComposeTritonAttentionBackend", "register"]

try:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    KVComposeFlashAttentionBackend = make_backend(FlashAttentionBackend, "KVComposeFlashAttentionBackend")
    KVComposeFlashAttentionBackend.__module__ = __name__
except ImportError:  # pragma: no cover - a build without FlashAttention
    KVComposeFlashAttentionBackend = None

from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

KVComposeTritonAttentionBackend = make_backend(TritonAttentionBackend, "KVComposeTritonAttentionBackend")
KVComposeTritonAttentionBackend.__module__ = __name__


def register() -> None:
    """Resolve `FLASH_ATTN` and `TRITON_ATTN` to kvcompose's in this process."""
    if KVComposeFlashAttentionBackend is not None:
        register_backend(AttentionBackendEnum.FLASH_ATTN, f"{__name__}.KVComposeFlashAttentionBackend")
    register_backend(AttentionBackendEnum.TRITON_ATTN, f"{__name__}.KVComposeTritonAttentionBackend")
