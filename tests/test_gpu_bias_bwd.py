"""The GPU backward with ``attn_bias`` / ``attn_mask`` (issue 14) against the float64
reference: dq, dk, dv and ``dbias``, on the wgmma kernels (D=64 and 128 on sm_90;
the D=128 bias/mask plans take the mma.sync kernels, dispatch._BWD_SM90_VARIANT_SPILLS,
but for the staged fp32 bias alone and the mask alone: test_staged_d128_on_wgmma),
the bias/mask tile staged through shared memory where its rows are 16-byte aligned
(test_staged*; the other tests' odd seqlen_k read it element by element)
and the mma.sync ones (D=96, 256, and every head_dim before sm_90). dbias comes from
the wgmma dbias kernel at padded D=64 and 128 on sm_90 (test_dbias_on_wgmma checks the
launch), else from the mma.sync one.

Tolerance (:mod:`cupyflash.testing`): ``max|got - ref64| <= 3 * max|naive - ref64| +
FLOOR`` for every gradient (``dbias`` included; 2x for out and lse), ``naive`` the
reference's naive implementation in the input dtype with the same bias and mask.
Inputs are fresh random values; every CuPy allocation made during a test starts as
0xFF bytes (NaN) and dq, dk, dv are NaN-poisoned buffers, so an element never written
fails (dbias too: the dbias kernel writes every element of its uninitialised output,
zeros where no (query, key) pair reaches it).

Covered: every broadcast shape of the bias, in q's dtype and in float32, stride-0
and non-contiguous biases (read in place), masks, ``-inf`` entries and fully masked
rows (zero dq and dbias rows, nothing NaN), causal, window, softcap (dbias is dS
before softcap's 1 - tanh² factor), dropout with ``rng_state``, GQA, varlen,
deterministic mode (bit-for-bit reruns, broadcast biases included), float16 and
bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import testing
from test_cpu_bias import SCALE as VARLEN_SCALE
from test_cpu_bias import _packed_reference
from test_gpu_variants import _NO_BF16, dev, dtype_kw, for_reference, host, poisoned
from test_varlen import cu_seqlens, packed_inputs

pytestmark = pytest.mark.gpu

FLOOR = 1e-3
SEED, OFFSET = 0x5EED_0014_B1A5_0BD0, 7


@pytest.fixture
def cp():
    """cupy, every allocation NaN-poisoned (0xFF bytes) for the test's duration."""
    cupy = pytest.importorskip("cupy")
    with testing.poisoned_allocations(cupy):
        yield cupy


def _dtypes(*names):
    return [pytest.param(n, marks=_NO_BF16) if n == "bfloat16" else n for n in names]


def bias_values(rng, shape, dtype):
    """Host bias values of about +-2 (in ``dtype``: q's or float32)."""
    return (2.0 * rng.standard_normal(shape, dtype=np.float32)).astype(testing.resolve_dtype(dtype))


def keep_mask(rng, shape, keep=0.75):
    return rng.random(shape) < keep


def run(cp, rng, dtype, shape, causal, *, bias=None, mask=None, view=None, variants=None, deterministic=False,
        softmax_scale=None):
    """Fresh inputs; the forward then the backward (``return_dbias`` with a bias) through
    the public functions into poisoned outputs. ``bias``/``mask`` are host arrays, moved
    to the GPU; the bias is then given ``view`` (the same view is taken of the host array
    for the reference). Returns the host inputs, the host (out, lse), the host gradients (dbias
    last) and the host bias and mask as the reference takes them."""
    batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim = shape
    variants = dict(variants or {})
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    view = view or (lambda x: x)
    d_bias = None if bias is None else view(dev(cp, bias))
    d_mask = None if mask is None else cp.asarray(mask)
    kw = dict(softmax_scale=softmax_scale, causal=causal, **dtype_kw(cp, dtype),
              **{n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in variants.items()})
    d_q, d_k, d_v, d_dout = (dev(cp, x) for x in (q, k, v, dout))
    out, lse = cupyflash.flash_attn_fwd(d_q, d_k, d_v, out=poisoned(cp, q.shape, dtype),
                                        lse=poisoned(cp, (batch, nheads_q, seqlen_q), np.float32),
                                        attn_bias=d_bias, attn_mask=d_mask, **kw)
    grads = cupyflash.flash_attn_bwd(d_dout, d_q, d_k, d_v, out, lse, deterministic=deterministic,
                                     dq=poisoned(cp, q.shape, dtype), dk=poisoned(cp, k.shape, dtype),
                                     dv=poisoned(cp, v.shape, dtype), attn_bias=d_bias, attn_mask=d_mask,
                                     return_dbias=bias is not None, **kw)
    assert len(grads) == 3 + (variants.get("sinks") is not None) + (bias is not None)
    if bias is not None:
        assert grads[-1].shape == d_bias.shape and grads[-1].dtype == d_bias.dtype
    h_bias = None if bias is None else view(bias)
    h_mask = None if mask is None else mask
    grads = tuple(host(g, dtype if i < 3 or bias is None or bias.dtype != np.float32 else None)
                  for i, g in enumerate(grads))
    return (q, k, v, dout), (host(out, dtype), host(lse)), grads, (h_bias, h_mask)


def check(inputs, fwd, grads, scores, causal, variants=None, softmax_scale=None):
    """out, lse and every gradient against the float64 reference with the naive rule."""
    q, k, v, dout = inputs
    bias, mask = scores
    batch, seqlen_q, nheads = q.shape[:3]
    ref_kw = for_reference(dict(variants or {}), batch, nheads, seqlen_q, k.shape[1])
    ref_kw.update(attn_bias=bias, attn_mask=mask)
    for g in grads:
        assert not np.isnan(np.asarray(g, np.float32)).any()
    testing.assert_fwd_matches_reference(q, k, v, *fwd, softmax_scale=softmax_scale, causal=causal, floor=FLOOR,
                                         **ref_kw)
    dsinks = grads[3] if (variants or {}).get("sinks") is not None else None
    testing.assert_bwd_matches_reference(dout, q, k, v, *grads[:3], softmax_scale=softmax_scale, causal=causal,
                                         dsinks=dsinks, dbias=grads[-1] if bias is not None else None,
                                         out=fwd[0], floor=FLOOR, **ref_kw)


# id -> (dtype, (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), causal): the wgmma
# kernels at D=64 (and D=128's mma.sync fallback), the mma.sync ones at D=96 and 256; tails
# in both axes, GQA, seqlen_q > seqlen_k (causal: top rows see no key)
CONFIGS = {
    "f16-d64-gqa": ("float16", (2, 200, 333, 4, 2, 64), False),
    "bf16-d128-causal": ("bfloat16", (2, 333, 200, 4, 2, 128), True),
    "f16-d96-causal": ("float16", (1, 130, 257, 4, 4, 96), True),
    "bf16-d256": ("bfloat16", (2, 77, 150, 2, 1, 256), False),
}


def _config(name):
    return [pytest.param(*CONFIGS[name], id=name)]


def _all_configs():
    return [pytest.param(*c, id=n) for n, c in CONFIGS.items()]


# name -> the bias's shape given (batch, nheads_q, seqlen_q, seqlen_k)
BROADCAST = {
    "full": lambda b, h, m, n: (b, h, m, n),
    "per-head": lambda b, h, m, n: (1, h, m, n),
    "per-batch": lambda b, h, m, n: (b, 1, m, n),
    "per-key": lambda b, h, m, n: (b, 1, 1, n),
    "per-row": lambda b, h, m, n: (b, 1, m, 1),
    "shared": lambda b, h, m, n: (m, n),
}


def _score_shape(shape):
    batch, seqlen_q, seqlen_k, nheads_q = shape[:4]
    return batch, nheads_q, seqlen_q, seqlen_k


# ----------------------------------------------------------------------------
# Every broadcast shape, in q's dtype and in float32
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bias_dtype", ["q", "float32"])
@pytest.mark.parametrize("name", list(BROADCAST))
@pytest.mark.parametrize("dtype,shape,causal", _all_configs())
def test_bias_shapes(cp, rng, dtype, shape, causal, name, bias_dtype):
    bias = bias_values(rng, BROADCAST[name](*_score_shape(shape)), dtype if bias_dtype == "q" else "float32")
    check(*run(cp, rng, dtype, shape, causal, bias=bias), causal)


@pytest.mark.parametrize("name", ["full", "per-batch", "per-key", "shared"])
@pytest.mark.parametrize("dtype,shape,causal", _all_configs())
def test_masks(cp, rng, dtype, shape, causal, name):
    mask = keep_mask(rng, BROADCAST[name](*_score_shape(shape)))
    inputs, fwd, grads, scores = run(cp, rng, dtype, shape, causal, mask=mask)
    assert len(grads) == 3
    check(inputs, fwd, grads, scores, causal)


@pytest.mark.parametrize("dtype,shape,causal", _all_configs())
def test_bias_and_mask(cp, rng, dtype, shape, causal):
    batch, nheads, seqlen_q, seqlen_k = _score_shape(shape)
    bias = bias_values(rng, (1, nheads, seqlen_q, seqlen_k), "float32")
    mask = keep_mask(rng, (batch, 1, seqlen_q, seqlen_k), 0.8)
    check(*run(cp, rng, dtype, shape, causal, bias=bias, mask=mask), causal)


# ----------------------------------------------------------------------------
# Strides: stride-0 and non-contiguous biases, read in place
# ----------------------------------------------------------------------------

# name -> (the base array's shape given (B, H, Sq, Sk), the view of it given the shape)
STRIDED = {
    "stride0-full": (lambda b, h, m, n: (n,), lambda x, s: _broadcast_to(x, s)),
    "stride0-heads": (lambda b, h, m, n: (m, n), lambda x, s: _broadcast_to(x, (1,) + s[1:])),
    "transposed": (lambda b, h, m, n: (b, h, n, m), lambda x, s: x.transpose(0, 1, 3, 2)),
    "key-step-2": (lambda b, h, m, n: (b, 1, m, 2 * n + 1), lambda x, s: x[..., 1::2]),
    "sliced-rows": (lambda b, h, m, n: (b, h, m + 9, n + 3), lambda x, s: x[:, :, 4:4 + s[2], 2:2 + s[3]]),
    "reversed": (lambda b, h, m, n: (b, h, m, n), lambda x, s: x[:, ::-1, ::-1, ::-1]),
}


def _broadcast_to(x, shape):
    xp = np if isinstance(x, np.ndarray) else __import__("cupy")
    return xp.broadcast_to(x, shape)


@pytest.mark.parametrize("name", list(STRIDED))
@pytest.mark.parametrize("dtype,shape,causal", _config("f16-d64-gqa") + _config("f16-d96-causal"))
def test_strided_biases(cp, rng, dtype, shape, causal, name):
    base_shape, make_view = STRIDED[name]
    full = _score_shape(shape)
    base = bias_values(rng, base_shape(*full), dtype)
    mask = keep_mask(rng, (full[3],), 0.9)
    inputs, fwd, grads, scores = run(cp, rng, dtype, shape, causal, bias=base, mask=mask,
                                     view=lambda x: make_view(x, full))
    assert not scores[0].flags.c_contiguous
    check(inputs, fwd, grads, scores, causal)


# ----------------------------------------------------------------------------
# -inf entries and rows that see no key
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("via", ["bias", "mask"])
@pytest.mark.parametrize("dtype,shape,causal", _all_configs())
def test_fully_masked_rows(cp, rng, dtype, shape, causal, via):
    """A quarter of the entries hidden at random, rows 3 and 20 of (batch 0, head 1) and
    row 30 of every head of the last batch hidden entirely: zero dq and dbias rows there,
    zero dbias wherever hidden, nothing NaN, the rest as the reference."""
    score_shape = batch, nheads, seqlen_q, seqlen_k = _score_shape(shape)
    hidden = rng.random(score_shape) < 0.25
    hidden[0, 1, [3, 20]] = True
    hidden[-1, :, 30] = True
    bias = bias_values(rng, score_shape, "float32")
    mask = None
    if via == "bias":
        bias[hidden] = -np.inf
    else:
        mask = ~hidden
    inputs, fwd, grads, scores = run(cp, rng, dtype, shape, causal, bias=bias, mask=mask)
    dq, dbias = grads[0], grads[-1]
    out, lse = fwd
    for b, h, i in [(0, 1, 3), (0, 1, 20)] + [(batch - 1, h, 30) for h in range(nheads)]:
        assert lse[b, h, i] == -np.inf
        assert (out[b, i, h] == 0).all() and (dq[b, i, h] == 0).all() and (dbias[b, h, i] == 0).all()
    assert (dbias[hidden] == 0).all()
    for x in (out, lse) + tuple(grads):
        assert not np.isnan(np.asarray(x, np.float32)).any()
    check(inputs, fwd, grads, scores, causal)


@pytest.mark.parametrize("dtype,shape,causal", _config("f16-d64-gqa") + _config("bf16-d256"))
def test_every_key_hidden(cp, rng, dtype, shape, causal):
    """A mask hiding everything: every gradient 0, dbias too."""
    full = _score_shape(shape)
    bias = bias_values(rng, (full[2], full[3]), dtype)
    _, fwd, grads, _ = run(cp, rng, dtype, shape, causal, bias=bias, mask=np.zeros((1, 1, 1, 1), bool))
    assert (fwd[1] == -np.inf).all()
    for g in grads:
        assert (np.asarray(g, np.float32) == 0).all()


# ----------------------------------------------------------------------------
# With the other variants; deterministic mode
# ----------------------------------------------------------------------------

# id -> (variants, softmax_scale as a multiple of 1/sqrt(head_dim))
WITH = {
    "window": ({"window_size": (48, 16)}, 1.0),
    "softcap": ({"softcap": 5.0}, 2.0),  # dbias is dS before the 1 - tanh² factor
    "dropout": ({"dropout_p": 0.2, "rng_state": (SEED, OFFSET)}, 1.0),
    "alibi-sinks": ({"alibi_slopes": np.linspace(0.05, 0.4, 4, dtype=np.float32),
                     "sinks": np.array([1.0, 3.0, -np.inf, 2.0], np.float32)}, 1.0),
    "softcap-dropout-window": ({"softcap": 8.0, "dropout_p": 0.1, "rng_state": (SEED, OFFSET),
                                "window_size": (64, -1)}, 2.0),
}


@pytest.mark.parametrize("name", list(WITH))
@pytest.mark.parametrize("dtype,shape,causal", _all_configs())
def test_with_other_variants(cp, rng, dtype, shape, causal, name):
    variants, scale = WITH[name]
    if "sinks" in variants and shape[3] != 4:
        variants = {**variants, "alibi_slopes": variants["alibi_slopes"][:shape[3]],
                    "sinks": variants["sinks"][:shape[3]]}
    softmax_scale = scale / np.sqrt(shape[5])
    batch, nheads, seqlen_q, seqlen_k = _score_shape(shape)
    bias = bias_values(rng, (batch, 1, seqlen_q, seqlen_k), dtype)
    mask = keep_mask(rng, (1, nheads, 1, seqlen_k), 0.85)
    check(*run(cp, rng, dtype, shape, causal, bias=bias, mask=mask, variants=variants, softmax_scale=softmax_scale),
          causal, variants, softmax_scale)


@pytest.mark.parametrize("name", ["full", "per-head", "per-key", "shared"])
@pytest.mark.parametrize("dtype,shape,causal", _all_configs())
def test_deterministic(cp, rng, dtype, shape, causal, name):
    """Deterministic mode, dq from the dQ kernel; dbias comes from the dbias kernel, which
    sums what broadcasts onto each tile in a fixed order: the same bits run after run,
    for a broadcast bias too."""
    bias = bias_values(rng, BROADCAST[name](*_score_shape(shape)), "float32")
    mask = keep_mask(rng, _score_shape(shape)[2:], 0.9)
    inputs, fwd, grads, scores = run(cp, rng, dtype, shape, causal, bias=bias, mask=mask, deterministic=True)
    check(inputs, fwd, grads, scores, causal)
    # the same inputs again: the same bits
    q, k, v, dout = (dev(cp, x) for x in inputs)
    kw = dict(causal=causal, **dtype_kw(cp, dtype), attn_bias=cp.asarray(scores[0]),
              attn_mask=cp.asarray(scores[1]))
    out, lse = cupyflash.flash_attn_fwd(q, k, v, **kw)
    again = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, deterministic=True, return_dbias=True, **kw)
    for a, b in zip(grads, again):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), host(b, dtype if a.dtype != np.float32
                                                                           else None).view(np.uint8))


# ----------------------------------------------------------------------------
# Varlen: sequence b's block [b, :, :len_q, :len_k] of the bias
# ----------------------------------------------------------------------------

LENS_Q = (5, 140, 0, 1, 70, 64)
LENS_K = (7, 133, 3, 1, 0, 200)

VARLEN_SHAPES = {
    "full": (lambda b, h, m, n: (b, h, m, n), None),
    "shared": (lambda b, h, m, n: (m, n), None),
    "per-key-and-mask": (lambda b, h, m, n: (b, 1, 1, n), lambda b, h, m, n: (1, h, m, n)),
    "mask-only": (None, lambda b, h, m, n: (b, h, m, n)),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(VARLEN_SHAPES))
@pytest.mark.parametrize("dtype,head_dim", [("float16", 64), pytest.param("bfloat16", 96, marks=_NO_BF16),
                                            ("float16", 128)])
def test_varlen(cp, rng, dtype, head_dim, name, causal):
    _varlen(cp, rng, dtype, head_dim, name, causal, max(LENS_K) + 2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["full", "per-key-and-mask", "mask-only"])
@pytest.mark.parametrize("dtype,head_dim", [("float16", 64), ("float16", 128)])
def test_varlen_staged(cp, rng, dtype, head_dim, name, causal):
    """max_seqlen_k = 208: the bias's and mask's rows 16-byte aligned (VAR_BIAS_STAGED)."""
    _varlen(cp, rng, dtype, head_dim, name, causal, 208)


def _varlen(cp, rng, dtype, head_dim, name, causal, max_k):
    nheads, nheads_kv = 4, 2
    q, k, v = packed_inputs(rng, LENS_Q, LENS_K, nheads, nheads_kv, head_dim, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    max_q = max(LENS_Q) + 3  # entries past the longest are not read
    args = (cu_seqlens(LENS_Q), cu_seqlens(LENS_K), max_q, max_k)
    full = (len(LENS_Q), nheads, max_q, max_k)
    bias_shape, mask_shape = VARLEN_SHAPES[name]
    variants = {}
    if bias_shape is not None:
        variants["attn_bias"] = bias_values(rng, bias_shape(*full), "float32")
    if mask_shape is not None:
        variants["attn_mask"] = keep_mask(rng, mask_shape(*full))
    d_args = (cp.asarray(args[0]), cp.asarray(args[1])) + args[2:]
    d_variants = {n: cp.asarray(x) for n, x in variants.items()}
    kw = dict(softmax_scale=VARLEN_SCALE, causal=causal, **dtype_kw(cp, dtype), **d_variants)
    d_q, d_k, d_v, d_dout = (dev(cp, x) for x in (q, k, v, dout))
    out, lse = cupyflash.flash_attn_varlen_fwd(d_q, d_k, d_v, *d_args, **kw)
    grads = cupyflash.flash_attn_varlen_bwd(d_dout, d_q, d_k, d_v, out, lse, *d_args,
                                            return_dbias=bias_shape is not None, **kw)
    results = dict(out=host(out, dtype), lse=host(lse), dq=host(grads[0], dtype), dk=host(grads[1], dtype),
                   dv=host(grads[2], dtype))
    if bias_shape is not None:
        assert grads[3].shape == variants["attn_bias"].shape and grads[3].dtype == np.float32
        results["dbias"] = host(grads[3])
    refs = _packed_reference(q, k, v, dout, LENS_Q, LENS_K, causal, **variants)
    for key, got in results.items():
        assert not np.isnan(np.asarray(got, np.float32)[np.isfinite(refs[key][0])]).any(), key
        ref, naive = refs[key]
        factor = testing.OUT_FACTOR if key in ("out", "lse") else testing.GRAD_FACTOR
        floor = testing.REL_FLOOR * max(1.0, float(np.abs(ref[np.isfinite(ref)]).max(initial=0.0)))
        testing.assert_close_to_reference(key, got, ref, naive, factor, floor)
    if bias_shape is not None and variants["attn_bias"].ndim == 4 and variants["attn_bias"].shape[2] > 1:
        assert (results["dbias"][:, :, max(LENS_Q):] == 0).all()  # rows past every sequence: never written


# ----------------------------------------------------------------------------
# The staged tile (VAR_BIAS_STAGED: every row 16-byte aligned, dispatch.score_vec_ok):
# the dK/dV kernels (mma.sync; wgmma at D=64) and the dQ kernels copy each (query
# block, key block)'s bias/mask tile into shared memory. seqlen_k = 208 keeps the bias's
# (q's dtype and fp32) and the mask's rows aligned with a key tail in every tile size;
# the padded view keeps them aligned at seqlen_k = 203 (the copy zero-fills past it).
# ----------------------------------------------------------------------------

STAGED_CONFIGS = {
    "bf16-d64": ("bfloat16", (2, 150, 208, 4, 2, 64), False),
    "f16-d64-causal": ("float16", (1, 208, 208, 2, 2, 64), True),
    "f16-d128-causal": ("float16", (2, 208, 144, 4, 2, 128), True),
    "bf16-d96-causal": ("bfloat16", (1, 130, 208, 4, 4, 96), True),
    "f16-d256": ("float16", (2, 77, 208, 2, 1, 256), False),
    "f16-d32": ("float16", (1, 100, 272, 2, 2, 32), False),
}

# name -> (bias shape or None, bias dtype ("q" or "float32"), mask shape or None), given (B, H, Sq, Sk)
STAGED_KINDS = {
    "bias": (lambda b, h, m, n: (b, h, m, n), "q", None),
    "bias-fp32": (lambda b, h, m, n: (1, h, m, n), "float32", None),
    "mask": (None, None, lambda b, h, m, n: (b, h, m, n)),
    "bias-and-mask": (lambda b, h, m, n: (b, 1, m, n), "q", lambda b, h, m, n: (1, h, m, n)),
    "row-broadcast": (lambda b, h, m, n: (b, 1, 1, n), "float32", lambda b, h, m, n: (b, 1, 1, n)),
}


def _staged_param(name):
    dtype, shape, causal = STAGED_CONFIGS[name]
    return pytest.param(dtype, shape, causal, id=name, marks=_NO_BF16 if dtype == "bfloat16" else ())


def _assert_staged(cp, bias, mask):
    """The arrays pass dispatch.score_vec_ok (the plan stages them)."""
    from cupyflash import _variant, dispatch

    options = {n: x for n, x in (("attn_bias", bias), ("attn_mask", mask)) if x is not None}
    assert _variant.staged_bits(options) & dispatch.VAR_BIAS_STAGED


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("kind", list(STAGED_KINDS))
@pytest.mark.parametrize("dtype,shape,causal", [_staged_param(n) for n in STAGED_CONFIGS])
def test_staged(cp, rng, dtype, shape, causal, kind, deterministic):
    bias_shape, bias_dtype, mask_shape = STAGED_KINDS[kind]
    full = _score_shape(shape)
    bias = None if bias_shape is None else bias_values(rng, bias_shape(*full),
                                                       dtype if bias_dtype == "q" else "float32")
    mask = None if mask_shape is None else keep_mask(rng, mask_shape(*full), 0.8)
    _assert_staged(cp, None if bias is None else cp.asarray(bias), None if mask is None else cp.asarray(mask))
    check(*run(cp, rng, dtype, shape, causal, bias=bias, mask=mask, deterministic=deterministic), causal)


@pytest.mark.parametrize("with_mask", [False, True], ids=["bias", "bias-and-mask"])
@pytest.mark.parametrize("dtype,head_dim,causal", [("float16", 64, False), pytest.param("bfloat16", 96, True,
                                                                                        marks=_NO_BF16),
                                                   ("float16", 128, True), ("float16", 256, False)])
def test_staged_padded_rows(cp, rng, dtype, head_dim, causal, with_mask):
    """seqlen_k = 203 keys of rows padded to 208: aligned rows, a key tail that is not a
    multiple of 8 (the copy reads only the bytes inside the row)."""
    shape = (2, 120, 203, 2, 2, head_dim)
    full = _score_shape(shape)
    base = bias_values(rng, full[:3] + (208,), dtype)
    mask = keep_mask(rng, (full[3],), 0.9) if with_mask else None
    view = lambda x: x[..., :203]  # noqa: E731
    _assert_staged(cp, view(dev(cp, base)), None)
    inputs, fwd, grads, scores = run(cp, rng, dtype, shape, causal, bias=base, mask=mask, view=view)
    assert not scores[0].flags.c_contiguous
    check(inputs, fwd, grads, scores, causal)


# ----------------------------------------------------------------------------
# The wgmma dbias kernel (flash_bwd_dbias_sm90_kernel: sm_90, padded head_dim 64 and
# 128, 16-byte aligned data): dispatch launches it, and its dbias matches the reference
# ----------------------------------------------------------------------------

# id -> (dtype, shape, causal, bias shape, bias dtype, mask shape or None, variants): tails
# in both axes, every broadcast kind (batch and head visits, rows and keys summed), q's
# dtype and fp32, masks, GQA, causal with rows that see no key, a padded head_dim (120),
# a window, dropout
SM90_DBIAS = {
    "d64-per-head-gqa": ("float16", (3, 200, 333, 4, 2, 64), False, BROADCAST["per-head"], "q", None, None),
    "d128-per-batch-fp32-causal": ("bfloat16", (2, 333, 200, 4, 4, 128), True, BROADCAST["per-batch"],
                                   "float32", None, None),
    "d64-full-mask": ("float16", (2, 130, 257, 2, 2, 64), False, BROADCAST["full"], "q",
                      lambda b, h, m, n: (b, h, m, n), None),
    "d128-per-key-mask": ("float16", (2, 150, 300, 4, 4, 128), True, BROADCAST["per-key"], "float32",
                          lambda b, h, m, n: (1, h, 1, n), None),
    "d64-per-row": ("bfloat16", (2, 260, 190, 2, 2, 64), False, BROADCAST["per-row"], "q", None, None),
    "d120-shared-window": ("float16", (1, 257, 257, 4, 4, 120), False, BROADCAST["shared"], "q", None,
                           {"window_size": (48, 16)}),
    "d64-dropout": ("float16", (2, 200, 200, 2, 2, 64), True, BROADCAST["per-head"], "float32", None,
                    {"dropout_p": 0.2, "rng_state": (SEED, OFFSET)}),
}


def _sm90_dbias_param(name):
    dtype, *rest = SM90_DBIAS[name]
    return pytest.param(dtype, *rest, id=name, marks=_NO_BF16 if dtype == "bfloat16" else ())


@pytest.mark.parametrize("dtype,shape,causal,bias_shape,bias_dtype,mask_shape,variants",
                         [_sm90_dbias_param(n) for n in SM90_DBIAS])
def test_dbias_on_wgmma(cp, rng, launches, dtype, shape, causal, bias_shape, bias_dtype, mask_shape, variants):
    from cupyflash import _launch

    if _launch.compute_capability(cp.cuda.Device().id) != (9, 0):
        pytest.skip("the wgmma dbias kernel runs on compute capability 9.0")
    full = _score_shape(shape)
    bias = bias_values(rng, bias_shape(*full), dtype if bias_dtype == "q" else "float32")
    mask = None if mask_shape is None else keep_mask(rng, mask_shape(*full), 0.8)
    if mask is not None and mask.shape[2] > 1:
        mask[..., 5, :] = False  # a row that sees no key: its dbias row is 0
    check(*run(cp, rng, dtype, shape, causal, bias=bias, mask=mask, variants=variants), causal, variants)
    assert "flash_bwd_dbias_sm90_kernel" in launches and "flash_bwd_dbias_kernel" not in launches


@pytest.fixture
def no_ws_bias(monkeypatch):
    """The ws backward's bias off (BWD_WS_BIAS = (): its staged q-dtype bias is
    tests/test_gpu_bias_bwd_ws.py's), the plans forgotten before and after."""
    from cupyflash import _gpu, dispatch

    monkeypatch.setattr(dispatch, "BWD_WS_BIAS", ())
    _gpu.clear_plans()
    yield
    monkeypatch.undo()
    _gpu.clear_plans()


# The staged fp32 bias alone, the q-dtype bias alone and the mask alone at D=128 on sm_90: the wgmma dK/dV kernel
# (dispatch._BWD_SM90_STAGED_FITS), atomic dQ in it (default) or the wgmma dQ kernel
# (deterministic). Query tails (200, 130 rows), key counts that are multiples of 8 (staged).
D128_STAGED = {
    "bias-fp32": (lambda b, h, m, n: (1, h, m, n), None),
    "bias-q": (lambda b, h, m, n: (b, 1, m, n), None),
    "mask": (None, lambda b, h, m, n: (b, h, m, n)),
    "mask-per-key": (None, lambda b, h, m, n: (b, 1, 1, n)),
}


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("kind", list(D128_STAGED))
@pytest.mark.parametrize("dtype,shape,causal", [
    pytest.param("float16", (2, 200, 208, 4, 2, 128), False, id="f16-gqa"),
    pytest.param("bfloat16", (1, 130, 272, 2, 2, 128), True, id="bf16-causal", marks=_NO_BF16),
])
def test_staged_d128_on_wgmma(cp, rng, launches, no_ws_bias, dtype, shape, causal, kind, deterministic):
    from cupyflash import _launch

    if _launch.compute_capability(cp.cuda.Device().id) != (9, 0):
        pytest.skip("the wgmma dK/dV kernel runs on compute capability 9.0")
    bias_shape, mask_shape = D128_STAGED[kind]
    full = _score_shape(shape)
    bias = None if bias_shape is None else bias_values(rng, bias_shape(*full), "float32" if kind == "bias-fp32" else dtype)
    mask = None if mask_shape is None else keep_mask(rng, mask_shape(*full), 0.8)
    if mask is not None and mask.shape[2] > 1:
        mask[..., 5, :] = False  # a row that sees no key
    _assert_staged(cp, None if bias is None else cp.asarray(bias), None if mask is None else cp.asarray(mask))
    check(*run(cp, rng, dtype, shape, causal, bias=bias, mask=mask, deterministic=deterministic), causal)
    assert "flash_bwd_dkdv_sm90_kernel" in launches and "flash_bwd_dkdv_kernel" not in launches
    assert ("flash_bwd_dq_sm90_kernel" in launches) == deterministic


# ----------------------------------------------------------------------------
# The strip dbias kernel (flash_bwd_dbias_strip_sm90_kernel: sm_90, padded head_dim 64
# and 128, a bias with whole rows and keys whose (batch, head) pairs per strip fit shared
# memory: dispatch.uses_sm90_dbias_strips). DBIAS_STRIP_MIN_WAVES = 0 so that these small
# problems take it (their strips do not fill 132 SMs), and BWD_DBIAS_WS = () (the ws dbias
# kernel would serve the bias alone); the plans are forgotten before and after, so the other
# tests keep their kernels.
# ----------------------------------------------------------------------------


@pytest.fixture
def strips(monkeypatch):
    from cupyflash import _gpu, dispatch

    monkeypatch.setattr(dispatch, "DBIAS_STRIP_MIN_WAVES", 0)
    monkeypatch.setattr(dispatch, "BWD_DBIAS_WS", ())  # (the ws dbias kernel: test_gpu_bias_bwd_ws.py)
    _gpu.clear_plans()
    yield
    monkeypatch.undo()
    _gpu.clear_plans()


# id -> (dtype, shape, causal, bias shape, bias dtype, mask shape or None, variants): tails
# in both axes (257 x 190, 333 x 200), per-head (the batch's pairs), per-batch (the heads'),
# full (one pair) and shared (batch x heads pairs), q's dtype and fp32, masks with a row
# that sees no key, GQA, causal with rows that see no key, head_dim 120, window, dropout,
# softcap with ALiBi
STRIP_DBIAS = {
    "d64-per-head-gqa": ("float16", (4, 257, 190, 4, 2, 64), False, BROADCAST["per-head"], "q", None, None),
    "d64-per-head-fp32-causal-mask": ("bfloat16", (3, 257, 190, 2, 2, 64), True, BROADCAST["per-head"], "float32",
                                      lambda b, h, m, n: (b, h, m, n), None),
    "d64-per-batch-mask": ("float16", (2, 190, 257, 2, 1, 64), False, BROADCAST["per-batch"], "q",
                           lambda b, h, m, n: (1, h, m, n), None),
    "d64-shared-window": ("float16", (1, 257, 257, 4, 4, 64), False, BROADCAST["shared"], "float32", None,
                          {"window_size": (48, 16)}),
    "d64-full-dropout": ("float16", (2, 200, 200, 2, 2, 64), True, BROADCAST["full"], "float32", None,
                         {"dropout_p": 0.2, "rng_state": (SEED, OFFSET)}),
    "d128-full-causal": ("float16", (2, 333, 200, 4, 4, 128), True, BROADCAST["full"], "q", None, None),
    "d128-per-head-b2-fp32-mask": ("bfloat16", (2, 200, 257, 4, 2, 128), False, BROADCAST["per-head"], "float32",
                                   lambda b, h, m, n: (b, 1, m, n), None),
    "d120-full-softcap-alibi": ("float16", (1, 257, 190, 2, 2, 120), False, BROADCAST["full"], "q", None,
                                {"softcap": 8.0, "alibi_slopes": np.array([0.25, 0.5], np.float32)}),
}


def _strip_param(name):
    dtype, *rest = STRIP_DBIAS[name]
    return pytest.param(dtype, *rest, id=name, marks=_NO_BF16 if dtype == "bfloat16" else ())


@pytest.mark.parametrize("dtype,shape,causal,bias_shape,bias_dtype,mask_shape,variants",
                         [_strip_param(n) for n in STRIP_DBIAS])
def test_dbias_strips(cp, rng, strips, launches, dtype, shape, causal, bias_shape, bias_dtype, mask_shape,
                      variants):
    from cupyflash import _launch

    if _launch.compute_capability(cp.cuda.Device().id) != (9, 0):
        pytest.skip("the strip dbias kernel runs on compute capability 9.0")
    full = _score_shape(shape)
    bias = bias_values(rng, bias_shape(*full), dtype if bias_dtype == "q" else "float32")
    mask = None if mask_shape is None else keep_mask(rng, mask_shape(*full), 0.8)
    if mask is not None:
        mask[..., 5, :] = False  # a row that sees no key: its dbias row is 0
    check(*run(cp, rng, dtype, shape, causal, bias=bias, mask=mask, variants=variants), causal, variants)
    assert "flash_bwd_dbias_strip_sm90_kernel" in launches
    assert "flash_bwd_dbias_sm90_kernel" not in launches and "flash_bwd_dbias_kernel" not in launches


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dbias_strips_deterministic(cp, rng, strips, launches, head_dim, causal):
    """The strips sum each tile's pairs in the tile kernel's order: the same bits run after
    run, and the same bits as the tile kernel."""
    from cupyflash import _gpu, _launch, dispatch

    if _launch.compute_capability(cp.cuda.Device().id) != (9, 0):
        pytest.skip("the strip dbias kernel runs on compute capability 9.0")
    shape = (2, 257, 190, 4, 2, head_dim)
    full = _score_shape(shape)
    bias = bias_values(rng, BROADCAST["per-head"](*full), "float32")
    inputs, fwd, grads, scores = run(cp, rng, "float16", shape, causal, bias=bias)
    check(inputs, fwd, grads, scores, causal)
    assert "flash_bwd_dbias_strip_sm90_kernel" in launches
    q, k, v, dout = (dev(cp, x) for x in inputs)
    kw = dict(causal=causal, **dtype_kw(cp, "float16"), attn_bias=cp.asarray(scores[0]))
    out, lse = cupyflash.flash_attn_fwd(q, k, v, **kw)
    again = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, return_dbias=True, **kw)[-1]
    np.testing.assert_array_equal(grads[-1].view(np.uint8), host(again).view(np.uint8))
    dispatch.DBIAS_STRIP_MIN_WAVES = 1e9  # the tile kernel (restored by the fixture)
    _gpu.clear_plans()
    del launches[:]
    tiles = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, return_dbias=True, **kw)[-1]
    assert "flash_bwd_dbias_sm90_kernel" in launches
    np.testing.assert_array_equal(grads[-1].view(np.uint8), host(tiles).view(np.uint8))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dbias_strips_varlen(cp, rng, strips, launches, head_dim, causal):
    """A packed batch: sequences with no row in a strip (0 rows, 1 row) and no key (0 keys)."""
    from cupyflash import _launch

    if _launch.compute_capability(cp.cuda.Device().id) != (9, 0):
        pytest.skip("the strip dbias kernel runs on compute capability 9.0")
    _varlen(cp, rng, "float16", head_dim, "full", causal, max(LENS_K) + 2)
    assert "flash_bwd_dbias_strip_sm90_kernel" in launches
