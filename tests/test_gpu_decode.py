"""flash_attn_with_kvcache on the GPU (kernels_cu/flash_decode.cu) against the
float64 reference (skipped without a GPU).

Inputs are fresh random float16/bfloat16 data; the memory pool is NaN-poisoned
before each call so unwritten outputs show; results and the caches after the
append are checked with tests/test_kvcache.py's rule (the naive same-dtype
error bound of cupyflash.testing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import cupyflash
from cupyflash import testing
from test_kvcache import assert_matches_reference, i32

pytestmark = pytest.mark.gpu


def _cp():
    return pytest.importorskip("cupy")


def _host(rng, shape, dtype):
    return testing.random_normal(rng, shape, dtype)


def _dev(cp, x):
    """A host array on the GPU: float16 as is, bfloat16 as its uint16 bits."""
    if x.dtype == np.float16 or x.dtype == np.int32:
        return cp.asarray(x)
    return cp.asarray(testing.to_bf16_bits(x.astype(np.float32)))


def _back(x, dtype):
    x = x.get()
    return testing.from_bf16_bits(x) if dtype == "bfloat16" else x.astype(np.float32)


def _poison_pool(cp, nbytes):
    """Leave NaN in the pool blocks the next allocations of these sizes reuse."""
    for n in nbytes:
        cp.full(max(1, n // 2), np.nan, dtype=cp.float16)
    cp.cuda.Stream.null.synchronize()


def run_and_check(cp, rng, dtype, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                  cache_batch_idx=None, block_table=None, causal=False, num_splits=0):
    """Run on the GPU (device copies of the host arrays), check out, lse and the caches."""
    d = {name: (None if x is None else _dev(cp, x)) for name, x in
         (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
          ("cache_batch_idx", cache_batch_idx), ("block_table", block_table))}
    lengths = cache_seqlens if not isinstance(cache_seqlens, np.ndarray) else cp.asarray(cache_seqlens)
    _poison_pool(cp, (q.nbytes, q.size * 2))
    out, lse = cupyflash.flash_attn_with_kvcache(
        d["q"], d["k_cache"], d["v_cache"], d["k"], d["v"], cache_seqlens=lengths,
        cache_batch_idx=d["cache_batch_idx"], block_table=d["block_table"], causal=causal,
        num_splits=num_splits, return_lse=True, dtype=dtype)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    got = _back(out, dtype)
    ref_k, ref_v = assert_matches_reference(q, k_cache, v_cache, k, v, got, lse.get(),
                                            cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                                            block_table=block_table, causal=causal)
    assert np.array_equal(_back(d["k_cache"], dtype).astype(np.float64), ref_k)
    assert np.array_equal(_back(d["v_cache"], dtype).astype(np.float64), ref_v)
    return got, lse.get()


def _table(rng, batch, blocks_per_seq, num_blocks, shared=0):
    """A shuffled block table; the first ``shared`` pages of every sequence are one
    set of blocks (a shared prefix)."""
    perm = rng.permutation(num_blocks)
    table = perm[:batch * blocks_per_seq].reshape(batch, blocks_per_seq).copy()
    if shared:
        table[:, :shared] = table[0, :shared]
    return i32(table)


def decode_step(rng, dtype, seqlen_q, nheads_q, nheads_kv, head_dim, paged, batch=3, capacity=640, page_size=32):
    """Host inputs of a batch of decode steps with an append: q, the new k and v, cache
    lengths 0 / 20 / near the capacity, the block table (None for a dense cache) and the
    caches' shape; draw fresh caches of that shape for each call (the append writes them)."""
    q = _host(rng, (batch, seqlen_q, nheads_q, head_dim), dtype)
    k, v = (_host(rng, (batch, seqlen_q, nheads_kv, head_dim), dtype) for _ in range(2))
    lengths = i32([0, 20, capacity - seqlen_q - 3])
    if paged:
        table = _table(rng, batch, capacity // page_size, batch * capacity // page_size + 2)
        return q, k, v, lengths, table, (table.max() + 1, page_size, nheads_kv, head_dim)
    return q, k, v, lengths, None, (batch, capacity, nheads_kv, head_dim)


DECODE_CASES = [  # dtype, head_dim, nheads_q, nheads_kv, paged, causal
    ("float16", 128, 8, 2, False, False),
    ("bfloat16", 128, 8, 2, True, True),
    ("float16", 64, 4, 4, True, False),
    ("bfloat16", 64, 8, 1, False, True),
    ("float16", 256, 4, 2, True, False),
    ("bfloat16", 96, 6, 2, False, False),
    ("float16", 32, 2, 2, True, True),
    ("float16", 40, 4, 2, False, True),
    ("bfloat16", 59, 4, 1, True, False),   # head_dim not a multiple of 8: element loads
    ("float16", 192, 2, 1, False, False),
]


@pytest.mark.parametrize("dtype,head_dim,nheads_q,nheads_kv,paged,causal", DECODE_CASES)
def test_decode_per_sequence_lengths(rng, dtype, head_dim, nheads_q, nheads_kv, paged, causal):
    """One new query per sequence, lengths including 0 and a page tail, with an append."""
    cp = _cp()
    batch, capacity, page_size = 4, 640, 32
    q = _host(rng, (batch, 1, nheads_q, head_dim), dtype)
    k, v = (_host(rng, (batch, 1, nheads_kv, head_dim), dtype) for _ in range(2))
    lengths = i32([0, 1, 333, capacity - 1])
    if paged:
        table = _table(rng, batch, capacity // page_size, batch * capacity // page_size + 3)
        shape = (table.max() + 1, page_size, nheads_kv, head_dim)
    else:
        table, shape = None, (batch, capacity, nheads_kv, head_dim)
    k_cache, v_cache = (_host(rng, shape, dtype) for _ in range(2))
    run_and_check(cp, rng, dtype, q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table,
                  causal=causal)


@pytest.mark.parametrize("seqlen_q,nheads_q,nheads_kv", [(2, 8, 2), (5, 4, 1), (64, 4, 1), (100, 2, 2)])
@pytest.mark.parametrize("paged", [False, True])
def test_causal_chunked_prefill(rng, seqlen_q, nheads_q, nheads_kv, paged):
    """Several new queries (every warp grid: 8, 20, 256, 200 packed rows), appended and causal."""
    cp = _cp()
    dtype, head_dim, batch, page_size = "float16", 128, 2, 64
    capacity = 1024
    q = _host(rng, (batch, seqlen_q, nheads_q, head_dim), dtype)
    k, v = (_host(rng, (batch, seqlen_q, nheads_kv, head_dim), dtype) for _ in range(2))
    lengths = i32([0, 700])
    if paged:
        table = _table(rng, batch, capacity // page_size, 2 * capacity // page_size)
        shape = (2 * capacity // page_size, page_size, nheads_kv, head_dim)
    else:
        table, shape = None, (batch, capacity, nheads_kv, head_dim)
    k_cache, v_cache = (_host(rng, shape, dtype) for _ in range(2))
    run_and_check(cp, rng, dtype, q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table,
                  causal=True)


def test_causal_more_queries_than_keys(rng):
    """Rows above the bottom-right diagonal see no key: out 0, lse -inf, no NaN."""
    cp = _cp()
    q = _host(rng, (2, 9, 4, 64), "float16")
    k_cache, v_cache = (_host(rng, (2, 32, 2, 64), "float16") for _ in range(2))
    _, lse = run_and_check(cp, rng, "float16", q, k_cache, v_cache, cache_seqlens=i32([3, 0]), causal=True)
    assert np.isneginf(lse[0, :, :6]).all() and np.isfinite(lse[0, :, 6:]).all()
    assert np.isneginf(lse[1]).all()


def test_cache_batch_idx(rng):
    cp = _cp()
    q = _host(rng, (3, 1, 8, 128), "bfloat16")
    k, v = (_host(rng, (3, 2, 2, 128), "bfloat16") for _ in range(2))
    k_cache, v_cache = (_host(rng, (5, 300, 2, 128), "bfloat16") for _ in range(2))
    run_and_check(cp, rng, "bfloat16", q, k_cache, v_cache, k, v, cache_seqlens=i32([10, 290, 0]),
                  cache_batch_idx=i32([4, 0, 2]))


@pytest.mark.parametrize("page_size", [16, 48, 256])
def test_paged_shared_prefix(rng, page_size):
    """Sequences share their first pages; each appends into its own."""
    cp = _cp()
    batch, pages = 3, 8
    q = _host(rng, (batch, 1, 8, 64), "float16")
    k, v = (_host(rng, (batch, 1, 2, 64), "float16") for _ in range(2))
    table = _table(rng, batch, pages, batch * pages, shared=2)
    k_cache, v_cache = (_host(rng, (batch * pages, page_size, 2, 64), "float16") for _ in range(2))
    lengths = i32([2 * page_size, 5 * page_size + 3, 8 * page_size - 1])
    run_and_check(cp, rng, "float16", q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table)


@pytest.mark.parametrize("cache_seqlens", [None, 77])
def test_whole_cache_and_int_lengths(rng, cache_seqlens):
    cp = _cp()
    q = _host(rng, (2, 1, 8, 128), "float16")
    k_cache, v_cache = (_host(rng, (2, 2000, 2, 128), "float16") for _ in range(2))
    run_and_check(cp, rng, "float16", q, k_cache, v_cache, cache_seqlens=cache_seqlens)


def test_long_cache_splits(rng):
    """A long cache, one sequence: the automatic choice splits the keys."""
    cp = _cp()
    q = _host(rng, (1, 1, 32, 128), "bfloat16")
    k_cache, v_cache = (_host(rng, (1, 20000, 8, 128), "bfloat16") for _ in range(2))
    run_and_check(cp, rng, "bfloat16", q, k_cache, v_cache, cache_seqlens=i32([19999]))


def test_num_splits_does_not_change_the_result(rng):
    cp = _cp()
    q = _host(rng, (2, 3, 8, 64), "float16")
    k_cache, v_cache = (_host(rng, (2, 3000, 2, 64), "float16") for _ in range(2))
    lengths = i32([2999, 130])
    results = [run_and_check(cp, rng, "float16", q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                             num_splits=n)[0] for n in (1, 2, 7, 0, 500)]
    for other in results[1:]:
        assert np.abs(other - results[0]).max() < 2e-3


def test_int_cache_seqlens_reuses_one_plan(rng):
    """A decode loop advances an int length each step: one plan, the right length every step."""
    cp = _cp()
    from cupyflash import _kvcache

    q = _host(rng, (2, 1, 4, 64), "float16")
    k_cache, v_cache = (_host(rng, (2, 256, 2, 64), "float16") for _ in range(2))
    before = len(_kvcache._ENTRIES)
    for length in (1, 2, 100, 255):
        run_and_check(cp, rng, "float16", q, k_cache, v_cache, cache_seqlens=length)
    assert len(_kvcache._ENTRIES) == before + 1


def test_out_of_range_block_indices_are_clamped(rng):
    """Device indices the host cannot check: out-of-range blocks read the nearest valid block."""
    cp = _cp()
    q = _host(rng, (1, 1, 4, 64), "float16")
    k_cache, v_cache = (_host(rng, (4, 16, 2, 64), "float16") for _ in range(2))
    bad = cp.asarray(i32([[1, -7, 99]]))
    clamped = i32([[1, 0, 3]])
    lengths = cp.asarray(i32([40]))
    dq, dk, dv = (_dev(cp, x) for x in (q, k_cache, v_cache))
    out = cupyflash.flash_attn_with_kvcache(dq, dk, dv, cache_seqlens=lengths, block_table=bad)
    want = cupyflash.flash_attn_with_kvcache(dq, dk, dv, cache_seqlens=lengths, block_table=cp.asarray(clamped))
    assert not cp.isnan(out).any()
    cp.testing.assert_array_equal(out, want)


_MEMCHECK_SCRIPT = """
import cupy as cp, numpy as np, cupyflash
q = cp.ones((2, 1, 4, 64), dtype=cp.float16)
cache = cp.ones((4, 16, 2, 64), dtype=cp.float16)
table = cp.asarray(np.array([[1, -7, 99], [2**30, 3, -1]], dtype=np.int32))
rows = cp.asarray(np.array([-3, 9], dtype=np.int32))
for kw in (dict(block_table=table), dict(cache_batch_idx=rows)):
    kc = cache if "block_table" in kw else cp.ones((2, 48, 2, 64), dtype=cp.float16)
    for lengths in ([40, 48], [-5, 10**6]):  # lengths past the capacity are clamped too
        out = cupyflash.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cp.asarray(np.array(lengths, np.int32)),
                                                num_splits=3, **kw)
        assert not cp.isnan(out).any()
cp.cuda.Device().synchronize()
print("ok")
"""


def test_memcheck_out_of_range_indices():
    """compute-sanitizer memcheck: out-of-range device indices never touch memory outside the cache."""
    _cp()
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH")
    proc = subprocess.run([sanitizer, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-c",
                           _MEMCHECK_SCRIPT], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_unaligned_views(rng):
    """Strided views (every other head of a wider cache): 16-byte loads stay legal or fall back."""
    cp = _cp()
    q = _host(rng, (2, 1, 4, 64), "float16")
    wide_k, wide_v = (_host(rng, (2, 100, 4, 64), "float16") for _ in range(2))
    dq = _dev(cp, q)
    dk, dv = _dev(cp, wide_k)[:, :, ::2], _dev(cp, wide_v)[:, :, ::2]
    lengths = i32([99, 50])
    out = cupyflash.flash_attn_with_kvcache(dq, dk, dv, cache_seqlens=cp.asarray(lengths))
    assert_matches_reference(q, wide_k[:, :, ::2], wide_v[:, :, ::2], None, None, out.get().astype(np.float32),
                             cupyflash.flash_attn_with_kvcache(dq, dk, dv, cache_seqlens=cp.asarray(lengths),
                                                               return_lse=True)[1].get(),
                             cache_seqlens=lengths)


@pytest.mark.parametrize("appended,lengths", [(False, "device"), (False, "int"), (False, "none"),
                                              (True, "device"), (True, "int")])  # an append needs lengths
def test_long_chunk_on_a_dense_cache_runs_the_dense_forward(rng, launches, appended, lengths):
    """seqlen_q >= DECODE_DENSE_MIN_SEQLEN_Q on a dense cache: the dense forward reads the
    cache in place with each sequence's length as seqused_k; an append (or an int length)
    first runs an append-only decode launch that writes those lengths."""
    cp = _cp()
    from cupyflash import dispatch

    dtype = "bfloat16" if appended else "float16"
    seqlen_q = dispatch.DECODE_DENSE_MIN_SEQLEN_Q
    batch, nheads_q, nheads_kv, head_dim, capacity = 2, 4, 2, 128, 1536
    q = _host(rng, (batch, seqlen_q, nheads_q, head_dim), dtype)
    k_cache, v_cache = (_host(rng, (batch, capacity, nheads_kv, head_dim), dtype) for _ in range(2))
    k = v = None
    if appended:
        k, v = (_host(rng, (batch, seqlen_q, nheads_kv, head_dim), dtype) for _ in range(2))
    cache_seqlens = {"device": i32([0, capacity - seqlen_q - 5]), "int": 700, "none": None}[lengths]
    run_and_check(cp, rng, dtype, q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=True)
    names = " ".join(launches)
    assert "flash_fwd" in names  # the dense forward (wgmma, or its split-KV mma.sync kernel)
    assert ("flash_decode_kernel" in names) == (appended or lengths == "int")


# ----------------------------------------------------------------------------
# Attention variants (issue 13): the GPU against the CPU path of
# flash_attn_with_kvcache on float32 copies of the same inputs (the CPU path is
# checked against the float64 reference in test_kvcache.py)
# ----------------------------------------------------------------------------

#: max|gpu - cpu| <= tol * max(1, max|cpu|), out and lse (P is rounded to the
#: input type before P·V, so bf16 gets a looser bound)
_VARIANT_TOL = {"float16": {"out": 5e-3, "lse": 3e-3}, "bfloat16": {"out": 3e-2, "lse": 1e-2}}


def _variant_options(rng, which, batch, nheads_q, seqlen_q):
    """Host options (float32 arrays) for a case name: parts joined by '+'."""
    options, causal = {}, False
    for part in which.split("+"):
        if part == "window":  # left and right edges; a left edge well inside the longest sequence
            options["window_size"] = (37, 2 if seqlen_q > 1 else 0)
        elif part == "causal_window":
            options["window_size"], causal = (70, -1), True
        elif part == "softcap":
            options["softcap"] = 1.5
        elif part == "alibi":  # per query head
            options["alibi_slopes"] = (rng.random(nheads_q, dtype=np.float32) * 0.05).astype(np.float32)
        elif part == "alibi_batch":  # per (sequence, query head)
            options["alibi_slopes"] = (rng.random((batch, nheads_q), dtype=np.float32) * 0.05).astype(np.float32)
        elif part == "sinks":
            options["sinks"] = (rng.standard_normal(nheads_q, dtype=np.float32) * 2 + 1).astype(np.float32)
        else:
            raise ValueError(part)
    return options, causal


def _assert_close_variant(name, got, want, dtype):
    empty = np.isneginf(want)
    assert not np.isnan(got).any(), name
    assert np.array_equal(np.isneginf(got), empty), name
    got, want = got[~empty].astype(np.float64), want[~empty].astype(np.float64)
    if want.size:
        err, scale = np.abs(got - want).max(), max(1.0, np.abs(want).max())
        assert err <= _VARIANT_TOL[dtype][name] * scale, (name, err, scale)


def run_variant_and_check(cp, dtype, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                          block_table=None, cache_batch_idx=None, causal=False, num_splits=0, options):
    """The GPU (device copies) against the CPU path (float32 copies): out, lse, the caches."""
    d = {name: (None if x is None else _dev(cp, x)) for name, x in
         (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
          ("cache_batch_idx", cache_batch_idx), ("block_table", block_table))}
    lengths = cache_seqlens if not isinstance(cache_seqlens, np.ndarray) else cp.asarray(cache_seqlens)
    dev_options = {n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in options.items()}
    _poison_pool(cp, (q.nbytes, q.size * 2))
    out, lse = cupyflash.flash_attn_with_kvcache(
        d["q"], d["k_cache"], d["v_cache"], d["k"], d["v"], cache_seqlens=lengths,
        cache_batch_idx=d["cache_batch_idx"], block_table=d["block_table"], causal=causal,
        num_splits=num_splits, return_lse=True, dtype=dtype, **dev_options)
    f32 = {name: (None if x is None else x.astype(np.float32)) for name, x in
           (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v))}
    want_out, want_lse = cupyflash.flash_attn_with_kvcache(
        f32["q"], f32["k_cache"], f32["v_cache"], f32["k"], f32["v"], cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, block_table=block_table, causal=causal, return_lse=True, **options)
    got_out, got_lse = _back(out, dtype), lse.get()
    _assert_close_variant("out", got_out, want_out, dtype)
    _assert_close_variant("lse", got_lse, want_lse, dtype)
    assert np.array_equal(_back(d["k_cache"], dtype), f32["k_cache"])
    assert np.array_equal(_back(d["v_cache"], dtype), f32["v_cache"])
    return got_out, got_lse


VARIANTS = ["window", "causal_window", "softcap", "alibi", "alibi_batch", "sinks", "causal_window+sinks",
            "softcap+alibi_batch"]


@pytest.mark.parametrize("which", VARIANTS)
@pytest.mark.parametrize("seqlen_q,nheads_q,nheads_kv", [(1, 32, 8), (4, 32, 8), (1, 8, 8), (4, 8, 8)])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_variants(rng, which, seqlen_q, nheads_q, nheads_kv, paged):
    """Decode steps with an append, cache lengths 0 / inside / beyond the window, unsplit and 4 splits."""
    cp = _cp()
    dtype = "bfloat16" if nheads_kv == 8 and nheads_q == 32 else "float16"
    head_dim, batch = (128 if nheads_q == 32 else 64), 3
    options, causal = _variant_options(rng, which, batch, nheads_q, seqlen_q)
    q, k, v, lengths, table, shape = decode_step(rng, dtype, seqlen_q, nheads_q, nheads_kv, head_dim, paged, batch)
    for num_splits in (1, 4):
        k_cache, v_cache = (_host(rng, shape, dtype) for _ in range(2))  # fresh caches: the append writes them
        run_variant_and_check(cp, dtype, q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table,
                              causal=causal, num_splits=num_splits, options=options)


@pytest.mark.parametrize("which", ["sinks", "causal_window+sinks"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_sinks_of_rows_that_see_no_key(rng, which, num_splits):
    """No key (an empty sequence; causal rows above the diagonal): out 0 and lse the sink."""
    cp = _cp()
    dtype, batch, seqlen_q, nheads_q, nheads_kv, head_dim = "float16", 3, 4, 8, 2, 64
    options, _ = _variant_options(rng, which, batch, nheads_q, seqlen_q)
    q = _host(rng, (batch, seqlen_q, nheads_q, head_dim), dtype)
    k_cache, v_cache = (_host(rng, (batch, 300, nheads_kv, head_dim), dtype) for _ in range(2))
    out, lse = run_variant_and_check(cp, dtype, q, k_cache, v_cache, cache_seqlens=i32([0, 2, 290]), causal=True,
                                     num_splits=num_splits, options=options)
    sinks = np.broadcast_to(options["sinks"][:, None], (nheads_q, seqlen_q))
    assert (out[0] == 0).all() and (out[1, :2] == 0).all()  # sequence 1: rows 0, 1 see no key
    np.testing.assert_allclose(lse[0], sinks, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[1][:, :2], sinks[:, :2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["causal_window+sinks", "softcap+alibi_batch", "window"])
@pytest.mark.parametrize("seqlen_q,nheads_q,nheads_kv", [(5, 8, 2), (3, 32, 4), (40, 4, 2)])
def test_decode_variants_every_warp_grid(rng, which, seqlen_q, nheads_q, nheads_kv):
    """20, 24 and 80 packed rows (warp grids 2x2, 2x2, 4x1); cache_batch_idx; automatic splits."""
    cp = _cp()
    dtype, head_dim, batch = "float16", 64, 2
    options, causal = _variant_options(rng, which, batch, nheads_q, seqlen_q)
    q = _host(rng, (batch, seqlen_q, nheads_q, head_dim), dtype)
    k, v = (_host(rng, (batch, 2, nheads_kv, head_dim), dtype) for _ in range(2))
    k_cache, v_cache = (_host(rng, (3, 900, nheads_kv, head_dim), dtype) for _ in range(2))
    run_variant_and_check(cp, dtype, q, k_cache, v_cache, k, v, cache_seqlens=i32([850, 3]),
                          cache_batch_idx=i32([2, 0]), causal=causal, options=options)


def test_decode_window_over_a_long_cache_splits_the_window(rng):
    """A window of 300 keys over 20k: the automatic splits share the window's tiles."""
    cp = _cp()
    q = _host(rng, (1, 1, 32, 128), "bfloat16")
    k_cache, v_cache = (_host(rng, (1, 20000, 8, 128), "bfloat16") for _ in range(2))
    options = {"window_size": (300, 0), "sinks": (rng.standard_normal(32) + 1).astype(np.float32)}
    for num_splits in (0, 1, 3, 64):
        run_variant_and_check(cp, "bfloat16", q, k_cache, v_cache, cache_seqlens=i32([19999]), causal=True,
                              num_splits=num_splits, options=options)


@pytest.fixture
def variant_launches(monkeypatch):
    """The names of the kernels launched, with or without variants."""
    from cupyflash import _launch

    names = []
    real_call = _launch.Launcher.__call__

    def call(self, stream, *pointers, var=None):
        prefix = "" if var is None else "variant:"
        names.extend(prefix + spec.template.rsplit("::", 1)[1] for spec in self.launches)
        real_call(self, stream, *pointers, var=var)

    monkeypatch.setattr(_launch.Launcher, "__call__", call)
    return names


@pytest.mark.parametrize("which", ["window", "causal_window", "softcap", "alibi_batch", "sinks",
                                   "causal_window+sinks", "softcap+alibi"])
@pytest.mark.parametrize("appended", [False, True])
def test_long_chunk_variants_run_the_dense_forward(rng, variant_launches, which, appended):
    """seqlen_q >= DECODE_DENSE_MIN_SEQLEN_Q on a dense cache: the dense forward with the
    variants, aligned to each sequence's length (an append first: the plain append-only launch)."""
    cp = _cp()
    from cupyflash import _launch, dispatch

    if _launch.compute_capability(cp.cuda.Device().id) != (9, 0):
        pytest.skip("the dense (wgmma) forward serves long chunks on sm_90 only")
    dtype, seqlen_q = "bfloat16", dispatch.DECODE_DENSE_MIN_SEQLEN_Q
    batch, nheads_q, nheads_kv, head_dim, capacity = 2, 4, 2, 128, 1024
    options, causal = _variant_options(rng, which, batch, nheads_q, seqlen_q)
    q = _host(rng, (batch, seqlen_q, nheads_q, head_dim), dtype)
    k_cache, v_cache = (_host(rng, (batch, capacity, nheads_kv, head_dim), dtype) for _ in range(2))
    k = v = None
    if appended:
        k, v = (_host(rng, (batch, seqlen_q, nheads_kv, head_dim), dtype) for _ in range(2))
    lengths = i32([100, capacity - seqlen_q - 5])
    run_variant_and_check(cp, dtype, q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=causal,
                          options=options)
    names = " ".join(variant_launches)
    assert "variant:flash_fwd" in names
    assert ("flash_decode_kernel" in names) == appended and "variant:flash_decode" not in names
