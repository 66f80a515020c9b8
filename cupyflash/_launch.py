"""What every GPU call shares: device facts, array geometry, and the launcher.

A GPU call is planned once per call signature (shapes, strides, dtype, flags,
device, alignment) by :mod:`._gpu` / :mod:`._gpu_bwd`; the plan holds a
:class:`Launcher`: the kernels' function handles and launch shapes, and the
params struct packed once with everything but the pointers.  Each call then
writes its pointers into the struct (:class:`._params.FieldWriter`, by field
name) and launches, with no Python-level work that depends on the shapes.

cupy is imported lazily: importing this module needs no GPU.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import threading

from . import _compile

LOG2E = 1.4426950408889634  # 1 / ln(2)
#: Byte alignment of each buffer inside one scratch allocation (cupy's and
#: torch's allocators return at least this).
SCRATCH_ALIGN = 256


@functools.lru_cache(maxsize=None)
def num_sms(device_id: int) -> int:
    import cupy  # noqa: PLC0415
    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> tuple[int, int]:
    import cupy  # noqa: PLC0415
    cc = cupy.cuda.Device(device_id).compute_capability
    return int(cc[:-1]), int(cc[-1])


# ----------------------------------------------------------------------------
# Array geometry, in elements
# ----------------------------------------------------------------------------


def element_strides(a) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


def seq_strides(a) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements of a dense (batch, seqlen, nheads, d)
    or packed (total, nheads, d) tensor; a packed tensor's batch stride is 0."""
    s = element_strides(a)
    return s[:3] if a.ndim == 4 else (0, s[0], s[1])


def stride_fields(**arrays) -> dict[str, int]:
    """The params structs' stride fields, ``{name}_batch_stride`` / ``_row_stride`` /
    ``_head_stride`` in elements (:func:`seq_strides`), of each named array; an
    absent array (None) gets strides 0."""
    fields = {}
    for name, a in arrays.items():
        for axis, s in zip(("batch", "row", "head"), (0, 0, 0) if a is None else seq_strides(a)):
            fields[f"{name}_{axis}_stride"] = s
    return fields


def lse_strides(lse) -> tuple[int, int]:
    """(batch, head) strides in elements of a dense (batch, nheads, seqlen) or packed
    (nheads, total) lse (unit row stride); a packed lse's batch stride is 0."""
    s = element_strides(lse)
    return s[:2] if lse.ndim == 3 else (0, s[0])


def strides_vec_ok(arrays, head_dim: int) -> bool:
    """The stride half of :func:`vec_ok`: head_dim and every stride but the last
    in multiples of 8 elements (16 bytes)."""
    if head_dim % 8:
        return False
    return not any(s % 8 for a in arrays for s in element_strides(a)[:-1])


def vec_ok(arrays, head_dim: int) -> bool:
    """16-byte accesses are legal: aligned pointers, strides and head_dim in multiples of 8 elements."""
    return strides_vec_ok(arrays, head_dim) and not any(a.data.ptr % 16 for a in arrays)


class Contiguous:
    """The geometry of a C-contiguous array not yet allocated (``data.ptr`` 0:
    aligned, as every allocator here returns at least 256-byte alignment)."""

    __slots__ = ("shape", "ndim", "itemsize", "strides", "data")

    class _Null:
        ptr = 0

    def __init__(self, shape, itemsize):
        self.shape, self.ndim, self.itemsize = tuple(shape), len(shape), itemsize
        strides, step = [], itemsize
        for n in reversed(self.shape):
            strides.append(step)
            step *= max(n, 1)
        self.strides = tuple(reversed(strides))
        self.data = self._Null


def scratch_layout(sizes: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """``(total bytes, offsets)`` of buffers of ``sizes`` bytes in one allocation
    (scratch, or a call's outputs)."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // SCRATCH_ALIGN) * SCRATCH_ALIGN
    return total, tuple(offsets)


def geometry(*arrays) -> tuple:
    """What a plan depends on in arrays (None: allocated by the call): shapes,
    strides and 16-byte alignment."""
    return tuple(None if a is None else (a.shape, a.strides, a.data.ptr % 16 == 0) for a in arrays)


class PlanCache(dict):
    """Plans by call signature, dropped all at once past ``limit`` entries. Every cache
    made is listed in :data:`PLAN_CACHES` (:func:`clear_plan_caches` empties them all)."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit
        PLAN_CACHES.append(self)

    def put(self, key, plan):
        """Cache ``plan`` under ``key`` (not when ``key`` is None); return it."""
        if key is not None:
            if len(self) >= self.limit:
                self.clear()
            self[key] = plan
        return plan

    def get_or_make(self, key, make):
        plan = self.get(key)
        return plan if plan is not None else self.put(key, make())


#: Every PlanCache: the planners' (``_gpu``, ``_gpu_bwd``) and the public entry points'
#: per-signature ones (``_api``, ``_torch_path``, ``_kvcache``), which hold plans too.
PLAN_CACHES: list = []


def clear_plan_caches() -> None:
    """Empty every PlanCache (after a dispatch table changed: a plan cached anywhere
    would otherwise keep running the old choice)."""
    for cache in PLAN_CACHES:
        cache.clear()


#: Buffers a CUDA graph captured on the current stream reads or writes on its
#: replays, after the call that made them has returned: the scratch allocated while
#: the stream captured (back in CuPy's pool, its block would be handed to the next
#: array allocated), and the copies a call makes of strided inputs. Kept until
#: :func:`release_graph_scratch`.
GRAPH_SCRATCH: list = []


def keep_for_graph(*buffers) -> None:
    """Keep ``buffers`` (None entries skipped) in :data:`GRAPH_SCRATCH` when the current
    stream is capturing a CUDA graph."""
    import cupy  # noqa: PLC0415

    if cupy.cuda.get_current_stream().is_capturing():
        GRAPH_SCRATCH.extend(b for b in buffers if b is not None)


def cupy_alloc(nbytes: int):
    """``(owner, pointer)`` of ``nbytes`` from CuPy's memory pool on the current device
    (kept for the graph's replays when the current stream is capturing one)."""
    import cupy  # noqa: PLC0415

    memory = cupy.cuda.alloc(nbytes)
    keep_for_graph(memory)
    return memory, memory.ptr


def release_graph_scratch() -> None:
    """Return the scratch of the CUDA graphs captured so far to CuPy's pool: call it
    once those graphs will not be replayed again."""
    GRAPH_SCRATCH.clear()


# ----------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------


class Launcher:
    """Launches a fixed sequence of kernels whose one argument is a params struct.

    ``template`` is the struct's bytes with every field but the pointers set;
    ``writer`` (a :class:`._params.FieldWriter`) names the pointer fields that
    each call sets.  The kernels are resolved (compiled on first use, loaded)
    on the current device when the launcher is made.  A call copies nothing:
    it writes the pointers into the launcher's own struct and launches; the
    driver copies the struct at launch, so a lock around the two is enough to
    make concurrent calls from several threads safe.
    """

    __slots__ = ("_buffer", "_argv", "_argv_address", "_pack_into", "_var_pack_into", "_var_offset", "_kernels",
                 "_lock", "_launch_kernel", "launches", "_maps_address", "_maps", "_map_pointers", "_map_vars")

    def __init__(self, launches, template: bytes, writer, variant=None, maps=None):
        """``variant``: ``(offset, writer)`` of the struct's ``var`` member and the
        writer of its per-call fields (:mod:`._variant`), for calls with ``var``.
        ``maps``: ``(offset, make)`` for a struct that carries TMA maps of the first
        three pointers (:class:`._tma.MapCache`): ``make(q, k, v)`` returns their bytes,
        written at ``offset`` on every call; or ``(offset, make, indices)``: the maps of
        the pointers at those positions; or ``(offset, make, indices, var_indices)``: then
        also (after those) of the ``var`` values at ``var_indices`` (a bias's address)."""
        import cupy  # noqa: PLC0415

        self._launch_kernel = cupy.cuda.driver.launchKernel
        self.launches = tuple(launches)
        self._kernels = tuple(
            (_compile.get_function(l.source, l.name_expression, l.smem_bytes), *l.grid, *l.block, l.smem_bytes)
            for l in self.launches)
        self._buffer = ctypes.create_string_buffer(template, len(template))
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._buffer))
        self._argv_address = ctypes.addressof(self._argv)
        self._pack_into = writer.struct.pack_into
        self._var_offset, self._var_pack_into = (0, None) if variant is None else (variant[0],
                                                                                  variant[1].struct.pack_into)
        self._maps_address, self._maps = (0, None) if maps is None else (
            ctypes.addressof(self._buffer) + maps[0], maps[1])
        # the mapped pointers, picked from a call's by one C call
        self._map_pointers = operator.itemgetter(*((0, 1, 2) if maps is None or len(maps) < 3 else maps[2]))
        self._map_vars = () if maps is None or len(maps) < 4 else tuple(maps[3])
        self._lock = threading.Lock()

    def __call__(self, stream: int, *pointers: int, var=None) -> None:
        """Launch every kernel on ``stream`` with the pointer fields set to ``pointers``
        and, when ``var`` is given (a plan with variants), the ``var`` member's per-call
        fields to ``var`` (``_variant.call_values``)."""
        launch, argv = self._launch_kernel, self._argv_address
        with self._lock:
            self._pack_into(self._buffer, 0, *pointers)
            if self._maps is not None:
                addresses = self._map_pointers(pointers)
                if self._map_vars:
                    addresses = (*addresses, *[var[i] for i in self._map_vars])
                maps = self._maps(*addresses)
                ctypes.memmove(self._maps_address, maps, len(maps))
            if var is not None:
                self._var_pack_into(self._buffer, self._var_offset, *var)
            for func, gx, gy, gz, bx, by, bz, smem in self._kernels:
                launch(func, gx, gy, gz, bx, by, bz, smem, stream, argv, 0)
