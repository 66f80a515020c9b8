"""The hot path: a call is validated and planned once per call signature, and
preallocated outputs are validated like every other argument (no GPU needed)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cupyflash
from cupyflash import _api, _checks
from fakes import FakeCupyArray, install_fake_gpu


def _qkv(rng, dtype=np.float32, seqlen_q=12, seqlen_k=20):
    q = rng.standard_normal((2, seqlen_q, 4, 16)).astype(dtype)
    k = rng.standard_normal((2, seqlen_k, 2, 16)).astype(dtype)
    v = rng.standard_normal((2, seqlen_k, 2, 16)).astype(dtype)
    return q, k, v


@pytest.fixture
def counted(monkeypatch):
    """Counts the validations (check_qkv) and plans (_api._plan_fwd/_plan_bwd) made."""
    counts = {"check_qkv": 0, "plan_fwd": 0, "plan_bwd": 0}
    for module, name, key in ((_checks, "check_qkv", "check_qkv"), (_api, "_plan_fwd", "plan_fwd"),
                              (_api, "_plan_bwd", "plan_bwd")):
        real = getattr(module, name)

        def wrapper(*args, _real=real, _key=key, **kwargs):
            counts[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
    return counts


def test_a_repeated_signature_is_validated_and_planned_once(counted, rng):
    q, k, v = _qkv(rng)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    for _ in range(3):
        q2, k2, v2 = _qkv(rng)  # new arrays, same signature
        cupyflash.flash_attn_fwd(q2, k2, v2, causal=True)
    assert counted == {"check_qkv": 1, "plan_fwd": 1, "plan_bwd": 0}
    for _ in range(3):
        cupyflash.flash_attn_bwd(out, q, k, v, out, lse, causal=True)
    assert counted == {"check_qkv": 2, "plan_fwd": 1, "plan_bwd": 1}


@pytest.mark.parametrize("change", ["shape", "strides", "dtype", "causal", "causal type", "scale",
                                    "scale type", "out"])
def test_each_part_of_the_signature_makes_a_new_plan(counted, rng, change):
    q, k, v = _qkv(rng)
    kwargs = dict(causal=False, softmax_scale=0.25)
    cupyflash.flash_attn_fwd(q, k, v, **kwargs)
    if change == "shape":
        q = q[:, :7]
    elif change == "strides":
        q = np.asfortranarray(q).copy(order="K")[:, :, :, :]  # same shape and dtype, other strides
        q = np.lib.stride_tricks.as_strided(np.repeat(q, 2, axis=1), q.shape,
                                            (q.strides[0] * 2, q.strides[1] * 2, q.strides[2], 4))
    elif change == "dtype":
        q, k, v = (x.astype(np.float64) for x in (q, k, v))
    elif change == "causal":
        kwargs["causal"] = True
    elif change == "causal type":
        kwargs["causal"] = np.bool_(False)
    elif change == "scale":
        kwargs["softmax_scale"] = 0.5
    elif change == "scale type":
        kwargs["softmax_scale"] = np.float32(0.25)
    else:
        kwargs["out"] = np.empty_like(q)
    cupyflash.flash_attn_fwd(q, k, v, **kwargs)
    assert counted["plan_fwd"] == 2


def test_a_cached_signature_still_rejects_what_it_did_not_see(counted, rng):
    q, k, v = _qkv(rng)
    cupyflash.flash_attn_fwd(q, k, v, causal=True)
    with pytest.raises(TypeError, match=r"causal must be a bool; got int"):
        cupyflash.flash_attn_fwd(q, k, v, causal=1)  # hashes like True
    with pytest.raises(TypeError, match=r"softmax_scale must be a real number or None; got bool"):
        cupyflash.flash_attn_fwd(q, k, v, causal=True, softmax_scale=True)
    with pytest.raises(TypeError, match=r"must not be a numpy\.ma\.MaskedArray"):
        cupyflash.flash_attn_fwd(np.ma.masked_array(q), k, v, causal=True)


def test_an_unhashable_argument_is_validated_not_cached(counted, rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=r"dtype must be None or a dtype name"):
        cupyflash.flash_attn_fwd(q, k, v, dtype=["bfloat16"])
    assert counted["check_qkv"] == 1


def test_fake_gpu_plans_once_per_signature(monkeypatch, rng):
    plans, runs = install_fake_gpu(monkeypatch)
    q, k, v = (FakeCupyArray(x) for x in _qkv(rng, np.float16))
    for _ in range(4):
        cupyflash.flash_attn_fwd(q, k, v, causal=True)
    assert len(plans) == 1 and len(runs) == 4
    cupyflash.flash_attn_fwd(q, k, v, causal=True, out=FakeCupyArray(np.empty_like(q.host)))
    assert len(plans) == 2


def test_fake_gpu_device_and_alignment_are_part_of_the_signature(monkeypatch, rng):
    plans, _ = install_fake_gpu(monkeypatch)
    hosts = _qkv(rng, np.float16)
    q, k, v = (FakeCupyArray(x) for x in hosts)
    cupyflash.flash_attn_fwd(q, k, v)
    q.data.ptr += 2  # now not 16-byte aligned: the kernels' vector loads are off
    cupyflash.flash_attn_fwd(q, k, v)
    assert len(plans) == 2


# ----------------------------------------------------------------------------
# Preallocated outputs
# ----------------------------------------------------------------------------


def test_cpu_out_and_lse_are_written_and_returned(rng):
    q, k, v = _qkv(rng)
    want_out, want_lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    out, lse = np.full_like(want_out, np.nan), np.full_like(want_lse, np.nan)
    got_out, got_lse = cupyflash.flash_attn_fwd(q, k, v, causal=True, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)


def test_cpu_gradients_are_written_into_strided_outputs(rng):
    q, k, v = _qkv(rng)
    out, lse = cupyflash.flash_attn_fwd(q, k, v)
    want = cupyflash.flash_attn_bwd(out, q, k, v, out, lse)
    big = np.full((2, 12, 8, 16), np.nan, np.float32)
    dq = big[:, :, ::2]  # every other head: a strided view
    dk, dv = np.full_like(k, np.nan), np.full_like(v, np.nan)
    got = cupyflash.flash_attn_bwd(out, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert np.isnan(big[:, :, 1::2]).all()  # the other heads untouched


@pytest.mark.parametrize("name, bad, exc, text", [
    ("out", lambda q, lse: np.empty((2, 12, 4, 8), np.float32), ValueError,
     r"out must have the same shape as q \(2, 12, 4, 16\); got \(2, 12, 4, 8\)\."),
    ("out", lambda q, lse: np.empty_like(q, np.float64), TypeError,
     r"out must have the same dtype as q \(float32\); got float64\."),
    ("out", lambda q, lse: np.empty((2, 12, 4, 32), np.float32)[..., ::2], ValueError,
     r"out must have unit stride in its last dimension \(head_dim\); got a stride of 2 elements\."),
    ("out", lambda q, lse: [0.0], TypeError, r"out must be a numpy\.ndarray or cupy\.ndarray; got list\."),
    ("lse", lambda q, lse: np.empty((2, 12, 4), np.float32), ValueError,
     r"lse must have shape \(batch, nheads_q, seqlen_q\) = \(2, 4, 12\); got \(2, 12, 4\)\."),
    ("lse", lambda q, lse: np.empty_like(lse, np.float16), TypeError,
     r"lse must have dtype float32; got float16\."),
])
def test_bad_forward_outputs_are_rejected(rng, name, bad, exc, text):
    q, k, v = _qkv(rng)
    lse = np.empty((2, 4, 12), np.float32)
    with pytest.raises(exc, match=rf"^cupyflash\.flash_attn_fwd: {text}$"):
        cupyflash.flash_attn_fwd(q, k, v, **{name: bad(q, lse)})


@pytest.mark.parametrize("name", ["dq", "dk", "dv"])
def test_bad_gradient_outputs_are_rejected(monkeypatch, rng, name):
    q, k, v = _qkv(rng)
    out, lse = cupyflash.flash_attn_fwd(q, k, v)
    like = {"dq": q, "dk": k, "dv": v}[name]
    shape = re.escape(str(tuple(like.shape)))
    like_name = {"dq": "q", "dk": "k", "dv": "v"}[name]
    with pytest.raises(ValueError, match=rf"^cupyflash\.flash_attn_bwd: {name} must have the same shape as "
                                         rf"{like_name} {shape}; got \(1, 1, 1, 16\)\.$"):
        cupyflash.flash_attn_bwd(out, q, k, v, out, lse, **{name: np.empty((1, 1, 1, 16), np.float32)})
    install_fake_gpu(monkeypatch)
    with pytest.raises(TypeError, match=rf"^cupyflash\.flash_attn_bwd: {name} must be a numpy\.ndarray like q "
                                        r"\(numpy and cupy inputs cannot be mixed\); got cupy\.ndarray\.$"):
        cupyflash.flash_attn_bwd(out, q, k, v, out, lse, **{name: FakeCupyArray(np.empty_like(like))})


def test_cupy_output_on_another_device_is_rejected(monkeypatch, rng):
    install_fake_gpu(monkeypatch)
    q, k, v = (FakeCupyArray(x) for x in _qkv(rng, np.float16))
    out = FakeCupyArray(np.empty_like(q.host), device_id=1)
    with pytest.raises(ValueError, match=r"^cupyflash\.flash_attn_fwd: out must be on the same device as q "
                                         r"\(cuda:0\); got cuda:1\.$"):
        cupyflash.flash_attn_fwd(q, k, v, out=out)


# ----------------------------------------------------------------------------
# flash-attention's variant options
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("fn_name", ["flash_attn_fwd", "flash_attn", "flash_attn_bwd"])
@pytest.mark.parametrize("option, value, want", [
    ("dropout_p", 0.1, {"dropout_p": 0.1, "rng_state": (1, 0)}), ("window_size", (128, 0), {"window_size": (128, 0)}),
    ("alibi_slopes", "slopes", None), ("softcap", 30.0, {"softcap": 30.0}), ("sinks", "sinks", None)])
def test_variants_on_gpu_arrays_go_to_the_gpu_variant_path(monkeypatch, rng, fn_name, option, value, want):
    """On GPU arrays, after their checks, the options that are on reach the GPU
    variant entry (``_gpu.variant_fwd`` / ``_gpu_bwd.variant_bwd``) as the CPU path
    would take them (issue 13)."""
    from fakes import FakeCupyArray, install_fake_gpu

    install_fake_gpu(monkeypatch)
    q, k, v = (FakeCupyArray(x.astype(np.float16)) for x in _qkv(rng))
    if value in ("slopes", "sinks"):
        value = FakeCupyArray(np.ones(q.shape[2], np.float32))
        want = {option: value}
    extra = {"rng_state": (1, 0)} if option == "dropout_p" else {}
    seen = {}

    def record(*args, **kwargs):
        seen.update(kwargs)
        return "sentinel", "lse"

    cupyflash._gpu.variant_fwd = record  # the fake modules install_fake_gpu put in place
    cupyflash._gpu_bwd.variant_bwd = record
    args = (q, k, v)
    if fn_name == "flash_attn_bwd":
        lse = FakeCupyArray(np.zeros((q.shape[0], q.shape[2], q.shape[1]), np.float32))
        args = (q, q, k, v, q, lse)
    result = getattr(cupyflash, fn_name)(*args, **{option: value}, **extra)
    assert seen["options"] == want
    assert seen["causal"] is False and seen["dtype_name"] == "float16"
    assert seen["softmax_scale"] == pytest.approx(q.shape[3] ** -0.5)
    assert result[0] == "sentinel" if fn_name != "flash_attn" else result == "sentinel"


@pytest.mark.parametrize("option, value", [("dropout_p", 0.1), ("window_size", (3, 0)), ("softcap", 5.0),
                                           ("alibi_slopes", "slopes"), ("sinks", "sinks")])
def test_variants_run_on_the_cpu_path(rng, option, value):
    """Through the public functions: cupyflash.cpu with the option, forward and backward."""
    from cupyflash import cpu

    q, k, v = _qkv(rng)
    if value in ("slopes", "sinks"):
        value = rng.standard_normal(q.shape[2]).astype(np.float32) ** 2
    options = {option: value, **({"rng_state": (7, 2)} if option == "dropout_p" else {})}
    out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True, **options)
    want_out, want_lse = cpu.fwd(q, k, v, q.shape[3] ** -0.5, True, **options)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    np.testing.assert_array_equal(cupyflash.flash_attn(q, k, v, causal=True, **options), want_out)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    grads = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, **options)
    want = cpu.bwd(dout, q, k, v, out, lse, q.shape[3] ** -0.5, True, **options)
    assert len(grads) == len(want) == (4 if option == "sinks" else 3)
    for got, expect in zip(grads, want):
        np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("option, value, cls, message", [
    ("alibi_slopes", np.ones(3, np.float32), ValueError, "alibi_slopes must have shape (4,) or (2, 4)"),
    ("alibi_slopes", np.ones(4, np.float64), TypeError, "alibi_slopes must have dtype float32"),
    ("sinks", np.ones((2, 4), np.float32), ValueError, "sinks must have shape (4,)"),
    ("rng_state", (1, 2**32), ValueError, "rng_state's offset must be in [0, 2**32)"),
    ("rng_state", 5, TypeError, "rng_state must be None or a pair of ints"),
    ("return_rng_state", 1, TypeError, "return_rng_state must be a bool; got int."),
])
def test_variant_arguments_are_checked(rng, option, value, cls, message):
    q, k, v = _qkv(rng)  # (2, seqlen, 4, d)
    assert q.shape[0] == 2 and q.shape[2] == 4
    with pytest.raises(cls, match=re.escape(f"cupyflash.flash_attn_fwd: {message}")):
        cupyflash.flash_attn_fwd(q, k, v, **{option: value})


@pytest.mark.parametrize("option, value", [("dropout_p", 0.0), ("window_size", [-1, -1]),
                                           ("alibi_slopes", None), ("softcap", 0)])
def test_flash_attention_options_off_are_taken(rng, option, value):
    q, k, v = _qkv(rng)
    out = cupyflash.flash_attn(q, k, v, **{option: value})
    np.testing.assert_array_equal(out, cupyflash.flash_attn(q, k, v))


def test_varlen_options_run_on_the_cpu_path(rng):
    """The varlen functions take the variants (tests/test_varlen_variants.py has more)."""
    q = rng.standard_normal((7, 2, 8)).astype(np.float32)
    cu = np.array([0, 3, 7], np.int32)
    out = cupyflash.flash_attn_varlen(q, q, q, cu, cu, 4, 4, window_size=(2, 2))
    assert out.shape == q.shape


@pytest.mark.parametrize("option, value, cls, message", [
    ("softcap", 3e38, ValueError, "softcap must be 0 (off) or in [1e-30, 1e+30]"),
    ("softcap", 1e-300, ValueError, "softcap must be 0 (off) or in [1e-30, 1e+30]"),
    ("softcap", True, TypeError, "softcap must be a float >= 0"),
    ("window_size", (2**63, 0), ValueError, "window_size's left entry must be in [-1, 2**31 - 1]"),
    ("window_size", {1: 2, 3: 4}, TypeError, "window_size must be a pair of ints"),
    ("sinks", np.array([np.nan, 0, 0, 0], np.float32), ValueError, "sinks must be finite or -inf"),
    ("alibi_slopes", np.array([np.inf, 0, 0, 0], np.float32), ValueError, "alibi_slopes must be finite"),
])
def test_variant_values_that_would_give_nan_are_refused(rng, option, value, cls, message):
    q, k, v = _qkv(rng)
    with pytest.raises(cls, match=re.escape(f"cupyflash.flash_attn_fwd: {message}")):
        cupyflash.flash_attn_fwd(q, k, v, **{option: value})


def test_a_minus_inf_sink_is_no_sink(rng):
    q, k, v = _qkv(rng)
    out, lse = cupyflash.flash_attn_fwd(q, k, v, sinks=np.full(4, -np.inf, np.float32))
    want_out, want_lse = cupyflash.flash_attn_fwd(q, k, v)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)


def test_clear_plans_empties_every_plan_cache():
    """_gpu.clear_plans (a dispatch switch changed) empties the entry points' caches too:
    a per-signature entry kept would go on running the old plan (session 10: a bench A/B
    of FWD_WS timed the same kernel twice)."""
    from cupyflash import _gpu, _kvcache, _launch  # noqa: PLC0415 (_torch_path's need torch)

    caches = (_api._FWD_ENTRIES, _api._BWD_ENTRIES, _kvcache._ENTRIES, _gpu.PLANS)
    assert all(any(c is listed for listed in _launch.PLAN_CACHES) for c in caches)
    for i, cache in enumerate(caches):
        cache.put(("test", i), object())
    _gpu.clear_plans()
    assert not any(len(c) for c in _launch.PLAN_CACHES)
