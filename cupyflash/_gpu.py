"""GPU forward: plans a call (dispatch, params, kernels) once per signature; runs it.

Inputs arrive validated by ``_api`` or ``_varlen`` (rank, shapes, dtypes, unit
last stride, non-empty; ``cu_seqlens`` int32, contiguous, consistent with
``max_seqlen``).  Arrays are cupy ndarrays (or anything with their geometry:
``shape``, ``strides`` in bytes, ``itemsize``, ``data.ptr``); bfloat16 data
arrives as 2-byte storage with ``dtype="bfloat16"`` named explicitly.

Dense batches are ``(batch, seqlen, nheads, head_dim)`` tensors; packed
(varlen) batches ``(total, nheads, head_dim)`` tensors with ``cu_seqlens``,
which the kernels read on the device: one launch covers the whole batch, with
batch strides 0 and the longest lengths in ``seqlen_q``/``seqlen_k``
(kernels_cu/seqlens.cuh).

:func:`plan_fwd` returns a :class:`FwdCall`, which callers cache per call
signature (``_api`` for cupy arrays, ``_torch_path`` for torch tensors,
``jax`` inside XLA); :meth:`FwdCall.run` then only writes pointers and
launches.  :func:`fwd` and :func:`varlen_fwd` are the plain cupy entry points.
The backward lives in :mod:`._gpu_bwd` (which imports nothing from here).
"""

from __future__ import annotations

import functools

import numpy as np

from . import _gpu_bwd, _launch, _params, _tma, _variant, dispatch
from ._launch import LOG2E, Contiguous, element_strides, lse_strides, seq_strides, vec_ok  # noqa: F401

# Plans are pure functions of scalars: memoised here (not in dispatch, whose
# tables tests and `bench --fwd-tiles` patch) they cost ~0.1 us instead of ~10.
select_fwd = functools.lru_cache(maxsize=4096)(dispatch.select_fwd)
select_bwd = _gpu_bwd.select_bwd

#: FwdParams' pointer fields, set on every call (in the struct's order).
FWD_POINTERS = ("q", "k", "v", "out", "lse", "out_accum", "lse_accum", "cu_seqlens_q", "cu_seqlens_k",
                "seqused_k")
_FWD_WRITER = _params.FieldWriter(_params.FWD_PARAMS, FWD_POINTERS)


class FwdCall:
    """One planned forward: its kernels, packed params, and output shapes.

    ``run(stream, alloc, q, k, v, out, lse, cu_seqlens_q=0, cu_seqlens_k=0,
    seqused_k=0)`` takes device pointers (ints) of arrays with the geometry it
    was planned for (``seqused_k``: int32 ``(batch,)`` keys each sequence of a
    dense batch uses, or 0); ``alloc(nbytes) -> (owner, pointer)`` provides the split-KV scratch
    (kept by the caller until the launches are queued; stream order makes the
    memory safe to reuse afterwards).
    """

    __slots__ = ("plan", "out_shape", "lse_shape", "scratch_bytes", "block_map_tile", "_accum_offsets",
                 "_launcher")

    def __init__(self, plan, out_shape, lse_shape, scratch, launcher):
        self.plan, self.out_shape, self.lse_shape = plan, out_shape, lse_shape
        #: (BLOCK_M, BLOCK_N) of the mask's tile map the kernel reads (VAR_BLOCK_MAP), or None
        self.block_map_tile = dispatch.fwd_block_map_tile(plan)
        self.scratch_bytes, self._accum_offsets = scratch
        self._launcher = launcher

    def run(self, stream, alloc, q, k, v, out, lse, cu_seqlens_q=0, cu_seqlens_k=0, seqused_k=0, var=None):
        """``var``: the variants' per-call values (``_variant.call_values``) of a plan
        made with variants, else None."""
        owner = None
        out_accum = lse_accum = 0
        if self.scratch_bytes:
            owner, base = alloc(self.scratch_bytes)
            out_accum, lse_accum = (base + o for o in self._accum_offsets)
        self._launcher(stream, q, k, v, out, lse, out_accum, lse_accum, cu_seqlens_q, cu_seqlens_k, seqused_k,
                       var=var)
        return owner


def plan_fwd(q, k, v, out, lse, *, softmax_scale: float, causal: bool, dtype_name: str, device_id: int,
             packed=None, options=None, ws=None) -> FwdCall:
    """Plan a forward on the current device (compiling its kernels on first use).

    ``out``/``lse`` are the arrays to write, or None for C-contiguous ones the
    caller allocates (``FwdCall.out_shape``/``lse_shape``).  ``packed`` is None
    for a dense batch, else ``(batch, max_seqlen_q, max_seqlen_k)`` of a packed one.
    ``options``: the variants on (``_checks.check_variants``), or None; a plan
    made with them is run with ``FwdCall.run(..., var=_variant.call_values(...))``.
    ``ws``: where the warp-specialised kernel may serve the call (``dispatch.select_fwd``'s
    ``ws``, ``ws_block_map`` for a block-sparse call and ``ws_bias`` for a bias; None:
    ``dispatch.FWD_WS``, ``dispatch.FWD_WS_BLOCK_MAP`` and ``dispatch.FWD_WS_BIAS``); False
    for calls run with ``seqused_k`` (that kernel reads the keys past it).
    """
    nheads_q, head_dim = q.shape[-2:]
    nheads_kv = k.shape[-2]
    if packed is None:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        lse_shape = (batch, nheads_q, seqlen_q)
    else:
        batch, seqlen_q, seqlen_k = packed
        lse_shape = (nheads_q, q.shape[0])
    out = Contiguous(q.shape, q.itemsize) if out is None else out
    lse = Contiguous(lse_shape, 4) if lse is None else lse
    plan = select_fwd(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=nheads_q, head_dim=head_dim,
        dtype=dtype_name, causal=causal, vec=vec_ok((q, k, v, out), head_dim),
        num_sms=_launch.num_sms(device_id), cc=_launch.compute_capability(device_id), varlen=packed is not None,
        variant=_variant.plan_bits(options) if options else 0, ws=dispatch.FWD_WS if ws is None else ws,
        persistent=dispatch.FWD_WS_PERSISTENT, ws_block_map=dispatch.FWD_WS_BLOCK_MAP if ws is None else ws,
        ws_bias=dispatch.FWD_WS_BIAS if ws is None else ws)
    scratch = (0, (0, 0))
    if plan.num_splits > 1:  # dense batches only
        rows = plan.num_splits * batch * nheads_q * seqlen_q
        scratch = _launch.scratch_layout((rows * plan.head_dim_padded * 4, rows * 4))
    strides = _launch.stride_fields(q=q, k=k, v=v, o=out)
    lse_batch_stride, lse_head_stride = lse_strides(lse)
    template = _params.pack(
        _params.FWD_PARAMS, **dict.fromkeys(FWD_POINTERS, 0), **strides,
        lse_batch_stride=lse_batch_stride, lse_head_stride=lse_head_stride,
        batch=batch, nheads_q=nheads_q, nheads_kv=nheads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        head_dim=head_dim, num_m_blocks=plan.num_m_blocks, num_splits=plan.num_splits,
        n_blocks_per_split=plan.n_blocks_per_split,
        softmax_scale=softmax_scale, softmax_scale_log2=softmax_scale * LOG2E,
        var=_variant.plan_fields(options or {}, softmax_scale, nheads_q, dispatch.fwd_block_map_tile(plan)))
    launches = (plan.main,) if plan.combine is None else (plan.main, plan.combine)
    maps = None
    if plan.tma_box_rows is not None:  # FwdTmaParams: FwdParams, then the maps, rewritten per pointer
        template += bytes(_params.FWD_TMA_PARAMS.itemsize - len(template))
        q_rows, kv_rows = plan.tma_box_rows
        maps = (_params.offset_of(_params.FWD_TMA_PARAMS, "q_map"),
                _tma.maps_of((q, k, v), dtype_name, (q_rows, kv_rows, kv_rows)))
    return FwdCall(plan, tuple(q.shape), lse_shape, scratch,
                   _launch.Launcher(launches, template, _FWD_WRITER, _VAR_WRITER, maps))


_VAR_WRITER = (_params.offset_of(_params.FWD_PARAMS, "var"), _variant.WRITER)


def _storage_dtype_name(a, dtype: str | None) -> str:
    return dtype if dtype is not None else a.dtype.name


def fwd(q, k, v, *, softmax_scale: float, causal: bool, dtype: str | None = None, out=None, lse=None):
    """Forward on the GPU. Returns ``(out, lse)``; ``out`` has q's storage dtype.

    ``out``/``lse``: preallocated (validated) outputs to write, or None.
    """
    with q.device:  # allocate, compile and launch on the inputs' device
        return _run_fwd(q, k, v, softmax_scale, causal, dtype, out, lse, None)


def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               softmax_scale: float, causal: bool, dtype: str | None = None):
    """Forward over a packed batch on the GPU, in one launch.

    q ``(total_q, nheads_q, head_dim)``, k and v ``(total_k, nheads_kv,
    head_dim)``, ``cu_seqlens_q/k`` int32 ``(batch + 1,)`` on q's device and
    read only there. Returns ``(out, lse)``: out like q (its storage dtype), lse
    ``(nheads_q, total_q)`` float32.
    """
    with q.device:
        return _run_fwd(q, k, v, softmax_scale, causal, dtype, None, None,
                        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


def _run_fwd(q, k, v, softmax_scale, causal, dtype, out, lse, packed, options=None):
    """``packed``: None for a dense batch, else (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    ``options``: the variants on (``_checks.check_variants``'s), or None."""
    import cupy  # noqa: PLC0415

    device_id = q.data.device_id
    dims = None if packed is None else (packed[0].shape[0] - 1, int(packed[2]), int(packed[3]))
    dtype_name = _storage_dtype_name(q, dtype)
    key = (_launch.geometry(q, k, v, out, lse), device_id, softmax_scale, causal, dtype_name, dims)
    var = None
    if options:
        options = _variant.contiguous(options)
        key += (_variant.plan_key(options),)
    call = PLANS.get_or_make(key, lambda: plan_fwd(
        q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, dtype_name=dtype_name,
        device_id=device_id, packed=dims, options=options))
    block_map = None  # the mask's tile map (kept alive until the launch is queued)
    if options:
        if call.block_map_tile is not None:
            block_map, = _variant.block_maps(options, (call.block_map_tile,))
        var = _variant.call_values(options, block_map=0 if block_map is None else block_map.data.ptr)
    if out is None:
        out = cupy.empty(call.out_shape, dtype=q.dtype)
    if lse is None:
        lse = cupy.empty(call.lse_shape, dtype=np.float32)
    cu = (0, 0) if packed is None else (packed[0].data.ptr, packed[1].data.ptr)
    call.run(cupy.cuda.get_current_stream().ptr, _launch.cupy_alloc, q.data.ptr, k.data.ptr, v.data.ptr,
             out.data.ptr, lse.data.ptr, *cu, var=var)
    return out, lse


def variant_fwd(q, k, v, out, lse, *, softmax_scale: float, causal: bool, dtype_name: str, options,
                packed=None):
    """A forward with variants on the GPU (``options``: ``_checks.check_variants``'s,
    not empty); ``packed`` as in :func:`_run_fwd`. Returns ``(out, lse)``."""
    with q.device:
        return _run_fwd(q, k, v, softmax_scale, causal, dtype_name, out, lse, packed, options)


PLANS = _launch.PlanCache()


def clear_plans() -> None:
    """Forget every cached plan (after a dispatch table changed: bench's experiment
    switches): the planners' and the entry points' (``_launch.clear_plan_caches``) and
    the memoised dispatch choices."""
    _launch.clear_plan_caches()
    _gpu_bwd.clear_plans()
    select_fwd.cache_clear()


def bwd(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, deterministic: bool = False,
        dtype: str | None = None, dq=None, dk=None, dv=None):
    """Backward on the GPU. Returns ``(dq, dk, dv)`` (see :func:`._gpu_bwd.bwd`)."""
    return _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                        deterministic=deterministic, dtype=dtype, dq=dq, dk=dk, dv=dv)


varlen_bwd = _gpu_bwd.varlen_bwd
