"""Kernel selection and the params mirror: pure, no GPU needed."""

from __future__ import annotations

import math

import pytest

from cupyflash import _params, dispatch


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
    if cc == (9, 0):  # the wgmma kernel: <T, HEAD_DIM, BLOCK_N, CTAS_PER_SM, IS_CAUSAL, EVEN_K>
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
    assert len(sm90) == 2 * 2 * 2 * 2  # dtype x head_dim (64, 128) x causal x even_k
    assert all(L.smem_bytes <= 227 * 1024 for L in sm90)
    assert not [L for L in dispatch.all_fwd_launches((8, 0)) if L.source == "flash_fwd_sm90.cu"]


def test_decode_shape_splits_keys_and_covers_them_all():
    plan = dispatch.select_fwd(batch=1, seqlen_q=1, seqlen_k=8192, nheads_q=8, head_dim=128,
                               dtype="bfloat16", causal=False, vec=True, num_sms=132)
    block_n = dispatch.fwd_tiles(128, True, False)[1]
    n_blocks = math.ceil(8192 / block_n)
    assert plan.num_splits > 1
    assert plan.num_splits * plan.n_blocks_per_split >= n_blocks
    assert (plan.num_splits - 1) * plan.n_blocks_per_split < n_blocks  # no empty trailing split
    assert plan.combine is not None and plan.main.grid[1] == plan.num_splits
    assert plan.main.args[0] == "__nv_bfloat16" and plan.main.args[-1] == "true"


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
    assert launch.name_expression.endswith(", true, true, true, false>")


def test_fwd_params_mirror_layout():
    dt = _params.FWD_PARAMS
    offsets = [dt.fields[n][1] for n in dt.names]
    assert offsets == sorted(offsets)
    # 7 pointers + 12 int64 strides, then 9 int32 and 2 float32, padded to 8 bytes.
    assert dt.fields["batch"][1] == 7 * 8 + 12 * 8
    assert dt.itemsize == 200
    assert f"-DCUPYFLASH_FWD_PARAMS_BYTES={dt.itemsize}" in _params.size_defines()


def test_struct_packer_matches_numpy_layout():
    import numpy as np

    from cupyflash import _gpu

    packer = _gpu._struct_packer(_params.FWD_PARAMS)
    assert packer.size == _params.FWD_PARAMS.itemsize
    values = list(range(1, 20)) + list(range(100, 109)) + [0.5, 0.25]
    rec = np.frombuffer(packer.pack(*values), dtype=_params.FWD_PARAMS)[0]
    assert rec["q"] == 1 and rec["o_head_stride"] == 19 and rec["batch"] == 100
    assert rec["n_blocks_per_split"] == 108 and rec["softmax_scale_log2"] == 0.25


def test_sm80_keeps_the_narrower_d64_tile():
    kw = dict(batch=4, seqlen_q=4096, seqlen_k=4096, nheads_q=32, head_dim=64, dtype="float16",
              causal=False, vec=True)
    assert dispatch.select_fwd(**kw, cc=(12, 0)).main.args[3] == "128"  # mma.sync kernel, cc >= 9.0 tables
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
    monkeypatch.setattr(dispatch, "_BWD_TILE_SPILLS", {(128, best, True, False)})
    assert dkdv_tile(dispatch.select_bwd(causal=True, **kw)) != best
    assert dkdv_tile(dispatch.select_bwd(causal=False, **kw)) == best
    names = {L.name_expression for L in dispatch.all_bwd_launches((8, 0))}
    excluded = dispatch.bwd_dkdv_launch("float16", 128, best, True, True, True, False)
    assert excluded.name_expression not in names
