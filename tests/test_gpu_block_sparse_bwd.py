"""Block-sparse masks in the GPU backward (issue 14): the wgmma dK/dV and dQ kernels' tile
maps (VAR_BLOCK_MAP; dispatch.bwd_block_map_tiles).

The dK/dV kernel reads the map at its 64 x 128 tile down each key block's column
(variant.cuh QueryBlockMap), the dQ kernel at its 128 x 64 tile along each query block's
row (KeyBlockMap): empty tiles are skipped (no loads, no MMA, no dQ atomics), full ones
run with no mask reads, partial ones read the mask. The mma.sync fallbacks (D=96 here)
take no map and mask every tile: the same results.

Masks made of 64 x 64 cells that are empty, full or random inside (so that the kernels'
64 x 128 and 128 x 64 tiles are a mix of all three), passed as a plain bool mask
(mapped on the GPU per call) and as a :class:`cupyflash.BlockMask` (mapped once), with
rows that see no key (inside partial tiles, and whole query blocks every tile of which
is skipped) and key blocks no query sees; causal, GQA, D=64 and 128, fp16 and bf16,
sequence lengths that are not multiples of the tiles, deterministic mode. Every
gradient is held against the float64 reference with the rule of tests/test_gpu_bias_bwd.py
(``max|got - ref64| <= 3 * max|naive - ref64| + FLOOR``), outputs NaN-poisoned.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import dispatch, testing
from test_gpu_bias_bwd import check, cp  # noqa: F401 (cp: fixture)
from test_gpu_variants import _NO_BF16, dev, dtype_kw, host, poisoned

pytestmark = pytest.mark.gpu

# id -> (dtype, (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), causal). The
# mask's rows are 16-byte aligned (staged: VAR_BIAS_STAGED) where seqlen_k is a multiple
# of 16; D=128 takes the wgmma kernels only so (dispatch._BWD_SM90_STAGED_FITS).
CONFIGS = {
    "bf16-d64-700x645-gqa": ("bfloat16", (2, 700, 645, 6, 3, 64), False),         # mask read element-wise
    "f16-d64-520x520-causal": ("float16", (2, 520, 520, 4, 4, 64), True),
    "f16-d64-600x640-staged": ("float16", (2, 600, 640, 4, 2, 64), False),        # staged mask
    "bf16-d128-600x640-gqa": ("bfloat16", (2, 600, 640, 6, 3, 128), False),       # staged (D=128 needs it)
    "f16-d128-528x528-causal": ("float16", (2, 528, 528, 4, 4, 128), True),
    "f16-d96-390x450": ("float16", (2, 390, 450, 2, 2, 96), False),               # mma.sync: no map
}
#: The configs whose backward runs on the wgmma kernels (on an H200), which read the map.
WGMMA = {name for name, (_, shape, _) in CONFIGS.items() if shape[5] in (64, 128)}


def _params(names):
    for name in names:
        yield pytest.param(name, marks=_NO_BF16 if CONFIGS[name][0] == "bfloat16" else (), id=name)


def _block_sparse(rng, shape, keep=0.35, partial=0.4):
    """A bool mask of ``shape`` (..., rows, keys) made of 64 x 64 cells: empty, full, or
    (``partial`` of the kept ones) random inside."""
    *lead, rows, cols = shape
    nb = (-(-rows // 64), -(-cols // 64))
    kept = rng.random((*lead, *nb)) < keep
    mixed = kept & (rng.random((*lead, *nb)) < partial)
    i, j = np.arange(rows) // 64, np.arange(cols) // 64
    cells = kept[..., i[:, None], j[None, :]]
    inside = rng.random(shape) < 0.6
    return np.where(mixed[..., i[:, None], j[None, :]], inside, cells)


@pytest.fixture
def kernels(monkeypatch):
    """The (kernel name, VARIANT) of every wgmma backward kernel launched."""
    from cupyflash import _launch

    seen = []
    real_call = _launch.Launcher.__call__

    def call(self, stream, *pointers, var=None):
        seen.extend((L.template.rsplit("::", 1)[1], int(L.args[-1])) for L in self.launches
                    if L.template in dispatch._BWD_BLOCK_MAP_KERNELS)  # noqa: SLF001
        real_call(self, stream, *pointers, var=var)

    monkeypatch.setattr(_launch.Launcher, "__call__", call)
    return seen


def _run(cp, rng, config, mask, form, deterministic=False):
    """Fresh inputs; the forward with the plain mask, the backward with ``mask`` as
    ``form`` ("mask" or "BlockMask") into poisoned gradients. Returns the host inputs,
    (out, lse) and (dq, dk, dv)."""
    dtype, shape, causal = CONFIGS[config]
    batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim = shape
    q, k, v = testing.random_qkv(rng, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    d_q, d_k, d_v, d_dout = (dev(cp, x) for x in (q, k, v, dout))
    d_mask = cp.asarray(mask)
    kw = dict(causal=causal, **dtype_kw(cp, dtype))
    out, lse = cupyflash.flash_attn_fwd(d_q, d_k, d_v, attn_mask=d_mask, **kw)
    arg = cupyflash.BlockMask.from_mask(d_mask) if form == "BlockMask" else d_mask
    grads = cupyflash.flash_attn_bwd(d_dout, d_q, d_k, d_v, out, lse, deterministic=deterministic,
                                     dq=poisoned(cp, q.shape, dtype), dk=poisoned(cp, k.shape, dtype),
                                     dv=poisoned(cp, v.shape, dtype), attn_mask=arg, **kw)
    return (q, k, v, dout), (host(out, dtype), host(lse)), tuple(host(g, dtype) for g in grads)


def _assert_mapped(kernels, config):
    """The wgmma configs launched each backward kernel that reads a map with its bit; the
    others launched none of those kernels."""
    assert kernels if config in WGMMA else not kernels
    assert all(variant & dispatch.VAR_BLOCK_MAP for _, variant in kernels), kernels


@pytest.mark.parametrize("config", list(_params(CONFIGS)))
@pytest.mark.parametrize("form", ["mask", "BlockMask"])
@pytest.mark.parametrize("mask_shape", ["per-batch", "per-head", "shared"])
def test_block_sparse_backward(cp, rng, kernels, mask_shape, form, config):
    _, shape, causal = CONFIGS[config]
    b, m, n, h = shape[:4]
    lead = {"per-batch": (b, 1), "per-head": (1, h), "shared": ()}[mask_shape]
    mask = _block_sparse(rng, (*lead, m, n))
    mask[..., 70:75, :] = False   # rows that see no key, inside partial tiles
    mask[..., :, 256:384] = False  # keys no query sees: a key block of the dK/dV kernel with no step
    inputs, fwd, grads = _run(cp, rng, config, mask, form)
    assert np.all(np.asarray(grads[0], np.float32)[:, 70:75] == 0)  # the dq of rows that see no key
    check(inputs, fwd, grads, (None, mask), causal)
    _assert_mapped(kernels, config)


@pytest.mark.parametrize("config", list(_params(["bf16-d64-700x645-gqa", "bf16-d128-600x640-gqa",
                                                 "f16-d96-390x450"])))
def test_query_blocks_and_key_blocks_whose_every_tile_is_skipped(cp, rng, kernels, config):
    """Query blocks with no kept tile (their dq 0, no step of the dQ kernel), key blocks
    with none (dk, dv 0: the dK/dV block runs no step), next to rows that see every key."""
    _, shape, causal = CONFIGS[config]
    b, m, n = shape[:3]
    mask = _block_sparse(rng, (b, 1, m, n))
    mask[:, :, :256] = False
    mask[:, :, :, 384:] = False
    mask[:, :, 300:310, :384] = True
    inputs, fwd, grads = _run(cp, rng, config, mask, "BlockMask")
    dq, dk, dv = (np.asarray(g, np.float32) for g in grads)
    assert np.all(dq[:, :256] == 0) and np.all(dk[:, 384:] == 0) and np.all(dv[:, 384:] == 0)
    check(inputs, fwd, grads, (None, mask), causal)
    _assert_mapped(kernels, config)


@pytest.mark.parametrize("config", list(_params(["f16-d64-520x520-causal", "bf16-d128-600x640-gqa"])))
def test_deterministic_block_sparse_backward_is_reproducible(cp, rng, kernels, config):
    """Deterministic mode with the map (D=128: the wgmma dQ kernel reads its own map):
    the reference's results, bit for bit again on a rerun and with the BlockMask."""
    _, shape, causal = CONFIGS[config]
    b, m, n = shape[:3]
    mask = _block_sparse(rng, (b, 1, m, n))
    seed = int(rng.integers(2**32))
    first = _run(cp, np.random.default_rng(seed), config, mask, "mask", deterministic=True)
    again = _run(cp, np.random.default_rng(seed), config, mask, "BlockMask", deterministic=True)
    for a, c in zip(first[2], again[2]):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(c).view(np.uint16))
    check(*first, (None, mask), causal)
    assert {name for name, _ in kernels} == {"flash_bwd_dkdv_sm90_kernel", "flash_bwd_dq_sm90_kernel"}
    _assert_mapped(kernels, config)


@pytest.mark.parametrize("config", list(_params(["bf16-d64-700x645-gqa", "f16-d64-600x640-staged"])))
def test_a_bias_beside_the_mask_takes_no_map(cp, rng, kernels, config):
    """A bias beside the mask (with dbias): the backward takes no map there
    (dispatch._BWD_SM90_MAP_DROPS) and masks every tile, with the reference's results."""
    from test_gpu_bias_bwd import run

    dtype, shape, causal = CONFIGS[config]
    b, m, n, h = shape[:4]
    mask = _block_sparse(rng, (b, 1, m, n))
    bias = (2.0 * rng.standard_normal((1, h, m, n), dtype=np.float32)).astype(testing.resolve_dtype(dtype))
    inputs, fwd, grads, scores = run(cp, rng, dtype, shape, causal, bias=bias, mask=mask)
    check(inputs, fwd, grads, scores, causal)
    assert kernels and not [v for _, v in kernels if v & dispatch.VAR_BLOCK_MAP]


def test_torch_backward_takes_the_map(cp, rng, kernels):
    """cupyflash.torch's backward with a bool mask (the variant operator, through the same
    plans) launches the mapped wgmma kernels and matches the float64 reference."""
    torch = pytest.importorskip("torch")
    cft = pytest.importorskip("cupyflash.torch")
    config = "f16-d64-520x520-causal"
    dtype, shape, causal = CONFIGS[config]
    b, m, n, h, hk, d = shape
    q, k, v = testing.random_qkv(rng, b, m, n, h, hk, d, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    mask = _block_sparse(rng, (b, 1, m, n))
    t = [torch.from_numpy(np.asarray(x)).cuda().requires_grad_() for x in (q, k, v)]
    out = cft.flash_attn_func(*t, causal=causal, attn_mask=torch.from_numpy(mask).cuda())
    out.backward(torch.from_numpy(np.asarray(dout)).cuda())
    grads = tuple(x.grad.cpu().numpy() for x in t)
    testing.assert_bwd_matches_reference(dout, q, k, v, *grads, causal=causal, attn_mask=mask, floor=1e-3)
    _assert_mapped(kernels, config)
