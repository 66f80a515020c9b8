"""What a GPU plan and call take from ``attn_bias`` / ``attn_mask`` (cupyflash._variant,
issue 14), with no GPU: the VARIANT bits (in pairs or element by element), the plan
key, the kernel strides and the per-call pointers; the arrays are never copied."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cupyflash import _params, _variant, dispatch


def array(shape, dtype, ptr=1 << 20, strides=None, base=None):
    """The geometry of a device array (shape, strides in bytes, itemsize, dtype, data.ptr):
    C-contiguous, or a view with ``strides`` (in elements) of a larger one."""
    dtype = np.dtype(dtype)
    if strides is None:
        strides = np.empty(shape, dtype).strides
    else:
        strides = tuple(s * dtype.itemsize for s in strides)
    return SimpleNamespace(shape=tuple(shape), ndim=len(shape), strides=strides, itemsize=dtype.itemsize,
                           dtype=dtype, data=SimpleNamespace(ptr=ptr))


B, H, M, N = 2, 4, 100, 128


@pytest.mark.parametrize("name,options,want", [
    ("q-dtype", {"attn_bias": array((1, H, M, N), np.float16)}, dispatch.VAR_BIAS),
    ("fp32", {"attn_bias": array((B, 1, M, N), np.float32)}, dispatch.VAR_BIAS_FP32),
    ("mask", {"attn_mask": array((B, 1, 1, N), np.bool_)}, dispatch.VAR_MASK),
    ("odd-seqlen_k", {"attn_bias": array((1, H, M, N + 1), np.float16)},
     dispatch.VAR_BIAS | dispatch.VAR_BIAS_STRIDED),
    ("odd-address", {"attn_bias": array((1, H, M, N), np.float32, ptr=(1 << 20) + 4)},
     dispatch.VAR_BIAS_FP32 | dispatch.VAR_BIAS_STRIDED),
    ("transposed", {"attn_bias": array((1, H, M, N), np.float16, strides=(0, M * N, 1, M))},
     dispatch.VAR_BIAS | dispatch.VAR_BIAS_STRIDED),
    ("per-query", {"attn_bias": array((B, 1, M, 1), np.float16)}, dispatch.VAR_BIAS | dispatch.VAR_BIAS_STRIDED),
    ("broadcast_to", {"attn_bias": array((B, H, M, N), np.float16, strides=(0, M * N, N, 1))}, dispatch.VAR_BIAS),
    ("bias-pairs-mask-not", {"attn_bias": array((1, H, M, N), np.float16),
                             "attn_mask": array((B, 1, M, N), np.bool_, ptr=(1 << 20) + 1)},
     dispatch.VAR_BIAS | dispatch.VAR_MASK | dispatch.VAR_BIAS_STRIDED),
    ("with-causal-window", {"attn_bias": array((1, H, M, N), np.float16), "window_size": (8, 0)},
     dispatch.VAR_BIAS | dispatch.VAR_WINDOW),
])
def test_bits_read_pairs_only_where_they_are_aligned(name, options, want):
    assert _variant.bits(options) == want


def test_plan_key_sees_the_strides_and_the_pairs():
    even = {"attn_bias": array((1, H, M, N), np.float16)}
    odd = {"attn_bias": array((1, H, M, N), np.float16, ptr=(1 << 20) + 2)}
    again = {"attn_bias": array((1, H, M, N), np.float16, ptr=1 << 24)}
    assert _variant.plan_key(even) == _variant.plan_key(again)  # another pointer, the same plan
    assert _variant.plan_key(even) != _variant.plan_key(odd)    # element by element
    wider = {"attn_bias": array((1, H, M, N), np.float16, strides=(0, M * (N + 2), N + 2, 1))}
    assert _variant.plan_key(even) != _variant.plan_key(wider)


def test_plan_fields_are_the_broadcast_strides_and_call_values_the_pointers():
    bias = array((B, H, M, N), np.float32, ptr=4096, strides=(0, M * N, N, 1))  # broadcast_to over batch
    mask = array((B, 1, 1, N), np.bool_, ptr=8192)
    options = {"attn_bias": bias, "attn_mask": mask}
    fields = _variant.plan_fields(options, 0.125, H)
    assert [fields[f"bias_{a}_stride"] for a in ("batch", "head", "row", "col")] == [0, M * N, N, 1]
    assert [fields[f"mask_{a}_stride"] for a in ("batch", "head", "row", "col")] == [N, 0, 0, 1]
    assert all(fields[f"dbias_{a}_stride"] == 0 for a in ("batch", "head", "row", "col"))  # forward: no dbias
    values = dict(zip(_params.VARIANT_PER_CALL, _variant.call_values(options)))
    assert values["attn_bias"] == 4096 and values["attn_mask"] == 8192 and values["dbias"] == 0
    _params.pack(_params.VARIANT_PARAMS, **fields)  # every field has its type


def test_contiguous_never_copies_the_bias_or_mask():
    pytest.importorskip("cupy")  # imported (no GPU needed); only slopes and sinks would be copied
    options = {"attn_bias": array((1, H, M, N), np.float16, strides=(0, M * N, 1, M)),
               "attn_mask": array((B, 1, M, N), np.bool_, strides=(2 * M * N, 0, 2 * N, 2))}
    assert _variant.contiguous(options) is options


@pytest.mark.parametrize("staged", [False, True], ids=["register", "staged"])
def test_plans_take_the_block_map_with_a_mask(staged):
    """``plan_bits``: ``staged_bits`` with VAR_BLOCK_MAP where a mask is given (forward and
    backward plans alike: each kernel that reads no map drops the bit); none without."""
    mask = array((B, 1, M, N), np.bool_, ptr=(1 << 20) + (0 if staged else 2))
    for options in ({"attn_mask": mask}, {"attn_mask": mask, "attn_bias": array((1, H, M, N), np.float16)}):
        both = _variant.staged_bits(options)
        assert bool(both & dispatch.VAR_BIAS_STAGED) == staged and not both & dispatch.VAR_BLOCK_MAP
        assert _variant.plan_bits(options) == both | dispatch.VAR_BLOCK_MAP
    bias_only = {"attn_bias": array((1, H, M, N), np.float16)}
    assert _variant.plan_bits(bias_only) == _variant.staged_bits(bias_only)
