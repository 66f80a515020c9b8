"""A/B of the backward at head_dim 192 and 256: the warp-specialised kernel split by roles
(dispatch.bwd_ws_roles) against the mma.sync kernels it replaced there, one process,
interleaved, through the public API (cupyflash.flash_attn_bwd), kernel time (cupyx
benchmark, best of 3 rounds), 16k tokens, nheads 2048 / head_dim. The two paths' gradients
are compared at 1024. Prints a table and the speed-ups last; JSON under $OUT.

    python .ci/bwd_wide_ab.py
"""
import concurrent.futures as cf, json, multiprocessing, os, sys
import cupy as cp, numpy as np
from cupyx.profiler import benchmark
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cupyflash
from cupyflash import _compile, _gpu, _gpu_bwd, _launch, dispatch
from ws_d64_ab import rand, spread

TOKENS = 16384
DEFAULT = dispatch.BWD_WS_HEAD_DIMS
CONFIGS = {"mma.sync": tuple(d for d in DEFAULT if not dispatch.bwd_ws_roles(d)), "ws roles": DEFAULT}


def use(name):
    dispatch.BWD_WS_HEAD_DIMS = CONFIGS[name]
    _gpu.clear_plans()
    _gpu_bwd.clear_plans()


def as_f32(x):
    return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32) if x.dtype == cp.uint16 else x.astype(cp.float32)


def compile_one(source, name):
    _compile.compile_variant(source, name, (9, 0))


def precompile(cases):
    """Every launch of both paths' plans, compiled in parallel (NVRTC) before timing."""
    jobs = set()
    for n in CONFIGS:
        use(n)
        for d, dt, s, c in cases:
            plan = dispatch.select_bwd(batch=TOKENS // s, seqlen_q=s, seqlen_k=s, nheads_q=2048 // d,
                                       nheads_kv=2048 // d, head_dim=d, dtype=dt, causal=c, deterministic=False,
                                       vec=True, num_sms=_launch.num_sms(0), cc=(9, 0))
            jobs.update((L.source, L.name_expression) for L in plan.launches)
            fwd = dispatch.select_fwd(batch=TOKENS // s, seqlen_q=s, seqlen_k=s, nheads_q=2048 // d, head_dim=d,
                                      dtype=dt, causal=c, vec=True, num_sms=_launch.num_sms(0), cc=(9, 0),
                                      ws=dispatch.FWD_WS, persistent=dispatch.FWD_WS_PERSISTENT)
            jobs.update((L.source, L.name_expression) for L in (fwd.main, fwd.combine) if L is not None)
    with cf.ProcessPoolExecutor(max_workers=15, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(compile_one, *zip(*jobs)))


def main():
    precompile([(d, dt, s, c) for d in (256, 192) for dt in ("bfloat16", "float16") for s in (1024, 4096, 16384)
                for c in (False, True)])
    rng = cp.random.default_rng(0)
    rows = []
    print("D  dtype  seqlen causal | " + " ".join(f"{n:>9}" for n in CONFIGS) + " | mma.sync / ws  TFLOP/s(ws)")
    for d in (256, 192):
        for dt in ("bfloat16", "float16"):
            for s in (1024, 4096, 16384):
                for c in (False, True):
                    h = 2048 // d
                    q, k, v, dout = (rand(rng, dt, TOKENS // s, s, h, d) for _ in range(4))
                    kw = {"causal": c, **({"dtype": "bfloat16"} if dt == "bfloat16" else {})}
                    out, lse = cupyflash.flash_attn_fwd(q, k, v, **kw)
                    args = (dout, q, k, v, out, lse)
                    t = {n: [] for n in CONFIGS}
                    for _ in range(3):
                        for n in CONFIGS:
                            use(n)
                            r = benchmark(cupyflash.flash_attn_bwd, args, kw, n_repeat=10, n_warmup=2)
                            t[n].append(float(np.median(r.gpu_times)) * 1e3)
                    best = {n: min(x) for n, x in t.items()}
                    if s == 1024:
                        grads = {}
                        for n in CONFIGS:
                            use(n)
                            grads[n] = [as_f32(g) for g in cupyflash.flash_attn_bwd(*args, **kw)]
                        for a, b in zip(*grads.values()):
                            err = float(cp.abs(a - b).max()) / max(float(cp.abs(b).max()), 1e-6)
                            assert err < 3e-2 and bool(cp.isfinite(a).all()), err
                    flops = 4 * TOKENS * s * h * d * 2.5 * (0.5 if c else 1)
                    row = dict(head_dim=d, dtype=dt, seqlen=s, causal=c, **{f"{n}_ms": best[n] for n in CONFIGS},
                               speedup=best["mma.sync"] / best["ws roles"], tflops=flops / best["ws roles"] / 1e9)
                    rows.append(row)
                    print(f"{d} {dt[:4]} {s:6d} {c!s:5} | " + " ".join(f"{best[n]:9.4f}" for n in CONFIGS)
                          + f" | {row['speedup']:.3f}  {row['tflops']:.0f}", flush=True)
    for d in (256, 192):
        print(f"D={d}: ws roles / mma.sync " + spread(r["speedup"] for r in rows if r["head_dim"] == d))
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "bwd_wide_ab.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
