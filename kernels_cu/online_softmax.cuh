// online_softmax.cuh: the running row max of FlashAttention-2 (Dao 2023,
// Algorithm 1) kept in fp32 registers in the layout of the mma accumulator
// fragments, the rescaling of the accumulators, and the final normalisation
// that yields lse.
//
// Scores arrive in log2 units (variant.cuh's score_tile: x = softmax_scale·log2(e)·q·k,
// or the variant's modified score), and the running max is taken over those same
// rounded values, so a row's largest term is exactly exp2(0) = 1 at any logit
// magnitude; or, plain scores, raw (exp_raw: the scale folded into the exp2s). A
// row's max may start at its sink (variant.cuh), which then joins the sum in finalize.
// The mma.sync kernel does not add the row sums up here: it accumulates them on the
// Tensor Cores as one more n8 tile, P·1 (acc_l), next to P·V. That keeps no fp32 copy
// of P alive past the softmax (the adds otherwise get scheduled below P·V and cost ~30
// registers at D=128), and it normalises by the sum of exactly the rounded P that
// multiplied V. The wgmma kernel has registers to spare but no spare tile, and keeps
// fp32 partial sums instead.
#pragma once

#include "ptx.cuh"

namespace cupyflash {

template <int M_TILES>
struct OnlineSoftmax {
    float row_max[M_TILES][2];  // log2 units; rows g and g+8 of each m-tile

    // start: -inf, or the rows' sink in log2 units (one head per tile; see init_rows).
    __device__ __forceinline__ void init(float start = NEG_INF) {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) { row_max[i][0] = start; row_max[i][1] = start; }
    }

    // Turn row (i, h) of the scores s into unnormalised probabilities
    // p = exp2(s - m_new) in place, update the running max, and return the factor
    // exp2(m_old - m_new) that rescales what was accumulated for that row. A row
    // whose max is still -inf (every key masked so far) gets p = 0 and no NaN.
    template <int N_TILES>
    __device__ __forceinline__ float exp_row(float (&s)[M_TILES][N_TILES][4], int i, int h) {
        float m_tile = row_max[i][h];
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) m_tile = fmaxf(m_tile, fmaxf(s[i][j][2 * h], s[i][j][2 * h + 1]));
        const float m_new = quad_max(m_tile);
        // Guard the all-masked row: subtract 0 instead of -inf.
        const float m_sub = m_new == NEG_INF ? 0.f : m_new;
        const float alpha = fast_exp2(row_max[i][h] - m_sub);
        row_max[i][h] = m_new;
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) {
            s[i][j][2 * h] = fast_exp2(s[i][j][2 * h] - m_sub);
            s[i][j][2 * h + 1] = fast_exp2(s[i][j][2 * h + 1] - m_sub);
        }
        return alpha;
    }

    // exp_row for every row at once, on raw scores (RAW: variant.cuh's RAW_SCORES, the ws
    // forward's plain scores): s holds q·k, masked to -inf, and scale_log2 =
    // softmax_scale·log2(e) > 0 (the API checks it). The max is taken over the raw scores
    // and scaled once per row (rounding is monotonic: the same m_new as over the scaled
    // ones), and each exp2's argument is one FFMA s·scale_log2 - m_new (FA2's), where a
    // scaled score costs an FMUL in score_tile and an FADD in exp_row. The row's largest
    // term is then exp2 of the product's rounding residual, at most half an ulp of m_new:
    // below RAW_FFMA_BELOW within 2^-13 of 0, so the term rounds to 1 in fp16 and bf16.
    // A warp with a row max at or above it (logits of 1e9 leave a residual up to 32, 3e10
    // up to 1024: inf) scales its scores first for this block (__fmul_rn: never
    // contracted), and the largest term is exactly exp2(0), as exp_row's. One vote per
    // block for all of a thread's rows.
    static constexpr float RAW_FFMA_BELOW = 4096.f;
    template <int N_TILES>
    __device__ __forceinline__ void exp_raw(float (&s)[M_TILES][N_TILES][4], float (&alpha)[M_TILES][2],
                                            float scale_log2) {
        float m_sub[M_TILES][2];
        bool far = false;
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m_tile = NEG_INF;
#pragma unroll
                for (int j = 0; j < N_TILES; ++j) m_tile = fmaxf(m_tile, fmaxf(s[i][j][2 * h], s[i][j][2 * h + 1]));
                const float m_new = fmaxf(row_max[i][h], quad_max(m_tile) * scale_log2);
                m_sub[i][h] = m_new == NEG_INF ? 0.f : m_new;  // the all-masked row, as exp_row's
                alpha[i][h] = fast_exp2(row_max[i][h] - m_sub[i][h]);
                row_max[i][h] = m_new;
                far |= !(fabsf(m_sub[i][h]) < RAW_FFMA_BELOW);
            }
        }
        if (__any_sync(0xffffffffu, far)) {
#pragma unroll
            for (int i = 0; i < M_TILES; ++i)
#pragma unroll
                for (int j = 0; j < N_TILES; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[i][j][e] = __fmul_rn(s[i][j][e], scale_log2);
            scale_log2 = 1.f;  // the FFMA below is then exactly the subtraction
        }
#pragma unroll
        for (int i = 0; i < M_TILES; ++i)
#pragma unroll
            for (int j = 0; j < N_TILES; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[i][j][e] = fast_exp2(fmaf(s[i][j][e], scale_log2, -m_sub[i][e / 2]));
    }

    // s becomes P; the accumulators (acc_o = P·V, acc_l = P·1) are rescaled.
    template <int N_TILES, int D_TILES>
    __device__ __forceinline__ void update(float (&s)[M_TILES][N_TILES][4], float (&acc_o)[M_TILES][D_TILES][4],
                                           float (&acc_l)[M_TILES][4]) {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float alpha = exp_row(s, i, h);
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
    // finalize_sums. RAW, scale_log2: raw scores (exp_raw), here and in update_sums.
    template <bool RAW = false, int N_TILES, int D_TILES>
    __device__ __forceinline__ void update(float (&s)[M_TILES][N_TILES][4], float (&acc_o)[M_TILES][D_TILES][4],
                                           float (&row_sum)[M_TILES][2], float scale_log2 = 1.f) {
        float alpha[M_TILES][2];
        update_sums<RAW>(s, row_sum, alpha, scale_log2);
        rescale(acc_o, alpha);
    }
    // update in two halves, for a kernel whose previous P·V is still in flight
    // while the next scores are turned into P (flash_fwd_ws.cu): s becomes P and the
    // row sums are rescaled and added to; alpha returns the factors that rescale(),
    // called once P·V has completed, applies to acc_o.
    template <bool RAW = false, int N_TILES>
    __device__ __forceinline__ void update_sums(float (&s)[M_TILES][N_TILES][4], float (&row_sum)[M_TILES][2],
                                                float (&alpha)[M_TILES][2], float scale_log2 = 1.f) {
        if constexpr (RAW) exp_raw(s, alpha, scale_log2);
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if constexpr (!RAW) alpha[i][h] = exp_row(s, i, h);
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < N_TILES; ++j) sum += s[i][j][2 * h] + s[i][j][2 * h + 1];
                row_sum[i][h] = fmaf(row_sum[i][h], alpha[i][h], sum);
            }
        }
    }
    template <int D_TILES>
    __device__ __forceinline__ void rescale(float (&acc_o)[M_TILES][D_TILES][4], const float (&alpha)[M_TILES][2]) {
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

    // Divide the accumulator by the row sum (plus the sink's term, when sink, the
    // rows' sink in log2 units, is not -inf), times out_scale (dropout's 1/(1-p)),
    // and return lse = (m + log2(sum))·ln(2) (natural log). A row that saw no key
    // gets output 0 and lse = -inf (the sink, with one).
    template <int D_TILES>
    __device__ __forceinline__ void finalize(float (&acc_o)[M_TILES][D_TILES][4], const float (&acc_l)[M_TILES][4],
                                             float (&lse)[M_TILES][2], float sink = NEG_INF, float out_scale = 1.f) {
        float sums[M_TILES][2];
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
            sums[i][0] = acc_l[i][0];  // every column of P·1 holds the whole row sum
            sums[i][1] = acc_l[i][2];
        }
        normalize(acc_o, sums, lse, sink, out_scale);
    }
    // The same from thread-partial row sums (the wgmma kernels' update).
    template <int D_TILES>
    __device__ __forceinline__ void finalize_sums(float (&acc_o)[M_TILES][D_TILES][4],
                                                  const float (&row_sum)[M_TILES][2], float (&lse)[M_TILES][2],
                                                  float sink = NEG_INF, float out_scale = 1.f) {
        float sums[M_TILES][2];
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
            sums[i][0] = quad_sum(row_sum[i][0]);
            sums[i][1] = quad_sum(row_sum[i][1]);
        }
        normalize(acc_o, sums, lse, sink, out_scale);
    }

    template <int D_TILES>
    __device__ __forceinline__ void normalize(float (&acc_o)[M_TILES][D_TILES][4], const float (&sums)[M_TILES][2],
                                              float (&lse)[M_TILES][2], float sink, float out_scale) {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // row_max >= sink once the max started there: no -inf - -inf
                const float sum = sink == NEG_INF ? sums[i][h] : sums[i][h] + fast_exp2(sink - row_max[i][h]);
                const bool empty = !(sum > 0.f);    // also catches NaN
                const float inv = empty ? 0.f : out_scale / sum;
                lse[i][h] = empty ? NEG_INF : (row_max[i][h] + __log2f(sum)) * LN2;
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
