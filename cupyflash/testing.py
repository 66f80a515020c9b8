"""Tolerance rules and input helpers shared by the CPU and GPU tests.

The tolerance follows FlashAttention's own tests: a fast path may be off the
float64 reference by at most ``factor`` times what a naive implementation in
the same precision is off by, plus a small floor::

    max|actual - ref64| <= factor * max|naive - ref64| + floor

with ``factor`` 2 for outputs and lse and 3 for gradients.  The naive error
measures what rounding alone costs at this shape and dtype, so the bound
follows the problem instead of being a fixed atol.  NaN never passes, and
positions where the reference is ``-inf`` (the lse of a row that sees no key)
must be exactly ``-inf``.

Everything here works on NumPy arrays and accepts CuPy arrays (copied to the
host); nothing imports CuPy.
"""

from __future__ import annotations

import contextlib

import numpy as np

from . import reference

__all__ = [
    "OUT_FACTOR",
    "GRAD_FACTOR",
    "REL_FLOOR",
    "resolve_dtype",
    "naive_dtype",
    "assert_close_to_reference",
    "assert_fwd_matches_reference",
    "assert_bwd_matches_reference",
    "given_out",
    "random_qkv",
    "random_normal",
    "poison",
    "poisoned_allocations",
    "to_bf16_bits",
    "from_bf16_bits",
]

OUT_FACTOR = 2.0  # out and lse
GRAD_FACTOR = 3.0  # dq, dk, dv
#: floor = REL_FLOOR * max(1, max|ref64|): covers shapes where the naive error is
#: exactly 0 (one key: softmax is exactly 1) while fp32 summation order is not.
REL_FLOOR = 1e-5


def resolve_dtype(dtype):
    """A NumPy dtype from a dtype or a name; "bfloat16" means ml_dtypes.bfloat16."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def naive_dtype(dtype):
    """The precision a naive implementation should run in to match a fast path.

    The fast paths accumulate in float32 whatever the input, so float64 inputs
    are held to a naive float32 implementation; the others to their own dtype.
    """
    dtype = resolve_dtype(dtype)
    return np.dtype(np.float32) if dtype == np.float64 else dtype


def _host64(x):
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()
    return np.asarray(x).astype(np.float64)


def assert_close_to_reference(name, actual, ref64, naive, factor, floor):
    """Assert ``max|actual - ref64| <= factor * max|naive - ref64| + floor``.

    Parameters
    ----------
    name : str
        What is compared ("out", "lse", "dq", ...), for the message.
    actual, ref64, naive : array
        The same shape; NumPy or CuPy, any float dtype.
    factor, floor : float
        The bound is ``factor * naive_error + floor``.

    Returns
    -------
    float
        The max absolute error of ``actual`` (over the finite reference values).

    Raises
    ------
    AssertionError
        On a shape mismatch, any NaN in ``actual`` or ``ref64``, a mismatch
        where ``ref64`` is infinite (it must be matched exactly), a non-finite
        ``actual`` where ``ref64`` is finite, or an error over the bound.
    ValueError
        When ``naive`` is not finite where ``ref64`` is: no bound can be set.
    """
    actual, ref64, naive = _host64(actual), _host64(ref64), _host64(naive)
    if actual.shape != ref64.shape or naive.shape != ref64.shape:
        raise AssertionError(
            f"{name}: shape {actual.shape} (naive {naive.shape}) != reference {ref64.shape}"
        )
    if np.isnan(ref64).any():
        raise AssertionError(f"{name}: the reference has NaN at {np.argwhere(np.isnan(ref64))[:5]}")
    if np.isnan(actual).any():
        where = np.argwhere(np.isnan(actual))
        raise AssertionError(f"{name}: {len(where)} NaN values, first at {tuple(where[0])}")
    finite = np.isfinite(ref64)
    bad_inf = ~finite & (actual != ref64)
    if bad_inf.any():
        where = tuple(np.argwhere(bad_inf)[0])
        raise AssertionError(
            f"{name}: {int(bad_inf.sum())} values must be {ref64[where]} like the reference; "
            f"first at {where} is {actual[where]}"
        )
    if not np.isfinite(actual[finite]).all():
        where = tuple(np.argwhere(finite & ~np.isfinite(actual))[0])
        raise AssertionError(f"{name}: value {actual[where]} at {where}; the reference is finite")
    if not np.isfinite(naive[finite]).all():
        raise ValueError(f"{name}: the naive result is not finite where the reference is")
    if not finite.any():
        return 0.0
    err = np.abs(actual[finite] - ref64[finite])
    naive_err = np.abs(naive[finite] - ref64[finite])
    bound = factor * naive_err.max() + floor
    if not err.max() <= bound:
        worst = tuple(int(i) for i in np.argwhere(finite)[np.argmax(err)])
        raise AssertionError(
            f"{name}: max error {err.max():.3e} (mean {err.mean():.3e}) exceeds "
            f"{factor:g} x naive max error {naive_err.max():.3e} (mean {naive_err.mean():.3e}) "
            f"+ floor {floor:.1e} = {bound:.3e}; worst at {worst}: "
            f"actual {actual[worst]!r}, reference {ref64[worst]!r}"
        )
    return float(err.max())


def _floor(ref64):
    finite = ref64[np.isfinite(ref64)]
    return REL_FLOOR * max(1.0, float(np.abs(finite).max()) if finite.size else 1.0)


def assert_fwd_matches_reference(q, k, v, out, lse, *, softmax_scale=None, causal=False, floor=None,
                                 **variants):
    """Check a forward result against the float64 reference with the naive rule.

    Parameters
    ----------
    q, k, v : array
        The inputs, (batch, seqlen, nheads, head_dim); NumPy or CuPy.
    out, lse : array
        The result to check.
    softmax_scale, causal
        As for :func:`cupyflash.reference.attention_fwd`.
    floor : float, optional
        The bound's floor; defaults to ``REL_FLOOR * max(1, max|ref64|)``.
    **variants
        ``window_size``, ``softcap``, ``alibi_slopes``, ``sinks``, ``dropout_p``,
        ``dropout_mask``, ``attn_bias`` and ``attn_mask``, given alike to the
        reference and to the naive implementation.

    Returns
    -------
    dict
        Max absolute errors, ``{"out": ..., "lse": ...}``.
    """
    ref_out, ref_lse = reference.attention_fwd(q, k, v, softmax_scale, causal, **variants)
    dtype = naive_dtype(_host_dtype(q))
    naive_out, naive_lse = reference.naive_attention(q, k, v, softmax_scale, causal, dtype, **variants)
    return {
        "out": assert_close_to_reference("out", out, ref_out, naive_out, OUT_FACTOR,
                                         _floor(ref_out) if floor is None else floor),
        "lse": assert_close_to_reference("lse", lse, ref_lse, naive_lse, OUT_FACTOR,
                                         _floor(ref_lse) if floor is None else floor),
    }


def assert_bwd_matches_reference(dout, q, k, v, dq, dk, dv, *, softmax_scale=None,
                                 causal=False, dsinks=None, dbias=None, out=None, floor=None, **variants):
    """Check gradients against the float64 reference with the naive rule.

    Parameters
    ----------
    dout, q, k, v : array
        The inputs; NumPy or CuPy.
    dq, dk, dv : array
        The gradients to check.
    softmax_scale, causal, floor, **variants
        As for :func:`assert_fwd_matches_reference`.
    dsinks : array, optional
        The sinks' gradient to check; required when ``sinks`` is given.
    dbias : array, optional
        The bias's gradient to check (in ``attn_bias``'s shape), with ``attn_bias``
        among the variants; the naive one is summed from its rounded ``dS``.
    out : array, optional
        The forward output the gradients were computed from.  Given, ``dsinks``
        and ``dbias`` are held against the reference's for it (see
        :func:`given_out`): recommended whenever they are checked.

    Returns
    -------
    dict
        Max absolute errors, ``{"dq": ..., "dk": ..., "dv": ...}`` (and ``"dsinks"``,
        ``"dbias"``).
    """
    with_dbias = dbias is not None
    if with_dbias and variants.get("attn_bias") is None:
        raise ValueError("assert_bwd_matches_reference: dbias needs attn_bias")
    refs = reference.attention_bwd(dout, q, k, v, softmax_scale, causal, return_dbias=with_dbias,
                                   **variants)
    if out is not None:
        refs = given_out(refs, out, dout, q, k, v, softmax_scale=softmax_scale, causal=causal, **variants)
    dtype = naive_dtype(_host_dtype(q))
    naives = reference.naive_attention_bwd(dout, q, k, v, softmax_scale, causal, dtype,
                                           return_dbias=with_dbias, **variants)
    names, got = ("dq", "dk", "dv"), (dq, dk, dv)
    if variants.get("sinks") is not None:
        if dsinks is None:
            raise ValueError("assert_bwd_matches_reference: dsinks must be given with sinks")
        names, got = names + ("dsinks",), got + (dsinks,)
    if with_dbias:
        names, got = names + ("dbias",), got + (dbias,)
    return {
        name: assert_close_to_reference(name, g, ref, naive, GRAD_FACTOR,
                                        _floor(ref) if floor is None else floor)
        for name, g, ref, naive in zip(names, got, refs, naives)
    }


def given_out(refs, out, dout, q, k, v, *, softmax_scale=None, causal=False, **variants):
    """The reference gradients ``refs`` (``attention_bwd``'s: dq, dk, dv, then dsinks
    with sinks, dbias with ``attn_bias`` when it was asked) with dsinks and dbias
    made those of the forward output ``out`` given.

    FlashAttention computes ``dS = P * (dP - delta)`` and ``dsinks = -sum P_sink *
    delta`` with ``delta = rowsum(dout * out)`` of the ``out`` it returned, rounded
    to the input dtype; the naive implementation never rounds ``out``, so its
    error does not include that rounding.  Where nothing else contributes it is
    all there is: a bias broadcast over the keys has an exact dbias of 0 (softmax
    is shift-invariant) and a computed one that is exactly this rounding.  The
    rounding of ``out`` is held to the rule by the forward's check; given it,
    ``delta`` is the returned out's, here as in the fast paths:
    ``dS += P * (delta_exact - delta_returned)``, ``dsinks += sum P_sink *
    (delta_exact - delta_returned)``.  dq, dk and dv are left as they are.

    Returns the corrected tuple (float64).
    """
    ref_out, ref_lse = reference.attention_fwd(q, k, v, softmax_scale, causal, **variants)
    dout64 = _host64(dout)
    change = ((dout64 * ref_out).sum(axis=-1) - (dout64 * _host64(out)).sum(axis=-1)).transpose(0, 2, 1)
    refs = list(refs)
    at = 3
    sinks = variants.get("sinks")
    if sinks is not None and len(refs) > at:
        sink64 = _host64(sinks)[None, :, None]
        with np.errstate(invalid="ignore"):  # a -inf sink of a row that sees no key: -inf - -inf
            p_sink = np.where(np.isneginf(sink64), 0.0, np.exp(sink64 - ref_lse))  # (B, H, Sq)
        refs[at] = refs[at] + (p_sink * change).sum(axis=(0, 2))
        at += 1
    bias = variants.get("attn_bias")
    if bias is not None and len(refs) > at:
        full = reference.attention_probs(q, k, softmax_scale, causal, **variants) * change[..., None]
        shape = tuple(bias.shape)
        padded = (1,) * (4 - len(shape)) + shape
        axes = tuple(a for a in range(4) if padded[a] == 1 and full.shape[a] > 1)
        refs[at] = refs[at] + full.sum(axis=axes, keepdims=True).reshape(shape)
    return tuple(refs)


def _host_dtype(x):
    # cupy dtypes are numpy dtypes
    return np.dtype(x.dtype)


def random_normal(rng, shape, dtype, xp=np):
    """Fresh standard-normal values of ``dtype`` (drawn on the host, then moved to ``xp``)."""
    host = rng.standard_normal(shape, dtype=np.float32).astype(resolve_dtype(dtype))
    return host if xp is np else xp.asarray(host)


def random_qkv(rng, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, dtype, xp=np):
    """Fresh standard-normal ``(q, k, v)`` in the (batch, seqlen, nheads, head_dim) layout.

    Parameters
    ----------
    rng : numpy.random.Generator
    batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim : int
    dtype : dtype or str
        "bfloat16" means ml_dtypes.bfloat16.
    xp : module, optional
        ``numpy`` (default) or ``cupy``; values are drawn on the host either way.

    Returns
    -------
    q : array, shape (batch, seqlen_q, nheads_q, head_dim)
    k, v : array, shape (batch, seqlen_k, nheads_kv, head_dim)
    """
    return (
        random_normal(rng, (batch, seqlen_q, nheads_q, head_dim), dtype, xp),
        random_normal(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype, xp),
        random_normal(rng, (batch, seqlen_k, nheads_kv, head_dim), dtype, xp),
    )


def poison(shape, dtype, xp=np):
    """An array of NaN: give it as an output buffer to prove every element is written."""
    return xp.full(shape, np.nan, dtype=resolve_dtype(dtype))


@contextlib.contextmanager
def poisoned_allocations(cupy):
    """Within the block, every CuPy allocation is filled with 0xFF bytes (NaN in every
    float dtype) before use, from a memory pool of its own that is freed on exit: an
    output, a scratch buffer or an intermediate the kernels forget to write shows up
    as NaN."""
    pool = cupy.cuda.MemoryPool()

    def malloc(nbytes):
        mem = pool.malloc(nbytes)
        if nbytes:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, nbytes, cupy.cuda.get_current_stream().ptr)
        return mem

    try:
        with cupy.cuda.using_allocator(malloc):
            yield
    finally:
        pool.free_all_blocks()


def to_bf16_bits(x32):
    """float32 values -> bfloat16 bit patterns as uint16 (round to nearest even).

    The storage the GPU path takes for bfloat16 cupy data (``dtype="bfloat16"``).
    """
    u = np.ascontiguousarray(x32, dtype=np.float32).view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def from_bf16_bits(bits):
    """bfloat16 bit patterns (uint16) -> the float32 values they hold, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
