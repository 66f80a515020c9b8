"""The public functions: validate, then dispatch NumPy arrays to the CPU path and
CuPy arrays to the GPU kernels.  Other arrays (torch, JAX, anything with
``__dlpack__`` or ``__cuda_array_interface__``) go through :mod:`._interop`,
which views them as NumPy/CuPy arrays without copying, calls back in here and
hands the results back in the caller's type."""

from __future__ import annotations

from . import _checks, _interop, cpu

__all__ = ["flash_attn_fwd", "flash_attn_bwd", "flash_attn"]


def flash_attn_fwd(q, k, v, *, softmax_scale=None, causal=False, dtype=None):
    """Exact attention forward pass, ``softmax(q @ k.T * softmax_scale) @ v``.

    Computed tile by tile with an online softmax (FlashAttention-2), so the
    ``(seqlen_q, seqlen_k)`` score matrix is never stored.  NumPy arrays run the
    tiled CPU path (:mod:`cupyflash.cpu`); CuPy arrays run the CUDA kernels.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads_q, head_dim)
        Queries: a numpy.ndarray (CPU path), a cupy.ndarray (GPU), or a torch
        tensor, JAX array or other ``__dlpack__``/``__cuda_array_interface__``
        array (viewed without copying; see Notes).  dtype float16, bfloat16,
        float32 or float64 on the CPU (bfloat16 from ml_dtypes); float16 or
        bfloat16 on the GPU (bfloat16 cupy data as uint16/int16 storage with
        ``dtype="bfloat16"``).  Any strides as long as the last one is 1
        element; views are read in place, never copied.
    k : array, shape (batch, seqlen_k, nheads_kv, head_dim)
        Keys; same array type, dtype and device as ``q``.  ``nheads_q`` must be
        a multiple of ``nheads_kv`` (GQA; MQA when ``nheads_kv == 1``): query
        head ``h`` reads KV head ``h // (nheads_q // nheads_kv)``.  K and V are
        never expanded in memory.
    v : array, shape (batch, seqlen_k, nheads_kv, head_dim)
        Values; same array type, dtype and device as ``q``.
    softmax_scale : float, optional
        Scale of ``q @ k.T`` before the softmax; finite and > 0, within float32
        range (between 1.4e-45 and 2.36e38, as it is used in float32).  Defaults to
        ``1 / sqrt(head_dim)``.  The scaled scores are float32: where
        ``softmax_scale * q.k`` reaches about 1e7 in magnitude float32 no longer
        resolves them and accuracy is lost; the CPU backward clamps the exponent
        of P at 0 there and stays finite, the GPU kernels do not clamp it.  Where
        the scaled scores overflow float32 the result is undefined.
    causal : bool, optional
        Causal mask aligned to the bottom-right corner of the score matrix:
        query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.  With
        ``seqlen_q == seqlen_k`` that is the usual lower triangle.  Otherwise
        (1 = attended, 0 = masked)::

            seqlen_q=2, seqlen_k=5:      seqlen_q=5, seqlen_k=2:
                1 1 1 1 0                    0 0
                1 1 1 1 1                    0 0
                                             0 0
                                             1 0
                                             1 1

        A query row that sees no key (the top rows on the right) gets output
        0 and lse ``-inf``; its gradients are 0.  Nothing is NaN.
    dtype : str, optional
        The element type of cupy arrays held in 2-byte integer storage:
        ``"bfloat16"`` (or ``"float16"``) for uint16/int16 arrays of raw bits,
        since CuPy has no bfloat16 dtype.  ``None`` (default) or q's own dtype
        name otherwise; torch and JAX arrays carry their dtype and take None.

    Returns
    -------
    out : array, shape (batch, seqlen_q, nheads_q, head_dim)
        Same array type and dtype as ``q`` (uint16 storage stays uint16),
        C-contiguous.  Accumulated in float32.
    lse : array, shape (batch, nheads_q, seqlen_q), float32
        The natural-log logsumexp of each row of scaled, masked scores,
        ``log(sum_j exp(softmax_scale * q_i . k_j))``; the backward pass needs it.

    Raises
    ------
    TypeError
        An input is not an array (or is a numpy masked array, whose mask would be
        ignored), array types are mixed (numpy with cupy,
        torch with cupy, ...), a dtype is unsupported or differs between q, k
        and v, ``dtype`` does not fit the arrays, ``causal`` is not a bool, or
        ``softmax_scale`` is not a real number.
    ValueError
        An input is not 4-D; batch or head_dim differ between q, k and v;
        k and v differ in seqlen or nheads; ``nheads_q`` is not a multiple of
        ``nheads_kv``; head_dim is 0 or above 256; a last stride is not 1;
        arrays are on different devices; ``softmax_scale`` is not finite and > 0
        or is outside float32 range.

    See Also
    --------
    flash_attn_bwd : the gradients, from ``out`` and ``lse``.
    flash_attn : the output alone.
    cupyflash.reference.attention_fwd : the dense float64 reference.

    Notes
    -----
    Empty inputs (batch, seqlen_q or nheads 0) give empty results; with
    ``seqlen_k == 0`` every row sees no key (out 0, lse ``-inf``).  No kernel
    runs in either case.

    Other array types are viewed, not copied, and the results come back in
    the caller's type: torch CUDA tensors run on
    ``torch.cuda.current_stream()``, torch CPU tensors on the CPU path; JAX
    GPU arrays are exchanged through DLPack with its stream handshake, JAX
    CPU arrays run the CPU path.  Results are plain (non-differentiable)
    arrays: for gradients inside a framework use
    :func:`cupyflash.torch.flash_attn_func` or
    :func:`cupyflash.jax.flash_attention`.  All inputs must be of one array
    type and on one device.

    References
    ----------
    .. [1] T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism
       and Work Partitioning", 2023, arXiv:2307.08691.  Algorithm 1.

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 4, 2, 8), dtype=np.float32)
    >>> out, lse = cupyflash.flash_attn_fwd(q, q, q, causal=True)
    >>> out.shape, lse.shape
    ((1, 4, 2, 8), (1, 2, 4))
    """
    if _interop.foreign(q, k, v):
        return _interop.call("flash_attn_fwd", flash_attn_fwd, ("q", "k", "v"), (q, k, v),
                             dict(softmax_scale=softmax_scale, causal=causal), dtype)
    return _fwd("flash_attn_fwd", q, k, v, softmax_scale, causal, dtype)

def flash_attn_bwd(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False,
                   deterministic=False, dtype=None):
    """Exact attention backward pass: the gradients of ``flash_attn_fwd``.

    Recomputes the attention probabilities block by block from ``lse``
    instead of storing them.  With ``delta = rowsum(dout * out)``:
    ``dv = P.T @ dout``, ``dS = P * (dout @ v.T - delta)``,
    ``dq = softmax_scale * dS @ k``, ``dk = softmax_scale * dS.T @ q``.

    Parameters
    ----------
    dout : array, shape (batch, seqlen_q, nheads_q, head_dim)
        Gradient of the loss with respect to ``out``; same dtype as ``q``.
    q : array, shape (batch, seqlen_q, nheads_q, head_dim)
    k, v : array, shape (batch, seqlen_k, nheads_kv, head_dim)
        The forward inputs, with the same rules as in :func:`flash_attn_fwd`.
    out : array, shape (batch, seqlen_q, nheads_q, head_dim)
        The forward output; same dtype as ``q``.
    lse : array, shape (batch, nheads_q, seqlen_q), float32
        The forward logsumexp (natural log).
    softmax_scale : float, optional
        The forward's scale; defaults to ``1 / sqrt(head_dim)``.
    causal : bool, optional
        The forward's mask (see :func:`flash_attn_fwd` for the alignment).
    deterministic : bool, optional
        On the GPU, accumulate dq in a fixed order instead of with atomics, so
        repeated runs give identical bits (on the H200 at 0.94-1.14x the
        default's speed).  ``False`` promises no particular order: on compute
        capability 9.0, at head_dim 33-64 with 16-byte aligned inputs, the
        default takes the fixed-order path too, which measured faster there.  The CPU path is always deterministic
        and ignores it.
    dtype : str, optional
        As in :func:`flash_attn_fwd`: ``"bfloat16"`` for cupy arrays of raw
        bfloat16 bits in uint16/int16 storage (dout, q, k, v and out alike).

    Returns
    -------
    dq : array, shape (batch, seqlen_q, nheads_q, head_dim), dtype of ``q``
    dk : array, shape (batch, seqlen_k, nheads_kv, head_dim), dtype of ``k``
    dv : array, shape (batch, seqlen_k, nheads_kv, head_dim), dtype of ``v``
        With GQA, ``dk`` and ``dv`` are summed over the query heads that share
        each KV head.  Rows of ``q`` that see no key get ``dq`` 0.

    Raises
    ------
    TypeError
        As for :func:`flash_attn_fwd`; also when ``dout`` or ``out`` differ
        from ``q`` in dtype, ``lse`` is not float32, or ``deterministic`` is
        not a bool.
    ValueError
        As for :func:`flash_attn_fwd`; also when ``dout`` or ``out`` differ
        from ``q`` in shape, or ``lse`` is not (batch, nheads_q, seqlen_q).

    References
    ----------
    .. [1] T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism
       and Work Partitioning", 2023, arXiv:2307.08691.  Algorithm 2.
    """
    fn = "flash_attn_bwd"
    if _interop.foreign(dout, q, k, v, out, lse):
        return _interop.call(fn, flash_attn_bwd, ("dout", "q", "k", "v", "out", "lse"),
                             (dout, q, k, v, out, lse),
                             dict(softmax_scale=softmax_scale, causal=causal,
                                  deterministic=deterministic), dtype)
    gpu = _checks.check_qkv(fn, q, k, v, dtype)
    _checks.check_bwd_extras(fn, dout, out, lse, q)
    scale = _checks.check_flags(fn, softmax_scale, q.shape[3], causal, deterministic)
    causal = bool(causal)
    if _checks.is_empty(q, k):
        return _checks.empty_bwd(q, k, v, gpu)
    if not gpu:
        return cpu.bwd(dout, q, k, v, out, lse, scale, causal)
    from . import _gpu

    return _gpu.bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal,
                    deterministic=bool(deterministic), **_gpu_dtype(fn, dtype))


def flash_attn(q, k, v, *, softmax_scale=None, causal=False, dtype=None):
    """Exact attention, ``softmax(q @ k.T * softmax_scale) @ v``: the output alone.

    The same as ``flash_attn_fwd(q, k, v, ...)[0]``; see :func:`flash_attn_fwd`
    for the shapes, dtypes, the causal alignment and what is raised.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads_q, head_dim)
    k, v : array, shape (batch, seqlen_k, nheads_kv, head_dim)
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool, optional
        Bottom-right aligned causal mask.
    dtype : str, optional
        ``"bfloat16"`` for cupy arrays of raw bfloat16 bits (uint16/int16).

    Returns
    -------
    out : array, shape (batch, seqlen_q, nheads_q, head_dim), dtype of ``q``

    Raises
    ------
    TypeError, ValueError
        As for :func:`flash_attn_fwd`.

    References
    ----------
    .. [1] T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism
       and Work Partitioning", 2023, arXiv:2307.08691.  Algorithm 1.
    """
    if _interop.foreign(q, k, v):
        return _interop.call("flash_attn", flash_attn, ("q", "k", "v"), (q, k, v),
                             dict(softmax_scale=softmax_scale, causal=causal), dtype)
    return _fwd("flash_attn", q, k, v, softmax_scale, causal, dtype)[0]


def _fwd(fn, q, k, v, softmax_scale, causal, dtype):
    """Validate (errors name ``fn``), then run the CPU path or the GPU kernels."""
    gpu = _checks.check_qkv(fn, q, k, v, dtype)
    scale = _checks.check_flags(fn, softmax_scale, q.shape[3], causal)
    causal = bool(causal)
    if _checks.is_empty(q, k):
        return _checks.empty_fwd(q, gpu)
    if not gpu:
        return cpu.fwd(q, k, v, scale, causal)
    from . import _gpu

    return _gpu.fwd(q, k, v, softmax_scale=scale, causal=causal, **_gpu_dtype(fn, dtype))

def _gpu_dtype(fn, dtype):
    """``{"dtype": name}`` for the GPU module when ``dtype=`` was given (validated), else ``{}``."""
    return {} if dtype is None else {"dtype": _checks.dtype_name(fn, dtype)}
