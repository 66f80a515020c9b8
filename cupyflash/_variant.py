"""The attention variants on the GPU: what a plan and a call write into the
params structs' ``var`` member (kernels_cu/variant.cuh ``VariantParams``).

The options arrive validated (``_checks.check_variants``: the CPU path's
keyword arguments of the options that are on).  A plan depends on which
variants are on and on their scalars (:func:`plan_key`, :func:`plan_fields`);
the arrays' pointers and the dropout state change per call
(:func:`call_values`, VariantParams' first fields).
"""

from __future__ import annotations

from . import _launch, _params, dispatch
from ._launch import LOG2E, Contiguous
from ._philox import dropout_threshold

#: Writes VariantParams' per-call fields (``_params.VARIANT_PER_CALL``).
WRITER = _params.FieldWriter(_params.VARIANT_PARAMS, _params.VARIANT_PER_CALL)


def _bias_storage(options):
    bias = options.get("attn_bias")
    if bias is None:
        return None
    return "float32" if bias.dtype.itemsize == 4 else "element"


def _strided(options) -> bool:
    """Whether the bias or the mask cannot be read in aligned pairs of columns
    (``dispatch.score_pairs_ok``: a column stride other than 1, odd strides, an odd
    address), so that the kernels read them element by element."""
    return any(x is not None and not dispatch.score_pairs_ok(broadcast_strides(x), x.itemsize, x.data.ptr)
               for x in (options.get("attn_bias"), options.get("attn_mask")))


def _staged(options) -> bool:
    """Whether every bias and mask given can be copied 16 bytes at a time
    (``dispatch.score_vec_ok``: unit column stride, 16-byte aligned rows)."""
    arrays = [x for x in (options.get("attn_bias"), options.get("attn_mask")) if x is not None]
    return bool(arrays) and all(dispatch.score_vec_ok(broadcast_strides(x), x.itemsize, x.data.ptr) for x in arrays)


def bias_tma_ok(options) -> bool:
    """Whether a TMA map can describe the bias (``_tma.bias_map``, for the ws backward's
    staged bias): no bias, or broadcast strides all non-negative and below 2^40 bytes (a
    reversed view, staged for the cp.async kernels, is not)."""
    bias = options.get("attn_bias")
    return bias is None or all(0 <= s * bias.itemsize < 1 << 40 for s in broadcast_strides(bias))


def staged_bits(options) -> int:
    """:func:`bits` for a plan (forward or backward): with VAR_BIAS_STAGED where the bias
    and mask can be staged through shared memory (``select_fwd``/``select_bwd`` drop it
    for each kernel that does not stage, or whose stages do not fit)."""
    b = bits(options)
    return b | dispatch.VAR_BIAS_STAGED if _staged(options) and not b & dispatch.VAR_BIAS_STRIDED else b


def plan_bits(options) -> int:
    """:func:`staged_bits` with VAR_BLOCK_MAP with a mask: the VARIANT a plan (forward or
    backward) is selected with (``fwd_variant`` and ``select_bwd`` drop the map's bit
    for each kernel that takes no map)."""
    b = staged_bits(options)
    return b | dispatch.VAR_BLOCK_MAP if "attn_mask" in options else b


def block_map_shape(mask, tile) -> tuple[int, int, int, int]:
    """The shape of the mask's tile map at ``tile = (BLOCK_M, BLOCK_N)``
    (``_blockmask.BlockMask.tiles``): the mask's batch and head dimensions, and its row
    and key dimensions in tiles (1 where the mask's is 1)."""
    bm, hm, rows, cols = mask.shape
    return (bm, hm, 1 if rows == 1 else -(-rows // tile[0]), 1 if cols == 1 else -(-cols // tile[1]))


def block_maps(options, tiles):
    """The mask's tile maps on the GPU at each of ``tiles`` (``(BLOCK_M, BLOCK_N)``, or None:
    no map): the BlockMask's (``options["block_mask"]``, kept there for later calls), else
    reduced from the mask now, once for all of them."""
    from ._blockmask import BlockMask  # noqa: PLC0415

    if all(tile is None for tile in tiles):
        return (None,) * len(tiles)
    bm = options.get("block_mask")
    fresh = bm is None
    if fresh:
        bm = BlockMask.from_mask(options["attn_mask"])
    maps = tuple(None if tile is None else bm.tiles(*tile) for tile in tiles)
    if fresh:
        _launch.keep_for_graph(*maps)  # a graph being captured replays reading them
    return maps


def bits(options) -> int:
    """The kernels' VARIANT template argument for ``options`` (with a bias or mask, it
    depends on their strides and on the parity of their addresses)."""
    return dispatch.variant_bits(window="window_size" in options, softcap="softcap" in options,
                                 alibi="alibi_slopes" in options, sinks="sinks" in options,
                                 dropout="dropout_p" in options, bias=_bias_storage(options),
                                 mask="attn_mask" in options, strided=_strided(options))


def decode_bits(options) -> int:
    """The decode kernel's VARIANT for ``options`` (no dropout): :func:`bits` without
    VAR_BIAS_STRIDED, since that kernel reads a bias and mask element by element at any
    strides (variant.cuh ScoreMod), never in pairs."""
    return bits(options) & ~dispatch.VAR_BIAS_STRIDED


def broadcast_strides(x) -> tuple[int, int, int, int]:
    """(batch, head, row, col) strides in elements of a 4-D bias, mask or dbias
    (``_checks.check_variants``' left-padded form) read as broadcast to the full
    (batch, nheads_q, seqlen_q, seqlen_k): 0 along its size-1 dimensions."""
    return tuple(0 if n == 1 else s // x.itemsize for n, s in zip(x.shape, x.strides))


def dbias_shape(options):
    """The 4-D shape of the backward's dbias (the bias's; it has the bias's dtype too),
    or None without one."""
    return options["attn_bias"].shape if options.get("return_dbias") else None


def plan_key(options) -> tuple:
    """What a plan depends on: the variants on and their scalars (no arrays but the
    bias's and mask's broadcast strides, and through :func:`bits` whether they are
    read in pairs; whether they are staged, :func:`staged_bits`)."""
    alibi = options.get("alibi_slopes")
    key = (bits(options), options.get("window_size"), options.get("softcap"), options.get("dropout_p"),
           None if alibi is None else alibi.ndim)
    if "attn_bias" in options or "attn_mask" in options:
        key += tuple(None if x is None else broadcast_strides(x)
                     for x in (options.get("attn_bias"), options.get("attn_mask")))
        key += (dbias_shape(options), _staged(options))
    if "attn_mask" in options:  # the tile map's strides (plan_fields) follow the mask's shape, not
        key += (tuple(options["attn_mask"].shape),)  # its strides: a stride-0 view of a batch has both
    return key


def plan_fields(options, softmax_scale: float, nheads_q: int, block_map_tile=None, kv_block_map_tile=None) -> dict:
    """VariantParams with its per-plan fields set (the per-call ones 0); ``block_map_tile``:
    the (BLOCK_M, BLOCK_N) of the mask's tile map the kernels that walk key blocks read
    (VAR_BLOCK_MAP: the forward, the backward's dQ kernel), or None; ``kv_block_map_tile``:
    that of the backward's dK/dV kernel (``dispatch.bwd_block_map_tiles``), or None."""
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
    arrays = {"bias": options.get("attn_bias"), "mask": options.get("attn_mask")}
    shape = dbias_shape(options)
    if shape is not None:  # C-contiguous in the bias's 4-D shape and dtype (the backward allocates it)
        arrays["dbias"] = Contiguous(shape, options["attn_bias"].itemsize)
    for name, tile in (("block_map", block_map_tile), ("kv_block_map", kv_block_map_tile)):
        if tile is not None:  # C-contiguous uint8 (BlockMask.tiles)
            arrays[name] = Contiguous(block_map_shape(options["attn_mask"], tile), 1)
    for name, x in arrays.items():
        if x is not None:
            for axis, stride in zip(("batch", "head", "row", "col"), broadcast_strides(x)):
                fields[f"{name}_{axis}_stride"] = stride
    return fields


def contiguous(options):
    """``options`` with the slopes and sinks as C-contiguous device arrays (the kernels
    read them with unit head stride, and ``(batch, nheads_q)`` slopes with batch stride
    ``nheads_q``): a view is copied, a contiguous array kept as it is. The bias and
    mask are never copied: the kernels read them at their strides."""
    import cupy  # noqa: PLC0415

    out = options
    for name in ("alibi_slopes", "sinks"):
        x = options.get(name)
        if x is not None and not x.flags.c_contiguous:
            out = {**out, name: cupy.ascontiguousarray(x)}
            _launch.keep_for_graph(out[name])  # a graph being captured replays reading it
    return out


def call_values(options, dsinks: int = 0, dbias: int = 0, block_map: int = 0,
                kv_block_map: int = 0) -> tuple[int, ...]:
    """VariantParams' per-call fields (``_params.VARIANT_PER_CALL``): the slopes',
    sinks', bias's and mask's pointers, ``dsinks`` and ``dbias`` (the backward's
    output pointers, or 0), ``block_map`` and ``kv_block_map`` (the mask's tile maps,
    :func:`plan_fields`', or 0), and the dropout seed and offset."""
    ptr = [0 if x is None else x.data.ptr for x in (options.get(name) for name in
                                                   ("alibi_slopes", "sinks", "attn_bias", "attn_mask"))]
    seed, offset = options.get("rng_state", (0, 0))
    return (ptr[0], ptr[1], dsinks, ptr[2], ptr[3], dbias, block_map, kv_block_map, seed, offset)
