"""GPU backward: fills BwdParams, picks the kernels through dispatch, launches them.

Inputs arrive validated by ``_api`` (shapes, dtypes, unit last strides, one
device, non-empty).  Arrays are cupy ndarrays; bfloat16 data arrives as 2-byte
storage with ``dtype="bfloat16"`` named explicitly.  The gradients are
allocated here, C-contiguous in the inputs' storage dtype; the fp32 scratch
buffers are O(seqlen), never O(seqlen_q * seqlen_k):

* ``lse_log2``, ``delta``: (batch, nheads_q, seqlen_q_rounded), written by the
  preprocess kernel;
* ``dq_accum``: (batch, nheads_q, seqlen_q_rounded, head_dim_padded), the
  atomic dQ sum (default mode only; zeroed by the preprocess kernel);
* ``dkv_accum``: (2, kv_splits, batch, nheads_kv, seqlen_k, head_dim_padded),
  partial dK and dV when a GQA group is split over several blocks.

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
    import cupy  # noqa: PLC0415

    batch, seqlen_q, nheads_q, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
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
            num_sms=_gpu._num_sms(dev), cc=_gpu._cc(dev))
        rows = (batch, nheads_q, plan.seqlen_q_rounded)
        lse_log2 = cupy.empty(rows, dtype=cupy.float32)
        delta = cupy.empty(rows, dtype=cupy.float32)
        dq_accum = cupy.empty(rows + (plan.head_dim_padded,), dtype=cupy.float32) if plan.dq_accum else None
        dkv_accum = None
        if plan.kv_splits > 1:
            dkv_accum = cupy.empty((2, plan.kv_splits, batch, nheads_kv, seqlen_k, plan.head_dim_padded),
                                   dtype=cupy.float32)

        strides = [_gpu.element_strides(a)[:3] for a in (q, k, v, out, dout, dq, dk, dv)]
        lse_strides = _gpu.element_strides(lse)[:2]
        packed = _BWD_PACK.pack(
            q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr,
            dq.data.ptr, dk.data.ptr, dv.data.ptr,
            lse.data.ptr, lse_log2.data.ptr, delta.data.ptr,
            dq_accum.data.ptr if dq_accum is not None else 0,
            dkv_accum.data.ptr if dkv_accum is not None else 0,
            *(s for triple in strides for s in triple), *lse_strides,
            batch, nheads_q, nheads_kv, seqlen_q, seqlen_k, head_dim,
            plan.head_dim_padded, plan.seqlen_q_rounded, plan.num_stages, plan.kv_splits,
            softmax_scale, softmax_scale * _gpu.LOG2E,
        )
        stream = cupy.cuda.get_current_stream().ptr
        for launch in plan.launches:
            _gpu.launch(launch, packed, stream)
    return dq, dk, dv
