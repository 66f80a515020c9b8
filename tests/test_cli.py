"""``python -m cupyflash``: info, demo, and the check-kernels/bench hooks."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cupyflash import bench, cli, cpu
from fakes import cpu_compute_bwd, cpu_compute_fwd, install_fake_gpu

REPO = Path(__file__).resolve().parents[1]


def _run(*args, env=None):
    """Run ``python -m cupyflash ARGS`` from outside the repo; returns the CompletedProcess."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-m", "cupyflash", *args], capture_output=True,
                          text=True, env=full_env, cwd=REPO.parent, timeout=300)


def test_info():
    result = _run("info", env={"CUPYFLASH_CACHE_DIR": "/tmp/cf-cache-test"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("cupyflash")
    assert "0.1.0" in out.splitlines()[0]
    for key in ("numpy", "scipy", "cupy", "GPU", "NVRTC", "kernel sources", "kernel cache"):
        assert any(line.startswith(key) for line in out.splitlines()), key
    assert "/tmp/cf-cache-test" in out


def test_info_default_cache_dir(monkeypatch, capsys):
    monkeypatch.delenv("CUPYFLASH_CACHE_DIR", raising=False)
    assert cli.main(["info"]) == 0
    assert os.path.join(".cache", "cupyflash") in capsys.readouterr().out


def test_cache_dir_expands_a_quoted_tilde(monkeypatch, tmp_path, capsys):
    """Found by QA: ``export CUPYFLASH_CACHE_DIR="~/kcache"`` (quoted, so the shell leaves
    the tilde) made the cache a directory literally named "~" under the working directory."""
    from cupyflash import _compile

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", "~/kcache")
    assert _compile.cache_dir() == tmp_path / "kcache"
    assert cli.main(["info"]) == 0
    assert str(tmp_path / "kcache") in capsys.readouterr().out


def test_demo_cpu_small():
    result = _run("demo", "--device", "cpu", "--seqlen", "200", "--seqlen-k", "300",
                  "--nheads", "4", "--nheads-kv", "2", "--head-dim", "40", "--causal",
                  "--seed", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "CPU path" in out
    assert "q (1, 200, 4, 40)" in out and "k, v (1, 300, 2, 40)" in out
    assert "causal=True" in out and "seed 3" in out
    assert out.count("TFLOP/s") == 2
    assert out.count("(one run)") == 2  # the CPU path times a single run
    assert "max |error| vs float64 reference" in out and "check passed" in out
    assert "[cupyflash] forward" in result.stderr  # progress goes to stderr


def test_demo_cpu_default_shape():
    """The shape a user without a GPU gets; it must stay quick."""
    result = _run("demo", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "q (1, 1024, 8, 64)" in result.stdout and "float32" in result.stdout


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_demo_cpu_low_precision(capsys, dtype):
    pytest.importorskip("ml_dtypes")
    assert cli.main(["demo", "--device", "cpu", "--seqlen", "130", "--nheads", "2",
                     "--dtype", dtype]) == 0
    assert f"dtype {dtype}" in capsys.readouterr().out


def test_demo_fails_when_the_check_fails(monkeypatch, capsys):
    real_fwd = cpu.fwd

    def wrong_fwd(*args):
        out, lse = real_fwd(*args)
        out[0, 3, 1, 2] += 0.5
        return out, lse

    monkeypatch.setattr(cpu, "fwd", wrong_fwd)
    assert cli.main(["demo", "--device", "cpu", "--seqlen", "64", "--nheads", "2"]) == 1
    assert "check FAILED" in capsys.readouterr().out


def test_demo_gpu_without_gpu_says_why(capsys):
    cupy, reason = cli._probe_gpu()
    if cupy is not None:
        pytest.skip("a GPU is usable here")
    assert cli.main(["demo", "--device", "gpu"]) == 2
    assert "not usable" in capsys.readouterr().err


def test_reference_subset_fits():
    cfg = dict(batch=4, seqlen_q=2048, seqlen_k=2048, nheads_q=16, nheads_kv=4, head_dim=64)
    b, hq, hkv = cli._reference_subset(cfg)
    assert (b, hq, hkv) == (slice(0, 1), slice(0, 4), slice(0, 1))  # whole GQA groups
    small = dict(cfg, batch=2, seqlen_q=64, seqlen_k=64)
    assert cli._reference_subset(small) == (slice(0, 2), slice(0, 16), slice(0, 4))


def test_no_command_prints_usage():
    result = _run()
    assert result.returncode == 2
    assert "usage: cupyflash" in result.stderr and "demo" in result.stderr


def test_version():
    result = _run("--version")
    assert result.returncode == 0 and result.stdout.strip() == "cupyflash 0.1.0"


@pytest.mark.parametrize("command,module", [("check-kernels", "check_kernels"),
                                            ("bench", "bench")])
def test_missing_plugin_is_not_available(monkeypatch, capsys, command, module):
    monkeypatch.setitem(sys.modules, f"cupyflash.{module}", None)  # import fails
    assert cli.main([command, "--anything"]) == 2
    assert f"cupyflash {command}: not available" in capsys.readouterr().err


@pytest.mark.parametrize("command,module", [("check-kernels", "check_kernels"),
                                            ("bench", "bench")])
def test_plugin_is_registered(monkeypatch, command, module):
    fake = types.ModuleType(f"cupyflash.{module}")
    seen = []
    fake.add_arguments = lambda parser: parser.add_argument("--arch")
    fake.main = lambda args: seen.append(args.arch) or 7
    monkeypatch.setitem(sys.modules, f"cupyflash.{module}", fake)
    monkeypatch.delattr(f"cupyflash.{module}", raising=False)
    assert cli.main([command, "--arch", "9.0"]) == 7
    assert seen == ["9.0"]


@pytest.fixture
def fake_gpu_stack(monkeypatch):
    """A fake cupy with one device, and fake GPU modules that run the CPU path;
    returns the kernel runs, ``(kind, plan keywords)`` in order."""
    _, runs = install_fake_gpu(monkeypatch, cpu_compute_fwd, cpu_compute_bwd)
    return runs


def test_demo_gpu_branch_with_a_fake_gpu(fake_gpu_stack, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_MAX_REFERENCE_SCORES", 2 * 128 * 128)  # force a subset
    assert cli.main(["demo", "--batch", "2", "--seqlen", "128", "--nheads", "8",
                     "--nheads-kv", "4", "--head-dim", "32", "--causal", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "GPU (Fake GPU, sm_90)" in out and "dtype float16" in out
    assert out.count("(median of 2 runs)") == 2
    assert "batch 0..0, query heads 0..1" in out and "check passed" in out
    kinds = [kind for kind, _ in fake_gpu_stack]
    assert kinds == ["fwd", "bwd"] + ["fwd"] * 2 + ["bwd"] * 2  # warm-up, then timed


def test_demo_gpu_rejects_a_dtype_the_gpu_lacks(fake_gpu_stack, capsys):
    assert cli.main(["demo", "--dtype", "float32", "--seqlen", "64"]) == 2
    assert "GPU path takes float16" in capsys.readouterr().err
    assert fake_gpu_stack == []
