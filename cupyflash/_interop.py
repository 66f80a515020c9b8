"""Zero-copy views of torch, JAX and other DLPack / CUDA-array-interface arrays.

The public functions in ``_api`` and ``_varlen`` take NumPy and CuPy arrays.
Anything else that is an array (``torch.Tensor``, ``jax.Array``, an object with
``__dlpack__`` or ``__cuda_array_interface__``) comes here: :func:`call` views
every argument as a NumPy (CPU) or CuPy (GPU) array without copying, calls the
public function again with the views, and hands the results back in the
caller's type.  The attention variants' arrays (``alibi_slopes=``, ``sinks=``,
and issue 14's ``attn_bias=``, ``attn_mask=``) are viewed the same way when
given, strides and all (a stride-0 broadcast view stays one: nothing is copied),
with the same type and device checks (slopes and sinks float32, the bias q's
dtype or float32, the mask bool), and ``dsinks`` and ``dbias`` come back in the
caller's type (``dbias`` in the bias's dtype, bfloat16 included).

What each framework gets
------------------------
torch, CUDA
    ``cupy.from_dlpack`` of the tensor (bfloat16 as a ``view(torch.int16)``,
    since CuPy has no bfloat16; the kernels are told ``dtype="bfloat16"``).
    Everything runs on ``torch.cuda.current_stream()``, made CuPy's current
    stream for the call, so the work is ordered after the producer's and
    before later torch work without any synchronisation.  Results come back
    through ``torch.from_dlpack`` (bfloat16: ``.view(torch.bfloat16)``): no copy.
    Memory lifetime follows torch's rules for the current stream (use
    ``Tensor.record_stream`` for tensors made on another stream, as for any
    torch op).
torch, CPU
    ``Tensor.numpy()`` views (bfloat16 as ml_dtypes.bfloat16) on the CPU path;
    results back through ``torch.from_numpy``: no copy.
JAX, GPU
    DLPack with the consumer stream: CuPy's current stream is passed to
    ``jax.Array.__dlpack__(stream=...)``, so it waits for the computation that
    produces the array; results go back through ``jax.dlpack.from_dlpack``,
    which makes JAX's stream wait for ours.  bfloat16 (which CuPy cannot
    import, and JAX's ``__cuda_array_interface__`` refuses) is read straight
    from the DLPack capsule as uint16 storage, and results are handed to JAX
    in a capsule relabelled as bfloat16: no copy either way.  Because JAX
    cannot see the stream the kernels ran on, the inputs are kept alive until
    an event recorded after the kernels has completed.  Under ``jax.jit``
    there is no data to hand over: use :func:`cupyflash.jax.flash_attention`.
JAX, CPU
    ``numpy.asarray`` views on the CPU path; results are copied into JAX
    arrays with ``jax.device_put``.
other ``__cuda_array_interface__`` / ``__dlpack__`` objects
    ``cupy.asarray`` / ``cupy.from_dlpack`` (``numpy.from_dlpack`` on the
    CPU); results are CuPy (NumPy) arrays, as there is no general way back.

Neither torch nor JAX is ever imported here: an argument is recognised by the
module of its type, so a framework is used only when its arrays are passed.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import sys

import numpy as np

from ._checks import _type_name, fail

# DLPack constants (dlpack.h)
DL_CPU = 1
DL_CUDA = 2
DL_BFLOAT = 4
#: Device types a view is made of: CPU memory by NumPy, the CUDA ones (device, pinned
#: host, managed) by cupy.from_dlpack; any other is named in a TypeError.
_DL_VIEWED = frozenset((DL_CPU, DL_CUDA, 3, 13))
_DL_DEVICE_NAMES = {4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm", 11: "ROCm host",
                    12: "ExtDev", 14: "oneAPI", 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}

_NATIVE = frozenset(("numpy", "cupy", None))  # None: not an array; the checks say so
_KIND_BY_TYPE: dict = {}


# ----------------------------------------------------------------------------
# What an argument is: decided once per type, from the module of the type
# ----------------------------------------------------------------------------


def kind(x):
    """'numpy', 'cupy', 'torch', 'jax', 'other:<module>' or None (not an array)."""
    t = type(x)
    try:
        return _KIND_BY_TYPE[t]
    except KeyError:
        pass
    k = _KIND_BY_TYPE[t] = _classify(t)
    if k in _NATIVE:
        _NATIVE_TYPES.add(t)
    return k


#: Types whose kind is in _NATIVE (seen so far): one set lookup on the hot path.
_NATIVE_TYPES: set = set()


def _classify(t):
    if issubclass(t, np.ndarray):
        return "numpy"
    top = t.__module__.partition(".")[0]
    if top == "cupy":
        return "cupy"
    if top == "torch":
        torch = sys.modules.get("torch")
        return "torch" if torch is not None and issubclass(t, torch.Tensor) else None
    if top in ("jax", "jaxlib"):
        jax = sys.modules.get("jax")
        if jax is not None and issubclass(t, (jax.Array, jax.core.Tracer)):
            return "jax"  # tracers too, to say what to use under jax.jit
        return None
    if hasattr(t, "__cuda_array_interface__") or hasattr(t, "__dlpack__"):
        return f"other:{top}"
    return None


def _all_native(given, kwargs, names) -> bool:
    """Every positional array in ``given`` and every keyword array in ``names`` is NumPy,
    CuPy or not an array (None, an int): one set lookup each once its type was seen."""
    for x in given:
        if type(x) not in _NATIVE_TYPES and kind(x) not in _NATIVE:
            return False
    for name in names:
        x = kwargs.get(name)
        if type(x) not in _NATIVE_TYPES and kind(x) not in _NATIVE:
            return False
    return True


def foreign(*arrays):
    """True when any argument is an array that is neither NumPy nor CuPy."""
    for x in arrays:
        if kind(x) not in _NATIVE:
            return True
    return False


def _label(x):
    k = kind(x)
    return {"numpy": "numpy.ndarray", "cupy": "cupy.ndarray", "torch": "torch.Tensor",
            "jax": "jax.Array"}.get(k) or _type_name(x)


# ----------------------------------------------------------------------------
# The entry point from _api
# ----------------------------------------------------------------------------


def accepts_foreign(*names, keywords=(), optional=(), appends=None):
    """Decorate a public function whose leading arguments ``names`` are arrays, so
    that foreign arrays (torch, JAX, ``__dlpack__`` objects) go through :func:`call`.

    NumPy and CuPy arrays reach the function itself after one type lookup per
    array.  Arrays may also be passed by keyword.

    ``keywords`` name keyword-only array arguments, viewed like the others;
    ``optional`` names (among ``names`` and ``keywords``) may be left out or be
    something that is not an array (None, a Python int), which is handed on
    unchanged.  ``appends`` is ``(written, given)``: the arrays ``written`` are
    modified in place when any of ``given`` is not None (refused for JAX, whose
    arrays are immutable; torch CPU tensors see the writes through their views).
    """
    if not (keywords or optional or appends):
        return _accepts_foreign_positional(names)
    count = len(names)
    all_names = tuple(names) + tuple(keywords)
    optional = frozenset(optional)

    def decorate(fn):
        fn_name = fn.__name__

        @functools.wraps(fn)
        def public(*args, **kwargs):
            given = args[:count]
            if _all_native(given, kwargs, all_names[len(given):]):
                return fn(*args, **kwargs)
            arrays = list(given)
            for name in all_names[len(given):]:
                if name not in kwargs and name not in optional:
                    return fn(*args, **kwargs)  # a missing argument: Python says which
                arrays.append(kwargs.pop(name, None))
            return call(fn_name, public, all_names, tuple(arrays), args[count:], kwargs,
                        keywords=tuple(keywords), optional=optional, appends=appends)

        return public

    return decorate


def _accepts_foreign_positional(names):
    count = len(names)

    def decorate(fn):
        fn_name = fn.__name__

        @functools.wraps(fn)
        def public(*args, **kwargs):
            given = args[:count]
            if _all_native(given, kwargs, names[len(given):]):
                return fn(*args, **kwargs)
            arrays = list(given)
            for name in names[len(given):]:
                if name not in kwargs:
                    return fn(*args, **kwargs)  # a missing argument: Python says which
                arrays.append(kwargs.pop(name))
            return call(fn_name, public, names, tuple(arrays), args[count:], kwargs)

        return public

    return decorate


#: Keyword arguments that are preallocated outputs: viewed like the inputs, and
#: handed back as the caller's own objects.
_OUTPUTS = ("out", "lse", "dq", "dk", "dv")

#: Keyword arrays of the attention variants (issues 13 and 14): viewed like the inputs
#: when given, whatever the function (their checks are the core's, after the views).
_VARIANT_ARRAYS = ("alibi_slopes", "sinks", "attn_bias", "attn_mask")


def call(fn_name, fn, names, arrays, rest, kwargs, keywords=(), optional=frozenset(),
         appends=None):
    """Run ``fn`` (a public function) on views of ``arrays``; results in the caller's type.

    ``names`` name the arrays, which are ``fn``'s leading positional arguments in
    that order, then its keyword-only array arguments ``keywords``; ``rest`` (e.g.
    varlen's ``max_seqlen_q``) and ``kwargs`` are passed on, with preallocated
    outputs (``out=``, ``dq=``, ...) viewed like the arrays.  Arguments named in
    ``optional`` that are not arrays (None, an int) are passed on unchanged;
    ``appends`` as for :func:`accepts_foreign`.
    """
    # The variants' arrays (alibi_slopes, sinks, attn_bias, attn_mask) are keyword arrays of
    # every function that takes them: viewed like q, k and v when given (None is passed on
    # as it is).
    if (kwargs.get("alibi_slopes") is not None or kwargs.get("sinks") is not None
            or kwargs.get("attn_bias") is not None or kwargs.get("attn_mask") is not None):  # four lookups otherwise
        extra = tuple(name for name in _VARIANT_ARRAYS
                      if name not in names and kwargs.get(name) is not None)
        names = tuple(names) + extra
        arrays = tuple(arrays) + tuple(kwargs.pop(name) for name in extra)
        keywords = tuple(keywords) + extra
    q = arrays[names.index("q")]
    k0 = kind(q)
    if k0 == "torch" and "dtype" not in kwargs and not keywords:
        from . import _torch_path  # noqa: PLC0415 (imports nothing until torch arrays come)

        # The lean path checks the call (check_call) when it first sees its signature.
        result = _torch_path.run(fn_name, names, arrays, rest, kwargs)
        if result is not NotImplemented:
            return result
    passed = {name: x for name, x in zip(names, arrays) if name in optional and kind(x) is None}
    viewed = tuple(name for name in names if name not in passed)
    all_names, names = names, viewed
    arrays = tuple(x for name, x in zip(all_names, arrays) if name not in passed)
    outputs = check_call(fn_name, names, arrays, kwargs)
    kwargs.pop("dtype", None)
    if outputs and k0 == "jax":
        fail(TypeError, fn_name,
             f"{next(iter(outputs))} must be None for jax.Array inputs (JAX arrays are immutable; "
             f"use the returned arrays); got a jax.Array.")
    if appends and k0 == "jax":
        written, given = appends
        for name in given:
            if name not in passed:
                fail(TypeError, fn_name,
                     f"{name} must be None for jax.Array inputs ({' and '.join(given)} are "
                     f"written into {' and '.join(written)} in place, and JAX arrays are "
                     f"immutable: cupyflash.jax.{fn_name} appends functionally and returns the "
                     f"new caches); got a jax.Array.")
    for name in outputs:  # handed on as views, in place of the caller's objects
        del kwargs[name]
    count = len(names)
    n_positional = len(all_names) - len(keywords)

    def on_views(*views, **extra):
        if not passed and not keywords:
            return fn(*views[:count], *rest, **kwargs, **dict(zip(outputs, views[count:])),
                      **extra)
        by_name = dict(passed, **dict(zip(names, views[:count])))
        return fn(*(by_name[name] for name in all_names[:n_positional]), *rest, **kwargs,
                  **{name: by_name[name] for name in keywords},
                  **dict(zip(outputs, views[count:])), **extra)

    run = {"torch": _run_torch, "jax": _run_jax}.get(k0, _run_other)
    result = run(fn_name, on_views, names + tuple(outputs), (*arrays, *outputs.values()))
    # A preallocated output is handed back as the caller's own object.
    slots = _RESULT_SLOTS.get(fn_name)
    if outputs and slots:
        result = (tuple(outputs.get(slot, r) for slot, r in zip(slots, result))
                  + tuple(result[len(slots):]))  # dsinks after dq, dk, dv
    return result


def check_call(fn_name, names, arrays, kwargs):
    """Every array (and preallocated output) of one type, no ``dtype=``; returns
    the outputs given, by name."""
    q = arrays[names.index("q")]
    k0 = kind(q)
    if k0 is None:
        fail(TypeError, fn_name,
             f"q must be a numpy.ndarray, cupy.ndarray, torch.Tensor, jax.Array or an array "
             f"with __dlpack__ or __cuda_array_interface__; got {_type_name(q)}.")
    outputs = {name: kwargs[name] for name in _OUTPUTS if kwargs.get(name) is not None}
    for name, x in (*zip(names, arrays), *outputs.items()):
        if kind(x) != k0:
            fail(TypeError, fn_name,
                 f"{name} must be a {_label(q)} like q (array types cannot be mixed); "
                 f"got {_label(x)}.")
    dtype = kwargs.get("dtype")
    if dtype is not None:
        fail(TypeError, fn_name,
             f"dtype must be None for {_label(q)} inputs, which carry their own dtype "
             f"(dtype= is for cupy arrays of raw bfloat16 bits); got {dtype!r}.")
    return outputs


#: Which result each preallocated output is, per function that takes them.
_RESULT_SLOTS = {"flash_attn_fwd": ("out", "lse"), "flash_attn_bwd": ("dq", "dk", "dv")}


def _map(result, convert):
    """``result`` (an array, or a tuple of them) converted; a dropout ``rng_state``
    in it (a tuple of ints, or None) is handed back as it is."""
    if isinstance(result, tuple):
        return tuple(a if a is None or isinstance(a, tuple) else convert(a) for a in result)
    return convert(result)


#: Arguments whose dtype is fixed, whatever q's is (the others must have q's).
_FIXED_DTYPES = {"lse": "float32", "alibi_slopes": "float32", "sinks": "float32", "cu_seqlens_q": "int32", "cu_seqlens_k": "int32",
                 "cache_seqlens": "int32", "cache_batch_idx": "int32", "block_table": "int32",
                 "attn_mask": "bool"}


def _check_same(fn_name, names, values, what, cls):
    """Every value equal to q's (a fixed dtype: that one; the bias: q's or float32);
    ``what`` is 'dtype' or 'device'.  The dtype messages are the core's."""
    ref = values[names.index("q")]
    for name, value in zip(names, values):
        if name in _FIXED_DTYPES and what == "dtype":
            if value != _FIXED_DTYPES[name]:
                if name == "attn_mask":
                    fail(TypeError, fn_name, f"attn_mask must have dtype bool (True = attend; a float mask "
                                             f"belongs in attn_bias); got {value}.")
                fail(TypeError, fn_name,
                     f"{name} must have dtype {_FIXED_DTYPES[name]}; got {value}.")
        elif name == "attn_bias" and what == "dtype":
            if value != ref and value != "float32":
                fail(TypeError, fn_name, f"attn_bias must have q's dtype ({ref}) or float32; got {value}.")
        elif value != ref:
            fail(cls, fn_name, f"{name} must have the same {what} as q ({ref}); got {value}.")


def _import_cupy(fn_name, what):
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        raise ImportError(
            f"cupyflash.{fn_name}: q is a {what} on a CUDA device, which needs cupy "
            f"(pip install 'cupyflash[cuda13]' or '[cuda12]'); importing it failed: "
            f"{type(exc).__name__}: {exc}") from exc
    return cupy


# ----------------------------------------------------------------------------
# Streams
# ----------------------------------------------------------------------------


class _StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def external_stream(cupy, ptr):
    """A CuPy stream object for the raw stream ``ptr`` (not owned, never destroyed)."""
    if ptr == 0:
        return cupy.cuda.Stream.null
    from_external = getattr(cupy.cuda.Stream, "from_external", None)  # CuPy >= 14
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr)


def use_stream(cupy, ptr):
    """A context in which CuPy's current stream (on the current device) is ``ptr``."""
    if cupy.cuda.get_current_stream().ptr == ptr:
        return contextlib.nullcontext()
    return external_stream(cupy, ptr)


def _dlpack_stream(cupy):
    """CuPy's current stream as a DLPack ``stream=`` argument (1: the legacy default)."""
    ptr = cupy.cuda.get_current_stream().ptr
    return ptr if ptr else 1


_PENDING = collections.deque()  # (event, objects) kept alive until the event completes


def _retain(cupy, objects):
    """Keep ``objects`` alive until the work queued so far on the current stream is done.

    For producers that cannot see our stream (JAX, CAI objects): their memory
    must not be freed and reused while the kernels still read it.  Costs one
    event record; completed entries are dropped on the next call.
    """
    # Take the oldest entry off before asking whether it is done, and put it back if
    # not: another thread doing the same between the two steps (check, then pop) would
    # otherwise have this one pop an entry nobody checked, freeing memory in use.
    while _PENDING:
        try:
            entry = _PENDING.popleft()
        except IndexError:  # another thread took the last one
            break
        if not entry[0].done:
            _PENDING.appendleft(entry)
            break
    event = cupy.cuda.Event(block=False, disable_timing=True)
    event.record()
    _PENDING.append((event, objects))


# ----------------------------------------------------------------------------
# DLPack capsules, read and relabelled in place (for bfloat16, which CuPy lacks)
# ----------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):  # capsule "dltensor" (DLPack < 1.0)
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):  # capsule "dltensor_versioned" (>= 1.0)
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


@functools.cache
def _capsule_api():
    api = ctypes.pythonapi
    api.PyCapsule_IsValid.restype = ctypes.c_int
    api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return api


def _dltensor(capsule):
    """The DLTensor inside an unconsumed DLPack capsule (a view of its memory)."""
    api = _capsule_api()
    for name, struct in ((b"dltensor", _DLManagedTensor),
                         (b"dltensor_versioned", _DLManagedTensorVersioned)):
        if api.PyCapsule_IsValid(capsule, name):
            return struct.from_address(api.PyCapsule_GetPointer(capsule, name)).dl_tensor
    raise BufferError("not an unconsumed DLPack capsule")


def capsule_info(capsule):
    """``(ptr, shape, strides, (device_type, device_id), (code, bits, lanes))`` of a capsule.

    ``ptr`` includes the byte offset; ``strides`` are in elements (C order when
    the capsule gives none).
    """
    t = _dltensor(capsule)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = (tuple(t.strides[i] for i in range(t.ndim)) if t.strides
               else c_strides(shape))
    ptr = (t.data or 0) + t.byte_offset
    return (ptr, shape, strides, (t.device.device_type, t.device.device_id),
            (t.dtype.code, t.dtype.bits, t.dtype.lanes))


def relabel_capsule(capsule, code, bits):
    """Change the element type a capsule declares (same size), in place."""
    t = _dltensor(capsule)
    if t.dtype.bits != bits or t.dtype.lanes != 1:
        raise BufferError(f"cannot relabel {t.dtype.bits}-bit data as {bits}-bit")
    t.dtype.code = code


def c_strides(shape):
    """C-order strides, in elements."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def cupy_from_pointer(cupy, ptr, shape, dtype, strides, owner, device_id):
    """A CuPy array over device memory it does not own; ``owner`` is kept alive with it.

    ``strides`` in elements (non-negative).  No copy, no synchronisation.
    """
    dtype = np.dtype(dtype)
    if any(n == 0 for n in shape):
        with cupy.cuda.Device(device_id):
            return cupy.empty(shape, dtype)
    if any(s < 0 for s in strides):
        raise BufferError("negative strides are not supported")
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    memory = cupy.cuda.UnownedMemory(ptr, extent * dtype.itemsize, owner, device_id)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0),
                        tuple(s * dtype.itemsize for s in strides))


def cupy_from_capsule(cupy, capsule, dtype):
    """A CuPy array of ``dtype`` (same size as the capsule's type) over a CUDA capsule's data."""
    ptr, shape, strides, (device_type, device_id), (_, bits, lanes) = capsule_info(capsule)
    if device_type != DL_CUDA:
        raise BufferError(f"expected CUDA memory (DLPack device type {DL_CUDA}); "
                          f"got device type {device_type}")
    if bits != 8 * np.dtype(dtype).itemsize or lanes != 1:
        raise BufferError(f"cannot view {bits}-bit data as {np.dtype(dtype).name}")
    return cupy_from_pointer(cupy, ptr, shape, dtype, strides, capsule, device_id)


class AsBfloat16:
    """Hands out a CuPy 2-byte array's DLPack capsule declared as bfloat16 (no copy)."""

    __slots__ = ("_array",)

    def __init__(self, array):
        self._array = array

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        extra = {key: value for key, value in (("max_version", max_version),
                                                 ("dl_device", dl_device), ("copy", copy))
                 if value is not None}
        capsule = self._array.__dlpack__(stream=stream, **extra)
        relabel_capsule(capsule, DL_BFLOAT, 16)
        return capsule


def _is_storage(a):
    """A 2-byte integer array: bfloat16 bits on their way out."""
    return a.dtype.itemsize == 2 and a.dtype.kind in "iu"


# ----------------------------------------------------------------------------
# torch
# ----------------------------------------------------------------------------


def _run_torch(fn_name, fn, names, arrays):
    torch = sys.modules["torch"]
    _check_same(fn_name, names, [str(x.dtype).removeprefix("torch.") for x in arrays],
                "dtype", TypeError)
    _check_same(fn_name, names, [str(x.device) for x in arrays], "device", ValueError)
    q = arrays[names.index("q")]
    bf16 = q.dtype == torch.bfloat16
    arrays = [x.detach() for x in arrays]  # DLPack refuses tensors that require grad
    if q.device.type == "cpu":
        views = [torch_to_numpy(x) for x in arrays]
        return _map(fn(*views), numpy_to_torch)
    if q.device.type != "cuda":
        fail(ValueError, fn_name, f"q must be on a CUDA device or the CPU; got {q.device}.")
    cupy = _import_cupy(fn_name, "torch.Tensor")
    with cupy.cuda.Device(q.device.index), \
            use_stream(cupy, torch.cuda.current_stream(q.device).cuda_stream):
        views = [_torch_to_cupy(torch, cupy, x) for x in arrays]
        result = fn(*views, **({"dtype": "bfloat16"} if bf16 else {}))

        def back(a):
            t = torch.from_dlpack(a)
            return t.view(torch.bfloat16) if bf16 and _is_storage(a) else t

        return _map(result, back)


def _torch_to_cupy(torch, cupy, x):
    """A CuPy view of a CUDA tensor (DLPack, its strides kept: no copy); bfloat16 as
    int16 storage, bool through uint8 (whatever DLPack type code torch gives bool)."""
    if x.dtype == torch.bfloat16:
        return cupy.from_dlpack(x.view(torch.int16))
    if x.dtype == torch.bool:
        return cupy.from_dlpack(x.view(torch.uint8)).view(cupy.bool_)
    return cupy.from_dlpack(x)


def torch_to_numpy(x):
    """A NumPy view of a CPU tensor (bfloat16 as ml_dtypes.bfloat16)."""
    torch = sys.modules["torch"]
    x = x.detach()
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def numpy_to_torch(a):
    """A CPU tensor over a NumPy array's memory (ml_dtypes.bfloat16 -> torch.bfloat16)."""
    torch = sys.modules["torch"]
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# ----------------------------------------------------------------------------
# JAX
# ----------------------------------------------------------------------------


def _jax_device(fn_name, name, x):
    devices = x.devices()
    if len(devices) != 1:
        fail(ValueError, fn_name,
             f"{name} must be on a single device; got an array sharded over "
             f"{len(devices)} devices.")
    (device,) = devices
    return device


def _jax_device_label(device):
    if device.platform == "cpu":
        return "cpu"
    if device.platform in ("gpu", "cuda"):
        return f"cuda:{device.local_hardware_id}"
    return f"{device.platform}:{device.id}"


def _run_jax(fn_name, fn, names, arrays):
    jax = sys.modules["jax"]
    for name, x in zip(names, arrays):
        if isinstance(x, jax.core.Tracer):
            fail(TypeError, fn_name,
                 f"{name} must be a concrete jax.Array, not a tracer (inside jax.jit, grad or "
                 f"vmap there is no data to hand over; use cupyflash.jax.flash_attention); "
                 f"got {_type_name(x)}.")
    devices = [_jax_device(fn_name, name, x) for name, x in zip(names, arrays)]
    _check_same(fn_name, names, [x.dtype.name for x in arrays], "dtype", TypeError)
    _check_same(fn_name, names, [_jax_device_label(d) for d in devices], "device", ValueError)
    qi = names.index("q")
    device = devices[qi]
    bf16 = arrays[qi].dtype.name == "bfloat16"
    if device.platform == "cpu":
        views = [np.asarray(x) for x in arrays]
        return _map(fn(*views), lambda a: jax.device_put(a, device))
    if device.platform not in ("gpu", "cuda"):
        fail(ValueError, fn_name, f"q must be on a CUDA GPU or the CPU; got {device}.")
    cupy = _import_cupy(fn_name, "jax.Array")
    from jax import dlpack as jax_dlpack

    with cupy.cuda.Device(device.local_hardware_id):
        views = [_jax_to_cupy(cupy, x) for x in arrays]
        result = fn(*views, **({"dtype": "bfloat16"} if bf16 else {}))
        _retain(cupy, views)  # the views hold JAX's external references to the buffers

        def back(a):
            # Both ways share a's memory; JAX's stream waits for ours (DLPack stream=).
            return jax_dlpack.from_dlpack(AsBfloat16(a) if bf16 and _is_storage(a) else a)

        return _map(result, back)


def _jax_to_cupy(cupy, x):
    name = x.dtype.name
    if name not in ("bfloat16", "bool"):
        return cupy.from_dlpack(x)  # passes CuPy's current stream to x.__dlpack__
    # bfloat16 as uint16 storage; bool straight from the capsule (8-bit), whatever
    # DLPack type code the exporter gives it
    capsule = x.__dlpack__(stream=_dlpack_stream(cupy))  # orders our stream after x's producer
    return cupy_from_capsule(cupy, capsule, np.uint16 if name == "bfloat16" else np.bool_)


# ----------------------------------------------------------------------------
# Anything else with __cuda_array_interface__ or __dlpack__
# ----------------------------------------------------------------------------


def _run_other(fn_name, fn, names, arrays):
    views = []
    for name, x in zip(names, arrays):
        if hasattr(x, "__cuda_array_interface__"):
            views.append(_import_cupy(fn_name, _type_name(x)).asarray(x))  # syncs on its stream
            continue
        device_type = int(x.__dlpack_device__()[0])
        if device_type not in _DL_VIEWED:
            fail(TypeError, fn_name,
                 f"{name} must be in CPU or CUDA memory (DLPack device type 1 or 2); got a "
                 f"{_type_name(x)} on DLPack device type {device_type} "
                 f"({_DL_DEVICE_NAMES.get(device_type, 'unknown')}).")
        if device_type == DL_CPU:
            views.append(np.from_dlpack(x))
        else:
            views.append(_import_cupy(fn_name, _type_name(x)).from_dlpack(x))
    labels = ["cpu" if isinstance(x, np.ndarray) else f"cuda:{x.device.id}" for x in views]
    _check_same(fn_name, names, labels, "device", ValueError)
    q = views[names.index("q")]
    if isinstance(q, np.ndarray):
        return fn(*views)
    cupy = sys.modules["cupy"]
    with q.device:
        result = fn(*views)
        _retain(cupy, views)
    return result
