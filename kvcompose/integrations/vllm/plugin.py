"""vLLM's `vllm.general_plugins` entry point of kvcompose (declared in pyproject.toml): vLLM calls `register()`
in each of its processes (front end, engine core, workers) whenever kvcompose is installed next to it.

It registers kvcompose's attention backends over the platform's (`attention.register`). They stay
pass-through until a kvcompose worker (`worker_cls`, which `vllm serve --worker-cls` or `engine_kwargs`
sets) attaches its state, so an engine without kvcompose settings runs vLLM's code unchanged. The worker
registers them too, so the plugin is a convenience for `vllm serve`, not a requirement; nothing here imports
vLLM at import time.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register kvcompose's attention backends in this vLLM process (idempotent; a no-op without vLLM)."""
    try:
        from .attention import register as _register
    except ImportError:  # kvcompose installed without vLLM: nothing to register
        return
    _register()
