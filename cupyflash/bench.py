"""``python -m cupyflash bench``: forward and backward against torch SDPA (FA2, cuDNN).

The standard grid: head_dim 64 and 128, nheads = 2048 / head_dim,
batch * seqlen = 16384, seqlen 512..16384, causal and not, fp16 and bf16.
FLOPs are 4 * B * H * Sq * Sk * D, halved when causal, x2.5 for backward.
Times are CUDA-event medians after warm-up; every implementation runs on the
same inputs in the same process. When torch is importable its flash and cuDNN
SDPA backends are measured too and ratios printed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

# Instruction ceilings on the H200 (kernels_cu/PERF.md): a register-only m16n8k16
# mma.sync loop, and the fp16 GEMM (wgmma) ceiling. "frac" is the forward's share
# of the ceiling of the path dispatch picked for the point.
MMA_SYNC_CEILING_TFLOPS = 620.0
WGMMA_CEILING_TFLOPS = 741.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head-dim", type=int, action="append", default=None, help="default 64 and 128")
    parser.add_argument("--seqlen", type=int, action="append", default=None, help="default 512..16384")
    parser.add_argument("--dtype", action="append", choices=("float16", "bfloat16"), default=None)
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    parser.add_argument("--no-bwd", action="store_true", help="forward only")
    parser.add_argument("--no-torch", action="store_true", help="do not measure torch SDPA")
    parser.add_argument("--deterministic", action="store_true",
                        help="also time the deterministic backward (no dQ atomics)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="save a PNG plot here (needs matplotlib)")
    parser.add_argument("--fwd-kernel", choices=("auto", "mma"), default="auto",
                        help="experiment: 'mma' keeps the forward on the mma.sync kernel even where "
                             "dispatch picks wgmma (cc 9.0), for A/B runs")
    parser.add_argument("--bwd-dq", choices=("mma", "wgmma"), default="wgmma",
                        help="experiment: 'mma' runs the deterministic dQ on the mma.sync kernel even "
                             "where dispatch picks wgmma (cc 9.0), for A/B runs")
    parser.add_argument("--bwd-sm90-block-m", action="append", default=None, metavar="D:BLOCK_M",
                        help="experiment: query rows per step of the wgmma dK/dV kernel (cc 9.0) for one "
                             "padded head_dim in this process, e.g. 64:128 (dispatch._BWD_SM90_BLOCK_MS "
                             "lists the compiled values)")
    parser.add_argument("--fwd-overlap", action="store_true",
                        help="experiment: the software-pipelined wgmma forward (softmax of one key block "
                             "overlapping the previous block's P·V; dispatch.FWD_SM90_OVERLAP), for A/B runs")
    parser.add_argument("--fwd-sm90", action="append", default=None, metavar="D:BLOCK_N,CTAS_PER_SM",
                        help="experiment: override the wgmma forward tile of one head_dim in this process")
    parser.add_argument("--fwd-tiles", action="append", default=None, metavar="D:BLOCK_M,BLOCK_N,WARPS",
                        help="experiment: override the forward tile of one head_dim in this process")


def parse_bwd_sm90_block_m(specs) -> dict[int, int]:
    """``--bwd-sm90-block-m`` values (``D:BLOCK_M``) -> {padded head_dim: BLOCK_M}."""
    out = {}
    for spec in specs or ():
        d, _, block_m = spec.partition(":")
        try:
            out[int(d)] = int(block_m)
        except ValueError:
            raise ValueError(f"--bwd-sm90-block-m takes D:BLOCK_M (e.g. 64:128); got {spec!r}") from None
    return out


def flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, bwd=False):
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    return f * (2.5 if bwd else 1.0)


def _time_ms(fn, reps, cupy, warmup_ms=100.0):
    """Median milliseconds of fn() over reps, with CUDA events on the current cupy stream.

    Warm-up: at least 3 calls and ``warmup_ms`` of wall time, so module loads,
    compiles and a GPU that clocked down while the host compiled stay out of the
    numbers (run 15's one slow point was the first of its group, right after a
    compile: a possible cause, not a confirmed one).
    """
    stream = cupy.cuda.get_current_stream()
    t0, calls = time.perf_counter(), 0
    while calls < 3 or (time.perf_counter() - t0) * 1e3 < warmup_ms:
        fn()
        stream.synchronize()
        calls += 1
    times = []
    for _ in range(reps):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def _torch_env():
    try:
        import torch  # noqa: PLC0415
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - torch is optional
        return None
    if not torch.cuda.is_available():
        return None
    return torch, SDPBackend, sdpa_kernel


def _bf16_bits(cupy, x32):
    """float32 cupy array -> bf16 bit patterns (uint16), round to nearest even."""
    u = x32.view(cupy.uint32)
    rounded = u + (0x7FFF + ((u >> 16) & 1))
    return (rounded >> 16).astype(cupy.uint16)


def run_point(cupy, torch_env, *, head_dim, seqlen, dtype, causal, tokens, reps, bwd, deterministic=False):
    from . import _gpu  # noqa: PLC0415

    batch, nheads = max(1, tokens // seqlen), 2048 // head_dim
    shape = (batch, seqlen, nheads, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    q32, k32, v32, do32 = (cupy.random.standard_normal(shape, dtype=cupy.float32) for _ in range(4))
    if dtype == "float16":
        q, k, v, dout = (x.astype(cupy.float16) for x in (q32, k32, v32, do32))
    else:
        q, k, v, dout = (_bf16_bits(cupy, x) for x in (q32, k32, v32, do32))
    del q32, k32, v32, do32
    res = {"head_dim": head_dim, "seqlen": seqlen, "batch": batch, "nheads": nheads, "dtype": dtype,
           "causal": causal}
    f_fwd = flops(batch, nheads, seqlen, seqlen, head_dim, causal)
    f_bwd = flops(batch, nheads, seqlen, seqlen, head_dim, causal, bwd=True)

    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    out, lse = _gpu.fwd(q, k, v, softmax_scale=scale, causal=causal, dtype=dtype)
    cupy.cuda.get_current_stream().synchronize()
    res["fwd_extra_bytes"] = pool.used_bytes() - before
    res["fwd_output_bytes"] = out.nbytes + lse.nbytes
    ms = _time_ms(lambda: _gpu.fwd(q, k, v, softmax_scale=scale, causal=causal, dtype=dtype), reps, cupy)
    res["ours_fwd_ms"], res["ours_fwd_tflops"] = ms, f_fwd / ms / 1e9
    plan = _gpu.select_fwd(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads_q=nheads, head_dim=head_dim,
                           dtype=dtype, causal=causal, vec=True, num_sms=_gpu._num_sms(q.device.id),
                           cc=_gpu._cc(q.device.id))
    wgmma = plan.main.source == "flash_fwd_sm90.cu"
    res["fwd_kernel"] = ("wgmma-overlap" if plan.main.args[-1] == "true" else "wgmma") if wgmma else "mma.sync"
    res["ours_fwd_frac_ceiling"] = res["ours_fwd_tflops"] / (WGMMA_CEILING_TFLOPS if wgmma else MMA_SYNC_CEILING_TFLOPS)
    if bwd:
        try:
            ms = _time_ms(lambda: _gpu.bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal,
                                           dtype=dtype), reps, cupy)
            res["ours_bwd_ms"], res["ours_bwd_tflops"] = ms, f_bwd / ms / 1e9
            dkdv = _gpu.select_bwd(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads_q=nheads,
                                   nheads_kv=nheads, head_dim=head_dim, dtype=dtype, causal=causal,
                                   deterministic=False, vec=True, num_sms=_gpu._num_sms(q.device.id),
                                   cc=_gpu._cc(q.device.id)).launches[1]
            res["bwd_kernel"] = "wgmma" if dkdv.source == "flash_bwd_sm90.cu" else "mma.sync"
            res["bwd_dkdv_block_m"] = int(dkdv.args[2])  # both dK/dV kernels: <T, HEAD_DIM, BLOCK_M, ...>
            before = pool.used_bytes()
            grads = _gpu.bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal, dtype=dtype)
            cupy.cuda.get_current_stream().synchronize()
            res["bwd_extra_bytes"] = pool.used_bytes() - before
            res["bwd_output_bytes"] = sum(g.nbytes for g in grads)
            del grads
            if deterministic:
                ms = _time_ms(lambda: _gpu.bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal,
                                               dtype=dtype, deterministic=True), reps, cupy)
                res["ours_bwd_det_ms"], res["ours_bwd_det_tflops"] = ms, f_bwd / ms / 1e9
                res["ratio_bwd_det_vs_default"] = res["ours_bwd_ms"] / ms
        except Exception as e:  # noqa: BLE001 - report, keep benchmarking the forward
            res["ours_bwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    if torch_env is not None:
        torch, backend, sdpa_kernel = torch_env
        tdt = torch.float16 if dtype == "float16" else torch.bfloat16
        to_t = (lambda x: torch.from_dlpack(x)) if dtype == "float16" else \
            (lambda x: torch.from_dlpack(x.view(cupy.int16)).view(tdt))
        tq, tk, tv, tdo = (to_t(x).transpose(1, 2) for x in (q, k, v, dout))
        for name, be in (("fa2", backend.FLASH_ATTENTION), ("cudnn", backend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    def f():
                        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    ms = _torch_time(torch, f, reps)
                    res[f"{name}_fwd_ms"], res[f"{name}_fwd_tflops"] = ms, f_fwd / ms / 1e9
                    if bwd:
                        gq, gk, gv = (x.detach().requires_grad_() for x in (tq, tk, tv))
                        o = torch.nn.functional.scaled_dot_product_attention(gq, gk, gv, is_causal=causal)
                        def g():
                            return torch.autograd.grad(o, (gq, gk, gv), tdo, retain_graph=True)
                        ms = _torch_time(torch, g, reps)
                        res[f"{name}_bwd_ms"], res[f"{name}_bwd_tflops"] = ms, f_bwd / ms / 1e9
                        del o, gq, gk, gv
            except Exception as e:  # noqa: BLE001 - a backend may refuse a shape
                res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for name in ("fa2", "cudnn"):
            for pas in ("fwd", "bwd"):
                if f"{name}_{pas}_ms" in res and f"ours_{pas}_ms" in res:
                    res[f"ratio_{pas}_vs_{name}"] = res[f"{name}_{pas}_ms"] / res[f"ours_{pas}_ms"]
    return res


def _torch_time(torch, fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _fmt(r, key, width=7, prec=0):
    v = r.get(key)
    return f"{v:{width}.{prec}f}" if isinstance(v, (int, float)) else " " * (width - 1) + "-"


def print_table(results, out=sys.stdout):
    print("\n  D  seqlen dtype causal | fwd TFLOP/s ours  fa2 cudnn | x fa2 x cudnn frac |"
          " bwd TFLOP/s ours  fa2 cudnn | x fa2 x cudnn", file=out)
    for r in results:
        print(f"{r['head_dim']:3d} {r['seqlen']:6d} {r['dtype'][:4]:>5} {str(r['causal'])[0]:>6} |"
              f"          {_fmt(r, 'ours_fwd_tflops', 5)}{_fmt(r, 'fa2_fwd_tflops', 5)}{_fmt(r, 'cudnn_fwd_tflops', 6)} |"
              f"{_fmt(r, 'ratio_fwd_vs_fa2', 6, 2)}{_fmt(r, 'ratio_fwd_vs_cudnn', 8, 2)}"
              f"{_fmt(r, 'ours_fwd_frac_ceiling', 5, 2)} |"
              f"          {_fmt(r, 'ours_bwd_tflops', 5)}{_fmt(r, 'fa2_bwd_tflops', 5)}{_fmt(r, 'cudnn_bwd_tflops', 6)} |"
              f"{_fmt(r, 'ratio_bwd_vs_fa2', 6, 2)}{_fmt(r, 'ratio_bwd_vs_cudnn', 8, 2)}", file=out)


def _plot(results, path):
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    keys = sorted({(r["head_dim"], r["dtype"], r["causal"]) for r in results})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = [r for r in results if (r["head_dim"], r["dtype"], r["causal"]) == key]
        for impl in ("ours", "fa2", "cudnn"):
            pts = [(r["seqlen"], r.get(f"{impl}_fwd_tflops")) for r in rows if r.get(f"{impl}_fwd_tflops")]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={key[0]} {key[1]} causal={key[2]}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("fwd TFLOP/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(args: argparse.Namespace) -> int:
    try:  # the experiment switches first: a bad one fails before any GPU work
        block_ms = parse_bwd_sm90_block_m(args.bwd_sm90_block_m)
        if block_ms:
            from . import dispatch  # noqa: PLC0415
            for d, block_m in block_ms.items():
                dispatch.set_bwd_sm90_block_m(d, block_m)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    try:
        import cupy  # noqa: PLC0415
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        print(f"bench needs a CUDA GPU and cupy: {e}", file=sys.stderr)
        return 2
    if args.bwd_dq == "mma":
        from . import dispatch  # noqa: PLC0415
        dispatch.BWD_DQ_SM90 = False
    if args.fwd_overlap:
        from . import dispatch  # noqa: PLC0415
        dispatch.FWD_SM90_OVERLAP = True
    if args.fwd_kernel == "mma":
        from . import dispatch  # noqa: PLC0415
        dispatch._FWD_SM90.clear()  # noqa: SLF001
    if args.fwd_sm90:
        from . import dispatch  # noqa: PLC0415
        for spec in args.fwd_sm90:
            d, tile = spec.split(":")
            t = tuple(int(x) for x in tile.split(","))
            dispatch._FWD_SM90[int(d)] = (t, t)  # noqa: SLF001
    if args.fwd_tiles:
        from . import dispatch  # noqa: PLC0415
        for spec in args.fwd_tiles:
            d, tile = spec.split(":")
            t = tuple(int(x) for x in tile.split(","))
            dispatch._FWD_TILES[int(d)] = (t, t)  # noqa: SLF001
    torch_env = None if args.no_torch else _torch_env()
    head_dims = args.head_dim or [64, 128]
    seqlens = args.seqlen or [512, 1024, 2048, 4096, 8192, 16384]
    dtypes = args.dtype or ["float16", "bfloat16"]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    results = []
    total = len(head_dims) * len(seqlens) * len(dtypes) * len(causals)
    for i, (d, dt, c, s) in enumerate(
            (d, dt, c, s) for d in head_dims for dt in dtypes for c in causals for s in seqlens):
        r = run_point(cupy, torch_env, head_dim=d, seqlen=s, dtype=dt, causal=c, tokens=args.tokens,
                      reps=args.reps, bwd=not args.no_bwd, deterministic=args.deterministic)
        results.append(r)
        print(f"[{i + 1}/{total}] D={d} S={s} {dt} causal={c}: ours fwd {r['ours_fwd_tflops']:.0f} TFLOP/s"
              + (f", fa2 {r['fa2_fwd_tflops']:.0f}" if "fa2_fwd_tflops" in r else "")
              + (f"; bwd {r['ours_bwd_tflops']:.0f}" if "ours_bwd_tflops" in r else "")
              + (f", deterministic {r['ours_bwd_det_tflops']:.0f} ({r['ratio_bwd_det_vs_default']:.2f}x)"
                 if "ours_bwd_det_tflops" in r else ""), file=sys.stderr, flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       "results": results}, f, indent=1)
    if args.plot:
        try:
            _plot(results, args.plot)
        except ImportError:
            print("matplotlib not installed; no plot", file=sys.stderr)
    print_table(results)
    return 0
