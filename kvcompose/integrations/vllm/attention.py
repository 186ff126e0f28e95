"""kvcompose's attention backends for vLLM: the platform's backend (`CPU_ATTN`; on CUDA `FLASH_ATTN` and
`TRITON_ATTN`) with two mixins, registered over it through vLLM's public `register_backend`.

* `PhysicalLengths` (metadata builder): when a request of the step's batch was compressed, the kernel gets
  the physical lengths (`seq_lens` = held + new tokens) and the step's `slot_mapping` is rewritten in place
  from the physical positions and the compacted block table (`Runtime.slots`); the logical positions
  (RoPE) are untouched. The same tensor is the forward context's slot mapping, so the KV write of every
  layer lands at the physical slots.
* `RecordQueries` (impl): before vLLM's attention, writes the step's planned post-RoPE queries of the layer
  into kvcompose's ring (`Runtime.record`); after it, recomputes the rows whose KV heads hold their own counts
  (`Runtime.head_attention`: vLLM's kernels read one length for every KV head).

Both are pass-through until a kvcompose worker attaches its `Runtime` (`_kvc`): an engine without kvcompose
in the same process runs vLLM's code unchanged. Only `CPU_ATTN` runs here; the CUDA classes
(`attention_gpu.py`) are written from vLLM's source and untested.

Relies on (not a stable vLLM API): `CommonAttentionMetadata.replace` and its fields `seq_lens`,
`seq_lens_cpu_upper_bound`, `max_seq_len`, `block_table_tensor`, `slot_mapping`, `_num_computed_tokens_cache`;
the impls' `forward(layer, query, key, value, kv_cache, attn_metadata, output, ...)` signature.
"""

from __future__ import annotations

try:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"{__name__} needs vLLM (pip install kvcompose[vllm]; see docs/serving.md): {e}") from e

from .backend import PhysicalLengths, RecordQueries, backend_kind, make_backend

__all__ = ["PhysicalLengths", "RecordQueries", "register", "backend_kind", "make_backend"]

if current_platform.is_cpu():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    KVComposeCPUAttentionBackend = make_backend(CPUAttentionBackend, "KVComposeCPUAttentionBackend")
    KVComposeCPUAttentionBackend.__module__ = __name__


def register() -> None:
    """Resolve this platform's attention backends to kvcompose's (in this process; idempotent)."""
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.KVComposeCPUAttentionBackend")
    elif current_platform.is_cuda_alike():  # pragma: no cover - no GPU here
        from . import attention_gpu

        attention_gpu.register()
