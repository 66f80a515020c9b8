// params.cuh: the kernel parameter structs, passed by value.
// Each is mirrored field by field in cupyflash/_params.py (a numpy structured
// dtype with align=True); the sizes are checked on both sides.
#pragma once

#include "common.cuh"
#include "variant.cuh"
#include "tma.cuh"

namespace cupyflash {

// Shapes are those of a dense batch; a packed (varlen) batch has cu_seqlens_q/k
// set, (total_q, nheads, head_dim) tensors with batch strides 0, lse
// (nheads_q, total_q) with lse_batch_stride 0, and seqlen_q/k = max_seqlen_q/k
// (see seqlens.cuh).
struct FwdParams {
    const void* q;          // (batch, seqlen_q, nheads_q, head_dim)
    const void* k;          // (batch, seqlen_k, nheads_kv, head_dim)
    const void* v;          // (batch, seqlen_k, nheads_kv, head_dim)
    void* out;              // (batch, seqlen_q, nheads_q, head_dim)
    float* lse;             // (batch, nheads_q, seqlen_q), unit row stride, natural log
    float* out_accum;       // split-KV partials: (num_splits, batch, nheads_q, seqlen_q, HEAD_DIM) fp32
    float* lse_accum;       // split-KV partials: (num_splits, batch, nheads_q, seqlen_q) fp32
    const int* cu_seqlens_q;  // (batch + 1,) prefix sums of the query lengths; null for a dense batch
    const int* cu_seqlens_k;  // (batch + 1,) prefix sums of the key lengths; null for a dense batch
    const int* seqused_k;     // (batch,) keys each sequence of a dense batch uses (its first ones,
                              // at most seqlen_k; causal aligns to it); null: all seqlen_k
    int64 q_batch_stride, q_row_stride, q_head_stride;  // in elements
    int64 k_batch_stride, k_row_stride, k_head_stride;
    int64 v_batch_stride, v_row_stride, v_head_stride;
    int64 o_batch_stride, o_row_stride, o_head_stride;
    int64 lse_batch_stride, lse_head_stride;
    int32 batch, nheads_q, nheads_kv, seqlen_q, seqlen_k, head_dim;
    int32 num_m_blocks;        // ceil(seqlen_q / BLOCK_M)
    int32 num_splits;          // 1 unless split-KV
    int32 n_blocks_per_split;  // key blocks each split visits
    float softmax_scale;       // multiplies q.k
    float softmax_scale_log2;  // softmax_scale * log2(e), for exp2
    VariantParams var;         // window, softcap, ALiBi, sinks, dropout (variant.cuh)
};

#ifdef CUPYFLASH_FWD_PARAMS_BYTES
static_assert(sizeof(FwdParams) == CUPYFLASH_FWD_PARAMS_BYTES,
              "FwdParams differs in size from its mirror in cupyflash/_params.py");
#endif

// The warp-specialised forward (flash_fwd_ws.cu): FwdParams and the TMA maps of
// q, k and v, each (head_dim, seqlen, nheads, batch) innermost first with a box
// of 64 columns (128 bytes, the swizzle's span) by the tile's rows, encoded on
// the host per pointer (cupyflash/_tma.py). The kernel takes it __grid_constant__,
// so the copy engine reads the maps in parameter space.
struct FwdTmaParams {
    FwdParams fwd;
    TmaDescriptor q_map, k_map, v_map;
};

#ifdef CUPYFLASH_FWD_TMA_PARAMS_BYTES
static_assert(sizeof(FwdTmaParams) == CUPYFLASH_FWD_TMA_PARAMS_BYTES,
              "FwdTmaParams differs in size from its mirror in cupyflash/_params.py");
#endif

// The backward pass (flash_bwd.cu): preprocess, dK/dV (+ atomic dQ), dQ, convert.
// Dense or packed (varlen) as FwdParams. The fp32 row buffers lse_log2, delta
// and dq_accum have one row per query row, laid out like a contiguous lse:
// (batch, nheads_q, seqlen_q), or (nheads_q, total_q) for a packed batch.
struct BwdParams {
    const void* q;          // (batch, seqlen_q, nheads_q, head_dim)
    const void* k;          // (batch, seqlen_k, nheads_kv, head_dim)
    const void* v;          // (batch, seqlen_k, nheads_kv, head_dim)
    const void* out;        // (batch, seqlen_q, nheads_q, head_dim), the forward output
    const void* dout;       // (batch, seqlen_q, nheads_q, head_dim)
    void* dq;               // (batch, seqlen_q, nheads_q, head_dim)
    void* dk;               // (batch, seqlen_k, nheads_kv, head_dim)
    void* dv;               // (batch, seqlen_k, nheads_kv, head_dim)
    const float* lse;       // (batch, nheads_q, seqlen_q), natural log, -inf for rows that see no key
    float* lse_log2;        // (batch, nheads_q, seqlen_q): lse * log2(e); +inf for rows that see no key (P = 0)
    float* delta;           // (batch, nheads_q, seqlen_q): rowsum(dout * out)
    float* dq_accum;        // (batch, nheads_q, seqlen_q, head_dim_padded) fp32; null when deterministic
    float* dkv_accum;       // (2, kv_splits, batch, nheads_kv, seqlen_k, head_dim_padded) fp32 partial
                            // dK (scaled) and dV of each split of a GQA group; null when kv_splits == 1
                            // (packed: (2, kv_splits, nheads_kv, total_k, head_dim_padded))
    const int* cu_seqlens_q;  // (batch + 1,) prefix sums of the query lengths; null for a dense batch
    const int* cu_seqlens_k;  // (batch + 1,) prefix sums of the key lengths; null for a dense batch
    int64 q_batch_stride, q_row_stride, q_head_stride;  // in elements
    int64 k_batch_stride, k_row_stride, k_head_stride;
    int64 v_batch_stride, v_row_stride, v_head_stride;
    int64 o_batch_stride, o_row_stride, o_head_stride;
    int64 do_batch_stride, do_row_stride, do_head_stride;
    int64 dq_batch_stride, dq_row_stride, dq_head_stride;
    int64 dk_batch_stride, dk_row_stride, dk_head_stride;
    int64 dv_batch_stride, dv_row_stride, dv_head_stride;
    int64 lse_batch_stride, lse_head_stride;
    int32 batch, nheads_q, nheads_kv, seqlen_q, seqlen_k;
    int32 total_q, total_k;    // packed batches: the query / key rows, q.shape[0] and k.shape[0]
                               // (the row buffers' rows per head); unused (0) for a dense batch
    int32 head_dim;
    int32 head_dim_padded;     // the compiled HEAD_DIM: row length of dq_accum and dkv_accum
    int32 num_stages;          // dK/dV kernel: Q/dO tiles in flight, 2 (double-buffered) or 1
    int32 kv_splits;           // dK/dV blocks per (key block, KV head), each taking
                               // nheads_q / nheads_kv / kv_splits of the group's query heads
    float softmax_scale;       // multiplies q.k
    float softmax_scale_log2;  // softmax_scale * log2(e), for exp2
    VariantParams var;         // window, softcap, ALiBi, sinks, dropout (variant.cuh)
};

#ifdef CUPYFLASH_BWD_PARAMS_BYTES
static_assert(sizeof(BwdParams) == CUPYFLASH_BWD_PARAMS_BYTES,
              "BwdParams differs in size from its mirror in cupyflash/_params.py");
#endif

// The warp-specialised backward's parameters (flash_bwd_ws.cu): BwdParams, then the
// TMA maps of q, k, v and dout (as FwdTmaParams': boxes of 64 columns by the tile's
// rows, 64 for Q and dO, 128 for K and V), taken __grid_constant__.
struct BwdTmaParams {
    BwdParams bwd;
    TmaDescriptor q_map, k_map, v_map, do_map;
    TmaDescriptor bias_map;  // flash_bwd_ws.cu with a bias (WS_BWD_BIAS): cupyflash/_tma.py bias_map
};

#ifdef CUPYFLASH_BWD_TMA_PARAMS_BYTES
static_assert(sizeof(BwdTmaParams) == CUPYFLASH_BWD_TMA_PARAMS_BYTES,
              "BwdTmaParams differs in size from its mirror in cupyflash/_params.py");
#endif

// Attention against a KV cache (flash_decode.cu): a few new query rows per
// sequence, the query heads of one KV head packed into the rows of one tile
// (packed row r = q_row * group + the head's index in its group), the keys
// split over num_splits blocks, each sequence with its own length.
struct DecodeParams {
    const void* q;          // (batch, seqlen_q, nheads_q, head_dim)
    const void* k_cache;    // (batch_cache, seqlen_cache, nheads_kv, head_dim), or paged
    const void* v_cache;    //   (num_blocks, page_size, nheads_kv, head_dim)
    const void* k_new;      // (batch, seqlen_new, nheads_kv, head_dim), appended at cache_seqlens[b]; may be null
    const void* v_new;
    void* out;              // (batch, seqlen_q, nheads_q, head_dim)
    float* lse;             // (batch, nheads_q, seqlen_q), natural log
    float* out_accum;       // split partials: (num_splits, batch, nheads_q, seqlen_q, HEAD_DIM) fp32
    float* lse_accum;       // split partials: (num_splits, batch, nheads_q, seqlen_q) fp32
    const int* cache_seqlens;    // (batch,) keys in the cache before the append; null: cache_seqlen for all
    const int* cache_batch_idx;  // (batch,) cache row of each sequence; null: row b (dense caches only)
    const int* block_table;      // (batch, max_blocks_per_seq) block of each page; null: dense cache
    int* seqused_k_out;          // (batch,): each sequence's key count after the append is written
                                 // here (for the dense forward's seqused_k); may be null
    int64 cache_seqlen;          // the cache length of every sequence when cache_seqlens is null (set per call)
    int64 q_batch_stride, q_row_stride, q_head_stride;  // in elements
    int64 k_batch_stride, k_row_stride, k_head_stride;  // batch: cache row, or block when paged
    int64 v_batch_stride, v_row_stride, v_head_stride;
    int64 knew_batch_stride, knew_row_stride, knew_head_stride;
    int64 vnew_batch_stride, vnew_row_stride, vnew_head_stride;
    int64 o_batch_stride, o_row_stride, o_head_stride;
    int64 block_table_batch_stride;
    int32 batch, nheads_q, nheads_kv, seqlen_q, head_dim;
    int32 seqlen_new;          // rows of k_new / v_new (0: no append)
    int32 page_size;           // slots per block (paged)
    int32 page_shift;          // log2(page_size) when a power of two (shifts, not divisions), else -1
    int32 cache_rows;          // blocks in the pool (paged) or rows of the cache (dense): indices are clamped to it
    int32 capacity;            // slots per sequence (seqlen_cache, or max_blocks_per_seq * page_size):
                               // cache lengths are clamped to capacity - seqlen_new
    int32 group;               // nheads_q / nheads_kv: query heads per KV head
    int32 num_m_blocks;        // ceil(seqlen_q * group / BLOCK_M)
    int32 num_splits;          // key ranges per (sequence, KV head, row block)
    float softmax_scale;       // multiplies q.k
    float softmax_scale_log2;  // softmax_scale * log2(e), for exp2
    VariantParams var;         // window, softcap, ALiBi, sinks, dropout (variant.cuh)
};

#ifdef CUPYFLASH_DECODE_PARAMS_BYTES
static_assert(sizeof(DecodeParams) == CUPYFLASH_DECODE_PARAMS_BYTES,
              "DecodeParams differs in size from its mirror in cupyflash/_params.py");
#endif

}  // namespace cupyflash
