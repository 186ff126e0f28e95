"""Memory tiers ("Not All Thoughts Need HBM"): exact host round trips, exact merges, the compressed tier's
error bound, and the central finding: with the same evicted share, generation does not depend on how
many tokens stay in HBM."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcompose import (
    AccumulatedAttention, CompressedTier, Hierarchy, HostTier, KVComposeCache, KVComposeError, Pipeline, Prefetcher,
    ProtectPrompt, ProtectRecent, SeenShare, TierTokens, TopK, methods,
)
from kvcompose.attention import attend, build_mask
from kvcompose.methods import with_tier
from kvcompose.testing import tiny_model
from kvcompose.selectors import priority_order
from kvcompose.tiers import quantization_error_bound
from kvcompose.view import LayerSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run fastest on one thread


def _tokens(b, h, n, d, dv, dtype, seed, seen=None, state=True):
    g = torch.Generator().manual_seed(seed)
    seen = max(seen or 2 * n + 3, n)
    pos = torch.stack([torch.randperm(seen, generator=g)[:n].sort().values for _ in range(b * h)]).reshape(b, h, n)
    valid = torch.rand(b, h, n, generator=g) > 0.1
    channels = torch.rand(b, h, n, 1, generator=g) if state else torch.zeros(b, h, n, 0)  # e.g. accumulated attention
    return TierTokens(torch.randn(b, h, n, d, generator=g).to(dtype), torch.randn(b, h, n, dv, generator=g).to(dtype),
                      pos, valid, channels)


def _kept(tok: TierTokens, k: int = 0):
    """`kept [B, H]`: how many candidates stayed in HBM (the tier stores here ignore it or use it as a count)."""
    return torch.full(tok.positions.shape[:2], k, dtype=torch.long)


def _init(tier, tok: TierTokens) -> dict:
    """A tier store's fresh state for a layer holding tokens like `tok`."""
    b, h, _, d = tok.keys.shape
    return tier.init(LayerSpec(0, 1, b, h, d, tok.values.shape[-1], tok.keys.device, tok.keys.dtype))


def _assert_same(a: TierTokens, b: TierTokens):
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(a.positions, b.positions) and torch.equal(a.valid, b.valid)
    assert a.channels.shape == b.channels.shape and torch.equal(a.channels, b.channels)


# ------------------------------------------------------------------------------------------------
# host tier and merge: exact
# ------------------------------------------------------------------------------------------------
@given(b=st.integers(1, 3), h=st.integers(1, 3), n=st.integers(0, 40), d=st.sampled_from([1, 4, 16]),
       dv=st.sampled_from([2, 16]), dt=st.integers(0, 2), frac=st.floats(0.0, 1.0), seed=st.integers(0, 999))
def test_host_roundtrip_exact(b, h, n, d, dv, dt, frac, seed):
    tok = _tokens(b, h, n, d, dv, DTYPES[dt], seed)
    k = int(frac * n)
    sub = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(seed + i))[:k].sort().values
                       for i in range(b * h)]).reshape(b, h, k) if n else torch.zeros(b, h, 0, dtype=torch.long)
    part = tok.take(sub)
    tier = HostTier()
    state = tier.store(_init(tier, part), part, 10_000, _kept(part))
    got = tier.fetch(state)
    if k == 0:
        assert got is None and tier.nbytes(state)["host"] == 0
        return
    _assert_same(got, part)
    # on CPU the host store keeps its own copy: changing the caller's tensors afterwards changes nothing
    before = got.keys.clone()
    part.keys.add_(1)
    assert torch.equal(tier.fetch(state).keys, before)
    item = part.keys.element_size()
    assert tier.nbytes(state) == {"host": b * h * k * (d + dv) * item, "compressed": 0}
    # the combined store: the candidates arrive in priority order (the selector's); the best-ranked go to host
    # memory, the rest is evicted
    hier = Hierarchy(evict_ratio=0.5)
    seen = 2 * n
    scores = torch.rand(b, h, n, generator=torch.Generator().manual_seed(seed))
    order = priority_order(scores, torch.zeros_like(tok.valid), tok.valid)
    hs = hier.store(_init(hier, tok), tok.take(order), seen, _kept(tok))
    n_host, n_comp = hier.split(_kept(tok, n), _kept(tok), seen)
    # `seen - n` tokens were evicted before: the store evicts only what is still over the evicted share
    assert (n_comp == 0).all() and (n_host == min(n, seen - seen // 2)).all()
    n_host = min(n, seen - seen // 2)
    got = hier.fetch(hs)
    if n_host:
        top = order[..., :n_host].sort(-1).values  # the best-ranked, back in position order
        _assert_same(got, tok.take(top))
    else:
        assert got is None


@given(b=st.integers(1, 2), h=st.integers(1, 3), g=st.integers(1, 3), t=st.integers(2, 48), q=st.integers(1, 3),
       hot_frac=st.floats(0.0, 1.0), dt=st.integers(0, 2), seed=st.integers(0, 999))
def test_merge_is_bit_identical_to_all_hbm(b, h, g, t, q, hot_frac, dt, seed):
    """Hot + fetched tokens, merged, equal what an all-HBM cache holding the same tokens holds, element for
    element and in the same order; attention over them is bit-identical."""
    dtype = DTYPES[dt]
    gen = torch.Generator().manual_seed(seed)
    seen = t + 7
    allt = _tokens(b, h, t, 8, 8, dtype, seed, seen=seen)
    allt.positions[..., -1] = seen - 1  # the newest token is always hot
    allt.positions, _ = allt.positions.sort(-1)
    n_hot = max(1, int(hot_frac * t))
    is_hot = torch.zeros(b, h, t, dtype=torch.bool)
    for i in range(b):
        for j in range(h):
            is_hot[i, j, torch.randperm(t - 1, generator=gen)[: n_hot - 1]] = True
    is_hot[..., -1] = True
    order = torch.sort(is_hot.to(torch.int8), dim=-1, descending=True, stable=True).indices
    hot_idx = order[..., :n_hot].sort(-1).values
    tier_idx = order[..., n_hot:].sort(-1).values
    hot, cold = allt.take(hot_idx), allt.take(tier_idx)
    tier = HostTier()
    state = tier.store(_init(tier, cold), cold, seen, _kept(cold, n_hot))
    fetched = Prefetcher().fetch(tier, state, "layer 0")
    if t == n_hot:
        assert fetched is None
        return
    m = Prefetcher.merge(hot.keys, hot.values, hot.positions, hot.valid, hot.channels, fetched)
    assert torch.equal(m.keys, allt.keys) and torch.equal(m.values, allt.values)
    assert torch.equal(m.positions, allt.positions) and torch.equal(m.valid, allt.valid)
    assert torch.equal(m.channels, allt.channels)
    hot_part, tier_part = m.split(allt.channels)
    assert torch.equal(hot_part, hot.channels) and torch.equal(tier_part, cold.channels)
    query = torch.randn(b, h * g, q, 8, generator=gen).to(dtype)
    qpos = torch.arange(seen - q, seen)
    out_tier = attend(query, m.keys, m.values, build_mask(m.positions, m.valid, qpos), 0.35)
    out_hbm = attend(query, allt.keys, allt.values, build_mask(allt.positions, allt.valid, qpos), 0.35)
    assert torch.equal(out_tier, out_hbm)


# ------------------------------------------------------------------------------------------------
# compressed tier: error bound, exact survivors
# ------------------------------------------------------------------------------------------------
@given(b=st.integers(1, 2), h=st.integers(1, 2), n=st.integers(1, 70), d=st.sampled_from([3, 8, 16, 64]),
       bits=st.sampled_from([4, 8]), kg=st.sampled_from([2, 8, 32]), vg=st.sampled_from([4, 32]),
       dt=st.integers(0, 1), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 999))
def test_compressed_tier_error_within_bound(b, h, n, d, bits, kg, vg, dt, scale, seed):
    dtype = DTYPES[dt]
    tok = _tokens(b, h, n, d, d, torch.float32, seed)
    tok.keys, tok.values = (tok.keys * scale).to(dtype), (tok.values * scale).to(dtype)
    tier = CompressedTier(bits=bits, key_group=kg, value_group=vg)
    state = tier.store(_init(tier, tok), tok, 10_000, _kept(tok))
    got = tier.fetch(state)
    assert torch.equal(got.positions, tok.positions) and torch.equal(got.valid, tok.valid)
    assert torch.equal(got.channels, tok.channels) and got.keys.dtype == dtype
    for x, y, g, axis in ((tok.keys, got.keys, kg, "channel"), (tok.values, got.values, vg, "token")):
        bound = quantization_error_bound(x, bits, g, axis)
        # float32 arithmetic: a few ulps of the group's magnitude; half precision: half an ulp of the output
        out_ulp = (x.float().abs() + bound) * 2.0**-8 if dtype != torch.float32 else 0.0  # half an ulp of the output
        slack = 1e-5 * x.float().abs().amax() + out_ulp
        assert ((x.float() - y.float()).abs() <= bound + slack).all()


def test_compressed_tier_keeps_codes_of_survivors():
    """A token that stays compressed keeps its codes: its dequantized value does not drift."""
    tok = _tokens(2, 2, 37, 16, 16, torch.float32, 1, seen=200)
    tok.valid[:] = True
    tier = CompressedTier(bits=4, key_group=8, slack=4.0)
    state = tier.store(_init(tier, tok), tok, 200, _kept(tok))
    first = tier.fetch(state)
    bytes_before = tier.nbytes(state)["compressed"]
    for step, keep in enumerate(([0, 3, 5, 8, 20, 36], [3, 8, 20])):
        survivors = first.take(torch.tensor(keep).expand(2, 2, len(keep)))
        new = _tokens(2, 2, 5, 16, 16, torch.float32, 10 + step, seen=5)
        new.positions += 200 + 10 * step
        new.valid[:] = True
        state = tier.store(state, TierTokens.cat([survivors, new]), 300, _kept(new))
        got = tier.fetch(state)
        assert torch.equal(got.keys[:, :, : len(keep)], survivors.keys)
        assert torch.equal(got.values[:, :, : len(keep)], survivors.values)
        assert torch.equal(got.positions[:, :, len(keep):], new.positions)
        assert state.get("requantized", 0) == 0
    assert tier.nbytes(state)["compressed"] < bytes_before  # dead groups were dropped
    # and int4 codes are smaller than the fp32 tokens they replace
    assert bytes_before < first.keys.numel() * 4 * 2 / 2


# ------------------------------------------------------------------------------------------------
# the central finding, end to end
# ------------------------------------------------------------------------------------------------
PROMPT, NEW, INTERVAL = 16, 48, 8
RECENT = 8  # memory_hierarchy's protected recent window: it must fit in the retained share at the first event


def _ids(b=1, seed=0):
    return torch.randint(3, 128, (b, PROMPT), generator=torch.Generator().manual_seed(seed))


def _generate(model, pipeline, budget=None, interval=INTERVAL, num_beams=1, ids=None):
    cache = KVComposeCache(model, pipeline, budget, interval=interval)
    out = model.generate(input_ids=_ids() if ids is None else ids, past_key_values=cache, max_new_tokens=NEW,
                         min_new_tokens=NEW, do_sample=False, num_beams=num_beams, output_logits=num_beams == 1,
                         return_dict_in_generate=True)
    logits = torch.stack(out.logits) if num_beams == 1 else None
    return out.sequences, logits, cache


@pytest.mark.parametrize("evict, hbm_ratios", [(0.0, (0.25, 0.5, 1.0)), (0.25, (0.25, 0.5, 0.75))])
def test_generation_depends_on_evict_ratio_only(evict, hbm_ratios):
    """For a fixed evict_ratio, greedy tokens are identical and logits bit-identical for every hbm_ratio;
    HBM bytes follow hbm_ratio. The largest hbm_ratio (1 - evict) leaves host memory empty: it is the
    all-HBM cache holding the same tokens."""
    model = tiny_model("llama", layers=2)
    runs = [_generate(model, methods.memory_hierarchy(h, evict_ratio=evict, recent=RECENT)) for h in hbm_ratios]
    seq0, logits0, _ = runs[0]
    for seq, logits, _ in runs[1:]:
        assert torch.equal(seq, seq0)
        assert torch.equal(logits, logits0)
    seen = PROMPT + NEW - 1
    last_event = PROMPT + (NEW - 1) // INTERVAL * INTERVAL
    per_token = runs[0][2].layers[0].bytes_per_token()
    retained = seen - int(evict * last_event)
    for h, (_, _, cache) in zip(hbm_ratios, runs):
        rep = cache.memory()
        assert set(rep.by_tier) == {"hbm", "host", "compressed"}
        share = cache.pipeline.allocator.layer_budget(0, 2, None, last_event)  # SeenShare: HBM's share of seen
        hbm_tokens = seen if h == 1.0 else share + seen - last_event
        assert abs(hbm_tokens - (h * last_event + seen - last_event)) <= 2
        assert rep.by_tier_layer["hbm"] == [hbm_tokens * per_token] * 2
        assert rep.by_tier["host"] == 2 * (retained - hbm_tokens) * per_token
        assert rep.by_tier["compressed"] == 0
        assert rep.peak["host"] >= rep.by_tier["host"] and rep.peak["hbm"] >= rep.by_tier["hbm"]
    hbm = [r[2].memory().by_tier["hbm"] for r in runs]
    assert hbm[0] < hbm[1] < hbm[2]
    if evict == 0.0:  # nothing evicted: the full cache, bit for bit
        full_seq, full_logits, _ = _generate(model, methods.full())
        assert torch.equal(full_logits, logits0) and torch.equal(full_seq, seq0)
        assert runs[-1][2].layers[0].events == 0


def test_any_pipeline_can_offload_to_host():
    """VaSE whose drops go to host memory instead of being deleted computes exactly the full cache."""
    model = tiny_model("llama", layers=2)
    _, full_logits, _ = _generate(model, methods.full())
    pipe = with_tier(methods.vase(recent=4, window=4), HostTier())
    _, logits, cache = _generate(model, pipe, budget=16, interval=4)
    assert torch.equal(logits, full_logits)
    rep = cache.memory()
    assert max(cache.held_lengths()) < 16 + 4 and rep.by_tier["host"] > rep.by_tier["hbm"]
    _, evicting, _ = _generate(model, methods.vase(recent=4, window=4), budget=16, interval=4)
    assert not torch.equal(evicting, full_logits)  # the same method with eviction does change the output


def test_compressed_share_fixed_then_hbm_share_still_irrelevant():
    """With fixed compressed and evict shares the compressed set is the same band of the ranking, so the
    HBM share still changes nothing; the compressed tier itself does change the output."""
    model = tiny_model("llama", layers=2)
    runs = [_generate(model, methods.memory_hierarchy(h, compressed_ratio=0.25, evict_ratio=0.25, recent=RECENT))
            for h in (0.25, 0.5)]
    assert torch.equal(runs[0][1], runs[1][1])
    rep = runs[0][2].memory()
    assert rep.by_tier["compressed"] > 0 and rep.by_tier["host"] > 0
    host_only = _generate(model, methods.memory_hierarchy(0.25, evict_ratio=0.25, recent=RECENT))[1]
    assert not torch.equal(runs[0][1], host_only)


def test_tiers_change_at_every_event_and_tier_tokens_keep_accumulating():
    """Tokens move between tiers in both directions, and accumulated attention keeps growing for tokens
    that live in host memory (they are attended from there)."""
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(3))
    cache = KVComposeCache(model, methods.memory_hierarchy(0.25, evict_ratio=0.1, recent=4), interval=8)
    layer = cache.layers[0]
    snapshots = []
    with torch.no_grad():
        model(input_ids=ids[:, :16], past_key_values=cache)
        for t in range(16, 80):
            model(input_ids=ids[:, t : t + 1], past_key_values=cache)
            if layer.seen % INTERVAL == 0:
                host = layer.segment.tier["host"]
                acc = host["channels"][..., 0]  # accumulated attention: the pipeline's one token-state channel
                snapshots.append((set(layer.positions[0, 0].tolist()), dict(zip(host["positions"][0, 0].tolist(),
                                                                                   acc[0, 0].tolist()))))
    promoted = demoted = grew = 0
    for (hbm0, host0), (hbm1, host1) in zip(snapshots, snapshots[1:]):
        promoted += len(hbm1 & set(host0))
        demoted += len(set(host1) & hbm0)
        grew += sum(host1[p] > host0[p] for p in set(host0) & set(host1))
    assert promoted > 0 and demoted > 0 and grew > 0


def test_memory_hierarchy_with_a_budget_and_beam_search():
    model = tiny_model("llama", layers=2)
    pipe = methods.PRESETS["memory_hierarchy"](hbm_ratio=0.5, evict_ratio=0.25, recent=RECENT)
    _, _, cache = _generate(model, pipe, budget=12)
    assert max(cache.held_lengths()) < 12 + INTERVAL
    rep = cache.memory()
    assert rep.by_tier["host"] > 0
    # beam search reorders tier state too (_batch_apply): the HBM share still does not matter
    beams = [_generate(model, methods.memory_hierarchy(h, compressed_ratio=0.25, evict_ratio=0.25, recent=RECENT),
                       num_beams=2)[0]
             for h in (0.25, 0.5)]
    assert torch.equal(beams[0], beams[1])


def test_memory_hierarchy_protects_prompt_and_recent_tokens():
    """The prompt and the newest `recent` tokens are protected: never evicted, whatever the shares (they were
    only ranked first by the removed `Prioritized` scorer); the other tokens follow the cumulative-attention
    ranking, and the tiers take what HBM does not keep in the selector's order."""
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    pipe = methods.memory_hierarchy(0.25, evict_ratio=0.25, recent=RECENT)
    assert [type(p) for p in pipe.protectors] == [ProtectRecent, ProtectPrompt]
    assert isinstance(pipe.scorer, AccumulatedAttention) and isinstance(pipe.selector, TopK)
    assert isinstance(pipe.allocator, SeenShare) and isinstance(pipe.tier, Hierarchy)
    cache = KVComposeCache(model, pipe, interval=INTERVAL)
    layer = cache.layers[0]
    prompt_kept = PROMPT
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        for t in range(3 * INTERVAL):
            model(input_ids=ids[:, t % PROMPT : t % PROMPT + 1], past_key_values=cache)
            if layer.seen % INTERVAL == 0:
                seen = layer.seen
                room = seen - int(0.25 * seen) - RECENT  # the prompt is protected up to the room left
                prompt_kept = min(prompt_kept, room)  # (an evicted prompt token is gone for good)
                fetched = pipe.tier.fetch(layer.segment.tier)
                for h in range(layer.num_heads):
                    held = set(layer.positions[0, h].tolist())
                    tier = set(fetched.positions[0, h][fetched.valid[0, h]].tolist())
                    assert not held & tier
                    kept = held | tier  # not evicted
                    assert set(range(seen - RECENT, seen)) <= kept  # recent: never evicted (HBM or host)
                    assert len(kept) == seen - int(0.25 * seen)  # exactly the evicted share is gone
                    assert len(set(range(PROMPT)) & kept) == prompt_kept
    assert layer.events == 3
    # the tiers follow the selector's one order: everything HBM keeps ranks above everything in the tiers
    view, channels, _ = layer.view()
    sel, _ = pipe.select(view, pipe.allocator.layer_budget(0, 1, None, layer.seen), layer.segment.blocks, channels)
    assert sel.order is not None
    for h in range(view.shape[1]):
        pos = view.positions.gather(-1, sel.order)[0, h]
        k = int((sel.kept[0, h] >= 0).sum())
        assert set(pos[:k].tolist()) == set(view.positions.gather(-1, sel.kept)[0, h].tolist())
        acc = channels[..., 0].gather(-1, sel.order)[0, h]
        free = (pos >= PROMPT) & (pos < layer.seen - RECENT)  # never protected
        free[:k] = False
        rest = acc[free]  # unprotected tokens outside HBM come in descending cumulative attention
        assert rest.numel() > 1 and (rest[1:] <= rest[:-1]).all()
        recent = (pos >= layer.seen - RECENT).nonzero().flatten()
        assert int(recent.max()) < int(free.nonzero().min())  # protected tokens rank above every other one


def test_memory_hierarchy_default_recent_window_with_eviction():
    """Early in decoding the default recent window (64) holds more tokens than the evict share leaves: the
    protected tokens are never evicted (fewer go than the share asks), and no error is raised."""
    model = tiny_model("llama", layers=1)
    _, _, cache = _generate(model, methods.memory_hierarchy(0.25, evict_ratio=0.25))
    layer = cache.layers[0]
    assert layer.events > 0
    held = set(cache.kept_positions(0).reshape(-1).tolist())
    tier = cache.pipeline.tier.fetch(layer.segment.tier)
    if tier is not None:
        held |= set(tier.positions[tier.valid].tolist())
    seen = cache.get_seq_length()
    assert set(range(max(0, seen - 64), seen)) <= held  # every recent token is still somewhere


def test_reorder_moves_tier_rows():
    model = tiny_model("llama", layers=1)
    ids = _ids(b=2, seed=5)
    cache = KVComposeCache(model, methods.memory_hierarchy(0.25, compressed_ratio=0.25, evict_ratio=0.1, recent=RECENT),
                           interval=4)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        for _ in range(12):
            model(input_ids=ids[:, -1:], past_key_values=cache)
    tier, layer = cache.pipeline.tier, cache.layers[0]
    before = tier.fetch(layer.segment.tier)
    assert before.channels.shape[-1] == 1 and before.n > 0 and layer.segment.tier["compressed"].get("n")
    cache.reorder_cache(torch.tensor([1, 0]))
    after = tier.fetch(layer.segment.tier)
    _assert_same(after, before.apply(lambda t: t.flip(0)))
    cache.batch_select_indices(torch.tensor([1]))
    _assert_same(tier.fetch(layer.segment.tier), before.apply(lambda t: t[:1]))


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------
def test_bad_input_errors():
    with pytest.raises(KVComposeError, match="sum to at most 1"):
        methods.memory_hierarchy(0.5, compressed_ratio=0.3, evict_ratio=0.3)
    with pytest.raises(KVComposeError, match="in \\[0, 1\\]"):
        Hierarchy(0.5, evict_ratio=-0.1)
    with pytest.raises(KVComposeError, match="at most 1"):
        Hierarchy(0.6, evict_ratio=0.6)
    with pytest.raises(KVComposeError, match="hbm_ratio must be > 0"):  # HBM's share is the allocator's now
        SeenShare(0.0, evict_ratio=0.5)
    with pytest.raises(KVComposeError, match="host memory or a compressed tier"):  # a share for a missing tier
        KVComposeCache(tiny_model("llama", layers=1), Pipeline(AccumulatedAttention(), TopK(), SeenShare(0.5)))
    with pytest.raises((KVComposeError, TypeError)):  # TypeError under the test suite's runtime type checks
        Hierarchy("half")
    with pytest.raises(KVComposeError, match="bits"):
        CompressedTier(bits=3)
    with pytest.raises(KVComposeError, match="power of two"):
        CompressedTier(key_group=24)
    with pytest.raises(KVComposeError, match="location"):
        CompressedTier(location="disk")
    if not torch.cuda.is_available():
        with pytest.raises(KVComposeError, match="CUDA is not available"):
            HostTier(device="cuda")
        with pytest.raises(KVComposeError, match="CUDA is not available"):
            CompressedTier(device="cuda:0")
    with pytest.raises(KVComposeError, match="only 'cpu' and 'cuda'"):
        HostTier(device="meta")
    with pytest.raises((KVComposeError, TypeError), match="Pipeline"):
        with_tier("vase", HostTier())
    with pytest.raises((KVComposeError, TypeError), match="TierStore"):
        with_tier(methods.vase(), "host")
    with pytest.raises(KVComposeError, match="ProtectRecent"):
        methods.memory_hierarchy(recent=-1)
    with pytest.raises(KVComposeError, match="lookahead"):
        Prefetcher(lookahead=-1)
    model = tiny_model("llama", layers=1)
    with pytest.raises(KVComposeError, match="needs a token budget"):
        KVComposeCache(model, with_tier(methods.vase(), HostTier()))
    with pytest.raises(KVComposeError, match="tier stores"):
        Pipeline(AccumulatedAttention(), TopK(), HostTier(), CompressedTier())
    # a store built for another device refuses the layer's tokens
    tier = HostTier(device="cpu")
    tok = _tokens(1, 1, 3, 4, 4, torch.float32, 0)
    assert tier.fetch(tier.store(_init(tier, tok), tok, 10, _kept(tok))).n == 3  # fine on CPU
    if torch.cuda.is_available():  # pragma: no cover - GPU machines only
        with pytest.raises(KVComposeError, match="built for device"):
            HostTier(device="cuda").store({}, tok, 10, _kept(tok))
    assert KVComposeCache(model, methods.memory_hierarchy(0.5)).budget is None  # budget-free


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layer_ahead_prefetch_is_exact():  # pragma: no cover - runs on GPU machines only
    model = tiny_model("llama", layers=3).cuda()
    ids = _ids().cuda()
    runs = [_generate(model, methods.memory_hierarchy(h, evict_ratio=0.25, recent=RECENT), ids=ids) for h in (0.25, 0.75)]
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][0], runs[1][0])
    host = runs[0][2].layers[0].segment.tier["host"]["stash"]
    assert host.cuda and all(b.is_pinned() for b in host._buf.values())
    comp = _generate(model, methods.memory_hierarchy(0.25, compressed_ratio=0.25, evict_ratio=0.25, recent=RECENT), ids=ids)
    comp2 = _generate(model, methods.memory_hierarchy(0.5, compressed_ratio=0.25, evict_ratio=0.25, recent=RECENT), ids=ids)
    assert torch.equal(comp[1], comp2[1])
