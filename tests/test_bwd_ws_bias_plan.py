"""An additive bias on the warp-specialised backward's plan, without a GPU (issue 14;
kernels_cu/flash_bwd_ws.cu with WS_BWD_BIAS = VAR_BIAS | VAR_BIAS_STAGED): where it is
chosen (a staged bias of the inputs' dtype at BWD_WS_BIAS's head_dims; not an fp32 bias,
a mask, a bias read in pairs or element by element, deterministic mode, a packed batch,
the sets it spills with), its launch and shared memory (the kernel's traits, through
NVRTC), the bias's TMA map (_tma.bias_map) and the launcher that encodes it from the
call's bias pointer, and NVRTC compiles with no spill (skipped without NVRTC)."""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _params, _tma, dispatch

WS = "cupyflash::flash_bwd_ws_kernel"
BIAS = dispatch.VAR_BIAS | dispatch.VAR_BIAS_STAGED
W, SC, AL, SK, DR = (dispatch.VAR_WINDOW, dispatch.VAR_SOFTCAP, dispatch.VAR_ALIBI, dispatch.VAR_SINKS,
                     dispatch.VAR_DROPOUT)


def _plan(**kw):
    args = dict(batch=2, seqlen_q=1000, seqlen_k=1000, nheads_q=8, nheads_kv=8, head_dim=128, dtype="bfloat16",
                causal=False, deterministic=False, vec=True, cc=(9, 0), variant=BIAS, ws=True)
    args.update(kw)
    return dispatch.select_bwd(**args)


@pytest.fixture
def on_everywhere(monkeypatch):
    monkeypatch.setattr(dispatch, "BWD_WS_BIAS", (64, 128, 192, 256))


@pytest.mark.parametrize("head_dim", [64, 120, 128, 176, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dbias", [False, True])
def test_a_staged_bias_takes_it_with_dq(on_everywhere, head_dim, causal, dbias):
    """With dQ (bulk reduce-adds, or from registers by roles) at 64 query rows per step; the
    bias's stage beside each step's Q and dO; dbias, when asked, from the dbias kernel last."""
    d = dispatch.padded_head_dim(head_dim)
    shape = (1, 8, 1000, 1000)
    plan = _plan(head_dim=head_dim, causal=causal, dbias_shape=shape if dbias else None)
    names = [L.template for L in plan.launches]
    assert names[:3] == ["cupyflash::flash_bwd_preprocess_kernel", WS, "cupyflash::flash_bwd_convert_dq_kernel"]
    assert len(names) == 3 + dbias and (not dbias or "dbias" in names[-1])
    dkdv = plan.launches[1]
    assert dkdv.args == ("__nv_bfloat16", str(d), "64", str(causal).lower(), str(head_dim == d).lower(), "true",
                         str(BIAS))
    assert dkdv.smem_bytes == dispatch.bwd_ws_smem_bytes(d, 64, True, bias=True) <= 227 * 1024
    n = dispatch.bwd_ws_block_n(d)
    assert plan.tma_box_rows == (64, n, n, 64) and plan.dq_accum


def test_on_by_default_where_measured():
    assert set(dispatch.BWD_WS_BIAS) <= set(dispatch.BWD_WS_HEAD_DIMS)
    for d in (64, 128, 192, 256):
        ws = any(L.template == WS for L in _plan(head_dim=d).launches)
        assert ws == (d in dispatch.BWD_WS_BIAS), d


@pytest.mark.parametrize("change", [
    dict(variant=dispatch.VAR_BIAS),                                 # read in pairs, not staged
    dict(variant=dispatch.VAR_BIAS | dispatch.VAR_BIAS_STRIDED),    # element by element
    dict(variant=dispatch.VAR_BIAS_FP32 | dispatch.VAR_BIAS_STAGED),
    dict(variant=BIAS | dispatch.VAR_MASK),
    dict(variant=dispatch.VAR_MASK | dispatch.VAR_BIAS_STAGED),
    dict(variant=BIAS | SC | DR),                                    # spills at 128 (_BWD_WS_BIAS_SPILLS)
    dict(deterministic=True), dict(vec=False), dict(cc=(8, 0)), dict(ws=False),
    dict(varlen=True, total_q=1500, total_k=1700)],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_everything_else_keeps_the_other_kernels(on_everywhere, change):
    plan = _plan(**change)
    assert all(L.template != WS for L in plan.launches) and plan.tma_box_rows is None


def test_the_switch(monkeypatch):
    monkeypatch.setattr(dispatch, "BWD_WS_BIAS", ())
    assert all(L.template != WS for L in _plan().launches)
    monkeypatch.setattr(dispatch, "BWD_WS_BIAS", (128,))
    assert _plan().launches[1].template == WS
    assert all(L.template != WS for L in _plan(head_dim=256).launches)
    # plain attention and the variants do not depend on it
    monkeypatch.setattr(dispatch, "BWD_WS_BIAS", ())
    assert _plan(variant=0).launches[1].template == WS and _plan(variant=W).launches[1].template == WS


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_takes_the_variants_beside_the_bias_but_where_they_spill(d):
    """bwd_ws_takes: the bias bits both or none; a set of _BWD_WS_BIAS_SPILLS, or one of the
    plain sets' spills, refused, and bwd_ws_launch refuses it too."""
    assert not dispatch.bwd_ws_takes(dispatch.VAR_BIAS, d) and not dispatch.bwd_ws_takes(
        dispatch.VAR_BIAS_STAGED, d)
    for bits in (0, W, SC, AL, SK, DR, W | SK, SC | SK, AL | SK):
        spills = any(bits & s == s for s in dispatch._BWD_WS_BIAS_SPILLS[d]) or not dispatch.bwd_ws_takes(bits, d)
        assert dispatch.bwd_ws_takes(BIAS | bits, d) == (not spills), (d, bits)
        if spills:
            with pytest.raises(ValueError, match="variant bits"):
                dispatch.bwd_ws_launch("float16", d, True, True, variant=BIAS | bits)
    assert dispatch.bwd_ws_takes(BIAS, d)


def test_shared_memory():
    """Two stages of the bias tile (64 query rows by the block's keys, 2 bytes each) beside
    each head_dim's stages: D=128 and 256 fill the 227 KB a Hopper block may have."""
    for d in (64, 128, 192, 256):
        n = dispatch.bwd_ws_block_n(d)
        assert dispatch.bwd_ws_smem_bytes(d, 64, True, True) == dispatch.bwd_ws_smem_bytes(d) + 2 * 64 * n * 2
        assert dispatch.bwd_ws_smem_bytes(d, 64, True, True) <= dispatch.max_smem_per_block((9, 0))
    assert dispatch.bwd_ws_smem_bytes(128, 64, True, True) > 226 * 1024


def test_traits_are_the_kernels():
    """bwd_ws_smem_bytes with the bias is BwdWsTraits' SMEM_BYTES (BIAS true), and the bias
    tile's layout the transposed reader's: static_asserts compiled by NVRTC."""
    from test_bwd_dispatch import compile_asserts  # sibling module

    lines = ['#include "flash_bwd_ws.cu"']
    for d in (64, 128, 192, 256):
        tr = f"cupyflash::BwdWsTraits<__nv_bfloat16, {d}, 64, true, true>"
        lines += [f'static_assert({tr}::SMEM_BYTES == {dispatch.bwd_ws_smem_bytes(d, 64, True, True)}, "smem");',
                  f'static_assert({tr}::STAGE_BYTES == {2 * 64 * d * 2 + 64 * dispatch.bwd_ws_block_n(d) * 2}, '
                  f'"stage");',
                  f'static_assert({tr}::BiasTile::ELEM == 2, "elem");']
    compile_asserts(lines, "bwd_ws_bias_traits.cu")


def test_check_kernels_lists_the_bias_sets():
    ws = {L.args for L in dispatch.all_bwd_launches((9, 0)) if L.template == WS and int(L.args[-1]) & 32}
    for d in (64, 128, 192, 256):
        want = {b for b in dispatch.BWD_WS_BIAS_CHECK_VARIANTS if dispatch.bwd_ws_takes(b, d)}
        got = {int(a[-1]) for a in ws if a[1] == str(d)}
        assert got == want and BIAS in got, d
    assert len(ws) == 2 * 2 * 2 * sum(len({b for b in dispatch.BWD_WS_BIAS_CHECK_VARIANTS
                                           if dispatch.bwd_ws_takes(b, d)}) for d in (64, 128, 192, 256))


# ----------------------------------------------------------------------------
# The bias's TMA map and its launcher
# ----------------------------------------------------------------------------

# name -> (the bias's 4-D shape, its broadcast strides in elements, the map's dims innermost first)
MAPS = {
    "full": ((2, 8, 300, 520), (8 * 300 * 520, 300 * 520, 520, 1), (520, 300, 8, 2)),
    "per-head": ((1, 8, 300, 520), (0, 300 * 520, 520, 1), (520, 300, 8, 1)),
    "per-batch": ((2, 1, 300, 520), (300 * 520, 0, 520, 1), (520, 300, 1, 2)),
    "per-key": ((2, 1, 1, 520), (520, 0, 0, 1), (520, 1, 1, 2)),
    "stride-0-batch": ((2, 8, 300, 520), (0, 300 * 520, 520, 1), (520, 300, 8, 1)),
    "slice": ((2, 8, 300, 520), (8 * 303 * 536, 303 * 536, 536, 1), (520, 300, 8, 2)),
}


@pytest.mark.parametrize("name", list(MAPS))
def test_bias_map_dims_strides_and_box(name):
    """Innermost first (keys, rows, heads, batch); a broadcast dimension (stride 0) has size 1
    and the 16 bytes any size-1 dimension takes; boxes of 64 keys by the step's rows."""
    shape, strides, dims = MAPS[name]
    m = _tma.bias_map("bfloat16", shape, strides, 2, 64)
    assert m.dims == dims and m.box == (64, 64, 1, 1) and m.data_type == 9
    want = tuple(s * 2 if size > 1 else 16 for s, size in zip(strides[2::-1], dims[1:]))
    assert m.strides == want


def test_bias_map_refuses_what_the_copy_engine_cannot_read():
    with pytest.raises(ValueError, match="unit column stride"):
        _tma.bias_map("float16", (1, 1, 64, 64), (0, 0, 1, 0), 2, 64)
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        _tma.bias_map("float16", (1, 1, 64, 63), (0, 0, 63, 1), 2, 64)


def test_launcher_writes_the_bias_map_from_the_call_values():
    """(offset, make, indices, var_indices): the maps of q, k, v, dout, then of the bias's
    pointer (VariantParams' attn_bias among the call values), at bias_map."""
    from cupyflash import _gpu_bwd
    from test_params import _recording_launcher  # sibling module

    from test_bwd_ws_plan import bwd_tma_template  # sibling module

    mirror = _params.BWD_TMA_PARAMS
    template, maps = bwd_tma_template()

    assert _params.VARIANT_PER_CALL[_gpu_bwd._BIAS_MAP_VAR] == "attn_bias"
    launcher, seen = _recording_launcher(template, (_params.offset_of(mirror, "q_map"), maps, _gpu_bwd._MAP_POINTERS,
                                                    (_gpu_bwd._BIAS_MAP_VAR,)), _gpu_bwd._BWD_WRITER)
    launcher._var_offset = _gpu_bwd._VAR_WRITER[0]  # (the helper's is the forward's)
    pointers = tuple(range(101, 101 + len(_gpu_bwd.BWD_POINTERS)))
    var = (11, 12, 13, 77, 15, 16, 17, 18, 5, 9)
    launcher(0, *pointers, var=var)
    (got,) = (np.frombuffer(b, dtype=mirror)[0] for b in seen)
    assert [bytes(got[n])[0] for n in ("q_map", "k_map", "v_map", "do_map", "bias_map")] == [101, 102, 103, 105, 77]
    assert got["bwd"]["var"]["attn_bias"] == 77


# ----------------------------------------------------------------------------
# NVRTC: no spill
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("d,variant", [(128, BIAS), (128, BIAS | W | SK), (64, BIAS | DR), (256, BIAS | AL),
                                       (192, BIAS | SC)])
@pytest.mark.parametrize("causal,even_k", [(True, True), (False, False)])
def test_compiles_without_spills(d, variant, causal, even_k):
    from test_bwd_dispatch import _compile_clean  # sibling module

    _compile_clean(dispatch.bwd_ws_launch("bfloat16", d, causal, even_k, variant=variant), (9, 0))


# ----------------------------------------------------------------------------
# plan_bwd: the maps it hands the launcher (fake arrays, no GPU)
# ----------------------------------------------------------------------------


class _FakeBias:
    """A 4-D fp16 bias's geometry (strides in bytes), at an aligned address."""

    class _Data:
        ptr = 0

    def __init__(self, shape, strides):
        self.shape, self.ndim, self.strides = tuple(shape), len(shape), tuple(2 * s for s in strides)
        self.itemsize, self.dtype, self.data = 2, np.dtype(np.float16), self._Data


def _plan_bwd(monkeypatch, bias):
    """plan_bwd of a (2, 1000, 8, 128) fp16 call with ``bias`` on a faked cc 9.0 device; returns
    the plan and the ``maps`` argument its Launcher was made with."""
    from cupyflash import _gpu_bwd, _launch

    monkeypatch.setattr(_launch, "num_sms", lambda device_id: 132)
    monkeypatch.setattr(_launch, "compute_capability", lambda device_id: (9, 0))
    monkeypatch.setattr(dispatch, "BWD_WS", True)
    monkeypatch.setattr(dispatch, "BWD_WS_BIAS", (128,))
    made = {}

    class FakeLauncher:
        def __init__(self, launches, template, writer, variant=None, maps=None):
            made["maps"] = maps

    monkeypatch.setattr(_launch, "Launcher", FakeLauncher)
    q = _launch.Contiguous((2, 1000, 8, 128), 2)
    lse = _launch.Contiguous((2, 8, 1000), 4)
    call = _gpu_bwd.plan_bwd(q, q, q, q, q, lse, None, None, None, softmax_scale=0.1, causal=False,
                             deterministic=False, dtype_name="float16", device_id=0, options={"attn_bias": bias})
    return call.plan, made["maps"]


def test_plan_bwd_appends_the_bias_map(monkeypatch):
    from cupyflash import _gpu_bwd

    bias = _FakeBias((1, 8, 1000, 1000), (8 * 10**6, 10**6, 1000, 1))
    plan, maps = _plan_bwd(monkeypatch, bias)
    assert plan.launches[1].template == WS and int(plan.launches[1].args[-1]) == BIAS
    offset, cache, pointers, var_indices = maps
    assert offset == _params.offset_of(_params.BWD_TMA_PARAMS, "q_map") and pointers == _gpu_bwd._MAP_POINTERS
    assert var_indices == (_gpu_bwd._BIAS_MAP_VAR,) and len(cache.maps) == 5
    assert cache.maps[4] == _tma.bias_map("float16", bias.shape, (0, 10**6, 1000, 1), 2, 64)
    assert cache.maps[4].dims == (1000, 1000, 8, 1)


def test_plan_bwd_keeps_a_reversed_bias_off_it(monkeypatch):
    """A reversed view (negative row stride) is staged for the cp.async kernels, but no TMA map
    describes it (_variant.bias_tma_ok): the plan keeps the other dK/dV kernels."""
    from cupyflash import _variant

    bias = _FakeBias((1, 8, 1000, 1000), (8 * 10**6, 10**6, -1000, 1))
    assert _variant.staged_bits({"attn_bias": bias}) & dispatch.VAR_BIAS_STAGED
    assert not _variant.bias_tma_ok({"attn_bias": bias})
    plan, maps = _plan_bwd(monkeypatch, bias)
    assert all(L.template != WS for L in plan.launches) and maps is None


def test_launcher_init_takes_the_var_indices():
    """Launcher.__init__ keeps maps[3] (the var values whose maps follow the pointers')."""
    pytest.importorskip("cupy")
    from cupyflash import _launch

    template = bytes(_params.BWD_TMA_PARAMS.itemsize)
    from cupyflash import _gpu_bwd

    with_bias = _launch.Launcher((), template, _gpu_bwd._BWD_WRITER, maps=(64, None, (0, 1, 2, 4), (3,)))
    without = _launch.Launcher((), template, _gpu_bwd._BWD_WRITER, maps=(64, None, (0, 1, 2, 4)))
    assert with_bias._map_vars == (3,) and without._map_vars == ()


# ----------------------------------------------------------------------------
# The ws dbias kernel (kernels_cu/flash_bwd_dbias_ws.cu) beside the ws backward
# ----------------------------------------------------------------------------

DBIAS_WS = "cupyflash::flash_bwd_dbias_ws_kernel"


@pytest.mark.parametrize("head_dim", [64, 120, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dbias_shape", [(1, 8, 1000, 1000), (2, 1, 1000, 1000), (2, 8, 1000, 1000),
                                         (1, 1, 1000, 1000)])
def test_the_bias_alone_takes_the_ws_dbias_kernel(on_everywhere, head_dim, causal, dbias_shape):
    """Last, one block per (plane, 128 keys, 128 query rows), the ws kernel's maps (BwdTmaParams)."""
    plan = _plan(head_dim=head_dim, causal=causal, dbias_shape=dbias_shape)
    d = dispatch.padded_head_dim(head_dim)
    dbias = plan.launches[-1]
    assert plan.launches[1].template == WS and dbias.template == DBIAS_WS
    assert dbias.args == ("__nv_bfloat16", str(d), str(causal).lower(), str(BIAS))
    assert dbias.grid == (dbias_shape[0] * dbias_shape[1] * 8 * 8, 1, 1) and dbias.block == (384, 1, 1)
    assert dbias.smem_bytes == dispatch.bwd_dbias_ws_smem_bytes(d) <= dispatch.max_smem_per_block((9, 0))


@pytest.mark.parametrize("change", [
    dict(variant=BIAS | W), dict(variant=BIAS | SK), dict(variant=BIAS | DR),   # the bias alone only
    dict(head_dim=192), dict(head_dim=256),                                        # not its head_dims
    dict(dbias_shape=(2, 1, 1, 1000)), dict(dbias_shape=(2, 8, 1000, 1)),          # rows or keys summed
    dict(variant=dispatch.VAR_BIAS), dict(deterministic=True), dict(ws=False)],    # not the ws backward
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_everything_else_keeps_the_other_dbias_kernels(on_everywhere, change):
    args = {"dbias_shape": (1, 8, 1000, 1000), **change}
    plan = _plan(**args)
    assert all(L.template != DBIAS_WS for L in plan.launches)
    assert "dbias" in plan.launches[-1].template


def test_the_dbias_switch(monkeypatch, on_everywhere):
    monkeypatch.setattr(dispatch, "BWD_DBIAS_WS", ())
    assert all(L.template != DBIAS_WS for L in _plan(dbias_shape=(1, 8, 1000, 1000)).launches)
    monkeypatch.setattr(dispatch, "BWD_DBIAS_WS", (128,))
    assert _plan(dbias_shape=(1, 8, 1000, 1000)).launches[-1].template == DBIAS_WS
    assert _plan(head_dim=64, dbias_shape=(1, 8, 1000, 1000)).launches[-1].template != DBIAS_WS
    with pytest.raises(ValueError, match="ws dbias kernel"):
        dispatch.bwd_dbias_ws_launch("float16", 128, False, variant=BIAS | W)


def test_dbias_ws_traits_are_the_kernels():
    from test_bwd_dispatch import compile_asserts  # sibling module

    lines = ['#include "flash_bwd_dbias_ws.cu"']
    for d in dispatch.BWD_DBIAS_WS_HEAD_DIMS:
        tr = f"cupyflash::DbiasWsTraits<__half, {d}>"
        lines += [f'static_assert({tr}::SMEM_BYTES == {dispatch.bwd_dbias_ws_smem_bytes(d)}, "smem");',
                  f'static_assert({tr}::BLOCK_M * {tr}::M_STEPS == {dispatch.BWD_DBIAS_WS_ROWS}, "rows");',
                  f'static_assert({tr}::BLOCK_N == {dispatch.BWD_DBIAS_WS_KEYS}, "keys");',
                  f'static_assert({tr}::BLOCK_M == 64 && {tr}::BLOCK_N == {dispatch.bwd_ws_block_n(d)}, "boxes");',
                  f'static_assert({tr}::NUM_THREADS == {dispatch.BWD_WS_THREADS}, "threads");']
    compile_asserts(lines, "bwd_dbias_ws_traits.cu")


def test_check_kernels_lists_the_ws_dbias_kernels():
    got = {L.args for L in dispatch.all_bwd_launches((9, 0)) if L.template == DBIAS_WS}
    assert got == {(t, str(d), c, str(BIAS)) for t in ("__half", "__nv_bfloat16")
                   for d in dispatch.BWD_DBIAS_WS_HEAD_DIMS for c in ("false", "true")}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dbias_ws_compiles_without_spills(d, causal):
    from test_bwd_dispatch import _compile_clean  # sibling module

    _compile_clean(dispatch.bwd_dbias_ws_launch("bfloat16", d, causal), (9, 0))
