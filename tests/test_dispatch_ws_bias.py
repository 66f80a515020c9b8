"""Dispatch of forwards with an additive bias (VAR_BIAS) to the warp-specialised forward
(kernels_cu/flash_fwd_ws.cu), behind dispatch.FWD_WS_BIAS (on by default): which calls
it takes, with which template arguments, and which stay on the other kernels (an fp32,
strided or masked bias, dropout, D=64, and where the kernel spills). No GPU."""

from __future__ import annotations

import pytest

from cupyflash import dispatch
from cupyflash._sources import kernels_dir

WS = "cupyflash::flash_fwd_ws_kernel"
SM90 = "cupyflash::flash_fwd_sm90_kernel"
B = dispatch.VAR_BIAS
W, SC, AL, SK = dispatch.VAR_WINDOW, dispatch.VAR_SOFTCAP, dispatch.VAR_ALIBI, dispatch.VAR_SINKS


def _plan(**kw):
    args = dict(batch=4, seqlen_q=4096, seqlen_k=4096, nheads_q=16, head_dim=128, dtype="bfloat16",
                causal=False, vec=True, num_sms=132, cc=(9, 0), variant=B | dispatch.VAR_BIAS_STAGED,
                ws=dispatch.FWD_WS_WINS, persistent="auto", ws_bias=dispatch.FWD_WS_BIAS)
    args.update(kw)
    return dispatch.select_fwd(**args)


def test_on_by_default_but_at_64_and_off_keeps_the_other_kernels():
    """On by default at 128, 192 and 256 (PERF.md v30, run 141: D=64 measured slower than the
    cp.async kernel); off (select_fwd's ws_bias False, its default) or at D=64 a bias stays
    on the cp.async wgmma kernel, staged, whatever FWD_WS says for plain calls."""
    assert dispatch.FWD_WS_BIAS == (128, 192, 256)
    for ws in (dispatch.FWD_WS_WINS, True):
        for plan in (_plan(ws=ws, ws_bias=False), _plan(ws=ws, head_dim=64)):
            assert plan.main.template == SM90 and int(plan.main.args[6]) & dispatch.VAR_BIAS_STAGED
        assert _plan(ws=ws).main.template == WS


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [128, 64, 256, 192, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_on_the_ws_kernel_at_the_plain_tile_persistent(dtype, head_dim, causal):
    """Switched on, every head_dim the kernel has takes a bias, staged bit dropped (the
    kernel reads the bias into registers), at the 128-row tile (D=64's plain 192 rows do not
    take it) and the variants' key tile, with the plain call's shared memory, persistent
    under "auto" (its tiles are of equal cost)."""
    plan = _plan(dtype=dtype, head_dim=head_dim, causal=causal, ws_bias=True)
    d = dispatch.padded_head_dim(head_dim)
    block_n, stages = dispatch.fwd_ws_tile(d, causal, B)
    assert plan.main.template == WS and plan.combine is None and plan.num_splits == 1
    assert plan.main.args == (dispatch.CTYPES[dtype], str(d), "128", str(block_n), str(stages), str(causal).lower(),
                              str(head_dim == d).lower(), str(B), "false", "true")
    assert dispatch.fwd_block_map_tile(plan) is None
    assert plan.main.smem_bytes == dispatch.fwd_ws_smem_bytes(d, block_n, stages, 128) <= 227 * 1024
    assert (block_n, stages) == dispatch.fwd_ws_tile(d, causal, dispatch.VAR_SINKS)
    if d != 64:  # (D=64's plain call takes 192 rows one block per tile: FWD_WS_D64_BLOCK_M)
        plain = _plan(dtype=dtype, head_dim=head_dim, causal=causal, variant=0, persistent=True)
        assert plan.main.grid == plain.main.grid and plan.num_m_blocks == plain.num_m_blocks


@pytest.mark.parametrize("ws_bias,takes", [(True, {64, 128, 192, 256}), ((128,), {128}), ((64, 256), {64, 256}),
                                           (dispatch.FWD_WS_BIAS, {128, 192, 256}),
                                           ((), set()), (False, set())])
def test_the_switch_picks_the_head_dims(ws_bias, takes):
    got = {d for d in (64, 128, 192, 256) if _plan(head_dim=d, ws_bias=ws_bias).main.template == WS}
    assert got == takes


@pytest.mark.parametrize("bits", [W, SC, AL, SK, SC | AL | SK, W | SC | SK])
@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_with_the_variants_it_takes(bits, head_dim):
    """The bias with a window, softcap, ALiBi or sinks (FWD_WS_VARIANTS less
    FWD_WS_BIAS_SPILLS), one block per tile where the persistent form spills or, with a
    window, does not pay (persistent_ws_pays)."""
    plan = _plan(variant=B | bits, head_dim=head_dim, causal=bool(bits & W), ws_bias=True)
    assert plan.main.template == WS and int(plan.main.args[7]) == B | bits
    walks = dispatch.uses_persistent_ws(B | bits, False, head_dim) and dispatch.persistent_ws_pays(B | bits, False)
    assert plan.main.args[9] == str(walks).lower() and (walks or bits & W or head_dim == 128)


@pytest.mark.parametrize("kw", [dict(variant=B | dispatch.VAR_BIAS_STRIDED),               # not in pairs
                                dict(variant=dispatch.VAR_BIAS_FP32),                      # fp32
                                dict(variant=dispatch.VAR_BIAS_FP32 | dispatch.VAR_BIAS_STAGED),
                                dict(variant=B | dispatch.VAR_MASK | dispatch.VAR_BLOCK_MAP),  # with a mask
                                dict(variant=B | dispatch.VAR_MASK),
                                dict(variant=B | dispatch.VAR_DROPOUT),                    # dropout
                                dict(variant=B | W | AL, head_dim=128),                    # spills at 128
                                dict(variant=B | W, head_dim=256),                         # spills at 256
                                dict(variant=B, vec=False), dict(variant=B, cc=(8, 0))])
def test_what_stays_off_the_ws_kernel(kw):
    assert _plan(ws_bias=True, **kw).main.template != WS
    assert _plan(ws_bias=True, **kw) == _plan(ws_bias=False, **kw)


def test_the_spill_rules():
    """The compile sweep's results (.ci/ws_bias_spills.py, PERF.md v30: every subset of a
    window, softcap, ALiBi and sinks with the bias at every head_dim, causal or not, packed
    or not, persistent or not, sm_90, NVRTC 13.0): 64 and 192 spill nowhere; 128 persistent
    with a window or ALiBi, and a window with ALiBi; 256 with a window, persistent with
    softcap or ALiBi."""
    spills = dispatch.fwd_ws_spills
    for d in (64, 192):
        assert not any(spills(d, B | bits, varlen, walk) for bits in range(16)
                       for varlen in (False, True) for walk in (False, True))
    assert spills(128, B | W, False, True) and not spills(128, B | W, False, False)
    assert spills(128, B | AL, False, True) and not spills(128, B | AL, True, False)
    assert spills(128, B | W | AL, False, False) and not spills(128, B | SC | SK, False, True)
    assert spills(256, B | W, False, False) and spills(256, B | W, True, False)
    assert spills(256, B | SC, False, True) and not spills(256, B | SC, False, False)
    assert spills(256, B | AL, False, True) and not spills(256, B | AL | SK, False, False)
    assert not spills(256, B | SK, False, True) and not spills(256, B, False, True)


def test_the_bias_bits_are_the_kernels():
    """FWD_WS_BIAS_VARIANTS is variant.cuh's WS_FWD_BIAS, which flash_fwd_ws.cu takes, with the
    variants it never takes beside it (FWD_WS_BIAS_SPILLS) refused by a static_assert too;
    fwd_ws_launch refuses an fp32, strided or staged bias."""
    variant = (kernels_dir() / "variant.cuh").read_text()
    assert "constexpr int WS_FWD_BIAS = VAR_BIAS;" in variant
    assert dispatch.FWD_WS_BIAS_VARIANTS == B
    assert dispatch.FWD_WS_BIAS_SPILLS == dispatch.VAR_DROPOUT | dispatch.VAR_MASK
    ws = (kernels_dir() / "flash_fwd_ws.cu").read_text()
    assert "(VARIANT & WS_FWD_BIAS) == 0 || (VARIANT & (VAR_DROPOUT | VAR_MASK)) == 0" in ws
    dispatch.fwd_ws_launch("float16", 128, False, True, variant=B)
    dispatch.fwd_ws_launch("float16", 128, True, True, variant=B | SK, persistent=True)
    for bad in (dispatch.VAR_BIAS_FP32, B | dispatch.VAR_BIAS_STRIDED, B | dispatch.VAR_BIAS_STAGED,
                B | dispatch.VAR_DROPOUT, B | dispatch.VAR_MASK | dispatch.VAR_BLOCK_MAP):
        with pytest.raises(ValueError, match="variant bits"):
            dispatch.fwd_ws_launch("float16", 128, False, True, variant=bad)
    with pytest.raises(ValueError, match="variant bits"):
        dispatch.fwd_ws_launch("float16", 128, False, True, variant=B | W, persistent=True)


def test_check_kernels_compiles_the_bias_launches():
    """check-kernels covers the bias on the ws kernel alone and with each variant it takes."""
    got = {(int(launch.args[1]), int(launch.args[7]), launch.args[9])
           for launch in dispatch.all_fwd_launches() if launch.template == WS and int(launch.args[7]) & B}
    for bits in (0, W, SC, AL, SK):
        assert (128, B | bits, "false") in got and (64, B | bits, "false") in got
    assert (128, B, "true") in got and (256, B | SK, "true") in got and (256, B | W, "false") not in got
