"""cupyflash.torch.flash_attn_with_kvcache: CPU tensors (and, marked gpu, CUDA tensors).

The append goes into the caller's cache tensors.  On the CPU the results must
be the NumPy core's bits (the core's results are checked against the float64
reference, tests/kvcache_cases.py), in eager mode and under
``torch.compile(fullgraph=True)`` (the custom operator
``cupyflash::flash_attn_with_kvcache``, declared to mutate the caches).  No
gradient flows, as in flash-attention.  Skipped without torch.
"""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cft = pytest.importorskip("cupyflash.torch")

import kvcache_cases as cases  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _interop, testing  # noqa: E402

f = cft.flash_attn_with_kvcache
FN = "flash_attn_with_kvcache"
_HAS_BF16 = importlib.util.find_spec("ml_dtypes") is not None
_BF16 = pytest.param("bfloat16", marks=pytest.mark.skipif(not _HAS_BF16,
                                                          reason="bfloat16 needs ml_dtypes"))


def to_torch(args, device="cpu"):
    """The case's NumPy arrays as fresh torch tensors on ``device`` (bfloat16 included)."""
    return {n: (_interop.numpy_to_torch(x.copy()).to(device) if isinstance(x, np.ndarray) else x)
            for n, x in args.items()}


def host(t):
    """A NumPy copy of a tensor on any device (bfloat16 as ml_dtypes.bfloat16)."""
    return _interop.torch_to_numpy(t.detach().cpu()).copy()


# ----------------------------------------------------------------------------
# Results and the in-place append (CPU)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", cases.NAMES)
def test_matches_the_core_and_appends_into_the_callers_tensors(rng, name):
    args = cases.make(name, rng)
    out, lse, k_cache, v_cache = cases.expected(args)
    t = to_torch(args)
    seqlens0 = (t["cache_seqlens"].clone() if isinstance(t["cache_seqlens"], torch.Tensor)
                else None)
    got_out, got_lse = cases.call(f, t, return_lse=True)
    assert isinstance(got_out, torch.Tensor) and got_out.dtype == torch.float32
    assert got_lse.dtype == torch.float32 and tuple(got_lse.shape) == lse.shape
    assert np.array_equal(host(got_out), out) and np.array_equal(host(got_lse), lse)
    # the caller's own tensors hold the append
    assert np.array_equal(host(t["k_cache"]), k_cache)
    assert np.array_equal(host(t["v_cache"]), v_cache)
    if seqlens0 is not None:
        assert torch.equal(t["cache_seqlens"], seqlens0)  # not advanced, as in flash-attention


@pytest.mark.parametrize("dtype", ["float16", _BF16, "float64"])
def test_dtypes(rng, dtype):
    args = cases.make("paged-shared-prefix-append", rng, dtype)
    out, lse, k_cache, _ = cases.expected(args)
    t = to_torch(args)
    got_out, got_lse = cases.call(f, t, return_lse=True)
    assert got_out.dtype == t["q"].dtype
    assert np.array_equal(host(got_out), out) and np.array_equal(host(got_lse), lse)
    assert np.array_equal(host(t["k_cache"]), k_cache)


def test_return_structure(rng):
    t = to_torch(cases.make("dense-append", rng))
    out = cases.call(f, t)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (3, 1, 4, 16)
    out_lse = cases.call(f, t, return_lse=True)
    assert isinstance(out_lse, tuple) and len(out_lse) == 2
    alias = cases.call(f, t, return_softmax_lse=True)  # flash-attention's name
    assert isinstance(alias, tuple) and torch.equal(alias[1], out_lse[1])


def test_no_gradient_flows(rng):
    """As flash-attention's flash_attn_with_kvcache: no backward, outputs without grad_fn."""
    t = to_torch(cases.make("dense-append", rng))
    q, k = t["q"].requires_grad_(), t["k"].requires_grad_()
    out, lse = f(q, t["k_cache"], t["v_cache"], k, t["v"], cache_seqlens=t["cache_seqlens"],
                 return_lse=True)
    assert not out.requires_grad and out.grad_fn is None and not lse.requires_grad


def test_version_counters_record_the_append(rng):
    """Autograd is told the caches changed (a tensor saved for a backward and then
    appended into is caught); inference tensors, which have no counter, work too."""
    args = cases.make("dense-append", rng)
    t = to_torch(args)
    versions = t["k_cache"]._version, t["v_cache"]._version
    cases.call(f, dict(t, k=None, v=None))
    assert (t["k_cache"]._version, t["v_cache"]._version) == versions  # nothing written
    cases.call(f, t)
    assert t["k_cache"]._version > versions[0] and t["v_cache"]._version > versions[1]
    _, _, k_cache, _ = cases.expected(args)
    with torch.inference_mode():  # tensors made here (clone) are inference tensors
        t = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in to_torch(args).items()}
        assert t["k_cache"].is_inference()
        cases.call(f, t)
        assert np.array_equal(host(t["k_cache"]), k_cache)


def test_strides(rng):
    """q, k, v with a non-unit last stride are copied (as flash-attention); the caches
    cannot be (the append must land in them): refused."""
    args = cases.make("dense-append", rng)
    out, _, k_cache, _ = cases.expected(args)
    t = to_torch(args)

    def strided(x):
        return torch.repeat_interleave(x, 2, dim=-1)[..., ::2]

    got = f(strided(t["q"]), t["k_cache"], t["v_cache"], strided(t["k"]), strided(t["v"]),
            cache_seqlens=t["cache_seqlens"], causal=True)
    assert np.array_equal(host(got), out) and np.array_equal(host(t["k_cache"]), k_cache)
    message = (f"cupyflash.{FN}: k_cache must have unit stride in its last dimension (head_dim); "
               "got a stride of 2 elements.")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        f(t["q"], strided(t["k_cache"]), t["v_cache"], t["k"], t["v"],
          cache_seqlens=t["cache_seqlens"])


def test_mixed_dtypes_are_refused(rng):
    t = to_torch(cases.make("dense-append", rng))
    message = f"cupyflash.{FN}: k_cache must have the same dtype as q (float32); got float64."
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        f(t["q"], t["k_cache"].double(), t["v_cache"], t["k"], t["v"],
          cache_seqlens=t["cache_seqlens"])
    message = f"cupyflash.{FN}: cache_seqlens must have dtype int32; got int64."
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        f(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"],
          cache_seqlens=t["cache_seqlens"].long())


@pytest.mark.parametrize("option, value, shown", [
    ("rotary_cos", "tensor", "'Tensor'"), ("rotary_sin", "tensor", "'Tensor'"),
    ("cache_leftpad", "tensor", "'Tensor'"), ("alibi_slopes", "tensor", "'Tensor'"),
    ("window_size", (4, 0), "(4, 0)"), ("softcap", 1.0, "1.0")])
def test_unsupported_options(rng, option, value, shown):
    t = to_torch(cases.make("dense-append", rng))
    value = torch.ones(3) if value == "tensor" else value
    rule = {"window_size": "(-1, -1)", "softcap": "0.0"}.get(option, "None")
    message = (f"cupyflash.torch.{FN}: {option} must be {rule} ({option} is not implemented); "
               f"got {shown}.")
    k_cache0 = t["k_cache"].clone()
    with pytest.raises(NotImplementedError, match="^" + re.escape(message) + "$"):
        cases.call(f, t, **{option: value})
    assert torch.equal(t["k_cache"], k_cache0)  # refused before anything is written
    cases.call(f, t, rotary_interleaved=False)  # meaningless without rotary_cos: ignored


# ----------------------------------------------------------------------------
# torch.compile: the custom operator
# ----------------------------------------------------------------------------


def test_the_operator_is_registered():
    op = torch.ops.cupyflash.flash_attn_with_kvcache.default
    mutated = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["k_cache", "v_cache"]


@pytest.mark.parametrize("seqlens", ["tensor", "int"])
def test_torch_compile_fullgraph_keeps_the_append(rng, seqlens):
    args = cases.make("paged-shared-prefix-append", rng)
    if seqlens == "int":
        args["cache_seqlens"] = 36
    out, lse, k_cache, v_cache = cases.expected(args)
    t = to_torch(args)
    lengths = t["cache_seqlens"]

    def step(q, k_cache, v_cache, k, v, table, *maybe_lengths):
        return f(q, k_cache, v_cache, k, v, cache_seqlens=maybe_lengths[0] if maybe_lengths else lengths,
                 block_table=table, causal=True, return_lse=True)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    extra = (lengths,) if seqlens == "tensor" else ()
    got_out, got_lse = compiled(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], t["block_table"],
                                *extra)
    assert np.array_equal(host(got_out), out) and np.array_equal(host(got_lse), lse)
    assert np.array_equal(host(t["k_cache"]), k_cache)
    assert np.array_equal(host(t["v_cache"]), v_cache)


# Before: under torch.compile the scalars went through int()/bool()/float() unchecked:
# cache_seqlens=3.7 ran as 3, causal="no" as causal, num_splits=1.5 as 1 (eager mode
# raised the core's TypeError for each).
@pytest.mark.parametrize("kwargs,text", [
    ({"cache_seqlens": 3.7}, "cache_seqlens must be None, an int or an int32 array"),
    ({"cache_seqlens": True}, "cache_seqlens must be None, an int or an int32 array"),
    ({"causal": "no"}, "causal must be a bool; got str."),
    ({"num_splits": 1.5}, "num_splits must be an int (0: automatic); got float."),
    ({"softmax_scale": "0.5"}, "softmax_scale must be a real number or None; got str."),
])
def test_torch_compile_checks_the_scalars_like_eager(kwargs, text):
    q, k_cache, v_cache = (torch.randn(2, 1, 4, 16), torch.randn(2, 8, 2, 16),
                           torch.randn(2, 8, 2, 16))
    k, v = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    kwargs = {"cache_seqlens": 3, **kwargs}
    message = re.escape(f"cupyflash.flash_attn_with_kvcache: {text}")
    with pytest.raises(TypeError, match="^" + message):
        f(q, k_cache, v_cache, k, v, **kwargs)
    compiled = torch.compile(lambda *a: f(*a, **kwargs), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception) as exc:  # noqa: PT011 (dynamo wraps the TypeError, quoting it)
        compiled(q, k_cache, v_cache, k, v)
    assert f"TypeError('cupyflash.flash_attn_with_kvcache: {text}" in str(exc.value), exc.value


def test_opcheck(rng):
    """The schema (what is mutated) and the fake implementation agree with the kernel."""
    t = to_torch(cases.make("paged-shared-prefix-append", rng))
    torch.library.opcheck(
        torch.ops.cupyflash.flash_attn_with_kvcache.default,
        (t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], t["cache_seqlens"], None, None,
         t["block_table"], 0.25, True, 0),
        test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------
# CUDA tensors
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} sees no CUDA device")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", _BF16])
@pytest.mark.parametrize("name", ["dense-append", "paged-shared-prefix-append",
                                  "batch-idx-mqa-append", "chunked-prefill"])
def test_cuda_matches_the_reference_and_appends_in_place(cuda, rng, name, dtype):
    from test_kvcache import assert_matches_reference

    args = cases.make(name, rng, dtype)
    t = to_torch(args, cuda)
    out, lse = cases.call(f, t, return_lse=True)
    assert out.device == t["q"].device and out.dtype == t["q"].dtype
    ref_k, ref_v = assert_matches_reference(
        args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], host(out), host(lse),
        cache_seqlens=args["cache_seqlens"], cache_batch_idx=args["cache_batch_idx"],
        block_table=args["block_table"], softmax_scale=args["softmax_scale"], causal=args["causal"])
    assert np.array_equal(host(t["k_cache"]).astype(np.float64), ref_k)  # the caller's tensors
    assert np.array_equal(host(t["v_cache"]).astype(np.float64), ref_v)


@pytest.mark.gpu
def test_cuda_torch_compile_keeps_the_append(cuda, rng):
    args = cases.make("paged-shared-prefix-append", rng, "float16")
    t = to_torch(args, cuda)
    eager = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in t.items()}
    want = cases.call(f, eager)
    compiled = torch.compile(lambda *a: f(*a[:5], cache_seqlens=a[5], block_table=a[6], causal=True),
                             backend="aot_eager", fullgraph=True)
    got = compiled(*(t[n] for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens",
                                    "block_table")))
    torch.testing.assert_close(got, want)
    assert torch.equal(t["k_cache"], eager["k_cache"]) and torch.equal(t["v_cache"], eager["v_cache"])


def test_core_function_on_tensors_is_the_same(rng):
    """cupyflash.flash_attn_with_kvcache on tensors (the interop path) gives the same."""
    args = cases.make("batch-idx-mqa-append", rng)
    a, b = to_torch(args), to_torch(args)
    assert torch.equal(cases.call(f, a), cases.call(cupyflash.flash_attn_with_kvcache, b))
    assert torch.equal(a["k_cache"], b["k_cache"])


# Before: a numpy q or cache raised AttributeError ('numpy.ndarray' object has no
# attribute 'dim'), window_size=None a bare TypeError from tuple().
@pytest.mark.parametrize("arg,value,error,text", [
    ("q", "numpy", TypeError, r"q must be a torch\.Tensor; got numpy\.ndarray\.$"),
    ("k_cache", "numpy", TypeError, r"k_cache must be a torch\.Tensor; got numpy\.ndarray\.$"),
    ("k", "numpy", TypeError, r"k must be None or a torch\.Tensor; got numpy\.ndarray\.$"),
    ("window_size", None, TypeError, r"window_size must be a pair of ints"),
    ("window_size", 5, TypeError, r"window_size must be a pair of ints"),
])
def test_non_tensors_and_malformed_options_are_named(rng, arg, value, error, text):
    q, k_cache, v_cache = (torch.randn(2, 1, 4, 16), torch.randn(2, 8, 2, 16),
                           torch.randn(2, 8, 2, 16))
    k, v = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=3)
    args[arg] = args[arg].numpy() if value == "numpy" else value
    with pytest.raises(error, match=r"^cupyflash\.torch\.flash_attn_with_kvcache: " + text):
        cft.flash_attn_with_kvcache(**args)


# ----------------------------------------------------------------------------
# attn_bias and attn_mask (issue 14): passed through to the core
# ----------------------------------------------------------------------------


def _scores(rng, args, bias_dtype="float32"):
    """A bias over the cache's key positions (per head and row, broadcast over the batch)
    and a padding mask (per sequence and key), as NumPy arrays."""
    batch, seqlen_q, nheads, _ = args["q"].shape
    table = args["block_table"]
    capacity = args["k_cache"].shape[1] * (1 if table is None else table.shape[1])
    bias = testing.random_normal(rng, (nheads, seqlen_q, capacity), bias_dtype)
    return {"attn_bias": bias, "attn_mask": rng.random((batch, 1, 1, capacity)) < 0.8}


@pytest.mark.parametrize("name", ["dense-append", "paged-shared-prefix-append", "batch-idx-mqa-append"])
def test_bias_and_mask_match_the_core(rng, name):
    args = cases.make(name, rng)
    scores = _scores(rng, args)
    k_cache, v_cache = args["k_cache"].copy(), args["v_cache"].copy()
    out, lse = cases.call(cupyflash.flash_attn_with_kvcache, dict(args, k_cache=k_cache, v_cache=v_cache),
                          return_lse=True, **scores)
    t = to_torch(args)
    got_out, got_lse = cases.call(f, t, return_lse=True, **to_torch(scores))
    assert np.array_equal(host(got_out), out) and np.array_equal(host(got_lse), lse)
    assert np.array_equal(host(t["k_cache"]), k_cache)


def test_torch_compile_fullgraph_with_bias_and_mask(rng):
    args = cases.make("paged-shared-prefix-append", rng)
    scores = to_torch(_scores(rng, args))
    t = to_torch(args)
    eager = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in t.items()}
    want = cases.call(f, eager, return_lse=True, **scores)

    def step(q, k_cache, v_cache, k, v, lengths, table, bias, mask):
        return f(q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table, causal=True,
                 return_lse=True, attn_bias=bias, attn_mask=mask)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(*(t[n] for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table")),
                   scores["attn_bias"], scores["attn_mask"])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(t["k_cache"], eager["k_cache"])


def test_opcheck_with_bias_and_mask(rng):
    args = cases.make("paged-shared-prefix-append", rng)
    scores = to_torch(_scores(rng, args))
    t = to_torch(args)
    torch.library.opcheck(
        torch.ops.cupyflash.flash_attn_with_kvcache.default,
        (t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], t["cache_seqlens"], None, None,
         t["block_table"], 0.25, True, 0, scores["attn_bias"], scores["attn_mask"]),
        test_utils=("test_schema", "test_faketensor"))


def test_bias_and_mask_must_be_tensors(rng):
    t = to_torch(cases.make("dense-append", rng))
    for name in ("attn_bias", "attn_mask"):
        with pytest.raises(TypeError, match="^" + re.escape(
                f"cupyflash.torch.{FN}: {name} must be None or a torch.Tensor; got numpy.ndarray.") + "$"):
            cases.call(f, t, **{name: np.zeros((64,), np.float32 if name == "attn_bias" else bool)})
    message = (f"cupyflash.{FN}: attn_bias must have a last dimension (the key position in a sequence) of 1 or "
               f"at least the cache's capacity (64 keys per sequence)")
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        cases.call(f, t, attn_bias=torch.zeros(63))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", _BF16])
@pytest.mark.parametrize("name", ["dense-append", "paged-shared-prefix-append"])
def test_cuda_bias_and_mask_match_the_cpu_path(cuda, rng, name, dtype):
    """The decode kernel with a bias (q's dtype and float32) and a mask, against the CPU
    path on float32 copies (test_gpu_decode's tolerance)."""
    from test_gpu_decode import _assert_close_variant

    args = cases.make(name, rng, dtype)
    for bias_dtype in (dtype, "float32"):
        scores = _scores(rng, args, bias_dtype)
        t = to_torch(args, cuda)
        out, lse = cases.call(f, t, return_lse=True, **to_torch(scores, cuda))
        f32 = {n: (x.astype(np.float32) if isinstance(x, np.ndarray) and x.dtype != np.int32 else x)
               for n, x in args.items()}
        host_scores = {"attn_bias": scores["attn_bias"].astype(np.float32), "attn_mask": scores["attn_mask"]}
        want_out, want_lse = cases.call(cupyflash.flash_attn_with_kvcache, f32, return_lse=True, **host_scores)
        _assert_close_variant("out", host(out).astype(np.float32), want_out, dtype)
        _assert_close_variant("lse", host(lse), want_lse, dtype)
