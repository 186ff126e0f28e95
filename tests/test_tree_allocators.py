"""A per-layer allocator inside a `BranchCache` (issue item 8): `BranchCache(model, budget=40, scorer=...)` with a
ReasoningWave said it "needs a cache budget (budget=...)", although a budget was given (it meant the active path's
budget, which a tree without `active_budget` never uses). Inactive nodes are compressed to the sizes the tree
chooses; the layer schedule applies to the active node with `active_budget`."""

from __future__ import annotations

import pytest
import torch

from kvcompose import BranchCache, KVComposeError, ReasoningWave, methods
from kvcompose.allocators import layer_budget

from helpers import tree_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROFILE = {"model": "tiny", "demand": [1.0, 3.0], "num_hidden_layers": 2}


@pytest.mark.parametrize("make", [
    lambda: methods.reason_alloc(methods.rkv(window=2), profile=PROFILE, page_size=4, window=4, floor=0.5),
    lambda: methods.pyramid_rkv(methods.rkv(window=2), beta=2),
    lambda: methods.with_allocator(methods.rkv(window=2), ReasoningWave(PROFILE)),
], ids=["reason_alloc", "pyramid", "wave"])
def test_per_layer_allocators_in_a_tree(make):
    model = tree_model()
    cache = BranchCache(model, budget=40, scorer=make())
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache)
    a, b = cache.fork(0), cache.fork(0)
    for br, n in ((a, 20), (b, 24)):
        cache.switch(br)
        model.generate(input_ids=torch.cat([prompt, prompt[:, -1:]], 1), past_key_values=cache, max_new_tokens=n,
                       min_new_tokens=n, do_sample=False)
    assert cache.compressions > 0  # the inactive branch was compressed by the pipeline
    cache.switch(a)
    model.generate(input_ids=torch.cat([cache.tokens(a), prompt[:, -1:]], 1), past_key_values=cache,
                   max_new_tokens=2, do_sample=False)  # rehydrated and decoded
    active = BranchCache(model, budget=40, scorer=make(), active_budget=16, interval=4)  # the schedule applies
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=active)
    model.generate(input_ids=torch.cat([prompt, prompt[:, -1:]], 1), past_key_values=active, max_new_tokens=20,
                   min_new_tokens=20, do_sample=False)
    assert max(layer.events for layer in active.layers) > 0


def test_the_message_names_both_budgets():
    with pytest.raises(KVComposeError, match="BranchCache\\(active_budget=...\\)"):
        layer_budget(ReasoningWave(PROFILE), 0, 2, None, 10)
