"""Dense attention written plainly: the float64 reference and a naive low-precision one.

Everything here materialises the full ``(batch, nheads, seqlen_q, seqlen_k)``
score matrix, so it is for tests and small checks only.  The masking contract is
the one of :func:`cupyflash.flash_attn_fwd`:

* layout ``(batch, seqlen, nheads, head_dim)``; K/V may have fewer heads
  (GQA/MQA), query head ``h`` reads KV head ``h // (nheads_q // nheads_kv)``;
* causal aligns bottom-right: query ``i`` sees key ``j`` iff
  ``j <= i + seqlen_k - seqlen_q``;
* a row that sees no key has output 0, lse ``-inf`` and zero gradients.

:func:`attention_fwd` / :func:`attention_bwd` also define the score variants
(keyword-only, all off by default), in this order::

    s = softmax_scale * q . k                       # (batch, nheads_q, seqlen_q, seqlen_k)
    s = softcap * tanh(s / softcap)                 # softcap > 0
    s = s - slope[b, h] * |i + seqlen_k - seqlen_q - j|   # alibi_slopes
    s = s + attn_bias[b, h, i, j]                   # attn_bias, broadcast
    s = -inf where key j is outside causal / window_size, or attn_mask[b, h, i, j] is False
    p = exp(s - lse),  lse = log(sum_j exp(s_ij) + exp(sinks[h]))   # sinks: no value
    p = p * dropout_mask / (1 - dropout_p)          # lse stays the undropped one
    out = p @ v

A window is ``window_size=(left, right)`` (-1 = unbounded): query ``i`` sees key
``j`` iff ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``;
``causal`` sets ``right = 0``.  ``attn_bias`` (float) and ``attn_mask`` (bool,
True = attend) broadcast to ``(batch, nheads_q, seqlen_q, seqlen_k)`` by NumPy's
rules; a ``-inf`` bias hides a key like the mask.  A row with no visible key
(whichever hides it) has output 0 and lse ``-inf`` (``sinks[h]`` with sinks) and
zero gradients; ``dbias`` is the gradient of the final score ``s`` summed over
the bias's broadcast dimensions.

:func:`attention_fwd` / :func:`attention_bwd` compute in float64.  Their
backward is the textbook softmax Jacobian, independent of the FlashAttention
``delta`` trick, and is checked against finite differences in the tests.

:func:`naive_attention` / :func:`naive_attention_bwd` compute the same thing the
way a naive PyTorch implementation would in a low precision: every matmul
accumulates in float32 and rounds its result to ``dtype``, the scaled scores
and the softmax are rounded to ``dtype``.  Their error against the float64
reference sets the tolerance for the fast paths (see :mod:`cupyflash.testing`).

Inputs may be NumPy arrays of any float dtype (including ml_dtypes bfloat16) or
CuPy arrays, which are copied to the host.
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = [
    "visible_keys",
    "attention_fwd",
    "attention_bwd",
    "attention_probs",
    "attention_with_kvcache",
    "naive_attention",
    "naive_attention_bwd",
]


def _host(x, dtype=None):
    """A NumPy array from a NumPy or CuPy array (CuPy arrays are ``.get()``-ed)."""
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()
    return np.asarray(x) if dtype is None else np.asarray(x, dtype=dtype)


def _default_scale(softmax_scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def visible_keys(seqlen_q, seqlen_k, causal, *, window_size=(-1, -1)):
    """Boolean ``(seqlen_q, seqlen_k)`` mask, True where query ``i`` sees key ``j``.

    Parameters
    ----------
    seqlen_q, seqlen_k : int
    causal : bool
        Bottom-right aligned: ``j <= i + seqlen_k - seqlen_q`` (``right = 0``).
    window_size : (int, int), optional
        ``(left, right)``, -1 = unbounded (the default, no window).  Query ``i``
        sees key ``j`` iff ``i + seqlen_k - seqlen_q - left <= j`` (when
        ``left >= 0``) and ``j <= i + seqlen_k - seqlen_q + right`` (when
        ``right >= 0``); ``causal`` replaces ``right`` with 0.
    """
    left, right = (-1, -1) if window_size is None else (int(w) for w in window_size)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return np.ones((seqlen_q, seqlen_k), dtype=bool)
    diag = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)  # key on query i's diagonal
    cols = np.arange(seqlen_k)[None, :]
    visible = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        visible &= cols >= diag - left
    if right >= 0:
        visible &= cols <= diag + right
    return visible


def _check_shapes(fn, q, k, v=None, dout=None):
    """The layout rules of the fast paths, so that a mismatch is named instead of
    broadcast (a k of batch 1 against a q of batch 2) or failed deep in numpy."""
    def fail(message):
        raise ValueError(f"cupyflash.reference.{fn}: {message}")

    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else []) + (
        [("dout", dout)] if dout is not None else [])
    for name, x in named:
        if np.ndim(x) != 4:
            fail(f"{name} must have 4 dimensions (batch, seqlen, nheads, head_dim); got shape {np.shape(x)}.")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        fail(f"k must have q's batch ({q.shape[0]}) and head_dim ({q.shape[3]}); got shape {k.shape}.")
    if v is not None and v.shape[:3] != k.shape[:3]:  # (its head_dim may differ: the math allows it)
        fail(f"v must have k's (batch, seqlen, nheads) {k.shape[:3]}; got shape {v.shape}.")
    if dout is not None and dout.shape != q.shape:
        fail(f"dout must have q's shape {q.shape}; got {dout.shape}.")
    nheads, nheads_kv = q.shape[2], k.shape[2]
    if (nheads_kv == 0 and nheads != 0) or (nheads_kv and nheads % nheads_kv):
        fail(f"k must have a number of heads that divides q's ({nheads}); got {nheads_kv}.")


def _heads_first(x, nheads):
    """(B, S, Hkv, D) -> (B, nheads, S, D), repeating each KV head for its query heads."""
    x = x.transpose(0, 2, 1, 3)
    if x.shape[1] == 0 and nheads == 0:  # no head at all: nothing to repeat
        return x
    return np.repeat(x, nheads // x.shape[1], axis=1)


def _sum_groups(grad, nheads_kv):
    """(B, Hq, S, D) gradient of the repeated KV heads -> (B, S, Hkv, D)."""
    batch, nheads, seqlen, head_dim = grad.shape
    if nheads_kv == 0:
        return np.zeros((batch, seqlen, 0, head_dim), dtype=grad.dtype)
    grad = grad.reshape(batch, nheads_kv, nheads // nheads_kv, seqlen, head_dim).sum(axis=2)
    return grad.transpose(0, 2, 1, 3)


def _softmax_rows(scores, visible):
    """Softmax and logsumexp over the last axis, with -inf in masked places.

    Rows with no visible key get probabilities 0 and lse -inf (not NaN).
    """
    from scipy.special import logsumexp, softmax  # imported here: it takes ~0.2 s

    if scores.shape[-1] == 0:  # no key at all: scipy cannot reduce an empty axis
        return np.zeros(scores.shape, scores.dtype), np.full(scores.shape[:-1], -np.inf)
    # a row with no visible key, or whose only visible term is a -inf sink (no sink)
    empty = ~visible.any(axis=-1) | np.isneginf(np.where(visible, scores, -np.inf)).all(axis=-1)
    safe = np.where(empty[..., None], 0.0, scores)
    p = softmax(safe, axis=-1)
    lse = logsumexp(safe, axis=-1)
    p[np.broadcast_to(empty[..., None], p.shape)] = 0.0
    lse[np.broadcast_to(empty, lse.shape)] = -np.inf
    return p, lse


def _alibi_distance(seqlen_q, seqlen_k):
    """``|i + seqlen_k - seqlen_q - j|`` as float64, shape (seqlen_q, seqlen_k)."""
    diag = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    return np.abs(diag - np.arange(seqlen_k)[None, :]).astype(np.float64)


def _alibi_slopes4(alibi_slopes):
    """(nheads,) or (batch, nheads) slopes -> float64 (1 or batch, nheads, 1, 1)."""
    slopes = _host(alibi_slopes, np.float64)
    if slopes.ndim == 1:
        slopes = slopes[None, :]
    return slopes[:, :, None, None]


def _score_shape(q, k):
    """``(batch, nheads_q, seqlen_q, seqlen_k)``."""
    return (q.shape[0], q.shape[2], q.shape[1], k.shape[1])


def _bias64(attn_bias, shape, dtype=np.float64):
    """The bias as ``dtype`` (its values rounded to ``dtype`` only through float64),
    broadcast to ``shape`` (B, Hq, Sq, Sk); None without a bias."""
    if attn_bias is None:
        return None
    return np.broadcast_to(_host(attn_bias, np.float64).astype(dtype), shape)


def _visible4(visible, attn_mask, shape):
    """The (Sq, Sk) causal/window mask and ``attn_mask`` (True = attend), broadcast
    to ``shape`` (B, Hq, Sq, Sk); ``visible`` itself without a mask."""
    if attn_mask is None:
        return visible
    mask = _host(attn_mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"attn_mask must be bool (True = attend); got {mask.dtype}")
    return visible & np.broadcast_to(mask, shape)


def _sum_to_shape(grad, shape):
    """A (B, Hq, Sq, Sk) gradient summed over the dimensions that ``shape`` broadcasts:
    the leading ones it lacks and those where it has 1."""
    grad = grad.sum(axis=tuple(range(grad.ndim - len(shape))))
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and grad.shape[a] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape)


def _with_sink_column(scores, visible, sinks, shape):
    """The scores and visibility with the sink appended as one more, always visible
    key (B, Hq, Sq, Sk + 1)."""
    sink = np.broadcast_to(sinks[None, :, None, None], shape[:-1] + (1,))
    visible = np.broadcast_to(visible, shape)
    return (np.concatenate([scores, sink], axis=-1),
            np.concatenate([visible, np.ones(shape[:-1] + (1,), bool)], axis=-1))


def _keep_scale(dropout_p, dropout_mask):
    """The dropout factor ``mask / (1 - p)`` (B, Hq, Sq, Sk), or None without dropout."""
    if dropout_mask is None:
        if dropout_p:
            raise ValueError("dropout_p > 0 needs the dropout_mask it applies")
        return None
    return _host(dropout_mask).astype(bool) / (1.0 - float(dropout_p))


def _probs64(q, k, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
             alibi_slopes=None, sinks=None, attn_bias=None, attn_mask=None):
    """float64 probabilities (B, Hq, Sq, Sk), lse (B, Hq, Sq), the scale used, and
    what the backward needs: ``tanh(s / softcap)`` (or None), the sink's
    probability (B, Hq, Sq) (or None) and the alibi distance (or None)."""
    scale = _default_scale(softmax_scale, q.shape[-1])
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    shape = _score_shape(q, k)
    visible = _visible4(visible_keys(seqlen_q, seqlen_k, causal, window_size=window_size),
                        attn_mask, shape)
    scores = (q.transpose(0, 2, 1, 3) @ _heads_first(k, q.shape[2]).swapaxes(-1, -2)) * scale
    tanh = distance = p_sink = None
    if softcap:
        tanh = np.tanh(scores / float(softcap))
        scores = float(softcap) * tanh
    if alibi_slopes is not None:
        distance = _alibi_distance(seqlen_q, seqlen_k)
        scores = scores - _alibi_slopes4(alibi_slopes) * distance
    if attn_bias is not None:
        scores = scores + _bias64(attn_bias, shape)
    scores = np.where(visible, scores, -np.inf)
    if sinks is None:
        p, lse = _softmax_rows(scores, visible)
        return p, lse, scale, tanh, p_sink, distance
    # the sink is one more key, always visible, whose value is 0: append it as a column
    p, lse = _softmax_rows(*_with_sink_column(scores, visible, _host(sinks, np.float64), shape))
    return p[..., :-1], lse, scale, tanh, p[..., -1], distance


def attention_fwd(q, k, v, softmax_scale=None, causal=False, *, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
                  dropout_mask=None, attn_bias=None, attn_mask=None):
    """Dense float64 attention.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads_q, head_dim)
    k, v : array, shape (batch, seqlen_k, nheads_kv, head_dim)
        Any float dtype; NumPy or CuPy.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool, optional
        Bottom-right aligned causal mask: query ``i`` sees key ``j`` iff
        ``j <= i + seqlen_k - seqlen_q`` (a window with ``right = 0``).
    window_size : (int, int), optional
        ``(left, right)`` sliding window, -1 = unbounded on that side; the default
        ``(-1, -1)`` is no window.  Bottom-right aligned: query ``i`` sees key
        ``j`` iff ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k -
        seqlen_q + right``.  With ``causal``, ``right`` is 0.
    softcap : float, optional
        0 (the default) is off.  Otherwise the scaled scores become
        ``softcap * tanh(s / softcap)``, before ALiBi and masking.
    alibi_slopes : array, shape (nheads_q,) or (batch, nheads_q), optional
        float32 or float64, NumPy or CuPy.  Adds
        ``-slope[b, h] * |i + seqlen_k - seqlen_q - j|`` to the (softcapped)
        scores (bottom-right aligned, as flash-attention).
    sinks : array, shape (nheads_q,), optional
        Any float dtype.  One logit per query head, in the units of the scaled
        scores, that joins every row's softmax denominator but carries no value,
        so a row's weights sum to less than 1.  A row with no visible key then
        has output 0 and lse ``sinks[h]``.
    dropout_p : float, optional
        Dropout probability in [0, 1); the kept probabilities are multiplied by
        ``1 / (1 - dropout_p)``.  Needs ``dropout_mask`` when > 0.
    dropout_mask : bool array, shape (batch, nheads_q, seqlen_q, seqlen_k), optional
        True = keep.  Applied to the probabilities after the softmax (so also
        with ``dropout_p = 0``); the reference does not draw it.
    attn_bias : array, optional
        Any float dtype, NumPy or CuPy, any strides; broadcastable (NumPy's
        rules) to ``(batch, nheads_q, seqlen_q, seqlen_k)``.  Added to the
        scores after the softcap and ALiBi (in float64); a ``-inf`` entry hides
        the key; NaN and ``+inf`` propagate.
    attn_mask : bool array, optional
        Broadcastable like ``attn_bias``; True = attend, False hides the key
        (as the causal mask does).

    Returns
    -------
    out : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim), float64
    lse : numpy.ndarray, shape (batch, nheads_q, seqlen_q), float64
        Natural-log logsumexp of the modified, masked scores (and of the sink
        when ``sinks`` is given), before dropout; ``-inf`` for a row that sees
        no key and has no sink.
    """
    q, k, v = (_host(x, np.float64) for x in (q, k, v))
    _check_shapes("attention_fwd", q, k, v)
    p, lse, *_ = _probs64(q, k, softmax_scale, causal, window_size, softcap,
                          alibi_slopes, sinks, attn_bias, attn_mask)
    keep = _keep_scale(dropout_p, dropout_mask)
    if keep is not None:
        p = p * keep
    out = p @ _heads_first(v, q.shape[2])
    return out.transpose(0, 2, 1, 3), lse


def attention_probs(q, k, softmax_scale=None, causal=False, *, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, sinks=None, attn_bias=None, attn_mask=None, **dropout):
    """The float64 softmax probabilities of :func:`attention_fwd`, before dropout.

    Parameters
    ----------
    q, k, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, attn_bias, attn_mask
        As for :func:`attention_fwd`.
    **dropout
        ``dropout_p`` and ``dropout_mask`` are taken and ignored (the
        probabilities are those before dropout).

    Returns
    -------
    p : numpy.ndarray, shape (batch, nheads_q, seqlen_q, seqlen_k), float64
        ``exp(s - lse)``, 0 where a key is hidden; with sinks a row sums to less
        than 1 (the sink's share is not a column).
    """
    q, k = (_host(x, np.float64) for x in (q, k))
    _check_shapes("attention_probs", q, k)
    return _probs64(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, attn_bias,
                    attn_mask)[0]


def attention_bwd(dout, q, k, v, softmax_scale=None, causal=False, *, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
                  dropout_mask=None, return_dalibi=False, attn_bias=None, attn_mask=None,
                  return_dbias=False):
    """Gradients of ``sum(dout * attention_fwd(q, k, v, ...)[0])`` in float64.

    Parameters
    ----------
    dout : array, shape (batch, seqlen_q, nheads_q, head_dim)
    q, k, v, softmax_scale, causal
        As for :func:`attention_fwd`.
    window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_mask
        As for :func:`attention_fwd`; the backward differentiates through the
        softcap and uses the same dropout mask.
    return_dalibi : bool, optional
        Also return the gradient with respect to ``alibi_slopes`` (which must
        then be given).  Off by default: the kernels' contract is
        ``(dq, dk, dv[, dsinks][, dbias])``.
    attn_bias, attn_mask
        As for :func:`attention_fwd`.
    return_dbias : bool, optional
        Also return the gradient with respect to ``attn_bias`` (which must then
        be given).

    Returns
    -------
    dq : numpy.ndarray, shape of ``q``, float64
    dk, dv : numpy.ndarray, shape of ``k``, float64
        Summed over the query heads that share each KV head.
    dsinks : numpy.ndarray, shape (nheads_q,), float64
        Only when ``sinks`` is given (a 4-tuple then): summed over batch and rows.
    dbias : numpy.ndarray, shape of ``attn_bias``, float64
        Only with ``return_dbias``, after ``dsinks``: ``dS``, the gradient of
        the final score (after softcap, ALiBi and the bias; dropout included),
        summed over the dimensions the bias broadcasts.  0 where a key is hidden.
    d_alibi_slopes : numpy.ndarray, shape of ``alibi_slopes``, float64
        Only with ``return_dalibi``, last: summed over rows and keys (and over
        batch for slopes of shape (nheads_q,)).
    """
    if return_dbias and attn_bias is None:
        raise ValueError("return_dbias needs attn_bias")
    dout, q, k, v = (_host(x, np.float64) for x in (dout, q, k, v))
    _check_shapes("attention_bwd", q, k, v, dout)
    nheads, nheads_kv = q.shape[2], k.shape[2]
    p, _, scale, tanh, p_sink, distance = _probs64(
        q, k, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, attn_bias, attn_mask)
    keep = _keep_scale(dropout_p, dropout_mask)
    do = dout.transpose(0, 2, 1, 3)  # (B, Hq, Sq, D)
    dp = do @ _heads_first(v, nheads).swapaxes(-1, -2)
    if keep is not None:  # out = (P * keep) @ V
        dv = (p * keep).swapaxes(-1, -2) @ do
        dp = dp * keep
    else:
        dv = p.swapaxes(-1, -2) @ do
    # softmax Jacobian-vector product: dS = P * (dP - rowsum(P * dP)); a sink only
    # enlarges the denominator, so the form is the same
    row = (p * dp).sum(axis=-1, keepdims=True)
    ds = p * (dp - row)
    dbias = _sum_to_shape(ds, np.shape(attn_bias)) if return_dbias else None
    d_alibi = None
    if return_dalibi:
        if alibi_slopes is None:
            raise ValueError("return_dalibi needs alibi_slopes")
        d_alibi = -(ds * distance).sum(axis=(-1, -2))  # (B, Hq)
        if _host(alibi_slopes).ndim == 1:
            d_alibi = d_alibi.sum(axis=0)
    if tanh is not None:  # d/ds [c tanh(s / c)] = 1 - tanh^2
        ds = ds * (1.0 - tanh * tanh)
    dq = (ds @ _heads_first(k, nheads)) * scale
    dk = (ds.swapaxes(-1, -2) @ q.transpose(0, 2, 1, 3)) * scale
    grads = [dq.transpose(0, 2, 1, 3), _sum_groups(dk, nheads_kv), _sum_groups(dv, nheads_kv)]
    if sinks is not None:  # dP_j / d sink = -P_j * P_sink
        grads.append(-(p_sink * row[..., 0]).sum(axis=(0, 2)))
    if dbias is not None:
        grads.append(dbias)
    if d_alibi is not None:
        grads.append(d_alibi)
    return tuple(grads)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                           cache_batch_idx=None, block_table=None, softmax_scale=None,
                           causal=False, *, attn_bias=None, attn_mask=None):
    """Dense float64 attention against a KV cache, after appending ``k``, ``v``.

    The semantics of :func:`cupyflash.flash_attn_with_kvcache`, written plainly:
    the append copies ``k[b, i]`` into the cache slot of position
    ``cache_seqlens[b] + i`` of sequence ``b`` (cache row ``cache_batch_idx[b]``,
    or block ``block_table[b, pos // page_size]`` at ``pos % page_size``); then
    every sequence's logical cache, ``(batch, capacity, nheads_kv, head_dim)``, is
    gathered slot by slot and one masked softmax over the whole batch runs with
    key ``j`` of sequence ``b`` visible to query ``i`` iff
    ``j < seqlen_k_b = cache_seqlens[b] + seqlen_new`` and, with ``causal``,
    ``j <= i + seqlen_k_b - seqlen_q`` (and ``attn_mask[b, h, i, j]``), the score
    plus ``attn_bias[b, h, i, j]``.  No input is modified.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads_q, head_dim)
    k_cache, v_cache : array, shape (batch_cache, seqlen_cache, nheads_kv, head_dim)
        or (num_blocks, page_size, nheads_kv, head_dim) with ``block_table``.
    k, v : array, shape (batch, seqlen_new, nheads_kv, head_dim), optional
    cache_seqlens : int or array, shape (batch,), optional
        None: the whole capacity (``seqlen_cache`` or ``max_blocks_per_seq * page_size``).
    cache_batch_idx : array, shape (batch,), optional
    block_table : array, shape (batch, max_blocks_per_seq), optional
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool, optional
    attn_bias : array, optional
        Float, rank <= 4, broadcastable to ``(batch, nheads_q, seqlen_q, key)``
        (left-padded with 1s; each of the first three dimensions 1 or full), the
        last dimension 1 or at least the capacity, indexed by the key's position
        ``j`` in its sequence.  Added to the scaled scores; ``-inf`` hides a key.
    attn_mask : bool array, optional
        Broadcastable like ``attn_bias``; False hides key ``j`` from the row.

    Returns
    -------
    out : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim), float64
    lse : numpy.ndarray, shape (batch, nheads_q, seqlen_q), float64
        ``-inf`` (and out 0) for a row that sees no key.
    k_cache, v_cache : numpy.ndarray, float64
        New arrays: the caches after the append.
    """
    q = _host(q, np.float64)
    k_cache = _host(k_cache, np.float64).copy()
    v_cache = _host(v_cache, np.float64).copy()
    batch, seqlen_q, nheads, head_dim = q.shape
    table = None if block_table is None else _host(block_table).astype(np.int64)
    page_size = k_cache.shape[1]
    capacity = page_size * table.shape[1] if table is not None else k_cache.shape[1]
    rows = (np.arange(batch) if cache_batch_idx is None
            else _host(cache_batch_idx).astype(np.int64))
    lengths = (np.full(batch, capacity, dtype=np.int64) if cache_seqlens is None
               else np.broadcast_to(_host(cache_seqlens).astype(np.int64), (batch,)))

    def slot(b, pos):
        if table is None:
            return rows[b], pos
        return table[b, pos // page_size], pos % page_size

    seqlen_new = 0
    if k is not None:
        k, v = _host(k, np.float64), _host(v, np.float64)
        seqlen_new = k.shape[1]
        for b in range(batch):
            for i in range(seqlen_new):
                where = slot(b, int(lengths[b]) + i)
                k_cache[where] = k[b, i]
                v_cache[where] = v[b, i]
    seqlen_k = lengths + seqlen_new

    nheads_kv = k_cache.shape[2]
    keys = np.zeros((batch, capacity, nheads_kv, head_dim))
    values = np.zeros((batch, capacity, nheads_kv, head_dim))
    for b in range(batch):
        for j in range(int(seqlen_k[b])):
            keys[b, j] = k_cache[slot(b, j)]
            values[b, j] = v_cache[slot(b, j)]

    scale = _default_scale(softmax_scale, head_dim)
    scores = (q.transpose(0, 2, 1, 3) @ _heads_first(keys, nheads).swapaxes(-1, -2)) * scale
    i = np.arange(seqlen_q)[None, :, None]
    j = np.arange(capacity)[None, None, :]
    visible = j < seqlen_k[:, None, None]  # (B, Sq, capacity)
    if causal:
        visible = visible & (j <= i + (seqlen_k[:, None, None] - seqlen_q))
    visible = visible[:, None]  # (B, 1, Sq, capacity): every head alike
    shape = scores.shape  # (B, Hq, Sq, capacity)
    if attn_bias is not None:
        scores = scores + _bias64(_cache_keys(attn_bias, capacity), shape)
    visible = _visible4(visible, None if attn_mask is None else _cache_keys(attn_mask, capacity), shape)
    masked = np.where(visible, scores, -np.inf)
    row_max = masked.max(axis=-1, initial=-np.inf)
    shift = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(visible, np.exp(masked - shift[..., None]), 0.0)
    total = e.sum(axis=-1)
    seen = total > 0
    p = e / np.where(seen, total, 1.0)[..., None]
    lse = np.where(seen, np.log(np.where(seen, total, 1.0)) + shift, -np.inf)
    out = p @ _heads_first(values, nheads)
    return out.transpose(0, 2, 1, 3), lse, k_cache, v_cache


def _cache_keys(x, capacity):
    """A KV-cache bias or mask (rank <= 4, last dimension 1 or >= ``capacity``) as a
    4-D host array over the key positions ``0 .. capacity - 1``."""
    x = _host(x)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    return x if x.shape[3] == 1 else x[..., :capacity]


# ----------------------------------------------------------------------------
# Naive low-precision attention, to measure what rounding alone costs.
# ----------------------------------------------------------------------------


def _resolve_dtype(dtype):
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


class _Rounding:
    """Arithmetic in ``acc`` precision with results rounded to ``dtype``."""

    def __init__(self, dtype):
        self.dtype = _resolve_dtype(dtype)
        self.acc = np.float64 if self.dtype == np.float64 else np.float32

    def round(self, x):
        return np.asarray(x).astype(self.dtype).astype(self.acc)

    def matmul(self, a, b):
        return self.round(a @ b)

    def load(self, x):
        return self.round(_host(x, np.float64))


def _naive_probs(r, q, k, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, sinks=None, attn_bias=None, attn_mask=None):
    """Naive scores -> probabilities, each step rounded; q, k in (B, S, H, D).

    Returns ``(p, lse, scale, tanh, p_sink)``: ``tanh`` (rounded) with softcap and
    the sink's probability (B, Hq, Sq) with sinks, else None."""
    scale = _default_scale(softmax_scale, q.shape[-1])
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    shape = _score_shape(q, k)
    visible = _visible4(visible_keys(seqlen_q, seqlen_k, causal, window_size=window_size),
                        attn_mask, shape)
    scores = r.matmul(q.transpose(0, 2, 1, 3), _heads_first(k, q.shape[2]).swapaxes(-1, -2))
    scores = r.round(scores * r.acc(scale))
    tanh = None
    if softcap:
        tanh = r.round(np.tanh(r.round(scores / r.acc(softcap))))
        scores = r.round(tanh * r.acc(softcap))
    if alibi_slopes is not None:  # the bias in float32 (the slopes' dtype), added into the scores
        bias = _alibi_slopes4(alibi_slopes).astype(r.acc) * _alibi_distance(seqlen_q, seqlen_k).astype(r.acc)
        scores = r.round(scores - bias)
    if attn_bias is not None:  # the bias in its own dtype, added in the accumulator's precision
        with np.errstate(over="ignore"):
            scores = r.round(scores + _bias64(attn_bias, shape, r.acc))
    scores = np.where(visible, scores, -np.inf)
    if sinks is None:
        p, lse = _softmax_rows(scores, visible)
        return r.round(p), r.round(lse), scale, tanh, None
    p, lse = _softmax_rows(*_with_sink_column(scores, visible, r.round(_host(sinks, np.float64)), shape))
    p = r.round(p)
    return p[..., :-1], r.round(lse), scale, tanh, p[..., -1]


def naive_attention(q, k, v, softmax_scale=None, causal=False, dtype=None, *, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_mask=None,
                    attn_bias=None, attn_mask=None):
    """Dense attention as a naive implementation computes it in ``dtype``.

    Each matmul accumulates in float32 (float64 when ``dtype`` is float64) and
    rounds its result to ``dtype``; the scaled scores, the softmax and the
    logsumexp are rounded to ``dtype``, and so is every step of the variants
    (the softcap's divide, tanh and multiply; the scores after the ALiBi bias,
    which is computed in float32 like its slopes; the scores after ``attn_bias``,
    whose values, in their own dtype, are added in the accumulator's precision;
    the sink logit; the dropped probabilities).  Rows with no visible key give 0
    and lse ``-inf``, as in :func:`attention_fwd`.

    Parameters
    ----------
    q, k, v, softmax_scale, causal
        As for :func:`attention_fwd`; inputs are first rounded to ``dtype``.
    dtype : dtype or str, optional
        float16, "bfloat16", float32 or float64; defaults to ``q.dtype``.
    window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_mask, attn_bias, attn_mask
        The variants, as for :func:`attention_fwd` (all off by default).

    Returns
    -------
    out : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim), ``dtype``
    lse : numpy.ndarray, shape (batch, nheads_q, seqlen_q), ``dtype``
    """
    r = _Rounding(_host(q).dtype if dtype is None else dtype)
    q, k, v = (r.load(x) for x in (q, k, v))
    _check_shapes("naive_attention", q, k, v)
    p, lse, *_ = _naive_probs(r, q, k, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              sinks, attn_bias, attn_mask)
    keep = _keep_scale(dropout_p, dropout_mask)
    if keep is not None:
        p = r.round(p * keep)
    out = r.matmul(p, _heads_first(v, q.shape[2]))
    return out.transpose(0, 2, 1, 3).astype(r.dtype), lse.astype(r.dtype)


def naive_attention_bwd(dout, q, k, v, softmax_scale=None, causal=False, dtype=None, *,
                        window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                        dropout_p=0.0, dropout_mask=None, attn_bias=None, attn_mask=None,
                        return_dbias=False):
    """Backward of :func:`naive_attention`, as autograd would run it in ``dtype``.

    Parameters
    ----------
    dout, q, k, v, softmax_scale, causal, dtype
        As for :func:`naive_attention`.
    window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_mask, attn_bias, attn_mask
        As for :func:`attention_bwd`.
    return_dbias : bool, optional
        Also return the bias's gradient: the rounded ``dS`` summed (in the
        accumulator's precision) over the bias's broadcast dimensions, rounded.

    Returns
    -------
    dq : numpy.ndarray, shape of ``q``, ``dtype``
    dk, dv : numpy.ndarray, shape of ``k``, ``dtype``
    dsinks : numpy.ndarray, shape (nheads_q,), ``dtype``
        Only when ``sinks`` is given.
    dbias : numpy.ndarray, shape of ``attn_bias``, ``dtype``
        Only with ``return_dbias``, last.
    """
    if return_dbias and attn_bias is None:
        raise ValueError("return_dbias needs attn_bias")
    r = _Rounding(_host(q).dtype if dtype is None else dtype)
    dout, q, k, v = (r.load(x) for x in (dout, q, k, v))
    _check_shapes("naive_attention_bwd", q, k, v, dout)
    nheads, nheads_kv = q.shape[2], k.shape[2]
    p, _, scale, tanh, p_sink = _naive_probs(r, q, k, softmax_scale, causal, window_size, softcap,
                                             alibi_slopes, sinks, attn_bias, attn_mask)
    keep = _keep_scale(dropout_p, dropout_mask)
    do = dout.transpose(0, 2, 1, 3)
    dv = r.matmul((p if keep is None else r.round(p * keep)).swapaxes(-1, -2), do)
    dp = r.matmul(do, _heads_first(v, nheads).swapaxes(-1, -2))
    if keep is not None:
        dp = r.round(dp * keep)
    row = (p * dp).sum(axis=-1, keepdims=True)
    ds = r.round(p * (dp - row))
    dbias = r.round(_sum_to_shape(ds, np.shape(attn_bias))) if return_dbias else None
    if tanh is not None:
        ds = r.round(ds * r.round(1 - tanh * tanh))
    ds = r.round(ds * r.acc(scale))
    dq = r.matmul(ds, _heads_first(k, nheads))
    dk = r.matmul(ds.swapaxes(-1, -2), q.transpose(0, 2, 1, 3))
    grads = (
        dq.transpose(0, 2, 1, 3),
        r.round(_sum_groups(dk, nheads_kv)),
        r.round(_sum_groups(dv, nheads_kv)),
    )
    if p_sink is not None:
        grads += (r.round(-(p_sink * row[..., 0]).sum(axis=(0, 2))),)
    if dbias is not None:
        grads += (dbias,)
    return tuple(g.astype(r.dtype) for g in grads)


def _underflow_is_zero(fn):
    """``fn`` with float underflow ignored whatever the caller's ``np.seterr`` (as in
    :mod:`cupyflash.cpu`): far-below-max probabilities and the naive path's rounding to
    float16 / bfloat16 underflow by design."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(under="ignore"):
            return fn(*args, **kwargs)

    return wrapper


attention_fwd = _underflow_is_zero(attention_fwd)
attention_bwd = _underflow_is_zero(attention_bwd)
attention_probs = _underflow_is_zero(attention_probs)
attention_with_kvcache = _underflow_is_zero(attention_with_kvcache)
naive_attention = _underflow_is_zero(naive_attention)
naive_attention_bwd = _underflow_is_zero(naive_attention_bwd)
