"""``python -m cupyflash bench``: cupyflash against torch SDPA (FA2, cuDNN) and JAX.

Seven suites (``--suite``):

grid (default)
    The standard grid: head_dim 64 and 128, nheads = 2048 / head_dim,
    batch * seqlen = 16384, seqlen 512..16384, causal and not, fp16 and bf16;
    forward and backward TFLOP/s beside torch SDPA's flash and cuDNN backends.
seed
    batch 1, nheads 32, head_dim 128, causal, fp16 over seqlen 512..32768:
    latency, peak extra memory and errors against a float64 reference, beside
    SDPA's flash, cuDNN and math backends (:mod:`._bench_suites`).  Memory is
    measured the same way for every implementation: torch's allocator
    counters, with cupy's allocations routed through torch's allocator.
overhead
    Host microseconds per call on tiny shapes, cupy arrays and torch tensors,
    beside SDPA's own per-call cost, with pass/fail bars.
frameworks
    Training steps through ``cupyflash.torch.flash_attn_func`` and
    ``cupyflash.jax.flash_attention`` beside SDPA and ``jax.nn.dot_product_attention``.
decode
    ``cupyflash.flash_attn_with_kvcache`` at seqlen_q 1 against a full cache
    (batch 1/8/64, seqlen_k 1k..128k, 32/8 and 32/32 heads, D 64 and 128, bf16
    and fp16) beside SDPA's flash (``enable_gqa=True``) and cuDNN backends:
    K/V bandwidth against the copy bandwidth, ratios and bars (issue 12);
    then a paged cache against the contiguous one, and chunked prefill
    against the dense forward.
variants
    The attention variants of issue 13 at head_dim 128, 16 heads, batch *
    seqlen = 16384, seqlen 4096 and 16384 (:mod:`._bench_variants`): sliding
    window, softcap, ALiBi, sinks and dropout beside plain (causal and not),
    beside torch's compiled ``flex_attention`` expressing the same variant, and
    for the window beside ``jax.nn.dot_product_attention``'s cuDNN sliding
    window; FLOPs on the visible pairs, and the issue's bars.  A variant the
    GPU kernels do not implement yet is marked "n/impl".
bias
    Additive bias ((1, H, N, N) and (B, 1, N, N)) with its gradient, and a
    90%-empty block-sparse bool mask, at head_dim 64 and 128, seqlen
    1024..8192 (:mod:`._bench_bias`), beside torch SDPA's cuDNN and
    memory-efficient backends with the same ``attn_mask`` and the compiled
    ``flex_attention`` reading the bias in a ``score_mod``; the bias stream's
    bandwidth, and issue 14's bars.

FLOPs are 4 * B * H * Sq * Sk * D, halved when causal, x2.5 for backward.
Times are CUDA-event medians after a time-based warm-up (cupy events for
cupy calls, ``torch.cuda.Event`` for torch calls); every implementation runs
on the same inputs in the same process, through the public API.  Where one
input set fits in L2 the timed calls rotate through several sets, so the
inputs come from device memory as in a real model.  Each suite prints its
table last on stdout, progress on stderr; ``--json`` writes the results
(after every point, so a run cut short keeps what it measured) and
``--plot`` a PNG (needs matplotlib).  torch and JAX are optional: their
columns are skipped with a note when they do not import.
"""

from __future__ import annotations

import argparse
import functools
import io
import itertools
import json
import math
import statistics
import sys
import time

from . import cli

# Instruction ceilings on the H200 (kernels_cu/PERF.md): a register-only m16n8k16
# mma.sync loop, and the fp16 GEMM (wgmma) ceiling. "frac" is the forward's share
# of the ceiling of the path dispatch picked for the point.
MMA_SYNC_CEILING_TFLOPS = 620.0
WGMMA_CEILING_TFLOPS = 741.0

#: The H200's L2 cache.  An input set smaller than this is rotated with others.
L2_BYTES = 50 * 2**20

SUITES = ("grid", "seed", "overhead", "frameworks", "decode", "variants", "bias")

#: Timed repetitions per measurement when --reps is not given.
DEFAULT_REPS = {"grid": 20, "seed": 20, "overhead": 10, "frameworks": 20, "decode": 10,
                "variants": 10, "bias": 10}

#: Options that belong to some suites only: dest -> (flag, suites).  Given with
#: another suite they are an error rather than silently ignored.
SUITE_OPTIONS = {
    "head_dim": ("--head-dim", ("grid", "decode", "bias")),
    "dtype": ("--dtype", ("grid", "decode", "variants", "bias")),
    "causal": ("--causal", ("grid",)),
    "tokens": ("--tokens", ("grid",)),
    "no_bwd": ("--no-bwd", ("grid",)),
    "deterministic": ("--deterministic", ("grid",)),
    "seqlen": ("--seqlen", ("grid", "seed", "decode", "variants", "bias")),
    "calls": ("--calls", ("overhead",)),
    "no_jax": ("--no-jax", ("frameworks", "variants")),
    "batch": ("--batch", ("decode",)),
    "heads": ("--heads", ("decode",)),
    "part": ("--part", ("decode",)),
    "copy_tbps": ("--copy-tbps", ("decode",)),
    "max_kv_gb": ("--max-kv-gb", ("decode",)),
    "variant": ("--variant", ("variants",)),
}

_positive_int = cli._int_type(1)  # noqa: SLF001 - the CLI's own argument type


def _positive_float(text):
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number; got {text!r}")
    return value


def _heads(text):
    """An argparse type: ``Q:KV`` -> (nheads_q, nheads_kv), Q a positive multiple of KV."""
    q, sep, kv = text.partition(":")
    try:
        pair = (int(q), int(kv)) if sep else None
    except ValueError:
        pair = None
    if pair is None or min(pair) < 1 or pair[0] % pair[1]:
        raise argparse.ArgumentTypeError(f"must be Q:KV with Q a positive multiple of KV (e.g. 32:8); "
                                         f"got {text!r}")
    return pair


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", choices=SUITES, default="grid",
                        help="grid: the standard grid (default); seed: B=1 H=32 D=128 causal fp16 "
                             "latency, memory and errors; overhead: host us per call; frameworks: "
                             "torch and JAX training steps; decode: flash_attn_with_kvcache against "
                             "SDPA, paged, chunked prefill; variants: window, softcap, ALiBi, sinks and "
                             "dropout against plain causal and FlexAttention; bias: attn_bias with dbias "
                             "and a block-sparse mask against SDPA (cuDNN, mem-efficient) and FlexAttention")
    parser.add_argument("--head-dim", type=_positive_int, action="append", default=None,
                        help="grid, decode, bias: default 64 and 128")
    parser.add_argument("--seqlen", type=_positive_int, action="append", default=None,
                        help="grid: default 512..16384; seed: default 512..32768; decode: seqlen_k of "
                             "the decode grid, default 1024, 8192, 32768, 131072; variants: default 4096 "
                             "and 16384; bias: default 1024, 4096, 8192")
    parser.add_argument("--dtype", action="append", choices=("float16", "bfloat16"), default=None,
                        help="grid, decode: default both; variants, bias: default bfloat16")
    parser.add_argument("--batch", type=_positive_int, action="append", default=None,
                        help="decode: batch of the decode grid, default 1, 8, 64")
    parser.add_argument("--heads", type=_heads, action="append", default=None, metavar="Q:KV",
                        help="decode: nheads_q:nheads_kv of the decode grid, default 32:8 and 32:32")
    parser.add_argument("--part", action="append", choices=("grid", "paged", "prefill"), default=None,
                        help="decode: the parts to run (default all): grid, the decode grid; paged, "
                             "paged against contiguous; prefill, chunked prefill against the dense forward")
    parser.add_argument("--copy-tbps", type=_positive_float, default=None,
                        help="decode: the device's copy bandwidth in TB/s, the bandwidth bar's "
                             "reference (default 4.24, the H200's)")
    parser.add_argument("--max-kv-gb", type=_positive_float, default=None,
                        help="decode: skip points whose K/V caches exceed this many GB (default 40)")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default=None,
                        help="grid: default both")
    parser.add_argument("--tokens", type=_positive_int, default=None,
                        help="grid: batch * seqlen (default 16384)")
    parser.add_argument("--no-bwd", action="store_true", help="grid: forward only")
    parser.add_argument("--no-torch", action="store_true", help="do not measure torch")
    parser.add_argument("--no-jax", action="store_true", help="frameworks, variants: do not measure JAX")
    parser.add_argument("--variant", action="append", default=None,
                        choices=("plain", "causal", "window", "softcap", "alibi", "sinks", "dropout"),
                        help="variants: the variants to run (default all; causal, the bars' reference, "
                             "always runs)")
    parser.add_argument("--deterministic", action="store_true",
                        help="grid: also time the deterministic backward (no dQ atomics)")
    parser.add_argument("--reps", type=_positive_int, default=None,
                        help="timed repetitions per measurement (overhead: batches of --calls "
                             "calls); default " + ", ".join(f"{s} {n}" for s, n in DEFAULT_REPS.items()))
    parser.add_argument("--calls", type=_positive_int, default=None,
                        help="overhead: back-to-back calls per batch (default 300)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="save a PNG plot here (needs matplotlib)")
    parser.add_argument("--fwd-kernel", choices=("auto", "mma"), default="auto",
                        help="experiment: 'mma' keeps the forward on the mma.sync kernel even where "
                             "dispatch picks wgmma (cc 9.0), for A/B runs")
    parser.add_argument("--bwd-dq", choices=("mma", "wgmma"), default="wgmma",
                        help="experiment: 'mma' runs the deterministic dQ on the mma.sync kernel even "
                             "where dispatch picks wgmma (cc 9.0), for A/B runs")
    parser.add_argument("--fwd-sm90", action="append", default=None, metavar="D:BLOCK_N,CTAS_PER_SM",
                        help="experiment: override the wgmma forward tile of one head_dim in this process")
    parser.add_argument("--fwd-tiles", action="append", default=None, metavar="D:BLOCK_M,BLOCK_N,WARPS",
                        help="experiment: override the forward tile of one head_dim in this process")


def check_suite_options(args) -> None:
    """Raise ValueError (one line) for an option given with a suite it does not apply to."""
    for dest, (flag, suites) in SUITE_OPTIONS.items():
        if args.suite not in suites and getattr(args, dest) not in (None, False):
            names = ", ".join(suites[:-1]) + " and " + suites[-1] if len(suites) > 1 else suites[0]
            raise ValueError(f"{flag} applies to --suite {names} only; got --suite {args.suite}")


def parse_tiles(specs, flag, fields) -> dict[int, tuple[int, ...]]:
    """``--fwd-sm90`` / ``--fwd-tiles`` values (``D:A,B[,C]``) -> {head_dim: (A, B[, C])}."""
    out = {}
    for spec in specs or ():
        d, sep, tile = spec.partition(":")
        try:
            head_dim, values = int(d), tuple(int(x) for x in tile.split(","))
        except ValueError:
            values = ()
        if not sep or len(values) != len(fields):
            raise ValueError(f"{flag} takes D:{','.join(fields)}; got {spec!r}")
        out[head_dim] = values
    return out


def flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, bwd=False):
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    return f * (2.5 if bwd else 1.0)


# ----------------------------------------------------------------------------
# Timers and inputs (shared by every suite)
# ----------------------------------------------------------------------------


def _warm_up(fn, synchronize, warmup_ms):
    """Call fn() (synchronising after each) at least 3 times and for ``warmup_ms`` of wall time."""
    t0, calls = time.perf_counter(), 0
    while calls < 3 or (time.perf_counter() - t0) * 1e3 < warmup_ms:
        fn()
        synchronize()
        calls += 1


def _event_median_ms(fn, reps, new_event, elapsed_ms):
    """Median over reps of the milliseconds between events recorded before and after fn()."""
    times = []
    for _ in range(reps):
        start, stop = new_event(), new_event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(elapsed_ms(start, stop))
    return statistics.median(times)


def _time_ms(fn, reps, cupy, warmup_ms=100.0):
    """Median milliseconds of fn() over reps, with CUDA events on the current cupy stream.

    Warm-up: at least 3 calls and ``warmup_ms`` of wall time, so module loads,
    compiles and a GPU that clocked down while the host compiled stay out of the
    numbers (run 15's one slow point was the first of its group, right after a
    compile: a possible cause, not a confirmed one).
    """
    _warm_up(fn, cupy.cuda.get_current_stream().synchronize, warmup_ms)
    return _event_median_ms(fn, reps, cupy.cuda.Event, cupy.cuda.get_elapsed_time)


def _torch_time_ms(fn, reps, torch, warmup_ms=100.0):
    """:func:`_time_ms` for torch work: ``torch.cuda.Event`` on torch's current stream."""
    _warm_up(fn, torch.cuda.synchronize, warmup_ms)
    return _event_median_ms(fn, reps, lambda: torch.cuda.Event(enable_timing=True),
                            lambda start, stop: start.elapsed_time(stop))


def rotation_count(nbytes):
    """How many input sets the timed calls rotate through.

    Parameters
    ----------
    nbytes : int
        Bytes of one set (:func:`set_bytes`).

    Returns
    -------
    int
        1 when a set is at least as large as L2 (:data:`L2_BYTES`); otherwise
        enough that the other sets, touched between two uses of one, amount
        to twice L2, so none of a set is still cached when it comes round again.
    """
    if nbytes >= L2_BYTES:
        return 1
    return 1 + math.ceil(2 * L2_BYTES / nbytes)


def _rotating(fns):
    """One callable that calls ``fns`` in turn, one input set per call."""
    if len(fns) == 1:
        return fns[0]
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def _bf16_bits(cupy, x32):
    """float32 cupy array -> bf16 bit patterns (uint16), round to nearest even."""
    u = x32.view(cupy.uint32)
    rounded = u + (0x7FFF + ((u >> 16) & 1))
    return (rounded >> 16).astype(cupy.uint16)


def input_sets(cupy, shape, dtype, count):
    """``count`` sets of standard-normal (q, k, v, dout) cupy arrays of one shape.

    float16 arrays, or bfloat16 bit patterns in uint16 storage (the public
    API's ``dtype="bfloat16"``).
    """
    sets = []
    for _ in range(count):
        xs = [cupy.random.standard_normal(shape, dtype=cupy.float32) for _ in range(4)]
        sets.append(tuple(x.astype(cupy.float16) if dtype == "float16" else _bf16_bits(cupy, x)
                          for x in xs))
    return sets


def set_bytes(shape, dtype_bytes=2):
    """Bytes of one (q, k, v, dout) set of ``shape``."""
    return 4 * math.prod(shape) * dtype_bytes


def torch_env():
    """``((torch, SDPBackend, sdpa_kernel), None)``, or ``(None, why torch is not measured)``."""
    try:
        import torch  # noqa: PLC0415
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - torch is optional
        return None, f"torch not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    return (torch, SDPBackend, sdpa_kernel), None


def torch_view(torch, cupy, x, dtype):
    """A torch tensor on the memory of cupy array ``x`` (bfloat16 bits as torch.bfloat16)."""
    if dtype == "float16":
        return torch.from_dlpack(x)
    return torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)


# ----------------------------------------------------------------------------
# --suite grid
# ----------------------------------------------------------------------------


def _kernel_info(q, *, batch, seqlen, nheads, head_dim, dtype, causal, bwd):
    """``(keys, ceiling)``: the kernels dispatch picks for a grid point (JSON keys fwd_kernel,
    bwd_kernel, bwd_dkdv_block_m) and the TFLOP/s ceiling of the forward's path.

    Read from the (internal) plans; if they change shape the point records
    ``kernel_info_error`` instead, and the ceiling is None.
    """
    from . import _gpu, _launch, dispatch  # noqa: PLC0415

    try:
        device = q.device.id
        common = dict(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads_q=nheads,
                      head_dim=head_dim, dtype=dtype, causal=causal, vec=True,
                      num_sms=_launch.num_sms(device), cc=_launch.compute_capability(device))
        main = _gpu.select_fwd(**common, ws=dispatch.FWD_WS).main
        ws = main.source == "flash_fwd_ws.cu"  # the warp-specialised forward (dispatch.FWD_WS)
        wgmma = ws or main.source == "flash_fwd_sm90.cu"
        info = {"fwd_kernel": "ws" if ws else "wgmma" if wgmma else "mma.sync"}
        if bwd:
            dkdv = _gpu.select_bwd(nheads_kv=nheads, deterministic=False, ws=dispatch.BWD_WS, **common).launches[1]
            info["bwd_kernel"] = {"flash_bwd_ws.cu": "ws", "flash_bwd_sm90.cu": "wgmma"}.get(dkdv.source, "mma.sync")
            info["bwd_dkdv_block_m"] = {"flash_bwd_sm90.cu": dispatch.BWD_SM90_BLOCK_M}.get(
                dkdv.source) or int(dkdv.args[2])  # flash_bwd.cu, flash_bwd_ws.cu: <T, HEAD_DIM, BLOCK_M, ...>
    except Exception as e:  # noqa: BLE001 - the plans are internal; the timings stand without them
        return {"kernel_info_error": f"{type(e).__name__}: {str(e)[:200]}"}, None
    return info, WGMMA_CEILING_TFLOPS if wgmma else MMA_SYNC_CEILING_TFLOPS


def run_point(cupy, env, *, head_dim, seqlen, dtype, causal, tokens, reps, bwd, deterministic=False):
    """One grid point: ours (public API on cupy arrays) and torch SDPA's flash and cuDNN backends."""
    import cupyflash  # noqa: PLC0415

    batch, nheads = max(1, tokens // seqlen), 2048 // head_dim
    shape = (batch, seqlen, nheads, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    count = rotation_count(set_bytes(shape))
    sets = input_sets(cupy, shape, dtype, count)
    res = {"head_dim": head_dim, "seqlen": seqlen, "batch": batch, "nheads": nheads, "dtype": dtype,
           "causal": causal, "input_sets": count}
    f_fwd = flops(batch, nheads, seqlen, seqlen, head_dim, causal)
    f_bwd = flops(batch, nheads, seqlen, seqlen, head_dim, causal, bwd=True)

    def fwd(s):
        return cupyflash.flash_attn_fwd(s[0], s[1], s[2], softmax_scale=scale, causal=causal, dtype=dtype)

    def bwd_(s, o, det=False):
        return cupyflash.flash_attn_bwd(s[3], s[0], s[1], s[2], *o, softmax_scale=scale, causal=causal,
                                        dtype=dtype, deterministic=det)

    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    out, lse = fwd(sets[0])
    cupy.cuda.get_current_stream().synchronize()
    res["fwd_extra_bytes"] = pool.used_bytes() - before
    res["fwd_output_bytes"] = out.nbytes + lse.nbytes
    ms = _time_ms(_rotating([functools.partial(fwd, s) for s in sets]), reps, cupy)
    res["ours_fwd_ms"], res["ours_fwd_tflops"] = ms, f_fwd / ms / 1e9
    info, ceiling = _kernel_info(sets[0][0], batch=batch, seqlen=seqlen, nheads=nheads, head_dim=head_dim,
                                 dtype=dtype, causal=causal, bwd=bwd)
    res.update(info)
    if ceiling:
        res["ours_fwd_frac_ceiling"] = res["ours_fwd_tflops"] / ceiling
    if bwd:
        try:
            fwds = [(out, lse)] + [fwd(s) for s in sets[1:]]
            ms = _time_ms(_rotating([functools.partial(bwd_, s, o) for s, o in zip(sets, fwds)]), reps, cupy)
            res["ours_bwd_ms"], res["ours_bwd_tflops"] = ms, f_bwd / ms / 1e9
            before = pool.used_bytes()
            grads = bwd_(sets[0], fwds[0])
            cupy.cuda.get_current_stream().synchronize()
            res["bwd_extra_bytes"] = pool.used_bytes() - before
            res["bwd_output_bytes"] = sum(g.nbytes for g in grads)
            del grads
            if deterministic:
                ms = _time_ms(_rotating([functools.partial(bwd_, s, o, True) for s, o in zip(sets, fwds)]),
                              reps, cupy)
                res["ours_bwd_det_ms"], res["ours_bwd_det_tflops"] = ms, f_bwd / ms / 1e9
                res["ratio_bwd_det_vs_default"] = res["ours_bwd_ms"] / ms
        except Exception as e:  # noqa: BLE001 - report, keep benchmarking the forward
            res["ours_bwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    if env is not None:
        torch, backend, sdpa_kernel = env
        views = [tuple(torch_view(torch, cupy, x, dtype).transpose(1, 2) for x in s) for s in sets]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for name, be in (("fa2", backend.FLASH_ATTENTION), ("cudnn", backend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    ms = _torch_time_ms(_rotating([functools.partial(sdpa, *t[:3], is_causal=causal)
                                                   for t in views]), reps, torch)
                    res[f"{name}_fwd_ms"], res[f"{name}_fwd_tflops"] = ms, f_fwd / ms / 1e9
                    if bwd:
                        leaves = [tuple(x.detach().requires_grad_() for x in t[:3]) for t in views]
                        outs = [sdpa(*lv, is_causal=causal) for lv in leaves]
                        ms = _torch_time_ms(_rotating([
                            functools.partial(torch.autograd.grad, o, lv, t[3], retain_graph=True)
                            for o, lv, t in zip(outs, leaves, views)]), reps, torch)
                        res[f"{name}_bwd_ms"], res[f"{name}_bwd_tflops"] = ms, f_bwd / ms / 1e9
                        del outs, leaves
            except Exception as e:  # noqa: BLE001 - a backend may refuse a shape
                res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for name in ("fa2", "cudnn"):
            for pas in ("fwd", "bwd"):
                if f"{name}_{pas}_ms" in res and f"ours_{pas}_ms" in res:
                    res[f"ratio_{pas}_vs_{name}"] = res[f"{name}_{pas}_ms"] / res[f"ours_{pas}_ms"]
    return res


def _fmt(r, key, width=7, prec=0):
    v = r.get(key)
    return f"{v:{width}.{prec}f}" if isinstance(v, (int, float)) else " " * (width - 1) + "-"


def format_grid_table(results) -> str:
    """The grid's table: TFLOP/s of ours, FA2 and cuDNN, the ratios and the ceiling fraction."""
    lines = ["", "  D  seqlen dtype causal | fwd TFLOP/s ours  fa2 cudnn | x fa2 x cudnn frac |"
                 " bwd TFLOP/s ours  fa2 cudnn | x fa2 x cudnn"]
    for r in results:
        lines.append(
            f"{r['head_dim']:3d} {r['seqlen']:6d} {r['dtype'][:4]:>5} {str(r['causal'])[0]:>6} |"
            f"          {_fmt(r, 'ours_fwd_tflops', 5)}{_fmt(r, 'fa2_fwd_tflops', 5)}{_fmt(r, 'cudnn_fwd_tflops', 6)} |"
            f"{_fmt(r, 'ratio_fwd_vs_fa2', 6, 2)}{_fmt(r, 'ratio_fwd_vs_cudnn', 8, 2)}"
            f"{_fmt(r, 'ours_fwd_frac_ceiling', 5, 2)} |"
            f"          {_fmt(r, 'ours_bwd_tflops', 5)}{_fmt(r, 'fa2_bwd_tflops', 5)}{_fmt(r, 'cudnn_bwd_tflops', 6)} |"
            f"{_fmt(r, 'ratio_bwd_vs_fa2', 6, 2)}{_fmt(r, 'ratio_bwd_vs_cudnn', 8, 2)}")
    return "\n".join(lines)


def print_table(results, out=sys.stdout):
    print(format_grid_table(results), file=out)


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


def run_grid(cupy, args, report, save):
    """``--suite grid``: every point of the grid (or of --head-dim/--seqlen/--dtype/--causal)."""
    env, why = (None, None) if args.no_torch else torch_env()
    if why:
        report["notes"].append(f"torch SDPA columns skipped: {why}")
    head_dims = args.head_dim or [64, 128]
    seqlens = args.seqlen or [512, 1024, 2048, 4096, 8192, 16384]
    dtypes = args.dtype or ["float16", "bfloat16"]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal or "both"]
    total = len(head_dims) * len(seqlens) * len(dtypes) * len(causals)
    for i, (d, dt, c, s) in enumerate(
            (d, dt, c, s) for d in head_dims for dt in dtypes for c in causals for s in seqlens):
        r = run_point(cupy, env, head_dim=d, seqlen=s, dtype=dt, causal=c, tokens=args.tokens or 16384,
                      reps=args.reps, bwd=not args.no_bwd, deterministic=args.deterministic)
        report["results"].append(r)
        save()
        print(f"[{i + 1}/{total}] D={d} S={s} {dt} causal={c}: ours fwd {r['ours_fwd_tflops']:.0f} TFLOP/s"
              + (f", fa2 {r['fa2_fwd_tflops']:.0f}" if "fa2_fwd_tflops" in r else "")
              + (f"; bwd {r['ours_bwd_tflops']:.0f}" if "ours_bwd_tflops" in r else "")
              + (f", deterministic {r['ours_bwd_det_tflops']:.0f} ({r['ratio_bwd_det_vs_default']:.2f}x)"
                 if "ours_bwd_det_tflops" in r else ""), file=sys.stderr, flush=True)
        cupy.get_default_memory_pool().free_all_blocks()


# ----------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------


def _suite(name):
    """``(run, format_table, plot)`` of a suite."""
    if name == "grid":
        return run_grid, lambda report: format_grid_table(report["results"]), \
            lambda report, path: _plot(report["results"], path)
    if name == "variants":
        from . import _bench_variants  # noqa: PLC0415

        return _bench_variants.SUITE
    if name == "bias":
        from . import _bench_bias  # noqa: PLC0415

        return _bench_bias.SUITE
    from . import _bench_suites  # noqa: PLC0415

    return _bench_suites.SUITES[name]


def write_json(report, path):
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def write_plot(plot, report, path):
    """Draw the suite's plot to ``path``; a missing matplotlib becomes a note, not an error."""
    try:
        plot(report, path)
    except ImportError as e:
        report["notes"].append(f"no plot written to {path}: matplotlib is not installed ({e})")


def finish(report, args, format_table, plot, out=None):
    """Write the plot and the JSON, then print the notes and the table last (on ``out``, default stdout)."""
    if args.plot:
        write_plot(plot, report, args.plot)
    if args.json:
        write_json(report, args.json)
    text = io.StringIO()
    for note in report["notes"]:
        print(f"note: {note}", file=text)
    print(format_table(report), file=text)
    (out or sys.stdout).write(text.getvalue())


def _experiments(args):
    """Validate the experiment switches; returns the parsed tile overrides.  Raises ValueError."""
    return (parse_tiles(args.fwd_sm90, "--fwd-sm90", ("BLOCK_N", "CTAS_PER_SM")),
            parse_tiles(args.fwd_tiles, "--fwd-tiles", ("BLOCK_M", "BLOCK_N", "WARPS")))


def _apply_experiments(args, fwd_sm90, fwd_tiles):
    from . import dispatch  # noqa: PLC0415

    if args.bwd_dq == "mma":
        dispatch.BWD_DQ_SM90 = False
    if args.fwd_kernel == "mma":
        dispatch._FWD_SM90.clear()  # noqa: SLF001
        dispatch.FWD_WS = False  # (and the warp-specialised forward: wgmma too)
        dispatch.FWD_WS_BLOCK_MAP = False
    for d, t in fwd_sm90.items():
        dispatch._FWD_SM90[d] = (t, t)  # noqa: SLF001
    for d, t in fwd_tiles.items():
        dispatch._FWD_TILES[d] = (t, t)  # noqa: SLF001


def main(args: argparse.Namespace) -> int:
    try:  # the options first: a bad one fails before any GPU work
        check_suite_options(args)
        fwd_sm90, fwd_tiles = _experiments(args)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    cupy, why = cli.gpu_unavailable_reason()
    if cupy is None:
        print(f"bench: needs a CUDA GPU: {why}", file=sys.stderr)
        return 2
    _apply_experiments(args, fwd_sm90, fwd_tiles)
    if args.reps is None:
        args.reps = DEFAULT_REPS[args.suite]
    run, format_table, plot = _suite(args.suite)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    report = {"suite": args.suite, "device": name.decode() if isinstance(name, bytes) else name,
              "notes": [], "results": []}
    run(cupy, args, report, (lambda: write_json(report, args.json)) if args.json else (lambda: None))
    finish(report, args, format_table, plot)
    return 0
