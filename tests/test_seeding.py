"""The one seed rule (kvcompose.seeding): every place that takes a seed refuses one that the per-layer formula
would push past a 64-bit generator seed, where it is given (before: accepted, then torch's overflow error at the
first forward, or a dead vLLM engine at a request's first event)."""

import pytest
import torch

from kvcompose import BranchCache, KVComposeCache, KVComposeError, methods
from kvcompose.testing import tiny_model
from kvcompose.scorers import ProjectedNorm
from kvcompose.seeding import MAX_SEED, SEED_STRIDE, check_seed, derived_seed


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2)


@pytest.mark.parametrize("bad", [2**60, MAX_SEED + 1, -1, "3", 1.0, True, None])
def test_every_cache_refuses_a_seed_out_of_range(model, bad, unchecked):
    for make in (lambda: KVComposeCache(model, methods.random_attention(), budget=64, seed=bad),
                 lambda: BranchCache(model, scorer=methods.random_attention(), budget=64, seed=bad),
                 lambda: ProjectedNorm(seed=bad)):
        with pytest.raises(KVComposeError, match="seed"):
            make()


def test_the_largest_seed_decodes(model):
    """MAX_SEED is accepted and the first forward (which seeds every layer's generator) runs."""
    cache = KVComposeCache(model, methods.random_attention(recent=2, interval=2), budget=8, seed=MAX_SEED)
    ids = torch.randint(3, 100, (1, 12))
    out = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == 18 and cache.stats.compress_calls > 0
    assert derived_seed(MAX_SEED, SEED_STRIDE - 1) < 2**63
    torch.Generator().manual_seed(derived_seed(MAX_SEED, SEED_STRIDE - 1))


def test_check_seed_names_where():
    assert check_seed(7, "x") == 7
    with pytest.raises(KVComposeError, match=r"request seed must be in \[0, "):
        check_seed(-5, "request seed")
    with pytest.raises(KVComposeError, match="index"):
        derived_seed(1, SEED_STRIDE)
