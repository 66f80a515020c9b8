// seqlens.cuh: where the rows of one sequence of a batch live, for dense and
// packed (variable-length, "varlen") batches alike.
//
// Dense: every sequence has p.seqlen_q queries and p.seqlen_k keys, and
// sequence b is batch index b of (batch, seqlen, nheads, head_dim) tensors.
// Packed (p.cu_seqlens_q non-null): the sequences are concatenated along the
// rows of (total, nheads, head_dim) tensors; sequence b owns query rows
// cu_seqlens_q[b] .. cu_seqlens_q[b+1] and key rows cu_seqlens_k[b] ..
// cu_seqlens_k[b+1]. The host then passes batch strides of 0, and p.seqlen_q,
// p.seqlen_k hold the longest lengths (max_seqlen_q, max_seqlen_k), which size
// the grids; blocks past the end of a shorter sequence do no work.
// Either way, row m of sequence b sits at b * batch_stride + (start + m) * row_stride.
#pragma once

#include "params.cuh"

namespace cupyflash {

struct SeqLens {
    int q_start, k_start;    // first row of the sequence in the packed tensors; 0 when dense
    int seqlen_q, seqlen_k;  // this sequence's lengths
};

// A dense batch's key count: the forward may use only each sequence's first
// seqused_k[b] keys (flash-attention's seqused_k: a KV cache read in place),
// clamped into [0, seqlen_k] (device values are never trusted with an address);
// causal masks then align to that length.
__device__ __forceinline__ int dense_seqlen_k(const FwdParams& p, int b) {
    return p.seqused_k == nullptr ? p.seqlen_k : min(max(__ldg(p.seqused_k + b), 0), p.seqlen_k);
}
__device__ __forceinline__ int dense_seqlen_k(const BwdParams& p, int) { return p.seqlen_k; }

// One uniform branch per block; a dense batch reads nothing from memory (but seqused_k).
template <typename Params>
__device__ __forceinline__ SeqLens seq_lens(const Params& p, int b) {
    if (p.cu_seqlens_q == nullptr) return {0, 0, p.seqlen_q, dense_seqlen_k(p, b)};
    const int q0 = __ldg(p.cu_seqlens_q + b), k0 = __ldg(p.cu_seqlens_k + b);
    return {q0, k0, __ldg(p.cu_seqlens_q + b + 1) - q0, __ldg(p.cu_seqlens_k + b + 1) - k0};
}

// A block's SeqLens parked in 16 bytes of shared memory and read back at each
// use. The read is volatile, so the compiler cannot hoist it and hold the four
// values in registers across a loop: for kernels already at the register limit
// (the dK/dV kernel), where that would spill. One thread stores; a barrier
// must separate the store from the first load.
struct SeqLensSlot {
    static constexpr int BYTES = 16;
    uint32 addr;  // shared-memory address, 16-byte aligned

    __device__ __forceinline__ void store(const SeqLens& s) const {
        asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(addr), "r"(s.q_start), "r"(s.k_start), "r"(s.seqlen_q), "r"(s.seqlen_k));
    }
    __device__ __forceinline__ SeqLens load() const {
        SeqLens s;
        asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(s.q_start), "=r"(s.k_start), "=r"(s.seqlen_q), "=r"(s.seqlen_k) : "r"(addr));
        return s;
    }
};

}  // namespace cupyflash
