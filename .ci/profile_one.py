"""One fp16 forward and backward on the standard grid's shape, twice (for ncu: skip the
first call's launches).

    python .ci/profile_one.py HEAD_DIM SEQLEN CAUSAL [BIAS [fwd]]

BIAS: ``heads`` (a (1, H, N, N) bias, with dbias), ``batch`` ((B, 1, N, N), with
dbias), ``mask`` (a (B, 1, N, N) bool mask, 90% of the keys hidden), or none. E.g.
``ncu --clock-control none --launch-skip 4 python .ci/profile_one.py 64 4096 0 heads``
(each call launches: forward 1, backward 3-4 plus the dbias kernel). ``fwd`` after
BIAS: the forwards only (no backward kernels to compile or run).
"""
import sys

import cupy as cp

import cupyflash

d, s, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
bias_kind = sys.argv[4] if len(sys.argv) > 4 else "none"
fwd_only = len(sys.argv) > 5 and sys.argv[5] == "fwd"
h, b = 2048 // d, 16384 // s
rng = cp.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((b, s, h, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
kw = {}
if bias_kind in ("heads", "batch"):
    shape = (1, h, s, s) if bias_kind == "heads" else (b, 1, s, s)
    kw = {"attn_bias": rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16)}
elif bias_kind == "mask":
    kw = {"attn_mask": rng.random((b, 1, s, s)) < 0.1}
for _ in range(2):
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal, **kw)
    if not fwd_only:
        cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, return_dbias="attn_bias" in kw, **kw)
cp.cuda.Device().synchronize()
