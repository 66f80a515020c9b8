"""Shared fixtures: a fresh random generator per test, and the skip for GPU tests.

Tests marked ``gpu`` are skipped, with the reason, when cupy does not import or
no CUDA device is usable (the reason is ``cupyflash.cli.usable_gpu``'s,
as ``python -m cupyflash info`` prints it).  CuPy and the CLI module are imported
only when such tests were collected.

Every test that takes ``rng`` gets a generator seeded from fresh entropy; the
seed is printed in the report of a failing test.  Set ``CUPYFLASH_TEST_SEED``
to rerun with a given seed.

"""

from __future__ import annotations

import functools
import os

# The CPU path multiplies small tiles: BLAS threads gain little there and, on a
# machine whose cores are busy, spin-wait for each other (100x slower seen on 2
# cores).  One thread keeps the run time predictable.  Must precede numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason():
    """None when cupy imports and sees a CUDA device the kernels run on, else why not
    (the CLI's wording)."""
    from cupyflash.cli import usable_gpu as probe  # imported only when needed

    cupy, why_not = probe()  # (cupy, the device's name) when usable
    return None if cupy is not None else why_not


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason is not None:
        skip = pytest.mark.skip(reason=reason)
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A ``numpy.random.Generator`` seeded from fresh entropy (or CUPYFLASH_TEST_SEED)."""
    env = os.environ.get("CUPYFLASH_TEST_SEED")
    seed = int(env) if env else int(np.random.SeedSequence().entropy)
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "rng_seed":
                report.sections.append(
                    ("rng seed", f"rerun with CUPYFLASH_TEST_SEED={value}")
                )


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    """Every test plans its calls afresh: plans are cached per call signature
    (``_api``, ``_gpu``, ``_gpu_bwd``, ``_kvcache``, ``_torch_path``), and a test that patches a
    dispatch table or a device fact must not meet plans made before it, nor
    leave its own behind.  Compiled kernels stay cached (on disk and per device)."""
    import sys

    from cupyflash import _api, _gpu, _gpu_bwd, _kvcache, _launch

    for module, names in ((_api, ("_FWD_ENTRIES", "_BWD_ENTRIES")), (_gpu, ("PLANS",)), (_gpu_bwd, ("PLANS",)),
                          (_kvcache, ("_ENTRIES",)),
                          (sys.modules.get("cupyflash._torch_path"),
                           ("_FWD_ENTRIES", "_BWD_ENTRIES"))):
        for name in names if module is not None else ():
            monkeypatch.setattr(module, name, type(getattr(module, name))())
    monkeypatch.setattr(_launch, "num_sms", _launch.num_sms)  # undone if a test patches them
    monkeypatch.setattr(_launch, "compute_capability", _launch.compute_capability)


@pytest.fixture
def launches(monkeypatch):
    """Record the names of the kernels launched (the varlen kernels must exist).

    The per-sequence loop launches the forward kernel once per sequence; the
    varlen path once per batch.
    """
    from cupyflash import _gpu, _launch

    assert hasattr(_gpu, "varlen_fwd") and hasattr(_gpu, "varlen_bwd")
    names = []
    real_call = _launch.Launcher.__call__

    def call(self, stream, *pointers, var=None):
        names.extend(spec.template.rsplit("::", 1)[1] for spec in self.launches)
        real_call(self, stream, *pointers, var=var)

    monkeypatch.setattr(_launch.Launcher, "__call__", call)
    return names




@pytest.fixture
def jax_cpu_device():
    """Run the test with JAX's CPU device as the default one (for the tests of the
    CPU backend's callbacks, on a machine whose default JAX backend is a GPU)."""
    jax = pytest.importorskip("jax")
    with jax.default_device(jax.devices("cpu")[0]):
        yield
