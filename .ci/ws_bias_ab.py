"""The bias forward (``flash_attn_fwd(..., attn_bias=)``) of kernel trees in one process, and,
in the first tree, with ``dispatch.FWD_WS_BIAS`` off (the cp.async wgmma kernel at 64 and 128,
the mma.sync kernel at 192 and 256), beside the plain forward: bf16, 16k tokens, nheads
2048/head_dim, causal or not, a per-head (1, H, N, N) and a per-batch (B, 1, N, N) bias.

Each time is ``cupyx.profiler.benchmark``'s median of 20 GPU times, best of two rounds, the
trees interleaved (switching tree swaps the kernel directory, the loaded modules and the
plan caches: tree_ab.use_tree). The ws trees run with FWD_WS_BIAS on at every head_dim.
Prints one JSON line per case and writes them to $OUT/ws_bias_ab.json when $OUT is set.
PERF.md v30's runs 141-143 ran the uncommitted script this was made from.

    python .ci/ws_bias_ab.py kernels_cu [out/base/kernels_cu ...] [--head-dim 128 64] [--seqlen 4096 8192]
"""
import argparse
import json
import os

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

import cupyflash
from cupyflash import _gpu, dispatch
from tree_ab import use_tree  # .ci/, the script's directory

TOKENS = 16384


def gpu_ms(fn, reps=20):
    return float(np.median(benchmark(fn, n_repeat=reps, n_warmup=3).gpu_times[0])) * 1e3


def bf16_bits(x):
    """A float32 device array's bfloat16 storage (truncated), as the API takes it (uint16)."""
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128, 64, 256, 192])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 8192])
    args = ap.parse_args()
    rows = []
    for d in args.head_dim:
        h = 2048 // d
        for n in args.seqlen:
            b = TOKENS // n
            for causal in (False, True):
                rs = np.random.default_rng(0)
                q, k, v = (bf16_bits(cp.asarray(rs.standard_normal((b, n, h, d), dtype=np.float32)))
                           for _ in range(3))
                for shape in ("heads", "batch"):
                    bias = bf16_bits(cp.asarray(rs.standard_normal((1, h, n, n) if shape == "heads" else (b, 1, n, n),
                                                                   dtype=np.float32)))

                    def fwd():
                        return cupyflash.flash_attn_fwd(q, k, v, causal=causal, attn_bias=bias, dtype="bfloat16")

                    row = {"head_dim": d, "seqlen": n, "causal": causal, "bias": shape}
                    for _ in range(2):
                        for tree in args.trees:
                            use_tree(tree)
                            dispatch.FWD_WS_BIAS = True
                            _gpu.clear_plans()
                            row[tree] = min(row.get(tree, float("inf")), gpu_ms(fwd))
                        use_tree(args.trees[0])
                        dispatch.FWD_WS_BIAS = False
                        _gpu.clear_plans()
                        row["off"] = min(row.get("off", float("inf")), gpu_ms(fwd))
                    dispatch.FWD_WS_BIAS = True
                    _gpu.clear_plans()
                    row["plain"] = gpu_ms(lambda: cupyflash.flash_attn_fwd(q, k, v, causal=causal, dtype="bfloat16"))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    del bias
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ws_bias_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
