"""GPU backward: fills BwdParams, picks the kernels through dispatch, launches them.

Inputs arrive validated by ``_api`` or ``_varlen`` (shapes, dtypes, unit last
strides, one device, non-empty).  Arrays are cupy ndarrays; bfloat16 data
arrives as 2-byte storage with ``dtype="bfloat16"`` named explicitly.  Dense
batches are ``(batch, seqlen, nheads, head_dim)``; packed (varlen) batches
``(total, nheads, head_dim)`` with ``cu_seqlens`` read on the device, as in
:mod:`._gpu`.  The gradients are allocated here, C-contiguous in the inputs'
storage dtype; the fp32 scratch buffers are O(rows), never O(seqlen_q *
seqlen_k), with no padding (``total_q = batch * seqlen_q`` for a dense batch,
``q.shape[0]`` for a packed one):

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

from . import _gpu, _params

_BWD_PACK = _gpu._struct_packer(_params.BWD_PARAMS)


def bwd(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, deterministic: bool = False,
        dtype: str | None = None):
    """Backward on the GPU. Returns ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``.

    ``deterministic`` computes dq in a separate kernel that sums key blocks in
    a fixed order instead of with atomics: bitwise reproducible, slower.
    """
    return _bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype, None)


def varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               softmax_scale: float, causal: bool, deterministic: bool = False, dtype: str | None = None):
    """Backward over a packed batch in one pass of launches (see ``_gpu.varlen_fwd``).

    dout, q, out ``(total_q, nheads_q, head_dim)``, k, v ``(total_k, nheads_kv,
    head_dim)``, lse ``(nheads_q, total_q)``. Returns ``(dq, dk, dv)`` shaped
    and typed like ``(q, k, v)``.
    """
    return _bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype,
                (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


def _bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype, packed):
    """``packed``: None for a dense batch, else (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    import cupy  # noqa: PLC0415

    nheads_q, head_dim = q.shape[-2:]
    nheads_kv = k.shape[-2]
    batch, seqlen_q, seqlen_k, cu_q, cu_k = _gpu.batch_shape(q, k, packed)
    # BwdParams.total_q/k and select_bwd's: the packed row counts (0 for a dense batch)
    packed_totals = (0, 0) if packed is None else (q.shape[0], k.shape[0])
    total_q, total_k = (batch * seqlen_q, batch * seqlen_k) if packed is None else packed_totals
    dtype_name = dtype if dtype is not None else str(q.dtype)
    with q.device:
        dq = cupy.empty(q.shape, dtype=q.dtype)
        dk = cupy.empty(k.shape, dtype=k.dtype)
        dv = cupy.empty(v.shape, dtype=v.dtype)
        if q.size == 0 or k.size == 0:  # nothing sees anything: every gradient is 0
            for g in (dq, dk, dv):
                g.fill(0)
            return dq, dk, dv

        dev = q.device.id
        plan = _gpu.select_bwd(
            batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=nheads_q, nheads_kv=nheads_kv,
            head_dim=head_dim, dtype=dtype_name, causal=causal, deterministic=deterministic,
            vec=_gpu.vec_ok((q, k, v, out, dout, dq, dk, dv), head_dim),
            num_sms=_gpu._num_sms(dev), cc=_gpu._cc(dev), varlen=packed is not None,
            total_q=packed_totals[0], total_k=packed_totals[1])
        # the row buffers: one row per query (key) row of the batch, per head
        rows_q = nheads_q * total_q
        lse_log2 = cupy.empty(rows_q, dtype=cupy.float32)
        delta = cupy.empty(rows_q, dtype=cupy.float32)
        dq_accum = cupy.empty((rows_q, plan.head_dim_padded), dtype=cupy.float32) if plan.dq_accum else None
        dkv_accum = None
        if plan.kv_splits > 1:
            dkv_accum = cupy.empty((2, plan.kv_splits, nheads_kv * total_k, plan.head_dim_padded),
                                   dtype=cupy.float32)

        strides = [_gpu.seq_strides(a) for a in (q, k, v, out, dout, dq, dk, dv)]
        params = _BWD_PACK.pack(
            q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr,
            dq.data.ptr, dk.data.ptr, dv.data.ptr,
            lse.data.ptr, lse_log2.data.ptr, delta.data.ptr,
            dq_accum.data.ptr if dq_accum is not None else 0,
            dkv_accum.data.ptr if dkv_accum is not None else 0,
            cu_q, cu_k,
            *(s for triple in strides for s in triple), *_gpu.lse_strides(lse),
            batch, nheads_q, nheads_kv, seqlen_q, seqlen_k, *packed_totals, head_dim,
            plan.head_dim_padded, plan.num_stages, plan.kv_splits,
            softmax_scale, softmax_scale * _gpu.LOG2E,
        )
        stream = cupy.cuda.get_current_stream().ptr
        for launch in plan.launches:
            _gpu.launch(launch, params, stream)
    return dq, dk, dv
