"""The PASS/FAIL bars of the overhead and frameworks suites (no GPU)."""

from __future__ import annotations

import pytest

from cupyflash import _bench_suites as suites


def test_the_overhead_bars_are_the_brief():
    assert suites.BARS_US == {("cupy", "fwd"): 10.0, ("cupy", "bwd"): 20.0,
                              ("torch", "fwd"): 20.0, ("torch", "bwd"): 35.0,
                              ("flash_attn_func", "fwd"): 20.0, ("flash_attn_func", "bwd"): 35.0}


@pytest.mark.parametrize("wall_us,bar_us,regime,status", [
    (9.99, 10.0, "host-bound", "PASS"),
    (10.0, 10.0, "host-bound", "PASS"),      # the bar is "<="
    (10.01, 10.0, "host-bound", "FAIL"),
    (36.0, 35.0, "host-bound", "FAIL"),
    (80.0, 20.0, "GPU-bound", "n/a"),        # the GPU's time sets the wall time: no verdict on the host
    (5.0, None, "host-bound", "-"),          # no bar for this row
])
def test_overhead_bar_status(wall_us, bar_us, regime, status):
    assert suites.bar_status(wall_us, bar_us, regime) == status


@pytest.mark.parametrize("host_us,gpu_us,regime", [
    (8.0, 3.0, "host-bound"), (3.0, 8.0, "GPU-bound"), (5.0, 5.0, "GPU-bound")])
def test_regime(host_us, gpu_us, regime):
    assert suites.regime(host_us, gpu_us) == regime


@pytest.mark.parametrize("framework,seqlen,bar", [
    ("torch", 128, ("fa2", 1.1, False)), ("torch", 1024, ("fa2", 1.1, False)),
    ("torch", 2048, ("fa2", 1.0, True)), ("torch", 4096, ("fa2", 1.0, True)),
    ("jax", 128, ("cudnn", 1.2, False)), ("jax", 1024, ("cudnn", 1.2, False)), ("jax", 4096, None)])
def test_step_bars(framework, seqlen, bar):
    assert suites.step_bar(framework, seqlen) == bar


def test_every_measured_step_shape_has_a_bar():
    for shape in suites.TORCH_STEP_SHAPES:
        assert suites.step_bar("torch", shape[1]) is not None
    for shape in suites.JAX_STEP_SHAPES:
        assert suites.step_bar("jax", shape[1]) is not None


@pytest.mark.parametrize("ours,ref,limit,strict,status", [
    (1.1, 1.0, 1.1, False, "PASS"),   # exactly 1.1x
    (1.1001, 1.0, 1.1, False, "FAIL"),
    (0.5, 1.0, 1.1, False, "PASS"),
    (1.2, 1.0, 1.2, False, "PASS"),
    (1.25, 1.0, 1.2, False, "FAIL"),
    (1.0, 1.0, 1.0, True, "FAIL"),    # "faster than FA2": a tie fails
    (0.99, 1.0, 1.0, True, "PASS"),
    ("OOM", 1.0, 1.1, False, "n/a"),
    (1.0, "error", 1.1, False, "n/a"),
    (1.0, None, 1.1, False, "n/a"),
])
def test_step_status(ours, ref, limit, strict, status):
    assert suites.step_status(ours, ref, limit, strict) == status


def test_judge_step_writes_ratios_and_the_bar():
    res = {"framework": "torch", "seqlen": 2048, "ours_ms": 2.0, "fa2_ms": 2.2, "cudnn_ms": 1.6}
    suites.judge_step(res)
    assert res["ratio_vs_fa2"] == pytest.approx(1.1) and res["ratio_vs_cudnn"] == pytest.approx(0.8)
    assert (res["bar"], res["status"]) == ("ours < fa2", "PASS")
    res = {"framework": "jax", "seqlen": 128, "ours_ms": 1.3, "cudnn_ms": 1.0, "xla_ms": "OOM"}
    suites.judge_step(res)
    assert "ratio_vs_xla" not in res
    assert (res["bar"], res["status"]) == ("ours <= 1.2x cudnn", "FAIL")
    res = {"framework": "jax", "seqlen": 4096, "ours_ms": 1.0}
    suites.judge_step(res)
    assert (res["bar"], res["status"]) == (None, "-")


def test_count_statuses():
    results = [{"status": s} for s in ("PASS", "FAIL", "PASS", "-", "n/a", "OOM", "error")] + [{}]
    assert suites.count_statuses(results) == {"PASS": 2, "FAIL": 1, "n/a": 1, "error": 1, "OOM": 1}
