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
the graph as opaque nodes instead of breaking it.  In eager mode
:func:`flash_attn_func` runs :class:`FlashAttnFunc`, a plain
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

import torch

from . import _api, _torch_path

__all__ = ["FlashAttnFunc", "flash_attn_func"]


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


def _unsupported(option, rule, value):
    raise NotImplementedError(
        f"cupyflash.torch.flash_attn_func: {option} must be {rule} ({option} is not "
        f"implemented); got {value!r}.")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, softcap=0.0):
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
        Must be 0.0: dropout is not implemented.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    causal : bool
        Causal mask aligned bottom-right (see :func:`cupyflash.flash_attn_fwd`).
    window_size : (int, int)
        Must be (-1, -1): local attention is not implemented.
    alibi_slopes : None
        Must be None: ALiBi is not implemented.
    deterministic : bool
        Bitwise reproducible backward (slower; see :func:`cupyflash.flash_attn_bwd`).
    return_attn_probs : bool
        Must be False.
    softcap : float, keyword-only
        Must be 0.0: softcapping is not implemented.

    Returns
    -------
    out : torch.Tensor, shape (batch, seqlen_q, nheads_q, head_dim), dtype of q

    Raises
    ------
    NotImplementedError
        An unsupported option is set; the message names it.
    TypeError, ValueError
        As :func:`cupyflash.flash_attn_fwd` for the tensors.
    """
    if dropout_p != 0.0:
        _unsupported("dropout_p", "0.0", dropout_p)
    if tuple(window_size) != (-1, -1):
        _unsupported("window_size", "(-1, -1)", window_size)
    if alibi_slopes is not None:
        _unsupported("alibi_slopes", "None", type(alibi_slopes).__name__)
    if return_attn_probs:
        _unsupported("return_attn_probs", "False", return_attn_probs)
    if softcap != 0.0:
        _unsupported("softcap", "0.0", softcap)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0  # 0: rejected later
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    if _is_compiling():  # an opaque node in the graph, differentiable through its registered autograd
        out, _ = torch.ops.cupyflash.flash_attn(q, k, v, float(softmax_scale), bool(causal),
                                                bool(deterministic))
        return out
    return FlashAttnFunc.apply(q, k, v, float(softmax_scale), bool(causal), bool(deterministic))


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
