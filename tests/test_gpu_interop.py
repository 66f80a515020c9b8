"""torch, JAX and CuPy on the GPU: zero copy, dtypes, streams and gradients (skipped without a GPU).

Each framework's tests skip, with the reason, when it is not installed or has
no CUDA device.  Tolerances follow ``cupyflash.testing``: against a float64
reference, the error may be at most 2x (outputs) or 3x (gradients) the error of
a naive implementation in the same dtype, plus FLOOR.  The naive error is the
larger of the framework's own attention in that dtype (torch's math SDPA,
``jax.nn.dot_product_attention``) and ``cupyflash.reference``'s naive one.

Shapes are small and head_dim is 64 throughout, so few kernel variants are
compiled (fp16/bf16 x causal) and the file runs in well under a minute once
they are cached.
"""

from __future__ import annotations

import os

# Before JAX starts: leave GPU memory to torch and CuPy (XLA preallocates 75% by default).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

import cupyflash
from cupyflash import _interop, reference, testing

pytestmark = pytest.mark.gpu

FLOOR = 1e-3
B, S, HQ, HKV, D = 2, 128, 4, 2, 64


def _cp():
    return pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} sees no CUDA device")
    return torch


@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"jax {jax.__version__} has no GPU backend: {exc}")
    return jax


def _host(x):
    """float64 NumPy copy of a NumPy array, torch tensor, JAX array or CuPy array."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    if hasattr(x, "detach"):
        return x.detach().double().cpu().numpy()
    if hasattr(x, "get"):
        return np.asarray(x.get(), np.float64)
    return np.asarray(x.astype("float32"), np.float64)


def check(name, got, ref64, naives, factor):
    """``max|got - ref64| <= factor * max(naive errors) + FLOOR`` (cupyflash.testing's rule)."""
    ref64 = _host(ref64)
    naives = [_host(n) for n in naives]
    worst = max(naives, key=lambda n: float(np.nanmax(np.abs(n - ref64))))
    testing.assert_close_to_reference(name, _host(got), ref64, worst, factor, FLOOR)


def _spy(monkeypatch, name):
    """Wraps the run of every planned forward (``name`` "fwd") or backward ("bwd");
    records the pointers, the element type of the kernels, and the stream."""
    from cupyflash import _gpu, _gpu_bwd

    cls = _gpu.FwdCall if name == "fwd" else _gpu_bwd.BwdCall
    inputs, outputs = (3, 2) if name == "fwd" else (6, 3)
    calls = []
    real = cls.run

    def spy(self, stream, alloc, *pointers):
        owner = real(self, stream, alloc, *pointers)
        main = self.plan.main if name == "fwd" else self.plan.launches[1]
        calls.append({"inputs": list(pointers[:inputs]),
                      "outputs": list(pointers[inputs:inputs + outputs]),
                      "dtype": "bfloat16" if main.args[0] == "__nv_bfloat16" else None,
                      "stream": stream})
        return owner

    monkeypatch.setattr(cls, "run", spy)
    return calls


# ----------------------------------------------------------------------------
# torch
# ----------------------------------------------------------------------------


def _draw(rng, seqlen_q=S):
    """Host float32 (q, k, v) from the test's seeded generator."""
    return testing.random_qkv(rng, B, seqlen_q, S, HQ, HKV, D, np.float32)


def _torch_qkv(torch, rng, dtype, requires_grad=False, seqlen_q=S):
    return tuple(torch.from_numpy(x).to("cuda", dtype).requires_grad_(requires_grad)
                 for x in _draw(rng, seqlen_q))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_zero_copy_in_and_out(monkeypatch, torch, rng, dtype):
    fwd_calls, bwd_calls = _spy(monkeypatch, "fwd"), _spy(monkeypatch, "bwd")
    # q, k, v strided views into a packed qkv tensor, read in place
    qkv = torch.from_numpy(testing.random_normal(rng, (B, S, 3, HQ, D), np.float32))
    qkv = qkv.to("cuda", getattr(torch, dtype))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1, :HKV], qkv[:, :, 2, :HKV]
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    dq, dk, dv = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, causal=True)
    [f], [b] = fwd_calls, bwd_calls
    assert f["inputs"] == [x.data_ptr() for x in (q, k, v)]
    assert f["outputs"] == [out.data_ptr(), lse.data_ptr()]
    assert b["inputs"] == [x.data_ptr() for x in (out, q, k, v, out, lse)]
    assert b["outputs"] == [x.data_ptr() for x in (dq, dk, dv)]
    assert f["dtype"] == b["dtype"] == ("bfloat16" if dtype == "bfloat16" else None)
    assert f["stream"] == torch.cuda.current_stream().cuda_stream
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and dq.dtype == q.dtype
    assert isinstance(out, torch.Tensor) and out.device == q.device


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_fwd_matches_reference(torch, rng, dtype, causal):
    q, k, v = _torch_qkv(torch, rng, getattr(torch, dtype), seqlen_q=S if causal else 96)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal)
    host = [_host(x) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention_fwd(*host, causal=causal)
    naive_out, naive_lse = reference.naive_attention(*host, causal=causal, dtype=dtype)
    check("out", out, ref_out, [naive_out], testing.OUT_FACTOR)
    check("lse", lse, ref_lse, [naive_lse], testing.OUT_FACTOR)


def _sdpa(torch, q, k, v, causal, dtype=None):
    """torch's math SDPA in (batch, seqlen, heads, dim) layout, optionally upcast."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if dtype is not None:
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2), (q, k, v)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_flash_attn_func_grads_match_sdpa(torch, rng, dtype, causal):
    from cupyflash.torch import flash_attn_func

    q, k, v = _torch_qkv(torch, rng, getattr(torch, dtype), requires_grad=True)
    dout = _torch_qkv(torch, rng, q.dtype)[0]
    out = flash_attn_func(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    ref, ref_in = _sdpa(torch, q, k, v, causal, torch.float64)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    naive, naive_in = _sdpa(torch, q, k, v, causal, q.dtype)
    naive_grads = torch.autograd.grad(naive, naive_in, dout)
    host = [_host(x) for x in (dout, q, k, v)]
    ours_naive = reference.naive_attention_bwd(*host, causal=causal, dtype=dtype)

    check("out", out, ref, [naive, reference.naive_attention(*host[1:], causal=causal,
                                                             dtype=dtype)[0]], testing.OUT_FACTOR)
    for name, g, r, n, n2 in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads, ours_naive):
        assert g.dtype == q.dtype and g.shape == r.shape
        check(name, g, r, [n, n2], testing.GRAD_FACTOR)


def test_torch_stream_ordering(monkeypatch, torch, rng):
    """q is filled on a side stream after a long sleep; the kernels must run after the fill."""
    calls = _spy(monkeypatch, "fwd")
    q_src, k, v = _torch_qkv(torch, rng, torch.float16)
    expected = cupyflash.flash_attn(q_src, k, v)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q = torch.empty_like(q_src)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before q is written
        q.copy_(q_src)
        out = cupyflash.flash_attn(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    assert calls[-1]["stream"] == side.cuda_stream
    assert torch.equal(out, expected)


def test_torch_compile_fullgraph(torch, rng):
    """The custom ops stay in the graph: fullgraph=True, forward and backward."""
    from cupyflash.torch import flash_attn_func

    q, k, v = _torch_qkv(torch, rng, torch.float16, requires_grad=True)
    w = torch.eye(D, device="cuda", dtype=torch.float16, requires_grad=True)

    def loss(q, k, v, w):  # deterministic: bitwise comparable with the eager run
        return flash_attn_func(q @ w, k, v, causal=True,
                               deterministic=True).float().square().sum()

    eager = torch.autograd.grad(loss(q, k, v, w), (q, k, v, w))
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, w), (q, k, v, w))
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.slow
def test_torch_compile_inductor(torch, rng):
    from cupyflash.torch import flash_attn_func

    q, k, v = _torch_qkv(torch, rng, torch.bfloat16, requires_grad=True)

    def loss(q, k, v):
        return flash_attn_func(q * 2, k, v, causal=True).float().square().sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=1e-2, atol=1e-2)


# the variants of flash_attn_func (issue 13): kwargs, alibi shape or None, sinks
TORCH_VARIANTS = {
    "sinks+window+causal": ({"window_size": (40, 0), "causal": True}, None, True),
    "softcap+alibi+sinks": ({"softcap": 5.0}, (B, HQ), True),
    "alibi+window": ({"window_size": (17, 9)}, (HQ,), False),
    "dropout+causal": ({"dropout_p": 0.2, "rng_state": (123456789123, 77), "causal": True}, None, False),
    "dropout+sinks": ({"dropout_p": 0.1, "rng_state": (5, 2**32 - 1)}, None, True),
}


def _host_like(torch, x):
    """A NumPy copy of a tensor in its own dtype (bfloat16 as ml_dtypes), for cupyflash.testing."""
    from cupyflash import _interop

    return _interop.torch_to_numpy(x.detach().cpu()).copy()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(TORCH_VARIANTS))
def test_torch_flash_attn_func_variant_grads_match_reference(torch, rng, dtype, case):
    """flash_attn_func with variants, forward and backward (q, k, v and sinks), against the
    float64 reference with cupyflash.testing's rule; alibi_slopes get no gradient."""
    from cupyflash import _philox
    from cupyflash.torch import flash_attn_func

    kwargs, alibi_shape, with_sinks = TORCH_VARIANTS[case]
    kwargs = dict(kwargs)
    causal = kwargs.pop("causal", False)
    q, k, v = _torch_qkv(torch, rng, getattr(torch, dtype), requires_grad=True)
    dout = _torch_qkv(torch, rng, q.dtype)[0]
    sinks = (torch.from_numpy(rng.standard_normal(HQ).astype(np.float32)).cuda().requires_grad_(True)
             if with_sinks else None)
    alibi = (torch.from_numpy((0.02 + 0.1 * rng.random(alibi_shape)).astype(np.float32)).cuda()
             .requires_grad_(True) if alibi_shape else None)
    out = flash_attn_func(q, k, v, causal=causal, alibi_slopes=alibi, sinks=sinks, **kwargs)
    out.backward(dout)
    assert out.dtype == q.dtype and q.grad.dtype == q.dtype
    rng_state = kwargs.pop("rng_state", None)
    variants = dict(kwargs, alibi_slopes=None if alibi is None else alibi.detach().cpu().numpy(),
                    sinks=None if sinks is None else sinks.detach().cpu().numpy())
    if rng_state is not None:
        variants["dropout_mask"] = _philox.dropout_keep_mask(*rng_state, kwargs["dropout_p"], B, HQ, S, S)
    host = [_host_like(torch, x) for x in (q, k, v)]
    core = {n: x for n, x in variants.items() if x is not None and n != "dropout_mask"}
    _, lse = cupyflash.flash_attn_fwd(*host, causal=causal, rng_state=rng_state, **core)  # the CPU path's lse
    testing.assert_fwd_matches_reference(*host, _host_like(torch, out), lse, causal=causal, **variants)
    testing.assert_bwd_matches_reference(
        _host_like(torch, dout), *host, *(_host_like(torch, x.grad) for x in (q, k, v)), causal=causal,
        dsinks=None if sinks is None else sinks.grad.cpu().numpy(), floor=1e-3, **variants)  # tests/test_gpu_variants.py's floor
    if alibi is not None:
        assert alibi.grad is None
    if sinks is not None:
        assert sinks.grad.dtype == torch.float32 and sinks.grad.device == q.device


def test_torch_dropout_follows_torch_cuda_manual_seed(torch, rng):
    """Without rng_state the state is (seed, Philox offset / 4) of torch's CUDA generator, which
    advances by 4 per call: torch.cuda.manual_seed reproduces the masks, the next call differs,
    and the backward draws the forward's mask."""
    from cupyflash.torch import flash_attn_func

    q, k, v = _torch_qkv(torch, rng, torch.float16, requires_grad=True)
    dout = _torch_qkv(torch, rng, q.dtype)[0]
    gen = torch.cuda.default_generators[q.device.index]
    runs = []
    for _ in range(2):
        torch.cuda.manual_seed(2024)
        before = gen.get_state().view(torch.int64).clone()
        out = flash_attn_func(q, k, v, dropout_p=0.25, causal=True)
        runs.append((out, torch.autograd.grad(out, (q, k, v), dout)))
        after = gen.get_state().view(torch.int64)
        assert int(after[0]) == int(before[0]) and int(after[1]) == int(before[1]) + 4
    seed, offset = int(before[0]) & (2**64 - 1), int(before[1]) >> 2
    for a, b in zip((runs[0][0], *runs[0][1]), (runs[1][0], *runs[1][1])):
        assert torch.equal(a, b)
    explicit = flash_attn_func(q, k, v, dropout_p=0.25, causal=True, rng_state=(seed, offset))
    assert torch.equal(explicit, runs[0][0])
    assert not torch.equal(flash_attn_func(q, k, v, dropout_p=0.25, causal=True), runs[0][0])


def test_torch_core_functions_take_cuda_sinks_and_return_cuda_dsinks(torch, rng):
    q, k, v = _torch_qkv(torch, rng, torch.bfloat16)
    sinks = torch.randn(HQ, device="cuda")
    out, lse = cupyflash.flash_attn_fwd(q, k, v, sinks=sinks, causal=True)
    grads = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, sinks=sinks, causal=True)
    assert len(grads) == 4 and grads[3].device == q.device and grads[3].dtype == torch.float32
    assert grads[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_fwd: sinks must have the same device as q"):
        cupyflash.flash_attn_fwd(q, k, v, sinks=sinks.cpu())


def test_torch_compile_fullgraph_with_variants(torch, rng):
    """The variant ops stay in the graph: sinks get their gradient, alibi none; dropout needs an
    explicit rng_state under torch.compile."""
    from cupyflash.torch import flash_attn_func

    q, k, v = _torch_qkv(torch, rng, torch.float16, requires_grad=True)
    sinks = torch.randn(HQ, device="cuda", requires_grad=True)
    alibi = torch.full((HQ,), 0.05, device="cuda")

    def loss(q, k, v, sinks):
        return flash_attn_func(q, k, v, causal=True, window_size=(33, 0), softcap=4.0, alibi_slopes=alibi,
                               sinks=sinks, dropout_p=0.1, rng_state=(9, 1),
                               deterministic=True).float().square().sum()

    eager = torch.autograd.grad(loss(q, k, v, sinks), (q, k, v, sinks))
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks))
    for g, e in zip(got[:3], eager[:3]):  # deterministic: bitwise
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    torch.testing.assert_close(got[3], eager[3], rtol=1e-5, atol=1e-6)  # dsinks: float atomics
    no_state = torch.compile(lambda q: flash_attn_func(q, k, v, dropout_p=0.1), fullgraph=True,
                             backend="aot_eager")
    with pytest.raises(Exception, match=r"rng_state=\(seed, offset\) must be given with dropout_p > 0 under "
                                        r"torch\.compile"):
        no_state(q)


def test_torch_and_cupy_mixed_is_rejected(torch, rng):
    cp = _cp()
    q, k, v = _torch_qkv(torch, rng, torch.float16)
    with pytest.raises(TypeError, match=r"k must be a torch\.Tensor like q \(array types cannot "
                                        r"be mixed\); got cupy\.ndarray\."):
        cupyflash.flash_attn(q, cp.from_dlpack(k), v)


def test_torch_cpu_and_cuda_mixed_is_rejected(torch, rng):
    q, k, v = _torch_qkv(torch, rng, torch.float16)
    with pytest.raises(ValueError, match=r"v must have the same device as q \(cuda:0\); got cpu\."):
        cupyflash.flash_attn(q, k, v.cpu())


# ----------------------------------------------------------------------------
# CuPy, bfloat16 as uint16 storage with dtype="bfloat16"
# ----------------------------------------------------------------------------


def test_cupy_bf16_storage_end_to_end(rng):
    cp = _cp()
    ml_dtypes = pytest.importorskip("ml_dtypes")
    host = testing.random_qkv(rng, B, S, S, HQ, HKV, D, "bfloat16")
    dout = testing.random_normal(rng, host[0].shape, "bfloat16")
    q, k, v, do = (cp.asarray(x.view(np.uint16)) for x in (*host, dout))
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True, dtype="bfloat16")
    dq, dk, dv = cupyflash.flash_attn_bwd(do, q, k, v, out, lse, causal=True, dtype="bfloat16")
    assert isinstance(out, cp.ndarray) and out.dtype == cp.uint16 and dq.dtype == cp.uint16

    def bf16(x):
        return x.get().view(ml_dtypes.bfloat16)

    ref_out, ref_lse = reference.attention_fwd(*host, causal=True)
    naive_out, naive_lse = reference.naive_attention(*host, causal=True, dtype="bfloat16")
    check("out", bf16(out), ref_out, [naive_out], testing.OUT_FACTOR)
    check("lse", lse, ref_lse, [naive_lse], testing.OUT_FACTOR)
    refs = reference.attention_bwd(dout, *host, causal=True)
    naives = reference.naive_attention_bwd(dout, *host, causal=True, dtype="bfloat16")
    for name, g, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, naives):
        check(name, bf16(g), r, [n], testing.GRAD_FACTOR)
    with pytest.raises(TypeError, match="pass dtype='bfloat16'"):
        cupyflash.flash_attn(q, k, v)


# ----------------------------------------------------------------------------
# JAX
# ----------------------------------------------------------------------------


def _jax_qkv(jax, rng, dtype):
    gpu = jax.devices("gpu")[0]
    return tuple(jax.device_put(jax.numpy.asarray(x, dtype), gpu) for x in _draw(rng))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_jax_zero_copy_in_and_out(monkeypatch, jax, rng, dtype):
    calls = _spy(monkeypatch, "fwd")
    q, k, v = _jax_qkv(jax, rng, dtype)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    [f] = calls
    assert f["inputs"] == [x.unsafe_buffer_pointer() for x in (q, k, v)]
    assert f["outputs"] == [out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()]
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and lse.dtype == np.float32
    host = [_host(x) for x in (q, k, v)]
    check("out", out, reference.attention_fwd(*host, causal=True)[0],
          [reference.naive_attention(*host, causal=True, dtype=dtype)[0]], testing.OUT_FACTOR)
    jax.block_until_ready(out)
    cupyflash.flash_attn(q, k, v)
    assert len(_interop._PENDING) <= 2  # inputs are released once the kernels are done


def test_jax_stream_ordering(jax, rng):
    """q comes out of a long JAX computation still running; the kernels must wait for it."""
    jnp = jax.numpy
    q_src, k, v = _jax_qkv(jax, rng, "float16")
    expected = np.asarray(cupyflash.flash_attn(q_src, k, v))
    x = jax.random.normal(jax.random.key(1), (4096, 4096)) / 64

    @jax.jit
    def late_q(x, q_src):
        y = jax.lax.fori_loop(0, 200, lambda i, y: jnp.tanh(y @ x), x)
        return q_src + (jnp.sum(y) > 1e30).astype(q_src.dtype)  # == q_src, only once y is done

    late_q(x, q_src).block_until_ready()  # compile first
    q = late_q(x, q_src)  # dispatched, still running
    out = cupyflash.flash_attn(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_jax_flash_attention_grads_match_dot_product_attention(jax, rng, dtype, causal):
    from cupyflash.jax import flash_attention

    q, k, v = _jax_qkv(jax, rng, dtype)
    dout = _jax_qkv(jax, rng, dtype)[0]
    w = jax.numpy.eye(D, dtype=dtype)

    def vjp(attention, jit):
        # q and k go through an exact in-graph projection (identity), so the kernels
        # must be ordered after XLA's own work on its stream
        def f(q, k, v):
            return attention(q @ w, k @ w, v)

        if jit:
            f = jax.jit(f)
        out, pullback = jax.vjp(f, q, k, v)
        return out, pullback(dout)

    ours = lambda q, k, v: flash_attention(q, k, v, causal=causal)
    theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    naive, naive_grads = vjp(theirs, jit=True)
    host = [_host(x) for x in (dout, q, k, v)]
    ref = reference.attention_fwd(*host[1:], causal=causal)[0]
    ref_grads = reference.attention_bwd(*host, causal=causal)
    ours_naive = reference.naive_attention(*host[1:], causal=causal, dtype=dtype)[0]
    ours_naive_grads = reference.naive_attention_bwd(*host, causal=causal, dtype=dtype)
    for jit in (False, True):
        out, grads = vjp(ours, jit)
        assert out.dtype == q.dtype
        check("out", out, ref, [naive, ours_naive], testing.OUT_FACTOR)
        for name, g, r, n, n2 in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads,
                                     ours_naive_grads):
            assert g.dtype == q.dtype
            check(name, g, r, [n, n2], testing.GRAD_FACTOR)


def test_jax_flash_attention_writes_xla_buffers_in_place(monkeypatch, jax, rng):
    from cupyflash.jax import flash_attention

    calls = _spy(monkeypatch, "fwd")
    q, k, v = _jax_qkv(jax, rng, "bfloat16")
    out = flash_attention(q, k, v)
    [f] = calls
    assert f["inputs"] == [x.unsafe_buffer_pointer() for x in (q, k, v)]
    assert f["outputs"][0] == out.unsafe_buffer_pointer()
    assert f["dtype"] == "bfloat16"


def test_jax_backward_writes_xla_gradient_buffers_in_place(monkeypatch, jax, rng):
    """dq, dk, dv are XLA's own output buffers; the backward reads the forward's out and lse in place."""
    from cupyflash.jax import flash_attention

    fwd_calls, bwd_calls = _spy(monkeypatch, "fwd"), _spy(monkeypatch, "bwd")
    q, k, v = _jax_qkv(jax, rng, "bfloat16")
    dout = _jax_qkv(jax, rng, "bfloat16")[0]
    out, pullback = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v)
    grads = pullback(dout)
    [f], [b] = fwd_calls, bwd_calls
    assert b["outputs"] == [g.unsafe_buffer_pointer() for g in grads]
    assert b["inputs"][:4] == [x.unsafe_buffer_pointer() for x in (dout, q, k, v)]
    assert b["inputs"][4:] == f["outputs"]  # out and lse, where the forward wrote them
    assert b["dtype"] == "bfloat16"


def test_jax_jit_step_plans_once_and_allocates_nothing_in_cupy(monkeypatch, jax, rng):
    """A repeated jit step re-plans nothing (the plans made at trace time are the ones
    run), and the scratch is XLA's: CuPy's pool (_launch.cupy_alloc) is never asked."""
    from cupyflash import _gpu, _gpu_bwd, _launch
    from cupyflash.jax import flash_attention

    planned = {"fwd": 0, "bwd": 0}

    def counting(kind, real):
        def plan(*args, **kwargs):
            planned[kind] += 1
            return real(*args, **kwargs)
        return plan

    def no_pool(nbytes):
        raise AssertionError(f"the JAX path asked CuPy's pool for {nbytes} bytes")

    monkeypatch.setattr(_gpu, "plan_fwd", counting("fwd", _gpu.plan_fwd))
    monkeypatch.setattr(_gpu_bwd, "plan_bwd", counting("bwd", _gpu_bwd.plan_bwd))
    monkeypatch.setattr(_launch, "cupy_alloc", no_pool)
    jnp = jax.numpy
    # a signature of its own (seqlen_q 96): no other JAX test planned it already
    gpu = jax.devices("gpu")[0]
    q, k, v = (jax.device_put(jnp.asarray(x, jnp.bfloat16), gpu) for x in _draw(rng, seqlen_q=96))
    step = jax.jit(jax.grad(lambda q, k, v: flash_attention(q, k, v, causal=True).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2)))
    first = jax.block_until_ready(step(q, k, v))
    assert planned == {"fwd": 1, "bwd": 1}  # at trace time, and that plan is the one run
    for _ in range(3):
        again = jax.block_until_ready(step(q, k, v))
    jax.block_until_ready(step(q * 2, k, v))  # other buffers, same signature
    assert planned == {"fwd": 1, "bwd": 1}
    for a, b in zip(first, again):
        np.testing.assert_allclose(_host(a), _host(b), rtol=1e-2, atol=1e-2)


def test_jax_flash_attention_variant_grads_match_reference(jax, rng):
    """jax.jit(jax.grad) through flash_attention with sinks, window, softcap, ALiBi and dropout
    (a PRNG key) on the GPU: q, k, v and sinks against the float64 reference."""
    from cupyflash import _philox
    from cupyflash.jax import flash_attention

    jnp = jax.numpy
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _draw(rng))
    dout = jnp.asarray(_draw(rng)[0], jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(HQ).astype(np.float32))
    alibi = jnp.full((HQ,), 0.03, jnp.float32)
    key = jax.random.key(3)
    kw = dict(causal=True, window_size=(50, 0), softcap=6.0, dropout_p=0.15)

    def loss(q, k, v, sinks, key):
        out = flash_attention(q, k, v, sinks=sinks, alibi_slopes=alibi, rng_state=key, **kw)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks, key)
    bits = [int(b) for b in np.asarray(jax.random.bits(key, (3,), jnp.uint32))]
    state = (bits[0] | bits[1] << 32, bits[2])
    mask = _philox.dropout_keep_mask(*state, kw["dropout_p"], B, HQ, S, S)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    host = [np.asarray(x).astype(ml_dtypes.bfloat16) for x in (dout, q, k, v)]
    variants = dict(window_size=kw["window_size"], softcap=kw["softcap"], alibi_slopes=np.asarray(alibi),
                    sinks=np.asarray(sinks), dropout_p=kw["dropout_p"], dropout_mask=mask)
    # dsinks against the reference of the out the backward's delta came from (given_out)
    out = np.asarray(flash_attention(q, k, v, sinks=sinks, alibi_slopes=alibi, rng_state=key, **kw))
    testing.assert_bwd_matches_reference(*host, *(np.asarray(g).astype(ml_dtypes.bfloat16) for g in grads[:3]),
                                         causal=True, dsinks=np.asarray(grads[3]),
                                         out=out.astype(ml_dtypes.bfloat16), **variants)


def test_jax_and_torch_mixed_is_rejected(jax, torch, rng):
    q, k, v = _jax_qkv(jax, rng, "float16")
    with pytest.raises(TypeError, match=r"k must be a jax\.Array like q \(array types cannot be "
                                        r"mixed\); got torch\.Tensor\."):
        cupyflash.flash_attn(q, torch.from_dlpack(k), v)


# ----------------------------------------------------------------------------
# Varlen (packed) functions: torch CUDA and JAX GPU, cu_seqlens viewed in place too
# ----------------------------------------------------------------------------

# an empty key side, an empty query side, more rows than one tile, len_q > len_k
VARLEN_LENS_Q, VARLEN_LENS_K = (37, 0, 150, 5, 70), (64, 9, 130, 0, 33)
VARLEN_MAX = (max(VARLEN_LENS_Q), max(VARLEN_LENS_K))


def _varlen_host(rng, dtype):
    """Host (q, k, v, dout) in ``dtype`` (bfloat16: ml_dtypes), int32 (cu_seqlens_q, _k)."""
    from test_varlen import cu_seqlens, packed_inputs  # sibling module

    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    q, k, v = packed_inputs(rng, VARLEN_LENS_Q, VARLEN_LENS_K, HQ, HKV, D, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    return q, k, v, dout, cu_seqlens(VARLEN_LENS_Q), cu_seqlens(VARLEN_LENS_K)


def _varlen_run(q, k, v, dout, cu_q, cu_k, causal):
    """``({out, lse, dq, dk, dv}, out of flash_attn_varlen)`` in the inputs' type."""
    args = (cu_q, cu_k, *VARLEN_MAX)
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, causal=causal)
    alone = cupyflash.flash_attn_varlen(q, k, v, *args, causal=causal)
    dq, dk, dv = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *args, causal=causal)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), alone


def _check_varlen(results, host, causal):
    """Each sequence against the float64 reference (test_varlen's packed_reference)."""
    from test_varlen import packed_reference  # sibling module

    q, k, v, dout, cu_q, cu_k = host
    refs = packed_reference(q, k, v, dout, cu_q, cu_k, causal)
    for name, got in results.items():
        ref, naive = refs[name]
        factor = testing.OUT_FACTOR if name in ("out", "lse") else testing.GRAD_FACTOR
        testing.assert_close_to_reference(name, _host(got), ref, naive, factor, FLOOR)


def _spy_varlen(monkeypatch):
    """Records the device pointers the varlen checks see (and dtype=, the stream), and the
    pointers of the CuPy results before they are handed back."""
    from cupyflash import _varlen

    cp = _cp()
    seen = {"inputs": [], "extras": [], "outputs": [], "dtype": [], "stream": []}
    from cupyflash import _checks

    real_check, real_extras, real_map = (_varlen._check_varlen, _checks.check_bwd_extras,
                                         _interop._map)

    def check(fn, q, k, v, cu_q, cu_k, *rest):
        seen["inputs"].append([a.data.ptr for a in (q, k, v, cu_q, cu_k)])
        seen["dtype"].append(rest[-1])
        seen["stream"].append(cp.cuda.get_current_stream().ptr)
        return real_check(fn, q, k, v, cu_q, cu_k, *rest)

    def extras(fn, dout, out, lse, q, packed=False):
        seen["extras"].append([a.data.ptr for a in (dout, out, lse)])
        return real_extras(fn, dout, out, lse, q, packed)

    def map_(result, convert):
        seen["outputs"].append([a.data.ptr for a in
                                (result if isinstance(result, tuple) else (result,))])
        return real_map(result, convert)

    monkeypatch.setattr(_varlen, "_check_varlen", check)
    monkeypatch.setattr(_checks, "check_bwd_extras", extras)
    monkeypatch.setattr(_interop, "_map", map_)
    return seen


def _spy_gpu_dtype(monkeypatch):
    """Records the dtype= of each GPU call (varlen kernels, or the per-sequence fwd/bwd)."""
    from cupyflash import _gpu

    dtypes = []
    for name in ("varlen_fwd", "varlen_bwd", "fwd", "bwd"):
        real = getattr(_gpu, name, None)
        if real is None:
            continue

        def spy(*args, _real=real, **kwargs):
            dtypes.append(kwargs.get("dtype"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(_gpu, name, spy)
    return dtypes


def _to_torch(torch, x):
    return _interop.numpy_to_torch(x).to("cuda")  # bfloat16 (ml_dtypes) -> torch.bfloat16


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_varlen_zero_copy_in_and_out(monkeypatch, torch, rng, dtype):
    host = _varlen_host(rng, dtype)
    q, _, _, dout, cu_q, cu_k = (_to_torch(torch, x) for x in host)
    # k and v strided views into a packed kv tensor, read in place
    kv = _to_torch(torch, testing.random_normal(rng, (sum(VARLEN_LENS_K), 2, HKV, D), dtype))
    k, v = kv[:, 0], kv[:, 1]
    seen, gpu_dtypes = _spy_varlen(monkeypatch), _spy_gpu_dtype(monkeypatch)
    args = (cu_q, cu_k, *VARLEN_MAX)
    out, lse = cupyflash.flash_attn_varlen_fwd(q, k, v, *args, causal=True)
    dq, dk, dv = cupyflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *args, causal=True)
    ptrs = [x.data_ptr() for x in (q, k, v, cu_q, cu_k)]
    assert seen["inputs"] == [ptrs, ptrs]
    assert seen["extras"] == [[x.data_ptr() for x in (dout, out, lse)]]
    assert seen["outputs"] == [[out.data_ptr(), lse.data_ptr()],
                               [x.data_ptr() for x in (dq, dk, dv)]]
    want_dtype = "bfloat16" if dtype == "bfloat16" else None
    assert seen["dtype"] == [want_dtype] * 2
    assert gpu_dtypes and set(gpu_dtypes) == {want_dtype}
    assert set(seen["stream"]) == {torch.cuda.current_stream().cuda_stream}
    for x in (out, lse, dq, dk, dv):
        assert isinstance(x, torch.Tensor) and x.device == q.device
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == q.dtype
    assert lse.dtype == torch.float32 and lse.shape == (HQ, sum(VARLEN_LENS_Q))
    assert (dk.shape, dv.shape) == (k.shape, v.shape)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_varlen_matches_reference_per_sequence(torch, rng, dtype, causal):
    host = _varlen_host(rng, dtype)
    results, alone = _varlen_run(*(_to_torch(torch, x) for x in host), causal)
    assert torch.equal(alone, results["out"])
    for name, x in results.items():
        assert isinstance(x, torch.Tensor) and x.is_cuda
        assert x.dtype == (torch.float32 if name == "lse" else getattr(torch, dtype))
    _check_varlen(results, host, causal)


def test_torch_varlen_cu_seqlens_rules(torch, rng):
    cp = _cp()
    q, k, v, _, cu_q, cu_k = (_to_torch(torch, x) for x in _varlen_host(rng, "float16"))
    fn = cupyflash.flash_attn_varlen
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_varlen: cu_seqlens_q must have "
                                         r"the same device as q \(cuda:0\); got cpu\.$"):
        fn(q, k, v, cu_q.cpu(), cu_k, *VARLEN_MAX)
    with pytest.raises(TypeError, match=r"^cupyflash\.flash_attn_varlen: cu_seqlens_k must be a "
                                        r"torch\.Tensor like q \(array types cannot be mixed\); "
                                        r"got cupy\.ndarray\.$"):
        fn(q, k, v, cu_q, cp.from_dlpack(cu_k), *VARLEN_MAX)
    with pytest.raises(TypeError, match=r"cu_seqlens_k must have dtype int32; got int64\.$"):
        fn(q, k, v, cu_q, cu_k.long(), *VARLEN_MAX)


def _to_jax(jax, x):
    return jax.device_put(jax.numpy.asarray(x), jax.devices("gpu")[0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_jax_varlen_zero_copy_and_matches_reference(monkeypatch, jax, rng, dtype, causal):
    host = _varlen_host(rng, dtype)
    q, k, v, dout, cu_q, cu_k = inputs = [_to_jax(jax, x) for x in host]
    assert cu_q.dtype == np.int32
    seen, gpu_dtypes = _spy_varlen(monkeypatch), _spy_gpu_dtype(monkeypatch)
    results, alone = _varlen_run(*inputs, causal)
    ptrs = [x.unsafe_buffer_pointer() for x in (q, k, v, cu_q, cu_k)]
    assert seen["inputs"] == [ptrs] * 3
    out, lse = results["out"], results["lse"]
    assert seen["extras"] == [[x.unsafe_buffer_pointer() for x in (dout, out, lse)]]
    assert seen["outputs"] == [[out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()],
                               [alone.unsafe_buffer_pointer()],
                               [results[n].unsafe_buffer_pointer() for n in ("dq", "dk", "dv")]]
    want_dtype = "bfloat16" if dtype == "bfloat16" else None
    assert seen["dtype"] == [want_dtype] * 3
    assert gpu_dtypes and set(gpu_dtypes) == {want_dtype}
    for name, x in results.items():
        assert isinstance(x, jax.Array) and x.devices() == q.devices()
        assert x.dtype == (np.float32 if name == "lse" else q.dtype)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(out))
    _check_varlen(results, host, causal)


def test_jax_and_torch_varlen_mixed_is_rejected(jax, torch, rng):
    q, k, v, _, cu_q, cu_k = (_to_jax(jax, x) for x in _varlen_host(rng, "float16"))
    with pytest.raises(TypeError, match=r"cu_seqlens_q must be a jax\.Array like q \(array types "
                                        r"cannot be mixed\); got torch\.Tensor\.$"):
        cupyflash.flash_attn_varlen(q, k, v, torch.from_dlpack(cu_q), cu_k, *VARLEN_MAX)
