"""What a forward with a bias, a mask or a block map writes into VariantParams, checked
field by field by name against the arrays given (no GPU: device arrays are stand-ins
with a ``data.ptr``), and the kernels the GPU block-sparse tests run.

Run 64 (the block-sparse merge on the H200) failed every unsplit wgmma forward with
two or more key blocks: the kernel's key loop (flash_fwd_sm90.cu) skipped a block and
then read each block's K/V with the next block's coordinates. The GPU tests of the
map itself had all been split over keys (mma.sync: no map), so they passed; the
dispatch check below keeps them on the kernel they name.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _blockmask, _params, _variant, dispatch
from cupyflash._bench_bias import torch_mask_source


class _Device:
    """A host array with a device pointer (``data.ptr``), as _variant reads a CuPy array."""

    class _Data:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, array, ptr):
        self.array, self.data = array, self._Data(ptr)
        self.shape, self.strides, self.itemsize, self.dtype = array.shape, array.strides, array.itemsize, array.dtype
        self.ndim = array.ndim


def _packed(options, tile=None, **per_call):
    """VariantParams as a call writes it: the plan's fields, then the call's values
    through the writer the launcher uses; one numpy record."""
    fields = _variant.plan_fields(options, 0.125, options.get("nheads_q", 4), tile)
    template = bytearray(_params.pack(_params.VARIANT_PARAMS, **fields))
    _variant.WRITER.struct.pack_into(template, 0, *_variant.call_values(options, **per_call))
    return np.frombuffer(bytes(template), dtype=_params.VARIANT_PARAMS)[0]


def _strides(record, name):
    return [int(record[f"{name}_{axis}_stride"]) for axis in ("batch", "head", "row", "col")]


def test_call_values_are_in_the_per_call_fields_order():
    """Each value of call_values lands in the field of its name."""
    slopes, sinks = _Device(np.zeros(4, np.float32), 0x1000), _Device(np.zeros(4, np.float32), 0x2000)
    bias = _Device(np.zeros((1, 4, 8, 8), np.float16), 0x3000)
    mask = _Device(np.ones((1, 1, 8, 8), bool), 0x4000)
    options = {"alibi_slopes": slopes, "sinks": sinks, "attn_bias": bias, "attn_mask": mask,
               "rng_state": (0x5000, 77)}
    values = dict(zip(_params.VARIANT_PER_CALL,
                      _variant.call_values(options, dsinks=0x6000, dbias=0x7000, block_map=0x8000,
                                           kv_block_map=0x9000), strict=True))
    assert values == {"alibi_slopes": 0x1000, "sinks": 0x2000, "dsinks": 0x6000, "attn_bias": 0x3000,
                      "attn_mask": 0x4000, "dbias": 0x7000, "block_map": 0x8000, "kv_block_map": 0x9000,
                      "dropout_seed": 0x5000, "dropout_offset": 77}


@pytest.mark.parametrize("bias_shape", [(2, 4, 257, 190), (1, 4, 257, 190), (2, 1, 1, 190), (257, 190)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_bias_call_writes_its_pointer_and_strides(bias_shape, dtype):
    """A bias alone (run 64's test_bias_every_broadcast_shape): its pointer and its
    broadcast strides, no mask and no map."""
    host = np.zeros(bias_shape, dtype)
    host4 = host[(None,) * (4 - host.ndim)]
    bias = _Device(host4, 0xB000)
    record = _packed({"attn_bias": bias})
    assert int(record["attn_bias"]) == 0xB000
    assert int(record["attn_mask"]) == 0 and int(record["block_map"]) == 0
    assert _strides(record, "bias") == list(_variant.broadcast_strides(bias))
    assert _strides(record, "bias") == [0 if n == 1 else s // host.itemsize for n, s in zip(host4.shape, host4.strides)]
    assert _strides(record, "mask") == [0] * 4 and _strides(record, "block_map") == [0] * 4
    assert int(record["window_left"]) == -1 and float(record["dropout_scale"]) == 1.0


@pytest.mark.parametrize("mask_shape", [(2, 4, 700, 645), (2, 1, 700, 645), (1, 4, 1, 645), (700, 1), (700, 645),
                                        (5, 1, 393, 276)])
@pytest.mark.parametrize("tile", [(128, 64), (128, 128)])
def test_a_block_mask_call_writes_the_map_it_passes(mask_shape, tile):
    """The map's strides (per plan) are those of the map the call passes (per call):
    BlockMask.tiles at the kernel's tile, read as broadcast (0 along its size-1 axes)."""
    rng = np.random.default_rng(1)
    host = rng.random(mask_shape) < 0.5
    bm = cupyflash.BlockMask.from_mask(host)
    tiles = bm.tiles(*tile)
    mask4 = host[(None,) * (4 - host.ndim)]
    mask = _Device(mask4, 0xA000)
    assert tiles.shape == _variant.block_map_shape(mask, tile)
    record = _packed({"attn_mask": mask}, tile, block_map=0xC000)
    assert int(record["attn_mask"]) == 0xA000 and int(record["block_map"]) == 0xC000
    assert int(record["attn_bias"]) == 0
    assert _strides(record, "mask") == list(_variant.broadcast_strides(mask))
    assert _strides(record, "block_map") == [0 if n == 1 else s for n, s in zip(tiles.shape, tiles.strides)]
    # each (batch, head, query block, key block) the kernel addresses is the map's state there
    b, h, m, n = (x - 1 for x in tiles.shape)
    at = np.dot([b, h, m, n], _strides(record, "block_map"))
    assert tiles.reshape(-1)[at] == tiles[b, h, m, n]


def test_plan_key_tells_a_broadcast_batch_view_from_one_mask():
    """A stride-0 batch view and a batch-1 mask have the same broadcast strides, not the
    same tile map: the plan (whose map strides follow the shape) is not shared."""
    one = np.ones((1, 1, 300, 256), bool)
    view = np.broadcast_to(one, (2, 1, 300, 256))
    keys = {_variant.plan_key({"attn_mask": _Device(x, 0x100)}) for x in (one, view)}
    assert len(keys) == 2


def test_the_gpu_block_sparse_configs_run_the_kernel_they_name():
    """tests/test_gpu_block_sparse.py's configs labelled wgmma are unsplit on an H200's 132
    SMs (a split forward runs the mma.sync kernel, which reads no map), and their plans
    take the map at (128, 64)."""
    from test_gpu_block_sparse import CONFIGS, KERNELS  # sibling module

    for name, (dtype, (batch, seqlen_q, seqlen_k, nheads, _nheads_kv, head_dim), causal) in CONFIGS.items():
        plan = dispatch.select_fwd(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=nheads,
                                   head_dim=head_dim, dtype=dtype, causal=causal, vec=True, num_sms=132, cc=(9, 0),
                                   variant=dispatch.VAR_MASK | dispatch.VAR_BLOCK_MAP)
        assert plan.main.source == KERNELS[name], name
        if KERNELS[name] == "flash_fwd_sm90.cu":
            assert plan.num_splits == 1 and dispatch.fwd_block_map_tile(plan) == (128, 64), name
        else:
            assert dispatch.fwd_block_map_tile(plan) is None, name


def test_the_bench_hands_torch_the_blockmask_s_bool_array():
    """bench --suite bias's sparse case (run 64: torch.from_dlpack(BlockMask) raised "invalid
    capsule"): torch gets the BlockMask's own mask, a plain array as it is."""
    keep = np.ones((1, 1, 128, 128), bool)
    bm = cupyflash.BlockMask.from_mask(keep)
    assert torch_mask_source(bm) is keep
    assert torch_mask_source(keep) is keep
    assert _blockmask.EMPTY == 0
