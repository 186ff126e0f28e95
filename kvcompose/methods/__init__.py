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
           "PORTED", "NEEDS_MODEL", "preset", "recent_window", "keydiff", "lagkv", "cur", "leverage", "noncausal_attention", "compactor",
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


def recent_window(budget: int | None) -> int:
    """The recent window of random_attention and VaSE at `budget`: 64 tokens, or `budget // 4` (at least 1)
    below budget 256, where 64 recent tokens (plus VaSE's budget/4 value-protected tokens) would fill or
    overflow the budget.

    With random_attention's `random_pp` rule (the first `K - 1` prompt tokens kept, K = budget - recent) the
    window decides how a budget below the prompt splits between the head of the prompt and the recent window:
    at budget 64 it is 47 prompt tokens + 1 drawn + 16 recent, at 128 it is 95 + 1 + 32.

    Example:
        >>> methods.recent_window(128), methods.recent_window(None)
        (32, 64)
    """
    return 64 if budget is None or budget >= 256 else max(1, min(64, budget // 4))


# presets whose good defaults depend on the budget: name -> fn(budget) -> default keyword arguments
_BUDGET_DEFAULTS = {
    "random_attention": lambda budget: {"recent": recent_window(budget)},
    "vase": lambda budget: {"recent": recent_window(budget)},
}


def _check_args(name: str, fn, kwargs: dict) -> None:
    import inspect

    from ..view import KVComposeError

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        known = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise KVComposeError(f"preset {name!r} takes no argument {', '.join(map(repr, unknown))}; "
                             f"its arguments: {', '.join(known) or 'none'}")


def preset(name: str, budget: int | None = None, model=None, **kwargs):
    """The one factory of a method by name: one of `PRESETS`, or one ported from kvpress (`PORTED`).

    Args:
        name: a key of `PRESETS` or `PORTED`.
        budget: the cache budget the pipeline will run at (None: no budget). A preset whose good defaults
            depend on the budget decides them here (random_attention and VaSE: `recent=recent_window(budget)`),
            so a user, the command line and the benchmark tables get the same pipeline; the others ignore it.
            An argument given explicitly (e.g. `recent=64`) always wins.
        model: the model, passed to the ported presets in `NEEDS_MODEL` (which require it) and dropped for
            the others.
        **kwargs: the preset's own arguments.

    Returns:
        The `Pipeline`.

    Raises:
        KVComposeError: an unknown name, a budget that is not a positive int, or an argument the preset does
            not take.

    Example:
        >>> methods.preset("rkv", budget=128)
        >>> methods.preset("vase", budget=128)           # recent window 32, as in the tables
        >>> methods.preset("expected_attention", model=model, window=32)
    """
    from ..view import KVComposeError

    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise KVComposeError(f"preset {name!r}: budget must be a positive int or None, got {budget!r}")
    if name in PRESETS:
        fn = PRESETS[name]
        _check_args(name, fn, kwargs)
        defaults = _BUDGET_DEFAULTS[name](budget) if name in _BUDGET_DEFAULTS else {}
        return fn(**{**defaults, **kwargs})
    if name in PORTED:
        # one call builds any of them: the model goes to the presets whose rule can read it
        fn = PORTED[name]
        _check_args(name, fn, kwargs)
        return fn(**({"model": model} if name in NEEDS_MODEL else {}), **kwargs)
    raise KVComposeError(f"unknown preset {name!r}; presets: {', '.join([*PRESETS, *PORTED])}")
