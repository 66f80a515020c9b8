"""The bfloat16 bit helpers the GPU tests use to hand bf16 data to cupy."""

import numpy as np
import pytest

from cupyflash.testing import from_bf16_bits, to_bf16_bits


def test_bf16_bits_round_to_nearest_even_like_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    # float32 values (10.0 ** ints is float64: a float64 x would be rounded twice by
    # to_bf16_bits, through float32, and once by ml_dtypes, and differ in 1 of ~4000)
    x = (rng.standard_normal(4096, dtype=np.float32) * 10.0 ** rng.integers(-20, 20, 4096)).astype(np.float32)
    expected = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(to_bf16_bits(x), expected.view(np.uint16))
    np.testing.assert_array_equal(from_bf16_bits(to_bf16_bits(x)), expected.astype(np.float32))


def test_given_out_has_no_nan_for_a_minus_inf_sink_on_a_row_that_sees_no_key():
    """Causal with seqlen_q > seqlen_k: the top rows see no key, and lse = sink = -inf there."""
    from cupyflash import reference, testing

    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal(s) for s in ((1, 5, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8), (1, 5, 2, 8)))
    sinks = np.array([-np.inf, 0.5], np.float32)
    out, _ = reference.attention_fwd(q, k, v, causal=True, sinks=sinks)
    refs = reference.attention_bwd(dout, q, k, v, causal=True, sinks=sinks)
    fixed = testing.given_out(refs, out.astype(np.float16), dout, q, k, v, causal=True, sinks=sinks)
    assert np.isfinite(fixed[3]).all() and fixed[3][0] == refs[3][0] == 0


def test_poisoned_allocations_fills_every_allocation_and_frees_its_pool():
    """With a stand-in for cupy: each allocation in the block is memset to 0xFF on the
    current stream, the allocator is restored and the pool freed on exit (also on error)."""
    import contextlib
    import types

    from cupyflash import testing

    calls = []

    class Pool:
        def malloc(self, nbytes):
            return types.SimpleNamespace(ptr=1000 + nbytes)

        def free_all_blocks(self):
            calls.append("freed")

    current = {}

    @contextlib.contextmanager
    def using_allocator(malloc):
        current["malloc"] = malloc
        try:
            yield
        finally:
            current.pop("malloc")

    cuda = types.SimpleNamespace(
        MemoryPool=Pool, using_allocator=using_allocator,
        get_current_stream=lambda: types.SimpleNamespace(ptr=7),
        runtime=types.SimpleNamespace(memsetAsync=lambda *args: calls.append(args)))
    fake = types.SimpleNamespace(cuda=cuda)
    with pytest.raises(RuntimeError), testing.poisoned_allocations(fake):
        current["malloc"](16)
        current["malloc"](0)
        raise RuntimeError
    assert calls == [(1016, 0xFF, 16, 7), "freed"] and not current
