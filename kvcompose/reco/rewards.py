"""ReCo step rewards: the per-step score that drives compression, the reflection penalty and stopping.

ReCo (arXiv "ReCo", reward-coordinated compression; abstract only) couples its controls to a step-level
process reward. `StepInfo` is one completed step, `StepReward` the interface, `ConfidenceReward` a
training-free confidence proxy (the default; not a PRM) and `PRMReward` an adapter for a real,
user-supplied process reward model.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

__all__ = ["StepInfo", "StepReward", "ConfidenceReward", "PRMReward"]


@dataclass
class StepInfo:
    """One completed reasoning step, as handed to a `StepReward` (the unit ReCo rewards).

    Attributes:
        text: the step's text (stripped).
        token_ids: its generated token ids, length n.
        logprobs: `Float[n]` log-probability of each chosen token under the distribution the tracker saw
            (NaN where unknown).
        entropies: `Float[n]` entropy (nats) of that distribution at each token (NaN where unknown).
        index: 0-based step number within its row.
        row: batch row.
        prefix_text: prompt text + generated text before this step (what a PRM conditions on).
        vocab_size: size of the distribution (normalises entropy); None when unknown.
        reward: filled in by the tracker after scoring.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: Float[Tensor, " n"] | Sequence[float] = field(default_factory=list)
    entropies: Float[Tensor, " n"] | Sequence[float] = field(default_factory=list)
    index: int = 0
    row: int = 0
    prefix_text: str = ""
    vocab_size: int | None = None
    reward: float | None = None

    def __post_init__(self) -> None:
        self.logprobs = torch.as_tensor(self.logprobs, dtype=torch.float32).reshape(-1)
        self.entropies = torch.as_tensor(self.entropies, dtype=torch.float32).reshape(-1)


class StepReward(ABC):
    """Interface: `reward(step: StepInfo) -> float in [0, 1]`, higher = better / more confident step.

    ReCo (arXiv, abstract only) drives compression, the reflection penalty and stopping from a
    step-level process reward; implementations: `ConfidenceReward` (training-free proxy, default) and
    `PRMReward` (a real, user-supplied PRM).
    """

    @abstractmethod
    def __call__(self, step: StepInfo) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


class ConfidenceReward(StepReward):
    """Default step reward: a training-free CONFIDENCE PROXY, not a process reward model.

    It only looks at the policy model's own token distribution over the step:

        reward = w * mean_t p(chosen_t) + (1 - w) * (1 - mean_t H_t / log V)

    where `p(chosen_t) = exp(logprob_t)` and `H_t` is the entropy of the distribution at token t,
    normalised by its maximum `log V`. Both terms lie in [0, 1], so does the reward. A step the model
    wrote with peaked, agreeing distributions scores high; hesitant steps score low. It says nothing
    about *correctness*: a confidently wrong step scores high. Use `PRMReward` with a trained PRM for a
    real process reward.

    Args:
        weight: `w`, weight of the mean chosen-token probability (the rest goes to the entropy term).
        vocab_size: used when the `StepInfo` carries none; without either, only the probability term.
        empty_reward: returned for steps with no usable token statistics.
    """

    def __init__(self, weight: float = 0.5, vocab_size: int | None = None, empty_reward: float = 0.5):
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight must be in [0, 1], got {weight}")
        self.weight = float(weight)
        self.vocab_size = vocab_size
        self.empty_reward = float(empty_reward)

    def __call__(self, step: StepInfo) -> float:
        lp = torch.as_tensor(step.logprobs, dtype=torch.float32)
        ent = torch.as_tensor(step.entropies, dtype=torch.float32)
        lp = lp[~torch.isnan(lp)]
        ent = ent[torch.isfinite(ent)]
        if lp.numel() == 0:
            return self.empty_reward
        prob = lp.exp().clamp(0.0, 1.0).mean().item()
        v = step.vocab_size or self.vocab_size
        if v is None or v < 2 or ent.numel() == 0:
            return float(min(1.0, max(0.0, prob)))
        h = (ent / math.log(v)).clamp(0.0, 1.0).mean().item()
        r = self.weight * prob + (1.0 - self.weight) * (1.0 - h)
        return float(min(1.0, max(0.0, r)))

    def __repr__(self) -> str:
        return f"ConfidenceReward(weight={self.weight})"


class PRMReward(StepReward):
    """Adapter for a user-supplied process reward model (what ReCo's "process reward" means literally).

    Args:
        fn: `fn(prefix_text, step_text) -> float`: the PRM's score of `step_text` given the partial
            solution (prompt + earlier steps) `prefix_text`.
        transform: optional map of the raw score into [0, 1] (e.g. a sigmoid for logits). The result is
            clamped to [0, 1]; a NaN score raises.

    `PRMReward.from_hf(model, tokenizer, positive_label=...)` wraps a Hugging Face
    sequence-classification model that scores a partial solution. Note the PRM runs synchronously inside
    `generate` at each completed step.
    """

    def __init__(self, fn: Callable[[str, str], float], transform: Callable[[float], float] | None = None):
        self.fn = fn
        self.transform = transform

    def __call__(self, step: StepInfo) -> float:
        r = float(self.fn(step.prefix_text, step.text))
        if self.transform is not None:
            r = float(self.transform(r))
        if math.isnan(r):
            raise ValueError("PRM returned NaN")
        return min(1.0, max(0.0, r))

    @classmethod
    def from_hf(
        cls,
        model: Any,
        tokenizer: Any,
        positive_label: int | str = 1,
        template: str = "{prefix}{step}",
        max_length: int | None = None,
    ) -> PRMReward:
        """A PRM from an HF `*ForSequenceClassification` model and its tokenizer.

        The partial solution `template.format(prefix=..., step=...)` is classified; the reward is the
        softmax probability of `positive_label` (an index, or a name looked up in
        `model.config.label2id`); a one-logit head gives `sigmoid(logit)`. With `max_length`, the input
        keeps its LAST `max_length` tokens (the newest step matters most).
        """
        if isinstance(positive_label, str):
            label2id = getattr(model.config, "label2id", None) or {}
            if positive_label not in label2id:
                raise ValueError(f"label {positive_label!r} not in model.config.label2id {label2id}")
            idx = int(label2id[positive_label])
        else:
            idx = int(positive_label)

        def fn(prefix: str, step: str) -> float:
            text = template.format(prefix=prefix, step=step)
            enc = tokenizer(text, return_tensors="pt")
            ids = enc["input_ids"]
            mask = enc.get("attention_mask", torch.ones_like(ids))
            if max_length is not None:
                ids, mask = ids[:, -max_length:], mask[:, -max_length:]
            device = next(model.parameters()).device
            with torch.no_grad():
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[0].float()
            if logits.numel() == 1:
                return torch.sigmoid(logits).item()
            return torch.softmax(logits, dim=-1)[idx].item()

        return cls(fn)
