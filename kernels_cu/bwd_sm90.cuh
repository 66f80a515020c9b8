// bwd_sm90.cuh: what both Hopper dK/dV kernels share (flash_bwd_sm90.cu, every warp
// loads with cp.async; flash_bwd_ws.cu, warp-specialised with TMA): the step's
// products for one warpgroup's 64 keys of a BLOCK_N-key block against BLOCK_M query
// rows, computed transposed (keys as rows), and the epilogue that writes dK and dV.
// Q, dO, K, V and dSᵀ are Swizzle128Tile tiles (wgmma.cuh); every GEMM is one wgmma
// group, which the caller waits for.
#pragma once

#include "params.cuh"
#include "seqlens.cuh"
#include "bwd_rows.cuh"
#include "tile_io.cuh"
#include "wgmma.cuh"

namespace cupyflash {

// Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for warpgroup wg's 64 keys of the K, V tiles (BLOCK_N rows)
// against the BLOCK_M rows of Q, dO: two groups, Sᵀ's the older.
template <typename T, int BLOCK_M, int BLOCK_N, int HEAD_DIM>
__device__ __forceinline__ void issue_st_dpt(float (&st)[BLOCK_M / 8][4], float (&dpt)[BLOCK_M / 8][4], uint32 sK,
                                             uint32 sV, uint32 sQ, uint32 sdO, int wg) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        Wgmma<T, BLOCK_M>::template ss<0, 0>(st, desc_k_major<BLOCK_N>(sK, wg * 64, kk),
                                             desc_k_major<BLOCK_M>(sQ, 0, kk), kk > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        Wgmma<T, BLOCK_M>::template ss<0, 0>(dpt, desc_k_major<BLOCK_N>(sV, wg * 64, kk),
                                             desc_k_major<BLOCK_M>(sdO, 0, kk), kk > 0);
    }
    wgmma_commit();
}

// acc (64 keys x HEAD_DIM) += A (64 keys x BLOCK_M, registers: acc_to_a_operand's) · B
// (the BLOCK_M x HEAD_DIM tile at sB, read MN-major): dV += Pᵀ·dO, dK += dSᵀ·Q. A must
// stay live until the group has completed.
template <typename T, int BLOCK_M, int HEAD_DIM>
__device__ __forceinline__ void issue_keys_rs(float (&acc)[HEAD_DIM / 8][4], const uint32 (&a)[BLOCK_M / 16][4],
                                              uint32 sB) {
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
        Wgmma<T, HEAD_DIM>::template rs<1>(acc, a[kk], desc_mn_major<BLOCK_M>(sB, kk));
    }
    wgmma_commit();
}

// The keep bits of a kernel without dropout (ds_from_dp's Keep; never asked).
struct NoKeep {
    __device__ __forceinline__ bool operator()(int, int) const { return true; }
};

// dSᵀ = Pᵀ∘(dPᵀ∘Z·rp − delta) in place of dPᵀ (the fp32 accumulator, query columns 8 j
// + 2 t (+1)), with Pᵀ as rounded for the A operand p (softcap: P·(1 − tanh²), rounded
// likewise), delta the step's BLOCK_M values at s_delta; with dropout, keep(j, e) the
// keep bit of element (j, e) and dropout_scale rp.
template <typename T, int M_TILES, bool DROPOUT, typename Keep>
__device__ __forceinline__ void ds_from_dp(float (&dpt)[M_TILES][4], const uint32 (&p)[M_TILES / 2][4],
                                           const float* s_delta, int t, const Keep& keep, float dropout_scale) {
#pragma unroll
    for (int j = 0; j < M_TILES; ++j) {
        const float2 delta = *reinterpret_cast<const float2*>(s_delta + j * 8 + 2 * t);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float2 pr = TypeTraits<T>::unpack(p[j / 2][(j % 2) * 2 + hh]);
            float dp0 = dpt[j][2 * hh], dp1 = dpt[j][2 * hh + 1];
            if constexpr (DROPOUT) {
                dp0 = keep(j, 2 * hh) ? dp0 * dropout_scale : 0.f;
                dp1 = keep(j, 2 * hh + 1) ? dp1 * dropout_scale : 0.f;
            }
            dp0 -= delta.x;
            dp1 -= delta.y;
            dpt[j][2 * hh] = pr.x * dp0;
            dpt[j][2 * hh + 1] = pr.y * dp1;
        }
    }
}

// dSᵀ's A operand (key rows key_row0 and key_row0 + 8, query columns from 2 t) into the
// DSTile (key rows, BLOCK_M query columns) at sdS, for dQ = dS·K (read MN-major there).
template <typename DSTile, int BLOCK_M>
__device__ __forceinline__ void store_ds_t(uint32 sdS, const uint32 (&dsa)[BLOCK_M / 16][4], int key_row0, int t) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            // dsa[kk][hh] = (row key_row0 + 8 hh, columns 16 kk + 2t..), [2 + hh] 8 columns on
            const uint32 r = key_row0 + hh * 8;
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(sdS + DSTile::offset(r, 2 * kk) + t * 4),
                         "r"(dsa[kk][hh]));
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(sdS + DSTile::offset(r, 2 * kk + 1) + t * 4),
                         "r"(dsa[kk][2 + hh]));
        }
    }
}

// dQ[0 .. 64, col0 .. col0 + DQ_COLS) = dS·K over all BLOCK_N keys: A = dS read MN-major
// from the dSᵀ tile at sdS (its first 64 query columns), B = the K tile at sK read
// MN-major from column col0.
template <typename T, int BLOCK_N, int DQ_COLS, typename KVTile>
__device__ __forceinline__ void issue_dq(float (&dq)[DQ_COLS / 8][4], uint32 sdS, uint32 sK, int col0) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        Wgmma<T, DQ_COLS>::template ss<1, 1>(
            dq, desc_mn_major<BLOCK_N>(sdS, kk),
            desc_mn_major<BLOCK_N>(sK + (col0 / 64) * KVTile::BLOCK_BYTES + (col0 % 64) * 2, kk), kk > 0);
    }
    wgmma_commit();
}

// The epilogue of the block's keys n0 .. n0 + keys_valid - 1 of (batch b, KV head h_kv):
// dK·softmax_scale and dV, this thread's rows key_row0 and key_row0 + 8. A GQA group
// split over several blocks (kv_splits > 1) writes fp32 partials (split's rows of
// dkv_accum) straight from registers; else the rows are staged in T through the K and V
// tiles at sK, sV (the caller has made sure no thread still reads them), sync() waits
// for all THREADS threads, and they store 16-byte chunks (thread: this thread's index
// among them, store_tile's).
template <typename T, int BLOCK_N, int HEAD_DIM, int THREADS, bool EVEN_K, typename KVTile, typename Sync>
__device__ __forceinline__ void store_dkdv(const BwdParams& p, const float (&acc_dk)[HEAD_DIM / 8][4],
                                           const float (&acc_dv)[HEAD_DIM / 8][4], const SeqLens& seq, int b,
                                           int h_kv, int split, int n0, int keys_valid, int key_row0, int t,
                                           uint32 sK, uint32 sV, Sync sync, uint32 thread) {
    constexpr int D_TILES = HEAD_DIM / 8;
    if (p.kv_splits > 1) {
        const int64 part_rows = key_rows(p);  // rows of one split
        float* dk_part = p.dkv_accum + (split * part_rows + key_row_index(p, b, h_kv, seq, n0)) * HEAD_DIM;
        float* dv_part = dk_part + p.kv_splits * part_rows * HEAD_DIM;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = key_row0 + hh * 8;
            if (row >= keys_valid) continue;
#pragma unroll
            for (int j = 0; j < D_TILES; ++j) {
                const int col = row * HEAD_DIM + j * 8 + 2 * t;
                *reinterpret_cast<float2*>(dk_part + col) =
                    make_float2(acc_dk[j][2 * hh] * p.softmax_scale, acc_dk[j][2 * hh + 1] * p.softmax_scale);
                *reinterpret_cast<float2*>(dv_part + col) = make_float2(acc_dv[j][2 * hh], acc_dv[j][2 * hh + 1]);
            }
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < D_TILES; ++j) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = key_row0 + hh * 8;
            const uint32 dk2 = TypeTraits<T>::pack(acc_dk[j][2 * hh] * p.softmax_scale,
                                                   acc_dk[j][2 * hh + 1] * p.softmax_scale);
            const uint32 dv2 = TypeTraits<T>::pack(acc_dv[j][2 * hh], acc_dv[j][2 * hh + 1]);
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(sK + KVTile::offset(r, j) + t * 4), "r"(dk2));
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(sV + KVTile::offset(r, j) + t * 4), "r"(dv2));
        }
    }
    sync();
    T* dk = static_cast<T*>(p.dk) + b * p.dk_batch_stride + h_kv * p.dk_head_stride +
            int64(seq.k_start + n0) * p.dk_row_stride;
    T* dv = static_cast<T*>(p.dv) + b * p.dv_batch_stride + h_kv * p.dv_head_stride +
            int64(seq.k_start + n0) * p.dv_row_stride;
    store_tile<T, BLOCK_N, HEAD_DIM, THREADS, true, EVEN_K, KVTile>(dk, p.dk_row_stride, sK, keys_valid, p.head_dim,
                                                                    thread);
    store_tile<T, BLOCK_N, HEAD_DIM, THREADS, true, EVEN_K, KVTile>(dv, p.dv_row_stride, sV, keys_valid, p.head_dim,
                                                                    thread);
}

}  // namespace cupyflash
