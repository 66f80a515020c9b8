// bulk_copy.cuh: Hopper's bulk asynchronous copies (the TMA unit without a tensor
// map, sm_90): one thread hands the copy engine a contiguous shared-memory range,
// the SM's threads go on. Sizes and addresses are multiples of 16 bytes.
#pragma once

#include "common.cuh"

namespace cupyflash {

// global[dst .. dst + bytes) += shared[src .. src + bytes), as fp32 element-wise
// adds performed in L2 (atomic per element, in no fixed order). Writers of src
// fence it first (fence_proxy_async_smem) and meet the issuing thread at a barrier.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32 src, uint32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The issuing thread waits until at most N of its bulk groups still read shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
// ... until at most N of its bulk groups are still in flight at all.
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}

}  // namespace cupyflash
