"""``python -m cupyflash bench --suite variants``: the attention variants' speed bars (issue 13).

At head_dim 128, 16 heads and batch * seqlen = 16384 tokens (seqlen 4096 and
16384, bfloat16 by default), for the forward and the backward:

- **ours** through the public functions (``flash_attn_fwd``/``flash_attn_bwd`` on
  cupy arrays) for each variant of :data:`VARIANTS`: plain and causal (the
  references), a (4096, 0) sliding window, softcap 30, ALiBi, sinks and dropout
  0.1, all causal;
- **flex**: torch's ``flex_attention`` compiled with ``torch.compile`` expressing
  the same variant (:func:`flex_calls`): the window and the causal mask as block
  masks, softcap and ALiBi as ``score_mod``, sinks through the lse it returns
  (``out * sigmoid(lse - sink)``, differentiable, in the compiled function).
  FlexAttention has no dropout: that row has no flex figure;
- **jax** for the window: ``jax.nn.dot_product_attention(..., is_causal=True,
  local_window_size=(4096, 0), implementation="cudnn")``, jitted, and its
  ``jit(grad)`` training step beside ours' forward + backward.

FLOPs count the visible (query, key) pairs only (:func:`visible_pairs`): ``4 * B
* H * D * pairs``, x2.5 for the backward.  The bars (:func:`judge_variants`):

- window: TFLOP/s at least 0.9 x the plain causal kernel's at seqlen 16384;
- softcap, ALiBi and sinks: time at most 1.10 x plain causal's, dropout 1.25 x;
- FlexAttention's time at least 1.3 x ours for window, softcap, ALiBi and sinks
  at seqlen 4096 and 16384.

Every bar is checked for the forward and for the backward; ``report["bars"]``
counts the checks by status and ``report["bar_checks"]`` lists each one with its
ratio.  The GPU kernels of a variant that does not exist yet raise
NotImplementedError: that measurement is marked ``"n/impl"`` with a note and the
suite carries on; torch or JAX missing skips their columns with a note.

Device time (reasoned, not measured): ours is 14 points of two timings, about
0.15 s each with the warm-up; flex compiles (dynamo, inductor, Triton) once per
variant *and shape* (``dynamic=False``: the two seqlens are two compiles), 8
compiles of a forward and a backward, which is most of the suite's time; JAX
compiles 4 programs.  ``flex_first_fwd_s``/``flex_first_bwd_s`` (the first calls,
compiles included) record what they cost.
"""

from __future__ import annotations

import collections
import functools
import importlib
import sys
import time

import numpy as np

from . import bench
from ._bench_suites import ERROR, OOM, _number, cell, mark_failed, ratio

NOT_IMPLEMENTED = "n/impl"

VARIANT_CONFIG = {"head_dim": 128, "nheads": 2048 // 128, "tokens": 16384}
VARIANT_SEQLENS = (4096, 16384)
VARIANT_DTYPES = ("bfloat16",)
PASSES = ("fwd", "bwd")

#: The variants' parameters (issue 13's speed section).
WINDOW = (4096, 0)
SOFTCAP = 30.0
DROPOUT_P = 0.1
DROPOUT_RNG_STATE = (0x5EED, 0)

#: name -> the variant's options: ``causal`` and which of the variant options are on.
VARIANTS = {
    "plain": {"causal": False},
    "causal": {"causal": True},
    "window": {"causal": True, "window_size": WINDOW},
    "softcap": {"causal": True, "softcap": SOFTCAP},
    "alibi": {"causal": True, "alibi_slopes": True},
    "sinks": {"causal": True, "sinks": True},
    "dropout": {"causal": True, "dropout_p": DROPOUT_P},
}
#: The reference of the bars: the plain causal kernel at the same shape.
REFERENCE = "causal"

#: Bars.  Window: TFLOP/s (visible pairs) >= WINDOW_BAR x causal's, at WINDOW_BAR_SEQLENS;
#: COST_BARS: time <= limit x causal's; FlexAttention's time >= FLEX_BAR x ours for
#: FLEX_VARIANTS at FLEX_BAR_SEQLENS.
WINDOW_BAR = 0.9
WINDOW_BAR_SEQLENS = (16384,)
COST_BARS = {"softcap": 1.10, "alibi": 1.10, "sinks": 1.10, "dropout": 1.25}
FLEX_BAR = 1.3
FLEX_BAR_SEQLENS = (4096, 16384)
FLEX_VARIANTS = ("window", "softcap", "alibi", "sinks")
#: The block mask each flex variant runs with.
FLEX_MASKS = {"window": "window", "softcap": "causal", "alibi": "causal", "sinks": "causal"}
FLEX_EXPRESSIONS = {
    "window": "block_mask from create_block_mask(mask_mod: kv_idx <= q_idx and q_idx - kv_idx <= 4096)",
    "softcap": "causal block mask; score_mod: 30 * tanh(score / 30)",
    "alibi": "causal block mask; score_mod: score - slopes[h] * |q_idx - kv_idx|",
    "sinks": "causal block mask; out * sigmoid(lse - sinks[h]) on flex_attention's lse (return_aux or "
             "return_lse, differentiable), inside the compiled function",
    "dropout": "none: FlexAttention has no dropout",
}
#: The order in which check statuses are counted and the worst first, for a point's status.
STATUS_ORDER = ("PASS", "FAIL", "n/a", NOT_IMPLEMENTED, ERROR, OOM)
_WORST_FIRST = ("FAIL", OOM, ERROR, NOT_IMPLEMENTED, "n/a", "PASS")


# ----------------------------------------------------------------------------
# Pure pieces: visible pairs, FLOPs, the variants' parameters
# ----------------------------------------------------------------------------


def visible_pairs(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)) -> int:
    """How many (query, key) pairs are visible under a causal mask and/or a window.

    Parameters
    ----------
    seqlen_q, seqlen_k : int
    causal : bool, optional
        Bottom-right aligned: query ``i`` sees key ``j`` only if ``j <= i +
        seqlen_k - seqlen_q`` (``right`` becomes 0).
    window_size : (int, int), optional
        ``(left, right)``, -1 = unbounded: query ``i`` sees key ``j`` iff ``i +
        seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``
        (:func:`cupyflash.reference.visible_keys`).

    Returns
    -------
    int
        The number of True entries of the ``(seqlen_q, seqlen_k)`` mask,
        counted row by row without building it.
    """
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    diag = np.arange(seqlen_q, dtype=np.int64) + (seqlen_k - seqlen_q)  # key on each row's diagonal
    lo = np.maximum(diag - left, 0) if left >= 0 else np.zeros_like(diag)
    hi = np.minimum(diag + right, seqlen_k - 1) if right >= 0 else np.full_like(diag, seqlen_k - 1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def variant_flops(batch, nheads, head_dim, pairs, bwd=False) -> float:
    """``4 * batch * nheads * head_dim * pairs``, x2.5 for the backward."""
    return 4.0 * batch * nheads * head_dim * pairs * (2.5 if bwd else 1.0)


def tflops(flops, ms):
    """TFLOP/s of ``flops`` in ``ms`` milliseconds; None unless ``ms`` is a measured positive number."""
    return flops / ms / 1e9 if _number(ms) and ms > 0 else None


def alibi_slopes(nheads):
    """ALiBi's slopes for ``nheads`` heads (float32): ``2 ** (-8 (h + 1) / nheads)``."""
    return (2.0 ** (-8.0 * np.arange(1, nheads + 1) / nheads)).astype(np.float32)


def sink_logits(nheads):
    """Sink logits, one per head (float32), spread over [-1, 1]."""
    return np.linspace(-1.0, 1.0, nheads, dtype=np.float32)


def selected_variants(names):
    """The variants to run, in :data:`VARIANTS` order, the reference always among them."""
    chosen = set(names or VARIANTS) | {REFERENCE}
    return [name for name in VARIANTS if name in chosen]


def describe(name) -> str:
    """A variant's options as text, e.g. ``causal, window_size=(4096, 0)``."""
    options = VARIANTS[name]
    parts = ["causal" if options["causal"] else "non-causal"]
    for key, value in options.items():
        if key == "causal":
            continue
        if key == "alibi_slopes":
            parts.append("alibi_slopes=2**(-8(h+1)/nheads)")
        elif key == "sinks":
            parts.append("sinks=linspace(-1, 1, nheads)")
        elif key == "dropout_p":
            parts.append(f"dropout_p={value:g}, rng_state={DROPOUT_RNG_STATE}")
        else:
            parts.append(f"{key}={value!r}")
    return ", ".join(parts)


def ours_kwargs(cupy, name, nheads) -> dict:
    """The keyword arguments of ``flash_attn_fwd``/``flash_attn_bwd`` for one variant (cupy arrays)."""
    options = VARIANTS[name]
    kwargs = {"causal": options["causal"]}
    if "window_size" in options:
        kwargs["window_size"] = options["window_size"]
    if "softcap" in options:
        kwargs["softcap"] = options["softcap"]
    if options.get("alibi_slopes"):
        kwargs["alibi_slopes"] = cupy.asarray(alibi_slopes(nheads))
    if options.get("sinks"):
        kwargs["sinks"] = cupy.asarray(sink_logits(nheads))
    if "dropout_p" in options:
        kwargs.update(dropout_p=options["dropout_p"], rng_state=DROPOUT_RNG_STATE)
    return kwargs


# ----------------------------------------------------------------------------
# Measuring one implementation: the forward, then the second pass
# ----------------------------------------------------------------------------


def mark_not_implemented(res, name, keys, exc) -> None:
    """Record a NotImplementedError: every key of ``keys`` not yet in ``res`` becomes ``"n/impl"``
    and ``res[name + "_note"]`` says so, with the message."""
    for key in keys:
        res.setdefault(key, NOT_IMPLEMENTED)
    res.setdefault(f"{name}_note", f"not implemented: {' '.join(str(exc).split())[:200]}")


def _mark(res, name, keys, exc):
    if isinstance(exc, NotImplementedError):
        mark_not_implemented(res, name, keys, exc)
    else:
        mark_failed(res, name, keys, exc)


def _first_call(impl, call, res, key):
    """``call()``, waited for, its wall seconds (a compile included) under ``res[key]``."""
    t0 = time.perf_counter()
    result = call()
    impl.wait(result)
    res[key] = time.perf_counter() - t0
    return result


def measure_passes(impl, sets, res, reps) -> None:
    """Time an implementation's two passes into ``res``, rotating through ``sets``.

    The first call of each pass is made (and waited for) before its timing:
    its wall time, compiles included, goes to ``<name>_first_<pass>_s``.  A
    NotImplementedError marks the times it leaves unmeasured ``"n/impl"``
    (:func:`mark_not_implemented`), any other error ``"OOM"`` or ``"error"``
    (:func:`cupyflash._bench_suites.mark_failed`); a failed forward leaves the
    second pass unmeasured too.

    Parameters
    ----------
    impl : OursVariant, FlexVariant, JaxWindow or alike
        ``name``, ``passes`` (the forward's name, then the second pass's:
        ``("fwd", "bwd")``, or ``("fwd", "step")`` for a training step),
        ``prepare(sets) -> states``, ``forward(state)``, ``backward(state,
        forward's result)``, ``wait(result)`` and ``time_ms(fn, reps)``.
    sets : list of tuple
        ``(q, k, v, dout)`` cupy arrays.
    res : dict
        Receives ``<name>_<pass>_ms`` for both passes.
    reps : int
    """
    name, (first_pass, second_pass) = impl.name, impl.passes
    keys = [f"{name}_{first_pass}_ms", f"{name}_{second_pass}_ms"]
    try:
        states = impl.prepare(sets)
        first = _first_call(impl, lambda: impl.forward(states[0]), res, f"{name}_first_{first_pass}_s")
        res[keys[0]] = impl.time_ms(bench._rotating([functools.partial(impl.forward, s)  # noqa: SLF001
                                                     for s in states]), reps)
        fwds = [first] + [impl.forward(s) for s in states[1:]]
    except Exception as e:  # noqa: BLE001 - a missing kernel, an OOM or a refusal is a result
        _mark(res, name, keys, e)
        return
    try:
        _first_call(impl, lambda: impl.backward(states[0], fwds[0]), res, f"{name}_first_{second_pass}_s")
        res[keys[1]] = impl.time_ms(bench._rotating([functools.partial(impl.backward, s, f)  # noqa: SLF001
                                                     for s, f in zip(states, fwds)]), reps)
    except Exception as e:  # noqa: BLE001
        _mark(res, name, keys[1:], e)


class OursVariant:
    """cupyflash's ``flash_attn_fwd``/``flash_attn_bwd`` on cupy arrays with one variant's options."""

    name = "ours"
    passes = PASSES

    def __init__(self, cupy, *, dtype, softmax_scale, kwargs, bwd_kwargs=None):
        """``kwargs``: both passes' keyword arguments; ``bwd_kwargs``: the backward's extra ones."""
        import cupyflash  # noqa: PLC0415

        self.cupy, self.lib, self.kwargs = cupy, cupyflash, dict(kwargs, softmax_scale=softmax_scale, dtype=dtype)
        self.bwd_kwargs = dict(self.kwargs, **(bwd_kwargs or {}))

    def prepare(self, sets):
        return sets

    def forward(self, state):
        q, k, v, _ = state
        return self.lib.flash_attn_fwd(q, k, v, **self.kwargs)

    def backward(self, state, fwd):
        q, k, v, dout = state
        return self.lib.flash_attn_bwd(dout, q, k, v, fwd[0], fwd[1], **self.bwd_kwargs)

    def wait(self, result):
        self.cupy.cuda.get_current_stream().synchronize()

    def time_ms(self, fn, reps):
        return bench._time_ms(fn, reps, self.cupy)  # noqa: SLF001


# ----------------------------------------------------------------------------
# FlexAttention: the variants as score_mod / block_mask, compiled
# ----------------------------------------------------------------------------


def flex_mask_mods(window_left=WINDOW[0]):
    """``{"causal": mask_mod, "window": mask_mod}`` for ``create_block_mask``.

    seqlen_q == seqlen_k in this suite, so the bottom-right diagonal is ``kv_idx ==
    q_idx``; the window is ``(window_left, 0)``.
    """
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= window_left)

    return {"causal": causal, "window": window}


def flex_calls(torch, flex_attention, aux_request=None, *, softmax_scale, softcap=SOFTCAP):
    """The functions that express each variant with ``flex_attention``, by name (uncompiled).

    Each is ``fn(q, k, v, block_mask, *params)`` on ``(batch, nheads, seqlen,
    head_dim)`` tensors and returns the output; ``params`` is ``(slopes,)`` for
    alibi, ``(sinks,)`` for sinks, nothing otherwise.  Each is its own ``def``,
    so each has its own code object and its own torch.compile cache entries.

    Parameters
    ----------
    torch : module
        ``torch`` (its ``tanh``, ``abs`` and ``sigmoid``).
    flex_attention : callable
        ``torch.nn.attention.flex_attention.flex_attention``.
    aux_request : type, optional
        ``AuxRequest`` where torch has it (``return_aux=AuxRequest(lse=True)``,
        torch >= 2.9, where ``return_lse`` is deprecated); otherwise sinks take
        the lse through ``return_lse=True``.
    softmax_scale, softcap : float
    """
    scale = softmax_scale
    request = None if aux_request is None else aux_request(lse=True)  # made once, a constant to dynamo

    def window(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)

    def capped(q, k, v, block_mask):
        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)

    def alibi(q, k, v, block_mask, slopes):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * torch.abs(q_idx - kv_idx)

        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)

    def sinks(q, k, v, block_mask, sink):
        if request is None:
            out, lse = flex_attention(q, k, v, block_mask=block_mask, scale=scale, return_lse=True)
        else:
            out, aux = flex_attention(q, k, v, block_mask=block_mask, scale=scale, return_aux=request)
            lse = aux.lse
        # the sink joins each row's denominator: out * sum / (sum + exp(sink)) = out * sigmoid(lse - sink)
        return (out * torch.sigmoid(lse - sink[None, :, None])[..., None]).to(out.dtype)

    return {"window": window, "softcap": capped, "alibi": alibi, "sinks": sinks}


class FlexEnv:
    """torch's flex_attention for the suite: one compiled function per variant, block masks per seqlen.

    ``torch.compile(fn, dynamic=False)`` is made once per variant and reused;
    dynamo compiles it again for each new shape (static shapes, as a model
    would run).  Block masks are made (eagerly) once per (mask, seqlen),
    outside the timed calls.
    """

    def __init__(self, torch, module, *, softmax_scale, compile_fn=None, device="cuda"):
        self.torch, self.device = torch, device
        self.create_block_mask = module.create_block_mask
        self.functions = flex_calls(torch, module.flex_attention, getattr(module, "AuxRequest", None),
                                    softmax_scale=softmax_scale)
        self.mask_mods = flex_mask_mods()
        self._compile = compile_fn or functools.partial(torch.compile, dynamic=False)
        self.compiled, self.masks = {}, {}

    def function(self, variant):
        if variant not in self.compiled:
            self.compiled[variant] = self._compile(self.functions[variant])
        return self.compiled[variant]

    def block_mask(self, variant, seqlen):
        key = (FLEX_MASKS[variant], seqlen)
        if key not in self.masks:
            self.masks[key] = self.create_block_mask(self.mask_mods[key[0]], None, None, seqlen, seqlen,
                                                     device=self.device)
        return self.masks[key]

    def params(self, variant, nheads):
        """The variant's parameter tensors: ALiBi's slopes; the sinks (a leaf that requires grad)."""
        torch = self.torch
        if variant == "alibi":
            return (torch.tensor(alibi_slopes(nheads), device=self.device),)
        if variant == "sinks":
            return (torch.tensor(sink_logits(nheads), device=self.device, requires_grad=True),)
        return ()

    def release(self):
        self.torch.cuda.empty_cache()


def flex_module(torch_env):
    """``(torch.nn.attention.flex_attention, None)``, or ``(None, why FlexAttention is not
    measured)``.  Turns off AOTAutograd's donated buffers, which refuse a backward run
    twice on one graph (``retain_graph=True``), as the timed backwards repeat."""
    if torch_env is None:
        return None, "torch not measured"
    torch = torch_env[0]
    try:
        module = importlib.import_module("torch.nn.attention.flex_attention")
    except Exception as e:  # noqa: BLE001 - an older torch
        return None, f"torch has no flex_attention ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    config = getattr(getattr(torch, "_functorch", None), "config", None)
    if config is not None and hasattr(config, "donated_buffer"):
        config.donated_buffer = False
    return module, None


def flex_env(torch_env, softmax_scale):
    """``(FlexEnv, None)``, or ``(None, why FlexAttention is not measured)``."""
    module, why = flex_module(torch_env)
    return (None, why) if module is None else (FlexEnv(torch_env[0], module, softmax_scale=softmax_scale), None)


class FlexVariant:
    """One variant through the compiled flex_attention, on (B, H, S, D) contiguous copies of the inputs.

    The forward is timed on inputs that require grad (the training forward,
    which also saves what the backward needs), so one compile serves both
    passes; the backward is ``torch.autograd.grad(out, leaves, dout,
    retain_graph=True)``, the leaves being q, k, v and, for sinks, the sinks.
    """

    name = "flex"
    passes = PASSES

    def __init__(self, env, cupy, variant, *, dtype, seqlen, nheads):
        self.env, self.torch, self.cupy, self.dtype = env, env.torch, cupy, dtype
        self.fn = env.function(variant)
        self.mask = env.block_mask(variant, seqlen)
        self.params = env.params(variant, nheads)

    def prepare(self, sets):
        torch, states = self.torch, []
        for s in sets:
            q, k, v, dout = (bench.torch_view(torch, self.cupy, x, self.dtype).transpose(1, 2).contiguous()
                             for x in s)
            leaves = tuple(x.requires_grad_() for x in (q, k, v))
            states.append((leaves + tuple(p for p in self.params if p.requires_grad), dout))
        return states

    def forward(self, state):
        return self.fn(*state[0][:3], self.mask, *self.params)

    def backward(self, state, out):
        leaves, dout = state
        return self.torch.autograd.grad(out, leaves, dout, retain_graph=True)

    def wait(self, result):
        self.torch.cuda.synchronize()

    def time_ms(self, fn, reps):
        return bench._torch_time_ms(fn, reps, self.torch)  # noqa: SLF001


# ----------------------------------------------------------------------------
# JAX: the window through cuDNN
# ----------------------------------------------------------------------------


class JaxWindow:
    """``jax.nn.dot_product_attention(is_causal=True, local_window_size=WINDOW, implementation="cudnn")``.

    Passes ``("fwd", "step")``: the jitted forward, and ``jit(grad)`` of
    ``sum(out * g)`` over q, k, v (a training step: forward and backward), on
    JAX arrays of the inputs' shape and dtype; wall clock over batches of steps
    (:func:`cupyflash._bench_suites.jax_time_ms`).  ``window`` and
    ``implementation`` are the suite's unless a test says otherwise.
    """

    name = "jax"
    passes = ("fwd", "step")

    def __init__(self, mods, *, dtype, softmax_scale, window=WINDOW, implementation="cudnn"):
        from . import _bench_suites  # noqa: PLC0415

        self.jax, self.jnp, _ = mods
        self._time = _bench_suites.jax_time_ms
        attention = functools.partial(self.jax.nn.dot_product_attention, scale=softmax_scale, is_causal=True,
                                      local_window_size=tuple(window), implementation=implementation)
        self.fwd = self.jax.jit(attention)
        self.step = _bench_suites.jax_grad_step(self.jax, self.jnp, attention)
        self.dtype = getattr(self.jnp, dtype)

    def prepare(self, sets):
        jax, shape = self.jax, tuple(sets[0][0].shape)
        keys = iter(jax.random.split(jax.random.key(0), 4 * len(sets)))
        return [tuple(jax.random.normal(next(keys), shape, self.dtype) for _ in range(4)) for _ in sets]

    def forward(self, state):
        return self.fwd(*state[:3])

    def backward(self, state, out):
        return self.step(*state)

    def wait(self, result):
        self.jax.block_until_ready(result)

    def time_ms(self, fn, reps):
        return self._time(self.jax, fn, [()], reps)


# ----------------------------------------------------------------------------
# Ratios and bars
# ----------------------------------------------------------------------------


def causal_bar(variant, seqlen):
    """``(quantity, limit, at_least)`` of the bar against plain causal, or None where none applies.

    quantity ``"tflops"`` is ours' TFLOP/s / causal's (window, must be >= limit),
    ``"time"`` ours' time / causal's (softcap, alibi, sinks, dropout, <= limit).
    """
    if variant == "window":
        return ("tflops", WINDOW_BAR, True) if seqlen in WINDOW_BAR_SEQLENS else None
    if variant in COST_BARS:
        return ("time", COST_BARS[variant], False)
    return None


def flex_bar(variant, seqlen):
    """FlexAttention's time / ours must be >= this (None where no bar applies)."""
    return FLEX_BAR if variant in FLEX_VARIANTS and seqlen in FLEX_BAR_SEQLENS else None


def check_status(value, limit, at_least, ours_ms) -> str:
    """PASS/FAIL of ``value`` against ``limit``; without a value: ours' marker ("n/impl", "OOM",
    "error") when ours was not measured, else "n/a" (the reference or the other side missing)."""
    if _number(value):
        return "PASS" if (value >= limit if at_least else value <= limit) else "FAIL"
    return ours_ms if ours_ms in (NOT_IMPLEMENTED, OOM, ERROR) else "n/a"


def point_status(bars) -> str:
    """A point's status from its bars' statuses: the worst of them, "-" when none applies."""
    judged = [b for b in bars if b != "-"]
    if not judged:
        return "-"
    return next(s for s in _WORST_FIRST if s in judged)


def _bar_text(variant, pas, quantity, limit, at_least, against):
    if against == "flex":
        return f"{variant} {pas}: flex time / ours >= {limit:g}"
    what = "TFLOP/s" if quantity == "tflops" else "time"
    return f"{variant} {pas}: {what} / causal's {'>=' if at_least else '<='} {limit:g}"


def _put(res, key, value):
    if value is not None:
        res[key] = value


def add_tflops(r) -> None:
    """``<impl>_<pass>_tflops`` (ours, flex): the visible-pair FLOPs over the time, where measured."""
    for pas in PASSES:
        for impl in ("ours", "flex"):
            _put(r, f"{impl}_{pas}_tflops", tflops(r[f"{pas}_flops"], r.get(f"{impl}_{pas}_ms")))


def add_ratios(r, ref) -> None:
    """A result's ratios, in place, where both sides were measured (``ref``: the causal result at its
    shape, with its TFLOP/s, or None).

    ``time_<pass>_vs_causal`` (ours' time / causal's) and ``tflops_<pass>_vs_causal``;
    ``ratio_<pass>_vs_flex`` (flex's time / ours); ``ours_step_ms`` (forward + backward),
    ``ratio_fwd_vs_jax`` and ``ratio_step_vs_jax`` (JAX's time / ours').
    """
    for pas in PASSES:
        if ref is not None and ref is not r:
            _put(r, f"time_{pas}_vs_causal", ratio(r.get(f"ours_{pas}_ms"), ref.get(f"ours_{pas}_ms")))
            _put(r, f"tflops_{pas}_vs_causal", ratio(r.get(f"ours_{pas}_tflops"), ref.get(f"ours_{pas}_tflops")))
        _put(r, f"ratio_{pas}_vs_flex", ratio(r.get(f"flex_{pas}_ms"), r.get(f"ours_{pas}_ms")))
    if _number(r.get("ours_fwd_ms")) and _number(r.get("ours_bwd_ms")):
        r["ours_step_ms"] = r["ours_fwd_ms"] + r["ours_bwd_ms"]
    for pas in ("fwd", "step"):
        _put(r, f"ratio_{pas}_vs_jax", ratio(r.get(f"jax_{pas}_ms"), r.get(f"ours_{pas}_ms")))


def judge_bars(r) -> list[dict]:
    """A result's bars, in place: ``bar_<pass>_causal`` and ``bar_<pass>_flex`` (PASS, FAIL, "n/a",
    "n/impl", "OOM", "error", or "-" where no bar applies) and ``status`` (:func:`point_status`);
    returns its checks (see :func:`judge_variants`)."""
    checks = []
    for pas in PASSES:
        limit = flex_bar(r["variant"], r["seqlen"])
        rules = (("causal", causal_bar(r["variant"], r["seqlen"])),
                 ("flex", None if limit is None else ("ratio", limit, True)))
        for against, rule in rules:
            if rule is None:
                r[f"bar_{pas}_{against}"] = "-"
                continue
            quantity, limit, at_least = rule
            value = r.get(f"ratio_{pas}_vs_flex" if against == "flex" else f"{quantity}_{pas}_vs_causal")
            status = r[f"bar_{pas}_{against}"] = check_status(value, limit, at_least, r.get(f"ours_{pas}_ms"))
            checks.append({"bar": _bar_text(r["variant"], pas, quantity, limit, at_least, against),
                           "against": against, "variant": r["variant"], "dtype": r["dtype"], "seqlen": r["seqlen"],
                           "pass": pas, "value": value, "limit": limit, "status": status})
    r["status"] = point_status([c["status"] for c in checks])
    return checks


def judge_variants(results) -> list[dict]:
    """TFLOP/s (:func:`add_tflops`), ratios (:func:`add_ratios`, against the causal result of the
    same dtype and seqlen), bars and statuses (:func:`judge_bars`) of every result, in place; returns the bar checks.

    Returns
    -------
    list of dict
        One per bar judged: ``bar`` (its rule as text), ``against`` ("causal"
        or "flex"), ``variant``, ``dtype``, ``seqlen``, ``pass``, ``value``
        (the ratio, None when not measured), ``limit`` and ``status``.
    """
    for r in results:
        add_tflops(r)
    refs = {(r["dtype"], r["seqlen"]): r for r in results if r["variant"] == REFERENCE}
    checks = []
    for r in results:
        add_ratios(r, refs.get((r["dtype"], r["seqlen"])))
        checks += judge_bars(r)
    return checks


def count_checks(checks) -> dict[str, int]:
    """How many bar checks are in each status (:data:`STATUS_ORDER`, those that occur)."""
    counts = collections.Counter(c["status"] for c in checks)
    return {s: counts[s] for s in STATUS_ORDER if counts[s]}


def not_implemented_note(results):
    """One note naming the variants (and passes) ours does not implement yet, or None."""
    missing = []
    for r in results:
        passes = [p for p in PASSES if r.get(f"ours_{p}_ms") == NOT_IMPLEMENTED]
        label = r["variant"] if len(passes) == len(PASSES) else f"{r['variant']} ({', '.join(passes)})"
        if passes and label not in missing:
            missing.append(label)
    if not missing:
        return None
    first = next(r["ours_note"] for r in results if "ours_note" in r)
    return f"ours: not implemented on the GPU yet for {', '.join(missing)} ({first})"


_NOTE_PREFIX = "ours: not implemented on the GPU yet"


def judge_report(report) -> None:
    """Judge every result, and update ``bar_checks``, ``bars`` and the not-implemented note."""
    checks = judge_variants(report["results"])
    report["bar_checks"], report["bars"] = checks, count_checks(checks)
    report["notes"] = [n for n in report["notes"] if not n.startswith(_NOTE_PREFIX)]
    note = not_implemented_note(report["results"])
    if note:
        report["notes"].append(note)


# ----------------------------------------------------------------------------
# The suite
# ----------------------------------------------------------------------------


def variant_result(name, *, dtype, seqlen, batch, nheads, head_dim, input_sets) -> dict:
    """A result's fixed fields: the point, its options, its visible pairs and FLOPs."""
    options = VARIANTS[name]
    pairs = visible_pairs(seqlen, seqlen, options["causal"], options.get("window_size", (-1, -1)))
    res = {"variant": name, "dtype": dtype, "seqlen": seqlen, "batch": batch, "nheads": nheads,
           "head_dim": head_dim, "causal": options["causal"], "options": describe(name), "visible_pairs": pairs,
           "fwd_flops": variant_flops(batch, nheads, head_dim, pairs),
           "bwd_flops": variant_flops(batch, nheads, head_dim, pairs, bwd=True), "input_sets": input_sets}
    if name == "dropout":
        res["flex_note"] = "FlexAttention has no dropout"
    return res


def _progress(report, save, res, impl):
    judge_report(report)
    save()
    times = ", ".join(f"{p} {cell(res.get(f'{impl}_{p}_ms'), 0, '.3f')} ms"
                      for p in (("fwd", "step") if impl == "jax" else PASSES))
    print(f"variants {res['dtype']} S={res['seqlen']} {res['variant']}: {impl} {times}", file=sys.stderr,
          flush=True)


def variants_shape(cupy, flex, jax_mods, report, save, *, dtype, seqlen, names, reps):
    """Every variant at one (dtype, seqlen): ours, then JAX (window), then FlexAttention, whose
    compiles take the longest (so a run cut short keeps the rest)."""
    cfg = VARIANT_CONFIG
    head_dim, nheads = cfg["head_dim"], cfg["nheads"]
    batch = max(1, cfg["tokens"] // seqlen)
    shape = (batch, seqlen, nheads, head_dim)
    scale = head_dim ** -0.5
    count = bench.rotation_count(bench.set_bytes(shape))
    sets = bench.input_sets(cupy, shape, dtype, count)
    rows = {}
    for name in names:
        res = rows[name] = variant_result(name, dtype=dtype, seqlen=seqlen, batch=batch, nheads=nheads,
                                          head_dim=head_dim, input_sets=count)
        report["results"].append(res)
        try:
            impl = OursVariant(cupy, dtype=dtype, softmax_scale=scale, kwargs=ours_kwargs(cupy, name, nheads))
            measure_passes(impl, sets, res, reps)
        except Exception as e:  # noqa: BLE001 - the variant's arrays could not be made
            _mark(res, "ours", [f"ours_{p}_ms" for p in PASSES], e)
        _progress(report, save, res, "ours")
        cupy.get_default_memory_pool().free_all_blocks()
    if jax_mods is not None and "window" in rows:
        res = rows["window"]
        try:
            measure_passes(JaxWindow(jax_mods, dtype=dtype, softmax_scale=scale), sets, res, reps)
        except Exception as e:  # noqa: BLE001 - e.g. a cuDNN without sliding windows
            mark_failed(res, "jax", ["jax_fwd_ms", "jax_step_ms"], e)
        _progress(report, save, res, "jax")
    if flex is not None:
        for name in (n for n in names if n in FLEX_VARIANTS):
            res = rows[name]
            try:
                measure_passes(FlexVariant(flex, cupy, name, dtype=dtype, seqlen=seqlen, nheads=nheads),
                               sets, res, reps)
            except Exception as e:  # noqa: BLE001 - the block mask or the compile failed
                mark_failed(res, "flex", [f"flex_{p}_ms" for p in PASSES], e)
            _progress(report, save, res, "flex")
            flex.release()
    del sets
    cupy.get_default_memory_pool().free_all_blocks()


def bar_rules() -> dict[str, str]:
    """The bars as text (the report's ``config["bars"]``)."""
    seqs = " and ".join(str(s) for s in FLEX_BAR_SEQLENS)
    return {"window": f"window TFLOP/s (visible pairs) >= {WINDOW_BAR:g} x causal's at seqlen "
                      + " and ".join(str(s) for s in WINDOW_BAR_SEQLENS),
            "cost": ", ".join(f"{n} time <= {limit:g} x causal's" for n, limit in COST_BARS.items()),
            "flex": f"FlexAttention time >= {FLEX_BAR:g} x ours for {', '.join(FLEX_VARIANTS)} at seqlen {seqs}"}


def run_variants(cupy, args, report, save):
    """``--suite variants``: ours, FlexAttention and (window) JAX per variant, dtype and seqlen.

    ``--variant`` picks the variants (causal, the bars' reference, always runs),
    ``--seqlen`` and ``--dtype`` the shapes; ``--no-torch`` and ``--no-jax``
    drop FlexAttention and JAX.
    """
    cfg = VARIANT_CONFIG
    names = selected_variants(args.variant)
    seqlens = args.seqlen or list(VARIANT_SEQLENS)
    dtypes = args.dtype or list(VARIANT_DTYPES)
    scale = cfg["head_dim"] ** -0.5
    flex, jax_mods = None, None
    if any(n in FLEX_VARIANTS for n in names):
        env, why = (None, "--no-torch") if args.no_torch else bench.torch_env()
        if env is not None:
            flex, why = flex_env(env, scale)
        if flex is None:
            report["notes"].append(f"FlexAttention columns skipped: {why}")
    if "window" in names:
        from . import _bench_suites  # noqa: PLC0415

        jax_mods, why = (None, "--no-jax") if args.no_jax else _bench_suites.jax_env()
        if jax_mods is None:
            report["notes"].append(f"JAX window column skipped: {why}")
    report.update(config={
        **cfg, "seqlens": list(seqlens), "dtypes": list(dtypes), "softmax_scale": scale,
        "variants": {n: describe(n) for n in names},
        "flops": "4 * batch * nheads * head_dim * visible (query, key) pairs, x2.5 for the backward "
                 "(causal: seqlen * (seqlen + 1) / 2 pairs)",
        "flex": {n: FLEX_EXPRESSIONS[n] for n in names if n in FLEX_EXPRESSIONS},
        "flex_compile": "torch.compile(fn, dynamic=False) once per variant (compiled again per shape); the "
                        "forward timed on inputs that require grad, so one compile serves both passes; "
                        "inputs as contiguous (batch, nheads, seqlen, head_dim) copies",
        "jax": f"jax.nn.dot_product_attention(is_causal=True, local_window_size={WINDOW}, "
               f"implementation='cudnn'): jit forward, and jit(grad) of sum(out * g) as the step, beside "
               f"ours' forward + backward; wall clock over batches of steps",
        "bars": bar_rules()},
        impls=["ours"] + (["flex"] if flex else []) + (["jax"] if jax_mods else []), variants=names,
        bar_checks=[], bars={})
    for dtype in dtypes:
        for seqlen in seqlens:
            variants_shape(cupy, flex, jax_mods, report, save, dtype=dtype, seqlen=seqlen, names=names,
                           reps=args.reps)
    judge_report(report)


_SHORT_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


def _vs_causal(r, pas):
    """The quantity of a row's bar against causal: TFLOP/s ratio for the window, else the time ratio."""
    return r.get(f"{'tflops' if r['variant'] == 'window' else 'time'}_{pas}_vs_causal")


def format_variants_table(report) -> str:
    """One row per (variant, seqlen, dtype): ours, the ratio against causal, flex; then JAX; the bars."""
    cfg, rows = report["config"], report["results"]
    costs = ", ".join(f"{n} <= {limit:g}" for n, limit in COST_BARS.items())
    lines = [f"variants: head_dim {cfg['head_dim']}, nheads {cfg['nheads']}, batch * seqlen {cfg['tokens']}; "
             f"ms per call; TF = TFLOP/s on the visible pairs (4*B*H*D*pairs, x2.5 bwd)",
             f"vs c: window's TFLOP/s / causal's (bar >= {WINDOW_BAR:g} at seqlen "
             + ", ".join(str(s) for s in WINDOW_BAR_SEQLENS) + f"), the others' time / causal's (bars {costs})",
             f"x flex: FlexAttention's time / ours (bar >= {FLEX_BAR:g} for {', '.join(FLEX_VARIANTS)} at seqlen "
             + ", ".join(str(s) for s in FLEX_BAR_SEQLENS) + f"); {NOT_IMPLEMENTED} = not implemented on the GPU yet",
             f"{'variant':<8}{'seqlen':>7} {'dtype':<5}{'pairs M':>9} |"
             + "".join(f"{pas + ' ms':>9}{'TF':>6}{'vs c':>6}{'flex ms':>9}{'x flex':>7} |" for pas in PASSES)
             + f"{'c fwd':>6}{'bwd':>5} |{'f fwd':>6}{'bwd':>5} | status  (bars: c vs causal, f vs flex)"]
    for r in rows:
        lines.append(
            f"{r['variant']:<8}{r['seqlen']:>7} {_SHORT_DTYPES.get(r['dtype'], r['dtype']):<5}"
            f"{r['visible_pairs'] / 1e6:9.1f} |"
            + "".join(cell(r.get(f"ours_{pas}_ms"), 9, ".3f") + cell(r.get(f"ours_{pas}_tflops"), 6, ".0f")
                      + cell(_vs_causal(r, pas), 6, ".2f") + cell(r.get(f"flex_{pas}_ms"), 9, ".3f")
                      + cell(r.get(f"ratio_{pas}_vs_flex"), 7, ".2f") + " |" for pas in PASSES)
            + cell(r.get("bar_fwd_causal"), 6, "") + cell(r.get("bar_bwd_causal"), 5, "") + " |"
            + cell(r.get("bar_fwd_flex"), 6, "") + cell(r.get("bar_bwd_flex"), 5, "") + f" | {r.get('status', '-')}")
    jax_rows = [r for r in rows if "jax_fwd_ms" in r]
    if jax_rows:
        lines += ["", f"window {WINDOW} beside jax.nn.dot_product_attention(implementation='cudnn'): ms; "
                      "step = forward + backward (JAX: jit(grad) of sum(out * g)); x jax = JAX's time / ours",
                  f"{'seqlen':>7} {'dtype':<5}| fwd{'ours':>8}{'jax':>8}{'x jax':>7} | step{'ours':>8}{'jax':>8}"
                  f"{'x jax':>7}"]
        for r in jax_rows:
            lines.append(f"{r['seqlen']:>7} {_SHORT_DTYPES.get(r['dtype'], r['dtype']):<5}|   "
                         + cell(r.get("ours_fwd_ms"), 8, ".3f") + cell(r.get("jax_fwd_ms"), 8, ".3f")
                         + cell(r.get("ratio_fwd_vs_jax"), 7, ".2f") + " |    "
                         + cell(r.get("ours_step_ms"), 8, ".3f") + cell(r.get("jax_step_ms"), 8, ".3f")
                         + cell(r.get("ratio_step_vs_jax"), 7, ".2f"))
    bars = report.get("bars") or {}
    lines.append("bars: " + (", ".join(f"{n} {s}" for s, n in bars.items()) if bars else "none judged"))
    return "\n".join(lines)


def plot_variants(report, path):
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = report["results"]
    fig, axes = plt.subplots(1, len(PASSES), figsize=(max(6, len(rows) * 0.8), 4), squeeze=False)
    labels = [f"{r['variant']}\n{r['seqlen']}" for r in rows]
    for ax, pas in zip(axes[0], PASSES):
        for j, impl in enumerate(("ours", "flex")):
            values = [r.get(f"{impl}_{pas}_tflops") or 0 for r in rows]
            ax.bar([i + 0.4 * j for i in range(len(rows))], values, 0.4, label=impl)
        ax.set_xticks([i + 0.2 for i in range(len(rows))], labels, fontsize=7)
        ax.set(ylabel=f"{pas} TFLOP/s (visible pairs)", title=f"variants {pas}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


SUITE = (run_variants, format_variants_table, plot_variants)
