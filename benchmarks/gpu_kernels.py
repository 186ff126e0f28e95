"""GPU micro-benchmarks of the kvcompose kernels: Triton vs the PyTorch reference.

``bench_kernels()`` times every kernel on CUDA (torch.cuda.Event, warmup, median of
``reps``) at realistic sizes (H=8, D=128, bf16, B up to 8, T up to 32768), checks the
two paths agree, and prints the time ratio and the achieved bandwidth
(minimum bytes moved / time) against the H200's ~4.8 TB/s.  Key redundancy is
compute-bound (2*T^2*D flops per head), so its TFLOP/s is printed too.

On a machine without CUDA it prints "no CUDA" and returns 0.

    python benchmarks/gpu_kernels.py            # quick set
    python benchmarks/gpu_kernels.py --full     # all sizes
"""

import statistics
import sys

import torch

PEAK_BW = 4.8e12  # H200 HBM3e, bytes/s
PEAK_FLOPS = 790e12  # H200 bf16 matrix, flop/s (as measured on such machines)


def _time_ms(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _max_diff(x, y):
    if isinstance(x, (tuple, list)):
        return max(_max_diff(a, b) for a, b in zip(x, y))
    if hasattr(x, "codes"):  # QTensor: compare the dequantized values
        return _max_diff(x.dequantize(torch.float32), y.dequantize(torch.float32))
    return float((x.float() - y.float()).abs().max())


def _cases(full, device="cuda", bw_sizes=None, kr_sizes=None, H=8, D=128):
    """(kernel name, config string, bytes moved, flops or 0, thunk) per case."""
    import kvcompose.kernels as K

    dev, bf16 = torch.device(device), torch.bfloat16
    if bw_sizes is None:
        bw_sizes = [(1, 4096), (4, 16384), (8, 32768)] if full else [(1, 4096), (8, 32768)]
    if kr_sizes is None:
        kr_sizes = [(1, 4096), (1, 16384), (2, 32768)] if full else [(1, 4096), (1, 16384)]
    cases = []
    for B, T in bw_sizes:
        g = torch.Generator(device=dev).manual_seed(0)
        keys = torch.randn(B, H, T, D, device=dev, dtype=bf16, generator=g)
        values = torch.randn(B, H, T, D, device=dev, dtype=bf16, generator=g)
        n, e = B * H * T * D, 2
        cfg = f"B={B} H={H} T={T} D={D} bf16"
        # compact: keep half, sorted; out-of-place (in place needs a fresh copy per call).
        Kk = T // 2
        idx = torch.sort(torch.rand(B, H, T, device=dev).argsort(-1)[..., :Kk], -1).values
        cases.append(("compact", cfg + f" K={Kk}", 2 * 2 * B * H * Kk * D * e + idx.numel() * 8, 0,
                      lambda k=keys, v=values, i=idx: K.compact(k, v, i, check_indices=False)))
        for kind in ("range", "l2"):
            cases.append((f"value_magnitude[{kind}]", cfg, n * e + B * H * T * 4, 0,
                          lambda v=values, kd=kind: K.value_magnitude(v, kd)))
        Wn, G = 32, 4
        q = torch.randn(B, H * G, Wn, D, device=dev, dtype=bf16, generator=g)
        kpos = torch.arange(T, device=dev).expand(B, H, T).contiguous()
        kval = torch.ones(B, H, T, dtype=torch.bool, device=dev)
        qpos = torch.arange(T - Wn, T, device=dev)
        qval = torch.ones(B, Wn, dtype=torch.bool, device=dev)
        for gqa in ("mean", "max"):
            cases.append((f"window_scores[{gqa},avg5]", cfg + f" W={Wn} G={G}",
                          n * e + q.numel() * e + B * H * T * (8 + 1 + 4), 4 * B * H * G * Wn * T * D,
                          lambda gq=gqa, q=q, k=keys, kp=kpos, kv=kval, qp=qpos, qv=qval: K.window_attention_scores(
                              q, k, kp, kv, qp, qv, D ** -0.5, gqa=gq, pool="avg", kernel=5)))
        for bits, axis, x in ((4, "channel", keys), (4, "token", values), (8, "channel", keys)):
            code_bytes = n // 2 if bits == 4 else n
            stat_bytes = 2 * 4 * (n // 32)
            qt = K.quantize(x, bits, 32, axis)
            cases.append((f"quantize[{bits}b,{axis}]", cfg, n * e + code_bytes + stat_bytes, 0,
                          lambda x=x, b=bits, a=axis: K.quantize(x, b, 32, a)))
            cases.append((f"dequantize[{bits}b,{axis}]", cfg, n * e + code_bytes + stat_bytes, 0,
                          lambda qt=qt: K.dequantize(qt)))
    for B, T in kr_sizes:
        g = torch.Generator(device=dev).manual_seed(1)
        keys = torch.randn(B, H, T, D, device=dev, dtype=bf16, generator=g)
        valid = torch.ones(B, H, T, dtype=torch.bool, device=dev)
        for prec in ("ieee", "tf32"):
            cases.append((f"key_redundancy[{prec}]", f"B={B} H={H} T={T} D={D} bf16",
                          B * H * T * (D * 2 + 1 + 4), 2 * B * H * T * T * D,
                          lambda k=keys, v=valid, p=prec: K.key_redundancy(k, v, 0.5, precision=p)))
    return cases


def bench_kernels(full=False, reps=10):
    """Time each kernel (Triton vs reference) on CUDA; returns a list of result dicts
    (empty without CUDA, after printing "no CUDA")."""
    if not torch.cuda.is_available():
        print("no CUDA")
        return []
    import kvcompose.kernels as K

    if not K.HAS_TRITON:
        print("no triton: only the reference path exists")
        return []
    print(f"device: {torch.cuda.get_device_name()}  (bandwidth vs {PEAK_BW / 1e12:.1f} TB/s)")
    hdr = f"{'kernel':28s} {'config':36s} {'ref ms':>9s} {'triton ms':>10s} {'speedup':>8s} {'GB/s':>8s} {'%peak':>6s} {'TFLOP/s':>8s} {'maxdiff':>9s}"
    print(hdr)
    results = []
    for name, cfg, nbytes, flops, fn in _cases(full):
        row = dict(kernel=name, config=cfg, bytes=nbytes, flops=flops)
        try:
            with K.use_triton(True):
                t_tri = _time_ms(fn, reps=reps)
                out_tri = fn()
            with K.force_reference():
                try:
                    t_ref = _time_ms(fn, warmup=1, reps=max(3, reps // 3))
                    out_ref = fn()
                    diff = _max_diff(out_tri, out_ref)
                except torch.cuda.OutOfMemoryError:
                    t_ref, diff = float("nan"), float("nan")
                    torch.cuda.empty_cache()
        except Exception as exc:  # keep going: report the failure in the table
            print(f"{name:28s} {cfg:36s} FAILED: {type(exc).__name__}: {exc}")
            row["error"] = f"{type(exc).__name__}: {exc}"
            results.append(row)
            continue
        bw = nbytes / (t_tri * 1e-3)
        tf = flops / (t_tri * 1e-3) / 1e12 if flops else 0.0
        # the roofline (docs/gpu.md): the kernel at the higher of its two roofs, HBM and bf16 matrix
        model_ms = 1e3 * max(nbytes / PEAK_BW, flops / PEAK_FLOPS)
        row.update(ref_ms=t_ref, triton_ms=t_tri, speedup=t_ref / t_tri, gbps=bw / 1e9,
                   pct_peak=100 * bw / PEAK_BW, tflops=tf, max_diff=diff, model_ms=model_ms,
                   achieved_vs_model=model_ms / t_tri)
        results.append(row)
        print(f"{name:28s} {cfg:36s} {t_ref:9.3f} {t_tri:10.3f} {t_ref / t_tri:8.2f} {bw / 1e9:8.0f} "
              f"{100 * bw / PEAK_BW:6.1f} {tf:8.1f} {diff:9.2e}")
        torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    bench_kernels(full="--full" in sys.argv)
    sys.exit(0)
