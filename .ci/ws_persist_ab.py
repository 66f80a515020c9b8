"""The persistent ws forward against the one-block-per-tile one, in one process: D=128,
16 heads, 16k tokens (batch x seqlen), fp16 and bf16, causal and not, a (4096, 0) window
at 16384 causal, one packed (varlen) batch; kernel time by ``cupyx.profiler.benchmark``
(``gpu_times``), the same call with ``dispatch.FWD_WS_PERSISTENT`` off and on.

Each switch is followed by ``_gpu.clear_plans()`` and checked: the call's one launch
must be the ws kernel with the PERSISTENT template argument and the grid of that mode
(``dispatch.fwd_ws_grid``). The kernels are compiled up front in parallel (the disk
cache), so the timed part is ~10 s and the whole run under ~90 s on an H200.

    python .ci/ws_persist_ab.py
"""
import concurrent.futures as cf
import multiprocessing
import os

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

import cupyflash
from cupyflash import _compile, _gpu, _launch, dispatch

H, D = 16, 128
TOKENS = 16384


def rand(rng, dtype, *shape):
    x = rng.standard_normal(shape, dtype=cp.float32)
    if dtype == "float16":
        return x.astype(cp.float16)
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)  # bf16: the top half of fp32 (truncated)


def cases():
    """(label, fn, args, kwargs, visible (query, key) pairs, select_fwd's shape)."""
    rng = cp.random.default_rng(0)
    out = []
    for dtype in ("float16", "bfloat16"):
        kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        for causal in (False, True):
            for s in (512, 1024, 2048, 4096, 8192, 16384):
                b = TOKENS // s
                q, k, v = (rand(rng, dtype, b, s, H, D) for _ in range(3))
                pairs = b * s * s / (2 if causal else 1)
                out.append((f"{dtype:8s} B={b:<3d} S={s:<5d} {'causal' if causal else 'full':6s}",
                            cupyflash.flash_attn_fwd, (q, k, v), {"causal": causal, **kw}, pairs,
                            dict(batch=b, seqlen_q=s, seqlen_k=s, dtype=dtype, causal=causal)))
        s = 16384
        q, k, v = (rand(rng, dtype, 1, s, H, D) for _ in range(3))
        pairs = sum(min(i + 1, 4097) for i in range(s))
        out.append((f"{dtype:8s} B=1   S=16384 window(4096,0) causal", cupyflash.flash_attn_fwd, (q, k, v),
                    {"causal": True, "window_size": (4096, 0), **kw}, pairs,
                    dict(batch=1, seqlen_q=s, seqlen_k=s, dtype=dtype, causal=True, variant=dispatch.VAR_WINDOW)))
        lens = np.random.default_rng(1).integers(256, 2049, size=TOKENS // 1152)
        cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        total, mx = int(lens.sum()), int(lens.max())
        q, k, v = (rand(rng, dtype, total, H, D) for _ in range(3))
        pairs = float((lens.astype(np.float64) * (lens + 1) / 2).sum())
        out.append((f"{dtype:8s} varlen {len(lens)} seqs 256-2048 causal", cupyflash.flash_attn_varlen_fwd,
                    (q, k, v, cu, cu, mx, mx), {"causal": True, **kw}, pairs,
                    dict(batch=len(lens), seqlen_q=mx, seqlen_k=mx, dtype=dtype, causal=True, varlen=True)))
    return out


def num_sms():
    return _launch.num_sms(cp.cuda.Device().id)


def plan(shape, persistent):
    return dispatch.select_fwd(nheads_q=H, head_dim=D, vec=True, num_sms=num_sms(), cc=(9, 0),
                               ws=dispatch.FWD_WS, persistent=persistent, **shape)


def set_mode(persistent):
    dispatch.FWD_WS_PERSISTENT = persistent
    _gpu.clear_plans()


def launched(fn, args, kwargs):
    """The Launch specs of one call (Launcher.__call__ wrapped for it alone)."""
    specs, real = [], _launch.Launcher.__call__

    def record(self, *a, **k):
        specs.extend(self.launches)
        return real(self, *a, **k)

    _launch.Launcher.__call__ = record
    try:
        fn(*args, **kwargs)
    finally:
        _launch.Launcher.__call__ = real
    return specs


def check_mode(fn, args, kwargs, shape, persistent):
    specs = launched(fn, args, kwargs)
    want = plan(shape, persistent).main
    assert [s.template for s in specs] == ["cupyflash::flash_fwd_ws_kernel"], specs
    (got,) = specs
    assert got.args[-1] == str(persistent).lower() and got.grid == want.grid, (got, persistent)
    m_blocks = -(-shape["seqlen_q"] // dispatch.FWD_WS_BLOCK_M)
    assert got.grid == dispatch.fwd_ws_grid(m_blocks, shape["batch"] * H, shape["causal"], num_sms(), persistent)


def time_ms(fn, args, kwargs):
    r = benchmark(fn, args, kwargs, n_repeat=30, n_warmup=5)
    return float(np.median(r.gpu_times)) * 1e3


def compile_one(source, name_expression):
    """Into the disk cache, where the launches' get_function finds it."""
    _compile.compile_variant(source, name_expression, (9, 0))


def main():
    assert dispatch.FWD_WS_PERSISTENT is False, "run with the default off (the script flips it)"
    todo = cases()
    launches = {plan(c[-1], p).main for c in todo for p in (False, True)}
    with cf.ProcessPoolExecutor(max_workers=min(len(launches), os.cpu_count() or 1),
                                mp_context=multiprocessing.get_context("spawn")) as pool:  # no CUDA in them
        list(pool.map(compile_one, [L.source for L in launches], [L.name_expression for L in launches]))
    print(f"{num_sms()} SMs; persistent grid = min(units, {num_sms() * dispatch.FWD_WS_BLOCKS_PER_SM}); "
          "a unit: a query tile, causal a pair of them (kernels_cu/tile_scheduler.cuh)")
    print(f"{'case':44s} | grid ms  persistent ms  speed-up  TFLOP/s (grid, persistent)")
    for label, fn, args, kwargs, pairs, shape in todo:
        ms = {}
        for persistent in (False, True, False, True):  # twice each, interleaved; the better of two
            set_mode(persistent)
            check_mode(fn, args, kwargs, shape, persistent)
            ms[persistent] = min(ms.get(persistent, np.inf), time_ms(fn, args, kwargs))
        tf = [4 * H * D * pairs / (ms[p] * 1e-3) / 1e12 for p in (False, True)]
        print(f"{label:44s} | {ms[False]:7.4f} {ms[True]:13.4f} {ms[False] / ms[True]:9.3f}  {tf[0]:5.0f} {tf[1]:5.0f}")
    set_mode(False)


if __name__ == "__main__":
    main()
