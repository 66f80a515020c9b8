// query_grid.cuh: which (batch, head, query block) a thread block owns in the
// kernels parallel over query blocks: both forwards (flash_fwd.cu,
// flash_fwd_sm90.cu) and both deterministic dQ kernels (flash_bwd.cu,
// flash_bwd_sm90.cu).
#pragma once

#include "params.cuh"

namespace cupyflash {

// Query blocks of one head are adjacent in the grid (K/V reuse in L2); causal
// runs each head's heaviest (last) query blocks first (the dQ kernels; the
// forwards' causal order is causal_section_tile_coords'). The block index's type
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

// The causal forwards' order: sections of section_heads (batch, head) pairs, and
// within a section the heaviest query block of every head first, then the next
// heaviest (longest-processing-time first), so the grid ends on its lightest
// blocks. A section's K/V fits in L2 (dispatch.causal_section_heads), so the
// blocks running at once still share their keys there. section_heads = 1 is
// query_tile_coords' order.
__device__ __forceinline__ TileCoords causal_section_tile_coords(int block, int num_m_blocks, int batch_heads,
                                                                 int section_heads, int nheads_q, int nheads_kv) {
    const int section_blocks = section_heads * num_m_blocks;
    const int section = block / section_blocks;
    const int r = block - section * section_blocks;
    const int bh0 = section * section_heads;
    const int heads = min(section_heads, batch_heads - bh0);  // the last section may be short
    const int rank = r / heads;                                // 0 = the heaviest query block
    const int bh = bh0 + (r - rank * heads);
    const int h = bh % nheads_q;
    return {bh / nheads_q, h, h / (nheads_q / nheads_kv), num_m_blocks - 1 - rank};
}

// The forward's: reading %ctaid through volatile asm lets the epilogue recompute
// this instead of keeping pointers live across the key loop.
template <bool IS_CAUSAL>
__device__ __forceinline__ TileCoords fwd_tile_coords(const FwdParams& p) {
    uint32 x;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
    if constexpr (IS_CAUSAL) {
        return causal_section_tile_coords(int(x), p.num_m_blocks, p.batch * p.nheads_q, p.section_heads,
                                          p.nheads_q, p.nheads_kv);
    } else {
        return query_tile_coords<false>(int(x), p.num_m_blocks, p.nheads_q, p.nheads_kv);
    }
}

}  // namespace cupyflash
