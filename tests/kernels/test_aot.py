"""Every Triton kernel, through its wrapper, compiled ahead of time for sm_80 and sm_90 on this CPU
(`kvcompose.bench.aot`: Triton's real pipeline down to ptxas; no GPU). The CI sample runs in the default suite
in one subprocess (the wrappers must see compiled Triton, and this process runs the interpreter), compiling in
a pool of 2: about 25-40 s of wall time here (108 distinct compiles). It holds the decode path (paged decode
attention at fp32/bf16/fp16 x head dims 64/128/256, split and unsplit, a prefill-sized direct call;
dequantization at every dtype, head dim, 8 and 4 bits, both axes) and at head dim 128 every other kernel (the
cases issue 31 found: key redundancy at 16 bits on sm_80, the W=64 window kernel, in-place compaction). Every
configuration the library launches compiles under `-m slow` (`test_every_configuration_compiles`), and
`benchmarks/kernel_aot.py` prints the table of docs/kernels.md.

Rules (issue 31): no compile error; no spill in a bf16/fp16 launch at head dim <= 128; at most 128 registers per
thread at 4 warps and no stack in a kernel of every decode step; no launch asking more shared memory than the
GPU has."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcompose.bench import aot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ptxas_ok() -> bool:
    try:
        import triton  # noqa: F401
        from triton import knobs

        return os.path.exists(knobs.nvidia.ptxas.path)
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _ptxas_ok(), reason="needs triton with its bundled ptxas")


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default of this triton, without its warning
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "kvcompose.bench.aot", "--json", str(out), *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert out.exists(), r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """The CI sample, compiled once per test session (plus the self-test)."""
    return _run(tmp_path_factory.mktemp("aot"), "--selftest")


def test_the_ci_sample_compiles_within_the_rules(sample):
    assert sample["problems"] == [], "\n".join(sample["problems"])
    assert all(r["regs"] is not None for r in sample["rows"])  # ptxas's report was read for every launch


def test_the_sample_holds_the_decode_path_and_the_reported_cases(sample):
    rows = sample["rows"]
    have = {(r["function"], r["dtype"], r["head_dim"], r["arch"]) for r in rows}
    for dn in ("fp32", "bf16", "fp16"):
        for d in (64, 128, 256):
            for arch in ("sm_80", "sm_90"):
                assert ("paged_decode_attention", dn, d, arch) in have
                assert ("dequantize", dn, d, arch) in have
        for fn in ("key_redundancy", "window_attention_scores", "compact", "value_magnitude"):
            assert (fn, dn, 128, "sm_80") in have and (fn, dn, 128, "sm_90") in have
    paged = [r for r in rows if r["kernel"] == "_paged_decode_kernel" and r["path"] == "decode"]
    # the split (batch 1 over 132 SMs) and the unsplit (batch 64) variants both compile
    assert {r["grid"][2] > 1 for r in paged} == {True, False}
    assert {r["kernel"] for r in rows if r["function"] == "dequantize"} == {"_dequant_channel_kernel",
                                                                          "_dequant_token_kernel"}
    # the decode kernels fit: at most 128 registers per thread at 4 warps, nothing spilled
    for r in rows:
        if r["kernel"] in aot.DECODE_KERNELS:
            assert r["stack"] == 0 and (r["num_warps"] != 4 or r["regs"] <= aot.MAX_DECODE_REGS), r


def test_the_check_refuses_the_old_decode_tiles(sample):
    """The rule can fail: the paged kernel's tiles before issue 31 (bf16, head dim 128, BLOCK_N=64, 3 stages)
    use more than 128 registers per thread at 4 warps on sm_90."""
    assert any("registers per thread" in p for p in sample["selftest"]), sample["selftest"]


def _row(**kw):
    base = dict(function="f", kernel="_k", config="c", path="event", dtype="bf16", head_dim=128, arch="sm_90",
                regs=100, stack=0, spill_stores=0, spill_loads=0, smem=1024, num_warps=4, num_stages=2, error=None)
    return {**base, **kw}


def test_the_rules():
    assert aot.check([_row()]) == []
    assert aot.check([_row(error="CompilationError: x")])
    assert aot.check([_row(spill_stores=4, spill_loads=4, stack=8)])  # a 16-bit spill at head dim 128
    assert aot.check([_row(dtype="fp32", spill_stores=4, stack=8)]) == []  # fp32: reported, not refused
    assert aot.check([_row(head_dim=256, spill_stores=4, stack=8)]) == []
    assert aot.check([_row(kernel="_paged_decode_kernel", regs=129)])
    assert aot.check([_row(kernel="_paged_decode_kernel", regs=129, num_warps=8)]) == []
    assert aot.check([_row(kernel="_dequant_token_kernel", dtype="fp32", stack=16)])  # decode path: no stack
    assert aot.check([_row(smem=232449)]) and aot.check([_row(arch="sm_80", smem=200000)])


@pytest.mark.slow
def test_every_configuration_compiles(tmp_path):
    """Every configuration the library launches (`--full`; several minutes on 2 cores)."""
    full = _run(tmp_path, "--full")
    assert full["problems"] == [], "\n".join(full["problems"])
