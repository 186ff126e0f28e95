"""One call shape per leaf role (optax's `update -> (result, new_state)`): a Scorer, Protector or Selector may
keep layer state and return `(result, new_state)` as an Allocator or a Merger does, and the Pipeline threads it;
a selector's `priority` gets the tokens' positions when it asks; the protector that fills the room the others
leave is marked by an attribute (`fills_room`), not found by its class."""

import pytest
import torch

from helpers import random_view
from kvcompose import (KeyNorm, KVComposeCache, KVComposeError, Pipeline, ProtectPrompt, ProtectRecent, Protector, Scorer,
                       Selector, TopK, methods)
from kvcompose.blocks.composite import CompositeTokens
from kvcompose.selectors import BlockGranular
from kvcompose.testing import tiny_model


class CountingScore(Scorer):
    """Scores by position; its state counts the events it scored (returned as `(scores, new_state)`)."""

    def init(self, spec):
        return 0

    def score(self, view, state):
        return view.positions.float(), state + 1


class CountingProtect(Protector):
    """Protects the newest token; its state counts its calls."""

    def init(self, spec):
        return 0

    def max_count(self, budget):
        return 1

    def protect(self, view, budget, room, state):
        newest = view.positions == view.positions.amax(-1, keepdim=True)
        return newest & view.valid, state + 1


class EvenFirst(Selector):
    """Keeps even positions first: a priority that reads the positions; its state counts its events."""

    needs_scores = False

    def init(self, spec):
        return 0

    def priority(self, scores, valid, generator, positions, state):
        return (positions % 2 == 0).float() + positions.float() * 1e-3, state + 1


def _leaf_states(pipe, states):
    return {type(leaf).__name__: s for leaf, s in zip(pipe.leaves, states)}


def test_every_leaf_role_may_return_its_new_state():
    pipe = Pipeline(CountingScore(), CountingProtect(), TopK())
    view = random_view(b=1, h=2, t=20, prompt=4)
    sel, states = pipe.select(view, 8)
    sel, states = pipe.select(view, 8, states)
    got = _leaf_states(pipe, states)
    assert got["CountingScore"] == 2 and got["CountingProtect"] == 2  # threaded from one event to the next
    newest = view.positions.amax(-1)
    kept_pos = view.positions.gather(-1, sel.kept)
    assert (kept_pos == newest[..., None]).any(-1).all()  # the protector's mask was used

    pipe = Pipeline(EvenFirst())
    sel, states = pipe.select(view, 6)
    sel, states = pipe.select(view, 6, states)
    assert _leaf_states(pipe, states)["EvenFirst"] == 2
    kept_pos = view.positions.gather(-1, sel.kept)
    assert (kept_pos % 2 == 0).all()  # the priority read the positions the pipeline passed


def test_stateful_leaves_run_in_a_cache():
    model = tiny_model("llama", layers=2)
    pipe = Pipeline(CountingScore(), CountingProtect(), TopK())
    cache = KVComposeCache(model, pipe, budget=8, interval=4)
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids[:, :12], past_key_values=cache)
        for t in range(12, 30):
            model(input_ids=ids[:, t:t + 1], past_key_values=cache)
    counts = _leaf_states(pipe, cache.layers[0].write_segment().blocks)
    assert counts["CountingScore"] >= 3 and counts["CountingScore"] == counts["CountingProtect"]


def test_the_room_filling_protector_is_an_attribute():
    class PromptLike(ProtectPrompt):
        pass

    class RoomTaker(Protector):
        fills_room = True

        def max_count(self, budget):
            return 0

        def protect(self, view, budget, room):
            # gets the room the others leave: budget 10 - ProtectRecent(4) = 6
            assert room == 6, room
            return view.is_prompt & view.valid & (view.positions < room)

    view = random_view(b=1, h=2, t=24, prompt=12, w=4)
    sel, _ = Pipeline(KeyNorm(), ProtectRecent(4), RoomTaker(), TopK()).select(view, 10)
    assert sel.protected.max() <= 10
    with pytest.raises(KVComposeError, match="at most one protector may fill the room"):
        Pipeline(ProtectPrompt(), PromptLike(), methods.random_attention().selector)
    with pytest.raises(KVComposeError, match="ProtectPrompt, RoomTaker"):
        Pipeline(ProtectPrompt(), RoomTaker(), methods.random_attention().selector)


def test_no_selector_overrides_the_call():
    """BlockGranular and CompositeTokens (and the bench's RequestBlocks) override `choose`, not `__call__`."""
    from kvcompose.bench.paged_blocks import RequestBlocks

    for cls in (BlockGranular, CompositeTokens, RequestBlocks, TopK):
        assert cls.__call__ is Selector.__call__ and cls.apply is Selector.apply, cls
