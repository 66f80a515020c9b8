"""The package as installed: imports, exports, and a wheel that carries the kernels."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import cupyflash

REPO = Path(__file__).resolve().parents[1]


def _python(code, *, cwd, pythonpath):
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=cwd, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_does_not_import_gpu_frameworks(tmp_path):
    out = _python(
        "import sys, cupyflash, cupyflash.cpu, cupyflash.reference, cupyflash.testing; "
        "print(sorted(m for m in ('cupy', 'torch', 'jax') if m in sys.modules))",
        cwd=tmp_path, pythonpath=REPO)
    assert out.strip() == "[]"


def test_exports():
    assert cupyflash.__version__ == "0.1.0"
    for name in ("flash_attn_fwd", "flash_attn_bwd", "flash_attn", "reference"):
        assert name in cupyflash.__all__ and hasattr(cupyflash, name)
    assert cupyflash.reference.attention_fwd


def test_version_matches_pyproject():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^version = "(.*)"$', text, re.M).group(1) == cupyflash.__version__


def test_wheel_carries_the_kernels(tmp_path):
    kernels = sorted(p.name for p in (REPO / "kernels_cu").glob("*.cu*"))
    assert "flash_fwd.cu" in kernels, "kernels_cu/flash_fwd.cu is missing from the checkout"
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(wheel_dir), str(REPO)], capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    [wheel] = wheel_dir.glob("cupyflash-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for name in kernels:
        assert f"cupyflash/kernels_cu/{name}" in names
    assert "cupyflash/cli.py" in names and "cupyflash/_sources.py" in names

    install = subprocess.run([*pip, "install", "--no-deps", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _python(
        "import cupyflash, cupyflash._sources as s; "
        "print(cupyflash.__file__); print(s.kernels_dir()); print(s.sources_hash())",
        cwd=elsewhere, pythonpath=target)
    module_file, kernels_dir, digest = out.split()
    assert Path(module_file).is_relative_to(target)
    assert Path(kernels_dir).is_relative_to(target)
    sys.path.insert(0, str(REPO))
    try:
        from cupyflash import _sources
        assert digest == _sources.sources_hash()  # the same kernel files, byte for byte
    finally:
        sys.path.remove(str(REPO))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_pyproject_declares_runtime_deps_numpy_and_scipy_only():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert sorted(re.split(r"[<>=!~ ]", d)[0] for d in project["dependencies"]) == \
        ["numpy", "scipy"]
    assert project["scripts"]["cupyflash"] == "cupyflash.cli:main"
