"""Interop without a GPU: routing, errors, ``dtype=``, DLPack capsules, and torch/JAX on the CPU.

The torch and JAX tests skip (with the reason) where those frameworks are not
installed; everything else needs only NumPy.  GPU dispatch of ``dtype=`` is
tested with a fake ``cupy`` module and a fake ``cupyflash._gpu``, as in
``test_api_checks``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import cupyflash
from cupyflash import _interop, cpu
from fakes import FakeCupyArray, install_fake_gpu

REPO = Path(__file__).resolve().parents[1]
FUNCTIONS = ("flash_attn_fwd", "flash_attn", "flash_attn_bwd")


def _qkv(rng, dtype=np.float32, sq=9, sk=13, hq=4, hkv=2, d=8):
    def draw(shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    return draw((2, sq, hq, d)), draw((2, sk, hkv, d)), draw((2, sk, hkv, d))


def _call(fn_name, q, k, v, **kwargs):
    fn = getattr(cupyflash, fn_name)
    if fn_name == "flash_attn_bwd":
        out, lse = cupyflash.flash_attn_fwd(*(_plain(x) for x in (q, k, v)))
        return fn(q, q, k, v, _like(q, out), _like(q, lse), **kwargs)
    return fn(q, k, v, **kwargs)


def _plain(x):
    return x.array if isinstance(x, DLPackOnly) else x


def _like(x, a):
    return DLPackOnly(a) if isinstance(x, DLPackOnly) else a


class DLPackOnly:
    """An array type cupyflash does not know, with only the DLPack protocol (CPU memory)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class Opaque:
    """Not an array at all."""


# ----------------------------------------------------------------------------
# NumPy and CuPy stay on their path; the type of every argument is looked at once
# ----------------------------------------------------------------------------


def test_numpy_path_is_unchanged(monkeypatch, rng):
    q, k, v = _qkv(rng)
    want = cpu.fwd(q, k, v, 1 / np.sqrt(8), True)

    def no_interop(*args, **kwargs):
        raise AssertionError("numpy arrays went through _interop")

    monkeypatch.setattr(_interop, "call", no_interop)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    np.testing.assert_array_equal(out, want[0])
    np.testing.assert_array_equal(lse, want[1])
    dq, _, _ = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, causal=True)
    assert isinstance(dq, np.ndarray)


@pytest.mark.parametrize("x,kind", [
    (np.zeros(3), "numpy"), (np.ma.zeros(3), "numpy"), ([1.0], None), (1.0, None),
    (Opaque(), None), (DLPackOnly(np.zeros(3)), f"other:{__name__.partition('.')[0]}"),
])
def test_kind(x, kind):
    assert _interop.kind(x) == kind
    assert _interop.foreign(x) == (kind not in ("numpy", "cupy", None))


def test_import_does_not_import_frameworks(tmp_path):
    """Calls on NumPy arrays and on an unknown DLPack type import neither torch, JAX nor cupy."""
    code = (
        "import sys, numpy as np, cupyflash, cupyflash._interop\n"
        "q = np.ones((1, 4, 2, 8), np.float32)\n"
        "cupyflash.flash_attn(q, q, q)\n"
        "class D:\n"
        "    def __init__(self, a): self.a = a\n"
        "    def __dlpack__(self, **kw): return self.a.__dlpack__(**kw)\n"
        "    def __dlpack_device__(self): return self.a.__dlpack_device__()\n"
        "assert type(cupyflash.flash_attn(D(q), D(q), D(q))) is np.ndarray\n"
        "print(sorted(m for m in ('cupy', 'torch', 'jax', 'jaxlib') if m in sys.modules))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ----------------------------------------------------------------------------
# Unknown DLPack arrays on the CPU: viewed in place, results are NumPy arrays
# ----------------------------------------------------------------------------


def test_dlpack_object_is_viewed_in_place(monkeypatch, rng):
    q, k, v = _qkv(rng)
    seen = {}
    real_fwd = cpu.fwd

    def spy(q_, k_, v_, *args):
        seen["ptrs"] = [a.ctypes.data for a in (q_, k_, v_)]
        return real_fwd(q_, k_, v_, *args)

    monkeypatch.setattr(cpu, "fwd", spy)
    out = cupyflash.flash_attn(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v), causal=True)
    assert seen["ptrs"] == [a.ctypes.data for a in (q, k, v)]
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, real_fwd(q, k, v, 1 / np.sqrt(8), True)[0])


# ----------------------------------------------------------------------------
# Mixed or unsupported arguments: TypeError naming the argument
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("fn_name", FUNCTIONS)
@pytest.mark.parametrize("arg", ["k", "v"])
def test_dlpack_object_mixed_with_numpy_is_rejected(rng, fn_name, arg):
    q, k, v = _qkv(rng)
    args = {"q": DLPackOnly(q), "k": DLPackOnly(k), "v": DLPackOnly(v)}
    args[arg] = args[arg].array
    with pytest.raises(TypeError, match=rf"^cupyflash\.{fn_name}: {arg} must be a "
                                        r".*DLPackOnly like q \(array types cannot be mixed\); "
                                        r"got numpy\.ndarray\.$"):
        _call(fn_name, args["q"], args["k"], args["v"])


def test_numpy_q_with_dlpack_k_is_rejected(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn: k must be a numpy\.ndarray like "
                                        r"q \(array types cannot be mixed\); got .*DLPackOnly\.$"):
        cupyflash.flash_attn(q, DLPackOnly(k), v)


def test_non_array_q_with_dlpack_k_is_rejected(rng):
    _, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn: q must be a numpy\.ndarray, "
                                        r"cupy\.ndarray, torch\.Tensor, jax\.Array or an array "
                                        r"with __dlpack__ .*; got list\.$"):
        cupyflash.flash_attn([1.0], DLPackOnly(k), DLPackOnly(v))


class OnDevice(DLPackOnly):
    """A DLPack array that says it lives on another device type (Metal, ROCm, ...)."""

    def __init__(self, array, device_type):
        super().__init__(array)
        self.device_type = device_type

    def __dlpack_device__(self):
        return (self.device_type, 0)


# Before: cupy.from_dlpack was handed it and raised its own error (or, with no NVIDIA
# driver, a CUDARuntimeError: cudaErrorInsufficientDriver) from inside cupyflash.
@pytest.mark.parametrize("device_type,label", [(8, "Metal"), (10, "ROCm"), (4, "OpenCL"), (99, "unknown")])
def test_dlpack_object_on_an_unsupported_device_is_named(rng, device_type, label):
    q, k, v = _qkv(rng)
    for arg in ("q", "k"):
        args = {"q": DLPackOnly(q), "k": DLPackOnly(k), "v": DLPackOnly(v)}
        args[arg] = OnDevice(args[arg].array, device_type)
        with pytest.raises(TypeError, match=rf"^cupyflash\.flash_attn: {arg} must be in CPU or CUDA "
                                            rf"memory \(DLPack device type 1 or 2\); got a .*OnDevice on "
                                            rf"DLPack device type {device_type} \({label}\)\.$"):
            cupyflash.flash_attn(args["q"], args["k"], args["v"])


def test_opaque_object_is_rejected_by_the_checks(rng):
    _, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=r"q must be a numpy\.ndarray or cupy\.ndarray; got "
                                        r".*Opaque\.$"):
        cupyflash.flash_attn(Opaque(), k, v)


def test_dtype_with_dlpack_object_is_rejected(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn: dtype must be None for "
                                        r".*DLPackOnly inputs"):
        cupyflash.flash_attn(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v), dtype="bfloat16")


# ----------------------------------------------------------------------------
# dtype= : only to name the element type of 2-byte storage on the GPU
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("fn_name", FUNCTIONS)
@pytest.mark.parametrize("dtype", ["float32", np.float32, np.dtype(np.float32)])
def test_dtype_naming_the_numpy_dtype_is_accepted(rng, fn_name, dtype):
    q, k, v = _qkv(rng)
    _call(fn_name, q, k, v, dtype=dtype)


@pytest.mark.parametrize("fn_name", FUNCTIONS)
@pytest.mark.parametrize("dtype,text", [
    ("bfloat16", ("dtype must be None or q's own dtype (float32): dtype= only names the element "
                  "type of uint16/int16 storage in cupy arrays (use ml_dtypes.bfloat16 for "
                  "numpy); got 'bfloat16'.")),
    ("float16", "got 'float16'."),
    (42, "dtype must be None or a dtype name such as 'bfloat16'; got int."),
    (Opaque(), "dtype must be None or a dtype name such as 'bfloat16'; got "),
])
def test_dtype_on_numpy_is_rejected(rng, fn_name, dtype, text):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError) as info:
        _call(fn_name, q, k, v, dtype=dtype)
    message = str(info.value)
    assert message.startswith(f"cupyflash.{fn_name}: dtype must "), message
    assert text in message and message.endswith("."), message


def test_numpy_uint16_with_bfloat16_is_rejected(rng):
    q, k, v = (x.view(np.uint16) for x in _qkv(rng, np.float16))
    with pytest.raises(TypeError, match="dtype= only names the element type of uint16/int16 "
                                        "storage in cupy arrays"):
        cupyflash.flash_attn(q, k, v, dtype="bfloat16")




@pytest.fixture
def fake_gpu(monkeypatch):
    """Fake ``cupy`` and GPU modules; returns the plans made, ``(kind, keywords)``."""
    plans, _ = install_fake_gpu(monkeypatch)
    return plans


def _gpu_args(rng, storage):
    q, k, v = (x.view(storage) for x in _qkv(rng, np.float16))
    lse = np.zeros((2, 4, 9), np.float32)
    return [FakeCupyArray(x) for x in (q, k, v, q, lse)]


@pytest.mark.parametrize("storage", [np.uint16, np.int16])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_storage_with_dtype_reaches_the_kernels(fake_gpu, rng, storage, dtype):
    q, k, v, out, lse = _gpu_args(rng, storage)
    o, l = cupyflash.flash_attn_fwd(q, k, v, dtype=dtype)
    assert o.dtype == storage and l.dtype == np.float32  # storage in, storage out
    assert cupyflash.flash_attn(q, k, v, dtype=dtype, causal=True).dtype == storage
    grads = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, dtype=dtype)
    assert [g.dtype for g in grads] == [storage] * 3
    assert [kw["dtype_name"] for _, kw in fake_gpu] == [dtype] * 3


def test_gpu_float16_without_dtype_is_planned_as_float16(fake_gpu, rng):
    q, k, v, _, _ = _gpu_args(rng, np.float16)
    cupyflash.flash_attn(q, k, v)
    cupyflash.flash_attn(q, k, v, dtype="float16")
    assert [kw["dtype_name"] for _, kw in fake_gpu] == ["float16", "float16"]


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_gpu_storage_without_dtype_is_rejected(fake_gpu, rng, fn_name):
    q, k, v, out, lse = _gpu_args(rng, np.uint16)
    fn = getattr(cupyflash, fn_name)
    args = (out, q, k, v, out, lse) if fn_name == "flash_attn_bwd" else (q, k, v)
    with pytest.raises(TypeError, match=rf"^cupyflash\.{fn_name}: q must have dtype float16 or "
                                        r"bfloat16 on the GPU path .*; got uint16 \(for bfloat16 "
                                        r"data held as uint16/int16, pass dtype='bfloat16'\)\.$"):
        fn(*args)


@pytest.mark.parametrize("storage,dtype,text", [
    (np.uint16, "float32", ("dtype must be 'float16' or 'bfloat16' for uint16 storage; got "
                            "'float32'.")),
    (np.float16, "bfloat16", "dtype must be None or q's own dtype (float16)"),
    (np.int32, "bfloat16", "dtype must be None or q's own dtype (int32)"),
])
def test_gpu_bad_dtype_is_rejected(fake_gpu, rng, storage, dtype, text):
    q, k, v = (FakeCupyArray(x.astype(storage)) for x in _qkv(rng))
    with pytest.raises(TypeError) as info:
        cupyflash.flash_attn(q, k, v, dtype=dtype)
    assert text in str(info.value)
    assert fake_gpu == []


def test_gpu_storage_mismatch_is_rejected(fake_gpu, rng):
    q, k, v, _, _ = _gpu_args(rng, np.uint16)
    k = FakeCupyArray(k.host.view(np.int16))
    with pytest.raises(TypeError, match=r"k must have the same dtype as q \(uint16\); got int16\."):
        cupyflash.flash_attn(q, k, v, dtype="bfloat16")


# ----------------------------------------------------------------------------
# DLPack capsules: read and relabel in place
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
def test_capsule_info_reads_a_strided_view(max_version):
    base = np.arange(3 * 4 * 10, dtype=np.uint16).reshape(3, 4, 10)
    view = base[:, 1:, ::2]
    kwargs = {} if max_version is None else {"max_version": max_version}
    try:
        capsule = view.__dlpack__(**kwargs)
    except (TypeError, BufferError) as exc:
        pytest.skip(f"numpy {np.__version__} cannot export this capsule: {exc}")
    ptr, shape, strides, device, dtype = _interop.capsule_info(capsule)
    assert ptr == view.ctypes.data
    assert shape == (3, 3, 5) and strides == (40, 10, 2)
    assert device == (_interop.DL_CPU, 0)
    assert dtype == (1, 16, 1)  # kDLUInt, 16 bits, 1 lane


def test_relabel_capsule_changes_only_the_type_code():
    a = np.zeros((2, 3), np.uint16)
    capsule = a.__dlpack__()
    _interop.relabel_capsule(capsule, _interop.DL_BFLOAT, 16)
    assert _interop.capsule_info(capsule)[4] == (_interop.DL_BFLOAT, 16, 1)
    assert _interop.capsule_info(capsule)[:2] == (a.ctypes.data, (2, 3))
    with pytest.raises(BufferError, match="cannot relabel 16-bit data as 32-bit"):
        _interop.relabel_capsule(capsule, _interop.DL_BFLOAT, 32)


def test_consumed_capsule_is_refused():
    capsule = np.zeros(3, np.uint16).__dlpack__()
    np.from_dlpack(types.SimpleNamespace(__dlpack__=lambda **kw: capsule,
                                         __dlpack_device__=lambda: (_interop.DL_CPU, 0)))
    with pytest.raises(BufferError, match="not an unconsumed DLPack capsule"):
        _interop.capsule_info(capsule)


@pytest.mark.parametrize("shape,strides", [((2, 3, 4), (12, 4, 1)), ((5,), (1,)), ((), ()),
                                           ((2, 0, 3), (3, 3, 1))])
def test_c_strides(shape, strides):
    assert _interop.c_strides(shape) == strides


# ----------------------------------------------------------------------------
# torch CPU tensors (skipped without torch)
# ----------------------------------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _torch_qkv(torch, rng, dtype, requires_grad=False, sq=17, sk=23):
    q, k, v = _qkv(rng, np.float32, sq=sq, sk=sk, d=16)
    return tuple(torch.from_numpy(x).to(dtype).requires_grad_(requires_grad) for x in (q, k, v))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_torch_cpu_in_torch_out_in_place(monkeypatch, torch, rng, dtype_name):
    dtype = getattr(torch, dtype_name)
    q, k, v = _torch_qkv(torch, rng, dtype, requires_grad=True)
    seen = {}
    real_fwd = cpu.fwd

    def spy(q_, k_, v_, *args):
        seen["ptrs"] = [a.ctypes.data for a in (q_, k_, v_)]
        seen["dtype"] = q_.dtype.name
        return real_fwd(q_, k_, v_, *args)

    monkeypatch.setattr(cpu, "fwd", spy)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    assert seen == {"ptrs": [x.data_ptr() for x in (q, k, v)], "dtype": dtype_name}
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and lse.dtype == torch.float32
    assert not out.requires_grad
    dq, dk, _ = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, causal=True)
    assert dq.dtype == dtype and dk.shape == k.shape


def test_torch_and_numpy_mixed_is_rejected(torch, rng):
    q, k, v = _torch_qkv(torch, rng, torch.float32)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn: v must be a torch\.Tensor like "
                                        r"q \(array types cannot be mixed\); got numpy\.ndarray\.$"):
        cupyflash.flash_attn(q, k, v.numpy())


def test_torch_devices_must_match(torch, rng):
    q, k, v = _torch_qkv(torch, rng, torch.float32)
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn: k must have the same device as "
                                         r"q \(cpu\); got meta\.$"):
        cupyflash.flash_attn(q, k.to("meta"), v)


def test_torch_dtypes_must_match(torch, rng):
    q, k, v = _torch_qkv(torch, rng, torch.float32)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn: v must have the same dtype as q "
                                        r"\(float32\); got bfloat16\.$"):
        cupyflash.flash_attn(q, k, v.bfloat16())
    out, lse = cupyflash.flash_attn_fwd(q, k, v)
    with pytest.raises(TypeError, match=r"lse must have dtype float32; got float16\.$"):
        cupyflash.flash_attn_bwd(out, q, k, v, out, lse.half())


@pytest.mark.parametrize("causal", [False, True])
def test_torch_flash_attn_func_grads_match_sdpa(torch, rng, causal):
    q, k, v = _torch_qkv(torch, rng, torch.float64, requires_grad=True, sq=23, sk=23)
    from cupyflash.torch import flash_attn_func

    dout = torch.randn(q.shape, dtype=torch.float64)
    got = flash_attn_func(q, k, v, causal=causal)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal, enable_gqa=True).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    # cupyflash accumulates in float32 whatever the input dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-4)


def test_torch_expanded_dout_is_accepted(torch, rng):
    """``out.sum().backward()`` hands the backward an all-zero-stride gradient."""
    from cupyflash.torch import FlashAttnFunc, flash_attn_func

    q, k, v = _torch_qkv(torch, rng, torch.float32, requires_grad=True)
    flash_attn_func(q, k, v).sum().backward()
    first = q.grad.clone()
    q.grad = None
    FlashAttnFunc.apply(q, k, v, 16 ** -0.5, False, False).sum().backward()
    torch.testing.assert_close(q.grad, first, rtol=0, atol=0)


def test_torch_custom_ops_pass_opcheck(torch, rng):
    import cupyflash.torch  # noqa: F401  (registers the ops)

    q, k, v = _torch_qkv(torch, rng, torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.cupyflash.flash_attn, (q, k, v, 0.25, True, False))
    out, lse = torch.ops.cupyflash.flash_attn(q.detach(), k.detach(), v.detach(), 0.25, True,
                                              False)
    torch.library.opcheck(torch.ops.cupyflash.flash_attn_bwd,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                           0.25, True, False))


def test_torch_return_attn_probs_is_named(torch, rng):
    from cupyflash.torch import flash_attn_func

    q, k, v = _torch_qkv(torch, rng, torch.float32)
    with pytest.raises(NotImplementedError,
                       match=r"^cupyflash\.torch\.flash_attn_func: return_attn_probs must be "):
        flash_attn_func(q, k, v, return_attn_probs=True)


@pytest.mark.parametrize("option,value,error,text", [
    ("dropout_p", 1.0, ValueError, r"dropout_p must be in \[0, 1\)"),
    ("window_size", (4, -2), ValueError, r"window_size's right entry must be in \[-1"),
    ("alibi_slopes", [0.5], TypeError, r"alibi_slopes must be None or a float32 array"),
    ("softcap", -1.0, ValueError, r"softcap must be finite and >= 0"),
])
def test_torch_malformed_variants_are_named(torch, rng, option, value, error, text):
    from cupyflash.torch import flash_attn_func

    q, k, v = _torch_qkv(torch, rng, torch.float32)
    with pytest.raises(error, match=r"^cupyflash\.torch\.flash_attn_func: " + text):
        flash_attn_func(q, k, v, **{option: value})


# Before: a numpy array, a list or None for q/k/v raised AttributeError ('numpy.ndarray'
# object has no attribute 'dim') from inside cupyflash.torch; causal, deterministic and
# softmax_scale went through bool()/float() unchecked, so causal="False" ran causal and
# softmax_scale="0.3" ran with 0.3 (the core and cupyflash.jax raise TypeError for both).
@pytest.mark.parametrize("variant", [{}, {"softcap": 2.0}], ids=["plain", "variant"])
@pytest.mark.parametrize("arg,value,text", [
    ("q", "numpy", r"q must be a torch\.Tensor; got numpy\.ndarray\.$"),
    ("k", "numpy", r"k must be a torch\.Tensor; got numpy\.ndarray\.$"),
    ("v", None, r"v must be a torch\.Tensor; got NoneType\.$"),
    ("q", [1.0], r"q must be a torch\.Tensor; got list\.$"),
    ("causal", "False", r"causal must be a bool; got str\.$"),
    ("causal", None, r"causal must be a bool; got NoneType\.$"),
    ("deterministic", 0.5, r"deterministic must be a bool; got float\.$"),
    ("softmax_scale", "0.3", r"softmax_scale must be a real number or None; got str\.$"),
    ("softmax_scale", True, r"softmax_scale must be a real number or None; got bool\.$"),
    ("softmax_scale", float("nan"), r"softmax_scale must be finite and > 0; got nan\.$"),
])
def test_torch_flash_attn_func_checks_its_inputs(torch, rng, variant, arg, value, text):
    from cupyflash.torch import flash_attn_func

    q, k, v = _torch_qkv(torch, rng, torch.float32)
    args = dict(q=q, k=k, v=v, **variant)
    args[arg] = args[arg].numpy() if value == "numpy" else value
    with pytest.raises(TypeError if "must be a" in text else ValueError,
                       match=r"^cupyflash\.torch\.flash_attn_func: " + text):
        flash_attn_func(**args)


# the variants of flash_attn_func: (kwargs without tensors, alibi shape or None, sinks)
TORCH_VARIANTS = {
    "sinks": ({}, None, True),
    "sinks+window+causal": ({"window_size": (6, 1), "causal": True}, None, True),
    "softcap+alibi+sinks": ({"softcap": 3.0}, (2, 4), True),
    "alibi+window": ({"window_size": (3, 3)}, (4,), False),
}


@pytest.mark.parametrize("case", list(TORCH_VARIANTS))
def test_torch_flash_attn_func_variant_grads_match_reference(torch, rng, case):
    """Gradients of q, k, v and sinks (alibi_slopes constants) against the float64 reference."""
    from cupyflash import testing
    from cupyflash.torch import flash_attn_func

    kwargs, alibi_shape, with_sinks = TORCH_VARIANTS[case]
    kwargs = dict(kwargs)
    causal = kwargs.pop("causal", False)
    q, k, v = _torch_qkv(torch, rng, torch.float32, requires_grad=True)
    sinks = torch.from_numpy(rng.standard_normal(4).astype(np.float32)).requires_grad_(True) if with_sinks else None
    alibi = (torch.from_numpy((0.1 + 0.2 * rng.random(alibi_shape)).astype(np.float32)).requires_grad_(True)
             if alibi_shape else None)
    dout = torch.randn(q.shape, dtype=torch.float32)
    out = flash_attn_func(q, k, v, causal=causal, alibi_slopes=alibi, sinks=sinks, **kwargs)
    out.backward(dout)
    variants = dict(kwargs, alibi_slopes=None if alibi is None else alibi.detach().numpy(),
                    sinks=None if sinks is None else sinks.detach().numpy())
    host = [x.detach().numpy() for x in (q, k, v)]
    _, lse = cupyflash.flash_attn_fwd(*host, causal=causal, **{n: x for n, x in variants.items() if x is not None})
    testing.assert_fwd_matches_reference(*host, out.detach().numpy(), lse, causal=causal, **variants)
    testing.assert_bwd_matches_reference(dout.numpy(), *host, q.grad.numpy(), k.grad.numpy(), v.grad.numpy(),
                                         causal=causal, dsinks=None if sinks is None else sinks.grad.numpy(),
                                         **variants)
    if alibi is not None:
        assert alibi.grad is None  # constants, as in flash-attention


def test_torch_dropout_draws_from_torch_generator_and_keeps_it_for_backward(torch, rng):
    from cupyflash.torch import flash_attn_func

    q, k, v = _torch_qkv(torch, rng, torch.float32, requires_grad=True)
    dout = torch.randn(q.shape)
    outs = []
    for _ in range(2):
        torch.manual_seed(1234)
        outs.append(flash_attn_func(q, k, v, dropout_p=0.3))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # torch.manual_seed: the same mask
    assert not torch.equal(outs[0], flash_attn_func(q, k, v, dropout_p=0.3))  # the next draw: a new mask
    # the backward is the core's with the forward's state: rng_state explicit gives the same bits
    generator = torch.Generator().manual_seed(99)
    out = flash_attn_func(q, k, v, dropout_p=0.3, generator=generator)
    (dq,) = torch.autograd.grad(out, (q,), dout)
    seed = int(torch.randint(0, 1 << 62, (), generator=torch.Generator().manual_seed(99), dtype=torch.int64))
    host = [x.detach().numpy() for x in (q, k, v)]
    o, lse = cupyflash.flash_attn_fwd(*host, dropout_p=0.3, rng_state=(seed, 0))
    np.testing.assert_array_equal(out.detach().numpy(), o)
    want = cupyflash.flash_attn_bwd(dout.numpy(), *host, o, lse, dropout_p=0.3, rng_state=(seed, 0))[0]
    np.testing.assert_array_equal(dq.numpy(), want)
    explicit = flash_attn_func(q, k, v, dropout_p=0.3, rng_state=(seed, 0))
    torch.testing.assert_close(explicit, out, rtol=0, atol=0)


# Before: a generator that is not a torch.Generator reached torch.randint, whose TypeError
# ("randint() received an invalid combination of arguments") named neither cupyflash nor
# the argument.
@pytest.mark.parametrize("generator,error,text", [
    (5, TypeError, r"generator must be None or a torch\.Generator; got int\.$"),
    ("rng", TypeError, r"generator must be None or a torch\.Generator; got numpy\.random\."),
])
def test_torch_generator_that_is_not_one_is_named(torch, rng, generator, error, text):
    from cupyflash.torch import flash_attn_func

    q, k, v = _torch_qkv(torch, rng, torch.float32)
    generator = rng if generator == "rng" else generator
    with pytest.raises(error, match=r"^cupyflash\.torch\.flash_attn_func: " + text):
        flash_attn_func(q, k, v, dropout_p=0.25, generator=generator)
    # checked with dropout off too, where nothing is drawn from it
    with pytest.raises(error, match=r"^cupyflash\.torch\.flash_attn_func: " + text):
        flash_attn_func(q, k, v, generator=generator)


def test_torch_variants_off_take_the_plain_function(monkeypatch, torch, rng):
    import cupyflash.torch as cft

    q, k, v = _torch_qkv(torch, rng, torch.float32, requires_grad=True)
    monkeypatch.setattr(cft.FlashAttnVariantFunc, "apply", None)  # would raise if called
    out = cft.flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), None, softcap=0.0)
    torch.testing.assert_close(out, cft.flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)


def test_torch_core_functions_take_tensor_sinks_and_return_tensor_dsinks(torch, rng):
    q, k, v = _torch_qkv(torch, rng, torch.float32)
    sinks = torch.from_numpy(rng.standard_normal(4).astype(np.float32))
    alibi = torch.full((4,), 0.1)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, sinks=sinks, alibi_slopes=alibi, softcap=2.0)
    grads = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, sinks=sinks, alibi_slopes=alibi, softcap=2.0)
    assert len(grads) == 4 and all(isinstance(g, torch.Tensor) for g in grads)
    host = [x.numpy() for x in (q, k, v)]
    want = cupyflash.flash_attn_bwd(out.numpy(), *host, out.numpy(), lse.numpy(), sinks=sinks.numpy(),
                                    alibi_slopes=alibi.numpy(), softcap=2.0)
    for g, w in zip(grads, want):
        np.testing.assert_array_equal(g.numpy(), w)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_fwd: sinks must have dtype float32; got float64"):
        cupyflash.flash_attn_fwd(q, k, v, sinks=sinks.double())


def test_torch_variant_custom_ops_pass_opcheck(torch, rng):
    import cupyflash.torch  # noqa: F401  (registers the ops)

    q, k, v = _torch_qkv(torch, rng, torch.float32, requires_grad=True)
    sinks = torch.from_numpy(rng.standard_normal(4).astype(np.float32)).requires_grad_(True)
    alibi = torch.full((4,), 0.1)
    flags = (0.25, True, False, 5, 0, 3.0, 0.2, 7, 3)  # scale, causal, deterministic, window, softcap, p, seed, offset
    torch.library.opcheck(torch.ops.cupyflash.flash_attn_variant, (q, k, v, alibi, sinks, *flags))
    out, lse = torch.ops.cupyflash.flash_attn_variant(q.detach(), k.detach(), v.detach(), alibi, sinks.detach(),
                                                      *flags)
    for s in (sinks.detach(), None):
        torch.library.opcheck(torch.ops.cupyflash.flash_attn_variant_bwd,
                              (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, alibi, s,
                               *flags))


# ----------------------------------------------------------------------------
# JAX CPU arrays (skipped without jax)
# ----------------------------------------------------------------------------


@pytest.fixture
def jax():
    return pytest.importorskip("jax")


def _jax_qkv(jax, rng, dtype="float32", sq=17, sk=17):
    return tuple(jax.numpy.asarray(x, dtype=dtype) for x in _qkv(rng, sq=sq, sk=sk, d=16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_cpu_in_jax_out(jax, rng, dtype):
    q, k, v = _jax_qkv(jax, rng, dtype)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and lse.dtype == np.float32
    want = cupyflash.flash_attn(*(np.asarray(x) for x in (q, k, v)), causal=True)
    np.testing.assert_array_equal(np.asarray(out), want)


def test_jax_core_functions_take_jax_sinks_and_return_jax_dsinks(jax, rng):
    q, k, v = _jax_qkv(jax, rng)
    sinks = jax.numpy.asarray(rng.standard_normal(4).astype(np.float32))
    alibi = jax.numpy.full((2, 4), 0.1, jax.numpy.float32)
    kw = dict(causal=True, window_size=(5, 0))
    out, lse = cupyflash.flash_attn_fwd(q, k, v, sinks=sinks, alibi_slopes=alibi, **kw)
    grads = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, sinks=sinks, alibi_slopes=alibi, **kw)
    assert len(grads) == 4 and all(isinstance(g, jax.Array) for g in grads)
    host = [np.asarray(x) for x in (q, k, v)]
    o, l = cupyflash.flash_attn_fwd(*host, sinks=np.asarray(sinks), alibi_slopes=np.asarray(alibi), **kw)
    np.testing.assert_array_equal(np.asarray(out), o)
    want = cupyflash.flash_attn_bwd(o, *host, o, l, sinks=np.asarray(sinks), alibi_slopes=np.asarray(alibi), **kw)
    for g, w in zip(grads, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_jax_sinks_are_checked_like_q(jax, rng):
    q, k, v = _jax_qkv(jax, rng)
    sinks = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_fwd: sinks must be a jax\.Array like q "
                                        r"\(array types cannot be mixed\); got numpy\.ndarray\.$"):
        cupyflash.flash_attn_fwd(q, k, v, sinks=sinks)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn: alibi_slopes must have dtype float32; "
                                        r"got bfloat16\.$"):
        cupyflash.flash_attn(q, k, v, alibi_slopes=jax.numpy.zeros(4, jax.numpy.bfloat16))
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_fwd: sinks must have shape \(4,\)"):
        cupyflash.flash_attn_fwd(q, k, v, sinks=jax.numpy.zeros(3, jax.numpy.float32))


def test_dlpack_sinks_are_viewed_and_dsinks_follows_preallocated_gradients(rng):
    """Variant arrays of a foreign type are viewed like q; with dq= given (handed back as the
    caller's object) the result still ends with dsinks."""
    q, k, v = _qkv(rng)
    sinks = rng.standard_normal(4).astype(np.float32)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, sinks=sinks)
    dq = DLPackOnly(np.empty_like(q))
    grads = cupyflash.flash_attn_bwd(*(DLPackOnly(x) for x in (out, q, k, v, out, lse)),
                                     sinks=DLPackOnly(sinks), dq=dq)
    assert len(grads) == 4 and grads[0] is dq
    want = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, sinks=sinks)
    np.testing.assert_array_equal(dq.array, want[0])
    np.testing.assert_array_equal(grads[3], want[3])


def test_jax_tracer_in_core_api_points_to_cupyflash_jax(jax, rng):
    q, k, v = _jax_qkv(jax, rng)
    with pytest.raises(TypeError, match=r"q must be a concrete jax\.Array, not a tracer .*use "
                                        r"cupyflash\.jax\.flash_attention"):
        jax.jit(cupyflash.flash_attn)(q, k, v)


@pytest.mark.parametrize("causal", [False, True])
def test_jax_flash_attention_matches_dot_product_attention(jax, rng, causal):
    from cupyflash.jax import flash_attention

    q, k, v = _jax_qkv(jax, rng)

    def loss(attention):
        return lambda q, k, v: (attention(q, k, v) ** 2).sum()

    ours = lambda q, k, v: flash_attention(q, k, v, causal=causal)
    theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    ref = theirs(q, k, v)
    ref_grads = jax.grad(loss(theirs), argnums=(0, 1, 2))(q, k, v)
    for out in (ours(q, k, v), jax.jit(ours)(q, k, v)):
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=1e-5)
    for grad in (jax.grad(loss(ours), argnums=(0, 1, 2)),
                 jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))):
        for g, r in zip(grad(q, k, v), ref_grads):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=1e-4)


# Before: a NumPy q raised AttributeError ('numpy.ndarray' object has no attribute
# 'devices') outside jax.jit, though NumPy k and v (and a NumPy q under jit) work, as
# they do for JAX's own functions.
@pytest.mark.parametrize("numpy_args", ["q", "qkv"])
def test_jax_flash_attention_takes_numpy_q_like_jax(jax, rng, numpy_args):
    from cupyflash.jax import flash_attention

    q, k, v = _jax_qkv(jax, rng)
    expected = np.asarray(flash_attention(q, k, v, causal=True))
    args = [np.asarray(x) if name in numpy_args else x for name, x in zip("qkv", (q, k, v))]
    for call in (flash_attention, jax.jit(flash_attention, static_argnames="causal")):
        out = call(*args, causal=True)
        assert isinstance(out, jax.Array)
        np.testing.assert_array_equal(np.asarray(out), expected)


def test_jax_flash_attention_validates_at_trace_time(jax, rng):
    from cupyflash.jax import flash_attention

    q, k, v = _jax_qkv(jax, rng)
    with pytest.raises(ValueError, match=r"^cupyflash\.jax\.flash_attention: k must have the same "
                                         r"head_dim as q \(16\); got 8\."):  # + JAX's note
        jax.jit(flash_attention)(q, k[..., :8], v)
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        flash_attention(q, k, v, causal=1)


# ----------------------------------------------------------------------------
# Varlen (packed) functions: the same routing, cu_seqlens converted alongside
# ----------------------------------------------------------------------------

VARLEN_FUNCTIONS = ("flash_attn_varlen_fwd", "flash_attn_varlen", "flash_attn_varlen_bwd")
# sequences with an empty query side, an empty key side, len_q > len_k and len_q < len_k
VARLEN_LENS_Q, VARLEN_LENS_K = (5, 0, 9, 3, 12), (7, 3, 4, 0, 16)


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _varlen_numpy(rng, hq=4, hkv=2, d=16):
    """Host float32 (q, k, v, dout, cu_q, cu_k) of a packed GQA batch."""
    tq, tk = sum(VARLEN_LENS_Q), sum(VARLEN_LENS_K)
    q, dout = (rng.standard_normal((tq, hq, d), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((tk, hkv, d), dtype=np.float32) for _ in range(2))
    return q, k, v, dout, _cu(VARLEN_LENS_Q), _cu(VARLEN_LENS_K)


VARLEN_MAX = (max(VARLEN_LENS_Q), max(VARLEN_LENS_K))


def _varlen_all(q, k, v, dout, cu_q, cu_k, causal, wrap=lambda a: a):
    """``(out, lse, out_alone, dq, dk, dv)`` of the three varlen functions.

    ``wrap`` turns the numpy (out, lse) of the forward into the argument type
    the backward takes, when the forward's own results are not that type.
    """
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, *VARLEN_MAX, causal=causal)
    alone = cupyflash.flash_attn_varlen(q, k, v, cu_q, cu_k, *VARLEN_MAX, causal=causal)
    grads = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, wrap(out), wrap(lse), cu_q, cu_k,
                                            *VARLEN_MAX, causal=causal)
    return (out, lse, alone, *grads)


def _spy_varlen_checks(monkeypatch, pointer):
    """Records ``pointer(x)`` of the arrays the varlen checks see, and the dtype= given."""
    from cupyflash import _varlen

    seen = []
    real = _varlen._check_varlen

    def spy(fn, q, k, v, cu_q, cu_k, *rest):
        seen.append(([pointer(a) for a in (q, k, v, cu_q, cu_k)], rest[-1]))
        return real(fn, q, k, v, cu_q, cu_k, *rest)

    monkeypatch.setattr(_varlen, "_check_varlen", spy)
    return seen


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_dlpack_objects_are_viewed_in_place(monkeypatch, rng, causal):
    arrays = _varlen_numpy(rng)
    want = _varlen_all(*arrays, causal)
    seen = _spy_varlen_checks(monkeypatch, lambda a: a.ctypes.data)
    got = _varlen_all(*(DLPackOnly(x) for x in arrays), causal, wrap=DLPackOnly)
    q, k, v, _, cu_q, cu_k = arrays
    assert [ptrs for ptrs, _ in seen] == [[a.ctypes.data for a in (q, k, v, cu_q, cu_k)]] * 3
    for g, w in zip(got, want):
        assert type(g) is np.ndarray
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("fn_name", VARLEN_FUNCTIONS)
@pytest.mark.parametrize("arg", ["k", "cu_seqlens_q", "cu_seqlens_k"])
def test_varlen_dlpack_object_mixed_with_numpy_is_rejected(rng, fn_name, arg):
    q, k, v, dout, cu_q, cu_k = _varlen_numpy(rng)
    args = {name: DLPackOnly(x) for name, x in
            dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k).items()}
    args[arg] = args[arg].array
    fn = getattr(cupyflash, fn_name)
    tail = (args["cu_seqlens_q"], args["cu_seqlens_k"], *VARLEN_MAX)
    with pytest.raises(TypeError, match=rf"^cupyflash\.{fn_name}: {arg} must be a "
                                        r".*DLPackOnly like q \(array types cannot be mixed\); "
                                        r"got numpy\.ndarray\.$"):
        if fn_name == "flash_attn_varlen_bwd":
            out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, *VARLEN_MAX)
            fn(DLPackOnly(dout), args["q"], args["k"], args["v"], DLPackOnly(out),
               DLPackOnly(lse), *tail)
        else:
            fn(args["q"], args["k"], args["v"], *tail)


@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cu_seqlens_k"])
def test_varlen_numpy_q_with_dlpack_cu_seqlens_is_rejected(rng, arg):
    q, k, v, _, cu_q, cu_k = _varlen_numpy(rng)
    cu = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    cu[arg] = DLPackOnly(cu[arg])
    with pytest.raises(TypeError, match=rf"^cupyflash\.flash_attn_varlen: {arg} must be a "
                                        r"numpy\.ndarray like q \(array types cannot be mixed\); "
                                        r"got .*DLPackOnly\.$"):
        cupyflash.flash_attn_varlen(q, k, v, cu["cu_seqlens_q"], cu["cu_seqlens_k"],
                                    *VARLEN_MAX)


def test_varlen_dtype_with_dlpack_object_is_rejected(rng):
    arrays = [DLPackOnly(x) for x in _varlen_numpy(rng)]
    q, k, v, _, cu_q, cu_k = arrays
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_varlen_fwd: dtype must be None "
                                        r"for .*DLPackOnly inputs"):
        cupyflash.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, *VARLEN_MAX, dtype="bfloat16")


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_cpu_varlen_in_torch_out_in_place(monkeypatch, torch, rng, dtype_name, causal):
    dtype = getattr(torch, dtype_name)
    q, k, v, dout, cu_q, cu_k = _varlen_numpy(rng)
    tq, tk, tv, tdout = (torch.from_numpy(x).to(dtype).requires_grad_() for x in (q, k, v, dout))
    tcu_q, tcu_k = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    # the numpy result on the very same values (bfloat16 as ml_dtypes.bfloat16)
    host = [_interop.torch_to_numpy(x) for x in (tq, tk, tv, tdout)]
    want = _varlen_all(*host, cu_q, cu_k, causal)

    seen = _spy_varlen_checks(monkeypatch, lambda a: a.ctypes.data)
    got = _varlen_all(tq, tk, tv, tdout, tcu_q, tcu_k, causal)
    assert [ptrs for ptrs, _ in seen] == [[x.data_ptr() for x in (tq, tk, tv, tcu_q, tcu_k)]] * 3
    out, lse, alone, dq, dk, dv = got
    for g in got:
        assert isinstance(g, torch.Tensor) and g.device.type == "cpu" and not g.requires_grad
    assert out.dtype == alone.dtype == dq.dtype == dk.dtype == dv.dtype == dtype
    assert lse.dtype == torch.float32 and lse.shape == (4, sum(VARLEN_LENS_Q))
    assert (out.shape, dq.shape, dk.shape, dv.shape) == (tq.shape, tq.shape, tk.shape, tv.shape)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_interop.torch_to_numpy(g), w)


def test_torch_varlen_cu_seqlens_rules(torch, rng):
    q, k, v, _, cu_q, cu_k = _varlen_numpy(rng)
    tq, tk, tv, tcu_q, tcu_k = (torch.from_numpy(x) for x in (q, k, v, cu_q, cu_k))
    fn = cupyflash.flash_attn_varlen
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_varlen: cu_seqlens_k must be a "
                                        r"torch\.Tensor like q \(array types cannot be mixed\); "
                                        r"got numpy\.ndarray\.$"):
        fn(tq, tk, tv, tcu_q, cu_k, *VARLEN_MAX)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_varlen: cu_seqlens_q must be a "
                                        r"numpy\.ndarray like q \(array types cannot be mixed\); "
                                        r"got torch\.Tensor\.$"):
        fn(q, k, v, tcu_q, cu_k, *VARLEN_MAX)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_varlen: cu_seqlens_q must have "
                                        r"dtype int32; got int64\.$"):
        fn(tq, tk, tv, tcu_q.long(), tcu_k, *VARLEN_MAX)
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_varlen: cu_seqlens_k must have "
                                         r"the same device as q \(cpu\); got meta\.$"):
        fn(tq, tk, tv, tcu_q, tcu_k.to("meta"), *VARLEN_MAX)
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_varlen: max_seqlen_q must be at "
                                         r"least the longest query sequence"):
        fn(tq, tk, tv, tcu_q, tcu_k, 3, VARLEN_MAX[1])  # the checks run on the views
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_varlen_fwd: dtype must be None "
                                        r"for torch\.Tensor inputs"):
        cupyflash.flash_attn_varlen_fwd(tq, tk, tv, tcu_q, tcu_k, *VARLEN_MAX, dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_jax_cpu_varlen_in_jax_out(jax, rng, dtype, causal):
    q, k, v, dout, cu_q, cu_k = _varlen_numpy(rng)
    jq, jk, jv, jdout = (jax.numpy.asarray(x, dtype=dtype) for x in (q, k, v, dout))
    jcu_q, jcu_k = jax.numpy.asarray(cu_q), jax.numpy.asarray(cu_k)
    assert jcu_q.dtype == np.int32
    want = _varlen_all(*(np.asarray(x) for x in (jq, jk, jv, jdout)), cu_q, cu_k, causal)
    got = _varlen_all(jq, jk, jv, jdout, jcu_q, jcu_k, causal)
    out, lse, alone, dq, dk, dv = got
    for g in got:
        assert isinstance(g, jax.Array) and g.devices() == jq.devices()
    assert out.dtype == alone.dtype == dq.dtype == dk.dtype == dv.dtype == jq.dtype
    assert lse.dtype == np.float32
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_jax_varlen_mixed_is_rejected(jax, rng):
    q, k, v, _, cu_q, cu_k = _varlen_numpy(rng)
    jq, jk, jv, jcu_q, jcu_k = (jax.numpy.asarray(x) for x in (q, k, v, cu_q, cu_k))
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_varlen_fwd: cu_seqlens_q must be "
                                        r"a jax\.Array like q \(array types cannot be mixed\); "
                                        r"got numpy\.ndarray\.$"):
        cupyflash.flash_attn_varlen_fwd(jq, jk, jv, cu_q, jcu_k, *VARLEN_MAX)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_varlen: cu_seqlens_k must have "
                                        r"dtype int32; got float32\.$"):
        cupyflash.flash_attn_varlen(jq, jk, jv, jcu_q, jcu_k.astype("float32"), *VARLEN_MAX)


def test_jax_and_torch_varlen_mixed_is_rejected(jax, torch, rng):
    q, k, v, _, cu_q, cu_k = _varlen_numpy(rng)
    jq, jk, jv, jcu_q = (jax.numpy.asarray(x) for x in (q, k, v, cu_q))
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_varlen: cu_seqlens_k must be a "
                                        r"jax\.Array like q \(array types cannot be mixed\); "
                                        r"got torch\.Tensor\.$"):
        cupyflash.flash_attn_varlen(jq, jk, jv, jcu_q, torch.from_numpy(cu_k), *VARLEN_MAX)


# ----------------------------------------------------------------------------
# attn_bias / attn_mask (issue 14) through the interop layer: viewed like q (strides
# kept), dbias back in the caller's type
# ----------------------------------------------------------------------------


def _score_arrays(rng, sq=9, sk=13):
    bias = (2.0 * rng.standard_normal((1, 4, sq, sk))).astype(np.float32)
    mask = rng.random((2, 1, 1, sk)) < 0.8
    return bias, mask


def test_dlpack_bias_and_mask_are_viewed_and_dbias_comes_back(rng):
    """Foreign (DLPack) bias and mask are viewed like q; dbias ends the backward's result,
    after dsinks, with dq= given (handed back as the caller's object)."""
    q, k, v = _qkv(rng)
    bias, mask = _score_arrays(rng)
    sinks = rng.standard_normal(4).astype(np.float32)
    kw = dict(causal=True, sinks=sinks, attn_bias=bias, attn_mask=mask)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, **kw)
    got_out, got_lse = cupyflash.flash_attn_fwd(*(DLPackOnly(x) for x in (q, k, v)), causal=True,
                                                sinks=DLPackOnly(sinks), attn_bias=DLPackOnly(bias),
                                                attn_mask=DLPackOnly(mask))
    np.testing.assert_array_equal(got_out, out)
    dq = DLPackOnly(np.empty_like(q))
    grads = cupyflash.flash_attn_bwd(*(DLPackOnly(x) for x in (out, q, k, v, out, lse)), causal=True,
                                     sinks=DLPackOnly(sinks), attn_bias=DLPackOnly(bias),
                                     attn_mask=DLPackOnly(mask), return_dbias=True, dq=dq)
    want = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, return_dbias=True, **kw)
    assert len(grads) == 5 and grads[0] is dq
    for g, w in zip((dq.array, *grads[1:]), want):
        np.testing.assert_array_equal(g, w)


def test_torch_bias_and_mask_keep_their_strides(torch, rng, monkeypatch):
    """CPU tensors: an expand()ed bias and mask reach the core as views of the caller's
    memory (stride 0 kept), and the results equal the contiguous ones; dbias is a tensor in
    the bias's shape and dtype."""
    from cupyflash import _checks

    seen = []
    real = _checks.check_score_arrays

    def spy(fn, q, *args, attn_bias=None, attn_mask=None, **kwargs):
        seen.append((attn_bias, attn_mask))
        return real(fn, q, *args, attn_bias=attn_bias, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(_checks, "check_score_arrays", spy)
    q, k, v = _torch_qkv(torch, rng, torch.float32)
    base = torch.from_numpy(rng.standard_normal((4, 1, 23)).astype(np.float32))
    bias = base.expand(2, 4, 17, 23)
    mask = torch.from_numpy(rng.random((1, 1, 23)) < 0.8).expand(2, 1, 17, 23)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias, attn_mask=mask)
    (b, m), = seen
    assert b.ctypes.data == bias.data_ptr() and b.strides[0] == b.strides[2] == 0
    assert m.ctypes.data == mask.data_ptr() and m.strides[2] == 0
    want, _ = cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias.contiguous(), attn_mask=mask.contiguous())
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grads = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, attn_bias=bias, attn_mask=mask, return_dbias=True)
    assert len(grads) == 4 and isinstance(grads[3], torch.Tensor)
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype  # a full-size view: full-size dbias


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_torch_bias_dtypes_through_the_core(torch, rng, dtype_name):
    """A bias of q's dtype or float32: dbias in the bias's dtype (bfloat16 included)."""
    q, k, v = _torch_qkv(torch, rng, getattr(torch, dtype_name))
    for bias_dtype in {getattr(torch, dtype_name), torch.float32}:
        bias = torch.zeros(1, 4, 17, 23, dtype=bias_dtype)
        out, lse = cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias)
        dbias = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, attn_bias=bias, return_dbias=True)[3]
        assert dbias.dtype == bias_dtype and dbias.shape == bias.shape


def test_torch_bad_bias_and_mask_are_named(torch, rng):
    q, k, v = _torch_qkv(torch, rng, torch.float32)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_fwd: attn_bias must be a torch\.Tensor like q "
                                        r"\(array types cannot be mixed\); got numpy\.ndarray\.$"):
        cupyflash.flash_attn_fwd(q, k, v, attn_bias=np.zeros((17, 23), np.float32))
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_fwd: attn_mask must have dtype bool \(True = "
                                        r"attend; a float mask belongs in attn_bias\); got uint8\.$"):
        cupyflash.flash_attn_fwd(q, k, v, attn_mask=torch.ones(17, 23, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn: attn_bias must have q's dtype \(float32\) or "
                                        r"float32; got float16\.$"):
        cupyflash.flash_attn(q, k, v, attn_bias=torch.zeros(17, 23, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_fwd: attn_bias must be broadcastable"):
        cupyflash.flash_attn_fwd(q, k, v, attn_bias=torch.zeros(3, 1, 17, 23))


def test_jax_core_functions_take_jax_bias_and_mask(jax, rng):
    q, k, v = _jax_qkv(jax, rng)
    bias = jax.numpy.asarray((rng.standard_normal((17, 17))).astype(np.float32))
    mask = jax.numpy.asarray(rng.random((2, 1, 1, 17)) < 0.8)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias, attn_mask=mask, causal=True)
    grads = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, attn_bias=bias, attn_mask=mask, causal=True,
                                     return_dbias=True)
    assert len(grads) == 4 and all(isinstance(g, jax.Array) for g in grads)
    host = [np.asarray(x) for x in (q, k, v)]
    kw = dict(attn_bias=np.asarray(bias), attn_mask=np.asarray(mask), causal=True)
    o, l = cupyflash.flash_attn_fwd(*host, **kw)
    np.testing.assert_array_equal(np.asarray(out), o)
    want = cupyflash.flash_attn_bwd(o, *host, o, l, return_dbias=True, **kw)
    for g, w in zip(grads, want):
        np.testing.assert_array_equal(np.asarray(g), w)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_fwd: attn_mask must have dtype bool"):
        cupyflash.flash_attn_fwd(q, k, v, attn_mask=jax.numpy.ones((17, 17), jax.numpy.int32))
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_fwd: attn_bias must be a jax\.Array like q"):
        cupyflash.flash_attn_fwd(q, k, v, attn_bias=np.zeros((17, 17), np.float32))
