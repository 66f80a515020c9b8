"""The attention variants on the GPU: what a plan and a call write into the
params structs' ``var`` member (kernels_cu/variant.cuh ``VariantParams``).

The options arrive validated (``_checks.check_variants``: the CPU path's
keyword arguments of the options that are on).  A plan depends on which
variants are on and on their scalars (:func:`plan_key`, :func:`plan_fields`);
the arrays' pointers and the dropout state change per call
(:func:`call_values`, VariantParams' first fields).
"""

from __future__ import annotations

from . import _params, dispatch
from ._launch import LOG2E
from ._philox import dropout_threshold

#: Writes VariantParams' per-call fields (``_params.VARIANT_PER_CALL``).
WRITER = _params.FieldWriter(_params.VARIANT_PARAMS, _params.VARIANT_PER_CALL)


def bits(options) -> int:
    """The kernels' VARIANT template argument for ``options``."""
    return dispatch.variant_bits(window="window_size" in options, softcap="softcap" in options,
                                 alibi="alibi_slopes" in options, sinks="sinks" in options,
                                 dropout="dropout_p" in options)


def plan_key(options) -> tuple:
    """What a plan depends on: the variants on and their scalars (no arrays)."""
    alibi = options.get("alibi_slopes")
    return (bits(options), options.get("window_size"), options.get("softcap"), options.get("dropout_p"),
            None if alibi is None else alibi.ndim)


def plan_fields(options, softmax_scale: float, nheads_q: int) -> dict:
    """VariantParams with its per-plan fields set (the per-call ones 0)."""
    fields = dict(_params.VARIANT_OFF)
    if "window_size" in options:
        fields["window_left"], fields["window_right"] = options["window_size"]
    if "softcap" in options:
        fields["softcap_log2"] = options["softcap"] * LOG2E
        fields["softcap_scale"] = softmax_scale / options["softcap"]
    alibi = options.get("alibi_slopes")
    if alibi is not None:
        fields["alibi_batch_stride"] = nheads_q if alibi.ndim == 2 else 0
    if "dropout_p" in options:
        fields["dropout_threshold"] = dropout_threshold(options["dropout_p"])
        fields["dropout_scale"] = 1.0 / (1.0 - options["dropout_p"])
    return fields


def contiguous(options):
    """``options`` with the slopes and sinks as C-contiguous device arrays (the kernels
    read them with unit head stride, and ``(batch, nheads_q)`` slopes with batch stride
    ``nheads_q``): a view is copied, a contiguous array kept as it is."""
    import cupy  # noqa: PLC0415

    out = options
    for name in ("alibi_slopes", "sinks"):
        x = options.get(name)
        if x is not None and not x.flags.c_contiguous:
            out = {**out, name: cupy.ascontiguousarray(x)}
    return out


def call_values(options, dsinks: int = 0) -> tuple[int, int, int, int, int]:
    """VariantParams' per-call fields: the slopes' and sinks' pointers, ``dsinks``
    (the backward's output pointer, or 0), and the dropout seed and offset."""
    alibi, sinks = options.get("alibi_slopes"), options.get("sinks")
    seed, offset = options.get("rng_state", (0, 0))
    return (0 if alibi is None else alibi.data.ptr, 0 if sinks is None else sinks.data.ptr, dsinks,
            seed, offset)
