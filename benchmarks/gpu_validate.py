#!/usr/bin/env python3
"""One-shot GPU validation of kvcompose (written for a ~15-minute H200 lease: one call of at most 9 minutes).

Parts, each with its own time limit and try/except (a failure or a timeout is recorded and the next part
runs; results are written after every part, so a hard kill keeps what finished):

  env      versions, device, whether Triton compiles (not interpreted), which optional modules exist.
  kernels  (b) every kernel, Triton vs PyTorch reference (``benchmarks/gpu_kernels.py: bench_kernels``),
           plus paged decode attention (kvcompose.kernels.paged_decode_attention) vs its reference
           (gather + SDPA) and vs dense SDPA over a contiguous cache: ms, speedup, GB/s and % of 4.8 TB/s.
  tests    (a) ``python -m pytest -v --maxfail=25`` on CUDA with KVCOMPOSE_FORCE_REFERENCE=0 and TRITON_INTERPRET
           unset (kernels compiled): first tests/kernels (at most 60% of the part's time), then the rest; a
           failing test does not stop the part. Per-test outcomes, failures, skips with reasons, the slowest
           tests, and (``--baseline``) the tests whose outcome differs from an earlier run (e.g. the CPU one
           this script records with ``--dry-run --parts tests``).
  decode   (c) decode throughput of a random-initialised ~1B Llama (hidden 2048, 16 layers, 32 heads,
           8 KV heads, intermediate 8192, vocab 32000, bf16), full cache vs random_attention, rkv, vase and
           memory_hierarchy (when kvcompose.methods has it), plus transformers' DynamicCache: tokens/s
           (all decode steps, and the steady state after the first compression), ratio to full, compression
           share (the device is synchronised around every event: ``cache.stats.sync``, so queued attention
           is not counted as compression), peak / final KV bytes, peak device memory; batch 1 and 8. Each
           run has its own time slice (generate's ``max_time``): a slow run decodes fewer tokens (recorded)
           instead of taking the part's time from the others.
  tiers    (d) bit-identity of tiered vs all-HBM greedy logits on the GPU where it is claimed: rows that are
           not ragged (one unpadded row), where neither side builds an attention mask (counted: SDPA calls
           with a mask, per side), and a left-padded batch of two (both sides masked) for the record; then the
           host-tier overhead: memory_hierarchy with host memory (layer-ahead prefetch on the side stream; and
           with lookahead 0, synchronous) vs the same retained tokens all in HBM, interleaved repeats, each
           repeat's row written as soon as it is measured.

Usage (GPU):   python benchmarks/gpu_validate.py --out "$OUT"          (default out: docs/results/gpu)
       (CPU):  python benchmarks/gpu_validate.py --dry-run              (tiny sizes, interpreter, < 5 min)
Options: --parts env,kernels,tests,decode,tiers   --budget-s 490   --prompt-len/--new-tokens/--budget ...
Outputs in --out: gpu_validate.json, gpu_validate.md, pytest.log (<= 8 files, for the device tool).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
PARTS = ("env", "kernels", "tests", "decode", "tiers")
#: Seconds per part on the GPU: they sum to the default total of 490 s, which counts the imports (done once,
#: before any part, outside the parts' limits); with interpreter start-up and the beartype wheel one call
#: stays under 9 minutes. Dry-run caps are below.
CAPS = {"env": 10, "kernels": 70, "tests": 170, "decode": 150, "tiers": 90}
#: Dry run: the tests part starts a pytest process, whose start-up (torch, transformers, the beartype hook over
#: kvcompose) alone took ~55 s on a loaded 2-core machine.
DRY_CAPS = {"env": 10, "kernels": 15, "tests": 120, "decode": 40, "tiers": 40}
TOTAL_S, DRY_TOTAL_S = 490.0, 260.0
PEAK_BW = 4.8e12  # H200 HBM3e bytes/s


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (Triton interpreter); < 5 minutes")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "gpu"))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--budget-s", type=float, default=None, help="total seconds, imports included (default 490 GPU, 260 dry-run)")
    ap.add_argument("--cap", action="append", default=[], metavar="PART=SECONDS", help="override a part's limit")
    ap.add_argument("--test-targets", default=None,
                    help="comma-separated pytest targets (default: tests/kernels then the rest; "
                         "dry-run: tests/kernels/test_errors.py)")
    ap.add_argument("--baseline", default=None, help="an earlier gpu_validate.json: report tests whose outcome differs")
    ap.add_argument("--prompt-len", type=int, default=None, help="decode: prompt tokens (default 2048; dry 32)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode: new tokens (default 512; dry 32)")
    ap.add_argument("--batches", default=None, help="decode: comma-separated batch sizes (default 1,8; dry 1,2)")
    ap.add_argument("--budget", type=int, default=None, help="decode: token budget (default 1024; dry 16)")
    ap.add_argument("--interval", type=int, default=None, help="decode: compression interval (default 64; dry 8)")
    return ap.parse_args(argv)


ARGS = parse_args()
DRY = ARGS.dry_run

# -- Triton mode must be settled before anything decorates a @triton.jit kernel (kvcompose.kernels import) --
if not DRY:
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU
    os.environ["KVCOMPOSE_FORCE_REFERENCE"] = "0"

import torch  # noqa: E402

CUDA = torch.cuda.is_available()
if DRY and not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if not DRY and not CUDA:
    print("gpu_validate: no CUDA device. Use --dry-run to check the script on CPU (tiny sizes, no GPU numbers).")
    sys.exit(2)
DEV = torch.device("cuda" if CUDA else "cpu")
if not CUDA:
    torch.set_num_threads(1)  # a shared small CPU: more threads than free cores slows everything down
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))


# ================================================================================ plumbing
class PartTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise PartTimeout in the main thread after `seconds` (SIGALRM; a running CUDA kernel finishes first)."""
    def handler(signum, frame):
        raise PartTimeout(f"time limit of {seconds:.0f} s reached")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def free():
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def timer_ms(fn, warmup=3, reps=10):
    """Median ms of `fn()`: CUDA events on the GPU, perf_counter on CPU (dry-run)."""
    if CUDA:
        from gpu_kernels import _time_ms

        return _time_ms(fn, warmup=warmup, reps=reps)
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def fmt(x, spec=".3g"):
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def md_table(rows, cols):
    if not rows:
        return "(no rows)\n"
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out) + "\n"


# ================================================================================ env
def part_env(data):
    data["python"] = sys.version.split()[0]
    data["platform"] = platform.platform()
    data["torch"] = torch.__version__
    data["cuda"] = torch.version.cuda
    data["device"] = torch.cuda.get_device_name() if CUDA else "cpu"
    if CUDA:
        p = torch.cuda.get_device_properties(DEV)
        data["sms"] = p.multi_processor_count
        data["memory_gib"] = round(p.total_memory / 2**30, 1)
    import importlib.metadata
    import importlib.util

    mods = {}  # versions from the installed metadata: nothing is imported under the part's time limit
    for m in ("triton", "transformers", "jaxtyping", "beartype", "hypothesis", "pytest", "accelerate", "gguf"):
        if importlib.util.find_spec(m) is None:
            mods[m] = "MISSING"
            continue
        try:
            mods[m] = importlib.metadata.version(m)
        except importlib.metadata.PackageNotFoundError:
            mods[m] = "? (no metadata; on sys.path)"
    data["modules"] = mods
    import kvcompose
    import kvcompose.kernels as K

    data["kvcompose"] = kvcompose.__version__
    data["HAS_TRITON"] = K.HAS_TRITON
    data["TRITON_INTERPRETED"] = K.TRITON_INTERPRETED
    data["backend_on_device"] = K.backend_for_device(DEV) if CUDA else "reference (cpu)"
    data["env"] = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "KVCOMPOSE_FORCE_REFERENCE", "CUDA_VISIBLE_DEVICES")}
    from kvcompose import methods

    data["has_memory_hierarchy"] = hasattr(methods, "memory_hierarchy")
    import kvcompose.tiers as tiers

    data["has_HostTier"] = hasattr(tiers, "HostTier")
    if CUDA and K.TRITON_INTERPRETED:
        data["WARNING"] = "Triton is interpreted on the GPU: TRITON_INTERPRET was set before kvcompose.kernels loaded"
    for k, v in data.items():
        print(f"  {k}: {v}")


# ================================================================================ kernels
def _paged_case(B, H, G, D, P, T, dtype, seed=0):
    """Ragged paged storage: per-head lengths uniform in [T/2, T], shuffled page ids, ascending positions."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (B, H), device=DEV, generator=g)
    pages = (lengths + P - 1) // P
    M, N = int(pages.max()), int(pages.sum())
    perm = torch.randperm(N, device=DEV, generator=g)
    col = torch.arange(M, device=DEV)
    table = torch.full((B, H, M), -1, dtype=torch.long, device=DEV)
    table[col < pages[..., None]] = perm
    keys = torch.randn(N, P, D, device=DEV, generator=g).to(dtype)
    values = torch.randn(N, P, D, device=DEV, generator=g).to(dtype)
    positions = torch.zeros(N, P, dtype=torch.long, device=DEV)
    t = torch.arange(M * P, device=DEV).expand(B, H, M * P)
    inside = t < lengths[..., None]
    slot = table.gather(-1, (t // P).clamp(max=M - 1)).clamp(min=0) * P + t % P
    positions.view(-1)[slot[inside]] = t[inside]
    valid = torch.ones(N, P, dtype=torch.bool, device=DEV)
    q = torch.randn(B, H * G, 1, D, device=DEV, generator=g).to(dtype)
    qpos = torch.tensor([T], device=DEV)
    return dict(q=q, keys=keys, values=values, positions=positions, valid=valid, table=table, lengths=lengths,
                qpos=qpos, tokens=int(lengths.sum()))


def data_sms() -> int:
    return torch.cuda.get_device_properties(DEV).multi_processor_count if CUDA else 132


def part_kernels(data):
    import kvcompose.bench.roofline as R
    import kvcompose.kernels as K
    from kvcompose.attention import attend, build_mask
    from kvcompose.kernels.paged_attention import gather_pages
    from gpu_kernels import _cases, _max_diff, bench_kernels

    # ---- paged decode attention first (the new kernel), then the other kernels
    prow = data.setdefault("paged_attention", [])
    if CUDA:
        sizes = [(1, 4096), (8, 4096), (1, 32768), (8, 32768)]
        H, G, D, P, dtype, reps = 8, 4, 128, 16, torch.bfloat16, 10
    else:
        sizes = [(1, 40)]
        H, G, D, P, dtype, reps = 2, 2, 16, 4, torch.float32, 1
    warm = 3 if CUDA else 0
    for B, T in sizes:
        c = _paged_case(B, H, G, D, P, T, dtype)
        cfg = f"B={B} H={H} G={G} D={D} P={P} Tmax={T} {str(dtype).replace('torch.', '')}"
        elt = c["keys"].element_size()
        nbytes = c["tokens"] * (2 * D * elt + 8 + 1) + c["table"].numel() * 8 + 2 * c["q"].numel() * elt
        args = (c["q"], c["keys"], c["values"], c["positions"], c["valid"], c["table"], c["lengths"], c["qpos"], D ** -0.5)
        row = dict(config=cfg, tokens=c["tokens"], bytes=nbytes)
        try:
            with K.use_triton(True):
                auto = lambda: K.paged_decode_attention(*args, check_indices=False)  # noqa: E731
                one = lambda: K.paged_decode_attention(*args, num_splits=1, check_indices=False)  # noqa: E731
                row["triton_ms"] = timer_ms(auto, warmup=warm, reps=reps)
                row["triton_1split_ms"] = timer_ms(one, warmup=warm, reps=reps)
                out = auto()
                out1 = one()
            with K.use_triton(False):
                ref = lambda: K.paged_decode_attention(*args, check_indices=False)  # noqa: E731
                row["reference_ms"] = timer_ms(ref, warmup=1 if CUDA else 0, reps=max(1, reps // 3))
                want = ref()
            # the dense layer's path: a contiguous [B, H, T, D] cache, build_mask + attend (no gather)
            Tm = int(c["lengths"].max())
            k, inside = gather_pages(c["keys"], c["table"], c["lengths"], Tm)
            v, _ = gather_pages(c["values"], c["table"], c["lengths"], Tm)
            pos = torch.where(inside, torch.arange(Tm, device=DEV), 2**40)
            dense = lambda: attend(c["q"], k, v, build_mask(pos, inside, c["qpos"]), D ** -0.5)  # noqa: E731
            row["dense_sdpa_ms"] = timer_ms(dense, warmup=1 if CUDA else 0, reps=max(1, reps // 3))
            row["max_diff"] = float((out.float() - want.float()).abs().max())
            row["max_diff_1split"] = float((out1.float() - want.float()).abs().max())
            row["speedup_vs_reference"] = row["reference_ms"] / row["triton_ms"]
            row["speedup_vs_dense"] = row["dense_sdpa_ms"] / row["triton_ms"]
            row["gbps"] = nbytes / (row["triton_ms"] * 1e-3) / 1e9
            row["pct_peak"] = 100 * nbytes / (row["triton_ms"] * 1e-3) / PEAK_BW
            # the roofline model's prediction (kvcompose.bench.roofline: whole pages, KV-split partials)
            shape = R.ModelShape(layers=1, heads=H * G, kv_heads=H, head_dim=D, elt=elt)
            mb, _, ms = R.paged_attention_cost(shape, B, c["lengths"].reshape(-1).tolist(), page=P,
                                               sms=data_sms())
            row.update(model_bytes=mb, model_splits=ms, model_ms=1e3 * mb / PEAK_BW,
                       achieved_vs_model=(1e3 * mb / PEAK_BW) / row["triton_ms"])
            del k, v
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        prow.append(row)
        print(f"  paged {cfg:48s} triton {row.get('triton_ms', float('nan')):8.3f} ms (1 split "
              f"{row.get('triton_1split_ms', float('nan')):8.3f}) ref {row.get('reference_ms', float('nan')):8.3f} "
              f"dense {row.get('dense_sdpa_ms', float('nan')):8.3f}  {row.get('gbps', float('nan')):7.0f} GB/s "
              f"{row.get('pct_peak', float('nan')):5.1f}%  model {row.get('model_ms', float('nan')):8.3f} ms "
              f"({100 * row.get('achieved_vs_model', float('nan')):5.1f}% of it)  "
              f"diff {row.get('max_diff', float('nan')):.2e} {row.get('error', '')}")
        del c
        free()

    # ---- the other kernels (benchmarks/gpu_kernels.py)
    rows = data.setdefault("kernels", [])
    if CUDA:
        rows.extend(bench_kernels(full=False, reps=10))
    else:  # dry-run: the same cases at tiny sizes through the interpreter
        for name, cfg, nbytes, flops, fn in _cases(False, device="cpu", bw_sizes=[(1, 40)], kr_sizes=[(1, 40)], H=2, D=16):
            row = dict(kernel=name, config=cfg, bytes=nbytes)
            try:
                with K.use_triton(True):
                    t_tri = timer_ms(fn, warmup=0, reps=1)
                    a = fn()
                with K.force_reference():
                    t_ref = timer_ms(fn, warmup=0, reps=1)
                    b = fn()
                row.update(ref_ms=t_ref, triton_ms=t_tri, speedup=t_ref / t_tri, max_diff=_max_diff(a, b))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print(f"  {name:28s} {cfg:36s} {row.get('triton_ms', float('nan')):9.2f} ms {row.get('error', '')}")


# ================================================================================ tests
_LINE = re.compile(r"^(\S+::\S.*?)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_SKIP = re.compile(r"^SKIPPED \[\d+\] (.*?): (.*)$")
_DUR = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")


def _pytest(targets, limit, log):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None) if CUDA else env.setdefault("TRITON_INTERPRET", "1")
    env["KVCOMPOSE_FORCE_REFERENCE"] = "0"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    # -v (one line per test) so a run cut by the time limit can still be parsed; no -x: one failing test
    # (e.g. a tolerance made for the interpreter) must not hide the outcome of every test after it
    cmd = [sys.executable, "-m", "pytest", "--maxfail=25", "-v", "-rfEs", "--durations=10", "-p", "no:cacheprovider",
           *targets]
    t0 = time.time()
    with open(log, "a") as fh:
        fh.write(f"\n===== {' '.join(cmd)}\n")
        fh.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc, timed_out = None, True
    return rc, timed_out, time.time() - t0


def part_tests(data, limit, out):
    log = out / "pytest.log"
    if log.exists():
        log.unlink()
    try:
        import beartype  # noqa: F401  (tests/conftest.py type-checks kvcompose through jaxtyping + beartype)
    except Exception:
        data["error"] = ("beartype is missing: tests/conftest.py needs it. Carry its wheel (docs/gpu.md) "
                         "and rerun with --parts tests")
        print("  " + data["error"])
        return
    if ARGS.test_targets:
        phases = [[t for t in ARGS.test_targets.split(",") if t]]
    elif DRY:
        phases = [["tests/kernels/test_errors.py"]]
    else:
        phases = [["tests/kernels"], ["tests", "--ignore=tests/kernels"]]
    deadline = time.time() + limit
    data["phases"] = []
    for i, targets in enumerate(phases):
        left = deadline - time.time()
        if i == 0 and len(phases) > 1:
            left = min(left, 0.6 * limit)  # the kernels first, but leave the rest of the suite its share
        if left < 10:
            data["phases"].append(dict(targets=targets, skipped="no time left"))
            continue
        start = log.stat().st_size if log.exists() else 0
        rc, timed_out, secs = _pytest(targets, left, log)
        text = log.read_text(errors="replace")[start:]
        outcomes, skips, durs = {}, [], []
        for line in text.splitlines():
            m = _LINE.match(line)
            if m:
                outcomes[m.group(1)] = m.group(2)
            m = _SKIP.match(line)
            if m:
                skips.append(dict(where=m.group(1), reason=m.group(2)))
            m = _DUR.match(line)
            if m:
                durs.append(dict(seconds=float(m.group(1)), when=m.group(2), test=m.group(3)))
        counts = {}
        for o in outcomes.values():
            counts[o] = counts.get(o, 0) + 1
        tail = [ln for ln in text.splitlines() if re.match(r"^=+ .*(passed|failed|error|skipped).* =+$", ln)]
        ph = dict(targets=targets, returncode=rc, timed_out=timed_out, seconds=round(secs, 1), counts=counts,
                  failed=[k for k, v in outcomes.items() if v in ("FAILED", "ERROR")], skipped=skips,
                  slowest=durs, summary=tail[-1] if tail else None, outcomes=outcomes)
        if rc not in (0, None) and not ph["failed"]:
            ph["note"] = "pytest exited non-zero without a parsed failure (collection error?): see pytest.log"
            ph["log_tail"] = text.splitlines()[-30:]
        data["phases"].append(ph)
        print(f"  pytest {' '.join(targets)}: rc={rc} timed_out={timed_out} {secs:.0f}s {counts} "
              f"{ph['summary'] or ''}")
        for f in ph["failed"]:
            print(f"    FAILED {f}")
        for s in skips:
            print(f"    SKIPPED {s['where']}: {s['reason']}")
    if ARGS.baseline:
        try:
            base = json.loads(Path(ARGS.baseline).read_text())
            old = {}
            for ph in base["parts"]["tests"]["data"].get("phases", []):
                old.update(ph.get("outcomes", {}))
            new = {}
            for ph in data["phases"]:
                new.update(ph.get("outcomes", {}))
            data["differs_from_baseline"] = {k: dict(baseline=old[k], now=v) for k, v in new.items()
                                             if k in old and old[k] != v}
            print(f"  tests whose outcome differs from {ARGS.baseline}: {data['differs_from_baseline'] or 'none'}")
        except Exception as exc:
            data["baseline_error"] = f"{type(exc).__name__}: {exc}"


# ================================================================================ decode
_MODEL: dict = {}


def _model():
    """The part's model, built once per process (decode and tiers share it)."""
    if "model" in _MODEL:
        return _MODEL["model"], _MODEL["name"]
    if DRY:
        from kvcompose.testing import tiny_model

        model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128).to(DEV)
        name = "tiny llama (2 layers, 4 heads, 2 KV heads, head dim 16, fp32)"
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384,
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(DEV):
            model = LlamaForCausalLM(cfg)
        model = model.to(torch.bfloat16).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        n = sum(p.numel() for p in model.parameters())
        name = f"random Llama {n / 1e9:.2f}B (hidden 2048, 16 layers, 32 heads, 8 KV heads, ffn 8192, vocab 32000, bf16)"
    _MODEL.update(model=model, name=name)
    return model, name


def _presets():
    from kvcompose import methods

    small = DRY  # tiny model: windows that fit a tiny budget
    p = {
        "full": lambda: methods.full(),
        "random_attention": lambda: methods.random_attention(recent=4) if small else methods.random_attention(),
        "rkv": lambda: methods.rkv(window=4) if small else methods.rkv(),
        "vase": lambda: methods.vase(recent=4, window=4) if small else methods.vase(),
    }
    if hasattr(methods, "memory_hierarchy"):
        p["memory_hierarchy"] = (lambda: methods.memory_hierarchy(0.25, recent=4)) if small else \
            (lambda: methods.memory_hierarchy(0.25))
    return p


def _timed_events(cache):
    """A kvcompose cache whose compression events are timed between device synchronisations
    (`cache.stats.sync`): otherwise an event's wall time also holds the attention still queued before it."""
    stats = getattr(cache, "stats", None)
    if stats is not None:
        stats.sync = True
    return cache


@torch.no_grad()
def _decode(model, ids, cache, n, max_time=None, attention_mask=None):
    """Greedy-decode up to n tokens (at most `max_time` seconds: generate's own stopping criterion) with
    per-step stamps (kvcompose.models.TokenClock)."""
    from kvcompose.models import TokenClock

    clock = TokenClock(ids.device)
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids) if attention_mask is None else attention_mask,
                   past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False, temperature=None,
                   top_p=None, top_k=None, streamer=clock, pad_token_id=model.generation_config.pad_token_id,
                   max_time=max_time)
    return clock.stamps


def _rate(stamps, start=0):
    s = stamps[start:]
    return (len(s) - 1) / (s[-1] - s[0]) if len(s) > 1 and s[-1] > s[0] else float("nan")


def _slices(deadline, runs_left, floor=1.0):
    """Seconds for the next run: an equal share of what is left before `deadline` (minus a margin)."""
    return max(floor, (deadline - time.time() - 3.0) / max(1, runs_left))


def part_decode(data, limit):
    from transformers import DynamicCache

    import kvcompose.bench.roofline as R
    from kvcompose import KVComposeCache

    deadline = time.time() + limit
    prompt = ARGS.prompt_len or (32 if DRY else 2048)
    new = ARGS.new_tokens or (32 if DRY else 512)
    budget = ARGS.budget or (16 if DRY else 1024)
    interval = ARGS.interval or (8 if DRY else 64)
    batches = [int(b) for b in (ARGS.batches or ("1,2" if DRY else "1,8")).split(",")]
    model, name = _model()
    vocab = model.config.vocab_size
    data.update(model=name, prompt=prompt, new_tokens=new, budget=budget, interval=interval, batches=batches,
                note=("prompt = random token ids standing in for a reasoning trace so far; compressing methods "
                      "keep the whole prompt until decoded token `interval`, then hold budget..budget+interval. "
                      "steady tok/s counts the steps after decoded token 2*interval. Each run has an equal share "
                      "of the part's time (generate's max_time): `decoded` says how many tokens it reached. "
                      "Compression events are timed between device synchronisations (cache.stats.sync)."))
    print(f"  {name}; prompt {prompt} + {new} new tokens, budget {budget}, interval {interval}, batches {batches}")
    presets = _presets()
    data["skipped"] = [] if "memory_hierarchy" in presets else ["memory_hierarchy: not in kvcompose.methods"]
    rows = data.setdefault("rows", [])

    def make(cfg):
        if cfg == "hf_dynamic":
            model.set_attn_implementation("sdpa")
            return DynamicCache(config=model.config)
        pipe = presets[cfg]()
        return _timed_events(KVComposeCache(model, pipe, None if cfg == "full" else budget, interval=interval))

    configs = ["hf_dynamic", *presets]
    # warm-up: CUDA/cuBLAS init and the Triton kernels' compilation, outside the timed runs
    g = torch.Generator().manual_seed(1)
    wids = torch.randint(3, vocab, (1, min(prompt, 2 * budget)), generator=g).to(DEV)
    for cfg in configs:
        _decode(model, wids, make(cfg), 2 * interval + 2)
    sync()
    runs_left = len(batches) * len(configs)
    for B in batches:
        ids = torch.randint(3, vocab, (B, prompt), generator=torch.Generator().manual_seed(B)).to(DEV)
        for cfg in configs:
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            cache = make(cfg)
            slice_s = _slices(deadline, runs_left)
            runs_left -= 1
            stamps = _decode(model, ids, cache, new, max_time=slice_s)
            row = dict(config=cfg, batch=B, decoded=len(stamps), time_slice_s=round(slice_s, 1),
                       tok_s=_rate(stamps), steady_tok_s=_rate(stamps, 2 * interval))
            row["agg_tok_s"] = row["tok_s"] * B
            if isinstance(cache, KVComposeCache):
                mem = cache.memory()
                row["peak_kv_MiB"] = mem.peak["hbm"] / 2**20
                row["final_kv_MiB"] = mem.total / 2**20
                row["host_MiB"] = mem.by_tier.get("host", 0) / 2**20
                row["full_equiv_MiB"] = mem.full_cache / 2**20
                dec = stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")
                row["compress_share"] = cache.stats.compress_seconds / dec
                row["compress_calls"] = cache.stats.compress_calls
            else:
                kv = sum(l.keys.numel() * l.keys.element_size() * 2 for l in cache.layers if l.keys is not None)
                row["peak_kv_MiB"] = row["final_kv_MiB"] = kv / 2**20
            if CUDA:
                row["peak_device_GiB"] = torch.cuda.max_memory_allocated() / 2**30
            try:  # the roofline model's step at the middle of the run (kvcompose.bench.roofline)
                shape = R.ModelShape.from_config(model.config, next(model.parameters()).element_size())
                pipe = presets["full" if cfg == "hf_dynamic" else cfg]()
                st = R.step_cost(pipe, prompt + max(1, len(stamps)) // 2, budget, shape, R.H200, B, interval)
                row.update(model_step_ms=1e3 * st.predicted_s(R.H200), model_floor_ms=1e3 * st.floor_s)
                if row["steady_tok_s"] == row["steady_tok_s"] and row["steady_tok_s"] > 0:
                    row["measured_vs_model"] = (1e3 / row["steady_tok_s"]) / row["model_step_ms"]
            except Exception as exc:  # the model must not cost a measured row
                row["model_error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print(f"  B={B} {cfg:18s} {row['tok_s']:8.1f} tok/s/seq (steady {row['steady_tok_s']:8.1f}) "
                  f"{row['decoded']:5d} tokens in <= {slice_s:5.1f} s, peak KV {row['peak_kv_MiB']:8.1f} MiB "
                  f"final {row['final_kv_MiB']:8.1f} MiB compress {100 * row.get('compress_share', 0):5.1f}%",
                  flush=True)
            del cache
            free()
        base = {r["config"]: r for r in rows if r["batch"] == B}
        for r in rows:
            if r["batch"] == B:
                for ref in ("full", "hf_dynamic"):
                    if ref in base:
                        r[f"ratio_vs_{ref}"] = r["tok_s"] / base[ref]["tok_s"]
                        r[f"steady_ratio_vs_{ref}"] = r["steady_tok_s"] / base[ref]["steady_tok_s"]
    free()


# ================================================================================ tiers
class _Steps:
    """A `generate` streamer that marks the decode steps: generate hands it the prompt before the prefill and
    each new token after its step, so from the second call on every forward is a decode step."""

    def __init__(self):
        self.calls = 0

    def put(self, value):
        self.calls += 1

    def end(self):
        pass

    @property
    def decoding(self) -> bool:
        return self.calls >= 2


@contextlib.contextmanager
def _count_sdpa(steps: _Steps):
    """Counts `F.scaled_dot_product_attention` calls of the decode steps, with and without an attention mask
    (kvcompose's attention and the paged reference call it through `torch.nn.functional`)."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention
    n = {"decode_calls": 0, "decode_masked": 0}

    def spy(q, *args, **kwargs):
        if steps.decoding:
            n["decode_calls"] += 1
            mask = kwargs.get("attn_mask", args[2] if len(args) > 2 else None)
            n["decode_masked"] += mask is not None
        return real(q, *args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        yield n
    finally:
        F.scaled_dot_product_attention = real


def part_tiers(data, limit):
    from kvcompose import KVComposeCache, Prefetcher, methods

    deadline = time.time() + limit
    if not hasattr(methods, "memory_hierarchy"):
        data["skipped"] = "kvcompose.methods.memory_hierarchy does not exist"
        return
    import kvcompose.tiers as tiers

    if not hasattr(tiers, "HostTier"):
        data["skipped"] = "kvcompose.tiers.HostTier does not exist"
        return
    model, name = _model()
    vocab = model.config.vocab_size
    hbm, evict = 0.25, 0.1
    prompt, new, interval, repeats = (32, 32, 8, 2) if DRY else (1024, 256, 64, 2)
    data.update(model=name, prompt=prompt, new_tokens=new, interval=interval, hbm=hbm, evict=evict, repeats=repeats)
    ids = torch.randint(3, vocab, (1, prompt), generator=torch.Generator().manual_seed(0)).to(DEV)

    def make(cfg, itv):
        # the protected recent window must fit in the retained share at the first event (dry: prompt 32 + 8)
        pipe = methods.memory_hierarchy(1.0 - evict if cfg == "all_hbm" else hbm, evict_ratio=evict,
                                        recent=8 if DRY else 64)
        cache = KVComposeCache(model, pipe, interval=itv)
        if cfg == "host_sync":
            cache.prefetcher = Prefetcher(lookahead=0)
        return cache

    # bit identity first (the check that matters most): greedy logits over several compression events.
    # Claimed where rows are not ragged (one unpadded row: no attention mask on either side, so both take the
    # same SDPA kernel); a left-padded batch of two (masked on both sides) is recorded next to it.
    n_id = 32 if DRY else 96
    itv_id = 8 if DRY else 16
    pad = torch.ones(2, prompt, dtype=torch.long, device=DEV)
    pad[1, : prompt // 4] = 0
    ids2 = torch.randint(3, vocab, (2, prompt), generator=torch.Generator().manual_seed(1)).to(DEV).masked_fill(pad == 0, 0)
    cases = {"one_row": (ids, torch.ones_like(ids), ("all_hbm", "host", "host_sync")),
             "padded_batch": (ids2, pad, ("all_hbm", "host"))}
    ident = data.setdefault("identity", {})
    with torch.no_grad():
        for case, (x, am, cfgs) in cases.items():
            logits, masked = {}, {}
            for cfg in cfgs:
                steps = _Steps()
                with _count_sdpa(steps) as n:
                    g = model.generate(input_ids=x, attention_mask=am, past_key_values=make(cfg, itv_id),
                                       max_new_tokens=n_id, min_new_tokens=n_id, do_sample=False, temperature=None,
                                       top_p=None, top_k=None, output_logits=True, return_dict_in_generate=True,
                                       pad_token_id=model.generation_config.pad_token_id, streamer=steps)
                logits[cfg] = torch.stack(g.logits)
                masked[cfg] = dict(n)
            r = {"tokens": n_id, "interval": itv_id, "rows": int(x.shape[0]), "sdpa": masked,
                 "max_abs_logit_diff": float((logits["host"].float() - logits["all_hbm"].float()).abs().max())}
            for cfg in cfgs[1:]:
                r[f"identical_{cfg}_vs_all_hbm"] = bool(torch.equal(logits[cfg], logits["all_hbm"]))
            ident[case] = r
            print(f"  identity ({case}): " + ", ".join(f"{k[len('identical_'):]}: {v}" for k, v in r.items()
                                                       if k.startswith("identical_"))
                  + f"; max diff {r['max_abs_logit_diff']:.3g}; masked decode SDPA calls "
                  + ", ".join(f"{c} {m['decode_masked']}/{m['decode_calls']}" for c, m in masked.items()), flush=True)
    one = ident["one_row"]
    # the claim: bit-identical where rows are not ragged, and neither side masked there
    data["identical_host_vs_all_hbm"] = one["identical_host_vs_all_hbm"]
    data["identical_host_sync_vs_all_hbm"] = one["identical_host_sync_vs_all_hbm"]
    data["unmasked_on_both_sides"] = all(m["decode_masked"] == 0 for m in one["sdpa"].values())
    # what the issue asks: rows that are not ragged get no mask, on the tiered side too, and the logits are equal
    data["claim_holds"] = bool(data["unmasked_on_both_sides"] and one["identical_host_vs_all_hbm"]
                               and one["identical_host_sync_vs_all_hbm"])
    data["identity_tokens"] = n_id
    print(f"  claim (not ragged: unmasked on both sides and bit-identical): {data['claim_holds']}")
    data["max_abs_logit_diff"] = one["max_abs_logit_diff"]
    # overhead: interleaved repeats, each in its own time slice; a row is written after every repeat
    times = {c: [] for c in ("all_hbm", "host", "host_sync")}
    mem = {}
    _decode(model, ids, make("host", interval), 2 * interval + 2)  # warm-up
    runs_left = repeats * len(times)
    data["rows"] = []
    for r in range(repeats):
        for cfg in times:
            cache = make(cfg, interval)
            slice_s = _slices(deadline, runs_left)
            runs_left -= 1
            stamps = _decode(model, ids, cache, new, max_time=slice_s)
            times[cfg].append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))  # seconds per decoded token
            rep = cache.memory()
            mem[cfg] = {k: v / 2**20 for k, v in rep.by_tier.items()}
            print(f"  repeat {r} {cfg:10s} {1e3 * times[cfg][-1]:7.2f} ms/token over {len(stamps)} tokens", flush=True)
            base = statistics.median(times["all_hbm"]) if times["all_hbm"] else float("nan")
            data["rows"] = [dict(config=c, median_s_per_token=statistics.median(t), ratio_vs_all_hbm=statistics.median(t) / base,
                                 runs=t, **{f"{k}_MiB": v for k, v in mem.get(c, {}).items()})
                            for c, t in times.items() if t]
    free()


# ================================================================================ report
def write(results, out):
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_validate.json").write_text(json.dumps(results, indent=1, default=str))
    md = [f"# kvcompose GPU validation ({'DRY RUN on CPU, tiny sizes: no GPU numbers' if DRY else results['meta']['device']})",
          "", f"Run {results['meta']['time']}; total {results['meta'].get('total_s', '?')} s.", ""]
    for name, p in results["parts"].items():
        md.append(f"## {name}: {p['status']} ({p.get('seconds', 0):.0f} s of {p.get('limit_s', 0):.0f} s)")
        if p.get("error"):
            md += ["", "```", p["error"][-2000:], "```"]
        d = p.get("data", {})
        if name == "env":
            md += ["", "```", json.dumps(d, indent=1, default=str), "```"]
        elif name == "kernels":
            md += ["", md_table(d.get("kernels", []), ["kernel", "config", "ref_ms", "triton_ms", "speedup", "gbps",
                                                          "pct_peak", "tflops", "model_ms", "achieved_vs_model",
                                                          "max_diff", "error"]),
                   "Paged decode attention (bytes = K+V of the held tokens + positions/valid + page table):", "",
                   md_table(d.get("paged_attention", []), ["config", "tokens", "triton_ms", "triton_1split_ms",
                                                           "reference_ms", "dense_sdpa_ms", "speedup_vs_reference",
                                                           "speedup_vs_dense", "gbps", "pct_peak", "model_ms",
                                                           "model_splits", "achieved_vs_model", "max_diff", "error"])]
        elif name == "tests":
            for ph in d.get("phases", []):
                md += ["", f"- `{' '.join(ph.get('targets', []))}`: {ph.get('summary') or ph.get('skipped') or ''} "
                           f"counts {ph.get('counts')} rc={ph.get('returncode')} timed_out={ph.get('timed_out')}"]
                md += [f"  - FAILED `{f}`" for f in ph.get("failed", [])]
                md += [f"  - SKIPPED {s['where']}: {s['reason']}" for s in ph.get("skipped", [])]
                md += [f"  - slow: {s['seconds']}s {s['test']}" for s in ph.get("slowest", [])[:5]]
            if "differs_from_baseline" in d:
                md += ["", f"Outcome differs from the baseline: {d['differs_from_baseline'] or 'none'}"]
            if d.get("error"):
                md += ["", d["error"]]
        elif name == "decode":
            md += ["", f"{d.get('model', '')}; prompt {d.get('prompt')} + {d.get('new_tokens')} new tokens, budget "
                       f"{d.get('budget')}, interval {d.get('interval')}. {d.get('note', '')} {d.get('skipped', '')}", "",
                   md_table(d.get("rows", []), ["batch", "config", "decoded", "tok_s", "steady_tok_s", "agg_tok_s", "ratio_vs_full",
                                                "steady_ratio_vs_full", "ratio_vs_hf_dynamic", "model_step_ms",
                                                "model_floor_ms", "measured_vs_model", "compress_share",
                                                "peak_kv_MiB", "final_kv_MiB", "host_MiB", "peak_device_GiB"])]
        elif name == "tiers":
            md += ["", f"{d.get('skipped', '')} **claim holds: {d.get('claim_holds')}**. Identical logits host vs all-HBM (one unpadded row, where it is "
                       f"claimed): {d.get('identical_host_vs_all_hbm')} (lookahead 0: "
                       f"{d.get('identical_host_sync_vs_all_hbm')}), no attention mask on either side: "
                       f"{d.get('unmasked_on_both_sides')}; over {d.get('identity_tokens')} tokens;"
                       f" prompt {d.get('prompt')} + {d.get('new_tokens')} new, hbm {d.get('hbm')}, evict {d.get('evict')}", "",
                   "```", json.dumps(d.get("identity", {}), indent=1), "```", "",
                   md_table(d.get("rows", []), ["config", "median_s_per_token", "ratio_vs_all_hbm", "hbm_MiB", "host_MiB"])]
        md.append("")
    (out / "gpu_validate.md").write_text("\n".join(md))
    return "\n".join(md)


def preload() -> float:
    """Import everything the parts use, before any time limit: a limit that fires inside an import leaves a
    half-initialised module in sys.modules (e.g. torch._inductor, which kvcompose's no_trace pulls in) and
    every later part fails on it. Returns the seconds it took."""
    t0 = time.time()
    import transformers  # noqa: F401
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: F401

    import kvcompose  # noqa: F401
    import kvcompose.bench.decode  # noqa: F401
    import kvcompose.bench.roofline  # noqa: F401
    import kvcompose.kernels  # noqa: F401
    import kvcompose.tiers  # noqa: F401
    import gpu_kernels  # noqa: F401  (benchmarks/gpu_kernels.py: the kernel cases)
    return time.time() - t0


def main():
    t_start = time.time()
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in ARGS.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"unknown parts {bad}; choose from {PARTS}")
    caps = dict(DRY_CAPS if DRY else CAPS)
    for c in ARGS.cap:
        k, v = c.split("=")
        caps[k] = float(v)
    budget = ARGS.budget_s or (DRY_TOTAL_S if DRY else TOTAL_S)
    results = {"meta": dict(dry_run=DRY, device=torch.cuda.get_device_name() if CUDA else "cpu",
                            time=time.strftime("%Y-%m-%d %H:%M:%S"), parts=parts, caps=caps, budget_s=budget,
                            argv=sys.argv[1:]),
               "parts": {}}
    results["meta"]["import_s"] = round(preload(), 1)
    print(f"imports: {results['meta']['import_s']} s (outside the parts' limits)", flush=True)
    order = [p for p in PARTS if p in parts]
    for i, name in enumerate(order):
        later = sum(min(caps[p], 20) for p in order[i + 1:])  # keep a little for every later part
        limit = min(caps[name], budget - (time.time() - t_start) - later)
        entry = {"status": "skipped", "limit_s": limit, "data": {}}
        results["parts"][name] = entry
        print(f"== {name} (limit {limit:.0f} s)", flush=True)
        if limit < 5:
            entry["error"] = "no time left in the total budget"
            print("  skipped: no time left")
            continue
        t0 = time.time()
        try:
            if name == "tests":
                part_tests(entry["data"], limit, out)  # a subprocess with its own timeout
            else:
                with time_limit(limit):
                    if name in ("decode", "tiers"):  # time-sliced inside: they fit their limit
                        {"decode": part_decode, "tiers": part_tiers}[name](entry["data"], limit)
                    else:
                        {"env": part_env, "kernels": part_kernels}[name](entry["data"])
            cut = any(ph.get("timed_out") for ph in entry["data"].get("phases", []))
            entry["status"] = "failed" if entry["data"].get("error") else "timeout" if cut else "ok"
        except PartTimeout as exc:
            entry["status"] = "timeout"
            entry["error"] = str(exc)
            print(f"  TIMEOUT: {exc} (partial results kept)")
        except BaseException as exc:  # noqa: BLE001 - keep every other part
            if isinstance(exc, KeyboardInterrupt):
                raise
            entry["status"] = "failed"
            entry["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            print(f"  FAILED: {type(exc).__name__}: {exc}")
        finally:
            entry["seconds"] = time.time() - t0
            free()
            results["meta"]["total_s"] = round(time.time() - t_start, 1)
            write(results, out)
    md = write(results, out)
    print("\n" + md)
    print(f"written: {out / 'gpu_validate.json'}, {out / 'gpu_validate.md'}" + (", pytest.log" if "tests" in parts else ""))
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
