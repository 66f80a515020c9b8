"""GPU attention against a KV cache: plans a call once per signature; runs it.

Inputs arrive validated by :mod:`._kvcache` (shapes, dtypes, devices, unit last
strides; host-side lengths and indices checked when they are on the host).
Arrays are cupy ndarrays (or anything with their geometry: ``shape``,
``strides`` in bytes, ``itemsize``, ``data.ptr``).

:func:`plan_decode` returns a :class:`DecodeCall` (kernels_cu/flash_decode.cu:
the decode kernel, and the combine kernel when the keys are split), which
``_kvcache`` caches per call signature (its ``_ENTRIES``); :meth:`DecodeCall.run` only writes
pointers and launches.
"""

from __future__ import annotations

import functools

from . import _launch, _params, _variant, dispatch
from ._launch import LOG2E, Contiguous, vec_ok

select_decode = functools.lru_cache(maxsize=4096)(dispatch.select_decode)

#: DecodeParams' fields set on every call (in the struct's order): the pointers,
#: and the cache length that an int ``cache_seqlens`` gives (a decode loop
#: advances it every step; it must not make a new plan).
DECODE_POINTERS = ("q", "k_cache", "v_cache", "k_new", "v_new", "out", "lse", "out_accum", "lse_accum",
                   "cache_seqlens", "cache_batch_idx", "block_table", "seqused_k_out", "cache_seqlen")
_DECODE_WRITER = _params.FieldWriter(_params.DECODE_PARAMS, DECODE_POINTERS)
_VAR_WRITER = (_params.offset_of(_params.DECODE_PARAMS, "var"), _variant.WRITER)


class DecodeCall:
    """One planned decode call: its kernels, packed params and output shapes.

    ``run(stream, alloc, q, k_cache, v_cache, k_new, v_new, out, lse,
    cache_seqlens, cache_batch_idx, block_table, cache_seqlen, seqused_k_out=0, var=None)``
    takes device pointers (0 for an absent array) and the cache length used
    when ``cache_seqlens`` is 0; ``seqused_k_out``, an int32 ``(batch,)``
    buffer, receives each sequence's key count after the append; ``alloc(nbytes) -> (owner, pointer)`` provides the
    split partials, kept by the caller until the launches are queued.  ``var``:
    the variants' per-call values (``_variant.call_values``) of a plan made with
    variants, else None.

    ``launcher(stream, q, k_cache, v_cache, k_new, v_new, out, lse, out_accum, lse_accum,
    cache_seqlens, cache_batch_idx, block_table, seqused_k_out, cache_seqlen, var=None)``
    launches with the split partials at ``out_accum``/``lse_accum``: offsets
    ``accum_offsets`` into ``scratch_bytes`` bytes of 256-byte aligned scratch (for a
    caller that allocates the scratch with its outputs).
    """

    __slots__ = ("plan", "out_shape", "lse_shape", "scratch_bytes", "accum_offsets", "launcher")

    def __init__(self, plan, out_shape, lse_shape, scratch, launcher):
        self.plan, self.out_shape, self.lse_shape = plan, out_shape, lse_shape
        self.scratch_bytes, self.accum_offsets = scratch
        self.launcher = launcher

    def run(self, stream, alloc, q, k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens, cache_batch_idx,
            block_table, cache_seqlen, seqused_k_out=0, var=None):
        owner = None
        out_accum = lse_accum = 0
        if self.scratch_bytes:
            owner, base = alloc(self.scratch_bytes)
            out_accum, lse_accum = (base + o for o in self.accum_offsets)
        self.launcher(stream, q, k_cache, v_cache, k_new, v_new, out, lse, out_accum, lse_accum, cache_seqlens,
                       cache_batch_idx, block_table, seqused_k_out, cache_seqlen, var=var)
        return owner


def plan_decode(q, k_cache, v_cache, k_new, v_new, block_table, *, max_seqlen_k: int,
                softmax_scale: float, causal: bool, num_splits: int, dtype_name: str, device_id: int,
                append_only: bool = False, options=None) -> DecodeCall:
    """Plan a decode call on the current device (compiling its kernels on first use).

    ``k_new``/``v_new``: the keys and values to append, or None.  ``block_table``:
    the paged cache's table (its geometry only), or None for a dense cache.
    ``max_seqlen_k``: the
    cache's capacity per sequence, which bounds every sequence's keys after
    the append (sizes the key splits; device lengths are clamped to it).  Outputs are
    C-contiguous: out like q, lse ``(batch, nheads_q, seqlen_q)`` float32.
    ``append_only``: no attention (as if seqlen_q were 0): the launch appends
    and writes ``seqused_k_out``, for the dense forward that follows.
    ``options``: the variants on (``_checks.check_variants``; no dropout; a bias and
    mask as 4-D views whose last dimension is the key position), or None; a plan made
    with them is run with ``DecodeCall.run(..., var=...)``.
    An append-only plan ignores them (it attends to nothing).
    """
    if append_only or not options:
        options = {}
    batch, seqlen_q, nheads_q, head_dim = q.shape
    if append_only:
        seqlen_q = 0
    nheads_kv = k_cache.shape[2]
    out = Contiguous(q.shape, q.itemsize)
    appended = () if k_new is None else (k_new, v_new)
    plan = select_decode(
        batch=batch, seqlen_q=seqlen_q, nheads_q=nheads_q, nheads_kv=nheads_kv, head_dim=head_dim,
        max_seqlen_k=max_seqlen_k, dtype=dtype_name, causal=causal, paged=block_table is not None,
        vec=vec_ok((q, k_cache, v_cache, *appended), head_dim), num_splits=num_splits,
        num_sms=_launch.num_sms(device_id), cc=_launch.compute_capability(device_id),
        variant=_variant.decode_bits(options), window_left=options.get("window_size", (-1, -1))[0])
    lse_shape = (batch, nheads_q, q.shape[1])
    page_size = k_cache.shape[1] if block_table is not None else 0
    scratch = (0, (0, 0))
    if plan.num_splits > 1:
        rows = plan.num_splits * batch * nheads_q * seqlen_q
        scratch = _launch.scratch_layout((rows * plan.head_dim_padded * 4, rows * 4))
    strides = _launch.stride_fields(q=q, k=k_cache, v=v_cache, knew=k_new, vnew=v_new, o=out)
    template = _params.pack(
        _params.DECODE_PARAMS, **dict.fromkeys(DECODE_POINTERS, 0), **strides,
        block_table_batch_stride=0 if block_table is None else block_table.strides[0] // block_table.itemsize,
        batch=batch, nheads_q=nheads_q, nheads_kv=nheads_kv, seqlen_q=seqlen_q, head_dim=head_dim,
        seqlen_new=0 if k_new is None else k_new.shape[1],
        page_size=page_size, page_shift=page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1,
        cache_rows=k_cache.shape[0],
        capacity=max_seqlen_k,
        group=nheads_q // nheads_kv, num_m_blocks=plan.num_m_blocks, num_splits=plan.num_splits,
        softmax_scale=softmax_scale, softmax_scale_log2=softmax_scale * LOG2E,
        var=_variant.plan_fields(options, softmax_scale, nheads_q))
    launches = (plan.main,) if plan.combine is None else (plan.main, plan.combine)
    return DecodeCall(plan, tuple(q.shape), lse_shape, scratch,
                      _launch.Launcher(launches, template, _DECODE_WRITER, _VAR_WRITER))


def clear_plans() -> None:
    """Forget the memoised dispatch choices (after a dispatch table changed)."""
    select_decode.cache_clear()
