"""The bias backward (``flash_attn_bwd(..., attn_bias=)``) with ``dispatch.BWD_WS_BIAS`` on at
every head_dim (the ws kernel with the bias's TMA stages) and off (the cp.async wgmma or the
mma.sync dK/dV kernels), one process: bf16, 16k tokens, nheads 2048/head_dim, causal or not,
a per-head (1, H, N, N) and a per-batch (B, 1, N, N) bias, the backward with dbias
(``return_dbias=True``) and without, beside the plain backward. With dbias, ``ws_dbias`` runs
the ws dbias kernel where it serves (``dispatch.BWD_DBIAS_WS`` at its head_dims), and
``ws_olddbias`` the ws backward with the strip or tile dbias kernels (``BWD_DBIAS_WS = ()``).

Each time is ``cupyx.profiler.benchmark``'s median of 10 GPU times, best of two rounds, on
and off interleaved. Prints one JSON line per case and writes them to
$OUT/ws_bias_bwd_ab.json when $OUT is set.

    python .ci/ws_bias_bwd_ab.py [--head-dim 128 64] [--seqlen 4096 8192] [--causal 0 1]
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


def gpu_ms(fn, reps=10):
    return float(np.median(benchmark(fn, n_repeat=reps, n_warmup=2).gpu_times[0])) * 1e3


def bf16_bits(x):
    """A float32 device array's bfloat16 storage (truncated), as the API takes it (uint16)."""
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)


def switch(on, ws_dbias=True):
    dispatch.BWD_WS_BIAS = dispatch.BWD_WS_HEAD_DIMS if on else ()
    dispatch.BWD_DBIAS_WS = dispatch.BWD_DBIAS_WS_HEAD_DIMS if ws_dbias else ()
    _gpu.clear_plans()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128, 64, 256, 192])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--shapes", nargs="+", default=["heads", "batch"])
    args = ap.parse_args()
    rows = []
    for d in args.head_dim:
        h = 2048 // d
        for n in args.seqlen:
            b = TOKENS // n
            for causal in map(bool, args.causal):
                rs = np.random.default_rng(0)
                q, k, v, dout = (bf16_bits(cp.asarray(rs.standard_normal((b, n, h, d), dtype=np.float32)))
                                 for _ in range(4))
                kw = dict(causal=causal, dtype="bfloat16")
                out, lse = cupyflash.flash_attn_fwd(q, k, v, **kw)
                plain = gpu_ms(lambda: cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, **kw))
                for shape in args.shapes:
                    bias = bf16_bits(cp.asarray(rs.standard_normal((1, h, n, n) if shape == "heads" else (b, 1, n, n),
                                                                   dtype=np.float32)))
                    out, lse = cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias, **kw)
                    row = {"head_dim": d, "seqlen": n, "causal": causal, "bias": shape, "plain": plain}
                    for dbias in (False, True):
                        def bwd():
                            return cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, attn_bias=bias,
                                                            return_dbias=dbias, **kw)
                        modes = [("ws", True, True), ("off", False, True)]
                        if dbias and d in dispatch.BWD_DBIAS_WS_HEAD_DIMS:
                            modes.append(("ws_olddbias", True, False))
                        for _ in range(2):
                            for name, on, ws_dbias in modes:
                                switch(on, ws_dbias)
                                key = f"{name}_dbias" if dbias and name != "ws_olddbias" else name
                                row[key] = min(row.get(key, float("inf")), gpu_ms(bwd))
                    switch(True)
                    row["speedup"] = row["off"] / row["ws"]
                    row["speedup_dbias"] = row["off_dbias"] / row["ws_dbias"]
                    if "ws_olddbias" in row:
                        row["dbias_kernel_speedup"] = row["ws_olddbias"] / row["ws_dbias"]
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    del bias
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ws_bias_bwd_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
