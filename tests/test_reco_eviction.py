"""ReCo step-attributed eviction (`StepRewardScore`, `Lexicographic`, `methods.reco_evict`, `StepReplay`):
tokens carry the tracker's step in a token channel, and every compression event keeps exactly what a
loop-level reading of the rule keeps (tokens of the highest-reward completed steps are deleted first,
the base score decides inside a step, prompt and open step rank above completed steps)."""

from __future__ import annotations

import bisect

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from helpers import random_view
from kvcompose import KVComposeCache, KVComposeError, Pipeline, ProtectRecent, TopK, ValueNorm, methods
from kvcompose.testing import tiny_model
from kvcompose.reco import (
    UNREWARDED, Lexicographic, RewardTracker, RewardTrackingProcessor, StepReplay, StepRewardScore, StepSegmenter,
)
from kvcompose.view import LayerView

SCRIPT = "a = 3.\n\nb = 45.\n\nStep 3: c\nStep 4: 9 + 1\n\nso 10.\n\nd=2\n\n" * 6


class CharTokenizer:
    """id = ord(char), vocabulary 128."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


class ForceScript(LogitsProcessor):
    """Forces the characters of a script, one per step (after the tracker has seen the model's own scores)."""

    def __init__(self, text: str, prompt: int):
        self.ids, self.prompt = [ord(c) for c in text], prompt

    def __call__(self, input_ids, scores):
        i = input_ids.shape[1] - self.prompt
        out = torch.full_like(scores, -1e9)
        out[:, self.ids[i % len(self.ids)]] = 0.0
        return out


class Recorder:
    """Wraps `pipeline.select` to record every event: the view (copied: the store compacts its buffers in
    place), the tracker's steps then, and the kept set."""

    def __init__(self, pipe, tracker):
        self.events = []
        inner = pipe.select

        def select(view, budget, states=None, channels=None):
            sel, new = inner(view, budget, states, channels)
            snap = LayerView(**{**view.__dict__, **{k: getattr(view, k).clone() for k in ("keys", "values", "positions",
                                                                                         "valid")}})
            self.events.append((snap, channels.clone(), list(tracker.step_ends(0)), list(tracker.rewards_of(0)),
                                tracker.prompt_length, sel))
            return sel, new

        pipe.select = select


def _run(order="reward", budget=40, interval=8, new=150, recent=3, seed=0):
    model = tiny_model("llama", vocab=128, layers=2)
    tok = CharTokenizer()
    tracker = RewardTracker(tok, segmenter=StepSegmenter())
    pipe = methods.reco_evict(tracker, Pipeline(ProtectRecent(recent), ValueNorm(), TopK()), order=order, seed=seed)
    rec = Recorder(pipe, tracker)
    cache = KVComposeCache(model, pipe, budget=budget, interval=interval)
    ids = torch.tensor([[1, 81, 58, 32, 65, 66, 67, 10]])
    procs = LogitsProcessorList([RewardTrackingProcessor(tracker), ForceScript(SCRIPT, ids.shape[1])])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   past_key_values=cache, pad_token_id=0, logits_processor=procs)
    return cache, tracker, rec, pipe


def _reference_kept(view: LayerView, ends, rewards, p0, budget, recent, order="reward", seed=0):
    """The rule, token by token: protected newest `recent`; the rest by (step key, value range)."""
    import random

    b, h, t = view.shape
    out = []
    for hh in range(h):
        toks = []
        for j in range(t):
            pos = int(view.positions[0, hh, j])
            if not bool(view.valid[0, hh, j]):
                continue
            g = pos - p0
            k = bisect.bisect_right(ends, g)
            if g < 0 or k >= len(rewards):
                key = UNREWARDED
            elif order == "reward":
                key = -rewards[k]
            elif order == "inverse":
                key = rewards[k]
            else:
                key = -random.Random(seed * 1_000_003 + k).random()
            v = view.values[0, hh, j]
            toks.append((pos, key, float(v.max() - v.min())))
        toks.sort(key=lambda x: x[0])
        prot = {p for p, _, _ in toks[-recent:]}
        # ties of both keys (identical tokens have identical values in layer 0): the newer token first
        rest = sorted((x for x in toks if x[0] not in prot), key=lambda x: (x[1], x[2], x[0]), reverse=True)
        out.append(sorted(prot | {p for p, _, _ in rest[: budget - len(prot)]}))
    return out


@pytest.mark.parametrize("order", ["reward", "inverse", "random"])
def test_every_event_keeps_what_the_loop_rule_keeps(order):
    cache, tracker, rec, _ = _run(order=order)
    assert len(tracker.rewards_of(0)) >= 8 and len(set(round(r, 6) for r in tracker.rewards_of(0))) > 3
    checked = 0
    for view, _, ends, rewards, p0, sel in rec.events:
        kept = sel.kept[0]
        got = [sorted(int(view.positions[0, hh, j]) for j in kept[hh].tolist() if j >= 0) for hh in range(view.shape[1])]
        assert got == _reference_kept(view, ends, rewards, p0, 40, 3, order)
        checked += len(rewards) > 0
    assert checked >= 10  # events with rewarded steps, in both layers


def test_step_channel_equals_the_tracker_spans():
    """After generation (and many compactions), every held generated token's channel is the tracker's step."""
    cache, tracker, _, pipe = _run(new=120)
    ends, p0 = tracker.step_ends(0), tracker.prompt_length
    seen = cache.get_seq_length()
    for layer in cache.layers:
        ch = layer.segment.store.read_channels()[..., 0]
        pos, n = layer.positions, layer.lengths
        gen_tokens = 0
        for hh in range(pos.shape[1]):
            for j in range(int(n[0, hh])):
                g = int(pos[0, hh, j]) - p0
                if g < 0 or g >= seen - p0 - 1:  # prompt, or the last token (the tracker reads it next pass)
                    continue
                assert int(ch[0, hh, j]) == bisect.bisect_right(ends, g), (g, ends)
                gen_tokens += 1
        assert gen_tokens >= 30 and layer.events >= 10


def test_scores_of_the_rule_and_controls():
    class Source:
        batch_size, prompt_length = 1, 10

        def step_ends(self, row):
            return [3, 6, 9]

        def rewards_of(self, row):
            return [0.2, 0.9, 0.5]

    v = random_view(b=1, h=1, t=20, seen=22, prompt=10, seed=0)
    pos = v.positions[0, 0]
    steps = StepRewardScore(Source()).step_ids(v.positions, 10)[0, 0]
    want = [(-1 if p < 10 else bisect.bisect_right([3, 6, 9], int(p) - 10)) for p in pos.tolist()]
    assert steps.tolist() == want
    state = steps.clamp(min=0).float()[None, None]
    for order, keys in (("reward", [-0.2, -0.9, -0.5]), ("inverse", [0.2, 0.9, 0.5])):
        s = StepRewardScore(Source(), order=order)(v, state)[0, 0]
        exp = [UNREWARDED if w < 0 or w >= 3 else keys[w] for w in want]
        assert torch.allclose(s, torch.tensor(exp))
    r1 = StepRewardScore(Source(), order="random", seed=3)(v, state)[0, 0]
    r2 = StepRewardScore(Source(), order="random", seed=3)(v, state)[0, 0]
    assert torch.equal(r1, r2) and ((r1 < 0) | (r1 == UNREWARDED)).all()
    # Lexicographic: first key major, second breaks ties
    a = torch.tensor([[[1.0, 0.0, 1.0, 0.0]]])
    z = torch.tensor([[[0.5, 0.9, 0.1, 0.2]]])

    class Fixed(ValueNorm):
        def __init__(self, x):
            super().__init__()
            self.x = x

        def score(self, view):
            return self.x

    w = random_view(b=1, h=1, t=4, w=2, seen=4, seed=1)
    assert Lexicographic(Fixed(a), Fixed(z))(w).tolist() == [[[3.0, 1.0, 2.0, 0.0]]]


def test_replay_matches_the_live_tracker():
    """`StepReplay` built from the distributions a live tracker saw gives the same steps and rewards, and
    reveals them token by token as the live tracker had them."""
    model = tiny_model("llama", vocab=128, layers=2)
    tok = CharTokenizer()
    live = RewardTracker(tok)
    ids = torch.tensor([[1, 81, 58, 32, 65, 66, 67, 10]])
    seen_scores, counts = [], []

    class Spy(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen_scores.append(scores.clone())
            counts.append(len(live.step_ends(0)))
            return scores

    procs = LogitsProcessorList([RewardTrackingProcessor(live), Spy(), ForceScript(SCRIPT, ids.shape[1])])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=90, min_new_tokens=90,
                         do_sample=False, pad_token_id=0, logits_processor=procs)
    trace = out[0, ids.shape[1]:].tolist()
    replay = StepReplay.from_logits(tok, ids[0].tolist(), trace, torch.cat(seen_scores))
    assert replay.batch_size == 0 and replay.step_ends(0) == []
    live.sync(out)
    assert replay.ends == live.step_ends(0) and replay.rewards == pytest.approx(live.rewards_of(0))
    for n, c in enumerate(counts):  # the processor at generated index n had read n tokens
        replay.advance(n)
        assert len(replay.step_ends(0)) == c and replay.prompt_length == ids.shape[1]


def test_reco_bundle_with_reward_eviction_and_errors():
    model = tiny_model("llama", vocab=128)
    r = methods.reco(CharTokenizer(), base=methods.rkv(window=4), budget=24, evict="reward")
    assert isinstance(r.pipeline.scorer, Lexicographic)
    ids = torch.tensor([[1, 81, 58, 10]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                         past_key_values=r.cache(model, interval=8), pad_token_id=0, **r.generate_kwargs())
    assert out.shape[1] > 4
    with pytest.raises(KVComposeError, match="evict"):
        methods.reco(CharTokenizer(), evict="steps")
    with pytest.raises(KVComposeError, match="TopK"):
        methods.reco_evict(RewardTracker(CharTokenizer()), methods.vase())
    with pytest.raises(KVComposeError, match="order"):
        StepRewardScore(RewardTracker(CharTokenizer()), order="high")
    with pytest.raises(KVComposeError, match="step source"):
        StepRewardScore(object())
    tr = RewardTracker(CharTokenizer())
    cache = KVComposeCache(model, methods.reco_evict(tr, methods.rkv(window=4)), budget=16, interval=4)
    tr.observe(torch.ones(3, 5, dtype=torch.long), torch.zeros(3, 128))  # the tracker follows 3 rows
    with pytest.raises(KVComposeError, match="follows 3 rows"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                       past_key_values=cache, pad_token_id=0)
