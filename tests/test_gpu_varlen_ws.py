"""Packed (varlen) batches on the warp-specialised TMA forward (kernels_cu/flash_fwd_ws.cu)
against the float64 reference, sequence by sequence; skipped without a GPU, and off
compute capability 9.0.

The switch (dispatch.FWD_WS) is on at every head_dim the kernel has, and each test
asserts that the forward's one launch is that kernel; each test runs twice, one block per
tile and persistent (dispatch.FWD_WS_PERSISTENT). Ragged lengths: a sequence with
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


@pytest.fixture(params=["grid", "persistent", "rows192"])
def ws_launches(request, monkeypatch, launches):
    """The switch on at every head_dim (fresh plans), one block per tile, persistent, or
    one block per tile with D=64's 192-row tile (dispatch.FWD_WS_D64_BLOCK_M; every test
    here runs all three; persistent on a device that reports 3 SMs, so that each block
    walks many tiles, some past their sequence's end), on a cc 9.0 device; every CuPy
    allocation NaN-poisoned; yields the names of the kernels launched, and checks the mode
    and the tile of every ws launch (packed batches are never split, whatever the SM count)."""
    cp = pytest.importorskip("cupy")
    from cupyflash import _gpu, _launch, dispatch

    persistent = request.param == "persistent"
    num_sms = 3 if persistent else _launch.num_sms(cp.cuda.Device().id)
    switch_ws_on(monkeypatch, persistent, num_sms)
    d64_block_m = 192 if request.param == "rows192" else 128
    monkeypatch.setattr(dispatch, "FWD_WS_D64_BLOCK_M", d64_block_m)
    tiles = []
    modes = record_ws_modes(monkeypatch, tiles)
    with testing.poisoned_allocations(cp):
        yield launches
    check_ws_modes(modes, persistent, num_sms)
    want = [dispatch.fwd_ws_block_m(d, bits, persistent and dispatch.uses_persistent_ws(bits), d64_block_m)
            for d, _, bits in tiles]
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
            for j, head_dim in enumerate((128, 64, 104)):  # 104: 100 is never 16-byte aligned
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
