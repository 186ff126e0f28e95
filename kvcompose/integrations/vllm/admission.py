"""The front end's check of a request's kvcompose settings: a vLLM logits processor whose `validate_params`
refuses a request with bad settings before it enters the engine core, so that the engine never sees it.

vLLM 0.32 calls every custom logits processor's `validate_params(sampling_params)` in its front end when a
request arrives (`InputProcessor._validate_params`, for `LLM.generate` and for the OpenAI server alike); a
`ValueError` there refuses that request alone: `LLM.generate` raises it, the server answers HTTP 400 with
the message. `engine_kwargs` puts the class in `logits_processors` and `serve_args` in `--logits-processors`.
In the worker the processor does nothing (`apply` returns the logits unchanged; argmax-invariant).

The check is `rules.request_settings` against the engine's settings and limits (`rules.engine_limits` of the
engine's `additional_config`, block size and `max_model_len`), the same function the scheduler runs when
the request arrives: a request that passes here is accepted there. vLLM hands `validate_params` only the
request's `SamplingParams`, so the engine's config is read from the front end's `InputProcessor` that calls
it (`self.vllm_config` of a calling frame: not a stable API; when it cannot be found the request goes on
unchecked here, and the scheduler refuses it alone, with an error finish instead of an HTTP 400).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

try:
    from vllm.exceptions import VLLMValidationError
    from vllm.logger import init_logger
    from vllm.v1.sample.logits_processor import LogitsProcessor
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"{__name__} needs vLLM (pip install kvcompose[vllm]; see docs/serving.md): {e}") from e

from ...view import KVComposeError
from .rules import CONFIG_KEY, Engine, engine_limits, request_settings

__all__ = ["KVComposeAdmission", "engine_of", "check_request"]

logger = init_logger(__name__)

_ENGINES: dict[int, tuple[Any, Engine]] = {}  # id(vllm_config) -> (weak reference to it, its Engine)
_WARNED: set[str] = set()


def engine_of(vllm_config) -> Engine | None:
    """The `rules.Engine` of a kvcompose engine's `VllmConfig` (None for an engine without kvcompose
    settings), computed once per config."""
    hit = _ENGINES.get(id(vllm_config))
    if hit is not None and hit[0]() is vllm_config:
        return hit[1]
    cfg = (vllm_config.additional_config or {}).get(CONFIG_KEY)
    if not cfg:
        return None
    engine = engine_limits(dict(cfg), vllm_config.cache_config.block_size, vllm_config.model_config.max_model_len)
    try:
        ref = weakref.ref(vllm_config)
    except TypeError:  # pragma: no cover - a config that takes no weak references: not cached
        return engine
    _ENGINES[id(vllm_config)] = (ref, engine)
    for k in [k for k, (r, _) in _ENGINES.items() if r() is None]:
        del _ENGINES[k]
    return engine


def check_request(extra_args: Any, vllm_config) -> None:
    """Raise vLLM's `VLLMValidationError` (a client error: HTTP 400) naming the problem when a request's
    `extra_args` hold kvcompose settings the engine of `vllm_config` would refuse."""
    engine = engine_of(vllm_config)
    if engine is None:
        return
    try:
        request_settings(extra_args, engine)
    except KVComposeError as e:
        raise VLLMValidationError(f"kvcompose: {e}") from None
    except Exception as e:  # noqa: BLE001 - never expected (tests/test_vllm_rules.py), still the request's fault
        raise VLLMValidationError(f"kvcompose could not read this request's settings ({type(e).__name__}: "
                                  f"{str(e)[:300]})") from None


def _calling_config():
    """The `vllm_config` of the front end object that validates the request (vLLM's `InputProcessor`), found
    among the calling frames; None when vLLM's call path no longer has one."""
    f = sys._getframe(2)
    for _ in range(12):
        if f is None:
            break
        owner = f.f_locals.get("self")
        cfg = getattr(owner, "vllm_config", None)
        if cfg is not None and hasattr(cfg, "additional_config") and hasattr(cfg, "cache_config"):
            return cfg
        f = f.f_back
    return None


class KVComposeAdmission(LogitsProcessor):
    """vLLM logits processor that checks kvcompose request settings at admission (see the module docstring).

    Its `validate_params` raises `VLLMValidationError("kvcompose: ...")` for a request whose
    `SamplingParams.extra_args["kvcompose"]` the engine would refuse; in the worker it changes nothing.
    """

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        extra = sampling_params.extra_args
        if extra is None:
            return
        if not isinstance(extra, dict):
            raise VLLMValidationError(f"kvcompose: SamplingParams.extra_args must be a dict, got {type(extra).__name__}")
        if CONFIG_KEY not in extra:
            return
        cfg = _calling_config()
        if cfg is None:
            if "frame" not in _WARNED:
                _WARNED.add("frame")
                logger.warning("kvcompose: the front end's vLLM config was not found; requests with kvcompose "
                               "settings are checked by the scheduler only (a bad one finishes with an error)")
            return
        check_request(extra, cfg)

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits):
        """Unchanged: this processor only checks requests at admission."""
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass
