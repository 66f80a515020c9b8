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
// A bias or mask staged through shared memory (VAR_BIAS_STAGED) has its own 3-stage
// ring after V's, each block's tile copied with its K tile (variant.cuh
// StagedScoreTerms); otherwise it is read into registers a block ahead (ScoreTerms).
// With the mask's tile map (VAR_BLOCK_MAP, variant.cuh KeyBlockMap) the key loop
// walks only the blocks whose tile the mask keeps somewhere, the ring loading the
// next two of those, and a block the mask keeps wholly takes the mask-free scores.
//
// Template parameters, in order:
//   T           __half or __nv_bfloat16
//   HEAD_DIM    padded head dimension, 64 or 128; runtime head_dim <= HEAD_DIM
//   BLOCK_N     keys per tile (64 or 128)
//   CTAS_PER_SM blocks the registers must leave room for on one SM (1 or 2); two
//               blocks drift apart, so one's softmax overlaps the other's wgmma
//   IS_CAUSAL   bottom-right aligned causal mask
//   EVEN_K      head_dim == HEAD_DIM (no column predicates)
//   VARIANT     the variants switched on (variant.cuh's VAR_* bits)
// 16-byte loads are assumed (dispatch sends unaligned data to flash_fwd.cu).
// Dense and packed (varlen) batches alike (seqlens.cuh).
#include "params.cuh"
#include "seqlens.cuh"
#include "query_grid.cuh"
#include "ptx.cuh"
#include "tile_io.cuh"
#include "variant.cuh"
#include "online_softmax.cuh"
#include "warp_mma.cuh"
#include "wgmma.cuh"
#include "fwd_sm90.cuh"

namespace cupyflash {

template <typename T_, int HEAD_DIM_, int BLOCK_N_, int VARIANT_>
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
    // the bias and mask of a key block (this thread's fragment rows: one m16 tile)
    using Terms = KeyBlockTerms<VARIANT_, T, 1, N_TILES, BLOCK_M, NUM_THREADS>;
    // +1024: the dynamic shared window is aligned up to the swizzle atom in the kernel.
    // (cupyflash/dispatch.py fwd_sm90_smem_bytes; checked at launch, below)
    static constexpr int SMEM_BYTES = QTile::BYTES + STAGES * (2 * KVTile::BYTES + Terms::STAGE_BYTES) + 1024;
    static_assert(SMEM_BYTES <= 227 * 1024, "more shared memory than a Hopper block has");
};

template <typename T, int HEAD_DIM, int BLOCK_N, int CTAS_PER_SM, bool IS_CAUSAL, bool EVEN_K, int VARIANT>
__global__ void __launch_bounds__(256, CTAS_PER_SM)
flash_fwd_sm90_kernel(const FwdParams p) {
    using Tr = FwdSm90Traits<T, HEAD_DIM, BLOCK_N, VARIANT>;
    constexpr int BLOCK_M = Tr::BLOCK_M, N_TILES = Tr::N_TILES, D_TILES = Tr::D_TILES;
    constexpr int NT = Tr::NUM_THREADS, STAGES = Tr::STAGES;
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;

    extern __shared__ __align__(16) unsigned char smem[];
    const uint32 sQ = (smem_addr(smem) + 1023u) & ~1023u;
    const uint32 sK0 = sQ + QTile::BYTES;                       // K stage s at sK0 + s * KVTile::BYTES
    const uint32 sV0 = sK0 + STAGES * KVTile::BYTES;            // V likewise
    const uint32 sB0 = sV0 + STAGES * KVTile::BYTES;            // bias/mask stages (staged only)
    // The launch's dynamic shared memory is dispatch's number (fwd_sm90_smem_bytes): it
    // must cover this kernel's. (Checked with the staged stages, whose size is new: in
    // the plain D=64 kernel the check's registers cost a spill.)
    if constexpr (Tr::Terms::STAGE_BYTES > 0) {
        if (threadIdx.x == 0 && dynamic_smem_bytes() < uint32(Tr::SMEM_BYTES)) __trap();
    }

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wg = warp / 4;                                    // warpgroup: query rows 64 wg ..
    const int g = lane / 4, t = lane % 4;

    const TileCoords tc = fwd_tile_coords<IS_CAUSAL>(p);
    const int b = tc.b, h = tc.h, h_kv = tc.h_kv, m_block = tc.m_block;
    const int m0 = m_block * BLOCK_M;
    const SeqLens seq = seq_lens(p, b);
    if (m0 >= seq.seqlen_q) return;  // past the end of a shorter sequence of a packed batch
    const Mask<IS_CAUSAL, VARIANT> mask(p.var, seq.seqlen_q, seq.seqlen_k);
    const BlockRange blocks = mask.key_blocks(m0, BLOCK_M, BLOCK_N);
    const ScoreMod<VARIANT, T> mod(p.var, p.softmax_scale_log2, b, h, seq.seqlen_q, seq.seqlen_k);
    const float sink = sink_log2<VARIANT>(p.var, h);
    // This thread's fragment rows within the block: r0 and r0 + 8.
    const int r0 = wg * 64 + (warp % 4) * 16 + g;
    typename Tr::Terms terms(mod, b, h, m0, r0, sB0);  // the bias and mask of a key block
    const KeyBlockMap<VARIANT> map(p.var, b, h, m_block);  // which blocks are visited (VAR_BLOCK_MAP)

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
    // K, the block's bias/mask tile (staged: in K's commit group; a mask all True is not
    // copied), V.
    // (An edge block, blocks.masked(n), always reads the mask, FULL or not: copied.)
    auto load_kv = [&](int n, int stage) {
        load_k(n, stage);
        terms.stage_in(n, stage, blocks.masked(n) || map.state(n) != BLOCK_FULL);
        load_v(n, stage);
    };

    float acc_o[1][D_TILES][4];
    clear(acc_o);
    float row_sum[1][2] = {{0.f, 0.f}};
    OnlineSoftmax<1> softmax;
    softmax.init(sink);

    // ---- the two GEMMs of one key block, each its own wgmma group; the caller waits
    auto issue_s = [&](float (&s)[1][N_TILES][4], int stage) {  // S = Q·Kᵀ for this warpgroup's 64 rows
        issue_qk<T, BLOCK_M, BLOCK_N, HEAD_DIM>(s[0], sQ, wg, sK0 + stage * KVTile::BYTES);
    };
    auto issue_pv = [&](const uint32 (&pa)[BLOCK_N / 16][4], int stage) {  // O += P·V, P in registers
        cupyflash::issue_pv<T, BLOCK_N, HEAD_DIM>(acc_o[0], pa, sV0 + stage * KVTile::BYTES);
    };
    // Prologue: Q with the first key block, then the second key block (groups 0, 1).
    // The visited blocks, from the last down: n, then n_next (n - 1, n - 2, ... without
    // a block map); < blocks.begin: none left.
    int n = map.prev(blocks.end, blocks.begin);
    int n_next = n >= blocks.begin ? map.prev(n, blocks.begin) : n;
    if (n >= blocks.begin) {
        load_tile<T, BLOCK_M, HEAD_DIM, NT, true, EVEN_K, QTile>(sQ, q, p.q_row_stride, seq.seqlen_q - m0,
                                                                 p.head_dim);
        load_kv(n, 0);
    }
    cp_async_commit();
    if (n_next >= blocks.begin) load_kv(n_next, 1);
    cp_async_commit();

    int stage = 0;  // stage of key block n; the visited block after n_next goes to stage + 2 (mod 3)
    // One key block: masked (causal/window edge), attn_masked (its mask not all True).
    // Returns the block to visit next (n_next as it was; < blocks.begin: none) and
    // moves n_next on to the one after it, whose loads it issued. (Without a map: n - 1,
    // and n_next is not carried.)
    auto step = [&](int n, auto masked, auto attn_masked) -> int {
        constexpr bool MASKED = decltype(masked)::value, ATTN_MASKED = decltype(attn_masked)::value;
        cp_async_wait<1>();        // this thread's copies of block n have landed
        fence_proxy_async_smem();  // ... and are visible to wgmma
        __syncthreads();           // everyone's have; everyone is done with block n + 1
        // Block n - 2's loads: at D=128 issued behind the S wgmma (their address
        // arithmetic then runs while the tensor cores work: +8% median, PERF.md v11);
        // at D=64, whose S is short, before it (issued behind it, they delayed the
        // softmax: -5%).
        constexpr bool LOADS_UNDER_S = HEAD_DIM >= 128;
        const int n_after = !KeyBlockMap<VARIANT>::ON ? n - 2
                            : n_next >= blocks.begin ? map.prev(n_next, blocks.begin) : n_next;
        auto load_next = [&] {
            const int free_stage = stage == 0 ? 2 : stage - 1;
            if (n_after >= blocks.begin) load_kv(n_after, free_stage);
            cp_async_commit();
        };
        if constexpr (!LOADS_UNDER_S) load_next();

        // The block's bias and mask (from global memory, or from its stage): read
        // while the tensor cores do S.
        terms.template load<MASKED, ATTN_MASKED>(n * BLOCK_N + 2 * t, stage);
        float s[1][N_TILES][4];
        issue_s(s, stage);
        if constexpr (LOADS_UNDER_S) load_next();
        // Dropout's keep bits depend on no score: drawn while the tensor cores do S.
        [[maybe_unused]] DropoutBits<1, N_TILES> keep;
        if constexpr ((VARIANT & VAR_DROPOUT) != 0) {
            keep.draw(Dropout(p.var, b, h, p.nheads_q), m0 + r0, n * BLOCK_N + 2 * t);
        }
        wgmma_wait<0>();
        fence_operands(s[0]);
        // ---- scores in log2 units (the variant's), masked where the block needs it
        score_tile<MASKED, ATTN_MASKED>(s, mod, mask, m0 + r0, n * BLOCK_N + 2 * t, terms);

        // ---- online softmax: s becomes P, acc_o is rescaled
        fence_operands(acc_o[0]);
        softmax.update(s, acc_o, row_sum);
        if constexpr ((VARIANT & VAR_DROPOUT) != 0) keep.zero_dropped(s);  // the row sums keep the undropped P

        // ---- O += P·V, P repacked from the S accumulators as the register A operand
        uint32 pa[BLOCK_N / 16][4];
        acc_to_a_operand<T>(s[0], pa);
        issue_pv(pa, stage);
        wgmma_wait<0>();
        fence_operands(acc_o[0]);
        stage = stage == STAGES - 1 ? 0 : stage + 1;
        if constexpr (KeyBlockMap<VARIANT>::ON) {
            const int visit = n_next;
            n_next = n_after;
            return visit;
        } else {
            return n - 1;
        }
    };
    // A block off the causal/window edge: with the map, mask-free where the mask keeps
    // it wholly (the edge blocks always read the mask: three steps compiled, not four).
    auto step_bulk = [&](int n) -> int {
        if constexpr (KeyBlockMap<VARIANT>::ON) {
            if (map.state(n) == BLOCK_FULL) return step(n, Bool<false>{}, Bool<false>{});
            return step(n, Bool<false>{}, Bool<true>{});
        } else {
            return step(n, Bool<false>{}, Bool<true>{});
        }
    };

    // Masked blocks (key tail, causal diagonal) first, then the bulk with no mask
    // code; with a window, one loop that asks each block (the window's left edge is
    // masked too), so the step is compiled twice, not three times.
    if constexpr (Mask<IS_CAUSAL, VARIANT>::WINDOW) {
        // (n = step(n): the next visited block. Not `n = n_next` after the step: the step
        // has moved n_next on to the block after that one.)
        while (n >= blocks.begin) {
            if (blocks.masked(n)) n = step(n, Bool<true>{}, Bool<true>{}); else n = step_bulk(n);
        }
    } else {
        while (n >= blocks.unmasked_end) n = step(n, Bool<true>{}, Bool<true>{});
        while (n >= 0) n = step_bulk(n);
    }

    // ---- epilogue
    float lse[1][2];
    softmax.finalize_sums(acc_o, row_sum, lse, sink, (VARIANT & VAR_DROPOUT) ? p.var.dropout_scale : 1.f);
    store_fwd_rows<T, BLOCK_M, HEAD_DIM, EVEN_K>(p, acc_o[0], lse[0], b, h, m0, r0, wg, sQ, 1 + wg);
}

}  // namespace cupyflash
