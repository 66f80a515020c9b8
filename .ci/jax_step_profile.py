"""Where a jitted JAX training step through ``cupyflash.jax.flash_attention`` spends its time.

Run on a GPU machine, from the repository root:

    python .ci/jax_step_profile.py [--shape B,S,H,D ...] [--dtype bfloat16|float16]
                                   [--no-causal] [--reps 200] [--profile-steps 50]

Defaults: the issue's two shapes, 8,128,12,64 and 4,1024,16,64, bfloat16, causal
self-attention.  The step is ``jax.jit(jax.grad(loss, argnums=(0, 1, 2)))`` with
``loss = attention(q, k, v).astype(float32).sum()``, in ms per step, timed two ways:

  pipelined  REPS steps queued back to back, one sync at the end: what a training
             loop sees, the larger of the host's and the GPU's time per step
  blocking   a sync after every step: host and GPU latency added up

for these variants of the attention:

  cudnn          jax.nn.dot_product_attention(implementation="cudnn")
  cupyflash      cupyflash.jax.flash_attention
  no-op cb       the same compiled step, its two callbacks patched to return at once:
                 what buffer_callback and the graph around it cost (results garbage)
  pointers only  callbacks that only read their buffers' device pointers and stream
  cmd buffer     traced with buffer_callback(command_buffer_compatible=True): XLA
                 records the callbacks into its CUDA graphs and replays them, calling
                 Python only when it re-records (new buffer addresses); needs
                 CUSTOM_CALL in --xla_gpu_enable_command_buffer (XLA_FLAGS)
  kernels        cupyflash's forward + backward kernels alone on CuPy arrays,
                 replayed as one CUDA graph: GPU time, no host cost

then, for cupyflash: Python callback calls per step, each callback's wall time per
call (measured inside XLA's call into Python), and a cProfile of the callbacks
(time per step, top functions).  The bar of the issue "Every call costs what its
kernels cost": the cupyflash step within 1.2x of the cudnn one.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

# XLA preallocates 75% of GPU memory by default; the kernels-only timing allocates in CuPy.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's cupyflash

import cupy as cp  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cupyflash  # noqa: E402
import cupyflash.jax as cfj  # noqa: E402

BUDGET = 1.2


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", action="append", default=None, help="B,S,H,D (repeatable)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--reps", type=int, default=200, help="steps per timing trial (5 trials, median)")
    p.add_argument("--profile-steps", type=int, default=50, help="steps under cProfile")
    args = p.parse_args()
    args.shape = [tuple(int(x) for x in s.split(",")) for s in (args.shape or ["8,128,12,64", "4,1024,16,64"])]
    return args


def make_step(attention, causal):
    def loss(q, k, v):
        return attention(q, k, v, causal).astype(jnp.float32).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def ours(q, k, v, causal):
    return cfj.flash_attention(q, k, v, causal=causal)


def cudnn(q, k, v, causal):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def timed(step, args, reps, trials=5):
    """(pipelined, blocking) ms per step: medians over ``trials`` runs of ``reps`` steps."""
    for _ in range(3):
        jax.block_until_ready(step(*args))
    pipelined, blocking = [], []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            result = step(*args)
        jax.block_until_ready(result)
        pipelined.append((time.perf_counter() - t) / reps)
        t = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(step(*args))
        blocking.append((time.perf_counter() - t) / reps)
    return statistics.median(pipelined) * 1e3, statistics.median(blocking) * 1e3


@contextlib.contextmanager
def callbacks(fwd, bwd):
    """cupyflash.jax's two callbacks replaced by ``fwd(real, self, ctx, outputs, *inputs)`` and
    ``bwd(...)``, ``real`` being the callback replaced.  Steps already compiled call them at
    once: XLA holds the callback objects, whose class is patched."""
    saved = {cls: cls.__call__ for cls in (cfj._Fwd, cfj._Bwd)}

    def install(cls, wrapper):
        real = saved[cls]

        def call(self, ctx, outputs, *inputs):
            wrapper(real, self, ctx, outputs, *inputs)

        cls.__call__ = call

    install(cfj._Fwd, fwd)
    install(cfj._Bwd, bwd)
    try:
        yield
    finally:
        for cls, real in saved.items():
            cls.__call__ = real


def noop(real, self, ctx, outputs, *inputs):
    pass


def pointers_only(real, self, ctx, outputs, *inputs):
    inputs[0].__dlpack_device__()
    for buffer in (*inputs, *outputs):
        cfj._pointer(buffer)
    ctx.stream  # noqa: B018 (the read is the point)


def kernels_ms(shape, dtype, causal, reps):
    """GPU ms of cupyflash's forward + backward on CuPy arrays, replayed as one CUDA graph
    (eagerly with events where capture fails: then host time may show too)."""
    rng = cp.random.default_rng(0)

    def draw():
        x = rng.standard_normal(shape, dtype=cp.float32)
        return (x.view(cp.uint32) >> 16).astype(cp.uint16) if dtype == "bfloat16" else x.astype(cp.float16)

    q, k, v, dout = (draw() for _ in range(4))
    kw = {"causal": causal, "dtype": "bfloat16" if dtype == "bfloat16" else None}

    def once():
        out, lse = cupyflash.flash_attn_fwd(q, k, v, **kw)
        cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, **kw)

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):
            once()
        stream.synchronize()
        try:
            stream.begin_capture()
            once()
            launch, how = stream.end_capture().launch, "graph"
        except Exception as exc:  # noqa: BLE001
            with contextlib.suppress(Exception):
                stream.end_capture()
            launch, how = once, f"eager ({type(exc).__name__})"
        launch()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(reps):
            launch()
        end.record()
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / reps, how


def callback_stats(step, args, steps):
    """Python callback calls per step, and µs per call of each callback (wall clock)."""
    times = {"fwd": [], "bwd": []}

    def clocked(kind):
        def call(real, self, ctx, outputs, *inputs):
            t = time.perf_counter_ns()
            real(self, ctx, outputs, *inputs)
            times[kind].append(time.perf_counter_ns() - t)
        return call

    with callbacks(clocked("fwd"), clocked("bwd")):
        for _ in range(steps):
            result = step(*args)
        jax.block_until_ready(result)
    calls = (len(times["fwd"]) + len(times["bwd"])) / steps
    us = {k: (statistics.median(t) / 1e3 if t else float("nan")) for k, t in times.items()}
    return calls, us


def profile(step, args, steps):
    """cProfile of the two callbacks over ``steps`` steps (enabled inside each call:
    XLA may call them from a thread of its own)."""
    prof = cProfile.Profile()

    def profiled(real, self, ctx, outputs, *inputs):
        prof.enable()
        try:
            real(self, ctx, outputs, *inputs)
        finally:
            prof.disable()

    with callbacks(profiled, profiled):
        for _ in range(steps):
            result = step(*args)
        jax.block_until_ready(result)
    stats = pstats.Stats(prof)
    lines = [f"  callbacks' Python time under cProfile (which inflates it): {stats.total_tt / steps * 1e6:.1f} "
             f"us per step; top functions by own time, per step:",
             f"  {'own us':>8}{'cum us':>9}{'calls':>7}  function"]
    top = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:14]
    for (filename, line, name), (_, ncalls, own, cum, _) in top:
        where = f"{Path(filename).name}:{line}({name})" if line else name
        lines.append(f"  {own / steps * 1e6:8.1f}{cum / steps * 1e6:9.1f}{ncalls / steps:7.1f}  {where}")
    return "\n".join(lines) + "\n"


def max_rel_diff(got, want):
    got, want = (np.asarray(x, np.float32) for x in (got, want))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def cmd_buffer_variant(causal, args, others, reference, reps):
    """The cupyflash step traced with ``command_buffer_compatible=True``: its timings (or
    None) and a note (Python calls per step, agreement with ``reference`` on ``others``)."""
    real = cfj._buffer_callback
    cfj._buffer_callback = functools.partial(real, command_buffer_compatible=True)
    jax.clear_caches()  # or JAX reuses the custom_vjp's traces, made without the option
    try:
        step = make_step(ours, causal)
        row = timed(step, args, reps)
        calls, _ = callback_stats(step, args, 20)
        err = max(max_rel_diff(a, b) for x, ref in zip(others, reference)
                  for a, b in zip(step(x, *args[1:]), ref))
        return row, (f"{calls:.2f} Python callback calls per step; gradients on {len(others)} inputs "
                     f"vs the plain step's: max rel. diff {err:.1e}")
    except Exception as exc:  # noqa: BLE001 (reported, not fatal)
        return None, f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        cfj._buffer_callback = real
        jax.clear_caches()


def run_shape(shape, dtype, causal, reps, profile_steps):
    b, s, h, d = shape
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, shape, dtype) for key in keys[:3])
    args, others = (q, k, v), (q, jax.random.normal(keys[3], shape, dtype))
    print(f"\n== B{b} S{s} H{h} D{d} {dtype} {'causal' if causal else 'full'} ==", flush=True)
    rows = {}
    step_cudnn, step_ours = make_step(cudnn, causal), make_step(ours, causal)
    rows["cudnn"] = timed(step_cudnn, args, reps)
    rows["cupyflash"] = timed(step_ours, args, reps)
    with callbacks(noop, noop):
        rows["no-op cb"] = timed(step_ours, args, reps)
    with callbacks(pointers_only, pointers_only):
        rows["pointers only"] = timed(step_ours, args, reps)
    calls, us = callback_stats(step_ours, args, 50)
    profiled = profile(step_ours, args, profile_steps)
    grad_err = [max_rel_diff(a, b) for a, b in zip(step_ours(*args), step_cudnn(*args))]
    reference = [step_ours(x, k, v) for x in others]
    cmd_row, cmd_note = cmd_buffer_variant(causal, args, others, reference, reps)
    if cmd_row is not None:
        rows["cmd buffer"] = cmd_row
    kernel_ms, how = kernels_ms(shape, dtype, causal, reps)

    base_p, base_b = rows["cudnn"]
    print(f"  {'variant':<15}{'pipelined ms':>13}{'blocking ms':>13}{'x cudnn':>9}{'(blocking)':>11}")
    for name, (p, bl) in rows.items():
        print(f"  {name:<15}{p:13.3f}{bl:13.3f}{p / base_p:9.2f}{bl / base_b:11.2f}")
    print(f"  {'kernels':<15}{kernel_ms:13.3f}{'':>13}{kernel_ms / base_p:9.2f}   ({how}, GPU time)")
    print(f"  cmd buffer: {cmd_note}")
    print("  cupyflash vs cudnn gradients, max rel. diff: "
          + ", ".join(f"{n} {e:.1e}" for n, e in zip(("dq", "dk", "dv"), grad_err)))
    print(f"  cupyflash callbacks: {calls:.2f} calls per step; wall time per call: "
          f"fwd {us['fwd']:.1f} us, bwd {us['bwd']:.1f} us (inside XLA's call into Python)")
    budget = BUDGET * base_p
    ours_p, noop_p = rows["cupyflash"][0], rows["no-op cb"][0]
    print(f"  bar: {BUDGET}x cudnn = {budget:.3f} ms/step (pipelined): cupyflash "
          f"{'within' if ours_p <= budget else 'OVER'} ({ours_p / base_p:.2f}x); buffer_callback alone "
          f"(no-op cb) {'fits' if noop_p <= budget else 'EXCEEDS THE BUDGET'} ({noop_p / base_p:.2f}x)")
    print(profiled, end="", flush=True)


def main():
    import jaxlib

    args = parse_args()
    dev = cp.cuda.Device()
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
          f"cupy {cp.__version__}, {cp.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; cupyflash from {Path(cupyflash.__file__).parent}")
    for shape in args.shape:
        run_shape(shape, args.dtype, args.causal, args.reps, args.profile_steps)


if __name__ == "__main__":
    main()
