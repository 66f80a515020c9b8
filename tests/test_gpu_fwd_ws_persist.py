"""The persistent ws forward (dispatch.FWD_WS_PERSISTENT, kernels_cu/tile_scheduler.cuh) on
grids of several blocks, each walking many tiles (test_gpu_fwd_ws and test_gpu_varlen_ws run
every case persistent too, on one block or three): the device reports 3 or 7 SMs, so the
walk's odd rounds (the snake: tile k·grid + grid - 1 - b) and a last round that only some
blocks have are taken; causal tiles of every weight and tiles that see no key fall
anywhere in a block's walk (a packed batch is never persistent: it is checked to run one
block per tile). Against the float64
reference (the naive rule in the inputs' dtype); skipped without a GPU, off cc 9.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from test_gpu_fwd import make_inputs  # sibling modules
from test_gpu_fwd_ws import (WS_EMPTY_ROWS, WS_KERNEL, _check, _run, check_rows_that_see_no_key, check_variant,
                             check_ws_modes, record_ws_modes, run_variant, switch_ws_on)
from test_gpu_variants import OFFSET, SEED, alibi_batch_heads, sink_logits
from test_gpu_varlen_ws import _check as check_packed
from test_gpu_varlen_ws import _forward as packed_forward

from cupyflash import testing

pytestmark = pytest.mark.gpu


@dataclass
class Walk:
    launches: list  # the kernels launched (conftest's recorder)
    modes: list  # the ws launches' (persistent, VARIANT, grid, HEAD_DIM)
    varlen: bool = False  # a packed batch: never persistent (dispatch.uses_persistent_ws)


@pytest.fixture(params=[3, 7], ids=["3sm", "7sm"])
def walk(request, monkeypatch, launches):
    """Persistent on a device that reports request.param SMs; every ws launch is checked
    to have run persistent (a packed batch's, one block per tile) when the test ends."""
    from cupyflash import _gpu

    switch_ws_on(monkeypatch, True, request.param)
    w = Walk(launches, record_ws_modes(monkeypatch))
    yield w
    check_ws_modes(w.modes, True, request.param, varlen=w.varlen)
    _gpu.clear_plans()


def _tiles(batch, seqlen_q, nheads_q):
    return -(-seqlen_q // 128) * batch * nheads_q


# (dtype, head_dim, causal, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv): 24-96 tiles
DENSE = [
    ("float16", 128, False, 3, 1000, 1000, 4, 2),
    ("bfloat16", 128, True, 3, 1000, 1000, 4, 2),
    ("bfloat16", 128, True, 2, 700, 1300, 4, 4),
    ("float16", 128, True, 2, 1300, 700, 4, 1),   # bottom-right: the top 600 rows see no key
    ("float16", 64, True, 3, 1000, 1000, 4, 2),
    ("bfloat16", 64, False, 2, 777, 333, 4, 2),
]


@pytest.mark.parametrize("dtype,head_dim,causal,batch,seqlen_q,seqlen_k,nheads_q,nheads_kv", DENSE)
def test_persistent_dense(walk, rng, dtype, head_dim, causal, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv):
    host, dev = make_inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _run(dev, dtype, scale, causal)
    assert walk.launches == [WS_KERNEL]
    (persistent, _, grid, _), = walk.modes
    assert persistent and _tiles(batch, seqlen_q, nheads_q) > 2 * grid  # every block walks several tiles
    _check(host, out, lse, dtype, scale, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_persistent_packed(walk, rng, causal):
    """Ragged sequences with a 0-length one on each side, tails into the next sequence
    and past the last, with the persistent mode on: a packed batch runs one block per
    tile all the same (dispatch.uses_persistent_ws; the walk's teardown checks it)."""
    cp = pytest.importorskip("cupy")
    walk.varlen = True
    launches = walk.launches
    lens_q, lens_k = (0, 1, 127, 129, 300, 513, 0, 1000), (5, 0, 200, 129, 257, 100, 64, 1333)
    with testing.poisoned_allocations(cp):
        inputs, out, lse = packed_forward(cp, lens_q, lens_k, 8, 2, 128, "bfloat16", causal, rng)
    assert launches == [WS_KERNEL]
    check_packed(inputs, out, lse, lens_q, lens_k, causal)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", list(WS_EMPTY_ROWS))
def test_persistent_tiles_that_see_no_key(walk, rng, case, with_sinks):
    """Tiles with no visible key (a window's, causal's) between tiles with keys in one
    block's walk: out 0, lse -inf (the sink's with sinks), the rest within the rule."""
    check_rows_that_see_no_key(walk.launches, rng, case, with_sinks)


@pytest.mark.parametrize("causal,variants", [
    pytest.param(False, {"window_size": (300, 200)}, id="window"),
    # (with ALiBi: a window with softcap alone runs one block per tile, dispatch._FWD_WS_SPILLS)
    pytest.param(True, {"window_size": (256, -1), "softcap": 8.0, "alibi_slopes": None},
                 id="causal-window-softcap-alibi"),
    pytest.param(False, {"dropout_p": 0.2, "rng_state": (SEED, OFFSET)}, id="dropout"),
    pytest.param(True, {"sinks": None, "alibi_slopes": None}, id="causal-sinks-alibi"),
])
def test_persistent_variants(walk, rng, causal, variants):
    """Variants whose per-tile state (a window's key range, ALiBi's slope, a sink, dropout's
    Philox offsets) is set up afresh at each tile of the walk."""
    launches = walk.launches
    shape = (2, 1000, 1000, 4, 2, 128)
    variants = dict(variants)
    if "sinks" in variants:
        variants["sinks"] = sink_logits(rng, shape[3])
    if "alibi_slopes" in variants:
        variants["alibi_slopes"] = alibi_batch_heads(rng, shape[0], shape[3])
    inputs, fwd = run_variant(launches, rng, "float16", shape, causal, variants)
    check_variant(inputs, fwd, causal, variants)
