"""Context parallelism: ring attention over N ranks, forward and backward.

Each rank holds one shard of the sequence axis of q, k and v.  The K/V shards
travel around the ring (rank ``r`` sends to ``r + 1`` and receives from
``r - 1``): at step ``s`` rank ``r`` holds the K/V of rank ``(r - s) % N`` and
attends its own queries to it with :func:`cupyflash.flash_attn_fwd`.  The
partial ``(out, lse)`` of the steps are merged exactly by their lse
(:func:`merge_by_lse`), the reduction split-KV uses.  The backward recomputes
each step with :func:`cupyflash.flash_attn_bwd`, given the *merged* out and lse,
so that every partial gradient is exact (``delta = rowsum(dout * out)`` and the
softmax normaliser are global); dq accumulates on the rank, dk and dv
accumulate in float32 beside the K/V shard they belong to and travel the ring
with it, one last hop bringing them home.

Layouts (the sequence axis is axis 1 of q, k, v, dout, out; axis 2 of lse):

* non-causal: contiguous shards, rank ``r`` holds ``[r * S/N, (r+1) * S/N)``
  (:func:`contiguous_shard`);
* causal: the zigzag layout.  The sequence is cut into ``2N`` chunks and rank
  ``r`` holds chunks ``r`` and ``2N-1-r``, concatenated in that order
  (:func:`zigzag_shard`): every rank then has the same causal work.  Which
  part of the queries sees which part of the keys follows from the chunks'
  global positions (see ``_causal_plan``): a later chunk sees an earlier one
  fully, a chunk sees itself causally, an earlier chunk does not see a later
  one (skipped).

Communication goes through a communicator with ``rank``, ``size`` and
``sendrecv_next(arrays) -> arrays`` (send to the next rank, receive the arrays
of the same shapes and dtypes from the previous one).  Two are provided:
:class:`NcclComm` (cupy arrays, one process per GPU) and :class:`LoopbackComm`
(N ranks simulated by threads in one process, for the tests: :func:`run_ring`).

Launching with NCCL: one process per GPU, e.g. ``torchrun --nproc-per-node=2
script.py`` (it sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) or ``mpirun -np 2
python script.py``.  Rank 0 makes the id with ``cupy.cuda.nccl.get_unique_id()``
and shares it with the others (``torch.distributed`` broadcast of the bytes, MPI
``bcast``, or a file); each process selects its GPU (``cupy.cuda.Device(
local_rank).use()``) and builds ``NcclComm(rank, size, uid)``.  On machines whose
notes ask for NVLink multicast (NVLS) off, launch with ``NCCL_NVLS_ENABLE=0``;
nothing here uses multicast.

Status: the schedule, the layouts and the merge are checked on the CPU (NumPy)
through :class:`LoopbackComm` against the float64 reference.  :class:`NcclComm`
has **not been run**: no multi-GPU machine was available.  Communication is not
yet overlapped with compute (sends and receives are issued after the step's
attention, on the current stream); the GPU bfloat16 storage form (``dtype=
"bfloat16"``) and torch tensors are not taken.
"""

from __future__ import annotations

import numbers
import sys
import threading

import numpy as np

from . import _api, _checks
from ._checks import fail

__all__ = [
    "ring_attn_fwd",
    "ring_attn_bwd",
    "merge_by_lse",
    "zigzag_shard",
    "zigzag_unshard",
    "contiguous_shard",
    "contiguous_unshard",
    "LoopbackComm",
    "run_ring",
    "NcclComm",
]


def _xp(x):
    """numpy or cupy, whichever ``x`` belongs to (cupy is never imported here)."""
    return sys.modules["cupy"] if _checks._is_gpu_array(x) else np


# ---------------------------------------------------------------- layouts


def _check_layout(fn, x, rank, size, axis, parts):
    _check_size(fn, size)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < size:
        fail(ValueError, fn, f"rank must be an int in [0, size={size}); got {rank!r}.")
    if _checks._kind(x) is None:
        fail(TypeError, fn, f"x must be a numpy or cupy array; got {_checks._type_name(x)}.")
    if not -x.ndim <= axis < x.ndim:
        fail(ValueError, fn, f"axis must be in [-{x.ndim}, {x.ndim}) for a {x.ndim}-D x; got {axis}.")
    if x.shape[axis] % parts:
        fail(ValueError, fn, f"x's axis {axis} (length {x.shape[axis]}) must be divisible by "
                             f"{parts} ({'2 * ' if parts != size else ''}size={size}).")


def _check_size(fn, size):
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        fail(ValueError, fn, f"size must be a positive int; got {size!r}.")


def _take(x, axis, start, stop):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def contiguous_shard(x, rank, size, axis=1):
    """Rank ``rank``'s contiguous shard: part ``rank`` of ``size`` equal parts of ``axis``.

    Parameters
    ----------
    x : numpy or cupy array
        The full array; ``x.shape[axis]`` must be divisible by ``size``.
    rank, size : int
        ``0 <= rank < size``.
    axis : int, optional
        The sequence axis: 1 for q, k, v, out, dout (the default), 2 for lse.

    Returns
    -------
    array
        A view of ``x``, ``x.shape[axis] // size`` long on ``axis``.

    Raises
    ------
    TypeError, ValueError
        On a non-array, a bad rank, size or axis, or a length not divisible by ``size``.
    """
    _check_layout("contiguous_shard", x, rank, size, axis, size)
    n = x.shape[axis] // size
    return _take(x, axis, rank * n, (rank + 1) * n)


def contiguous_unshard(shards, axis=1):
    """The full array from the ranks' contiguous shards (rank order); the inverse of
    :func:`contiguous_shard`."""
    shards = _check_shards("contiguous_unshard", shards)
    return _xp(shards[0]).concatenate(shards, axis=axis)


def zigzag_shard(x, rank, size, axis=1):
    """Rank ``rank``'s zigzag shard: chunks ``rank`` and ``2*size-1-rank`` of ``2*size``.

    The layout that gives every rank the same causal work.

    Parameters
    ----------
    x : numpy or cupy array
        The full array; ``x.shape[axis]`` must be divisible by ``2 * size``.
    rank, size : int
        ``0 <= rank < size``.
    axis : int, optional
        The sequence axis: 1 for q, k, v, out, dout (the default), 2 for lse.

    Returns
    -------
    array
        A new array, ``x.shape[axis] // size`` long on ``axis``: the two chunks
        concatenated, the earlier first.

    Raises
    ------
    TypeError, ValueError
        As :func:`contiguous_shard`, with ``2 * size`` for the divisibility.
    """
    _check_layout("zigzag_shard", x, rank, size, axis, 2 * size)
    c = x.shape[axis] // (2 * size)
    last = 2 * size - 1 - rank
    return _xp(x).concatenate([_take(x, axis, rank * c, (rank + 1) * c),
                               _take(x, axis, last * c, (last + 1) * c)], axis=axis)


def zigzag_unshard(shards, axis=1):
    """The full array from the ranks' zigzag shards (rank order); the inverse of
    :func:`zigzag_shard`.  Each shard's ``axis`` must have an even length."""
    shards = _check_shards("zigzag_unshard", shards)
    n = len(shards)
    length = shards[0].shape[axis]
    if length % 2:
        fail(ValueError, "zigzag_unshard", f"shards' axis {axis} must have an even length; got {length}.")
    h = length // 2
    chunks = [None] * (2 * n)
    for r, s in enumerate(shards):
        chunks[r], chunks[2 * n - 1 - r] = _take(s, axis, 0, h), _take(s, axis, h, 2 * h)
    return _xp(shards[0]).concatenate(chunks, axis=axis)


def _check_shards(fn, shards):
    shards = list(shards) if isinstance(shards, (list, tuple)) else None
    if not shards:
        fail(TypeError, fn, "shards must be a non-empty list or tuple of arrays.")
    for r, s in enumerate(shards):
        if _checks._kind(s) is None:
            fail(TypeError, fn, f"shards[{r}] must be a numpy or cupy array; got {_checks._type_name(s)}.")
        if s.shape != shards[0].shape:
            fail(ValueError, fn, f"shards[{r}] must have the shape of shards[0] {shards[0].shape}; "
                                 f"got {s.shape}.")
    return shards


# ---------------------------------------------------------------- the merge


def _check_merge(fn, out, lse, part_out, part_lse):
    arrays = (("out", out), ("lse", lse), ("part_out", part_out), ("part_lse", part_lse))
    for name, x in arrays:
        if _checks._kind(x) is None:
            fail(TypeError, fn, f"{name} must be a numpy or cupy array; got {_checks._type_name(x)}.")
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            fail(TypeError, fn, f"{name} must have a float dtype; got {_checks.dtype_desc(x.dtype)}.")
    for name, x in arrays[1:]:
        if _checks._kind(x) != _checks._kind(out):
            fail(TypeError, fn, f"{name} must be a {_checks._kind(out)} array like out; got "
                                f"{_checks._type_name(x)}.")
    if out.ndim != 4:
        fail(ValueError, fn, f"out must have 4 dimensions (batch, seqlen_q, nheads_q, head_dim); got "
                             f"{out.ndim} with shape {tuple(out.shape)}.")
    if part_out.shape != out.shape:
        fail(ValueError, fn, f"part_out must have out's shape {tuple(out.shape)}; got {tuple(part_out.shape)}.")
    batch, seqlen_q, nheads_q, _ = out.shape
    for name, x in arrays[1::2]:
        if x.shape != (batch, nheads_q, seqlen_q):
            fail(ValueError, fn, f"{name} must have shape (batch, nheads_q, seqlen_q) = "
                                 f"{(batch, nheads_q, seqlen_q)} (out's); got {tuple(x.shape)}.")


def merge_by_lse(out, lse, part_out, part_lse):
    """Merge two partial attentions over disjoint key sets into one, exactly.

    ``lse = log(exp(lse) + exp(part_lse))`` and ``out`` is the average of the two
    weighted by ``exp(lse_i - lse)``.  A row that saw no key in one part
    (lse ``-inf``) takes the other part as it is; a row with ``-inf`` in both
    stays ``-inf`` with out 0.  No NaN arises.

    Parameters
    ----------
    out, part_out : array, shape (batch, seqlen_q, nheads_q, head_dim)
        float32 (or wider) accumulator and a partial output of any float dtype.
    lse, part_lse : array, shape (batch, nheads_q, seqlen_q), float32
        Natural-log sums of exponentials.

    Returns
    -------
    out : array, dtype of ``out``
    lse : array, float32

    Raises
    ------
    TypeError
        An argument is not a numpy or cupy array, the four are not of one kind,
        or one has a non-float dtype.
    ValueError
        ``out`` is not 4-D, ``part_out`` does not have its shape, or ``lse`` and
        ``part_lse`` do not have the shape ``(batch, nheads_q, seqlen_q)`` of
        ``out`` (nothing is broadcast: a mismatched partial would be merged
        silently into every row or head).
    """
    _check_merge("merge_by_lse", out, lse, part_out, part_lse)
    xp = _xp(lse)
    with np.errstate(under="ignore"):  # a far smaller part's weight underflows to 0 by design
        new = xp.logaddexp(lse, part_lse)
        safe = xp.where(xp.isneginf(new), xp.float32(0), new)  # -inf - -inf would be NaN
        w_old = xp.exp(lse - safe).transpose(0, 2, 1)[..., None]
        w_part = xp.exp(part_lse - safe).transpose(0, 2, 1)[..., None]
        return (w_old * out + w_part * part_out).astype(out.dtype, copy=False), new.astype(xp.float32, copy=False)


# ---------------------------------------------------------------- the schedule


def _causal_plan(rank, src, n):
    """The attention calls of ``rank``'s zigzag queries against ``src``'s zigzag keys.

    Both shards are ``n = 2c`` long: chunks ``(a, 2N-1-a)``.  Returns a list of
    ``(q_rows, k_rows, causal)`` with slices of the local shards:

    * ``src == rank``: the shard's own lower triangle, ``causal=True``
      (chunk r sees itself causally, chunk 2N-1-r sees chunk r and itself);
    * ``src < rank``: every query sees chunk ``src`` (earlier than both query
      chunks) and none sees ``2N-1-src`` (later than both);
    * ``src > rank``: chunk ``r`` (earlier than both key chunks) sees nothing,
      chunk ``2N-1-r`` (later than both) sees all of them.
    """
    c, full = n // 2, slice(None)
    if src == rank:
        return [(full, full, True)]
    if src < rank:
        return [(full, slice(0, c), False)]
    return [(slice(c, n), full, False)]


def _plan(comm, causal, src, seqlen):
    if causal:
        return _causal_plan(comm.rank, src, seqlen)
    return [(slice(None), slice(None), False)]


def _check_comm(fn, comm):
    rank, size = getattr(comm, "rank", None), getattr(comm, "size", None)
    if not callable(getattr(comm, "sendrecv_next", None)):
        fail(TypeError, fn, f"comm must have a sendrecv_next method (LoopbackComm, NcclComm); "
                            f"got {_checks._type_name(comm)}.")
    for name, value in (("rank", rank), ("size", size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            fail(TypeError, fn, f"comm.{name} must be an int; got {_checks._type_name(value)}.")
    if not 0 <= rank < size:
        fail(ValueError, fn, f"comm.rank must be in [0, comm.size={size}); got {rank}.")


def _check_ring(fn, q, k, v, comm, causal, softmax_scale):
    _check_comm(fn, comm)
    _checks.check_qkv(fn, q, k, v)
    scale = _checks.check_flags(fn, softmax_scale, q.shape[-1], causal)
    if causal:
        if k.shape[1] != q.shape[1]:
            fail(ValueError, fn, f"causal ring attention is self-attention: k must have q's seqlen "
                                 f"({q.shape[1]}) in its zigzag shard; got {k.shape[1]}.")
        if q.shape[1] % 2:
            fail(ValueError, fn, f"a causal (zigzag) shard holds two equal chunks: q's seqlen must be "
                                 f"even; got {q.shape[1]}.")
    return scale


def ring_attn_fwd(q, k, v, *, comm, causal=False, softmax_scale=None):
    """Ring attention forward: this rank's share of ``flash_attn_fwd`` over the whole sequence.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q / N, nheads_q, head_dim)
        This rank's query shard: contiguous (``contiguous_shard``) when not
        causal, zigzag (``zigzag_shard``) when causal.  numpy (CPU path) or cupy
        (GPU: float16 or bfloat16 arrays are not accepted in raw-bits form, so
        float16), dtypes as :func:`cupyflash.flash_attn_fwd`.
    k, v : array, shape (batch, seqlen_k / N, nheads_kv, head_dim)
        This rank's key and value shards, in the same layout; every rank's
        shards must have the same shapes.  GQA: ``nheads_q`` a multiple of
        ``nheads_kv``.  Causal needs ``seqlen_k == seqlen_q`` (self-attention)
        and an even shard length.
    comm : communicator
        ``rank``, ``size`` and ``sendrecv_next`` (:class:`NcclComm`,
        :class:`LoopbackComm`).  Every rank must call with the same flags.
    causal : bool, optional
        The usual causal mask over the *global* positions: query ``i`` sees key
        ``j`` iff ``j <= i`` (seqlen_q == seqlen_k).
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.

    Returns
    -------
    out : array, shape of ``q``, dtype of ``q``
        Merged in float32, rounded once.
    lse : array, shape (batch, nheads_q, seqlen_q / N), float32
        Natural log; ``-inf`` for a row that sees no key (none in self-attention).

    Raises
    ------
    TypeError, ValueError
        On a bad communicator, on any input ``flash_attn_fwd`` refuses (named
        ``ring_attn_fwd``), or on a causal shard that is not self-attention or has
        an odd length.
    """
    fn = "ring_attn_fwd"
    scale = _check_ring(fn, q, k, v, comm, causal, softmax_scale)
    xp = _xp(q)
    out = xp.zeros(q.shape, xp.float32)
    lse = xp.full(_checks.lse_shape(q), -xp.inf, xp.float32)
    for step in range(comm.size):
        src = (comm.rank - step) % comm.size
        for qs, ks, c in _plan(comm, causal, src, q.shape[1]):
            o, l = _api.flash_attn_fwd(q[:, qs], k[:, ks], v[:, ks], softmax_scale=scale, causal=c)
            out[:, qs], lse[:, :, qs] = merge_by_lse(out[:, qs], lse[:, :, qs], o, l)
        if step + 1 < comm.size:
            k, v = comm.sendrecv_next((k, v))
    return out.astype(q.dtype), lse


def ring_attn_bwd(dout, q, k, v, out, lse, *, comm, causal=False, softmax_scale=None):
    """Ring attention backward: the gradients of :func:`ring_attn_fwd` for this rank's shards.

    Parameters
    ----------
    dout : array, shape of ``q``
        The gradient of this rank's out; dtype of ``q``.
    q, k, v : array
        This rank's shards, as given to :func:`ring_attn_fwd`.
    out, lse : array
        :func:`ring_attn_fwd`'s results on this rank (the merged ones: they are
        what makes every step's partial gradient exact).
    comm, causal, softmax_scale
        As given to :func:`ring_attn_fwd`.

    Returns
    -------
    dq : array, shape and dtype of ``q``
    dk, dv : array, shape and dtype of ``k``, ``v``
        Summed in float32 over every rank's queries (and, with GQA, over the
        query heads of each KV head), rounded once.

    Raises
    ------
    TypeError, ValueError
        As :func:`ring_attn_fwd`, and on a ``dout``, ``out`` or ``lse`` that
        ``flash_attn_bwd`` refuses (named ``ring_attn_bwd``).
    """
    fn = "ring_attn_bwd"
    scale = _check_ring(fn, q, k, v, comm, causal, softmax_scale)
    _checks.check_bwd_extras(fn, dout, out, lse, q)
    xp = _xp(q)
    dq = xp.zeros(q.shape, xp.float32)
    dk, dv = xp.zeros(k.shape, xp.float32), xp.zeros(v.shape, xp.float32)
    k_dtype, v_dtype = k.dtype, v.dtype
    for step in range(comm.size):
        src = (comm.rank - step) % comm.size
        for qs, ks, c in _plan(comm, causal, src, q.shape[1]):
            g_q, g_k, g_v = _api.flash_attn_bwd(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs],
                                                lse[:, :, qs], softmax_scale=scale, causal=c)
            dq[:, qs] += g_q
            dk[:, ks] += g_k
            dv[:, ks] += g_v
        if step + 1 < comm.size:
            k, v, dk, dv = comm.sendrecv_next((k, v, dk, dv))
    if comm.size > 1:  # the accumulators in hand are rank + 1's: one last hop home
        dk, dv = comm.sendrecv_next((dk, dv))
    return dq.astype(q.dtype), dk.astype(k_dtype), dv.astype(v_dtype)


# ---------------------------------------------------------------- communicators


class _Ring:
    """The state N loopback ranks share: one mailbox per rank and a barrier."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.mailbox = [None] * size


class LoopbackComm:
    """One of N ranks simulated in one process (threads), for the tests.

    Made by :func:`run_ring`, which runs the N ranks' schedules in lockstep:
    ``sendrecv_next`` posts copies of the arrays in this rank's mailbox, waits
    for every rank to post, takes the previous rank's, and waits again before
    returning (so that no mailbox is reused before it is read).  The result is
    the same for any thread timing.  Works for numpy and cupy arrays.
    """

    def __init__(self, ring, rank):
        self._ring, self.rank, self.size = ring, rank, ring.size

    def sendrecv_next(self, arrays):
        """Send ``arrays`` to rank ``rank + 1``; return those of rank ``rank - 1``."""
        ring = self._ring
        ring.mailbox[self.rank] = tuple(a.copy() for a in arrays)
        ring.barrier.wait()
        got = ring.mailbox[(self.rank - 1) % self.size]
        ring.barrier.wait()
        return got


def run_ring(fn, size):
    """Run ``fn(comm)`` for ranks ``0 .. size-1``, each in a thread with its
    :class:`LoopbackComm`; return the list of results in rank order.

    An exception in any rank aborts the barrier (so no rank waits forever) and
    the first rank's exception, in rank order, is raised here.
    """
    _check_size("run_ring", size)
    ring = _Ring(size)
    results, errors = [None] * size, [None] * size

    def body(rank):
        try:
            results[rank] = fn(LoopbackComm(ring, rank))
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors[rank] = e
            ring.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"ring-rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # A rank's own error first; then the BrokenBarrierError of a rank it stopped.
    raised = [e for e in errors if e is not None]
    raised.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
    if raised:
        raise raised[0]
    return results


class NcclComm:
    """A ring over NCCL for cupy arrays: one process per GPU.

    **Not run yet**: written from CuPy's documented ``cupy.cuda.nccl`` API
    (``NcclCommunicator(ndev, commId, rank)``, ``send``/``recv`` with
    ``groupStart``/``groupEnd``, NCCL 2.7+), but no machine with two GPUs was
    available to run it.  See the module docstring for launching.

    Parameters
    ----------
    rank, size : int
        This process's rank and the number of processes (GPUs).
    unique_id
        ``cupy.cuda.nccl.get_unique_id()`` of rank 0 (a tuple or bytes, by CuPy
        version), the same on every rank; passed to NCCL as it is.

    The current CUDA device must be this rank's GPU when it is built.
    ``sendrecv_next`` issues both transfers in one NCCL group on the current
    stream and returns once they are enqueued: the received arrays are ready for
    work on that stream.

    Raises
    ------
    RuntimeError
        When cupy or its NCCL binding cannot be imported, or NCCL is not available.
    ValueError
        On a bad ``rank`` or ``size``.
    """

    _DTYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
               "uint16": "NCCL_UINT8", "int16": "NCCL_UINT8"}  # 2-byte storage goes as bytes

    def __init__(self, rank, size, unique_id):
        fn = "NcclComm"
        _check_size(fn, size)
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < size:
            fail(ValueError, fn, f"rank must be an int in [0, size={size}); got {rank!r}.")
        try:
            import cupy
            from cupy.cuda import nccl
        except Exception as e:  # noqa: BLE001 (ImportError, or CUDA libraries missing)
            fail(RuntimeError, fn, f"needs cupy with NCCL (cupy.cuda.nccl); it did not import: {e}")
        if not getattr(nccl, "available", True):
            fail(RuntimeError, fn, "needs the NCCL library, which cupy.cuda.nccl did not find "
                                   "(pip install the nvidia-nccl-cu* wheel of cupy's CUDA).")
        try:
            devices = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001 (CUDARuntimeError: no driver, no device)
            fail(RuntimeError, fn, f"needs a CUDA GPU; CUDA says: {e}")
        if devices < 1:
            fail(RuntimeError, fn, "needs a CUDA GPU; none is visible.")
        self.rank, self.size = int(rank), int(size)
        self._cupy, self._nccl = cupy, nccl
        self._comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)

    def sendrecv_next(self, arrays):
        """Send each array to rank ``rank + 1`` and receive one of the same shape and
        dtype from rank ``rank - 1``; return the received arrays."""
        cupy, nccl = self._cupy, self._nccl
        stream = cupy.cuda.get_current_stream().ptr
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        sends = [cupy.ascontiguousarray(a) for a in arrays]
        kinds = [self._DTYPES.get(a.dtype.name) for a in sends]
        for a, kind in zip(sends, kinds):
            if kind is None:
                fail(TypeError, "NcclComm.sendrecv_next",
                     f"arrays must be float16, float32, float64 or 2-byte storage; got {a.dtype}.")
        received = [cupy.empty_like(a) for a in sends]
        nccl.groupStart()
        try:
            for a, b, kind in zip(sends, received, kinds):
                count = a.nbytes if kind == "NCCL_UINT8" else a.size
                self._comm.send(a.data.ptr, count, getattr(nccl, kind), nxt, stream)
                self._comm.recv(b.data.ptr, count, getattr(nccl, kind), prev, stream)
        finally:
            nccl.groupEnd()
        return tuple(received)
