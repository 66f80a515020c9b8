"""Backward kernel selection, the BwdParams mirror, and the no-spill compile check.

No GPU is needed: selection is pure Python, and the kernels compile through
NVRTC (when cupy imports) for sm_80 and sm_90.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from cupyflash import _params, dispatch


def _plan(**kw):
    # cc 10.0: 227 KB of shared memory like the H200, and the mma.sync dK/dV kernel
    # at every head_dim (cc 9.0 takes the wgmma kernel at 64 and 128; tested below).
    # ws=False: the cp.async wgmma kernels, which the warp-specialised one replaces for
    # plain attention on cc 9.0 (tests/test_bwd_ws_plan.py).
    args = dict(batch=2, seqlen_q=1000, seqlen_k=1000, nheads_q=8, nheads_kv=8, head_dim=128,
                dtype="float16", causal=False, deterministic=False, vec=True, cc=(10, 0), ws=False)
    args.update(kw)
    return dispatch.select_bwd(**args)


def _names(plan):
    return [L.template.rsplit("::", 1)[1] for L in plan.launches]


# ---------------------------------------------------------------------------
# select_bwd
# ---------------------------------------------------------------------------


def test_default_mode_launches_preprocess_dkdv_convert():
    plan = _plan()
    assert _names(plan) == ["flash_bwd_preprocess_kernel", "flash_bwd_dkdv_kernel",
                            "flash_bwd_convert_dq_kernel"]
    assert plan.dq_accum
    assert plan.launches[1].args[-2] == "false"  # DETERMINISTIC (then VARIANT)


def test_deterministic_mode_launches_dq_kernel_and_no_accumulator():
    plan = _plan(deterministic=True)
    assert _names(plan) == ["flash_bwd_preprocess_kernel", "flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel"]
    assert not plan.dq_accum
    assert plan.launches[1].args[-2] == "true"


@pytest.mark.parametrize("head_dim,padded,even_k", [(32, 32, True), (40, 64, False), (59, 64, False),
                                                    (64, 64, True), (96, 96, True), (111, 128, False),
                                                    (128, 128, True), (192, 192, True), (256, 256, True)])
def test_head_dim_padding_and_even_k(head_dim, padded, even_k):
    plan = _plan(head_dim=head_dim)
    main = plan.launches[1]
    assert plan.head_dim_padded == padded
    assert main.args[1] == str(padded)
    assert main.args[9] == ("true" if even_k else "false")


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 9), (9, 0), (12, 0)])
@pytest.mark.parametrize("head_dim", dispatch.HEAD_DIMS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_shared_memory_fits_the_gpu(cc, head_dim, deterministic):
    plan = _plan(head_dim=head_dim, cc=cc, deterministic=deterministic)
    for launch in plan.launches:
        assert launch.smem_bytes <= dispatch.max_smem_per_block(cc)


def test_227kb_gpus_use_big_double_buffered_tiles():
    for d in dispatch.HEAD_DIMS:
        plan = _plan(head_dim=d, cc=(10, 0))
        assert plan.num_stages == 2
        widest = dispatch._bwd_tiles(d, False, False, True)[0]  # the widest that does not spill
        assert tuple(int(a) for a in plan.launches[1].args[2:8]) == widest


def test_a100_keeps_big_tiles_single_buffered_where_needed():
    stages = {d: _plan(head_dim=d, cc=(8, 0)).num_stages for d in dispatch.HEAD_DIMS}
    assert stages == {32: 2, 64: 2, 96: 2, 128: 1, 192: 1, 256: 1}  # D=64: the 64x128 tile (spills)


@pytest.mark.parametrize("seqlen_q,seqlen_k,nheads_q,nheads_kv", [(1, 1, 1, 1), (17, 1, 4, 1),
                                                                   (1000, 3000, 32, 8), (5, 100000, 1, 1)])
def test_grids(seqlen_q, seqlen_k, nheads_q, nheads_kv):
    batch = 3
    plan = _plan(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=nheads_q, nheads_kv=nheads_kv)
    pre, main, convert = plan.launches[:3]
    block_n = int(main.args[3])
    # the preprocess walks all rows of the row buffers as one run (blocks may span heads)
    assert pre.grid == (math.ceil(batch * nheads_q * seqlen_q / dispatch.bwd_preprocess_rows(128)), 1, 1)
    assert main.grid == (math.ceil(seqlen_k / block_n) * batch * nheads_kv * plan.kv_splits, 1, 1)
    assert main.block == (int(main.args[4]) * 32, 1, 1)
    assert convert.grid == (math.ceil(batch * nheads_q * seqlen_q / 8), 1, 1)

    det = _plan(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=nheads_q, nheads_kv=nheads_kv,
                deterministic=True)
    dq = det.launches[2]
    assert dq.grid == (math.ceil(seqlen_q / int(dq.args[2])) * batch * nheads_q, 1, 1)


@pytest.mark.parametrize("d", dispatch.HEAD_DIMS)
def test_preprocess_lanes_cover_the_padded_row(d):
    """ROW_LANES lanes of 8 elements cover the padded row (VEC: one 16-byte chunk per
    lane; !VEC: elements lane + k * ROW_LANES, k < 8), fewer than half of them idle."""
    lanes = dispatch.bwd_preprocess_row_lanes(d)
    assert lanes in (4, 8, 16, 32) and 8 * lanes >= d > 4 * lanes
    for vec in (True, False):
        launch = dispatch.bwd_preprocess_launch("bfloat16", d, vec, 10**6)
        assert launch.args == ("__nv_bfloat16", str(lanes), str(dispatch.BWD_PREPROCESS_ROWS_PER_THREAD),
                               "true" if vec else "false")
        assert launch.block == (256, 1, 1) and launch.smem_bytes == 0
        rows = 256 // lanes * dispatch.BWD_PREPROCESS_ROWS_PER_THREAD
        assert dispatch.bwd_preprocess_rows(d) == rows
        assert launch.grid == (math.ceil(10**6 / rows), 1, 1)


def test_preprocess_grid_at_the_seed_shape():
    """B=1, H=32, S=512, D=128: 16384 rows, 64 per block (16 lanes per row, 4 rows per
    thread), 256 blocks: ~2 per SM on 132 SMs (was 128 blocks of 128 rows)."""
    plan = dispatch.select_bwd(batch=1, seqlen_q=512, seqlen_k=512, nheads_q=32, nheads_kv=32, head_dim=128,
                               dtype="float16", causal=True, deterministic=False, vec=True, cc=(9, 0), ws=False)
    pre = plan.launches[0]
    assert pre.name_expression == "cupyflash::flash_bwd_preprocess_kernel<__half, 16, 4, true>"
    assert pre.grid == (256, 1, 1) and pre.block == (256, 1, 1)


def _emulate_preprocess_mapping(rows_per_head, heads, head_dim, vec):
    """The preprocess kernel's index arithmetic (kernels_cu/flash_bwd.cu), thread by thread
    in NumPy: which (buffer row, head, row in head, column) each load covers, which
    dq_accum words each block zeroes."""
    d = dispatch.padded_head_dim(head_dim)
    launch = dispatch.bwd_preprocess_launch("float16", d, vec, heads * rows_per_head)
    lanes, per_thread = int(launch.args[1]), int(launch.args[2])
    slots = launch.block[0] // lanes
    rows_block = slots * per_thread
    total = heads * rows_per_head
    tid = np.arange(launch.block[0])
    slot, lane = tid // lanes, tid % lanes
    loads, zeroed = [], []
    for block in range(launch.grid[0]):
        row0 = block * rows_block
        rows_valid = min(rows_block, total - row0)
        bh0, m0 = row0 // rows_per_head, row0 % rows_per_head
        for i in range(per_thread):
            r = slot + i * slots
            ok = r < rows_valid
            m = m0 + r
            nxt = m // rows_per_head  # the kernel's run-over branch (nxt = 0 without it)
            bh, m = bh0 + nxt, m - nxt * rows_per_head
            for e in range(8):
                col = lane * 8 + e if vec else lane + e * lanes
                keep = ok & (col < head_dim)
                loads.append(np.stack([row0 + r, bh, m, col])[:, keep])
        count = rows_valid * d // 4
        zeroed.append(row0 * d // 4 + np.arange(count))
    return np.concatenate(loads, axis=1), np.concatenate(zeroed), d


@pytest.mark.parametrize("rows_per_head,heads", [(1, 300), (17, 6), (31, 5), (512, 2), (1000, 1), (33, 7)])
@pytest.mark.parametrize("head_dim,vec", [(128, True), (64, True), (40, True), (59, False), (100, False),
                                          (256, True), (192, False), (1, False), (96, True)])
def test_preprocess_mapping_covers_every_row_once(rows_per_head, heads, head_dim, vec):
    loads, zeroed, d = _emulate_preprocess_mapping(rows_per_head, heads, head_dim, vec)
    row, bh, m, col = loads
    total = heads * rows_per_head
    # each (row, column) of the row buffers once, at its own (head, row in head)
    assert len(row) == total * head_dim
    assert len(np.unique(row * head_dim + col)) == total * head_dim
    np.testing.assert_array_equal(bh * rows_per_head + m, row)
    assert (m < rows_per_head).all() and (bh < heads).all() and (col < head_dim).all()
    # dq_accum: every word of the whole padded rows, once
    np.testing.assert_array_equal(np.sort(zeroed), np.arange(total * d // 4))


def test_preprocess_instantiations_in_check_kernels():
    """One per (dtype, ROW_LANES, VEC): every preprocess launch select_bwd can return is compiled."""
    names = {L.name_expression for L in dispatch.all_bwd_launches() if L.template.endswith("preprocess_kernel")}
    assert len(names) == 2 * 4 * 2
    for d in dispatch.HEAD_DIMS:
        for dtype, vec in ((t, v) for t in dispatch.CTYPES for v in (True, False)):
            assert dispatch.bwd_preprocess_launch(dtype, d, vec).name_expression in names


@pytest.mark.parametrize("num_sms,splits", [(3, 1), (6, 2), (7, 4), (132, 4)])
def test_gqa_group_is_split_when_the_grid_is_small(num_sms, splits):
    # 3 key blocks x 1 batch x 2 KV heads = 6 blocks; group of 4 query heads
    plan = _plan(batch=1, seqlen_q=300, seqlen_k=300, nheads_q=8, nheads_kv=2, num_sms=num_sms)
    assert plan.kv_splits == splits
    assert plan.launches[1].grid[0] == 6 * splits
    names = _names(plan)
    assert ("flash_bwd_convert_dkv_kernel" in names) == (splits > 1)
    assert names[-1] == ("flash_bwd_convert_dkv_kernel" if splits > 1 else "flash_bwd_convert_dq_kernel")


def test_no_split_without_gqa_or_with_a_full_grid():
    assert _plan(nheads_q=8, nheads_kv=8, seqlen_k=100).kv_splits == 1
    assert _plan(batch=8, nheads_q=32, nheads_kv=8, seqlen_k=4096).kv_splits == 1


def test_many_heads_go_on_grid_x():
    plan = _plan(batch=70000, seqlen_q=16, seqlen_k=16, nheads_q=1, nheads_kv=1, head_dim=32)
    assert all(L.grid[1:] == (1, 1) for L in plan.launches)
    assert plan.launches[1].grid[0] == 70000


def test_rejects_bad_dtype_arch_and_head_dim():
    with pytest.raises(ValueError, match="dtype"):
        _plan(dtype="float32")
    with pytest.raises(NotImplementedError, match="compute capability"):
        _plan(cc=(7, 5))
    with pytest.raises(ValueError, match="head_dim"):
        _plan(head_dim=257)


def test_all_bwd_launches_covers_every_selection():
    for cc in [(8, 0), (8, 9), (9, 0)]:
        every = {L.name_expression for L in dispatch.all_bwd_launches(cc)}
        for head_dim in (32, 59, 64, 96, 111, 128, 192, 256):
            for causal in (False, True):
                for deterministic in (False, True):
                    for vec in (False, True):
                        plan = _plan(head_dim=head_dim, causal=causal, deterministic=deterministic, vec=vec,
                                     cc=cc, dtype="bfloat16" if vec else "float16")
                        for launch in plan.launches:
                            assert launch.name_expression in every


def test_table_warp_grids_are_consistent():
    """The C static_asserts of BwdTraits/BwdDqTraits, checked in Python for every table entry."""
    for d, tiles in dispatch._BWD_TILES.items():
        for block_m, block_n, warps, wm_sdp, wn_dkv, wm_dq in tiles:
            assert block_m <= 32 * warps  # one thread per row of lse_log2 and delta
            for n_along, rows, cols in ((wm_sdp, block_m, block_n), (wn_dkv, block_n, d), (wm_dq, block_m, d)):
                assert warps % n_along == 0
                assert (rows // n_along) % 16 == 0 and (cols // (warps // n_along)) % 16 == 0
    for d, tiles in dispatch._BWD_DQ_TILES.items():
        for block_m, block_n, warps in tiles:
            assert (block_m // warps) % 16 == 0 and block_n % 16 == 0


# ---------------------------------------------------------------------------
# BwdParams mirror
# ---------------------------------------------------------------------------


def test_bwd_params_layout():
    dt = _params.BWD_PARAMS
    assert dt is not None and dt.isalignedstruct
    names = list(dt.names)
    assert names[:15] == ["q", "k", "v", "out", "dout", "dq", "dk", "dv", "lse", "lse_log2", "delta", "dq_accum",
                          "dkv_accum", "cu_seqlens_q", "cu_seqlens_k"]
    assert all(dt.fields[n][0] == np.uint64 for n in names[:15])
    strides = [n for n in names if n.endswith("_stride")]
    assert all(dt.fields[n][0] == np.int64 for n in strides)
    assert len(strides) == 8 * 3 + 2
    assert dt.fields["softmax_scale_log2"][0] == np.float32
    assert dt.itemsize % 8 == 0
    assert f"-DCUPYFLASH_BWD_PARAMS_BYTES={dt.itemsize}" in _params.size_defines()


def _nvrtc_or_skip():
    try:
        from cupy.cuda import nvrtc
    except Exception as exc:  # noqa: BLE001 (any import failure means: no NVRTC here)
        pytest.skip(f"cupy/NVRTC not importable: {exc}")
    return nvrtc


def compile_asserts(lines, name):
    """Compile ``lines`` (C++ with static_asserts on kernels_cu's facts) with NVRTC for
    sm_90; a failed assert fails the calling test with the compiler's log (skipped
    without NVRTC)."""
    nvrtc = _nvrtc_or_skip()
    from cupyflash import _compile

    prog = nvrtc.createProgram("\n".join(lines) + "\n", name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, _compile.compile_options((9, 0)))
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def test_bwd_params_offsets_match_c():
    """Every field offset of the numpy mirror equals offsetof in params.cuh (via NVRTC)."""
    dt = _params.BWD_PARAMS
    lines = ['#include "params.cuh"']
    for name in dt.names:
        lines.append(f'static_assert(__builtin_offsetof(cupyflash::BwdParams, {name}) == {dt.fields[name][1]}, '
                     f'"{name}");')
    lines.append(f'static_assert(sizeof(cupyflash::BwdParams) == {dt.itemsize}, "size");')
    compile_asserts(lines, "bwd_params_offsets.cu")


# ---------------------------------------------------------------------------
# Compile check: 0 spill bytes and no stack frame
# ---------------------------------------------------------------------------


def _compile_clean(launch, arch):
    _nvrtc_or_skip()
    from cupyflash import _compile

    compiled = _compile.compile_variant(launch.source, launch.name_expression, arch, use_cache=False)
    res = _compile.parse_ptxas_log(compiled.log)
    assert res.spill_bytes == 0 and res.stack_bytes == 0, (launch.name_expression, arch, res)
    assert "warning" not in compiled.log.lower(), compiled.log


def _quick_launches():
    """One D=64 and one D=128 dK/dV kernel (fast path, default mode), the dQ kernel, the helpers."""
    out = []
    for d in (64, 128):
        tile = dispatch._BWD_TILES[d][0]
        out.append(dispatch.bwd_dkdv_launch("float16", d, tile, True, True, True, False))
        out.append(dispatch.bwd_dq_launch("float16", d, dispatch._BWD_DQ_TILES[d][0], True, True, True))
    out.append(dispatch.bwd_preprocess_launch("float16", 128, True))
    out.append(dispatch.bwd_preprocess_launch("float16", 64, False))
    out.append(dispatch.bwd_convert_launch("float16", True))
    out.append(dispatch.bwd_convert_dkv_launch("float16", True))
    return out


@pytest.mark.parametrize("arch", dispatch.ARCHS, ids=lambda a: f"sm{a[0]}{a[1]}")
@pytest.mark.parametrize("launch", _quick_launches(), ids=lambda L: L.name_expression)
def test_quick_variants_compile_without_spills(launch, arch):
    _compile_clean(launch, arch)


@pytest.mark.parametrize("head_dim,causal,even_k,deterministic",
                         [(64, True, True, False), (128, True, False, False), (128, False, True, True),
                          (64, True, False, False), (64, False, True, True)])
def test_wgmma_dkdv_variant_compiles_for_sm90a_without_spills(head_dim, causal, even_k, deterministic):
    _compile_clean(dispatch.bwd_dkdv_sm90_launch("bfloat16", head_dim, causal, even_k, deterministic), (9, 0))


@pytest.mark.parametrize("variant", [dispatch.VAR_WINDOW, dispatch.VAR_SOFTCAP, dispatch.VAR_DROPOUT])
def test_wgmma_backward_variants_compile_without_warnings(variant):
    """(An unused variable of a variant that is off is a warning: kept out.)"""
    for launch in (dispatch.bwd_dkdv_sm90_launch("bfloat16", 64, True, True, True, variant=variant),
                   dispatch.bwd_dq_sm90_launch("bfloat16", 64, True, True, variant=0)):
        _compile_clean(launch, (9, 0))


def test_wgmma_dkdv_takes_64_query_rows_per_step():
    """BLOCK_M is fixed at 64 (128 at D=64 measured no faster: kernels_cu/PERF.md v17)."""
    for head_dim in (40, 64, 100, 128):
        dkdv = _plan(head_dim=head_dim, cc=(9, 0)).launches[1]
        assert dkdv.template == "cupyflash::flash_bwd_dkdv_sm90_kernel"
        assert dkdv.args[1] == str(dispatch.padded_head_dim(head_dim)) and len(dkdv.args) == 6
        assert dkdv.smem_bytes == dispatch.bwd_dkdv_sm90_smem_bytes(int(dkdv.args[1]))
    assert dispatch.BWD_SM90_BLOCK_M == 64


def test_wgmma_dkdv_shared_memory():
    # K, V (128 keys), dSᵀ (128 keys x BLOCK_M), 2 stages of Q and dO (BLOCK_M rows) and
    # of lse/delta (BLOCK_M floats each), SeqLens, 1 KB of alignment
    assert dispatch.bwd_dkdv_sm90_smem_bytes(64) == 32768 + 16384 + 32768 + 1024 + 16 + 1024
    assert dispatch.bwd_dkdv_sm90_smem_bytes(128) == 65536 + 16384 + 65536 + 1024 + 16 + 1024
    for d in (64, 128):
        assert dispatch.bwd_dkdv_sm90_smem_bytes(d) <= dispatch.max_smem_per_block((9, 0))


def test_every_wgmma_dkdv_variant_is_listed_for_check_kernels():
    sm90 = [L for L in dispatch.all_bwd_launches((9, 0)) if L.template.endswith("flash_bwd_dkdv_sm90_kernel")]
    plain = {L.args for L in sm90 if L.args[-1] == "0"}
    assert len(plain) == 2 * 2 * 2 * 2 * 2  # dtype, head_dim, causal, even_k, det
    variants = {L.args for L in sm90 if L.args[-1] != "0"
                and not int(L.args[-1]) & (dispatch.VAR_BIAS_STAGED | dispatch.VAR_BLOCK_MAP)}
    # each alone: head_dim, causal, and whether dQ comes from its own kernel; not where
    # the wgmma kernel spills (those plans take mma.sync); the staged bit needs a bias or
    # mask (BWD_STAGED_CHECK_VARIANTS), the map's bit a mask (BWD_BLOCK_MAP_CHECK_VARIANTS)
    want = {("__nv_bfloat16", str(d), causal, "true", str(det or dispatch._bwd_sm90_separate_dq(d)).lower(),
             str(bit)) for d in (64, 128) for causal in ("false", "true") for det in (False, True)
            for bit in dispatch.VARIANT_BITS.values()
            if dispatch.uses_sm90_bwd(d, True, (9, 0), bit) and bit not in (dispatch.VAR_BIAS_STAGED,
                                                                               dispatch.VAR_BLOCK_MAP)}
    assert variants == want
    assert not [L for L in dispatch.all_bwd_launches((8, 0)) if L.source == "flash_bwd_sm90.cu"]


@pytest.mark.parametrize("cc,wgmma", [((9, 0), True), ((8, 0), False), ((10, 0), False)])
@pytest.mark.parametrize("head_dim", [40, 64, 100, 128, 96, 256])
def test_hopper_dkdv_runs_on_wgmma_for_head_dims_64_and_128(cc, wgmma, head_dim):
    plan = _plan(head_dim=head_dim, cc=cc, vec=True)
    dkdv = plan.launches[1]
    uses = dkdv.template == "cupyflash::flash_bwd_dkdv_sm90_kernel"
    assert uses == (wgmma and dispatch.padded_head_dim(head_dim) in (64, 128))
    if uses:
        assert dkdv.smem_bytes <= dispatch.max_smem_per_block(cc) and dkdv.block == (256, 1, 1)
    assert _plan(head_dim=head_dim, cc=cc, vec=False).launches[1].template == "cupyflash::flash_bwd_dkdv_kernel"


@pytest.mark.slow
@pytest.mark.parametrize("arch,launch", [(a, L) for a in dispatch.ARCHS for L in dispatch.all_bwd_launches(a)],
                         ids=lambda x: f"sm{x[0]}{x[1]}" if isinstance(x, tuple) else x.name_expression)
def test_every_variant_compiles_without_spills(launch, arch):
    _compile_clean(launch, arch)


def test_wgmma_dq_kernel_serves_deterministic_mode_on_hopper(monkeypatch):
    kw = dict(head_dim=128, causal=True, deterministic=True, cc=(9, 0))
    plan = _plan(**kw)
    dq = plan.launches[2]
    assert _names(plan) == ["flash_bwd_preprocess_kernel", "flash_bwd_dkdv_sm90_kernel", "flash_bwd_dq_sm90_kernel"]
    assert dq.grid == (math.ceil(1000 / dispatch.BWD_DQ_SM90_BLOCK_M) * 2 * 8, 1, 1)
    assert dq.smem_bytes <= dispatch.max_smem_per_block((9, 0))
    assert dq.name_expression in {L.name_expression for L in dispatch.all_bwd_launches((9, 0))}
    assert _names(_plan(**{**kw, "deterministic": False}))[2] == "flash_bwd_convert_dq_kernel"
    assert _names(_plan(**{**kw, "cc": (8, 0)}))[2] == "flash_bwd_dq_kernel"
    monkeypatch.setattr(dispatch, "BWD_DQ_SM90", False)  # the A/B switch
    assert _names(_plan(**kw))[2] == "flash_bwd_dq_kernel"


@pytest.mark.parametrize("head_dim,separate", [(64, True), (40, True), (128, False), (100, False)])
def test_hopper_default_mode_takes_the_dq_kernel_where_measured_faster(monkeypatch, head_dim, separate):
    plan = _plan(head_dim=head_dim, causal=False, deterministic=False, cc=(9, 0))
    names = _names(plan)
    if separate:
        assert names[1:3] == ["flash_bwd_dkdv_sm90_kernel", "flash_bwd_dq_sm90_kernel"]
        assert not plan.dq_accum and plan.launches[1].args[-2] == "true"  # dK/dV skips dQ
    else:
        assert names[2] == "flash_bwd_convert_dq_kernel" and plan.dq_accum
    assert _names(_plan(head_dim=head_dim, deterministic=False, cc=(8, 0)))[2] == "flash_bwd_convert_dq_kernel"
    monkeypatch.setattr(dispatch, "BWD_DQ_SM90", False)  # the A/B switch restores atomics
    assert _names(_plan(head_dim=head_dim, deterministic=False, cc=(9, 0)))[2] == "flash_bwd_convert_dq_kernel"


@pytest.mark.parametrize("head_dim,causal,even_k", [(64, True, True), (128, False, False)])
def test_wgmma_dq_variant_compiles_for_sm90a_without_spills(head_dim, causal, even_k):
    _compile_clean(dispatch.bwd_dq_sm90_launch("bfloat16", head_dim, causal, even_k), (9, 0))


# ----------------------------------------------------------------------------
# attn_bias / attn_mask (issue 14)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bits", [dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK, dispatch.VAR_BIAS])
def test_staged_fp32_bias_or_mask_alone_at_d128_on_hopper_take_wgmma(bits, causal, deterministic):
    """Staged, the fp32 bias alone and the mask alone fit the D=128 wgmma dK/dV kernel,
    and the q-dtype bias alone takes it with its spill (faster than mma.sync: measured)
    (_BWD_SM90_STAGED_FITS): its plan stages the tile there; dQ from the wgmma dQ kernel
    (deterministic; staged where its three stages fit: not the fp32 bias) or by atomics in
    the dK/dV kernel (default at D=128)."""
    S = dispatch.VAR_BIAS_STAGED
    plan = dispatch.select_bwd(batch=2, seqlen_q=1000, seqlen_k=1000, nheads_q=8, nheads_kv=8, head_dim=128,
                               dtype="bfloat16", causal=causal, deterministic=deterministic, vec=True, cc=(9, 0),
                               variant=bits | S, ws=False)  # (the q-dtype bias: test_bwd_ws_bias_plan.py)
    dkdv = plan.launches[1]
    assert dkdv.template == "cupyflash::flash_bwd_dkdv_sm90_kernel" and dkdv.args[-1] == str(bits | S)
    assert dkdv.smem_bytes == dispatch.bwd_dkdv_sm90_smem_bytes(128, variant=bits | S) <= 227 * 1024
    assert plan.dq_accum == (not deterministic)
    if deterministic:
        assert plan.launches[2].template == "cupyflash::flash_bwd_dq_sm90_kernel"
        assert plan.launches[2].args[-1] == str(bits if bits == dispatch.VAR_BIAS_FP32 else bits | S)
    names = {L.name_expression for L in dispatch.all_bwd_launches((9, 0))}
    assert all(L.name_expression in names for L in plan.launches[1:])
    # unstaged (rows not 16-byte aligned), on unaligned data, and before sm_90: mma.sync
    assert not dispatch.uses_sm90_bwd(128, True, (9, 0), bits)
    assert not dispatch.uses_sm90_bwd(128, False, (9, 0), bits | S)
    assert not dispatch.uses_sm90_bwd(128, True, (8, 0), bits | S)

_BIAS_MASK = (dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("variant", _BIAS_MASK)
def test_bias_mask_backward_at_d128_on_hopper_takes_the_spill_free_mma_sync_kernels(variant, deterministic):
    """The D=128 wgmma dK/dV kernel spills with the bias/mask reads: those plans run the
    mma.sync kernels (64x64 dK/dV tile) there; D=64 stays on wgmma."""
    plan = _plan(head_dim=128, cc=(9, 0), variant=variant, deterministic=deterministic)
    assert all(L.source == "flash_bwd.cu" for L in plan.launches)
    dkdv = plan.launches[1]
    assert dkdv.template == "cupyflash::flash_bwd_dkdv_kernel" and dkdv.args[2:8] == ("64", "64", "8", "4", "2", "2")
    assert dkdv.args[-1] == str(variant)
    wgmma = _plan(head_dim=64, cc=(9, 0), variant=variant, deterministic=deterministic)
    assert wgmma.launches[1].template == "cupyflash::flash_bwd_dkdv_sm90_kernel"
    dq = wgmma.launches[2]
    assert dq.template == "cupyflash::flash_bwd_dq_sm90_kernel" and dq.args[2] == "64"  # 64 keys, not 128
    assert dq.smem_bytes == 2 * 128 * 64 * 2 + 2 * 3 * 64 * 64 * 2 + 1024
    assert _plan(head_dim=64, cc=(9, 0), deterministic=deterministic).launches[2].args[2] == "128"
    # the other variants keep the wgmma kernels at D=128
    other = _plan(head_dim=128, cc=(9, 0), variant=dispatch.VAR_SOFTCAP, deterministic=deterministic)
    assert other.launches[1].template == "cupyflash::flash_bwd_dkdv_sm90_kernel"


@pytest.mark.parametrize("variant", _BIAS_MASK)
def test_bias_mask_backward_tiles_on_mma_sync(variant):
    for det in (False, True):
        for d, want in ((32, (64, 128)), (64, (64, 128)), (128, (64, 64))):
            dkdv = _plan(head_dim=d, cc=(8, 0), variant=variant, deterministic=det).launches[1]
            assert tuple(int(x) for x in dkdv.args[2:4]) == want, (d, det)
    for d, keys in ((32, 64), (64, 32), (96, 32), (128, 64), (256, 32)):
        dq = _plan(head_dim=d, cc=(8, 0), variant=variant, deterministic=True).launches[2]
        assert dq.template == "cupyflash::flash_bwd_dq_kernel" and int(dq.args[3]) == keys, d
    # without the bias/mask bits the tables are unchanged
    assert _plan(head_dim=32, cc=(8, 0), deterministic=True).launches[1].args[2:4] == ("128", "128")


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_check_kernels_lists_bias_and_mask_in_every_backward_family(cc):
    launches = dispatch.all_bwd_launches(cc)
    families = {"cupyflash::flash_bwd_dkdv_kernel", "cupyflash::flash_bwd_dq_kernel"}
    if cc == (9, 0):
        families |= {"cupyflash::flash_bwd_dkdv_sm90_kernel", "cupyflash::flash_bwd_dq_sm90_kernel"}
    for bit in _BIAS_MASK:
        listed = {L.template for L in launches if L.args[-1] == str(bit)}
        dbias = {"cupyflash::flash_bwd_dbias_kernel"} if bit != dispatch.VAR_MASK else set()
        if dbias and cc == (9, 0):
            dbias.add("cupyflash::flash_bwd_dbias_sm90_kernel")  # D=64, 128 on aligned data
            dbias.add("cupyflash::flash_bwd_dbias_strip_sm90_kernel")  # ... whole rows and keys, few pairs
        assert listed == families | dbias, bit
        # every plan's kernels are among them (aligned bf16, any head_dim), dbias's too
        names = {L.name_expression for L in launches}
        for d, causal, det in itertools.product((32, 64, 96, 128, 192, 256), (False, True), (False, True)):
            plan = _plan(head_dim=d, cc=cc, variant=bit, deterministic=det, causal=causal, dtype="bfloat16",
                         dbias_shape=(1, 8, 1000, 1000) if dbias else None)
            assert (plan.launches[-1].template in dbias) == bool(dbias)
            for L in plan.launches[1:]:
                if L.args[-1] == str(bit):
                    assert L.name_expression in names, L.name_expression


# ----------------------------------------------------------------------------
# The dbias kernel (kernels_cu/flash_bwd_dbias.cu)
# ----------------------------------------------------------------------------


def test_dbias_tile_table_warp_grids_are_consistent():
    """BwdDbiasTraits' static_asserts, for every table entry."""
    for d, tiles in dispatch._BWD_DBIAS_TILES.items():
        assert d in dispatch.HEAD_DIMS
        for block_m, block_n, warps, warps_m in tiles:
            assert block_m <= 32 * warps  # one thread per row of lse_log2 and delta
            assert warps % warps_m == 0
            assert (block_m // warps_m) % 16 == 0 and (block_n // (warps // warps_m)) % 16 == 0


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (9, 0), (12, 0)])
def test_dbias_tile_fits_shared_memory_with_two_stages_where_they_fit(cc):
    for d in dispatch.HEAD_DIMS:
        tile, stages = dispatch.bwd_dbias_tile(d, cc)
        assert tile in dispatch._BWD_DBIAS_TILES[d] and stages in (1, 2)
        limit = dispatch.max_smem_per_block(cc)
        assert dispatch.bwd_dbias_smem_bytes(d, tile, stages) <= limit
        if stages == 1:
            assert dispatch.bwd_dbias_smem_bytes(d, tile, 2) > limit
        earlier = dispatch._BWD_DBIAS_TILES[d][:dispatch._BWD_DBIAS_TILES[d].index(tile)]
        assert all(dispatch.bwd_dbias_smem_bytes(d, t, 1) > limit for t in earlier)


def test_dbias_tiles_on_the_h200_and_a100():
    assert dispatch.bwd_dbias_tile(64, (9, 0)) == ((128, 64, 8, 4), 2)
    assert dispatch.bwd_dbias_tile(128, (9, 0)) == ((128, 64, 8, 4), 2)
    assert dispatch.bwd_dbias_tile(128, (8, 0)) == ((128, 64, 8, 4), 1)  # 2 stages need 206 KB
    assert dispatch.bwd_dbias_tile(256, (9, 0)) == ((64, 64, 4, 2), 1)


def test_dbias_smem_bytes_follow_the_traits():
    # D=64, 128 x 64: Q, dO 128 rows of 9 chunks, K, V 64 rows; two stages; 2 x 2 x 128 floats
    assert dispatch.bwd_dbias_smem_bytes(64, (128, 64, 8, 4), 2) == 2 * 2 * (128 + 64) * 9 * 16 + 2048
    # D=32, one stage: the epilogue's fp32 tile (rows of 64 + 4 floats) is larger
    assert dispatch.bwd_dbias_smem_bytes(32, (128, 64, 8, 4), 1) == 128 * 68 * 4


@pytest.mark.parametrize("shape,tiles", [
    ((1, 8, 1000, 1000), 8 * 8 * 16),   # (1, H, N, N): 128 x 64 tiles
    ((2, 1, 1000, 1000), 2 * 8 * 16),   # (B, 1, N, N)
    ((1, 1, 1000, 1000), 8 * 16),       # (N, N)
    ((2, 1, 1, 1000), 2 * 16),          # (B, 1, 1, N): one row block, summed over the rows
    ((2, 1, 1000, 1), 2 * 8),           # (B, 1, N, 1): one key block, summed over the keys
    ((1, 1, 1, 1), 1),
])
@pytest.mark.parametrize("cc", [(9, 0), (10, 0)])  # the wgmma kernel; the mma.sync one
def test_dbias_grid_has_one_block_per_tile_of_the_bias(shape, tiles, cc):
    plan = _plan(head_dim=64, variant=dispatch.VAR_BIAS, dbias_shape=shape, cc=cc)
    dbias = plan.launches[-1]
    if cc == (9, 0):
        assert dbias.template == "cupyflash::flash_bwd_dbias_sm90_kernel"
        assert dbias.args[2:5] == ("128", "64", "8")
    else:
        assert dbias.template == "cupyflash::flash_bwd_dbias_kernel"
        assert dbias.args[2:7] == ("128", "64", "8", "4", "2")
    assert dbias.block == (256, 1, 1)
    assert dbias.grid == (tiles, 1, 1)
    assert dbias.smem_bytes <= dispatch.max_smem_per_block(cc)


@pytest.mark.parametrize("head_dim,vec,cc,wgmma", [
    (64, True, (9, 0), True), (128, True, (9, 0), True), (120, True, (9, 0), True),  # padded to 128
    (32, True, (9, 0), False), (96, True, (9, 0), False), (256, True, (9, 0), False),
    (64, False, (9, 0), False),                                                   # unaligned
    (64, True, (8, 0), False), (128, True, (10, 0), False), (64, True, (12, 0), False),
])
def test_dbias_kernel_on_wgmma_where_it_serves(head_dim, vec, cc, wgmma):
    plan = _plan(head_dim=head_dim, vec=vec, cc=cc, variant=dispatch.VAR_BIAS_FP32 | dispatch.VAR_MASK,
                 dbias_shape=(1, 8, 1000, 1000))
    dbias = plan.launches[-1]
    assert (dbias.template == "cupyflash::flash_bwd_dbias_sm90_kernel") == wgmma
    assert dbias.template.startswith("cupyflash::flash_bwd_dbias")
    assert dbias.args[-1] == str(dispatch.VAR_BIAS_FP32 | dispatch.VAR_MASK)
    if wgmma:  # <T, D, BM, BN, WARPS, CAUSAL, EVEN_K, VARIANT>
        assert dbias.args[1] == str(dispatch.padded_head_dim(head_dim))
        assert dbias.args[6] == ("true" if head_dim in (64, 128) else "false")


def test_dbias_sm90_smem_bytes_follow_the_traits():
    # two stages of Q, dO (128 rows) and K, V (64 rows), unpadded; 2 x 2 x 128 floats; 1 KB to align
    assert dispatch.bwd_dbias_sm90_smem_bytes(64) == 2 * 2 * (128 + 64) * 64 * 2 + 2048 + 1024
    assert dispatch.bwd_dbias_sm90_smem_bytes(128) == 2 * 2 * (128 + 64) * 128 * 2 + 2048 + 1024
    assert dispatch.bwd_dbias_sm90_smem_bytes(128) <= dispatch.max_smem_per_block((9, 0))
    with pytest.raises(ValueError, match="bias"):
        dispatch.bwd_dbias_sm90_launch("float16", 64, False, True, variant=dispatch.VAR_MASK)


def test_dbias_kernel_runs_last_and_only_when_asked():
    kw = dict(head_dim=96, variant=dispatch.VAR_BIAS_FP32 | dispatch.VAR_MASK, causal=True)
    without = _plan(**kw)
    assert "flash_bwd_dbias_kernel" not in _names(without)
    plan = _plan(**kw, dbias_shape=(2, 8, 1000, 1000))
    assert _names(plan)[:-1] == _names(without) and _names(plan)[-1] == "flash_bwd_dbias_kernel"
    args = plan.launches[-1].args  # <T, D, BM, BN, WARPS, WARPS_M, STAGES, CAUSAL, EVEN_K, VEC, VARIANT>
    assert args[0] == "__half" and args[1] == "96" and args[7:] == ("true", "true", "true", str(kw["variant"]))
    odd = _plan(**{**kw, "head_dim": 90, "vec": False}, dbias_shape=(2, 8, 1000, 1000)).launches[-1]
    assert odd.args[8:10] == ("false", "false")
    with pytest.raises(ValueError, match="bias"):
        dispatch.bwd_dbias_launch("float16", 64, (128, 64, 8, 4), 2, False, True, True, variant=dispatch.VAR_MASK)


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_check_kernels_lists_every_dbias_plan_on_aligned_data(cc):
    names = {L.name_expression for L in dispatch.all_bwd_launches(cc)}
    extras = (0, dispatch.VAR_MASK, dispatch.VAR_BIAS_STRIDED)
    for d, causal, bias, extra in itertools.product(dispatch.HEAD_DIMS, (False, True),
                                                    (dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32), extras):
        plan = _plan(head_dim=d, causal=causal, variant=bias | extra, dtype="bfloat16", cc=cc,
                     dbias_shape=(1, 8, 1, 1000))
        assert plan.launches[-1].name_expression in names, (d, causal, bias | extra)
    for bit in dispatch.DBIAS_CHECK_WITH:
        plan = _plan(head_dim=64, variant=dispatch.VAR_BIAS | bit, dtype="bfloat16", cc=cc,
                     dbias_shape=(2, 1, 1000, 1000))
        assert plan.launches[-1].name_expression in names, bit
    unaligned = _plan(head_dim=59, vec=False, variant=dispatch.VAR_BIAS, cc=cc, dbias_shape=(2, 8, 1000, 1000))
    assert unaligned.launches[-1].name_expression in names


def _staged_plan(head_dim, bits, cc=(9, 0), deterministic=False):
    """The plan of the cp.async and mma.sync kernels (not the ws backward, which takes a staged
    q-dtype bias itself: test_bwd_ws_bias_plan.py)."""
    return dispatch.select_bwd(batch=2, seqlen_q=4096, seqlen_k=4096, nheads_q=2048 // head_dim,
                               nheads_kv=2048 // head_dim, head_dim=head_dim, dtype="bfloat16", causal=False,
                               deterministic=deterministic, vec=True, cc=cc,
                               variant=bits | dispatch.VAR_BIAS_STAGED,
                               dbias_shape=(2, 1, 4096, 4096) if bits & dispatch.VAR_BIAS else None, ws=False)


@pytest.mark.parametrize("bits", [dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK,
                                  dispatch.VAR_BIAS | dispatch.VAR_MASK])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_staged_backward_keeps_its_tile_and_stages(cc, head_dim, bits):
    """VAR_BIAS_STAGED on the backward: the dK/dV and dQ kernels that stage the tile keep
    the tile and stage count of the unstaged plan (the bit dropped where the stages do
    not fit; the wgmma dQ kernel takes the plain kernel's tile where it fits:
    bwd_dq_sm90_tile), their shared memory covers the stages, and the dbias kernel never
    has it.
    (The D=128 plans that fit the wgmma kernels only staged change family: tested above.)"""
    S = dispatch.VAR_BIAS_STAGED
    if dispatch.uses_sm90_bwd(head_dim, True, cc, bits | S) != dispatch.uses_sm90_bwd(head_dim, True, cc, bits):
        assert (head_dim, cc) == (128, (9, 0)) and bits in dispatch._BWD_SM90_STAGED_FITS[128]
        return
    for det in (False, True):
        plan, plain = _staged_plan(head_dim, bits, cc, det), _plan_bits(head_dim, bits, cc, det)
        assert plan.num_stages == plain.num_stages
        for staged, unstaged in zip(plan.launches, plain.launches):
            assert staged.template == unstaged.template
            if staged.template.endswith("dbias_kernel"):
                assert not int(staged.args[-1]) & S
            if not staged.args[-1].isdigit() or not int(staged.args[-1]) & S:
                assert staged == unstaged
                continue
            assert int(staged.args[-1]) == int(unstaged.args[-1]) | S
            if staged.template.endswith("flash_bwd_dq_sm90_kernel"):  # staged: the plain kernel's tile where it fits
                d, block_n = int(staged.args[1]), int(staged.args[2])
                assert (block_n, int(staged.args[3])) == dispatch.bwd_dq_sm90_tile(d, int(staged.args[-1]))
                assert staged.args[:2] + staged.args[3:-1] == unstaged.args[:2] + unstaged.args[3:-1]
                assert staged.smem_bytes == dispatch.bwd_dq_sm90_smem_bytes(d, block_n, int(staged.args[-1]))
            else:
                assert staged.args[:-1] == unstaged.args[:-1]
            assert staged.smem_bytes > unstaged.smem_bytes
            assert staged.smem_bytes <= dispatch.max_smem_per_block(cc)


def _plan_bits(head_dim, bits, cc, deterministic):
    return dispatch.select_bwd(batch=2, seqlen_q=4096, seqlen_k=4096, nheads_q=2048 // head_dim,
                               nheads_kv=2048 // head_dim, head_dim=head_dim, dtype="bfloat16", causal=False,
                               deterministic=deterministic, vec=True, cc=cc, variant=bits,
                               dbias_shape=(2, 1, 4096, 4096) if bits & dispatch.VAR_BIAS else None)


def test_staged_backward_shared_memory():
    S, B, F, M = dispatch.VAR_BIAS_STAGED, dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK
    tile = (64, 128, 8, 2, 4, 4)
    plain = dispatch.bwd_smem_bytes(64, tile, 2)
    assert dispatch.bwd_smem_bytes(64, tile, 2, B) == plain  # not staged: no tile
    assert dispatch.bwd_smem_bytes(64, tile, 2, S | B) == plain + 2 * 64 * 128 * 2
    assert dispatch.bwd_smem_bytes(64, tile, 1, S | F | M) == dispatch.bwd_smem_bytes(64, tile, 1) + 64 * 128 * 5
    assert dispatch.bwd_dq_smem_bytes(64, (64, 32, 4), S | M) == dispatch.bwd_dq_smem_bytes(64, (64, 32, 4)) + 2 * 64 * 32
    # wgmma dK/dV: two stages from a 128-byte boundary after the SeqLens slot
    end = dispatch.bwd_dkdv_sm90_smem_bytes(64) - 1024
    assert dispatch.bwd_dkdv_sm90_smem_bytes(64, variant=S | B) == -(-end // 128) * 128 + 2 * 64 * 128 * 2 + 1024
    assert not dispatch.score_stage_ok(16, M) and dispatch.score_stage_ok(16, B) and dispatch.score_stage_ok(32, M)


def test_staged_d128_stays_on_mma_sync_on_hopper():
    """The wgmma dK/dV kernel at D=128 spills more with the staged bias with the mask, or
    softcap (255 registers; not measured against mma.sync): those plans take the mma.sync
    kernels, which stage the tile. (The q-dtype bias alone takes the wgmma kernel.)"""
    for bits in (dispatch.VAR_BIAS_FP32 | dispatch.VAR_MASK, dispatch.VAR_BIAS | dispatch.VAR_MASK,
                 dispatch.VAR_BIAS_FP32 | dispatch.VAR_SOFTCAP, dispatch.VAR_MASK | dispatch.VAR_BIAS_STRIDED):
        plan = _staged_plan(128, bits)
        assert plan.launches[1].template == "cupyflash::flash_bwd_dkdv_kernel", bits
        assert int(plan.launches[1].args[-1]) & dispatch.VAR_BIAS_STAGED
    plan = _staged_plan(64, dispatch.VAR_BIAS)
    assert plan.launches[1].template == "cupyflash::flash_bwd_dkdv_sm90_kernel"
    assert int(plan.launches[1].args[-1]) & dispatch.VAR_BIAS_STAGED


# ----------------------------------------------------------------------------
# The strip dbias kernel (flash_bwd_dbias_strip_sm90_kernel): one block per strip of 128
# rows of a bias (batch, head), its pairs' Q, dO resident
# ----------------------------------------------------------------------------


def test_dbias_strip_smem_and_pairs():
    # D=64: K, V three stages of 64 x 64; per pair Q, dO 128 x 64 and 2 x 128 floats
    assert dispatch.bwd_dbias_strip_smem_bytes(64, 4) == 1024 + 6 * 64 * 64 * 2 + 4 * (2 * 128 * 64 * 2 + 1024)
    assert dispatch.bwd_dbias_strip_max_pairs(64) == 5
    assert dispatch.bwd_dbias_strip_max_pairs(128) == 2
    # D=128: the third stage and 2 pairs fill the opt-in limit exactly
    assert dispatch.bwd_dbias_strip_smem_bytes(128, 2) == 227 * 1024
    for d in (64, 128):
        assert dispatch.bwd_dbias_strip_smem_bytes(d, dispatch.bwd_dbias_strip_max_pairs(d)) <= 227 * 1024
        assert dispatch.bwd_dbias_strip_smem_bytes(d, dispatch.bwd_dbias_strip_max_pairs(d) + 1) > 227 * 1024


@pytest.mark.parametrize("shape,batch,heads,pairs", [
    ((1, 32, 4096, 4096), 4, 32, 4),   # per head: the batch's 4 entries
    ((4, 1, 4096, 4096), 4, 32, 32),   # per batch: every head
    ((4, 32, 4096, 4096), 4, 32, 1),   # full
    ((1, 1, 4096, 4096), 2, 2, 4),     # shared
])
def test_dbias_strip_pairs(shape, batch, heads, pairs):
    assert dispatch.dbias_strip_pairs(shape, batch, heads) == pairs


@pytest.mark.parametrize("d,vec,cc,shape,batch,heads,seqlen,strips", [
    (64, True, (9, 0), (1, 32, 4096, 4096), 4, 32, 4096, True),    # the bench's D=64 per head: 4 pairs
    (64, True, (9, 0), (4, 32, 4096, 4096), 4, 32, 4096, True),    # full: 1 pair
    (64, True, (9, 0), (4, 1, 4096, 4096), 4, 32, 4096, False),    # per batch: 32 pairs
    (128, True, (9, 0), (1, 16, 4096, 4096), 4, 16, 4096, False),  # D=128 per head: 4 pairs > 2
    (128, True, (9, 0), (1, 16, 4096, 4096), 2, 16, 4096, True),   # ... of a batch of 2
    (128, True, (9, 0), (4, 16, 4096, 4096), 4, 16, 4096, True),   # full
    (64, True, (9, 0), (1, 32, 1, 4096), 4, 32, 4096, False),      # rows broadcast
    (64, True, (9, 0), (1, 32, 4096, 1), 4, 32, 4096, False),      # keys broadcast
    (64, True, (9, 0), (1, 4, 1000, 1000), 4, 4, 1000, False),     # 32 strips < 132 SMs
    (64, True, (9, 0), (1, 4, 4224, 1000), 4, 4, 4224, True),      # 132 strips
    (96, True, (9, 0), (1, 32, 4096, 4096), 4, 32, 4096, False),   # not a wgmma dbias head_dim
    (64, False, (9, 0), (1, 32, 4096, 4096), 4, 32, 4096, False),  # unaligned
    (64, True, (10, 0), (1, 32, 4096, 4096), 4, 32, 4096, False),
    (64, True, (8, 0), (1, 32, 4096, 4096), 4, 32, 4096, False),
])
def test_uses_sm90_dbias_strips(d, vec, cc, shape, batch, heads, seqlen, strips):
    assert dispatch.uses_sm90_dbias_strips(d, vec, cc, shape, batch, heads, seqlen, 132) == strips


def test_dbias_strip_min_waves(monkeypatch):
    args = (64, True, (9, 0), (1, 4, 257, 190), 4, 4, 257, 132)
    assert not dispatch.uses_sm90_dbias_strips(*args)
    monkeypatch.setattr(dispatch, "DBIAS_STRIP_MIN_WAVES", 0)
    assert dispatch.uses_sm90_dbias_strips(*args)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 120, 128])
def test_dbias_strip_plan(d, causal):
    plan = dispatch.select_bwd(batch=2, seqlen_q=4096, seqlen_k=4096, nheads_q=16, nheads_kv=4, head_dim=d,
                               dtype="bfloat16", causal=causal, deterministic=False, vec=True, cc=(9, 0),
                               variant=dispatch.VAR_BIAS_FP32 | dispatch.VAR_MASK, dbias_shape=(1, 16, 4096, 4096))
    dbias = plan.launches[-1]
    assert dbias.template == "cupyflash::flash_bwd_dbias_strip_sm90_kernel"
    # <T, D, BM, BN, WARPS, CAUSAL, EVEN_K, VARIANT>
    assert dbias.args[1:] == (str(dispatch.padded_head_dim(d)), "128", "64", "8", "true" if causal else "false",
                              "true" if d in (64, 128) else "false", str(dispatch.VAR_BIAS_FP32 | dispatch.VAR_MASK))
    assert dbias.grid == (16 * 32, 1, 1)
    assert dbias.block == (256, 1, 1)
    assert dbias.smem_bytes <= dispatch.max_smem_per_block((9, 0))
    if d in (64, 128):  # check-kernels compiles aligned head_dims
        assert dbias.name_expression in {L.name_expression for L in dispatch.all_bwd_launches((9, 0))}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK,
                                  dispatch.VAR_BIAS | dispatch.VAR_MASK, dispatch.VAR_BIAS | dispatch.VAR_SOFTCAP])
def test_wgmma_dq_kernel_stages_the_tile_where_it_fits(head_dim, bits):
    """The wgmma dQ kernel streams the key block's bias/mask tile beside K and V (three
    stages, as the forward) where they fit one block with its tile, at the plain kernel's
    128 keys at D=64 where they fit there, else the element-wise path's 64; not with
    softcap (its per-element path reads the bias itself); its shared memory covers the
    stages."""
    S = dispatch.VAR_BIAS_STAGED
    expect = {(64, dispatch.VAR_BIAS): 128, (64, dispatch.VAR_BIAS_FP32): 64, (64, dispatch.VAR_MASK): 128,
              (64, dispatch.VAR_BIAS | dispatch.VAR_MASK): 64, (128, dispatch.VAR_BIAS): 64,
              (128, dispatch.VAR_MASK): 64}
    staged_bits = dispatch.bwd_dq_sm90_variant(head_dim, bits | S)
    assert dispatch.bwd_dq_sm90_variant(head_dim, bits) == bits
    if (head_dim, bits) not in expect:  # softcap, or the stages do not fit: unstaged
        assert staged_bits == bits
        return
    assert staged_bits == bits | S
    block_n, ctas = dispatch.bwd_dq_sm90_tile(head_dim, bits | S)
    assert (block_n, ctas) == (expect[head_dim, bits], 1)
    tile = 128 * block_n * ((4 if bits & dispatch.VAR_BIAS_FP32 else 2 if bits & dispatch.VAR_BIAS else 0)
                            + (1 if bits & dispatch.VAR_MASK else 0))
    staged = dispatch.bwd_dq_sm90_smem_bytes(head_dim, block_n, bits | S)
    assert staged == 2 * 128 * head_dim * 2 + 3 * (2 * block_n * head_dim * 2 + tile) + 1024 <= 227 * 1024
    launch = dispatch.bwd_dq_sm90_launch("bfloat16", head_dim, False, True, variant=bits | S)
    assert launch.smem_bytes == staged and launch.args[2] == str(block_n)
    # unstaged, the element-wise path's tile
    assert dispatch.bwd_dq_sm90_tile(head_dim, bits) == (64, 1)  # every case here has a bias or mask
