"""The suites' measurement code without a GPU.

``FakeCupy`` is numpy posing as cupy: its arrays are numpy arrays, so the public
API runs cupyflash's CPU path on them, while events, streams, the memory pool and
the spin kernel are stubs.  That runs the grid, seed and overhead code end to
end (inputs, rotation, timing calls, memory and error bookkeeping, JSON), and
fake implementations that raise out-of-memory errors check that a failure is a
result and never a crash.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

import numpy as np
import pytest

from cupyflash import _bench_suites as suites
from cupyflash import bench, cli


class _Event:
    log = None

    def record(self):
        if _Event.log is not None:
            _Event.log.append("record")

    def synchronize(self):
        pass


class _Stream:
    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Pool:
    def used_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


class FakeCupy(types.ModuleType):
    """numpy as cupy; every event interval lasts ``elapsed_ms``; spin-kernel launches are logged."""

    def __init__(self, elapsed_ms=2.0):
        super().__init__("cupy")
        rng = np.random.default_rng(0)
        self.ndarray = type("ndarray", (), {})  # no numpy array is a cupy array
        self.random = types.SimpleNamespace(
            standard_normal=lambda shape, dtype: rng.standard_normal(shape, dtype=dtype))
        stream = _Stream()
        self.cuda = types.SimpleNamespace(
            Event=_Event, get_current_stream=lambda: stream, get_elapsed_time=lambda start, stop: elapsed_ms,
            Stream=types.SimpleNamespace(null=stream), Device=lambda *args: types.SimpleNamespace(id=0),
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                          getDeviceProperties=lambda device: {"name": b"Fake GPU"}))
        self.spins = []
        self.RawKernel = lambda source, name: lambda grid, block, args: self.spins.append(int(args[0]))
        self._pool = _Pool()

    def get_default_memory_pool(self):
        return self._pool

    def __getattr__(self, name):
        return getattr(np, name)


class FakeMemory:
    """Every call takes ``nbytes`` extra; counts the calls and the releases."""

    label = "fake"
    method = "fake counter"

    def __init__(self, nbytes=4096):
        self.nbytes, self.calls, self.releases = nbytes, 0, 0

    def peak_extra(self, fn):
        self.calls += 1
        return fn(), self.nbytes

    def release(self):
        self.releases += 1


class OutOfMemoryError(RuntimeError):
    """Named as torch's and cupy's are."""


class FakeImpl:
    """An implementation on numpy: out = 2 q, grads = (dout, k, v); raises where told to."""

    def __init__(self, name="fake", fail_in=None, exc=None):
        self.name, self.fail_in, self.exc = name, fail_in, exc or OutOfMemoryError("Tried to allocate 1 TiB")
        self.used = []

    def _maybe_fail(self, where):
        if where == self.fail_in:
            raise self.exc

    def context(self):
        return _Stream()

    def prepare(self, inputs):
        self._maybe_fail("prepare")
        return inputs

    def forward(self, state):
        self._maybe_fail("forward")
        return 2 * state[0].astype(np.float64)

    def forward_timed(self, state):
        self.used.append(("fwd", id(state)))
        return self.forward(state)

    def output(self, fwd):
        return fwd

    def backward(self, state, fwd):
        self._maybe_fail("backward")
        self.used.append(("bwd", id(state)))
        return state[3], state[1], state[2]

    def time_ms(self, fn, reps):
        for _ in range(3):
            fn()
        self._maybe_fail("time")
        return 1.5

    def to_xp(self, x):
        return x


def _sets(count=3, shape=(1, 4, 2, 8)):
    rng = np.random.default_rng(1)
    return [tuple(rng.standard_normal(shape) for _ in range(4)) for _ in range(count)]


def _ref(s):
    return {"out": 2 * s[0], "dq": s[3], "dk": s[1], "dv": s[2] + 1.0}  # dv off by one


def test_measure_impl_records_times_memory_and_errors():
    sets, impl, memory = _sets(), FakeImpl(), FakeMemory(4096)
    res = {}
    suites.measure_impl(impl, sets, res, reps=5, memory=memory, ref=_ref(sets[0]), xp=np)
    assert res["fake_fwd_ms"] == res["fake_bwd_ms"] == 1.5
    assert res["fake_fwd_extra_bytes"] == res["fake_bwd_extra_bytes"] == 4096
    for t in ("out", "dq", "dk"):
        assert res[f"fake_{t}_max_abs"] == 0.0 and res[f"fake_{t}_rel_l2"] == 0.0
    assert res["fake_dv_max_abs"] == pytest.approx(1.0)
    assert res["fake_dv_rel_l2"] == pytest.approx(np.sqrt(sets[0][2].size) / np.linalg.norm(sets[0][2] + 1))
    # the timed calls rotate through the sets: three calls, three different sets, each pass
    assert {i for p, i in impl.used if p == "fwd"} == {id(s) for s in sets}
    assert {i for p, i in impl.used if p == "bwd"} >= {id(s) for s in sets}


def test_memory_is_measured_after_one_unmeasured_call_of_each_pass():
    impl, log = FakeImpl(), []
    forward, backward = impl.forward, impl.backward
    impl.forward = lambda state: log.append("forward") or forward(state)
    impl.backward = lambda state, fwd: log.append("backward") or backward(state, fwd)

    class Memory(FakeMemory):
        def peak_extra(self, fn):
            log.append("measure")
            return super().peak_extra(fn)

    suites.measure_impl(impl, _sets(1), {}, reps=5, memory=Memory(), ref=None, xp=np)
    assert log[:3] == ["forward", "measure", "forward"]
    assert log[log.index("backward"):][:3] == ["backward", "measure", "backward"]


def test_measure_impl_without_a_reference_skips_the_errors():
    res = {}
    suites.measure_impl(FakeImpl(), _sets(), res, reps=5, memory=FakeMemory(), ref=None, xp=np)
    assert sorted(res) == ["fake_bwd_extra_bytes", "fake_bwd_ms", "fake_fwd_extra_bytes", "fake_fwd_ms"]


def _error_keys(name, tensors):
    return {f"{name}_{t}_{m}" for t in tensors for m in ("max_abs", "rel_l2")}


def test_oom_in_the_backward_keeps_the_forward():
    sets = _sets()
    res = {}
    suites.measure_impl(FakeImpl("math", fail_in="backward"), sets, res, reps=5, memory=FakeMemory(),
                        ref=_ref(sets[0]), xp=np)
    assert res["math_fwd_ms"] == 1.5 and res["math_out_max_abs"] == 0.0
    for key in {"math_bwd_ms", "math_bwd_extra_bytes"} | _error_keys("math", ("dq", "dk", "dv")):
        assert res[key] == "OOM", key
    assert res["math_error"] == "OutOfMemoryError: Tried to allocate 1 TiB"


@pytest.mark.parametrize("where", ["prepare", "forward", "time"])
def test_oom_in_the_forward_marks_everything(where):
    sets = _sets()
    res = {}
    suites.measure_impl(FakeImpl("math", fail_in=where), sets, res, reps=5, memory=FakeMemory(),
                        ref=_ref(sets[0]), xp=np)
    keys = ({f"math_{p}_{k}" for p in ("fwd", "bwd") for k in ("ms", "extra_bytes")}
            | _error_keys("math", suites.TENSORS))
    assert {k for k, v in res.items() if v == "OOM"} == keys - ({"math_fwd_extra_bytes", "math_out_max_abs",
                                                                "math_out_rel_l2"} if where == "time" else set())
    assert res["math_error"].startswith("OutOfMemoryError")


def test_another_error_is_an_error_not_an_oom():
    res = {}
    suites.measure_impl(FakeImpl("cudnn", fail_in="forward", exc=RuntimeError("No available kernel")),
                        _sets(), res, reps=5, memory=FakeMemory(), ref=None, xp=np)
    assert res == {"cudnn_fwd_ms": "error", "cudnn_fwd_extra_bytes": "error", "cudnn_bwd_ms": "error",
                   "cudnn_bwd_extra_bytes": "error", "cudnn_error": "RuntimeError: No available kernel"}


@pytest.fixture
def small_l2(monkeypatch):
    """L2 of 1 MiB: the test shapes rotate through a few input sets."""
    monkeypatch.setattr(bench, "L2_BYTES", 2**20)


def test_seed_point_on_the_cpu_path_is_close_to_float64(small_l2):
    """The whole seed point with cupyflash's real CPU path: small errors, ratios, rotation, OOM."""
    class Fa2(suites.Ours):
        name = "fa2"

    cupy, memory = FakeCupy(), FakeMemory()
    impls = [suites.Ours(cupy, True), Fa2(cupy, True), FakeImpl("math", fail_in="forward")]
    res = suites.seed_point(cupy, impls, memory, seqlen=16, reps=2)
    assert res["input_sets"] == 1 + 4  # 512 KiB sets against 1 MiB of L2
    assert (res["batch"], res["nheads"], res["head_dim"], res["causal"]) == (1, 32, 128, True)
    assert res["ours_fwd_ms"] == res["ours_bwd_ms"] == 2.0  # the fake events
    assert res["ratio_fwd_vs_fa2"] == res["ratio_bwd_vs_fa2"] == 1.0
    assert "ratio_fwd_vs_math" not in res and res["math_fwd_ms"] == "OOM"
    for t in suites.TENSORS:  # float16 inputs, float32 arithmetic: errors well below 1e-2
        assert 0 < res[f"ours_{t}_max_abs"] < 1e-2, t
        assert 0 < res[f"ours_{t}_rel_l2"] < 5e-3, t
        assert res[f"fa2_{t}_max_abs"] == res[f"ours_{t}_max_abs"]
    assert suites.errors_not_above(res, "ours", "fa2") == "8/8"
    assert memory.releases == 1 + len(impls)  # after the reference and after each implementation


def test_seed_point_beyond_the_error_limit_has_no_errors(small_l2, monkeypatch):
    monkeypatch.setattr(suites, "ERROR_MAX_SEQLEN", 8)
    cupy = FakeCupy()
    res = suites.seed_point(cupy, [suites.Ours(cupy, True)], FakeMemory(), seqlen=16, reps=2)
    assert "ours_fwd_ms" in res and not any("max_abs" in k for k in res)


def test_grid_point_on_the_cpu_path(small_l2):
    cupy = FakeCupy(elapsed_ms=4.0)
    res = bench.run_point(cupy, None, head_dim=64, seqlen=32, dtype="float16", causal=True, tokens=32,
                          reps=2, bwd=True, deterministic=True)
    assert (res["batch"], res["nheads"], res["input_sets"]) == (1, 32, 1 + 4)  # 512 KiB sets
    assert res["ours_fwd_ms"] == res["ours_bwd_ms"] == res["ours_bwd_det_ms"] == 4.0
    assert res["ours_fwd_tflops"] == pytest.approx(bench.flops(1, 32, 32, 32, 64, True) / 4.0 / 1e9)
    assert res["ours_bwd_tflops"] == pytest.approx(bench.flops(1, 32, 32, 32, 64, True, bwd=True) / 4.0 / 1e9)
    assert res["ratio_bwd_det_vs_default"] == 1.0
    assert res["fwd_output_bytes"] == 32 * 32 * 64 * 2 + 32 * 32 * 4  # out fp16 + lse fp32
    assert res["bwd_output_bytes"] == 3 * 32 * 32 * 64 * 2
    assert "ours_bwd_error" not in res
    assert "kernel_info_error" in res  # no GPU plan for numpy arrays; the timings stand


@pytest.fixture
def fake_gpu(monkeypatch):
    """``import cupy`` gives a FakeCupy (the GPU probe finds one device)."""
    cupy = FakeCupy(elapsed_ms=1e-6)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


def test_bench_grid_end_to_end(fake_gpu, small_l2, tmp_path, capsys):
    path = tmp_path / "grid.json"
    assert cli.main(["bench", "--seqlen", "32", "--head-dim", "64", "--dtype", "float16", "--causal", "yes",
                     "--tokens", "64", "--reps", "2", "--no-torch", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert (report["suite"], report["device"], report["notes"]) == ("grid", "Fake GPU", [])
    assert [(r["head_dim"], r["seqlen"], r["causal"]) for r in report["results"]] == [(64, 32, True)]
    out = capsys.readouterr()
    assert out.out == bench.format_grid_table(report["results"]) + "\n"
    assert out.err.startswith("[1/1] D=64 S=32 float16 causal=True: ours fwd ")


def test_bench_seed_end_to_end(fake_gpu, small_l2, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(suites, "CupyPeak", lambda cupy: FakeMemory())
    path = tmp_path / "seed.json"
    assert cli.main(["bench", "--suite", "seed", "--seqlen", "16", "--seqlen", "32", "--reps", "2",
                     "--no-torch", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["impls"] == ["ours"] and report["memory_method"] == "fake counter"
    assert report["notes"] == ["torch SDPA columns skipped: --no-torch"]
    assert [r["seqlen"] for r in report["results"]] == [16, 32]
    assert all(r["ours_out_rel_l2"] < 5e-3 for r in report["results"])
    stdout = capsys.readouterr().out
    assert stdout == "note: torch SDPA columns skipped: --no-torch\n" + suites.format_seed_table(report) + "\n"


def test_bench_overhead_end_to_end(fake_gpu, small_l2, tmp_path, capsys, monkeypatch):
    """Host-bound rows (the fake GPU takes no time) judged against the bars; the spin kernel's length."""
    monkeypatch.setattr(suites, "OVERHEAD_SHAPES", (((1, 16, 2, 32), "float16"),))
    monkeypatch.setattr(suites, "GPU_CALLS", 3)
    benchmarks = []

    def benchmark(fn, n_repeat, n_warmup, name):  # cupyx's needs a name for a functools.partial
        benchmarks.append((n_repeat, n_warmup, name))
        fn()
        return types.SimpleNamespace(cpu_times=np.array([4e-6, 6e-6, 5e-6]))

    profiler = types.SimpleNamespace(benchmark=benchmark)
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(profiler=profiler))
    monkeypatch.setitem(sys.modules, "cupyx.profiler", profiler)
    path = tmp_path / "overhead.json"
    assert cli.main(["bench", "--suite", "overhead", "--calls", "4", "--reps", "2", "--no-torch",
                     "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert (report["calls"], report["batches"], report["gpu_calls"]) == (4, 2, 3)
    assert [(r["api"], r["pass"]) for r in report["results"]] == [("cupy", "fwd"), ("cupy", "bwd")]
    for r in report["results"]:
        assert r["regime"] == "host-bound" and r["cpu_times_us"] == pytest.approx(5.0)
        assert r["wall_us"] >= r["host_us"] > 0
        assert r["bar_us"] == suites.BARS_US[("cupy", r["pass"])]
        assert r["status"] == ("PASS" if r["wall_us"] <= r["bar_us"] else "FAIL")
    assert benchmarks == [(4, 10, "cupy fwd"), (4, 10, "cupy bwd")]
    assert fake_gpu.spins[0] == 1000  # compiled before timing
    assert len(fake_gpu.spins) == 1 + 2 * 5
    first_row_spins = fake_gpu.spins[1:6]
    assert min(first_row_spins) == max(first_row_spins) > 1_000_000  # 1 ms plus twice the host time
    assert report["bars"] == suites.count_statuses(report["results"])
    assert capsys.readouterr().out.endswith(suites.format_overhead_table(report) + "\n")


def test_bench_frameworks_without_torch_or_jax(fake_gpu, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "jax", None)  # import fails
    assert cli.main(["bench", "--suite", "frameworks", "--no-torch"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "note: torch steps skipped: --no-torch"
    assert out[1].startswith("note: JAX steps skipped: JAX not importable (ModuleNotFoundError")
    assert out[-1] == "bars: none judged"


def test_a_framework_failing_outside_an_implementation_is_a_result():
    def measure():
        raise RuntimeError("DNN library initialization failed")

    res = suites.step_or_failure("jax", (8, 128, 12, 64), measure)
    assert (res["ours_ms"], res["cudnn_ms"], res["xla_ms"], res["status"]) == ("error",) * 3 + ("n/a",)
    assert res["jax_error"] == "RuntimeError: DNN library initialization failed"
    assert (res["batch"], res["seqlen"], res["bar"]) == (8, 128, "ours <= 1.2x cudnn")
    ok = {"framework": "torch", "seqlen": 128, "status": "PASS"}
    assert suites.step_or_failure("torch", (8, 128, 12, 64), lambda: ok) is ok


def test_per_call_us_times_back_to_back_calls():
    calls, syncs = [], []

    def fn():
        calls.append(1)
        time.sleep(0.0005)

    wall, host = suites.per_call_us(fn, calls=20, batches=3, synchronize=lambda: syncs.append(len(calls)),
                                    warmup_ms=5.0)
    warmup = len(calls) - 60
    assert 3 <= warmup <= 12
    # after the warm-up, one synchronize before and one after each batch of 20 calls, none inside
    assert syncs[warmup:] == [warmup, warmup + 20, warmup + 20, warmup + 40, warmup + 40, warmup + 60]
    assert 500 <= host <= wall < 50_000


def test_gpu_us_per_call_queues_the_calls_behind_a_spin():
    log = []
    _Event.log = log
    try:
        us = suites.gpu_us_per_call(lambda: log.append("call"), calls=4, host_us=10.0,
                                    spin=lambda ns: log.append(("spin", ns)), new_event=_Event,
                                    elapsed_ms=lambda start, stop: 0.2, repeats=2)
    finally:
        _Event.log = None
    assert us == pytest.approx(50.0)  # 0.2 ms over 4 calls
    one = [("spin", 2 * 4 * 10_000 + 1_000_000), "record", "call", "call", "call", "call", "record"]
    assert log == one + one


def test_jax_time_ms_rotates_and_blocks_once_per_batch():
    blocked, seen = [], []
    jax = types.SimpleNamespace(block_until_ready=lambda x: blocked.append(x) or x)

    def step(q):
        seen.append(q)
        time.sleep(0.001)
        return q

    ms = suites.jax_time_ms(jax, step, ["a", "b", "c"], 4, steps_per_batch=5, warmup_ms=1.0)
    assert 1.0 <= ms < 100.0
    warmup = len(seen) - 20
    assert warmup >= 3 and seen[:9] == ["a", "b", "c"] * 3
    assert [len(b) for b in blocked[warmup:]] == [5, 5, 5, 5]  # one wait per batch of steps
    assert blocked[:warmup] == seen[:warmup]  # the warm-up waits for every step


def test_jax_env_sets_no_preallocation_and_reports_a_missing_jax(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.setitem(sys.modules, "jax", None)
    mods, why = suites.jax_env()
    assert mods is None and why.startswith("JAX not importable (ModuleNotFoundError")
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_torch_peak_counts_cupy_allocations_through_torch():
    """cupy's allocations during the call become torch tensors, so torch's counters see them."""
    made = []

    class Tensor:
        def __init__(self, size):
            self.size = size

        def data_ptr(self):
            return 4096

    torch = types.SimpleNamespace(uint8="uint8", empty=lambda size, dtype, device: made.append(
        (size, dtype, device)) or Tensor(size))
    counters = {"allocated": 1000, "peak": 0}
    torch.cuda = types.SimpleNamespace(
        synchronize=lambda: None, memory_allocated=lambda: counters["allocated"],
        reset_peak_memory_stats=lambda: counters.update(peak=counters["allocated"]),
        max_memory_allocated=lambda: counters["peak"])
    allocators = []

    class UsingAllocator:
        def __init__(self, malloc):
            self.malloc = malloc

        def __enter__(self):
            allocators.append(self.malloc)

        def __exit__(self, *exc):
            allocators.pop()

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=3), using_allocator=UsingAllocator,
        UnownedMemory=lambda ptr, size, owner: ("memory", ptr, size, owner),
        MemoryPointer=lambda memory, offset: ("pointer", memory, offset)))

    def call():  # allocates 512 bytes through cupy, torch sees 1500 at the peak
        pointer = allocators[-1](512)
        counters["peak"] = 1500
        return pointer

    pointer, extra = suites.TorchPeak(torch, cupy).peak_extra(call)
    assert extra == 500 and allocators == []
    assert made == [(512, "uint8", "cuda:3")]
    assert pointer[:1] == ("pointer",) and pointer[1][:3] == ("memory", 4096, 512)
    assert isinstance(pointer[1][3], Tensor)  # the tensor lives as long as cupy's memory


def test_cupy_peak_hook_tracks_the_peak_of_the_call():
    pytest.importorskip("cupy.cuda.memory_hook")
    peak = suites.CupyPeak(FakeCupy())  # cupy's real MemoryHook, the fake's stream

    def call():
        hook = hooks[-1]
        for kind, size in (("malloc", 1024), ("malloc", 512), ("free", 1024), ("malloc", 256)):
            getattr(hook, f"{kind}_postprocess")(device_id=0, mem_size=size, mem_ptr=0, pmem_id=0)
        return "done"

    hooks = []
    real_hook = peak._hook

    def tracked():
        hooks.append(real_hook())
        return hooks[-1]

    peak._hook = tracked
    assert peak.peak_extra(call) == ("done", 1536)
