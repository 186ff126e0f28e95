"""Scoring of batched teacher forcing against full-cache references kept as hidden states.

A `HiddenReference` is the full cache's run of one trace as final hidden states (`[T, D]`, 85x smaller than
SmolLM2's log-probs). `RowScores` scores a batch's hidden states chunk by chunk: top-1 agreement, KL(full ||
method) and the NLL of each trace token.

**Why it does not recompute the reference's log-probs** (docs/results.md, "What batching costs and saves"):
recomputing them (a head matmul and a log-softmax over the vocabulary per position, in every cell) was a
third of the batched bench's time. With a linear output head `logits = W h + b` and no soft-capping,

    KL(full || method) = sum_v p_r(v) lp_r(v) - sum_v p_r(v) lp_m(v)
                       = A_r - [sum_{v in S} p_r(v) (x_m(v) - lse_m) + e_r . h_m + c_r - tail_r lse_m]

where x_m are the method's logits, lse_m their logsumexp, S the reference's `TOP` most likely tokens, and
`e_r = W^T p_tail`, `c_r = b . p_tail`, `tail_r = sum p_tail` the rest of its distribution. So each reference
position keeps `A_r` (its negative entropy), `S` with its probabilities, its top-1 token, `e_r` (`[D]`),
`c_r` and `tail_r` (`ReferenceStats`, computed once per trace), and each chunk of the method costs one head
matmul, one max and one exp-sum over the vocabulary. The top-`TOP` tokens are read from the method's own
logits, so float32 rounding of those logits cancels as it does in the direct computation; only the tail's
share (`tail_r`, usually a few percent of the mass) is taken through `e_r` exactly. Measured on SmolLM2
(tests/test_bench_batched.py checks a tiny model): per-token KL within 1e-6 of the direct computation.
Models whose head is not such a map in float32 (soft-capped logits, reduced precision) are scored the
direct way (`head_logits`, the references' log-probs recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .metrics import kl_divergence, top1_agreement
from ..traces import Trace, _device

__all__ = ["head_logits", "HiddenReference", "ReferenceStats", "RowScores", "linear_head"]


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def head_logits(model, hidden: Tensor) -> Tensor:
    """The model's output logits (float32) from final hidden states `[..., hidden]`: the output embedding,
    then the final logit soft-capping of the config if it has one (Gemma 2)."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(_text_config(model), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def linear_head(model) -> torch.nn.Linear | None:
    """The output head when the logits are exactly `head(h)` in float32 (a `Linear`, float32 weights, no
    soft-capping): then KL and top-1 can be scored from `ReferenceStats`. None otherwise."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.weight.dtype != torch.float32:
        return None
    if getattr(_text_config(model), "final_logit_softcapping", None):
        return None
    return head


TOP = 64  # reference tokens read from the method's own logits (the rest through `e_r`)


@dataclass
class ReferenceStats:
    """Per position of a reference (T positions, vocabulary V, hidden size D, k = `TOP`):

    - `top1` `[T]`: the argmax of its log-probs; `negent` `[T]` float64: `sum_v p(v) log p(v)`;
    - `idx` `[T, k]`, `prob` `[T, k]` float64: its k most likely tokens and their probabilities;
    - `expect` `[T, D]` float32: `W^T p_tail`, the output embedding expected under the rest of the
      distribution; `bias` `[T]` float64: `b . p_tail` (0 without a bias); `tail` `[T]` float64: its mass."""

    top1: Int[Tensor, " T"]
    negent: Float[Tensor, " T"]
    idx: Int[Tensor, "T k"]
    prob: Float[Tensor, "T k"]
    expect: Float[Tensor, "T D"]
    bias: Float[Tensor, " T"]
    tail: Float[Tensor, " T"]

    FIELDS = ("top1", "negent", "idx", "prob", "expect", "bias", "tail")

    def to_dict(self) -> dict[str, Tensor]:
        return {f"stats_{k}": getattr(self, k) for k in self.FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Tensor]) -> "ReferenceStats | None":
        return cls(**{k: d[f"stats_{k}"] for k in cls.FIELDS}) if all(f"stats_{k}" in d for k in cls.FIELDS) else None

    @classmethod
    @torch.no_grad()
    def of(cls, head: torch.nn.Linear, hidden: Float[Tensor, "T D"], top: int | None = None) -> "ReferenceStats":
        """The statistics of reference hidden states `hidden` under the float32 linear `head` (`top` most
        likely tokens kept apart; default `TOP`)."""
        top = TOP if top is None else top
        logits = head(hidden.to(device=head.weight.device, dtype=torch.float32))
        m = logits.amax(-1, keepdim=True)
        z = (logits - m).double()
        logp = z - z.exp().sum(-1, keepdim=True).log()
        p = logp.exp()
        top1 = torch.log_softmax(logits, dim=-1).argmax(-1)  # as the direct path's argmax of float32 log-probs
        prob, idx = p.topk(min(top, p.shape[-1]), dim=-1)
        p_tail = p.scatter(-1, idx, 0.0)
        bias = p_tail @ head.bias.double() if head.bias is not None else torch.zeros(p.shape[0], dtype=torch.float64)
        return cls(top1=top1.cpu(), negent=(p * logp).sum(-1).cpu(), idx=idx.cpu(), prob=prob.cpu(),
                   expect=(p_tail.float() @ head.weight).cpu(), bias=bias.cpu(), tail=p_tail.sum(-1).cpu())

    def rows(self, start: int, n: int) -> "ReferenceStats":
        return ReferenceStats(**{k: getattr(self, k)[start : start + n] for k in self.FIELDS})


@dataclass
class HiddenReference:
    """The full cache's run of one trace, kept as final hidden states (85x smaller than log-probs for
    SmolLM2's 49k vocabulary); `logp(start, n)` recomputes the log-probs of positions `start .. start+n`
    through the output head (`head_logits`).

    Attributes: `hidden` `[T, hidden]` float32 (row t predicts `trace_ids[t]`), `nll` `[T]`, `recall` (the
    recall probe's mean log-prob of the question, or None), `stats` (`ReferenceStats`, or None until
    `reference_stats` computes them)."""

    hidden: Tensor
    nll: Tensor
    recall: float | None
    stats: ReferenceStats | None = field(default=None, repr=False)

    def logp(self, model, start: int, n: int) -> Tensor:
        h = self.hidden[start : start + n].to(device=_device(model), dtype=model.dtype)
        return torch.log_softmax(head_logits(model, h), dim=-1).cpu()

    def reference_stats(self, model, chunk: int = 256) -> ReferenceStats:
        """`stats`, computed once (in chunks of `chunk` positions) for a model with a `linear_head`."""
        if self.stats is None:
            head = linear_head(model)
            if head is None:
                raise ValueError("reference statistics need a float32 linear output head")
            parts = [ReferenceStats.of(head, self.hidden[s : s + chunk]) for s in range(0, self.hidden.shape[0], chunk)]
            self.stats = ReferenceStats(**{k: torch.cat([getattr(p, k) for p in parts]) for k in ReferenceStats.FIELDS})
        return self.stats


class RowScores:
    """Per-row top-1 agreement and KL against the references, and the NLL of each trace token, gathered chunk by
    chunk: `score(start, hidden)` scores `hidden` `[B, n, D]`, whose row b predicts `traces[b].trace_ids[start:]`.

    With a `linear_head` the rows are scored together from `ReferenceStats` (module docstring); else row by row
    from the references' recomputed log-probs. Set `direct=True` to force the latter."""

    def __init__(self, model, traces: list[Trace], references: list[HiddenReference], direct: bool = False):
        self.model, self.references = model, references
        self.targets = [torch.tensor(t.trace_ids) for t in traces]
        self.top1: list[list[float]] = [[] for _ in traces]
        self.kl: list[list[float]] = [[] for _ in traces]
        self.nll: list[list[float]] = [[] for _ in traces]
        self.head = None if direct else linear_head(model)
        if self.head is not None:
            for r in references:
                r.reference_stats(model)

    def __call__(self, start: int, hidden: Tensor) -> None:
        if self.head is None:
            return self._direct(start, hidden)
        n = hidden.shape[1]
        dev = hidden.device
        st = [r.stats.rows(start, n) for r in self.references]
        ref = {k: torch.stack([getattr(s, k) for s in st]).to(dev) for k in ReferenceStats.FIELDS}  # [B, n, ...]
        tgt = torch.stack([t[start : start + n] for t in self.targets]).to(dev)
        h = hidden.float()
        logits = self.head(h)  # [B, n, V]
        m = logits.amax(-1)
        lse = m.double() + (logits - m[..., None]).exp_().sum(-1).double().log()  # float64: no rounding to lse's ulp
        agree = (logits.gather(-1, ref["top1"][..., None])[..., 0] >= m).float()
        x_top = logits.gather(-1, ref["idx"]).double()  # [B, n, k]
        x_tgt = logits.gather(-1, tgt[..., None])[..., 0].double()
        del logits
        cross = (ref["prob"] * (x_top - lse[..., None])).sum(-1) + (h.double() * ref["expect"].double()).sum(-1) \
            + ref["bias"] - ref["tail"] * lse  # sum_v p_r(v) log p_m(v)
        kl = (ref["negent"] - cross).clamp_min(0.0)
        nll = lse - x_tgt
        for row, (a, k, l) in enumerate(zip(agree.tolist(), kl.tolist(), nll.tolist())):
            self.top1[row].extend(a)
            self.kl[row].extend(k)
            self.nll[row].extend(l)

    def _direct(self, start: int, hidden: Tensor) -> None:
        n = hidden.shape[1]
        for b, tgt in enumerate(self.targets):
            lp = torch.log_softmax(head_logits(self.model, hidden[b]), dim=-1).cpu()
            lr = self.references[b].logp(self.model, start, n)
            self.top1[b].extend(top1_agreement(lr, lp).tolist())
            self.kl[b].extend(kl_divergence(lr, lp).tolist())
            self.nll[b].extend((-lp.gather(1, tgt[start : start + n, None])[:, 0]).tolist())
