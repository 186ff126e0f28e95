"""Block-granular eviction (what a paged serving engine can do): whole blocks kept or evicted, protected
tokens protect their block, the kept blocks are the best by the pooled priority; it composes with every
scorer and protector and runs in a cache (paged storage)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples, random_view
from kvcompose import (
    BlockGranular, KVComposeCache, KVComposeError, Pipeline, ProtectRecent, ProtectSinks, RandomDrop, TopK,
    ValueNorm, methods,
)
from kvcompose.testing import tiny_model


@settings(max_examples=examples(30), deadline=None)
@given(block=st.integers(2, 8), budget=st.integers(12, 30), recent=st.integers(0, 6), sinks=st.integers(0, 3),
       reduce=st.sampled_from(["mean", "max"]), per_head=st.booleans(), seed=st.integers(0, 50),
       random=st.booleans())
def test_whole_blocks_protection_and_budget(block, budget, recent, sinks, reduce, per_head, seed, random):
    view = random_view(b=2, h=2, t=40, seen=40, w=8, seed=seed)
    view = type(view)(**{**view.__dict__, "positions": torch.arange(40).expand(2, 2, 40).contiguous()})
    inner = RandomDrop() if random else TopK()
    blocks = [ProtectRecent(recent)] * bool(recent) + [ProtectSinks(sinks)] * bool(sinks)
    pipe = Pipeline(*blocks, *([] if random else [ValueNorm()]), BlockGranular(inner, block, reduce, per_head))
    sel, _ = pipe.select(view, budget)
    for b in range(2):
        for h in range(2):
            kept = [k for k in sel.kept[b, h].tolist() if k >= 0]
            assert kept == sorted(set(kept))
            by_block = {}
            for k in kept:
                by_block.setdefault(k // block, []).append(k)
            newest = 39 // block
            for blk, members in by_block.items():  # whole blocks (the newest may be partial: it ends at 39)
                want = list(range(blk * block, min(blk * block + block, 40)))
                assert members == want or (blk == newest and members == want)
            protected = set(range(40 - recent, 40)) | set(range(sinks))
            assert protected <= set(kept)
            protected_blocks = {p // block for p in protected}
            unprotected = [k for k in kept if k // block not in protected_blocks]
            assert len(kept) <= max(budget, len(protected_blocks) * block) or not unprotected
            if len(kept) > budget:  # only protected blocks can push a head over its budget
                assert not unprotected
    if not per_head:
        assert all(sel.kept[b, 0].tolist() == sel.kept[b, 1].tolist() for b in range(2))


def test_block_scores_are_the_mean_of_their_tokens():
    """Reference loop: block score = mean of its tokens' scores; keep the best blocks while they fit."""
    view = random_view(b=1, h=1, t=32, seen=32, w=8)
    view = type(view)(**{**view.__dict__, "positions": torch.arange(32)[None, None]})
    pipe = Pipeline(ValueNorm(), BlockGranular(TopK(), block=4))
    sel, _ = pipe.select(view, 12)
    s = pipe.scorer(view)[0, 0]
    means = [s[i * 4:(i + 1) * 4].mean().item() for i in range(8)]
    best = sorted(range(8), key=lambda i: -means[i])[:3]
    expect = sorted(k for i in best for k in range(4 * i, 4 * i + 4))
    assert sel.kept[0, 0].tolist() == expect


def test_block_granular_presets_run_in_a_cache():
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    for base in (methods.snapkv(window=8), methods.rkv(window=8), methods.vase(recent=8, window=8),
                 methods.random_attention(recent=8), methods.h2o(), methods.tova()):
        pipe = base.replace(BlockGranular(base.selector, block=8))
        assert pipe.paged
        cache = KVComposeCache(model, pipe, budget=40, interval=8)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                       max_new_tokens=48, min_new_tokens=48, do_sample=False)
        assert max(layer.events for layer in cache.layers) > 0
        pos = cache.kept_positions(0)
        seen = cache.get_seq_length()
        for row in pos.reshape(-1, pos.shape[-1]):
            held = [p for p in row.tolist() if p >= 0]
            for blk in {p // 8 for p in held}:
                if blk != (seen - 1) // 8:
                    assert sum(1 for p in held if p // 8 == blk) == 8


def test_bad_block_granular_input():
    for bad in (dict(block=0), dict(block=-3)):  # (wrong types get the type checker's error)
        try:
            BlockGranular(TopK(), **bad)
        except KVComposeError as e:
            assert "BlockGranular" in str(e)
        else:
            raise AssertionError(f"{bad} accepted")
    try:
        BlockGranular(BlockGranular(TopK()))
    except KVComposeError as e:
        assert "token-level" in str(e)
    else:
        raise AssertionError("nested BlockGranular accepted")
