"""Decode kernel A/B on the device: ring depth x split count, contiguous and paged."""
import sys
import numpy as np, cupy as cp
import cupyflash
from cupyflash import dispatch, _gpu_decode, _kvcache
from cupyx.profiler import benchmark

def t_us(fn):
    r = benchmark(fn, n_repeat=20, n_warmup=3)
    return float(np.median(r.gpu_times[0])) * 1e6

def reset():
    _gpu_decode.clear_plans(); _kvcache._ENTRIES.clear()

for B, S, HKV, D in [(1, 131072, 8, 128), (8, 131072, 8, 128), (8, 32768, 8, 128), (1, 32768, 32, 64), (64, 8192, 8, 128)]:
    HQ = 32
    kc = cp.random.standard_normal((B, S, HKV, D), dtype=cp.float32).astype(cp.float16)
    vc = cp.random.standard_normal((B, S, HKV, D), dtype=cp.float32).astype(cp.float16)
    q = cp.random.standard_normal((B, 1, HQ, D), dtype=cp.float32).astype(cp.float16)
    lens = cp.full((B,), S, dtype=cp.int32)
    gb = 2 * kc.nbytes / 1e3
    line = []
    paged = {}
    for page in (16, 64, 256):
        nb = B * S // page
        perm = cp.asarray(np.random.default_rng(0).permutation(nb).astype(np.int32))
        pk = cp.empty((nb, page, HKV, D), cp.float16); pv = cp.empty_like(pk)
        pk[perm] = kc.reshape(nb, page, HKV, D); pv[perm] = vc.reshape(nb, page, HKV, D)
        paged[page] = (pk, pv, perm.reshape(B, S // page))
    nb = B * S // 64
    ident = (kc.reshape(nb, 64, HKV, D), vc.reshape(nb, 64, HKV, D),
             cp.arange(nb, dtype=cp.int32).reshape(B, S // 64))
    for stages in (3,):
        dispatch._DECODE_TILES[D] = (64, stages)
        reset()
        c = t_us(lambda: cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens))
        auto = [e.call.plan.num_splits for e in _kvcache._ENTRIES.values()]
        text = f"st{stages} splits {auto}: contiguous {c:7.1f} us {gb/c/1e3:4.2f} TB/s | paged"
        for page, (pk, pv, table) in paged.items():
            p = t_us(lambda: cupyflash.flash_attn_with_kvcache(q, pk, pv, cache_seqlens=lens, block_table=table))
            text += f" {page}: {p:7.1f} ({p / c:4.2f}x)"
        p = t_us(lambda: cupyflash.flash_attn_with_kvcache(q, ident[0], ident[1], cache_seqlens=lens,
                                                           block_table=ident[2]))
        text += f" | 64 in order: {p:7.1f} ({p / c:4.2f}x)"
        line.append(text)
    del paged
    print(f"B={B} S={S} HKV={HKV} D={D}:", flush=True)
    for l in line: print("   ", l, flush=True)
    del kc, vc
    cp.get_default_memory_pool().free_all_blocks()

import time
q = cp.zeros((1, 1, 32, 128), cp.float16); kc = cp.zeros((1, 1024, 8, 128), cp.float16)
lens = cp.full((1,), 1000, cp.int32)
f = lambda: cupyflash.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens)
for _ in range(200): f()
cp.cuda.Device().synchronize()
for n in (2000, 2000):
    t = time.perf_counter()
    for _ in range(n): f()
    host = (time.perf_counter() - t) / n * 1e6
    cp.cuda.Device().synchronize()
    print(f"host us per call (B=1, 1k keys, no sync): {host:.1f}", flush=True)
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for _ in range(2000): f()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(8)
