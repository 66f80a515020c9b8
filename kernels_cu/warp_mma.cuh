// warp_mma.cuh: one warp's share of a GEMM whose operands sit in shared
// memory, and the way its accumulator fragments leave registers.
//
// A warp computes acc[MT][NT] (an (MT*16) x (NT*8) tile of C, fp32) += A·B on
// mma.sync.m16n8k16 over K_STEPS steps of 16. Each operand is a SmemTile (see
// tile_io.cuh: row-major, 16-byte chunks, odd row stride) stored either way:
//   A, K_ROWS=false: rows are m, contiguous along k      -> ldmatrix        (Q for S = Q·Kᵀ)
//   A, K_ROWS=true:  rows are k, contiguous along m      -> ldmatrix.trans  (P for Pᵀ·dO)
//   B, K_ROWS=false: rows are n, contiguous along k      -> ldmatrix        (K for S = Q·Kᵀ)
//   B, K_ROWS=true:  rows are k, contiguous along n      -> ldmatrix.trans  (dO for Pᵀ·dO)
// The fragment layouts are those of ptx.cuh; every pattern below hands lane
// 8i + r the row address of row r of the 8x8 matrix that lands in register i.
#pragma once

#include "tile_io.cuh"

namespace cupyflash {

template <typename Tile, bool K_ROWS>
struct AOperand {
    // Byte offset of this lane's ldmatrix row address for m-tile 0, k-step 0.
    //   rows m:  matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
    //   rows k:  the same four, read transposed: (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), ...
    __device__ static __forceinline__ uint32 lane_offset(int m0, int lane) {
        return K_ROWS ? Tile::offset((lane & 7) + ((lane >> 4) << 3), m0 / 8 + ((lane >> 3) & 1))
                      : Tile::offset(m0 + (lane & 15), lane >> 4);
    }
    static constexpr uint32 M_STEP = K_ROWS ? 32 : 16 * Tile::STRIDE * 16;  // next m16 tile
    static constexpr uint32 K_STEP = K_ROWS ? 16 * Tile::STRIDE * 16 : 32;  // next k16 step
    __device__ static __forceinline__ void load(uint32 (&a)[4], uint32 addr) {
        if constexpr (K_ROWS) ldmatrix_x4_trans(a, addr); else ldmatrix_x4(a, addr);
    }
};

template <typename Tile, bool K_ROWS>
struct BOperand {
    // Byte offset of this lane's ldmatrix row address for n-tile pair 0, k-step 0;
    // one x4 load gives {b0, b1} of n-tile 2j and {b0, b1} of n-tile 2j+1.
    //   rows n:  matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
    //   rows k:  (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15), transposed
    __device__ static __forceinline__ uint32 lane_offset(int n0, int lane) {
        return K_ROWS ? Tile::offset(lane & 15, n0 / 8 + (lane >> 4))
                      : Tile::offset(n0 + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    }
    static constexpr uint32 N_STEP = K_ROWS ? 32 : 16 * Tile::STRIDE * 16;  // next n16 pair
    static constexpr uint32 K_STEP = K_ROWS ? 16 * Tile::STRIDE * 16 : 32;
    __device__ static __forceinline__ void load(uint32 (&b)[4], uint32 addr) {
        if constexpr (K_ROWS) ldmatrix_x4_trans(b, addr); else ldmatrix_x4(b, addr);
    }
};

template <int MT, int NT>
__device__ __forceinline__ void clear(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}

// acc += A[m0 : m0 + 16 MT, 0 : 16 K_STEPS] · B[0 : 16 K_STEPS, n0 : n0 + 8 NT].
// a_base / b_base are shared-memory addresses of the tiles; m0, n0 multiples of 16.
// The k loop stays rolled (ROLLED) where unrolling would let the compiler hoist
// fragment loads of later steps and run out of registers.
template <typename T, int MT, int NT, int K_STEPS, typename ATile, bool A_K_ROWS, typename BTile,
          bool B_K_ROWS, bool ROLLED>
__device__ __forceinline__ void warp_gemm(float (&acc)[MT][NT][4], uint32 a_base, int m0, uint32 b_base,
                                          int n0) {
    static_assert(NT % 2 == 0, "B fragments are loaded for pairs of n8 tiles");
    using A = AOperand<ATile, A_K_ROWS>;
    using B = BOperand<BTile, B_K_ROWS>;
    const int lane = threadIdx.x % 32;
    const uint32 a_addr = a_base + A::lane_offset(m0, lane);
    const uint32 b_addr = b_base + B::lane_offset(n0, lane);
    auto k_step = [&](int kk) {
        uint32 a[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) A::load(a[i], a_addr + kk * A::K_STEP + i * A::M_STEP);
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            uint32 b[4];
            B::load(b, b_addr + kk * B::K_STEP + j * B::N_STEP);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                mma_m16n8k16<T>(acc[i][2 * j], a[i], b[0], b[1]);
                mma_m16n8k16<T>(acc[i][2 * j + 1], a[i], b[2], b[3]);
            }
        }
    };
    if constexpr (ROLLED) {
#pragma unroll 1
        for (int kk = 0; kk < K_STEPS; ++kk) k_step(kk);
    } else {
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) k_step(kk);
    }
}

// Repack an accumulator tile (rows m, columns k) as A fragments for a GEMM over
// k, the way FlashAttention-2 feeds P to P·V without a trip through memory:
// the C layout of two adjacent n8 tiles is the A layout of one k16 step.
template <typename T, int MT, int KS>
__device__ __forceinline__ void pack_a(uint32 (&a)[MT][KS][4], const float (&acc)[MT][2 * KS][4]) {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            a[i][kk][0] = TypeTraits<T>::pack(acc[i][2 * kk][0], acc[i][2 * kk][1]);
            a[i][kk][1] = TypeTraits<T>::pack(acc[i][2 * kk][2], acc[i][2 * kk][3]);
            a[i][kk][2] = TypeTraits<T>::pack(acc[i][2 * kk + 1][0], acc[i][2 * kk + 1][1]);
            a[i][kk][3] = TypeTraits<T>::pack(acc[i][2 * kk + 1][2], acc[i][2 * kk + 1][3]);
        }
    }
}

// acc += A · B[0 : 16 KS, n0 : n0 + 8 NT] with A already in registers (pack_a).
template <typename T, int MT, int NT, int KS, typename BTile, bool B_K_ROWS>
__device__ __forceinline__ void warp_gemm_areg(float (&acc)[MT][NT][4], const uint32 (&a)[MT][KS][4],
                                               uint32 b_base, int n0) {
    static_assert(NT % 2 == 0, "B fragments are loaded for pairs of n8 tiles");
    using B = BOperand<BTile, B_K_ROWS>;
    const uint32 b_addr = b_base + B::lane_offset(n0, threadIdx.x % 32);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            uint32 b[4];
            B::load(b, b_addr + kk * B::K_STEP + j * B::N_STEP);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                mma_m16n8k16<T>(acc[i][2 * j], a[i][kk], b[0], b[1]);
                mma_m16n8k16<T>(acc[i][2 * j + 1], a[i][kk], b[2], b[3]);
            }
        }
    }
}

// Round a warp's accumulator tile to T and write it row-major into a SmemTile at
// rows row0.., columns col0.. (col0 a multiple of 8); each value is multiplied
// by scale first. Lane (g, t) writes 4 bytes per row: conflict-free (odd stride).
template <typename T, typename Tile, int MT, int NT>
__device__ __forceinline__ void store_frag(uint32 base, const float (&acc)[MT][NT][4], int row0, int col0,
                                           float scale = 1.f) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32 val = TypeTraits<T>::pack(acc[i][j][2 * h] * scale, acc[i][j][2 * h + 1] * scale);
                const uint32 addr = base + Tile::offset(row0 + i * 16 + h * 8 + g, col0 / 8 + j) + t * 4;
                asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(val));
            }
        }
    }
}

// dst[row, col] += acc for a warp tile of a row-major fp32 global array
// (row_stride floats), rows row0.. below rows_valid, columns col0..: lane
// (g, t) adds the pairs (2t, 2t+1) (red_add_f32x2: one two-wide reduction on
// sm_90).
template <int MT, int NT>
__device__ __forceinline__ void atomic_add_frag(float* dst, int row_stride, const float (&acc)[MT][NT][4],
                                                int row0, int col0, int rows_valid) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + i * 16 + h * 8 + g;
            if (r >= rows_valid) continue;
            float* row = dst + r * row_stride + col0 + 2 * t;
#pragma unroll
            for (int j = 0; j < NT; ++j) red_add_f32x2(row + j * 8, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        }
    }
}

}  // namespace cupyflash
