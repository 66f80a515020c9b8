"""Backward kernels on the GPU against the float64 reference (skipped without a GPU).

Tolerance (cupyflash.testing): max|gpu - ref64| <= 3 * max|naive - ref64| + 1e-3,
where naive is the dense computation in the input dtype with fp32 matmul
accumulation, rounded per op; NaN never passes.  The forward's out and lse come
from the GPU forward, as in training.

The grid is head_dim x causal x (seqlen_q, seqlen_k) x GQA ratio x
deterministic (dtype alternates by index).  The full grid is marked ``slow``;
the default run takes a fixed subset, chosen by index arithmetic, that covers
every value of every axis.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from cupyflash import _launch

from cupyflash import reference, testing
from cupyflash.testing import from_bf16_bits, to_bf16_bits

pytestmark = pytest.mark.gpu

HEAD_DIMS = (32, 40, 59, 64, 96, 128, 256)
CAUSAL = (False, True)
SEQLENS = ((1, 1), (17, 1), (1, 17), (113, 203), (203, 113), (512, 256), (1023, 1024))
GQA = (1, 4)
DETERMINISTIC = (False, True)
_LARGE = 5  # SEQLENS[5:] are the expensive pairs (the dense reference dominates)
FLOOR = 1e-3


def _cp():
    return pytest.importorskip("cupy")


# ---------------------------------------------------------------------------
# inputs and checks
# ---------------------------------------------------------------------------


def to_device(x32: np.ndarray, dtype: str):
    """(host float32 copy exactly representable in dtype, device array of dtype's storage)."""
    cp = _cp()
    if dtype == "float16":
        x = x32.astype(np.float16)
        return x.astype(np.float32), cp.asarray(x)
    bits = to_bf16_bits(x32)
    return from_bf16_bits(bits), cp.asarray(bits)


def to_host(x, dtype: str) -> np.ndarray:
    x = x.get()
    return from_bf16_bits(x) if dtype == "bfloat16" else x.astype(np.float32)


def make_problem(rng, dtype, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim):
    """Host float32 copies and device arrays of q, k, v and a fresh dout."""
    shapes = [(batch, seqlen_q, nheads_q, head_dim), (batch, seqlen_k, nheads_kv, head_dim),
              (batch, seqlen_k, nheads_kv, head_dim), (batch, seqlen_q, nheads_q, head_dim)]
    pairs = [to_device(rng.standard_normal(s, dtype=np.float32), dtype) for s in shapes]
    return [h for h, _ in pairs], [d for _, d in pairs]


def run(dev, dtype, softmax_scale, causal, deterministic):
    """GPU forward, then GPU backward; returns the device (dq, dk, dv)."""
    from cupyflash import _gpu, _gpu_bwd

    q, k, v, dout = dev
    out, lse = _gpu.fwd(q, k, v, softmax_scale=softmax_scale, causal=causal, dtype=dtype)
    return _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                        deterministic=deterministic, dtype=dtype)


def check(host, grads, dtype, softmax_scale, causal):
    q, k, v, dout = host
    refs = reference.attention_bwd(dout, q, k, v, softmax_scale, causal)
    naive_dtype = np.float16
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")  # the naive bf16 reference rounds through it
        naive_dtype = "bfloat16"
    naives = reference.naive_attention_bwd(dout, q, k, v, softmax_scale, causal, naive_dtype)
    for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, refs, naives):
        assert got.shape == ref.shape, name
        testing.assert_close_to_reference(name, to_host(got, dtype), ref, naive, testing.GRAD_FACTOR, FLOOR)


def _shape_for(seqlens, gqa):
    """(batch, nheads_q, nheads_kv): smaller batch/heads for the large pairs."""
    seqlen_q, seqlen_k = seqlens
    if seqlen_q * seqlen_k > 1 << 16:
        return 1, gqa, 1
    return 2, 2 * gqa, 2


# ---------------------------------------------------------------------------
# the grid
# ---------------------------------------------------------------------------


def _in_default_run(i_hd, i_causal, i_seq, i_gqa, i_det):
    """Deterministic subset: a third of the small-seqlen grid, 16 cases for the large pairs."""
    if i_seq < _LARGE:
        return (i_hd + i_causal + i_seq + i_gqa + i_det) % 3 == 0
    return i_hd == (3 * i_causal + i_gqa + 2 * i_det + i_seq) % len(HEAD_DIMS)


def _grid():
    axes = (HEAD_DIMS, CAUSAL, SEQLENS, GQA, DETERMINISTIC)
    for idx in itertools.product(*(range(len(a)) for a in axes)):
        head_dim, causal, seqlens, gqa, det = (a[i] for a, i in zip(axes, idx))
        dtype = "bfloat16" if (idx[0] + idx[2] + idx[3]) % 3 == 0 else "float16"
        marks = () if _in_default_run(*idx) else (pytest.mark.slow,)
        name = (f"{dtype}-d{head_dim}-{'causal' if causal else 'full'}-{seqlens[0]}x{seqlens[1]}-"
                f"gqa{gqa}-{'det' if det else 'atomic'}")
        yield pytest.param(dtype, head_dim, causal, seqlens, gqa, det, marks=marks, id=name)


@pytest.mark.parametrize("dtype,head_dim,causal,seqlens,gqa,deterministic", list(_grid()))
def test_bwd_matches_reference(rng, dtype, head_dim, causal, seqlens, gqa, deterministic):
    batch, nheads_q, nheads_kv = _shape_for(seqlens, gqa)
    host, dev = make_problem(rng, dtype, batch, *seqlens, nheads_q, nheads_kv, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    grads = run(dev, dtype, scale, causal, deterministic)
    check(host, grads, dtype, scale, causal)


@pytest.mark.parametrize("deterministic", DETERMINISTIC, ids=["atomic", "det"])
def test_bwd_other_softmax_scale(rng, deterministic):
    """softmax_scale enters dq and dk once each (not 1/sqrt(head_dim) by accident)."""
    host, dev = make_problem(rng, "float16", 2, 150, 130, 4, 2, 64)
    grads = run(dev, "float16", 0.37, True, deterministic)
    check(host, grads, "float16", 0.37, True)


# ---------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim,causal,gqa", [(64, True, 4), (128, False, 1), (128, True, 2), (256, True, 1)])
def test_bwd_deterministic_is_bitwise_reproducible(rng, head_dim, causal, gqa):
    cp = _cp()
    host, dev = make_problem(rng, "float16", 2, 1023, 1024, 2 * gqa, 2, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    first = run(dev, "float16", scale, causal, True)
    for _ in range(2):
        again = run(dev, "float16", scale, causal, True)
        for a, b in zip(first, again):
            assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))


@pytest.mark.parametrize("deterministic", DETERMINISTIC, ids=["atomic", "det"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_fully_masked_rows_get_zero(rng, deterministic, head_dim):
    """causal, seqlen_q > seqlen_k: rows that see no key get dq = 0; nothing is NaN."""
    host, dev = make_problem(rng, "float16", 2, 300, 70, 4, 2, head_dim)
    grads = run(dev, "float16", 0.125, True, deterministic)
    dq, dk, dv = (to_host(g, "float16") for g in grads)
    for g in (dq, dk, dv):
        assert not np.isnan(g).any()
    np.testing.assert_array_equal(dq[:, :230], 0)  # row i sees key j iff j <= i - 230
    check(host, grads, "float16", 0.125, True)


def strided_problem(rng, head_dim):
    """fp16 q, k, v as views into one packed (B, S, 3, H, D) device tensor and dout a
    strided view of a wider one: (host float32 copies of q, k, v, dout; the device views)."""
    cp = _cp()
    qkv32 = rng.standard_normal((2, 333, 3, 4, head_dim), dtype=np.float32).astype(np.float16)
    qkv = cp.asarray(qkv32)
    dout_big = cp.asarray(rng.standard_normal((2, 333, 4, 2 * head_dim), dtype=np.float32).astype(np.float16))
    dout = dout_big[..., :head_dim]
    host = [qkv32[:, :, i].astype(np.float32) for i in range(3)] + [dout.get().astype(np.float32)]
    return host, (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dout)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_noncontiguous_qkv_slices(rng, head_dim):
    """q, k, v as views into one packed (B, S, 3, H, D) tensor, dout a strided view too."""
    cp = _cp()
    from cupyflash import _gpu, _gpu_bwd

    host, (q, k, v, dout) = strided_problem(rng, head_dim)
    scale = 1.0 / math.sqrt(head_dim)

    def grads(q, k, v, dout):
        out, lse = _gpu.fwd(q, k, v, softmax_scale=scale, causal=True)
        return _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=True, deterministic=True)

    got = grads(q, k, v, dout)
    want = grads(*(cp.ascontiguousarray(x) for x in (q, k, v, dout)))
    for a, b in zip(got, want):
        assert a.flags.c_contiguous
        cp.testing.assert_array_equal(a, b)
    check(host, got, "float16", scale, True)


@pytest.mark.parametrize("deterministic", DETERMINISTIC, ids=["atomic", "det"])
def test_bwd_unaligned_pointers_take_the_scalar_path(rng, deterministic):
    """Views starting one element into a row: no 16-byte loads (VEC=false), same results."""
    cp = _cp()
    from cupyflash import _gpu, _gpu_bwd, dispatch

    d = 64
    host, views = [], []
    for shape in [(2, 120, 4, d), (2, 90, 2, d), (2, 90, 2, d), (2, 120, 4, d)]:
        big32 = rng.standard_normal(shape[:-1] + (d + 1,), dtype=np.float32).astype(np.float16)
        host.append(big32[..., 1:].astype(np.float32))
        views.append(cp.asarray(big32)[..., 1:])
    q, k, v, dout = views
    assert not _gpu.vec_ok((q,), d)
    plan = dispatch.select_bwd(batch=2, seqlen_q=120, seqlen_k=90, nheads_q=4, nheads_kv=2, head_dim=d,
                               dtype="float16", causal=True, deterministic=deterministic, vec=False)
    assert plan.launches[1].args[10] == "false"
    out, lse = _gpu.fwd(q, k, v, softmax_scale=0.125, causal=True)
    grads = _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=0.125, causal=True,
                         deterministic=deterministic)
    check(host, grads, "float16", 0.125, True)


@pytest.mark.parametrize("cc", [(8, 0), (8, 9)], ids=["sm80-tiles", "sm89-tiles"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("deterministic", DETERMINISTIC, ids=["atomic", "det"])
def test_bwd_tiles_of_smaller_gpus(rng, monkeypatch, cc, head_dim, deterministic):
    """Run the tile choices (and single-stage pipeline) other GPUs get, on this GPU.

    The same instantiation can then need another shared-memory size than on this
    GPU (1 stage instead of 2), so the loaded-function cache, which sets the
    shared-memory limit once per function, is swapped for an empty one here.
    """
    from cupyflash import _compile, _gpu, _gpu_bwd

    host, dev = make_problem(rng, "float16", 1, 257, 300, 4, 2, head_dim)
    q, k, v, dout = dev
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _gpu.fwd(q, k, v, softmax_scale=scale, causal=True)
    monkeypatch.setattr(_launch, "compute_capability", lambda device_id: cc)
    monkeypatch.setattr(_compile, "_modules", {})
    grads = _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=True, deterministic=deterministic)
    check(host, grads, "float16", scale, True)


def _wgmma_cases():
    shapes = [(384, 384), (1000, 1500), (1500, 1000), (129, 257), (640, 8)]
    for i, (seqlens, head_dim, causal) in enumerate(itertools.product(shapes, (64, 128, 100), (False, True))):
        dtype = "bfloat16" if i % 2 else "float16"
        det = i % 3 == 0
        yield pytest.param(dtype, head_dim, causal, seqlens, det,
                           id=f"{dtype}-d{head_dim}-{'causal' if causal else 'full'}-{seqlens[0]}x{seqlens[1]}-"
                              f"{'det' if det else 'atomic'}")


@pytest.mark.parametrize("dtype,head_dim,causal,seqlens,deterministic", list(_wgmma_cases()))
def test_bwd_wgmma_kernel(rng, monkeypatch, launches, dtype, head_dim, causal, seqlens, deterministic):
    """Hopper's cp.async wgmma dK/dV kernel (the variants' and deterministic mode's; the
    warp-specialised one is switched off here, and tested in test_gpu_bwd_ws): several key
    and query blocks, tails, bottom-right causal, GQA."""
    from cupyflash import _gpu_bwd, dispatch

    cp = _cp()
    _skip_unless_hopper(cp)
    monkeypatch.setattr(dispatch, "BWD_WS", False)
    _gpu_bwd.clear_plans()
    try:
        host, dev = make_problem(rng, dtype, 1, *seqlens, 4, 2, head_dim)
        scale = 1.0 / math.sqrt(head_dim)
        grads = run(dev, dtype, scale, causal, deterministic)
        vec = head_dim % 8 == 0  # (head_dim 100: unaligned rows, the mma.sync kernels)
        assert ("flash_bwd_dkdv_sm90_kernel" in launches) == vec and "flash_bwd_ws_kernel" not in launches
        check(host, grads, dtype, scale, causal)
    finally:
        _gpu_bwd.clear_plans()


@pytest.mark.parametrize("dtype,causal,seqlens", [("float16", False, (384, 384)), ("bfloat16", True, (1000, 1500)),
                                                  ("float16", True, (129, 257))])
def test_bwd_wgmma_atomic_dq_at_head_dim_64(rng, monkeypatch, dtype, causal, seqlens):
    """The dK/dV kernel's atomic dQ at head_dim 64, which the default no longer takes
    on Hopper (the dQ kernel measured faster there) but `bench --bwd-dq mma` does."""
    from cupyflash import _gpu, dispatch

    cp = _cp()
    cc = _skip_unless_hopper(cp)
    monkeypatch.setattr(dispatch, "BWD_DQ_SM90", False)
    monkeypatch.setattr(dispatch, "BWD_WS", False)  # the cp.async kernel's atomics (not the ws kernel's)
    _gpu.clear_plans()  # plans are memoised: drop those made with the flags on
    try:
        plan = dispatch.select_bwd(batch=1, seqlen_q=seqlens[0], seqlen_k=seqlens[1], nheads_q=4, nheads_kv=2,
                                   head_dim=64, dtype=dtype, causal=causal, deterministic=False, vec=True, cc=cc)
        assert plan.launches[1].template == "cupyflash::flash_bwd_dkdv_sm90_kernel" and plan.dq_accum and plan.launches[2].template == "cupyflash::flash_bwd_convert_dq_kernel"
        host, dev = make_problem(rng, dtype, 1, *seqlens, 4, 2, 64)
        scale = 1.0 / math.sqrt(64)
        check(host, run(dev, dtype, scale, causal, False), dtype, scale, causal)
    finally:
        _gpu.clear_plans()


@pytest.mark.parametrize("dtype,head_dim,causal,seqlens", [
    ("float16", 64, False, (384, 384)), ("bfloat16", 64, True, (1000, 1500)),
    ("float16", 128, True, (1500, 1000)), ("bfloat16", 128, False, (129, 257)),
    ("float16", 100, True, (640, 8))])
def test_bwd_wgmma_dq_kernel_is_deterministic(rng, dtype, head_dim, causal, seqlens):
    """The deterministic dQ kernel on wgmma: against the reference, and bitwise
    equal over two runs."""
    from cupyflash import dispatch

    cp = _cp()
    cc = _skip_unless_hopper(cp)
    plan = dispatch.select_bwd(batch=1, seqlen_q=seqlens[0], seqlen_k=seqlens[1], nheads_q=4, nheads_kv=2,
                               head_dim=head_dim, dtype=dtype, causal=causal, deterministic=True,
                               vec=True, cc=cc)
    assert plan.launches[2].template == "cupyflash::flash_bwd_dq_sm90_kernel"
    host, dev = make_problem(rng, dtype, 1, *seqlens, 4, 2, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    grads = run(dev, dtype, scale, causal, True)
    again = run(dev, dtype, scale, causal, True)
    cp.testing.assert_array_equal(grads[0], again[0])
    check(host, grads, dtype, scale, causal)


def _skip_unless_hopper(cp):
    from cupyflash import _gpu

    cc = _launch.compute_capability(cp.cuda.Device().id)
    if cc != (9, 0):
        pytest.skip(f"the wgmma kernels run on compute capability 9.0; this GPU is {cc}")
    return cc


@pytest.mark.parametrize("num_sms,splits", [(3, 1), (6, 2), (100, 4)])
@pytest.mark.parametrize("deterministic", DETERMINISTIC, ids=["atomic", "det"])
def test_bwd_gqa_group_splits(rng, monkeypatch, launches, num_sms, splits, deterministic):
    """A GQA group's query heads split over 1, 2 or 4 dK/dV blocks (fp32 partials, summed in order)."""
    from cupyflash import _gpu, _gpu_bwd, dispatch

    host, dev = make_problem(rng, "float16", 1, 260, 300, 8, 2, 64)  # 3 key blocks x 2 KV heads
    q, k, v, dout = dev
    out, lse = _gpu.fwd(q, k, v, softmax_scale=0.125, causal=True)
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: num_sms)
    plan = dispatch.select_bwd(batch=1, seqlen_q=260, seqlen_k=300, nheads_q=8, nheads_kv=2, head_dim=64,
                               dtype="float16", causal=True, deterministic=deterministic, vec=True,
                               num_sms=num_sms, cc=_launch.compute_capability(q.device.id))
    assert plan.kv_splits == splits
    grads = _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=0.125, causal=True, deterministic=deterministic)
    check(host, grads, "float16", 0.125, True)
    assert ("flash_bwd_convert_dkv_kernel" in launches) == (splits > 1)  # the patched device fact took


def test_bwd_public_api_fp16(rng):
    cp = _cp()
    import cupyflash

    host, dev = make_problem(rng, "float16", 2, 200, 180, 8, 2, 128)
    q, k, v, dout = dev
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True)
    assert all(isinstance(g, cp.ndarray) and g.dtype == cp.float16 for g in grads)
    check(host, grads, "float16", 128 ** -0.5, True)


def test_bwd_many_heads_on_grid_x(rng):
    """batch * heads above 65535."""
    cp = _cp()
    from cupyflash import _gpu, _gpu_bwd

    q = cp.asarray(rng.standard_normal((70000, 16, 1, 32), dtype=np.float32).astype(np.float16))
    dout = cp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(np.float16))
    out, lse = _gpu.fwd(q, q, q, softmax_scale=32 ** -0.5, causal=False)
    dq, dk, dv = _gpu_bwd.bwd(dout, q, q, q, out, lse, softmax_scale=32 ** -0.5, causal=False)
    host = [x[-3:].get().astype(np.float32) for x in (q, q, q, dout)]
    check(host, (dq[-3:], dk[-3:], dv[-3:]), "float16", 32 ** -0.5, False)


@pytest.mark.parametrize("deterministic", DETERMINISTIC, ids=["atomic", "det"])
def test_bwd_int64_offsets(rng, deterministic):
    """q and dout with a batch stride above 2**31 elements: batch 1 sits past every 32-bit offset."""
    cp = _cp()
    from cupyflash import _gpu, _gpu_bwd

    n = 2**31 // (64 * 64) + 16
    big = cp.empty((2, n, 64, 64), dtype=cp.float16)
    q, dout = big[:, -64:, :2], big[:, -64:, 2:4]
    host_q = rng.standard_normal(q.shape, dtype=np.float32).astype(np.float16)
    host_do = rng.standard_normal(q.shape, dtype=np.float32).astype(np.float16)
    q[...] = cp.asarray(host_q)
    dout[...] = cp.asarray(host_do)
    host_k, k = to_device(rng.standard_normal((2, 100, 2, 64), dtype=np.float32), "float16")
    host_v, v = to_device(rng.standard_normal((2, 100, 2, 64), dtype=np.float32), "float16")
    out, lse = _gpu.fwd(q, k, v, softmax_scale=0.125, causal=False)
    grads = _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=0.125, causal=False, deterministic=deterministic)
    check([host_q.astype(np.float32), host_k, host_v, host_do.astype(np.float32)], grads, "float16", 0.125, False)
    del big
