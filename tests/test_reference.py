"""The references themselves, and the tolerance helpers in cupyflash.testing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash import reference, testing

# ----------------------------------------------------------------------------
# The float64 reference against a loop written from the definition
# ----------------------------------------------------------------------------


def _loop_attention(q, k, v, scale, causal):
    """Per-row attention from the definition: out, lse (float64)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            hk = h // (nheads // nheads_kv)
            for i in range(seqlen_q):
                keys = [j for j in range(seqlen_k) if not causal or j <= i + seqlen_k - seqlen_q]
                if not keys:
                    continue
                s = np.array([scale * q[b, i, h] @ k[b, j, hk] for j in keys])
                lse[b, h, i] = math.log(np.exp(s).sum())
                w = np.exp(s - lse[b, h, i])
                out[b, i, h] = sum(wj * v[b, j, hk] for wj, j in zip(w, keys))
    return out, lse


SHAPES = [  # batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim
    (1, 3, 4, 2, 1, 3),
    (2, 4, 3, 4, 2, 2),
    (1, 5, 2, 3, 3, 4),  # causal: rows 0..2 see no key
    (1, 1, 6, 2, 2, 5),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_forward_matches_definition(rng, shape, causal):
    batch, sq, sk, hq, hkv, d = shape
    q, k, v = testing.random_qkv(rng, batch, sq, sk, hq, hkv, d, "float64")
    out, lse = reference.attention_fwd(q, k, v, 0.7, causal)
    out_loop, lse_loop = _loop_attention(q, k, v, 0.7, causal)
    np.testing.assert_allclose(out, out_loop, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_loop, rtol=1e-12, atol=1e-12)


def test_visible_keys_is_bottom_right_aligned():
    assert reference.visible_keys(2, 5, True).astype(int).tolist() == [
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]
    assert reference.visible_keys(5, 2, True).astype(int).tolist() == [
        [0, 0], [0, 0], [0, 0], [1, 0], [1, 1],
    ]
    assert reference.visible_keys(3, 4, False).all()


# ----------------------------------------------------------------------------
# Backward against central finite differences
# ----------------------------------------------------------------------------


def _finite_difference_grads(dout, q, k, v, scale, causal, eps=1e-6):
    """d/dx of sum(dout * out) by central differences, for x in q, k, v."""
    def loss(q_, k_, v_):
        return float((dout * reference.attention_fwd(q_, k_, v_, scale, causal)[0]).sum())

    grads = []
    for which in range(3):
        args = [q.copy(), k.copy(), v.copy()]
        x = args[which]
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            plus = loss(*args)
            x[idx] = orig - eps
            minus = loss(*args)
            x[idx] = orig
            g[idx] = (plus - minus) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("which", ["attention_bwd", "naive_attention_bwd"])
def test_backward_matches_finite_differences(rng, shape, causal, which):
    batch, sq, sk, hq, hkv, d = shape
    q, k, v = testing.random_qkv(rng, batch, sq, sk, hq, hkv, d, "float64")
    dout = rng.standard_normal(q.shape)
    if which == "attention_bwd":
        grads = reference.attention_bwd(dout, q, k, v, 0.8, causal)
    else:  # the naive backward, run in float64, rounds nothing
        grads = reference.naive_attention_bwd(dout, q, k, v, 0.8, causal, np.float64)
    expected = _finite_difference_grads(dout, q, k, v, 0.8, causal)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8, err_msg=name)


def test_empty_rows_have_zero_output_and_gradients(rng):
    q, k, v = testing.random_qkv(rng, 1, 5, 2, 2, 1, 4, "float64")
    out, lse = reference.attention_fwd(q, k, v, None, True)
    dq, dk, dv = reference.attention_bwd(np.ones_like(q), q, k, v, None, True)
    assert (out[:, :3] == 0).all() and (lse[:, :, :3] == -np.inf).all() and (dq[:, :3] == 0).all()
    for x in (out, dq, dk, dv):
        assert np.isfinite(x).all()


# ----------------------------------------------------------------------------
# The naive low-precision version
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_naive_rounds_to_its_dtype(rng, dtype):
    pytest.importorskip("ml_dtypes")
    q, k, v = testing.random_qkv(rng, 1, 30, 40, 2, 1, 16, "float32")
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = reference.naive_attention(q, k, v, None, True, dtype)
    grads = reference.naive_attention_bwd(dout, q, k, v, None, True, dtype)
    want = testing.resolve_dtype(dtype)
    assert out.dtype == lse.dtype == want and all(g.dtype == want for g in grads)
    ref_out, _ = reference.attention_fwd(q, k, v, None, True)
    err = np.abs(out.astype(np.float64) - ref_out).max()
    eps = float(np.finfo(want).eps) if want != testing.resolve_dtype("bfloat16") else 2.0**-7
    assert 0 < err < 50 * eps  # rounding shows, and stays rounding-sized


def test_naive_in_float64_is_the_reference(rng):
    q, k, v = testing.random_qkv(rng, 2, 20, 30, 4, 2, 8, "float64")
    dout = rng.standard_normal(q.shape)
    for got, want in zip(reference.naive_attention(q, k, v, 0.4, True, np.float64),
                         reference.attention_fwd(q, k, v, 0.4, True)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for got, want in zip(reference.naive_attention_bwd(dout, q, k, v, 0.4, True, np.float64),
                         reference.attention_bwd(dout, q, k, v, 0.4, True)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


class _DeviceArray:
    """Stands in for a cupy array: only ``.get()`` is needed."""

    def __init__(self, host):
        self._host = host

    def get(self):
        return self._host


def test_reference_accepts_arrays_with_get(rng):
    q, k, v = testing.random_qkv(rng, 1, 6, 7, 2, 1, 4, "float16")
    got = reference.attention_fwd(_DeviceArray(q), _DeviceArray(k), _DeviceArray(v))
    want = reference.attention_fwd(q, k, v)
    np.testing.assert_array_equal(got[0], want[0])
    out, _ = reference.naive_attention(_DeviceArray(q), _DeviceArray(k), _DeviceArray(v))
    assert out.dtype == np.float16


# ----------------------------------------------------------------------------
# cupyflash.testing
# ----------------------------------------------------------------------------


def test_close_passes_within_the_bound():
    ref = np.array([1.0, 2.0, -np.inf])
    err = testing.assert_close_to_reference("x", np.array([1.1, 2.0, -np.inf]), ref,
                                            np.array([1.06, 2.0, -np.inf]), 2, 0)
    assert err == pytest.approx(0.1)


@pytest.mark.parametrize("actual,expected_text", [
    ([1.2, 2.0, -np.inf], "exceeds 2 x naive max error"),
    ([np.nan, 2.0, -np.inf], "NaN"),
    ([1.0, 2.0, 0.0], "must be -inf"),
    ([1.0, np.inf, -np.inf], "the reference is finite"),
    ([1.0, 2.0], "shape"),
], ids=["over-bound", "nan", "not-inf", "inf", "shape"])
def test_close_fails(actual, expected_text):
    ref = np.array([1.0, 2.0, -np.inf])
    naive = np.array([1.05, 2.0, -np.inf])
    with pytest.raises(AssertionError, match=expected_text) as info:
        testing.assert_close_to_reference("out", np.array(actual), ref, naive, 2, 0)
    assert str(info.value).startswith("out: ")


def test_close_failure_reports_max_and_mean_of_both():
    with pytest.raises(AssertionError) as info:
        testing.assert_close_to_reference("dq", np.array([0.0, 1.0]), np.zeros(2),
                                          np.array([0.0, 0.1]), 3, 1e-5)
    message = str(info.value)
    assert "max error 1.000e+00 (mean 5.000e-01)" in message
    assert "naive max error 1.000e-01 (mean 5.000e-02)" in message


def test_close_rejects_nan_in_reference_and_non_finite_naive():
    with pytest.raises(AssertionError, match="reference has NaN"):
        testing.assert_close_to_reference("x", np.zeros(2), np.array([0.0, np.nan]),
                                          np.zeros(2), 2, 0)
    with pytest.raises(ValueError, match="naive"):
        testing.assert_close_to_reference("x", np.zeros(2), np.zeros(2),
                                          np.array([0.0, np.inf]), 2, 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_random_qkv_and_poison(rng, dtype):
    pytest.importorskip("ml_dtypes")
    q, k, v = testing.random_qkv(rng, 2, 3, 5, 4, 2, 8, dtype)
    assert q.shape == (2, 3, 4, 8) and k.shape == v.shape == (2, 5, 2, 8)
    assert q.dtype == k.dtype == v.dtype == testing.resolve_dtype(dtype)
    for x in (q, k, v):
        assert (x.astype(np.float32) != 0).mean() > 0.9  # fresh values, not zeros
    q2, _, _ = testing.random_qkv(rng, 2, 3, 5, 4, 2, 8, dtype)
    assert not np.array_equal(q, q2)
    bad = testing.poison((2, 3), dtype)
    assert bad.dtype == testing.resolve_dtype(dtype) and np.isnan(bad.astype(np.float32)).all()


def test_naive_dtype_for_float64_is_float32():
    assert testing.naive_dtype(np.float64) == np.float32
    assert testing.naive_dtype("float16") == np.float16


@pytest.mark.parametrize("fn", ["attention_fwd", "naive_attention", "attention_bwd", "naive_attention_bwd",
                                "attention_probs"])
@pytest.mark.parametrize("q_shape,k_shape,v_shape,message", [
    ((2, 8, 2, 8), (1, 8, 2, 8), (1, 8, 2, 8), r"k must have q's batch \(2\) and head_dim \(8\); got shape"),
    ((1, 8, 4, 8), (1, 8, 3, 8), (1, 8, 3, 8), r"k must have a number of heads that divides q's \(4\); got 3"),
    ((1, 8, 2, 8), (1, 8, 4, 8), (1, 8, 4, 8), r"k must have a number of heads that divides q's \(2\); got 4"),
    ((1, 8, 2, 8), (1, 8, 2, 16), (1, 8, 2, 16), r"k must have q's batch \(1\) and head_dim \(8\)"),
    ((1, 8, 2, 8), (1, 8, 2, 8), (1, 9, 2, 8), r"v must have k's \(batch, seqlen, nheads\) \(1, 8, 2\); got shape \(1, 9, 2, 8\)"),
    ((8, 2, 8), (1, 8, 2, 8), (1, 8, 2, 8), r"q must have 4 dimensions"),
])
def test_reference_names_a_layout_mismatch(fn, q_shape, k_shape, v_shape, message):
    """Found by QA: the reference broadcast a k of batch 1 against a q of batch 2
    (a result where the fast paths refuse the call) and failed deep in numpy
    ("operands could not be broadcast together") for GQA heads that do not divide."""
    q, k, v = np.ones(q_shape), np.ones(k_shape), np.ones(v_shape)
    args = {"attention_fwd": (q, k, v), "naive_attention": (q, k, v), "attention_probs": (q, k),
            "attention_bwd": (q, q, k, v), "naive_attention_bwd": (q, q, k, v)}[fn]
    if fn == "attention_probs" and "v must" in message:
        pytest.skip("attention_probs takes no v")
    with pytest.raises(ValueError, match=f"cupyflash.reference.{fn}: {message}"):
        getattr(reference, fn)(*args)


def test_the_reference_and_the_rule_work_under_seterr_raise():
    """Found by QA: under ``np.errstate(all="raise")`` the float64 reference raised
    FloatingPointError (scipy's logsumexp underflowing on far-below-max scores), so
    ``testing.assert_*_matches_reference`` could not check an ALiBi call."""
    import cupyflash

    rng = np.random.default_rng(0)
    q, k, v = testing.random_qkv(rng, 2, 40, 33, 4, 2, 32, "float32")
    q = q * 10
    kw = dict(alibi_slopes=np.full(4, 30.0, np.float32), causal=True)
    with np.errstate(all="raise"):
        out, lse = cupyflash.flash_attn_fwd(q, k, v, **kw)
        testing.assert_fwd_matches_reference(q, k, v, out, lse, **kw)
        grads = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, **kw)
        testing.assert_bwd_matches_reference(out, q, k, v, *grads, **kw)
        reference.naive_attention(q, k, v, None, True, "float16", alibi_slopes=kw["alibi_slopes"])
