"""The decode path on a fake CUDA device (`kvcompose.bench.fakecuda.FakeCuda`): every op runs on a FakeTensor on
`cuda:0` (torch's device rules: a tensor on another device raises) and on a real CPU tensor (the values), so every
host sync is seen where a GPU would stall (`item`/`bool`/`int`, data-dependent shapes, blocking device-to-host
copies), with the kvcompose frame that made it. A tiny model is moved to the fake device; for every preset x store
x tier of `tests/test_decode_path.py` (and the ported presets): prefill, ordinary decode steps and a compression
event. Claims:

- no device mismatch anywhere (the run completes on the fake device);
- no host sync from kvcompose at prefill (no blocking copy: the paged stores' initial limits are made on the host)
  and none on an ordinary step;
- at most `MAX_SYNCS` = 2 per layer per compression event for every preset of `methods.PRESETS` on every store and
  tier (before issue 31: 9-22); 0 for a constant allocator without a tier, 1 for a per-head allocator (its
  budgets) or a block-granular selection (its kept width), 1 for a compressed tier (its two widths at once), 1 for
  the batched checks and counts where the host cannot derive them. The ported kvpress presets: see `PORTED_MAX`;
- prefill never runs the paged decode kernel (it goes to SDPA); a paged store's decode steps do.

About 2-3 minutes here (10 decode steps per combination, ~70 combinations).
"""

from __future__ import annotations

import pytest
import torch

from kvcompose import methods
from kvcompose.bench.fakecuda import FakeCuda, cuda_guard_available
from kvcompose.testing import tiny_model
from test_decode_path import PROMPT, _cache, _combos, _ids, _pipeline

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cuda_guard_available(), reason="needs a C++ compiler for the CUDA guard shim")]

STEPS = 10  # the event is at decoded token 8 (interval 8); ordinary steps before and after it
MAX_SYNCS = 2  # per layer per event
#: ported kvpress presets whose own blocks still read the device at an event (per layer per event)
PORTED_MAX = {"adakv": 4, "cam": 3, "kvcompose_paper": 3}


@pytest.fixture(scope="module")
def device():
    """One fake device and a model on it for the module (the model of tests/test_decode_path.py, built anew:
    that module's own copy stays on the CPU; the pipelines read their model facts from it)."""
    fc = FakeCuda()
    return fc, fc.to_device(tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16))


def _run(fc: FakeCuda, model, name: str, store: str, tier: str | None):
    fc.syncs.clear()
    fc.launches.clear()
    steps = []
    with fc, torch.no_grad():
        fc.phase = "setup"
        ids = _ids(PROMPT + STEPS).to("cuda:0")
        cache = _cache(model, _pipeline(name, store, tier))
        fc.phase = "prefill"
        model(input_ids=ids[:, :PROMPT], past_key_values=cache)
        for t in range(PROMPT, PROMPT + STEPS):
            fc.phase = f"step {t - PROMPT + 1}"
            before = cache.stats.compress_calls
            out = model(input_ids=ids[:, t : t + 1], past_key_values=cache)
            steps.append((fc.phase, cache.stats.compress_calls - before))
        assert out.logits.device.type == "cuda"
    return cache, steps


@pytest.mark.parametrize("name, store, tier", _combos())
def test_fake_cuda_decode(device, name, store, tier):
    fc, model = device
    cache, steps = _run(fc, model, name, store, tier)
    ours = [s for s in fc.syncs if s.kvcompose]
    at = lambda phase: [str(s) for s in ours if s.phase == phase]  # noqa: E731
    assert at("prefill") == []
    events = [(phase, n) for phase, n in steps if n]
    ordinary = [phase for phase, n in steps if not n]
    assert ordinary
    for phase in ordinary:
        assert at(phase) == [], phase
    if name != "full":
        assert events, f"{name} never compressed in {STEPS} steps"
    limit = PORTED_MAX.get(name, MAX_SYNCS) if name not in methods.PRESETS else MAX_SYNCS
    for phase, n in events:
        assert len(at(phase)) <= limit * n, (phase, n, at(phase))
    per_event = max((len(at(p)) / n for p, n in events), default=0)
    print(f"{name}/{store}/{tier}: {per_event:g} host syncs per layer per event; "
          f"{sorted(set(at(events[0][0]))) if events else []}")
    # prefill attends through SDPA, decode steps of a paged store that attends itself through the kernel
    launched = {(k, p) for k, p in fc.launches}
    assert ("_paged_decode_kernel", "prefill") not in launched
    pipe = cache.pipeline
    if pipe.paged and not pipe.tier.holds_tokens and not pipe.observers:
        assert any(k == "_paged_decode_kernel" and p.startswith("step") for k, p in launched)


def test_the_fake_device_sees_syncs_copies_and_mismatches():
    """The harness can fail: a value read, a data-dependent shape and a blocking copy are each one sync (a
    non-blocking copy into pinned memory is not); a CPU tensor meeting a CUDA one raises."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    fc = FakeCuda()
    with fc:
        x = torch.arange(6, device="cuda:0").float()
        assert x.device.type == "cuda" and float(x.sum()) == 15.0  # the real half carries the values
        _ = x[x > 2]  # boolean mask: a data-dependent shape
        _ = x.cpu()  # blocking
        buf = torch.empty(6, pin_memory=True)
        buf.copy_(x, non_blocking=True)  # asynchronous into pinned memory
        y = torch.ones(6, device="cuda:0")
        z = (x + y)[torch.arange(3, device="cuda:0")]  # indexing needs the CUDA device guard
        assert z.shape == (3,) and z.device.type == "cuda"
        with pytest.raises(FakeTensorDeviceMismatchError):
            _ = x + torch.ones(6)
    kinds = [s.kind for s in fc.syncs]
    assert kinds == ["item", "shape", "d2h"] and fc.async_d2h == 1
    assert torch.equal(buf, torch.arange(6).float())
