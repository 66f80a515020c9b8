"""Dispatch of block-sparse forwards (a bool mask with its tile map: VAR_MASK |
VAR_BLOCK_MAP) to the warp-specialised forward (kernels_cu/flash_fwd_ws.cu), behind
dispatch.FWD_WS_BLOCK_MAP (on by default): which calls it takes, with which template
arguments, and the tile of the map they read. No GPU."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cupyflash import dispatch
from cupyflash._sources import kernels_dir

WS = "cupyflash::flash_fwd_ws_kernel"
SM90 = "cupyflash::flash_fwd_sm90_kernel"
MAP = dispatch.VAR_MASK | dispatch.VAR_BLOCK_MAP


def _plan(**kw):
    args = dict(batch=4, seqlen_q=4096, seqlen_k=4096, nheads_q=16, head_dim=128, dtype="bfloat16",
                causal=False, vec=True, num_sms=132, cc=(9, 0), variant=MAP, ws=dispatch.FWD_WS_WINS,
                persistent="auto")
    args.update(kw)
    return dispatch.select_fwd(**args)


def test_on_by_default_and_off_keeps_the_cp_async_kernel():
    """The switch is on by default at every head_dim (PERF.md v25, run 116; 192 and 256 since
    run 132); off (select_fwd's ws_block_map False) a mask with its map stays on the cp.async
    wgmma kernel, whatever FWD_WS says for the plain calls."""
    assert dispatch.FWD_WS_BLOCK_MAP is True
    for ws in (dispatch.FWD_WS_WINS, True):
        plan = _plan(ws=ws)
        assert plan.main.template == SM90 and dispatch.fwd_block_map_tile(plan) == (128, 64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [128, 64, 100, 40])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persistent", ["auto", True, False])
def test_on_the_ws_kernel_at_its_plain_tile_one_block_per_tile(monkeypatch, dtype, head_dim, causal, persistent):
    """Switched on, every head_dim the kernel has takes it, at the plain call's 128-row
    tile (D=64's plain call takes 192 rows, FWD_WS_D64_BLOCK_M, which the map does not),
    compiled with the mask's bits, never persistent; the map is read at that tile
    (128 x BLOCK_N), the TMA boxes'."""
    plan = _plan(dtype=dtype, head_dim=head_dim, causal=causal, persistent=persistent, ws_block_map=True)
    d = dispatch.padded_head_dim(head_dim)
    block_n, stages = dispatch.fwd_ws_tile(d, causal, MAP)
    assert plan.main.template == WS and plan.combine is None and plan.num_splits == 1
    assert plan.main.args == (dispatch.CTYPES[dtype], str(d), "128", str(block_n), str(stages), str(causal).lower(),
                              str(head_dim == d).lower(), str(MAP), "false", "false")
    assert plan.main.grid == (32 * 4 * 16, 1, 1) and plan.num_m_blocks == 32
    assert dispatch.fwd_block_map_tile(plan) == (dispatch.FWD_WS_BLOCK_M, block_n) == plan.tma_box_rows
    monkeypatch.setattr(dispatch, "FWD_WS_D64_BLOCK_M", 128)
    plain = _plan(dtype=dtype, head_dim=head_dim, causal=causal, variant=0, ws=True, persistent=False)
    assert dataclasses.replace(plan, main=plain.main) == plain  # grid, smem, boxes: the plain call's
    assert dataclasses.replace(plan.main, args=plain.main.args) == plain.main


@pytest.mark.parametrize("ws_block_map,takes", [(True, {64, 128, 192, 256}), ((128,), {128}), ((64,), {64}),
                                                ((192,), {192}), ((), set()), (False, set()),
                                                (dispatch.FWD_WS_BLOCK_MAP, {64, 128, 192, 256})])
def test_the_switch_picks_the_head_dims(ws_block_map, takes):
    got = {d for d in (64, 128, 192, 256) if _plan(head_dim=d, ws_block_map=ws_block_map).main.template == WS}
    assert got == takes


@pytest.mark.parametrize("bits", [dispatch.VAR_ALIBI, dispatch.VAR_SINKS, dispatch.VAR_ALIBI | dispatch.VAR_SINKS])
def test_with_the_ws_variants(bits):
    """The variants whose map kernels compile with no spill combine with the map."""
    plan = _plan(variant=MAP | bits, ws_block_map=True)
    assert plan.main.template == WS and int(plan.main.args[7]) == MAP | bits and plan.main.args[9] == "false"
    assert dispatch.fwd_block_map_tile(plan) == (128, 128)


@pytest.mark.parametrize("bits", [dispatch.VAR_WINDOW, dispatch.VAR_SOFTCAP, dispatch.VAR_DROPOUT,
                                  dispatch.VAR_WINDOW | dispatch.VAR_SINKS, dispatch.VAR_ALIBI | dispatch.VAR_DROPOUT])
def test_the_variants_that_spill_with_the_map_stay_on_the_cp_async_kernel(bits):
    assert dispatch.FWD_WS_MAP_SPILLS == dispatch.VAR_WINDOW | dispatch.VAR_SOFTCAP | dispatch.VAR_DROPOUT
    plan = _plan(variant=MAP | bits, ws_block_map=True)
    assert plan.main.template == SM90 and plan == _plan(variant=MAP | bits)
    assert _plan(variant=bits, ws=True).main.template == WS  # without the map, the ws kernel's


def test_the_staged_bit_is_dropped():
    """A mask whose rows could be staged (VAR_BIAS_STAGED, the cp.async kernel's) is read
    into registers by the ws kernel: the same instantiation as without the bit."""
    staged = _plan(variant=MAP | dispatch.VAR_BIAS_STAGED, ws_block_map=True)
    assert staged == _plan(ws_block_map=True)
    assert dispatch.ws_fwd_variant(MAP | dispatch.VAR_BIAS_STAGED) == MAP
    assert dispatch.ws_fwd_variant(dispatch.VAR_WINDOW | dispatch.VAR_BIAS_STAGED) == (
        dispatch.VAR_WINDOW | dispatch.VAR_BIAS_STAGED)  # (only with the map)


@pytest.mark.parametrize("kw", [dict(variant=MAP | dispatch.VAR_BIAS_STRIDED),          # not in pairs
                                dict(variant=MAP | dispatch.VAR_BIAS),                  # a bias
                                dict(variant=MAP | dispatch.VAR_BIAS_FP32 | dispatch.VAR_BIAS_STAGED),
                                dict(variant=dispatch.VAR_MASK),                        # a mask without its map
                                dict(head_dim=96), dict(head_dim=32), dict(vec=False), dict(cc=(8, 0)),
                                dict(head_dim=256, variant=MAP | dispatch.VAR_ALIBI)])  # (spills: _FWD_WS_SPILLS)
def test_the_rest_stays_where_it_was(kw):
    assert _plan(ws_block_map=True, **kw).main.template != WS
    assert _plan(ws_block_map=True, **kw) == _plan(**kw)


def test_packed_batches_take_the_map_too():
    dense = _plan(batch=5, seqlen_q=3000, seqlen_k=700, ws_block_map=True)
    packed = _plan(batch=5, seqlen_q=3000, seqlen_k=700, ws_block_map=True, varlen=True)
    assert packed.main.template == WS and packed.main.args == (*dense.main.args[:-2], "true", "false")
    assert dispatch.fwd_block_map_tile(packed) == (128, 128)


def test_small_grids_still_split_on_the_mma_sync_kernel():
    """Split over keys (a grid under a wave), as every ws call: the mma.sync kernel, no map."""
    plan = _plan(batch=1, seqlen_q=128, seqlen_k=16384, nheads_q=4, ws_block_map=True)
    assert plan.num_splits > 1 and plan.main.template == "cupyflash::flash_fwd_kernel"
    assert dispatch.fwd_block_map_tile(plan) is None


def test_never_persistent():
    assert not dispatch.uses_persistent_ws(MAP) and not dispatch.uses_persistent_ws(MAP | dispatch.VAR_SOFTCAP)
    assert dispatch.uses_persistent_ws(dispatch.VAR_SOFTCAP)
    text = (kernels_dir() / "flash_fwd_ws.cu").read_text()
    assert 'static_assert(!PERSISTENT || (VARIANT & VAR_BLOCK_MAP) == 0, "flash_fwd_ws_kernel: not persistent' in text


def test_the_map_bits_are_the_kernels():
    """FWD_WS_MAP_VARIANTS is variant.cuh's WS_FWD_MAP_VARIANTS, which flash_fwd_ws.cu takes
    (both bits or neither); fwd_ws_launch refuses a mask without its map."""
    variant = (kernels_dir() / "variant.cuh").read_text()
    assert "constexpr int WS_FWD_MAP_VARIANTS = VAR_MASK | VAR_BLOCK_MAP;" in variant
    assert dispatch.FWD_WS_MAP_VARIANTS == MAP
    ws = (kernels_dir() / "flash_fwd_ws.cu").read_text()
    assert "(VARIANT & ~(WS_VARIANTS | WS_FWD_MAP_VARIANTS | WS_FWD_BIAS)) == 0" in ws
    assert "(VARIANT & WS_FWD_MAP_VARIANTS) == WS_FWD_MAP_VARIANTS" in ws
    # the variants it never takes with the map: dispatch.FWD_WS_MAP_SPILLS
    assert "(VARIANT & VAR_BLOCK_MAP) == 0 || (VARIANT & (VAR_WINDOW | VAR_SOFTCAP | VAR_DROPOUT)) == 0" in ws
    dispatch.fwd_ws_launch("float16", 128, False, True, variant=MAP)
    for bad in (dispatch.VAR_MASK, dispatch.VAR_BLOCK_MAP, MAP | dispatch.VAR_BIAS_STRIDED):
        with pytest.raises(ValueError, match="variant bits"):
            dispatch.fwd_ws_launch("float16", 128, False, True, variant=bad)


def test_the_map_tile_is_the_kernels():
    """fwd_block_map_tile reads each kernel's VARIANT, BLOCK_M and BLOCK_N at their places in
    its template (flash_fwd_sm90.cu <T, HEAD_DIM, BLOCK_N, ..., VARIANT at 6>, BLOCK_M its
    traits' SM90_BLOCK_M; flash_fwd_ws.cu <T, HEAD_DIM, BLOCK_M, BLOCK_N, ..., VARIANT at 7>)."""
    assert dispatch._FWD_MAP_KERNELS == {"flash_fwd_sm90.cu": (6, None, 2), "flash_fwd_ws.cu": (7, 2, 3)}  # noqa: SLF001
    text = (kernels_dir() / "flash_fwd_sm90.cu").read_text()
    assert re.search(rf"static constexpr int BLOCK_M = {dispatch.SM90_BLOCK_M};", text)
    assert "template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, bool IS_CAUSAL" in (
        kernels_dir() / "flash_fwd_ws.cu").read_text()
    sm90 = dispatch.fwd_sm90_launch("float16", 128, False, True, variant=MAP)
    ws = dispatch.fwd_ws_launch("float16", 128, False, True, variant=MAP)
    assert sm90.args[6] == ws.args[7] == str(MAP)
    assert sm90.args[2] == "64" and ws.args[3] == "128"


def test_check_kernels_compiles_the_map_kernels():
    """check-kernels compiles the map with each ws variant, at both head_dims, causal or
    not, dense and packed, never persistent."""
    on90 = [L for L in dispatch.all_fwd_launches((9, 0)) if L.template == WS and int(L.args[7]) & MAP]
    got = {(L.args[1], L.args[5], int(L.args[7]), L.args[8], L.args[9]) for L in on90}
    bits = {b for b in dispatch.FWD_WS_CHECK_VARIANTS if b & MAP}
    with_map = (0, dispatch.VAR_ALIBI, dispatch.VAR_SINKS, dispatch.VAR_ALIBI | dispatch.VAR_SINKS)
    assert bits == {MAP | b for b in with_map}
    assert got == {(str(d), c, b, v, "false") for d in dispatch._FWD_WS for c in ("false", "true") for b in bits
                   for v in ("false", "true") if not (d == 256 and b & dispatch.VAR_ALIBI)
                   }  # (_FWD_WS_SPILLS)
    # the map alone in every dtype and EVEN_K, as the plain kernels (the variants: bf16, even)
    alone = {(L.args[0], L.args[6]) for L in on90 if int(L.args[7]) == MAP}
    assert alone == {(t, e) for t in dispatch.CTYPES.values() for e in ("true", "false")}
    assert len(on90) == len(set(on90))


@pytest.mark.parametrize("lead", [(), (1, 1), "per-batch", "per-head"])
def test_every_gpu_test_case_plans_the_ws_kernel(lead):
    """tests/test_gpu_block_sparse_ws.py's configs, as its fixture plans them (the switch on,
    one SM), with their masks' plan bits (_variant.plan_bits: an odd key length would read
    the mask element by element, VAR_BIAS_STRIDED, on the cp.async kernel), take the ws
    kernel with the map."""
    import numpy as np
    from test_block_sparse_plan import _Device  # sibling modules
    from test_gpu_block_sparse_ws import CONFIGS

    from cupyflash import _variant

    for name, (dtype, (batch, seqlen_q, seqlen_k, nheads, _nheads_kv, head_dim), causal) in CONFIGS.items():
        shape = {"per-batch": (batch, 1), "per-head": (1, nheads)}.get(lead, lead) + (seqlen_q, seqlen_k)
        host = np.zeros(shape, bool)
        mask = _Device(host[(None,) * (4 - host.ndim)], 0x10000)
        variant = _variant.plan_bits({"attn_mask": mask})
        assert variant & MAP == MAP and not variant & dispatch.VAR_BIAS_STRIDED, name
        plan = _plan(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=nheads, head_dim=head_dim,
                     dtype=dtype, causal=causal, num_sms=1, variant=variant, ws_block_map=True)
        d = dispatch.padded_head_dim(head_dim)
        tile = (128, dispatch.fwd_ws_tile(d, causal, variant & (MAP | dispatch.FWD_WS_VARIANTS))[0])
        assert plan.main.template == WS and dispatch.fwd_block_map_tile(plan) == tile, name
