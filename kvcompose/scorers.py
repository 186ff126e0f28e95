"""Scorers: `LayerView -> Float[B, H, T]`, higher = more worth keeping.

Scorers combine with arithmetic: `0.1 * Importance() - 0.9 * Redundancy()` is a scorer too (a composite
whose state is the tuple of its parts' states). A scorer that needs queries declares `query_window` (the
layer keeps that many post-RoPE queries in a ring buffer). A scorer that must see every decoding step
(H2O's accumulated attention) is an `Observer` with token state: the running total is one float per held
token, carried by the layer's store with its token, and handed to `observe` and `score` as `[B, H, T]`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .attention_math import attention_probs
from .block import Block, require_role, with_state
from .kernels import key_redundancy, value_magnitude, window_attention_scores
from .seeding import check_seed, derived_seed, draw
from .view import AttentionStep, KVComposeError, LayerSpec, LayerView, warn_unused

__all__ = [
    "Scorer",
    "Combined",
    "AccumulatedAttention",
    "WindowedAttention",
    "KeyRedundancy",
    "ValueNorm",
    "KeyNorm",
    "LastQueryAttention",
    "Recency",
    "RandomScore",
    "ProjectedNorm",
]


class Scorer(Block):
    """Base class. Subclasses implement `score(view) -> Float[B, H, T]`, or `score(view, state)` when the
    scorer has state (token state, `init`, or parts). A stateful `score` may also return `(scores, new_state)`
    (optax's shape, as an Allocator or a Merger returns): the pipeline keeps the new state for the layer."""

    _hook = "score(view) (or score(view, state))"

    def score(self, view: LayerView, *state: Any) -> Float[Tensor, "B H T"]:  # pragma: no cover - abstract
        raise NotImplementedError

    def apply(self, view: LayerView, state: Any = None) -> tuple[Float[Tensor, "B H T"], Any]:
        """`(scores, new_state)`: the one call shape of every leaf role (the pipeline calls this)."""
        s, new = with_state(self.score(view, state) if self.takes_state else self.score(view), state)
        b, h, t = view.shape
        if not isinstance(s, Tensor) or s.shape != (b, h, t):
            got = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
            raise KVComposeError(f"{type(self).__name__} returned scores of shape {got}, expected {(b, h, t)}")
        return s.float(), new

    def __call__(self, view: LayerView, state: Any = None) -> Float[Tensor, "B H T"]:
        return self.apply(view, state)[0]

    # arithmetic -------------------------------------------------------------------------------
    def __add__(self, other: "Scorer | float") -> "Scorer":
        return Combined.of(self, 1.0) + other

    def __radd__(self, other: "Scorer | float") -> "Scorer":
        return self + other

    def __sub__(self, other: "Scorer | float") -> "Scorer":
        return self + (-1.0) * _term(other)

    def __rsub__(self, other: "Scorer | float") -> "Scorer":
        return (-1.0) * self + other

    def __mul__(self, weight: float) -> "Scorer":
        return Combined(((self, _weight(weight)),), 0.0)

    def __rmul__(self, weight: float) -> "Scorer":
        return self * weight

    def __truediv__(self, weight: float) -> "Scorer":
        w = _weight(weight)
        if w == 0.0:
            raise KVComposeError("a scorer cannot be divided by 0")
        return self * (1.0 / w)

    def __neg__(self) -> "Scorer":
        return self * -1.0

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


class Combined(Scorer):
    """A weighted sum of scorers plus a constant: `sum_i w_i * s_i(view) + c`."""

    def __init__(self, terms: tuple[tuple[Scorer, float], ...], constant: float = 0.0):
        for s, w in terms:
            require_role(s, Scorer, "Combined", ": a weighted sum adds scorers only")
            _weight(w)
        self.terms = tuple((s, float(w)) for s, w in terms)
        self.constant = float(_weight(constant))

    @staticmethod
    def of(s: Scorer, w: float) -> "Combined":
        return s if isinstance(s, Combined) and w == 1.0 else Combined(((s, w),), 0.0)

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return max((s.query_window for s, _ in self.terms), default=0)

    def children(self) -> tuple[Block, ...]:
        return tuple(s for s, _ in self.terms)

    def __add__(self, other: "Scorer | float") -> "Scorer":
        other = _term(other)
        if not isinstance(other, Scorer):
            return Combined(self.terms, self.constant + other)
        o = Combined.of(other, 1.0)
        return Combined(self.terms + o.terms, self.constant + o.constant)

    def __mul__(self, weight: float) -> "Scorer":
        weight = _weight(weight)
        return Combined(tuple((s, w * weight) for s, w in self.terms), self.constant * weight)

    def score(self, view: LayerView, state: tuple | None = None) -> Float[Tensor, "B H T"]:
        total = torch.full(view.shape, self.constant, dtype=torch.float32, device=view.keys.device)
        parts = state if state is not None else (None,) * len(self.terms)
        for (s, w), st in zip(self.terms, parts):
            total = total + w * s(view, st)
        return total

    def __repr__(self) -> str:
        parts = [f"{w:g} * {s!r}" for s, w in self.terms]
        if self.constant:
            parts.append(f"{self.constant:g}")
        return " + ".join(parts)


def _weight(w: Any) -> float:
    """A scorer's weight or constant: a real number (a block here is a scorer mixed with another role)."""
    if isinstance(w, Block) and not isinstance(w, Scorer):
        w._not_a_scorer()
    if isinstance(w, bool) or not isinstance(w, (int, float)) or w != w:
        raise KVComposeError((f"a scorer can only be scaled by a number, got {type(w).__name__} {w!r}"
                              + (" (a product of scorers is not a scorer)" if isinstance(w, Scorer) else ""))[:200])
    return float(w)


def _term(x: Any) -> "Scorer | float":
    """The other operand of `+` / `-`: a scorer, or a number (the constant term)."""
    if isinstance(x, Scorer):
        return x
    if isinstance(x, Block):
        x._not_a_scorer()
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise KVComposeError(f"scorers add only scorers and numbers, got {type(x).__name__}")
    return float(x)


def _causal_mask(
    key_pos: Int[Tensor, "B H T"], key_valid: Bool[Tensor, "B H T"], query_pos: Int[Tensor, " Q"]
) -> Bool[Tensor, "B H Q T"]:
    return (key_pos[:, :, None, :] <= query_pos[None, None, :, None]) & key_valid[:, :, None, :]


class AccumulatedAttention(Scorer):
    """H2O's heavy-hitter score: the sum of softmax attention each token received from every query so far.

    Paper: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs", NeurIPS 2023
    (arXiv 2306.14048). Per KV head, attention is summed over its query-head group and over all queries
    (prefill included). Also the cumulative-attention ranking of the memory-hierarchy paper. The logits are
    computed in the cache's dtype (as the model's attention computes them) and the softmax in float32.

    Args:
        normalize: divide the total by the number of queries that could see the token (reduces the bias
            towards old tokens); default False, as in H2O.
    """

    token_state = 1

    def __init__(self, normalize: bool = False):
        self.normalize = normalize

    def observe(self, state: Float[Tensor, "B H T"], step: AttentionStep) -> Float[Tensor, "B H T"]:
        """Add the softmax attention every query of the step gave each key (summed over the query group)."""
        queries, keys = step.queries, step.keys
        b, hq, q, d = queries.shape
        h = keys.shape[1]
        g = hq // h
        if step.softcap is not None or step.sinks is not None:  # what the model attended to, features included
            p = attention_probs(queries, keys, step.mask, step.scale, step.softcap, step.sinks)
            add = p.reshape(b, h, g * q, -1).sum(dim=2)
            return state + (add / g if self.normalize else add)
        # logits in the keys' dtype (fp32 accumulation inside the matmul, as the model's own attention), then
        # float32: no float32 copy of every held key at every step (bit-identical for float32 caches)
        qg = queries.reshape(b, h, g * q, d).to(keys.dtype)
        logits = torch.einsum("bhqd,bhtd->bhqt", qg, keys).float() * step.scale
        if step.mask is not None:
            m = step.mask[:, :, None].expand(b, h, g, q, keys.shape[2]).reshape(b, h, g * q, -1)
            logits = logits.masked_fill(~m, float("-inf"))
        add = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=2)
        if state.shape != add.shape:
            raise KVComposeError("accumulated-attention state out of step with the cache")
        return state + (add / g if self.normalize else add)

    def score(self, view: LayerView, state: Float[Tensor, "B H T"]) -> Float[Tensor, "B H T"]:
        if self.normalize:
            count = (view.seen - view.positions).clamp(min=1).float()
            return state / count
        return state


class WindowedAttention(Scorer):
    """Attention from the last `window` queries, with a GQA reduction and 1-D pooling.

    SnapKV (Li et al., arXiv 2404.14469): window 32, softmax per query head, mean over the group, average
    pooling with kernel 5. R-KV (Cai et al., arXiv 2505.24133): window 8, max over the GQA group of the
    logits *before* softmax, softmax over the candidate keys (the window's own tokens excluded), max pooling
    with kernel 7. VaSE: window 64, mean over the group, average pooling kernel 5.

    Args:
        window: number of most recent queries (W).
        gqa: "mean" (softmax per query head, then mean over the group) or "max" (max of logits before softmax).
        pool: "avg", "max" or "none"; kernel: pooling width (odd).
        exclude_recent: the newest `exclude_recent` tokens are not candidates: excluded from the softmax and
            scored 0 (R-KV excludes its 8-token window; they are protected anyway).
    """

    def __init__(
        self,
        window: int = 32,
        gqa: Literal["mean", "max"] = "mean",
        pool: Literal["avg", "max", "none"] = "avg",
        kernel: int = 5,
        exclude_recent: int = 0,
    ):
        if window <= 0:
            raise KVComposeError(f"window must be positive, got {window}")
        if gqa not in ("mean", "max"):
            raise KVComposeError(f"gqa must be 'mean' or 'max', got {gqa!r}")
        if pool not in ("avg", "max", "none"):
            raise KVComposeError(f"pool must be 'avg', 'max' or 'none', got {pool!r}")
        if kernel <= 0 or kernel % 2 == 0:
            raise KVComposeError(f"pooling kernel must be a positive odd number, got {kernel}")
        if exclude_recent < 0:
            raise KVComposeError("exclude_recent must be >= 0")
        if pool == "none" and kernel != 5:
            warn_unused(f"WindowedAttention(kernel={kernel})", "pool='none' pools nothing")
        self.window, self.gqa, self.pool, self.kernel, self.exclude_recent = window, gqa, pool, kernel, exclude_recent

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        if view.queries is None or view.queries.shape[2] == 0:
            return torch.zeros(view.shape, device=view.keys.device)
        q = view.queries[:, :, -self.window :]
        qpos = view.query_positions[-self.window :]
        qvalid = view.query_valid[:, -self.window :]
        candidates = None
        if self.exclude_recent:
            candidates = view.positions < (view.seen - self.exclude_recent)
        return window_attention_scores(
            q, view.keys, view.positions, view.valid, qpos, qvalid, view.scale,
            gqa=self.gqa, candidates=candidates, pool=self.pool, kernel=self.kernel,
        )


class KeyRedundancy(Scorer):
    """R-KV's redundancy: how much a token's key repeats other keys (higher = more redundant).

    Per KV head: cosine similarity of the candidate keys, diagonal zeroed; for each row the most recent
    column above `threshold` is zeroed (the newest duplicate escapes); column means; softmax over tokens.
    Use it with a negative weight: `0.1 * importance - 0.9 * KeyRedundancy()` (R-KV, arXiv 2505.24133).

    Args:
        threshold: similarity above which two keys count as duplicates (R-KV: 0.5).
        exclude_recent: newest tokens left out of the candidate set (scored 0).
    """

    def __init__(self, threshold: float = 0.5, exclude_recent: int = 0):
        if not -1.0 <= threshold <= 1.0:
            raise KVComposeError(f"threshold must be a cosine similarity in [-1, 1], got {threshold}")
        self.threshold, self.exclude_recent = threshold, exclude_recent

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        cand = view.valid
        if self.exclude_recent:
            cand = cand & (view.positions < view.seen - self.exclude_recent)
        return key_redundancy(view.keys, cand, self.threshold)


class ValueNorm(Scorer):
    """Value magnitude per token: `max(v) - min(v)` over the head dim (VaSE) or the L2 norm.

    VaSE (terarachang/VaSE): large-magnitude values carry the attention output; they are protected.

    Args:
        kind: "range" (VaSE) or "l2".
    """

    def __init__(self, kind: Literal["range", "l2"] = "range"):
        if kind not in ("range", "l2"):
            raise KVComposeError(f"kind must be 'range' or 'l2', got {kind!r}")
        self.kind = kind

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        return value_magnitude(view.values, self.kind)


class KeyNorm(Scorer):
    """Negative L2 norm of the key: low-norm keys draw more attention and are kept.

    Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024
    (arXiv 2406.11430); kvpress's KnormPress.
    """

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        return -view.keys.float().norm(dim=-1)


class LastQueryAttention(Scorer):
    """TOVA: the attention of the newest query, averaged over all heads (one keep-set per layer).

    Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104.

    Args:
        per_head: keep a separate set per KV head (mean over its query group) instead of TOVA's shared set.
    """

    query_window = 1

    def __init__(self, per_head: bool = False):
        self.per_head = per_head

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        if view.queries is None or view.queries.shape[2] == 0:
            return torch.zeros(view.shape, device=view.keys.device)
        s = window_attention_scores(
            view.queries[:, :, -1:], view.keys, view.positions, view.valid,
            view.query_positions[-1:], view.query_valid[:, -1:], view.scale, gqa="mean", pool="none",
        )
        if not self.per_head:
            s = s.mean(dim=1, keepdim=True).expand_as(s)
        return s


class Recency(Scorer):
    """The token's position: with `TopK` it keeps the most recent tokens (StreamingLLM's window)."""

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        return view.positions.float()


class RandomScore(Scorer):
    """Independent uniform random scores per row, KV head and token, drawn from the layer's generator."""

    draws_random = True
    draws_per_row = True

    def score(self, view: LayerView) -> Float[Tensor, "B H T"]:
        return draw(torch.rand, view.shape, view.generator, view.device)


class ProjectedNorm(Scorer):
    """VaSE's query-free score: `|k G|^2 * |v G|^2` with a Gaussian projection `G` (`D x rank`, entries
    N(0, 1/rank)), normalised over the tokens of each (row, KV head); no query is needed.

    VaSE (terarachang/VaSE, the `cur_fixed_gauss` / `cur_resample_gauss` modes, after kvpress's CUR press):
    with `fixed=True` one `G` per row is drawn when the layer starts and kept (block state, from
    `init`); with `fixed=False` a fresh `G` is drawn at every event from the layer's generator. The
    reference sets the 4 sink tokens to the top score: compose with `ProtectSinks(4)`.

    Args:
        rank: columns of `G` (VaSE: 20).
        fixed: draw `G` once per layer (True) or at every event (False).
        seed: seeds the fixed projections (with the layer index).
    """

    draws_per_row = True  # with fixed=False: one G per row, drawn through `seeding.draw`

    def __init__(self, rank: int = 20, fixed: bool = True, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise KVComposeError(f"ProjectedNorm: rank must be a positive int, got {rank!r}")
        self.rank, self.fixed, self.seed = rank, bool(fixed), check_seed(seed, "ProjectedNorm(seed=...)")
        if not self.fixed and self.seed != 0:
            warn_unused(f"ProjectedNorm(seed={seed})", "with fixed=False a fresh projection is drawn at every event "
                        "from the layer's generator (the cache's seed)")

    @property
    def draws_random(self) -> bool:  # type: ignore[override]
        return not self.fixed

    def init(self, spec: LayerSpec) -> Float[Tensor, "B 1 D R"] | None:
        if not self.fixed:
            return None
        gen = torch.Generator(device=spec.device)
        gen.manual_seed(derived_seed(self.seed, spec.layer_idx))
        return torch.randn(spec.batch, 1, spec.head_dim, self.rank, generator=gen, device=spec.device) / self.rank**0.5

    def score(self, view: LayerView, state: Tensor | None = None) -> Float[Tensor, "B H T"]:
        b, h, t, d = view.keys.shape
        g = state
        if g is None or g.shape[0] != b:
            g = draw(torch.randn, (b, 1, d, self.rank), view.generator, view.device) / self.rank**0.5
        k2 = (view.keys.float() @ g).pow(2).sum(-1)
        v2 = (view.values.float() @ g[..., : view.values.shape[-1], :]).pow(2).sum(-1)
        s = (k2 * v2).masked_fill(~view.valid, 0.0)
        return s / s.sum(-1, keepdim=True).clamp(min=1e-30)
