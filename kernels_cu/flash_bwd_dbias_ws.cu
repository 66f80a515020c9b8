// flash_bwd_dbias_ws.cu: the gradient of attn_bias (issue 14) on Hopper, warp-specialised as
// flash_bwd_ws.cu (a producer warp moves the data by TMA, two consumer warpgroups only
// compute), for a bias of T staged (WS_BWD_BIAS) beside that kernel: the same maps
// (BwdTmaParams: Q, K, V, dO and the bias), the same products and the same Pᵀ.
//
// dbias is dS before softmax_scale (cupyflash/reference.py), summed over what broadcasts
// onto it (flash_bwd_dbias.cu's header):
//   dbias[b', h', i, j] = Σ over the visits (b, h) of P∘(dP − delta),  P = prob(x, lse·log2e)
// A block owns BLOCK_N = 128 keys (consumer warpgroup c: 64 of them) by M_STEPS x 64 query
// rows of one plane (b', h') of dbias, and walks the plane's visits: every batch entry where
// dbias's batch dimension is 1, every query head where its head dimension is 1, else the
// plane's own. Each visit copies K and V of (b, KV head of h) once, into a two-stage ring,
// and runs one step per query block of the block: Q, dO, lse_log2 and delta of those rows
// (a two-stage ring), Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (bwd_sm90.cuh issue_st_dpt), Pᵀ with the
// bias (PtOperands, the bias tile read transposed from its stage: the plane's tiles are the
// same at every visit and copied once), dSᵀ = Pᵀ∘(dPᵀ − delta) (ds_from_dp), added into the
// step's fp32 accumulator. The sum runs in a fixed order (deterministic, no atomics). At the
// end each accumulator is stored once in T, every element of the block's tile (0 where no
// visit reaches it: a query block the keys' causal range skips), from the fragments to the
// dbias strides (keys contiguous).
//
// Query rows past seqlen_q arrive as zeros with lse_log2 = +inf (P = 0), keys past seqlen_k
// as zeros, masked in Sᵀ; neither is stored. A query block no key of the block sees (causal)
// is not visited. Template parameters: T, HEAD_DIM (64 or 128: cupyflash/dispatch.py
// BWD_DBIAS_WS), IS_CAUSAL, VARIANT (WS_BWD_BIAS alone). Dense batches, 16-byte aligned
// data, a bias with whole rows and keys (dbias's row and key dimensions not broadcast).
#include "params.cuh"
#include "ptx.cuh"
#include "seqlens.cuh"
#include "bwd_rows.cuh"
#include "tile_io.cuh"
#include "variant.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "bwd_sm90.cuh"

namespace cupyflash {

template <typename T_, int HEAD_DIM_>
struct DbiasWsTraits : BwdWsRoles {
    using T = T_;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr int BLOCK_M = 64;   // query rows per step
    static constexpr int BLOCK_N = 128;  // keys per block: 64 per consumer warpgroup
    static constexpr int M_STEPS = 2;    // query blocks per block: each visit's K, V serve both
    static constexpr int STAGES = 2;     // K, V of two visits; Q, dO, rows of two steps
    using KVTile = Swizzle128Tile<T, BLOCK_N, HEAD_DIM>;
    using QTile = Swizzle128Tile<T, BLOCK_M, HEAD_DIM>;
    using BiasTile = Swizzle128Tile<T, BLOCK_M, BLOCK_N>;
    // From the 1024-byte aligned base: STAGES x (K, V), STAGES x (Q, dO), M_STEPS bias tiles,
    // STAGES x (lse_log2, delta), the SeqLens slot, the mbarriers (full_kv, empty_kv, full_q,
    // empty_q per stage; full_bias).
    static constexpr int KV_STAGE_BYTES = 2 * KVTile::BYTES;
    static constexpr int Q_STAGE_BYTES = 2 * QTile::BYTES;
    static constexpr int Q_OFFSET = STAGES * KV_STAGE_BYTES;
    static constexpr int BIAS_OFFSET = Q_OFFSET + STAGES * Q_STAGE_BYTES;
    static constexpr int ROWS_OFFSET = BIAS_OFFSET + M_STEPS * BiasTile::BYTES;
    static constexpr int SEQ_OFFSET = ROWS_OFFSET + STAGES * 2 * BLOCK_M * 4;
    static constexpr int BAR_OFFSET = SEQ_OFFSET + SeqLensSlot::BYTES;
    static constexpr int SMEM_BYTES = BAR_OFFSET + 8 * (4 * STAGES + 1) + 1024;  // +1024: the alignment
    static_assert(SMEM_BYTES <= 227 * 1024, "more shared memory than a Hopper block has");
};

template <typename T, int HEAD_DIM, bool IS_CAUSAL, int VARIANT>
__global__ void __launch_bounds__(384, 1)
flash_bwd_dbias_ws_kernel(const __grid_constant__ BwdTmaParams tp) {
    static_assert(VARIANT == WS_BWD_BIAS, "flash_bwd_dbias_ws_kernel: a staged bias of T, no other variant");
    using Tr = DbiasWsTraits<T, HEAD_DIM>;
    constexpr int BLOCK_M = Tr::BLOCK_M, BLOCK_N = Tr::BLOCK_N, STAGES = Tr::STAGES, BOX = Tr::BOX_COLS;
    constexpr int M_STEPS = Tr::M_STEPS, M_TILES = BLOCK_M / 8;
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    using BiasTile = typename Tr::BiasTile;
    using Terms = StagedScoreTermsT<VARIANT, T, BLOCK_M, BLOCK_N, Tr::CONSUMER_THREADS, BiasTile>;
    const BwdParams& p = tp.bwd;
    const VariantParams& var = p.var;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - smem_addr(smem_raw));
    auto sK = [&](int stage) { return base + stage * Tr::KV_STAGE_BYTES; };
    auto sV = [&](int stage) { return sK(stage) + KVTile::BYTES; };
    auto sQ = [&](int stage) { return base + Tr::Q_OFFSET + stage * Tr::Q_STAGE_BYTES; };
    auto sdO = [&](int stage) { return sQ(stage) + QTile::BYTES; };
    auto sBias = [&](int i) { return base + Tr::BIAS_OFFSET + i * BiasTile::BYTES; };
    auto rows_offset = [&](int stage) { return Tr::ROWS_OFFSET + stage * 2 * BLOCK_M * 4; };  // lse_log2, delta
    const uint32 bars = base + Tr::BAR_OFFSET;
    auto full_kv = [&](int stage) { return bars + 8 * stage; };
    auto empty_kv = [&](int stage) { return bars + 8 * (STAGES + stage); };
    auto full_q = [&](int stage) { return bars + 8 * (2 * STAGES + stage); };
    auto empty_q = [&](int stage) { return bars + 8 * (3 * STAGES + stage); };
    const uint32 full_bias = bars + 8 * 4 * STAGES;

    // ---- which tile: (plane, key block, query group), a plane's query groups of one key block
    //      adjacent in the grid (their visits read the same K, V)
    const int planes_h = var.dbias_head_stride ? p.nheads_q : 1;
    const int num_groups = ceil_div(p.seqlen_q, BLOCK_M * M_STEPS), num_n = ceil_div(p.seqlen_k, BLOCK_N);
    const int group = blockIdx.x % num_groups, n_block = (blockIdx.x / num_groups) % num_n;
    const int plane = blockIdx.x / num_groups / num_n;
    const int pb = plane / planes_h, ph = plane % planes_h;  // the plane's (batch, head) in dbias
    const int visit_heads = var.dbias_head_stride ? 1 : p.nheads_q;
    const int num_visits = (var.dbias_batch_stride ? 1 : p.batch) * visit_heads;
    auto visit_b = [&](int vi) { return var.dbias_batch_stride ? pb : vi / visit_heads; };
    auto visit_h = [&](int vi) { return var.dbias_head_stride ? ph : vi % visit_heads; };
    const SeqLens seq = seq_lens(p, 0);  // (dense: every sequence's)
    const int n0 = n_block * BLOCK_N, m_first = group * M_STEPS;
    const SeqLensSlot seq_slot{base + Tr::SEQ_OFFSET};

    // The block's query blocks m_first + i that its keys' rows see (causal: not those above
    // the diagonal), and those that need the mask (flash_bwd_ws.cu's rule).
    const BlockRange blocks = Mask<IS_CAUSAL, VARIANT>(var, seq.seqlen_q, seq.seqlen_k).query_blocks(
        n0, BLOCK_N, min(BLOCK_N, seq.seqlen_k - n0), BLOCK_M, ceil_div(seq.seqlen_q, BLOCK_M));
    const int m_masked_end = blocks.unmasked_end == blocks.end ? blocks.unmasked_begin : blocks.end;
    auto visited = [&](int i) { return m_first + i >= blocks.begin && m_first + i < blocks.end; };
    int steps_per_visit = 0;
#pragma unroll
    for (int i = 0; i < M_STEPS; ++i) steps_per_visit += visited(i);
    const bool any = steps_per_visit > 0 && num_visits > 0;

    if (threadIdx.x == 0) {
        // the launch's dynamic shared memory is dispatch's (bwd_dbias_ws_smem_bytes): it must cover this
        if (dynamic_smem_bytes() < uint32(Tr::SMEM_BYTES)) __trap();
        seq_slot.store(seq);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_kv(s), 1);
            mbar_init(empty_kv(s), 4 * Tr::CONSUMERS);  // one arrival per consumer warp
            mbar_init(full_q(s), 1 + 32);               // the copies' arrive.expect_tx, the row loads' 32 lanes
            mbar_init(empty_q(s), 4 * Tr::CONSUMERS);
        }
        mbar_init(full_bias, 1);
        fence_barrier_init();
    }
    __syncthreads();

    const int lane = threadIdx.x % 32;
    if (threadIdx.x < 128) {
        // ================= producer: warp 0 copies; the other three only give up registers
        setmaxnreg_dec<Tr::PRODUCER_REGS>();
        if (threadIdx.x >= 32 || !any) return;
        if (lane == 0) {
            // the plane's bias tiles, once (a broadcast dimension of the bias: coordinate 0)
            mbar_arrive_expect_tx(full_bias, steps_per_visit * BiasTile::BYTES);
#pragma unroll
            for (int i = 0; i < M_STEPS; ++i) {
                if (!visited(i)) continue;
#pragma unroll
                for (int c = 0; c < BLOCK_N / BOX; ++c) {
                    tma_load_4d(sBias(i) + c * BiasTile::BLOCK_BYTES, tp.bias_map, full_bias, n0 + c * BOX,
                                var.bias_row_stride ? (m_first + i) * BLOCK_M : 0, var.bias_head_stride ? ph : 0,
                                var.bias_batch_stride ? pb : 0);
                }
            }
        }
        int it = 0;
#pragma unroll 1
        for (int vi = 0; vi < num_visits; ++vi) {
            const int b = visit_b(vi), h = visit_h(vi), h_kv = h / (p.nheads_q / p.nheads_kv);
            const int ks = vi % STAGES;
            mbar_wait(empty_kv(ks), ((vi / STAGES) & 1) ^ 1);
            if (lane == 0) {
                mbar_arrive_expect_tx(full_kv(ks), Tr::KV_STAGE_BYTES);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / BOX; ++c) {
                    tma_load_4d(sK(ks) + c * KVTile::BLOCK_BYTES, tp.k_map, full_kv(ks), c * BOX, n0, h_kv, b);
                    tma_load_4d(sV(ks) + c * KVTile::BLOCK_BYTES, tp.v_map, full_kv(ks), c * BOX, n0, h_kv, b);
                }
            }
#pragma unroll
            for (int i = 0; i < M_STEPS; ++i) {
                if (!visited(i)) continue;
                const int stage = it % STAGES, m0 = (m_first + i) * BLOCK_M;
                mbar_wait(empty_q(stage), ((it / STAGES) & 1) ^ 1);
                if (lane == 0) {
                    mbar_arrive_expect_tx(full_q(stage), Tr::Q_STAGE_BYTES);
#pragma unroll
                    for (int c = 0; c < HEAD_DIM / BOX; ++c) {
                        tma_load_4d(sQ(stage) + c * QTile::BLOCK_BYTES, tp.q_map, full_q(stage), c * BOX, m0, h, b);
                        tma_load_4d(sdO(stage) + c * QTile::BLOCK_BYTES, tp.do_map, full_q(stage), c * BOX, m0, h,
                                    b);
                    }
                }
                load_step_rows<BLOCK_M>(reinterpret_cast<float*>(smem + rows_offset(stage)), p, b, h, seq, m0, lane);
                mbar_arrive(full_q(stage));  // (release: this lane's stores)
                ++it;
            }
        }
        return;
    }

    // ================= consumers
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    const uint32 ct = threadIdx.x - 128;  // consumer thread
    const int warp = ct / 32, cw = warp / 4;
    const int g = lane / 4, t = lane % 4;
    // This thread's fragment rows: keys key_row0 and key_row0 + 8 of the block; its columns:
    // query rows 8 j + 2 t (+1) of each step's block.
    const int key_row0 = cw * 64 + (warp % 4) * 16 + g;
    float acc[M_STEPS][M_TILES][4];  // dbias (transposed: keys as rows) of each query block
#pragma unroll
    for (int i = 0; i < M_STEPS; ++i)
#pragma unroll
        for (int j = 0; j < M_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    if (any) {
        mbar_wait(full_bias, 0);
        int it = 0;
#pragma unroll 1
        for (int vi = 0; vi < num_visits; ++vi) {
            const int b = visit_b(vi), h = visit_h(vi), ks = vi % STAGES;
            mbar_wait(full_kv(ks), (vi / STAGES) & 1);
            // ---- one step: query block m_first + i of (b, h) against this visit's K, V
            auto step = [&](auto i_, auto masked) {
                constexpr int I = decltype(i_)::value;
                constexpr bool MASKED = decltype(masked)::value;
                const int stage = it % STAGES, m0 = (m_first + I) * BLOCK_M;
                const float* s_lse = reinterpret_cast<const float*>(smem + rows_offset(stage));
                const float* s_delta = s_lse + BLOCK_M;
                uint32 sK_ = sK(ks), sV_ = sV(ks);
                asm volatile("" : "+r"(sK_), "+r"(sV_));
                mbar_wait(full_q(stage), (it / STAGES) & 1);
                float st[M_TILES][4], dpt[M_TILES][4];
                issue_st_dpt<T, BLOCK_M, BLOCK_N, HEAD_DIM>(st, dpt, sK_, sV_, sQ(stage), sdO(stage), cw);
                wgmma_wait<1>();
                fence_operands(st);
                PtOperands<T, BLOCK_M, IS_CAUSAL, VARIANT> pt;
                pt.template recompute<MASKED, true, Terms>(st, p, seq_slot, s_lse, sBias(I), b, h, n0, key_row0, m0,
                                                           g, t);
                wgmma_wait<0>();  // this warp is done with the stage's Q and dO (and this visit's K, V)
                fence_operands(dpt);
                ds_from_dp<T, M_TILES, false>(dpt, pt.ds_p(), s_delta, t, pt.keep, 1.f);
                __syncwarp();
                if (lane == 0) mbar_arrive(empty_q(stage));  // (after its rows' last read: delta)
#pragma unroll
                for (int j = 0; j < M_TILES; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[I][j][e] += dpt[j][e];
                ++it;
            };
#pragma unroll
            for (int i = 0; i < M_STEPS; ++i) {
                if (!visited(i)) continue;
                const bool masked = m_first + i < m_masked_end;
                if (i == 0) {
                    if (masked) step(Int<0>{}, Bool<true>{});
                    else step(Int<0>{}, Bool<false>{});
                } else {
                    if (masked) step(Int<1>{}, Bool<true>{});
                    else step(Int<1>{}, Bool<false>{});
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_kv(ks));  // every GEMM of the visit has completed
        }
    }
    static_assert(M_STEPS == 2, "the step's query block is a compile-time index (above)");

    // ---- epilogue: each query block's dbias, rows before seqlen_q and keys before seqlen_k,
    //      in T at the dbias strides (every element of the tile: 0 where nothing was visited)
    T* dbias = static_cast<T*>(var.dbias) + pb * var.dbias_batch_stride + ph * var.dbias_head_stride;
#pragma unroll
    for (int i = 0; i < M_STEPS; ++i) {
#pragma unroll
        for (int j = 0; j < M_TILES; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = n0 + key_row0 + 8 * (e / 2), query = (m_first + i) * BLOCK_M + 8 * j + 2 * t + (e & 1);
                if (key < seq.seqlen_k && query < seq.seqlen_q) {
                    dbias[int64(query) * var.dbias_row_stride + int64(key) * var.dbias_col_stride] =
                        TypeTraits<T>::from_float(acc[i][j][e]);
                }
            }
        }
    }
}

}  // namespace cupyflash
