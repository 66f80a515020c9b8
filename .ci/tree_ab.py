"""The forward (or, --bwd, the backward) of two (or three: --also) kernel trees in one process: this checkout's ``kernels_cu`` against
another copy of it (a base commit's, e.g. ``git archive main kernels_cu | tar -x -C out/base``),
through the public API with the library's default plans, on the standard grid (head_dim 64
and 128 or those given, nheads 2048/head_dim, 16k tokens, seqlen 1024-16384, causal or not, fp16 and bf16)
plus, at bf16 4096 and 16384 causal, sinks and a window (1024, 0).

Both trees' kernels are compiled up front in parallel (each keyed on its own sources'
hash in the disk cache); then each case is timed by ``cupyx.profiler.benchmark``
(``gpu_times``, median of 20), the trees interleaved, best of three rounds (--rounds). Switching
tree swaps the kernel directory, the loaded modules and the plan caches. Prints a
table, the speed-up (base time / this tree's) min / median / max last, and writes JSON
under $OUT when it is set.

    python .ci/tree_ab.py out/base/kernels_cu [--quick] [--bwd] [--head-dim 128] [--rounds 5]
    # --quick: seqlen 4096 and 16384 only; --bwd: flash_attn_bwd, given the forward's out and lse
"""
import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
from pathlib import Path

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

import cupyflash
from cupyflash import _compile, _gpu, _launch, _sources, _variant, dispatch
from ws_d64_ab import rand, spread  # .ci/, the script's directory

TOKENS = 16384
_MODULES = {}  # tree -> its loaded modules (_compile._modules)


def use_tree(path):
    path = Path(path)
    _sources.kernels_dir = _compile.kernels_dir = lambda: path
    _sources.sources_hash.cache_clear()
    _compile._modules = _MODULES.setdefault(str(path), {})
    _gpu.clear_plans()


def variant_kwargs(name, nheads):
    return {"plain": {}, "sinks": {"sinks": cp.asarray(np.linspace(-1, 1, nheads, dtype=np.float32))},
            "window": {"window_size": (1024, 0)}}[name]


def cases(quick, head_dims):
    out = []
    seqlens = (4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384)
    for d in head_dims:
        for dtype in ("float16", "bfloat16"):
            for s in seqlens:
                for causal in (False, True):
                    out.append((d, dtype, s, causal, "plain"))
        for s in (4096, 16384) if d in (64, 128) else ():
            for name in ("sinks", "window"):
                out.append((d, "bfloat16", s, True, name))
    return out


def launches_of(label, bwd):
    d, dtype, s, causal, name = label
    h = 2048 // d
    bits = _variant.bits(variant_kwargs(name, h)) if name != "plain" else 0
    if bwd:
        plan = dispatch.select_bwd(batch=TOKENS // s, seqlen_q=s, seqlen_k=s, nheads_q=h, nheads_kv=h, head_dim=d,
                                   dtype=dtype, causal=causal, deterministic=False, vec=True,
                                   num_sms=_launch.num_sms(cp.cuda.Device().id), cc=(9, 0), variant=bits)
        return list(plan.launches)
    plan = dispatch.select_fwd(batch=TOKENS // s, seqlen_q=s, seqlen_k=s, nheads_q=h, head_dim=d, dtype=dtype,
                               causal=causal, vec=True, num_sms=_launch.num_sms(cp.cuda.Device().id), cc=(9, 0),
                               variant=bits, ws=dispatch.FWD_WS, persistent=dispatch.FWD_WS_PERSISTENT,
                               ws_block_map=dispatch.FWD_WS_BLOCK_MAP)
    return [L for L in (plan.main, plan.combine) if L is not None]


def compile_one(tree, source, name_expression):
    use_tree(tree)
    _compile.compile_variant(source, name_expression, (9, 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base", help="the other kernels_cu directory")
    ap.add_argument("--this", help="a kernels_cu directory to time in place of this checkout's")
    ap.add_argument("--also", help="a third kernels_cu directory, timed beside them")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bwd", action="store_true", help="time the backward (given the forward's out and lse)")
    ap.add_argument("--head-dim", type=int, action="append",
                    help="the head_dims (repeatable; default 64 and 128, the variants at those only)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the best counts)")
    args = ap.parse_args()
    trees = {"base": str(Path(args.base).resolve()),
             "this": str(Path(args.this).resolve() if args.this else _sources.kernels_dir())}
    if args.also:
        trees["also"] = str(Path(args.also).resolve())
    labels = cases(args.quick, args.head_dim or (64, 128))
    launches = {L for label in labels for L in launches_of(label, args.bwd)}
    jobs = [(t, L.source, L.name_expression) for t in trees.values() for L in launches]
    with cf.ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1),
                                mp_context=multiprocessing.get_context("spawn")) as pool:  # no CUDA in them
        list(pool.map(compile_one, *zip(*jobs)))
    rng = cp.random.default_rng(0)
    fn = cupyflash.flash_attn_bwd if args.bwd else cupyflash.flash_attn_fwd
    results = []
    print("D   dtype    seqlen causal variant | " + " ".join(f"{t:>6} ms" for t in trees) + " | speed-up")
    for label in labels:
        d, dtype, s, causal, name = label
        h = 2048 // d
        arrays = tuple(rand(rng, dtype, TOKENS // s, s, h, d) for _ in range(3))
        kw = {"causal": causal, **variant_kwargs(name, h), **({"dtype": "bfloat16"} if dtype == "bfloat16" else {})}
        if args.bwd:  # (dout, q, k, v, out, lse), the forward's by this checkout's tree
            use_tree(trees["this"])
            arrays = (rand(rng, dtype, TOKENS // s, s, h, d), *arrays, *cupyflash.flash_attn_fwd(*arrays, **kw))
        times = {t: [] for t in trees}
        for _ in range(args.rounds):
            for t, path in trees.items():
                use_tree(path)
                r = benchmark(fn, arrays, kw, n_repeat=20, n_warmup=3)
                times[t].append(float(np.median(r.gpu_times)) * 1e3)
        best = {t: min(v) for t, v in times.items()}
        row = {"head_dim": d, "dtype": dtype, "seqlen": s, "causal": causal, "variant": name,
               **{f"{t}_ms": best[t] for t in trees}, "speedup": best["base"] / best["this"],
               **({"also_speedup": best["base"] / best["also"]} if "also" in trees else {}),
               "kernels": [[L.template, list(L.args)] for L in launches_of(label, args.bwd)]}
        results.append(row)
        print(f"{d:3d} {dtype:8} {s:6d} {causal!s:6} {name:7} | " + " ".join(f"{best[t]:9.4f}" for t in trees)
              + f" | {row['speedup']:6.3f}" + (f" {row['also_speedup']:6.3f}" if "also" in trees else ""))
    for sel, rows in (("all", results), *((f"D={d}", [r for r in results if r["head_dim"] == d])
                                          for d in sorted({r["head_dim"] for r in results}))):
        for t in ("this", "also")[:len(trees) - 1]:
            print(f"{sel}: {t} / base speed-up " + spread(r["speedup" if t == "this" else "also_speedup"] for r in rows))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tree_ab.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
