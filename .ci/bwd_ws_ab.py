"""The warp-specialised backward (kernels_cu/flash_bwd_ws.cu, dispatch.BWD_WS) against the
cp.async wgmma kernels it replaces, in one process, on the standard grid: D=64 and 128,
nheads = 2048 / D, 16k tokens (batch x seqlen), fp16 and bf16, causal and not, plus a
packed (varlen) batch and a GQA 4:1 case. Kernel time of the whole backward (preprocess,
dK/dV, dQ or convert) by ``cupyx.profiler.benchmark`` (``gpu_times``), BWD_WS off then on
for each point; the dK/dV launch of each mode is checked. Prints one line per point and
the ratio (cp.async time / ws time: > 1 means ws is faster), and writes JSON to $OUT.

    python .ci/bwd_ws_ab.py [--quick]
"""
import argparse
import json
import os

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

import cupyflash
from cupyflash import _gpu, dispatch

TOKENS = 16384


def rand(rng, dtype, *shape):
    x = rng.standard_normal(shape, dtype=cp.float32)
    if dtype == "float16":
        return x.astype(cp.float16)
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)  # bf16: the top half of fp32 (truncated)


def set_ws(on):
    dispatch.BWD_WS = on
    _gpu.clear_plans()


def dkdv_kernel(fn, args, kwargs):
    names = []
    real = cupyflash._launch.Launcher.__call__

    def call(self, stream, *pointers, var=None):
        names.extend(spec.template.rsplit("::", 1)[1] for spec in self.launches)
        real(self, stream, *pointers, var=var)

    cupyflash._launch.Launcher.__call__ = call
    try:
        fn(*args, **kwargs)
    finally:
        cupyflash._launch.Launcher.__call__ = real
    return next(n for n in names if "dkdv" in n or "bwd_ws" in n)


def cases(quick):
    rng = cp.random.default_rng(0)
    seqlens = (1024, 4096, 16384) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    out = []
    for d in (64, 128):
        h = 2048 // d
        for dtype in ("float16", "bfloat16"):
            kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
            for causal in (False, True):
                for s in seqlens:
                    b = TOKENS // s
                    q, k, v, do = (rand(rng, dtype, b, s, h, d) for _ in range(4))
                    out_, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal, **kw)
                    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                    out.append((f"D={d:<3d} {dtype:8s} B={b:<3d} S={s:<5d} {'causal' if causal else 'full':6s}",
                                cupyflash.flash_attn_bwd, (do, q, k, v, out_, lse), {"causal": causal, **kw}, flops))
    for d in (64, 128):  # GQA 4:1 and a packed batch, bf16 causal
        h = 2048 // d
        s, b = 4096, 4
        q, do = (rand(rng, "bfloat16", b, s, h, d) for _ in range(2))
        k, v = (rand(rng, "bfloat16", b, s, h // 4, d) for _ in range(2))
        out_, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True, dtype="bfloat16")
        out.append((f"D={d:<3d} bfloat16 B=4   S=4096  causal GQA {h}:{h // 4}", cupyflash.flash_attn_bwd,
                    (do, q, k, v, out_, lse), {"causal": True, "dtype": "bfloat16"}, 2.5 * 4 * b * h * s * s * d / 2))
        lens = np.random.default_rng(1).integers(256, 2049, size=TOKENS // 1152)
        cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        total, mx = int(lens.sum()), int(lens.max())
        q, k, v, do = (rand(rng, "bfloat16", total, h, d) for _ in range(4))
        out_, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, cu, cu, mx, mx, causal=True, dtype="bfloat16")
        flops = 2.5 * 4 * h * d * float((lens.astype(np.float64) ** 2 / 2).sum())
        out.append((f"D={d:<3d} bfloat16 varlen {len(lens)} seqs causal", cupyflash.flash_attn_varlen_bwd,
                    (do, q, k, v, out_, lse, cu, cu, mx, mx), {"causal": True, "dtype": "bfloat16"}, flops))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    rows = []
    for label, fn, args, kwargs, flops in cases(a.quick):
        times, kernels = {}, {}
        for on in (False, True):
            set_ws(on)
            kernels[on] = dkdv_kernel(fn, args, kwargs)
            r = benchmark(fn, args, kwargs, n_repeat=a.reps, n_warmup=3)
            times[on] = float(np.median(r.gpu_times[0])) * 1e3
        assert kernels[True] == "flash_bwd_ws_kernel" and kernels[False] != kernels[True], kernels
        ratio = times[False] / times[True]
        rows.append({"case": label, "cp_async_ms": times[False], "ws_ms": times[True], "ratio": ratio,
                     "ws_tflops": flops / times[True] * 1e-9, "cp_async_tflops": flops / times[False] * 1e-9})
        print(f"{label:44s} cp.async {times[False]:8.3f} ms ({rows[-1]['cp_async_tflops']:5.0f})  "
              f"ws {times[True]:8.3f} ms ({rows[-1]['ws_tflops']:5.0f})  {ratio:5.2f}x", flush=True)
    ratios = [r["ratio"] for r in rows]
    print(f"ws / cp.async speedup: min {min(ratios):.2f} median {float(np.median(ratios)):.2f} max {max(ratios):.2f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bwd_ws_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
