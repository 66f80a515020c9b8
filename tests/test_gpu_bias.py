"""The GPU forward's ``attn_bias`` / ``attn_mask`` (issue 14) against the float64 reference.

Both forward kernels: the wgmma kernel (D=64 and 128 on cc 9.0) and the mma.sync
kernel (D=96, D=32, and a short seqlen_q that takes split-KV; every head_dim on
cc 8.x), each with seqlens that are not multiples of the tiles. Held to the rule
of the other variant GPU tests (:mod:`cupyflash.testing`): ``max|got - ref64| <=
2 * max|naive - ref64| + FLOOR`` for out and lse, with fresh random inputs, every
CuPy allocation NaN-poisoned (0xFF bytes) and the outputs written into NaN-filled
``out=`` / ``lse=`` buffers, so an element never written fails; ``-inf`` in lse
must match exactly.

Covered: every broadcast shape (full, (1, H, N, N), (B, 1, N, N), (B, 1, 1, N),
(B, 1, N, 1), rank 2), q-dtype and float32 biases, bool masks, a stride-0
``cupy.broadcast_to`` view, sliced, strided and transposed biases (read in pairs
or element by element, ``dispatch.score_pairs_ok``), ``-inf`` entries and fully
masked rows (out 0, lse -inf; the sink with sinks), the other variants combined
(causal, window, softcap, ALiBi, sinks), GQA, varlen, and that a broadcast bias
is never expanded to ``(B, H, N, N)`` on the device. The ``-staged`` configurations and
views (16-byte aligned rows, ``dispatch.score_vec_ok``) take the wgmma kernel's shared
memory stages (VAR_BIAS_STAGED), with key and query tails.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _variant, dispatch, testing
from test_cpu_bias import SCALE as PACKED_SCALE  # sibling modules
from test_cpu_bias import _packed_reference
from test_gpu_variants import _NO_BF16, alibi_heads, dev, dtype_kw, host, poisoned, sink_logits
from test_varlen import cu_seqlens, packed_inputs

pytestmark = pytest.mark.gpu

FLOOR = 1e-3


@pytest.fixture
def cp():
    """cupy, every allocation NaN-poisoned (0xFF bytes)."""
    cupy = pytest.importorskip("cupy")
    with testing.poisoned_allocations(cupy):
        yield cupy


# id -> (dtype, (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), causal); the
# kernel each takes on an H200
CONFIGS = {
    "bf16-d64-200x333-gqa": ("bfloat16", (2, 200, 333, 4, 2, 64), False),       # wgmma
    "f16-d128-257x190-causal": ("float16", (1, 257, 190, 4, 4, 128), True),     # wgmma; top rows see no key
    "f16-d96-130x203-gqa": ("float16", (2, 130, 203, 4, 2, 96), False),         # mma.sync
    "bf16-d32-77x129-causal": ("bfloat16", (2, 77, 129, 2, 1, 32), True),       # mma.sync
    "f16-d64-9x1500-split": ("float16", (1, 9, 1500, 2, 2, 64), False),         # mma.sync, split-KV
    # 16-byte rows (seqlen_k a multiple of 16): staged through shared memory on the wgmma
    # kernel (VAR_BIAS_STAGED), with a key tail of 16 keys and a query tail
    "bf16-d64-200x208-staged": ("bfloat16", (2, 200, 208, 4, 2, 64), False),    # wgmma, two blocks per SM
    "f16-d128-300x272-causal-staged": ("float16", (1, 300, 272, 4, 4, 128), True),  # wgmma
    "f16-d64-9x1504-split-staged": ("float16", (1, 9, 1504, 2, 2, 64), False),  # mma.sync (staged bit dropped)
}

#: name -> the bias's (or mask's) shape given (batch, nheads_q, seqlen_q, seqlen_k)
BROADCAST = {
    "full": lambda b, h, m, n: (b, h, m, n),
    "per-head": lambda b, h, m, n: (1, h, m, n),
    "per-batch": lambda b, h, m, n: (b, 1, m, n),
    "per-key": lambda b, h, m, n: (b, 1, 1, n),
    "per-query": lambda b, h, m, n: (b, 1, m, 1),   # column stride 0: element by element
    "rank2": lambda b, h, m, n: (m, n),
}


def _params(names, table=CONFIGS):
    for name in names:
        marks = _NO_BF16 if table[name][0] == "bfloat16" else ()
        yield pytest.param(name, marks=marks, id=name)


def _bias(rng, shape, dtype):
    return (2.0 * rng.standard_normal(shape, dtype=np.float32)).astype(testing.resolve_dtype(dtype))


def _mask(rng, shape, keep=0.7):
    return rng.random(shape) < keep


def _inputs(rng, dtype, shape):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = shape
    return testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype)


def _score_shape(shape):
    batch, seqlen_q, seqlen_k, nheads = shape[:4]
    return batch, nheads, seqlen_q, seqlen_k


def _fwd(cp, q, k, v, dtype, causal, device_arrays, **variants):
    """The public forward on the GPU into poisoned outputs; host (out, lse)."""
    batch, seqlen_q, nheads = q.shape[:3]
    d_q, d_k, d_v = (dev(cp, x) for x in (q, k, v))
    out, lse = poisoned(cp, q.shape, dtype), poisoned(cp, (batch, nheads, seqlen_q), np.float32)
    got = cupyflash.flash_attn_fwd(d_q, d_k, d_v, causal=causal, out=out, lse=lse, **dtype_kw(cp, dtype),
                                   **device_arrays, **variants)
    assert got[0] is out and got[1] is lse
    return host(out, dtype), host(lse)


def _check(q, k, v, fwd, causal, **ref_variants):
    return testing.assert_fwd_matches_reference(q, k, v, *fwd, causal=causal, floor=FLOOR, **ref_variants)


def _device_bias(cp, x):
    """A host bias (or mask) on the GPU: bfloat16 as its storage bits."""
    return dev(cp, x)


# ----------------------------------------------------------------------------
# Broadcast shapes, bias dtypes, masks
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(_params(CONFIGS)))
@pytest.mark.parametrize("bias_dtype", ["q", "float32"])
@pytest.mark.parametrize("shape_name", list(BROADCAST))
def test_bias_every_broadcast_shape(cp, rng, shape_name, bias_dtype, config):
    dtype, shape, causal = CONFIGS[config]
    q, k, v = _inputs(rng, dtype, shape)
    bias = _bias(rng, BROADCAST[shape_name](*_score_shape(shape)), dtype if bias_dtype == "q" else "float32")
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_bias": _device_bias(cp, bias)})
    _check(q, k, v, fwd, causal, attn_bias=bias)


@pytest.mark.parametrize("config", list(_params(CONFIGS)))
@pytest.mark.parametrize("shape_name", ["full", "per-head", "per-batch", "per-key", "per-query", "rank2"])
def test_mask_every_broadcast_shape(cp, rng, shape_name, config):
    dtype, shape, causal = CONFIGS[config]
    q, k, v = _inputs(rng, dtype, shape)
    mask = _mask(rng, BROADCAST[shape_name](*_score_shape(shape)))
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": cp.asarray(mask)})
    _check(q, k, v, fwd, causal, attn_mask=mask)


@pytest.mark.parametrize("config", list(_params(["bf16-d64-200x333-gqa", "f16-d128-257x190-causal",
                                                 "f16-d96-130x203-gqa", "f16-d64-9x1500-split",
                                                 "bf16-d64-200x208-staged", "f16-d128-300x272-causal-staged"])))
def test_bias_and_mask_together(cp, rng, config):
    dtype, shape, causal = CONFIGS[config]
    b, h, m, n = _score_shape(shape)
    q, k, v = _inputs(rng, dtype, shape)
    bias, mask = _bias(rng, (1, h, m, n), dtype), _mask(rng, (b, 1, m, n))
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_bias": _device_bias(cp, bias), "attn_mask": cp.asarray(mask)})
    _check(q, k, v, fwd, causal, attn_bias=bias, attn_mask=mask)


# ----------------------------------------------------------------------------
# Strides: read in place, in pairs or element by element
# ----------------------------------------------------------------------------

# id -> the device view of a (1, H, M, N) bias built from a float32 host array
VIEWS = {
    # stride-0 batch: broadcast_to of a per-head bias to (B, H, M, N)
    "broadcast_to": lambda cp, x, b: cp.broadcast_to(x, (b,) + x.shape[1:]),
    # a slice of a wider bias at an even column offset, even row stride: pairs aligned
    "slice-even": lambda cp, x, b: cp.pad(x, ((0, 0), (0, 0), (0, 3), (2, 4 + x.shape[3] % 2)))[
        :, :, :x.shape[2], 2:2 + x.shape[3]],
    # an odd column offset: pairs misaligned, read element by element
    "slice-odd": lambda cp, x, b: cp.pad(x, ((0, 0), (0, 0), (0, 0), (1, 2)))[:, :, :, 1:1 + x.shape[3]],
    # column stride 2
    "every-other-column": lambda cp, x, b: cp.repeat(x, 2, axis=3)[:, :, :, ::2],
    # the transpose of a (1, H, N, M) array: column stride M
    "transposed": lambda cp, x, b: cp.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2),
    # rows padded to 16 elements (16-byte aligned rows, staged where seqlen_k is not a
    # multiple of 8: the copies' key tail reads part of a 16-byte chunk)
    "aligned-rows": lambda cp, x, b: cp.pad(x, ((0, 0), (0, 0), (0, 0), (0, 16 - x.shape[3] % 16)))[
        :, :, :, :x.shape[3]],
    # an odd row stride: odd rows' pairs misaligned
    "odd-row-stride": lambda cp, x, b: cp.pad(x, ((0, 0), (0, 0), (0, 0), (0, 1 + x.shape[3] % 2)))[
        :, :, :, :x.shape[3]],
}


@pytest.mark.parametrize("config", list(_params(["bf16-d64-200x333-gqa", "f16-d128-257x190-causal",
                                                 "f16-d96-130x203-gqa", "bf16-d64-200x208-staged"])))
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("bias_dtype", ["q", "float32"])
def test_bias_views_are_read_in_place(cp, rng, view, bias_dtype, config):
    dtype, shape, causal = CONFIGS[config]
    b, h, m, n = _score_shape(shape)
    q, k, v = _inputs(rng, dtype, shape)
    bias = _bias(rng, (1, h, m, n), dtype if bias_dtype == "q" else "float32")
    d_bias = VIEWS[view](cp, _device_bias(cp, bias), b)
    assert d_bias.shape[1:] == bias.shape[1:]
    # the values, on the host, for the reference (bfloat16 storage viewed back)
    ref_bias = host(d_bias, dtype if bias_dtype == "q" else None)
    assert np.array_equal(ref_bias[:1].astype(np.float32), bias.astype(np.float32))
    # read in pairs only with unit column stride and even row strides (a contiguous
    # bias of odd seqlen_k has odd rows misaligned)
    strided = not dispatch.score_pairs_ok(_variant.broadcast_strides(d_bias), d_bias.itemsize, d_bias.data.ptr)
    assert strided == {"broadcast_to": n % 2 == 1, "slice-even": False, "aligned-rows": False}.get(view, True)
    staged = dispatch.score_vec_ok(_variant.broadcast_strides(d_bias), d_bias.itemsize, d_bias.data.ptr)
    assert staged == (view == "aligned-rows" or view == "broadcast_to" and n * d_bias.itemsize % 16 == 0)
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_bias": d_bias})
    _check(q, k, v, fwd, causal, attn_bias=ref_bias)


@pytest.mark.parametrize("config", list(_params(["bf16-d64-200x333-gqa", "f16-d96-130x203-gqa"])))
def test_mask_views_are_read_in_place(cp, rng, config):
    dtype, shape, causal = CONFIGS[config]
    b, h, m, n = _score_shape(shape)
    q, k, v = _inputs(rng, dtype, shape)
    mask = _mask(rng, (1, h, n, m))
    d_mask = cp.asarray(mask).transpose(0, 1, 3, 2)  # column stride seqlen_q
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": d_mask})
    _check(q, k, v, fwd, causal, attn_mask=mask.transpose(0, 1, 3, 2))
    odd = cp.pad(cp.asarray(mask.transpose(0, 1, 3, 2)), ((0, 0), (0, 0), (0, 0), (1, 0)))[..., 1:]
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": odd})
    _check(q, k, v, fwd, causal, attn_mask=mask.transpose(0, 1, 3, 2))


# ----------------------------------------------------------------------------
# -inf entries and rows that see no key
# ----------------------------------------------------------------------------


def dead_rows(b, h, m):
    """(batch, nheads, seqlen_q) bool: the rows a test hides from every key: the first, a
    middle and the last (tail) row of each head, and a whole head of the first batch."""
    dead = np.zeros((b, h, m), bool)
    dead[:, :, [0, m // 2, m - 1]] = True
    dead[0, -1, :] = True
    return dead


@pytest.mark.parametrize("config", list(_params(CONFIGS)))
@pytest.mark.parametrize("how", ["bias-inf", "mask", "bias-inf+sinks"])
def test_rows_that_see_no_key_give_zero_and_minus_inf(cp, rng, how, config):
    dtype, shape, causal = CONFIGS[config]
    b, h, m, n = _score_shape(shape)
    q, k, v = _inputs(rng, dtype, shape)
    dead = dead_rows(b, h, m)
    variants, ref = {}, {}
    if how.startswith("bias-inf"):
        bias = _bias(rng, (b, h, m, n), "float32")
        bias[rng.random(bias.shape) < 0.2] = -np.inf  # scattered -inf entries mask too
        bias[dead] = -np.inf
        variants["attn_bias"], ref["attn_bias"] = cp.asarray(bias), bias
    else:
        mask = _mask(rng, (b, h, m, n))
        mask[dead] = False
        variants["attn_mask"], ref["attn_mask"] = cp.asarray(mask), mask
    extra = {}
    if how.endswith("sinks"):
        sinks = sink_logits(rng, h)
        extra["sinks"], ref["sinks"] = cp.asarray(sinks), sinks
    out, lse = _fwd(cp, q, k, v, dtype, causal, {**variants, **extra})
    _check(q, k, v, (out, lse), causal, **ref)
    rows = dead.transpose(0, 2, 1)  # (batch, seqlen_q, nheads) as out
    assert (out.astype(np.float32)[rows] == 0).all()
    if "sinks" in ref:  # the sink alone: lse = sinks[h] (rounded through log2 units)
        want = np.broadcast_to(ref["sinks"][None, :, None], lse.shape)
        assert np.allclose(lse[dead], want[dead], rtol=1e-5, atol=1e-5)
    else:
        assert (lse[dead] == -np.inf).all()


# ----------------------------------------------------------------------------
# With the other variants
# ----------------------------------------------------------------------------

# id -> (causal, the other variants given rng and (batch, nheads)) with a bias and a mask
COMBOS = {
    "causal": (True, lambda rng, b, h: {}),
    "window": (False, lambda rng, b, h: {"window_size": (48, 16)}),
    "window+causal": (True, lambda rng, b, h: {"window_size": (64, -1)}),
    "softcap": (None, lambda rng, b, h: {"softcap": 5.0}),
    "alibi": (None, lambda rng, b, h: {"alibi_slopes": alibi_heads(h)}),
    "sinks": (None, lambda rng, b, h: {"sinks": sink_logits(rng, h)}),
    "softcap+alibi+sinks+window": (True, lambda rng, b, h: {"softcap": 8.0, "alibi_slopes": alibi_heads(h),
                                                            "sinks": sink_logits(rng, h),
                                                            "window_size": (100, 0)}),
}


@pytest.mark.parametrize("config", list(_params(["bf16-d64-200x333-gqa", "f16-d128-257x190-causal",
                                                 "f16-d96-130x203-gqa", "f16-d64-9x1500-split",
                                                 "bf16-d64-200x208-staged", "f16-d128-300x272-causal-staged"])))
@pytest.mark.parametrize("with_mask", [False, True], ids=["bias", "bias+mask"])
@pytest.mark.parametrize("combo", list(COMBOS))
def test_bias_with_other_variants(cp, rng, combo, with_mask, config):
    dtype, shape, causal = CONFIGS[config]
    forced, make = COMBOS[combo]
    causal = causal if forced is None else forced
    b, h, m, n = _score_shape(shape)
    q, k, v = _inputs(rng, dtype, shape)
    others = make(rng, b, h)
    bias = _bias(rng, (1, h, m, n), "float32")
    arrays, ref = {"attn_bias": cp.asarray(bias)}, {"attn_bias": bias}
    if with_mask:
        mask = _mask(rng, (b, 1, m, n), keep=0.8)
        arrays["attn_mask"], ref["attn_mask"] = cp.asarray(mask), mask
    on_gpu = {name: cp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in others.items()}
    fwd = _fwd(cp, q, k, v, dtype, causal, arrays, **on_gpu)
    _check(q, k, v, fwd, causal, **ref, **others)


# ----------------------------------------------------------------------------
# Varlen
# ----------------------------------------------------------------------------

LENS_Q, LENS_K = [33, 0, 190, 1, 129], [70, 12, 160, 65, 129]


@pytest.mark.parametrize("dtype,head_dim", [("float16", 64), pytest.param("bfloat16", 128, marks=_NO_BF16),
                                            ("float16", 96)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("arrays", ["bias", "bias-fp32+mask", "mask-per-key"])
@pytest.mark.parametrize("pad_k", [2, 16], ids=["max_k+2", "staged"])  # 176 keys: 16-byte rows, staged
def test_varlen_reads_each_sequence_s_block(cp, rng, pad_k, arrays, causal, dtype, head_dim):
    nheads, nheads_kv = 4, 2
    q, k, v = packed_inputs(rng, LENS_Q, LENS_K, nheads, nheads_kv, head_dim, dtype)
    # larger than the longest: entries past them are not read
    max_q, max_k = max(LENS_Q) + 3, max(LENS_K) + pad_k
    full = (len(LENS_Q), nheads, max_q, max_k)
    ref = {}
    if arrays == "bias":
        ref["attn_bias"] = _bias(rng, (1, nheads, max_q, max_k), dtype)
    elif arrays == "bias-fp32+mask":
        ref["attn_bias"] = _bias(rng, full, "float32")
        ref["attn_mask"] = _mask(rng, (len(LENS_Q), 1, max_q, max_k))
    else:
        ref["attn_mask"] = _mask(rng, (len(LENS_Q), 1, 1, max_k))
    d_q, d_k, d_v = (dev(cp, x) for x in (q, k, v))
    out, lse = cupyflash.flash_attn_varlen_fwd(
        d_q, d_k, d_v, cp.asarray(cu_seqlens(LENS_Q)), cp.asarray(cu_seqlens(LENS_K)), max_q, max_k,
        softmax_scale=PACKED_SCALE, causal=causal, **dtype_kw(cp, dtype),  # _packed_reference's scale
        **{name: dev(cp, x) for name, x in ref.items()})
    refs = _packed_reference(q, k, v, testing.random_normal(rng, q.shape, dtype), LENS_Q, LENS_K, causal, **ref)
    for key, got in (("out", host(out, dtype)), ("lse", host(lse))):
        ref64, naive = refs[key]
        testing.assert_close_to_reference(key, got, ref64, naive, testing.OUT_FACTOR, FLOOR)


# ----------------------------------------------------------------------------
# Memory: a broadcast bias is never expanded
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bias_shape", ["per-head", "per-batch", "broadcast_to"])
def test_broadcast_bias_allocates_no_full_score_array(rng, bias_shape):
    """Every device allocation of the call is recorded (the current allocator): none is
    as large as the bias expanded to (B, H, N, N) in a 2-byte dtype, and the used bytes
    grow by out and lse only."""
    cp = pytest.importorskip("cupy")
    pool = cp.cuda.MemoryPool()
    sizes = []

    def malloc(nbytes):
        sizes.append(nbytes)
        return pool.malloc(nbytes)

    batch, seqlen, nheads, head_dim = 2, 1024, 8, 64
    with cp.cuda.using_allocator(malloc):
        q, k, v = (cp.asarray(x) for x in _inputs(rng, "float16", (batch, seqlen, seqlen, nheads, nheads, head_dim)))
        shape = {"per-head": (1, nheads, seqlen, seqlen), "per-batch": (batch, 1, seqlen, seqlen),
                 "broadcast_to": (1, nheads, seqlen, seqlen)}[bias_shape]
        bias = cp.asarray(_bias(rng, shape, "float32"))
        if bias_shape == "broadcast_to":
            bias = cp.broadcast_to(bias, (batch, nheads, seqlen, seqlen))
        cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias)  # compile and plan outside the count
        cp.cuda.get_current_stream().synchronize()
        sizes.clear()
        used = pool.used_bytes()
        out, lse = cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias)
        cp.cuda.get_current_stream().synchronize()
        assert sizes, "the call allocates out and lse through the current allocator"
        full_bytes = batch * nheads * seqlen * seqlen * 2  # the smallest (B, H, N, N) expansion
        assert not [n for n in sizes if n >= full_bytes], sizes
        assert pool.used_bytes() - used <= out.nbytes + lse.nbytes + 2 * 512  # the pool rounds to 512 bytes
        assert bool(cp.isfinite(out).all())
    pool.free_all_blocks()
