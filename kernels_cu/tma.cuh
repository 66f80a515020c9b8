// tma.cuh: the pieces of a warp-specialised Hopper pipeline (sm_90, setmaxnreg
// sm_90a) through inline PTX: tensor-map descriptors and the bulk tensor copy
// (TMA) that fills shared memory from them, the mbarriers its copies complete on,
// named barriers between warpgroups, and register reallocation between roles.
// No cuda/barrier or cute: pip's headers have neither.
//
// mbarrier phases: a barrier initialised with count c completes its current phase
// once c arrivals have happened and every byte announced by expect_tx has landed;
// it then flips to the next phase. mbar_wait(bar, parity) returns once the phase
// of that parity has completed; on a fresh barrier, the phase "before" phase 0
// (parity 1) counts as completed, so a producer that waits parity (round & 1) ^ 1
// on its empty barriers passes its first round at once.
#pragma once

#include "common.cuh"

namespace cupyflash {

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned (cuda.h is not
// available to NVRTC). Encoded on the host (cupyflash/_tma.py); read by the copy
// engine from a kernel parameter (__grid_constant__) in place.
struct alignas(64) TmaDescriptor {
    uint64 opaque[16];
};

__device__ __forceinline__ void mbar_init(uint32 bar, uint32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// Makes initialised barriers visible to the async proxy (the copy engine); a CTA
// barrier must follow before any thread uses them.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also announces bytes the copy engine will deliver in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32 bar, uint32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32 bar, uint32 parity) {
    uint32 done;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}
// Until the phase of this parity has completed (try_wait suspends for a while
// in hardware before it reports failure, so the loop does not spin hot).
__device__ __forceinline__ void mbar_wait(uint32 bar, uint32 parity) {
    while (!mbar_try_wait(bar, parity)) {}
}

// Orders this thread's generic-proxy accesses of shared memory (ld/st.shared) before
// later async-proxy ones (a TMA copy into the same bytes, issued after an mbarrier
// hand-off): without it the copy engine may write them before the reads or writes land.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Generic address of a descriptor in kernel-parameter space (the parameter must
// be __grid_constant__, or taking its address makes a local copy).
__device__ __forceinline__ uint64 tma_desc_addr(const TmaDescriptor& d) {
    return reinterpret_cast<uint64>(&d);
}
__device__ __forceinline__ void tma_prefetch_desc(const TmaDescriptor& d) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(tma_desc_addr(d)) : "memory");
}
// Copy the box at coordinates (c0 innermost, .., c3) of a 4-D tensor map into
// shared memory at dst (the map's swizzle applied; 1024-byte aligned for the
// 128-byte swizzle); its bytes complete_tx on bar. Elements out of the tensor's
// bounds arrive as zeros and still count toward the box's bytes.
__device__ __forceinline__ void tma_load_4d(uint32 dst, const TmaDescriptor& map, uint32 bar, int c0, int c1,
                                            int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        :: "r"(dst), "l"(tma_desc_addr(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

// Add bytes (a multiple of 16, both addresses 16-byte aligned) of fp32 from shared
// memory at src into global memory at dst, element by element, in the copy engine
// (sm_90; the adds are atomic with respect to other reductions). The calling thread's
// bulk group: bulk_commit() closes it, bulk_wait_read<N>() returns once all but the N
// newest groups have finished reading shared memory (src may then be overwritten),
// bulk_wait<N>() once they have finished altogether.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32 src, uint32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}

// Named barriers (ids 1..15; 0 is __syncthreads) over THREADS threads, a multiple
// of 32: sync waits until THREADS have arrived (itself included); arrive counts
// this warp without waiting.
template <int THREADS>
__device__ __forceinline__ void named_barrier_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "n"(THREADS) : "memory");
}
template <int THREADS>
__device__ __forceinline__ void named_barrier_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "n"(THREADS) : "memory");
}

// Move registers between warpgroups (sm_90a): every warp of a warpgroup executes
// the same one. ptxas honours them only under a register cap at entry
// (__launch_bounds__(threads, 1)) and warns C7508 when it cannot.
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(REGS % 8 == 0 && REGS >= 24 && REGS <= 256, "setmaxnreg: 24..256 in steps of 8");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(REGS % 8 == 0 && REGS >= 24 && REGS <= 256, "setmaxnreg: 24..256 in steps of 8");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS));
}

}  // namespace cupyflash
