"""flash_attn_with_kvcache on the CPU path: results, the in-place append, paged
caches, validation, and the GPU path's wiring on a fake GPU (the kernels' own
tests are in test_gpu_decode.py).

Results are checked against ``reference.attention_with_kvcache`` (float64) with
the naive same-dtype rule of :mod:`cupyflash.testing` (error at most 2x that of
a naive implementation in the same precision, plus a floor), the naive results
being computed sequence by sequence on the gathered keys, as in
``test_varlen.py``.  The reference itself is checked against the dense
``reference.attention_fwd``.
"""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest

import cupyflash
from cupyflash import _params, reference, testing
from fakes import FakeCupyArray, cpu_compute_decode, install_fake_gpu

_NO_BF16 = pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is None,
                              reason="bfloat16 needs ml_dtypes (pip install ml_dtypes)")
DTYPES = [pytest.param("float16"), pytest.param("bfloat16", marks=_NO_BF16),
          pytest.param("float32"), pytest.param("float64")]
FN = "flash_attn_with_kvcache"


def rand(rng, shape, dtype="float32"):
    return testing.random_normal(rng, shape, dtype)


def pair(rng, shape, dtype="float32"):
    """Two fresh random arrays (keys and values)."""
    return rand(rng, shape, dtype), rand(rng, shape, dtype)


def i32(values):
    return np.asarray(values, dtype=np.int32)


# ----------------------------------------------------------------------------
# The comparison: reference (float64) and naive (same dtype), per sequence
# ----------------------------------------------------------------------------


def _slot(b, pos, rows, table, page_size):
    if table is None:
        return (b if rows is None else int(rows[b])), pos
    return int(table[b, pos // page_size]), pos % page_size


def _sequence(cache, b, length, rows, table):
    """Sequence b's first ``length`` keys of a (possibly paged) cache, (1, length, H, D)."""
    page_size = cache.shape[1]
    picked = [cache[_slot(b, j, rows, table, page_size)] for j in range(length)]
    return np.stack(picked)[None] if picked else cache[:1, :0]


def assert_matches_reference(q, k_cache0, v_cache0, k, v, out, lse, *, cache_seqlens=None,
                             cache_batch_idx=None, block_table=None, softmax_scale=None,
                             causal=False):
    """``out``/``lse`` against the float64 reference with the naive rule; the caches
    before the call are ``k_cache0``/``v_cache0``.  Returns the reference's caches."""
    ref_out, ref_lse, ref_k, ref_v = reference.attention_with_kvcache(
        q, k_cache0, v_cache0, k, v, cache_seqlens, cache_batch_idx, block_table,
        softmax_scale, causal)
    batch = q.shape[0]
    capacity = (k_cache0.shape[1] if block_table is None
                else block_table.shape[1] * k_cache0.shape[1])
    lengths = (np.full(batch, capacity) if cache_seqlens is None
               else np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64), (batch,)))
    lengths = lengths + (0 if k is None else k.shape[1])
    naive_out = np.zeros(q.shape)
    naive_lse = np.full(ref_lse.shape, -np.inf)
    naive_dtype = testing.naive_dtype(q.dtype)
    for b in range(batch):
        if lengths[b] == 0:
            continue
        keys, values = (_sequence(c, b, int(lengths[b]), cache_batch_idx, block_table)
                        .astype(q.dtype) for c in (ref_k, ref_v))
        o, l = reference.naive_attention(q[b:b + 1], keys, values, softmax_scale, causal,
                                         naive_dtype)
        naive_out[b], naive_lse[b] = o[0], l[0]
    for name, got, ref, naive in (("out", out, ref_out, naive_out),
                                  ("lse", lse, ref_lse, naive_lse)):
        finite = ref[np.isfinite(ref)]
        floor = testing.REL_FLOOR * max(1.0, float(np.abs(finite).max()) if finite.size else 1.0)
        testing.assert_close_to_reference(name, got, ref, naive, testing.OUT_FACTOR, floor)
    return ref_k, ref_v


def run_and_check(q, k_cache, v_cache, k=None, v=None, **kw):
    """Call on copies of the caches taken before; check results and the updated cache."""
    k_cache0, v_cache0 = k_cache.copy(), v_cache.copy()
    out, lse = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, return_lse=True,
                                                 **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == np.float32
    ref_k, ref_v = assert_matches_reference(q, k_cache0, v_cache0, k, v, out, lse, **kw)
    assert np.array_equal(k_cache.astype(np.float64), ref_k)
    assert np.array_equal(v_cache.astype(np.float64), ref_v)
    return out, lse


# ----------------------------------------------------------------------------
# The reference against the dense reference
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_reference_whole_cache_is_dense_attention(rng, causal):
    q = rand(rng, (3, 5, 4, 16))
    k_cache, v_cache = pair(rng, (3, 9, 2, 16))
    out, lse, kc, vc = reference.attention_with_kvcache(q, k_cache, v_cache, causal=causal,
                                                        softmax_scale=0.3)
    dense_out, dense_lse = reference.attention_fwd(q, k_cache, v_cache, 0.3, causal)
    np.testing.assert_allclose(out, dense_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, dense_lse, rtol=1e-12, atol=1e-12)
    assert np.array_equal(kc, k_cache) and np.array_equal(vc, v_cache)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_per_sequence_is_dense_attention_on_cache_plus_new(rng, paged, causal):
    """Each sequence: dense attention on [its cache entries, the new keys]."""
    batch, page_size, seqlen_q, seqlen_new = 3, 16, 4, 3
    lengths = i32([0, 21, 40])
    q = rand(rng, (batch, seqlen_q, 2, 8))
    k, v = pair(rng, (batch, seqlen_new, 1, 8))
    if paged:
        table = i32(rng.permutation(12)[:9].reshape(batch, 3))
        k_cache, v_cache = pair(rng, (12, page_size, 1, 8))
        logical_k = k_cache[table].reshape(batch, -1, 1, 8)
        logical_v = v_cache[table].reshape(batch, -1, 1, 8)
    else:
        table = None
        k_cache, v_cache = pair(rng, (batch, 48, 1, 8))
        logical_k, logical_v = k_cache, v_cache
    k0, v0 = k_cache.copy(), v_cache.copy()
    out, lse, kc, vc = reference.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table, causal=causal)
    assert np.array_equal(k_cache, k0) and np.array_equal(v_cache, v0)  # inputs untouched
    for b in range(batch):
        n = int(lengths[b])
        keys = np.concatenate([logical_k[b, :n], k[b]])[None]
        values = np.concatenate([logical_v[b, :n], v[b]])[None]
        dense_out, dense_lse = reference.attention_fwd(q[b:b + 1], keys, values, None, causal)
        np.testing.assert_allclose(out[b], dense_out[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b], dense_lse[0], rtol=1e-12, atol=1e-12)
    # the updated caches hold the new keys where the sequence's positions map to
    for b in range(batch):
        for i in range(seqlen_new):
            where = _slot(b, int(lengths[b]) + i, None, table, page_size)
            assert np.array_equal(kc[where], k[b, i]) and np.array_equal(vc[where], v[b, i])


# ----------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_per_sequence_cache_seqlens(rng, dtype, causal, seqlen_q):
    """Lengths 0 (no key: out 0, lse -inf), 1, a tile tail, and the full cache."""
    seqlen_cache = 200
    lengths = i32([0, 1, 137, seqlen_cache])
    q = rand(rng, (4, seqlen_q, 4, 32), dtype)
    k_cache, v_cache = pair(rng, (4, seqlen_cache, 2, 32), dtype)
    out, lse = run_and_check(q, k_cache, v_cache, cache_seqlens=lengths, causal=causal)
    assert (out[0] == 0).all() and (lse[0] == -np.inf).all()
    assert np.isfinite(lse[1:, :, -1]).all()


@pytest.mark.parametrize("cache_seqlens", [None, 37])
def test_whole_cache_and_int_cache_seqlens(rng, cache_seqlens):
    q = rand(rng, (2, 2, 2, 16))
    k_cache, v_cache = pair(rng, (2, 50, 2, 16))
    out, _ = run_and_check(q, k_cache, v_cache, cache_seqlens=cache_seqlens)
    same = cupyflash.flash_attn_with_kvcache(
        q, k_cache[:, :37 if cache_seqlens else 50], v_cache[:, :37 if cache_seqlens else 50])
    assert np.array_equal(out, same)


def _written_mask(shape, lengths, seqlen_new, rows=None, table=None):
    mask = np.zeros(shape[:2], dtype=bool)
    for b in range(len(lengths)):
        for i in range(seqlen_new):
            mask[_slot(b, int(lengths[b]) + i, rows, table, shape[1])] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_new", [1, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_append_in_place(rng, dtype, seqlen_new, causal):
    lengths = i32([0, 9, 130])
    q = rand(rng, (3, seqlen_new, 4, 16), dtype)
    k, v = pair(rng, (3, seqlen_new, 2, 16), dtype)
    k_cache, v_cache = pair(rng, (3, 140, 2, 16), dtype)
    k0, v0, lengths0 = k_cache.copy(), v_cache.copy(), lengths.copy()
    run_and_check(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=causal)
    assert np.array_equal(lengths, lengths0)  # the caller's lengths are not advanced
    mask = _written_mask(k_cache.shape, lengths, seqlen_new)
    for b in range(3):
        n = int(lengths[b])
        assert np.array_equal(k_cache[b, n:n + seqlen_new], k[b])
        assert np.array_equal(v_cache[b, n:n + seqlen_new], v[b])
    assert np.array_equal(k_cache[~mask], k0[~mask]) and np.array_equal(v_cache[~mask], v0[~mask])


def test_append_then_attention_sees_new_keys(rng):
    """Decoding step by step equals attention over the whole sequence at once."""
    steps, prompt = 6, 20
    q_all = rand(rng, (1, steps, 2, 16))
    k_all, v_all = pair(rng, (1, prompt + steps, 1, 16))
    k_cache = np.zeros((1, 64, 1, 16), np.float32) + rand(rng, (1, 64, 1, 16))
    v_cache = np.zeros((1, 64, 1, 16), np.float32) + rand(rng, (1, 64, 1, 16))
    k_cache[:, :prompt], v_cache[:, :prompt] = k_all[:, :prompt], v_all[:, :prompt]
    for t in range(steps):
        n = prompt + t
        out = cupyflash.flash_attn_with_kvcache(
            q_all[:, t:t + 1], k_cache, v_cache, k_all[:, n:n + 1], v_all[:, n:n + 1],
            cache_seqlens=i32([n]), causal=True)
        full = cupyflash.flash_attn_fwd(q_all[:, t:t + 1], k_all[:, :n + 1], v_all[:, :n + 1])[0]
        np.testing.assert_allclose(out, full, rtol=1e-6, atol=1e-6)
    assert np.array_equal(k_cache[:, :prompt + steps], k_all)


def test_cache_batch_idx_permutation_with_append(rng):
    rows = i32([2, 0, 3, 1])
    lengths = i32([4, 0, 30, 11])
    q = rand(rng, (4, 2, 2, 16))
    k, v = pair(rng, (4, 2, 2, 16))
    k_cache, v_cache = pair(rng, (5, 40, 2, 16))
    k0, v0 = k_cache.copy(), v_cache.copy()
    run_and_check(q, k_cache, v_cache, k, v, cache_seqlens=lengths, cache_batch_idx=rows,
                  causal=True)
    mask = _written_mask(k_cache.shape, lengths, 2, rows=rows)
    assert mask.sum() == 8 and not mask[4].any()  # row 4 is nobody's
    assert np.array_equal(k_cache[~mask], k0[~mask]) and np.array_equal(v_cache[~mask], v0[~mask])
    for b in range(4):
        n = int(lengths[b])
        assert np.array_equal(k_cache[rows[b], n:n + 2], k[b])


def test_cache_batch_idx_repeated_rows_without_append(rng):
    rows = i32([1, 1, 0])
    q = rand(rng, (3, 3, 4, 8))
    k_cache, v_cache = pair(rng, (2, 30, 1, 8))
    out, _ = run_and_check(q, k_cache, v_cache, cache_seqlens=i32([12, 25, 30]),
                           cache_batch_idx=rows)
    alone = cupyflash.flash_attn_with_kvcache(q[:1], k_cache[1:], v_cache[1:],
                                              cache_seqlens=12)
    assert np.array_equal(out[:1], alone)


def _prefix_sharing_table(rng, batch, n_shared, n_own, num_blocks):
    """Every sequence starts with the same ``n_shared`` blocks, then its own blocks;
    block ids shuffled over the pool."""
    perm = rng.permutation(num_blocks)
    shared, own = perm[:n_shared], perm[n_shared:n_shared + batch * n_own].reshape(batch, n_own)
    return i32(np.concatenate([np.broadcast_to(shared, (batch, n_shared)), own], axis=1))


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_shared_prefix_with_append(rng, page_size, causal):
    batch, n_shared, n_own, num_blocks = 3, 2, 3, 20
    table = _prefix_sharing_table(rng, batch, n_shared, n_own, num_blocks)
    base = n_shared * page_size
    lengths = i32([base, base + 1, base + 2 * page_size + 3])
    q = rand(rng, (batch, 4, 4, 32))
    k, v = pair(rng, (batch, 4, 2, 32))
    k_cache = rand(rng, (num_blocks, page_size, 2, 32))
    v_cache = rand(rng, (num_blocks, page_size, 2, 32))
    k0, v0 = k_cache.copy(), v_cache.copy()
    run_and_check(q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table,
                  causal=causal)
    mask = _written_mask(k_cache.shape, lengths, 4, table=table)
    assert mask.sum() == batch * 4
    assert np.array_equal(k_cache[~mask], k0[~mask]) and np.array_equal(v_cache[~mask], v0[~mask])


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_random_table_with_repeats_no_append(rng, page_size):
    """Blocks drawn at random: repeated within and across sequences, any order; the
    entries past a sequence's last block are never read (here: out of range)."""
    num_blocks, width = 7, 5
    table = i32(rng.integers(0, num_blocks, size=(4, width)))
    lengths = i32([0, page_size * 2 + 5, page_size * width, 1])
    table[0, :] = -1
    table[3, 1:] = num_blocks + 3
    q = rand(rng, (4, 3, 2, 16))
    k_cache = rand(rng, (num_blocks, page_size, 2, 16))
    v_cache = rand(rng, (num_blocks, page_size, 2, 16))
    run_and_check(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, causal=True)


def test_paged_equals_dense_layout(rng):
    """The same keys laid out in pages (shuffled) or in rows give identical results."""
    page_size, batch, blocks_per_seq = 16, 3, 4
    q = rand(rng, (batch, 5, 4, 16))
    dense_k = rand(rng, (batch, page_size * blocks_per_seq, 2, 16))
    dense_v = rand(rng, (batch, page_size * blocks_per_seq, 2, 16))
    table = i32(rng.permutation(batch * blocks_per_seq).reshape(batch, blocks_per_seq))
    paged_k = np.empty((batch * blocks_per_seq, page_size, 2, 16), np.float32)
    paged_v = np.empty_like(paged_k)
    for b in range(batch):
        for p in range(blocks_per_seq):
            paged_k[table[b, p]] = dense_k[b, p * page_size:(p + 1) * page_size]
            paged_v[table[b, p]] = dense_v[b, p * page_size:(p + 1) * page_size]
    lengths = i32([3, 40, 64])
    for causal in (False, True):
        dense = cupyflash.flash_attn_with_kvcache(q, dense_k, dense_v, cache_seqlens=lengths,
                                                  causal=causal, return_lse=True)
        paged = cupyflash.flash_attn_with_kvcache(q, paged_k, paged_v, cache_seqlens=lengths,
                                                  block_table=table, causal=causal,
                                                  return_lse=True)
        assert all(np.array_equal(a, b) for a, b in zip(dense, paged))


@pytest.mark.parametrize("seqlen_q", [1, 7, 64])
@pytest.mark.parametrize("paged", [False, True])
def test_causal_chunked_prefill(rng, seqlen_q, paged):
    """A chunk of seqlen_q new tokens appended after a longer cache: bottom-right causal."""
    batch, page_size = 2, 16
    lengths = i32([90, 150])
    capacity = 256
    q = rand(rng, (batch, seqlen_q, 4, 32), "float16")
    k, v = pair(rng, (batch, seqlen_q, 2, 32), "float16")
    if paged:
        table = i32(rng.permutation(2 * capacity // page_size).reshape(batch, -1))
        shape = (2 * capacity // page_size, page_size, 2, 32)
    else:
        table, shape = None, (batch, capacity, 2, 32)
    k_cache, v_cache = rand(rng, shape, "float16"), rand(rng, shape, "float16")
    out, lse = run_and_check(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                             block_table=table, causal=True)
    # the last query (the newest token) sees the whole sequence: as without the mask
    # (within a float16 ulp or two: its tile holds other rows)
    last = cupyflash.flash_attn_with_kvcache(q[:, -1:], k_cache, v_cache,
                                             cache_seqlens=lengths + seqlen_q, block_table=table)
    np.testing.assert_allclose(out[:, -1:].astype(np.float32), last.astype(np.float32),
                               rtol=2e-3, atol=2e-4)


def test_causal_more_queries_than_keys(rng):
    """seqlen_q > seqlen_k_b: the top rows see no key (out 0, lse -inf)."""
    q = rand(rng, (2, 6, 2, 8))
    k_cache, v_cache = pair(rng, (2, 10, 2, 8))
    out, lse = run_and_check(q, k_cache, v_cache, cache_seqlens=i32([2, 10]), causal=True)
    assert (out[0, :4] == 0).all() and (lse[0, :, :4] == -np.inf).all()
    assert np.isfinite(lse[0, :, 4:]).all() and np.isfinite(lse[1]).all()


@pytest.mark.parametrize("nheads_q,nheads_kv", [(8, 2), (6, 1), (3, 3)])
def test_gqa(rng, nheads_q, nheads_kv):
    q = rand(rng, (2, 3, nheads_q, 16), "bfloat16" if _has_bf16() else "float16")
    k, v = pair(rng, (2, 1, nheads_kv, 16), q.dtype)
    k_cache, v_cache = pair(rng, (2, 33, nheads_kv, 16), q.dtype)
    run_and_check(q, k_cache, v_cache, k, v, cache_seqlens=i32([7, 32]), causal=True,
                  softmax_scale=0.2)


def _has_bf16():
    return importlib.util.find_spec("ml_dtypes") is not None


def test_num_splits_does_not_change_the_result(rng):
    q = rand(rng, (2, 4, 4, 16))
    k_cache, v_cache = pair(rng, (2, 300, 2, 16))
    results = [cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=i32([299, 17]),
                                                 causal=True, num_splits=n, return_lse=True)
               for n in (0, 1, 2, 7, 64)]
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])


def test_return_lse(rng):
    q = rand(rng, (2, 3, 2, 8))
    k_cache, v_cache = pair(rng, (2, 10, 1, 8))
    out = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)
    assert isinstance(out, np.ndarray) and out.shape == q.shape
    both = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, return_lse=True)
    assert isinstance(both, tuple) and len(both) == 2
    assert np.array_equal(both[0], out) and both[1].shape == (2, 2, 3) and both[1].dtype == np.float32
    ref_lse = reference.attention_fwd(q, k_cache[:, :5], v_cache[:, :5])[1]
    np.testing.assert_allclose(both[1], ref_lse, rtol=1e-5, atol=1e-5)


def test_empty_query_still_appends(rng):
    q = rand(rng, (2, 0, 2, 8))
    k, v = pair(rng, (2, 3, 1, 8))
    k_cache, v_cache = pair(rng, (2, 10, 1, 8))
    out, lse = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=i32([0, 7]),
                                                 return_lse=True)
    assert out.shape == (2, 0, 2, 8) and lse.shape == (2, 2, 0)
    assert np.array_equal(k_cache[0, :3], k[0]) and np.array_equal(v_cache[1, 7:], v[1])


def test_empty_batch(rng):
    q = rand(rng, (0, 1, 2, 8))
    k_cache, v_cache = pair(rng, (3, 10, 1, 8))
    out = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=i32([]),
                                            cache_batch_idx=i32([]))
    assert out.shape == (0, 1, 2, 8)


# ----------------------------------------------------------------------------
# Bad input: each rule, its exact message
# ----------------------------------------------------------------------------


def _valid(rng=None):
    """q (2,3,4,16), dense caches (2,32,2,16), k/v (2,2,2,16), lengths [5, 30]."""
    rng = rng or np.random.default_rng(1)
    return dict(q=rand(rng, (2, 3, 4, 16)), k_cache=rand(rng, (2, 32, 2, 16)),
                v_cache=rand(rng, (2, 32, 2, 16)), k=rand(rng, (2, 2, 2, 16)),
                v=rand(rng, (2, 2, 2, 16)), cache_seqlens=i32([5, 30]))


def _paged(args, page_size=16, num_blocks=6, table=((0, 1), (2, 3))):
    rng = np.random.default_rng(2)
    args["k_cache"] = rand(rng, (num_blocks, page_size, 2, 16))
    args["v_cache"] = rand(rng, (num_blocks, page_size, 2, 16))
    args["block_table"] = i32(table)
    return args


def _with(**changes):
    def mutate(args):
        for key, make in changes.items():
            args[key] = make(args)
        return args
    return mutate


def _read_only(x):
    x = x.copy()
    x.flags.writeable = False
    return x


BAD = [
    ("q-list", TypeError, "q must be a numpy.ndarray or cupy.ndarray; got list.",
     _with(q=lambda a: a["q"].tolist())),
    ("q-int", TypeError, "q must have dtype float16, bfloat16 (ml_dtypes), float32 or float64 on "
     "the CPU path (numpy arrays); got int32.",
     _with(**{n: (lambda a, n=n: a[n].astype(np.int32))
              for n in ("q", "k_cache", "v_cache", "k", "v")})),
    ("k_cache-dtype", TypeError, "k_cache must have the same dtype as q (float32); got float64.",
     _with(k_cache=lambda a: a["k_cache"].astype(np.float64))),
    ("k-dtype", TypeError, "v must have the same dtype as q (float32); got float16.",
     _with(v=lambda a: a["v"].astype(np.float16))),
    ("k_cache-rank", ValueError, "k_cache must have 4 dimensions (batch, seqlen, nheads, head_dim); "
     "got 3 with shape (2, 32, 32).", _with(k_cache=lambda a: a["k_cache"].reshape(2, 32, 32))),
    ("head_dim", ValueError, "v_cache must have the same head_dim as q (16); got 8.",
     _with(v_cache=lambda a: a["v_cache"][..., :8])),
    ("v_cache-seqlen", ValueError, "v_cache must have the same seqlen as k_cache (32); got 31.",
     _with(v_cache=lambda a: a["v_cache"][:, :31])),
    ("v_cache-batch", ValueError, "v_cache must have the same dimension 0 as k_cache (2); got 1.",
     _with(v_cache=lambda a: a["v_cache"][:1])),
    ("gqa", ValueError, "k_cache must have a number of heads that divides q's (4); got 3.",
     _with(k_cache=lambda a: a["k_cache"][:, :, :1].repeat(3, 2),
           v_cache=lambda a: a["v_cache"][:, :, :1].repeat(3, 2), k=lambda a: None,
           v=lambda a: None)),
    ("head_dim-range", ValueError, "q must have head_dim between 1 and 256; got 300.",
     _with(q=lambda a: np.ones((2, 3, 4, 300), np.float32),
           k_cache=lambda a: np.ones((2, 32, 2, 300), np.float32),
           v_cache=lambda a: np.ones((2, 32, 2, 300), np.float32), k=lambda a: None,
           v=lambda a: None)),
    ("k_cache-stride", ValueError, "k_cache must have unit stride in its last dimension (head_dim); "
     "got a stride of 2 elements.",
     _with(k_cache=lambda a: np.repeat(a["k_cache"], 2, axis=-1)[..., ::2])),
    ("k-without-v", ValueError, "v must be given with k (the new keys and values are appended "
     "together); got None.", _with(v=lambda a: None)),
    ("v-without-k", ValueError, "k must be given with v (the new keys and values are appended "
     "together); got None.", _with(k=lambda a: None)),
    ("k-batch", ValueError, "k must have the same batch size as q (2); got 1.",
     _with(k=lambda a: a["k"][:1], v=lambda a: a["v"][:1])),
    ("k-nheads", ValueError, "k must have the same nheads as k_cache (2); got 1.",
     _with(k=lambda a: a["k"][:, :, :1], v=lambda a: a["v"][:, :, :1])),
    ("k-seqlen", ValueError, "v must have the same seqlen as k (2); got 1.",
     _with(v=lambda a: a["v"][:, :1])),
    ("k-head_dim", ValueError, "k must have the same head_dim as q (16); got 8.",
     _with(k=lambda a: a["k"][..., :8], v=lambda a: a["v"][..., :8])),
    ("read-only", ValueError, "v_cache must be writeable; got a read-only array.",
     _with(v_cache=lambda a: _read_only(a["v_cache"]))),
    ("caches-overlap", ValueError, "v_cache must not overlap k_cache in memory; got arrays that "
     "share memory.", _with(v_cache=lambda a: a["k_cache"])),
    ("seqlens-huge", ValueError, "cache_seqlens must fit in int32; got 4294967296.",
     _with(cache_seqlens=lambda a: 2**32)),
    ("causal", TypeError, "causal must be a bool; got int.", _with(causal=lambda a: 1)),
    ("softmax_scale", ValueError, "softmax_scale must be finite and > 0; got -1.0.",
     _with(softmax_scale=lambda a: -1.0)),
    ("num_splits-type", TypeError, "num_splits must be an int (0: automatic); got float.",
     _with(num_splits=lambda a: 2.0)),
    ("num_splits-bool", TypeError, "num_splits must be an int (0: automatic); got bool.",
     _with(num_splits=lambda a: True)),
    ("num_splits-negative", ValueError, "num_splits must be >= 0 (0: automatic); got -1.",
     _with(num_splits=lambda a: -1)),
    ("return_lse", TypeError, "return_lse must be a bool; got NoneType.",
     _with(return_lse=lambda a: None)),
    ("seqlens-type", TypeError, "cache_seqlens must be None, an int or an int32 array of shape "
     "(batch,) like q; got list.", _with(cache_seqlens=lambda a: [5, 30])),
    ("seqlens-float", TypeError, "cache_seqlens must be None, an int or an int32 array of shape "
     "(batch,) like q; got float.", _with(cache_seqlens=lambda a: 5.0)),
    ("seqlens-dtype", TypeError, "cache_seqlens must have dtype int32; got int64.",
     _with(cache_seqlens=lambda a: a["cache_seqlens"].astype(np.int64))),
    ("seqlens-shape", ValueError, "cache_seqlens must have shape (batch,) with batch = 2 (q's); "
     "got (3,).", _with(cache_seqlens=lambda a: i32([1, 2, 3]))),
    ("seqlens-negative", ValueError, "cache_seqlens must be >= 0; got -4 for sequence 1.",
     _with(cache_seqlens=lambda a: i32([3, -4]))),
    ("seqlens-int-negative", ValueError, "cache_seqlens must be >= 0; got -1 for sequence 0.",
     _with(cache_seqlens=lambda a: -1)),
    ("seqlens-capacity", ValueError, "cache_seqlens + seqlen_new (2) must be at most the cache's "
     "seqlen (32); got 33 for sequence 1.", _with(cache_seqlens=lambda a: i32([5, 31]))),
    ("seqlens-capacity-no-append", ValueError, "cache_seqlens must be at most the cache's seqlen "
     "(32); got 40 for sequence 0.",
     _with(cache_seqlens=lambda a: 40, k=lambda a: None, v=lambda a: None)),
    ("append-without-seqlens", ValueError, "cache_seqlens must be given to append k and v (None "
     "means the whole cache is valid, leaving no slot to append to); got None.",
     _with(cache_seqlens=lambda a: None)),
    ("batch-mismatch", ValueError, "k_cache must have the same batch size as q (2) when neither "
     "cache_batch_idx nor block_table is given; got 3.",
     _with(k_cache=lambda a: np.concatenate([a["k_cache"], a["k_cache"][:1]]),
           v_cache=lambda a: np.concatenate([a["v_cache"], a["v_cache"][:1]]))),
    ("batch_idx-dtype", TypeError, "cache_batch_idx must have dtype int32; got int64.",
     _with(cache_batch_idx=lambda a: np.array([1, 0]))),
    ("batch_idx-numpy-only", TypeError, "cache_batch_idx must be a numpy.ndarray or cupy.ndarray; "
     "got list.", _with(cache_batch_idx=lambda a: [1, 0])),
    ("batch_idx-shape", ValueError, "cache_batch_idx must have shape (batch,) with batch = 2 (q's); "
     "got (2, 1).", _with(cache_batch_idx=lambda a: i32([[1], [0]]))),
    ("batch_idx-range", ValueError, "cache_batch_idx must hold cache rows in [0, batch_cache = 2); "
     "got 2 at [1].", _with(cache_batch_idx=lambda a: i32([0, 2]))),
    ("batch_idx-negative", ValueError, "cache_batch_idx must hold cache rows in [0, batch_cache = "
     "2); got -1 at [0].", _with(cache_batch_idx=lambda a: i32([-1, 0]))),
    ("batch_idx-repeat-append", ValueError, "cache_batch_idx must not let two appended keys share "
     "a cache slot (sequences 0 and 1 would both write it); got overlapping appends.",
     _with(cache_batch_idx=lambda a: i32([1, 1]), cache_seqlens=lambda a: i32([5, 5]))),
    ("both-indexings", ValueError, "cache_batch_idx must be None when block_table is given (a "
     "paged cache has no rows to pick); got both.",
     lambda a: dict(_paged(a), cache_batch_idx=i32([0, 1]))),
    ("page_size", ValueError, "k_cache must have a page_size (dimension 1) that is a positive "
     "multiple of 16 when block_table is given; got 24.", lambda a: _paged(a, page_size=24)),
    ("page_size-0", ValueError, "k_cache must have a page_size (dimension 1) that is a positive "
     "multiple of 16 when block_table is given; got 0.",
     lambda a: dict(_paged(a, page_size=0), k=None, v=None, cache_seqlens=0)),
    ("table-dtype", TypeError, "block_table must have dtype int32; got int64.",
     lambda a: dict(_paged(a), block_table=np.array([[0, 1], [2, 3]]))),
    ("table-rank", ValueError, "block_table must have shape (batch, max_blocks_per_seq) with batch "
     "= 2 (q's); got (4,).", lambda a: dict(_paged(a), block_table=i32([0, 1, 2, 3]))),
    ("table-batch", ValueError, "block_table must have shape (batch, max_blocks_per_seq) with batch "
     "= 2 (q's); got (1, 2).", lambda a: _paged(a, table=((0, 1),))),
    ("table-stride", ValueError, "block_table must have unit stride in its last dimension "
     "(max_blocks_per_seq); got a stride of 2 elements.",
     lambda a: dict(_paged(a), block_table=i32([[0, 9, 1, 9], [2, 9, 3, 9]])[:, ::2])),
    ("table-narrow", ValueError, "block_table must have enough blocks per sequence for "
     "cache_seqlens + seqlen_new (2): 33 keys of sequence 1 need 3 blocks of 16; got "
     "max_blocks_per_seq = 2.", lambda a: dict(_paged(a), cache_seqlens=i32([5, 31]))),
    ("table-range", ValueError, "block_table must hold block indices in [0, num_blocks = 6) in the "
     "entries a sequence uses; got 6 at [1, 1].", lambda a: _paged(a, table=((0, 1), (2, 6)))),
    ("table-negative", ValueError, "block_table must hold block indices in [0, num_blocks = 6) in "
     "the entries a sequence uses; got -1 at [0, 0].", lambda a: _paged(a, table=((-1, 1), (2, 3)))),
    ("table-shared-append", ValueError, "block_table must not let two appended keys share a cache "
     "slot (sequences 0 and 1 would both write it); got overlapping appends.",
     lambda a: dict(_paged(a, table=((0, 1), (0, 1))), cache_seqlens=i32([20, 20]))),
]


def _call(args):
    args = dict(args)
    return cupyflash.flash_attn_with_kvcache(args.pop("q"), args.pop("k_cache"),
                                             args.pop("v_cache"), args.pop("k"), args.pop("v"),
                                             **args)


def test_valid_arguments_pass():
    _call(_valid())
    _call(_paged(_valid()))


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(case):
    _, cls, message, mutate = case
    args = mutate(_valid())
    k_cache0 = args["k_cache"].copy()
    with pytest.raises(cls, match="^" + re.escape(f"cupyflash.{FN}: {message}") + "$"):
        _call(args)
    assert np.array_equal(args["k_cache"], k_cache0)  # nothing appended before the check


def test_shared_block_append_at_different_slots_is_fine(rng):
    """Two sequences may append into one block when their slots differ."""
    args = _paged(_valid(), table=((0, 1), (0, 2)))
    args["cache_seqlens"] = i32([16, 18])  # slots (1, 0..1) and (2, 2..3): distinct
    _call(args)


# ----------------------------------------------------------------------------
# GPU arrays: validated, then planned once per signature and run (a fake GPU
# that computes with the CPU path; the kernels' own tests are in test_gpu_decode.py)
# ----------------------------------------------------------------------------


def _on_fake_gpu(args):
    """FakeCupyArrays of the arguments (float32 as float16, which the GPU path takes)."""
    def fake(x):
        return FakeCupyArray(x.astype(np.float16) if x.dtype == np.float32 else x)
    return {name: (None if x is None else fake(x)) for name, x in args.items()}


def _fake_gpu_args(rng, paged=False):
    return _on_fake_gpu(_paged(_valid(rng)) if paged else _valid(rng))


def _host_args(args):
    return {n: (x.host.copy() if isinstance(x, FakeCupyArray) else x) for n, x in args.items()}


@pytest.mark.parametrize("paged", [False, True])
def test_cupy_runs_the_planned_gpu_call(monkeypatch, rng, paged):
    plans, runs = install_fake_gpu(monkeypatch, compute_decode=cpu_compute_decode)
    args = _fake_gpu_args(rng, paged)
    host = _host_args(args)
    expect = _call(host)
    out = _call(args)
    assert isinstance(out, FakeCupyArray) and np.array_equal(out.host, expect)
    assert np.array_equal(args["k_cache"].host, host["k_cache"])  # the append reached the cache
    assert [kind for kind, _ in plans] == ["decode"] and len(runs) == 1
    capacity = (args["block_table"].shape[1] * args["k_cache"].shape[1] if paged
                else args["k_cache"].shape[1])
    assert plans[0][1]["max_seqlen_k"] == capacity


def test_cupy_int_cache_seqlens_reuses_the_plan(monkeypatch, rng):
    """A decode loop advances an int cache_seqlens every step: one plan, the length per run."""
    plans, runs = install_fake_gpu(monkeypatch, compute_decode=cpu_compute_decode)
    args = _fake_gpu_args(rng)
    args["k"] = args["v"] = None
    for length in (3, 4, 9):
        host = _host_args(dict(args, cache_seqlens=length))
        out = _call(dict(args, cache_seqlens=length))
        assert np.array_equal(out.host, _call(host))
    assert len(plans) == 1 and len(runs) == 3


@pytest.mark.parametrize("change,cls,message", [
    (dict(q=lambda a: FakeCupyArray(a["q"].host.astype(np.float32))), TypeError,
     "q must have dtype float16 or bfloat16 on the GPU path"),
    (dict(cache_seqlens=lambda a: FakeCupyArray(i32([1, 2]).astype(np.int64))), TypeError,
     "cache_seqlens must have dtype int32; got int64."),
    (dict(cache_seqlens=lambda a: i32([1, 2])), TypeError,
     "cache_seqlens must be a cupy.ndarray like q (numpy and cupy inputs cannot be mixed); got "
     "numpy.ndarray."),
    (dict(cache_seqlens=lambda a: 31), ValueError,
     "cache_seqlens + seqlen_new (2) must be at most the cache's seqlen (32); got 33"),
    (dict(k=lambda a: None), ValueError, "k must be given with v"),
    (dict(cache_batch_idx=lambda a: FakeCupyArray(i32([[0, 1]]))), ValueError,
     "cache_batch_idx must have shape (batch,) with batch = 2 (q's); got (1, 2)."),
    (dict(cache_batch_idx=lambda a: FakeCupyArray(i32([0, 1]), device_id=1)), ValueError,
     "cache_batch_idx must be on the same device as q (cuda:0); got cuda:1."),
])
def test_cupy_invalid_input_is_refused_first(monkeypatch, rng, change, cls, message):
    install_fake_gpu(monkeypatch)
    args = _with(**change)(_fake_gpu_args(rng))
    with pytest.raises(cls, match=re.escape(f"cupyflash.{FN}: {message}")):
        _call(args)


def test_cupy_paged_page_size_is_checked(monkeypatch, rng):
    install_fake_gpu(monkeypatch)
    args = _on_fake_gpu(_paged(_valid(rng), page_size=8))
    with pytest.raises(ValueError, match=re.escape("that is a positive multiple of 16 when "
                                                   "block_table is given; got 8.")):
        _call(args)


# ----------------------------------------------------------------------------
# Foreign CPU arrays
# ----------------------------------------------------------------------------


@pytest.fixture
def jax():
    return pytest.importorskip("jax")


def test_jax_cpu_without_append(jax, rng):
    a = _paged(_valid(rng))
    expect = cupyflash.flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"],
                                               cache_seqlens=a["cache_seqlens"],
                                               block_table=a["block_table"], causal=True,
                                               return_lse=True)
    j = {n: jax.numpy.asarray(x) for n, x in a.items() if x is not None}
    out, lse = cupyflash.flash_attn_with_kvcache(j["q"], j["k_cache"], j["v_cache"],
                                                 cache_seqlens=j["cache_seqlens"],
                                                 block_table=j["block_table"], causal=True,
                                                 return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert np.array_equal(np.asarray(out), expect[0]) and np.array_equal(np.asarray(lse), expect[1])
    # a Python int for cache_seqlens passes through unchanged
    out = cupyflash.flash_attn_with_kvcache(j["q"], j["k_cache"], j["v_cache"], cache_seqlens=20,
                                            block_table=j["block_table"])
    expect = cupyflash.flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=20,
                                               block_table=a["block_table"])
    assert np.array_equal(np.asarray(out), expect)


def test_jax_append_is_refused(jax, rng):
    a = _valid(rng)
    j = {n: jax.numpy.asarray(x) for n, x in a.items()}
    message = (f"cupyflash.{FN}: k must be None for jax.Array inputs (k and v are written into "
               "k_cache and v_cache in place, and JAX arrays are immutable: "
               f"cupyflash.jax.{FN} appends functionally and returns the new caches); got a jax.Array.")
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        cupyflash.flash_attn_with_kvcache(j["q"], j["k_cache"], j["v_cache"], j["k"], j["v"],
                                          cache_seqlens=j["cache_seqlens"])


def test_jax_mixed_with_numpy_is_refused(jax, rng):
    a = _valid(rng)
    with pytest.raises(TypeError, match=re.escape(
            "cache_seqlens must be a jax.Array like q (array types cannot be mixed); got "
            "numpy.ndarray.")):
        cupyflash.flash_attn_with_kvcache(jax.numpy.asarray(a["q"]), jax.numpy.asarray(a["k_cache"]),
                                          jax.numpy.asarray(a["v_cache"]),
                                          cache_seqlens=a["cache_seqlens"])


def test_jax_index_dtype_is_checked(jax, rng):
    a = _valid(rng)
    j = {n: jax.numpy.asarray(x) for n, x in a.items()}
    with pytest.raises(TypeError, match=re.escape("block_table must have dtype int32; got")):
        cupyflash.flash_attn_with_kvcache(j["q"], j["k_cache"], j["v_cache"],
                                          cache_seqlens=j["cache_seqlens"],
                                          block_table=jax.numpy.zeros((2, 2), dtype="int16"))


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("paged", [False, True])
def test_torch_cpu_append_is_visible_to_the_caller(torch, rng, paged):
    a = _paged(_valid(rng)) if paged else _valid(rng)
    expect_k, expect_v = a["k_cache"].copy(), a["v_cache"].copy()
    expect = cupyflash.flash_attn_with_kvcache(a["q"], expect_k, expect_v, a["k"], a["v"],
                                               cache_seqlens=a["cache_seqlens"],
                                               block_table=a.get("block_table"), causal=True)
    t = {n: torch.from_numpy(x.copy()) for n, x in a.items()}
    lengths0 = t["cache_seqlens"].clone()
    out = cupyflash.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"],
                                            cache_seqlens=t["cache_seqlens"],
                                            block_table=t.get("block_table"), causal=True)
    assert isinstance(out, torch.Tensor) and np.array_equal(out.numpy(), expect)
    assert np.array_equal(t["k_cache"].numpy(), expect_k)
    assert np.array_equal(t["v_cache"].numpy(), expect_v)
    assert not np.array_equal(expect_k, a["k_cache"])  # something was appended
    assert torch.equal(t["cache_seqlens"], lengths0)


# ----------------------------------------------------------------------------
# Memory: one sequence's keys at a time, not the batch's
# ----------------------------------------------------------------------------


def test_extra_memory_is_one_sequence_not_the_batch(rng):
    """Paged: the call's traced peak (outputs included) stays near one sequence's
    gathered keys and values, far below gathering the whole batch."""
    import tracemalloc

    batch, page_size, blocks, nheads_kv, head_dim = 16, 64, 16, 2, 64
    table = i32(rng.permutation(batch * blocks).reshape(batch, blocks))
    k_cache, v_cache = pair(rng, (batch * blocks, page_size, nheads_kv, head_dim))
    q = rand(rng, (batch, 1, 4, head_dim))
    one_sequence = 2 * blocks * page_size * nheads_kv * head_dim * 4  # its keys and values
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                cache_seqlens=blocks * page_size,
                                                block_table=table)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert np.isfinite(out).all()
    assert one_sequence <= peak < 2 * one_sequence, (peak, one_sequence, batch * one_sequence)


def test_cupy_bfloat16_storage_needs_dtype(monkeypatch, rng):
    """uint16 storage of bfloat16 data: refused without dtype=, planned as bfloat16 with it."""
    plans, _ = install_fake_gpu(monkeypatch)
    args = {n: FakeCupyArray(x if x.dtype == np.int32 else testing.to_bf16_bits(x))
            for n, x in _valid(rng).items()}
    with pytest.raises(TypeError, match=re.escape("(for bfloat16 data held as uint16/int16, pass "
                                                  "dtype='bfloat16')")):
        _call(args)
    _call(dict(args, dtype="bfloat16"))
    assert plans[0][1]["dtype_name"] == "bfloat16"


# ----------------------------------------------------------------------------
# Found by trying to break it (session 5)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("length", [np.int64(5), np.int32(5)])
def test_numpy_integer_cache_seqlens_is_an_int(monkeypatch, rng, length):
    """A numpy integer length runs like the int it holds, on the CPU and the (fake) GPU path."""
    args = _valid(rng)
    want = _call(dict(args, cache_seqlens=5, k=None, v=None))
    assert np.array_equal(_call(dict(args, cache_seqlens=length, k=None, v=None)), want)
    install_fake_gpu(monkeypatch, compute_decode=cpu_compute_decode)
    gpu = _on_fake_gpu(dict(args, k=None, v=None))
    got = _call(dict(gpu, cache_seqlens=length))
    assert np.array_equal(got.host, _call(dict(_host_args(gpu), cache_seqlens=5)))


@pytest.mark.parametrize("length,message", [(-5, "cache_seqlens must be >= 0; got -5"),
                                            (10**6, "block_table must have enough blocks per sequence")])
def test_int_lengths_are_checked_with_an_empty_batch(monkeypatch, rng, length, message):
    args = _paged(_valid(rng))
    empty = {n: (x[:0] if n in ("q", "k", "v", "block_table") else x) for n, x in args.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        _call(dict(empty, cache_seqlens=length))
    install_fake_gpu(monkeypatch)
    gpu = _on_fake_gpu(empty)
    _call(dict(gpu, cache_seqlens=3))  # a valid call plans the signature first
    with pytest.raises(ValueError, match=re.escape(message)):
        _call(dict(gpu, cache_seqlens=length))


def test_broadcast_cache_is_refused_for_an_append(rng):
    args = _valid(rng)
    strides = (0,) + args["k_cache"].strides[1:]
    for name in ("k_cache", "v_cache"):
        base = args[name][:1].copy()
        args[name] = np.lib.stride_tricks.as_strided(base, (2,) + base.shape[1:], strides)
    with pytest.raises(ValueError, match=re.escape("k_cache must not be a broadcast view")):
        _call(args)


def test_new_keys_that_are_views_of_the_cache_are_copied_first(rng):
    args = _valid(rng)
    host = {n: (x.copy() if isinstance(x, np.ndarray) else x) for n, x in args.items()}
    args["v"] = args["k_cache"][:, 3:5]  # v is read from slots the append of k is about to write
    host["v"] = host["k_cache"][:, 3:5].copy()
    args["cache_seqlens"] = host["cache_seqlens"] = i32([3, 3])
    assert np.array_equal(_call(args), _call(host))
    assert np.array_equal(args["v_cache"], host["v_cache"])


@pytest.mark.parametrize("alias", ["f4", "single", "float32"])
def test_dtype_aliases_name_the_same_dtype(alias):
    assert np.array_equal(_call(dict(_valid(), dtype=alias)), _call(_valid()))  # fresh caches each


# ----------------------------------------------------------------------------
# Attention variants (issue 13) on the CPU path
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    dict(window_size=(7, 0)), dict(softcap=3.0), dict(alibi_slopes="per-batch"), dict(sinks=True),
    dict(window_size=(5, 2), softcap=2.0, alibi_slopes="per-head", sinks=True)])
@pytest.mark.parametrize("paged", [False, True])
def test_variants_match_the_reference_per_sequence(rng, options, paged):
    """Each sequence against reference.attention_fwd with the variant on its own keys
    (appended first), causal aligned to the sequence's own length."""
    args = _paged(_valid(rng)) if paged else _valid(rng)
    batch, _, nheads, _ = args["q"].shape
    options = dict(options)
    if options.get("alibi_slopes") == "per-batch":
        options["alibi_slopes"] = rand(rng, (batch, nheads)) ** 2
    elif options.get("alibi_slopes") == "per-head":
        options["alibi_slopes"] = rand(rng, (nheads,)) ** 2
    if options.get("sinks"):
        options["sinks"] = rand(rng, (nheads,))
    out, lse = _call(dict(args, causal=True, return_lse=True, **options))
    table = args.get("block_table")
    for b in range(batch):
        length = int(args["cache_seqlens"][b]) + args["k"].shape[1]
        keys, values = (_sequence(args[c], b, length, None, table) for c in ("k_cache", "v_cache"))
        seq = dict(options)
        if seq.get("alibi_slopes") is not None and seq["alibi_slopes"].ndim == 2:
            seq["alibi_slopes"] = seq["alibi_slopes"][b]
        ref_out, ref_lse = reference.attention_fwd(args["q"][b:b + 1], keys, values, causal=True, **seq)
        np.testing.assert_allclose(out[b], ref_out[0], atol=2e-5)
        np.testing.assert_allclose(lse[b], ref_lse[0], atol=2e-5)


def _fake_variant_options(rng, batch, nheads, which):
    """Variant options for the fake GPU (float32 FakeCupyArrays) and the same on the host."""
    options = {}
    if "window" in which:
        options["window_size"] = (6, 0) if "causal" in which else (5, 2)
    if "softcap" in which:
        options["softcap"] = 2.5
    if "alibi" in which:
        options["alibi_slopes"] = rand(rng, (batch, nheads) if "per-batch" in which else (nheads,)) ** 2
    if "sinks" in which:
        options["sinks"] = rand(rng, (nheads,))
    gpu = {n: (FakeCupyArray(x) if isinstance(x, np.ndarray) else x) for n, x in options.items()}
    return gpu, options


def _compute_decode_with_variants(plan_kwargs, q, k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens,
                                  cache_batch_idx, block_table, cache_seqlen, var=None):
    """compute_decode for the fake GPU: the CPU path with the plan's variant options,
    the slopes and sinks read at the call's pointers (``var``)."""
    from fakes import BY_POINTER

    options = dict(plan_kwargs.get("options") or {})
    assert (var is None) == (not options)
    if options:
        alibi, sinks, dsinks, bias, mask, dbias, block_map, kv_block_map, seed, offset = var  # VARIANT_PER_CALL
        assert (dsinks, bias, mask, dbias, block_map, kv_block_map, seed, offset) == (0,) * 8
        assert (alibi != 0) == ("alibi_slopes" in options) and (sinks != 0) == ("sinks" in options)
        for name, ptr in (("alibi_slopes", alibi), ("sinks", sinks)):
            if ptr:
                options[name] = BY_POINTER[ptr].host
    host = lambda a: None if a is None else a.host  # noqa: E731
    lengths = cache_seqlen if cache_seqlens is None else cache_seqlens.host
    o, l = cupyflash.flash_attn_with_kvcache(
        host(q), host(k_cache), host(v_cache), host(k_new), host(v_new), cache_seqlens=lengths,
        cache_batch_idx=host(cache_batch_idx), block_table=host(block_table),
        softmax_scale=plan_kwargs["softmax_scale"], causal=plan_kwargs["causal"], return_lse=True, **options)
    out.host[...] = o
    if lse is not None:  # (an lse the call does not return has no array)
        lse.host[...] = l


@pytest.mark.parametrize("which", ["window", "window causal", "softcap", "alibi", "alibi per-batch", "sinks",
                                   "window sinks causal", "softcap alibi per-batch"])
@pytest.mark.parametrize("paged", [False, True])
def test_variants_on_the_gpu_run_the_planned_decode_call(monkeypatch, rng, which, paged):
    """GPU arrays with variants: the decode plan gets the options, each run the slopes'
    and sinks' pointers of its own call; one plan per signature (fresh values reuse it)."""
    plans, runs = install_fake_gpu(monkeypatch, compute_decode=_compute_decode_with_variants)
    args = _fake_gpu_args(rng, paged)
    causal = "causal" in which
    for step in range(2):
        gpu_opts, host_opts = _fake_variant_options(rng, 2, 4, which)
        host = _host_args(args)
        expect = _call(dict(host, causal=causal, return_lse=True, **host_opts))
        out, lse = _call(dict(args, causal=causal, return_lse=True, **gpu_opts))
        assert np.array_equal(out.host, expect[0]) and np.array_equal(lse.host, expect[1])
        assert np.array_equal(args["k_cache"].host, host["k_cache"])  # the append reached the cache
    assert [kind for kind, _ in plans] == ["decode"] and len(runs) == 2
    planned = plans[0][1]["options"]
    assert sorted(planned) == sorted(host_opts) and not planned.get("append_only")
    if "window_size" in host_opts:
        assert planned["window_size"] == host_opts["window_size"]
    # another window is another plan; the same call without variants another again
    if "window_size" in host_opts:
        _call(dict(args, causal=causal, **dict(gpu_opts, window_size=(3, 0))))
        assert len(plans) == 2 and plans[1][1]["options"]["window_size"] == (3, 0)
    before = len(plans)
    _call(dict(args, causal=causal))
    assert len(plans) == before + 1 and not plans[-1][1].get("options")


def test_variants_off_take_the_plain_plan(monkeypatch, rng):
    """Options given but off (window (-1, -1), softcap 0) plan and run as no variant."""
    plans, runs = install_fake_gpu(monkeypatch, compute_decode=_compute_decode_with_variants)
    args = _fake_gpu_args(rng)
    out = _call(dict(args, window_size=(-1, -1), softcap=0.0))
    assert not plans[0][1]["options"]
    assert np.array_equal(out.host, _call(_host_args(args)))


def test_variants_on_the_long_chunk_path_plan_the_dense_forward_with_them(monkeypatch, rng):
    """A chunk that takes the dense forward: the append-only decode launch has no variant,
    the forward is planned with the options and run with this call's pointers."""
    from cupyflash import dispatch

    seen = []
    plans, runs = install_fake_gpu(
        monkeypatch, compute_fwd=lambda kw, *arrays, var=None: seen.append(("fwd", var)),
        compute_decode=lambda kw, *arrays, var=None: seen.append(("decode", var)))
    monkeypatch.setattr(dispatch, "decode_uses_dense_fwd", lambda **kw: True)
    args = _fake_gpu_args(rng)
    gpu_opts, host_opts = _fake_variant_options(rng, 2, 4, "window sinks alibi per-batch")
    _call(dict(args, causal=True, **gpu_opts))
    (k1, decode), (k2, fwd) = plans
    assert (k1, k2) == ("decode", "fwd")
    assert decode["append_only"] and not decode.get("options")
    assert sorted(fwd["options"]) == sorted(host_opts) and fwd["causal"]
    # _params.VARIANT_PER_CALL: the slopes' and sinks' pointers, every other one 0
    rest = (0,) * (len(_params.VARIANT_PER_CALL) - 2)
    assert seen == [("decode", None), ("fwd", (gpu_opts["alibi_slopes"].data.ptr, gpu_opts["sinks"].data.ptr, *rest))]


def test_variants_bad_input_on_the_gpu(monkeypatch, rng):
    install_fake_gpu(monkeypatch)
    args = _fake_gpu_args(rng)
    with pytest.raises(ValueError, match=re.escape(f"cupyflash.{FN}: softcap must be finite and >= 0")):
        _call(dict(args, softcap=-1.0))
    with pytest.raises(TypeError, match=re.escape(f"cupyflash.{FN}: sinks must be a cupy.ndarray like q")):
        _call(dict(args, sinks=rand(rng, (4,))))
    with pytest.raises(ValueError, match=re.escape(f"cupyflash.{FN}: alibi_slopes must have shape (4,) or (2, 4)")):
        _call(dict(args, alibi_slopes=FakeCupyArray(rand(rng, (3,)))))


@pytest.mark.parametrize("which", ["", "window", "softcap alibi per-batch", "window sinks causal"])
def test_plan_decode_sets_the_variant_bits_and_fields(monkeypatch, rng, which):
    """The real planner (kernels not built): the kernel's VARIANT argument, VariantParams'
    per-plan fields in the params template, the variant writer; the append-only plan
    has none."""
    from cupyflash import _gpu_decode, _launch, _params, _variant, dispatch

    made = []

    class Launcher:
        def __init__(self, launches, template, writer, variant=None):
            made.append((launches, template, variant))

    monkeypatch.setattr(_launch, "Launcher", Launcher)
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: 132)
    monkeypatch.setattr(_launch, "compute_capability", lambda device_id: (9, 0))
    q = FakeCupyArray(np.zeros((2, 3, 8, 64), np.float16))
    k_cache, v_cache = (FakeCupyArray(np.zeros((2, 4096, 2, 64), np.float16)) for _ in range(2))
    _, options = _fake_variant_options(rng, 2, 8, which)
    for append_only in (False, True):
        made.clear()
        call = _gpu_decode.plan_decode(q, k_cache, v_cache, None, None, None, max_seqlen_k=4096, softmax_scale=0.125,
                                       causal="causal" in which, num_splits=0, dtype_name="float16", device_id=0,
                                       append_only=append_only, options=options)
        (launches, template, variant), = made
        bits = 0 if append_only else _variant.bits(options)
        assert launches[0].args[-1] == str(bits)
        var = np.frombuffer(template, _params.DECODE_PARAMS)[0]["var"]
        want = _variant.plan_fields({} if append_only else options, 0.125, 8)
        for name, value in want.items():
            assert var[name] == np.asarray(value, var[name].dtype), name
        assert variant == (_params.offset_of(_params.DECODE_PARAMS, "var"), _variant.WRITER)
        if "window" in which and not append_only:  # the splits share the window's tiles, not the cache's
            left = options["window_size"][0]
            tiles = dispatch.decode_visible_tiles(4096, 3, 64, left)
            assert call.plan.num_splits == dispatch.decode_num_splits(2 * 2, tiles, 132) <= tiles
