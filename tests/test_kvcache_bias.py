"""flash_attn_with_kvcache with an additive bias and a boolean mask (issue 14): the
CPU path against the float64 reference, the rule of the key dimension (a key's
position in its sequence, 1 or at least the cache's capacity), bad input, and the
GPU path's wiring on a fake GPU (the kernels' own tests are in test_gpu_decode.py).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import cupyflash
from cupyflash import _params, reference
from fakes import FakeCupyArray, install_fake_gpu
from test_kvcache import (FN, _call, _fake_gpu_args, _host_args, _paged, _valid, i32, rand)

#: max|got - want| <= tol * max(1, max|want|), per dtype of q (the CPU path adds the
#: bias in float32, cupyflash.cpu.fwd, so float64 is held to float32's rounding of it)
_TOL = {"float64": 1e-6, "float32": 2e-5, "float16": 3e-3}


def _capacity(args):
    cache = args["k_cache"]
    return cache.shape[1] * (args["block_table"].shape[1] if args.get("block_table") is not None else 1)


def _reference(args, **scores):
    """The float64 reference of a call (on copies of the caches before it)."""
    return reference.attention_with_kvcache(
        args["q"], args["k_cache"], args["v_cache"], args.get("k"), args.get("v"), args.get("cache_seqlens"),
        args.get("cache_batch_idx"), args.get("block_table"), args.get("softmax_scale"), args.get("causal", False),
        **scores)[:2]


def _assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any()
    hidden = np.isneginf(want)
    assert np.array_equal(np.isneginf(got), hidden)
    if (~hidden).any():
        err = np.abs(got[~hidden] - want[~hidden]).max()
        assert err <= _TOL[dtype] * max(1.0, np.abs(want[~hidden]).max()), err


def check(args, **scores):
    """Run on copies of the caches; out and lse against the reference. Returns (out, lse)."""
    before = {n: (x.copy() if isinstance(x, np.ndarray) else x) for n, x in args.items()}
    out, lse = _call(dict(args, return_lse=True, **scores))
    want_out, want_lse = _reference(before, **scores)
    _assert_close(out, want_out, args["q"].dtype.name)
    _assert_close(lse, want_lse, args["q"].dtype.name)
    return out, lse


def _bias_form(rng, form, batch, nheads, seqlen_q, capacity, dtype="float32"):
    """A bias of one broadcast or stride form (with some -inf entries)."""
    if form == "full":
        x = rand(rng, (batch, nheads, seqlen_q, capacity), dtype)
    elif form == "heads_rank3_fp32":
        x = rand(rng, (nheads, seqlen_q, capacity))
    elif form == "keys_rank1":
        x = rand(rng, (capacity,), dtype)
    elif form == "key_dim_1":
        x = rand(rng, (batch, nheads, seqlen_q, 1), dtype)
    elif form == "wider":
        x = rand(rng, (batch, 1, seqlen_q, capacity + 13), dtype)
    elif form == "stride0":  # a broadcast view, read in place
        x = np.broadcast_to(rand(rng, (1, 1, 1, capacity), dtype), (batch, nheads, seqlen_q, capacity))
    elif form == "sliced":  # every stride other than the dense one
        x = rand(rng, (batch, 2 * nheads, seqlen_q + 2, 2 * capacity), dtype)[:, ::2, 1:seqlen_q + 1, ::2]
    elif form == "transposed":
        x = rand(rng, (batch, capacity, seqlen_q, nheads), dtype).transpose(0, 3, 2, 1)
    else:
        raise ValueError(form)
    if x.flags.writeable and x.size > 4:
        x[rng.random(x.shape) < 0.2] = -np.inf
    return x


BIAS_FORMS = ["full", "heads_rank3_fp32", "keys_rank1", "key_dim_1", "wider", "stride0", "sliced", "transposed"]


@pytest.mark.parametrize("form", BIAS_FORMS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_bias_forms_match_the_reference(rng, form, paged, causal):
    """Appended k/v, GQA (4 query heads on 2 KV heads), lengths 5 and 30 (+2 appended)."""
    args = _paged(_valid(rng)) if paged else _valid(rng)
    batch, seqlen_q, nheads, _ = args["q"].shape
    bias = _bias_form(rng, form, batch, nheads, seqlen_q, _capacity(args))
    check(dict(args, causal=causal), attn_bias=bias)


MASK_FORMS = {
    "padding": lambda rng, b, h, s, n: rng.random((b, 1, 1, n)) < 0.7,
    "per_head_rank3": lambda rng, b, h, s, n: rng.random((h, s, n)) < 0.6,
    "stride0": lambda rng, b, h, s, n: np.broadcast_to(rng.random((1, 1, s, n)) < 0.5, (b, h, s, n)),
    "sliced": lambda rng, b, h, s, n: (rng.random((b, h, s, 3 * n)) < 0.6)[..., 1::3],
}


@pytest.mark.parametrize("form", sorted(MASK_FORMS))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_mask_forms_match_the_reference(rng, form, paged, with_bias):
    args = _paged(_valid(rng)) if paged else _valid(rng)
    batch, seqlen_q, nheads, _ = args["q"].shape
    capacity = _capacity(args)
    scores = {"attn_mask": MASK_FORMS[form](rng, batch, nheads, seqlen_q, capacity)}
    if with_bias:
        scores["attn_bias"] = _bias_form(rng, "full", batch, nheads, seqlen_q, capacity)
    check(dict(args, causal=True), **scores)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_dtypes_with_a_bias_of_q_dtype_and_of_float32(rng, dtype):
    args = {n: (x.astype(dtype) if isinstance(x, np.ndarray) and x.dtype == np.float32 else x)
            for n, x in _valid(rng).items()}
    for bias_dtype in (dtype, "float32"):
        check(dict(args, causal=True), attn_bias=rand(rng, (2, 4, 3, 32), bias_dtype),
              attn_mask=rng.random((2, 1, 1, 32)) < 0.8)


@pytest.mark.parametrize("how", ["bias", "mask"])
@pytest.mark.parametrize("paged", [False, True])
def test_fully_masked_rows_give_zero_and_minus_inf(rng, how, paged):
    """A row whose every key the bias (-inf) or the mask hides: out 0, lse -inf, no NaN;
    the other rows as the reference; with sinks, lse is the sink."""
    args = _paged(_valid(rng)) if paged else _valid(rng)
    batch, seqlen_q, nheads, _ = args["q"].shape
    capacity = _capacity(args)
    if how == "bias":
        scores = {"attn_bias": rand(rng, (batch, nheads, seqlen_q, capacity))}
        scores["attn_bias"][0, 1, 2] = -np.inf
        scores["attn_bias"][1, :, 0] = -np.inf
    else:
        scores = {"attn_mask": np.ones((batch, nheads, seqlen_q, capacity), bool)}
        scores["attn_mask"][0, 1, 2] = False
        scores["attn_mask"][1, :, 0] = False
    out, lse = check(args, **scores)
    assert (out[0, 2, 1] == 0).all() and (out[1, 0] == 0).all()
    assert lse[0, 1, 2] == -np.inf and (lse[1, :, 0] == -np.inf).all()
    sinks = rand(rng, (nheads,))
    out, lse = _call(dict(args, return_lse=True, sinks=sinks, **scores))
    assert not np.isnan(out).any() and (out[1, 0] == 0).all()
    np.testing.assert_allclose(lse[1, :, 0], sinks, rtol=1e-6)


def test_bias_is_indexed_by_key_position_not_cache_slot(rng):
    """A paged cache holding the same sequences as a dense one (pages in another order)
    gives the same result with the same bias: key j of a sequence takes column j."""
    dense = _valid(rng)
    page_size = 16
    table = i32([[3, 0], [1, 5]])
    k_pool, v_pool = (np.zeros((6, page_size, 2, 16), np.float32) for _ in range(2))
    for b in range(2):
        for p in range(2):
            k_pool[table[b, p]] = dense["k_cache"][b, p * page_size:(p + 1) * page_size]
            v_pool[table[b, p]] = dense["v_cache"][b, p * page_size:(p + 1) * page_size]
    paged = dict(dense, k_cache=k_pool, v_cache=v_pool, block_table=table)
    scores = dict(attn_bias=rand(rng, (2, 4, 3, 32)), attn_mask=rng.random((2, 1, 3, 32)) < 0.7)
    want = _call(dict(dense, k_cache=dense["k_cache"].copy(), v_cache=dense["v_cache"].copy(), causal=True,
                      return_lse=True, **scores))
    got = _call(dict(paged, causal=True, return_lse=True, **scores))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_columns_past_a_sequence_are_never_used(rng):
    """NaN (bias) and False (mask) past each sequence's keys change nothing."""
    args = _valid(rng)
    capacity = _capacity(args)
    bias = rand(rng, (2, 4, 3, capacity + 5))
    mask = rng.random((2, 1, 3, capacity + 5)) < 0.7
    lengths = args["cache_seqlens"] + args["k"].shape[1]
    poisoned_bias, poisoned_mask = bias.copy(), mask.copy()
    for b, n in enumerate(lengths):
        poisoned_bias[b, ..., n:] = np.nan
        poisoned_mask[b, ..., n:] = False
    copies = lambda: {n: (x.copy() if isinstance(x, np.ndarray) else x) for n, x in args.items()}  # noqa: E731
    want = _call(dict(copies(), return_lse=True, attn_bias=bias, attn_mask=mask))
    got = _call(dict(copies(), return_lse=True, attn_bias=poisoned_bias, attn_mask=poisoned_mask))
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_cache_batch_idx_and_whole_cache(rng):
    """Rows picked by cache_batch_idx, no append, cache_seqlens None (the whole cache)."""
    args = _valid(rng)
    args.update(k=None, v=None, cache_seqlens=None, cache_batch_idx=i32([1, 0]))
    check(args, attn_bias=rand(rng, (2, 4, 3, 32)), attn_mask=rng.random((4, 3, 32)) < 0.8)


def test_a_block_mask_is_taken_as_its_mask(rng):
    args = _valid(rng)
    mask = rng.random((2, 4, 3, 32)) < 0.6
    copies = lambda: {n: (x.copy() if isinstance(x, np.ndarray) else x) for n, x in args.items()}  # noqa: E731
    want = _call(dict(copies(), attn_mask=mask))
    assert np.array_equal(_call(dict(copies(), attn_mask=cupyflash.BlockMask.from_mask(mask))), want)


def test_reference_bias_is_the_dense_reference_per_sequence(rng):
    """reference.attention_with_kvcache's bias: the dense reference's on each sequence's keys."""
    args = _valid(rng)
    bias, mask = rand(rng, (2, 4, 3, 40)), rng.random((2, 1, 3, 40)) < 0.7
    out, lse, kc, vc = reference.attention_with_kvcache(
        args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"], causal=True,
        attn_bias=bias, attn_mask=mask)
    for b, n in enumerate(args["cache_seqlens"] + 2):
        o, l = reference.attention_fwd(args["q"][b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], None, True,
                                       attn_bias=bias[b:b + 1, ..., :n], attn_mask=mask[b:b + 1, ..., :n])
        np.testing.assert_allclose(out[b], o[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b], l[0], rtol=1e-12, atol=1e-12)


def test_extra_memory_is_the_bias_own_size(rng):
    """A broadcast bias over a big batch is never expanded: the call allocates about
    one sequence's keys and values, not batch * nheads * seqlen_q * capacity floats."""
    import tracemalloc

    batch, capacity = 64, 512
    q = rand(rng, (batch, 1, 8, 16))
    k_cache, v_cache = rand(rng, (batch, capacity, 2, 16)), rand(rng, (batch, capacity, 2, 16))
    bias = np.broadcast_to(rand(rng, (1, 1, 1, capacity)), (batch, 8, 1, capacity))
    lengths = np.full(batch, capacity, np.int32)
    tracemalloc.start()
    cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, attn_bias=bias)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < batch * 8 * capacity * 4 // 2, peak


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------

LAYOUT = "(batch, nheads_q, seqlen_q, key)"
BAD = [
    ("bias rank 5", ValueError,
     f"attn_bias must have at most 4 dimensions, broadcastable to {LAYOUT}; got 5 with shape (1, 2, 4, 3, 32).",
     dict(attn_bias=np.zeros((1, 2, 4, 3, 32), np.float32))),
    ("bias nheads", ValueError,
     f"attn_bias must be broadcastable to {LAYOUT} = (2, 4, 3, >= 32), each dimension 1 or full (left-padded "
     f"with 1s to 4 dimensions); got shape (2, 3, 3, 32), whose nheads_q is 3.",
     dict(attn_bias=np.zeros((2, 3, 3, 32), np.float32))),
    ("bias batch", ValueError,
     f"attn_bias must be broadcastable to {LAYOUT} = (2, 4, 3, >= 32), each dimension 1 or full (left-padded "
     f"with 1s to 4 dimensions); got shape (3, 1, 1, 32), whose batch is 3.",
     dict(attn_bias=np.zeros((3, 1, 1, 32), np.float32))),
    ("mask seqlen_q", ValueError,
     f"attn_mask must be broadcastable to {LAYOUT} = (2, 4, 3, >= 32), each dimension 1 or full (left-padded "
     f"with 1s to 4 dimensions); got shape (2, 32), whose seqlen_q is 2.",
     dict(attn_mask=np.ones((2, 32), bool))),
    ("bias keys short", ValueError,
     f"attn_bias must have a last dimension (the key position in a sequence) of 1 or at least the cache's "
     f"capacity (32 keys per sequence), broadcastable to {LAYOUT}; got shape (4, 3, 31), whose key dimension "
     f"is 31.", dict(attn_bias=np.zeros((4, 3, 31), np.float32))),
    ("mask float", TypeError,
     "attn_mask must have dtype bool (True = attend; a float mask belongs in attn_bias); got float32.",
     dict(attn_mask=np.ones((32,), np.float32))),
    ("mask int", TypeError,
     "attn_mask must have dtype bool (True = attend; a float mask belongs in attn_bias); got int32.",
     dict(attn_mask=np.ones((32,), np.int32))),
    ("bias float64", TypeError, "attn_bias must have q's dtype (float32) or float32; got float64.",
     dict(attn_bias=np.zeros((32,), np.float64))),
    ("bias list", TypeError, "attn_bias must be a numpy.ndarray or cupy.ndarray; got list.",
     dict(attn_bias=[0.0] * 32)),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
@pytest.mark.parametrize("paged", [False, True])
def test_bad_input(case, paged):
    _, cls, message, scores = case
    args = _paged(_valid()) if paged else _valid()
    k_cache0 = args["k_cache"].copy()
    with pytest.raises(cls, match="^" + re.escape(f"cupyflash.{FN}: {message}") + "$"):
        _call(dict(args, **scores))
    assert np.array_equal(args["k_cache"], k_cache0)  # nothing appended before the check


def test_bad_input_on_the_gpu(monkeypatch, rng):
    """float64 and host arrays and another device are refused on the (fake) GPU."""
    install_fake_gpu(monkeypatch)
    args = _fake_gpu_args(rng)
    with pytest.raises(TypeError, match="^" + re.escape(
            f"cupyflash.{FN}: attn_bias must have q's dtype (float16) or float32; got float64.") + "$"):
        _call(dict(args, attn_bias=FakeCupyArray(np.zeros((32,), np.float64))))
    with pytest.raises(TypeError, match="^" + re.escape(
            f"cupyflash.{FN}: attn_mask must be a cupy.ndarray like q (numpy and cupy inputs cannot be mixed); "
            f"got numpy.ndarray.") + "$"):
        _call(dict(args, attn_mask=np.ones((32,), bool)))
    with pytest.raises(ValueError, match=re.escape(f"cupyflash.{FN}: attn_bias must be on the same device as q")):
        _call(dict(args, attn_bias=FakeCupyArray(np.zeros((32,), np.float16), device_id=1)))


# ----------------------------------------------------------------------------
# The GPU path's wiring (a fake GPU computing with the CPU path)
# ----------------------------------------------------------------------------


def _compute_decode_with_scores(plan_kwargs, q, k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens,
                                cache_batch_idx, block_table, cache_seqlen, var=None):
    """compute_decode for the fake GPU: the CPU path with the plan's options, the bias and
    mask read at this call's pointers (``var``, _params.VARIANT_PER_CALL)."""
    from fakes import BY_POINTER

    options = dict(plan_kwargs.get("options") or {})
    alibi, sinks, dsinks, bias, mask, dbias, block_map, kv_block_map, seed, offset = var
    assert (dsinks, dbias, block_map, kv_block_map, seed, offset) == (0,) * 6
    assert (bias != 0) == ("attn_bias" in options) and (mask != 0) == ("attn_mask" in options)
    for name, ptr in (("alibi_slopes", alibi), ("sinks", sinks), ("attn_bias", bias), ("attn_mask", mask)):
        if ptr:
            options[name] = BY_POINTER[ptr].host
    host = lambda a: None if a is None else a.host  # noqa: E731
    o, l = cupyflash.flash_attn_with_kvcache(
        host(q), host(k_cache), host(v_cache), host(k_new), host(v_new),
        cache_seqlens=cache_seqlen if cache_seqlens is None else cache_seqlens.host,
        cache_batch_idx=host(cache_batch_idx), block_table=host(block_table),
        softmax_scale=plan_kwargs["softmax_scale"], causal=plan_kwargs["causal"], return_lse=True, **options)
    out.host[...] = o
    if lse is not None:
        lse.host[...] = l


@pytest.mark.parametrize("paged", [False, True])
def test_gpu_calls_plan_the_decode_kernel_with_the_bias_and_mask(monkeypatch, rng, paged):
    """One plan per signature; each call passes its own bias's and mask's pointers, even
    where a long chunk on a dense cache would take the dense forward."""
    from cupyflash import dispatch

    plans, runs = install_fake_gpu(monkeypatch, compute_decode=_compute_decode_with_scores)
    monkeypatch.setattr(dispatch, "decode_uses_dense_fwd", lambda **kw: True)
    args = _fake_gpu_args(rng, paged)
    for step in range(2):
        bias = rand(rng, (2, 1, 3, 40)).astype(np.float16)
        mask = rng.random((4, 1, 32)) < 0.7
        host = _host_args(args)
        expect = _call(dict(host, causal=True, return_lse=True, attn_bias=bias, attn_mask=mask))
        out, lse = _call(dict(args, causal=True, return_lse=True, attn_bias=FakeCupyArray(bias),
                              attn_mask=FakeCupyArray(mask)))
        assert np.array_equal(out.host, expect[0]) and np.array_equal(lse.host, expect[1])
    assert [kind for kind, _ in plans] == ["decode"] and len(runs) == 2
    planned = plans[0][1]["options"]
    assert sorted(planned) == ["attn_bias", "attn_mask"] and planned["attn_bias"].shape == (2, 1, 3, 40)
    assert planned["attn_mask"].shape == (1, 4, 1, 32)  # the 4-D view
    # another geometry is another plan
    _call(dict(args, attn_bias=FakeCupyArray(rand(rng, (2, 4, 3, 32)).astype(np.float16))))
    assert len(plans) == 2


@pytest.mark.parametrize("which", ["bias", "bias_fp32 mask", "mask strided", "bias strided"])
def test_plan_decode_sets_the_bias_bits_and_strides(monkeypatch, rng, which):
    """The real planner (kernels not built): VAR_BIAS / VAR_BIAS_FP32 / VAR_MASK with no
    qualifier bit (element reads at any strides), the broadcast strides in the template."""
    from cupyflash import _gpu_decode, _launch, _variant, dispatch

    made = []

    class Launcher:
        def __init__(self, launches, template, writer, variant=None):
            made.append((launches, template))

    monkeypatch.setattr(_launch, "Launcher", Launcher)
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: 132)
    monkeypatch.setattr(_launch, "compute_capability", lambda device_id: (9, 0))
    q = FakeCupyArray(np.zeros((2, 3, 8, 64), np.float16))
    k_cache, v_cache = (FakeCupyArray(np.zeros((2, 4096, 2, 64), np.float16)) for _ in range(2))
    options, want_bits = {}, 0
    if "bias" in which:
        dtype = np.float32 if "fp32" in which else np.float16
        bias = np.zeros((2, 8, 3, 2 * 4096) if "strided" in which else (8, 1, 4096), dtype)
        options["attn_bias"] = FakeCupyArray(bias[..., ::2] if "strided" in which else bias[None])
        want_bits |= dispatch.VAR_BIAS_FP32 if "fp32" in which else dispatch.VAR_BIAS
    if "mask" in which:
        mask = np.ones((2, 1, 3, 3 * 4096) if "strided" in which else (2, 1, 3, 4096), bool)
        options["attn_mask"] = FakeCupyArray(mask[..., 1::3] if "strided" in which else mask)
        want_bits |= dispatch.VAR_MASK
    _gpu_decode.plan_decode(q, k_cache, v_cache, None, None, None, max_seqlen_k=4096, softmax_scale=0.125,
                            causal=True, num_splits=0, dtype_name="float16", device_id=0, options=options)
    (launches, template), = made
    assert launches[0].args[-1] == str(want_bits) == str(_variant.decode_bits(options))
    var = np.frombuffer(template, _params.DECODE_PARAMS)[0]["var"]
    for name in ("bias", "mask"):
        x = options.get(f"attn_{name}")
        if x is not None:
            strides = tuple(var[f"{name}_{axis}_stride"] for axis in ("batch", "head", "row", "col"))
            assert strides == _variant.broadcast_strides(x)
            assert strides[3] == (2 if name == "bias" else 3) if "strided" in which else strides[3] == 1
