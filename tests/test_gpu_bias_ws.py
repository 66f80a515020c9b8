"""An additive bias on the warp-specialised forward (kernels_cu/flash_fwd_ws.cu with
VAR_BIAS: a bias of q's dtype read in pairs into registers), switched on at every head_dim
(dispatch.FWD_WS_BIAS; the default leaves D=64 on the cp.async kernel), on a
device that reports one SM (no split-KV); every test asserts that each forward it ran
was that kernel with the bias, in the mode asked for (persistent or one block per tile).

Against the float64 reference with tests/test_gpu_bias.py's rule, outputs NaN-poisoned,
``-inf`` in lse exact: every broadcast shape read in pairs (full, per head, per batch,
per key, rank 2, a stride-0 view), causal, tails (lengths not multiples of the tiles),
GQA, D=64, 128, 192 and 256 (176 padded), fp16 and bf16, ``-inf`` entries and rows that
see no key (out 0, lse -inf), the variants the kernel takes with a bias (a window,
softcap, ALiBi, sinks), and packed batches. The calls it does not take (an fp32 bias, a
bias with a mask or with dropout, a bias whose rows are not pair-aligned) stay on the
cp.async wgmma kernel. Skipped without a GPU and off compute capability 9.0.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_cpu_bias import SCALE as PACKED_SCALE  # sibling modules
from test_cpu_bias import _packed_reference
from test_gpu_bias import (BROADCAST, _bias, _check, _fwd, _inputs, _mask, _params, _score_shape,  # noqa: F401
                           cp, dead_rows)
from test_gpu_fwd_ws import WS_KERNEL, record_ws_modes, switch_ws_on
from test_gpu_variants import alibi_heads, dev, dtype_kw, host, sink_logits
from test_varlen import cu_seqlens, packed_inputs

import cupyflash
from cupyflash import testing

pytestmark = pytest.mark.gpu

BIAS = 32  # dispatch.VAR_BIAS (checked in ws_bias)

# id -> (dtype, (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), causal). Key
# lengths even: the bias's rows are then read in pairs (odd ones take VAR_BIAS_STRIDED,
# the cp.async kernel: test_the_calls_it_does_not_take).
CONFIGS = {
    "bf16-d64-200x334-gqa": ("bfloat16", (2, 200, 334, 4, 2, 64), False),
    "f16-d64-520x520-causal": ("float16", (1, 520, 520, 3, 3, 64), True),
    "f16-d128-257x190-causal": ("float16", (1, 257, 190, 4, 4, 128), True),   # top rows see no key
    "bf16-d128-400x778": ("bfloat16", (2, 400, 778, 4, 2, 128), False),
    "f16-d120-300x512": ("float16", (1, 300, 512, 2, 2, 120), False),         # padded to 128
    "bf16-d256-300x646-causal": ("bfloat16", (1, 300, 646, 2, 1, 256), True),
    "f16-d192-260x388-gqa": ("float16", (2, 260, 388, 4, 2, 192), False),
    "bf16-d176-200x256-causal": ("bfloat16", (1, 200, 256, 2, 2, 176), True),  # padded to 192
}
#: the broadcast shapes read in pairs (per-query's column stride is 0: element by element)
PAIRED = [name for name in BROADCAST if name != "per-query"]


def _record_ws_args(monkeypatch):
    """The template arguments of every ws kernel launched from now on (<T, HEAD_DIM, BLOCK_M,
    BLOCK_N, STAGES, IS_CAUSAL, EVEN_K, VARIANT, VARLEN, PERSISTENT>)."""
    from cupyflash import _launch

    seen = []
    real_call = _launch.Launcher.__call__

    def call(self, stream, *pointers, var=None):
        seen.extend(spec.args for spec in self.launches if spec.template.endswith(WS_KERNEL))
        real_call(self, stream, *pointers, var=var)

    monkeypatch.setattr(_launch.Launcher, "__call__", call)
    return seen


@pytest.fixture(params=[False, True], ids=["one-block-per-tile", "persistent"])
def ws_bias(request, monkeypatch, launches):
    """FWD_WS_BIAS on, the ws switch as test_gpu_fwd_ws.switch_ws_on sets it (FWD_WS_PERSISTENT
    as the parameter, a cc 9.0 device reporting one SM; conftest restores it), fresh plans;
    yields the template arguments of each ws launch (_record_ws_args), then checks that every
    forward was one, with the bias, persistent where asked and the kernel takes it."""
    from cupyflash import _gpu, dispatch

    persistent = request.param
    monkeypatch.setattr(dispatch, "FWD_WS_BIAS", True)
    switch_ws_on(monkeypatch, persistent, 1)  # (skips off cc 9.0)
    assert dispatch.VAR_BIAS == BIAS
    modes = _record_ws_args(monkeypatch)
    yield modes
    assert modes, "no ws launch"
    for args in modes:
        d, bits, varlen, walk = int(args[1]), int(args[7]), args[8] == "true", args[9] == "true"
        assert bits & BIAS and not bits & dispatch.VAR_BIAS_STAGED, modes
        assert walk == (persistent and dispatch.uses_persistent_ws(bits, varlen, d)), (modes, persistent)
    fwd = [name for name in launches if name.startswith("flash_fwd")]
    assert fwd and all(name == WS_KERNEL for name in fwd), fwd
    _gpu.clear_plans()


@pytest.mark.parametrize("config", list(_params(CONFIGS, CONFIGS)))
@pytest.mark.parametrize("shape_name", PAIRED)
def test_bias_every_paired_broadcast_shape(ws_bias, cp, rng, shape_name, config):
    dtype, shape, causal = CONFIGS[config]
    q, k, v = _inputs(rng, dtype, shape)
    bias = _bias(rng, BROADCAST[shape_name](*_score_shape(shape)), dtype)
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_bias": dev(cp, bias)})
    _check(q, k, v, fwd, causal, attn_bias=bias)


@pytest.mark.parametrize("config", list(_params(["f16-d128-257x190-causal", "bf16-d64-200x334-gqa",
                                                 "bf16-d256-300x646-causal", "f16-d192-260x388-gqa"], CONFIGS)))
def test_a_stride_0_view_and_a_slice_are_read_in_place(ws_bias, cp, rng, config):
    """A (1, H, N, N) bias broadcast to (B, H, N, N) by a stride-0 view, and the leading
    (N, N) block of a wider bias (row stride past the keys, still pair-aligned)."""
    dtype, shape, causal = CONFIGS[config]
    b, h, m, n = _score_shape(shape)
    q, k, v = _inputs(rng, dtype, shape)
    base = _bias(rng, (1, h, m, n), dtype)
    view = cp.broadcast_to(dev(cp, base), (b, h, m, n))
    _check(q, k, v, _fwd(cp, q, k, v, dtype, causal, {"attn_bias": view}), causal, attn_bias=base)
    wide = _bias(rng, (b, h, m + 3, n + 6), dtype)
    sliced = dev(cp, wide)[:, :, :m, :n]
    _check(q, k, v, _fwd(cp, q, k, v, dtype, causal, {"attn_bias": sliced}), causal,
           attn_bias=np.ascontiguousarray(wide[:, :, :m, :n]))


@pytest.mark.parametrize("config", list(_params(["f16-d128-257x190-causal", "bf16-d128-400x778",
                                                 "bf16-d64-200x334-gqa", "bf16-d256-300x646-causal"], CONFIGS)))
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_minus_inf_entries_and_rows_that_see_no_key(ws_bias, cp, rng, sinks, config):
    dtype, shape, causal = CONFIGS[config]
    b, h, m, n = _score_shape(shape)
    q, k, v = _inputs(rng, dtype, shape)
    dead = dead_rows(b, h, m)
    bias = _bias(rng, (b, h, m, n), dtype)
    bias[rng.random(bias.shape) < 0.2] = -np.inf  # scattered -inf entries mask too
    bias[dead] = -np.inf
    ref = {"attn_bias": bias}
    arrays = {"attn_bias": dev(cp, bias)}
    if sinks:
        ref["sinks"] = sink_logits(rng, h)
        arrays["sinks"] = cp.asarray(ref["sinks"])
    out, lse = _fwd(cp, q, k, v, dtype, causal, arrays)
    _check(q, k, v, (out, lse), causal, **ref)
    assert (out.astype(np.float32)[dead.transpose(0, 2, 1)] == 0).all()
    if sinks:  # the sink alone: lse = sinks[h] (rounded through log2 units)
        want = np.broadcast_to(ref["sinks"][None, :, None], lse.shape)
        assert np.allclose(lse[dead], want[dead], rtol=1e-5, atol=1e-5)
    else:
        assert (lse[dead] == -np.inf).all()


# id -> (causal: forced, or None: the config's; the variants given rng and nheads)
COMBOS = {
    "window": (False, lambda rng, h: {"window_size": (48, 16)}),
    "window+causal": (True, lambda rng, h: {"window_size": (64, -1)}),
    "softcap": (None, lambda rng, h: {"softcap": 5.0}),
    "alibi": (None, lambda rng, h: {"alibi_slopes": alibi_heads(h)}),
    "sinks": (None, lambda rng, h: {"sinks": sink_logits(rng, h)}),
    "alibi+sinks+softcap": (None, lambda rng, h: {"alibi_slopes": alibi_heads(h), "sinks": sink_logits(rng, h),
                                                  "softcap": 8.0}),
    "window+softcap+sinks": (True, lambda rng, h: {"window_size": (100, 0), "softcap": 8.0,
                                                   "sinks": sink_logits(rng, h)}),
}


@pytest.mark.parametrize("config", list(_params(["bf16-d64-200x334-gqa", "f16-d128-257x190-causal",
                                                 "bf16-d128-400x778", "f16-d192-260x388-gqa",
                                                 "bf16-d256-300x646-causal"], CONFIGS)))
@pytest.mark.parametrize("combo", list(COMBOS))
def test_bias_with_the_variants_it_takes(monkeypatch, launches, cp, rng, combo, config):
    """Each combination runs the ws kernel where it takes it (dispatch.uses_ws_fwd: not
    where _FWD_WS_SPILLS says it spills, e.g. a window beside the bias at 256), else the
    kernel the plan picks; the result matches either way."""
    from cupyflash import _gpu, dispatch

    dtype, shape, causal = CONFIGS[config]
    forced, make = COMBOS[combo]
    causal = causal if forced is None else forced
    b, h, m, n = _score_shape(shape)
    monkeypatch.setattr(dispatch, "FWD_WS_BIAS", True)
    switch_ws_on(monkeypatch, dispatch.FWD_WS_PERSISTENT, 1)  # (skips off cc 9.0)
    modes = record_ws_modes(monkeypatch)
    q, k, v = _inputs(rng, dtype, shape)
    others = make(rng, h)
    bias = _bias(rng, (1, h, m, n), dtype)
    on_gpu = {name: cp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in others.items()}
    fwd = _fwd(cp, q, k, v, dtype, causal, {"attn_bias": dev(cp, bias)}, **on_gpu)
    _check(q, k, v, fwd, causal, attn_bias=bias, **others)
    d = dispatch.padded_head_dim(shape[-1])
    bits = BIAS | sum(bit for name, bit in (("window_size", dispatch.VAR_WINDOW), ("softcap", dispatch.VAR_SOFTCAP),
                                            ("alibi_slopes", dispatch.VAR_ALIBI), ("sinks", dispatch.VAR_SINKS))
                      if name in others)
    if dispatch.uses_ws_fwd(d, True, (9, 0), bits):
        assert modes and all(mode[1] == bits for mode in modes), modes
    else:
        assert not modes, modes
    _gpu.clear_plans()


LENS_Q, LENS_K = [33, 0, 190, 1, 129], [70, 12, 160, 64, 130]


@pytest.mark.parametrize("dtype,head_dim", [("float16", 64), ("bfloat16", 128), ("float16", 256)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bias_shape", ["per-head", "full"])
def test_varlen_reads_each_sequence_s_block(ws_bias, cp, rng, bias_shape, causal, dtype, head_dim):
    """Packed batches (never persistent): each sequence reads its own (max_q, max_k) block of
    the bias, rows and keys past its lengths never read (the bias larger than the longest)."""
    nheads, nheads_kv = 4, 2
    q, k, v = packed_inputs(rng, LENS_Q, LENS_K, nheads, nheads_kv, head_dim, dtype)
    max_q, max_k = max(LENS_Q) + 3, max(LENS_K) + 2
    lead = (1, nheads) if bias_shape == "per-head" else (len(LENS_Q), nheads)
    ref = {"attn_bias": _bias(rng, (*lead, max_q, max_k), dtype)}
    d_q, d_k, d_v = (dev(cp, x) for x in (q, k, v))
    out, lse = cupyflash.flash_attn_varlen_fwd(
        d_q, d_k, d_v, cp.asarray(cu_seqlens(LENS_Q)), cp.asarray(cu_seqlens(LENS_K)), max_q, max_k,
        softmax_scale=PACKED_SCALE, causal=causal, **dtype_kw(cp, dtype),
        **{name: dev(cp, x) for name, x in ref.items()})
    refs = _packed_reference(q, k, v, testing.random_normal(rng, q.shape, dtype), LENS_Q, LENS_K, causal, **ref)
    for key, got in (("out", host(out, dtype)), ("lse", host(lse))):
        ref64, naive = refs[key]
        testing.assert_close_to_reference(key, got, ref64, naive, testing.OUT_FACTOR, 1e-3)


@pytest.mark.parametrize("how", ["fp32-bias", "bias+mask", "odd-row-stride", "bias+dropout"])
def test_the_calls_it_does_not_take(monkeypatch, launches, cp, rng, how):
    """An fp32 bias, a bias with a mask, and a bias whose rows are not pair-aligned stay on
    the cp.async wgmma kernel (flash_fwd_sm90.cu), and still match."""
    from cupyflash import _gpu, dispatch

    monkeypatch.setattr(dispatch, "FWD_WS_BIAS", True)
    switch_ws_on(monkeypatch, dispatch.FWD_WS_PERSISTENT, 1)  # (skips off cc 9.0)
    dtype, shape, causal = CONFIGS["bf16-d128-400x778"]
    q, k, v = _inputs(rng, dtype, shape)
    score_shape = _score_shape(shape)
    n = score_shape[3]
    if how == "odd-row-stride":  # the leading keys of a wider bias: rows of an odd length
        wide = _bias(rng, (*score_shape[:3], n + 1), dtype)
        ref = {"attn_bias": np.ascontiguousarray(wide[..., :n])}
        arrays = {"attn_bias": dev(cp, wide)[..., :n]}
    else:
        ref = {"attn_bias": _bias(rng, score_shape, "float32" if how == "fp32-bias" else dtype)}
        if how == "bias+mask":
            ref["attn_mask"] = _mask(rng, score_shape)
        arrays = {name: dev(cp, x) for name, x in ref.items()}
    if how == "bias+dropout":
        fwd = cupyflash.flash_attn_fwd(dev(cp, q), dev(cp, k), dev(cp, v), causal=causal, dropout_p=0.1,
                                       rng_state=(7, 0), **dtype_kw(cp, dtype), **arrays)
        assert np.isfinite(host(fwd[0], dtype)).all()
    else:
        fwd = _fwd(cp, q, k, v, dtype, causal, arrays)
        _check(q, k, v, fwd, causal, **ref)
    fwd_kernels = [name for name in launches if name.startswith("flash_fwd")]
    assert fwd_kernels and WS_KERNEL not in fwd_kernels and "flash_fwd_sm90_kernel" in fwd_kernels, fwd_kernels
    _gpu.clear_plans()
