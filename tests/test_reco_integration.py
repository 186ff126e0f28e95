"""ReCo wired into the cache and generate(): RewardAllocator, methods.reco, budgets that follow the reward.

Tiny random models (kvcompose.testing.tiny_model) and fake tokenizers; the step rewards are scripted so the
expected budgets are known exactly.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import examples, random_view
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteriaList

from kvcompose import KVComposeCache, KVComposeError, Pipeline, methods
from kvcompose.allocators import HeadUtility, Pyramid
from kvcompose.methods.reco import Reco, RewardAllocator
from kvcompose.testing import tiny_model
from kvcompose.stores import PagedStore
from kvcompose.reco import (
    ConfidenceStopping,
    ForcePrefix,
    ReflectionPenalty,
    RewardBudgetSchedule,
    RewardTracker,
    RewardTrackingProcessor,
    StepInfo,
    StepReward,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one torch thread for the module


# ------------------------------------------------------------------------------------------------
# fakes
# ------------------------------------------------------------------------------------------------


class FixedRewards:
    """A reward source with fixed per-row rewards (what RewardAllocator reads of a RewardTracker)."""

    def __init__(self, rewards):
        self.rewards = list(rewards)

    @property
    def batch_size(self):
        return len(self.rewards)

    def reward_of(self, row):
        return self.rewards[row]

    @property
    def current_rewards(self):
        return list(self.rewards)

    @property
    def current_reward(self):
        return min(self.rewards)


class CharTok:
    """One token per ASCII char, id = ord(char) (vocab 128); id 0 is padding."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


class StepPerToken(CharTok):
    """Every generated token decodes to 'x' plus a blank line: each token completes one reasoning step."""

    def decode(self, ids, skip_special_tokens=True):
        return "x\n\n" * len(ids)


class Scripted(StepReward):
    """Step reward = fn(step index, row)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, step: StepInfo) -> float:
        return float(self.fn(step.index, step.row))


class Every(LogitsProcessor):
    """Forces token `tok` at every generated position p < `until` with p % k in `at` (step boundaries)."""

    def __init__(self, prompt_len, k, at, tok, until=10**9):
        self.prompt_len, self.k, self.at, self.tok, self.until = prompt_len, k, set(at), tok, until

    def __call__(self, input_ids, scores):
        p = input_ids.shape[1] - self.prompt_len
        if p < self.until and p % self.k in self.at:
            scores = torch.full_like(scores, -1e4)
            scores[:, self.tok] = 0.0
        return scores


class Monitor(LogitsProcessor):
    """Put FIRST: at each call records the reward the forward pass just used (the tracker is not yet
    updated for this step), layer 0's compression-event count and every layer's held tokens per row."""

    def __init__(self, cache, tracker, rows=1):
        self.cache, self.tracker, self.rows, self.log = cache, tracker, rows, []

    def __call__(self, input_ids, scores):
        rewards = [self.tracker.reward_of(b) for b in range(self.rows)]
        held = [per_row_held(layer) for layer in self.cache.layers]
        self.log.append((rewards, self.cache.layers[0].events, held))
        return scores


def per_row_held(layer):
    """Real (valid) tokens held per row, max over heads."""
    if isinstance(layer.segment.store, PagedStore):  # per-row budgets: paged storage
        return layer.lengths.max(-1).values.tolist()
    return layer.valid.sum(-1).max(-1).values.tolist()


def gen(model, prompt, cache, procs, crits=(), n=64):
    ids = torch.tensor(prompt)
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n, do_sample=False,
        pad_token_id=0, logits_processor=LogitsProcessorList(procs), stopping_criteria=StoppingCriteriaList(list(crits)),
    )


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0)


# ------------------------------------------------------------------------------------------------
# RewardAllocator on its own
# ------------------------------------------------------------------------------------------------


@settings(max_examples=examples(40), deadline=None)
@given(
    rewards=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=6),
    base=st.integers(1, 2048),
    lo_hi=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    min_scale=st.floats(0.05, 1.0),
)
def test_budget_is_monotone_non_increasing_in_reward(rewards, base, lo_hi, min_scale):
    low, high = sorted(lo_hi)
    sched = RewardBudgetSchedule(1, low=low, high=high, min_scale=min_scale)
    alloc = RewardAllocator(FixedRewards(rewards), sched, batch="row")
    view = random_view(b=1, h=3, t=12, d=4, w=4, prompt=2)
    budgets = []
    for r in sorted(rewards):
        alloc.tracker = FixedRewards([r])
        out, state = alloc(view, base)
        assert state is None  # stateless: the reward is read from the tracker
        assert out.shape == (1, 3) and out.dtype == torch.long
        assert (out == out[0, 0]).all()  # one budget per row, every head
        assert int(out[0, 0]) == sched(r, base) and 1 <= int(out[0, 0]) <= base
        budgets.append(int(out[0, 0]))
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))


def test_allocate_fills_rows_by_policy():
    sched = RewardBudgetSchedule(1, low=0.0, high=1.0, min_scale=0.5)
    view = random_view(b=3, h=2, t=20, d=4, w=4)
    src = FixedRewards([0.0, 1.0, 0.5])
    per_row = [sched(r, 100) for r in src.rewards]
    assert per_row == [100, 50, 75]
    assert RewardAllocator(src, sched, batch="min")(view, 100)[0].tolist() == [[50, 50]] * 3
    assert RewardAllocator(src, sched, batch="max")(view, 100)[0].tolist() == [[100, 100]] * 3
    assert RewardAllocator(src, sched, batch="row")(view, 100)[0].tolist() == [[b, b] for b in per_row]


def test_layer_budget_is_the_cap_and_the_schedule_applies_once():
    """The cache passes layer_budget(...) back as `budget` to allocate: the schedule must not be applied
    twice (reward 1 -> half the budget, not a quarter)."""
    sched = RewardBudgetSchedule(1, low=0.0, high=1.0, min_scale=0.5)
    src = FixedRewards([1.0, 0.0])
    view = random_view(b=2, h=2, t=20, d=4, w=4, layer_idx=1)
    cached = replace(view, cache_budget=128)  # what the cache hands over: its own budget rides on the view
    for batch, cap in [("min", 64), ("max", 128)]:
        alloc = RewardAllocator(src, sched, batch=batch)
        assert alloc.uniform
        assert alloc.layer_budget(1, 4, 128, 200) == cap
        assert alloc(cached, cap)[0].tolist() == [[cap, cap]] * 2
    alloc = RewardAllocator(src, sched, batch="row")
    assert not alloc.uniform  # per-row budgets: paged storage
    assert alloc.layer_budget(1, 4, 128, 200) == 128
    assert alloc(cached, 128)[0].tolist() == [[64, 64], [128, 128]]
    # outside the cache protocol (no cache budget on the view), `budget` is the base budget
    alloc = RewardAllocator(FixedRewards([1.0, 1.0]), sched)
    assert alloc(view, 80)[0].tolist() == [[40, 40]] * 2


def test_budget_follows_a_real_tracker():
    """Driven by a RewardTracker fed token by token: each completed step's (scripted) reward sets the budget."""
    script = [0.1, 0.95, 0.5, 1.0, 0.0]
    tr = RewardTracker(StepPerToken(), reward=Scripted(lambda i, row: script[i]))
    sched = RewardBudgetSchedule(1, low=0.0, high=1.0, min_scale=0.25)
    alloc = RewardAllocator(tr, sched)
    ids = torch.tensor([[1, 2, 3]])
    tr.observe(ids, torch.zeros(1, 128))  # the prompt: a new generation starts
    assert alloc.layer_budget(0, 2, 400, 10) == sched(tr.default_reward, 400)  # before the first step
    for i, r in enumerate(script):
        ids = torch.cat([ids, torch.tensor([[7]])], 1)
        tr.observe(ids, torch.zeros(1, 128))
        assert tr.rewards_of(0)[-1] == r
        assert alloc.layer_budget(0, 2, 400, 10) == sched(r, 400) == int((1 - 0.75 * r) * 400 + 1e-9)


def test_protection_floor_from_bind_and_check(model):
    """R-KV always keeps its 8 newest tokens: a scheduled budget below 8 is raised to 8."""
    sched = RewardBudgetSchedule(1, low=0.0, high=1.0, min_scale=0.01)
    alloc = RewardAllocator(FixedRewards([1.0]), sched)
    assert alloc.layer_budget(0, 2, 100, 30) == 1  # unbound: no floor known
    p = methods.with_allocator(methods.rkv(), alloc)
    KVComposeCache(model, p, budget=100)  # the cache calls allocator.check(pipeline, ...) -> bind
    assert alloc.layer_budget(0, 2, 100, 30) == 8
    view = random_view(b=1, h=2, t=30, d=16, w=8)
    assert p.select(view, 8)[0].kept.shape[-1] == 8  # does not raise "protected tokens do not fit"


def test_wraps_a_per_layer_allocator():
    sched = RewardBudgetSchedule(1, low=0.0, high=1.0, min_scale=0.5)
    pyr = Pyramid(window=8, beta=20.0)
    alloc = RewardAllocator(FixedRewards([1.0]), sched, inner=pyr)
    base = pyr.layer_budgets(4, 256)
    assert [alloc.layer_budget(i, 4, 256, 300) for i in range(4)] == [b // 2 for b in base]
    r = methods.reco(CharTok(), base=methods.pyramid_rkv(), budget=256, bands=(), stop_k=None)
    assert isinstance(r.allocator.inner, Pyramid)


def test_bad_inputs(model):
    src = FixedRewards([0.5])
    with pytest.raises(KVComposeError, match="reward_of"):
        RewardAllocator(object())
    with pytest.raises(KVComposeError, match="batch"):
        RewardAllocator(src, batch="median")
    with pytest.raises(KVComposeError, match="different budgets"):
        RewardAllocator(src, inner=HeadUtility())
    with pytest.raises(KVComposeError, match="already"):
        RewardAllocator(src, inner=RewardAllocator(src))
    alloc = RewardAllocator(FixedRewards([0.5, 0.5]))
    with pytest.raises(KVComposeError, match="reset"):  # tracker follows 2 rows, the cache holds 3
        alloc(random_view(b=3, h=2, t=20, d=4, w=4), 16)
    with pytest.raises(KVComposeError, match="does not compress"):
        methods.reco(CharTok(), base=methods.full())
    with pytest.raises(KVComposeError, match="budget"):
        methods.reco(CharTok(), budget=0)
    with pytest.raises(KVComposeError, match="stop_k"):
        methods.reco(CharTok(), stop_k=0)
    with pytest.raises(KVComposeError, match="band"):
        methods.reco(CharTok(), bands=[(0.9, 0.1, 1.0)])
    with pytest.raises(KVComposeError, match="protectors"):
        methods.reco(CharTok(), budget=4)  # R-KV protects 8 recent tokens
    r = methods.reco(CharTok())
    with pytest.raises(KVComposeError, match="budget"):
        r.cache(model)


# ------------------------------------------------------------------------------------------------
# the cache under a scripted reward
# ------------------------------------------------------------------------------------------------

SCHED = RewardBudgetSchedule(1, low=0.0, high=1.0, min_scale=0.5)  # reward 0 -> 32, reward 1 -> 16


def run_scripted(model, script, budget=32, interval=8, n=96, rows=1, batch="min"):
    tr = RewardTracker(StepPerToken(), reward=Scripted(script), default_reward=0.0)
    alloc = RewardAllocator(tr, SCHED, batch=batch)
    cache = KVComposeCache(model, methods.with_allocator(methods.rkv(), alloc), budget=budget, interval=interval)
    mon = Monitor(cache, tr, rows)
    prompt = [[1, 5 + b, 6, 7] for b in range(rows)]
    gen(model, prompt, cache, [mon, RewardTrackingProcessor(tr)], n=n)
    return mon.log, cache, tr


def test_cache_holds_fewer_tokens_after_high_reward_steps(model):
    """Rewards alternate in blocks of 32 steps (0 then 1; one step per token). At every compression event the cache is cut to
    exactly schedule(reward of the latest step) = 32 (low reward) or 16 (high reward), so it holds fewer
    tokens after high-reward steps; it never holds more than the base budget + interval."""
    log, cache, tr = run_scripted(model, lambda i, row: float((i // 32) % 2))
    assert len(tr.rewards_of(0)) >= 90
    after = {0.0: [], 1.0: []}
    seen_events = 0
    for rewards, events, held in log:
        if events > seen_events:  # this forward pass ran a compression event (all layers at once)
            seen_events = events
            assert all(h[0] == SCHED(rewards[0], 32) for h in held)
            after[rewards[0]].append(held[0][0])
        assert all(h[0] <= 32 + 8 for h in held)
    assert seen_events >= 5
    assert after[1.0] and after[0.0]
    assert max(after[1.0]) == 16 and min(after[0.0]) > 16
    # same model, constant rewards: the final held size follows the reward
    held_hi = run_scripted(model, lambda i, row: 1.0)[1].held_lengths()
    held_lo = run_scripted(model, lambda i, row: 0.0)[1].held_lengths()
    assert max(held_hi) <= 16 + 8 and min(held_lo) >= 32 and max(held_hi) < min(held_lo)


def test_batch_min_policy_gives_every_row_the_smallest_budget(model):
    """B=2 on dense storage: row 0 confident, row 1 not; policy 'min' cuts both rows to 16."""
    log, cache, _ = run_scripted(model, lambda i, row: 1.0 if row == 0 else 0.0, rows=2, batch="min")
    last = log[-1][2]
    assert all(len(h) == 2 and h[0] == h[1] and h[0] <= 16 + 8 for h in last)


def test_batch_row_policy_gives_each_row_its_own_budget(model):
    """B=2 with policy 'row' (ragged storage): the confident row keeps 16 tokens, the other 32."""
    log, cache, _ = run_scripted(model, lambda i, row: 1.0 if row == 0 else 0.0, rows=2, batch="row")
    assert all(isinstance(layer.segment.store, PagedStore) for layer in cache.layers)
    seen_events = 0
    for rewards, events, held in log:
        if events > seen_events:
            seen_events = events
            assert all(h == [16, 32] for h in held)
    assert seen_events >= 6


# ------------------------------------------------------------------------------------------------
# methods.reco end to end
# ------------------------------------------------------------------------------------------------


def test_reco_bundle_plugs_into_generate(model):
    """methods.reco over R-KV with a scripted reward: steps (every 6 tokens, forced blank lines) 0-5 are low,
    then high; after two confident steps 'The answer is' is forced, the model answers and stops.
    The cache compresses with budgets that follow the reward; reset() makes a second call identical."""
    tok = CharTok()
    r = methods.reco(
        tok, base=methods.rkv(), budget=RewardBudgetSchedule(32, low=0.0, high=1.0, min_scale=0.5),
        reward=Scripted(lambda i, row: 0.0 if i < 6 else 1.0), stop_k=2, stop_threshold=0.9,
        max_answer_tokens=4,
    )
    assert isinstance(r, Reco) and r.budget == 32
    kinds = [type(p) for p in r.logits_processor]
    assert kinds == [RewardTrackingProcessor, ReflectionPenalty, ForcePrefix]
    assert [type(c) for c in r.stopping_criteria] == [ConfidenceStopping]
    prompt = [[1, 81, 58, 10]]

    def run():
        cache = r.cache(model, interval=8)
        mon = Monitor(cache, r.tracker)
        out = gen(model, prompt, cache, [Every(4, 6, (4, 5), 10, until=48), mon, *r.logits_processor], r.stopping_criteria, n=120)
        return out, cache, mon

    out, cache, mon = run()
    text = tok.decode(out[0, 4:].tolist())
    fired = r.stopping.fired_at[0]  # sequence length when the 2nd confident step completed
    assert r.tracker.rewards_of(0)[:8] == [0.0] * 6 + [1.0] * 2
    assert fired == 4 + 6 * 8
    assert tok.decode(out[0, fired : fired + 14].tolist()) == "\nThe answer is"
    # the prefix, then at most max_answer_tokens free tokens (fewer if a number and a newline come first)
    assert fired + 14 < out.shape[1] <= fired + 14 + 4
    assert out.shape[1] < 4 + 120
    assert "\n\n" in text
    # budgets: events after low-reward steps compress to 32, after high-reward ones to 16
    events = [(rw[0], held) for k, (rw, ev, held) in enumerate(mon.log) if ev > (mon.log[k - 1][1] if k else 0)]
    assert {SCHED(rw, 32) for rw, _ in events} == {32, 16}
    for rw, held in events:
        assert all(h[0] == SCHED(rw, 32) for h in held)
    r.reset()
    out2, _, _ = run()
    assert torch.equal(out, out2) and r.stopping.fired_at[0] == fired


def test_reco_default_reward_runs_and_records_steps(model):
    """The default ConfidenceReward on the model's own logits: runs, scores steps in [0, 1], compresses."""
    tok = CharTok()
    r = methods.reco(tok, budget=24, stop_k=None)
    assert len(r.stopping_criteria) == 0 and r.stopping is None and r.force is None
    cache = r.cache(model, interval=8)
    out = gen(model, [[1, 81, 58, 10]], cache, [Every(4, 5, (3, 4), 10), *r.logits_processor], n=48)
    assert out.shape[1] == 4 + 48
    rewards = r.tracker.rewards_of(0)
    assert len(rewards) >= 8 and all(0.0 <= x <= 1.0 for x in rewards)
    assert cache.layers[0].events >= 4 and max(cache.held_lengths()) <= 24 + 8


def test_reco_over_any_pipeline_with_allocator(model):
    """Composability: RewardAllocator dropped into SnapKV via methods.with_allocator."""
    tr = RewardTracker(StepPerToken(), reward=Scripted(lambda i, row: 1.0), default_reward=1.0)
    p = methods.with_allocator(methods.snapkv(window=4), RewardAllocator(tr, SCHED))
    assert isinstance(p, Pipeline)
    cache = KVComposeCache(model, p, budget=32, interval=8)
    gen(model, [[1, 5, 6, 7]], cache, [RewardTrackingProcessor(tr)], n=40)
    assert max(cache.held_lengths()) <= 16 + 8
