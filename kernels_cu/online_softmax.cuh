// online_softmax.cuh: the running row max and row sum of FlashAttention-2
// (Dao 2023, Algorithm 1), kept in fp32 registers in the layout of the mma
// accumulator fragments, plus the final normalisation that yields lse.
//
// Scores arrive unscaled (raw q.k); softmax_scale * log2(e) is folded into one
// FMA before exp2. The output accumulator stays unnormalised until finalize().
#pragma once

#include "ptx.cuh"

namespace cupyflash {

template <int M_TILES>
struct OnlineSoftmax {
    float row_max[M_TILES][2];  // raw-score units; rows g and g+8 of each m-tile
    float row_sum[M_TILES][2];  // this thread's share; reduced over the quad at the end

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) { row_max[i][h] = NEG_INF; row_sum[i][h] = 0.f; }
        }
    }

    // Turn scores s into unnormalised probabilities p = exp2((s - m_new) * scale_log2)
    // in place, and rescale the output accumulator by exp2((m_old - m_new) * scale_log2).
    // A row whose max is still -inf (every key masked so far) gets p = 0 and no NaN.
    template <int N_TILES, int D_TILES>
    __device__ __forceinline__ void update(float (&s)[M_TILES][N_TILES][4],
                                           float (&acc_o)[M_TILES][D_TILES][4], float scale_log2) {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m_tile = row_max[i][h];
#pragma unroll
                for (int j = 0; j < N_TILES; ++j) {
                    m_tile = fmaxf(m_tile, fmaxf(s[i][j][2 * h], s[i][j][2 * h + 1]));
                }
                const float m_new = quad_max(m_tile);
                // Guard the all-masked row: subtract 0 instead of -inf.
                const float m_scaled = m_new == NEG_INF ? 0.f : m_new * scale_log2;
                const float alpha = fast_exp2(row_max[i][h] * scale_log2 - m_scaled);
                row_max[i][h] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = fast_exp2(fmaf(s[i][j][2 * h + e], scale_log2, -m_scaled));
                        s[i][j][2 * h + e] = p;
                        sum += p;
                    }
                }
                row_sum[i][h] = fmaf(row_sum[i][h], alpha, sum);
#pragma unroll
                for (int d = 0; d < D_TILES; ++d) {
                    acc_o[i][d][2 * h] *= alpha;
                    acc_o[i][d][2 * h + 1] *= alpha;
                }
            }
        }
    }

    // Divide the accumulator by the row sum and return lse = m * scale + ln(sum)
    // (natural log). A row that saw no key gets output 0 and lse = -inf.
    template <int D_TILES>
    __device__ __forceinline__ void finalize(float (&acc_o)[M_TILES][D_TILES][4], float softmax_scale,
                                             float (&lse)[M_TILES][2]) {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float sum = quad_sum(row_sum[i][h]);
                const bool empty = !(sum > 0.f);  // also catches NaN
                const float inv = empty ? 0.f : 1.f / sum;
                lse[i][h] = empty ? NEG_INF : row_max[i][h] * softmax_scale + __logf(sum);
#pragma unroll
                for (int d = 0; d < D_TILES; ++d) {
                    acc_o[i][d][2 * h] *= inv;
                    acc_o[i][d][2 * h + 1] *= inv;
                }
            }
        }
    }
};

}  // namespace cupyflash
