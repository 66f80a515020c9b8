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

Variants (keyword-only, all off by default; the semantics of
:func:`cupyflash.reference.attention_fwd`), in the order the kernels apply them::

    t = softmax_scale * log2(e) * q . k                 # scores in log2 units, or with
    t = softcap * log2(e) * tanh(softmax_scale / softcap * q . k)   # softcap > 0
    t = t - slope[b, h] * log2(e) * |i + seqlen_k - seqlen_q - j|   # alibi_slopes
    t = t + log2(e) * attn_bias[b, h, i, j]              # attn_bias (broadcast)
    t = -inf outside causal / window_size                # masked tiles only
    t = -inf where not attn_mask[b, h, i, j]             # attn_mask (broadcast)
    online softmax over t (max, exp2) ... lse, with the sink folded in at the end
    p = p * keep / (1 - dropout_p)                       # lse stays the undropped one

Without softcap, ALiBi and a bias the scores stay raw and ``softmax_scale * log2(e)``
is folded into the exponent as above (bitwise the plain path); with either,
the modified scores are computed once in log2 units, and the max is taken over
exactly the values that are exponentiated, so the largest term is
``exp2(0) = 1``.  The backward recomputes the same ``t``, and ``softcap``
multiplies ``dS`` by ``1 - tanh^2``.

* **Bias and mask** (issue 14): ``attn_bias`` (float) and ``attn_mask`` (bool,
  True = attend) are 4-D arrays whose every dimension is 1 or that of
  ``(batch, nheads_q, seqlen_q, seqlen_k)``, in any strides.  Each score tile
  reads its ``(rows, keys)`` block of them in place (a size-1 dimension is
  broadcast by NumPy, never expanded), so nothing of size ``B*H*N*N`` is made.
  A ``-inf`` bias entry or a False mask entry hides the key from that row, as
  the causal mask does; a row that sees no key ends as above.  The mask's block
  map (:mod:`cupyflash._blockmask`, at this path's tile, over every batch and
  head) skips the tiles it hides wholly and runs those it keeps wholly with no
  mask: exactly the values of masking every tile, which is all the skipping
  may change (an all-hidden tile adds ``p = 0`` to every sum).  The backward's
  ``dbias = dS`` (the gradient of the final score, dropout included, before
  softcap's ``1 - tanh^2``) is summed per tile over the bias's size-1
  dimensions into an accumulator of the bias's 4-D shape (float32; float64
  for float64 inputs).

* **Window** ``(left, right)`` (-1 = unbounded), bottom-right aligned like the
  causal mask, which is the window's ``right = 0``.  Key tiles outside every
  row's window are skipped; tiles every row sees fully run unmasked; the
  masked tiles are the ones on the two window edges (see :func:`_key_tiles`
  and :func:`_query_tiles`).
* **Sinks** ``(nheads_q,)``: one more logit per head with no value, folded
  into the softmax state at the end of each query tile; lse includes it, the
  backward returns ``dsinks = -sum_{b,i} exp(sink - lse) * delta``.  A row
  that sees no key has output 0 and lse exactly ``sinks[h]``.
* **Dropout**: the keep mask of each tile is drawn by
  :func:`cupyflash._philox.keep_mask` from ``rng_state = (seed, offset)`` at
  the tile's global (batch, head, row, column) indices (the batch index
  counted from ``batch_start``), so it never depends on the tiling.  The row sum takes every probability, the accumulator the
  kept ones; ``1 / (1 - p)`` scales the output once, at the end (in the
  backward: ``dP`` per tile and ``dV`` once per key tile).

The functions take validated arguments (see :mod:`cupyflash._checks`); call
them through :func:`cupyflash.flash_attn_fwd` and :func:`cupyflash.flash_attn_bwd`.
"""

from __future__ import annotations

import functools

import numpy as np

from . import _blockmask, _philox
from ._checks import pad4

__all__ = ["BLOCK_M", "BLOCK_N", "fwd", "bwd"]

# Tile sizes.  Any value is correct; these keep a (B, H, BM, BN) float32 score
# tile small enough for the cache while amortising NumPy's per-call overhead.
BLOCK_M = 128
BLOCK_N = 128

LOG2E = 1.4426950408889634  # 1/ln(2): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): log2 units -> natural log

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


def _window(causal, window_size):
    """``(left, right)`` with -1 = unbounded; ``causal`` sets ``right = 0``."""
    left, right = (-1, -1) if window_size is None else (int(w) for w in window_size)
    left, right = max(left, -1), max(right, -1)
    return left, (0 if causal else right)


def _span(lo, hi, limit):
    """Clamp the inclusive index range [lo, hi] (None = unbounded) to [0, limit)."""
    lo = 0 if lo is None else max(lo, 0)
    hi = limit - 1 if hi is None else min(hi, limit - 1)
    return lo, hi


def _tile_ranges(lo_any, hi_any, lo_all, hi_all, limit, block):
    """Tile bounds ``(begin, full_begin, full_end, end)`` along one axis.

    ``[lo_any, hi_any]`` is what some row (or column) of the other tile sees,
    ``[lo_all, hi_all]`` what all of them see (inclusive, None = unbounded).
    Tiles start at ``begin`` (a multiple of ``block``) and step by ``block``,
    the last one ends at ``end``; the tiles in ``[full_begin, full_end)`` are
    wholly inside ``[lo_all, hi_all]`` (unmasked), the others masked.
    """
    lo, hi = _span(lo_any, hi_any, limit)
    if hi < lo:
        return 0, 0, 0, 0
    begin, end = (lo // block) * block, hi + 1
    lo_f, hi_f = _span(lo_all, hi_all, limit)
    full_begin = min(max(-(-lo_f // block) * block, begin), end)
    full_end = end if hi_f + 1 >= end else ((hi_f + 1) // block) * block
    full_end = min(max(full_end, full_begin), end)
    return begin, full_begin, full_end, end


def _key_tiles(m0, m1, seqlen_q, seqlen_k, window):
    """Key tiles for query rows [m0, m1): ``(n_begin, n_full_begin, n_full_end, n_end)``.

    ``window`` is ``(left, right)`` as from :func:`_window` (``(-1, 0)`` is
    causal, ``(-1, -1)`` no mask).  Key tiles start at ``n_begin`` and step by
    ``BLOCK_N`` up to ``n_end``; those in ``[n_full_begin, n_full_end)`` are
    fully visible to every row of the query tile (no mask); the ones before
    and after straddle a window edge (masked path); keys outside
    ``[n_begin, n_end)`` are invisible to the whole tile and skipped.
    """
    left, right = window
    offset = seqlen_k - seqlen_q
    lo_any = None if left < 0 else m0 + offset - left  # first row's left edge
    hi_any = None if right < 0 else m1 - 1 + offset + right  # last row's right edge
    lo_all = None if left < 0 else m1 - 1 + offset - left
    hi_all = None if right < 0 else m0 + offset + right
    return _tile_ranges(lo_any, hi_any, lo_all, hi_all, seqlen_k, BLOCK_N)


def _query_tiles(n0, n1, seqlen_q, seqlen_k, window):
    """Query tiles for key rows [n0, n1): ``(m_begin, m_full_begin, m_full_end, m_end)``.

    Query tiles start at ``m_begin`` and step by ``BLOCK_M`` up to ``m_end``;
    those in ``[m_full_begin, m_full_end)`` see the whole key tile (no mask),
    the ones before and after straddle a window edge (masked path); rows
    outside ``[m_begin, m_end)`` see none of the key tile and are skipped.
    """
    left, right = window
    offset = seqlen_k - seqlen_q
    # row i sees key j iff j - offset - right <= i <= j - offset + left
    lo_any = None if right < 0 else n0 - offset - right
    hi_any = None if left < 0 else n1 - 1 - offset + left
    lo_all = None if right < 0 else n1 - 1 - offset - right
    hi_all = None if left < 0 else n0 - offset + left
    return _tile_ranges(lo_any, hi_any, lo_all, hi_all, seqlen_q, BLOCK_M)


def _apply_causal_mask(s, m0, m1, n0, n1, seqlen_q, seqlen_k, group, window=(-1, 0)):
    """Set scores of keys that query rows cannot see (causal / window) to -inf, in place.

    ``s`` is a (B, Hkv, G*(m1-m0), n1-n0) score tile; ``window`` is
    ``(left, right)`` as from :func:`_window`, causal by default.
    """
    left, right = window
    diag = np.arange(m0, m1)[:, None] + (seqlen_k - seqlen_q)
    cols = np.arange(n0, n1)[None, :]
    hidden = np.zeros((m1 - m0, n1 - n0), dtype=bool)  # (BM, BN)
    if right >= 0:
        hidden |= cols > diag + right
    if left >= 0:
        hidden |= cols < diag - left
    batch, nheads_kv = s.shape[:2]
    s5 = s.reshape(batch, nheads_kv, group, m1 - m0, n1 - n0)
    np.copyto(s5, -np.inf, where=hidden)


# ----------------------------------------------------------------------------
# Variants: the score pipeline (softcap, ALiBi, mask), sinks and dropout
# ----------------------------------------------------------------------------


class _Variants:
    """The variant arguments of one call, resolved once (all off by default)."""

    def __init__(self, q_shape, nheads_kv, seqlen_k, softmax_scale, causal, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, rng_state=None,
                 batch_start=0, attn_bias=None, attn_mask=None, block_mask=None):
        _, seqlen_q, nheads, _ = q_shape
        self.nheads, self.group = nheads, nheads // nheads_kv
        self.dims = (seqlen_q, seqlen_k, self.group)
        self.scale = float(softmax_scale)
        self.scale_log2 = _F32(softmax_scale * LOG2E)
        self.window = _window(causal, window_size)
        self.softcap = float(softcap or 0.0)
        self.alibi = None  # slope * log2(e), float32 (1 or B, Hkv, G, 1, 1)
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes, dtype=_F32)
            slopes = slopes.reshape((-1, nheads_kv, self.group, 1, 1))
            self.alibi = slopes * _F32(LOG2E)
        self.sinks = None if sinks is None else np.asarray(sinks, dtype=_F32).reshape(nheads)
        self.dropout_p = float(dropout_p or 0.0)
        if self.dropout_p:
            if rng_state is None:
                raise ValueError("dropout_p > 0 needs rng_state=(seed, offset)")
            self.seed, self.offset = (int(x) for x in rng_state)
        self.batch_start = int(batch_start)  # the dropout counter's index of sequence 0
        # the bias and mask as 4-D views (size-1 dimensions broadcast, never expanded)
        self.bias = None if attn_bias is None else pad4(np.asarray(attn_bias))
        self.mask = None if attn_mask is None else pad4(np.asarray(attn_mask))
        # the mask's tile map at (BLOCK_M, BLOCK_N), over every batch and head at once
        # (a tile holds them all): EMPTY tiles are skipped, FULL ones take no mask
        self.tile_map = None
        if self.mask is not None:
            tiles = (_blockmask.cell_map(self.mask, BLOCK_M, BLOCK_N) if block_mask is None
                     else block_mask.tiles(BLOCK_M, BLOCK_N))
            self.tile_map = _blockmask.combine_heads(tiles)
        # softcap, ALiBi and a bias: scores computed once in log2 units (exponent
        # factor 1); otherwise raw scores with softmax_scale * log2(e) folded into the exponent
        self.modified = self.softcap > 0 or self.alibi is not None or self.bias is not None
        self.score_unit = _F32(1) if self.modified else self.scale_log2

    def tile_state(self, m0, n0):
        """The mask's state (``_blockmask`` EMPTY, PARTIAL, FULL) on the tile at rows
        ``m0`` and keys ``n0`` (multiples of BLOCK_M and BLOCK_N); FULL without a mask."""
        if self.tile_map is None:
            return _blockmask.FULL
        rows, cols = self.tile_map.shape
        return int(self.tile_map[0 if rows == 1 else m0 // BLOCK_M, 0 if cols == 1 else n0 // BLOCK_N])

    def sink_rows(self, rows):
        """The sink logit of each tile row, shape (1, Hkv, G*rows)."""
        sinks = self.sinks.reshape(-1, self.group, 1)
        return np.broadcast_to(sinks, sinks.shape[:2] + (rows,)).reshape(1, sinks.shape[0], -1)


def _block(x, m0, m1, n0, n1):
    """Rows [m0, m1) and keys [n0, n1) of a 4-D bias, mask or dbias (a view): a
    size-1 row or key dimension is broadcast, so it is taken whole."""
    rows = slice(None) if x.shape[2] == 1 else slice(m0, m1)
    keys = slice(None) if x.shape[3] == 1 else slice(n0, n1)
    return x[:, :, rows, keys]


def _split_heads(x, nheads_kv, group):
    """A (B', H', R, C) block (``H'`` 1 or nheads_q) as (B', Hkv, G, R, C) or (B', 1, 1, R, C),
    to broadcast against a 5-D view of a (B, Hkv, G*R, C) tile (a view: it only splits an axis)."""
    heads = (1, 1) if x.shape[1] == 1 else (nheads_kv, group)
    return x.reshape(x.shape[:1] + heads + x.shape[2:])


def _tile5(s, group):
    """A (B, Hkv, G*R, C) tile as (B, Hkv, G, R, C) (a view)."""
    batch, nheads_kv, rows, cols = s.shape
    return s.reshape(batch, nheads_kv, group, rows // group, cols)


def _add_bias(s, var, m0, m1, n0, n1):
    """``s += log2(e) * bias`` over a log2-unit (B, Hkv, G*BM, BN) score tile, in place."""
    nheads_kv = s.shape[1]
    block = _split_heads(_block(var.bias, m0, m1, n0, n1), nheads_kv, var.group)
    with np.errstate(over="ignore"):  # a bias past float32 / log2(e) is -inf (masks) or +inf
        s5 = _tile5(s, var.group)
        s5 += block.astype(_F32) * _F32(LOG2E)


def _apply_attn_mask(s, var, m0, m1, n0, n1):
    """Set the scores that ``attn_mask`` hides (False) to -inf, in place."""
    block = _split_heads(_block(var.mask, m0, m1, n0, n1), s.shape[1], var.group)
    np.copyto(_tile5(s, var.group), -np.inf, where=~block)


def _add_dbias(dbias, ds, var, m0, m1, n0, n1):
    """Add a (B, Hkv, G*BM, BN) ``dS`` tile into the (B', H', Sq', Sk') dbias accumulator,
    summed over the accumulator's size-1 (broadcast) dimensions."""
    batch, nheads_kv, rows, cols = ds.shape
    ds4 = ds.reshape(batch, nheads_kv * var.group, rows // var.group, cols)  # (B, Hq, BM, BN)
    axes = tuple(a for a in range(4) if dbias.shape[a] == 1 and ds4.shape[a] > 1)
    block = _block(dbias, m0, m1, n0, n1)
    block += ds4.sum(axis=axes, keepdims=True, dtype=dbias.dtype) if axes else ds4


def _alibi_bias(var, m0, m1, n0, n1):
    """``slope * log2(e) * |i + seqlen_k - seqlen_q - j|`` as (1 or B, Hkv, G*BM, BN)."""
    seqlen_q, seqlen_k, group = var.dims
    diag = np.arange(m0, m1)[:, None] + (seqlen_k - seqlen_q)
    dist = np.abs(diag - np.arange(n0, n1)[None, :]).astype(_F32)
    bias = var.alibi * dist  # (B', Hkv, G, BM, BN)
    return bias.reshape(bias.shape[0], bias.shape[1], group * (m1 - m0), n1 - n0)


def _scores(q_tile, k_tile, m0, m1, n0, n1, masked, var, attn_masked=True):
    """One score tile, in units of ``var.score_unit`` (raw, or log2 with the
    variants applied), masked when ``masked`` (causal, window) and, with a mask,
    ``attn_masked`` (False: the tile's mask is all True); also ``tanh`` for softcap (or None)."""
    s = q_tile @ k_tile.swapaxes(-1, -2)
    tanh = None
    if var.modified:
        if var.softcap:
            s *= _F32(var.scale / var.softcap)
            tanh = np.tanh(s, out=s)
            s = tanh * _F32(var.softcap * LOG2E)
        else:
            s *= var.scale_log2
        if var.alibi is not None:
            s -= _alibi_bias(var, m0, m1, n0, n1)
        if var.bias is not None:
            _add_bias(s, var, m0, m1, n0, n1)
    if masked:
        _apply_causal_mask(s, m0, m1, n0, n1, *var.dims, var.window)
    if var.mask is not None and attn_masked:
        _apply_attn_mask(s, var, m0, m1, n0, n1)
    return s, tanh


def _keep_tile(var, m0, m1, n0, n1, batch, nheads_kv):
    """The dropout keep mask of a (B, Hkv, G*(m1-m0), n1-n0) tile, drawn at the
    tile's global indices (so independent of the tiling)."""
    group = var.group
    heads = np.arange(nheads_kv)[:, None] * group + np.arange(group)[None, :]
    keep = _philox.keep_mask(var.seed, var.offset, var.dropout_p,
                             np.arange(var.batch_start, var.batch_start + batch)[:, None, None, None, None],
                             heads[None, :, :, None, None],
                             np.arange(m0, m1)[None, None, None, :, None],
                             np.arange(n0, n1)[None, None, None, None, :], var.nheads)
    return keep.reshape(batch, nheads_kv, group * (m1 - m0), n1 - n0)


def _tiles(begin, full_begin, full_end, end, block):
    """``(t0, t1, masked)`` for the tiles of [begin, end), in ascending order."""
    for t0 in range(begin, end, block):
        yield t0, min(t0 + block, end), not full_begin <= t0 < full_end


# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------


def _online_softmax_step(acc, row_max, row_sum, s, v_tile, scale_log2, keep=None):
    """Fold one key tile into the online-softmax state; return the new state.

    ``acc`` (B, Hkv, R, D), ``row_max`` and ``row_sum`` (B, Hkv, R) float32;
    ``s`` (B, Hkv, R, BN) scores (overwritten), ``scale_log2`` their exponent
    factor; ``v_tile`` (B, Hkv, BN, D); ``keep`` the dropout mask (or None):
    the row sum takes every probability, the accumulator the kept ones.
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
    if keep is not None:
        p *= keep
    acc *= alpha[..., None]
    acc += p @ v_tile
    return acc, new_max, row_sum


def _finalize(acc, row_max, row_sum, softmax_scale):
    """Normalise the accumulator; return ``(out_tile, lse_tile)`` in float32.

    ``softmax_scale`` turns ``row_max`` into natural-log units.
    """
    seen = row_sum > 0
    inv_sum = np.divide(_F32(1), row_sum, out=np.zeros_like(row_sum), where=seen)
    acc *= inv_sum[..., None]
    lse = np.log(row_sum, out=np.full_like(row_sum, -np.inf), where=seen)
    lse += np.where(seen, row_max * _F32(softmax_scale), _F32(0))
    return acc, lse


def _finalize_with_sink(acc, row_max, row_sum, score_unit, lse_scale, sink):
    """:func:`_finalize` with one more term, the sink logit (no value), in the sum.

    ``row_max * score_unit`` is the running max in log2 units and
    ``row_max * lse_scale`` in natural-log units; ``sink`` (1, Hkv, R) is in
    natural-log units.  The sink is folded in as one last online-softmax step,
    so a row has ``l > 0`` unless it saw no key and its sink is ``-inf`` (no
    sink): a row that saw no key gets ``lse = sink``, and out 0.
    """
    sink_log2 = sink * _F32(LOG2E)
    max_log2 = row_max * score_unit  # -inf for a row that saw no key
    new_max = np.maximum(max_log2, sink_log2)
    # no key and a -inf sink: the max stays -inf; subtracting 0 instead keeps
    # exp2(-inf - -inf) = NaN out (every term is then exp2(-inf) = 0)
    shift = np.where(new_max == -np.inf, _F32(0), new_max)
    alpha = np.exp2(max_log2 - shift)
    row_sum = row_sum * alpha + np.exp2(sink_log2 - shift)
    seen = row_sum > 0
    acc *= np.divide(alpha, row_sum, out=np.zeros_like(row_sum), where=seen)[..., None]
    top = np.where(sink_log2 >= max_log2, sink, row_max * _F32(lse_scale))
    lse = np.log(row_sum, out=np.full_like(row_sum, -np.inf), where=seen)
    lse += np.where(seen, top, _F32(0))
    return acc, lse


def _underflow_is_zero(fn):
    """Run ``fn`` with float underflow ignored, whatever the caller's ``np.seterr``.

    exp2 of a far-below-max score and the rounding of tiny values into float16 /
    bfloat16 outputs underflow by design (to 0 or a subnormal, as on the GPU);
    under a caller's ``np.seterr(all="raise")`` (a common way to hunt NaNs) they
    raised FloatingPointError on ordinary inputs.  Overflow and invalid
    operations keep the caller's settings."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(under="ignore"):
            return fn(*args, **kwargs)

    return wrapper


@_underflow_is_zero
def fwd(q, k, v, softmax_scale, causal, *, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, sinks=None, dropout_p=0.0, rng_state=None, batch_start=0,
        attn_bias=None, attn_mask=None, block_mask=None):
    """Tiled forward pass: ``(out, lse)`` for validated, non-empty inputs.

    Parameters
    ----------
    q : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim)
    k, v : numpy.ndarray, shape (batch, seqlen_k, nheads_kv, head_dim)
        Same dtype as ``q`` (float16, bfloat16, float32 or float64); any strides.
    softmax_scale : float
        Multiplies ``q @ k.T`` before the softmax.
    causal : bool
        Bottom-right aligned causal mask (a window with ``right = 0``).
    window_size : (int, int), optional
        ``(left, right)`` sliding window, -1 = unbounded; bottom-right aligned.
    softcap : float, optional
        0 = off; else scaled scores become ``softcap * tanh(s / softcap)``.
    alibi_slopes : array, shape (nheads_q,) or (batch, nheads_q), optional
        Adds ``-slope * |i + seqlen_k - seqlen_q - j|`` after the softcap.
    sinks : array, shape (nheads_q,), optional
        One logit per head in the softmax denominator, with no value.
    dropout_p : float, optional
        Dropout probability in [0, 1); needs ``rng_state``.
    rng_state : (int, int), optional
        ``(seed, offset)`` of :func:`cupyflash._philox.keep_mask`.
    batch_start : int, optional
        The dropout mask's batch index of ``q``'s first sequence (0): sequence
        ``b`` of ``q`` draws the mask of batch index ``batch_start + b``.  The
        varlen CPU path runs sequence ``b`` of a packed batch as a batch of one
        with ``batch_start=b``, so that it draws the mask the dense batch would.
    attn_bias : numpy.ndarray, optional
        Float (any dtype; used in float32), rank <= 4, broadcastable to
        ``(batch, nheads_q, seqlen_q, seqlen_k)`` with each dimension (left-padded
        with 1s) 1 or full; any strides, read in place.  Added to the scores
        after the softcap and ALiBi; ``-inf`` hides a key.
    attn_mask : numpy.ndarray of bool, optional
        Broadcastable like ``attn_bias``; False hides the key from the row.
    block_mask : cupyflash.BlockMask, optional
        ``attn_mask``'s BlockMask, whose map is reused (else it is computed here).
        Key tiles the mask hides wholly are skipped, tiles it keeps wholly take no
        mask; the results are bit for bit those of masking every tile.

    Returns
    -------
    out : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim), dtype of ``q``
    lse : numpy.ndarray, shape (batch, nheads_q, seqlen_q), float32
        Natural-log logsumexp of the (modified, masked) scaled scores and the
        sink, before dropout; ``-inf`` for a row that sees no key and no sink.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    var = _Variants(q.shape, nheads_kv, seqlen_k, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, sinks, dropout_p, rng_state, batch_start, attn_bias, attn_mask, block_mask)
    out = np.empty(q.shape, dtype=q.dtype)
    lse = np.empty((batch, nheads, seqlen_q), dtype=_F32)

    for m0 in range(0, seqlen_q, BLOCK_M):
        m1 = min(m0 + BLOCK_M, seqlen_q)
        rows = var.group * (m1 - m0)
        q_tile = _load_q_rows(q, m0, m1, nheads_kv)
        acc = np.zeros((batch, nheads_kv, rows, head_dim), dtype=_F32)
        row_max = np.full((batch, nheads_kv, rows), -np.inf, dtype=_F32)
        row_sum = np.zeros((batch, nheads_kv, rows), dtype=_F32)

        # --- key tiles in the window only; those every row sees fully take no mask
        key_range = _key_tiles(m0, m1, seqlen_q, seqlen_k, var.window)
        for n0, n1, masked in _tiles(*key_range, BLOCK_N):
            # --- the mask's block map: an empty tile adds nothing to the state (every
            # p would be 0), a full one needs no mask
            state = var.tile_state(m0, n0)
            if state == _blockmask.EMPTY:
                continue
            s, _ = _scores(q_tile, _load_kv_rows(k, n0, n1), m0, m1, n0, n1, masked, var,
                           state != _blockmask.FULL)
            keep = (_keep_tile(var, m0, m1, n0, n1, batch, nheads_kv) if var.dropout_p
                    else None)
            acc, row_max, row_sum = _online_softmax_step(
                acc, row_max, row_sum, s, _load_kv_rows(v, n0, n1), var.score_unit, keep
            )

        lse_scale = LN2 if var.modified else softmax_scale  # row_max -> natural log
        if var.sinks is not None:
            out_tile, lse_tile = _finalize_with_sink(acc, row_max, row_sum, var.score_unit,
                                                     lse_scale, var.sink_rows(m1 - m0))
        else:
            out_tile, lse_tile = _finalize(acc, row_max, row_sum, lse_scale)
        if var.dropout_p:
            out_tile *= _F32(1.0 / (1.0 - var.dropout_p))
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
              m0, m1, n0, n1, masked, var, dbias=None, attn_masked=True):
    """One (query tile, key tile) step of the backward pass, accumulating in place
    (into the 4-D ``dbias`` accumulator too, when given); ``attn_masked`` as for
    :func:`_scores`."""
    batch, nheads_kv = k_tile.shape[:2]
    q_tile = _load_q_rows(q, m0, m1, nheads_kv)
    do_tile = _load_q_rows(dout, m0, m1, nheads_kv)
    # --- recompute P from lse: p = exp2(s * scale * log2e - lse * log2e)
    s, tanh = _scores(q_tile, k_tile, m0, m1, n0, n1, masked, var, attn_masked)
    if not var.modified:
        s *= var.scale_log2
    s -= _stats_rows(lse_log2, m0, m1, nheads_kv)
    # P <= 1 exactly; at huge softmax_scale the float32 rounding of s*scale and of
    # lse (their ulp exceeds 1 beyond ~1e7) could push the exponent far above 0
    # and overflow exp2 to inf (then inf * 0 = NaN in dS). Clamp it.
    np.minimum(s, 0, out=s)
    p = np.exp2(s, out=s)
    keep = _keep_tile(var, m0, m1, n0, n1, batch, nheads_kv) if var.dropout_p else None
    # --- dV += P^T dO (the G query heads of a KV head sum in the product);
    # with dropout the kept P (1/(1-p) applied to dV at the end)
    dv_acc += (p if keep is None else p * keep).swapaxes(-1, -2) @ do_tile
    # --- dS = P * (dP - delta), dP = dO V^T (* keep / (1-p) with dropout)
    ds = do_tile @ v_tile.swapaxes(-1, -2)
    if keep is not None:
        ds *= keep
        ds *= _F32(1.0 / (1.0 - var.dropout_p))
    ds -= _stats_rows(delta, m0, m1, nheads_kv)
    ds *= p
    if dbias is not None:  # the bias is added after the softcap: its gradient is this dS
        _add_dbias(dbias, ds, var, m0, m1, n0, n1)
    if tanh is not None:  # d/dx [c tanh(x / c)] = 1 - tanh^2
        ds *= 1 - tanh * tanh
    # --- dQ += dS K and dK += dS^T Q (softmax_scale applied once at the end)
    _store_q_rows(dq_acc, m0, m1, ds @ k_tile, add=True)
    dk_acc += ds.swapaxes(-1, -2) @ q_tile


@_underflow_is_zero
def bwd(dout, q, k, v, out, lse, softmax_scale, causal, *, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, sinks=None, dropout_p=0.0, rng_state=None, batch_start=0,
        attn_bias=None, attn_mask=None, return_dbias=False, block_mask=None):
    """Tiled backward pass: ``(dq, dk, dv)`` (and ``dsinks``, ``dbias``) for validated, non-empty inputs.

    Parameters
    ----------
    dout, q, out : numpy.ndarray, shape (batch, seqlen_q, nheads_q, head_dim)
    k, v : numpy.ndarray, shape (batch, seqlen_k, nheads_kv, head_dim)
        All five in one dtype (float16, bfloat16, float32 or float64); any strides.
    lse : numpy.ndarray, shape (batch, nheads_q, seqlen_q), float32
        As returned by :func:`fwd` (with the same variants).
    softmax_scale : float
    causal : bool
    window_size, softcap, alibi_slopes, sinks, dropout_p, rng_state, batch_start, attn_bias, attn_mask, block_mask
        As for :func:`fwd`; the same values as the forward that gave ``out``.
    return_dbias : bool, optional
        Also return the gradient of ``attn_bias`` (which must be given).

    Returns
    -------
    dq : numpy.ndarray, shape and dtype of ``q``
    dk, dv : numpy.ndarray, shape and dtype of ``k``
        Summed over the query heads that share each KV head.
    dsinks : numpy.ndarray, shape (nheads_q,), float32
        Only when ``sinks`` is given: summed over batch and rows.
    dbias : numpy.ndarray, float32 (float64 for float64 inputs)
        Only with ``return_dbias``, last: ``dS``, the gradient of the final scores,
        summed over the bias's broadcast dimensions, in the shape of ``attn_bias``
        left-padded to 4 dimensions.  0 where the key is hidden.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    var = _Variants(q.shape, nheads_kv, seqlen_k, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, sinks, dropout_p, rng_state, batch_start, attn_bias, attn_mask, block_mask)
    dbias = None
    if return_dbias:
        if var.bias is None:
            raise ValueError("return_dbias needs attn_bias")
        dbias = np.zeros(var.bias.shape, dtype=np.float64 if q.dtype == np.float64 else _F32)

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
        tile_args = (k_tile, v_tile, dk_acc, dv_acc, dq_acc, q, dout, lse_log2, delta)
        # --- query tiles in the window only; those that see the whole key tile
        # take no mask
        query_range = _query_tiles(n0, n1, seqlen_q, seqlen_k, var.window)
        for m0, m1, masked in _tiles(*query_range, BLOCK_M):
            state = var.tile_state(m0, n0)  # an empty tile adds 0 to every gradient
            if state != _blockmask.EMPTY:
                _bwd_tile(*tile_args, m0, m1, n0, n1, masked, var, dbias, state != _blockmask.FULL)
        dk_acc *= _F32(softmax_scale)
        if var.dropout_p:
            dv_acc *= _F32(1.0 / (1.0 - var.dropout_p))
        dk[:, n0:n1] = dk_acc.transpose(0, 2, 1, 3)
        dv[:, n0:n1] = dv_acc.transpose(0, 2, 1, 3)

    dq_acc *= _F32(softmax_scale)
    grads = (dq_acc.astype(q.dtype, copy=False), dk, dv)
    if var.sinks is not None:
        # dP_j / d sink = -P_j * P_sink, so dsink = -sum_i P_sink,i * delta_i
        p_sink = np.exp2(var.sinks[None, :, None] * _F32(LOG2E) - lse_log2)
        dsinks = -(p_sink * delta).sum(axis=(0, 2), dtype=np.float64)
        grads += (dsinks.astype(_F32),)
    return grads if dbias is None else grads + (dbias,)
