// fwd_grid.cuh: which (batch, head, query block) a forward thread block owns,
// for both forward kernels (flash_fwd.cu, flash_fwd_sm90.cu).
#pragma once

#include "params.cuh"

namespace cupyflash {

// Which (batch, head, query block) a thread block owns. Query blocks of one head
// are adjacent in the grid (K/V reuse in L2); causal runs each head's heaviest
// query blocks first. Reading %ctaid through volatile asm lets the epilogue
// recompute this instead of keeping pointers live across the key loop.
struct TileCoords {
    int b, h, h_kv, m_block;
};
template <bool IS_CAUSAL>
__device__ __forceinline__ TileCoords fwd_tile_coords(const FwdParams& p) {
    uint32 x;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
    const int bh = int(x) / p.num_m_blocks;
    int m_block = int(x) % p.num_m_blocks;
    if (IS_CAUSAL) m_block = p.num_m_blocks - 1 - m_block;
    const int h = bh % p.nheads_q;
    return {bh / p.nheads_q, h, h / (p.nheads_q / p.nheads_kv), m_block};
}

}  // namespace cupyflash
