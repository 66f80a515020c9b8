"""A/B of the ws forward's key-block size at head_dim 192 and 256 (PERF.md v28, run 130), one
process, interleaved, through the public API, kernel time (cupyx benchmark, best of 3 rounds).
Each config patches dispatch._FWD_WS[d] (and FWD_WS_PERSISTENT) and clears the plans; edit
CONFIGS to try other tiles. Prints a table and the speed-ups over "base" last; JSON under $OUT.

    python .ci/ws_tile_ab.py
"""
import concurrent.futures as cf, json, multiprocessing, os, sys
import cupy as cp, numpy as np
from cupyx.profiler import benchmark
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cupyflash
from cupyflash import _compile, _gpu, _launch, dispatch
from ws_d64_ab import rand, spread

TOKENS = 16384
DEFAULT = dict(dispatch._FWD_WS)
# (run 130 compared 192 x 64 x 3 against 112 x 2, and 256 x 64 x 2 against 80 x 2: since
# landed, 192's base is 112 keys, and 80 keys at 256 needs the m64n80 wgmma that was removed)
WIDE = {256: ((64, 2), (64, 2)), 192: ((64, 3), (64, 3))}
CONFIGS = {  # name -> (head_dim -> table entry, persistent)
    "base": ({}, "auto"),
    "base_np": ({}, False),
    "other_np": (WIDE, False),
    "other_p": (WIDE, "auto"),
}
def use(name):
    table, pers = CONFIGS[name]
    dispatch._FWD_WS.clear(); dispatch._FWD_WS.update(DEFAULT); dispatch._FWD_WS.update(table)
    dispatch.FWD_WS_PERSISTENT = pers
    _gpu.clear_plans()

def plan(d, dtype, s, causal):
    return dispatch.select_fwd(batch=TOKENS // s, seqlen_q=s, seqlen_k=s, nheads_q=2048 // d, head_dim=d, dtype=dtype,
                               causal=causal, vec=True, num_sms=_launch.num_sms(0), cc=(9, 0), ws=dispatch.FWD_WS,
                               persistent=dispatch.FWD_WS_PERSISTENT)

def compile_one(source, name):
    _compile.compile_variant(source, name, (9, 0))

def main():
    cases = [(d, dt, s, c) for d in (256, 192) for dt in ("float16", "bfloat16") for s in (1024, 4096, 16384) for c in (False, True)]
    jobs = set()
    for name in CONFIGS:
        use(name)
        for cs in cases:
            L = plan(*cs).main
            jobs.add((L.source, L.name_expression))
    with cf.ProcessPoolExecutor(max_workers=15, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(compile_one, *zip(*jobs)))
    rng = cp.random.default_rng(0)
    rows = []
    print("D  dtype  seqlen causal | " + " ".join(f"{n:>9}" for n in CONFIGS) + " | base / each")
    for d, dt, s, c in cases:
        h = 2048 // d
        arrays = tuple(rand(rng, dt, TOKENS // s, s, h, d) for _ in range(3))
        kw = {"causal": c, **({"dtype": "bfloat16"} if dt == "bfloat16" else {})}
        t = {n: [] for n in CONFIGS}
        for _ in range(3):
            for n in CONFIGS:
                use(n)
                r = benchmark(cupyflash.flash_attn_fwd, arrays, kw, n_repeat=20, n_warmup=3)
                t[n].append(float(np.median(r.gpu_times)) * 1e3)
        best = {n: min(v) for n, v in t.items()}
        if s == 1024:  # the tiles agree (fp32 softmax either way; outputs in the inputs' dtype)
            outs = {}
            for n in CONFIGS:
                use(n)
                o = cupyflash.flash_attn_fwd(*arrays, **kw)[0]
                outs[n] = (o.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32) if dt == "bfloat16" else o.astype(cp.float32)
            for n in CONFIGS:
                err = float(cp.abs(outs[n] - outs["base"]).max())
                assert err < 2e-2 and bool(cp.isfinite(outs[n]).all()), (n, err)
        row = dict(head_dim=d, dtype=dt, seqlen=s, causal=c, **{f"{n}_ms": best[n] for n in CONFIGS},
                   **{f"{n}_speedup": best["base"] / best[n] for n in CONFIGS})
        rows.append(row)
        print(f"{d} {dt[:4]} {s:6d} {c!s:5} | " + " ".join(f"{best[n]:9.4f}" for n in CONFIGS) + " | "
              + " ".join(f"{row[n + '_speedup']:.3f}" for n in CONFIGS), flush=True)
    for d in (256, 192):
        for n in list(CONFIGS)[1:]:
            print(f"D={d}: {n} / base " + spread(r[n + "_speedup"] for r in rows if r["head_dim"] == d))
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "wide_ab.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
