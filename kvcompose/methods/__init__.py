"""Published methods as preset Pipelines: each is a few blocks, never a special case in the cache.

Read like optax's `alias.py`: `vase` = sinks + value protection + attention-weighted sampling.
"""

from .baselines import full, h2o, snapkv, streaming_llm, tova, knorm
from .reasoning import random_attention, rkv, vase
from .hierarchy import memory_hierarchy, with_tier
from .allocation import growpage, pyramid_rkv, reason_alloc, with_allocator
from .reco import Reco, RewardAllocator, reco, reco_evict  # not in PRESETS: reco returns a bundle, not a pipeline

__all__ = ["full", "streaming_llm", "h2o", "snapkv", "tova", "knorm", "rkv", "random_attention", "vase", "PRESETS",
           "memory_hierarchy", "with_tier", "pyramid_rkv", "reason_alloc", "growpage", "with_allocator",
           "reco", "Reco", "RewardAllocator", "reco_evict"]

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
    "memory_hierarchy": memory_hierarchy,  # works with or without a budget (HBM = min(budget, share of seen))
    "pyramid_rkv": pyramid_rkv,
    "reason_alloc": reason_alloc,  # the shipped ReasoningWave profile of the model if any, else head-wise only
    "growpage": growpage,
}
