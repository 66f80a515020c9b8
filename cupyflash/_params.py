"""NumPy mirrors of the kernel parameter structs in ``kernels_cu/params.cuh``.

Each dtype lists the C struct's fields in order with ``align=True``, so numpy
lays them out as the C compiler does. The itemsize is passed to NVRTC as
``-DCUPYFLASH_*_PARAMS_BYTES`` and checked there with ``static_assert``; the
Python side is checked in ``tests/test_dispatch.py``, and the field names, order
and types against params.cuh in ``tests/test_params.py``.

The structs are filled by field name (:func:`pack`, once per call signature;
:class:`FieldWriter` for the per-call pointers), never by position.
"""

from __future__ import annotations

import struct as _stdlib_struct

import numpy as np

_PTR = np.uint64
_U64 = np.uint64
_U32 = np.uint32
_I64 = np.int64
_I32 = np.int32
_F32 = np.float32


def _struct(fields):
    return np.dtype(fields, align=True)


#: kernels_cu/variant.cuh VariantParams, the member ``var`` of every params struct.
VARIANT_PARAMS = _struct(
    [
        ("alibi_slopes", _PTR), ("sinks", _PTR), ("dsinks", _PTR), ("attn_bias", _PTR), ("attn_mask", _PTR),
        ("dbias", _PTR), ("block_map", _PTR), ("kv_block_map", _PTR), ("dropout_seed", _U64),
        ("dropout_offset", _U32), ("dropout_threshold", _U32), ("alibi_batch_stride", _I64),
        *((f"{name}_{axis}_stride", _I64) for name in ("bias", "mask", "dbias")
          for axis in ("batch", "head", "row", "col")),
        *((f"{name}_{axis}_stride", _I64) for name in ("block_map", "kv_block_map")
          for axis in ("batch", "head", "row", "col")),
        ("window_left", _I32), ("window_right", _I32),
        ("softcap_log2", _F32), ("softcap_scale", _F32), ("dropout_scale", _F32),
    ]
)
#: VariantParams' fields set on every call (its first ones, in order).
VARIANT_PER_CALL = ("alibi_slopes", "sinks", "dsinks", "attn_bias", "attn_mask", "dbias", "block_map",
                    "kv_block_map", "dropout_seed", "dropout_offset")
#: Every variant off.
VARIANT_OFF = {**{name: 0 for name in VARIANT_PARAMS.names},
               "window_left": -1, "window_right": -1, "dropout_scale": 1.0}


FWD_PARAMS = _struct(
    [
        ("q", _PTR), ("k", _PTR), ("v", _PTR), ("out", _PTR), ("lse", _PTR),
        ("out_accum", _PTR), ("lse_accum", _PTR), ("cu_seqlens_q", _PTR), ("cu_seqlens_k", _PTR),
        ("seqused_k", _PTR),
        ("q_batch_stride", _I64), ("q_row_stride", _I64), ("q_head_stride", _I64),
        ("k_batch_stride", _I64), ("k_row_stride", _I64), ("k_head_stride", _I64),
        ("v_batch_stride", _I64), ("v_row_stride", _I64), ("v_head_stride", _I64),
        ("o_batch_stride", _I64), ("o_row_stride", _I64), ("o_head_stride", _I64),
        ("lse_batch_stride", _I64), ("lse_head_stride", _I64),
        ("batch", _I32), ("nheads_q", _I32), ("nheads_kv", _I32),
        ("seqlen_q", _I32), ("seqlen_k", _I32), ("head_dim", _I32),
        ("num_m_blocks", _I32), ("num_splits", _I32), ("n_blocks_per_split", _I32),
        ("softmax_scale", _F32), ("softmax_scale_log2", _F32),
        ("var", VARIANT_PARAMS),
    ]
)

#: kernels_cu/tma.cuh TmaDescriptor (the driver's CUtensorMap): 128 bytes, 64-byte aligned.
TMA_DESCRIPTOR_BYTES = 128
_TMA_ALIGN = 64


def _tma_params(name: str, params: np.dtype, maps: tuple[str, ...]) -> np.dtype:
    """kernels_cu/params.cuh FwdTmaParams / BwdTmaParams: ``params`` as member ``name``,
    then the ``maps``, each at the next multiple of 64 bytes (numpy's align=True knows no
    64-byte members)."""
    names, formats, offsets, pos = [name], [params], [0], params.itemsize
    for map_name in maps:
        pos = -(-pos // _TMA_ALIGN) * _TMA_ALIGN
        names.append(map_name)
        formats.append((np.uint8, TMA_DESCRIPTOR_BYTES))
        offsets.append(pos)
        pos += TMA_DESCRIPTOR_BYTES
    return np.dtype({"names": names, "formats": formats, "offsets": offsets,
                     "itemsize": -(-pos // _TMA_ALIGN) * _TMA_ALIGN})


FWD_TMA_PARAMS = _tma_params("fwd", FWD_PARAMS, ("q_map", "k_map", "v_map"))

BWD_PARAMS = _struct(
    [
        ("q", _PTR), ("k", _PTR), ("v", _PTR), ("out", _PTR), ("dout", _PTR),
        ("dq", _PTR), ("dk", _PTR), ("dv", _PTR),
        ("lse", _PTR), ("lse_log2", _PTR), ("delta", _PTR), ("dq_accum", _PTR), ("dkv_accum", _PTR),
        ("cu_seqlens_q", _PTR), ("cu_seqlens_k", _PTR),
        ("q_batch_stride", _I64), ("q_row_stride", _I64), ("q_head_stride", _I64),
        ("k_batch_stride", _I64), ("k_row_stride", _I64), ("k_head_stride", _I64),
        ("v_batch_stride", _I64), ("v_row_stride", _I64), ("v_head_stride", _I64),
        ("o_batch_stride", _I64), ("o_row_stride", _I64), ("o_head_stride", _I64),
        ("do_batch_stride", _I64), ("do_row_stride", _I64), ("do_head_stride", _I64),
        ("dq_batch_stride", _I64), ("dq_row_stride", _I64), ("dq_head_stride", _I64),
        ("dk_batch_stride", _I64), ("dk_row_stride", _I64), ("dk_head_stride", _I64),
        ("dv_batch_stride", _I64), ("dv_row_stride", _I64), ("dv_head_stride", _I64),
        ("lse_batch_stride", _I64), ("lse_head_stride", _I64),
        ("batch", _I32), ("nheads_q", _I32), ("nheads_kv", _I32), ("seqlen_q", _I32), ("seqlen_k", _I32),
        ("total_q", _I32), ("total_k", _I32), ("head_dim", _I32),
        ("head_dim_padded", _I32), ("num_stages", _I32), ("kv_splits", _I32),
        ("softmax_scale", _F32), ("softmax_scale_log2", _F32),
        ("var", VARIANT_PARAMS),
    ]
)

BWD_TMA_PARAMS = _tma_params("bwd", BWD_PARAMS, ("q_map", "k_map", "v_map", "do_map", "bias_map"))

DECODE_PARAMS = _struct(
    [
        ("q", _PTR), ("k_cache", _PTR), ("v_cache", _PTR), ("k_new", _PTR), ("v_new", _PTR),
        ("out", _PTR), ("lse", _PTR), ("out_accum", _PTR), ("lse_accum", _PTR),
        ("cache_seqlens", _PTR), ("cache_batch_idx", _PTR), ("block_table", _PTR),
        ("seqused_k_out", _PTR), ("cache_seqlen", _I64),
        ("q_batch_stride", _I64), ("q_row_stride", _I64), ("q_head_stride", _I64),
        ("k_batch_stride", _I64), ("k_row_stride", _I64), ("k_head_stride", _I64),
        ("v_batch_stride", _I64), ("v_row_stride", _I64), ("v_head_stride", _I64),
        ("knew_batch_stride", _I64), ("knew_row_stride", _I64), ("knew_head_stride", _I64),
        ("vnew_batch_stride", _I64), ("vnew_row_stride", _I64), ("vnew_head_stride", _I64),
        ("o_batch_stride", _I64), ("o_row_stride", _I64), ("o_head_stride", _I64),
        ("block_table_batch_stride", _I64),
        ("batch", _I32), ("nheads_q", _I32), ("nheads_kv", _I32), ("seqlen_q", _I32), ("head_dim", _I32),
        ("seqlen_new", _I32), ("page_size", _I32), ("page_shift", _I32), ("cache_rows", _I32), ("capacity", _I32),
        ("group", _I32), ("num_m_blocks", _I32), ("num_splits", _I32),
        ("softmax_scale", _F32), ("softmax_scale_log2", _F32),
        ("var", VARIANT_PARAMS),
    ]
)


def size_defines() -> list[str]:
    """NVRTC ``-D`` options that let params.cuh static_assert the mirrored sizes."""
    return [f"-DCUPYFLASH_FWD_PARAMS_BYTES={FWD_PARAMS.itemsize}",
            f"-DCUPYFLASH_BWD_PARAMS_BYTES={BWD_PARAMS.itemsize}",
            f"-DCUPYFLASH_DECODE_PARAMS_BYTES={DECODE_PARAMS.itemsize}",
            f"-DCUPYFLASH_FWD_TMA_PARAMS_BYTES={FWD_TMA_PARAMS.itemsize}",
            f"-DCUPYFLASH_BWD_TMA_PARAMS_BYTES={BWD_TMA_PARAMS.itemsize}"]


def pack(struct: np.dtype, **fields) -> bytes:
    """The bytes of one ``struct`` with every field set by name (all must be given).

    Pointers are ints, strides and sizes ints, scales floats (rounded to float32
    as the C struct holds them); a nested struct (``var``) takes a dict of its
    fields, all given likewise.  Called once per call signature (the plan),
    never per call.
    """
    record = np.zeros((), dtype=struct)
    _fill(record, struct, fields)
    return record.tobytes()


def _fill(record, struct, fields):
    names = set(struct.names)
    if fields.keys() != names:
        missing, extra = sorted(names - fields.keys()), sorted(fields.keys() - names)
        raise TypeError(f"cupyflash: params struct fields missing {missing}, unknown {extra}")
    for name, value in fields.items():
        sub = struct.fields[name][0]
        if sub.names is not None:
            _fill(record[name], sub, value)
        else:
            record[name] = value


def offset_of(struct: np.dtype, name: str) -> int:
    """Byte offset of field ``name`` in ``struct``."""
    return struct.fields[name][1]


class FieldWriter:
    """Writes a fixed set of fields, by name, into the packed bytes of a struct.

    ``FieldWriter(FWD_PARAMS, ("q", "k", ...)).pack_into(buffer, q_ptr, k_ptr, ...)``
    sets those fields (the per-call pointers) in a buffer that holds the rest
    (the plan's template).  The names must be consecutive fields, in the
    struct's order, starting at its first (as the pointers are): one
    ``struct.pack_into`` writes them all and touches no other byte.
    """

    __slots__ = ("names", "struct")

    _CODES = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i",
              np.dtype(np.uint32): "I", np.dtype(np.float32): "f"}

    def __init__(self, struct: np.dtype, names: tuple[str, ...]):
        if tuple(names) != struct.names[:len(names)]:
            raise ValueError(f"cupyflash: fields {names} are not the struct's first fields in order")
        fmt, pos = "<", 0
        for name in names:
            field, offset = struct.fields[name][:2]
            if offset != pos:
                raise ValueError(f"cupyflash: field {name} is not right after the one before it")
            fmt += self._CODES[field]
            pos = offset + field.itemsize
        self.names = tuple(names)
        self.struct = _stdlib_struct.Struct(fmt)  # its pack_into(buffer, 0, *values) is what a call runs

    def pack_into(self, buffer, *values) -> None:
        self.struct.pack_into(buffer, 0, *values)
