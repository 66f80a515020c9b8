"""The float64 reference's ``attn_bias`` / ``attn_mask`` (issue 14).

The forward is checked against a per-row loop written from the definition
(``s = softcap * tanh(scale * q.k / softcap) - alibi + bias``, hidden keys
left out), the backward (``dbias`` included, in the bias's own broadcast shape)
against central finite differences of ``sum(out * dout)``, and the naive
implementation against the reference in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash import reference, testing

# ----------------------------------------------------------------------------
# An independent formulation: one row at a time, from the definition
# ----------------------------------------------------------------------------


def _loop_attention(q, k, v, scale, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    sinks=None, dropout_p=0.0, dropout_mask=None, attn_bias=None, attn_mask=None):
    """out (B, Sq, Hq, D), lse (B, Hq, Sq), float64, row by row; the bias and the mask
    are read element by element at their broadcast indices."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    left, right = window_size
    if causal:
        right = 0

    def at(x, b, h, i, j):  # x[b, h, i, j] under NumPy broadcasting (rank <= 4)
        index = (b, h, i, j)[4 - x.ndim:]
        return x[tuple(0 if n == 1 else t for n, t in zip(x.shape, index))]

    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            hk = h // (nheads // nheads_kv)
            for i in range(seqlen_q):
                diag = i + seqlen_k - seqlen_q
                keys, logits = [], []
                for j in range(seqlen_k):
                    if (left >= 0 and j < diag - left) or (right >= 0 and j > diag + right):
                        continue
                    if attn_mask is not None and not at(attn_mask, b, h, i, j):
                        continue
                    s = scale * float(q[b, i, h] @ k[b, j, hk])
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if alibi_slopes is not None:
                        s -= float(alibi_slopes[h]) * abs(diag - j)
                    if attn_bias is not None:
                        s += float(at(attn_bias, b, h, i, j))
                    if s == -math.inf:
                        continue
                    keys.append(j)
                    logits.append(s)
                terms = logits + ([float(sinks[h])] if sinks is not None else [])
                if not terms or max(terms) == -math.inf:
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


SHAPE = (2, 4, 5, 4, 2, 3)  # (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim)


def _cases():
    """name -> keyword arguments given rng, for SHAPE."""

    def bias(rng, shape):
        return rng.standard_normal(shape)

    def mask(rng, shape, keep=0.7):
        return rng.random(shape) < keep

    return {
        "bias-full": lambda rng: {"attn_bias": bias(rng, (2, 4, 4, 5))},
        "bias-per-head": lambda rng: {"attn_bias": bias(rng, (1, 4, 4, 5))},
        "bias-per-batch": lambda rng: {"attn_bias": bias(rng, (2, 1, 4, 5))},
        "bias-per-key": lambda rng: {"attn_bias": bias(rng, (2, 1, 1, 5))},
        "bias-rank2": lambda rng: {"attn_bias": bias(rng, (4, 5))},
        "bias-rank3": lambda rng: {"attn_bias": bias(rng, (4, 1, 5))},
        "bias-rank1": lambda rng: {"attn_bias": bias(rng, (5,))},
        "bias-float32": lambda rng: {"attn_bias": bias(rng, (1, 4, 4, 5)).astype(np.float32)},
        "mask-full": lambda rng: {"attn_mask": mask(rng, (2, 4, 4, 5))},
        "mask-rank2": lambda rng: {"attn_mask": mask(rng, (4, 5))},
        "bias+mask": lambda rng: {"attn_bias": bias(rng, (2, 1, 4, 5)), "attn_mask": mask(rng, (1, 4, 1, 5))},
        "bias+causal+window": lambda rng: {"causal": True, "window_size": (2, -1),
                                           "attn_bias": bias(rng, (1, 4, 4, 5))},
        "bias+softcap+alibi": lambda rng: {"softcap": 0.8, "alibi_slopes": rng.uniform(0.1, 0.5, 4),
                                           "attn_bias": bias(rng, (2, 4, 4, 5))},
        "bias+sinks+mask": lambda rng: {"sinks": rng.standard_normal(4), "attn_bias": bias(rng, (4, 5)),
                                        "attn_mask": mask(rng, (2, 1, 4, 5))},
        "bias+dropout": lambda rng: {"dropout_p": 0.3, "dropout_mask": mask(rng, (2, 4, 4, 5), 0.7),
                                     "attn_bias": bias(rng, (2, 1, 1, 5))},
        "everything": lambda rng: {"causal": True, "window_size": (3, -1), "softcap": 2.0,
                                   "alibi_slopes": rng.uniform(0.1, 0.5, 4), "sinks": rng.standard_normal(4),
                                   "dropout_p": 0.2, "dropout_mask": mask(rng, (2, 4, 4, 5), 0.8),
                                   "attn_bias": bias(rng, (1, 4, 4, 5)), "attn_mask": mask(rng, (2, 1, 4, 5), 0.9)},
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_definition(rng, name):
    kwargs = CASES[name](rng)
    q, k, v, _ = _inputs(rng, *SHAPE)
    out, lse = reference.attention_fwd(q, k, v, 0.6, **kwargs)
    causal = kwargs.pop("causal", False)
    out_loop, lse_loop = _loop_attention(q, k, v, 0.6, causal, **kwargs)
    np.testing.assert_allclose(out, out_loop, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_loop, rtol=1e-12, atol=1e-12)


def test_minus_inf_bias_entries_and_rows_match_the_definition(rng):
    q, k, v, dout = _inputs(rng, *SHAPE)
    bias = rng.standard_normal((2, 4, 4, 5))
    bias[rng.random(bias.shape) < 0.3] = -np.inf
    bias[0, 2, 1] = -np.inf  # a row that sees no key
    mask = np.ones((4, 5), bool)
    mask[3] = False  # row 3 of every head and batch element: no key
    out, lse = reference.attention_fwd(q, k, v, 0.6, attn_bias=bias, attn_mask=mask)
    out_loop, lse_loop = _loop_attention(q, k, v, 0.6, attn_bias=bias, attn_mask=mask)
    np.testing.assert_allclose(out, out_loop, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_loop))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_loop[np.isfinite(lse_loop)], rtol=1e-12)
    assert (lse[0, 2, 1] == -np.inf) and (lse[:, :, 3] == -np.inf).all()
    assert (out[0, 1, 2] == 0).all() and (out[:, 3] == 0).all()
    dq, dk, dv, dbias = reference.attention_bwd(dout, q, k, v, 0.6, attn_bias=bias, attn_mask=mask,
                                                return_dbias=True)
    assert all(np.isfinite(g).all() for g in (dq, dk, dv, dbias))
    assert (dq[0, 1, 2] == 0).all() and (dq[:, 3] == 0).all()
    assert (dbias[np.isneginf(bias)] == 0).all() and (dbias[:, :, 3] == 0).all()


# ----------------------------------------------------------------------------
# Backward: finite differences, dbias in the bias's own shape
# ----------------------------------------------------------------------------


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


@pytest.mark.parametrize("name", [n for n in CASES if n != "bias-float32"])
def test_backward_matches_finite_differences(rng, name):
    """dq, dk, dv (dsinks) and dbias: perturbing the (broadcast) bias itself checks
    that dbias is summed over exactly the dimensions it broadcasts."""
    kwargs = CASES[name](rng)
    q, k, v, dout = _inputs(rng, *SHAPE)
    with_bias = "attn_bias" in kwargs

    def loss():
        return float((reference.attention_fwd(q, k, v, 0.6, **kwargs)[0] * dout).sum())

    grads = reference.attention_bwd(dout, q, k, v, 0.6, return_dbias=with_bias, **kwargs)
    wrt = [q, k, v]
    if "sinks" in kwargs:
        wrt.append(kwargs["sinks"])
    if with_bias:
        wrt.append(kwargs["attn_bias"])
    assert len(grads) == len(wrt)
    for grad, x in zip(grads, wrt):
        assert grad.shape == x.shape and grad.dtype == np.float64
        _assert_rel(grad, _fd_grad(loss, x))


def test_dbias_is_the_full_gradient_summed(rng):
    q, k, v, dout = _inputs(rng, *SHAPE)
    full = rng.standard_normal((2, 4, 4, 5))
    *_, dfull = reference.attention_bwd(dout, q, k, v, attn_bias=full, return_dbias=True, softcap=1.5)
    for shape, axes in (((1, 4, 4, 5), (0,)), ((2, 1, 1, 5), (1, 2)), ((4, 5), (0, 1)), ((5,), (0, 1, 2)),
                        ((4, 1), (0, 1, 3))):
        bias = full[(0,) * (4 - len(shape)) + tuple(slice(None) if n > 1 else slice(0, 1) for n in shape)]
        expanded = np.broadcast_to(bias, full.shape)
        *_, dbias = reference.attention_bwd(dout, q, k, v, attn_bias=bias, return_dbias=True, softcap=1.5)
        *_, dexp = reference.attention_bwd(dout, q, k, v, attn_bias=expanded.copy(), return_dbias=True,
                                           softcap=1.5)
        assert dbias.shape == bias.shape
        want = dexp.sum(axis=axes, keepdims=True).reshape(shape)
        np.testing.assert_allclose(dbias, want, rtol=1e-12, atol=1e-14)
    assert np.abs(dfull).max() > 0


def test_any_strides(rng):
    """A stride-0 view, a transposed slice and a reversed view give what their
    contiguous copies give."""
    q, k, v, dout = _inputs(rng, *SHAPE)
    big = rng.standard_normal((7, 6, 4, 2))
    views = [np.broadcast_to(rng.standard_normal(5), (2, 4, 4, 5)),
             big[1:6, 1:5, :, 1].transpose(2, 1, 0),
             rng.standard_normal((2, 4, 4, 5))[::-1, :, ::-1]]
    for bias in views:
        assert not bias.flags.c_contiguous
        got = reference.attention_bwd(dout, q, k, v, attn_bias=bias, return_dbias=True)
        want = reference.attention_bwd(dout, q, k, v, attn_bias=np.ascontiguousarray(bias), return_dbias=True)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        assert got[-1].shape == bias.shape


def test_return_convention(rng):
    q, k, v, dout = _inputs(rng, *SHAPE)
    bias = rng.standard_normal((4, 5))
    assert len(reference.attention_bwd(dout, q, k, v, attn_bias=bias)) == 3
    assert len(reference.attention_bwd(dout, q, k, v, attn_mask=np.ones(5, bool))) == 3
    dq, dk, dv, dsinks, dbias = reference.attention_bwd(dout, q, k, v, sinks=np.zeros(4), attn_bias=bias,
                                                        return_dbias=True)
    assert dsinks.shape == (4,) and dbias.shape == (4, 5)
    *_, dbias, dalibi = reference.attention_bwd(dout, q, k, v, alibi_slopes=np.ones(4), attn_bias=bias,
                                                return_dbias=True, return_dalibi=True)
    assert dbias.shape == (4, 5) and dalibi.shape == (4,)
    with pytest.raises(ValueError, match="attn_bias"):
        reference.attention_bwd(dout, q, k, v, return_dbias=True)
    with pytest.raises(ValueError, match="attn_bias"):
        reference.naive_attention_bwd(dout, q, k, v, return_dbias=True)
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        reference.attention_fwd(q, k, v, attn_mask=np.ones((4, 5), np.float32))
    with pytest.raises(ValueError):  # not broadcastable
        reference.attention_fwd(q, k, v, attn_bias=np.zeros((3, 5)))


def test_a_bias_shifts_the_logits(rng):
    """A per-row constant bias changes nothing (softmax is shift-invariant) but lse;
    a per-key bias equals the same shift of the keys' logits."""
    q, k, v, dout = _inputs(rng, *SHAPE)
    out0, lse0 = reference.attention_fwd(q, k, v)
    rows = rng.standard_normal((2, 4, 4, 1))
    out, lse = reference.attention_fwd(q, k, v, attn_bias=rows)
    np.testing.assert_allclose(out, out0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse0 + rows[..., 0], rtol=1e-12, atol=1e-12)
    *_, drows = reference.attention_bwd(dout, q, k, v, attn_bias=rows, return_dbias=True)
    np.testing.assert_allclose(drows, 0, atol=1e-12)  # the rows of dS sum to 0 without sinks
    # a large negative bias on one key is that key hidden
    bias = np.zeros(5)
    bias[2] = -1e4
    mask = np.arange(5) != 2
    for a, b in zip(reference.attention_fwd(q, k, v, attn_bias=bias), reference.attention_fwd(q, k, v,
                                                                                               attn_mask=mask)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------
# The naive implementation: in float64 the reference; in float16 it rounds
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_naive_in_float64_is_the_reference(rng, name):
    kwargs = CASES[name](rng)
    causal = kwargs.pop("causal", False)
    q, k, v, dout = _inputs(rng, *SHAPE)
    want = reference.attention_fwd(q, k, v, 0.6, causal, **kwargs)
    got = reference.naive_attention(q, k, v, 0.6, causal, np.float64, **kwargs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    with_bias = "attn_bias" in kwargs
    want = reference.attention_bwd(dout, q, k, v, 0.6, causal, return_dbias=with_bias, **kwargs)
    got = reference.naive_attention_bwd(dout, q, k, v, 0.6, causal, np.float64, return_dbias=with_bias, **kwargs)
    assert len(got) == len(want) == 3 + ("sinks" in kwargs) + with_bias
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["bias-per-head", "bias+sinks+mask", "everything"])
def test_naive_in_float16_rounds_but_stays_close(rng, name):
    kwargs = CASES[name](rng)
    causal = kwargs.pop("causal", False)
    kwargs["attn_bias"] = kwargs["attn_bias"].astype(np.float16)
    q, k, v, dout = _inputs(rng, *SHAPE)
    want = reference.attention_fwd(q, k, v, 0.6, causal, **kwargs)[0]
    got = reference.naive_attention(q, k, v, 0.6, causal, np.float16, **kwargs)[0]
    assert got.dtype == np.float16 and 0 < np.abs(got - want).max() < 2e-2
    grads = reference.naive_attention_bwd(dout, q, k, v, 0.6, causal, np.float16, return_dbias=True, **kwargs)
    refs = reference.attention_bwd(dout, q, k, v, 0.6, causal, return_dbias=True, **kwargs)
    assert grads[-1].shape == kwargs["attn_bias"].shape
    for g, r in zip(grads, refs):
        assert g.dtype == np.float16 and np.abs(g - r).max() < 5e-2 * max(1.0, np.abs(r).max())


def test_naive_with_minus_inf_rows_gives_no_nan(rng):
    q, k, v, dout = _inputs(rng, *SHAPE)
    bias = rng.standard_normal((1, 4, 4, 5))
    bias[0, 1, 2] = -np.inf
    mask = np.ones((2, 1, 4, 5), bool)
    mask[1, 0, 0] = False
    out, lse = reference.naive_attention(q, k, v, None, False, np.float16, attn_bias=bias, attn_mask=mask)
    assert not np.isnan(out.astype(np.float32)).any()
    assert lse[0, 1, 2] == -np.inf and (lse[1, :, 0] == -np.inf).all()
    grads = reference.naive_attention_bwd(dout, q, k, v, None, False, np.float16, attn_bias=bias, attn_mask=mask,
                                          return_dbias=True)
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads)


# ----------------------------------------------------------------------------
# attention_probs, and testing.given_out (dsinks and dbias for a returned out)
# ----------------------------------------------------------------------------


def test_attention_probs(rng):
    q, k, v, _ = _inputs(rng, *SHAPE)
    kwargs = CASES["everything"](rng)
    causal = kwargs.pop("causal")
    p = reference.attention_probs(q, k, 0.6, causal, **kwargs)
    assert p.shape == (2, 4, 4, 5)
    eye = np.broadcast_to(np.eye(5)[None, :, None, :], (2, 5, 2, 5))
    no_dropout = {name: x for name, x in kwargs.items() if not name.startswith("dropout")}
    out, _ = reference.attention_fwd(q, k, eye, 0.6, causal, **no_dropout)
    np.testing.assert_allclose(p, out.transpose(0, 2, 1, 3), rtol=1e-13, atol=1e-15)
    plain = reference.attention_probs(q, k, attn_bias=rng.standard_normal((4, 5)))
    np.testing.assert_allclose(plain.sum(axis=-1), 1.0, rtol=1e-13)


def test_given_out(rng):
    """With the exact out nothing changes; with another out, a per-row bias's dbias
    is the change of delta (its rows of P sum to 1), dsinks its P_sink-weighted sum."""
    q, k, v, dout = _inputs(rng, *SHAPE)
    bias = rng.standard_normal((2, 4, 4, 1))
    sinks = rng.standard_normal(4)
    refs = reference.attention_bwd(dout, q, k, v, attn_bias=bias, sinks=sinks, return_dbias=True)
    out, lse = reference.attention_fwd(q, k, v, attn_bias=bias, sinks=sinks)
    same = testing.given_out(refs, out, dout, q, k, v, attn_bias=bias, sinks=sinks)
    for a, b in zip(same, refs):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    other = out + 1e-3 * rng.standard_normal(out.shape)
    got = testing.given_out(refs, other, dout, q, k, v, attn_bias=bias, sinks=sinks)
    for a, b in zip(got[:3], refs[:3]):
        np.testing.assert_array_equal(a, b)
    change = ((dout * out).sum(-1) - (dout * other).sum(-1)).transpose(0, 2, 1)  # (B, H, Sq)
    p_sink = np.exp(sinks[None, :, None] - lse)
    np.testing.assert_allclose(got[3], refs[3] + (p_sink * change).sum(axis=(0, 2)), rtol=1e-12)
    np.testing.assert_allclose(got[4][..., 0], refs[4][..., 0] + (1 - p_sink) * change, rtol=1e-10, atol=1e-14)
