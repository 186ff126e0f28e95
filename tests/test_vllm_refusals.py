"""Engine settings kvcompose's vLLM route refuses up front (`scheduler.check_engine`, which the scheduler runs at
start-up): each on a real `VllmConfig` that vLLM itself builds from `EngineArgs` for a tiny model (no engine
is started), and the KV-cache-group check on vLLM's own `KVCacheConfig` types. A clean kvcompose config is
accepted, so every refusal below is caused by the one setting it changes. Skipped without vLLM (its own
virtualenv: docs/serving.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_support import tiny_llama  # noqa: E402

from kvcompose.integrations.vllm import engine_kwargs  # noqa: E402
from kvcompose.view import KVComposeError  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


def _config(model: str, **over):
    from vllm.engine.arg_utils import EngineArgs

    kw = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=512, skip_tokenizer_init=True,
              **engine_kwargs("rkv", budget=128))
    kw.update(over)
    return EngineArgs(**kw).create_engine_config()


def test_a_clean_kvcompose_engine_is_accepted(model):
    from kvcompose.integrations.vllm.scheduler import check_engine

    check_engine(_config(model))


@pytest.mark.parametrize("over,match", [
    (dict(enable_prefix_caching=True), r"prefix caching"),
    (dict(additional_config={}), r"needs additional_config"),
])
def test_engine_args_that_are_refused(model, over, match):
    from kvcompose.integrations.vllm.scheduler import check_engine

    with pytest.raises(KVComposeError, match=match):
        check_engine(_config(model, **over))


def test_speculative_decoding_parallelism_and_async_scheduling_are_refused(model):
    """Settings the CPU platform cannot build (a draft model, several processes) or turns off itself (async
    scheduling), set on copies of a real config: the check reads only these fields. Tensor parallelism runs
    when every rank holds whole KV heads (tests/test_vllm_tp.py); pipeline parallelism is refused."""
    import copy

    from kvcompose.integrations.vllm.scheduler import check_engine

    cfg = _config(model)
    spec = copy.copy(cfg)
    object.__setattr__(spec, "speculative_config", object())  # any speculative config
    with pytest.raises(KVComposeError, match="speculative decoding"):
        check_engine(spec)
    def parallel(**fields):
        par = copy.copy(cfg.parallel_config)
        for k, v in fields.items():
            object.__setattr__(par, k, v)
        out = copy.copy(cfg)
        object.__setattr__(out, "parallel_config", par)
        return out

    with pytest.raises(KVComposeError, match="pipeline parallelism .*different steps"):
        check_engine(parallel(pipeline_parallel_size=2))
    check_engine(parallel(tensor_parallel_size=2))  # the tiny Llama's 2 KV heads: one per rank
    with pytest.raises(KVComposeError, match="tensor_parallel_size=4 with 2 KV heads"):
        check_engine(parallel(tensor_parallel_size=4))  # vLLM would replicate the heads
    sched = copy.copy(cfg.scheduler_config)  # vLLM's CPU platform turns async scheduling off by itself
    object.__setattr__(sched, "async_scheduling", True)
    asy = copy.copy(cfg)
    object.__setattr__(asy, "scheduler_config", sched)
    with pytest.raises(KVComposeError, match="async scheduling"):
        check_engine(asy)
    check_engine(cfg)  # the copies changed nothing in the original


def _kv_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec(layer_names=[f"model.layers.{i}.self_attn.attn"], kv_cache_spec=s)
              for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_more_than_one_kv_cache_group_and_sliding_windows_are_refused(model):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvcompose.integrations.vllm.scheduler import check_engine

    cfg = _config(model)
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    check_engine(cfg, _kv_config(full))
    with pytest.raises(KVComposeError, match="2 KV-cache groups"):
        check_engine(cfg, _kv_config(full, full))
    sw = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    with pytest.raises(KVComposeError, match="SlidingWindowSpec"):
        check_engine(cfg, _kv_config(sw))


def test_pipelines_the_engine_cannot_feed_are_refused_by_the_engine_too(model):
    """H2O (accumulated attention of every query) and budgets that are not whole blocks, given to the engine
    directly in its additional_config (not through engine_kwargs, which refuses them earlier)."""
    from kvcompose.integrations.vllm.rules import engine_settings

    cfg = _config(model)
    for bad, match in (({"preset": "h2o", "budget": 128}, "observes every attention step"),
                       ({"preset": "rkv", "budget": 100}, "not a whole number of vLLM blocks")):
        with pytest.raises(KVComposeError, match=match):
            engine_settings(bad, cfg.cache_config.block_size)
