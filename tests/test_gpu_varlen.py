"""Variable-length batches on the GPU (cupy float16 / bfloat16) against the float64 reference.

Cases run through the varlen kernels (``_gpu.varlen_fwd`` / ``_gpu.varlen_bwd``:
one launch per kernel for the whole batch, ``cu_seqlens`` read on the device)
and, where marked with the ``route`` fixture, also through the per-sequence
loop over ``_gpu.fwd`` / ``_gpu.bwd`` that ``_varlen`` falls back to without
them.  Tolerance as in the other GPU tests: ``factor * naive same-dtype error
+ 1e-3`` (:mod:`cupyflash.testing`).

Every CuPy allocation made during a test starts as 0xFF bytes, a NaN in
float16, bfloat16 and float32 (the ``poisoned_memory`` fixture): an output
element, or a scratch row of the backward, that the kernels skip or read
before writing shows up as NaN.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from cupyflash import _launch

import cupyflash
from cupyflash import testing
from test_varlen import LAYOUTS, cu_seqlens, packed_inputs, packed_reference  # sibling module

pytestmark = pytest.mark.gpu

FLOOR = 1e-3
_NO_BF16 = pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is None,
                              reason="bfloat16 needs ml_dtypes (pip install ml_dtypes)")
DTYPES = ["float16", pytest.param("bfloat16", marks=_NO_BF16)]


def _cp():
    return pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def poisoned_memory():
    """Fill every CuPy allocation of the test with 0xFF bytes (NaN) before use."""
    with testing.poisoned_allocations(_cp()):
        yield


@pytest.fixture(params=["kernel", "loop"])
def route(request, monkeypatch):
    """Run through the varlen kernels, or hide them to exercise the per-sequence loop."""
    if request.param == "kernel":
        request.getfixturevalue("launches")
    else:
        from cupyflash import _gpu

        monkeypatch.delattr(_gpu, "varlen_fwd", raising=False)
        monkeypatch.delattr(_gpu, "varlen_bwd", raising=False)
    return request.param


def _to_device(x):
    """Host float16 or ml_dtypes.bfloat16 -> cupy storage (bfloat16 as uint16 bits), dtype= kwarg."""
    cp = _cp()
    if x.dtype == np.float16:
        return cp.asarray(x), {}
    return cp.asarray(x.view(np.uint16)), {"dtype": "bfloat16"}


def _to_host(x, like):
    """Device result -> host array of the host inputs' dtype (float32 stays float32)."""
    x = x.get()
    return x.view(like.dtype) if x.dtype == np.uint16 else x


def _run(dout, q, k, v, lens_q, lens_k, causal, deterministic=False, max_extra=0):
    """Host inputs -> host results of the GPU forward and backward.

    ``max_extra`` is added to both max_seqlen (they need only bound the lengths).
    """
    cp = _cp()
    (d_dout, kw), (d_q, _), (d_k, _), (d_v, _) = (_to_device(x) for x in (dout, q, k, v))
    args = (cp.asarray(cu_seqlens(lens_q)), cp.asarray(cu_seqlens(lens_k)),
            max(lens_q, default=0) + max_extra, max(lens_k, default=0) + max_extra)
    out, lse = cupyflash.flash_attn_varlen_fwd(d_q, d_k, d_v, *args, causal=causal, **kw)
    assert isinstance(out, cp.ndarray) and out.dtype == d_q.dtype and out.shape == q.shape
    assert lse.dtype == cp.float32 and lse.shape == (q.shape[1], q.shape[0])
    dq, dk, dv = cupyflash.flash_attn_varlen_bwd(d_dout, d_q, d_k, d_v, out, lse, *args,
                                                 causal=causal, deterministic=deterministic, **kw)
    return {name: _to_host(x, q) for name, x in
            dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv).items()}


def _check(results, refs):
    for name, got in results.items():
        ref, naive = refs[name]
        factor = testing.OUT_FACTOR if name in ("out", "lse") else testing.GRAD_FACTOR
        testing.assert_close_to_reference(name, got, ref, naive, factor, FLOOR)


def _problem(rng, lens_q, lens_k, nheads, nheads_kv, head_dim, dtype):
    q, k, v = packed_inputs(rng, lens_q, lens_k, nheads, nheads_kv, head_dim, dtype)
    return testing.random_normal(rng, q.shape, dtype), q, k, v


def _reference(dout, q, k, v, lens_q, lens_k, causal):
    return packed_reference(q, k, v, dout, cu_seqlens(lens_q), cu_seqlens(lens_k), causal)


# ----------------------------------------------------------------------------
# Against the float64 reference, sequence by sequence
# ----------------------------------------------------------------------------

_LAYOUT_ARGS = {"argnames": "lens_q,lens_k,head_dim", "argvalues": [case[1:] for case in LAYOUTS],
                "ids": [case[0] for case in LAYOUTS]}


@pytest.mark.parametrize(**_LAYOUT_ARGS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [1, 4])
def test_matches_reference_per_sequence(rng, route, lens_q, lens_k, head_dim, causal, gqa):
    """float16 through both routes (deterministic dQ with GQA, atomic dQ without)."""
    problem = _problem(rng, lens_q, lens_k, 2 * gqa, 2, head_dim, np.float16)
    results = _run(*problem, lens_q, lens_k, causal, deterministic=gqa == 4)
    _check(results, _reference(*problem, lens_q, lens_k, causal))


@pytest.mark.parametrize(**_LAYOUT_ARGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_kernels_match_reference(rng, launches, lens_q, lens_k, head_dim, dtype, causal, gqa,
                                 deterministic):
    """Both dtypes and both dQ modes: one launch per kernel, whatever the number of sequences."""
    problem = _problem(rng, lens_q, lens_k, 2 * gqa, 2, head_dim, testing.resolve_dtype(dtype))
    results = _run(*problem, lens_q, lens_k, causal, deterministic=deterministic)
    _check(results, _reference(*problem, lens_q, lens_k, causal))
    # mma.sync, or on cc 9.0 wgmma (the TMA kernel at the head_dims of dispatch.FWD_WS)
    fwd_names = ("flash_fwd_kernel", "flash_fwd_sm90_kernel", "flash_fwd_ws_kernel")
    assert launches[0] in fwd_names and sum(launches.count(n) for n in fwd_names) == 1
    assert "flash_fwd_combine_kernel" not in launches  # packed batches are never split over keys
    bwd = launches[1:]
    assert bwd[0] == "flash_bwd_preprocess_kernel"
    assert bwd[1] in ("flash_bwd_dkdv_kernel", "flash_bwd_dkdv_sm90_kernel", "flash_bwd_ws_kernel")
    if bwd[1] == "flash_bwd_ws_kernel":  # Hopper's default mode (dispatch.BWD_WS): atomic dQ
        assert not deterministic and bwd[2] == "flash_bwd_convert_dq_kernel"
    elif bwd[1] == "flash_bwd_dkdv_sm90_kernel":  # Hopper: at head_dim 64 the dQ kernel in both modes
        from cupyflash import dispatch

        separate = deterministic or dispatch.padded_head_dim(head_dim) in dispatch._BWD_SM90_SEPARATE_DQ
        assert bwd[2] == ("flash_bwd_dq_sm90_kernel" if separate else "flash_bwd_convert_dq_kernel")
    else:
        assert bwd[2] == ("flash_bwd_dq_kernel" if deterministic else "flash_bwd_convert_dq_kernel")
    assert bwd[3:] in ([], ["flash_bwd_convert_dkv_kernel"])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_max_seqlen_above_the_longest_sequence(rng, launches, causal, deterministic):
    """Grids sized for longer sequences than any: the blocks past every sequence write nothing."""
    lens_q, lens_k = (70, 3, 129), (64, 200, 129)
    problem = _problem(rng, lens_q, lens_k, 4, 2, 64, np.float16)
    results = _run(*problem, lens_q, lens_k, causal, deterministic, max_extra=300)
    _check(results, _reference(*problem, lens_q, lens_k, causal))


@pytest.mark.parametrize("num_sms,splits", [(3, 1), (20, 2), (1000, 4)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_gqa_group_splits(rng, launches, monkeypatch, num_sms, splits, deterministic):
    """A GQA group's query heads split over 1, 2 or 4 dK/dV blocks, packed."""
    cp = _cp()
    from cupyflash import _gpu, dispatch

    lens_q, lens_k = (100, 0, 260, 7), (300, 5, 40, 7)
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: num_sms)
    plan = dispatch.select_bwd(batch=4, seqlen_q=260, seqlen_k=300, nheads_q=8, nheads_kv=2,
                               head_dim=64, dtype="float16", causal=True,
                               deterministic=deterministic, vec=True, num_sms=num_sms,
                               cc=_launch.compute_capability(cp.cuda.Device().id), varlen=True,
                               total_q=sum(lens_q), total_k=sum(lens_k))
    assert plan.kv_splits == splits
    problem = _problem(rng, lens_q, lens_k, 8, 2, 64, np.float16)
    results = _run(*problem, lens_q, lens_k, True, deterministic)
    _check(results, _reference(*problem, lens_q, lens_k, True))
    assert ("flash_bwd_convert_dkv_kernel" in launches) == (splits > 1)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_unaligned_views_take_the_scalar_path(rng, launches, deterministic):
    """Packed views starting one element into a row: no 16-byte loads (VEC=false), same results."""
    cp = _cp()
    from cupyflash import _gpu

    lens_q, lens_k, d = (5, 140, 33), (9, 140, 60), 64
    host, views = [], []
    for rows, heads in ((sum(lens_q), 4), (sum(lens_k), 2), (sum(lens_k), 2), (sum(lens_q), 4)):
        big = rng.standard_normal((rows, heads, d + 1), dtype=np.float32).astype(np.float16)
        host.append(big[..., 1:])
        views.append(cp.asarray(big)[..., 1:])
    q, k, v, dout = views
    assert not _gpu.vec_ok((q,), d)
    args = (cp.asarray(cu_seqlens(lens_q)), cp.asarray(cu_seqlens(lens_k)), 140, 140)
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, causal=True)
    grads = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *args, causal=True,
                                            deterministic=deterministic)
    results = dict(zip(("out", "lse", "dq", "dk", "dv"), (x.get() for x in (out, lse, *grads))))
    hq, hk, hv, hdout = host
    _check(results, _reference(hdout, hq, hk, hv, lens_q, lens_k, True))


# ----------------------------------------------------------------------------
# Empty sequences, isolation, and the padded/dense batches
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_length_sequences(rng, route, dtype, causal):
    lens_q, lens_k = (0, 4, 0, 3, 0, 129), (2, 0, 0, 5, 6, 64)
    problem = _problem(rng, lens_q, lens_k, 4, 2, 64, testing.resolve_dtype(dtype))
    results = _run(*problem, lens_q, lens_k, causal)
    for x in results.values():
        assert not np.isnan(x.astype(np.float32)).any()
    rows = slice(0, 4)  # the sequence with 4 queries and no key
    assert (results["out"][rows] == 0).all() and (results["lse"][:, rows] == -np.inf).all()
    assert (results["dq"][rows] == 0).all()
    keys = slice(0, 2)  # the sequence with 2 keys and no query
    assert (results["dk"][keys] == 0).all() and (results["dv"][keys] == 0).all()
    _check(results, _reference(*problem, lens_q, lens_k, causal))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_sequences_do_not_see_each_other(rng, route, causal, deterministic):
    """NaN in one sequence's q, k, v and dout leaves every other sequence's results intact.

    Packed neighbours share tiles of the grid's rows: tails must be masked or
    zero-filled, and dQ atomics must stop at the sequence's last row.
    """
    lens_q, lens_k = (20, 130, 131), (25, 140, 140)
    dout, q, k, v = _problem(rng, lens_q, lens_k, 4, 2, 64, np.float16)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    clean = _run(dout, q, k, v, lens_q, lens_k, causal, deterministic)
    for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k), (dout, cu_q)):
        x[cu[1]:cu[2]] = np.nan
    dirty = _run(dout, q, k, v, lens_q, lens_k, causal, deterministic)
    for name in ("out", "lse", "dq", "dk", "dv"):
        cu = cu_k if name in ("dk", "dv") else cu_q
        rows = np.r_[0:cu[1], cu[2]:cu[3]]
        axis = 1 if name == "lse" else 0
        got, want = np.take(dirty[name], rows, axis), np.take(clean[name], rows, axis)
        assert not np.isnan(got).any(), name
        if name == "dq" and not deterministic:  # fp32 atomics: the summation order varies
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3, err_msg=name)
        else:
            assert np.array_equal(got, want), name


def _agree(name, got, want):
    """Two float16 runs of the same problem whose fp32 sums may differ in order."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    scale = max(1.0, float(np.abs(want[np.isfinite(want)]).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=4e-3, atol=4e-3 * scale, err_msg=name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_equal_lengths_match_the_batched_api(rng, route, causal):
    cp = _cp()
    batch, seqlen_q, seqlen_k, nheads, head_dim = 3, 200, 130, 8, 64
    q, k, v, dout = (testing.random_normal(rng, (batch, s, h, head_dim), np.float16, xp=cp)
                     for s, h in ((seqlen_q, nheads), (seqlen_k, 2), (seqlen_k, 2),
                                  (seqlen_q, nheads)))
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal)
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True)

    def pack(x):
        return x.reshape(-1, *x.shape[2:])

    args = (cp.asarray(cu_seqlens([seqlen_q] * batch)), cp.asarray(cu_seqlens([seqlen_k] * batch)),
            seqlen_q, seqlen_k)
    p_out, p_lse = cupyflash.flash_attn_varlen_fwd(pack(q), pack(k), pack(v), *args, causal=causal)
    p_grads = cupyflash.flash_attn_varlen_bwd(pack(dout), pack(q), pack(k), pack(v), p_out, p_lse,
                                              *args, causal=causal, deterministic=True)
    _agree("out", p_out.get(), pack(out).get())
    np.testing.assert_allclose(p_lse.get(), lse.transpose(1, 0, 2).reshape(nheads, -1).get(),
                               atol=1e-4, rtol=1e-4)
    for name, got, want in zip(("dq", "dk", "dv"), p_grads, grads):
        _agree(name, got.get(), pack(want).get())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padded_batch_and_packed_batch_agree(rng, route, causal):
    """A NaN-padded batch, run sequence by sequence on its real rows, equals the packed run."""
    cp = _cp()
    lens_q, lens_k = np.array([12, 140, 1, 57]), np.array([30, 140, 9, 257])
    batch, nheads, nheads_kv, head_dim = len(lens_q), 4, 1, 64
    shape_q = (batch, lens_q.max(), nheads, head_dim)
    shape_k = (batch, lens_k.max(), nheads_kv, head_dim)
    q, k, v, dout = (np.full(s, np.nan, np.float16) for s in (shape_q, shape_k, shape_k, shape_q))
    for b in range(batch):
        for x, n in ((q, lens_q[b]), (k, lens_k[b]), (v, lens_k[b]), (dout, lens_q[b])):
            x[b, :n] = testing.random_normal(rng, x[b, :n].shape, np.float16)
    real_q = np.arange(shape_q[1])[None, :] < lens_q[:, None]
    real_k = np.arange(shape_k[1])[None, :] < lens_k[:, None]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    args = (cp.asarray(cu_q), cp.asarray(cu_k), int(lens_q.max()), int(lens_k.max()))
    packed = [cp.asarray(x) for x in (q[real_q], k[real_k], v[real_k], dout[real_q])]
    out, lse = cupyflash.flash_attn_varlen_fwd(*packed[:3], *args, causal=causal)
    dq, dk, dv = cupyflash.flash_attn_varlen_bwd(packed[3], *packed[:3], out, lse, *args,
                                                 causal=causal, deterministic=True)
    got = dict(out=out.get(), lse=lse.get(), dq=dq.get(), dk=dk.get(), dv=dv.get())
    for name, x in got.items():
        assert not np.isnan(x).any(), name
    for b in range(batch):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [cp.asarray(x[b:b + 1, :n]) for x, n in
               ((q, lens_q[b]), (k, lens_k[b]), (v, lens_k[b]), (dout, lens_q[b]))]
        want_out, want_lse = cupyflash.flash_attn_fwd(*one[:3], causal=causal)
        want = cupyflash.flash_attn_bwd(one[3], *one[:3], want_out, want_lse, causal=causal,
                                        deterministic=True)
        _agree("out", got["out"][rows], want_out.get()[0])
        np.testing.assert_allclose(got["lse"][:, rows], want_lse.get()[0], rtol=1e-4, atol=1e-4)
        for name, w, where in (("dq", want[0], rows), ("dk", want[1], keys), ("dv", want[2], keys)):
            _agree(name, got[name][where], w.get()[0])


def test_no_keys_at_all(route):
    cp = _cp()
    q = cp.ones((7, 4, 64), cp.float16)
    kv = cp.ones((0, 2, 64), cp.float16)
    cu_q, cu_k = cp.asarray(cu_seqlens([3, 4])), cp.asarray(cu_seqlens([0, 0]))
    out, lse = cupyflash.flash_attn_varlen_fwd(q, kv, kv, cu_q, cu_k, 4, 0)
    assert bool((out == 0).all()) and bool((lse == -cp.inf).all())


def test_softmax_scale_is_used(rng, launches):
    cp = _cp()
    lens = (33, 130)
    dout, q, k, v = _problem(rng, lens, lens, 4, 1, 32, np.float16)
    args = (cp.asarray(cu_seqlens(lens)), cp.asarray(cu_seqlens(lens)), 130, 130)
    d = [cp.asarray(x) for x in (q, k, v, dout)]
    out, lse = cupyflash.flash_attn_varlen_fwd(*d[:3], *args, softmax_scale=0.3, causal=True)
    grads = cupyflash.flash_attn_varlen_bwd(d[3], *d[:3], out, lse, *args, softmax_scale=0.3,
                                            causal=True)
    results = dict(zip(("out", "lse", "dq", "dk", "dv"), (x.get() for x in (out, lse, *grads))))
    refs = packed_reference(q, k, v, dout, cu_seqlens(lens), cu_seqlens(lens), True,
                            softmax_scale=0.3)
    _check(results, refs)
    assert sum(launches.count(n) for n in ("flash_fwd_kernel", "flash_fwd_sm90_kernel", "flash_fwd_ws_kernel")) == 1
