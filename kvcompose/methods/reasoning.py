"""Reasoning-time methods (decode-time compression for long chain-of-thought) as presets."""

from __future__ import annotations

from ..pipeline import Pipeline
from ..protectors import ProtectPrompt, ProtectRecent, ProtectSinks, ProtectValueNorm
from ..scorers import KeyRedundancy, ProjectedNorm, WindowedAttention
from ..selectors import RandomDrop, Sample, TopK
from ..view import warn_unused


def rkv(window: int = 8, lam: float = 0.1, threshold: float = 0.5, kernel: int = 7, interval: int = 128) -> Pipeline:
    """R-KV: importance minus redundancy, top-(B - 8) per KV head plus the 8 newest tokens.

    Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models", arXiv 2505.24133
    (Zefan-Cai/R-KV). Importance: the last 8 queries, logits maxed over the GQA group before softmax,
    softmax over the candidates (the window excluded), mean over queries, max-pool kernel 7.
    Redundancy: cosine similarity of all held keys (as the reference computes it, window included),
    threshold 0.5, newest duplicate exempt, column means, softmax. Score = lam * importance -
    (1 - lam) * redundancy with lam = 0.1 (README; the reference class default is 0.07).
    Deviation: for a key with no duplicate above the threshold the reference zeroes its similarity to
    slot 0 (an artifact of `max(arange * mask)` returning 0); we leave that row untouched.
    Schedule: R-KV compresses every 128 tokens (its buffer), the preset's default `interval`.
    """
    importance = WindowedAttention(window, gqa="max", pool="max", kernel=kernel, exclude_recent=window)
    redundancy = KeyRedundancy(threshold)
    return Pipeline(
        ProtectRecent(window), lam * importance - (1.0 - lam) * redundancy, TopK(),
        name=f"rkv(lam={lam})", interval=interval,
    )


def random_attention(recent: int = 64, shared_heads: bool = False, protect_prompt: bool = True,
                     interval: int = 64) -> Pipeline:
    """Random Attention: keep the prompt (inside the budget) and the newest 64 tokens; drop the rest
    uniformly at random, independently per row, layer and KV head, redrawn at every eviction.

    SalesforceAIResearch/Random-Attention (`random_pp`): with K = budget - recent, the first
    `min(prompt, K - 1)` prompt tokens are kept, so at least one slot is always left to the random draw;
    compression every 64 tokens. `shared_heads=True` draws one keep-set for all KV heads of a layer (the
    paper's per-head independence ablation); `protect_prompt=False` is the unprotected `random` baseline.
    """
    protect = [ProtectPrompt(keep="first", leave=1)] if protect_prompt else []
    name = "random_attention" + ("(shared_heads)" if shared_heads else "") + ("" if protect_prompt else "(no prompt)")
    return Pipeline(ProtectRecent(recent), *protect, RandomDrop(shared_heads=shared_heads), name=name,
                    interval=interval)


def vase(protect: int | float = 0.25, recent: int = 64, window: int = 64, sinks: int = 4, kernel: int = 5,
         query_free: bool = False, rank: int = 20, interval: int = 64) -> Pipeline:
    """VaSE: 4 sinks + the budget/4 tokens of largest value range protected, the newest 64 kept, and the
    rest sampled without replacement in proportion to smoothed attention of the last 64 queries.

    terarachang/VaSE. Attention: softmax over candidates, mean over 64 queries, average pool kernel 5,
    mean over the GQA group. Value range: max(v) - min(v) over the head dim, sinks infinite. Compression
    every 64 tokens.

    `query_free=True` is VaSE's query-free variant (`cur_fixed_gauss`): the 4 sinks and the newest tokens
    kept, the rest ranked by `|k G|^2 * |v G|^2` with a fixed Gaussian projection G (`rank` columns,
    `ProjectedNorm`), top-k; no query buffer at all.
    """
    if query_free:
        dead = {k: v for k, v, d in (("protect", protect, 0.25), ("window", window, 64), ("kernel", kernel, 5)) if v != d}
        for k, v in dead.items():
            warn_unused(f"vase({k}={v!r})", "the query-free variant (query_free=True) has no value protection and no "
                        "query window")
        return Pipeline(ProtectRecent(recent), ProtectSinks(sinks), ProjectedNorm(rank, fixed=True), TopK(),
                        name="vase(query_free)", interval=interval)
    if rank != 20:
        warn_unused(f"vase(rank={rank})", "rank is the projection of the query-free variant (query_free=True)")
    return Pipeline(
        ProtectRecent(recent),
        ProtectValueNorm(protect, kind="range", sinks=sinks, exclude_recent=recent),
        WindowedAttention(window, gqa="mean", pool="avg", kernel=kernel, exclude_recent=recent),
        Sample(),
        name="vase", interval=interval,
    )
