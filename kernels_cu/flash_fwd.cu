// flash_fwd.cu: the FlashAttention-2 forward pass (Dao 2023, Algorithm 1) on
// mma.sync.m16n8k16 Tensor Core fragments.
//
// One thread block owns BLOCK_M query rows of one (batch, head); each warp owns
// BLOCK_M / NUM_WARPS of those rows. Q stays in shared memory; K and V tiles
// of BLOCK_N keys stream through shared memory with cp.async, each load
// overlapping one GEMM. S = Q·Kᵀ and the online softmax live in registers; P is
// repacked from the S accumulators straight into the A operand of O += P·V.
//
// Template parameters, in order:
//   T           __half or __nv_bfloat16
//   HEAD_DIM    padded head dimension (multiple of 16); runtime head_dim <= HEAD_DIM
//   BLOCK_M     query rows per block;  BLOCK_N  keys per tile
//   NUM_WARPS   warps per block (each owns BLOCK_M / NUM_WARPS rows, a multiple of 16)
//   IS_CAUSAL   bottom-right aligned causal mask
//   EVEN_K      head_dim == HEAD_DIM (no column predicates)
//   VEC         16-byte loads are legal (pointers, strides, head_dim multiples of 8 elements)
//   IS_SPLIT    split-KV: write fp32 partial (out, lse) for flash_fwd_combine
//   VARIANT     the variants switched on (variant.cuh's VAR_* bits)
//
// Dense and packed (varlen) batches run the same instantiations: seqlens.cuh
// gives each block its sequence's rows and lengths (split-KV: dense only).
#include "params.cuh"
#include "block_traits.cuh"
#include "ptx.cuh"
#include "seqlens.cuh"
#include "query_grid.cuh"
#include "tile_io.cuh"
#include "variant.cuh"
#include "online_softmax.cuh"
#include "warp_mma.cuh"

namespace cupyflash {

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS>
struct FwdTraits : BlockTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS * 32> {
    static constexpr int ROWS_PER_WARP = BLOCK_M / NUM_WARPS;
    static constexpr int M_TILES = ROWS_PER_WARP / 16;  // m16 tiles per warp
    static constexpr int N_TILES = BLOCK_N / 8;         // n8 tiles of S per warp
    static constexpr int D_TILES = HEAD_DIM / 8;        // n8 tiles of O per warp
    using QTile = SmemTile<T, BLOCK_M, HEAD_DIM>;
    using KVTile = SmemTile<T, BLOCK_N, HEAD_DIM>;
    static constexpr int SMEM_BYTES = QTile::BYTES + 2 * KVTile::BYTES;

    static_assert(ROWS_PER_WARP % 16 == 0, "each warp owns whole m16 tiles");
    static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "k16 steps");
};

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS,
          bool IS_CAUSAL, bool EVEN_K, bool VEC, bool IS_SPLIT, int VARIANT>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_fwd_kernel(const FwdParams p) {
    using Tr = FwdTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS>;
    constexpr int M_TILES = Tr::M_TILES, N_TILES = Tr::N_TILES, D_TILES = Tr::D_TILES;
    constexpr int NT = Tr::NUM_THREADS;
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;

    extern __shared__ __align__(16) unsigned char smem[];
    const uint32 sQ = smem_addr(smem);
    const uint32 sK = sQ + QTile::BYTES;
    const uint32 sV = sK + KVTile::BYTES;

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;

    const TileCoords tc = fwd_tile_coords<IS_CAUSAL>(p);
    const SeqLens seq = seq_lens(p, tc.b);
    const int m0 = tc.m_block * BLOCK_M;
    if (m0 >= seq.seqlen_q) return;  // past the end of a shorter sequence of a packed batch
    const T* q = static_cast<const T*>(p.q) + tc.b * p.q_batch_stride + int64(seq.q_start + m0) * p.q_row_stride +
                 tc.h * p.q_head_stride;

    const Mask<IS_CAUSAL, VARIANT> mask(p.var, seq.seqlen_q, seq.seqlen_k);
    BlockRange blocks = mask.key_blocks(m0, BLOCK_M, BLOCK_N);
    if (IS_SPLIT) {  // this split's share of the key blocks
        blocks.begin = max(blocks.begin, int(blockIdx.y) * p.n_blocks_per_split);
        blocks.end = min(blocks.end, int(blockIdx.y + 1) * p.n_blocks_per_split);
        blocks.clamp();
    }
    const ScoreMod<VARIANT, T> mod(p.var, p.softmax_scale_log2, tc.b, tc.h, seq.seqlen_q, seq.seqlen_k);
    // The sink joins the rows of one split only.
    const float sink = blockIdx.y == 0 ? sink_log2<VARIANT>(p.var, tc.h) : NEG_INF;

    // Per-thread fragment rows: row r0 + 16 i (+ 8) of this block, i < M_TILES.
    const int r0 = warp * Tr::ROWS_PER_WARP + g;
    ScoreTerms<VARIANT, T, M_TILES, N_TILES> terms(mod, m0 + r0);  // the bias and mask of a key block

    float acc_o[M_TILES][D_TILES][4];
#pragma unroll
    for (int i = 0; i < M_TILES; ++i)
#pragma unroll
        for (int d = 0; d < D_TILES; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[i][d][e] = 0.f;
    float acc_l[M_TILES][4];  // P·1: the row sums, accumulated on the Tensor Cores
#pragma unroll
    for (int i = 0; i < M_TILES; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_l[i][e] = 0.f;
    OnlineSoftmax<M_TILES> softmax;
    softmax.init(sink);

    const T* k = static_cast<const T*>(p.k) + tc.b * p.k_batch_stride + int64(seq.k_start) * p.k_row_stride +
                 tc.h_kv * p.k_head_stride;
    const T* v = static_cast<const T*>(p.v) + tc.b * p.v_batch_stride + int64(seq.k_start) * p.v_row_stride +
                 tc.h_kv * p.v_head_stride;
    auto load_kv = [&](uint32 dst, const T* src, int64 row_stride, int n) {
        load_tile<T, BLOCK_N, HEAD_DIM, NT, VEC, EVEN_K>(dst, src + int64(n) * BLOCK_N * row_stride, row_stride,
                                                         seq.seqlen_k - n * BLOCK_N, p.head_dim);
    };
    auto load_k = [&](int n) { load_kv(sK, k, p.k_row_stride, n); };
    auto load_v = [&](int n) { load_kv(sV, v, p.v_row_stride, n); };

    if (blocks.begin < blocks.end) {
        load_tile<T, BLOCK_M, HEAD_DIM, NT, VEC, EVEN_K>(sQ, q, p.q_row_stride, seq.seqlen_q - m0, p.head_dim);
        load_k(blocks.end - 1);
        cp_async_commit();
    }

    // One key block: S = Q·Kᵀ, mask, online softmax, O += P·V. The V load
    // overlaps Q·Kᵀ, the next K load overlaps softmax and P·V.
    auto step = [&](int n, auto masked) {
        float s[M_TILES][N_TILES][4];
#pragma unroll
        for (int i = 0; i < M_TILES; ++i)
#pragma unroll
            for (int j = 0; j < N_TILES; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[i][j][e] = 0.f;

        // A warp whose rows see none of this block's keys (the causal diagonal, the
        // window's edges) skips its mma work (it still takes part in the loads and
        // barriers); the SM's other block gets its issue slots. Unmasked blocks
        // never branch here.
        const int warp_row0 = m0 + warp * Tr::ROWS_PER_WARP;
        const bool warp_idle = decltype(masked)::value &&
                               mask.none_visible(warp_row0, warp_row0 + Tr::ROWS_PER_WARP - 1, n * BLOCK_N,
                                                 (n + 1) * BLOCK_N - 1);
        // The block's bias and mask, in flight during the wait and Q·Kᵀ.
        if (!warp_idle) terms.template load<decltype(masked)::value>(n * BLOCK_N + 2 * t);

        cp_async_wait<0>();
        __syncthreads();  // K[n] landed; every warp is done reading V[n+1]
        load_v(n);
        cp_async_commit();

        if (!warp_idle) {
            // ---- S = Q·Kᵀ (rolled over k16 steps: unrolling lets the compiler hoist
            //      fragment loads and spill at HEAD_DIM 128)
#pragma unroll 1
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
                uint32 a[M_TILES][4];
#pragma unroll
                for (int i = 0; i < M_TILES; ++i) {
                    ldmatrix_x4(a[i], sQ + QTile::offset(warp * Tr::ROWS_PER_WARP + i * 16 + (lane & 15),
                                                         kk * 2 + (lane >> 4)));
                }
#pragma unroll
                for (int j = 0; j < N_TILES / 2; ++j) {
                    uint32 bk[4];
                    ldmatrix_x4(bk, sK + KVTile::offset(j * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                        kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
                    for (int i = 0; i < M_TILES; ++i) {
                        mma_m16n8k16<T>(s[i][2 * j], a[i], bk[0], bk[1]);
                        mma_m16n8k16<T>(s[i][2 * j + 1], a[i], bk[2], bk[3]);
                    }
                }
            }
            // ---- scores in log2 units (the variant's), masked where the block needs it
            score_tile<decltype(masked)::value>(s, mod, mask, m0 + r0, n * BLOCK_N + 2 * t, terms);
        }

        cp_async_wait<0>();
        __syncthreads();  // V[n] landed; every warp is done reading K[n]
        if (n > blocks.begin) {
            load_k(n - 1);
            cp_async_commit();
        }

        if (!warp_idle) {
            // ---- online softmax: s becomes P, acc_o and acc_l are rescaled
            softmax.update(s, acc_o, acc_l);

            // ---- l += P·1 and O += P·V, with P repacked from the S accumulators as the A
            //      operand; dropout zeroes its dropped entries for P·V only (the row sums
            //      are the undropped ones; 1/(1-p) comes in the epilogue)
            uint32 pa[M_TILES][BLOCK_N / 16][4];
            pack_a<T>(pa, s);
#pragma unroll
            for (int i = 0; i < M_TILES; ++i)
#pragma unroll
                for (int kk = 0; kk < BLOCK_N / 16; ++kk)
                    mma_m16n8k16<T>(acc_l[i], pa[i][kk], TypeTraits<T>::ONE_PAIR, TypeTraits<T>::ONE_PAIR);
            if constexpr ((VARIANT & VAR_DROPOUT) != 0) {
                const TileCoords td = fwd_tile_coords<IS_CAUSAL>(p);
                Dropout(p.var, td.b, td.h, p.nheads_q).apply(s, m0 + r0, n * BLOCK_N + 2 * t);
                pack_a<T>(pa, s);
            }
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#pragma unroll
                for (int j = 0; j < D_TILES / 2; ++j) {
                    uint32 bv[4];
                    ldmatrix_x4_trans(bv, sV + KVTile::offset(kk * 16 + (lane & 15), j * 2 + (lane >> 4)));
#pragma unroll
                    for (int i = 0; i < M_TILES; ++i) {
                        mma_m16n8k16<T>(acc_o[i][2 * j], pa[i][kk], bv[0], bv[1]);
                        mma_m16n8k16<T>(acc_o[i][2 * j + 1], pa[i][kk], bv[2], bv[3]);
                    }
                }
            }
        }
    };

    // Masked blocks (key tail, causal diagonal) first, then the bulk with no mask
    // code, then the masked blocks of the window's left edge.
    int n = blocks.end - 1;
    for (; n >= blocks.unmasked_end; --n) step(n, Bool<true>{});
    for (; n >= blocks.unmasked_begin; --n) step(n, Bool<false>{});
    if constexpr (Mask<IS_CAUSAL, VARIANT>::WINDOW) {
        for (; n >= blocks.begin; --n) step(n, Bool<true>{});
    }

    // ---- epilogue (tile coordinates recomputed: nothing but accumulators crossed the loop)
    float lse[M_TILES][2];
    softmax.finalize(acc_o, acc_l, lse, sink, (VARIANT & VAR_DROPOUT) ? p.var.dropout_scale : 1.f);
    const TileCoords te = fwd_tile_coords<IS_CAUSAL>(p);
    const SeqLens se = seq_lens(p, te.b);
    const int e_m0 = te.m_block * BLOCK_M;
    const int rows_valid = min(BLOCK_M, se.seqlen_q - e_m0);

    if (IS_SPLIT) {
        // fp32 partials, straight from registers; the combine kernel merges splits by lse.
        const int64 row_index0 = (int64(te.b) * p.nheads_q + te.h) * p.seqlen_q + e_m0;
        const int64 split_rows = int64(p.batch) * p.nheads_q * p.seqlen_q;
        float* o_acc = p.out_accum + (int64(blockIdx.y) * split_rows + row_index0) * HEAD_DIM;
        float* l_acc = p.lse_accum + int64(blockIdx.y) * split_rows + row_index0;
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int row = r0 + i * 16 + hh * 8;
                if (row >= rows_valid) continue;
                if (t == 0) l_acc[row] = lse[i][hh];
#pragma unroll
                for (int d = 0; d < D_TILES; ++d) {
                    *reinterpret_cast<float2*>(o_acc + int64(row) * HEAD_DIM + d * 8 + 2 * t) =
                        make_float2(acc_o[i][d][2 * hh], acc_o[i][d][2 * hh + 1]);
                }
            }
        }
        return;
    }

    float* lse_rows = p.lse + te.b * p.lse_batch_stride + te.h * p.lse_head_stride + se.q_start + e_m0;
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = r0 + i * 16 + hh * 8;
            if (t == 0 && row < rows_valid) lse_rows[row] = lse[i][hh];
        }
    }
    // Stage O through this warp's own Q rows so the global stores are 16 bytes wide.
    __syncthreads();  // every warp is done with sQ (and the last loads)
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
        for (int d = 0; d < D_TILES; ++d) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const uint32 val = TypeTraits<T>::pack(acc_o[i][d][2 * hh], acc_o[i][d][2 * hh + 1]);
                const uint32 addr = sQ + QTile::offset(r0 + i * 16 + hh * 8, d) + t * 4;  // n8 tile d = chunk d
                asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(val));
            }
        }
    }
    __syncthreads();
    T* out = static_cast<T*>(p.out) + te.b * p.o_batch_stride + int64(se.q_start + e_m0) * p.o_row_stride +
             te.h * p.o_head_stride;
    store_tile<T, BLOCK_M, HEAD_DIM, NT, VEC, EVEN_K>(out, p.o_row_stride, sQ, rows_valid, p.head_dim);
}

// Merge split-KV partials: out = sum_s exp(lse_s - lse) * out_s, lse = logsumexp_s lse_s.
// One warp per (batch, head, query row); dense batches only.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(128)
flash_fwd_combine_kernel(const FwdParams p) {
    const int64 rows = int64(p.batch) * p.nheads_q * p.seqlen_q;
    const int64 row = int64(blockIdx.x) * 4 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;

    float lse_max = NEG_INF;
    for (int s = 0; s < p.num_splits; ++s) lse_max = fmaxf(lse_max, p.lse_accum[s * rows + row]);
    float sum = 0.f;
    if (lse_max != NEG_INF) {
        for (int s = 0; s < p.num_splits; ++s) sum += __expf(p.lse_accum[s * rows + row] - lse_max);
    }
    const bool empty = !(sum > 0.f);
    const float lse = empty ? NEG_INF : lse_max + __logf(sum);

    const int m = int(row % p.seqlen_q);
    const int bh = int(row / p.seqlen_q);
    const int b = bh / p.nheads_q, h = bh % p.nheads_q;
    T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + m * p.o_row_stride + h * p.o_head_stride;
    for (int c = lane; c < p.head_dim; c += 32) {
        float acc = 0.f;
        if (!empty) {
            for (int s = 0; s < p.num_splits; ++s) {
                const float w = __expf(p.lse_accum[s * rows + row] - lse);
                acc += w * p.out_accum[(s * rows + row) * HEAD_DIM + c];
            }
        }
        out[c] = TypeTraits<T>::from_float(acc);
    }
    if (lane == 0) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + m] = lse;
}

}  // namespace cupyflash
