// flash_fwd_sm90.cu: the FlashAttention-2 forward pass (Dao 2023, Algorithm 1)
// on Hopper warpgroup MMA (wgmma, sm_90a), in the manner of FlashAttention-3
// (Shah et al. 2024) without its producer warps: every warp both loads and computes.
//
// One thread block owns BLOCK_M = 128 query rows of one (batch, head); each of
// its two warpgroups owns 64 of them. Q stays in shared memory; K and V tiles of
// BLOCK_N keys stream through a 3-stage cp.async ring in the 128-byte swizzle
// that wgmma descriptors read directly. S = Q·Kᵀ takes both operands from shared
// memory; the online softmax runs on the S accumulators in registers; O += P·V
// takes P from registers (the S accumulator layout is the A operand layout) and V
// from shared memory, transposed by the descriptor. One barrier per key block:
// it publishes block n's tiles and frees the stage the load for block n-2 reuses.
//
// OVERLAP (experimental, off by default in dispatch) software-pipelines the key
// loop in the manner of FlashAttention-3's intra-warpgroup overlap (Shah et al.
// 2024, section 3.2): each step issues S of its key block and O += P·V of the block
// before together, and runs the softmax of the one while the tensor cores do the
// other. V is then read one step after K, and the ring streams V one block behind K
// (see the main loop).
//
// Template parameters, in order:
//   T           __half or __nv_bfloat16
//   HEAD_DIM    padded head dimension, 64 or 128; runtime head_dim <= HEAD_DIM
//   BLOCK_N     keys per tile (64 or 128)
//   CTAS_PER_SM blocks the registers must leave room for on one SM (1 or 2); two
//               blocks drift apart, so one's softmax overlaps the other's wgmma
//   IS_CAUSAL   bottom-right aligned causal mask
//   EVEN_K      head_dim == HEAD_DIM (no column predicates)
//   OVERLAP     the software-pipelined key loop
// 16-byte loads are assumed (dispatch sends unaligned data to flash_fwd.cu).
// Dense and packed (varlen) batches alike (seqlens.cuh).
#include "params.cuh"
#include "seqlens.cuh"
#include "query_grid.cuh"
#include "ptx.cuh"
#include "tile_io.cuh"
#include "mask.cuh"
#include "online_softmax.cuh"
#include "wgmma.cuh"

namespace cupyflash {

template <typename T_, int HEAD_DIM_, int BLOCK_N_>
struct FwdSm90Traits {
    using T = T_;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr int BLOCK_M = 128;
    static constexpr int BLOCK_N = BLOCK_N_;
    static constexpr int NUM_WARPGROUPS = 2;
    static constexpr int NUM_THREADS = NUM_WARPGROUPS * 128;
    static constexpr int STAGES = 3;            // K/V ring depth
    static constexpr int N_TILES = BLOCK_N / 8;  // n8 column tiles of S per warp
    static constexpr int D_TILES = HEAD_DIM / 8;
    using QTile = Swizzle128Tile<T, BLOCK_M, HEAD_DIM>;
    using KVTile = Swizzle128Tile<T, BLOCK_N, HEAD_DIM>;
    // +1024: the dynamic shared window is aligned up to the swizzle atom in the kernel.
    static constexpr int SMEM_BYTES = QTile::BYTES + 2 * STAGES * KVTile::BYTES + 1024;
};

template <typename T, int HEAD_DIM, int BLOCK_N, int CTAS_PER_SM, bool IS_CAUSAL, bool EVEN_K, bool OVERLAP>
__global__ void __launch_bounds__(256, CTAS_PER_SM)
flash_fwd_sm90_kernel(const FwdParams p) {
    using Tr = FwdSm90Traits<T, HEAD_DIM, BLOCK_N>;
    constexpr int BLOCK_M = Tr::BLOCK_M, N_TILES = Tr::N_TILES, D_TILES = Tr::D_TILES;
    constexpr int NT = Tr::NUM_THREADS, STAGES = Tr::STAGES;
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;

    extern __shared__ __align__(16) unsigned char smem[];
    const uint32 sQ = (smem_addr(smem) + 1023u) & ~1023u;
    const uint32 sK0 = sQ + QTile::BYTES;                       // K stage s at sK0 + s * KVTile::BYTES
    const uint32 sV0 = sK0 + STAGES * KVTile::BYTES;            // V likewise

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wg = warp / 4;                                    // warpgroup: query rows 64 wg ..
    const int g = lane / 4, t = lane % 4;

    const TileCoords tc = fwd_tile_coords<IS_CAUSAL>(p);
    const int b = tc.b, h = tc.h, h_kv = tc.h_kv, m_block = tc.m_block;
    const int m0 = m_block * BLOCK_M;
    const SeqLens seq = seq_lens(p, b);
    if (m0 >= seq.seqlen_q) return;  // past the end of a shorter sequence of a packed batch
    const int n_end = n_block_end<IS_CAUSAL>(m0, BLOCK_M, BLOCK_N, seq.seqlen_q, seq.seqlen_k);
    const int n_unmasked_end = n_block_unmasked_end<IS_CAUSAL>(m0, BLOCK_N, seq.seqlen_q, seq.seqlen_k);
    // This thread's fragment rows within the block: r0 and r0 + 8.
    const int r0 = wg * 64 + (warp % 4) * 16 + g;

    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + int64(seq.q_start + m0) * p.q_row_stride +
                 h * p.q_head_stride;
    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + int64(seq.k_start) * p.k_row_stride +
                 h_kv * p.k_head_stride;
    const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + int64(seq.k_start) * p.v_row_stride +
                 h_kv * p.v_head_stride;
    const int seqlen_k = seq.seqlen_k;
    auto load_k = [&](int n, int stage) {
        load_tile<T, BLOCK_N, HEAD_DIM, NT, true, EVEN_K, KVTile>(sK0 + stage * KVTile::BYTES,
                                                                  k + int64(n) * BLOCK_N * p.k_row_stride,
                                                                  p.k_row_stride, seqlen_k - n * BLOCK_N, p.head_dim);
    };
    auto load_v = [&](int n, int stage) {
        load_tile<T, BLOCK_N, HEAD_DIM, NT, true, EVEN_K, KVTile>(sV0 + stage * KVTile::BYTES,
                                                                  v + int64(n) * BLOCK_N * p.v_row_stride,
                                                                  p.v_row_stride, seqlen_k - n * BLOCK_N, p.head_dim);
    };
    auto load_kv = [&](int n, int stage) { load_k(n, stage); load_v(n, stage); };

    float acc_o[1][D_TILES][4];
#pragma unroll
    for (int d = 0; d < D_TILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][d][e] = 0.f;
    float row_sum[1][2] = {{0.f, 0.f}};
    OnlineSoftmax<1> softmax;
    softmax.init();

    // ---- the two GEMMs of one key block, each its own wgmma group; the caller waits
    auto issue_s = [&](float (&s)[1][N_TILES][4], int stage) {  // S = Q·Kᵀ for this warpgroup's 64 rows
        const uint32 sK = sK0 + stage * KVTile::BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            Wgmma<T, BLOCK_N>::template ss<0, 0>(s[0], desc_k_major<BLOCK_M>(sQ, wg * 64, kk),
                                                 desc_k_major<BLOCK_N>(sK, 0, kk), kk > 0);
        }
        wgmma_commit();
    };
    auto issue_pv = [&](const uint32 (&pa)[BLOCK_N / 16][4], int stage) {  // O += P·V, P in registers
        const uint32 sV = sV0 + stage * KVTile::BYTES;
        fence_operands(acc_o[0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            Wgmma<T, HEAD_DIM>::template rs<1>(acc_o[0], pa[kk], desc_mn_major<BLOCK_N>(sV, kk));
        }
        wgmma_commit();
    };
    auto mask = [&](float (&s)[1][N_TILES][4], int n) {
        const SeqLens sl = seq_lens(p, b);
        apply_mask<1, N_TILES, IS_CAUSAL>(s, m0 + r0, n * BLOCK_N + 2 * t, sl.seqlen_q, sl.seqlen_k);
    };

    if constexpr (!OVERLAP) {
        // Prologue: Q with the first key block, then the second key block (groups 0, 1).
        if (n_end > 0) {
            load_tile<T, BLOCK_M, HEAD_DIM, NT, true, EVEN_K, QTile>(sQ, q, p.q_row_stride, seq.seqlen_q - m0,
                                                                     p.head_dim);
            load_kv(n_end - 1, 0);
        }
        cp_async_commit();
        if (n_end > 1) load_kv(n_end - 2, 1);
        cp_async_commit();

        int stage = 0;  // stage of key block n; block n - 2 goes to stage + 2 (mod 3)
        auto step = [&](int n, auto masked) {
            cp_async_wait<1>();        // this thread's copies of block n have landed
            fence_proxy_async_smem();  // ... and are visible to wgmma
            __syncthreads();           // everyone's have; everyone is done with block n + 1
            // Block n - 2's loads: at D=128 issued behind the S wgmma (their address
            // arithmetic then runs while the tensor cores work: +8% median, PERF.md v11);
            // at D=64, whose S is short, before it (issued behind it, they delayed the
            // softmax: -5%).
            constexpr bool LOADS_UNDER_S = HEAD_DIM >= 128;
            auto load_next = [&] {
                const int free_stage = stage == 0 ? 2 : stage - 1;
                if (n >= 2) load_kv(n - 2, free_stage);
                cp_async_commit();
            };
            if constexpr (!LOADS_UNDER_S) load_next();

            float s[1][N_TILES][4];
            issue_s(s, stage);
            if constexpr (LOADS_UNDER_S) load_next();
            wgmma_wait<0>();
            fence_operands(s[0]);
            if constexpr (decltype(masked)::value) mask(s, n);

            // ---- online softmax: s becomes P, acc_o is rescaled
            fence_operands(acc_o[0]);
            softmax.update(s, acc_o, row_sum, p.softmax_scale_log2);

            // ---- O += P·V, P repacked from the S accumulators as the register A operand
            uint32 pa[BLOCK_N / 16][4];
            acc_to_a_operand<T>(s[0], pa);
            issue_pv(pa, stage);
            wgmma_wait<0>();
            fence_operands(acc_o[0]);
            stage = stage == STAGES - 1 ? 0 : stage + 1;
        };

        // Masked blocks (key tail, causal diagonal) first, then the bulk with no mask code.
        int n = n_end - 1;
        for (; n >= n_unmasked_end; --n) step(n, Bool<true>{});
        for (; n >= 0; --n) step(n, Bool<false>{});
    } else {
        // Software-pipelined: the step of key block n issues S_n = Q·K_nᵀ, rescales
        // acc_o by the factor of the block before (n + 1) while the tensor cores work
        // on S_n, issues O += P_{n+1}·V_{n+1} (P kept in registers since that block's
        // step), waits for S_n only, and runs the softmax of S_n while the tensor
        // cores do P_{n+1}·V_{n+1}. The first step has no product before it; the last
        // block's product follows the loop.
        //
        // Block n's K and V sit in ring stage s(n), with s(n - 1) = s(n) + 1 (mod 3).
        // Step n reads K_n and V_{n+1} and loads K_{n-2} and V_{n-1}, read two steps
        // later (as in the serial loop): V streams one block behind K. Its barrier
        // comes after every warp waited for S_{n+1} and P_{n+2}·V_{n+2} (in step
        // n + 1), so K stage s(n+1) = s(n-2) and V stage s(n+2) = s(n-1) are free;
        // no stage of K or of V is read and written at once:
        //
        //   step n    reads K s(n), V s(n+1)    lands K s(n-1), V s(n)    loads K s(n-2), V s(n-1)
        //
        // Prologue: Q and K of the first block (group 0); K of the second and V of
        // the first (group 1).
        if (n_end > 0) {
            load_tile<T, BLOCK_M, HEAD_DIM, NT, true, EVEN_K, QTile>(sQ, q, p.q_row_stride, seq.seqlen_q - m0,
                                                                     p.head_dim);
            load_k(n_end - 1, 0);
        }
        cp_async_commit();
        if (n_end > 1) load_k(n_end - 2, 1);
        if (n_end > 0) load_v(n_end - 1, 0);
        cp_async_commit();

        __shared__ __align__(8) float wait_slot[2];  // wgmma_wait_after's store; never read
        int stage = 0;                // s(n) of the step's block n
        uint32 pa[BLOCK_N / 16][4];   // P_{n+1}, the register A operand of O += P_{n+1}·V_{n+1}
        float alpha[1][2];            // S_{n+1}'s rescale factor for acc_o, per row
        auto step = [&](int n, auto masked, auto first) {
            cp_async_wait<1>();        // this thread's copies of K_n and V_{n+1} have landed
            fence_proxy_async_smem();  // ... and are visible to wgmma
            __syncthreads();           // everyone's have; everyone is done with K_{n+1} and V_{n+2}
            const int prev = stage == 0 ? STAGES - 1 : stage - 1;  // s(n + 1) = s(n - 2)
            const int next = stage == STAGES - 1 ? 0 : stage + 1;  // s(n - 1) = s(n + 2)

            float s[1][N_TILES][4];
            issue_s(s, stage);
            if constexpr (!decltype(first)::value) {
                OnlineSoftmax<1>::rescale(acc_o, alpha);
                issue_pv(pa, prev);
            }
            if (n >= 2) load_k(n - 2, prev);  // behind both GEMMs
            if (n >= 1) load_v(n - 1, next);
            cp_async_commit();
            // ---- S_n has landed (P_{n+1}·V_{n+1} may still run)
            if constexpr (decltype(first)::value) wgmma_wait<0>(); else wgmma_wait<1>();
            fence_operands(s[0]);
            if constexpr (decltype(masked)::value) mask(s, n);

            // ---- online softmax of S_n: s becomes P_n, the row sums are updated; acc_o
            //      waits for P_{n+1}·V_{n+1} and the next step
            softmax.update_sums(s, row_sum, p.softmax_scale_log2, alpha);

            // ---- P_{n+1}·V_{n+1} has landed: its A registers take P_n
            if constexpr (!decltype(first)::value) {
                wgmma_wait_after<0>(smem_addr(wait_slot), row_sum[0][0], row_sum[0][1]);
                fence_operands(pa);
                fence_operands(acc_o[0]);
            }
            acc_to_a_operand<T>(s[0], pa);
            stage = next;
        };

        // Masked blocks (key tail, causal diagonal) first, then the bulk with no mask
        // code. The first step (no product before it) always masks: on a block that
        // needs none the mask changes nothing.
        int n = n_end - 1;
        if (n >= 0) step(n--, Bool<true>{}, Bool<true>{});
        for (; n >= n_unmasked_end; --n) step(n, Bool<true>{}, Bool<false>{});
        for (; n >= 0; --n) step(n, Bool<false>{}, Bool<false>{});

        if (n_end > 0) {  // ---- the last block's O += P·V: block 0 in stage s(0) = s(-1) - 1
            cp_async_wait<0>();
            fence_proxy_async_smem();
            __syncthreads();  // everyone's copies of V_0 have landed
            OnlineSoftmax<1>::rescale(acc_o, alpha);
            issue_pv(pa, stage == 0 ? STAGES - 1 : stage - 1);
            wgmma_wait<0>();
            fence_operands(pa);
            fence_operands(acc_o[0]);
        }
    }

    // ---- epilogue
    float lse[1][2];
    softmax.finalize_sums(acc_o, row_sum, p.softmax_scale, lse);
    const SeqLens se = seq_lens(p, b);
    const int rows_valid = min(BLOCK_M, se.seqlen_q - m0);
    // The overlapped loop has no register to keep the head index in: read it again.
    const int h_out = OVERLAP ? fwd_tile_coords<IS_CAUSAL>(p).h : h;
    float* lse_rows = p.lse + b * p.lse_batch_stride + h_out * p.lse_head_stride + se.q_start + m0;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int row = r0 + hh * 8;
        if (t == 0 && row < rows_valid) lse_rows[row] = lse[0][hh];
    }
    // Stage O through this warpgroup's own 64 rows of sQ (no other warpgroup reads
    // them; its own last wgmma on them has completed), then 16-byte stores.
    asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg));
#pragma unroll
    for (int d = 0; d < D_TILES; ++d) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const uint32 val = TypeTraits<T>::pack(acc_o[0][d][2 * hh], acc_o[0][d][2 * hh + 1]);
            const uint32 addr = sQ + QTile::offset(r0 + hh * 8, d) + t * 4;  // n8 tile d = chunk d
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(val));
        }
    }
    asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg));
    T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + int64(se.q_start + m0 + wg * 64) * p.o_row_stride +
             h_out * p.o_head_stride;
    store_tile<T, 64, HEAD_DIM, 128, true, EVEN_K, QTile, false>(out, p.o_row_stride, sQ + wg * 64 * 128,
                                                          rows_valid - wg * 64, p.head_dim);
}

}  // namespace cupyflash
