"""The float64 reference's variants (window, softcap, ALiBi, sinks, dropout).

The forward is checked against a per-row loop written from the definition in
issue 13, the backward against central finite differences of
``sum(out * dout)``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash import reference, testing

# ----------------------------------------------------------------------------
# An independent formulation: one row at a time, from the definition
# ----------------------------------------------------------------------------


def _loop_attention(q, k, v, scale, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_mask=None):
    """out (B, Sq, Hq, D), lse (B, Hq, Sq), float64, row by row."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    left, right = window_size
    if causal:
        right = 0
    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            hk = h // (nheads // nheads_kv)
            for i in range(seqlen_q):
                diag = i + seqlen_k - seqlen_q
                keys = [j for j in range(seqlen_k)
                        if (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)]
                logits = []
                for j in keys:
                    s = scale * float(q[b, i, h] @ k[b, j, hk])
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if alibi_slopes is not None:
                        slope = (alibi_slopes[h] if alibi_slopes.ndim == 1
                                 else alibi_slopes[b, h])
                        s -= float(slope) * abs(diag - j)
                    logits.append(s)
                terms = logits + ([float(sinks[h])] if sinks is not None else [])
                if not terms:
                    continue
                top = max(terms)
                lse[b, h, i] = top + math.log(sum(math.exp(t - top) for t in terms))
                for j, s in zip(keys, logits):
                    w = math.exp(s - lse[b, h, i])
                    if dropout_mask is not None:
                        w = w * dropout_mask[b, h, i, j] / (1.0 - dropout_p)
                    out[b, i, h] += w * v[b, j, hk]
    return out, lse


def _inputs(rng, batch, sq, sk, hq, hkv, d):
    q, k, v = testing.random_qkv(rng, batch, sq, sk, hq, hkv, d, "float64")
    return q, k, v, rng.standard_normal((batch, sq, hq, d))


# name -> (shape (batch, sq, sk, hq, hkv, d), keyword arguments given rng)
def _variant_cases():
    def alibi(rng, shape):
        return rng.uniform(0.05, 0.5, shape).astype(np.float32)

    def mask(rng, shape, p):
        return rng.random(shape) >= p

    return {
        "window": ((1, 4, 6, 2, 1, 3), lambda rng: {"window_size": (2, 1)}),
        "window_left_only": ((1, 5, 5, 2, 2, 2), lambda rng: {"window_size": (1, -1)}),
        "window_right_only": ((1, 4, 3, 1, 1, 3), lambda rng: {"window_size": (-1, 0)}),
        "softcap": ((2, 3, 4, 2, 1, 3), lambda rng: {"softcap": 1.5}),
        "alibi_heads": ((1, 3, 5, 2, 1, 3), lambda rng: {"alibi_slopes": alibi(rng, (2,))}),
        "alibi_batch_heads": ((2, 4, 3, 2, 2, 2),
                              lambda rng: {"alibi_slopes": alibi(rng, (2, 2))}),
        "sinks": ((2, 3, 4, 2, 1, 3), lambda rng: {"sinks": rng.standard_normal(2)}),
        "dropout": ((2, 3, 4, 2, 1, 3),
                    lambda rng: {"dropout_p": 0.3, "dropout_mask": mask(rng, (2, 2, 3, 4), 0.3)}),
        # combinations
        "window+causal+gqa": ((2, 5, 7, 4, 2, 3),
                              lambda rng: {"causal": True, "window_size": (2, 3)}),
        "softcap+alibi": ((1, 4, 5, 2, 1, 3),
                          lambda rng: {"softcap": 0.8, "alibi_slopes": alibi(rng, (1, 2))}),
        "sinks+window": ((1, 4, 4, 2, 2, 3),
                         lambda rng: {"window_size": (1, 0), "sinks": rng.standard_normal(2)}),
        "dropout+causal": ((1, 4, 5, 2, 1, 3),
                           lambda rng: {"causal": True, "dropout_p": 0.25,
                                        "dropout_mask": mask(rng, (1, 2, 4, 5), 0.25)}),
        "everything": ((2, 4, 5, 4, 2, 2),
                       lambda rng: {"causal": True, "window_size": (2, -1), "softcap": 2.0,
                                    "alibi_slopes": alibi(rng, (4,)),
                                    "sinks": rng.standard_normal(4), "dropout_p": 0.2,
                                    "dropout_mask": mask(rng, (2, 4, 4, 5), 0.2)}),
    }


CASES = _variant_cases()


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_definition(rng, name):
    shape, make = CASES[name]
    kwargs = make(rng)
    q, k, v, _ = _inputs(rng, *shape)
    out, lse = reference.attention_fwd(q, k, v, 0.6, **kwargs)
    causal = kwargs.pop("causal", False)
    out_loop, lse_loop = _loop_attention(q, k, v, 0.6, causal, **kwargs)
    np.testing.assert_allclose(out, out_loop, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_loop, rtol=1e-12, atol=1e-12)


def _fd_grad(loss, x, eps=1e-5):
    """Central differences of the scalar ``loss()`` with respect to every element of x."""
    grad = np.zeros(x.shape)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for n in range(flat.size):
        keep = flat[n]
        flat[n] = keep + eps
        up = loss()
        flat[n] = keep - eps
        down = loss()
        flat[n] = keep
        gflat[n] = (up - down) / (2 * eps)
    return grad


def _assert_rel(actual, expected, tol=1e-6):
    scale = max(np.abs(expected).max(), 1e-300)
    err = np.abs(actual - expected).max() / scale
    assert err < tol, f"relative error {err:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_finite_differences(rng, name):
    shape, make = CASES[name]
    kwargs = make(rng)
    if "alibi_slopes" in kwargs:  # differentiate it too: a float64 copy to perturb
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].astype(np.float64)
    q, k, v, dout = _inputs(rng, *shape)

    def loss():
        return float((reference.attention_fwd(q, k, v, 0.6, **kwargs)[0] * dout).sum())

    grads = reference.attention_bwd(dout, q, k, v, 0.6, return_dalibi="alibi_slopes" in kwargs,
                                    **kwargs)
    wrt = [q, k, v]
    if "sinks" in kwargs:
        wrt.append(kwargs["sinks"])
    if "alibi_slopes" in kwargs:
        wrt.append(kwargs["alibi_slopes"])
    assert len(grads) == len(wrt)
    for grad, x in zip(grads, wrt):
        assert grad.shape == x.shape and grad.dtype == np.float64
        _assert_rel(grad, _fd_grad(loss, x))


def test_return_convention(rng):
    q, k, v, dout = _inputs(rng, 2, 3, 4, 4, 2, 3)
    assert len(reference.attention_bwd(dout, q, k, v)) == 3
    assert len(reference.attention_bwd(dout, q, k, v, softcap=1.0, window_size=(1, 1),
                                       alibi_slopes=np.ones(4, np.float32))) == 3
    dq, dk, dv, dsinks = reference.attention_bwd(dout, q, k, v, sinks=np.zeros(4, np.float32))
    assert dsinks.shape == (4,)
    *_, dalibi = reference.attention_bwd(dout, q, k, v, alibi_slopes=np.ones((2, 4)),
                                         return_dalibi=True)
    assert dalibi.shape == (2, 4)
    with pytest.raises(ValueError, match="alibi_slopes"):
        reference.attention_bwd(dout, q, k, v, return_dalibi=True)
    with pytest.raises(ValueError, match="dropout_mask"):
        reference.attention_fwd(q, k, v, dropout_p=0.1)


def test_defaults_are_the_plain_attention(rng):
    q, k, v, dout = _inputs(rng, 2, 4, 5, 4, 2, 3)
    for causal in (False, True):
        plain = reference.attention_fwd(q, k, v, 0.5, causal)
        off = reference.attention_fwd(q, k, v, 0.5, causal, window_size=(-1, -1), softcap=0.0,
                                      alibi_slopes=None, sinks=None, dropout_p=0.0,
                                      dropout_mask=None)
        for a, b in zip(plain, off):
            np.testing.assert_array_equal(a, b)
        # an all-keep mask with p = 0 changes nothing; a window as wide as the
        # sequence neither
        full = np.ones((2, 4, 4, 5), bool)
        for kwargs in ({"dropout_mask": full}, {"window_size": (10, 10)}):
            for a, b in zip(plain, reference.attention_fwd(q, k, v, 0.5, causal, **kwargs)):
                np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-14)
        grads = reference.attention_bwd(dout, q, k, v, 0.5, causal)
        for a, b in zip(grads, reference.attention_bwd(dout, q, k, v, 0.5, causal,
                                                       dropout_mask=full)):
            np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-14)


def test_window_mask_is_bottom_right_aligned():
    assert reference.visible_keys(3, 5, False, window_size=(1, 0)).astype(int).tolist() == [
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    # causal replaces right with 0
    assert (reference.visible_keys(3, 5, True, window_size=(1, 2))
            == reference.visible_keys(3, 5, False, window_size=(1, 0))).all()
    assert (reference.visible_keys(3, 5, True, window_size=(-1, -1))
            == reference.visible_keys(3, 5, True)).all()
    # seqlen_q > seqlen_k: the first rows see nothing
    assert reference.visible_keys(4, 2, False, window_size=(0, 0)).astype(int).tolist() == [
        [0, 0], [0, 0], [1, 0], [0, 1],
    ]


def test_alibi_and_softcap_order(rng):
    """softcap applies to q.k only; ALiBi is added after it (one key: lse = score)."""
    q, k, v, _ = _inputs(rng, 1, 2, 1, 1, 1, 2)
    raw = 0.5 * float(q[0, 1, 0] @ k[0, 0, 0])
    _, lse = reference.attention_fwd(q, k, v, 0.5, softcap=0.3,
                                     alibi_slopes=np.array([0.25], np.float32))
    # query 1 is on the diagonal of key 0 (distance 0), query 0 at distance 1
    assert lse[0, 0, 1] == pytest.approx(0.3 * math.tanh(raw / 0.3), rel=1e-14)
    raw0 = 0.5 * float(q[0, 0, 0] @ k[0, 0, 0])
    assert lse[0, 0, 0] == pytest.approx(0.3 * math.tanh(raw0 / 0.3) - 0.25, rel=1e-14)


def test_dropout_keeps_the_undropped_lse(rng):
    q, k, v, _ = _inputs(rng, 1, 3, 4, 2, 1, 3)
    mask = rng.random((1, 2, 3, 4)) >= 0.5
    out, lse = reference.attention_fwd(q, k, v, dropout_p=0.5, dropout_mask=mask)
    out0, lse0 = reference.attention_fwd(q, k, v)
    np.testing.assert_array_equal(lse, lse0)
    assert not np.allclose(out, out0)
    # nothing kept: out 0
    out, _ = reference.attention_fwd(q, k, v, dropout_p=0.5, dropout_mask=np.zeros_like(mask))
    assert (out == 0).all()


def test_sinks_lower_the_weights_and_fill_empty_rows(rng):
    q, k, v, dout = _inputs(rng, 1, 5, 2, 2, 1, 3)  # causal: rows 0..2 see no key
    sinks = np.array([0.5, -1.0], np.float32)
    out, lse = reference.attention_fwd(q, k, v, causal=True, sinks=sinks)
    assert (out[:, :3] == 0).all()
    np.testing.assert_array_equal(lse[:, :, :3], np.broadcast_to(sinks[None, :, None], (1, 2, 3)))
    _, lse_plain = reference.attention_fwd(q, k, v, causal=True)
    np.testing.assert_allclose(lse[:, :, 3:], np.logaddexp(lse_plain[:, :, 3:],
                                                           sinks[None, :, None]), rtol=1e-14)
    dq, dk, dv, dsinks = reference.attention_bwd(dout, q, k, v, causal=True, sinks=sinks)
    assert (dq[:, :3] == 0).all()
    assert all(np.isfinite(g).all() for g in (dq, dk, dv, dsinks))


@pytest.mark.parametrize("kwargs", [
    {"window_size": (0, 0)},
    {"window_size": (0, 0), "softcap": 1.0, "alibi_slopes": np.array([0.3, 0.1])},
    {"causal": True, "window_size": (1, -1), "sinks": np.array([0.0, 2.0])},
    {"causal": True, "dropout_p": 0.5, "dropout_mask": np.ones((1, 2, 5, 2), bool)},
], ids=["window", "window+softcap+alibi", "causal+window+sinks", "causal+dropout"])
def test_masked_rows_give_no_nan(rng, kwargs):
    """seqlen_q 5 > seqlen_k 2: the first three rows see no key."""
    q, k, v, dout = _inputs(rng, 1, 5, 2, 2, 1, 3)
    out, lse = reference.attention_fwd(q, k, v, **kwargs)
    assert np.isfinite(out).all() and (out[:, :3] == 0).all()
    assert not np.isnan(lse).any()
    if "sinks" not in kwargs:
        assert (lse[:, :, :3] == -np.inf).all()
    grads = reference.attention_bwd(dout, q, k, v, **kwargs)
    assert all(np.isfinite(g).all() for g in grads)
    assert (grads[0][:, :3] == 0).all()


# ----------------------------------------------------------------------------
# The naive implementation's variants: in float64 they are the reference; in a
# low precision they round (their error sets the tolerance of the fast paths)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_naive_in_float64_is_the_reference(rng, name):
    shape, make = CASES[name]
    kwargs = make(rng)
    causal = kwargs.pop("causal", False)
    q, k, v, dout = _inputs(rng, *shape)
    want = reference.attention_fwd(q, k, v, 0.6, causal, **kwargs)
    got = reference.naive_attention(q, k, v, 0.6, causal, np.float64, **kwargs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    want = reference.attention_bwd(dout, q, k, v, 0.6, causal, **kwargs)
    got = reference.naive_attention_bwd(dout, q, k, v, 0.6, causal, np.float64, **kwargs)
    assert len(got) == len(want) == (4 if "sinks" in kwargs else 3)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["softcap+alibi", "sinks+window", "everything"])
def test_naive_in_float16_rounds_but_stays_close(rng, name):
    """float16 results: near the reference, not equal to it, in float16."""
    shape, make = CASES[name]
    kwargs = make(rng)
    causal = kwargs.pop("causal", False)
    q, k, v, dout = _inputs(rng, *shape)
    want = reference.attention_fwd(q, k, v, 0.6, causal, **kwargs)[0]
    got = reference.naive_attention(q, k, v, 0.6, causal, np.float16, **kwargs)[0]
    assert got.dtype == np.float16 and 0 < np.abs(got - want).max() < 2e-2
    grads = reference.naive_attention_bwd(dout, q, k, v, 0.6, causal, np.float16, **kwargs)
    refs = reference.attention_bwd(dout, q, k, v, 0.6, causal, **kwargs)
    for g, r in zip(grads, refs):
        assert g.dtype == np.float16 and np.abs(g - r).max() < 5e-2 * max(1.0, np.abs(r).max())


def test_naive_without_variants_is_unchanged(rng):
    """The variants' keywords given off are bitwise the defaults."""
    q, k, v, dout = _inputs(rng, 2, 9, 11, 4, 2, 8)
    off = dict(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
               dropout_mask=None)
    for dtype in (np.float16, np.float32):
        for a, b in zip(reference.naive_attention(q, k, v, None, True, dtype),
                        reference.naive_attention(q, k, v, None, True, dtype, **off)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(reference.naive_attention_bwd(dout, q, k, v, None, True, dtype),
                        reference.naive_attention_bwd(dout, q, k, v, None, True, dtype, **off)):
            np.testing.assert_array_equal(a, b)


def test_a_minus_inf_sink_on_a_row_that_sees_no_key(rng):
    """No key and a -inf sink (no sink): out 0 and lse -inf, not NaN; the naive one too."""
    q, k, v, dout = _inputs(rng, 1, 5, 2, 2, 1, 3)
    sinks = np.array([-np.inf, 0.5])
    out, lse = reference.attention_fwd(q, k, v, causal=True, sinks=sinks)
    assert not np.isnan(out).any() and (out[:, :3] == 0).all()
    np.testing.assert_array_equal(lse[0, :, :3], [[-np.inf] * 3, [0.5] * 3])
    grads = reference.attention_bwd(dout, q, k, v, causal=True, sinks=sinks)
    assert all(np.isfinite(g).all() for g in grads)
    naive_out, naive_lse = reference.naive_attention(q, k, v, None, True, np.float16, sinks=sinks)
    assert not np.isnan(naive_out.astype(np.float32)).any() and (naive_lse[0, 0, :3] == -np.inf).all()
    assert all(np.isfinite(g.astype(np.float32)).all()
               for g in reference.naive_attention_bwd(dout, q, k, v, None, True, np.float16, sinks=sinks))
