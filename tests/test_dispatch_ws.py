"""Dispatch of the warp-specialised TMA forward (kernels_cu/flash_fwd_ws.cu): off
unless asked for, and then only for the calls it serves."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from cupyflash import dispatch
from cupyflash._sources import kernels_dir

WS = "cupyflash::flash_fwd_ws_kernel"


def _plan(**kw):
    args = dict(batch=1, seqlen_q=16384, seqlen_k=16384, nheads_q=16, head_dim=128, dtype="bfloat16",
                causal=False, vec=True, num_sms=132, cc=(9, 0))
    args.update(kw)
    return dispatch.select_fwd(**args)


def test_on_where_it_wins_by_default_and_switched_by_the_environment():
    env = os.environ.get("CUPYFLASH_FWD_WS", "")
    assert dispatch.FWD_WS == {"0": False, "all": True}.get(env, dispatch.FWD_WS_WINS)
    assert _plan(ws=False).main.template == "cupyflash::flash_fwd_sm90_kernel"
    assert _plan(ws=False).tma_box_rows is None


ALL = (64, 128, 192, 256)


@pytest.mark.parametrize("env,wins", [("", ALL), ("0", ()), ("1", ALL), ("all", ALL)])
def test_the_environment_picks_the_head_dims(env, wins):
    """By default (and CUPYFLASH_FWD_WS=1): the head_dims where the kernel wins (D=64 and
    128 since run 121, 192 and 256 since run 128); =0: none; =all: every one it has."""
    import subprocess
    import sys

    code = ("from cupyflash import dispatch as d; print([h for h in (64, 128, 192, 256) if d.select_fwd("
            "batch=1, seqlen_q=16384, seqlen_k=16384, nheads_q=16, head_dim=h, dtype='bfloat16', causal=False,"
            " vec=True, ws=d.FWD_WS).main.template.endswith('ws_kernel')])")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CUPYFLASH_FWD_WS": env},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(list(wins))


@pytest.mark.parametrize("ws,takes", [((128,), {128}), ((64,), {64}), ((256,), {256}), ((), set()),
                                      (False, set()), (True, set(ALL))])
def test_ws_head_dims(ws, takes):
    got = {d for d in (*ALL, 96) if _plan(head_dim=d, ws=ws).main.template == WS}
    assert got == takes
    assert dispatch.FWD_WS_WINS == ALL


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [128, 64, 100, 40])
@pytest.mark.parametrize("causal", [False, True])
def test_ws_serves_plain_dense_aligned_hopper_calls(dtype, head_dim, causal):
    """D=128 at 128 query rows, D=64 at 192 (FWD_WS_D64_BLOCK_M), one block per tile."""
    plan = _plan(dtype=dtype, head_dim=head_dim, causal=causal, ws=True)
    d = dispatch.padded_head_dim(head_dim)
    rows = {64: 192, 128: 128}[d]
    assert dispatch.fwd_ws_block_m(d, 0) == rows
    block_n, stages = dispatch.fwd_ws_tile(d, causal)
    assert plan.main.template == WS and plan.combine is None and plan.num_splits == 1
    assert plan.main.args == (dispatch.CTYPES[dtype], str(d), str(rows), str(block_n), str(stages),
                              str(causal).lower(), str(head_dim == d).lower(), "0", "false", "false")
    assert plan.main.block == (128 * (1 + rows // 64), 1, 1)
    m_blocks = -(-16384 // rows)
    assert plan.main.grid == (m_blocks * 16, 1, 1) and plan.num_m_blocks == m_blocks
    assert plan.n_blocks_per_split == -(-16384 // block_n)
    assert plan.tma_box_rows == (rows, block_n)
    assert plan.main.smem_bytes == dispatch.fwd_ws_smem_bytes(d, block_n, stages, rows) <= 227 * 1024


_WS_BITS = (dispatch.VAR_WINDOW, dispatch.VAR_SOFTCAP, dispatch.VAR_ALIBI, dispatch.VAR_SINKS, dispatch.VAR_DROPOUT)


@pytest.mark.parametrize("variant", [*_WS_BITS, dispatch.VAR_SOFTCAP | dispatch.VAR_ALIBI,
                                     dispatch.VAR_WINDOW | dispatch.VAR_SINKS, dispatch.FWD_WS_VARIANTS])
@pytest.mark.parametrize("causal", [False, True])
def test_ws_takes_the_score_and_softmax_variants(variant, causal):
    """softcap, ALiBi, a window, sinks and dropout, alone or together, take the plain
    call's kernel and tile, compiled with their bits."""
    plain = _plan(ws=True, causal=causal)
    plan = _plan(ws=True, causal=causal, variant=variant)
    assert plan.main.template == WS and plan.main.args == (*plain.main.args[:-3], str(variant), "false", "false")
    assert dataclasses.replace(plan, main=plain.main) == plain  # grid, smem, boxes: the plain call's
    assert dispatch.uses_ws_fwd(128, True, (9, 0), variant)


def test_ws_variants_are_the_kernels():
    """FWD_WS_VARIANTS is variant.cuh's WS_VARIANTS, and every bit of it is one the
    kernel's own static_assert lets through."""
    text = (kernels_dir() / "variant.cuh").read_text()
    assert "constexpr int WS_VARIANTS = VAR_WINDOW | VAR_SOFTCAP | VAR_ALIBI | VAR_SINKS | VAR_DROPOUT;" in text
    assert dispatch.FWD_WS_VARIANTS == sum(_WS_BITS)
    with pytest.raises(ValueError, match="variant bits"):
        dispatch.fwd_ws_launch("float16", 128, False, True, variant=dispatch.VAR_MASK)


@pytest.mark.parametrize("kw", [dict(cc=(8, 0)), dict(vec=False),
                                dict(variant=dispatch.VAR_BIAS | dispatch.VAR_BIAS_STAGED),
                                dict(variant=dispatch.VAR_MASK | dispatch.VAR_BLOCK_MAP),
                                dict(variant=dispatch.VAR_SOFTCAP | dispatch.VAR_BIAS),
                                dict(variant=dispatch.VAR_WINDOW | dispatch.VAR_MASK),
                                dict(variant=dispatch.VAR_SOFTCAP | dispatch.VAR_BIAS, varlen=True),
                                dict(varlen=True, vec=False), dict(varlen=True, head_dim=256, vec=False),
                                dict(head_dim=256, variant=dispatch.VAR_WINDOW | dispatch.VAR_DROPOUT),
                                dict(head_dim=256, variant=dispatch.VAR_WINDOW, varlen=True),
                                dict(head_dim=32), dict(head_dim=96)])
def test_ws_leaves_the_rest_to_the_other_kernels(kw):
    assert _plan(ws=True, **kw).main.template != WS
    assert _plan(ws=True, **kw) == _plan(**kw)


@pytest.mark.parametrize("variant", [0, *_WS_BITS, dispatch.FWD_WS_VARIANTS])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [128, 64, 104])
def test_ws_serves_packed_batches_with_the_dense_instantiations(variant, causal, head_dim):
    """A packed (varlen) batch takes the dense call's kernel, template arguments and tile
    (the kernel branches on cu_seqlens at run time), its grid over the longest sequence."""
    kw = dict(batch=5, seqlen_q=3000, seqlen_k=700, head_dim=head_dim, causal=causal, variant=variant, ws=True)
    dense, packed = _plan(**kw), _plan(**kw, varlen=True)
    assert packed.main.template == WS and packed.main.args == (*dense.main.args[:-2], "true", "false")
    assert dataclasses.replace(packed, main=dense.main) == dense
    assert dataclasses.replace(packed.main, args=dense.main.args) == dense.main
    d = dispatch.padded_head_dim(head_dim)
    rows = dispatch.fwd_ws_block_m(d, variant)
    m_blocks = -(-3000 // rows)
    assert packed.num_m_blocks == m_blocks and packed.main.grid == (m_blocks * 5 * 16, 1, 1)
    assert packed.tma_box_rows == (rows, dispatch.fwd_ws_tile(d, causal)[0])
    assert dispatch.uses_ws_fwd(d, True, (9, 0), variant)
    assert not dispatch.uses_ws_fwd(d, True, (9, 0), variant | dispatch.VAR_MASK)


def test_ws_packed_batches_are_never_split():
    """The dense decode shape leaves the ws kernel for split-KV; a packed one (never split,
    as on every kernel) stays on it."""
    kw = dict(seqlen_q=1, seqlen_k=65536, nheads_q=8, ws=True)
    assert _plan(**kw).num_splits > 1 and _plan(**kw).main.template != WS
    plan = _plan(**kw, varlen=True)
    assert plan.main.template == WS and plan.num_splits == 1 and plan.combine is None
    assert plan.main.grid == (8, 1, 1)
    assert _plan(**{**kw, "ws": False}, varlen=True).main.template == "cupyflash::flash_fwd_sm90_kernel"


def test_ws_small_grids_still_split_on_the_mma_sync_kernel():
    plan = _plan(ws=True, seqlen_q=1, seqlen_k=8192)
    assert plan.num_splits > 1 and plan.main.template == "cupyflash::flash_fwd_kernel"


def test_ws_kernels_are_checked_on_sm90_only():
    on90 = [L for L in dispatch.all_fwd_launches((9, 0)) if L.template == WS]
    assert {L.args[1] for L in on90} == {"64", "128", "192", "256"} == {str(d) for d in dispatch._FWD_WS}
    rows128 = [L for L in on90 if L.args[2] == "128"]
    plain = [L for L in rows128 if L.args[7] == "0"]
    # dtype x head_dim x causal x even_k x (dense, dense persistent, packed: never persistent)
    assert len(plain) == 2 * 4 * 2 * 2 * 3
    assert not [L for L in on90 if L.args[8] == L.args[9] == "true"]
    assert {L.args[8] for L in rows128 if L.args[7] != "0"} == {"false", "true"}
    assert {L.args[9] for L in rows128 if L.args[7] != "0"} == {"false", "true"}
    variants = {(L.args[1], L.args[5], int(L.args[7])) for L in rows128 if L.args[7] != "0"}
    assert variants == {(str(d), c, bits) for d in dispatch._FWD_WS for c in ("false", "true")
                        for bits in dispatch.FWD_WS_CHECK_VARIANTS if dispatch.uses_ws_fwd(d, True, (9, 0), bits)}
    # (all of them but, at 256, those with a window and dropout or softcap, ALiBi and dropout,
    # the map with ALiBi, or a bias with a window: _FWD_WS_SPILLS)
    left_out = {bits for bits in dispatch.FWD_WS_CHECK_VARIANTS if ("256", "true", bits) not in variants}
    W, SC, AL, DR = dispatch.VAR_WINDOW, dispatch.VAR_SOFTCAP, dispatch.VAR_ALIBI, dispatch.VAR_DROPOUT
    pairs = (W | DR, dispatch.VAR_BLOCK_MAP | AL, W | SC, AL | DR, dispatch.VAR_BIAS | W)
    assert left_out == {b for b in dispatch.FWD_WS_CHECK_VARIANTS if any(b & p == p for p in pairs)}
    assert left_out and all(("192", "true", b) in variants for b in dispatch.FWD_WS_CHECK_VARIANTS)
    # the 192-row tile (D=64, one block per tile): plain in every dtype, EVEN_K and VARLEN;
    # the check variants it takes
    rows192 = [L for L in on90 if L.args[2] == "192"]
    assert {(L.args[1], L.args[9]) for L in rows192} == {("64", "false")}
    assert len([L for L in rows192 if L.args[7] == "0"]) == 2 * 2 * 2 * 2
    assert {(L.args[5], int(L.args[7])) for L in rows192 if L.args[7] != "0"} == {
        (c, bits) for c in ("false", "true") for bits in dispatch.FWD_WS_CHECK_VARIANTS
        if dispatch.fwd_ws_wide_takes(bits)}
    assert len(on90) == len(set(on90))
    # each bit alone, and all of them together
    assert set(_WS_BITS) | {dispatch.FWD_WS_VARIANTS} <= set(dispatch.FWD_WS_CHECK_VARIANTS)
    assert not [L for L in dispatch.all_fwd_launches((8, 0)) if L.template == WS]


def test_ws_smem_bytes_are_the_kernel_traits():
    """fwd_ws_smem_bytes and fwd_ws_threads are FwdWsTraits' SMEM_BYTES and NUM_THREADS (Q,
    the K/V stages, the 4 STAGES + 3 mbarriers, 1 KB of alignment; a producer and one consumer
    warpgroup per 64 rows) at every tile a plan takes: static_asserts compiled by NVRTC."""
    from test_bwd_dispatch import compile_asserts  # sibling module

    assert dispatch.fwd_ws_smem_bytes(128, 128, 2) == 2 * 128 * (128 + 4 * 128) + 88 + 1024
    assert dispatch.fwd_ws_threads(128) == 384 and dispatch.fwd_ws_threads(192) == 512
    tiles = sorted({(int(L.args[1]), int(L.args[2]), int(L.args[3]), int(L.args[4]))
                    for L in dispatch.all_fwd_launches((9, 0)) if L.template == WS})
    assert {m for _, m, _, _ in tiles} == set(dispatch.FWD_WS_BLOCK_MS)
    lines = ['#include "flash_fwd_ws.cu"']
    for d, m, n, stages in tiles:
        tr = f"cupyflash::FwdWsTraits<__half, {d}, {m}, {n}, {stages}>"
        lines += [f'static_assert({tr}::SMEM_BYTES == {dispatch.fwd_ws_smem_bytes(d, n, stages, m)}, "smem");',
                  f'static_assert({tr}::NUM_THREADS == {dispatch.fwd_ws_threads(m)}, "threads");',
                  f'static_assert({tr}::BLOCK_M == {m} && {tr}::BLOCK_N == {n}, "tile");']
    compile_asserts(lines, "fwd_ws_traits.cu")
    # the table's choices fit a block's 227 KB with the kernel's 16 bytes of static shared memory
    for d in dispatch._FWD_WS:
        for causal in (False, True):
            assert dispatch.fwd_ws_smem_bytes(d, *dispatch.fwd_ws_tile(d, causal)) + 16 <= 227 * 1024


def test_ws_tile_at_192():
    """D=192: plain attention on 112-key blocks (two stages), every variant (the map's
    included) on 64-key blocks (three), as check-kernels compiles them; both fit."""
    for causal in (False, True):
        assert dispatch.fwd_ws_tile(192, causal) == (112, 2)
        for bits in (dispatch.VAR_WINDOW, dispatch.VAR_SINKS, dispatch.FWD_WS_MAP_VARIANTS):
            assert dispatch.fwd_ws_tile(192, causal, bits) == (64, 3)
            plan = dispatch.select_fwd(batch=2, seqlen_q=2048, seqlen_k=2048, nheads_q=8, head_dim=192,
                                       dtype="bfloat16", causal=causal, vec=True, variant=bits, ws=True,
                                       ws_block_map=True)
            assert plan.main.template == WS and plan.main.args[3] == "64", plan.main
            assert dispatch.fwd_ws_smem_bytes(192, 64, 3) + 16 <= 227 * 1024
        plan = dispatch.select_fwd(batch=2, seqlen_q=2048, seqlen_k=2048, nheads_q=8, head_dim=192,
                                   dtype="bfloat16", causal=causal, vec=True, ws=True)
        assert plan.main.args[3:5] == ("112", "2") and plan.n_blocks_per_split == 19
    ws192 = {(L.args[3], L.args[7] != "0") for L in dispatch.all_fwd_launches((9, 0))
             if L.template == WS and L.args[1] == "192"}
    assert ws192 == {("112", False), ("64", True)}


def test_ws_spills_at_256():
    """At D=256 the ws forward takes no call it spills with (check-kernels, _FWD_WS_SPILLS):
    a window not packed nor persistent, dropout not persistent, neither together, no window
    with softcap, no ALiBi with dropout, no map with ALiBi; D=192 and 128 take them all."""
    W, DR, AL, MAP = dispatch.VAR_WINDOW, dispatch.VAR_DROPOUT, dispatch.VAR_ALIBI, dispatch.FWD_WS_MAP_VARIANTS
    assert dispatch.uses_ws_fwd(256, True, (9, 0), W) and not dispatch.uses_ws_fwd(256, True, (9, 0), W, varlen=True)
    assert not dispatch.uses_persistent_ws(W | dispatch.VAR_SINKS, False, 256)
    assert dispatch.uses_ws_fwd(256, True, (9, 0), DR) and not dispatch.uses_persistent_ws(DR, False, 256)
    assert dispatch.uses_persistent_ws(DR, False, 128) and dispatch.uses_persistent_ws(DR, False, 192)
    assert not dispatch.uses_ws_fwd(256, True, (9, 0), W | DR) and dispatch.uses_ws_fwd(192, True, (9, 0), W | DR)
    assert not dispatch.uses_ws_fwd(256, True, (9, 0), MAP | AL) and dispatch.uses_ws_fwd(256, True, (9, 0), MAP)
    # every other subset of the variants compiles with no spill at 256 (check-kernels, session 18)
    SC = dispatch.VAR_SOFTCAP
    assert not dispatch.uses_ws_fwd(256, True, (9, 0), W | SC) and not dispatch.uses_ws_fwd(256, True, (9, 0), AL | DR)
    assert dispatch.uses_ws_fwd(256, True, (9, 0), SC | AL | dispatch.VAR_SINKS)
    assert dispatch.uses_persistent_ws(dispatch.VAR_SOFTCAP | AL, False, 256)
    # at 128 a window with softcap (and sinks) runs one block per tile (persistent, it spills)
    assert not dispatch.uses_persistent_ws(W | dispatch.VAR_SOFTCAP, False, 128)
    assert not dispatch.uses_persistent_ws(W | dispatch.VAR_SOFTCAP | dispatch.VAR_SINKS, False, 128)
    assert dispatch.uses_persistent_ws(W | dispatch.VAR_SOFTCAP | AL, False, 128)
    assert dispatch.uses_persistent_ws(W | dispatch.VAR_SOFTCAP, False, 64)
    # the plans: a window with dropout at 256 goes to the mma.sync kernel; packed with a window too
    for variant, varlen in ((W | DR, False), (W, True)):
        plan = dispatch.select_fwd(batch=1, seqlen_q=4096, seqlen_k=4096, nheads_q=8, head_dim=256,
                                   dtype="float16", causal=True, vec=True, variant=variant, varlen=varlen, ws=True,
                                   persistent=True)
        assert plan.main.template == "cupyflash::flash_fwd_kernel", plan.main
    plan = dispatch.select_fwd(batch=4, seqlen_q=4096, seqlen_k=4096, nheads_q=8, head_dim=256, dtype="float16",
                               causal=True, vec=True, variant=W, ws=True, persistent=True)
    assert plan.main.template == WS and plan.main.args[-1] == "false"
    with pytest.raises(ValueError, match="head_dim 256"):
        dispatch.fwd_ws_launch("float16", 256, True, True, variant=DR, persistent=True)


def test_every_gpu_test_case_plans_the_ws_kernel():
    """tests/test_gpu_fwd_ws.py's shapes, as its fixture plans them (the switch on at every
    head_dim, one SM: no split-KV), all take the warp-specialised kernel, alone."""
    import test_gpu_fwd_ws as g  # sibling module; its GPU tests skip here

    shapes = [(2 if sq * sk < 4_000_000 else 1, sq, sk, 2 * gqa, d, dtype, causal)
              for dtype, d, causal, sq, sk, gqa in g._grid()]
    shapes += [(2, 333, 517, 4, d, dtype, causal) for d in (104, 40) for dtype in ("float16", "bfloat16")
               for causal in (False, True)]
    shapes += [(2, sq, sk, 4, d, dtype, causal) for sq, sk in g.WIDE_SEQLENS for d in (256, 192, 200, 136)
               for dtype in ("float16", "bfloat16") for causal in (False, True)]
    shapes += [(2, 777, 777, 4, d, "float16", True) for d in (64, 128)]
    shapes += [(1, 640, 640, 4, 128, "bfloat16", False), (1, 16384, 16384, 2, 128, "bfloat16", False)]
    shapes += [(1, 400, 50, 2, d, "float16", True) for d in (64, 128)]
    for batch, sq, sk, nheads, d, dtype, causal in shapes:
        plan = dispatch.select_fwd(batch=batch, seqlen_q=sq, seqlen_k=sk, nheads_q=nheads, head_dim=d,
                                   dtype=dtype, causal=causal, vec=d % 8 == 0, num_sms=1, cc=(9, 0), ws=True)
        assert plan.main.template == WS and plan.combine is None, (batch, sq, sk, nheads, d)


def test_every_gpu_variant_case_plans_the_ws_kernel():
    """... and its variant cases, with the variant bits their options give (_variant.bits)."""
    import numpy as np
    import test_gpu_fwd_ws as g

    from cupyflash import _variant

    rng = np.random.default_rng(0)
    configs = [g.VARIANT_CONFIGS[c][1:] for c in g.VARIANT_CONFIGS]  # (shape, causal)
    cases = [(shape, causal, make(rng, shape)) for shape, causal in configs for make, _ in g.VARIANTS_ALONE.values()]
    cases += [(shape, causal if forced is None else forced, make(rng, shape))
              for shape, causal in configs for forced, make in g.VARIANT_COMBOS.values()]
    cases += [(shape, causal, make(rng)) for shape, causal, make, _ in g.WS_EMPTY_ROWS.values()]
    cases += [((1, 16384, 16384, 2, 2, 128), causal, g.long_variants(rng, window)) for causal, window in g.LONG_WINDOWS]
    for shape, causal, variants in cases:
        batch, sq, sk, nheads, _, d = shape
        bits = _variant.bits(variants)
        assert bits and not bits & ~dispatch.FWD_WS_VARIANTS
        if dispatch.fwd_ws_spills(d, bits, False, False):  # (VARIANTS_ALONE never; COMBO_CASES leaves them out)
            assert d == 256 and set(variants) >= {"window_size", "dropout_p"}
            continue
        plan = dispatch.select_fwd(batch=batch, seqlen_q=sq, seqlen_k=sk, nheads_q=nheads, head_dim=d,
                                   dtype="float16", causal=causal, vec=True, num_sms=1, cc=(9, 0), variant=bits,
                                   ws=True)
        assert plan.main.template == WS and plan.main.args[7] == str(bits), (shape, sorted(variants))


def test_every_gpu_varlen_case_plans_the_ws_kernel(monkeypatch):
    """tests/test_gpu_varlen_ws.py's packed batches (the switch on at every head_dim, and, as
    its fixture sets) all take the warp-specialised kernel, alone,
    with the variant bits their options give."""
    import numpy as np
    import test_gpu_varlen_ws as g

    from cupyflash import _variant

    rng = np.random.default_rng(0)
    cases = [(p.values[0], p.values[1], p.values[2], p.values[3], p.values[4], 2 * p.values[5], 0)
             for p in g._cases()]
    lens_q, lens_k = g.LAYOUTS["ragged"]
    cases += [(lens_q, lens_k, 128, "float16", causal, 8, _variant.bits(make(rng, len(lens_q), 8)))
              for causal, make in g.VARLEN_VARIANTS.values()]
    for lens_q, lens_k, d, dtype, causal, nheads, bits in cases:
        plan = dispatch.select_fwd(batch=len(lens_q), seqlen_q=max(lens_q), seqlen_k=max(lens_k), nheads_q=nheads,
                                   head_dim=d, dtype=dtype, causal=causal, vec=True, cc=(9, 0), varlen=True,
                                   variant=bits, ws=True)
        assert plan.main.template == WS and plan.combine is None and plan.main.args[7:] == (str(bits), "true", "false")


# ----------------------------------------------------------------------------
# The persistent ws forward (dispatch.FWD_WS_PERSISTENT, kernels_cu/tile_scheduler.cuh)
# ----------------------------------------------------------------------------


def test_persistent_where_it_pays_by_default():
    """"auto" (the default): persistent for dense calls without a window, one block per
    tile for a window and for packed batches (persistent_ws_pays); True forces it where
    the kernel takes the variant, False never."""
    assert dispatch.FWD_WS_PERSISTENT == "auto"
    assert _plan(ws=False, persistent="auto").main.template == "cupyflash::flash_fwd_sm90_kernel"
    plan = _plan(ws=True)
    assert plan.main.args[-1] == "false" and plan.main.grid == (128 * 16, 1, 1)
    for causal in (False, True):
        plan = _plan(ws=True, causal=causal, persistent="auto")
        assert plan.main.args[-1] == "true" and plan.main.grid == (132, 1, 1)
        window = _plan(ws=True, causal=causal, persistent="auto", variant=dispatch.VAR_WINDOW)
        assert window.main.args[-1] == "false" and window.main.grid == (128 * 16, 1, 1)
        assert _plan(ws=True, causal=causal, persistent=True, variant=dispatch.VAR_WINDOW).main.args[-1] == "true"
        packed = _plan(ws=True, causal=causal, persistent="auto", varlen=True, batch=4)
        assert packed.main.args[-1] == "false" and packed.main.grid == (128 * 4 * 16, 1, 1)
        assert _plan(ws=True, causal=causal, persistent=False).main.args[-1] == "false"
    assert dispatch.persistent_ws_pays(dispatch.VAR_SOFTCAP | dispatch.VAR_SINKS, False)
    assert not dispatch.persistent_ws_pays(dispatch.VAR_WINDOW, False)
    assert not dispatch.persistent_ws_pays(0, True)


@pytest.mark.parametrize("m_blocks,heads,num_sms,grid,causal_grid", [
    (1, 1, 132, 1, 1), (131, 1, 132, 131, 66), (132, 1, 132, 132, 66), (133, 1, 132, 132, 67),
    (4, 512, 132, 132, 132), (128, 16, 132, 132, 132), (5, 1, 1, 1, 1), (100, 1, 7, 7, 7), (3, 2, 132, 6, 4)])
def test_fwd_ws_grid(m_blocks, heads, num_sms, grid, causal_grid):
    """Persistent: one block per SM (FWD_WS_BLOCKS_PER_SM), never more than there are
    units (tiles; causal, pairs of a head's query blocks, the middle one alone when odd);
    otherwise one block per tile."""
    assert dispatch.FWD_WS_BLOCKS_PER_SM == 1
    assert dispatch.fwd_ws_grid(m_blocks, heads, False, num_sms, True) == (grid, 1, 1)
    assert dispatch.fwd_ws_grid(m_blocks, heads, True, num_sms, True) == (causal_grid, 1, 1)
    for causal in (False, True):
        assert dispatch.fwd_ws_grid(m_blocks, heads, causal, num_sms, False) == (m_blocks * heads, 1, 1)


@pytest.mark.parametrize("variant", [0, dispatch.VAR_WINDOW, dispatch.VAR_DROPOUT,
                                     dispatch.FWD_WS_VARIANTS & ~(dispatch.VAR_DROPOUT | dispatch.VAR_SOFTCAP)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,seqlen", [(32, 512), (1, 16384), (1, 100)])
def test_persistent_plan(variant, causal, batch, seqlen):
    """The persistent plan is the non-persistent one but for the kernel's last template
    argument and the grid (fwd_ws_grid over the same tiles, from num_sms)."""
    kw = dict(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, causal=causal, variant=variant, ws=True, num_sms=132)
    grid_plan, persistent = _plan(**kw), _plan(**kw, persistent=True)
    assert grid_plan.main.template == persistent.main.template == WS
    assert persistent.main.args == (*grid_plan.main.args[:-1], "true") and grid_plan.main.args[-1] == "false"
    tiles = -(-seqlen // 128) * batch * 16
    assert grid_plan.main.grid == (tiles, 1, 1)
    units = (-(-seqlen // 128) + 1) // 2 * batch * 16 if causal else tiles  # causal: pairs, an odd one alone
    assert persistent.main.grid == dispatch.fwd_ws_grid(-(-seqlen // 128), batch * 16, causal, 132, True)
    assert persistent.main.grid == (min(units, 132), 1, 1)
    assert dataclasses.replace(persistent.main, args=grid_plan.main.args, grid=grid_plan.main.grid) == grid_plan.main
    assert dataclasses.replace(persistent, main=grid_plan.main) == grid_plan


@pytest.mark.parametrize("variant", [dispatch.VAR_WINDOW | dispatch.VAR_DROPOUT, dispatch.FWD_WS_VARIANTS])
def test_persistent_not_with_a_window_and_dropout(variant):
    """A window with dropout (FWD_WS_NOT_PERSISTENT: spills when persistent) runs one block
    per tile with the switch on; check-kernels lists no such persistent kernel."""
    assert not dispatch.uses_persistent_ws(variant)
    assert _plan(ws=True, variant=variant, persistent=True) == _plan(ws=True, variant=variant)
    assert not [L for L in dispatch.all_fwd_launches((9, 0)) if L.template == WS and L.args[-1] == "true"
                and not dispatch.uses_persistent_ws(int(L.args[7]))]
    text = (kernels_dir() / "flash_fwd_ws.cu").read_text()
    assert "static_assert(!PERSISTENT || (VARIANT & (VAR_WINDOW | VAR_DROPOUT)) != (VAR_WINDOW | VAR_DROPOUT)," in text
    assert dispatch.FWD_WS_NOT_PERSISTENT == dispatch.VAR_WINDOW | dispatch.VAR_DROPOUT


@pytest.mark.parametrize("variant", [0, dispatch.VAR_SOFTCAP, dispatch.VAR_WINDOW])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_not_for_packed_batches(variant, causal):
    """A packed batch runs one block per tile whatever the switch says (uses_persistent_ws:
    its producer zeroes each sequence's last V rows, which spills next to the walk), and the
    kernel static_asserts it."""
    assert dispatch.uses_persistent_ws(variant)
    assert not dispatch.uses_persistent_ws(variant, varlen=True)
    kw = dict(batch=4, seqlen_q=3000, seqlen_k=3000, causal=causal, variant=variant, varlen=True, ws=True)
    for persistent in (True, "auto"):
        assert _plan(**kw, persistent=persistent) == _plan(**kw, persistent=False)
    assert _plan(**kw, persistent=True).main.args[-2:] == ("true", "false")
    text = (kernels_dir() / "flash_fwd_ws.cu").read_text()
    assert 'static_assert(!PERSISTENT || !VARLEN, "flash_fwd_ws_kernel: not persistent with a packed batch");' in text


def test_persistent_leaves_the_other_kernels_alone():
    """The switch only changes the ws kernel: the cp.async and split-KV plans are as without it."""
    for kw in (dict(ws=False), dict(ws=True, head_dim=96), dict(ws=True, seqlen_q=1, seqlen_k=65536, nheads_q=8)):
        assert _plan(**kw, persistent=True) == _plan(**kw)
        assert _plan(**kw).main.template != WS


def _walk(m_blocks: int, heads: int, causal: bool, grid: int, b: int) -> list[tuple[int, int]]:
    """kernels_cu/tile_scheduler.cuh's walk of block b: (head, query block) of each tile.
    Units k grid + b, one head's adjacent; causal, unit j of a head is its query blocks
    M-1-j then j (once when they are the same)."""
    per_head = -(-m_blocks // 2) if causal else m_blocks
    tiles = []
    for unit in range(b, per_head * heads, grid):
        head, j = divmod(unit, per_head)
        tiles += [(head, m) for m in dict.fromkeys((m_blocks - 1 - j, j) if causal else (j,))]
    return tiles


def test_the_walk_is_the_kernels():
    text = (kernels_dir() / "tile_scheduler.cuh").read_text()
    assert "static constexpr int PAIR = IS_CAUSAL ? 2 : 1;" in text
    assert "const int m_block = IS_CAUSAL && !tile.second ? p.num_m_blocks - 1 - j : j;" in text
    assert "if (IS_CAUSAL && !tile.second && j != p.num_m_blocks - 1 - j) {" in text
    assert "tile.unit += gridDim.x;" in text and "tile.unit = blockIdx.x;" in text


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("m_blocks,heads,grid", [(1, 1, 1), (7, 1, 1), (7, 1, 3), (8, 12, 3), (4, 512, 132),
                                                 (128, 16, 132), (127, 16, 132), (3, 2, 6), (33, 5, 7)])
def test_the_walk_visits_every_tile_once(causal, m_blocks, heads, grid):
    grid = dispatch.fwd_ws_grid(m_blocks, heads, causal, grid, True)[0]
    seen = sorted(t for b in range(grid) for t in _walk(m_blocks, heads, causal, grid, b))
    assert seen == [(h, m) for h in range(heads) for m in range(m_blocks)]
    assert all(_walk(m_blocks, heads, causal, grid, b) for b in range(grid))  # no block idle


@pytest.mark.parametrize("seqlen", [512, 1000, 1024, 2048, 4096, 8192, 16384])
def test_causal_units_balance_the_blocks(seqlen):
    """Causal tiles weigh m_block + 1 key blocks. At 132 SMs, 16 heads and 16k tokens,
    plain round-robin over the tiles leaves the busiest block at 1.2-1.65x the mean load
    (1.65 at seqlen 512, where block b meets the same query block every round); the
    pairs keep it within the one-unit quantization (~3%)."""
    m_blocks, heads = -(-seqlen // 128), max(1, 16384 // seqlen) * 16
    mean = heads * m_blocks * (m_blocks + 1) / 2 / 132
    loads = [sum(m + 1 for _, m in _walk(m_blocks, heads, True, 132, b)) for b in range(132)]
    assert max(loads) <= 1.04 * mean
    round_robin = [sum(m_blocks - t % m_blocks for t in range(b, heads * m_blocks, 132)) for b in range(132)]
    assert max(round_robin) >= 1.05 * mean


# ----------------------------------------------------------------------------
# D=64's 192-row tile (dispatch.FWD_WS_D64_BLOCK_M: three consumer warpgroups)
# ----------------------------------------------------------------------------

_WIDE_TAKES = (0, dispatch.VAR_SOFTCAP, dispatch.VAR_ALIBI, dispatch.VAR_SINKS, dispatch.VAR_DROPOUT,
               dispatch.VAR_ALIBI | dispatch.VAR_SINKS, dispatch.VAR_SOFTCAP | dispatch.VAR_SINKS,
               dispatch.VAR_SOFTCAP | dispatch.VAR_DROPOUT, dispatch.VAR_SINKS | dispatch.VAR_DROPOUT,
               dispatch.VAR_SOFTCAP | dispatch.VAR_SINKS | dispatch.VAR_DROPOUT)
_WIDE_REFUSES = (dispatch.VAR_WINDOW, dispatch.VAR_SOFTCAP | dispatch.VAR_ALIBI, dispatch.VAR_ALIBI | dispatch.VAR_DROPOUT,
                 dispatch.VAR_WINDOW | dispatch.VAR_SINKS, dispatch.FWD_WS_VARIANTS,
                 dispatch.VAR_MASK | dispatch.VAR_BLOCK_MAP)


def test_d64_takes_192_rows_where_it_pays_by_default():
    """By default D=64 runs 192 rows (one block per tile) for plain attention, ALiBi and
    sinks; softcap and dropout, which measured slower there (FWD_WS_WIDE_LOSES, run 121),
    keep 128 rows and the persistent walk."""
    assert dispatch.FWD_WS_D64_BLOCK_M == 192 and dispatch.FWD_WS_BLOCK_MS == (128, 192)
    assert dispatch.FWD_WS_WIDE_LOSES == dispatch.VAR_SOFTCAP | dispatch.VAR_DROPOUT
    for variant in (0, dispatch.VAR_ALIBI, dispatch.VAR_SINKS, dispatch.VAR_ALIBI | dispatch.VAR_SINKS):
        plan = _plan(head_dim=64, ws=dispatch.FWD_WS_WINS, variant=variant, persistent="auto")
        assert plan.main.args[2] == "192" and plan.main.args[-1] == "false", variant
        assert plan.main.block == (512, 1, 1) and plan.tma_box_rows[0] == 192
    for variant in (dispatch.VAR_SOFTCAP, dispatch.VAR_DROPOUT, dispatch.VAR_SINKS | dispatch.VAR_DROPOUT):
        plan = _plan(head_dim=64, ws=dispatch.FWD_WS_WINS, variant=variant, persistent="auto")
        assert plan.main.args[2] == "128" and plan.main.args[-1] == "true", variant
        assert dispatch.fwd_ws_block_m(64, variant, False, 192) == 192  # the tile takes it, if asked
    plan = _plan(head_dim=64, ws=True, persistent=False, variant=dispatch.VAR_SOFTCAP)
    assert plan.main.args[2] == "128" and plan.main.block == (384, 1, 1) and plan.tma_box_rows[0] == 128


@pytest.mark.parametrize("seqlen_q,rows", [(1024, 128), (2047, 128), (2048, 192), (4096, 192)])
def test_d64_192_rows_from_2048_queries(seqlen_q, rows):
    """Short queries keep 128 rows (FWD_WS_D64_WIDE_MIN_SEQLEN: 192 measured slower at 1024);
    a packed batch decides on its longest sequence."""
    assert dispatch.FWD_WS_D64_WIDE_MIN_SEQLEN == 2048
    for varlen in (False, True):
        plan = _plan(head_dim=64, ws=dispatch.FWD_WS_WINS, seqlen_q=seqlen_q, persistent="auto", varlen=varlen)
        assert plan.main.args[2] == str(rows) and plan.tma_box_rows[0] == rows
        assert plan.num_m_blocks == -(-seqlen_q // rows)


def test_d64_128_rows_when_switched(monkeypatch):
    monkeypatch.setattr(dispatch, "FWD_WS_D64_BLOCK_M", 128)
    plan = _plan(head_dim=64, ws=True, persistent=False)
    assert plan.main.args[2] == "128" and plan.main.block == (384, 1, 1) and plan.tma_box_rows[0] == 128


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", _WIDE_TAKES)
@pytest.mark.parametrize("persistent", [False, True, "auto"])
def test_d64_192_rows(monkeypatch, causal, variant, persistent):
    """FWD_WS_D64_BLOCK_M = 192: a D=64 call whose variant the tile takes runs 192 query rows
    per tile, one block per tile whatever the persistent switch says (512 threads, Q's TMA
    box and the grid at 192 rows, its shared memory); D=128 keeps 128."""
    monkeypatch.setattr(dispatch, "FWD_WS_D64_BLOCK_M", 192)
    monkeypatch.setattr(dispatch, "FWD_WS_WIDE_LOSES", 0)  # every variant the tile takes
    plan = _plan(head_dim=64, ws=True, causal=causal, variant=variant, persistent=persistent)
    block_n, stages = dispatch.fwd_ws_tile(64, causal)
    assert plan.main.template == WS and plan.main.args[1:5] == ("64", "192", str(block_n), str(stages))
    assert plan.main.args[7:] == (str(variant), "false", "false")
    assert plan.main.block == (512, 1, 1) and plan.tma_box_rows == (192, block_n)
    assert plan.num_m_blocks == -(-16384 // 192) and plan.main.grid == (plan.num_m_blocks * 16, 1, 1)
    assert plan.main.smem_bytes == dispatch.fwd_ws_smem_bytes(64, block_n, stages, 192) <= 227 * 1024
    assert _plan(head_dim=128, ws=True, causal=causal, variant=variant).main.args[2] == "128"


@pytest.mark.parametrize("variant", _WIDE_REFUSES)
def test_d64_192_rows_not_for_the_sets_that_spill(monkeypatch, variant):
    """A window, a map, ALiBi with softcap or with dropout keep 128 rows (they spill at 160
    registers: FWD_WS_WIDE_SPILLS), and fwd_ws_launch refuses them 192, as it refuses 192 at
    D=128, persistent, or a tile size the kernel does not have."""
    monkeypatch.setattr(dispatch, "FWD_WS_D64_BLOCK_M", 192)
    assert not dispatch.fwd_ws_wide_takes(variant)
    plan = _plan(head_dim=64, ws=True, ws_block_map=True, variant=variant, persistent=False)
    assert plan.main.template == WS and plan.main.args[2] == "128"
    with pytest.raises(ValueError, match="query rows per tile"):
        dispatch.fwd_ws_launch("float16", 64, False, True, variant=dispatch.ws_fwd_variant(variant), block_m=192)
    for kw in (dict(head_dim_padded=128), dict(persistent=True), dict(block_m=256)):
        args = dict(dtype="float16", head_dim_padded=64, causal=False, even_k=True, block_m=192) | kw
        with pytest.raises(ValueError, match="query rows per tile"):
            dispatch.fwd_ws_launch(**args)


def test_d64_192_rows_spill_facts():
    assert dispatch.FWD_WS_WIDE_VARIANTS == (dispatch.VAR_SOFTCAP | dispatch.VAR_ALIBI | dispatch.VAR_SINKS
                                             | dispatch.VAR_DROPOUT)
    taken = {b for b in range(32) if dispatch.fwd_ws_wide_takes(b)}
    assert taken == set(_WIDE_TAKES) | {dispatch.VAR_ALIBI | dispatch.VAR_SINKS}


@pytest.mark.parametrize("causal,variant", [(False, 0), (True, 0), (True, dispatch.VAR_SOFTCAP),
                                            (False, dispatch.VAR_SINKS | dispatch.VAR_DROPOUT)])
def test_d64_192_rows_compile_without_spills(causal, variant):
    from test_bwd_dispatch import _compile_clean  # sibling module

    _compile_clean(dispatch.fwd_ws_launch("bfloat16", 64, causal, True, variant=variant, block_m=192), (9, 0))
