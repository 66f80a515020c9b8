"""Kernel selection and the params mirror: pure, no GPU needed."""

from __future__ import annotations

import itertools
import math
import re

import pytest

from cupyflash import _params, dispatch
from cupyflash._sources import kernels_dir


@pytest.mark.parametrize("head_dim,expected", [(1, 32), (8, 32), (32, 32), (33, 64), (59, 64), (64, 64),
                                               (65, 96), (111, 128), (128, 128), (129, 192), (256, 256)])
def test_padded_head_dim(head_dim, expected):
    assert dispatch.padded_head_dim(head_dim) == expected


def test_padded_head_dim_rejects_over_256():
    with pytest.raises(ValueError, match="head_dim must be at most 256; got 257"):
        dispatch.padded_head_dim(257)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_standard_grid_does_not_split(head_dim, causal, cc):
    plan = dispatch.select_fwd(batch=16, seqlen_q=1024, seqlen_k=1024, nheads_q=2048 // head_dim,
                               head_dim=head_dim, dtype="float16", causal=causal, vec=True, cc=cc)
    assert plan.num_splits == 1 and plan.combine is None
    if cc == (9, 0):  # the wgmma kernel: <T, HEAD_DIM, BLOCK_N, CTAS_PER_SM, IS_CAUSAL, EVEN_K, VARIANT>
        assert plan.main.template == "cupyflash::flash_fwd_sm90_kernel"
        block_m, causal_arg = dispatch.SM90_BLOCK_M, plan.main.args[4]
    else:
        assert plan.main.template == "cupyflash::flash_fwd_kernel"
        block_m, causal_arg = dispatch.fwd_tiles(head_dim, True, causal, cc)[0], plan.main.args[5]
    assert plan.main.grid == (16 * (2048 // head_dim) * math.ceil(1024 / block_m), 1, 1)
    assert plan.num_m_blocks == math.ceil(1024 / block_m)
    assert causal_arg == ("true" if causal else "false")


@pytest.mark.parametrize("case,wgmma", [
    (dict(), True),
    (dict(head_dim=128, causal=True, dtype="bfloat16"), True),
    (dict(head_dim=100), True),          # runs on the 128 specialisation with predicated columns
    (dict(cc=(8, 0)), False),
    (dict(cc=(8, 9)), False),
    (dict(cc=(10, 0)), False),           # sm_90a code runs on cc 9.0 only
    (dict(vec=False), False),
    (dict(head_dim=96), False),
    (dict(head_dim=256), False),
    (dict(seqlen_q=1, seqlen_k=8192), False),   # split-KV stays on the mma.sync kernel
])
def test_which_forward_kernel(case, wgmma):
    kw = dict(batch=2, seqlen_q=2048, seqlen_k=2048, nheads_q=16, head_dim=64, dtype="float16",
              causal=False, vec=True, cc=(9, 0))
    kw.update(case)
    plan = dispatch.select_fwd(**kw)
    assert (plan.main.template == "cupyflash::flash_fwd_sm90_kernel") == wgmma
    if wgmma:
        assert plan.main.args[5] == ("true" if kw["head_dim"] == plan.head_dim_padded else "false")
        assert plan.main.block == (dispatch.SM90_THREADS, 1, 1)


def test_wgmma_variants_fit_hopper_shared_memory_and_are_checked_on_sm90_only():
    sm90 = [L for L in dispatch.all_fwd_launches((9, 0)) if L.source == "flash_fwd_sm90.cu"]
    plain = [L for L in sm90 if L.args[-1] == "0"]
    assert len(plain) == 2 * 2 * 2 * 2  # dtype x head_dim (64, 128) x causal x even_k
    # bf16, head_dim x causal; the staged ones: each at D=64 and 128 x causal, but the fp32
    # bias with a mask at D=128 (with and without the block map), whose stages do not fit
    # (the register path's instead)
    assert len(sm90) - len(plain) == (len(dispatch.FWD_CHECK_VARIANTS) + len(dispatch.FWD_STAGED_CHECK_VARIANTS)) * 4
    staged = [L for L in sm90 if int(L.args[-1]) & dispatch.VAR_BIAS_STAGED]
    assert len(staged) == len(dispatch.FWD_STAGED_CHECK_VARIANTS) * 2 * 2 - 4
    assert all(L.smem_bytes <= 227 * 1024 for L in sm90)
    assert not [L for L in dispatch.all_fwd_launches((8, 0)) if L.source == "flash_fwd_sm90.cu"]


def test_variant_bits_are_variant_cuh_s():
    """dispatch's VAR_* bits against kernels_cu/variant.cuh's constants."""
    text = (kernels_dir() / "variant.cuh").read_text()
    found = dict(re.findall(r"constexpr int VAR_(\w+) = (\d+);", text))
    assert {name.lower(): int(v) for name, v in found.items()} == dispatch.VARIANT_BITS
    assert dispatch.variant_bits() == 0
    assert dispatch.variant_bits(window=True, sinks=True) == dispatch.VAR_WINDOW | dispatch.VAR_SINKS


@pytest.mark.parametrize("variant", [0, 1, 2, 4, 8, 16, 31])
def test_variant_is_the_last_template_argument_of_every_forward(variant):
    for cc in ((8, 0), (9, 0)):
        for seqlen_q in (1, 2048):  # split-KV (mma.sync), and the wgmma kernel on cc 9.0
            plan = dispatch.select_fwd(batch=1, seqlen_q=seqlen_q, seqlen_k=8192, nheads_q=8, head_dim=128,
                                       dtype="bfloat16", causal=True, vec=True, cc=cc, variant=variant)
            assert plan.main.args[-1] == str(variant)
            if plan.combine is not None:  # the combine kernel has no variant
                assert len(plan.combine.args) == 2


def test_lean_variants_take_the_lean_tiles():
    """Window, ALiBi and dropout take tiles with registers for their code (_FWD_LEAN_VARIANTS)."""
    kw = dict(batch=4, seqlen_q=4096, seqlen_k=4096, nheads_q=16, head_dim=128, dtype="bfloat16",
              causal=True, vec=True)
    plain = dispatch.select_fwd(**kw, cc=(8, 0))
    for bit in (dispatch.VAR_WINDOW, dispatch.VAR_ALIBI, dispatch.VAR_DROPOUT):
        lean = dispatch.select_fwd(**kw, cc=(8, 0), variant=bit)
        assert lean.main.args[2:5] == tuple(str(x) for x in dispatch._FWD_TILES_LEAN[128][1])
    for bit in (dispatch.VAR_SOFTCAP, dispatch.VAR_SINKS):
        assert dispatch.select_fwd(**kw, cc=(8, 0), variant=bit).main.args[2:5] == plain.main.args[2:5]
    # wgmma: (BLOCK_N, CTAS_PER_SM)
    assert dispatch.fwd_sm90_tile(64, True, dispatch.VAR_ALIBI) == (64, 1)
    assert dispatch.fwd_sm90_tile(128, True, dispatch.VAR_DROPOUT) == (128, 1)
    assert dispatch.fwd_sm90_tile(64, False, dispatch.VAR_WINDOW) == dispatch.fwd_sm90_tile(64, False)


def test_decode_shape_splits_keys_and_covers_them_all():
    plan = dispatch.select_fwd(batch=1, seqlen_q=1, seqlen_k=8192, nheads_q=8, head_dim=128,
                               dtype="bfloat16", causal=False, vec=True, num_sms=132)
    block_n = dispatch.fwd_tiles(128, True, False)[1]
    n_blocks = math.ceil(8192 / block_n)
    assert plan.num_splits > 1
    assert plan.num_splits * plan.n_blocks_per_split >= n_blocks
    assert (plan.num_splits - 1) * plan.n_blocks_per_split < n_blocks  # no empty trailing split
    assert plan.combine is not None and plan.main.grid[1] == plan.num_splits
    assert plan.main.args[0] == "__nv_bfloat16" and plan.main.args[-2:] == ("true", "0")  # IS_SPLIT, VARIANT


def test_uneven_head_dim_and_unaligned_data_pick_predicated_variants():
    plan = dispatch.select_fwd(batch=2, seqlen_q=100, seqlen_k=100, nheads_q=4, head_dim=59,
                               dtype="float16", causal=False, vec=False)
    # <T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, IS_CAUSAL, EVEN_K, VEC, IS_SPLIT>
    assert plan.main.args[1] == "64" and plan.main.args[6] == "false" and plan.main.args[7] == "false"


def test_select_fwd_rejects_old_gpus_and_unknown_dtypes():
    with pytest.raises(NotImplementedError, match="compute capability 8.0"):
        dispatch.select_fwd(batch=1, seqlen_q=1, seqlen_k=1, nheads_q=1, head_dim=64, dtype="float16",
                            causal=False, vec=True, cc=(7, 5))
    with pytest.raises(ValueError, match="dtype"):
        dispatch.select_fwd(batch=1, seqlen_q=1, seqlen_k=1, nheads_q=1, head_dim=64, dtype="float32",
                            causal=False, vec=True)


def test_every_tile_fits_shared_memory_and_divides_its_warps():
    for launch in dispatch.all_fwd_launches():
        if launch.template.endswith("flash_fwd_kernel"):
            _, d, block_m, block_n, warps = launch.args[:5]
            assert int(block_m) % (16 * int(warps)) == 0
            assert int(block_n) % 16 == 0
            assert launch.smem_bytes <= 163 * 1024  # sm_80's opt-in limit (sm_90: 227 KB)


def test_name_expression_is_the_template_with_its_arguments():
    launch = dispatch.fwd_launch("float16", 64, True, True, True, False)
    assert launch.name_expression.startswith("cupyflash::flash_fwd_kernel<__half, 64, ")
    assert launch.name_expression.endswith(", true, true, true, false, 0>")


def test_fwd_params_mirror_layout():
    dt = _params.FWD_PARAMS
    offsets = [dt.fields[n][1] for n in dt.names]
    assert offsets == sorted(offsets)
    # 10 pointers + 14 int64 strides, then 9 int32 and 2 float32, padded to 8 bytes; then var.
    assert dt.fields["cu_seqlens_q"][1] == 7 * 8 and dt.fields["cu_seqlens_k"][1] == 8 * 8
    assert dt.fields["seqused_k"][1] == 9 * 8
    assert dt.fields["lse_head_stride"][1] == 10 * 8 + 13 * 8
    assert dt.fields["batch"][1] == 10 * 8 + 14 * 8
    assert dt.fields["var"][1] == 240 and dt.itemsize == 240 + _params.VARIANT_PARAMS.itemsize
    assert f"-DCUPYFLASH_FWD_PARAMS_BYTES={dt.itemsize}" in _params.size_defines()


def test_d64_forward_takes_64_key_tiles_on_the_mma_sync_kernel():
    """The 128x128 tile spills since the variant policy (NVRTC 13.0): 128x64 everywhere."""
    kw = dict(batch=4, seqlen_q=4096, seqlen_k=4096, nheads_q=32, head_dim=64, dtype="float16",
              causal=False, vec=True)
    assert dispatch.select_fwd(**kw, cc=(12, 0)).main.args[3] == "64"  # mma.sync kernel, cc >= 9.0
    assert dispatch.select_fwd(**kw, cc=(8, 0)).main.args[3] == "64"


def test_split_kv_takes_the_roomier_tile():
    plan = dispatch.select_fwd(batch=1, seqlen_q=1, seqlen_k=65536, nheads_q=8, head_dim=64,
                               dtype="float16", causal=False, vec=True)
    assert plan.num_splits > 1 and plan.main.args[3] == "64"  # BLOCK_N of the causal column
    assert plan.num_splits * plan.n_blocks_per_split >= 65536 // 64


def test_bwd_tile_exclusions_are_honoured(monkeypatch):
    kw = dict(batch=2, seqlen_q=1024, seqlen_k=1024, nheads_q=16, nheads_kv=16, head_dim=128,
              dtype="float16", deterministic=False, vec=True, cc=(8, 0))  # the mma.sync kernel's tiles

    def dkdv_tile(plan):
        dkdv = next(L for L in plan.launches if "dkdv" in L.template)
        return tuple(int(x) for x in dkdv.args[2:8])

    best = dkdv_tile(dispatch.select_bwd(causal=True, **kw))
    monkeypatch.setattr(dispatch, "_BWD_TILE_SPILLS", {(128, best, True, False, True)})
    assert dkdv_tile(dispatch.select_bwd(causal=True, **kw)) != best
    assert dkdv_tile(dispatch.select_bwd(causal=False, **kw)) == best
    assert dkdv_tile(dispatch.select_bwd(causal=True, **{**kw, "vec": False})) == best
    names = {L.name_expression for L in dispatch.all_bwd_launches((8, 0))}
    excluded = dispatch.bwd_dkdv_launch("float16", 128, best, True, True, True, False)
    assert excluded.name_expression not in names


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True])
def test_unaligned_atomic_backward_avoids_the_widest_tile(head_dim, deterministic):
    """The widest D=64/128 atomic-dQ tiles spill on unaligned data (D=64: on any data):
    those take the next tile."""
    def dkdv_tile(vec):
        plan = dispatch.select_bwd(batch=2, seqlen_q=1024, seqlen_k=1024, nheads_q=16, nheads_kv=16,
                                   head_dim=head_dim, dtype="float16", causal=True,
                                   deterministic=deterministic, vec=vec, cc=(8, 0))  # mma.sync tiles
        return tuple(int(x) for x in plan.launches[1].args[2:8])

    widest = dispatch._BWD_TILES[head_dim][0]
    assert (dkdv_tile(True) == widest) == (deterministic or head_dim == 128)
    assert (dkdv_tile(False) == widest) == deterministic


# ---------------------------------------------------------------------------
# Packed (varlen) batches: the same variants, grids over the longest sequence
# ---------------------------------------------------------------------------


def test_varlen_forward_never_splits_and_grids_over_the_longest_sequence():
    kw = dict(batch=1, seqlen_q=1, seqlen_k=65536, nheads_q=8, head_dim=128, dtype="float16",
              causal=False, vec=True, cc=(8, 0))
    assert dispatch.select_fwd(**kw).num_splits > 1  # the dense decode shape splits...
    plan = dispatch.select_fwd(**kw, varlen=True)    # ...a packed one never does
    assert plan.num_splits == 1 and plan.combine is None and plan.main.args[-2] == "false"  # IS_SPLIT
    kw["cc"] = (9, 0)  # Hopper: the wgmma kernel, which has no split-KV
    plan = dispatch.select_fwd(**kw, varlen=True)
    assert plan.num_splits == 1 and plan.main.template == "cupyflash::flash_fwd_sm90_kernel"
    plan = dispatch.select_fwd(**kw, varlen=True, ws=dispatch.FWD_WS_WINS)  # the TMA kernel at D=128
    assert plan.num_splits == 1 and plan.main.template == "cupyflash::flash_fwd_ws_kernel"
    plan = dispatch.select_fwd(batch=5, seqlen_q=300, seqlen_k=70, nheads_q=4, head_dim=64,
                               dtype="bfloat16", causal=True, vec=True, varlen=True, cc=(8, 0))
    block_m = dispatch.fwd_tiles(64, True, True, (8, 0))[0]
    assert plan.num_m_blocks == math.ceil(300 / block_m)
    assert plan.main.grid == (plan.num_m_blocks * 5 * 4, 1, 1)


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_varlen_plans_use_checked_variants(cc):
    every = {L.name_expression for L in dispatch.all_fwd_launches(cc) + dispatch.all_bwd_launches(cc)}
    for head_dim, causal, vec, deterministic, ws in itertools.product(
            (40, 64, 128, 256), (False, True), (False, True), (False, True), (False, True)):
        fwd = dispatch.select_fwd(batch=3, seqlen_q=500, seqlen_k=9000, nheads_q=8, head_dim=head_dim,
                                  dtype="float16", causal=causal, vec=vec, cc=cc, varlen=True, ws=ws)
        bwd = dispatch.select_bwd(batch=3, seqlen_q=500, seqlen_k=9000, nheads_q=8, nheads_kv=2,
                                  head_dim=head_dim, dtype="float16", causal=causal,
                                  deterministic=deterministic, vec=vec, cc=cc, varlen=True,
                                  total_q=700, total_k=9100)
        for launch in (fwd.main, *bwd.launches):
            assert launch.name_expression in every


def test_varlen_backward_row_kernels_cover_the_packed_rows():
    """The row-wise kernels see a packed batch as one sequence of total rows; the dK/dV and
    dQ grids cover the longest sequences of every batch entry."""
    kw = dict(batch=3, seqlen_q=500, seqlen_k=300, nheads_q=8, nheads_kv=2, head_dim=64,
              dtype="float16", causal=True, vec=True, num_sms=1000, cc=(8, 0))  # mma.sync tile arguments
    plan = dispatch.select_bwd(**kw, deterministic=False, varlen=True, total_q=701, total_k=350)
    pre, dkdv, convert, convert_dkv = plan.launches
    block_n = int(dkdv.args[3])
    assert pre.grid == (math.ceil(701 * 8 / dispatch.bwd_preprocess_rows(64)), 1, 1)
    assert dkdv.grid == (math.ceil(300 / block_n) * 3 * 2 * plan.kv_splits, 1, 1)
    assert convert.grid == (math.ceil(701 * 8 / 8), 1, 1)  # one warp per row, 8 per block
    assert plan.kv_splits > 1 and convert_dkv.grid == (math.ceil(350 * 2 / 8), 1, 1)
    det = dispatch.select_bwd(**kw, deterministic=True, varlen=True, total_q=701, total_k=350)
    dq = det.launches[2]
    assert dq.grid == (math.ceil(500 / int(dq.args[2])) * 3 * 8, 1, 1)
    # a dense batch of the same lengths: rows per (batch, head)
    dense = dispatch.select_bwd(**kw, deterministic=False)
    assert dense.launches[0].grid == (math.ceil(3 * 500 * 8 / dispatch.bwd_preprocess_rows(64)), 1, 1)
    assert dense.launches[2].grid == (math.ceil(3 * 500 * 8 / 8), 1, 1)


def test_varlen_backward_needs_the_packed_row_counts():
    kw = dict(batch=3, seqlen_q=500, seqlen_k=300, nheads_q=8, nheads_kv=2, head_dim=64,
              dtype="float16", causal=True, deterministic=False, vec=True, varlen=True)
    with pytest.raises(ValueError, match="a packed batch needs total_q and total_k >= 1; got 0 and 5"):
        dispatch.select_bwd(**kw, total_k=5)


def test_seq_strides_of_dense_and_packed_tensors():
    import numpy as np

    from cupyflash import _gpu

    dense = np.zeros((2, 5, 3, 8), np.float16)
    packed = np.zeros((7, 3, 10), np.float16)[..., 1:9]
    assert _gpu.seq_strides(dense) == (5 * 3 * 8, 3 * 8, 8)
    assert _gpu.seq_strides(packed) == (0, 30, 10)
    assert _gpu.lse_strides(np.zeros((2, 3, 5), np.float32)) == (15, 5)
    assert _gpu.lse_strides(np.zeros((3, 11), np.float32)[:, :7]) == (0, 11)


# ----------------------------------------------------------------------------
# Decode (kernels_cu/flash_decode.cu)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("rows,warps", [(1, (1, 4)), (16, (1, 4)), (17, (2, 2)), (32, (2, 2)), (33, (4, 1)),
                                        (2048, (4, 1))])
def test_decode_warps_follow_the_packed_rows(rows, warps):
    assert dispatch.decode_warps(rows) == warps


def test_decode_packs_gqa_heads_into_rows():
    # 32 query heads on 8 KV heads, one query: 4 packed rows, one row block per KV head
    plan = dispatch.select_decode(batch=1, seqlen_q=1, nheads_q=32, nheads_kv=8, head_dim=128,
                                  max_seqlen_k=32768, dtype="bfloat16", causal=False, paged=False, vec=True)
    assert plan.main.args[3:5] == ("1", "4") and plan.num_m_blocks == 1 and plan.block_m == 16
    # grid: (row blocks x splits, KV heads, batch)
    assert plan.main.grid == (plan.num_splits, 8, 1)
    # 8 blocks alone would leave 124 SMs idle: split until every SM streams keys
    # with two blocks, evenly (no SM with a block more than another)
    assert 256 <= 8 * plan.num_splits <= 264 and plan.combine is not None
    assert plan.combine.grid == (32, 1, 1)


def test_decode_large_batch_does_not_split():
    plan = dispatch.select_decode(batch=64, seqlen_q=1, nheads_q=32, nheads_kv=8, head_dim=128,
                                  max_seqlen_k=8192, dtype="float16", causal=False, paged=True, vec=True)
    assert plan.num_splits == 1 and plan.combine is None and plan.main.grid == (1, 8, 64)


def test_decode_splits_keep_two_tiles_each_and_respect_requests():
    short = dispatch.select_decode(batch=1, seqlen_q=1, nheads_q=8, nheads_kv=8, head_dim=64,
                                   max_seqlen_k=640, dtype="float16", causal=False, paged=False, vec=True)
    assert short.num_splits == 640 // 64  # latency bound: one tile per block
    tiny = dispatch.select_decode(batch=1, seqlen_q=1, nheads_q=8, nheads_kv=8, head_dim=64,
                                  max_seqlen_k=100, dtype="float16", causal=False, paged=False, vec=True)
    assert tiny.num_splits == 1
    for asked, got in ((1, 1), (5, 5), (10_000, dispatch.DECODE_MAX_SPLITS)):
        plan = dispatch.select_decode(batch=1, seqlen_q=1, nheads_q=8, nheads_kv=8, head_dim=64,
                                      max_seqlen_k=1 << 20, dtype="float16", causal=False, paged=False,
                                      vec=True, num_splits=asked)
        assert plan.num_splits == got
    few_tiles = dispatch.select_decode(batch=1, seqlen_q=1, nheads_q=8, nheads_kv=8, head_dim=64,
                                       max_seqlen_k=130, dtype="float16", causal=False, paged=False,
                                       vec=True, num_splits=50)
    assert few_tiles.num_splits == 3  # no more splits than key tiles


def test_decode_splits_keep_the_sms_even():
    # 8 blocks of 2048 tiles: 33 splits (264 blocks, two per SM), never 18 or 36
    # (144 blocks: 12 SMs with two took 202 us where 128 blocks took 157 on the H200)
    assert dispatch.decode_num_splits(8, 2048, 132) == 33
    assert dispatch.decode_num_splits(64, 2048, 132) == 4
    assert dispatch.decode_num_splits(512, 128, 132) == 1


@pytest.mark.parametrize("blocks,n_tiles", [(8, 2048), (8, 128), (64, 512), (1, 16), (300, 40)])
def test_decode_num_splits_is_the_cheapest_by_the_model(blocks, n_tiles):
    over = dispatch.DECODE_BLOCK_OVERHEAD_TILES

    def cost(s):
        slots = 132 * dispatch.DECODE_BLOCKS_PER_SM
        return math.ceil(blocks * s / slots) * (math.ceil(n_tiles / s) + over) + (over if s > 1 else 0)

    got = dispatch.decode_num_splits(blocks, n_tiles, 132)
    assert all(cost(got) <= cost(s) for s in range(1, min(n_tiles, 128) + 1))
    assert all(cost(got) < cost(s) for s in range(1, got))  # the fewest splits on a tie


def test_decode_chunked_prefill_splits_rows():
    plan = dispatch.select_decode(batch=1, seqlen_q=512, nheads_q=32, nheads_kv=8, head_dim=128,
                                  max_seqlen_k=32768, dtype="bfloat16", causal=True, paged=False, vec=True)
    assert plan.main.args[3:5] == ("4", "1") and plan.block_m == 64
    assert plan.num_m_blocks == 512 * 4 // 64


@pytest.mark.parametrize("d", dispatch.HEAD_DIMS)
def test_decode_smem_fits_and_two_blocks_share_an_sm_up_to_128(d):
    for warps, cc in itertools.product(((1, 4), (2, 2), (4, 1)), ((8, 0), (8, 6), (9, 0))):
        launch = dispatch.decode_launch("float16", d, warps, False, False, True, cc=cc)
        assert launch.smem_bytes <= dispatch.max_smem_per_block(cc)
        block_n, w_n = int(launch.args[2]), int(launch.args[4])
        assert block_n // w_n >= 16  # every warp takes whole k16 steps
        if cc == (9, 0):
            assert launch.args[2:6] == (str(dispatch._DECODE_TILES[d][0]), *map(str, warps),
                                        str(dispatch._DECODE_TILES[d][1]))
        if cc == (9, 0) and d <= 128 and warps == (1, 4):
            assert 2 * (launch.smem_bytes + 1024) <= dispatch.smem_per_sm((9, 0))
    # the epilogue's warp merge reuses the ring (DecodeTraits static_assert)
    block_n, stages = dispatch._DECODE_TILES[d]
    merge = 4 * 16 * 4 + 3 * 16 * (d + 8) * 4
    assert merge <= stages * 2 * dispatch._smem_tile_bytes(block_n, d)


def test_decode_empty_query_still_launches_one_block_to_append():
    plan = dispatch.select_decode(batch=2, seqlen_q=0, nheads_q=4, nheads_kv=2, head_dim=64,
                                  max_seqlen_k=4096, dtype="float16", causal=True, paged=False, vec=True)
    assert plan.num_m_blocks == 1 and plan.num_splits == 1 and plan.combine is None


def test_all_decode_launches_cover_select_decode():
    every = {L.name_expression for L in dispatch.all_decode_launches()}
    for rows, d, causal, paged, vec in itertools.product((1, 20, 100), dispatch.HEAD_DIMS, (False, True),
                                                         (False, True), (False, True)):
        plan = dispatch.select_decode(batch=1, seqlen_q=rows, nheads_q=1, nheads_kv=1, head_dim=d,
                                      max_seqlen_k=50_000, dtype="bfloat16", causal=causal, paged=paged, vec=vec)
        assert plan.main.name_expression in every
        assert plan.combine is None or plan.combine.name_expression in every


def test_decode_long_dense_chunks_take_the_dense_forward():
    n = dispatch.DECODE_DENSE_MIN_SEQLEN_Q
    kw = dict(head_dim=128, paged=False, cache_batch_idx=False, vec=True, cc=(9, 0))
    assert dispatch.decode_uses_dense_fwd(seqlen_q=n, **kw)
    assert not dispatch.decode_uses_dense_fwd(seqlen_q=n - 1, **kw)
    assert not dispatch.decode_uses_dense_fwd(seqlen_q=n, **dict(kw, paged=True))
    assert not dispatch.decode_uses_dense_fwd(seqlen_q=n, **dict(kw, cache_batch_idx=True))
    assert not dispatch.decode_uses_dense_fwd(seqlen_q=n, **dict(kw, cc=(8, 0)))  # no wgmma
    assert not dispatch.decode_uses_dense_fwd(seqlen_q=n, **dict(kw, vec=False))


def test_stride_fields_name_every_axis_in_elements_and_zero_an_absent_array():
    from cupyflash import _launch

    dense = _launch.Contiguous((2, 5, 4, 8), 2)         # (batch, seqlen, nheads, head_dim)
    packed = _launch.Contiguous((9, 4, 8), 2)           # (total, nheads, head_dim): batch stride 0
    fields = _launch.stride_fields(q=dense, k=packed, knew=None)
    assert fields == {"q_batch_stride": 160, "q_row_stride": 32, "q_head_stride": 8,
                      "k_batch_stride": 0, "k_row_stride": 32, "k_head_stride": 8,
                      "knew_batch_stride": 0, "knew_row_stride": 0, "knew_head_stride": 0}
    # the params structs' stride fields are exactly what the plans fill
    for struct, names in ((_params.FWD_PARAMS, ("q", "k", "v", "o")),
                          (_params.BWD_PARAMS, ("q", "k", "v", "o", "do", "dq", "dk", "dv")),
                          (_params.DECODE_PARAMS, ("q", "k", "v", "knew", "vnew", "o"))):
        made = set(_launch.stride_fields(**dict.fromkeys(names, dense)))
        assert made == {n for n in struct.names if n.endswith("_stride") and not n.startswith(("lse", "block"))}


def test_decode_visible_tiles_bound_a_window():
    assert dispatch.decode_visible_tiles(131072, 1, 64) == 2048  # no window: every tile of the cache
    assert dispatch.decode_visible_tiles(131072, 1, 64, 4095) == 65  # 4096 keys, anywhere in a tile
    assert dispatch.decode_visible_tiles(131072, 4, 64, 0) == 2
    assert dispatch.decode_visible_tiles(100, 1, 64, 10_000) == 2  # never more than the cache's
    assert dispatch.decode_visible_tiles(0, 0, 64, 0) == 1


@pytest.mark.parametrize("left", [0, 63, 64, 1000, 4095])
@pytest.mark.parametrize("seqlen_q,block_n", [(1, 64), (4, 64), (7, 32), (300, 64)])
def test_decode_visible_tiles_cover_every_blocks_rows(left, seqlen_q, block_n):
    """No block of packed rows sees keys of more tiles than decode_visible_tiles, at any length
    (the kernel's range: tiles of keys [i + off - left, i + off + right] over its rows)."""
    for seqlen_k in (seqlen_q, seqlen_q + 5, 1000, 5000):
        off = seqlen_k - seqlen_q
        for first, last in ((0, seqlen_q - 1), (seqlen_q // 2, seqlen_q - 1), (0, 0)):
            begin = max(0, first + off - left)
            end = seqlen_k  # right unbounded: the most keys
            tiles = -(-end // block_n) - begin // block_n
            assert tiles <= dispatch.decode_visible_tiles(seqlen_k, seqlen_q, block_n, left)


def test_decode_window_splits_share_the_visible_tiles():
    kw = dict(batch=1, seqlen_q=1, nheads_q=32, nheads_kv=8, head_dim=128, max_seqlen_k=131072, dtype="bfloat16",
              causal=True, paged=True, vec=True)
    plain = dispatch.select_decode(**kw)
    window = dispatch.select_decode(**kw, variant=dispatch.VAR_WINDOW, window_left=4095)
    assert window.main.args[-1] == str(dispatch.VAR_WINDOW) and plain.main.args[-1] == "0"
    assert window.num_splits == dispatch.decode_num_splits(8, 65, 132) <= 65  # each split 1-2 tiles of the window
    asked = dispatch.select_decode(**kw, variant=dispatch.VAR_WINDOW, window_left=4095, num_splits=128)
    assert asked.num_splits == 65  # no more splits than visible tiles
    every = {L.name_expression for L in dispatch.all_decode_launches()}
    for bit in (dispatch.VAR_WINDOW, dispatch.VAR_SOFTCAP, dispatch.VAR_ALIBI, dispatch.VAR_SINKS):
        for rows in (1, 20, 100):
            plan = dispatch.select_decode(**dict(kw, seqlen_q=rows, nheads_q=8), variant=bit)
            assert plan.main.name_expression in every


def test_bias_and_mask_forwards_are_listed_for_check_kernels():
    """Each of the bias (element, fp32), the mask, their strided reads and the combinations
    users run, on both forward kernels (sm90: wgmma; every cc: mma.sync, split or not)."""
    want = {dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK,
            dispatch.VAR_BIAS | dispatch.VAR_BIAS_STRIDED, dispatch.VAR_BIAS_FP32 | dispatch.VAR_BIAS_STRIDED,
            dispatch.VAR_MASK | dispatch.VAR_BIAS_STRIDED, dispatch.VAR_BIAS | dispatch.VAR_MASK,
            dispatch.VAR_BIAS | dispatch.VAR_SOFTCAP, dispatch.VAR_BIAS | dispatch.VAR_WINDOW}
    assert want <= set(dispatch.FWD_CHECK_VARIANTS)
    assert dispatch.VAR_BIAS_STRIDED not in dispatch.FWD_CHECK_VARIANTS  # meaningless alone
    for cc in ((8, 0), (9, 0)):
        launches = dispatch.all_fwd_launches(cc)
        for bit in want:
            mma = {(L.args[1], L.args[5], L.args[8]) for L in launches
                   if L.source == "flash_fwd.cu" and L.args[-1] == str(bit) and "combine" not in L.template}
            assert mma == {(str(d), c, s) for d in dispatch.HEAD_DIMS for c in ("false", "true")
                           for s in ("false", "true")}
            sm90 = {(L.args[1], L.args[4]) for L in launches
                    if L.source == "flash_fwd_sm90.cu" and L.args[-1] == str(bit)}
            assert sm90 == ({(d, c) for d in ("64", "128") for c in ("false", "true")} if cc == (9, 0) else set())
            # what select_fwd returns is what is listed
            for d, causal, seqlen_q in itertools.product((64, 96, 128, 256), (False, True), (1, 4096)):
                plan = dispatch.select_fwd(batch=2, seqlen_q=seqlen_q, seqlen_k=4096, nheads_q=8, head_dim=d,
                                           dtype="bfloat16", causal=causal, vec=True, cc=cc, variant=bit)
                assert plan.main.name_expression in {L.name_expression for L in launches}


@pytest.mark.parametrize("bit", [dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK,
                                 dispatch.VAR_MASK | dispatch.VAR_BIAS_STRIDED])
def test_bias_and_mask_take_their_tiles(bit):
    """A bias or mask is held a key block ahead in registers: halved key tiles where the
    default ones spill (_FWD_TILES_BIAS); on the wgmma kernel one block per SM, 64-key
    tiles at D=128."""
    kw = dict(batch=4, seqlen_q=4096, seqlen_k=4096, nheads_q=16, dtype="bfloat16", causal=True, vec=True)
    for d, tile in dispatch._FWD_TILES_BIAS.items():
        plan = dispatch.select_fwd(**kw, head_dim=d, cc=(8, 0), variant=bit)
        assert plan.main.args[2:5] == tuple(map(str, tile))
    assert dispatch.select_fwd(**kw, head_dim=96, cc=(8, 0), variant=bit).main.args[2:5] == \
        dispatch.select_fwd(**kw, head_dim=96, cc=(8, 0)).main.args[2:5]
    assert dispatch.fwd_sm90_tile(128, True, bit) == (64, 1)
    assert dispatch.fwd_sm90_tile(64, True, bit) == (64, 1)
    assert dispatch.fwd_sm90_tile(64, False, bit) == (64, 1)
    assert dispatch.fwd_sm90_tile(64, True, bit | dispatch.VAR_ALIBI) == (64, 1)
    # window, ALiBi, dropout keep their lean tiles with a bias too
    lean = dispatch.select_fwd(**kw, head_dim=128, cc=(8, 0), variant=bit | dispatch.VAR_WINDOW)
    assert lean.main.args[2:5] == tuple(map(str, dispatch._FWD_TILES_LEAN[128][1]))


def test_score_pairs_need_unit_column_stride_even_strides_and_an_aligned_pointer():
    ok = dispatch.score_pairs_ok
    assert ok((0, 0, 1024, 1), 2, 256)
    assert ok((0, 0, 0, 1), 4, 8)                     # one row for every query row
    assert not ok((0, 0, 1, 1024), 2, 256)            # transposed
    assert not ok((0, 0, 1023, 1), 2, 256)            # odd row stride: odd rows start misaligned
    assert not ok((1023 * 1024 + 1, 0, 1024, 1), 1, 256)  # odd batch stride
    assert not ok((0, 1025, 1024, 1), 2, 256)          # odd head stride
    assert not ok((0, 0, 1024, 1), 2, 258)             # the pointer one element off
    assert not ok((0, 0, 1024, 0), 2, 256)             # broadcast columns
    assert ok((0, 0, 1024, 1), 1, 2) and not ok((0, 0, 1024, 1), 1, 1)  # a mask: 2-byte pairs


def test_strided_bit_needs_a_bias_or_mask_and_decode_reads_elements():
    assert dispatch.variant_bits(bias="element", strided=True) == dispatch.VAR_BIAS | dispatch.VAR_BIAS_STRIDED
    assert dispatch.variant_bits(mask=True, strided=True) == dispatch.VAR_MASK | dispatch.VAR_BIAS_STRIDED
    with pytest.raises(ValueError, match="strided"):
        dispatch.variant_bits(strided=True)
    kw = dict(batch=1, seqlen_q=1, nheads_q=8, nheads_kv=8, head_dim=128, max_seqlen_k=4096, dtype="bfloat16",
              causal=True, paged=False, vec=True)
    # the decode kernel takes the bias and mask (issue 14), read element by element: no qualifier bits
    for bit in (dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK):
        assert dispatch.select_decode(**kw, variant=bit).main.args[-1] == str(bit)
    for bit in (dispatch.VAR_BIAS_STRIDED, dispatch.VAR_BIAS_STAGED, dispatch.VAR_BLOCK_MAP, dispatch.VAR_DROPOUT):
        with pytest.raises(ValueError, match="decode kernel takes no dropout"):
            dispatch.select_decode(**kw, variant=dispatch.VAR_MASK | dispatch.VAR_BIAS | bit)
    listed = {int(L.args[-1]) for L in dispatch.all_decode_launches() if L.template.endswith("decode_kernel")}
    assert not any(v & (dispatch.VAR_DROPOUT | dispatch.VAR_BIAS_STRIDED | dispatch.VAR_BIAS_STAGED
                        | dispatch.VAR_BLOCK_MAP) for v in listed)
    assert {dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK} <= listed


def test_decode_bias_and_mask_plans_are_listed_for_check_kernels():
    every = {L.name_expression for L in dispatch.all_decode_launches()}
    kw = dict(batch=1, nheads_q=1, nheads_kv=1, max_seqlen_k=4096, dtype="bfloat16", vec=True)
    bits = (dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK)
    for bit, d, rows, causal, paged in itertools.product(bits, dispatch.HEAD_DIMS, (1, 20, 100), (False, True),
                                                         (False, True)):
        plan = dispatch.select_decode(**kw, head_dim=d, seqlen_q=rows, causal=causal, paged=paged, variant=bit)
        assert plan.main.name_expression in every


def test_decode_bias_on_a_paged_cache_at_256_takes_two_row_warps():
    """The (4, 1) grid spills there with a bias or mask (_DECODE_BIAS_TWO_ROW_WARPS); not
    on a dense cache, nor without them, nor at other head dims."""
    kw = dict(batch=1, seqlen_q=100, nheads_q=1, nheads_kv=1, max_seqlen_k=4096, dtype="bfloat16", causal=True,
              vec=True)
    warps = lambda plan: tuple(int(x) for x in plan.main.args[3:5])  # noqa: E731
    for bit in (dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK, dispatch.VAR_BIAS | dispatch.VAR_MASK):
        plan = dispatch.select_decode(**kw, head_dim=256, paged=True, variant=bit)
        assert warps(plan) == (2, 2) and plan.block_m == 32 and plan.num_m_blocks == 4
        assert warps(dispatch.select_decode(**kw, head_dim=256, paged=False, variant=bit)) == (4, 1)
        assert warps(dispatch.select_decode(**kw, head_dim=192, paged=True, variant=bit)) == (4, 1)
    assert warps(dispatch.select_decode(**kw, head_dim=256, paged=True)) == (4, 1)


def test_score_vec_needs_unit_column_stride_and_16_byte_rows():
    ok = dispatch.score_vec_ok
    assert ok((0, 0, 1024, 1), 2, 256) and ok((0, 0, 16, 1), 1, 16) and ok((0, 0, 4, 1), 4, 16)
    assert ok((0, 0, 0, 1), 2, 256)                   # one row for every query row
    assert ok((208, 0, 0, 1), 2, 512)                 # (B, 1, 1, 208) bf16: 416-byte batch stride
    assert not ok((0, 0, 1002, 1), 2, 256)            # pairs aligned, rows not (2004 bytes)
    assert dispatch.score_pairs_ok((0, 0, 1002, 1), 2, 256)
    assert not ok((0, 0, 1000, 1), 1, 256)            # a mask of 1000 keys: rows 8 bytes off
    assert not ok((1000, 0, 0, 1), 1, 256)            # ... or its (B, 1, 1, N) batches
    assert not ok((0, 1004, 1024, 1), 2, 256)         # head stride
    assert not ok((0, 0, 1024, 1), 2, 260)            # the pointer
    assert not ok((0, 0, 1024, 2), 2, 256)            # column stride


def test_staged_bias_keeps_two_blocks_per_sm_where_its_stages_fit():
    """VAR_BIAS_STAGED on the wgmma kernel: D=64 keeps its two blocks per SM with a bf16
    bias or a mask alone (both blocks' stages in the SM's 228 KB), one block with an fp32
    bias or both arrays; D=128 64-key tiles; the fp32 bias with a mask at D=128 does not
    fit and is read into registers; the mma.sync kernel drops the bit."""
    S, B, F, M = dispatch.VAR_BIAS_STAGED, dispatch.VAR_BIAS, dispatch.VAR_BIAS_FP32, dispatch.VAR_MASK
    for causal in (False, True):
        assert dispatch.fwd_sm90_tile(64, causal, S | B) == (64, 2)
        assert dispatch.fwd_sm90_tile(64, causal, S | M) == (64, 2)
        assert dispatch.fwd_sm90_tile(64, causal, S | F) == (64, 1)
        assert dispatch.fwd_sm90_tile(64, causal, S | B | M) == (64, 1)
        assert dispatch.fwd_sm90_tile(64, causal, S | B | dispatch.VAR_ALIBI) == (64, 1)
        assert dispatch.fwd_sm90_tile(64, causal, S | B | dispatch.VAR_WINDOW) == (64, 2)
        for bits in (B, F, M, B | M, F | M):
            assert dispatch.fwd_sm90_tile(128, causal, S | bits) == (64, 1)
    # the stages' bytes: 3 x 128 x 64 x (2 | 4 | 1 | 3), beside Q and the K/V ring
    base = dispatch.fwd_sm90_smem_bytes(64, 64)
    assert base == 2 * 64 * (128 + 6 * 64) + 1024
    for bits, per in ((B, 2), (F, 4), (M, 1), (B | M, 3), (F | M, 5)):
        assert dispatch.fwd_sm90_smem_bytes(64, 64, S | bits) - base == 3 * 128 * 64 * per
        assert dispatch.fwd_sm90_smem_bytes(64, 64, bits) == base  # not staged: no stages
    two = dispatch.fwd_sm90_smem_bytes(64, 64, S | B)
    assert 2 * (two + 1024) == dispatch.smem_per_sm((9, 0))  # exactly two blocks
    assert dispatch.fwd_variant(128, S | F | M, sm90=True) == F | M
    assert dispatch.fwd_variant(128, S | B | M, sm90=True) == S | B | M
    assert dispatch.fwd_variant(64, S | B, sm90=False) == B
    kw = dict(batch=4, seqlen_q=4096, seqlen_k=4096, nheads_q=32, head_dim=64, dtype="bfloat16", causal=False,
              vec=True)
    plan = dispatch.select_fwd(**kw, variant=S | B)
    assert plan.main.source == "flash_fwd_sm90.cu" and plan.main.args[-1] == str(S | B)
    assert plan.main.args[2:4] == ("64", "2") and plan.main.smem_bytes == two
    plan = dispatch.select_fwd(**kw, cc=(8, 0), variant=S | B)
    assert plan.main.args[-1] == str(B)
    plan = dispatch.select_fwd(**{**kw, "head_dim": 128}, variant=S | F | M)
    assert plan.main.args[-1] == str(F | M) and plan.main.smem_bytes == dispatch.fwd_sm90_smem_bytes(128, 64)
    launches = {L.name_expression for L in dispatch.all_fwd_launches((9, 0))}
    for bits in dispatch.FWD_STAGED_CHECK_VARIANTS:
        for d, causal in itertools.product((64, 128), (False, True)):
            got = dispatch.select_fwd(**{**kw, "head_dim": d, "causal": causal}, variant=bits)
            assert got.main.name_expression in launches


def test_staged_needs_a_bias_or_mask_and_not_strided():
    assert dispatch.variant_bits(bias="element", staged=True) == dispatch.VAR_BIAS | dispatch.VAR_BIAS_STAGED
    with pytest.raises(ValueError, match="need a bias or a mask"):
        dispatch.variant_bits(staged=True)
    with pytest.raises(ValueError, match="not staged"):
        dispatch.variant_bits(mask=True, strided=True, staged=True)


_FWD_SHAPE = dict(batch=2, seqlen_q=1024, seqlen_k=1024, nheads_q=8, head_dim=64, dtype="float16",
                  causal=False, vec=True)


@pytest.mark.parametrize("name", ["batch", "seqlen_q", "nheads_q"])
@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_planners_refuse_an_empty_problem_by_name(name, cc):
    """Found by QA: select_fwd with batch, seqlen_q or nheads_q 0 died in a ZeroDivisionError
    (num_splits_heuristic), select_bwd returned zero-sized grids, and select_decode with
    nheads_kv 0 divided by zero. The API never plans an empty problem (it returns the
    empty results itself); a direct call now says what is wrong."""
    with pytest.raises(ValueError, match=f"select_fwd plans a launch and needs {name} >= 1 .*; got 0"):
        dispatch.select_fwd(**{**_FWD_SHAPE, name: 0}, cc=cc)
    with pytest.raises(ValueError, match=f"select_bwd plans a launch and needs {name} >= 1 .*; got 0"):
        dispatch.select_bwd(**{**_FWD_SHAPE, name: 0}, nheads_kv=2, deterministic=False, cc=cc)


def test_planners_refuse_kv_heads_that_do_not_divide():
    with pytest.raises(ValueError, match=r"select_bwd needs nheads_kv dividing nheads_q \(8\); got 3"):
        dispatch.select_bwd(**_FWD_SHAPE, nheads_kv=3, deterministic=False)
    decode = dict(batch=2, seqlen_q=1, nheads_q=8, head_dim=64, max_seqlen_k=1000, dtype="float16",
                  causal=False, paged=False, vec=True)
    with pytest.raises(ValueError, match="select_decode plans a launch and needs nheads_kv >= 1 .*; got 0"):
        dispatch.select_decode(**decode, nheads_kv=0)
    with pytest.raises(ValueError, match=r"select_decode needs nheads_kv dividing nheads_q \(8\); got 3"):
        dispatch.select_decode(**decode, nheads_kv=3)
    assert dispatch.select_decode(**{**decode, "seqlen_q": 0}, nheads_kv=2).num_m_blocks == 1  # appends


def test_padded_head_dim_rejects_below_1():
    with pytest.raises(ValueError, match="head_dim must be at least 1; got 0"):
        dispatch.padded_head_dim(0)
