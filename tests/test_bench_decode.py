"""``bench --suite decode`` without a GPU: K/V bytes and bandwidth, the bars, the output check,
skipping by memory, failures as results, the cuDNN GQA fallback, the paged copy, the tables.

The suite runs end to end on ``FakeCupy`` (numpy posing as cupy: the public API runs its CPU
path on the arrays) and, for the SDPA columns, on a fake torch whose tensors are numpy arrays
and whose ``scaled_dot_product_attention`` computes attention in float32; its cuDNN backend
refuses ``enable_gqa`` as some cuDNN versions do.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
import types

import numpy as np
import pytest
from test_bench_suites import FakeCupy

import cupyflash
from cupyflash import _bench_suites as suites
from cupyflash import bench, cli


class DecodeCupy(FakeCupy):
    """FakeCupy with ``random.permutation`` (the paged cache's block table) and ``from_dlpack``."""

    def __init__(self, elapsed_ms=0.5):
        super().__init__(elapsed_ms)
        rng = np.random.default_rng(0)
        self.random.permutation = lambda n: rng.permutation(n)
        self.allocated = []

    def empty(self, shape, dtype):
        self.allocated.append(tuple(shape))
        return np.empty(shape, dtype)

    def from_dlpack(self, x):
        return np.asarray(x.array)


# ----------------------------------------------------------------------------
# A fake torch: tensors are numpy arrays; SDPA computes attention in float32
# ----------------------------------------------------------------------------


class FakeTensor:
    def __init__(self, array):
        self.array = array

    shape = property(lambda self: self.array.shape)

    def transpose(self, a, b):
        return FakeTensor(np.swapaxes(self.array, a, b))

    def view(self, dtype):
        return FakeTensor(self.array.view(dtype))

    def repeat_interleave(self, repeats, dim):
        return FakeTensor(np.repeat(self.array, repeats, axis=dim))

    def numel(self):
        return self.array.size

    def element_size(self):
        return self.array.itemsize

    def float(self):
        return FakeTensor(self.array.astype(np.float32))

    def contiguous(self):
        return FakeTensor(np.ascontiguousarray(self.array))


class _TorchEvent:
    def __init__(self, enable_timing):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return FakeTorch.elapsed_ms[FakeTorch.backend]


class FakeTorch(types.SimpleNamespace):
    """torch's calls that the decode suite makes; ``calls`` logs (backend, k heads, enable_gqa)."""

    backend = None
    elapsed_ms = {"FLASH_ATTENTION": 1.0, "CUDNN_ATTENTION": 0.4}

    def __init__(self, cudnn_gqa=False, fail=None):
        super().__init__()
        self.calls, self.empty_caches, self.cudnn_gqa, self.fail = [], 0, cudnn_gqa, fail
        self.bfloat16 = "bfloat16"
        self.from_dlpack = FakeTensor
        self.cuda = types.SimpleNamespace(synchronize=lambda: None, empty_cache=self._empty_cache,
                                          Event=_TorchEvent)
        self.nn = types.SimpleNamespace(functional=types.SimpleNamespace(scaled_dot_product_attention=self._sdpa))

    def _empty_cache(self):
        self.empty_caches += 1

    def _sdpa(self, q, k, v, enable_gqa=False):
        backend = FakeTorch.backend
        self.calls.append((backend, k.shape[1], enable_gqa))
        if backend == self.fail:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if backend == "CUDNN_ATTENTION" and enable_gqa and not self.cudnn_gqa:
            raise RuntimeError("No available kernel. Aborting execution.")
        q, k, v = (x.array.astype(np.float32) for x in (q, k, v))
        group = q.shape[1] // k.shape[1]
        if group > 1 and not enable_gqa:
            raise RuntimeError("query and key must have the same number of heads")
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return FakeTensor(((p / p.sum(axis=-1, keepdims=True)) @ v).astype(np.float16))


def torch_env(**kwargs):
    torch = FakeTorch(**kwargs)
    backends = types.SimpleNamespace(FLASH_ATTENTION="FLASH_ATTENTION", CUDNN_ATTENTION="CUDNN_ATTENTION")

    @contextlib.contextmanager
    def sdpa_kernel(backend):
        FakeTorch.backend = backend
        try:
            yield
        finally:
            FakeTorch.backend = None

    return torch, backends, sdpa_kernel


def _args(**kwargs):
    defaults = dict(no_torch=False, copy_tbps=None, max_kv_gb=None, part=None, batch=[2], seqlen=[64],
                    heads=[(4, 2)], head_dim=[16], dtype=["float16"], reps=2)
    return types.SimpleNamespace(**{**defaults, **kwargs})


def _report():
    return {"suite": "decode", "notes": [], "results": []}


@pytest.fixture
def small(monkeypatch):
    """Paged and prefill parts at small shapes; a 16 KiB L2, so some points rotate input sets."""
    monkeypatch.setattr(bench, "L2_BYTES", 2**14)
    monkeypatch.setattr(suites, "PAGED_SHAPES", ((2, 64),))
    monkeypatch.setattr(suites, "PAGE_SIZES", (16, 32))
    monkeypatch.setattr(suites, "PAGED_CONFIG", {"nheads_q": 4, "nheads_kv": 2, "head_dim": 16,
                                                 "dtype": "float16"})
    monkeypatch.setattr(suites, "PREFILL_SEQLENS_Q", (8, 16))
    monkeypatch.setattr(suites, "PREFILL_CONFIG", {"batch": 1, "seqlen_k": 64, "nheads_q": 4, "nheads_kv": 2,
                                                   "head_dim": 16, "dtype": "float16", "causal": True})


# ----------------------------------------------------------------------------
# Bytes, bandwidth, bars
# ----------------------------------------------------------------------------


def test_kv_bytes_and_bandwidth():
    assert suites.kv_bytes(8, 32768, 8, 128) == 2 * 8 * 32768 * 8 * 128 * 2 == 1073741824
    assert suites.kv_bytes(1, 1024, 32, 64, itemsize=4) == 2 * 1024 * 32 * 64 * 4
    assert suites.tbps(4.24e9, 1.0) == pytest.approx(4.24)  # 4.24 GB in 1 ms
    assert suites.tbps(1e12, 1000.0) == pytest.approx(1.0)
    for ms in ("error", "OOM", None, 0.0):
        assert suites.tbps(1e9, ms) is None


def _grid_res(kv_bytes, ours_ms, fa2_ms=None, cudnn_ms=None, check="PASS"):
    res = {"part": "grid", "kv_bytes": kv_bytes, "ours_ms": ours_ms, "check": check}
    if fa2_ms is not None:
        res["fa2_ms"] = fa2_ms
    if cudnn_ms is not None:
        res["cudnn_ms"] = cudnn_ms
    return res


def test_judge_decode_computes_bandwidth_fraction_and_ratios():
    res = _grid_res(2 * 2**30, 0.6, fa2_ms=1.2, cudnn_ms=0.9)
    suites.judge_decode(res, copy_tbps=4.24)
    assert res["ours_tbps"] == pytest.approx(2 * 2**30 / 0.6e-3 / 1e12)
    assert res["ours_frac_copy"] == pytest.approx(res["ours_tbps"] / 4.24)
    assert res["fa2_tbps"] == pytest.approx(2 * 2**30 / 1.2e-3 / 1e12)
    assert (res["ratio_vs_fa2"], res["ratio_vs_cudnn"]) == (pytest.approx(2.0), pytest.approx(1.5))
    assert (res["bar_bw"], res["bar_fa2"], res["bar_cudnn"], res["status"]) == ("PASS", "PASS", "PASS", "PASS")
    slow = _grid_res(2 * 2**30, 0.6, fa2_ms=1.2, cudnn_ms=0.9)
    suites.judge_decode(slow, copy_tbps=8.0)  # a faster copy: the same time is below 80% of it
    assert slow["ours_frac_copy"] < 0.8 and slow["bar_bw"] == "FAIL" and slow["status"] == "FAIL"


MIB = 2**20


def _bw_ms(kv_bytes, frac, copy_tbps=4.24):
    """ours' ms at ``frac`` of the copy bandwidth."""
    return kv_bytes / (frac * copy_tbps * 1e9)


@pytest.mark.parametrize("kv_bytes,ours_ms,fa2,cudnn,check,bars,status", [
    (256 * MIB, _bw_ms(256 * MIB, 0.8001), None, None, "PASS", ("PASS", "n/a", "n/a"), "n/a"),  # 80%, at 256 MiB
    (256 * MIB, _bw_ms(256 * MIB, 0.79), None, None, "PASS", ("FAIL", "n/a", "n/a"), "FAIL"),   # 79% of copy
    (256 * MIB - 1, 1.0, 1.5, 1.0, "PASS", ("-", "PASS", "PASS"), "PASS"),  # below 256 MiB: no bandwidth bar
    (MIB, 1.0, 1.49, 1.2, "PASS", ("-", "FAIL", "PASS"), "FAIL"),           # not 1.5x FA2
    (MIB, 1.0, 2.0, 0.99, "PASS", ("-", "PASS", "FAIL"), "FAIL"),           # slower than cuDNN
    (MIB, 1.0, 2.0, "error", "PASS", ("-", "PASS", "n/a"), "n/a"),          # cuDNN not measured
    (MIB, 1.0, 2.0, "skipped", "PASS", ("-", "PASS", "n/a"), "n/a"),
    (MIB, 1.0, 2.0, 1.5, "FAIL", ("-", "PASS", "PASS"), "FAIL"),            # a wrong output fails the point
    (MIB, 1.0, 2.0, 1.5, "n/a", ("-", "PASS", "PASS"), "n/a"),              # nothing to check against
    (MIB, "error", 2.0, 1.5, "n/a", ("-", "n/a", "n/a"), "error"),          # ours failed: its marker
    (2**30, "OOM", None, None, "n/a", ("n/a", "n/a", "n/a"), "OOM"),
])
def test_decode_bars(kv_bytes, ours_ms, fa2, cudnn, check, bars, status):
    """fa2 and cudnn: their time as a multiple of ours' (1.0 ms), or a marker."""
    res = _grid_res(kv_bytes, ours_ms, fa2, cudnn, check)
    suites.judge_decode(res, copy_tbps=4.24)
    assert (res["bar_bw"], res["bar_fa2"], res["bar_cudnn"]) == bars
    assert res["status"] == status


def test_the_bars_are_issue_12s():
    assert (suites.BW_BAR, suites.BW_MIN_BYTES, suites.FA2_BAR, suites.CUDNN_BAR) == (0.8, 256 * MIB, 1.5, 1.0)
    assert (suites.PAGED_BAR, suites.PREFILL_BAR, suites.DEFAULT_COPY_TBPS) == (1.1, 1.0, 4.24)
    assert suites.PAGE_SIZES == (16, 64, 256)
    assert suites.PAGED_SHAPES == ((8, 32768), (1, 131072))
    assert suites.PREFILL_SEQLENS_Q == (64, 256, 512) and suites.PREFILL_CONFIG["seqlen_k"] == 32768


@pytest.mark.parametrize("paged,contiguous,check,bar,status", [
    (1.1, 1.0, "PASS", "PASS", "PASS"),     # exactly 10% slower
    (1.1001, 1.0, "PASS", "FAIL", "FAIL"),
    (0.9, 1.0, "FAIL", "PASS", "FAIL"),
    (1.0, "error", "n/a", "n/a", "n/a"),
    ("OOM", 1.0, "n/a", "n/a", "OOM"),
])
def test_paged_bar(paged, contiguous, check, bar, status):
    res = {"paged_ms": paged, "contiguous_ms": contiguous, "check": check}
    suites.judge_against(res, "paged", "contiguous", suites.PAGED_BAR)
    assert (res["bar_time"], res["status"]) == (bar, status)
    if bar != "n/a":
        assert res["ratio_paged_vs_contiguous"] == pytest.approx(paged / contiguous)


def test_prefill_bar_is_at_least_as_fast_as_dense():
    for kvcache, status in ((1.0, "PASS"), (0.8, "PASS"), (1.01, "FAIL")):
        res = {"kvcache_ms": kvcache, "dense_ms": 1.0, "check": "PASS"}
        suites.judge_against(res, "kvcache", "dense", suites.PREFILL_BAR)
        assert res["status"] == status


# ----------------------------------------------------------------------------
# The output check
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("has_nan,max_abs,status", [
    (False, 0.0, "PASS"), (False, 1e-2, "PASS"), (False, 1.01e-2, "FAIL"), (False, math.nan, "FAIL"),
    (True, 0.0, "FAIL"), (True, None, "FAIL"), (False, None, "n/a")])
def test_check_status(has_nan, max_abs, status):
    assert suites.check_status(has_nan, max_abs, 1e-2) == status


def test_record_check_prefers_fa2_then_cudnn_and_sees_a_nan():
    ours = np.zeros((1, 1, 2, 4), np.float32)
    off = ours + 0.5
    res = {}
    suites.record_check(res, np, ours, [("fa2", off), ("cudnn", ours)], 1e-2)
    assert (res["check_against"], res["check_max_abs"], res["check"]) == ("fa2", 0.5, "FAIL")
    res = {}
    suites.record_check(res, np, ours, [("fa2", None), ("cudnn", ours)], 1e-2)
    assert (res["check_against"], res["check_max_abs"], res["check"], res["ours_nan"]) == ("cudnn", 0.0, "PASS",
                                                                                           False)
    nan = ours.copy()
    nan[0, 0, 1, 2] = np.nan
    res = {}
    suites.record_check(res, np, nan, [("fa2", None), ("cudnn", None)], 1e-2, name="paged")
    assert res["paged_nan"] and res["check_against"] is None and res["check"] == "FAIL"
    res = {}
    suites.record_check(res, np, nan, [("fa2", ours)], 1e-2)
    assert math.isnan(res["check_max_abs"]) and res["check"] == "FAIL"
    res = {}
    suites.record_check(res, np, None, [("fa2", ours)], 1e-2)
    assert res["check"] == "n/a"
    res = {}
    suites.record_check(res, np, ours, [("fa2", np.zeros((1, 1, 4, 2), np.float32))], 1e-2)
    assert res["check"] == "FAIL" and res["check_error"].startswith("ValueError: outputs of shapes")


def test_bfloat16_outputs_are_compared_as_float32():
    cupy = DecodeCupy()
    x = np.array([1.0, -2.5, 3.140625], np.float32)
    assert np.array_equal(suites._as_float32(cupy, bench._bf16_bits(cupy, x), "bfloat16"), x)
    assert np.array_equal(suites._as_float32(cupy, x.astype(np.float16), "float16"), x.astype(np.float16))


# ----------------------------------------------------------------------------
# Inputs: the fill, the paged copy, the grid, skipping by memory
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fill_normal_fills_every_element_a_chunk_at_a_time(dtype):
    cupy = DecodeCupy()
    storage = np.full((3, 50, 2, 4), 0xFFFF, np.uint16)  # NaN bits in both types
    suites.fill_normal(cupy, storage, dtype, chunk=64)  # 1200 elements, 19 chunks, the last partial
    values = suites._as_float32(cupy, suites._typed(cupy, storage, dtype), dtype)
    assert np.isfinite(values).all()
    assert abs(values.mean()) < 0.2 and 0.8 < values.std() < 1.2


def test_paged_copy_shuffles_the_blocks_and_keeps_each_sequence_in_order():
    cupy = DecodeCupy()
    rng = np.random.default_rng(1)
    k, v = (rng.integers(0, 1000, (2, 64, 2, 4)).astype(np.uint16) for _ in range(2))
    k_pages, v_pages, table = suites.paged_copy(cupy, k, v, 16)
    assert k_pages.shape == (8, 16, 2, 4) and table.shape == (2, 4) and table.dtype == np.int32
    assert sorted(table.reshape(-1)) == list(range(8))  # every block of the pool, once
    assert not np.array_equal(table.reshape(-1), np.arange(8))  # shuffled (seeded)
    for b in range(2):
        for p in range(4):
            assert np.array_equal(k_pages[table[b, p]], k[b, 16 * p:16 * (p + 1)])
            assert np.array_equal(v_pages[table[b, p]], v[b, 16 * p:16 * (p + 1)])
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        suites.paged_copy(cupy, k[:, :40], v[:, :40], 16)


def test_the_default_grid_skips_what_exceeds_40_gb():
    shapes = suites.decode_shapes(suites.DECODE_BATCHES, suites.DECODE_SEQLENS, suites.DECODE_HEADS,
                                  suites.DECODE_HEAD_DIMS)
    assert len(shapes) == 3 * 4 * 2 * 2
    skipped = [s for s in shapes if suites.kv_skip_reason(suites.kv_bytes(s[0], s[1], s[3], s[4]), 40e9)]
    assert skipped == [(64, 131072, 32, 32, 64), (64, 131072, 32, 32, 128)]  # 68.7 and 137.4 GB
    assert suites.kv_skip_reason(68719476736, 40e9) == "K/V 68.7 GB > 40 GB (--max-kv-gb)"
    assert suites.kv_skip_reason(int(40e9), 40e9) is None


def test_points_past_the_memory_limit_are_skipped_without_allocating(small):
    cupy, report = DecodeCupy(), _report()
    suites.run_decode(cupy, _args(seqlen=[64, 128], dtype=["float16", "bfloat16"], max_kv_gb=20000 / 1e9,
                                  no_torch=True, part=["grid"]), report, lambda: None)
    rows = report["results"]
    assert [(r["seqlen_k"], r["dtype"], r["status"]) for r in rows] == [
        (64, "float16", "n/a"), (64, "bfloat16", "error"),  # 16 KiB: measured (no torch: nothing to judge)
        (128, "float16", "skipped"), (128, "bfloat16", "skipped")]  # 32 KiB > 20 kB
    assert rows[2]["skipped"] == "K/V 0.0 GB > 2e-05 GB (--max-kv-gb)"
    assert "ours_ms" not in rows[2]
    assert (2, 128, 2, 16) not in cupy.allocated
    assert report["bars"] == {"n/a": 1, "error": 1, "skipped": 2}


def test_the_caches_are_allocated_once_per_shape_for_both_dtypes(small):
    cupy, report = DecodeCupy(), _report()
    suites.run_decode(cupy, _args(dtype=["float16", "bfloat16"], no_torch=True, part=["grid"]), report,
                      lambda: None)
    assert [r["dtype"] for r in report["results"]] == ["float16", "bfloat16"]
    assert cupy.allocated.count((2, 64, 2, 16)) == 2  # k_cache and v_cache of the one input set
    fp16, bf16 = report["results"]
    assert fp16["ours_ms"] == 0.5 and fp16["ours_nan"] is False
    # numpy takes no bfloat16 bits in uint16 storage (cupy arrays do): an error, recorded
    assert bf16["ours_ms"] == "error" and bf16["ours_error"].startswith(
        "TypeError: cupyflash.flash_attn_with_kvcache: dtype must be None or q's own dtype (uint16)")


# ----------------------------------------------------------------------------
# Against SDPA (fake torch): the check, the cuDNN GQA fallback, failures
# ----------------------------------------------------------------------------


def _grid_point(monkeypatch, env, *, heads=(4, 2), max_kv_gb=None):
    monkeypatch.setattr(bench, "torch_env", lambda: (env, None))
    cupy, report = DecodeCupy(elapsed_ms=0.5), _report()
    suites.run_decode(cupy, _args(heads=[heads], part=["grid"], max_kv_gb=max_kv_gb), report, lambda: None)
    return report


def test_against_sdpa_with_the_cudnn_gqa_fallback(small, monkeypatch):
    env = torch_env()
    report = _grid_point(monkeypatch, env)
    (r,) = report["results"]
    assert report["impls"] == ["ours", "fa2", "cudnn"]
    assert (r["ours_ms"], r["fa2_ms"], r["cudnn_ms"]) == (0.5, 1.0, 0.4)
    assert (r["ratio_vs_fa2"], r["ratio_vs_cudnn"]) == (pytest.approx(2.0), pytest.approx(0.8))
    assert (r["bar_fa2"], r["bar_cudnn"], r["status"]) == ("PASS", "FAIL", "FAIL")
    # ours' CPU path against the fake FA2 (float32 attention): a small error
    assert r["check_against"] == "fa2" and r["check"] == "PASS" and 0 < r["check_max_abs"] < 2e-3
    assert r["cudnn_kv"] == "expanded"
    assert r["cudnn_gqa_refusal"] == "RuntimeError: No available kernel. Aborting execution."
    calls = env[0].calls
    assert calls[0] == ("FLASH_ATTENTION", 2, True)  # FA2: enable_gqa on the 2 KV heads
    assert calls[calls.index(("CUDNN_ATTENTION", 2, True)) + 1] == ("CUDNN_ATTENTION", 4, False)  # expanded
    assert {c for c in calls if c[0] == "CUDNN_ATTENTION"} == {("CUDNN_ATTENTION", 2, True),
                                                               ("CUDNN_ATTENTION", 4, False)}
    assert env[0].empty_caches >= 2  # after each backend


def test_cudnn_with_gqa_is_not_expanded(small, monkeypatch):
    env = torch_env(cudnn_gqa=True)
    (r,) = _grid_point(monkeypatch, env)["results"]
    assert "cudnn_kv" not in r and r["cudnn_ms"] == 0.4
    assert {c for c in env[0].calls if c[0] == "CUDNN_ATTENTION"} == {("CUDNN_ATTENTION", 2, True)}


def test_equal_heads_pass_no_enable_gqa(small, monkeypatch):
    env = torch_env()
    (r,) = _grid_point(monkeypatch, env, heads=(4, 4))["results"]
    assert "cudnn_kv" not in r and r["check"] == "PASS"
    assert {c[1:] for c in env[0].calls} == {(4, False)}


def test_an_expansion_past_the_memory_limit_is_skipped(small, monkeypatch):
    env = torch_env()
    # K/V of the set: 16 KiB; expanded to 4 heads: 32 KiB > 20 kB
    (r,) = _grid_point(monkeypatch, env, max_kv_gb=20000 / 1e9)["results"]
    assert r["cudnn_ms"] == "skipped" and r["cudnn_skipped"].startswith("refuses GQA; K/V expanded to nheads_q")
    assert r["fa2_ms"] == 1.0 and r["bar_cudnn"] == "n/a" and r["status"] == "n/a"


def test_a_backend_error_is_recorded_and_the_suite_carries_on(small, monkeypatch):
    env = torch_env(fail="FLASH_ATTENTION")
    monkeypatch.setattr(bench, "torch_env", lambda: (env, None))
    cupy, report = DecodeCupy(), _report()
    suites.run_decode(cupy, _args(seqlen=[64, 128], part=["grid"]), report, lambda: None)
    assert len(report["results"]) == 2
    for r in report["results"]:
        assert r["fa2_ms"] == "OOM" and r["fa2_error"].startswith("RuntimeError: CUDA out of memory")
        assert r["cudnn_ms"] == 0.4 and r["check_against"] == "cudnn" and r["check"] == "PASS"
        assert r["bar_fa2"] == "n/a" and r["status"] == "FAIL"  # ours 0.5 ms against cuDNN's 0.4


@pytest.mark.parametrize("exc,marker", [
    (NotImplementedError("cupyflash.flash_attn_with_kvcache: the GPU decode kernel is not built yet"), "error"),
    (type("OutOfMemoryError", (RuntimeError,), {})("Out of memory allocating 4 GiB"), "OOM"),
])
def test_our_failure_is_a_result(small, monkeypatch, exc, marker):
    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(cupyflash, "flash_attn_with_kvcache", fail)
    monkeypatch.setattr(cupyflash, "flash_attn_fwd", fail)
    cupy, report = DecodeCupy(), _report()
    suites.run_decode(cupy, _args(no_torch=True), report, lambda: None)
    rows = report["results"]
    assert [r["part"] for r in rows] == ["grid", "paged", "paged", "prefill", "prefill"]
    assert rows[0]["ours_ms"] == marker and rows[0]["status"] == marker and rows[0]["check"] == "n/a"
    assert rows[0]["ours_error"] == f"{type(exc).__name__}: {exc}"
    assert all(r["status"] == marker for r in rows)
    assert rows[1]["contiguous_ms"] == rows[1]["paged_ms"] == marker
    assert rows[3]["kvcache_ms"] == rows[3]["dense_ms"] == marker
    assert report["bars"] == {marker: 5}


def test_an_allocation_failure_marks_the_shape(small, monkeypatch):
    cupy, report = DecodeCupy(), _report()

    def empty(shape, dtype):
        raise type("OutOfMemoryError", (MemoryError,), {})("out of memory to allocate")

    cupy.empty = empty
    suites.run_decode(cupy, _args(dtype=["float16", "bfloat16"], no_torch=True), report, lambda: None)
    assert [(r["part"], r["status"]) for r in report["results"]] == [("grid", "OOM")] * 2 + [
        ("paged", "OOM")] * 2 + [("prefill", "OOM")] * 2
    assert report["results"][0]["inputs_error"].startswith("OutOfMemoryError")


# ----------------------------------------------------------------------------
# Paged and prefill on the CPU path
# ----------------------------------------------------------------------------


def test_paged_and_prefill_parts(small):
    cupy, report = DecodeCupy(elapsed_ms=0.5), _report()
    suites.run_decode(cupy, _args(no_torch=True, part=["paged", "prefill"]), report, lambda: None)
    paged, prefill = report["results"][:2], report["results"][2:]
    assert [r["page_size"] for r in paged] == [16, 32]
    for r in paged:
        assert (r["contiguous_ms"], r["paged_ms"], r["ratio_paged_vs_contiguous"]) == (0.5, 0.5, 1.0)
        assert r["check_against"] == "contiguous" and r["check_max_abs"] == 0.0 and r["paged_nan"] is False
        assert r["status"] == "PASS"
    assert [r["seqlen_q"] for r in prefill] == [8, 16]
    for r in prefill:
        assert r["causal"] is True and r["check_against"] == "dense" and r["check_max_abs"] == 0.0
        assert r["ratio_kvcache_vs_dense"] == 1.0 and r["status"] == "PASS"
    assert report["parts"] == ["paged", "prefill"]


# ----------------------------------------------------------------------------
# The table and the command
# ----------------------------------------------------------------------------


def _decode_report():
    grid = [
        {"part": "grid", "batch": 8, "seqlen_k": 32768, "nheads_q": 32, "nheads_kv": 8, "head_dim": 128,
         "dtype": "bfloat16", "kv_bytes": 2**30, "ours_ms": 0.3, "fa2_ms": 0.5, "cudnn_ms": 0.33,
         "cudnn_kv": "expanded", "check": "PASS", "check_max_abs": 3.1e-5},
        {"part": "grid", "batch": 1, "seqlen_k": 1024, "nheads_q": 32, "nheads_kv": 32, "head_dim": 64,
         "dtype": "float16", "kv_bytes": 8 * 2**20, "ours_ms": 0.01, "fa2_ms": 0.012, "cudnn_ms": "error",
         "check": "PASS", "check_max_abs": 1e-4},
        {"part": "grid", "batch": 64, "seqlen_k": 131072, "nheads_q": 32, "nheads_kv": 32, "head_dim": 128,
         "dtype": "bfloat16", "kv_bytes": 137438953472, "status": "skipped", "skipped": "K/V 137.4 GB > 40 GB"},
    ]
    for r in grid[:2]:
        suites.judge_decode(r, 4.24)
    paged = {"part": "paged", "batch": 8, "seqlen_k": 32768, "nheads_q": 32, "nheads_kv": 8, "head_dim": 128,
             "dtype": "bfloat16", "page_size": 16, "contiguous_ms": 0.3, "paged_ms": 0.32, "check": "PASS",
             "check_max_abs": 0.0}
    prefill = {"part": "prefill", "batch": 1, "seqlen_k": 32768, "nheads_q": 32, "nheads_kv": 8, "head_dim": 128,
               "dtype": "bfloat16", "seqlen_q": 512, "kvcache_ms": 0.5, "dense_ms": 0.45, "check": "PASS",
               "check_max_abs": 2e-3}
    suites.judge_against(paged, "paged", "contiguous", suites.PAGED_BAR)
    suites.judge_against(prefill, "kvcache", "dense", suites.PREFILL_BAR)
    rows = grid + [paged, prefill]
    return {"suite": "decode", "config": {"copy_tbps": 4.24}, "notes": [], "results": rows,
            "bars": suites.count_statuses(rows)}


def test_decode_table():
    lines = suites.format_decode_table(_decode_report()).splitlines()
    assert lines[0].startswith("decode: seqlen_q 1 against a full cache; ms per call")
    assert "frac of 4.24 TB/s copy" in lines[0] and "cudnn+ = K/V heads expanded" in lines[0]
    assert lines[1].startswith("bars: bw >= 0.8 where K/V >= 256 MiB, x fa2 >= 1.5, x cudnn >= 1")
    assert lines[2].split() == ["B", "seqlen", "heads", "D", "dtype", "K/V", "MB", "|", "ours", "fa2", "cudnn",
                                "|", "x", "fa2", "x", "cudnn", "|", "TB/s", "frac", "|", "max", "err", "|", "bw",
                                "fa2", "cudnn", "chk", "|", "status"]
    tbps = 2**30 / 0.3e-3 / 1e12
    assert lines[3].split() == ["8", "32768", "32/8", "128", "bf16", "1073.7", "|", "0.3000", "0.5000", "0.3300+",
                                "|", "1.67", "1.10", "|", f"{tbps:.2f}", f"{tbps / 4.24:.2f}", "|", "3.1e-05", "|",
                                "PASS", "PASS", "PASS", "PASS", "|", "PASS"]
    assert lines[4].split() == ["1", "1024", "32/32", "64", "fp16", "8.4", "|", "0.0100", "0.0120", "error", "|",
                                "1.20", "-", "|", "0.84", "0.20", "|", "1.0e-04", "|", "-", "FAIL", "n/a", "PASS",
                                "|", "FAIL"]
    assert lines[5].split() == ["64", "131072", "32/32", "128", "bf16", "137439.0", "|", "-", "-", "-", "|", "-",
                                "-", "|", "-", "-", "|", "-", "|", "-", "-", "-", "-", "|", "skipped"]
    assert lines[6] == ""
    assert lines[7].startswith("paged: ours on a paged cache (blocks a shuffled pool) vs ours contiguous")
    assert lines[8].split() == ["B", "seqlen", "heads", "D", "dtype", "page", "|", "contiguous", "paged", "|",
                                "paged/contiguous", "|", "max", "err", "|", "status"]
    assert lines[9].split() == ["8", "32768", "32/8", "128", "bf16", "16", "|", "0.3000", "0.3200", "|", "1.067",
                                "|", "0.0e+00", "|", "PASS"]
    assert lines[11].startswith("prefill: ours flash_attn_with_kvcache vs flash_attn_fwd (dense), causal")
    assert lines[12].split()[5:12] == ["Sq", "|", "dense", "kvcache", "|", "kvcache/dense", "|"]
    assert lines[13].split() == ["1", "32768", "32/8", "128", "bf16", "512", "|", "0.4500", "0.5000", "|", "1.111",
                                 "|", "2.0e-03", "|", "FAIL"]
    assert lines[14] == "bars: 2 PASS, 2 FAIL, 1 skipped"
    assert len(lines) == 15


def test_decode_table_of_one_part():
    report = _decode_report()
    report["results"] = report["results"][3:4]
    lines = suites.format_decode_table(report).splitlines()
    assert lines[0].startswith("paged: ") and len(lines) == 4


def test_a_missing_matplotlib_is_a_note(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    _, format_table, plot = suites.SUITES["decode"]
    report, out = _decode_report(), io.StringIO()
    bench.finish(report, types.SimpleNamespace(plot=str(tmp_path / "d.png"), json=None), format_table, plot, out=out)
    assert report["notes"][-1].startswith(f"no plot written to {tmp_path / 'd.png'}: matplotlib is not installed")
    assert out.getvalue().endswith(suites.format_decode_table(report) + "\n")


def test_heads_argument():
    assert bench._heads("32:8") == (32, 8) and bench._heads("8:8") == (8, 8)
    assert bench._positive_float("4.24") == 4.24


def test_bench_decode_end_to_end(small, monkeypatch, tmp_path, capsys):
    cupy = DecodeCupy(elapsed_ms=1e-3)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    path = tmp_path / "decode.json"
    assert cli.main(["bench", "--suite", "decode", "--batch", "2", "--seqlen", "64", "--heads", "4:2",
                     "--head-dim", "16", "--dtype", "float16", "--copy-tbps", "3.35", "--no-torch",
                     "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert (report["suite"], report["device"]) == ("decode", "Fake GPU")
    assert report["notes"] == ["torch SDPA columns skipped: --no-torch"]
    assert report["config"]["copy_tbps"] == 3.35 and report["config"]["max_kv_bytes"] == 40e9
    assert report["parts"] == ["grid", "paged", "prefill"]
    assert [r["part"] for r in report["results"]] == ["grid", "paged", "paged", "prefill", "prefill"]
    grid = report["results"][0]
    assert grid["ours_frac_copy"] == pytest.approx(grid["kv_bytes"] / 1e-3 / 1e9 / 3.35)
    assert report["bars"] == suites.count_statuses(report["results"])
    out = capsys.readouterr()
    assert out.out == "note: torch SDPA columns skipped: --no-torch\n" + suites.format_decode_table(report) + "\n"
    assert out.err.splitlines()[0].startswith("decode B=2 S=64 4/2 D=16 float16: ours 0.0010 ms (")
