"""Packed (varlen) batches on the warp-specialised TMA forward (kernels_cu/flash_fwd_ws.cu)
against the float64 reference, sequence by sequence; skipped without a GPU, and off
compute capability 9.0.

The switch (dispatch.FWD_WS) is on at every head_dim the kernel has, and each test
asserts that the forward's one launch is that kernel; each test runs twice, at D=64 with
128 and with 192 query rows per tile (one block per tile: packed batches are never
persistent, which the fixture checks with the persistent switch on). Ragged lengths: a sequence with
no query, one with no key, lengths that are not multiples of the 128-row tiles (so a
tile's rows past its sequence come from the next sequence, and past the last one from
the map's zero fill), q longer than k and the reverse (bottom-right causal rows that see
no key), GQA. Every CuPy allocation is NaN-poisoned: an output row the kernel skips, or
a row it writes into the next sequence's, shows up.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu_fwd_ws import check_ws_modes, record_ws_modes, switch_ws_on  # sibling modules
from test_gpu_variants import VARLEN_VARIANTS, dev, dtype_kw, host, on_xp
from test_varlen import cu_seqlens, packed_inputs, packed_reference

import cupyflash
from cupyflash import testing

pytestmark = pytest.mark.gpu

WS_KERNEL = "flash_fwd_ws_kernel"
FLOOR = 1e-3

# (lens_q, lens_k): ragged, with a length-0 sequence on each side, tails of every kind.
LAYOUTS = {
    "ragged": ((0, 1, 127, 129, 300, 513), (5, 0, 200, 129, 257, 100)),
    "q-gt-k": ((700, 3, 256), (90, 128, 255)),
    "one-long": ((1000,), (1333,)),
}


@pytest.fixture(params=["grid", "rows192"])
def ws_launches(request, monkeypatch, launches):
    """The switch on at every head_dim (fresh plans), one block per tile (packed batches
    are never persistent: dispatch.uses_persistent_ws; the switch is set to True here, and
    each launch is checked to have refused it), at D=64 with 128 or 192 query rows
    (dispatch.FWD_WS_D64_BLOCK_M; every test here runs both), on a cc 9.0 device; every
    CuPy allocation NaN-poisoned; yields the names of the kernels launched, and checks the
    mode and the tile of every ws launch (packed batches are never split, whatever the SM
    count)."""
    cp = pytest.importorskip("cupy")
    from cupyflash import _gpu, _launch, dispatch

    num_sms = _launch.num_sms(cp.cuda.Device().id)
    switch_ws_on(monkeypatch, True, num_sms)
    d64_block_m = 192 if request.param == "rows192" else 128
    monkeypatch.setattr(dispatch, "FWD_WS_D64_BLOCK_M", d64_block_m)
    monkeypatch.setattr(dispatch, "FWD_WS_WIDE_LOSES", 0)  # 192 rows with every variant the tile takes
    monkeypatch.setattr(dispatch, "FWD_WS_D64_WIDE_MIN_SEQLEN", 0)  # and at every seqlen
    tiles = []
    modes = record_ws_modes(monkeypatch, tiles)
    with testing.poisoned_allocations(cp):
        yield launches
    check_ws_modes(modes, True, num_sms, varlen=True)
    want = [dispatch.fwd_ws_block_m(d, bits, False, d64_block_m) for d, _, bits in tiles]
    assert [m for _, m, _ in tiles] == want, tiles
    _gpu.clear_plans()


def _forward(cp, lens_q, lens_k, nheads_q, nheads_kv, head_dim, dtype, causal, rng, max_extra=0, **variants):
    """Host inputs, and the GPU forward's host (out, lse)."""
    q, k, v = packed_inputs(rng, lens_q, lens_k, nheads_q, nheads_kv, head_dim, testing.resolve_dtype(dtype))
    args = (cp.asarray(cu_seqlens(lens_q)), cp.asarray(cu_seqlens(lens_k)), max(lens_q) + max_extra,
            max(lens_k) + max_extra)
    out, lse = cupyflash.flash_attn_varlen_fwd(dev(cp, q), dev(cp, k), dev(cp, v), *args, causal=causal,
                                               **dtype_kw(cp, q.dtype), **on_xp(cp, variants))
    assert out.shape == q.shape and lse.shape == (nheads_q, q.shape[0])
    return (q, k, v), host(out, q.dtype), host(lse)


def _check(inputs, out, lse, lens_q, lens_k, causal, **variants):
    q, k, v = inputs
    dout = np.zeros_like(q)
    refs = packed_reference(q, k, v, dout, cu_seqlens(lens_q), cu_seqlens(lens_k), causal, **variants)
    for name, got in (("out", out), ("lse", lse)):
        ref, naive = refs[name]
        testing.assert_close_to_reference(name, got, ref, naive, testing.OUT_FACTOR, FLOOR)


def _cases():
    cases = []
    for i, (name, (lens_q, lens_k)) in enumerate(LAYOUTS.items()):
        for causal in (False, True):
            # 104: 100 is never 16-byte aligned; 256 and 192: the wide tiles
            for j, head_dim in enumerate((128, 64, 104, 256, 192)):
                gqa = (1, 4)[(i + j) % 2]
                dtype = ("float16", "bfloat16")[(i + j + causal) % 2]
                cases.append(pytest.param(lens_q, lens_k, head_dim, dtype, causal, gqa,
                                          id=f"{name}-d{head_dim}-{dtype}-{'causal' if causal else 'full'}-gqa{gqa}"))
    return cases


@pytest.mark.parametrize("lens_q,lens_k,head_dim,dtype,causal,gqa", _cases())
def test_ws_varlen_matches_reference(ws_launches, rng, lens_q, lens_k, head_dim, dtype, causal, gqa):
    cp = pytest.importorskip("cupy")
    inputs, out, lse = _forward(cp, lens_q, lens_k, 2 * gqa, 2, head_dim, dtype, causal, rng)
    assert ws_launches == [WS_KERNEL]  # one launch for the whole batch, on the TMA kernel
    _check(inputs, out, lse, lens_q, lens_k, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ws_varlen_grid_past_the_longest_sequence(ws_launches, rng, causal):
    """max_seqlen above every length: the blocks past each sequence return without a store."""
    cp = pytest.importorskip("cupy")
    lens_q, lens_k = (70, 3, 129), (64, 200, 129)
    inputs, out, lse = _forward(cp, lens_q, lens_k, 4, 2, 128, "float16", causal, rng, max_extra=300)
    assert ws_launches == [WS_KERNEL]
    _check(inputs, out, lse, lens_q, lens_k, causal)


@pytest.mark.parametrize("name", list(VARLEN_VARIANTS))
def test_ws_varlen_variants(ws_launches, rng, name):
    """The ws variants per sequence: aligned to its own lengths, its row of (batch,
    nheads_q) ALiBi slopes, its dropout mask drawn at batch index b (the CPU path's
    varlen convention, test_varlen.sequence_variants)."""
    cp = pytest.importorskip("cupy")
    causal, make = VARLEN_VARIANTS[name]
    lens_q, lens_k = LAYOUTS["ragged"]
    variants = make(rng, len(lens_q), 8)
    inputs, out, lse = _forward(cp, lens_q, lens_k, 8, 2, 128, "float16", causal, rng, **variants)
    assert ws_launches == [WS_KERNEL]
    _check(inputs, out, lse, lens_q, lens_k, causal, **variants)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dirty", [1, 2], ids=["middle", "last"])
def test_ws_varlen_sequences_do_not_see_each_other(ws_launches, rng, head_dim, causal, dirty):
    """NaN in one sequence's q, k and v leaves every other sequence's out and lse
    bitwise as they were: the key block that runs on past the previous sequence's end
    copies the NaN sequence's rows, whose V the producer zeroes (P is 0 there, but
    0 x NaN is not), and its K scores are masked."""
    cp = pytest.importorskip("cupy")
    lens_q, lens_k = (20, 130, 131), (25, 140, 140)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q, k, v = packed_inputs(rng, lens_q, lens_k, 4, 2, head_dim, np.float16)

    def run(q, k, v):
        out, lse = cupyflash.flash_attn_varlen_fwd(dev(cp, q), dev(cp, k), dev(cp, v), cp.asarray(cu_q),
                                                   cp.asarray(cu_k), max(lens_q), max(lens_k), causal=causal)
        return host(out, q.dtype), host(lse)

    clean = run(q, k, v)
    _check((q, k, v), *clean, lens_q, lens_k, causal)
    for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k)):
        x[cu[dirty]:cu[dirty + 1]] = np.nan
    dirty_out = run(q, k, v)
    assert ws_launches == [WS_KERNEL] * 2
    rows = np.concatenate([np.arange(cu_q[b], cu_q[b + 1]) for b in range(len(lens_q)) if b != dirty])
    for got, want, axis in ((dirty_out[0], clean[0], 0), (dirty_out[1], clean[1], 1)):
        got, want = np.take(got, rows, axis), np.take(want, rows, axis)
        assert not np.isnan(got.astype(np.float32)).any()
        assert np.array_equal(got, want)
