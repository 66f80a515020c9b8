"""The public functions: validate, then dispatch NumPy arrays to the CPU path and
CuPy arrays to the GPU kernels.  Other arrays (torch, JAX, anything with
``__dlpack__`` or ``__cuda_array_interface__``) go through :mod:`._interop`,
which views them as NumPy/CuPy arrays without copying, calls back in here and
hands the results back in the caller's type (torch CUDA tensors take a lean
path of their own, :mod:`._torch_path`).

Each call is validated and planned once per call signature (see ``_fwd``):
a repeated call with the same shapes, strides, dtypes, device, alignment and
flags goes straight to the kernel launch."""

from __future__ import annotations

import sys

import numpy as np

from . import _checks, _interop, _launch, cpu
from ._checks import NOT_IMPLEMENTED as _OFF

__all__ = ["flash_attn_fwd", "flash_attn_bwd", "flash_attn"]

# flash-attention's options, off.  The defaults below are these very objects, so a
# call that leaves the options out is told by identity (nothing to check); any value
# given, an equal one too, goes through _checks.check_implemented, as in the varlen
# functions and on the torch path: a value is taken or refused alike everywhere.
_NO_DROPOUT, _NO_WINDOW, _NO_SOFTCAP = _OFF["dropout_p"], _OFF["window_size"], _OFF["softcap"]


@_interop.accepts_foreign("q", "k", "v")
def flash_attn_fwd(q, k, v, *, softmax_scale=None, causal=False, dtype=None, out=None, lse=None,
                   dropout_p=_NO_DROPOUT, window_size=_NO_WINDOW, alibi_slopes=None, softcap=_NO_SOFTCAP,
                   sinks=None, rng_state=None, attn_bias=None, attn_mask=None, return_rng_state=False):
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
    out : array, optional
        Preallocated output to write, of the same array type, device, shape and
        dtype as ``q``, with a unit last stride (any other strides, but not a
        broadcast view); returned.  NumPy outputs must be writeable and must not
        share memory with each other; on the CPU an output may be one of the
        inputs (the result is computed before it is written).  On the GPU
        outputs are not checked against the inputs: one that overlaps an input
        or another output gives an undefined result.
    lse : array, optional
        Preallocated lse to write: float32, shape (batch, nheads_q, seqlen_q),
        unit last stride; returned.
    dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state
        Attention variants (issue 13), on the CPU path and in the GPU kernels.
        ``softcap`` (float >= 0, 0 = off): scores ``s`` become ``softcap *
        tanh(s / softcap)``.  ``alibi_slopes`` (float32, (nheads_q,) or
        (batch, nheads_q)): adds ``-slope * |i + seqlen_k - seqlen_q - j|``
        after the softcap.  ``window_size=(left, right)`` (ints, -1 =
        unbounded): query ``i`` sees key ``j`` iff ``i + seqlen_k - seqlen_q -
        left <= j <= i + seqlen_k - seqlen_q + right`` (``causal`` sets right
        to 0).  ``sinks`` (float32, (nheads_q,)): a logit per head that joins
        every row's softmax denominator with no value (``lse`` includes it).
        ``dropout_p`` (in [0, 1)): probabilities are kept with probability
        ``1 - p`` and scaled by ``1 / (1 - p)``, the keep mask drawn by
        :mod:`cupyflash._philox` from ``(seed, offset, batch, head, row,
        column)`` alone; ``lse`` is that of the undropped softmax.
        ``rng_state=(seed, offset)`` (a 64-bit and a 32-bit int, optional) is
        the mask's state: the same state gives bitwise the same result, a
        different seed a different mask.  Left out (None) with ``dropout_p >
        0``, a fresh state is drawn from cupyflash's generator (see
        ``return_rng_state`` and :func:`cupyflash.manual_seed`); it is
        ignored without dropout.  The semantics are
        :func:`cupyflash.reference.attention_fwd`'s.
    attn_bias : array, optional
        An additive bias on the scores (issue 14), broadcastable by NumPy's
        rules to ``(batch, nheads_q, seqlen_q, seqlen_k)``: rank at most 4,
        left-padded with size-1 dimensions, each dimension 1 or full; e.g.
        ``(1, nheads_q, seqlen_q, seqlen_k)`` per head, ``(batch, 1, seqlen_q,
        seqlen_k)`` per batch element, ``(batch, 1, 1, seqlen_k)`` per key,
        ``(seqlen_q, seqlen_k)`` for all.  Same array type and device as ``q``;
        dtype ``q``'s (on the GPU, bfloat16 data's uint16/int16 storage) or
        float32.  Any strides: a stride-0 broadcast view or a slice of a larger
        array is read in place, never copied or expanded.  It is added to the
        scaled scores after the softcap and ALiBi::

            s = softcap * tanh(softmax_scale * q.k / softcap) - alibi + attn_bias

        A ``-inf`` entry hides the key from that row, as the causal mask does.
        The values are not checked (that would read every one on every call):
        a NaN or ``+inf`` entry makes its row's output and gradients NaN (its
        lse is then not meaningful).  Hide keys with ``-inf`` or ``attn_mask``,
        not with a large finite negative value: a row whose every score is
        about ``-1e7`` or below (``(1 - mask) * -1e9``) keeps its forward, but
        its lse, stored in float32, rounds to the row maximum, and the
        backward's recomputed probabilities, hence its gradients, are wrong
        (as in FlashAttention, whose backward also recomputes P from lse).
    attn_mask : array of bool, optional
        A keep-mask broadcastable like ``attn_bias``: True attends, False
        hides the key from the row (together with ``causal``, ``window_size``
        and ``-inf`` biases).  dtype bool: a float mask belongs in ``attn_bias``.
        A row that sees no key, whatever hides them, gets output 0, lse ``-inf``
        (``sinks[h]`` with sinks) and zero gradients; nothing is NaN.
    return_rng_state : bool, optional
        Also return the dropout state used, third: the ``rng_state`` given,
        or the one drawn when none was (None without dropout).  Pass it to
        :func:`flash_attn_bwd`, which draws the same mask from it.  Default
        False: ``(out, lse)`` alone.

    Returns
    -------
    out : array, shape (batch, seqlen_q, nheads_q, head_dim)
        Same array type and dtype as ``q`` (uint16 storage stays uint16),
        C-contiguous.  Accumulated in float32.
    lse : array, shape (batch, nheads_q, seqlen_q), float32
        The natural-log logsumexp of each row of final, masked scores,
        ``log(sum_j exp(s_ij))`` with ``s_ij = softmax_scale * q_i . k_j``
        modified by the variants (softcap, ALiBi, ``attn_bias``; with sinks
        ``+ exp(sinks[h])`` inside the sum); the backward pass needs it.
    rng_state : tuple of two ints, or None
        Only with ``return_rng_state=True``: ``(seed, offset)`` of the
        dropout mask, None when ``dropout_p`` is 0.

    Raises
    ------
    TypeError
        An input is not an array (or is a numpy masked array, whose mask would be
        ignored), array types are mixed (numpy with cupy,
        torch with cupy, ...), a dtype is unsupported or differs between q, k
        and v, ``dtype`` does not fit the arrays, ``causal`` is not a bool, or
        ``softmax_scale`` is not a real number; ``out``/``lse`` have the wrong
        array type or dtype.
    ValueError
        An input is not 4-D; batch or head_dim differ between q, k and v;
        k and v differ in seqlen or nheads; ``nheads_q`` is not a multiple of
        ``nheads_kv``; head_dim is 0 or above 256; a last stride is not 1;
        arrays are on different devices; ``softmax_scale`` is not finite and > 0
        or is outside float32 range; ``out``/``lse`` have the wrong shape,
        device or last stride, are broadcast views (a zero stride), or (numpy)
        are read-only or share memory with each other.
        A variant option is malformed: ``dropout_p`` outside [0, 1),
        ``softcap`` negative or not finite, ``window_size`` not two ints >= -1,
        ``alibi_slopes``/``sinks`` of the wrong shape or dtype, ``rng_state``
        out of range (not a pair of ints, or ``return_rng_state`` not a
        bool: a TypeError).  ``attn_bias`` or
        ``attn_mask`` has more than 4 dimensions or one that is neither 1 nor
        full, or is on another device (their wrong array type or dtype, a
        non-bool mask included, is a TypeError).

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

    A bias per head, shared by the batch, and a key-padding mask (the last key
    of the sequence hidden):

    >>> bias = rng.standard_normal((1, 2, 4, 4), dtype=np.float32)
    >>> keep = np.array([True, True, True, False])            # (seqlen_k,): every row
    >>> out, lse = cupyflash.flash_attn_fwd(q, q, q, attn_bias=bias, attn_mask=keep)
    >>> dq, dk, dv, dbias = cupyflash.flash_attn_bwd(np.ones_like(out), q, q, q, out, lse,
    ...                                              attn_bias=bias, attn_mask=keep, return_dbias=True)
    >>> dbias.shape, float(np.abs(dbias[..., 3]).max())
    ((1, 2, 4, 4), 0.0)

    Dropout: the forward draws its state when given none, and returns it
    for the backward (the same state, the same mask):

    >>> out, lse, state = cupyflash.flash_attn_fwd(q, q, q, dropout_p=0.1, return_rng_state=True)
    >>> again, _ = cupyflash.flash_attn_fwd(q, q, q, dropout_p=0.1, rng_state=state)
    >>> bool((again == out).all())
    True
    >>> dq, dk, dv = cupyflash.flash_attn_bwd(np.ones_like(out), q, q, q, out, lse, dropout_p=0.1,
    ...                                       rng_state=state)
    """
    if (dropout_p is not _NO_DROPOUT or window_size is not _NO_WINDOW or alibi_slopes is not None
            or softcap is not _NO_SOFTCAP or sinks is not None or rng_state is not None
            or attn_bias is not None or attn_mask is not None or return_rng_state is not False):
        return _variant_fwd("flash_attn_fwd", q, k, v, softmax_scale, causal, dtype, out, lse,
                            (dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state),
                            (attn_bias, attn_mask), return_rng_state)
    return _fwd("flash_attn_fwd", q, k, v, softmax_scale, causal, dtype, out, lse)


@_interop.accepts_foreign("dout", "q", "k", "v", "out", "lse")
def flash_attn_bwd(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False,
                   deterministic=False, dtype=None, dq=None, dk=None, dv=None,
                   dropout_p=_NO_DROPOUT, window_size=_NO_WINDOW, alibi_slopes=None, softcap=_NO_SOFTCAP,
                   sinks=None, rng_state=None, attn_bias=None, attn_mask=None, return_dbias=False):
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
        default takes the fixed-order path too, which measured faster there.  ``dsinks`` is summed with float
        atomics either way (not bitwise reproducible).  The CPU path is always
        deterministic and ignores it.
    dtype : str, optional
        As in :func:`flash_attn_fwd`: ``"bfloat16"`` for cupy arrays of raw
        bfloat16 bits in uint16/int16 storage (dout, q, k, v and out alike).
    dq, dk, dv : array, optional
        Preallocated gradients to write, each of the array type, device, shape
        and dtype of its input (``q``, ``k``, ``v``), with a unit last stride;
        returned.
    dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state
        As in :func:`flash_attn_fwd`, and the same as the forward was given
        (the dropout mask is drawn again from ``rng_state``).  With
        ``dropout_p > 0``, ``rng_state`` is required: the state the forward
        used (its own, or the one it drew, returned with
        ``return_rng_state=True``).
    attn_bias, attn_mask : array, optional
        As in :func:`flash_attn_fwd`, and the same as the forward was given.
    return_dbias : bool, optional
        Also return ``dbias``, the gradient of ``attn_bias`` (which must then be
        given).  ``False`` (default) computes no bias gradient.

    Returns
    -------
    dq : array, shape (batch, seqlen_q, nheads_q, head_dim), dtype of ``q``
    dk : array, shape (batch, seqlen_k, nheads_kv, head_dim), dtype of ``k``
    dv : array, shape (batch, seqlen_k, nheads_kv, head_dim), dtype of ``v``
        With GQA, ``dk`` and ``dv`` are summed over the query heads that share
        each KV head.  Rows of ``q`` that see no key get ``dq`` 0.
    dsinks : array, shape (nheads_q,), float32
        Only when ``sinks`` is given: the gradient of the sinks, summed over
        the batch and the rows, in the array type of ``q`` (on the GPU summed
        with float atomics: not bitwise reproducible).
    dbias : array, shape and dtype of ``attn_bias``
        Only with ``return_dbias``, last (after ``dsinks``): ``dS``, the
        gradient of the loss with respect to the final score ``s`` (after the
        softcap and ALiBi, through dropout), summed over every dimension the
        bias broadcasts (size 1 in its shape, or missing from it): a
        ``(seqlen_q, seqlen_k)`` bias gets the sum over batch and heads.  A
        stride-0 view is a full-size bias: its gradient is full-size.
        Accumulated in float32 (float64 for float64 inputs on the CPU path),
        in the array type of ``q``; 0 where a key is hidden and in rows that
        see no key.  As FlashAttention does, ``dS = P * (dP - delta)`` takes
        ``delta = rowsum(dout * out)`` from the ``out`` given, rounded to its
        dtype: the gradient of a bias broadcast over the keys (shape
        ``(..., seqlen_q, 1)``), exactly 0 since softmax is shift-invariant,
        comes back as that rounding (of the order of ``eps * |dout| * |out|``
        per row).

    Raises
    ------
    TypeError
        As for :func:`flash_attn_fwd`; also when ``dout`` or ``out`` differ
        from ``q`` in dtype, ``lse`` is not float32, ``deterministic`` is
        not a bool, or ``rng_state`` is missing with ``dropout_p > 0``;
        ``dq``/``dk``/``dv`` as ``out`` in :func:`flash_attn_fwd`.
    ValueError
        As for :func:`flash_attn_fwd`; also when ``dout`` or ``out`` differ
        from ``q`` in shape, or ``lse`` is not (batch, nheads_q, seqlen_q);
        ``dq``/``dk``/``dv`` as ``out`` in :func:`flash_attn_fwd`;
        ``return_dbias`` is True without ``attn_bias`` (a TypeError when it
        is not a bool).

    References
    ----------
    .. [1] T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism
       and Work Partitioning", 2023, arXiv:2307.08691.  Algorithm 2.
    """
    if (dropout_p is not _NO_DROPOUT or window_size is not _NO_WINDOW or alibi_slopes is not None
            or softcap is not _NO_SOFTCAP or sinks is not None or rng_state is not None
            or attn_bias is not None or attn_mask is not None or return_dbias is not False):
        return _variant_bwd("flash_attn_bwd", dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                            dtype, dq, dk, dv, (dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state),
                            (attn_bias, attn_mask, return_dbias))
    return _bwd("flash_attn_bwd", dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype,
                dq, dk, dv)


@_interop.accepts_foreign("q", "k", "v")
def flash_attn(q, k, v, *, softmax_scale=None, causal=False, dtype=None,
               dropout_p=_NO_DROPOUT, window_size=_NO_WINDOW, alibi_slopes=None, softcap=_NO_SOFTCAP,
               sinks=None, rng_state=None, attn_bias=None, attn_mask=None, return_rng_state=False):
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
    dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state
        Attention variants, as in :func:`flash_attn_fwd` (``rng_state``
        optional: drawn from cupyflash's generator when left out).
    attn_bias, attn_mask : array, optional
        An additive bias and a boolean keep-mask broadcastable to
        ``(batch, nheads_q, seqlen_q, seqlen_k)``, as in :func:`flash_attn_fwd`.
    return_rng_state : bool, optional
        Also return the dropout state used (None without dropout), as in
        :func:`flash_attn_fwd`: ``(out, rng_state)``.

    Returns
    -------
    out : array, shape (batch, seqlen_q, nheads_q, head_dim), dtype of ``q``
    rng_state : tuple of two ints, or None
        Only with ``return_rng_state=True``.

    Raises
    ------
    TypeError, ValueError
        As for :func:`flash_attn_fwd`.

    References
    ----------
    .. [1] T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism
       and Work Partitioning", 2023, arXiv:2307.08691.  Algorithm 1.
    """
    if (dropout_p is not _NO_DROPOUT or window_size is not _NO_WINDOW or alibi_slopes is not None
            or softcap is not _NO_SOFTCAP or sinks is not None or rng_state is not None
            or attn_bias is not None or attn_mask is not None or return_rng_state is not False):
        result = _variant_fwd("flash_attn", q, k, v, softmax_scale, causal, dtype, None, None,
                              (dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state),
                              (attn_bias, attn_mask), return_rng_state)
        return (result[0], result[2]) if len(result) == 3 else result[0]
    return _fwd("flash_attn", q, k, v, softmax_scale, causal, dtype, None, None)[0]


# ----------------------------------------------------------------------------
# Attention variants (issue 13): validated on every call, run on the GPU or the CPU path
# ----------------------------------------------------------------------------


def _variant_fwd(fn, q, k, v, softmax_scale, causal, dtype, out, lse, variants, scores=(None, None),
                 return_rng_state=False):
    """A forward with variant options given: the plain validation, the options',
    then the GPU kernels or the CPU path; all options off: the hot path.

    ``variants`` are issue 13's options in :func:`._checks.check_variants`' order,
    ``scores`` is ``(attn_bias, attn_mask)`` (issue 14).  With dropout and no
    ``rng_state`` the state is drawn from the library generator; with
    ``return_rng_state`` the state used (None without dropout) ends the result."""
    if return_rng_state is not False:
        return_rng_state = _checks.check_return_rng_state(fn, return_rng_state)
    result, options = _variant_fwd_run(fn, q, k, v, softmax_scale, causal, dtype, out, lse, variants, scores)
    return tuple(result) + (options.get("rng_state"),) if return_rng_state else result


def _variant_fwd_run(fn, q, k, v, softmax_scale, causal, dtype, out, lse, variants, scores):
    """``((out, lse), options)`` of :func:`_variant_fwd`."""
    gpu = _checks.check_qkv(fn, q, k, v, dtype)
    scale = _checks.check_flags(fn, softmax_scale, q.shape[3], causal)
    _checks.check_outputs(fn, q, {"out": (out, q), "lse": (lse, None)})
    attn_bias, attn_mask = scores
    options = _checks.check_variants(fn, q, gpu, *variants, softmax_scale=scale, attn_bias=attn_bias,
                                     attn_mask=attn_mask, seqlens=(q.shape[1], k.shape[1]), draw_rng=True)
    if not options:
        return _fwd(fn, q, k, v, softmax_scale, causal, dtype, out, lse), options
    if gpu:
        return _variant_fwd_gpu(fn, q, k, v, scale, causal, dtype, out, lse, options), options
    if out is not None or lse is not None:
        _checks.check_numpy_outputs(fn, (("out", out), ("lse", lse)))
    if q.size == 0 or k.shape[1] == 0:  # no query, or no key: out 0, lse -inf (the sink with sinks)
        o = np.zeros(q.shape, dtype=q.dtype)
        l = np.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf, dtype=np.float32)
        if "sinks" in options:
            l[...] = options["sinks"][None, :, None]
    else:
        o, l = cpu.fwd(q, k, v, scale, bool(causal), **options)
    return (_into(out, o), _into(lse, l)), options


def _variant_fwd_gpu(fn, q, k, v, scale, causal, dtype, out, lse, options):
    """The GPU forward with variants (``options`` validated, not empty)."""
    if q.size == 0 or k.shape[1] == 0:
        o, l = _checks.empty_fwd(q, True)
        if "sinks" in options and l.size:
            l[...] = options["sinks"][None, :, None]
        return _into(out, o), _into(lse, l)
    from . import _gpu

    dtype_name = _checks.dtype_name(fn, dtype) if dtype is not None else q.dtype.name
    return _gpu.variant_fwd(q, k, v, out, lse, softmax_scale=scale, causal=bool(causal), dtype_name=dtype_name,
                            options=options)


def _variant_bwd(fn, dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype, dq, dk, dv,
                 variants, scores=(None, None, False)):
    """The backward's counterpart of :func:`_variant_fwd`: ``(dq, dk, dv)``, then
    ``dsinks`` when sinks are given, then ``dbias`` with ``return_dbias``
    (``scores`` is ``(attn_bias, attn_mask, return_dbias)``)."""
    gpu = _checks.check_qkv(fn, q, k, v, dtype)
    _checks.check_bwd_extras(fn, dout, out, lse, q)
    scale = _checks.check_flags(fn, softmax_scale, q.shape[3], causal, deterministic)
    _checks.check_outputs(fn, q, {"dq": (dq, q), "dk": (dk, k), "dv": (dv, v)})
    attn_bias, attn_mask, return_dbias = scores
    options = _checks.check_variants(fn, q, gpu, *variants, softmax_scale=scale, attn_bias=attn_bias,
                                     attn_mask=attn_mask, return_dbias=return_dbias,
                                     seqlens=(q.shape[1], k.shape[1]))
    if not options:
        return _bwd(fn, dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype, dq, dk, dv)
    if gpu:
        return _variant_bwd_gpu(fn, dout, q, k, v, out, lse, scale, causal, deterministic, dtype, dq, dk, dv,
                                options, attn_bias)
    if dq is not None or dk is not None or dv is not None:
        _checks.check_numpy_outputs(fn, (("dq", dq), ("dk", dk), ("dv", dv)))
    if q.size == 0 or k.shape[1] == 0:
        grads = tuple(np.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
        if "sinks" in options:
            grads += (np.zeros(options["sinks"].shape, dtype=np.float32),)
        if "return_dbias" in options:
            grads += (np.zeros(attn_bias.shape, dtype=attn_bias.dtype),)
        return tuple(_into(g, r) for g, r in zip((dq, dk, dv), grads[:3])) + grads[3:]
    grads = cpu.bwd(dout, q, k, v, out, lse, scale, bool(causal), **options)
    if "return_dbias" in options:
        grads = grads[:-1] + (_finish_dbias(grads[-1], attn_bias, q.dtype.name),)
    result = tuple(_into(g, r) for g, r in zip((dq, dk, dv), grads[:3]))
    return result + tuple(grads[3:])


def _variant_bwd_gpu(fn, dout, q, k, v, out, lse, scale, causal, deterministic, dtype, dq, dk, dv, options,
                     attn_bias=None):
    """The GPU backward with variants (``options`` validated, not empty; ``attn_bias``
    the user's, for the shape and dtype of ``dbias``)."""
    import cupy  # noqa: PLC0415

    if q.size == 0 or k.shape[1] == 0:
        grads = tuple(_into(g, r) for g, r in zip((dq, dk, dv), _checks.empty_bwd(q, k, v, True)))
        with q.device:
            if "sinks" in options:
                grads += (cupy.zeros(q.shape[2], dtype=cupy.float32),)
            if "return_dbias" in options:  # zero bits are 0 in every element type
                grads += (cupy.zeros(attn_bias.shape, dtype=attn_bias.dtype),)
        return grads
    from . import _gpu_bwd

    dtype_name = _checks.dtype_name(fn, dtype) if dtype is not None else q.dtype.name
    grads = _gpu_bwd.variant_bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=bool(causal),
                                 deterministic=bool(deterministic), dtype_name=dtype_name, options=options,
                                 dq=dq, dk=dk, dv=dv)
    if "return_dbias" in options:
        with q.device:
            grads = tuple(grads[:-1]) + (_finish_dbias(grads[-1], attn_bias, dtype_name),)
    return grads


def _finish_dbias(dbias4, attn_bias, dtype_name):
    """The bias gradient as returned: the CPU path's 4-D accumulator (float32, or
    float64 from float64 CPU inputs) or the GPU kernel's dbias (already in the bias's
    dtype), the bias's shape left-padded to 4 dimensions, reshaped to the user's
    ``attn_bias`` shape, in its dtype.

    ``dtype_name`` is the element type of q's data (``dtype=``'s on the GPU): a bias
    held in q's uint16/int16 storage gets the bits of that element type."""
    dbias = dbias4.reshape(attn_bias.shape)
    target = attn_bias.dtype
    if dbias.dtype == target:  # the GPU's (bits of dtype_name in a storage dtype), or a float32 bias's
        return dbias
    if target.name not in _checks.GPU_STORAGE_DTYPES:
        return dbias.astype(target, copy=False)
    if dtype_name == "float16":
        return dbias.astype(np.float16).view(target)
    # bfloat16 bits, rounded to nearest even from float32 (NaN stays a quiet NaN)
    xp = sys.modules["cupy"] if _checks._is_gpu_array(dbias) else np
    x32 = xp.ascontiguousarray(dbias.astype(np.float32, copy=False))
    u = x32.view(np.uint32)
    bits = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    bits = xp.where(x32 != x32, np.uint32(0x7FC0), bits)
    return bits.astype(np.uint16).view(target)


def _gpu_dtype(fn, dtype):
    """``{"dtype": name}`` for the GPU module when ``dtype=`` was given (validated), else ``{}``."""
    return {} if dtype is None else {"dtype": _checks.dtype_name(fn, dtype)}


# ----------------------------------------------------------------------------
# The hot path: validate and plan once per call signature
# ----------------------------------------------------------------------------
#
# A call's signature is everything validation and planning read: the function,
# the flags (with their types: True and 1 hash alike, and only one is a bool),
# ``dtype=``, and per array its type, shape, strides and dtype, plus for cupy
# arrays the device and whether the pointer is 16-byte aligned.  The first call
# of a signature validates, plans (dispatch, params struct, kernels) and caches
# an entry; a repeated call computes the key, finds the entry and runs it.
# What the signature cannot hold is checked on every call instead: NumPy outputs'
# writeability and overlap (the CPU entries), and arguments whose == is not their
# value's (a softmax_scale or dtype= of another type: never cached).


def _sig(x, gpu_type):
    """One array's part of a call signature (None for an output not given).

    ``gpu_type`` is ``cupy.ndarray`` (None before cupy is imported): a cupy
    array adds its device and whether its pointer is 16-byte aligned.
    """
    if x is None:
        return None
    t = type(x)
    if t is gpu_type or (gpu_type is not None and t is not np.ndarray and isinstance(x, gpu_type)):
        data = x.data
        return t, x.shape, x.strides, x.dtype, data.device_id, data.ptr & 15 == 0
    return t, x.shape, x.strides, x.dtype


def _gpu_type():
    """``cupy.ndarray`` if cupy was imported (by the caller: never here), else None."""
    cupy = sys.modules.get("cupy")
    return None if cupy is None else getattr(cupy, "ndarray", None)


#: softmax_scale types whose == and hash are those of their value, so that two
#: scales equal as keys are one scale: only these are cached.  A scale of any other
#: type (a float subclass with its own __eq__, say) is validated on every call.
SCALE_KEY_TYPES = frozenset((type(None), float, int, *(
    t for t in set(np.sctypeDict.values())
    if issubclass(t, (np.floating, np.integer)) and not issubclass(t, np.timedelta64))))


def _dtype_keyable(dtype):
    """``dtype=`` may be part of a key: None, a str, a numpy.dtype or a type (numpy's
    scalar types, ml_dtypes.bfloat16), whose equality is what dtype_name reads."""
    return dtype is None or type(dtype) is str or isinstance(dtype, np.dtype) or type(dtype) is type


_FWD_ENTRIES = _launch.PlanCache()
_BWD_ENTRIES = _launch.PlanCache()


def _fwd(fn, q, k, v, softmax_scale, causal, dtype, out, lse):
    """Run the forward entry of this call's signature, validating and planning it first if new."""
    g = _gpu_type()
    key = entry = None
    if type(softmax_scale) in SCALE_KEY_TYPES and (dtype is None or _dtype_keyable(dtype)):
        try:
            key = (fn, type(softmax_scale), softmax_scale, type(causal), causal, dtype,
                   _sig(q, g), _sig(k, g), _sig(v, g), _sig(out, g), _sig(lse, g))
            entry = _FWD_ENTRIES.get(key)
        except Exception:  # noqa: BLE001 (not an array, unhashable, a raising __hash__: validation says)
            key = entry = None
    if entry is None:
        entry = _FWD_ENTRIES.put(key, _plan_fwd(fn, q, k, v, softmax_scale, causal, dtype, out, lse))
    return entry(q, k, v, out, lse)


def _bwd(fn, dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype, dq, dk, dv):
    """Run the backward entry of this call's signature, validating and planning it first if new."""
    g = _gpu_type()
    key = entry = None
    if type(softmax_scale) in SCALE_KEY_TYPES and (dtype is None or _dtype_keyable(dtype)):
        try:
            key = (fn, type(softmax_scale), softmax_scale, type(causal), causal, type(deterministic),
                   deterministic, dtype, _sig(dout, g), _sig(q, g), _sig(k, g), _sig(v, g), _sig(out, g),
                   _sig(lse, g), _sig(dq, g), _sig(dk, g), _sig(dv, g))
            entry = _BWD_ENTRIES.get(key)
        except Exception:  # noqa: BLE001
            key = entry = None
    if entry is None:
        entry = _BWD_ENTRIES.put(key, _plan_bwd(fn, dout, q, k, v, out, lse, softmax_scale, causal,
                                                deterministic, dtype, dq, dk, dv))
    return entry(dout, q, k, v, out, lse, dq, dk, dv)


def _plan_fwd(fn, q, k, v, softmax_scale, causal, dtype, out, lse):
    """Validate a forward call; return the entry that runs calls of its signature."""
    gpu = _checks.check_qkv(fn, q, k, v, dtype)
    scale = _checks.check_flags(fn, softmax_scale, q.shape[3], causal)
    _checks.check_outputs(fn, q, {"out": (out, q), "lse": (lse, None)})
    if _checks.is_empty(q, k):
        return _EmptyFwd(fn, gpu)
    if not gpu:
        return _CpuFwd(fn, scale, bool(causal))
    from . import _gpu

    dtype_name = _checks.dtype_name(fn, dtype) if dtype is not None else q.dtype.name
    device_id = q.device.id
    with q.device:
        call = _gpu.plan_fwd(q, k, v, out, lse, softmax_scale=scale, causal=bool(causal),
                             dtype_name=dtype_name, device_id=device_id)
    return _GpuFwd(call, device_id)


def _plan_bwd(fn, dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dtype, dq, dk, dv):
    """Validate a backward call; return the entry that runs calls of its signature."""
    gpu = _checks.check_qkv(fn, q, k, v, dtype)
    _checks.check_bwd_extras(fn, dout, out, lse, q)
    scale = _checks.check_flags(fn, softmax_scale, q.shape[3], causal, deterministic)
    _checks.check_outputs(fn, q, {"dq": (dq, q), "dk": (dk, k), "dv": (dv, v)})
    if _checks.is_empty(q, k):
        return _EmptyBwd(fn, gpu)
    if not gpu:
        return _CpuBwd(fn, scale, bool(causal))
    from . import _gpu_bwd

    dtype_name = _checks.dtype_name(fn, dtype) if dtype is not None else q.dtype.name
    device_id = q.device.id
    with q.device:
        call = _gpu_bwd.plan_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=scale,
                                 causal=bool(causal), deterministic=bool(deterministic),
                                 dtype_name=dtype_name, device_id=device_id)
    return _GpuBwd(call, device_id)


def _into(given, result):
    """``result`` written into the preallocated ``given`` array (returned), or ``result``."""
    if given is None:
        return result
    given[...] = result
    return given


# The CPU entries check the NumPy outputs given on every call, before computing:
# whether they are writeable and whether they overlap each other is not part of
# the call signature (see _checks.check_numpy_outputs).


class _CpuFwd:
    __slots__ = ("fn", "scale", "causal")

    def __init__(self, fn, scale, causal):
        self.fn, self.scale, self.causal = fn, scale, causal

    def __call__(self, q, k, v, out, lse):
        if out is not None or lse is not None:
            _checks.check_numpy_outputs(self.fn, (("out", out), ("lse", lse)))
        o, l = cpu.fwd(q, k, v, self.scale, self.causal)
        return _into(out, o), _into(lse, l)


class _CpuBwd:
    __slots__ = ("fn", "scale", "causal")

    def __init__(self, fn, scale, causal):
        self.fn, self.scale, self.causal = fn, scale, causal

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv):
        if dq is not None or dk is not None or dv is not None:
            _checks.check_numpy_outputs(self.fn, (("dq", dq), ("dk", dk), ("dv", dv)))
        grads = cpu.bwd(dout, q, k, v, out, lse, self.scale, self.causal)
        return tuple(_into(g, r) for g, r in zip((dq, dk, dv), grads))


class _EmptyFwd:
    """Nothing to compute (no query, or no key): out 0, lse -inf, no kernel."""

    __slots__ = ("fn", "gpu")

    def __init__(self, fn, gpu):
        self.fn, self.gpu = fn, gpu

    def __call__(self, q, k, v, out, lse):
        if not self.gpu and (out is not None or lse is not None):
            _checks.check_numpy_outputs(self.fn, (("out", out), ("lse", lse)))
        o, l = _checks.empty_fwd(q, self.gpu)
        return _into(out, o), _into(lse, l)


class _EmptyBwd:
    __slots__ = ("fn", "gpu")

    def __init__(self, fn, gpu):
        self.fn, self.gpu = fn, gpu

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv):
        if not self.gpu and (dq is not None or dk is not None or dv is not None):
            _checks.check_numpy_outputs(self.fn, (("dq", dq), ("dk", dk), ("dv", dv)))
        grads = _checks.empty_bwd(q, k, v, self.gpu)
        return tuple(_into(g, r) for g, r in zip((dq, dk, dv), grads))


class _GpuEntry:
    """What the GPU entries share: the device (CUDA graph capture: _launch.keep_for_graph)."""

    __slots__ = ("call", "device_id", "_cupy")

    def __init__(self, call, device_id):
        self.call, self.device_id = call, device_id
        self._cupy = sys.modules["cupy"]


class _GpuFwd(_GpuEntry):
    __slots__ = ()

    def __call__(self, q, k, v, out, lse):
        cupy, call = self._cupy, self.call
        if cupy.cuda.runtime.getDevice() != self.device_id:
            with cupy.cuda.Device(self.device_id):
                return self(q, k, v, out, lse)
        # Two allocations, like FA2's: out and lse have separate lifetimes (one
        # allocation for both measured ~1 us faster, but keeps out alive with lse).
        if out is None:
            out = cupy.ndarray(call.out_shape, q.dtype)
        if lse is None:
            lse = cupy.ndarray(call.lse_shape, _FLOAT32)
        call.run(cupy.cuda.get_current_stream().ptr, _launch.cupy_alloc, q.data.ptr, k.data.ptr, v.data.ptr,
                 out.data.ptr, lse.data.ptr)  # (split-KV scratch: kept by cupy_alloc while capturing)
        return out, lse


class _GpuBwd(_GpuEntry):
    __slots__ = ()

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv):
        if self._cupy.cuda.runtime.getDevice() != self.device_id:
            with self._cupy.cuda.Device(self.device_id):
                return self(dout, q, k, v, out, lse, dq, dk, dv)
        ndarray = self._cupy.ndarray
        if dq is None and dk is None and dv is None:  # one allocation for the three
            memory = self._cupy.cuda.alloc(self.call.grads_bytes)
            _, o_dk, o_dv = self.call.grads_offsets
            dq = ndarray(q.shape, q.dtype, memory)
            dk = ndarray(k.shape, k.dtype, memory + o_dk)
            dv = ndarray(v.shape, v.dtype, memory + o_dv)
        else:
            dq = ndarray(q.shape, q.dtype) if dq is None else dq
            dk = ndarray(k.shape, k.dtype) if dk is None else dk
            dv = ndarray(v.shape, v.dtype) if dv is None else dv
        self.call.run(self._cupy.cuda.get_current_stream().ptr, _launch.cupy_alloc, dout.data.ptr, q.data.ptr,
                      k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr)
        return dq, dk, dv


_FLOAT32 = np.dtype(np.float32)
