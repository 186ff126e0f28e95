"""`vllm serve` with kvcompose: the flags `serve_args` prints parse with vLLM's own `vllm serve` parser into an
engine whose settings kvcompose's scheduler accepts (no engine is started), and kvcompose's plugin entry
point is installed. Skipped without vLLM (its own virtualenv: docs/serving.md)."""

from __future__ import annotations

import importlib.metadata as md

import pytest

pytest.importorskip("vllm")


def _parse(flags: list[str]):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", *flags])
    return AsyncEngineArgs.from_cli_args(args)


def test_serve_flags_parse_into_a_kvcompose_engine():
    from kvcompose.integrations.vllm import SCHEDULER_CLS, WORKER_CLS, serve_args
    from kvcompose.integrations.vllm.rules import CONFIG_KEY, engine_settings

    ea = _parse(serve_args("rkv", 512, preset_args={"window": 8}))
    assert ea.scheduler_cls == SCHEDULER_CLS and ea.worker_cls == WORKER_CLS
    assert ea.block_size == 32 and ea.enable_prefix_caching is False and ea.async_scheduling is False
    cfg = ea.additional_config[CONFIG_KEY]
    s = engine_settings(cfg, ea.block_size)
    assert repr(s.pipeline) == "rkv(lam=0.1)" and (s.budget, s.interval) == (512, 128)


def test_plugin_entry_point_is_installed():
    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kvcompose"]
    assert eps and eps[0].value == "kvcompose.integrations.vllm.plugin:register"
    eps[0].load()()  # registers kvcompose's backends in this process (idempotent)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CPU_ATTN.get_path().endswith("KVComposeCPUAttentionBackend")
