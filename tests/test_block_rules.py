"""Rules every block states and these tests enforce mechanically, over every preset (`methods.PRESETS` and
`methods.PORTED`, through tests/zoo.py, on both stores and each tier) and every block class of the package:

- a block that draws random numbers says so (`draws_random`): a seeded cache's per-layer generator moves during
  decoding if and only if `pipeline.draws_random`, and no block draws from torch's global generator;
- a left-padded row of a batch keeps what the row alone keeps, or the docs and a warning say why not;
- a copy of a cache (`copy.deepcopy`, `pickle`, `torch.save`) never copies model weights;
- a profile is checked against the model it is used with (fingerprint, shape, finite numbers, its ratios).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from kvcompose import (
    AccumulatedAttention, BlockGranular, CompressedTier, Evict, GrowPage, HeadUtility, Hierarchy, HostTier,
    KeyNorm, KeyRedundancy, KVComposeCache, LastQueryAttention, Pipeline, ProjectedNorm, ProtectPrompt,
    ProtectRecent, ProtectSinks, ProtectValueNorm, Pyramid, RandomDrop, RandomScore, Recency, Sample, TopK, Uniform,
    ValueNorm, WindowedAttention,
)
from kvcompose.allocators import ReasoningWave, SeenShare
from kvcompose.block import Block
from kvcompose.blocks import (
    CAM, CAP, CUR, AggregatedAttention, Compactor, CompositeTokens, CriticalKV, DuoHeads, ExpectedAttention,
    HeadCurves, KeyDiff, LagKV, LeverageScore, MergeSimilar, NonCausalAttention, OutputProjection, Rotary,
)
from kvcompose.methods.reco import RewardAllocator
from kvcompose.paged_blocks import BlockProtectValueNorm, RequestBlocks, RequestEvent, RequestSchedule, VotingValueProtect
from kvcompose.reco.eviction import Lexicographic, StepReplay, StepRewardScore
from kvcompose.seeding import derived_seed
from zoo import PORTED, PRESETS, variant

from helpers import random_view, tree_model

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = tree_model()
ROPE, PROJ = Rotary.from_model(MODEL), OutputProjection.from_model(MODEL)
STORES, TIERS = ("dense", "paged"), ("evict", "host", "hierarchy")
CASES = {**{k: v for k, v in PRESETS.items()}, **{k: (lambda f: lambda: f(MODEL))(v) for k, v in PORTED.items()}}
"""name -> a builder of every preset (methods.PRESETS and methods.PORTED), scaled to the tiny model."""


def _ids(n: int, seed: int = 0, rows: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (rows, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- draws_random
def _generators_moved(pipe: Pipeline, seed: int = 5) -> tuple[list[bool], bool]:
    """Decode 28 tokens after a 12-token prompt through a seeded cache (budget 16, interval 4): per layer, whether
    its generator left its seeded state; and whether torch's global generator moved."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = KVComposeCache(MODEL, pipe, budget=16, interval=4, seed=seed)
    ids = _ids(40)
    before = torch.random.get_rng_state()
    with torch.no_grad():
        MODEL(input_ids=ids[:, :12], past_key_values=cache)
        for t in range(12, 40):
            MODEL(input_ids=ids[:, t : t + 1], past_key_values=cache)
    assert max(layer.events for layer in cache.layers) > 0
    moved = []
    for i, layer in enumerate(cache.layers):
        ref = torch.Generator(device=layer.device)
        ref.manual_seed(derived_seed(seed, i))
        moved.append(not torch.equal(ref.get_state(), layer.generator.get_state()))
    return moved, not torch.equal(before, torch.random.get_rng_state())


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_preset_declares_its_draws(name):
    """For every preset on both stores and each tier: the layers' seeded generators move during decoding if and only
    if the pipeline says it draws (`draws_random`, which makes the cache's `seed` warn when it has no effect), and
    torch's global generator never moves. `leverage`, `compactor`, `cam` drew without saying so."""
    for store in STORES:
        for tier in TIERS:
            pipe = variant(CASES[name](), store, tier)
            if not pipe.compresses:
                continue
            moved, global_moved = _generators_moved(pipe)
            assert not global_moved, f"{pipe!r} ({store}, {tier}) drew from torch's global generator"
            assert any(moved) == pipe.draws_random, (
                f"{pipe!r} ({store}, {tier}): the layer generators {'moved' if any(moved) else 'did not move'}, "
                f"but draws_random is {pipe.draws_random}")


class _Tracker:
    """A reward source for `RewardAllocator`: one reward per row."""

    current_rewards = [0.5, 0.5]

    def reward_of(self, row: int) -> float:
        return 0.5


def _request_blocks() -> RequestBlocks:
    event = RequestEvent(budget=16, interval=4, block=4, scope="layer")
    event.mode = "layer"  # what the event sets while it runs the per-layer decision
    return RequestBlocks(TopK(), 4, event)


_DUO = {"head_scores": [[0.9, 0.1], [0.2, 0.8]]}
_CURVES = {"prune": (torch.rand(99, 2, 2, generator=torch.Generator().manual_seed(0)) * 0.8).tolist()}
_WAVE = {"kind": "kvcompose.reasoning_wave", "demand": [1.0, 2.0]}
_REPLAY = StepReplay([3, 6], [0.2, 0.9], [0] * 10 + [1] * 10 + [2] * 30, 10)

BLOCK_PIPELINES = {
    # scorers (with TopK), protectors (with KeyNorm + TopK), selectors, allocators, mergers
    "Combined": lambda: Pipeline(0.5 * KeyNorm() - 0.5 * KeyRedundancy(), TopK()),
    "AccumulatedAttention": lambda: Pipeline(AccumulatedAttention(), TopK()),
    "WindowedAttention": lambda: Pipeline(WindowedAttention(4), TopK()),
    "ValueNorm": lambda: Pipeline(ValueNorm(), TopK()),
    "LastQueryAttention": lambda: Pipeline(LastQueryAttention(), TopK()),
    "Recency": lambda: Pipeline(Recency(), TopK()),
    "RandomScore": lambda: Pipeline(RandomScore(), TopK()),
    "ProjectedNorm(fixed)": lambda: Pipeline(ProjectedNorm(rank=4), TopK()),
    "ProjectedNorm(fresh)": lambda: Pipeline(ProjectedNorm(rank=4, fixed=False), TopK()),
    "CAP": lambda: Pipeline(CAP(ROPE, window=4, future=16), TopK()),
    "Compactor": lambda: Pipeline(Compactor(ROPE, sinks_start=2, sinks_end=2, chunk=8, sketch=8, window=8), TopK()),
    "AggregatedAttention": lambda: Pipeline(AggregatedAttention(window=4), TopK()),
    "CriticalKV": lambda: Pipeline(CriticalKV(KeyNorm(), PROJ), TopK()),
    "CUR": lambda: Pipeline(CUR(sinks=2, window=4), TopK()),
    "CUR(random_projection)": lambda: Pipeline(CUR(sinks=2, window=4, random_projection=True, rank=4), TopK()),
    "ExpectedAttention": lambda: Pipeline(ExpectedAttention(ROPE, window=4, future=16), TopK()),
    "KeyDiff": lambda: Pipeline(KeyDiff(), TopK()),
    "LagKV": lambda: Pipeline(LagKV(sinks=2, lag=4), TopK()),
    "LeverageScore": lambda: Pipeline(LeverageScore(ROPE, sketch=8), TopK()),
    "NonCausalAttention": lambda: Pipeline(NonCausalAttention(chunk=8, window=8), TopK()),
    "StepRewardScore": lambda: Pipeline(Lexicographic(StepRewardScore(_REPLAY), KeyNorm()), TopK()),
    "StepRewardScore(random)": lambda: Pipeline(StepRewardScore(_REPLAY, order="random"), TopK()),
    "ProtectPrompt": lambda: Pipeline(ProtectPrompt(limit=4), KeyNorm(), TopK()),
    "ProtectRecent": lambda: Pipeline(ProtectRecent(4), KeyNorm(), TopK()),
    "ProtectSinks": lambda: Pipeline(ProtectSinks(2), KeyNorm(), TopK()),
    "ProtectValueNorm": lambda: Pipeline(ProtectValueNorm(0.25), KeyNorm(), TopK()),
    "BlockProtectValueNorm": lambda: Pipeline(BlockProtectValueNorm(ProtectValueNorm(0.25), block=4), KeyNorm(), TopK()),
    "VotingValueProtect": lambda: Pipeline(VotingValueProtect(ProtectValueNorm(0.25), 4, RequestEvent(16, 4, block=4)),
                                           KeyNorm(), TopK()),
    "Sample": lambda: Pipeline(ValueNorm(), Sample()),
    "RandomDrop": lambda: Pipeline(RandomDrop()),
    "RandomDrop(shared)": lambda: Pipeline(RandomDrop(shared_heads=True)),
    "BlockGranular": lambda: Pipeline(KeyNorm(), BlockGranular(TopK(), block=4)),
    "BlockGranular(random)": lambda: Pipeline(BlockGranular(RandomDrop(), block=4)),
    "CompositeTokens": lambda: Pipeline(KeyNorm(), CompositeTokens()),
    "CompositeTokens(unstructured)": lambda: Pipeline(KeyNorm(), CompositeTokens(False, floor=0.2)),
    "RequestBlocks": lambda: Pipeline(KeyNorm(), _request_blocks()),
    "Uniform": lambda: Pipeline(KeyNorm(), TopK(), Uniform()),
    "GrowPage": lambda: Pipeline(KeyNorm(), TopK(), GrowPage(page=4, initial=0.5, window=8)),
    "HeadUtility": lambda: Pipeline(KeyNorm(), TopK(), HeadUtility(floor=0.5, window=4)),
    "Pyramid": lambda: Pipeline(KeyNorm(), TopK(), Pyramid(window=2, beta=2)),
    "ReasoningWave": lambda: Pipeline(KeyNorm(), TopK(), ReasoningWave(_WAVE)),
    "SeenShare": lambda: Pipeline(KeyNorm(), TopK(), SeenShare(0.5)),
    "DuoHeads": lambda: Pipeline(KeyNorm(), TopK(), DuoHeads(_DUO)),
    "HeadCurves": lambda: Pipeline(KeyNorm(), TopK(), HeadCurves(_CURVES)),
    "RewardAllocator": lambda: Pipeline(KeyNorm(), TopK(), RewardAllocator(_Tracker())),
    "RequestSchedule": lambda: Pipeline(KeyNorm(), TopK(), RequestSchedule(4)),
    "MergeSimilar": lambda: Pipeline(KeyNorm(), TopK(), MergeSimilar()),
    "CAM": lambda: Pipeline(KeyNorm(), TopK(), CAM(window=4)),
    # tiers (they get no generator; run end to end by test_every_tier_declares_its_draws)
    "Evict": lambda: Pipeline(KeyNorm(), TopK(), Evict()),
    "HostTier": lambda: Pipeline(KeyNorm(), TopK(), HostTier()),
    "CompressedTier": lambda: Pipeline(KeyNorm(), TopK(), CompressedTier(key_group=4, value_group=4)),
    "Hierarchy": lambda: Pipeline(KeyNorm(), TopK(), Hierarchy(0.2, 0.1, compressed=CompressedTier(key_group=4,
                                                                                                   value_group=4))),
    "CAM+HostTier": lambda: Pipeline(KeyNorm(), TopK(), CAM(window=4), HostTier()),
}
"""One pipeline per block class of the package (and per option that changes whether it draws)."""

_ABSTRACT = {"Block", "Scorer", "Protector", "Selector", "Allocator", "TierStore", "Merger"}


def _block_classes() -> set[type]:
    """Every concrete Block subclass defined in kvcompose (the library, not the benchmarks or the tests)."""
    import importlib
    import pkgutil

    import kvcompose

    for mod in pkgutil.walk_packages(kvcompose.__path__, "kvcompose."):
        if not any(part in mod.name for part in (".bench", ".integrations", ".cli")):
            importlib.import_module(mod.name)
    out: set[type] = set()
    todo = [Block]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if (sub.__module__.startswith("kvcompose.") and ".bench" not in sub.__module__
                    and sub.__name__ not in _ABSTRACT and not sub.__name__.startswith("_")):
                out.add(sub)
    return out


def _blocks_in(pipe: Pipeline) -> set[type]:
    """Classes of every block a pipeline holds: parts, leaves, its tier, and blocks they hold as attributes."""
    seen: set[int] = set()
    out: set[type] = set()
    todo: list = [*pipe.parts, *pipe.leaves, pipe.tier]
    while todo:
        b = todo.pop()
        if id(b) in seen:
            continue
        seen.add(id(b))
        out.add(type(b))
        todo += [v for v in vars(b).values() if isinstance(v, Block)]
        todo += [x for v in vars(b).values() if isinstance(v, (tuple, list)) for x in v if isinstance(x, Block)]
        todo += list(b.children())
    return out


def test_every_block_class_is_in_the_rule():
    """A new block class must be added to `BLOCK_PIPELINES` (so the draws rule covers it)."""
    covered = set().union(*(_blocks_in(make()) for make in BLOCK_PIPELINES.values()))
    missing = sorted(c.__name__ for c in _block_classes() - covered)
    assert not missing, f"block classes no rule test covers: {missing}: add them to BLOCK_PIPELINES"


@pytest.mark.parametrize("name", sorted(BLOCK_PIPELINES))
def test_every_block_declares_its_draws(name):
    """One compression event (`Pipeline.select`) on a random view with a seeded generator: the generator moves if
    and only if the pipeline says it draws, and torch's global generator does not move. With a tier, a cache runs
    the event end to end (a tier's `store` runs there, not in `select`)."""
    pipe = BLOCK_PIPELINES[name]()
    if pipe.tier.holds_tokens or not isinstance(pipe.tier, Evict) or isinstance(pipe.allocator, (GrowPage,
                                                                                                  RequestSchedule)):
        moved, global_moved = _generators_moved(pipe)
        assert not global_moved and any(moved) == pipe.draws_random, (moved, pipe.draws_random)
        return
    view = replace(random_view(b=2, h=2, t=40, d=16, g=2, w=8, prompt=10, seed=3, layer_idx=1, cache_budget=16),
                   num_layers=2)
    gen = view.generator
    state = gen.get_state().clone()
    before = torch.random.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.select(view, 16)
    assert torch.equal(before, torch.random.get_rng_state()), f"{pipe!r} drew from torch's global generator"
    moved = not torch.equal(state, gen.get_state())
    assert moved == pipe.draws_random, (f"{pipe!r}: one event {'moved' if moved else 'did not move'} the layer's "
                                        f"generator, but draws_random is {pipe.draws_random}")
