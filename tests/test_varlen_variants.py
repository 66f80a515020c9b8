"""The varlen functions' attention variants (issue 13) on the CPU path: window_size,
softcap, alibi_slopes, sinks and dropout_p with rng_state.

Each sequence is the dense batch element ``b`` of its own lengths: aligned
bottom-right to them, its row of (batch, nheads_q) ALiBi slopes, its dropout
mask drawn by :mod:`cupyflash._philox` at batch index ``b``.  Results are
checked against the float64 reference sequence by sequence with the naive
same-dtype rule of :mod:`cupyflash.testing` (``test_varlen.packed_reference``),
and against the dense functions on batches holding the same sequences.  Bad
values raise TypeError/ValueError naming the argument; on GPU arrays (a fake
cupy) the options reach the GPU variant entries with the packed batch.
"""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest

import cupyflash
from cupyflash import _philox, cpu, testing
from fakes import FakeCupyArray, install_fake_gpu
from test_varlen import (FUNCTIONS, _call, _valid_args, assert_matches_packed_reference, cu_seqlens,
                         packed_inputs, packed_reference)

_NO_BF16 = pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is None,
                              reason="bfloat16 needs ml_dtypes (pip install ml_dtypes)")
SEED, OFFSET = 0x0123_4567_89AB_CDEF, 11

# Lengths with a sequence of no query, one of no key, a single token and tiles' tails.
LENS_Q = (5, 130, 0, 1, 64, 20)
LENS_K = (7, 100, 3, 1, 0, 150)
NHEADS, NHEADS_KV, HEAD_DIM = 4, 2, 16


def _slopes(rng, shape):
    return rng.uniform(0.05, 0.5, shape).astype(np.float32)


def _sinks(rng, nheads=NHEADS):
    return rng.standard_normal(nheads).astype(np.float32)


# name -> (causal, kwargs given rng and the number of sequences)
VARIANTS = {
    "window": (False, lambda rng, batch: {"window_size": (9, 5)}),
    "window-left": (False, lambda rng, batch: {"window_size": (17, -1)}),
    "window-right": (False, lambda rng, batch: {"window_size": (-1, 3)}),
    "softcap": (False, lambda rng, batch: {"softcap": 1.5}),
    "alibi-heads": (True, lambda rng, batch: {"alibi_slopes": _slopes(rng, (NHEADS,))}),
    "alibi-batch-heads": (False, lambda rng, batch: {"alibi_slopes": _slopes(rng, (batch, NHEADS))}),
    "sinks": (False, lambda rng, batch: {"sinks": _sinks(rng)}),
    "dropout": (False, lambda rng, batch: {"dropout_p": 0.3, "rng_state": (SEED, OFFSET)}),
    "window+causal+gqa": (True, lambda rng, batch: {"window_size": (11, 4)}),
    "softcap+alibi": (False, lambda rng, batch: {"softcap": 0.8, "alibi_slopes": _slopes(rng, (batch, NHEADS))}),
    "sinks+window": (False, lambda rng, batch: {"window_size": (6, 0), "sinks": _sinks(rng)}),
    "dropout+causal": (True, lambda rng, batch: {"dropout_p": 0.25, "rng_state": (SEED, OFFSET)}),
    "everything": (True, lambda rng, batch: {
        "window_size": (13, -1), "softcap": 2.0, "alibi_slopes": _slopes(rng, (NHEADS,)), "sinks": _sinks(rng),
        "dropout_p": 0.2, "rng_state": (SEED, OFFSET)}),
}


def _problem(rng, dtype, lens_q=LENS_Q, lens_k=LENS_K, nheads=NHEADS, nheads_kv=NHEADS_KV, head_dim=HEAD_DIM):
    q, k, v = packed_inputs(rng, lens_q, lens_k, nheads, nheads_kv, head_dim, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    args = (cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q, default=0), max(lens_k, default=0))
    return dout, q, k, v, args


def _fwd_bwd(dout, q, k, v, args, causal, **variants):
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, causal=causal, **variants)
    grads = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *args, causal=causal, **variants)
    return out, lse, grads


# ----------------------------------------------------------------------------
# Against the float64 reference, sequence by sequence
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", pytest.param("bfloat16", marks=_NO_BF16)])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_reference_per_sequence(rng, name, dtype):
    causal, make = VARIANTS[name]
    variants = make(rng, len(LENS_Q))
    dout, q, k, v, args = _problem(rng, dtype)
    out, lse, grads = _fwd_bwd(dout, q, k, v, args, causal, **variants)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (NHEADS, q.shape[0])
    assert len(grads) == (4 if "sinks" in variants else 3)
    assert [g.dtype for g in grads[:3]] == [q.dtype] * 3
    results = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    if "sinks" in variants:
        assert grads[3].shape == (NHEADS,) and grads[3].dtype == np.float32
        results["dsinks"] = grads[3]
    refs = packed_reference(q, k, v, dout, args[0], args[1], causal, out=out, **variants)
    assert_matches_packed_reference(results, refs)
    np.testing.assert_array_equal(
        cupyflash.flash_attn_varlen(q, k, v, *args, causal=causal, **variants), out)


def test_softmax_scale_with_variants(rng):
    dout, q, k, v, args = _problem(rng, np.float32)
    variants = {"softcap": 3.0, "window_size": (20, 2), "sinks": _sinks(rng)}
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, softmax_scale=0.7, **variants)
    grads = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *args, softmax_scale=0.7, **variants)
    refs = packed_reference(q, k, v, dout, args[0], args[1], False, softmax_scale=0.7, **variants)
    assert_matches_packed_reference(dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv", "dsinks"), grads))),
                                    refs)


# ----------------------------------------------------------------------------
# A packed batch is the dense batch: sequence b as batch element b
# ----------------------------------------------------------------------------


def _dense_kwargs(variants, batch):
    """The dense call's variants for a batch of ``batch`` elements."""
    dense = dict(variants)
    slopes = dense.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 2:
        dense["alibi_slopes"] = np.ascontiguousarray(slopes[:batch])
    return dense


@pytest.mark.parametrize("name", ["dropout", "alibi-batch-heads", "everything", "dropout+causal"])
def test_each_sequence_is_its_dense_batch_element(rng, name):
    """Sequence ``b`` equals element ``b`` of a dense batch of ``b + 1`` (the elements
    before it random): the same (b, h, i, j) draws the same dropout decision, and the
    same slopes row applies."""
    causal, make = VARIANTS[name]
    lens_q, lens_k = (9, 31, 1, 40), (12, 31, 5, 17)
    variants = make(rng, len(lens_q))
    dout, q, k, v, args = _problem(rng, np.float32, lens_q, lens_k)
    out, lse, grads = _fwd_bwd(dout, q, k, v, args, causal, **variants)
    cu_q, cu_k = args[0], args[1]
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        dense = [testing.random_normal(rng, (b + 1, n, h, HEAD_DIM), np.float32)
                 for n, h in ((n_q, NHEADS), (n_k, NHEADS_KV), (n_k, NHEADS_KV), (n_q, NHEADS))]
        for x, packed, where in zip(dense, (q, k, v, dout), (rows, keys, keys, rows)):
            x[b] = packed[where]
        d_q, d_k, d_v, d_dout = dense
        kw = _dense_kwargs(variants, b + 1)
        want_out, want_lse = cupyflash.flash_attn_fwd(d_q, d_k, d_v, causal=causal, **kw)
        want = cupyflash.flash_attn_bwd(d_dout, d_q, d_k, d_v, want_out, want_lse, causal=causal, **kw)
        np.testing.assert_allclose(out[rows], want_out[b], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[:, rows], want_lse[b], rtol=1e-6, atol=1e-6)
        for got, expect, where in zip(grads[:3], want[:3], (rows, keys, keys)):
            np.testing.assert_allclose(got[where], expect[b], rtol=1e-5, atol=1e-5)


def test_equal_lengths_are_the_dense_batch(rng):
    """With equal lengths the packed batch is the dense batch reshaped, variants and all."""
    batch, seqlen_q, seqlen_k = 3, 40, 33
    causal, make = VARIANTS["everything"]
    variants = make(rng, batch)
    variants["alibi_slopes"] = _slopes(rng, (batch, NHEADS))
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, NHEADS, NHEADS_KV, HEAD_DIM, np.float32)
    dout = testing.random_normal(rng, q.shape, np.float32)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal, **variants)
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, **variants)

    def pack(x):
        return x.reshape(-1, *x.shape[2:])

    args = (cu_seqlens([seqlen_q] * batch), cu_seqlens([seqlen_k] * batch), seqlen_q, seqlen_k)
    p_out, p_lse, p_grads = _fwd_bwd(pack(dout), pack(q), pack(k), pack(v), args, causal, **variants)
    np.testing.assert_allclose(p_out, pack(out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p_lse, lse.transpose(1, 0, 2).reshape(NHEADS, -1), rtol=1e-6, atol=1e-6)
    for got, want in zip(p_grads[:3], grads[:3]):
        np.testing.assert_allclose(got, pack(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(p_grads[3], grads[3], rtol=1e-5, atol=1e-5)  # dsinks, summed alike


# ----------------------------------------------------------------------------
# Dropout: the mask of sequence b is the Philox one at batch index b
# ----------------------------------------------------------------------------


def test_dropout_mask_is_the_philox_one_per_sequence():
    """Uniform scores and one-hot values: out > 0 exactly where a key was kept."""
    lens_q, lens_k = (3, 9, 5), (13, 4, 13)
    nheads, p = 2, 0.4
    q = np.zeros((sum(lens_q), nheads, 13), np.float32)
    k = np.zeros((sum(lens_k), nheads, 13), np.float32)
    v = np.ascontiguousarray(np.concatenate([np.broadcast_to(np.eye(13, dtype=np.float32)[:n, None],
                                                             (n, nheads, 13)) for n in lens_k]))
    args = (cu_seqlens(lens_q), cu_seqlens(lens_k), 9, 13)
    out, _ = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, dropout_p=p, rng_state=(SEED, OFFSET))
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        rows = slice(args[0][b], args[0][b + 1])
        keep = _philox.dropout_keep_mask(SEED, OFFSET, p, b + 1, nheads, n_q, n_k)[b]  # (H, n_q, n_k)
        np.testing.assert_array_equal(out[rows, :, :n_k].transpose(1, 0, 2) > 0, keep)
        assert (out[rows, :, n_k:] == 0).all()
    again, _ = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, dropout_p=p, rng_state=(SEED, OFFSET))
    np.testing.assert_array_equal(again, out)
    for other in ((SEED + 1, OFFSET), (SEED, OFFSET + 1)):
        changed, _ = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, dropout_p=p, rng_state=other)
        assert not np.array_equal(changed, out)


def test_dropout_backward_draws_the_forwards_mask(rng):
    dout, q, k, v, args = _problem(rng, np.float32)
    kw = {"dropout_p": 0.3, "rng_state": (SEED, OFFSET)}
    out, lse, grads = _fwd_bwd(dout, q, k, v, args, True, **kw)
    other = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *args, causal=True, dropout_p=0.3,
                                            rng_state=(SEED, OFFSET + 1))
    assert not np.array_equal(other[0], grads[0])
    again = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *args, causal=True, **kw)
    for a, b in zip(again, grads):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------
# Rows that see no key; empty batches; options off
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_rows_that_see_no_key(rng, with_sinks):
    """A sequence with no key, and a window whose right edge is left of every key for
    the first rows: out 0, lse -inf (the sink with sinks), dq 0, nothing NaN."""
    lens_q, lens_k = (30, 6, 12), (10, 0, 12)
    dout, q, k, v, args = _problem(rng, np.float16, lens_q, lens_k)
    sinks = _sinks(rng) if with_sinks else None
    kw = dict(window_size=(4, -1), causal=True, softcap=3.0, sinks=sinks, dropout_p=0.1,
              rng_state=(SEED, OFFSET))
    out, lse, grads = _fwd_bwd(dout, q, k, v, args, **kw)
    for x in (out, lse) + tuple(grads):
        assert not np.isnan(x.astype(np.float32)).any()
    empty = np.r_[0:20, 30:36]  # the 20 first rows of sequence 0 (30 queries, 10 keys), all of sequence 1
    assert (out[empty] == 0).all() and (grads[0][empty] == 0).all()
    want = np.broadcast_to(sinks[:, None], (NHEADS, len(empty))) if with_sinks else -np.inf
    np.testing.assert_array_equal(lse[:, empty], want)
    if with_sinks:
        refs = packed_reference(q, k, v, dout, args[0], args[1], True, window_size=(4, -1), softcap=3.0,
                                sinks=sinks, dropout_p=0.1, rng_state=(SEED, OFFSET))
        assert_matches_packed_reference(dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv", "dsinks"), grads))),
                                        refs)


@pytest.mark.parametrize("lens_q,lens_k", [((3, 3), (0, 0)), ((0, 0), (4, 5)), ((), ())],
                         ids=["no-keys", "no-queries", "batch0"])
def test_nothing_to_compute_with_variants(rng, monkeypatch, lens_q, lens_k):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the CPU path ran")

    monkeypatch.setattr(cpu, "fwd", must_not_run)
    monkeypatch.setattr(cpu, "bwd", must_not_run)
    dout, q, k, v, args = _problem(rng, np.float32, lens_q, lens_k)
    sinks = _sinks(rng)
    kw = dict(sinks=sinks, window_size=(3, 0), dropout_p=0.5, rng_state=(1, 2))
    out, lse, grads = _fwd_bwd(dout, q, k, v, args, False, **kw)
    assert (out == 0).all() and out.shape == q.shape
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[:, None], lse.shape))
    assert len(grads) == 4
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and (g == 0).all()
    np.testing.assert_array_equal(grads[3], np.zeros(NHEADS, np.float32))


def test_options_off_are_bitwise_the_default(rng):
    dout, q, k, v, args = _problem(rng, np.float16)
    plain = _fwd_bwd(dout, q, k, v, args, True)
    off = dict(window_size=[-1, -1], softcap=0, alibi_slopes=None, sinks=None, dropout_p=0.0, rng_state=(3, 4))
    same = _fwd_bwd(dout, q, k, v, args, True, **off)
    for a, b in zip(plain[:2] + plain[2], same[:2] + same[2]):
        np.testing.assert_array_equal(a, b)


def test_a_minus_inf_sink_is_no_sink(rng):
    dout, q, k, v, args = _problem(rng, np.float32)
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, sinks=np.full(NHEADS, -np.inf, np.float32))
    want_out, want_lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)


# ----------------------------------------------------------------------------
# Bad input: TypeError / ValueError naming the argument and the rule
# ----------------------------------------------------------------------------

# _valid_args: q (12, 4, 8) in 3 sequences; (id, exception, argument, text, kwargs)
BAD = [
    ("window-below-minus-1", ValueError, "window_size's left entry",
     "must be in [-1, 2**31 - 1] (-1: unbounded); got -2.", dict(window_size=(-2, 0))),
    ("window-float", TypeError, "window_size's right entry", "must be an int (-1: unbounded); got float.",
     dict(window_size=(3, 1.5))),
    ("window-three", ValueError, "window_size", "must have two entries (left, right); got 3",
     dict(window_size=(1, 2, 3))),
    ("window-int", TypeError, "window_size", "must be a pair of ints (left, right), -1 for unbounded; got int.",
     dict(window_size=4)),
    ("softcap-negative", ValueError, "softcap", "must be finite and >= 0 (0: off); got -1.0.",
     dict(softcap=-1.0)),
    ("softcap-inf", ValueError, "softcap", "must be finite and >= 0 (0: off); got inf.",
     dict(softcap=float("inf"))),
    ("softcap-str", TypeError, "softcap", "must be a float >= 0 (0: off); got str.", dict(softcap="30")),
    ("dropout-one", ValueError, "dropout_p", "must be in [0, 1); got 1.0.", dict(dropout_p=1.0, rng_state=(1, 0))),
    ("dropout-negative", ValueError, "dropout_p", "must be in [0, 1); got -0.1.", dict(dropout_p=-0.1)),
    ("dropout-bool", TypeError, "dropout_p", "must be a float in [0, 1); got bool.", dict(dropout_p=True)),
    ("dropout-no-rng-state", TypeError, "rng_state=(seed, offset)", "must be given with dropout_p > 0",
     dict(dropout_p=0.1)),  # the backward's alone: a forward draws its own state
    ("rng-state-int", TypeError, "rng_state", "must be None or a pair of ints (seed, offset); got int.",
     dict(dropout_p=0.1, rng_state=5)),
    ("rng-state-offset", ValueError, "rng_state's offset", "must be in [0, 2**32); got 4294967296.",
     dict(dropout_p=0.1, rng_state=(1, 2**32))),
    ("alibi-list", TypeError, "alibi_slopes", "must be None or a float32 array of shape (nheads_q,) or "
     "(batch, nheads_q); got list.", dict(alibi_slopes=[0.5] * 4)),
    ("alibi-shape", ValueError, "alibi_slopes", "must have shape (4,) or (3, 4) (q's nheads_q = 4, batch = 3); "
     "got (2,).", dict(alibi_slopes=np.ones(2, np.float32))),
    ("alibi-batch", ValueError, "alibi_slopes", "must have shape (4,) or (3, 4) (q's nheads_q = 4, batch = 3); "
     "got (12, 4).", dict(alibi_slopes=np.ones((12, 4), np.float32))),  # total_q rows, not batch
    ("alibi-dtype", TypeError, "alibi_slopes", "must have dtype float32; got float64.",
     dict(alibi_slopes=np.ones(4))),
    ("alibi-inf", ValueError, "alibi_slopes", "must be finite; got a NaN or infinite value.",
     dict(alibi_slopes=np.array([0, np.inf, 0, 0], np.float32))),
    ("sinks-shape", ValueError, "sinks", "must have shape (4,) (q's nheads_q = 4); got (3, 4).",
     dict(sinks=np.ones((3, 4), np.float32))),
    ("sinks-dtype", TypeError, "sinks", "must have dtype float32; got float16.", dict(sinks=np.ones(4, np.float16))),
    ("sinks-nan", ValueError, "sinks", "must be finite or -inf (no sink); got a NaN or infinite value.",
     dict(sinks=np.array([0, np.nan, 0, 0], np.float32))),
    ("sinks-gpu", TypeError, "sinks", "must be a numpy.ndarray like q (numpy and cupy inputs cannot be mixed); "
     "got cupy.ndarray.", "fake-gpu-sinks"),
]


def _bad_cases():
    for fn_name in FUNCTIONS:
        for case in BAD:
            if case[0] == "dropout-no-rng-state" and not fn_name.endswith("_bwd"):
                continue
            yield pytest.param(fn_name, *case[1:], id=f"{fn_name}-{case[0]}")


@pytest.mark.parametrize("fn_name,exc_type,arg,text,kwargs", list(_bad_cases()))
def test_bad_variant_values(monkeypatch, fn_name, exc_type, arg, text, kwargs):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the CPU path ran")

    if kwargs == "fake-gpu-sinks":
        install_fake_gpu(monkeypatch)
        kwargs = {"sinks": FakeCupyArray(np.zeros(4, np.float32))}
    monkeypatch.setattr(cpu, "fwd", must_not_run)
    monkeypatch.setattr(cpu, "bwd", must_not_run)
    with pytest.raises(exc_type) as info:
        _call(fn_name, _valid_args(), **kwargs)
    message = str(info.value)
    assert message.startswith(f"cupyflash.{fn_name}: {arg} must "), message
    assert text in message, message


# ----------------------------------------------------------------------------
# GPU arrays (a fake cupy): checked, then the GPU variant entries with the packed batch
# ----------------------------------------------------------------------------


def _fake_gpu_args():
    return {name: (FakeCupyArray(x.astype(np.float16) if x.dtype == np.float32 and name != "lse" else x)
                   if isinstance(x, np.ndarray) else x)
            for name, x in _valid_args().items()}


@pytest.mark.parametrize("fn_name", FUNCTIONS)
@pytest.mark.parametrize("option, value", [
    ("dropout_p", 0.1), ("window_size", (128, 0)), ("alibi_slopes", "slopes"), ("softcap", 30.0),
    ("sinks", "sinks")])
def test_variants_on_the_gpu_go_to_the_variant_entries(monkeypatch, fn_name, option, value):
    """The options that are on reach ``_gpu.variant_fwd`` / ``_gpu_bwd.variant_bwd`` with
    the packed batch (cu_seqlens and the max lengths)."""
    install_fake_gpu(monkeypatch)
    if value in ("slopes", "sinks"):
        value = FakeCupyArray(np.ones(4, np.float32))
    extra = {"rng_state": (1, 0)} if option == "dropout_p" else {}
    seen = {}

    def record(*args, **kwargs):
        seen.update(kwargs)
        return "out", "lse"

    cupyflash._gpu.variant_fwd = record  # the fake modules install_fake_gpu put in place
    cupyflash._gpu_bwd.variant_bwd = record
    args = _fake_gpu_args()
    _call(fn_name, args, **{option: value}, **extra)
    assert option in seen["options"] or (option == "dropout_p" and seen["options"]["dropout_p"] == 0.1)
    cu_q, cu_k, max_q, max_k = seen["packed"]
    assert cu_q is args["cu_seqlens_q"] and cu_k is args["cu_seqlens_k"]
    assert (max_q, max_k) == (args["max_seqlen_q"], args["max_seqlen_k"])


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_malformed_variants_on_the_gpu_are_refused_first(monkeypatch, fn_name):
    install_fake_gpu(monkeypatch)
    with pytest.raises(ValueError, match=re.escape(f"cupyflash.{fn_name}: softcap must be finite and >= 0")):
        _call(fn_name, _fake_gpu_args(), softcap=-1.0)
    with pytest.raises(ValueError, match=re.escape(f"cupyflash.{fn_name}: alibi_slopes must have shape (4,) or "
                                                   f"(3, 4)")):
        _call(fn_name, _fake_gpu_args(), alibi_slopes=FakeCupyArray(np.ones(5, np.float32)))
    with pytest.raises(ValueError, match=re.escape(f"cupyflash.{fn_name}: alibi_slopes must be on the same "
                                                   f"device as q (cuda:0); got cuda:1.")):
        _call(fn_name, _fake_gpu_args(), alibi_slopes=FakeCupyArray(np.ones(4, np.float32), device_id=1))
    if fn_name.endswith("_bwd"):  # a forward draws its own state
        with pytest.raises(TypeError, match=re.escape(f"cupyflash.{fn_name}: rng_state=(seed, offset) must be "
                                                      f"given")):
            _call(fn_name, _fake_gpu_args(), dropout_p=0.5)


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_options_off_on_the_gpu_take_the_kernels(monkeypatch, fn_name):
    """Off values given explicitly are no variant: the plain GPU route runs."""
    install_fake_gpu(monkeypatch)
    from cupyflash import _gpu

    calls = []
    for name in ("varlen_fwd", "varlen_bwd"):
        monkeypatch.setattr(_gpu, name, lambda *a, _n=name, **kw: calls.append((_n, kw)) or ("out", "lse", "dq"),
                            raising=False)
    _call(fn_name, _fake_gpu_args(), window_size=(-1, -1), softcap=0.0, dropout_p=0.0, alibi_slopes=None)
    assert len(calls) == 1
    assert not {"window_size", "softcap", "dropout_p", "alibi_slopes", "sinks", "rng_state"} & set(calls[0][1])
