// flash_decode.cu: attention of a few new query rows against a KV cache --
// decoding, speculative decoding, chunked prefill -- at memory bandwidth.
//
// Three ideas make it a bandwidth kernel rather than the prefill kernel with one row:
//   * Packed GQA (FlashAttention-3's pack_gqa): the `group` query heads that
//     share a KV head, times the seqlen_q query rows, are the rows of one tile
//     (packed row r = q_row * group + head - h_kv * group), so each K/V byte is
//     read from memory once per KV head, not once per query head.
//   * Split over the keys: each block takes 1/num_splits of its sequence's key
//     tiles (computed on the device from the sequence's own length), so small
//     batches still fill the SMs; flash_decode_combine_kernel merges the fp32
//     partials by their lse.
//   * Warps split the keys, not the rows, when there are few rows: the
//     WARPS_M x WARPS_N warps of a block each own 16 packed rows and
//     BLOCK_N / WARPS_N keys of every tile, with their own online softmax, and
//     the WARPS_N partial results are merged through shared memory at the end.
//     A column of WARPS_M warps shares its K/V rows and synchronises only
//     within itself (a named barrier; __syncwarp for one warp), so a decode
//     block has no block-wide barrier in its key loop.
// K/V tiles stream through a STAGES-deep cp.async ring. The cache is dense (row
// cache_batch_idx[b] or b) or paged (block_table[b][key / page_size], looked up
// per key row as the tile is loaded); out-of-range device indices and lengths
// are clamped into the cache, never read out of bounds. Appended keys (k_new, v_new) are
// read from k_new/v_new directly and copied into the cache slots by the same
// blocks, so the append costs no extra pass.
//
// Template parameters, in order:
//   T           __half or __nv_bfloat16
//   HEAD_DIM    padded head dimension (multiple of 16); runtime head_dim <= HEAD_DIM
//   BLOCK_N     keys per tile;  WARPS_M x WARPS_N  the warp grid;  STAGES  ring depth
//   IS_CAUSAL   bottom-right aligned causal mask (per sequence)
//   PAGED       block_table lookup
//   VEC         16-byte loads are legal
//   VARIANT     the variants switched on (variant.cuh's VAR_* bits; no dropout here; a
//               bias or mask with none of their qualifier bits: see below)
// Variants act per packed row: row r is query row r / group of head h_kv * group
// + r % group, so its mask (causal, window), its ALiBi slope, its sink and its
// bias and mask row (b, head, q_row, key j: the key's position in the sequence,
// whatever cache slot holds it) are its own. The bias and mask are read element by
// element at their strides (ScoreMod), never staged or in pairs: each packed row
// reads one element per key, against the 2 * head_dim K/V elements of that key
// that the block's rows share. The block visits only the key tiles some row of it sees (a window over a
// long cache reads ~window keys), and the splits share those tiles. A sink joins
// each row's softmax once: in warp column 0 of split 0, whose running max starts
// there; the warp merge and the combine then carry it in that partial's lse.
// head_dim < HEAD_DIM is a run-time predicate on the columns (no EVEN_K
// variants: in a kernel bound by memory it costs nothing measurable).
#include "params.cuh"
#include "ptx.cuh"
#include "tile_io.cuh"
#include "warp_mma.cuh"
#include "variant.cuh"
#include "online_softmax.cuh"

namespace cupyflash {

template <typename T_, int HEAD_DIM_, int BLOCK_N_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct DecodeTraits {
    using T = T_;
    static constexpr int HEAD_DIM = HEAD_DIM_, BLOCK_N = BLOCK_N_, STAGES = STAGES_;
    static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_;
    static constexpr int NUM_THREADS = WARPS_M * WARPS_N * 32;
    static constexpr int COLUMN_THREADS = WARPS_M * 32;   // the warps sharing one key range
    static constexpr int BLOCK_M = 16 * WARPS_M;          // packed rows per block
    static constexpr int WARP_KEYS = BLOCK_N / WARPS_N;   // keys of a tile per warp
    static constexpr int N_TILES = WARP_KEYS / 8;
    static constexpr int D_TILES = HEAD_DIM / 8;
    using QTile = SmemTile<T, BLOCK_M, HEAD_DIM>;
    using KVTile = SmemTile<T, BLOCK_N, HEAD_DIM>;
    static constexpr int STAGE_BYTES = 2 * KVTile::BYTES;  // K then V
    // The epilogue reuses the ring: WARPS_N lse rows, then WARPS_N - 1 fp32 O tiles
    // (rows padded by 8 floats: conflict-free float2 stores).
    static constexpr int O_STRIDE = HEAD_DIM + 8;
    static constexpr int MERGE_BYTES = WARPS_N * BLOCK_M * 4 + (WARPS_N - 1) * BLOCK_M * O_STRIDE * 4;
    static constexpr int SMEM_BYTES = QTile::BYTES + STAGES * STAGE_BYTES;

    static_assert(WARP_KEYS % 16 == 0, "each warp takes whole k16 steps of P·V");
    static_assert(HEAD_DIM % 16 == 0, "k16 steps of Q·Kᵀ");
    static_assert(STAGES >= 2, "a ring has at least two slots");
    static_assert(MERGE_BYTES <= STAGES * STAGE_BYTES, "the warp merge fits in the ring");
};

// Where the keys of one (sequence, KV head) live: key j < cache_len in the cache
// (paged or dense), keys from cache_len on in k_new / v_new.
template <typename T, bool PAGED>
struct KvSource {
    const T* k;     // dense: the sequence's cache row at this head; paged: the pool at this head
    const T* v;
    const T* k_new;  // this sequence's new rows at this head
    const T* v_new;
    const int* table;  // paged: this sequence's block_table row
    int64 k_block_stride, v_block_stride, k_row_stride, v_row_stride, knew_row_stride, vnew_row_stride;
    int cache_len, page_size, page_shift, cache_rows;

    // Page and slot of cache key j: shifts for a power-of-two page_size (a
    // division by a run-time value costs ~20 instructions per key row).
    __device__ __forceinline__ int page_of(int j) const {
        return page_shift >= 0 ? j >> page_shift : j / page_size;
    }
    __device__ __forceinline__ int slot_of(int j) const {
        return page_shift >= 0 ? j & (page_size - 1) : j - (j / page_size) * page_size;
    }
    // The block holding cache key j (paged), clamped into the pool: one index load per key row.
    __device__ __forceinline__ int block_of(int j) const {
        return min(max(__ldg(table + page_of(j)), 0), cache_rows - 1);
    }

    // Pointers to key j's K and V rows (j >= 0 and below the sequence's length);
    // block: block_of(j), fetched ahead (paged caches only).
    __device__ __forceinline__ void locate(int j, int block, const T*& kp, const T*& vp) const {
        if (j >= cache_len) {
            kp = k_new + int64(j - cache_len) * knew_row_stride;
            vp = v_new + int64(j - cache_len) * vnew_row_stride;
            return;
        }
        if constexpr (PAGED) {
            const int slot = slot_of(j);
            kp = k + block * k_block_stride + int64(slot) * k_row_stride;
            vp = v + block * v_block_stride + int64(slot) * v_row_stride;
        } else {
            kp = k + int64(j) * k_row_stride;
            vp = v + int64(j) * v_row_stride;
        }
    }
};

// The cache slot of key j (j >= cache_len: a slot the append writes).
template <typename T, bool PAGED>
__device__ __forceinline__ T* cache_slot(T* base, const KvSource<T, PAGED>& src, int64 block_stride,
                                         int64 row_stride, int j) {
    if constexpr (PAGED) {
        return base + src.block_of(j) * block_stride + int64(src.slot_of(j)) * row_stride;
    } else {
        return base + int64(j) * row_stride;
    }
}

template <typename T, int HEAD_DIM, int BLOCK_N, int WARPS_M, int WARPS_N, int STAGES,
          bool IS_CAUSAL, bool PAGED, bool VEC, int VARIANT>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32, 1)
flash_decode_kernel(const DecodeParams p) {
    using Tr = DecodeTraits<T, HEAD_DIM, BLOCK_N, WARPS_M, WARPS_N, STAGES>;
    constexpr int BLOCK_M = Tr::BLOCK_M, WARP_KEYS = Tr::WARP_KEYS;
    constexpr int N_TILES = Tr::N_TILES, D_TILES = Tr::D_TILES;
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;

    extern __shared__ __align__(16) unsigned char smem[];
    const uint32 sQ = smem_addr(smem);
    const uint32 ring = sQ + QTile::BYTES;

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;  // the warps of column wn share its key rows
    const int g = lane / 4, t = lane % 4;

    // ---- scheduler: (row block, split) fastest, so the row blocks of one KV head run together (L2)
    const int m_block = blockIdx.x % p.num_m_blocks;
    const int split = blockIdx.x / p.num_m_blocks;
    const int h_kv = blockIdx.y, b = blockIdx.z;
    const int rows = p.seqlen_q * p.group;  // packed rows of this (sequence, KV head)
    const int m0 = m_block * BLOCK_M;

    // A device length the host never saw is clamped into the cache (as are device indices).
    const int cache_len = min(max(p.cache_seqlens == nullptr ? int(p.cache_seqlen) : __ldg(p.cache_seqlens + b), 0),
                              p.capacity - p.seqlen_new);
    const int seqlen_k = cache_len + p.seqlen_new;

    // Key tiles: causal rows see keys up to q_row + seqlen_k - seqlen_q. With a window,
    // the block's query rows q_first .. q_last (packed r -> r / group) see keys
    // [mask.col_begin(q_first), mask.col_end(q_last)) between them, and every one of
    // them keys [col_begin(q_last), col_end(q_first)). The splits share the visited tiles.
    using MaskT = Mask<IS_CAUSAL, VARIANT>;
    // (made where a variant needs it: an unused Mask still moves the plain kernel's code)
    auto make_mask = [&]() { return MaskT(p.var, p.seqlen_q, seqlen_k); };
    const int diag = seqlen_k - p.seqlen_q;
    int visible = seqlen_k;
    if (IS_CAUSAL) visible = min(visible, max(0, (min(rows, m0 + BLOCK_M) - 1) / p.group + 1 + diag));
    if constexpr (MaskT::WINDOW) visible = make_mask().col_end((min(rows, m0 + BLOCK_M) - 1) / p.group);
    const int n_tiles_all = rows == 0 ? 0 : ceil_div(visible, BLOCK_N);  // rows 0: append only
    int n_first = 0;
    if constexpr (MaskT::WINDOW) n_first = min(make_mask().col_begin(m0 / p.group) / BLOCK_N, n_tiles_all);
    const int per_split = ceil_div(n_tiles_all - n_first, p.num_splits);
    const int n_begin = min(n_first + split * per_split, n_tiles_all);
    const int n_end = min(n_begin + per_split, n_tiles_all);
    int unmasked = seqlen_k;  // keys every row of the block sees
    if (IS_CAUSAL) unmasked = min(unmasked, max(0, m0 / p.group + 1 + diag));
    if constexpr (MaskT::WINDOW) unmasked = make_mask().col_end(m0 / p.group);
    const int n_unmasked_end = max(n_begin, min(n_end, unmasked / BLOCK_N));
    // window: the tiles below n_unmasked_begin hold keys before the last row's left edge (masked again)
    int n_unmasked_begin = n_begin;
    if constexpr (MaskT::WINDOW) {
        const int last_row_begin = make_mask().col_begin((min(rows, m0 + BLOCK_M) - 1) / p.group);
        n_unmasked_begin = min(max(n_begin, ceil_div(last_row_begin, BLOCK_N)), n_unmasked_end);
    }
    const int n_tiles = n_end - n_begin;

    KvSource<T, PAGED> src;
    {
        const int row = PAGED ? 0
                              : min(max(p.cache_batch_idx == nullptr ? b : __ldg(p.cache_batch_idx + b), 0),
                                    p.cache_rows - 1);
        src.k = static_cast<const T*>(p.k_cache) + row * p.k_batch_stride + h_kv * p.k_head_stride;
        src.v = static_cast<const T*>(p.v_cache) + row * p.v_batch_stride + h_kv * p.v_head_stride;
        src.k_new = static_cast<const T*>(p.k_new) + b * p.knew_batch_stride + h_kv * p.knew_head_stride;
        src.v_new = static_cast<const T*>(p.v_new) + b * p.vnew_batch_stride + h_kv * p.vnew_head_stride;
        src.table = p.block_table + b * p.block_table_batch_stride;
        src.k_block_stride = p.k_batch_stride;
        src.v_block_stride = p.v_batch_stride;
        src.k_row_stride = p.k_row_stride;
        src.v_row_stride = p.v_row_stride;
        src.knew_row_stride = p.knew_row_stride;
        src.vnew_row_stride = p.vnew_row_stride;
        src.cache_len = cache_len;
        src.page_size = p.page_size;
        src.page_shift = p.page_shift;
        src.cache_rows = p.cache_rows;
    }

    // ---- loads. Q: packed row r is query row r / group of head h_kv * group + r % group.
    constexpr int CHUNKS = QTile::CHUNKS;
    auto load_q = [&]() {
        const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride;
#pragma unroll
        for (int idx = threadIdx.x; idx < BLOCK_M * CHUNKS; idx += Tr::NUM_THREADS) {
            const int r = idx / CHUNKS, chunk = idx % CHUNKS;
            const int pr = m0 + r;
            const T* row = q + int64(pr / p.group) * p.q_row_stride +
                           int64(h_kv * p.group + pr % p.group) * p.q_head_stride;
            load_chunk<T, VEC, false>(sQ + QTile::offset(r, chunk), row + chunk * 8, q, pr < rows, chunk,
                                       p.head_dim);
        }
    };
    // This column's WARP_KEYS rows of key tile n into ring slot `slot`. Paged: the
    // rows' blocks were fetched into registers by the previous load (tiles load in
    // descending order), and this load fetches tile n - 1's, so no load waits on
    // an index.
    using KvMap = TileMap<T, WARP_KEYS, HEAD_DIM, Tr::COLUMN_THREADS>;
    const int kv_row0 = (wm * 32 + lane) / KvMap::THREADS_PER_ROW;
    const int kv_chunk0 = (wm * 32 + lane) % KvMap::THREADS_PER_ROW;
    int blocks[PAGED ? KvMap::ITERS : 1];
    auto fetch_blocks = [&](int n) {
        if constexpr (PAGED) {
            const int j0 = n * BLOCK_N + wn * WARP_KEYS;  // this column's first key of tile n
            if (p.page_size % WARP_KEYS == 0) {  // its keys share one page: one index load
                const int block = n >= 0 && j0 < cache_len ? src.block_of(j0) : 0;
#pragma unroll
                for (int it = 0; it < KvMap::ITERS; ++it) blocks[it] = block;
            } else {
#pragma unroll
                for (int it = 0; it < KvMap::ITERS; ++it) {
                    const int j = j0 + kv_row0 + it * KvMap::ROWS_PER_IT;
                    blocks[it] = n >= 0 && j < cache_len ? src.block_of(j) : 0;
                }
            }
        }
    };
    auto load_kv = [&](int n, int slot) {
        const uint32 sK = ring + slot * Tr::STAGE_BYTES + KVTile::offset(wn * WARP_KEYS, 0);
        const uint32 sV = sK + KVTile::BYTES;
#pragma unroll
        for (int it = 0; it < KvMap::ITERS; ++it) {
            const int r = kv_row0 + it * KvMap::ROWS_PER_IT;
            const int j = n * BLOCK_N + wn * WARP_KEYS + r;
            const bool valid = j < seqlen_k;
            const T *kp = src.k, *vp = src.v;
            if (valid) src.locate(j, blocks[PAGED ? it : 0], kp, vp);
#pragma unroll
            for (int c = 0; c < KvMap::CHUNKS_PER_THREAD; ++c) {
                const int chunk = kv_chunk0 + c * KvMap::THREADS_PER_ROW;
                load_chunk<T, VEC, false>(sK + KVTile::offset(r, chunk), kp + chunk * 8, src.k, valid, chunk,
                                          p.head_dim);
                load_chunk<T, VEC, false>(sV + KVTile::offset(r, chunk), vp + chunk * 8, src.v, valid, chunk,
                                          p.head_dim);
            }
        }
        fetch_blocks(n - 1);
    };
    auto column_barrier = [&]() {
        if constexpr (WARPS_M == 1) {
            __syncwarp();
        } else {
            asm volatile("bar.sync %0, %1;\n" :: "r"(1 + wn), "n"(Tr::COLUMN_THREADS) : "memory");
        }
    };

    // Tiles are visited from the last (masked: tail, causal diagonal) down; visit i is tile n_end - 1 - i.
    if (n_tiles > 0) {
        load_q();
        fetch_blocks(n_end - 1);
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_tiles) load_kv(n_end - 1 - s, s);
        cp_async_commit();  // one group per slot, empty or not, so wait_group counts stay uniform
    }

    if (p.seqused_k_out != nullptr && blockIdx.x == 0 && h_kv == 0 && threadIdx.x == 0) p.seqused_k_out[b] = seqlen_k;

    // ---- the append: the blocks of this (sequence, KV head) share the new rows round-robin
    if (p.seqlen_new > 0) {
        T* k_cache = const_cast<T*>(src.k);
        T* v_cache = const_cast<T*>(src.v);
        const int pieces = p.seqlen_new * CHUNKS;  // (new row, chunk) pairs
        const int stride = p.num_m_blocks * p.num_splits * Tr::NUM_THREADS;
        for (int idx = blockIdx.x * Tr::NUM_THREADS + threadIdx.x; idx < pieces; idx += stride) {
            const int i = idx / CHUNKS, chunk = idx % CHUNKS;
            if (chunk * 8 >= p.head_dim) continue;
            const int j = cache_len + i;
            T* kd = cache_slot(k_cache, src, p.k_batch_stride, p.k_row_stride, j) + chunk * 8;
            T* vd = cache_slot(v_cache, src, p.v_batch_stride, p.v_row_stride, j) + chunk * 8;
            const T* ks = src.k_new + int64(i) * p.knew_row_stride + chunk * 8;
            const T* vs = src.v_new + int64(i) * p.vnew_row_stride + chunk * 8;
            if constexpr (VEC) {
                *reinterpret_cast<uint4*>(kd) = __ldg(reinterpret_cast<const uint4*>(ks));
                *reinterpret_cast<uint4*>(vd) = __ldg(reinterpret_cast<const uint4*>(vs));
            } else {
                for (int e = 0; e < min(8, p.head_dim - chunk * 8); ++e) {
                    kd[e] = ks[e];
                    vd[e] = vs[e];
                }
            }
        }
    }

    // ---- mainloop
    float acc_o[1][D_TILES][4];
    float acc_l[1][4];  // P·1 on the Tensor Cores (online_softmax.cuh)
    clear(acc_o);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_l[0][e] = 0.f;
    OnlineSoftmax<1> softmax;
    softmax.init();
    const int r_lane = m0 + wm * 16 + g;  // packed rows r_lane and r_lane + 8 of this thread
    // Variants (made only where one needs them: even unused, they move the plain kernel's code).
    // Row r_lane + 8 h is of head head_of(h), with its own score modifier (ALiBi slope).
    auto head_of = [&](int h) { return h_kv * p.group + (r_lane + 8 * h) % p.group; };
    auto make_mod = [&](int h) {
        return ScoreMod<VARIANT, T>(p.var, p.softmax_scale_log2, b, head_of(h), p.seqlen_q, seqlen_k);
    };
    // The sink joins the rows' softmax in one partial: warp column 0 of split 0.
    constexpr bool SINKS = (VARIANT & VAR_SINKS) != 0;
    if constexpr (SINKS) {
        if (split == 0 && wn == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) softmax.row_max[0][h] = sink_log2<VARIANT>(p.var, head_of(h));
        }
    }

    auto step = [&](int i, auto masked) {
        const int n = n_end - 1 - i;
        if (i == 0) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();  // Q (whole block) and slot 0 landed
        } else {
            cp_async_wait<STAGES - 2>();
            column_barrier();  // tile i landed; the column is done with slot (i - 1) % STAGES
        }
        if (i + STAGES - 1 < n_tiles) load_kv(n - (STAGES - 1), (i + STAGES - 1) % STAGES);
        cp_async_commit();

        const uint32 sK = ring + (i % STAGES) * Tr::STAGE_BYTES;
        const uint32 sV = sK + KVTile::BYTES;
        float s[1][N_TILES][4];
        clear(s);
        warp_gemm<T, 1, N_TILES, HEAD_DIM / 16, QTile, false, KVTile, false, (HEAD_DIM > 128)>(s, sQ, wm * 16, sK,
                                                                                   wn * WARP_KEYS);
        if constexpr (VARIANT == 0) {
            if constexpr (decltype(masked)::value) {
                int limit[1][2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    limit[0][h] = seqlen_k;
                    if (IS_CAUSAL) limit[0][h] = min(limit[0][h], max(0, (r_lane + 8 * h) / p.group + 1 + diag));
                }
                apply_col_limits<1, N_TILES>(s, n * BLOCK_N + wn * WARP_KEYS + 2 * t, limit);
            }
#pragma unroll
            for (int j = 0; j < N_TILES; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[0][j][e] *= p.softmax_scale_log2;  // log2 units (online_softmax.cuh)
        } else {  // the variant's scores in log2 units, masked per row (each its own query row)
            const int rows_q[2] = {r_lane / p.group, (r_lane + 8) / p.group};
            score_tile_rows<decltype(masked)::value>(s, make_mod(0), make_mod(1), make_mask(), rows_q,
                                                     n * BLOCK_N + wn * WARP_KEYS + 2 * t);
        }
        softmax.update(s, acc_o, acc_l);
        uint32 pa[1][WARP_KEYS / 16][4];
        pack_a<T, 1, WARP_KEYS / 16>(pa, s);
#pragma unroll
        for (int kk = 0; kk < WARP_KEYS / 16; ++kk)
            mma_m16n8k16<T>(acc_l[0], pa[0][kk], TypeTraits<T>::ONE_PAIR, TypeTraits<T>::ONE_PAIR);
        warp_gemm_areg<T, 1, D_TILES, WARP_KEYS / 16, KVTile, true>(acc_o, pa,
                                                                    sV + KVTile::offset(wn * WARP_KEYS, 0), 0);
    };
    // Masked tiles (tail, causal diagonal, window's right edge) first, then the bulk
    // with no mask code, then the masked tiles of the window's left edge.
    const int n_masked = n_end - n_unmasked_end;
    int i = 0;
    for (; i < n_masked; ++i) step(i, Bool<true>{});
    for (; i < (MaskT::WINDOW ? n_end - n_unmasked_begin : n_tiles); ++i) step(i, Bool<false>{});
    if constexpr (MaskT::WINDOW) {
        for (; i < n_tiles; ++i) step(i, Bool<true>{});
    }
    cp_async_wait<0>();

    // ---- epilogue: merge the WARPS_N warps of a row block (their lse), then write
    if constexpr (SINKS) {
        if (split == 0 && wn == 0) add_sink_term<VARIANT>(acc_l, softmax.row_max, p.var, head_of(0), head_of(1));
    }
    float lse[1][2];
    softmax.finalize(acc_o, acc_l, lse);
    if constexpr (WARPS_N > 1) {
        float* s_lse = reinterpret_cast<float*>(smem + QTile::BYTES);  // [WARPS_N][BLOCK_M]
        float* s_o = s_lse + WARPS_N * BLOCK_M;                         // [WARPS_N - 1][BLOCK_M][O_STRIDE]
        __syncthreads();  // every warp is done with the ring
        if (t == 0) {
            s_lse[wn * BLOCK_M + wm * 16 + g] = lse[0][0];
            s_lse[wn * BLOCK_M + wm * 16 + g + 8] = lse[0][1];
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = wm * 16 + g + 8 * h;
            float m = NEG_INF;
#pragma unroll
            for (int w = 0; w < WARPS_N; ++w) m = fmaxf(m, s_lse[w * BLOCK_M + row]);
            float sum = 0.f;
            if (m != NEG_INF) {
#pragma unroll
                for (int w = 0; w < WARPS_N; ++w) sum += __expf(s_lse[w * BLOCK_M + row] - m);
            }
            const float total = sum > 0.f ? m + __logf(sum) : NEG_INF;
            const float weight = lse[0][h] == NEG_INF ? 0.f : __expf(lse[0][h] - total);
            lse[0][h] = total;
#pragma unroll
            for (int d = 0; d < D_TILES; ++d) {
                acc_o[0][d][2 * h] *= weight;
                acc_o[0][d][2 * h + 1] *= weight;
            }
            if (wn > 0) {
                float* dst = s_o + ((wn - 1) * BLOCK_M + row) * Tr::O_STRIDE + 2 * t;
#pragma unroll
                for (int d = 0; d < D_TILES; ++d)
                    *reinterpret_cast<float2*>(dst + d * 8) = make_float2(acc_o[0][d][2 * h], acc_o[0][d][2 * h + 1]);
            }
        }
        __syncthreads();
        if (wn > 0) return;
#pragma unroll
        for (int w = 1; w < WARPS_N; ++w) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float* from = s_o + ((w - 1) * BLOCK_M + wm * 16 + g + 8 * h) * Tr::O_STRIDE + 2 * t;
#pragma unroll
                for (int d = 0; d < D_TILES; ++d) {
                    const float2 o = *reinterpret_cast<const float2*>(from + d * 8);
                    acc_o[0][d][2 * h] += o.x;
                    acc_o[0][d][2 * h + 1] += o.y;
                }
            }
        }
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r_lane + 8 * h;
        if (r >= rows) continue;
        const int q_row = r / p.group, head = h_kv * p.group + r % p.group;
        if (p.num_splits > 1) {
            const int64 index = ((int64(split) * p.batch + b) * p.nheads_q + head) * p.seqlen_q + q_row;
            if (t == 0) p.lse_accum[index] = lse[0][h];
            float* o = p.out_accum + index * HEAD_DIM + 2 * t;
#pragma unroll
            for (int d = 0; d < D_TILES; ++d)
                *reinterpret_cast<float2*>(o + d * 8) = make_float2(acc_o[0][d][2 * h], acc_o[0][d][2 * h + 1]);
        } else {
            if (t == 0) p.lse[(int64(b) * p.nheads_q + head) * p.seqlen_q + q_row] = lse[0][h];
            T* o = static_cast<T*>(p.out) + b * p.o_batch_stride + q_row * p.o_row_stride + head * p.o_head_stride;
#pragma unroll
            for (int d = 0; d < D_TILES; ++d) {
                const int col = d * 8 + 2 * t;
                if (col >= p.head_dim) continue;
                const uint32 pair = TypeTraits<T>::pack(acc_o[0][d][2 * h], acc_o[0][d][2 * h + 1]);
                if (VEC || col + 1 < p.head_dim) {
                    if (VEC) {
                        *reinterpret_cast<uint32*>(o + col) = pair;
                    } else {  // 2-byte alignment only
                        reinterpret_cast<unsigned short*>(o + col)[0] = (unsigned short)(pair & 0xffffu);
                        reinterpret_cast<unsigned short*>(o + col)[1] = (unsigned short)(pair >> 16);
                    }
                } else {
                    reinterpret_cast<unsigned short*>(o + col)[0] = (unsigned short)(pair & 0xffffu);
                }
            }
        }
    }
}

// Merge the split partials of each (sequence, query head, query row):
// lse = logsumexp_s lse_s, out = sum_s exp(lse_s - lse) out_s. One block per row,
// SPLIT_GROUPS groups of HEAD_DIM / 4 threads (float4 columns); group g takes splits
// g, g + SPLIT_GROUPS, ... Every thread issues the loads of its splits' lse and
// partial out at once (COMBINE_LOADS per pass: one memory latency up to
// SPLIT_GROUPS * COMBINE_LOADS splits), and merges them online against its own max,
// as the forward's softmax does; the groups' (max, sum, acc) then merge through
// shared memory after one barrier. Empty splits (lse -inf) weigh 0 and their partial
// is not used (it was never written).
constexpr int DECODE_MAX_SPLITS = 128;
constexpr int DECODE_COMBINE_SPLIT_GROUPS = 8;
constexpr int DECODE_COMBINE_LOADS = 4;

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(HEAD_DIM / 4 * DECODE_COMBINE_SPLIT_GROUPS)
flash_decode_combine_kernel(const DecodeParams p) {
    constexpr int COLS = HEAD_DIM / 4;  // threads per group: float4 columns
    constexpr int GROUPS = DECODE_COMBINE_SPLIT_GROUPS, LOADS = DECODE_COMBINE_LOADS;
    __shared__ float s_max[GROUPS], s_sum[GROUPS];
    __shared__ float4 s_acc[GROUPS][COLS];

    const int64 rows = int64(p.batch) * p.nheads_q * p.seqlen_q;
    const int64 row = blockIdx.x;  // (b, head, q_row), lse order
    const int splits = p.num_splits;
    const int group = threadIdx.x / COLS, col = threadIdx.x % COLS;
    const float* lse_part = p.lse_accum + row;
    const float4* o_part = reinterpret_cast<const float4*>(p.out_accum + row * HEAD_DIM) + col;

    float m = NEG_INF, sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = group; s0 < splits; s0 += GROUPS * LOADS) {
        float l[LOADS];
        float4 x[LOADS];
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int s = s0 + i * GROUPS;
            l[i] = s < splits ? __ldg(lse_part + s * rows) : NEG_INF;
            x[i] = s < splits ? __ldg(o_part + int64(s) * rows * COLS) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        float m_new = m;
#pragma unroll
        for (int i = 0; i < LOADS; ++i) m_new = fmaxf(m_new, l[i]);
        if (m_new == NEG_INF) continue;  // every split so far empty
        const float alpha = __expf(m - m_new);  // m = -inf: 0
        sum *= alpha;
        acc.x *= alpha; acc.y *= alpha; acc.z *= alpha; acc.w *= alpha;
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            if (l[i] == NEG_INF) continue;
            const float w = __expf(l[i] - m_new);
            sum += w;
            acc.x = fmaf(w, x[i].x, acc.x); acc.y = fmaf(w, x[i].y, acc.y);
            acc.z = fmaf(w, x[i].z, acc.z); acc.w = fmaf(w, x[i].w, acc.w);
        }
        m = m_new;
    }
    s_acc[group][col] = acc;
    if (col == 0) { s_max[group] = m; s_sum[group] = sum; }
    __syncthreads();
    if (group > 0) return;

    float m_all = NEG_INF;
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) m_all = fmaxf(m_all, s_max[g]);
    float total = 0.f;
    float4 out4 = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m_all != NEG_INF) {
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            const float w = __expf(s_max[g] - m_all);  // an empty group: exp(-inf) = 0
            const float4 a = s_acc[g][col];
            total = fmaf(w, s_sum[g], total);
            out4.x = fmaf(w, a.x, out4.x); out4.y = fmaf(w, a.y, out4.y);
            out4.z = fmaf(w, a.z, out4.z); out4.w = fmaf(w, a.w, out4.w);
        }
    }
    const bool empty = !(total > 0.f);
    const float inv = empty ? 0.f : 1.f / total;
    const int q_row = int(row % p.seqlen_q);
    const int bh = int(row / p.seqlen_q);
    const int b = bh / p.nheads_q, head = bh % p.nheads_q;
    T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + q_row * p.o_row_stride + head * p.o_head_stride;
    const float vals[4] = {out4.x * inv, out4.y * inv, out4.z * inv, out4.w * inv};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (col * 4 + e < p.head_dim) out[col * 4 + e] = TypeTraits<T>::from_float(vals[e]);
    }
    if (col == 0) p.lse[row] = empty ? NEG_INF : m_all + __logf(total);
}

}  // namespace cupyflash
