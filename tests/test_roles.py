"""A block in the wrong slot is refused everywhere a block is accepted, with the same words: what the block is and
what the slot takes (issue: `methods.with_allocator(methods.rkv(), HostTier())` returned a pipeline). Scorer
arithmetic with another role names the problem instead of Python's operand TypeError."""

from __future__ import annotations

import pytest

from kvcompose import (
    AccumulatedAttention, BlockGranular, BranchCache, CompressedTier, Evict, GrowPage, HeadUtility, Hierarchy,
    HostTier, KeyNorm, KVComposeCache, KVComposeError, Pipeline, ProtectPrompt, ProtectRecent, ProtectSinks, Pyramid,
    RandomDrop, Recency, Sample, TopK, Uniform, ValueNorm, methods,
)
from kvcompose.testing import tiny_model
from kvcompose.blocks import MergeSimilar
from kvcompose.bench.paged_blocks import BlockProtectValueNorm, RequestBlocks, RequestEvent
from kvcompose.reco.eviction import Lexicographic
from kvcompose.scorers import Combined

BLOCKS = {
    "Scorer": Recency(),
    "Protector": ProtectSinks(2),
    "Selector": TopK(),
    "Allocator": Pyramid(window=2),
    "TierStore": HostTier(),
    "Merger": MergeSimilar(),
}


def _slots(model):
    """Every place that takes a block of one role: (name, role it takes, call with the candidate)."""
    rkv = methods.rkv()
    return [
        ("with_allocator", "Allocator", lambda b: methods.with_allocator(rkv, b)),
        ("with_tier", "TierStore", lambda b: methods.with_tier(rkv, b)),
        ("with_merger", "Merger", lambda b: methods.with_merger(rkv, b)),
        ("BlockGranular", "Selector", lambda b: BlockGranular(b)),
        ("Combined", "Scorer", lambda b: Combined(((b, 1.0),))),
        ("Lexicographic", "Scorer", lambda b: Lexicographic(b, KeyNorm())),
        ("Lexicographic then", "Scorer", lambda b: Lexicographic(KeyNorm(), b)),
        ("HeadUtility(layers)", "Allocator", lambda b: HeadUtility(layers=b)),
        ("Hierarchy(host)", "TierStore:HostTier", lambda b: Hierarchy(host=b)),
        ("Hierarchy(compressed)", "TierStore:CompressedTier", lambda b: Hierarchy(compressed=b)),
        ("BlockProtectValueNorm(base)", "Protector:ProtectValueNorm", lambda b: BlockProtectValueNorm(b)),
        ("RequestBlocks(inner)", "Selector", lambda b: RequestBlocks(b, 4, RequestEvent(16, 8, block=4))),
        ("BranchCache(tier)", "TierStore", lambda b: BranchCache(model, tier=b)),
        ("pyramid_rkv(base)", "Pipeline", lambda b: methods.pyramid_rkv(base=b)),
        ("reason_alloc(base)", "Pipeline", lambda b: methods.reason_alloc(base=b, profile=None)),
        ("growpage(base)", "Pipeline", lambda b: methods.growpage(base=b)),
        ("KVComposeCache(pipeline)", "Pipeline", lambda b: KVComposeCache(model, b, budget=16)),
    ]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=1)


def test_wrong_role_refused_everywhere(model, unchecked):
    for where, takes, call in _slots(model):
        skip, _, named = takes.partition(":")
        takes = named or takes
        for role, block in BLOCKS.items():
            if role == skip:
                continue
            with pytest.raises(KVComposeError) as e:
                call(block)
            msg = str(e.value)
            assert role in msg, (where, role, msg)  # names what the block is ...
            assert takes in msg or "Pipeline" in msg, (where, takes, msg)  # ... and what the slot takes


def test_with_allocator_refuses_a_tier(unchecked):
    """Issue item 4: `with_allocator(rkv(), HostTier())` returned a pipeline with a Uniform allocator and a tier."""
    with pytest.raises(KVComposeError, match="HostTier\\(\\) is a TierStore, not an Allocator.*with_tier"):
        methods.with_allocator(methods.rkv(), HostTier())
    p = methods.with_allocator(methods.rkv(), Pyramid(window=8))  # the right role still works
    assert isinstance(p.allocator, Pyramid) and isinstance(p.tier, Evict)


def test_pipeline_refuses_non_blocks_and_duplicate_replacements(unchecked):
    with pytest.raises(KVComposeError, match="not a block.*replace"):
        Pipeline(methods.rkv())
    with pytest.raises(KVComposeError, match="not a kvcompose block"):
        Pipeline(ProtectRecent(4), "TopK", TopK())
    with pytest.raises(KVComposeError, match="2 blocks of the role Selector"):
        methods.rkv().replace(TopK(), Sample())
    with pytest.raises(KVComposeError, match="2 blocks of the role TierStore"):
        methods.rkv().replace(HostTier(), CompressedTier())
    p = methods.rkv().replace(Sample(), HostTier())
    assert isinstance(p.selector, Sample) and isinstance(p.tier, HostTier)


def test_scorer_arithmetic_names_the_problem(unchecked):
    """Issue item 6: `0.5 * Recency() - TopK()` raised Python's "unsupported operand ... for *" TypeError."""
    for expr in (lambda: 0.5 * Recency() - TopK(), lambda: Recency() + TopK(), lambda: TopK() + Recency(),
                 lambda: 0.5 * TopK(), lambda: -RandomDrop(), lambda: Recency() * ProtectSinks(4),
                 lambda: 0.3 * KeyNorm() + 0.7 * HostTier()):
        with pytest.raises(KVComposeError, match="is an? (Selector|Protector|TierStore), not a Scorer"):
            expr()
    with pytest.raises(KVComposeError, match="scaled by a number"):
        Recency() * KeyNorm()
    with pytest.raises(KVComposeError, match="only scorers and numbers"):
        Recency() + "1"
    s = 0.5 * Recency() - 0.25 * KeyNorm() + 1.0
    assert [w for _, w in s.terms] == [0.5, -0.25] and s.constant == 1.0
    assert [w for _, w in (Recency() / 4).terms] == [0.25]
    assert [w for _, w in (2 - ValueNorm()).terms] == [-1.0] and (2 - ValueNorm()).constant == 2.0
    assert isinstance(sum([Recency(), KeyNorm()]), Combined)


def test_role_names():
    from kvcompose.block import role_of

    assert [role_of(b) for b in BLOCKS.values()] == list(BLOCKS)
    assert role_of(methods.rkv()) == "Pipeline" and role_of(3) == "int"
    assert role_of(GrowPage()) == "Allocator" and role_of(Uniform()) == "Allocator"
    assert role_of(AccumulatedAttention()) == "Scorer" and role_of(ProtectPrompt()) == "Protector"
