"""The polynomial exp2 of FlashAttention-4's softmax option (kernels_cu/ptx.cuh
poly_exp2, used by the warp-specialised forward with POLY_EXP2 > 0), checked on the
CPU: its exact float32 op sequence emulated in numpy (clamp, round-down add, two exact
subtractions, three fused multiply-adds, the exponent shift, one multiply) with the
coefficients read from the header, against 2^x in float64."""

from __future__ import annotations

import re

import numpy as np
import pytest

from cupyflash._sources import kernels_dir

#: The relative error the kernel may make (the cubic's minimax error is 8.56e-5; the
#: float32 evaluation adds a few ulps).
MAX_REL_ERROR = 1e-4


def _constants():
    text = (kernels_dir() / "ptx.cuh").read_text()
    coeffs = {int(i): float.fromhex(c) for i, c in re.findall(r"EXP2_POLY_C(\d) = (0x[0-9a-fp.+-]+)f;", text)}
    body = text[text.index("float poly_exp2(float x)"):]
    body = body[:body.index("\n}\n")]
    (round_,) = re.findall(r"constexpr float ROUND = ([0-9.]+)f;", body)
    return text, body, [1.0, coeffs[1], coeffs[2], coeffs[3]], float(round_)


def _fma32(a, b, c):
    """float32 fma, rounded once: a·b is exact in float64, and the float64 sum rounded
    to odd (TwoSum's error decides the last bit) rounds to float32 correctly."""
    a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _add_rd32(a, b):
    """float32 a + b rounded toward -inf (PTX add.rm.f32)."""
    s = np.asarray(a, np.float32).astype(np.float64) + np.float64(b)  # exact: |a| << 2^23
    r = s.astype(np.float32)
    return np.where(r.astype(np.float64) > s, np.nextafter(r, np.float32(-np.inf)), r)


def poly_exp2(x):
    """ptx.cuh poly_exp2, op for op in float32."""
    _, _, (c0, c1, c2, c3), round_ = _constants()
    x = np.asarray(x, np.float32)
    round_ = np.float32(round_)
    with np.errstate(invalid="ignore"):
        xc = np.maximum(x, np.float32(-127.0))  # max.NaN: numpy's maximum keeps NaN too
        r = _add_rd32(xc, round_)
        f = xc - (r - round_)
        p = _fma32(_fma32(_fma32(c3, f, c2), f, c1), f, c0)
        scale = (r.view(np.uint32) << np.uint32(23)).view(np.float32)
        return (p * scale).astype(np.float32)


def test_the_emulation_is_the_kernels_op_sequence():
    """The constants and the op sequence emulated here are the header's."""
    _, body, (c0, *_), round_ = _constants()
    assert c0 == 1.0 and round_ == 1.5 * 2 ** 23 + 127
    for op in ('asm("max.NaN.f32 %0, %1, %2;\\n" : "=f"(xc) : "f"(x), "f"(-127.f));',
               "const float r = __fadd_rd(xc, ROUND);", "const float f = xc - (r - ROUND);",
               "fmaf(fmaf(fmaf(EXP2_POLY_C3, f, EXP2_POLY_C2), f, EXP2_POLY_C1), f, 1.f)",
               "return p * __int_as_float(__float_as_int(r) << 23);"):
        assert op in body


def _grid():
    """Every float32 in [-1, 0) on a 2^-20 spacing, a dense sweep of the range the softmax
    feeds it (x = s - m <= 0; up to 8 above a stale max with COND_RESCALE), and the
    neighbours of the integers, where floor(x) changes."""
    fine = np.arange(-(2 ** 20), 0, dtype=np.float64) / 2 ** 20
    sweep = np.linspace(-126.0, 8.5, 1_000_001)
    ints = np.arange(-126, 9, dtype=np.float32)
    edges = np.concatenate([ints, np.nextafter(ints, np.float32(-np.inf)), np.nextafter(ints, np.float32(np.inf))])
    return np.concatenate([fine.astype(np.float32), sweep.astype(np.float32), edges])


def test_relative_error_below_1e_4():
    x = _grid()
    x = x[(x >= -126) & (x <= 8.5)]
    got = poly_exp2(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got / want - 1)
    assert rel.max() < MAX_REL_ERROR, rel.max()
    assert rel.max() > 8e-5  # the cubic's own error dominates: the emulation is not 2^x itself
    print(f"poly_exp2: max relative error {rel.max():.3e} over {x.size} float32 inputs in [-126, 8.5]")


def test_integers_are_exact():
    """p(0) = 1 exactly, so whole powers of two come out exact (x = 0: the row's max gets 1)."""
    j = np.arange(-126, 9, dtype=np.float32)
    np.testing.assert_array_equal(poly_exp2(j), np.exp2(j.astype(np.float64)).astype(np.float32))


def test_masked_and_underflowing_inputs_give_exactly_zero():
    """-inf (a masked score) and anything below -126 give +0, never a NaN, garbage or denormal."""
    x = np.array([-np.inf, -3e38, -1e9, -1000.0, -200.0, -127.5, -127.0, -126.75,
                  np.nextafter(np.float32(-126), np.float32(-np.inf))], np.float32)
    got = poly_exp2(x)
    assert np.all(got == 0) and not np.signbit(got).any()
    tiny = poly_exp2(np.array([-126.0, -125.5], np.float32))
    assert np.all(tiny >= np.float32(2.0 ** -126))  # normal numbers down to the edge


def test_nan_stays_nan():
    assert np.isnan(poly_exp2(np.array([np.nan], np.float32))).all()


@pytest.mark.parametrize("x", [1e-7, 1e-3, 0.5, 7.99, 8.0])
def test_small_positive_inputs(x):
    """Rounding can put a score a hair above the max, and a stale max (COND_RESCALE) up to 8
    below it."""
    got = float(poly_exp2(np.array([x], np.float32))[0])
    assert abs(got / 2.0 ** np.float64(np.float32(x)) - 1) < MAX_REL_ERROR
