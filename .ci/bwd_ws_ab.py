"""The warp-specialised backward (kernels_cu/flash_bwd_ws.cu, dispatch.BWD_WS) against the
cp.async wgmma kernels it replaces, in one process, on the standard grid: D=128 (and 64),
nheads = 2048 / D, 16k tokens (batch x seqlen), fp16 and bf16, causal and not, plus a
GQA 4:1 case. Kernel time of the whole backward (preprocess,
dK/dV, dQ or convert) by ``cupyx.profiler.benchmark`` (``gpu_times``), BWD_WS off then on
for each point; the dK/dV launch of each mode is checked. Prints one line per point and
the ratio (cp.async time / ws time: > 1 means ws is faster), and writes JSON to $OUT.

``--variants``: the variant backwards instead (D=128, a window, softcap, ALiBi, sinks,
dropout and some of their sets; dispatch.BWD_WS on), dispatch.BWD_WS_VARIANTS off (the
cp.async kernel) then on (the ws kernel) for each point; TFLOP/s there are the nominal
dense or causal counts (a window does less).

``--d64``: the D=64 plans (PERF.md v24) on the same grid (``--quick``: S = 1024, 4096,
16384) and the GQA case, four per point (D64_PLANS): the default (the cp.async dK/dV
kernel without dQ), the ws kernel without dQ at 64 query rows per step, and at 128, each
beside the wgmma dQ kernel, and the ws kernel with its own dQ; prints the times and each
ws plan's ratio to the default. With ``--variants``: the variant cases at D=64 instead.

    python .ci/bwd_ws_ab.py [--quick] [--variants] [--head-dim 64 --head-dim 128]
    python .ci/bwd_ws_ab.py --d64 --quick [--variants]
"""
import argparse
import json
import os

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

import cupyflash
from cupyflash import _gpu, dispatch
from ws_persist_ab import launched, rand  # .ci/, the script's directory

TOKENS = 16384


def set_ws(on):
    dispatch.BWD_WS = on
    _gpu.clear_plans()


def set_ws_variants(on):
    dispatch.BWD_WS = True
    dispatch.BWD_WS_VARIANTS = dispatch.FWD_WS_VARIANTS if on else 0
    _gpu.clear_plans()


def dkdv_kernel(fn, args, kwargs):
    """The name of the dK/dV kernel one call launches."""
    names = (spec.template.rsplit("::", 1)[1] for spec in launched(fn, args, kwargs))
    return next(n for n in names if "dkdv" in n or "bwd_ws" in n)


def cases(quick, head_dims):
    rng = cp.random.default_rng(0)
    seqlens = (1024, 4096, 16384) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    out = []
    for d in head_dims:
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
    for d in head_dims:  # GQA 4:1, bf16 causal (a packed batch takes the cp.async kernels)
        h = 2048 // d
        s, b = 4096, 4
        q, do = (rand(rng, "bfloat16", b, s, h, d) for _ in range(2))
        k, v = (rand(rng, "bfloat16", b, s, h // 4, d) for _ in range(2))
        out_, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True, dtype="bfloat16")
        out.append((f"D={d:<3d} bfloat16 B=4   S=4096  causal GQA {h}:{h // 4}", cupyflash.flash_attn_bwd,
                    (do, q, k, v, out_, lse), {"causal": True, "dtype": "bfloat16"}, 2.5 * 4 * b * h * s * s * d / 2))
    return out


def variant_cases(quick, d=128):
    """D=d (128), 16k tokens, bf16 (and fp16 at 4096), causal and not: each variant the ws
    backward takes alone and three of their sets (those dispatch.bwd_ws_takes)."""
    rng = cp.random.default_rng(0)
    h = 2048 // d
    seed = (0x5EED_0FD2_0901_7ABC, 3)
    sinks = cp.asarray(np.random.default_rng(2).uniform(1.0, 6.0, h).astype(np.float32))
    slopes = cp.asarray((2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32))
    variants = {
        "window(1024,0)": {"window_size": (1024, 0)},
        "window(512,512)": {"window_size": (512, 512)},
        "softcap30": {"softcap": 30.0},
        "alibi": {"alibi_slopes": slopes},
        "sinks": {"sinks": sinks},
        "dropout0.1": {"dropout_p": 0.1, "rng_state": seed},
        "sinks+window(1024,0)": {"sinks": sinks, "window_size": (1024, 0)},
        "softcap30+dropout0.1": {"softcap": 30.0, "dropout_p": 0.1, "rng_state": seed},
        "window(1024,0)+softcap30+sinks": {"window_size": (1024, 0), "softcap": 30.0, "sinks": sinks},
    }
    seqlens = (4096, 16384) if quick else (1024, 4096, 16384)
    out = []
    for dtype in ("bfloat16", "float16"):
        kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        for causal in (False, True):
            for s in seqlens if dtype == "bfloat16" else (4096,):
                b = TOKENS // s
                q, k, v, do = (rand(rng, dtype, b, s, h, d) for _ in range(4))
                flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                for name, var in variants.items():
                    if name.startswith("window(512,512)") and causal:
                        continue
                    vkw = {"causal": causal, **kw, **var}
                    out_, lse = cupyflash.flash_attn_fwd(q, k, v, **vkw)
                    out.append((f"D={d:<3d} {dtype:8s} B={b:<3d} S={s:<5d} {'causal' if causal else 'full':6s} {name}",
                                cupyflash.flash_attn_bwd, (do, q, k, v, out_, lse), vkw, flops))
    return out


#: --d64's plans: the dispatch settings of each and whether its dQ comes from the wgmma dQ
#: kernel; the default first (every ratio is to it). "ws+dQ": the ws kernel with its own dQ
#: at D=64 (v23's 0.79-0.85x, before v24's dQ path fixes), for reference.
D64_PLANS = {
    "cp.async": ({"BWD_WS_HEAD_DIMS": (128,), "_BWD_SM90_SEPARATE_DQ": (64,)}, True),
    "ws m64": ({"BWD_WS_HEAD_DIMS": (64, 128), "BWD_WS_D64_BLOCK_M": 64}, True),
    "ws m128": ({"BWD_WS_HEAD_DIMS": (64, 128), "BWD_WS_D64_BLOCK_M": 128}, True),
    "ws+dQ": ({"BWD_WS_HEAD_DIMS": (64, 128), "_BWD_SM90_SEPARATE_DQ": ()}, False),
}


def dkdv_launch(fn, args, kwargs):
    """(name, query rows per step) of the dK/dV kernel one call launches, and whether dQ
    came from the wgmma dQ kernel."""
    specs = launched(fn, args, kwargs)
    names = [spec.template.rsplit("::", 1)[1] for spec in specs]
    dkdv = next(spec for spec, n in zip(specs, names) if "dkdv" in n or "bwd_ws" in n)
    block_m = int(dkdv.args[2]) if dkdv.source == "flash_bwd_ws.cu" else dispatch.BWD_SM90_BLOCK_M
    return dkdv.template.rsplit("::", 1)[1], block_m, "flash_bwd_dq_sm90_kernel" in names


def d64_main(a):
    """--d64: each point under each of D64_PLANS."""
    dispatch.BWD_WS = True
    dispatch.BWD_WS_VARIANTS = dispatch.FWD_WS_VARIANTS
    rows = []
    for label, fn, args, kwargs, flops in (variant_cases(a.quick, 64) if a.variants else cases(a.quick, (64,))):
        row = {"case": label}
        for plan, (settings, dq_kernel) in D64_PLANS.items():
            for name, value in settings.items():
                setattr(dispatch, name, value)
            _gpu.clear_plans()
            row[plan + " kernel"] = kernel = dkdv_launch(fn, args, kwargs)
            assert kernel[0] == ("flash_bwd_dkdv_sm90_kernel" if plan == "cp.async" else "flash_bwd_ws_kernel")
            assert kernel[2] == dq_kernel, f"{label} {plan}: {kernel}"
            r = benchmark(fn, args, kwargs, n_repeat=a.reps, n_warmup=3)
            row[plan + " ms"] = float(np.median(r.gpu_times[0])) * 1e3
        base = row["cp.async ms"]
        for plan in list(D64_PLANS)[1:]:
            row[plan + " ratio"] = base / row[plan + " ms"]
        rows.append(row)
        print(f"{label:{70 if a.variants else 44}s} " + "  ".join(
            f"{plan} {row[plan + ' ms']:8.3f} ms ({flops / row[plan + ' ms'] * 1e-9:4.0f}, "
            f"m{row[plan + ' kernel'][1]})" for plan in D64_PLANS) + "  " + "  ".join(
            f"{plan} {row[plan + ' ratio']:5.2f}x" for plan in list(D64_PLANS)[1:]), flush=True)
    for plan in list(D64_PLANS)[1:]:
        ratios = [r[plan + " ratio"] for r in rows]
        print(f"{plan} / cp.async speedup: min {min(ratios):.2f} median {float(np.median(ratios)):.2f} "
              f"max {max(ratios):.2f}")
    if os.environ.get("OUT"):
        name = "bwd_ws_ab_d64_variants.json" if a.variants else "bwd_ws_ab_d64.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(rows, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", action="store_true", help="variant backwards, BWD_WS_VARIANTS off then on")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--head-dim", type=int, action="append", choices=(64, 128),
                    help="head_dims of the plain cases (repeatable; default 128: the ws kernel's BWD_WS_HEAD_DIMS, "
                         "widened here to those asked for)")
    ap.add_argument("--d64", action="store_true", help="the D=64 plans: cp.async, ws at 64 and at 128 rows per step")
    a = ap.parse_args()
    if a.d64:
        return d64_main(a)
    head_dims = tuple(a.head_dim or (128,))
    dispatch.BWD_WS_HEAD_DIMS = tuple(sorted(set(dispatch.BWD_WS_HEAD_DIMS) | set(head_dims)))
    rows = []
    switch = set_ws_variants if a.variants else set_ws
    for label, fn, args, kwargs, flops in (variant_cases(a.quick) if a.variants else cases(a.quick, head_dims)):
        times, kernels = {}, {}
        for on in (False, True):
            switch(on)
            kernels[on] = dkdv_kernel(fn, args, kwargs)
            r = benchmark(fn, args, kwargs, n_repeat=a.reps, n_warmup=3)
            times[on] = float(np.median(r.gpu_times[0])) * 1e3
        assert kernels[True] == "flash_bwd_ws_kernel" and kernels[False] != kernels[True], kernels
        ratio = times[False] / times[True]
        rows.append({"case": label, "cp_async_ms": times[False], "ws_ms": times[True], "ratio": ratio,
                     "ws_tflops": flops / times[True] * 1e-9, "cp_async_tflops": flops / times[False] * 1e-9})
        width = 70 if a.variants else 44
        print(f"{label:{width}s} cp.async {times[False]:8.3f} ms ({rows[-1]['cp_async_tflops']:5.0f})  "
              f"ws {times[True]:8.3f} ms ({rows[-1]['ws_tflops']:5.0f})  {ratio:5.2f}x", flush=True)
    ratios = [r["ratio"] for r in rows]
    print(f"ws / cp.async speedup: min {min(ratios):.2f} median {float(np.median(ratios)):.2f} max {max(ratios):.2f}")
    if os.environ.get("OUT"):
        name = "bwd_ws_ab_variants.json" if a.variants else "bwd_ws_ab.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
