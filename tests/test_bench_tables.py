"""bench's tables, JSON and plots from fake results (no GPU): what each suite prints last."""

from __future__ import annotations

import argparse
import io
import json
import sys

from cupyflash import _bench_suites as suites
from cupyflash import bench

GRID_POINT = {"head_dim": 128, "seqlen": 4096, "dtype": "bfloat16", "causal": True,
              "ours_fwd_tflops": 512.3, "fa2_fwd_tflops": 401.7, "cudnn_fwd_tflops": 650.2,
              "ratio_fwd_vs_fa2": 1.2753, "ratio_fwd_vs_cudnn": 0.7879, "ours_fwd_frac_ceiling": 0.6913,
              "ours_bwd_tflops": 380.4, "fa2_bwd_tflops": 300.0, "ratio_bwd_vs_fa2": 1.268}


def test_grid_table_is_unchanged():
    """The grid's table as it was before the suites (the lines below are the old code's output)."""
    assert bench.format_grid_table([GRID_POINT, {"head_dim": 64, "seqlen": 512, "dtype": "float16",
                                                 "causal": False, "ours_fwd_tflops": 100.0}]) == (
        "\n  D  seqlen dtype causal | fwd TFLOP/s ours  fa2 cudnn | x fa2 x cudnn frac |"
        " bwd TFLOP/s ours  fa2 cudnn | x fa2 x cudnn\n"
        "128   4096  bflo      T |            512  402   650 |  1.28    0.79 0.69 |"
        "            380  300     - |  1.27       -\n"
        " 64    512  floa      F |            100    -     - |     -       -    - |"
        "              -    -     - |     -       -")
    out = io.StringIO()
    bench.print_table([GRID_POINT], out)
    assert out.getvalue() == bench.format_grid_table([GRID_POINT]) + "\n"


def _seed_report():
    errors = {f"{impl}_{t}_{m}": value for impl, value in (("ours", 1e-3), ("fa2", 2e-3), ("cudnn", 1e-3),
                                                          ("math", 4e-3))
              for t in suites.TENSORS for m in ("max_abs", "rel_l2")}
    errors["ours_dk_max_abs"] = 3e-3  # one of eight above FA2's
    small = {"seqlen": 4096, "ours_fwd_ms": 1.0, "fa2_fwd_ms": 1.25, "cudnn_fwd_ms": 0.8, "math_fwd_ms": 9.0,
             "ours_bwd_ms": 3.0, "fa2_bwd_ms": 3.6, "cudnn_bwd_ms": 2.4, "math_bwd_ms": 30.0,
             "ours_fwd_extra_bytes": 32 * 2**20, "fa2_fwd_extra_bytes": 33 * 2**20,
             "cudnn_fwd_extra_bytes": 2**20, "math_fwd_extra_bytes": 3 * 2**30,
             "ours_bwd_extra_bytes": 96 * 2**20, "fa2_bwd_extra_bytes": 100 * 2**20,
             "cudnn_bwd_extra_bytes": 0, "math_bwd_extra_bytes": 6 * 2**30, **errors}
    large = {"seqlen": 32768, "ours_fwd_ms": 20.0, "fa2_fwd_ms": 25.0, "cudnn_fwd_ms": 16.0,
             "math_fwd_ms": "OOM", "math_bwd_ms": "OOM", "math_fwd_extra_bytes": "OOM",
             "math_bwd_extra_bytes": "OOM", "ours_bwd_ms": 50.0, "fa2_bwd_ms": "error", "cudnn_bwd_ms": 40.0}
    for res in (small, large):
        suites.add_ratios(res, ["fa2", "cudnn", "math"])
    return {"suite": "seed", "config": suites.SEED_CONFIG, "impls": ["ours", "fa2", "cudnn", "math"],
            "memory_label": "torch's allocator counters", "error_max_seqlen": 4096, "notes": [],
            "results": [small, large]}


def test_seed_table_times_ratios_memory_and_errors():
    lines = suites.format_seed_table(_seed_report()).splitlines()
    assert lines[0] == ("seed: batch 1, nheads 32, head_dim 128, causal, float16; "
                        "x NAME = NAME's time / ours (>1: ours faster)")
    assert lines[1].split() == ["seqlen", "|", "fwd", "ms", "ours", "fa2", "cudnn", "math", "|", "x", "fa2",
                                "x", "cudnn", "x", "math", "|", "bwd", "ms", "ours", "fa2", "cudnn", "math",
                                "|", "x", "fa2", "x", "cudnn", "x", "math", "|"]
    assert lines[2].split() == ["4096", "|", "1.000", "1.250", "0.800", "9.000", "|", "1.25", "0.80", "9.00",
                                "|", "3.000", "3.600", "2.400", "30.000", "|", "1.20", "0.80", "10.00", "|"]
    # OOM and errors stay visible; no ratio is made of them
    assert lines[3].split() == ["32768", "|", "20.000", "25.000", "16.000", "OOM", "|", "1.25", "0.80", "-",
                                "|", "50.000", "error", "40.000", "OOM", "|", "-", "0.80", "-", "|"]
    assert lines[5] == "peak extra device memory beyond the inputs, MiB (torch's allocator counters)"
    assert lines[7].split() == ["4096", "|", "32.0", "33.0", "1.0", "3072.0", "|",
                                "96.0", "100.0", "0.0", "6144.0", "|"]
    assert lines[8].split() == ["32768", "|", "-", "-", "-", "OOM", "|", "-", "-", "-", "OOM", "|"]
    assert lines[10].startswith("errors against the float64 reference (max abs, relative L2)")
    assert lines[11].split()[:4] == ["seqlen", "impl", "|", "out"] and lines[11].endswith("ours <= fa2")
    error_rows = lines[12:]
    assert [row.split()[:2] for row in error_rows] == [["4096", i] for i in ("ours", "fa2", "cudnn", "math")]
    assert error_rows[0].split()[2:6] == ["|", "1.0e-03", "1.0e-03", "|"]
    assert error_rows[0].endswith(" 7/8")  # dk's max abs error is above FA2's
    assert "2.0e-03" in error_rows[1] and not error_rows[1].endswith("/8")


def test_seed_table_without_torch_has_ours_alone():
    report = _seed_report()
    report["impls"] = ["ours"]
    lines = suites.format_seed_table(report).splitlines()
    assert lines[1].split() == ["seqlen", "|", "fwd", "ms", "ours", "|", "|", "bwd", "ms", "ours", "|", "|"]
    assert "ours <= fa2" not in lines[11]
    assert len(lines) == 13  # one error row: ours at 4096


def test_errors_not_above_counts_the_metrics_both_have():
    res = {"ours_out_max_abs": 1.0, "fa2_out_max_abs": 1.0, "ours_dq_rel_l2": 2.0, "fa2_dq_rel_l2": 1.0,
           "ours_dk_max_abs": 1.0, "fa2_dk_max_abs": "OOM"}
    assert suites.errors_not_above(res, "ours", "fa2") == "1/2"
    assert suites.errors_not_above({}, "ours", "fa2") == "-"


def _overhead_report():
    rows = [{"shape": [1, 128, 8, 64], "dtype": "bfloat16", "api": "cupy", "pass": "fwd", "wall_us": 8.04,
             "host_us": 7.96, "cpu_times_us": 9.5, "gpu_us": 3.1, "regime": "host-bound", "bar_us": 10.0,
             "status": "PASS"},
            {"shape": [1, 128, 8, 64], "dtype": "float16", "api": "flash_attn_func", "pass": "fwd+bwd",
             "wall_us": 80.0, "host_us": 79.0, "cpu_times_us": 85.0, "gpu_us": 20.0, "regime": "host-bound",
             "bar_us": None, "status": "-"},
            {"shape": [1, 512, 32, 128], "dtype": "float16", "api": "torch", "pass": "bwd", "bar_us": 35.0,
             "status": "OOM", "row_error": "OutOfMemoryError: x"}]
    return {"suite": "overhead", "calls": 300, "batches": 10, "gpu_calls": 50, "notes": [], "results": rows,
            "bars": suites.count_statuses(rows)}


def test_overhead_table():
    lines = suites.format_overhead_table(_overhead_report()).splitlines()
    assert lines[0].startswith("overhead: us per call. wall/host: 300 back-to-back calls, median of 10 batches")
    assert "cupyx.profiler.benchmark cpu_times" in lines[1] and "events around 50 calls" in lines[1]
    assert lines[2].split() == ["shape", "dtype", "api", "pass", "wall", "host", "isolated", "GPU", "regime",
                                "bar", "status"]
    assert lines[3].split() == ["1x128x8x64", "bf16", "cupy", "fwd", "8.0", "8.0", "9.5", "3.1", "host-bound",
                                "10", "PASS"]
    assert lines[4].split() == ["1x128x8x64", "fp16", "flash_attn_func", "fwd+bwd", "80.0", "79.0", "85.0",
                                "20.0", "host-bound", "-", "-"]
    assert lines[5].split() == ["1x512x32x128", "fp16", "torch", "bwd", "-", "-", "-", "-", "-", "35", "OOM"]
    assert lines[6] == "bars: 1 PASS, 1 OOM"


def _frameworks_report():
    rows = [{"framework": "torch", "batch": 8, "seqlen": 128, "nheads": 12, "head_dim": 64, "ours_ms": 0.5,
             "fa2_ms": 0.48, "cudnn_ms": 0.45},
            {"framework": "torch", "batch": 2, "seqlen": 4096, "nheads": 32, "head_dim": 128, "ours_ms": 2.5,
             "fa2_ms": 2.4, "cudnn_ms": "error"},
            {"framework": "jax", "batch": 4, "seqlen": 1024, "nheads": 16, "head_dim": 64, "ours_ms": 1.0,
             "cudnn_ms": 0.9, "xla_ms": 2.0}]
    for r in rows:
        suites.judge_step(r)
    return {"suite": "frameworks", "notes": [], "results": rows, "bars": suites.count_statuses(rows)}


def test_frameworks_table():
    lines = suites.format_frameworks_table(_frameworks_report()).splitlines()
    assert lines[0].startswith("frameworks: ms per training step (forward + backward), bfloat16, causal")
    assert lines[1].startswith("torch: cupyflash.torch.flash_attn_func vs SDPA")
    assert lines[2].split() == ["shape", "ours", "fa2", "cudnn", "|", "x", "fa2", "x", "cudnn", "|", "bar",
                                "status"]
    assert lines[3].split() == ["8x128x12x64", "0.500", "0.480", "0.450", "|", "0.96", "0.90", "|",
                                "ours", "<=", "1.1x", "fa2", "PASS"]
    assert lines[4].split() == ["2x4096x32x128", "2.500", "2.400", "error", "|", "0.96", "-", "|",
                                "ours", "<", "fa2", "FAIL"]
    assert lines[5].startswith("jax: cupyflash.jax.flash_attention vs jax.nn.dot_product_attention")
    assert lines[6].split()[:4] == ["shape", "ours", "cudnn", "xla"]
    assert lines[7].split() == ["4x1024x16x64", "1.000", "0.900", "2.000", "|", "0.90", "2.00", "|",
                                "ours", "<=", "1.2x", "cudnn", "PASS"]
    assert lines[8] == "bars: 2 PASS, 1 FAIL"


def test_frameworks_table_of_one_framework_and_no_bars():
    report = {"suite": "frameworks", "notes": ["JAX steps skipped: --no-jax"], "results": [], "bars": {}}
    assert suites.format_frameworks_table(report).splitlines()[1:] == ["bars: none judged"]


def _args(**kwargs):
    return argparse.Namespace(**{"json": None, "plot": None, **kwargs})


def test_finish_writes_the_json_then_prints_notes_and_the_table_last(tmp_path):
    report = _overhead_report()
    report["notes"].append("torch rows skipped: --no-torch")
    path = tmp_path / "overhead.json"
    out = io.StringIO()
    bench.finish(report, _args(json=str(path)), suites.format_overhead_table, None, out=out)
    assert json.loads(path.read_text()) == report
    text = out.getvalue()
    assert text.startswith("note: torch rows skipped: --no-torch\n")
    assert text.endswith(suites.format_overhead_table(report) + "\n")


def test_a_missing_matplotlib_is_a_note(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    png = tmp_path / "seed.png"
    for name, report in (("seed", _seed_report()), ("overhead", _overhead_report()),
                         ("frameworks", _frameworks_report())):
        _, format_table, plot = suites.SUITES[name]
        out = io.StringIO()
        bench.finish(report, _args(plot=str(png), json=str(tmp_path / "r.json")), format_table, plot, out=out)
        assert not png.exists()
        note = f"no plot written to {png}: matplotlib is not installed"
        assert report["notes"][-1].startswith(note)
        assert json.loads((tmp_path / "r.json").read_text())["notes"][-1].startswith(note)
        assert out.getvalue().startswith(f"note: {note}")
    grid = {"notes": [], "results": [GRID_POINT]}
    bench.write_plot(lambda r, p: bench._plot(r["results"], p), grid, str(png))
    assert grid["notes"][0].startswith(f"no plot written to {png}: matplotlib is not installed")
