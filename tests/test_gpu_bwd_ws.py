"""The warp-specialised backward (kernels_cu/flash_bwd_ws.cu, dispatch.BWD_WS) on the GPU
against the float64 reference (the naive rule in the inputs' dtype, cupyflash.testing),
with every CuPy allocation poisoned (0xFF: NaN) so that a gradient or scratch row the
kernels skip shows up. Each test switches the kernel on and checks that it launched:
tails of both sides, bottom-right causal with rows that see no key, GQA (and a GQA group
split over several blocks), head_dim below its padded width, strided views; and the
variants it takes (a window, softcap, ALiBi, sinks, dropout: dispatch.BWD_WS_VARIANTS
switched on) against the reference with the same mask; and at D=64 (BWD_WS_HEAD_DIMS with
64) plain attention without dQ beside the wgmma dQ kernel, at 64 and 128 query rows per
step (BWD_WS_D64_BLOCK_M), and the variants with the kernel's own dQ, the same cases; and
above 128 (192 and 256, and head_dims padded to them) the kernel split by roles, dense,
GQA splits, strided views and the variants. (Packed batches and the other head_dims take
the cp.async or mma.sync kernels: test_gpu_varlen, test_gpu_bwd.)
Skipped without a GPU, and off compute capability 9.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from cupyflash import _launch, testing
from test_gpu_bwd import check, make_problem, run, strided_problem, to_host  # sibling module

pytestmark = pytest.mark.gpu

WS_KERNEL = "flash_bwd_ws_kernel"


@pytest.fixture
def ws(monkeypatch, launches):
    """BWD_WS on (plans made again), on a Hopper GPU; yields the launched kernels' names."""
    cp = pytest.importorskip("cupy")
    from cupyflash import _gpu_bwd, dispatch

    cc = _launch.compute_capability(cp.cuda.Device().id)
    if cc != (9, 0):
        pytest.skip(f"the warp-specialised backward runs on compute capability 9.0; this GPU is {cc}")
    monkeypatch.setattr(dispatch, "BWD_WS", True)
    _gpu_bwd.clear_plans()
    with testing.poisoned_allocations(cp):
        yield launches
    _gpu_bwd.clear_plans()


# (dtype, head_dim, causal, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv)
DENSE = [
    ("float16", 128, False, 2, 384, 384, 4, 2),
    ("bfloat16", 128, True, 1, 1000, 1500, 4, 2),
    ("float16", 128, True, 1, 1500, 1000, 4, 1),   # bottom-right: the first 500 rows see no key
    ("bfloat16", 128, False, 2, 129, 257, 2, 2),
    ("float16", 120, True, 1, 640, 8, 4, 2),       # head_dim 120 on the 128 kernel; 8 keys
    ("bfloat16", 104, False, 2, 203, 113, 4, 4),
    ("float16", 128, False, 3, 1, 17, 2, 1),
    ("bfloat16", 128, True, 2, 17, 1, 2, 2),
    ("bfloat16", 128, True, 1, 4096, 4096, 2, 1),  # 64 query blocks per key block, both stages many times
    # above 128: split by roles (dispatch.bwd_ws_roles), 64-key blocks, dQ added from registers
    ("float16", 256, False, 2, 384, 384, 4, 2),
    ("bfloat16", 256, True, 1, 1000, 1500, 4, 2),
    ("float16", 256, True, 1, 700, 333, 4, 1),     # bottom-right: the first 367 rows see no key
    ("bfloat16", 256, False, 2, 129, 257, 2, 2),
    ("float16", 232, True, 1, 300, 8, 4, 2),       # head_dim 232 on the 256 kernel; 8 keys
    ("bfloat16", 256, False, 3, 1, 17, 2, 1),
    ("bfloat16", 256, True, 1, 2048, 2048, 2, 1),  # 32 query blocks per key block
    ("float16", 192, False, 2, 384, 520, 4, 2),
    ("bfloat16", 192, True, 1, 1000, 700, 4, 4),
    ("float16", 160, True, 2, 203, 113, 4, 2),     # padded to 192
]


@pytest.mark.parametrize("dtype,head_dim,causal,batch,seqlen_q,seqlen_k,nheads_q,nheads_kv", DENSE)
def test_dense(ws, rng, dtype, head_dim, causal, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv):
    host, dev = make_problem(rng, dtype, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    grads = run(dev, dtype, scale, causal, False)
    assert WS_KERNEL in ws
    check(host, grads, dtype, scale, causal)


@pytest.mark.parametrize("head_dim", [120, 128, 256])
def test_rows_that_see_no_key(ws, rng, head_dim):
    """causal, seqlen_q > seqlen_k: rows that see no key get dq = 0; nothing is NaN."""
    host, dev = make_problem(rng, "float16", 2, 300, 70, 4, 2, head_dim)
    grads = run(dev, "float16", 0.125, True, False)
    assert WS_KERNEL in ws
    for g in (to_host(x, "float16") for x in grads):
        assert not np.isnan(g).any()
    np.testing.assert_array_equal(to_host(grads[0], "float16")[:, :230], 0)  # row i sees key j iff j <= i - 230
    check(host, grads, "float16", 0.125, True)


@pytest.mark.parametrize("num_sms,splits", [(3, 1), (6, 2), (100, 4)])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_gqa_group_splits(ws, rng, monkeypatch, num_sms, splits, head_dim):
    """A GQA group's query heads over 1, 2 or 4 blocks: the fp32 partials' epilogue."""
    from cupyflash import _gpu, _gpu_bwd, dispatch

    host, dev = make_problem(rng, "bfloat16", 1, 260, 300, 8, 2, head_dim)  # 3 key blocks x 2 KV heads
    q, k, v, dout = dev
    out, lse = _gpu.fwd(q, k, v, softmax_scale=0.125, causal=True, dtype="bfloat16")
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: num_sms)
    plan = dispatch.select_bwd(batch=1, seqlen_q=260, seqlen_k=300, nheads_q=8, nheads_kv=2, head_dim=head_dim,
                               dtype="bfloat16", causal=True, deterministic=False, vec=True, num_sms=num_sms,
                               cc=(9, 0))
    assert plan.kv_splits == splits
    grads = _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=0.125, causal=True, dtype="bfloat16")
    assert WS_KERNEL in ws and ("flash_bwd_convert_dkv_kernel" in ws) == (splits > 1)
    check(host, grads, "bfloat16", 0.125, True)


@pytest.mark.parametrize("head_dim", [120, 128, 200, 256])
def test_strided_views(ws, rng, head_dim):
    """q, k, v as views into one (B, S, 3, H, D) tensor, dout a strided view: the TMA maps
    take the views' row and head strides."""
    from cupyflash import _gpu, _gpu_bwd

    host, (q, k, v, dout) = strided_problem(rng, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = _gpu.fwd(q, k, v, softmax_scale=scale, causal=True)
    grads = _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=True)
    assert WS_KERNEL in ws
    check(host, grads, "float16", scale, True)


# ----------------------------------------------------------------------------
# Variants (dispatch.BWD_WS_VARIANTS switched on): the helpers of test_gpu_variants,
# forward and backward through the public functions, against the float64 reference with
# the same window, slopes, sinks and (rng_state's Philox) dropout mask
# ----------------------------------------------------------------------------


@pytest.fixture
def ws_variants(ws, monkeypatch):
    """The ws fixture with every variant the kernel takes switched on."""
    from cupyflash import dispatch

    monkeypatch.setattr(dispatch, "BWD_WS_VARIANTS", dispatch.FWD_WS_VARIANTS)
    return ws


def _variants_case(name):
    from test_gpu_variants import OFFSET, SEED, alibi_batch_heads, alibi_heads, sink_logits  # sibling module

    drop = {"dropout_p": 0.17, "rng_state": (SEED, OFFSET)}
    return {
        # window edges on both sides of an unmasked bulk: 300 keys left of the diagonal
        "window+causal": lambda rng, s: {"window_size": (300, -1)},
        "window-96-40": lambda rng, s: {"window_size": (96, 40)},
        "softcap": lambda rng, s: {"softcap": 5.0},
        "alibi": lambda rng, s: {"alibi_slopes": alibi_batch_heads(rng, s[0], s[3])},
        "alibi-heads": lambda rng, s: {"alibi_slopes": alibi_heads(s[3])},
        "sinks": lambda rng, s: {"sinks": sink_logits(rng, s[3])},
        "dropout": lambda rng, s: dict(drop),
        "dropout-p0.5": lambda rng, s: {"dropout_p": 0.5, "rng_state": (SEED, OFFSET)},
        "sinks+window": lambda rng, s: {"window_size": (200, 16), "sinks": sink_logits(rng, s[3])},
        "alibi+sinks": lambda rng, s: {"alibi_slopes": alibi_heads(s[3]), "sinks": sink_logits(rng, s[3])},
        "softcap+dropout": lambda rng, s: {"softcap": 8.0, **drop},
        "sinks+dropout": lambda rng, s: {"sinks": sink_logits(rng, s[3]), **drop},
        "window+softcap+sinks": lambda rng, s: {"window_size": (150, 0), "softcap": 8.0,
                                                "sinks": sink_logits(rng, s[3])},
    }[name]


# (variant case, dtype, (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim), causal, scale multiple)
VARIANT_CASES = [
    ("window+causal", "bfloat16", (1, 1000, 1100, 8, 2, 128), True, 1.0),
    ("window+causal", "float16", (2, 333, 200, 4, 4, 120), True, 1.0),  # top rows see no key; head_dim 120
    ("window-96-40", "float16", (2, 700, 517, 4, 2, 128), False, 1.0),
    ("softcap", "float16", (2, 256, 300, 4, 2, 128), False, 2.0),
    ("softcap", "bfloat16", (1, 200, 333, 8, 2, 128), True, 2.0),
    ("alibi", "bfloat16", (1, 200, 333, 8, 2, 128), True, 1.0),
    ("alibi-heads", "float16", (2, 300, 211, 4, 2, 128), False, 1.0),
    ("sinks", "float16", (2, 256, 300, 4, 2, 128), False, 1.0),
    ("sinks", "bfloat16", (1, 333, 200, 8, 2, 128), True, 1.0),
    ("dropout", "bfloat16", (1, 200, 333, 8, 2, 128), True, 1.0),
    ("dropout", "float16", (2, 300, 211, 4, 2, 120), False, 1.0),
    ("dropout-p0.5", "float16", (1, 640, 700, 4, 1, 128), True, 1.0),
    ("sinks+window", "bfloat16", (1, 400, 390, 8, 2, 128), False, 1.0),
    ("softcap+dropout", "float16", (1, 200, 333, 8, 2, 128), True, 2.0),
    ("sinks+dropout", "bfloat16", (2, 256, 300, 4, 2, 128), False, 1.0),
    ("window+softcap+sinks", "bfloat16", (1, 200, 333, 8, 2, 128), True, 2.0),
    # split by roles: the variant's Pᵀ (softcap: P·(1 − tanh²)) from warpgroup 0 to 1, each
    # drawing dropout's keep bits
    ("window+causal", "bfloat16", (1, 700, 800, 4, 2, 256), True, 1.0),
    ("window-96-40", "float16", (2, 300, 317, 2, 2, 256), False, 1.0),
    ("softcap", "bfloat16", (1, 200, 333, 4, 2, 256), True, 2.0),
    ("alibi", "float16", (1, 200, 333, 4, 2, 256), True, 1.0),
    ("sinks", "bfloat16", (2, 256, 300, 2, 2, 256), False, 1.0),
    ("dropout", "bfloat16", (1, 200, 333, 4, 2, 256), True, 1.0),
    ("dropout-p0.5", "float16", (1, 300, 270, 2, 1, 240), False, 1.0),
    ("alibi+sinks", "float16", (1, 200, 333, 4, 2, 256), True, 1.0),
    ("softcap+dropout", "float16", (1, 200, 333, 4, 2, 192), True, 2.0),
    ("window+softcap+sinks", "bfloat16", (1, 200, 333, 4, 2, 256), True, 2.0),  # Gemma-2's sliding layers
    ("softcap", "float16", (2, 256, 300, 4, 2, 192), False, 2.0),
    ("window-96-40", "bfloat16", (1, 400, 390, 4, 2, 192), False, 1.0),
    ("dropout", "float16", (1, 200, 333, 4, 2, 176), True, 1.0),
    ("sinks+dropout", "bfloat16", (2, 256, 300, 2, 2, 192), False, 1.0),
    ("window+softcap+sinks", "float16", (1, 200, 333, 4, 2, 192), True, 2.0),
]


@pytest.mark.parametrize("name,dtype,shape,causal,scale_mult", VARIANT_CASES,
                         ids=[f"{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}{'-causal' if c[3] else ''}"
                              for c in VARIANT_CASES])
def test_variants(ws_variants, rng, name, dtype, shape, causal, scale_mult):
    cp = pytest.importorskip("cupy")
    from test_gpu_variants import check_dense, run_dense  # sibling module

    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    variants = _variants_case(name)(rng, shape)
    scale = scale_mult / math.sqrt(shape[-1])
    inputs, fwd, grads = run_dense(cp, rng, dtype, shape, causal, variants, scale)
    assert WS_KERNEL in ws_variants
    check_dense(inputs, fwd, grads, causal, variants, scale)


@pytest.mark.parametrize("name", ["alibi+dropout", "softcap+alibi"])
def test_variant_sets_that_spill_stay_on_the_cp_async_kernel(ws_variants, rng, name):
    """dispatch.BWD_WS_VARIANT_SPILLS: switched on, these still run (and pass) on the other kernel."""
    cp = pytest.importorskip("cupy")
    from test_gpu_variants import OFFSET, SEED, alibi_heads, check_dense, run_dense  # sibling module

    shape = (1, 200, 333, 8, 2, 128)
    variants = {"alibi_slopes": alibi_heads(shape[3])}
    variants.update({"dropout_p": 0.17, "rng_state": (SEED, OFFSET)} if name == "alibi+dropout" else {"softcap": 5.0})
    inputs, fwd, grads = run_dense(cp, rng, "float16", shape, True, variants)
    assert WS_KERNEL not in ws_variants and "flash_bwd_dkdv_sm90_kernel" in ws_variants
    check_dense(inputs, fwd, grads, True, variants)


def test_a_set_that_spills_at_256_stays_on_the_mma_sync_kernel(ws_variants, rng):
    """dispatch._BWD_WS_ROLES_SPILLS: softcap with dropout at 256 runs (and passes) on flash_bwd.cu."""
    cp = pytest.importorskip("cupy")
    from test_gpu_variants import OFFSET, SEED, check_dense, run_dense  # sibling module

    variants = {"softcap": 8.0, "dropout_p": 0.17, "rng_state": (SEED, OFFSET)}
    scale = 2.0 / math.sqrt(256)
    inputs, fwd, grads = run_dense(cp, rng, "float16", (1, 200, 333, 4, 2, 256), True, variants, scale)
    assert WS_KERNEL not in ws_variants and "flash_bwd_dkdv_kernel" in ws_variants
    check_dense(inputs, fwd, grads, True, variants, scale)


# ----------------------------------------------------------------------------
# D=64 (dispatch.BWD_WS_HEAD_DIMS with 64): plain, the ws kernel without dQ, 64 or 128 query
# rows per step (BWD_WS_D64_BLOCK_M), then the wgmma dQ kernel (no dq_accum, no convert
# kernel); with a variant, the ws kernel with its own dQ (dq_accum, the convert kernel)
# ----------------------------------------------------------------------------


@pytest.fixture(params=[64, 128], ids=lambda m: f"block_m{m}")
def ws_d64(request, ws, monkeypatch):
    """The ws fixture at D=64 with BWD_WS_D64_BLOCK_M = the parameter and every variant the
    kernel takes; yields a D64Run. Every plan cache (the public entry points' too) is emptied
    before and after, so that no plan made under these settings outlives them."""
    from cupyflash import _gpu, dispatch

    monkeypatch.setattr(dispatch, "BWD_WS_HEAD_DIMS", (64, 128))
    monkeypatch.setattr(dispatch, "BWD_WS_D64_BLOCK_M", request.param)
    monkeypatch.setattr(dispatch, "BWD_WS_VARIANTS", dispatch.FWD_WS_VARIANTS)
    _gpu.clear_plans()
    ws_args = []
    recording_call = _launch.Launcher.__call__  # conftest's (it records the names)

    def call(self, stream, *pointers, var=None):
        ws_args.extend(spec.args for spec in self.launches if spec.template.endswith(WS_KERNEL))
        recording_call(self, stream, *pointers, var=var)

    monkeypatch.setattr(_launch.Launcher, "__call__", call)
    yield D64Run(ws, ws_args, request.param)
    _gpu.clear_plans()


@dataclass
class D64Run:
    names: list        # the launched kernels' names
    ws_args: list      # the ws launches' template arguments
    d64_block_m: int   # BWD_WS_D64_BLOCK_M

    @staticmethod
    def expected(variant, d64_block_m):
        """What a D=64 plan launches (dispatch.bwd_ws_separate_dq): plain, the ws kernel
        without dQ at ``d64_block_m`` rows per step, then the wgmma dQ kernel; with a variant,
        the ws kernel with its own dQ at 64 rows, then the convert kernel. Returns the ws
        launch's (HEAD_DIM, BLOCK_M, WITH_DQ, VARIANT), a kernel that ran and one that did not."""
        if variant:
            return ("64", "64", "true", str(variant)), "flash_bwd_convert_dq_kernel", "flash_bwd_dq_sm90_kernel"
        return ("64", str(d64_block_m), "false", "0"), "flash_bwd_dq_sm90_kernel", "flash_bwd_convert_dq_kernel"

    def check_launched(self, variant=0):
        """The ws kernel ran in the dQ mode and at the rows per step ``variant`` takes (expected)."""
        ws_args, present, absent = self.expected(variant, self.d64_block_m)
        assert WS_KERNEL in self.names and present in self.names and absent not in self.names
        assert {(a[1], a[2], a[5], a[6]) for a in self.ws_args} == {ws_args}


DENSE_64 = [
    ("float16", 64, False, 2, 384, 384, 4, 2),
    ("bfloat16", 64, True, 1, 1000, 1500, 4, 2),
    ("float16", 64, True, 1, 1500, 1000, 4, 1),   # bottom-right: the first 500 rows see no key
    ("float16", 64, True, 1, 200, 1000, 2, 2),    # 200 rows: one full and one partial 128-row block
    ("bfloat16", 48, False, 2, 203, 113, 4, 4),   # head_dim 48 and 40 on the 64 kernel
    ("float16", 40, True, 1, 640, 8, 4, 2),
    ("float16", 64, False, 3, 1, 17, 2, 1),
    ("bfloat16", 64, True, 2, 17, 1, 2, 2),
    ("bfloat16", 64, True, 1, 4096, 4096, 2, 1),  # 32-64 query blocks per key block
]


@pytest.mark.parametrize("dtype,head_dim,causal,batch,seqlen_q,seqlen_k,nheads_q,nheads_kv", DENSE_64)
def test_d64_dense(ws_d64, rng, dtype, head_dim, causal, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv):
    host, dev = make_problem(rng, dtype, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    grads = run(dev, dtype, scale, causal, False)
    ws_d64.check_launched()
    check(host, grads, dtype, scale, causal)


@pytest.mark.parametrize("head_dim", [40, 64])
def test_d64_rows_that_see_no_key(ws_d64, rng, head_dim):
    host, dev = make_problem(rng, "bfloat16", 2, 300, 70, 4, 2, head_dim)
    grads = run(dev, "bfloat16", 0.125, True, False)
    ws_d64.check_launched()
    for g in (to_host(x, "bfloat16") for x in grads):
        assert not np.isnan(g).any()
    np.testing.assert_array_equal(to_host(grads[0], "bfloat16")[:, :230], 0)
    check(host, grads, "bfloat16", 0.125, True)


@pytest.mark.parametrize("num_sms,splits", [(3, 1), (100, 4)])
def test_d64_gqa_group_splits(ws_d64, rng, monkeypatch, num_sms, splits):
    from cupyflash import _gpu, _gpu_bwd, dispatch

    host, dev = make_problem(rng, "float16", 1, 260, 300, 8, 2, 64)
    q, k, v, dout = dev
    out, lse = _gpu.fwd(q, k, v, softmax_scale=0.125, causal=True)
    monkeypatch.setattr(_launch, "num_sms", lambda device_id: num_sms)
    plan = dispatch.select_bwd(batch=1, seqlen_q=260, seqlen_k=300, nheads_q=8, nheads_kv=2, head_dim=64,
                               dtype="float16", causal=True, deterministic=False, vec=True, num_sms=num_sms,
                               cc=(9, 0))
    assert plan.kv_splits == splits
    grads = _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=0.125, causal=True)
    ws_d64.check_launched()
    assert ("flash_bwd_convert_dkv_kernel" in ws_d64.names) == (splits > 1)
    check(host, grads, "float16", 0.125, True)


def test_d64_strided_views(ws_d64, rng):
    from cupyflash import _gpu, _gpu_bwd

    host, (q, k, v, dout) = strided_problem(rng, 64)
    out, lse = _gpu.fwd(q, k, v, softmax_scale=0.125, causal=True)
    grads = _gpu_bwd.bwd(dout, q, k, v, out, lse, softmax_scale=0.125, causal=True)
    ws_d64.check_launched()
    check(host, grads, "float16", 0.125, True)


# (variant case, dtype, shape, causal, scale multiple): every variant at D=64 (the ws kernel
# with its own dQ, at 64 rows per step)
VARIANT_CASES_64 = [
    ("window+causal", "bfloat16", (1, 1000, 1100, 8, 2, 64), True, 1.0),
    ("window-96-40", "float16", (2, 700, 517, 4, 2, 64), False, 1.0),
    ("softcap", "bfloat16", (1, 200, 333, 8, 2, 64), True, 2.0),
    ("alibi", "bfloat16", (1, 200, 333, 8, 2, 64), True, 1.0),
    ("alibi-heads", "float16", (2, 300, 211, 4, 2, 40), False, 1.0),
    ("sinks", "float16", (2, 256, 300, 4, 2, 64), False, 1.0),
    ("dropout", "bfloat16", (1, 200, 333, 8, 2, 64), True, 1.0),
    ("sinks+window", "bfloat16", (1, 400, 390, 8, 2, 64), False, 1.0),
    ("alibi+sinks", "float16", (1, 1500, 1000, 4, 1, 64), True, 1.0),  # bottom-right: rows that see no key
    ("softcap+dropout", "float16", (1, 200, 333, 8, 2, 64), True, 2.0),
    ("window+softcap+sinks", "bfloat16", (1, 200, 333, 8, 2, 64), True, 2.0),
]


@pytest.mark.parametrize("name,dtype,shape,causal,scale_mult", VARIANT_CASES_64,
                         ids=[f"{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}{'-causal' if c[3] else ''}"
                              for c in VARIANT_CASES_64])
def test_d64_variants(ws_d64, rng, name, dtype, shape, causal, scale_mult):
    cp = pytest.importorskip("cupy")
    from test_gpu_variants import check_dense, run_dense  # sibling module

    from cupyflash import _variant

    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    variants = _variants_case(name)(rng, shape)
    scale = scale_mult / math.sqrt(shape[-1])
    inputs, fwd, grads = run_dense(cp, rng, dtype, shape, causal, variants, scale)
    ws_d64.check_launched(_variant.bits(variants))
    check_dense(inputs, fwd, grads, causal, variants, scale)
