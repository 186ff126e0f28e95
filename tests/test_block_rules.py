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
from hypothesis import example, given, settings
from hypothesis import strategies as st

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
from kvcompose.bench.paged_blocks import BlockProtectValueNorm, RequestBlocks, RequestEvent, RequestSchedule, VotingValueProtect
from kvcompose.reco.eviction import Lexicographic, StepReplay, StepRewardScore
from kvcompose.seeding import derived_seed
from zoo import PORTED, PRESETS, ids as _ids, variant

from helpers import examples, random_view, ratio_curves, tree_model

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = tree_model()
ROPE, PROJ = Rotary.from_model(MODEL), OutputProjection.from_model(MODEL)
STORES, TIERS = ("dense", "paged"), ("evict", "host", "hierarchy")
CASES = {**{k: v for k, v in PRESETS.items()}, **{k: (lambda f: lambda: f(MODEL))(v) for k, v in PORTED.items()}}
"""name -> a builder of every preset (methods.PRESETS and methods.PORTED), scaled to the tiny model."""


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
_CURVES = {"prune": ratio_curves(2, 2, seed=0)}
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


@pytest.mark.parametrize("base, hook", [("Scorer", "score"), ("Protector", "protect"), ("Selector", "priority")])
def test_a_block_that_overrides_call_is_refused_where_it_is_defined(base, hook):
    """The pipeline calls a block's `apply`, which calls the role's hook: a subclass that implements `__call__`
    instead would never run (a scorer failed with a bare NotImplementedError at its first event), so defining
    one is refused with the hook to implement."""
    import kvcompose

    with pytest.raises(TypeError, match=f"overrides __call__.*a {base} implements {hook}"):
        type("Mine", (getattr(kvcompose, base),), {"__call__": lambda self, *a, **k: None})


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


@pytest.mark.parametrize("name", sorted(BLOCK_PIPELINES))
def test_every_block_that_draws_per_row_draws_for_each_row_what_it_draws_alone(name):
    """`draws_per_row` (the vLLM route groups requests on it): with one generator per row (`RowGenerators`), a view
    of 3 rows keeps for each row what the row alone keeps with its own generator. A pipeline that draws otherwise
    must not declare it; one that draws nothing has nothing to promise."""
    from kvcompose.view import RowGenerators

    pipe = BLOCK_PIPELINES[name]()
    if not (pipe.draws_random and pipe.draws_per_row):
        return
    view = replace(random_view(b=3, h=2, t=40, d=16, g=2, w=8, prompt=10, seed=5, layer_idx=1, cache_budget=16),
                   num_layers=2)
    gens = lambda: [torch.Generator().manual_seed(40 + r) for r in range(3)]  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        together, _ = pipe.select(replace(view, generator=RowGenerators(gens())), 16)
        for r, g in enumerate(gens()):
            cut = {f: getattr(view, f)[r:r + 1] for f in ("keys", "values", "positions", "valid", "queries",
                                                          "query_valid")}
            alone, _ = pipe.select(replace(view, generator=g, **cut), 16)
            assert torch.equal(together.kept[r], alone.kept[0]), (name, r)
            if together.values is not None:
                assert torch.equal(together.values[r], alone.values[0]), (name, r)


# ------------------------------------------------------------------------------------------------ padded rows
def _pad_row(alone, pad: int, seed: int, slots: bool):
    """A batch of two rows whose row 0 is `alone`'s row with `pad` tokens of left padding: with `slots`, the padding
    slots are still held (before a first event: valid False, positions 0..pad-1, keys of garbage); without, they
    were never kept (after an event) and row 0 ends with empty slots where the other row holds more."""
    b, h, t, d = alone.keys.shape
    w = alone.queries.shape[2]
    extra = pad if slots else 3
    other = random_view(b=1, h=h, t=t + extra, d=d, g=alone.groups, w=w, prompt=alone.prompt_length + pad,
                        seen=alone.seen + pad, seed=seed + 100)
    g = torch.Generator().manual_seed(seed + 200)
    junk = lambda *s: torch.randn(*s, generator=g) * 3  # noqa: E731
    if slots:
        keys0 = torch.cat([junk(1, h, pad, d), alone.keys], 2)
        values0 = torch.cat([junk(1, h, pad, alone.values.shape[-1]), alone.values], 2)
        pos0 = torch.cat([torch.arange(pad).expand(1, h, pad), alone.positions + pad], 2)
        valid0 = torch.cat([torch.zeros(1, h, pad, dtype=torch.bool), alone.valid], 2)
    else:
        keys0 = torch.cat([alone.keys, junk(1, h, extra, d)], 2)
        values0 = torch.cat([alone.values, junk(1, h, extra, alone.values.shape[-1])], 2)
        far = torch.full((1, h, extra), 2**40, dtype=torch.long) + torch.arange(extra)
        pos0 = torch.cat([alone.positions + pad, far], 2)
        valid0 = torch.cat([alone.valid, torch.zeros(1, h, extra, dtype=torch.bool)], 2)
    return replace(
        alone, keys=torch.cat([keys0, other.keys]), values=torch.cat([values0, other.values]),
        positions=torch.cat([pos0, other.positions]), valid=torch.cat([valid0, other.valid]),
        prompt_length=alone.prompt_length + pad, queries=torch.cat([alone.queries, other.queries]),
        query_positions=alone.query_positions + pad, query_valid=torch.cat([alone.query_valid, other.query_valid]),
        seen=alone.seen + pad, padding=torch.tensor([pad, 0]), generator=torch.Generator().manual_seed(seed))


def _row0(pipe, view, sel, shift: int) -> dict:
    """What row 0 keeps, as positions of its own (left padding not counted): per head the kept positions, the
    ranking of its real tokens (when the pipeline ranks them all), its budget, how many the tier retains and the
    merged values of its kept tokens."""
    b, h, t = view.shape
    out: dict = {"budget": sel.budget[0].tolist(), "kept": [], "order": [], "values": []}
    for head in range(h):
        k = sel.kept[0, head]
        k = k[k >= 0]
        real = view.valid[0, head, k]
        out["kept"].append((view.positions[0, head, k][real] - shift).tolist())
        if sel.values is not None:
            out["values"].append(sel.values[0, head, k][real])
        if sel.order is not None:
            o = sel.order[0, head]
            out["order"].append((view.positions[0, head, o][view.valid[0, head, o]] - shift).tolist())
    if pipe.tier.holds_tokens:
        n_kept = (sel.kept >= 0).sum(-1)
        out["retained"] = pipe.tier.retained(view.valid.sum(-1), n_kept, view.row_seen[:, None], sel.protected)[0].tolist()
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_padded_row_keeps_what_the_row_alone_keeps(name):
    """For every preset on both stores and each tier, one compression event on a view of a row alone and on a batch
    whose row 0 is that row with left padding (padding slots held, or already gone): row 0 keeps the same tokens,
    ranks its real tokens the same way, gets the same budget, the tier retains as many and a merger gives the
    same values. A preset that cannot (random draws depend on the batch's shape; GrowPage's pool and SeenShare's
    HBM share are the batch's) says why in `Pipeline.padded_rows_note` (a cache warns it at a padded forward, and
    docs/methods.md lists them)."""
    for store in STORES:
        for tier in TIERS:
            pipe = variant(CASES[name](), store, tier)
            if not pipe.compresses:
                continue
            if pipe.padded_rows_note() is not None:
                continue  # documented exception: checked by test_padded_row_exceptions_are_named
            for layer in (0, 1):
                for pad, slots in ((3, True), (5, False)):
                    alone = replace(random_view(b=1, h=2, t=40, d=16, g=2, w=8, prompt=10, seed=layer + pad,
                                                layer_idx=layer, cache_budget=16), num_layers=2)
                    alone = replace(alone, generator=torch.Generator().manual_seed(1))
                    batch = _pad_row(alone, pad, seed=layer + pad, slots=slots)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        a = _row0(pipe, alone, pipe.select(alone, 16)[0], 0)
                        p = _row0(pipe, batch, pipe.select(batch, 16)[0], pad)
                    where = f"{pipe!r} ({store}, {tier}, layer {layer}, padding {pad}, {'slots' if slots else 'gone'})"
                    for key in ("budget", "kept", "order", "retained"):
                        assert a.get(key) == p.get(key), f"{where}: row 0's {key} differs from the row alone's"
                    for va, vp in zip(a["values"], p["values"]):
                        torch.testing.assert_close(va, vp, msg=f"{where}: merged values differ")


def _held_by_row(cache, row: int, shift: int) -> list:
    """Per layer, what row `row` holds: per head the positions of its real tokens in HBM and in the tier, counted
    from the row's first token."""
    out = []
    for i, layer in enumerate(cache.layers):
        pos, valid = cache.kept_positions(i)[row], layer.valid[row]
        hbm = [sorted((pos[h][(pos[h] >= 0) & valid[h, : pos.shape[-1]]] - shift).tolist()) for h in range(pos.shape[0])]
        tier = []
        if layer.config.pipeline.tier.holds_tokens and layer.segment.tier:
            tt = layer.config.pipeline.tier.fetch(layer.segment.tier)
            if tt is not None:
                tier = [sorted((tt.positions[row, h][tt.valid[row, h]] - shift).tolist()) for h in range(tt.positions.shape[1])]
        out.append((hbm, tier))
    return out


PADDED_CASES = {
    # the cases: LU-KV's ratio counted the padding, ChunkKV cut its chunks from the padded start, and the
    # hierarchy's shares were of the tokens seen with padding; HeadUtility and DuoHeads for their head budgets
    "lukv": lambda: CASES["lukv"](),
    "chunkkv": lambda: CASES["chunkkv"](),
    "duo_attention": lambda: CASES["duo_attention"](),
    "reason_alloc": lambda: CASES["reason_alloc"](),
    "h2o+hierarchy": lambda: variant(CASES["h2o"](), "dense", "hierarchy"),
}


@pytest.mark.parametrize("name", sorted(PADDED_CASES))
def test_padded_row_keeps_what_the_row_alone_keeps_end_to_end(name):
    """Through a cache: a batch whose row 0 has 3 tokens of left padding is decoded greedily; the row alone,
    teacher-forced on row 0's tokens, holds the same tokens in every layer and head (HBM and tier) at the end."""
    pipe = PADDED_CASES[name]()
    pad, prompt, new = 3, 12, 28
    ids = _ids(prompt, seed=0, rows=2)
    mask = torch.ones(2, prompt, dtype=torch.long)
    ids[0, :pad], mask[0, :pad] = 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = KVComposeCache(MODEL, pipe, budget=16, interval=4)
        out = MODEL.generate(input_ids=ids, attention_mask=mask, past_key_values=batch, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False)
        alone = KVComposeCache(MODEL, pipe, budget=16, interval=4)
    seq = out[:1, pad:]
    with torch.no_grad():
        MODEL(input_ids=seq[:, : prompt - pad], past_key_values=alone)
        for t in range(prompt - pad, seq.shape[1] - 1):
            MODEL(input_ids=seq[:, t : t + 1], past_key_values=alone)
    assert min(layer.events for layer in batch.layers) > 1
    assert _held_by_row(batch, 0, pad) == _held_by_row(alone, 0, 0)


# ---------------------------------------------------------------------------------------------- copies and weights
def _wide_model():
    """The tests' tiny model with its KV shapes (2 layers, 4 query and 2 KV heads of 16) but 4x the hidden size and
    8x the MLP: about 5x the parameter bytes, the same cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=256, head_dim=16, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    return LlamaForCausalLM(cfg).eval()


WIDE = _wide_model()


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _own_tensor_bytes(obj, model) -> int:
    """Bytes of the tensor storages reachable from `obj` that are not the model's parameters (a model reached on the
    way is not walked: a cache shares it)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen_objs: set[int] = set()
    storages: dict[int, int] = {}
    todo = [obj]
    while todo:
        x = todo.pop()
        if id(x) in seen_objs or isinstance(x, (torch.nn.Module, type, str, bytes, int, float, bool, type(None))):
            continue
        seen_objs.add(id(x))
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
            continue
        if isinstance(x, dict):
            todo += list(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            todo += list(x)
        elif hasattr(x, "__dict__"):
            todo += list(vars(x).values())
    return sum(storages.values())


def _decoded_cache(model, pipe):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = KVComposeCache(model, pipe, budget=16, interval=4)
    ids = _ids(28)
    with torch.no_grad():
        model(input_ids=ids[:, :12], past_key_values=cache)
        for t in range(12, 28):
            model(input_ids=ids[:, t : t + 1], past_key_values=cache)
    return cache


@pytest.mark.parametrize("name", sorted(CASES))
def test_copies_never_copy_model_weights(name):
    """For every preset on both stores and each tier, a decoded cache on the tests' tiny model and on a model with
    the same KV shapes but about 5x the parameter bytes: the pickled cache (also what `torch.save` writes) and the
    tensors a `copy.deepcopy` owns have the same size on both (a copy never copies a weight), and the copy decodes
    (its blocks take the weights they read from the shared model again). `criticalkv` carried every layer's
    `o_proj` weights in each copy, pickle and vLLM config."""
    import copy
    import pickle

    assert _param_bytes(WIDE) > 4 * _param_bytes(MODEL)
    build = PORTED.get(name)
    for store in STORES:
        for tier in TIERS:
            sizes, owned = [], []
            for model in (MODEL, WIDE):
                pipe = variant(build(model) if build is not None else PRESETS[name](), store, tier)
                sizes.append(len(pickle.dumps(pipe)))
                cache = _decoded_cache(model, pipe)
                sizes.append(len(pickle.dumps(cache)))
                dup = copy.deepcopy(cache)
                owned.append(_own_tensor_bytes(dup, model))
                with torch.no_grad():
                    model(input_ids=_ids(1, seed=5), past_key_values=dup)  # the copy decodes
            where = f"{name} ({store}, {tier})"
            assert abs(sizes[0] - sizes[2]) < 512, f"{where}: the pickled pipeline grows with the model's weights: {sizes}"
            assert abs(sizes[1] - sizes[3]) < 4096, f"{where}: the pickled cache grows with the model's weights: {sizes}"
            assert abs(owned[0] - owned[1]) < 4096, f"{where}: a deep copy owns weight-sized tensors: {owned}"


# ------------------------------------------------------------------------------------------------- profiles
def test_profile_numbers_are_checked():
    """Profiles are refused by name when they cannot work: HeadCurves curves that ignore their ratios (all zero: every
    head kept every token at budget 8, silently), DuoHeads scores that are NaN or not numbers (a raw torch error)."""
    from kvcompose import KVComposeError, methods

    with pytest.raises(KVComposeError, match=r"do not follow their ratios: row 98 \(ratio 99%\) prunes 0%"):
        HeadCurves({"prune": [[[0.0, 0.0], [0.0, 0.0]]] * 99})
    with pytest.raises(KVComposeError, match="do not follow their ratios"):
        methods.lukv({"prune": [[[0.5, 0.5], [0.5, 0.5]]] * 99}, base=methods.keydiff())
    HeadCurves({"prune": ratio_curves(2, 2, seed=3)})  # curves that follow their ratios
    for bad, shown in ((float("nan"), "nan"), ("x", "'x'"), (None, "None"), (True, "True"), (float("inf"), "inf")):
        with pytest.raises(KVComposeError, match=rf"head_scores\[1\]\[0\] is {shown}, not a finite number"):
            DuoHeads({"head_scores": [[0.9, 0.1], [bad, 0.8]]})


def test_profiles_and_model_data_of_another_model_are_refused():
    """A profile calibrated on one model, or `criticalkv(model=...)` built from it, used with another model of the same
    shape (the tests' tiny model with other random weights): refused when the cache is built, naming the cause;
    the same profile on its own model works. Before, each was accepted silently."""
    from kvcompose import KVComposeError, methods
    from kvcompose.calibration import calibrate_reasoning_wave
    from kvcompose.head_calibration import calibrate_heads
    from kvcompose.testing import tiny_model

    other = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, seed=7)  # same shape, other weights
    g = torch.Generator().manual_seed(3)
    prompts, traces = [torch.randint(3, 128, (12,), generator=g)], [torch.randint(3, 128, (40,), generator=g)]
    duo = calibrate_heads(MODEL, prompts, traces, kind="duo", sinks=2, recent=8)
    curves = calibrate_heads(MODEL, prompts, traces, kind="lukv", window=4)
    wave = calibrate_reasoning_wave(MODEL, prompts, traces=traces)
    pipes = {
        "duo": lambda: methods.duo_attention(duo, sinks=2),
        "lukv": lambda: methods.lukv(curves, base=methods.keydiff(), sinks=2),
        "wave": lambda: methods.reason_alloc(methods.rkv(window=2, kernel=3), profile=wave, window=4, page_size=4,
                                             floor=0.5),
        "criticalkv": lambda: methods.criticalkv(MODEL),
    }
    same_bf16 = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, dtype=torch.bfloat16)  # MODEL's weights
    for name, make in pipes.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            KVComposeCache(MODEL, make(), budget=16)  # its own model
            KVComposeCache(same_bf16, make(), budget=16)  # its own weights in another dtype
            with pytest.raises(KVComposeError, match="another model|another model's"):
                KVComposeCache(other, make(), budget=16)
    assert "weights" in duo["fingerprint"] and "weights" in curves["fingerprint"] and "weights" in wave["fingerprint"]
    # the shipped ReasonAlloc profile is found by the whole architecture: a model with SmolLM2's 30 layers and 3 KV
    # heads but another width gets none (before: SmolLM2's, matched by its layer and KV-head counts)
    shaped = tiny_model("llama", layers=30, heads=3, kv_heads=3, head_dim=16)
    with pytest.warns(UserWarning, match="no shipped ReasoningWave profile matches"):
        cache = KVComposeCache(shaped, methods.reason_alloc(), budget=64)
    assert cache.pipeline.allocator.layers.resolve(30, 3) is None


def test_calibrate_duo_refuses_traces_inside_the_window(tmp_path, capsys):
    """`kvcompose calibrate --target duo` on traces no longer than the streaming window exited 0 and wrote all-zero
    scores (no query sees a token outside the window): now exit 2, one line, no file."""
    import json

    from kvcompose import cli
    from kvcompose.testing import save_tiny_chat_model

    tiny = save_tiny_chat_model(tmp_path / "model")
    capsys.readouterr()
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "What is 1 plus 1?", "answer": "#### 2"}))
    out = tmp_path / "duo.json"
    code = cli.main(["calibrate", "--target", "duo", "--model", tiny, "--data", str(data), "--n", "1", "--offset", "0",
                     "--new-tokens", "4", "--kind", "greedy", "--recent", "200", "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("loading")]
    assert code == 2 and not out.exists()
    assert len(err) == 1 and "streaming window" in err[0] and "every head would score 0" in err[0], err


# ---------------------------------------------------------------------------------------------- closed caches
def _implementations() -> list[str]:
    out = ["sdpa", "eager"]
    try:
        from transformers.integrations.flex_attention import flex_attention_forward  # noqa: F401

        out.append("flex_attention")
    except ImportError:  # pragma: no cover - a torch without flex attention
        pass
    return out


@pytest.mark.parametrize("impl", _implementations())
@pytest.mark.parametrize("how", ["close", "restore", "switch"])
@pytest.mark.parametrize("kind", ["plain", "tree"])
def test_a_closed_cache_is_refused_by_name_on_every_implementation(impl, how, kind):
    """A cache that was closed, or whose model lost kvcompose's attention (`restore`, `set_attn_implementation`),
    is refused with a `KVComposeError` naming why at its next step, a single token or several, whatever the
    model's own implementation: before, sdpa's single-token step named it (at the next layer's update), while eager,
    flex attention and any multi-token step ended in the model's own shape error (a mask sized for the cache over
    the new keys alone). `cache.bind(model)` opens it again, and it decodes as if nothing happened."""
    import copy

    from kvcompose import BranchCache, KVComposeError, methods
    from kvcompose import attention as kattn
    from kvcompose.testing import tiny_model

    model = tiny_model("llama", layers=2, attn_implementation=impl)
    ids = _ids(16)
    if kind == "plain":
        cache = KVComposeCache(model, methods.rkv(window=2, kernel=3), budget=8, interval=4)
    else:
        cache = BranchCache(model, budget=64)
    with torch.no_grad():
        model(input_ids=ids[:, :8], past_key_values=cache)
    twin = copy.deepcopy(cache)  # never closed: what the cache decodes once opened again
    if how == "close":
        cache.close()
        want = "was closed"
    elif how == "restore":
        kattn.restore(model)
        want = "no longer uses kvcompose's attention implementation"
    else:
        model.set_attn_implementation("eager" if impl != "eager" else "sdpa")
        want = "no longer uses kvcompose's attention implementation"
    for step in (ids[:, 8:9], ids[:, 8:12]):  # a single token, and several
        with torch.no_grad(), pytest.raises(KVComposeError, match=want):
            model(input_ids=step, past_key_values=cache)
    with pytest.raises(KVComposeError, match=want):
        model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    cache.bind(model)
    a = model.generate(input_ids=ids[:, :12], past_key_values=cache, max_new_tokens=6, do_sample=False)
    b = model.generate(input_ids=ids[:, :12], past_key_values=twin, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ head-wise row totals
@settings(max_examples=examples(40), deadline=None)
@given(kind=st.sampled_from(["heads_mass", "heads_entropy", "adakv", "unstructured_int"]), rows=st.integers(1, 3),
       heads=st.sampled_from([2, 4]), t=st.integers(8, 48), budget=st.integers(3, 24), floor=st.integers(0, 4),
       protect=st.booleans(), pad=st.integers(0, 6), bf16=st.booleans(), seed=st.integers(0, 20))
# AdaKV's floor (a share of the budget, or KVCompose's int lower bound) was added on top of the protected tokens:
# at budget 3 with 3 protected tokens per head a row of 4 heads kept 15 tokens of its total of 12
@example(kind="adakv", rows=1, heads=4, t=20, budget=3, floor=0, protect=True, pad=0, bf16=False, seed=0)
@example(kind="unstructured_int", rows=1, heads=4, t=20, budget=3, floor=2, protect=True, pad=0, bf16=False, seed=1)
def test_head_wise_budgets_keep_the_row_total(kind, rows, heads, t, budget, floor, protect, pad, bf16, seed):
    """A head-wise split moves tokens between the heads of a row, never beyond the row's total: after one event,
    every row keeps at most `heads * budget` tokens (padded rows, bf16 included), and HeadUtility's budgets sum to
    exactly that total with every head within its budget."""
    from kvcompose import KVComposeError

    view = random_view(b=rows, h=heads, t=t, d=16, g=2, w=4, seen=t + 3, pad=[pad] * rows if pad else None, seed=seed,
                       dtype=torch.bfloat16 if bf16 else torch.float32, cache_budget=budget)
    prot = [ProtectRecent(2), ProtectSinks(1)] if protect else []
    if kind.startswith("heads"):
        alloc = HeadUtility(floor=max(floor, 1), utility="mass" if kind == "heads_mass" else "entropy", window=4)
        pipe = Pipeline(*prot, KeyNorm(), TopK(), alloc)
    else:
        pipe = Pipeline(*prot, KeyNorm(), CompositeTokens(False, floor=0.2 if kind == "adakv" else floor))
    try:
        pipe.validate(budget)
        pipe.allocator.check(pipe, budget, 2, heads)
    except KVComposeError:
        return  # refused up front (a cache would refuse it too)
    sel, _ = pipe.select(view, budget)
    kept = (sel.kept >= 0).sum(-1)
    assert bool((kept.sum(-1) <= heads * budget).all()), (kept.tolist(), heads * budget)
    if kind.startswith("heads"):
        assert sel.budget.sum(-1).tolist() == [heads * budget] * rows
        assert bool((kept <= sel.budget).all())


def test_padded_row_exceptions_are_named():
    """A preset that may keep other tokens for a left-padded row than for the row alone says why: every block with a
    `padded_rows` reason, and every block that draws, is listed in docs/methods.md ('Batches with left padding'),
    and a cache warns at the first forward of a padded batch if and only if the pipeline has such a reason."""
    from pathlib import Path

    from kvcompose import KVComposeWarning

    docs = (Path(__file__).resolve().parents[1] / "docs" / "methods.md").read_text()
    section = docs.split("## Batches with left padding")[1].split("\n## ")[0]
    ids = _ids(10, rows=2)
    mask = torch.ones(2, 10, dtype=torch.long)
    ids[0, :3], mask[0, :3] = 0, 0
    for name in sorted(CASES):
        pipe = CASES[name]()
        if not pipe.compresses:
            continue
        for b in pipe.blocks():
            if b.padded_rows or b.draws_random:
                assert f"`{type(b).__name__}" in section, f"{type(b).__name__} of {name} is not in the docs' list"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = KVComposeCache(MODEL, pipe, budget=16, interval=4)
            with torch.no_grad():
                MODEL(input_ids=ids, attention_mask=mask, past_key_values=cache)
        warned = [w for w in caught if issubclass(w.category, KVComposeWarning) and "left padding" in str(w.message)]
        assert bool(warned) == (pipe.padded_rows_note() is not None), (name, [str(w.message) for w in warned])
