"""Variable-length (packed) batches on the CPU path, validation, and GPU routing.

Results are checked against the float64 reference applied sequence by sequence,
with the naive same-dtype rule of :mod:`cupyflash.testing` (factor 2 for out
and lse, 3 for the gradients).  GPU dispatch is tested with a fake ``cupy`` and
a fake ``cupyflash._gpu``, as in ``test_api_checks.py``.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types

import numpy as np
import pytest

import cupyflash
from cupyflash import _philox, cpu, reference, testing
from fakes import FakeCupyArray

_NO_BF16 = pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is None,
                              reason="bfloat16 needs ml_dtypes (pip install ml_dtypes)")

# (id, query lengths, key lengths, head_dim).  Lengths cover 0, 1, tails, and
# sequences longer than one 128-row tile on both sides.
LAYOUTS = [
    ("mixed", (5, 130, 1, 0, 64), (7, 130, 1, 3, 200), 40),
    ("q-ne-k", (17, 200, 3, 9), (40, 150, 0, 9), 64),
    ("long", (300,), (260,), 16),
]
DTYPES = ("float16", "bfloat16", "float32")


def cu_seqlens(lengths):
    """int32 prefix sums ``[0, l0, l0 + l1, ...]``."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_inputs(rng, lens_q, lens_k, nheads, nheads_kv, head_dim, dtype):
    q = testing.random_normal(rng, (sum(lens_q), nheads, head_dim), dtype)
    k = testing.random_normal(rng, (sum(lens_k), nheads_kv, head_dim), dtype)
    v = testing.random_normal(rng, (sum(lens_k), nheads_kv, head_dim), dtype)
    return q, k, v


def sequence_variants(variants, b, len_q, len_k, nheads):
    """The reference's variant keywords for sequence ``b`` run as a batch of one:
    ALiBi slopes of shape (batch, nheads_q) sliced to row ``b``; ``dropout_p`` with
    ``rng_state`` turned into the Philox keep mask at batch index ``b`` (rows and
    columns counted within the sequence), as the varlen contract draws it."""
    seq = dict(variants)
    slopes = seq.get("alibi_slopes")
    if slopes is not None and np.ndim(slopes) == 2:
        seq["alibi_slopes"] = slopes[b]
    rng_state = seq.pop("rng_state", None)
    if seq.get("dropout_p"):
        seq["dropout_mask"] = _philox.keep_mask(
            *rng_state, seq["dropout_p"], b, np.arange(nheads)[:, None, None],
            np.arange(len_q)[None, :, None], np.arange(len_k)[None, None, :], nheads)[None]
    return seq


def packed_reference(q, k, v, dout, cu_q, cu_k, causal, softmax_scale=None, out=None, **variants):
    """Float64 reference and naive results, per sequence, packed like the outputs.

    ``out``: the packed output the gradients were computed from; with sinks, the
    reference dsinks is then that of the returned ``out`` (:func:`cupyflash.testing.given_out`).

    ``variants`` are the public functions' variant keywords (``window_size``,
    ``softcap``, ``alibi_slopes``, ``sinks``, ``dropout_p`` with ``rng_state``),
    applied per sequence by :func:`sequence_variants`.

    Returns ``{name: (ref64, naive)}`` for out, lse, dq, dk, dv (and dsinks, summed
    over the sequences, when ``sinks`` is given).
    """
    naive_dtype = testing.naive_dtype(q.dtype)
    nheads = q.shape[1]
    sinks = variants.get("sinks")
    res = {
        "out": np.zeros((2,) + q.shape), "lse": np.full((2, nheads, q.shape[0]), -np.inf),
        "dq": np.zeros((2,) + q.shape), "dk": np.zeros((2,) + k.shape),
        "dv": np.zeros((2,) + v.shape),
    }
    if sinks is not None:  # a row that sees no key has lse sinks[h]
        res["lse"][...] = np.asarray(sinks, np.float64)[None, :, None]
        res["dsinks"] = np.zeros((2, nheads))
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])):
        if q1 == q0 or k1 == k0:
            continue  # out 0 and lse -inf (or the sink) for the queries; zero gradients
        seq_kw = sequence_variants(variants, b, q1 - q0, k1 - k0, nheads)
        args = (q[None, q0:q1], k[None, k0:k1], v[None, k0:k1])
        ref_fwd = reference.attention_fwd(*args, softmax_scale, causal, **seq_kw)
        naive_fwd = reference.naive_attention(*args, softmax_scale, causal, naive_dtype, **seq_kw)
        ref_bwd = reference.attention_bwd(dout[None, q0:q1], *args, softmax_scale, causal, **seq_kw)
        if out is not None and sinks is not None:
            ref_bwd = testing.given_out(ref_bwd, out[None, q0:q1], dout[None, q0:q1], *args,
                                        softmax_scale=softmax_scale, causal=causal, **seq_kw)
        naive_bwd = reference.naive_attention_bwd(dout[None, q0:q1], *args, softmax_scale,
                                                  causal, naive_dtype, **seq_kw)
        seq = {"out": (ref_fwd[0], naive_fwd[0]), "lse": (ref_fwd[1], naive_fwd[1]),
               "dq": (ref_bwd[0], naive_bwd[0]), "dk": (ref_bwd[1], naive_bwd[1]),
               "dv": (ref_bwd[2], naive_bwd[2])}
        where = {"out": np.s_[:, q0:q1], "lse": np.s_[:, :, q0:q1], "dq": np.s_[:, q0:q1],
                 "dk": np.s_[:, k0:k1], "dv": np.s_[:, k0:k1]}
        for name, (ref, naive) in seq.items():
            res[name][where[name]] = ref[0], naive[0]
        if sinks is not None:
            res["dsinks"] += np.stack([ref_bwd[3], naive_bwd[3].astype(np.float64)])
    return {name: (pair[0], pair[1]) for name, pair in res.items()}


def _floor(ref64):
    finite = ref64[np.isfinite(ref64)]
    return testing.REL_FLOOR * max(1.0, float(np.abs(finite).max()) if finite.size else 1.0)


def assert_matches_packed_reference(results, refs):
    for name, got in results.items():
        ref, naive = refs[name]
        factor = testing.OUT_FACTOR if name in ("out", "lse") else testing.GRAD_FACTOR
        testing.assert_close_to_reference(name, got, ref, naive, factor, _floor(ref))


def _grid():
    for i_dtype, dtype in enumerate(DTYPES):
        for i_layout, (name, lens_q, lens_k, head_dim) in enumerate(LAYOUTS):
            for causal in (False, True):
                for gqa in (1, 2):
                    marks = (_NO_BF16,) if dtype == "bfloat16" else ()
                    yield pytest.param(dtype, lens_q, lens_k, head_dim, causal, gqa, marks=marks,
                                       id=f"{dtype}-{name}-{'causal' if causal else 'full'}"
                                          f"-gqa{gqa}")


@pytest.mark.parametrize("dtype,lens_q,lens_k,head_dim,causal,gqa", list(_grid()))
def test_matches_reference_per_sequence(rng, dtype, lens_q, lens_k, head_dim, causal, gqa):
    nheads_kv = 2
    q, k, v = packed_inputs(rng, lens_q, lens_k, gqa * nheads_kv, nheads_kv, head_dim, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))

    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and out.flags.c_contiguous
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == np.float32
    dq, dk, dv = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *args, causal=causal)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype
    assert np.array_equal(cupyflash.flash_attn_varlen(q, k, v, *args, causal=causal), out)

    refs = packed_reference(q, k, v, dout, cu_q, cu_k, causal)
    assert_matches_packed_reference(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), refs)


def test_softmax_scale_is_used(rng):
    lens = (33, 7)
    q, k, v = packed_inputs(rng, lens, lens, 4, 1, 32, np.float32)
    dout = testing.random_normal(rng, q.shape, np.float32)
    cu = cu_seqlens(lens)
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, cu, cu, 33, 33, softmax_scale=0.3,
                                               causal=True)
    grads = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu, cu, 33, 33,
                                            softmax_scale=0.3, causal=True)
    refs = packed_reference(q, k, v, dout, cu, cu, True, softmax_scale=0.3)
    assert_matches_packed_reference(dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv"), grads))),
                                    refs)


# ----------------------------------------------------------------------------
# Packed against padded batches
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_equal_lengths_match_the_batched_api(rng, causal):
    """With equal lengths the packed batch is the padded batch reshaped."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = 3, 150, 90, 4, 2, 32
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim,
                                 np.float32)
    dout = testing.random_normal(rng, q.shape, np.float32)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal)
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal)

    def pack(x):
        return x.reshape(-1, *x.shape[2:])

    cu_q, cu_k = cu_seqlens([seqlen_q] * batch), cu_seqlens([seqlen_k] * batch)
    args = (cu_q, cu_k, seqlen_q, seqlen_k)
    p_out, p_lse = cupyflash.flash_attn_varlen_fwd(pack(q), pack(k), pack(v), *args,
                                                   causal=causal)
    p_grads = cupyflash.flash_attn_varlen_bwd(pack(dout), pack(q), pack(k), pack(v), p_out,
                                              p_lse, *args, causal=causal)
    np.testing.assert_allclose(p_out, pack(out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p_lse, lse.transpose(1, 0, 2).reshape(nheads, -1),
                               rtol=1e-6, atol=1e-6)
    for got, want in zip(p_grads, grads):
        np.testing.assert_allclose(got, pack(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padded_batch_and_packed_batch_agree(rng, causal):
    """A padded batch, run sequence by sequence on its real rows, equals the packed run.

    The padding holds NaN: packing drops it, and no NaN may reach the results.
    """
    lens_q, lens_k = np.array([12, 140, 1, 57]), np.array([30, 140, 9, 57])
    batch, nheads, nheads_kv, head_dim = len(lens_q), 4, 1, 24
    shape_q = (batch, lens_q.max(), nheads, head_dim)
    shape_k = (batch, lens_k.max(), nheads_kv, head_dim)
    q, k, v, dout = (np.full(s, np.nan, np.float32) for s in (shape_q, shape_k, shape_k, shape_q))
    for b in range(batch):
        for x, n in ((q, lens_q[b]), (k, lens_k[b]), (v, lens_k[b]), (dout, lens_q[b])):
            x[b, :n] = rng.standard_normal(x[b, :n].shape, dtype=np.float32)
    real_q = np.arange(shape_q[1])[None, :] < lens_q[:, None]
    real_k = np.arange(shape_k[1])[None, :] < lens_k[:, None]
    args = (cu_seqlens(lens_q), cu_seqlens(lens_k), int(lens_q.max()), int(lens_k.max()))
    out, lse = cupyflash.flash_attn_varlen_fwd(q[real_q], k[real_k], v[real_k], *args,
                                               causal=causal)
    dq, dk, dv = cupyflash.flash_attn_varlen_bwd(dout[real_q], q[real_q], k[real_k], v[real_k],
                                                 out, lse, *args, causal=causal)
    for x in (out, lse, dq, dk, dv):
        assert not np.isnan(x).any()
    cq, ck = args[0], args[1]
    for b in range(batch):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        one = (q[b:b + 1, :lens_q[b]], k[b:b + 1, :lens_k[b]], v[b:b + 1, :lens_k[b]])
        want_out, want_lse = cupyflash.flash_attn_fwd(*one, causal=causal)
        want = cupyflash.flash_attn_bwd(dout[b:b + 1, :lens_q[b]], *one, want_out, want_lse,
                                        causal=causal)
        np.testing.assert_allclose(out[rows], want_out[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[:, rows], want_lse[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dq[rows], want[0][0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dk[keys], want[1][0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dv[keys], want[2][0], rtol=1e-5, atol=1e-5)


def test_sequences_do_not_see_each_other(rng):
    """NaN in one sequence's q, k, v and dout leaves every other sequence's results intact."""
    lens_q, lens_k = (20, 9, 131), (25, 9, 140)
    q, k, v = packed_inputs(rng, lens_q, lens_k, 2, 2, 16, np.float32)
    dout = testing.random_normal(rng, q.shape, np.float32)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    args = (cu_q, cu_k, 131, 140)
    clean = _fwd_bwd(dout, q, k, v, args)
    for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k), (dout, cu_q)):
        x[cu[1]:cu[2]] = np.nan
    dirty = _fwd_bwd(dout, q, k, v, args)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), dirty, clean):
        cu = cu_k if name in ("dk", "dv") else cu_q
        rows = np.r_[0:cu[1], cu[2]:cu[3]]
        axis = 1 if name == "lse" else 0
        assert np.array_equal(np.take(got, rows, axis), np.take(want, rows, axis)), name


def _fwd_bwd(dout, q, k, v, args, causal=False):
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, causal=causal)
    return (out, lse) + cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *args,
                                                        causal=causal)


# ----------------------------------------------------------------------------
# Zero-length sequences and empty batches
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("lens_q,lens_k", [
    ((0, 4, 0, 3, 0), (2, 0, 0, 5, 6)),   # empty q, empty k, both empty, real, empty q
    ((3, 3), (0, 0)),                     # no key at all
    ((0, 0), (4, 5)),                     # no query at all
    ((), ()),                             # batch 0
], ids=["mixed", "no-keys", "no-queries", "batch0"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_length_sequences(rng, monkeypatch, lens_q, lens_k, causal):
    calls = []
    real_fwd, real_bwd = cpu.fwd, cpu.bwd

    def counting(fn, name):
        def wrapper(*args):
            calls.append((name, args[1].shape[1], args[2].shape[1]))
            return fn(*args)
        return wrapper

    monkeypatch.setattr(cpu, "fwd", counting(real_fwd, "fwd"))
    monkeypatch.setattr(cpu, "bwd", counting(real_bwd, "bwd"))
    q, k, v = packed_inputs(rng, lens_q, lens_k, 2, 1, 8, np.float16)
    dout = testing.random_normal(rng, q.shape, np.float16)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    args = (cu_q, cu_k, max(lens_q, default=0), max(lens_k, default=0))
    out, lse, dq, dk, dv = _fwd_bwd(dout, q, k, v, args, causal)

    assert all(n_q > 0 and n_k > 0 for _, n_q, n_k in calls)  # (1, len, H, D) views, never empty
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if n_k == 0:
            assert (out[rows] == 0).all() and (lse[:, rows] == -np.inf).all()
            assert (dq[rows] == 0).all()
        if n_q == 0:
            assert (dk[keys] == 0).all() and (dv[keys] == 0).all()
    for x in (out, lse, dq, dk, dv):
        assert not np.isnan(x).any()
    refs = packed_reference(q, k, v, dout, cu_q, cu_k, causal)
    assert_matches_packed_reference(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), refs)


def test_nheads_zero_gives_empty_results():
    q = np.zeros((5, 0, 8), np.float32)
    cu = cu_seqlens([2, 3])
    out, lse = cupyflash.flash_attn_varlen_fwd(q, q, q, cu, cu, 3, 3)
    assert out.shape == (5, 0, 8) and lse.shape == (0, 5)


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------

FUNCTIONS = ("flash_attn_varlen_fwd", "flash_attn_varlen", "flash_attn_varlen_bwd")


def _valid_args(dtype=np.float32):
    """q (12, 4, 8) in sequences of 5, 0, 7; k/v (15, 2, 8) in 7, 3, 5."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((12, 4, 8)).astype(dtype)
    k = rng.standard_normal((15, 2, 8)).astype(dtype)
    v = rng.standard_normal((15, 2, 8)).astype(dtype)
    return dict(q=q, k=k, v=v, dout=q.copy(), out=q.copy(),
                lse=np.zeros((4, 12), np.float32),
                cu_seqlens_q=cu_seqlens([5, 0, 7]), cu_seqlens_k=cu_seqlens([7, 3, 5]),
                max_seqlen_q=7, max_seqlen_k=7)


def _call(fn_name, a, **kwargs):
    fn = getattr(cupyflash, fn_name)
    tail = (a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"])
    if fn_name == "flash_attn_varlen_bwd":
        return fn(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], *tail, **kwargs)
    return fn(a["q"], a["k"], a["v"], *tail, **kwargs)


def _set(**changes):
    def mutate(args):
        for key, make in changes.items():
            args[key] = make(args)
        return args
    return mutate


def _strided(x):
    wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def _i32(values):
    return np.array(values, dtype=np.int32)


# (id, exception, argument named in the message, text in the message, mutation, kwargs)
CASES = [
    ("q-list", TypeError, "q", "must be a numpy.ndarray or cupy.ndarray; got list.",
     _set(q=lambda a: a["q"].tolist()), {}),
    ("q-rank4", ValueError, "q", "must have 3 dimensions (total_q, nheads, head_dim); got 4 "
     "with shape (1, 12, 4, 8).", _set(q=lambda a: a["q"][None]), {}),
    ("k-rank2", ValueError, "k", "must have 3 dimensions (total_k, nheads_kv, head_dim); got 2",
     _set(k=lambda a: a["k"][0]), {}),
    ("v-rank4", ValueError, "v", "3 dimensions", _set(v=lambda a: a["v"][None]), {}),
    ("q-int32", TypeError, "q", "must have dtype float16, bfloat16 (ml_dtypes), float32",
     _set(q=lambda a: a["q"].astype(np.int32)), {}),
    ("k-dtype", TypeError, "k", "must have the same dtype as q (float32); got float64.",
     _set(k=lambda a: a["k"].astype(np.float64)), {}),
    ("v-dtype", TypeError, "v", "same dtype as q (float32); got float16.",
     _set(v=lambda a: a["v"].astype(np.float16)), {}),
    ("k-head_dim", ValueError, "k", "must have the same head_dim as q (8); got 4.",
     _set(k=lambda a: a["k"][..., :4]), {}),
    ("v-total", ValueError, "v", "must have the same total_k as k (15); got 14.",
     _set(v=lambda a: a["v"][:14]), {}),
    ("v-nheads", ValueError, "v", "must have the same nheads as k (2); got 1.",
     _set(v=lambda a: a["v"][:, :1]), {}),
    ("gqa", ValueError, "k", "number of heads that divides q's (4); got 3.",
     _set(k=lambda a: np.zeros((15, 3, 8), np.float32),
          v=lambda a: np.zeros((15, 3, 8), np.float32)), {}),
    ("head_dim-257", ValueError, "q", "head_dim between 1 and 256; got 257.",
     _set(q=lambda a: np.zeros((12, 4, 257), np.float32),
          k=lambda a: np.zeros((15, 2, 257), np.float32),
          v=lambda a: np.zeros((15, 2, 257), np.float32),
          dout=lambda a: np.zeros((12, 4, 257), np.float32),
          out=lambda a: np.zeros((12, 4, 257), np.float32)), {}),
    ("q-last-stride", ValueError, "q", "unit stride in its last dimension (head_dim)",
     _set(q=lambda a: _strided(a["q"])), {}),
    ("cu_q-list", TypeError, "cu_seqlens_q", "must be a numpy.ndarray or cupy.ndarray; got list.",
     _set(cu_seqlens_q=lambda a: [0, 5, 5, 12]), {}),
    ("cu_q-int64", TypeError, "cu_seqlens_q", "must have dtype int32; got int64.",
     _set(cu_seqlens_q=lambda a: a["cu_seqlens_q"].astype(np.int64)), {}),
    ("cu_k-float32", TypeError, "cu_seqlens_k", "must have dtype int32; got float32.",
     _set(cu_seqlens_k=lambda a: a["cu_seqlens_k"].astype(np.float32)), {}),
    ("cu_q-uint32", TypeError, "cu_seqlens_q", "int32; got uint32.",
     _set(cu_seqlens_q=lambda a: a["cu_seqlens_q"].astype(np.uint32)), {}),
    ("cu_q-2d", ValueError, "cu_seqlens_q", "must be 1-D (batch + 1,); got shape (1, 4).",
     _set(cu_seqlens_q=lambda a: a["cu_seqlens_q"][None]), {}),
    ("cu_k-0d", ValueError, "cu_seqlens_k", "must be 1-D (batch + 1,); got shape ().",
     _set(cu_seqlens_k=lambda a: _i32(0)), {}),
    ("cu_q-empty", ValueError, "cu_seqlens_q", "must have batch + 1 >= 1 elements; got 0.",
     _set(cu_seqlens_q=lambda a: _i32([])), {}),
    ("cu_q-strided", ValueError, "cu_seqlens_q", "must be contiguous; got a stride of 2 elements.",
     _set(cu_seqlens_q=lambda a: _i32([0, 9, 5, 9, 5, 9, 12])[::2]), {}),
    ("cu_q-start", ValueError, "cu_seqlens_q", "must start at 0; got 1.",
     _set(cu_seqlens_q=lambda a: _i32([1, 5, 5, 12])), {}),
    ("cu_k-start", ValueError, "cu_seqlens_k", "must start at 0; got -2.",
     _set(cu_seqlens_k=lambda a: _i32([-2, 7, 10, 15])), {}),
    ("cu_q-decreasing", ValueError, "cu_seqlens_q",
     "must be non-decreasing; got 4 after 5 at index 2.",
     _set(cu_seqlens_q=lambda a: _i32([0, 5, 4, 12])), {}),
    ("cu_k-decreasing", ValueError, "cu_seqlens_k",
     "must be non-decreasing; got 0 after 7 at index 2.",
     _set(cu_seqlens_k=lambda a: _i32([0, 7, 0, 15])), {}),
    ("cu_q-last", ValueError, "cu_seqlens_q", "must end at total_q = q.shape[0] (12); got 11.",
     _set(cu_seqlens_q=lambda a: _i32([0, 5, 5, 11])), {}),
    ("cu_k-last", ValueError, "cu_seqlens_k", "must end at total_k = k.shape[0] (15); got 16.",
     _set(cu_seqlens_k=lambda a: _i32([0, 7, 10, 16])), {}),
    ("cu-lengths", ValueError, "cu_seqlens_k",
     "must have the same length as cu_seqlens_q (4 = batch + 1); got 3.",
     _set(cu_seqlens_k=lambda a: _i32([0, 7, 15])), {}),
    ("max_q-small", ValueError, "max_seqlen_q",
     "must be at least the longest query sequence (7, sequence 2); got 6.",
     _set(max_seqlen_q=lambda a: 6), {}),
    ("max_k-small", ValueError, "max_seqlen_k",
     "must be at least the longest key sequence (7, sequence 0); got 5.",
     _set(max_seqlen_k=lambda a: 5), {}),
    ("max_q-negative", ValueError, "max_seqlen_q", "must be >= 0; got -1.",
     _set(max_seqlen_q=lambda a: -1), {}),
    # found by QA: accepted, the GPU path then died packing it into an int32 param (OverflowError)
    ("max_q-int32", ValueError, "max_seqlen_q",
     "must be at most 2**31 - 1 (the kernels index sequences in int32); got 2147483648.",
     _set(max_seqlen_q=lambda a: 2**31), {}),
    ("max_k-huge", ValueError, "max_seqlen_k", "must be at most 2**31 - 1", _set(max_seqlen_k=lambda a: 10**12), {}),
    ("max_q-float", TypeError, "max_seqlen_q", "must be an int; got float.",
     _set(max_seqlen_q=lambda a: 7.0), {}),
    ("max_k-bool", TypeError, "max_seqlen_k", "must be an int; got bool.",
     _set(max_seqlen_k=lambda a: True), {}),
    ("max_k-none", TypeError, "max_seqlen_k", "must be an int; got NoneType.",
     _set(max_seqlen_k=lambda a: None), {}),
    ("scale-zero", ValueError, "softmax_scale", "finite and > 0; got 0.0.", None,
     dict(softmax_scale=0)),
    ("causal-int", TypeError, "causal", "must be a bool; got int.", None, dict(causal=1)),
]

BWD_CASES = [
    ("dout-shape", ValueError, "dout", "must have the same shape as q (12, 4, 8); got (11, 4, 8).",
     _set(dout=lambda a: a["dout"][:11]), {}),
    ("dout-rank", ValueError, "dout", "must have 3 dimensions (total_q, nheads, head_dim)",
     _set(dout=lambda a: a["dout"][None]), {}),
    ("dout-dtype", TypeError, "dout", "same dtype as q (float32); got float64.",
     _set(dout=lambda a: a["dout"].astype(np.float64)), {}),
    ("out-shape", ValueError, "out", "same shape as q", _set(out=lambda a: a["out"][:, :2]), {}),
    ("out-last-stride", ValueError, "out", "unit stride", _set(out=lambda a: _strided(a["out"])),
     {}),
    ("lse-shape", ValueError, "lse",
     "must have shape (nheads_q, total_q) = (4, 12); got (12, 4).",
     _set(lse=lambda a: np.zeros((12, 4), np.float32)), {}),
    ("lse-batched", ValueError, "lse", "got (1, 4, 12).", _set(lse=lambda a: a["lse"][None]), {}),
    ("lse-dtype", TypeError, "lse", "must have dtype float32; got float64.",
     _set(lse=lambda a: a["lse"].astype(np.float64)), {}),
    ("lse-last-stride", ValueError, "lse", "unit stride in its last dimension (total_q)",
     _set(lse=lambda a: _strided(a["lse"])), {}),
    ("deterministic-int", TypeError, "deterministic", "must be a bool; got int.", None,
     dict(deterministic=0)),
]


def _cases():
    for fn_name in FUNCTIONS:
        for case in CASES:
            yield pytest.param(fn_name, *case[1:], id=f"{fn_name}-{case[0]}")
    for case in BWD_CASES:
        yield pytest.param("flash_attn_varlen_bwd", *case[1:], id=f"bwd-{case[0]}")


def _must_not_run(*args, **kwargs):
    raise AssertionError("a kernel ran")


@pytest.mark.parametrize("fn_name,exc_type,arg,text,mutate,kwargs", list(_cases()))
def test_bad_input(monkeypatch, fn_name, exc_type, arg, text, mutate, kwargs):
    monkeypatch.setattr(cpu, "fwd", _must_not_run)
    monkeypatch.setattr(cpu, "bwd", _must_not_run)
    args = _valid_args()
    if mutate is not None:
        args = mutate(args)
    with pytest.raises(exc_type) as info:
        _call(fn_name, args, **kwargs)
    message = str(info.value)
    assert message.startswith(f"cupyflash.{fn_name}: {arg} must "), message
    assert text in message, message
    assert message.endswith(".")


def test_valid_arguments_pass():
    a = _valid_args()
    a["max_seqlen_q"], a["max_seqlen_k"] = np.int64(300), np.int32(7)
    for fn_name in FUNCTIONS:
        _call(fn_name, a, softmax_scale=np.float32(0.5), causal=np.bool_(True))
    _call("flash_attn_varlen_bwd", a, deterministic=True)


# ----------------------------------------------------------------------------
# GPU routing with a fake cupy and a fake _gpu
# ----------------------------------------------------------------------------




def _host(x):
    return x.host if isinstance(x, FakeCupyArray) else x


@pytest.fixture
def fake_cupy(monkeypatch):
    module = types.ModuleType("cupy")
    module.ndarray = FakeCupyArray
    module.zeros = lambda shape, dtype: FakeCupyArray(np.zeros(shape, dtype))
    module.full = lambda shape, value, dtype: FakeCupyArray(np.full(shape, value, dtype))
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def _install_gpu(monkeypatch, *, varlen):
    """A fake ``cupyflash._gpu`` that records calls; ``fwd``/``bwd`` compute on the host."""
    calls = []
    fake = types.ModuleType("cupyflash._gpu")
    real_fwd, real_bwd = cpu.fwd, cpu.bwd

    def fwd(q, k, v, **kwargs):
        calls.append(("fwd", q.shape, k.shape, kwargs))
        return tuple(FakeCupyArray(x) for x in real_fwd(q.host, k.host, v.host,
                                                         kwargs["softmax_scale"],
                                                         kwargs["causal"]))

    def bwd(*arrays, **kwargs):
        calls.append(("bwd", arrays[1].shape, arrays[2].shape, kwargs))
        return tuple(FakeCupyArray(x) for x in real_bwd(*(_host(a) for a in arrays),
                                                         kwargs["softmax_scale"],
                                                         kwargs["causal"]))

    fake.fwd, fake.bwd = fwd, bwd
    if varlen:
        def varlen_fwd(*args, **kwargs):
            calls.append(("varlen_fwd", args, kwargs))
            return "out", "lse"

        def varlen_bwd(*args, **kwargs):
            calls.append(("varlen_bwd", args, kwargs))
            return "dq", "dk", "dv"

        fake.varlen_fwd, fake.varlen_bwd = varlen_fwd, varlen_bwd
    monkeypatch.setitem(sys.modules, "cupyflash._gpu", fake)
    monkeypatch.setattr(cupyflash, "_gpu", fake, raising=False)
    monkeypatch.setattr(cpu, "fwd", _must_not_run)
    monkeypatch.setattr(cpu, "bwd", _must_not_run)
    return calls


def _gpu_args(dtype=np.float16, device_id=0):
    a = _valid_args(dtype)
    return {name: (FakeCupyArray(x, device_id) if isinstance(x, np.ndarray) else x)
            for name, x in a.items()}


def test_cupy_arrays_go_to_gpu_varlen_kernels(fake_cupy, monkeypatch):
    calls = _install_gpu(monkeypatch, varlen=True)
    a = _gpu_args()
    a["max_seqlen_q"] = np.int64(9)
    tail = (a["cu_seqlens_q"], a["cu_seqlens_k"])
    assert _call("flash_attn_varlen_fwd", a, causal=np.bool_(True)) == ("out", "lse")
    assert _call("flash_attn_varlen", a, softmax_scale=0.25) == "out"
    assert _call("flash_attn_varlen_bwd", a, softmax_scale=2,
                 deterministic=np.bool_(True)) == ("dq", "dk", "dv")
    (n1, args1, kw1), (n2, _, kw2), (n3, args3, kw3) = calls
    assert (n1, n2, n3) == ("varlen_fwd", "varlen_fwd", "varlen_bwd")
    assert args1 == (a["q"], a["k"], a["v"], *tail, 9, 7)
    assert type(args1[5]) is int and type(args1[6]) is int
    assert kw1 == dict(softmax_scale=1 / math.sqrt(8), causal=True)
    assert type(kw1["causal"]) is bool and type(kw1["softmax_scale"]) is float
    assert kw2 == dict(softmax_scale=0.25, causal=False)
    assert args3 == (a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], *tail, 9, 7)
    assert kw3 == dict(softmax_scale=2.0, causal=False, deterministic=True)
    assert type(kw3["deterministic"]) is bool


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_without_varlen_kernels_loops_over_sequences(fake_cupy, monkeypatch, causal):
    """The fallback calls _gpu.fwd/bwd once per non-empty sequence and packs the results."""
    a = _gpu_args(np.float16)
    host = {name: _host(x) for name, x in a.items()}
    want_out, want_lse = cupyflash.flash_attn_varlen_fwd(
        host["q"], host["k"], host["v"], host["cu_seqlens_q"], host["cu_seqlens_k"], 7, 7,
        causal=causal)
    want_grads = cupyflash.flash_attn_varlen_bwd(
        host["dout"], host["q"], host["k"], host["v"], want_out, want_lse,
        host["cu_seqlens_q"], host["cu_seqlens_k"], 7, 7, causal=causal)

    calls = _install_gpu(monkeypatch, varlen=False)
    out, lse = _call("flash_attn_varlen_fwd", a, causal=causal)
    a["out"], a["lse"] = out, lse
    grads = _call("flash_attn_varlen_bwd", a, causal=causal, deterministic=True)
    assert isinstance(out, FakeCupyArray) and isinstance(lse, FakeCupyArray)
    assert np.array_equal(out.host, want_out) and np.array_equal(lse.host, want_lse)
    for got, want in zip(grads, want_grads):
        assert isinstance(got, FakeCupyArray) and np.array_equal(got.host, want)
    # sequences (5, 7), (0, 3), (7, 5): the empty query sequence reaches no kernel
    assert [(c[0], c[1], c[2]) for c in calls] == [
        ("fwd", (1, 5, 4, 8), (1, 7, 2, 8)), ("fwd", (1, 7, 4, 8), (1, 5, 2, 8)),
        ("bwd", (1, 5, 4, 8), (1, 7, 2, 8)), ("bwd", (1, 7, 4, 8), (1, 5, 2, 8)),
    ]
    assert calls[0][3] == dict(softmax_scale=1 / math.sqrt(8), causal=causal)
    assert calls[2][3] == dict(softmax_scale=1 / math.sqrt(8), causal=causal, deterministic=True)


def test_cupy_empty_inputs_do_not_reach_the_gpu_module(fake_cupy, monkeypatch):
    calls = _install_gpu(monkeypatch, varlen=True)
    q = FakeCupyArray(np.ones((5, 4, 8), np.float16))
    kv = FakeCupyArray(np.ones((0, 2, 8), np.float16))
    cu_q, cu_k = FakeCupyArray(cu_seqlens([2, 3])), FakeCupyArray(cu_seqlens([0, 0]))
    out, lse = cupyflash.flash_attn_varlen_fwd(q, kv, kv, cu_q, cu_k, 3, 0)
    assert (out.host == 0).all() and lse.shape == (4, 5) and (lse.host == -np.inf).all()
    dq, dk, dv = cupyflash.flash_attn_varlen_bwd(q, q, kv, kv, out, lse, cu_q, cu_k, 3, 0)
    assert dq.shape == (5, 4, 8) and dk.shape == (0, 2, 8) and (dq.host == 0).all()
    assert calls == []


@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cupy_cu_seqlens_must_be_cupy_on_the_same_device(fake_cupy, monkeypatch, arg):
    _install_gpu(monkeypatch, varlen=True)
    a = _gpu_args()
    a[arg] = _host(a[arg])
    with pytest.raises(TypeError, match=rf"^cupyflash\.flash_attn_varlen_fwd: {arg} must be a "
                                        r"cupy\.ndarray like q .*; got numpy\.ndarray\.$"):
        _call("flash_attn_varlen_fwd", a)
    a[arg] = FakeCupyArray(a[arg], device_id=1)
    with pytest.raises(ValueError, match=rf"^cupyflash\.flash_attn_varlen_fwd: {arg} must be on "
                                         r"the same device as q \(cuda:0\); got cuda:1\.$"):
        _call("flash_attn_varlen_fwd", a)


def test_cupy_float32_is_rejected(fake_cupy, monkeypatch):
    _install_gpu(monkeypatch, varlen=True)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_varlen_fwd: q must have dtype "
                                        r"float16 or bfloat16 on the GPU path"):
        _call("flash_attn_varlen_fwd", _gpu_args(np.float32))


# ----------------------------------------------------------------------------
# dtype= : 2-byte cupy storage reaches the GPU module with its element type
# ----------------------------------------------------------------------------


def _storage_args(storage, element=np.float16):
    """Host arguments in ``element``, and fake cupy ones with q, k, v, dout, out as storage."""
    host = _valid_args(element)
    a = _gpu_args()
    for name in ("q", "k", "v", "dout", "out"):
        a[name] = FakeCupyArray(host[name].view(storage))
    return host, a


@pytest.mark.parametrize("storage", [np.uint16, np.int16])
@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=_NO_BF16)])
@pytest.mark.parametrize("varlen", [True, False], ids=["kernels", "loop"])
def test_gpu_storage_with_dtype_reaches_the_gpu_module(fake_cupy, monkeypatch, storage, dtype,
                                                       varlen):
    host, a = _storage_args(storage, testing.resolve_dtype(dtype))
    # what the loop must pack (computed before the fake GPU module forbids the CPU path)
    want_out, want_lse = cupyflash.flash_attn_varlen_fwd(
        host["q"], host["k"], host["v"], host["cu_seqlens_q"], host["cu_seqlens_k"], 7, 7,
        causal=True)
    want_grads = cupyflash.flash_attn_varlen_bwd(
        host["dout"], host["q"], host["k"], host["v"], want_out, want_lse,
        host["cu_seqlens_q"], host["cu_seqlens_k"], 7, 7, causal=True)
    calls = _install_gpu(monkeypatch, varlen=varlen)
    if not varlen:  # compute on the element type the bits hold, hand back the storage
        fake = sys.modules["cupyflash._gpu"]
        real_fwd, real_bwd = fake.fwd, fake.bwd

        def as_elements(x):
            return FakeCupyArray(x.host.view(testing.resolve_dtype(dtype)), x.device.id)

        def as_storage(results):
            return tuple(FakeCupyArray(r.host.view(storage) if r.host.itemsize == 2 else r.host)
                         for r in results)

        fake.fwd = lambda *xs, **kw: as_storage(real_fwd(*(as_elements(x) for x in xs), **kw))
        fake.bwd = lambda *xs, **kw: as_storage(real_bwd(
            *(x if x.dtype == np.float32 else as_elements(x) for x in xs), **kw))
    out, lse = _call("flash_attn_varlen_fwd", a, causal=True, dtype=dtype)
    _call("flash_attn_varlen", a, dtype=dtype)
    if not varlen:
        a["out"], a["lse"] = out, lse
    grads = _call("flash_attn_varlen_bwd", a, causal=True, dtype=dtype)
    assert {c[-1].get("dtype") for c in calls} == {dtype}
    if varlen:
        assert [c[0] for c in calls] == ["varlen_fwd", "varlen_fwd", "varlen_bwd"]
        return
    # the loop packs what the per-sequence calls computed: the numpy result, as storage bits
    assert out.dtype == storage and lse.dtype == np.float32
    assert np.array_equal(out.host, want_out.view(storage))
    assert np.array_equal(lse.host, want_lse)
    for got, want in zip(grads, want_grads):
        assert got.dtype == storage and np.array_equal(got.host, want.view(storage))


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_gpu_storage_without_dtype_is_rejected(fake_cupy, monkeypatch, fn_name):
    calls = _install_gpu(monkeypatch, varlen=True)
    _, a = _storage_args(np.uint16)
    with pytest.raises(TypeError, match=rf"^cupyflash\.{fn_name}: q must have dtype float16 or "
                                        r"bfloat16 on the GPU path .*; got uint16 \(for bfloat16 "
                                        r"data held as uint16/int16, pass dtype='bfloat16'\)\.$"):
        _call(fn_name, a)
    with pytest.raises(TypeError, match=r"dtype must be 'float16' or 'bfloat16' for uint16 "
                                        r"storage; got 'float32'\.$"):
        _call(fn_name, a, dtype="float32")
    assert calls == []


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_dtype_on_numpy_is_rejected(fn_name):
    with pytest.raises(TypeError, match=rf"^cupyflash\.{fn_name}: dtype must be None or q's own "
                                        r"dtype \(float32\).*; got 'bfloat16'\.$"):
        _call(fn_name, _valid_args(), dtype="bfloat16")
    _call(fn_name, _valid_args(), dtype="float32")  # names what q is: accepted
