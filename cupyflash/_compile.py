"""Run-time compilation of kernel variants through NVRTC, with a disk cache.

One NVRTC program per variant: the source is ``#include "<file>.cu"`` and the
variant is named with ``nvrtcAddNameExpression``. Compiled cubins are cached on
disk under a key that covers the hash of every file in ``kernels_cu/`` (CuPy's
own cache only hashes the source text, not the headers it includes), the name
expression, the options, and the NVRTC version; loaded modules are memoised per
device. Compilation needs NVRTC but no GPU, which ``check-kernels`` relies on.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import _params
from ._sources import kernels_dir, sources_hash

_lock = threading.Lock()
_modules: dict[tuple[int, str], tuple[object, int]] = {}  # (device, key) -> (module handle, function handle)


def cache_dir() -> Path:
    """Where compiled cubins live: $CUPYFLASH_CACHE_DIR or ~/.cache/cupyflash."""
    env = os.environ.get("CUPYFLASH_CACHE_DIR")
    if env:
        return Path(env).expanduser()  # a quoted "~/..." reaches us unexpanded
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cupyflash"


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> str:
    """A directory holding cuda_fp16.h: pip's CUDA runtime headers, else a toolkit's."""
    candidates = []
    for mod in ("nvidia.cu13", "nvidia.cuda_runtime", "nvidia.cu12"):
        try:
            pkg = __import__(mod, fromlist=["__path__"])
            candidates += [Path(p) / "include" for p in pkg.__path__]
        except ImportError:
            pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_fp16.h").is_file():
            return str(c)
    raise RuntimeError(
        "cupyflash: cuda_fp16.h not found; install the CUDA runtime headers with "
        "`pip install nvidia-cuda-runtime` (or set CUDA_PATH to a CUDA toolkit); looked in "
        + ", ".join(str(c) for c in candidates)
    )


def _nvrtc():
    from cupy.cuda import nvrtc  # noqa: PLC0415 (cupy is optional)
    return nvrtc


def arch_name(arch: tuple[int, int]) -> str:
    """NVRTC target for a compute capability.

    sm_90 builds target ``sm_90a``: wgmma (kernels_cu/wgmma.cuh) exists only in
    the architecture-specific target, whose cubin runs on exactly cc 9.0 -- the
    device the code was compiled for anyway.
    """
    return f"sm_{arch[0]}{arch[1]}" + ("a" if arch == (9, 0) else "")


def compile_options(arch: tuple[int, int]) -> list[str]:
    return [
        "-std=c++17",
        f"-arch={arch_name(arch)}",
        f"-I{kernels_dir()}",
        f"-I{cuda_include_dir()}",
        "-default-device",
        "--ptxas-options=-v",
        *_params.size_defines(),
    ]


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    lowered_name: str
    log: str


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int
    stack_bytes: int


def parse_ptxas_log(log: str) -> Resources:
    """Registers, spill bytes (stores + loads) and stack frame from a ``ptxas -v`` log."""
    regs = re.findall(r"Used (\d+) registers", log)
    stack = re.findall(r"(\d+) bytes stack frame", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not regs:
        raise ValueError("cupyflash: no register report in the ptxas log:\n" + log)
    return Resources(
        registers=max(int(r) for r in regs),
        spill_bytes=sum(int(a) + int(b) for a, b in spills),
        stack_bytes=max((int(s) for s in stack), default=0),
    )


def _cache_key(source: str, name_expression: str, options: list[str]) -> str:
    h = hashlib.sha256()
    nvrtc_version = ".".join(map(str, _nvrtc().getVersion()))
    portable = [o for o in options if not o.startswith("-I")]  # paths vary, contents are hashed
    for part in (sources_hash(), source, name_expression, nvrtc_version, *portable):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def compile_variant(source: str, name_expression: str, arch: tuple[int, int],
                    use_cache: bool = True) -> Compiled:
    """Compile one template instantiation to a cubin (no GPU needed).

    The ptxas resource report (``--ptxas-options=-v``) is kept in ``Compiled.log``.
    """
    options = compile_options(arch)
    key = _cache_key(source, name_expression, options)
    cdir = cache_dir()
    cubin_path, meta_path = cdir / f"{key}.cubin", cdir / f"{key}.json"
    if use_cache:
        cached = _read_cached(cubin_path, meta_path)
        if cached is not None:
            return cached

    nvrtc = _nvrtc()
    code = f'#include "{source}"\n'
    prog = nvrtc.createProgram(code, f"cupyflash_{source}", [], [])
    try:
        nvrtc.addNameExpression(prog, name_expression)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(
                f"cupyflash: NVRTC failed to compile {name_expression}:\n{nvrtc.getProgramLog(prog)}"
            ) from e
        log = nvrtc.getProgramLog(prog)
        lowered = nvrtc.getLoweredName(prog, name_expression)
        # cupy 14.2's getCUBIN drops the image's final byte (a zero the ELF program
        # headers still cover); put it back so cached files are whole ELF images.
        # A trailing zero after a complete image is ignored by the loader.
        cubin = nvrtc.getCUBIN(prog) + b"\0"
    finally:
        nvrtc.destroyProgram(prog)

    if use_cache:
        _write_cached(cdir, cubin_path, cubin, meta_path, json.dumps({"lowered_name": lowered, "log": log}).encode())
    return Compiled(cubin, lowered, log)


def _read_cached(cubin_path: Path, meta_path: Path) -> Compiled | None:
    """The cached compile, or None when it is missing or unreadable (then compiled again)."""
    try:
        if not (cubin_path.is_file() and meta_path.is_file()):
            return None
        meta = json.loads(meta_path.read_text())
        return Compiled(cubin_path.read_bytes(), meta["lowered_name"], meta.get("log", ""))
    except (OSError, ValueError, KeyError, TypeError):  # unreadable, or a damaged JSON file
        return None


#: Cache directories already warned about (one warning per directory and process).
_unwritable: set[str] = set()


def _write_cached(cdir: Path, cubin_path: Path, cubin: bytes, meta_path: Path, meta: bytes) -> None:
    """Store a compile in the cache; a cache that cannot be written only costs the
    recompile next time (one warning), never the call."""
    try:
        cdir.mkdir(parents=True, exist_ok=True)
        # Write atomically so concurrent processes never read half a file.
        for path, data in ((cubin_path, cubin), (meta_path, meta)):
            fd, tmp = tempfile.mkstemp(dir=cdir)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as exc:
        if str(cdir) not in _unwritable:
            _unwritable.add(str(cdir))
            warnings.warn(f"cupyflash: cannot write the kernel cache in {cdir} ({type(exc).__name__}: {exc}); "
                          f"kernels are compiled again in every process. Set CUPYFLASH_CACHE_DIR to a writable "
                          f"directory to keep them.", RuntimeWarning, stacklevel=3)


def get_function(source: str, name_expression: str, smem_bytes: int):
    """The loaded kernel (a CUfunction handle) for the current device, compiled on first use."""
    import cupy  # noqa: PLC0415

    dev = cupy.cuda.Device()
    cache_key = (dev.id, name_expression)
    hit = _modules.get(cache_key)
    if hit is not None:
        return hit[1]
    with _lock:
        hit = _modules.get(cache_key)
        if hit is not None:
            return hit[1]
        cc = dev.compute_capability  # e.g. "90"
        arch = (int(cc[:-1]), int(cc[-1]))
        compiled = compile_variant(source, name_expression, arch)
        drv = cupy.cuda.driver
        module = drv.moduleLoadData(compiled.cubin)
        func = drv.moduleGetFunction(module, compiled.lowered_name)
        if smem_bytes > 48 * 1024:
            drv.funcSetAttribute(func, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes)
        _modules[cache_key] = (module, func)
        return func
