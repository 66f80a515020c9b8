"""Where one cupy forward call's host time goes (kernels_cu/PERF.md v20).

On the GPU machine: ``PYTHONPATH=. python3 .ci/host_breakdown.py``. Times, in µs per
call over back-to-back calls (median of 5 passes of N calls), the pieces of
``flash_attn_fwd`` on CuPy arrays: the whole call at a small D=64 shape (cp.async
kernel) and at a D=128 shape (the warp-specialised kernel and its tensor maps, also
with that kernel off), then each step of the hot path alone: the device check, the
stream, the plan key, the cache lookup, the output allocations, the params write and
the raw launch of the same kernel, and a do-nothing kernel's launch.
"""
import ctypes
import statistics
import time

import cupy
import numpy as np

import cupyflash
from cupyflash import _api, _gpu, _launch, dispatch

N = 3000


def us(fn, n=N):
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


def inputs(b, s, h, d):
    return [cupy.random.standard_normal((b, s, h, d), dtype=cupy.float32).astype(cupy.float16) for _ in range(3)]


rows = []
small = inputs(1, 128, 8, 64)
seed = inputs(1, 512, 32, 128)
q, k, v = small
rows.append(("flash_attn_fwd (1,128,8,64)", us(lambda: cupyflash.flash_attn_fwd(q, k, v))))
out, lse = cupyflash.flash_attn_fwd(q, k, v)
rows.append(("  with out=, lse=", us(lambda: cupyflash.flash_attn_fwd(q, k, v, out=out, lse=lse))))
qs, ks, vs = seed
rows.append(("flash_attn_fwd (1,512,32,128) ws", us(lambda: cupyflash.flash_attn_fwd(qs, ks, vs))))
dispatch.FWD_WS = False
_gpu.clear_plans()
rows.append(("flash_attn_fwd (1,512,32,128) cp.async", us(lambda: cupyflash.flash_attn_fwd(qs, ks, vs))))
dispatch.FWD_WS = dispatch.FWD_WS_WINS
_gpu.clear_plans()
cupyflash.flash_attn_fwd(qs, ks, vs)

# The pieces, at the small shape
rows.append(("getDevice()", us(lambda: cupy.cuda.runtime.getDevice())))
rows.append(("with q.device", us(lambda: q.device.__enter__() and q.device.__exit__(None, None, None))))
rows.append(("get_current_stream().ptr", us(lambda: cupy.cuda.get_current_stream().ptr)))
rows.append(("geometry(q, k, v, None, None)", us(lambda: _launch.geometry(q, k, v, None, None))))
rows.append(("cupy.ndarray((1,128,8,64), f16)", us(lambda: cupy.ndarray((1, 128, 8, 64), np.float16))))
rows.append(("cupy.ndarray((1,8,128), f32)", us(lambda: cupy.ndarray((1, 8, 128), np.float32))))
rows.append(("cupy.cuda.alloc(20 KB)", us(lambda: cupy.cuda.alloc(20480))))
rows.append(("q.data.ptr x5", us(lambda: (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr))))
g = _api._gpu_type()
rows.append(("_api._sig x5 (the entry key's arrays)", us(lambda: (_api._sig(q, g), _api._sig(k, g), _api._sig(v, g),
                                                             _api._sig(None, g), _api._sig(None, g)))))
# the small call's entry (the first planned): its launcher's params write and launch alone
entry = next(iter(_api._FWD_ENTRIES.values()))
rows.append(("entry(q, k, v, None, None)", us(lambda: entry(q, k, v, None, None))))
launcher = entry.call._launcher
ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr, 0, 0, 0, 0, 0)
stream = cupy.cuda.get_current_stream().ptr
rows.append(("Launcher(...) (params + launch)", us(lambda: launcher(stream, *ptrs))))
noop = cupy.RawKernel(r'extern "C" __global__ void noop(const long long* p) {}', "noop")
noop((1,), (32,), (cupy.int64(0),))
buf = ctypes.create_string_buffer(8)
argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
launch = cupy.cuda.driver.launchKernel
func = noop.kernel.ptr
rows.append(("driver.launchKernel(noop)", us(lambda: launch(func, 1, 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(argv), 0))))
libcuda = ctypes.CDLL("libcuda.so.1")
cu_launch = libcuda.cuLaunchKernel
cu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
rows.append(("ctypes cuLaunchKernel(noop)", us(lambda: cu_launch(func, 1, 1, 1, 32, 1, 1, 0, stream, argv, None))))

width = max(len(r[0]) for r in rows)
print("host µs per call (median of 5 x %d back-to-back calls)" % N)
for name, t in rows:
    print(f"{name:<{width}}  {t:7.2f}")
