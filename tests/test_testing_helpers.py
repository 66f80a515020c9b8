"""The bfloat16 bit helpers the GPU tests use to hand bf16 data to cupy."""

import numpy as np
import pytest

from cupyflash.testing import from_bf16_bits, to_bf16_bits


def test_bf16_bits_round_to_nearest_even_like_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = rng.standard_normal(4096, dtype=np.float32) * 10.0 ** rng.integers(-20, 20, 4096)
    expected = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(to_bf16_bits(x), expected.view(np.uint16))
    np.testing.assert_array_equal(from_bf16_bits(to_bf16_bits(x)), expected.astype(np.float32))
