"""``python -m cupyflash demo`` with bad arguments, and the reason the GPU is not used.

Bad arguments end in one line on stderr ("argument, requirement, what was given")
and exit status 2, never in a traceback.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import cupyflash
from cupyflash import cli

REPO = Path(__file__).resolve().parents[1]


def _demo_error(capsys, *args):
    """Run ``demo --device cpu ARGS`` in process; return its one error line (exit status 2)."""
    try:
        code = cli.main(["demo", "--device", "cpu", "--seqlen", "32", "--nheads", "2", *args])
    except SystemExit as exc:  # argparse
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    lines = [line for line in captured.err.strip().splitlines()
             if not line.startswith("[cupyflash] ")]  # progress lines
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("cupyflash demo: error: ")
    return lines[0]


@pytest.mark.parametrize("args,expected", [
    (["--dtype", "int8"], ["--dtype", "float16, bfloat16, float32, float64", "'int8'"]),
    (["--dtype", "foo"], ["--dtype", "must be one of", "'foo'"]),
    (["--head-dim", "300"], ["--head-dim", "from 1 to 256", "got 300"]),
    (["--head-dim", "0"], ["--head-dim", "from 1 to 256", "got 0"]),
    (["--batch", "-1"], ["--batch", "positive integer", "got -1"]),
    (["--seqlen", "0"], ["--seqlen", "positive integer", "got 0"]),
    (["--seqlen-k", "x"], ["--seqlen-k", "positive integer", "got 'x'"]),
    (["--nheads", "0"], ["--nheads", "positive integer", "got 0"]),
    (["--repeat", "0"], ["--repeat", "positive integer", "got 0"]),
    (["--seed", "-5"], ["--seed", "non-negative integer", "got -5"]),
    (["--nheads-kv", "3"], ["--nheads-kv", "must divide --nheads (2)", "got 3"]),
])
def test_bad_demo_argument_is_one_line(capsys, args, expected):
    line = _demo_error(capsys, *args)
    for text in expected:
        assert text in line, line


def test_nheads_kv_against_the_default_nheads(capsys):
    try:
        code = cli.main(["demo", "--device", "cpu", "--nheads-kv", "3"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert "--nheads-kv: must divide the default --nheads (8); got 3" in capsys.readouterr().err


def test_bad_demo_argument_from_the_shell():
    """What the user sees: no traceback, status 2, one line."""
    result = subprocess.run(
        [sys.executable, "-m", "cupyflash", "demo", "--device", "cpu", "--dtype", "int8"],
        check=False, capture_output=True, text=True, cwd=REPO.parent, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        ("cupyflash demo: error: argument --dtype: must be one of float16, bfloat16, float32, "
         "float64; got 'int8' (see cupyflash demo --help)")]


def test_bfloat16_without_ml_dtypes_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import fails
    line = _demo_error(capsys, "--dtype", "bfloat16")
    assert "--dtype" in line and "ml_dtypes" in line and "not installed" in line
    assert 'pip install "cupyflash[bf16]"' in line


def test_library_argument_errors_are_reported_not_raised(monkeypatch, capsys):
    """Errors the library raises for its arguments end the demo with status 2 ..."""
    def refuse(*args, **kwargs):
        raise NotImplementedError("cupyflash: needs compute capability 8.0 or newer; got 7.5")

    monkeypatch.setattr(cupyflash, "flash_attn_fwd", refuse)
    line = _demo_error(capsys)
    assert line.endswith("needs compute capability 8.0 or newer; got 7.5")


@pytest.mark.parametrize("exc_type", [ValueError, TypeError, ZeroDivisionError])
def test_unexpected_errors_keep_their_traceback(monkeypatch, exc_type):
    """... while any other error is a bug and propagates."""
    def broken(*args, **kwargs):
        raise exc_type("something internal")

    monkeypatch.setattr(cupyflash, "flash_attn_fwd", broken)
    with pytest.raises(exc_type, match="something internal"):
        cli.main(["demo", "--device", "cpu", "--seqlen", "32", "--nheads", "2"])


def test_a_shape_too_large_for_any_memory_is_one_line(capsys):
    """Found by QA: ``--seqlen 99999999999999999999`` ended in numpy's "Maximum allowed
    dimension exceeded" traceback."""
    line = _demo_error(capsys, "--seqlen", "99999999999999999999")
    assert "GiB of inputs, outputs and gradients, more than any memory" in line
    assert "reduce --batch, --seqlen" in line


def test_a_shape_that_does_not_fit_in_memory_is_one_line(capsys, monkeypatch):
    """Found by QA: ``--batch 100000000`` ended in numpy's _ArrayMemoryError traceback."""
    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 191. TiB for an array")  # as numpy's _ArrayMemoryError

    from cupyflash import testing
    monkeypatch.setattr(testing, "random_qkv", no_memory)
    line = _demo_error(capsys, "--batch", "3")
    assert line.startswith("cupyflash demo: error: the problem does not fit in memory (")
    assert "reduce --batch, --seqlen" in line


def test_unrecognized_argument_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--device", "cpu", "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cupyflash: error: unrecognized arguments: --bogus (see cupyflash --help)"]


# ----------------------------------------------------------------------------
# Why the GPU is not used
# ----------------------------------------------------------------------------


def _fake_cupy(monkeypatch, error):
    def count():
        raise error

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))
    monkeypatch.setitem(sys.modules, "cupy", fake)


class CUDARuntimeError(RuntimeError):
    pass


_INSUFFICIENT = CUDARuntimeError(
    "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")


def test_reason_without_a_driver_says_so(monkeypatch):
    _fake_cupy(monkeypatch, _INSUFFICIENT)
    monkeypatch.setattr(cli, "_DRIVER_LIBRARIES", ("libcupyflash-no-such-driver.so.1",))
    cupy, reason = cli.gpu_unavailable_reason()
    assert cupy is None
    assert reason.startswith("no NVIDIA driver found (libcupyflash-no-such-driver.so.1 ")
    assert f"CUDARuntimeError: {_INSUFFICIENT}" in reason  # the original error is kept
    assert "\n" not in reason


def test_reason_with_a_driver_keeps_cupys_error(monkeypatch):
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no loadable C library to pose as the driver")
    error = "cudaErrorNoDevice: no CUDA-capable device is detected"
    _fake_cupy(monkeypatch, CUDARuntimeError(error))
    monkeypatch.setattr(cli, "_DRIVER_LIBRARIES", (libc,))
    assert cli.gpu_unavailable_reason() == (None, f"no CUDA device: CUDARuntimeError: {error}")


def test_reason_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    cupy, reason = cli.gpu_unavailable_reason()
    assert cupy is None and reason.startswith("cupy not importable: ModuleNotFoundError")


def test_demo_prints_the_reason(monkeypatch, capsys):
    _fake_cupy(monkeypatch, _INSUFFICIENT)
    monkeypatch.setattr(cli, "_DRIVER_LIBRARIES", ("libcupyflash-no-such-driver.so.1",))
    assert cli.main(["demo", "--device", "gpu"]) == 2
    assert "GPU is not usable: no NVIDIA driver found" in capsys.readouterr().err


def test_conftest_uses_the_cli_reason():
    import conftest

    cupy, why_not = cli.usable_gpu()
    assert conftest.gpu_unavailable_reason() == (None if cupy is not None else why_not)


def test_conftest_runs_the_gpu_tests_on_a_usable_gpu(monkeypatch):
    """usable_gpu gives (cupy, the device's name) on a usable GPU: that name is no skip reason."""
    import conftest

    monkeypatch.setattr(cli, "usable_gpu", lambda: (object(), "Some GPU, sm_90"))
    conftest.gpu_unavailable_reason.cache_clear()
    try:
        assert conftest.gpu_unavailable_reason() is None
    finally:
        conftest.gpu_unavailable_reason.cache_clear()


@pytest.mark.parametrize("cc, usable", [("75", False), ("80", True), ("90", True)])
def test_usable_gpu_refuses_a_device_older_than_the_kernels(monkeypatch, cc, usable):
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=0, compute_capability=cc),
        runtime=types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"Some GPU"})))
    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: (fake, None))
    cupy, why = cli.usable_gpu()
    if usable:
        assert cupy is fake and why == f"Some GPU, sm_{cc}"
    else:
        assert cupy is None
        assert why == "Some GPU, sm_75 has compute capability 7.5; cupyflash's kernels need 8.0 or newer"


# ----------------------------------------------------------------------------
# check-kernels with bad arguments
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("args,expected", [
    (["--arch", "7.5"], "argument --arch: must be a compute capability MAJOR.MINOR, 8.0 or newer "
                        "(e.g. 8.0, 9.0); got 7.5"),
    (["--arch", "abc"], "argument --arch: must be a compute capability MAJOR.MINOR, 8.0 or newer "
                        "(e.g. 8.0, 9.0); got 'abc'"),
    (["--arch", "9"], "argument --arch: must be a compute capability MAJOR.MINOR, 8.0 or newer "
                      "(e.g. 8.0, 9.0); got '9'"),
    (["-j", "0"], "argument -j/--jobs: must be a positive integer; got 0"),
    (["--jobs", "x"], "argument -j/--jobs: must be a positive integer; got 'x'"),
])
def test_bad_check_kernels_argument_is_one_line(capsys, monkeypatch, args, expected):
    """Found by QA: ``--arch 7.5`` ended in a NotImplementedError traceback from
    dispatch.select_bwd, ``--arch abc`` in int()'s ValueError, and ``-j 0`` ran with one job."""
    from cupyflash import check_kernels

    def must_not_run(*a, **k):
        raise AssertionError("check-kernels ran with a bad argument")

    monkeypatch.setattr(check_kernels, "run", must_not_run)
    with pytest.raises(SystemExit) as exc:
        cli.main(["check-kernels", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cupyflash check-kernels: error: {expected} (see cupyflash check-kernels --help)"]


def test_check_kernels_arch_parses_to_the_tuple_run_takes(monkeypatch):
    try:
        from cupy.cuda import nvrtc  # noqa: F401  (check_kernels.main's own test)
    except ImportError as exc:
        pytest.skip(f"check-kernels needs cupy and NVRTC: {exc}")
    from cupyflash import check_kernels

    seen = []
    monkeypatch.setattr(check_kernels, "run", lambda archs, **kw: seen.append((archs, kw["jobs"])) or 0)
    assert cli.main(["check-kernels", "--arch", "8.6", "--arch", "9.0", "-j", "3"]) == 0
    assert cli.main(["check-kernels"]) == 0
    assert seen[0] == ([(8, 6), (9, 0)], 3)
    assert seen[1][0] == [(8, 0), (9, 0)]


def test_check_kernels_match_that_matches_nothing_is_an_error(capsys):
    """Found by QA: ``check-kernels --match <typo>`` printed "0 of 0 variants compile with
    no spills" and exited 0, a pass with nothing checked."""
    from cupyflash import check_kernels

    assert check_kernels.run([(9, 0)], quick=True, match="no_such_kernel") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cupyflash check-kernels: error: no kernel variant matches --match 'no_such_kernel' "
                   "with --quick for sm_90; nothing was compiled"]
