// online_softmax.cuh: the running row max of FlashAttention-2 (Dao 2023,
// Algorithm 1) kept in fp32 registers in the layout of the mma accumulator
// fragments, the rescaling of the accumulators, and the final normalisation
// that yields lse.
//
// Scores arrive unscaled (raw q.k); softmax_scale * log2(e) is folded into one
// FMA before exp2. The mma.sync kernel does not add the row sums up here: it
// accumulates them on the Tensor Cores as one more n8 tile, P·1 (acc_l), next to
// P·V. That keeps no fp32 copy of P alive past the softmax (the adds otherwise get
// scheduled below P·V and cost ~30 registers at D=128), and it normalises by the
// sum of exactly the rounded P that multiplied V. The wgmma kernel has registers
// to spare but no spare tile, and keeps fp32 partial sums instead.
#pragma once

#include "ptx.cuh"

namespace cupyflash {

template <int M_TILES>
struct OnlineSoftmax {
    float row_max[M_TILES][2];  // raw-score units; rows g and g+8 of each m-tile

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) { row_max[i][0] = NEG_INF; row_max[i][1] = NEG_INF; }
    }

    // Turn row (i, h) of the scores s into unnormalised probabilities
    // p = exp2((s - m_new) * scale_log2) in place, update the running max, and
    // return the factor exp2((m_old - m_new) * scale_log2) that rescales what was
    // accumulated for that row. A row whose max is still -inf (every key masked so
    // far) gets p = 0 and no NaN.
    template <int N_TILES>
    __device__ __forceinline__ float exp_row(float (&s)[M_TILES][N_TILES][4], int i, int h, float scale_log2) {
        float m_tile = row_max[i][h];
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) m_tile = fmaxf(m_tile, fmaxf(s[i][j][2 * h], s[i][j][2 * h + 1]));
        const float m_new = quad_max(m_tile);
        // Guard the all-masked row: subtract 0 instead of -inf.
        const float m_scaled = m_new == NEG_INF ? 0.f : m_new * scale_log2;
        const float alpha = fast_exp2(row_max[i][h] * scale_log2 - m_scaled);
        row_max[i][h] = m_new;
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) {
            s[i][j][2 * h] = fast_exp2(fmaf(s[i][j][2 * h], scale_log2, -m_scaled));
            s[i][j][2 * h + 1] = fast_exp2(fmaf(s[i][j][2 * h + 1], scale_log2, -m_scaled));
        }
        return alpha;
    }

    // s becomes P; the accumulators (acc_o = P·V, acc_l = P·1) are rescaled.
    template <int N_TILES, int D_TILES>
    __device__ __forceinline__ void update(float (&s)[M_TILES][N_TILES][4], float (&acc_o)[M_TILES][D_TILES][4],
                                           float (&acc_l)[M_TILES][4], float scale_log2) {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float alpha = exp_row(s, i, h, scale_log2);
                acc_l[i][2 * h] *= alpha;
                acc_l[i][2 * h + 1] *= alpha;
#pragma unroll
                for (int d = 0; d < D_TILES; ++d) {
                    acc_o[i][d][2 * h] *= alpha;
                    acc_o[i][d][2 * h + 1] *= alpha;
                }
            }
        }
    }

    // For kernels with no spare Tensor Core tile for P·1 (wgmma): s becomes P,
    // acc_o is rescaled, and each thread keeps fp32 partial row sums of its own
    // columns in row_sum (rows g, g+8 of each m-tile), summed across the quad by
    // finalize_sums.
    template <int N_TILES, int D_TILES>
    __device__ __forceinline__ void update(float (&s)[M_TILES][N_TILES][4], float (&acc_o)[M_TILES][D_TILES][4],
                                           float (&row_sum)[M_TILES][2], float scale_log2) {
        float alpha[M_TILES][2];
        update_sums(s, row_sum, scale_log2, alpha);
        rescale(acc_o, alpha);
    }

    // update() in two parts, for kernels whose O += P·V of the previous key block is
    // still in flight when the next block's scores arrive (FlashAttention-3's
    // intra-warpgroup overlap): update_sums turns s into P and rescales and adds to
    // the thread-partial row sums, leaving in alpha each row's factor for acc_o;
    // rescale applies it once that product has landed (before the next one is issued).
    template <int N_TILES>
    __device__ __forceinline__ void update_sums(float (&s)[M_TILES][N_TILES][4], float (&row_sum)[M_TILES][2],
                                                float scale_log2, float (&alpha)[M_TILES][2]) {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                alpha[i][h] = exp_row(s, i, h, scale_log2);
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < N_TILES; ++j) sum += s[i][j][2 * h] + s[i][j][2 * h + 1];
                row_sum[i][h] = fmaf(row_sum[i][h], alpha[i][h], sum);
            }
        }
    }
    template <int D_TILES>
    __device__ __forceinline__ static void rescale(float (&acc_o)[M_TILES][D_TILES][4],
                                                   const float (&alpha)[M_TILES][2]) {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int d = 0; d < D_TILES; ++d) {
                    acc_o[i][d][2 * h] *= alpha[i][h];
                    acc_o[i][d][2 * h + 1] *= alpha[i][h];
                }
            }
        }
    }

    // Divide the accumulator by the row sum and return lse = m * scale + ln(sum)
    // (natural log). A row that saw no key gets output 0 and lse = -inf.
    template <int D_TILES>
    __device__ __forceinline__ void finalize(float (&acc_o)[M_TILES][D_TILES][4], const float (&acc_l)[M_TILES][4],
                                             float softmax_scale, float (&lse)[M_TILES][2]) {
        float sums[M_TILES][2];
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
            sums[i][0] = acc_l[i][0];  // every column of P·1 holds the whole row sum
            sums[i][1] = acc_l[i][2];
        }
        normalize(acc_o, sums, softmax_scale, lse);
    }
    // The same from thread-partial row sums (the wgmma kernels' update).
    template <int D_TILES>
    __device__ __forceinline__ void finalize_sums(float (&acc_o)[M_TILES][D_TILES][4],
                                                  const float (&row_sum)[M_TILES][2], float softmax_scale,
                                                  float (&lse)[M_TILES][2]) {
        float sums[M_TILES][2];
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
            sums[i][0] = quad_sum(row_sum[i][0]);
            sums[i][1] = quad_sum(row_sum[i][1]);
        }
        normalize(acc_o, sums, softmax_scale, lse);
    }

    template <int D_TILES>
    __device__ __forceinline__ void normalize(float (&acc_o)[M_TILES][D_TILES][4], const float (&sums)[M_TILES][2],
                                              float softmax_scale, float (&lse)[M_TILES][2]) {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float sum = sums[i][h];
                const bool empty = !(sum > 0.f);    // also catches NaN
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
