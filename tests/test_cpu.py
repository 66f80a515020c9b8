"""The tiled CPU path against the float64 reference, plus metamorphic properties.

The grid is dtype x head_dim x causal x (seqlen_q, seqlen_k) x GQA ratio.  The
full grid is marked ``slow``; the default run takes a fixed subset (chosen by
index arithmetic, not at random) that covers every value of every axis.
"""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest

import cupyflash
from cupyflash import cpu, reference, testing

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (8, 40, 59, 64, 111, 128, 256)
CAUSAL = (False, True)
SEQLENS = ((1, 1), (1, 17), (17, 1), (113, 203), (203, 113), (512, 256), (1023, 1024))
GQA = (1, 4)
_LARGE = 5  # SEQLENS[5:] are the expensive pairs (the dense reference dominates)

_NO_BF16 = pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is None,
                              reason="bfloat16 needs ml_dtypes (pip install ml_dtypes)")


def _in_default_run(i_dtype, i_hd, i_causal, i_seq, i_gqa):
    """Deterministic subset: half of the small-seqlen grid, 12 cases per large pair."""
    if i_seq < _LARGE:
        return (i_dtype + i_hd + i_causal + i_seq + i_gqa) % 2 == 0
    return i_hd == (2 * i_dtype + 3 * i_causal + i_gqa + i_seq) % 7


def _grid():
    axes = (DTYPES, HEAD_DIMS, CAUSAL, SEQLENS, GQA)
    for idx in itertools.product(*(range(len(a)) for a in axes)):
        dtype, head_dim, causal, seqlens, gqa = (a[i] for a, i in zip(axes, idx))
        marks = () if _in_default_run(*idx) else (pytest.mark.slow,)
        if dtype == "bfloat16":
            marks += (_NO_BF16,)
        name = f"{dtype}-d{head_dim}-{'causal' if causal else 'full'}-" \
               f"{seqlens[0]}x{seqlens[1]}-gqa{gqa}"
        yield pytest.param(dtype, head_dim, causal, seqlens, gqa, marks=marks, id=name)


GRID = list(_grid())


def _shape_for(seqlens, gqa):
    """(batch, nheads_q, nheads_kv): smaller batch/heads for the large pairs."""
    seqlen_q, seqlen_k = seqlens
    if seqlen_q * seqlen_k > 1 << 16:
        return 1, gqa, 1
    return 2, 2 * gqa, 2


def _run_and_check(rng, dtype, head_dim, causal, seqlens, gqa, softmax_scale=None):
    batch, nheads_q, nheads_kv = _shape_for(seqlens, gqa)
    q, k, v = testing.random_qkv(rng, batch, *seqlens, nheads_q, nheads_kv, head_dim, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)

    out, lse = cupyflash.flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and out.flags.c_contiguous
    assert lse.shape == (batch, nheads_q, seqlens[0]) and lse.dtype == np.float32
    testing.assert_fwd_matches_reference(q, k, v, out, lse, softmax_scale=softmax_scale,
                                         causal=causal)

    dq, dk, dv = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse,
                                          softmax_scale=softmax_scale, causal=causal)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype
    testing.assert_bwd_matches_reference(dout, q, k, v, dq, dk, dv,
                                         softmax_scale=softmax_scale, causal=causal)


@pytest.mark.parametrize("dtype,head_dim,causal,seqlens,gqa", GRID)
def test_matches_reference(rng, dtype, head_dim, causal, seqlens, gqa):
    _run_and_check(rng, dtype, head_dim, causal, seqlens, gqa)


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(113, 203), (203, 113), (17, 1)], ids=str)
@pytest.mark.parametrize("gqa", GQA, ids=lambda g: f"gqa{g}")
def test_float64_inputs(rng, causal, seqlens, gqa):
    """float64 in, float64 out, accumulated in float32 like the kernels."""
    _run_and_check(rng, "float64", 64, causal, seqlens, gqa)


@pytest.mark.parametrize("softmax_scale", [0.05, 0.3, 2.0])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
def test_softmax_scale(rng, softmax_scale, causal):
    _run_and_check(rng, "float32", 40, causal, (113, 203), 4, softmax_scale=softmax_scale)


def test_default_run_covers_every_axis_value():
    default = [p.values for p in GRID if pytest.mark.slow.mark not in p.marks]
    assert len(default) >= 150
    for axis, values in enumerate((DTYPES, HEAD_DIMS, CAUSAL, SEQLENS, GQA)):
        assert {case[axis] for case in default} == set(values), axis


# ----------------------------------------------------------------------------
# Tiling: odd tile sizes, skipped and masked tiles
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 48), (64, 16), (7, 5)])
@pytest.mark.parametrize("seqlens", [(70, 45), (45, 70), (64, 64)], ids=str)
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
def test_any_tile_size(rng, monkeypatch, block_m, block_n, seqlens, causal):
    """Results do not depend on the tile sizes, including ones that divide nothing."""
    monkeypatch.setattr(cpu, "BLOCK_M", block_m)
    monkeypatch.setattr(cpu, "BLOCK_N", block_n)
    _run_and_check(rng, "float32", 16, causal, seqlens, 2)


def _count_calls(monkeypatch, name):
    calls = []
    original = getattr(cpu, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu, name, counted)
    return calls


@pytest.mark.parametrize("seqlens,visited,masked", [
    ((512, 512), 10, 4),   # 4x4 tiles: the lower triangle, the diagonal masked
    ((256, 512), 7, 2),    # bottom-right alignment: row tile 0 sees key tiles 0..2
    ((512, 256), 3, 2),    # row tiles 0 and 1 see nothing and are not visited
])
def test_causal_skips_hidden_tiles_and_masks_only_the_diagonal(rng, monkeypatch, seqlens,
                                                               visited, masked):
    monkeypatch.setattr(cpu, "BLOCK_M", 128)
    monkeypatch.setattr(cpu, "BLOCK_N", 128)
    q, k, v = testing.random_qkv(rng, 1, *seqlens, 2, 1, 8, "float32")
    steps = _count_calls(monkeypatch, "_online_softmax_step")
    masks = _count_calls(monkeypatch, "_apply_causal_mask")
    out, lse = cpu.fwd(q, k, v, 0.3, True)
    assert (len(steps), len(masks)) == (visited, masked)

    del masks[:]
    tiles = _count_calls(monkeypatch, "_bwd_tile")
    cpu.bwd(q, q, k, v, out, lse, 0.3, True)
    assert (len(tiles), len(masks)) == (visited, masked)


# ----------------------------------------------------------------------------
# Metamorphic properties
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_permuting_keys_and_values_together_keeps_output(rng, dtype):
    q, k, v = testing.random_qkv(rng, 2, 150, 300, 4, 2, 32, dtype)
    perm = rng.permutation(300)
    out, lse = cupyflash.flash_attn_fwd(q, k, v)
    out_p, lse_p = cupyflash.flash_attn_fwd(q, k[:, perm], v[:, perm])
    # only the order of the float32 sums changes; the result is rounded to dtype
    tol = 4 * np.finfo(np.dtype(dtype)).eps
    np.testing.assert_allclose(out_p.astype(np.float32), out.astype(np.float32), atol=tol, rtol=tol)
    np.testing.assert_allclose(lse_p, lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("split", [1, 128, 150, 299])
def test_merging_two_halves_by_lse_gives_the_whole(rng, split):
    q, k, v = testing.random_qkv(rng, 2, 70, 300, 4, 1, 24, "float32")
    out, lse = cupyflash.flash_attn_fwd(q, k, v)
    out_a, lse_a = cupyflash.flash_attn_fwd(q, k[:, :split], v[:, :split])
    out_b, lse_b = cupyflash.flash_attn_fwd(q, k[:, split:], v[:, split:])
    lse_ab = np.logaddexp(lse_a, lse_b)
    # (B, H, S) weights onto the (B, S, H, D) outputs
    w_a = np.exp(lse_a - lse_ab).transpose(0, 2, 1)[..., None]
    w_b = np.exp(lse_b - lse_ab).transpose(0, 2, 1)[..., None]
    np.testing.assert_allclose(lse_ab, lse, atol=2e-6, rtol=1e-6)
    np.testing.assert_allclose(w_a * out_a + w_b * out_b, out, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=_NO_BF16 if d == "bfloat16" else ())
                                   for d in DTYPES + ("float64",)])
@pytest.mark.parametrize("seqlens", [(37, 20), (300, 129), (5, 1)], ids=str)
def test_rows_that_see_no_key(rng, dtype, seqlens):
    """Causal with seqlen_q > seqlen_k: the top rows are empty: 0, -inf, zero grads, no NaN."""
    seqlen_q, seqlen_k = seqlens
    q, k, v = testing.random_qkv(rng, 2, seqlen_q, seqlen_k, 4, 2, 16, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    dq, dk, dv = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True)
    empty = seqlen_q - seqlen_k  # rows 0 .. empty-1 see no key
    for x in (out, lse, dq, dk, dv):
        assert not np.isnan(x.astype(np.float32)).any()
    assert (out[:, :empty] == 0).all()
    assert (lse[:, :, :empty] == -np.inf).all()
    assert np.isfinite(lse[:, :, empty:]).all()
    assert (dq[:, :empty] == 0).all()
    assert np.isfinite(dk.astype(np.float32)).all() and np.isfinite(dv.astype(np.float32)).all()


def _packed_qkv(rng, batch, seqlen, nheads, head_dim, dtype):
    qkv = testing.random_normal(rng, (batch, seqlen, 3, nheads, head_dim), dtype)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
def test_views_of_packed_qkv_equal_contiguous_copies(rng, dtype, causal):
    q, k, v = _packed_qkv(rng, 2, 200, 4, 24, dtype)
    assert not q.flags.c_contiguous
    dout = testing.random_normal(rng, (2, 200, 8, 24), dtype)[:, :, ::2]  # strided heads
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal)
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal)

    c = np.ascontiguousarray
    out_c, lse_c = cupyflash.flash_attn_fwd(c(q), c(k), c(v), causal=causal)
    grads_c = cupyflash.flash_attn_bwd(c(dout), c(q), c(k), c(v), out_c, lse_c, causal=causal)
    np.testing.assert_array_equal(out, out_c)
    np.testing.assert_array_equal(lse, lse_c)
    for g, g_c in zip(grads, grads_c):
        np.testing.assert_array_equal(g, g_c)


def test_other_strided_views(rng):
    """Reversed, sliced and transposed-storage views (unit last stride) all work."""
    base_q = testing.random_normal(rng, (3, 80, 4, 16), "float32")
    base_kv = testing.random_normal(rng, (2, 4, 150, 16), "float32")  # heads-first storage
    q = base_q[::-2, ::-1]  # batch 2 of 3, reversed; reversed sequence
    k = base_kv.transpose(0, 2, 1, 3)[:, :, 1:3]  # (2, 150, 2, 16), heads-first storage
    v = np.flip(k, axis=1)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    testing.assert_fwd_matches_reference(q, k, v, out, lse, causal=True)
    dq, dk, dv = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, causal=True)
    testing.assert_bwd_matches_reference(out, q, k, v, dq, dk, dv, causal=True)


def test_deterministic_flag_and_repeat_runs_are_bit_identical(rng):
    q, k, v = testing.random_qkv(rng, 1, 200, 180, 4, 2, 32, "float16")
    dout = testing.random_normal(rng, q.shape, "float16")
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    first = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True)
    second = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_flash_attn_is_the_forward_output(rng):
    q, k, v = testing.random_qkv(rng, 1, 33, 40, 2, 1, 8, "float32")
    np.testing.assert_array_equal(cupyflash.flash_attn(q, k, v, causal=True),
                                  cupyflash.flash_attn_fwd(q, k, v, causal=True)[0])


def test_lse_is_the_natural_log(rng):
    q, k, v = testing.random_qkv(rng, 1, 20, 30, 2, 2, 8, "float64")
    _, lse = cupyflash.flash_attn_fwd(q, k, v, softmax_scale=0.5)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * 0.5
    np.testing.assert_allclose(lse, np.log(np.exp(scores).sum(-1)), rtol=1e-6)


def test_reference_is_the_same_contract(rng):
    """The CPU path and the reference agree on a GQA causal case with empty rows."""
    q, k, v = testing.random_qkv(rng, 1, 40, 25, 6, 2, 8, "float64")
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    ref_out, ref_lse = reference.attention_fwd(q, k, v, causal=True)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
