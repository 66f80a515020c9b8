// flash_bwd_sm90.cu: the dK/dV (+ atomic dQ) kernel of the FlashAttention-2
// backward (Dao 2023, Algorithm 2) on Hopper warpgroup MMA (wgmma, sm_90a).
// Preprocess, the deterministic dQ kernel and the convert kernels are
// flash_bwd.cu's; see its header for the row-buffer contract. Query tails load
// Q, dO, lse_log2 and delta as 0 (so dO = 0 and dS = P·(0 − 0) = 0 there, whatever
// finite score the variant gives them, and their dQ is not stored); key-less rows
// have lse_log2 = +inf (P = 0); key tails, the causal diagonal and the window's
// edges are masked (variant.cuh's Mask). Dense and packed (varlen) batches alike
// (seqlens.cuh).
//
// Variants (VARIANT, variant.cuh; cupyflash/reference.py is the specification):
// the score x = ScoreMod(q·k) (softcap, ALiBi, bias; -inf where the bool mask is 0)
// in log2 units, P = prob(x, lse_log2) (lse includes any sink: sinks change nothing
// here, dsinks is the preprocess kernel's), Z the dropout keep mask of the forward's
// Philox counters, rp = 1/(1-p):
//   dV += (P∘Z·rp)ᵀ·dO,  dS = P∘(dP∘Z·rp − delta) (∘ (1 − tanh²) with softcap)
// (dbias is flash_bwd_dbias.cu's kernel). The dK/dV kernel's Pᵀ with its variant is
// bwd_sm90.cuh's PtOperands, which flash_bwd_ws.cu's consumers run too.
// With the mask's tile map (VAR_BLOCK_MAP, variant.cuh KeyBlockMap / QueryBlockMap, each
// kernel's map at its own tile) both kernels visit only the tiles the mask keeps
// somewhere (a skipped tile's P, so its dV, dS, dK and dQ terms, are 0: with atomic dQ
// it adds nothing either), and run those it keeps wholly with no mask reads (staged:
// with no mask copy).
//
// One block owns BLOCK_N = 128 keys of one (batch, KV head); each of its two
// warpgroups owns 64 of them and loops over the query blocks (BLOCK_M = 64) of
// the group's query heads.
// Everything is computed transposed, keys as rows, so every product's A operand
// is either in shared memory or already in registers:
//   Sᵀ  = K·Qᵀ          A = K (smem), B = Q (smem)               -> registers
//   dPᵀ = V·dOᵀ         A = V (smem), B = dO (smem)              -> registers
//   Pᵀ  = exp2(Sᵀ·scale·log2e − lse·log2e),  dSᵀ = Pᵀ∘(dPᵀ − delta)
//   dV += Pᵀ·dO         A = Pᵀ (registers; ∘Z with dropout, rp in the epilogue),
//                       B = dO (smem, MN-major)
//   dK += dSᵀ·Q         A = dSᵀ (registers), B = Q (smem, MN-major)
//   dQ  = dS·K          A = dSᵀ staged in smem (read MN-major), B = K (smem, MN-major);
//                       over all 128 keys, warpgroup w takes columns [w·D/2, (w+1)·D/2)
//                       of the 64 query rows; added to dq_accum with fp32 atomics.
// Q, dO, lse_log2 and delta are double-buffered (cp.async, 128-byte swizzle).
//
// Template parameters: T, HEAD_DIM (64 or 128), IS_CAUSAL, EVEN_K, DETERMINISTIC
// (skip dQ: flash_bwd_dq_kernel computes it), VARIANT (variant.cuh).
// 16-byte loads are assumed.
#include "params.cuh"
#include "ptx.cuh"
#include "seqlens.cuh"
#include "query_grid.cuh"
#include "bwd_rows.cuh"
#include "tile_io.cuh"
#include "variant.cuh"
#include "warp_mma.cuh"
#include "wgmma.cuh"
#include "bwd_sm90.cuh"

namespace cupyflash {

template <typename T_, int HEAD_DIM_, int VARIANT_ = 0>
struct BwdSm90Traits {
    using T = T_;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr int BLOCK_M = 64;   // query rows per step
    static constexpr int BLOCK_N = 128;  // keys per block, 64 per warpgroup
    static constexpr int NUM_THREADS = 256;
    using KVTile = Swizzle128Tile<T, BLOCK_N, HEAD_DIM>;   // K, V (and dK, dV staging)
    using QTile = Swizzle128Tile<T, BLOCK_M, HEAD_DIM>;    // Q, dO
    using DSTile = Swizzle128Tile<T, BLOCK_N, BLOCK_M>;    // dSᵀ: key rows, BLOCK_M query columns
    static constexpr int STAGE_BYTES = 2 * QTile::BYTES;
    static constexpr int ROWS_OFFSET = 2 * KVTile::BYTES + DSTile::BYTES + 2 * STAGE_BYTES;
    // lse_log2 and delta: 2 stages x 2 x BLOCK_M floats; the block's SeqLens;
    // +1024 to align the window.
    static constexpr int SEQ_OFFSET = ROWS_OFFSET + 2 * 2 * BLOCK_M * 4;
    // (VAR_BIAS_STAGED) 2 stages of the query block's bias/mask tile (BLOCK_M x BLOCK_N,
    // ScoreTileStage), after the SeqLens rounded up to 128 bytes
    static constexpr bool STAGED = (VARIANT_ & VAR_BIAS_STAGED) != 0;
    static constexpr int SCORE_OFFSET = (SEQ_OFFSET + SeqLensSlot::BYTES + 127) / 128 * 128;
    static constexpr int SCORE_BYTES = ScoreStageBytes<STAGED, VARIANT_, T, BLOCK_M, BLOCK_N, NUM_THREADS>::value;
    static constexpr int SMEM_BYTES = (STAGED ? SCORE_OFFSET + 2 * SCORE_BYTES : SEQ_OFFSET + SeqLensSlot::BYTES) + 1024;
};

template <typename T, int HEAD_DIM, bool IS_CAUSAL, bool EVEN_K, bool DETERMINISTIC, int VARIANT>
__global__ void __launch_bounds__(256, 1)
flash_bwd_dkdv_sm90_kernel(const BwdParams p) {
    using Tr = BwdSm90Traits<T, HEAD_DIM, VARIANT>;
    constexpr int BLOCK_M = Tr::BLOCK_M, BLOCK_N = Tr::BLOCK_N, NT = Tr::NUM_THREADS;
    constexpr int D_TILES = HEAD_DIM / 8;        // n8 tiles of dK, dV
    constexpr int M_TILES = BLOCK_M / 8;         // n8 tiles of Sᵀ, dPᵀ (query columns)
    // dQ's 64 x HEAD_DIM per step, split over the two warpgroups: half the columns each.
    constexpr int DQ_COLS = HEAD_DIM / 2;  // dQ columns per warpgroup
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    using DSTile = typename Tr::DSTile;
    constexpr bool DROPOUT = (VARIANT & VAR_DROPOUT) != 0;
    constexpr bool STAGED = Tr::STAGED;  // the bias/mask tile through shared memory (else ScoreMod's reads)

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - smem_addr(smem_raw));
    const uint32 sK = base, sV = sK + KVTile::BYTES, sdS = sV + KVTile::BYTES;
    auto sQ = [&](int stage) { return sdS + DSTile::BYTES + stage * Tr::STAGE_BYTES; };
    auto sdO = [&](int stage) { return sQ(stage) + QTile::BYTES; };
    auto stage_floats = [&](int stage) {  // lse_log2[BLOCK_M], then delta[BLOCK_M]
        return reinterpret_cast<const float*>(smem + Tr::ROWS_OFFSET + stage * 2 * BLOCK_M * 4);
    };
    auto sScore = [&](int stage) { return base + uint32(Tr::SCORE_OFFSET + stage * Tr::SCORE_BYTES); };
    // The launch's dynamic shared memory is dispatch's (bwd_dkdv_sm90_smem_bytes): it must
    // cover this kernel's (checked where the staged tiles' size is new).
    if constexpr (STAGED) {
        if (threadIdx.x == 0 && dynamic_smem_bytes() < uint32(Tr::SMEM_BYTES)) __trap();
    }

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wg = warp / 4;
    const int g = lane / 4, t = lane % 4;
    // This thread's fragment rows: keys key_row0 and key_row0 + 8 of the block
    // (Sᵀ, dPᵀ, dK, dV); in dQ, query rows dq_row0 + 16 (warp % 4) + g (+ 8) of a
    // step, columns from dq_col0.
    const int key_row0 = wg * 64 + (warp % 4) * 16 + g;
    const int dq_row0 = 0, dq_col0 = wg * DQ_COLS;

    // ---- which tile (query_grid.cuh)
    const KeyTileCoords tc = key_tile_coords(p, BLOCK_N);
    const int n_block = tc.n_block, split = tc.split, b = tc.b, h_kv = tc.h_kv, heads = tc.heads;
    const int h_first = tc.h_first;
    const SeqLens seq = seq_lens(p, b);
    const int n0 = n_block * BLOCK_N;
    if (n0 >= seq.seqlen_k) return;  // past the end of a shorter sequence of a packed batch
    const int keys_valid = min(BLOCK_N, seq.seqlen_k - n0);
    // The loop reads the sequence's rows and lengths back from shared memory:
    // held in registers across it they would spill at D=128.
    const SeqLensSlot seq_slot{base + Tr::SEQ_OFFSET};
    if (threadIdx.x == 0) seq_slot.store(seq);

    // Query blocks [m_begin, m_end) see these keys; those blocks.masked() need the mask.
    const int num_m_blocks = ceil_div(seq.seqlen_q, BLOCK_M);
    const BlockRange blocks =
        Mask<IS_CAUSAL, VARIANT>(p.var, seq.seqlen_q, seq.seqlen_k).query_blocks(n0, BLOCK_N, keys_valid, BLOCK_M,
                                                                                 num_m_blocks);
    const int m_begin = blocks.begin, m_end = blocks.end;
    // Without a window the masked blocks are [m_begin, m_masked_end): blocks.masked()'s
    // second range [unmasked_end, end) is empty or (a key tail) the whole range. One
    // bound held across the loop instead of two.
    constexpr bool WINDOW = Mask<IS_CAUSAL, VARIANT>::WINDOW;
    const int m_masked_end = blocks.unmasked_end == m_end ? blocks.unmasked_begin : m_end;
    const int nm = m_end - m_begin;
    const int num_iters = heads * nm;
    // With the mask's tile map (VAR_BLOCK_MAP) the steps are the (head, query block)
    // pairs whose tile the mask keeps somewhere; those it keeps wholly take no mask.
    const QueryBlockMap<VARIANT> map(p.var, b, n_block);
    constexpr bool MAP = QueryBlockMap<VARIANT>::ON;
    const int h_end = h_first + heads;

    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride +
                 int64(seq.k_start + n0) * p.k_row_stride;
    const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride +
                 int64(seq.k_start + n0) * p.v_row_stride;

    // Q, dO, lse_log2, delta of query block m_block of head h, zero-filled past
    // seqlen_q (and head_dim); staged, its bias/mask tile (the mask's unless its map says
    // it keeps the whole tile: full).
    auto load_query_block = [&](int h, int m_block, int stage, const SeqLens& seq, bool full) {
        const int m0 = m_block * BLOCK_M;
        const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                     int64(seq.q_start + m0) * p.q_row_stride;
        const T* dout = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride +
                        int64(seq.q_start + m0) * p.do_row_stride;
        const int rows_valid = seq.seqlen_q - m0;
        load_tile<T, BLOCK_M, HEAD_DIM, NT, true, EVEN_K, QTile>(sQ(stage), q, p.q_row_stride, rows_valid,
                                                                 p.head_dim);
        load_tile<T, BLOCK_M, HEAD_DIM, NT, true, EVEN_K, QTile>(sdO(stage), dout, p.do_row_stride, rows_valid,
                                                                 p.head_dim);
        const int r = threadIdx.x;  // thread r loads row r of lse_log2 and of delta
        if (r < BLOCK_M) {
            const bool valid = r < rows_valid;
            const int64 row_index = query_row_index(p, b, h, seq, m0) + (valid ? r : 0);
            const uint32 s_rows = base + Tr::ROWS_OFFSET + stage * 2 * BLOCK_M * 4 + r * 4;
            cp_async_4(s_rows, p.lse_log2 + row_index, valid);
            cp_async_4(s_rows + BLOCK_M * 4, p.delta + row_index, valid);
        }
        // the (query block, key block)'s bias/mask tile, in the group of Q and dO
        if constexpr (STAGED) {
            ScoreTileStage<VARIANT, T, BLOCK_M, BLOCK_N, NT>::copy(sScore(stage), p.var, b, h, m0, n0,
                                                                   seq.seqlen_q - 1, seq.seqlen_k - 1, !full);
        }
    };

    float acc_dk[D_TILES][4], acc_dv[D_TILES][4];
#pragma unroll
    for (int j = 0; j < D_TILES; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) { acc_dk[j][e] = 0.f; acc_dv[j][e] = 0.f; }

    load_tile<T, BLOCK_N, HEAD_DIM, NT, true, EVEN_K, KVTile>(sK, k, p.k_row_stride, keys_valid, p.head_dim);
    load_tile<T, BLOCK_N, HEAD_DIM, NT, true, EVEN_K, KVTile>(sV, v, p.v_row_stride, keys_valid, p.head_dim);
    // The steps' (head, query block) pairs: heads h_first .. h_end - 1, each its query
    // blocks m_begin .. m_end - 1 (with the map, those it keeps), in that order. A block
    // masked for the causal/window edge or the key tail reads the mask whatever its map
    // says (three steps compiled, not four).
    auto edge = [&](int m_block) { return WINDOW ? blocks.masked(m_block) : m_block < m_masked_end; };
    auto full = [&](int h, int m_block) { return MAP && !edge(m_block) && map.state(h, m_block) == BLOCK_FULL; };
    int h = h_first, m_block = m_begin;
    // (guarded: the no-op call of a map that is off changed the default kernels' code)
    if constexpr (MAP) map.seek(h, m_block, h_end, m_begin, m_end);
    if (MAP ? h < h_end : num_iters > 0) load_query_block(h, m_block, 0, seq, full(h, m_block));
    cp_async_commit();

    // Step it: query block m_block of head h; the next step's is (h_next, m_next), if
    // any. attn_masked: its mask is read (false: the map's full tile).
    auto step = [&](int it, int h, int m_block, int h_next, int m_next, auto masked, auto attn_masked) {
        const int stage = it & 1;
        const int m0 = m_block * BLOCK_M;
        const float* s_lse = stage_floats(stage);
        const float* s_delta = s_lse + BLOCK_M;

        cp_async_wait<0>();
        fence_proxy_async_smem();
        __syncthreads();  // Q, dO, lse, delta [it] landed; every warp is done with step it-1

        // Loop-invariant tile addresses, made opaque so the compiler rebuilds the
        // descriptors each step instead of keeping ~60 registers of them live.
        uint32 sK_ = sK, sV_ = sV, sdS_ = sdS;
        asm volatile("" : "+r"(sK_), "+r"(sV_), "+r"(sdS_));

        // ---- Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for this warpgroup's 64 keys
        float st[M_TILES][4], dpt[M_TILES][4];
        issue_st_dpt<T, BLOCK_M, BLOCK_N, HEAD_DIM>(st, dpt, sK_, sV_, sQ(stage), sdO(stage), wg);
        // The next step's loads, issued while the tensor cores work on Sᵀ and dPᵀ
        // (their address arithmetic would otherwise sit on this step's critical path).
        if (MAP ? h_next < h_end : it + 1 < num_iters) {
            load_query_block(h_next, m_next, stage ^ 1, seq_slot.load(), full(h_next, m_next));
        }
        cp_async_commit();
        wgmma_wait<1>();
        fence_operands(st);

        // ---- Pᵀ = prob(score, lse) with the variant (bwd_sm90.cuh PtOperands; staged: this
        //      stage's bias/mask tile, read transposed)
        constexpr bool MASKED = decltype(masked)::value, ATTN_MASKED = decltype(attn_masked)::value;
        using Terms = typename Select<STAGED, StagedScoreTermsT<VARIANT, T, BLOCK_M, BLOCK_N, NT>, ElementTerms>::type;
        PtOperands<T, BLOCK_M, IS_CAUSAL, VARIANT> pt;
        pt.template recompute<MASKED, ATTN_MASKED, Terms>(st, p, seq_slot, s_lse, sScore(stage), b, h, n0, key_row0,
                                                          m0, g, t);
        uint32 (&dv_a)[BLOCK_M / 16][4] = pt.dv_a();
        // ---- dV += Pᵀ·dO (∘Z)
        issue_keys_rs<T, BLOCK_M, HEAD_DIM>(acc_dv, dv_a, sdO(stage));
        // dPᵀ; at D=128 dV too: P·dO reads its operand from registers while in flight, so
        // it must stay live until it completes, which costs D=128 registers it lacks;
        // D=64 has them, and computes dS while P·dO runs.
        constexpr bool DS_UNDER_DV = HEAD_DIM <= 64;
        wgmma_wait<DS_UNDER_DV ? 1 : 0>();
        fence_operands(dpt);

        // ---- dSᵀ = Pᵀ∘(dPᵀ∘Z·rp − delta) (∘(1 − tanh²)), with Pᵀ as rounded for dV
        uint32 dsa[BLOCK_M / 16][4];
        ds_from_dp<T, M_TILES, DROPOUT>(dpt, pt.ds_p(), s_delta, t, pt.keep, p.var.dropout_scale);
        acc_to_a_operand<T>(dpt, dsa);
        // ---- dK += dSᵀ·Q (times softmax_scale in the epilogue)
        issue_keys_rs<T, BLOCK_M, HEAD_DIM>(acc_dk, dsa, sQ(stage));

        if constexpr (!DETERMINISTIC) {
            // ---- dSᵀ to shared memory (key rows, query columns) for dQ = dS·K
            store_ds_t<DSTile, BLOCK_M>(sdS_, dsa, key_row0, t);
            fence_proxy_async_smem();
            asm volatile("bar.sync 1, 256;\n" ::: "memory");  // all of dSᵀ written

            // ---- dQ[dq_row0 .. + 64, dq_col0 .. + DQ_COLS] = dS·K over all 128 keys:
            //      A = dS read MN-major from the dSᵀ tile (its 64-column block of those
            //      query rows), B = K read MN-major (its columns from dq_col0)
            float dq[1][DQ_COLS / 8][4];
            issue_dq<T, BLOCK_N, DQ_COLS, KVTile>(dq[0], sdS_ + (dq_row0 / 64) * DSTile::BLOCK_BYTES, sK_, dq_col0);
            wgmma_wait<0>();
            fence_operands(dq[0]);
            const SeqLens seq = seq_slot.load();
            float* dq_accum = p.dq_accum + query_row_index(p, b, h, seq, m0) * HEAD_DIM;
            atomic_add_frag(dq_accum, HEAD_DIM, dq, dq_row0 + (warp % 4) * 16, dq_col0, seq.seqlen_q - m0);
        } else {
            wgmma_wait<0>();
        }
        if constexpr (DS_UNDER_DV) fence_operands(dv_a);  // live until P·dO completed
        fence_operands(acc_dv);
        fence_operands(acc_dk);
    };
    // A block off the edges: with the map, mask-free where the mask keeps it wholly.
    auto step_bulk = [&](int it, int h, int m_block, int h_next, int m_next) {
        if constexpr (MAP) {
            if (map.state(h, m_block) == BLOCK_FULL) {
                return step(it, h, m_block, h_next, m_next, Bool<false>{}, Bool<false>{});
            }
        }
        step(it, h, m_block, h_next, m_next, Bool<false>{}, Bool<true>{});
    };

    for (int it = 0; MAP ? h < h_end : it < num_iters; ++it) {
        int h_next = h, m_next = m_block + 1;
        if (m_next == m_end) { m_next = m_begin; ++h_next; }
        map.seek(h_next, m_next, h_end, m_begin, m_end);
        // (edge(m_block) written out: called here, the lambda changed the default kernels' code)
        if (WINDOW ? blocks.masked(m_block) : m_block < m_masked_end) {
            step(it, h, m_block, h_next, m_next, Bool<true>{}, Bool<true>{});
        } else {
            step_bulk(it, h, m_block, h_next, m_next);
        }
        h = h_next;
        m_block = m_next;
    }
    cp_async_wait<0>();
    __syncthreads();  // seq_slot stored (when the loop ran no step); every warpgroup is done with sK, sV
    const SeqLens seq_end = seq_slot.load();

    // ---- epilogue: dK·scale, dV (staged through sK / sV)
    uint32 sK_ = sK, sV_ = sV;
    prepare_store_dkdv<DROPOUT>(p, acc_dv, sK_, sV_);
    store_dkdv<T, BLOCK_N, HEAD_DIM, NT, EVEN_K, KVTile>(p, acc_dk, acc_dv, seq_end, b, h_kv, split, n0, keys_valid,
                                                         key_row0, t, sK_, sV_, [] { __syncthreads(); },
                                                         threadIdx.x);
}

}  // namespace cupyflash

namespace cupyflash {

// ---------------------------------------------------------------------------
// dQ without atomics (deterministic mode) on wgmma: one block per (128 query
// rows, batch, head), each warpgroup owning 64 of them; the forward's shape
// with one more product. K and V stream through the forward's 3-stage ring
// (one barrier per key block); P and dS never leave registers:
//   S = Q·Kᵀ, dP = dO·Vᵀ (both operands from shared memory),
//   dS = P∘(dP − delta), dQ += dS·K (dS from registers, K read MN-major);
// with variants as the dK/dV kernel (above), key blocks as the forward's (Mask::key_blocks);
// a staged bias/mask (VAR_BIAS_STAGED) streams beside K and V as in the forward.
// Key blocks are summed in a fixed order, so dq is bitwise reproducible.
// Template parameters: T, HEAD_DIM (64 or 128), BLOCK_N, CTAS_PER_SM, IS_CAUSAL, EVEN_K, VARIANT.
// ---------------------------------------------------------------------------
// Scores of an m64 accumulator (score_tile's layout, one m-tile) that Mask hides -> -inf.
template <bool IS_CAUSAL, int VARIANT, int N_TILES>
__device__ __forceinline__ void mask_tile(float (&s)[1][N_TILES][4], const Mask<IS_CAUSAL, VARIANT>& mask, int row0,
                                          int col0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                if (!mask.visible(row0 + hh * 8, col0 + j * 8 + e)) s[0][j][2 * hh + e] = NEG_INF;
            }
        }
    }
}

template <typename T_, int HEAD_DIM_, int BLOCK_N_, int VARIANT_>
struct BwdDqSm90Traits {
    using T = T_;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr int BLOCK_M = 128;
    static constexpr int BLOCK_N = BLOCK_N_;
    static constexpr int NUM_THREADS = 256;
    static constexpr int STAGES = 3;
    using QTile = Swizzle128Tile<T, BLOCK_M, HEAD_DIM>;   // Q and dO (and the dQ staging, in sQ)
    using KVTile = Swizzle128Tile<T, BLOCK_N, HEAD_DIM>;  // K and V, STAGES of each
    // (VAR_BIAS_STAGED) the key block's bias/mask tile, a stage beside each K/V stage, as
    // the forward's; else ScoreMod reads them element by element (ElementTerms)
    static constexpr bool STAGED = (VARIANT_ & VAR_BIAS_STAGED) != 0;
    using Terms = typename Select<STAGED, StagedScoreTerms<VARIANT_, T, 1, BLOCK_N / 8, BLOCK_M, NUM_THREADS>,
                                  ElementTerms>::type;
    static constexpr int STAGE_BYTES = ScoreStageBytes<STAGED, VARIANT_, T, BLOCK_M, BLOCK_N, NUM_THREADS>::value;
    static constexpr int SMEM_BYTES = 2 * QTile::BYTES + STAGES * (2 * KVTile::BYTES + STAGE_BYTES) + 1024;
    static_assert(SMEM_BYTES <= 227 * 1024, "more shared memory than a Hopper block has");
};

template <typename T, int HEAD_DIM, int BLOCK_N, int CTAS_PER_SM, bool IS_CAUSAL, bool EVEN_K, int VARIANT>
__global__ void __launch_bounds__(256, CTAS_PER_SM)
flash_bwd_dq_sm90_kernel(const BwdParams p) {
    using Tr = BwdDqSm90Traits<T, HEAD_DIM, BLOCK_N, VARIANT>;
    constexpr int BLOCK_M = Tr::BLOCK_M, NT = Tr::NUM_THREADS, STAGES = Tr::STAGES;
    constexpr int N_TILES = BLOCK_N / 8, D_TILES = HEAD_DIM / 8;
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    constexpr bool SOFTCAP = (VARIANT & VAR_SOFTCAP) != 0, DROPOUT = (VARIANT & VAR_DROPOUT) != 0;
    static_assert(!(Tr::STAGED && SOFTCAP), "softcap's per-element path reads its bias itself (not staged)");

    extern __shared__ __align__(16) unsigned char smem[];
    const uint32 sQ = (smem_addr(smem) + 1023u) & ~1023u;
    const uint32 sdO = sQ + QTile::BYTES;
    const uint32 sK0 = sdO + QTile::BYTES;           // K stage s at sK0 + s * KVTile::BYTES
    const uint32 sV0 = sK0 + STAGES * KVTile::BYTES;  // V likewise
    const uint32 sB0 = sV0 + STAGES * KVTile::BYTES;  // bias/mask stages (staged only)
    // The launch's dynamic shared memory is dispatch's (bwd_dq_sm90_smem_bytes): it must
    // cover this kernel's (checked where the staged tiles' size is new).
    if constexpr (Tr::STAGED) {
        if (threadIdx.x == 0 && dynamic_smem_bytes() < uint32(Tr::SMEM_BYTES)) __trap();
    }

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wg = warp / 4;
    const int g = lane / 4, t = lane % 4;

    // ---- which tile, its sequence and rows (query_grid.cuh)
    const DqBlock blk = dq_block<IS_CAUSAL>(p, BLOCK_M);
    if (blk.m0 >= blk.seq.seqlen_q) return;  // past the end of a shorter sequence of a packed batch
    const int b = blk.b, h = blk.h, m_block = blk.m_block, m0 = blk.m0, rows_valid = blk.rows_valid;
    const SeqLens seq = blk.seq;
    const DqRows<T> rows = dq_rows<T>(p, blk);
    const T *q = rows.q, *dout = rows.dout, *k = rows.k, *v = rows.v;
    const int seqlen_k = seq.seqlen_k;

    const BlockRange blocks =
        Mask<IS_CAUSAL, VARIANT>(p.var, seq.seqlen_q, seq.seqlen_k).key_blocks(m0, BLOCK_M, BLOCK_N);
    const ScoreMod<VARIANT, T> mod(p.var, p.softmax_scale_log2, b, h, seq.seqlen_q, seq.seqlen_k);
    const KeyBlockMap<VARIANT> map(p.var, b, h, m_block);  // which blocks are visited (VAR_BLOCK_MAP)
    constexpr bool MAP = KeyBlockMap<VARIANT>::ON;

    // This thread's fragment rows r0, r0 + 8 of the block; their lse_log2 and
    // delta (0 past seqlen_q, like Q and dO: see flash_bwd.cu).
    const int r0 = wg * 64 + (warp % 4) * 16 + g;
    const int64 row_index0 = query_row_index(p, b, h, seq, m0);
    float lse2[2], delta[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = r0 + hh * 8;
        lse2[hh] = r < rows_valid ? p.lse_log2[row_index0 + r] : 0.f;
        delta[hh] = r < rows_valid ? p.delta[row_index0 + r] : 0.f;
    }
    typename Tr::Terms terms(mod, b, h, m0, r0, sB0);  // (staged) the bias and mask of a key block

    float acc_dq[D_TILES][4];
#pragma unroll
    for (int d = 0; d < D_TILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[d][e] = 0.f;

    auto load_kv = [&](int n, int stage) {
        const int rows = seqlen_k - n * BLOCK_N;
        load_tile<T, BLOCK_N, HEAD_DIM, NT, true, EVEN_K, KVTile>(
            sK0 + stage * KVTile::BYTES, k + int64(n) * BLOCK_N * p.k_row_stride, p.k_row_stride, rows, p.head_dim);
        load_tile<T, BLOCK_N, HEAD_DIM, NT, true, EVEN_K, KVTile>(
            sV0 + stage * KVTile::BYTES, v + int64(n) * BLOCK_N * p.v_row_stride, p.v_row_stride, rows, p.head_dim);
        // in the group of K and V; a mask all True (the map's FULL, off the edges) is not copied
        if constexpr (Tr::STAGED) terms.stage_in(n, stage, !MAP || blocks.masked(n) || map.state(n) != BLOCK_FULL);
    };

    // Prologue: Q, dO with the first key block, then the second (groups 0, 1). The
    // visited blocks, from the last down (as the forward's): n, then n_next (n - 1, n - 2,
    // ... without a block map); < blocks.begin: none left.
    int n_first = blocks.end - 1, n_next = n_first - 1;
    if constexpr (MAP) {
        n_first = map.prev(blocks.end, blocks.begin);
        n_next = n_first >= blocks.begin ? map.prev(n_first, blocks.begin) : n_first;
    }
    if (n_first >= blocks.begin) {
        load_tile<T, BLOCK_M, HEAD_DIM, NT, true, EVEN_K, QTile>(sQ, q, p.q_row_stride, rows_valid, p.head_dim);
        load_tile<T, BLOCK_M, HEAD_DIM, NT, true, EVEN_K, QTile>(sdO, dout, p.do_row_stride, rows_valid, p.head_dim);
        load_kv(n_first, 0);
    }
    cp_async_commit();
    if (n_next >= blocks.begin) load_kv(n_next, 1);
    cp_async_commit();

    int stage = 0;  // stage of key block n; the visited block after n_next goes to stage + 2 (mod 3)
    // One key block: masked (key tail, causal/window edge), attn_masked (its mask not all
    // True). Returns the block to visit next (< blocks.begin: none) and, with the map,
    // moves n_next on to the one after it, whose loads it issued.
    auto step = [&](int n, auto masked, auto attn_masked) -> int {
        cp_async_wait<1>();        // this thread's copies of block n have landed
        fence_proxy_async_smem();  // ... and are visible to wgmma
        __syncthreads();           // everyone's have; everyone is done with block n + 1
        const int n_after = !MAP ? n - 2 : n_next >= blocks.begin ? map.prev(n_next, blocks.begin) : n_next;
        {
            const int free_stage = stage == 0 ? STAGES - 1 : stage - 1;
            if (n_after >= blocks.begin) load_kv(n_after, free_stage);
            cp_async_commit();
        }
        const uint32 sK = sK0 + stage * KVTile::BYTES, sV = sV0 + stage * KVTile::BYTES;

        // ---- S = Q·Kᵀ and dP = dO·Vᵀ for this warpgroup's 64 rows
        float s[1][N_TILES][4], dp[1][N_TILES][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            Wgmma<T, BLOCK_N>::template ss<0, 0>(s[0], desc_k_major<BLOCK_M>(sQ, wg * 64, kk),
                                                 desc_k_major<BLOCK_N>(sK, 0, kk), kk > 0);
        }
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            Wgmma<T, BLOCK_N>::template ss<0, 0>(dp[0], desc_k_major<BLOCK_M>(sdO, wg * 64, kk),
                                                 desc_k_major<BLOCK_N>(sV, 0, kk), kk > 0);
        }
        wgmma_commit();
        // Dropout's keep bits of this step, drawn while the tensor cores work
        [[maybe_unused]] DropoutBits<1, N_TILES> keep;
        if constexpr (DROPOUT) keep.draw(Dropout(p.var, b, h, p.nheads_q), m0 + r0, n * BLOCK_N + 2 * t);
        wgmma_wait<1>();
        fence_operands(s[0]);

        // ---- P = prob(score, lse) (times 1 − tanh² with softcap: dS's factor), masked
        //      scores 0; element (j, 2 hh + e) is row m0 + r0 + 8 hh, column n·BLOCK_N + 8 j + 2 t + e
        constexpr bool MASKED = decltype(masked)::value;
        [[maybe_unused]] constexpr bool ATTN_MASKED = decltype(attn_masked)::value;  // (VARIANT 0: no mask)
        if constexpr (VARIANT == 0) {
            if constexpr (MASKED) {
                const SeqLens sl = seq_lens(p, b);
                mask_tile(s, Mask<IS_CAUSAL, VARIANT>(p.var, sl.seqlen_q, sl.seqlen_k), m0 + r0, n * BLOCK_N + 2 * t);
            }
            // (at most 1: the preprocess raised lse_log2, flash_bwd.cu)
#pragma unroll
            for (int j = 0; j < N_TILES; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[0][j][e] = fast_exp2(fmaf(s[0][j][e], p.softmax_scale_log2, -lse2[e / 2]));
        } else {
            SeqLens sl{};
            if constexpr (MASKED) sl = seq_lens(p, b);
            const Mask<IS_CAUSAL, VARIANT> mask(p.var, sl.seqlen_q, sl.seqlen_k);
            if constexpr (Tr::STAGED) {  // the block's bias and mask from its stage (no softcap)
                terms.template load<MASKED, ATTN_MASKED>(n * BLOCK_N + 2 * t, stage);
                score_tile<MASKED, ATTN_MASKED>(s, mod, mask, m0 + r0, n * BLOCK_N + 2 * t, terms);
#pragma unroll
                for (int j = 0; j < N_TILES; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[0][j][e] = prob(s[0][j][e], lse2[e / 2]);
            } else if constexpr (!SOFTCAP) {  // as the forward: scores in log2 units, masked to -inf
                score_tile<MASKED, ATTN_MASKED>(s, mod, mask, m0 + r0, n * BLOCK_N + 2 * t);
#pragma unroll
                for (int j = 0; j < N_TILES; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[0][j][e] = prob(s[0][j][e], lse2[e / 2]);
            } else {  // the same element by element, with the raw score's 1 − tanh²
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int row = m0 + r0 + hh * 8;
#pragma unroll
                    for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = n * BLOCK_N + j * 8 + 2 * t + e;
                            float& x = s[0][j][2 * hh + e];
                            float pr = prob(mod.template score<ATTN_MASKED>(x, row, col), lse2[hh]);
                            if (MASKED && !mask.visible(row, col)) pr = 0.f;
                            x = pr * mod.dscore(x);
                        }
                    }
                }
            }
        }

        // ---- dS = P∘(dP∘Z·rp − delta) (∘(1 − tanh²)), repacked as the register A operand of dS·K
        wgmma_wait<0>();
        fence_operands(dp[0]);
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float d = dp[0][j][e];
                if constexpr (DROPOUT) d = keep(0, e / 2, j, e & 1) ? d * p.var.dropout_scale : 0.f;
                dp[0][j][e] = s[0][j][e] * (d - delta[e / 2]);
            }
        }
        uint32 ds[BLOCK_N / 16][4];
        acc_to_a_operand<T>(dp[0], ds);

        // ---- dQ += dS·K (times softmax_scale in the epilogue)
        fence_operands(acc_dq);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            Wgmma<T, HEAD_DIM>::template rs<1>(acc_dq, ds[kk], desc_mn_major<BLOCK_N>(sK, kk));
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(acc_dq);
        stage = stage == STAGES - 1 ? 0 : stage + 1;
        if constexpr (MAP) {
            const int visit = n_next;
            n_next = n_after;
            return visit;
        } else {
            return n - 1;
        }
    };
    // Masked key blocks (key tail, causal diagonal) first, then the bulk with no mask
    // code, then the masked blocks of the window's left edge. With the map, the visited
    // blocks only (n = step(n): the next one), those the mask keeps wholly mask-free;
    // without, each block in turn (the loops written as they were: the map's form, with
    // no map, changed the default kernels' code).
    if constexpr (MAP) {
        auto step_bulk = [&](int n) -> int {
            if (map.state(n) == BLOCK_FULL) return step(n, Bool<false>{}, Bool<false>{});
            return step(n, Bool<false>{}, Bool<true>{});
        };
        int n = n_first;
        while (n >= blocks.unmasked_end) n = step(n, Bool<true>{}, Bool<true>{});
        while (n >= blocks.unmasked_begin) n = step_bulk(n);
        if constexpr (Mask<IS_CAUSAL, VARIANT>::WINDOW) {
            while (n >= blocks.begin) n = step(n, Bool<true>{}, Bool<true>{});
        }
    } else {
        int n = blocks.end - 1;
        for (; n >= blocks.unmasked_end; --n) step(n, Bool<true>{}, Bool<true>{});
        for (; n >= blocks.unmasked_begin; --n) step(n, Bool<false>{}, Bool<true>{});
        if constexpr (Mask<IS_CAUSAL, VARIANT>::WINDOW) {
            for (; n >= blocks.begin; --n) step(n, Bool<true>{}, Bool<true>{});
        }
    }

    // ---- epilogue: dq = scale·dQ in T, staged through this warpgroup's own 64 rows
    //      of sQ (no other warpgroup reads them) for 16-byte stores
    cp_async_wait<0>();
    asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg));
#pragma unroll
    for (int d = 0; d < D_TILES; ++d) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const uint32 val = TypeTraits<T>::pack(acc_dq[d][2 * hh] * p.softmax_scale,
                                                   acc_dq[d][2 * hh + 1] * p.softmax_scale);
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(sQ + QTile::offset(r0 + hh * 8, d) + t * 4), "r"(val));
        }
    }
    asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg));
    // With softcap the sequence's start is read again, not held across the loop (where
    // it spills at D=64); without, reading it again costs the loop registers instead.
    const int q_start = SOFTCAP ? seq_lens(p, b).q_start : seq.q_start;
    T* dq = static_cast<T*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride +
            int64(q_start + m0 + wg * 64) * p.dq_row_stride;
    store_tile<T, 64, HEAD_DIM, 128, true, EVEN_K, QTile, false>(dq, p.dq_row_stride, sQ + wg * 64 * 128,
                                                               rows_valid - wg * 64, p.head_dim);
}

}  // namespace cupyflash
