"""One fp16 forward and backward on the standard grid's shape, twice (for ncu:
skip the first launch).
    python .ci/profile_one.py HEAD_DIM SEQLEN CAUSAL [BWD_BLOCK_M]
BWD_BLOCK_M: query rows per step of the wgmma dK/dV kernel (the experiment switch
of bench --bwd-sm90-block-m)."""
import sys

import cupy as cp

import cupyflash
from cupyflash import dispatch

d, s, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
if len(sys.argv) > 4:
    dispatch.set_bwd_sm90_block_m(dispatch.padded_head_dim(d), int(sys.argv[4]))
h, b = 2048 // d, 16384 // s
rng = cp.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((b, s, h, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
for _ in range(2):
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal)
    cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal)
cp.cuda.Device().synchronize()
