"""flash_attn_with_kvcache calls shared by the framework tests (torch, JAX).

Each case is a dict of NumPy arguments (``q``, ``k_cache``, ``v_cache``, ``k``,
``v``, ``cache_seqlens``, ``cache_batch_idx``, ``block_table``, ``causal``,
``softmax_scale``): per-sequence lengths (including 0) with an append, a paged
cache with a shared prefix and shuffled blocks, ``cache_batch_idx``, chunked
prefill, GQA/MQA, an int ``cache_seqlens`` and the whole cache.
:func:`expected` runs the NumPy core on copies (the framework results must be
the same bits on the CPU) and checks it against the float64 reference.
"""

from __future__ import annotations

import numpy as np

import cupyflash
from cupyflash import testing

#: The cases, by name.
NAMES = ("dense-append", "lengths-zero-and-full", "paged-shared-prefix-append", "paged-64-repeats",
         "batch-idx-mqa-append", "chunked-prefill", "gqa-int-seqlens", "whole-cache",
         "softmax-scale")

#: The array arguments, in flash_attn_with_kvcache's order.
ARRAYS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "block_table")


def _i32(values):
    return np.asarray(values, dtype=np.int32)


def make(name, rng, dtype="float32"):
    """The arguments of case ``name`` (NumPy arrays of ``dtype``; int32 indices)."""

    def rand(*shape):
        return testing.random_normal(rng, shape, dtype)

    args = dict(k=None, v=None, cache_seqlens=None, cache_batch_idx=None, block_table=None,
                causal=False, softmax_scale=None)
    if name == "dense-append":
        args.update(q=rand(3, 1, 4, 16), k_cache=rand(3, 64, 2, 16), v_cache=rand(3, 64, 2, 16),
                    k=rand(3, 1, 2, 16), v=rand(3, 1, 2, 16), cache_seqlens=_i32([0, 7, 40]),
                    causal=True)
    elif name == "lengths-zero-and-full":
        args.update(q=rand(4, 2, 4, 16), k_cache=rand(4, 64, 2, 16), v_cache=rand(4, 64, 2, 16),
                    cache_seqlens=_i32([0, 1, 33, 64]))
    elif name == "paged-shared-prefix-append":
        # 2 shared prefix blocks (32 keys), then 2 own blocks each, in shuffled physical order
        perm = rng.permutation(12)
        shared, own = perm[:2], perm[2:6].reshape(2, 2)
        table = _i32([[*shared, *own[0]], [*shared, *own[1]]])
        args.update(q=rand(2, 3, 4, 16), k_cache=rand(12, 16, 2, 16), v_cache=rand(12, 16, 2, 16),
                    k=rand(2, 3, 2, 16), v=rand(2, 3, 2, 16), cache_seqlens=_i32([40, 36]),
                    block_table=table, causal=True)
    elif name == "paged-64-repeats":
        table = _i32(rng.integers(0, 5, size=(3, 3)))
        args.update(q=rand(3, 1, 8, 16), k_cache=rand(5, 64, 2, 16), v_cache=rand(5, 64, 2, 16),
                    cache_seqlens=_i32([10, 150, 0]), block_table=table)
    elif name == "batch-idx-mqa-append":
        args.update(q=rand(3, 1, 4, 16), k_cache=rand(4, 48, 1, 16), v_cache=rand(4, 48, 1, 16),
                    k=rand(3, 1, 1, 16), v=rand(3, 1, 1, 16), cache_seqlens=_i32([5, 20, 47]),
                    cache_batch_idx=_i32([2, 0, 3]), causal=True)
    elif name == "chunked-prefill":
        args.update(q=rand(2, 16, 4, 32), k_cache=rand(2, 64, 2, 32), v_cache=rand(2, 64, 2, 32),
                    k=rand(2, 16, 2, 32), v=rand(2, 16, 2, 32), cache_seqlens=_i32([0, 20]),
                    causal=True)
    elif name == "gqa-int-seqlens":
        args.update(q=rand(2, 3, 4, 16), k_cache=rand(2, 40, 4, 16), v_cache=rand(2, 40, 4, 16),
                    cache_seqlens=30, causal=True)
    elif name == "whole-cache":
        args.update(q=rand(2, 5, 2, 16), k_cache=rand(2, 24, 1, 16), v_cache=rand(2, 24, 1, 16))
    elif name == "softmax-scale":
        args.update(q=rand(2, 1, 2, 8), k_cache=rand(2, 32, 2, 8), v_cache=rand(2, 32, 2, 8),
                    k=rand(2, 2, 2, 8), v=rand(2, 2, 2, 8), cache_seqlens=_i32([3, 30]),
                    softmax_scale=0.3)
    else:
        raise KeyError(name)
    return args


def call(fn, args, **extra):
    """``fn(q, k_cache, v_cache, k, v, cache_seqlens=..., ...)`` with the case's arguments."""
    a = dict(args)
    return fn(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("k"), a.pop("v"), **a, **extra)


def expected(args):
    """``(out, lse, k_cache, v_cache)`` of the NumPy core on copies of the caches, checked
    against the float64 reference (the naive same-dtype rule of test_kvcache)."""
    from test_kvcache import assert_matches_reference

    k_cache, v_cache = args["k_cache"].copy(), args["v_cache"].copy()
    out, lse = call(cupyflash.flash_attn_with_kvcache,
                    dict(args, k_cache=k_cache, v_cache=v_cache), return_lse=True)
    ref_k, ref_v = assert_matches_reference(
        args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], out, lse,
        cache_seqlens=args["cache_seqlens"], cache_batch_idx=args["cache_batch_idx"],
        block_table=args["block_table"], softmax_scale=args["softmax_scale"],
        causal=args["causal"])
    assert np.array_equal(k_cache.astype(np.float64), ref_k)
    assert np.array_equal(v_cache.astype(np.float64), ref_v)
    return out, lse, k_cache, v_cache
