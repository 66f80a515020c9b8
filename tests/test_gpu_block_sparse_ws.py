"""Block-sparse masks on the warp-specialised forward (kernels_cu/flash_fwd_ws.cu with
VAR_MASK | VAR_BLOCK_MAP), switched on for each test (dispatch.FWD_WS_BLOCK_MAP, at
both head_dims) on a device that reports one SM (no split-KV); every test asserts that
each forward it ran was that kernel with the map, one block per tile.

The map is read at the ws tile, 128 x 128 (128 x 64 at 192 and 256): masks of 128-blocks (empty, full, or random
inside: tiles of all three states), and of 64-blocks, whose 64 x 64 cells the tile
combines (a tile empty only where its four cells are, full only where all four are).
Against the float64 reference with tests/test_gpu_bias.py's rule, outputs NaN-poisoned,
``-inf`` in lse exact: causal, tails (lengths not multiples of 128), rows that see no key
(out 0, lse -inf: hidden inside partial tiles, or every tile of their query block empty),
D=64, 128, 192 and 256 (176 padded), fp16 and bf16, the mask per batch, per head or shared, a BlockMask reused
across calls, the other variants the kernel takes, and packed batches. Skipped without a
GPU and off compute capability 9.0.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu_bias import _check, _fwd, _inputs, _params, cp  # noqa: F401 (cp: fixture)  # sibling modules
from test_gpu_block_sparse import _block_sparse, _kinds, check_varlen_block_sparse
from test_gpu_fwd_ws import WS_KERNEL, record_ws_modes
from test_gpu_variants import _NO_BF16

import cupyflash
from cupyflash import testing

pytestmark = pytest.mark.gpu

MAP = 128 | 1024  # dispatch.VAR_MASK | dispatch.VAR_BLOCK_MAP (checked in ws_map)

# id -> (dtype, (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), causal). Key
# lengths even: the mask's rows are then read in pairs (an odd row stride takes
# VAR_BIAS_STRIDED, which stays on the cp.async kernel: the last test).
CONFIGS = {
    "bf16-d64-700x646-gqa": ("bfloat16", (2, 700, 646, 4, 2, 64), False),
    "f16-d64-520x520-causal": ("float16", (2, 520, 520, 3, 3, 64), True),
    "f16-d128-400x778": ("float16", (2, 400, 778, 4, 2, 128), False),
    "bf16-d128-600x300-causal": ("bfloat16", (2, 600, 300, 3, 3, 128), True),   # top rows see no key
    "f16-d120-512x1024": ("float16", (1, 512, 1024, 4, 4, 120), False),        # padded to 128 (a multiple of 8: aligned); whole tiles
    "bf16-d128-1024x1024-causal": ("bfloat16", (1, 1024, 1024, 2, 1, 128), True),
    # The wide head_dims: 128 x 64 tiles (dispatch._FWD_WS[256]; at 192 every variant's,
    # _FWD_WS_VARIANT_TILE), each 128-block of the mask two of them.
    "bf16-d256-400x646-causal": ("bfloat16", (2, 400, 646, 2, 1, 256), True),
    "f16-d256-520x520": ("float16", (1, 520, 520, 3, 3, 256), False),
    "f16-d192-600x778-gqa": ("float16", (2, 600, 778, 4, 2, 192), False),
    "bf16-d176-384x512-causal": ("bfloat16", (1, 384, 512, 2, 2, 176), True),  # padded to 192
}


@pytest.fixture
def ws_map(monkeypatch, launches):
    """FWD_WS_BLOCK_MAP on at every head_dim, a cc 9.0 device reporting one SM (conftest
    restores it), fresh plans; yields the (persistent, VARIANT, grid) of each ws launch
    (test_gpu_fwd_ws.record_ws_modes), then checks that every forward was one, with the map."""
    cupy = pytest.importorskip("cupy")
    from cupyflash import _gpu, _launch, dispatch

    cc = tuple(int(c) for c in cupy.cuda.Device().compute_capability)
    if cc != (9, 0):
        pytest.skip(f"the warp-specialised forward runs on compute capability 9.0; this GPU is {cc}")
    assert dispatch.VAR_MASK | dispatch.VAR_BLOCK_MAP == MAP
    monkeypatch.setattr(dispatch, "FWD_WS_BLOCK_MAP", True)
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: 1)
    _gpu.clear_plans()
    modes = record_ws_modes(monkeypatch)
    yield modes
    assert modes, "no ws launch"
    assert all(not persistent and bits & MAP == MAP for persistent, bits, _, _ in modes), modes
    fwd = [name for name in launches if name.startswith("flash_fwd")]
    assert fwd and all(name == WS_KERNEL for name in fwd), fwd
    _gpu.clear_plans()


def _ws_kinds(cp, mask):
    """The states of a mask's tiles at the ws tile."""
    return _kinds(cp.asnumpy(cupyflash.BlockMask.from_mask(cp.asarray(mask)).tiles(128, 128)))


@pytest.mark.parametrize("config", list(_params(CONFIGS, CONFIGS)))
@pytest.mark.parametrize("form", ["mask", "BlockMask"])
@pytest.mark.parametrize("mask_shape", ["per-batch", "per-head", "shared"])
def test_block_sparse_forward(ws_map, cp, rng, mask_shape, form, config):
    """Tiles empty, full and partial (128-blocks: the tile's own), rows hidden inside partial tiles."""
    dtype, shape, causal = CONFIGS[config]
    b, m, n, h = shape[:4]
    q, k, v = _inputs(rng, dtype, shape)
    lead = {"per-batch": (b, 1), "per-head": (1, h), "shared": ()}[mask_shape]
    mask = _block_sparse(rng, (*lead, m, n), block=128, keep=0.4)
    mask[..., 128:256, :128] = True  # a full tile
    mask[..., :128, 128:256] = True  # ... and one made partial by:
    mask[..., 70:75, :] = False  # rows that see no key, inside partial tiles
    assert _ws_kinds(cp, mask) == {0, 1, 2}
    arg = cupyflash.BlockMask.from_mask(cp.asarray(mask)) if form == "BlockMask" else cp.asarray(mask)
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": arg})
    assert np.all(fwd[1][:, :, 70:75] == -np.inf) and np.all(fwd[0][:, 70:75] == 0)
    _check(q, k, v, fwd, causal, attn_mask=mask)


@pytest.mark.parametrize("config", list(_params(["bf16-d64-700x646-gqa", "f16-d128-400x778",
                                                 "bf16-d128-1024x1024-causal", "bf16-d256-400x646-causal",
                                                 "f16-d192-600x778-gqa"], CONFIGS)))
def test_cells_smaller_than_the_tile(ws_map, cp, rng, config):
    """64-blocks: each 128 x 128 tile combines four 64 x 64 cells (a tile full only where all
    four are, empty only where all four are), some of each state."""
    dtype, shape, causal = CONFIGS[config]
    b, m, n = shape[:3]
    q, k, v = _inputs(rng, dtype, shape)
    mask = _block_sparse(rng, (m, n), block=64, keep=0.5, partial=0.2)
    mask[:128, :128] = True   # a full tile of four full cells
    mask[128:256, :] = False  # a query block whose every tile is empty
    mask[128:192, 256:320] = True  # ... but for one cell: a partial tile of full and empty cells
    assert _ws_kinds(cp, mask) == {0, 1, 2}
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": cupyflash.BlockMask.from_mask(cp.asarray(mask))})
    _check(q, k, v, fwd, causal, attn_mask=mask)


@pytest.mark.parametrize("config", list(_params(["bf16-d64-700x646-gqa", "f16-d128-400x778",
                                                 "bf16-d128-600x300-causal", "f16-d256-520x520"], CONFIGS)))
def test_query_blocks_whose_every_tile_is_skipped(ws_map, cp, rng, config):
    dtype, shape, causal = CONFIGS[config]
    b, m, n = shape[:3]
    q, k, v = _inputs(rng, dtype, shape)
    mask = _block_sparse(rng, (b, 1, m, n), block=128)
    mask[:, :, :256] = False  # two whole query blocks: nothing but Q copied, out 0 and lse -inf
    mask[:, :, 300:310, :] = True  # and rows that see every key
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": cupyflash.BlockMask.from_mask(cp.asarray(mask))})
    assert np.all(fwd[0][:, :256] == 0) and np.all(fwd[1][:, :, :256] == -np.inf)
    _check(q, k, v, fwd, causal, attn_mask=mask)


def test_a_mask_with_no_key_anywhere(ws_map, cp, rng):
    dtype, shape, causal = CONFIGS["f16-d128-400x778"]
    q, k, v = _inputs(rng, dtype, shape)
    mask = np.zeros(shape[1:3], bool)
    out, lse = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": cp.asarray(mask)})
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_the_bench_pattern_all_visible_tiles_full(ws_map, cp, rng):
    """bench --suite bias's sparse case (a 90%-empty 128-block mask, the diagonal visible),
    small: every visited tile runs the plain step."""
    from cupyflash._bench_bias import sparse_mask

    dtype, shape = "bfloat16", (2, 1024, 1024, 4, 4, 128)
    q, k, v = _inputs(rng, dtype, shape)
    mask = sparse_mask(1024)
    assert _ws_kinds(cp, mask) == {0, 2}
    fwd = _fwd(cp, q, k, v, dtype, False, {"attn_mask": cupyflash.BlockMask.from_mask(cp.asarray(mask))})
    _check(q, k, v, fwd, False, attn_mask=mask)


def test_blockmask_reused_across_calls(ws_map, cp, rng):
    """One BlockMask for several calls: reduced once, its ws tile map kept, results equal."""
    dtype, shape, causal = CONFIGS["bf16-d64-700x646-gqa"]
    q, k, v = _inputs(rng, dtype, shape)
    mask = _block_sparse(rng, shape[1:3], block=128)
    bm = cupyflash.BlockMask.from_mask(cp.asarray(mask))
    first = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": bm})
    again = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": bm})
    assert list(bm._tiles) == [(128, 128)]  # noqa: SLF001
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    _check(q, k, v, first, causal, attn_mask=mask)


def _with_combos(table):
    """(config, combo) params: each config of ``table`` with its variant combinations."""
    for name, combos in table.items():
        for param in _params([name], CONFIGS):
            yield from (pytest.param(name, combo, marks=param.marks, id=f"{name}-{combo}") for combo in combos)


@pytest.mark.parametrize("config,combo", list(_with_combos({
    "bf16-d64-700x646-gqa": ("sinks", "alibi", "alibi+sinks"), "f16-d128-400x778": ("sinks", "alibi", "alibi+sinks"),
    "f16-d192-600x778-gqa": ("sinks", "alibi", "alibi+sinks"), "bf16-d256-400x646-causal": ("sinks",)})))
def test_block_sparse_with_other_variants(ws_map, cp, rng, combo, config):
    """The variants the ws kernel takes with the map (dispatch.FWD_WS_MAP_SPILLS: not a
    window, softcap or dropout, which stay on the cp.async kernel; at 256 not ALiBi either,
    dispatch._FWD_WS_SPILLS)."""
    dtype, shape, causal = CONFIGS[config]
    b, m, n, h = shape[:4]
    q, k, v = _inputs(rng, dtype, shape)
    mask = _block_sparse(rng, (b, 1, m, n), block=128, keep=0.5)
    others = {}
    if "sinks" in combo:
        others["sinks"] = rng.standard_normal(h).astype(np.float32)
    if "alibi" in combo:
        others["alibi_slopes"] = (0.1 * rng.random(h)).astype(np.float32)
    on_gpu = {name: cp.asarray(x) for name, x in others.items()}
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": cupyflash.BlockMask.from_mask(cp.asarray(mask))},
               **on_gpu)
    _check(q, k, v, fwd, causal, attn_mask=mask, **others)


@pytest.mark.parametrize("dtype,head_dim", [("float16", 64), pytest.param("bfloat16", 128, marks=_NO_BF16),
                                            pytest.param("bfloat16", 256, marks=_NO_BF16), ("float16", 192)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_block_sparse(ws_map, cp, rng, causal, dtype, head_dim):
    check_varlen_block_sparse(cp, rng, causal, dtype, head_dim, block=128)


def test_a_strided_mask_stays_on_the_cp_async_kernel(cp, rng, launches, monkeypatch):
    """A mask that cannot be read in pairs (a column stride of 2; an odd row stride alike) is
    not the ws kernel's."""
    pytest.importorskip("cupy")
    from cupyflash import _gpu, _launch, dispatch

    monkeypatch.setattr(dispatch, "FWD_WS_BLOCK_MAP", True)
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: 1)
    _gpu.clear_plans()
    dtype, shape, causal = CONFIGS["f16-d128-400x778"]
    q, k, v = _inputs(rng, dtype, shape)
    wide = _block_sparse(rng, (shape[1], 2 * shape[2]), block=128)
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_mask": cp.asarray(wide)[:, ::2]})
    assert WS_KERNEL not in launches and "flash_fwd_sm90_kernel" in launches
    _check(q, k, v, fwd, causal, attn_mask=wide[:, ::2])
    _gpu.clear_plans()
