"""Tiled FlashAttention-2 in NumPy: the CPU path and the executable spec of the kernels.

This module runs the same algorithm as the CUDA kernels, tile by tile, so that a
reader can follow the kernels' arithmetic here and a test can compare the two:

* Forward (Dao 2023, Algorithm 1): for each tile of ``BLOCK_M`` query rows, walk
  the key tiles of ``BLOCK_N`` keys with an online softmax whose state is the
  running row max ``m`` (of the raw scores), the running row sum ``l`` and the
  unnormalised accumulator ``acc``.  Exponentials are ``exp2`` with
  ``softmax_scale * log2(e)`` folded into the scores; the tile ends with one
  divide by ``l`` and ``lse = m * softmax_scale + log(l)``.
* Backward (Dao 2023, Algorithm 2): a preprocess ``delta = rowsum(dO * O)``,
  then for each key tile a walk over the query tiles that recomputes ``P`` from
  ``lse`` and accumulates ``dV``, ``dK`` (per key tile) and ``dQ`` (across key
  tiles, as the kernels do with fp32 atomics).

Accumulation is float32 whatever the input dtype; outputs come back in the
input dtype and ``lse`` in float32.  Batch and heads are vectorised: the
``G = nheads_q // nheads_kv`` query heads that share a KV head are stacked
along the row axis of a tile, so one ``(B, Hkv, G*BM, D) @ (B, Hkv, D, BN)``
product serves the whole group and the KV-head gradients come out already
summed over the group.  K and V are never expanded; extra memory is O(tile)
plus the outputs (and a float32 dQ accumulator in the backward).

Causal masking aligns the mask bottom-right: query ``i`` sees key ``j`` iff
``j <= i + seqlen_k - seqlen_q``.  Tiles that no query of the tile can see are
skipped; only the boundary tiles run the masked path.  A row that sees no key
ends with ``l == 0``: its output is 0, its lse ``-inf``, its gradients 0.

The functions take validated arguments (see :mod:`cupyflash._checks`); call
them through :func:`cupyflash.flash_attn_fwd` and :func:`cupyflash.flash_attn_bwd`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK_M", "BLOCK_N", "fwd", "bwd"]

# Tile sizes.  Any value is correct; these keep a (B, H, BM, BN) float32 score
# tile small enough for the cache while amortising NumPy's per-call overhead.
BLOCK_M = 128
BLOCK_N = 128

LOG2E = 1.4426950408889634  # 1/ln(2): exp(x) == exp2(x * LOG2E)

_F32 = np.float32


# ----------------------------------------------------------------------------
# Tile movement: (B, S, H, D) slices in any dtype <-> float32 tiles laid out
# (B, Hkv, rows, D), with the G query heads of a KV head stacked in the rows.
# ----------------------------------------------------------------------------


def _load_q_rows(x, m0, m1, nheads_kv):
    """Rows [m0, m1) of a (B, S, Hq, D) array as a float32 (B, Hkv, G*(m1-m0), D) tile."""
    batch, _, nheads, head_dim = x.shape
    group = nheads // nheads_kv
    rows = x[:, m0:m1].reshape(batch, m1 - m0, nheads_kv, group, head_dim)
    tile = np.ascontiguousarray(rows.transpose(0, 2, 3, 1, 4), dtype=_F32)
    return tile.reshape(batch, nheads_kv, group * (m1 - m0), head_dim)


def _store_q_rows(dst, m0, m1, tile, *, add=False):
    """Write (or add) a (B, Hkv, G*(m1-m0), D) tile into rows [m0, m1) of ``dst``."""
    batch, nheads_kv, _, head_dim = tile.shape
    group = dst.shape[2] // nheads_kv
    view = dst[:, m0:m1].reshape(batch, m1 - m0, nheads_kv, group, head_dim)
    src = tile.reshape(batch, nheads_kv, group, m1 - m0, head_dim).transpose(0, 3, 1, 2, 4)
    if add:
        view += src
    else:
        view[...] = src


def _load_kv_rows(x, n0, n1):
    """Rows [n0, n1) of a (B, S, Hkv, D) array as a float32 (B, Hkv, n1-n0, D) tile."""
    return np.ascontiguousarray(x[:, n0:n1].transpose(0, 2, 1, 3), dtype=_F32)


def _stats_rows(x, m0, m1, nheads_kv):
    """Columns [m0, m1) of a (B, Hq, S) row statistic as (B, Hkv, G*(m1-m0), 1)."""
    batch, nheads, _ = x.shape
    tile = x[:, :, m0:m1].reshape(batch, nheads_kv, (nheads // nheads_kv) * (m1 - m0))
    return tile[..., None]


def _store_stats_rows(dst, m0, m1, tile):
    """Write a (B, Hkv, G*(m1-m0)) row statistic into columns [m0, m1) of ``dst``."""
    batch, nheads, _ = dst.shape
    dst[:, :, m0:m1] = tile.reshape(batch, nheads, m1 - m0)


# ----------------------------------------------------------------------------
# Causal bounds: which tiles are skipped, which need the mask.
# ----------------------------------------------------------------------------


def _key_tiles(m0, m1, seqlen_q, seqlen_k, causal):
    """Key range for query rows [m0, m1): ``(n_split, n_end)``.

    Key tiles starting below ``n_split`` are fully visible to every row of the
    query tile (no mask); tiles in ``[n_split, n_end)`` straddle the diagonal
    (masked path); keys from ``n_end`` on are invisible to the whole tile.
    """
    if not causal:
        return seqlen_k, seqlen_k
    offset = seqlen_k - seqlen_q
    n_end = min(max(m1 + offset, 0), seqlen_k)  # last row m1-1 sees keys < m1 + offset
    n_full = max(m0 + offset + 1, 0)  # first row m0 sees keys < m0 + offset + 1
    if n_full >= n_end:
        return n_end, n_end
    return (n_full // BLOCK_N) * BLOCK_N, n_end


def _query_tiles(n0, n1, seqlen_q, seqlen_k, causal):
    """Query range for key rows [n0, n1): ``(m_begin, m_split)``.

    Query tiles in ``[m_begin, m_split)`` straddle the diagonal (masked path);
    tiles from ``m_split`` on see the whole key tile; rows below ``m_begin``
    see none of it.  Both bounds are multiples of ``BLOCK_M``.
    """
    if not causal:
        return 0, 0
    offset = seqlen_k - seqlen_q
    first_row = min(max(n0 - offset, 0), seqlen_q)  # first row that sees key n0
    full_row = min(max(n1 - 1 - offset, 0), seqlen_q)  # first row that sees key n1-1
    m_begin = (first_row // BLOCK_M) * BLOCK_M
    m_split = -(-full_row // BLOCK_M) * BLOCK_M
    return m_begin, max(m_begin, min(m_split, seqlen_q))


def _apply_causal_mask(s, m0, m1, n0, n1, seqlen_q, seqlen_k, group):
    """Set scores of keys that query rows cannot see to -inf, in place.

    ``s`` is a (B, Hkv, G*(m1-m0), n1-n0) score tile.
    """
    offset = seqlen_k - seqlen_q
    rows = np.arange(m0, m1)[:, None]
    cols = np.arange(n0, n1)[None, :]
    hidden = cols > rows + offset  # (BM, BN)
    batch, nheads_kv = s.shape[:2]
    s5 = s.reshape(batch, nheads_kv, group, m1 - m0, n1 - n0)
    np.copyto(s5, -np.inf, where=hidden)


# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------


def _online_softmax_step(acc, row_max, row_sum, s, v_tile, scale_log2):
    """Fold one key tile into the online-softmax state; return the new state.

    ``acc`` (B, Hkv, R, D), ``row_max`` and ``row_sum`` (B, Hkv, R) float32;
    ``s`` (B, Hkv, R, BN) raw scores (overwritten); ``v_tile`` (B, Hkv, BN, D).
    """
    new_max = np.maximum(row_max, s.max(axis=-1))
    # A row that has seen only masked keys keeps a max of -inf; subtracting 0
    # instead keeps exp2(-inf - -inf) = NaN out of it (every p is exp2(-inf) = 0).
    max_scaled = np.where(new_max == -np.inf, _F32(0), new_max * scale_log2)
    # --- p = exp2(s * scale * log2e - max * scale * log2e)
    s *= scale_log2
    s -= max_scaled[..., None]
    p = np.exp2(s, out=s)
    # --- rescale the old state by exp2(old_max - new_max) and add this tile
    alpha = np.exp2(row_max * scale_log2 - max_scaled)
    row_sum = row_sum * alpha + p.sum(axis=-1)
    acc *= alpha[..., None]
    acc += p @ v_tile
    return acc, new_max, row_sum


def _finalize(acc, row_max, row_sum, softmax_scale):
    """Normalise the accumulator; return ``(out_tile, lse_tile)`` in float32."""
    seen = row_sum > 0
    inv_sum = np.divide(_F32(1), row_sum, out=np.zeros_like(row_sum), where=seen)
    acc *= inv_sum[..., None]
    lse = np.log(row_sum, out=np.full_like(row_sum, -np.inf), where=seen)
    lse += np.where(seen, row_max * _F32(softmax_scale), _F32(0))
    return acc, lse


def fwd(q, k, v, softmax_scale, causal):
    """Tiled forward pass: ``(out, lse)`` for validated, non-empty inputs.

    Parameters
    ----------
    q : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim)
    k, v : numpy.ndarray, shape (batch, seqlen_k, nheads_kv, head_dim)
        Same dtype as ``q`` (float16, bfloat16, float32 or float64); any strides.
    softmax_scale : float
        Multiplies ``q @ k.T`` before the softmax.
    causal : bool
        Bottom-right aligned causal mask.

    Returns
    -------
    out : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim), dtype of ``q``
    lse : numpy.ndarray, shape (batch, nheads_q, seqlen_q), float32
        Natural-log logsumexp of the scaled scores; ``-inf`` for a row that sees no key.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale_log2 = _F32(softmax_scale * LOG2E)
    out = np.empty(q.shape, dtype=q.dtype)
    lse = np.empty((batch, nheads, seqlen_q), dtype=_F32)

    for m0 in range(0, seqlen_q, BLOCK_M):
        m1 = min(m0 + BLOCK_M, seqlen_q)
        rows = group * (m1 - m0)
        q_tile = _load_q_rows(q, m0, m1, nheads_kv)
        acc = np.zeros((batch, nheads_kv, rows, head_dim), dtype=_F32)
        row_max = np.full((batch, nheads_kv, rows), -np.inf, dtype=_F32)
        row_sum = np.zeros((batch, nheads_kv, rows), dtype=_F32)
        n_split, n_end = _key_tiles(m0, m1, seqlen_q, seqlen_k, causal)

        # --- key tiles every row sees: no mask code at all
        for n0 in range(0, n_split, BLOCK_N):
            n1 = min(n0 + BLOCK_N, n_end)
            s = q_tile @ _load_kv_rows(k, n0, n1).swapaxes(-1, -2)
            acc, row_max, row_sum = _online_softmax_step(
                acc, row_max, row_sum, s, _load_kv_rows(v, n0, n1), scale_log2
            )
        # --- boundary key tiles on the causal diagonal: masked
        for n0 in range(n_split, n_end, BLOCK_N):
            n1 = min(n0 + BLOCK_N, n_end)
            s = q_tile @ _load_kv_rows(k, n0, n1).swapaxes(-1, -2)
            _apply_causal_mask(s, m0, m1, n0, n1, seqlen_q, seqlen_k, group)
            acc, row_max, row_sum = _online_softmax_step(
                acc, row_max, row_sum, s, _load_kv_rows(v, n0, n1), scale_log2
            )

        out_tile, lse_tile = _finalize(acc, row_max, row_sum, softmax_scale)
        _store_q_rows(out, m0, m1, out_tile)
        _store_stats_rows(lse, m0, m1, lse_tile)
    return out, lse


# ----------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------


def _row_dot(dout, out):
    """Preprocess: ``delta = rowsum(dout * out)`` in float32, shape (B, Hq, S)."""
    batch, seqlen, nheads, _ = out.shape
    delta = np.empty((batch, nheads, seqlen), dtype=_F32)
    for m0 in range(0, seqlen, BLOCK_M):
        m1 = min(m0 + BLOCK_M, seqlen)
        prod = dout[:, m0:m1].astype(_F32) * out[:, m0:m1].astype(_F32)
        delta[:, :, m0:m1] = prod.sum(axis=-1).transpose(0, 2, 1)
    return delta


def _bwd_tile(k_tile, v_tile, dk_acc, dv_acc, dq_acc, q, dout, lse_log2, delta,
              m0, m1, n0, n1, scale_log2, masked, causal_dims):
    """One (query tile, key tile) step of the backward pass, accumulating in place."""
    nheads_kv = k_tile.shape[1]
    q_tile = _load_q_rows(q, m0, m1, nheads_kv)
    do_tile = _load_q_rows(dout, m0, m1, nheads_kv)
    # --- recompute P from lse: p = exp2(s * scale * log2e - lse * log2e)
    s = q_tile @ k_tile.swapaxes(-1, -2)
    if masked:
        _apply_causal_mask(s, m0, m1, n0, n1, *causal_dims)
    s *= scale_log2
    s -= _stats_rows(lse_log2, m0, m1, nheads_kv)
    # P <= 1 exactly; at huge softmax_scale the float32 rounding of s*scale and of
    # lse (their ulp exceeds 1 beyond ~1e7) could push the exponent far above 0
    # and overflow exp2 to inf (then inf * 0 = NaN in dS). Clamp it.
    np.minimum(s, 0, out=s)
    p = np.exp2(s, out=s)
    # --- dV += P^T dO (the G query heads of a KV head sum in the product)
    dv_acc += p.swapaxes(-1, -2) @ do_tile
    # --- dS = P * (dO V^T - delta)
    ds = do_tile @ v_tile.swapaxes(-1, -2)
    ds -= _stats_rows(delta, m0, m1, nheads_kv)
    ds *= p
    # --- dQ += dS K and dK += dS^T Q (softmax_scale applied once at the end)
    _store_q_rows(dq_acc, m0, m1, ds @ k_tile, add=True)
    dk_acc += ds.swapaxes(-1, -2) @ q_tile


def bwd(dout, q, k, v, out, lse, softmax_scale, causal):
    """Tiled backward pass: ``(dq, dk, dv)`` for validated, non-empty inputs.

    Parameters
    ----------
    dout, q, out : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim)
    k, v : numpy.ndarray, shape (batch, seqlen_k, nheads_kv, head_dim)
        All five in one dtype (float16, bfloat16, float32 or float64); any strides.
    lse : numpy.ndarray, shape (batch, nheads_q, seqlen_q), float32
        As returned by :func:`fwd`.
    softmax_scale : float
    causal : bool

    Returns
    -------
    dq : numpy.ndarray, shape and dtype of ``q``
    dk, dv : numpy.ndarray, shape and dtype of ``k``
        Summed over the query heads that share each KV head.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale_log2 = _F32(softmax_scale * LOG2E)
    causal_dims = (seqlen_q, seqlen_k, group)

    delta = _row_dot(dout, out)
    # A row that saw no key has lse = -inf; +inf makes every p = exp2(-inf) = 0.
    lse_log2 = np.where(lse == -np.inf, np.inf, lse * _F32(LOG2E)).astype(_F32)
    dq_acc = np.zeros(q.shape, dtype=_F32)
    dk = np.empty(k.shape, dtype=k.dtype)
    dv = np.empty(v.shape, dtype=v.dtype)

    for n0 in range(0, seqlen_k, BLOCK_N):
        n1 = min(n0 + BLOCK_N, seqlen_k)
        k_tile = _load_kv_rows(k, n0, n1)
        v_tile = _load_kv_rows(v, n0, n1)
        dk_acc = np.zeros_like(k_tile)
        dv_acc = np.zeros_like(v_tile)
        m_begin, m_split = _query_tiles(n0, n1, seqlen_q, seqlen_k, causal)
        tile_args = (k_tile, v_tile, dk_acc, dv_acc, dq_acc, q, dout, lse_log2, delta)
        # --- boundary query tiles on the causal diagonal: masked
        for m0 in range(m_begin, m_split, BLOCK_M):
            m1 = min(m0 + BLOCK_M, seqlen_q)
            _bwd_tile(*tile_args, m0, m1, n0, n1, scale_log2, True, causal_dims)
        # --- query tiles that see the whole key tile: no mask code at all
        for m0 in range(m_split, seqlen_q, BLOCK_M):
            m1 = min(m0 + BLOCK_M, seqlen_q)
            _bwd_tile(*tile_args, m0, m1, n0, n1, scale_log2, False, causal_dims)
        dk_acc *= _F32(softmax_scale)
        dk[:, n0:n1] = dk_acc.transpose(0, 2, 1, 3)
        dv[:, n0:n1] = dv_acc.transpose(0, 2, 1, 3)

    dq_acc *= _F32(softmax_scale)
    return dq_acc.astype(q.dtype, copy=False), dk, dv
