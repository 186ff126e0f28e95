"""kvcompose's mixins for a vLLM attention backend (see `attention.py`) and `make_backend`, which puts them on
any backend class. Imports nothing from vLLM: the backend classes come from the caller."""

from __future__ import annotations

import time

__all__ = ["PhysicalLengths", "RecordQueries", "LayerSlots", "make_backend", "backend_kind"]

_KINDS = {"CPU_ATTN": "CPU_ATTN", "FLASH_ATTN": "FLASH_ATTN", "TRITON_ATTN": "TRITON_ATTN"}


def backend_kind(name: str) -> str:
    """The KV layout family of a backend name (`runtime.PagedLayout`), or a clear refusal."""
    if name not in _KINDS:
        from ...view import KVComposeError

        raise KVComposeError(f"kvcompose's vLLM route supports the attention backends {sorted(_KINDS)}, not {name}")
    return _KINDS[name]


class PhysicalLengths:
    """Builder mixin: physical lengths and slots for the kernel (see the module docstring)."""

    _kvc = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        rt = self._kvc
        plan = None if rt is None else rt.step
        if plan is None or not plan.physical:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        t0 = time.perf_counter()
        cm = common_attn_metadata
        if cm.num_reqs != plan.seq_lens.shape[0]:  # padded batches (CUDA graphs) are refused up front
            from ...view import KVComposeError

            raise KVComposeError(f"attention metadata for {cm.num_reqs} requests, kvcompose planned "
                                 f"{plan.seq_lens.shape[0]}")
        rt.slots(cm.block_table_tensor, cm.slot_mapping)
        plan.block_table = cm.block_table_tensor
        upper = cm.seq_lens_cpu_upper_bound
        if plan.class_seq_lens is not None:  # layers hold their own counts: one metadata per class of layers
            plan.class_slots, plan.class_meta = [], []
            for phys, (seq, seq_cpu, top) in zip(plan.class_phys, plan.class_seq_lens):
                slots = cm.slot_mapping.clone()
                rt.slots(cm.block_table_tensor, slots, phys)
                plan.class_slots.append(slots)
                plan.class_meta.append(super().build(common_prefix_len, cm.replace(
                    seq_lens=seq.to(cm.seq_lens.dtype), max_seq_len=top, slot_mapping=slots,
                    seq_lens_cpu_upper_bound=None if upper is None else seq_cpu.to(upper.dtype),
                    _num_computed_tokens_cache=None), fast_build))
        cm = cm.replace(
            seq_lens=plan.seq_lens.to(cm.seq_lens.dtype),
            max_seq_len=plan.max_seq_len,
            seq_lens_cpu_upper_bound=None if upper is None else plan.seq_lens_cpu.to(upper.dtype),
            _num_computed_tokens_cache=None,
        )
        rt.stats.builder_seconds += time.perf_counter() - t0
        return super().build(common_prefix_len, cm, fast_build)


class RecordQueries:
    """Impl mixin: records the step's planned queries of this layer before vLLM's attention."""

    _kvc = None
    _kvc_layer = -1

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        rt = self._kvc
        if rt is not None and attn_metadata is not None:
            rt.record(self._kvc_layer, query)
            own = rt.layer_metadata(self._kvc_layer)  # layers that hold their own counts read their own lengths
            if own is not None:
                attn_metadata = own
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        plan = None if rt is None else rt.step
        if plan is not None and plan.head_rows is not None and attn_metadata is not None:
            rt.head_attention(self._kvc_layer, query, kv_cache, output)  # heads that hold their own counts
        return out


class LayerSlots:
    """Impl mixin (backends whose impl writes the KV cache in `do_kv_cache_update`): a layer that holds its own
    count writes this step's keys and values at its own physical slots (`Runtime.layer_slots`)."""

    _kvc = None
    _kvc_layer = -1

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        rt = self._kvc
        if rt is not None:
            own = rt.layer_slots(self._kvc_layer)
            if own is not None:
                slot_mapping = own
        return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping, *args, **kwargs)


def make_backend(base: type, name: str) -> type:
    """`base` (a vLLM attention backend class) whose builder and impl carry kvcompose's mixins."""
    builder = type(f"KVCompose{base.get_builder_cls().__name__}", (PhysicalLengths, base.get_builder_cls()), {})
    base_impl = base.get_impl_cls()
    mixins = (RecordQueries, LayerSlots) if hasattr(base_impl, "do_kv_cache_update") else (RecordQueries,)
    impl = type(f"KVCompose{base_impl.__name__}", (*mixins, base_impl), {})
    return type(name, (base,), {
        "get_builder_cls": staticmethod(lambda: builder),
        "get_impl_cls": staticmethod(lambda: impl),
        "__doc__": f"vLLM's {base.__name__} with kvcompose's physical lengths and query ring.",
    })
