// bwd_rows.cuh: where the backward's fp32 row buffers keep each query and key
// row: lse_log2, delta and dq_accum one row per query row, dkv_accum (per
// split) one per key row, with no padding, laid out like a contiguous lse:
// (batch, nheads, seqlen) for a dense batch, (nheads, total) for a packed one.
// The warp-specialised backward (flash_bwd_ws.cu) keeps its dq_accum rows with their
// 8-float pieces permuted (dq_accum_piece), which flash_bwd_convert_dq_kernel<.., SWIZZLED>
// undoes.
#pragma once

#include "params.cuh"
#include "seqlens.cuh"

namespace cupyflash {

// Rows of one (batch, head) in the row buffers: seqlen for a dense batch, all
// total rows of a packed one (whose row buffers have a single "batch").
__device__ __forceinline__ int query_rows_per_head(const BwdParams& p) {
    return p.cu_seqlens_q == nullptr ? p.seqlen_q : p.total_q;
}
__device__ __forceinline__ int key_rows_per_head(const BwdParams& p) {
    return p.cu_seqlens_k == nullptr ? p.seqlen_k : p.total_k;
}
// Rows of a whole row buffer (of one split, for dkv_accum).
__device__ __forceinline__ int64 query_rows(const BwdParams& p) {
    return int64(p.cu_seqlens_q == nullptr ? p.batch : 1) * p.nheads_q * query_rows_per_head(p);
}
__device__ __forceinline__ int64 key_rows(const BwdParams& p) {
    return int64(p.cu_seqlens_k == nullptr ? p.batch : 1) * p.nheads_kv * key_rows_per_head(p);
}

// Where logical 8-float piece `piece` of dq_accum's query row m (the row's index in its
// (batch, head)) lies in the warp-specialised backward's layout: the low two bits XORed
// with m's. Its consumers store dQ fragments to unpadded shared-memory rows (head_dim·4
// bytes, a multiple of 128: every row on the same banks), 4 rows per half-warp, one
// piece each; so permuted, those 4 pieces fall on 4 different 32-byte bank groups, and
// the block's rows stay contiguous, in the same layout, for one bulk reduce-add of all.
__device__ __forceinline__ int dq_accum_piece(int piece, int m) { return piece ^ (m & 3); }

// Index in lse_log2 and delta (in rows of dq_accum) of query row m of sequence b, head h.
__device__ __forceinline__ int64 query_row_index(const BwdParams& p, int b, int h, const SeqLens& seq, int m) {
    return p.cu_seqlens_q == nullptr ? (int64(b) * p.nheads_q + h) * p.seqlen_q + m
                                     : int64(h) * p.total_q + seq.q_start + m;
}
// Index in one split's rows of dkv_accum of key row n of sequence b, KV head h_kv.
__device__ __forceinline__ int64 key_row_index(const BwdParams& p, int b, int h_kv, const SeqLens& seq, int n) {
    return p.cu_seqlens_k == nullptr ? (int64(b) * p.nheads_kv + h_kv) * p.seqlen_k + n
                                     : int64(h_kv) * p.total_k + seq.k_start + n;
}

}  // namespace cupyflash
