"""``python -m cupyflash bench`` on the command line: --suite, the options of each suite,
the experiment switches' errors, and the message without a GPU (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cupyflash import bench, cli

REPO = Path(__file__).resolve().parents[1]


def _no_gpu(monkeypatch, reason="no NVIDIA driver found (libcuda.so.1 does not load; cupy said X)"):
    """The GPU probe reports ``reason``; returns the list of probes made."""
    probes = []
    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: probes.append(1) or (None, reason))
    return probes


def _bench(capsys, *argv):
    """Run ``cupyflash bench ARGV`` in process: (exit status, stderr lines)."""
    try:
        code = cli.main(["bench", *argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


def test_suite_defaults_to_grid_and_takes_each_suite():
    parser = cli.build_parser()
    assert parser.parse_args(["bench"]).suite == "grid"
    for suite in bench.SUITES:
        assert parser.parse_args(["bench", "--suite", suite]).suite == suite
    assert set(bench.SUITES) == {"grid", "seed", "overhead", "frameworks", "decode", "variants", "bias"}
    assert set(bench.DEFAULT_REPS) == set(bench.SUITES)


def test_an_unknown_suite_is_one_line_and_status_2(capsys, monkeypatch):
    probes = _no_gpu(monkeypatch)
    code, err = _bench(capsys, "--suite", "seeds")
    assert code == 2 and len(err) == 1
    assert err[0].startswith("cupyflash bench: error: argument --suite: invalid choice: 'seeds'")
    assert "grid" in err[0] and "frameworks" in err[0]
    assert probes == []  # refused before looking for a GPU


@pytest.mark.parametrize("argv,message", [
    (["--suite", "seed", "--head-dim", "64"], "--head-dim applies to --suite grid, decode and bias only; got --suite seed"),
    (["--suite", "overhead", "--dtype", "bfloat16"], "--dtype applies to --suite grid, decode, variants and bias only; got --suite overhead"),
    (["--suite", "frameworks", "--causal", "yes"],
     "--causal applies to --suite grid only; got --suite frameworks"),
    (["--suite", "seed", "--tokens", "1024"], "--tokens applies to --suite grid only; got --suite seed"),
    (["--suite", "seed", "--no-bwd"], "--no-bwd applies to --suite grid only; got --suite seed"),
    (["--suite", "overhead", "--deterministic"],
     "--deterministic applies to --suite grid only; got --suite overhead"),
    (["--suite", "overhead", "--seqlen", "512"],
     "--seqlen applies to --suite grid, seed, decode, variants and bias only; got --suite overhead"),
    (["--suite", "frameworks", "--seqlen", "512"],
     "--seqlen applies to --suite grid, seed, decode, variants and bias only; got --suite frameworks"),
    (["--calls", "10"], "--calls applies to --suite overhead only; got --suite grid"),
    (["--suite", "seed", "--no-jax"], "--no-jax applies to --suite frameworks and variants only; got --suite seed"),
    (["--variant", "window"], "--variant applies to --suite variants only; got --suite grid"),
    (["--suite", "variants", "--head-dim", "64"],
     "--head-dim applies to --suite grid, decode and bias only; got --suite variants"),
    (["--batch", "8"], "--batch applies to --suite decode only; got --suite grid"),
    (["--suite", "seed", "--heads", "32:8"], "--heads applies to --suite decode only; got --suite seed"),
    (["--suite", "overhead", "--part", "paged"], "--part applies to --suite decode only; got --suite overhead"),
    (["--copy-tbps", "3.35"], "--copy-tbps applies to --suite decode only; got --suite grid"),
    (["--suite", "frameworks", "--max-kv-gb", "20"],
     "--max-kv-gb applies to --suite decode only; got --suite frameworks"),
    (["--suite", "seed", "--causal", "yes"], "--causal applies to --suite grid only; got --suite seed"),
])
def test_an_option_of_another_suite_is_refused_before_the_gpu(capsys, monkeypatch, argv, message):
    probes = _no_gpu(monkeypatch)
    assert _bench(capsys, *argv) == (2, [f"bench: {message}"])
    assert probes == []


@pytest.mark.parametrize("argv", [
    ["--suite", "seed", "--seqlen", "512"], ["--suite", "overhead", "--calls", "50", "--reps", "3"],
    ["--suite", "frameworks", "--no-jax", "--no-torch"], ["--head-dim", "64", "--causal", "yes"],
    ["--suite", "seed", "--bwd-dq", "mma"],  # the experiment switches are process-wide: every suite
    ["--suite", "decode", "--batch", "1", "--seqlen", "1024", "--heads", "32:8", "--head-dim", "128",
     "--dtype", "bfloat16", "--part", "grid", "--part", "paged", "--copy-tbps", "3.35", "--max-kv-gb", "20"],
])
def test_options_of_the_suite_pass_on_to_the_gpu_probe(capsys, monkeypatch, argv):
    probes = _no_gpu(monkeypatch)
    code, err = _bench(capsys, *argv)
    assert code == 2 and probes == [1]
    assert err == ["bench: needs a CUDA GPU: no NVIDIA driver found (libcuda.so.1 does not load; cupy said X)"]


@pytest.mark.parametrize("argv,rule", [
    (["--reps", "0"], "argument --reps: must be a positive integer; got 0"),
    (["--calls", "-3"], "argument --calls: must be a positive integer; got -3"),
    (["--seqlen", "x"], "argument --seqlen: must be a positive integer; got 'x'"),
    (["--head-dim", "0"], "argument --head-dim: must be a positive integer; got 0"),
    (["--suite", "decode", "--copy-tbps", "0"], "argument --copy-tbps: must be a positive number; got '0'"),
    (["--suite", "decode", "--max-kv-gb", "inf"], "argument --max-kv-gb: must be a positive number; got 'inf'"),
    (["--suite", "decode", "--heads", "32:6"],
     "argument --heads: must be Q:KV with Q a positive multiple of KV (e.g. 32:8); got '32:6'"),
    (["--suite", "decode", "--heads", "32"],
     "argument --heads: must be Q:KV with Q a positive multiple of KV (e.g. 32:8); got '32'"),
    (["--suite", "decode", "--batch", "0"], "argument --batch: must be a positive integer; got 0"),
])
def test_a_bad_number_is_one_line(capsys, argv, rule):
    code, err = _bench(capsys, *argv)
    assert code == 2
    assert err == [f"cupyflash bench: error: {rule} (see cupyflash bench --help)"]


@pytest.mark.parametrize("argv,message", [
    (["--fwd-tiles", "64:128,64"], "--fwd-tiles takes D:BLOCK_M,BLOCK_N,WARPS; got '64:128,64'"),
    (["--fwd-tiles", "64"], "--fwd-tiles takes D:BLOCK_M,BLOCK_N,WARPS; got '64'"),
    (["--fwd-sm90", "x:64,1"], "--fwd-sm90 takes D:BLOCK_N,CTAS_PER_SM; got 'x:64,1'"),
    (["--fwd-sm90", "128:64,1,2"], "--fwd-sm90 takes D:BLOCK_N,CTAS_PER_SM; got '128:64,1,2'"),
])
def test_a_bad_tile_override_is_one_line(capsys, monkeypatch, argv, message):
    probes = _no_gpu(monkeypatch)
    code, err = _bench(capsys, *argv)
    assert (code, err, probes) == (2, [f"bench: {message}"], [])


def test_tile_overrides_parse():
    assert bench.parse_tiles(["64:128,64,4", "128:64,32,8"], "--fwd-tiles", ("M", "N", "W")) == {
        64: (128, 64, 4), 128: (64, 32, 8)}
    assert bench.parse_tiles(None, "--fwd-sm90", ("N", "C")) == {}


class CUDARuntimeError(RuntimeError):
    pass


def test_without_a_driver_bench_says_no_driver_found(monkeypatch, capsys):
    """cupy's own words ("CUDA driver version is insufficient") mislead when there is no driver."""
    def count():
        raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                               "for CUDA runtime version")

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cli, "_DRIVER_LIBRARIES", ("libcupyflash-no-such-driver.so.1",))
    for suite in bench.SUITES:
        code, err = _bench(capsys, "--suite", suite)
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith("bench: needs a CUDA GPU: no NVIDIA driver found "
                                 "(libcupyflash-no-such-driver.so.1 does not load; cupy said ")


def test_without_a_driver_from_the_shell():
    """What the user sees on a machine without the NVIDIA driver: one line, status 2.

    Without cupy installed (``pip install -e ".[test]"``) the line says so instead.
    """
    cupy, reason = cli.gpu_unavailable_reason()
    if cupy is not None:
        pytest.skip("a GPU is usable here")
    if not reason.startswith("cupy not importable") and cli._nvidia_driver_loads():
        pytest.skip("the NVIDIA driver loads here (the message names the device error instead)")
    result = subprocess.run([sys.executable, "-m", "cupyflash", "bench", "--suite", "seed"],
                            check=False, capture_output=True, text=True, cwd=REPO.parent, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines == [f"bench: needs a CUDA GPU: {reason}"]
    assert reason.startswith(("no NVIDIA driver found (", "cupy not importable: "))
