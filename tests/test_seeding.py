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


# -- one generator per row (the vLLM route's grouped events) ------------------------------------------------------

def _row(view, r, gen):
    """Row `r` of `view` alone, drawing from `gen`."""
    import dataclasses

    cut = {f.name: getattr(view, f.name)[r:r + 1] for f in dataclasses.fields(view)
           if f.name in ("keys", "values", "positions", "valid", "queries", "query_valid")}
    return dataclasses.replace(view, generator=gen, **cut)


def _per_row_pipelines():
    from kvcompose import Pipeline, ProtectSinks, TopK
    from kvcompose.blocks.rotary import Rotary
    from kvcompose.scorers import ValueNorm
    from kvcompose.selectors import RandomDrop, Sample

    rope = Rotary(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    return {
        "random_attention": methods.random_attention(recent=4),
        "vase": methods.vase(recent=4, window=8),
        "sample": Pipeline(ProtectSinks(2), ValueNorm(), Sample()),
        "random_drop(shared_heads)": Pipeline(RandomDrop(shared_heads=True)),
        "projected_norm(fresh)": Pipeline(ProjectedNorm(rank=4, fixed=False), TopK()),
        "leverage": methods.leverage(rope=rope, sketch=4),
        "compactor": methods.compactor(rope=rope),
    }


@pytest.mark.parametrize("name", list(_per_row_pipelines()))
def test_a_block_that_draws_per_row_draws_for_each_row_what_it_draws_alone(name):
    """`draws_per_row` is a promise: with one generator per row (`RowGenerators`), a view of 3 rows keeps for
    each row exactly what the row alone keeps with its generator (the vLLM route groups requests on it)."""
    from helpers import random_view
    from kvcompose.view import RowGenerators

    pipe = _per_row_pipelines()[name]
    assert pipe.draws_random and pipe.draws_per_row
    view = random_view(b=3, h=2, t=40, d=8, g=2, w=8, prompt=10, seed=4)
    gens = lambda: [torch.Generator().manual_seed(100 + r) for r in range(3)]  # noqa: E731
    import dataclasses

    together, _ = pipe.select(dataclasses.replace(view, generator=RowGenerators(gens())), 16)
    for r, g in enumerate(gens()):
        alone, _ = pipe.select(_row(view, r, g), 16)
        assert torch.equal(together.kept[r], alone.kept[0]), (name, r)
    if name == "compactor":  # its sketch moves the scores, but here the attention part decides the top 16
        return
    # and the draws matter: other generators keep other tokens for some row
    other, _ = pipe.select(dataclasses.replace(view, generator=RowGenerators(
        torch.Generator().manual_seed(7 + r) for r in range(3))), 16)
    assert not torch.equal(other.kept, together.kept)


def test_draws_per_row_and_their_refusals():
    from kvcompose import Pipeline, TopK
    from kvcompose.blocks.cam import CAM
    from kvcompose.blocks.cur import CUR
    from kvcompose.seeding import bernoulli, draw
    from kvcompose.view import RowGenerators

    rg = lambda: RowGenerators(torch.Generator().manual_seed(s) for s in (1, 2))  # noqa: E731
    got = draw(torch.randn, (2, 3, 4), rg(), torch.device("cpu"))
    want = torch.cat([torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2)])
    assert torch.equal(got, want)
    p = torch.full((2, 5), 0.5)
    assert torch.equal(bernoulli(p, rg()),
                       torch.cat([torch.bernoulli(p[:1], generator=torch.Generator().manual_seed(s)) for s in (1, 2)]))
    with pytest.raises(KVComposeError, match="not one draw per row"):
        draw(torch.rand, (3, 4), rg(), torch.device("cpu"))
    with pytest.raises(KVComposeError, match="not one draw per row"):
        bernoulli(torch.full((5,), 0.5), rg())
    # CUR's random projection is one matrix for every row, CAM's draw width is the rows' largest: not per row
    assert not Pipeline(CUR(random_projection=True), TopK()).draws_per_row
    assert not CAM.draws_per_row
    assert Pipeline(CUR(), TopK()).draws_per_row  # draws nothing: nothing to refuse
