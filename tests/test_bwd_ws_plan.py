"""The warp-specialised backward's plan (dispatch.uses_ws_bwd, bwd_ws_launch, BwdTmaParams),
without a GPU: where it is chosen (dense plain attention at padded head_dim 128 on cc 9.0;
the variants of BWD_WS_VARIANTS, all five by default; at D=64 with BWD_WS_HEAD_DIMS holding
64, without dQ beside the wgmma dQ kernel, 64 or BWD_WS_D64_BLOCK_M query rows per step),
its launch and shared memory (the kernel's traits, through NVRTC), the struct that carries its
TMA maps, and NVRTC compiles with no spill (skipped without NVRTC)."""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _params, dispatch

WS = "cupyflash::flash_bwd_ws_kernel"


def _plan(**kw):
    args = dict(batch=2, seqlen_q=1000, seqlen_k=1000, nheads_q=8, nheads_kv=8, head_dim=128,
                dtype="float16", causal=False, deterministic=False, vec=True, cc=(9, 0), ws=True)
    args.update(kw)
    return dispatch.select_bwd(**args)


@pytest.mark.parametrize("head_dim", [104, 120, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_attention_on_hopper_takes_it(head_dim, causal):
    plan = _plan(head_dim=head_dim, causal=causal)
    names = [L.template for L in plan.launches]
    assert names == ["cupyflash::flash_bwd_preprocess_kernel", WS, "cupyflash::flash_bwd_convert_dq_kernel"]
    dkdv = plan.launches[1]
    assert dkdv.args == ("__half", "128", "64", str(causal).lower(), str(head_dim == 128).lower(), "true", "0")
    assert dkdv.block == (384, 1, 1) and dkdv.smem_bytes == dispatch.bwd_ws_smem_bytes(128)
    # the cp.async kernel's grid: one block per (key block, batch, KV head)
    assert dkdv.grid == _plan(head_dim=head_dim, causal=causal, ws=False).launches[1].grid
    assert plan.dq_accum and plan.tma_box_rows == (64, 128, 128, 64)
    # dq_accum in the ws kernel's layout (bwd_rows.cuh dq_accum_piece), converted as such
    assert plan.launches[2].args == ("__half", "true", "true")
    cp_async = _plan(head_dim=head_dim, causal=causal, ws=False)
    assert cp_async.tma_box_rows is None and cp_async.launches[-1].args == ("__half", "true", "false")


def test_a_gqa_group_split_keeps_it_with_the_partials_convert():
    plan = _plan(nheads_q=8, nheads_kv=1, batch=1, num_sms=132)
    assert plan.kv_splits > 1 and plan.launches[1].template == WS
    assert plan.launches[-1].template == "cupyflash::flash_bwd_convert_dkv_kernel"


@pytest.mark.parametrize("change", [
    dict(deterministic=True), dict(vec=False), dict(cc=(8, 0)), dict(cc=(10, 0)), dict(head_dim=96),
    dict(varlen=True, total_q=1500, total_k=1700),
    dict(head_dim=256, deterministic=True), dict(head_dim=160, varlen=True, total_q=1500, total_k=1700),
    dict(head_dim=256, variant=dispatch.VAR_SOFTCAP | dispatch.VAR_DROPOUT), dict(variant=dispatch.VAR_BIAS), dict(variant=dispatch.VAR_MASK),
    dict(variant=dispatch.VAR_ALIBI | dispatch.VAR_DROPOUT), dict(ws=False)],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_everything_else_keeps_the_other_kernels(change):
    plan = _plan(**change)
    assert all(L.template != WS for L in plan.launches) and plan.tma_box_rows is None


def test_the_switch(monkeypatch):
    """ws=None reads dispatch.BWD_WS (what cupyflash._gpu_bwd passes explicitly)."""
    monkeypatch.setattr(dispatch, "BWD_WS", True)
    assert _plan(ws=None).launches[1].template == WS
    monkeypatch.setattr(dispatch, "BWD_WS", False)
    assert _plan(ws=None).launches[1].template == "cupyflash::flash_bwd_dkdv_sm90_kernel"


_WS_BITS = (dispatch.VAR_WINDOW, dispatch.VAR_SOFTCAP, dispatch.VAR_ALIBI, dispatch.VAR_SINKS, dispatch.VAR_DROPOUT)


def test_the_variants_take_it_by_default():
    """Every bit the kernel takes (PERF.md v24, run 105: each measured faster there)."""
    assert dispatch.BWD_WS_VARIANTS == dispatch.FWD_WS_VARIANTS
    for bit in _WS_BITS:
        dkdv = _plan(variant=bit).launches[1]
        assert dkdv.template == WS and dkdv.args[-1] == str(bit)


@pytest.mark.parametrize("variant", [*_WS_BITS, dispatch.VAR_WINDOW | dispatch.VAR_SINKS,
                                     dispatch.VAR_SOFTCAP | dispatch.VAR_DROPOUT,
                                     dispatch.VAR_WINDOW | dispatch.VAR_SOFTCAP | dispatch.VAR_SINKS])
@pytest.mark.parametrize("causal", [False, True])
def test_the_variants_switch(monkeypatch, variant, causal):
    """BWD_WS_VARIANTS: the bits it holds take the ws kernel, compiled with them; others do not."""
    monkeypatch.setattr(dispatch, "BWD_WS_VARIANTS", dispatch.FWD_WS_VARIANTS)
    dkdv = _plan(variant=variant, causal=causal).launches[1]
    assert dkdv.template == WS and dkdv.args[-1] == str(variant)
    monkeypatch.setattr(dispatch, "BWD_WS_VARIANTS", dispatch.FWD_WS_VARIANTS & ~variant)
    assert _plan(variant=variant, causal=causal).launches[1].template == "cupyflash::flash_bwd_dkdv_sm90_kernel"
    monkeypatch.setattr(dispatch, "BWD_WS_VARIANTS", variant)
    assert _plan(variant=variant, causal=causal, ws=False).launches[1].template != WS  # BWD_WS still decides


@pytest.mark.parametrize("variant", [*dispatch.BWD_WS_VARIANT_SPILLS, dispatch.FWD_WS_VARIANTS,
                                     dispatch.VAR_BIAS, dispatch.VAR_MASK, dispatch.VAR_SOFTCAP | dispatch.VAR_MASK])
def test_variant_sets_it_spills_with_or_never_takes(monkeypatch, variant):
    monkeypatch.setattr(dispatch, "BWD_WS_VARIANTS", dispatch.FWD_WS_VARIANTS | dispatch.VAR_BIAS | dispatch.VAR_MASK)
    assert not dispatch.bwd_ws_takes(variant)
    assert all(L.template != WS for L in _plan(variant=variant, dbias_shape=None).launches)
    with pytest.raises(ValueError, match="variant bits"):
        dispatch.bwd_ws_launch("float16", 128, True, True, variant=variant)


def test_kernel_takes_the_forwards_ws_variants():
    """The kernel's static_assert admits variant.cuh's WS_VARIANTS, FWD_WS_VARIANTS, and
    WS_BWD_BIAS, BWD_WS_BIAS_VARIANTS."""
    from cupyflash._sources import kernels_dir

    assert "static_assert((VARIANT & ~(WS_VARIANTS | WS_BWD_BIAS)) == 0" in (
        kernels_dir() / "flash_bwd_ws.cu").read_text()
    header = (kernels_dir() / "variant.cuh").read_text()
    assert "constexpr int WS_VARIANTS = VAR_WINDOW | VAR_SOFTCAP | VAR_ALIBI | VAR_SINKS | VAR_DROPOUT;" in header
    assert "constexpr int WS_BWD_BIAS = VAR_BIAS | VAR_BIAS_STAGED;" in header
    assert dispatch.BWD_WS_BIAS_VARIANTS == dispatch.VAR_BIAS | dispatch.VAR_BIAS_STAGED


def test_shared_memory():
    # K, V (128 keys), two dSᵀ (128 x 64), 2 stages of Q and dO (64 rows) and of lse/delta
    # (64 floats each), 64 unpadded dQ rows of head_dim fp32, SeqLens, 5 mbarriers, 1 KB
    assert dispatch.bwd_ws_smem_bytes(128) == 65536 + 32768 + 65536 + 1024 + 64 * 512 + 16 + 40 + 1024
    assert dispatch.bwd_ws_smem_bytes(64) == 32768 + 32768 + 32768 + 1024 + 64 * 256 + 16 + 40 + 1024
    assert dispatch.bwd_ws_smem_bytes(128) <= dispatch.max_smem_per_block((9, 0))
    # without dQ: no dSᵀ tiles, no dQ rows; 128 query rows: twice the stages and rows
    assert dispatch.bwd_ws_smem_bytes(64, 64, False) == 32768 + 32768 + 1024 + 16 + 40 + 1024
    assert dispatch.bwd_ws_smem_bytes(64, 128, False) == 32768 + 65536 + 2048 + 16 + 40 + 1024
    # split by roles: K, V (64 keys), one dSᵀ and the Pᵀ tile (64 x 64), the stages; no dQ rows
    assert dispatch.bwd_ws_smem_bytes(256) == 65536 + 8192 + 8192 + 131072 + 1024 + 16 + 40 + 1024
    assert dispatch.bwd_ws_smem_bytes(192) == 49152 + 8192 + 8192 + 98304 + 1024 + 16 + 40 + 1024
    assert dispatch.bwd_ws_smem_bytes(256) <= dispatch.max_smem_per_block((9, 0))


@pytest.mark.parametrize("head_dim", [136, 176, 192, 200, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_above_128_it_splits_by_roles(head_dim, causal):
    """Plain attention and the variants it takes at 192 and 256 (and head_dims padded to them):
    64-key blocks and boxes, dQ in the kernel (from registers, plain dq_accum layout: the
    convert kernel not swizzled), no wgmma dQ kernel."""
    d = dispatch.padded_head_dim(head_dim)
    for variant in (0, dispatch.VAR_WINDOW | dispatch.VAR_SOFTCAP | dispatch.VAR_SINKS, dispatch.VAR_DROPOUT):
        plan = _plan(head_dim=head_dim, causal=causal, variant=variant)
        names = [L.template for L in plan.launches]
        assert names == ["cupyflash::flash_bwd_preprocess_kernel", WS, "cupyflash::flash_bwd_convert_dq_kernel"]
        dkdv = plan.launches[1]
        assert dkdv.args == ("__half", str(d), "64", str(causal).lower(), str(head_dim == d).lower(), "true",
                             str(variant))
        assert dkdv.smem_bytes == dispatch.bwd_ws_smem_bytes(d) and plan.tma_box_rows == (64, 64, 64, 64)
        assert dkdv.grid == (-(-1000 // 64) * 2 * 8, 1, 1)
        assert plan.launches[2].args == ("__half", "true", "false") and plan.dq_accum
    with pytest.raises(ValueError, match="computes dQ"):
        dispatch.bwd_ws_launch("float16", d, causal, True, with_dq=False)


# (head_dim, BLOCK_M, WITH_DQ) of every ws instantiation check-kernels lists
_TILES = sorted({(int(L.args[1]), int(L.args[2]), L.args[5] == "true") for L in dispatch.all_bwd_launches((9, 0))
                 if L.template == WS})


def test_tiles_are_the_kernels_traits():
    """bwd_ws_smem_bytes and the TMA boxes' rows are BwdWsTraits' (SMEM_BYTES, BLOCK_M, BLOCK_N),
    for every tile a plan takes: static_asserts compiled by NVRTC."""
    from test_bwd_dispatch import compile_asserts  # sibling module

    assert _TILES == [(64, 64, False), (64, 64, True), (64, 128, False), (128, 64, True), (192, 64, True),
                      (256, 64, True)]
    lines = ['#include "flash_bwd_ws.cu"']
    for d, m, dq in _TILES:
        tr = f"cupyflash::BwdWsTraits<__half, {d}, {m}, {str(dq).lower()}>"
        lines += [f'static_assert({tr}::SMEM_BYTES == {dispatch.bwd_ws_smem_bytes(d, m, dq)}, "smem {d} {m}");',
                  f'static_assert({tr}::BLOCK_M == {m} && {tr}::BLOCK_N == {dispatch.bwd_ws_block_n(d)}, "tile");',
                  f'static_assert({tr}::ROLES == {str(dispatch.bwd_ws_roles(d)).lower()}, "roles");',
                  f'static_assert({tr}::STAGES == {dispatch.BWD_WS_STAGES}, "stages");',
                  f'static_assert({tr}::NUM_THREADS == {dispatch.BWD_WS_THREADS}, "threads");']
    compile_asserts(lines, "bwd_ws_traits.cu")


# ----------------------------------------------------------------------------
# D=64 (BWD_WS_HEAD_DIMS with 64): the ws kernel without dQ, then the wgmma dQ kernel
# ----------------------------------------------------------------------------

DQ = "cupyflash::flash_bwd_dq_sm90_kernel"


@pytest.fixture
def d64(monkeypatch):
    """D=64 on the ws kernel at 64 query rows per step (the tests that want 128 set it)."""
    monkeypatch.setattr(dispatch, "BWD_WS_HEAD_DIMS", (64, 128))
    monkeypatch.setattr(dispatch, "BWD_WS_D64_BLOCK_M", 64)
    return monkeypatch


@pytest.mark.parametrize("head_dim", [40, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_d64_takes_it_without_dq_beside_the_dq_kernel(d64, head_dim, causal):
    plan = _plan(head_dim=head_dim, causal=causal)
    old = _plan(head_dim=head_dim, causal=causal, ws=False)  # the cp.async dK/dV kernel without dQ
    assert [L.template for L in old.launches] == ["cupyflash::flash_bwd_preprocess_kernel",
                                                  "cupyflash::flash_bwd_dkdv_sm90_kernel", DQ]
    assert [L.template for L in plan.launches] == ["cupyflash::flash_bwd_preprocess_kernel", WS, DQ]
    dkdv = plan.launches[1]
    assert dkdv.args == ("__half", "64", "64", str(causal).lower(), str(head_dim == 64).lower(), "false", "0")
    assert dkdv.smem_bytes == dispatch.bwd_ws_smem_bytes(64, 64, False) and dkdv.grid == old.launches[1].grid
    assert plan.launches[2] == old.launches[2]  # the same dQ kernel, grid and all
    assert not plan.dq_accum and plan.tma_box_rows == (64, 128, 128, 64)


def test_d64_is_on_by_default_at_128_rows_per_step():
    """The defaults (PERF.md v25, run 116): D=64 on the ws kernel without dQ, 128 rows per step."""
    assert 64 in dispatch.BWD_WS_HEAD_DIMS and dispatch.BWD_WS_D64_BLOCK_M == 128
    plan = _plan(head_dim=64)
    assert [L.template for L in plan.launches] == ["cupyflash::flash_bwd_preprocess_kernel", WS, DQ]
    assert plan.launches[1].args[1:3] == ("64", "128") and plan.launches[1].args[5] == "false"


@pytest.mark.parametrize("head_dim", [40, 64])
def test_d64_wide_step(d64, head_dim):
    """BWD_WS_D64_BLOCK_M = 128: 128 query rows per step, the Q and dO boxes with them."""
    d64.setattr(dispatch, "BWD_WS_D64_BLOCK_M", 128)
    plan = _plan(head_dim=head_dim, causal=True)
    dkdv = plan.launches[1]
    assert dkdv.template == WS and dkdv.args[2] == "128" and dkdv.args[5] == "false"
    assert dkdv.smem_bytes == dispatch.bwd_ws_smem_bytes(64, 128, False)
    assert plan.tma_box_rows == (128, 128, 128, 128) and plan.launches[2].template == DQ
    # D=128 keeps its 64 rows and its dQ
    d128 = _plan(head_dim=128).launches[1]
    assert d128.args[2] == "64" and d128.args[5] == "true"


@pytest.mark.parametrize("variant", [*_WS_BITS, dispatch.VAR_WINDOW | dispatch.VAR_SINKS,
                                     dispatch.VAR_WINDOW | dispatch.VAR_ALIBI,
                                     dispatch.VAR_SOFTCAP | dispatch.VAR_DROPOUT])
@pytest.mark.parametrize("block_m", [64, 128])
def test_d64_variants_take_dq_in_the_ws_kernel(d64, variant, block_m):
    """Every variant set the kernel takes, at D=64: the ws kernel with its own dQ (64 rows per
    step, dq_accum in its layout, the convert kernel), whatever BWD_WS_D64_BLOCK_M says
    (dispatch.bwd_ws_separate_dq: PERF.md v25, run 117)."""
    d64.setattr(dispatch, "BWD_WS_D64_BLOCK_M", block_m)
    plan = _plan(head_dim=64, variant=variant)
    dkdv = plan.launches[1]
    assert [L.template for L in plan.launches] == [
        "cupyflash::flash_bwd_preprocess_kernel", WS, "cupyflash::flash_bwd_convert_dq_kernel"]
    assert dkdv.args[1:3] == ("64", "64") and dkdv.args[5:] == ("true", str(variant))
    assert dkdv.smem_bytes == dispatch.bwd_ws_smem_bytes(64, 64, True)
    assert plan.dq_accum and plan.tma_box_rows == (64, 128, 128, 64)
    assert dispatch.bwd_ws_separate_dq(64, 0) and not dispatch.bwd_ws_separate_dq(64, variant)
    assert not dispatch.bwd_ws_separate_dq(128, 0)


@pytest.mark.parametrize("block_m", [64, 128])
def test_every_d64_gpu_case_plans_it(d64, block_m):
    """tests/test_gpu_bwd_ws.py's D=64 cases, as its fixture plans them, take the ws kernel
    in the dQ mode and at the rows per step their checks expect (D64Run.expected)."""
    import test_gpu_bwd_ws as g  # sibling module; its GPU tests skip here

    from cupyflash import _variant

    d64.setattr(dispatch, "BWD_WS_D64_BLOCK_M", block_m)
    rng = np.random.default_rng(0)
    cases = [(dtype, (batch, sq, sk, hq, hkv, d), causal, 0)
             for dtype, d, causal, batch, sq, sk, hq, hkv in g.DENSE_64]
    cases += [(dtype, shape, causal, _variant.bits(g._variants_case(name)(rng, shape)))
              for name, dtype, shape, causal, _ in g.VARIANT_CASES_64]
    for dtype, (batch, sq, sk, hq, hkv, d), causal, bits in cases:
        plan = _plan(dtype=dtype, batch=batch, seqlen_q=sq, seqlen_k=sk, nheads_q=hq, nheads_kv=hkv, head_dim=d,
                     causal=causal, variant=bits, num_sms=1)
        names = {L.template.split("::")[1] for L in plan.launches}
        ws_args, present, absent = g.D64Run.expected(bits, block_m)
        dkdv = plan.launches[1]
        assert dkdv.template == WS and (dkdv.args[1], dkdv.args[2], dkdv.args[5], dkdv.args[6]) == ws_args
        assert present in names and absent not in names, (dtype, sq, sk, d, bits)
    assert {c[3] for c in cases} >= {0, dispatch.VAR_ALIBI, dispatch.VAR_ALIBI | dispatch.VAR_SINKS,
                                     dispatch.VAR_SOFTCAP, dispatch.VAR_DROPOUT, dispatch.VAR_WINDOW}


@pytest.mark.parametrize("change", [dict(deterministic=True), dict(vec=False), dict(cc=(8, 0)),
                                    dict(varlen=True, total_q=1500, total_k=1700), dict(ws=False),
                                    dict(variant=dispatch.VAR_BIAS)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_d64_everything_else_keeps_the_other_kernels(d64, change):
    plan = _plan(head_dim=64, **change)
    assert all(L.template != WS for L in plan.launches) and plan.tma_box_rows is None


@pytest.mark.parametrize("head_dim,with_dq,variant,block_m", [
    (128, True, 0, 128), (64, True, 0, 128), (128, False, 0, 128), (64, False, dispatch.VAR_DROPOUT, 128),
    (64, False, dispatch.VAR_ALIBI, 128), (64, False, 0, 96)])  # (the kernel takes 64 or 128)
def test_the_wide_step_is_refused_elsewhere(head_dim, with_dq, variant, block_m):
    with pytest.raises(ValueError, match="query rows per step"):
        dispatch.bwd_ws_launch("float16", head_dim, True, True, variant=variant, with_dq=with_dq, block_m=block_m)


def test_params_carry_five_maps_after_bwd_params():
    mirror = _params.BWD_TMA_PARAMS
    assert mirror.names == ("bwd", "q_map", "k_map", "v_map", "do_map", "bias_map")
    offsets = [_params.offset_of(mirror, n) for n in mirror.names]
    assert offsets[0] == 0 and offsets[1] == -(-_params.BWD_PARAMS.itemsize // 64) * 64
    assert np.diff(offsets[1:]).tolist() == [128, 128, 128, 128] and mirror.itemsize % 64 == 0
    assert f"-DCUPYFLASH_BWD_TMA_PARAMS_BYTES={mirror.itemsize}" in _params.size_defines()


def bwd_tma_template():
    """A BwdTmaParams struct's bytes (every BwdParams field 3, no variant), and a fake map
    maker whose map of address x is 128 bytes of x % 256."""
    mirror = _params.BWD_TMA_PARAMS
    bwd = _params.pack(_params.BWD_PARAMS, **{n: 3 for n in _params.BWD_PARAMS.names if n != "var"},
                       var=_params.VARIANT_OFF)

    def maps(*pointers):
        return b"".join(bytes([x % 256]) * 128 for x in pointers)

    return bwd + bytes(mirror.itemsize - len(bwd)), maps


def test_launcher_writes_the_maps_of_the_named_pointers():
    """(offset, make, indices): the maps of q, k, v and dout (pointer 4 of BwdParams')."""
    from cupyflash import _gpu_bwd
    from test_params import _recording_launcher  # sibling module

    mirror = _params.BWD_TMA_PARAMS
    template, maps = bwd_tma_template()

    indices = tuple(_gpu_bwd.BWD_POINTERS.index(n) for n in ("q", "k", "v", "dout"))
    assert indices == (0, 1, 2, 4)
    launcher, seen = _recording_launcher(template, (_params.offset_of(mirror, "q_map"), maps, indices),
                                         _gpu_bwd._BWD_WRITER)
    pointers = tuple(range(101, 101 + len(_gpu_bwd.BWD_POINTERS)))
    launcher(0, *pointers)
    (got,) = (np.frombuffer(b, dtype=mirror)[0] for b in seen)
    assert [bytes(got[n])[0] for n in ("q_map", "k_map", "v_map", "do_map")] == [101, 102, 103, 105]
    assert [got["bwd"][n] for n in _gpu_bwd.BWD_POINTERS] == list(pointers)


def test_check_kernels_lists_every_instantiation():
    ws = [L for L in dispatch.all_bwd_launches((9, 0)) if L.template == WS]
    bits = (0, *dispatch.BWD_WS_CHECK_VARIANTS)
    # dtype, causal, even_k; plain and BWD_WS_CHECK_VARIANTS with dQ at 64 rows (D=128; D=64's
    # variants), and D=64 plain without dQ at 64 and at 128 rows
    # split by roles (192, 256): plain and the checked sets each takes, with dQ at 64 rows
    # a bias (BWD_WS_BIAS_CHECK_VARIANTS), with dQ at 64 rows, the sets each head_dim takes
    roles = {d: (0, *(b for b in dispatch.FWD_WS_CHECK_VARIANTS if dispatch.bwd_ws_takes(b, d))) for d in (192, 256)}
    bias = {d: tuple(b for b in dispatch.BWD_WS_BIAS_CHECK_VARIANTS if dispatch.bwd_ws_takes(b, d))
            for d in (64, 128, 192, 256)}
    assert dispatch.FWD_WS_VARIANTS in roles[192] and dispatch.FWD_WS_VARIANTS not in roles[256]
    assert all(dispatch.BWD_WS_BIAS_VARIANTS in sets for sets in bias.values())
    assert len({L.args for L in ws}) == len(ws) == 2 * 2 * 2 * (
        2 * len(bits) - 1 + 2 + sum(map(len, roles.values())) + sum(map(len, bias.values())))
    for d, m, dq in _TILES:
        tile = [L for L in ws if L.args[1:3] == (str(d), str(m)) and L.args[5] == str(dq).lower()]
        want = ({0} if d == 64 and not dq else set(roles[d]) if d in roles else
                set(bits) - {0} if d == 64 else set(bits)) | (set(bias[d]) if dq and m == 64 else set())
        assert {int(L.args[-1]) for L in tile} == want
    assert set(_WS_BITS) <= set(dispatch.BWD_WS_CHECK_VARIANTS)
    assert not [L for L in dispatch.all_bwd_launches((8, 0)) if L.template == WS]


@pytest.mark.parametrize("causal,even_k", [(True, True), (False, False)])
def test_compiles_without_spills(causal, even_k):
    from test_bwd_dispatch import _compile_clean  # sibling module

    _compile_clean(dispatch.bwd_ws_launch("bfloat16", 128, causal, even_k), (9, 0))


@pytest.mark.parametrize("variant", [dispatch.VAR_WINDOW, dispatch.VAR_DROPOUT,
                                     dispatch.VAR_SOFTCAP | dispatch.VAR_DROPOUT])
@pytest.mark.parametrize("causal,even_k", [(True, True), (False, False)])
def test_variants_compile_without_spills(causal, even_k, variant):
    from test_bwd_dispatch import _compile_clean  # sibling module

    _compile_clean(dispatch.bwd_ws_launch("float16", 128, causal, even_k, variant=variant), (9, 0))


@pytest.mark.parametrize("block_m,variant,with_dq", [(64, 0, False), (128, 0, False),
                                                     (64, dispatch.VAR_SOFTCAP | dispatch.VAR_DROPOUT, True),
                                                     (64, dispatch.VAR_WINDOW | dispatch.VAR_SINKS, True)])
@pytest.mark.parametrize("causal,even_k", [(True, True), (False, False)])
def test_d64_compiles_without_spills(causal, even_k, block_m, variant, with_dq):
    from test_bwd_dispatch import _compile_clean  # sibling module

    _compile_clean(dispatch.bwd_ws_launch("bfloat16", 64, causal, even_k, variant=variant, with_dq=with_dq,
                                          block_m=block_m), (9, 0))
