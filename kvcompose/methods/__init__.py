"""Published methods as preset Pipelines: each is a few blocks, never a special case in the cache.

Read like optax's `alias.py`: `vase` = sinks + value protection + attention-weighted sampling.
"""

from .baselines import full, h2o, snapkv, streaming_llm, tova, knorm
from .reasoning import random_attention, rkv, vase
from .hierarchy import memory_hierarchy, with_tier
from .allocation import growpage, pyramid_rkv, reason_alloc, with_allocator
from .reco import Reco, RewardAllocator, reco, reco_evict  # not in PRESETS: reco returns a bundle, not a pipeline
from .ported import (NEEDS_MODEL, NEEDS_PROFILE, PORTED, adakv, cam, cap, chunkkv, compactor, criticalkv, cur, duo_attention,
                     expected_attention, keydiff, kvcompose_paper, lagkv, leverage, lukv, merging, noncausal_attention,
                     with_merger)

__all__ = ["full", "streaming_llm", "h2o", "snapkv", "tova", "knorm", "rkv", "random_attention", "vase", "PRESETS",
           "memory_hierarchy", "with_tier", "pyramid_rkv", "reason_alloc", "growpage", "with_allocator",
           "reco", "Reco", "RewardAllocator", "reco_evict",
           "PORTED", "NEEDS_MODEL", "preset", "keydiff", "lagkv", "cur", "leverage", "noncausal_attention", "compactor",
           "expected_attention", "cap", "criticalkv", "cam", "merging", "with_merger", "chunkkv", "kvcompose_paper",
           "duo_attention", "lukv", "NEEDS_PROFILE", "adakv"]

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


def preset(name: str, model=None, **kwargs):
    """A preset by name: one of `PRESETS`, or one ported from kvpress (`PORTED`; `model=` goes to the ones in
    `NEEDS_MODEL`, which require it, and is dropped for the others). Keyword arguments go to the preset.

    Example:
        >>> methods.preset("keydiff")
        >>> methods.preset("expected_attention", model=model, window=32)
    """
    from ..view import KVComposeError

    if name in PRESETS:
        return PRESETS[name](**kwargs)
    if name in PORTED:
        # one call builds any of them: the model goes to the presets whose rule can read it
        return PORTED[name](**({"model": model} if name in NEEDS_MODEL else {}), **kwargs)
    raise KVComposeError(f"unknown preset {name!r}; presets: {', '.join([*PRESETS, *PORTED])}")
