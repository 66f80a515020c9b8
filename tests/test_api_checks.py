"""Argument validation, empty inputs, and dispatch of cupy arrays to the GPU module.

GPU dispatch is tested without a GPU: a fake ``cupy`` module (whose ``ndarray``
wraps a NumPy array) goes into ``sys.modules`` and a fake ``cupyflash._gpu``
records its calls.  The real ``_gpu`` is never imported here.
"""

from __future__ import annotations

import math
import re
import sys
import types

import numpy as np
import pytest

import cupyflash
from cupyflash import _checks, cpu
from fakes import FakeCupyArray, install_fake_gpu

FUNCTIONS = ("flash_attn_fwd", "flash_attn", "flash_attn_bwd")


def _valid_args(dtype=np.float32):
    """Valid keyword arguments for every function: q (2,5,4,8), k/v (2,7,2,8)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 8)).astype(dtype)
    k = rng.standard_normal((2, 7, 2, 8)).astype(dtype)
    v = rng.standard_normal((2, 7, 2, 8)).astype(dtype)
    return dict(q=q, k=k, v=v, dout=q.copy(), out=q.copy(),
                lse=np.zeros((2, 4, 5), dtype=np.float32))


def _call(fn_name, args, **kwargs):
    fn = getattr(cupyflash, fn_name)
    if fn_name == "flash_attn_bwd":
        return fn(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"],
                  **kwargs)
    return fn(args["q"], args["k"], args["v"], **kwargs)


def _strided(x):
    """The same shape as ``x`` with a last stride of 2 elements."""
    wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype)
    return wide[..., ::2]


def _set(**changes):
    """A mutation of the valid arguments; values are callables of the valid args."""
    def mutate(args):
        for key, make in changes.items():
            args[key] = make(args)
        return args
    return mutate


# (id, exception, argument named in the message, text in the message, mutation, kwargs)
QKV_CASES = [
    ("q-list", TypeError, "q", "must be a numpy.ndarray or cupy.ndarray; got list",
     _set(q=lambda a: a["q"].tolist()), {}),
    ("k-scalar", TypeError, "k", "must be a numpy.ndarray or cupy.ndarray; got float",
     _set(k=lambda a: 1.0), {}),
    ("q-rank3", ValueError, "q", "must have 4 dimensions", _set(q=lambda a: a["q"][0]), {}),
    ("k-rank5", ValueError, "k", "must have 4 dimensions", _set(k=lambda a: a["k"][None]), {}),
    ("v-rank3", ValueError, "v", "must have 4 dimensions", _set(v=lambda a: a["v"][0]), {}),
    ("q-int32", TypeError, "q", "must have dtype float16, bfloat16 (ml_dtypes), float32",
     _set(q=lambda a: a["q"].astype(np.int32)), {}),
    ("q-complex", TypeError, "q", "got complex64",
     _set(q=lambda a: a["q"].astype(np.complex64)), {}),
    ("k-dtype", TypeError, "k", "must have the same dtype as q (float32); got float64.",
     _set(k=lambda a: a["k"].astype(np.float64)), {}),
    ("v-dtype", TypeError, "v", "must have the same dtype as q (float32); got float16.",
     _set(v=lambda a: a["v"].astype(np.float16)), {}),
    ("k-batch", ValueError, "k", "must have the same batch size as q (2); got 1.",
     _set(k=lambda a: a["k"][:1]), {}),
    ("v-batch", ValueError, "v", "must have the same batch size as q (2); got 1.",
     _set(v=lambda a: a["v"][:1]), {}),
    ("k-head_dim", ValueError, "k", "must have the same head_dim as q (8); got 4.",
     _set(k=lambda a: a["k"][..., :4]), {}),
    ("v-head_dim", ValueError, "v", "must have the same head_dim as q (8); got 4.",
     _set(v=lambda a: a["v"][..., :4]), {}),
    ("v-seqlen", ValueError, "v", "must have the same seqlen as k (7); got 6.",
     _set(v=lambda a: a["v"][:, :6]), {}),
    ("v-nheads", ValueError, "v", "must have the same nheads as k (2); got 1.",
     _set(v=lambda a: a["v"][:, :, :1]), {}),
    ("nheads-not-multiple", ValueError, "k", "number of heads that divides q's (4); got 3.",
     _set(k=lambda a: np.zeros((2, 7, 3, 8), np.float32),
          v=lambda a: np.zeros((2, 7, 3, 8), np.float32)), {}),
    ("nheads-kv-zero", ValueError, "k", "divides q's (4); got 0.",
     _set(k=lambda a: a["k"][:, :, :0], v=lambda a: a["v"][:, :, :0]), {}),
    ("head_dim-zero", ValueError, "q", "head_dim between 1 and 256; got 0.",
     _set(q=lambda a: a["q"][..., :0], k=lambda a: a["k"][..., :0],
          v=lambda a: a["v"][..., :0], dout=lambda a: a["q"][..., :0],
          out=lambda a: a["q"][..., :0]), {}),
    ("head_dim-257", ValueError, "q", "head_dim between 1 and 256; got 257.",
     _set(q=lambda a: np.zeros((2, 5, 4, 257), np.float32),
          k=lambda a: np.zeros((2, 7, 2, 257), np.float32),
          v=lambda a: np.zeros((2, 7, 2, 257), np.float32),
          dout=lambda a: np.zeros((2, 5, 4, 257), np.float32),
          out=lambda a: np.zeros((2, 5, 4, 257), np.float32)), {}),
    ("q-last-stride", ValueError, "q", "unit stride in its last dimension (head_dim); got a "
     "stride of 2 elements.", _set(q=lambda a: _strided(a["q"])), {}),
    ("k-last-stride", ValueError, "k", "unit stride", _set(k=lambda a: _strided(a["k"])), {}),
    ("v-last-stride", ValueError, "v", "unit stride", _set(v=lambda a: _strided(a["v"])), {}),
    ("scale-nan", ValueError, "softmax_scale", "must be finite and > 0; got nan.",
     None, dict(softmax_scale=float("nan"))),
    ("scale-inf", ValueError, "softmax_scale", "finite and > 0; got inf.",
     None, dict(softmax_scale=math.inf)),
    ("scale-zero", ValueError, "softmax_scale", "finite and > 0; got 0.0.",
     None, dict(softmax_scale=0)),
    ("scale-negative", ValueError, "softmax_scale", "finite and > 0; got -0.5.",
     None, dict(softmax_scale=-0.5)),
    ("scale-str", TypeError, "softmax_scale", "must be a real number or None; got str.",
     None, dict(softmax_scale="0.1")),
    ("scale-complex", TypeError, "softmax_scale", "real number", None, dict(softmax_scale=1j)),
    ("scale-bool", TypeError, "softmax_scale", "real number", None, dict(softmax_scale=True)),
    ("scale-array", TypeError, "softmax_scale", "got numpy.ndarray",
     None, dict(softmax_scale=np.array([0.1]))),
    ("causal-int", TypeError, "causal", "must be a bool; got int.", None, dict(causal=1)),
    ("causal-none", TypeError, "causal", "must be a bool; got NoneType.", None,
     dict(causal=None)),
    ("causal-str", TypeError, "causal", "must be a bool; got str.", None, dict(causal="yes")),
]

BWD_CASES = [
    ("dout-list", TypeError, "dout", "numpy.ndarray or cupy.ndarray",
     _set(dout=lambda a: a["dout"].tolist()), {}),
    ("dout-shape", ValueError, "dout", "must have the same shape as q (2, 5, 4, 8); "
     "got (2, 4, 4, 8).", _set(dout=lambda a: a["dout"][:, :4]), {}),
    ("dout-rank", ValueError, "dout", "4 dimensions", _set(dout=lambda a: a["dout"][0]), {}),
    ("dout-dtype", TypeError, "dout", "same dtype as q (float32); got float64.",
     _set(dout=lambda a: a["dout"].astype(np.float64)), {}),
    ("dout-last-stride", ValueError, "dout", "unit stride",
     _set(dout=lambda a: _strided(a["dout"])), {}),
    ("out-shape", ValueError, "out", "same shape as q", _set(out=lambda a: a["out"][:, :, :2]),
     {}),
    ("out-dtype", TypeError, "out", "same dtype as q (float32); got float16.",
     _set(out=lambda a: a["out"].astype(np.float16)), {}),
    ("out-last-stride", ValueError, "out", "unit stride",
     _set(out=lambda a: _strided(a["out"])), {}),
    ("lse-shape", ValueError, "lse", "must have shape (batch, nheads_q, seqlen_q) = (2, 4, 5); "
     "got (2, 5, 4).", _set(lse=lambda a: np.zeros((2, 5, 4), np.float32)), {}),
    ("lse-rank", ValueError, "lse", "got (2, 4, 5, 1).",
     _set(lse=lambda a: a["lse"][..., None]), {}),
    ("lse-dtype", TypeError, "lse", "must have dtype float32; got float64.",
     _set(lse=lambda a: a["lse"].astype(np.float64)), {}),
    ("lse-tuple", TypeError, "lse", "numpy.ndarray or cupy.ndarray; got tuple",
     _set(lse=lambda a: (1, 2)), {}),
    ("lse-last-stride", ValueError, "lse", "unit stride in its last dimension (seqlen_q)",
     _set(lse=lambda a: _strided(a["lse"])), {}),
    ("deterministic-int", TypeError, "deterministic", "must be a bool; got int.", None,
     dict(deterministic=0)),
]


def _cases():
    for fn_name in FUNCTIONS:
        for case in QKV_CASES:
            yield pytest.param(fn_name, *case[1:], id=f"{fn_name}-{case[0]}")
    for case in BWD_CASES:
        yield pytest.param("flash_attn_bwd", *case[1:], id=f"flash_attn_bwd-{case[0]}")


@pytest.mark.parametrize("fn_name,exc_type,arg,text,mutate,kwargs", list(_cases()))
def test_bad_input(monkeypatch, fn_name, exc_type, arg, text, mutate, kwargs):
    monkeypatch.setattr(cpu, "fwd", _must_not_run)
    monkeypatch.setattr(cpu, "bwd", _must_not_run)
    args = _valid_args()
    if mutate is not None:
        args = mutate(args)
    with pytest.raises(exc_type) as info:
        _call(fn_name, args, **kwargs)
    message = str(info.value)
    assert message.startswith(f"cupyflash.{fn_name}: {arg} must "), message
    assert text in message, message
    assert message.endswith(".")


def _must_not_run(*args, **kwargs):
    raise AssertionError("a kernel ran")


def test_valid_arguments_pass(monkeypatch):
    args = _valid_args()
    for fn_name in FUNCTIONS:
        _call(fn_name, args, softmax_scale=np.float32(0.5), causal=np.bool_(True))
    _call("flash_attn_bwd", args, deterministic=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_cpu_dtypes_are_accepted(dtype):
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    args = _valid_args(dtype)
    out, lse = _call("flash_attn_fwd", args)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32


# ----------------------------------------------------------------------------
# Empty inputs: correctly shaped results, no kernel
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("q_shape,kv_shape", [
    ((0, 5, 4, 8), (0, 7, 2, 8)),    # batch 0
    ((2, 0, 4, 8), (2, 7, 2, 8)),    # seqlen_q 0
    ((2, 5, 4, 8), (2, 0, 2, 8)),    # seqlen_k 0: every row sees no key
    ((2, 5, 0, 8), (2, 7, 0, 8)),    # nheads 0
    ((2, 5, 0, 8), (2, 7, 2, 8)),    # nheads_q 0
    ((2, 0, 4, 8), (2, 0, 2, 8)),    # both seqlens 0
], ids=["batch0", "seqlen_q0", "seqlen_k0", "nheads0", "nheads_q0", "seqlens0"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_inputs(monkeypatch, q_shape, kv_shape, causal):
    monkeypatch.setattr(cpu, "fwd", _must_not_run)
    monkeypatch.setattr(cpu, "bwd", _must_not_run)
    q = np.ones(q_shape, np.float16)
    k = np.ones(kv_shape, np.float16)
    v = np.ones(kv_shape, np.float16)
    batch, seqlen_q, nheads, _ = q_shape
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal)
    assert out.shape == q_shape and out.dtype == np.float16 and (out == 0).all()
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == np.float32
    assert (lse == -np.inf).all()
    assert cupyflash.flash_attn(q, k, v, causal=causal).shape == q_shape
    dq, dk, dv = cupyflash.flash_attn_bwd(q, q, k, v, out, lse, causal=causal)
    assert dq.shape == q_shape and dk.shape == kv_shape and dv.shape == kv_shape
    for g in (dq, dk, dv):
        assert g.dtype == np.float16 and (g == 0).all()


# ----------------------------------------------------------------------------
# GPU dispatch, with a fake cupy and a fake _gpu module
# ----------------------------------------------------------------------------




@pytest.fixture
def fake_gpu(monkeypatch):
    """Installs fake ``cupy`` and GPU modules; returns the plans made (kind, keywords)."""
    plans, _ = install_fake_gpu(monkeypatch)
    monkeypatch.setattr(cpu, "fwd", _must_not_run)
    monkeypatch.setattr(cpu, "bwd", _must_not_run)
    return plans


def _gpu_args(dtype=np.float16, device_id=0):
    return {name: FakeCupyArray(x, device_id) for name, x in _valid_args(dtype).items()}


def test_cupy_arrays_go_to_gpu_fwd(fake_gpu):
    a = _gpu_args()
    out, lse = cupyflash.flash_attn_fwd(a["q"], a["k"], a["v"], causal=np.bool_(True))
    assert isinstance(out, FakeCupyArray) and out.shape == a["q"].shape and out.dtype == np.float16
    assert isinstance(lse, FakeCupyArray) and lse.shape == (2, 4, 5) and lse.dtype == np.float32
    out = cupyflash.flash_attn(a["q"], a["k"], a["v"], softmax_scale=0.25)
    assert isinstance(out, FakeCupyArray) and out.shape == a["q"].shape
    (name, kwargs), (name2, kwargs2) = fake_gpu
    assert name == name2 == "fwd"
    assert kwargs == dict(softmax_scale=1 / math.sqrt(8), causal=True, dtype_name="float16", device_id=0)
    assert type(kwargs["causal"]) is bool and type(kwargs["softmax_scale"]) is float
    assert kwargs2 == dict(softmax_scale=0.25, causal=False, dtype_name="float16", device_id=0)


def test_cupy_arrays_go_to_gpu_bwd(fake_gpu):
    a = _gpu_args()
    dq, dk, dv = cupyflash.flash_attn_bwd(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"],
                                          softmax_scale=2, causal=True, deterministic=np.bool_(True))
    assert [x.shape for x in (dq, dk, dv)] == [a["q"].shape, a["k"].shape, a["v"].shape]
    [(name, kwargs)] = fake_gpu
    assert name == "bwd"
    assert kwargs == dict(softmax_scale=2.0, causal=True, deterministic=True, dtype_name="float16",
                          device_id=0)
    assert type(kwargs["deterministic"]) is bool


def test_cupy_empty_inputs_do_not_reach_the_gpu_module(fake_gpu):
    q = FakeCupyArray(np.ones((2, 5, 4, 8), np.float16))
    kv = FakeCupyArray(np.ones((2, 0, 2, 8), np.float16))
    out, lse = cupyflash.flash_attn_fwd(q, kv, kv)
    assert isinstance(out, FakeCupyArray) and (out.host == 0).all()
    assert lse.shape == (2, 4, 5) and (lse.host == -np.inf).all()
    dq, dk, dv = cupyflash.flash_attn_bwd(q, q, kv, kv, out, lse)
    assert dq.shape == (2, 5, 4, 8) and dk.shape == (2, 0, 2, 8) and (dq.host == 0).all()
    assert fake_gpu == []


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_cupy_float32_is_rejected(fake_gpu, fn_name):
    a = _gpu_args(np.float32)
    with pytest.raises(TypeError, match=rf"^cupyflash\.{fn_name}: q must have dtype float16 or "
                                        r"bfloat16 on the GPU path .*; got float32\.$"):
        _call(fn_name, a)


@pytest.mark.parametrize("fn_name", FUNCTIONS)
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_mixed_numpy_and_cupy_is_rejected(fake_gpu, fn_name, arg):
    a = _gpu_args()
    a[arg] = a[arg].host
    with pytest.raises(TypeError, match=rf"^cupyflash\.{fn_name}: . must be a "):
        _call(fn_name, a)


@pytest.mark.parametrize("arg", ["dout", "out", "lse"])
def test_mixed_numpy_and_cupy_is_rejected_in_bwd(fake_gpu, arg):
    a = _gpu_args()
    a[arg] = a[arg].host
    with pytest.raises(TypeError, match=rf"^cupyflash\.flash_attn_bwd: {arg} must be a "
                                        r"cupy\.ndarray like q .*; got numpy\.ndarray\.$"):
        _call("flash_attn_bwd", a)


@pytest.mark.parametrize("arg", ["k", "v", "dout", "out", "lse"])
def test_inputs_on_different_devices_are_rejected(fake_gpu, arg):
    a = _gpu_args()
    a[arg] = FakeCupyArray(a[arg].host, device_id=1)
    fn_name = "flash_attn_bwd" if arg in ("dout", "out", "lse") else "flash_attn_fwd"
    with pytest.raises(ValueError, match=rf"^cupyflash\.{fn_name}: {arg} must be on the same "
                                         r"device as q \(cuda:0\); got cuda:1\.$"):
        _call(fn_name, a)


def test_gpu_dtypes_table():
    assert _checks.GPU_DTYPES == ("float16", "bfloat16")  # bfloat16 as uint16/int16 + dtype=
    assert _checks.GPU_STORAGE_DTYPES == ("uint16", "int16")
    assert set(_checks.CPU_DTYPES) == {"float16", "bfloat16", "float32", "float64"}


@pytest.mark.parametrize("kwargs, message", [
    ({"sinks": np.full(2, 3e38, np.float32)}, "sinks must be at most 1e+30 in magnitude"),
    ({"alibi_slopes": np.full(2, -3e38, np.float32)}, "alibi_slopes must be at most 1e+30 in magnitude"),
    ({"softcap": 1e-30, "softmax_scale": 1e10}, "softmax_scale / softcap must be finite in float32"),
    ({"dropout_p": 1 - 2**-40, "rng_state": (1, 2)}, "dropout_p must be at most 1 - 2**-16"),
    ({"dropout_p": 1 - 2**-17, "rng_state": (1, 2)}, "dropout_p must be at most 1 - 2**-16"),
])
def test_variant_values_outside_float32_reach_are_refused(kwargs, message):
    """Values each within their own rule whose products in the kernels' float32 would
    overflow (sink * log2(e), slope * log2(e), scale / softcap), or a keep fraction a
    16-bit comparison cannot draw: ValueError, not NaN or a wrong lse."""
    q = np.random.default_rng(0).standard_normal((1, 4, 2, 8)).astype(np.float32)
    for fn in ("flash_attn_fwd", "flash_attn"):
        with pytest.raises(ValueError, match=re.escape(f"cupyflash.{fn}: {message}")):
            getattr(cupyflash, fn)(q, q, q, **kwargs)
    cupyflash.flash_attn_fwd(q, q, q, sinks=np.full(2, -np.inf, np.float32))  # -inf: no sink, still taken


# Before: a dict raised KeyError: 0 from inside check_variants, a set or a generator a
# bare "object is not subscriptable", and bytes b"12" ran with seed 49 and offset 50.
@pytest.mark.parametrize("rng_state", [{1: 2, 3: 4}, {1, 2}, (x for x in (1, 2)), b"12", "12",
                                       np.array([[1, 2]]), np.array(7), (1, 2, 3)],
                         ids=["dict", "set", "generator", "bytes", "str", "2d-array", "0d-array", "three"])
@pytest.mark.parametrize("fn", ["flash_attn_fwd", "flash_attn", "flash_attn_bwd"])
def test_rng_state_that_is_not_a_pair_is_named(fn, rng_state):
    q = np.random.default_rng(0).standard_normal((1, 4, 2, 8)).astype(np.float32)
    args = (q, q, q) if fn != "flash_attn_bwd" else (q, q, q, q, q, np.zeros((1, 2, 4), np.float32))
    with pytest.raises(TypeError, match=re.escape(f"cupyflash.{fn}: rng_state must be None or a pair "
                                                  f"of ints (seed, offset); got ")):
        getattr(cupyflash, fn)(*args, dropout_p=0.25, rng_state=rng_state)
    # the forms that are pairs: a tuple, a list, a 1-D array of two ints
    for pair in ((3, 4), [3, 4], np.array([3, 4], np.uint64)):
        getattr(cupyflash, fn)(*args, dropout_p=0.25, rng_state=pair)


# ----------------------------------------------------------------------------
# attn_bias / attn_mask / return_dbias (issue 14): bad input, the options the GPU
# side is given, and the plain call left untouched
# ----------------------------------------------------------------------------

# The valid arguments' scores are (batch, nheads_q, seqlen_q, seqlen_k) = (2, 4, 5, 7).
_FULL = "(batch, nheads_q, seqlen_q, seqlen_k) = (2, 4, 5, 7)"

# (id, exception, argument named, text in the message, kwargs given the valid args)
SCORE_CASES = [
    ("bias-rank5", ValueError, "attn_bias", "must have at most 4 dimensions, broadcastable to (batch, nheads_q, "
     "seqlen_q, seqlen_k); got 5 with shape (1, 2, 4, 5, 7).", lambda a: {"attn_bias": np.zeros((1, 2, 4, 5, 7),
                                                                                                  np.float32)}),
    ("bias-heads-3", ValueError, "attn_bias", f"must be broadcastable to {_FULL}, each dimension 1 or full "
     f"(left-padded with 1s to 4 dimensions); got shape (2, 3, 5, 7), whose nheads_q is 3.",
     lambda a: {"attn_bias": np.zeros((2, 3, 5, 7), np.float32)}),
    ("bias-seqlen_k", ValueError, "attn_bias", "got shape (5, 6), whose seqlen_k is 6.",
     lambda a: {"attn_bias": np.zeros((5, 6), np.float32)}),
    ("bias-seqlen_q-padded", ValueError, "attn_bias", "got shape (2, 7), whose seqlen_q is 2.",
     lambda a: {"attn_bias": np.zeros((2, 7), np.float32)}),
    ("bias-batch", ValueError, "attn_bias", "got shape (3, 1, 1, 7), whose batch is 3.",
     lambda a: {"attn_bias": np.zeros((3, 1, 1, 7), np.float32)}),
    ("bias-float64", TypeError, "attn_bias", "must have q's dtype (float32) or float32; got float64.",
     lambda a: {"attn_bias": np.zeros((5, 7))}),
    ("bias-float16", TypeError, "attn_bias", "must have q's dtype (float32) or float32; got float16.",
     lambda a: {"attn_bias": np.zeros((5, 7), np.float16)}),
    ("bias-int", TypeError, "attn_bias", "got int64.", lambda a: {"attn_bias": np.zeros((5, 7), np.int64)}),
    ("bias-big-endian", TypeError, "attn_bias", "got big-endian float32.",
     lambda a: {"attn_bias": np.zeros((5, 7), ">f4")}),
    ("bias-bool", TypeError, "attn_bias", "got bool.", lambda a: {"attn_bias": np.ones((5, 7), bool)}),
    ("bias-list", TypeError, "attn_bias", "must be a numpy.ndarray or cupy.ndarray; got list.",
     lambda a: {"attn_bias": [[0.0] * 7] * 5}),
    ("bias-float", TypeError, "attn_bias", "must be a numpy.ndarray or cupy.ndarray; got float.",
     lambda a: {"attn_bias": 0.5}),
    ("bias-masked-array", TypeError, "attn_bias", "must not be a numpy.ma.MaskedArray",
     lambda a: {"attn_bias": np.ma.masked_array(np.zeros((5, 7), np.float32))}),
    ("mask-int", TypeError, "attn_mask", "must have dtype bool (True = attend; a float mask belongs in attn_bias); "
     "got int32.", lambda a: {"attn_mask": np.ones((5, 7), np.int32)}),
    ("mask-float", TypeError, "attn_mask", "a float mask belongs in attn_bias); got float32.",
     lambda a: {"attn_mask": np.zeros((5, 7), np.float32)}),
    ("mask-uint8", TypeError, "attn_mask", "got uint8.", lambda a: {"attn_mask": np.ones((5, 7), np.uint8)}),
    ("mask-rank5", ValueError, "attn_mask", "must have at most 4 dimensions",
     lambda a: {"attn_mask": np.ones((1, 1, 1, 1, 7), bool)}),
    ("mask-keys", ValueError, "attn_mask", "got shape (2, 1, 5, 8), whose seqlen_k is 8.",
     lambda a: {"attn_mask": np.ones((2, 1, 5, 8), bool)}),
    ("mask-tuple", TypeError, "attn_mask", "must be a numpy.ndarray or cupy.ndarray; got tuple.",
     lambda a: {"attn_mask": (True, False)}),
]

SCORE_BWD_CASES = [
    ("return_dbias-without-bias", ValueError, "return_dbias", "must be False without attn_bias (dbias is the "
     "gradient of attn_bias); got True with attn_bias=None.", lambda a: {"return_dbias": True}),
    ("return_dbias-with-mask-only", ValueError, "return_dbias", "must be False without attn_bias",
     lambda a: {"return_dbias": True, "attn_mask": np.ones((5, 7), bool)}),
    ("return_dbias-int", TypeError, "return_dbias", "must be a bool; got int.",
     lambda a: {"return_dbias": 1, "attn_bias": np.zeros((5, 7), np.float32)}),
    ("return_dbias-none", TypeError, "return_dbias", "must be a bool; got NoneType.",
     lambda a: {"return_dbias": None}),
]


def _score_cases():
    for fn_name in FUNCTIONS:
        for case in SCORE_CASES:
            yield pytest.param(fn_name, *case[1:], id=f"{fn_name}-{case[0]}")
    for case in SCORE_BWD_CASES:
        yield pytest.param("flash_attn_bwd", *case[1:], id=f"flash_attn_bwd-{case[0]}")


@pytest.mark.parametrize("fn_name,exc_type,arg,text,make", list(_score_cases()))
def test_bad_bias_and_mask(monkeypatch, fn_name, exc_type, arg, text, make):
    monkeypatch.setattr(cpu, "fwd", _must_not_run)
    monkeypatch.setattr(cpu, "bwd", _must_not_run)
    args = _valid_args()
    with pytest.raises(exc_type) as info:
        _call(fn_name, args, **make(args))
    message = str(info.value)
    assert message.startswith(f"cupyflash.{fn_name}: {arg} must "), message
    assert text in message, message
    assert message.endswith("."), message


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_a_float64_bias_with_float16_inputs_is_refused(fn_name):
    with pytest.raises(TypeError, match=re.escape(f"cupyflash.{fn_name}: attn_bias must have q's dtype (float16) "
                                                  f"or float32; got float64.")):
        _call(fn_name, _valid_args(np.float16), attn_bias=np.zeros((1, 4, 5, 7)))


@pytest.mark.parametrize("q_dtype,bias_dtype", [("float16", "float16"), ("float16", "float32"),
                                                ("float32", "float32"), ("float64", "float64"),
                                                ("float64", "float32"), ("bfloat16", "bfloat16"),
                                                ("bfloat16", "float32")])
def test_bias_dtypes_taken(q_dtype, bias_dtype):
    if "bfloat16" in (q_dtype, bias_dtype):
        pytest.importorskip("ml_dtypes")
    from cupyflash import testing

    args = _valid_args(testing.resolve_dtype(q_dtype))
    bias = np.zeros((2, 1, 5, 7), testing.resolve_dtype(bias_dtype))
    out, lse = _call("flash_attn_fwd", args, attn_bias=bias, attn_mask=np.ones(7, bool))
    assert out.dtype == args["q"].dtype
    *_, dbias = _call("flash_attn_bwd", dict(args, out=out, lse=lse), attn_bias=bias, return_dbias=True)
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype


@pytest.mark.parametrize("shape", [(), (7,), (1, 7), (5, 1), (4, 5, 7), (2, 1, 1, 7), (1, 4, 1, 1), (2, 4, 5, 7)])
def test_broadcastable_shapes_are_taken(shape):
    args = _valid_args()
    out, lse = _call("flash_attn_fwd", args, attn_bias=np.zeros(shape, np.float32),
                     attn_mask=np.ones(shape, bool))
    *_, dbias = _call("flash_attn_bwd", dict(args, out=out, lse=lse), attn_bias=np.zeros(shape, np.float32),
                      return_dbias=True)
    assert dbias.shape == shape


def test_check_variants_gives_4d_views():
    """The interface with the GPU side: options["attn_bias"] / ["attn_mask"] are the
    user's arrays left-padded to 4-D by indexing (views of the same memory, with the
    same strides: never broadcast or copied), options["return_dbias"] is True."""
    args = _valid_args()
    q = args["q"]
    wide = np.zeros((5, 20), np.float32)
    bias = wide[:, 2:16:2]  # (5, 7), key stride 2
    mask = np.ones((1, 4, 1, 7), bool)
    options = _checks.check_variants("flash_attn_bwd", q, False, 0.0, (-1, -1), None, 0.0, None, None,
                                     attn_bias=bias, attn_mask=mask, return_dbias=True, seqlens=(5, 7))
    assert set(options) == {"attn_bias", "attn_mask", "return_dbias"} and options["return_dbias"] is True
    b4, m4 = options["attn_bias"], options["attn_mask"]
    assert b4.shape == (1, 1, 5, 7) and b4.strides[2:] == bias.strides and np.shares_memory(b4, wide)
    assert b4.base is bias or b4.base is bias.base
    assert m4 is mask  # already 4-D: the array itself
    assert m4.dtype == np.bool_ and b4.dtype == np.float32
    none = _checks.check_variants("flash_attn_bwd", q, False, 0.0, (-1, -1), None, 0.0, None, None)
    assert none == {}
    # varlen: batch = the number of sequences, seqlens the max lengths
    packed = np.zeros((12, 4, 8), np.float32)
    options = _checks.check_variants("flash_attn_varlen_fwd", packed, False, 0.0, (-1, -1), None, 0.0, None, None,
                                     batch=3, attn_bias=np.zeros((3, 1, 6, 9), np.float32), seqlens=(6, 9))
    assert options["attn_bias"].shape == (3, 1, 6, 9)
    with pytest.raises(ValueError, match=re.escape("(batch, nheads_q, max_seqlen_q, max_seqlen_k) = (3, 4, 6, 9)")
                       + r".*got shape \(12, 1, 6, 9\), whose batch is 12\.$"):
        _checks.check_variants("flash_attn_varlen_fwd", packed, False, 0.0, (-1, -1), None, 0.0, None, None,
                               batch=3, attn_bias=np.zeros((12, 1, 6, 9), np.float32), seqlens=(6, 9))


def test_a_plain_call_takes_the_hot_path(monkeypatch):
    """The defaults (None, None, False) divert nothing: no variant validation runs."""
    from cupyflash import _api

    monkeypatch.setattr(_api, "_variant_fwd", _must_not_run)
    monkeypatch.setattr(_api, "_variant_bwd", _must_not_run)
    args = _valid_args()
    for fn_name in FUNCTIONS:
        _call(fn_name, args, attn_bias=None, attn_mask=None)
    _call("flash_attn_bwd", args, return_dbias=False)


def test_options_given_off_are_the_plain_call(monkeypatch):
    """np.False_ for return_dbias is validated, then runs the plain path (3 results)."""
    args = _valid_args()
    plain = _call("flash_attn_bwd", args)
    same = _call("flash_attn_bwd", args, return_dbias=np.False_)
    assert len(same) == 3
    for a, b in zip(plain, same):
        np.testing.assert_array_equal(a, b)


class _ArrayFake(FakeCupyArray):
    """A fake cupy array with the methods dbias's finishing step uses."""

    def reshape(self, shape):
        return _ArrayFake(self.host.reshape(shape), self.device.id)

    def astype(self, dtype, copy=True):
        return _ArrayFake(self.host.astype(dtype, copy=copy), self.device.id)


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_gpu_bias_and_mask_go_to_the_variant_entries(monkeypatch, fn_name):
    """On cupy arrays the checked options reach _gpu.variant_fwd / _gpu_bwd.variant_bwd
    as 4-D views of the user's arrays; the backward's dbias (float32, 4-D) comes back
    in the bias's shape and dtype, after dsinks."""
    install_fake_gpu(monkeypatch)
    a = _gpu_args()
    bias = FakeCupyArray(np.arange(35, dtype=np.float16).reshape(5, 7))
    mask = FakeCupyArray(np.ones((2, 1, 1, 7), bool))
    sinks = FakeCupyArray(np.zeros(4, np.float32))
    seen = {}

    def fwd(q, k, v, out, lse, **kwargs):
        seen.update(kwargs)
        return "out", "lse"

    def bwd(dout, q, k, v, out, lse, **kwargs):
        seen.update(kwargs)
        dbias4 = _ArrayFake(np.full((1, 1, 5, 7), 0.5, np.float32))
        return "dq", "dk", "dv", "dsinks", dbias4

    cupyflash._gpu.variant_fwd = fwd  # the fake modules install_fake_gpu put in place
    cupyflash._gpu_bwd.variant_bwd = bwd
    extra = {"return_dbias": True} if fn_name == "flash_attn_bwd" else {}
    result = _call(fn_name, a, attn_bias=bias, attn_mask=mask, sinks=sinks, **extra)
    options = seen["options"]
    assert options["attn_bias"].shape == (1, 1, 5, 7) and np.shares_memory(options["attn_bias"].host, bias.host)
    assert options["attn_mask"] is mask and options["sinks"] is sinks
    assert options.get("return_dbias", False) is (fn_name == "flash_attn_bwd")
    if fn_name == "flash_attn_bwd":
        assert result[:4] == ("dq", "dk", "dv", "dsinks")
        dbias = result[4]
        assert isinstance(dbias, FakeCupyArray) and dbias.shape == (5, 7) and dbias.dtype == np.float16
        assert (dbias.host == 0.5).all()


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_gpu_bias_checks(monkeypatch, fn_name):
    install_fake_gpu(monkeypatch)
    a = _gpu_args()
    with pytest.raises(TypeError, match=re.escape(f"cupyflash.{fn_name}: attn_bias must be a cupy.ndarray like q "
                                                  f"(numpy and cupy inputs cannot be mixed); got numpy.ndarray.")):
        _call(fn_name, a, attn_bias=np.zeros((5, 7), np.float16))
    with pytest.raises(ValueError, match=re.escape(f"cupyflash.{fn_name}: attn_mask must be on the same device as "
                                                   f"q (cuda:0); got cuda:1.")):
        _call(fn_name, a, attn_mask=FakeCupyArray(np.ones((5, 7), bool), device_id=1))
    with pytest.raises(TypeError, match=re.escape(f"cupyflash.{fn_name}: attn_bias must have q's dtype (float16) "
                                                  f"or float32; got float64.")):
        _call(fn_name, a, attn_bias=FakeCupyArray(np.zeros((5, 7))))
    odd = np.ndarray((5, 7), np.float16, buffer=np.zeros(200, np.uint8), strides=(21, 3))  # 3-byte key stride
    with pytest.raises(ValueError, match=re.escape(f"cupyflash.{fn_name}: attn_bias must have strides in whole "
                                                   f"elements on the GPU (multiples of 2 bytes); got strides of "
                                                   f"(21, 3) bytes.")):
        _call(fn_name, a, attn_bias=FakeCupyArray(odd))
    # numpy q with a cupy bias
    with pytest.raises(TypeError, match=re.escape(f"cupyflash.{fn_name}: attn_bias must be a numpy.ndarray like q "
                                                  f"(numpy and cupy inputs cannot be mixed); got cupy.ndarray.")):
        _call(fn_name, _valid_args(), attn_bias=FakeCupyArray(np.zeros((5, 7), np.float32)))


def test_gpu_bf16_storage_bias(monkeypatch):
    """bfloat16 data in uint16 storage with dtype="bfloat16": a uint16 bias is q's
    dtype, an int16 one is not; dbias comes back as bfloat16 bits in uint16."""
    from cupyflash import _api, testing

    install_fake_gpu(monkeypatch)
    a = {name: FakeCupyArray(testing.to_bf16_bits(x.host.astype(np.float32)) if name != "lse" else x.host)
         for name, x in _gpu_args().items()}
    bias = FakeCupyArray(np.zeros((2, 4, 5, 7), np.uint16))
    cupyflash._gpu.variant_fwd = lambda *args, **kwargs: ("out", "lse")
    _call("flash_attn_fwd", a, dtype="bfloat16", attn_bias=bias)
    with pytest.raises(TypeError, match=re.escape("attn_bias must have q's dtype (uint16) or float32; got int16.")):
        _call("flash_attn_fwd", a, dtype="bfloat16", attn_bias=FakeCupyArray(np.zeros((5, 7), np.int16)))
    # the finishing step, on the host: float32 -> bfloat16 bits (round to nearest even), float16 bits
    values = np.array([[1.0, -2.5, 3.14159, np.nan, 1e-30, 65504.0]], np.float32)
    bits = _api._finish_dbias(values[None, None], np.zeros(6, np.uint16), "bfloat16")
    assert bits.shape == (6,) and bits.dtype == np.uint16
    np.testing.assert_array_equal(bits[[0, 1, 2, 4, 5]], testing.to_bf16_bits(values[0, [0, 1, 2, 4, 5]]))
    assert np.isnan(testing.from_bf16_bits(bits[3]))
    half = _api._finish_dbias(values[None, None], np.zeros((1, 6), np.int16), "float16")
    assert half.dtype == np.int16
    np.testing.assert_array_equal(half.view(np.float16), values.astype(np.float16))


# The varlen functions: q (12, 4, 8) in 3 sequences, max_seqlen_q = max_seqlen_k = 7.
_PACKED_FULL = "(batch, nheads_q, max_seqlen_q, max_seqlen_k) = (3, 4, 7, 7)"
VARLEN_SCORE_CASES = [
    ("bias-total-rows", ValueError, "attn_bias", f"must be broadcastable to {_PACKED_FULL}, each dimension 1 or "
     f"full (left-padded with 1s to 4 dimensions); got shape (12, 7), whose max_seqlen_q is 12.",
     {"attn_bias": np.zeros((12, 7), np.float32)}),
    ("bias-batch", ValueError, "attn_bias", "got shape (2, 1, 7, 7), whose batch is 2.",
     {"attn_bias": np.zeros((2, 1, 7, 7), np.float32)}),
    ("bias-rank5", ValueError, "attn_bias", "must have at most 4 dimensions, broadcastable to (batch, nheads_q, "
     "max_seqlen_q, max_seqlen_k); got 5", {"attn_bias": np.zeros((1, 3, 4, 7, 7), np.float32)}),
    ("bias-float64", TypeError, "attn_bias", "must have q's dtype (float32) or float32; got float64.",
     {"attn_bias": np.zeros(7)}),
    ("mask-float", TypeError, "attn_mask", "a float mask belongs in attn_bias); got float64.",
     {"attn_mask": np.zeros((7, 7))}),
    ("mask-list", TypeError, "attn_mask", "must be a numpy.ndarray or cupy.ndarray; got list.",
     {"attn_mask": [True] * 7}),
]


def _varlen_score_cases():
    import test_varlen

    for fn_name in test_varlen.FUNCTIONS:
        for case in VARLEN_SCORE_CASES:
            yield pytest.param(fn_name, *case[1:], id=f"{fn_name}-{case[0]}")
    yield pytest.param("flash_attn_varlen_bwd", ValueError, "return_dbias", "must be False without attn_bias",
                       {"return_dbias": True}, id="flash_attn_varlen_bwd-return_dbias-without-bias")
    yield pytest.param("flash_attn_varlen_bwd", TypeError, "return_dbias", "must be a bool; got str.",
                       {"return_dbias": "yes", "attn_bias": np.zeros(7, np.float32)},
                       id="flash_attn_varlen_bwd-return_dbias-str")


@pytest.mark.parametrize("fn_name,exc_type,arg,text,kwargs", list(_varlen_score_cases()))
def test_bad_varlen_bias_and_mask(monkeypatch, fn_name, exc_type, arg, text, kwargs):
    import test_varlen

    monkeypatch.setattr(cpu, "fwd", _must_not_run)
    monkeypatch.setattr(cpu, "bwd", _must_not_run)
    with pytest.raises(exc_type) as info:
        test_varlen._call(fn_name, test_varlen._valid_args(), **kwargs)
    message = str(info.value)
    assert message.startswith(f"cupyflash.{fn_name}: {arg} must "), message
    assert text in message, message
    assert message.endswith("."), message


@pytest.mark.parametrize("fn_name", ["flash_attn_varlen_fwd", "flash_attn_varlen", "flash_attn_varlen_bwd"])
def test_gpu_varlen_bias_goes_to_the_variant_entries(monkeypatch, fn_name):
    """Packed cupy arrays: the options (4-D views) and the packed batch reach the GPU
    variant entries; dbias comes back in the bias's shape and dtype."""
    import test_varlen

    install_fake_gpu(monkeypatch)
    a = {name: (FakeCupyArray(x.astype(np.float16) if x.dtype == np.float32 and name != "lse" else x)
                if isinstance(x, np.ndarray) else x) for name, x in test_varlen._valid_args().items()}
    bias = FakeCupyArray(np.zeros((3, 1, 7, 7), np.float32))
    mask = FakeCupyArray(np.ones((7,), bool))
    seen = {}

    def record(*args, **kwargs):
        seen.update(kwargs)
        return ("dq", "dk", "dv", _ArrayFake(np.ones((3, 1, 7, 7), np.float32))) if "deterministic" in kwargs \
            else ("out", "lse")

    cupyflash._gpu.variant_fwd = record
    cupyflash._gpu_bwd.variant_bwd = record
    extra = {"return_dbias": True} if fn_name.endswith("bwd") else {}
    result = test_varlen._call(fn_name, a, attn_bias=bias, attn_mask=mask, **extra)
    assert seen["options"]["attn_bias"] is bias and seen["options"]["attn_mask"].shape == (1, 1, 1, 7)
    assert seen["packed"][0] is a["cu_seqlens_q"] and seen["packed"][2:] == (7, 7)
    if fn_name.endswith("bwd"):
        assert seen["options"]["return_dbias"] is True
        assert result[3].shape == (3, 1, 7, 7) and result[3].dtype == np.float32 and (result[3].host == 1).all()
