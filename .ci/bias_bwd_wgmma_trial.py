"""Trial (session 8): the D=128 backward with a q-dtype bias on the wgmma kernels
(they spill 24-36 B there) against the default mma.sync plan, bf16, N=4096, 16k tokens.
    python .ci/bias_bwd_wgmma_trial.py
Prints ms per backward (with dbias) for both and the max difference of the gradients."""
import cupy as cp
from cupyx.profiler import benchmark

import cupyflash
from cupyflash import _api, _gpu, _gpu_bwd, _launch, dispatch

d, s = 128, 4096
h, b = 2048 // d, 16384 // s
rng = cp.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((b, s, h, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
bias = rng.standard_normal((1, h, s, s), dtype=cp.float32).astype(cp.float16)
out, lse = cupyflash.flash_attn_fwd(q, k, v, attn_bias=bias)
call = lambda: cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, attn_bias=bias, return_dbias=True)
results = {}
for name in ("mma.sync (default)", "wgmma (spilling)"):
    if name.startswith("wgmma"):
        dispatch._BWD_SM90_STAGED_FITS = {128: dispatch._BWD_SM90_STAGED_FITS[128] + (dispatch.VAR_BIAS,)}
        _gpu.clear_plans()
        for mod in (_api, _gpu_bwd):
            for c in list(vars(mod).values()):
                if isinstance(c, _launch.PlanCache):
                    c.clear()
                elif hasattr(c, "cache_clear"):
                    c.cache_clear()
    results[name] = [g.astype(cp.float32) for g in call()]
    t = benchmark(call, n_repeat=10, n_warmup=2).gpu_times.mean() * 1e3
    print(f"{name}: {t:.3f} ms")
a, c = results.values()
print("max |diff| dq dk dv dbias:", [float(cp.abs(x - y).max()) for x, y in zip(a, c)])
