"""The warp-specialised forward under FlashAttention-4's softmax options (issue 15;
dispatch.FWD_WS_SOFTMAX: the polynomial exp2 on a share of the score fragments,
conditional rescaling, both), against the float64 reference with the repo's rule.

test_gpu_fwd_ws.py's tests run again here, each under every option of OPTIONS (its
ws_on fixture is redefined below with the option switched on): lengths off the tiles,
causal tails, rows and whole query blocks that see no key (out 0, lse -inf), softcap,
ALiBi, windows, sinks and dropout alone and combined, 16k tokens. Then what the options
touch most: a single key at scaled logits 1e9 .. 3e10 (the value row exactly), and
logits that rise block after block in the kernel's walk by less than the rescaling
threshold (the running max stays stale; the terms reach 2^8). Skipped without a GPU,
off compute capability 9.0. Each option compiles its own kernels (NVRTC): the first run
takes minutes; ``-k poly2`` and the like pick one."""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu_fwd_ws import (  # noqa: F401  (collected here, with this module's ws_on)
    WS_KERNEL, test_ws_fwd_fully_masked_rows, test_ws_fwd_head_dim_below_the_tile, test_ws_fwd_long,
    test_ws_fwd_matches_reference, test_ws_fwd_new_pointers_same_plan, test_ws_fwd_strided_views,
    test_ws_variant_alone, test_ws_variant_combination, test_ws_variant_long, test_ws_window_rows_that_see_no_key)
from test_gpu_variants import _extreme_problem, dev, host

import cupyflash
from cupyflash import dispatch, reference, testing

pytestmark = pytest.mark.gpu

#: id -> the options on (both off is test_gpu_fwd_ws.py itself)
OPTIONS = {
    "poly2": dispatch.WsSoftmax(poly_exp2=2),
    "poly4": dispatch.WsSoftmax(poly_exp2=4),
    "cond": dispatch.WsSoftmax(cond_rescale=True),
    "poly2+cond": dispatch.WsSoftmax(poly_exp2=2, cond_rescale=True),
}


@pytest.fixture(params=list(OPTIONS))
def ws_on(request, monkeypatch, launches):
    """test_gpu_fwd_ws.py's fixture (the kernel on at every head_dim, one SM: no split-KV)
    with the option ``request.param`` on; yields the names of the kernels launched."""
    cp = pytest.importorskip("cupy")
    from cupyflash import _gpu, _launch

    cc = tuple(int(c) for c in cp.cuda.Device().compute_capability)
    if cc != (9, 0):
        pytest.skip(f"the warp-specialised forward runs on compute capability 9.0; this GPU is {cc}")
    monkeypatch.setattr(dispatch, "FWD_WS", True)
    monkeypatch.setattr(dispatch, "FWD_WS_SOFTMAX", OPTIONS[request.param])
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: 1)
    _gpu.clear_plans()
    yield launches
    _gpu.clear_plans()


def test_the_plan_takes_the_option(ws_on, rng):
    """The switch reaches the kernel's template arguments (POLY_EXP2, COND_RESCALE)."""
    import cupy

    from cupyflash import _gpu

    q, k, v = (cupy.asarray(x) for x in testing.random_qkv(rng, 1, 256, 256, 2, 2, 128, "float16"))
    call = _gpu.plan_fwd(q, k, v, None, None, softmax_scale=0.1, causal=False, dtype_name="float16", device_id=0)
    option = dispatch.FWD_WS_SOFTMAX
    assert call.plan.main.template.endswith(WS_KERNEL)
    assert call.plan.main.args[8:] == (str(option.poly_exp2), str(option.cond_rescale).lower())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("logit", [1e9, 1e10, 3e10])
@pytest.mark.parametrize("seqlen_k,dominant", [(1, 0), (300, 41), (300, 280)],
                         ids=["one-key", "dominant-walked-last", "dominant-walked-first"])
def test_extreme_logits_give_the_value_row(ws_on, dtype, logit, seqlen_k, dominant):
    """One key at scaled logit 1e9 .. 3e10, the others (three key blocks) at 0: out is its
    value row exactly, lse the logit. The kernel walks the key blocks from the last: the
    dominant key in block 0 moves the max by ~logit at the last step (alpha = 0), in
    block 2 it is there from the start and the later blocks' terms are exp2(-logit) = 0."""
    import cupy

    (q, k, v, _), d, scale = _extreme_problem(cupy, dtype, 128, logit, seqlen_k, dominant)
    kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    out, lse = cupyflash.flash_attn_fwd(*d[:3], softmax_scale=scale, **kw)
    got = host(out, dtype)
    assert ws_on == [WS_KERNEL]
    np.testing.assert_array_equal(got, np.broadcast_to(v[:, dominant:dominant + 1], got.shape))
    np.testing.assert_allclose(host(lse), reference.attention_fwd(q, k, v, scale)[1], rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rise", [1.0, 5.0, 7.9, 8.1, 20.0])
def test_logits_rising_along_the_walk(ws_on, rng, dtype, causal, rise):
    """Key block b's logits (log2 units) sit ``rise`` below block b - 1's, so the running
    max grows by about ``rise`` at each block of the walk (last block first): below the
    threshold (8) conditional rescaling keeps a stale max for several blocks and the
    terms grow towards 2^8; above it every step rescales. fp16 P must not overflow."""
    import cupy

    seqlen, head_dim = 1024, 128
    scale = head_dim ** -0.5
    q, k, v = testing.random_qkv(rng, 1, seqlen, seqlen, 2, 2, head_dim, dtype)
    q32, k32 = q.astype(np.float32), k.astype(np.float32)
    q32[..., 0] = 4.0  # logit offset of key j: 4 · k[j, 0] · scale (natural units)
    k32[:, :, :, 0] = (-(np.arange(seqlen) // 128) * rise * np.log(2) / (4 * scale))[None, :, None]
    q, k = (x.astype(q.dtype) for x in (q32, k32))
    kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    with testing.poisoned_allocations(cupy):
        out, lse = cupyflash.flash_attn_fwd(dev(cupy, q), dev(cupy, k), dev(cupy, v), softmax_scale=scale,
                                            causal=causal, **kw)
        out, lse = host(out, dtype), host(lse)
    assert ws_on == [WS_KERNEL]
    assert np.isfinite(out.astype(np.float32)).all() and np.isfinite(lse).all()
    testing.assert_fwd_matches_reference(q, k, v, out, lse, softmax_scale=scale, causal=causal, floor=1e-3)
