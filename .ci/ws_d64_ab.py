"""The D=64 forward on four plans, in one process: the cp.async wgmma kernel, the
warp-specialised kernel at 128 query rows per tile (two consumer warpgroups; persistent
where FWD_WS_PERSISTENT "auto" says), at 192 where that tile takes the call (three:
FlashAttention-3's hdim-64 tile; FWD_WS_WIDE_LOSES ignored), and the library's default
(dispatch.FWD_WS_D64_BLOCK_M, FWD_WS_WIDE_LOSES; PERF.md v26). Standard grid: nheads 32,
16k tokens, seqlen 1024 / 2048 / 4096 / 16384, causal or not, fp16 and bf16, and (bf16, 4096 and
16384, causal) softcap 30, ALiBi, sinks, dropout 0.1, a window (1024, 0). Kernel time by
``cupyx.profiler.benchmark`` (``gpu_times``), best of two interleaved rounds; each timed
call is asserted to launch its plan's kernel and template arguments. The kernels are
compiled up front in parallel (the disk cache). Prints a table, the speed-ups' min /
median / max over cp.async last, and writes JSON under $OUT when it is set.

    python .ci/ws_d64_ab.py [--quick]     # --quick: seqlen 4096 and 16384 only
"""
import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

import cupyflash
from cupyflash import _compile, _gpu, _launch, _variant, dispatch
from ws_persist_ab import launched  # .ci/, the script's directory

H, D, TOKENS = 32, 64, 16384
#: mode -> (FWD_WS, FWD_WS_D64_BLOCK_M, FWD_WS_WIDE_LOSES, FWD_WS_D64_WIDE_MIN_SEQLEN);
#: "default": the library's choice
MODES = {"cp.async": (False, 128, 0, 0), "ws128": ((64, 128), 128, 0, 0), "ws192": ((64, 128), 192, 0, 0),
         "default": (dispatch.FWD_WS, dispatch.FWD_WS_D64_BLOCK_M, dispatch.FWD_WS_WIDE_LOSES,
                     dispatch.FWD_WS_D64_WIDE_MIN_SEQLEN)}


def rand(rng, dtype, *shape):
    x = rng.standard_normal(shape, dtype=cp.float32)
    if dtype == "float16":
        return x.astype(cp.float16)
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)  # bf16: the top half of fp32 (truncated)


def spread(xs):
    """'min a median b max c' of speed-ups (the A/B scripts' last lines)."""
    x = sorted(xs)
    return f"min {x[0]:.3f} median {x[len(x) // 2]:.3f} max {x[-1]:.3f}"


def variant_kwargs(name):
    slopes = np.exp2(-8.0 * np.arange(1, H + 1) / H).astype(np.float32)
    return {"plain": {}, "softcap": {"softcap": 30.0}, "alibi": {"alibi_slopes": cp.asarray(slopes)},
            "sinks": {"sinks": cp.asarray(np.linspace(-1, 1, H, dtype=np.float32))},
            "dropout": {"dropout_p": 0.1}, "window": {"window_size": (1024, 0)}}[name]


def cases(quick):
    rng = cp.random.default_rng(0)
    out = []
    seqlens = (4096, 16384) if quick else (1024, 2048, 4096, 16384)
    for dtype in ("float16", "bfloat16"):
        for s in seqlens:
            for causal in (False, True):
                out.append((dtype, s, causal, "plain"))
    for s in (4096, 16384):
        for name in ("softcap", "alibi", "sinks", "dropout", "window"):
            out.append(("bfloat16", s, True, name))
    built = []
    for dtype, s, causal, name in out:
        b = TOKENS // s
        q, k, v = (rand(rng, dtype, b, s, H, D) for _ in range(3))
        kw = {"causal": causal, **variant_kwargs(name)}
        if dtype == "bfloat16":
            kw["dtype"] = "bfloat16"
        built.append(((dtype, s, causal, name), (q, k, v), kw))
    return built


def set_mode(mode):
    (dispatch.FWD_WS, dispatch.FWD_WS_D64_BLOCK_M, dispatch.FWD_WS_WIDE_LOSES,
     dispatch.FWD_WS_D64_WIDE_MIN_SEQLEN) = MODES[mode]
    _gpu.clear_plans()


def plan_of(label, mode):
    dtype, s, causal, name = label
    bits = _variant.bits(variant_kwargs(name)) if name != "plain" else 0
    set_mode(mode)
    return dispatch.select_fwd(batch=TOKENS // s, seqlen_q=s, seqlen_k=s, nheads_q=H, head_dim=D, dtype=dtype,
                               causal=causal, vec=True, num_sms=_launch.num_sms(cp.cuda.Device().id), cc=(9, 0),
                               variant=bits, ws=dispatch.FWD_WS, persistent=dispatch.FWD_WS_PERSISTENT)


def compile_one(source, name_expression):
    _compile.compile_variant(source, name_expression, (9, 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    built = cases(args.quick)
    launches = {L for label, _, _ in built for mode in MODES
                for L in (plan_of(label, mode).main, plan_of(label, mode).combine) if L is not None}
    with cf.ProcessPoolExecutor(max_workers=min(len(launches), os.cpu_count() or 1),
                                mp_context=multiprocessing.get_context("spawn")) as pool:  # no CUDA in them
        list(pool.map(compile_one, [L.source for L in launches], [L.name_expression for L in launches]))
    fn = cupyflash.flash_attn_fwd
    results = []
    print("dtype    seqlen causal variant | " + "  ".join(f"{m:>9} ms" for m in MODES)
          + " | ws128 x  ws192 x  default x")
    for label, arrays, kw in built:
        times = {m: [] for m in MODES}
        for _ in range(2):
            for mode in MODES:
                set_mode(mode)
                got = launched(fn, arrays, kw)
                want = plan_of(label, mode).main
                assert got[0].template == want.template and got[0].args == want.args, (mode, got[0], want)
                assert mode == "cp.async" or got[0].template == "cupyflash::flash_fwd_ws_kernel", (mode, got[0])
                r = benchmark(fn, arrays, kw, n_repeat=20, n_warmup=3)
                times[mode].append(float(np.median(r.gpu_times)) * 1e3)
        best = {m: min(t) for m, t in times.items()}
        dtype, s, causal, name = label
        flops = 4 * TOKENS * s * H * D / (2 if causal else 1)
        row = {"dtype": dtype, "seqlen": s, "causal": causal, "variant": name,
               **{f"{m}_ms": best[m] for m in MODES},
               **{f"{m}_tflops": flops / best[m] / 1e9 for m in MODES}}
        results.append(row)
        print(f"{dtype:8} {s:6d} {causal!s:6} {name:7} | " + "  ".join(f"{best[m]:12.4f}" for m in MODES)
              + "".join(f" {best['cp.async'] / best[m]:8.3f}" for m in ("ws128", "ws192", "default"))
              + f"  (default: {plan_of(label, 'default').main.args[2]} rows)")
    for m in ("ws128", "ws192", "default"):
        print(f"{m} / cp.async speed-up: " + spread(r["cp.async_ms"] / r[f"{m}_ms"] for r in results))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ws_d64_ab.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
