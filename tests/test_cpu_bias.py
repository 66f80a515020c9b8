"""The CPU path's ``attn_bias`` / ``attn_mask`` (issue 14) against the float64 reference.

Every result is held to flash-attention's rule (:mod:`cupyflash.testing`): at most
2x (3x for gradients, ``dbias`` included) the error of a naive implementation in
the same dtype, plus a small floor.  Inputs are fresh random values, outputs are
NaN-poisoned buffers (so every element must be written), and the tiles are small
(16 x 12) so that every case runs many tiles and their tails.  Covered: every
broadcast shape of the bias and the mask, non-contiguous and stride-0 biases,
``-inf`` entries and fully masked rows, the combinations with the other
variants, GQA and varlen, ``dbias`` summed over the broadcast dimensions (also
against the same bias expanded, and against the identity ``dq = scale * dS k``),
and that a broadcast bias is never expanded to ``(B, H, N, N)``.
"""

from __future__ import annotations

import importlib.util
import tracemalloc

import numpy as np
import pytest

import cupyflash
from cupyflash import _philox, cpu, reference, testing
from test_varlen import cu_seqlens, packed_inputs

_NO_BF16 = pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is None,
                              reason="bfloat16 needs ml_dtypes (pip install ml_dtypes)")
DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=_NO_BF16)]
SCALE = 0.4
SEED, OFFSET = 0x5EED_0000_0014, 3
#: (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim): GQA, tails in both tile axes
SHAPE = (2, 37, 45, 4, 2, 16)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(cpu, "BLOCK_M", 16)
    monkeypatch.setattr(cpu, "BLOCK_N", 12)


#: name -> the bias's (or mask's) shape given (batch, nheads_q, seqlen_q, seqlen_k)
BROADCAST = {
    "full": lambda b, h, m, n: (b, h, m, n),
    "per-head": lambda b, h, m, n: (1, h, m, n),
    "per-batch": lambda b, h, m, n: (b, 1, m, n),
    "per-key": lambda b, h, m, n: (b, 1, 1, n),
    "per-row": lambda b, h, m, n: (b, 1, m, 1),
    "per-head-scalar": lambda b, h, m, n: (1, h, 1, 1),
    "rank3": lambda b, h, m, n: (h, m, n),
    "rank2": lambda b, h, m, n: (m, n),
    "rank1": lambda b, h, m, n: (n,),
}


def _dtype(name):
    return testing.resolve_dtype(name)


def _bias(rng, shape, dtype=np.float32):
    return (2.0 * rng.standard_normal(shape, dtype=np.float32)).astype(_dtype(dtype))


def _mask(rng, shape, keep=0.7):
    return rng.random(shape) < keep


def _problem(rng, dtype, shape=SHAPE):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = shape
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype)
    return q, k, v, testing.random_normal(rng, q.shape, dtype)


def _score_shape(q, k):
    return q.shape[0], q.shape[2], q.shape[1], k.shape[1]


def _run(q, k, v, dout, causal=False, **variants):
    """The public forward and backward on the CPU path, into NaN-poisoned outputs;
    ``return_dbias`` whenever a bias is given.  Returns ``(out, lse, grads)``."""
    out, lse = testing.poison(q.shape, q.dtype), testing.poison((q.shape[0], q.shape[2], q.shape[1]), np.float32)
    got = cupyflash.flash_attn_fwd(q, k, v, softmax_scale=SCALE, causal=causal, out=out, lse=lse, **variants)
    assert got[0] is out and got[1] is lse
    dq, dk, dv = (testing.poison(x.shape, x.dtype) for x in (q, k, v))
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, softmax_scale=SCALE, causal=causal, dq=dq, dk=dk,
                                     dv=dv, return_dbias=variants.get("attn_bias") is not None, **variants)
    assert grads[0] is dq and grads[1] is dk and grads[2] is dv
    return out, lse, grads


def _reference_kwargs(q, k, variants):
    """The reference's keywords for the public ones: the Philox mask for rng_state."""
    ref = {name: x for name, x in variants.items() if name != "rng_state"}
    if variants.get("dropout_p"):
        batch, nheads, seqlen_q, seqlen_k = _score_shape(q, k)
        ref["dropout_mask"] = _philox.dropout_keep_mask(*variants["rng_state"], variants["dropout_p"], batch,
                                                        nheads, seqlen_q, seqlen_k)
    return ref


def _check(q, k, v, dout, out, lse, grads, causal=False, **variants):
    """Everything against the float64 reference with the naive rule; returns the errors.

    ``dsinks`` and ``dbias`` are held against the reference's for the returned
    ``out`` (:func:`cupyflash.testing.given_out`: delta from the rounded out, as
    FlashAttention computes it)."""
    ref_kw = _reference_kwargs(q, k, variants)
    bias = variants.get("attn_bias")
    with_sinks = variants.get("sinks") is not None
    assert len(grads) == 3 + with_sinks + (bias is not None)
    dsinks = grads[3] if with_sinks else None
    dbias = grads[-1] if bias is not None else None
    if dbias is not None:
        assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    errors = testing.assert_fwd_matches_reference(q, k, v, out, lse, softmax_scale=SCALE, causal=causal, **ref_kw)
    errors.update(testing.assert_bwd_matches_reference(dout, q, k, v, *grads[:3], softmax_scale=SCALE,
                                                       causal=causal, dsinks=dsinks, dbias=dbias, out=out,
                                                       **ref_kw))
    return errors


# ----------------------------------------------------------------------------
# Every broadcast shape, every dtype
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bias_dtype", ["q", "float32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(BROADCAST))
def test_bias_shapes_match_reference(rng, name, dtype, bias_dtype):
    if dtype == "float32" and bias_dtype == "float32":
        pytest.skip("q's dtype is float32: the same case")
    q, k, v, dout = _problem(rng, dtype)
    bias = _bias(rng, BROADCAST[name](*_score_shape(q, k)), dtype if bias_dtype == "q" else np.float32)
    out, lse, grads = _run(q, k, v, dout, attn_bias=bias)
    assert out.dtype == q.dtype and [g.dtype for g in grads[:3]] == [q.dtype] * 3
    _check(q, k, v, dout, out, lse, grads, attn_bias=bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(BROADCAST))
def test_mask_shapes_match_reference(rng, name, dtype):
    q, k, v, dout = _problem(rng, dtype)
    mask = _mask(rng, BROADCAST[name](*_score_shape(q, k)))
    out, lse, grads = _run(q, k, v, dout, attn_mask=mask)
    assert len(grads) == 3
    _check(q, k, v, dout, out, lse, grads, attn_mask=mask)


@pytest.mark.parametrize("bias_dtype", ["float64", "float32"])
def test_float64_inputs(rng, bias_dtype):
    """float64 inputs (held to the naive float32 rule); dbias in the bias's dtype."""
    q, k, v, dout = _problem(rng, "float64")
    bias = _bias(rng, (1, 4, 37, 45), bias_dtype)
    mask = _mask(rng, (2, 1, 1, 45), 0.8)
    out, lse, grads = _run(q, k, v, dout, causal=True, attn_bias=bias, attn_mask=mask)
    assert grads[-1].dtype == np.dtype(bias_dtype)
    _check(q, k, v, dout, out, lse, grads, causal=True, attn_bias=bias, attn_mask=mask)


# ----------------------------------------------------------------------------
# With the other variants, GQA and MQA
# ----------------------------------------------------------------------------


def _alibi(rng, shape):
    return rng.uniform(0.05, 0.5, shape).astype(np.float32)


def _sinks(rng, nheads=4):
    return rng.standard_normal(nheads).astype(np.float32)


# name -> (shape, causal, variants given rng, bias shape and mask shape given (B, H, Sq, Sk))
COMBOS = {
    "causal": (SHAPE, True, lambda rng: {}),
    "causal-sq>sk": ((2, 45, 30, 4, 2, 16), True, lambda rng: {}),
    "window": (SHAPE, False, lambda rng: {"window_size": (9, 5)}),
    "softcap": (SHAPE, False, lambda rng: {"softcap": 1.5}),
    "alibi": (SHAPE, False, lambda rng: {"alibi_slopes": _alibi(rng, (2, 4))}),
    "sinks": (SHAPE, False, lambda rng: {"sinks": _sinks(rng)}),
    "dropout": (SHAPE, False, lambda rng: {"dropout_p": 0.3, "rng_state": (SEED, OFFSET)}),
    "mqa": ((2, 37, 45, 4, 1, 16), True, lambda rng: {}),
    "no-gqa": ((2, 37, 45, 2, 2, 16), False, lambda rng: {"window_size": (20, -1)}),
    "everything": (SHAPE, True, lambda rng: {
        "window_size": (13, -1), "softcap": 2.0, "alibi_slopes": _alibi(rng, (4,)), "sinks": _sinks(rng),
        "dropout_p": 0.2, "rng_state": (SEED, OFFSET)}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(COMBOS))
def test_with_other_variants(rng, name, dtype):
    shape, causal, make = COMBOS[name]
    q, k, v, dout = _problem(rng, dtype, shape)
    batch, nheads, seqlen_q, seqlen_k = _score_shape(q, k)
    variants = make(rng)
    variants["attn_bias"] = _bias(rng, (1, nheads, seqlen_q, seqlen_k))
    variants["attn_mask"] = _mask(rng, (batch, 1, seqlen_q, seqlen_k), 0.8)
    out, lse, grads = _run(q, k, v, dout, causal, **variants)
    _check(q, k, v, dout, out, lse, grads, causal, **variants)


def test_order_bias_after_softcap_and_alibi(rng):
    """One key per row: lse is the final score itself, softcap(scale q.k) - alibi + bias."""
    q, k, v, _ = _problem(rng, "float32", (1, 3, 1, 2, 1, 8))
    bias = np.array([0.5, -1.25, 2.0], np.float32)[None, None, :, None]  # per row
    slopes = np.array([0.25, 0.5], np.float32)
    _, lse = cupyflash.flash_attn_fwd(q, k, v, softmax_scale=SCALE, softcap=0.3, alibi_slopes=slopes,
                                      attn_bias=bias)
    raw = SCALE * np.einsum("bihd,bjd->bhi", q.astype(np.float64), k[:, :, 0].astype(np.float64))
    distance = np.abs(np.arange(3) + 1 - 3)  # key 0 is on row 2's diagonal
    want = 0.3 * np.tanh(raw / 0.3) - slopes[None, :, None] * distance + bias[0, 0, :, 0]
    np.testing.assert_allclose(lse, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# Strides: read in place; the same bits as a contiguous copy
# ----------------------------------------------------------------------------


def _strided_biases(rng, batch, nheads, seqlen_q, seqlen_k):
    """name -> a bias view whose strides are not C-contiguous."""
    row = _bias(rng, (seqlen_k,))
    big = _bias(rng, (seqlen_k + 5, seqlen_q + 3, nheads, 3))
    wide = _bias(rng, (batch, 1, seqlen_q, 2 * seqlen_k + 1))
    return {
        # a stride-0 broadcast view of full shape (its gradient is full-size)
        "broadcast-view-full": np.broadcast_to(row, (batch, nheads, seqlen_q, seqlen_k)),
        "broadcast-view-heads": np.broadcast_to(_bias(rng, (seqlen_q, seqlen_k)), (1, nheads, seqlen_q, seqlen_k)),
        # a transposed slice of a larger array: no unit stride anywhere
        "transposed-slice": big[2:2 + seqlen_k, 1:1 + seqlen_q, :, 1].transpose(2, 1, 0),
        "key-step-2": wide[..., 1::2],
        "reversed": _bias(rng, (batch, nheads, seqlen_q, seqlen_k))[:, ::-1, ::-1, ::-1],
        "fortran": np.asfortranarray(_bias(rng, (seqlen_q, seqlen_k))),
    }


@pytest.mark.parametrize("name", ["broadcast-view-full", "broadcast-view-heads", "transposed-slice", "key-step-2",
                                  "reversed", "fortran"])
def test_strided_biases_are_read_in_place(rng, name):
    q, k, v, dout = _problem(rng, "float16")
    bias = _strided_biases(rng, *_score_shape(q, k))[name]
    assert not bias.flags.c_contiguous
    mask = _mask(rng, (45,), 0.9)
    got = _run(q, k, v, dout, causal=True, attn_bias=bias, attn_mask=mask)
    want = _run(q, k, v, dout, causal=True, attn_bias=np.ascontiguousarray(bias), attn_mask=mask)
    for a, b in zip(got[:2] + got[2], want[:2] + want[2]):  # the same values: the same bits
        np.testing.assert_array_equal(a, b)
    assert got[2][-1].shape == bias.shape
    _check(q, k, v, dout, *got, causal=True, attn_bias=bias, attn_mask=mask)


def test_strided_masks_are_read_in_place(rng):
    q, k, v, dout = _problem(rng, "float32")
    batch, nheads, seqlen_q, seqlen_k = _score_shape(q, k)
    big = _mask(rng, (seqlen_k, 2 * seqlen_q, batch))
    mask = big[:, ::2].transpose(2, 1, 0)[:, None]  # (B, 1, Sq, Sk), transposed and stepped
    got = _run(q, k, v, dout, attn_mask=mask)
    want = _run(q, k, v, dout, attn_mask=np.ascontiguousarray(mask))
    for a, b in zip(got[:2] + got[2], want[:2] + want[2]):
        np.testing.assert_array_equal(a, b)
    _check(q, k, v, dout, *got, attn_mask=mask)


# ----------------------------------------------------------------------------
# -inf entries and rows that see no key
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("via", ["bias", "mask", "both"])
def test_minus_inf_entries_and_fully_masked_rows(rng, via, with_sinks, dtype):
    """A quarter of the keys hidden at random, and rows 3 and 20 of (batch 0, head 1)
    and row 30 of every head of batch 1 hidden entirely: out 0, lse -inf (the sink),
    dq 0 and dbias 0 there; nothing NaN; the rest as the reference."""
    q, k, v, dout = _problem(rng, dtype)
    batch, nheads, seqlen_q, seqlen_k = shape = _score_shape(q, k)
    hidden = rng.random(shape) < 0.25
    hidden[0, 1, [3, 20]] = True
    hidden[1, :, 30] = True
    variants = {"sinks": _sinks(rng)} if with_sinks else {}
    bias = _bias(rng, shape, dtype)
    if via in ("bias", "both"):
        bias[hidden if via == "bias" else hidden & (rng.random(shape) < 0.5)] = -np.inf
    if via in ("mask", "both"):
        variants["attn_mask"] = ~hidden if via == "mask" else ~(hidden & np.isfinite(bias.astype(np.float32)))
    variants["attn_bias"] = bias
    out, lse, grads = _run(q, k, v, dout, **variants)
    dq, dk, dv, *_, dbias = grads
    for x in (out, lse) + tuple(grads):
        assert not np.isnan(x.astype(np.float32)).any()
    empty = [(0, 1, 3), (0, 1, 20)] + [(1, h, 30) for h in range(nheads)]
    for b, h, i in empty:
        assert (out[b, i, h] == 0).all() and (dq[b, i, h] == 0).all() and (dbias[b, h, i] == 0).all()
        assert lse[b, h, i] == (variants["sinks"][h] if with_sinks else -np.inf)
    assert (dbias[hidden] == 0).all()
    assert np.isfinite(dk.astype(np.float32)).all() and np.isfinite(dv.astype(np.float32)).all()
    _check(q, k, v, dout, out, lse, grads, **variants)


def test_every_key_hidden(rng):
    """A mask hiding everything: out 0, lse -inf, every gradient 0 (dbias too)."""
    q, k, v, dout = _problem(rng, "float16")
    bias = _bias(rng, (45,), "float16")
    out, lse, grads = _run(q, k, v, dout, attn_bias=bias, attn_mask=np.zeros((1, 1, 1, 1), bool))
    assert (out == 0).all() and (lse == -np.inf).all()
    for g in grads:
        assert (g == 0).all()


# ----------------------------------------------------------------------------
# dbias: summed over the broadcast dimensions; it is dS
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in BROADCAST if n != "full"])
def test_dbias_is_the_full_gradient_summed(rng, name):
    """A broadcast bias's dbias is the dbias of the same bias expanded (an explicit
    copy), summed over the dimensions it broadcasts; the rest is the same."""
    q, k, v, dout = _problem(rng, "float32")
    full_shape = _score_shape(q, k)
    bias = _bias(rng, BROADCAST[name](*full_shape))
    variants = {"causal": True, "softcap": 3.0, "sinks": _sinks(rng)}
    got = _run(q, k, v, dout, attn_bias=bias, **variants)
    expanded = np.broadcast_to(bias, full_shape).copy()
    want = _run(q, k, v, dout, attn_bias=expanded, **variants)
    for a, b in zip(got[:2] + got[2][:-1], want[:2] + want[2][:-1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    padded = (1,) * (4 - bias.ndim) + bias.shape
    axes = tuple(a for a in range(4) if padded[a] == 1 and full_shape[a] > 1)
    summed = want[2][-1].astype(np.float64).sum(axis=axes, keepdims=True).reshape(bias.shape)
    np.testing.assert_allclose(got[2][-1], summed, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(summed).max()))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_dbias_is_ds(rng, dtype, dropout):
    """Without softcap, dq = softmax_scale * dS k and dk = softmax_scale * dS^T q
    (summed over the query heads of a KV head), with dS = dbias for a full bias."""
    q, k, v, dout = _problem(rng, dtype)
    batch, nheads, seqlen_q, seqlen_k = shape = _score_shape(q, k)
    variants = {"dropout_p": 0.25, "rng_state": (SEED, OFFSET)} if dropout else {}
    bias = _bias(rng, shape, dtype)
    _, _, (dq, dk, _, dbias) = _run(q, k, v, dout, causal=True, attn_bias=bias, **variants)
    group = nheads // k.shape[2]
    ds = dbias.astype(np.float64).reshape(batch, k.shape[2], group, seqlen_q, seqlen_k)
    want_dq = SCALE * np.einsum("bkgij,bjkd->bikgd", ds, k.astype(np.float64)).reshape(dq.shape)
    want_dk = SCALE * np.einsum("bkgij,bikgd->bjkd", ds,
                                q.astype(np.float64).reshape(batch, seqlen_q, k.shape[2], group, -1))
    for got, want in ((dq, want_dq), (dk, want_dk)):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("q_dtype,bias_dtype", [("float16", "float16"), ("float16", "float32"),
                                                ("float32", "float32"), ("float64", "float64"),
                                                ("float64", "float32"),
                                                pytest.param("bfloat16", "bfloat16", marks=_NO_BF16),
                                                pytest.param("bfloat16", "float32", marks=_NO_BF16)])
def test_dbias_has_the_bias_shape_and_dtype(rng, q_dtype, bias_dtype):
    q, k, v, dout = _problem(rng, q_dtype)
    for shape in ((37, 45), (4, 1, 45), (2, 4, 37, 45), (1,)):
        bias = _bias(rng, shape, bias_dtype)
        dbias = _run(q, k, v, dout, attn_bias=bias)[2][-1]
        assert dbias.shape == bias.shape and dbias.dtype == bias.dtype


def test_mask_equals_a_minus_inf_bias(rng):
    q, k, v, dout = _problem(rng, "float32")
    mask = _mask(rng, (2, 1, 37, 45), 0.6)
    bias = _bias(rng, (1, 4, 37, 45))
    with_mask = _run(q, k, v, dout, attn_bias=bias, attn_mask=mask)
    as_bias = _run(q, k, v, dout, attn_bias=np.where(mask, bias, -np.inf).astype(np.float32))
    for a, b in zip(with_mask[:2] + with_mask[2][:3], as_bias[:2] + as_bias[2][:3]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # the mask's dbias sums over the batch what the (B, H, Sq, Sk) -inf bias keeps apart
    np.testing.assert_allclose(with_mask[2][3], as_bias[2][3].sum(axis=0, keepdims=True), rtol=1e-5, atol=1e-6)


def test_off_values_and_an_all_true_mask(rng):
    """None is no bias (the plain path); an all-True mask changes no bit; a zero bias
    only the units the scores are computed in."""
    q, k, v, dout = _problem(rng, "float16")
    plain = _run(q, k, v, dout, causal=True)
    for variants in ({"attn_bias": None, "attn_mask": None}, {"attn_mask": np.ones((37, 45), bool)}):
        same = _run(q, k, v, dout, causal=True, **variants)
        for a, b in zip(plain[:2] + plain[2], same[:2] + same[2]):
            np.testing.assert_array_equal(a, b)
    zero = _run(q, k, v, dout, causal=True, attn_bias=np.zeros((1,), np.float32))
    for a, b in zip(plain[:2] + plain[2], zero[:2] + zero[2][:3]):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------
# Varlen: the bias's block of each sequence, at positions local to it
# ----------------------------------------------------------------------------

LENS_Q = (5, 40, 0, 1, 30, 20)
LENS_K = (7, 33, 3, 1, 0, 50)


def _packed_reference(q, k, v, dout, lens_q, lens_k, causal, attn_bias=None, attn_mask=None, **variants):
    """Per sequence: the float64 reference and the naive implementation on its block of
    the bias and mask.  Returns ``{name: (ref64, naive)}``, dbias accumulated into the
    bias's padded shape, then reshaped to the bias's own."""
    naive_dtype = testing.naive_dtype(q.dtype)
    nheads = q.shape[1]
    res = {"out": np.zeros((2,) + q.shape), "lse": np.full((2, nheads, q.shape[0]), -np.inf),
           "dq": np.zeros((2,) + q.shape), "dk": np.zeros((2,) + k.shape), "dv": np.zeros((2,) + v.shape)}
    if variants.get("sinks") is not None:  # a row that sees no key has lse sinks[h]
        res["lse"][...] = np.asarray(variants["sinks"], np.float64)[None, :, None]
    pad = (lambda x: None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape))
    bias4, mask4 = pad(attn_bias), pad(attn_mask)
    if bias4 is not None:
        res["dbias"] = np.zeros((2,) + bias4.shape)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        if not (n_q and n_k):
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])

        def block(x, b=b, n_q=n_q, n_k=n_k):
            return None if x is None else x[b if x.shape[0] > 1 else 0][None, :, :n_q if x.shape[2] > 1 else 1,
                                                                         :n_k if x.shape[3] > 1 else 1]

        kw = dict(variants, attn_bias=block(bias4), attn_mask=block(mask4))
        args = (q[None, rows], k[None, keys], v[None, keys])
        fwd = (reference.attention_fwd(*args, SCALE, causal, **kw),
               reference.naive_attention(*args, SCALE, causal, naive_dtype, **kw))
        with_dbias = bias4 is not None
        bwd = (reference.attention_bwd(dout[None, rows], *args, SCALE, causal, return_dbias=with_dbias, **kw),
               reference.naive_attention_bwd(dout[None, rows], *args, SCALE, causal, naive_dtype,
                                             return_dbias=with_dbias, **kw))
        for i in range(2):
            res["out"][i, rows], res["lse"][i, :, rows] = fwd[i][0][0], fwd[i][1][0]
            res["dq"][i, rows], res["dk"][i, keys], res["dv"][i, keys] = (g[0] for g in bwd[i][:3])
            if with_dbias:
                d = res["dbias"][i]
                d[b if d.shape[0] > 1 else 0, :, :n_q if d.shape[2] > 1 else 1,
                  :n_k if d.shape[3] > 1 else 1] += bwd[i][-1][0]
    if bias4 is not None:
        res["dbias"] = res["dbias"].reshape((2,) + attn_bias.shape)
    return {name: (pair[0], pair[1]) for name, pair in res.items()}


def _varlen_run(q, k, v, dout, args, causal, **variants):
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, softmax_scale=SCALE, causal=causal, **variants)
    grads = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *args, softmax_scale=SCALE, causal=causal,
                                            return_dbias=variants.get("attn_bias") is not None, **variants)
    return out, lse, grads


# name -> the bias's shape given (batch, nheads, max_seqlen_q, max_seqlen_k), and the mask's
VARLEN_SHAPES = {
    "full": (lambda b, h, m, n: (b, h, m, n), None),
    "shared": (lambda b, h, m, n: (m, n), None),
    "per-key": (lambda b, h, m, n: (b, 1, 1, n), None),
    "per-head-and-mask": (lambda b, h, m, n: (1, h, m, n), lambda b, h, m, n: (b, 1, m, n)),
    "mask-only": (None, lambda b, h, m, n: (b, h, m, n)),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(VARLEN_SHAPES))
def test_varlen_matches_reference_per_sequence(rng, name, causal, dtype):
    nheads, nheads_kv = 4, 2
    q, k, v = packed_inputs(rng, LENS_Q, LENS_K, nheads, nheads_kv, 16, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    max_q, max_k = max(LENS_Q) + 3, max(LENS_K) + 2  # larger than the longest: entries past them are not read
    args = (cu_seqlens(LENS_Q), cu_seqlens(LENS_K), max_q, max_k)
    full = (len(LENS_Q), nheads, max_q, max_k)
    bias_shape, mask_shape = VARLEN_SHAPES[name]
    variants = {}
    if bias_shape is not None:
        variants["attn_bias"] = _bias(rng, bias_shape(*full))
    if mask_shape is not None:
        variants["attn_mask"] = _mask(rng, mask_shape(*full))
    out, lse, grads = _varlen_run(q, k, v, dout, args, causal, **variants)
    results = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    if bias_shape is not None:
        assert grads[3].shape == variants["attn_bias"].shape and grads[3].dtype == np.float32
        results["dbias"] = grads[3]
    refs = _packed_reference(q, k, v, dout, LENS_Q, LENS_K, causal, **variants)
    for key, got in results.items():
        ref, naive = refs[key]
        factor = testing.OUT_FACTOR if key in ("out", "lse") else testing.GRAD_FACTOR
        floor = testing.REL_FLOOR * max(1.0, float(np.abs(ref[np.isfinite(ref)]).max(initial=0.0)))
        testing.assert_close_to_reference(key, got, ref, naive, factor, floor)
    if bias_shape is not None and len(variants["attn_bias"].shape) == 4 and variants["attn_bias"].shape[2] > 1:
        assert (grads[3][:, :, max(LENS_Q):] == 0).all()  # rows past every sequence: no gradient


def test_varlen_with_variants_matches_reference(rng):
    nheads = 4
    q, k, v = packed_inputs(rng, LENS_Q, LENS_K, nheads, 1, 16, "float16")
    dout = testing.random_normal(rng, q.shape, "float16")
    max_q, max_k = max(LENS_Q), max(LENS_K)
    args = (cu_seqlens(LENS_Q), cu_seqlens(LENS_K), max_q, max_k)
    variants = {"window_size": (11, 2), "softcap": 2.5, "sinks": _sinks(rng), "alibi_slopes": _alibi(rng, (4,)),
                "attn_bias": _bias(rng, (len(LENS_Q), 1, max_q, max_k), "float16"),
                "attn_mask": _mask(rng, (1, nheads, 1, max_k), 0.85)}
    out, lse, grads = _varlen_run(q, k, v, dout, args, True, **variants)
    refs = _packed_reference(q, k, v, dout, LENS_Q, LENS_K, True, **variants)
    dsinks_ref = np.zeros((2, nheads))
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    for b, (n_q, n_k) in enumerate(zip(LENS_Q, LENS_K)):  # dsinks, summed over the sequences
        if n_q and n_k:
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            kw = dict(variants, attn_bias=variants["attn_bias"][b:b + 1, :, :n_q, :n_k],
                      attn_mask=variants["attn_mask"][..., :n_k])
            dsinks_ref[0] += reference.attention_bwd(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                                     SCALE, True, **kw)[3]
            dsinks_ref[1] += reference.naive_attention_bwd(dout[None, rows], q[None, rows], k[None, keys],
                                                           v[None, keys], SCALE, True, np.float16, **kw)[3]
    refs["dsinks"] = (dsinks_ref[0], dsinks_ref[1])
    results = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2], dsinks=grads[3], dbias=grads[4])
    assert grads[4].dtype == np.float16 and grads[4].shape == variants["attn_bias"].shape
    for key, got in results.items():
        ref, naive = refs[key]
        factor = testing.OUT_FACTOR if key in ("out", "lse") else testing.GRAD_FACTOR
        floor = testing.REL_FLOOR * max(1.0, float(np.abs(ref[np.isfinite(ref)]).max(initial=0.0)))
        testing.assert_close_to_reference(key, got, ref, naive, factor, floor)


def test_varlen_equal_lengths_is_the_dense_batch(rng):
    batch, seqlen_q, seqlen_k, nheads = 3, 30, 26, 4
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, 2, 16, np.float32)
    dout = testing.random_normal(rng, q.shape, np.float32)
    variants = {"attn_bias": _bias(rng, (1, nheads, seqlen_q, seqlen_k)),
                "attn_mask": _mask(rng, (batch, 1, 1, seqlen_k), 0.8), "sinks": _sinks(rng)}
    out, lse, grads = _run(q, k, v, dout, True, **variants)

    def pack(x):
        return x.reshape(-1, *x.shape[2:])

    args = (cu_seqlens([seqlen_q] * batch), cu_seqlens([seqlen_k] * batch), seqlen_q, seqlen_k)
    p_out, p_lse, p_grads = _varlen_run(pack(q), pack(k), pack(v), pack(dout), args, True, **variants)
    np.testing.assert_allclose(p_out, pack(out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p_lse, lse.transpose(1, 0, 2).reshape(nheads, -1), rtol=1e-6, atol=1e-6)
    for got, want in zip(p_grads[:3], grads[:3]):
        np.testing.assert_allclose(got, pack(want), rtol=1e-5, atol=1e-5)
    for got, want in zip(p_grads[3:], grads[3:]):  # dsinks, dbias: summed over the sequences alike
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_varlen_nothing_to_compute(rng, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the CPU path ran")

    monkeypatch.setattr(cpu, "fwd", must_not_run)
    monkeypatch.setattr(cpu, "bwd", must_not_run)
    q, k, v = packed_inputs(rng, (3, 2), (0, 0), 4, 2, 8, np.float16)
    args = (cu_seqlens((3, 2)), cu_seqlens((0, 0)), 3, 0)
    bias = _bias(rng, (2, 4, 3, 1), "float16")
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, attn_bias=bias)
    assert (out == 0).all() and (lse == -np.inf).all()
    *grads, dbias = cupyflash.flash_attn_varlen_bwd(q, q, k, v, out, lse, *args, attn_bias=bias, return_dbias=True)
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype and (dbias == 0).all()


def test_dense_nothing_to_compute(rng, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the CPU path ran")

    monkeypatch.setattr(cpu, "fwd", must_not_run)
    monkeypatch.setattr(cpu, "bwd", must_not_run)
    q, k, v = testing.random_qkv(rng, 2, 5, 0, 4, 2, 8, np.float16)
    bias = _bias(rng, (4, 5, 1), "float16")
    out, lse = cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias, attn_mask=np.ones(1, bool))
    assert (out == 0).all() and (lse == -np.inf).all()
    dq, dk, dv, dbias = cupyflash.flash_attn_bwd(q, q, k, v, out, lse, attn_bias=bias, return_dbias=True)
    assert dbias.shape == bias.shape and dbias.dtype == np.float16 and (dbias == 0).all()
    assert (dq == 0).all()


# ----------------------------------------------------------------------------
# Memory: a broadcast bias is never expanded to (B, H, N, N)
# ----------------------------------------------------------------------------


def _extra_peak(fn, *args, **kwargs):
    """``(result, bytes)``: the peak traced memory of ``fn(...)`` above its start."""
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn(*args, **kwargs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak - start


def test_a_broadcast_bias_is_not_expanded(rng, monkeypatch):
    """NumPy reports its allocations to tracemalloc.  At B=2, H=8, N=1024 one float32
    (B, H, N, N) array is 67 MB (an (H, N, N) one 34 MB); the tiled path with a (N, N)
    bias, a stride-0 view of full shape and a (B, 1, 1, N) mask stays below a quarter
    of it (measured: 4 MB forward, 11 MB backward: its outputs, the (N, N) dbias and
    a few tiles)."""
    monkeypatch.setattr(cpu, "BLOCK_M", 128)
    monkeypatch.setattr(cpu, "BLOCK_N", 128)
    batch, seqlen, nheads, head_dim = 2, 1024, 8, 16
    q, k, v = testing.random_qkv(rng, batch, seqlen, seqlen, nheads, nheads, head_dim, np.float32)
    dout = testing.random_normal(rng, q.shape, np.float32)
    dense = batch * nheads * seqlen * seqlen * 4
    limit = dense / 4
    bias = _bias(rng, (seqlen, seqlen))
    mask = _mask(rng, (batch, 1, 1, seqlen), 0.9)
    kw = dict(softmax_scale=SCALE, causal=True, attn_bias=bias, attn_mask=mask)
    (out, lse), fwd_bytes = _extra_peak(cupyflash.flash_attn_fwd, q, k, v, **kw)
    assert fwd_bytes >= out.nbytes  # tracemalloc does see NumPy's allocations
    grads, bwd_bytes = _extra_peak(cupyflash.flash_attn_bwd, dout, q, k, v, out, lse, return_dbias=True, **kw)
    assert bwd_bytes >= sum(g.nbytes for g in grads)
    assert grads[-1].shape == bias.shape
    view = np.broadcast_to(bias, (batch, nheads, seqlen, seqlen))  # stride 0: 4 MB of memory, 67 MB of shape
    _, view_bytes = _extra_peak(cupyflash.flash_attn_fwd, q, k, v, **dict(kw, attn_bias=view))
    for what, used in (("forward", fwd_bytes), ("backward", bwd_bytes), ("forward, stride-0 view", view_bytes)):
        assert used < limit, f"{what}: peak {used / 1e6:.1f} MB (one (B, H, N, N) array: {dense / 1e6:.0f} MB)"
