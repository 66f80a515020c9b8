"""What a batch-1 decode call's latency is made of (kernels_cu/PERF.md v22).

``PYTHONPATH=. python3 .ci/decode_latency.py``: bf16, Sq=1, 32/8 heads, D=128, int
cache_seqlens. Per key count, the bench's latency (events around one call from an idle
GPU, median of 300) of: the public call; the planned entry called directly; its
launcher alone (pointers precomputed); the launcher with the main kernel only (no
combine: wrong output, timing only).
"""
import cupy

import cupyflash
from cupyflash import _bench_suites, _kvcache, bench


def latency_us(fn, reps=300):
    """The bench's decode latency (events around one call from an idle GPU, median)."""
    return bench._time_ms(fn, reps, cupy, warmup_ms=_bench_suites.DECODE_WARMUP_MS) * 1e3  # noqa: SLF001


B, HQ, HKV, D = 1, 32, 8, 128
rng = cupy.random.default_rng(0)
for sk in (1024, 8192, 32768, 131072):
    q = rng.standard_normal((B, 1, HQ, D), dtype=cupy.float32).astype(cupy.float16).view(cupy.uint16)
    kc, vc = (rng.standard_normal((B, sk, HKV, D), dtype=cupy.float32).astype(cupy.float16).view(cupy.uint16)
              for _ in range(2))
    _kvcache._ENTRIES.clear()
    public = lambda: cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sk, dtype="bfloat16")
    public()
    entry = next(iter(_kvcache._ENTRIES.values()))
    direct = lambda: entry(q, kc, vc, None, None, sk, None, None)
    call = entry.call
    launcher = call.launcher
    out, lse = entry._allocate(q.dtype)
    scratch = cupy.cuda.alloc(max(call.scratch_bytes, 1))
    oa, la = (scratch.ptr + o for o in call.accum_offsets)
    stream = cupy.cuda.get_current_stream().ptr
    args = (stream, q.data.ptr, kc.data.ptr, vc.data.ptr, 0, 0, out.data.ptr, lse.data.ptr, oa, la, 0, 0, 0, 0, sk)
    raw = lambda: launcher(*args)
    row = [f"{sk:>6} keys, splits {call.plan.num_splits:>3}: public {latency_us(public):6.1f}",
           f"entry {latency_us(direct):6.1f}", f"launcher {latency_us(raw):6.1f}"]
    kernels = launcher._kernels
    launcher._kernels = kernels[:1]
    row.append(f"main only {latency_us(raw):6.1f}")
    launcher._kernels = kernels[1:]
    row.append(f"combine only {latency_us(raw):6.1f}")
    launcher._kernels = kernels
    print("  ".join(row), flush=True)

# Host pieces at the last key count (µs per back-to-back call, host clock up to the last
# call's return, median of 5 batches of 3000)
from cupyflash import _api, _interop  # noqa: E402


def host_us(fn):
    return _bench_suites.per_call_us(fn, calls=3000, batches=5, synchronize=cupy.cuda.Device().synchronize)[1]


names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "block_table", "alibi_slopes",
         "sinks")
pieces = {
    "public call": public,
    "public, return_lse": lambda: cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sk, dtype="bfloat16",
                                                                    return_lse=True),
    "entry()": direct,
    "launcher": raw,
    "_signature": lambda: _kvcache._signature(q, kc, vc, None, None, sk, None, None, None, False, 0, False,
                                              "bfloat16"),
    "_all_native": lambda: _interop._all_native((q, kc, vc), {"cache_seqlens": sk, "dtype": "bfloat16"}, names[3:]),
    "_sig(q)": lambda: _api._sig(q, cupy.ndarray),
    "cupy.cuda.alloc": lambda: cupy.cuda.alloc(4096),
    "ndarray(shape, dtype, mem)": lambda: cupy.ndarray((1, 1, 32, 128), q.dtype, scratch),
    "get_current_stream()": cupy.cuda.get_current_stream,
    "stream.is_capturing()": cupy.cuda.get_current_stream().is_capturing,
    "runtime.getDevice()": cupy.cuda.runtime.getDevice,
    "q.data.ptr": lambda: q.data.ptr,
    "q.shape, strides, dtype": lambda: (q.shape, q.strides, q.dtype),
}
for name, fn in pieces.items():
    print(f"host {name:<28} {host_us(fn):6.2f} us", flush=True)
