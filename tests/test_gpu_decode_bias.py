"""flash_attn_with_kvcache on the GPU with an additive bias and a boolean mask (issue
14): the decode kernel (kernels_cu/flash_decode.cu, VAR_BIAS / VAR_BIAS_FP32 /
VAR_MASK) against the CPU path of the same call on float32 copies of the same
inputs (the CPU path is checked against the float64 reference in
tests/test_kvcache_bias.py), with test_gpu_decode.py's tolerance, NaN-poisoned
memory pool and checks of the caches after the append.  Skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import testing
from test_gpu_decode import (_assert_close_variant, _back, _cp, _dev, _host, _poison_pool, _table, decode_step,
                             _variant_options)
from test_kvcache import i32

pytestmark = pytest.mark.gpu


def _device_scores(cp, scores, dtype):
    """Device copies of host scores: a bias of q's dtype as its storage (bfloat16 bits),
    float32 and bool as they are; a form name of a view is applied on the device (the
    view's strides are what the kernel reads). Returns ``(device, host)``: the host
    side holds the values the device has (q's dtype rounded), as float32."""
    device, host = {}, {}
    for name, (x, view) in scores.items():
        if x.dtype == np.float32 or x.dtype == np.bool_:
            d = cp.asarray(x)
            h = x
        else:
            d = _dev(cp, x)
            h = _back(d, dtype)
        device[name], host[name] = view(cp, d), view(np, h)
    return device, host


def _run(cp, dtype, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, scores, block_table=None,
         cache_batch_idx=None, causal=False, num_splits=0, options=None):
    """The GPU (device copies) against the CPU path (float32 copies): out, lse, the caches.
    ``scores``: name -> (host array, view(module, array)); ``options``: other variants."""
    options = options or {}
    d = {name: (None if x is None else _dev(cp, x)) for name, x in
         (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
          ("cache_batch_idx", cache_batch_idx), ("block_table", block_table))}
    dev_scores, host_scores = _device_scores(cp, scores, dtype)
    dev_options = {n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in options.items()}
    _poison_pool(cp, (q.nbytes, q.size * 2))
    out, lse = cupyflash.flash_attn_with_kvcache(
        d["q"], d["k_cache"], d["v_cache"], d["k"], d["v"], cache_seqlens=cp.asarray(cache_seqlens),
        cache_batch_idx=d["cache_batch_idx"], block_table=d["block_table"], causal=causal, num_splits=num_splits,
        return_lse=True, dtype=dtype, **dev_options, **dev_scores)
    f32 = {name: (None if x is None else x.astype(np.float32)) for name, x in
           (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v))}
    want_out, want_lse = cupyflash.flash_attn_with_kvcache(
        f32["q"], f32["k_cache"], f32["v_cache"], f32["k"], f32["v"], cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, block_table=block_table, causal=causal, return_lse=True, **options,
        **host_scores)
    got_out, got_lse = _back(out, dtype), lse.get()
    _assert_close_variant("out", got_out, want_out, dtype)
    _assert_close_variant("lse", got_lse, want_lse, dtype)
    assert np.array_equal(_back(d["k_cache"], dtype), f32["k_cache"])
    assert np.array_equal(_back(d["v_cache"], dtype), f32["v_cache"])
    return got_out, got_lse


def _whole(xp, x):
    return x


def _with_inf(rng, x, fraction=0.15):
    x = x.copy()
    x[rng.random(x.shape) < fraction] = -np.inf
    return x


def _scores(rng, form, dtype, batch, nheads_q, seqlen_q, capacity):
    """``{name: (host array, view)}`` for a case name: parts joined by '+'."""
    out = {}
    for part in form.split("+"):
        if part == "bias":  # q's dtype, full, with -inf entries
            out["attn_bias"] = (_with_inf(rng, _host(rng, (batch, nheads_q, seqlen_q, capacity), dtype)), _whole)
        elif part == "bias_fp32_heads":  # float32, (nheads_q, seqlen_q, key): broadcast over the batch
            out["attn_bias"] = (_with_inf(rng, _host(rng, (nheads_q, seqlen_q, capacity), "float32")), _whole)
        elif part == "bias_stride0":  # a stride-0 view over batch, heads and rows, read in place
            shape = (batch, nheads_q, seqlen_q, capacity)
            out["attn_bias"] = (_host(rng, (1, 1, 1, capacity), dtype),
                                lambda xp, x, shape=shape: xp.broadcast_to(x, shape))
        elif part == "bias_sliced":  # column stride 3, rows of a wider array, keys past the capacity
            out["attn_bias"] = (_host(rng, (batch, nheads_q, seqlen_q + 1, 3 * capacity + 7), "float32"),
                                lambda xp, x, s=seqlen_q: x[:, :, 1:s + 1, ::3])
        elif part == "bias_key1":  # one value per (batch, head, row)
            out["attn_bias"] = (_host(rng, (batch, nheads_q, seqlen_q, 1), dtype), _whole)
        elif part == "padding_mask":  # (batch, 1, 1, key)
            out["attn_mask"] = (rng.random((batch, 1, 1, capacity)) < 0.8, _whole)
        elif part == "mask":  # per head and row
            out["attn_mask"] = (rng.random((batch, nheads_q, seqlen_q, capacity)) < 0.6, _whole)
        else:
            raise ValueError(part)
    return out


FORMS = ["bias", "bias_fp32_heads", "bias_stride0", "bias_sliced", "bias_key1", "padding_mask", "mask",
         "bias+mask", "bias_fp32_heads+padding_mask"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seqlen_q,nheads_q,nheads_kv", [(1, 32, 8), (4, 32, 8), (1, 8, 8), (3, 8, 2)])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_bias_and_mask(rng, form, seqlen_q, nheads_q, nheads_kv, paged):
    """Decode steps with an append, GQA, lengths 0 / short / near the capacity, causal,
    unsplit and 4 splits."""
    cp = _cp()
    dtype = "bfloat16" if nheads_q == 32 else "float16"
    head_dim, batch, capacity = (128 if nheads_q == 32 else 64), 3, 640
    q, k, v, lengths, table, shape = decode_step(rng, dtype, seqlen_q, nheads_q, nheads_kv, head_dim, paged, batch,
                                                 capacity)
    scores = _scores(rng, form, dtype, batch, nheads_q, seqlen_q, capacity)
    for num_splits in (1, 4):
        k_cache, v_cache = (_host(rng, shape, dtype) for _ in range(2))  # fresh caches: the append writes them
        _run(cp, dtype, q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table, causal=True,
             num_splits=num_splits, scores=scores)


@pytest.mark.parametrize("form", ["bias+mask", "bias_sliced"])
@pytest.mark.parametrize("which", ["causal_window+sinks", "softcap+alibi_batch", "window"])
@pytest.mark.parametrize("seqlen_q,nheads_q,nheads_kv", [(5, 8, 2), (3, 32, 4), (40, 4, 2)])
def test_decode_bias_with_other_variants_every_warp_grid(rng, form, which, seqlen_q, nheads_q, nheads_kv):
    """20, 24 and 80 packed rows (warp grids 2x2, 2x2, 4x1); cache_batch_idx; automatic splits."""
    cp = _cp()
    dtype, head_dim, batch, capacity = "float16", 64, 2, 900
    options, causal = _variant_options(rng, which, batch, nheads_q, seqlen_q)
    q = _host(rng, (batch, seqlen_q, nheads_q, head_dim), dtype)
    k, v = (_host(rng, (batch, 2, nheads_kv, head_dim), dtype) for _ in range(2))
    k_cache, v_cache = (_host(rng, (3, capacity, nheads_kv, head_dim), dtype) for _ in range(2))
    _run(cp, dtype, q, k_cache, v_cache, k, v, cache_seqlens=i32([850, 3]), cache_batch_idx=i32([2, 0]),
         causal=causal, options=options, scores=_scores(rng, form, dtype, batch, nheads_q, seqlen_q, capacity))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sinks", [False, True])
def test_fully_masked_rows(rng, num_splits, sinks):
    """Rows whose every key the bias (-inf) or the mask hides: out 0, lse -inf (the sink)."""
    cp = _cp()
    dtype, batch, seqlen_q, nheads_q, nheads_kv, head_dim, capacity = "float16", 2, 3, 8, 2, 64, 300
    q = _host(rng, (batch, seqlen_q, nheads_q, head_dim), dtype)
    k_cache, v_cache = (_host(rng, (batch, capacity, nheads_kv, head_dim), dtype) for _ in range(2))
    bias = _host(rng, (batch, nheads_q, seqlen_q, capacity), "float32")
    bias[0, 3, 1] = -np.inf
    mask = np.ones((batch, 1, seqlen_q, capacity), bool)
    mask[1, 0, 2] = False
    options = {"sinks": (rng.standard_normal(nheads_q) + 1).astype(np.float32)} if sinks else {}
    out, lse = _run(cp, dtype, q, k_cache, v_cache, cache_seqlens=i32([250, 290]), num_splits=num_splits,
                    options=options, scores={"attn_bias": (bias, _whole), "attn_mask": (mask, _whole)})
    assert (out[0, 1, 3] == 0).all() and (out[1, 2] == 0).all()
    if sinks:
        np.testing.assert_allclose(lse[0, 3, 1], options["sinks"][3], rtol=1e-5)
        np.testing.assert_allclose(lse[1, :, 2], options["sinks"], rtol=1e-5)
    else:
        assert lse[0, 3, 1] == -np.inf and (lse[1, :, 2] == -np.inf).all()


def test_bias_past_each_sequence_is_never_read(rng):
    """NaN in the bias at key positions past each sequence's keys (a paged cache): the
    same bits as with finite values there."""
    cp = _cp()
    dtype, batch, nheads_q, nheads_kv, head_dim, capacity, page_size = "bfloat16", 3, 8, 2, 128, 512, 64
    q = _host(rng, (batch, 1, nheads_q, head_dim), dtype)
    table = _table(rng, batch, capacity // page_size, batch * capacity // page_size)
    k_cache, v_cache = (_host(rng, (table.max() + 1, page_size, nheads_kv, head_dim), dtype) for _ in range(2))
    lengths = i32([1, 100, 511])
    bias = _host(rng, (batch, 1, 1, capacity), "float32")
    poisoned = bias.copy()
    for b, n in enumerate(lengths):
        poisoned[b, ..., n:] = np.nan
    d = {n: _dev(cp, x) for n, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("table", table))}
    runs = [cupyflash.flash_attn_with_kvcache(d["q"], d["k_cache"], d["v_cache"], cache_seqlens=cp.asarray(lengths),
                                              block_table=d["table"], attn_bias=cp.asarray(x), return_lse=True,
                                              dtype=dtype) for x in (bias, poisoned)]
    (out, lse), (p_out, p_lse) = ((o.get(), l.get()) for o, l in runs)
    assert np.isfinite(lse).all() and np.isfinite(testing.from_bf16_bits(out)).all()
    assert np.array_equal(out, p_out) and np.array_equal(lse, p_lse)


@pytest.mark.parametrize("appended", [False, True])
def test_long_chunk_with_a_bias_runs_the_decode_kernel(rng, launches, appended):
    """seqlen_q >= DECODE_DENSE_MIN_SEQLEN_Q on a dense cache takes the dense forward
    without a bias; with one, the decode kernel (which indexes it by key position)."""
    cp = _cp()
    from cupyflash import dispatch

    dtype, seqlen_q = "bfloat16", dispatch.DECODE_DENSE_MIN_SEQLEN_Q
    batch, nheads_q, nheads_kv, head_dim, capacity = 2, 4, 2, 128, 1024
    q = _host(rng, (batch, seqlen_q, nheads_q, head_dim), dtype)
    k_cache, v_cache = (_host(rng, (batch, capacity, nheads_kv, head_dim), dtype) for _ in range(2))
    k = v = None
    if appended:
        k, v = (_host(rng, (batch, seqlen_q, nheads_kv, head_dim), dtype) for _ in range(2))
    scores = _scores(rng, "bias+padding_mask", dtype, batch, nheads_q, seqlen_q, capacity)
    _run(cp, dtype, q, k_cache, v_cache, k, v, cache_seqlens=i32([100, capacity - seqlen_q - 5]), causal=True,
         scores=scores)
    assert "flash_decode_kernel" in launches and not any("flash_fwd" in n for n in launches)
