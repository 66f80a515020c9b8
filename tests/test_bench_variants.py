"""``bench --suite variants`` without a GPU: the visible-pair count, the bars, failures and
not-implemented kernels as results, the FlexAttention expressions, the JAX window, the table.

The suite runs end to end on ``FakeCupy`` (numpy posing as cupy: the public API runs the CPU
path, which implements every variant); FlexAttention runs on a fake torch whose tensors are
numpy arrays and whose ``flex_attention`` is the dense definition (score_mod, then the mask,
then the softmax), so the suite's score_mods, mask_mods and sinks correction are checked
against the float64 reference; the JAX window runs on the real JAX's CPU backend (XLA).
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
from scipy.special import expit
from test_bench_suites import FakeCupy, OutOfMemoryError

import cupyflash
from cupyflash import _bench_variants as variants
from cupyflash import bench, cli, reference


# ----------------------------------------------------------------------------
# Visible pairs and FLOPs
# ----------------------------------------------------------------------------


SHAPES = [(1, 1), (5, 5), (17, 17), (13, 29), (29, 13), (1, 40), (40, 1), (64, 64)]
WINDOWS = [(-1, -1), (0, 0), (3, 0), (0, 4), (2, 5), (-1, 3), (4, -1), (100, 100), (0, -1), (-1, 0)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_match_the_brute_force_mask(seqlen_q, seqlen_k, causal):
    for window in WINDOWS:
        expected = int(reference.visible_keys(seqlen_q, seqlen_k, causal, window_size=window).sum())
        assert variants.visible_pairs(seqlen_q, seqlen_k, causal, window) == expected, window


def test_visible_pairs_at_the_suite_shapes():
    for s in (4096, 16384):
        assert variants.visible_pairs(s, s) == s * s
        assert variants.visible_pairs(s, s, True) == s * (s + 1) // 2
    # (4096, 0): at 4096 every causal pair is in the window; at 16384 row i sees min(i, 4096) + 1 keys
    assert variants.visible_pairs(4096, 4096, True, (4096, 0)) == 4096 * 4097 // 2
    assert variants.visible_pairs(16384, 16384, True, (4096, 0)) == sum(min(i, 4096) + 1 for i in range(16384))
    assert variants.visible_pairs(16384, 16384, False, (4096, 0)) == variants.visible_pairs(16384, 16384, True,
                                                                                             (4096, 0))
    assert variants.visible_pairs(0, 5) == variants.visible_pairs(5, 0, True) == 0


def test_flops_and_tflops():
    assert variants.variant_flops(2, 16, 128, 1000) == 4.0 * 2 * 16 * 128 * 1000
    assert variants.variant_flops(2, 16, 128, 1000, bwd=True) == 2.5 * variants.variant_flops(2, 16, 128, 1000)
    assert variants.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert variants.tflops(1e12, "n/impl") is None and variants.tflops(1e12, 0.0) is None


def test_the_variants_and_their_options():
    assert tuple(variants.VARIANTS) == ("plain", "causal", "window", "softcap", "alibi", "sinks", "dropout")
    parser = cli.build_parser()
    for name in variants.VARIANTS:  # bench's --variant choices are the suite's variants
        assert parser.parse_args(["bench", "--suite", "variants", "--variant", name]).variant == [name]
    assert variants.selected_variants(None) == list(variants.VARIANTS)
    assert variants.selected_variants(["sinks", "window"]) == ["causal", "window", "sinks"]
    cupy = FakeCupy()
    assert variants.ours_kwargs(cupy, "plain", 4) == {"causal": False}
    assert variants.ours_kwargs(cupy, "window", 4) == {"causal": True, "window_size": (4096, 0)}
    assert variants.ours_kwargs(cupy, "softcap", 4) == {"causal": True, "softcap": 30.0}
    assert variants.ours_kwargs(cupy, "dropout", 4) == {"causal": True, "dropout_p": 0.1,
                                                       "rng_state": variants.DROPOUT_RNG_STATE}
    slopes = variants.ours_kwargs(cupy, "alibi", 4)["alibi_slopes"]
    assert slopes.dtype == np.float32 and np.allclose(slopes, [2**-2, 2**-4, 2**-6, 2**-8])
    sinks = variants.ours_kwargs(cupy, "sinks", 4)["sinks"]
    assert sinks.dtype == np.float32 and sinks.shape == (4,)
    assert variants.describe("window") == "causal, window_size=(4096, 0)"
    assert variants.describe("plain") == "non-causal"


# ----------------------------------------------------------------------------
# Ratios and bars
# ----------------------------------------------------------------------------


def _result(variant, seqlen=16384, dtype="bfloat16", ours=(1.0, 2.0), flex=None, jax=None):
    res = variants.variant_result(variant, dtype=dtype, seqlen=seqlen, batch=16384 // seqlen, nheads=16,
                                  head_dim=128, input_sets=1)
    res["ours_fwd_ms"], res["ours_bwd_ms"] = ours
    if flex is not None:
        res["flex_fwd_ms"], res["flex_bwd_ms"] = flex
    if jax is not None:
        res["jax_fwd_ms"], res["jax_step_ms"] = jax
    return res


def test_cost_bars_against_causal():
    rows = [_result("causal"), _result("softcap", ours=(1.10, 2.3)), _result("dropout", ours=(1.25, 2.5)),
            _result("plain", ours=(1.9, 3.9))]
    checks = variants.judge_variants(rows)
    causal, softcap, dropout, plain = rows
    assert softcap["time_fwd_vs_causal"] == pytest.approx(1.10)
    assert (softcap["bar_fwd_causal"], softcap["bar_bwd_causal"], softcap["status"]) == ("PASS", "FAIL", "FAIL")
    assert (dropout["bar_fwd_causal"], dropout["bar_bwd_causal"], dropout["status"]) == ("PASS", "PASS", "PASS")
    assert causal["status"] == plain["status"] == "-"  # the references have no bar
    assert "time_fwd_vs_causal" not in causal and plain["time_fwd_vs_causal"] == pytest.approx(1.9)
    assert [(c["variant"], c["pass"], c["against"], c["status"]) for c in checks] == [
        ("softcap", "fwd", "causal", "PASS"), ("softcap", "fwd", "flex", "n/a"),  # flex not measured
        ("softcap", "bwd", "causal", "FAIL"), ("softcap", "bwd", "flex", "n/a"),
        ("dropout", "fwd", "causal", "PASS"), ("dropout", "bwd", "causal", "PASS")]
    assert checks[2]["bar"] == "softcap bwd: time / causal's <= 1.1"
    assert checks[2]["value"] == pytest.approx(1.15) and checks[2]["limit"] == 1.10
    assert checks[1]["bar"] == "softcap fwd: flex time / ours >= 1.3" and checks[1]["value"] is None
    assert variants.count_checks(checks) == {"PASS": 3, "FAIL": 1, "n/a": 2}


def test_the_window_bar_is_tflops_on_visible_pairs_at_16k_only():
    ratio = variants.visible_pairs(16384, 16384, True, (4096, 0)) / variants.visible_pairs(16384, 16384, True)
    # the window's time scaled with its visible pairs, at 0.95x causal's TFLOP/s forward, 0.85x backward
    rows = [_result("causal"), _result("window", ours=(ratio / 0.95, 2.0 * ratio / 0.85)),
            _result("causal", seqlen=4096), _result("window", seqlen=4096, ours=(5.0, 5.0))]
    variants.judge_variants(rows)
    window = rows[1]
    assert window["ours_fwd_tflops"] == pytest.approx(0.95 * rows[0]["ours_fwd_tflops"])
    assert window["tflops_fwd_vs_causal"] == pytest.approx(0.95)
    assert (window["bar_fwd_causal"], window["bar_bwd_causal"]) == ("PASS", "FAIL")
    assert (rows[3]["bar_fwd_causal"], rows[3]["bar_bwd_causal"]) == ("-", "-")  # no window bar at 4096
    assert rows[3]["tflops_fwd_vs_causal"] == pytest.approx(0.2)  # still reported


def test_flex_bars_where_flex_was_measured():
    rows = [_result("causal", seqlen=4096), _result("alibi", seqlen=4096, ours=(1.0, 2.0), flex=(1.3, 2.5)),
            _result("sinks", seqlen=4096), _result("dropout", seqlen=4096),
            _result("causal", seqlen=8192), _result("alibi", seqlen=8192, flex=(1.0, 1.0))]
    variants.judge_variants(rows)
    alibi, sinks, dropout, alibi_8k = rows[1], rows[2], rows[3], rows[5]
    assert alibi["ratio_fwd_vs_flex"] == pytest.approx(1.3) and alibi["ratio_bwd_vs_flex"] == pytest.approx(1.25)
    assert (alibi["bar_fwd_flex"], alibi["bar_bwd_flex"]) == ("PASS", "FAIL")
    assert (sinks["bar_fwd_flex"], sinks["bar_bwd_flex"], sinks["status"]) == ("n/a", "n/a", "n/a")
    assert dropout["bar_fwd_flex"] == "-" and dropout["flex_note"] == "FlexAttention has no dropout"
    assert alibi_8k["bar_fwd_flex"] == "-" and alibi_8k["ratio_fwd_vs_flex"] == 1.0  # no flex bar at 8192
    assert alibi["flex_fwd_tflops"] == pytest.approx(alibi["ours_fwd_tflops"] / 1.3)


def test_not_implemented_and_failures_mark_the_checks():
    rows = [_result("causal"), _result("softcap", ours=("n/impl", "n/impl"), flex=(2.0, 4.0)),
            _result("sinks", ours=(1.0, "n/impl")), _result("alibi", ours=("OOM", "OOM"))]
    checks = variants.judge_variants(rows)
    softcap, sinks, alibi = rows[1:]
    assert [softcap[f"bar_{p}_{a}"] for a in ("causal", "flex") for p in ("fwd", "bwd")] == ["n/impl"] * 4
    assert softcap["status"] == "n/impl"
    assert (sinks["bar_fwd_causal"], sinks["bar_bwd_causal"], sinks["status"]) == ("PASS", "n/impl", "n/impl")
    assert alibi["status"] == "OOM"
    assert variants.count_checks(checks) == {"PASS": 1, "n/a": 1, "n/impl": 6, "OOM": 4}


def test_ratios_against_causal_do_not_depend_on_the_order_of_the_results():
    rows = [_result("plain", ours=(2.0, 4.0)), _result("causal")]
    variants.judge_variants(rows)
    assert rows[0]["tflops_fwd_vs_causal"] == pytest.approx(0.5 * rows[0]["visible_pairs"] / rows[1]["visible_pairs"])


def test_a_missing_reference_leaves_the_bars_unjudged():
    rows = [_result("softcap")]
    variants.judge_variants(rows)
    assert (rows[0]["bar_fwd_causal"], rows[0]["status"]) == ("n/a", "n/a")


def test_jax_ratios_are_the_forward_and_the_step():
    rows = [_result("causal"), _result("window", ours=(1.0, 2.0), jax=(1.5, 4.5))]
    variants.judge_variants(rows)
    window = rows[1]
    assert window["ours_step_ms"] == 3.0
    assert window["ratio_fwd_vs_jax"] == 1.5 and window["ratio_step_vs_jax"] == 1.5


def test_point_status_is_the_worst_bar():
    assert variants.point_status(["-", "-"]) == "-"
    assert variants.point_status(["PASS", "-", "n/a"]) == "n/a"
    assert variants.point_status(["PASS", "n/impl", "FAIL"]) == "FAIL"
    assert variants.point_status(["PASS", "PASS"]) == "PASS"


def test_the_not_implemented_note_names_the_variants_and_passes():
    rows = [_result("causal"), _result("window", ours=("n/impl", "n/impl")),
            _result("sinks", ours=(1.0, "n/impl")), _result("window", seqlen=4096, ours=("n/impl", "n/impl"))]
    rows[1]["ours_note"] = "not implemented: cupyflash.flash_attn_fwd: window_size is not implemented"
    assert variants.not_implemented_note(rows) == (
        "ours: not implemented on the GPU yet for window, sinks (bwd) "
        "(not implemented: cupyflash.flash_attn_fwd: window_size is not implemented)")
    assert variants.not_implemented_note(rows[:1]) is None


# ----------------------------------------------------------------------------
# measure_passes: failures as results
# ----------------------------------------------------------------------------


class FakeImpl:
    name, passes = "fake", ("fwd", "bwd")

    def __init__(self, fail_in=None, exc=None):
        self.fail_in, self.exc, self.used, self.waits = fail_in, exc, [], 0

    def prepare(self, sets):
        return sets

    def forward(self, state):
        if self.fail_in == "forward":
            raise self.exc
        self.used.append(("fwd", id(state)))
        return "out"

    def backward(self, state, fwd):
        if self.fail_in == "backward":
            raise self.exc
        self.used.append(("bwd", id(state), fwd))

    def wait(self, result):
        self.waits += 1

    def time_ms(self, fn, reps):
        for _ in range(3):
            fn()
        return 1.25


def test_measure_passes_times_both_passes_rotating_through_the_sets():
    sets, impl, res = [("a",), ("b",), ("c",)], FakeImpl(), {}
    variants.measure_passes(impl, sets, res, reps=2)
    assert res["fake_fwd_ms"] == res["fake_bwd_ms"] == 1.25
    assert res["fake_first_fwd_s"] >= 0 and res["fake_first_bwd_s"] >= 0
    assert impl.waits == 2  # each pass's first call is waited for (its compile timed) before the timing
    assert {i for p, i, *_ in impl.used if p == "fwd"} == {id(s) for s in sets}
    assert {i for p, i, *_ in impl.used if p == "bwd"} == {id(s) for s in sets}
    assert all(f == "out" for p, *rest in impl.used if p == "bwd" for f in rest[1:])


def test_a_not_implemented_forward_marks_both_passes():
    res = {}
    exc = NotImplementedError("cupyflash.flash_attn_fwd: softcap is not implemented on the GPU yet (issue 13)")
    variants.measure_passes(FakeImpl("forward", exc), [("a",)], res, reps=2)
    assert res["fake_fwd_ms"] == res["fake_bwd_ms"] == "n/impl"
    assert res["fake_note"] == "not implemented: " + str(exc)


def test_a_not_implemented_backward_keeps_the_forward():
    res = {}
    variants.measure_passes(FakeImpl("backward", NotImplementedError("dsinks")), [("a",)], res, reps=2)
    assert (res["fake_fwd_ms"], res["fake_bwd_ms"], res["fake_note"]) == (1.25, "n/impl", "not implemented: dsinks")


@pytest.mark.parametrize("exc,marker", [(OutOfMemoryError("Tried to allocate 9 GiB"), "OOM"),
                                        (RuntimeError("No available kernel"), "error")])
def test_other_failures_are_oom_or_error(exc, marker):
    res = {}
    variants.measure_passes(FakeImpl("forward", exc), [("a",)], res, reps=2)
    assert res["fake_fwd_ms"] == res["fake_bwd_ms"] == marker
    assert res["fake_error"] == f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------
# A fake torch and flex_attention (the dense definition, on numpy)
# ----------------------------------------------------------------------------


class Tensor(np.ndarray):
    """A numpy array posing as a torch tensor, for the calls the suite makes."""

    requires_grad = False

    def requires_grad_(self):
        self.requires_grad = True
        return self

    def transpose(self, a, b):
        return np.swapaxes(self, a, b)

    def contiguous(self):
        return np.ascontiguousarray(self).view(Tensor)

    def to(self, dtype):
        return self.astype(dtype)


def _tensor(values, device=None, requires_grad=False, dtype=None):
    t = np.array(values, dtype=dtype).view(Tensor)
    t.requires_grad = requires_grad
    return t


class _TorchEvent:
    elapsed = 3.0

    def __init__(self, enable_timing):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return _TorchEvent.elapsed


def fake_torch():
    torch = types.SimpleNamespace(
        tanh=np.tanh, abs=np.abs, sigmoid=expit, tensor=_tensor,
        from_dlpack=lambda x: np.asarray(x).view(Tensor), grads=[], empty_caches=0)
    torch.cuda = types.SimpleNamespace(synchronize=lambda: None, Event=_TorchEvent,
                                       empty_cache=lambda: setattr(torch, "empty_caches", torch.empty_caches + 1))

    def grad(out, leaves, dout, retain_graph=False):
        torch.grads.append((len(leaves), retain_graph))
        return tuple(np.zeros_like(x) for x in leaves)

    torch.autograd = types.SimpleNamespace(grad=grad)
    return torch


def fake_flex_module(with_aux=True):
    """flex_attention by its definition: scores * scale, score_mod, the mask (here the mask_mod
    itself: create_block_mask returns it), the softmax; lse in natural log."""
    module = types.SimpleNamespace(calls=[], masks=[])

    def flex_attention(q, k, v, score_mod=None, block_mask=None, scale=None, return_lse=False, return_aux=None):
        module.calls.append((score_mod is not None, return_lse, return_aux is not None))
        batch, nheads, seqlen_q, _ = q.shape
        index = [np.arange(n).reshape([-1 if i == axis else 1 for i in range(4)])
                 for axis, n in enumerate((batch, nheads, seqlen_q, k.shape[2]))]
        scores = np.einsum("bhqd,bhkd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64)) * scale
        if score_mod is not None:
            scores = score_mod(scores, *index)
        if block_mask is not None:
            scores = np.where(block_mask(*index), scores, -np.inf)
        top = np.max(scores, axis=-1, keepdims=True)  # (not scipy's logsumexp: the fixture hides jax as None)
        lse = (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))[..., 0]
        out = (np.exp(scores - lse[..., None]) @ np.asarray(v, np.float64)).view(Tensor)
        if return_aux is not None:
            return out, types.SimpleNamespace(lse=lse)
        return (out, lse) if return_lse else out

    def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device):
        module.masks.append((B, H, Q_LEN, KV_LEN, device))
        return mask_mod

    module.flex_attention, module.create_block_mask = flex_attention, create_block_mask
    if with_aux:
        module.AuxRequest = lambda lse: types.SimpleNamespace(lse=lse)
    return module


def _bhsd(rng, batch, nheads, seqlen, head_dim):
    return rng.standard_normal((batch, seqlen, nheads, head_dim))


@pytest.mark.parametrize("with_aux", [True, False])
@pytest.mark.parametrize("variant", ["window", "softcap", "alibi", "sinks"])
def test_the_flex_expressions_equal_the_float64_reference(variant, with_aux):
    """Each variant as flex expresses it, run by flex_attention's definition, is the variant."""
    rng = np.random.default_rng(5)
    batch, nheads, seqlen, head_dim, window = 2, 3, 19, 8, (4, 0)
    q, k, v = (3 * _bhsd(rng, batch, nheads, seqlen, head_dim) for _ in range(3))
    scale = head_dim ** -0.5
    torch, module = fake_torch(), fake_flex_module(with_aux)
    env = variants.FlexEnv(torch, module, softmax_scale=scale, compile_fn=lambda fn: fn, device="cpu")
    env.mask_mods = variants.flex_mask_mods(window[0])
    params = env.params(variant, nheads)
    out = env.function(variant)(*(_tensor(np.swapaxes(x, 1, 2)) for x in (q, k, v)),
                                env.block_mask(variant, seqlen), *params)
    options = {"window": {"window_size": window}, "softcap": {"softcap": 30.0},
               "alibi": {"alibi_slopes": variants.alibi_slopes(nheads)},
               "sinks": {"sinks": variants.sink_logits(nheads)}}[variant]
    expected, _ = reference.attention_fwd(q, k, v, scale, causal=True, **options)
    np.testing.assert_allclose(np.swapaxes(np.asarray(out), 1, 2), expected, rtol=1e-10, atol=1e-12)
    if variant == "sinks":
        assert params[0].requires_grad and module.calls[-1][1:] == (not with_aux, with_aux)
    if variant == "alibi":
        assert not params[0].requires_grad


# ----------------------------------------------------------------------------
# The JAX window (the real JAX, on its CPU backend: XLA instead of cuDNN)
# ----------------------------------------------------------------------------


def test_the_jax_window_is_ours():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    impl = variants.JaxWindow((jax, jnp, None), dtype="float32", softmax_scale=0.3, window=(3, 0),
                              implementation="xla")
    states = impl.prepare([(np.zeros((2, 16, 2, 8)),)] * 2)
    assert len(states) == 2 and states[0][0].shape == (2, 16, 2, 8) and states[0][0].dtype == jnp.float32
    q, k, v, _ = (np.asarray(x, np.float64) for x in states[0])
    expected, _ = reference.attention_fwd(q, k, v, 0.3, causal=True, window_size=(3, 0))
    np.testing.assert_allclose(np.asarray(impl.forward(states[0])), expected, rtol=2e-5, atol=2e-5)
    res = {}
    variants.measure_passes(impl, [(np.zeros((2, 16, 2, 8)),)], res, reps=2)
    assert res["jax_fwd_ms"] > 0 and res["jax_step_ms"] > 0 and "jax_error" not in res
    assert [g.shape for g in impl.backward(states[0], None)] == [(2, 16, 2, 8)] * 3


# ----------------------------------------------------------------------------
# The suite end to end
# ----------------------------------------------------------------------------


@pytest.fixture
def small(monkeypatch):
    """The suite at head_dim 16, 2 heads, 64 tokens; L2 of 64 KiB; ``import cupy`` gives a FakeCupy;
    no warm-up."""
    monkeypatch.setattr(variants, "VARIANT_CONFIG", {"head_dim": 16, "nheads": 2, "tokens": 64})
    monkeypatch.setattr(bench, "L2_BYTES", 2**16)
    cupy = FakeCupy(elapsed_ms=1.0)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "jax", None)  # JAX does not import
    monkeypatch.setattr(bench, "_warm_up", lambda fn, synchronize, warmup_ms: (fn(), synchronize()))
    return cupy


def _run(capsys, tmp_path, *argv):
    path = tmp_path / "variants.json"
    assert cli.main(["bench", "--suite", "variants", "--dtype", "float16", "--reps", "2", "--json", str(path),
                     *argv]) == 0
    captured = capsys.readouterr()
    return json.loads(path.read_text()), captured.out, captured.err


def test_bench_variants_on_the_cpu_path(small, capsys, tmp_path):
    report, out, err = _run(capsys, tmp_path, "--seqlen", "16", "--seqlen", "32", "--no-torch")
    assert report["suite"] == "variants" and report["impls"] == ["ours"]
    assert report["notes"][0] == "FlexAttention columns skipped: --no-torch"
    assert report["notes"][1].startswith("JAX window column skipped: JAX not importable (")
    assert len(report["notes"]) == 2
    assert report["variants"] == list(variants.VARIANTS)
    assert [(r["seqlen"], r["variant"]) for r in report["results"]] == [
        (s, v) for s in (16, 32) for v in variants.VARIANTS]
    for r in report["results"]:
        assert r["batch"] == 64 // r["seqlen"] and r["input_sets"] == 1 + 8  # 16 KiB sets, 64 KiB of L2
        assert r["ours_fwd_ms"] == r["ours_bwd_ms"] == 1.0  # every variant ran (the CPU path has them all)
        window = variants.VARIANTS[r["variant"]].get("window_size", (-1, -1))
        pairs = variants.visible_pairs(r["seqlen"], r["seqlen"], r["causal"], window)
        assert r["visible_pairs"] == pairs
        assert r["ours_fwd_tflops"] == pytest.approx(4 * r["batch"] * 2 * 16 * pairs / 1.0 / 1e9)
    statuses = {r["variant"]: r["status"] for r in report["results"]}
    assert statuses == {"plain": "-", "causal": "-", "window": "-", "softcap": "PASS", "alibi": "PASS",
                        "sinks": "PASS", "dropout": "PASS"}
    assert report["bars"] == {"PASS": 16}  # 4 cost bars x 2 passes x 2 seqlens; no window bar below 16k
    assert len(report["bar_checks"]) == 16
    assert set(report["config"]["bars"]) == {"window", "cost", "flex"}
    assert report["config"]["variants"]["dropout"] == "causal, dropout_p=0.1, rng_state=(24301, 0)"
    assert out.endswith(variants.format_variants_table(report) + "\n")
    assert out.startswith("note: FlexAttention columns skipped: --no-torch\n")
    assert "variants float16 S=32 dropout: ours fwd 1.000 ms, bwd 1.000 ms" in err


def test_variants_not_implemented_on_the_gpu_are_results(small, capsys, tmp_path, monkeypatch):
    """Today's GPU functions: plain runs, every variant raises NotImplementedError (sinks: only
    its backward, as a kernel landing pass by pass would)."""
    fwd, bwd = cupyflash.flash_attn_fwd, cupyflash.flash_attn_bwd
    on = ("window_size", "softcap", "alibi_slopes", "dropout_p")

    def gpu_fwd(*args, **kwargs):
        if any(k in kwargs for k in on):
            raise NotImplementedError(f"cupyflash.flash_attn_fwd: {next(k for k in on if k in kwargs)} is not "
                                      f"implemented on the GPU yet (issue 13)")
        return fwd(*args, **kwargs)

    def gpu_bwd(*args, **kwargs):
        if any(k in kwargs for k in (*on, "sinks")):
            raise NotImplementedError("cupyflash.flash_attn_bwd: not implemented on the GPU yet")
        return bwd(*args, **kwargs)

    monkeypatch.setattr(cupyflash, "flash_attn_fwd", gpu_fwd)
    monkeypatch.setattr(cupyflash, "flash_attn_bwd", gpu_bwd)
    report, out, _ = _run(capsys, tmp_path, "--seqlen", "32", "--no-torch", "--no-jax")
    rows = {r["variant"]: r for r in report["results"]}
    assert rows["causal"]["ours_fwd_ms"] == rows["plain"]["ours_bwd_ms"] == 1.0
    for name in ("window", "softcap", "alibi", "dropout"):
        assert rows[name]["ours_fwd_ms"] == rows[name]["ours_bwd_ms"] == "n/impl", name
        assert rows[name]["ours_note"].startswith("not implemented: cupyflash.flash_attn_fwd: ")
    assert (rows["sinks"]["ours_fwd_ms"], rows["sinks"]["ours_bwd_ms"]) == (1.0, "n/impl")
    assert {n: r["status"] for n, r in rows.items() if n not in ("plain", "causal", "window")} == {
        "softcap": "n/impl", "alibi": "n/impl", "sinks": "n/impl", "dropout": "n/impl"}
    assert report["bars"] == {"PASS": 1, "n/impl": 7}
    assert report["notes"][-1].startswith("ours: not implemented on the GPU yet for window, softcap, alibi, "
                                          "sinks (bwd), dropout (not implemented: cupyflash.flash_attn_fwd: "
                                          "window_size is not implemented")
    assert "note: ours: not implemented on the GPU yet" in out
    assert "n/impl" in out.splitlines()[-2]  # the dropout row, the bars line last


def test_bench_variants_beside_flex(small, capsys, tmp_path, monkeypatch):
    """FlexAttention through a fake torch: compiled once per variant, block masks made once per
    (mask, seqlen), the flex rows for window, softcap, alibi and sinks only, their bars."""
    torch, module, compiled = fake_torch(), fake_flex_module(), []

    def compile_fn(fn):
        compiled.append(fn.__name__)
        return fn

    monkeypatch.setattr(bench, "torch_env", lambda: ((torch, None, None), None))
    monkeypatch.setattr(variants, "flex_env", lambda env, scale: (variants.FlexEnv(
        env[0], module, softmax_scale=scale, compile_fn=compile_fn, device="cpu"), None))
    report, out, err = _run(capsys, tmp_path, "--seqlen", "16", "--seqlen", "32", "--no-jax")
    assert report["impls"] == ["ours", "flex"]
    assert compiled == ["window", "capped", "alibi", "sinks"]  # once per variant, reused across seqlens
    assert module.masks == [(None, None, 16, 16, "cpu")] * 2 + [(None, None, 32, 32, "cpu")] * 2  # window, causal
    rows = {(r["seqlen"], r["variant"]): r for r in report["results"]}
    for (seqlen, name), r in rows.items():
        if name in variants.FLEX_VARIANTS:
            assert r["flex_fwd_ms"] == r["flex_bwd_ms"] == 3.0 and r["ratio_fwd_vs_flex"] == 3.0
        else:
            assert "flex_fwd_ms" not in r
    assert torch.grads.count((4, True)) >= 2 and torch.grads.count((3, True)) >= 2  # sinks' leaf has a grad
    assert rows[(16, "dropout")]["flex_note"] == "FlexAttention has no dropout"
    assert rows[(32, "sinks")]["bar_fwd_flex"] == "-"  # the flex bars are at seqlen 4096 and 16384
    assert report["config"]["flex"]["sinks"].startswith("causal block mask; out * sigmoid(lse - sinks[h])")
    assert "variants float16 S=16 sinks: flex fwd 3.000 ms, bwd 3.000 ms" in err
    assert torch.empty_caches == 8


def test_flex_failing_is_a_result(small, capsys, tmp_path, monkeypatch):
    torch, module = fake_torch(), fake_flex_module()

    def compile_fn(fn):
        def fails(*args):
            raise RuntimeError("triton not found: inductor cannot compile")
        return fails

    monkeypatch.setattr(bench, "torch_env", lambda: ((torch, None, None), None))
    monkeypatch.setattr(variants, "flex_env", lambda env, scale: (variants.FlexEnv(
        env[0], module, softmax_scale=scale, compile_fn=compile_fn, device="cpu"), None))
    report, _, _ = _run(capsys, tmp_path, "--seqlen", "16", "--variant", "softcap", "--no-jax")
    softcap = report["results"][1]
    assert softcap["flex_fwd_ms"] == softcap["flex_bwd_ms"] == "error"
    assert softcap["flex_error"] == "RuntimeError: triton not found: inductor cannot compile"
    assert softcap["ours_fwd_ms"] == 1.0


def test_flex_env_without_flex_attention(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "torch.nn", None)
    env, why = variants.flex_env((sys.modules["torch"], None, None), 0.1)
    assert env is None and why.startswith("torch has no flex_attention (")
    assert variants.flex_env(None, 0.1) == (None, "torch not measured")


def test_flex_env_turns_donated_buffers_off(monkeypatch):
    """flex_module (shared by the variants and bias suites) turns them off."""
    torch = fake_torch()
    torch._functorch = types.SimpleNamespace(config=types.SimpleNamespace(donated_buffer=True))
    torch.compile = lambda fn, dynamic: fn
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", fake_flex_module())
    env, why = variants.flex_env((torch, None, None), 0.1)
    assert why is None and isinstance(env, variants.FlexEnv)
    assert torch._functorch.config.donated_buffer is False


def test_only_the_chosen_variants_and_the_reference_run(small, capsys, tmp_path):
    report, _, _ = _run(capsys, tmp_path, "--seqlen", "16", "--variant", "window", "--no-torch", "--no-jax")
    assert [r["variant"] for r in report["results"]] == ["causal", "window"]
    assert report["notes"] == ["FlexAttention columns skipped: --no-torch", "JAX window column skipped: --no-jax"]
    report, _, _ = _run(capsys, tmp_path, "--seqlen", "16", "--variant", "dropout", "--no-torch", "--no-jax")
    assert [r["variant"] for r in report["results"]] == ["causal", "dropout"]
    assert report["notes"] == []  # neither FlexAttention nor JAX has a figure for these


def test_bench_variants_beside_jax(small, capsys, tmp_path, monkeypatch):
    """The window's JAX rows through the real JAX on the CPU (XLA standing in for cuDNN)."""
    monkeypatch.delitem(sys.modules, "jax")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from cupyflash import _bench_suites

    monkeypatch.setattr(_bench_suites, "jax_env", lambda: ((jax, jnp, None), None))
    real = variants.JaxWindow  # float32: JAX's CPU dot has no float16 x float16 -> float32

    monkeypatch.setattr(variants, "JaxWindow", lambda mods, *, dtype, softmax_scale: real(
        mods, dtype="float32", softmax_scale=softmax_scale, implementation="xla"))
    report, out, _ = _run(capsys, tmp_path, "--seqlen", "16", "--variant", "window", "--no-torch")
    assert report["impls"] == ["ours", "jax"]
    window = report["results"][1]
    assert window["jax_fwd_ms"] > 0 and window["jax_step_ms"] > 0 and window["ours_step_ms"] == 2.0
    assert window["ratio_step_vs_jax"] == pytest.approx(window["jax_step_ms"] / 2.0)
    assert "jax_fwd_ms" not in report["results"][0]
    assert "window (4096, 0) beside jax.nn.dot_product_attention(implementation='cudnn')" in out
    assert report["config"]["jax"].startswith("jax.nn.dot_product_attention(is_causal=True, "
                                              "local_window_size=(4096, 0), implementation='cudnn')")
