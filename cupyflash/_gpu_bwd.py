"""GPU backward: plans a call (dispatch, params, kernels) once per signature; runs it.

Inputs arrive validated by ``_api`` or ``_varlen`` (shapes, dtypes, unit last
strides, one device, non-empty).  Arrays are cupy ndarrays (or anything with
their geometry); bfloat16 data arrives as 2-byte storage with
``dtype="bfloat16"`` named explicitly.  Dense batches are ``(batch, seqlen,
nheads, head_dim)``; packed (varlen) batches ``(total, nheads, head_dim)`` with
``cu_seqlens`` read on the device, as in :mod:`._gpu`.  The gradients are
written where the caller says (allocated C-contiguous in the inputs' storage
dtype when not given); the fp32 scratch buffers are O(rows), never
O(seqlen_q * seqlen_k), with no padding (``total_q = batch * seqlen_q`` for a
dense batch, ``q.shape[0]`` for a packed one), in one allocation per call:

* ``lse_log2``, ``delta``: one value per query row, ``nheads_q * total_q``,
  written by the preprocess kernel;
* ``dq_accum``: ``(nheads_q * total_q, head_dim_padded)``, the atomic dQ sum
  (default mode only; zeroed by the preprocess kernel);
* ``dkv_accum``: ``(2, kv_splits, nheads_kv * total_k, head_dim_padded)``,
  partial dK and dV when a GQA group is split over several blocks.

Their rows are ordered like a contiguous lse: ``(batch, nheads, seqlen)``
dense, ``(nheads, total)`` packed (kernels_cu/flash_bwd.cu).

With GQA each dK/dV block loops over the query heads of its KV head (or a
share of them), so dk and dv are summed in a fixed order and K/V are never
expanded.
"""

from __future__ import annotations

import functools
import math

from . import _launch, _params, _tma, _variant, dispatch
from ._launch import LOG2E, Contiguous, lse_strides, vec_ok

select_bwd = functools.lru_cache(maxsize=4096)(dispatch.select_bwd)

#: BwdParams' pointer fields, set on every call (in the struct's order).
BWD_POINTERS = ("q", "k", "v", "out", "dout", "dq", "dk", "dv", "lse", "lse_log2", "delta", "dq_accum",
                "dkv_accum", "cu_seqlens_q", "cu_seqlens_k")
_BWD_WRITER = _params.FieldWriter(_params.BWD_PARAMS, BWD_POINTERS)
#: The pointers whose TMA maps BwdTmaParams carries, by their place in BWD_POINTERS.
_MAP_POINTERS = tuple(BWD_POINTERS.index(name) for name in ("q", "k", "v", "dout"))
#: ... and (a bias on the ws kernel: its bias_map) the bias's, by its place in the variants' call values.
_BIAS_MAP_VAR = _params.VARIANT_PER_CALL.index("attn_bias")


class BwdCall:
    """One planned backward: its kernels, packed params and scratch layout.

    ``run(stream, alloc, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=0,
    cu_seqlens_k=0)`` takes device pointers (ints) of arrays with the geometry
    it was planned for; ``alloc(nbytes) -> (owner, pointer)`` provides the
    scratch, which the caller may free once the launches are queued (stream
    order).  Returns the scratch's owner.
    """

    __slots__ = ("plan", "grads_bytes", "grads_offsets", "scratch_bytes", "block_map_tiles", "_offsets",
                 "_has_dq_accum", "_has_dkv_accum", "_launcher")

    def __init__(self, plan, grad_sizes, scratch, launcher):
        self.plan = plan
        #: (BLOCK_M, BLOCK_N) of the mask's tile maps the dK/dV and the dQ kernel read
        #: (VAR_BLOCK_MAP: VariantParams' kv_block_map, block_map), each None if not read
        self.block_map_tiles = dispatch.bwd_block_map_tiles(plan)
        # dq, dk and dv in one allocation, when the caller allocates them together
        self.grads_bytes, self.grads_offsets = _launch.scratch_layout(grad_sizes)
        self.scratch_bytes, self._offsets = scratch
        self._has_dq_accum = plan.dq_accum
        self._has_dkv_accum = plan.kv_splits > 1
        self._launcher = launcher

    def run(self, stream, alloc, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=0, cu_seqlens_k=0, var=None):
        """``var``: the variants' per-call values (``_variant.call_values``) of a plan
        made with variants, else None."""
        owner, base = alloc(self.scratch_bytes)
        o_log2, o_delta, o_dq, o_dkv = self._offsets
        pointers = (q, k, v, out, dout, dq, dk, dv, lse, base + o_log2, base + o_delta,
                    base + o_dq if self._has_dq_accum else 0, base + o_dkv if self._has_dkv_accum else 0,
                    cu_seqlens_q, cu_seqlens_k)
        self._launcher(stream, *pointers, var=var)
        return owner


def plan_bwd(dout, q, k, v, out, lse, dq, dk, dv, *, softmax_scale: float, causal: bool, deterministic: bool,
             dtype_name: str, device_id: int, packed=None, options=None) -> BwdCall:
    """Plan a backward on the current device (compiling its kernels on first use).

    ``dq``/``dk``/``dv`` are the arrays to write, or None for C-contiguous ones
    the caller allocates.  ``packed`` is None for a dense batch, else ``(batch,
    max_seqlen_q, max_seqlen_k)`` of a packed one.  ``options``: the variants on, or
    None (as ``_gpu.plan_fwd``'s).
    """
    nheads_q, head_dim = q.shape[-2:]
    nheads_kv = k.shape[-2]
    if packed is None:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        packed_totals = (0, 0)  # BwdParams.total_q/k and select_bwd's: 0 for a dense batch
        total_q, total_k = batch * seqlen_q, batch * seqlen_k
    else:
        batch, seqlen_q, seqlen_k = packed
        packed_totals = total_q, total_k = q.shape[0], k.shape[0]
    dq = Contiguous(q.shape, q.itemsize) if dq is None else dq
    dk = Contiguous(k.shape, k.itemsize) if dk is None else dk
    dv = Contiguous(v.shape, v.itemsize) if dv is None else dv
    plan = select_bwd(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=nheads_q, nheads_kv=nheads_kv,
        head_dim=head_dim, dtype=dtype_name, causal=causal, deterministic=deterministic,
        vec=vec_ok((q, k, v, out, dout, dq, dk, dv), head_dim),
        num_sms=_launch.num_sms(device_id), cc=_launch.compute_capability(device_id), varlen=packed is not None,
        total_q=packed_totals[0], total_k=packed_totals[1], variant=_variant.plan_bits(options) if options else 0,
        dbias_shape=_variant.dbias_shape(options) if options else None, ws=dispatch.BWD_WS,
        ws_bias=dispatch.BWD_WS_BIAS if not options or _variant.bias_tma_ok(options) else ())
    kv_tile, q_tile = dispatch.bwd_block_map_tiles(plan)  # VAR_BLOCK_MAP: the dK/dV and dQ kernels' maps
    rows_q = nheads_q * total_q  # the row buffers: one row per query (key) row, per head
    scratch = _launch.scratch_layout((
        rows_q * 4, rows_q * 4,
        rows_q * plan.head_dim_padded * 4 if plan.dq_accum else 0,
        2 * plan.kv_splits * nheads_kv * total_k * plan.head_dim_padded * 4 if plan.kv_splits > 1 else 0))
    strides = _launch.stride_fields(q=q, k=k, v=v, o=out, do=dout, dq=dq, dk=dk, dv=dv)
    lse_batch_stride, lse_head_stride = lse_strides(lse)
    template = _params.pack(
        _params.BWD_PARAMS, **dict.fromkeys(BWD_POINTERS, 0), **strides,
        lse_batch_stride=lse_batch_stride, lse_head_stride=lse_head_stride,
        batch=batch, nheads_q=nheads_q, nheads_kv=nheads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        total_q=packed_totals[0], total_k=packed_totals[1], head_dim=head_dim,
        head_dim_padded=plan.head_dim_padded, num_stages=plan.num_stages, kv_splits=plan.kv_splits,
        softmax_scale=softmax_scale, softmax_scale_log2=softmax_scale * LOG2E,
        var=_variant.plan_fields(options or {}, softmax_scale, nheads_q, block_map_tile=q_tile,
                                 kv_block_map_tile=kv_tile))
    grad_sizes = tuple(math.prod(x.shape) * x.itemsize for x in (q, k, v))
    maps = None
    if plan.tma_box_rows is not None:  # BwdTmaParams: BwdParams, then the maps of q, k, v, dout (, the bias)
        template += bytes(_params.BWD_TMA_PARAMS.itemsize - len(template))
        seq_maps = _tma.seq_maps((q, k, v, dout), dtype_name, plan.tma_box_rows)
        offset = _params.offset_of(_params.BWD_TMA_PARAMS, "q_map")
        bias = (options or {}).get("attn_bias")
        if bias is None:  # (a ws plan with a bias has it on the ws kernel: dispatch.uses_ws_bwd)
            maps = (offset, _tma.MapCache(seq_maps), _MAP_POINTERS)
        else:  # its box: the step's query rows by 64 keys
            bias_map = _tma.bias_map(dtype_name, bias.shape, _variant.broadcast_strides(bias), bias.itemsize,
                                     plan.tma_box_rows[0])
            maps = (offset, _tma.MapCache((*seq_maps, bias_map)), _MAP_POINTERS, (_BIAS_MAP_VAR,))
    return BwdCall(plan, grad_sizes, scratch,
                   _launch.Launcher(plan.launches, template, _BWD_WRITER, _VAR_WRITER, maps))


_VAR_WRITER = (_params.offset_of(_params.BWD_PARAMS, "var"), _variant.WRITER)


def variant_bwd(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, deterministic: bool,
                dtype_name: str, options, dq=None, dk=None, dv=None, packed=None):
    """A backward with variants on the GPU (``options`` not empty); ``packed`` as in
    :func:`_run_bwd`. Returns ``(dq, dk, dv)``, then ``dsinks`` (float32
    ``(nheads_q,)``, summed over the batch and rows) when sinks are on, then ``dbias``
    with ``options["return_dbias"]``: in the bias's 4-D shape (``_variant.dbias_shape``)
    and dtype, C-contiguous, dS summed over the bias's broadcast (size-1) dimensions; a
    packed batch's sequence ``b`` adds into ``dbias[b, :, :len_q, :len_k]`` (its block
    of the bias), and the rest is 0.

    dbias comes from its own kernel (kernels_cu/flash_bwd_dbias.cu), one block per tile
    of it summing in registers, in a fixed order, over what broadcasts onto the tile,
    then writing every element of the tile once (zeros where nothing reaches it): no
    atomics, so it is bitwise reproducible in any mode, and allocated uninitialised."""
    with q.device:
        return _run_bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype_name, packed,
                        dq, dk, dv, options)


PLANS = _launch.PlanCache()


def clear_plans() -> None:
    """Forget every cached plan (after a dispatch table changed)."""
    PLANS.clear()
    select_bwd.cache_clear()


def bwd(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, deterministic: bool = False,
        dtype: str | None = None, dq=None, dk=None, dv=None):
    """Backward on the GPU. Returns ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``.

    ``deterministic`` computes dq in a separate kernel that sums key blocks in
    a fixed order instead of with atomics: bitwise reproducible, slower.
    ``dq``/``dk``/``dv``: preallocated (validated) gradients to write, or None.
    """
    with q.device:
        return _run_bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype, None,
                        dq, dk, dv)


def varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               softmax_scale: float, causal: bool, deterministic: bool = False, dtype: str | None = None):
    """Backward over a packed batch in one pass of launches (see ``_gpu.varlen_fwd``).

    dout, q, out ``(total_q, nheads_q, head_dim)``, k, v ``(total_k, nheads_kv,
    head_dim)``, lse ``(nheads_q, total_q)``. Returns ``(dq, dk, dv)`` shaped
    and typed like ``(q, k, v)``.
    """
    with q.device:
        return _run_bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype,
                        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), None, None, None)


def _run_bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype, packed, dq, dk, dv,
             options=None):
    """``packed``: None for a dense batch, else (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    ``options``: the variants on, or None (the result ends with ``dsinks`` with sinks, then
    ``dbias`` with ``return_dbias``)."""
    import cupy  # noqa: PLC0415

    if q.size == 0 or k.size == 0:  # nothing sees anything: every gradient is 0
        grads = tuple(cupy.zeros(x.shape, dtype=x.dtype) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v)))
        for g in grads:
            g.fill(0)
        if options and "sinks" in options:
            grads += (cupy.zeros(q.shape[-2], dtype=cupy.float32),)
        if options and _variant.dbias_shape(options) is not None:
            grads += (cupy.zeros(_variant.dbias_shape(options), dtype=options["attn_bias"].dtype),)
        return grads
    device_id = q.data.device_id
    dims = None if packed is None else (packed[0].shape[0] - 1, int(packed[2]), int(packed[3]))
    dtype_name = dtype if dtype is not None else q.dtype.name
    key = (_launch.geometry(dout, q, k, v, out, lse, dq, dk, dv), device_id, softmax_scale, causal,
           deterministic, dtype_name, dims)
    dsinks = dbias = var = None
    if options:
        options = _variant.contiguous(options)
        key += (_variant.plan_key(options),)
        if "sinks" in options:
            dsinks = cupy.zeros(q.shape[-2], dtype=cupy.float32)
        if _variant.dbias_shape(options) is not None:  # every element written by the dbias kernel
            dbias = cupy.empty(_variant.dbias_shape(options), dtype=options["attn_bias"].dtype)
    call = PLANS.get_or_make(key, lambda: plan_bwd(
        dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
        deterministic=deterministic, dtype_name=dtype_name, device_id=device_id, packed=dims, options=options))
    if options:  # with the mask's tile maps of the kernels that read one (kept until the launches are queued)
        kv_tile, q_tile = call.block_map_tiles
        maps = _variant.block_maps(options, (q_tile, kv_tile))
        var = _variant.call_values(options, *(0 if x is None else x.data.ptr for x in (dsinks, dbias, *maps)))
    dq = cupy.empty(q.shape, dtype=q.dtype) if dq is None else dq
    dk = cupy.empty(k.shape, dtype=k.dtype) if dk is None else dk
    dv = cupy.empty(v.shape, dtype=v.dtype) if dv is None else dv
    cu = (0, 0) if packed is None else (packed[0].data.ptr, packed[1].data.ptr)
    call.run(cupy.cuda.get_current_stream().ptr, _launch.cupy_alloc, dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr,
             out.data.ptr, lse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr, *cu, var=var)
    return (dq, dk, dv) + tuple(x for x in (dsinks, dbias) if x is not None)
