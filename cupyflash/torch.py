"""cupyflash inside PyTorch: autograd, ``torch.compile`` and flash-attention's API.

:func:`flash_attn_func` takes the arguments of flash-attention's function of
the same name, in the (batch, seqlen, nheads, head_dim) layout, and is
differentiable.  It is built on two custom operators,

* ``torch.ops.cupyflash.flash_attn(q, k, v, softmax_scale, causal,
  deterministic) -> (out, lse)``, differentiable in q, k and v, and
* ``torch.ops.cupyflash.flash_attn_bwd(dout, q, k, v, out, lse,
  softmax_scale, causal, deterministic) -> (dq, dk, dv)``,

registered with ``torch.library.custom_op`` together with their shapes
(``register_fake``), so ``torch.compile(..., fullgraph=True)`` keeps them in
the graph as opaque nodes instead of breaking it.  The attention variants
(window, softcap, ALiBi, sinks, dropout, and issue 14's additive bias and
boolean mask) have a pair of their own, ``torch.ops.cupyflash.flash_attn_variant``
(differentiable in q, k, v, sinks and attn_bias) and
``torch.ops.cupyflash.flash_attn_variant_bwd`` (which also returns dsinks and
dbias), whose schema holds every variant.  In eager mode
:func:`flash_attn_func` runs :class:`FlashAttnFunc` (with a variant on,
:class:`FlashAttnVariantFunc`), a plain
``torch.autograd.Function`` over the same kernels (identical results): the
custom-op dispatch costs tens of microseconds per call that eager mode does
not need.  Outputs and scratch memory come from torch's caching allocator, and
nothing synchronises the host, so ``torch.cuda.graph`` captures a training
step through :func:`flash_attn_func` (warm up once first: the first call of
each shape compiles its kernels).

CUDA tensors run the GPU kernels on ``torch.cuda.current_stream()``, reading and
writing torch's memory in place (through DLPack); CPU tensors run cupyflash's
tiled CPU path.  dtypes: float16 and bfloat16 on the GPU; float16, bfloat16,
float32 and float64 on the CPU.

:func:`flash_attn_with_kvcache` is flash-attention's function of that name
(decoding against a KV cache, the new keys and values appended into the
caller's cache tensors in place).  It has no backward, as in flash-attention.
In eager mode it calls :func:`cupyflash.flash_attn_with_kvcache` directly;
under ``torch.compile`` it is the custom operator
``torch.ops.cupyflash.flash_attn_with_kvcache``, registered with
``mutates_args=("k_cache", "v_cache")``.

Importing this module imports torch; importing ``cupyflash`` does not.

Examples
--------
>>> import torch
>>> from cupyflash.torch import flash_attn_func
>>> q = torch.randn(2, 128, 8, 64, dtype=torch.float16, device="cuda", requires_grad=True)
>>> k = torch.randn(2, 128, 2, 64, dtype=torch.float16, device="cuda", requires_grad=True)
>>> v = torch.randn_like(k, requires_grad=True)
>>> flash_attn_func(q, k, v, causal=True).sum().backward()   # doctest: +SKIP
"""

import numbers

import numpy as np
import torch

from . import _api, _checks, _kvcache, _torch_path

__all__ = ["FlashAttnFunc", "FlashAttnVariantFunc", "flash_attn_func", "flash_attn_with_kvcache"]


def _check_tensors(fn, named, optional=()):
    """Each of ``named`` (``(name, value)`` pairs) is a torch tensor; those in ``optional``
    may also be None.  The core checks the rest (shape, dtype, device)."""
    for name, x in named:
        if isinstance(x, torch.Tensor) or (x is None and name in optional):
            continue
        rule = "None or a torch.Tensor" if name in optional else "a torch.Tensor"
        _checks.fail(TypeError, fn, f"{name} must be {rule}; got {_checks._type_name(x)}.")  # noqa: SLF001


def _unit_last_stride(x):
    """``x`` itself when its last stride is 1 element, else a contiguous copy (as flash-attn)."""
    return x if x.dim() == 0 or x.stride(-1) == 1 else x.contiguous()


# ----------------------------------------------------------------------------
# Custom operators
# ----------------------------------------------------------------------------


@torch.library.custom_op(
    "cupyflash::flash_attn", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
           "bool deterministic) -> (Tensor, Tensor)")
def _flash_attn_op(q, k, v, softmax_scale, causal, deterministic):
    # deterministic is used by the backward only; it is an input so autograd sees it.
    out, lse = _api.flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)
    return out, lse


@_flash_attn_op.register_fake
def _flash_attn_fake(q, k, v, softmax_scale, causal, deterministic):
    batch, seqlen_q, nheads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads_q, seqlen_q), dtype=torch.float32)


@torch.library.custom_op(
    "cupyflash::flash_attn_bwd", mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
           "float softmax_scale, bool causal, bool deterministic) -> (Tensor, Tensor, Tensor)")
def _flash_attn_bwd_op(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    dq, dk, dv = _api.flash_attn_bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                                     causal=causal, deterministic=deterministic)
    return dq, dk, dv


@_flash_attn_bwd_op.register_fake
def _flash_attn_bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.cupyflash.flash_attn_bwd(
        _unit_last_stride(dout), q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
        ctx.deterministic)
    return dq, dk, dv, None, None, None


_flash_attn_op.register_autograd(_backward, setup_context=_setup_context)


# The attention variants (issues 13 and 14): one more pair of operators, whose schema
# holds every variant (window as two ints, the dropout state as two ints), so the plain
# operators above keep their schema.  The bias and the mask (issue 14) come last, with
# defaults, so calls written for issue 13's schema still work.  dsinks and dbias are
# empty tensors when not asked for (an operator returns no None).

_VARIANT_SCHEMA = ("Tensor? alibi_slopes, Tensor? sinks, float softmax_scale, bool causal, "
                   "bool deterministic, int window_left, int window_right, float softcap, "
                   "float dropout_p, int seed, int offset")
_SCORE_SCHEMA = "Tensor? attn_bias=None, Tensor? attn_mask=None"
#: The number of flags (floats, bools, ints) after sinks, and where the bias sits in
#: the inputs of ``flash_attn_variant`` (for its autograd).
_N_FLAGS = 9
_BIAS_INPUT = 5 + _N_FLAGS


def _variant_kwargs(alibi_slopes, sinks, window_left, window_right, softcap, dropout_p, seed, offset,
                    attn_bias=None, attn_mask=None):
    """The core's keyword arguments for the operators' variant arguments."""
    return dict(window_size=(int(window_left), int(window_right)), softcap=float(softcap),
                alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=float(dropout_p),
                rng_state=(int(seed) & _MASK64, int(offset)) if dropout_p > 0 else None,
                attn_bias=attn_bias, attn_mask=attn_mask)


@torch.library.custom_op(
    "cupyflash::flash_attn_variant", mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_VARIANT_SCHEMA}, {_SCORE_SCHEMA}) -> (Tensor, Tensor)")
def _flash_attn_variant_op(q, k, v, alibi_slopes, sinks, softmax_scale, causal, deterministic,
                           window_left, window_right, softcap, dropout_p, seed, offset, attn_bias=None,
                           attn_mask=None):
    out, lse = _api.flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal, **_variant_kwargs(
        alibi_slopes, sinks, window_left, window_right, softcap, dropout_p, seed, offset, attn_bias, attn_mask))
    return out, lse


@_flash_attn_variant_op.register_fake
def _flash_attn_variant_fake(q, k, v, *_):
    batch, seqlen_q, nheads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads_q, seqlen_q), dtype=torch.float32)


@torch.library.custom_op(
    "cupyflash::flash_attn_variant_bwd", mutates_args=(),
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_VARIANT_SCHEMA}, "
           f"{_SCORE_SCHEMA}, bool return_dbias=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _flash_attn_variant_bwd_op(dout, q, k, v, out, lse, alibi_slopes, sinks, softmax_scale, causal,
                               deterministic, window_left, window_right, softcap, dropout_p, seed, offset,
                               attn_bias=None, attn_mask=None, return_dbias=False):
    grads = _api.flash_attn_bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                deterministic=deterministic, return_dbias=bool(return_dbias), **_variant_kwargs(
                                    alibi_slopes, sinks, window_left, window_right, softcap, dropout_p,
                                    seed, offset, attn_bias, attn_mask))
    dsinks = grads[3] if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    # dbias in the bias's shape and dtype, contiguous (as the fake says)
    dbias = grads[-1].contiguous() if return_dbias else q.new_empty((0,))
    return grads[0], grads[1], grads[2], dsinks, dbias


@_flash_attn_variant_bwd_op.register_fake
def _flash_attn_variant_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, sinks, softmax_scale, causal,
                                 deterministic, window_left, window_right, softcap, dropout_p, seed, offset,
                                 attn_bias=None, attn_mask=None, return_dbias=False):
    dsinks = q.new_empty((0,) if sinks is None else (q.shape[2],), dtype=torch.float32)
    dbias = attn_bias.new_empty(attn_bias.shape) if return_dbias else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks, dbias


def _variant_setup_context(ctx, inputs, output):
    q, k, v, alibi_slopes, sinks = inputs[:5]
    flags = inputs[5:_BIAS_INPUT]
    attn_bias, attn_mask = (tuple(inputs[_BIAS_INPUT:_BIAS_INPUT + 2]) + (None, None))[:2]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks, attn_bias, attn_mask)
    ctx.flags, ctx.n_inputs = flags, len(inputs)
    ctx.mark_non_differentiable(lse)


def _variant_backward(ctx, dout, _dlse):
    q, k, v, out, lse, alibi_slopes, sinks, attn_bias, attn_mask = ctx.saved_tensors
    needs = ctx.needs_input_grad
    return_dbias = attn_bias is not None and len(needs) > _BIAS_INPUT and bool(needs[_BIAS_INPUT])
    dq, dk, dv, dsinks, dbias = torch.ops.cupyflash.flash_attn_variant_bwd(
        _unit_last_stride(dout), q, k, v, out, lse, alibi_slopes, sinks, *ctx.flags, attn_bias, attn_mask,
        return_dbias)
    grads = (dq, dk, dv, None, dsinks if sinks is not None else None) + (None,) * len(ctx.flags)
    grads += (dbias if return_dbias else None, None)
    return grads[:ctx.n_inputs]


_flash_attn_variant_op.register_autograd(_variant_backward, setup_context=_variant_setup_context)


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------


class FlashAttnFunc(torch.autograd.Function):
    """``out = FlashAttnFunc.apply(q, k, v, softmax_scale, causal, deterministic)``.

    The autograd.Function form of :func:`flash_attn_func` (all six arguments
    required, ``softmax_scale`` a float), which eager mode runs: it calls the
    kernels directly (cupyflash's lean torch path), without the custom-op
    dispatch.  Saves q, k, v and out for the backward (``save_for_backward``:
    saved-tensor hooks see them), and keeps lse, which it made and does not
    return; the attention matrix is never stored.
    """

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic):
        out, ctx.lse, ctx.backward_plans = _torch_path.fwd(q, k, v, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out)
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = _torch_path.bwd(ctx.backward_plans, _unit_last_stride(dout), q, k, v, out, ctx.lse,
                                     ctx.softmax_scale, ctx.causal, ctx.deterministic)
        return dq, dk, dv, None, None, None


class FlashAttnVariantFunc(torch.autograd.Function):
    """``out = FlashAttnVariantFunc.apply(q, k, v, alibi_slopes, sinks, softmax_scale, causal,
    deterministic, window_size, softcap, dropout_p, rng_state[, attn_bias, attn_mask])``.

    The autograd.Function that eager :func:`flash_attn_func` runs when an
    attention variant is on (the first twelve arguments required;
    ``alibi_slopes`` and ``sinks`` may be None, ``rng_state`` is a ``(seed,
    offset)`` pair, or None (without dropout; with dropout, a state drawn by
    :func:`cupyflash.flash_attn_fwd` from cupyflash's generator and kept for
    the backward); ``attn_bias`` and ``attn_mask``
    default to None).  Differentiable in q, k, v, sinks (dsinks from
    :func:`cupyflash.flash_attn_bwd`) and attn_bias (dbias, asked of the
    backward only when the bias requires grad); alibi_slopes are constants
    and the mask is bool.  Saves q, k, v, out, lse, the slopes, the sinks,
    the bias and the mask (references, not copies); the backward is given the
    forward's variants, the dropout state included, so it draws the same mask.
    """

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, sinks, softmax_scale, causal, deterministic, window_size,
                softcap, dropout_p, rng_state, attn_bias=None, attn_mask=None):
        variants = dict(window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                        rng_state=rng_state if dropout_p > 0 else None)
        # the state used (rng_state None with dropout: the core draws one) is the backward's
        out, lse, variants["rng_state"] = _api.flash_attn_fwd(
            q, k, v, softmax_scale=softmax_scale, causal=causal, alibi_slopes=alibi_slopes, sinks=sinks,
            attn_bias=attn_bias, attn_mask=attn_mask, return_rng_state=True, **variants)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks, attn_bias, attn_mask)
        ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.variants = (
            softmax_scale, causal, deterministic, variants)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, alibi_slopes, sinks, attn_bias, attn_mask = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return_dbias = attn_bias is not None and len(needs) > 12 and bool(needs[12])
        grads = _api.flash_attn_bwd(_unit_last_stride(dout), q, k, v, out, lse,
                                    softmax_scale=ctx.softmax_scale, causal=ctx.causal,
                                    deterministic=ctx.deterministic, alibi_slopes=alibi_slopes,
                                    sinks=sinks, attn_bias=attn_bias, attn_mask=attn_mask,
                                    return_dbias=return_dbias, **ctx.variants)
        dsinks = grads[3] if sinks is not None else None
        dbias = grads[-1] if return_dbias else None
        # (Nones past the inputs given are dropped by autograd)
        return (grads[0], grads[1], grads[2], None, dsinks) + (None,) * 7 + (dbias, None)


def _unsupported(option, rule, value, fn="flash_attn_func"):
    raise NotImplementedError(
        f"cupyflash.torch.{fn}: {option} must be {rule} ({option} is not "
        f"implemented); got {value!r}.")


_NO_DROPOUT, _NO_WINDOW, _NO_SOFTCAP = _api._NO_DROPOUT, _api._NO_WINDOW, _api._NO_SOFTCAP  # noqa: SLF001
_FN = "torch.flash_attn_func"
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_RNG_SPEC = np.zeros((1, 1, 1, 1), np.float32)  # a q for checking rng_state alone


def flash_attn_func(q, k, v, dropout_p=_NO_DROPOUT, softmax_scale=None, causal=False,
                    window_size=_NO_WINDOW, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, softcap=_NO_SOFTCAP, sinks=None, rng_state=None,
                    generator=None, attn_bias=None, attn_mask=None):
    """Exact attention for torch tensors, differentiable; flash-attention's signature.

    Parameters
    ----------
    q : torch.Tensor, shape (batch, seqlen_q, nheads_q, head_dim)
        float16 or bfloat16 on a CUDA device (float16, bfloat16, float32 or
        float64 on the CPU).  A last stride other than 1 is made contiguous
        first (a copy); any other strides are read in place.
    k, v : torch.Tensor, shape (batch, seqlen_k, nheads_kv, head_dim)
        Same dtype and device as q; ``nheads_q`` a multiple of ``nheads_kv``
        (GQA/MQA, never expanded in memory).
    dropout_p : float
        Dropout probability in [0, 1) (0: off).  Each attention probability
        is kept with probability ``1 - dropout_p`` and scaled by
        ``1 / (1 - dropout_p)``; the keep mask comes from cupyflash's Philox
        generator at ``rng_state`` (see below), and the backward uses the
        same mask.  As in flash-attention, pass 0.0 at evaluation time.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool
        Causal mask aligned bottom-right (see :func:`cupyflash.flash_attn_fwd`).
    window_size : (int, int)
        Sliding window ``(left, right)``, -1 for unbounded: query ``i`` sees
        key ``j`` iff ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k -
        seqlen_q + right``.  Combines with ``causal`` (which sets right to 0).
    alibi_slopes : torch.Tensor, shape (nheads_q,) or (batch, nheads_q), float32, optional
        ALiBi: adds ``-slope * |i + seqlen_k - seqlen_q - j|`` to the scores
        (after the softcap).  On q's device.  A constant: no gradient flows to
        it (flash-attention does not differentiate the slopes either), even
        when it requires grad.
    deterministic : bool
        Bitwise reproducible backward (slower; see :func:`cupyflash.flash_attn_bwd`).
    return_attn_probs : bool
        Must be False (cupyflash never forms the attention matrix).
    softcap : float, keyword-only
        Logit softcapping (0: off): scores ``s`` become ``softcap * tanh(s /
        softcap)``; differentiated through.
    sinks : torch.Tensor, shape (nheads_q,), float32, keyword-only, optional
        Attention sinks: a logit per head that joins every row's softmax
        denominator with no value.  On q's device.  Differentiable: a
        ``sinks`` that requires grad gets ``.grad`` (dsinks, summed over the
        batch and the rows).
    rng_state : (int, int), keyword-only, optional
        The dropout state ``(seed, offset)``: a 64-bit seed and a 32-bit
        offset (see :func:`cupyflash.flash_attn_fwd`).  Default: drawn from
        torch's generator, as below.  Ignored without dropout.
    generator : torch.Generator, keyword-only, optional
        The generator to draw ``rng_state`` from when it is not given; default
        torch's default generator of q's device.
    attn_bias : torch.Tensor, keyword-only, optional
        An additive bias on the scores, broadcastable to ``(batch, nheads_q,
        seqlen_q, seqlen_k)`` by torch's rules: rank at most 4, each dimension
        (left-padded with 1s) 1 or full; e.g. ``(1, nheads_q, seqlen_q,
        seqlen_k)``, ``(batch, 1, 1, seqlen_k)`` or ``(seqlen_q, seqlen_k)``.
        On q's device, dtype q's or float32.  Any strides, read in place: an
        ``expand()``ed (stride-0) or sliced bias is never copied.  Added after
        the softcap and ALiBi; a ``-inf`` entry hides the key from the row
        (see :func:`cupyflash.flash_attn_fwd`).  Differentiable: a bias that
        requires grad gets its gradient (``dS`` summed over the dimensions it
        broadcasts, in its own shape and dtype, accumulated in float32); one
        that does not costs no bias gradient.  The gradient of an
        ``expand()``ed view is full-size (autograd's rule for a view), which
        ``expand``'s backward then sums: to keep the gradient small, pass the
        small tensor itself, whose size-1 dimensions broadcast.
    attn_mask : torch.Tensor of bool, keyword-only, optional
        A keep-mask broadcastable like ``attn_bias`` (True attends; the
        convention of ``torch.nn.functional.scaled_dot_product_attention``'s
        bool ``attn_mask``), on q's device, any strides.  A float mask belongs
        in ``attn_bias``.  Not differentiable.  A row that sees no key gets
        output 0 and zero gradients.

    Returns
    -------
    out : torch.Tensor, shape (batch, seqlen_q, nheads_q, head_dim), dtype of q

    Raises
    ------
    NotImplementedError
        ``return_attn_probs=True``; under ``torch.compile``, dropout without
        an explicit ``rng_state``.
    TypeError, ValueError
        As :func:`cupyflash.flash_attn_fwd` for the tensors and the variants
        (``attn_bias``/``attn_mask`` that are not torch tensors are named here).

    Notes
    -----
    Without any variant on (the defaults, ``attn_bias=None`` and
    ``attn_mask=None`` included) the call is exactly the plain one:
    :class:`FlashAttnFunc` in eager mode, ``cupyflash::flash_attn`` under
    ``torch.compile``.  With a variant on it runs :class:`FlashAttnVariantFunc`
    in eager mode (through the general DLPack path of the core functions, a
    few microseconds more per call) and the custom operators
    ``cupyflash::flash_attn_variant`` / ``cupyflash::flash_attn_variant_bwd``
    under ``torch.compile``, whose schema holds every variant.

    **Dropout's random state** follows flash-attention's convention: with no
    ``rng_state`` the forward takes a ``(seed, offset)`` from torch's
    generator and advances it, and the autograd context keeps it for the
    backward.  On a CUDA device that is ``torch.cuda.default_generators[i]``
    (or ``generator``), read and advanced on the host (``get_state`` /
    ``set_state``, no synchronisation): the seed is the generator's seed
    (``torch.cuda.manual_seed``'s value) and the offset is its Philox offset,
    which advances by 4, as one of torch's random ops would; cupyflash's
    32-bit offset is that offset / 4 (the bits above 32 are folded into the
    seed).  So ``torch.cuda.manual_seed(s)`` makes a run's masks
    reproducible, and successive calls draw different masks.  On the CPU the
    seed is drawn with ``torch.randint`` from ``torch.default_generator`` (or
    ``generator``), offset 0.  Under ``torch.compile``, or inside a CUDA graph
    capture (where a host-side state would be baked into every replay), pass
    ``rng_state`` explicitly.
    """
    _check_tensors(_FN, (("q", q), ("k", k), ("v", v)))
    # the core's rules, before the operators' float()/bool() (bool("False") is True)
    _checks.check_flags(_FN, softmax_scale, 1, causal, deterministic)
    if (dropout_p is not _NO_DROPOUT or window_size is not _NO_WINDOW or alibi_slopes is not None
            or softcap is not _NO_SOFTCAP or sinks is not None or rng_state is not None
            or generator is not None or return_attn_probs is not False or attn_bias is not None
            or attn_mask is not None):
        return _variant_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                             deterministic, return_attn_probs, softcap, sinks, rng_state, generator,
                             attn_bias, attn_mask)
    return _plain_func(q, k, v, softmax_scale, causal, deterministic)


def _plain_func(q, k, v, softmax_scale, causal, deterministic):
    """:func:`flash_attn_func` with every variant off."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0  # 0: rejected later
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    if _is_compiling():  # an opaque node in the graph, differentiable through its registered autograd
        out, _ = torch.ops.cupyflash.flash_attn(q, k, v, float(softmax_scale), bool(causal),
                                                bool(deterministic))
        return out
    return FlashAttnFunc.apply(q, k, v, float(softmax_scale), bool(causal), bool(deterministic))


def _check_tensor(name, x, rule):
    """``x`` is None or a torch tensor (the core checks the rest: device, dtype, shape)."""
    if x is not None and not isinstance(x, torch.Tensor):
        _checks.fail(TypeError, _FN, f"{name} must be None or {rule}; got {_checks._type_name(x)}.")  # noqa: SLF001


def _variant_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                  return_attn_probs, softcap, sinks, rng_state, generator, attn_bias=None, attn_mask=None):
    """:func:`flash_attn_func` with a variant argument given (any value)."""
    if return_attn_probs:
        _unsupported("return_attn_probs", "False", return_attn_probs)
    if generator is not None and not isinstance(generator, torch.Generator):
        _checks.fail(TypeError, _FN, f"generator must be None or a torch.Generator; got "
                                     f"{_checks._type_name(generator)}.")  # noqa: SLF001
    _check_tensor("attn_bias", attn_bias, "a torch.Tensor of q's dtype or float32")
    _check_tensor("attn_mask", attn_mask, "a bool torch.Tensor")
    window = _checks._check_option_forms(_FN, dropout_p, window_size, alibi_slopes, softcap)  # noqa: SLF001
    dropout_p, softcap = float(dropout_p), float(softcap)
    if (dropout_p == 0.0 and window == (-1, -1) and softcap == 0.0 and alibi_slopes is None and sinks is None
            and attn_bias is None and attn_mask is None):
        # (not flash_attn_func again: under torch.compile the defaults' identity checks
        # do not hold, and it would come back here)
        return _plain_func(q, k, v, softmax_scale, causal, deterministic)
    if dropout_p > 0.0:
        if rng_state is None:
            if _is_compiling():
                _unsupported_compile("rng_state=(seed, offset) must be given with dropout_p > 0 under "
                                     "torch.compile (drawing it reads and advances torch's generator "
                                     "state on the host, which a compiled graph does not do); got None")
            rng_state = _draw_rng_state(q, generator)
        else:
            if generator is not None:
                _checks.fail(ValueError, _FN, "generator must be None when rng_state is given (the state "
                                              "to draw from, or the state itself: not both); got both.")
            # the core's rules for rng_state, here too: the operators' int64 slots take any int
            _checks.check_variants(_FN, _RNG_SPEC, False, dropout_p, window, None, softcap, None, rng_state)
    else:
        rng_state = None
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0  # 0: rejected later
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    if _is_compiling():
        seed, offset = _rng_ints(rng_state)
        out, _ = torch.ops.cupyflash.flash_attn_variant(
            q, k, v, alibi_slopes, sinks, float(softmax_scale), bool(causal), bool(deterministic),
            window[0], window[1], softcap, dropout_p, seed, offset, attn_bias, attn_mask)
        return out
    return FlashAttnVariantFunc.apply(q, k, v, alibi_slopes, sinks, softmax_scale, causal, deterministic,
                                      window, softcap, dropout_p, rng_state, attn_bias, attn_mask)


def _rng_ints(rng_state):
    """``(seed, offset)`` for the operators' int64 schema (the seed as its signed bits)."""
    if rng_state is None:
        return 0, 0
    try:
        seed, offset = rng_state
    except (TypeError, ValueError):
        seed, offset = rng_state, 0  # the core's check names it
    if isinstance(seed, int) and seed >= 1 << 63:
        seed -= 1 << 64
    return seed, offset


def _unsupported_compile(message):
    raise NotImplementedError(f"cupyflash.{_FN}: {message}.")


def _draw_rng_state(q, generator):
    """A dropout ``(seed, offset)`` from torch's generator (see :func:`flash_attn_func`'s Notes)."""
    device = q.device
    if device.type == "cuda":
        if generator is None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            generator = torch.cuda.default_generators[index]
        elif generator.device.type != "cuda":
            _checks.fail(ValueError, _FN, f"generator must be a CUDA generator for tensors on {device}; "
                                          f"got one on {generator.device}.")
        state = generator.get_state()  # a copy on the host: (seed, Philox offset), int64 each
        words = state.view(torch.int64)
        seed, offset = int(words[0]) & _MASK64, int(words[1])
        words[1] = offset + 4
        generator.set_state(state)
        unit = offset >> 2
        if unit >> 32:  # past cupyflash's 32-bit offset: fold the rest into the seed
            seed ^= ((unit >> 32) * 0x9E3779B97F4A7C15) & _MASK64
        return seed, unit & _MASK32
    if generator is None:
        generator = torch.default_generator
    seed = int(torch.randint(0, 1 << 62, (), generator=generator, dtype=torch.int64))
    return seed, 0


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


# ----------------------------------------------------------------------------
# flash_attn_with_kvcache: decoding against a KV cache, appended in place
# ----------------------------------------------------------------------------


@torch.library.custom_op(
    "cupyflash::flash_attn_with_kvcache", mutates_args=("k_cache", "v_cache"),
    schema="(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
           "Tensor? cache_seqlens, int? cache_seqlens_int, Tensor? cache_batch_idx, "
           f"Tensor? block_table, float softmax_scale, bool causal, int num_splits, {_SCORE_SCHEMA}) "
           "-> (Tensor, Tensor)")
def _kvcache_op(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, cache_batch_idx,
                block_table, softmax_scale, causal, num_splits, attn_bias=None, attn_mask=None):
    # cache_seqlens is a tensor or an int: the schema has a slot for each (at most one given).
    out, lse = _kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v,
        cache_seqlens=cache_seqlens if cache_seqlens is not None else cache_seqlens_int,
        cache_batch_idx=cache_batch_idx, block_table=block_table, softmax_scale=softmax_scale,
        causal=causal, num_splits=num_splits, return_lse=True, attn_bias=attn_bias, attn_mask=attn_mask)
    return out, lse


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, cache_batch_idx,
                  block_table, softmax_scale, causal, num_splits, attn_bias=None, attn_mask=None):
    batch, seqlen_q, nheads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads_q, seqlen_q), dtype=torch.float32)


_increment_version = (getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
                      or torch._C._increment_version)  # noqa: SLF001


def _mark_written(*tensors):
    """Tell autograd that ``tensors`` were written in place behind its back (their
    version counters, which catch a tensor saved for a backward and changed since);
    inference tensors have none."""
    for t in tensors:
        if not t.is_inference():
            _increment_version(t)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                            cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, num_splits=0, return_lse=False, rotary_cos=None,
                            rotary_sin=None, cache_leftpad=None, window_size=(-1, -1),
                            softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                            return_softmax_lse=False, attn_bias=None, attn_mask=None):
    """Attention of new queries against a KV cache for torch tensors, appending in place.

    flash-attention's ``flash_attn_with_kvcache``, over
    :func:`cupyflash.flash_attn_with_kvcache` (whose docstring has the full
    semantics): if ``k`` and ``v`` are given they are written into the caller's
    ``k_cache``/``v_cache`` tensors at positions ``cache_seqlens[b] ...``; then
    ``q[b]`` attends to the sequence's first ``cache_seqlens[b] + seqlen_new``
    cache entries.  Inference only: no gradient flows through it (flash-
    attention's function has no backward either), so ``out`` and ``lse`` never
    require grad, whatever the inputs do.

    CUDA tensors run the GPU path on ``torch.cuda.current_stream()``, CPU
    tensors the CPU path; every tensor (the index tensors too) must be on q's
    device.  In eager mode the core function runs directly; under
    ``torch.compile`` the call is the custom operator
    ``torch.ops.cupyflash.flash_attn_with_kvcache`` (declared to mutate
    ``k_cache`` and ``v_cache``), so ``fullgraph=True`` works.

    Parameters
    ----------
    q : torch.Tensor, shape (batch, seqlen_q, nheads_q, head_dim)
        float16 or bfloat16 on a CUDA device (float16, bfloat16, float32 or
        float64 on the CPU).  A last stride other than 1 is made contiguous
        first (a copy), as for ``k`` and ``v``.
    k_cache, v_cache : torch.Tensor, shape (batch_cache, seqlen_cache, nheads_kv, head_dim)
        q's dtype and device, unit last stride (never copied: the append
        writes into them).  With ``block_table``: shape (num_blocks,
        page_size, nheads_kv, head_dim), ``page_size`` a positive multiple of
        16.  ``nheads_q`` a multiple of ``nheads_kv`` (GQA/MQA).
    k, v : torch.Tensor, shape (batch, seqlen_new, nheads_kv, head_dim), optional
        New keys and values to append, both or neither; q's dtype and device.
    cache_seqlens : int or torch.Tensor, shape (batch,), int32, optional
        The number of valid cache entries of each sequence before the append
        (an int: the same for all).  None: the whole cache is valid (no room to
        append).  Not modified: the caller advances it.
    cache_batch_idx : torch.Tensor, shape (batch,), int32, optional
        The cache row each sequence uses.  Not with ``block_table``.
    block_table : torch.Tensor, shape (batch, max_blocks_per_seq), int32, optional
        Paged cache: entry ``p`` of row ``b`` is the block holding sequence
        ``b``'s keys ``p * page_size`` to ``(p + 1) * page_size - 1``.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool
        Causal mask aligned bottom-right: query ``i`` sees key ``j`` iff
        ``j <= i + seqlen_k_b - seqlen_q``.
    num_splits : int
        Splits of each sequence's keys on the GPU (0: automatic); any value
        gives the same result within rounding.
    return_lse : bool
        Also return the logsumexp (``return_softmax_lse``, flash-attention's
        name, does the same).
    rotary_cos, rotary_sin, cache_leftpad, alibi_slopes : None
        Must be None: not implemented.
    window_size : (int, int)
        Must be (-1, -1): local attention is not implemented.
    softcap : float
        Must be 0.0: softcapping is not implemented.
    rotary_interleaved : bool
        Ignored (it only matters with ``rotary_cos``).
    return_softmax_lse : bool
        As ``return_lse``.
    attn_bias : torch.Tensor, optional
        An additive bias (issue 14), q's dtype or float32, on q's device, rank <= 4,
        broadcastable to ``(batch, nheads_q, seqlen_q, key)`` (each of the first
        three dimensions 1 or full), the last dimension 1 or at least the cache's
        capacity, indexed by the key's position in its sequence; any strides (read
        in place).  Added to the scaled scores; ``-inf`` hides a key.  As in
        :func:`cupyflash.flash_attn_with_kvcache`; no gradient.
    attn_mask : torch.Tensor of bool, optional
        A keep-mask broadcastable like ``attn_bias``: False hides the key.

    Returns
    -------
    out : torch.Tensor, shape (batch, seqlen_q, nheads_q, head_dim), dtype of q
    lse : torch.Tensor, shape (batch, nheads_q, seqlen_q), float32
        Only with ``return_lse`` (or ``return_softmax_lse``): the natural-log
        logsumexp of each row of scaled scores, ``-inf`` for a row that sees
        no key.

    Raises
    ------
    NotImplementedError
        An unsupported option is set (the message names it).
    TypeError, ValueError
        As :func:`cupyflash.flash_attn_with_kvcache` (messages name that
        function), including tensors of mixed dtypes or devices.  Under
        ``torch.compile`` they are raised when the compiled graph runs.

    Examples
    --------
    >>> import torch
    >>> from cupyflash.torch import flash_attn_with_kvcache
    >>> k_cache = torch.zeros(2, 64, 2, 16)
    >>> v_cache = torch.zeros(2, 64, 2, 16)
    >>> q, k, v = torch.ones(2, 1, 4, 16), torch.ones(2, 1, 2, 16), torch.ones(2, 1, 2, 16)
    >>> lens = torch.tensor([3, 10], dtype=torch.int32)
    >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)
    >>> float(k_cache[1, 10, 0, 0]), tuple(out.shape)   # the append, in the caller's tensor
    (1.0, (2, 1, 4, 16))
    """
    fn = "flash_attn_with_kvcache"
    _check_tensors(f"torch.{fn}", (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                   ("k", k), ("v", v), ("attn_bias", attn_bias), ("attn_mask", attn_mask)),
                   optional=("k", "v", "attn_bias", "attn_mask"))
    for option, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                          ("cache_leftpad", cache_leftpad), ("alibi_slopes", alibi_slopes)):
        if value is not None:
            _unsupported(option, "None", type(value).__name__, fn)
    window = _checks._check_option_forms(f"torch.{fn}", 0.0, window_size, None, softcap)  # noqa: SLF001
    if window != (-1, -1):
        _unsupported("window_size", "(-1, -1)", window_size, fn)
    if softcap != 0.0:
        _unsupported("softcap", "0.0", softcap, fn)
    if return_softmax_lse is True:
        return_lse = True
    q = _unit_last_stride(q)
    if k is not None:
        k = _unit_last_stride(k)
    if v is not None:
        v = _unit_last_stride(v)
    if _is_compiling():  # an opaque node in the graph, mutating k_cache and v_cache
        # the core's rules for the scalars, before the operator's float()/bool()/int()
        # (int(3.7) is 3, bool("no") True); the tensors are checked when the op runs
        _checks.check_flags(fn, softmax_scale, 1, causal)
        _checks.check_num_splits(fn, num_splits)
        if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor) and (
                isinstance(cache_seqlens, (bool, np.bool_)) or not isinstance(cache_seqlens, numbers.Integral)):
            _checks.fail(TypeError, fn, f"cache_seqlens must be None, an int or an int32 array of shape "
                                        f"(batch,) like q; got {_checks._type_name(cache_seqlens)}.")  # noqa: SLF001
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0  # 0: rejected later
        seqlens_tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
        seqlens_int = None if seqlens_tensor is not None or cache_seqlens is None else int(cache_seqlens)
        with torch.no_grad():  # no backward, as in eager mode
            out, lse = torch.ops.cupyflash.flash_attn_with_kvcache(
                q, k_cache, v_cache, k, v, seqlens_tensor, seqlens_int, cache_batch_idx,
                block_table, float(softmax_scale), bool(causal), int(num_splits), attn_bias, attn_mask)
        return (out, lse) if return_lse else out
    result = _kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        block_table=block_table, softmax_scale=softmax_scale, causal=causal,
        num_splits=num_splits, return_lse=return_lse, attn_bias=attn_bias, attn_mask=attn_mask)
    if k is not None:
        _mark_written(k_cache, v_cache)
    return result
