"""The warp-specialised kernels under compute-sanitizer: small shapes with tails on both
sides (rows and keys not multiples of the tiles), GQA, each case asserted to launch the
ws kernel it is meant for and to give finite outputs. Run it under the tool:

    compute-sanitizer --tool memcheck --error-exitcode 3 python3 .ci/sanitize_ws.py
    compute-sanitizer --tool racecheck --error-exitcode 3 python3 .ci/sanitize_ws.py [--quick]

Cases: the ws backward at D=128 (dQ by the reduce warp), at D=64 plain (no dQ, 128 query
rows per step, then the wgmma dQ kernel) and with variants (its own dQ), at 192 and 256 (split
by roles; 200 below 256), with a bias (its TMA stages) and its ws dbias kernel; the ws forward
one block per tile, persistent, with a block-sparse mask (its map), D=64's 192-row tile,
D=192 and 256 (and 136, 200 below them), and packed (varlen, D=128 and 64).
The device reports one SM to the planner (no split-KV, as in the GPU tests). Prints "ok"
last. ``--quick``: the first case of each kernel only (racecheck is slow).
"""
import sys

import cupy as cp
import numpy as np

import cupyflash
from cupyflash import _launch

names = []
_real_call = _launch.Launcher.__call__


def _recording_call(self, stream, *pointers, var=None):
    names.extend(spec.template.rsplit("::", 1)[1] for spec in self.launches)
    _real_call(self, stream, *pointers, var=var)


_launch.Launcher.__call__ = _recording_call
# One SM, as the GPU tests' fixtures do: the plans then never split the keys (small shapes
# would take split-KV, whose forward is the mma.sync kernel)
_launch.num_sms = lambda device_id: 1
rng = np.random.default_rng(7)


def rand(*shape):
    return cp.asarray(rng.standard_normal(shape).astype(np.float16))


def finite(*arrays):
    for a in arrays:
        assert bool(cp.isfinite(a).all()), "non-finite output"


def backward(shape, causal, expect, **variants):
    batch, sq, sk, hq, hkv, d = shape
    q, k, v, dout = rand(batch, sq, hq, d), rand(batch, sk, hkv, d), rand(batch, sk, hkv, d), rand(batch, sq, hq, d)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal,
                                        **{n: x for n, x in variants.items() if n != "return_dbias"})[:2]
    del names[:]
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, **variants)
    assert set(expect) <= set(names), (expect, names)
    finite(*[g for g in grads if g is not None])


def forward(shape, causal, expect, **kw):
    batch, sq, sk, hq, hkv, d = shape
    q, k, v = rand(batch, sq, hq, d), rand(batch, sk, hkv, d), rand(batch, sk, hkv, d)
    del names[:]
    out = cupyflash.flash_attn_fwd(q, k, v, causal=causal, **kw)[0]
    assert set(expect) <= set(names), (expect, names)
    finite(out)


WS_BWD = "flash_bwd_ws_kernel"
WS_FWD = "flash_fwd_ws_kernel"
WS_DBIAS = "flash_bwd_dbias_ws_kernel"
alibi = cp.asarray(np.linspace(0.1, 0.6, 4, dtype=np.float32))
sinks = cp.asarray(np.linspace(-1.0, 1.0, 4, dtype=np.float32))
mask = cp.asarray(rng.random((1, 1, 300, 430)) < 0.5)
mask[..., :128, 128:256] = False  # an empty tile, next to random ones
mask_tall = cp.asarray(rng.random((1, 1, 517, 300)) < 0.5)
mask_tall[..., 128:256, :64] = False

cases = [
    (backward, ((1, 200, 300, 4, 2, 128), True, [WS_BWD, "flash_bwd_convert_dq_kernel"])),
    (backward, ((2, 300, 200, 4, 2, 64), False, [WS_BWD, "flash_bwd_dq_sm90_kernel"])),
    (backward, ((1, 200, 333, 4, 2, 64), True, [WS_BWD, "flash_bwd_convert_dq_kernel"]), dict(softcap=30.0)),
    (backward, ((1, 260, 190, 4, 1, 64), True, [WS_BWD, "flash_bwd_convert_dq_kernel"]),
     dict(alibi_slopes=alibi, sinks=sinks)),
    (backward, ((1, 300, 250, 4, 2, 128), False, [WS_BWD]), dict(window_size=(100, 40))),
    # split by roles (above 128): dQ added from registers, 64-key blocks
    (backward, ((1, 200, 300, 4, 2, 256), True, [WS_BWD, "flash_bwd_convert_dq_kernel"])),
    (backward, ((2, 130, 77, 4, 4, 200), False, [WS_BWD])),
    (backward, ((1, 190, 260, 4, 2, 192), True, [WS_BWD]), dict(softcap=20.0, window_size=(80, 0))),
    (backward, ((1, 150, 170, 4, 1, 256), False, [WS_BWD]), dict(alibi_slopes=alibi, sinks=sinks)),
    # a bias (staged: 16-byte rows), its tiles copied by the producer's TMA: per head, a key
    # tail (304 keys); a row-broadcast (B, 1, 1, N) one; per batch, split by roles
    (backward, ((1, 200, 304, 4, 2, 128), True, [WS_BWD, WS_DBIAS]),
     dict(attn_bias=rand(1, 4, 200, 304), return_dbias=True)),
    (backward, ((2, 150, 264, 4, 2, 64), False, [WS_BWD]), dict(attn_bias=rand(2, 1, 1, 264))),
    (backward, ((2, 330, 264, 4, 2, 64), False, [WS_BWD, WS_DBIAS]),
     dict(attn_bias=rand(2, 1, 330, 264), return_dbias=True)),
    (backward, ((2, 130, 200, 4, 2, 256), False, [WS_BWD]), dict(attn_bias=rand(2, 1, 130, 200))),
    (backward, ((1, 190, 136, 4, 4, 192), True, [WS_BWD]), dict(attn_bias=rand(1, 4, 190, 136), sinks=sinks)),
    (forward, ((1, 300, 430, 4, 2, 128), False, [WS_FWD]), dict(attn_mask=mask)),
    (forward, ((1, 300, 430, 4, 2, 64), False, [WS_FWD]), dict(attn_mask=mask)),
    (forward, ((2, 700, 650, 4, 2, 128), True, [WS_FWD])),
    (forward, ((1, 513, 1000, 4, 4, 128), False, [WS_FWD]), dict(window_size=(200, 0), softcap=20.0)),
    (forward, ((1, 2100, 1900, 3, 1, 64), True, [WS_FWD])),  # D=64's 192-row tile (seqlen_q >= 2048)
    # the wide head_dims (64-key blocks), 200 and 136 with TMA's zero-filled columns
    (forward, ((2, 300, 333, 4, 2, 256), True, [WS_FWD])),
    (forward, ((1, 333, 517, 4, 2, 200), False, [WS_FWD]), dict(window_size=(100, 30), sinks=sinks)),
    (forward, ((1, 517, 300, 4, 1, 192), False, [WS_FWD]), dict(attn_mask=mask_tall)),
    (forward, ((2, 300, 333, 4, 2, 136), True, [WS_FWD]), dict(softcap=20.0)),
]
quick = "--quick" in sys.argv
seen = set()
for fn, args, *kw in cases:
    if quick and fn in seen:
        continue
    seen.add(fn)
    fn(*args, **(kw[0] if kw else {}))
    print(fn.__name__, args[0], kw[0].keys() if kw else "", "done", flush=True)

# packed: key tails inside the next sequence (the producer zeroes their V rows), D=128 and 64
cu_q = cp.asarray(np.array([0, 130, 131, 520], np.int32))
cu_k = cp.asarray(np.array([0, 200, 517, 700], np.int32))
for d in (128, 64):
    q, k, v = rand(520, 4, d), rand(700, 2, d), rand(700, 2, d)
    del names[:]
    out = cupyflash.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, 389, 317, causal=True)[0]
    assert WS_FWD in names, names
    finite(out)
cp.cuda.Device().synchronize()
print("ok")
