// query_grid.cuh: which (batch, head, query block) a thread block owns in the
// kernels parallel over query blocks: both forwards (flash_fwd.cu,
// flash_fwd_sm90.cu) and both deterministic dQ kernels (flash_bwd.cu,
// flash_bwd_sm90.cu).
#pragma once

#include "params.cuh"

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

}  // namespace cupyflash
