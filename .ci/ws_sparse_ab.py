"""Block-sparse forwards on the cp.async wgmma kernel (dispatch.FWD_WS_BLOCK_MAP off)
against the warp-specialised one (on, the default since run 116), in one process: bench --suite bias's
sparse case (N=4096, bf16, 16k tokens, nheads = 2048 / D, a (1, 1, N, N) mask of
128-blocks 90% empty plus the diagonal, every visible block full: cupyflash._bench_bias
sparse_mask) and the same blocks made partial (each visible block keeps 75% of its
elements at random), at D=64 and 128; kernel time by ``cupyx.profiler.benchmark``
(``gpu_times``), and each time over the plain call's (no mask, the default plan) of the
same shape: the issue-14 bar is sparse / plain <= 0.15.

Each switch is followed by ``_gpu.clear_plans()`` and checked: the call's one launch must
be the kernel of that mode (off: flash_fwd_sm90_kernel, on: flash_fwd_ws_kernel with the
mask's bits, one block per tile). The kernels are compiled up front in parallel (the disk
cache); the timed part is ~10 s on an H200.

    python .ci/ws_sparse_ab.py
"""
import concurrent.futures as cf
import multiprocessing
import os

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

import cupyflash
from cupyflash import _compile, _gpu, _launch, dispatch
from cupyflash._bench_bias import BIAS_TOKENS, SPARSE_BAR, sparse_block_map, sparse_mask
from ws_persist_ab import launched  # .ci/, the script's directory

N = 4096
MAP = dispatch.VAR_MASK | dispatch.VAR_BLOCK_MAP
#: The plan's bits for these masks (contiguous, 16-byte rows: _variant.plan_bits stages them
#: for the cp.async kernel; the ws kernel drops the staged bit)
PLAN_BITS = MAP | dispatch.VAR_BIAS_STAGED
KERNEL = {False: "cupyflash::flash_fwd_sm90_kernel", True: "cupyflash::flash_fwd_ws_kernel"}


def rand(rng, *shape):
    x = rng.standard_normal(shape, dtype=cp.float32)
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)  # bf16: the top half of fp32 (truncated)


def masks():
    """name -> the (N, N) bool mask on the host: the bench's, and its visible blocks partial."""
    full = sparse_mask(N)
    inside = np.random.default_rng(2).random((N, N)) < 0.75
    np.fill_diagonal(inside, True)  # every row still sees a key
    return {"sparse": full, "partial": full & inside}


def num_sms():
    return _launch.num_sms(cp.cuda.Device().id)


def plan(d, on, variant):
    batch = BIAS_TOKENS // N
    return dispatch.select_fwd(batch=batch, seqlen_q=N, seqlen_k=N, nheads_q=2048 // d, head_dim=d,
                               dtype="bfloat16", causal=False, vec=True, num_sms=num_sms(), cc=(9, 0),
                               variant=variant, ws=dispatch.FWD_WS, persistent=dispatch.FWD_WS_PERSISTENT,
                               ws_block_map=on)


def set_mode(on):
    dispatch.FWD_WS_BLOCK_MAP = on
    _gpu.clear_plans()


def check_mode(fn, args, kwargs, on):
    (got,) = launched(fn, args, kwargs)
    assert got.template == KERNEL[on], (got, on)
    assert int(got.args[7 if on else 6]) & MAP == MAP, got  # VARIANT: ws <T, D, BLOCK_M, BLOCK_N, ..>, sm90 <T, D, BLOCK_N, ..>
    if on:
        assert got.args[9] == "false", got  # never persistent


def time_ms(fn, args, kwargs):
    r = benchmark(fn, args, kwargs, n_repeat=30, n_warmup=5)
    return float(np.median(r.gpu_times)) * 1e3


def compile_one(source, name_expression):
    """Into the disk cache, where the launches' get_function finds it."""
    _compile.compile_variant(source, name_expression, (9, 0))


def main():
    assert dispatch.FWD_WS_BLOCK_MAP is True, "run with the default (on since run 116; the script flips it)"
    launches = {plan(d, on, v).main for d in (64, 128) for on in (False, True) for v in (0, PLAN_BITS)}
    with cf.ProcessPoolExecutor(max_workers=min(len(launches), os.cpu_count() or 1),
                                mp_context=multiprocessing.get_context("spawn")) as pool:  # no CUDA in them
        list(pool.map(compile_one, [L.source for L in launches], [L.name_expression for L in launches]))
    rng = cp.random.default_rng(0)
    host_masks = masks()
    visible = float(sparse_block_map(N).mean())
    print(f"N={N}, bf16, {BIAS_TOKENS} tokens, nheads = 2048 / D; {visible:.1%} of the 128-blocks visible; "
          f"bar: sparse / plain <= {SPARSE_BAR}")
    print(f"{'D':>3} {'case':8s} | plain ms | off ms  on ms  | off/plain on/plain | on speed-up")
    for d in (64, 128):
        b, h = BIAS_TOKENS // N, 2048 // d
        q, k, v = (rand(rng, b, N, h, d) for _ in range(3))
        kw = {"dtype": "bfloat16"}
        set_mode(False)
        plain = time_ms(cupyflash.flash_attn_fwd, (q, k, v), kw)
        for name, mask in host_masks.items():
            bm = cupyflash.BlockMask.from_mask(cp.asarray(mask).reshape(1, 1, N, N))
            args, kwargs = (q, k, v), {**kw, "attn_mask": bm}
            ms = {}
            for on in (False, True, False, True):  # twice each, interleaved; the better of two
                set_mode(on)
                check_mode(cupyflash.flash_attn_fwd, args, kwargs, on)
                ms[on] = min(ms.get(on, np.inf), time_ms(cupyflash.flash_attn_fwd, args, kwargs))
            print(f"{d:3d} {name:8s} | {plain:8.4f} | {ms[False]:6.4f} {ms[True]:6.4f} | "
                  f"{ms[False] / plain:9.3f} {ms[True] / plain:8.3f} | {ms[False] / ms[True]:8.3f}")
    set_mode(False)


if __name__ == "__main__":
    main()
