"""The public functions' hot path on the GPU: preallocated outputs, the plan cache,
torch's allocator, and CUDA graph capture and replay (skipped without a GPU).

Inputs are fresh random float16 data; outputs are NaN-poisoned; results are
checked against the float64 reference with cupyflash.testing's rule, or
bitwise against the same kernels writing fresh arrays.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import testing

pytestmark = pytest.mark.gpu

B, SQ, SK, HQ, HKV, D = 2, 160, 200, 4, 2, 64


def _cp():
    return pytest.importorskip("cupy")


def _inputs(rng, xp, seqlen_q=SQ, seqlen_k=SK):
    q, k, v = testing.random_qkv(rng, B, seqlen_q, seqlen_k, HQ, HKV, D, "float16", xp)
    dout = testing.random_normal(rng, q.shape, "float16", xp)
    return q, k, v, dout


def _nan_like(cp, x, shape=None):
    return cp.full(x.shape if shape is None else shape, np.nan, dtype=x.dtype)


def _check_fwd_bwd(q, k, v, dout, out, lse, dq, dk, dv, causal):
    """Against the float64 reference; host copies keep the dtype (the naive rule's precision)."""
    host = [x.get() for x in (q, k, v, dout)]
    testing.assert_fwd_matches_reference(*host[:3], out.get(), lse.get(), causal=causal)
    testing.assert_bwd_matches_reference(host[3], *host[:3], *(g.get() for g in (dq, dk, dv)), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_preallocated_strided_outputs_match_fresh_ones(rng, causal):
    cp = _cp()
    q, k, v, dout = _inputs(rng, cp)
    want_out, want_lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal)
    want = cupyflash.flash_attn_bwd(dout, q, k, v, want_out, want_lse, causal=causal, deterministic=True)
    # out: every other head of a wider buffer; lse: a slice of a longer one; both NaN-poisoned
    out_big = _nan_like(cp, q, (B, SQ, 2 * HQ, D))
    lse_big = cp.full((B, HQ, SQ + 40), np.nan, cp.float32)
    out, lse = out_big[:, :, ::2], lse_big[:, :, 40:]
    got_out, got_lse = cupyflash.flash_attn_fwd(q, k, v, causal=causal, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    cp.testing.assert_array_equal(out, want_out)
    cp.testing.assert_array_equal(lse, want_lse)
    assert cp.isnan(out_big[:, :, 1::2]).all() and cp.isnan(lse_big[:, :, :40]).all()
    dq_big = _nan_like(cp, q, (B, SQ, HQ, 2 * D))
    dq, dk, dv = dq_big[..., :D], _nan_like(cp, k), _nan_like(cp, v)
    got = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                   dq=dq, dk=dk, dv=dv)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    for g, w in zip(got, want):
        cp.testing.assert_array_equal(g, w)
    assert cp.isnan(dq_big[..., D:]).all()
    _check_fwd_bwd(q, k, v, dout, out, lse, dq, dk, dv, causal)


def test_a_repeated_call_is_planned_once(monkeypatch, rng):
    cp = _cp()
    from cupyflash import _api, _gpu, _gpu_bwd

    plans = []
    for module, name in ((_gpu, "plan_fwd"), (_gpu_bwd, "plan_bwd")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _n=name, **kw: plans.append(_n) or _real(*a, **kw))
    for _ in range(3):
        q, k, v, dout = _inputs(rng, cp)
        out, lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
        dq, dk, dv = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True)
    assert plans == ["plan_fwd", "plan_bwd"]
    _check_fwd_bwd(q, k, v, dout, out, lse, dq, dk, dv, True)


def test_split_kv_forward_through_the_hot_path(rng):
    """One query row against many keys: the split-KV plan, whose scratch the call allocates."""
    cp = _cp()
    q, k, v, dout = _inputs(rng, cp, seqlen_q=1, seqlen_k=4096)
    from cupyflash import _api

    out, lse = cupyflash.flash_attn_fwd(q, k, v)
    entries = [e for e in _api._FWD_ENTRIES.values() if getattr(e, "call", None) is not None]
    assert any(e.call.plan.num_splits > 1 for e in entries)
    testing.assert_fwd_matches_reference(*(x.get() for x in (q, k, v)), out.get(), lse.get())


@pytest.mark.parametrize("causal", [False, True])
def test_cupy_graph_capture_and_replay_on_new_data(rng, causal):
    cp = _cp()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v, dout = _inputs(rng, cp)
        out, lse = _nan_like(cp, q), cp.full((B, HQ, SQ), np.nan, cp.float32)
        dq, dk, dv = _nan_like(cp, q), _nan_like(cp, k), _nan_like(cp, v)

        def step():
            cupyflash.flash_attn_fwd(q, k, v, causal=causal, out=out, lse=lse)
            cupyflash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, dq=dq, dk=dk, dv=dv)

        step()  # plans and compiles; fills the memory pool the capture then draws from
        stream.synchronize()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        for x in (out, lse, dq, dk, dv):
            x.fill(np.nan)
        new = _inputs(rng, cp)  # new data, written into the captured buffers
        for dst, src in zip((q, k, v, dout), new):
            dst[...] = src
        graph.launch(stream)
        stream.synchronize()
    _check_fwd_bwd(q, k, v, dout, out, lse, dq, dk, dv, causal)


def test_cupy_graph_of_decode_steps(rng):
    """Generation's loop: one decode step (append the new key and value, attend, advance
    the device lengths) captured once in a CUDA graph, then replayed step after step on
    new queries. The split-KV scratch the capture allocated stays the graph's
    (``_launch.GRAPH_SCRATCH``): arrays allocated after the capture are not written by
    the replays. Checked per step against the float64 reference of the cache so far."""
    cp = _cp()
    from cupyflash import _launch
    from test_kvcache import assert_matches_reference

    batch, hq, hkv, d, capacity = 3, 8, 2, 64, 256
    host_k, host_v = (testing.random_normal(rng, (batch, capacity, hkv, d), "float16") for _ in range(2))
    lengths = np.array([5, 100, 0], dtype=np.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        k_cache, v_cache = cp.asarray(host_k), cp.asarray(host_v)
        q_in, k_in, v_in = (cp.empty((batch, 1, h, d), cp.float16) for h in (hq, hkv, hkv))
        seqlens = cp.asarray(lengths)

        def step():
            out, lse = cupyflash.flash_attn_with_kvcache(q_in, k_cache, v_cache, k_in, v_in, cache_seqlens=seqlens,
                                                         num_splits=3, return_lse=True)
            cp.add(seqlens, 1, out=seqlens)  # the next step's lengths, on the device
            return out, lse

        def new_inputs():
            new = [testing.random_normal(rng, x.shape, "float16") for x in (q_in, k_in, v_in)]
            for dst, src in zip((q_in, k_in, v_in), new):
                dst[...] = cp.asarray(src)
            return new

        def check(new, out, lse):
            nonlocal host_k, host_v, lengths
            stream.synchronize()
            ref_k, ref_v = assert_matches_reference(new[0], host_k, host_v, new[1], new[2],
                                                    out.get().astype(np.float32), lse.get(), cache_seqlens=lengths)
            host_k, host_v = ref_k.astype(np.float16), ref_v.astype(np.float16)
            assert np.array_equal(k_cache.get(), host_k) and np.array_equal(v_cache.get(), host_v)
            lengths = lengths + 1
            assert np.array_equal(seqlens.get(), lengths)

        new = new_inputs()
        check(new, *step())  # eager: plans, compiles, fills the pool the capture draws from
        kept = len(_launch.GRAPH_SCRATCH)
        new = new_inputs()
        stream.begin_capture()
        out, lse = step()
        graph = stream.end_capture()
        assert len(_launch.GRAPH_SCRATCH) == kept + 1  # the split-KV scratch, kept for the replays
        guards = [cp.full(512 << i, 0x5A, dtype=cp.uint8) for i in range(12) for _ in range(2)]
        for _ in range(3):
            out.fill(np.nan)
            lse.fill(np.nan)
            graph.launch(stream)
            check(new, out, lse)
            new = new_inputs()
        assert all(bool((g == 0x5A).all()) for g in guards)
    del graph
    _launch.release_graph_scratch()


# ----------------------------------------------------------------------------
# torch
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} sees no CUDA device")
    return torch


def _torch_inputs(torch, rng, requires_grad=False):
    """float16 CUDA tensors (q, k, v, dout)."""
    return tuple(torch.from_numpy(x).to("cuda").requires_grad_(requires_grad) for x in _inputs(rng, np))


def _torch_check(torch, q, k, v, dout, out, grads, causal):
    from cupyflash import reference

    host = [x.detach().cpu().numpy() for x in (q, k, v, dout)]
    ref = reference.attention_fwd(*host[:3], None, causal)[0]
    naive = reference.naive_attention(*host[:3], None, causal, np.float16)[0]
    testing.assert_close_to_reference("out", out.detach().cpu().numpy(), ref, naive, testing.OUT_FACTOR,
                                      testing._floor(ref))
    testing.assert_bwd_matches_reference(host[3], *host[:3], *(g.cpu().numpy() for g in grads), causal=causal)


def test_torch_outputs_come_from_torchs_allocator(torch, rng):
    q, k, v, dout = _torch_inputs(torch, rng)
    cupyflash.flash_attn_fwd(q, k, v)  # plan and compile first
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out, lse = cupyflash.flash_attn_fwd(q, k, v)
    assert torch.cuda.memory_allocated() - before >= out.nbytes + lse.nbytes
    before = torch.cuda.memory_allocated()
    dq, dk, dv = cupyflash.flash_attn_bwd(dout, q, k, v, out, lse)
    assert torch.cuda.memory_allocated() - before >= dq.nbytes + dk.nbytes + dv.nbytes


def test_torch_preallocated_outputs_are_returned(torch, rng):
    q, k, v, dout = _torch_inputs(torch, rng)
    want_out, want_lse = cupyflash.flash_attn_fwd(q, k, v, causal=True)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, HQ, SQ), float("nan"), device="cuda")
    got = cupyflash.flash_attn_fwd(q, k, v, causal=True, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_torch_flash_attn_func_eager_path_calls_the_kernels_directly(monkeypatch, torch, rng):
    from cupyflash import _torch_path
    from cupyflash.torch import flash_attn_func

    calls = []
    for name in ("fwd", "bwd"):
        real = getattr(_torch_path, name)
        monkeypatch.setattr(_torch_path, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    monkeypatch.setattr(_torch_path, "_plan_bwd", _counted(_torch_path._plan_bwd, calls, "plan_bwd"))
    q, k, v, dout = _torch_inputs(torch, rng, requires_grad=True)
    for _ in range(3):
        out = flash_attn_func(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    # the lean path, not the custom op's dispatch; the backward planned once, from the forward's key
    assert calls == ["fwd", "bwd", "plan_bwd"] + ["fwd", "bwd"] * 2
    _torch_check(torch, q, k, v, dout, out, grads, True)


def _counted(fn, calls, name):
    def counted(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return counted


@pytest.mark.parametrize("causal", [False, True])
def test_torch_graph_capture_of_a_training_step(torch, rng, causal):
    from cupyflash.torch import flash_attn_func

    q, k, v, dout = _torch_inputs(torch, rng, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch's graph docs ask
        for _ in range(2):
            out = flash_attn_func(q, k, v, causal=causal)
            torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    new = _torch_inputs(torch, rng)
    with torch.no_grad():
        for dst, src in zip((q, k, v, dout), new):
            dst.copy_(src)
        for x in (out, *grads):
            x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _torch_check(torch, q, k, v, dout, out, grads, causal)
