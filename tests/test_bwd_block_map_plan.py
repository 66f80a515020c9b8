"""The backward's block map (issue 14) in the plans, no GPU needed: which kernels take
VAR_BLOCK_MAP (dispatch.select_bwd), at which tiles their maps are read
(dispatch.bwd_block_map_tiles), what a plan writes for them (VariantParams' block_map
and kv_block_map, _variant.plan_fields / call_values), and that check-kernels lists
every mapped kernel a plan can take.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cupyflash import _params, _variant, dispatch

MAP, MASK, STAGED = dispatch.VAR_BLOCK_MAP, dispatch.VAR_MASK, dispatch.VAR_BIAS_STAGED
DKDV, DQ = "cupyflash::flash_bwd_dkdv_sm90_kernel", "cupyflash::flash_bwd_dq_sm90_kernel"


def _plan(head_dim=64, variant=MASK | MAP, deterministic=False, cc=(9, 0), vec=True, causal=False, **kw):
    args = dict(batch=2, seqlen_q=1000, seqlen_k=1000, nheads_q=8, nheads_kv=4, head_dim=head_dim,
                dtype="bfloat16", causal=causal, deterministic=deterministic, vec=vec, cc=cc, variant=variant)
    return dispatch.select_bwd(**{**args, **kw})


def _variants(plan):
    """{template: VARIANT} of the plan's kernels that take the variant bits last."""
    return {L.template: int(L.args[-1]) for L in plan.launches if L.args[-1].lstrip("-").isdigit()}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,variant,tiles", [
    (64, MASK | MAP, ((64, 128), (128, 64))),                 # dQ from its own kernel (64 keys with a mask)
    (64, MASK | STAGED | MAP, ((64, 128), (128, 128))),       # the dQ kernel stages it, at 128 keys
    (128, MASK | STAGED | MAP, ((64, 128), None)),            # default: dQ by atomics in the dK/dV kernel
])
def test_the_wgmma_kernels_take_the_map_at_their_own_tiles(head_dim, variant, tiles, causal, deterministic):
    plan = _plan(head_dim, variant, deterministic, causal=causal)
    kinds = _variants(plan)
    assert kinds[DKDV] & MAP
    want = tiles if not deterministic else (tiles[0], tiles[1] or (128, 64))  # deterministic: the dQ kernel's too
    assert dispatch.bwd_block_map_tiles(plan) == want
    if want[1] is not None:
        assert kinds[DQ] & MAP and plan.launches[2].args[2] == str(want[1][1])
    # the map changes no other choice: the same plan, less the bit, as without it
    unmapped = _plan(head_dim, variant & ~MAP, deterministic, causal=causal)
    assert len(plan.launches) == len(unmapped.launches)
    for a, b in zip(plan.launches, unmapped.launches):
        if a.template in (DKDV, DQ):
            a = dataclasses.replace(a, args=a.args[:-1] + (str(int(a.args[-1]) & ~MAP),))
        assert a == b


@pytest.mark.parametrize("case", ["sm80", "unaligned", "d96", "d128-not-staged", "no-mask", "bias"])
def test_the_other_kernels_drop_the_map(case):
    """The mma.sync fallbacks (cc 8.0, unaligned data, other head_dims, D=128 without the
    staged mask) mask every tile: no kernel keeps the bit, no map is read; without a mask
    the bit means nothing; beside a bias the wgmma kernels take no map (_BWD_SM90_MAP_DROPS)."""
    kw = {"sm80": dict(cc=(8, 0)), "unaligned": dict(vec=False), "d96": dict(head_dim=96),
          "d128-not-staged": dict(head_dim=128), "no-mask": dict(variant=MAP),
          "bias": dict(variant=MASK | dispatch.VAR_BIAS | MAP, dbias_shape=(1, 8, 1000, 1000))}[case]
    plan = _plan(**kw)
    assert not any(v & MAP for v in _variants(plan).values())
    assert dispatch.bwd_block_map_tiles(plan) == (None, None)
    assert plan == _plan(**{**kw, "variant": kw.get("variant", MASK | MAP) & ~MAP})


def test_plan_fields_and_call_values_of_the_backward_s_maps():
    """What _gpu_bwd.plan_bwd and _run_bwd write: the dQ kernel's map in block_map, the
    dK/dV kernel's in kv_block_map, each with its tile's strides and its own pointer."""
    mask = np.ones((2, 1, 1000, 1000), bool)
    plan = _plan(64, MASK | MAP, deterministic=True)
    kv_tile, q_tile = dispatch.bwd_block_map_tiles(plan)
    fields = _variant.plan_fields({"attn_mask": mask}, 0.125, 8, block_map_tile=q_tile, kv_block_map_tile=kv_tile)
    assert _variant.block_map_shape(mask, q_tile) == (2, 1, 8, 16)
    assert _variant.block_map_shape(mask, kv_tile) == (2, 1, 16, 8)
    assert [fields[f"block_map_{a}_stride"] for a in ("batch", "head", "row", "col")] == [128, 0, 16, 1]
    assert [fields[f"kv_block_map_{a}_stride"] for a in ("batch", "head", "row", "col")] == [128, 0, 8, 1]
    values = dict(zip(_params.VARIANT_PER_CALL, _variant.call_values({}, block_map=0x100, kv_block_map=0x200),
                      strict=True))
    assert values["block_map"] == 0x100 and values["kv_block_map"] == 0x200


def test_check_kernels_lists_every_mapped_backward_kernel():
    """Every wgmma backward kernel a plan with a map takes (the check variants, both modes,
    causal or not, D=64 and 128) is in all_bwd_launches((9, 0)), with the map's bit; none
    on cc 8.0."""
    listed = {(L.template, L.args) for L in dispatch.all_bwd_launches((9, 0))}
    mapped = set()
    for bits in dispatch.BWD_BLOCK_MAP_CHECK_VARIANTS:
        for d in (64, 128):
            for causal in (False, True):
                for det in (False, True):
                    plan = _plan(d, bits, det, causal=causal, seqlen_q=1024, seqlen_k=1024, batch=1, nheads_q=16,
                                 nheads_kv=16)
                    mapped |= {(L.template, L.args) for L in plan.launches
                               if L.template in (DKDV, DQ) and int(L.args[-1]) & MAP}
    assert mapped <= listed
    assert {t for t, _ in mapped} == {DKDV, DQ}
    assert not [L for L in dispatch.all_bwd_launches((8, 0)) if L.args[-1].isdigit() and int(L.args[-1]) & MAP]


@pytest.mark.parametrize("launch", [
    dispatch.bwd_dkdv_sm90_launch("bfloat16", 128, True, True, False, variant=MASK | STAGED | MAP),
    dispatch.bwd_dq_sm90_launch("bfloat16", 64, True, True, variant=MASK | MAP),
], ids=["dkdv-d128-staged-atomic-dq", "dq-d64"])
def test_mapped_wgmma_kernels_compile_without_spills(launch):
    """The two mapped kernels nearest the register limit compile (local NVRTC, sm_90a) with
    no spill and no warning."""
    pytest.importorskip("cupy")
    from cupyflash import _compile

    compiled = _compile.compile_variant(launch.source, launch.name_expression, (9, 0), use_cache=False)
    res = _compile.parse_ptxas_log(compiled.log)
    assert res.spill_bytes == 0 and res.stack_bytes == 0, (launch.name_expression, res)
    assert "warning" not in compiled.log.lower(), compiled.log
