"""Stand-ins for cupy arrays and the GPU modules, so GPU routing is tested on
machines without a GPU."""

from __future__ import annotations

import itertools
import sys
import types
import weakref

import numpy as np

_ADDRESSES = itertools.count(1 << 20, 256)  # 256-byte aligned fake device addresses
BY_POINTER = weakref.WeakValueDictionary()  # fake pointer -> the FakeCupyArray it addresses


class FakeMemory:
    """A cupy MemoryPointer's ``ptr`` and ``device_id``."""

    def __init__(self, device_id):
        self.ptr, self.device_id = next(_ADDRESSES), device_id

    def __add__(self, offset):  # memory + offset: another fake address
        return FakeMemory(self.device_id)


class FakeDevice:
    compute_capability = "90"

    def __init__(self, device_id=0):
        self.id = device_id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeCupyArray:
    """The attributes the checks and the hot path read, slicing and assignment,
    around a NumPy array; ``data.ptr`` is a fake device address (:data:`BY_POINTER`).

    ``FakeCupyArray(host_array, device_id)``, or ``FakeCupyArray(shape, dtype[,
    memptr])`` as ``cupy.ndarray(shape, dtype[, memptr])`` (uninitialised memory:
    NaN-poisoned here; each array has memory of its own).
    """

    def __init__(self, host, device_id=0, memptr=None):
        if isinstance(host, tuple):
            host, device_id = np.empty(host, device_id), 0
            host.view(np.uint8).fill(0xFF)  # NaN in every float type
        self.host = host
        self.device = FakeDevice(device_id)
        self.data = FakeMemory(device_id)
        BY_POINTER[self.data.ptr] = self

    shape = property(lambda self: self.host.shape)
    ndim = property(lambda self: self.host.ndim)
    dtype = property(lambda self: self.host.dtype)
    strides = property(lambda self: self.host.strides)
    itemsize = property(lambda self: self.host.itemsize)
    size = property(lambda self: self.host.size)

    def __getitem__(self, index):
        return FakeCupyArray(self.host[index], self.device.id)

    def __setitem__(self, index, value):
        self.host[index] = value.host if isinstance(value, FakeCupyArray) else value

    def get(self):
        return self.host


# ----------------------------------------------------------------------------
# A fake GPU stack for the planned hot path (cupyflash._api -> _gpu.plan_fwd /
# _gpu_bwd.plan_bwd -> call.run(pointers)): fake device memory is addressed by
# fake pointers, and the fake calls compute on the host with the CPU path.
# ----------------------------------------------------------------------------


class FakeStream:
    ptr = 0

    @staticmethod
    def is_capturing():
        return False

    @staticmethod
    def synchronize():
        return None


def fake_cupy_module(device_count=1):
    """A module with the parts of cupy the library touches on its hot path."""
    cupy = types.ModuleType("cupy")
    cupy.ndarray = FakeCupyArray
    cupy.zeros = lambda shape, dtype: FakeCupyArray(np.zeros(shape, dtype))
    cupy.empty = lambda shape, dtype: FakeCupyArray(tuple(shape), dtype)
    cupy.full = lambda shape, value, dtype: FakeCupyArray(np.full(shape, value, dtype))
    cupy.asarray = FakeCupyArray
    cupy.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: device_count,
                                      getDeviceProperties=lambda i: {"name": b"Fake GPU"}),
        Device=FakeDevice,
        get_current_stream=lambda: FakeStream,
        alloc=lambda nbytes: FakeMemory(0),
    )
    return cupy


class FakeCall:
    """A planned call: records its plan's keywords and every run; computes with ``compute``."""

    grads_bytes = scratch_bytes = 0  # the fake allocator ignores sizes
    grads_offsets = (0, 0, 0)
    accum_offsets = (0, 0)
    last_var = None

    def __init__(self, kind, plan_kwargs, shapes, compute, runs):
        self.kind, self.plan_kwargs, self.compute, self.runs = kind, plan_kwargs, compute, runs
        self.out_shape, self.lse_shape = shapes

    def run(self, stream, alloc, *pointers, var=None):
        """``var``: the variants' per-call values (kept as ``last_var``), or None."""
        self.last_var = var
        self.runs.append((self.kind, self.plan_kwargs))
        if self.kind == "decode":  # 10 pointers, then the int cache length
            arrays = [BY_POINTER.get(p) for p in pointers[:10]] + [pointers[10]]
        else:
            arrays = [BY_POINTER.get(p) for p in pointers[:5 if self.kind == "fwd" else 9]]
        if self.compute is not None:  # with var= only for a call with variants
            self.compute(self.plan_kwargs, *arrays, **({} if var is None else {"var": var}))
        return None

    def launcher(self, stream, q, k_cache, v_cache, k_new, v_new, out, lse, out_accum, lse_accum, cache_seqlens,
                 cache_batch_idx, block_table, seqused_k_out, cache_seqlen, var=None):
        """A decode call's launcher (its scratch allocated by the caller): :meth:`run`'s work."""
        return self.run(stream, None, q, k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens, cache_batch_idx,
                        block_table, cache_seqlen, var=var)


def install_fake_gpu(monkeypatch, compute_fwd=None, compute_bwd=None, compute_decode=None):
    """Fake ``cupy``, ``cupyflash._gpu``, ``cupyflash._gpu_bwd`` and
    ``cupyflash._gpu_decode``; returns ``(plans, runs)``: the keyword arguments
    of each plan made, and each run.

    ``compute_fwd(plan_kwargs, q, k, v, out, lse)``, ``compute_bwd(plan_kwargs,
    dout, q, k, v, out, lse, dq, dk, dv)`` and ``compute_decode(plan_kwargs, q,
    k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens,
    cache_batch_idx, block_table, cache_seqlen)`` fill the
    outputs (FakeCupyArrays; None for absent arrays).
    """
    import cupyflash

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_module())
    plans, runs = [], []

    def plan_fwd(q, k, v, out, lse, **kwargs):
        plans.append(("fwd", kwargs))
        return FakeCall("fwd", kwargs, (q.shape, (q.shape[0], q.shape[2], q.shape[1])), compute_fwd, runs)

    def plan_bwd(dout, q, k, v, out, lse, dq, dk, dv, **kwargs):
        plans.append(("bwd", kwargs))
        return FakeCall("bwd", kwargs, (None, None), compute_bwd, runs)

    def plan_decode(q, k_cache, v_cache, k_new, v_new, block_table, **kwargs):
        plans.append(("decode", kwargs))
        return FakeCall("decode", kwargs, (q.shape, (q.shape[0], q.shape[2], q.shape[1])), compute_decode, runs)

    gpu = types.ModuleType("cupyflash._gpu")
    gpu.plan_fwd = plan_fwd
    gpu_bwd = types.ModuleType("cupyflash._gpu_bwd")
    gpu_bwd.plan_bwd = plan_bwd
    gpu_decode = types.ModuleType("cupyflash._gpu_decode")
    gpu_decode.plan_decode = plan_decode
    for name, module in (("_gpu", gpu), ("_gpu_bwd", gpu_bwd), ("_gpu_decode", gpu_decode)):
        monkeypatch.setitem(sys.modules, f"cupyflash.{name}", module)
        monkeypatch.setattr(cupyflash, name, module, raising=False)
    return plans, runs


def cpu_compute_fwd(plan_kwargs, q, k, v, out, lse):
    """compute_fwd for install_fake_gpu: the CPU path, written into out and lse."""
    from cupyflash import cpu

    o, l = cpu.fwd(q.host, k.host, v.host, plan_kwargs["softmax_scale"], plan_kwargs["causal"])
    out.host[...], lse.host[...] = o, l


def cpu_compute_decode(plan_kwargs, q, k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens, cache_batch_idx, block_table, cache_seqlen):
    """compute_decode for install_fake_gpu: the CPU path on the host arrays (the
    append lands in the caches' host arrays), written into out and lse."""
    from cupyflash import _kvcache

    host = lambda a: None if a is None else a.host  # noqa: E731
    lengths = cache_seqlen if cache_seqlens is None else cache_seqlens.host
    o, l = _kvcache.flash_attn_with_kvcache(
        host(q), host(k_cache), host(v_cache), host(k_new), host(v_new), cache_seqlens=lengths,
        cache_batch_idx=host(cache_batch_idx), block_table=host(block_table),
        softmax_scale=plan_kwargs["softmax_scale"], causal=plan_kwargs["causal"], return_lse=True)
    out.host[...] = o
    if lse is not None:  # (an lse the call does not return has no array)
        lse.host[...] = l


def cpu_compute_bwd(plan_kwargs, dout, q, k, v, out, lse, dq, dk, dv):
    from cupyflash import cpu

    grads = cpu.bwd(dout.host, q.host, k.host, v.host, out.host, lse.host, plan_kwargs["softmax_scale"],
                    plan_kwargs["causal"])
    for dst, src in zip((dq, dk, dv), grads):
        dst.host[...] = src
