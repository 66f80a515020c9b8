// query_grid.cuh: which (batch, head, query block) a thread block owns in the
// kernels parallel over query blocks: the forwards (flash_fwd.cu, flash_fwd_sm90.cu,
// flash_fwd_ws.cu) and both deterministic dQ kernels (flash_bwd.cu,
// flash_bwd_sm90.cu), whose block's rows dq_block() finds; and which (batch, KV head,
// split, key block) in the dK/dV kernels, parallel over key blocks (key_tile_coords).
#pragma once

#include "params.cuh"
#include "seqlens.cuh"

namespace cupyflash {

// Query blocks of one head are adjacent in the grid (K/V reuse in L2); causal
// runs each head's heaviest (last) query blocks first. The block index's type
// sets the division's (signed in the forwards, unsigned in the dQ kernels, as
// each was measured).
struct TileCoords {
    int b, h, h_kv, m_block;
};
template <bool IS_CAUSAL, typename Index>
__device__ __forceinline__ TileCoords query_tile_coords(Index block, int num_m_blocks, int nheads_q,
                                                        int nheads_kv) {
    const int bh = block / num_m_blocks;
    int m_block = block % num_m_blocks;
    if (IS_CAUSAL) m_block = num_m_blocks - 1 - m_block;
    const int h = bh % nheads_q;
    return {bh / nheads_q, h, h / (nheads_q / nheads_kv), m_block};
}

// The forward's: reading %ctaid through volatile asm lets the epilogue recompute
// this instead of keeping pointers live across the key loop.
template <bool IS_CAUSAL>
__device__ __forceinline__ TileCoords fwd_tile_coords(const FwdParams& p) {
    uint32 x;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
    return query_tile_coords<IS_CAUSAL>(int(x), p.num_m_blocks, p.nheads_q, p.nheads_kv);
}

// A dQ kernel's block (flash_bwd.cu, flash_bwd_sm90.cu: one block per query block of
// one (batch, head)): its tile and its sequence; the caller returns at once when m0 >=
// seq.seqlen_q (a block past the end of a shorter sequence of a packed batch), then
// takes its rows of Q and dO and the start of its KV head's K and V (dq_rows).
struct DqBlock {
    int b, h, h_kv, m_block, m0, rows_valid;
    SeqLens seq;
};
template <bool IS_CAUSAL>
__device__ __forceinline__ DqBlock dq_block(const BwdParams& p, int block_m) {
    const TileCoords tc = query_tile_coords<IS_CAUSAL>(blockIdx.x, ceil_div(p.seqlen_q, block_m), p.nheads_q,
                                                       p.nheads_kv);
    const SeqLens seq = seq_lens(p, tc.b);
    const int m0 = tc.m_block * block_m;
    return {tc.b, tc.h, tc.h_kv, tc.m_block, m0, min(block_m, seq.seqlen_q - m0), seq};
}
template <typename T>
struct DqRows {
    const T *q, *dout, *k, *v;
};
template <typename T>
__device__ __forceinline__ DqRows<T> dq_rows(const BwdParams& p, const DqBlock& d) {
    return {static_cast<const T*>(p.q) + d.b * p.q_batch_stride + d.h * p.q_head_stride +
                int64(d.seq.q_start + d.m0) * p.q_row_stride,
            static_cast<const T*>(p.dout) + d.b * p.do_batch_stride + d.h * p.do_head_stride +
                int64(d.seq.q_start + d.m0) * p.do_row_stride,
            static_cast<const T*>(p.k) + d.b * p.k_batch_stride + d.h_kv * p.k_head_stride +
                int64(d.seq.k_start) * p.k_row_stride,
            static_cast<const T*>(p.v) + d.b * p.v_batch_stride + d.h_kv * p.v_head_stride +
                int64(d.seq.k_start) * p.v_row_stride};
}

// A dK/dV kernel's block (flash_bwd.cu, flash_bwd_sm90.cu, flash_bwd_ws.cu): key block
// n_block of (batch b, KV head h_kv), visiting the query heads h_first .. h_first + heads
// - 1 of the group's share split (of kv_splits). The key blocks of one (batch, KV head,
// split) are adjacent in the grid (Q/dO reuse in L2); causal runs the heaviest key
// blocks (small n) first.
struct KeyTileCoords {
    int n_block, split, b, h_kv, heads, h_first;
};
__device__ __forceinline__ KeyTileCoords key_tile_coords(const BwdParams& p, int block_n, uint32 block) {
    const int num_n_blocks = ceil_div(p.seqlen_k, block_n);
    const int n_block = block % num_n_blocks;
    const int split = (block / num_n_blocks) % p.kv_splits;
    const int bh_kv = block / num_n_blocks / p.kv_splits;
    const int b = bh_kv / p.nheads_kv, h_kv = bh_kv % p.nheads_kv;
    const int heads = p.nheads_q / p.nheads_kv / p.kv_splits;
    return {n_block, split, b, h_kv, heads, (h_kv * p.kv_splits + split) * heads};
}
__device__ __forceinline__ KeyTileCoords key_tile_coords(const BwdParams& p, int block_n) {
    return key_tile_coords(p, block_n, blockIdx.x);
}
// The same with %ctaid read through volatile asm: an epilogue recomputes the tile
// instead of holding the prologue's coordinates across the loop (flash_bwd_ws.cu).
__device__ __forceinline__ KeyTileCoords key_tile_coords_again(const BwdParams& p, int block_n) {
    uint32 block;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(block));
    return key_tile_coords(p, block_n, block);
}
}  // namespace cupyflash
