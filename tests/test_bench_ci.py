""".ci/gpu, the one GPU session script, run here with stub commands (no GPU).

``nvidia-smi``, ``python3`` (for pytest, check-kernels and bench) and ``timeout``
are stubs that log their arguments; ``python3 -`` runs the real interpreter, so
the script's own Python snippets run as on the device.  The tests check what
the device would be asked to do: the stages, their time limits (quick's must add
up under the 600 s of one device call), the files under $OUT (8 at most) and the
summary printed last.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / ".ci" / "gpu"

FAKE_BENCH = r'''
import argparse, json, os, sys, time
p = argparse.ArgumentParser()
p.add_argument("--suite"); p.add_argument("--json"); p.add_argument("--plot")
args, _ = p.parse_known_args(sys.argv[1:])
print(f"progress of {args.suite}", file=sys.stderr)
if args.suite == os.environ.get("SLOW_SUITE"):
    time.sleep(30)
report = {"suite": args.suite, "notes": [], "results": [{}, {}]}
if args.suite in ("overhead", "frameworks", "decode", "variants"):
    report["bars"] = {"PASS": 3, "FAIL": 1}
with open(args.json, "w") as f:
    json.dump(report, f)
print(f"table of {args.suite}")
sys.exit(1 if args.suite == os.environ.get("FAIL_SUITE") else 0)
'''


@pytest.fixture
def stubs(tmp_path):
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "fake_bench.py").write_text(FAKE_BENCH)
    scripts = {
        "nvidia-smi": 'echo "NVIDIA H200, 1980 MHz, 1980 MHz, 31"',
        "timeout": f'echo "timeout $*" >> "$STUB_LOG"; exec {shutil.which("timeout")} "$@"',
        "python3": f'''
if [ "$1" = - ]; then exec {sys.executable} "$@"; fi
echo "python3 $*" >> "$STUB_LOG"
case "$1 $2 $3" in
    "-m pytest "*) echo ...; echo "========= 5 passed, 1 skipped in 1.00s ========="; exit ${{PYTEST_RC:-0}} ;;
    "-m cupyflash check-kernels") echo "ok a"; echo "ok b"; echo "FAIL c: spills"; sleep "${{CHECK_SLEEP:-0}}"
                                  exit 1 ;;
    "-m cupyflash bench") shift 3; exec {sys.executable} "{tmp_path / 'fake_bench.py'}" "$@" ;;
esac
echo "unexpected python3 $*" >&2; exit 99''',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body + "\n")
        path.chmod(0o755)
    return tmp_path


def _run(stubs, *args, **env):
    out = stubs / "out"
    log = stubs / "log.txt"
    log.write_text("")
    result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PATH": f"{stubs / 'bin'}:{os.environ['PATH']}",
                                 "OUT": str(out), "STUB_LOG": str(log), **env})
    return result, log.read_text().splitlines(), out


def _timeouts(log):
    """The time limits of the foreground stages, in order (the background compile check aside)."""
    return [int(line.split()[1]) for line in log if line.startswith("timeout ") and "check-kernels" not in line]


def _summary(stdout):
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("== .ci/gpu "))
    return lines[start], [line.split(None, 3) for line in lines[start + 2:]]


def test_quick_runs_every_stage_within_one_device_call(stubs):
    result, log, out = _run(stubs, "quick")
    assert result.returncode == 0, result.stdout + result.stderr
    limits = _timeouts(log)
    assert limits == [30, 210, 100, 90, 60, 80, 90]  # versions, tests, grid, seed, overhead, frameworks, decode
    assert sum(limits[:-1]) <= 580 < 600  # decode, last, gets what is left before DEADLINE (see below)
    # the compile check runs in the background under `timeout` too, stopped when the tests end
    assert any(line.startswith("timeout 210 python3 -m cupyflash check-kernels --arch 9.0") for line in log)
    pytest_cmd = next(line for line in log if line.startswith("python3 -m pytest"))
    assert "-m gpu and not slow -n 12 -q" in pytest_cmd
    benches = [line for line in log if line.startswith("python3 -m cupyflash bench")]
    assert [b.split("--suite ")[1].split()[0] for b in benches] == ["grid", "seed", "overhead", "frameworks",
                                                                    "decode"]
    assert f"--json {out}/bench_grid.json --plot {out}/bench_grid.png --seqlen 1024 --seqlen 4096 " \
           f"--seqlen 16384 --reps 10" in benches[0]
    assert all("--reps 10" in b for b in benches)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench.txt", "bench_decode.json", "bench_frameworks.json", "bench_grid.json",
                     "bench_overhead.json", "bench_seed.json", "gpu.txt"]
    assert len(files) + 1 <= 8  # with the grid's PNG: what one device call brings back
    assert all(p.is_file() for p in out.iterdir())
    bench_txt = (out / "bench.txt").read_text()
    for suite in ("grid", "seed", "overhead", "frameworks", "decode"):
        assert f"== bench --suite {suite} (status 0) ==\nprogress of {suite}\ntable of {suite}\n" in bench_txt
    gpu_txt = (out / "gpu.txt").read_text()
    assert gpu_txt.startswith("NVIDIA H200, 1980 MHz")
    pytest_log = "== pytest (status 0) ==\n...\n========= 5 passed, 1 skipped in 1.00s =========\n"
    assert pytest_log + "== check-kernels (finished) ==\nok a\nok b\nFAIL c: spills\n" in gpu_txt
    title, rows = _summary(result.stdout)
    assert title.startswith("== .ci/gpu quick: summary (")
    assert all(r[2].isdigit() for r in rows if r[0] != "check-kernels")  # seconds per stage
    assert [r[:2] + r[3:] for r in rows] == [
        ["pytest", "0", "5 passed, 1 skipped in 1.00s"], ["check-kernels", "-", "2 ok, 1 FAIL (finished)"],
        ["grid", "0", "2 results"], ["seed", "0", "2 results"],
        ["overhead", "0", "2 results, bars: 3 PASS, 1 FAIL"],
        ["frameworks", "0", "2 results, bars: 3 PASS, 1 FAIL"],
        ["decode", "0", "2 results, bars: 3 PASS, 1 FAIL"]]
    assert "table of frameworks" in result.stdout  # each suite's table on the console too


def test_an_unfinished_compile_check_is_stopped_when_the_tests_end(stubs):
    start = time.monotonic()
    result, _, out = _run(stubs, "quick", SUITES="seed", CHECK_SLEEP="60")
    assert time.monotonic() - start < 30
    assert result.returncode == 0
    assert _summary(result.stdout)[1][1] == ["check-kernels", "-", "-", "2 ok, 1 FAIL (stopped unfinished)"]
    assert "== check-kernels (stopped unfinished) ==\nok a\n" in (out / "gpu.txt").read_text()


def test_full_runs_the_whole_grid(stubs):
    result, log, _ = _run(stubs, "full", SUITES="grid")
    assert result.returncode == 0
    grid = next(line for line in log if line.startswith("python3 -m cupyflash bench --suite grid"))
    assert "--seqlen" not in grid and "--reps" not in grid
    assert _timeouts(log)[2] == 300


def test_a_failing_suite_fails_the_run_and_the_others_still_run(stubs):
    result, _, _ = _run(stubs, "quick", FAIL_SUITE="seed", TESTS="none")
    assert result.returncode == 1
    _, rows = _summary(result.stdout)
    assert rows[0] == ["pytest", "-", "-", "skipped (TESTS=none)"]
    assert [r[:2] for r in rows[2:]] == [["grid", "0"], ["seed", "1"], ["overhead", "0"], ["frameworks", "0"],
                                         ["decode", "0"]]


def test_failing_tests_fail_the_run(stubs):
    result, _, _ = _run(stubs, "quick", PYTEST_RC="1", SUITES="overhead")
    assert result.returncode == 1
    assert _summary(result.stdout)[1][0][:2] == ["pytest", "1"]


def test_a_suite_past_its_time_is_stopped_and_the_summary_still_comes(stubs):
    result, log, _ = _run(stubs, "quick", SLOW_SUITE="seed", SUITES="seed overhead", TESTS="none",
                          DEADLINE="16")  # seed gets what is left of 16 - 10 s, less than its 90
    assert result.returncode == 1
    assert 0 < _timeouts(log)[1] <= 6
    rows = _summary(result.stdout)[1]
    assert rows[2][0] == "seed" and rows[2][1:3] == ["124", "(timeout"]
    assert rows[3] == ["overhead", "-", "-", "skipped: no time left before DEADLINE=16"]


def test_suites_and_extra_arguments_from_the_environment(stubs):
    result, log, _ = _run(stubs, "quick", TESTS="none", SUITES="grid overhead frameworks",
                          BENCH_ARGS="--deterministic", OVERHEAD_ARGS="--calls 100",
                          FRAMEWORKS_ARGS="--no-jax --fwd-overlap")
    assert result.returncode == 0
    benches = [line for line in log if line.startswith("python3 -m cupyflash bench")]
    assert len(benches) == 3
    assert benches[0].endswith("--reps 10 --deterministic")  # BENCH_ARGS: the grid's, as before the suites
    assert benches[1].endswith("--reps 10 --calls 100")
    assert benches[2].endswith("--reps 10 --no-jax --fwd-overlap")


def test_decode_takes_its_arguments_and_what_is_left_before_the_deadline(stubs):
    """decode's limit is 90 s and DECODE_ARGS its extra arguments; last in quick, it gets what the
    stages before it leave before DEADLINE (quick's limits add up past it)."""
    result, log, _ = _run(stubs, "quick", TESTS="none", SUITES="decode", DECODE_ARGS="--part grid --batch 1")
    assert result.returncode == 0
    bench = next(line for line in log if line.startswith("python3 -m cupyflash bench"))
    assert bench.endswith("--suite decode --json " + str(stubs / "out" / "bench_decode.json")
                          + " --reps 10 --part grid --batch 1")
    assert _timeouts(log)[1] == 90
    result, log, _ = _run(stubs, "quick", TESTS="none", SUITES="decode", DEADLINE="40")
    assert result.returncode == 0
    assert 0 < _timeouts(log)[1] <= 30  # 40 - 10 s for the summary - the time already spent


def test_variants_runs_only_when_asked_for_with_its_limit_and_arguments(stubs):
    """variants is not among the default suites (the quick run above); SUITES=variants runs it
    under its 180 s limit with VARIANTS_ARGS, and its bars come into the summary."""
    result, log, out = _run(stubs, "quick", TESTS="none", SUITES="variants", VARIANTS_ARGS="--variant window")
    assert result.returncode == 0
    bench = next(line for line in log if line.startswith("python3 -m cupyflash bench"))
    assert bench.endswith("--suite variants --json " + str(out / "bench_variants.json")
                          + " --reps 10 --variant window")
    assert _timeouts(log)[1] == 180
    row = _summary(result.stdout)[1][2]
    assert row[:2] == ["variants", "0"] and row[3] == "2 results, bars: 3 PASS, 1 FAIL"
    assert sorted(p.name for p in out.iterdir()) == ["bench.txt", "bench_variants.json", "gpu.txt"]


def test_a_bad_mode_or_suite_is_refused(stubs):
    result, _, _ = _run(stubs, "fast")
    assert result.returncode == 2 and "mode must be quick or full; got 'fast'" in result.stderr
    result, _, _ = _run(stubs, "quick", TESTS="none", SUITES="grd")
    assert result.returncode == 1
    assert _summary(result.stdout)[1][2] == ["grd", "-", "-",
                                             "unknown suite (grid, seed, overhead, frameworks, decode, variants or bias)"]


def test_the_summary_reads_a_partial_json(stubs, tmp_path):
    """A suite stopped by its timeout leaves the JSON of the points it finished."""
    report = {"suite": "seed", "notes": ["torch SDPA columns skipped: x"], "results": [{}]}
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(report))
    start = "result=$(python3 - \"$OUT/bench_$suite.json\" <<'EOF'\n"
    snippet = SCRIPT.read_text().split(start)[1].split("\nEOF")[0]
    run = subprocess.run([sys.executable, "-", str(path)], input=snippet, capture_output=True, text=True,
                         check=True)
    assert run.stdout.strip() == "1 results, 1 notes"
    run = subprocess.run([sys.executable, "-", str(tmp_path / "missing.json")], input=snippet,
                         capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "no JSON (FileNotFoundError)"
