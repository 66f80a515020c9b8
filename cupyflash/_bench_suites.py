"""The seed, overhead, frameworks and decode suites of ``python -m cupyflash bench``.

Each suite is ``run(cupy, args, report, save)``, which appends result dicts
to ``report["results"]`` (and notes to ``report["notes"]``) and calls
``save()`` after each, ``format_table(report) -> str`` and
``plot(report, path)``; :data:`SUITES` maps the names to them.  Everything
that does not need a GPU (tables, bars, error metrics, the float64
reference, the failure marks) takes plain values, so the tests run it with
fakes.

Failures are results: an out-of-memory error anywhere in an implementation's
measurement marks its remaining numbers ``"OOM"``, any other error
``"error"`` (with the message under ``<impl>_error``); the suite carries on.
A measurement not made on purpose (a point too large for --max-kv-gb) is
``"skipped"``, with the reason.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import math
import os
import statistics
import sys
import time

import numpy as np

from . import bench, reference

OOM = "OOM"
ERROR = "error"
SKIPPED = "skipped"

# ----------------------------------------------------------------------------
# Shared: failures, numbers in cells, error metrics, the float64 reference
# ----------------------------------------------------------------------------


def is_oom(exc) -> bool:
    """Whether ``exc`` is an out-of-memory error (torch's, cupy's, cuBLAS/cuDNN's or XLA's)."""
    text = str(exc)
    return ("OutOfMemory" in type(exc).__name__ or "out of memory" in text.lower()
            or "ALLOC_FAILED" in text or "RESOURCE_EXHAUSTED" in text)


def mark_failed(res, name, keys, exc) -> None:
    """Record a failed measurement: every key of ``keys`` not yet in ``res`` becomes
    ``"OOM"`` (out of memory) or ``"error"``, and ``res[name + "_error"]`` the message."""
    marker = OOM if is_oom(exc) else ERROR
    for key in keys:
        res.setdefault(key, marker)
    res.setdefault(f"{name}_error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def ratio(numerator, denominator):
    """``numerator / denominator`` when both are measured numbers, else None."""
    if _number(numerator) and _number(denominator) and denominator > 0:
        return numerator / denominator
    return None


def cell(value, width, spec) -> str:
    """A right-aligned table cell: a number in ``spec``, a marker ("OOM") as is, None as "-"."""
    if value is None:
        text = "-"
    elif _number(value):
        text = format(value, spec)
    else:
        text = str(value)
    return f"{text:>{width}}"


def error_metrics(xp, actual, ref) -> tuple[float, float]:
    """Max abs error and relative L2 error of ``actual`` against ``ref``, in float64.

    Parameters
    ----------
    xp : module
        numpy or cupy, the module of the arrays.
    actual : array
        Any float dtype; compared in float64.
    ref : array, float64, shape of ``actual``

    Returns
    -------
    max_abs : float
        ``max |actual - ref|`` (NaN if ``actual`` holds a NaN).
    rel_l2 : float
        ``||actual - ref||_2 / ||ref||_2`` over all elements; 0 when both are
        zero, inf when only ``ref`` is.
    """
    diff = actual.astype(xp.float64) - ref
    max_abs = float(xp.max(xp.abs(diff)))
    norm = float(xp.sqrt(xp.sum(ref * ref)))
    err = float(xp.sqrt(xp.sum(diff * diff)))
    return max_abs, (err / norm if norm > 0 else (0.0 if err == 0 else math.inf))


def reference_attention(xp, q, k, v, dout, *, softmax_scale, causal, max_scores=1 << 27):
    """float64 ``out``, ``dq``, ``dk``, ``dv`` of exact attention, on the arrays' device.

    The textbook formulas (softmax, then its Jacobian) in float64, a few heads
    at a time so that at most ``max_scores`` scores are held per matrix; with
    ``xp = cupy`` the reference for a long sequence takes milliseconds where
    :mod:`cupyflash.reference` (host, all heads at once) would take minutes.
    Same masking contract as :func:`cupyflash.flash_attn_fwd` (causal aligned
    bottom-right; a row that sees no key gives 0).

    Parameters
    ----------
    xp : module
        numpy or cupy, the module of the arrays.
    q, dout : array, shape (batch, seqlen_q, nheads, head_dim)
    k, v : array, shape (batch, seqlen_k, nheads, head_dim)
        As many heads as q (no GQA).
    softmax_scale : float
    causal : bool
    max_scores : int, optional
        Scores per chunk of heads (2**27 float64: 1 GiB per matrix).

    Returns
    -------
    dict
        ``{"out", "dq", "dk", "dv"}``, float64, in the inputs' layout.
    """
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    if k.shape[2] != nheads:
        raise ValueError(f"reference_attention takes as many KV heads as query heads; "
                         f"got {k.shape[2]} and {nheads}")
    visible = xp.asarray(reference.visible_keys(seqlen_q, seqlen_k, causal))
    out, dq, dk, dv = (xp.empty(x.shape, dtype=xp.float64) for x in (q, q, k, v))
    step = max(1, max_scores // max(1, seqlen_q * seqlen_k))
    for b in range(batch):
        for h in range(0, nheads, step):
            heads = slice(h, h + step)
            qh, kh, vh, doh = (x[b, :, heads].astype(xp.float64).transpose(1, 0, 2)
                               for x in (q, k, v, dout))
            scores = xp.where(visible, (qh @ kh.transpose(0, 2, 1)) * softmax_scale, -xp.inf)
            row_max = scores.max(axis=-1, keepdims=True)
            p = xp.exp(scores - xp.where(xp.isfinite(row_max), row_max, 0.0))
            del scores
            total = p.sum(axis=-1, keepdims=True)
            p /= xp.where(total > 0, total, 1.0)
            o = p @ vh
            ds = p * (doh @ vh.transpose(0, 2, 1) - (doh * o).sum(axis=-1, keepdims=True))
            out[b, :, heads] = o.transpose(1, 0, 2)
            dq[b, :, heads] = ((ds @ kh) * softmax_scale).transpose(1, 0, 2)
            dk[b, :, heads] = ((ds.transpose(0, 2, 1) @ qh) * softmax_scale).transpose(1, 0, 2)
            dv[b, :, heads] = (p.transpose(0, 2, 1) @ doh).transpose(1, 0, 2)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


# ----------------------------------------------------------------------------
# Peak extra device memory, one method for every implementation
# ----------------------------------------------------------------------------


class TorchPeak:
    """Peak extra memory of a call from torch's caching-allocator counters.

    While the call runs, cupy allocates through torch's allocator (each cupy
    allocation is a torch uint8 tensor), so cupyflash's buffers and torch's
    are counted by the same counter: ``max_memory_allocated()`` after the call
    minus ``memory_allocated()`` before it, after ``reset_peak_memory_stats()``.
    The inputs exist before the call and are not counted; what the call
    returns (out, lse, the autograd graph, the gradients) is.
    """

    label = "torch's allocator counters, cupy's allocations routed through torch's allocator"
    method = ("torch.cuda.max_memory_allocated() during the call minus memory_allocated() before "
              "(reset_peak_memory_stats), with cupy's allocations routed through torch's caching "
              "allocator so cupyflash and torch are counted alike")

    def __init__(self, torch, cupy):
        self.torch, self.cupy = torch, cupy

    def _malloc(self, size):
        buf = self.torch.empty(size, dtype=self.torch.uint8, device=f"cuda:{self.cupy.cuda.Device().id}")
        return self.cupy.cuda.MemoryPointer(self.cupy.cuda.UnownedMemory(buf.data_ptr(), size, buf), 0)

    def peak_extra(self, fn):
        """``(fn(), peak extra bytes)``."""
        torch = self.torch
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with self.cupy.cuda.using_allocator(self._malloc):
            result = fn()
            torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - base

    def release(self):
        self.torch.cuda.empty_cache()
        self.cupy.get_default_memory_pool().free_all_blocks()


class CupyPeak:
    """Peak extra memory of a call from a cupy memory hook (when torch is not measured).

    The peak, during the call, of the bytes cupy's memory pool has handed out
    since the call began (``malloc`` adds a block's size, ``free`` takes it off).
    """

    label = "a cupy memory hook"
    method = "peak of cupy's memory-pool blocks handed out during the call (a cupy MemoryHook)"

    def __init__(self, cupy):
        from cupy.cuda import memory_hook  # noqa: PLC0415

        class PeakHook(memory_hook.MemoryHook):
            name = "cupyflash_bench_peak"

            def __init__(self):
                self.current = self.peak = 0

            def malloc_postprocess(self, **kwargs):
                self.current += kwargs["mem_size"]
                self.peak = max(self.peak, self.current)

            def free_postprocess(self, **kwargs):
                self.current -= kwargs["mem_size"]

        self.cupy, self._hook = cupy, PeakHook

    def peak_extra(self, fn):
        """``(fn(), peak extra bytes)``."""
        hook = self._hook()
        self.cupy.cuda.get_current_stream().synchronize()
        with hook:
            result = fn()
            self.cupy.cuda.get_current_stream().synchronize()
        return result, hook.peak

    def release(self):
        self.cupy.get_default_memory_pool().free_all_blocks()


# ----------------------------------------------------------------------------
# --suite seed
# ----------------------------------------------------------------------------

SEED_CONFIG = {"batch": 1, "nheads": 32, "head_dim": 128, "causal": True, "dtype": "float16"}
SEED_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
#: Errors against the float64 reference are measured up to this seqlen.
ERROR_MAX_SEQLEN = 4096
TENSORS = ("out", "dq", "dk", "dv")
SDPA_BACKENDS = (("fa2", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("math", "MATH"))


class Ours:
    """cupyflash on cupy arrays: ``flash_attn_fwd`` and ``flash_attn_bwd``, cupy events."""

    name = "ours"

    def __init__(self, cupy, causal):
        import cupyflash  # noqa: PLC0415

        self.cupy, self.causal, self.lib = cupy, causal, cupyflash

    def context(self):
        return contextlib.nullcontext()

    def prepare(self, inputs):
        return inputs

    def forward(self, state):
        q, k, v, _ = state
        return self.lib.flash_attn_fwd(q, k, v, causal=self.causal)

    forward_timed = forward

    def output(self, fwd):
        return fwd[0]

    def backward(self, state, fwd):
        q, k, v, dout = state
        return self.lib.flash_attn_bwd(dout, q, k, v, *fwd, causal=self.causal)

    def time_ms(self, fn, reps):
        return bench._time_ms(fn, reps, self.cupy)  # noqa: SLF001

    def to_xp(self, x):
        return x


class Sdpa:
    """torch SDPA with one backend, on (B, H, S, D) views of the same memory; torch events.

    The forward is timed on tensors that do not require grad; the forward
    whose memory is measured, and whose graph the timed backward
    (``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``) runs,
    is the training one on leaves that do.
    """

    def __init__(self, env, cupy, name, backend, *, causal, dtype):
        self.torch, backends, self.sdpa_kernel = env
        self.cupy, self.name, self.causal, self.dtype = cupy, name, causal, dtype
        self.backend = getattr(backends, backend)
        self.sdpa = self.torch.nn.functional.scaled_dot_product_attention

    def context(self):
        return self.sdpa_kernel(self.backend)

    def prepare(self, inputs):
        q, k, v, dout = (bench.torch_view(self.torch, self.cupy, x, self.dtype).transpose(1, 2)
                         for x in inputs)
        return (q, k, v), tuple(x.detach().requires_grad_() for x in (q, k, v)), dout

    def forward(self, state):
        return self.sdpa(*state[1], is_causal=self.causal)

    def forward_timed(self, state):
        return self.sdpa(*state[0], is_causal=self.causal)

    def output(self, fwd):
        return fwd.transpose(1, 2)

    def backward(self, state, fwd):
        _, leaves, dout = state
        grads = self.torch.autograd.grad(fwd, leaves, dout, retain_graph=True)
        return tuple(g.transpose(1, 2) for g in grads)

    def time_ms(self, fn, reps):
        return bench._torch_time_ms(fn, reps, self.torch)  # noqa: SLF001

    def to_xp(self, x):
        return self.cupy.from_dlpack(x.detach())  # torch exports no tensor that requires grad


def _error_keys(name, tensors):
    return [f"{name}_{t}_{m}" for t in tensors for m in ("max_abs", "rel_l2")]


def _record_errors(res, name, tensors, arrays, ref, xp):
    for t, a in zip(tensors, arrays):
        res[f"{name}_{t}_max_abs"], res[f"{name}_{t}_rel_l2"] = error_metrics(xp, a, ref[t])


def measure_impl(impl, sets, res, *, reps, memory, ref, xp):
    """Latency, peak extra memory and (with ``ref``) errors of one implementation, into ``res``.

    Memory and errors come from the first input set, after one unmeasured
    call of the pass (so one-time allocations, compiles and workspaces made on
    first use, stay out); the times rotate through all the sets.  A failure
    marks what it left unmeasured (:func:`mark_failed`); a failed forward
    leaves the backward unmeasured too.

    Parameters
    ----------
    impl : Ours, Sdpa or alike
        ``name``, ``context()``, ``prepare(inputs)``, ``forward(state)``,
        ``forward_timed(state)``, ``output(fwd)``, ``backward(state, fwd)``,
        ``time_ms(fn, reps)`` and ``to_xp(x)``.
    sets : list of tuple
        ``(q, k, v, dout)`` arrays, shape (batch, seqlen, nheads, head_dim).
    res : dict
        Receives ``<name>_fwd_ms``, ``<name>_bwd_ms``,
        ``<name>_fwd_extra_bytes``, ``<name>_bwd_extra_bytes`` and, with
        ``ref``, ``<name>_<out|dq|dk|dv>_<max_abs|rel_l2>``.
    reps : int
        Timed repetitions per pass.
    memory : TorchPeak or CupyPeak
        ``peak_extra(fn) -> (fn(), bytes)``.
    ref : dict or None
        :func:`reference_attention` of the first set.
    xp : module
        The module of the arrays ``to_xp`` returns and of ``ref``.
    """
    name = impl.name
    fwd_keys = [f"{name}_fwd_ms", f"{name}_fwd_extra_bytes"] + (_error_keys(name, TENSORS[:1]) if ref else [])
    bwd_keys = [f"{name}_bwd_ms", f"{name}_bwd_extra_bytes"] + (_error_keys(name, TENSORS[1:]) if ref else [])
    with impl.context():
        try:
            states = [impl.prepare(s) for s in sets]
            impl.forward(states[0])
            first, res[f"{name}_fwd_extra_bytes"] = memory.peak_extra(lambda: impl.forward(states[0]))
            if ref:
                _record_errors(res, name, TENSORS[:1], [impl.to_xp(impl.output(first))], ref, xp)
            res[f"{name}_fwd_ms"] = impl.time_ms(
                bench._rotating([functools.partial(impl.forward_timed, s) for s in states]), reps)  # noqa: SLF001
            fwds = [first] + [impl.forward(s) for s in states[1:]]
        except Exception as e:  # noqa: BLE001 - OOM or a refusal is a result
            mark_failed(res, name, fwd_keys + bwd_keys, e)
            return
        try:
            impl.backward(states[0], fwds[0])
            grads, res[f"{name}_bwd_extra_bytes"] = memory.peak_extra(lambda: impl.backward(states[0], fwds[0]))
            if ref:
                _record_errors(res, name, TENSORS[1:], [impl.to_xp(g) for g in grads], ref, xp)
            del grads
            res[f"{name}_bwd_ms"] = impl.time_ms(
                bench._rotating([functools.partial(impl.backward, s, f)  # noqa: SLF001
                                 for s, f in zip(states, fwds)]), reps)
        except Exception as e:  # noqa: BLE001
            mark_failed(res, name, bwd_keys, e)


def add_ratios(res, others):
    """``ratio_<fwd|bwd>_vs_<other>`` = other's time / ours (> 1: ours faster), where both were measured."""
    for other in others:
        for pas in ("fwd", "bwd"):
            r = ratio(res.get(f"{other}_{pas}_ms"), res.get(f"ours_{pas}_ms"))
            if r is not None:
                res[f"ratio_{pas}_vs_{other}"] = r


def seed_point(cupy, impls, memory, *, seqlen, reps):
    """One seqlen of the seed suite: every implementation on the same input sets."""
    cfg = SEED_CONFIG
    shape = (cfg["batch"], seqlen, cfg["nheads"], cfg["head_dim"])
    count = bench.rotation_count(bench.set_bytes(shape))
    sets = bench.input_sets(cupy, shape, cfg["dtype"], count)
    res = {"seqlen": seqlen, **cfg, "input_sets": count}
    ref = None
    if seqlen <= ERROR_MAX_SEQLEN:
        try:
            ref = reference_attention(cupy, *sets[0], softmax_scale=cfg["head_dim"] ** -0.5,
                                      causal=cfg["causal"])
        except Exception as e:  # noqa: BLE001
            mark_failed(res, "reference", [], e)
        memory.release()
    for impl in impls:
        measure_impl(impl, sets, res, reps=reps, memory=memory, ref=ref, xp=cupy)
        memory.release()
    add_ratios(res, [impl.name for impl in impls[1:]])
    return res


def run_seed(cupy, args, report, save):
    """``--suite seed``: ours beside SDPA's flash, cuDNN and math backends, per seqlen."""
    env, why = (None, "--no-torch") if args.no_torch else bench.torch_env()
    impls = [Ours(cupy, SEED_CONFIG["causal"])]
    if env is None:
        report["notes"].append(f"torch SDPA columns skipped: {why}")
        memory = CupyPeak(cupy)
    else:
        impls += [Sdpa(env, cupy, name, backend, causal=SEED_CONFIG["causal"], dtype=SEED_CONFIG["dtype"])
                  for name, backend in SDPA_BACKENDS]
        memory = TorchPeak(env[0], cupy)
    report.update(config=SEED_CONFIG, impls=[impl.name for impl in impls], memory_method=memory.method,
                  memory_label=memory.label, error_max_seqlen=ERROR_MAX_SEQLEN)
    seqlens = args.seqlen or SEED_SEQLENS
    for i, seqlen in enumerate(seqlens):
        res = seed_point(cupy, impls, memory, seqlen=seqlen, reps=args.reps)
        report["results"].append(res)
        save()
        print(f"[{i + 1}/{len(seqlens)}] seed S={seqlen}: " + "; ".join(
            f"{impl.name} fwd {cell(res.get(impl.name + '_fwd_ms'), 0, '.3f')} ms "
            f"bwd {cell(res.get(impl.name + '_bwd_ms'), 0, '.3f')} ms" for impl in impls),
            file=sys.stderr, flush=True)


def format_seed_table(report) -> str:
    """Latency and ratios, peak extra memory, and errors (seqlen <= ERROR_MAX_SEQLEN)."""
    impls, cfg, rows = report["impls"], report["config"], report["results"]
    others = impls[1:]
    lines = [f"seed: batch {cfg['batch']}, nheads {cfg['nheads']}, head_dim {cfg['head_dim']}, "
             f"{'causal' if cfg['causal'] else 'non-causal'}, {cfg['dtype']}; "
             f"x NAME = NAME's time / ours (>1: ours faster)",
             f"{'seqlen':>6} |" + "".join(
                 f" {pas} ms" + "".join(f"{i:>8}" for i in impls) + " |"
                 + "".join(f"{'x ' + o:>8}" for o in others) + " |" for pas in ("fwd", "bwd"))]
    for r in rows:
        lines.append(f"{r['seqlen']:6d} |" + "".join(
            "       " + "".join(cell(r.get(f"{i}_{pas}_ms"), 8, ".3f") for i in impls) + " |"
            + "".join(cell(r.get(f"ratio_{pas}_vs_{o}"), 8, ".2f") for o in others) + " |"
            for pas in ("fwd", "bwd")))
    lines += ["", "peak extra device memory beyond the inputs, MiB (" + report["memory_label"] + ")",
              f"{'seqlen':>6} |" + "".join(f" {pas} MiB" + "".join(f"{i:>8}" for i in impls) + " |"
                                           for pas in ("fwd", "bwd"))]
    for r in rows:
        lines.append(f"{r['seqlen']:6d} |" + "".join(
            "        " + "".join(cell(_mib(r.get(f"{i}_{pas}_extra_bytes")), 8, ".1f") for i in impls) + " |"
            for pas in ("fwd", "bwd")))
    checked = [r for r in rows if r["seqlen"] <= report["error_max_seqlen"]]
    if checked:
        lines += ["", f"errors against the float64 reference (max abs, relative L2); 'ours <= fa2': "
                      f"how many of ours' {2 * len(TENSORS)} are at most FA2's",
                  f"{'seqlen':>6} {'impl':<6}|" + "".join(f"{t + ' max':>9}{'rel':>9} |" for t in TENSORS)
                  + (" ours <= fa2" if "fa2" in impls else "")]
        for r in checked:
            for i in impls:
                line = f"{r['seqlen']:6d} {i:<6}|" + "".join(
                    cell(r.get(f"{i}_{t}_max_abs"), 9, ".1e") + cell(r.get(f"{i}_{t}_rel_l2"), 9, ".1e") + " |"
                    for t in TENSORS)
                if i == "ours" and "fa2" in impls:
                    line += f" {errors_not_above(r, 'ours', 'fa2')}"
                lines.append(line)
    return "\n".join(lines)


def _mib(value):
    return value / 2**20 if _number(value) else value


def errors_not_above(res, name, other) -> str:
    """``"k/n"``: of the n error metrics both have, how many of ``name``'s are <= ``other``'s."""
    pairs = [(res.get(k), res.get(k.replace(name, other, 1))) for k in _error_keys(name, TENSORS)]
    pairs = [(a, b) for a, b in pairs if _number(a) and _number(b)]
    return f"{sum(a <= b for a, b in pairs)}/{len(pairs)}" if pairs else "-"


def plot_seed(report, path):
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, pas in zip(axes, ("fwd", "bwd")):
        for impl in report["impls"]:
            pts = [(r["seqlen"], r[f"{impl}_{pas}_ms"]) for r in report["results"]
                   if _number(r.get(f"{impl}_{pas}_ms"))]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="seqlen", ylabel=f"{pas} ms", title=f"seed {pas}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


# ----------------------------------------------------------------------------
# --suite overhead
# ----------------------------------------------------------------------------

OVERHEAD_SHAPES = (((1, 128, 8, 64), "float16"), ((1, 128, 8, 64), "bfloat16"), ((1, 512, 32, 128), "float16"))
OVERHEAD_CALLS = 300
#: Calls queued behind the spin kernel for the GPU time (well below CUDA's queue of pending launches).
GPU_CALLS = 50
#: Host microseconds per call each API must stay within (rows not listed have no bar).
BARS_US = {("cupy", "fwd"): 10.0, ("cupy", "bwd"): 20.0, ("torch", "fwd"): 20.0, ("torch", "bwd"): 35.0,
           ("flash_attn_func", "fwd"): 20.0, ("flash_attn_func", "bwd"): 35.0}

_SPIN_SOURCE = r"""
extern "C" __global__ void cupyflash_bench_spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""

Row = collections.namedtuple("Row", "api pass_ kind context build")
Row.__doc__ = """One overhead measurement: ``build()`` (inside ``context()``) returns the call;
``kind`` ("cupy" or "torch") picks the events and stream it is timed with."""


def per_call_us(fn, *, calls, batches, synchronize, warmup_ms=100.0):
    """Microseconds per call of ``fn`` called back to back, by the host's clock.

    Parameters
    ----------
    fn : callable
        One call (launches GPU work and returns without waiting for it).
    calls : int
        Calls per batch, with no synchronisation between them.
    batches : int
        Batches; each starts after a synchronize and ends with one.
    synchronize : callable
        Waits for the GPU.
    warmup_ms : float, optional
        Warm-up as :func:`cupyflash.bench._time_ms` (at least 3 calls and this long).

    Returns
    -------
    wall : float
        Median over batches of (time to the synchronize after the last call) / calls.
    host : float
        The same up to the last call's return: the host's own cost per call
        when the GPU keeps up.
    """
    bench._warm_up(fn, synchronize, warmup_ms)  # noqa: SLF001
    wall, host = [], []
    for _ in range(batches):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return statistics.median(wall), statistics.median(host)


def gpu_us_per_call(fn, *, calls, host_us, spin, new_event, elapsed_ms, repeats=5):
    """GPU microseconds per call, free of the host's launch gaps.

    A spin kernel holds the stream (twice the host time of ``calls`` calls,
    plus 1 ms) while the calls queue behind it; the events around them then
    time the GPU running them back to back.

    Parameters
    ----------
    fn : callable
        One call, on the stream ``spin`` and the events use.
    calls : int
        Calls queued per repeat (few enough for CUDA's queue of pending launches).
    host_us : float
        The host's time per call (:func:`per_call_us`), to size the spin.
    spin : callable
        ``spin(ns)`` launches a kernel that runs for ``ns`` nanoseconds.
    new_event, elapsed_ms : callable
        A timing event with ``record()`` and ``synchronize()``; milliseconds between two.
    repeats : int, optional

    Returns
    -------
    float
        Median over ``repeats`` of the events' interval / calls, in microseconds.
    """
    spin_ns = int(2e3 * calls * host_us) + 1_000_000
    times = []
    for _ in range(repeats):
        start, stop = new_event(), new_event()
        spin(spin_ns)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(elapsed_ms(start, stop) * 1e3 / calls)
    return statistics.median(times)


def regime(host_us, gpu_us) -> str:
    """"host-bound" when the host's time per call exceeds the GPU's, else "GPU-bound"."""
    return "host-bound" if host_us > gpu_us else "GPU-bound"


def bar_status(wall_us, bar_us, regime_) -> str:
    """PASS/FAIL of ``wall_us`` against the bar; "-" without a bar, "n/a" when GPU-bound
    (the GPU's own time, not the host's, sets the wall time there)."""
    if bar_us is None:
        return "-"
    if regime_ != "host-bound":
        return "n/a"
    return "PASS" if wall_us <= bar_us else "FAIL"


def overhead_rows(cupy, env, dtype, sets):
    """The calls measured for one shape: cupy arrays, torch tensors, flash_attn_func, SDPA (FA2)."""
    import cupyflash  # noqa: PLC0415

    none = contextlib.nullcontext
    fwd = [functools.partial(cupyflash.flash_attn_fwd, q, k, v, dtype=dtype) for q, k, v, _ in sets]

    def cupy_bwd():
        calls = [functools.partial(cupyflash.flash_attn_bwd, s[3], s[0], s[1], s[2], *f(), dtype=dtype)
                 for s, f in zip(sets, fwd)]
        return bench._rotating(calls)  # noqa: SLF001

    rows = [Row("cupy", "fwd", "cupy", none, lambda: bench._rotating(fwd)),  # noqa: SLF001
            Row("cupy", "bwd", "cupy", none, cupy_bwd)]
    if env is None:
        return rows
    torch, backends, sdpa_kernel = env
    from . import torch as cupyflash_torch  # noqa: PLC0415

    tsets = [tuple(bench.torch_view(torch, cupy, x, dtype) for x in s) for s in sets]
    tfwd = [functools.partial(cupyflash.flash_attn_fwd, *t[:3]) for t in tsets]

    def torch_bwd():
        return bench._rotating([functools.partial(cupyflash.flash_attn_bwd, t[3], *t[:3], *f())  # noqa: SLF001
                                for t, f in zip(tsets, tfwd)])

    def leaves(t):
        return tuple(x.detach().requires_grad_() for x in t[:3])

    def step(attn, inputs, grad):
        return torch.autograd.grad(attn(*inputs), inputs, grad)

    def autograd_rows(api, attn, layout, context):
        views = [tuple(layout(x) for x in t) for t in tsets]

        def bwd():
            calls = []
            for v in views:
                inputs = leaves(v)
                calls.append(functools.partial(torch.autograd.grad, attn(*inputs), inputs, v[3],
                                               retain_graph=True))
            return bench._rotating(calls)  # noqa: SLF001

        return [Row(api, "fwd", "torch", context,
                    lambda: bench._rotating([functools.partial(attn, *v[:3]) for v in views])),  # noqa: SLF001
                Row(api, "bwd", "torch", context, bwd),
                Row(api, "fwd+bwd", "torch", context,
                    lambda: bench._rotating([functools.partial(step, attn, leaves(v), v[3])  # noqa: SLF001
                                             for v in views]))]

    return (rows
            + [Row("torch", "fwd", "torch", none, lambda: bench._rotating(tfwd)),  # noqa: SLF001
               Row("torch", "bwd", "torch", none, torch_bwd)]
            + autograd_rows("flash_attn_func", cupyflash_torch.flash_attn_func, lambda x: x, none)
            + autograd_rows("sdpa fa2", torch.nn.functional.scaled_dot_product_attention,
                            lambda x: x.transpose(1, 2), lambda: sdpa_kernel(backends.FLASH_ATTENTION)))


class _Clocks:
    """Synchronisation, events and the spin kernel for cupy calls and for torch calls."""

    def __init__(self, cupy, env):
        self.cupy, self.torch = cupy, env[0] if env else None
        self.kernel = cupy.RawKernel(_SPIN_SOURCE, "cupyflash_bench_spin")
        self.spin(cupy.cuda.get_current_stream(), 1000)  # compile it now, not while timing

    def spin(self, stream, ns):
        with stream:
            self.kernel((1,), (1,), (np.uint64(ns),))

    def of(self, kind):
        """``(synchronize, new_event, elapsed_ms, spin(ns))`` for calls of ``kind``."""
        cupy, torch = self.cupy, self.torch
        if kind == "cupy":
            stream = cupy.cuda.get_current_stream()
            return (stream.synchronize, cupy.cuda.Event, cupy.cuda.get_elapsed_time,
                    functools.partial(self.spin, stream))
        ptr = torch.cuda.current_stream().cuda_stream
        stream = cupy.cuda.Stream.null if ptr == 0 else cupy.cuda.ExternalStream(ptr)
        return (torch.cuda.synchronize, lambda: torch.cuda.Event(enable_timing=True),
                lambda start, stop: start.elapsed_time(stop), functools.partial(self.spin, stream))


def measure_row(row, clocks, *, calls, batches):
    """Wall, host, isolated (cupyx.profiler.benchmark cpu_times) and GPU microseconds of one row."""
    from cupyx.profiler import benchmark  # noqa: PLC0415

    synchronize, new_event, elapsed_ms, spin = clocks.of(row.kind)
    with row.context():
        fn = row.build()
        wall, host = per_call_us(fn, calls=calls, batches=batches, synchronize=synchronize)
        gpu = gpu_us_per_call(fn, calls=GPU_CALLS, host_us=host, spin=spin, new_event=new_event,
                              elapsed_ms=elapsed_ms)
        isolated = float(np.median(benchmark(fn, n_repeat=calls, n_warmup=10,
                                             name=f"{row.api} {row.pass_}").cpu_times)) * 1e6
    return {"wall_us": wall, "host_us": host, "cpu_times_us": isolated, "gpu_us": gpu,
            "regime": regime(host, gpu)}


def run_overhead(cupy, args, report, save):
    """``--suite overhead``: host microseconds per call on tiny shapes, with bars."""
    env, why = (None, "--no-torch") if args.no_torch else bench.torch_env()
    if why:
        report["notes"].append(f"torch rows skipped: {why}")
    calls = args.calls or OVERHEAD_CALLS
    report.update(calls=calls, batches=args.reps, gpu_calls=GPU_CALLS, bars_us={
        f"{api} {pas}": bar for (api, pas), bar in BARS_US.items()})
    clocks = _Clocks(cupy, env)
    for shape, dtype in OVERHEAD_SHAPES:
        count = bench.rotation_count(bench.set_bytes(shape))
        sets = bench.input_sets(cupy, shape, dtype, count)
        for row in overhead_rows(cupy, env, dtype, sets):
            res = {"shape": list(shape), "dtype": dtype, "api": row.api, "pass": row.pass_,
                   "input_sets": count, "bar_us": BARS_US.get((row.api, row.pass_))}
            try:
                res.update(measure_row(row, clocks, calls=calls, batches=args.reps))
                res["status"] = bar_status(res["wall_us"], res["bar_us"], res["regime"])
            except Exception as e:  # noqa: BLE001 - an error is a result
                mark_failed(res, "row", ["status"], e)
            report["results"].append(res)
            save()
            print(f"overhead {_shape_text(shape)} {dtype} {row.api} {row.pass_}: "
                  f"wall {cell(res.get('wall_us'), 0, '.1f')} us, GPU {cell(res.get('gpu_us'), 0, '.1f')} us "
                  f"{res['status']}", file=sys.stderr, flush=True)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    report["bars"] = count_statuses(report["results"])


def count_statuses(results) -> dict[str, int]:
    """How many results PASS, FAIL, are "n/a", ended in an error/OOM or were skipped."""
    counts = collections.Counter(r.get("status") for r in results)
    return {s: counts[s] for s in ("PASS", "FAIL", "n/a", ERROR, OOM, SKIPPED) if counts[s]}


_SHORT_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


def _shape_text(shape):
    return "x".join(str(n) for n in shape)


def _bars_line(report):
    bars = report.get("bars") or {}
    return "bars: " + (", ".join(f"{n} {s}" for s, n in bars.items()) if bars else "none judged")


def format_overhead_table(report) -> str:
    """One line per (shape, dtype, call): the four times, the regime and the bar."""
    lines = [f"overhead: us per call. wall/host: {report['calls']} back-to-back calls, median of "
             f"{report['batches']} batches (host: before the final synchronize);",
             f"isolated: cupyx.profiler.benchmark cpu_times; GPU: events around {report['gpu_calls']} "
             f"calls queued behind a spin kernel",
             f"{'shape':<13}{'dtype':<6}{'api':<16}{'pass':<8}{'wall':>8}{'host':>8}{'isolated':>9}"
             f"{'GPU':>8}  {'regime':<11}{'bar':>5}  status"]
    for r in report["results"]:
        lines.append(f"{_shape_text(r['shape']):<13}{_SHORT_DTYPES[r['dtype']]:<6}{r['api']:<16}{r['pass']:<8}"
                     + cell(r.get("wall_us"), 8, ".1f") + cell(r.get("host_us"), 8, ".1f")
                     + cell(r.get("cpu_times_us"), 9, ".1f") + cell(r.get("gpu_us"), 8, ".1f")
                     + f"  {r.get('regime', '-'):<11}" + cell(r.get("bar_us"), 5, ".0f")
                     + f"  {r['status']}")
    lines.append(_bars_line(report))
    return "\n".join(lines)


def plot_overhead(report, path):
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    groups = list(dict.fromkeys((tuple(r["shape"]), r["dtype"]) for r in report["results"]))
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (shape, dtype) in zip(axes[0], groups):
        rows = [r for r in report["results"] if (tuple(r["shape"]), r["dtype"]) == (shape, dtype)
                and _number(r.get("wall_us"))]
        labels = [f"{r['api']} {r['pass']}" for r in rows]
        ax.barh(labels, [r["wall_us"] for r in rows], label="wall")
        ax.scatter([r["gpu_us"] for r in rows], labels, color="k", zorder=3, label="GPU")
        ax.invert_yaxis()
        ax.set(xlabel="us per call", title=f"{_shape_text(shape)} {dtype}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


# ----------------------------------------------------------------------------
# --suite frameworks
# ----------------------------------------------------------------------------

TORCH_STEP_SHAPES = ((8, 128, 12, 64), (4, 1024, 16, 64), (2, 2048, 16, 128), (2, 4096, 32, 128))
JAX_STEP_SHAPES = ((8, 128, 12, 64), (4, 1024, 16, 64))
#: Implementations beside ours, per framework.
STEP_IMPLS = {"torch": ("fa2", "cudnn"), "jax": ("cudnn", "xla")}
JAX_STEPS_PER_BATCH = 10


def step_bar(framework, seqlen):
    """``(reference, limit, strict)``: ours' step time must be <= ``limit`` x the reference's
    (< when ``strict``); None where no bar is set."""
    if framework == "torch":
        return ("fa2", 1.1, False) if seqlen < 2048 else ("fa2", 1.0, True)
    if seqlen < 2048:
        return ("cudnn", 1.2, False)
    return None


def step_status(ours_ms, ref_ms, limit, strict) -> str:
    """PASS/FAIL of ours' time against ``limit`` x the reference's; "n/a" unless both were measured."""
    if not (_number(ours_ms) and _number(ref_ms)):
        return "n/a"
    ok = ours_ms < limit * ref_ms if strict else ours_ms <= limit * ref_ms
    return "PASS" if ok else "FAIL"


def judge_step(res) -> None:
    """Ratios (other's time / ours) and the bar of one frameworks result, into ``res``."""
    for other in STEP_IMPLS[res["framework"]]:
        r = ratio(res.get(f"{other}_ms"), res.get("ours_ms"))
        if r is not None:
            res[f"ratio_vs_{other}"] = r
    bar = step_bar(res["framework"], res["seqlen"])
    if bar is None:
        res["bar"], res["status"] = None, "-"
        return
    ref, limit, strict = bar
    res["bar"] = f"ours {'<' if strict else '<='} {'' if limit == 1 else f'{limit:g}x '}{ref}"
    res["status"] = step_status(res.get("ours_ms"), res.get(f"{ref}_ms"), limit, strict)


def _step_result(framework, shape, count):
    batch, seqlen, nheads, head_dim = shape
    return {"framework": framework, "batch": batch, "seqlen": seqlen, "nheads": nheads,
            "head_dim": head_dim, "dtype": "bfloat16", "causal": True, "input_sets": count}


def torch_step_point(env, shape, reps):
    """ms per training step (forward + autograd backward) at one shape: ours, SDPA FA2 and cuDNN."""
    torch, backends, sdpa_kernel = env
    from . import torch as cupyflash_torch  # noqa: PLC0415

    count = bench.rotation_count(bench.set_bytes(shape))
    sets = [tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            for _ in range(count)]
    res = _step_result("torch", shape, count)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step(attn, inputs, grad):
        return torch.autograd.grad(attn(*inputs), inputs, grad)

    impls = {"ours": (contextlib.nullcontext, functools.partial(cupyflash_torch.flash_attn_func, causal=True),
                      lambda x: x),
             "fa2": (lambda: sdpa_kernel(backends.FLASH_ATTENTION), functools.partial(sdpa, is_causal=True),
                     lambda x: x.transpose(1, 2)),
             "cudnn": (lambda: sdpa_kernel(backends.CUDNN_ATTENTION), functools.partial(sdpa, is_causal=True),
                       lambda x: x.transpose(1, 2))}
    for name, (context, attn, layout) in impls.items():
        try:
            with context():
                steps = [functools.partial(step, attn, tuple(layout(x).detach().requires_grad_() for x in s[:3]),
                                           layout(s[3])) for s in sets]
                res[f"{name}_ms"] = bench._torch_time_ms(bench._rotating(steps), reps, torch)  # noqa: SLF001
        except Exception as e:  # noqa: BLE001
            mark_failed(res, name, [f"{name}_ms"], e)
    judge_step(res)
    return res


def jax_env():
    """``((jax, jax.numpy, cupyflash.jax), None)``, or ``(None, why JAX is not measured)``."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for cupy's pool
    try:
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415

        from . import jax as cupyflash_jax  # noqa: PLC0415

        backend = jax.default_backend()
    except Exception as e:  # noqa: BLE001 - JAX is optional
        return None, f"JAX not importable ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    if backend != "gpu":
        return None, f"JAX has no GPU backend (default backend: {backend})"
    return (jax, jnp, cupyflash_jax), None


def jax_grad_step(jax, jnp, attention):
    """``jax.jit(jax.grad(loss, argnums=(0, 1, 2)))`` with ``loss = sum(attention(q, k, v) * g)``."""
    def loss(q, k, v, g):
        return jnp.sum((attention(q, k, v) * g).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def jax_time_ms(jax, step, sets, reps, *, steps_per_batch=JAX_STEPS_PER_BATCH, warmup_ms=100.0):
    """Milliseconds per step of a jitted JAX function, by the wall clock.

    JAX has no events: a batch dispatches ``steps_per_batch`` steps (rotating
    through ``sets``) and waits for them with ``block_until_ready``.  The
    warm-up (compilation included) blocks on every step.

    Parameters
    ----------
    jax : module
    step : callable
        ``step(*set)`` dispatches one step and returns its (unready) result.
    sets : list of tuple
        The arguments of the steps, in turn.
    reps : int
        Batches.
    steps_per_batch : int, optional
    warmup_ms : float, optional
        At least 3 steps and this long, as :func:`cupyflash.bench._time_ms`.

    Returns
    -------
    float
        Median over batches of the batch's time / ``steps_per_batch``.
    """
    turn = itertools.cycle(sets)
    bench._warm_up(lambda: jax.block_until_ready(step(*next(turn))), lambda: None, warmup_ms)  # noqa: SLF001
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready([step(*next(turn)) for _ in range(steps_per_batch)])
        times.append((time.perf_counter() - t0) * 1e3 / steps_per_batch)
    return statistics.median(times)


def jax_step_point(mods, shape, reps):
    """ms per ``jax.jit(jax.grad)`` step at one shape: ours, jax.nn.dot_product_attention cudnn and xla."""
    jax, jnp, cupyflash_jax = mods
    count = bench.rotation_count(bench.set_bytes(shape))
    keys = iter(jax.random.split(jax.random.key(0), 4 * count))
    sets = [tuple(jax.random.normal(next(keys), shape, jnp.bfloat16) for _ in range(4)) for _ in range(count)]
    res = _step_result("jax", shape, count)

    def dpa(implementation):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    impls = {"ours": lambda q, k, v: cupyflash_jax.flash_attention(q, k, v, causal=True),
             "cudnn": dpa("cudnn"), "xla": dpa("xla")}
    for name, attention in impls.items():
        try:
            res[f"{name}_ms"] = jax_time_ms(jax, jax_grad_step(jax, jnp, attention), sets, reps)
        except Exception as e:  # noqa: BLE001 - cuDNN may refuse a shape
            mark_failed(res, name, [f"{name}_ms"], e)
    judge_step(res)
    return res


def run_frameworks(cupy, args, report, save):
    """``--suite frameworks``: torch training steps, then JAX ones (JAX imported only here)."""
    report["config"] = {"dtype": "bfloat16", "causal": True, "jax_steps_per_batch": JAX_STEPS_PER_BATCH}
    env, why = (None, "--no-torch") if args.no_torch else bench.torch_env()
    if env is None:
        report["notes"].append(f"torch steps skipped: {why}")
    else:
        for shape in TORCH_STEP_SHAPES:
            res = step_or_failure("torch", shape, lambda: torch_step_point(env, shape, args.reps))
            _add_step(report, save, res)
        env[0].cuda.empty_cache()  # give torch's cached memory back before XLA allocates
    mods, why = (None, "--no-jax") if args.no_jax else jax_env()
    if mods is None:
        report["notes"].append(f"JAX steps skipped: {why}")
    else:
        for shape in JAX_STEP_SHAPES:
            res = step_or_failure("jax", shape, lambda: jax_step_point(mods, shape, args.reps))
            _add_step(report, save, res)
    report["bars"] = count_statuses(report["results"])


def step_or_failure(framework, shape, measure):
    """``measure()``, or where it fails outside one implementation (inputs, a framework that
    starts but cannot compute) a result with every time marked (:func:`mark_failed`)."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - e.g. JAX and torch loading clashing CUDA libraries
        res = _step_result(framework, shape, None)
        mark_failed(res, framework, [f"{name}_ms" for name in ("ours", *STEP_IMPLS[framework])], e)
        judge_step(res)
        return res


def _add_step(report, save, res):
    report["results"].append(res)
    save()
    print(f"frameworks {res['framework']} {_step_shape(res)}: " + ", ".join(
        f"{name} {cell(res.get(name + '_ms'), 0, '.3f')} ms" for name in ("ours", *STEP_IMPLS[res["framework"]]))
        + f" {res['status']}", file=sys.stderr, flush=True)


def _step_shape(res):
    return f"{res['batch']}x{res['seqlen']}x{res['nheads']}x{res['head_dim']}"


_STEP_TITLES = {"torch": "torch: cupyflash.torch.flash_attn_func vs SDPA, CUDA events per step",
                "jax": "jax: cupyflash.jax.flash_attention vs jax.nn.dot_product_attention, "
                       "wall clock over batches of steps"}


def format_frameworks_table(report) -> str:
    """ms per training step and ratios, one section per framework, and the bars."""
    lines = ["frameworks: ms per training step (forward + backward), bfloat16, causal, shape "
             "batch x seqlen x nheads x head_dim; x NAME = NAME's time / ours (>1: ours faster)"]
    for framework, others in STEP_IMPLS.items():
        rows = [r for r in report["results"] if r["framework"] == framework]
        if not rows:
            continue
        lines += [_STEP_TITLES[framework],
                  f"{'shape':<14}" + "".join(f"{n:>9}" for n in ("ours", *others)) + " |"
                  + "".join(f"{'x ' + o:>9}" for o in others) + " | " + f"{'bar':<19} status"]
        for r in rows:
            lines.append(f"{_step_shape(r):<14}" + "".join(cell(r.get(f"{n}_ms"), 9, ".3f")
                                                          for n in ("ours", *others)) + " |"
                         + "".join(cell(r.get(f"ratio_vs_{o}"), 9, ".2f") for o in others)
                         + f" | {r['bar'] or '-':<19} {r['status']}")
    lines.append(_bars_line(report))
    return "\n".join(lines)


def plot_frameworks(report, path):
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    frameworks = [f for f in STEP_IMPLS if any(r["framework"] == f for r in report["results"])]
    fig, axes = plt.subplots(1, max(1, len(frameworks)), figsize=(6 * max(1, len(frameworks)), 3.5),
                             squeeze=False)
    for ax, framework in zip(axes[0], frameworks):
        rows = [r for r in report["results"] if r["framework"] == framework]
        names = ("ours", *STEP_IMPLS[framework])
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            ax.bar([i + j * width for i in range(len(rows))],
                   [r[f"{name}_ms"] if _number(r.get(f"{name}_ms")) else 0 for r in rows], width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [_step_shape(r) for r in rows])
        ax.set(ylabel="ms per step", title=framework)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


# ----------------------------------------------------------------------------
# --suite decode
# ----------------------------------------------------------------------------

DECODE_BATCHES = (1, 8, 64)
DECODE_SEQLENS = (1024, 8192, 32768, 131072)
#: (nheads_q, nheads_kv): GQA 4:1 and plain multi-head.
DECODE_HEADS = ((32, 8), (32, 32))
DECODE_HEAD_DIMS = (64, 128)
DECODE_DTYPES = ("bfloat16", "float16")
DECODE_PARTS = ("grid", "paged", "prefill")
#: The H200's device-to-device copy bandwidth, TB/s (--copy-tbps).
DEFAULT_COPY_TBPS = 4.24
#: Points whose K/V cache (one input set) exceeds this many GB are skipped (--max-kv-gb).
DEFAULT_MAX_KV_GB = 40.0
#: The bandwidth bar applies where the K/V cache is at least this large.
BW_MIN_BYTES = 256 * 2**20
#: Bars: ours' K/V bandwidth >= BW_BAR x copy; FA2's time >= FA2_BAR x ours; cuDNN's >= CUDNN_BAR x ours;
#: paged <= PAGED_BAR x contiguous; the kvcache chunked prefill <= PREFILL_BAR x the dense forward.
BW_BAR = 0.8
FA2_BAR = 1.5
CUDNN_BAR = 1.0
PAGED_BAR = 1.1
PREFILL_BAR = 1.0
PAGE_SIZES = (16, 64, 256)
#: (batch, seqlen_k) of the paged comparison, at PAGED_CONFIG.
PAGED_SHAPES = ((8, 32768), (1, 131072))
PAGED_CONFIG = {"nheads_q": 32, "nheads_kv": 8, "head_dim": 128, "dtype": "bfloat16"}
PREFILL_SEQLENS_Q = (64, 256, 512)
PREFILL_CONFIG = {"batch": 1, "seqlen_k": 32768, "nheads_q": 32, "nheads_kv": 8, "head_dim": 128,
                  "dtype": "bfloat16", "causal": True}
#: Max abs difference allowed between ours' output and the reference's (SDPA flash's, or ours' other path).
CHECK_TOL = {"bfloat16": 1e-2, "float16": 5e-3}
#: Warm-up of each timing (bench._time_ms: at least 3 calls and this long); decode calls are short.
DECODE_WARMUP_MS = 20.0
#: float32 elements generated at a time when filling a cache (256 MiB).
FILL_CHUNK = 1 << 26


class Skip(Exception):
    """A measurement not made on purpose (memory); recorded as ``"skipped"`` with the reason."""


def kv_bytes(batch, seqlen_k, nheads_kv, head_dim, itemsize=2) -> int:
    """Bytes of the K and V caches: ``2 * batch * seqlen_k * nheads_kv * head_dim * itemsize``."""
    return 2 * batch * seqlen_k * nheads_kv * head_dim * itemsize


def tbps(nbytes, ms):
    """TB/s (10**12 bytes per second) of ``nbytes`` moved in ``ms`` milliseconds; None unless ``ms`` is a
    measured positive number."""
    return nbytes / ms / 1e9 if _number(ms) and ms > 0 else None


def kv_skip_reason(nbytes, max_bytes):
    """Why a point whose caches take ``nbytes`` is skipped, or None when it fits ``max_bytes``."""
    if nbytes <= max_bytes:
        return None
    return f"K/V {nbytes / 1e9:.1f} GB > {max_bytes / 1e9:g} GB (--max-kv-gb)"


def bar_at_least(value, limit) -> str:
    """PASS when ``value >= limit``, FAIL below; "n/a" unless ``value`` is a measured number."""
    if not _number(value):
        return "n/a"
    return "PASS" if value >= limit else "FAIL"


def check_status(has_nan, max_abs, tol) -> str:
    """The output check: FAIL on a NaN or an error above ``tol`` (a NaN error too); PASS within
    ``tol``; "n/a" when there was nothing to compare with (and no NaN)."""
    if has_nan:
        return "FAIL"
    if max_abs is None:
        return "n/a"
    return "PASS" if max_abs <= tol else "FAIL"


def overall_status(ours_ms, bars) -> str:
    """A point's status from ours' time and its bars (PASS, FAIL, "n/a" or "-" = not applicable).

    ours' failure marker ("OOM", "error", "skipped") when ours was not measured; FAIL when a bar
    fails; PASS when every applicable bar passes; otherwise "n/a" (some bar could not be judged).
    """
    if not _number(ours_ms):
        return ours_ms if ours_ms in (OOM, ERROR, SKIPPED) else "n/a"
    if "FAIL" in bars:
        return "FAIL"
    return "PASS" if all(b in ("PASS", "-") for b in bars) else "n/a"


def judge_decode(res, copy_tbps) -> None:
    """Bandwidths, ratios, the four bars and the status of one decode-grid result, into ``res``.

    ``res`` holds ``kv_bytes``, ``ours_ms``, ``fa2_ms``, ``cudnn_ms`` (numbers or failure markers)
    and ``check``; ``<impl>_tbps`` is the un-expanded K/V bytes over that implementation's time.
    """
    ms = res.get("ours_ms")
    for name in ("ours", "fa2", "cudnn"):
        value = tbps(res["kv_bytes"], res.get(f"{name}_ms"))
        if value is not None:
            res[f"{name}_tbps"] = value
    if "ours_tbps" in res:
        res["ours_frac_copy"] = res["ours_tbps"] / copy_tbps
    for other in ("fa2", "cudnn"):
        r = ratio(res.get(f"{other}_ms"), ms)
        if r is not None:
            res[f"ratio_vs_{other}"] = r
    res["bar_bw"] = "-" if res["kv_bytes"] < BW_MIN_BYTES else bar_at_least(res.get("ours_frac_copy"), BW_BAR)
    res["bar_fa2"] = bar_at_least(res.get("ratio_vs_fa2"), FA2_BAR)
    res["bar_cudnn"] = bar_at_least(res.get("ratio_vs_cudnn"), CUDNN_BAR)
    res["status"] = overall_status(ms, [res["bar_bw"], res["bar_fa2"], res["bar_cudnn"], res.get("check", "n/a")])


def judge_against(res, name, base, limit) -> None:
    """``ratio_<name>_vs_<base>`` (= name's time / base's: < 1 is faster), the bar ``name's time <=
    limit x base's`` and the status (with the output check), into ``res``."""
    r = ratio(res.get(f"{name}_ms"), res.get(f"{base}_ms"))
    if r is not None:
        res[f"ratio_{name}_vs_{base}"] = r
    res["bar_time"] = "n/a" if r is None else ("PASS" if r <= limit else "FAIL")
    res["status"] = overall_status(res.get(f"{name}_ms"), [res["bar_time"], res.get("check", "n/a")])


def max_abs_diff(xp, a, b) -> float:
    """``max |a - b|`` (float32 arrays of one shape); NaN where either holds a NaN."""
    if a.shape != b.shape:
        raise ValueError(f"outputs of shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be compared")
    return float(xp.max(xp.abs(a - b))) if a.size else 0.0


def record_check(res, xp, ours, refs, tol, name="ours") -> None:
    """Compare ours' output with the first available reference output, into ``res``.

    Parameters
    ----------
    res : dict
        Receives ``<name>_nan``, ``check_against`` (the reference's name or None), ``check_max_abs``,
        ``check_tol`` and ``check`` (:func:`check_status`; "n/a" without ours' output).
    xp : module
        The arrays' module.
    ours : array or None
        float32, shape (batch, seqlen_q, nheads_q, head_dim).
    refs : list of (str, array or None)
        Candidate references in order of preference, as ``ours``.
    tol : float
    name : str, optional
        The name of ours' output in ``res`` (the NaN flag's key).
    """
    res["check_tol"] = tol
    if ours is None:
        res["check"] = "n/a"
        return
    has_nan = res[f"{name}_nan"] = bool(xp.isnan(ours).any())
    against = next(((name, out) for name, out in refs if out is not None), None)
    res["check_against"] = against[0] if against else None
    max_abs = None
    if against:
        try:
            max_abs = res["check_max_abs"] = max_abs_diff(xp, ours, against[1])
        except Exception as e:  # noqa: BLE001 - a wrong shape is a failed check, not a crash
            res["check_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            res["check"] = "FAIL"
            return
    res["check"] = check_status(has_nan, max_abs, tol)


def _typed(cupy, storage, dtype):
    """uint16 storage as the array the public API takes: float16 values, or bfloat16 bits as they are."""
    return storage.view(cupy.float16) if dtype == "float16" else storage


def _as_float32(cupy, x, dtype):
    """An output of ours (float16, or bfloat16 bits in uint16 storage) as float32."""
    if dtype == "float16":
        return x.astype(cupy.float32)
    return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


def fill_normal(cupy, storage, dtype, chunk=None) -> None:
    """Fill uint16 ``storage`` with standard-normal ``dtype`` values (float16, or bfloat16 bits),
    ``chunk`` float32 elements at a time (default :data:`FILL_CHUNK`), so a large cache needs no
    float32 copy of itself."""
    chunk = chunk or FILL_CHUNK
    flat = storage.reshape(-1)
    for start in range(0, flat.size, chunk):
        x = cupy.random.standard_normal(min(chunk, flat.size - start), dtype=cupy.float32)
        flat[start:start + x.size] = (x.astype(cupy.float16).view(cupy.uint16) if dtype == "float16"
                                      else bench._bf16_bits(cupy, x))  # noqa: SLF001


def decode_sets(cupy, count, *, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim):
    """``count`` sets of uninitialised uint16 (q, k_cache, v_cache) storage (:func:`fill_normal` fills them)."""
    kv = (batch, seqlen_k, nheads_kv, head_dim)
    return [(cupy.empty((batch, seqlen_q, nheads_q, head_dim), dtype=cupy.uint16),
             cupy.empty(kv, dtype=cupy.uint16), cupy.empty(kv, dtype=cupy.uint16)) for _ in range(count)]


def paged_copy(cupy, k_cache, v_cache, page_size):
    """A paged copy of a full contiguous cache: ``(k_pages, v_pages, block_table)``.

    The pool has exactly ``batch * seqlen_k / page_size`` blocks; the block table is a random
    permutation of them (int32, shape (batch, seqlen_k / page_size)), so a sequence's blocks lie
    anywhere in the pool, in no order.
    """
    batch, seqlen_k, nheads_kv, head_dim = k_cache.shape
    if seqlen_k % page_size:
        raise ValueError(f"seqlen_k {seqlen_k} is not a multiple of page_size {page_size}")
    num_blocks = batch * (seqlen_k // page_size)
    table = cupy.random.permutation(num_blocks).astype(cupy.int32)
    pages = []
    for cache in (k_cache, v_cache):
        pool = cupy.empty((num_blocks, page_size, nheads_kv, head_dim), dtype=cache.dtype)
        pool[table] = cache.reshape(num_blocks, page_size, nheads_kv, head_dim)
        pages.append(pool)
    return pages[0], pages[1], table.reshape(batch, num_blocks // batch)


class _OursBase:
    """cupyflash through the public API on cupy arrays; cupy events."""

    def __init__(self, cupy, name, dtype, causal=True):
        import cupyflash  # noqa: PLC0415

        self.cupy, self.name, self.dtype, self.causal, self.lib = cupy, name, dtype, causal, cupyflash

    def context(self):
        return contextlib.nullcontext()

    def prepare(self, sets, res):
        return [tuple(_typed(self.cupy, x, self.dtype) for x in s[:3]) + tuple(s[3:]) for s in sets]

    def output(self, out):
        return _as_float32(self.cupy, out, self.dtype)

    def time_ms(self, fn, reps):
        return bench._time_ms(fn, reps, self.cupy, warmup_ms=DECODE_WARMUP_MS)  # noqa: SLF001

    def release(self):
        pass


class OursKV(_OursBase):
    """``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens[, block_table=...], causal=...)``;
    a set is ``(q, k_cache, v_cache)`` or ``(q, k_pages, v_pages, block_table)``."""

    def __init__(self, cupy, name, dtype, lens, causal=True):
        super().__init__(cupy, name, dtype, causal)
        self.lens = lens

    def call(self, state):
        q, k, v = state[:3]
        table = state[3] if len(state) > 3 else None
        return self.lib.flash_attn_with_kvcache(q, k, v, cache_seqlens=self.lens, block_table=table,
                                                causal=self.causal, dtype=self.dtype)


class OursDense(_OursBase):
    """``flash_attn_fwd(q, k, v, causal=...)``: the dense forward on the cache as keys and values."""

    def call(self, state):
        return self.lib.flash_attn_fwd(*state[:3], causal=self.causal, dtype=self.dtype)

    def output(self, out):
        return super().output(out[0])


class DecodeSdpa:
    """torch SDPA with one backend on (B, H, S, D) views of the same cupy memory (DLPack, no copy).

    ``enable_gqa=True`` where nheads_q != nheads_kv.  With ``expand_on_refusal`` (cuDNN), a backend
    that refuses the grouped call gets K/V with their heads repeated (``repeat_interleave``, made
    here, outside the timed calls) and ``res[name + "_kv"] = "expanded"`` with the refusal under
    ``<name>_gqa_refusal``; where the expanded K/V of all sets would exceed ``max_bytes`` the
    measurement is skipped (:class:`Skip`).  ``is_causal=False``: torch's causal mask is aligned
    top-left, and one query against a full cache sees every key.
    """

    def __init__(self, env, cupy, name, backend, *, dtype, nheads_q, nheads_kv, max_bytes,
                 expand_on_refusal=False):
        self.torch, backends, self.sdpa_kernel = env
        self.cupy, self.name, self.dtype = cupy, name, dtype
        self.backend = getattr(backends, backend)
        self.sdpa = self.torch.nn.functional.scaled_dot_product_attention
        self.group = nheads_q // nheads_kv
        self.kwargs = {"enable_gqa": True} if self.group > 1 else {}
        self.max_bytes, self.expand_on_refusal = max_bytes, expand_on_refusal

    def context(self):
        return self.sdpa_kernel(self.backend)

    def prepare(self, sets, res):
        torch, cupy = self.torch, self.cupy
        views = [tuple(bench.torch_view(torch, cupy, _typed(cupy, x, self.dtype), self.dtype).transpose(1, 2)
                       for x in s[:3]) for s in sets]
        self.kwargs = {"enable_gqa": True} if self.group > 1 else {}
        if not (self.expand_on_refusal and self.group > 1):
            return views
        try:
            self.sdpa(*views[0], **self.kwargs)
            torch.cuda.synchronize()
            return views
        except Exception as e:  # noqa: BLE001 - the refusal is recorded; the expanded call is timed
            res[f"{self.name}_gqa_refusal"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        expanded = sum(2 * k.numel() * k.element_size() * self.group for _, k, _ in views)
        if expanded > self.max_bytes:
            raise Skip(f"refuses GQA; K/V expanded to nheads_q would take {expanded / 1e9:.1f} GB "
                       f"> {self.max_bytes / 1e9:g} GB (--max-kv-gb)")
        res[f"{self.name}_kv"] = "expanded"
        self.kwargs = {}
        return [(q, k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1))
                for q, k, v in views]

    def call(self, state):
        return self.sdpa(*state, **self.kwargs)

    def output(self, out):
        return self.cupy.from_dlpack(out.transpose(1, 2).float().contiguous())

    def time_ms(self, fn, reps):
        return bench._torch_time_ms(fn, reps, self.torch, warmup_ms=DECODE_WARMUP_MS)  # noqa: SLF001

    def release(self):
        self.torch.cuda.empty_cache()


def measure_decode(impl, sets, res, reps):
    """ms per call of one implementation into ``res[impl.name + "_ms"]``, rotating through ``sets``.

    Parameters
    ----------
    impl : OursKV, OursDense, DecodeSdpa or alike
        ``name``, ``context()``, ``prepare(sets, res) -> states``, ``call(state)``,
        ``output(out) -> float32 array (batch, seqlen_q, nheads_q, head_dim)``,
        ``time_ms(fn, reps)`` and ``release()``.
    sets : list of tuple
        uint16 storage (:func:`decode_sets`), filled.
    res : dict
    reps : int

    Returns
    -------
    array or None
        The output of the first set as float32 (before the timed calls), None when the call failed.
        A failure marks the time "OOM" or "error" (:func:`mark_failed`); a :class:`Skip`,
        "skipped" with the reason under ``<name>_skipped``.
    """
    name, out = impl.name, None
    try:
        with impl.context():
            states = impl.prepare(sets, res)
            try:
                out = impl.output(impl.call(states[0]))
                res[f"{name}_ms"] = impl.time_ms(
                    bench._rotating([functools.partial(impl.call, s) for s in states]), reps)  # noqa: SLF001
            finally:
                del states
    except Skip as e:
        res[f"{name}_ms"], res[f"{name}_skipped"] = SKIPPED, str(e)
    except Exception as e:  # noqa: BLE001 - a refusal, an OOM or a missing kernel is a result
        mark_failed(res, name, [f"{name}_ms"], e)
    finally:
        impl.release()
    return out


def _release(cupy, env):
    cupy.get_default_memory_pool().free_all_blocks()
    if env is not None:
        env[0].cuda.empty_cache()


def _decode_result(part, **fields):
    return {"part": part, **fields}


def _skipped(res, reason):
    res.update(status=SKIPPED, skipped=reason)
    return res


def _point_text(r):
    head = f"B={r['batch']} S={r['seqlen_k']} {r['nheads_q']}/{r['nheads_kv']} D={r['head_dim']} {r['dtype']}"
    if r["part"] == "paged":
        return f"paged {head} page {r['page_size']}"
    if r["part"] == "prefill":
        return f"prefill Sq={r['seqlen_q']} {head}"
    return f"decode {head}"


def _progress(report, save, res, names):
    report["results"].append(res)
    save()
    times = ", ".join(f"{n} {cell(res.get(n + '_ms'), 0, '.4f')} ms" for n in names)
    bandwidth = f" ({res['ours_tbps']:.2f} TB/s)" if "ours_tbps" in res else ""
    print(f"{_point_text(res)}: " + (times + bandwidth + " " if times else "") + res["status"],
          file=sys.stderr, flush=True)


def decode_grid(cupy, env, report, save, *, shapes, dtypes, reps, copy_tbps, max_bytes):
    """The decode grid: seqlen_q 1 against a full cache, ours beside SDPA FA2 and cuDNN.

    One allocation of (q, k_cache, v_cache) storage per shape (batch, seqlen_k, nheads_q,
    nheads_kv, head_dim), refilled for each dtype; rotated through several sets where one is
    smaller than L2.
    """
    for batch, seqlen_k, nheads_q, nheads_kv, head_dim in shapes:
        nbytes = kv_bytes(batch, seqlen_k, nheads_kv, head_dim)
        count = bench.rotation_count(nbytes)
        meta = dict(batch=batch, seqlen_q=1, seqlen_k=seqlen_k, nheads_q=nheads_q, nheads_kv=nheads_kv,
                    head_dim=head_dim, kv_bytes=nbytes, input_sets=count)
        reason = kv_skip_reason(nbytes, max_bytes)
        if reason:
            for dtype in dtypes:
                _progress(report, save, _skipped(_decode_result("grid", **meta, dtype=dtype), reason), [])
            continue
        try:
            sets = decode_sets(cupy, count, batch=batch, seqlen_q=1, seqlen_k=seqlen_k, nheads_q=nheads_q,
                               nheads_kv=nheads_kv, head_dim=head_dim)
            lens = cupy.full((batch,), seqlen_k, dtype=cupy.int32)
        except Exception as e:  # noqa: BLE001 - no memory for the inputs: every dtype's point says so
            for dtype in dtypes:
                res = _decode_result("grid", **meta, dtype=dtype)
                mark_failed(res, "inputs", ["ours_ms", "fa2_ms", "cudnn_ms", "status"], e)
                _progress(report, save, res, [])
            _release(cupy, env)
            continue
        for dtype in dtypes:
            res = _decode_result("grid", **meta, dtype=dtype)
            try:
                for s in sets:
                    for x in s:
                        fill_normal(cupy, x, dtype)
            except Exception as e:  # noqa: BLE001
                mark_failed(res, "inputs", ["ours_ms", "fa2_ms", "cudnn_ms", "status"], e)
                _progress(report, save, res, [])
                continue
            impls = [OursKV(cupy, "ours", dtype, lens)]
            if env is not None:
                impls += [DecodeSdpa(env, cupy, name, backend, dtype=dtype, nheads_q=nheads_q,
                                     nheads_kv=nheads_kv, max_bytes=max_bytes, expand_on_refusal=name == "cudnn")
                          for name, backend in SDPA_BACKENDS[:2]]
            outs = {impl.name: measure_decode(impl, sets, res, reps) for impl in impls}
            record_check(res, cupy, outs["ours"], [(n, outs.get(n)) for n in ("fa2", "cudnn")], CHECK_TOL[dtype])
            judge_decode(res, copy_tbps)
            _progress(report, save, res, [impl.name for impl in impls])
            del outs
        del sets, lens
        _release(cupy, env)


def decode_paged(cupy, env, report, save, *, reps, max_bytes):
    """Ours on a paged cache (shuffled blocks, each page size) against ours on the same cache contiguous."""
    cfg = PAGED_CONFIG
    dtype = cfg["dtype"]
    for batch, seqlen_k in PAGED_SHAPES:
        nbytes = kv_bytes(batch, seqlen_k, cfg["nheads_kv"], cfg["head_dim"])
        count = bench.rotation_count(nbytes)
        metas = [dict(batch=batch, seqlen_q=1, seqlen_k=seqlen_k, **cfg, kv_bytes=nbytes, input_sets=count,
                      page_size=page_size) for page_size in PAGE_SIZES]
        reason = kv_skip_reason(2 * nbytes, max_bytes)  # the contiguous cache and its paged copy
        if reason:
            for meta in metas:
                _progress(report, save, _skipped(_decode_result("paged", **meta), reason), [])
            continue
        contiguous = {}
        try:
            sets = decode_sets(cupy, count, batch=batch, seqlen_q=1, seqlen_k=seqlen_k,
                               nheads_q=cfg["nheads_q"], nheads_kv=cfg["nheads_kv"], head_dim=cfg["head_dim"])
            for s in sets:
                for x in s:
                    fill_normal(cupy, x, dtype)
            lens = cupy.full((batch,), seqlen_k, dtype=cupy.int32)
            base = measure_decode(OursKV(cupy, "contiguous", dtype, lens), sets, contiguous, reps)
        except Exception as e:  # noqa: BLE001
            for meta in metas:
                res = _decode_result("paged", **meta)
                mark_failed(res, "inputs", ["contiguous_ms", "paged_ms", "status"], e)
                _progress(report, save, res, [])
            _release(cupy, env)
            continue
        for meta in metas:
            res = {**_decode_result("paged", **meta), **contiguous}
            try:
                paged = [(s[0], *paged_copy(cupy, s[1], s[2], meta["page_size"])) for s in sets]
            except Exception as e:  # noqa: BLE001
                mark_failed(res, "inputs", ["paged_ms", "status"], e)
                _progress(report, save, res, ["contiguous"])
                continue
            out = measure_decode(OursKV(cupy, "paged", dtype, lens), paged, res, reps)
            del paged
            cupy.get_default_memory_pool().free_all_blocks()
            record_check(res, cupy, out, [("contiguous", base)], CHECK_TOL[dtype], name="paged")
            judge_against(res, "paged", "contiguous", PAGED_BAR)
            _progress(report, save, res, ["contiguous", "paged"])
        del sets, lens, base
        _release(cupy, env)


def decode_prefill(cupy, env, report, save, *, reps, max_bytes):
    """Chunked prefill: ours' flash_attn_with_kvcache against ours' dense flash_attn_fwd on the same
    queries and cache (causal, aligned bottom-right in both)."""
    cfg = PREFILL_CONFIG
    dtype = cfg["dtype"]
    nbytes = kv_bytes(cfg["batch"], cfg["seqlen_k"], cfg["nheads_kv"], cfg["head_dim"])
    count = bench.rotation_count(nbytes)
    shape = {k: cfg[k] for k in ("batch", "seqlen_k", "nheads_q", "nheads_kv", "head_dim")}
    for seqlen_q in PREFILL_SEQLENS_Q:
        res = _decode_result("prefill", seqlen_q=seqlen_q, **cfg, kv_bytes=nbytes, input_sets=count)
        reason = kv_skip_reason(nbytes, max_bytes)
        if reason:
            _progress(report, save, _skipped(res, reason), [])
            continue
        try:
            sets = decode_sets(cupy, count, seqlen_q=seqlen_q, **shape)
            for s in sets:
                for x in s:
                    fill_normal(cupy, x, dtype)
            lens = cupy.full((cfg["batch"],), cfg["seqlen_k"], dtype=cupy.int32)
        except Exception as e:  # noqa: BLE001
            mark_failed(res, "inputs", ["kvcache_ms", "dense_ms", "status"], e)
            _progress(report, save, res, [])
            _release(cupy, env)
            continue
        out = measure_decode(OursKV(cupy, "kvcache", dtype, lens, causal=cfg["causal"]), sets, res, reps)
        dense = measure_decode(OursDense(cupy, "dense", dtype, causal=cfg["causal"]), sets, res, reps)
        record_check(res, cupy, out, [("dense", dense)], CHECK_TOL[dtype], name="kvcache")
        judge_against(res, "kvcache", "dense", PREFILL_BAR)
        _progress(report, save, res, ["kvcache", "dense"])
        del sets, lens, out, dense
        _release(cupy, env)


def decode_shapes(batches, seqlens, heads, head_dims):
    """The grid's (batch, seqlen_k, nheads_q, nheads_kv, head_dim), K/V size growing within each batch."""
    return [(b, s, hq, hkv, d) for b in batches for d in head_dims for hq, hkv in heads for s in seqlens]


def run_decode(cupy, args, report, save):
    """``--suite decode``: flash_attn_with_kvcache against SDPA (FA2, cuDNN), paged and chunked prefill.

    ``--batch``, ``--seqlen``, ``--heads``, ``--head-dim`` and ``--dtype`` restrict the grid,
    ``--part`` picks the parts (grid, paged, prefill; default all).
    """
    env, why = (None, "--no-torch") if args.no_torch else bench.torch_env()
    if why:
        report["notes"].append(f"torch SDPA columns skipped: {why}")
    copy_tbps = args.copy_tbps or DEFAULT_COPY_TBPS
    max_bytes = (args.max_kv_gb or DEFAULT_MAX_KV_GB) * 1e9
    parts = args.part or list(DECODE_PARTS)
    report.update(config={
        "seqlen_q": 1, "cache": "full (cache_seqlens = seqlen_k)", "copy_tbps": copy_tbps,
        "max_kv_bytes": max_bytes, "bw_min_bytes": BW_MIN_BYTES, "warmup_ms": DECODE_WARMUP_MS,
        "check_tol": CHECK_TOL, "page_sizes": list(PAGE_SIZES), "paged": PAGED_CONFIG, "prefill": PREFILL_CONFIG,
        "bars": {"bw": f"ours K/V TB/s >= {BW_BAR:g} x copy where K/V >= {BW_MIN_BYTES} bytes",
                 "fa2": f"fa2 ms >= {FA2_BAR:g} x ours", "cudnn": f"cudnn ms >= {CUDNN_BAR:g} x ours",
                 "paged": f"paged ms <= {PAGED_BAR:g} x contiguous",
                 "prefill": f"kvcache ms <= {PREFILL_BAR:g} x dense"}},
        impls=["ours"] + ([] if env is None else ["fa2", "cudnn"]), parts=list(parts))
    common = dict(reps=args.reps, max_bytes=max_bytes)
    if "grid" in parts:
        shapes = decode_shapes(args.batch or DECODE_BATCHES, args.seqlen or DECODE_SEQLENS,
                               args.heads or DECODE_HEADS, args.head_dim or DECODE_HEAD_DIMS)
        decode_grid(cupy, env, report, save, shapes=shapes, dtypes=args.dtype or DECODE_DTYPES,
                    copy_tbps=copy_tbps, **common)
    if "paged" in parts:
        decode_paged(cupy, env, report, save, **common)
    if "prefill" in parts:
        decode_prefill(cupy, env, report, save, **common)
    report["bars"] = count_statuses(report["results"])


def _heads_text(r):
    return f"{r['nheads_q']}/{r['nheads_kv']}"


def _decode_cudnn_cell(r, width):
    if r.get("cudnn_kv") == "expanded" and _number(r.get("cudnn_ms")):
        return f"{format(r['cudnn_ms'], '.4f') + '+':>{width}}"
    return cell(r.get("cudnn_ms"), width, ".4f")


def format_decode_table(report) -> str:
    """The decode grid (times, ratios, bandwidth, the check and the bars), then paged and prefill."""
    cfg, rows = report["config"], report["results"]
    lines = []
    grid = [r for r in rows if r["part"] == "grid"]
    if grid:
        lines += [f"decode: seqlen_q 1 against a full cache; ms per call; x NAME = NAME's time / ours (>1: ours "
                  f"faster); TB/s = K/V bytes / ours' time, frac of {cfg['copy_tbps']:g} TB/s copy; "
                  f"cudnn+ = K/V heads expanded for cuDNN",
                  f"bars: bw >= {BW_BAR:g} where K/V >= {BW_MIN_BYTES / 2**20:g} MiB, x fa2 >= {FA2_BAR:g}, "
                  f"x cudnn >= {CUDNN_BAR:g}, chk: max |ours - fa2| within tolerance and no NaN",
                  f"{'B':>3} {'seqlen':>7} {'heads':>5} {'D':>3} {'dtype':<5} {'K/V MB':>9} |{'ours':>9}{'fa2':>9}"
                  f"{'cudnn':>10} |{'x fa2':>7}{'x cudnn':>8} |{'TB/s':>6}{'frac':>6} |{'max err':>8} |"
                  f"{'bw':>5}{'fa2':>5}{'cudnn':>6}{'chk':>5} | status"]
        for r in grid:
            lines.append(
                f"{r['batch']:3d} {r['seqlen_k']:7d} {_heads_text(r):>5} {r['head_dim']:3d} "
                f"{_SHORT_DTYPES[r['dtype']]:<5} {r['kv_bytes'] / 1e6:9.1f} |" + cell(r.get("ours_ms"), 9, ".4f")
                + cell(r.get("fa2_ms"), 9, ".4f") + _decode_cudnn_cell(r, 10) + " |"
                + cell(r.get("ratio_vs_fa2"), 7, ".2f") + cell(r.get("ratio_vs_cudnn"), 8, ".2f") + " |"
                + cell(r.get("ours_tbps"), 6, ".2f") + cell(r.get("ours_frac_copy"), 6, ".2f") + " |"
                + cell(r.get("check_max_abs"), 8, ".1e") + " |" + cell(r.get("bar_bw"), 5, "")
                + cell(r.get("bar_fa2"), 5, "") + cell(r.get("bar_cudnn"), 6, "") + cell(r.get("check"), 5, "")
                + f" | {r['status']}")
    sections = (("paged", "contiguous", "paged",
                 f"paged: ours on a paged cache (blocks a shuffled pool) vs ours contiguous, seqlen_q 1; "
                 f"bar: paged <= {PAGED_BAR:g}x contiguous, outputs within tolerance",
                 "page", lambda r: r["page_size"]),
                ("prefill", "dense", "kvcache",
                 f"prefill: ours flash_attn_with_kvcache vs flash_attn_fwd (dense), causal, on the same "
                 f"queries and cache; bar: kvcache <= {PREFILL_BAR:g}x dense, outputs within tolerance",
                 "Sq", lambda r: r["seqlen_q"]))
    for part, base, name, title, key, value in sections:
        rows_ = [r for r in rows if r["part"] == part]
        if not rows_:
            continue
        if lines:
            lines.append("")
        lines += [title,
                  f"{'B':>3} {'seqlen':>7} {'heads':>5} {'D':>3} {'dtype':<5} {key:>5} |{base:>11}{name:>9} |"
                  f"{name + '/' + base:>19} |{'max err':>8} | status"]
        for r in rows_:
            lines.append(
                f"{r['batch']:3d} {r['seqlen_k']:7d} {_heads_text(r):>5} {r['head_dim']:3d} "
                f"{_SHORT_DTYPES[r['dtype']]:<5} {value(r):5d} |" + cell(r.get(f"{base}_ms"), 11, ".4f")
                + cell(r.get(f"{name}_ms"), 9, ".4f") + " |" + cell(r.get(f"ratio_{name}_vs_{base}"), 19, ".3f")
                + " |" + cell(r.get("check_max_abs"), 8, ".1e") + f" | {r['status']}")
    lines.append(_bars_line(report))
    return "\n".join(lines)


def plot_decode(report, path):
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in report["results"] if r["part"] == "grid"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for impl in ("ours", "fa2", "cudnn"):
        pts = sorted((r["kv_bytes"], r[f"{impl}_tbps"]) for r in rows if _number(r.get(f"{impl}_tbps")))
        if pts:
            ax.scatter(*zip(*pts), label=impl, s=14)
    ax.axhline(report["config"]["copy_tbps"], color="k", linestyle="--", linewidth=1, label="copy")
    ax.set_xscale("log")
    ax.set(xlabel="K/V bytes", ylabel="TB/s (K/V bytes / time)", title="decode, seqlen_q 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


SUITES = {
    "seed": (run_seed, format_seed_table, plot_seed),
    "overhead": (run_overhead, format_overhead_table, plot_overhead),
    "frameworks": (run_frameworks, format_frameworks_table, plot_frameworks),
    "decode": (run_decode, format_decode_table, plot_decode),
}
