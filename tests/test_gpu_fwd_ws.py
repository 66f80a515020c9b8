"""The warp-specialised TMA forward (kernels_cu/flash_fwd_ws.cu) on the GPU against
the float64 reference, switched on (dispatch.FWD_WS) at every head_dim it has for each
test; skipped without a GPU, and off compute capability 9.0.

Every case must run that kernel: the fixture reports one SM, so the split-KV heuristic
(which the warp-specialised kernel does not serve) never splits the small grids here,
and each test asserts the launch. Results are held to the naive rule with the naive
implementation in the inputs' dtype (test_gpu_fwd.check)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from test_gpu_fwd import check, make_inputs  # sibling module

from cupyflash import testing
from cupyflash.testing import from_bf16_bits

pytestmark = pytest.mark.gpu

WS_KERNEL = "flash_fwd_ws_kernel"


@pytest.fixture
def ws_on(monkeypatch, launches):
    """The switch on at every head_dim (plans made afresh: conftest's fresh_plans), on a
    cc 9.0 device that reports one SM (no split-KV: conftest restores num_sms); yields
    the names of the kernels launched."""
    cp = pytest.importorskip("cupy")
    from cupyflash import _gpu, _launch, dispatch

    cc = tuple(int(c) for c in cp.cuda.Device().compute_capability)
    if cc != (9, 0):
        pytest.skip(f"the warp-specialised forward runs on compute capability 9.0; this GPU is {cc}")
    monkeypatch.setattr(dispatch, "FWD_WS", True)
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: 1)
    _gpu.select_fwd.cache_clear()
    yield launches
    _gpu.select_fwd.cache_clear()


def _run(dev, dtype, scale, causal):
    """The forward into NaN-poisoned outputs (every allocation 0xFF); host float32 (out, lse)."""
    import cupy

    from cupyflash import _gpu

    with testing.poisoned_allocations(cupy):
        out, lse = _gpu.fwd(*dev, softmax_scale=scale, causal=causal, dtype=dtype)
        out, lse = out.get(), lse.get()
    out = from_bf16_bits(out) if dtype == "bfloat16" else out.astype(np.float32)
    return out, lse


def _check(host, out, lse, dtype, scale, causal):
    """The naive rule, the naive implementation in ``dtype`` (host holds float32 copies)."""
    check(host, out, lse, dtype, scale, causal)


# Lengths that are not multiples of the 128-row tiles, one block, several, q != k both ways.
SEQLENS = [(1, 1), (100, 100), (1000, 1000), (4097, 4097), (100, 1000), (1000, 100), (1, 4097), (129, 257)]


def _grid():
    """Every length pair, causal and not, at D=128 and 64; dtype and GQA alternate."""
    cases = []
    for i, (sq, sk) in enumerate(SEQLENS):
        for causal in (False, True):
            for j, d in enumerate((128, 64)):
                dtype = "bfloat16" if (i + j + causal) % 2 else "float16"
                gqa = 4 if (i + j) % 3 == 0 else 1
                cases.append((dtype, d, causal, sq, sk, gqa))
    return cases


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,gqa", _grid())
def test_ws_fwd_matches_reference(ws_on, rng, dtype, head_dim, causal, seqlen_q, seqlen_k, gqa):
    batch = 2 if seqlen_q * seqlen_k < 4_000_000 else 1
    nheads_kv = 2
    host, dev = make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads_kv * gqa, nheads_kv, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _run(dev, dtype, scale, causal)
    assert ws_on == [WS_KERNEL]
    _check(host, out, lse, dtype, scale, causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [104, 40])
@pytest.mark.parametrize("causal", [False, True])
def test_ws_fwd_head_dim_below_the_tile(ws_on, rng, dtype, head_dim, causal):
    """head_dim < HEAD_DIM: TMA zero-fills the missing columns, the stores skip them.
    (Multiples of 8: TMA needs 16-byte strides; 100 would go to the mma.sync kernel.)"""
    host, dev = make_inputs(rng, dtype, 2, 333, 517, 4, 2, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _run(dev, dtype, scale, causal)
    assert ws_on == [WS_KERNEL]
    _check(host, out, lse, dtype, scale, causal)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_ws_fwd_strided_views(ws_on, rng, head_dim):
    """q, k, v as views into one packed (B, S, 3, H, D) tensor: the maps take the
    tensors' own row and head strides."""
    import cupy

    from cupyflash import _gpu

    qkv32 = rng.standard_normal((2, 777, 3, 4, head_dim), dtype=np.float32).astype(np.float16)
    qkv = cupy.asarray(qkv32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _gpu.fwd(q, k, v, softmax_scale=scale, causal=True)
    assert ws_on == [WS_KERNEL]
    host = [qkv32[:, :, i].astype(np.float32) for i in range(3)]
    _check(host, out.get().astype(np.float32), lse.get(), "float16", scale, True)


def test_ws_fwd_new_pointers_same_plan(ws_on, rng):
    """A second call with the same geometry at other addresses (one plan, maps encoded
    again) and a third at the first call's (maps from the cache)."""
    host_a, dev_a = make_inputs(rng, "bfloat16", 1, 640, 640, 4, 4, 128)
    host_b, dev_b = make_inputs(rng, "bfloat16", 1, 640, 640, 4, 4, 128)
    for host, dev in ((host_a, dev_a), (host_b, dev_b), (host_a, dev_a)):
        out, lse = _run(dev, "bfloat16", 128 ** -0.5, False)
        _check(host, out, lse, "bfloat16", 128 ** -0.5, False)
    assert ws_on == [WS_KERNEL] * 3


@pytest.mark.parametrize("head_dim", [64, 128])
def test_ws_fwd_fully_masked_rows(ws_on, rng, head_dim):
    """causal with seqlen_q > seqlen_k: rows that see no key give out 0 and lse -inf,
    and whole query blocks with no key block too."""
    host, dev = make_inputs(rng, "float16", 1, 400, 50, 2, 2, head_dim)
    out, lse = _run(dev, "float16", 0.125, True)
    assert ws_on == [WS_KERNEL]
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[:, :350], 0)
    assert np.all(lse[:, :, :350] == -np.inf)
    _check(host, out, lse, "float16", 0.125, True)


@pytest.mark.parametrize("causal", [False, True])
def test_ws_fwd_long(ws_on, rng, causal):
    """16k tokens at D=128 (the shape it is measured at), checked on a row subset."""
    import cupy

    from cupyflash import _gpu, reference

    host, dev = make_inputs(rng, "bfloat16", 1, 16384, 16384, 2, 2, 128)
    with testing.poisoned_allocations(cupy):
        out, lse = _gpu.fwd(*dev, softmax_scale=128 ** -0.5, causal=causal, dtype="bfloat16")
        out, lse = from_bf16_bits(out.get()), lse.get()
    assert ws_on == [WS_KERNEL]
    rows = np.r_[0:130, 8100:8230, 16254:16384]
    q, k, v = host
    ref_out, ref_lse = reference.attention_fwd(q[:, rows], k, v, 128 ** -0.5, False) if not causal else (None, None)
    if causal:  # each row i sees keys 0..i (seqlen_q == seqlen_k)
        ref_out = np.empty((1, len(rows), 2, 128))
        ref_lse = np.empty((1, 2, len(rows)))
        for n, i in enumerate(rows):
            o, l_ = reference.attention_fwd(q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1], 128 ** -0.5, False)
            ref_out[:, n], ref_lse[:, :, n] = o[:, 0], l_[:, :, 0]
    np.testing.assert_allclose(out[:, rows], ref_out, atol=2e-2, rtol=0)
    np.testing.assert_allclose(lse[:, :, rows], ref_lse, atol=1e-3, rtol=1e-4)
