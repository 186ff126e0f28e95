"""Ahead-of-time compile check of every Triton kernel kvcompose launches, without a GPU.

Each configuration below calls a public kernel wrapper (`kvcompose.kernels`) on fake CUDA tensors of the
shapes the library passes (`torch._subclasses.FakeTensorMode`: no memory, no device), under
`kvcompose.kernels.dispatch.intercept_launches`, which records every launch (the `@triton.jit` function, its
grid, arguments and constexprs: the block sizes, warps and flags the wrapper picked) instead of running it.
Each distinct launch is then compiled by Triton's own pipeline for `sm_80` and `sm_90`
(`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`, specialised exactly as
`JITFunction.run` specialises a real launch: the same binder, the same attributes), down to a cubin with the
`ptxas` that ships in the triton wheel, whose `-v` report gives registers, spills, stack and shared memory.

    python -m kvcompose.bench.aot                 # the CI sample (the decode path and the reported cases)
    python -m kvcompose.bench.aot --full          # every configuration (benchmarks/kernel_aot.py: the table)
    python -m kvcompose.bench.aot --json out.json

Must run with `TRITON_INTERPRET` unset (the wrappers choose GPU settings only when compiled kernels exist):
the test (`tests/kernels/test_aot.py`) runs it in a subprocess. Compiles run in a pool of at most 2 processes
and are cached per process. Relies on Triton internals (`create_function_from_signature`,
`JITFunction._pack_args`; checked with triton 3.9).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ARCHS", "Config", "configurations", "capture", "compile_launch", "run", "check", "markdown",
           "DECODE_KERNELS", "MAX_DECODE_REGS", "SMEM_LIMIT"]

ARCHS = (80, 90)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (64, 128, 256)
#: Kernels that run on every decode step (paged decode attention; the compressed tier's dequantization).
DECODE_KERNELS = ("_paged_decode_kernel", "_dequant_channel_kernel", "_dequant_token_kernel")
#: Registers per thread at 4 warps that a decode-step kernel may use (4 CTAs of 128 threads per SM on 64k
#: registers: enough resident warps to hide the gathers' latency).
MAX_DECODE_REGS = 128
#: The most dynamic shared memory one block may ask for (A100: 163 KB; H100/H200: 227 KB): a launch asking
#: more fails on the GPU ("out of resource: shared memory").
SMEM_LIMIT = {"sm_80": 166912, "sm_90": 232448}
#: Qwen3-8B-like decode shapes: 8 KV heads, 4 query heads each, pages of 16 tokens.
H, G, P = 8, 4, 16


@dataclass
class Config:
    """One call of a public wrapper: `call()` runs it on fake CUDA tensors (inside the capture)."""

    kernel: str          # the public function
    label: str           # shapes and options
    path: str            # "decode" (every decode step), "event" (compression events), "prefill", "api"
    dtype: str
    head_dim: int
    call: Callable[[], Any]
    default: bool = False  # in the CI sample
    sms: int = 132


@dataclass
class Launch:
    """A launch the wrapper made: what `kernel[grid](*args, **kwargs)` received (tensors as stand-ins)."""

    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict
    config: int = -1
    index: int = 0
    key: str = ""
    results: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__


class _TensorArg:
    """What Triton's specialisation reads from a tensor argument: its dtype and its address (fake tensors
    have none: the allocation is taken 16-byte aligned, as the CUDA caching allocator's are, plus the view's
    offset)."""

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self._ptr = t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:
        return self._ptr

    def __repr__(self) -> str:
        return f"<{str(self.dtype).replace('torch.', '')} +{self._ptr}>"


def _e(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="cuda")


# ============================================================================ configurations
def _paged(dt, D, B, T, Q, splits, window):
    from ..kernels import paged_decode_attention

    def call():
        n = B * H * math.ceil(T / P)
        q = _e(B, Q, H * G, D, dtype=dt).transpose(1, 2)  # the model's layout [B, Hq, Q, D] over [B, Q, Hq, D]
        return paged_decode_attention(
            q, _e(n, P, D, dtype=dt), _e(n, P, D, dtype=dt), _e(n, P, dtype=torch.long),
            _e(n, P, dtype=torch.bool), _e(B, H, math.ceil(T / P), dtype=torch.long), _e(B, H, dtype=torch.long),
            torch.arange(T - Q, T, device="cuda"), D ** -0.5, window, num_splits=splits, check_indices=False)
    return call


def _dequant(dt, D, bits, axis, T=4096, B=1):
    from ..kernels import QTensor, dequantize

    def call():  # the tier's codes as the compressed tier holds them (quantize is an event kernel)
        dc = (D + 1) // 2 if bits == 4 else D
        st = (B, H, -(-T // 32), D) if axis == "channel" else (B, H, T, -(-D // 32))
        q = QTensor(_e(B, H, T, dc, dtype=torch.uint8), _e(*st), _e(*st), bits, 32, axis, (B, H, T, D), dt)
        return dequantize(q, dt)
    return call


def _quant(dt, D, bits, axis, T=4096, B=1):
    from ..kernels import quantize

    return lambda: quantize(_e(B, H, T, D, dtype=dt), bits, 32, axis)


def _compact(dt, D, inplace, T=4096, B=1):
    from ..kernels import compact

    def call():
        k, v, K = _e(B, H, T, D, dtype=dt), _e(B, H, T, D, dtype=dt), T // 2
        idx = _e(B, H, K, dtype=torch.long)
        if inplace:  # DenseStore.compact: into the leading slice of the layer's own buffer
            return compact(k, v, idx, out_keys=k[:, :, :K], out_values=v[:, :, :K], check_indices=False)
        return compact(k, v, idx, check_indices=False)
    return call


def _redundancy(dt, D, T=4096, B=1):
    from ..kernels import key_redundancy

    return lambda: key_redundancy(_e(B, H, T, D, dtype=dt), _e(B, H, T, dtype=torch.bool), 0.5)


def _window(dt, D, W, gqa, T=4096, B=1):
    from ..kernels import window_attention_scores

    return lambda: window_attention_scores(
        _e(B, H * G, W, D, dtype=dt), _e(B, H, T, D, dtype=dt), _e(B, H, T, dtype=torch.long),
        _e(B, H, T, dtype=torch.bool), torch.arange(T - W, T, device="cuda"), _e(B, W, dtype=torch.bool),
        D ** -0.5, gqa=gqa, pool="avg", kernel=5)


def _magnitude(dt, D, kind, T=4096, B=1):
    from ..kernels import value_magnitude

    return lambda: value_magnitude(_e(B, H, T, D, dtype=dt), kind)


def configurations(full: bool = False) -> list[Config]:
    """Every configuration the library launches (`full`), or the CI sample: the decode path (paged decode
    attention at every dtype and head dim, split and unsplit; dequantization at every dtype and head dim, 8
    and 4 bits), and at head dim 128 every other kernel (the cases issue 31 reported)."""
    out: list[Config] = []

    def add(kernel, label, path, dn, D, call, default=False, sms=132):
        if full or default:
            out.append(Config(kernel, label, path, dn, D, call, default, sms))

    for dn, dt in DTYPES.items():
        for D in HEAD_DIMS:
            mid = D == 128
            # decode: B=1 splits the KV (about two waves over 132 SMs); B=64 fills the GPU unsplit
            for B, window in ((1, None), (64, None), (1, 4096)):
                tag = f"B={B} T=32k Q=1" + (f" window={window}" if window else "")
                add("paged_decode_attention", tag, "decode", dn, D, _paged(dt, D, B, 32768, 1, None, window),
                    default=window is None)
            add("paged_decode_attention", "B=1 T=4k Q=4 (multi-token)", "decode", dn, D,
                _paged(dt, D, 1, 4096, 4, None, None))
            add("paged_decode_attention", "B=1 T=512 Q=512 (direct call, prefill-sized)", "api", dn, D,
                _paged(dt, D, 1, 512, 512, 1, None), default=mid)
            for bits in (8, 4):
                for axis in ("channel", "token"):
                    add("dequantize", f"{bits}b {axis} group 32", "decode", dn, D, _dequant(dt, D, bits, axis),
                        default=True)
                    add("quantize", f"{bits}b {axis} group 32", "event", dn, D, _quant(dt, D, bits, axis))
            for inplace in (True, False):
                add("compact", "in place" if inplace else "out of place", "event", dn, D,
                    _compact(dt, D, inplace), default=mid and inplace)
            add("key_redundancy", "T=4k", "event", dn, D, _redundancy(dt, D), default=mid)
            for W in (1, 8, 32, 64):
                for gqa in ("mean", "max"):
                    add("window_attention_scores", f"W={W} gqa={gqa}", "event", dn, D, _window(dt, D, W, gqa),
                        default=mid and W == 64 and gqa == "mean")
            for kind in ("range", "l2"):
                add("value_magnitude", kind, "event", dn, D, _magnitude(dt, D, kind), default=mid and kind == "range")
    return out


# ============================================================================ capture
def capture(call: Callable[[], Any], sms: int = 132) -> list[Launch]:
    """The launches `call()` makes on fake CUDA tensors (nothing runs; the wrappers see `sms` SMs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..kernels.dispatch import intercept_launches
    from .fakecuda import install_cuda_guard

    install_cuda_guard()
    launches: list[Launch] = []

    def hook(kernel, grid, args, kwargs):
        args = tuple(_TensorArg(a) if isinstance(a, torch.Tensor) else a for a in args)
        launches.append(Launch(kernel, grid, args, dict(kwargs)))

    with FakeTensorMode(), intercept_launches(hook, sms=sms):
        call()
    return launches


# ============================================================================ compile
_LINE_REGS = re.compile(r"Used (\d+) registers")
_LINE_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_CACHE: dict[str, dict] = {}


def _specialise(launch: Launch, arch: int):
    """(src, target, options) exactly as `JITFunction.run` builds them for this launch on `sm_<arch>`."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    k = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(k.signature, k.params, backend)
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", k.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    bound, spec, opts = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = k._pack_args(backend, kwargs, bound, spec, opts)
    del triton
    return ASTSource(k, signature, constexprs, attrs), target, options


def launch_key(launch: Launch, arch: int) -> str:
    """Launches with one key compile to the same cubin."""
    src, _, options = _specialise(launch, arch)
    return f"{arch}:{src.hash()}:{options.hash()}"


def compile_launch(launch: Launch, arch: int) -> dict:
    """Compile one launch for `sm_<arch>`: registers, spills (bytes), stack (bytes per thread), the dynamic
    shared memory the launch asks for and ptxas's static one, warps, stages, or the compile error."""
    import triton
    from triton import knobs

    src, target, options = _specialise(launch, arch)
    key = f"{arch}:{src.hash()}:{options.hash()}"
    if key in _CACHE:
        return _CACHE[key]
    log = io.StringIO()
    t0 = time.perf_counter()
    old = (knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile)
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True  # the -v report of this compile
    try:
        with contextlib.redirect_stdout(log):
            ck = triton.compile(src, target=target, options=options.__dict__)
        text = log.getvalue()
        regs = _LINE_REGS.findall(text)
        sp = _LINE_SPILL.findall(text)
        res = dict(regs=int(regs[-1]) if regs else None, stack=int(sp[-1][0]) if sp else None,
                   spill_stores=int(sp[-1][1]) if sp else None, spill_loads=int(sp[-1][2]) if sp else None,
                   smem=int(ck.metadata.shared), num_warps=int(ck.metadata.num_warps),
                   num_stages=int(ck.metadata.num_stages), error=None)
    except Exception as exc:  # a compile error is a result (the check fails on it)
        res = dict(regs=None, stack=None, spill_stores=None, spill_loads=None, smem=None,
                   num_warps=options.num_warps, num_stages=options.num_stages,
                   error=f"{type(exc).__name__}: {str(exc)[-2000:]}")
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = old
    res["compile_s"] = round(time.perf_counter() - t0, 2)
    _CACHE[key] = res
    return res


def _worker(job: tuple[bool, int, int, int]) -> tuple[tuple, dict]:
    full, ci, li, arch = job
    cfg = configurations(full)[ci]
    return job, compile_launch(capture(cfg.call, cfg.sms)[li], arch)


def run(full: bool = False, workers: int = 2, archs: tuple[int, ...] = ARCHS, only: str | None = None) -> list[dict]:
    """Capture every configuration, compile each distinct launch once per arch (a pool of at most
    `workers` processes, at most 2), and return one row per (configuration, launch, arch)."""
    from ..kernels import TRITON_INTERPRETED

    if TRITON_INTERPRETED:
        raise RuntimeError("kvcompose.bench.aot needs compiled Triton: unset TRITON_INTERPRET (run it as a subprocess)")
    cfgs = configurations(full)
    rows, jobs, first = [], {}, {}
    for ci, cfg in enumerate(cfgs):
        if only and only not in cfg.kernel:
            continue
        for li, ln in enumerate(capture(cfg.call, cfg.sms)):
            for arch in archs:
                key = launch_key(ln, arch)
                first.setdefault(key, (full, ci, li, arch))
                c = ln.kwargs
                rows.append(dict(function=cfg.kernel, kernel=ln.name, config=cfg.label, path=cfg.path,
                                 dtype=cfg.dtype, head_dim=cfg.head_dim, arch=f"sm_{arch}", grid=list(ln.grid),
                                 blocks={k: v for k, v in c.items() if k.startswith("BLOCK") or k in
                                         ("num_warps", "num_stages", "PRECISION")},
                                 default=cfg.default, key=key))
                jobs[key] = first[key]
    workers = max(1, min(2, workers, len(jobs) or 1))
    todo = list(jobs.items())
    if workers == 1:
        done = {key: compile_launch(capture(cfgs[ci].call, cfgs[ci].sms)[li], arch) for key, (_, ci, li, arch) in todo}
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            res = list(ex.map(_worker, [j for _, j in todo]))
        done = {key: r for (key, _), (_, r) in zip(todo, res)}
    for r in rows:
        r.update(done[r["key"]])
    return rows


# ============================================================================ rules
def check(rows: list[dict]) -> list[str]:
    """The rules of issue 31: no compile error; no spill in a bf16/fp16 launch at head dim <= 128; at most
    `MAX_DECODE_REGS` registers per thread at 4 warps in a decode-step kernel (and no spill there at all);
    no launch asking more shared memory than its GPU has (`SMEM_LIMIT`)."""
    bad = []
    for r in rows:
        where = f"{r['function']} ({r['kernel']}) {r['config']} {r['dtype']} D={r['head_dim']} {r['arch']}"
        if r["error"]:
            bad.append(f"{where}: compile error {r['error'][:300]}")
            continue
        spill = (r["spill_stores"] or 0) + (r["spill_loads"] or 0)
        if spill and r["dtype"] in ("bf16", "fp16") and r["head_dim"] <= 128:
            bad.append(f"{where}: {r['spill_stores']} B spill stores, {r['spill_loads']} B spill loads")
        if r["smem"] > SMEM_LIMIT[r["arch"]]:
            bad.append(f"{where}: asks {r['smem']} B of shared memory (the GPU has {SMEM_LIMIT[r['arch']]})")
        if r["kernel"] in DECODE_KERNELS:
            if r["num_warps"] == 4 and r["regs"] > MAX_DECODE_REGS:
                bad.append(f"{where}: {r['regs']} registers per thread at 4 warps (> {MAX_DECODE_REGS})")
            if spill or r["stack"]:
                bad.append(f"{where}: a decode-step kernel with {r['stack']} B of stack ({spill} B spilled)")
    return bad


def markdown(rows: list[dict]) -> str:
    """The docs table: one row per (function, configuration, dtype, head dim), both archs side by side."""
    by: dict[tuple, dict] = {}
    for r in rows:
        k = (r["function"], r["kernel"], r["config"], r["path"], r["dtype"], r["head_dim"])
        by.setdefault(k, {})[r["arch"]] = r
    head = ("| function | kernel | config | path | dtype | D | blocks | warps | sm_80 regs / spill B / smem KB "
            "| sm_90 regs / spill B / smem KB |")
    out = [head, "|" + "---|" * 10]
    for (fn, kern, cfg, path, dn, D), a in by.items():
        any_ = next(iter(a.values()))
        blocks = " ".join(f"{k.replace('BLOCK_', '')}={v}" for k, v in any_["blocks"].items()
                          if k.startswith("BLOCK"))

        def cell(r):
            if r is None:
                return "-"
            if r["error"]:
                return "**error**"
            sp = (r["spill_stores"] or 0) + (r["spill_loads"] or 0)
            return f"{r['regs']} / {sp if not sp else f'**{sp}**'} / {r['smem'] / 1024:.0f}"

        out.append(f"| {fn} | `{kern}` | {cfg} | {path} | {dn} | {D} | {blocks} | {any_['num_warps']} "
                   f"| {cell(a.get('sm_80'))} | {cell(a.get('sm_90'))} |")
    return "\n".join(out) + "\n"


def selftest() -> list[str]:
    """The check can fail: paged decode attention at bf16, head dim 128, with the tiles it had before issue 31
    (BLOCK_N=64, 3 stages) compiled for sm_90 must be refused (172 registers per thread at 4 warps)."""
    cfg = next(c for c in configurations(True) if c.kernel == "paged_decode_attention" and c.dtype == "bf16"
               and c.head_dim == 128 and c.label.startswith("B=1 T=32k Q=1") and c.path == "decode")
    ln = capture(cfg.call, cfg.sms)[0]
    ln.kwargs.update(BLOCK_N=64, num_stages=3, num_warps=4)
    r = compile_launch(ln, 90)
    row = dict(function=cfg.kernel, kernel=ln.name, config=cfg.label + " (pre-issue-31 tiles)", path=cfg.path,
               dtype=cfg.dtype, head_dim=cfg.head_dim, arch="sm_90", **r)
    return check([row])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="every configuration (default: the CI sample)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--markdown", action="store_true", help="print the docs table")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", default=None, help="only the public functions whose name contains this")
    ap.add_argument("--selftest", action="store_true", help="also show that the check refuses the old decode tiles")
    a = ap.parse_args(argv)
    t0 = time.time()
    rows = run(a.full, a.workers, only=a.only)
    bad = check(rows)
    out = dict(rows=rows, problems=bad)
    if a.selftest:
        out["selftest"] = selftest()
    out["seconds"] = round(time.time() - t0, 1)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    if a.markdown:
        print(markdown(rows))
    n = len({r["key"] for r in rows})
    print(f"{len(rows)} launches ({n} distinct compiles) in {time.time() - t0:.0f} s; {len(bad)} problems",
          file=sys.stderr)
    for b in bad:
        print("  " + b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.exit(main())
