"""Published methods as preset Pipelines: each is a few blocks, never a special case in the cache.

Read like optax's `alias.py`: `vase` = sinks + value protection + attention-weighted sampling.
"""

from .baselines import full, h2o, snapkv, streaming_llm, tova, knorm
from .reasoning import random_attention, rkv, vase

__all__ = ["full", "streaming_llm", "h2o", "snapkv", "tova", "knorm", "rkv", "random_attention", "vase", "PRESETS"]

PRESETS = {
    "full": full,
    "streaming_llm": streaming_llm,
    "h2o": h2o,
    "snapkv": snapkv,
    "tova": tova,
    "knorm": knorm,
    "rkv": rkv,
    "random_attention": random_attention,
    "vase": vase,
}
