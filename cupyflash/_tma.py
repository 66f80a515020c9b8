"""TMA tensor maps (``CUtensorMap``) for the warp-specialised forward.

``kernels_cu/flash_fwd_ws.cu`` copies its Q, K and V tiles with the bulk tensor
copy engine, which reads a 128-byte descriptor per tensor: the tensor's address,
sizes and strides, the box one copy moves, and the shared-memory swizzle.  The
driver encodes it (``cuTensorMapEncodeTiled``); cupy exposes no binding, so it is
called here through ctypes on ``libcuda.so.1``, loaded on first use (importing
this module needs no GPU).

A map describes a dense ``(batch, seqlen, nheads, head_dim)`` tensor as four
dimensions, innermost first ``(head_dim, seqlen, nheads, batch)``, with the
tensor's own row, head and batch strides (any, in multiples of 16 bytes), and a
box of 64 columns (128 bytes: the 128-byte swizzle's span, the layout the
kernel's wgmma descriptors read) by the tile's rows.  Reads out of bounds (rows
past seqlen, columns past head_dim) arrive as zeros.

Everything but the address is fixed by a call's plan (:class:`TiledMap`);
:class:`MapCache` encodes per address and keeps the bytes (an encode costs the
driver about 1-2 us; a hit is a dict lookup), so a call with the pointers of an
earlier one writes its maps without the driver.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from ._launch import seq_strides

#: CUtensorMapDataType of each storage dtype.
DATA_TYPES = {"float16": 6, "bfloat16": 9}
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
L2_PROMOTION_256B = 3
OOB_FILL_ZERO = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zeros
#: Elements per box row: 128 bytes of a 16-bit type (kernels_cu/flash_fwd_ws.cu BOX_COLS).
BOX_COLS = 64
DESCRIPTOR_BYTES = 128
_MAX_STRIDE = 1 << 40


@dataclass(frozen=True)
class TiledMap:
    """The arguments of ``cuTensorMapEncodeTiled`` but the address: sizes in
    elements and box innermost first, strides in bytes of the outer three."""

    data_type: int
    dims: tuple[int, int, int, int]
    strides: tuple[int, int, int]
    box: tuple[int, int, int, int]


def seq_map(dtype: str, shape, strides, itemsize: int, box_rows: int) -> TiledMap:
    """The map of a dense ``(batch, seqlen, nheads, head_dim)`` tensor with
    ``strides`` (batch, row, head) in elements, copied in boxes of ``box_rows``
    rows by :data:`BOX_COLS` columns.

    A dimension of size 1 is never stepped over: its stride is replaced by 16
    bytes, which the driver accepts whatever the array's was (e.g. 0).
    Raises ValueError for strides the copy engine cannot address.
    """
    batch, seqlen, nheads, head_dim = shape
    batch_stride, row_stride, head_stride = strides
    byte_strides = []
    for name, size, stride in (("row", seqlen, row_stride), ("head", nheads, head_stride),
                               ("batch", batch, batch_stride)):
        b = stride * itemsize if size > 1 else 16
        if b <= 0 or b % 16 or b >= _MAX_STRIDE:
            raise ValueError(f"cupyflash: a TMA map needs {name} strides that are positive multiples of "
                             f"16 bytes below 2^40; got {b} bytes")
        byte_strides.append(b)
    return TiledMap(DATA_TYPES[dtype], (head_dim, seqlen, nheads, batch), tuple(byte_strides),
                    (BOX_COLS, box_rows, 1, 1))


def bias_map(dtype: str, shape, strides, itemsize: int, box_rows: int) -> TiledMap:
    """The map of a 4-D bias ``(batch, nheads, seqlen_q, seqlen_k)`` read at its broadcast
    ``strides`` (batch, head, row, col; elements, 0 along a broadcast dimension:
    ``_variant.broadcast_strides``), copied in boxes of ``box_rows`` query rows by
    :data:`BOX_COLS` keys (kernels_cu/flash_bwd_ws.cu with a bias): dimensions innermost
    first ``(seqlen_k, seqlen_q, nheads, batch)``, each broadcast one of size 1 (the kernel's
    coordinate there is 0; a broadcast row arrives as the box's row 0, zeros below it).

    Raises ValueError for a column stride other than 1 or strides the copy engine cannot
    address (as :func:`seq_map`).
    """
    batch, nheads, seqlen_q, seqlen_k = shape
    batch_stride, head_stride, row_stride, col_stride = strides
    if col_stride != 1:
        raise ValueError(f"cupyflash: a bias's TMA map needs unit column stride; got {col_stride}")
    dims = (seqlen_k, seqlen_q if row_stride else 1, nheads if head_stride else 1, batch if batch_stride else 1)
    return seq_map(dtype, (dims[3], dims[1], dims[2], seqlen_k), (batch_stride, row_stride, head_stride), itemsize,
                   box_rows)


def encode(m: TiledMap, address: int, encode_fn=None) -> bytes:
    """The 128 bytes of ``m`` over the tensor at ``address`` (16-byte aligned).

    ``encode_fn``: a callable with ``cuTensorMapEncodeTiled``'s C signature (the
    driver's, by default; tests pass a fake), returning its CUresult.
    """
    fn = driver_encode() if encode_fn is None else encode_fn
    out = (ctypes.c_uint8 * DESCRIPTOR_BYTES)()
    u64x4, u32x4 = ctypes.c_uint64 * 4, ctypes.c_uint32 * 4
    result = fn(ctypes.byref(out), m.data_type, 4, ctypes.c_void_p(address), u64x4(*m.dims),
                (ctypes.c_uint64 * 3)(*m.strides), u32x4(*m.box), u32x4(1, 1, 1, 1), INTERLEAVE_NONE,
                SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZERO)
    if result != 0:
        raise RuntimeError(f"cupyflash: cuTensorMapEncodeTiled failed (CUresult {result}) for {m} at "
                           f"address {address:#x}")
    return bytes(out)


@functools.lru_cache(maxsize=None)
def driver_encode():
    """``cuTensorMapEncodeTiled`` from the CUDA driver, with its argument types."""
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


class MapCache:
    """The encoded maps of a plan's tensors, per address.

    ``MapCache((q_map, k_map, v_map))(q_ptr, k_ptr, v_ptr)`` returns the three
    descriptors back to back (FwdTmaParams holds them so: 128 bytes each, at
    multiples of 64), encoding only addresses not seen before; each tensor's
    addresses are kept up to ``limit`` and then forgotten all at once.
    """

    __slots__ = ("maps", "_seen", "_encode_fn", "limit")

    def __init__(self, maps, encode_fn=None, limit: int = 64):
        self.maps = tuple(maps)
        self._seen = tuple({} for _ in self.maps)
        self._encode_fn = encode_fn
        self.limit = limit

    def __call__(self, *addresses: int) -> bytes:
        parts = []
        for m, seen, address in zip(self.maps, self._seen, addresses):
            desc = seen.get(address)
            if desc is None:
                if len(seen) >= self.limit:
                    seen.clear()
                desc = seen[address] = encode(m, address, self._encode_fn)
            parts.append(desc)
        return b"".join(parts)


def seq_maps(arrays, dtype_name: str, box_rows) -> tuple[TiledMap, ...]:
    """The maps of ``arrays``, array i copied in boxes of ``box_rows[i]`` rows.

    Dense ``(batch, seqlen, nheads, d)`` tensors map as they are; packed ``(total,
    nheads, d)`` ones as one sequence of ``total`` rows in a batch of 1 (the kernels
    offset their row coordinate by the sequence's start: kernels_cu/flash_fwd_ws.cu),
    so no copy reads past the packed tensor's last row (the map's bound: zeros)."""
    return tuple(seq_map(dtype_name, tuple(a.shape) if len(a.shape) == 4 else (1, *a.shape), seq_strides(a),
                         a.itemsize, rows)
                 for a, rows in zip(arrays, box_rows, strict=True))


def maps_of(arrays, dtype_name: str, box_rows) -> MapCache:
    """The maps of :func:`seq_maps` per address."""
    return MapCache(seq_maps(arrays, dtype_name, box_rows))
