"""Ring attention (cupyflash.parallel) on N simulated ranks (LoopbackComm), against
the float64 reference with the repo's rule on the unsharded results.

The NCCL communicator cannot run here (one GPU at most): only its refusals are
tested.  Tests marked ``gpu`` run the same loopback schedule on cupy arrays.
"""

from __future__ import annotations

import sys
import threading
import warnings

import numpy as np
import pytest

from cupyflash import flash_attn_fwd, parallel, testing
from cupyflash.parallel import (LoopbackComm, NcclComm, contiguous_shard, contiguous_unshard,
                                merge_by_lse, ring_attn_bwd, ring_attn_fwd, run_ring, zigzag_shard,
                                zigzag_unshard)


def _layout(causal):
    return (zigzag_shard, zigzag_unshard) if causal else (contiguous_shard, contiguous_unshard)


def ring(q, k, v, dout, n_ranks, causal, softmax_scale=None):
    """Shard, run forward and backward on ``n_ranks`` loopback ranks, unshard:
    (out, lse, dq, dk, dv) of the whole sequence."""
    shard, unshard = _layout(causal)

    def rank_fn(comm):
        qs, ks, vs, ds = (shard(x, comm.rank, comm.size) for x in (q, k, v, dout))
        out, lse = ring_attn_fwd(qs, ks, vs, comm=comm, causal=causal, softmax_scale=softmax_scale)
        grads = ring_attn_bwd(ds, qs, ks, vs, out, lse, comm=comm, causal=causal,
                              softmax_scale=softmax_scale)
        return (out, lse) + grads

    per_rank = run_ring(rank_fn, n_ranks)
    out, lse, dq, dk, dv = ([r[i] for r in per_rank] for i in range(5))
    return unshard(out), unshard(lse, axis=2), unshard(dq), unshard(dk), unshard(dv)


def check(q, k, v, dout, n_ranks, causal, softmax_scale=None):
    out, lse, dq, dk, dv = ring(q, k, v, dout, n_ranks, causal, softmax_scale)
    assert out.dtype == q.dtype and dq.dtype == q.dtype and dk.dtype == k.dtype
    assert lse.dtype == np.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    testing.assert_fwd_matches_reference(q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal)
    testing.assert_bwd_matches_reference(dout, q, k, v, dq, dk, dv, softmax_scale=softmax_scale,
                                         causal=causal, out=out)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4])
def test_ring_matches_reference(rng, n_ranks, causal, dtype):
    """GQA (4 query heads on 2 KV heads), 2 chunks of 12 rows per rank."""
    seqlen = 2 * n_ranks * 12
    q, k, v = testing.random_qkv(rng, 2, seqlen, seqlen, 4, 2, 32, dtype)
    dout = testing.random_normal(rng, q.shape, dtype)
    check(q, k, v, dout, n_ranks, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_mha_scale_odd_sizes(rng, causal):
    """MHA, a given scale, head_dim 40, one chunk of 1 row per rank (the smallest zigzag)."""
    q, k, v = testing.random_qkv(rng, 1, 6, 6, 3, 3, 40, "float32")
    dout = testing.random_normal(rng, q.shape, "float32")
    check(q, k, v, dout, 3, causal, softmax_scale=0.3)


def test_ring_cross_attention_non_causal(rng):
    """Non-causal shards of q and k/v may differ in length (cross-attention)."""
    q, k, v = testing.random_qkv(rng, 1, 8, 20, 2, 1, 16, "float32")
    dout = testing.random_normal(rng, q.shape, "float32")
    check(q, k, v, dout, 4, False)


def test_ring_one_rank_is_flash_attn(rng):
    """With one rank the ring is one flash_attn_fwd call, merged with nothing: the same bits."""
    q, k, v = testing.random_qkv(rng, 1, 16, 16, 2, 2, 16, "float32")
    for causal in (False, True):
        out, lse = run_ring(lambda comm: ring_attn_fwd(q, k, v, comm=comm, causal=causal), 1)[0]
        ref_out, ref_lse = flash_attn_fwd(q, k, v, causal=causal)
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_array_equal(lse, ref_lse)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_causal_plan_covers_the_mask_once(size):
    """Over the ring's steps, the (rows, keys, causal) calls of each rank cover the
    global causal mask restricted to its zigzag rows exactly once."""
    c = 3
    seqlen = 2 * size * c
    mask = np.tril(np.ones((seqlen, seqlen), dtype=int))
    pos = np.arange(seqlen)
    for rank in range(size):
        rows = zigzag_shard(pos, rank, size, axis=0)
        covered = np.zeros((2 * c, seqlen), dtype=int)
        for src in range(size):
            keys = zigzag_shard(pos, src, size, axis=0)
            for qs, ks, causal in parallel._causal_plan(rank, src, 2 * c):
                r, k = rows[qs], keys[ks]
                seen = np.tril(np.ones((len(r), len(k)), dtype=int)) if causal else 1
                np.add.at(covered, (np.searchsorted(rows, r)[:, None], k[None, :]), seen)
        np.testing.assert_array_equal(covered, mask[rows])


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_layouts_round_trip(rng, size):
    x = rng.standard_normal((2, 8 * size, 3, 4)).astype(np.float32)
    shards = [zigzag_shard(x, r, size) for r in range(size)]
    assert all(s.shape == (2, 8, 3, 4) for s in shards)
    np.testing.assert_array_equal(zigzag_unshard(shards), x)
    shards = [contiguous_shard(x, r, size) for r in range(size)]
    np.testing.assert_array_equal(contiguous_unshard(shards), x)
    lse = rng.standard_normal((2, 3, 8 * size)).astype(np.float32)
    np.testing.assert_array_equal(zigzag_unshard([zigzag_shard(lse, r, size, axis=2)
                                                  for r in range(size)], axis=2), lse)


def test_zigzag_chunks():
    """Rank r holds chunks r and 2N-1-r, the earlier first."""
    x = np.arange(8)
    assert [zigzag_shard(x, r, 2, axis=0).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [contiguous_shard(x, r, 2, axis=0).tolist() for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_merge_by_lse_matches_one_call(rng):
    """Two halves of the keys, merged, are the attention over all of them."""
    q, k, v = testing.random_qkv(rng, 2, 7, 10, 2, 2, 8, "float32")
    parts = [flash_attn_fwd(q, k[:, sl], v[:, sl]) for sl in (slice(0, 4), slice(4, 10))]
    out = np.zeros(q.shape, np.float32)
    lse = np.full((2, 2, 7), -np.inf, np.float32)
    for o, l in parts:
        out, lse = merge_by_lse(out, lse, o, l)
    ref_out, ref_lse = flash_attn_fwd(q, k, v)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


def test_merge_by_lse_with_rows_that_see_no_key():
    """A -inf partial leaves the other part as it is; -inf on both sides stays -inf with
    out 0; no NaN and no floating-point warning."""
    shape = (1, 3, 1, 2)
    out = np.array([1.0, 2.0, 0.0, 0.0, 0.0, 0.0], np.float32).reshape(shape)
    lse = np.array([[[0.5, -np.inf, -np.inf]]], np.float32)
    part_out = np.array([9.0, 9.0, 3.0, 4.0, 0.0, 0.0], np.float16).reshape(shape)
    part_lse = np.array([[[-np.inf, 1.5, -np.inf]]], np.float32)
    with np.errstate(all="raise"):
        merged, merged_lse = merge_by_lse(out, lse, part_out, part_lse)
    np.testing.assert_array_equal(merged_lse, [[[0.5, 1.5, -np.inf]]])
    np.testing.assert_array_equal(merged.reshape(3, 2), [[1, 2], [3, 4], [0, 0]])
    assert merged.dtype == np.float32 and merged_lse.dtype == np.float32


def test_loopback_passes_copies_round_the_ring():
    def rank_fn(comm):
        mine = np.full(2, comm.rank)
        got = comm.sendrecv_next((mine, mine * 10))
        mine[:] = -1  # the receiver holds a copy
        return [g.tolist() for g in got]

    assert run_ring(rank_fn, 3) == [[[2, 2], [20, 20]], [[0, 0], [0, 0]], [[1, 1], [10, 10]]]


def test_run_ring_raises_a_rank_error_without_hanging():
    def rank_fn(comm):
        if comm.rank == 1:
            raise KeyError("rank 1 broke")
        comm.sendrecv_next((np.zeros(1),))  # the others wait for rank 1

    with pytest.raises(KeyError, match="rank 1 broke"):
        run_ring(rank_fn, 3)
    assert threading.active_count() < 10  # every thread joined


class _Comm:
    def __init__(self, rank=0, size=1, method=True):
        self.rank, self.size = rank, size
        if method:
            self.sendrecv_next = lambda arrays: arrays


@pytest.mark.parametrize("comm, cls, match", [
    (object(), TypeError, "ring_attn_fwd: comm must have a sendrecv_next method"),
    (_Comm(method=False), TypeError, "comm must have a sendrecv_next method"),
    (_Comm(rank=1.0), TypeError, "comm.rank must be an int; got float"),
    (_Comm(rank=2, size=2), ValueError, r"comm.rank must be in \[0, comm.size=2\); got 2"),
])
def test_bad_comm(comm, cls, match):
    q = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(cls, match=match):
        ring_attn_fwd(q, q, q, comm=comm)


def test_bad_inputs():
    comm = _Comm()
    q = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(TypeError, match="cupyflash.ring_attn_fwd: k must have the same dtype as q"):
        ring_attn_fwd(q, q.astype(np.float16), q, comm=comm)
    with pytest.raises(ValueError, match="ring_attn_fwd: .*k must have q's seqlen \\(4\\)"):
        ring_attn_fwd(q, q[:, :2], q[:, :2], comm=comm, causal=True)
    with pytest.raises(ValueError, match="ring_attn_fwd: .*q's seqlen must be even; got 3"):
        ring_attn_fwd(q[:, :3], q[:, :3], q[:, :3], comm=comm, causal=True)
    with pytest.raises(TypeError, match="ring_attn_fwd: causal must be a bool"):
        ring_attn_fwd(q, q, q, comm=comm, causal=1)
    with pytest.raises(ValueError, match="ring_attn_bwd: softmax_scale"):
        ring_attn_bwd(q, q, q, q, q, np.zeros((1, 2, 4), np.float32), comm=comm, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="ring_attn_bwd: lse must have shape"):
        ring_attn_bwd(q, q, q, q, q, np.zeros((1, 4, 2), np.float32), comm=comm)


def test_bad_layout_arguments():
    x = np.zeros((1, 6, 1, 1))
    with pytest.raises(ValueError, match=r"cupyflash.zigzag_shard: x's axis 1 \(length 6\) must be divisible "
                                         r"by 4 \(2 \* size=2\)"):
        zigzag_shard(x, 0, 2)
    with pytest.raises(ValueError, match="contiguous_shard: x's axis 1 .* divisible by 4"):
        contiguous_shard(x, 0, 4)
    with pytest.raises(ValueError, match=r"zigzag_shard: rank must be an int in \[0, size=3\); got 3"):
        zigzag_shard(x, 3, 3)
    with pytest.raises(ValueError, match="contiguous_shard: size must be a positive int; got 0"):
        contiguous_shard(x, 0, 0)
    with pytest.raises(ValueError, match="zigzag_shard: axis must be in"):
        zigzag_shard(x, 0, 1, axis=4)
    with pytest.raises(TypeError, match="zigzag_shard: x must be a numpy or cupy array; got list"):
        zigzag_shard([1, 2], 0, 1)
    with pytest.raises(TypeError, match="zigzag_unshard: shards must be a non-empty list"):
        zigzag_unshard([])
    with pytest.raises(ValueError, match=r"contiguous_unshard: shards\[1\] must have the shape of"):
        contiguous_unshard([x, x[:, :3]])
    with pytest.raises(ValueError, match="zigzag_unshard: shards' axis 1 must have an even length; got 3"):
        zigzag_unshard([x[:, :3]])


def test_nccl_comm_refuses_without_nccl(monkeypatch):
    """Without cupy's NCCL binding (made so here), NcclComm says what is missing."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(RuntimeError, match=r"cupyflash.NcclComm: needs cupy with NCCL \(cupy.cuda.nccl\)"):
        NcclComm(0, 2, b"id")
    with pytest.raises(ValueError, match=r"NcclComm: rank must be an int in \[0, size=2\); got 2"):
        NcclComm(2, 2, b"id")


def test_nccl_comm_refuses_on_this_machine():
    """Where NCCL or a GPU is missing, as on the CPU machines, the error is a clear
    RuntimeError (not a CUDA or NCCL error from deep inside)."""
    try:
        with warnings.catch_warnings():  # cupy warns when libnccl does not load
            warnings.simplefilter("ignore")
            import cupy
            from cupy.cuda import nccl
        usable = bool(getattr(nccl, "available", False)) and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        usable = False
    if usable:
        pytest.skip("NCCL and a GPU are usable here: NcclComm would need the other ranks")
    with pytest.raises(RuntimeError, match="cupyflash.NcclComm: needs"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        NcclComm(0, 2, b"id")


def test_loopback_is_the_protocol():
    """LoopbackComm has what ring_attn_* use: rank, size, sendrecv_next."""
    ring_state = parallel._Ring(2)
    comm = LoopbackComm(ring_state, 1)
    assert (comm.rank, comm.size) == (1, 2) and callable(comm.sendrecv_next)


# ---------------------------------------------------------------- the same on one GPU


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_ranks", [2, 4])
def test_ring_on_gpu_loopback(rng, n_ranks, causal):
    """cupy float16 arrays through the loopback schedule, GQA, head_dim 64."""
    cp = pytest.importorskip("cupy")
    seqlen = 2 * n_ranks * 64
    host = testing.random_qkv(rng, 2, seqlen, seqlen, 4, 2, 64, "float16")
    dout_h = testing.random_normal(rng, host[0].shape, "float16")
    q, k, v, dout = (cp.asarray(x) for x in host + (dout_h,))
    out, lse, dq, dk, dv = ring(q, k, v, dout, n_ranks, causal)
    assert isinstance(out, cp.ndarray) and out.dtype == cp.float16
    testing.assert_fwd_matches_reference(q, k, v, out, lse, causal=causal)
    testing.assert_bwd_matches_reference(dout, q, k, v, dq, dk, dv, causal=causal, out=out)


@pytest.mark.parametrize("change,exc_type,message", [
    (dict(part_lse=np.zeros((1, 1, 16), np.float32)), ValueError,
     r"part_lse must have shape \(batch, nheads_q, seqlen_q\) = \(1, 2, 16\) \(out's\); got \(1, 1, 16\)"),
    (dict(lse=np.zeros((1, 16, 2), np.float32)), ValueError,
     r"lse must have shape \(batch, nheads_q, seqlen_q\) = \(1, 2, 16\) \(out's\); got \(1, 16, 2\)"),
    (dict(part_out=np.zeros((1, 8, 2, 8), np.float32)), ValueError,
     r"part_out must have out's shape \(1, 16, 2, 8\); got \(1, 8, 2, 8\)"),
    (dict(part_out=np.zeros((1, 1, 2, 8), np.float32)), ValueError, "part_out must have out's shape"),
    (dict(out=np.zeros((16, 2, 8), np.float32)), ValueError, "out must have 4 dimensions"),
    (dict(part_lse=[0.0]), TypeError, "part_lse must be a numpy or cupy array; got list"),
    (dict(lse=np.zeros((1, 2, 16), np.int32)), TypeError, "lse must have a float dtype; got int32"),
])
def test_merge_by_lse_refuses_mismatched_parts(change, exc_type, message):
    """Found by QA: merge_by_lse broadcast whatever it was given: a part_lse of shape
    (batch, 1, seqlen_q) was merged silently into every head, and other mismatches ended in
    numpy's bare "operands could not be broadcast together"."""
    args = dict(out=np.zeros((1, 16, 2, 8), np.float32), lse=np.zeros((1, 2, 16), np.float32),
                part_out=np.zeros((1, 16, 2, 8), np.float32), part_lse=np.zeros((1, 2, 16), np.float32))
    args.update(change)
    with pytest.raises(exc_type, match=f"cupyflash.merge_by_lse: {message}"):
        merge_by_lse(**args)
