"""Argument validation for the public functions.

Every rule raises TypeError, ValueError or NotImplementedError (never assert)
with a message of one form::

    cupyflash.flash_attn_fwd: k must have the same dtype as q (float16); got bfloat16.

that is: the function, the argument, the rule, and what was given.  Checks are a
handful of attribute reads so that the per-call overhead stays small.  CuPy is
never imported here: an array is a CuPy array only if ``cupy`` is already in
``sys.modules`` and the array is an instance of ``cupy.ndarray``.
"""

from __future__ import annotations

import math
import numbers
import sys

import numpy as np

from . import _rng

#: dtypes the NumPy (CPU) path takes, by ``dtype.name``.  "bfloat16" is ml_dtypes'
#: (an array can only have it when ml_dtypes is importable).
CPU_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: element types the CuPy (GPU) path computes in.  CuPy has no bfloat16 dtype, so
#: bfloat16 data arrives as 2-byte integer storage (GPU_STORAGE_DTYPES) with
#: ``dtype="bfloat16"`` passed explicitly to the public functions.
GPU_DTYPES = ("float16", "bfloat16")
#: cupy dtypes that may hold GPU_DTYPES data when ``dtype=`` names the element type.
GPU_STORAGE_DTYPES = ("uint16", "int16")
MAX_HEAD_DIM = 256
#: The kernels (and the CPU path) use ``softmax_scale`` and ``softmax_scale * log2(e)``
#: as float32: outside this range one of them rounds to 0 or overflows, and every
#: output would be NaN.  The bounds are the smallest float32 subnormal and the
#: largest scale whose product with log2(e) is a finite float32.
MIN_SOFTMAX_SCALE = 2.0**-149
MAX_SOFTMAX_SCALE = float(np.finfo(np.float32).max) / 1.4426950408889634


def fail(cls, fn, message):
    """Raise ``cls`` with the ``cupyflash.<fn>: <message>`` form."""
    raise cls(f"cupyflash.{fn}: {message}")


def _is_gpu_array(x):
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def _kind(x):
    """'numpy', 'cupy' or None for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if _is_gpu_array(x):
        return "cupy"
    return None


def _type_name(x):
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def _device_name(x):
    return f"cuda:{x.device.id}"


def check_flags(fn, softmax_scale, head_dim, causal, deterministic=False):
    """Validate the keyword arguments; return the resolved softmax scale (float)."""
    if not isinstance(causal, (bool, np.bool_)):
        fail(TypeError, fn, f"causal must be a bool; got {_type_name(causal)}.")
    if not isinstance(deterministic, (bool, np.bool_)):
        fail(TypeError, fn, f"deterministic must be a bool; got {_type_name(deterministic)}.")
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        fail(TypeError, fn,
             f"softmax_scale must be a real number or None; got {_type_name(softmax_scale)}.")
    try:
        scale = float(softmax_scale)
    except OverflowError:  # a huge int or Fraction
        fail(ValueError, fn,
             f"softmax_scale must be finite and > 0; got a {_type_name(softmax_scale)} too large "
             f"for a float.")
    if not (math.isfinite(scale) and scale > 0):
        fail(ValueError, fn, f"softmax_scale must be finite and > 0; got {scale!r}.")
    if not MIN_SOFTMAX_SCALE <= scale <= MAX_SOFTMAX_SCALE:
        fail(ValueError, fn,
             f"softmax_scale must be between {MIN_SOFTMAX_SCALE:.2g} and "
             f"{MAX_SOFTMAX_SCALE:.3g} (it is used in float32); got {scale!r}.")
    return scale


def dtype_desc(dtype):
    """``dtype.name``, prefixed with the byte order when it is not the machine's."""
    if dtype.isnative:
        return dtype.name
    return f"{'big' if dtype.byteorder == '>' else 'little'}-endian {dtype.name}"


def _is_masked(x):
    ma = sys.modules.get("numpy.ma")  # no masked array exists unless numpy.ma was imported
    return ma is not None and isinstance(x, ma.MaskedArray)


#: The layouts the validators take: a dense batch and a packed (varlen) one.
_DENSE_LAYOUT = "(batch, seqlen, nheads, head_dim)"
_PACKED_LAYOUTS = {"q": "(total_q, nheads, head_dim)", "k": "(total_k, nheads_kv, head_dim)",
                   "v": "(total_k, nheads_kv, head_dim)", "dout": "(total_q, nheads, head_dim)",
                   "out": "(total_q, nheads, head_dim)"}


def _check_array(fn, name, x, kind, ref_name, rank=4):
    """Array type (the same side as ``ref_name``) and, unless ``rank`` is None, the
    rank of a dense (4) or packed (3) layout."""
    got = _kind(x)
    if got is None:
        fail(TypeError, fn, f"{name} must be a numpy.ndarray or cupy.ndarray; got {_type_name(x)}.")
    if got == "numpy" and _is_masked(x):
        fail(TypeError, fn,
             f"{name} must not be a numpy.ma.MaskedArray (its mask would be ignored); pass "
             f"{name}.filled(value) or {name}.data.")
    if got != kind:
        fail(TypeError, fn,
             f"{name} must be a {kind}.ndarray like {ref_name} (numpy and cupy inputs cannot be "
             f"mixed); got {got}.ndarray.")
    if rank is not None and x.ndim != rank:
        layout = _DENSE_LAYOUT if rank == 4 else _PACKED_LAYOUTS[name]
        fail(ValueError, fn,
             f"{name} must have {rank} dimensions {layout}; got {x.ndim} with shape {tuple(x.shape)}.")


def _check_last_stride(fn, name, x, what="head_dim"):
    """A unit last stride; on the GPU, every stride in whole elements too (the kernels
    take strides in elements: a byte stride that is not a multiple of the itemsize
    would be truncated, or address misaligned elements)."""
    if x.shape[-1] > 1 and x.strides[-1] != x.itemsize and x.size > 0:
        fail(ValueError, fn,
             f"{name} must have unit stride in its last dimension ({what}); "
             f"got a stride of {x.strides[-1] / x.itemsize:g} elements.")
    if x.size > 1 and _is_gpu_array(x) and any(s % x.itemsize for n, s in zip(x.shape, x.strides) if n > 1):
        fail(ValueError, fn,
             f"{name} must have strides in whole elements on the GPU (multiples of {x.itemsize} "
             f"bytes); got strides of {tuple(x.strides)} bytes.")


def _check_device(fn, name, x, q):
    if x.device.id != q.device.id:
        fail(ValueError, fn,
             f"{name} must be on the same device as q ({_device_name(q)}); got {_device_name(x)}.")


def dtype_name(fn, dtype):
    """The name of a ``dtype=`` argument (a str, or anything ``numpy.dtype`` takes):
    NumPy's name for it (``'f2'`` and ``'half'`` are ``'float16'``), or the str
    itself when NumPy does not know it (``'bfloat16'`` without ml_dtypes)."""
    if isinstance(dtype, str):
        try:
            return np.dtype(dtype).name
        except TypeError:
            return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        fail(TypeError, fn,
             f"dtype must be None or a dtype name such as 'bfloat16'; got {_type_name(dtype)}.")


def _check_dtype(fn, q, kind, dtype=None):
    name = q.dtype.name
    if dtype is not None:
        given = dtype_name(fn, dtype)
        if given == name:  # names what q already is: nothing to reinterpret
            return
        if kind != "cupy" or name not in GPU_STORAGE_DTYPES:
            fail(TypeError, fn,
                 f"dtype must be None or q's own dtype ({name}): dtype= only names the element "
                 f"type of uint16/int16 storage in cupy arrays (use ml_dtypes.bfloat16 for "
                 f"numpy); got {given!r}.")
        if given not in GPU_DTYPES:
            fail(TypeError, fn,
                 f"dtype must be 'float16' or 'bfloat16' for {name} storage; got {given!r}.")
        return
    if kind == "numpy":
        if name not in CPU_DTYPES:
            fail(TypeError, fn,
                 f"q must have dtype float16, bfloat16 (ml_dtypes), float32 or float64 on the "
                 f"CPU path (numpy arrays); got {name}.")
    elif name not in GPU_DTYPES:
        hint = (" (for bfloat16 data held as uint16/int16, pass dtype='bfloat16')"
                if name in GPU_STORAGE_DTYPES else "")
        fail(TypeError, fn,
             f"q must have dtype float16 or bfloat16 on the GPU path (cupy arrays: bfloat16 as "
             f"uint16/int16 storage with dtype='bfloat16'); got {name}{hint}.")


def check_qkv(fn, q, k, v, dtype=None, packed=False, names=("k", "v"), same_batch=True):
    """Validate q, k, v (and ``dtype=``); return True for CuPy (GPU) inputs, False for NumPy.

    Dense layout ``(batch, seqlen, nheads, head_dim)``, or with ``packed`` the
    varlen layout ``(total, nheads, head_dim)`` (no batch axis).  ``names`` are
    k's and v's names in the messages (``("k_cache", "v_cache")`` for a KV
    cache); without ``same_batch`` their batch axis may differ from q's (a
    cache's rows or pages).
    """
    kind = _kind(q)
    rank = 3 if packed else 4
    kn, vn = names
    for name, x in (("q", q), (kn, k), (vn, v)):
        _check_array(fn, name, x, kind, "q", rank)
    _check_dtype(fn, q, kind, dtype)
    for name, x in ((kn, k), (vn, v)):
        if x.dtype != q.dtype:
            fail(TypeError, fn,
                 f"{name} must have the same dtype as q ({dtype_desc(q.dtype)}); "
                 f"got {dtype_desc(x.dtype)}.")
    seq_axis, nheads, head_dim = rank - 3, q.shape[-2], q.shape[-1]
    for name, x in ((kn, k), (vn, v)):
        if same_batch and not packed and x.shape[0] != q.shape[0]:
            fail(ValueError, fn,
                 f"{name} must have the same batch size as q ({q.shape[0]}); got {x.shape[0]}.")
        if x.shape[-1] != head_dim:
            fail(ValueError, fn,
                 f"{name} must have the same head_dim as q ({head_dim}); got {x.shape[-1]}.")
    if not same_batch and v.shape[0] != k.shape[0]:
        fail(ValueError, fn,
             f"{vn} must have the same dimension 0 as {kn} ({k.shape[0]}); got {v.shape[0]}.")
    if v.shape[seq_axis] != k.shape[seq_axis]:
        what = "total_k" if packed else "seqlen"
        fail(ValueError, fn,
             f"{vn} must have the same {what} as {kn} ({k.shape[seq_axis]}); "
             f"got {v.shape[seq_axis]}.")
    if v.shape[-2] != k.shape[-2]:
        fail(ValueError, fn,
             f"{vn} must have the same nheads as {kn} ({k.shape[-2]}); got {v.shape[-2]}.")
    nheads_kv = k.shape[-2]
    if (nheads_kv == 0 and nheads > 0) or (nheads_kv > 0 and nheads % nheads_kv):
        fail(ValueError, fn,
             f"{kn} must have a number of heads that divides q's ({nheads}); got {nheads_kv}.")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        fail(ValueError, fn,
             f"q must have head_dim between 1 and {MAX_HEAD_DIM}; got {head_dim}.")
    for name, x in (("q", q), (kn, k), (vn, v)):
        _check_last_stride(fn, name, x)
    if kind == "cupy":
        _check_device(fn, kn, k, q)
        _check_device(fn, vn, v, q)
    return kind == "cupy"


def check_like(fn, name, x, like, like_name="q"):
    """``x`` (dout, out, or a preallocated output) has the shape and dtype of
    ``like`` (the input named ``like_name``) and a unit last stride."""
    if tuple(x.shape) != tuple(like.shape):
        fail(ValueError, fn,
             f"{name} must have the same shape as {like_name} {tuple(like.shape)}; got {tuple(x.shape)}.")
    if x.dtype != like.dtype:
        fail(TypeError, fn,
             f"{name} must have the same dtype as {like_name} ({dtype_desc(like.dtype)}); "
             f"got {dtype_desc(x.dtype)}.")
    _check_last_stride(fn, name, x)


def lse_shape(q, packed=False):
    """The shape of q's lse: ``(batch, nheads_q, seqlen_q)``, packed ``(nheads_q, total_q)``."""
    return (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])


def _check_lse(fn, name, lse, q, kind, packed):
    _check_array(fn, name, lse, kind, "q", rank=None)  # its shape is checked below
    shape = lse_shape(q, packed)
    if tuple(lse.shape) != shape:
        layout = "(nheads_q, total_q)" if packed else "(batch, nheads_q, seqlen_q)"
        fail(ValueError, fn, f"{name} must have shape {layout} = {shape}; got {tuple(lse.shape)}.")
    if lse.dtype != np.float32:
        fail(TypeError, fn, f"{name} must have dtype float32; got {dtype_desc(lse.dtype)}.")
    _check_last_stride(fn, name, lse, "total_q" if packed else "seqlen_q")


def check_bwd_extras(fn, dout, out, lse, q, packed=False):
    """Validate the backward's dout, out and lse against a validated q."""
    kind = _kind(q)
    for name, x in (("dout", dout), ("out", out)):
        _check_array(fn, name, x, kind, "q", 3 if packed else 4)
        check_like(fn, name, x, q)
    _check_lse(fn, "lse", lse, q, kind, packed)
    if kind == "cupy":
        for name, x in (("dout", dout), ("out", out), ("lse", lse)):
            _check_device(fn, name, x, q)


#: The input each preallocated gradient is like.
_OUTPUT_OF = {"dk": "k", "dv": "v"}


def check_outputs(fn, q, outputs):
    """Validate preallocated outputs against a validated q: ``outputs`` maps each
    given name (``out``/``lse`` of the forward, ``dq``/``dk``/``dv`` of the
    backward) to ``(array, like)``, ``like`` being the input whose shape and dtype
    it must have (q for out and dq, k for dk, v for dv; None for ``lse``).  Any
    strides with a unit last stride."""
    kind = _kind(q)
    for name, (x, like) in outputs.items():
        if x is None:
            continue
        if like is None:
            _check_lse(fn, name, x, q, kind, packed=False)
        else:
            _check_array(fn, name, x, kind, "q", rank=None)
            check_like(fn, name, x, like, _OUTPUT_OF.get(name, "q"))
        _check_no_repeats(fn, name, x)
        if kind == "cupy":
            _check_device(fn, name, x, q)


def _check_no_repeats(fn, name, x):
    """An output must not be a broadcast view: a zero stride on an axis of length > 1
    makes several of its elements one memory location, which cannot hold them all
    (the GPU kernels would race on it).  A function of shape and strides only, so the
    hot path's call signature covers it."""
    for n, s in zip(x.shape, x.strides):
        if s == 0 and n > 1:
            strides = tuple(t // x.itemsize for t in x.strides)
            fail(ValueError, fn,
                 f"{name} must not be a broadcast view (a zero stride on an axis of length > 1: its "
                 f"elements overlap); got shape {tuple(x.shape)} with strides {strides} elements.")


def check_numpy_outputs(fn, outputs):
    """Per call, before anything is computed: the preallocated NumPy outputs (``(name,
    array)`` pairs, None for one not given) are writeable and share no memory with each
    other.  Both depend on more than the call signature (the flag, the pointers), so the
    CPU entries of the hot path check them on every call that passes outputs."""
    given = [(name, x) for name, x in outputs if x is not None]
    for i, (name, x) in enumerate(given):
        if not x.flags.writeable:
            fail(ValueError, fn, f"{name} must be writeable; got a read-only array.")
        for other, y in given[:i]:
            if np.shares_memory(x, y):
                fail(ValueError, fn, f"{name} must not overlap {other} in memory; got arrays that share memory.")


#: flash-attention's arguments that cupyflash does not implement yet, with the
#: value that means "off" (the only one taken).
NOT_IMPLEMENTED = {"dropout_p": 0.0, "window_size": (-1, -1), "alibi_slopes": None, "softcap": 0.0}


def _is_off(value, off):
    """``value`` is the option's "off" value (None: is None; else equal to it, as a bool:
    an array, whose comparison has no single truth value, is not off)."""
    if off is None:
        return value is None
    try:
        return bool(value == off)
    except Exception:  # noqa: BLE001 (an array's ambiguous truth value, a failing __eq__)
        return False


def check_implemented(fn, dropout_p=0.0, window_size=(-1, -1), alibi_slopes=None, softcap=0.0):
    """Check the form of flash-attention's variant options (issue 13), then raise
    NotImplementedError naming the first that is on.

    Every public function runs this on any option given (dense, varlen, torch), so
    a value is taken or refused alike everywhere: a malformed value gets a
    TypeError/ValueError with the rule, a well-formed one that is not off the
    NotImplementedError (the kernels do not implement it yet)."""
    window = _check_option_forms(fn, dropout_p, window_size, alibi_slopes, softcap)
    for name, value, off in (("dropout_p", dropout_p, 0.0), ("window_size", window, (-1, -1)),
                             ("alibi_slopes", alibi_slopes, None), ("softcap", softcap, 0.0)):
        if not _is_off(value, off):
            shown = _type_name(value) if name == "alibi_slopes" else repr(value)
            fail(NotImplementedError, fn,
                 f"{name} must be {off!r} ({name} is not implemented yet); got {shown}.")


def _is_real(x) -> bool:
    """A real scalar other than a bool."""
    if isinstance(x, (bool, np.bool_)):
        return False
    return isinstance(x, numbers.Real) and not hasattr(x, "ndim") or isinstance(x, np.floating | np.integer)


#: softcap's range: scale / softcap and softcap * log2(e) stay finite in float32.
SOFTCAP_RANGE = (1e-30, 1e30)
#: window_size entries are key offsets: at most int32.
WINDOW_MAX = 2**31 - 1
#: The largest dropout_p: the keep decision is a 16-bit comparison (cupyflash._philox).
DROPOUT_MAX = 1.0 - 2.0**-16
F32_MAX = float(np.finfo(np.float32).max)
#: alibi_slopes and sinks in magnitude: value * log2(e) stays finite in float32.
VARIANT_VALUE_MAX = 1e30


def _check_option_forms(fn, dropout_p, window_size, alibi_slopes, softcap):
    """The rules of issue 13's options; returns ``window_size`` as a tuple of two ints."""
    if not _is_real(dropout_p):
        fail(TypeError, fn, f"dropout_p must be a float in [0, 1); got {_type_name(dropout_p)}.")
    if not 0.0 <= float(dropout_p) < 1.0:
        fail(ValueError, fn, f"dropout_p must be in [0, 1); got {float(dropout_p)!r}.")
    if float(dropout_p) > DROPOUT_MAX:
        fail(ValueError, fn, f"dropout_p must be at most 1 - 2**-16 (the keep decision compares 16-bit "
                             f"half-words: a smaller keep fraction cannot be drawn); got {float(dropout_p)!r}.")
    if not _is_real(softcap):
        fail(TypeError, fn, f"softcap must be a float >= 0 (0: off); got {_type_name(softcap)}.")
    if not (math.isfinite(float(softcap)) and float(softcap) >= 0.0):
        fail(ValueError, fn, f"softcap must be finite and >= 0 (0: off); got {float(softcap)!r}.")
    low, high = SOFTCAP_RANGE
    if float(softcap) != 0.0 and not low <= float(softcap) <= high:
        fail(ValueError, fn, f"softcap must be 0 (off) or in [{low:g}, {high:g}] (float32 range for the "
                             f"scores' scale / softcap); got {float(softcap)!r}.")
    if alibi_slopes is not None and not (hasattr(alibi_slopes, "shape") and hasattr(alibi_slopes, "dtype")):
        fail(TypeError, fn,
             f"alibi_slopes must be None or a float32 array of shape (nheads_q,) or (batch, nheads_q); "
             f"got {_type_name(alibi_slopes)}.")
    if not isinstance(window_size, (tuple, list, np.ndarray)):
        window = None
    else:
        try:
            window = tuple(window_size)
        except TypeError:
            window = None
    if window is None:
        fail(TypeError, fn,
             f"window_size must be a pair of ints (left, right), -1 for unbounded; got "
             f"{_type_name(window_size)}.")
    if len(window) != 2:
        fail(ValueError, fn,
             f"window_size must have two entries (left, right); got {len(window)}: {window!r}.")
    for side, w in zip(("left", "right"), window):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
            fail(TypeError, fn, f"window_size's {side} entry must be an int (-1: unbounded); got "
                                f"{_type_name(w)}.")
        if not -1 <= int(w) <= WINDOW_MAX:
            fail(ValueError, fn, f"window_size's {side} entry must be in [-1, 2**31 - 1] (-1: unbounded); got "
                                 f"{int(w)}.")
    return tuple(int(w) for w in window)


def check_variants(fn, q, gpu, dropout_p, window_size, alibi_slopes, softcap, sinks, rng_state, *,
                   batch=None, softmax_scale=None, attn_bias=None, attn_mask=None, return_dbias=False,
                   seqlens=None, draw_rng=False, rng_rule=None, key_capacity=None):
    """The variant options of a validated call (issues 13 and 14): their forms, and the
    arrays against ``q``.  Returns the keyword arguments of the options that are on
    (those of ``cupyflash.cpu.fwd``/``bwd``; the GPU path takes the same), empty
    when every option is off.

    ``q`` is dense ``(batch, seqlen, nheads, head_dim)``; or, with ``batch`` (the
    number of sequences, ``len(cu_seqlens) - 1``), packed ``(total, nheads,
    head_dim)`` as in the varlen functions.  ``softmax_scale`` (the call's, checked):
    ``softmax_scale / softcap`` must be finite in float32.

    ``attn_bias`` / ``attn_mask`` (issue 14) are checked by :func:`check_score_arrays`
    against ``seqlens = (seqlen_q, seqlen_k)`` (dense: q's and k's; varlen:
    ``max_seqlen_q``, ``max_seqlen_k``), which must then be given; the options hold
    them as 4-D views (``options["attn_bias"]``, ``options["attn_mask"]``).
    ``key_capacity`` (a KV cache's): the key dimension's rule is check_score_arrays'.
    ``return_dbias`` (the backward's) must be a bool, and True only with
    ``attn_bias``: ``options["return_dbias"] = True`` then.

    ``rng_state`` None with ``dropout_p > 0``: with ``draw_rng`` (a forward) a
    state is drawn from the library generator (:func:`._rng.next_rng_state`,
    once every other check has passed), otherwise (a backward) a TypeError
    naming ``rng_state``, whose reason is ``rng_rule`` when given."""
    window = _check_option_forms(fn, dropout_p, window_size, alibi_slopes, softcap)
    if softmax_scale is not None and float(softcap) > 0 and not float(softmax_scale) / float(softcap) < F32_MAX:
        fail(ValueError, fn, f"softmax_scale / softcap must be finite in float32 (below {F32_MAX:.3g}); got "
                             f"{float(softmax_scale)!r} / {float(softcap)!r}.")
    packed = batch is not None
    batch, nheads = (q.shape[0], q.shape[2]) if batch is None else (batch, q.shape[1])
    kind = _kind(q)
    for name, x, shapes in (("alibi_slopes", alibi_slopes, ((nheads,), (batch, nheads))),
                            ("sinks", sinks, ((nheads,),))):
        if x is None:
            continue
        _check_array(fn, name, x, kind, "q", rank=None)
        if x.dtype != np.float32:
            fail(TypeError, fn, f"{name} must have dtype float32; got {dtype_desc(x.dtype)}.")
        if tuple(x.shape) not in shapes:
            shown = " or ".join(str(s) for s in shapes)
            fail(ValueError, fn, f"{name} must have shape {shown} (q's nheads_q = {nheads}"
                                 f"{f', batch = {batch}' if len(shapes) > 1 else ''}); got {tuple(x.shape)}.")
        if kind == "cupy":
            _check_device(fn, name, x, q)
        elif (np.isnan(x).any() or np.isposinf(x).any()) or (name == "alibi_slopes" and not np.isfinite(x).all()):
            rule = "finite" if name == "alibi_slopes" else "finite or -inf (no sink)"
            fail(ValueError, fn, f"{name} must be {rule}; got a NaN or infinite value.")
        elif x.size and np.abs(x[np.isfinite(x)], dtype=np.float64).max(initial=0.0) > VARIANT_VALUE_MAX:
            fail(ValueError, fn, f"{name} must be at most {VARIANT_VALUE_MAX:g} in magnitude (its value * log2(e) "
                                 f"is a float32 in the kernels); got {float(np.abs(x[np.isfinite(x)]).max())!r}.")
    if rng_state is not None:
        # a sequence of two, as window_size: not a dict (keys), a set (no order), a
        # generator (consumed) or bytes/str (characters)
        sequence = isinstance(rng_state, (tuple, list)) or (isinstance(rng_state, np.ndarray)
                                                             and rng_state.ndim == 1)
        if not sequence or len(rng_state) != 2:
            fail(TypeError, fn, f"rng_state must be None or a pair of ints (seed, offset); got "
                                f"{_type_name(rng_state)}" + (f" of length {len(rng_state)}." if sequence else "."))
        seed, offset = rng_state = tuple(rng_state)
        for part, value, bits in (("seed", seed, 64), ("offset", offset, 32)):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                fail(TypeError, fn, f"rng_state's {part} must be an int; got {_type_name(value)}.")
            if not 0 <= int(value) < 2**bits:
                fail(ValueError, fn, f"rng_state's {part} must be in [0, 2**{bits}); got {int(value)}.")
    dropout = float(dropout_p) > 0
    if dropout and rng_state is None and not draw_rng:
        fail(TypeError, fn, "rng_state=(seed, offset) must be given with dropout_p > 0 (" + (rng_rule or (
            "the state the forward used, which draws the mask again: pass return_rng_state=True to the "
            "forward to get it")) + "); got None.")
    options = {}
    if dropout and rng_state is not None:
        options.update(dropout_p=float(dropout_p), rng_state=(int(rng_state[0]), int(rng_state[1])))
    if window != (-1, -1):
        options["window_size"] = window
    if float(softcap) > 0:
        options["softcap"] = float(softcap)
    if alibi_slopes is not None:
        options["alibi_slopes"] = alibi_slopes
    if sinks is not None:
        options["sinks"] = sinks
    if attn_bias is not None or attn_mask is not None or return_dbias is not False:
        options.update(check_score_arrays(fn, q, nheads=nheads, batch=batch, seqlens=seqlens, attn_bias=attn_bias,
                                          attn_mask=attn_mask, return_dbias=return_dbias, packed=packed,
                                          key_capacity=key_capacity))
    if dropout and rng_state is None:  # a forward's own state: drawn last, once the call is known good
        options = dict(dropout_p=float(dropout_p), rng_state=_rng.next_rng_state(), **options)
    return options


def check_return_rng_state(fn, return_rng_state):
    """``return_rng_state`` (the forwards') is a bool."""
    if not isinstance(return_rng_state, (bool, np.bool_)):
        fail(TypeError, fn, f"return_rng_state must be a bool; got {_type_name(return_rng_state)}.")
    return bool(return_rng_state)


#: The shape a bias or mask broadcasts to, as its messages name it: dense, and varlen.
SCORE_LAYOUT = ("batch", "nheads_q", "seqlen_q", "seqlen_k")
PACKED_SCORE_LAYOUT = ("batch", "nheads_q", "max_seqlen_q", "max_seqlen_k")
#: ... against a KV cache (flash_attn_with_kvcache): keys by their position in the sequence.
CACHE_SCORE_LAYOUT = ("batch", "nheads_q", "seqlen_q", "key")


def pad4(x):
    """``x`` (rank <= 4) as a 4-D view, left-padded with size-1 dimensions
    (``x[None, ...]``: never a copy, never broadcast); ``x`` itself when 4-D."""
    return x if x.ndim == 4 else x[(None,) * (4 - x.ndim) + (Ellipsis,)]


def check_score_arrays(fn, q, batch, nheads, seqlens, attn_bias, attn_mask, return_dbias=False,
                       packed=False, key_capacity=None):
    """The options of ``attn_bias``, ``attn_mask`` and ``return_dbias`` (issue 14).

    Each array is a NumPy or CuPy array like ``q`` (and on its device) of rank at
    most 4, broadcastable to ``(batch, nheads_q, seqlen_q, seqlen_k)`` (``packed``:
    the varlen functions' ``(batch, nheads_q, max_seqlen_q, max_seqlen_k)``) with
    every dimension (after left-padding with 1s) either 1 or full; any strides (on
    the GPU, in whole elements).  The bias has q's dtype (on the GPU the storage dtype of
    bfloat16 data too) or float32; the mask is bool.  The values are not read:
    NaN and ``+inf`` in a bias propagate.  Returns ``{"attn_bias": 4-D view,
    "attn_mask": 4-D view, "return_dbias": True}``, each only when given (on).  ``attn_mask``
    may be a :class:`cupyflash.BlockMask`: its mask is checked as a plain one, and the
    options hold it too (``"block_mask"``), so that its block map is reused.

    ``key_capacity`` (flash_attn_with_kvcache: the cache's keys per sequence,
    ``seqlen_cache`` or ``max_blocks_per_seq * page_size``): the last dimension is
    indexed by a key's position in its sequence, and must be 1 or at least
    ``key_capacity`` (every key a sequence can see); ``seqlens[1]`` is not used."""
    kind = _kind(q)
    if not isinstance(return_dbias, (bool, np.bool_)):
        fail(TypeError, fn, f"return_dbias must be a bool; got {_type_name(return_dbias)}.")
    if return_dbias and attn_bias is None:
        fail(ValueError, fn, "return_dbias must be False without attn_bias (dbias is the gradient of "
                             "attn_bias); got True with attn_bias=None.")
    options = {}
    block_mask = None
    if attn_mask is not None and type(attn_mask).__name__ == "BlockMask":
        from ._blockmask import BlockMask  # noqa: PLC0415

        if isinstance(attn_mask, BlockMask):  # its map is reused (options["block_mask"])
            block_mask, attn_mask = attn_mask, attn_mask.mask
    if attn_bias is None and attn_mask is None:
        return options
    if seqlens is None:
        raise TypeError(f"check_score_arrays ({fn}): seqlens=(seqlen_q, seqlen_k) must be given with "
                        f"attn_bias or attn_mask")  # a caller's mistake, not the user's
    cache = key_capacity is not None
    full = (batch, nheads, int(seqlens[0]), int(key_capacity if cache else seqlens[1]))
    axes = CACHE_SCORE_LAYOUT if cache else PACKED_SCORE_LAYOUT if packed else SCORE_LAYOUT
    layout = "(" + ", ".join(axes) + ")"
    for name, x in (("attn_bias", attn_bias), ("attn_mask", attn_mask)):
        if x is None:
            continue
        _check_array(fn, name, x, kind, "q", rank=None)
        if name == "attn_mask" and x.dtype != np.bool_:
            fail(TypeError, fn, f"attn_mask must have dtype bool (True = attend; a float mask belongs in "
                                f"attn_bias); got {dtype_desc(x.dtype)}.")
        if name == "attn_bias" and x.dtype != q.dtype and x.dtype != np.float32:
            fail(TypeError, fn, f"attn_bias must have q's dtype ({dtype_desc(q.dtype)}) or float32; got "
                                f"{dtype_desc(x.dtype)}.")
        if x.ndim > 4:
            fail(ValueError, fn, f"{name} must have at most 4 dimensions, broadcastable to {layout}; "
                                 f"got {x.ndim} with shape {tuple(x.shape)}.")
        shape = (1,) * (4 - x.ndim) + tuple(x.shape)
        for what, n, want in zip(axes, shape, full):
            if cache and what == "key":
                if n != 1 and n < want:
                    fail(ValueError, fn,
                         f"{name} must have a last dimension (the key position in a sequence) of 1 or at least "
                         f"the cache's capacity ({want} keys per sequence), broadcastable to {layout}; got "
                         f"shape {tuple(x.shape)}, whose key dimension is {n}.")
                continue
            if n != 1 and n != want:
                shown = f"{layout} = ({full[0]}, {full[1]}, {full[2]}, >= {full[3]})" if cache else f"{layout} = {full}"
                fail(ValueError, fn,
                     f"{name} must be broadcastable to {shown}, each dimension 1 or full "
                     f"(left-padded with 1s to 4 dimensions); got shape {tuple(x.shape)}, whose {what} "
                     f"is {n}.")
        if kind == "cupy":
            if x.size > 1 and any(s % x.itemsize for n, s in zip(x.shape, x.strides) if n > 1):
                fail(ValueError, fn,
                     f"{name} must have strides in whole elements on the GPU (multiples of {x.itemsize} "
                     f"bytes); got strides of {tuple(x.strides)} bytes.")
            _check_device(fn, name, x, q)
        options[name] = pad4(x)
    if block_mask is not None:
        options["block_mask"] = block_mask
    if return_dbias:
        options["return_dbias"] = True
    return options


def is_empty(q, k):
    """True when there is nothing to compute (batch, seqlen or nheads is 0)."""
    return q.size == 0 or k.shape[1] == 0


def _zeros_module(q, gpu):
    return sys.modules["cupy"] if gpu else np


def empty_fwd(q, gpu):
    """``(out, lse)`` without calling a kernel: out zeros, lse -inf."""
    xp = _zeros_module(q, gpu)
    batch, seqlen_q, nheads, _ = q.shape
    if gpu:
        with q.device:
            return (xp.zeros(q.shape, dtype=q.dtype),
                    xp.full((batch, nheads, seqlen_q), -np.inf, dtype=np.float32))
    return (np.zeros(q.shape, dtype=q.dtype),
            np.full((batch, nheads, seqlen_q), -np.inf, dtype=np.float32))


def empty_bwd(q, k, v, gpu):
    """``(dq, dk, dv)`` without calling a kernel: all zeros."""
    xp = _zeros_module(q, gpu)
    if gpu:
        with q.device:
            return tuple(xp.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
    return tuple(np.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))


# ----------------------------------------------------------------------------
# KV cache (flash_attn_with_kvcache): the index arrays, page size and lengths
# ----------------------------------------------------------------------------

#: The GPU decode kernel reads a paged cache in tiles of this many keys: the page
#: size must be a multiple of it (the CPU path, the specification, takes the same).
PAGE_SIZE_MULTIPLE = 16


def check_bool(fn, name, value):
    if not isinstance(value, (bool, np.bool_)):
        fail(TypeError, fn, f"{name} must be a bool; got {_type_name(value)}.")


def check_num_splits(fn, num_splits):
    """An int >= 0 (0: choose automatically)."""
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral):
        fail(TypeError, fn,
             f"num_splits must be an int (0: automatic); got {_type_name(num_splits)}.")
    if int(num_splits) < 0:
        fail(ValueError, fn, f"num_splits must be >= 0 (0: automatic); got {int(num_splits)}.")


def check_index_array(fn, name, x, q, layout, batch):
    """An int32 array of q's kind (and device) whose shape is ``layout`` (a tuple of
    axis names, the first being ``batch``) with a unit last stride; returns its values
    as host int64 for NumPy, None for CuPy (they are not read)."""
    kind = _kind(q)
    _check_array(fn, name, x, kind, "q", rank=None)
    if x.dtype != np.int32:
        fail(TypeError, fn, f"{name} must have dtype int32; got {dtype_desc(x.dtype)}.")
    if x.ndim != len(layout) or x.shape[0] != batch:
        shown = "(" + ", ".join(layout) + ("," if len(layout) == 1 else "") + ")"
        fail(ValueError, fn,
             f"{name} must have shape {shown} with batch = {batch} (q's); got {tuple(x.shape)}.")
    _check_last_stride(fn, name, x, layout[-1])
    if kind == "cupy":
        _check_device(fn, name, x, q)
        return None
    return x.astype(np.int64)


def check_cache_seqlens(fn, cache_seqlens, q):
    """``cache_seqlens``: None, an int >= 0, or an int32 (batch,) array of q's kind.

    Returns host int64 values, shape (batch,), or None when they live on the GPU
    (or when cache_seqlens is None: the whole cache)."""
    if cache_seqlens is None:
        return None
    batch = q.shape[0]
    if _kind(cache_seqlens) is None and isinstance(cache_seqlens, numbers.Integral) \
            and not isinstance(cache_seqlens, (bool, np.bool_)):
        if not -2**31 <= int(cache_seqlens) < 2**31:
            fail(ValueError, fn,
                 f"cache_seqlens must fit in int32; got {int(cache_seqlens)}.")
        if batch == 0 and int(cache_seqlens) < 0:  # an empty batch has no values to check it by
            fail(ValueError, fn, f"cache_seqlens must be >= 0; got {int(cache_seqlens)}.")
        values = np.full(batch, int(cache_seqlens), dtype=np.int64)
    else:
        if _kind(cache_seqlens) is None:
            fail(TypeError, fn,
                 f"cache_seqlens must be None, an int or an int32 array of shape (batch,) like "
                 f"q; got {_type_name(cache_seqlens)}.")
        values = check_index_array(fn, "cache_seqlens", cache_seqlens, q, ("batch",), batch)
        if values is None:
            return None
    if values.size and values.min() < 0:
        b = int(np.argmin(values))
        fail(ValueError, fn,
             f"cache_seqlens must be >= 0; got {int(values[b])} for sequence {b}.")
    return values


def check_cache_lengths(fn, lengths, seqlen_new, capacity, paged):
    """Every sequence's cache length plus the appended keys fits the cache."""
    if lengths is None or not lengths.size:
        return
    b = int(np.argmax(lengths))
    longest = int(lengths[b])
    if longest + seqlen_new <= capacity:
        return
    new = f" + seqlen_new ({seqlen_new})" if seqlen_new else ""
    if paged:
        fail(ValueError, fn,
             f"block_table must have enough blocks per sequence for cache_seqlens{new}: "
             f"{longest + seqlen_new} keys of sequence {b} need "
             f"{-(-(longest + seqlen_new) // paged)} blocks of {paged}; got "
             f"max_blocks_per_seq = {capacity // paged}.")
    fail(ValueError, fn,
         f"cache_seqlens{new} must be at most the cache's seqlen ({capacity}); got "
         f"{longest + seqlen_new} for sequence {b}.")


def check_block_indices(fn, table, used_blocks, num_blocks):
    """The used entries of a host block table (``used_blocks[b]`` leading entries of row
    b) name blocks in [0, num_blocks)."""
    used = np.arange(table.shape[1])[None, :] < used_blocks[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, p = (int(i) for i in np.argwhere(bad)[0])
        fail(ValueError, fn,
             f"block_table must hold block indices in [0, num_blocks = {num_blocks}) in the "
             f"entries a sequence uses; got {int(table[b, p])} at [{b}, {p}].")


def check_row_indices(fn, rows, batch_cache):
    """Host ``cache_batch_idx`` values name rows in [0, batch_cache)."""
    bad = (rows < 0) | (rows >= batch_cache)
    if bad.any():
        b = int(np.argmax(bad))
        fail(ValueError, fn,
             f"cache_batch_idx must hold cache rows in [0, batch_cache = {batch_cache}); got "
             f"{int(rows[b])} at [{b}].")


def check_distinct_slots(fn, name, slots, batch, seqlen_new):
    """The cache slots the append writes (host ids, shape (batch, seqlen_new)) are
    distinct: two sequences writing one slot would leave it undefined."""
    flat = slots.reshape(-1)
    order = np.argsort(flat, kind="stable")
    dup = np.nonzero(flat[order][1:] == flat[order][:-1])[0]
    if dup.size:
        first, second = sorted((int(order[dup[0]]), int(order[dup[0] + 1])))
        fail(ValueError, fn,
             f"{name} must not let two appended keys share a cache slot (sequences "
             f"{first // seqlen_new} and {second // seqlen_new} would both write it); got "
             f"overlapping appends.")
