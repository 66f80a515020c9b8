"""The CPU path needs O(N) extra memory, not the O(N^2) of a dense score matrix.

NumPy reports its allocations to tracemalloc, so the traced peak during a call,
less what was traced when it started, is the call's extra memory (its outputs
included, its inputs excluded).
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from cupyflash import cpu

BATCH, NHEADS, HEAD_DIM = 1, 8, 64


def _extra_peak(fn, *args):
    """``(result, bytes)``: the peak traced memory of ``fn(*args)`` above its start."""
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak - start


def _check(rng, seqlen, limit_mb):
    shape = (BATCH, seqlen, NHEADS, HEAD_DIM)
    q, k, v, dout = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    dense_mb = BATCH * NHEADS * seqlen * seqlen * 4 / 1e6  # one float32 score matrix

    (out, lse), fwd_bytes = _extra_peak(cpu.fwd, q, k, v, HEAD_DIM**-0.5, False)
    assert fwd_bytes >= out.nbytes  # tracemalloc does see NumPy's allocations
    (dq, dk, dv), bwd_bytes = _extra_peak(cpu.bwd, dout, q, k, v, out, lse, HEAD_DIM**-0.5,
                                          False)
    assert bwd_bytes >= dq.nbytes + dk.nbytes + dv.nbytes
    assert np.isfinite(dq).all()
    fwd_mb, bwd_mb = fwd_bytes / 1e6, bwd_bytes / 1e6
    assert fwd_mb < limit_mb, f"forward peak {fwd_mb:.0f} MB (dense would be {dense_mb:.0f} MB)"
    assert bwd_mb < limit_mb, f"backward peak {bwd_mb:.0f} MB (dense would be {dense_mb:.0f} MB)"


@pytest.mark.slow
def test_peak_memory_at_seqlen_16384(rng):
    """The target: under 200 MB where one dense score matrix alone is 8.6 GB."""
    _check(rng, 16384, 200)


def test_peak_memory_at_seqlen_4096(rng):
    """The default-run variant: the 200 MB bound scaled by 4096/16384 (dense: 537 MB)."""
    _check(rng, 4096, 200 * 4096 / 16384)
