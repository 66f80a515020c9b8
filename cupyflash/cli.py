"""``python -m cupyflash``: demo, info, check-kernels and bench.

``check-kernels`` and ``bench`` live in :mod:`cupyflash.check_kernels` and
:mod:`cupyflash.bench`; each exposes ``add_arguments(parser)`` and
``main(args) -> int``.  When one cannot be imported its subcommand says so and
exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time

import numpy as np

from . import __version__
from ._checks import MAX_HEAD_DIM

_PLUGINS = (
    ("check-kernels", "check_kernels", "compile every kernel variant and check its resources"),
    ("bench", "bench", "time the kernels against a baseline"),
)

#: Largest score matrix (batch * nheads_q * seqlen_q * seqlen_k) the demo checks
#: densely in float64; a larger problem is checked on a subset of its heads.
_MAX_REFERENCE_SCORES = 1 << 24


def _progress(message):
    print(f"[cupyflash] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# GPU probing (never raises)
# ----------------------------------------------------------------------------


#: The NVIDIA driver's user-space library, by platform.  cupy loads it lazily and,
#: when it is missing, reports cudaErrorInsufficientDriver (as if it were too old).
_DRIVER_LIBRARIES = {"win32": ("nvcuda.dll",)}.get(sys.platform, ("libcuda.so.1", "libcuda.so"))


def _nvidia_driver_loads():
    """Whether the NVIDIA driver library (libcuda) can be loaded in this process."""
    import ctypes

    for name in _DRIVER_LIBRARIES:
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return True
    return False


def gpu_unavailable_reason():
    """``(cupy_module_or_None, reason)``: cupy with a usable device, or why not (one line).

    Never raises.  ``tests/conftest.py`` uses it for the skip reason of GPU tests.
    """
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising anything
        return None, f"cupy not importable: {type(exc).__name__}: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        try:
            driver = _nvidia_driver_loads()
        except Exception:  # the probe is a diagnosis; never let it fail
            driver = True
        if not driver:
            return None, (f"no NVIDIA driver found ({_DRIVER_LIBRARIES[0]} does not load; "
                          f"cupy said {error})")
        return None, f"no CUDA device: {error}"
    if count < 1:
        return None, "no CUDA device: cupy reports 0 devices"
    return cupy, None


def usable_gpu():
    """``(cupy, "NAME, sm_XY")`` when cupyflash's kernels can run on the current GPU,
    else ``(None, why not)`` (one line).  Never raises.

    Beyond :func:`gpu_unavailable_reason`: a device older than the kernels need
    (compute capability ``dispatch.ARCHS[0]``) is not usable, and says so.
    ``demo``, ``info``, the examples and the GPU tests' skip use it.
    """
    cupy, reason = gpu_unavailable_reason()
    if cupy is None:
        return None, reason
    from .dispatch import ARCHS  # noqa: PLC0415

    try:
        device = cupy.cuda.Device()
        cc = device.compute_capability  # e.g. "90"
        name = gpu_name(cupy)
        major, minor = int(cc[:-1]), int(cc[-1])
    except Exception as exc:  # a diagnosis; never let it fail
        return None, f"cupy cannot query the GPU: {type(exc).__name__}: {exc}"
    if (major, minor) < ARCHS[0]:
        need = ".".join(map(str, ARCHS[0]))
        return None, f"{name} has compute capability {major}.{minor}; cupyflash's kernels need {need} or newer"
    return cupy, name


_probe_gpu = usable_gpu


# ----------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------


#: dtypes the demo offers (the GPU path takes _checks.GPU_DTYPES of them).
_DEMO_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _int_type(minimum, maximum=None):
    """An argparse type: an int in [minimum, maximum] (argparse prefixes "argument --NAME: ")."""
    if maximum is not None:
        rule = f"must be an integer from {minimum} to {maximum}"
    else:
        rule = {0: "must be a non-negative integer", 1: "must be a positive integer"}[minimum]

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{rule}; got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{rule}; got {value}")
        return value

    return parse


_positive_int = _int_type(1)


def _demo_dtype(text):
    if text not in _DEMO_DTYPES:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(_DEMO_DTYPES)}; got {text!r}")
    return text


def _add_demo_arguments(p):
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="gpu needs cupy and a CUDA device; auto picks it when usable")
    p.add_argument("--batch", type=_positive_int, help="default 4 on the GPU, 1 on the CPU")
    p.add_argument("--seqlen", type=_positive_int,
                   help="seqlen_q; default 2048 on the GPU, 1024 on the CPU")
    p.add_argument("--seqlen-k", type=_positive_int, help="default: --seqlen")
    p.add_argument("--nheads", type=_positive_int,
                   help="query heads; default 16 on the GPU, 8 on the CPU")
    p.add_argument("--nheads-kv", type=_positive_int,
                   help="KV heads (GQA), a divisor of --nheads; default: --nheads")
    p.add_argument("--head-dim", type=_int_type(1, MAX_HEAD_DIM), default=64,
                   help=f"1 to {MAX_HEAD_DIM} (default 64)")
    p.add_argument("--dtype", type=_demo_dtype, metavar="{" + ",".join(_DEMO_DTYPES) + "}",
                   help="default float16 on the GPU, float32 on the CPU (which computes "
                        "float16/bfloat16 in float32 with conversions: slower)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--repeat", type=_positive_int, default=5,
                   help="timed GPU iterations (default 5; the CPU path times one run)")
    p.add_argument("--seed", type=_int_type(0), help="random seed (default: fresh)")


def _demo_config(args, gpu):
    def pick(value, gpu_default, cpu_default):
        return value if value is not None else (gpu_default if gpu else cpu_default)

    seqlen = pick(args.seqlen, 2048, 1024)
    nheads = pick(args.nheads, 16, 8)
    return dict(
        batch=pick(args.batch, 4, 1),
        seqlen_q=seqlen,
        seqlen_k=args.seqlen_k if args.seqlen_k is not None else seqlen,
        nheads_q=nheads,
        nheads_kv=args.nheads_kv if args.nheads_kv is not None else nheads,
        head_dim=args.head_dim,
        dtype=pick(args.dtype, "float16", "float32"),
    )


def _demo_config_error(cfg, args):
    """Why ``cfg`` cannot run (one line naming the argument), or None."""
    if cfg["nheads_q"] % cfg["nheads_kv"]:
        nheads = "--nheads" if args.nheads is not None else "the default --nheads"
        return (f"argument --nheads-kv: must divide {nheads} ({cfg['nheads_q']}); "
                f"got {cfg['nheads_kv']} (see cupyflash demo --help)")
    if _demo_bytes(cfg) > _DEMO_MAX_BYTES:
        return (f"the shape needs {_demo_bytes(cfg) / 2**30:.3g} GiB of inputs, outputs and gradients, "
                f"more than any memory; reduce --batch, --seqlen, --seqlen-k, --nheads or --head-dim")
    if cfg["dtype"] == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401
        except ImportError as exc:
            missing = isinstance(exc, ModuleNotFoundError) and exc.name == "ml_dtypes"
            why = ("is not installed" if missing
                   else f"does not import ({type(exc).__name__}: {exc})")
            return (f"argument --dtype: bfloat16 needs the ml_dtypes package, which {why}; "
                    f"install it with: pip install \"cupyflash[bf16]\"")
    return None


def _demo_bytes(cfg):
    """Bytes of the demo's q, k, v, dout, out, dq, dk and dv (Python ints: no overflow)."""
    itemsize = 8 if cfg["dtype"] == "float64" else 4 if cfg["dtype"] == "float32" else 2
    q = cfg["batch"] * cfg["seqlen_q"] * cfg["nheads_q"] * cfg["head_dim"]
    kv = cfg["batch"] * cfg["seqlen_k"] * cfg["nheads_kv"] * cfg["head_dim"]
    return (4 * q + 4 * kv) * itemsize


#: Larger than any memory (and than what numpy can index): such a shape is refused up front.
_DEMO_MAX_BYTES = 1 << 60


def _flops(cfg, causal):
    f = 4.0 * cfg["batch"] * cfg["nheads_q"] * cfg["seqlen_q"] * cfg["seqlen_k"] * cfg["head_dim"]
    return f / 2 if causal else f


def _reference_subset(cfg):
    """``(batch_slice, q_heads, kv_heads)`` small enough for the dense float64 check."""
    group = cfg["nheads_q"] // cfg["nheads_kv"]
    per_kv_head = group * cfg["seqlen_q"] * cfg["seqlen_k"]
    kv_heads = max(1, min(cfg["nheads_kv"], _MAX_REFERENCE_SCORES // max(per_kv_head, 1)))
    batches = 1
    if kv_heads == cfg["nheads_kv"]:
        batches = max(1, min(cfg["batch"], _MAX_REFERENCE_SCORES // max(per_kv_head * kv_heads, 1)))
    return slice(0, batches), slice(0, kv_heads * group), slice(0, kv_heads)


def _timed(fn, sync, repeat):
    """Median wall time of ``fn()`` over ``repeat`` runs; returns (result, seconds)."""
    times, result = [], None
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return result, sorted(times)[len(times) // 2]


def _run_demo(args):
    import cupyflash
    from . import _checks, testing

    cupy, why_not = (None, "--device cpu") if args.device == "cpu" else _probe_gpu()
    if args.device == "gpu" and cupy is None:
        print(f"cupyflash demo: --device gpu, but the GPU is not usable: {why_not}", file=sys.stderr)
        return 2
    gpu = cupy is not None
    cfg = _demo_config(args, gpu)
    problem = _demo_config_error(cfg, args)
    if problem is not None:
        print(f"cupyflash demo: error: {problem}", file=sys.stderr)
        return 2
    if gpu and cfg["dtype"] not in _checks.GPU_DTYPES:
        print(f"cupyflash demo: the GPU path takes {', '.join(_checks.GPU_DTYPES)} for now; "
              f"got --dtype {cfg['dtype']} (add --device cpu for the CPU path)", file=sys.stderr)
        return 2
    xp = cupy if gpu else np
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    causal = args.causal

    where = f"GPU ({gpu_name(cupy)})" if gpu else f"CPU path (numpy; GPU not used: {why_not})"
    print(f"cupyflash {__version__} demo on the {where}")
    print(f"  q {(cfg['batch'], cfg['seqlen_q'], cfg['nheads_q'], cfg['head_dim'])}  "
          f"k, v {(cfg['batch'], cfg['seqlen_k'], cfg['nheads_kv'], cfg['head_dim'])}  "
          f"dtype {cfg['dtype']}  causal={causal}  seed {seed}")

    try:
        _progress("drawing inputs")
        q, k, v = testing.random_qkv(rng, cfg["batch"], cfg["seqlen_q"], cfg["seqlen_k"],
                                     cfg["nheads_q"], cfg["nheads_kv"], cfg["head_dim"],
                                     cfg["dtype"], xp)
        dout = testing.random_normal(rng, q.shape, cfg["dtype"], xp)

        if gpu:
            sync = cupy.cuda.get_current_stream().synchronize
            repeat = args.repeat
            _progress("warm-up (compiles the kernels on first use; this can take a while)")
            out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal)
            cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal)
        else:
            sync, repeat = (lambda: None), 1
        _progress("forward")
        (out, lse), t_fwd = _timed(lambda: cupyflash.flash_attn_fwd(q, k, v, causal=causal),
                                   sync, repeat)
        _progress("backward")
        (dq, dk, dv), t_bwd = _timed(
            lambda: cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal),
            sync, repeat)
    except MemoryError as exc:  # numpy's _ArrayMemoryError, cupy's OutOfMemoryError
        print(f"cupyflash demo: error: the problem does not fit in memory ({_demo_bytes(cfg) / 2**30:.3g} GiB "
              f"of inputs, outputs and gradients; {type(exc).__name__}: {exc}); reduce --batch, --seqlen, "
              f"--seqlen-k, --nheads or --head-dim", file=sys.stderr)
        return 2
    except (ValueError, TypeError, NotImplementedError) as exc:
        # cupyflash's own argument errors ("cupyflash.<fn>: ..." / "cupyflash: ...") say
        # what the arguments broke; anything else is a bug and keeps its traceback.
        if not str(exc).startswith("cupyflash"):
            raise
        print(f"cupyflash demo: error: {exc}", file=sys.stderr)
        return 2

    flops = _flops(cfg, causal)
    runs = f"median of {repeat} runs" if repeat > 1 else "one run"
    print(f"  forward   {t_fwd * 1e3:10.2f} ms   {flops / t_fwd / 1e12:8.3f} TFLOP/s   ({runs})")
    print(f"  backward  {t_bwd * 1e3:10.2f} ms   {2.5 * flops / t_bwd / 1e12:8.3f} TFLOP/s"
          f"   ({runs})")

    b, hq, hkv = _reference_subset(cfg)
    subset = (f"batch {b.start}..{b.stop - 1}, query heads {hq.start}..{hq.stop - 1}"
              if (b.stop, hq.stop) != (cfg["batch"], cfg["nheads_q"]) else "all of it")
    _progress(f"checking against the float64 reference ({subset})")
    sub = [x[b, :, hq] for x in (q, dout, out, dq)] + [x[b, :, hkv] for x in (k, v, dk, dv)]
    q_s, dout_s, out_s, dq_s, k_s, v_s, dk_s, dv_s = sub
    try:
        errors = testing.assert_fwd_matches_reference(q_s, k_s, v_s, out_s, lse[b, hq],
                                                      causal=causal)
        errors.update(testing.assert_bwd_matches_reference(dout_s, q_s, k_s, v_s, dq_s, dk_s,
                                                           dv_s, causal=causal))
    except AssertionError as exc:
        print(f"  check FAILED on {subset}: {exc}")
        return 1
    print(f"  max |error| vs float64 reference on {subset}: "
          + "  ".join(f"{name} {err:.2e}" for name, err in errors.items()))
    naive = testing.naive_dtype(cfg["dtype"]).name
    print(f"  check passed: within {testing.OUT_FACTOR:g}x (out, lse) and "
          f"{testing.GRAD_FACTOR:g}x (gradients) of a naive {naive} implementation's error")
    return 0


def gpu_name(cupy):
    """``"NAME, sm_XY"`` of the current device (or why it is unavailable)."""
    try:
        dev = cupy.cuda.Device()
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        return f"{name}, sm_{dev.compute_capability}"
    except Exception as exc:  # the name is cosmetic
        return f"device name unavailable: {exc}"


# ----------------------------------------------------------------------------
# info
# ----------------------------------------------------------------------------


def _version_of(module_name):
    try:
        return importlib.import_module(module_name).__version__
    except Exception as exc:
        return f"not importable ({type(exc).__name__}: {exc})"


def _nvrtc_version():
    """NVRTC's version through cupy (whose module moved between releases), or why not."""
    reasons = []
    for module_name in ("cupy.cuda.nvrtc", "cupy_backends.cuda.libs.nvrtc"):
        try:
            major, minor = importlib.import_module(module_name).getVersion()
        except Exception as exc:
            reasons.append(f"{module_name}: {type(exc).__name__}: {exc}")
        else:
            return f"{major}.{minor}"
    return "unavailable (" + "; ".join(reasons) + ")"


def _run_info(args):
    from . import _sources

    lines = [
        ("cupyflash", __version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("numpy", np.__version__),
        ("scipy", _version_of("scipy")),
        ("ml_dtypes", _version_of("ml_dtypes")),
    ]
    cupy_version = _version_of("cupy")
    lines.append(("cupy", cupy_version))
    cupy, why_not = _probe_gpu()
    if cupy is None:
        lines.append(("GPU", f"not usable: {why_not}"))
    else:
        lines.append(("GPU", f"usable: {gpu_name(cupy)}"))
    lines.append(("NVRTC", _nvrtc_version()))
    try:
        lines.append(("kernel sources", str(_sources.kernels_dir())))
    except Exception as exc:
        lines.append(("kernel sources", f"not found ({exc})"))
    from . import _compile

    lines.append(("kernel cache", str(_compile.cache_dir())))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    return 0


# ----------------------------------------------------------------------------
# parser
# ----------------------------------------------------------------------------


def _not_available(name, reason):
    def run(args):
        print(f"cupyflash {name}: not available ({reason})", file=sys.stderr)
        return 2

    return run


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (``PROG: error: MESSAGE (see PROG --help)``), status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser():
    parser = _Parser(
        prog="cupyflash",
        description="Exact FlashAttention for CuPy arrays (and a tiled NumPy path).",
    )
    parser.add_argument("--version", action="version", version=f"cupyflash {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="run forward and backward on a realistic shape and "
                                       "check it against the float64 reference")
    _add_demo_arguments(demo)
    demo.set_defaults(func=_run_demo)

    info = sub.add_parser("info", help="versions, GPU availability, kernel paths")
    info.set_defaults(func=_run_info)

    for name, module_name, help_text in _PLUGINS:
        try:
            module = importlib.import_module(f"{__package__}.{module_name}")
        except ImportError as exc:
            p = sub.add_parser(name, help=f"{help_text} (not available)")
            p.set_defaults(func=_not_available(name, f"{type(exc).__name__}: {exc}"),
                           ignores_extra_args=True)
        else:
            p = sub.add_parser(name, help=help_text)
            module.add_arguments(p)
            p.set_defaults(func=module.main)
    return parser


def main(argv=None):
    """Entry point of ``python -m cupyflash`` and the ``cupyflash`` script; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "ignores_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)
