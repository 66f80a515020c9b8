"""cupyflash inside JAX: :func:`flash_attention`, differentiable and usable under ``jax.jit``.

The kernels run inside XLA's computation through
``jax.experimental.buffer_callback`` (JAX >= 0.7): XLA hands the callback its
device buffers and its CUDA stream, and the callback launches cupyflash's
kernels on that stream, straight on XLA's buffers, so the work is ordered with
the rest of the computation and XLA owns every byte of it.  Gradients come
from ``jax.custom_vjp`` with ``out`` and ``lse`` as residuals.  On the CPU
backend the same callbacks run cupyflash's CPU path.  The attention variants
(window, softcap, ALiBi, sinks, dropout, and issue 14's ``attn_bias`` /
``attn_mask``) have callbacks of their own, which run the core functions on
views of XLA's buffers; the bias is a differentiable input of the
``custom_vjp`` (its cotangent is dbias), the mask a constant.

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

:func:`flash_attn_with_kvcache` (decoding against a KV cache) runs in a
``buffer_callback`` too, its cache outputs aliased to the cache inputs: the
append is functional (the updated caches are returned), and in place when the
caches are donated to ``jax.jit``.  It is validated at trace time with the
core's rules, then calls :func:`cupyflash.flash_attn_with_kvcache` on views of
XLA's buffers (NumPy on the CPU; CuPy, on XLA's stream, on a GPU).  It has no
gradient.

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

__all__ = ["flash_attention", "flash_attn_with_kvcache"]

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


def _value_spec(x):
    """A NumPy stand-in for an optional array at trace time: its shape and dtype, every
    value 0, over memory it owns (the core's checks read the slopes' and sinks' values
    on the CPU; the real values are not known at trace time, nor read there).  One
    element broadcast (stride 0): never the size of a bias or mask."""
    return np.broadcast_to(np.zeros((), np.dtype(x.dtype)), tuple(x.shape))


def _device(q):
    """q's one device, or None for a tracer, an array over several devices or a NumPy
    array (which JAX puts on the default device, as it does a tracer's computation)."""
    devices = None if isinstance(q, jax.core.Tracer) or not hasattr(q, "devices") else q.devices()
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


# ----------------------------------------------------------------------------
# The attention variants (issue 13): their own callbacks, which run the core on
# views of XLA's buffers (the plain calls above keep their planned path)
# ----------------------------------------------------------------------------

_NO_DROPOUT, _NO_WINDOW, _NO_SOFTCAP = _api._NO_DROPOUT, _api._NO_WINDOW, _api._NO_SOFTCAP  # noqa: SLF001
_MASK32 = (1 << 32) - 1


class _VariantStatic(tuple):
    """What a variant call fixes at trace time (hashable): ``(softmax_scale, causal,
    deterministic, window_size, softcap, dropout_p, rng_state, inputs, bias_dtype)``,
    where ``rng_state`` is the static ``(seed, offset)`` (None: none, or a key's bits
    given as an input), ``inputs`` names the optional inputs given, in order, among
    ``("alibi_slopes", "sinks", "attn_bias", "attn_mask", "rng")``, and
    ``bias_dtype`` is the name of ``attn_bias``'s dtype (None without one)."""

    __slots__ = ()

    def variants(self, rng=None):
        """The core's keyword arguments (``rng``: the bits of a key, read on the host)."""
        _, _, _, window, softcap, dropout_p, rng_state, _, _ = self
        if rng is not None:
            words = [int(w) for w in np.asarray(rng, dtype=np.uint32)]
            rng_state = (words[0] | words[1] << 32, words[2])
        return dict(window_size=window, softcap=softcap, dropout_p=dropout_p,
                    rng_state=rng_state if dropout_p > 0 else None)


def _host_rng(buffer, device_id, cupy=None):
    """The three uint32 words of a key's bits, on the host (from the GPU: a copy, on
    XLA's stream, that waits for it)."""
    if cupy is None:
        return np.asarray(buffer)
    return _cupy_view(cupy, buffer, np.uint32, device_id).get()


class _VariantCallback:
    """``buffer_callback`` functions of the variants: the core on views of XLA's buffers
    (NumPy on the CPU; CuPy on the GPU, on XLA's stream, the results written straight
    into XLA's buffers)."""

    __slots__ = ("static", "dtype_name", "__weakref__")

    def __init__(self, static, dtype_name):
        self.static, self.dtype_name = static, dtype_name

    @staticmethod
    def _storage(dtype_name):
        """The dtype of a CuPy view of data of ``dtype_name`` (bfloat16: its uint16 bits)."""
        return np.dtype(np.uint16) if dtype_name == "bfloat16" else np.dtype(dtype_name)

    def _views(self, buffers, names):
        """``(views, device_id, cupy, dtype)``: views of ``buffers`` by name."""
        kind, device_id = buffers[0].__dlpack_device__()
        if kind == _interop.DL_CPU:
            return {name: np.asarray(b) for name, b in zip(names, buffers)}, device_id, None, None
        cupy = _interop._import_cupy(_FN, "jax.Array")  # noqa: SLF001
        bf16 = self.dtype_name == "bfloat16"
        data = self._storage(self.dtype_name)
        fixed = {"lse": np.float32, "alibi_slopes": np.float32, "sinks": np.float32, "dsinks": np.float32,
                 "rng": np.uint32, "attn_mask": np.bool_}
        bias_dtype = self.static[8]
        if bias_dtype is not None:  # dbias has the bias's dtype
            fixed["attn_bias"] = fixed["dbias"] = self._storage(bias_dtype)
        views = {name: _cupy_view(cupy, b, fixed.get(name, data), device_id) for name, b in zip(names, buffers)}
        return views, device_id, cupy, ("bfloat16" if bf16 else None)

    @contextlib.contextmanager
    def _entered(self, ctx, buffers, names):
        """Views of ``buffers`` by name on their device (and on XLA's stream, ``ctx.stream``,
        which only a GPU callback has),
        with the core's variant keywords: yields ``(views, cupy, dtype, variants)``;
        the key's bits (``rng``) are read and left out of the views."""
        kind, device_id = buffers[0].__dlpack_device__()
        with contextlib.nullcontext() if kind == _interop.DL_CPU else _cuda_device(device_id):
            views, device_id, cupy, dtype = self._views(buffers, names)
            with contextlib.nullcontext() if cupy is None else _interop.use_stream(cupy, ctx.stream):
                rng = views.pop("rng", None)
                variants = self.static.variants(None if rng is None else (
                    np.asarray(rng) if cupy is None else rng.get()))
                yield views, cupy, dtype, variants


class _VariantFwd(_VariantCallback):
    """``callback(ctx, (out, lse), q, k, v, *optional)``."""

    __slots__ = ()

    def __call__(self, ctx, outputs, *inputs):
        scale, causal = self.static[:2]
        names = ("out", "lse", "q", "k", "v") + self.static[7]
        with self._entered(ctx, (*outputs, *inputs), names) as (views, cupy, dtype, variants):
            extra = {} if dtype is None else {"dtype": dtype}
            arrays = {name: views.get(name) for name in _OPTIONAL_ARRAYS}
            if cupy is None:
                o, l = _api.flash_attn_fwd(views["q"], views["k"], views["v"], softmax_scale=scale,
                                           causal=causal, **arrays, **variants)
                views["out"][...] = o
                views["lse"][...] = l
            else:  # straight into XLA's out and lse
                _api.flash_attn_fwd(views["q"], views["k"], views["v"], softmax_scale=scale, causal=causal,
                                    out=views["out"], lse=views["lse"], **arrays, **variants, **extra)


class _VariantBwd(_VariantCallback):
    """``callback(ctx, (dq, dk, dv[, dsinks][, dbias]), dout, q, k, v, out, lse, *optional)``;
    dbias only with ``with_dbias`` (the bias is differentiated: ``return_dbias=True``)."""

    __slots__ = ("with_dbias",)

    def __init__(self, static, dtype_name, with_dbias=False):
        super().__init__(static, dtype_name)
        self.with_dbias = with_dbias

    def __call__(self, ctx, outputs, *inputs):
        scale, causal, deterministic = self.static[:3]
        optional = self.static[7]
        grads = (("dq", "dk", "dv") + (("dsinks",) if "sinks" in optional else ())
                 + (("dbias",) if self.with_dbias else ()))
        names = grads + ("dout", "q", "k", "v", "out", "lse") + optional
        with self._entered(ctx, (*outputs, *inputs), names) as (views, cupy, dtype, variants):
            args = [views[name] for name in ("dout", "q", "k", "v", "out", "lse")]
            kwargs = dict(softmax_scale=scale, causal=causal, deterministic=deterministic,
                          **{name: views.get(name) for name in _OPTIONAL_ARRAYS}, **variants)
            if self.with_dbias:
                kwargs["return_dbias"] = True
            if cupy is None:
                result = _api.flash_attn_bwd(*args, **kwargs)
                for name, r in zip(grads, result):
                    views[name][...] = r
            else:  # dq, dk, dv straight into XLA's buffers; dsinks and dbias copied there
                result = _api.flash_attn_bwd(*args, dq=views["dq"], dk=views["dk"], dv=views["dv"],
                                             **kwargs, **({} if dtype is None else {"dtype": dtype}))
                for name, r in zip(grads[3:], result[3:]):
                    views[name][...] = r


#: The optional arrays the core takes by keyword (the rest of ``inputs``, "rng", is read
#: on the host).
_OPTIONAL_ARRAYS = ("alibi_slopes", "sinks", "attn_bias", "attn_mask")

_variant_fwd_callback = functools.lru_cache(maxsize=1024)(_VariantFwd)
_variant_bwd_callback = functools.lru_cache(maxsize=1024)(_VariantBwd)


def _variant_fwd_call(static, q, k, v, optional):
    if _checks.is_empty(q, k):
        batch, seqlen_q, nheads_q, _ = q.shape
        lse = jnp.full((batch, nheads_q, seqlen_q), -jnp.inf, jnp.float32)
        if "sinks" in static[7]:  # a row that sees no key: the sink alone
            lse = jnp.broadcast_to(optional[static[7].index("sinks")][None, :, None], lse.shape)
        return jnp.zeros(q.shape, q.dtype), lse
    callback = _variant_fwd_callback(static, np.dtype(q.dtype).name)
    batch, seqlen_q, nheads_q, _ = q.shape
    result = (jax.ShapeDtypeStruct(q.shape, q.dtype),
              jax.ShapeDtypeStruct((batch, nheads_q, seqlen_q), jnp.float32))
    return tuple(_buffer_callback(callback, result, vmap_method="sequential")(q, k, v, *optional))


def _variant_bwd_call(static, dout, q, k, v, out, lse, optional, with_dbias=False):
    """``(dq, dk, dv)``, then dsinks with sinks, then dbias with ``with_dbias``."""
    sinks = "sinks" in static[7]
    result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    if sinks:
        result += (jax.ShapeDtypeStruct((q.shape[2],), jnp.float32),)
    if with_dbias:
        bias = optional[static[7].index("attn_bias")]
        result += (jax.ShapeDtypeStruct(bias.shape, bias.dtype),)
    if _checks.is_empty(q, k):
        return tuple(jnp.zeros(r.shape, r.dtype) for r in result)
    callback = _variant_bwd_callback(static, np.dtype(q.dtype).name, with_dbias)
    return tuple(_buffer_callback(callback, result, vmap_method="sequential")(
        dout, q, k, v, out, lse, *optional))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _variant_attention(static, q, k, v, optional):
    return _variant_fwd_call(static, q, k, v, optional)[0]


# The rule is defined with symbolic zeros (``symbolic_zeros=True``): the forward rule
# sees which inputs are differentiated (``CustomVJPPrimal.perturbed``), so the
# backward computes dbias only when the bias is (``return_dbias=True``), as the torch
# wrapper does when the bias requires grad.  Whether it is rides in the residuals'
# structure (``((),)`` or ``()``: no leaves either way).

_DBIAS, _NO_DBIAS = ((),), ()


def _variant_attention_fwd(static, q, k, v, optional):
    q, k, v = q.value, k.value, v.value
    names = static[7]
    with_dbias = "attn_bias" in names and optional[names.index("attn_bias")].perturbed
    optional = tuple(x.value for x in optional)
    out, lse = _variant_fwd_call(static, q, k, v, optional)
    return out, (q, k, v, out, lse, optional, _DBIAS if with_dbias else _NO_DBIAS)


def _variant_attention_bwd(static, residuals, dout):
    q, k, v, out, lse, optional, dbias_marker = residuals
    if isinstance(dout, jax.custom_derivatives.SymbolicZero):  # out does not reach the loss
        dout = jnp.zeros(out.shape, out.dtype)
    with_dbias = dbias_marker == _DBIAS
    grads = _variant_bwd_call(static, dout, q, k, v, out, lse, optional, with_dbias)
    names = static[7]
    # alibi_slopes are constants (flash-attention does not differentiate them either);
    # rng (a key's bits, integers) and attn_mask (bool) have no cotangent; dbias is last
    d_optional = tuple(grads[3] if name == "sinks" else grads[-1] if name == "attn_bias" and with_dbias
                       else None for name in names)
    return grads[0], grads[1], grads[2], d_optional


_variant_attention.defvjp(_variant_attention_fwd, _variant_attention_bwd, symbolic_zeros=True)


def _is_key(x):
    """A JAX PRNG key: typed (``jax.random.key``) or raw (``jax.random.PRNGKey``, uint32 (2,))."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return np.dtype(dtype) == np.uint32 and tuple(getattr(x, "shape", ())) == (2,)


#: What each optional array of :func:`flash_attention` must be, as its TypeError says.
_ARRAY_RULES = {"alibi_slopes": "a float32 jax.Array", "sinks": "a float32 jax.Array",
                "attn_bias": "a jax.Array of q's dtype or float32", "attn_mask": "a bool jax.Array"}


def _optional_array(name, x):
    """An optional array argument as a JAX array (NumPy arrays converted; None kept)."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    if not isinstance(x, (jax.Array, jax.core.Tracer)):
        _checks.fail(TypeError, _FN, f"{name} must be None or {_ARRAY_RULES[name]}; got "
                                     f"{_checks._type_name(x)}.")  # noqa: SLF001
    return x


#: Why the JAX wrapper draws no state of its own (the missing rng_state's TypeError says it).
_RNG_RULE = ("JAX's randomness is explicit: pass a jax.random key, split per step, or a (seed, offset) "
             "pair; a state drawn on the host would be fixed at trace time and replayed by every call "
             "of a jitted function")


def _variant_call(q, k, v, scale, causal, deterministic, dropout_p, window_size, softcap, alibi_slopes,
                  sinks, rng_state, attn_bias=None, attn_mask=None):
    """:func:`flash_attention` with a variant argument given: validated at trace time
    with the core's rules (on NumPy specs of the arrays), then the variant callbacks."""
    key = rng_state if _is_key(rng_state) else None
    if key is not None and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape != ():
        _checks.fail(TypeError, _FN, f"rng_state must be one JAX PRNG key (shape ()) or a (seed, offset) pair; "
                                     f"got a key array of shape {tuple(key.shape)} (index it, e.g. "
                                     f"jax.random.split(key)[0], to take one key per call).")
    arrays = {name: _optional_array(name, x) for name, x in (
        ("alibi_slopes", alibi_slopes), ("sinks", sinks), ("attn_bias", attn_bias), ("attn_mask", attn_mask))}
    specs = {name: None if x is None else _value_spec(x) for name, x in arrays.items()}
    options = _checks.check_variants(
        _FN, _spec(q), False, dropout_p, window_size, specs["alibi_slopes"], softcap, specs["sinks"],
        (0, 0) if key is not None else rng_state, attn_bias=specs["attn_bias"], attn_mask=specs["attn_mask"],
        seqlens=(q.shape[1], k.shape[1]), rng_rule=_RNG_RULE)
    if not options:
        return _attention(q, k, v, scale, causal, deterministic)
    bias_dtype = None if attn_bias is None else np.dtype(arrays["attn_bias"].dtype).name
    if _buffer_callback is None:
        return _eager(_api.flash_attn, q, k, v, softmax_scale=scale, causal=causal,
                      **{name: x for name, x in arrays.items() if x is not None},
                      **_VariantStatic((scale, causal, deterministic, options.get(
                          "window_size", (-1, -1)), options.get("softcap", 0.0), options.get("dropout_p", 0.0),
                          options.get("rng_state"), (), bias_dtype)).variants())
    names, optional = [], []
    for name, x in arrays.items():
        if x is not None:
            names.append(name)
            optional.append(x)
    static_rng = options.get("rng_state")
    if "dropout_p" in options and key is not None:
        if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)
        names.append("rng")
        optional.append(jax.random.bits(key, (3,), jnp.uint32))  # seed (two words) and offset
        static_rng = None
    static = _VariantStatic((scale, causal, deterministic, options.get("window_size", (-1, -1)),
                             options.get("softcap", 0.0), options.get("dropout_p", 0.0), static_rng,
                             tuple(names), bias_dtype))
    return _variant_attention(static, q, k, v, tuple(optional))


def flash_attention(q, k, v, *, softmax_scale=None, causal=False, deterministic=False,
                    dropout_p=_NO_DROPOUT, window_size=_NO_WINDOW, softcap=_NO_SOFTCAP, alibi_slopes=None,
                    sinks=None, rng_state=None, attn_bias=None, attn_mask=None):
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
    dropout_p : float, optional
        Dropout probability in [0, 1) (0: off): each attention probability
        is kept with probability ``1 - dropout_p`` and scaled by ``1 / (1 -
        dropout_p)``; the backward uses the same mask (the state is kept with
        the residuals: nothing to pass to ``jax.grad``).  Needs ``rng_state``.
    window_size : (int, int), optional
        Sliding window ``(left, right)``, -1 for unbounded (see
        :func:`cupyflash.flash_attn_fwd`); combines with ``causal``.
    softcap : float, optional
        Logit softcapping (0: off): ``s -> softcap * tanh(s / softcap)``.
    alibi_slopes : jax.Array, shape (nheads_q,) or (batch, nheads_q), float32, optional
        ALiBi slopes.  Constants: ``jax.grad`` gives them a zero cotangent
        (flash-attention does not differentiate them either).
    sinks : jax.Array, shape (nheads_q,), float32, optional
        Attention sinks, a logit per head in every row's softmax denominator.
        Differentiable: ``jax.grad`` with respect to them gives dsinks (from
        the backward, summed over the batch and the rows).
    rng_state : (int, int) or jax PRNG key, optional
        The dropout state, required with ``dropout_p > 0``: either a pair of
        Python ints ``(seed, offset)`` (a 64-bit seed and a 32-bit offset, as
        in :func:`cupyflash.flash_attn_fwd`; fixed at trace time, so a new
        pair under ``jax.jit`` retraces), or a JAX PRNG key
        (``jax.random.key(...)``, or a raw ``jax.random.PRNGKey``: any uint32
        array of shape (2,) is taken as one), which may be traced: the state is
        ``jax.random.bits(key, (3,), uint32)`` (seed = word 0 + word 1 << 32,
        offset = word 2), computed in the graph and read on the host when the
        kernels are launched (on a GPU a 12-byte copy that waits for XLA's
        stream).  Split the key per step and per layer, as for any JAX
        randomness.  The same state gives the same mask, here and in
        :func:`cupyflash.flash_attn_fwd`.  Unlike the core functions, which
        draw a state from cupyflash's generator when given none, this
        wrapper refuses a missing state with dropout (a TypeError naming
        ``rng_state``): under ``jax.jit`` a state drawn on the host would be a
        trace-time constant, the same mask at every step.
    attn_bias : jax.Array, optional
        An additive bias on the scores, broadcastable to ``(batch, nheads_q,
        seqlen_q, seqlen_k)``: rank at most 4, each dimension (left-padded
        with 1s) 1 or full, e.g. ``(1, nheads_q, seqlen_q, seqlen_k)``,
        ``(batch, 1, 1, seqlen_k)`` or ``(seqlen_q, seqlen_k)``.  dtype q's
        or float32.  Added after the softcap and ALiBi; a ``-inf`` entry
        hides the key from the row (see :func:`cupyflash.flash_attn_fwd`).
        Differentiable: its cotangent is dbias (``dS`` summed over the
        dimensions it broadcasts, in its shape and dtype), computed only when
        the bias is differentiated (``jax.grad`` with respect to q alone
        computes none).
    attn_mask : jax.Array of bool, optional
        A keep-mask broadcastable like ``attn_bias``: True attends.  Not
        differentiable (``jax.vjp`` gives it a float0 cotangent).  A row that
        sees no key, whatever hides them, gets output 0 and zero gradients.

    Returns
    -------
    out : jax.Array, shape (batch, seqlen_q, nheads_q, head_dim), dtype of q

    Raises
    ------
    TypeError, ValueError
        At trace time, with the rules of :func:`cupyflash.flash_attn_fwd`
        (the variants' too: shapes and dtypes of the slopes, sinks, bias and
        mask, a non-bool mask included; their values are not read at trace
        time); a TypeError when ``dropout_p > 0`` without ``rng_state``.
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

    With a variant on, the call runs callbacks of its own that call
    :func:`cupyflash.flash_attn_fwd` / :func:`cupyflash.flash_attn_bwd` on
    views of XLA's buffers (NumPy on the CPU backend; CuPy on a GPU, on XLA's
    stream, writing out, lse, dq, dk and dv into XLA's buffers): planned when
    they run rather than at trace time, with the kernels' scratch from CuPy's
    pool.  Without one (the defaults, or values that mean off) the call is
    the plain one above.
    """
    scale = _validate(q, k, v, softmax_scale, causal, deterministic)
    if (dropout_p is not _NO_DROPOUT or window_size is not _NO_WINDOW or softcap is not _NO_SOFTCAP
            or alibi_slopes is not None or sinks is not None or rng_state is not None
            or attn_bias is not None or attn_mask is not None):
        return _variant_call(q, k, v, scale, bool(causal), bool(deterministic), dropout_p, window_size,
                             softcap, alibi_slopes, sinks, rng_state, attn_bias, attn_mask)
    return _attention(q, k, v, scale, bool(causal), bool(deterministic))


# ----------------------------------------------------------------------------
# flash_attn_with_kvcache: attention against a KV cache, the append functional
# ----------------------------------------------------------------------------

#: The function the messages name: the core's (the rules are its rules).
_KV_FN = "flash_attn_with_kvcache"
#: The arrays the callback may take, in order (those given, without None).
_KV_ARRAYS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "block_table",
              "attn_bias", "attn_mask")
#: Which of them are index arrays (int32).
_KV_INDEX = frozenset(("cache_seqlens", "cache_batch_idx", "block_table"))


def _writeable_spec(x):
    """A writeable NumPy array with x's shape and dtype (never read), as the core's
    checks want of a cache it appends to: a unit last stride over one row of its own
    memory and zero strides elsewhere, so that it spans only memory it owns (two of
    them never overlap, for the core's ``numpy.shares_memory`` check)."""
    dtype = np.dtype(x.dtype)
    shape = tuple(x.shape)
    if not shape:
        return np.zeros((), dtype)
    strides = (0,) * (len(shape) - 1) + (dtype.itemsize,)
    return np.lib.stride_tricks.as_strided(np.zeros(max(shape[-1], 1), dtype), shape, strides)


def _kv_array(name, x, optional=True):
    """x as a JAX array (NumPy arrays converted; None kept when ``optional``)."""
    if x is None and optional:
        return None
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        _checks.fail(TypeError, _KV_FN, f"{name} must be a jax.Array; got {_checks._type_name(x)}.")
    return x


def _kv_check_shapes(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                     softmax_scale, causal, num_splits, return_lse):
    """The rules of :func:`cupyflash._kvcache._check` that need no values: shapes, dtypes
    and flags (the arguments are NumPy specs; an int ``cache_seqlens`` is checked in
    full).  For lengths and indices that are tracers, or on the GPU."""
    fn = _KV_FN
    _checks.check_qkv(fn, q, k_cache, v_cache, names=("k_cache", "v_cache"), same_batch=False)
    batch = q.shape[0]
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        _checks.fail(ValueError, fn,
                     f"{missing} must be given with {given} (the new keys and values are appended "
                     f"together); got None.")
    seqlen_new = 0
    if k is not None:
        _checks.check_qkv(fn, q, k, v)
        if k.shape[2] != k_cache.shape[2]:
            _checks.fail(ValueError, fn,
                         f"k must have the same nheads as k_cache ({k_cache.shape[2]}); "
                         f"got {k.shape[2]}.")
        seqlen_new = k.shape[1]
    scale = _checks.check_flags(fn, softmax_scale, q.shape[3], causal)
    _checks.check_num_splits(fn, num_splits)
    _checks.check_bool(fn, "return_lse", return_lse)
    if cache_batch_idx is not None and block_table is not None:
        _checks.fail(ValueError, fn,
                     "cache_batch_idx must be None when block_table is given (a paged cache has no "
                     "rows to pick); got both.")
    lengths = _checks.check_cache_seqlens(fn, cache_seqlens, q)
    if isinstance(cache_seqlens, np.ndarray):  # a spec: its values are not known here
        lengths = np.zeros(batch, dtype=np.int64)
    if cache_seqlens is None and k is not None:
        _checks.fail(ValueError, fn,
                     "cache_seqlens must be given to append k and v (None means the whole cache is "
                     "valid, leaving no slot to append to); got None.")
    if block_table is not None:
        page_size = k_cache.shape[1]
        if page_size % _checks.PAGE_SIZE_MULTIPLE or page_size == 0:
            _checks.fail(ValueError, fn,
                         f"k_cache must have a page_size (dimension 1) that is a positive multiple "
                         f"of {_checks.PAGE_SIZE_MULTIPLE} when block_table is given; got "
                         f"{page_size}.")
        _checks.check_index_array(fn, "block_table", block_table, q,
                                  ("batch", "max_blocks_per_seq"), batch)
        _checks.check_cache_lengths(fn, lengths, seqlen_new, block_table.shape[1] * page_size,
                                    page_size)
    else:
        if cache_batch_idx is not None:
            _checks.check_index_array(fn, "cache_batch_idx", cache_batch_idx, q, ("batch",), batch)
        elif k_cache.shape[0] != batch:
            _checks.fail(ValueError, fn,
                         f"k_cache must have the same batch size as q ({batch}) when neither "
                         f"cache_batch_idx nor block_table is given; got {k_cache.shape[0]}.")
        _checks.check_cache_lengths(fn, lengths, seqlen_new, k_cache.shape[1], 0)
    return scale


def _kv_validate(arrays, cache_seqlens, softmax_scale, causal, num_splits, return_lse):
    """Validate at trace time with the core's rules and messages; returns the softmax scale.

    On the CPU, when the lengths and indices are concrete arrays (not tracers), the
    core's checks run in full, values included (:func:`cupyflash._kvcache._check` on
    NumPy specs of the big arrays and host views of the index arrays).  Otherwise
    (under ``jax.jit``, or on the GPU, where the core reads no device values either)
    only what needs no values is checked here; on the CPU the core checks the values
    when the callback runs.
    """
    from . import _kvcache

    q = arrays["q"]
    index = {name: arrays.get(name) for name in _KV_INDEX}
    index["cache_seqlens"] = arrays.get("cache_seqlens", cache_seqlens)
    on_cpu = _platform(q) == "cpu"
    specs = {name: (_writeable_spec(x) if x is not None else None)
             for name, x in arrays.items() if name not in _KV_INDEX}
    specs.setdefault("k", None)
    specs.setdefault("v", None)
    concrete = on_cpu and not any(isinstance(x, jax.core.Tracer)
                                  for name, x in arrays.items() if name in _KV_INDEX)
    if concrete:
        host = {name: (np.asarray(x) if name in arrays else x) for name, x in index.items()}
        plan = _kvcache._check(specs["q"], specs["k_cache"], specs["v_cache"], specs["k"],  # noqa: SLF001
                               specs["v"], host["cache_seqlens"], host["cache_batch_idx"],
                               host["block_table"], softmax_scale, causal, num_splits,
                               return_lse, None)
        scale = plan.scale
    else:
        # zeros of each index array's shape and dtype (small; the checks read them)
        stand_in = {name: (np.zeros(tuple(x.shape), np.dtype(x.dtype)) if name in arrays else x)
                    for name, x in index.items()}
        scale = _kv_check_shapes(specs["q"], specs["k_cache"], specs["v_cache"], specs["k"],
                                 specs["v"], stand_in["cache_seqlens"], stand_in["cache_batch_idx"],
                                 stand_in["block_table"], softmax_scale, causal, num_splits,
                                 return_lse)
    dtype = np.dtype(q.dtype).name
    if not on_cpu and dtype not in _checks.GPU_DTYPES:
        _checks.fail(TypeError, _KV_FN,
                     f"q must have dtype float16 or bfloat16 on the GPU; got {dtype}.")
    if "attn_bias" in specs or "attn_mask" in specs:  # (the core's rules: shapes and dtypes only)
        qs, cache = specs["q"], specs["k_cache"]
        table = index["block_table"]
        capacity = cache.shape[1] * (table.shape[1] if table is not None else 1)
        _checks.check_score_arrays(_KV_FN, qs, qs.shape[0], qs.shape[2], (qs.shape[1], capacity),
                                   specs.get("attn_bias"), specs.get("attn_mask"), key_capacity=capacity)
    return scale


class _KVCallback:
    """The ``buffer_callback`` function of one signature: which arrays are given (in
    ``_KV_ARRAYS`` order), an int ``cache_seqlens`` (or None), the flags and the dtype.

    ``callback(ctx, (out, lse[, k_cache, v_cache]), *arrays)``: with an append, the
    cache outputs alias the cache inputs (XLA copies the input there first unless it
    was donated), and the core appends into them in place.  On the CPU the core runs
    on NumPy views of XLA's buffers; on a GPU on CuPy views, on XLA's stream.
    """

    __slots__ = ("names", "seqlens", "softmax_scale", "causal", "num_splits", "dtype_name", "bias_dtype_name",
                 "__weakref__")

    def __init__(self, names, seqlens, softmax_scale, causal, num_splits, dtype_name, bias_dtype_name=None):
        """``bias_dtype_name``: ``attn_bias``'s dtype (q's or float32), None without one."""
        self.names, self.seqlens = names, seqlens
        self.softmax_scale, self.causal, self.num_splits = softmax_scale, causal, num_splits
        self.dtype_name, self.bias_dtype_name = dtype_name, bias_dtype_name

    @property
    def appends(self):
        return "k" in self.names

    def _core(self, arrays, dtype):
        from . import _kvcache

        return _kvcache.flash_attn_with_kvcache(
            arrays["q"], arrays["k_cache"], arrays["v_cache"], arrays.get("k"), arrays.get("v"),
            cache_seqlens=arrays.get("cache_seqlens", self.seqlens),
            cache_batch_idx=arrays.get("cache_batch_idx"), block_table=arrays.get("block_table"),
            softmax_scale=self.softmax_scale, causal=self.causal, num_splits=self.num_splits,
            return_lse=True, dtype=dtype, attn_bias=arrays.get("attn_bias"), attn_mask=arrays.get("attn_mask"))

    def __call__(self, ctx, outputs, *inputs):
        buffers = dict(zip(self.names, inputs))
        out, lse = outputs[0], outputs[1]
        if self.appends:  # XLA's buffers of the new caches, holding the old ones
            buffers["k_cache"], buffers["v_cache"] = outputs[2], outputs[3]
        kind, device_id = inputs[0].__dlpack_device__()
        if kind == _interop.DL_CPU:
            o, l = self._core({name: np.asarray(b) for name, b in buffers.items()}, None)
            np.asarray(out)[...] = o
            np.asarray(lse)[...] = l
            return
        cupy = _interop._import_cupy(_KV_FN, "jax.Array")  # noqa: SLF001
        bf16 = self.dtype_name == "bfloat16"
        data = np.dtype(np.uint16) if bf16 else np.dtype(self.dtype_name)
        types = dict.fromkeys(_KV_INDEX, np.dtype(np.int32))
        types["attn_mask"] = np.dtype(np.bool_)
        types["attn_bias"] = np.dtype(np.float32) if self.bias_dtype_name == "float32" else data
        with _cuda_device(device_id), _interop.use_stream(cupy, ctx.stream):
            views = {name: _cupy_view(cupy, b, types.get(name, data), device_id) for name, b in buffers.items()}
            o, l = self._core(views, "bfloat16" if bf16 else None)
            _cupy_view(cupy, out, data, device_id)[...] = o  # on XLA's stream
            _cupy_view(cupy, lse, np.float32, device_id)[...] = l


def _cupy_view(cupy, buffer, dtype, device_id):
    """A CuPy array over a ``buffer_callback`` Buffer on the GPU (dense, row-major)."""
    shape = tuple(buffer.shape)
    return _interop.cupy_from_pointer(cupy, _pointer(buffer), shape, dtype,
                                      _interop.c_strides(shape), buffer, device_id)


_kv_callback = functools.lru_cache(maxsize=1024)(_KVCallback)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _kv_call(callback, *arrays):
    q, k_cache, v_cache = arrays[:3]
    batch, seqlen_q, nheads_q, _ = q.shape
    result = [jax.ShapeDtypeStruct(q.shape, q.dtype),
              jax.ShapeDtypeStruct((batch, nheads_q, seqlen_q), jnp.float32)]
    aliases = None
    if callback.appends:
        result += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
        aliases = {1: 2, 2: 3}  # k_cache -> output 2, v_cache -> output 3
    return tuple(_buffer_callback(callback, tuple(result), vmap_method="sequential",
                                  input_output_aliases=aliases)(*arrays))


@_kv_call.defjvp
def _kv_jvp(callback, primals, tangents):
    raise NotImplementedError(
        f"cupyflash.jax.{_KV_FN} is not differentiable (an inference function with no backward, "
        f"like flash-attention's); use cupyflash.jax.flash_attention for training, or "
        f"jax.lax.stop_gradient on its inputs.")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                            cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, num_splits=0, return_lse=False, attn_bias=None, attn_mask=None):
    """Attention of new queries against a KV cache, for JAX arrays; usable under ``jax.jit``.

    :func:`cupyflash.flash_attn_with_kvcache` (flash-attention's function of that
    name) with a functional append: JAX arrays are immutable, so when ``k`` and
    ``v`` are given the updated caches are returned, and ``k_cache``/``v_cache``
    themselves are left as they were.  Under ``jax.jit`` with the caches donated
    (``donate_argnums``) XLA updates them in place: the append writes only the
    new slots.  Without donation, XLA first copies each cache (its whole size)
    into the output.

    Parameters
    ----------
    q : jax.Array, shape (batch, seqlen_q, nheads_q, head_dim)
        The new queries (1 per sequence for a decode step).  dtype float16 or
        bfloat16 on a GPU; float16, bfloat16, float32 or float64 on the CPU
        backend.
    k_cache, v_cache : jax.Array, shape (batch_cache, seqlen_cache, nheads_kv, head_dim)
        The cache, q's dtype: row ``b`` (or ``cache_batch_idx[b]``) holds
        sequence ``b``'s keys/values.  With ``block_table``: shape
        (num_blocks, page_size, nheads_kv, head_dim), ``page_size`` a positive
        multiple of 16.  ``nheads_q`` a multiple of ``nheads_kv`` (GQA/MQA).
    k, v : jax.Array, shape (batch, seqlen_new, nheads_kv, head_dim), optional
        New keys and values, both or neither, q's dtype: written at positions
        ``cache_seqlens[b] ...`` of sequence ``b`` in the returned caches,
        before attention (which then sees ``cache_seqlens[b] + seqlen_new``
        keys).
    cache_seqlens : int or jax.Array, shape (batch,), int32, optional
        The number of valid cache entries of each sequence before the append (an
        int: the same for all, fixed at trace time).  None: the whole cache is
        valid, which leaves no room to append.
    cache_batch_idx : jax.Array, shape (batch,), int32, optional
        The cache row each sequence uses.  Not with ``block_table``.
    block_table : jax.Array, shape (batch, max_blocks_per_seq), int32, optional
        Paged cache: entry ``p`` of row ``b`` is the block holding sequence
        ``b``'s keys ``p * page_size`` to ``(p + 1) * page_size - 1``.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool, optional
        Causal mask aligned bottom-right: query ``i`` sees key ``j`` iff
        ``j <= i + seqlen_k_b - seqlen_q``.
    num_splits : int, optional
        Splits of each sequence's keys on the GPU (0: automatic); any value gives
        the same result within rounding.
    return_lse : bool, optional
        Also return the logsumexp.
    attn_bias : jax.Array, optional
        An additive bias (issue 14), q's dtype or float32, rank <= 4,
        broadcastable to ``(batch, nheads_q, seqlen_q, key)`` (each of the first
        three dimensions 1 or full), the last dimension 1 or at least the cache's
        capacity (``seqlen_cache``, or ``max_blocks_per_seq * page_size``), indexed
        by the key's position in its sequence.  Added to the scaled scores;
        ``-inf`` hides a key.  As in :func:`cupyflash.flash_attn_with_kvcache`.
    attn_mask : jax.Array of bool, optional
        A keep-mask broadcastable like ``attn_bias``: False hides the key.

    Returns
    -------
    out : jax.Array, shape (batch, seqlen_q, nheads_q, head_dim), dtype of q
    lse : jax.Array, shape (batch, nheads_q, seqlen_q), float32
        Only with ``return_lse=True``; ``-inf`` for a row that sees no key.
    k_cache, v_cache : jax.Array, shapes and dtypes of the inputs
        Only when ``k`` and ``v`` are given: the caches after the append.

    So the result is ``out``; ``(out, lse)`` with ``return_lse``; ``(out,
    k_cache, v_cache)`` with ``k``/``v``; ``(out, lse, k_cache, v_cache)`` with
    both.

    Raises
    ------
    TypeError, ValueError
        At trace time, with the rules and messages of
        :func:`cupyflash.flash_attn_with_kvcache` (named so in the message).
        Lengths and indices are checked at trace time when they are concrete
        arrays on the CPU backend (eager calls); under ``jax.jit`` on the CPU
        the core checks them when the computation runs, and the error comes
        back as a ``jax.errors.JaxRuntimeError`` that quotes it.  On a GPU,
        device values are not checked (as for CuPy arrays).
    NotImplementedError
        Under ``jax.grad`` / ``jax.jvp`` through the result: no gradient is
        defined (flash-attention's ``flash_attn_with_kvcache`` has no backward
        either).
    RuntimeError
        When ``jax.experimental.buffer_callback`` is missing (JAX < 0.7).

    Notes
    -----
    The work runs in a ``jax.experimental.buffer_callback``: on the CPU, the
    NumPy path on views of XLA's buffers; on a GPU, the core on CuPy views of
    them, on XLA's stream (its output and lse come from CuPy's memory pool and
    are copied into XLA's buffers; see the README on XLA's preallocation).
    ``jax.vmap`` runs it once per mapped element.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from cupyflash.jax import flash_attn_with_kvcache
    >>> k_cache, v_cache = jnp.zeros((2, 64, 2, 16)), jnp.zeros((2, 64, 2, 16))
    >>> q = jnp.ones((2, 1, 4, 16), jnp.float32)
    >>> k = v = jnp.ones((2, 1, 2, 16), jnp.float32)
    >>> lens = jnp.array([3, 10], jnp.int32)
    >>> step = jax.jit(lambda q, kc, vc, k, v, lens: flash_attn_with_kvcache(
    ...     q, kc, vc, k, v, cache_seqlens=lens, causal=True), donate_argnums=(1, 2))
    >>> out, k_cache, v_cache = step(q, k_cache, v_cache, k, v, lens)
    >>> float(k_cache[1, 10, 0, 0]), out.shape
    (1.0, (2, 1, 4, 16))
    """
    given = {"q": _kv_array("q", q, optional=False),
             "k_cache": _kv_array("k_cache", k_cache, optional=False),
             "v_cache": _kv_array("v_cache", v_cache, optional=False),
             "k": _kv_array("k", k), "v": _kv_array("v", v),
             "cache_batch_idx": _kv_array("cache_batch_idx", cache_batch_idx),
             "block_table": _kv_array("block_table", block_table),
             "attn_bias": _kv_array("attn_bias", attn_bias), "attn_mask": _kv_array("attn_mask", attn_mask)}
    if isinstance(cache_seqlens, np.integer):
        cache_seqlens = int(cache_seqlens)  # a numpy integer scalar: the int it holds, as in the core
    if isinstance(cache_seqlens, np.ndarray) or (
            hasattr(cache_seqlens, "shape") and hasattr(cache_seqlens, "dtype")):
        given["cache_seqlens"] = _kv_array("cache_seqlens", cache_seqlens)
        seqlens = None
    else:  # None, an int, or something the checks refuse
        seqlens = cache_seqlens
    arrays = {name: given[name] for name in _KV_ARRAYS if given.get(name) is not None}
    scale = _kv_validate(arrays, seqlens, softmax_scale, causal, num_splits, return_lse)
    if _buffer_callback is None:
        raise RuntimeError(
            f"cupyflash.jax.{_KV_FN}: this JAX ({jax.__version__}) has no "
            "jax.experimental.buffer_callback, which it needs (JAX >= 0.7).")
    q = arrays["q"]
    bias = arrays.get("attn_bias")
    callback = _kv_callback(tuple(arrays), None if seqlens is None else int(seqlens), scale,
                            bool(causal), int(num_splits), np.dtype(q.dtype).name,
                            None if bias is None else np.dtype(bias.dtype).name)
    results = _kv_call(callback, *arrays.values())
    out, lse = results[:2]
    head = (out, lse) if return_lse else (out,)
    if callback.appends:
        return (*head, *results[2:])
    return head if return_lse else out
