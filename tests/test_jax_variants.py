"""cupyflash.jax.flash_attention with the attention variants (issue 13), on JAX's CPU backend.

The CPU backend runs the variant callbacks on NumPy views of XLA's buffers, so
the whole custom_vjp is exercised here: jax.grad with respect to q, k, v and
sinks against the float64 reference's backward (cupyflash.testing's rule),
alibi_slopes as constants, dropout from static ints or a PRNG key (the same
mask as the core function's), the checks at trace time, and the plain path
left alone when every variant is off.  tests/test_gpu_interop.py has the GPU
counterpart.  Skipped without jax (or without buffer_callback, JAX < 0.7).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
cfj = pytest.importorskip("cupyflash.jax")
if cfj._buffer_callback is None:
    pytest.skip(f"jax {jax.__version__} has no buffer_callback", allow_module_level=True)

import cupyflash  # noqa: E402
from cupyflash import testing  # noqa: E402

# JAX's CPU backend (NumPy views of XLA's buffers), also where its default is a GPU.
pytestmark = pytest.mark.usefixtures("jax_cpu_device")

jnp = jax.numpy
flash_attention = cfj.flash_attention


def _inputs(rng, batch=2, sq=11, sk=17, hq=4, hkv=2, d=16):
    q, k, v = testing.random_qkv(rng, batch, sq, sk, hq, hkv, d, np.float32)
    dout = testing.random_normal(rng, q.shape, np.float32)
    return q, k, v, dout


def _slopes(rng, shape):
    return (0.25 * rng.random(shape) + 0.05).astype(np.float32)


CASES = {
    "sinks": dict(sinks=True),
    "sinks+window+causal": dict(sinks=True, window_size=(5, 2), causal=True),
    "sinks+softcap+alibi": dict(sinks=True, softcap=2.5, alibi=(4,)),
    "alibi_batch+window": dict(alibi=(2, 4), window_size=(3, -1)),
    "softcap+causal": dict(softcap=4.0, causal=True),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_grads_match_reference(rng, case, jit):
    spec = dict(CASES[case])
    q, k, v, dout = _inputs(rng)
    sinks = rng.standard_normal(4).astype(np.float32) if spec.pop("sinks", False) else None
    alibi = _slopes(rng, spec.pop("alibi")) if "alibi" in spec else None
    causal = spec.pop("causal", False)
    variants = dict(spec, alibi_slopes=alibi, sinks=sinks)

    def loss(q, k, v, sinks):
        out = flash_attention(q, k, v, causal=causal, alibi_slopes=None if alibi is None else jnp.asarray(alibi),
                              sinks=sinks, **spec)
        return (out * jnp.asarray(dout)).sum(), out

    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    grad = jax.grad(loss, argnums=argnums, has_aux=True)
    if jit:
        grad = jax.jit(grad)
    grads, out = grad(*(jnp.asarray(x) for x in (q, k, v)), None if sinks is None else jnp.asarray(sinks))
    _, lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal, **{n: x for n, x in variants.items() if x is not None})
    testing.assert_fwd_matches_reference(q, k, v, np.asarray(out), lse, causal=causal, **variants)
    grads = [np.asarray(g) for g in grads]
    testing.assert_bwd_matches_reference(dout, q, k, v, *grads[:3], causal=causal,
                                         dsinks=grads[3] if sinks is not None else None, **variants)


def test_alibi_slopes_are_constants(rng):
    q, k, v, _ = _inputs(rng)
    alibi = jnp.asarray(_slopes(rng, (4,)))
    loss = lambda q, a: flash_attention(q, jnp.asarray(k), jnp.asarray(v), alibi_slopes=a).sum()
    dq, da = jax.grad(loss, argnums=(0, 1))(jnp.asarray(q), alibi)
    assert np.all(np.asarray(da) == 0) and np.any(np.asarray(dq) != 0)


def test_grads_are_the_core_backward(rng):
    """jax.grad's cotangents are flash_attn_bwd's results (dsinks the fourth), bit for bit."""
    q, k, v, dout = _inputs(rng)
    sinks = rng.standard_normal(4).astype(np.float32)
    kw = dict(causal=True, window_size=(4, 0), softcap=3.0)
    loss = lambda q, k, v, s: (flash_attention(q, k, v, sinks=s, **kw) * jnp.asarray(dout)).sum()
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jnp.asarray(x) for x in (q, k, v, sinks)))
    out, lse = cupyflash.flash_attn_fwd(q, k, v, sinks=sinks, **kw)
    want = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, sinks=sinks, **kw)
    assert len(want) == 4
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def _key_state(key):
    bits = [int(b) for b in np.asarray(jax.random.bits(key, (3,), jnp.uint32))]
    return bits[0] | bits[1] << 32, bits[2]


@pytest.mark.parametrize("how", ["typed key", "raw key", "ints"])
def test_dropout_mask_is_the_core_functions(rng, how):
    q, k, v, dout = _inputs(rng)
    if how == "ints":
        state = (int(rng.integers(0, 2**63)), int(rng.integers(0, 2**32)))
        rng_state = state
    else:
        key = jax.random.key(int(rng.integers(0, 2**31)))
        state = _key_state(key)
        rng_state = key if how == "typed key" else jax.random.key_data(key)
    kw = dict(dropout_p=0.25, causal=True)
    loss = lambda q, k, v: (flash_attention(q, k, v, rng_state=rng_state, **kw) * jnp.asarray(dout)).sum()
    got_out = flash_attention(*(jnp.asarray(x) for x in (q, k, v)), rng_state=rng_state, **kw)
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x) for x in (q, k, v)))
    out, lse = cupyflash.flash_attn_fwd(q, k, v, rng_state=state, **kw)
    np.testing.assert_array_equal(np.asarray(got_out), out)
    want = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, rng_state=state, **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_dropout_key_may_be_traced_and_changes_the_mask(rng):
    q, k, v, _ = (jnp.asarray(x) for x in _inputs(rng))
    step = jax.jit(lambda q, key: flash_attention(q, k, v, dropout_p=0.5, rng_state=key))
    a, b = jax.random.split(jax.random.key(0))
    out_a, out_a2, out_b = step(q, a), step(q, a), step(q, b)
    np.testing.assert_array_equal(np.asarray(out_a), np.asarray(out_a2))
    assert not np.array_equal(np.asarray(out_a), np.asarray(out_b))


@pytest.mark.parametrize("jit", [False, True])
def test_a_batch_of_keys_is_refused_by_name(rng, jit):
    """Found by QA: ``rng_state=jax.random.split(key)`` (a key array of shape (2,), the
    index forgotten) died in jax.random.bits' own "bits accepts a single key" error."""
    q, k, v, _ = (jnp.asarray(x) for x in _inputs(rng))
    call = lambda key: flash_attention(q, k, v, dropout_p=0.1, rng_state=key)  # noqa: E731
    with pytest.raises(TypeError, match=r"^cupyflash\.jax\.flash_attention: rng_state must be one JAX PRNG key "
                                        r"\(shape \(\)\) or a \(seed, offset\) pair; got a key array of shape \(2,\)"):
        (jax.jit(call) if jit else call)(jax.random.split(jax.random.key(0)))
    assert call(jax.random.split(jax.random.key(0))[0]).shape == q.shape


def test_variants_are_checked_at_trace_time(rng):
    q, k, v, _ = (jnp.asarray(x) for x in _inputs(rng))
    with pytest.raises(ValueError, match=r"^cupyflash\.jax\.flash_attention: sinks must have shape \(4,\)"):
        jax.jit(lambda q, s: flash_attention(q, k, v, sinks=s))(q, jnp.zeros(3, jnp.float32))
    with pytest.raises(TypeError, match=r"^cupyflash\.jax\.flash_attention: alibi_slopes must have dtype float32"):
        flash_attention(q, k, v, alibi_slopes=jnp.zeros(4, jnp.float16))
    with pytest.raises(TypeError, match=r"^cupyflash\.jax\.flash_attention: rng_state=\(seed, offset\) must be "
                                        r"given with dropout_p > 0 \(JAX's randomness is explicit"):
        flash_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"^cupyflash\.jax\.flash_attention: softcap must be finite"):
        flash_attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match=r"window_size's left entry must be in \[-1"):
        flash_attention(q, k, v, window_size=(-2, 0))


def test_variants_off_take_the_plain_path(monkeypatch, rng):
    q, k, v, _ = (jnp.asarray(x) for x in _inputs(rng))
    plain = flash_attention(q, k, v, causal=True)
    monkeypatch.setattr(cfj, "_variant_attention", None)  # would raise if called
    got = flash_attention(q, k, v, causal=True, dropout_p=0.0, window_size=(-1, -1), softcap=0.0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))


def test_empty_inputs_with_sinks(rng):
    q, k, v, _ = _inputs(rng, sk=0)
    sinks = jnp.asarray(rng.standard_normal(4).astype(np.float32))
    loss = lambda q, s: flash_attention(q, jnp.asarray(k), jnp.asarray(v), sinks=s).sum()
    out = flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), sinks=sinks)
    assert np.all(np.asarray(out) == 0)
    dq, ds = jax.grad(loss, argnums=(0, 1))(jnp.asarray(q), sinks)
    assert np.all(np.asarray(dq) == 0) and np.all(np.asarray(ds) == 0) and ds.shape == (4,)
