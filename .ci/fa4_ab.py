"""FlashAttention-4's softmax options in the warp-specialised forward (issue 15;
dispatch.FWD_WS_SOFTMAX, kernels_cu/online_softmax.cuh), against the kernel without
them, in one process on an H200: bf16 and fp16, D=128, 16 heads, batch x seqlen = 16k,
seqlen 1024 / 4096 / 16384, causal and not, plain, softcap=30 and ALiBi. Kernel time
by ``cupyx.profiler.benchmark`` (mean gpu_times, the best of two interleaved rounds);
every timed call is checked to have launched exactly the kernel its option plans (a
previous A/B timed the same kernel twice). Then the max abs error of out against the
float64 reference, per option, at one shape (bf16, seqlen 1024, causal) per variant.

    python .ci/fa4_ab.py            # ~100 s: the kernels compile in parallel first
    FA4_AB_CONFIGS=off,cond-rescale python .ci/fa4_ab.py   # a subset of the options
"""
import concurrent.futures as cf
import os
import time

import numpy as np

from cupyflash import dispatch

D, H, TOKENS, SEQLENS = 128, 16, 16384, (1024, 4096, 16384)
DTYPES = ("bfloat16", "float16")
#: id -> the variant's keyword arguments (ALiBi's slopes: the standard geometric ones)
VARIANTS = {"plain": {}, "softcap": {"softcap": 30.0},
            "alibi": {"alibi_slopes": 2.0 ** (-8.0 * np.arange(1, H + 1) / H)}}
VARIANT_BITS = {"plain": 0, "softcap": dispatch.VAR_SOFTCAP, "alibi": dispatch.VAR_ALIBI}
W = dispatch.WsSoftmax
CONFIGS = {"off": W(), "poly 1/4": W(2), "poly 1/2": W(4), "cond-rescale": W(0, True),
           "both 1/4": W(2, True), "both 1/2": W(4, True)}
if os.environ.get("FA4_AB_CONFIGS"):  # e.g. "off,cond-rescale": a subset, in that order
    CONFIGS = {n: CONFIGS[n] for n in os.environ["FA4_AB_CONFIGS"].split(",")}


def planned(dtype, seqlen, causal, variant, option):
    """The forward kernel dispatch plans for the call under ``option``."""
    return dispatch.select_fwd(batch=TOKENS // seqlen, seqlen_q=seqlen, seqlen_k=seqlen, nheads_q=H, head_dim=D,
                               dtype=dtype, causal=causal, vec=True, variant=VARIANT_BITS[variant],
                               ws=dispatch.FWD_WS, ws_softmax=option).main


def _compile(launch):
    from cupyflash import _compile as c

    c.compile_variant(launch.source, launch.name_expression, (9, 0))
    return launch.name_expression


def precompile():
    """Every kernel of the sweep, compiled into the disk cache by a process pool (before
    this process touches CUDA: the workers are forked)."""
    kernels = {planned(t, s, c, v, o) for t in DTYPES for s in SEQLENS[:1] for c in (False, True)
               for v in VARIANTS for o in CONFIGS.values()}
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        list(pool.map(_compile, kernels))
    print(f"compiled {len(kernels)} kernels in {time.perf_counter() - t0:.0f} s")


def main():
    precompile()
    import cupy as cp
    from cupyx.profiler import benchmark

    import cupyflash
    from cupyflash import _gpu, _launch, reference

    launched = []
    real_call = _launch.Launcher.__call__

    def call(self, stream, *pointers, var=None):
        launched.extend(spec.name_expression for spec in self.launches)
        return real_call(self, stream, *pointers, var=var)

    _launch.Launcher.__call__ = call
    rng = cp.random.default_rng(0)

    def inputs(dtype, seqlen, variant):
        b = TOKENS // seqlen
        q, k, v = (rng.standard_normal((b, seqlen, H, D), dtype=cp.float32) for _ in range(3))
        if dtype == "bfloat16":  # bf16 storage: the uint16 bits, dtype= names it
            q, k, v = (cp.asarray(cupyflash.testing.to_bf16_bits(x.get())) for x in (q, k, v))
        else:
            q, k, v = (x.astype(cp.float16) for x in (q, k, v))
        kw = {name: cp.asarray(x, cp.float32) if isinstance(x, np.ndarray) else x
              for name, x in VARIANTS[variant].items()}
        return (q, k, v), {"dtype": dtype, **kw}

    def run(option, fn, args, kw, want, repeat):
        dispatch.FWD_WS_SOFTMAX = option
        _gpu.clear_plans()
        launched.clear()
        fn(*args, **kw)
        assert launched == [want.name_expression], (launched, want.name_expression)
        if not repeat:
            return None
        r = benchmark(fn, args, kw, n_repeat=repeat, n_warmup=3)
        assert set(launched) == {want.name_expression}
        return float(r.gpu_times.mean()) * 1e3

    names = list(CONFIGS)
    print(f"{'dtype':9} {'variant':8} {'seqlen':>6} {'causal':6} | " + " ".join(f"{n:>12}" for n in names)
          + "   (ms; then speed-up vs off)")
    for dtype in DTYPES:
        for variant in VARIANTS:
            for seqlen in SEQLENS:
                for causal in (False, True):
                    args, kw = inputs(dtype, seqlen, variant)
                    kw["causal"] = causal
                    plans = {n: planned(dtype, seqlen, causal, variant, o) for n, o in CONFIGS.items()}
                    assert len({p.name_expression for p in plans.values()}) == len(plans)  # the switch changes it
                    times = {n: [] for n in names}
                    for _ in range(2):
                        for n in names:
                            times[n].append(run(CONFIGS[n], cupyflash.flash_attn_fwd, args, kw, plans[n], 15))
                    ms = {n: min(t) for n, t in times.items()}
                    row = f"{dtype:9} {variant:8} {seqlen:6d} {causal!s:6} | "
                    print(row + " ".join(f"{ms[n]:12.4f}" for n in names))
                    print(" " * len(row) + " ".join(f"{ms['off'] / ms[n]:11.3f}x" for n in names))

    print("\nmax |out - float64 reference| (bf16, B=1, seqlen 1024, 16 heads, causal)")
    for variant in VARIANTS:
        (q, k, v), kw = inputs("bfloat16", 1024, variant)
        q, k, v = (x[:1] for x in (q, k, v))
        kw["causal"] = True
        host = [cupyflash.testing.from_bf16_bits(x.get()).astype(np.float64) for x in (q, k, v)]
        ref_kw = {n: x.get() if hasattr(x, "get") else x for n, x in kw.items() if n not in ("dtype",)}
        ref = reference.attention_fwd(*host, **ref_kw)[0]
        errs = []
        for n in names:
            want = dispatch.select_fwd(batch=1, seqlen_q=1024, seqlen_k=1024, nheads_q=H, head_dim=D,
                                       dtype="bfloat16", causal=True, vec=True, variant=VARIANT_BITS[variant],
                                       ws=dispatch.FWD_WS, ws_softmax=CONFIGS[n]).main
            dispatch.FWD_WS_SOFTMAX = CONFIGS[n]
            _gpu.clear_plans()
            launched.clear()
            out, _ = cupyflash.flash_attn_fwd(q, k, v, **kw)
            assert launched == [want.name_expression], (launched, want.name_expression)
            errs.append(float(np.abs(cupyflash.testing.from_bf16_bits(out.get()).astype(np.float64) - ref).max()))
        print(f"{variant:8} " + " ".join(f"{n}: {e:.2e}" for n, e in zip(names, errs)))
    dispatch.FWD_WS_SOFTMAX = W()
    _gpu.clear_plans()


if __name__ == "__main__":
    main()
