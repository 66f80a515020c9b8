"""The dropout random numbers: Philox4x32-7, counter-based, in NumPy (issue 13).

This module is the specification the kernels' dropout must reproduce bit for
bit: the keep decision of score ``(b, h, i, j)`` (sequence ``b`` of the
batch, query head ``h``, query row ``i`` and key column ``j`` of that
sequence) depends on nothing but ``(seed, offset, b * nheads_q + h, i, j)``
and ``p``: not on tiles, splits, the kernel or the GPU, so the CPU path and
every kernel draw the same mask.

* Generator: Philox4x32 (Salmon, Moraes, Dror and Shaw, "Parallel random
  numbers: as easy as 1, 2, 3", SC 2011) with 7 rounds, the fewest the paper
  finds Crush-resistant and the count flash-attention's dropout uses; the
  round function is checked against Random123's known-answer vectors for 10
  rounds in ``tests/test_philox.py``.
* Key: ``(seed & 0xffffffff, seed >> 32)`` of a 64-bit ``seed``.
* Counter: ``(j >> 3, i, b * nheads + h, offset)``, 32 bits each; one Philox
  call gives four 32-bit words, eight 16-bit halves: half ``j & 1`` (low
  first) of word ``(j >> 1) & 3`` decides column ``j``.  One call thus covers
  the eight columns of an n8 tile, which a quad of lanes shares.
* Keep: ``half >= dropout_threshold(p)``, an integer comparison, so a kept
  fraction of ``1 - p`` within 2^-16 (flash-attention's is within 2^-8).

``offset`` (a 32-bit counter) tells the calls of one seed apart: the same
``(seed, offset)`` gives the same mask, a different one a new mask.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROUNDS", "philox4x32", "dropout_threshold", "keep_mask", "dropout_keep_mask"]

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)  # round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85                        # Weyl key increments
_LO = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)
#: Philox rounds of the dropout generator (kernels_cu/variant.cuh PHILOX_ROUNDS).
ROUNDS = 7
#: Bits of the keep decision: a 16-bit half-word against the threshold.
KEEP_BITS = 16


def philox4x32(counter, key, rounds=ROUNDS):
    """Philox4x32 with ``rounds`` rounds.

    Parameters
    ----------
    counter : array_like of uint32, shape (4, ...)
        The four counter words of each draw.
    key : tuple of two ints
        The key words (each below 2**32).
    rounds : int, optional
        7 (the dropout's, default) or 10 (Random123's default, for its
        known-answer vectors).

    Returns
    -------
    numpy.ndarray, uint32, shape (4, ...)
        The four output words of each draw.
    """
    c = [np.asarray(w, dtype=np.uint64) for w in counter]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
        p0, p1 = _M0 * c[0], _M1 * c[2]  # 64-bit products of 32-bit words: exact
        c = [(p1 >> _SHIFT) ^ c[1] ^ np.uint64(k0), p1 & _LO, (p0 >> _SHIFT) ^ c[3] ^ np.uint64(k1), p0 & _LO]
    return np.stack([w.astype(np.uint32) for w in c])


def dropout_threshold(p: float) -> int:
    """The 16-bit half-word below which a score is dropped: ``floor(p * 2**16)``,
    at most ``2**16 - 1`` (``p`` in [0, 1))."""
    return min(int(np.floor(float(p) * 2.0**KEEP_BITS)), 2**KEEP_BITS - 1)


def keep_mask(seed: int, offset: int, p: float, batch_index, head_index, rows, cols, nheads: int):
    """The keep decisions of the scores at broadcastable index arrays.

    Parameters
    ----------
    seed, offset : int
        The generator state: a 64-bit seed, a 32-bit offset.
    p : float
        The dropout probability, in [0, 1).
    batch_index, head_index, rows, cols : array_like of int
        Sequence, query head, query row and key column of each score (in the
        sequence's own coordinates), broadcast together.
    nheads : int
        Query heads per sequence (``nheads_q``): ``b * nheads + h`` is the
        counter's third word.

    Returns
    -------
    numpy.ndarray, bool
        True where the score is kept, in the broadcast shape.
    """
    b, h, i, j = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in
                                       (batch_index, head_index, rows, cols)))
    counter = ((j >> 3) & 0xFFFFFFFF, i & 0xFFFFFFFF, (b * nheads + h) & 0xFFFFFFFF,
               np.full(j.shape, int(offset) & 0xFFFFFFFF, dtype=np.int64))
    words = philox4x32(counter, (int(seed) & 0xFFFFFFFF, (int(seed) >> 32) & 0xFFFFFFFF))
    word = np.take_along_axis(words, ((j >> 1) & 3)[None], axis=0)[0]
    half = (word >> (KEEP_BITS * (j & 1)).astype(np.uint32)) & np.uint32(0xFFFF)
    return half >= np.uint32(dropout_threshold(p))


def dropout_keep_mask(seed: int, offset: int, p: float, batch: int, nheads: int, seqlen_q: int,
                      seqlen_k: int):
    """The whole keep mask of a dense batch, for tests and debugging (small shapes).

    Returns
    -------
    numpy.ndarray, bool, shape (batch, nheads, seqlen_q, seqlen_k)
        True where a probability is kept (and scaled by ``1 / (1 - p)``).
    """
    return keep_mask(seed, offset, p, np.arange(batch)[:, None, None, None], np.arange(nheads)[None, :, None, None],
                     np.arange(seqlen_q)[None, None, :, None], np.arange(seqlen_k)[None, None, None, :], nheads)
