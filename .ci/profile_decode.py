"""One decode step, twice (for ncu: skip the first call's launches).

    python .ci/profile_decode.py BATCH SEQLEN_K [HEADS_KV [HEAD_DIM]]

Sq=1, 32 query heads, fp16, a dense cache of SEQLEN_K valid keys. E.g.
``ncu --clock-control none -k regex:flash_decode --launch-skip 2 python .ci/profile_decode.py 1 131072``.
"""
import sys

import cupy as cp

import cupyflash

b, sk = int(sys.argv[1]), int(sys.argv[2])
hkv = int(sys.argv[3]) if len(sys.argv) > 3 else 8
d = int(sys.argv[4]) if len(sys.argv) > 4 else 128
rng = cp.random.default_rng(0)
q = rng.standard_normal((b, 1, 32, d), dtype=cp.float32).astype(cp.float16)
kc, vc = (rng.standard_normal((b, sk, hkv, d), dtype=cp.float32).astype(cp.float16) for _ in range(2))
for _ in range(2):
    cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sk)
cp.cuda.Device().synchronize()
