"""cupyflash inside JAX: :func:`flash_attention`, differentiable and usable under ``jax.jit``.

The kernels run inside XLA's computation through
``jax.experimental.buffer_callback`` (JAX >= 0.7): XLA hands the callback its
device buffers and its CUDA stream, the callback views the buffers as CuPy
arrays (through ``__cuda_array_interface__``, no copy) and launches cupyflash's
kernels on XLA's stream, so the work is ordered with the rest of the
computation and XLA owns every buffer.  The forward writes ``out`` and ``lse``
straight into XLA's output buffers; the backward computes dq, dk, dv in CuPy
memory and copies them into XLA's (one device-to-device copy each, on the same
stream).  Gradients come from ``jax.custom_vjp`` with ``out`` and ``lse`` as
residuals.  On the CPU backend the same callback runs cupyflash's CPU path.

Where ``buffer_callback`` is missing (older JAX), :func:`flash_attention` falls
back to handing concrete arrays over through DLPack: it works eagerly and
raises a ``RuntimeError`` that says so under ``jax.jit`` or ``jax.grad``.

Memory: CuPy allocates the backward's gradients and scratch from its own pool,
beside XLA's.  XLA preallocates 75% of GPU memory by default; set
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or a smaller
``XLA_PYTHON_CLIENT_MEM_FRACTION``) before JAX starts so CuPy has room.

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

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _api, _checks, _interop

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


def _platform(q):
    """'cpu', 'gpu', ...: q's device, or the default backend for tracers (unknown yet)."""
    devices = None if isinstance(q, jax.core.Tracer) else q.devices()
    if devices is None or len(devices) != 1:
        return jax.default_backend()
    return next(iter(devices)).platform


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
# The callbacks: XLA buffers -> CuPy (GPU) or NumPy (CPU) views -> cupyflash
# ----------------------------------------------------------------------------


def _is_cuda(buffer):
    """True for a CUDA buffer: ``Buffer.__cuda_array_interface__`` raises on the CPU."""
    try:
        return bool(buffer.__cuda_array_interface__)
    except Exception:  # noqa: BLE001  (jaxlib's error type varies between versions)
        return False


def _device_id(cupy, buffers):
    for b in buffers:
        ptr = b.__cuda_array_interface__["data"][0]
        if ptr:
            return cupy.cuda.runtime.pointerGetAttributes(ptr).device
    return cupy.cuda.runtime.getDevice()


def _cupy_views(cupy, buffers, device_id):
    """CuPy views of XLA buffers (dense, row-major); bfloat16 as uint16 storage."""
    views = []
    for b in buffers:
        cai = b.__cuda_array_interface__
        dtype = np.dtype(b.dtype)
        storage = np.uint16 if dtype.name == "bfloat16" else dtype
        shape = tuple(cai["shape"])
        views.append(_interop.cupy_from_pointer(cupy, cai["data"][0], shape, storage,
                                                _interop.c_strides(shape), b, device_id))
    return views


def _on_gpu(ctx, buffers, run):
    """Run ``run(views, dtype)`` on XLA's stream, with CuPy views of ``buffers``."""
    import cupy

    device_id = _device_id(cupy, buffers)
    with cupy.cuda.Device(device_id), _interop.use_stream(cupy, ctx.stream):
        views = _cupy_views(cupy, buffers, device_id)
        run(views, "bfloat16" if np.dtype(buffers[0].dtype).name == "bfloat16" else None)


@functools.cache  # one function per flag set: jit caches key on it
def _fwd_callback(softmax_scale, causal):
    def callback(ctx, outputs, q, k, v):
        out, lse = outputs
        if not _is_cuda(q):
            o, l = _api.flash_attn_fwd(np.asarray(q), np.asarray(k), np.asarray(v),
                                       softmax_scale=softmax_scale, causal=causal)
            np.asarray(out)[...] = o
            np.asarray(lse)[...] = l
            return

        def run(views, dtype):
            qv, kv, vv, outv, lsev = views
            if _checks.is_empty(qv, kv):
                outv.fill(0)
                lsev.fill(-np.inf)
                return
            from . import _gpu

            # Straight into XLA's buffers: no copy.
            _gpu.fwd(qv, kv, vv, softmax_scale=softmax_scale, causal=causal, dtype=dtype,
                     out=outv, lse=lsev)

        _on_gpu(ctx, (q, k, v, out, lse), run)

    return callback


@functools.cache
def _bwd_callback(softmax_scale, causal, deterministic):
    def callback(ctx, outputs, dout, q, k, v, out, lse):
        flags = {"softmax_scale": softmax_scale, "causal": causal,
                 "deterministic": deterministic}
        if not _is_cuda(q):
            grads = _api.flash_attn_bwd(*(np.asarray(b) for b in (dout, q, k, v, out, lse)),
                                        **flags)
            for dst, src in zip(outputs, grads):
                np.asarray(dst)[...] = src
            return

        def run(views, dtype):
            grads = _api.flash_attn_bwd(*views[:6], dtype=dtype, **flags)
            for dst, src in zip(views[6:], grads):  # one D2D copy each, on XLA's stream
                if src.nbytes:
                    dst.data.copy_from_device_async(src.data, src.nbytes)

        _on_gpu(ctx, (dout, q, k, v, out, lse, *outputs), run)

    return callback


def _fwd_call(q, k, v, softmax_scale, causal):
    if _buffer_callback is None:
        return _eager(_api.flash_attn_fwd, q, k, v, softmax_scale=softmax_scale, causal=causal)
    batch, seqlen_q, nheads_q, _ = q.shape
    result = (jax.ShapeDtypeStruct(q.shape, q.dtype),
              jax.ShapeDtypeStruct((batch, nheads_q, seqlen_q), jnp.float32))
    return _buffer_callback(_fwd_callback(softmax_scale, causal), result,
                            vmap_method="sequential")(q, k, v)


def _bwd_call(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    if _buffer_callback is None:
        return _eager(_api.flash_attn_bwd, dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                      causal=causal, deterministic=deterministic)
    result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return _buffer_callback(_bwd_callback(softmax_scale, causal, deterministic), result,
                            vmap_method="sequential")(dout, q, k, v, out, lse)


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
    RuntimeError
        Under a JAX transformation when ``jax.experimental.buffer_callback``
        is missing (JAX < 0.7).

    Notes
    -----
    ``jax.vmap`` runs the kernels once per mapped element
    (``vmap_method="sequential"``); map over a batch axis instead where you can.
    """
    scale = _validate(q, k, v, softmax_scale, causal, deterministic)
    return _attention(q, k, v, scale, bool(causal), bool(deterministic))
