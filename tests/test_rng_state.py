"""Dropout's random state (issue 13): optional in the forwards, returned, required back.

A forward with ``dropout_p > 0`` and no ``rng_state`` draws ``(seed, offset)`` from
cupyflash's generator (``cupyflash.manual_seed``; the offset advances by one per
call) and returns it with ``return_rng_state=True``; the backward must be given it
(a TypeError naming ``rng_state`` otherwise).  The same state gives bitwise the
same result; another state another mask.  CPU path (NumPy arrays).
"""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

import cupyflash
from cupyflash import _philox, _rng, cpu, reference, testing

P = 0.3
SHAPE = (2, 13, 19, 4, 2, 16)  # batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim


@pytest.fixture(autouse=True)
def _keep_generator():
    """Each test starts from a generator of its own, and leaves the process's as it was."""
    saved = _rng._state
    _rng._state = None
    yield
    _rng._state = saved


def _qkv(rng, dtype=np.float32):
    q, k, v = testing.random_qkv(rng, *SHAPE, dtype)
    return q, k, v, testing.random_normal(rng, q.shape, dtype)


def _packed(rng):
    """Two sequences (5 and 8 queries, 7 and 12 keys), packed."""
    q = rng.standard_normal((13, 4, 16)).astype(np.float32)
    k = rng.standard_normal((19, 2, 16)).astype(np.float32)
    v = rng.standard_normal((19, 2, 16)).astype(np.float32)
    return q, k, v, np.array([0, 5, 13], np.int32), np.array([0, 7, 19], np.int32)


def _is_state(state):
    return (isinstance(state, tuple) and len(state) == 2 and all(type(x) is int for x in state)
            and 0 <= state[0] < 2**64 and 0 <= state[1] < 2**32)


def test_forward_without_rng_state_draws_and_returns_one(rng):
    q, k, v, _ = _qkv(rng)
    out, lse, state = cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, return_rng_state=True)
    assert _is_state(state)
    assert out.shape == q.shape and lse.shape == (SHAPE[0], SHAPE[3], SHAPE[1])
    # it is the Philox mask of that state: the CPU path given it explicitly agrees bit for bit
    want_out, want_lse = cpu.fwd(q, k, v, SHAPE[5] ** -0.5, False, dropout_p=P, rng_state=state)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)


def test_the_returned_state_reproduces_the_forward_bitwise(rng):
    q, k, v, _ = _qkv(rng)
    out, lse, state = cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, causal=True, return_rng_state=True)
    again, again_lse = cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, causal=True, rng_state=state)
    np.testing.assert_array_equal(again, out)
    np.testing.assert_array_equal(again_lse, lse)
    np.testing.assert_array_equal(cupyflash.flash_attn(q, k, v, dropout_p=P, causal=True, rng_state=state), out)


def test_consecutive_calls_draw_different_masks(rng):
    q, k, v, _ = _qkv(rng)
    first, _, s1 = cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, return_rng_state=True)
    second, _, s2 = cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, return_rng_state=True)
    third, s3 = cupyflash.flash_attn(q, k, v, dropout_p=P, return_rng_state=True)
    assert s2 == (s1[0], s1[1] + 1) and s3 == (s1[0], s1[1] + 2)  # one offset per call
    assert not np.array_equal(first, second) and not np.array_equal(second, third)
    masks = [_philox.dropout_keep_mask(*s, P, SHAPE[0], SHAPE[3], SHAPE[1], SHAPE[2]) for s in (s1, s2)]
    assert not np.array_equal(*masks)


def test_manual_seed_makes_the_draws_reproducible(rng):
    q, k, v, _ = _qkv(rng)
    cupyflash.manual_seed(2024)
    out, _, state = cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, return_rng_state=True)
    later, _, later_state = cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, return_rng_state=True)
    assert (state, later_state) == ((2024, 0), (2024, 1))
    cupyflash.manual_seed(2024)
    np.testing.assert_array_equal(cupyflash.flash_attn_fwd(q, k, v, dropout_p=P)[0], out)
    np.testing.assert_array_equal(cupyflash.flash_attn_fwd(q, k, v, dropout_p=P)[0], later)
    cupyflash.manual_seed(2025)  # another seed, another mask
    assert not np.array_equal(cupyflash.flash_attn_fwd(q, k, v, dropout_p=P)[0], out)
    assert _rng.next_rng_state() == (2025, 1)  # the sequence is the new seed's


def test_backward_with_the_returned_state_matches_the_reference(rng):
    q, k, v, dout = _qkv(rng)
    out, lse, state = cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, causal=True, return_rng_state=True)
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, dropout_p=P, causal=True, rng_state=state)
    mask = _philox.dropout_keep_mask(*state, P, SHAPE[0], SHAPE[3], SHAPE[1], SHAPE[2])
    ref_out, _ = reference.attention_fwd(q, k, v, causal=True, dropout_p=P, dropout_mask=mask)
    want = reference.attention_bwd(dout, q, k, v, causal=True, dropout_p=P, dropout_mask=mask)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *want)):
        ref = np.asarray(ref, np.float64)
        err = float(np.abs(np.asarray(got, np.float64) - ref).max())
        assert err <= 1e-5 * max(1.0, float(np.abs(ref).max())), (name, err)


def test_backward_without_rng_state_raises_naming_it(rng):
    q, k, v, dout = _qkv(rng)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, dropout_p=P)
    with pytest.raises(TypeError, match=re.escape("cupyflash.flash_attn_bwd: rng_state=(seed, offset) must be "
                                                  "given with dropout_p > 0")) as info:
        cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, dropout_p=P)
    assert "return_rng_state=True" in str(info.value)
    qp, kp, vp, cu_q, cu_k = _packed(rng)
    out, lse = cupyflash.flash_attn_varlen_fwd(qp, kp, vp, cu_q, cu_k, 8, 12, dropout_p=P)
    with pytest.raises(TypeError, match=re.escape("cupyflash.flash_attn_varlen_bwd: rng_state=(seed, offset) "
                                                  "must be given")):
        cupyflash.flash_attn_varlen_bwd(out, qp, kp, vp, out, lse, cu_q, cu_k, 8, 12, dropout_p=P)


def test_varlen_forwards_draw_and_return_the_state(rng):
    q, k, v, cu_q, cu_k = _packed(rng)
    cupyflash.manual_seed(77)
    out, lse, state = cupyflash.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, 8, 12, dropout_p=P,
                                                      return_rng_state=True)
    assert state == (77, 0)
    only, only_state = cupyflash.flash_attn_varlen(q, k, v, cu_q, cu_k, 8, 12, dropout_p=P, return_rng_state=True)
    assert only_state == (77, 1) and not np.array_equal(only, out)
    again, again_lse = cupyflash.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, 8, 12, dropout_p=P, rng_state=state)
    np.testing.assert_array_equal(again, out)
    np.testing.assert_array_equal(again_lse, lse)
    grads = cupyflash.flash_attn_varlen_bwd(out, q, k, v, out, lse, cu_q, cu_k, 8, 12, dropout_p=P,
                                            rng_state=state)
    # sequence 1 is batch index 1 of a dense batch: its mask and gradients are the dense call's
    dense = [x[None, a:b] for x, (a, b) in ((q, (5, 13)), (k, (7, 19)), (v, (7, 19)))]
    pad = [np.concatenate([np.zeros_like(x), x]) for x in dense]  # batch 0 a dummy (zeros)
    d_out, d_lse = cupyflash.flash_attn_fwd(*pad, dropout_p=P, rng_state=state)
    np.testing.assert_array_equal(d_out[1], out[5:13])
    d_grads = cupyflash.flash_attn_bwd(np.concatenate([np.zeros_like(d_out[:1]), out[None, 5:13]]), *pad,
                                       d_out, d_lse, dropout_p=P, rng_state=state)
    np.testing.assert_array_equal(d_grads[0][1], grads[0][5:13])


def test_return_rng_state_conventions(rng):
    q, k, v, _ = _qkv(rng)
    assert cupyflash.flash_attn_fwd(q, k, v, return_rng_state=True)[2] is None  # no dropout: no state
    assert cupyflash.flash_attn_fwd(q, k, v, dropout_p=0.0, rng_state=(1, 2), return_rng_state=True)[2] is None
    assert cupyflash.flash_attn(q, k, v, return_rng_state=True)[1] is None
    plain = cupyflash.flash_attn_fwd(q, k, v, return_rng_state=False)
    assert len(plain) == 2
    given = cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, rng_state=[np.uint64(5), 9], return_rng_state=True)[2]
    assert given == (5, 9) and _is_state(given)  # the one given, as ints
    assert _rng._state is None  # an explicit state neither uses nor advances the generator
    for fn in (cupyflash.flash_attn_fwd, cupyflash.flash_attn):
        with pytest.raises(TypeError, match=re.escape(f"cupyflash.{fn.__name__}: return_rng_state must be a "
                                                      f"bool; got str.")):
            fn(q, k, v, dropout_p=P, return_rng_state="yes")


def test_a_refused_call_draws_nothing(rng):
    q, k, v, _ = _qkv(rng)
    cupyflash.manual_seed(3)
    with pytest.raises(ValueError, match="softcap"):
        cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks must have shape"):
        cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, sinks=np.zeros(3, np.float32))
    assert cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, return_rng_state=True)[2] == (3, 0)


@pytest.mark.parametrize("seed, cls, text", [
    (True, TypeError, "seed must be an int; got bool."), (1.5, TypeError, "seed must be an int; got float."),
    ("1", TypeError, "seed must be an int; got str."), (-1, ValueError, "seed must be in [0, 2**64); got -1."),
    (2**64, ValueError, f"seed must be in [0, 2**64); got {2**64}.")])
def test_manual_seed_is_checked(seed, cls, text):
    with pytest.raises(cls, match=re.escape(f"cupyflash.manual_seed: {text}")):
        cupyflash.manual_seed(seed)
    cupyflash.manual_seed(np.int64(2**62))  # any integral type
    cupyflash.manual_seed(2**64 - 1)
    assert _rng.next_rng_state() == (2**64 - 1, 0)


def test_the_offset_wraps_into_the_next_seed():
    _rng._state = [2**64 - 1, 2**32 - 2]
    assert [_rng.next_rng_state() for _ in range(3)] == [(2**64 - 1, 2**32 - 2), (2**64 - 1, 2**32 - 1), (0, 0)]


def test_the_first_seed_comes_from_the_os():
    first = _rng.next_rng_state()
    assert first[1] == 0 and 0 <= first[0] < 2**64
    _rng._state = None
    assert _rng.next_rng_state()[0] != first[0]  # 2**-64 odds of a false failure


def test_threads_never_share_a_state():
    cupyflash.manual_seed(11)
    seen = []

    def draw():
        seen.extend(_rng.next_rng_state() for _ in range(500))

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == [(11, i) for i in range(2000)]


def test_jax_arrays_through_the_core_get_the_state_back(rng, jax_cpu_device):
    jax = pytest.importorskip("jax")
    q, k, v, _ = _qkv(rng)
    cupyflash.manual_seed(5)
    out, lse, state = cupyflash.flash_attn_fwd(*(jax.numpy.asarray(x) for x in (q, k, v)), dropout_p=P,
                                               return_rng_state=True)
    assert state == (5, 0) and isinstance(out, jax.Array)
    np.testing.assert_array_equal(np.asarray(out), cupyflash.flash_attn_fwd(q, k, v, dropout_p=P, rng_state=state)[0])
