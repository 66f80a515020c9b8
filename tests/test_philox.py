"""The dropout generator (cupyflash._philox): Philox4x32 and the keep mask."""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _philox

# Random123's known-answer vectors for Philox4x32-10 (its tests/kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_known_answers(counter, key, expected):
    out = _philox.philox4x32(np.array(counter, dtype=np.uint32)[:, None], key, rounds=10)
    assert out.dtype == np.uint32 and out.shape == (4, 1)
    assert tuple(int(w) for w in out[:, 0]) == expected


def test_vectorised_draws_equal_one_at_a_time():
    counters = np.array([c for c, _, _ in KAT], dtype=np.uint32).T  # (4, 3)
    together = _philox.philox4x32(counters, (7, 9))
    for n in range(3):
        alone = _philox.philox4x32(counters[:, n:n + 1], (7, 9))
        assert np.array_equal(together[:, n], alone[:, 0])


def test_threshold():
    assert _philox.dropout_threshold(0.0) == 0
    assert _philox.dropout_threshold(0.5) == 2**15
    assert _philox.dropout_threshold(0.1) == 6553
    assert _philox.dropout_threshold(1 - 2**-40) == 2**16 - 1


def test_mask_depends_only_on_the_indices():
    """Any block of the mask, computed on its own, is that block of the whole mask."""
    seed, offset, p = 2**40 + 12345, 3, 0.3
    whole = _philox.dropout_keep_mask(seed, offset, p, 2, 3, 17, 45)
    block = _philox.keep_mask(seed, offset, p, 1, 2, np.arange(5, 12)[:, None], np.arange(13, 40)[None, :], 3)
    assert np.array_equal(block, whole[1, 2, 5:12, 13:40])
    one = _philox.keep_mask(seed, offset, p, 0, 1, 16, 44, 3)
    assert bool(one) == bool(whole[0, 1, 16, 44])


def test_keep_rate_is_within_four_sigma():
    p, n = 0.17, 2 * 8 * 256 * 256
    mask = _philox.dropout_keep_mask(5, 0, p, 2, 8, 256, 256)
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(mask.mean() - (1 - p)) < 4 * sigma


def test_state_changes_the_mask_and_p_zero_keeps_everything():
    a = _philox.dropout_keep_mask(1, 0, 0.5, 1, 2, 32, 32)
    assert np.array_equal(a, _philox.dropout_keep_mask(1, 0, 0.5, 1, 2, 32, 32))
    assert not np.array_equal(a, _philox.dropout_keep_mask(2, 0, 0.5, 1, 2, 32, 32))
    assert not np.array_equal(a, _philox.dropout_keep_mask(1, 1, 0.5, 1, 2, 32, 32))
    assert _philox.dropout_keep_mask(1, 0, 0.0, 1, 2, 32, 32).all()


def test_columns_and_heads_are_not_correlated():
    """Eight neighbouring columns share a Philox call, two a word, none a half-word."""
    mask = _philox.dropout_keep_mask(11, 0, 0.5, 1, 2, 64, 64)
    for other in range(1, 8):
        assert 0.4 < (mask[..., 0::8] == mask[..., other::8]).mean() < 0.6
    assert 0.4 < (mask[:, 0] == mask[:, 1]).mean() < 0.6


def test_keep_decision_is_the_documented_half_word():
    """Column j is decided by half j & 1 of word (j >> 1) & 3 of the call at counter
    (j >> 3, i, b * nheads + h, offset), against floor(p * 2**16)."""
    seed, offset, p, nheads = 2**33 + 7, 5, 0.37, 3
    b, h, i = 1, 2, 9
    key = (seed & 0xFFFFFFFF, seed >> 32)
    row = _philox.keep_mask(seed, offset, p, b, h, i, np.arange(40), nheads)
    for j in range(40):
        words = _philox.philox4x32(np.array([j >> 3, i, b * nheads + h, offset], dtype=np.uint32)[:, None], key)
        half = (int(words[(j >> 1) & 3, 0]) >> (16 * (j & 1))) & 0xFFFF
        assert bool(row[j]) == (half >= _philox.dropout_threshold(p))


def test_seven_rounds_differ_from_ten():
    c = np.array([1, 2, 3, 4], dtype=np.uint32)[:, None]
    assert _philox.ROUNDS == 7
    assert not np.array_equal(_philox.philox4x32(c, (5, 6)), _philox.philox4x32(c, (5, 6), rounds=10))
