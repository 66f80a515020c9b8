"""The warp-specialised TMA forward (kernels_cu/flash_fwd_ws.cu) on the GPU against
the float64 reference, switched on (dispatch.FWD_WS) at every head_dim it has for each
test, each test run three times: one block per tile, persistent (dispatch.FWD_WS_PERSISTENT:
the fixture's one SM gives a grid of one block, which walks every tile), and one block per
tile with D=64 on its 192-row tile (dispatch.FWD_WS_D64_BLOCK_M: three consumer
warpgroups, where it takes the variant); skipped without a GPU, and off compute
capability 9.0.

Every case must run that kernel: the fixture reports one SM, so the split-KV heuristic
(which the warp-specialised kernel does not serve) never splits the small grids here,
and each test asserts the launch. Results are held to the naive rule with the naive
implementation in the inputs' dtype (test_gpu_fwd.check).

The variants it takes (dispatch.FWD_WS_VARIANTS: softcap, ALiBi, a window, sinks,
dropout) run through the public forward into NaN-poisoned outputs, alone and
combined, and are checked against the reference with the same variants
(test_gpu_variants' helpers; dropout with the Philox keep mask of its rng_state)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from test_gpu_fwd import check, make_inputs  # sibling modules
from test_gpu_variants import (_NO_BF16, OFFSET, SEED, alibi_batch_heads, alibi_heads, dev, for_reference, host,
                               poisoned, sink_logits)

import cupyflash
from cupyflash import testing
from cupyflash.testing import from_bf16_bits

pytestmark = pytest.mark.gpu

WS_KERNEL = "flash_fwd_ws_kernel"


def record_ws_modes(monkeypatch, tiles=None):
    """The PERSISTENT template argument, the VARIANT bits, the grid and HEAD_DIM of every ws kernel
    launched from now on (Launcher.__call__ wrapped, over conftest's ``launches`` recorder);
    and into ``tiles``, if given, each launch's (HEAD_DIM, BLOCK_M, VARIANT)."""
    from cupyflash import _launch

    modes = []
    real_call = _launch.Launcher.__call__

    def call(self, stream, *pointers, var=None):
        ws = [spec for spec in self.launches if spec.template.endswith(WS_KERNEL)]
        modes.extend((spec.args[-1] == "true", int(spec.args[7]), spec.grid[0], int(spec.args[1])) for spec in ws)
        if tiles is not None:
            tiles.extend((int(spec.args[1]), int(spec.args[2]), int(spec.args[7])) for spec in ws)
        real_call(self, stream, *pointers, var=var)

    monkeypatch.setattr(_launch.Launcher, "__call__", call)
    return modes


def check_ws_modes(modes, persistent, num_sms, varlen=False):
    """Every ws launch ran in the mode asked for (persistent: at most num_sms blocks), but
    for the variants (and packed batches) the persistent form does not take
    (dispatch.uses_persistent_ws)."""
    from cupyflash import dispatch

    assert modes, "no ws launch"
    assert all(p == (persistent and dispatch.uses_persistent_ws(bits, varlen, d)) for p, bits, _, d in modes), modes
    assert all(grid <= num_sms for p, _, grid, _ in modes if p), modes


def switch_ws_on(monkeypatch, persistent, num_sms):
    """dispatch.FWD_WS at every head_dim, FWD_WS_PERSISTENT as given, a cc 9.0 device that
    reports num_sms SMs (conftest restores it), fresh plans; skips off cc 9.0."""
    cp = pytest.importorskip("cupy")
    from cupyflash import _gpu, _launch, dispatch

    cc = tuple(int(c) for c in cp.cuda.Device().compute_capability)
    if cc != (9, 0):
        pytest.skip(f"the warp-specialised forward runs on compute capability 9.0; this GPU is {cc}")
    monkeypatch.setattr(dispatch, "FWD_WS", True)
    monkeypatch.setattr(dispatch, "FWD_WS_PERSISTENT", persistent)
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: num_sms)
    _gpu.clear_plans()


@pytest.fixture(params=["grid", "persistent", "rows192"])
def ws_on(request, monkeypatch, launches):
    """The switch on at every head_dim, one block per tile, persistent, or one block per
    tile with D=64's 192-row tile (dispatch.FWD_WS_D64_BLOCK_M; every test here runs all
    three), plans made afresh (conftest's fresh_plans), on a cc 9.0 device that reports one
    SM (no split-KV; a persistent grid of one block, which walks every tile); yields the
    names of the kernels launched, and checks the mode and the tile of every ws launch."""
    from cupyflash import _gpu, dispatch

    persistent = request.param == "persistent"
    switch_ws_on(monkeypatch, persistent, 1)
    d64_block_m = 192 if request.param == "rows192" else 128
    monkeypatch.setattr(dispatch, "FWD_WS_D64_BLOCK_M", d64_block_m)
    monkeypatch.setattr(dispatch, "FWD_WS_WIDE_LOSES", 0)  # 192 rows with every variant the tile takes
    monkeypatch.setattr(dispatch, "FWD_WS_D64_WIDE_MIN_SEQLEN", 0)  # and at every seqlen
    tiles = []
    modes = record_ws_modes(monkeypatch, tiles)
    yield launches
    check_ws_modes(modes, persistent, 1)
    want = [dispatch.fwd_ws_block_m(d, bits, persistent and dispatch.uses_persistent_ws(bits, False, d), d64_block_m)
            for d, _, bits in tiles]
    assert [m for _, m, _ in tiles] == want, tiles
    _gpu.clear_plans()


def _run(dev, dtype, scale, causal):
    """The forward into NaN-poisoned outputs (every allocation 0xFF); host float32 (out, lse)."""
    import cupy

    from cupyflash import _gpu

    with testing.poisoned_allocations(cupy):
        out, lse = _gpu.fwd(*dev, softmax_scale=scale, causal=causal, dtype=dtype)
        out, lse = out.get(), lse.get()
    out = from_bf16_bits(out) if dtype == "bfloat16" else out.astype(np.float32)
    return out, lse


def _check(host, out, lse, dtype, scale, causal):
    """The naive rule, the naive implementation in ``dtype`` (host holds float32 copies)."""
    check(host, out, lse, dtype, scale, causal)


# Lengths that are not multiples of the 128-row tiles, one block, several, q != k both ways.
SEQLENS = [(1, 1), (100, 100), (1000, 1000), (4097, 4097), (100, 1000), (1000, 100), (1, 4097), (129, 257)]


def _grid():
    """Every length pair, causal and not, at D=128 and 64; dtype and GQA alternate."""
    cases = []
    for i, (sq, sk) in enumerate(SEQLENS):
        for causal in (False, True):
            for j, d in enumerate((128, 64)):
                dtype = "bfloat16" if (i + j + causal) % 2 else "float16"
                gqa = 4 if (i + j) % 3 == 0 else 1
                cases.append((dtype, d, causal, sq, sk, gqa))
    return cases


@pytest.mark.parametrize("dtype,head_dim,causal,seqlen_q,seqlen_k,gqa", _grid())
def test_ws_fwd_matches_reference(ws_on, rng, dtype, head_dim, causal, seqlen_q, seqlen_k, gqa):
    batch = 2 if seqlen_q * seqlen_k < 4_000_000 else 1
    nheads_kv = 2
    host, dev = make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads_kv * gqa, nheads_kv, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _run(dev, dtype, scale, causal)
    assert ws_on == [WS_KERNEL]
    _check(host, out, lse, dtype, scale, causal)


# The wide head_dims (64-key blocks, O in 96 or 128 registers a thread): 192 and 256, and
# 136 and 200 below them (TMA's zero-filled columns); fewer lengths than the grid above.
WIDE_SEQLENS = [(100, 100), (1000, 1000), (1000, 100), (1, 4097), (129, 257)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", WIDE_SEQLENS)
@pytest.mark.parametrize("head_dim", [256, 192, 200, 136])
@pytest.mark.parametrize("causal", [False, True])
def test_ws_fwd_wide_head_dims(ws_on, rng, head_dim, causal, seqlen_q, seqlen_k):
    dtype = "bfloat16" if (head_dim + seqlen_q + causal) % 2 else "float16"
    host, dev = make_inputs(rng, dtype, 2, seqlen_q, seqlen_k, 4, 2, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _run(dev, dtype, scale, causal)
    assert ws_on == [WS_KERNEL]
    _check(host, out, lse, dtype, scale, causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [104, 40])
@pytest.mark.parametrize("causal", [False, True])
def test_ws_fwd_head_dim_below_the_tile(ws_on, rng, dtype, head_dim, causal):
    """head_dim < HEAD_DIM: TMA zero-fills the missing columns, the stores skip them.
    (Multiples of 8: TMA needs 16-byte strides; 100 would go to the mma.sync kernel.)"""
    host, dev = make_inputs(rng, dtype, 2, 333, 517, 4, 2, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _run(dev, dtype, scale, causal)
    assert ws_on == [WS_KERNEL]
    _check(host, out, lse, dtype, scale, causal)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_ws_fwd_strided_views(ws_on, rng, head_dim):
    """q, k, v as views into one packed (B, S, 3, H, D) tensor: the maps take the
    tensors' own row and head strides."""
    import cupy

    from cupyflash import _gpu

    qkv32 = rng.standard_normal((2, 777, 3, 4, head_dim), dtype=np.float32).astype(np.float16)
    qkv = cupy.asarray(qkv32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _gpu.fwd(q, k, v, softmax_scale=scale, causal=True)
    assert ws_on == [WS_KERNEL]
    host = [qkv32[:, :, i].astype(np.float32) for i in range(3)]
    _check(host, out.get().astype(np.float32), lse.get(), "float16", scale, True)


def test_ws_fwd_new_pointers_same_plan(ws_on, rng):
    """A second call with the same geometry at other addresses (one plan, maps encoded
    again) and a third at the first call's (maps from the cache)."""
    host_a, dev_a = make_inputs(rng, "bfloat16", 1, 640, 640, 4, 4, 128)
    host_b, dev_b = make_inputs(rng, "bfloat16", 1, 640, 640, 4, 4, 128)
    for host, dev in ((host_a, dev_a), (host_b, dev_b), (host_a, dev_a)):
        out, lse = _run(dev, "bfloat16", 128 ** -0.5, False)
        _check(host, out, lse, "bfloat16", 128 ** -0.5, False)
    assert ws_on == [WS_KERNEL] * 3


@pytest.mark.parametrize("head_dim", [64, 128])
def test_ws_fwd_fully_masked_rows(ws_on, rng, head_dim):
    """causal with seqlen_q > seqlen_k: rows that see no key give out 0 and lse -inf,
    and whole query blocks with no key block too."""
    host, dev = make_inputs(rng, "float16", 1, 400, 50, 2, 2, head_dim)
    out, lse = _run(dev, "float16", 0.125, True)
    assert ws_on == [WS_KERNEL]
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[:, :350], 0)
    assert np.all(lse[:, :, :350] == -np.inf)
    _check(host, out, lse, "float16", 0.125, True)


@pytest.mark.parametrize("causal", [False, True])
def test_ws_fwd_long(ws_on, rng, causal):
    """16k tokens at D=128 (the shape it is measured at), checked on a row subset."""
    import cupy

    from cupyflash import _gpu, reference

    host, dev = make_inputs(rng, "bfloat16", 1, 16384, 16384, 2, 2, 128)
    with testing.poisoned_allocations(cupy):
        out, lse = _gpu.fwd(*dev, softmax_scale=128 ** -0.5, causal=causal, dtype="bfloat16")
        out, lse = from_bf16_bits(out.get()), lse.get()
    assert ws_on == [WS_KERNEL]
    rows = np.r_[0:130, 8100:8230, 16254:16384]
    q, k, v = host
    ref_out, ref_lse = reference.attention_fwd(q[:, rows], k, v, 128 ** -0.5, False) if not causal else (None, None)
    if causal:  # each row i sees keys 0..i (seqlen_q == seqlen_k)
        ref_out = np.empty((1, len(rows), 2, 128))
        ref_lse = np.empty((1, 2, len(rows)))
        for n, i in enumerate(rows):
            o, l_ = reference.attention_fwd(q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1], 128 ** -0.5, False)
            ref_out[:, n], ref_lse[:, :, n] = o[:, 0], l_[:, :, 0]
    np.testing.assert_allclose(out[:, rows], ref_out, atol=2e-2, rtol=0)
    np.testing.assert_allclose(lse[:, :, rows], ref_lse, atol=1e-3, rtol=1e-4)


# ----------------------------------------------------------------------------
# Variants: softcap, ALiBi, a window, sinks, dropout (dispatch.FWD_WS_VARIANTS)
# ----------------------------------------------------------------------------

# id -> (dtype, (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), causal); no
# length a multiple of the 128-row / 128-key tiles
VARIANT_CONFIGS = {
    "bf16-d128-1000x1000-gqa": ("bfloat16", (2, 1000, 1000, 8, 2, 128), False),
    "f16-d128-777x1333-causal": ("float16", (1, 777, 1333, 4, 4, 128), True),
    "f16-d128-1000x300-mqa-causal": ("float16", (1, 1000, 300, 4, 1, 128), True),  # top 700 rows see no key
    "bf16-d64-333x517-gqa": ("bfloat16", (2, 333, 517, 4, 2, 64), False),
    "f16-d256-333x517-causal": ("float16", (1, 333, 517, 4, 2, 256), True),
    "bf16-d192-1000x300-gqa": ("bfloat16", (1, 1000, 300, 8, 2, 192), False),
}

# id -> (the variants given rng and the shape, softmax_scale as a multiple of 1/sqrt(head_dim))
VARIANTS_ALONE = {
    "softcap": (lambda rng, s: {"softcap": 5.0}, 2.0),
    "alibi": (lambda rng, s: {"alibi_slopes": alibi_batch_heads(rng, s[0], s[3])}, 1.0),
    "sinks": (lambda rng, s: {"sinks": sink_logits(rng, s[3])}, 1.0),
    # masked blocks at both edges and unmasked ones between them, at 128-row blocks
    "window-300-200": (lambda rng, s: {"window_size": (300, 200)}, 1.0),
    "window-64-0": (lambda rng, s: {"window_size": (64, 0)}, 1.0),
    "window-0-64": (lambda rng, s: {"window_size": (0, 64)}, 1.0),
    "window-32-8": (lambda rng, s: {"window_size": (32, 8)}, 1.0),  # q > k: rows i < sq - sk - 8 see none
    "dropout": (lambda rng, s: {"dropout_p": 0.17, "rng_state": (SEED, OFFSET)}, 1.0),
}

# id -> (causal: forced, or None for the config's; the variants given rng and the shape)
VARIANT_COMBOS = {
    "softcap+alibi": (None, lambda rng, s: {"softcap": 5.0, "alibi_slopes": alibi_heads(s[3])}),
    "window+causal": (True, lambda rng, s: {"window_size": (200, -1)}),
    "sinks+window": (None, lambda rng, s: {"window_size": (150, 40), "sinks": sink_logits(rng, s[3])}),
    "window+dropout": (None, lambda rng, s: {"window_size": (256, 64), "dropout_p": 0.3,
                                             "rng_state": (SEED, OFFSET)}),
    "all": (True, lambda rng, s: {"window_size": (256, 0), "softcap": 8.0,
                                  "alibi_slopes": alibi_batch_heads(rng, s[0], s[3]),
                                  "sinks": sink_logits(rng, s[3]), "dropout_p": 0.25,
                                  "rng_state": (SEED, OFFSET)}),
}


def _on_gpu(variants):
    """The variants as the public forward takes them on the GPU (arrays moved there)."""
    import cupy

    return {name: cupy.asarray(x) if isinstance(x, np.ndarray) else x for name, x in variants.items()}


def run_variant(ws_on, rng, dtype, shape, causal, variants, softmax_scale=None):
    """Fresh inputs; the public forward with ``variants`` into poisoned outputs, asserted to
    run the warp-specialised kernel alone. Returns the host ``(q, k, v)`` and ``(out, lse)``."""
    import cupy

    batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim = shape
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, dtype)
    dtype_kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    with testing.poisoned_allocations(cupy):
        out, lse = cupyflash.flash_attn_fwd(
            dev(cupy, q), dev(cupy, k), dev(cupy, v), softmax_scale=softmax_scale, causal=causal,
            out=poisoned(cupy, q.shape, dtype), lse=poisoned(cupy, (batch, nheads_q, seqlen_q), np.float32),
            **dtype_kw, **_on_gpu(variants))
        out, lse = host(out, dtype), host(lse)
    assert ws_on == [WS_KERNEL]
    return (q, k, v), (out, lse)


def check_variant(inputs, fwd, causal, variants, softmax_scale=None):
    q, k, v = inputs
    ref_kw = for_reference(variants, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    testing.assert_fwd_matches_reference(q, k, v, *fwd, softmax_scale=softmax_scale, causal=causal, floor=1e-3,
                                         **ref_kw)


def _variant_configs(names):
    return [pytest.param(n, marks=_NO_BF16 if VARIANT_CONFIGS[n][0] == "bfloat16" else (), id=n) for n in names]


@pytest.mark.parametrize("config", _variant_configs(VARIANT_CONFIGS))
@pytest.mark.parametrize("variant", list(VARIANTS_ALONE))
def test_ws_variant_alone(ws_on, rng, variant, config):
    dtype, shape, causal = VARIANT_CONFIGS[config]
    make, scale_mult = VARIANTS_ALONE[variant]
    variants = make(rng, shape)
    scale = scale_mult / math.sqrt(shape[-1])
    inputs, fwd = run_variant(ws_on, rng, dtype, shape, causal, variants, scale)
    check_variant(inputs, fwd, causal, variants, scale)


# (at D=256 not a window with dropout, which spills in the ws kernel: dispatch._FWD_WS_SPILLS
# sends it to the mma.sync kernel, test_dispatch_ws.test_ws_spills_at_256)
COMBO_CONFIGS = ["bf16-d128-1000x1000-gqa", "f16-d128-777x1333-causal", "bf16-d64-333x517-gqa",
                 "f16-d256-333x517-causal", "bf16-d192-1000x300-gqa"]
COMBO_CASES = [(combo, config) for config in COMBO_CONFIGS for combo in VARIANT_COMBOS
               if not (VARIANT_CONFIGS[config][1][-1] == 256 and combo in ("window+dropout", "all"))]


@pytest.mark.parametrize("combo,config", [
    pytest.param(combo, config, marks=_NO_BF16 if VARIANT_CONFIGS[config][0] == "bfloat16" else (),
                 id=f"{combo}-{config}") for combo, config in COMBO_CASES])
def test_ws_variant_combination(ws_on, rng, combo, config):
    dtype, shape, causal = VARIANT_CONFIGS[config]
    forced, make = VARIANT_COMBOS[combo]
    causal = causal if forced is None else forced
    variants = make(rng, shape)
    inputs, fwd = run_variant(ws_on, rng, dtype, shape, causal, variants)
    check_variant(inputs, fwd, causal, variants)


# id -> (shape, causal, the variants given rng, the rows that see no key)
WS_EMPTY_ROWS = {
    # off = -900: row i sees keys up to i - 892; query blocks 0-5 see no key block at all
    "window-32-8": ((2, 1000, 100, 4, 2, 128), False, lambda rng: {"window_size": (32, 8)}, np.s_[:892]),
    # causal with a left edge: rows i < 700 see none (blocks 0-4 wholly)
    "causal+window+softcap+alibi": ((1, 1000, 300, 4, 1, 128), True,
                                    lambda rng: {"window_size": (40, -1), "softcap": 5.0,
                                                 "alibi_slopes": alibi_heads(4)}, np.s_[:700]),
}


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", list(WS_EMPTY_ROWS))
def test_ws_window_rows_that_see_no_key(ws_on, rng, case, with_sinks):
    """A query block whose window holds no key block copies none (the producer and both
    consumers skip the key loop) and still writes out 0 and lse -inf (with sinks: the
    sink's, as the reference defines); the rows around it within the rule; no NaN."""
    check_rows_that_see_no_key(ws_on, rng, case, with_sinks)


def check_rows_that_see_no_key(launches, rng, case, with_sinks):
    """WS_EMPTY_ROWS[case] (with a sink per head or not): its empty rows get out 0 and lse
    -inf (the sink's with sinks), the rest is within the rule, nothing is NaN."""
    shape, causal, make, empty = WS_EMPTY_ROWS[case]
    variants = make(rng)
    if with_sinks:
        variants["sinks"] = rng.uniform(-2.0, 2.0, shape[3]).astype(np.float32)
    inputs, (out, lse) = run_variant(launches, rng, "float16", shape, causal, variants)
    assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(lse).any()
    assert (out[:, empty] == 0).all()
    if with_sinks:
        np.testing.assert_allclose(lse[:, :, empty], np.broadcast_to(variants["sinks"][None, :, None],
                                                                     lse[:, :, empty].shape), rtol=1e-5, atol=1e-5)
    else:
        assert (lse[:, :, empty] == -np.inf).all()
    check_variant(inputs, (out, lse), causal, variants)


# (causal, window_size or None) of test_ws_variant_long
LONG_WINDOWS = [(False, None), (True, (1000, -1)), (False, (2048, 512))]


def long_variants(rng, window):
    """test_ws_variant_long's variants: softcap and sinks (neither depends on a position),
    and the window if any."""
    variants = {"softcap": 10.0, "sinks": sink_logits(rng, 2)}
    return variants if window is None else {**variants, "window_size": window}


@_NO_BF16
@pytest.mark.parametrize("causal,window", LONG_WINDOWS)
def test_ws_variant_long(ws_on, rng, causal, window):
    """16k tokens at D=128 with softcap, sinks and (here) a window: many unmasked blocks
    between the masked edges, the shape the window bar is measured at; checked on a row
    subset, each row against the reference of the keys it sees."""
    import cupy

    from cupyflash import reference

    seqlen = 16384
    variants = long_variants(rng, window)
    q, k, v = testing.random_qkv(rng, 1, seqlen, seqlen, 2, 2, 128, "bfloat16")
    with testing.poisoned_allocations(cupy):
        out, lse = cupyflash.flash_attn_fwd(dev(cupy, q), dev(cupy, k), dev(cupy, v), causal=causal,
                                            dtype="bfloat16", **_on_gpu(variants))
        out, lse = host(out, "bfloat16").astype(np.float32), host(lse)
    assert ws_on == [WS_KERNEL]
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right
    position_free = {name: x for name, x in variants.items() if name != "window_size"}
    rows = np.r_[0:130, 8100:8230, 16254:16384]
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref_out = np.empty((1, len(rows), 2, 128))
    ref_lse = np.empty((1, 2, len(rows)))
    for n, i in enumerate(rows):  # row i (seqlen_q == seqlen_k) sees keys lo..hi
        lo = 0 if left < 0 else max(0, i - left)
        hi = seqlen - 1 if right < 0 else min(seqlen - 1, i + right)
        o, l_ = reference.attention_fwd(q64[:, i:i + 1], k64[:, lo:hi + 1], v64[:, lo:hi + 1], 128 ** -0.5, False,
                                        **position_free)
        ref_out[:, n], ref_lse[:, :, n] = o[:, 0], l_[:, :, 0]
    np.testing.assert_allclose(out[:, rows], ref_out, atol=2e-2, rtol=0)
    np.testing.assert_allclose(lse[:, :, rows], ref_lse, atol=1e-3, rtol=1e-4)
