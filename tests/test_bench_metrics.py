"""bench's numbers without a GPU: error metrics, the chunked float64 reference, OOM
recognition, input rotation, ratios and table cells."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash import _bench_suites as suites
from cupyflash import bench, reference


def test_error_metrics_max_abs_and_relative_l2():
    ref = np.array([[3.0, 0.0], [0.0, 4.0]])
    actual = np.array([[3.0, 0.5], [0.0, 3.0]], dtype=np.float16)  # errors 0.5 and -1
    max_abs, rel = suites.error_metrics(np, actual, ref)
    assert max_abs == 1.0
    assert rel == pytest.approx(math.sqrt(0.25 + 1.0) / 5.0)


def test_error_metrics_of_exact_and_of_zero_references():
    x = np.arange(6.0).reshape(2, 3)
    assert suites.error_metrics(np, x, x) == (0.0, 0.0)
    zero = np.zeros(3)
    assert suites.error_metrics(np, zero, zero) == (0.0, 0.0)
    assert suites.error_metrics(np, np.ones(3), zero) == (1.0, math.inf)


def test_error_metrics_see_a_nan():
    max_abs, rel = suites.error_metrics(np, np.array([1.0, np.nan]), np.array([1.0, 1.0]))
    assert math.isnan(max_abs) and math.isnan(rel)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(7, 7), (5, 9), (9, 4)])
@pytest.mark.parametrize("max_scores", [1, 1 << 27])  # one head per chunk, and all at once
def test_reference_matches_cupyflash_reference(rng, causal, seqlen_q, seqlen_k, max_scores):
    """The GPU-side float64 reference (here with numpy) is cupyflash.reference, head chunks or not."""
    batch, nheads, head_dim, scale = 2, 3, 8, 0.3
    q = rng.standard_normal((batch, seqlen_q, nheads, head_dim)).astype(np.float16)
    k, v = (rng.standard_normal((batch, seqlen_k, nheads, head_dim)).astype(np.float16) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float16)
    got = suites.reference_attention(np, q, k, v, dout, softmax_scale=scale, causal=causal,
                                     max_scores=max_scores)
    out, _ = reference.attention_fwd(q, k, v, softmax_scale=scale, causal=causal)
    dq, dk, dv = reference.attention_bwd(dout, q, k, v, softmax_scale=scale, causal=causal)
    for name, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv)):
        assert got[name].dtype == np.float64 and got[name].shape == want.shape
        np.testing.assert_allclose(got[name], want, rtol=1e-12, atol=1e-12, err_msg=name)


def test_reference_takes_no_gqa(rng):
    q = np.zeros((1, 4, 4, 8))
    k = np.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="as many KV heads as query heads"):
        suites.reference_attention(np, q, k, k, q, softmax_scale=1.0, causal=False)


class OutOfMemoryError(RuntimeError):
    """Named as torch's and cupy's are."""


@pytest.mark.parametrize("exc,oom", [
    (OutOfMemoryError("Tried to allocate 64.00 GiB"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDNN_STATUS_ALLOC_FAILED"), True),
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"), True),
    (RuntimeError("No available kernel. Aborting execution."), False),
    (ValueError("head_dim must be at most 256"), False),
])
def test_is_oom(exc, oom):
    assert suites.is_oom(exc) is oom


def test_mark_failed_fills_only_what_is_missing():
    res = {"math_fwd_ms": 1.5}
    suites.mark_failed(res, "math", ["math_fwd_ms", "math_bwd_ms"], OutOfMemoryError("Tried\n  to allocate"))
    assert res == {"math_fwd_ms": 1.5, "math_bwd_ms": "OOM",
                   "math_error": "OutOfMemoryError: Tried to allocate"}
    res = {}
    suites.mark_failed(res, "cudnn", ["cudnn_ms"], RuntimeError("No available kernel"))
    assert res == {"cudnn_ms": "error", "cudnn_error": "RuntimeError: No available kernel"}


def test_rotation_count_keeps_l2_from_holding_the_inputs(monkeypatch):
    monkeypatch.setattr(bench, "L2_BYTES", 100)
    assert bench.rotation_count(100) == 1
    assert bench.rotation_count(1000) == 1
    assert bench.rotation_count(99) == 4      # the 3 others: 297 bytes >= 2 x L2
    assert bench.rotation_count(50) == 5
    assert bench.rotation_count(1) == 201
    for nbytes in range(1, 100):
        count = bench.rotation_count(nbytes)
        assert (count - 1) * nbytes >= 2 * 100 > (count - 2) * nbytes


def test_rotation_counts_of_the_suites():
    """The real L2: the grid's sets never rotate, the small seed and step shapes do."""
    assert bench.L2_BYTES == 50 * 2**20
    assert bench.rotation_count(bench.set_bytes((1, 16384, 32, 64))) == 1       # the grid's smallest set
    assert bench.rotation_count(bench.set_bytes((1, 512, 32, 128))) == 8        # seed at 512: 16 MiB
    assert bench.rotation_count(bench.set_bytes((1, 32768, 32, 128))) == 1
    assert bench.set_bytes((8, 128, 12, 64)) == 4 * 8 * 128 * 12 * 64 * 2


def test_rotating_calls_each_in_turn():
    seen = []
    fns = [lambda i=i: seen.append(i) or i for i in range(3)]
    assert bench._rotating(fns[:1]) is fns[0]
    call = bench._rotating(fns)
    assert [call() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert seen == [0, 1, 2, 0, 1, 2, 0]


def test_ratio_and_cells():
    assert suites.ratio(3.0, 2.0) == 1.5
    assert suites.ratio("OOM", 2.0) is None and suites.ratio(1.0, "error") is None
    assert suites.ratio(None, 1.0) is None and suites.ratio(1.0, 0.0) is None
    assert suites.cell(1.23456, 7, ".3f") == "  1.235"
    assert suites.cell("OOM", 5, ".3f") == "  OOM"
    assert suites.cell(None, 3, ".1f") == "  -"
    assert suites.cell(True, 5, ".1f") == " True"  # a flag is not a number


def test_flops():
    assert bench.flops(2, 3, 5, 7, 11, causal=False) == 4 * 2 * 3 * 5 * 7 * 11
    assert bench.flops(2, 3, 5, 7, 11, causal=True) == 2 * 2 * 3 * 5 * 7 * 11
    assert bench.flops(2, 3, 5, 7, 11, causal=True, bwd=True) == 2.5 * 2 * 2 * 3 * 5 * 7 * 11
