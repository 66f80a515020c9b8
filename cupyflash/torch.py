"""cupyflash inside PyTorch: autograd, ``torch.compile`` and flash-attention's API.

:func:`flash_attn_func` takes the arguments of flash-attention's function of
the same name, in the (batch, seqlen, nheads, head_dim) layout, and is
differentiable.  It is built on two custom operators,

* ``torch.ops.cupyflash.flash_attn(q, k, v, softmax_scale, causal,
  deterministic) -> (out, lse)``, differentiable in q, k and v, and
* ``torch.ops.cupyflash.flash_attn_bwd(dout, q, k, v, out, lse,
  softmax_scale, causal, deterministic) -> (dq, dk, dv)``,

registered with ``torch.library.custom_op`` together with their shapes
(``register_fake``), so ``torch.compile(..., fullgraph=True)`` keeps them in
the graph as opaque nodes instead of breaking it.  In eager mode
:func:`flash_attn_func` runs :class:`FlashAttnFunc`, a plain
``torch.autograd.Function`` over the same kernels (identical results): the
custom-op dispatch costs tens of microseconds per call that eager mode does
not need.  Outputs and scratch memory come from torch's caching allocator, and
nothing synchronises the host, so ``torch.cuda.graph`` captures a training
step through :func:`flash_attn_func` (warm up once first: the first call of
each shape compiles its kernels).

CUDA tensors run the GPU kernels on ``torch.cuda.current_stream()``, reading and
writing torch's memory in place (through DLPack); CPU tensors run cupyflash's
tiled CPU path.  dtypes: float16 and bfloat16 on the GPU; float16, bfloat16,
float32 and float64 on the CPU.

:func:`flash_attn_with_kvcache` is flash-attention's function of that name
(decoding against a KV cache, the new keys and values appended into the
caller's cache tensors in place).  It has no backward, as in flash-attention.
In eager mode it calls :func:`cupyflash.flash_attn_with_kvcache` directly;
under ``torch.compile`` it is the custom operator
``torch.ops.cupyflash.flash_attn_with_kvcache``, registered with
``mutates_args=("k_cache", "v_cache")``.

Importing this module imports torch; importing ``cupyflash`` does not.

Examples
--------
>>> import torch
>>> from cupyflash.torch import flash_attn_func
>>> q = torch.randn(2, 128, 8, 64, dtype=torch.float16, device="cuda", requires_grad=True)
>>> k = torch.randn(2, 128, 2, 64, dtype=torch.float16, device="cuda", requires_grad=True)
>>> v = torch.randn_like(k, requires_grad=True)
>>> flash_attn_func(q, k, v, causal=True).sum().backward()   # doctest: +SKIP
"""

import torch

from . import _api, _kvcache, _torch_path

__all__ = ["FlashAttnFunc", "flash_attn_func", "flash_attn_with_kvcache"]


def _unit_last_stride(x):
    """``x`` itself when its last stride is 1 element, else a contiguous copy (as flash-attn)."""
    return x if x.dim() == 0 or x.stride(-1) == 1 else x.contiguous()


# ----------------------------------------------------------------------------
# Custom operators
# ----------------------------------------------------------------------------


@torch.library.custom_op(
    "cupyflash::flash_attn", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
           "bool deterministic) -> (Tensor, Tensor)")
def _flash_attn_op(q, k, v, softmax_scale, causal, deterministic):
    # deterministic is used by the backward only; it is an input so autograd sees it.
    out, lse = _api.flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)
    return out, lse


@_flash_attn_op.register_fake
def _flash_attn_fake(q, k, v, softmax_scale, causal, deterministic):
    batch, seqlen_q, nheads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads_q, seqlen_q), dtype=torch.float32)


@torch.library.custom_op(
    "cupyflash::flash_attn_bwd", mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
           "float softmax_scale, bool causal, bool deterministic) -> (Tensor, Tensor, Tensor)")
def _flash_attn_bwd_op(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    dq, dk, dv = _api.flash_attn_bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                                     causal=causal, deterministic=deterministic)
    return dq, dk, dv


@_flash_attn_bwd_op.register_fake
def _flash_attn_bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.cupyflash.flash_attn_bwd(
        _unit_last_stride(dout), q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
        ctx.deterministic)
    return dq, dk, dv, None, None, None


_flash_attn_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------


class FlashAttnFunc(torch.autograd.Function):
    """``out = FlashAttnFunc.apply(q, k, v, softmax_scale, causal, deterministic)``.

    The autograd.Function form of :func:`flash_attn_func` (all six arguments
    required, ``softmax_scale`` a float), which eager mode runs: it calls the
    kernels directly (cupyflash's lean torch path), without the custom-op
    dispatch.  Saves q, k, v and out for the backward (``save_for_backward``:
    saved-tensor hooks see them), and keeps lse, which it made and does not
    return; the attention matrix is never stored.
    """

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic):
        out, ctx.lse, ctx.backward_plans = _torch_path.fwd(q, k, v, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out)
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = _torch_path.bwd(ctx.backward_plans, _unit_last_stride(dout), q, k, v, out, ctx.lse,
                                     ctx.softmax_scale, ctx.causal, ctx.deterministic)
        return dq, dk, dv, None, None, None


def _unsupported(option, rule, value, fn="flash_attn_func"):
    raise NotImplementedError(
        f"cupyflash.torch.{fn}: {option} must be {rule} ({option} is not "
        f"implemented); got {value!r}.")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, softcap=0.0):
    """Exact attention for torch tensors, differentiable; flash-attention's signature.

    Parameters
    ----------
    q : torch.Tensor, shape (batch, seqlen_q, nheads_q, head_dim)
        float16 or bfloat16 on a CUDA device (float16, bfloat16, float32 or
        float64 on the CPU).  A last stride other than 1 is made contiguous
        first (a copy); any other strides are read in place.
    k, v : torch.Tensor, shape (batch, seqlen_k, nheads_kv, head_dim)
        Same dtype and device as q; ``nheads_q`` a multiple of ``nheads_kv``
        (GQA/MQA, never expanded in memory).
    dropout_p : float
        Must be 0.0: dropout is not implemented.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool
        Causal mask aligned bottom-right (see :func:`cupyflash.flash_attn_fwd`).
    window_size : (int, int)
        Must be (-1, -1): local attention is not implemented.
    alibi_slopes : None
        Must be None: ALiBi is not implemented.
    deterministic : bool
        Bitwise reproducible backward (slower; see :func:`cupyflash.flash_attn_bwd`).
    return_attn_probs : bool
        Must be False.
    softcap : float, keyword-only
        Must be 0.0: softcapping is not implemented.

    Returns
    -------
    out : torch.Tensor, shape (batch, seqlen_q, nheads_q, head_dim), dtype of q

    Raises
    ------
    NotImplementedError
        An unsupported option is set; the message names it.
    TypeError, ValueError
        As :func:`cupyflash.flash_attn_fwd` for the tensors.
    """
    if dropout_p != 0.0:
        _unsupported("dropout_p", "0.0", dropout_p)
    if tuple(window_size) != (-1, -1):
        _unsupported("window_size", "(-1, -1)", window_size)
    if alibi_slopes is not None:
        _unsupported("alibi_slopes", "None", type(alibi_slopes).__name__)
    if return_attn_probs:
        _unsupported("return_attn_probs", "False", return_attn_probs)
    if softcap != 0.0:
        _unsupported("softcap", "0.0", softcap)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0  # 0: rejected later
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    if _is_compiling():  # an opaque node in the graph, differentiable through its registered autograd
        out, _ = torch.ops.cupyflash.flash_attn(q, k, v, float(softmax_scale), bool(causal),
                                                bool(deterministic))
        return out
    return FlashAttnFunc.apply(q, k, v, float(softmax_scale), bool(causal), bool(deterministic))


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


# ----------------------------------------------------------------------------
# flash_attn_with_kvcache: decoding against a KV cache, appended in place
# ----------------------------------------------------------------------------


@torch.library.custom_op(
    "cupyflash::flash_attn_with_kvcache", mutates_args=("k_cache", "v_cache"),
    schema="(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
           "Tensor? cache_seqlens, int? cache_seqlens_int, Tensor? cache_batch_idx, "
           "Tensor? block_table, float softmax_scale, bool causal, int num_splits) "
           "-> (Tensor, Tensor)")
def _kvcache_op(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, cache_batch_idx,
                block_table, softmax_scale, causal, num_splits):
    # cache_seqlens is a tensor or an int: the schema has a slot for each (at most one given).
    out, lse = _kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v,
        cache_seqlens=cache_seqlens if cache_seqlens is not None else cache_seqlens_int,
        cache_batch_idx=cache_batch_idx, block_table=block_table, softmax_scale=softmax_scale,
        causal=causal, num_splits=num_splits, return_lse=True)
    return out, lse


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, cache_batch_idx,
                  block_table, softmax_scale, causal, num_splits):
    batch, seqlen_q, nheads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads_q, seqlen_q), dtype=torch.float32)


_increment_version = (getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
                      or torch._C._increment_version)  # noqa: SLF001


def _mark_written(*tensors):
    """Tell autograd that ``tensors`` were written in place behind its back (their
    version counters, which catch a tensor saved for a backward and changed since);
    inference tensors have none."""
    for t in tensors:
        if not t.is_inference():
            _increment_version(t)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                            cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, num_splits=0, return_lse=False, rotary_cos=None,
                            rotary_sin=None, cache_leftpad=None, window_size=(-1, -1),
                            softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                            return_softmax_lse=False):
    """Attention of new queries against a KV cache for torch tensors, appending in place.

    flash-attention's ``flash_attn_with_kvcache``, over
    :func:`cupyflash.flash_attn_with_kvcache` (whose docstring has the full
    semantics): if ``k`` and ``v`` are given they are written into the caller's
    ``k_cache``/``v_cache`` tensors at positions ``cache_seqlens[b] ...``; then
    ``q[b]`` attends to the sequence's first ``cache_seqlens[b] + seqlen_new``
    cache entries.  Inference only: no gradient flows through it (flash-
    attention's function has no backward either), so ``out`` and ``lse`` never
    require grad, whatever the inputs do.

    CUDA tensors run the GPU path on ``torch.cuda.current_stream()``, CPU
    tensors the CPU path; every tensor (the index tensors too) must be on q's
    device.  In eager mode the core function runs directly; under
    ``torch.compile`` the call is the custom operator
    ``torch.ops.cupyflash.flash_attn_with_kvcache`` (declared to mutate
    ``k_cache`` and ``v_cache``), so ``fullgraph=True`` works.

    Parameters
    ----------
    q : torch.Tensor, shape (batch, seqlen_q, nheads_q, head_dim)
        float16 or bfloat16 on a CUDA device (float16, bfloat16, float32 or
        float64 on the CPU).  A last stride other than 1 is made contiguous
        first (a copy), as for ``k`` and ``v``.
    k_cache, v_cache : torch.Tensor, shape (batch_cache, seqlen_cache, nheads_kv, head_dim)
        q's dtype and device, unit last stride (never copied: the append
        writes into them).  With ``block_table``: shape (num_blocks,
        page_size, nheads_kv, head_dim), ``page_size`` a positive multiple of
        16.  ``nheads_q`` a multiple of ``nheads_kv`` (GQA/MQA).
    k, v : torch.Tensor, shape (batch, seqlen_new, nheads_kv, head_dim), optional
        New keys and values to append, both or neither; q's dtype and device.
    cache_seqlens : int or torch.Tensor, shape (batch,), int32, optional
        The number of valid cache entries of each sequence before the append
        (an int: the same for all).  None: the whole cache is valid (no room to
        append).  Not modified: the caller advances it.
    cache_batch_idx : torch.Tensor, shape (batch,), int32, optional
        The cache row each sequence uses.  Not with ``block_table``.
    block_table : torch.Tensor, shape (batch, max_blocks_per_seq), int32, optional
        Paged cache: entry ``p`` of row ``b`` is the block holding sequence
        ``b``'s keys ``p * page_size`` to ``(p + 1) * page_size - 1``.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool
        Causal mask aligned bottom-right: query ``i`` sees key ``j`` iff
        ``j <= i + seqlen_k_b - seqlen_q``.
    num_splits : int
        Splits of each sequence's keys on the GPU (0: automatic); any value
        gives the same result within rounding.
    return_lse : bool
        Also return the logsumexp (``return_softmax_lse``, flash-attention's
        name, does the same).
    rotary_cos, rotary_sin, cache_leftpad, alibi_slopes : None
        Must be None: not implemented.
    window_size : (int, int)
        Must be (-1, -1): local attention is not implemented.
    softcap : float
        Must be 0.0: softcapping is not implemented.
    rotary_interleaved : bool
        Ignored (it only matters with ``rotary_cos``).
    return_softmax_lse : bool
        As ``return_lse``.

    Returns
    -------
    out : torch.Tensor, shape (batch, seqlen_q, nheads_q, head_dim), dtype of q
    lse : torch.Tensor, shape (batch, nheads_q, seqlen_q), float32
        Only with ``return_lse`` (or ``return_softmax_lse``): the natural-log
        logsumexp of each row of scaled scores, ``-inf`` for a row that sees
        no key.

    Raises
    ------
    NotImplementedError
        An unsupported option is set (the message names it).
    TypeError, ValueError
        As :func:`cupyflash.flash_attn_with_kvcache` (messages name that
        function), including tensors of mixed dtypes or devices.  Under
        ``torch.compile`` they are raised when the compiled graph runs.

    Examples
    --------
    >>> import torch
    >>> from cupyflash.torch import flash_attn_with_kvcache
    >>> k_cache = torch.zeros(2, 64, 2, 16)
    >>> v_cache = torch.zeros(2, 64, 2, 16)
    >>> q, k, v = torch.ones(2, 1, 4, 16), torch.ones(2, 1, 2, 16), torch.ones(2, 1, 2, 16)
    >>> lens = torch.tensor([3, 10], dtype=torch.int32)
    >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)
    >>> float(k_cache[1, 10, 0, 0]), tuple(out.shape)   # the append, in the caller's tensor
    (1.0, (2, 1, 4, 16))
    """
    fn = "flash_attn_with_kvcache"
    for option, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                          ("cache_leftpad", cache_leftpad), ("alibi_slopes", alibi_slopes)):
        if value is not None:
            _unsupported(option, "None", type(value).__name__, fn)
    if tuple(window_size) != (-1, -1):
        _unsupported("window_size", "(-1, -1)", window_size, fn)
    if softcap != 0.0:
        _unsupported("softcap", "0.0", softcap, fn)
    if return_softmax_lse is True:
        return_lse = True
    q = _unit_last_stride(q)
    if k is not None:
        k = _unit_last_stride(k)
    if v is not None:
        v = _unit_last_stride(v)
    if _is_compiling():  # an opaque node in the graph, mutating k_cache and v_cache
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0  # 0: rejected later
        seqlens_tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
        seqlens_int = None if seqlens_tensor is not None or cache_seqlens is None else int(cache_seqlens)
        with torch.no_grad():  # no backward, as in eager mode
            out, lse = torch.ops.cupyflash.flash_attn_with_kvcache(
                q, k_cache, v_cache, k, v, seqlens_tensor, seqlens_int, cache_batch_idx,
                block_table, float(softmax_scale), bool(causal), int(num_splits))
        return (out, lse) if return_lse else out
    result = _kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        block_table=block_table, softmax_scale=softmax_scale, causal=causal,
        num_splits=num_splits, return_lse=return_lse)
    if k is not None:
        _mark_written(k_cache, v_cache)
    return result
