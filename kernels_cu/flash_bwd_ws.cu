// flash_bwd_ws.cu: the dK/dV (+ dQ) kernel of the FlashAttention-2 backward (Dao
// 2023, Algorithm 2) on Hopper, warp-specialised as FlashAttention-3's backward
// (Shah et al. 2024, mainloop_bwd_sm90_tma_gmma_ws): a producer warpgroup moves
// the data, two consumer warpgroups only compute.
//
// The tile and the products are flash_bwd_sm90.cu's (see its header): a block owns
// BLOCK_N = 128 keys of one (batch, KV head), consumer warpgroup c (threads 128 +
// 128c ..) 64 of them, and it loops over the query blocks (BLOCK_M = 64 rows; 128 without
// dQ, below) of the group's query heads, computing everything transposed (keys as rows):
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, Pᵀ = exp2(Sᵀ·scale·log2e − lse·log2e), dSᵀ = Pᵀ∘(dPᵀ − delta),
//   dV += Pᵀ·dO, dK += dSᵀ·Q, dQ = dS·K (dSᵀ through shared memory; warpgroup c takes
//   columns [c·D/2, (c+1)·D/2) of the 64 query rows, over all 128 keys).
// What differs is who moves the data:
//   * warp 0 of the producer warpgroup copies K and V once, and each step's Q and dO
//     with the bulk tensor copy engine (TMA) into a STAGES-deep ring of 128-byte-swizzled
//     stages (the layout wgmma's descriptors read), and the step's lse_log2 and delta
//     rows with plain loads; each stage completes on full_q[s] (the copies' bytes and the
//     warp's 32 arrivals), and the 8 consumer warps release it on empty_q[s] once their
//     last GEMM reading it (dK += dSᵀ·Q) has completed;
//   * warp 1 adds each step's dQ into dq_accum: the consumers leave their fp32 dQ in
//     shared memory (sdQ: 64 unpadded rows, in dq_accum's own layout, bwd_rows.cuh
//     dq_accum_piece, whose permutation keeps the fragment stores free of bank
//     conflicts) and arrive on DQ_FULL; the warp issues one bulk reduce-add
//     (cp.reduce.async.bulk .add.f32) of the step's 64 contiguous rows (those before
//     seqlen_q at a query tail), waits until the engine has read sdQ, and arrives on
//     DQ_EMPTY, which the consumers wait on before they write the next dQ. (Per-row
//     reduce-adds from padded rows cost the warp ~50 cycles each to issue, one lane at a
//     time: 64 a step kept the consumers waiting on DQ_EMPTY, PERF.md v24.)
// So the consumers (setmaxnreg 240) issue no load, no atomic and no block-wide barrier:
// their only synchronisation with each other is dSᵀ (DS_BAR, both warpgroups, once a
// step), double-buffered so that the next step's dSᵀ never waits for this step's dQ GEMM.
//
// Without dQ (WITH_DQ false: the plan takes dQ from flash_bwd_sm90.cu's wgmma dQ kernel,
// as at D=64, where the per-step dQ reduce-add has half D=128's FLOPs per byte and lost to
// that kernel, PERF.md v23) there are no dSᵀ tiles, no dQ GEMM, no sdQ and no warp 1:
// the two consumer warpgroups never wait for each other inside the loop, and each step
// may take BLOCK_M = 128 query rows (FlashAttention-3's hdim-64 tile), which halves the
// per-row share of the step's fixed work (PERF.md v24).
//
// Above 128 (BwdWsTraits::ROLES: 192, 256) a warpgroup's dK and dV over 64 keys would be
// 256 registers at D=256, so the consumers split by role instead: a block owns BLOCK_N = 64
// keys, both warpgroups the same ones; warpgroup 0 computes Sᵀ, Pᵀ and dV += Pᵀ·dO and hands
// Pᵀ (as dSᵀ takes it) to warpgroup 1 through shared memory (PT_BAR); warpgroup 1 computes
// dPᵀ, dSᵀ and dK += dSᵀ·Q and writes dSᵀ (DS_BAR); each adds its columns of dQ = dS·K into
// dq_accum from registers (the fp32 rows would not fit in shared memory beside the stages;
// plain layout, no warp 1), warpgroup 1 a step late, under warpgroup 0's Pᵀ (PERF.md v29).
//
// Rows past seqlen_q arrive as zeros (the map's bound), with lse_log2 = +inf (P = 0,
// so dV and dK get nothing from them) and delta 0 (dS = 0, so dK and dQ get nothing),
// and their dQ rows are not added. Keys past seqlen_k arrive as zeros too, are masked
// in Sᵀ (P = 0), and their dK, dV rows are not stored. A block whose keys no query
// block sees stores zeros and copies nothing.
//
// Variants (VARIANT, variant.cuh WS_VARIANTS: a window, softcap, ALiBi, sinks, dropout;
// those whose code lives in the scores): Pᵀ, its dropout keep bits and softcap's dS factor
// are flash_bwd_sm90.cu's, written once (bwd_sm90.cuh PtOperands), and so are its
// equations (see its header; sinks change nothing here, dsinks is the preprocess
// kernel's). Both warpgroups ask Mask for the query blocks a key block sees (a window's
// range); the producer copies exactly those steps, and the consumers run those
// blocks.masked() (key tail, causal diagonal, a window's two edges) with mask code, the
// rest without. dV's 1/(1-p) is applied once in the epilogue.
//
// An additive bias (WS_BWD_BIAS: of T, staged, i.e. with 16-byte rows): warp 0 copies each
// step's bias tile (the step's query rows by the block's keys, in 64-key 128-byte-swizzled
// boxes, BiasTile) by TMA into the step's stage beside Q and dO, under the same full_q
// barrier, from a map of the bias's own 4-D shape (cupyflash/_tma.py bias_map: a broadcast
// dimension has size 1 and coordinate 0); the consumers read it transposed into Pᵀ's score
// (variant.cuh StagedScoreTermsT, the cp.async kernel's reader). dbias is the dbias
// kernel's. A mask, a block map or an fp32 bias stays on flash_bwd_sm90.cu.
//
// Template parameters: T, HEAD_DIM (128, 192 and 256 with dQ; 64 with dQ for the variants and the bias,
// without it, beside the wgmma dQ kernel, for plain attention: cupyflash/dispatch.py
// bwd_ws_separate_dq), BLOCK_M (query rows per step: 64, or 128 without dQ), IS_CAUSAL,
// EVEN_K (head_dim == HEAD_DIM: no column predicates in the dK, dV stores), WITH_DQ,
// VARIANT (bits of WS_VARIANTS, and WS_BWD_BIAS; some sets spill at the consumers' 240
// registers: cupyflash/dispatch.py BWD_WS_VARIANT_SPILLS, _BWD_WS_ROLES_SPILLS,
// _BWD_WS_BIAS_SPILLS). Dense batches only (a packed batch's maps would bring the next
// sequence's rows into a tile's tail: measured slower with those rows zeroed in shared
// memory, PERF.md v23) and no deterministic mode: flash_bwd_sm90.cu's kernels serve
// those. 16-byte aligned data and strides (a TMA requirement).
#include "params.cuh"
#include "ptx.cuh"
#include "seqlens.cuh"
#include "query_grid.cuh"
#include "bwd_rows.cuh"
#include "tile_io.cuh"
#include "variant.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "bwd_sm90.cuh"

namespace cupyflash {

template <typename T_, int HEAD_DIM_, int BLOCK_M_, bool WITH_DQ_, bool BIAS_ = false>
struct BwdWsTraits : BwdWsRoles {
    using T = T_;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr bool WITH_DQ = WITH_DQ_;
    static constexpr bool BIAS = BIAS_;  // each stage holds the step's bias tile too (WS_BWD_BIAS)
    // Above 128 the warpgroups split the work by role, not by keys (see the header): one
    // block of 64 keys, dV in warpgroup 0, dK in warpgroup 1, dQ added from registers.
    static constexpr bool ROLES = HEAD_DIM > 128;
    static_assert(!ROLES || WITH_DQ, "the split by roles computes dQ itself");
    // Query rows per step: 64, or 128 without dQ at D=64 (FlashAttention-3's hdim-64
    // backward tile, 128 x 128: Sᵀ, dPᵀ m64n128, dV, dK 8 k-steps); dQ's per-step
    // fragment (64 rows x HEAD_DIM / 2 per warpgroup) is written for 64.
    static constexpr int BLOCK_M = BLOCK_M_;
    static_assert(BLOCK_M == 64 || (BLOCK_M == 128 && !WITH_DQ), "64 query rows per step, or 128 without dQ");
    static constexpr int BLOCK_N = ROLES ? 64 : 128;  // keys per block: 64 per consumer warpgroup, or 64 shared
    static constexpr int STAGES = 2;     // Q, dO, lse_log2, delta in flight
    using KVTile = Swizzle128Tile<T, BLOCK_N, HEAD_DIM>;  // K, V (and the dK, dV staging)
    using QTile = Swizzle128Tile<T, BLOCK_M, HEAD_DIM>;   // Q, dO
    using DSTile = Swizzle128Tile<T, BLOCK_N, BLOCK_M>;   // dSᵀ: key rows, BLOCK_M query columns
    using BiasTile = Swizzle128Tile<T, BLOCK_M, BLOCK_N>; // the bias: query rows, BLOCK_N key columns
    static constexpr int DQ_ROW_BYTES = HEAD_DIM * 4;
    // dSᵀ tiles: two (the next step's never waits for this one's dQ GEMM) when split by
    // keys; one when split by roles, whose barriers order its uses (see the consumers).
    static constexpr int DS_TILES = !WITH_DQ ? 0 : ROLES ? 1 : 2;
    // ROLES: Pᵀ from warpgroup 0 to warpgroup 1, in its A-operand registers' order
    // (thread-major: 16-byte piece kk of consumer thread c at (kk·128 + c)·16).
    static constexpr int PT_BYTES = ROLES ? BLOCK_N * BLOCK_M * int(sizeof(T)) : 0;
    // From the 1024-byte aligned base: K, V, dSᵀ x DS_TILES, (ROLES) Pᵀ, STAGES x (Q, dO, (BIAS) bias),
    // STAGES x (lse_log2, delta), (WITH_DQ, by keys) the dQ rows, the block's SeqLens, the
    // mbarriers (full_kv, full_q[STAGES], empty_q[STAGES]).
    static constexpr int DS_OFFSET = 2 * KVTile::BYTES;
    static constexpr int PT_OFFSET = DS_OFFSET + DS_TILES * DSTile::BYTES;
    static constexpr int Q_OFFSET = PT_OFFSET + PT_BYTES;
    static constexpr int STAGE_BYTES = 2 * QTile::BYTES + (BIAS ? BiasTile::BYTES : 0);
    static constexpr int ROWS_OFFSET = Q_OFFSET + STAGES * STAGE_BYTES;
    static constexpr int DQ_OFFSET = ROWS_OFFSET + STAGES * 2 * BLOCK_M * 4;
    static constexpr int SEQ_OFFSET = DQ_OFFSET + (WITH_DQ && !ROLES ? BLOCK_M * DQ_ROW_BYTES : 0);
    static constexpr int BAR_OFFSET = SEQ_OFFSET + SeqLensSlot::BYTES;
    static constexpr int SMEM_BYTES = BAR_OFFSET + 8 * (1 + 2 * STAGES) + 1024;  // +1024: the alignment
    static_assert(SMEM_BYTES <= 227 * 1024, "more shared memory than a Hopper block has");
    // Named barriers. By keys: dSᵀ written (consumers); dQ written / read (consumers and
    // warp 1). By roles: Pᵀ written (warpgroup 0 arrives, 1 waits); dSᵀ written (both).
    // Both: every consumer done with K and V (the epilogue stages dK, dV there).
    static constexpr int DS_BAR = 1, DQ_FULL_BAR = 2, DQ_EMPTY_BAR = 3, EPILOGUE_BAR = 4, PT_BAR = 5;
    static constexpr int DQ_BAR_THREADS = CONSUMER_THREADS + 32;
};

template <typename T, int HEAD_DIM, int BLOCK_M_, bool IS_CAUSAL, bool EVEN_K, bool WITH_DQ, int VARIANT>
__global__ void __launch_bounds__(384, 1)
flash_bwd_ws_kernel(const __grid_constant__ BwdTmaParams tp) {
    static_assert((VARIANT & ~(WS_VARIANTS | WS_BWD_BIAS)) == 0, "flash_bwd_ws_kernel: no mask, block map or fp32 bias");
    constexpr bool DROPOUT = (VARIANT & VAR_DROPOUT) != 0;
    constexpr bool BIAS = (VARIANT & WS_BWD_BIAS) != 0;
    static_assert(!BIAS || (VARIANT & WS_BWD_BIAS) == WS_BWD_BIAS, "flash_bwd_ws_kernel: a bias is staged");
    using Tr = BwdWsTraits<T, HEAD_DIM, BLOCK_M_, WITH_DQ, BIAS>;
    constexpr int BLOCK_M = Tr::BLOCK_M, BLOCK_N = Tr::BLOCK_N, STAGES = Tr::STAGES, BOX = Tr::BOX_COLS;
    constexpr int D_TILES = HEAD_DIM / 8;  // n8 tiles of dK, dV
    constexpr int M_TILES = BLOCK_M / 8;   // n8 tiles of Sᵀ, dPᵀ (query columns)
    constexpr int DQ_COLS = HEAD_DIM / 2;  // dQ columns per consumer warpgroup
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    using DSTile = typename Tr::DSTile;
    using BiasTile = typename Tr::BiasTile;
    const BwdParams& p = tp.bwd;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - smem_addr(smem_raw));
    const uint32 sK = base, sV = base + KVTile::BYTES, sdQ = base + Tr::DQ_OFFSET;
    auto sdS = [&](int buf) { return base + Tr::DS_OFFSET + buf * DSTile::BYTES; };
    auto sQ = [&](int stage) { return base + Tr::Q_OFFSET + stage * Tr::STAGE_BYTES; };
    auto sdO = [&](int stage) { return sQ(stage) + QTile::BYTES; };
    auto sBias = [&](int stage) { return sdO(stage) + QTile::BYTES; };  // (BIAS)
    auto rows_offset = [&](int stage) { return Tr::ROWS_OFFSET + stage * 2 * BLOCK_M * 4; };  // lse_log2, delta
    const uint32 bars = base + Tr::BAR_OFFSET;
    const uint32 full_kv = bars;
    auto full_q = [&](int stage) { return bars + 8 * (1 + stage); };
    auto empty_q = [&](int stage) { return bars + 8 * (1 + STAGES + stage); };

    // ---- which tile (query_grid.cuh)
    const KeyTileCoords tc = key_tile_coords(p, BLOCK_N);
    const int n_block = tc.n_block, b = tc.b, h_kv = tc.h_kv, heads = tc.heads;
    const int h_first = tc.h_first;
    const SeqLens seq = seq_lens(p, b);
    const int n0 = n_block * BLOCK_N;
    if (n0 >= seq.seqlen_k) return;  // past the end of a shorter sequence of a packed batch
    const int keys_valid = min(BLOCK_N, seq.seqlen_k - n0);
    const SeqLensSlot seq_slot{base + Tr::SEQ_OFFSET};

    // Query blocks [m_begin, m_end) of each head see these keys (a window's range); those
    // blocks.masked() need the mask (the causal diagonal, a window's two edges; all of them
    // at a key tail). Without a window they are [m_begin, m_masked_end): one bound held
    // across the consumers' loop instead of two (flash_bwd_sm90.cu).
    constexpr bool WINDOW = Mask<IS_CAUSAL, VARIANT>::WINDOW;
    const BlockRange blocks = Mask<IS_CAUSAL, VARIANT>(p.var, seq.seqlen_q, seq.seqlen_k).query_blocks(
        n0, BLOCK_N, keys_valid, BLOCK_M, ceil_div(seq.seqlen_q, BLOCK_M));
    const int m_begin = blocks.begin, m_end = blocks.end, nm = m_end - m_begin;
    const int m_masked_end = blocks.unmasked_end == m_end ? blocks.unmasked_begin : m_end;
    const int num_iters = heads * nm;  // steps: (head, query block) pairs, heads outer

    if (threadIdx.x == 0) {
        // the launch's dynamic shared memory is dispatch's (bwd_ws_smem_bytes): it must cover this
        if (dynamic_smem_bytes() < uint32(Tr::SMEM_BYTES)) __trap();
        seq_slot.store(seq);
        mbar_init(full_kv, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_q(s), 1 + 32);     // the copies' arrive.expect_tx, the row loads' 32 lanes
            mbar_init(empty_q(s), 4 * Tr::CONSUMERS);  // one arrival per consumer warp
        }
        fence_barrier_init();
    }
    __syncthreads();

    // The bias's terms of a step's Pᵀ, read transposed from its stage (BIAS), else none.
    using Terms = typename Select<BIAS, StagedScoreTermsT<VARIANT, T, BLOCK_M, BLOCK_N, Tr::CONSUMER_THREADS, BiasTile>,
                                  ElementTerms>::type;
    const int lane = threadIdx.x % 32;
    if (threadIdx.x < 128) {
        // ================= producer warpgroup
        setmaxnreg_dec<Tr::PRODUCER_REGS>();
        const int warp = threadIdx.x / 32;
        if (warp == 0) {
            // ---- loads: K, V once; each step's Q, dO (TMA) and lse_log2, delta (lanes)
            if (lane == 0 && num_iters > 0) {
                tma_prefetch_desc(tp.q_map);
                tma_prefetch_desc(tp.do_map);
                mbar_arrive_expect_tx(full_kv, 2 * KVTile::BYTES);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / BOX; ++c) {
                    tma_load_4d(sK + c * KVTile::BLOCK_BYTES, tp.k_map, full_kv, c * BOX, n0, h_kv, b);
                    tma_load_4d(sV + c * KVTile::BLOCK_BYTES, tp.v_map, full_kv, c * BOX, n0, h_kv, b);
                }
            }
            int h = h_first, m_block = m_begin;
#pragma unroll 1
            for (int it = 0; it < num_iters; ++it) {
                const int stage = it % STAGES, m0 = m_block * BLOCK_M;
                mbar_wait(empty_q(stage), ((it / STAGES) & 1) ^ 1);  // the consumers are done with it
                if (lane == 0) {
                    mbar_arrive_expect_tx(full_q(stage), Tr::STAGE_BYTES);
#pragma unroll
                    for (int c = 0; c < HEAD_DIM / BOX; ++c) {
                        tma_load_4d(sQ(stage) + c * QTile::BLOCK_BYTES, tp.q_map, full_q(stage), c * BOX, m0, h, b);
                        tma_load_4d(sdO(stage) + c * QTile::BLOCK_BYTES, tp.do_map, full_q(stage), c * BOX, m0, h, b);
                    }
                    if constexpr (BIAS) {
                        // the step's bias tile, in the bias's own 4-D shape (_tma.bias_map): a
                        // broadcast dimension (stride 0) has the one coordinate 0 (a broadcast
                        // row: the box's row 0, the one the consumers read; the rest zeros)
                        const VariantParams& v = p.var;
#pragma unroll
                        for (int c = 0; c < BLOCK_N / BOX; ++c) {
                            tma_load_4d(sBias(stage) + c * BiasTile::BLOCK_BYTES, tp.bias_map, full_q(stage),
                                        n0 + c * BOX, v.bias_row_stride ? m0 : 0, v.bias_head_stride ? h : 0,
                                        v.bias_batch_stride ? b : 0);
                        }
                    }
                }
                load_step_rows<BLOCK_M>(reinterpret_cast<float*>(smem + rows_offset(stage)), p, b, h, seq, m0, lane);
                mbar_arrive(full_q(stage));  // (release: this lane's stores)
                if (++m_block == m_end) { m_block = m_begin; ++h; }
            }
        } else if (WITH_DQ && !Tr::ROLES && warp == 1) {
            // ---- dQ: each step's rows added into dq_accum by the copy engine
            if (num_iters > 0) named_barrier_arrive<Tr::DQ_BAR_THREADS>(Tr::DQ_EMPTY_BAR);  // sdQ starts free
            int h = h_first, m_block = m_begin;
#pragma unroll 1
            for (int it = 0; it < num_iters; ++it) {
                const int m0 = m_block * BLOCK_M;
                const int rows_valid = seq.seqlen_q - m0;
                float* dq_accum = p.dq_accum + query_row_index(p, b, h, seq, m0) * HEAD_DIM;
                named_barrier_sync<Tr::DQ_BAR_THREADS>(Tr::DQ_FULL_BAR);  // the consumers' dQ is in sdQ
                if (lane == 0) {  // the step's rows of dq_accum and sdQ are contiguous alike
                    bulk_reduce_add_f32(dq_accum, sdQ, min(rows_valid, BLOCK_M) * Tr::DQ_ROW_BYTES);
                }
                bulk_commit();
                bulk_wait_read<0>();
                __syncwarp();
                if (it + 1 < num_iters) named_barrier_arrive<Tr::DQ_BAR_THREADS>(Tr::DQ_EMPTY_BAR);
                if (++m_block == m_end) { m_block = m_begin; ++h; }
            }
            bulk_wait<0>();
        }
        return;
    }

    // ================= consumers
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    const uint32 ct = threadIdx.x - 128;  // consumer thread
    const int warp = ct / 32, cw = warp / 4;
    const int g = lane / 4, t = lane % 4;
    // The producer's steps, in its order (heads outer), each with mask code or without.
    auto for_each_step = [&](auto& step) {
        int h = h_first, m_block = m_begin;
        for (int it = 0; it < num_iters; ++it) {
            if (WINDOW ? blocks.masked(m_block) : m_block < m_masked_end) step(it, h, m_block, Bool<true>{});
            else step(it, h, m_block, Bool<false>{});
            if (++m_block == m_end) { m_block = m_begin; ++h; }
        }
    };
    if constexpr (Tr::ROLES) {
        // ---- split by roles: warpgroup 0 Sᵀ, Pᵀ, dV += Pᵀ·dO; warpgroup 1 dPᵀ, dSᵀ, dK +=
        //      dSᵀ·Q; each some columns of dQ. Fragment rows: keys key_row0 and key_row0 + 8
        //      of the block in both (Sᵀ, dPᵀ, dK, dV); in dQ, the step's query rows alike.
        const bool p_side = cw == 0;
        const int key_row0 = (warp % 4) * 16 + g;
        // warpgroup 0's dQ columns: half, rounded up to whole 64-column chunks of the K tile
        // (a wgmma descriptor starts on one): at 192, 128 and 64
        constexpr int ROLES_DQ_COLS = (HEAD_DIM / 2 + 63) / 64 * 64;
        float acc[D_TILES][4];  // dV (warpgroup 0) or dK (warpgroup 1)
#pragma unroll
        for (int j = 0; j < D_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
        if (num_iters > 0) mbar_wait(full_kv, 0);
        const uint32 sPt = base + Tr::PT_OFFSET + (ct % 128) * 16;  // this thread's Pᵀ pieces, 2 KB apart

        // ---- dQ[0 .. 64, col0 .. + COLS) of query block m0 of head h = dS·K over the block's
        //      64 keys (warpgroup 0 the first ROLES_DQ_COLS columns, 1 the rest), added into
        //      dq_accum from registers (its rows before seqlen_q; no bulk copy: the fp32 rows
        //      would not fit in shared memory beside the stages). Waits for every group of the
        //      warpgroup (a dPᵀ issued before it too).
        auto add_dq = [&](auto cols, auto chunk, int col0, int h, int m0) {
            constexpr int COLS = decltype(cols)::value, CHUNK = decltype(chunk)::value;
            const SeqLens sq = seq_slot.load();
            const int rows_valid = sq.seqlen_q - m0;
            float* dq_rows = p.dq_accum + (query_row_index(p, b, h, sq, m0) + key_row0) * HEAD_DIM + col0 + 2 * t;
#pragma unroll 1
            for (int c = 0; c < COLS; c += CHUNK) {  // CHUNK columns at a time (registers)
                uint32 sK_ = sK, sdS_ = sdS(0);
                asm volatile("" : "+r"(sK_), "+r"(sdS_));
                float dq[CHUNK / 8][4];
                issue_dq<T, BLOCK_N, CHUNK, KVTile>(dq, sdS_, sK_, col0 + c);
                wgmma_wait<0>();
                fence_operands(dq);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    if (key_row0 + 8 * hh >= rows_valid) continue;
#pragma unroll
                    for (int j = 0; j < CHUNK / 8; ++j) {
                        red_add_f32x2(dq_rows + hh * 8 * HEAD_DIM + c + 8 * j, dq[j][2 * hh], dq[j][2 * hh + 1]);
                    }
                }
            }
        };
        // warpgroup 1's dQ columns at a time: 64 at 256 (its 128 beside dK, dPᵀ in flight,
        // would spill)
        constexpr int DQ1_COLS = HEAD_DIM - ROLES_DQ_COLS, DQ1_CHUNK = HEAD_DIM > 192 ? 64 : DQ1_COLS;
        // Warpgroup 1 adds a step's dQ at the next step, under warpgroup 0's Pᵀ: after
        // issuing that step's dPᵀ, before it waits for Pᵀ (the dSᵀ tile stays that step's
        // until warpgroup 1 writes the next: after Pᵀ, which warpgroup 0 writes after its own
        // dQ of the step before).
        int h_prev = 0, m0_prev = 0;

        auto step = [&](int it, int h, int m_block, auto masked) {
            constexpr bool MASKED = decltype(masked)::value;
            const int stage = it % STAGES;
            const int m0 = m_block * BLOCK_M;
            const float* s_lse = reinterpret_cast<const float*>(smem + rows_offset(stage));
            const float* s_delta = s_lse + BLOCK_M;
            uint32 sK_ = sK, sV_ = sV, sdS_ = sdS(0);
            asm volatile("" : "+r"(sK_), "+r"(sV_), "+r"(sdS_));
            mbar_wait(full_q(stage), (it / STAGES) & 1);
            if (p_side) {
                // ---- Sᵀ = K·Qᵀ; Pᵀ = prob(score, lse) with the variant (bwd_sm90.cuh PtOperands)
                float st[M_TILES][4];
                wgmma_fence();
                issue_keys_ss<T, BLOCK_M, BLOCK_N, HEAD_DIM>(st, sK_, sQ(stage), 0);
                wgmma_wait<0>();
                fence_operands(st);
                PtOperands<T, BLOCK_M, IS_CAUSAL, VARIANT> pt;
                pt.template recompute<MASKED, true, Terms>(st, p, seq_slot, s_lse, BIAS ? sBias(stage) : 0u, b, h, n0,
                                                           key_row0, m0, g, t);
                // ---- Pᵀ as dSᵀ takes it (softcap: P·(1 − tanh²)) to warpgroup 1, thread for thread
#pragma unroll
                for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
                    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
                                 :: "r"(sPt + kk * 128 * 16), "r"(pt.ds_p()[kk][0]), "r"(pt.ds_p()[kk][1]),
                                 "r"(pt.ds_p()[kk][2]), "r"(pt.ds_p()[kk][3]) : "memory");
                }
                named_barrier_arrive<Tr::CONSUMER_THREADS>(Tr::PT_BAR);
                // ---- dV += Pᵀ·dO (∘Z)
                issue_keys_rs<T, BLOCK_M, HEAD_DIM>(acc, pt.dv_a(), sdO(stage));
                wgmma_wait<0>();  // this warp is done with the stage's Q and dO
                fence_operands(pt.dv_a());
                __syncwarp();
                if (lane == 0) mbar_arrive(empty_q(stage));
            } else {
                // ---- dPᵀ = V·dOᵀ; with dropout, Z (the keep bits warpgroup 0 draws for the same rows)
                float dpt[M_TILES][4];
                wgmma_fence();
                issue_keys_ss<T, BLOCK_M, BLOCK_N, HEAD_DIM>(dpt, sV_, sdO(stage), 0);
                KeepBitsT keep;
                if constexpr (DROPOUT) keep.draw(Dropout(p.var, b, h, p.nheads_q), n0 + key_row0 - g, m0 + 2 * t, g, t);
                // ---- the step before's dQ (its last columns), under dPᵀ and warpgroup 0's Pᵀ
                if (it > 0) add_dq(Int<DQ1_COLS>{}, Int<DQ1_CHUNK>{}, ROLES_DQ_COLS, h_prev, m0_prev);
                else wgmma_wait<0>();
                fence_operands(dpt);
                // ---- dSᵀ = Pᵀ∘(dPᵀ∘Z·rp − delta) (∘(1 − tanh²)), with warpgroup 0's Pᵀ
                named_barrier_sync<Tr::CONSUMER_THREADS>(Tr::PT_BAR);
                uint32 pa[BLOCK_M / 16][4];
#pragma unroll
                for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
                    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(pa[kk][0]), "=r"(pa[kk][1]), "=r"(pa[kk][2]), "=r"(pa[kk][3])
                                 : "r"(sPt + kk * 128 * 16) : "memory");
                }
                ds_from_dp<T, M_TILES, DROPOUT>(dpt, pa, s_delta, t, keep, p.var.dropout_scale);
                uint32 dsa[BLOCK_M / 16][4];
                acc_to_a_operand<T>(dpt, dsa);
                // ---- dK += dSᵀ·Q (times softmax_scale in the epilogue); dSᵀ to shared memory
                issue_keys_rs<T, BLOCK_M, HEAD_DIM>(acc, dsa, sQ(stage));
                store_ds_t<DSTile, BLOCK_M>(sdS_, dsa, key_row0, t);
                fence_proxy_async_smem();
                named_barrier_sync<Tr::CONSUMER_THREADS>(Tr::DS_BAR);  // all of dSᵀ written
                wgmma_wait<0>();  // dK done: this warp is done with the stage's Q and dO
                fence_operands(dsa);
                __syncwarp();
                if (lane == 0) mbar_arrive(empty_q(stage));
                h_prev = h, m0_prev = m0;
            }
            if (p_side) {
                named_barrier_sync<Tr::CONSUMER_THREADS>(Tr::DS_BAR);  // all of dSᵀ written
                add_dq(Int<ROLES_DQ_COLS>{}, Int<ROLES_DQ_COLS>{}, 0, h, m0);
            }
            fence_operands(acc);
        };

        for_each_step(step);
        if (!p_side && num_iters > 0) add_dq(Int<DQ1_COLS>{}, Int<DQ1_CHUNK>{}, ROLES_DQ_COLS, h_prev, m0_prev);
        named_barrier_sync<Tr::CONSUMER_THREADS>(Tr::EPILOGUE_BAR);  // every consumer is done with sK, sV
        const SeqLens seq_end = seq_slot.load();

        // ---- epilogue: each warpgroup stages its accumulator (dV in sV, dK·scale in sK),
        //      then all store both (or, a GQA group split over blocks, writes its fp32 partials)
        uint32 sK_ = sK, sV_ = sV;
        if (p_side) prepare_store_dkdv<DROPOUT>(p, acc, sK_, sV_);
        else asm volatile("" : "+r"(sK_), "+r"(sV_));
        const KeyTileCoords te = VARIANT ? key_tile_coords_again(p, BLOCK_N) : tc;
        const int n0_end = VARIANT ? te.n_block * BLOCK_N : n0;
        const int keys_end = VARIANT ? min(BLOCK_N, seq_end.seqlen_k - n0_end) : keys_valid;
        float* part = nullptr;
        if (p.kv_splits > 1) {
            part = dkv_partial_dk<HEAD_DIM>(p, seq_end, te.b, te.h_kv, te.split, n0_end);
            if (p_side) part = dkv_partial_dv<HEAD_DIM>(p, part);
        }
        put_key_rows<T, HEAD_DIM, KVTile>(p, acc, p_side ? 1.f : p.softmax_scale, part, p_side ? sV_ : sK_, key_row0,
                                          keys_end, t);
        if (p.kv_splits > 1) return;
        named_barrier_sync<Tr::CONSUMER_THREADS>(Tr::EPILOGUE_BAR);
        store_staged_dkdv<T, BLOCK_N, HEAD_DIM, Tr::CONSUMER_THREADS, EVEN_K, KVTile>(
            p, seq_end, te.b, te.h_kv, n0_end, keys_end, sK_, sV_, ct);
    } else {
        // This thread's fragment rows: keys key_row0 and key_row0 + 8 of the block (Sᵀ, dPᵀ,
        // dK, dV); in dQ, query rows 16 (warp % 4) + g (+ 8) of the step, columns from dq_col0.
        const int key_row0 = cw * 64 + (warp % 4) * 16 + g;
        [[maybe_unused]] const int dq_row0 = (warp % 4) * 16 + g, dq_col0 = cw * DQ_COLS;

        float acc_dk[D_TILES][4], acc_dv[D_TILES][4];
    #pragma unroll
        for (int j = 0; j < D_TILES; ++j)
    #pragma unroll
            for (int e = 0; e < 4; ++e) { acc_dk[j][e] = 0.f; acc_dv[j][e] = 0.f; }
        if (num_iters > 0) mbar_wait(full_kv, 0);

        auto step = [&](int it, int h, int m_block, auto masked) {
            constexpr bool MASKED = decltype(masked)::value;
            const int stage = it % STAGES;
            const int m0 = m_block * BLOCK_M;
            const float* s_lse = reinterpret_cast<const float*>(smem + rows_offset(stage));
            const float* s_delta = s_lse + BLOCK_M;
            // Loop-invariant tile addresses, made opaque so the compiler rebuilds the
            // descriptors each step instead of keeping them live (flash_bwd_sm90.cu).
            uint32 sK_ = sK, sV_ = sV, sdS_ = WITH_DQ ? sdS(it & 1) : 0u;
            asm volatile("" : "+r"(sK_), "+r"(sV_), "+r"(sdS_));
            mbar_wait(full_q(stage), (it / STAGES) & 1);

            // ---- Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for this warpgroup's 64 keys
            float st[M_TILES][4], dpt[M_TILES][4];
            issue_st_dpt<T, BLOCK_M, BLOCK_N, HEAD_DIM>(st, dpt, sK_, sV_, sQ(stage), sdO(stage), cw);
            wgmma_wait<1>();
            fence_operands(st);

            // ---- Pᵀ = prob(score, lse) with the variant (bwd_sm90.cuh PtOperands)
            PtOperands<T, BLOCK_M, IS_CAUSAL, VARIANT> pt;
            pt.template recompute<MASKED, true, Terms>(st, p, seq_slot, s_lse, BIAS ? sBias(stage) : 0u, b, h, n0,
                                                       key_row0, m0, g, t);
            uint32 (&dv_a)[BLOCK_M / 16][4] = pt.dv_a();
            // dPᵀ, then dSᵀ; dV's GEMM before (D=128: waited for with dPᵀ, its register operand
            // live until it completes; D=64 computes dS under it; flash_bwd_sm90.cu) or, with
            // dropout at D=128, after: Pᵀ (dS's) and Pᵀ∘Z (dV's) both live under it spilled
            // 16-24 bytes (nvcc 13.0); so Pᵀ dies into dSᵀ first, and dV and dK go together.
            constexpr bool DS_UNDER_DV = HEAD_DIM <= 64, DV_AFTER_DS = DROPOUT && !DS_UNDER_DV;
            // ---- dV += Pᵀ·dO (∘Z)
            if constexpr (!DV_AFTER_DS) issue_keys_rs<T, BLOCK_M, HEAD_DIM>(acc_dv, dv_a, sdO(stage));
            wgmma_wait<DS_UNDER_DV ? 1 : 0>();
            fence_operands(dpt);

            // ---- dSᵀ = Pᵀ∘(dPᵀ∘Z·rp − delta) (∘(1 − tanh²)), with Pᵀ as rounded for dV
            uint32 dsa[BLOCK_M / 16][4];
            ds_from_dp<T, M_TILES, DROPOUT>(dpt, pt.ds_p(), s_delta, t, pt.keep, p.var.dropout_scale);
            acc_to_a_operand<T>(dpt, dsa);
            if constexpr (DV_AFTER_DS) issue_keys_rs<T, BLOCK_M, HEAD_DIM>(acc_dv, dv_a, sdO(stage));
            // ---- dK += dSᵀ·Q (times softmax_scale in the epilogue)
            issue_keys_rs<T, BLOCK_M, HEAD_DIM>(acc_dk, dsa, sQ(stage));

            if constexpr (WITH_DQ) {
                // ---- dSᵀ to shared memory (key rows, query columns), this step's buffer
                store_ds_t<DSTile, BLOCK_M>(sdS_, dsa, key_row0, t);
                fence_proxy_async_smem();
                named_barrier_sync<Tr::CONSUMER_THREADS>(Tr::DS_BAR);  // all of dSᵀ written

                // ---- dQ[0 .. 64, dq_col0 .. + DQ_COLS] = dS·K over all 128 keys: A = dS read
                //      MN-major from the dSᵀ tile, B = K read MN-major (its columns from dq_col0)
                float dq[DQ_COLS / 8][4];
                issue_dq<T, BLOCK_N, DQ_COLS, KVTile>(dq, sdS_, sK_, dq_col0);
                wgmma_wait<1>();  // dV, dK done: this warp is done with the stage's Q and dO
                __syncwarp();
                if (lane == 0) mbar_arrive(empty_q(stage));
                wgmma_wait<0>();
                fence_operands(dq);

                // ---- dQ to sdQ, in dq_accum's layout, for warp 1's reduce-add (once it has read
                //      the step before's). This thread's rows (dq_row0, + 8) are alike mod 4 (m0 is
                //      a multiple of 64), so their pieces are permuted alike; and the permutation
                //      touches the low two bits only, so piece dq_col0 / 8 + j (dq_col0 / 8 is 0 or
                //      a multiple of 8) lies at dq_col0 / 8 + dq_accum_piece(j, ..).
                named_barrier_sync<Tr::DQ_BAR_THREADS>(Tr::DQ_EMPTY_BAR);
                const uint32 sdq_row = sdQ + dq_row0 * Tr::DQ_ROW_BYTES + dq_col0 * 4 + t * 8;
    #pragma unroll
                for (int j = 0; j < DQ_COLS / 8; ++j) {
    #pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                                     :: "r"(sdq_row + dq_accum_piece(j, dq_row0) * 32 + hh * 8 * Tr::DQ_ROW_BYTES),
                                     "f"(dq[j][2 * hh]), "f"(dq[j][2 * hh + 1]));
                    }
                }
                fence_proxy_async_shared();  // this thread's stores before the copy engine's reads
                named_barrier_arrive<Tr::DQ_BAR_THREADS>(Tr::DQ_FULL_BAR);
            } else {
                wgmma_wait<0>();  // dV, dK done: this warp is done with the stage's Q and dO
                __syncwarp();
                if (lane == 0) mbar_arrive(empty_q(stage));
            }
            if constexpr (DS_UNDER_DV) fence_operands(dv_a);  // live until P·dO completed
            fence_operands(acc_dv);
            fence_operands(acc_dk);
        };

        for_each_step(step);
        named_barrier_sync<Tr::CONSUMER_THREADS>(Tr::EPILOGUE_BAR);  // every consumer is done with sK, sV
        const SeqLens seq_end = seq_slot.load();

        // ---- epilogue: dK·scale, dV (staged through sK / sV).
        //      With a variant the tile's coordinates are recomputed here: its code leaves no
        //      registers to hold them across the loop (dropout, a window with ALiBi: 8-24 bytes
        //      of spill, nvcc 13.0); the plain kernel keeps them.
        uint32 sK_ = sK, sV_ = sV;
        prepare_store_dkdv<DROPOUT>(p, acc_dv, sK_, sV_);
        const KeyTileCoords te = VARIANT ? key_tile_coords_again(p, BLOCK_N) : tc;
        const int n0_end = VARIANT ? te.n_block * BLOCK_N : n0;
        const int keys_end = VARIANT ? min(BLOCK_N, seq_end.seqlen_k - n0_end) : keys_valid;
        store_dkdv<T, BLOCK_N, HEAD_DIM, Tr::CONSUMER_THREADS, EVEN_K, KVTile>(
            p, acc_dk, acc_dv, seq_end, te.b, te.h_kv, te.split, n0_end, keys_end, key_row0, t, sK_, sV_,
            [] { named_barrier_sync<Tr::CONSUMER_THREADS>(Tr::EPILOGUE_BAR); }, ct);
    }
}

}  // namespace cupyflash
