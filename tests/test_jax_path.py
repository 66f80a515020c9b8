"""cupyflash.jax's GPU hot path without a GPU: plans and their cache, the scratch, the callbacks.

The callbacks that XLA runs on a GPU are driven here with fake buffers (device
pointers, shapes, a CUDA device) and fake plans, so everything they do in
Python is checked on the CPU: which plan a call takes, which pointers it hands
it, where the scratch comes from.  tests/test_gpu_interop.py runs them for real.
Skipped without jax (or with a JAX older than 0.7, which has no buffer_callback).
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
cfj = pytest.importorskip("cupyflash.jax")
if cfj._buffer_callback is None:
    pytest.skip(f"jax {jax.__version__} has no buffer_callback", allow_module_level=True)

from cupyflash import _gpu, _gpu_bwd, _interop, _launch  # noqa: E402

jnp = jax.numpy
Q_SHAPE, K_SHAPE = (2, 24, 4, 16), (2, 40, 2, 16)
LSE_SHAPE = (2, 4, 24)
DL_CUDA = 2


class FakeCall:
    """A planned call: its scratch size, and the runs it was asked for."""

    def __init__(self, scratch_bytes):
        self.scratch_bytes = scratch_bytes
        self.runs = []

    def run(self, stream, alloc, *pointers):
        scratch = alloc(self.scratch_bytes)[1] if self.scratch_bytes else None
        self.runs.append({"stream": stream, "alloc": alloc, "pointers": pointers, "scratch": scratch})


class FakeBuffer:
    """A buffer_callback Buffer on CUDA device ``device``."""

    def __init__(self, ptr, shape=(1,), device=0):
        self.ptr, self.shape, self.device = ptr, shape, device

    def __dlpack_device__(self):
        return DL_CUDA, self.device

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "<f2", "data": (self.ptr, False), "version": 2}


class FakeContext:
    stream = 0x5EED


@pytest.fixture
def planner(monkeypatch):
    """Fake plan_fwd/plan_bwd (returning FakeCalls of ``planner.scratch_bytes``) that
    record their arguments; the current CUDA device is never touched."""

    class Planner:
        scratch_bytes = 4096
        calls = []

        @classmethod
        def fake(cls, kind):
            def plan(*arrays, **kwargs):
                call = FakeCall(cls.scratch_bytes)
                cls.calls.append({"kind": kind, "arrays": arrays, "kwargs": kwargs, "call": call})
                return call
            return plan

    Planner.calls = []
    monkeypatch.setattr(_gpu, "plan_fwd", Planner.fake("fwd"))
    monkeypatch.setattr(_gpu_bwd, "plan_bwd", Planner.fake("bwd"))
    monkeypatch.setattr(cfj, "_cuda_device", lambda device_id: contextlib.nullcontext())
    return Planner


def _fwd(scale=0.25, causal=True):
    return cfj._Fwd(Q_SHAPE, K_SHAPE, "bfloat16", scale, causal)


def _bwd(scale=0.25, causal=True, deterministic=False):
    return cfj._Bwd(Q_SHAPE, K_SHAPE, "bfloat16", scale, causal, deterministic)


# ----------------------------------------------------------------------------
# Geometry and alignment
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("aligned", [True, False])
def test_geometry_is_a_c_contiguous_buffer_with_the_given_alignment(aligned):
    g = cfj._geometry(Q_SHAPE, 2, aligned)
    like = np.empty(Q_SHAPE, np.float16)
    assert (g.shape, g.strides, g.itemsize, g.ndim) == (like.shape, like.strides, 2, 4)
    assert (g.data.ptr % 16 == 0) is aligned
    assert _launch.vec_ok([g], Q_SHAPE[3]) is aligned


def test_aligned_needs_every_pointer_on_16_bytes():
    assert cfj._aligned(0x1000, 0x2010, 0x30000)
    assert not cfj._aligned(0x1000, 0x2008, 0x30000)
    assert not cfj._aligned(0x1002)


# ----------------------------------------------------------------------------
# Plans: made once per (device, alignment), from geometry of the signature
# ----------------------------------------------------------------------------


def test_fwd_plan_is_made_once_per_device_and_alignment(planner):
    callback = _fwd()
    first = callback.plan(0, True)
    assert callback.plan(0, True) is first
    assert callback.plan(0, False) is not first
    assert callback.plan(1, True) is not first
    assert len(planner.calls) == 3
    [aligned, misaligned, other_device] = planner.calls
    q, k, v, out, lse = aligned["arrays"]
    assert [a.shape for a in (q, k, v, out, lse)] == [Q_SHAPE, K_SHAPE, K_SHAPE, Q_SHAPE, LSE_SHAPE]
    assert [a.itemsize for a in (q, k, v, out, lse)] == [2, 2, 2, 2, 4]
    assert aligned["kwargs"] == {"softmax_scale": 0.25, "causal": True, "dtype_name": "bfloat16",
                                 "device_id": 0}
    assert all(a.data.ptr % 16 == 0 for a in aligned["arrays"])
    assert all(a.data.ptr % 16 for a in misaligned["arrays"])
    assert other_device["kwargs"]["device_id"] == 1


def test_bwd_plan_takes_the_geometry_of_every_buffer(planner):
    _bwd(deterministic=True).plan(3, True)
    [plan] = planner.calls
    assert [a.shape for a in plan["arrays"]] == [Q_SHAPE, Q_SHAPE, K_SHAPE, K_SHAPE, Q_SHAPE, LSE_SHAPE,
                                                  Q_SHAPE, K_SHAPE, K_SHAPE]
    assert plan["kwargs"] == {"softmax_scale": 0.25, "causal": True, "deterministic": True,
                              "dtype_name": "bfloat16", "device_id": 3}


def test_one_callback_per_signature():
    assert cfj._fwd_callback(Q_SHAPE, K_SHAPE, "float16", 0.25, True) is \
        cfj._fwd_callback(Q_SHAPE, K_SHAPE, "float16", 0.25, True)
    assert cfj._fwd_callback(Q_SHAPE, K_SHAPE, "float16", 0.25, True) is not \
        cfj._fwd_callback(Q_SHAPE, K_SHAPE, "float16", 0.25, False)
    assert cfj._bwd_callback(Q_SHAPE, K_SHAPE, "float16", 0.25, True, False) is not \
        cfj._bwd_callback(Q_SHAPE, K_SHAPE, "float16", 0.25, True, True)


# ----------------------------------------------------------------------------
# The GPU callbacks: XLA's pointers and stream into the plan, scratch from XLA
# ----------------------------------------------------------------------------


def test_fwd_callback_runs_its_plan_on_xla_buffers_and_stream(planner):
    callback = _fwd()
    q, k, v, out, lse = (FakeBuffer(0x10000 * (i + 1), device=1) for i in range(5))
    scratch = FakeBuffer(0x90000, (planner.scratch_bytes,), device=1)
    for _ in range(3):
        callback(FakeContext(), (out, lse, scratch), q, k, v)
    [plan] = planner.calls  # planned once
    assert plan["kwargs"]["device_id"] == 1 and all(a.data.ptr % 16 == 0 for a in plan["arrays"])
    runs = plan["call"].runs
    assert len(runs) == 3
    assert runs[0]["pointers"] == (0x10000, 0x20000, 0x30000, 0x40000, 0x50000)
    assert runs[0]["stream"] == FakeContext.stream
    assert runs[0]["scratch"] == 0x90000


def test_bwd_callback_writes_straight_into_xla_gradient_buffers(planner):
    callback = _bwd()
    dout, q, k, v, out, lse, dq, dk, dv = (FakeBuffer(0x10000 * (i + 1)) for i in range(9))
    scratch = FakeBuffer(0xA0000, (planner.scratch_bytes + 256,))
    callback(FakeContext(), (dq, dk, dv, scratch), dout, q, k, v, out, lse)
    [plan] = planner.calls
    [run] = plan["call"].runs
    assert run["pointers"] == tuple(0x10000 * (i + 1) for i in range(9))  # dq, dk, dv last: XLA's
    assert run["scratch"] == 0xA0000


def test_misaligned_buffers_get_a_plan_of_their_own(planner):
    callback = _fwd()
    buffers = [FakeBuffer(0x10000 * (i + 1)) for i in range(5)]
    scratch = FakeBuffer(0x90000, (planner.scratch_bytes,))
    callback(FakeContext(), (buffers[3], buffers[4], scratch), *buffers[:3])
    buffers[1] = FakeBuffer(0x20008)
    callback(FakeContext(), (buffers[3], buffers[4], scratch), *buffers[:3])
    aligned, misaligned = planner.calls
    assert all(a.data.ptr % 16 for a in misaligned["arrays"])
    assert misaligned["call"].runs[0]["pointers"][1] == 0x20008


def test_a_plan_without_scratch_reads_no_scratch_pointer(planner):
    planner.scratch_bytes = 0
    callback = _fwd()
    buffers = [FakeBuffer(0x10000 * (i + 1)) for i in range(5)]
    callback(FakeContext(), (buffers[3], buffers[4], object()), *buffers[:3])  # a bare object: never read
    [run] = planner.calls[0]["call"].runs
    assert run["scratch"] is None


@pytest.mark.parametrize("start", [0x90000, 0x90010, 0x900F0])
def test_scratch_starts_at_the_first_aligned_byte_of_xla_buffer(start):
    call = FakeCall(5000)
    alloc = cfj._scratch_alloc(call, FakeBuffer(start, (cfj._scratch_nbytes(5000),)))
    owner, base = alloc(5000)
    assert owner is None and base % _launch.SCRATCH_ALIGN == 0 and start <= base < start + _launch.SCRATCH_ALIGN
    assert cfj._scratch_alloc(call, FakeBuffer(0x90010, (5000,))) is None  # no room left to align


def test_scratch_from_cupy_pool_on_xla_stream_when_the_plan_outgrows_xla_scratch(planner, monkeypatch):
    streams = []

    @contextlib.contextmanager
    def use_stream(cupy, ptr):
        streams.append(ptr)
        yield

    monkeypatch.setattr(_interop, "use_stream", use_stream)
    monkeypatch.setitem(sys.modules, "cupy", object())
    monkeypatch.setattr(_launch, "cupy_alloc", lambda nbytes: ("pool", 0xB0000))
    callback = _bwd()
    buffers = [FakeBuffer(0x10000 * (i + 1)) for i in range(9)]
    scratch = FakeBuffer(0xA0000, (planner.scratch_bytes - 1,))  # sized at trace time for another plan
    callback(FakeContext(), (*buffers[6:], scratch), *buffers[:6])
    [run] = planner.calls[0]["call"].runs
    assert run["scratch"] == 0xB0000 and streams == [FakeContext.stream]


# ----------------------------------------------------------------------------
# Trace time: the scratch output is sized from the plan; empty inputs need no kernel
# ----------------------------------------------------------------------------


def _bf16(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.bfloat16)


def _result_avals(jaxpr):
    """The result avals of every buffer_callback in ``jaxpr`` and the jaxprs inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "buffer_callback":
            found.append(eqn.params["result_avals"])
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)  # a ClosedJaxpr's Jaxpr
            if hasattr(inner, "eqns"):
                found += _result_avals(inner)
    return found


def test_trace_time_scratch_is_the_plans_for_aligned_buffers(planner, monkeypatch):
    monkeypatch.setattr(cfj, "_platform", lambda q: "gpu")
    monkeypatch.setattr(cfj, "_trace_device_id", lambda q: 0)
    planner.scratch_bytes = 12288
    q, k, v = _bf16(Q_SHAPE), _bf16(K_SHAPE, 1), _bf16(K_SHAPE, 2)

    def loss(q, k, v):
        return cfj.flash_attention(q, k, v, causal=True).astype(jnp.float32).sum()

    fwd, bwd = _result_avals(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)
    scratch = ((12288 + _launch.SCRATCH_ALIGN,), jnp.uint8)  # room to align the plan's layout
    assert [(a.shape, a.dtype) for a in fwd] == [(Q_SHAPE, jnp.bfloat16), (LSE_SHAPE, jnp.float32), scratch]
    assert [(a.shape, a.dtype) for a in bwd] == [(Q_SHAPE, jnp.bfloat16), (K_SHAPE, jnp.bfloat16),
                                                 (K_SHAPE, jnp.bfloat16), scratch]
    assert [(p["kind"], p["kwargs"]["device_id"]) for p in planner.calls] == [("fwd", 0), ("bwd", 0)]
    assert all(a.data.ptr % 16 == 0 for p in planner.calls for a in p["arrays"])


def test_cpu_backend_plans_nothing_and_needs_no_scratch(planner):
    q, k, v = _bf16(Q_SHAPE), _bf16(K_SHAPE, 1), _bf16(K_SHAPE, 2)
    [fwd] = _result_avals(jax.make_jaxpr(lambda q, k, v: cfj.flash_attention(q, k, v))(q, k, v).jaxpr)
    assert fwd[2].shape == (0,) and planner.calls == []


@pytest.mark.parametrize("empty", ["seqlen_k", "seqlen_q", "batch"])
def test_empty_inputs_are_answered_at_trace_time(monkeypatch, empty):
    def no_callback(*args, **kwargs):
        raise AssertionError("buffer_callback called for an empty input")

    monkeypatch.setattr(cfj, "_buffer_callback", no_callback)
    qs, ks = list(Q_SHAPE), list(K_SHAPE)
    if empty == "seqlen_k":
        ks[1] = 0
    elif empty == "seqlen_q":
        qs[1] = 0
    else:
        qs[0] = ks[0] = 0
    q, k, v = (jnp.ones(s, jnp.float32) for s in (qs, ks, ks))
    out, lse = jax.jit(cfj._fwd_call, static_argnums=(3, 4))(q, k, v, 0.25, True)
    assert out.shape == q.shape and not np.asarray(out).any()
    assert lse.shape == (qs[0], qs[2], qs[1]) and np.all(np.asarray(lse) == -np.inf)

    def loss(q, k, v):
        return cfj.flash_attention(q, k, v).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and not np.asarray(g).any()
