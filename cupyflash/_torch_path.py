"""The lean path for torch CUDA tensors: no CuPy array on a repeated call.

``cupyflash.flash_attn_fwd``, ``flash_attn`` and ``flash_attn_bwd`` on torch
CUDA tensors come here from :func:`._interop.call`.  As on the cupy path, a
call is validated and planned once per call signature (the tensors' types,
dtypes, devices, shapes, strides and 16-byte alignment, and the flags): the
first call of a signature views the tensors as CuPy arrays (DLPack, no copy)
and runs the same validation and planning as cupy arrays, with the same error
messages; every call then reads ``data_ptr()`` of each tensor, allocates the
outputs (and the backward's scratch) with ``torch.empty`` on the tensors'
device (torch's caching allocator: memory statistics, streams and CUDA graph
pools see them), and launches on ``torch.cuda.current_stream()``.

Anything this path does not cover (CPU tensors, empty inputs, the varlen
functions, a call with an attention variant on, a bias or a mask included) returns
``NotImplemented`` and takes the general DLPack path of
:mod:`._interop`.

Importing this module imports torch (the caller already has it).
"""

from __future__ import annotations

import sys

import torch

from . import _api, _checks, _interop, _launch

try:  # the raw stream handle without building a torch.cuda.Stream (what torch's own compiled code uses)
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: SLF001
except AttributeError:  # pragma: no cover - older or other torch builds
    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream

_UINT8 = torch.uint8
_FLOAT32 = torch.float32


def _sig(t):
    """One tensor's part of a call signature (None for an output not given)."""
    if t is None:
        return None
    return type(t), t.dtype, t.device, t.shape, t.stride(), t.data_ptr() & 15 == 0


class _Entry:
    """A planned call on one CUDA device: the plan, and torch allocation."""

    __slots__ = ("call", "device", "index", "_cupy")

    def __init__(self, call, device):
        self.call, self.device, self.index = call, device, device.index
        self._cupy = sys.modules["cupy"]

    def alloc(self, nbytes):
        buffer = torch.empty(nbytes, dtype=_UINT8, device=self.device)
        return buffer, buffer.data_ptr()

    def _on_device(self):
        cupy = self._cupy
        if cupy.cuda.runtime.getDevice() == self.index:
            return None
        return cupy.cuda.Device(self.index)


def _empty_like(x, contiguous):
    """An uninitialised C-contiguous tensor like ``x`` (``empty_like`` when ``x`` is
    contiguous: it costs half of ``torch.empty`` with a shape)."""
    if contiguous:
        return torch.empty_like(x)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class _Fwd(_Entry):
    __slots__ = ("contiguous", "backward_plans")

    def __init__(self, call, device, contiguous):
        super().__init__(call, device)
        self.contiguous = contiguous  # of q
        self.backward_plans = _launch.PlanCache(64)  # of the autograd backward (see bwd)

    def __call__(self, q, k, v, out, lse):
        device = self._on_device()
        if device is not None:
            with device:
                return self(q, k, v, out, lse)
        call = self.call
        if out is None:
            out = _empty_like(q, self.contiguous)
        if lse is None:
            lse = torch.empty(call.lse_shape, dtype=_FLOAT32, device=self.device)
        call.run(_raw_stream(self.index), self.alloc, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                 out.data_ptr(), lse.data_ptr())
        return out, lse


class _Bwd(_Entry):
    __slots__ = ("contiguous",)

    def __init__(self, call, device, contiguous):
        super().__init__(call, device)
        self.contiguous = contiguous  # of (q, k, v)

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv):
        device = self._on_device()
        if device is not None:
            with device:
                return self(dout, q, k, v, out, lse, dq, dk, dv)
        cq, ck, cv = self.contiguous
        if dq is None:
            dq = _empty_like(q, cq)
        if dk is None:
            dk = _empty_like(k, ck)
        if dv is None:
            dv = _empty_like(v, cv)
        self.call.run(_raw_stream(self.index), self.alloc, dout.data_ptr(), q.data_ptr(), k.data_ptr(),
                      v.data_ptr(), out.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                      dv.data_ptr())
        return dq, dk, dv


_GENERAL = object()  # an entry saying: this signature takes the general path
_FWD_ENTRIES = _launch.PlanCache()
_BWD_ENTRIES = _launch.PlanCache()


def run(fn_name, names, arrays, rest, kwargs):
    """The result of a public function on torch tensors, or NotImplemented."""
    fast = _FAST.get(fn_name)
    if fast is None or rest or (fn_name == "flash_attn" and ("out" in kwargs or "lse" in kwargs)):
        return NotImplemented
    try:
        return fast(fn_name, *arrays, **kwargs)
    except _Unsupported:
        return NotImplemented


class _Unsupported(Exception):
    """A keyword this path does not take (the general path takes it, or says what is wrong)."""


#: The variant options (issues 13 and 14) with their "off" values.  A call that gives
#: one with any other value (or type) takes the general path, which checks it and runs
#: the variant; off, this path runs as if it was not given.
_VARIANTS_OFF = {**_checks.NOT_IMPLEMENTED, "sinks": None, "rng_state": None, "attn_bias": None,
                 "attn_mask": None, "return_dbias": False, "return_rng_state": False}


def _check_options(fn_name, options):
    for name, value in options.items():
        off = _VARIANTS_OFF.get(name, _Unsupported)
        if off is _Unsupported or not (value is off or (
                off is not None and type(value) is type(off) and value == off)):
            raise _Unsupported


def _views(fn_name, names, tensors):
    """CuPy views of CUDA tensors (first call of a signature only), after the general
    path's dtype and device checks; bfloat16 as int16 storage."""
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    _interop._check_same(fn_name, names, dtypes, "dtype", TypeError)  # noqa: SLF001
    _interop._check_same(fn_name, names, [str(t.device) for t in tensors], "device", ValueError)  # noqa: SLF001
    cupy = _interop._import_cupy(fn_name, "torch.Tensor")  # noqa: SLF001
    with cupy.cuda.Device(tensors[names.index("q")].device.index):
        return [None if t is None else cupy.from_dlpack(
            (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).detach()) for t in tensors]


def _fwd(fn_name, q, k, v, *, softmax_scale=None, causal=False, out=None, lse=None, **options):
    if options:
        _check_options(fn_name, options)
    key = entry = None
    if type(softmax_scale) in _api.SCALE_KEY_TYPES:
        try:
            key = (fn_name, type(softmax_scale), softmax_scale, type(causal), causal,
                   _sig(q), _sig(k), _sig(v), _sig(out), _sig(lse))
            entry = _FWD_ENTRIES.get(key)
        except Exception:  # noqa: BLE001 (validation says what is wrong)
            key = entry = None
    if entry is None:
        entry = _FWD_ENTRIES.put(key, _plan_fwd(fn_name, q, k, v, softmax_scale, causal, out, lse))
    if entry is _GENERAL:
        return NotImplemented
    result = entry(q, k, v, out, lse)
    return result[0] if fn_name == "flash_attn" else result


def _plan_fwd(fn_name, q, k, v, softmax_scale, causal, out, lse):
    _interop.check_call(fn_name, ("q", "k", "v"), (q, k, v), {"out": out, "lse": lse})
    if q.device.type != "cuda":
        return _GENERAL
    names = ("q", "k", "v", "out", "lse")
    given = [(n, t) for n, t in zip(names, (q, k, v, out, lse)) if t is not None]
    views = dict(zip((n for n, _ in given), _views(fn_name, [n for n, _ in given], [t for _, t in given])))
    qv, kv, vv = views["q"], views["k"], views["v"]
    dtype = "bfloat16" if q.dtype == torch.bfloat16 else None
    entry = _api._plan_fwd(fn_name, qv, kv, vv, softmax_scale, causal, dtype,  # noqa: SLF001
                           views.get("out"), views.get("lse"))
    if not isinstance(entry, _api._GpuFwd):  # noqa: SLF001 (empty inputs)
        return _GENERAL
    return _Fwd(entry.call, q.device, q.is_contiguous())


def _bwd(fn_name, dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, deterministic=False,
         dq=None, dk=None, dv=None, **options):
    if options:
        _check_options(fn_name, options)
    key = entry = None
    if type(softmax_scale) in _api.SCALE_KEY_TYPES:
        try:
            key = (type(softmax_scale), softmax_scale, type(causal), causal, type(deterministic), deterministic,
                   _sig(dout), _sig(q), _sig(k), _sig(v), _sig(out), _sig(lse), _sig(dq), _sig(dk), _sig(dv))
            entry = _BWD_ENTRIES.get(key)
        except Exception:  # noqa: BLE001
            key = entry = None
    if entry is None:
        entry = _BWD_ENTRIES.put(key, _plan_bwd(fn_name, dout, q, k, v, out, lse, softmax_scale, causal,
                                                deterministic, dq, dk, dv))
    if entry is _GENERAL:
        return NotImplemented
    return entry(dout, q, k, v, out, lse, dq, dk, dv)


def _plan_bwd(fn_name, dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dq, dk, dv):
    _interop.check_call(fn_name, ("dout", "q", "k", "v", "out", "lse"), (dout, q, k, v, out, lse),
                        {"dq": dq, "dk": dk, "dv": dv})
    if q.device.type != "cuda":
        return _GENERAL
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    given = [(n, t) for n, t in zip(names, (dout, q, k, v, out, lse, dq, dk, dv)) if t is not None]
    views = dict(zip((n for n, _ in given), _views(fn_name, [n for n, _ in given], [t for _, t in given])))
    dtype = "bfloat16" if q.dtype == torch.bfloat16 else None
    entry = _api._plan_bwd(fn_name, *(views[n] for n in names[:6]), softmax_scale, causal,  # noqa: SLF001
                           deterministic, dtype, views.get("dq"), views.get("dk"), views.get("dv"))
    if not isinstance(entry, _api._GpuBwd):  # noqa: SLF001 (empty inputs)
        return _GENERAL
    return _Bwd(entry.call, q.device, (q.is_contiguous(), k.is_contiguous(), v.is_contiguous()))


def _attn(fn_name, q, k, v, *, softmax_scale=None, causal=False, **options):
    """flash_attn: _fwd without the preallocated outputs, which flash_attn does not take
    (given, they are unknown options: the general path has Python say so)."""
    if options:
        _check_options(fn_name, options)
    return _fwd(fn_name, q, k, v, softmax_scale=softmax_scale, causal=causal)


_FAST = {"flash_attn_fwd": _fwd, "flash_attn": _attn, "flash_attn_bwd": _bwd}


# ----------------------------------------------------------------------------
# For cupyflash.torch's autograd.Function: the backward's signature is the
# forward's (q, k, v as they were; out and lse as the forward allocated them)
# plus dout's, so each forward entry keeps the backward plans of its calls,
# by dout's signature and the deterministic flag.
# ----------------------------------------------------------------------------


def fwd(q, k, v, softmax_scale, causal):
    """``(out, lse, backward_plans)`` of tensors, for cupyflash.torch (no options,
    no outputs given); ``backward_plans`` (None off the lean path) goes back to
    :func:`bwd` with the same tensors."""
    key = entry = None
    if type(softmax_scale) in _api.SCALE_KEY_TYPES:
        try:
            key = ("flash_attn_fwd", type(softmax_scale), softmax_scale, type(causal), causal,
                   _sig(q), _sig(k), _sig(v), None, None)
            entry = _FWD_ENTRIES.get(key)
        except Exception:  # noqa: BLE001 - a key that cannot be built: validation says why
            key = entry = None
    if entry is None:
        entry = _FWD_ENTRIES.put(key, _plan_fwd("flash_attn_fwd", q, k, v, softmax_scale, causal, None, None))
    if entry is _GENERAL or key is None:
        out, lse = _api.flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)
        return out, lse, None
    out, lse = entry(q, k, v, None, None)
    return out, lse, entry.backward_plans


def bwd(backward_plans, dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    """``(dq, dk, dv)`` for cupyflash.torch: ``backward_plans`` from :func:`fwd`,
    the other tensors those :func:`fwd` took and gave."""
    entry = key = None
    if backward_plans is not None:
        try:
            key = (type(deterministic), deterministic, _sig(dout))
            entry = backward_plans.get(key)
        except Exception:  # noqa: BLE001 - as in fwd
            key = None
        if entry is None and key is not None:
            entry = backward_plans.put(key, _plan_bwd(
                "flash_attn_bwd", dout, q, k, v, out, lse, softmax_scale, causal, deterministic, None, None, None))
    if entry is None or entry is _GENERAL:
        return _api.flash_attn_bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                   deterministic=deterministic)
    return entry(dout, q, k, v, out, lse, None, None, None)
