"""``bench --suite bias``'s pure pieces: shapes, the sparse mask, figures, bars, the table (no GPU)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from cupyflash import _bench_bias as bb
from cupyflash import bench


def test_bias_shapes_per_case():
    assert bb.bias_shape("plain", 4, 16, 4096) is None
    assert bb.bias_shape("heads", 4, 16, 4096) == (1, 16, 4096, 4096)
    assert bb.bias_shape("batch", 4, 16, 4096) == (4, 1, 4096, 4096)
    assert bb.bias_shape("sparse", 4, 16, 4096) == (1, 1, 4096, 4096)


def test_sparse_mask_is_whole_blocks_with_the_diagonal_visible():
    blocks = bb.sparse_block_map(4096)
    assert blocks.shape == (32, 32) and blocks.diagonal().all()
    off = blocks[~np.eye(32, dtype=bool)]
    assert 0.03 < off.mean() < 0.2  # about 1 - SPARSE_EMPTY
    mask = bb.sparse_mask(4096)
    assert mask.shape == (4096, 4096) and mask.dtype == bool
    tiles = mask.reshape(32, 128, 32, 128)
    assert (tiles.all(axis=(1, 3)) == tiles.any(axis=(1, 3))).all()  # each block all True or all False
    assert (tiles.any(axis=(1, 3)) == blocks).all()
    assert (bb.sparse_block_map(4096) == blocks).all()  # seeded: the same map each run


def test_sparse_mask_of_a_length_that_is_not_a_block_multiple():
    mask = bb.sparse_mask(1000)
    assert mask.shape == (1000, 1000) and mask.any(axis=1).all()


def test_flops_and_stream_bytes():
    assert bb.bias_flops(4, 16, 128, 4096) == 4.0 * 4 * 16 * 128 * 4096 * 4096
    assert bb.bias_flops(4, 16, 128, 4096, bwd=True) == 2.5 * bb.bias_flops(4, 16, 128, 4096)
    assert bb.stream_bytes((1, 16, 1024, 1024), 2) == 16 * 1024 * 1024 * 2
    assert bb.stream_bytes((1, 16, 1024, 1024), 2, bwd=True) == 16 * 1024 * 1024 * 6


def _result(case, **times):
    r = bb.bias_result(case, head_dim=128, seqlen=4096, dtype="bfloat16", batch=4, nheads=16, input_sets=1)
    r.update(times)
    return r


def test_bars_pass_and_fail_on_the_right_side():
    plain = _result("plain", ours_fwd_ms=1.0, ours_bwd_ms=2.5)
    heads = _result("heads", ours_fwd_ms=1.2, ours_bwd_ms=3.0, sdpa_cudnn_fwd_ms=1.5, sdpa_efficient_fwd_ms=1.1,
                    sdpa_cudnn_bwd_ms="error", sdpa_efficient_bwd_ms=4.0, flex_fwd_ms=1.6, flex_bwd_ms=3.5)
    sparse = _result("sparse", ours_fwd_ms=0.14, ours_bwd_ms=0.5)
    checks = bb.judge_bias([plain, heads, sparse])
    assert heads["ratio_fwd_vs_sdpa"] == pytest.approx(1.1 / 1.2)  # the faster backend
    assert heads["bar_fwd_sdpa"] == "FAIL" and heads["bar_bwd_sdpa"] == "PASS"
    assert heads["bar_fwd_flex"] == "PASS" and heads["bar_bwd_flex"] == "FAIL"  # 1.33 and 1.17 against 1.3
    assert sparse["time_fwd_vs_plain"] == pytest.approx(0.14) and sparse["bar_fwd_plain"] == "PASS"
    assert heads["ours_fwd_stream_tbps"] == pytest.approx(16 * 4096 * 4096 * 2 / 1.2e-3 / 1e12)
    assert len(checks) == 5 and "bar_fwd_sdpa" not in plain


def test_unmeasured_ours_carries_its_marker_into_the_bars():
    heads = _result("heads", ours_fwd_ms="n/impl", ours_bwd_ms="n/impl", sdpa_cudnn_fwd_ms=1.0)
    bb.judge_bias([heads])
    assert heads["bar_fwd_sdpa"] == "n/impl" and heads["bar_fwd_flex"] == "n/impl"


def test_table_lists_every_result_and_the_bar_counts():
    report = {"results": [_result("plain", ours_fwd_ms=1.0), _result("heads", ours_fwd_ms=1.2, flex_fwd_ms=2.0)],
              "notes": []}
    bb.judge_report(report)
    text = bb.format_bias_table(report)
    assert text.count("\n 128   4096 ") == 2 and text.splitlines()[-1].startswith("bars: ")


def test_suite_is_registered_with_its_options():
    assert "bias" in bench.SUITES and bench._suite("bias") == bb.SUITE
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--suite", "bias", "--head-dim", "64", "--seqlen", "1024", "--dtype", "float16"])
    bench.check_suite_options(args)
    args = parser.parse_args(["--suite", "bias", "--variant", "window"])
    with pytest.raises(ValueError):
        bench.check_suite_options(args)


def test_ours_asks_for_dbias_only_with_a_bias_and_only_in_the_backward():
    bias, mask = object(), object()
    with_bias = bb.ours_bias(None, dtype="bfloat16", softmax_scale=0.1, bias=bias)
    assert with_bias.kwargs["attn_bias"] is bias and "return_dbias" not in with_bias.kwargs
    assert with_bias.bwd_kwargs["return_dbias"] is True and with_bias.bwd_kwargs["attn_bias"] is bias
    with_mask = bb.ours_bias(None, dtype="bfloat16", softmax_scale=0.1, mask=mask)
    assert with_mask.kwargs["attn_mask"] is mask and "return_dbias" not in with_mask.bwd_kwargs
