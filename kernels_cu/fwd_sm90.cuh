// fwd_sm90.cuh: what both wgmma forwards share (flash_fwd_sm90.cu, every warp
// loads with cp.async; flash_fwd_ws.cu, warp-specialised with TMA): the two GEMMs
// of one key block for one warpgroup's 64 query rows, and the epilogue that
// stores those rows' O and lse. Q, K and V are Swizzle128Tile tiles (wgmma.cuh).
#pragma once

#include "params.cuh"
#include "seqlens.cuh"
#include "tile_io.cuh"
#include "wgmma.cuh"

namespace cupyflash {

// S = Q·Kᵀ for warpgroup wg's 64 rows of the BLOCK_M-row Q tile at sQ and the
// BLOCK_N-key K tile at sK, both from shared memory: one wgmma group, which the
// caller waits for.
template <typename T, int BLOCK_M, int BLOCK_N, int HEAD_DIM>
__device__ __forceinline__ void issue_qk(float (&s)[BLOCK_N / 8][4], uint32 sQ, int wg, uint32 sK) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        Wgmma<T, BLOCK_N>::template ss<0, 0>(s, desc_k_major<BLOCK_M>(sQ, wg * 64, kk),
                                             desc_k_major<BLOCK_N>(sK, 0, kk), kk > 0);
    }
    wgmma_commit();
}

// O += P·V with P in registers (acc_to_a_operand's) and the V tile at sV read
// MN-major: one wgmma group, which the caller waits for.
template <typename T, int BLOCK_N, int HEAD_DIM>
__device__ __forceinline__ void issue_pv(float (&acc_o)[HEAD_DIM / 8][4], const uint32 (&pa)[BLOCK_N / 16][4],
                                         uint32 sV) {
    fence_operands(acc_o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        Wgmma<T, HEAD_DIM>::template rs<1>(acc_o, pa[kk], desc_mn_major<BLOCK_N>(sV, kk));
    }
    wgmma_commit();
}

// The epilogue of warpgroup wg (threads threadIdx.x % 128 of it): lse, and O
// (normalised) staged through the warpgroup's own 64 rows of the Q tile at sQ
// (no other warpgroup reads them; the caller has waited for its own last wgmma on
// them), then 16-byte stores. bar_id: a named barrier of this warpgroup's alone.
// r0: this thread's first fragment row in the block (r0 and r0 + 8). thread: its
// threadIdx.x (store_tile's; r0 must be derived from the same value).
template <typename T, int BLOCK_M, int HEAD_DIM, bool EVEN_K>
__device__ __forceinline__ void store_fwd_rows(const FwdParams& p, const float (&acc_o)[HEAD_DIM / 8][4],
                                               const float (&lse)[2], int b, int h, int m0, int r0, int wg,
                                               uint32 sQ, int bar_id, uint32 thread = threadIdx.x) {
    using QTile = Swizzle128Tile<T, BLOCK_M, HEAD_DIM>;
    const int t = thread % 4;
    const SeqLens se = seq_lens(p, b);
    const int rows_valid = min(BLOCK_M, se.seqlen_q - m0);
    float* lse_rows = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + se.q_start + m0;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int row = r0 + hh * 8;
        if (t == 0 && row < rows_valid) lse_rows[row] = lse[hh];
    }
    asm volatile("bar.sync %0, 128;\n" :: "r"(bar_id));
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; ++d) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const uint32 val = TypeTraits<T>::pack(acc_o[d][2 * hh], acc_o[d][2 * hh + 1]);
            const uint32 addr = sQ + QTile::offset(r0 + hh * 8, d) + t * 4;  // n8 tile d = chunk d
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(val));
        }
    }
    asm volatile("bar.sync %0, 128;\n" :: "r"(bar_id));
    T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + int64(se.q_start + m0 + wg * 64) * p.o_row_stride +
             h * p.o_head_stride;
    store_tile<T, 64, HEAD_DIM, 128, true, EVEN_K, QTile, false>(out, p.o_row_stride, sQ + wg * 64 * 128,
                                                                 rows_valid - wg * 64, p.head_dim, thread);
}

}  // namespace cupyflash
