"""Blocks on random tensors: selector/protector invariants (hypothesis), scorer arithmetic, pipeline checks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import random_view
from kvcompose import (
    AccumulatedAttention, AttentionStep, KeyNorm, KeyRedundancy, KVComposeError, LastQueryAttention, Pipeline, ProtectPrompt,
    ProtectRecent, ProtectSinks, ProtectValueNorm, RandomDrop, RandomScore, Recency, Sample, TopK, ValueNorm,
    WindowedAttention,
)

SELECTORS = {"topk": lambda: TopK(), "sample": lambda: Sample(), "random": lambda: RandomDrop()}


def _select(kind, view, protected, budget, seed):
    sel = SELECTORS[kind]()
    scores = None if kind == "random" else ValueNorm()(view)
    g = torch.Generator().manual_seed(seed)
    b, h, _ = view.shape
    kept, order = sel(scores, protected, view.valid, torch.full((b, h), budget), g)
    assert order is None  # the full priority order only on request (need_order=True)
    return kept


@given(
    kind=st.sampled_from(sorted(SELECTORS)),
    t=st.integers(8, 48),
    frac=st.floats(0.1, 1.0),
    nprot=st.integers(0, 8),
    pad=st.integers(0, 6),
    seed=st.integers(0, 1000),
)
def test_selector_invariants(kind, t, frac, nprot, pad, seed):
    view = random_view(b=2, h=3, t=t, w=min(8, t), seen=t + 5, pad=[pad, 0], seed=seed)
    budget = max(1, int(frac * t))
    gen = torch.Generator().manual_seed(seed)
    protected = torch.zeros(view.valid.shape, dtype=torch.bool)
    for b in range(2):
        for h in range(3):
            protected[b, h, torch.randperm(t, generator=gen)[: min(nprot, budget)]] = True
    protected &= view.valid
    kept = _select(kind, view, protected, budget, seed)
    assert kept.shape == (2, 3, min(budget, t))
    assert (kept >= 0).all()
    # sorted, unique: chronological order
    assert (kept[..., 1:] > kept[..., :-1]).all()
    keep_mask = torch.zeros_like(protected)
    keep_mask.scatter_(-1, kept, True)
    # protected tokens are always kept
    assert not (protected & ~keep_mask).any()
    # padding is never kept while a real token is dropped
    n_valid = view.valid.sum(-1)
    kept_invalid = (keep_mask & ~view.valid).sum(-1)
    assert ((kept_invalid == 0) | (n_valid < budget)).all()
    # determinism
    assert torch.equal(kept, _select(kind, view, protected, budget, seed))


@pytest.mark.parametrize("kind", ["sample", "random"])
def test_random_selectors_depend_on_seed(kind):
    view = random_view(b=1, h=2, t=64, seen=64)
    protected = torch.zeros(view.valid.shape, dtype=torch.bool)
    a = _select(kind, view, protected, 16, 1)
    b = _select(kind, view, protected, 16, 2)
    assert not torch.equal(a, b)


def test_random_drop_independent_per_head_and_row():
    view = random_view(b=2, h=2, t=64, seen=64)
    kept = _select("random", view, torch.zeros(view.valid.shape, dtype=torch.bool), 16, 0)
    assert not torch.equal(kept[0, 0], kept[0, 1])
    assert not torch.equal(kept[0, 0], kept[1, 0])


def test_sample_prefers_high_scores():
    # token 0..9 get score 1000, the rest 1e-3: sampling proportional must take all ten
    view = random_view(b=1, h=1, t=50, seen=50)
    scores = torch.full((1, 1, 50), 1e-3)
    scores[..., :10] = 1000.0
    kept, _ = Sample()(scores, torch.zeros(1, 1, 50, dtype=torch.bool), view.valid, torch.full((1, 1), 10),
                       torch.Generator().manual_seed(0))
    assert kept.tolist() == [[list(range(10))]]


def test_pipeline_rejects_overfull_protection():
    # the pipeline (not the selector) refuses protected tokens beyond the budget when no tier keeps them
    view = random_view(b=1, h=1, t=20, seen=20, prompt=20)
    with pytest.raises(KVComposeError, match="12 protected tokens do not fit in a budget of 10"):
        Pipeline(ProtectSinks(4), ProtectRecent(8), ValueNorm(), TopK()).select(view, 10)


def test_selector_overfull_protection_ranks_protected_by_priority():
    # a selector given more protected tokens than the budget (allowed when a tier keeps the rest) keeps the
    # `budget` protected tokens of highest priority, and its order lists every protected token first
    view = random_view(b=1, h=1, t=20, seen=20)
    scores = torch.arange(20, dtype=torch.float32).reshape(1, 1, 20)
    protected = torch.zeros(1, 1, 20, dtype=torch.bool)
    protected[..., :12] = True
    kept, order = TopK()(scores, protected, view.valid, torch.full((1, 1), 5), need_order=True)
    assert kept.tolist() == [[[7, 8, 9, 10, 11]]]
    assert order[0, 0, :5].sort().values.tolist() == [7, 8, 9, 10, 11]
    assert order[0, 0, 5:12].tolist() == [6, 5, 4, 3, 2, 1, 0]
    assert order[0, 0, 12:].tolist() == list(range(19, 11, -1))


def test_protect_sinks_recent_prompt():
    view = random_view(b=1, h=2, t=30, seen=30, w=8, prompt=12)
    assert ProtectSinks(4)(view, 16).sum(-1).tolist() == [[4, 4]]
    sinks = ProtectSinks(4)(view, 16)
    assert (view.positions[sinks].reshape(2, 4) == view.positions[..., :4].reshape(2, 4)).all()
    recent = ProtectRecent(5)(view, 16)
    assert (view.positions[recent].reshape(2, 5) >= 25).all()
    # prompt fits
    prompt = ProtectPrompt()(view, 32, 32)
    assert torch.equal(prompt, view.is_prompt)
    # prompt larger than the room: first `sinks` + newest prompt tokens, exactly `room`
    capped = ProtectPrompt(sinks=2)(view, 8, 5)
    assert capped.sum(-1).tolist() == [[5, 5]]
    assert (capped & ~view.is_prompt).sum() == 0
    # float share of the budget
    assert ProtectRecent(0.25)(view, 16).sum(-1).tolist() == [[4, 4]]


def test_protect_sinks_skip_left_padding():
    view = random_view(b=2, h=1, t=30, seen=30, pad=[5, 0])
    sinks = ProtectSinks(2)(view, 8)
    pos0 = view.positions[0, 0][sinks[0, 0]]
    assert (pos0 >= 5).all() and view.valid[0, 0][sinks[0, 0]].all()


def test_protect_value_norm_counts_sinks_and_largest():
    view = random_view(b=1, h=1, t=30, seen=30)
    mask = ProtectValueNorm(8, sinks=4)(view, 32)
    assert int(mask.sum()) == 8
    ranks = torch.argsort(view.positions[0, 0])
    assert mask[0, 0, ranks[:4]].all()  # sinks inside the k
    mag = ValueNorm("range")(view)[0, 0]
    rest = mask[0, 0].clone()
    rest[ranks[:4]] = False
    # the other 4 are the largest value ranges among non-sinks
    cand = mag.clone()
    cand[ranks[:4]] = -1
    assert set(torch.topk(cand, 4).indices.tolist()) == set(torch.nonzero(rest).flatten().tolist())


@pytest.mark.parametrize("bad", [0, -3, 1.5, "x", True])
def test_protector_bad_counts(bad):
    # KVComposeError without runtime type checking; beartype (on in tests) rejects wrong types first
    with pytest.raises((KVComposeError, TypeError)):
        ProtectRecent(bad) if bad != 0 else ProtectRecent(-1)


def test_scorer_arithmetic():
    view = random_view()
    a, b = ValueNorm(), KeyNorm()
    combo = 0.1 * a - 0.9 * b + 2.0
    expect = 0.1 * a(view) - 0.9 * b(view) + 2.0
    assert torch.allclose(combo(view), expect)
    assert torch.allclose((-a)(view), -a(view))
    assert set(map(type, combo.children())) == {ValueNorm, KeyNorm}


def test_scorers_shapes_and_finite():
    view = random_view(b=2, h=2, t=24, w=8, seen=30)
    for s in [ValueNorm(), ValueNorm("l2"), KeyNorm(), Recency(), RandomScore(), KeyRedundancy(),
              WindowedAttention(8), WindowedAttention(4, gqa="max", pool="max", kernel=7, exclude_recent=4),
              LastQueryAttention(), LastQueryAttention(per_head=True)]:
        out = s(view)
        assert out.shape == (2, 2, 24) and torch.isfinite(out).all(), s
    # AccumulatedAttention scores its token state (one channel per held token), which observe() updates
    acc = AccumulatedAttention()
    step = AttentionStep(view.queries, view.keys, view.positions, view.valid, None, view.scale)
    state = acc.observe(torch.zeros(2, 2, 24), step)
    out = acc(view, state)
    assert out.shape == (2, 2, 24) and torch.isfinite(out).all() and torch.equal(out, state)
    # every query spreads one unit of attention over the keys: the total is the number of queries (Hq/H * W)
    assert torch.allclose(state.sum(-1), torch.full((2, 2), 2.0 * 8))


def test_tova_one_keep_set_per_layer():
    view = random_view(b=1, h=3, t=24, seen=24)
    s = LastQueryAttention()(view)
    assert torch.allclose(s[:, 0], s[:, 1]) and torch.allclose(s[:, 0], s[:, 2])


def test_pipeline_composition_errors():
    with pytest.raises(KVComposeError, match="2 selectors"):
        Pipeline(TopK(), RandomDrop())
    with pytest.raises(KVComposeError, match="needs scores"):
        Pipeline(ProtectRecent(4), TopK())
    with pytest.raises(KVComposeError, match="ignores scores"):
        Pipeline(ValueNorm(), RandomDrop())
    with pytest.raises(KVComposeError, match="2 scorers"):
        Pipeline(ValueNorm(), KeyNorm(), TopK())
    with pytest.raises(KVComposeError, match="no selector"):
        Pipeline(ValueNorm())
    with pytest.raises((KVComposeError, TypeError)):
        Pipeline("topk")
    p = Pipeline(ProtectSinks(4), ProtectRecent(64), ValueNorm(), TopK())
    with pytest.raises(KVComposeError, match="more than the budget"):
        p.validate(32)
    for bad in [0, -1]:
        with pytest.raises(KVComposeError, match="budget"):
            p.validate(bad)
    with pytest.raises((KVComposeError, TypeError)):
        p.validate(2.5)
    p.validate(128)
    with pytest.raises(KVComposeError, match="needs a token budget"):
        p.validate(None)


def test_pipeline_select_keeps_budget_and_protection():
    view = random_view(b=2, h=2, t=40, w=8, seen=60, prompt=10)
    p = Pipeline(ProtectRecent(8), ProtectPrompt(), RandomDrop())
    sel, states = p.select(view, 20)
    assert len(states) == len(p.leaves)
    assert sel.kept.shape == (2, 2, 20)
    kept_pos = view.positions.gather(-1, sel.kept)
    assert ((kept_pos >= 52).sum(-1) == 8).all()
    prompt_held = view.is_prompt.sum(-1)
    assert ((kept_pos < 10).sum(-1) == prompt_held.clamp(max=12)).all()
