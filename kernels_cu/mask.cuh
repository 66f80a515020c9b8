// mask.cuh: which key blocks a query block visits, which of them need a mask,
// and the mask itself.
//
// Causal masks align to the bottom-right corner: query row i sees key j iff
// j <= i + seqlen_k - seqlen_q (the lengths of its own sequence, in a packed batch).
#pragma once

#include "common.cuh"

namespace cupyflash {

// Number of key blocks visible to query rows [m0, m0 + block_m).
template <bool IS_CAUSAL>
__device__ __forceinline__ int n_block_end(int m0, int block_m, int block_n, int seqlen_q, int seqlen_k) {
    int keys = seqlen_k;
    if (IS_CAUSAL) keys = min(keys, max(0, m0 + block_m + seqlen_k - seqlen_q));
    return ceil_div(keys, block_n);
}

// Key blocks below this index are in bounds and fully visible to every row of
// [m0, m0 + block_m): they need no mask.
template <bool IS_CAUSAL>
__device__ __forceinline__ int n_block_unmasked_end(int m0, int block_n, int seqlen_q, int seqlen_k) {
    int full = seqlen_k / block_n;
    if (IS_CAUSAL) {
        // block n is fully visible iff (n + 1) * block_n - 1 <= m0 + seqlen_k - seqlen_q
        const int last_key_for_first_row = m0 + seqlen_k - seqlen_q;
        full = min(full, last_key_for_first_row < 0 ? 0 : (last_key_for_first_row + 1) / block_n);
    }
    return full;
}

// Set to -inf the scores of one mma accumulator tile set that fall past the key
// tail or above the causal diagonal. s[i][j][e]: m-tile i, n-tile j, element e
// of the m16n8 fragment (rows g and g+8, columns 2t and 2t+1).
//   row0: global query row of element 0 of m-tile 0 (lane row g).
//   col0: global key column of element 0 of n-tile 0 (lane column 2t).
template <int M_TILES, int N_TILES, bool IS_CAUSAL>
__device__ __forceinline__ void apply_mask(float (&s)[M_TILES][N_TILES][4], int row0, int col0,
                                           int seqlen_q, int seqlen_k) {
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + i * 16 + half * 8;
            int col_limit = seqlen_k;  // first invisible column
            if (IS_CAUSAL) col_limit = min(col_limit, max(0, row + 1 + seqlen_k - seqlen_q));
#pragma unroll
            for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (col0 + j * 8 + e >= col_limit) s[i][j][half * 2 + e] = NEG_INF;
                }
            }
        }
    }
}

// Set to -inf the scores at or past a per-row column limit: col_limit[i][half]
// is the first invisible key of fragment row (i, half). For kernels whose rows
// are not one query row each (the decode kernel's packed query heads).
template <int M_TILES, int N_TILES>
__device__ __forceinline__ void apply_col_limits(float (&s)[M_TILES][N_TILES][4], int col0,
                                                 const int (&col_limit)[M_TILES][2]) {
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (col0 + j * 8 + e >= col_limit[i][half]) s[i][j][half * 2 + e] = NEG_INF;
                }
            }
        }
    }
}

}  // namespace cupyflash
