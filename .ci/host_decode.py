"""Where a decode call's time goes at batch 1 (kernels_cu/PERF.md v22).

``PYTHONPATH=. python3 .ci/host_decode.py``: bf16, Sq=1, 32/8 heads, D=128. Prints
(1) host µs per back-to-back call of flash_attn_with_kvcache (int and device lengths)
and of its launcher alone; (2) the bench's latency (events around one call from an idle
GPU, median of 200) for ours, SDPA flash and SDPA cuDNN at 1k-128k keys; (3) the top of
a cProfile of 3000 calls.
"""
import cProfile
import pstats
import statistics
import time

import cupy
import numpy as np

import cupyflash
from cupyflash import _kvcache


def host_us(fn, n=3000):
    for _ in range(200):
        fn()
    cupy.cuda.Device().synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
        cupy.cuda.Device().synchronize()
    return statistics.median(runs)


def latency_us(fn, sync, event, elapsed, reps=200):
    for _ in range(20):
        fn()
    sync()
    times = []
    for _ in range(reps):
        a, b = event(), event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(elapsed(a, b) * 1e3)
    return statistics.median(times)


B, HQ, HKV, D = 1, 32, 8, 128
rng = cupy.random.default_rng(0)


def make(sk):
    q = rng.standard_normal((B, 1, HQ, D), dtype=cupy.float32).astype(cupy.float16).view(cupy.uint16)
    kc, vc = (rng.standard_normal((B, sk, HKV, D), dtype=cupy.float32).astype(cupy.float16).view(cupy.uint16)
              for _ in range(2))
    return q, kc, vc


q, kc, vc = make(1024)
lens = cupy.full((B,), 1024, dtype=cupy.int32)
call_int = lambda: cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=1024, dtype="bfloat16")
call_dev = lambda: cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, dtype="bfloat16")
print(f"host us/call, 1k keys, int lengths: {host_us(call_int):.1f}")
print(f"host us/call, 1k keys, device lengths: {host_us(call_dev):.1f}")
call_int()
entry = next(iter(_kvcache._ENTRIES.values()))
print("entry:", type(entry).__name__, "splits:", entry.call.plan.num_splits)
print(f"entry() alone: {host_us(lambda: entry(q, kc, vc, None, None, 1024, None, None)):.1f}")
pr = cProfile.Profile()
pr.enable()
for _ in range(3000):
    call_int()
pr.disable()
cupy.cuda.Device().synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)

try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
except Exception as e:  # noqa: BLE001
    torch = None
    print("no torch:", e)
cev = (cupy.cuda.Device().synchronize, cupy.cuda.Event, cupy.cuda.get_elapsed_time)
for sk in (1024, 8192, 32768, 131072):
    q, kc, vc = make(sk)
    ours = lambda: cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sk, dtype="bfloat16")
    row = [f"latency us, {sk:>6} keys: ours {latency_us(ours, *cev):7.1f}"]
    if torch is not None:
        tq, tk, tv = (torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16).transpose(1, 2) for x in (q, kc, vc))
        tev = (torch.cuda.synchronize, lambda: torch.cuda.Event(enable_timing=True), lambda a, b: a.elapsed_time(b))
        for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
                    row.append(f"{name} {latency_us(f, *tev):7.1f} (host {host_us(f, 1000):5.1f})")
            except Exception as e:  # noqa: BLE001
                row.append(f"{name} error {type(e).__name__}")
    row.append(f"ours host {host_us(ours, 1000):5.1f}")
    print("  ".join(row), flush=True)
