"""Metrics of the fidelity benchmark: distances between the full cache's next-token distributions and a
compressing cache's, and the final number of a GSM8K-style answer.

- `kl_divergence`, `top1_agreement`: per position, from log-probabilities `[..., V]`.
- `perplexity_ratio`: `exp(mean NLL - mean NLL_ref)` over the same tokens.
- `extract_answer`, `gsm8k_answer`: the last number of a text; the number after GSM8K's `####` (Cobbe et al.,
  2021). For grading against references with LaTeX, fractions or units use `kvcompose.bench.grading`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from jaxtyping import Float
from torch import Tensor

from ..view import KVComposeError

__all__ = ["kl_divergence", "top1_agreement", "perplexity_ratio", "extract_answer", "gsm8k_answer", "norm_number"]


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


_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def norm_number(s: str) -> str | None:
    """The last number in `s` as a plain string: commas removed, trailing zeros of decimals dropped."""
    m = _NUM.findall(s)
    if not m:
        return None
    x = m[-1].replace(",", "")
    if "." in x:
        x = x.rstrip("0").rstrip(".")
    return x


def gsm8k_answer(answer: str | None) -> str | None:
    """The number after GSM8K's `####` (commas removed), or None."""
    if not answer or "####" not in answer:
        return None
    return norm_number(answer.split("####")[-1].strip())


def extract_answer(text: str) -> str | None:
    """The last number in a generated answer (commas removed, trailing zeros of decimals dropped)."""
    return norm_number(text)
