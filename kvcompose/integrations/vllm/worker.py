"""Loaded by vLLM in each worker process as `worker_extension_cls` (see `engine_kwargs`): importing it
registers the compacting attention backend (`attention.register`) before the worker builds its model."""

from __future__ import annotations

from .attention import register

__all__ = ["KVComposeWorkerExtension"]

register()


class KVComposeWorkerExtension:
    """Empty worker extension: vLLM mixes it into its worker class; its import does the registration."""
