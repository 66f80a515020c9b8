"""The library's dropout generator: the ``rng_state`` a forward draws when given none.

A per-process 64-bit seed (from ``os.urandom`` at first use, or set by
:func:`manual_seed`) and a 32-bit offset.  Each forward with ``dropout_p > 0``
and no ``rng_state`` takes ``(seed, offset)`` and advances the offset by 1.

Why 1 is enough: a call's Philox counters (:mod:`cupyflash._philox`) are
``(j >> 3, i, b * nheads_q + h, offset)``: the scores of a call, whatever its
shape, use the first three words only, and the fourth is the offset alone.  Two
offsets thus never share a counter, so two calls never reuse a random number
(as long as the seed is the same; after ``2**32`` calls the offset wraps to 0
with the next seed, ``seed + 1 mod 2**64``, a new Philox key).

Drawing costs a lock and two integer operations on the host: no device sync,
no allocation of arrays.
"""

from __future__ import annotations

import numbers
import os
import threading

__all__ = ["manual_seed", "next_rng_state"]

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_lock = threading.Lock()
_state = None  # [seed, offset]: the next state to hand out; None until first use


def _reset_lock_in_child():  # a fork while another thread held the lock must not deadlock the child
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_in_child)


def manual_seed(seed):
    """Seed cupyflash's dropout generator, making the drawn dropout masks reproducible.

    A forward (:func:`cupyflash.flash_attn_fwd`, :func:`cupyflash.flash_attn`,
    the varlen functions) with ``dropout_p > 0`` and no ``rng_state`` draws
    ``rng_state = (seed, offset)`` from this generator; after
    ``manual_seed(s)`` the next draws are ``(s, 0)``, ``(s, 1)``, ... (the
    offset advances by one per call, which is enough for two calls never to
    share a random number: see :mod:`cupyflash._rng`).  Explicit ``rng_state``
    arguments neither use nor advance it.

    Parameters
    ----------
    seed : int
        In [0, 2**64).

    Raises
    ------
    TypeError
        ``seed`` is not an int (a bool is not taken).
    ValueError
        ``seed`` is outside [0, 2**64).

    Notes
    -----
    Without a call to it, the seed is drawn from ``os.urandom`` at the first
    draw of the process (a forked child continues its parent's sequence, as
    with NumPy's and torch's global generators).  The torch wrapper
    :func:`cupyflash.torch.flash_attn_func` draws from torch's generator
    instead (``torch.manual_seed``).

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> q = np.random.default_rng(0).standard_normal((1, 4, 2, 8), dtype=np.float32)
    >>> cupyflash.manual_seed(1234)
    >>> out, lse, state = cupyflash.flash_attn_fwd(q, q, q, dropout_p=0.1, return_rng_state=True)
    >>> state
    (1234, 0)
    """
    global _state
    from . import _checks

    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        _checks.fail(TypeError, "manual_seed", f"seed must be an int; got {_checks._type_name(seed)}.")  # noqa: SLF001
    if not 0 <= int(seed) <= _MASK64:
        _checks.fail(ValueError, "manual_seed", f"seed must be in [0, 2**64); got {int(seed)}.")
    with _lock:
        _state = [int(seed), 0]


def _ensure():
    global _state
    if _state is None:
        _state = [int.from_bytes(os.urandom(8), "little"), 0]
    return _state


def next_rng_state():
    """The ``(seed, offset)`` for a forward given no ``rng_state``; advances the offset."""
    with _lock:
        state = _ensure()
        seed, offset = state
        if offset == _MASK32:
            state[0], state[1] = (seed + 1) & _MASK64, 0
        else:
            state[1] = offset + 1
    return seed, offset
