"""GPU path: fills the params structs, picks variants through dispatch, launches.

Inputs arrive validated by ``_api`` or ``_varlen`` (rank, shapes, dtypes, unit
last stride, non-empty; ``cu_seqlens`` int32, contiguous, consistent with
``max_seqlen``). Arrays are cupy ndarrays; bfloat16 data arrives as 2-byte
storage with ``dtype="bfloat16"`` named explicitly.

Dense batches are ``(batch, seqlen, nheads, head_dim)`` tensors; packed
(varlen) batches ``(total, nheads, head_dim)`` tensors with ``cu_seqlens``,
which the kernels read on the device: one launch covers the whole batch, with
batch strides 0 and the longest lengths in ``seqlen_q``/``seqlen_k``
(kernels_cu/seqlens.cuh).
"""

from __future__ import annotations

import ctypes
import functools
import struct

import numpy as np

from . import _compile, _params, dispatch

LOG2E = 1.4426950408889634  # 1 / ln(2)


def _struct_packer(dt: np.dtype) -> struct.Struct:
    """A ``struct.Struct`` with the byte layout of an aligned numpy struct dtype."""
    codes = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i",
             np.dtype(np.float32): "f"}
    fmt, pos = "<", 0
    for name in dt.names:
        fdt, off = dt.fields[name][:2]
        fmt += "x" * (off - pos) + codes[fdt]
        pos = off + fdt.itemsize
    fmt += "x" * (dt.itemsize - pos)
    packer = struct.Struct(fmt)
    assert packer.size == dt.itemsize  # internal invariant, not user input
    return packer


_FWD_PACK = _struct_packer(_params.FWD_PARAMS)

# Plans are pure functions of scalars: memoised here (not in dispatch, whose
# tables tests and `bench --fwd-tiles` patch) they cost ~0.1 us instead of ~10.
select_fwd = functools.lru_cache(maxsize=4096)(dispatch.select_fwd)
select_bwd = functools.lru_cache(maxsize=4096)(dispatch.select_bwd)


@functools.lru_cache(maxsize=None)
def _num_sms(device_id: int) -> int:
    import cupy  # noqa: PLC0415
    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


@functools.lru_cache(maxsize=None)
def _cc(device_id: int) -> tuple[int, int]:
    import cupy  # noqa: PLC0415
    cc = cupy.cuda.Device(device_id).compute_capability
    return int(cc[:-1]), int(cc[-1])


def element_strides(a) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


def seq_strides(a) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements of a dense (batch, seqlen, nheads, d)
    or packed (total, nheads, d) tensor; a packed tensor's batch stride is 0."""
    s = element_strides(a)
    return s[:3] if a.ndim == 4 else (0, s[0], s[1])


def lse_strides(lse) -> tuple[int, int]:
    """(batch, head) strides in elements of a dense (batch, nheads, seqlen) or packed
    (nheads, total) lse (unit row stride); a packed lse's batch stride is 0."""
    s = element_strides(lse)
    return s[:2] if lse.ndim == 3 else (0, s[0])


def batch_shape(q, k, packed) -> tuple[int, int, int, int, int]:
    """``(batch, seqlen_q, seqlen_k, cu_seqlens_q pointer, cu_seqlens_k pointer)`` for the params.

    ``packed`` is None for a dense batch (pointers 0), else ``(cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)``, whose maxima stand for the
    lengths.
    """
    if packed is None:
        return q.shape[0], q.shape[1], k.shape[1], 0, 0
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = packed
    return (cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k,
            cu_seqlens_q.data.ptr, cu_seqlens_k.data.ptr)


def vec_ok(arrays, head_dim: int) -> bool:
    """16-byte accesses are legal: aligned pointers, strides and head_dim in multiples of 8 elements."""
    if head_dim % 8:
        return False
    for a in arrays:
        if a.data.ptr % 16:
            return False
        if any(s % 8 for s in element_strides(a)[:-1]):
            return False
    return True


def launch(launch_spec: dispatch.Launch, packed_params: bytes, stream_ptr: int) -> None:
    """Launch one kernel whose only argument is a params struct passed by value."""
    import cupy  # noqa: PLC0415

    func = _compile.get_function(launch_spec.source, launch_spec.name_expression, launch_spec.smem_bytes)
    buf = ctypes.create_string_buffer(packed_params, len(packed_params))
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    gx, gy, gz = launch_spec.grid
    bx, by, bz = launch_spec.block
    cupy.cuda.driver.launchKernel(func, gx, gy, gz, bx, by, bz, launch_spec.smem_bytes, stream_ptr,
                                  ctypes.addressof(argv), 0)


def _storage_dtype_name(a, dtype: str | None) -> str:
    if dtype is not None:
        return dtype
    return str(a.dtype)


def fwd(q, k, v, *, softmax_scale: float, causal: bool, dtype: str | None = None, out=None, lse=None):
    """Forward on the GPU. Returns ``(out, lse)``; ``out`` has q's storage dtype."""
    with q.device:  # allocate, compile and launch on the inputs' device
        return _fwd(q, k, v, softmax_scale, causal, dtype, out, lse, None)


def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               softmax_scale: float, causal: bool, dtype: str | None = None):
    """Forward over a packed batch on the GPU, in one launch.

    q ``(total_q, nheads_q, head_dim)``, k and v ``(total_k, nheads_kv,
    head_dim)``, ``cu_seqlens_q/k`` int32 ``(batch + 1,)`` on q's device and
    read only there. Returns ``(out, lse)``: out like q (its storage dtype), lse
    ``(nheads_q, total_q)`` float32.
    """
    with q.device:
        return _fwd(q, k, v, softmax_scale, causal, dtype, None, None,
                    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


def _fwd(q, k, v, softmax_scale, causal, dtype, out, lse, packed):
    """``packed``: None for a dense batch, else (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    import cupy  # noqa: PLC0415

    nheads_q, head_dim = q.shape[-2:]
    nheads_kv = k.shape[-2]
    batch, seqlen_q, seqlen_k, cu_q, cu_k = batch_shape(q, k, packed)
    lse_shape = (batch, nheads_q, seqlen_q) if packed is None else (nheads_q, q.shape[0])
    dtype_name = _storage_dtype_name(q, dtype)
    if out is None:
        out = cupy.empty(q.shape, dtype=q.dtype)
    if lse is None:
        lse = cupy.empty(lse_shape, dtype=cupy.float32)
    dev = q.device.id
    plan = select_fwd(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=nheads_q, head_dim=head_dim,
        dtype=dtype_name, causal=causal, vec=vec_ok((q, k, v, out), head_dim),
        num_sms=_num_sms(dev), cc=_cc(dev), varlen=packed is not None)
    out_accum = lse_accum = None
    if plan.num_splits > 1:  # dense batches only
        out_accum = cupy.empty((plan.num_splits, batch, nheads_q, seqlen_q, plan.head_dim_padded), cupy.float32)
        lse_accum = cupy.empty((plan.num_splits, batch, nheads_q, seqlen_q), cupy.float32)
    qs, ks, vs, os_ = (seq_strides(a) for a in (q, k, v, out))
    params = _FWD_PACK.pack(
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr,
        out_accum.data.ptr if out_accum is not None else 0,
        lse_accum.data.ptr if lse_accum is not None else 0,
        cu_q, cu_k,
        *qs, *ks, *vs, *os_, *lse_strides(lse),
        batch, nheads_q, nheads_kv, seqlen_q, seqlen_k, head_dim,
        plan.num_m_blocks, plan.num_splits, plan.n_blocks_per_split,
        softmax_scale, softmax_scale * LOG2E,
    )
    stream = cupy.cuda.get_current_stream().ptr
    launch(plan.main, params, stream)
    if plan.combine is not None:
        launch(plan.combine, params, stream)
    return out, lse


def bwd(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, deterministic: bool = False,
        dtype: str | None = None):
    """Backward on the GPU. Returns ``(dq, dk, dv)``."""
    from . import _gpu_bwd  # noqa: PLC0415

    return _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                        deterministic=deterministic, dtype=dtype)


def varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               softmax_scale: float, causal: bool, deterministic: bool = False, dtype: str | None = None):
    """Backward over a packed batch on the GPU (see varlen_fwd). Returns ``(dq, dk, dv)``."""
    from . import _gpu_bwd  # noqa: PLC0415

    return _gpu_bwd.varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                               dtype=dtype)
