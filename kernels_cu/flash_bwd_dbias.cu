// flash_bwd_dbias.cu: the gradient of attn_bias (issue 14), with no atomics:
// deterministic by construction. Two entry points share one body: mma.sync.m16n8k16
// fragments (flash_bwd_dbias_kernel, any GPU) and Hopper wgmma (flash_bwd_dbias_sm90_kernel,
// sm_90a, padded head_dim 64 and 128).
//
// dbias is dS before softcap's factor and softmax_scale (cupyflash/reference.py),
//   dbias[b', h', i', j'] = Σ P∘(dP∘Z·rp − delta)  over (b, h, i, j) broadcast onto it,
// with P = prob(x, lse·log2e) (x the variant's masked score, log2 units), dP = dO·Vᵀ,
// Z dropout's keep mask, rp = 1/(1-p), delta = rowsum(dO∘O): two of the backward's
// five GEMMs again (S and dP), none of them stored.
//
// One block per tile of dbias over the bias's own 4-D shape (bias batch, bias head,
// row block, key block; a size-1 dimension has one index, and a bias broadcast along
// rows (keys) has one row (key) block of a single row (key)). The block loops over what
// broadcasts onto its tile, in a fixed order: every batch entry when the bias's batch
// dimension is 1, every query head when its head dimension is 1 (GQA: K/V head h /
// group), every query block when its rows are 1, every key block when its keys are 1.
// Per visit: Q, dO of the query rows, K, V of the keys, lse_log2 and delta (the
// preprocess kernel's row buffers, bwd_rows.cuh) arrive by cp.async a visit ahead;
//   S = Q·Kᵀ,  P = prob(x, lse·log2e),  dP = dO·Vᵀ,  acc += P∘(dP∘Z·rp − delta)
// in fp32 registers (variant.cuh's DbiasScores). The bias of the tile is the same at
// every visit: read once into registers. At the end the tile (summed over its rows or
// keys where the bias broadcasts along them) is written once, in the bias's element
// type (T or fp32), at the dbias strides.
//
// Every element of dbias is written: tiles, or visits, that no (query, key) pair
// reaches (causal, window, a shorter sequence of a packed batch) add nothing, so
// such elements are 0. Visits whose blocks no row sees (Mask::key_blocks) are skipped;
// visits at a key tail, the causal diagonal or a window's edge run the masked step.
// Query tails load Q, dO, lse_log2 and delta as 0, so dS = P∘(0 − 0) = 0 there
// (flash_bwd.cu's header); rows that see no key have lse_log2 = +inf, so P = 0.
//
// Template parameters, in order:
//   T          __half or __nv_bfloat16 (q, k, v, out, dout)
//   HEAD_DIM   padded head dimension (multiple of 16); runtime head_dim <= HEAD_DIM
//   BLOCK_M    query rows per tile;  BLOCK_N  keys per tile
//   NUM_WARPS  warps per block, in a WARPS_M x (NUM_WARPS / WARPS_M) grid of warp tiles
//   WARPS_M    warps along the query rows
//   STAGES     2: each visit's four tiles load during the whole previous visit;
//              1: one buffer each, Q and K of the next visit loading under dP's GEMM
//              and dO and V under the next S (for shared memory too small for 2)
//   IS_CAUSAL, EVEN_K, VEC, VARIANT  as for flash_bwd.cu's kernels (VARIANT has a bias)
// The wgmma kernel (WGMMA in the shared body): each warpgroup owns 64 of BLOCK_M = 128
// rows and all BLOCK_N keys (warp w: rows 16 w .., the mma.sync accumulator layout,
// WARPS_M = NUM_WARPS = 8), S = Q·Kᵀ and dP = dO·Vᵀ as m64nBLOCK_N k16 wgmma with both
// operands from 128-byte-swizzled shared tiles, issued together: P is computed under
// dP's product. Two stages, 16-byte loads (VEC) only.
#include "params.cuh"
#include "block_traits.cuh"
#include "ptx.cuh"
#include "seqlens.cuh"
#include "bwd_rows.cuh"
#include "tile_io.cuh"
#include "variant.cuh"
#include "warp_mma.cuh"
#include "wgmma.cuh"

namespace cupyflash {

// The shared tiles of Q, dO (BLOCK_M rows) and K, V (BLOCK_N rows): padded for
// ldmatrix, or in wgmma's 128-byte swizzle.
template <bool WGMMA, typename T, int ROWS, int HEAD_DIM> struct DbiasTile {
    using type = SmemTile<T, ROWS, HEAD_DIM>;
};
template <typename T, int ROWS, int HEAD_DIM> struct DbiasTile<true, T, ROWS, HEAD_DIM> {
    using type = Swizzle128Tile<T, ROWS, HEAD_DIM>;
};

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int WARPS_M_, int STAGES_,
          bool WGMMA_ = false>
struct BwdDbiasTraits : BlockTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS * 32> {
    static constexpr int STAGES = STAGES_;
    // S, dP and the dbias accumulator: (BLOCK_M x BLOCK_N) in warp tiles of WARP_ROWS x WARP_COLS
    static constexpr int WARP_ROWS = BLOCK_M / WARPS_M_;
    static constexpr int WARP_COLS = BLOCK_N / (NUM_WARPS / WARPS_M_);
    static constexpr int M_TILES = WARP_ROWS / 16, N_TILES = WARP_COLS / 8;

    static constexpr bool WGMMA = WGMMA_;
    using QTile = typename DbiasTile<WGMMA, T, BLOCK_M, HEAD_DIM>::type;   // Q and dO
    using KVTile = typename DbiasTile<WGMMA, T, BLOCK_N, HEAD_DIM>::type;  // K and V
    // Shared memory: per stage Q, K, dO, V; then two slots of (lse_log2, delta) rows.
    // The epilogue's fp32 tile (rows padded by 4 floats) reuses it. (WGMMA: from the
    // first 1024-byte boundary, the swizzle atom; every tile is a multiple of 1024 bytes.)
    static constexpr int STAGE_BYTES = 2 * QTile::BYTES + 2 * KVTile::BYTES;
    static constexpr int ROWS_BYTES = 2 * 2 * BLOCK_M * 4;
    static constexpr int ACC_STRIDE = BLOCK_N + 4;  // floats
    static constexpr int PIPE_BYTES = STAGES * STAGE_BYTES + ROWS_BYTES;
    static constexpr int ACC_BYTES = BLOCK_M * ACC_STRIDE * 4;
    static constexpr int ALIGN_BYTES = WGMMA ? 1024 : 0;
    static constexpr int SMEM_BYTES = (PIPE_BYTES > ACC_BYTES ? PIPE_BYTES : ACC_BYTES) + ALIGN_BYTES;

    static_assert(NUM_WARPS % WARPS_M_ == 0, "the warp grid uses every warp");
    static_assert(WARP_ROWS % 16 == 0 && WARP_COLS % 16 == 0, "warp tiles of whole m16 tiles and n8 tile pairs");
    static_assert(HEAD_DIM % 16 == 0, "k16 steps");
    static_assert(BLOCK_M <= BwdDbiasTraits::NUM_THREADS, "one thread per row of lse_log2 and delta");
    static_assert(STAGES == 1 || STAGES == 2, "one or two stages");
    static_assert(!WGMMA || (NUM_WARPS % 4 == 0 && WARPS_M_ == NUM_WARPS && BLOCK_M == 16 * NUM_WARPS &&
                             STAGES == 2 && (BLOCK_N == 32 || BLOCK_N == 64 || BLOCK_N == 128)),
                  "wgmma: warpgroups of 64 rows x BLOCK_N keys, two stages");
};

// One visit of a block: the (batch, head) pair and the query and key blocks.
struct DbiasVisit {
    int b, h, m0, n0;
    bool masked;  // the step needs mask code (key tail, causal diagonal, window edge)
};

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int WARPS_M, int STAGES, bool WGMMA,
          bool IS_CAUSAL, bool EVEN_K, bool VEC, int VARIANT>
__device__ __forceinline__ void dbias_tile(const BwdParams& p) {
    using Tr = BwdDbiasTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, WARPS_M, STAGES, WGMMA>;
    static_assert(!WGMMA || VEC, "wgmma: 16-byte loads");
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using Scores = DbiasScores<IS_CAUSAL, VARIANT, T, Tr::M_TILES, Tr::N_TILES>;
    using BiasT = typename Scores::BiasMod::BiasT;
    constexpr int NT = Tr::NUM_THREADS;
    constexpr int M_TILES = Tr::M_TILES, N_TILES = Tr::N_TILES;
    // The GEMMs' k loops unrolled at D <= 64: with 8 warps per SM the next k step's
    // ldmatrix must issue under this one's mma (rolled, as the dK/dV kernel's, its
    // latency is exposed at every step: the H200's D=64 dbias took 4.9 ms rolled, 4.1
    // unrolled, at B·N = 16k, N = 4096, (B, 1, N, N)). Dropout's Philox rounds and the
    // mask's reads take D <= 64 to 244-255 registers unrolled: those stay rolled.
    constexpr bool ROLLED = HEAD_DIM > 64 || (VARIANT & (VAR_DROPOUT | VAR_MASK)) != 0;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr uint32 ALIGN = Tr::ALIGN_BYTES > 16 ? Tr::ALIGN_BYTES : 16;  // (the mma.sync tiles: 16 bytes)
    const uint32 s_base = (smem_addr(smem_raw) + ALIGN - 1) & ~(ALIGN - 1);
    unsigned char* const smem = smem_raw + (s_base - smem_addr(smem_raw));
    auto sQ = [&](int stage) { return s_base + stage * Tr::STAGE_BYTES; };
    auto sK = [&](int stage) { return sQ(stage) + QTile::BYTES; };
    auto sdO = [&](int stage) { return sK(stage) + KVTile::BYTES; };
    auto sV = [&](int stage) { return sdO(stage) + QTile::BYTES; };
    // slot s: lse_log2 of BLOCK_M rows, then their delta
    auto rows_addr = [&](int slot) { return s_base + STAGES * Tr::STAGE_BYTES + slot * 2 * BLOCK_M * 4; };
    auto rows_of = [&](int slot) {
        return reinterpret_cast<const float*>(smem + STAGES * Tr::STAGE_BYTES + slot * 2 * BLOCK_M * 4);
    };

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int warp_row0 = (warp % WARPS_M) * Tr::WARP_ROWS, warp_col0 = (warp / WARPS_M) * Tr::WARP_COLS;

    // ---- which tile: a dbias dimension of size 1 (stride 0) is summed over
    const VariantParams& var = p.var;
    const bool all_b = var.dbias_batch_stride == 0, all_h = var.dbias_head_stride == 0;
    const bool all_m = var.dbias_row_stride == 0, all_n = var.dbias_col_stride == 0;
    const int m_blocks = ceil_div(p.seqlen_q, BLOCK_M), n_blocks = ceil_div(p.seqlen_k, BLOCK_N);
    const int tiles_m = all_m ? 1 : m_blocks, tiles_n = all_n ? 1 : n_blocks;
    const int heads_b = all_h ? 1 : p.nheads_q;
    const int n_tile = blockIdx.x % tiles_n;
    const int m_tile = blockIdx.x / tiles_n % tiles_m;
    const int bh_tile = blockIdx.x / tiles_n / tiles_m;
    const int h_tile = bh_tile % heads_b, b_tile = bh_tile / heads_b;

    // ---- what broadcasts onto it: visit it = ((b · heads + h) · blocks_m + m) · blocks_n + n
    const int visit_b = all_b ? p.batch : 1, visit_h = all_h ? p.nheads_q : 1;
    const int visit_m = all_m ? m_blocks : 1, visit_n = all_n ? n_blocks : 1;
    const int num_visits = visit_b * visit_h * visit_m * visit_n;
    const int group = p.nheads_q / p.nheads_kv;

    // The visit's pair and blocks, and whether any of its rows sees any of its keys.
    auto visit_of = [&](int it, DbiasVisit& v) {
        const int n = all_n ? it % visit_n : n_tile;
        it /= visit_n;
        const int m = all_m ? it % visit_m : m_tile;
        it /= visit_m;
        v.h = all_h ? it % visit_h : h_tile;
        v.b = all_b ? it / visit_h : b_tile;
        v.m0 = m * BLOCK_M;
        v.n0 = n * BLOCK_N;
        const SeqLens seq = seq_lens(p, v.b);
        if (v.m0 >= seq.seqlen_q || v.n0 >= seq.seqlen_k) return false;
        const BlockRange r = Mask<IS_CAUSAL, VARIANT>(var, seq.seqlen_q, seq.seqlen_k)
                                 .key_blocks(v.m0, BLOCK_M, BLOCK_N);
        v.masked = r.masked(n);
        return n >= r.begin && n < r.end;
    };
    // The first visit at or after it that some (query, key) pair reaches (num_visits: none).
    auto next_visit = [&](int it, DbiasVisit& v) {
        while (it < num_visits && !visit_of(it, v)) ++it;
        return it;
    };

    // Loads of one visit, zero-filled past the sequence (and head_dim): Q, K and the
    // rows' lse_log2, delta (into rows slot `slot`), then dO, V.
    auto load_qk = [&](const DbiasVisit& v, int stage, int slot) {
        const SeqLens seq = seq_lens(p, v.b);
        const T* q = static_cast<const T*>(p.q) + v.b * p.q_batch_stride + v.h * p.q_head_stride +
                     int64(seq.q_start + v.m0) * p.q_row_stride;
        const T* k = static_cast<const T*>(p.k) + v.b * p.k_batch_stride + (v.h / group) * p.k_head_stride +
                     int64(seq.k_start + v.n0) * p.k_row_stride;
        load_tile<T, BLOCK_M, HEAD_DIM, NT, VEC, EVEN_K, QTile>(sQ(stage), q, p.q_row_stride, seq.seqlen_q - v.m0,
                                                                p.head_dim);
        load_tile<T, BLOCK_N, HEAD_DIM, NT, VEC, EVEN_K, KVTile>(sK(stage), k, p.k_row_stride, seq.seqlen_k - v.n0,
                                                                 p.head_dim);
        const int r = threadIdx.x;  // thread r loads row r of lse_log2 and delta
        if (r < BLOCK_M) {
            const bool valid = v.m0 + r < seq.seqlen_q;
            const int64 row_index = query_row_index(p, v.b, v.h, seq, v.m0) + (valid ? r : 0);
            cp_async_4(rows_addr(slot) + r * 4, p.lse_log2 + row_index, valid);
            cp_async_4(rows_addr(slot) + (BLOCK_M + r) * 4, p.delta + row_index, valid);
        }
    };
    auto load_dov = [&](const DbiasVisit& v, int stage) {
        const SeqLens seq = seq_lens(p, v.b);
        const T* dout = static_cast<const T*>(p.dout) + v.b * p.do_batch_stride + v.h * p.do_head_stride +
                        int64(seq.q_start + v.m0) * p.do_row_stride;
        const T* vv = static_cast<const T*>(p.v) + v.b * p.v_batch_stride + (v.h / group) * p.v_head_stride +
                      int64(seq.k_start + v.n0) * p.v_row_stride;
        load_tile<T, BLOCK_M, HEAD_DIM, NT, VEC, EVEN_K, QTile>(sdO(stage), dout, p.do_row_stride,
                                                                seq.seqlen_q - v.m0, p.head_dim);
        load_tile<T, BLOCK_N, HEAD_DIM, NT, VEC, EVEN_K, KVTile>(sV(stage), vv, p.v_row_stride, seq.seqlen_k - v.n0,
                                                                 p.head_dim);
    };

    // ---- the tile's bias at this thread's fragment positions, read once (rows and keys
    //      clamped into the bias; those past it are never stored)
    const typename Scores::BiasMod bias_mod(var, p.softmax_scale_log2, b_tile, h_tile, p.seqlen_q, p.seqlen_k);
    typename Scores::Terms bias(bias_mod, m_tile * BLOCK_M + warp_row0 + g);
    bias.template load<true>(n_tile * BLOCK_N + warp_col0 + 2 * t);

    float acc[M_TILES][N_TILES][4];
    clear(acc);

    DbiasVisit cur;
    int it = next_visit(0, cur);
    if (it < num_visits) {
        load_qk(cur, 0, 0);
        if constexpr (STAGES == 1) cp_async_commit();
        load_dov(cur, 0);
    }
    cp_async_commit();

    auto step = [&](auto masked, int slot, bool has_next, const DbiasVisit& next) {
        constexpr bool MASKED = decltype(masked)::value;
        const int stage = STAGES == 2 ? slot : 0;
        if constexpr (STAGES == 2) {
            cp_async_wait<0>();
            if constexpr (WGMMA) fence_proxy_async_smem();  // this thread's copies, visible to wgmma
            __syncthreads();  // this visit's tiles landed; every warp is done with the last one's
            if (has_next) {
                load_qk(next, stage ^ 1, slot ^ 1);
                load_dov(next, stage ^ 1);
            }
            cp_async_commit();
        } else {
            cp_async_wait<1>();
            __syncthreads();  // Q, K, rows landed (dO, V may still be in flight)
        }

        const SeqLens seq = seq_lens(p, cur.b);
        const Scores scores(var, p.softmax_scale_log2, cur.b, cur.h, p.nheads_q, seq.seqlen_q, seq.seqlen_k, bias);
        const float* s_lse = rows_of(slot);
        const float* s_delta = s_lse + BLOCK_M;
        auto lse2 = [&](int i, int hh) { return s_lse[warp_row0 + i * 16 + hh * 8 + g]; };
        auto delta = [&](int i, int hh) { return s_delta[warp_row0 + i * 16 + hh * 8 + g]; };
        float s[M_TILES][N_TILES][4], dp[M_TILES][N_TILES][4];
        if constexpr (WGMMA) {
            // ---- S = Q·Kᵀ, then dP = dO·Vᵀ, for this warpgroup's 64 rows
            const int wg_row0 = warp / 4 * 64;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
                Wgmma<T, BLOCK_N>::template ss<0, 0>(s[0], desc_k_major<BLOCK_M>(sQ(stage), wg_row0, kk),
                                                     desc_k_major<BLOCK_N>(sK(stage), 0, kk), kk > 0);
            wgmma_commit();
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
                Wgmma<T, BLOCK_N>::template ss<0, 0>(dp[0], desc_k_major<BLOCK_M>(sdO(stage), wg_row0, kk),
                                                     desc_k_major<BLOCK_N>(sV(stage), 0, kk), kk > 0);
            wgmma_commit();
            // ---- P = prob(x, lse·log2e), x the pair's masked score with the tile's bias,
            //      under dP's product
            wgmma_wait<1>();
            fence_operands(s[0]);
            scores.template probs<MASKED>(s, cur.m0 + warp_row0 + g, cur.n0 + warp_col0 + 2 * t, lse2);
            wgmma_wait<0>();
            fence_operands(dp[0]);
        } else {
            // ---- S = Q·Kᵀ
            clear(s);
            warp_gemm<T, M_TILES, N_TILES, HEAD_DIM / 16, QTile, false, KVTile, false, ROLLED>(
                s, sQ(stage), warp_row0, sK(stage), warp_col0);
            if constexpr (STAGES == 1) {
                __syncthreads();  // every warp is done with Q, K
                if (has_next) load_qk(next, 0, slot ^ 1);
                cp_async_commit();
            }

            // ---- P = prob(x, lse·log2e), x the pair's masked score with the tile's bias
            scores.template probs<MASKED>(s, cur.m0 + warp_row0 + g, cur.n0 + warp_col0 + 2 * t, lse2);

            if constexpr (STAGES == 1) {
                cp_async_wait<1>();
                __syncthreads();  // dO, V landed
            }

            // ---- dP = dO·Vᵀ
            clear(dp);
            warp_gemm<T, M_TILES, N_TILES, HEAD_DIM / 16, QTile, false, KVTile, false, ROLLED>(
                dp, sdO(stage), warp_row0, sV(stage), warp_col0);
            if constexpr (STAGES == 1) {
                __syncthreads();  // every warp is done with dO, V
                if (has_next) load_dov(next, 0);
                cp_async_commit();
            }
        }

        // ---- dbias += P∘(dP∘Z·rp − delta)
        scores.accumulate(acc, s, dp, delta);
    };

    for (int slot = 0; it < num_visits; slot ^= 1) {
        DbiasVisit next;
        const int it_next = next_visit(it + 1, next);
        const bool has_next = it_next < num_visits;
        if (cur.masked) step(Bool<true>{}, slot, has_next, next);
        else step(Bool<false>{}, slot, has_next, next);
        it = it_next;
        cur = next;
    }

    // ---- epilogue: the fp32 tile through shared memory, summed over its rows (keys)
    //      where the bias broadcasts along them, then stored once as BiasT
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the pipeline's buffers
    float* s_acc = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int i = 0; i < M_TILES; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int j = 0; j < N_TILES; ++j) {
                const int row = warp_row0 + i * 16 + hh * 8 + g, col = warp_col0 + j * 8 + 2 * t;
                *reinterpret_cast<float2*>(s_acc + row * Tr::ACC_STRIDE + col) =
                    make_float2(acc[i][j][2 * hh], acc[i][j][2 * hh + 1]);
            }
    __syncthreads();

    const int m0 = m_tile * BLOCK_M, n0 = n_tile * BLOCK_N;
    const int rows_out = all_m ? 1 : min(BLOCK_M, p.seqlen_q - m0);
    const int cols_out = all_n ? 1 : min(BLOCK_N, p.seqlen_k - n0);
    const int sum_rows = all_m ? BLOCK_M : 1, sum_cols = all_n ? BLOCK_N : 1;
    BiasT* dbias = static_cast<BiasT*>(var.dbias) + b_tile * var.dbias_batch_stride + h_tile * var.dbias_head_stride +
                   int64(m0) * var.dbias_row_stride + int64(n0) * var.dbias_col_stride;
    for (int e = threadIdx.x; e < rows_out * BLOCK_N; e += NT) {
        const int r = e / BLOCK_N, c = e % BLOCK_N;  // consecutive threads, consecutive keys
        if (c >= cols_out) continue;
        float x = 0.f;
        for (int rr = 0; rr < sum_rows; ++rr)  // a fixed order: bitwise reproducible
            for (int cc = 0; cc < sum_cols; ++cc) x += s_acc[(r + rr) * Tr::ACC_STRIDE + c + cc];
        BiasT& out = dbias[int64(r) * var.dbias_row_stride + int64(c) * var.dbias_col_stride];
        if constexpr (sizeof(BiasT) == 4) out = x;
        else out = TypeTraits<T>::from_float(x);
    }
}

// ---------------------------------------------------------------------------
// Strips (sm_90a, flash_bwd_dbias_strip_sm90_kernel): one block per strip of BLOCK_M
// query rows of one bias (batch, head), for a bias with whole rows and keys (no row
// or key broadcast) whose V = (batch visits) x (head visits) pairs broadcast onto it
// fit shared memory side by side (dispatch.uses_sm90_dbias_strips). Q, dO, lse_log2
// and delta of the V pairs' BLOCK_M rows load once and stay resident; the block walks
// the key tiles n = 0, 1, .. and for each the V pairs in the tile kernel's order
// (batch, then head), streaming each step's K and V through a three-stage cp.async
// ring. The 128 x 64 tile's sum over its V visits stays in registers (the same fp32
// additions in the same order as the tile kernel: bitwise the same dbias), and is
// stored once from the fragments, straight to the dbias strides, when the walk leaves
// the tile; tiles no pair reaches are stored as 0. The tile's bias is read into
// registers when the walk enters it.
// Software pipelined (PIPELINED below): step i's elementwise work (P, then acc +=
// P∘(dP − delta)) runs while the tensor cores compute step i+1's S and dP, issued just
// before it into the other of two sets of accumulators (the sets alternate: the loop is
// unrolled by two steps) and waited for at the step's end. (Issued a step earlier and
// left in flight across the loop's back edge and its branches, ptxas serializes every
// wgmma: C7514.) Unpipelined, each warpgroup's tensor cores idled through its
// elementwise work, most of a step (ncu: issue slots 40% busy, the tensor pipe low).
// The ring, at step i's barrier: pipelined, step i+1's K, V (landed; read by the GEMMs
// issued now), i+2's (landing), and i+3's loading into step i's stage (its GEMMs were
// waited for in step i-1); else step i's (landed), i+1's (landing), i+2's loading.
// Shared memory (from a 1024-byte boundary): K, V of the ring's 3 stages; Q, dO of each
// pair; lse_log2, delta rows of each pair (dispatch.bwd_dbias_strip_smem_bytes).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool IS_CAUSAL, bool EVEN_K,
          int VARIANT>
__device__ __forceinline__ void dbias_strip(const BwdParams& p) {
    using Tr = BwdDbiasTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, NUM_WARPS, 2, true>;  // (its tiles)
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using Scores = DbiasScores<IS_CAUSAL, VARIANT, T, Tr::M_TILES, Tr::N_TILES>;
    using BiasT = typename Scores::BiasMod::BiasT;
    constexpr int NT = Tr::NUM_THREADS;
    constexpr int N_TILES = Tr::N_TILES;
    constexpr int RING = 3;  // stages of K, V
    static_assert(Tr::M_TILES == 1, "wgmma: each warp 16 rows");
    // The second set of S, dP accumulators is BLOCK_N registers more per thread (plain
    // bias, D=64: 163 -> 237 under nvcc 13.0). With the boolean mask's reads or dropout's
    // Philox rounds (205-250 registers unpipelined) they spill (2-384 bytes, nvcc 13.0):
    // those variants keep one set, S and dP of step i issued in step i, P computed under dP.
    constexpr bool PIPELINED = (VARIANT & (VAR_MASK | VAR_DROPOUT)) == 0;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32 s_base = (smem_addr(smem_raw) + 1023) & ~1023u;
    unsigned char* const smem = smem_raw + (s_base - smem_addr(smem_raw));

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int warp_row0 = warp * Tr::WARP_ROWS;  // warp_col0 = 0
    const int wg_row0 = warp / 4 * 64;           // this warpgroup's rows

    // ---- which strip; the pairs that broadcast onto it: visit vi = b' · visit_h + h'
    const VariantParams& var = p.var;
    const bool all_b = var.dbias_batch_stride == 0, all_h = var.dbias_head_stride == 0;
    const int m_blocks = ceil_div(p.seqlen_q, BLOCK_M), n_blocks = ceil_div(p.seqlen_k, BLOCK_N);
    const int heads_b = all_h ? 1 : p.nheads_q;
    // causal: the strips of most keys (the last rows) first
    const int m_pos = blockIdx.x % m_blocks;
    const int m_tile = IS_CAUSAL ? m_blocks - 1 - m_pos : m_pos;
    const int bh_tile = blockIdx.x / m_blocks;
    const int h_tile = bh_tile % heads_b, b_tile = bh_tile / heads_b;
    const int m0 = m_tile * BLOCK_M;
    const int visit_b = all_b ? p.batch : 1, visit_h = all_h ? p.nheads_q : 1;
    const int nvis = visit_b * visit_h;
    const int group = p.nheads_q / p.nheads_kv;

    auto sK = [&](int stage) { return s_base + stage * 2 * KVTile::BYTES; };
    auto sV = [&](int stage) { return sK(stage) + KVTile::BYTES; };
    auto sQ = [&](int vi) { return s_base + RING * 2 * KVTile::BYTES + vi * 2 * QTile::BYTES; };
    auto sdO = [&](int vi) { return sQ(vi) + QTile::BYTES; };
    const int rows0 = RING * 2 * KVTile::BYTES + nvis * 2 * QTile::BYTES;  // bytes from s_base
    auto rows_addr = [&](int vi) { return s_base + rows0 + vi * 2 * BLOCK_M * 4; };
    auto rows_of = [&](int vi) { return reinterpret_cast<const float*>(smem + rows0 + vi * 2 * BLOCK_M * 4); };

    auto pair_b = [&](int vi) { return all_b ? vi / visit_h : b_tile; };
    auto pair_h = [&](int vi) { return all_h ? vi % visit_h : h_tile; };

    // A step: key tile n of pair vi (batch b); n = n_blocks: past the walk's end.
    struct Step {
        int n, vi, b;
        bool masked;  // the step needs mask code (key tail, causal diagonal, window edge)
    };
    // The first step at or after (n, vi) (vi <= nvis) that some (query, key) pair reaches.
    // (The walk's position as two counters: no division of a step index per step.)
    auto next_step = [&](int n, int vi) {
        Step v;
        for (;; ++vi) {
            if (vi == nvis) vi = 0, ++n;
            v.n = n, v.vi = vi;
            if (n >= n_blocks) return v;
            v.b = pair_b(vi);
            const SeqLens seq = seq_lens(p, v.b);
            if (m0 < seq.seqlen_q && n * BLOCK_N < seq.seqlen_k) {
                const BlockRange r =
                    Mask<IS_CAUSAL, VARIANT>(var, seq.seqlen_q, seq.seqlen_k).key_blocks(m0, BLOCK_M, BLOCK_N);
                v.masked = r.masked(n);
                if (n >= r.begin && n < r.end) return v;
            }
        }
    };
    auto load_kv = [&](const Step& v, int stage) {
        const SeqLens seq = seq_lens(p, v.b);
        const int h_kv = pair_h(v.vi) / group, n0 = v.n * BLOCK_N;
        const T* k = static_cast<const T*>(p.k) + v.b * p.k_batch_stride + h_kv * p.k_head_stride +
                     int64(seq.k_start + n0) * p.k_row_stride;
        const T* vv = static_cast<const T*>(p.v) + v.b * p.v_batch_stride + h_kv * p.v_head_stride +
                      int64(seq.k_start + n0) * p.v_row_stride;
        load_tile<T, BLOCK_N, HEAD_DIM, NT, true, EVEN_K, KVTile>(sK(stage), k, p.k_row_stride, seq.seqlen_k - n0,
                                                                  p.head_dim);
        load_tile<T, BLOCK_N, HEAD_DIM, NT, true, EVEN_K, KVTile>(sV(stage), vv, p.v_row_stride, seq.seqlen_k - n0,
                                                                  p.head_dim);
    };

    // ---- prologue: every pair's Q, dO, lse_log2, delta (pairs whose sequence has no
    //      row here are never stepped: not loaded) with the first step's K, V; then the
    //      second step's K, V
    for (int vi = 0; vi < nvis; ++vi) {
        const int b = pair_b(vi), h = pair_h(vi);
        const SeqLens seq = seq_lens(p, b);
        if (m0 >= seq.seqlen_q) continue;
        const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                     int64(seq.q_start + m0) * p.q_row_stride;
        const T* dout = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride +
                        int64(seq.q_start + m0) * p.do_row_stride;
        load_tile<T, BLOCK_M, HEAD_DIM, NT, true, EVEN_K, QTile>(sQ(vi), q, p.q_row_stride, seq.seqlen_q - m0,
                                                                 p.head_dim);
        load_tile<T, BLOCK_M, HEAD_DIM, NT, true, EVEN_K, QTile>(sdO(vi), dout, p.do_row_stride, seq.seqlen_q - m0,
                                                                 p.head_dim);
        const int r = threadIdx.x;  // thread r loads row r of lse_log2 and delta
        if (r < BLOCK_M) {
            const bool valid = m0 + r < seq.seqlen_q;
            const int64 row_index = query_row_index(p, b, h, seq, m0) + (valid ? r : 0);
            cp_async_4(rows_addr(vi) + r * 4, p.lse_log2 + row_index, valid);
            cp_async_4(rows_addr(vi) + (BLOCK_M + r) * 4, p.delta + row_index, valid);
        }
    }
    // The walk's next steps, each with its K, V in the ring (n = n_blocks: no step): cur
    // (step i), nxt (i + 1) and, pipelined, aft (i + 2).
    Step cur = next_step(0, 0);
    if (cur.n < n_blocks) load_kv(cur, 0);
    cp_async_commit();
    Step nxt = cur.n < n_blocks ? next_step(cur.n, cur.vi + 1) : cur;
    if (nxt.n < n_blocks) load_kv(nxt, 1);
    cp_async_commit();
    Step aft = nxt;
    if constexpr (PIPELINED) {
        if (nxt.n < n_blocks) aft = next_step(nxt.n, nxt.vi + 1);
        if (aft.n < n_blocks) load_kv(aft, 2);
        cp_async_commit();
    }

    const typename Scores::BiasMod bias_mod(var, p.softmax_scale_log2, b_tile, h_tile, p.seqlen_q, p.seqlen_k);
    typename Scores::Terms bias(bias_mod, m0 + warp_row0 + g);
    float acc[1][N_TILES][4];
    clear(acc);

    // Store acc as key tile n of the strip (rows and keys past dbias's are not stored).
    BiasT* const dbias_strip_ptr = static_cast<BiasT*>(var.dbias) + b_tile * var.dbias_batch_stride +
                                   h_tile * var.dbias_head_stride;
    auto store_acc = [&](int n) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = m0 + warp_row0 + hh * 8 + g;
            if (row >= p.seqlen_q) continue;
            BiasT* out_row = dbias_strip_ptr + int64(row) * var.dbias_row_stride;
#pragma unroll
            for (int j = 0; j < N_TILES; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = n * BLOCK_N + j * 8 + 2 * t + e;
                    if (col >= p.seqlen_k) continue;
                    const float x = acc[0][j][2 * hh + e];
                    BiasT& out = out_row[int64(col) * var.dbias_col_stride];
                    if constexpr (sizeof(BiasT) == 4) out = x;
                    else out = TypeTraits<T>::from_float(x);
                }
        }
    };

    using Acc = float[1][N_TILES][4];
    // S = Q·Kᵀ, then dP = dO·Vᵀ of step v (K, V at stage) for this warpgroup's 64 rows:
    // two commit groups. Pipelined, issued also past the walk's end (on whatever stage and
    // pair v names; never read): a branch around them costs 17 registers (ptxas, D=64).
    auto issue = [&](const Step& v, int stage, Acc& s, Acc& dp) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            Wgmma<T, BLOCK_N>::template ss<0, 0>(s[0], desc_k_major<BLOCK_M>(sQ(v.vi), wg_row0, kk),
                                                 desc_k_major<BLOCK_N>(sK(stage), 0, kk), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            Wgmma<T, BLOCK_N>::template ss<0, 0>(dp[0], desc_k_major<BLOCK_M>(sdO(v.vi), wg_row0, kk),
                                                 desc_k_major<BLOCK_N>(sV(stage), 0, kk), kk > 0);
        wgmma_commit();
    };
    // Step cur's elementwise work, its S, dP in (s, dp): waited for here (pipelined:
    // complete, waited for at the end of the last step).
    auto finish = [&](auto masked, Acc& s, Acc& dp) {
        constexpr bool MASKED = decltype(masked)::value;
        const int vi = cur.vi;
        const SeqLens seq = seq_lens(p, cur.b);
        const Scores scores(var, p.softmax_scale_log2, cur.b, pair_h(vi), p.nheads_q, seq.seqlen_q, seq.seqlen_k,
                            bias);
        const float* s_lse = rows_of(vi);
        const float* s_delta = s_lse + BLOCK_M;
        auto lse2 = [&](int i, int hh) { return s_lse[warp_row0 + i * 16 + hh * 8 + g]; };
        auto delta = [&](int i, int hh) { return s_delta[warp_row0 + i * 16 + hh * 8 + g]; };
        // ---- P = prob(x, lse·log2e), x the pair's masked score with the tile's bias
        if constexpr (!PIPELINED) {
            wgmma_wait<1>();
            fence_operands(s[0]);
        }
        scores.template probs<MASKED>(s, m0 + warp_row0 + g, cur.n * BLOCK_N + 2 * t, lse2);
        // ---- dbias += P∘(dP∘Z·rp − delta)
        if constexpr (!PIPELINED) {
            wgmma_wait<0>();
            fence_operands(dp[0]);
        }
        scores.accumulate(acc, s, dp, delta);
    };

    // One step of the walk, its S, dP in (s, dp); the next step's go to (s_next,
    // dp_next) (pipelined: the other set; else the same). False past the walk's end.
    // acc_n: the key tile acc sums; bias_n: the tile whose bias is in registers.
    int stage = 0, acc_n = 0, bias_n = -1;  // stage: step cur's K, V
    auto walk = [&](Acc& s, Acc& dp, Acc& s_next, Acc& dp_next) {
        while (acc_n < cur.n) {  // leave tiles acc_n .. cur.n - 1: stored once (0 where unreached)
            store_acc(acc_n);
            clear(acc);
            ++acc_n;
        }
        if (cur.n >= n_blocks) return false;
        if (bias_n != acc_n) {
            bias.template load<true>(acc_n * BLOCK_N + 2 * t);
            bias_n = acc_n;
        }
        // the step after the last one loaded: pipelined i + 3, into cur's stage (its GEMMs
        // are done); else i + 2, into step i-1's
        const Step last = PIPELINED ? aft : nxt;
        const Step fresh = last.n < n_blocks ? next_step(last.n, last.vi + 1) : last;
        const int stage1 = stage == RING - 1 ? 0 : stage + 1, stage2 = stage1 == RING - 1 ? 0 : stage1 + 1;
        cp_async_wait<1>();        // pipelined: step i+1's K, V landed (its GEMMs issue now); else step i's
        fence_proxy_async_smem();  // this thread's copies, visible to wgmma
        __syncthreads();           // everyone's have; every warp is done with the stage loaded next
        if (fresh.n < n_blocks) load_kv(fresh, PIPELINED ? stage : stage2);
        cp_async_commit();
        if constexpr (PIPELINED) issue(nxt, stage1, s_next, dp_next);
        else issue(cur, stage, s, dp);
        if (cur.masked) finish(Bool<true>{}, s, dp);
        else finish(Bool<false>{}, s, dp);
        if constexpr (PIPELINED) {
            wgmma_wait<0>();
            fence_operands(s_next[0]);
            fence_operands(dp_next[0]);
        }
        cur = nxt;
        if constexpr (PIPELINED) nxt = aft, aft = fresh;
        else nxt = fresh;
        stage = stage1;
        return true;
    };

    float s0[1][N_TILES][4], dp0[1][N_TILES][4];
    if constexpr (PIPELINED) {
        // the first step's GEMMs, then two steps per trip: the sets alternate
        float s1[1][N_TILES][4], dp1[1][N_TILES][4];
        cp_async_wait<2>();
        fence_proxy_async_smem();
        __syncthreads();
        issue(cur, 0, s0, dp0);
        wgmma_wait<0>();
        fence_operands(s0[0]);
        fence_operands(dp0[0]);
        while (walk(s0, dp0, s1, dp1) && walk(s1, dp1, s0, dp0)) {
        }
    } else {
        while (walk(s0, dp0, s0, dp0)) {
        }
    }
    wgmma_wait<0>();  // (pipelined: the GEMMs issued past the end)
    cp_async_wait<0>();
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int WARPS_M, int STAGES,
          bool IS_CAUSAL, bool EVEN_K, bool VEC, int VARIANT>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_bwd_dbias_kernel(const BwdParams p) {
    dbias_tile<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, WARPS_M, STAGES, false, IS_CAUSAL, EVEN_K, VEC, VARIANT>(p);
}

// sm_90a: S and dP on wgmma (BLOCK_M = 16 NUM_WARPS, WARPS_M = NUM_WARPS, two stages, VEC).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool IS_CAUSAL, bool EVEN_K,
          int VARIANT>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_bwd_dbias_sm90_kernel(const BwdParams p) {
    dbias_tile<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, NUM_WARPS, 2, true, IS_CAUSAL, EVEN_K, true, VARIANT>(p);
}

// sm_90a strips (dbias_strip above; dynamic shared memory sized by the pairs per strip).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool IS_CAUSAL, bool EVEN_K,
          int VARIANT>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_bwd_dbias_strip_sm90_kernel(const BwdParams p) {
    dbias_strip<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, IS_CAUSAL, EVEN_K, VARIANT>(p);
}

}  // namespace cupyflash
