"""Variable-length (packed) batches: attention over sequences of different lengths.

The sequences of a batch are concatenated along the token axis, with no padding,
and described by int32 prefix sums ``cu_seqlens`` (flash-attention's varlen
layout).  Validation follows :mod:`cupyflash._checks`; then

* NumPy arrays loop over the sequences and run the tiled CPU path
  (:func:`cupyflash.cpu.fwd` / :func:`cupyflash.cpu.bwd`) on ``(1, len, H, D)``
  views, writing into the packed outputs, so extra memory stays O(tokens).
  The attention variants (issue 13) run there too, sequence ``b`` as the dense
  batch element ``b`` would: its own row of (batch, nheads_q) ALiBi slopes, its
  dropout mask drawn at batch index ``b`` (``batch_start``), and its block
  ``[b, :, :len_q, :len_k]`` of a ``(batch, nheads_q, max_seqlen_q,
  max_seqlen_k)``-broadcastable ``attn_bias`` / ``attn_mask`` (issue 14; a
  view, and the block of ``dbias`` its gradient is added into);
* CuPy arrays go to ``_gpu.varlen_fwd`` / ``_gpu.varlen_bwd`` (bfloat16 as
  uint16/int16 storage with ``dtype="bfloat16"``, as in ``_api``): one launch
  of each kernel covers the whole batch, the kernels read ``cu_seqlens`` on the
  device, and their grids are sized by ``max_seqlen_q/k`` (blocks past the end
  of a shorter sequence do no work).  A GPU module without those entry points
  gets the same per-sequence loop as NumPy, over ``_gpu.fwd`` / ``_gpu.bwd``
  (the tests run both);
* other arrays (torch, JAX, ``__dlpack__`` objects), ``cu_seqlens`` included, go
  through :func:`._interop.call` like the dense functions: viewed as NumPy/CuPy
  arrays without copying, results handed back in the caller's type.

Either way a sequence with no key gets out 0, lse ``-inf`` (``sinks[h]`` with
sinks) and dq 0 on its query rows, and one with no query dk = dv = 0 on its key rows (the loop skips
such pairs; the kernels find no key block, or no query block, to visit).
"""

from __future__ import annotations

import numbers
import sys

import numpy as np

from . import _checks, _interop, cpu
from ._api import _NO_DROPOUT, _NO_SOFTCAP, _NO_WINDOW, _finish_dbias, _gpu_dtype
from ._checks import fail

__all__ = ["flash_attn_varlen_fwd", "flash_attn_varlen_bwd", "flash_attn_varlen"]


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------

def _host_values(x):
    """The values of a 1-D int32 array as NumPy int64 (a CuPy array is copied)."""
    if not isinstance(x, np.ndarray):
        x = x.get()
    return np.asarray(x, dtype=np.int64)


def _check_cu_seqlens(fn, name, cu, q, total, total_name):
    """Validate one ``cu_seqlens``; return its values on the host (int64)."""
    kind = _checks._kind(q)
    _checks._check_array(fn, name, cu, kind, "q", rank=None)
    if cu.dtype != np.int32:
        fail(TypeError, fn, f"{name} must have dtype int32; got {_checks.dtype_desc(cu.dtype)}.")
    if cu.ndim != 1:
        fail(ValueError, fn, f"{name} must be 1-D (batch + 1,); got shape {tuple(cu.shape)}.")
    if cu.shape[0] == 0:
        fail(ValueError, fn, f"{name} must have batch + 1 >= 1 elements; got 0.")
    if cu.shape[0] > 1 and cu.strides[0] != cu.itemsize:
        fail(ValueError, fn,
             f"{name} must be contiguous; got a stride of {cu.strides[0] / cu.itemsize:g} "
             f"elements.")
    if kind == "cupy":
        _checks._check_device(fn, name, cu, q)
    values = _host_values(cu)
    if values[0] != 0:
        fail(ValueError, fn, f"{name} must start at 0; got {int(values[0])}.")
    steps = np.diff(values)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0)) + 1
        fail(ValueError, fn,
             f"{name} must be non-decreasing; got {int(values[i])} after {int(values[i - 1])} "
             f"at index {i}.")
    if values[-1] != total:
        fail(ValueError, fn,
             f"{name} must end at {total_name} ({total}); got {int(values[-1])}.")
    return values


#: The longest sequence a max_seqlen may name (int32 in the kernels' params).
_MAX_SEQLEN = 2**31 - 1


def _check_max_seqlen(fn, name, value, cu_values, what):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        fail(TypeError, fn, f"{name} must be an int; got {_checks._type_name(value)}.")
    if int(value) < 0:
        fail(ValueError, fn, f"{name} must be >= 0; got {int(value)}.")
    if int(value) > _MAX_SEQLEN:  # the kernels' params and grids hold it as an int32
        fail(ValueError, fn, f"{name} must be at most 2**31 - 1 (the kernels index sequences in int32); "
                             f"got {int(value)}.")
    lengths = np.diff(cu_values)
    if lengths.size and int(value) < lengths.max():
        i = int(np.argmax(lengths))
        fail(ValueError, fn,
             f"{name} must be at least the longest {what} sequence ({int(lengths[i])}, "
             f"sequence {i}); got {int(value)}.")


def _check_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  dtype=None):
    """Validate everything but the flags; return ``(gpu, cu_q, cu_k)`` (host int64 values)."""
    gpu = _checks.check_qkv(fn, q, k, v, dtype, packed=True)
    cu_q = _check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q, q.shape[0],
                             "total_q = q.shape[0]")
    cu_k = _check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, q, k.shape[0],
                             "total_k = k.shape[0]")
    if cu_k.shape[0] != cu_q.shape[0]:
        fail(ValueError, fn,
             f"cu_seqlens_k must have the same length as cu_seqlens_q ({cu_q.shape[0]} = "
             f"batch + 1); got {cu_k.shape[0]}.")
    _check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, cu_q, "query")
    _check_max_seqlen(fn, "max_seqlen_k", max_seqlen_k, cu_k, "key")
    return gpu, cu_q, cu_k


# ----------------------------------------------------------------------------
# The per-sequence loop (CPU path, and GPU modules without varlen kernels)
# ----------------------------------------------------------------------------


def _xp(gpu):
    return sys.modules["cupy"] if gpu else np


def _pairs(cu_q, cu_k):
    """``(b, q0, q1, k0, k1)`` for each sequence ``b`` with at least one query and one key."""
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])):
        if q1 > q0 and k1 > k0:
            yield b, int(q0), int(q1), int(k0), int(k1)


def _sequence_block(x, b, len_q, len_k):
    """The index of sequence ``b``'s block in a 4-D bias, mask or dbias of shape
    (1 or batch, H', 1 or max_seqlen_q, 1 or max_seqlen_k): its batch row and its
    first ``len_q`` rows and ``len_k`` keys (a size-1 dimension is broadcast: whole)."""
    return (slice(None) if x.shape[0] == 1 else slice(b, b + 1), slice(None),
            slice(None) if x.shape[2] == 1 else slice(0, len_q),
            slice(None) if x.shape[3] == 1 else slice(0, len_k))


def _sequence_options(options, b, len_q, len_k):
    """The variant options of sequence ``b`` (``len_q`` queries, ``len_k`` keys) run
    as a batch of one: ALiBi slopes of shape (batch, nheads_q) sliced to its row,
    the dropout mask drawn at batch index ``b`` (``batch_start``), as the dense path
    draws it for that sequence, and its block of the bias and mask (positions
    local to the sequence)."""
    if not options:
        return options
    if "block_mask" in options:  # the whole batch's map: the sequence's block is mapped anew
        options = {name: x for name, x in options.items() if name != "block_mask"}
    slopes = options.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 2:
        options = {**options, "alibi_slopes": slopes[b:b + 1]}
    if "dropout_p" in options:
        options = {**options, "batch_start": b}
    for name in ("attn_bias", "attn_mask"):
        x = options.get(name)
        if x is not None:
            options = {**options, name: x[_sequence_block(x, b, len_q, len_k)]}
    return options


def _fwd_loop(fwd_one, xp, q, k, v, cu_q, cu_k, sinks=None):
    """Packed ``(out, lse)`` from ``fwd_one(b, q, k, v)`` applied to each sequence's
    (1, len, H, D) views.

    Rows of a sequence with no key keep out 0 and lse -inf (``sinks[h]`` with sinks).
    """
    out = xp.zeros(q.shape, dtype=q.dtype)
    lse = xp.full((q.shape[1], q.shape[0]), -np.inf, dtype=np.float32)
    if sinks is not None:
        lse[...] = sinks[:, None]
    for b, q0, q1, k0, k1 in _pairs(cu_q, cu_k):
        seq_out, seq_lse = fwd_one(b, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1])
        out[q0:q1] = seq_out[0]
        lse[:, q0:q1] = seq_lse[0]
    return out, lse


def _bwd_loop(bwd_one, xp, dout, q, k, v, out, lse, cu_q, cu_k, sinks=None, dbias=None):
    """Packed ``(dq, dk, dv)`` from ``bwd_one(b, dout, q, k, v, out, lse)`` applied to
    each sequence's views; with ``sinks``, also ``dsinks`` summed over the sequences;
    with ``dbias`` (a zeroed 4-D accumulator of the bias's padded shape), the last
    result of each sequence added into its block of it, which ends the results.

    Rows of a sequence with no key (dq) or no query (dk, dv) keep 0; such a
    sequence adds nothing to ``dsinks`` (its rows have out 0, so delta 0) or ``dbias``.
    """
    dq = xp.zeros(q.shape, dtype=q.dtype)
    dk = xp.zeros(k.shape, dtype=k.dtype)
    dv = xp.zeros(v.shape, dtype=v.dtype)
    dsinks = None if sinks is None else xp.zeros(sinks.shape, dtype=np.float64)
    for b, q0, q1, k0, k1 in _pairs(cu_q, cu_k):
        rows, keys = slice(q0, q1), slice(k0, k1)
        seq_grads = bwd_one(b, dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                            out[None, rows], lse[None, :, rows])
        dq[rows] = seq_grads[0][0]
        dk[keys] = seq_grads[1][0]
        dv[keys] = seq_grads[2][0]
        if dsinks is not None:
            dsinks += seq_grads[3]
        if dbias is not None:
            dbias[_sequence_block(dbias, b, q1 - q0, k1 - k0)] += seq_grads[-1]
    grads = (dq, dk, dv)
    if dsinks is not None:
        grads += (dsinks.astype(np.float32),)
    return grads if dbias is None else grads + (dbias,)


def _empty_fwd(xp, q, sinks=None):
    lse = xp.full((q.shape[1], q.shape[0]), -np.inf, dtype=np.float32)
    if sinks is not None:  # no key: the sink alone
        lse[...] = sinks[:, None]
    return xp.zeros(q.shape, dtype=q.dtype), lse


def _empty_bwd(xp, q, k, v, sinks=None, attn_bias=None):
    """Zero gradients (and dsinks, and a zero dbias in ``attn_bias``'s shape and dtype)."""
    grads = tuple(xp.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
    if sinks is not None:
        grads += (xp.zeros(sinks.shape, dtype=np.float32),)
    if attn_bias is not None:  # zero bits are 0 in every element type
        grads += (xp.zeros(attn_bias.shape, dtype=attn_bias.dtype),)
    return grads


def _nothing_to_compute(q, k):
    """No query element, or no key at all: no kernel needs to run."""
    return q.size == 0 or k.shape[0] == 0


_FWD_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
_BWD_NAMES = ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k")


def _given(dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state):
    """The variant options for :func:`._checks.check_variants`, or None when every one
    was left out (the defaults are the dense functions' "off" objects, told by
    identity: a value given, an equal one too, is checked)."""
    if (dropout_p is _NO_DROPOUT and window_size is _NO_WINDOW and alibi_slopes is None
            and softcap is _NO_SOFTCAP and sinks is None and rng_state is None):
        return None
    return dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state


#: The variants of issue 13 off, for a call that gives only issue 14's options.
_OFF = (_NO_DROPOUT, _NO_WINDOW, None, _NO_SOFTCAP, None, None)


def _scores(attn_bias=None, attn_mask=None, return_dbias=False):
    """Issue 14's options for :func:`_variants`, or None when none was given (told by
    identity, like :func:`_given`)."""
    if attn_bias is None and attn_mask is None and return_dbias is False:
        return None
    return attn_bias, attn_mask, return_dbias


def _variants(fn, q, gpu, cu_q, variants, scale, scores=None, max_seqlens=None, draw_rng=False):
    """The variant options that are on (``cupyflash.cpu``'s keywords), checked against
    q's heads, the number of sequences and the scale; the bias and mask (``scores``,
    from :func:`_scores`) against ``(batch, nheads_q, max_seqlen_q, max_seqlen_k)``."""
    if variants is None and scores is None:
        return {}
    attn_bias, attn_mask, return_dbias = (None, None, False) if scores is None else scores
    return _checks.check_variants(fn, q, gpu, *(_OFF if variants is None else variants),
                                  batch=cu_q.shape[0] - 1, softmax_scale=scale, attn_bias=attn_bias,
                                  attn_mask=attn_mask, return_dbias=return_dbias,
                                  seqlens=None if max_seqlens is None else tuple(int(n) for n in max_seqlens),
                                  draw_rng=draw_rng)


def _fwd(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
         causal, dtype, variants=None, scores=None, return_rng_state=False):
    """Validate, then run the forward on the CPU, the GPU varlen kernels, or the GPU loop;
    with ``return_rng_state``, the dropout state used (None without dropout) ends the result."""
    if return_rng_state is not False:
        return_rng_state = _checks.check_return_rng_state(fn, return_rng_state)
    options = {}
    result = _fwd_run(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                      causal, dtype, variants, scores, options)
    return tuple(result) + (options.get("rng_state"),) if return_rng_state else result


def _fwd_run(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             causal, dtype, variants, scores, used):
    """:func:`_fwd`'s ``(out, lse)``; the options it ran with are put in ``used``."""
    gpu, cu_q, cu_k = _check_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dtype)
    scale = _checks.check_flags(fn, softmax_scale, q.shape[2], causal)
    causal = bool(causal)
    options = _variants(fn, q, gpu, cu_q, variants, scale, scores, (max_seqlen_q, max_seqlen_k), draw_rng=True)
    used.update(options)
    sinks = options.get("sinks")
    if not gpu:
        if _nothing_to_compute(q, k):
            return _empty_fwd(np, q, sinks)
        return _fwd_loop(
            lambda b, qs, ks, vs: cpu.fwd(qs, ks, vs, scale, causal,
                                          **_sequence_options(options, b, qs.shape[1], ks.shape[1])),
            np, q, k, v, cu_q, cu_k, sinks)
    from . import _gpu

    kw_dtype = _gpu_dtype(fn, dtype)
    with q.device:
        if _nothing_to_compute(q, k):
            return _empty_fwd(_xp(gpu), q, sinks)
        if options:
            return _gpu.variant_fwd(q, k, v, None, None, softmax_scale=scale, causal=causal,
                                    dtype_name=kw_dtype.get("dtype", q.dtype.name), options=options,
                                    packed=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
        if hasattr(_gpu, "varlen_fwd"):
            return _gpu.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                   int(max_seqlen_k), softmax_scale=scale, causal=causal,
                                   **kw_dtype)
        return _fwd_loop(
            lambda b, qs, ks, vs: _gpu.fwd(qs, ks, vs, softmax_scale=scale, causal=causal, **kw_dtype,
                                           **_sequence_options(options, b, qs.shape[1], ks.shape[1])),
            _xp(gpu), q, k, v, cu_q, cu_k, sinks)


def _bwd(fn, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
         softmax_scale, causal, deterministic, dtype, variants=None, scores=None):
    """Validate, then run the backward on the CPU, the GPU varlen kernels, or the GPU loop."""
    gpu, cu_q, cu_k = _check_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dtype)
    _checks.check_bwd_extras(fn, dout, out, lse, q, packed=True)
    scale = _checks.check_flags(fn, softmax_scale, q.shape[2], causal, deterministic)
    causal, deterministic = bool(causal), bool(deterministic)
    options = _variants(fn, q, gpu, cu_q, variants, scale, scores, (max_seqlen_q, max_seqlen_k))
    sinks = options.get("sinks")
    attn_bias = scores[0] if "return_dbias" in options else None  # the user's: dbias's shape and dtype
    if not gpu:
        if _nothing_to_compute(q, k):
            return _empty_bwd(np, q, k, v, sinks, attn_bias)
        dbias = None
        if attn_bias is not None:
            dbias = np.zeros(options["attn_bias"].shape, np.float64 if q.dtype == np.float64 else np.float32)
        grads = _bwd_loop(
            lambda b, *a: cpu.bwd(*a, scale, causal, **_sequence_options(options, b, a[1].shape[1],
                                                                          a[2].shape[1])),
            np, dout, q, k, v, out, lse, cu_q, cu_k, sinks, dbias)
        if dbias is None:
            return grads
        return grads[:-1] + (_finish_dbias(grads[-1], attn_bias, q.dtype.name),)
    from . import _gpu

    kw_dtype = _gpu_dtype(fn, dtype)
    with q.device:
        if _nothing_to_compute(q, k):
            return _empty_bwd(_xp(gpu), q, k, v, sinks, attn_bias)
        if options:
            from . import _gpu_bwd

            dtype_name = kw_dtype.get("dtype", q.dtype.name)
            grads = _gpu_bwd.variant_bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal,
                                         deterministic=deterministic, dtype_name=dtype_name, options=options,
                                         packed=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
            if attn_bias is None:
                return grads
            return tuple(grads[:-1]) + (_finish_dbias(grads[-1], attn_bias, dtype_name),)
        if hasattr(_gpu, "varlen_bwd"):
            return _gpu.varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                   int(max_seqlen_q), int(max_seqlen_k), softmax_scale=scale,
                                   causal=causal, deterministic=deterministic, **kw_dtype)
        return _bwd_loop(
            lambda b, *a: _gpu.bwd(*a, softmax_scale=scale, causal=causal,
                                   deterministic=deterministic, **kw_dtype,
                                   **_sequence_options(options, b, a[1].shape[1], a[2].shape[1])),
            _xp(gpu), dout, q, k, v, out, lse, cu_q, cu_k, sinks)


# ----------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------


@_interop.accepts_foreign(*_FWD_NAMES)
def flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                          softmax_scale=None, causal=False, dtype=None,
                          dropout_p=_NO_DROPOUT, window_size=_NO_WINDOW, alibi_slopes=None,
                          softcap=_NO_SOFTCAP, sinks=None, rng_state=None, attn_bias=None, attn_mask=None,
                          return_rng_state=False):
    """Exact attention forward pass over a packed batch of variable-length sequences.

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key
    rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; its queries attend only to its
    own keys, so padding never exists and is never attended.  Per sequence the
    result is that of :func:`cupyflash.flash_attn_fwd` on a batch of one (with
    the variants, at batch index ``b``: see ``dropout_p`` and ``alibi_slopes``).

    Parameters
    ----------
    q : array, shape (total_q, nheads_q, head_dim)
        Queries of all sequences, concatenated: a numpy.ndarray (CPU path), a
        cupy.ndarray (GPU), or a torch tensor, JAX array or other
        ``__dlpack__``/``__cuda_array_interface__`` array (viewed without
        copying, as in :func:`cupyflash.flash_attn_fwd`).  dtype float16,
        bfloat16, float32 or float64 on the CPU; float16 or bfloat16 on the GPU
        (bfloat16 cupy data as uint16/int16 storage with ``dtype="bfloat16"``).
        Any strides as long as the last one is 1 element.
    k, v : array, shape (total_k, nheads_kv, head_dim)
        Keys and values, concatenated the same way; same array type and dtype
        as ``q``.  ``nheads_q`` must be a multiple of ``nheads_kv`` (GQA):
        query head ``h`` reads KV head ``h // (nheads_q // nheads_kv)``.
    cu_seqlens_q, cu_seqlens_k : array, shape (batch + 1,), int32
        Prefix sums of the sequence lengths: ``[0, len_0, len_0 + len_1, ...]``.
        Same array type (and device) as ``q`` (an int32 torch tensor or JAX
        array for torch / JAX inputs); start at 0, non-decreasing, end at
        ``total_q`` / ``total_k``.  Zero-length sequences are allowed.
    max_seqlen_q, max_seqlen_k : int
        At least the longest query / key sequence.  The GPU kernels size their
        grids with them (blocks past a shorter sequence do no work), so a
        value far above the longest sequence only costs idle blocks.
    softmax_scale : float, optional
        Scale of ``q @ k.T`` before the softmax; finite and > 0, within float32
        range (between 1.4e-45 and 2.36e38, as it is used in float32).  Defaults to
        ``1 / sqrt(head_dim)``.  The scaled scores are float32: where
        ``softmax_scale * q.k`` reaches about 1e7 in magnitude float32 no longer
        resolves them and accuracy is lost; the CPU backward clamps the exponent
        of P at 0 there and stays finite, the GPU kernels do not clamp it.  Where
        the scaled scores overflow float32 the result is undefined.
    causal : bool, optional
        Causal mask aligned to the bottom-right corner of each sequence's score
        matrix: query ``i`` of a sequence sees its key ``j`` iff
        ``j <= i + len_k - len_q``.  For a sequence with len_q=2, len_k=5 and
        one with len_q=5, len_k=2 (1 = attended)::

            1 1 1 1 0        0 0
            1 1 1 1 1        0 0
                             0 0
                             1 0
                             1 1

        A query row that sees no key, including every row of a sequence whose
        key sequence is empty, gets output 0 and lse ``-inf``.  Nothing is NaN.
    dtype : str, optional
        As in :func:`cupyflash.flash_attn_fwd`: ``"bfloat16"`` (or
        ``"float16"``) for cupy arrays of raw bits in uint16/int16 storage.
        ``None`` (default) or q's own dtype name otherwise; torch and JAX
        arrays carry their dtype and take None.
    dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state
        Attention variants (issue 13) as in :func:`cupyflash.flash_attn_fwd`,
        with the same checks, on the CPU path and in the GPU kernels.  Each sequence is
        aligned bottom-right to its own lengths: ``window_size=(left, right)``
        lets query ``i`` of a sequence see its key ``j`` iff ``i + len_k -
        len_q - left <= j <= i + len_k - len_q + right``, and ALiBi adds
        ``-slope * |i + len_k - len_q - j|``.  ``alibi_slopes`` is float32 of
        shape (nheads_q,) or (batch, nheads_q), row ``b`` for sequence ``b``;
        ``sinks`` float32 (nheads_q,) (a row that sees no key then has lse
        ``sinks[h]``).  ``dropout_p`` takes an optional ``rng_state=(seed,
        offset)`` (left out: drawn from cupyflash's generator, see
        :func:`cupyflash.manual_seed`); the keep mask of sequence ``b`` is
        drawn by :mod:`cupyflash._philox` at batch index ``b`` with rows and
        columns counted within the sequence, so it is the mask
        :func:`cupyflash.flash_attn_fwd` draws for batch element ``b`` of a
        dense batch holding the same sequence.
    attn_bias, attn_mask : array, optional
        The additive bias and the boolean keep-mask of
        :func:`cupyflash.flash_attn_fwd` (issue 14: same dtypes, strides, order
        of application and masking), broadcastable to ``(batch, nheads_q,
        max_seqlen_q, max_seqlen_k)`` with ``batch = len(cu_seqlens_q) - 1``
        (each dimension, left-padded to 4, 1 or full), indexed by positions
        local to each sequence: query ``i`` and key ``j`` of sequence ``b`` get
        ``attn_bias[b, h, i, j]``.  Entries past a sequence's lengths are not read.
    return_rng_state : bool, optional
        Also return the dropout state used, third (the one given or drawn;
        None without dropout), for :func:`flash_attn_varlen_bwd`.  Default False.

    Returns
    -------
    out : array, shape (total_q, nheads_q, head_dim)
        Same array type and dtype as ``q`` (uint16 storage stays uint16),
        C-contiguous.
    lse : array, shape (nheads_q, total_q), float32
        The natural-log logsumexp of each row of scaled, masked scores (and of
        the sink with ``sinks``; before dropout).
    rng_state : tuple of two ints, or None
        Only with ``return_rng_state=True``: the dropout ``(seed, offset)``.

    Raises
    ------
    TypeError
        As for :func:`cupyflash.flash_attn_fwd`; also when a ``cu_seqlens`` is
        not an array of the type of ``q`` or not int32, or a ``max_seqlen`` is
        not an int.
    ValueError
        As for :func:`cupyflash.flash_attn_fwd` (with rank 3 instead of 4);
        also when a ``cu_seqlens`` is not 1-D, empty, not contiguous, does not
        start at 0, decreases, or does not end at the number of tokens; when
        the two ``cu_seqlens`` differ in length; or when a ``max_seqlen`` is
        smaller than the longest sequence or above ``2**31 - 1``.  A variant option is malformed as
        for :func:`cupyflash.flash_attn_fwd` (``alibi_slopes`` of shape
        (batch, nheads_q), ``attn_bias`` and ``attn_mask`` count ``batch =
        len(cu_seqlens_q) - 1``).

    Notes
    -----
    The ``cu_seqlens`` values are read on the host to validate them (for CuPy
    arrays that is a small device-to-host copy).  On the GPU one launch of the
    forward kernel covers the whole batch, whatever the number of sequences;
    the kernels read ``cu_seqlens`` on the device.

    torch tensors and JAX arrays are handled as by :func:`cupyflash.flash_attn_fwd`:
    viewed without copying (``cu_seqlens`` too), torch CUDA tensors run on
    ``torch.cuda.current_stream()``, JAX GPU arrays are exchanged through
    DLPack with its stream handshake, CPU tensors/arrays run the CPU path, and
    the results come back in the caller's type.  All array arguments must be
    of one array type and on one device.

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((7, 2, 8), dtype=np.float32)   # sequences of 3 and 4 tokens
    >>> cu = np.array([0, 3, 7], dtype=np.int32)
    >>> out, lse = cupyflash.flash_attn_varlen_fwd(q, q, q, cu, cu, 4, 4, causal=True)
    >>> out.shape, lse.shape
    ((7, 2, 8), (2, 7))
    >>> out, lse = cupyflash.flash_attn_varlen_fwd(q, q, q, cu, cu, 4, 4, window_size=(1, 0),
    ...                                            sinks=np.zeros(2, np.float32))
    """
    fn = "flash_attn_varlen_fwd"
    return _fwd(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, dtype,
                _given(dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state),
                _scores(attn_bias, attn_mask), return_rng_state)


@_interop.accepts_foreign(*_BWD_NAMES)
def flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, *, softmax_scale=None, causal=False, deterministic=False,
                          dtype=None, dropout_p=_NO_DROPOUT, window_size=_NO_WINDOW,
                          alibi_slopes=None, softcap=_NO_SOFTCAP, sinks=None, rng_state=None,
                          attn_bias=None, attn_mask=None, return_dbias=False):
    """Exact attention backward pass over a packed batch: the gradients of
    :func:`flash_attn_varlen_fwd`.

    Parameters
    ----------
    dout : array, shape (total_q, nheads_q, head_dim)
        Gradient of the loss with respect to ``out``; same dtype as ``q``.
    q : array, shape (total_q, nheads_q, head_dim)
    k, v : array, shape (total_k, nheads_kv, head_dim)
    out : array, shape (total_q, nheads_q, head_dim)
        The forward output; same dtype as ``q``.
    lse : array, shape (nheads_q, total_q), float32
        The forward logsumexp (natural log).
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        As for :func:`flash_attn_varlen_fwd`.
    softmax_scale : float, optional
        The forward's scale; defaults to ``1 / sqrt(head_dim)``.
    causal : bool, optional
        The forward's mask (bottom-right aligned per sequence).
    deterministic : bool, optional
        On the GPU, accumulate dq in a fixed order (see
        :func:`cupyflash.flash_attn_bwd`).  The CPU path ignores it.  On the
        GPU, as for the forward, each backward kernel is launched once for the
        whole batch; its fp32 scratch is O(total_q * nheads_q * head_dim), with
        no per-sequence padding.
    dtype : str, optional
        As in :func:`flash_attn_varlen_fwd`: ``"bfloat16"`` for cupy arrays of
        raw bfloat16 bits (dout, q, k, v and out alike).
    dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state
        As in :func:`flash_attn_varlen_fwd`, and the same as the forward was
        given (the dropout mask is drawn again from ``rng_state``, required
        with ``dropout_p > 0``: a TypeError names it when missing).
    attn_bias, attn_mask : array, optional
        As in :func:`flash_attn_varlen_fwd`, and the same as the forward was given.
    return_dbias : bool, optional
        Also return ``dbias``, the gradient of ``attn_bias`` (which must then be given).

    Returns
    -------
    dq : array, shape (total_q, nheads_q, head_dim), dtype of ``q``
    dk, dv : array, shape (total_k, nheads_kv, head_dim), dtype of ``k``
        With GQA, summed over the query heads that share each KV head.  Rows of
        a sequence whose other side is empty are 0.
    dsinks : numpy.ndarray, shape (nheads_q,), float32
        Only when ``sinks`` is given: the gradient of the sinks, summed over
        the sequences and their rows.
    dbias : array, shape and dtype of ``attn_bias``
        Only with ``return_dbias``, last: as in :func:`cupyflash.flash_attn_bwd`
        (summed over the broadcast dimensions, the sequences too when the
        bias's batch dimension is 1); 0 at positions past a sequence's lengths.

    Raises
    ------
    TypeError, ValueError
        As for :func:`flash_attn_varlen_fwd`; also when ``dout`` or ``out``
        differ from ``q`` in shape or dtype, ``lse`` is not
        ``(nheads_q, total_q)`` float32, or ``deterministic`` is not a bool.
    """
    fn = "flash_attn_varlen_bwd"
    return _bwd(fn, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, softmax_scale, causal, deterministic, dtype,
                _given(dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state),
                _scores(attn_bias, attn_mask, return_dbias))


@_interop.accepts_foreign(*_FWD_NAMES)
def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                      softmax_scale=None, causal=False, dtype=None,
                      dropout_p=_NO_DROPOUT, window_size=_NO_WINDOW, alibi_slopes=None,
                      softcap=_NO_SOFTCAP, sinks=None, rng_state=None, attn_bias=None, attn_mask=None,
                      return_rng_state=False):
    """Exact attention over a packed batch of variable-length sequences: the output alone.

    The same as ``flash_attn_varlen_fwd(...)[0]``; see
    :func:`flash_attn_varlen_fwd` for the layout, the causal alignment, the
    variants and what is raised.

    Parameters
    ----------
    q : array, shape (total_q, nheads_q, head_dim)
    k, v : array, shape (total_k, nheads_kv, head_dim)
    cu_seqlens_q, cu_seqlens_k : array, shape (batch + 1,), int32
    max_seqlen_q, max_seqlen_k : int
    softmax_scale : float, optional
    causal : bool, optional
    dtype : str, optional
        ``"bfloat16"`` for cupy arrays of raw bfloat16 bits (uint16/int16).
    dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state : optional
        As in :func:`flash_attn_varlen_fwd`.
    attn_bias, attn_mask : array, optional
        As in :func:`flash_attn_varlen_fwd`.
    return_rng_state : bool, optional
        Also return the dropout state used: ``(out, rng_state)``.

    Returns
    -------
    out : array, shape (total_q, nheads_q, head_dim), dtype of ``q``
    rng_state : tuple of two ints, or None
        Only with ``return_rng_state=True``.
    """
    fn = "flash_attn_varlen"
    result = _fwd(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, dtype,
                  _given(dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state),
                  _scores(attn_bias, attn_mask), return_rng_state)
    return (result[0], result[2]) if len(result) == 3 else result[0]
