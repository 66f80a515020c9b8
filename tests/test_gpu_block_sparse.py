"""Block-sparse masks on the GPU (issue 14): the wgmma forward's tile map (VAR_BLOCK_MAP).

Masks whose tiles are a mix of empty (skipped), full (no mask code) and partial
ones, passed as a plain bool mask (mapped on the GPU per call) and as a
:class:`cupyflash.BlockMask` (mapped once), against the float64 reference with
the rule of the other variant GPU tests (:mod:`cupyflash.testing`, as
tests/test_gpu_bias.py: ``max|got - ref64| <= 2 * max|naive - ref64| + FLOOR``),
outputs NaN-poisoned, ``-inf`` in lse exact. Rows that see no key (every tile
of their query block skipped, or hidden in partial tiles) give out 0 and lse
-inf. Causal and window combinations, fp16 and bf16, D=64 and 128 (wgmma, which
skips) and D=96 (mma.sync, which masks every tile: the same results), varlen.
The backward with a BlockMask gives the plain mask's gradients bit for bit (checked
here); its own tile maps: tests/test_gpu_block_sparse_bwd.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _blockmask, _gpu, dispatch, testing
from test_cpu_bias import SCALE as PACKED_SCALE  # sibling modules
from test_cpu_bias import _packed_reference
from test_gpu_bias import FLOOR, _check, _fwd, _inputs, _params, cp  # noqa: F401 (cp: fixture)
from test_gpu_variants import _NO_BF16, dev, dtype_kw, host
from test_varlen import cu_seqlens, packed_inputs

pytestmark = pytest.mark.gpu

# id -> (dtype, (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), causal). The
# wgmma ones have query blocks enough (>= 0.8 x 132 SMs) not to be split over keys: a
# split forward runs on the mma.sync kernel, which takes no map (run 64: with 2-4 heads
# every one of them was split, and the map's key loop went untested; KERNELS is checked
# on the CPU, tests/test_block_sparse_plan.py).
CONFIGS = {
    "bf16-d64-700x645-gqa": ("bfloat16", (2, 700, 645, 12, 6, 64), False),      # wgmma, 64-key tiles
    "f16-d64-520x520-causal": ("float16", (4, 520, 520, 6, 6, 64), True),       # wgmma
    "f16-d128-400x777": ("float16", (4, 400, 777, 8, 4, 128), False),           # wgmma
    "bf16-d128-600x300-causal": ("bfloat16", (4, 600, 300, 6, 6, 128), True),   # wgmma; top rows see no key
    "f16-d96-390x450": ("float16", (2, 390, 450, 2, 2, 96), False),             # mma.sync (no skipping)
    "f16-d64-640x640-staged": ("float16", (4, 640, 640, 6, 6, 64), False),      # wgmma, staged mask
}
#: id -> the forward kernel each config runs on an H200 (132 SMs), with a mask.
KERNELS = {name: "flash_fwd.cu" if name == "f16-d96-390x450" else "flash_fwd_sm90.cu" for name in CONFIGS}


def _block_sparse(rng, shape, block=64, keep=0.25, partial=0.3):
    """A bool mask of ``shape`` (..., rows, keys) made of ``block`` x ``block`` tiles:
    empty, full, or (``partial`` of the kept ones) random inside."""
    *lead, rows, cols = shape
    nb = (-(-rows // block), -(-cols // block))
    kept = rng.random((*lead, *nb)) < keep
    mixed = kept & (rng.random((*lead, *nb)) < partial)
    i, j = np.arange(rows) // block, np.arange(cols) // block
    mask = kept[..., i[:, None], j[None, :]].copy()
    inside = rng.random(shape) < 0.6
    return np.where(mixed[..., i[:, None], j[None, :]], inside, mask)


def _kinds(tile_map):
    return {int(x) for x in np.unique(tile_map)}


@pytest.mark.parametrize("config", list(_params(CONFIGS, CONFIGS)))
@pytest.mark.parametrize("form", ["mask", "BlockMask"])
@pytest.mark.parametrize("mask_shape", ["per-batch", "per-head", "shared"])
def test_block_sparse_forward(cp, rng, mask_shape, form, config):
    dtype, shape, causal = CONFIGS[config]
    b, m, n, h = shape[:4]
    q, k, v = _inputs(rng, dtype, shape)
    lead = {"per-batch": (b, 1), "per-head": (1, h), "shared": ()}[mask_shape]
    mask = _block_sparse(rng, (*lead, m, n))
    mask[..., 70:75, :] = False  # rows that see no key, inside partial tiles
    bm = cupyflash.BlockMask.from_mask(cp.asarray(mask))
    assert _kinds(cp.asnumpy(bm.block_map)) == {0, 1, 2}
    arg = bm if form == "BlockMask" else cp.asarray(mask)
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": arg})
    assert np.all(fwd[1][:, :, 70:75] == -np.inf) and np.all(fwd[0][:, 70:75] == 0)
    _check(q, k, v, fwd, causal, attn_mask=mask)


@pytest.mark.parametrize("config", list(_params(["bf16-d64-700x645-gqa", "f16-d128-400x777", "f16-d96-390x450"],
                                                CONFIGS)))
def test_query_blocks_whose_every_tile_is_skipped(cp, rng, config):
    dtype, shape, causal = CONFIGS[config]
    b, m, n = shape[:3]
    q, k, v = _inputs(rng, dtype, shape)
    mask = _block_sparse(rng, (b, 1, m, n))
    mask[:, :, :256] = False  # two whole 128-row query blocks: no tile visited
    mask[:, :, 300:310, :] = True  # and rows that see every key
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": cupyflash.BlockMask.from_mask(cp.asarray(mask))})
    assert np.all(fwd[0][:, :256] == 0) and np.all(fwd[1][:, :, :256] == -np.inf)
    _check(q, k, v, fwd, causal, attn_mask=mask)


@pytest.mark.parametrize("config", list(_params(["bf16-d64-700x645-gqa", "f16-d128-400x777"], CONFIGS)))
@pytest.mark.parametrize("combo", ["window", "causal+window", "sinks", "bias", "softcap"])
def test_block_sparse_with_other_variants(cp, rng, combo, config):
    dtype, shape, causal = CONFIGS[config]
    b, m, n, h = shape[:4]
    q, k, v = _inputs(rng, dtype, shape)
    mask = _block_sparse(rng, (b, 1, m, n), keep=0.4)
    others, on_gpu = {}, {}
    if "window" in combo:
        others["window_size"] = (200, 90)
        causal = causal or combo.startswith("causal")
    if combo == "sinks":
        others["sinks"] = rng.standard_normal(h).astype(np.float32)
    if combo == "bias":
        others["attn_bias"] = (2.0 * rng.standard_normal((1, h, m, n))).astype(np.float32)
    if combo == "softcap":
        others["softcap"] = 8.0
    on_gpu = {name: cp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in others.items()}
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": cupyflash.BlockMask.from_mask(cp.asarray(mask))},
               **on_gpu)
    _check(q, k, v, fwd, causal, attn_mask=mask, **others)


def test_the_wgmma_plan_takes_the_map_and_the_mma_sync_plan_does_not(cp):
    for d, want in ((64, (128, 64)), (128, (128, 64)), (96, None)):
        variant = dispatch.VAR_MASK | dispatch.VAR_BLOCK_MAP
        plan = _gpu.select_fwd(batch=1, seqlen_q=1024, seqlen_k=1024, nheads_q=16, head_dim=d, dtype="float16",
                               causal=False, vec=True, num_sms=132, cc=(9, 0), variant=variant)
        assert dispatch.fwd_block_map_tile(plan) == want


def test_blockmask_tile_maps_are_kept(cp, rng):
    dtype, shape, causal = CONFIGS["bf16-d64-700x645-gqa"]
    q, k, v = _inputs(rng, dtype, shape)
    mask = cp.asarray(_block_sparse(rng, (shape[1], shape[2])))
    bm = cupyflash.BlockMask.from_mask(mask)
    for _ in range(2):
        _fwd(cp, q, k, v, dtype, causal, {"attn_mask": bm})
    assert list(bm._tiles) == [(128, 64)]  # noqa: SLF001
    want = _blockmask.coarsen(cp.asnumpy(bm.block_map), (64, 64), 128, 64, shape[1], shape[2])
    np.testing.assert_array_equal(cp.asnumpy(bm._tiles[(128, 64)]), want)  # noqa: SLF001


@pytest.mark.parametrize("dtype,head_dim", [("float16", 64), pytest.param("bfloat16", 128, marks=_NO_BF16),
                                            ("float16", 96)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_block_sparse(cp, rng, causal, dtype, head_dim):
    check_varlen_block_sparse(cp, rng, causal, dtype, head_dim)


def check_varlen_block_sparse(cp, rng, causal, dtype, head_dim, block=64):
    """A packed batch (an empty sequence, one of one row, tails) with a BlockMask of
    ``block``-tiles against the float64 reference (out, lse)."""
    lens_q, lens_k = [200, 0, 390, 1, 129], [300, 12, 260, 65, 129]
    nheads, nheads_kv = 4, 2
    q, k, v = packed_inputs(rng, lens_q, lens_k, nheads, nheads_kv, head_dim, dtype)
    max_q, max_k = max(lens_q) + 3, max(lens_k) + 16
    mask = _block_sparse(rng, (len(lens_q), 1, max_q, max_k), block=block)
    d_q, d_k, d_v = (dev(cp, x) for x in (q, k, v))
    out, lse = cupyflash.flash_attn_varlen_fwd(
        d_q, d_k, d_v, cp.asarray(cu_seqlens(lens_q)), cp.asarray(cu_seqlens(lens_k)), max_q, max_k,
        softmax_scale=PACKED_SCALE, causal=causal, **dtype_kw(cp, dtype),
        attn_mask=cupyflash.BlockMask.from_mask(cp.asarray(mask)))
    refs = _packed_reference(q, k, v, testing.random_normal(rng, q.shape, dtype), lens_q, lens_k, causal,
                             attn_mask=mask)
    for key, got in (("out", host(out, dtype)), ("lse", host(lse))):
        ref64, naive = refs[key]
        testing.assert_close_to_reference(key, got, ref64, naive, testing.OUT_FACTOR, FLOOR)


def test_backward_with_a_blockmask_is_the_plain_mask_s(cp, rng):
    dtype, shape, causal = CONFIGS["bf16-d64-700x645-gqa"]
    q, k, v = (dev(cp, x) for x in _inputs(rng, dtype, shape))
    mask = cp.asarray(_block_sparse(rng, (shape[0], 1, shape[1], shape[2])))
    kw = dtype_kw(cp, dtype)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, attn_mask=mask, **kw)
    dout = dev(cp, testing.random_normal(rng, shape[:2] + (shape[3], shape[5]), dtype))
    got = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, attn_mask=cupyflash.BlockMask.from_mask(mask), **kw)
    want = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, attn_mask=mask, **kw)
    for a, b in zip(got, want):
        assert cp.array_equal(a, b)
