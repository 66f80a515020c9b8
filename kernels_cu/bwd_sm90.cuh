// bwd_sm90.cuh: what both Hopper dK/dV kernels share (flash_bwd_sm90.cu, every warp
// loads with cp.async; flash_bwd_ws.cu, warp-specialised with TMA, and its dbias kernel
// flash_bwd_dbias_ws.cu, which takes the roles, the products and Pᵀ): the step's
// products for one warpgroup's 64 keys of a BLOCK_N-key block against BLOCK_M query
// rows, computed transposed (keys as rows), the step's Pᵀ with its variant
// (PtOperands: the variant code of the scores, written once for both kernels), and the
// epilogue that writes dK and dV. Q, dO, K, V and dSᵀ are Swizzle128Tile tiles
// (wgmma.cuh); every GEMM is one wgmma group, which the caller waits for.
#pragma once

#include "params.cuh"
#include "seqlens.cuh"
#include "bwd_rows.cuh"
#include "tile_io.cuh"
#include "variant.cuh"
#include "wgmma.cuh"

namespace cupyflash {

// The warp roles of the warp-specialised backward kernels (flash_bwd_ws.cu, flash_bwd_dbias_ws.cu):
// a producer warpgroup that gives its registers up (setmaxnreg) and two consumer warpgroups;
// TMA boxes of 64 elements per row (cupyflash/_tma.py BOX_COLS).
struct BwdWsRoles {
    static constexpr int CONSUMERS = 2;
    static constexpr int NUM_THREADS = 128 * (1 + CONSUMERS);
    static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS = 240;
    static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * CONSUMER_THREADS <= 65536, "more registers than an SM has");
    static constexpr int BOX_COLS = 64;
};

// A step's lse_log2 and delta (BLOCK_M rows of each from query row m0 of (b, h)) into
// shared memory at rows, by one warp, lane l taking rows l, l + 32, ..: past the sequence
// lse_log2 = +inf (P = 0) and delta = 0. The ws kernels' producer; the caller arrives.
template <int BLOCK_M>
__device__ __forceinline__ void load_step_rows(float* rows, const BwdParams& p, int b, int h, const SeqLens& seq,
                                               int m0, int lane) {
    const int64 row_index = query_row_index(p, b, h, seq, m0);
    const int rows_valid = seq.seqlen_q - m0;
#pragma unroll
    for (int i = 0; i < BLOCK_M / 32; ++i) {
        const int r = lane + 32 * i;
        const bool valid = r < rows_valid;
        rows[r] = valid ? __ldg(p.lse_log2 + row_index + r) : __int_as_float(0x7f800000);
        rows[BLOCK_M + r] = valid ? __ldg(p.delta + row_index + r) : 0.f;
    }
}

// acc (64 keys x BLOCK_M) = X·Yᵀ for warpgroup wg's 64 keys of the key-side tile at sX
// (BLOCK_N rows: K or V) against the BLOCK_M rows at sY (Q or dO): Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ;
// one group.
template <typename T, int BLOCK_M, int BLOCK_N, int HEAD_DIM>
__device__ __forceinline__ void issue_keys_ss(float (&acc)[BLOCK_M / 8][4], uint32 sX, uint32 sY, int wg) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        Wgmma<T, BLOCK_M>::template ss<0, 0>(acc, desc_k_major<BLOCK_N>(sX, wg * 64, kk),
                                             desc_k_major<BLOCK_M>(sY, 0, kk), kk > 0);
    }
    wgmma_commit();
}

// Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for warpgroup wg's 64 keys of the K, V tiles (BLOCK_N rows)
// against the BLOCK_M rows of Q, dO: two groups, Sᵀ's the older.
template <typename T, int BLOCK_M, int BLOCK_N, int HEAD_DIM>
__device__ __forceinline__ void issue_st_dpt(float (&st)[BLOCK_M / 8][4], float (&dpt)[BLOCK_M / 8][4], uint32 sK,
                                             uint32 sV, uint32 sQ, uint32 sdO, int wg) {
    wgmma_fence();
    issue_keys_ss<T, BLOCK_M, BLOCK_N, HEAD_DIM>(st, sK, sQ, wg);
    issue_keys_ss<T, BLOCK_M, BLOCK_N, HEAD_DIM>(dpt, sV, sdO, wg);
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

// Dropout's keep bits (variant.cuh's Dropout, the forward's counters) of the step's Pᵀ
// tile, st[j][e] (j < 8: BLOCK_M = 64 query columns): key key0 + g + 8 (e / 2), query
// q0 + 8 j + (e & 1), with key0 the warp's first key (a multiple of 8) and q0 = m0 + 2 t.
// One Philox call decides 8 keys of one query: keys key0 + 8 c .. + 7, the rows g = 0
// .. 7 of one t. Those 8 lanes need the same 32 calls; lane g makes the 4 of n8 tile
// j = g and the 8 exchange the bits.
struct KeepBitsT {
    uint32 w[2];  // element (j, e) kept iff bit 8 e + (j & 3) of w[j / 4]

    __device__ __forceinline__ void draw(const Dropout& drop, int key0, int q0, int g, int t) {
        uint32 mine = 0;  // byte e: the 8 keys key0 + 8 (e / 2) + 0 .. 7 of query q0 + 8 g + (e & 1)
#pragma unroll
        for (int e = 0; e < 4; ++e) mine |= drop.keep8(q0 + 8 * g + (e & 1), (key0 + 8 * (e / 2)) >> 3) << (8 * e);
        // lane (g, t) takes bit g of each byte of lanes (j, t)
        w[0] = w[1] = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j / 4] |= ((__shfl_sync(0xffffffffu, mine, 4 * j + t) >> g) & 0x01010101u) << (j & 3);
    }
    __device__ __forceinline__ bool operator()(int j, int e) const { return (w[j / 4] >> (8 * e + (j & 3))) & 1u; }

    // The A operand of Pᵀ (acc_to_a_operand's layout: a[kk][q] holds n8 tile 2 kk + q / 2,
    // elements 2 (q & 1) (low half) and 2 (q & 1) + 1) with the dropped entries zeroed.
    template <int K_STEPS>
    __device__ __forceinline__ void zero_dropped(const uint32 (&a)[K_STEPS][4], uint32 (&out)[K_STEPS][4]) const {
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int j = 2 * kk + q / 2, e = 2 * (q & 1);
                out[kk][q] = a[kk][q] & (((*this)(j, e) ? 0x0000ffffu : 0u) | ((*this)(j, e + 1) ? 0xffff0000u : 0u));
            }
        }
    }
};

// The step's Pᵀ (BLOCK_M query columns of this warpgroup's 64 keys) as the A operands of
// dV += Pᵀ·dO and of dSᵀ = Pᵀ∘(dPᵀ − delta), for the variant (variant.cuh; the score x =
// ScoreMod(q·k) in log2 units, P = prob(x, lse_log2): sinks are in lse and change nothing
// here). recompute() turns the Sᵀ accumulator into Pᵀ; then
//   dv_a(): Pᵀ, with dropout Pᵀ∘Z (its 1/(1-p) comes in the epilogue: the kernel's
//           acc_dv times dropout_scale),
//   ds_p(): Pᵀ, with softcap P·(1 − tanh²) rounded like P (dS's factor; an fp32 copy
//           would cost D=128 the last 32 registers),
//   keep:   with dropout, Z (ds_from_dp's keep bits: dS takes the undropped P).
template <typename T, int BLOCK_M, bool IS_CAUSAL, int VARIANT>
struct PtOperands {
    static constexpr bool SOFTCAP = (VARIANT & VAR_SOFTCAP) != 0, ALIBI = (VARIANT & VAR_ALIBI) != 0;
    static constexpr bool DROPOUT = (VARIANT & VAR_DROPOUT) != 0;
    static constexpr bool STAGED = (VARIANT & VAR_BIAS_STAGED) != 0;
    static constexpr int M_TILES = BLOCK_M / 8, K_STEPS = BLOCK_M / 16;
    static_assert(!DROPOUT || M_TILES == 8, "KeepBitsT holds 8 query tiles");
    using Mod = ScoreMod<VARIANT, T>;
    uint32 pa[K_STEPS][4], pv[K_STEPS][4], pds[K_STEPS][4];  // Pᵀ; Pᵀ∘Z (dropout); P·(1 − tanh²) (softcap)
    KeepBitsT keep;

    __device__ __forceinline__ uint32 (&dv_a())[K_STEPS][4] { return DROPOUT ? pv : pa; }
    __device__ __forceinline__ uint32 (&ds_p())[K_STEPS][4] { return SOFTCAP ? pds : pa; }

    // Pᵀ of query block m0 of head h (batch b) against keys n0 + key_row0 (+ 8) of the
    // block: element (j, e) of st is key n0 + key_row0 + 8 (e / 2), query m0 + 8 j + 2 t
    // + (e & 1) (in the sequence), lse_log2 the step's BLOCK_M values at s_lse. MASKED:
    // the block needs the mask (masked scores give P = 0); ATTN_MASKED: its bool mask is
    // read (false: the block map's full tile). The sequence's lengths are read back from
    // seq_slot only where used (the mask, ALiBi's offset, the bias's and mask's clamped
    // reads). Terms: StagedScoreTermsT where the bias/mask tile is staged
    // (VAR_BIAS_STAGED; its stage at score_stage, read transposed from the warp's first
    // key key_row0 - g), else ScoreMod reads them (ElementTerms).
    template <bool MASKED, bool ATTN_MASKED, typename Terms = ElementTerms>
    __device__ __forceinline__ void recompute(float (&st)[M_TILES][4], const BwdParams& p, const SeqLensSlot& seq_slot,
                                              const float* s_lse, uint32 score_stage, int b, int h, int n0,
                                              int key_row0, int m0, int g, int t) {
        constexpr bool READS = Mod::BIAS || (Mod::MASK && ATTN_MASKED);
        SeqLens sl{};
        if constexpr (MASKED || ALIBI || (READS && !STAGED)) sl = seq_slot.load();
        const Mask<IS_CAUSAL, VARIANT> mask(p.var, sl.seqlen_q, sl.seqlen_k);
        const Mod mod(p.var, p.softmax_scale_log2, b, h, sl.seqlen_q, sl.seqlen_k);
        [[maybe_unused]] Terms terms;
        if constexpr (STAGED) terms.template load<ATTN_MASKED>(p.var, score_stage, key_row0 - g);
        KeyRows<IS_CAUSAL, VARIANT> key_rows[2] = {{mask, n0 + key_row0}, {mask, n0 + key_row0 + 8}};
        // ALiBi along each of the two keys (ScoreMod::AlibiLine): element (j, e) has d = query
        // + off - key = d0 - c, c = -(8 j + (e & 1)); with causal every element the mask
        // shows has d >= 0, the linear form (else the abs)
        [[maybe_unused]] const typename Mod::AlibiLine lines[2] = {
            mod.template alibi_line<IS_CAUSAL>(m0 + 2 * t + mod.off - (n0 + key_row0), mod.slope_log2),
            mod.template alibi_line<IS_CAUSAL>(m0 + 2 * t + mod.off - (n0 + key_row0 + 8), mod.slope_log2)};
        [[maybe_unused]] float pd[M_TILES][4];  // softcap: P·(1 − tanh²), dS's factor in place of P
#pragma unroll
        for (int j = 0; j < M_TILES; ++j) {
            const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + j * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                [[maybe_unused]] const int key = n0 + key_row0 + (e / 2) * 8, query = m0 + j * 8 + 2 * t + (e & 1);
                const float lse = (e & 1) ? lse2.y : lse2.x;
                float x;
                if constexpr (VARIANT == 0) {  // (at most 1: the preprocess raised lse_log2, flash_bwd.cu)
                    x = fast_exp2(fmaf(st[j][e], p.softmax_scale_log2, -lse));
                } else if constexpr (ALIBI) {
                    const float y =
                        mod.template scaled<IS_CAUSAL>(st[j][e], lines[e / 2], -(8 * j + (e & 1)), query, key);
                    if constexpr (STAGED) x = prob(terms.template apply<ATTN_MASKED>(y, j, e), lse);
                    else x = prob(mod.template with_terms<ATTN_MASKED>(y, query, key), lse);
                } else if constexpr (STAGED) {
                    x = prob(terms.template apply<ATTN_MASKED>(mod.scaled(st[j][e], query, key), j, e), lse);
                } else {
                    x = prob(mod.template score<ATTN_MASKED>(st[j][e], query, key), lse);
                }
                if (MASKED && !key_rows[e / 2].sees(query)) x = 0.f;  // Mask::visible(query, key)
                if constexpr (SOFTCAP) pd[j][e] = x * mod.dscore(st[j][e]);
                st[j][e] = x;
            }
        }
        acc_to_a_operand<T>(st, pa);
        if constexpr (SOFTCAP) acc_to_a_operand<T>(pd, pds);
        // the keep bits depend on no score: drawn here, while the tensor cores work on dPᵀ
        if constexpr (DROPOUT) {
            keep.draw(Dropout(p.var, b, h, p.nheads_q), n0 + key_row0 - g, m0 + 2 * t, g, t);
            keep.zero_dropped(pa, pv);
        }
    }
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

// Between the last step and store_dkdv, in both kernels: dV takes dropout's rp = 1/(1-p),
// kept out of the sum (PtOperands::dv_a is Pᵀ∘Z), and the staging addresses sK, sV are
// made opaque: the ones the prologue's K, V loads computed would otherwise be held
// across the loop, spilled where registers are short.
template <bool DROPOUT, int D_TILES>
__device__ __forceinline__ void prepare_store_dkdv(const BwdParams& p, float (&acc_dv)[D_TILES][4], uint32& sK,
                                                   uint32& sV) {
    if constexpr (DROPOUT) {
#pragma unroll
        for (int j = 0; j < D_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dv[j][e] *= p.var.dropout_scale;
    }
    asm volatile("" : "+r"(sK), "+r"(sV));
}

// Where a GQA group split over several blocks (kv_splits > 1) writes the fp32 partial dK
// rows of the block's keys from n0 (split's rows of dkv_accum); dV's lie kv_splits x the
// rows of one split further on (dkv_partial_dv).
template <int HEAD_DIM>
__device__ __forceinline__ float* dkv_partial_dk(const BwdParams& p, const SeqLens& seq, int b, int h_kv, int split,
                                                 int n0) {
    return p.dkv_accum + (split * key_rows(p) + key_row_index(p, b, h_kv, seq, n0)) * HEAD_DIM;
}
template <int HEAD_DIM>
__device__ __forceinline__ float* dkv_partial_dv(const BwdParams& p, float* dk_part) {
    return dk_part + p.kv_splits * key_rows(p) * HEAD_DIM;
}

// One accumulator (dK or dV, where a warpgroup holds one: flash_bwd_ws.cu split by roles) of
// this thread's key rows key_row0 and key_row0 + 8, times scale: with kv_splits > 1 written
// as fp32 to the partial rows at part (the rows before keys_valid), else staged in T into the
// KVTile at sX for store_staged_dkdv. (store_dkdv keeps its own loops over both: written
// through this, flash_bwd_sm90.cu's staged-bias kernel spilled 8 bytes.)
template <typename T, int HEAD_DIM, typename KVTile>
__device__ __forceinline__ void put_key_rows(const BwdParams& p, const float (&acc)[HEAD_DIM / 8][4], float scale,
                                             float* part, uint32 sX, int key_row0, int keys_valid, int t) {
    constexpr int D_TILES = HEAD_DIM / 8;
    if (p.kv_splits > 1) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = key_row0 + hh * 8;
            if (row >= keys_valid) continue;
#pragma unroll
            for (int j = 0; j < D_TILES; ++j) {
                *reinterpret_cast<float2*>(part + row * HEAD_DIM + j * 8 + 2 * t) =
                    make_float2(acc[j][2 * hh] * scale, acc[j][2 * hh + 1] * scale);
            }
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < D_TILES; ++j) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const uint32 x2 = TypeTraits<T>::pack(acc[j][2 * hh] * scale, acc[j][2 * hh + 1] * scale);
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(sX + KVTile::offset(key_row0 + hh * 8, j) + t * 4),
                         "r"(x2));
        }
    }
}

// The staged dK and dV tiles at sK, sV (put_key_rows's, every row staged and visible to
// all THREADS threads) to dk, dv: the block's keys n0 .. n0 + keys_valid - 1 of (batch b,
// KV head h_kv), in 16-byte chunks (thread: this thread's index among them, store_tile's).
template <typename T, int BLOCK_N, int HEAD_DIM, int THREADS, bool EVEN_K, typename KVTile>
__device__ __forceinline__ void store_staged_dkdv(const BwdParams& p, const SeqLens& seq, int b, int h_kv, int n0,
                                                  int keys_valid, uint32 sK, uint32 sV, uint32 thread) {
    T* dk = static_cast<T*>(p.dk) + b * p.dk_batch_stride + h_kv * p.dk_head_stride +
            int64(seq.k_start + n0) * p.dk_row_stride;
    T* dv = static_cast<T*>(p.dv) + b * p.dv_batch_stride + h_kv * p.dv_head_stride +
            int64(seq.k_start + n0) * p.dv_row_stride;
    store_tile<T, BLOCK_N, HEAD_DIM, THREADS, true, EVEN_K, KVTile>(dk, p.dk_row_stride, sK, keys_valid, p.head_dim,
                                                                    thread);
    store_tile<T, BLOCK_N, HEAD_DIM, THREADS, true, EVEN_K, KVTile>(dv, p.dv_row_stride, sV, keys_valid, p.head_dim,
                                                                    thread);
}

// The epilogue of the block's keys n0 .. n0 + keys_valid - 1 of (batch b, KV head h_kv),
// where each thread holds both accumulators of its rows key_row0 and key_row0 + 8:
// dK·softmax_scale and dV. A GQA group split over several blocks (kv_splits > 1) writes
// fp32 partials straight from registers; else the rows are staged in T through the K and
// V tiles at sK, sV (the caller has made sure no thread still reads them), sync() waits
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
    store_staged_dkdv<T, BLOCK_N, HEAD_DIM, THREADS, EVEN_K, KVTile>(p, seq, b, h_kv, n0, keys_valid, sK, sV, thread);
}

}  // namespace cupyflash
