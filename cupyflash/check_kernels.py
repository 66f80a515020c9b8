"""``python -m cupyflash check-kernels``: compile every kernel variant, no GPU needed.

Each instantiation the dispatcher can return is compiled through NVRTC for each
target architecture with ``--ptxas-options=-v``; any spill or stack frame is a
failure. Prints registers, shared memory and cold compile time per variant.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import time


def _arch(text: str) -> tuple[int, int]:
    """An argparse type: a compute capability ``MAJOR.MINOR`` the kernels support (8.0 or newer)."""
    from .dispatch import ARCHS  # noqa: PLC0415

    oldest = ".".join(map(str, ARCHS[0]))
    rule = f"must be a compute capability MAJOR.MINOR, {oldest} or newer (e.g. 8.0, 9.0)"
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{rule}; got {text!r}")
    arch = (int(parts[0]), int(parts[1]))
    if arch < ARCHS[0] or arch[1] > 9:
        raise argparse.ArgumentTypeError(f"{rule}; got {text}")
    return arch


def _jobs(text: str) -> int:
    """An argparse type: a positive number of parallel compiles."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", action="append", type=_arch, default=None, metavar="MAJOR.MINOR",
                        help="target compute capability (repeatable); default 8.0 and 9.0")
    parser.add_argument("--quick", action="store_true",
                        help="only the even, aligned, unsplit fp16 variants (one per head_dim, causal or not)")
    parser.add_argument("--match", default=None, help="only variants whose name contains this text")
    parser.add_argument("--no-cache", action="store_true", help="compile cold (measures compile time)")
    parser.add_argument("-j", "--jobs", type=_jobs, default=os.cpu_count() or 1, help="parallel compiles")


def _quick_sm90(launch) -> bool:
    """The wgmma kernels (cc 9.0) in --quick: fp16, even head_dim, the variants the
    default (non-deterministic) mode launches."""
    args = launch.args
    if launch.template.endswith("flash_fwd_ws_kernel"):  # <T, D, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, EVEN_K, ..>
        return args[0] == "__half" and args[6] == "true"
    if launch.template.endswith("flash_bwd_ws_kernel"):  # <T, D, BLOCK_M, IS_CAUSAL, EVEN_K, WITH_DQ, VARIANT>
        return args[0] == "__half" and args[4] == "true" and args[6] == "0"
    if not launch.source.endswith("_sm90.cu") or args[0] != "__half":
        return False
    if launch.template.endswith("flash_bwd_dkdv_sm90_kernel"):  # <T, D, CAUSAL, EVEN_K, DETERMINISTIC, VARIANT>
        from . import dispatch  # noqa: PLC0415

        # no dQ where the default takes dQ from its own kernel
        d = int(args[1])
        no_dq = dispatch.BWD_DQ_SM90 and d in dispatch._BWD_SM90_SEPARATE_DQ  # noqa: SLF001
        return args[3] == "true" and args[4] == str(no_dq).lower() and args[5] == "0"
    if launch.template.endswith("flash_fwd_sm90_kernel"):  # <..., IS_CAUSAL, EVEN_K, VARIANT>
        return args[5] == "true" and args[6] == "0"
    return args[-2] == "true" and args[-1] == "0"  # dQ: <..., IS_CAUSAL, EVEN_K, VARIANT>


def _launches(arch: tuple[int, int], quick: bool, match: str | None):
    from . import dispatch  # noqa: PLC0415

    launches = dispatch.all_fwd_launches(arch) + dispatch.all_bwd_launches(arch) + dispatch.all_decode_launches(arch)
    if quick:
        launches = [L for L in launches
                    if L.args[0] == "__half" and "false, true, true, false, 0" in ", ".join(L.args[-5:]) or
                    (L.args[0] == "__half" and L.template.endswith("combine_kernel") and L.args[1] == "128") or
                    _quick_sm90(L)]
    if match:
        launches = [L for L in launches if match in L.name_expression]
    return launches


def _compile_one(item):
    source, name, arch, use_cache = item
    from . import _compile  # noqa: PLC0415

    t0 = time.perf_counter()
    compiled = _compile.compile_variant(source, name, arch, use_cache=use_cache)
    return _compile.parse_ptxas_log(compiled.log), time.perf_counter() - t0


def run(archs, quick=False, match=None, jobs=1, use_cache=True, out=sys.stdout) -> int:
    per_arch = {a: _launches(a, quick, match) for a in archs}
    items = [(L.source, L.name_expression, a, use_cache) for a in archs for L in per_arch[a]]
    if not items:  # a --match that matches nothing checked nothing: that is no pass
        print(f"cupyflash check-kernels: error: no kernel variant matches --match {match!r}"
              f"{' with --quick' if quick else ''} for {', '.join(f'sm_{a}{b}' for a, b in archs)}; "
              f"nothing was compiled", file=sys.stderr)
        return 2
    smem = {L.name_expression: L.smem_bytes for a in archs for L in per_arch[a]}
    failures = 0
    print(f"compiling {len(items)} variants for {', '.join(f'sm_{a}{b}' for a, b in archs)} "
          f"with {jobs} jobs", file=out, flush=True)
    with cf.ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = pool.map(_compile_one, items)  # in order, as they finish
        for (source, name, arch, _), (res, secs) in zip(items, results):
            bad = res.spill_bytes or res.stack_bytes
            failures += bool(bad)
            print(f"{'FAIL' if bad else 'ok  '} sm_{arch[0]}{arch[1]} regs={res.registers:3d} "
                  f"spill={res.spill_bytes:4d}B stack={res.stack_bytes:4d}B smem={smem[name] // 1024:4d}KB "
                  f"{secs:5.1f}s  {name}", file=out, flush=True)
    print(f"{len(items) - failures} of {len(items)} variants compile with no spills", file=out)
    return 1 if failures else 0


def main(args: argparse.Namespace) -> int:
    try:
        from cupy.cuda import nvrtc  # noqa: F401, PLC0415
    except ImportError as e:
        print(f"check-kernels needs cupy and NVRTC (pip install 'cupyflash[cuda13]'): {e}", file=sys.stderr)
        return 2
    archs = args.arch or [(8, 0), (9, 0)]
    return run(archs, quick=args.quick, match=args.match, jobs=args.jobs, use_cache=not args.no_cache)
