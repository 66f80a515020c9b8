"""The backward's preprocess kernel on the GPU, its outputs checked directly against NumPy.

``flash_bwd_preprocess_kernel`` writes three row buffers: delta = rowsum(dO∘O) in
fp32, lse_log2 = lse·log2(e), raised by 2^-20 of itself (+inf where lse = -inf) and, when dq_accum is set,
dq_accum = 0 over whole padded rows. Each test runs the real ``_gpu_bwd`` entry
point with every launch but the preprocess dropped, and points the preprocess's
row buffers at guarded copies: sentinel-filled, with guard zones on both sides
that must come back untouched. The other backward tests see these buffers only
through the gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash import dispatch
from cupyflash.testing import from_bf16_bits, to_bf16_bits

pytestmark = pytest.mark.gpu

GUARD = 256          # fp32 words either side of each buffer
SENTINEL = 0x7FC0DEAD  # a NaN no kernel computes
LOG2E = np.float32(1.4426950408889634)


def _cp():
    return pytest.importorskip("cupy")


def _device(x32, dtype):
    """(host float32 values exactly representable in dtype, device storage array)."""
    cp = _cp()
    if dtype == "float16":
        x = x32.astype(np.float16)
        return x.astype(np.float32), cp.asarray(x)
    bits = to_bf16_bits(x32)
    return from_bf16_bits(bits), cp.asarray(bits)


def _lse(rng, shape):
    """Random lse values with about one row in eight at -inf (rows that see no key)."""
    lse = (rng.standard_normal(shape) * 4).astype(np.float32)
    lse[rng.random(shape) < 0.125] = -np.inf
    lse.flat[0] = -np.inf
    return lse


class _Guarded:
    """A device fp32 buffer of n words between two guard zones, all SENTINEL."""

    def __init__(self, n):
        cp = _cp()
        self.n = n
        self.words = cp.full(n + 2 * GUARD, SENTINEL, dtype=cp.uint32)
        self.ptr = self.words.data.ptr + GUARD * 4

    def body(self):
        return self.words[GUARD:GUARD + self.n].get().view(np.float32)

    def assert_guards_untouched(self, name):
        w = self.words.get()
        assert (w[:GUARD] == SENTINEL).all() and (w[GUARD + self.n:] == SENTINEL).all(), \
            f"{name}: the preprocess wrote outside its rows"


def _run_preprocess(monkeypatch, rows, head_dim, zero_dq, call):
    """Run ``call`` (a _gpu_bwd entry point) with the preprocess alone, on guarded buffers.

    Returns (delta, lse_log2, dq_accum or None) as host arrays, and the launch.
    """
    cp = _cp()
    from cupyflash import _gpu_bwd, _launch

    hdp = dispatch.padded_head_dim(head_dim)
    delta, lse_log2 = _Guarded(rows), _Guarded(rows)
    dq_accum = _Guarded(rows * hdp) if zero_dq else None
    seen, used = [], []
    names = _gpu_bwd.BWD_POINTERS

    class PreprocessOnly(_launch.Launcher):
        """The plan's launcher with every launch but the preprocess dropped, and the
        preprocess's row buffers pointed at the guarded copies."""

        __slots__ = ()

        def __init__(self, launches, template, writer, variant=None, maps=None):
            pre = [l for l in launches if l.template.endswith("::flash_bwd_preprocess_kernel")]
            seen.extend(pre)
            super().__init__(pre, template, writer, variant, maps)

        def __call__(self, stream, *pointers, var=None):
            p = list(pointers)
            p[names.index("delta")], p[names.index("lse_log2")] = delta.ptr, lse_log2.ptr
            planned = bool(p[names.index("dq_accum")])  # deterministic mode, and Hopper at D=64, have none
            assert planned or not zero_dq or head_dim <= 64
            used.append(planned and dq_accum is not None)
            p[names.index("dq_accum")] = dq_accum.ptr if used[-1] else 0
            super().__call__(stream, *p, var=var)

    monkeypatch.setattr(_launch, "Launcher", PreprocessOnly)
    monkeypatch.setattr(_gpu_bwd, "PLANS", _launch.PlanCache())  # plans made here stay here
    call()
    cp.cuda.get_current_stream().synchronize()
    assert len(seen) == 1, seen
    for name, buf in (("delta", delta), ("lse_log2", lse_log2), ("dq_accum", dq_accum)):
        if buf is not None:
            buf.assert_guards_untouched(name)
    acc = dq_accum.body().reshape(rows, hdp) if used[0] else None
    return delta.body(), lse_log2.body(), acc, seen[0]


def _check(delta, lse_log2, dq_accum, out, dout, lse):
    """out, dout: host (rows, head_dim) float32 in row-buffer order; lse: (rows,)."""
    prod = out.astype(np.float64) * dout.astype(np.float64)
    want = prod.sum(axis=1)
    tol = 3e-5 * np.abs(prod).sum(axis=1) + 1e-6  # fp32 accumulation of head_dim products
    err = np.abs(delta.astype(np.float64) - want)
    assert (err <= tol).all(), f"delta: worst row {int(np.argmax(err - tol))}, max err {err.max():.3g}"
    # one fp32 multiply, then raised by |that|·2^-20 in one FMA (kernels_cu/flash_bwd.cu: at least
    # 8 ulp, so the wgmma backwards' unrounded P never exceeds 1): float64 holds the sum exactly
    l2 = np.where(lse == -np.inf, 0.0, (lse * LOG2E).astype(np.float32).astype(np.float64))
    want_l2 = np.where(lse == -np.inf, np.inf, l2 + np.abs(l2) * 2.0 ** -20).astype(np.float32)
    np.testing.assert_array_equal(lse_log2, want_l2)
    nz = np.isfinite(lse) & (l2 != 0)
    ulp = np.spacing(np.abs(l2[nz]).astype(np.float32)).astype(np.float64)
    assert (lse_log2[nz] - l2[nz] >= 8 * ulp).all()
    assert np.isposinf(lse_log2[lse == -np.inf]).all()
    if dq_accum is not None:
        assert (dq_accum.view(np.uint32) == 0).all(), "dq_accum: not all +0.0"


def _dense_rows(x):
    """(batch, seqlen, nheads, d) -> (batch * nheads * seqlen, d), the row buffers' order."""
    return x.transpose(0, 2, 1, 3).reshape(-1, x.shape[-1])


# (batch, seqlen, nheads, head_dim, dtype): the seed shape; rows per head below, at and
# above the rows per block (blocks spanning heads and batch entries); every padded head_dim;
# head_dim % 8 != 0 (element loads) and head_dim < padded (idle lanes)
_DENSE = [
    (1, 512, 32, 128, "float16"),
    (2, 17, 3, 64, "bfloat16"),
    (3, 1, 7, 32, "float16"),
    (2, 203, 2, 96, "float16"),
    (1, 113, 4, 192, "bfloat16"),
    (2, 100, 3, 256, "float16"),
    (2, 33, 5, 40, "bfloat16"),
    (2, 70, 3, 59, "float16"),
    (1, 129, 2, 100, "bfloat16"),
    (1, 31, 9, 1, "float16"),
]


@pytest.mark.parametrize("zero_dq", [True, False], ids=["dq_accum", "no_dq_accum"])
@pytest.mark.parametrize("batch,seqlen,nheads,head_dim,dtype", _DENSE,
                         ids=[f"{c[4]}-b{c[0]}-s{c[1]}-h{c[2]}-d{c[3]}" for c in _DENSE])
def test_preprocess_dense_matches_numpy(rng, monkeypatch, batch, seqlen, nheads, head_dim, dtype, zero_dq):
    cp = _cp()
    from cupyflash import _gpu_bwd

    shape = (batch, seqlen, nheads, head_dim)
    host_o, out = _device(rng.standard_normal(shape, dtype=np.float32), dtype)
    host_do, dout = _device(rng.standard_normal(shape, dtype=np.float32), dtype)
    lse = _lse(rng, (batch, nheads, seqlen))
    q = cp.zeros_like(out)
    k = cp.zeros((batch, 1, 1, head_dim), dtype=out.dtype)
    rows = batch * nheads * seqlen

    def call():
        _gpu_bwd.bwd(dout, q, k, k, out, cp.asarray(lse), softmax_scale=0.5, causal=True,
                     deterministic=not zero_dq, dtype=dtype)

    delta, lse_log2, dq_accum, spec = _run_preprocess(monkeypatch, rows, head_dim, zero_dq, call)
    assert spec.args[-1] == ("true" if head_dim % 8 == 0 else "false")
    _check(delta, lse_log2, dq_accum, _dense_rows(host_o), _dense_rows(host_do), lse.reshape(-1))


def test_preprocess_seed_shape_launch(rng, monkeypatch):
    """B=1, H=32, S=512, D=128: 256 blocks of 64 rows, 16 lanes per row (PERF.md, session 4)."""
    cp = _cp()
    from cupyflash import _gpu_bwd

    shape = (1, 512, 32, 128)
    host_o, out = _device(rng.standard_normal(shape, dtype=np.float32), "float16")
    host_do, dout = _device(rng.standard_normal(shape, dtype=np.float32), "float16")
    lse = _lse(rng, (1, 32, 512))
    k = cp.zeros((1, 512, 32, 128), dtype=out.dtype)

    def call():
        _gpu_bwd.bwd(dout, cp.zeros_like(out), k, k, out, cp.asarray(lse), softmax_scale=128 ** -0.5,
                     causal=True, deterministic=False)

    delta, lse_log2, dq_accum, spec = _run_preprocess(monkeypatch, 32 * 512, 128, True, call)
    assert spec.name_expression == "cupyflash::flash_bwd_preprocess_kernel<__half, 16, 4, true>"
    assert spec.grid == (256, 1, 1)
    _check(delta, lse_log2, dq_accum, _dense_rows(host_o), _dense_rows(host_do), lse.reshape(-1))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_preprocess_strided_and_unaligned_views(rng, monkeypatch, head_dim):
    """out a view one element into wider rows (no 16-byte loads), dout a strided slice,
    lse a slice of a longer (batch, nheads, seqlen + 5) buffer."""
    cp = _cp()
    from cupyflash import _gpu_bwd

    batch, seqlen, nheads = 2, 77, 3
    host_big, big = _device(rng.standard_normal((batch, seqlen, nheads, head_dim + 1), dtype=np.float32), "float16")
    out, host_o = big[..., 1:], host_big[..., 1:]
    host_do_big, do_big = _device(rng.standard_normal((batch, seqlen, nheads, 2 * head_dim), dtype=np.float32),
                                  "float16")
    dout, host_do = do_big[..., :head_dim], host_do_big[..., :head_dim]
    lse_big = _lse(rng, (batch, nheads, seqlen + 5))
    lse = lse_big[..., :seqlen]
    q = cp.zeros((batch, seqlen, nheads, head_dim), dtype=out.dtype)
    k = cp.zeros((batch, 1, 1, head_dim), dtype=out.dtype)

    def call():
        _gpu_bwd.bwd(dout, q, k, k, out, cp.asarray(lse_big)[..., :seqlen], softmax_scale=0.5, causal=False)

    delta, lse_log2, dq_accum, spec = _run_preprocess(monkeypatch, batch * nheads * seqlen, head_dim, True, call)
    assert spec.args[-1] == "false"
    _check(delta, lse_log2, dq_accum, _dense_rows(host_o), _dense_rows(host_do), np.ascontiguousarray(lse).reshape(-1))


def test_preprocess_many_heads_of_one_row(rng, monkeypatch):
    """seqlen 1, batch * heads = 80000: every block spans 32 (batch, head) pairs."""
    cp = _cp()
    from cupyflash import _gpu_bwd

    shape = (5000, 1, 16, 128)
    host_o, out = _device(rng.standard_normal(shape, dtype=np.float32), "bfloat16")
    host_do, dout = _device(rng.standard_normal(shape, dtype=np.float32), "bfloat16")
    lse = _lse(rng, (5000, 16, 1))
    k = cp.zeros((5000, 1, 16, 128), dtype=out.dtype)

    def call():
        _gpu_bwd.bwd(dout, cp.zeros_like(out), k, k, out, cp.asarray(lse), softmax_scale=0.1, causal=False,
                     dtype="bfloat16")

    delta, lse_log2, dq_accum, _ = _run_preprocess(monkeypatch, 80000, 128, True, call)
    _check(delta, lse_log2, dq_accum, _dense_rows(host_o), _dense_rows(host_do), lse.reshape(-1))


@pytest.mark.parametrize("head_dim,dtype", [(128, "float16"), (64, "bfloat16"), (59, "float16"), (256, "bfloat16")])
def test_preprocess_varlen_matches_numpy(rng, monkeypatch, head_dim, dtype):
    """A packed batch (with an empty sequence): the row buffers are (nheads, total_q),
    walked as one run of total_q rows per head."""
    cp = _cp()
    from cupyflash import _gpu_bwd

    lens = [37, 0, 130, 1, 64]
    total, nheads = sum(lens), 3
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    shape = (total, nheads, head_dim)
    host_o, out = _device(rng.standard_normal(shape, dtype=np.float32), dtype)
    host_do, dout = _device(rng.standard_normal(shape, dtype=np.float32), dtype)
    lse = _lse(rng, (nheads, total))
    k = cp.zeros((4, 1, head_dim), dtype=out.dtype)
    cu_k = cp.asarray(np.array([0, 1, 1, 2, 3, 4], dtype=np.int32))

    def call():
        _gpu_bwd.varlen_bwd(dout, cp.zeros_like(out), k, k, out, cp.asarray(lse), cu, cu_k, max(lens), 1,
                            softmax_scale=0.3, causal=True, dtype=dtype)

    delta, lse_log2, dq_accum, _ = _run_preprocess(monkeypatch, nheads * total, head_dim, True, call)
    rows_o = host_o.transpose(1, 0, 2).reshape(-1, head_dim)  # (nheads, total) order
    rows_do = host_do.transpose(1, 0, 2).reshape(-1, head_dim)
    _check(delta, lse_log2, dq_accum, rows_o, rows_do, lse.reshape(-1))
