"""cupyflash.jax.flash_attention with ``attn_bias`` / ``attn_mask`` (issue 14), on JAX's CPU backend.

The CPU backend runs the variant callbacks on NumPy views of XLA's buffers, so
the whole custom_vjp is exercised here: the value and ``jax.grad`` with
respect to q, k, v and the bias against the float64 reference (cupyflash.testing's
rule), for every broadcast shape, bool masks, ``-inf`` entries and fully masked
rows, with causal and GQA, eagerly and under ``jax.jit``; the bias's cotangent
is the core backward's dbias bit for bit and is computed only when the bias is
differentiated; the mask has no cotangent (float0 for ``jax.vjp``); the checks
run at trace time with the core's messages.  tests/test_gpu_torch_bias.py has
the torch counterpart.  Skipped without jax (or without buffer_callback, JAX < 0.7).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

jax = pytest.importorskip("jax")
cfj = pytest.importorskip("cupyflash.jax")
if cfj._buffer_callback is None:
    pytest.skip(f"jax {jax.__version__} has no buffer_callback", allow_module_level=True)

import cupyflash  # noqa: E402
from cupyflash import _api, testing  # noqa: E402

# JAX's CPU backend (NumPy views of XLA's buffers), also where its default is a GPU.
pytestmark = pytest.mark.usefixtures("jax_cpu_device")

jnp = jax.numpy
flash_attention = cfj.flash_attention
FN = r"^cupyflash\.jax\.flash_attention: "

B, SQ, SK, HQ, HKV, D = 2, 11, 17, 4, 2, 16


def _inputs(rng, dtype=np.float32, sq=SQ, sk=SK):
    q, k, v = testing.random_qkv(rng, B, sq, sk, HQ, HKV, D, np.float32)
    dout = testing.random_normal(rng, q.shape, np.float32)
    return tuple(x.astype(dtype) for x in (q, k, v, dout))


def _bias(rng, shape, dtype=np.float32):
    return (2.0 * rng.standard_normal(shape)).astype(dtype)


def _grads(q, k, v, dout, bias, mask, causal, jit, **kw):
    """jax.grad of ``sum(out * dout)`` w.r.t. q, k, v and (when given) the bias; and out."""

    def loss(q, k, v, b):
        out = flash_attention(q, k, v, causal=causal, attn_bias=b, attn_mask=mask, **kw)
        return (out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)).sum(), out

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    grad = jax.grad(loss, argnums=argnums, has_aux=True)
    if jit:
        grad = jax.jit(grad)
    grads, out = grad(*(jnp.asarray(x) for x in (q, k, v)), None if bias is None else jnp.asarray(bias))
    return [np.asarray(g) for g in grads], np.asarray(out)


def _check(q, k, v, dout, out, grads, causal, bias=None, mask=None, **kw):
    """Value and gradients against the float64 reference (the rule of cupyflash.testing)."""
    scores = {name: x for name, x in (("attn_bias", bias), ("attn_mask", mask)) if x is not None}
    _, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal, **scores, **kw)
    testing.assert_fwd_matches_reference(q, k, v, out, lse, causal=causal, **scores, **kw)
    testing.assert_bwd_matches_reference(dout, q, k, v, *grads[:3], causal=causal,
                                         dbias=grads[3] if bias is not None else None, **scores, **kw)


# ----------------------------------------------------------------------------
# Values and gradients against the float64 reference
# ----------------------------------------------------------------------------

#: The bias shapes: per head, per batch element and key (padding-like), shared by all,
#: per batch element, full, and a 3-D one (left-padded to (1, HQ, 1, SK)).
BIAS_SHAPES = {"(1,H,N,N)": (1, HQ, SQ, SK), "(B,1,1,N)": (B, 1, 1, SK), "(N,N)": (SQ, SK),
               "(B,1,N,N)": (B, 1, SQ, SK), "(B,H,N,N)": (B, HQ, SQ, SK), "(H,1,N)": (HQ, 1, SK)}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(BIAS_SHAPES))
def test_bias_grads_match_reference(rng, shape, causal, jit):
    q, k, v, dout = _inputs(rng)
    bias = _bias(rng, BIAS_SHAPES[shape])
    grads, out = _grads(q, k, v, dout, bias, None, causal, jit)
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    _check(q, k, v, dout, out, grads, causal, bias=bias)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("mask_shape", [(B, 1, SQ, SK), (1, HQ, SQ, SK), (B, 1, 1, SK), (SQ, SK)])
def test_mask_alone_and_with_a_bias(rng, mask_shape, jit):
    q, k, v, dout = _inputs(rng)
    mask = rng.random(mask_shape) < 0.7
    grads, out = _grads(q, k, v, dout, None, jnp.asarray(mask), True, jit)
    _check(q, k, v, dout, out, grads, True, mask=mask)
    bias = _bias(rng, (1, HQ, SQ, SK))
    grads, out = _grads(q, k, v, dout, bias, jnp.asarray(mask), False, jit)
    _check(q, k, v, dout, out, grads, False, bias=bias, mask=mask)


@pytest.mark.parametrize("sq,sk", [(1, 17), (17, 5), (16, 16)])
def test_seqlens_and_gqa_with_causal(rng, sq, sk):
    """seqlen_q != seqlen_k (causal aligned bottom-right), GQA (4 query heads, 2 KV heads)."""
    q, k, v, dout = _inputs(rng, sq=sq, sk=sk)
    bias = _bias(rng, (B, HQ, sq, sk))
    mask = rng.random((B, 1, sq, sk)) < 0.8
    grads, out = _grads(q, k, v, dout, bias, jnp.asarray(mask), True, True)
    _check(q, k, v, dout, out, grads, True, bias=bias, mask=mask)


@pytest.mark.parametrize("jit", [False, True])
def test_fully_masked_rows_and_minus_inf(rng, jit):
    """Rows that see no key (the mask, -inf biases, or both with causal): out 0, no NaN, zero
    gradients there and zero dbias in those rows; -inf entries elsewhere hide their keys."""
    q, k, v, dout = _inputs(rng)
    mask = np.ones((B, 1, SQ, SK), bool)
    mask[0, :, 3] = False  # row 3 of batch 0: every key hidden by the mask
    bias = _bias(rng, (B, HQ, SQ, SK))
    bias[1, 2, 5] = -np.inf  # row 5 of batch 1, head 2: by the bias
    bias[:, :, 7, ::2] = -np.inf  # row 7: every other key
    grads, out = _grads(q, k, v, dout, bias, jnp.asarray(mask), False, jit)
    assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)
    assert np.all(out[0, 3] == 0) and np.all(out[1, 5, 2] == 0)
    assert np.all(grads[0][0, 3] == 0) and np.all(grads[0][1, 5, 2] == 0)
    dbias = grads[3]
    assert np.all(dbias[0, :, 3] == 0) and np.all(dbias[1, 2, 5] == 0)
    assert np.all(dbias[:, :, 7, ::2] == 0)  # hidden keys get no gradient
    _check(q, k, v, dout, out, grads, False, bias=bias, mask=mask)


_NO_ML_DTYPES = pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is None,
                                   reason="bfloat16 needs ml_dtypes")


@pytest.mark.parametrize("qdtype,bdtype", [
    ("float16", "float16"), ("float16", "float32"),
    pytest.param("bfloat16", "bfloat16", marks=_NO_ML_DTYPES),
    pytest.param("bfloat16", "float32", marks=_NO_ML_DTYPES),
])
def test_bias_dtypes(rng, qdtype, bdtype):
    """The bias in q's dtype or float32; dbias comes back in the bias's dtype."""
    q, k, v, dout = (x.astype(testing.resolve_dtype(qdtype)) for x in _inputs(rng))
    bias = _bias(rng, (1, HQ, SQ, SK)).astype(testing.resolve_dtype(bdtype))
    grads, out = _grads(q, k, v, dout, bias, None, True, True)
    assert out.dtype == q.dtype and grads[3].dtype == bias.dtype
    _check(q, k, v, dout, out, grads, True, bias=bias)


def test_with_the_other_variants(rng):
    """Bias and mask beside a window, softcap, ALiBi and sinks: dsinks and dbias both returned."""
    q, k, v, dout = _inputs(rng)
    bias = _bias(rng, (B, 1, SQ, SK))
    mask = rng.random((1, 1, SQ, SK)) < 0.8
    sinks = rng.standard_normal(HQ).astype(np.float32)
    slopes = (0.05 + 0.2 * rng.random(HQ)).astype(np.float32)
    kw = dict(window_size=(6, 2), softcap=3.0)

    def loss(q, k, v, b, s):
        out = flash_attention(q, k, v, causal=True, attn_bias=b, attn_mask=jnp.asarray(mask), sinks=s,
                              alibi_slopes=jnp.asarray(slopes), **kw)
        return (out * jnp.asarray(dout)).sum(), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        *(jnp.asarray(x) for x in (q, k, v, bias, sinks)))
    grads = [np.asarray(g) for g in grads]
    variants = dict(kw, attn_bias=bias, attn_mask=mask, sinks=sinks, alibi_slopes=slopes)
    _, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True, **variants)
    testing.assert_fwd_matches_reference(q, k, v, np.asarray(out), lse, causal=True, **variants)
    testing.assert_bwd_matches_reference(dout, q, k, v, *grads[:3], causal=True, dsinks=grads[4],
                                         dbias=grads[3], **variants)


# ----------------------------------------------------------------------------
# The cotangents are the core backward's; dbias only when asked for
# ----------------------------------------------------------------------------


def test_grads_are_the_core_backward_bit_for_bit(rng):
    q, k, v, dout = _inputs(rng)
    bias = _bias(rng, (B, 1, 1, SK))
    mask = rng.random((B, 1, SQ, SK)) < 0.8
    kw = dict(causal=True, attn_mask=mask)
    loss = lambda q, k, v, b: (flash_attention(q, k, v, attn_bias=b, causal=True, attn_mask=jnp.asarray(mask))
                               * jnp.asarray(dout)).sum()
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jnp.asarray(x) for x in (q, k, v, bias)))
    out, lse = cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias, **kw)
    want = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, attn_bias=bias, return_dbias=True, **kw)
    assert len(want) == 4
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)
    np.testing.assert_array_equal(np.asarray(flash_attention(*(jnp.asarray(x) for x in (q, k, v)),
                                                             attn_bias=jnp.asarray(bias), **kw)), out)


@pytest.fixture
def bwd_calls(monkeypatch):
    """The return_dbias of every core backward the callbacks make."""
    calls = []
    real = _api.flash_attn_bwd

    def spy(*args, **kwargs):
        calls.append(kwargs.get("return_dbias", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(_api, "flash_attn_bwd", spy)
    return calls


@pytest.mark.parametrize("jit", [False, True])
def test_dbias_only_when_the_bias_is_differentiated(rng, bwd_calls, jit):
    q, k, v, dout = (jnp.asarray(x) for x in _inputs(rng))
    bias = jnp.asarray(_bias(rng, (1, HQ, SQ, SK)))
    loss = lambda q, b: (flash_attention(q, k, v, attn_bias=b, causal=True) * dout).sum()
    # (each result waited for: the callbacks may run after the call returns, jitted or not)
    wrap = lambda f: lambda *a: jax.block_until_ready((jax.jit(f) if jit else f)(*a))  # noqa: E731
    dq_only = wrap(jax.grad(loss, argnums=0))(q, bias)
    assert bwd_calls == [False]
    dq, dbias = wrap(jax.grad(loss, argnums=(0, 1)))(q, bias)
    assert bwd_calls == [False, True]
    np.testing.assert_array_equal(np.asarray(dq_only), np.asarray(dq))
    # the bias a constant closed over: no dbias either
    wrap(jax.grad(lambda q: loss(q, bias)))(q)
    assert bwd_calls == [False, True, False]
    assert dbias.shape == bias.shape and np.any(np.asarray(dbias) != 0)


def test_the_mask_has_no_cotangent(rng):
    """jax.vjp over every input: the bool mask's cotangent is float0 (JAX's rule for
    non-float inputs), the bias's is dbias."""
    q, k, v, dout = (jnp.asarray(x) for x in _inputs(rng))
    bias = jnp.asarray(_bias(rng, (SQ, SK)))
    mask = jnp.asarray(rng.random((B, 1, SQ, SK)) < 0.8)
    out, vjp = jax.vjp(lambda q, k, v, b, m: flash_attention(q, k, v, attn_bias=b, attn_mask=m), q, k, v, bias,
                       mask)
    dq, dk, dv, dbias, dmask = vjp(dout)
    assert dmask.dtype == jax.dtypes.float0 and dmask.shape == mask.shape
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    # jax.grad with respect to the mask is refused by JAX itself (an integer-like input)
    with pytest.raises(TypeError, match="bool"):
        jax.grad(lambda m: flash_attention(q, k, v, attn_mask=m).sum())(mask)


def test_vmap_over_the_batch(rng):
    """jax.vmap with the bias mapped with q: one call per element (sequential), each the unmapped one."""
    q, k, v, _ = (jnp.asarray(x) for x in _inputs(rng))
    bias = jnp.asarray(_bias(rng, (B, HQ, SQ, SK)))
    one = lambda q, k, v, b: flash_attention(q[None], k[None], v[None], attn_bias=b[None], causal=True)[0]
    got = jax.vmap(one)(q, k, v, bias)
    want = flash_attention(q, k, v, attn_bias=bias, causal=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_no_bias_or_mask_takes_the_plain_path(rng, monkeypatch):
    """attn_bias=None and attn_mask=None are the plain call (no variant callback)."""
    q, k, v, _ = (jnp.asarray(x) for x in _inputs(rng))
    monkeypatch.setattr(cfj, "_variant_attention", None)  # would raise if called
    out = flash_attention(q, k, v, causal=True, attn_bias=None, attn_mask=None)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(cupyflash.flash_attn(
        *(np.asarray(x) for x in (q, k, v)), causal=True)))


def test_numpy_bias_and_mask_are_taken(rng):
    q, k, v, _ = _inputs(rng)
    bias, mask = _bias(rng, (1, HQ, SQ, SK)), rng.random((SQ, SK)) < 0.8
    got = flash_attention(*(jnp.asarray(x) for x in (q, k, v)), attn_bias=bias, attn_mask=mask)
    np.testing.assert_array_equal(np.asarray(got), cupyflash.flash_attn(q, k, v, attn_bias=bias, attn_mask=mask))


# ----------------------------------------------------------------------------
# Bad input: at trace time, the core's rules and messages
# ----------------------------------------------------------------------------


def test_bad_bias_and_mask_are_named_at_trace_time(rng):
    q, k, v, _ = (jnp.asarray(x) for x in _inputs(rng))
    with pytest.raises(TypeError, match=FN + r"attn_bias must be None or a jax\.Array of q's dtype or float32; "
                                         r"got list\.$"):
        flash_attention(q, k, v, attn_bias=[[0.0]])
    with pytest.raises(TypeError, match=FN + r"attn_mask must be None or a bool jax\.Array; got int\.$"):
        flash_attention(q, k, v, attn_mask=1)
    with pytest.raises(TypeError, match=FN + r"attn_mask must have dtype bool \(True = attend; a float mask "
                                         r"belongs in attn_bias\); got float32\.$"):
        flash_attention(q, k, v, attn_mask=jnp.zeros((SQ, SK), jnp.float32))
    with pytest.raises(TypeError, match=FN + r"attn_mask must have dtype bool .*; got int32\."):  # (jit appends a note)
        jax.jit(lambda q, m: flash_attention(q, k, v, attn_mask=m))(q, jnp.zeros((SQ, SK), jnp.int32))
    with pytest.raises(TypeError, match=FN + r"attn_bias must have q's dtype \(float32\) or float32; "
                                         r"got float16\.$"):
        flash_attention(q, k, v, attn_bias=jnp.zeros((SQ, SK), jnp.float16))
    with pytest.raises(ValueError, match=FN + r"attn_bias must be broadcastable to \(batch, nheads_q, seqlen_q, "
                                          r"seqlen_k\) = \(2, 4, 11, 17\), each dimension 1 or full .*whose "
                                          r"nheads_q is 2\."):
        jax.jit(lambda q, b: flash_attention(q, k, v, attn_bias=b))(q, jnp.zeros((1, 2, SQ, SK)))
    with pytest.raises(ValueError, match=FN + r"attn_mask must be broadcastable .*whose seqlen_k is 16\.$"):
        flash_attention(q, k, v, attn_mask=jnp.ones((SQ, SK - 1), bool))
    with pytest.raises(ValueError, match=FN + r"attn_bias must have at most 4 dimensions"):
        flash_attention(q, k, v, attn_bias=jnp.zeros((1, 1, 1, SQ, SK)))


def test_trace_time_stand_ins_hold_zeros_of_their_own():
    """The NumPy stand-ins the core's checks see at trace time: the shape and dtype, every value
    0 in memory they own (the checks read the slopes' and sinks' values; a stand-in over
    foreign memory made them fail at random), one element for a bias however large."""
    for x in (jnp.ones(4, jnp.float32), jnp.ones((2, 4), jnp.float32), jnp.ones((8, 16, 512, 512), bool)):
        spec = cfj._value_spec(x)
        assert spec.shape == x.shape and spec.dtype == np.dtype(x.dtype)
        assert not spec.any() and spec.base is not None and spec.base.size == 1
