// flash_fwd_ws.cu: the FlashAttention-2 forward (Dao 2023, Algorithm 1) on Hopper,
// warp-specialised as FlashAttention-3 (Shah et al. 2024): a producer warpgroup
// moves Q, K and V with the bulk tensor copy engine (TMA), two consumer
// warpgroups only compute (wgmma, online softmax).
//
// A thread block computes a tile, BLOCK_M = 128 query rows of one (batch, head) (or,
// persistent, several tiles in turn), or 192 (below): consumer warpgroup c (threads
// 128 + 128c ..) owns 64 of them. Warpgroup 0 gives its registers away (setmaxnreg.dec to 24) and
// one of its threads issues every copy: Q once a tile, then each key block's K and
// V tiles into a STAGES-deep ring of 128-byte-swizzled stages (the layout wgmma's
// descriptors read, wgmma.cuh Swizzle128Tile, with no copy through registers). Each
// copy completes on an mbarrier (full_q, full_k[s], full_v[s]: arrive.expect_tx of the
// tile's bytes); each consumer warp arrives on empty_k[s] once its S GEMM on stage s's
// K has completed and on empty_v[s] once its P·V on stage s's V has, and the producer
// waits there before it refills that tile. K and V are released apart and the producer
// copies K_{n+1} before V_n (FA3's order): a K stage comes free as soon as S has
// read it, about one GEMM phase after it was needed, where one shared release at the
// end of P·V would free it only when the next key block is already due (PERF.md:
// with two stages the next K was copied only once both consumers had finished the
// P·V before it, and the consumers waited out the copy's latency every key block).
// Tails need no predicates: TMA zero-fills rows past seqlen (a packed batch's: past
// total) and columns past head_dim; the key tail is masked in S.
//
// Why this shape (the cp.async kernel, flash_fwd_sm90.cu, measured waiting on its
// loads at D=128, PERF.md): the copies cost the consumers no instructions, no
// registers and no block-wide barrier, so the consumers (setmaxnreg.inc to 240)
// keep S (64 registers at BLOCK_N = 128), P (32) and O (64) live at once, and two
// overlaps hide the softmax under the tensor cores:
//   * within a warpgroup: S_n = Q·K_nᵀ is issued together with O += P_{n-1}·V_{n-1},
//     and block n's softmax runs while P_{n-1}·V_{n-1} is still in flight; O is
//     rescaled by block n's factors only after that GEMM has completed;
//   * between the two warpgroups (ping-pong): each issues its GEMMs only between
//     named-barrier sync (its own id) and arrive (the other's), so their GEMM
//     phases alternate and one's softmax runs under the other's GEMMs.
// FA3 at D=128 takes the same tile (128 x 128, two stages, both overlaps). Two
// stages of 128-key K and V tiles are 128 KB (+32 KB Q); a third fits (224 KB) and
// is the table's to choose (cupyflash/dispatch.py _FWD_WS: three at D=128).
// BLOCK_M = 192 is FA3's hdim-64 tile: three consumer warpgroups (setmaxnreg 160) take
// turns at the tensor cores in a ring (c issues after c - 1, mod 3). At D=64 a block's
// GEMMs take half of D=128's time against the same softmax, so with two warpgroups the
// tensor cores wait on the softmax; with three, two softmaxes run under each GEMM phase.
//
// Template parameters, in order:
//   T          __half or __nv_bfloat16
//   HEAD_DIM   padded head dimension, 64, 128, 192 or 256 (O's 96 or 128 accumulators a
//              thread at the last two: 112- or 64-key blocks, cupyflash/dispatch.py _FWD_WS);
//              runtime head_dim <= HEAD_DIM
//   BLOCK_M    query rows per tile: 64 per consumer warpgroup, 128 (two) or 192 (three)
//   BLOCK_N    keys per tile
//   STAGES     K/V ring depth
//   IS_CAUSAL  bottom-right aligned causal mask
//   EVEN_K     head_dim == HEAD_DIM (no column predicates in the O stores)
//   VARIANT    variant.cuh's VAR_* bits: WS_VARIANTS (softcap, ALiBi, a window, sinks,
//              dropout) or none, each optionally with WS_FWD_MAP_VARIANTS (a bool mask
//              with its tile map, below) or WS_FWD_BIAS (a bias of T, below); an fp32,
//              strided or masked bias goes to flash_fwd_sm90.cu
//   VARLEN     a packed batch (cu_seqlens); false: dense, whose code is then as if
//              packing did not exist (as a runtime branch it reordered the dense main
//              loop: 2.028 against 1.947 ms at S=8192, PERF.md runs 86-87)
//   PERSISTENT one block per SM walking the query tiles (tile_scheduler.cuh; not with
//              a window and dropout together, a map, or packed); false: one block per tile
// Dense and packed (varlen) batches alike (seqlens.cuh), 16-byte aligned data and
// strides (a TMA requirement). A packed batch's maps describe its (total, nheads,
// head_dim) tensors as one sequence of a batch of 1 (cupyflash/_gpu.py tma_maps):
// the copies start at the sequence's first row (q_start + m0, k_start + n BLOCK_N) of
// batch 0, as FA3 does. Rows past a sequence's end then come from the next sequence
// (past the last, the map's bound: zeros): its keys are masked as the dense key tail
// is (Mask asks the sequence's seqlen_k; P = 0 on them), and the producer's warp zeroes
// those V rows before the consumers' P·V reads them (they may hold anything, NaN
// included, and 0 x NaN is NaN; the copy completes on tail_v, the warp zeroes, then
// arrives on full_v); its queries are computed and never stored (the epilogue's stores
// are masked to the sequence's rows, store_fwd_rows). A tile past the end of a shorter
// sequence is skipped (tile_scheduler.cuh; a block with no tile returns at once, as in
// flash_fwd_sm90.cu). Packed batches are never persistent.
//
// Persistent (PERSISTENT; FlashAttention-3's persistent kernels): a block computes
// several tiles, the scheduler's, one after the other. The K/V ring's stages and
// phases run on across tiles, so the producer copies the next tile's first K while
// the consumers finish this tile's last GEMMs and epilogue; Q waits on empty_q, where
// every consumer warp arrives once its O has left sQ (the epilogue stages O there).
// seqused_k: keys past a sequence's count are masked in S (P = 0), but their rows
// are still read (up to seqlen_k) and must hold finite values, as P·V multiplies them
// (but those of the last key block, which a packed batch's producer zeroes).
//
// Variants (variant.cuh, as flash_fwd_sm90.cu takes them): both warpgroups ask Mask for
// the key blocks the query block sees (a window's range); the producer copies exactly
// those, from the last down, and the consumers walk the same blocks in the same order,
// the masked ones (key tail, causal diagonal, a window's edges) with mask code, the
// rest without. A query block that sees no key block copies nothing but Q and goes
// straight to the epilogue (O = 0, lse = -inf; the sink's lse with sinks). softcap and
// ALiBi are score_tile's (ScoreMod); sinks start the running max and join the sums in
// finalize; dropout's keep bits (they depend on no score) are drawn while the S GEMM
// runs (KEEP_UNDER_S) and zero P after the row sums took it, before P·V.
//
// Block sparsity (VAR_MASK with VAR_BLOCK_MAP: a bool mask and its map at this kernel's
// 128 x BLOCK_N tile, variant.cuh KeyBlockMap, which cupyflash/_blockmask.py coarsens from
// its 64 x 64 cells; alone, or with ALiBi or sinks; one block per tile): the producer and
// the consumers walk the same key blocks, those of the range that the map does not mark
// EMPTY (KeyBlockMap::prev, from the last down), so an empty block costs no copy and no
// GEMM, only its byte of the map (a ballot reads 32 of them at once: the producer's walk
// is therefore its whole first warp's, lane 0 issuing the copies). Of the blocks visited,
// the range's edges (key tail, causal diagonal) take the edge's mask code and the mask, a
// FULL block of the bulk the plain step, a PARTIAL one the mask. A step reads its block's
// mask in pairs of columns into registers (variant.cuh ScoreTerms: 32 a thread, loaded once
// the GEMMs are issued, so that their latency hides under S_n and P·V; the plan sends masks
// that cannot be read in pairs, VAR_BIAS_STRIDED, to flash_fwd_sm90.cu). Read element by
// element after the S GEMM instead (ScoreMod::keep_masked), the 64 loads, hoisted together,
// spilled 72-456 bytes next to S, P and O (nvcc 13.0). A query block whose every tile is
// empty copies Q only and stores O = 0, lse = -inf, as a row that sees no key.
//
// An additive bias (WS_FWD_BIAS: of T, rows pair-aligned, any batch/head/row strides,
// the plan's VAR_BIAS_STRIDED otherwise): each step reads its block's bias as the map's
// mask is read, in pairs into registers once the block's GEMMs are issued (ScoreTerms, 32
// words a thread at 128 keys; the key tail's odd column alone), and score_tile adds it
// (ScoreMod: after softcap and ALiBi). No shared memory: the K/V stages fill it, and the
// bias stream's loads go out from the consumers under the GEMMs, as the mask's.
#include "params.cuh"
#include "block_traits.cuh"
#include "seqlens.cuh"
#include "query_grid.cuh"
#include "variant.cuh"
#include "online_softmax.cuh"
#include "warp_mma.cuh"
#include "tma.cuh"
#include "fwd_sm90.cuh"
#include "tile_scheduler.cuh"

namespace cupyflash {

// NUM_THREADS: the producer warpgroup and one consumer warpgroup per 64 rows.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES_>
struct FwdWsTraits : BlockTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, 128 * (1 + BLOCK_M / 64)> {
    static constexpr int STAGES = STAGES_;
    static_assert(BLOCK_M == 128 || BLOCK_M == 192, "two or three consumer warpgroups");
    static constexpr int CONSUMERS = BLOCK_M / 64;               // consumer warpgroups, 64 rows each
    static constexpr int PRODUCER_REGS = 24;
    // (three: (65536 - 24 x 128) / 384, down to a multiple of 8)
    static constexpr int CONSUMER_REGS = CONSUMERS == 2 ? 240 : 160;
    static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= 65536, "more registers than an SM has");
    static constexpr int N_TILES = BLOCK_N / 8;
    static constexpr int D_TILES = HEAD_DIM / 8;
    using QTile = Swizzle128Tile<T, BLOCK_M, HEAD_DIM>;
    using KVTile = Swizzle128Tile<T, BLOCK_N, HEAD_DIM>;
    static constexpr int BOX_COLS = 64;  // elements per TMA box row: the 128-byte swizzle span (cupyflash/_tma.py)
    // mbarriers: full_q, full_k[STAGES], full_v[STAGES], empty_k[STAGES], empty_v[STAGES], empty_q
    // (the persistent kernel's), tail_v (a packed batch's; both 8 bytes reserved either way)
    static constexpr int BARRIER_BYTES = 8 * (3 + 4 * STAGES);
    // +1024: the window is aligned up to the swizzle atom (cupyflash/dispatch.py fwd_ws_smem_bytes)
    static constexpr int SMEM_BYTES = QTile::BYTES + 2 * STAGES * KVTile::BYTES + BARRIER_BYTES + 1024;
    static_assert(SMEM_BYTES <= 227 * 1024, "more shared memory than a Hopper block has");
    // Named barriers: 1 + c, consumer c's epilogue; SCHED + c, its turn to issue GEMMs.
    static constexpr int EPILOGUE_BAR = 1, SCHED_BAR = 1 + CONSUMERS;
};

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, bool IS_CAUSAL, bool EVEN_K, int VARIANT,
          bool VARLEN, bool PERSISTENT>
__global__ void __launch_bounds__((FwdWsTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES>::NUM_THREADS), 1)
flash_fwd_ws_kernel(const __grid_constant__ FwdTmaParams tp) {
    static_assert((VARIANT & ~(WS_VARIANTS | WS_FWD_MAP_VARIANTS | WS_FWD_BIAS)) == 0,
                  "flash_fwd_ws_kernel: a bias of T in pairs only (no fp32, strided or staged bias)");
    // (dropout's Philox state, or a mask's pairs, next to the bias's 32 registers of pairs
    // spill: cupyflash/dispatch.py FWD_WS_BIAS_SPILLS; some sets of the rest do at 128 and
    // 256, which the plan keeps off this kernel: _FWD_WS_SPILLS)
    static_assert((VARIANT & WS_FWD_BIAS) == 0 || (VARIANT & (VAR_DROPOUT | VAR_MASK)) == 0,
                  "flash_fwd_ws_kernel: the bias alone, or with a window, softcap, ALiBi or sinks");
    static_assert((VARIANT & WS_FWD_MAP_VARIANTS) == 0 || (VARIANT & WS_FWD_MAP_VARIANTS) == WS_FWD_MAP_VARIANTS,
                  "flash_fwd_ws_kernel: a mask with its block map, or neither");
    // (the walk's state spills next to a window's and dropout's: cupyflash/dispatch.py FWD_WS_NOT_PERSISTENT)
    static_assert(!PERSISTENT || (VARIANT & (VAR_WINDOW | VAR_DROPOUT)) != (VAR_WINDOW | VAR_DROPOUT),
                  "flash_fwd_ws_kernel: not persistent with a window and dropout");
    // (nor with the block map: the walk's state next to the map's and the mask's spills 40-72
    // bytes, nvcc 13.0; and a sparse call's tiles are of unequal cost, which one block per
    // tile balances better: cupyflash/dispatch.py uses_persistent_ws, kernels_cu/PERF.md v24)
    static_assert(!PERSISTENT || (VARIANT & VAR_BLOCK_MAP) == 0, "flash_fwd_ws_kernel: not persistent with a map");
    // (nor packed: the producer's zeroing of a sequence's last V rows next to the walk's
    // state spills 40-112 bytes at its 24 registers: cupyflash/dispatch.py uses_persistent_ws)
    static_assert(!PERSISTENT || !VARLEN, "flash_fwd_ws_kernel: not persistent with a packed batch");
    // (the map's mask pairs next to a window's edges, softcap's or dropout's state spill 8-144
    // bytes: cupyflash/dispatch.py FWD_WS_MAP_SPILLS, those calls take flash_fwd_sm90.cu)
    static_assert((VARIANT & VAR_BLOCK_MAP) == 0 || (VARIANT & (VAR_WINDOW | VAR_SOFTCAP | VAR_DROPOUT)) == 0,
                  "flash_fwd_ws_kernel: the map alone, or with ALiBi or sinks");
    constexpr bool DROPOUT = (VARIANT & VAR_DROPOUT) != 0;
    constexpr bool MAP = KeyBlockMap<VARIANT>::ON;  // the mask's tile map: empty key blocks skipped
    constexpr bool RAW = RAW_SCORES<VARIANT>;  // plain scores stay q·k: the scale rides the softmax's exp2s
    // Dropout's keep bits depend on no score: drawn while the consumer waits for its S
    // GEMM; with a window, whose edges leave no room for the Philox rounds next to S's
    // accumulators (20 bytes of spill, nvcc 13.0), before the GEMMs are issued.
    constexpr bool KEEP_UNDER_S = !Mask<IS_CAUSAL, VARIANT>::WINDOW;
    using Tr = FwdWsTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES>;
    constexpr int N_TILES = Tr::N_TILES, D_TILES = Tr::D_TILES, BOX = Tr::BOX_COLS;
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    // A block's bias or (with the map) mask pairs in registers (variant.cuh ScoreTerms, read
    // in pairs once the block's GEMMs are issued)
    using Terms = ScoreTerms<VARIANT, T, 1, N_TILES>;
    constexpr bool TERMS = Terms::ANY;
    const FwdParams& p = tp.fwd;

    extern __shared__ __align__(16) unsigned char smem[];
    const uint32 sQ = (smem_addr(smem) + 1023u) & ~1023u;
    const uint32 sK0 = sQ + QTile::BYTES;                // K stage s at sK0 + s * KVTile::BYTES
    const uint32 sV0 = sK0 + STAGES * KVTile::BYTES;     // V likewise
    const uint32 bars = sV0 + STAGES * KVTile::BYTES;
    const uint32 full_q = bars;
    auto full_k = [&](int s) { return bars + 8 * (1 + s); };
    auto full_v = [&](int s) { return bars + 8 * (1 + STAGES + s); };
    auto empty_k = [&](int s) { return bars + 8 * (1 + 2 * STAGES + s); };
    auto empty_v = [&](int s) { return bars + 8 * (1 + 3 * STAGES + s); };
    const uint32 empty_q = bars + 8 * (1 + 4 * STAGES);  // persistent only: sQ free for the next tile's Q
    const uint32 tail_v = bars + 8 * (2 + 4 * STAGES);   // packed only: a last V block's copy, before its zeroing

    const FwdTileScheduler<BLOCK_M, IS_CAUSAL, VARLEN, PERSISTENT> scheduler{p};
    FwdTile tile;
    if (!scheduler.first(tile)) return;  // no tile with a query (uniform)
    // The tile's mask and the key blocks its query block sees; next_tile moves both on.
    Mask<IS_CAUSAL, VARIANT> mask(p.var, tile.seq.seqlen_q, tile.seq.seqlen_k);
    BlockRange blocks = mask.key_blocks(tile.m0, BLOCK_M, BLOCK_N);
    auto next_tile = [&] {
        if (!scheduler.next(tile)) return false;
        mask = Mask<IS_CAUSAL, VARIANT>(p.var, tile.seq.seqlen_q, tile.seq.seqlen_k);
        blocks = mask.key_blocks(tile.m0, BLOCK_M, BLOCK_N);
        return true;
    };

    if (threadIdx.x == 0) {
        mbar_init(full_q, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_k(s), 1);
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), 4 * Tr::CONSUMERS);  // one arrival per consumer warp
            mbar_init(empty_v(s), 4 * Tr::CONSUMERS);
        }
        if constexpr (PERSISTENT) mbar_init(empty_q, 4 * Tr::CONSUMERS);
        if constexpr (VARLEN) mbar_init(tail_v, 1);
        fence_barrier_init();
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        // ================= producer: one thread issues every copy (with the block map,
        // its warp walks the key blocks with it: the map's reads are warp-wide ballots)
        setmaxnreg_dec<Tr::PRODUCER_REGS>();
        if (MAP ? threadIdx.x < 32 : threadIdx.x == 0) {
            const bool issues = !MAP || threadIdx.x == 0;  // the thread that issues the copies
            if (issues) {
                tma_prefetch_desc(tp.q_map);
                tma_prefetch_desc(tp.k_map);
                tma_prefetch_desc(tp.v_map);
            }
            // Key block n of a tile goes to stage (its position in the block's whole walk,
            // over all its tiles) % STAGES, K and V alike; K runs one block ahead of V:
            // K_first, then (K_{n'}, V_n) for each visited n, n' the one visited after it.
            int k_stage = 0, v_stage = 0;
            uint32 k_phase = 0, v_phase = 0, q_phase = 0;
            do {
                const int b = tile.tc.b, h_kv = tile.tc.h_kv, m0 = tile.m0;
                const KeyBlockMap<VARIANT> map(p.var, b, tile.tc.h, tile.tc.m_block);
                // The maps' (row, batch) coordinates of the sequence: (start row, 0) packed, (0, b) dense.
                const int map_b = VARLEN ? 0 : b, q_row0 = VARLEN ? tile.seq.q_start + m0 : m0;
                const int k_row0 = VARLEN ? tile.seq.k_start : 0;
                auto load_q = [&] {
                    if (!issues) return;
                    mbar_arrive_expect_tx(full_q, QTile::BYTES);
#pragma unroll
                    for (int c = 0; c < HEAD_DIM / BOX; ++c) {
                        tma_load_4d(sQ + c * QTile::BLOCK_BYTES, tp.q_map, full_q, c * BOX, q_row0, tile.tc.h,
                                    map_b);
                    }
                };
                auto load_k = [&](int n) {
                    mbar_wait(empty_k(k_stage), k_phase ^ 1);  // both consumers' S GEMMs of the round before are done
                    const uint32 sK = sK0 + k_stage * KVTile::BYTES;
                    if (issues) {
                        mbar_arrive_expect_tx(full_k(k_stage), KVTile::BYTES);
#pragma unroll
                        for (int c = 0; c < HEAD_DIM / BOX; ++c) {
                            tma_load_4d(sK + c * KVTile::BLOCK_BYTES, tp.k_map, full_k(k_stage), c * BOX,
                                        k_row0 + n * BLOCK_N, h_kv, map_b);
                        }
                    }
                    if (++k_stage == STAGES) { k_stage = 0; k_phase ^= 1; }
                };
                auto load_v = [&](int n) {
                    mbar_wait(empty_v(v_stage), v_phase ^ 1);  // both consumers' P·V of the round before are done
                    const uint32 sV = sV0 + v_stage * KVTile::BYTES;
                    // Packed, a sequence's last key block (the first visited) completes on
                    // tail_v: the producer's second warp zeroes its rows past the sequence
                    // and releases it to the consumers on full_v (below).
                    const bool tail = VARLEN && tile.seq.seqlen_k - n * BLOCK_N < BLOCK_N;
                    const uint32 done = tail ? tail_v : full_v(v_stage);
                    if (issues) {
                        mbar_arrive_expect_tx(done, KVTile::BYTES);
#pragma unroll
                        for (int c = 0; c < HEAD_DIM / BOX; ++c) {
                            tma_load_4d(sV + c * KVTile::BLOCK_BYTES, tp.v_map, done, c * BOX,
                                        k_row0 + n * BLOCK_N, h_kv, map_b);
                        }
                    }
                    if (++v_stage == STAGES) { v_stage = 0; v_phase ^= 1; }
                };
                if constexpr (!MAP) {
                    if constexpr (PERSISTENT) {
                        // The tile's first K goes out while the consumers may still be on the
                        // tile before (its ring stage came free after that tile's S GEMMs); Q
                        // waits for both consumers' O to have left sQ.
                        if (blocks.end - 1 >= blocks.begin) load_k(blocks.end - 1);
                        mbar_wait(empty_q, q_phase ^ 1);
                        q_phase ^= 1;
                        load_q();
                    } else {
                        load_q();
                        if (blocks.end - 1 >= blocks.begin) load_k(blocks.end - 1);
                    }
                    for (int n = blocks.end - 1; n >= blocks.begin; --n) {
                        if (n - 1 >= blocks.begin) load_k(n - 1);
                        load_v(n);
                    }
                } else {
                    // The same over the blocks the map does not mark EMPTY (never persistent),
                    // the first of them found once Q's copy has gone out. (Its own branch: the
                    // walk above written with prev(n) = n - 1 compiles to other SASS for the
                    // kernels with no map.)
                    load_q();
                    const int n_first = map.prev(blocks.end, blocks.begin);
                    if (n_first >= blocks.begin) load_k(n_first);
                    for (int n = n_first; n >= blocks.begin;) {
                        const int n_next = map.prev(n, blocks.begin);
                        if (n_next >= blocks.begin) load_k(n_next);
                        load_v(n);
                        n = n_next;
                    }
                }
            } while (next_tile());
        }
        if constexpr (VARLEN) {
            // Packed (one tile per block: never persistent): a sequence's last key block runs
            // on into the next sequence's rows, which may hold anything; P is 0 there, but
            // 0 x NaN is not. When the tile visits that block it is the first visited, in
            // V's stage 0 (phase 0), and its copy completes on tail_v: this warp zeroes the
            // rows past the sequence, then releases the stage to the consumers on full_v.
            // (Dense: the copy engine fills past the sequence, the maps' end, with zeros.)
            if (threadIdx.x / 32 == 1) {
                const KeyBlockMap<VARIANT> map(p.var, tile.tc.b, tile.tc.h, tile.tc.m_block);
                const int n_first = MAP ? map.prev(blocks.end, blocks.begin) : blocks.end - 1;
                const int rows = tile.seq.seqlen_k - n_first * BLOCK_N;
                if (n_first >= blocks.begin && rows < BLOCK_N) {
                    const int lane = threadIdx.x % 32;
                    mbar_wait(tail_v, 0);
                    KVTile::warp_zero_rows_from(sV0, rows, lane);
                    fence_proxy_async_shared();  // the zeros before the consumers' wgmma reads
                    __syncwarp();
                    if (lane == 0) mbar_arrive(full_v(0));
                }
            }
        }
        return;
    }

    // ================= consumers
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    const int cw = wg - 1;  // consumer index: query rows 64 cw ..
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // This thread's fragment rows within the block: r0 and r0 + 8.
    const int r0 = cw * 64 + (threadIdx.x / 32 % 4) * 16 + g;

    // Ping-pong: consumer cw issues GEMMs between sync on its own barrier and arrive
    // on the next one's (the other's; of three, cw + 1 mod 3). Each does one sync and
    // one arrive per GEMM phase; in each tile the last consumer arrives once up front
    // (consumer 0 goes first) and skips its last arrive, so no arrival is left over.
    constexpr int LAST = Tr::CONSUMERS - 1;
    auto sched_sync = [&] { named_barrier_sync<256>(Tr::SCHED_BAR + cw); };
    auto sched_arrive = [&] {
        named_barrier_arrive<256>(Tr::SCHED_BAR + (Tr::CONSUMERS == 2 ? 1 - cw : (cw + 1) % Tr::CONSUMERS));
    };
    // This warp's wgmma reads of a stage's K (V) are done (its wait_group has returned).
    auto release_k = [&](int s) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_k(s));
    };
    auto release_v = [&](int s) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_v(s));
    };

    __shared__ float2 pin;  // written, never read (wgmma_wait_after)
    const uint32 pin_slot = smem_addr(&pin);
    int stage = 0;  // stage and parity of the next key block's K (and, a step later, its V), over all tiles
    uint32 phase = 0, q_phase = 0;
    do {
        const int b = tile.tc.b, h = tile.tc.h, m0 = tile.m0;
        const ScoreMod<VARIANT, T> mod(p.var, p.softmax_scale_log2, b, h, tile.seq.seqlen_q, tile.seq.seqlen_k);
        const float sink = sink_log2<VARIANT>(p.var, h);

        float acc_o[1][D_TILES][4];
        clear(acc_o);
        float row_sum[1][2] = {{0.f, 0.f}};
        OnlineSoftmax<1> softmax;
        softmax.init(sink);

        mbar_wait(full_q, q_phase);  // also before the epilogue overwrites sQ with O
        // The visited blocks, from the last down, as the producer walks them.
        const KeyBlockMap<VARIANT> map(p.var, b, h, tile.tc.m_block);
        const int n_first = MAP ? map.prev(blocks.end, blocks.begin) : blocks.end - 1;
        if (n_first >= blocks.begin) {
            if (cw == LAST) sched_arrive();
            uint32 pa[BLOCK_N / 16][4];  // P of the block before, the A operand of its P·V
            // ---- the first block (masked, unless the range has no masked block): S alone
            {
                float s[1][N_TILES][4];
                [[maybe_unused]] DropoutBits<1, N_TILES> keep;
                const Dropout drop(p.var, b, h, p.nheads_q);  // (read only with dropout)
                if constexpr (DROPOUT && !KEEP_UNDER_S) keep.draw(drop, m0 + r0, n_first * BLOCK_N + 2 * t);
                mbar_wait(full_k(stage), phase);
                sched_sync();
                issue_qk<T, BLOCK_M, BLOCK_N, HEAD_DIM>(s[0], sQ, cw, sK0 + stage * KVTile::BYTES);
                sched_arrive();
                if constexpr (DROPOUT && KEEP_UNDER_S) keep.draw(drop, m0 + r0, n_first * BLOCK_N + 2 * t);
                // The block's mask, read while S runs (an edge block reads it whatever its map
                // state, as in the steps below).
                [[maybe_unused]] const int col0 = n_first * BLOCK_N + 2 * t;
                [[maybe_unused]] const bool edge = blocks.masked(n_first);
                [[maybe_unused]] const bool full = MAP && !edge && map.state(n_first) == BLOCK_FULL;
                [[maybe_unused]] Terms terms(mod, m0 + r0);
                if constexpr (TERMS) {  // (full: the map's only)
                    if (edge) terms.template load<true>(col0);
                    else if (!full) terms.template load<false>(col0);
                }
                wgmma_wait<0>();
                fence_operands(s[0]);
                release_k(stage);
                if constexpr (TERMS) {
                    if (edge) score_tile<true>(s, mod, mask, m0 + r0, col0, terms);
                    else if (full) score_tile<false, false>(s, mod, mask, m0 + r0, col0, terms);
                    else score_tile<false>(s, mod, mask, m0 + r0, col0, terms);
                } else if (blocks.masked(n_first)) {
                    fwd_score_tile<true, RAW>(s, mod, mask, m0 + r0, col0);
                } else {
                    fwd_score_tile<false, RAW>(s, mod, mask, m0 + r0, col0);
                }
                softmax.update<RAW>(s, acc_o, row_sum, p.softmax_scale_log2);
                if constexpr (DROPOUT) keep.zero_dropped(s);  // the row sums keep the undropped P
                acc_to_a_operand<T>(s[0], pa);
            }
            int prev_stage = stage;
            uint32 prev_phase = phase;
            if (++stage == STAGES) { stage = 0; phase ^= 1; }

            // ---- block n: S_n issued with P_{n'}·V_{n'} (n' the block visited before it);
            // softmax of S_n under that GEMM. masked: the range's edge mask code; attn_masked:
            // the bool mask's (a block the map has FULL takes none).
            // (score_tile is called in place: a generic lambda capturing mod and mask crashes
            // the NVRTC 13.0 / nvcc 13.0 device compiler, cicc, even when never called)
            auto step = [&](int n, auto masked, auto attn_masked) {
                float s[1][N_TILES][4];
                [[maybe_unused]] DropoutBits<1, N_TILES> keep;
                const Dropout drop(p.var, b, h, p.nheads_q);
                if constexpr (DROPOUT && !KEEP_UNDER_S) keep.draw(drop, m0 + r0, n * BLOCK_N + 2 * t);
                mbar_wait(full_k(stage), phase);
                mbar_wait(full_v(prev_stage), prev_phase);
                sched_sync();
                issue_qk<T, BLOCK_M, BLOCK_N, HEAD_DIM>(s[0], sQ, cw, sK0 + stage * KVTile::BYTES);
                issue_pv<T, BLOCK_N, HEAD_DIM>(acc_o[0], pa, sV0 + prev_stage * KVTile::BYTES);
                sched_arrive();
                if constexpr (DROPOUT && KEEP_UNDER_S) keep.draw(drop, m0 + r0, n * BLOCK_N + 2 * t);
                // The block's bias, or its mask (a PARTIAL or edge block), read while the GEMMs run.
                [[maybe_unused]] constexpr bool MASKED = decltype(masked)::value;
                [[maybe_unused]] constexpr bool ATTN_MASKED = decltype(attn_masked)::value;
                [[maybe_unused]] Terms terms(mod, m0 + r0);
                if constexpr (TERMS) terms.template load<MASKED, ATTN_MASKED>(n * BLOCK_N + 2 * t);
                wgmma_wait<1>();  // S_n (the older group) has completed
                fence_operands(s[0]);
                release_k(stage);  // K_n is free: the producer may copy the block STAGES on into it
                if constexpr (TERMS) {
                    score_tile<MASKED, ATTN_MASKED>(s, mod, mask, m0 + r0, n * BLOCK_N + 2 * t, terms);
                } else {
                    fwd_score_tile<decltype(masked)::value, RAW>(s, mod, mask, m0 + r0, n * BLOCK_N + 2 * t);
                }
                float alpha[1][2];
                softmax.update_sums<RAW>(s, row_sum, alpha, p.softmax_scale_log2);
                // P_{n-1}·V_{n-1} has completed: pa and V stage prev_stage are free. (Pinned
                // after the row sums, hence after every exp2 of the softmax: wgmma.cuh.)
                wgmma_wait_after<0>(pin_slot, row_sum[0][0], row_sum[0][1]);
                fence_operands(acc_o[0]);
                fence_operands(pa);
                release_v(prev_stage);
                softmax.rescale(acc_o, alpha);
                if constexpr (DROPOUT) keep.zero_dropped(s);  // the row sums keep the undropped P
                acc_to_a_operand<T>(s[0], pa);
                prev_stage = stage;
                prev_phase = phase;
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            };
            // Masked blocks (key tail, causal diagonal) first, then the bulk with no mask
            // code, then (a window's) masked left edge.
            if constexpr (!MAP) {
                int n = n_first - 1;
                for (; n >= blocks.unmasked_end; --n) step(n, Bool<true>{}, Bool<true>{});
                if constexpr (Mask<IS_CAUSAL, VARIANT>::WINDOW) {
                    for (; n >= blocks.unmasked_begin; --n) step(n, Bool<false>{}, Bool<true>{});
                    for (; n >= blocks.begin; --n) step(n, Bool<true>{}, Bool<true>{});
                } else {
                    for (; n >= 0; --n) step(n, Bool<false>{}, Bool<true>{});
                }
            } else {
                // The same over the visited blocks (as the producer's walk, its own branch; no
                // window, so the range starts at 0), a block of the bulk mask-free where the
                // mask keeps it wholly (an edge block reads the mask whatever its state: three
                // steps compiled, not four).
                int n = map.prev(n_first, 0);
                for (; n >= blocks.unmasked_end; n = map.prev(n, 0)) step(n, Bool<true>{}, Bool<true>{});
                for (; n >= 0; n = map.prev(n, 0)) {
                    if (map.state(n) == BLOCK_FULL) step(n, Bool<false>{}, Bool<false>{});
                    else step(n, Bool<false>{}, Bool<true>{});
                }
            }

            // ---- the last block's P·V
            mbar_wait(full_v(prev_stage), prev_phase);
            sched_sync();
            issue_pv<T, BLOCK_N, HEAD_DIM>(acc_o[0], pa, sV0 + prev_stage * KVTile::BYTES);
            if (Tr::CONSUMERS == 2 ? cw == 0 : cw != LAST) sched_arrive();
            wgmma_wait<0>();
            fence_operands(acc_o[0]);
            fence_operands(pa);
            release_v(prev_stage);
        }

        // ---- epilogue: a row with no key gets O = 0 and lse = -inf (finalize)
        float lse[1][2];
        softmax.finalize_sums(acc_o, row_sum, lse, sink, DROPOUT ? p.var.dropout_scale : 1.f);
        // Persistent: the epilogue's thread index made opaque in each tile. Every shared
        // memory address of the O staging is a function of the thread alone, and the
        // compiler would otherwise hoist them all out of the tile loop and hold them across
        // the mainloop (nvcc 13.0: 172 bytes of spill with a window, 156 with a window and
        // sinks, causal; plain causal D=128 peaks at R234 instead of R229).
        uint32 thread = threadIdx.x;
        int r0_out = r0;
        if constexpr (PERSISTENT) {
            asm volatile("" : "+r"(thread));
            r0_out = cw * 64 + (thread / 32 % 4) * 16 + int(thread % 32) / 4;  // r0, from thread
        }
        store_fwd_rows<T, BLOCK_M, HEAD_DIM, EVEN_K>(p, acc_o[0], lse[0], b, h, m0, r0_out, cw, sQ,
                                                     Tr::EPILOGUE_BAR + cw, thread);
        if constexpr (PERSISTENT) {
            // This warp's reads and writes of sQ (the O staging) are done: ordered before
            // the copy engine's (async proxy) write of the next tile's Q into it.
            fence_proxy_async_shared();
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_q);
            q_phase ^= 1;
        }
    } while (next_tile());
}

}  // namespace cupyflash
