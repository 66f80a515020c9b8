"""The tiled CPU path's variants (window, softcap, ALiBi, sinks, dropout) against
the float64 reference, with small tiles so that every case runs many tiles and tails.

The CPU path rounds only its inputs' dtype at the output and accumulates in
float32, so it is held to a direct bound: a few ulps of the output dtype (and
float32 accumulation noise) relative to the largest reference value.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _philox, cpu, reference, testing

SCALE = 0.4
SEED, OFFSET = 0x1234_5678_9ABC, 7


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(cpu, "BLOCK_M", 16)
    monkeypatch.setattr(cpu, "BLOCK_N", 12)


def _alibi(rng, shape):
    return rng.uniform(0.05, 0.5, shape).astype(np.float32)


# name -> ((batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), kwargs given rng)
CASES = {
    "window": ((2, 50, 41, 2, 2, 16), lambda rng: {"window_size": (9, 5)}),
    "window_left": ((1, 41, 50, 4, 2, 16), lambda rng: {"window_size": (7, -1)}),
    "window_right": ((1, 50, 37, 2, 1, 16), lambda rng: {"window_size": (-1, 3)}),
    "softcap": ((2, 45, 38, 2, 1, 16), lambda rng: {"softcap": 1.5}),
    "alibi_heads": ((1, 40, 53, 4, 2, 16), lambda rng: {"alibi_slopes": _alibi(rng, (4,))}),
    "alibi_batch_heads": ((2, 37, 30, 2, 2, 16),
                          lambda rng: {"alibi_slopes": _alibi(rng, (2, 2))}),
    "sinks": ((2, 35, 44, 4, 1, 16),
              lambda rng: {"sinks": rng.standard_normal(4).astype(np.float32)}),
    "dropout": ((2, 33, 47, 2, 1, 16), lambda rng: {"dropout_p": 0.3}),
    "window+causal+gqa": ((2, 52, 45, 4, 2, 16),
                          lambda rng: {"causal": True, "window_size": (11, 4)}),
    "softcap+alibi": ((1, 40, 45, 2, 1, 16),
                      lambda rng: {"softcap": 0.8, "alibi_slopes": _alibi(rng, (1, 2))}),
    "sinks+window": ((1, 44, 44, 2, 2, 16),
                     lambda rng: {"window_size": (6, 0),
                                  "sinks": rng.standard_normal(2).astype(np.float32)}),
    "dropout+causal": ((1, 40, 50, 2, 1, 16), lambda rng: {"causal": True, "dropout_p": 0.25}),
    "everything": ((2, 41, 50, 4, 2, 16),
                   lambda rng: {"causal": True, "window_size": (13, -1), "softcap": 2.0,
                                "alibi_slopes": _alibi(rng, (4,)),
                                "sinks": rng.standard_normal(4).astype(np.float32),
                                "dropout_p": 0.2}),
}


def _split(kwargs, shape):
    """(cpu kwargs, reference kwargs) from one case's kwargs."""
    batch, seqlen_q, seqlen_k, nheads_q = shape[:4]
    cpu_kw = {key: val for key, val in kwargs.items() if key != "causal"}
    ref_kw = dict(cpu_kw)
    if kwargs.get("dropout_p"):
        cpu_kw["rng_state"] = (SEED, OFFSET)
        ref_kw["dropout_mask"] = _philox.dropout_keep_mask(SEED, OFFSET, kwargs["dropout_p"], batch,
                                                           nheads_q, seqlen_q, seqlen_k)
    return cpu_kw, ref_kw


def _assert_close(name, got, ref, tol):
    got = np.asarray(got, dtype=np.float64)
    assert not np.isnan(got).any(), name
    assert np.array_equal(np.isinf(got), np.isinf(ref)), name
    finite = np.isfinite(ref)
    if np.isinf(ref).any():
        assert (got[~finite] == ref[~finite]).all(), name
    bound = tol * max(1.0, float(np.abs(ref[finite]).max(initial=0.0)))
    err = float(np.abs(got[finite] - ref[finite]).max(initial=0.0))
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


def _tols(dtype):
    eps = float(np.finfo(np.dtype(dtype)).eps)
    return max(2 * eps, 1e-5), max(4 * eps, 5e-5)  # (out, grads)


def _run(rng, dtype, shape, kwargs):
    batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim = shape
    causal = kwargs.get("causal", False)
    cpu_kw, ref_kw = _split(kwargs, shape)
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim,
                                 dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    out, lse = cpu.fwd(q, k, v, SCALE, causal, **cpu_kw)
    grads = cpu.bwd(dout, q, k, v, out, lse, SCALE, causal, **cpu_kw)
    return (q, k, v, dout, causal, ref_kw), (out, lse), grads


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(rng, small_tiles, name, dtype):
    shape, make = CASES[name]
    kwargs = make(rng)
    (q, k, v, dout, causal, ref_kw), (out, lse), grads = _run(rng, dtype, shape, kwargs)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    ref_out, ref_lse = reference.attention_fwd(q, k, v, SCALE, causal, **ref_kw)
    tol_out, tol_grad = _tols(dtype)
    _assert_close("out", out, ref_out, tol_out)
    _assert_close("lse", lse, ref_lse, 1e-5)

    refs = reference.attention_bwd(dout, q, k, v, SCALE, causal, **ref_kw)
    names = ("dq", "dk", "dv", "dsinks")
    assert len(grads) == len(refs) == (4 if "sinks" in kwargs else 3)
    for gname, got, ref in zip(names, grads, refs):
        assert got.shape == ref.shape
        assert got.dtype == (np.float32 if gname == "dsinks" else q.dtype)
        _assert_close(gname, got, ref, tol_grad)


# ----------------------------------------------------------------------------
# Dropout: the mask is the Philox one, whatever the tiling
# ----------------------------------------------------------------------------


def test_dropout_does_not_depend_on_the_tiles(rng, monkeypatch):
    shape, make = CASES["everything"]
    kwargs = make(rng)
    results = []
    for block_m, block_n in [(16, 12), (7, 64), (128, 5)]:
        monkeypatch.setattr(cpu, "BLOCK_M", block_m)
        monkeypatch.setattr(cpu, "BLOCK_N", block_n)
        results.append(_run(np.random.default_rng(5), "float32", shape, kwargs)[1:])
    (fwd0, grads0) = results[0]
    for fwd_, grads_ in results[1:]:
        # the same mask: only the order of float32 sums differs
        for a, b in zip(fwd0 + grads0, fwd_ + grads_):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_dropout_mask_is_the_philox_one(rng):
    """With v = identity-like one-hot values, the output shows which keys were kept."""
    batch, seqlen_q, seqlen_k, nheads = 1, 9, 13, 2
    q = np.zeros((batch, seqlen_q, nheads, seqlen_k), np.float32)  # uniform scores
    k = np.zeros((batch, seqlen_k, nheads, seqlen_k), np.float32)
    v = np.broadcast_to(np.eye(seqlen_k, dtype=np.float32)[None, :, None], k.shape).copy()
    out, _ = cpu.fwd(q, k, v, 1.0, False, dropout_p=0.4, rng_state=(SEED, OFFSET))
    keep = _philox.dropout_keep_mask(SEED, OFFSET, 0.4, batch, nheads, seqlen_q, seqlen_k)
    np.testing.assert_array_equal(out.transpose(0, 2, 1, 3) > 0, keep)
    other, _ = cpu.fwd(q, k, v, 1.0, False, dropout_p=0.4, rng_state=(SEED, OFFSET + 1))
    assert not np.array_equal(other, out)
    again, _ = cpu.fwd(q, k, v, 1.0, False, dropout_p=0.4, rng_state=(SEED, OFFSET))
    np.testing.assert_array_equal(again, out)


def test_dropout_needs_rng_state(rng):
    q, k, v = testing.random_qkv(rng, 1, 4, 4, 1, 1, 8, "float32")
    with pytest.raises(ValueError, match="rng_state"):
        cpu.fwd(q, k, v, 1.0, False, dropout_p=0.1)


# ----------------------------------------------------------------------------
# Window: hidden tiles skipped, fully visible tiles unmasked
# ----------------------------------------------------------------------------


def _visited(monkeypatch, name):
    calls = []
    original = getattr(cpu, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu, name, counted)
    return calls


@pytest.mark.parametrize("causal,window", [(False, (20, 20)), (True, (33, -1)),
                                            (False, (-1, 5)), (False, (0, 0))])
@pytest.mark.parametrize("seqlens", [(100, 100), (64, 100), (100, 64)], ids=str)
def test_tile_ranges_are_exact(monkeypatch, causal, window, seqlens):
    """Every key tile a query tile visits has a visible pair, every skipped one has
    none, and exactly the unmasked ones are fully visible (and likewise backward)."""
    monkeypatch.setattr(cpu, "BLOCK_M", 16)
    monkeypatch.setattr(cpu, "BLOCK_N", 8)
    seqlen_q, seqlen_k = seqlens
    visible = reference.visible_keys(seqlen_q, seqlen_k, causal, window_size=window)
    win = cpu._window(causal, window)
    for m0 in range(0, seqlen_q, 16):
        m1 = min(m0 + 16, seqlen_q)
        tiles = list(cpu._tiles(*cpu._key_tiles(m0, m1, seqlen_q, seqlen_k, win), 8))
        seen = {n0 for n0, _, _ in tiles}
        for n0 in range(0, seqlen_k, 8):
            block = visible[m0:m1, n0:n0 + 8]
            assert (n0 in seen) == block.any(), (m0, n0)
        for n0, n1, masked in tiles:
            assert not visible[m0:m1, n1:n0 + 8].any()  # a tile cut short at n_end
            assert masked == (not visible[m0:m1, n0:n1].all()), (m0, n0)
    for n0 in range(0, seqlen_k, 8):
        n1 = min(n0 + 8, seqlen_k)
        tiles = list(cpu._tiles(*cpu._query_tiles(n0, n1, seqlen_q, seqlen_k, win), 16))
        seen = {m0 for m0, _, _ in tiles}
        for m0 in range(0, seqlen_q, 16):
            assert (m0 in seen) == visible[m0:m0 + 16, n0:n1].any(), (m0, n0)
        for m0, m1, masked in tiles:
            assert not visible[m1:m0 + 16, n0:n1].any()
            assert masked == (not visible[m0:m1, n0:n1].all()), (m0, n0)


def test_window_skips_tiles(rng, monkeypatch):
    """A narrow window visits only the tiles near the diagonal, forward and backward."""
    monkeypatch.setattr(cpu, "BLOCK_M", 32)
    monkeypatch.setattr(cpu, "BLOCK_N", 32)
    q, k, v = testing.random_qkv(rng, 1, 256, 256, 2, 1, 8, "float32")
    steps = _visited(monkeypatch, "_online_softmax_step")
    masks = _visited(monkeypatch, "_apply_causal_mask")
    out, lse = cpu.fwd(q, k, v, SCALE, False, window_size=(16, 0))
    # row tile t sees key tiles t-1 (partly) and t (the diagonal): 8 + 7 tiles, all masked
    assert (len(steps), len(masks)) == (15, 15)
    del masks[:]
    tiles = _visited(monkeypatch, "_bwd_tile")
    cpu.bwd(q, q, k, v, out, lse, SCALE, False, window_size=(16, 0))
    assert (len(tiles), len(masks)) == (15, 15)
    del steps[:], masks[:]
    # window 64: key tiles t-2 (left edge, masked), t-1 (fully visible: unmasked) and t
    cpu.fwd(q, k, v, SCALE, False, window_size=(64, 0))
    assert (len(steps), len(masks)) == (8 + 7 + 6, 8 + 6)


# ----------------------------------------------------------------------------
# Rows that see no key; defaults
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_rows_that_see_no_key(rng, small_tiles, dtype, with_sinks):
    """window (-1, 0) with seqlen_q > seqlen_k leaves the top rows empty; a window
    right edge below the key range too."""
    batch, seqlen_q, seqlen_k, nheads = 2, 50, 30, 4
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, 2, 16, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    sinks = rng.standard_normal(nheads).astype(np.float32) if with_sinks else None
    kw = dict(window_size=(5, -1), causal=True, softcap=3.0, sinks=sinks, dropout_p=0.1,
              rng_state=(SEED, OFFSET))
    out, lse = cpu.fwd(q, k, v, SCALE, **kw)
    grads = cpu.bwd(dout, q, k, v, out, lse, SCALE, **kw)
    empty = seqlen_q - seqlen_k  # rows 0 .. empty-1 see no key
    for x in (out, lse) + grads:
        assert not np.isnan(x.astype(np.float32)).any()
    assert (out[:, :empty] == 0).all()
    want = (np.broadcast_to(sinks[None, :, None], (batch, nheads, empty)) if with_sinks
            else -np.inf)
    np.testing.assert_array_equal(lse[:, :, :empty], want)
    assert np.isfinite(lse[:, :, empty:]).all()
    assert (grads[0][:, :empty] == 0).all()
    for g in grads:
        assert np.isfinite(g.astype(np.float32)).all()


@pytest.mark.parametrize("causal", [False, True])
def test_off_values_are_bitwise_the_default(rng, small_tiles, causal):
    q, k, v = testing.random_qkv(rng, 2, 45, 38, 4, 2, 16, "float16")
    dout = testing.random_normal(rng, q.shape, "float16")
    plain = cpu.fwd(q, k, v, SCALE, causal)
    off = dict(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
               rng_state=(1, 2))
    same = cpu.fwd(q, k, v, SCALE, causal, **off)
    for a, b in zip(plain, same):
        np.testing.assert_array_equal(a, b)
    grads = cpu.bwd(dout, q, k, v, *plain, SCALE, causal)
    for a, b in zip(grads, cpu.bwd(dout, q, k, v, *plain, SCALE, causal, **off)):
        np.testing.assert_array_equal(a, b)
    # causal is the window (-1, 0): the same tiles, the same bits
    win = cpu.fwd(q, k, v, SCALE, False, window_size=(-1, 0))
    for a, b in zip(cpu.fwd(q, k, v, SCALE, True), win):
        np.testing.assert_array_equal(a, b)


def test_extreme_logits_keep_the_largest_term(rng):
    """With softcap off but ALiBi on (log2-unit scores), a single key at huge logits
    gives its value row: the max is taken over the exponentiated values."""
    q = np.full((1, 1, 1, 4), 3e4, np.float32)
    k = np.full((1, 1, 1, 4), 3e4, np.float32)
    v = rng.standard_normal((1, 1, 1, 4)).astype(np.float32)
    out, lse = cpu.fwd(q, k, v, 10.0, False, alibi_slopes=np.zeros(1, np.float32))
    np.testing.assert_array_equal(out, v)
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_minus_inf_sink_on_a_row_that_sees_no_key(rng, small_tiles, dtype):
    """A -inf sink is no sink: a row that sees no key then gets out 0 and lse -inf,
    not NaN (it gave NaN: the max of the row and the sink stayed -inf)."""
    q, k, v = testing.random_qkv(rng, 1, 40, 16, 4, 2, 16, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    sinks = np.array([0.5, -np.inf, 1.0, -np.inf], np.float32)
    out, lse = cpu.fwd(q, k, v, SCALE, True, sinks=sinks)
    grads = cpu.bwd(dout, q, k, v, out, lse, SCALE, True, sinks=sinks)
    empty = 40 - 16
    assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(lse).any()
    assert (out[:, :empty] == 0).all()
    np.testing.assert_array_equal(lse[0, :, :empty], np.broadcast_to(sinks[:, None], (4, empty)))
    ref_out, ref_lse = reference.attention_fwd(q, k, v, SCALE, True, sinks=sinks)
    tol_out, tol_grad = _tols(dtype)
    _assert_close("out", out, ref_out, tol_out)
    _assert_close("lse", lse, ref_lse, 1e-5)
    refs = reference.attention_bwd(dout, q, k, v, SCALE, True, sinks=sinks)
    for name, got, ref in zip(("dq", "dk", "dv", "dsinks"), grads, refs):
        _assert_close(name, got, ref, tol_grad)
    assert grads[3][1] == 0 and grads[3][3] == 0
