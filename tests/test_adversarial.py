"""Adversarial inputs on the CPU path: what a careless or hostile caller passes.

Each bug found by poking the public API with awkward shapes, scalars and arrays
has its regression test here; a few neighbouring cases that already behaved
are pinned down too (fully-masked rows, NaN inputs, odd strides).
"""

from __future__ import annotations

import fractions
import re
import warnings

import numpy as np
import pytest

import cupyflash
from cupyflash import reference

BATCHED = ("flash_attn_fwd", "flash_attn", "flash_attn_bwd")
VARLEN = ("flash_attn_varlen_fwd", "flash_attn_varlen", "flash_attn_varlen_bwd")


def _batched_args(dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 8)).astype(dtype)
    k = rng.standard_normal((2, 7, 2, 8)).astype(dtype)
    v = rng.standard_normal((2, 7, 2, 8)).astype(dtype)
    return dict(dout=q.copy(), q=q, k=k, v=v, out=q.copy(),
                lse=np.zeros((2, 4, 5), dtype=np.float32))


def _varlen_args(dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 4, 8)).astype(dtype)
    k = rng.standard_normal((8, 2, 8)).astype(dtype)
    v = rng.standard_normal((8, 2, 8)).astype(dtype)
    cu = np.array([0, 3, 3, 8], dtype=np.int32)
    return dict(dout=q.copy(), q=q, k=k, v=v, out=q.copy(),
                lse=np.zeros((4, 8), dtype=np.float32), cu_seqlens_q=cu, cu_seqlens_k=cu.copy(),
                max_seqlen_q=5, max_seqlen_k=5)


def _call(fn_name, a, **kwargs):
    fn = getattr(cupyflash, fn_name)
    names = ["q", "k", "v"]
    if fn_name.endswith("bwd"):
        names = ["dout", "q", "k", "v", "out", "lse"]
    if "varlen" in fn_name:
        names += ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    return fn(*(a[n] for n in names), **kwargs)


def _args_for(fn_name, dtype=np.float32):
    return _varlen_args(dtype) if "varlen" in fn_name else _batched_args(dtype)


def _message(fn_name, arg):
    return rf"^cupyflash\.{fn_name}: {arg} "


# ----------------------------------------------------------------------------
# softmax_scale that does not fit the float32 arithmetic
# ----------------------------------------------------------------------------

# Before: 10**400 raised a bare OverflowError from float(); 1e39 / 1e300 (whose
# softmax_scale * log2(e) overflows float32) and 1e-300 / 5e-324 (which round
# to 0 in float32) returned an all-NaN output without a word.
BAD_SCALES = [
    ("int-too-large-for-float", 10**400, "finite and > 0; got a int too large for a float."),
    ("fraction-too-large", fractions.Fraction(10**400, 3), "finite and > 0"),
    ("negative-int-too-large", -(10**400), "finite and > 0"),
    ("1e39", 1e39, r"between 1\.4e-45 and 2\.36e\+38 .*; got 1e\+39\."),
    ("1e300", 1e300, r"between .*; got 1e\+300\."),
    ("np.float64-1e300", np.float64(1e300), r"between .*; got 1e\+300\."),
    ("1e-300", 1e-300, r"between .*; got 1e-300\."),
    ("5e-324", 5e-324, r"between .*; got 5e-324\."),
]


@pytest.mark.parametrize("fn_name", BATCHED + VARLEN)
@pytest.mark.parametrize("value,text", [pytest.param(v, t, id=i) for i, v, t in BAD_SCALES])
def test_softmax_scale_outside_float32_is_rejected(fn_name, value, text):
    with pytest.raises(ValueError, match=_message(fn_name, "softmax_scale") + "must be " + text):
        _call(fn_name, _args_for(fn_name), softmax_scale=value)


@pytest.mark.parametrize("scale", [1e4, 1e-30, 2.0**-149, np.float32(0.25), np.int64(2),
                                   fractions.Fraction(1, 3), np.float16(0.5)],
                         ids=["1e4", "1e-30", "min-subnormal", "np.float32", "np.int64",
                              "Fraction", "np.float16"])
def test_extreme_but_representable_scales_match_the_reference(scale):
    a = _batched_args()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow / invalid-value warnings either
        out, lse = cupyflash.flash_attn_fwd(a["q"], a["k"], a["v"], softmax_scale=scale,
                                            causal=True)
    ref_out, ref_lse = reference.attention_fwd(a["q"], a["k"], a["v"], softmax_scale=scale,
                                               causal=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    finite = np.isfinite(ref_lse)
    assert (lse[~finite] == -np.inf).all()
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# Varlen backward with no heads at all
# ----------------------------------------------------------------------------

# Before: ZeroDivisionError from cpu.bwd (nheads // nheads_kv with nheads_kv 0);
# the forward and the batched backward return empty results.
@pytest.mark.parametrize("nheads_q,nheads_kv", [(0, 0), (0, 2)])
def test_varlen_bwd_with_zero_heads_gives_empty_results(nheads_q, nheads_kv):
    cu = np.array([0, 2, 5], dtype=np.int32)
    q = np.zeros((5, nheads_q, 8), np.float32)
    k = np.ones((5, nheads_kv, 8), np.float32)
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, k, cu, cu, 3, 3)
    dq, dk, dv = cupyflash.flash_attn_varlen_bwd(out, q, k, k, out, lse, cu, cu, 3, 3,
                                                 causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    assert not dk.any() and not dv.any()


# ----------------------------------------------------------------------------
# The float64 reference on empty inputs (the documented contract: empty in,
# empty out; seqlen_k == 0 gives out 0, lse -inf)
# ----------------------------------------------------------------------------

EMPTY_SHAPES = [
    ("seqlen_k-0", (2, 5, 4, 8), (2, 0, 2, 8)),
    ("seqlen_q-and-k-0", (2, 0, 4, 8), (2, 0, 2, 8)),
    ("nheads-0", (2, 5, 0, 8), (2, 7, 0, 8)),
]
REFERENCE_FNS = ("attention_fwd", "attention_bwd", "naive_attention", "naive_attention_bwd")


# Before: scipy's softmax raised "zero-size array to reduction operation maximum"
# for seqlen_k 0, and _heads_first divided by zero for nheads_kv 0.
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fn_name", REFERENCE_FNS)
@pytest.mark.parametrize("q_shape,kv_shape", [pytest.param(q, k, id=i) for i, q, k in EMPTY_SHAPES])
def test_reference_handles_empty_inputs_like_the_cpu_path(fn_name, q_shape, kv_shape, causal):
    q = np.ones(q_shape, np.float32)
    k = np.ones(kv_shape, np.float32)
    fn = getattr(reference, fn_name)
    args = (q, q, k, k) if fn_name.endswith("bwd") else (q, k, k)
    got = fn(*args, causal=causal)
    if fn_name.endswith("bwd"):
        expected = cupyflash.flash_attn_bwd(q, q, k, k, q, np.full((q_shape[0], q_shape[2],
                                            q_shape[1]), -np.inf, np.float32), causal=causal)
    else:
        expected = cupyflash.flash_attn_fwd(q, k, k, causal=causal)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(e, np.float64))


# ----------------------------------------------------------------------------
# Non-native byte order: the messages said "float32 ...; got float32."
# ----------------------------------------------------------------------------

def _swapped(x):
    return x.astype(x.dtype.newbyteorder())


BYTE_ORDER_CASES = [
    ("flash_attn_fwd", "k", "must have the same dtype as q \\(float32\\); got big-endian "
     "float32\\."),
    ("flash_attn", "v", "must have the same dtype as q \\(float32\\); got big-endian float32\\."),
    ("flash_attn_bwd", "dout", "must have the same dtype as q \\(float32\\); got big-endian "
     "float32\\."),
    ("flash_attn_bwd", "out", "must have the same dtype as q \\(float32\\); got big-endian "
     "float32\\."),
    ("flash_attn_bwd", "lse", "must have dtype float32; got big-endian float32\\."),
    ("flash_attn_varlen_fwd", "k", "must have the same dtype as q \\(float32\\); got big-endian "
     "float32\\."),
    ("flash_attn_varlen_bwd", "lse", "must have dtype float32; got big-endian float32\\."),
    ("flash_attn_varlen_fwd", "cu_seqlens_q", "must have dtype int32; got big-endian int32\\."),
    ("flash_attn_varlen", "cu_seqlens_k", "must have dtype int32; got big-endian int32\\."),
]


@pytest.mark.skipif(np.little_endian is False, reason="big-endian host")
@pytest.mark.parametrize("fn_name,arg,text", [pytest.param(*c, id=f"{c[0]}-{c[1]}")
                                              for c in BYTE_ORDER_CASES])
def test_non_native_byte_order_is_named_in_the_message(fn_name, arg, text):
    a = _args_for(fn_name)
    a[arg] = _swapped(a[arg])
    with pytest.raises(TypeError, match=_message(fn_name, arg) + text):
        _call(fn_name, a)


def test_q_k_v_all_in_non_native_byte_order_still_compute():
    a = _batched_args()
    q, k, v = (_swapped(a[n]) for n in ("q", "k", "v"))
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    ref_out, _ = reference.attention_fwd(a["q"], a["k"], a["v"], causal=True)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)


# ----------------------------------------------------------------------------
# Masked arrays: the mask was silently ignored
# ----------------------------------------------------------------------------

MASKED_CASES = [(fn, arg) for fn in BATCHED for arg in ("q", "k", "v")]
MASKED_CASES += [("flash_attn_bwd", arg) for arg in ("dout", "out", "lse")]
MASKED_CASES += [(fn, arg) for fn in VARLEN for arg in ("q", "k")]
MASKED_CASES += [("flash_attn_varlen_bwd", "lse"), ("flash_attn_varlen_fwd", "cu_seqlens_q")]


@pytest.mark.parametrize("fn_name,arg",
                         [pytest.param(f, a, id=f"{f}-{a}") for f, a in MASKED_CASES])
def test_masked_arrays_are_rejected(fn_name, arg):
    a = _args_for(fn_name)
    x = a[arg]
    a[arg] = np.ma.masked_array(x, mask=np.zeros(x.shape, bool))
    with pytest.raises(TypeError, match=_message(fn_name, arg) + re.escape(
            "must not be a numpy.ma.MaskedArray (its mask would be ignored)")):
        _call(fn_name, a)


# ----------------------------------------------------------------------------
# Cases that already behaved, pinned down
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 20), (129, 1), (1000, 129)])
def test_fully_masked_rows_get_exact_zero_gradients(seqlen_q, seqlen_k):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, seqlen_q, 6, 16)).astype(np.float16)
    k = rng.standard_normal((2, seqlen_k, 2, 16)).astype(np.float16)
    v = rng.standard_normal((2, seqlen_k, 2, 16)).astype(np.float16)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    dout = (100 * rng.standard_normal(out.shape)).astype(np.float16)
    dq, dk, dv = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True)
    hidden = seqlen_q - seqlen_k
    assert (out[:, :hidden] == 0).all() and (lse[:, :, :hidden] == -np.inf).all()
    assert (dq[:, :hidden] == 0).all()
    for x in (out, dq, dk, dv):
        assert np.isfinite(x).all()


def test_nan_input_propagates_without_crashing():
    a = _batched_args()
    q = a["q"].copy()
    q[0, 3, 1, 2] = np.nan
    with np.errstate(invalid="ignore"):
        out, lse = cupyflash.flash_attn_fwd(q, a["k"], a["v"])
        dq, dk, dv = cupyflash.flash_attn_bwd(a["dout"], q, a["k"], a["v"], out, lse)
        ref_out, _ = reference.attention_fwd(q, a["k"], a["v"])
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    assert np.isnan(dq[0, 3, 1]).all() and np.isnan(dk[0, :, 0]).all()


@pytest.mark.parametrize("view", ["reversed-seq", "reversed-batch-heads", "broadcast", "readonly"])
def test_odd_strides_match_the_reference(view):
    a = _batched_args()
    q, k, v = a["q"], a["k"], a["v"]
    if view == "reversed-seq":
        q, k, v = q[:, ::-1], k[:, ::-1], v[:, ::-1]
    elif view == "reversed-batch-heads":
        q, k = q[::-1, :, ::-1], k[::-1, :, ::-1]
    elif view == "broadcast":
        q, k = np.broadcast_to(q[:, :1], q.shape), np.broadcast_to(k[:1], k.shape)
    else:
        for x in (q, k, v):
            x.flags.writeable = False
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    ref_out, _ = reference.attention_fwd(q, k, v, causal=True)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    dq, dk, dv = cupyflash.flash_attn_bwd(np.ones_like(out), q, k, v, out, lse, causal=True)
    ref_grads = reference.attention_bwd(np.ones_like(out), q, k, v, causal=True)
    for g, r in zip((dq, dk, dv), ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-4)


@pytest.mark.parametrize("scale", [1e7, 1e9])
def test_huge_softmax_scale_gives_no_nan_on_the_cpu(rng, scale):
    """P = exp2(s*scale - lse) <= 1 exactly, but in float32 both terms carry rounding
    errors far above 1 at this scale; the CPU backward clamps the exponent at 0."""
    q = rng.standard_normal((1, 64, 2, 64)).astype(np.float32)
    out, lse = cupyflash.flash_attn_fwd(q, q, q, softmax_scale=scale)
    grads = cupyflash.flash_attn_bwd(np.ones_like(out), q, q, q, out, lse, softmax_scale=scale)
    for x in (out, lse, *grads):
        assert not np.isnan(x).any()


def test_testing_helpers_are_an_attribute_of_the_package():
    import subprocess
    import sys

    code = "import cupyflash; print(cupyflash.testing.GRAD_FACTOR)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "3.0"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("variant", [dict(), dict(alibi_slopes=np.full(4, 8.0, np.float32), causal=True),
                                     dict(sinks=np.full(4, -50.0, np.float32)), dict(dropout_p=0.3, rng_state=(1, 2))],
                         ids=["plain", "alibi-causal", "sinks", "dropout"])
def test_a_callers_seterr_raise_does_not_break_ordinary_inputs(dtype, variant):
    """Found by QA: under ``np.seterr(all="raise")`` / ``np.errstate(all="raise")`` (a usual
    way to hunt NaNs in one's own code) the CPU path raised FloatingPointError on ordinary
    finite inputs: exp2 of scores far below the row max, and the float16 / bfloat16 rounding
    of tiny gradients, underflow by design. Underflow is now ignored inside the CPU path
    (and parallel.merge_by_lse); overflow and invalid operations keep the caller's setting."""
    from cupyflash import parallel, testing

    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    with np.errstate(all="ignore"):
        q, k, v = testing.random_qkv(rng, 2, 40, 33, 4, 2, 32, dtype)
        q = (q.astype(np.float32) * 4).astype(q.dtype)  # sharp rows: most probabilities underflow
    with np.errstate(all="raise"):
        out, lse = cupyflash.flash_attn_fwd(q, k, v, **variant)
        grads = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, **variant)
        cu = np.array([0, 40], np.int32), np.array([0, 33], np.int32)
        cupyflash.flash_attn_varlen_fwd(q[0], k[0], v[0], *cu, 40, 33, **variant)
        half = [cupyflash.flash_attn_fwd(q, k[:, s], v[:, s]) for s in (slice(0, 16), slice(16, 33))]
        parallel.merge_by_lse(half[0][0].astype(np.float32), half[0][1], *half[1])
    assert all(np.isfinite(np.asarray(x, np.float64)).all() for x in (out, *grads))
