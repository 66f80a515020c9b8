"""cupyflash inside JAX: :func:`flash_attention`, differentiable and usable under ``jax.jit``.

The kernels run inside XLA's computation through
``jax.experimental.buffer_callback`` (JAX >= 0.7): XLA hands the callback its
device buffers and its CUDA stream, and the callback launches cupyflash's
kernels on that stream, straight on XLA's buffers, so the work is ordered with
the rest of the computation and XLA owns every byte of it.  Gradients come
from ``jax.custom_vjp`` with ``out`` and ``lse`` as residuals.  On the CPU
backend the same callbacks run cupyflash's CPU path.

What a call costs
-----------------
Everything that depends only on shapes, dtype and flags happens once, at trace
time: validation (with the core's rules and messages), and the plan of the
kernels (:func:`cupyflash._gpu.plan_fwd` / :func:`cupyflash._gpu_bwd.plan_bwd`
on geometry objects, compiling the kernels on first use) for the device JAX
traces for.  Each signature (shapes, dtype and flags) has one callback, which
keeps its plans per (CUDA device, 16-byte alignment of the buffers); a call
then only reads the buffers' device pointers, looks its plan up and launches
on XLA's stream.  The forward writes ``out`` and ``lse``, the backward dq, dk
and dv, straight into XLA's output buffers.  The kernels' fp32 scratch is one
more output of each callback: a byte vector that XLA allocates in its own
memory (and reuses once the call is done) and the caller drops, sized at trace
time from the plan.  So CuPy allocates nothing, and XLA's default
preallocation can stay on.  (The one exception: a plan made at run time that
needs more scratch than was sized at trace time -- on a device unlike the one
traced for, or for buffers not 16-byte aligned, which XLA does not hand out --
takes its scratch from CuPy's pool, ordered on XLA's stream.)

Empty inputs (no query, or no key) never reach a callback: the results (zeros,
lse ``-inf``) are built in JAX at trace time.

Where ``buffer_callback`` is missing (older JAX), :func:`flash_attention` falls
back to handing concrete arrays over through DLPack: it works eagerly and
raises a ``RuntimeError`` that says so under ``jax.jit`` or ``jax.grad``.

Importing this module imports JAX; importing ``cupyflash`` does not.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> from cupyflash.jax import flash_attention
>>> q = jax.random.normal(jax.random.key(0), (2, 128, 8, 64), jnp.bfloat16)
>>> loss = jax.jit(lambda q: flash_attention(q, q, q, causal=True).astype(jnp.float32).sum())
>>> dq = jax.grad(loss)(q)                                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from . import _api, _checks, _interop, _launch

try:
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # JAX < 0.7: eager DLPack fallback only
    _buffer_callback = None

__all__ = ["flash_attention"]

_FN = "jax.flash_attention"


# ----------------------------------------------------------------------------
# Validation at trace time, with the same rules and messages as the core
# ----------------------------------------------------------------------------


def _spec(x):
    """A NumPy array with x's shape, dtype and C strides over one element (never read)."""
    dtype = np.dtype(x.dtype)
    strides = tuple(s * dtype.itemsize for s in _interop.c_strides(x.shape))
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), tuple(x.shape), strides,
                                           writeable=False)


def _device(q):
    """q's one device, or None for a tracer or an array over several devices."""
    devices = None if isinstance(q, jax.core.Tracer) else q.devices()
    if devices is None or len(devices) != 1:
        return None
    return next(iter(devices))


def _platform(q):
    """'cpu', 'gpu', ...: q's device, or the default backend for tracers (unknown yet)."""
    device = _device(q)
    return jax.default_backend() if device is None else device.platform


def _validate(q, k, v, softmax_scale, causal, deterministic):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            _checks.fail(TypeError, _FN,
                         f"{name} must be a jax.Array; got {_checks._type_name(x)}.")
    _checks.check_qkv(_FN, _spec(q), _spec(k), _spec(v))
    dtype = np.dtype(q.dtype).name
    if _platform(q) != "cpu" and dtype not in _checks.GPU_DTYPES:
        _checks.fail(TypeError, _FN,
                     f"q must have dtype float16 or bfloat16 on the GPU; got {dtype}.")
    return _checks.check_flags(_FN, softmax_scale, q.shape[3], causal, deterministic)


# ----------------------------------------------------------------------------
# Plans: geometry objects in place of arrays, cached per device and alignment
# ----------------------------------------------------------------------------


class _Misaligned:
    """``data`` of a geometry whose pointer is not 16-byte aligned (all planning reads of it)."""

    ptr = 1


def _geometry(shape, itemsize, aligned):
    """What planning reads of one of XLA's buffers (dense, row-major): shape,
    byte strides, itemsize, and through ``data.ptr`` its 16-byte alignment."""
    geometry = _launch.Contiguous(shape, itemsize)
    if not aligned:
        geometry.data = _Misaligned
    return geometry


def _aligned(*pointers):
    """Whether every pointer is 16-byte aligned (what a plan's vectorised accesses need)."""
    bits = 0
    for p in pointers:
        bits |= p
    return bits & 15 == 0


def _cuda_device(device_id):
    """A context making CUDA device ``device_id`` current (CuPy's and the driver's),
    or a null context when it already is (XLA's thread usually has it current)."""
    cupy = _interop._import_cupy(_FN, "jax.Array")  # noqa: SLF001
    if cupy.cuda.runtime.getDevice() == device_id:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device_id)


def _pointer(buffer):
    """The device pointer of a ``buffer_callback`` Buffer on the GPU.

    jaxlib's Buffer exposes its pointer only through ``__cuda_array_interface__``
    (and ``__dlpack__``, which allocates a capsule): the cheapest way there is.
    """
    return buffer.__cuda_array_interface__["data"][0]


def _no_scratch(nbytes):
    """``alloc`` for a plan without scratch (never asked for any bytes)."""
    return None, 0


def _scratch_nbytes(plan_bytes):
    """The size of the scratch output for a plan's ``scratch_bytes``: room to align
    its start to ``_launch.SCRATCH_ALIGN``, as the plans' layouts assume."""
    return plan_bytes + _launch.SCRATCH_ALIGN if plan_bytes else 0


def _scratch_alloc(call, scratch):
    """``alloc`` for ``call.run``: in XLA's scratch buffer (a byte vector), from its
    first ``SCRATCH_ALIGN``-aligned byte, when the plan fits in it; else None (the
    caller takes CuPy's pool, on XLA's stream)."""
    needed = call.scratch_bytes
    if not needed:
        return _no_scratch
    start = _pointer(scratch)
    base = -(-start // _launch.SCRATCH_ALIGN) * _launch.SCRATCH_ALIGN
    if base + needed > start + scratch.shape[0]:
        return None
    return lambda nbytes: (None, base)


def _run(call, device_id, stream, scratch, *pointers):
    """Launch a planned call on XLA's stream, with its scratch (see :func:`_scratch_alloc`)."""
    with _cuda_device(device_id):
        alloc = _scratch_alloc(call, scratch)
        if alloc is not None:
            call.run(stream, alloc, *pointers)
            return
        cupy = sys.modules["cupy"]
        with _interop.use_stream(cupy, stream):  # freed to CuPy's pool in XLA's stream order
            call.run(stream, _launch.cupy_alloc, *pointers)


class _Callback:
    """The ``buffer_callback`` function of one signature: q's and k's shapes, the
    dtype and the flags (fixed at trace time).

    Plans are made on first use per ``(device_id, aligned)`` and kept; a call
    reads the buffers' pointers and runs its plan (see the module docstring).
    """

    __slots__ = ("q_shape", "k_shape", "dtype_name", "itemsize", "softmax_scale", "causal", "plans",
                 "__weakref__")  # jax keeps weak references to callbacks

    def __init__(self, q_shape, k_shape, dtype_name, softmax_scale, causal):
        self.q_shape, self.k_shape, self.dtype_name = q_shape, k_shape, dtype_name
        self.itemsize = jnp.dtype(dtype_name).itemsize
        self.softmax_scale, self.causal = softmax_scale, causal
        self.plans = {}

    @property
    def lse_shape(self):
        batch, seqlen_q, nheads_q, _ = self.q_shape
        return batch, nheads_q, seqlen_q

    def plan(self, device_id, aligned):
        """The plan for buffers on CUDA device ``device_id`` with this alignment (made once)."""
        key = device_id, aligned
        call = self.plans.get(key)
        if call is None:
            with _cuda_device(device_id):
                call = self._make(device_id, aligned)
            self.plans[key] = call
        return call


class _Fwd(_Callback):
    """``callback(ctx, (out, lse, scratch), q, k, v)``."""

    __slots__ = ()

    def _make(self, device_id, aligned):
        from . import _gpu

        qs, ks, item = self.q_shape, self.k_shape, self.itemsize
        q, out, k, v = (_geometry(shape, item, aligned) for shape in (qs, qs, ks, ks))
        lse = _geometry(self.lse_shape, 4, aligned)
        return _gpu.plan_fwd(q, k, v, out, lse, softmax_scale=self.softmax_scale, causal=self.causal,
                             dtype_name=self.dtype_name, device_id=device_id)

    def __call__(self, ctx, outputs, q, k, v):
        out, lse, scratch = outputs
        kind, device_id = q.__dlpack_device__()
        if kind == _interop.DL_CPU:
            o, l = _api.flash_attn_fwd(np.asarray(q), np.asarray(k), np.asarray(v),
                                       softmax_scale=self.softmax_scale, causal=self.causal)
            np.asarray(out)[...] = o
            np.asarray(lse)[...] = l
            return
        pointers = _pointer(q), _pointer(k), _pointer(v), _pointer(out), _pointer(lse)
        _run(self.plan(device_id, _aligned(*pointers)), device_id, ctx.stream, scratch, *pointers)


class _Bwd(_Callback):
    """``callback(ctx, (dq, dk, dv, scratch), dout, q, k, v, out, lse)``."""

    __slots__ = ("deterministic",)

    def __init__(self, q_shape, k_shape, dtype_name, softmax_scale, causal, deterministic):
        super().__init__(q_shape, k_shape, dtype_name, softmax_scale, causal)
        self.deterministic = deterministic

    def _make(self, device_id, aligned):
        from . import _gpu_bwd

        qs, ks, item = self.q_shape, self.k_shape, self.itemsize
        dout, q, out, dq, k, v, dk, dv = (_geometry(shape, item, aligned) for shape in (qs,) * 4 + (ks,) * 4)
        lse = _geometry(self.lse_shape, 4, aligned)
        return _gpu_bwd.plan_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=self.softmax_scale,
                                 causal=self.causal, deterministic=self.deterministic,
                                 dtype_name=self.dtype_name, device_id=device_id)

    def __call__(self, ctx, outputs, dout, q, k, v, out, lse):
        dq, dk, dv, scratch = outputs
        kind, device_id = q.__dlpack_device__()
        if kind == _interop.DL_CPU:
            grads = _api.flash_attn_bwd(*(np.asarray(b) for b in (dout, q, k, v, out, lse)),
                                        softmax_scale=self.softmax_scale, causal=self.causal,
                                        deterministic=self.deterministic)
            for dst, src in zip((dq, dk, dv), grads):
                np.asarray(dst)[...] = src
            return
        pointers = (_pointer(dout), _pointer(q), _pointer(k), _pointer(v), _pointer(out), _pointer(lse),
                    _pointer(dq), _pointer(dk), _pointer(dv))
        # straight into XLA's dq, dk, dv
        _run(self.plan(device_id, _aligned(*pointers)), device_id, ctx.stream, scratch, *pointers)


# One callback per signature: jit's caches key on the function, and its plans live in it.
_fwd_callback = functools.lru_cache(maxsize=1024)(_Fwd)
_bwd_callback = functools.lru_cache(maxsize=1024)(_Bwd)


def _trace_device_id(q):
    """The CUDA ordinal to plan for at trace time: q's device, or JAX's first local
    device for a tracer (where the computation runs by default)."""
    device = _device(q)
    return (jax.local_devices()[0] if device is None else device).local_hardware_id


def _scratch_spec(callback, q):
    """The scratch output of ``callback``'s buffer_callback: ``(nbytes,)`` uint8, from the
    plan for aligned buffers on the device traced for (planned now; none on the CPU)."""
    nbytes = 0
    if _platform(q) == "gpu":
        nbytes = _scratch_nbytes(callback.plan(_trace_device_id(q), True).scratch_bytes)
    return jax.ShapeDtypeStruct((nbytes,), jnp.uint8)


# ----------------------------------------------------------------------------
# The two calls
# ----------------------------------------------------------------------------


def _fwd_call(q, k, v, softmax_scale, causal):
    if _buffer_callback is None:
        return _eager(_api.flash_attn_fwd, q, k, v, softmax_scale=softmax_scale, causal=causal)
    if _checks.is_empty(q, k):  # nothing sees anything: no kernel
        batch, seqlen_q, nheads_q, _ = q.shape
        return jnp.zeros(q.shape, q.dtype), jnp.full((batch, nheads_q, seqlen_q), -jnp.inf, jnp.float32)
    callback = _fwd_callback(tuple(q.shape), tuple(k.shape), np.dtype(q.dtype).name, softmax_scale, causal)
    result = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(callback.lse_shape, jnp.float32),
              _scratch_spec(callback, q))
    out, lse, _ = _buffer_callback(callback, result, vmap_method="sequential")(q, k, v)
    return out, lse


def _bwd_call(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    if _buffer_callback is None:
        return _eager(_api.flash_attn_bwd, dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                      causal=causal, deterministic=deterministic)
    if _checks.is_empty(q, k):
        return tuple(jnp.zeros(x.shape, x.dtype) for x in (q, k, v))
    callback = _bwd_callback(tuple(q.shape), tuple(k.shape), np.dtype(q.dtype).name, softmax_scale, causal,
                             deterministic)
    result = (*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)), _scratch_spec(callback, q))
    dq, dk, dv, _ = _buffer_callback(callback, result, vmap_method="sequential")(dout, q, k, v, out, lse)
    return dq, dk, dv


def _eager(fn, *arrays, **kwargs):
    if any(isinstance(x, jax.core.Tracer) for x in arrays):
        raise RuntimeError(
            f"cupyflash.{_FN}: this JAX ({jax.__version__}) has no "
            "jax.experimental.buffer_callback (JAX >= 0.7), so cupyflash can only run on "
            "concrete arrays, not under jax.jit, jax.grad or jax.vmap; upgrade JAX to use it "
            "there.")
    return fn(*arrays, **kwargs)


# ----------------------------------------------------------------------------
# custom_vjp and the public function
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, softmax_scale, causal, deterministic):
    return _fwd_call(q, k, v, softmax_scale, causal)[0]


def _attention_fwd(q, k, v, softmax_scale, causal, deterministic):
    out, lse = _fwd_call(q, k, v, softmax_scale, causal)
    return out, (q, k, v, out, lse)


def _attention_bwd(softmax_scale, causal, deterministic, residuals, dout):
    q, k, v, out, lse = residuals
    return tuple(_bwd_call(dout, q, k, v, out, lse, softmax_scale, causal, deterministic))


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q, k, v, *, softmax_scale=None, causal=False, deterministic=False):
    """Exact attention for JAX arrays; differentiable, usable under ``jax.jit``.

    Parameters
    ----------
    q : jax.Array, shape (batch, seqlen_q, nheads_q, head_dim)
        float16 or bfloat16 on a GPU (float16, bfloat16, float32 or float64 on
        the CPU backend).  The layout of ``jax.nn.dot_product_attention``.
    k, v : jax.Array, shape (batch, seqlen_k, nheads_kv, head_dim)
        Same dtype as q; ``nheads_q`` a multiple of ``nheads_kv`` (GQA/MQA).
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool, optional
        Causal mask aligned bottom-right: query ``i`` sees key ``j`` iff
        ``j <= i + seqlen_k - seqlen_q`` (see :func:`cupyflash.flash_attn_fwd`).
        With ``seqlen_q == seqlen_k`` the usual lower triangle.
    deterministic : bool, optional
        Bitwise reproducible backward (slower).

    Returns
    -------
    out : jax.Array, shape (batch, seqlen_q, nheads_q, head_dim), dtype of q

    Raises
    ------
    TypeError, ValueError
        At trace time, with the rules of :func:`cupyflash.flash_attn_fwd`.
    ImportError
        At trace time on a GPU when CuPy cannot be imported.
    RuntimeError
        Under a JAX transformation when ``jax.experimental.buffer_callback``
        is missing (JAX < 0.7).

    Notes
    -----
    On a GPU the kernels are planned (and compiled, on first use) when the
    call is traced, for the device JAX traces for.  ``jax.vmap`` runs the
    kernels once per mapped element (``vmap_method="sequential"``); map over a
    batch axis instead where you can.
    """
    scale = _validate(q, k, v, softmax_scale, causal, deterministic)
    return _attention(q, k, v, scale, bool(causal), bool(deterministic))
