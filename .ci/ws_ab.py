"""The warp-specialised forward against the cp.async wgmma forward, in one process:
dense standard-grid shapes and packed (varlen) batches, D=128, fp16, 16 heads; kernel
time by ``cupyx.profiler.benchmark`` (the same call with ``dispatch.FWD_WS`` on and off).

    python .ci/ws_ab.py
"""
import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

import cupyflash
from cupyflash import _gpu, dispatch

rng = cp.random.default_rng(0)
h, d = 16, 128


def timed(fn, args, kwargs):
    out = {}
    for ws in (False, (128,), False, (128,)):
        dispatch.FWD_WS = ws
        _gpu.clear_plans()
        fn(*args, **kwargs)
        r = benchmark(fn, args, kwargs, n_repeat=50, n_warmup=5)
        out.setdefault(bool(ws), []).append(float(r.gpu_times.mean()) * 1e3)
    return min(out[False]), min(out[True])


def rand(*shape):
    return rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16)


print("case                     causal | cp.async ms  ws ms  ws speed-up  ws TF")
for causal in (False, True):
    for s in (512, 2048, 8192):
        b = 16384 // s
        q, k, v = rand(b, s, h, d), rand(b, s, h, d), rand(b, s, h, d)
        old, new = timed(cupyflash.flash_attn_fwd, (q, k, v), {"causal": causal})
        tf = 4 * b * h * s * s * d / (2 if causal else 1) / new / 1e9
        print(f"dense B={b:<3d} S={s:<5d}        {causal!s:6} | {old:9.4f} {new:7.4f} {old / new:9.3f} {tf:8.0f}")
    for lo, hi in ((256, 1024), (1024, 2048), (2048, 8192)):
        lens = np.random.default_rng(1).integers(lo, hi + 1, size=16384 // ((lo + hi) // 2))
        cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        total, mx = int(lens.sum()), int(lens.max())
        q, k, v = rand(total, h, d), rand(total, h, d), rand(total, h, d)
        old, new = timed(cupyflash.flash_attn_varlen_fwd, (q, k, v, cu, cu, mx, mx), {"causal": causal})
        pairs = float((lens.astype(np.float64) ** 2).sum()) / (2 if causal else 1)
        tf = 4 * h * pairs * d / new / 1e9
        print(f"varlen {len(lens):3d} seqs {lo}-{hi:<5d} {causal!s:6} | {old:9.4f} {new:7.4f} {old / new:9.3f} {tf:8.0f}")
