"""The decode path a GPU would run, proved on CPU (no GPU has run this code): over every preset, both stores
and each tier,

- (a) device discipline: under `torch.set_default_device("meta")` every tensor kvcompose creates still lands on
  the data's device (a tensor made without one would be a meta tensor; a function mode catches it);
- (b) a host-sync budget: a function mode counts, from kvcompose's own frames, every call that makes the host
  wait for the device (`item`, `tolist`, `__bool__`, `__int__`, `__float__`, `__index__`, `cpu`, `numpy`,
  `nonzero`, `masked_select`, `unique`, boolean-mask indexing): none on an ordinary decode step of the dense
  and the paged store and with a tier, one per forward at most when the forward passes a padding mask, and
  the ones of compression events are counted and reported;
- (c) memory: after a step no tensor of the size of the padded KV is alive (weak references to every padded
  view and merged path the step built), and `del cache` frees the stores without `gc.collect()`;
- bit-identity of tiered and all-HBM decoding (float32 and bfloat16), with the mask rule: a decode step over
  tokens that are all real and equally long attends unmasked, whether they come from HBM or from a tier.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvcompose import (BlockGranular, CompressedTier, HeadUtility, Hierarchy, HostTier, KVComposeCache, Uniform,
                       methods)
from kvcompose import attention_math, path as kpath
from kvcompose.methods import with_allocator, with_tier
from kvcompose.testing import tiny_model
from kvcompose.stores import PagedStore

from helpers import ratio_curves

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET, INTERVAL, PROMPT, STEPS = 96, 8, 100, 36
PRESETS = sorted(methods.PRESETS)
# the presets ported from kvpress (methods.PORTED), at sizes this test reaches; the calibrated ones get a profile of
# the tiny model (2 layers, 2 KV heads); every one is in the host-sync and device tests on its natural store, the
# mergers also with a host tier (the tokens a tier holds are not merged)
PORTED = sorted(methods.PORTED)
_PORTED_KW = {"lagkv": {"lag": 16}, "chunkkv": {"chunk": 8}, "noncausal_attention": {"chunk": 32, "window": 32},
              "compactor": {"chunk": 32, "window": 32},
              "duo_attention": {"profile": {"head_scores": [[0.9, 0.1], [0.2, 0.8]]}},
              "lukv": {"curves": ratio_curves(2, 2, seed=0)}}
TIERS = {"host": HostTier, "compressed": lambda: CompressedTier(bits=8, key_group=8, value_group=8),
         "hierarchy": lambda: Hierarchy(compressed_ratio=0.25, evict_ratio=0.0,
                                        compressed=CompressedTier(bits=8, key_group=8, value_group=8))}
_MODEL: dict = {}


def _model(dtype=torch.float32):
    if dtype not in _MODEL:
        _MODEL[dtype] = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, dtype=dtype)
    return _MODEL[dtype]


def _pipeline(name: str, store: str = "natural", tier: str | None = None):
    """A preset on its own store ("natural"), or moved to paged storage ("paged": per-head budgets where the
    allocator allows, else block-granular selection, which also gives heads unequal lengths)."""
    if name in methods.PORTED:
        pipe = methods.preset(name, model=_model(), **_PORTED_KW.get(name, {}))
    else:
        pipe = methods.PRESETS[name]()
    if store == "paged" and not pipe.paged and pipe.compresses:
        if isinstance(pipe.allocator, Uniform) and pipe.fixed_protection(BUDGET * 3 // 4) <= BUDGET * 3 // 4:
            pipe = with_allocator(pipe, HeadUtility(floor=0.75, window=8, page_size=8))
        else:
            pipe = pipe.replace(BlockGranular(pipe.selector, block=4), name=f"{pipe!r} + BlockGranular")
    if tier is not None and pipe.compresses:
        pipe = with_tier(pipe, TIERS[tier]())
    return pipe


def _combos():
    out = []
    for name in PRESETS:
        out.append((name, "natural", None))
        if not methods.PRESETS[name]().paged and name != "full":
            out.append((name, "paged", None))
        if name != "full":
            out += [(name, "natural", t) for t in TIERS]
    out += [("h2o", "paged", "host"), ("snapkv", "paged", "hierarchy")]
    out += [(name, "natural", None) for name in PORTED] + [("cam", "natural", "host"), ("merging", "natural", "host")]
    return out


def _ids(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ frames
_SKIP = ("/torch/", "/jaxtyping/", "/beartype/", "/typing.py", "/contextlib.py", "/functools.py")


def _from_kvcompose() -> bool:
    """Whether the torch call being handled was made by kvcompose's own code (its first frame outside
    torch and the type-checking wrappers is in the package)."""
    f = sys._getframe(2)
    while f is not None and any(s in f.f_code.co_filename.replace("\\", "/") for s in _SKIP):
        f = f.f_back
    if f is None:
        return False
    name = f.f_code.co_filename.replace("\\", "/")
    return "/kvcompose/" in name and "/tests/" not in name


_SYNCS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
                    "masked_select", "unique", "unique_consecutive", "argwhere", "bincount"})


def _bool_index(idx) -> bool:
    if isinstance(idx, torch.Tensor):
        return idx.dtype == torch.bool and idx.dim() > 0
    if isinstance(idx, (tuple, list)):
        return any(_bool_index(i) for i in idx)
    return False


class HostSyncs(TorchFunctionMode):
    """Counts the calls from kvcompose frames that wait for the device (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        sync = name in _SYNCS or (name == "where" and len(args) == 1 and not kwargs)
        sync = sync or (name in ("__getitem__", "__setitem__") and len(args) > 1 and _bool_index(args[1]))
        if sync and _from_kvcompose():
            self.count += 1
            f = sys._getframe(1)
            while f is not None and "/kvcompose/" not in f.f_code.co_filename.replace("\\", "/"):
                f = f.f_back
            self.where.append(f"{name} at {f.f_code.co_name}:{f.f_lineno}" if f else name)
        return func(*args, **(kwargs or {}))


class CreatedOnMeta(TorchFunctionMode):
    """Records every meta tensor that a kvcompose frame receives from a torch call (under
    `torch.set_default_device("meta")`, a tensor made without a device)."""

    def __init__(self):
        super().__init__()
        self.bad: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in outs) and _from_kvcompose():
            self.bad.append(getattr(func, "__name__", str(func)))
        return out


# ------------------------------------------------------------------------------------------ decode
@torch.no_grad()
def _decode(model, cache, ids, steps, mask=False, each=None):
    """Teacher-forced decoding: the prompt, then `steps` tokens one at a time. `each(step, cache)` may wrap every
    forward (a context manager factory). Returns the logits of every forward `[steps + 1, vocab]`."""
    n = ids.shape[1]
    kw = lambda t: {"attention_mask": torch.ones(1, t, dtype=torch.long)} if mask else {}  # noqa: E731
    logits = [model(input_ids=ids[:, :PROMPT], past_key_values=cache, **kw(PROMPT)).logits[0, -1]]
    for t in range(PROMPT, min(n, PROMPT + steps)):
        ctx = each(t) if each is not None else None
        if ctx is not None:
            with ctx:
                out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, **kw(t + 1))
        else:
            out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, **kw(t + 1))
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


def _cache(model, pipe, **kw):
    return KVComposeCache(model, pipe, BUDGET if pipe.compresses else None, interval=INTERVAL, **kw)


# ------------------------------------------------------------------------------------------ (b) host syncs
def _step_counter(cache, counts: list):
    """A context manager class for `_decode(each=...)`: counts the host syncs of each step into `counts` as
    `(syncs, whether the step ran a compression event, where they came from)`."""

    class Step:
        def __init__(self, t):
            self.mode = HostSyncs()
            self.events = cache.stats.compress_calls

        def __enter__(self):
            self.mode.__enter__()

        def __exit__(self, *exc):
            self.mode.__exit__(*exc)
            counts.append((self.mode.count, cache.stats.compress_calls > self.events, self.mode.where))

    return Step


@pytest.mark.parametrize("name, store, tier", _combos())
def test_no_host_sync_on_ordinary_decode_steps(name, store, tier):
    """Zero host syncs from kvcompose on every decode step without a compression event (and without a padding
    mask); events may sync, and are counted. Fails on the old core (9 syncs per layer in the paged store,
    GrowPage's `bool(rows.any())`, the prefetcher's width)."""
    model = _model()
    cache = _cache(model, _pipeline(name, store, tier))
    ids = _ids(PROMPT + STEPS)
    counts = []
    _decode(model, cache, ids, STEPS, each=_step_counter(cache, counts))
    ordinary = [(c, w) for c, ev, w in counts if not ev]
    events = [c for c, ev, _ in counts if ev]
    assert ordinary, "every step ran an event: the test would prove nothing"
    assert all(c == 0 for c, _ in ordinary), [w for c, w in ordinary if c][:1]
    if name != "full":
        assert events, f"{name} never compressed in {STEPS} steps"
    print(f"{name}/{store}/{tier}: {len(ordinary)} ordinary steps with 0 syncs; events: {len(events)} steps, "
          f"{sum(events)} syncs ({max(events, default=0)} at most in one step)")


@pytest.mark.parametrize("name, store, tier", [("snapkv", "natural", None), ("h2o", "paged", None),
                                               ("growpage", "natural", None), ("h2o", "natural", "host")])
def test_a_padding_mask_costs_one_sync_per_forward(name, store, tier):
    """With the 2-D padding mask generate passes, an ordinary step costs exactly one host sync per forward
    (whether the new tokens include padding), not one per layer."""
    model = _model()
    cache = _cache(model, _pipeline(name, store, tier))
    counts = []
    _decode(model, cache, _ids(PROMPT + 24), 24, mask=True, each=_step_counter(cache, counts))
    ordinary = [c for c, ev, _ in counts if not ev]
    assert ordinary and all(c == 1 for c in ordinary), ordinary


@pytest.mark.parametrize("tier", ["host", "evict"])
def test_tree_cache_decode_steps_have_no_host_sync(tier):
    """The tree cache's own per-forward work (ids and padding recorded on the device, accounting and the
    budget check from host mirrors) adds no host sync to a decode step over a path of several nodes."""
    from kvcompose import BranchCache, Evict

    model = _model()
    cache = BranchCache(model, budget=200, keep=0.25, tier=HostTier() if tier == "host" else Evict(),
                        active_budget=64, interval=INTERVAL)
    ids = _ids(60)
    counts = []
    with torch.no_grad():
        model(input_ids=ids[:, :30], past_key_values=cache)
        cache.switch(cache.fork(0))
        for t in range(30, 60):
            mode, events = HostSyncs(), cache.stats.compress_calls
            with mode:
                model(input_ids=ids[:, t : t + 1], past_key_values=cache)
            if cache.stats.compress_calls == events:
                counts.append(mode.count)
    assert cache.memory().nodes >= 2 and counts and all(c == 0 for c in counts), counts


# ------------------------------------------------------------------------------------------ (a) devices
@pytest.mark.parametrize("name, store, tier", [c for c in _combos() if c[2] in (None, "hierarchy")])
def test_every_tensor_the_cache_creates_follows_the_data(name, store, tier):
    """Under `torch.set_default_device("meta")` (the model and the inputs on the CPU), no torch call made by
    kvcompose returns a meta tensor, and the logits equal those of a run without the meta default."""
    model = _model()
    ids = _ids(PROMPT + 20)
    want = _decode(model, _cache(model, _pipeline(name, store, tier)), ids, 20)
    watch = CreatedOnMeta()
    torch.set_default_device("meta")
    try:
        with watch:
            got = _decode(model, _cache(model, _pipeline(name, store, tier)), ids, 20)
    finally:
        torch.set_default_device(None)
    assert watch.bad == []
    assert got.device.type == "cpu" and torch.equal(got, want)


def test_the_meta_watch_can_fail():
    """The watch sees a tensor created without a device from a kvcompose frame."""
    watch = CreatedOnMeta()
    torch.set_default_device("meta")
    try:
        with watch:
            attention_math.build_mask(torch.zeros(1, 1, 3, dtype=torch.long, device="cpu"),
                                      torch.ones(1, 1, 3, dtype=torch.bool, device="cpu"),
                                      torch.arange(2, 3))  # the query positions land on meta
    except (RuntimeError, NotImplementedError):
        pass
    finally:
        torch.set_default_device(None)
    assert watch.bad


# ------------------------------------------------------------------------------------------ (c) memory
def test_no_padded_copy_outlives_a_step(monkeypatch):
    """Every padded view a paged store gathers and every merged path view is gone once the step returns (the
    old paged store kept its padded view until the next append: about the KV's size again)."""
    refs: list = []
    view, gather = PagedStore.view, kpath.gather

    def watched_view(self):
        v = view(self)
        refs.extend(weakref.ref(t) for t in v)
        return v

    def watched_gather(*a, **k):
        tokens = gather(*a, **k)
        refs.append(weakref.ref(tokens))
        refs.extend(weakref.ref(t) for t in (tokens.keys, tokens.values))
        return tokens

    monkeypatch.setattr(PagedStore, "view", watched_view)
    monkeypatch.setattr(kpath, "gather", watched_gather)
    import kvcompose.layer as klayer
    monkeypatch.setattr(klayer, "gather", watched_gather)
    model = _model()
    for pipe in (_pipeline("h2o", "paged"), _pipeline("reason_alloc"), _pipeline("snapkv", "natural", "host")):
        cache = _cache(model, pipe)
        gc.disable()
        try:
            _decode(model, cache, _ids(PROMPT + 20), 20)
            assert refs, "no padded view was built: the test would prove nothing"
            alive = [r for r in refs if r() is not None]
            assert not alive, f"{len(alive)} padded tensors outlived the step ({pipe!r})"
        finally:
            gc.enable()
        refs.clear()


@pytest.mark.parametrize("name, store, tier", [("h2o", "natural", None), ("reason_alloc", "natural", None),
                                               ("snapkv", "natural", "hierarchy"), ("h2o", "paged", "host")])
def test_del_cache_frees_the_stores_without_the_garbage_collector(name, store, tier):
    """No reference cycle holds a cache's KV: with the collector off, `del cache` frees every store."""
    model = _model()
    gc.collect()
    gc.disable()
    try:
        cache = _cache(model, _pipeline(name, store, tier))
        _decode(model, cache, _ids(PROMPT + 12), 12)
        stores = [weakref.ref(layer.segment.store) for layer in cache.layers]
        keys = [weakref.ref(t) for layer in cache.layers for t in (layer.segment.store.lengths,)]
        assert all(r() is not None for r in stores)
        del cache
        assert all(r() is None for r in stores + keys)
    finally:
        gc.enable()


def test_del_tree_cache_frees_its_nodes_without_the_garbage_collector():
    from kvcompose import BranchCache

    model = _model()
    gc.collect()
    gc.disable()
    try:
        cache = BranchCache(model, budget=48, keep=0.25)
        with torch.no_grad():
            model(input_ids=_ids(20), past_key_values=cache)
            a = cache.fork(0)
            cache.switch(a)
            model(input_ids=_ids(8, 1), past_key_values=cache)
        stores = [weakref.ref(s.store) for n in cache._all_nodes() for s in n.segs if s.store is not None]
        assert len(stores) >= 4
        del cache
        assert all(r() is None for r in stores)
    finally:
        gc.enable()


# ------------------------------------------------------------------------------------------ tiers vs HBM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiered_and_all_hbm_decoding_are_bit_identical_and_unmasked(dtype, monkeypatch):
    """The same tokens evicted, the rest all in HBM or three quarters in host memory: logits bit-identical
    at every step (float32 and bfloat16), and every ordinary decode step attends unmasked in both runs (the
    old merge always built an all-True mask, which on a GPU picks another SDPA kernel)."""
    masks: list = []
    attend = attention_math.attend

    def spy(query, keys, values, mask, *a, **k):
        masks.append((query.shape[2], mask is None))
        return attend(query, keys, values, mask, *a, **k)

    monkeypatch.setattr(attention_math, "attend", spy)
    model = _model(dtype)
    ids = _ids(PROMPT + STEPS)
    runs = []
    for hbm in (0.75, 0.25):  # evict 0.25 of the tokens seen in both; 0.75 = everything kept is in HBM
        masks.clear()
        cache = KVComposeCache(model, methods.memory_hierarchy(hbm, evict_ratio=0.25, recent=4), interval=INTERVAL)
        logits = _decode(model, cache, ids, STEPS)
        host = cache.memory().by_tier["host"]
        runs.append((logits, host, [unmasked for q, unmasked in masks if q == 1]))
    (a, host_a, un_a), (b, host_b, un_b) = runs
    assert host_a == 0 and host_b > 0  # the second run really attends tier tokens
    assert torch.equal(a, b)
    assert un_a and all(un_a) and all(un_b) and len(un_a) == len(un_b)


def test_a_tier_without_host_counts_is_still_attended():
    """A third-party tier that does not mirror its counts on the host (`TierStore.counts` None) is fetched and
    sized on the device instead of being skipped: its tokens still count, exactly."""

    class NoMirror(HostTier):
        def store(self, *args, **kwargs):
            state = super().store(*args, **kwargs)
            state.pop("counts", None)
            return state

    model = _model()
    ids = _ids(PROMPT + 12)
    full = _decode(model, _cache(model, methods.full()), ids, 12)
    cache = _cache(model, with_tier(methods.h2o(), NoMirror()))
    got = _decode(model, cache, ids, 12)
    assert cache.memory().by_tier["host"] > 0
    assert torch.equal(got, full)
