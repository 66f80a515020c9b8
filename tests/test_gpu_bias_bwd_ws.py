"""An additive bias on the warp-specialised backward (kernels_cu/flash_bwd_ws.cu with
WS_BWD_BIAS: a bias of q's dtype with 16-byte rows, copied by the producer's TMA beside
each step's Q and dO and read transposed from shared memory), switched on at every
head_dim (dispatch.BWD_WS_BIAS), on cc 9.0. Every test asserts which kernels ran: the ws
kernel with the bias bits wherever the plan should take it, and never where it should not.

Against the float64 reference with tests/test_gpu_bias_bwd.py's rule (dq, dk, dv within
3x the naive same-dtype error plus a floor; dbias from the dbias kernel, checked too),
outputs NaN-poisoned: the broadcast shapes the kernel stages (full, per head, per batch,
a row-broadcast (B, 1, 1, N) bias, rank 2), a stride-0 view and a slice of a wider bias
(read in place), ``-inf`` entries and rows that see no key (zero dq and dbias rows),
query and key tails, GQA, seqlen_q > seqlen_k under causal, D=64, 128, 192 and 256 (120
padded to 128), fp16 and bf16, and the variants beside the bias. The calls it does not
take (an fp32 bias, a bias with a mask, unaligned rows, reversed rows, a bias broadcast
along the keys, deterministic mode) stay on the other kernels. Skipped without a GPU and off cc 9.0.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu_bias_bwd import BROADCAST, SEED, OFFSET, _score_shape, bias_values, check, cp, keep_mask, run  # noqa: F401

pytestmark = pytest.mark.gpu

WS = "flash_bwd_ws_kernel"
DBIAS_WS = "flash_bwd_dbias_ws_kernel"
BIAS_BITS = 32 | 512  # dispatch.BWD_WS_BIAS_VARIANTS (checked in ws_bwd)

# id -> (dtype, (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), causal); seqlen_k
# a multiple of 8 (16-byte bias rows: staged), not of the 128 (64) keys of a block
CONFIGS = {
    "f16-d64-gqa": ("float16", (2, 200, 336, 4, 2, 64), False),
    "bf16-d128-causal": ("bfloat16", (2, 333, 200, 4, 2, 128), True),  # top rows see no key
    "f16-d128-520": ("float16", (1, 520, 520, 3, 3, 128), False),
    "f16-d120-causal": ("float16", (1, 300, 512, 2, 2, 120), True),    # padded to 128
    "bf16-d192-gqa": ("bfloat16", (2, 260, 392, 4, 2, 192), False),
    "f16-d256-causal": ("float16", (1, 300, 648, 2, 1, 256), True),
}
#: the broadcast shapes the ws kernel takes (per-row's key stride is 0: not staged), and a
#: row-broadcast bias per head (its map: one row, every head)
SHAPES = {**{name: f for name, f in BROADCAST.items() if name != "per-row"},
          "per-key-head": lambda b, h, m, n: (1, h, 1, n)}


def _configs(names=None):
    return [pytest.param(*CONFIGS[n], id=n) for n in (names or CONFIGS)]


class _Seen(list):
    """The ws backward launches' template arguments; ``dbias``: the ws dbias kernel's."""

    def __init__(self):
        super().__init__()
        self.dbias = []

    def clear(self):
        super().clear()
        self.dbias.clear()


def _dbias_ws_expected(shape, dbias_shape, extra=0):
    """Whether the plan takes the ws dbias kernel (dispatch.uses_ws_dbias): the bias alone at
    padded head_dim 64 or 128, dbias with the sequence's rows and keys."""
    from cupyflash import dispatch

    return (not extra and dispatch.padded_head_dim(shape[5]) in (64, 128)
            and tuple(dbias_shape[-2:]) == (shape[1], shape[2]))


def _assert_dbias_ws(seen, expected):
    assert bool(seen.dbias) == expected and len(seen.dbias) <= 1, (seen.dbias, expected)
    if expected:
        assert int(seen.dbias[0][-1]) == BIAS_BITS, seen.dbias


@pytest.fixture
def ws_bwd(monkeypatch):
    """The ws backward on with BWD_WS_BIAS at every head_dim and the ws dbias kernel at its
    head_dims (BWD_DBIAS_WS), fresh plans, cc 9.0 only; yields the template arguments of each
    ws backward launch (<T, HEAD_DIM, BLOCK_M, IS_CAUSAL, EVEN_K, WITH_DQ, VARIANT>), and in
    its ``dbias`` those of each ws dbias launch (<T, HEAD_DIM, IS_CAUSAL, VARIANT>)."""
    from cupyflash import _gpu, _launch, dispatch

    if _launch.compute_capability(0) != (9, 0):
        pytest.skip("the warp-specialised backward needs compute capability 9.0")
    assert dispatch.BWD_WS_BIAS_VARIANTS == BIAS_BITS
    monkeypatch.setattr(dispatch, "BWD_WS", True)
    monkeypatch.setattr(dispatch, "BWD_WS_BIAS", dispatch.BWD_WS_HEAD_DIMS)
    monkeypatch.setattr(dispatch, "BWD_DBIAS_WS", dispatch.BWD_DBIAS_WS_HEAD_DIMS)
    _gpu.clear_plans()
    seen = _Seen()
    real_call = _launch.Launcher.__call__

    def call(self, stream, *pointers, var=None):
        seen.extend(spec.args for spec in self.launches if spec.template.endswith(WS))
        seen.dbias.extend(spec.args for spec in self.launches if spec.template.endswith(DBIAS_WS))
        real_call(self, stream, *pointers, var=var)

    monkeypatch.setattr(_launch.Launcher, "__call__", call)
    yield seen
    _gpu.clear_plans()


def _assert_ws_bias(seen, extra=0):
    """One ws backward launch, with the bias bits and ``extra`` (the other variants)."""
    assert len(seen) == 1 and int(seen[0][-1]) == BIAS_BITS | extra, seen


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype,shape,causal", _configs())
def test_every_staged_broadcast_shape(ws_bwd, cp, rng, dtype, shape, causal, name):
    bias = bias_values(rng, SHAPES[name](*_score_shape(shape)), dtype)
    check(*run(cp, rng, dtype, shape, causal, bias=bias), causal)
    _assert_ws_bias(ws_bwd)
    _assert_dbias_ws(ws_bwd, _dbias_ws_expected(shape, bias.shape))


@pytest.mark.parametrize("dtype,shape,causal", _configs(["f16-d64-gqa", "bf16-d128-causal", "f16-d256-causal"]))
def test_a_stride_0_view_and_a_slice_are_read_in_place(ws_bwd, cp, rng, dtype, shape, causal):
    """A (1, H, N, N) bias broadcast to (B, H, N, N) by a stride-0 view; the leading (N, N)
    block of a wider bias (8 keys wider: its rows still 16-byte aligned), offset by 8 keys."""
    full = b, h, m, n = _score_shape(shape)
    base = bias_values(rng, (1, h, m, n), dtype)
    view = lambda x: (cp if not isinstance(x, np.ndarray) else np).broadcast_to(x, full)  # noqa: E731
    inputs, fwd, grads, scores = run(cp, rng, dtype, shape, causal, bias=base, view=view)
    check(inputs, fwd, grads, scores, causal)
    _assert_ws_bias(ws_bwd)
    _assert_dbias_ws(ws_bwd, _dbias_ws_expected(shape, full))  # (dbias of the view's shape: per element)
    ws_bwd.clear()
    wide = bias_values(rng, (b, h, m + 3, n + 16), dtype)
    inputs, fwd, grads, scores = run(cp, rng, dtype, shape, causal, bias=wide,
                                     view=lambda x: x[:, :, 2:2 + m, 8:8 + n])
    assert not scores[0].flags.c_contiguous
    check(inputs, fwd, grads, scores, causal)
    _assert_ws_bias(ws_bwd)


@pytest.mark.parametrize("dtype,shape,causal", _configs())
def test_minus_inf_entries_and_rows_that_see_no_key(ws_bwd, cp, rng, dtype, shape, causal):
    """A quarter of the entries -inf at random, rows 3 and 20 of (batch 0, head 1) and row
    30 of every head of the last batch -inf entirely: zero out, dq and dbias rows there,
    zero dbias wherever hidden, nothing NaN, the rest as the reference."""
    score_shape = batch, nheads, _, _ = _score_shape(shape)
    hidden = rng.random(score_shape) < 0.25
    hidden[0, 1, [3, 20]] = True
    hidden[-1, :, 30] = True
    bias = bias_values(rng, score_shape, dtype)
    bias[hidden] = -np.inf
    inputs, fwd, grads, scores = run(cp, rng, dtype, shape, causal, bias=bias)
    _assert_ws_bias(ws_bwd)
    _assert_dbias_ws(ws_bwd, _dbias_ws_expected(shape, score_shape))
    out, lse = fwd
    dq, dbias = grads[0], grads[-1]
    for b, h, i in [(0, 1, 3), (0, 1, 20)] + [(batch - 1, h, 30) for h in range(nheads)]:
        assert lse[b, h, i] == -np.inf
        assert (out[b, i, h] == 0).all() and (dq[b, i, h] == 0).all() and (dbias[b, h, i] == 0).all()
    assert (np.asarray(dbias, np.float32)[hidden] == 0).all()
    check(inputs, fwd, grads, scores, causal)


# id -> (variants, softmax_scale as a multiple of 1/sqrt(head_dim), their VARIANT bits)
WITH = {
    "window": ({"window_size": (48, 16)}, 1.0, 1),
    "softcap": ({"softcap": 5.0}, 2.0, 2),
    "alibi": ({"alibi_slopes": np.linspace(0.05, 0.4, 4, dtype=np.float32)}, 1.0, 4),
    "sinks": ({"sinks": np.array([1.0, 3.0, -np.inf, 2.0], np.float32)}, 1.0, 8),
    "dropout": ({"dropout_p": 0.2, "rng_state": (SEED, OFFSET)}, 1.0, 16),
    "window-sinks": ({"window_size": (64, -1), "sinks": np.array([1.0, 3.0, -np.inf, 2.0], np.float32)}, 1.0, 9),
}


@pytest.mark.parametrize("name", list(WITH))
@pytest.mark.parametrize("dtype,shape,causal", _configs())
def test_with_the_other_variants(ws_bwd, cp, rng, dtype, shape, causal, name):
    """The ws kernel where it takes the set (dispatch.bwd_ws_takes: not where it spills),
    else the cp.async or mma.sync kernels; the result matches either way."""
    from cupyflash import dispatch

    variants, scale, bits = WITH[name]
    nheads = shape[3]
    variants = {k: (v[:nheads] if isinstance(v, np.ndarray) else v) for k, v in variants.items()}
    softmax_scale = scale / np.sqrt(shape[5])
    bias = bias_values(rng, (shape[0], 1, shape[1], shape[2]), dtype)
    check(*run(cp, rng, dtype, shape, causal, bias=bias, variants=variants, softmax_scale=softmax_scale),
          causal, variants, softmax_scale)
    if dispatch.bwd_ws_takes(BIAS_BITS | bits, dispatch.padded_head_dim(shape[5])):
        _assert_ws_bias(ws_bwd, bits)
    else:
        assert not ws_bwd
    assert not ws_bwd.dbias, ws_bwd.dbias  # (the ws dbias kernel takes the bias alone)


# id -> (the bias's dtype, with a mask, the view taken of it, the base's extra keys, deterministic)
NOT_TAKEN = {
    "fp32-bias": ("float32", False, None, 0, False),
    "bias-and-mask": ("q", True, None, 0, False),
    "unaligned-rows": ("q", False, lambda x: x[..., 1:], 1, False),  # rows start at an odd key
    "reversed-rows": ("q", False, lambda x: x[:, :, ::-1], 0, False),  # staged, but no TMA map
    "deterministic": ("q", False, None, 0, True),
}


@pytest.mark.parametrize("name", list(NOT_TAKEN))
@pytest.mark.parametrize("dtype,shape,causal", _configs(["f16-d64-gqa", "bf16-d128-causal", "f16-d256-causal"]))
def test_the_calls_it_does_not_take(ws_bwd, cp, rng, dtype, shape, causal, name):
    bias_dtype, with_mask, view, extra, deterministic = NOT_TAKEN[name]
    b, h, m, n = _score_shape(shape)
    bias = bias_values(rng, (1, h, m, n + extra), dtype if bias_dtype == "q" else bias_dtype)
    mask = keep_mask(rng, (b, 1, m, n), 0.8) if with_mask else None
    inputs, fwd, grads, scores = run(cp, rng, dtype, shape, causal, bias=bias, mask=mask, view=view,
                                     deterministic=deterministic)
    check(inputs, fwd, grads, scores, causal)
    assert not ws_bwd, ws_bwd  # (no ws launch at all: none of these is a plain call either)


@pytest.mark.parametrize("dtype,shape,causal", _configs(["bf16-d128-causal", "f16-d64-gqa"]))
def test_a_key_broadcast_bias_stays_off_it(ws_bwd, cp, rng, dtype, shape, causal):
    """(B, 1, M, 1): its key stride is 0, so its tile is not staged (no TMA map)."""
    bias = bias_values(rng, BROADCAST["per-row"](*_score_shape(shape)), dtype)
    check(*run(cp, rng, dtype, shape, causal, bias=bias), causal)
    assert not ws_bwd, ws_bwd


@pytest.mark.parametrize("name", ["per-head", "per-batch", "full"])
@pytest.mark.parametrize("dtype,shape,causal", _configs(["f16-d64-gqa", "bf16-d128-causal", "f16-d128-520"]))
def test_ws_dbias_is_deterministic(ws_bwd, cp, rng, dtype, shape, causal, name):
    """The ws dbias kernel sums each plane's visits in a fixed order, no atomics: the same
    inputs give the same bits."""
    import cupyflash

    from test_gpu_variants import dev, dtype_kw

    b, h, m, n = _score_shape(shape)
    bias = dev(cp, bias_values(rng, BROADCAST[name](b, h, m, n), dtype))
    q, k, v, dout = (dev(cp, x) for x in (bias_values(rng, (b, m, h, shape[5]), dtype),
                                          bias_values(rng, (b, n, shape[4], shape[5]), dtype),
                                          bias_values(rng, (b, n, shape[4], shape[5]), dtype),
                                          bias_values(rng, (b, m, h, shape[5]), dtype)))
    kw = dict(causal=causal, attn_bias=bias, **dtype_kw(cp, dtype))
    out, lse = cupyflash.flash_attn_fwd(q, k, v, **kw)
    first = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, return_dbias=True, **kw)[-1]
    again = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, return_dbias=True, **kw)[-1]
    assert ws_bwd.dbias and bytes(cp.asnumpy(first).tobytes()) == bytes(cp.asnumpy(again).tobytes())
