"""Worker side of the vLLM prototype: vLLM's CPU attention backend with a metadata builder that removes freed
(null) blocks from each request's block-table row and shortens its sequence length to match
(`compact_block_table`). The kernel, the KV write (`slot_mapping`) and the positions are vLLM's own.

`register()` overrides vLLM's `CPU_ATTN` backend through the public `register_backend` of
`vllm.v1.attention.backends.registry`; it must run in the worker process before the model is built, which
importing `kvcompose.integrations.vllm.worker` (vLLM's `worker_extension_cls`) does.
"""

from __future__ import annotations

try:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadataBuilder
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"{__name__} needs vLLM (pip install kvcompose[vllm]; see docs/serving.md): {e}"
    ) from e

from .policy import compact_block_table

__all__ = ["KVComposeCPUAttentionBackend", "KVComposeCPUAttentionMetadataBuilder", "register"]


class KVComposeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """`CPUAttentionMetadataBuilder` that hands the kernel compacted block tables (freed blocks removed).

    Runs once per KV-cache group and step; costs one pass over the `[requests, max_blocks]` table, and
    nothing more when no block is null.
    """

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        table, seq_lens, n_freed = compact_block_table(cm.block_table_tensor, cm.seq_lens, self.block_size)
        if n_freed:
            upper = cm.seq_lens_cpu_upper_bound
            if upper is not None:
                upper = upper - (cm.seq_lens - seq_lens).to(upper.dtype)
            cm = cm.replace(block_table_tensor=table, seq_lens=seq_lens, max_seq_len=int(seq_lens.max()),
                            seq_lens_cpu_upper_bound=upper, _num_computed_tokens_cache=None)
        return super().build(common_prefix_len, cm, fast_build)


class KVComposeCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend (same name, kernel and KV layout) with the compacting builder."""

    @staticmethod
    def get_builder_cls():
        return KVComposeCPUAttentionMetadataBuilder


def register() -> None:
    """Make vLLM's `CPU_ATTN` backend resolve to `KVComposeCPUAttentionBackend` in this process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     f"{KVComposeCPUAttentionBackend.__module__}.{KVComposeCPUAttentionBackend.__qualname__}")
