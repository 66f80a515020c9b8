"""cupyflash.jax.flash_attn_with_kvcache on JAX's CPU backend (and, marked gpu, on a GPU).

The append is functional: the updated caches are returned and the inputs are
untouched (in place under ``jax.jit`` with the caches donated).  On the CPU the
results must be the NumPy core's bits, eagerly and under ``jax.jit``, and the
core's results are checked against the float64 reference (tests/kvcache_cases.py).
Bad input gives the core's exceptions and messages: at trace time for shapes,
dtypes and flags, and for the values of concrete arrays; under ``jax.jit``,
values are checked when the computation runs.  Skipped without jax (or with a
JAX older than 0.7, which has no buffer_callback).
"""

from __future__ import annotations

import importlib.util
import os
import re

# Before JAX starts: leave GPU memory to CuPy (XLA preallocates 75% by default).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
cfj = pytest.importorskip("cupyflash.jax")
if cfj._buffer_callback is None:
    pytest.skip(f"jax {jax.__version__} has no buffer_callback", allow_module_level=True)

import kvcache_cases as cases  # noqa: E402
from test_kvcache import BAD, FN, _call, _valid  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _interop, testing  # noqa: E402

jnp = jax.numpy
f = cfj.flash_attn_with_kvcache
_HAS_BF16 = importlib.util.find_spec("ml_dtypes") is not None


def x64(on=True):
    """JAX's 64-bit mode for a block (float64 / int64 arrays stay what they are)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # older JAX
        from jax.experimental import enable_x64 as enable
    return enable(on)


def to_jax(args):
    return {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in args.items()}


def run_jax(args, jit=False, **extra):
    """The case through cupyflash.jax (eager, or jax.jit over the array arguments)."""
    j = to_jax(args)
    if not jit:
        return cases.call(f, j, **extra)
    names = [n for n in cases.ARRAYS if isinstance(j.get(n), jax.Array)]
    static = {n: x for n, x in j.items() if n not in names}

    def fn(*arrays):
        return cases.call(f, dict(static, **dict(zip(names, arrays))), **extra)

    return jax.jit(fn)(*(j[n] for n in names))


# ----------------------------------------------------------------------------
# Results: the core's bits, eagerly and under jit, with the append returned
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", cases.NAMES)
def test_matches_the_core(rng, name, jit):
    args = cases.make(name, rng)
    out, lse, k_cache, v_cache = cases.expected(args)
    k_cache0 = jnp.asarray(args["k_cache"])
    got = run_jax(dict(args, k_cache=k_cache0), jit=jit, return_lse=True)
    appends = args["k"] is not None
    assert len(got) == (4 if appends else 2)
    assert all(isinstance(x, jax.Array) for x in got)
    assert got[0].dtype == args["q"].dtype and got[1].dtype == np.float32
    assert np.array_equal(np.asarray(got[0]), out)
    assert np.array_equal(np.asarray(got[1]), lse)
    if appends:
        assert np.array_equal(np.asarray(got[2]), k_cache)
        assert np.array_equal(np.asarray(got[3]), v_cache)
        assert not np.array_equal(k_cache, args["k_cache"])  # something was appended
    assert np.array_equal(np.asarray(k_cache0), args["k_cache"])  # the input is untouched


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not _HAS_BF16, reason="bfloat16 needs ml_dtypes")), "float64"])
def test_dtypes(rng, dtype):
    args = cases.make("paged-shared-prefix-append", rng, dtype)
    out, lse, k_cache, v_cache = cases.expected(args)
    with x64(dtype == "float64"):
        got_out, got_lse, got_k, got_v = run_jax(args, jit=True, return_lse=True)
        assert got_out.dtype == np.dtype(args["q"].dtype)
        for got, want in ((got_out, out), (got_lse, lse), (got_k, k_cache), (got_v, v_cache)):
            assert np.array_equal(np.asarray(got), want)


def test_return_structure(rng):
    args = cases.make("dense-append", rng)
    no_append = dict(args, k=None, v=None)
    out = run_jax(no_append)
    assert isinstance(out, jax.Array) and out.shape == args["q"].shape
    out_lse = run_jax(no_append, return_lse=True)
    assert isinstance(out_lse, tuple) and len(out_lse) == 2 and out_lse[1].shape == (3, 4, 1)
    out_caches = run_jax(args)
    assert len(out_caches) == 3 and out_caches[1].shape == args["k_cache"].shape
    assert len(run_jax(args, return_lse=True)) == 4
    # flash-attention's order with lse: out, lse, then the caches
    both = run_jax(args, return_lse=True)
    assert np.array_equal(np.asarray(both[0]), np.asarray(out_caches[0]))
    assert np.array_equal(np.asarray(both[2]), np.asarray(out_caches[1]))


def test_decode_loop_under_jit_with_donated_caches(rng):
    """A prefill then several decode steps, the caches donated to a jitted step and
    cache_seqlens advanced by the caller: the same as the NumPy core in place."""
    batch, page_size, nheads, nheads_kv, head_dim = 3, 16, 4, 2, 16
    table = np.int32(rng.permutation(12).reshape(batch, 4))
    k_cache = cases.testing.random_normal(rng, (12, page_size, nheads_kv, head_dim), "float32")
    v_cache = cases.testing.random_normal(rng, (12, page_size, nheads_kv, head_dim), "float32")
    lengths = np.int32([0, 5, 20])
    step = jax.jit(lambda q, kc, vc, k, v, lens, table: f(q, kc, vc, k, v, cache_seqlens=lens,
                                                          block_table=table, causal=True),
                   donate_argnums=(1, 2))
    jk, jv, jtable = jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(table)
    for seqlen_new in (7, 1, 1, 1, 1):
        q = cases.testing.random_normal(rng, (batch, seqlen_new, nheads, head_dim), "float32")
        k, v = (cases.testing.random_normal(rng, (batch, seqlen_new, nheads_kv, head_dim), "float32")
                for _ in range(2))
        want = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                                 block_table=table, causal=True)
        out, jk, jv = step(jnp.asarray(q), jk, jv, jnp.asarray(k), jnp.asarray(v),
                           jnp.asarray(lengths), jtable)
        assert np.array_equal(np.asarray(out), want)
        lengths = lengths + np.int32(seqlen_new)
    assert np.array_equal(np.asarray(jk), k_cache) and np.array_equal(np.asarray(jv), v_cache)


def test_vmap_is_one_call_per_element(rng):
    groups = [cases.make("dense-append", rng) for _ in range(2)]
    stacked = {n: jnp.stack([jnp.asarray(g[n]) for g in groups])
               for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens")}
    out, k_cache, _ = jax.vmap(lambda q, kc, vc, k, v, lens: f(
        q, kc, vc, k, v, cache_seqlens=lens, causal=True))(*stacked.values())
    for i, g in enumerate(groups):
        want, _, want_k, _ = cases.expected(g)
        assert np.array_equal(np.asarray(out[i]), want)
        assert np.array_equal(np.asarray(k_cache[i]), want_k)


def test_empty_query_still_appends(rng):
    args = cases.make("dense-append", rng)
    args["q"] = args["q"][:, :0]
    out, lse, k_cache, v_cache = cases.expected(args)
    got = run_jax(args, jit=True, return_lse=True)
    assert got[0].shape == (3, 0, 4, 16) and got[1].shape == (3, 4, 0)
    assert np.array_equal(np.asarray(got[2]), k_cache)


def test_empty_batch(rng):
    args = cases.make("dense-append", rng)
    args = {n: (x[:0] if isinstance(x, np.ndarray) else x) for n, x in args.items()}
    out, k_cache, _ = run_jax(args, jit=True)
    assert out.shape == (0, 1, 4, 16) and k_cache.shape == (0, 64, 2, 16)


def test_not_differentiable(rng):
    j = to_jax(cases.make("dense-append", rng))
    message = (f"cupyflash.jax.{FN} is not differentiable (an inference function with no "
               "backward, like flash-attention's)")
    with pytest.raises(NotImplementedError, match="^" + re.escape(message)):
        jax.grad(lambda q: f(q, j["k_cache"], j["v_cache"], j["k"], j["v"],
                             cache_seqlens=j["cache_seqlens"])[0].sum())(j["q"])
    # nothing differentiated through it: fine
    grad = jax.grad(lambda x: f(j["q"], j["k_cache"], j["v_cache"], j["k"], j["v"],
                                cache_seqlens=j["cache_seqlens"])[0].sum() + x)(1.0)
    assert float(grad) == 1.0


def test_numpy_arrays_are_taken(rng):
    args = cases.make("batch-idx-mqa-append", rng)
    out, _, k_cache, _ = cases.expected(args)
    got_out, got_k, _ = cases.call(f, args)
    assert isinstance(got_out, jax.Array)
    assert np.array_equal(np.asarray(got_out), out) and np.array_equal(np.asarray(got_k), k_cache)


# ----------------------------------------------------------------------------
# Bad input: the core's rules and messages
# ----------------------------------------------------------------------------

#: Cases of test_kvcache.BAD with no JAX counterpart: strided views (JAX arrays are
#: dense), read-only and overlapping NumPy arrays, and non-arrays (JAX's own message).
_NUMPY_ONLY = {"q-list", "batch_idx-numpy-only", "k_cache-stride", "table-stride", "read-only",
               "caches-overlap"}
#: Cases whose error depends on the values of an index array: under jax.jit they are
#: found when the computation runs.
_VALUES = {"seqlens-negative", "seqlens-capacity", "batch_idx-range", "batch_idx-negative",
           "batch_idx-repeat-append", "table-narrow", "table-range", "table-negative",
           "table-shared-append"}
_JAX_BAD = [case for case in BAD if case[0] not in _NUMPY_ONLY]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", _JAX_BAD, ids=[c[0] for c in _JAX_BAD])
def test_bad_input(case, jit):
    name, cls, message, mutate = case
    full = f"cupyflash.{FN}: {message}"
    with x64():
        args = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x
                for n, x in mutate(_valid()).items()}
        if not jit or name not in _VALUES:
            # (under jit, JAX may add a line about its filtered traceback)
            with pytest.raises(cls, match="^" + re.escape(full) + r"($|\n)"):
                _jitted(args, jit)
            return
        with pytest.raises(RuntimeError, match=re.escape(full)):  # jax.errors.JaxRuntimeError
            jax.block_until_ready(_jitted(args, jit))


def _jitted(args, jit):
    args = dict(args)
    if not jit:
        return _call_jax(args)
    names = [n for n, x in args.items() if isinstance(x, jax.Array)]
    static = {n: x for n, x in args.items() if n not in names}
    return jax.jit(lambda *a: _call_jax(dict(static, **dict(zip(names, a)))))(
        *(args[n] for n in names))


def _call_jax(args):
    args = dict(args)
    return f(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("k"), args.pop("v"),
             **args)


def test_valid_arguments_pass():
    for args in (_valid(),):
        _jitted(to_jax(args), jit=True)
        _call(args)


def test_not_arrays_are_refused():
    j = to_jax(_valid())
    with pytest.raises(TypeError, match=re.escape(f"cupyflash.{FN}: q must be a jax.Array; got list.")):
        f([1.0], j["k_cache"], j["v_cache"])
    with pytest.raises(TypeError, match=re.escape(
            f"cupyflash.{FN}: cache_batch_idx must be a jax.Array; got list.")):
        f(j["q"], j["k_cache"], j["v_cache"], cache_seqlens=j["cache_seqlens"],
          cache_batch_idx=[0, 1])


def test_index_dtype_is_checked_under_jit():
    j = to_jax(_valid())
    with pytest.raises(TypeError, match=re.escape(
            f"cupyflash.{FN}: block_table must have dtype int32; got int16.")):
        jax.jit(lambda q, kc, vc, t: f(q, kc, vc, cache_seqlens=5, block_table=t))(
            j["q"], j["k_cache"], j["v_cache"], jnp.zeros((2, 2), jnp.int16))


def test_gpu_checks_shapes_and_dtype_not_values(monkeypatch):
    """Traced for a GPU: fp16/bf16 only, and no device value is read (as for CuPy)."""
    monkeypatch.setattr(cfj, "_platform", lambda q: "gpu")
    j = to_jax(_valid())
    with pytest.raises(TypeError, match=re.escape(
            f"cupyflash.{FN}: q must have dtype float16 or bfloat16 on the GPU; got float32.")):
        jax.eval_shape(lambda: f(j["q"], j["k_cache"], j["v_cache"], j["k"], j["v"],
                                 cache_seqlens=j["cache_seqlens"]))
    h = {n: x.astype(jnp.float16) if x.dtype == jnp.float32 else x for n, x in j.items()}
    bad_lengths = jnp.asarray(np.int32([-3, 99]))  # would fail on the CPU
    shapes = jax.eval_shape(lambda: f(h["q"], h["k_cache"], h["v_cache"], h["k"], h["v"],
                                      cache_seqlens=bad_lengths))
    assert [s.shape for s in shapes] == [(2, 3, 4, 16), (2, 32, 2, 16), (2, 32, 2, 16)]
    with pytest.raises(ValueError, match=re.escape("k must have the same nheads as k_cache (2); got 1.")):
        jax.eval_shape(lambda: f(h["q"], h["k_cache"], h["v_cache"], h["k"][:, :, :1],
                                 h["v"][:, :, :1], cache_seqlens=bad_lengths))


# ----------------------------------------------------------------------------
# The GPU callback, driven with fake buffers (no GPU)
# ----------------------------------------------------------------------------


class _FakeBuffer:
    """A buffer_callback Buffer on CUDA device 0."""

    def __init__(self, name, shape):
        self.name, self.shape = name, shape

    def __dlpack_device__(self):
        return _interop.DL_CUDA, 0


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_gpu_callback_appends_into_the_aliased_outputs(monkeypatch, dtype_name):
    """The core gets CuPy views of the cache *outputs* (aliased to the inputs), the
    element type, XLA's stream, and its out/lse are copied into XLA's buffers."""
    from cupyflash import _kvcache

    calls, copies = [], []

    class View:
        def __init__(self, buffer, dtype):
            self.buffer, self.dtype = buffer, np.dtype(dtype)

        def __setitem__(self, key, value):
            copies.append((self.buffer.name, self.dtype.name, value))

    def core(*args, **kwargs):
        calls.append((args, kwargs))
        return "OUT", "LSE"

    streams = []
    monkeypatch.setattr(_interop, "_import_cupy", lambda *a: "cupy")
    monkeypatch.setattr(cfj, "_cuda_device", lambda device_id: _nullcontext())
    monkeypatch.setattr(_interop, "use_stream", lambda cupy, ptr: streams.append(ptr) or _nullcontext())
    monkeypatch.setattr(cfj, "_cupy_view", lambda cupy, b, dtype, device_id: View(b, dtype))
    monkeypatch.setattr(_kvcache, "flash_attn_with_kvcache", core)
    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table")
    callback = cfj._KVCallback(names, None, 0.25, True, 3, dtype_name)
    inputs = [_FakeBuffer(n, (1,)) for n in names]
    outputs = [_FakeBuffer(n, (1,)) for n in ("out", "lse", "k_cache_out", "v_cache_out")]

    class Ctx:
        stream = 0x5EED

    callback(Ctx, outputs, *inputs)
    ((args, kwargs),) = calls
    storage = "uint16" if dtype_name == "bfloat16" else "float16"
    assert [(v.buffer.name, v.dtype.name) for v in args] == [
        ("q", storage), ("k_cache_out", storage), ("v_cache_out", storage), ("k", storage),
        ("v", storage)]
    assert kwargs["cache_seqlens"].buffer.name == "cache_seqlens"
    assert kwargs["cache_seqlens"].dtype == np.int32
    assert kwargs["block_table"].buffer.name == "block_table" and kwargs["cache_batch_idx"] is None
    assert kwargs["dtype"] == ("bfloat16" if dtype_name == "bfloat16" else None)
    assert (kwargs["softmax_scale"], kwargs["causal"], kwargs["num_splits"],
            kwargs["return_lse"]) == (0.25, True, 3, True)
    assert streams == [0x5EED]
    assert copies == [("out", storage, "OUT"), ("lse", "float32", "LSE")]


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


# ----------------------------------------------------------------------------
# On a GPU
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not _HAS_BF16, reason="bfloat16 needs ml_dtypes"))])
@pytest.mark.parametrize("name", ["paged-shared-prefix-append", "batch-idx-mqa-append"])
def test_gpu_matches_the_reference(rng, name, dtype):
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError as exc:
        pytest.skip(f"jax {jax.__version__} has no GPU backend: {exc}")
    from test_kvcache import assert_matches_reference

    args = cases.make(name, rng, dtype)
    on_gpu = {n: jax.device_put(x, gpu) if isinstance(x, np.ndarray) else x for n, x in args.items()}
    names = [n for n in cases.ARRAYS if isinstance(on_gpu.get(n), jax.Array)]
    static = {n: x for n, x in on_gpu.items() if n not in names}
    step = jax.jit(lambda *a: cases.call(f, dict(static, **dict(zip(names, a))), return_lse=True))
    out, lse, k_cache, v_cache = jax.block_until_ready(step(*(on_gpu[n] for n in names)))
    ref_k, ref_v = assert_matches_reference(
        args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], np.asarray(out),
        np.asarray(lse), cache_seqlens=args["cache_seqlens"],
        cache_batch_idx=args["cache_batch_idx"], block_table=args["block_table"],
        softmax_scale=args["softmax_scale"], causal=args["causal"])
    assert np.array_equal(np.asarray(k_cache).astype(np.float64), ref_k)
    assert np.array_equal(np.asarray(v_cache).astype(np.float64), ref_v)


# ----------------------------------------------------------------------------
# attn_bias and attn_mask (issue 14): passed through to the core
# ----------------------------------------------------------------------------


def _scores(rng, args, bias_dtype="float32"):
    """A bias over the cache's key positions (per head and row) and a padding mask."""
    batch, seqlen_q, nheads, _ = args["q"].shape
    table = args["block_table"]
    capacity = args["k_cache"].shape[1] * (1 if table is None else table.shape[1])
    bias = testing.random_normal(rng, (nheads, seqlen_q, capacity), bias_dtype)
    return {"attn_bias": bias, "attn_mask": rng.random((batch, 1, 1, capacity)) < 0.8}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ["dense-append", "paged-shared-prefix-append", "whole-cache"])
def test_bias_and_mask_match_the_core(rng, name, jit):
    args = cases.make(name, rng)
    scores = _scores(rng, args)
    k_cache, v_cache = args["k_cache"].copy(), args["v_cache"].copy()
    out, lse = cases.call(cupyflash.flash_attn_with_kvcache, dict(args, k_cache=k_cache, v_cache=v_cache),
                          return_lse=True, **scores)
    j = to_jax(scores)
    if jit:
        got = jax.jit(lambda bias, mask: cases.call(f, to_jax(args), return_lse=True, attn_bias=bias,
                                                    attn_mask=mask))(j["attn_bias"], j["attn_mask"])
    else:
        got = cases.call(f, to_jax(args), return_lse=True, **j)
    assert np.array_equal(np.asarray(got[0]), out) and np.array_equal(np.asarray(got[1]), lse)
    if args["k"] is not None:
        assert np.array_equal(np.asarray(got[2]), k_cache)


@pytest.mark.parametrize("gpu", [False, True])
def test_bias_and_mask_are_checked_at_trace_time(monkeypatch, gpu):
    """The core's rules and messages, on the CPU and traced for a GPU."""
    j = to_jax(_valid())
    if gpu:
        monkeypatch.setattr(cfj, "_platform", lambda q: "gpu")
        j = {n: x.astype(jnp.float16) if x.dtype == jnp.float32 else x for n, x in j.items()}
    dtype = "float16" if gpu else "float32"
    run = lambda **scores: jax.eval_shape(lambda: f(j["q"], j["k_cache"], j["v_cache"], j["k"], j["v"],  # noqa: E731
                                                    cache_seqlens=j["cache_seqlens"], **scores))
    with pytest.raises(ValueError, match="^" + re.escape(
            f"cupyflash.{FN}: attn_bias must have a last dimension (the key position in a sequence) of 1 or at "
            f"least the cache's capacity (32 keys per sequence), broadcastable to (batch, nheads_q, seqlen_q, "
            f"key); got shape (4, 3, 31), whose key dimension is 31.")):
        run(attn_bias=jnp.zeros((4, 3, 31), dtype))
    with pytest.raises(TypeError, match="^" + re.escape(
            f"cupyflash.{FN}: attn_mask must have dtype bool (True = attend; a float mask belongs in attn_bias); "
            f"got float32.")):
        run(attn_mask=jnp.zeros((32,), jnp.float32))
    if gpu:
        with x64():
            with pytest.raises(TypeError, match="^" + re.escape(
                    f"cupyflash.{FN}: attn_bias must have q's dtype (float16) or float32; got float64.")):
                run(attn_bias=jnp.zeros((32,), jnp.float64))
    shapes = run(attn_bias=jnp.zeros((2, 1, 3, 40), dtype), attn_mask=jnp.ones((32,), bool))
    assert [s.shape for s in shapes] == [(2, 3, 4, 16), (2, 32, 2, 16), (2, 32, 2, 16)]


@pytest.mark.parametrize("dtype_name,bias_dtype_name,storage", [
    ("float16", "float16", "float16"), ("bfloat16", "bfloat16", "uint16"), ("bfloat16", "float32", "float32")])
def test_gpu_callback_views_the_bias_and_mask(monkeypatch, dtype_name, bias_dtype_name, storage):
    """The bias is viewed in its own dtype (q's storage, or float32), the mask as bool."""
    from cupyflash import _kvcache

    calls = []

    class View:
        def __init__(self, buffer, dtype):
            self.buffer, self.dtype = buffer, np.dtype(dtype)

        def __setitem__(self, key, value):
            pass

    monkeypatch.setattr(_interop, "_import_cupy", lambda *a: "cupy")
    monkeypatch.setattr(cfj, "_cuda_device", lambda device_id: _nullcontext())
    monkeypatch.setattr(_interop, "use_stream", lambda cupy, ptr: _nullcontext())
    monkeypatch.setattr(cfj, "_cupy_view", lambda cupy, b, dtype, device_id: View(b, dtype))
    monkeypatch.setattr(_kvcache, "flash_attn_with_kvcache", lambda *a, **kw: calls.append(kw) or ("O", "L"))
    names = ("q", "k_cache", "v_cache", "attn_bias", "attn_mask")
    callback = cfj._KVCallback(names, 5, 0.25, False, 0, dtype_name, bias_dtype_name)

    class Ctx:
        stream = 0

    callback(Ctx, [_FakeBuffer(n, (1,)) for n in ("out", "lse")], *(_FakeBuffer(n, (1,)) for n in names))
    (kwargs,) = calls
    assert (kwargs["attn_bias"].buffer.name, kwargs["attn_bias"].dtype.name) == ("attn_bias", storage)
    assert (kwargs["attn_mask"].buffer.name, kwargs["attn_mask"].dtype.name) == ("attn_mask", "bool")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not _HAS_BF16, reason="bfloat16 needs ml_dtypes"))])
def test_gpu_bias_and_mask_match_the_cpu_path(rng, dtype):
    """The decode kernel under jax.jit with a bias (q's dtype and float32) and a mask,
    against the CPU path on float32 copies (test_gpu_decode's tolerance)."""
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError as exc:
        pytest.skip(f"jax {jax.__version__} has no GPU backend: {exc}")
    from test_gpu_decode import _assert_close_variant

    args = cases.make("paged-shared-prefix-append", rng, dtype)
    f32 = {n: (x.astype(np.float32) if isinstance(x, np.ndarray) and x.dtype != np.int32 else x)
           for n, x in args.items()}
    for bias_dtype in (dtype, "float32"):
        scores = _scores(rng, args, bias_dtype)
        want_out, want_lse = cases.call(cupyflash.flash_attn_with_kvcache, dict(f32), return_lse=True,
                                        attn_bias=scores["attn_bias"].astype(np.float32),
                                        attn_mask=scores["attn_mask"])
        on_gpu = {n: jax.device_put(x, gpu) if isinstance(x, np.ndarray) else x
                  for n, x in {**args, **scores}.items()}
        names = [n for n in (*cases.ARRAYS, "attn_bias", "attn_mask") if isinstance(on_gpu.get(n), jax.Array)]
        static = {n: x for n, x in on_gpu.items() if n not in names}
        step = jax.jit(lambda *a: cases.call(f, dict(static, **dict(zip(names, a))), return_lse=True))
        out, lse = jax.block_until_ready(step(*(on_gpu[n] for n in names)))[:2]
        _assert_close_variant("out", np.asarray(out).astype(np.float32), want_out, dtype)
        _assert_close_variant("lse", np.asarray(lse), want_lse, dtype)
