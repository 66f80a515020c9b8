"""Attention against a KV cache, with an in-place append: decoding (issue 12).

:func:`flash_attn_with_kvcache` is flash-attention's function of that name in
the ``(batch, seqlen, nheads, head_dim)`` layout.  The cache is either dense,
one row of ``seqlen_cache`` slots per sequence (``cache_batch_idx`` picks a
sequence's row), or paged: ``num_blocks`` blocks of ``page_size`` slots, and a
``block_table`` whose row ``b`` lists, in order, the blocks holding sequence
``b``'s keys.  The new keys and values ``k``, ``v`` (if given) are written into
the cache at positions ``cache_seqlens[b] ...`` first; attention then sees
``cache_seqlens[b] + seqlen_new`` keys per sequence.

This module is the API and its executable specification:

* NumPy arrays run the CPU path: the append writes into the caller's arrays,
  then each sequence's keys and values are gathered in order (a view of a
  dense cache row; one copy of the sequence's pages for a paged cache) into
  ``(1, len, H, D)`` arrays for the tiled :func:`cupyflash.cpu.fwd`, so the
  extra memory is O(one sequence's keys), never O(batch * cache);
* an ``attn_bias`` / ``attn_mask`` (issue 14) is indexed by a key's position in
  its sequence: the CPU path hands each sequence its view of them;
* CuPy arrays (and torch / JAX CUDA arrays) are validated once per call
  signature (shapes, strides, dtypes, devices, flags; an int
  ``cache_seqlens`` on every call) and run the decode kernel
  (kernels_cu/flash_decode.cu, planned by :mod:`._gpu_decode`): values on
  the device (lengths, indices) are never read by the host;
* torch and JAX CPU arrays go through :func:`._interop.call` (viewed without
  copying; the append into a torch tensor cache is visible to the caller, an
  append into a JAX array is refused: JAX arrays are immutable, and
  ``cupyflash.jax.flash_attn_with_kvcache`` appends functionally).

:func:`cupyflash.reference.attention_with_kvcache` computes the same in
float64, densely; the tests compare the two.
"""

from __future__ import annotations

import numbers
import sys

import numpy as np

from . import _api, _checks, _interop, _launch, cpu
from ._blockmask import BlockMask
from ._checks import fail

__all__ = ["flash_attn_with_kvcache"]

_FN = "flash_attn_with_kvcache"
_FLOAT32 = np.dtype(np.float32)
_NO_WINDOW, _NO_SOFTCAP = (-1, -1), 0.0  # the variants' "off" (issue 13)
_INT32 = np.dtype(np.int32)


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


class _Plan:
    """What validation found: the lengths (host int64, or None on the GPU), the
    cache rows or page table, and the resolved flags."""

    __slots__ = ("gpu", "scale", "lengths", "rows", "table", "page_size", "seqlen_new", "capacity")


def _check(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
           softmax_scale, causal, num_splits, return_lse, dtype):
    fn = _FN
    plan = _Plan()
    plan.gpu = _checks.check_qkv(fn, q, k_cache, v_cache, dtype, names=("k_cache", "v_cache"),
                                 same_batch=False)
    batch = q.shape[0]
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        fail(ValueError, fn,
             f"{missing} must be given with {given} (the new keys and values are appended "
             f"together); got None.")
    plan.seqlen_new = 0
    if k is not None:
        _checks.check_qkv(fn, q, k, v, dtype)
        if k.shape[2] != k_cache.shape[2]:
            fail(ValueError, fn,
                 f"k must have the same nheads as k_cache ({k_cache.shape[2]}); got {k.shape[2]}.")
        plan.seqlen_new = k.shape[1]
        if not plan.gpu:  # the append writes into them
            _checks.check_numpy_outputs(fn, (("k_cache", k_cache), ("v_cache", v_cache)))
    plan.scale = _checks.check_flags(fn, softmax_scale, q.shape[3], causal)
    _checks.check_num_splits(fn, num_splits)
    _checks.check_bool(fn, "return_lse", return_lse)
    if cache_batch_idx is not None and block_table is not None:
        fail(ValueError, fn,
             "cache_batch_idx must be None when block_table is given (a paged cache has no "
             "rows to pick); got both.")

    lengths = _checks.check_cache_seqlens(fn, cache_seqlens, q)
    # An int is checked as itself too (an empty batch leaves nothing to check it by).
    int_lengths = None if lengths is None or cache_seqlens is None or hasattr(cache_seqlens, "shape") \
        else np.full(1, int(cache_seqlens), dtype=np.int64)
    if cache_seqlens is None and k is not None:
        fail(ValueError, fn,
             "cache_seqlens must be given to append k and v (None means the whole cache is "
             "valid, leaving no slot to append to); got None.")
    plan.rows = plan.table = None
    plan.page_size = 0
    if block_table is not None:
        page_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
        if page_size % _checks.PAGE_SIZE_MULTIPLE or page_size == 0:
            fail(ValueError, fn,
                 f"k_cache must have a page_size (dimension 1) that is a positive multiple of "
                 f"{_checks.PAGE_SIZE_MULTIPLE} when block_table is given; got {page_size}.")
        table = _checks.check_index_array(fn, "block_table", block_table, q,
                                          ("batch", "max_blocks_per_seq"), batch)
        capacity = block_table.shape[1] * page_size
        if lengths is None and cache_seqlens is None:
            lengths = np.full(batch, capacity, dtype=np.int64)
        _checks.check_cache_lengths(fn, lengths if int_lengths is None else int_lengths, plan.seqlen_new,
                                    capacity, page_size)
        if table is not None and lengths is not None:
            used = -(-(lengths + plan.seqlen_new) // page_size)
            _checks.check_block_indices(fn, table, used, num_blocks)
        plan.table, plan.page_size = table, page_size
    else:
        capacity = k_cache.shape[1]
        rows = None
        if cache_batch_idx is not None:
            rows = _checks.check_index_array(fn, "cache_batch_idx", cache_batch_idx, q,
                                             ("batch",), batch)
            if rows is not None:
                _checks.check_row_indices(fn, rows, k_cache.shape[0])
        elif k_cache.shape[0] != batch:
            fail(ValueError, fn,
                 f"k_cache must have the same batch size as q ({batch}) when neither "
                 f"cache_batch_idx nor block_table is given; got {k_cache.shape[0]}.")
        else:
            rows = np.arange(batch, dtype=np.int64)
        if lengths is None and cache_seqlens is None:
            lengths = np.full(batch, capacity, dtype=np.int64)
        _checks.check_cache_lengths(fn, lengths if int_lengths is None else int_lengths, plan.seqlen_new,
                                    capacity, 0)
        plan.rows = rows
    plan.lengths, plan.capacity = lengths, capacity
    if plan.seqlen_new and lengths is not None and batch:
        slots = _append_slots(plan, lengths)
        if slots is not None:
            _checks.check_distinct_slots(
                fn, "block_table" if block_table is not None else "cache_batch_idx", slots[0],
                batch, plan.seqlen_new)
    return plan


def _append_slots(plan, lengths):
    """Where the append writes, on the host: ``(slot_ids, index)`` with ``slot_ids``
    (batch, seqlen_new) unique per cache slot and ``index`` the ``(block or row,
    position)`` index arrays into the cache; None when the indices live on the GPU."""
    positions = lengths[:, None] + np.arange(plan.seqlen_new)[None, :]  # (batch, seqlen_new)
    if plan.table is not None:
        blocks = np.take_along_axis(plan.table, positions // plan.page_size, axis=1)
        offsets = positions % plan.page_size
        return blocks * plan.page_size + offsets, (blocks, offsets)
    if plan.rows is None:
        return None
    rows = np.broadcast_to(plan.rows[:, None], positions.shape)
    return rows * (int(positions.max()) + 1) + positions, (rows, positions)


# ----------------------------------------------------------------------------
# The CPU path
# ----------------------------------------------------------------------------


def _append(plan, k_cache, v_cache, k, v):
    """Write k, v (batch, seqlen_new, Hkv, D) into the cache slots, in place."""
    _, (first, second) = _append_slots(plan, plan.lengths)
    # k or v may be views of the slots being written (of either cache): copy them first.
    if any(np.may_share_memory(x, c) for x in (k, v) for c in (k_cache, v_cache)):
        k, v = k.copy(), v.copy()
    k_cache[first, second] = k
    v_cache[first, second] = v


def _sequence_kv(plan, cache, b, length):
    """Sequence ``b``'s first ``length`` keys (or values) as a (1, length, Hkv, D) array:
    a view of its dense cache row, or a copy of its pages in order."""
    if plan.table is None:
        row = int(plan.rows[b])
        return cache[row:row + 1, :length]
    pages = plan.table[b, :-(-length // plan.page_size)]
    gathered = cache[pages].reshape(1, -1, *cache.shape[2:])
    return gathered[:, :length]


def _no_broadcast_caches(k_cache, v_cache):
    """Caches an append writes must not be broadcast views (one slot for several)."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _checks._check_no_repeats(_FN, name, cache)  # noqa: SLF001


def _sequence_scores(x, b, length):
    """Sequence ``b``'s part of a 4-D bias or mask ``(batch | 1, nheads_q | 1, seqlen_q | 1,
    key | 1)``: its batch entry and its first ``length`` key positions (views)."""
    if x.shape[0] != 1:
        x = x[b:b + 1]
    return x if x.shape[3] == 1 else x[..., :length]


def _cpu(plan, q, k_cache, v_cache, k, v, causal, options=None):
    """The CPU path; ``options``: the variants for :func:`cupyflash.cpu.fwd` (``alibi_slopes``
    of shape (batch, nheads_q), ``attn_bias`` and ``attn_mask`` taken per sequence: views of
    its batch entry and key positions)."""
    options = options or {}
    if plan.seqlen_new and q.shape[0]:
        _no_broadcast_caches(k_cache, v_cache)
        _append(plan, k_cache, v_cache, k, v)
    batch, seqlen_q, nheads, _ = q.shape
    out = np.zeros(q.shape, dtype=q.dtype)
    lse = np.full((batch, nheads, seqlen_q), -np.inf, dtype=np.float32)
    if q.size == 0:
        return out, lse
    for b in range(batch):
        length = int(plan.lengths[b]) + plan.seqlen_new
        if length == 0:  # no key: out 0, lse -inf (the sink with sinks)
            if "sinks" in options:
                lse[b] = options["sinks"][:, None]
            continue
        keys = _sequence_kv(plan, k_cache, b, length)
        values = _sequence_kv(plan, v_cache, b, length)
        seq_options = dict(options)
        slopes = options.get("alibi_slopes")
        if slopes is not None and slopes.ndim == 2:
            seq_options["alibi_slopes"] = slopes[b:b + 1]
        for name in ("attn_bias", "attn_mask"):
            if name in options:
                seq_options[name] = _sequence_scores(options[name], b, length)
        seq_out, seq_lse = cpu.fwd(q[b:b + 1], keys, values, plan.scale, causal, **seq_options)
        out[b] = seq_out[0]
        lse[b] = seq_lse[0]
    return out, lse


# ----------------------------------------------------------------------------
# The GPU path (kernels_cu/flash_decode.cu through ._gpu_decode)
# ----------------------------------------------------------------------------


class _GpuCacheEntry:
    """What the planned GPU entries share (one call signature each): made after
    the full validation; later calls re-check only the value of an int
    ``cache_seqlens`` (cheap) against the capacity."""

    __slots__ = ("call", "device_id", "capacity", "seqlen_new", "variant", "_cupy", "_outputs")

    def __init__(self, call, device_id, capacity, seqlen_new, out_shape, lse_shape, itemsize, variant=False,
                 scratch_bytes=0):
        """``variant``: the plans were made with variants (issues 13, 14): each call passes
        their per-call values (the slopes', sinks', bias's and mask's pointers). ``scratch_bytes``: the
        call's scratch, allocated after out and lse in the same allocation."""
        self.call, self.device_id, self.capacity, self.seqlen_new = call, device_id, capacity, seqlen_new
        self.variant = variant
        self._cupy = sys.modules["cupy"]
        out_bytes = itemsize * int(np.prod(out_shape))
        total, (_, lse_offset, scratch_offset) = _launch.scratch_layout(
            (out_bytes, 4 * int(np.prod(lse_shape)), scratch_bytes))
        self._outputs = (out_shape, lse_shape, total, lse_offset, scratch_offset)

    def _allocate(self, dtype):
        """out and lse in one allocation (a decode step is a few microseconds of host time)."""
        out_shape, lse_shape, total, lse_offset, _ = self._outputs
        ndarray = self._cupy.ndarray
        memory = self._cupy.cuda.alloc(total)
        return ndarray(out_shape, dtype, memory), ndarray(lse_shape, _FLOAT32, memory + lse_offset)

    def lengths_ok(self, cache_seqlens) -> bool:
        """An int ``cache_seqlens`` leaves room for the append (else: full validation, which raises)."""
        return type(cache_seqlens) is not int or 0 <= cache_seqlens <= self.capacity - self.seqlen_new

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes=None,
                 sinks=None, attn_bias=None, attn_mask=None):
        """``(out, lse)``, launched on the plan's device (switched to if it is not current);
        ``alibi_slopes``, ``sinks``, ``attn_bias``, ``attn_mask``: this call's (validated, as planned)."""
        if self._cupy.cuda.runtime.getDevice() != self.device_id:
            with self._cupy.cuda.Device(self.device_id):
                return self(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                            sinks, attn_bias, attn_mask)
        if self.variant:
            return self._variant_run(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                     alibi_slopes, sinks, attn_bias, attn_mask)
        return self._run(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, None)

    def _variant_run(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                     sinks, attn_bias, attn_mask):
        # The kernels index slopes and sinks densely: a strided view is copied (kept alive
        # by a captured graph, which replays reading it). The bias and mask are read in
        # place at their strides (planned).
        copies = tuple(None if x is None or _c_contiguous(x) else self._cupy.ascontiguousarray(x)
                       for x in (alibi_slopes, sinks))
        alibi_slopes, sinks = (x if c is None else c for x, c in zip((alibi_slopes, sinks), copies))
        # _variant.call_values (_params.VARIANT_PER_CALL): no dsinks, dbias, block maps or dropout
        var = (_ptr(alibi_slopes), _ptr(sinks), 0, _ptr(attn_bias), _ptr(attn_mask), 0, 0, 0, 0, 0)
        result = self._run(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, var)
        if any(c is not None for c in copies):
            _launch.keep_for_graph(*copies)
        return result

    def _lengths(self, cache_seqlens):
        """``(cache_seqlens pointer, cache length)`` for DecodeCall.run."""
        if cache_seqlens is None:
            return 0, self.capacity
        if type(cache_seqlens) is int:
            return 0, cache_seqlens
        return cache_seqlens.data.ptr, 0


def _is_integer(x) -> bool:
    """An integer scalar other than a bool (numpy integers, IntEnum): taken as an int."""
    if isinstance(x, np.integer):
        return True
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and not hasattr(x, "ndim")


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


def _c_contiguous(x) -> bool:
    """Whether ``x``'s elements lie densely in C order (strides of its dimensions > 1)."""
    expected = x.itemsize
    for n, stride in zip(reversed(x.shape), reversed(x.strides)):
        if n > 1 and stride != expected:
            return False
        expected *= n
    return True


class _GpuDecode(_GpuCacheEntry):
    """The decode kernel: append and attention in one launch (plus the combine when
    split). out, lse and the split partials share one allocation; lse becomes an
    array only when the call returns it."""

    __slots__ = ("_accum", "_launch", "_return_lse")

    def __init__(self, call, device_id, capacity, seqlen_new, out_shape, lse_shape, itemsize, variant=False,
                 return_lse=True):
        super().__init__(call, device_id, capacity, seqlen_new, out_shape, lse_shape, itemsize, variant,
                         scratch_bytes=call.scratch_bytes)
        scratch = self._outputs[4]
        self._accum = tuple(scratch + o for o in call.accum_offsets) if call.scratch_bytes else None
        self._launch, self._return_lse = call.launcher, return_lse

    def _run(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, var):
        cupy, accum = self._cupy, self._accum
        out_shape, lse_shape, total, lse_offset, _ = self._outputs
        memory = cupy.cuda.alloc(total)
        base = memory.ptr
        out = cupy.ndarray(out_shape, q.dtype, memory)
        lse = cupy.ndarray(lse_shape, _FLOAT32, memory + lse_offset) if self._return_lse else None
        stream = cupy.cuda.get_current_stream()
        if accum is None:
            out_accum = lse_accum = 0
        else:
            out_accum, lse_accum = base + accum[0], base + accum[1]
            _launch.keep_for_graph(memory)  # while capturing: the partials a replay writes, past out's lifetime
        lengths, cache_len = self._lengths(cache_seqlens)
        self._launch(stream.ptr, q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, _ptr(k), _ptr(v), out.data.ptr,
                     base + lse_offset if lse is None else lse.data.ptr, out_accum, lse_accum, lengths,
                     _ptr(cache_batch_idx), _ptr(block_table), 0, cache_len, var=var)
        return out, lse


class _GpuChunk(_GpuCacheEntry):
    """A long chunk on a dense cache (dispatch.decode_uses_dense_fwd): the
    dense forward reads the cache in place with each sequence's key count as
    seqused_k: ``cache_seqlens`` itself without an append, else the counts an
    append-only decode launch writes (after appending). With variants the forward
    is planned with them (aligned to each sequence's seqused_k); the append-only
    launch has none."""

    __slots__ = ("fwd",)

    def __init__(self, call, fwd, device_id, capacity, seqlen_new, out_shape, lse_shape, itemsize, variant=False):
        super().__init__(call, device_id, capacity, seqlen_new, out_shape, lse_shape, itemsize, variant)
        self.fwd = fwd

    def _run(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, var):
        cupy, fwd = self._cupy, self.fwd
        out, lse = self._allocate(q.dtype)
        stream = cupy.cuda.get_current_stream()
        used = None
        if k is None and cache_seqlens is None:
            seqused = 0  # every key of the cache
        elif k is None and type(cache_seqlens) is not int:
            seqused = cache_seqlens.data.ptr  # the lengths as they are (the forward clamps them)
        else:  # the append, or an int length: the decode kernel writes each sequence's key count
            used = cupy.ndarray((q.shape[0],), _INT32)
            seqused = used.data.ptr
            lengths, cache_len = self._lengths(cache_seqlens)
            self.call.run(stream.ptr, _launch.cupy_alloc, q.data.ptr, k_cache.data.ptr, v_cache.data.ptr,
                          _ptr(k), _ptr(v), 0, 0, lengths, 0, 0, cache_len, seqused)
        fwd.run(stream.ptr, _launch.cupy_alloc, q.data.ptr, k_cache.data.ptr, v_cache.data.ptr,
                out.data.ptr, lse.data.ptr, 0, 0, seqused, var=var)
        if used is not None:
            _launch.keep_for_graph(used)  # the counts a captured forward replays reading
        return out, lse


class _EmptyDecode:
    """No sequence: nothing to launch (an int ``cache_seqlens`` is still checked)."""

    __slots__ = ("_cupy", "capacity", "seqlen_new")

    def __init__(self, capacity, seqlen_new):
        self._cupy = sys.modules["cupy"]
        self.capacity, self.seqlen_new = capacity, seqlen_new

    lengths_ok = _GpuCacheEntry.lengths_ok

    def __call__(self, q, *args):
        return (self._cupy.zeros(q.shape, q.dtype),
                self._cupy.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf, _FLOAT32))


def _gpu_entry(plan, q, k_cache, v_cache, k, v, cache_batch_idx, block_table, causal, num_splits, dtype,
               options=None, return_lse=True):
    """The entry that runs GPU calls of this (validated) signature; ``options``: the
    variants on (``_checks.check_variants``), or empty; ``return_lse``: whether the
    calls return lse (else the entry may give None for it)."""
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if q.shape[0] == 0:
        return _EmptyDecode(capacity, plan.seqlen_new)
    if k is not None:
        _no_broadcast_caches(k_cache, v_cache)  # shapes and strides: part of the signature
    from . import _gpu, _gpu_decode, dispatch  # noqa: PLC0415

    device_id = q.device.id
    dtype_name = _checks.dtype_name(_FN, dtype) if dtype is not None else q.dtype.name
    # (a bias or mask: the decode kernel, which reads them at the key positions of
    # every cache layout; the dense forward's plan would index them at its own seqlen_k)
    dense = "attn_bias" not in options and "attn_mask" not in options and dispatch.decode_uses_dense_fwd(
        seqlen_q=q.shape[1], head_dim=q.shape[3], paged=paged, cache_batch_idx=cache_batch_idx is not None,
        vec=_launch.vec_ok((q, k_cache, v_cache), q.shape[3]), cc=_launch.compute_capability(device_id))
    with q.device:
        call = _gpu_decode.plan_decode(q, k_cache, v_cache, k, v, block_table, max_seqlen_k=capacity,
                                       softmax_scale=plan.scale, causal=causal, num_splits=num_splits,
                                       dtype_name=dtype_name, device_id=device_id, append_only=dense,
                                       options=None if dense else options)
        shapes = (q.shape, (q.shape[0], q.shape[2], q.shape[1]), q.itemsize)
        if not dense:
            return _GpuDecode(call, device_id, capacity, plan.seqlen_new, *shapes, variant=bool(options),
                              return_lse=return_lse)
        # (not the warp-specialised kernel: its copies read a cache's rows past seqused_k,
        # which may hold anything, and P·V multiplies them by 0: kernels_cu/flash_fwd_ws.cu)
        fwd = _gpu.plan_fwd(q, k_cache, v_cache, None, None, softmax_scale=plan.scale, causal=causal,
                            dtype_name=dtype_name, device_id=device_id, options=options or None, ws=False)
    return _GpuChunk(call, fwd, device_id, capacity, plan.seqlen_new, *shapes, variant=bool(options))


_ENTRIES = _launch.PlanCache()


def _signature(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
               num_splits, return_lse, dtype):
    """The call's signature for the entry cache, or None when it cannot be one
    (not CuPy arrays; a scale, flag or length of a type whose value is not its key)."""
    g = _api._gpu_type()
    if g is None or type(q) is not g or type(softmax_scale) not in _api.SCALE_KEY_TYPES \
            or not (dtype is None or _api._dtype_keyable(dtype)):
        return None
    if cache_seqlens is None or type(cache_seqlens) is int:
        lengths = type(cache_seqlens)
    elif type(cache_seqlens) is g:
        lengths = _api._sig(cache_seqlens, g)
    else:
        return None
    sig = _api._sig
    return (type(softmax_scale), softmax_scale, type(causal), causal, type(num_splits), num_splits,
            type(return_lse), return_lse, dtype, lengths, sig(q, g), sig(k_cache, g), sig(v_cache, g),
            sig(k, g), sig(v, g), sig(cache_batch_idx, g), sig(block_table, g))


def _variant_signature(window_size, softcap, alibi_slopes, sinks, attn_bias, attn_mask):
    """The variants' part of a call's signature (appended to :func:`_signature`'s), or
    None when it cannot be one: a window other than a tuple of ints, a softcap of
    a type whose value is not its key.  Two calls of one signature validate alike
    (on the GPU the slopes, sinks, bias and mask are checked by their geometry only)."""
    if type(window_size) is not tuple or any(type(w) is not int for w in window_size) \
            or type(softcap) not in _api.SCALE_KEY_TYPES:
        return None
    g = _api._gpu_type()
    return ("variants", window_size, type(softcap), softcap, _api._sig(alibi_slopes, g), _api._sig(sinks, g),
            _api._sig(attn_bias, g), _api._sig(attn_mask, g))


# ----------------------------------------------------------------------------
# The public function
# ----------------------------------------------------------------------------


@_interop.accepts_foreign("q", "k_cache", "v_cache", "k", "v",
                          keywords=("cache_seqlens", "cache_batch_idx", "block_table", "alibi_slopes", "sinks",
                                    "attn_bias", "attn_mask"),
                          optional=("k", "v", "cache_seqlens", "cache_batch_idx", "block_table", "alibi_slopes",
                                    "sinks", "attn_bias", "attn_mask"),
                          appends=(("k_cache", "v_cache"), ("k", "v")))
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                            cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, num_splits=0, return_lse=False, dtype=None,
                            window_size=_NO_WINDOW, softcap=_NO_SOFTCAP, alibi_slopes=None, sinks=None,
                            attn_bias=None, attn_mask=None):
    """Exact attention of new queries against a KV cache, appending new keys first.

    flash-attention's ``flash_attn_with_kvcache`` in the (batch, seqlen, nheads,
    head_dim) layout.  For each sequence ``b``: if ``k`` and ``v`` are given,
    they are written into the cache at positions ``cache_seqlens[b]`` to
    ``cache_seqlens[b] + seqlen_new - 1`` (in place); then the queries ``q[b]``
    attend to the sequence's first ``seqlen_k_b = cache_seqlens[b] + seqlen_new``
    cache keys, exactly as :func:`cupyflash.flash_attn_fwd` on those keys.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads_q, head_dim)
        New queries (1 per sequence for a decode step, more for chunked
        prefill or speculative decoding): a numpy.ndarray (CPU path), a
        cupy.ndarray, or a torch tensor / JAX array (viewed without copying,
        as in :func:`cupyflash.flash_attn_fwd`).  dtype float16, bfloat16
        (ml_dtypes), float32 or float64 on the CPU.  Unit last stride.
    k_cache, v_cache : array, shape (batch_cache, seqlen_cache, nheads_kv, head_dim)
        The cache, same array type and dtype as ``q``, unit last stride: row
        ``b`` (or ``cache_batch_idx[b]``) holds sequence ``b``'s keys/values.
        With ``block_table``: shape (num_blocks, page_size, nheads_kv,
        head_dim), a pool of blocks of ``page_size`` slots; ``page_size`` must
        be a positive multiple of 16.  ``nheads_q`` must be a multiple of
        ``nheads_kv`` (GQA / MQA: query head ``h`` reads KV head
        ``h // (nheads_q // nheads_kv)``).  Written in place when ``k``/``v`` are given (NumPy
        caches must then be writeable).
    k, v : array, shape (batch, seqlen_new, nheads_kv, head_dim), optional
        New keys and values to append, both or neither; same array type and
        dtype as ``q``.  Not for JAX arrays (immutable: TypeError).
    cache_seqlens : int or array, shape (batch,), int32, optional
        The number of valid cache entries of each sequence before the append
        (an int: the same for all).  Entries at or past
        ``cache_seqlens[b] + seqlen_new`` are never read.  None: the whole
        cache is valid (``seqlen_cache`` keys, or ``max_blocks_per_seq *
        page_size`` for a paged cache), which leaves no room to append, so
        ``k``/``v`` need it.  Not modified.
    cache_batch_idx : array, shape (batch,), int32, optional
        The cache row each sequence uses (default: row ``b``).  Rows may
        repeat when nothing is appended.  Not with ``block_table``.
    block_table : array, shape (batch, max_blocks_per_seq), int32, optional
        Paged cache: entry ``p`` of row ``b`` is the block holding sequence
        ``b``'s keys ``p * page_size`` to ``(p + 1) * page_size - 1``.  Blocks
        may be shared between sequences and appear in any order; entries past
        the blocks a sequence uses are never read (any value).
    softmax_scale : float, optional
        As in :func:`cupyflash.flash_attn_fwd`; defaults to ``1 / sqrt(head_dim)``.
    causal : bool, optional
        Causal mask aligned to the bottom-right corner of each sequence's score
        matrix: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k_b - seqlen_q``,
        so the last query is the newest token and sees the whole cache.  For
        seqlen_q=2 against seqlen_k_b=5, and seqlen_q=5 against
        seqlen_k_b=2 (1 = attended)::

            1 1 1 1 0        0 0
            1 1 1 1 1        0 0
                             0 0
                             1 0
                             1 1

        A query row that sees no key (also every row of a sequence with no
        key at all) gets output 0 and lse ``-inf``.  Nothing is NaN.
    num_splits : int, optional
        How many parts the GPU kernel splits each sequence's keys into (0:
        automatic).  Any value >= 0 gives the same result within rounding; the
        CPU path ignores it.
    return_lse : bool, optional
        Also return the logsumexp.
    dtype : str, optional
        As in :func:`cupyflash.flash_attn_fwd` (the element type of cupy
        uint16/int16 storage); None for NumPy, torch and JAX arrays.
    window_size, softcap, alibi_slopes, sinks : optional
        Attention variants as in :func:`cupyflash.flash_attn_fwd`, aligned to
        each sequence's own ``seqlen_k_b`` (``alibi_slopes`` of shape (batch,
        nheads_q) per sequence; ``sinks`` per query head, in every row's
        denominator: a row that sees no key gets out 0 and lse the sink).  On
        the GPU too (the decode kernel visits only the keys a window shows);
        no dropout.
    attn_bias : array, optional
        An additive bias (issue 14), as in :func:`cupyflash.flash_attn_fwd`
        but over the cache's keys: rank <= 4, broadcastable to ``(batch,
        nheads_q, seqlen_q, key)`` (left-padded with 1s; each of the first three
        dimensions 1 or full), its last dimension indexed by ``j``, a key's
        position in its sequence (0 to ``seqlen_k_b - 1``; the appended keys
        are ``cache_seqlens[b]`` on; a paged cache's key ``j`` whichever block
        holds it), 1 or at least the cache's capacity (``seqlen_cache``, or
        ``max_blocks_per_seq * page_size``), so that it covers every key a
        sequence can see; positions at or past ``seqlen_k_b`` are never read.
        dtype q's (on the GPU the storage dtype of bfloat16 data too) or
        float32; any strides, read in place (a stride-0 broadcast view is never
        expanded).  Added to the scaled scores after softcap and ALiBi;
        ``-inf`` hides a key.  Causal and window masks stay aligned to each
        sequence's ``seqlen_k_b``.
    attn_mask : array of bool, optional
        A keep-mask broadcastable like ``attn_bias`` (True attends, False hides
        the key), or a :class:`cupyflash.BlockMask` (its mask is used; the
        decode kernel takes no block map).  A row whose every key is hidden
        gets output 0 and lse ``-inf`` (the sink with ``sinks``).

    Returns
    -------
    out : array, shape (batch, seqlen_q, nheads_q, head_dim)
        Same array type and dtype as ``q``.
    lse : array, shape (batch, nheads_q, seqlen_q), float32
        Only with ``return_lse=True``: the natural-log logsumexp of each row of
        scaled, masked scores (``-inf`` for a row that sees no key).

    Raises
    ------
    TypeError
        As for :func:`cupyflash.flash_attn_fwd` (for q, k_cache, v_cache and
        k, v); when ``cache_seqlens``, ``cache_batch_idx`` or ``block_table``
        is not an int32 array of q's type (``cache_seqlens`` may be an int),
        ``num_splits`` is not an int or ``return_lse`` not a bool; when ``k``
        is given for JAX arrays; when ``attn_bias`` is not an array of q's
        type with q's dtype or float32 (so never float64 on the GPU), or
        ``attn_mask`` not a bool array of q's type.
    ValueError
        As for :func:`cupyflash.flash_attn_fwd` (shapes, head_dim, GQA, unit
        last stride); when only one of ``k``/``v`` is given; when k's nheads
        differ from the cache's; when ``cache_seqlens`` is negative or, with
        the append, exceeds the cache (``block_table`` too narrow for a paged
        cache); when ``k`` is given without ``cache_seqlens``; when both
        ``cache_batch_idx`` and ``block_table`` are given; when the page size
        is not a positive multiple of 16; when a used ``block_table`` entry or a
        ``cache_batch_idx`` entry is out of range; when two sequences would
        append into one cache slot; when a NumPy cache to append to is
        read-only, or ``k_cache`` and ``v_cache`` share memory; when an int
        ``cache_seqlens`` does not fit in int32; when ``num_splits`` is
        negative; when ``attn_bias`` or ``attn_mask`` has more than 4
        dimensions, a batch, head or row dimension that is neither 1 nor full,
        or a key dimension shorter than the capacity and not 1 (GPU: strides
        not in whole elements, or on another device).  Values (lengths and
        indices) are checked only when they are on the host (ints and NumPy
        arrays).

    Notes
    -----
    On the GPU, indices the host cannot check (a device ``block_table`` or
    ``cache_batch_idx``) are clamped into the cache: an out-of-range block or
    row reads (and an append writes) the nearest valid one, never memory
    outside the cache; a device ``cache_seqlens`` entry is clamped to
    ``[0, capacity - seqlen_new]`` (``capacity``: ``seqlen_cache``, or
    ``max_blocks_per_seq * page_size``).

    ``k`` and ``v`` may be views of the caches on the CPU (they are copied
    before the append writes); on the GPU they must not overlap the caches
    (the blocks that append and the blocks that read them run concurrently).
    An append into a broadcast (zero-stride) cache is refused.

    With ``attn_bias`` or ``attn_mask`` every GPU call runs the decode kernel,
    which reads them element by element at their strides; long chunks on a
    dense cache (``seqlen_q >= 256``), which otherwise run the dense forward,
    too.

    On the CPU all appends happen before any attention, so a sequence whose
    blocks are shared sees what other sequences appended into them; do not
    append into slots another sequence attends to if the result is to be the
    same on the GPU (where the kernel will append and attend per sequence).

    References
    ----------
    Dao, "FlashAttention-2", 2023; flash-attention's ``flash_attn_with_kvcache``
    (https://github.com/Dao-AILab/flash-attention); Kwon et al., "Efficient
    Memory Management for Large Language Model Serving with PagedAttention",
    SOSP 2023 (the paged cache).

    Examples
    --------
    >>> import numpy as np, cupyflash
    >>> rng = np.random.default_rng(0)
    >>> k_cache = rng.standard_normal((2, 32, 1, 8), dtype=np.float32)
    >>> v_cache = rng.standard_normal((2, 32, 1, 8), dtype=np.float32)
    >>> q, k, v = (rng.standard_normal((2, 1, h, 8), dtype=np.float32) for h in (4, 1, 1))
    >>> lens = np.array([5, 17], dtype=np.int32)
    >>> out = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    >>> out.shape, bool((k_cache[1, 17] == k[1, 0]).all())
    ((2, 1, 4, 8), True)
    >>> bias = np.zeros((32,), np.float32)  # one value per key position, every sequence and head
    >>> bias[:2] = -np.inf                  # hide each sequence's first two keys
    >>> out = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens + 1, attn_bias=bias)
    >>> out.shape
    (2, 1, 4, 8)
    """
    if cache_seqlens is not None and type(cache_seqlens) is not int and _is_integer(cache_seqlens):
        cache_seqlens = int(cache_seqlens)  # numpy integers and int subclasses: the int they hold
    if type(attn_mask) is BlockMask:  # its mask (the decode kernel walks the keys with no block map)
        attn_mask = attn_mask.mask
    variants = (window_size is not _NO_WINDOW or softcap is not _NO_SOFTCAP or alibi_slopes is not None
                or sinks is not None or attn_bias is not None or attn_mask is not None)
    try:
        key = _signature(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                         softmax_scale, causal, num_splits, return_lse, dtype)
        if key is not None and variants:
            extra = _variant_signature(window_size, softcap, alibi_slopes, sinks, attn_bias, attn_mask)
            key = None if extra is None else key + extra
        entry = None if key is None else _ENTRIES.get(key)
    except Exception:  # noqa: BLE001 (unhashable, a raising __hash__: validation says what is wrong)
        key = entry = None
    options = {}
    if entry is None or not entry.lengths_ok(cache_seqlens):
        plan = _check(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                      softmax_scale, causal, num_splits, return_lse, dtype)
        if variants:
            options = _checks.check_variants(_FN, q, plan.gpu, 0.0, window_size, alibi_slopes, softcap, sinks,
                                             None, softmax_scale=plan.scale, attn_bias=attn_bias,
                                             attn_mask=attn_mask, seqlens=(q.shape[1], plan.capacity),
                                             key_capacity=plan.capacity)
        if plan.gpu:
            entry = _ENTRIES.put(key, _gpu_entry(plan, q, k_cache, v_cache, k, v, cache_batch_idx, block_table,
                                                 bool(causal), int(num_splits), dtype, options,
                                                 return_lse=bool(return_lse)))
    if entry is not None:
        out, lse = entry(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                         sinks, attn_bias, attn_mask)
        return (out, lse) if return_lse else out
    out, lse = _cpu(plan, q, k_cache, v_cache, k, v, bool(causal), options)
    return (out, lse) if return_lse else out
