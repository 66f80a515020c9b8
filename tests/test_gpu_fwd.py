"""Forward kernel on the GPU against the float64 reference (skipped without a GPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash import testing
from cupyflash.testing import from_bf16_bits, to_bf16_bits

pytestmark = pytest.mark.gpu

SEQLENS = [(1, 1), (1, 17), (17, 1), (113, 203), (203, 113), (512, 256), (1023, 1024)]
HEAD_DIMS = [8, 32, 40, 59, 64, 96, 111, 128, 192, 256]


def _cp():
    return pytest.importorskip("cupy")


def make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim):
    """Host float32 copies (exactly representable in dtype) and device arrays."""
    cp = _cp()
    shapes = [(batch, seqlen_q, nheads_q, head_dim)] + [(batch, seqlen_k, nheads_kv, head_dim)] * 2
    host, dev = [], []
    for shape in shapes:
        x = rng.standard_normal(shape, dtype=np.float32)
        if dtype == "float16":
            x = x.astype(np.float16)
            host.append(x.astype(np.float32))
            dev.append(cp.asarray(x))
        else:
            bits = to_bf16_bits(x)
            host.append(from_bf16_bits(bits))
            dev.append(cp.asarray(bits))
    return host, dev


def run_fwd(dev, dtype, softmax_scale, causal):
    """Run the kernel into NaN-poisoned outputs; return host float32 (out, lse)."""
    cp = _cp()
    from cupyflash import _gpu

    q, k, v = dev
    out = cp.full(q.shape, 0xFFFF if dtype == "bfloat16" else np.nan, dtype=q.dtype)  # NaN either way
    lse = cp.full((q.shape[0], q.shape[2], q.shape[1]), np.nan, dtype=cp.float32)
    out, lse = _gpu.fwd(q, k, v, softmax_scale=softmax_scale, causal=causal, dtype=dtype, out=out, lse=lse)
    out = out.get()
    out = from_bf16_bits(out) if dtype == "bfloat16" else out.astype(np.float32)
    return out, lse.get()


def check(host, out, lse, dtype, softmax_scale, causal):
    q, k, v = host
    naive_dtype = "bfloat16" if dtype == "bfloat16" else np.float16
    from cupyflash import reference

    ref_out, ref_lse = reference.attention_fwd(q, k, v, softmax_scale, causal)
    naive_out, naive_lse = reference.naive_attention(q, k, v, softmax_scale, causal, naive_dtype)
    floor = 1e-3
    testing.assert_close_to_reference("out", out, ref_out, naive_out, testing.OUT_FACTOR, floor)
    testing.assert_close_to_reference("lse", lse, ref_lse, naive_lse, testing.OUT_FACTOR, floor)


def _grid():
    cases = []
    for i, d in enumerate(HEAD_DIMS):
        for j, (sq, sk) in enumerate(SEQLENS):
            causal = (i + j) % 2 == 0
            dtype = "float16" if (i + 2 * j) % 3 else "bfloat16"
            gqa = 4 if (i * 3 + j) % 4 == 0 else 1
            cases.append((dtype, d, causal, sq, sk, gqa))
    return cases


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,gqa", _grid())
def test_fwd_matches_reference(rng, dtype, head_dim, causal, seqlen_q, seqlen_k, gqa):
    host, dev = make_inputs(rng, dtype, 2, seqlen_q, seqlen_k, 2 * gqa, 2, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = run_fwd(dev, dtype, scale, causal)
    check(host, out, lse, dtype, scale, causal)


@pytest.mark.slow
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fwd_full_grid(rng, dtype, head_dim, causal, seqlen_q, seqlen_k, gqa):
    host, dev = make_inputs(rng, dtype, 2, seqlen_q, seqlen_k, 4, 4 // gqa, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = run_fwd(dev, dtype, scale, causal)
    check(host, out, lse, dtype, scale, causal)


def _cc():
    cp = _cp()
    return tuple(int(c) for c in cp.cuda.Device().compute_capability)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 104])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(384, 384), (1000, 1500), (1500, 1000), (129, 257), (640, 8)])
def test_fwd_wgmma_kernel(rng, monkeypatch, launches, dtype, head_dim, causal, seqlen_q, seqlen_k):
    """Hopper's cp.async wgmma kernel over several key blocks, tails, bottom-right causal,
    GQA (the warp-specialised forward, the default at D=64 and 128, off: tests/test_gpu_fwd_ws.py)."""
    from cupyflash import _gpu, dispatch

    if _cc() != (9, 0):
        pytest.skip(f"the wgmma kernel runs on compute capability 9.0; this GPU is {_cc()}")
    monkeypatch.setattr(dispatch, "FWD_WS", False)
    _gpu.clear_plans()
    plan = dispatch.select_fwd(batch=4, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=16, head_dim=head_dim,
                               dtype=dtype, causal=causal, vec=True, num_sms=132, cc=(9, 0))
    assert plan.main.template == "cupyflash::flash_fwd_sm90_kernel"  # (no split-KV at these sizes)
    host, dev = make_inputs(rng, dtype, 4, seqlen_q, seqlen_k, 16, 4, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = run_fwd(dev, dtype, scale, causal)
    assert launches == ["flash_fwd_sm90_kernel"]  # the plan above ran, not the ws kernel
    check(host, out, lse, dtype, scale, causal)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fwd_fully_masked_rows(rng, head_dim):
    """causal with seqlen_q > seqlen_k: rows that see no key give out 0 and lse -inf, no
    NaN; a query block with no key block at all likewise."""
    host, dev = make_inputs(rng, "float16", 1, 400, 50, 2, 2, head_dim)
    out, lse = run_fwd(dev, "float16", 0.125, True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[:, :350], 0)
    assert np.all(lse[:, :, :350] == -np.inf)
    check(host, out, lse, "float16", 0.125, True)


@pytest.mark.parametrize("causal", [False, True])
def test_fwd_public_api_fp16(rng, causal):
    cp = _cp()
    import cupyflash

    host, dev = make_inputs(rng, "float16", 2, 300, 257, 8, 2, 64)
    out, lse = cupyflash.flash_attn_fwd(*dev, causal=causal)
    check(host, out.get().astype(np.float32), lse.get(), "float16", 1 / 8, causal)
    assert isinstance(out, cp.ndarray) and out.dtype == cp.float16


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fwd_noncontiguous_qkv_slices(rng, head_dim):
    """q, k, v as views into one packed (B, S, 3, H, D) tensor: strides honoured, no copies."""
    cp = _cp()
    from cupyflash import _gpu

    qkv32 = rng.standard_normal((2, 333, 3, 4, head_dim), dtype=np.float32).astype(np.float16)
    qkv = cp.asarray(qkv32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _gpu.fwd(q, k, v, softmax_scale=scale, causal=True)
    ref, ref_lse = _gpu.fwd(cp.ascontiguousarray(q), cp.ascontiguousarray(k), cp.ascontiguousarray(v),
                            softmax_scale=scale, causal=True)
    cp.testing.assert_array_equal(out, ref)
    cp.testing.assert_array_equal(lse, ref_lse)
    host = [qkv32[:, :, i].astype(np.float32) for i in range(3)]
    check(host, out.get().astype(np.float32), lse.get(), "float16", scale, True)


def test_fwd_fully_masked_rows(rng):
    """causal with seqlen_q > seqlen_k: the first rows see no key -> out 0, lse -inf, no NaN."""
    host, dev = make_inputs(rng, "float16", 1, 200, 50, 2, 2, 64)
    out, lse = run_fwd(dev, "float16", 0.125, True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[:, :150], 0)
    assert np.all(lse[:, :, :150] == -np.inf)
    check(host, out, lse, "float16", 0.125, True)


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", [(1, 8192, False), (16, 20000, False), (64, 4096, True),
                                                      (1, 5, False)])
def test_fwd_split_kv_decode(rng, seqlen_q, seqlen_k, causal):
    """Decode shapes go through split-KV and the lse-merge combine kernel."""
    from cupyflash import dispatch

    plan = dispatch.select_fwd(batch=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_q=4, head_dim=128,
                               dtype="float16", causal=causal, vec=True)
    if seqlen_k > 1000:
        assert plan.num_splits > 1
    host, dev = make_inputs(rng, "float16", 1, seqlen_q, seqlen_k, 4, 4, 128)
    out, lse = run_fwd(dev, "float16", 128 ** -0.5, causal)
    check(host, out, lse, "float16", 128 ** -0.5, causal)


def test_fwd_long_sequence_32k(rng):
    cp = _cp()
    from cupyflash import _gpu

    host, dev = make_inputs(rng, "float16", 1, 32768, 32768, 1, 1, 64)
    out, lse = _gpu.fwd(*dev, softmax_scale=0.125, causal=True)
    rows = np.r_[0:64, 16000:16064, 32700:32768]
    q, k, v = host
    # The reference on a row subset: the causal limit for row i is i (seqlen_q == seqlen_k).
    ref_o = np.empty((len(rows), 64))
    for n, i in enumerate(rows):
        s = (q[0, i, 0].astype(np.float64) @ k[0, : i + 1, 0].T.astype(np.float64)) * 0.125
        p = np.exp(s - s.max())
        ref_o[n] = (p / p.sum()) @ v[0, : i + 1, 0].astype(np.float64)
    err = np.abs(out.get()[0, rows, 0].astype(np.float64) - ref_o).max()
    assert err < 2e-3, err
    assert not cp.isnan(lse).any()


def test_fwd_many_heads_and_int64_offsets(rng):
    """batch * heads above 65535 and more than 2**31 elements in one tensor."""
    cp = _cp()
    from cupyflash import _gpu

    q = cp.asarray(rng.standard_normal((70000, 16, 1, 32), dtype=np.float32).astype(np.float16))
    out, lse = _gpu.fwd(q, q, q, softmax_scale=32 ** -0.5, causal=False)
    host = q[-3:].get().astype(np.float32)
    from cupyflash import reference
    ref, _ = reference.attention_fwd(host, host, host, 32 ** -0.5, False)
    assert np.abs(out[-3:].get().astype(np.float64) - ref).max() < 2e-3

    # q's batch stride exceeds 2**31 elements, so batch 1 sits past every 32-bit offset.
    n = 2**31 // (64 * 64) + 16
    big = cp.empty((2, n, 64, 64), dtype=cp.float16)
    q = big[:, -64:, :2]
    q[...] = cp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(np.float16))
    kv = cp.asarray(rng.standard_normal((2, 100, 2, 64), dtype=np.float32).astype(np.float16))
    out, _ = _gpu.fwd(q, kv, kv, softmax_scale=0.125, causal=False)
    hq, hkv = q.get().astype(np.float32), kv.get().astype(np.float32)
    ref, _ = reference.attention_fwd(hq, hkv, hkv, 0.125, False)
    assert np.abs(out.get().astype(np.float64) - ref).max() < 2e-3
    del big


def test_fwd_matches_cpu_path(rng):
    import cupyflash

    host, dev = make_inputs(rng, "float16", 2, 257, 300, 4, 2, 64)
    out_gpu, lse_gpu = cupyflash.flash_attn_fwd(*dev, causal=True)
    out_cpu, lse_cpu = cupyflash.flash_attn_fwd(*(x.astype(np.float16) for x in host), causal=True)
    np.testing.assert_allclose(out_gpu.get().astype(np.float32), out_cpu.astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(lse_gpu.get(), lse_cpu, atol=1e-3, rtol=1e-4)
