"""Block sparsity (issue 14): ``cupyflash.BlockMask``'s map and the CPU path's skipping.

The map is checked against a brute-force reduction of the mask (random and
structured masks, tails in both axes, broadcast shapes, strided views); the CPU
path with skipping against the same path masking every tile, bit for bit; a
BlockMask against the plain mask; and the bad inputs' messages.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _blockmask, cpu

SCALE = 0.3


def _brute(mask4, gr, gc):
    """The state of each (gr, gc) cell of a 4-D mask, element by element."""
    bm, hm, rows, cols = mask4.shape
    gr, gc = (gr if rows > 1 else 1), (gc if cols > 1 else 1)
    nr, nc = -(-rows // gr), -(-cols // gc)
    out = np.empty((bm, hm, nr, nc), np.uint8)
    for r in range(nr):
        for c in range(nc):
            cell = mask4[:, :, r * gr:(r + 1) * gr, c * gc:(c + 1) * gc]
            out[:, :, r, c] = np.where(~cell.any(axis=(2, 3)), 0, np.where(cell.all(axis=(2, 3)), 2, 1))
    return out


def _structured(kind, rows, cols, rng):
    i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
    if kind == "random":
        return rng.random((rows, cols)) < 0.5
    if kind == "block-diagonal":
        return (i // 128) == (j // 128)
    if kind == "sparse-blocks":  # ~90% of the 128 x 128 blocks empty, the rest full
        keep = rng.random((-(-rows // 128), -(-cols // 128))) < 0.1
        return keep[i // 128, j // 128]
    if kind == "local":
        return np.abs(i - j) <= 40
    if kind == "all-false":
        return np.zeros((rows, cols), bool)
    return np.ones((rows, cols), bool)


@pytest.mark.parametrize("kind", ["random", "block-diagonal", "sparse-blocks", "local", "all-false", "all-true"])
@pytest.mark.parametrize("rows, cols", [(64, 64), (1, 200), (200, 1), (130, 257), (300, 61)])
def test_map_is_the_cells_states(kind, rows, cols):
    mask = _structured(kind, rows, cols, np.random.default_rng(rows * cols))
    bm = cupyflash.BlockMask.from_mask(mask)
    assert bm.block_map.dtype == np.uint8 and bm.block_map.flags.c_contiguous
    np.testing.assert_array_equal(bm.block_map, _brute(mask[None, None], 64, 64))
    for tile in [(128, 64), (128, 128), (128, 32), (128, 16), (64, 64), (16, 12)]:
        want = _brute(mask[None, None], *tile)  # exact states at the tile
        got = bm.tiles(*tile)
        assert got.shape == want.shape
        # the coarsened map equals the exact one where the tile is a multiple of the cell
        # and is conservative (never empty or full wrongly) where it is not
        if tile[0] % 64 == 0 and tile[1] % 64 == 0:
            np.testing.assert_array_equal(got, want)
        assert np.all((got == 0) <= (want == 0)) and np.all((got == 2) <= (want == 2))
        assert bm.tiles(*tile) is got  # computed once per tile shape


@pytest.mark.parametrize("shape", [(2, 3, 70, 90), (1, 3, 70, 90), (2, 1, 1, 90), (2, 1, 70, 1), (3, 70, 90), (90,)])
def test_map_of_broadcast_shapes_keeps_their_size_one_dimensions(shape):
    mask = np.random.default_rng(0).random(shape) < 0.3
    bm = cupyflash.BlockMask.from_mask(mask)
    mask4 = mask.reshape((1,) * (4 - mask.ndim) + shape)
    assert bm.block_map.shape[:2] == mask4.shape[:2]
    assert [n == 1 for n in bm.block_map.shape[2:]] == [n == 1 for n in mask4.shape[2:]]
    np.testing.assert_array_equal(bm.block_map, _brute(mask4, 64, 64))


def test_map_of_strided_views():
    rng = np.random.default_rng(1)
    base = rng.random((4, 300, 260)) < 0.2
    base[:, :128, :128] = True
    for view in (base[::2, ::2, 1::2], base.transpose(0, 2, 1), base[:, :, ::-1],
                 np.broadcast_to(base[:1, :1], (3, 1, 260))):
        bm = cupyflash.BlockMask.from_mask(view)
        v4 = view.reshape((1,) * (4 - view.ndim) + view.shape)
        np.testing.assert_array_equal(bm.block_map, _brute(v4, 64, 64))


def test_map_reduction_never_expands_a_broadcast_mask():
    mask = np.ones((1, 1, 1, 4096), bool)
    bm = cupyflash.BlockMask.from_mask(mask)
    assert bm.block_map.shape == (1, 1, 1, 64)
    assert bm.tiles(128, 128).shape == (1, 1, 1, 32)


def test_combine_heads():
    tiles = np.array([[[[0, 2, 1, 2]]], [[[0, 2, 2, 0]]]], np.uint8)  # (2, 1, 1, 4)
    np.testing.assert_array_equal(_blockmask.combine_heads(tiles), [[0, 2, 1, 1]])


# ---------------------------------------------------------------------------- CPU path


def _inputs(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype=np.float32):
    q = rng.standard_normal((batch, seqlen_q, nheads, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, nheads_kv, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, nheads_kv, head_dim)).astype(dtype)
    return q, k, v


def _block_sparse_mask(rng, shape, block=128, keep=0.3):
    *lead, rows, cols = shape
    blocks = rng.random((-(-rows // block), -(-cols // block))) < keep
    blocks[-1, -1], blocks[-1, 0] = True, False  # one full, one empty tile at least
    i, j = np.arange(rows) // block, np.arange(cols) // block
    mask = np.broadcast_to(blocks[i[:, None], j[None, :]], shape).copy()
    # partial blocks too: a few elements hidden in some full blocks, a row that sees nothing
    if rows > 5:
        mask[..., 5, :] = False
    mask[..., :, 3] &= rng.random(mask.shape[:-1]) < 0.5
    return mask


def _unskipped(monkeypatch):
    """Make the CPU path mask every tile (the map says partial everywhere)."""
    monkeypatch.setattr(cpu._Variants, "tile_state", lambda self, m0, n0: _blockmask.PARTIAL)


@pytest.mark.parametrize("case", ["dense", "gqa-per-head", "causal", "window", "row-broadcast", "bias+sinks"])
def test_cpu_skipping_is_bit_for_bit_the_unskipped_path(monkeypatch, case):
    rng = np.random.default_rng(7)
    batch, sq, sk, h, hkv, d = 2, 300, 333, 4, 2, 32
    q, k, v = _inputs(rng, batch, sq, sk, h, hkv, d)
    kwargs = {}
    mask_shape = (batch, 1, sq, sk)
    causal = case == "causal"
    if case == "gqa-per-head":
        mask_shape = (1, h, sq, sk)
    if case == "window":
        kwargs["window_size"] = (100, 30)
    if case == "row-broadcast":
        mask_shape = (batch, 1, 1, sk)
    if case == "bias+sinks":
        kwargs["attn_bias"] = rng.standard_normal((1, h, sq, sk)).astype(np.float32)
        kwargs["sinks"] = rng.standard_normal(h).astype(np.float32)
    mask = _block_sparse_mask(rng, mask_shape)
    bm = cupyflash.BlockMask.from_mask(mask)
    tiles = _blockmask.combine_heads(bm.tiles(cpu.BLOCK_M, cpu.BLOCK_N))
    if case != "row-broadcast":
        assert (tiles == _blockmask.EMPTY).any() and (tiles == _blockmask.FULL).any()  # both paths run
    got = cupyflash.flash_attn_fwd(q, k, v, softmax_scale=SCALE, causal=causal, attn_mask=bm, **kwargs)
    plain = cupyflash.flash_attn_fwd(q, k, v, softmax_scale=SCALE, causal=causal, attn_mask=mask, **kwargs)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, *got, softmax_scale=SCALE, causal=causal, attn_mask=bm,
                                     **kwargs)
    _unskipped(monkeypatch)
    want = cupyflash.flash_attn_fwd(q, k, v, softmax_scale=SCALE, causal=causal, attn_mask=mask, **kwargs)
    want_grads = cupyflash.flash_attn_bwd(dout, q, k, v, *want, softmax_scale=SCALE, causal=causal,
                                          attn_mask=mask, **kwargs)
    for a, b, c in zip(got, plain, want):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)
    for a, c in zip(grads, want_grads):
        np.testing.assert_array_equal(a, c)
    if case != "row-broadcast":  # row 5 sees no key
        assert np.all(got[1][:, :, 5] == (-np.inf if "sinks" not in kwargs else kwargs["sinks"][None, :]))


def test_cpu_skipping_matches_the_reference_on_rows_that_see_nothing():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 1, 260, 260, 2, 2, 16, np.float64)
    mask = _block_sparse_mask(rng, (260, 260), keep=0.2)
    mask[:128] = False  # a whole query tile sees no key: every one of its tiles skipped
    out, lse = cupyflash.flash_attn_fwd(q, k, v, softmax_scale=SCALE, attn_mask=cupyflash.BlockMask.from_mask(mask))
    ref_out, ref_lse = cupyflash.reference.attention_fwd(q, k, v, softmax_scale=SCALE, attn_mask=mask)
    assert np.all(out[:, :128] == 0) and np.all(lse[:, :, :128] == -np.inf)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)  # (float32 accumulation)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-6)


def test_blockmask_map_is_reused(monkeypatch):
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 1, 200, 200, 2, 2, 16)
    bm = cupyflash.BlockMask.from_mask(_block_sparse_mask(rng, (200, 200)))
    calls = []
    real = _blockmask.cell_map
    monkeypatch.setattr(_blockmask, "cell_map", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for _ in range(3):
        cupyflash.flash_attn_fwd(q, k, v, attn_mask=bm)
    assert calls == []
    cupyflash.flash_attn_fwd(q, k, v, attn_mask=bm.mask)  # a plain mask: mapped per call
    assert calls == [1]


def test_blockmask_in_varlen_and_flash_attn():
    rng = np.random.default_rng(5)
    seqlens = [70, 200, 1]
    cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
    total, h, d = int(cu[-1]), 2, 16
    q = rng.standard_normal((total, h, d)).astype(np.float32)
    mask = _block_sparse_mask(rng, (3, 1, 200, 200))
    bm = cupyflash.BlockMask.from_mask(mask)
    got = cupyflash.flash_attn_varlen_fwd(q, q, q, cu, cu, 200, 200, attn_mask=bm)
    want = cupyflash.flash_attn_varlen_fwd(q, q, q, cu, cu, 200, 200, attn_mask=mask)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    q4 = q[None, :200]
    out = cupyflash.flash_attn(q4, q4, q4, attn_mask=cupyflash.BlockMask.from_mask(mask[:1]))
    np.testing.assert_array_equal(out, cupyflash.flash_attn(q4, q4, q4, attn_mask=mask[:1]))


@pytest.mark.parametrize("make, exc, text", [
    (lambda: [[True]], TypeError, "mask must be a numpy.ndarray or cupy.ndarray of bool; got builtins.list"),
    (lambda: np.ones((4, 4), np.float32), TypeError, "mask must have dtype bool (True = attend); got float32"),
    (lambda: np.ones((4, 4), np.uint8), TypeError, "mask must have dtype bool"),
    (lambda: np.ones((), bool), ValueError, "mask must have 1 to 4 dimensions"),
    (lambda: np.ones((1, 1, 1, 4, 4), bool), ValueError, "mask must have 1 to 4 dimensions"),
    (lambda: np.ones((0, 4), bool), ValueError, "mask must have no dimension of size 0"),
])
def test_bad_masks(make, exc, text):
    with pytest.raises(exc, match="^cupyflash.BlockMask.from_mask: " + __import__("re").escape(text)):
        cupyflash.BlockMask.from_mask(make())


def test_blockmask_of_the_wrong_shape_is_named_attn_mask():
    q = np.zeros((1, 70, 2, 16), np.float32)
    bm = cupyflash.BlockMask.from_mask(np.ones((71, 70), bool))
    with pytest.raises(ValueError, match=r"^cupyflash.flash_attn_fwd: attn_mask must be broadcastable"):
        cupyflash.flash_attn_fwd(q, q, q, attn_mask=bm)


def test_repr():
    bm = cupyflash.BlockMask.from_mask(np.eye(128, dtype=bool))
    assert repr(bm) == "BlockMask(shape=(128, 128), cells=(1, 1, 2, 2), empty=2/4, full=0/4)"
