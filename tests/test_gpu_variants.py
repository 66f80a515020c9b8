"""Attention variants (issue 13) on the GPU against the float64 reference: window_size,
softcap, alibi_slopes, sinks and dropout_p with rng_state, alone and combined, through
the public functions (dense, varlen, KV cache).

Every test body runs twice, through the ``xp`` fixture: on NumPy arrays (the CPU
path, the executable specification; runs anywhere) and on CuPy arrays (the GPU
kernels; marked ``gpu``, skipped with the reason where no GPU is usable).  The
same assertions hold for both.

Tolerance (:mod:`cupyflash.testing`): ``max|got - ref64| <= 2 * max|naive - ref64|
+ FLOOR`` for out and lse, ``3 *`` for the gradients (dq, dk, dv, dsinks), where
``naive`` is :func:`cupyflash.reference.naive_attention` with the same variants in
the input dtype; FLOOR is 1e-3 as in the other GPU tests.  Dropout is compared
with the keep mask :mod:`cupyflash._philox` draws from the same ``rng_state``.

On the GPU every CuPy allocation made during a test starts as 0xFF bytes (NaN in
float16, bfloat16 and float32), and the dense functions write into NaN-poisoned
``out=``/``lse=``/``dq=``/``dk=``/``dv=`` arrays: an element that is never
written shows up as NaN.

Shapes stay small (seqlen <= 512, batch <= 2) and the variants are spread over a
few fixed configurations (dtype, head_dim, causal, lengths, GQA) instead of their
product, so that each kernel variant compiles once or twice in the run.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import cupyflash
from cupyflash import _philox, reference, testing
from test_kvcache import _sequence, i32  # sibling modules
from test_varlen import cu_seqlens, packed_reference, sequence_variants

FLOOR = 1e-3
SEED, OFFSET = 0x5EED_0FD2_0901_7ABC, 3
_HAS_BF16 = importlib.util.find_spec("ml_dtypes") is not None
_NO_BF16 = pytest.mark.skipif(not _HAS_BF16, reason="bfloat16 needs ml_dtypes (pip install ml_dtypes)")


# ----------------------------------------------------------------------------
# NumPy or CuPy: the array module, NaN-poisoned memory, moving arrays
# ----------------------------------------------------------------------------


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """``numpy`` (the CPU path) or ``cupy`` (the GPU), every CuPy allocation NaN-poisoned."""
    if request.param == "numpy":
        yield np
        return
    cp = pytest.importorskip("cupy")
    with testing.poisoned_allocations(cp):
        yield cp


def _is_bf16(dtype) -> bool:
    return np.dtype(testing.resolve_dtype(dtype)).name == "bfloat16"


def dev(xp, x):
    """A host array on ``xp``: a copy for NumPy, cupy storage (bfloat16 as its uint16
    bits) for CuPy; None stays None."""
    if x is None:
        return None
    if xp is np:
        return x.copy()
    return xp.asarray(x.view(np.uint16) if _is_bf16(x.dtype) else x)


def host(x, dtype=None):
    """An ``xp`` result on the host, bfloat16 storage viewed as ml_dtypes.bfloat16."""
    if x is None:
        return None
    if not isinstance(x, np.ndarray):
        x = x.get()
    if dtype is not None and _is_bf16(dtype) and x.dtype == np.uint16:
        x = x.view(testing.resolve_dtype("bfloat16"))
    return x


def dtype_kw(xp, dtype):
    """``dtype="bfloat16"`` for CuPy bfloat16 storage, else nothing."""
    return {"dtype": "bfloat16"} if xp is not np and _is_bf16(dtype) else {}


def poisoned(xp, shape, dtype):
    """A NaN-filled output buffer (bfloat16 NaN bits on CuPy)."""
    if xp is not np and _is_bf16(dtype):
        return xp.full(shape, 0xFFFF, dtype=np.uint16)
    return xp.full(shape, np.nan, dtype=testing.resolve_dtype(dtype))


def _dtypes(*names):
    return [pytest.param(n, marks=_NO_BF16) if n == "bfloat16" else n for n in names]


# ----------------------------------------------------------------------------
# Variants: the public keywords on xp, the reference's keywords on the host
# ----------------------------------------------------------------------------


def alibi_heads(nheads):
    """The ALiBi paper's slopes 2^(-8 h / nheads), float32."""
    return (2.0 ** (-8.0 * np.arange(1, nheads + 1) / nheads)).astype(np.float32)


def alibi_batch_heads(rng, batch, nheads):
    return (alibi_heads(nheads)[None, :] * rng.uniform(0.5, 2.0, (batch, 1))).astype(np.float32)


def sink_logits(rng, nheads):
    """Sinks that matter (lse is about log(seqlen_k)), one of them -inf (no sink)."""
    sinks = rng.uniform(1.0, 6.0, nheads).astype(np.float32)
    sinks[-1] = -np.inf
    return sinks


def on_xp(xp, variants):
    """The variants as the public functions take them on ``xp`` (arrays moved there)."""
    return {name: (xp.asarray(value) if isinstance(value, np.ndarray) and xp is not np else value)
            for name, value in variants.items()}


def for_reference(variants, batch, nheads, seqlen_q, seqlen_k):
    """The reference's keywords: ``rng_state`` becomes the Philox keep mask of the dense batch."""
    ref = dict(variants)
    rng_state = ref.pop("rng_state", None)
    if ref.get("dropout_p"):
        ref["dropout_mask"] = _philox.dropout_keep_mask(*rng_state, ref["dropout_p"], batch, nheads,
                                                        seqlen_q, seqlen_k)
    return ref


def run_dense(xp, rng, dtype, shape, causal, variants, softmax_scale=None, deterministic=False):
    """Fresh inputs; forward then backward through the public functions into poisoned
    outputs.  Returns the host inputs ``(q, k, v, dout)``, host ``(out, lse)`` and host
    gradients (with dsinks when sinks are given)."""
    batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim = shape
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    d_q, d_k, d_v, d_dout = (dev(xp, x) for x in (q, k, v, dout))
    kw = dict(softmax_scale=softmax_scale, causal=causal, **dtype_kw(xp, dtype), **on_xp(xp, variants))
    out, lse = cupyflash.flash_attn_fwd(d_q, d_k, d_v, out=poisoned(xp, q.shape, dtype),
                                        lse=poisoned(xp, (batch, nheads_q, seqlen_q), np.float32), **kw)
    assert isinstance(out, xp.ndarray) and out.dtype == d_q.dtype and lse.dtype == np.float32
    grads = cupyflash.flash_attn_bwd(d_dout, d_q, d_k, d_v, out, lse, deterministic=deterministic,
                                     dq=poisoned(xp, q.shape, dtype), dk=poisoned(xp, k.shape, dtype),
                                     dv=poisoned(xp, v.shape, dtype), **kw)
    assert len(grads) == (4 if variants.get("sinks") is not None else 3)
    return (q, k, v, dout), (host(out, dtype), host(lse)), tuple(host(g, dtype) for g in grads)


def check_dense(inputs, fwd, grads, causal, variants, softmax_scale=None):
    """Forward and gradients against the float64 reference with the naive rule."""
    q, k, v, dout = inputs
    batch, seqlen_q, nheads = q.shape[:3]
    ref_kw = for_reference(variants, batch, nheads, seqlen_q, k.shape[1])
    testing.assert_fwd_matches_reference(q, k, v, *fwd, softmax_scale=softmax_scale, causal=causal, floor=FLOOR,
                                         **ref_kw)
    dsinks = grads[3] if len(grads) == 4 else None
    if dsinks is not None:
        assert dsinks.shape == (nheads,)
    testing.assert_bwd_matches_reference(dout, q, k, v, *grads[:3], softmax_scale=softmax_scale, causal=causal,
                                         dsinks=dsinks, out=fwd[0], floor=FLOOR, **ref_kw)


# ----------------------------------------------------------------------------
# Each variant alone, over a few configurations
# ----------------------------------------------------------------------------

# id -> (dtype, (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), causal)
CONFIGS = {
    "f16-d64-256x256-gqa": ("float16", (2, 256, 256, 8, 2, 64), False),
    "bf16-d128-200x333-gqa-causal": ("bfloat16", (1, 200, 333, 8, 2, 128), True),
    "f16-d96-333x200-causal": ("float16", (2, 333, 200, 4, 4, 96), True),  # top rows see no key
    "bf16-d64-130x512-gqa": ("bfloat16", (2, 130, 512, 8, 2, 64), False),
}

# id -> (variants given rng and the shape, softmax_scale as a multiple of 1/sqrt(head_dim))
ALONE = {
    "window-causal": (lambda rng, s: {"window_size": (-1, 0)}, 1.0),
    "window-64-0": (lambda rng, s: {"window_size": (64, 0)}, 1.0),
    "window-0-64": (lambda rng, s: {"window_size": (0, 64)}, 1.0),
    "window-128-32": (lambda rng, s: {"window_size": (128, 32)}, 1.0),
    "window-32-8": (lambda rng, s: {"window_size": (32, 8)}, 1.0),  # rows i < seqlen_q - seqlen_k - 8 see none
    "softcap-30": (lambda rng, s: {"softcap": 30.0}, 8.0),  # scores of about +-30: tanh bends them
    "softcap-5": (lambda rng, s: {"softcap": 5.0}, 2.0),
    "alibi-heads": (lambda rng, s: {"alibi_slopes": alibi_heads(s[3])}, 1.0),
    "alibi-batch-heads": (lambda rng, s: {"alibi_slopes": alibi_batch_heads(rng, s[0], s[3])}, 1.0),
    "sinks": (lambda rng, s: {"sinks": sink_logits(rng, s[3])}, 1.0),
}


def _config_params(names):
    for name in names:
        dtype = CONFIGS[name][0]
        yield pytest.param(name, marks=_NO_BF16 if dtype == "bfloat16" else (), id=name)


#: Configurations whose NumPy runs of test_variant_alone sit behind ``slow`` (the CPU
#: path's arithmetic is the same as in the others; the GPU runs them all).
NUMPY_SLOW = ("f16-d64-256x256-gqa", "bf16-d64-130x512-gqa")


def _xp_config_params(names):
    """(xp, config) pairs, the xp fixture parametrized indirectly: cupy ones marked ``gpu``,
    NumPy ones of NUMPY_SLOW marked ``slow``."""
    for xp_name in ("numpy", "cupy"):
        for name in names:
            marks = [_NO_BF16] if CONFIGS[name][0] == "bfloat16" else []
            if xp_name == "cupy":
                marks.append(pytest.mark.gpu)
            elif name in NUMPY_SLOW:
                marks.append(pytest.mark.slow)
            yield pytest.param(xp_name, name, marks=marks, id=f"{xp_name}-{name}")


@pytest.mark.parametrize("xp,config", list(_xp_config_params(CONFIGS)), indirect=["xp"])
@pytest.mark.parametrize("variant", list(ALONE))
def test_variant_alone(xp, rng, variant, config):
    dtype, shape, causal = CONFIGS[config]
    make, scale_mult = ALONE[variant]
    variants = make(rng, shape)
    scale = scale_mult / np.sqrt(shape[-1])
    inputs, fwd, grads = run_dense(xp, rng, dtype, shape, causal, variants, scale)
    check_dense(inputs, fwd, grads, causal, variants, scale)


# ----------------------------------------------------------------------------
# Combinations
# ----------------------------------------------------------------------------

# id -> (causal, variants given rng and the shape)
COMBOS = {
    "window+causal+gqa": (True, lambda rng, s: {"window_size": (48, -1)}),
    "softcap+alibi": (None, lambda rng, s: {"softcap": 5.0, "alibi_slopes": alibi_batch_heads(rng, s[0], s[3])}),
    "sinks+window": (None, lambda rng, s: {"window_size": (40, 16), "sinks": sink_logits(rng, s[3])}),
    "window+softcap+alibi+sinks": (True, lambda rng, s: {"window_size": (100, 0), "softcap": 8.0,
                                                         "alibi_slopes": alibi_heads(s[3]),
                                                         "sinks": sink_logits(rng, s[3])}),
}


@pytest.mark.parametrize("config", list(_config_params(["f16-d64-256x256-gqa", "bf16-d128-200x333-gqa-causal"])))
@pytest.mark.parametrize("combo", list(COMBOS))
def test_combination(xp, rng, combo, config):
    dtype, shape, causal = CONFIGS[config]
    forced, make = COMBOS[combo]
    causal = causal if forced is None else forced
    variants = make(rng, shape)
    inputs, fwd, grads = run_dense(xp, rng, dtype, shape, causal, variants)
    check_dense(inputs, fwd, grads, causal, variants)
    q, k, v, _ = inputs
    only_out = cupyflash.flash_attn(dev(xp, q), dev(xp, k), dev(xp, v), causal=causal, **dtype_kw(xp, dtype),
                                    **on_xp(xp, variants))
    np.testing.assert_array_equal(host(only_out, dtype), fwd[0])


# ----------------------------------------------------------------------------
# Dropout against the reference given the Philox mask
# ----------------------------------------------------------------------------

DROPOUT_CASES = [
    pytest.param(config, 0.17, {}, id=f"{config}-p0.17") for config in
    ["f16-d64-256x256-gqa", "bf16-d128-200x333-gqa-causal", "f16-d96-333x200-causal"]
] + [pytest.param("f16-d64-256x256-gqa", 0.5, {"window_size": (64, 16), "sinks": "sinks"},
                  id="f16-d64-256x256-gqa-p0.5-window+sinks")]


@pytest.mark.parametrize("config,p,extra", DROPOUT_CASES)
def test_dropout_matches_reference_with_its_mask(xp, rng, config, p, extra):
    """Forward and backward with dropout equal the reference that applies the keep mask
    cupyflash._philox draws from the same rng_state (the backward draws it again)."""
    dtype, shape, causal = CONFIGS[config]
    variants = {"dropout_p": p, "rng_state": (SEED, OFFSET), **extra}
    if variants.get("sinks") == "sinks":
        variants["sinks"] = sink_logits(rng, shape[3])
    inputs, fwd, grads = run_dense(xp, rng, dtype, shape, causal, variants)
    check_dense(inputs, fwd, grads, causal, variants)


def _one_hot_problem(xp, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv):
    """Zero q and k (uniform scores) and one-hot values, head_dim = seqlen_k: the
    output's column j is > 0 exactly where key j was kept."""
    q = np.zeros((batch, seqlen_q, nheads_q, seqlen_k), np.float16)
    k = np.zeros((batch, seqlen_k, nheads_kv, seqlen_k), np.float16)
    v = np.ascontiguousarray(np.broadcast_to(np.eye(seqlen_k, dtype=np.float16)[None, :, None], k.shape))
    return dev(xp, q), dev(xp, k), dev(xp, v)


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads_q,nheads_kv,causal,p", [
    pytest.param(2, 512, 128, 8, 2, False, 0.3, id="2x512x128-h8-gqa-p0.3"),
    pytest.param(2, 100, 64, 4, 4, True, 0.9, id="2x100x64-h4-causal-p0.9"),
])
def test_dropout_mask_is_the_philox_mask(xp, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, causal, p):
    """The keep mask the forward applies (read from its output) equals
    cupyflash._philox.dropout_keep_mask bit for bit, and its keep rate is within 4
    sigma of 1 - p (2**20 draws in the first case).  (The debug mask function has no
    GPU path: the GPU's own mask is read from its output.)"""
    q, k, v = _one_hot_problem(xp, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv)
    out, _ = cupyflash.flash_attn_fwd(q, k, v, causal=causal, dropout_p=p, rng_state=(SEED, OFFSET))
    seen = host(out).transpose(0, 2, 1, 3) > 0  # (batch, nheads, seqlen_q, seqlen_k)
    keep = _philox.dropout_keep_mask(SEED, OFFSET, p, batch, nheads_q, seqlen_q, seqlen_k)
    visible = reference.visible_keys(seqlen_q, seqlen_k, causal)
    np.testing.assert_array_equal(seen, keep & visible)
    drawn = int(visible.sum()) * batch * nheads_q
    rate = float(seen.sum()) / drawn
    sigma = np.sqrt(p * (1 - p) / drawn)
    assert abs(rate - (1 - p)) <= 4 * sigma, (rate, 1 - p, sigma)


def test_dropout_mask_of_a_packed_batch_is_the_dense_one(xp):
    """Varlen: sequence b's mask is the one drawn at batch index b, rows and columns
    counted within the sequence."""
    lens_q, lens_k, nheads, p = (30, 64, 7), (64, 20, 50), 4, 0.5
    q = np.zeros((sum(lens_q), nheads, 64), np.float16)
    k = np.zeros((sum(lens_k), nheads, 64), np.float16)
    v = np.ascontiguousarray(np.concatenate([np.broadcast_to(np.eye(64, dtype=np.float16)[:n, None], (n, nheads, 64))
                                             for n in lens_k]))
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    out, _ = cupyflash.flash_attn_varlen_fwd(dev(xp, q), dev(xp, k), dev(xp, v), dev(xp, cu_q), dev(xp, cu_k),
                                             64, 64, dropout_p=p, rng_state=(SEED, OFFSET))
    out = host(out)
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        keep = _philox.dropout_keep_mask(SEED, OFFSET, p, b + 1, nheads, n_q, n_k)[b]
        rows = out[cu_q[b]:cu_q[b + 1]]
        np.testing.assert_array_equal(rows[:, :, :n_k].transpose(1, 0, 2) > 0, keep)
        assert (rows[:, :, n_k:] == 0).all()


def test_dropout_same_state_is_bitwise_and_another_is_not(xp, rng):
    """The same rng_state gives the same bits (forward and deterministic backward); a
    different seed or offset gives a different output."""
    dtype, shape, causal = CONFIGS["f16-d64-256x256-gqa"]
    batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim = shape
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    d = [dev(xp, x) for x in (q, k, v, dout)]

    def run(rng_state):
        kw = dict(causal=True, dropout_p=0.2, rng_state=rng_state)
        out, lse = cupyflash.flash_attn_fwd(*d[:3], **kw)
        grads = cupyflash.flash_attn_bwd(d[3], *d[:3], out, lse, deterministic=True, **kw)
        return [host(x) for x in (out, lse, *grads)]

    first, again = run((SEED, OFFSET)), run((SEED, OFFSET))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    for other in ((SEED + 1, OFFSET), (SEED, OFFSET + 1)):
        changed = run(other)
        assert not np.array_equal(changed[0], first[0])
        np.testing.assert_array_equal(changed[1], first[1])  # lse is the undropped one


# ----------------------------------------------------------------------------
# Varlen with variants
# ----------------------------------------------------------------------------

# id -> (dtype, lens_q, lens_k, nheads_q, nheads_kv, head_dim)
VARLEN_LAYOUTS = {
    "f16-d64-mixed": ("float16", (5, 130, 1, 0, 64), (7, 130, 1, 3, 200), 8, 2, 64),
    "bf16-d128-q-ne-k": ("bfloat16", (17, 200, 3, 9), (40, 150, 0, 9), 8, 2, 128),
}

# id -> (causal, variants given rng, the number of sequences and nheads_q)
VARLEN_VARIANTS = {
    "window+causal+gqa": (True, lambda rng, b, h: {"window_size": (32, -1)}),
    "dropout+causal": (True, lambda rng, b, h: {"dropout_p": 0.2, "rng_state": (SEED, OFFSET)}),
    "softcap": (False, lambda rng, b, h: {"softcap": 5.0}),
    "alibi-batch-heads": (False, lambda rng, b, h: {"alibi_slopes": alibi_batch_heads(rng, b, h)}),
    "sinks": (False, lambda rng, b, h: {"sinks": sink_logits(rng, h)}),
    "sinks+window": (True, lambda rng, b, h: {"window_size": (24, 0), "sinks": sink_logits(rng, h)}),
    "everything": (True, lambda rng, b, h: {"window_size": (60, -1), "softcap": 8.0,
                                            "alibi_slopes": alibi_heads(h), "sinks": sink_logits(rng, h),
                                            "dropout_p": 0.1, "rng_state": (SEED, OFFSET)}),
}


def run_varlen(xp, rng, layout, causal, variants):
    """Fresh packed inputs through flash_attn_varlen_fwd/_bwd; host inputs and results.
    ``layout`` is ``(dtype, lens_q, lens_k, nheads_q, nheads_kv, head_dim)``."""
    dtype, lens_q, lens_k, nheads_q, nheads_kv, head_dim = layout
    q = testing.random_normal(rng, (sum(lens_q), nheads_q, head_dim), dtype)
    k, v = (testing.random_normal(rng, (sum(lens_k), nheads_kv, head_dim), dtype) for _ in range(2))
    dout = testing.random_normal(rng, q.shape, dtype)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    args = (dev(xp, cu_q), dev(xp, cu_k), max(lens_q), max(lens_k))
    kw = dict(causal=causal, **dtype_kw(xp, dtype), **on_xp(xp, variants))
    d_q, d_k, d_v, d_dout = (dev(xp, x) for x in (q, k, v, dout))
    out, lse = cupyflash.flash_attn_varlen_fwd(d_q, d_k, d_v, *args, **kw)
    assert out.shape == q.shape and lse.shape == (nheads_q, q.shape[0])
    grads = cupyflash.flash_attn_varlen_bwd(d_dout, d_q, d_k, d_v, out, lse, *args, **kw)
    names = ("dq", "dk", "dv", "dsinks")[:len(grads)]
    results = dict(out=host(out, dtype), lse=host(lse), **{n: host(g, dtype) for n, g in zip(names, grads)})
    return (q, k, v, dout, cu_q, cu_k), results


def check_packed(results, refs):
    for name, got in results.items():
        ref, naive = refs[name]
        factor = testing.OUT_FACTOR if name in ("out", "lse") else testing.GRAD_FACTOR
        testing.assert_close_to_reference(name, got, ref, naive, factor, FLOOR)


@pytest.mark.parametrize("layout", [pytest.param(n, marks=_NO_BF16 if c[0] == "bfloat16" else ())
                                    for n, c in VARLEN_LAYOUTS.items()])
@pytest.mark.parametrize("name", list(VARLEN_VARIANTS))
def test_varlen_variants(xp, rng, name, layout):
    """Per sequence against the reference: aligned to its own lengths, its row of
    (batch, nheads_q) slopes, its dropout mask drawn at batch index b."""
    causal, make = VARLEN_VARIANTS[name]
    _, lens_q, _, nheads_q, _, _ = VARLEN_LAYOUTS[layout]
    variants = make(rng, len(lens_q), nheads_q)
    (q, k, v, dout, cu_q, cu_k), results = run_varlen(xp, rng, VARLEN_LAYOUTS[layout], causal, variants)
    assert ("dsinks" in results) == ("sinks" in variants)
    check_packed(results, packed_reference(q, k, v, dout, cu_q, cu_k, causal, **variants))


# ----------------------------------------------------------------------------
# flash_attn_with_kvcache with variants (no dropout there)
# ----------------------------------------------------------------------------

# id -> (causal, variants given rng, batch and nheads_q)
KV_VARIANTS = {
    "window-causal": (True, lambda rng, b, h: {"window_size": (24, 0)}),
    "window": (False, lambda rng, b, h: {"window_size": (40, 8)}),
    "softcap": (True, lambda rng, b, h: {"softcap": 5.0}),
    "alibi-batch-heads": (True, lambda rng, b, h: {"alibi_slopes": alibi_batch_heads(rng, b, h)}),
    "alibi-heads": (False, lambda rng, b, h: {"alibi_slopes": alibi_heads(h)}),
    "sinks": (True, lambda rng, b, h: {"sinks": sink_logits(rng, h)}),
    "everything": (True, lambda rng, b, h: {"window_size": (30, 0), "softcap": 8.0, "alibi_slopes": alibi_heads(h),
                                            "sinks": sink_logits(rng, h)}),
}


def _kv_cases():
    """Each variant on a decode step (seqlen_q 1) and on a chunk of 5 rows, one on a
    paged cache and the other on a dense one (alternating), dtype by the cache kind."""
    for i, name in enumerate(KV_VARIANTS):
        for seqlen_q, paged in ((1, i % 2 == 0), (5, i % 2 == 1)):
            dtype = "bfloat16" if paged else "float16"
            yield pytest.param(name, seqlen_q, paged, dtype, marks=_NO_BF16 if dtype == "bfloat16" else (),
                               id=f"{name}-q{seqlen_q}-{'paged' if paged else 'dense'}-{dtype}")


@pytest.mark.parametrize("name,seqlen_q,paged,dtype", list(_kv_cases()))
def test_kvcache_variants(xp, rng, name, seqlen_q, paged, dtype):
    """The append and the attention on xp against the CPU path of the same call on NumPy
    copies: the same caches after the append (bitwise), and out/lse within the naive rule
    of the float64 reference computed per sequence on the keys the CPU path gathered."""
    causal, make = KV_VARIANTS[name]
    batch, capacity, page_size, nheads_q, nheads_kv, head_dim = 3, 192, 32, 8, 2, 128
    variants = make(rng, batch, nheads_q)
    lengths = i32([0, 77, 150])
    q = testing.random_normal(rng, (batch, seqlen_q, nheads_q, head_dim), dtype)
    k, v = (testing.random_normal(rng, (batch, seqlen_q, nheads_kv, head_dim), dtype) for _ in range(2))
    table = None
    if paged:
        blocks = capacity // page_size
        table = i32(rng.permutation(batch * blocks + 2)[:batch * blocks].reshape(batch, blocks))
        cache_shape = (batch * blocks + 2, page_size, nheads_kv, head_dim)
    else:
        cache_shape = (batch, capacity, nheads_kv, head_dim)
    k_cache, v_cache = (testing.random_normal(rng, cache_shape, dtype) for _ in range(2))

    cpu_k, cpu_v = k_cache.copy(), v_cache.copy()
    cupyflash.flash_attn_with_kvcache(q, cpu_k, cpu_v, k, v, cache_seqlens=lengths, block_table=table,
                                      causal=causal, return_lse=True, **variants)
    d_k_cache, d_v_cache = dev(xp, k_cache), dev(xp, v_cache)
    out, lse = cupyflash.flash_attn_with_kvcache(
        dev(xp, q), d_k_cache, d_v_cache, dev(xp, k), dev(xp, v), cache_seqlens=dev(xp, lengths),
        block_table=dev(xp, table), causal=causal, return_lse=True, **dtype_kw(xp, dtype), **on_xp(xp, variants))
    np.testing.assert_array_equal(host(d_k_cache, dtype), cpu_k)
    np.testing.assert_array_equal(host(d_v_cache, dtype), cpu_v)

    ref_out, naive_out = np.zeros(q.shape), np.zeros(q.shape)
    ref_lse, naive_lse = (np.full((batch, nheads_q, seqlen_q), -np.inf) for _ in range(2))
    for b in range(batch):
        n_k = int(lengths[b]) + seqlen_q
        keys, values = (_sequence(c, b, n_k, None, table) for c in (cpu_k, cpu_v))
        seq = sequence_variants(variants, b, seqlen_q, n_k, nheads_q)
        o, l = reference.attention_fwd(q[b:b + 1], keys, values, None, causal, **seq)
        ref_out[b], ref_lse[b] = o[0], l[0]
        o, l = reference.naive_attention(q[b:b + 1], keys, values, None, causal, testing.naive_dtype(q.dtype), **seq)
        naive_out[b], naive_lse[b] = o[0], l[0]
    testing.assert_close_to_reference("out", host(out, dtype), ref_out, naive_out, testing.OUT_FACTOR, FLOOR)
    testing.assert_close_to_reference("lse", host(lse), ref_lse, naive_lse, testing.OUT_FACTOR, FLOOR)


# ----------------------------------------------------------------------------
# Extreme logits: the largest term of a row is exactly exp2(0) = 1
# ----------------------------------------------------------------------------


def _extreme_problem(xp, dtype, head_dim, logit, seqlen_k=1, dominant=0, key_dims=None):
    """One query row; key ``dominant`` of ``seqlen_k`` has scaled logit ``logit`` (the
    others 0).  q = 256 in every element, the key 256 in its first ``key_dims`` (default
    all): q.k = 65536 * key_dims exactly; a key_dims not a power of two makes
    softmax_scale * q.k inexact (a rounding residual in the raw-score FFMA)."""
    rng = np.random.default_rng(7)
    q = np.full((1, 1, 2, head_dim), 256.0, np.float32).astype(testing.resolve_dtype(dtype))
    k = np.zeros((1, seqlen_k, 1, head_dim), np.float32)
    key_dims = head_dim if key_dims is None else key_dims
    k[0, dominant, :, :key_dims] = 256.0
    k = k.astype(q.dtype)
    v = testing.random_normal(rng, (1, seqlen_k, 1, head_dim), dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    scale = logit / (65536.0 * key_dims)
    return (q, k, v, dout), [dev(xp, x) for x in (q, k, v, dout)], scale


def _check_extreme(xp, dtype, head_dim, logit, variants, seqlen_k=1, dominant=0, key_dims=None):
    (q, k, v, dout), d, scale = _extreme_problem(xp, dtype, head_dim, logit, seqlen_k, dominant, key_dims)
    kw = dict(softmax_scale=scale, **dtype_kw(xp, dtype), **on_xp(xp, variants))
    out, lse = cupyflash.flash_attn_fwd(*d[:3], **kw)
    got = host(out, dtype)
    want = np.broadcast_to(v[:, dominant:dominant + 1], got.shape)  # both query heads read KV head 0
    np.testing.assert_array_equal(got, want)
    # lse is the logit (a tanh of float32 accuracy, maybe approximate, with softcap)
    expect = reference.attention_fwd(q, k, v, scale, **variants)[1]
    np.testing.assert_allclose(host(lse), expect, rtol=1e-3 if "softcap" in variants else 1e-5)
    grads = cupyflash.flash_attn_bwd(d[3], *d[:3], out, lse, **kw)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), grads):
        g = host(g, dtype).astype(np.float32)
        assert np.isfinite(g).all(), f"{name}: {g}"
    if logit < 1e4 and not variants:
        # P = 1 on the key (less the preprocess's raise of lse_log2, 2^-20 of it: P > 0.99 here): dv is dout
        # summed over the two query heads; past 1e4 only finiteness is asked (lse's ulp grows)
        want_dv = np.zeros(v.shape, np.float32)
        want_dv[:, dominant] = dout.astype(np.float32).sum(axis=2, keepdims=True)[:, 0]
        np.testing.assert_allclose(host(grads[2], dtype).astype(np.float32), want_dv, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("dtype", _dtypes("float16", "bfloat16"))
@pytest.mark.parametrize("logit", [2e3, 1e9, 1e10, 3e10])
def test_extreme_logits_give_the_value_row(xp, logit, dtype, head_dim):
    """A single key at scaled logit 2e3 (below the raw-score FFMA's bound: online_softmax.cuh)
    or 1e9 .. 3e10 (fp16 inputs near 6e4 reach 3e10):
    out is the value row exactly, lse the logit; the backward is finite."""
    _check_extreme(xp, dtype, head_dim, logit, {})


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", _dtypes("float16", "bfloat16"))
@pytest.mark.parametrize("logit", [2e3, 5e3, 1e9, 3e10])
def test_extreme_logits_inexact_product(xp, logit, dtype, head_dim):
    """As above with q.k = 65536 * 3/4 head_dim, so softmax_scale * q.k rounds: the ws
    forward's raw-score FFMA leaves a residual (2e3: below its bound, it rounds away; 5e3
    and up: the warp scales its scores first), and out is still the value row exactly."""
    _check_extreme(xp, dtype, head_dim, logit, {}, key_dims=head_dim * 3 // 4)


@pytest.mark.parametrize("dtype", _dtypes("float16", "bfloat16"))
def test_extreme_logits_one_dominant_key(xp, dtype):
    """Among 70 keys (two key blocks) one at logit 3e10, the others at 0: its value row."""
    _check_extreme(xp, dtype, 64, 3e10, {}, seqlen_k=70, dominant=41)


@pytest.mark.parametrize("dtype", _dtypes("float16", "bfloat16"))
@pytest.mark.parametrize("variant", [
    pytest.param({"softcap": 1e12}, id="softcap"),
    pytest.param({"alibi_slopes": np.full(2, 0.25, np.float32)}, id="alibi"),
    pytest.param({"window_size": (0, 0)}, id="window"),
    pytest.param({"sinks": np.zeros(2, np.float32)}, id="sinks"),
])
def test_extreme_logits_with_variants(xp, variant, dtype):
    _check_extreme(xp, dtype, 64, 3e10, variant)


# ----------------------------------------------------------------------------
# Rows that see no key
# ----------------------------------------------------------------------------

EMPTY_ROWS = {  # id -> (shape, causal, variants given rng, the rows that see no key)
    "causal+window+softcap+alibi": ((1, 300, 100, 4, 2, 64), True,
                                    lambda rng: {"window_size": (16, -1), "softcap": 5.0,
                                                 "alibi_slopes": alibi_heads(4)}, np.s_[:200]),
    "window-right-edge": ((2, 300, 90, 4, 4, 128), False, lambda rng: {"window_size": (8, 4)}, np.s_[:206]),
}


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", list(EMPTY_ROWS))
def test_rows_that_see_no_key(xp, rng, case, with_sinks):
    """out 0, lse -inf (with sinks: the sink, as the reference defines), dq 0 on those
    rows, no NaN anywhere; the rest within the rule."""
    shape, causal, make, empty = EMPTY_ROWS[case]
    variants = make(rng)
    if with_sinks:
        variants["sinks"] = rng.uniform(-2.0, 2.0, shape[3]).astype(np.float32)
    inputs, (out, lse), grads = run_dense(xp, rng, "float16", shape, causal, variants)
    for x in (out, lse) + grads:
        assert not np.isnan(x.astype(np.float32)).any()
    assert (out[:, empty] == 0).all() and (grads[0][:, empty] == 0).all()
    if not with_sinks:
        assert (lse[:, :, empty] == -np.inf).all()
    check_dense(inputs, (out, lse), grads, causal, variants)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_varlen_sequence_without_keys(xp, rng, with_sinks):
    """Sequence 1 has queries and no key, the first 10 rows of sequence 0 see no key
    (causal, 20 queries on 10 keys): out 0, lse -inf (or the sink), dq 0; no NaN."""
    layout = ("float16", (20, 3, 50), (10, 0, 50), 8, 2, 64)
    variants = {"window_size": (40, 0), "softcap": 5.0}
    if with_sinks:
        variants["sinks"] = sink_logits(rng, 8)
    (q, k, v, dout, cu_q, cu_k), results = run_varlen(xp, rng, layout, True, variants)
    for x in results.values():
        assert not np.isnan(x.astype(np.float32)).any()
    empty = np.r_[0:10, 20:23]
    assert (results["out"][empty] == 0).all() and (results["dq"][empty] == 0).all()
    if not with_sinks:
        assert (results["lse"][:, empty] == -np.inf).all()
    check_packed(results, packed_reference(q, k, v, dout, cu_q, cu_k, True, **variants))
