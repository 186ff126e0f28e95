"""Metrics of the fidelity benchmark: distances between the full cache's next-token distributions and a
compressing cache's, and the final number of a GSM8K-style answer.

- `kl_divergence`, `top1_agreement`: per position, from log-probabilities `[..., V]`.
- `perplexity_ratio`: `exp(mean NLL - mean NLL_ref)` over the same tokens.
- `extract_answer`, `gsm8k_answer`: the last number of a text; the number after GSM8K's `####` (Cobbe et al.,
  2021). For grading against references with LaTeX, fractions or units use `kvcompose.bench.grading`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from jaxtyping import Float
from torch import Tensor

from ..data import extract_answer, gsm8k_answer, norm_number  # noqa: F401  (re-exported: one copy, in the library)
from ..view import KVComposeError

__all__ = ["kl_divergence", "top1_agreement", "perplexity_ratio", "extract_answer", "gsm8k_answer", "norm_number",
           "bootstrap_mean", "bootstrap_ratio", "BOOTSTRAP_RESAMPLES"]

BOOTSTRAP_RESAMPLES = 2000


def kl_divergence(logp_ref: Float[Tensor, "*batch V"], logp: Float[Tensor, "*batch V"]) -> Float[Tensor, "*batch"]:
    """KL(ref || other) in nats per row, from log-probabilities `[..., V]` (float32 accumulation)."""
    lr, lo = logp_ref.float(), logp.float()
    return (lr.exp() * (lr - lo)).sum(-1).clamp_min(0.0)


def top1_agreement(logp_ref: Float[Tensor, "*batch V"], logp: Float[Tensor, "*batch V"]) -> Float[Tensor, "*batch"]:
    """1.0 where both distributions put their maximum on the same token, per row."""
    return (logp_ref.argmax(-1) == logp.argmax(-1)).float()


def perplexity_ratio(nll: Iterable[float], nll_ref: Iterable[float]) -> float:
    """`exp(mean NLL - mean NLL_ref)` over the same tokens: the method's perplexity / the reference's."""
    a, b = list(nll), list(nll_ref)
    if len(a) != len(b) or not a:
        raise KVComposeError(f"perplexity_ratio needs two equally long non-empty lists, got {len(a)} and {len(b)}")
    return math.exp(sum(a) / len(a) - sum(b) / len(b))


def _resample(n: int, resamples: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (resamples, n), generator=g)


def _pooled(sums, counts, idx):
    import torch

    s = torch.as_tensor(sums, dtype=torch.float64)
    c = torch.as_tensor(counts, dtype=torch.float64)
    return s[idx].sum(-1) / c[idx].sum(-1).clamp(min=1e-300)


def _check_groups(sums, counts, name: str) -> int:
    if len(sums) != len(counts) or not len(sums):
        raise KVComposeError(f"{name} needs equally long non-empty per-prompt sums and counts, got {len(sums)} "
                             f"and {len(counts)}")
    return len(sums)


def bootstrap_mean(sums, counts, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                   seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of a token-pooled mean over prompts: `sums[i]` is prompt i's total (e.g.
    of per-token KL) over `counts[i]` tokens; prompts are resampled with replacement (`resamples` times,
    `torch.Generator` seeded with `seed`), the pooled mean `sum(sums) / sum(counts)` of each resample is
    taken, and the `(1 - level) / 2` and `(1 + level) / 2` quantiles are returned. Prompts, not tokens, are
    the unit: tokens of one prompt are not independent. With equal counts the pooled mean is the mean of
    the per-prompt means."""
    import torch

    n = _check_groups(sums, counts, "bootstrap_mean")
    if not 0.0 < level < 1.0:
        raise KVComposeError(f"level must be in (0, 1), got {level}")
    stats = _pooled(sums, counts, _resample(n, resamples, seed))
    lo, hi = torch.quantile(stats, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return lo, hi


def bootstrap_ratio(sums_a, counts_a, sums_b, counts_b, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = 0) -> tuple[float, float, float]:
    """`(ratio, lo, hi)`: the ratio of two pooled means over the SAME prompts (e.g. the mean KL of method A /
    method B) and its paired percentile bootstrap interval (each resample draws the same prompts for both)."""
    import torch

    n = _check_groups(sums_a, counts_a, "bootstrap_ratio")
    if _check_groups(sums_b, counts_b, "bootstrap_ratio") != n:
        raise KVComposeError("bootstrap_ratio compares two methods on the same prompts: give as many of each")
    idx = _resample(n, resamples, seed)
    r = _pooled(sums_a, counts_a, idx) / _pooled(sums_b, counts_b, idx)
    full = torch.arange(n)[None]
    ratio = float(_pooled(sums_a, counts_a, full) / _pooled(sums_b, counts_b, full))
    lo, hi = torch.quantile(r, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return ratio, lo, hi


