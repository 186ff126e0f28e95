"""The jaxtyping + beartype hook is on for the whole test session, for every kvcompose module, including
modules imported after the test session started; a wrong shape through the public API gets the checker's
error (not a bare IndexError or a silent broadcast)."""

import importlib
import sys

import pytest
import torch
from beartype.roar import BeartypeCallHintParamViolation
from jaxtyping import TypeCheckError

from kvcompose import DenseStore, KVComposeCache, LayerView, methods
from kvcompose.testing import tiny_model

CHECKER = (TypeCheckError, BeartypeCallHintParamViolation)  # the checker's errors; never KVComposeError


def test_a_late_imported_module_is_checked():
    sys.modules.pop("kvcompose.calibration", None)
    calibration = importlib.import_module("kvcompose.calibration")
    with pytest.raises(CHECKER):
        calibration.coverage_count([0.5, 0.5], 0.9)  # a list where a tensor is annotated


def test_wrong_shape_through_the_public_api_gets_the_checkers_error():
    model = tiny_model("llama", layers=1)
    cache = KVComposeCache(model, methods.streaming_llm(), budget=8, interval=4)
    keys = torch.zeros(1, 2, 3, 16)
    values = torch.zeros(1, 2, 4, 16)  # 4 tokens of values for 3 of keys
    store = DenseStore(1, 2, 16, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(CHECKER):
        store.append(keys, values, torch.arange(3))
    with pytest.raises(CHECKER):
        LayerView(layer_idx=0, num_layers=1, keys=keys, values=values[:, :, :3], positions=torch.zeros(1, 2, 5).long(),
                  valid=torch.ones(1, 2, 3, dtype=torch.bool), prompt_length=3, queries=None, query_positions=None,
                  query_valid=None, seen=3, scale=0.25)
    assert store.held == 0  # the refused append wrote nothing
    with pytest.raises(CHECKER):
        cache.update(keys, values, 0)  # the same mismatch through the cache
    assert cache.layers[0].seen == 0  # nothing counted as seen


def test_a_refused_update_leaves_the_cache_usable():
    """The cache hands the layer to the attention hook only after the layer took the tokens (issue 32's walk),
    so a refused update leaves no hand-off behind and the next forward runs (it was a strict xfail before)."""
    model = tiny_model("llama", layers=1)
    cache = KVComposeCache(model, methods.streaming_llm(), budget=8, interval=4)
    with pytest.raises(CHECKER):
        cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 4, 16), 0)  # 4 tokens of values for 3 of keys
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    assert cache.get_seq_length() == 5 and cache.layers[0].held == 5 and cache.layers[0].prompt_length == 5
