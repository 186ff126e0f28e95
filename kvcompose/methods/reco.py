"""ReCo as a kvcompose method: a reward-driven `Allocator` plus the decoding controls, in one bundle.

ReCo ("reward-coordinated compression and stopping", arXiv; only the abstract was available, there is
no reference code) scores each completed reasoning step with a lightweight process-reward estimate and
lets that one signal drive three controls:

1. **compression strength** -> `RewardAllocator`: the budget of the next compression event shrinks as
   the latest step's reward grows (harder compression on confident stretches, gentler on shaky ones);
2. **reflection penalty** -> `kvcompose.reco.ReflectionPenalty` (banded by reward);
3. **confidence early stopping** -> `kvcompose.reco.ConfidenceStopping` (+ `ForcePrefix`).

The reward machinery (step segmentation, `ConfidenceReward`, `PRMReward`, `RewardTracker`, the
schedule, the penalty, the stopping rule) lives in `kvcompose.reco`; this module connects it to the
cache (`RewardAllocator`, which drops into any compressing pipeline with `methods.with_allocator`) and
bundles everything for `model.generate` (`reco`, `Reco`):

```python
from kvcompose import KVComposeCache, methods

r = methods.reco(tokenizer, base=methods.rkv(), budget=256)
out = model.generate(**inputs, past_key_values=KVComposeCache(model, r.pipeline, budget=256),
                     logits_processor=r.logits_processor, stopping_criteria=r.stopping_criteria)
r.reset()  # before the next generate() call
```

How a reward reaches the cache: the tracker is fed by the logits processor AFTER each forward pass, and
the cache compresses INSIDE the forward pass (at every `interval`-th decoded token). So the compression
event of forward pass t uses the reward of the latest step completed by the tokens up to t - 1 (the step
completed by the token being fed in pass t is scored right after it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor
from transformers import LogitsProcessorList, StoppingCriteriaList

from ..allocators import Allocator, Uniform, layer_budget
from ..block import require_role
from ..cache import KVComposeCache
from ..pipeline import Pipeline
from ..selectors import TopK
from ..reco import (
    DEFAULT_ANSWER_PATTERN,
    DEFAULT_PENALTY_BANDS,
    DEFAULT_REFLECTION_WORDS,
    ConfidenceStopping,
    ForcePrefix,
    ReflectionPenalty,
    RewardBudgetSchedule,
    RewardTracker,
    RewardTrackingProcessor,
    StepReward,
    StepSegmenter,
)
from ..reco.eviction import Lexicographic, StepRewardScore
from ..view import KVComposeError, LayerView
from .allocation import with_allocator

__all__ = ["RewardAllocator", "reco", "Reco", "reco_evict"]

BatchPolicy = Literal["min", "max", "row"]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class RewardAllocator(Allocator):
    """Step reward -> KV budget of the next compression event (ReCo's reward-coordinated compression).

    At each compression event of layer l the base budget `base_l` (the cache's budget, or
    `inner.layer_budget(l, L, budget)` when a per-layer allocator is wrapped) is scaled by the schedule
    with the latest completed step's reward of each row:

        budget[b, h] = schedule(tracker.reward_of(b), base_budget=base_l)      for every KV head h

    The schedule (`kvcompose.reco.RewardBudgetSchedule`) is monotone non-increasing in the reward, so a
    high-reward (confident) step leads to a harder compression, a low-reward one to a gentler one. The
    result is raised, if needed, to the smallest budget the pipeline's fixed-count protectors fit in
    (see "Protection floor"), and never exceeds `base_l`.

    Batches (`batch`): ReCo wants one budget per row, but a dense `[B, H, K, D]` layer holds one budget
    for all its rows, so
        * `"min"` (default): every row gets the smallest per-row budget (dense storage; the memory bound of
          every row holds; a low-reward row batched with a confident one is compressed harder than alone);
        * `"max"`: every row gets the largest per-row budget (dense storage; the cautious choice, the least
          confident row decides, as `RewardTracker.current_reward` does);
        * `"row"`: each row its own budget. This sets `uniform = False` on the instance, so
          `KVComposeCache` stores every layer in paged storage (`kvcompose.stores.PagedStore`), where rows
          keep different lengths and memory follows their sum.
    With `B = 1` the three policies give the same budgets.

    Cache protocol (the `LayerSchedule` capability): the layer asks `layer_budget(l, L, budget, seen)`
    for its budget, uses it for the compression trigger and the buffer capacity, and passes it to
    `pipeline.select` -> `allocate(view, that budget)`. `layer_budget` returns the *cap* (the largest budget
    a row of the layer gets under the policy); `allocate(view, cap)` recomputes the per-row budgets from
    the base `base_l` of the cache's budget (`view.cache_budget`), so the schedule is applied once, not
    twice. Called with a view that carries no cache budget (e.g. `pipeline.select(view, 128)` outside a
    cache), `budget` is taken as the base budget.

    Protection floor: a scheduled budget below what the pipeline's fixed-count protectors keep (R-KV's 8
    newest tokens) is raised to the smallest budget they fit in. The pipeline is learnt from `bind`
    (called by `reco`) or from `check` (called by `KVComposeCache` at construction).

    The reward is read at call time; the tracker is updated by the logits processors after each forward
    pass, so all layers of one forward pass see the same reward. Reset the tracker between `generate`
    calls (`Reco.reset()`), otherwise a prefill compression (`compress_prefill=True`) would use the
    previous generation's last reward.

    Args:
        tracker: the reward source: a `kvcompose.reco.RewardTracker` or any object with `reward_of(row)`
            and `current_rewards` (a list, one per tracked row).
        schedule: reward -> budget map; its `base_budget` is ignored here (the cache's budget is the base).
            Default `RewardBudgetSchedule(1)` (linear from the full budget at reward <= 0.3 to half of it at
            reward >= 0.9).
        batch: `"min"`, `"max"` or `"row"` (above).
        inner: optional per-layer allocator (`uniform=True`, e.g. `Pyramid`) giving `base_l`.

    Shapes: `allocate(view, budget) -> Long[B, H]`.
    """

    def __init__(
        self,
        tracker: Any,
        schedule: RewardBudgetSchedule | None = None,
        batch: str = "min",
        inner: Allocator | None = None,
    ):
        if not hasattr(tracker, "reward_of") or not hasattr(tracker, "current_rewards"):
            raise KVComposeError(
                f"tracker must provide reward_of(row) and current_rewards (a RewardTracker), got {type(tracker).__name__}"
            )
        if schedule is not None and not isinstance(schedule, RewardBudgetSchedule):
            raise KVComposeError(f"schedule must be a RewardBudgetSchedule, got {type(schedule).__name__}")
        if batch not in ("min", "max", "row"):
            raise KVComposeError(f"batch must be 'min', 'max' or 'row', got {batch!r}")
        if inner is not None:
            require_role(inner, Allocator, "RewardAllocator(inner=...)")
            if isinstance(inner, RewardAllocator):
                raise KVComposeError("inner is already a RewardAllocator: wrap the underlying allocator once")
            if not inner.uniform:
                raise KVComposeError(
                    f"{inner!r} gives heads of a layer different budgets (uniform=False); "
                    "RewardAllocator can only wrap per-layer allocators"
                )
            if isinstance(inner, Uniform):
                inner = None
        self.tracker = tracker
        self.schedule = schedule if schedule is not None else RewardBudgetSchedule(1)
        self.batch: BatchPolicy = batch  # type: ignore[assignment]
        self.uniform = batch != "row"  # per-row budgets: paged storage
        if batch != "row":
            self.padded_rows = (f"RewardAllocator(batch={batch!r}) gives every row of the batch the budget of its "
                                f"{'least' if batch == 'min' else 'most'} confident row")
        self.inner = inner
        self.query_window = 0 if inner is None else int(getattr(inner, "query_window", 0))
        self._fixed: Any = None  # pipeline.fixed_protection, set by bind() (configuration, not state)

    # -- wiring ----------------------------------------------------------------------------------
    def bind(self, pipeline: Pipeline) -> None:
        """Remember the pipeline's fixed protection so that budgets never fall below what its
        fixed-count protectors keep (e.g. R-KV's 8 recent tokens). Called by `reco` and by `check`."""
        self._fixed = pipeline.fixed_protection

    # -- budgets ---------------------------------------------------------------------------------
    def _floor(self, b: int, base: int) -> int:
        """The smallest b' in [b, base] the fixed protectors fit in (`base` if none does)."""
        if self._fixed is None:
            return b
        while b < base and self._fixed(b) > b:
            b += 1
        return b

    def budget_for(self, reward: float, base: int) -> int:
        """Budget of one row with this reward, for base budget `base` (schedule + protection floor)."""
        return self._floor(self.schedule(reward, base), base)

    def row_budgets(self, base: int, batch: int | None = None) -> list[int]:
        """Per-row budgets `schedule(reward_of(b), base)` (floored), for `batch` rows (default: the rows
        the tracker follows)."""
        if batch is None:
            rewards = [float(r) for r in self.tracker.current_rewards]
        else:
            rows = getattr(self.tracker, "batch_size", batch)
            if rows not in (0, batch):
                raise KVComposeError(
                    f"the reward tracker follows {rows} rows but the cache holds {batch}: call Reco.reset() "
                    "(or tracker.reset()) before each generate() call"
                )
            rewards = [float(self.tracker.reward_of(b)) for b in range(batch)]
        return [self.budget_for(r, base) for r in rewards]

    def _base(self, layer_idx: int, num_layers: int, budget: int) -> int:
        base = layer_budget(self.inner, layer_idx, num_layers, budget, 0) if self.inner is not None else budget
        if not _is_int(base) or base <= 0:
            raise KVComposeError(f"RewardAllocator needs a positive int base budget, got {base!r}")
        return int(base)

    def layer_budget(self, layer_idx: int, num_layers: int, budget: int | None, seen: int) -> int:
        """The budget layer `layer_idx` may hold at the next compression event: the largest per-row budget
        under the batch policy (`"min"`: the smallest row budget). The cache uses it for the compression
        trigger and buffer capacity, and passes it back to `allocate`."""
        if budget is None:
            raise KVComposeError(f"{self!r} scales the cache's budget: give KVComposeCache a budget=...")
        base = self._base(layer_idx, num_layers, budget)
        rows = self.row_budgets(base)
        return min(rows) if self.batch == "min" else max(rows)

    def allocate(self, view: LayerView, budget: int) -> Int[Tensor, "B H"]:
        b, h, _ = view.shape
        if not _is_int(budget) or budget <= 0:
            raise KVComposeError(f"RewardAllocator: budget must be a positive int, got {budget!r}")
        cap = budget
        if view.cache_budget is not None:
            base = self._base(view.layer_idx, view.num_layers, view.cache_budget)
        else:  # called outside a cache: `budget` is the base budget
            base = budget
        rows = self.row_budgets(base, b)
        if self.batch == "min":
            rows = [min(rows)] * b
        elif self.batch == "max":
            rows = [max(rows)] * b
        rows = [min(r, cap) for r in rows]
        t = torch.tensor(rows, dtype=torch.long, device=view.keys.device)
        return t[:, None].expand(b, h).contiguous()

    def check(self, pipeline: Any, budget: int | None, num_layers: int, num_heads: int) -> None:
        """Called by `KVComposeCache` at construction: binds the pipeline (protection floor) and refuses
        settings that cannot work: the base budget of every layer must hold the protectors (lower
        scheduled budgets are raised to the protection floor)."""
        if isinstance(pipeline, Pipeline):
            self.bind(pipeline)
        if budget is None:
            raise KVComposeError(f"{self!r} scales the cache's budget: give KVComposeCache a budget=...")
        for i in range(num_layers):
            base = self._base(i, num_layers, budget)
            fixed = pipeline.fixed_protection(base)
            if fixed > base:
                raise KVComposeError(
                    f"{self!r}: layer {i} has a base budget of {base} tokens, less than the {fixed} tokens the "
                    "protectors always keep"
                )

    def __repr__(self) -> str:
        s = self.schedule
        inner = f", inner={self.inner!r}" if self.inner is not None else ""
        return (
            f"RewardAllocator(scale {s.max_scale}->{s.min_scale} over reward {s.low}->{s.high}, "
            f"batch={self.batch!r}{inner})"
        )


def reco_evict(tracker: Any, base: Pipeline | None = None, order: str = "reward", seed: int = 0) -> Pipeline:
    """ReCo's step-attributed eviction over `base` (R-KV by default): tokens carry their reasoning step
    (`StepRewardScore`, one token-state channel), and at each event the tokens of completed steps are
    ranked by their step's reward, highest reward evicted first; inside a step (and among the prompt and
    the open step, which rank above every completed step) the base score decides (`Lexicographic`).

    ReCo (arXiv, abstract only): deleting the tokens of high-reward steps beats deleting the same number at
    random. `order="inverse"` (lowest reward first) and `order="random"` (whole steps in a random order) are
    the controls of that claim. The base's protectors, allocator, tier and interval are kept; its selector
    must be `TopK` (a rank is not a sampling weight).

    Args:
        tracker: the `kvcompose.reco.RewardTracker` fed by a `RewardTrackingProcessor` in the same
            `generate` call (or a `kvcompose.reco.StepReplay` for teacher forcing).
        base: a pipeline with a scorer and `TopK` (default `methods.rkv()`).
        order: "reward" (ReCo), "inverse" or "random".
        seed: seed of the random step order.

    Example:
        >>> tracker = RewardTracker(tok)
        >>> pipe = methods.reco_evict(tracker, methods.rkv())
        >>> model.generate(**inputs, past_key_values=KVComposeCache(model, pipe, budget=128),
        ...                logits_processor=LogitsProcessorList([RewardTrackingProcessor(tracker)]))
    """
    from .reasoning import rkv

    base = base if base is not None else rkv()
    if not isinstance(base, Pipeline) or not base.compresses:
        raise KVComposeError(f"base must be a compressing kvcompose Pipeline (e.g. methods.rkv()), got {base!r}")
    if base.scorer is None or not isinstance(base.selector, TopK):
        raise KVComposeError(f"reco_evict ranks tokens: the base needs a scorer and TopK, got {base!r}")
    score = Lexicographic(StepRewardScore(tracker, order=order, seed=seed), base.scorer)  # type: ignore[arg-type]
    return base.replace(score, name=f"reco_evict({base!r}, order={order})")


@dataclass
class Reco:
    """Everything ReCo plugs into `model.generate`, built by `reco(...)`.

    Attributes:
        pipeline: the base pipeline with a `RewardAllocator` (pass to `KVComposeCache`).
        logits_processor: `[RewardTrackingProcessor, ReflectionPenalty?, ForcePrefix?]` (tracking first so
            the tracker sees the model's own distribution, forcing last).
        stopping_criteria: `[ConfidenceStopping]` (empty when stopping is off).
        tracker: the shared `RewardTracker` (read `tracker.steps` / `rewards_of(row)` after a run).
        allocator: the `RewardAllocator` inside `pipeline`.
        penalty, stopping, force: the individual controls (None when off).
        budget: the base budget given to `reco(budget=...)` (used by `cache()`), or None.
    """

    pipeline: Pipeline
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    tracker: RewardTracker
    allocator: RewardAllocator
    penalty: ReflectionPenalty | None = None
    stopping: ConfidenceStopping | None = None
    force: ForcePrefix | None = None
    budget: int | None = None

    def reset(self) -> None:
        """Forget the previous generation (tracker, stopping flags, forced prefixes). Call it before every
        `generate` call that reuses this bundle."""
        self.tracker.reset()
        if self.stopping is not None:
            self.stopping.reset()
        if self.force is not None:
            self.force.reset()

    def cache(self, model: Any, budget: int | None = None, **kwargs: Any) -> KVComposeCache:
        """`KVComposeCache(model, self.pipeline, budget=budget or self.budget, **kwargs)` (e.g. `interval=64`)."""
        b = budget if budget is not None else self.budget
        if b is None:
            raise KVComposeError("no budget: pass cache(model, budget=...) or reco(..., budget=...)")
        return KVComposeCache(model, self.pipeline, budget=b, **kwargs)

    def generate_kwargs(self) -> dict[str, Any]:
        """`{"logits_processor": ..., "stopping_criteria": ...}` for `model.generate(**inputs, **...)`."""
        return {"logits_processor": self.logits_processor, "stopping_criteria": self.stopping_criteria}


def reco(
    tokenizer: Any,
    base: Pipeline | None = None,
    budget: int | RewardBudgetSchedule | None = None,
    reward: StepReward | None = None,
    bands: Sequence[tuple[float, float, float]] = DEFAULT_PENALTY_BANDS,
    stop_k: int | None = 2,
    stop_threshold: float = 0.8,
    force_answer: bool = True,
    *,
    batch: str = "min",
    segmenter: StepSegmenter | None = None,
    reflection_words: Sequence[str] = DEFAULT_REFLECTION_WORDS,
    answer_prefix: str = "\nThe answer is",
    answer_pattern: str | None = DEFAULT_ANSWER_PATTERN,
    max_answer_tokens: int = 16,
    default_reward: float = 0.5,
    evict: str = "base",
) -> Reco:
    """ReCo: reward-coordinated compression, reflection penalty and early stopping over a base method.

    ReCo (arXiv, abstract only; 37-65% fewer generated tokens and 2.1-2.35x lower latency than full
    chain-of-thought reported). One `RewardTracker` scores each completed reasoning step (default reward:
    `ConfidenceReward`, a training-free confidence proxy, NOT a trained process reward model; pass
    `PRMReward` for a real one) and drives:

    * the KV budget of every compression event of `base` (`RewardAllocator`: harder at high reward);
    * a reward-banded penalty on reflection tokens (`ReflectionPenalty`, `bands`);
    * confidence stopping (`ConfidenceStopping`): once the last `stop_k` steps all have reward
      >= `stop_threshold`. With `force_answer=True` the row is then steered into `answer_prefix`
      ("The answer is"), answers freely, and stops after a number and a newline (or
      `max_answer_tokens`); with `force_answer=False` it stops outright, but only once `answer_pattern`
      ("answer is", "####", "\\boxed") has appeared in its text.

    Args:
        tokenizer: the model's tokenizer (decoding for step segmentation, token ids of reflection words
            and of the forced prefix).
        base: the compression pipeline to drive (default `methods.rkv()`). A per-layer allocator already in
            it (e.g. `Pyramid`) is kept under the reward schedule; a per-head one is refused.
        budget: an int (the base budget; stored on the bundle for `Reco.cache(model)`, the schedule is the
            default one) or a `RewardBudgetSchedule` (the reward -> budget map; its `base_budget` is stored
            on the bundle). Either way the allocator scales the cache's own budget at run time.
        reward: the step reward (default `ConfidenceReward()`).
        bands: `(low, high, penalty)` reward bands of the reflection penalty; empty = no penalty.
        stop_k: consecutive confident steps that trigger stopping; None = no early stopping.
        stop_threshold: reward threshold of a confident step.
        force_answer: force a final-answer prefix instead of cutting the text (above).
        batch: the allocator's batch policy (`RewardAllocator`): "min" (default), "max", or "row" (B = 1).
        segmenter: step segmentation (default: blank lines and "Step k" markers).
        reflection_words: words and phrases the penalty lowers.
        answer_prefix, max_answer_tokens: the forced answer (force mode).
        answer_pattern: the answer gate without force (ignored with `force_answer=True`).
        default_reward: the reward before a row's first completed step.
        evict: which tokens an event deletes: "base" (the base method's ranking, default) or "reward"
            (step-attributed: the tokens of the highest-reward completed steps first, `reco_evict`; the base
            needs a scorer and `TopK`).

    Returns a `Reco` bundle; call `.reset()` between `generate` calls. Greedy or sampling (no beam search).
    """
    from .reasoning import rkv

    if base is None:
        base = rkv()
    if not isinstance(base, Pipeline):
        raise KVComposeError(f"base must be a kvcompose Pipeline (e.g. methods.rkv()), got {type(base).__name__}")
    if not base.compresses:
        raise KVComposeError(f"base {base!r} does not compress: ReCo needs a compressing pipeline (e.g. methods.rkv())")
    if reward is not None and not isinstance(reward, StepReward):
        raise KVComposeError(f"reward must be a StepReward (ConfidenceReward, PRMReward), got {type(reward).__name__}")
    if stop_k is not None and (not _is_int(stop_k) or stop_k < 1):
        raise KVComposeError(f"stop_k must be a positive int or None, got {stop_k!r}")
    if not 0.0 <= float(stop_threshold) <= 1.0:
        raise KVComposeError(f"stop_threshold must lie in [0, 1], got {stop_threshold}")
    base_budget: int | None
    if budget is None:
        schedule, base_budget = RewardBudgetSchedule(1), None
    elif isinstance(budget, RewardBudgetSchedule):
        schedule, base_budget = budget, budget.base_budget
    elif _is_int(budget) and budget > 0:
        schedule, base_budget = RewardBudgetSchedule(budget), int(budget)
    else:
        raise KVComposeError(f"budget must be a positive int or a RewardBudgetSchedule, got {budget!r}")
    if base_budget is not None:
        base.validate(base_budget)
    for band in bands:
        if len(band) != 3 or not float(band[0]) < float(band[1]):
            raise KVComposeError(f"a penalty band is (low, high, penalty) with low < high, got {band!r}")

    inner = None
    name = f"reco({base!r})"
    if not isinstance(base.allocator, Uniform):  # keep a per-layer schedule under the reward schedule
        inner = base.allocator
        blocks = [*base.protectors, base.scorer, base.selector, base.tier]
        base = Pipeline(*[b for b in blocks if b is not None], name=base.name)
    if evict not in ("base", "reward"):
        raise KVComposeError(f"evict must be 'base' or 'reward', got {evict!r}")
    tracker = RewardTracker(tokenizer, reward=reward, segmenter=segmenter, default_reward=default_reward)
    if evict == "reward":
        base = reco_evict(tracker, base)
        name = f"reco({base!r})"
    allocator = RewardAllocator(tracker, schedule, batch=batch, inner=inner)
    pipeline = with_allocator(base, allocator, name=name)
    allocator.bind(pipeline)

    procs: list[Any] = [RewardTrackingProcessor(tracker)]
    penalty = None
    if len(bands):
        try:
            penalty = ReflectionPenalty(tokenizer, tracker, words=reflection_words, bands=bands)
        except ValueError as e:
            raise KVComposeError(str(e)) from e
        procs.append(penalty)
    force = stopping = None
    if stop_k is not None:
        if force_answer:
            try:
                force = ForcePrefix(tokenizer, prefix=answer_prefix, max_answer_tokens=max_answer_tokens)
            except ValueError as e:
                raise KVComposeError(str(e)) from e
            procs.append(force)
        stopping = ConfidenceStopping(
            tracker, k=stop_k, threshold=stop_threshold,
            answer_pattern=None if force_answer else answer_pattern, force=force,
        )
    return Reco(
        pipeline=pipeline,
        logits_processor=LogitsProcessorList(procs),
        stopping_criteria=StoppingCriteriaList([stopping] if stopping is not None else []),
        tracker=tracker,
        allocator=allocator,
        penalty=penalty,
        stopping=stopping,
        force=force,
        budget=base_budget,
    )
