// flash_bwd.cu: the FlashAttention-2 backward pass (Dao 2023, Algorithm 2) on
// mma.sync.m16n8k16 Tensor Core fragments.
//
// With P = exp(scale·Q·Kᵀ − lse) recomputed tile by tile and
// delta = rowsum(dO∘O) (= rowsum(P∘dP)):
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P∘(dP − delta),
//   dK = scale·dSᵀ·Q,  dQ = scale·dS·K.
// The variants (VARIANT, variant.cuh; cupyflash/reference.py is the specification):
// P = prob(x, lse·log2e) with x the modified, masked score in log2 units (softcap,
// ALiBi, bias; window, causal, key tail, bool mask: x = -inf), dropout's keep mask Z
// and rp = 1/(1-p) give dV = (P∘Z·rp)ᵀ·dO and dS = P∘(dP∘Z·rp − delta), softcap
// multiplies dS by 1 − tanh², and a sink (in lse already) adds dsinks[h] =
// −Σ exp(sink_h − lse)·delta (the preprocess kernel). With a bias, dbias = dS before
// the softcap factor, summed over broadcast dimensions, is flash_bwd_dbias.cu's own
// kernel (no atomics). variant.cuh's BwdScores holds the element-wise pieces.
//
// Kernels, in launch order (cupyflash/_gpu_bwd.py):
//   flash_bwd_preprocess_kernel  delta; lse·log2(e) with the P = 0 guards; dq_accum = 0;
//                                dsinks (sinks on)
//   flash_bwd_dkdv_kernel        one block per key block: dK and dV; in the default
//                                mode also dQ, added to dq_accum with fp32 atomics
//   flash_bwd_dq_kernel          deterministic mode: one block per query block
//                                recomputes S, P, dP, dS and sums dQ in a fixed order
//   flash_bwd_convert_dq_kernel  default mode: dq = scale·dq_accum in the input dtype
//   flash_bwd_convert_dkv_kernel GQA split over several blocks (kv_splits > 1):
//                                dk, dv = the sum of the fp32 partials, in a fixed order
//   flash_bwd_dbias_kernel       with a bias's gradient asked for (flash_bwd_dbias.cu):
//                                dbias from lse_log2 and delta, one block per tile of it
//
// Dense and packed (varlen) batches run the same instantiations: seqlens.cuh
// gives each block its sequence's rows and lengths.
//
// Row buffers: lse_log2, delta and dq_accum hold one fp32 row per query row,
// dkv_accum (per split) one per key row, with no padding, laid out like a
// contiguous lse: (batch, nheads, seqlen) for a dense batch, (nheads, total)
// for a packed one. The row-wise kernels (preprocess, converts) walk a packed
// batch as one sequence of total rows, so they need no cu_seqlens.
//
// Query tails need no mask code: rows past seqlen_q load Q, dO, lse_log2 and
// delta as 0, so S = 0, P = prob(x, 0) is finite and in [0, 1] with every variant
// (x = 0, or ALiBi's finite -slope·distance; prob clamps at 1), dP = dO·Vᵀ = 0
// and dS = P∘(dP∘Z·rp − delta) = 0 (times 1 − tanh² = 1 with softcap): they add
// nothing to dK, nothing to dV (dO = 0 there), and their dQ is never stored.
// Rows that see no key (lse = -inf) get lse_log2 = +inf, so P = 0 there, with
// no NaN. Key tails, the causal diagonal and the window's edges are masked.
#include "params.cuh"
#include "block_traits.cuh"
#include "ptx.cuh"
#include "seqlens.cuh"
#include "query_grid.cuh"
#include "bwd_rows.cuh"
#include "tile_io.cuh"
#include "variant.cuh"
#include "warp_mma.cuh"

namespace cupyflash {

#define POS_INF (__int_as_float(0x7f800000))

// load_tile, except that the !VEC path (element loads, which the compiler keeps
// in flight all at once: 64 registers for a 64 x 256 tile) goes one TileMap
// pass of rows at a time in a rolled loop, since the dK/dV kernel loads Q and
// dO while dK and dV already hold 128 registers per thread.
template <typename T, int ROWS, int HEAD_DIM, int NUM_THREADS, bool VEC, bool EVEN_K>
__device__ __forceinline__ void load_tile_lean(uint32 smem_base, const T* gmem, int64 row_stride, int rows_valid,
                                               int head_dim) {
    if constexpr (VEC) {
        load_tile<T, ROWS, HEAD_DIM, NUM_THREADS, true, EVEN_K>(smem_base, gmem, row_stride, rows_valid, head_dim);
    } else {
        using Tile = SmemTile<T, ROWS, HEAD_DIM>;
        constexpr int PASS = TileMap<T, ROWS, HEAD_DIM, NUM_THREADS>::ROWS_PER_IT;
#pragma unroll 1
        for (int r = 0; r < ROWS; r += PASS) {
            load_tile<T, PASS, HEAD_DIM, NUM_THREADS, false, EVEN_K>(smem_base + Tile::offset(r, 0),
                                                                    gmem + r * row_stride, row_stride,
                                                                    rows_valid - r, head_dim);
        }
    }
}

// ---------------------------------------------------------------------------
// Preprocess: delta = rowsum(dO∘O) in fp32, lse_log2 = lse·log2(e) raised by 2^-20 of
// itself (below; +inf where lse = -inf), dq_accum = 0 (default mode). The grid walks
// the row buffers as one flat run of query_rows(p) rows ((batch, head, row) dense, (head, row)
// packed): ROWS = PREPROCESS_THREADS / ROW_LANES · ROWS_PER_THREAD consecutive
// rows per block, which may span several heads (short sequences, many heads).
//
// A group of ROW_LANES lanes takes one row, each lane 8 elements of it (VEC:
// one 16-byte chunk of O and one of dO; !VEC: elements lane, lane + ROW_LANES,
// ...); cupyflash/dispatch.py picks ROW_LANES = head_dim_padded / 8 rounded up
// to a power of two (4 at D = 32, 16 at D = 128, 32 at D = 256). Each thread
// issues the loads of all its ROWS_PER_THREAD rows (O, dO, lse) first, then
// zeroes its share of the block's dq_accum rows, and only then waits for the
// loads, reduces and stores: the stores may alias O, dO and lse as far as the
// compiler knows, so a load written after a store would wait for it. (The
// version before walked 16 rows per warp with a reduction and a store between
// rows: one memory latency per row, 17 us for 16 MB at the seed shape.)
// ---------------------------------------------------------------------------
constexpr int PREPROCESS_THREADS = 256;

template <typename T, int ROW_LANES, int ROWS_PER_THREAD, bool VEC>
__global__ void __launch_bounds__(PREPROCESS_THREADS)
flash_bwd_preprocess_kernel(const BwdParams p) {
    static_assert(ROW_LANES == 4 || ROW_LANES == 8 || ROW_LANES == 16 || ROW_LANES == 32,
                  "ROW_LANES: a power of two, 4 to 32 (8 elements per lane: head_dim <= 8 * ROW_LANES)");
    constexpr int SLOTS = PREPROCESS_THREADS / ROW_LANES;  // rows per pass of the block
    constexpr int ROWS = SLOTS * ROWS_PER_THREAD;          // rows per block
    constexpr int ELEMS = 8;                               // elements of a row per lane
    const int64 row0 = int64(blockIdx.x) * ROWS;  // first row of the block in the row buffers
    const int rows_valid = int(min(int64(ROWS), query_rows(p) - row0));
    const uint32 rows_per_head = query_rows_per_head(p);
    const int slot = threadIdx.x / ROW_LANES, lane = threadIdx.x % ROW_LANES;
    // (batch·nheads_q + head, row) of the block's first row; unsigned 32 bits from here
    // on (batch·nheads_q < 2^32; m0 + ROWS < 2^32), for the cheaper divisions
    const uint32 bh0 = uint32(row0 / rows_per_head);
    const uint32 m0 = uint32(row0 - int64(bh0) * rows_per_head);
    struct HeadRows {  // O, dO and lse of row 0 of one (batch, head)
        const T* o;
        const T* d;
        const float* lse;
    };
    auto head_rows = [&](uint32 bh) {
        const uint32 nh = p.nheads_q, b = bh / nh, h = bh - b * nh;  // b = 0 when packed (batch strides are 0)
        return HeadRows{static_cast<const T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride,
                        static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride,
                        p.lse + b * p.lse_batch_stride + h * p.lse_head_stride};
    };
    const HeadRows first = head_rows(bh0);

    // ---- issue every load: O and dO (ELEMS elements of each per row), lse
    uint4 o[ROWS_PER_THREAD], d[ROWS_PER_THREAD];  // ELEMS values of T each
    float lse[ROWS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < ROWS_PER_THREAD; ++i) {
        const int r = slot + i * SLOTS;
        o[i] = d[i] = make_uint4(0u, 0u, 0u, 0u);
        lse[i] = 0.f;
        if (r >= rows_valid) continue;
        uint32 m = m0 + r;
        HeadRows head = first;
        if (m >= rows_per_head) {  // the block runs over into a later head
            const uint32 next = m / rows_per_head;
            m -= next * rows_per_head;
            head = head_rows(bh0 + next);
        }
        const T* orow = head.o + int64(m) * p.o_row_stride;
        const T* drow = head.d + int64(m) * p.do_row_stride;
        if constexpr (VEC) {  // head_dim % 8 == 0
            if (lane * ELEMS < p.head_dim) {
                o[i] = *reinterpret_cast<const uint4*>(orow + lane * ELEMS);
                d[i] = *reinterpret_cast<const uint4*>(drow + lane * ELEMS);
            }
        } else {
            T* oe = reinterpret_cast<T*>(&o[i]);
            T* de = reinterpret_cast<T*>(&d[i]);
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) {
                const int c = lane + e * ROW_LANES;
                if (c < p.head_dim) {
                    oe[e] = orow[c];
                    de[e] = drow[c];
                }
            }
        }
        if (lane == 0) lse[i] = head.lse[m];
    }

    // ---- dq_accum = 0 for the block's rows (default mode; the dK/dV kernel adds to it),
    //      whole padded rows, 16-byte stores over the block's contiguous range
    if (p.dq_accum != nullptr) {
        float4* acc = reinterpret_cast<float4*>(p.dq_accum + row0 * p.head_dim_padded);
        const int count = rows_valid * p.head_dim_padded / 4;
#pragma unroll 4
        for (int j = threadIdx.x; j < count; j += PREPROCESS_THREADS) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    // ---- delta = rowsum(dO∘O) in fp32 over the ROW_LANES lanes of the row; lse in log2 units
    float dots[ROWS_PER_THREAD];  // delta of each row (every lane of its group)
#pragma unroll
    for (int i = 0; i < ROWS_PER_THREAD; ++i) {
        const uint32* ow = reinterpret_cast<const uint32*>(&o[i]);
        const uint32* dw = reinterpret_cast<const uint32*>(&d[i]);
        float dot = 0.f;
#pragma unroll
        for (int w = 0; w < ELEMS / 2; ++w) {  // elements 2w, 2w + 1 (zeros past head_dim)
            const float2 a = TypeTraits<T>::unpack(ow[w]), c = TypeTraits<T>::unpack(dw[w]);
            dot = fmaf(a.x, c.x, dot);
            dot = fmaf(a.y, c.y, dot);
        }
#pragma unroll
        for (int offset = ROW_LANES / 2; offset > 0; offset /= 2) {  // within the aligned lane group
            dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        }
        dots[i] = dot;
        const int r = slot + i * SLOTS;
        if (lane == 0 && r < rows_valid) {
            p.delta[row0 + r] = dot;
            // +inf (P = 0) for rows that see no key; else, finite, raised by |lse·log2e|·2^-20
            // (at least 8 ulp of a normal value): the wgmma backwards take plain P =
            // exp2(fma(s, scale_log2, -lse_log2)) with the product unrounded, where lse carries
            // up to 5 ulp of the forward's roundings, so the largest term could reach exp2(+5
            // ulp): inf at logits near 3e10 (ulp 4096). P is then at most 1 at every magnitude,
            // smaller by a factor above 1 - 1e-4 at |lse| < 100 (far under its rounding to
            // fp16/bf16), 0.99 at 1e4, where lse's own rounding is a third of that.
            const float lse_log2 = lse[i] * LOG2E;
            p.lse_log2[row0 + r] = lse[i] == NEG_INF ? POS_INF
                                   : isfinite(lse_log2) ? fmaf(fabsf(lse_log2), 0x1p-20f, lse_log2) : lse_log2;
        }
    }

    // ---- sinks (p.var.dsinks set, zeroed by the host): dsinks[h] −= Σ over the rows of head h
    //      of P_sink·delta, P_sink = exp(sink_h − lse) (cupyflash/reference.py; rows with
    //      lse = -inf add 0). The block's rows may span several heads: each row adds into its
    //      head's slot in shared memory (at most ROWS heads, since each has one row here),
    //      then one atomic per head goes to global memory.
    if (p.var.dsinks != nullptr) {
        __shared__ float head_sums[ROWS];  // [head of the row − head of row 0]
        for (int j = threadIdx.x; j < ROWS; j += PREPROCESS_THREADS) head_sums[j] = 0.f;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < ROWS_PER_THREAD; ++i) {
            const int r = slot + i * SLOTS;
            if (lane == 0 && r < rows_valid && lse[i] != NEG_INF) {
                const uint32 rel = (m0 + r) / rows_per_head;  // bh of row r − bh0
                const uint32 h = (bh0 + rel) % uint32(p.nheads_q);
                atomicAdd(&head_sums[rel], expf(__ldg(p.var.sinks + h) - lse[i]) * dots[i]);
            }
        }
        __syncthreads();
        const int heads = int((m0 + rows_valid - 1) / rows_per_head) + 1;  // rows_valid >= 1
        for (int j = threadIdx.x; j < heads; j += PREPROCESS_THREADS) {
            atomicAdd(p.var.dsinks + (bh0 + j) % uint32(p.nheads_q), -head_sums[j]);
        }
    }
}

// ---------------------------------------------------------------------------
// dK/dV: one block per (key block, batch, KV head, split of the GQA group).
// ---------------------------------------------------------------------------
//
// K and V stay in shared memory and dK, dV in registers while the block walks
// over the query blocks that see its keys. With GQA it visits those of the
// query heads sharing its KV head, one after another (deterministic, nothing
// expanded); when that leaves too few blocks for the GPU, the group's heads
// are split over p.kv_splits blocks that write fp32 partials, summed by
// flash_bwd_convert_dkv_kernel in a fixed order.
// Per query block (the variants' forms at the top of this file):
//   S = Q·Kᵀ,  P = exp2(S·scale·log2e − lse·log2e),  dP = dO·Vᵀ,  dS = P∘(dP − delta)
//   P, dS -> shared memory (the next GEMMs read them transposed)
//   dV += Pᵀ·dO,  dK += dSᵀ·Q,  dQ_partial = dS·K -> atomicAdd into dq_accum
// Each GEMM has its own grid of warp tiles (the traits below; the warp counts
// per axis are chosen in cupyflash/dispatch.py so that fragments loaded with
// ldmatrix feed several mma each).
//
// Template parameters, in order:
//   T            __half or __nv_bfloat16
//   HEAD_DIM     padded head dimension (multiple of 16); runtime head_dim <= HEAD_DIM
//   BLOCK_M      query rows per tile;  BLOCK_N  keys per block
//   NUM_WARPS    warps per block
//   WARPS_M_SDP  warps along the query rows of S and dP (the rest go along keys)
//   WARPS_N_DKV  warps along the key rows of dK and dV (the rest go along head_dim)
//   WARPS_M_DQ   warps along the query rows of dQ (the rest go along head_dim)
//   IS_CAUSAL    bottom-right aligned causal mask
//   EVEN_K       head_dim == HEAD_DIM (no column predicates)
//   VEC          16-byte loads are legal (pointers, strides, head_dim multiples of 8 elements)
//   DETERMINISTIC  skip dQ here (flash_bwd_dq_kernel computes it without atomics)
//   VARIANT      the variants switched on (variant.cuh's VAR_* bits)
// Runtime: p.num_stages = 2 double-buffers Q, dO, lse, delta (the next query
// block loads during the whole step); 1 halves that memory and loads the next
// block during the dQ GEMM only (for GPUs with less shared memory).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int WARPS_M_SDP_, int WARPS_N_DKV_,
          int WARPS_M_DQ_, int VARIANT_ = 0>
struct BwdTraits : BlockTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS * 32> {

    // S and dP: (BLOCK_M x BLOCK_N) in a WARPS_M_SDP x (NUM_WARPS / WARPS_M_SDP) grid of warp tiles
    static constexpr int SDP_ROWS = BLOCK_M / WARPS_M_SDP_;
    static constexpr int SDP_COLS = BLOCK_N / (NUM_WARPS / WARPS_M_SDP_);
    static constexpr int SDP_MT = SDP_ROWS / 16, SDP_NT = SDP_COLS / 8;
    // dV and dK: (BLOCK_N x HEAD_DIM)
    static constexpr int DKV_ROWS = BLOCK_N / WARPS_N_DKV_;
    static constexpr int DKV_COLS = HEAD_DIM / (NUM_WARPS / WARPS_N_DKV_);
    static constexpr int DKV_MT = DKV_ROWS / 16, DKV_NT = DKV_COLS / 8;
    // dQ: (BLOCK_M x HEAD_DIM)
    static constexpr int DQ_ROWS = BLOCK_M / WARPS_M_DQ_;
    static constexpr int DQ_COLS = HEAD_DIM / (NUM_WARPS / WARPS_M_DQ_);
    static constexpr int DQ_MT = DQ_ROWS / 16, DQ_NT = DQ_COLS / 8;
    // dQ is only a per-step temporary (next to 2 * DKV_MT * DKV_NT * 4 registers
    // of dK, dV): split wide warp tiles into two column passes.
    static constexpr int DQ_PASS_COLS = DQ_MT * DQ_NT * 4 > 32 && DQ_COLS % 32 == 0 ? DQ_COLS / 2 : DQ_COLS;

    using QTile = SmemTile<T, BLOCK_M, HEAD_DIM>;   // Q and dO
    using KVTile = SmemTile<T, BLOCK_N, HEAD_DIM>;  // K and V (and the dK, dV staging at the end)
    using PTile = SmemTile<T, BLOCK_M, BLOCK_N>;    // P and dS
    // Shared memory: K, V, P, dS, the block's SeqLens, then per stage Q, dO, lse_log2, delta
    // and (VAR_BIAS_STAGED) the query block's bias/mask tile (ScoreTileStage, BLOCK_M x BLOCK_N).
    static constexpr bool STAGED = (VARIANT_ & VAR_BIAS_STAGED) != 0;
    static constexpr int SCORE_OFFSET = 2 * QTile::BYTES + 2 * BLOCK_M * 4;  // in a stage
    static constexpr int SCORE_BYTES =
        ScoreStageBytes<STAGED, VARIANT_, T, BLOCK_M, BLOCK_N, BwdTraits::NUM_THREADS>::value;
    static constexpr int STAGE_BYTES = SCORE_OFFSET + SCORE_BYTES;
    static constexpr int FIXED_BYTES = 2 * KVTile::BYTES + 2 * PTile::BYTES + SeqLensSlot::BYTES;

    static_assert(NUM_WARPS % WARPS_M_SDP_ == 0 && NUM_WARPS % WARPS_N_DKV_ == 0 && NUM_WARPS % WARPS_M_DQ_ == 0,
                  "warp grids must use every warp");
    static_assert(SDP_ROWS % 16 == 0 && DKV_ROWS % 16 == 0 && DQ_ROWS % 16 == 0, "warp tiles hold whole m16 tiles");
    static_assert(SDP_COLS % 16 == 0 && DKV_COLS % 16 == 0 && DQ_COLS % 16 == 0, "warp tiles hold n8 tile pairs");
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "k16 steps");
    static_assert(BLOCK_M <= BwdTraits::NUM_THREADS, "one thread per row of lse_log2 and delta");
};

// At least one block per SM, said explicitly: without it ptxas capped the D=96
// 64x64 tile at 128 registers (for two blocks per SM) and spilled.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int WARPS_M_SDP, int WARPS_N_DKV,
          int WARPS_M_DQ, bool IS_CAUSAL, bool EVEN_K, bool VEC, bool DETERMINISTIC, int VARIANT>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_bwd_dkdv_kernel(const BwdParams p) {
    using Tr = BwdTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, WARPS_M_SDP, WARPS_N_DKV, WARPS_M_DQ, VARIANT>;
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using PTile = typename Tr::PTile;
    constexpr int NT = Tr::NUM_THREADS;
    constexpr int SDP_MT = Tr::SDP_MT, SDP_NT = Tr::SDP_NT;
    constexpr int DKV_MT = Tr::DKV_MT, DKV_NT = Tr::DKV_NT;
    constexpr int DQ_MT = Tr::DQ_MT;

    extern __shared__ __align__(16) unsigned char smem[];
    const uint32 sK = smem_addr(smem);
    const uint32 sV = sK + KVTile::BYTES;
    const uint32 sP = sV + KVTile::BYTES;
    const uint32 sdS = sP + PTile::BYTES;
    const SeqLensSlot seq_slot{sdS + PTile::BYTES};
    // Per stage: Q, dO, lse_log2 (BLOCK_M floats), delta (BLOCK_M floats).
    auto sQ = [&](int stage) { return sK + Tr::FIXED_BYTES + stage * Tr::STAGE_BYTES; };
    auto sdO = [&](int stage) { return sQ(stage) + QTile::BYTES; };
    auto stage_floats = [&](int stage) {
        return reinterpret_cast<const float*>(smem + Tr::FIXED_BYTES + stage * Tr::STAGE_BYTES + 2 * QTile::BYTES);
    };
    auto sScore = [&](int stage) { return sQ(stage) + Tr::SCORE_OFFSET; };  // staged bias/mask tile
    constexpr bool STAGED = Tr::STAGED;
    // The launch's dynamic shared memory is dispatch's (bwd_smem_bytes): it must cover
    // this kernel's (checked where the staged tile's size is new).
    if constexpr (STAGED) {
        if (threadIdx.x == 0 && dynamic_smem_bytes() < uint32(Tr::FIXED_BYTES + p.num_stages * Tr::STAGE_BYTES)) {
            __trap();
        }
    }

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;

    // ---- which tile (query_grid.cuh)
    const KeyTileCoords tc = key_tile_coords(p, BLOCK_N);
    const int n_block = tc.n_block, split = tc.split, b = tc.b, h_kv = tc.h_kv;
    const SeqLens seq = seq_lens(p, b);
    const int n0 = n_block * BLOCK_N;
    const int heads = tc.heads, h_first = tc.h_first;  // the query heads this block visits
    // <= 0 past the end of a shorter sequence of a packed batch: such a block
    // visits no query block and stores nothing (an early return instead makes
    // ptxas spill in the unaligned variants).
    const int keys_valid = min(BLOCK_N, seq.seqlen_k - n0);
    // The loop reads the sequence's rows and lengths back from shared memory
    // (seq is dead after the prologue): held in registers they would spill.
    if (threadIdx.x == 0) seq_slot.store(seq);

    // ---- the query blocks that see these keys (variant.cuh): [mb.begin, mb.end), of
    //      which those outside [mb.unmasked_begin, mb.unmasked_end) need the mask (the
    //      causal diagonal and the window's edges; every one for the key tail block).
    //      Without a window the masked ones are a prefix, [mb.begin, m_masked_end).
    using Scores = BwdScores<IS_CAUSAL, VARIANT, T>;
    const BlockRange mb = Mask<IS_CAUSAL, VARIANT>(p.var, seq.seqlen_q, seq.seqlen_k)
                              .query_blocks(n0, BLOCK_N, keys_valid, BLOCK_M, ceil_div(seq.seqlen_q, BLOCK_M));
    const int m_begin = mb.begin;
    const int m_masked_end = mb.unmasked_end < mb.end ? mb.end : mb.unmasked_begin;  // no window only
    const int nm = mb.end - mb.begin;
    const int num_iters = heads * nm;  // (query head, query block) pairs
    const bool two_stage = p.num_stages == 2;

    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride +
                 int64(seq.k_start + n0) * p.k_row_stride;
    const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride +
                 int64(seq.k_start + n0) * p.v_row_stride;

    // Warp tiles of the three GEMM shapes.
    const int sdp_row0 = (warp % WARPS_M_SDP) * Tr::SDP_ROWS, sdp_col0 = (warp / WARPS_M_SDP) * Tr::SDP_COLS;
    const int dkv_row0 = (warp % WARPS_N_DKV) * Tr::DKV_ROWS, dkv_col0 = (warp / WARPS_N_DKV) * Tr::DKV_COLS;
    const int dq_row0 = (warp % WARPS_M_DQ) * Tr::DQ_ROWS, dq_col0 = (warp / WARPS_M_DQ) * Tr::DQ_COLS;

    // Load Q, dO, lse_log2, delta of iteration it, zero-filled past seqlen_q (and head_dim).
    auto load_query_block = [&](int it, int stage, const SeqLens& seq) {
        const int h = h_first + it / nm;
        const int m0 = (m_begin + it % nm) * BLOCK_M;
        const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                     int64(seq.q_start + m0) * p.q_row_stride;
        const T* dout = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride +
                        int64(seq.q_start + m0) * p.do_row_stride;
        const int rows_valid = seq.seqlen_q - m0;
        load_tile_lean<T, BLOCK_M, HEAD_DIM, NT, VEC, EVEN_K>(sQ(stage), q, p.q_row_stride, rows_valid, p.head_dim);
        load_tile_lean<T, BLOCK_M, HEAD_DIM, NT, VEC, EVEN_K>(sdO(stage), dout, p.do_row_stride, rows_valid,
                                                              p.head_dim);
        // lse_log2 and delta: thread r loads row r of each
        const int r = threadIdx.x;
        if (r < BLOCK_M) {
            const bool valid = r < rows_valid;
            const int64 row_index = query_row_index(p, b, h, seq, m0) + (valid ? r : 0);
            const uint32 s_rows = sdO(stage) + QTile::BYTES + r * 4;
            cp_async_4(s_rows, p.lse_log2 + row_index, valid);
            cp_async_4(s_rows + BLOCK_M * 4, p.delta + row_index, valid);
        }
        // the (query block, key block)'s bias/mask tile, in the group of Q and dO
        if constexpr (STAGED) {
            ScoreTileStage<VARIANT, T, BLOCK_M, BLOCK_N, NT>::copy(sScore(stage), p.var, b, h, m0, n0,
                                                                   seq.seqlen_q - 1, seq.seqlen_k - 1);
        }
    };

    float acc_dk[DKV_MT][DKV_NT][4], acc_dv[DKV_MT][DKV_NT][4];
    clear(acc_dk);
    clear(acc_dv);

    load_tile_lean<T, BLOCK_N, HEAD_DIM, NT, VEC, EVEN_K>(sK, k, p.k_row_stride, keys_valid, p.head_dim);
    load_tile_lean<T, BLOCK_N, HEAD_DIM, NT, VEC, EVEN_K>(sV, v, p.v_row_stride, keys_valid, p.head_dim);
    if (num_iters > 0) load_query_block(0, 0, seq);
    cp_async_commit();

    auto step = [&](int it, auto masked) {
        const int stage = two_stage ? (it & 1) : 0;
        const int h = h_first + it / nm;
        const int m0 = (m_begin + it % nm) * BLOCK_M;
        const float* s_lse = stage_floats(stage);
        const float* s_delta = s_lse + BLOCK_M;

        cp_async_wait<0>();
        __syncthreads();  // Q, dO, lse, delta [it] landed; every warp is done with step it-1
        if (two_stage && it + 1 < num_iters) {
            load_query_block(it + 1, stage ^ 1, seq_slot.load());
            cp_async_commit();
        }

        // ---- S = Q·Kᵀ
        float s[SDP_MT][SDP_NT][4];
        clear(s);
        warp_gemm<T, SDP_MT, SDP_NT, HEAD_DIM / 16, QTile, false, KVTile, false, true>(s, sQ(stage), sdp_row0,
                                                                                      sK, sdp_col0);

        // The variant's mask, scores and dropout for query head h (variant.cuh's BwdScores),
        // built where used from the lengths in shared memory, read only where needed.
        constexpr bool MASKED = decltype(masked)::value;
        auto scores = [&](auto lengths) {
            SeqLens sl{0, 0, 0, 0};
            if constexpr (decltype(lengths)::value) sl = seq_slot.load();
            return Scores(p.var, p.softmax_scale_log2, b, h, p.nheads_q, sl.seqlen_q, sl.seqlen_k);
        };
        constexpr bool LENGTHS = MASKED || Scores::UNMASKED_LENGTHS;
        // this lane's S element (0, 0, 0) in the sequence; the rows' lse_log2 and delta
        const int row0 = m0 + sdp_row0 + g, col0 = n0 + sdp_col0 + 2 * t;
        auto lse2 = [&](int i, int hh) { return s_lse[sdp_row0 + i * 16 + hh * 8 + g]; };
        auto delta = [&](int i, int hh) { return s_delta[sdp_row0 + i * 16 + hh * 8 + g]; };
        // The bias and mask: this stage's tile (staged; the ScoreMod only gives its strides'
        // broadcast test), else ScoreMod's reads element by element.
        const ScoreMod<VARIANT, T> tile_mod(p.var, p.softmax_scale_log2, b, h, 0, 0);
        using Terms = typename Select<STAGED, StagedScoreTerms<VARIANT, T, SDP_MT, SDP_NT, BLOCK_M, NT, BLOCK_N>,
                                      ElementTerms>::type;
        auto make_terms = [&]() {
            if constexpr (STAGED) {
                Terms terms(tile_mod, b, h, 0, sdp_row0 + g, sScore(stage), sdp_col0);
                terms.template load<MASKED>(0, 0);
                return terms;
            } else {
                return ElementTerms{};
            }
        };
        const Terms terms = make_terms();

        // ---- P = prob(x, lse·log2e), x the variant's masked score: 0 where masked (x = -inf)
        //      or lse_log2 = +inf (with softcap: in dscores below, from the raw S)
        if constexpr (!Scores::DEFER) scores(Bool<LENGTHS>{}).template probs<MASKED>(s, row0, col0, lse2, terms);

        // ---- dP = dO·Vᵀ
        float dp[SDP_MT][SDP_NT][4];
        clear(dp);
        warp_gemm<T, SDP_MT, SDP_NT, HEAD_DIM / 16, QTile, false, KVTile, false, true>(dp, sdO(stage), sdp_row0,
                                                                                      sV, sdp_col0);

        // ---- dS = P∘(dP∘Z·rp − delta) (∘ (1 − tanh²) with softcap) in place of dP, and
        //      P∘Z·rp (dropout's keep mask Z, rp = 1/(1-p)) in place of P
        scores(Bool<Scores::DEFER && LENGTHS>{}).template dscores<MASKED>(s, dp, row0, col0, lse2, delta, terms);

        // ---- P∘Z·rp and dS to shared memory: dV and dK read them transposed, dQ as is
        store_frag<T, PTile>(sP, s, sdp_row0, sdp_col0);
        store_frag<T, PTile>(sdS, dp, sdp_row0, sdp_col0);
        __syncthreads();  // P, dS visible to every warp

        // ---- dV += (P∘Z·rp)ᵀ·dO
        warp_gemm<T, DKV_MT, DKV_NT, BLOCK_M / 16, PTile, true, QTile, true, false>(acc_dv, sP, dkv_row0,
                                                                                   sdO(stage), dkv_col0);
        // ---- dK += dSᵀ·Q (times softmax_scale at the end)
        warp_gemm<T, DKV_MT, DKV_NT, BLOCK_M / 16, PTile, true, QTile, true, false>(acc_dk, sdS, dkv_row0,
                                                                                   sQ(stage), dkv_col0);

        if (!two_stage && it + 1 < num_iters) {
            __syncthreads();  // every warp is done with Q, dO, lse, delta [it]
            load_query_block(it + 1, 0, seq_slot.load());
            cp_async_commit();
        }

        // ---- dQ += dS·K, summed over key blocks in dq_accum by fp32 atomics
        //      (times softmax_scale in flash_bwd_convert_dq_kernel), in column
        //      passes of DQ_PASS_COLS so dQ adds at most 32 live registers;
        //      rows past seqlen_q are not added (the row buffers have no padding)
        if constexpr (!DETERMINISTIC) {
            const SeqLens seq = seq_slot.load();
            float* dq_accum = p.dq_accum + query_row_index(p, b, h, seq, m0) * HEAD_DIM;
            const int rows_valid = seq.seqlen_q - m0;
#pragma unroll 1
            for (int c0 = dq_col0; c0 < dq_col0 + Tr::DQ_COLS; c0 += Tr::DQ_PASS_COLS) {
                float dq[DQ_MT][Tr::DQ_PASS_COLS / 8][4];
                clear(dq);
                warp_gemm<T, DQ_MT, Tr::DQ_PASS_COLS / 8, BLOCK_N / 16, PTile, false, KVTile, true, true>(
                    dq, sdS, dq_row0, sK, c0);
                atomic_add_frag(dq_accum, HEAD_DIM, dq, dq_row0, c0, rows_valid);
            }
        }
    };

    for (int it = 0; it < num_iters; ++it) {
        const int m = m_begin + it % nm;
        if (Mask<IS_CAUSAL, VARIANT>::WINDOW ? mb.masked(m) : m < m_masked_end) {
            step(it, Bool<true>{});
        } else {
            step(it, Bool<false>{});
        }
    }

    cp_async_wait<0>();
    __syncthreads();  // seq_slot stored (when the loop ran no step); every warp is done with sK, sV
    const SeqLens seq_end = seq_slot.load();

    // ---- epilogue, split GQA group: fp32 partials straight from registers
    if (p.kv_splits > 1) {
        const int64 part_rows = key_rows(p);  // rows of one split
        float* dk_part = p.dkv_accum + (split * part_rows + key_row_index(p, b, h_kv, seq_end, n0)) * HEAD_DIM;
        float* dv_part = dk_part + p.kv_splits * part_rows * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < DKV_MT; ++i) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int row = dkv_row0 + i * 16 + hh * 8 + g;
                if (row >= keys_valid) continue;
#pragma unroll
                for (int j = 0; j < DKV_NT; ++j) {
                    const int col = row * HEAD_DIM + dkv_col0 + j * 8 + 2 * t;
                    *reinterpret_cast<float2*>(dk_part + col) = make_float2(
                        acc_dk[i][j][2 * hh] * p.softmax_scale, acc_dk[i][j][2 * hh + 1] * p.softmax_scale);
                    *reinterpret_cast<float2*>(dv_part + col) =
                        make_float2(acc_dv[i][j][2 * hh], acc_dv[i][j][2 * hh + 1]);
                }
            }
        }
        return;
    }

    // ---- epilogue: dK·scale and dV to T, staged through sK/sV for 16-byte stores
    store_frag<T, KVTile>(sK, acc_dk, dkv_row0, dkv_col0, p.softmax_scale);
    store_frag<T, KVTile>(sV, acc_dv, dkv_row0, dkv_col0);
    __syncthreads();
    T* dk = static_cast<T*>(p.dk) + b * p.dk_batch_stride + h_kv * p.dk_head_stride +
            int64(seq_end.k_start + n0) * p.dk_row_stride;
    T* dv = static_cast<T*>(p.dv) + b * p.dv_batch_stride + h_kv * p.dv_head_stride +
            int64(seq_end.k_start + n0) * p.dv_row_stride;
    store_tile<T, BLOCK_N, HEAD_DIM, NT, VEC, EVEN_K>(dk, p.dk_row_stride, sK, keys_valid, p.head_dim);
    store_tile<T, BLOCK_N, HEAD_DIM, NT, VEC, EVEN_K>(dv, p.dv_row_stride, sV, keys_valid, p.head_dim);
}

// ---------------------------------------------------------------------------
// dQ without atomics (deterministic mode): one block per (query block, batch, head).
// ---------------------------------------------------------------------------
//
// Shaped like the forward: each warp owns BLOCK_M / NUM_WARPS query rows and
// every key of a tile, so dS never leaves registers: it is repacked from the
// dP accumulators into the A operand of dQ += dS·K. Q and dO stay in shared
// memory; K is double-buffered (S and dQ both read it), V single-buffered.
// Key blocks are summed in a fixed order, so dq is bitwise reproducible.
//
// Template parameters: T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, IS_CAUSAL,
// EVEN_K, VEC, VARIANT as for flash_bwd_dkdv_kernel.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int VARIANT_ = 0>
struct BwdDqTraits : BlockTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS * 32> {
    static constexpr int ROWS_PER_WARP = BLOCK_M / NUM_WARPS;
    static constexpr int M_TILES = ROWS_PER_WARP / 16;
    static constexpr int N_TILES = BLOCK_N / 8;
    static constexpr int D_TILES = HEAD_DIM / 8;
    using QTile = SmemTile<T, BLOCK_M, HEAD_DIM>;   // Q and dO
    using KVTile = SmemTile<T, BLOCK_N, HEAD_DIM>;  // K (two buffers) and V
    // (VAR_BIAS_STAGED) two buffers of the key block's bias/mask tile, beside K's
    static constexpr bool STAGED = (VARIANT_ & VAR_BIAS_STAGED) != 0;
    using Terms = typename Select<
        STAGED, StagedScoreTerms<VARIANT_, T, M_TILES, N_TILES, BLOCK_M, BwdDqTraits::NUM_THREADS>, ElementTerms>::type;
    static constexpr int SCORE_BYTES =
        ScoreStageBytes<STAGED, VARIANT_, T, BLOCK_M, BLOCK_N, BwdDqTraits::NUM_THREADS>::value;
    static constexpr int SMEM_BYTES = 2 * QTile::BYTES + 3 * KVTile::BYTES + 2 * SCORE_BYTES;

    static_assert(ROWS_PER_WARP % 16 == 0, "each warp owns whole m16 tiles");
    static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "k16 steps");
};

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool IS_CAUSAL, bool EVEN_K, bool VEC,
          int VARIANT>
__global__ void __launch_bounds__(NUM_WARPS * 32)
flash_bwd_dq_kernel(const BwdParams p) {
    using Tr = BwdDqTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, VARIANT>;
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    constexpr int NT = Tr::NUM_THREADS;
    constexpr int M_TILES = Tr::M_TILES, N_TILES = Tr::N_TILES, D_TILES = Tr::D_TILES;

    extern __shared__ __align__(16) unsigned char smem[];
    const uint32 sQ = smem_addr(smem);
    const uint32 sdO = sQ + QTile::BYTES;
    const uint32 sV = sdO + QTile::BYTES;
    auto sK = [&](int buf) { return sV + KVTile::BYTES + buf * KVTile::BYTES; };
    const uint32 sScore0 = sK(2);  // staged bias/mask tile of K's buffer buf at sScore0 + buf * SCORE_BYTES
    constexpr bool STAGED = Tr::STAGED;
    // The launch's dynamic shared memory is dispatch's (bwd_dq_smem_bytes): it must cover
    // this kernel's (checked where the staged tiles' size is new).
    if constexpr (STAGED) {
        if (threadIdx.x == 0 && dynamic_smem_bytes() < uint32(Tr::SMEM_BYTES)) __trap();
    }

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;

    // ---- which tile, its sequence and rows (query_grid.cuh)
    const DqBlock blk = dq_block<IS_CAUSAL>(p, BLOCK_M);
    if (blk.m0 >= blk.seq.seqlen_q) return;  // past the end of a shorter sequence of a packed batch
    const int b = blk.b, h = blk.h, m0 = blk.m0, rows_valid = blk.rows_valid;
    const SeqLens seq = blk.seq;
    const DqRows<T> rows = dq_rows<T>(p, blk);
    const T *q = rows.q, *dout = rows.dout, *k = rows.k, *v = rows.v;

    // The variant's mask, scores and dropout for (b, h) (variant.cuh), and the key blocks
    // these rows see: [blocks.begin, blocks.end), those outside [blocks.unmasked_begin,
    // blocks.unmasked_end) masked.
    using Scores = BwdScores<IS_CAUSAL, VARIANT, T>;
    const Scores scores(p.var, p.softmax_scale_log2, b, h, p.nheads_q, seq.seqlen_q, seq.seqlen_k);
    const BlockRange blocks = scores.mask.key_blocks(m0, BLOCK_M, BLOCK_N);

    // Per-thread fragment rows: row r0 + 16 i (+ 8) of this block; their lse_log2
    // and delta (0 past seqlen_q, like Q and dO: see the top of this file).
    const int r0 = warp * Tr::ROWS_PER_WARP + g;
    // the bias and mask of a key block: staged with K (in its buffer), or ElementTerms
    [[maybe_unused]] typename Tr::Terms terms(scores.mod, b, h, m0, r0, sScore0);
    const int64 row_index0 = query_row_index(p, b, h, seq, m0);
    float lse2[M_TILES][2], delta[M_TILES][2];
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = r0 + i * 16 + hh * 8;
            lse2[i][hh] = r < rows_valid ? p.lse_log2[row_index0 + r] : 0.f;
            delta[i][hh] = r < rows_valid ? p.delta[row_index0 + r] : 0.f;
        }
    }

    float acc_dq[M_TILES][D_TILES][4];
    clear(acc_dq);

    auto load_kv = [&](uint32 dst, const T* src, int64 row_stride, int n) {
        load_tile_lean<T, BLOCK_N, HEAD_DIM, NT, VEC, EVEN_K>(dst, src + int64(n) * BLOCK_N * row_stride, row_stride,
                                                         seq.seqlen_k - n * BLOCK_N, p.head_dim);
    };

    if (blocks.begin < blocks.end) {
        load_tile_lean<T, BLOCK_M, HEAD_DIM, NT, VEC, EVEN_K>(sQ, q, p.q_row_stride, rows_valid, p.head_dim);
        load_tile_lean<T, BLOCK_M, HEAD_DIM, NT, VEC, EVEN_K>(sdO, dout, p.do_row_stride, rows_valid, p.head_dim);
        load_kv(sK(0), k, p.k_row_stride, blocks.end - 1);
        if constexpr (STAGED) terms.stage_in(blocks.end - 1, 0);
        cp_async_commit();
    }

    // One key block, n descending from blocks.end - 1: K[n] is in sK((blocks.end - 1 - n) % 2).
    auto step = [&](int n, auto masked) {
        constexpr bool MASKED = decltype(masked)::value;
        const int buf = (blocks.end - 1 - n) & 1;
        cp_async_wait<0>();
        __syncthreads();  // K[n] landed; every warp is done with V[n+1] and K[n+1]
        load_kv(sV, v, p.v_row_stride, n);
        cp_async_commit();
        if (n > blocks.begin) {
            load_kv(sK(buf ^ 1), k, p.k_row_stride, n - 1);
            if constexpr (STAGED) terms.stage_in(n - 1, buf ^ 1);
        }
        cp_async_commit();  // possibly empty: wait<1> below then still means "V landed"

        // ---- S = Q·Kᵀ
        float s[M_TILES][N_TILES][4];
        clear(s);
        warp_gemm<T, M_TILES, N_TILES, HEAD_DIM / 16, QTile, false, KVTile, false, true>(
            s, sQ, warp * Tr::ROWS_PER_WARP, sK(buf), 0);

        // ---- P = prob(x, lse·log2e), x the variant's masked score: 0 where masked (x = -inf)
        //      or lse_log2 = +inf (with softcap: in dscores below, from the raw S)
        const int col0 = n * BLOCK_N + 2 * t;  // this lane's first key column
        auto lse2_of = [&](int i, int hh) { return lse2[i][hh]; };
        auto delta_of = [&](int i, int hh) { return delta[i][hh]; };
        auto make_terms = [&]() {
            if constexpr (STAGED) {
                terms.template load<MASKED>(0, buf);
                return terms;
            } else {
                return ElementTerms{};
            }
        };
        const auto step_terms = make_terms();
        if constexpr (!Scores::DEFER) scores.template probs<MASKED>(s, m0 + r0, col0, lse2_of, step_terms);

        cp_async_wait<1>();
        __syncthreads();  // V[n] landed

        // ---- dP = dO·Vᵀ
        float dp[M_TILES][N_TILES][4];
        clear(dp);
        warp_gemm<T, M_TILES, N_TILES, HEAD_DIM / 16, QTile, false, KVTile, false, true>(
            dp, sdO, warp * Tr::ROWS_PER_WARP, sV, 0);

        // ---- dS = P∘(dP∘Z·rp − delta) (∘ (1 − tanh²) with softcap), repacked as the A
        //      operand of dS·K (s becomes P∘Z·rp, unused here)
        scores.template dscores<MASKED>(s, dp, m0 + r0, col0, lse2_of, delta_of, step_terms);
        uint32 ds[M_TILES][BLOCK_N / 16][4];
        pack_a<T>(ds, dp);

        // ---- dQ += dS·K
        warp_gemm_areg<T, M_TILES, D_TILES, BLOCK_N / 16, KVTile, true>(acc_dq, ds, sK(buf), 0);
    };

    // Masked key blocks (key tail, causal diagonal, the window's right edge) first, then
    // the bulk with no mask code, then the masked blocks of the window's left edge (a loop
    // compiled only with a window).
    int n = blocks.end - 1;
    for (; n >= blocks.unmasked_end; --n) step(n, Bool<true>{});
    for (; n >= blocks.unmasked_begin; --n) step(n, Bool<false>{});
    if constexpr (Mask<IS_CAUSAL, VARIANT>::WINDOW) {
        for (; n >= blocks.begin; --n) step(n, Bool<true>{});
    }

    // ---- epilogue: dq = scale·dQ in T, staged through sQ for 16-byte stores
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with sQ
    store_frag<T, QTile>(sQ, acc_dq, warp * Tr::ROWS_PER_WARP, 0, p.softmax_scale);
    __syncthreads();
    T* dq = static_cast<T*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride +
            int64(seq.q_start + m0) * p.dq_row_stride;
    store_tile<T, BLOCK_M, HEAD_DIM, NT, VEC, EVEN_K>(dq, p.dq_row_stride, sQ, rows_valid, p.head_dim);
}

// ---------------------------------------------------------------------------
// Convert (default mode): dq = softmax_scale·dq_accum in T. One warp per query
// row of the row buffers (packed: one head, all total_q rows). SWIZZLED: dq_accum
// in flash_bwd_ws.cu's layout (bwd_rows.cuh dq_accum_piece).
// ---------------------------------------------------------------------------
template <typename T, bool VEC, bool SWIZZLED>
__global__ void __launch_bounds__(256)
flash_bwd_convert_dq_kernel(const BwdParams p) {
    static_assert(VEC || !SWIZZLED, "the ws backward, the only writer of that layout, takes aligned data only");
    const int64 rows = query_rows(p);
    const int64 row = int64(blockIdx.x) * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int rows_per_head = query_rows_per_head(p);
    const int m = int(row % rows_per_head);
    const int bh = int(row / rows_per_head);
    const int b = bh / p.nheads_q, h = bh % p.nheads_q;  // b = 0 when packed (batch strides are 0)
    const float* src = p.dq_accum + row * p.head_dim_padded;
    T* dst = static_cast<T*>(p.dq) + b * p.dq_batch_stride + int64(m) * p.dq_row_stride + h * p.dq_head_stride;
    const float scale = p.softmax_scale;
    if constexpr (VEC) {
        // one 16-byte chunk (8 elements) per lane covers head_dim <= 256
        if (lane * 8 < p.head_dim) {
            const int piece = SWIZZLED ? dq_accum_piece(lane, m) : lane;
            const float4 x0 = reinterpret_cast<const float4*>(src)[2 * piece];
            const float4 x1 = reinterpret_cast<const float4*>(src)[2 * piece + 1];
            *reinterpret_cast<uint4*>(dst + lane * 8) = make_uint4(
                TypeTraits<T>::pack(x0.x * scale, x0.y * scale), TypeTraits<T>::pack(x0.z * scale, x0.w * scale),
                TypeTraits<T>::pack(x1.x * scale, x1.y * scale), TypeTraits<T>::pack(x1.z * scale, x1.w * scale));
        }
    } else {
        for (int c = lane; c < p.head_dim; c += 32) dst[c] = TypeTraits<T>::from_float(src[c] * scale);
    }
}

// ---------------------------------------------------------------------------
// Convert (GQA split): dk, dv = sum over splits of the fp32 partials, in T.
// One warp per (batch, KV head, key) row, both tensors (packed: one head, all total_k rows).
// ---------------------------------------------------------------------------
template <typename T, bool VEC>
__global__ void __launch_bounds__(256)
flash_bwd_convert_dkv_kernel(const BwdParams p) {
    const int64 rows = key_rows(p);  // rows of one split
    const int64 row = int64(blockIdx.x) * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int rows_per_head = key_rows_per_head(p);
    const int n = int(row % rows_per_head);
    const int bh = int(row / rows_per_head);
    const int b = bh / p.nheads_kv, h = bh % p.nheads_kv;  // b = 0 when packed (batch strides are 0)
    const int64 split_stride = rows * p.head_dim_padded;
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        const float* src = p.dkv_accum + (int64(which) * p.kv_splits * rows + row) * p.head_dim_padded;
        T* dst = which == 0
                     ? static_cast<T*>(p.dk) + b * p.dk_batch_stride + int64(n) * p.dk_row_stride + h * p.dk_head_stride
                     : static_cast<T*>(p.dv) + b * p.dv_batch_stride + int64(n) * p.dv_row_stride + h * p.dv_head_stride;
        if constexpr (VEC) {
            // one 16-byte chunk (8 elements) per lane covers head_dim <= 256
            if (lane * 8 < p.head_dim) {
                float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                for (int s = 0; s < p.kv_splits; ++s) {
                    const float4 x0 = reinterpret_cast<const float4*>(src + s * split_stride)[2 * lane];
                    const float4 x1 = reinterpret_cast<const float4*>(src + s * split_stride)[2 * lane + 1];
                    x[0] += x0.x; x[1] += x0.y; x[2] += x0.z; x[3] += x0.w;
                    x[4] += x1.x; x[5] += x1.y; x[6] += x1.z; x[7] += x1.w;
                }
                *reinterpret_cast<uint4*>(dst + lane * 8) =
                    make_uint4(TypeTraits<T>::pack(x[0], x[1]), TypeTraits<T>::pack(x[2], x[3]),
                               TypeTraits<T>::pack(x[4], x[5]), TypeTraits<T>::pack(x[6], x[7]));
            }
        } else {
            for (int c = lane; c < p.head_dim; c += 32) {
                float x = 0.f;
                for (int s = 0; s < p.kv_splits; ++s) x += src[s * split_stride + c];
                dst[c] = TypeTraits<T>::from_float(x);
            }
        }
    }
}

}  // namespace cupyflash
