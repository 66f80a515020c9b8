"""Dense attention written plainly: the float64 reference and a naive low-precision one.

Everything here materialises the full ``(batch, nheads, seqlen_q, seqlen_k)``
score matrix, so it is for tests and small checks only.  The masking contract is
the one of :func:`cupyflash.flash_attn_fwd`:

* layout ``(batch, seqlen, nheads, head_dim)``; K/V may have fewer heads
  (GQA/MQA), query head ``h`` reads KV head ``h // (nheads_q // nheads_kv)``;
* causal aligns bottom-right: query ``i`` sees key ``j`` iff
  ``j <= i + seqlen_k - seqlen_q``;
* a row that sees no key has output 0, lse ``-inf`` and zero gradients.

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

import math

import numpy as np

__all__ = [
    "visible_keys",
    "attention_fwd",
    "attention_bwd",
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


def visible_keys(seqlen_q, seqlen_k, causal):
    """Boolean ``(seqlen_q, seqlen_k)`` mask, True where query ``i`` sees key ``j``."""
    if not causal:
        return np.ones((seqlen_q, seqlen_k), dtype=bool)
    rows = np.arange(seqlen_q)[:, None]
    cols = np.arange(seqlen_k)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


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

    empty = ~visible.any(axis=-1)  # (Sq,)
    if scores.shape[-1] == 0:  # no key at all: scipy cannot reduce an empty axis
        return np.zeros(scores.shape, scores.dtype), np.full(scores.shape[:-1], -np.inf)
    safe = np.where(empty[:, None], 0.0, scores)
    p = softmax(safe, axis=-1)
    lse = logsumexp(safe, axis=-1)
    p[..., empty, :] = 0.0
    lse[..., empty] = -np.inf
    return p, lse


def _probs64(q, k, softmax_scale, causal):
    """float64 probabilities (B, Hq, Sq, Sk), lse (B, Hq, Sq) and the scale used."""
    scale = _default_scale(softmax_scale, q.shape[-1])
    visible = visible_keys(q.shape[1], k.shape[1], causal)
    scores = (q.transpose(0, 2, 1, 3) @ _heads_first(k, q.shape[2]).swapaxes(-1, -2)) * scale
    scores = np.where(visible, scores, -np.inf)
    p, lse = _softmax_rows(scores, visible)
    return p, lse, scale


def attention_fwd(q, k, v, softmax_scale=None, causal=False):
    """Dense float64 attention.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads_q, head_dim)
    k, v : array, shape (batch, seqlen_k, nheads_kv, head_dim)
        Any float dtype; NumPy or CuPy.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool, optional
        Bottom-right aligned causal mask.

    Returns
    -------
    out : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim), float64
    lse : numpy.ndarray, shape (batch, nheads_q, seqlen_q), float64
        Natural-log logsumexp of the scaled, masked scores.
    """
    q, k, v = (_host(x, np.float64) for x in (q, k, v))
    p, lse, _ = _probs64(q, k, softmax_scale, causal)
    out = p @ _heads_first(v, q.shape[2])
    return out.transpose(0, 2, 1, 3), lse


def attention_bwd(dout, q, k, v, softmax_scale=None, causal=False):
    """Gradients of ``sum(dout * attention_fwd(q, k, v)[0])`` in float64.

    Parameters
    ----------
    dout : array, shape (batch, seqlen_q, nheads_q, head_dim)
    q, k, v, softmax_scale, causal
        As for :func:`attention_fwd`.

    Returns
    -------
    dq : numpy.ndarray, shape of ``q``, float64
    dk, dv : numpy.ndarray, shape of ``k``, float64
        Summed over the query heads that share each KV head.
    """
    dout, q, k, v = (_host(x, np.float64) for x in (dout, q, k, v))
    nheads, nheads_kv = q.shape[2], k.shape[2]
    p, _, scale = _probs64(q, k, softmax_scale, causal)
    do = dout.transpose(0, 2, 1, 3)  # (B, Hq, Sq, D)
    dv = p.swapaxes(-1, -2) @ do
    dp = do @ _heads_first(v, nheads).swapaxes(-1, -2)
    # softmax Jacobian-vector product: dS = P * (dP - rowsum(P * dP))
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = (ds @ _heads_first(k, nheads)) * scale
    dk = (ds.swapaxes(-1, -2) @ q.transpose(0, 2, 1, 3)) * scale
    return dq.transpose(0, 2, 1, 3), _sum_groups(dk, nheads_kv), _sum_groups(dv, nheads_kv)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                           cache_batch_idx=None, block_table=None, softmax_scale=None,
                           causal=False):
    """Dense float64 attention against a KV cache, after appending ``k``, ``v``.

    The semantics of :func:`cupyflash.flash_attn_with_kvcache`, written plainly:
    the append copies ``k[b, i]`` into the cache slot of position
    ``cache_seqlens[b] + i`` of sequence ``b`` (cache row ``cache_batch_idx[b]``,
    or block ``block_table[b, pos // page_size]`` at ``pos % page_size``); then
    every sequence's logical cache, ``(batch, capacity, nheads_kv, head_dim)``, is
    gathered slot by slot and one masked softmax over the whole batch runs with
    key ``j`` of sequence ``b`` visible to query ``i`` iff
    ``j < seqlen_k_b = cache_seqlens[b] + seqlen_new`` and, with ``causal``,
    ``j <= i + seqlen_k_b - seqlen_q``.  No input is modified.

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


def _naive_probs(r, q, k, softmax_scale, causal):
    """Naive scores -> probabilities, each step rounded; q, k in (B, S, H, D)."""
    scale = _default_scale(softmax_scale, q.shape[-1])
    visible = visible_keys(q.shape[1], k.shape[1], causal)
    scores = r.matmul(q.transpose(0, 2, 1, 3), _heads_first(k, q.shape[2]).swapaxes(-1, -2))
    scores = r.round(scores * r.acc(scale))
    scores = np.where(visible, scores, -np.inf)
    p, lse = _softmax_rows(scores, visible)
    return r.round(p), r.round(lse), scale


def naive_attention(q, k, v, softmax_scale=None, causal=False, dtype=None):
    """Dense attention as a naive implementation computes it in ``dtype``.

    Each matmul accumulates in float32 (float64 when ``dtype`` is float64) and
    rounds its result to ``dtype``; the scaled scores, the softmax and the
    logsumexp are rounded to ``dtype`` too.  Rows with no visible key give 0
    and lse ``-inf``, as in :func:`attention_fwd`.

    Parameters
    ----------
    q, k, v, softmax_scale, causal
        As for :func:`attention_fwd`; inputs are first rounded to ``dtype``.
    dtype : dtype or str, optional
        float16, "bfloat16", float32 or float64; defaults to ``q.dtype``.

    Returns
    -------
    out : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim), ``dtype``
    lse : numpy.ndarray, shape (batch, nheads_q, seqlen_q), ``dtype``
    """
    r = _Rounding(_host(q).dtype if dtype is None else dtype)
    q, k, v = (r.load(x) for x in (q, k, v))
    p, lse, _ = _naive_probs(r, q, k, softmax_scale, causal)
    out = r.matmul(p, _heads_first(v, q.shape[2]))
    return out.transpose(0, 2, 1, 3).astype(r.dtype), lse.astype(r.dtype)


def naive_attention_bwd(dout, q, k, v, softmax_scale=None, causal=False, dtype=None):
    """Backward of :func:`naive_attention`, as autograd would run it in ``dtype``.

    Returns
    -------
    dq : numpy.ndarray, shape of ``q``, ``dtype``
    dk, dv : numpy.ndarray, shape of ``k``, ``dtype``
    """
    r = _Rounding(_host(q).dtype if dtype is None else dtype)
    dout, q, k, v = (r.load(x) for x in (dout, q, k, v))
    nheads, nheads_kv = q.shape[2], k.shape[2]
    p, _, scale = _naive_probs(r, q, k, softmax_scale, causal)
    do = dout.transpose(0, 2, 1, 3)
    dv = r.matmul(p.swapaxes(-1, -2), do)
    dp = r.matmul(do, _heads_first(v, nheads).swapaxes(-1, -2))
    ds = r.round(p * (dp - (p * dp).sum(axis=-1, keepdims=True)))
    ds = r.round(ds * r.acc(scale))
    dq = r.matmul(ds, _heads_first(k, nheads))
    dk = r.matmul(ds.swapaxes(-1, -2), q.transpose(0, 2, 1, 3))
    grads = (
        dq.transpose(0, 2, 1, 3),
        r.round(_sum_groups(dk, nheads_kv)),
        r.round(_sum_groups(dv, nheads_kv)),
    )
    return tuple(g.astype(r.dtype) for g in grads)
