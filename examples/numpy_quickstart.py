"""cupyflash on NumPy arrays: forward, backward, and the error against float64.

The README's NumPy quick start (same shapes), plus the dense float64 reference.
Run: python examples/numpy_quickstart.py   (a few seconds on the CPU)
"""

import numpy as np

import cupyflash
from cupyflash import reference

rng = np.random.default_rng()
batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim = 2, 1000, 1200, 8, 2, 64
q = rng.standard_normal((batch, seqlen_q, nheads_q, head_dim), dtype=np.float32)
k = rng.standard_normal((batch, seqlen_k, nheads_kv, head_dim), dtype=np.float32)
v = rng.standard_normal((batch, seqlen_k, nheads_kv, head_dim), dtype=np.float32)
dout = rng.standard_normal(q.shape, dtype=np.float32)

out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
dq, dk, dv = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True)

ref_out, ref_lse = reference.attention_fwd(q, k, v, causal=True)
ref_dq, ref_dk, ref_dv = reference.attention_bwd(dout, q, k, v, causal=True)

print(f"q {q.shape}, k/v {k.shape}, causal, out {out.shape} {out.dtype}, lse {lse.shape}")
for name, got, want in [("out", out, ref_out), ("lse", lse, ref_lse), ("dq", dq, ref_dq),
                        ("dk", dk, ref_dk), ("dv", dv, ref_dv)]:
    print(f"max |{name} - float64 reference| = {np.abs(got - want).max():.2e}")
