"""Variable-length batches on the GPU (cupy float16) against the float64 reference.

Each case runs twice: through the varlen kernels (``_gpu.varlen_fwd`` /
``_gpu.varlen_bwd``, skipped while the GPU module has none) and through the
per-sequence loop over ``_gpu.fwd`` / ``_gpu.bwd`` that is used without them.
Tolerance as in the other GPU tests: ``factor * naive float16 error + 1e-3``.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import testing
from test_varlen import LAYOUTS, cu_seqlens, packed_inputs, packed_reference  # sibling module

pytestmark = pytest.mark.gpu

FLOOR = 1e-3


def _cp():
    return pytest.importorskip("cupy")


@pytest.fixture(params=["kernel", "loop"])
def route(request, monkeypatch):
    """Run through the varlen kernels, or hide them to exercise the per-sequence loop."""
    from cupyflash import _gpu

    if request.param == "kernel":
        if not hasattr(_gpu, "varlen_fwd"):
            pytest.skip("cupyflash._gpu has no varlen_fwd yet (the per-sequence loop is used)")
    else:
        monkeypatch.delattr(_gpu, "varlen_fwd", raising=False)
        monkeypatch.delattr(_gpu, "varlen_bwd", raising=False)
    return request.param


def _run(dout, q, k, v, lens_q, lens_k, causal, deterministic=False):
    """Host float16 inputs -> host results of the GPU forward and backward."""
    cp = _cp()
    d_dout, d_q, d_k, d_v = (cp.asarray(x) for x in (dout, q, k, v))
    args = (cp.asarray(cu_seqlens(lens_q)), cp.asarray(cu_seqlens(lens_k)),
            max(lens_q, default=0), max(lens_k, default=0))
    out, lse = cupyflash.flash_attn_varlen_fwd(d_q, d_k, d_v, *args, causal=causal)
    assert isinstance(out, cp.ndarray) and out.dtype == cp.float16 and out.shape == q.shape
    assert lse.dtype == cp.float32 and lse.shape == (q.shape[1], q.shape[0])
    dq, dk, dv = cupyflash.flash_attn_varlen_bwd(d_dout, d_q, d_k, d_v, out, lse, *args,
                                                 causal=causal, deterministic=deterministic)
    return {name: x.get() for name, x in
            dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv).items()}


def _check(results, refs):
    for name, got in results.items():
        ref, naive = refs[name]
        factor = testing.OUT_FACTOR if name in ("out", "lse") else testing.GRAD_FACTOR
        testing.assert_close_to_reference(name, got, ref, naive, factor, FLOOR)


@pytest.mark.parametrize("lens_q,lens_k,head_dim", [case[1:] for case in LAYOUTS],
                         ids=[case[0] for case in LAYOUTS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [1, 4])
def test_matches_reference_per_sequence(rng, route, lens_q, lens_k, head_dim, causal, gqa):
    q, k, v = packed_inputs(rng, lens_q, lens_k, 2 * gqa, 2, head_dim, np.float16)
    dout = testing.random_normal(rng, q.shape, np.float16)
    results = _run(dout, q, k, v, lens_q, lens_k, causal, deterministic=gqa == 4)
    refs = packed_reference(q, k, v, dout, cu_seqlens(lens_q), cu_seqlens(lens_k), causal)
    _check(results, refs)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_length_sequences(rng, route, causal):
    lens_q, lens_k = (0, 4, 0, 3, 0, 129), (2, 0, 0, 5, 6, 64)
    q, k, v = packed_inputs(rng, lens_q, lens_k, 4, 2, 64, np.float16)
    dout = testing.random_normal(rng, q.shape, np.float16)
    results = _run(dout, q, k, v, lens_q, lens_k, causal)
    for x in results.values():
        assert not np.isnan(x).any()
    rows = slice(0, 4)  # the sequence with 4 queries and no key
    assert (results["out"][rows] == 0).all() and (results["lse"][:, rows] == -np.inf).all()
    assert (results["dq"][rows] == 0).all()
    keys = slice(0, 2)  # the sequence with 2 keys and no query
    assert (results["dk"][keys] == 0).all() and (results["dv"][keys] == 0).all()
    _check(results, packed_reference(q, k, v, dout, cu_seqlens(lens_q), cu_seqlens(lens_k),
                                     causal))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_equal_lengths_match_the_batched_api(rng, route, causal):
    cp = _cp()
    batch, seqlen_q, seqlen_k, nheads, head_dim = 3, 200, 130, 8, 64
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, 2, head_dim,
                                 np.float16, xp=cp)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal)
    args = (cp.asarray(cu_seqlens([seqlen_q] * batch)), cp.asarray(cu_seqlens([seqlen_k] * batch)),
            seqlen_q, seqlen_k)
    p_out, p_lse = cupyflash.flash_attn_varlen_fwd(
        *(x.reshape(-1, *x.shape[2:]) for x in (q, k, v)), *args, causal=causal)
    np.testing.assert_allclose(p_out.get().astype(np.float32),
                               out.reshape(-1, nheads, head_dim).get().astype(np.float32),
                               atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(p_lse.get(), lse.transpose(1, 0, 2).reshape(nheads, -1).get(),
                               atol=1e-4, rtol=1e-4)


def test_no_keys_at_all(route):
    cp = _cp()
    q = cp.ones((7, 4, 64), cp.float16)
    kv = cp.ones((0, 2, 64), cp.float16)
    cu_q, cu_k = cp.asarray(cu_seqlens([3, 4])), cp.asarray(cu_seqlens([0, 0]))
    out, lse = cupyflash.flash_attn_varlen_fwd(q, kv, kv, cu_q, cu_k, 4, 0)
    assert bool((out == 0).all()) and bool((lse == -cp.inf).all())
