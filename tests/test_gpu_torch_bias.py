"""cupyflash.torch.flash_attn_func with ``attn_bias`` / ``attn_mask`` (issue 14): CUDA tensors
(marked gpu) and CPU tensors.

Each case runs on CUDA tensors (float16, bfloat16: the GPU kernels, on torch's
stream) and on CPU tensors (float32, bfloat16: the CPU path); the CPU cases are
not marked gpu and run wherever torch is installed.  Checked:

* the value and the gradients of q, k, v and the bias against the float64
  reference with cupyflash.testing's rule, and the bias gradient again against
  torch's own ``scaled_dot_product_attention(attn_mask=bias)`` in float64
  (autograd through it: an independent derivation of dbias);
* every broadcast shape, an ``expand()``ed (stride-0) bias read in place (no
  copy, no (B, H, N, N) allocation), a bias gradient through ``expand``;
* bool masks against SDPA's bool ``attn_mask``; fully masked rows (out 0,
  zero gradients, zero dbias rows);
* dbias asked of the backward only when the bias requires grad;
* ``torch.compile(fullgraph=True)`` through the custom operators (bitwise the
  eager gradients with ``deterministic=True``), their fake registrations;
* bad input: a bias or mask that is not a torch tensor, on another device, of
  the wrong dtype or shape, and a non-bool mask, each a TypeError/ValueError
  naming the argument.

Skipped without torch; the CUDA cases without a usable GPU (tests/conftest.py).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cft = pytest.importorskip("cupyflash.torch")

import cupyflash  # noqa: E402
from cupyflash import _api, _checks, _interop, testing  # noqa: E402

flash_attn_func = cft.flash_attn_func
FN = r"^cupyflash\.torch\.flash_attn_func: "
B, SQ, SK, HQ, HKV, D = 2, 45, 61, 4, 2, 32

_NO_ML_DTYPES = pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is None,
                                   reason="bfloat16 on the CPU needs ml_dtypes")

#: (device, dtype) pairs: the GPU kernels' dtypes on CUDA, the CPU path's on the CPU.
DEVICE_DTYPES = [
    pytest.param("cuda", "float16", marks=pytest.mark.gpu, id="cuda-float16"),
    pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu, id="cuda-bfloat16"),
    pytest.param("cpu", "float32", id="cpu-float32"),
    pytest.param("cpu", "bfloat16", marks=_NO_ML_DTYPES, id="cpu-bfloat16"),
]
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"), pytest.param("cpu", id="cpu")]


def _tensor(x, device, dtype, requires_grad=False):
    return torch.from_numpy(np.ascontiguousarray(x)).to(device, dtype).requires_grad_(requires_grad)


def _qkv(rng, device, dtype, requires_grad=True, sq=SQ, sk=SK):
    q, k, v = testing.random_qkv(rng, B, sq, sk, HQ, HKV, D, np.float32)
    dout = testing.random_normal(rng, q.shape, np.float32)
    t = getattr(torch, dtype)
    return (*(_tensor(x, device, t, requires_grad) for x in (q, k, v)), _tensor(dout, device, t))


def _bias(rng, shape, device, dtype, requires_grad=True):
    return _tensor(2.0 * rng.standard_normal(shape), device, getattr(torch, dtype), requires_grad)


def _host(t):
    """A NumPy copy of a tensor in its own dtype (bfloat16 as ml_dtypes), for cupyflash.testing."""
    return _interop.torch_to_numpy(t.detach().cpu()).copy()


def _check(q, k, v, dout, out, causal, bias=None, mask=None, dbias=None):
    """out and q/k/v.grad (and dbias) against the float64 reference, cupyflash.testing's rule."""
    scores = {}
    if bias is not None:
        scores["attn_bias"] = _host(bias)
    if mask is not None:
        scores["attn_mask"] = _host(mask)
    host = [_host(x) for x in (q, k, v)]
    _, lse = cupyflash.flash_attn_fwd(*host, causal=causal, **scores)  # the CPU path's lse
    testing.assert_fwd_matches_reference(*host, _host(out), lse, causal=causal, **scores)
    testing.assert_bwd_matches_reference(
        _host(dout), *host, *(_host(x.grad) for x in (q, k, v)), causal=causal,
        dbias=None if dbias is None else _host(dbias), floor=1e-3 if q.is_cuda else None, **scores)


def _causal_mask(sq, sk, device):
    """The causal keep-mask aligned bottom-right (cupyflash's and flash-attention's)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)


def _sdpa64(q, k, v, causal, bias=None, mask=None):
    """torch's SDPA in float64 on the CPU with the same bias (in its float attn_mask) and bool
    mask (-inf there), the causal mask aligned bottom-right; GQA by repeating K/V heads.
    Differentiable in the float64 copies it makes: ``(out, (q64, k64, v64, bias64))``."""
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_(True) for x in (q, k, v))
    b64 = None if bias is None else bias.detach().cpu().double().requires_grad_(True)
    keep = None if mask is None else mask.cpu()
    if causal:
        c = _causal_mask(q.shape[1], k.shape[1], "cpu")
        keep = c if keep is None else keep & c
    scores = None
    if b64 is not None or keep is not None:
        scores = torch.zeros((), dtype=torch.float64) if b64 is None else b64
        if keep is not None:
            scores = torch.where(keep, scores, float("-inf"))
    rep = q.shape[2] // k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q64.transpose(1, 2), k64.repeat_interleave(rep, 2).transpose(1, 2),
        v64.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=scores).transpose(1, 2)
    return out, (q64, k64, v64, b64)


def _sdpa_dbias(q, k, v, dout, causal, bias, mask=None):
    out, (_, _, _, b64) = _sdpa64(q, k, v, causal, bias, mask)
    (dbias,) = torch.autograd.grad(out, (b64,), dout.detach().cpu().double())
    return out, dbias


def _assert_dbias_like_sdpa(got, want, dtype):
    tol = {"float16": 2e-2, "bfloat16": 8e-2, "float32": 1e-4}[dtype]
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.detach().cpu().double(), want, rtol=0, atol=tol * scale)


# ----------------------------------------------------------------------------
# Values and gradients
# ----------------------------------------------------------------------------

BIAS_SHAPES = {"(1,H,N,N)": (1, HQ, SQ, SK), "(B,1,N,N)": (B, 1, SQ, SK), "(B,1,1,N)": (B, 1, 1, SK),
               "(N,N)": (SQ, SK), "(B,H,N,N)": (B, HQ, SQ, SK)}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(BIAS_SHAPES))
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_bias_value_and_grads(rng, device, dtype, shape, causal):
    q, k, v, dout = _qkv(rng, device, dtype)
    bias = _bias(rng, BIAS_SHAPES[shape], device, dtype)
    out = flash_attn_func(q, k, v, causal=causal, attn_bias=bias)
    out.backward(dout)
    assert out.dtype == q.dtype and out.device == q.device
    assert bias.grad is not None and bias.grad.shape == bias.shape and bias.grad.dtype == bias.dtype
    assert bias.grad.device == q.device
    _check(q, k, v, dout, out, causal, bias=bias, dbias=bias.grad)
    _, want = _sdpa_dbias(q, k, v, dout, causal, bias)
    _assert_dbias_like_sdpa(bias.grad, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_bias_with_half_q(rng, device):
    """A float32 bias beside bfloat16 q, k, v: dbias float32."""
    q, k, v, dout = _qkv(rng, device, "bfloat16")
    bias = _bias(rng, (1, HQ, SQ, SK), device, "float32")
    out = flash_attn_func(q, k, v, attn_bias=bias, causal=True)
    out.backward(dout)
    assert bias.grad.dtype == torch.float32 and out.dtype == torch.bfloat16
    _check(q, k, v, dout, out, True, bias=bias, dbias=bias.grad)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_mask_matches_sdpa_bool_mask(rng, device, dtype):
    q, k, v, dout = _qkv(rng, device, dtype)
    mask = torch.from_numpy(rng.random((B, 1, SQ, SK)) < 0.7).to(device)
    mask[..., 0] = True  # every row sees a key (SDPA's output is undefined otherwise)
    bias = _bias(rng, (1, HQ, SQ, SK), device, dtype)
    out = flash_attn_func(q, k, v, attn_bias=bias, attn_mask=mask)
    out.backward(dout)
    _check(q, k, v, dout, out, False, bias=bias, mask=mask, dbias=bias.grad)
    want_out, want_dbias = _sdpa_dbias(q, k, v, dout, False, bias, mask)
    _assert_dbias_like_sdpa(bias.grad, want_dbias, dtype)
    tol = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 1e-5}[dtype]
    torch.testing.assert_close(out.detach().cpu().double(), want_out.detach(), rtol=0, atol=tol)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_fully_masked_rows(rng, device, dtype):
    """Rows that see no key (mask, -inf bias, or the mask beside causal): out 0, no NaN, zero
    gradients and zero dbias there."""
    q, k, v, dout = _qkv(rng, device, dtype)
    mask = torch.ones(B, 1, SQ, SK, dtype=torch.bool, device=device)
    mask[0, :, 3] = False
    mask[1, :, 0, : SK - SQ + 1] = False  # with causal, row 0 of batch 1 sees keys 0 .. SK - SQ alone
    bias = _bias(rng, (B, HQ, SQ, SK), device, dtype, requires_grad=False)
    bias[1, 2, 7] = float("-inf")
    bias.requires_grad_(True)
    out = flash_attn_func(q, k, v, causal=True, attn_bias=bias, attn_mask=mask)
    out.backward(dout)
    grads = (q.grad, k.grad, v.grad, bias.grad)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    for b, row, head in ((0, 3, slice(None)), (1, 0, slice(None)), (1, 7, 2)):
        assert (out[b, row, head] == 0).all() and (q.grad[b, row, head] == 0).all()
        assert (bias.grad[b, head, row] == 0).all()
    _check(q, k, v, dout, out, True, bias=bias, mask=mask, dbias=bias.grad)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_gqa_and_unequal_seqlens_with_causal(rng, device, dtype):
    for sq, sk in ((1, SK), (SK, 17)):
        q, k, v, dout = _qkv(rng, device, dtype, sq=sq, sk=sk)
        bias = _bias(rng, (B, HQ, sq, sk), device, dtype)
        mask = torch.from_numpy(rng.random((B, 1, 1, sk)) < 0.8).to(device)
        out = flash_attn_func(q, k, v, causal=True, attn_bias=bias, attn_mask=mask)
        out.backward(dout)
        _check(q, k, v, dout, out, True, bias=bias, mask=mask, dbias=bias.grad)


# ----------------------------------------------------------------------------
# Strides: an expand()ed bias is read in place
# ----------------------------------------------------------------------------


@pytest.fixture
def score_arrays(monkeypatch):
    """The bias and mask views the core validates (after DLPack), per call."""
    seen = []
    real = _checks.check_score_arrays

    def spy(fn, q, *args, attn_bias=None, attn_mask=None, **kwargs):
        seen.append((attn_bias, attn_mask))
        return real(fn, q, *args, attn_bias=attn_bias, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(_checks, "check_score_arrays", spy)
    return seen


def _pointer(a):
    """The address of a CuPy or NumPy array's first element."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_expanded_bias_and_mask_are_read_in_place(rng, device, dtype, score_arrays):
    """A stride-0 view reaches the core as a view of the caller's memory (its strides, its
    pointer), forward and backward; the result is the contiguous bias's."""
    q, k, v, dout = _qkv(rng, device, dtype)
    base = _bias(rng, (HQ, 1, SK), device, dtype, requires_grad=False)
    bias = base.expand(B, HQ, SQ, SK)  # strides (0, SK, 0, 1)
    keep = torch.from_numpy(rng.random((1, 1, 1, SK)) < 0.8).to(device)
    mask = keep.expand(B, 1, SQ, SK)
    out = flash_attn_func(q, k, v, attn_bias=bias, attn_mask=mask)
    out.backward(dout)
    assert score_arrays, "the core saw no bias"
    for b, m in score_arrays:  # the forward's and the backward's
        assert _pointer(b) == bias.data_ptr() and _pointer(m) == mask.data_ptr()
        assert b.strides[0] == 0 and b.strides[2] == 0 and m.strides[2] == 0
    contiguous = flash_attn_func(q, k, v, attn_bias=bias.contiguous(), attn_mask=mask.contiguous())
    torch.testing.assert_close(out, contiguous, rtol=0, atol=0)


@pytest.mark.gpu
def test_expanded_bias_allocates_no_full_size_tensor(rng):
    """No (B, H, N, N) buffer is allocated for a broadcast bias, forward or backward (without
    dbias): every allocation of the call, torch's (its peak) and CuPy's (each one, through a
    recording allocator: the general DLPack path allocates outputs there), stays far below
    the bias's full size."""
    import cupy

    batch, heads, n = 4, 8, 1024
    q, k, v = (torch.randn(batch, n, heads, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    base = torch.randn(1, heads, 1, n, device="cuda", dtype=torch.float32)
    bias = base.expand(batch, heads, n, n)
    full = batch * heads * n * n * 4  # 128 MiB
    flash_attn_func(q, k, v, attn_bias=bias).sum().backward()  # warm up (compiles, plans)
    torch.cuda.synchronize()
    sizes = []
    previous = cupy.cuda.get_allocator()

    def recording(nbytes):
        sizes.append(nbytes)
        return previous(nbytes)

    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cupy.cuda.set_allocator(recording)
    try:
        out = flash_attn_func(q, k, v, attn_bias=bias)
        out.sum().backward()
        torch.cuda.synchronize()
    finally:
        cupy.cuda.set_allocator(previous)
    assert torch.cuda.max_memory_allocated() - before < full // 8
    assert max(sizes, default=0) < full // 8, sorted(sizes)[-3:]


@pytest.mark.parametrize("device", DEVICES)
def test_bias_grad_through_expand_is_summed(rng, device):
    """A small bias expand()ed: autograd gets the full-size gradient of the view and expand's
    backward sums it, which equals the gradient of the small bias passed as it is."""
    q, k, v, dout = _qkv(rng, device, "float32" if device == "cpu" else "float16")
    small = _bias(rng, (1, HQ, 1, SK), device, "float32")
    flash_attn_func(q, k, v, attn_bias=small.expand(B, HQ, SQ, SK)).backward(dout)
    through_expand = small.grad.clone()
    small.grad = None
    flash_attn_func(q, k, v, attn_bias=small).backward(dout)
    torch.testing.assert_close(through_expand, small.grad, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# dbias only when asked for; the plain path untouched
# ----------------------------------------------------------------------------


@pytest.fixture
def bwd_kwargs(monkeypatch):
    calls = []
    real = _api.flash_attn_bwd

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(_api, "flash_attn_bwd", spy)
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_dbias_only_when_the_bias_requires_grad(rng, device, bwd_kwargs):
    dtype = "float32" if device == "cpu" else "float16"
    q, k, v, dout = _qkv(rng, device, dtype)
    bias = _bias(rng, (1, HQ, SQ, SK), device, dtype, requires_grad=False)
    flash_attn_func(q, k, v, attn_bias=bias).backward(dout)
    assert [c["return_dbias"] for c in bwd_kwargs] == [False] and bias.grad is None
    dq = q.grad.clone()
    q.grad = None
    bias.requires_grad_(True)
    flash_attn_func(q, k, v, attn_bias=bias).backward(dout)
    assert [c["return_dbias"] for c in bwd_kwargs] == [False, True]
    torch.testing.assert_close(q.grad, dq, rtol=0, atol=0)  # dq does not depend on asking for dbias


@pytest.mark.parametrize("device", DEVICES)
def test_none_bias_and_mask_take_the_plain_function(rng, device, monkeypatch):
    q, k, v, _ = _qkv(rng, device, "float32" if device == "cpu" else "float16")
    want = flash_attn_func(q, k, v, causal=True)
    monkeypatch.setattr(cft.FlashAttnVariantFunc, "apply", None)  # would raise if called
    got = flash_attn_func(q, k, v, causal=True, attn_bias=None, attn_mask=None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_core_functions_take_tensor_bias_and_return_tensor_dbias(rng, device):
    dtype = "bfloat16" if device == "cuda" else "float32"
    q, k, v, dout = _qkv(rng, device, dtype, requires_grad=False)
    bias = _bias(rng, (B, 1, 1, SK), device, dtype, requires_grad=False)
    mask = torch.ones(SQ, SK, dtype=torch.bool, device=device)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias, attn_mask=mask, causal=True)
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, attn_bias=bias, attn_mask=mask, causal=True,
                                     return_dbias=True)
    assert len(grads) == 4 and all(isinstance(g, torch.Tensor) for g in grads)
    dbias = grads[3]
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype and dbias.device == bias.device
    host = [_host(x) for x in (q, k, v)]
    testing.assert_bwd_matches_reference(_host(dout), *host, *(_host(g) for g in grads[:3]), causal=True,
                                         attn_bias=_host(bias), attn_mask=_host(mask), dbias=_host(dbias),
                                         floor=1e-3 if device == "cuda" else None)


# ----------------------------------------------------------------------------
# torch.compile: the custom operators
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_with_bias_and_mask(rng, device):
    """Under torch.compile the variant ops take the bias and mask: the same gradients as in
    eager mode (bitwise, deterministic), dbias included; a bias without grad costs none."""
    dtype = "float32" if device == "cpu" else "float16"
    q, k, v, _ = _qkv(rng, device, dtype)
    bias = _bias(rng, (1, HQ, SQ, SK), device, dtype)
    mask = torch.from_numpy(rng.random((B, 1, 1, SK)) < 0.8).to(device)

    def loss(q, k, v, bias):
        return flash_attn_func(q, k, v, causal=True, attn_bias=bias, attn_mask=mask,
                               deterministic=True).float().square().sum()

    eager = torch.autograd.grad(loss(q, k, v, bias), (q, k, v, bias))
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias))
    for g, e in zip(got, eager):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    got = torch.autograd.grad(compiled(q, k, v, bias.detach()), (q, k, v))
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_variant_ops_with_bias_pass_opcheck(rng, device):
    """The ops' fake registrations (shapes, dtypes; dbias the bias's) agree with the real ones."""
    dtype = "float32" if device == "cpu" else "float16"
    q, k, v, dout = _qkv(rng, device, dtype, requires_grad=False)
    bias = _bias(rng, (B, 1, SQ, SK), device, "float32", requires_grad=True)
    mask = torch.from_numpy(rng.random((SQ, SK)) < 0.8).to(device)
    flags = (D ** -0.5, True, False, -1, -1, 0.0, 0.0, 0, 0)
    torch.library.opcheck(torch.ops.cupyflash.flash_attn_variant, (q, k, v, None, None, *flags, bias, mask))
    out, lse = torch.ops.cupyflash.flash_attn_variant(q, k, v, None, None, *flags, bias.detach(), mask)
    for return_dbias in (True, False):
        torch.library.opcheck(torch.ops.cupyflash.flash_attn_variant_bwd,
                              (dout, q, k, v, out, lse, None, None, *flags, bias.detach(), mask, return_dbias))
    grads = torch.ops.cupyflash.flash_attn_variant_bwd(dout, q, k, v, out, lse, None, None, *flags,
                                                       bias.detach(), mask, True)
    assert len(grads) == 5 and grads[4].shape == bias.shape and grads[4].dtype == torch.float32


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_bad_bias_and_mask_are_named(rng, device):
    dtype = "float32" if device == "cpu" else "float16"
    q, k, v, _ = _qkv(rng, device, dtype, requires_grad=False)
    with pytest.raises(TypeError, match=FN + r"attn_bias must be None or a torch\.Tensor of q's dtype or "
                                         r"float32; got numpy\.ndarray\.$"):
        flash_attn_func(q, k, v, attn_bias=np.zeros((SQ, SK), np.float32))
    with pytest.raises(TypeError, match=FN + r"attn_mask must be None or a bool torch\.Tensor; got list\.$"):
        flash_attn_func(q, k, v, attn_mask=[[True]])
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_fwd: attn_mask must have dtype bool \(True = "
                                        r"attend; a float mask belongs in attn_bias\); got (int64|float32)\.$"):
        flash_attn_func(q, k, v, attn_mask=torch.ones(SQ, SK, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_fwd: attn_bias must have q's dtype "
                                        rf"\({dtype}\) or float32; got float64\.$"):
        flash_attn_func(q, k, v, attn_bias=torch.zeros(SQ, SK, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_fwd: attn_bias must be broadcastable to "
                                         r"\(batch, nheads_q, seqlen_q, seqlen_k\) = \(2, 4, 45, 61\), .*whose "
                                         r"nheads_q is 2\.$"):
        flash_attn_func(q, k, v, attn_bias=torch.zeros(1, 2, SQ, SK, dtype=q.dtype, device=device))
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_fwd: attn_mask must have at most 4 dimensions"):
        flash_attn_func(q, k, v, attn_mask=torch.ones(1, 1, 1, SQ, SK, dtype=torch.bool, device=device))


@pytest.mark.gpu
def test_bias_on_another_device_is_rejected(rng):
    q, k, v, _ = _qkv(rng, "cuda", "float16", requires_grad=False)
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_fwd: attn_bias must have the same device as q "
                                         r"\(cuda:0\); got cpu\.$"):
        flash_attn_func(q, k, v, attn_bias=torch.zeros(SQ, SK, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_fwd: attn_mask must have the same device as q"):
        flash_attn_func(q, k, v, attn_mask=torch.ones(SQ, SK, dtype=torch.bool))
