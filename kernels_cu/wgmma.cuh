// wgmma.cuh: Hopper warpgroup MMA (sm_90a) through inline PTX: shared-memory
// matrix descriptors for 128-byte-swizzled tiles, the async fences, and
// wgmma.mma_async (m64nNk16, N = 32, 64, 128, fp32 accumulators). The operand
// lists are spelled out per shape: PTX has no vector syntax for 16-64 registers.
//
// A warpgroup is 4 consecutive warps (threads 128w .. 128w+127). For m64nNk16
// with fp32 accumulators, warp i of the group owns rows 16i .. 16i+15 and holds
// them exactly like an mma.sync m16n8 accumulator repeated over N/8 column
// tiles: d[j][0..1] = (row g, cols 8j+2t, 8j+2t+1), d[j][2..3] = (row g+8, same
// cols), g = lane/4, t = lane%4. The register A operand (64x16) is the mma.sync
// m16n8k16 A fragment of each warp's 16 rows, so P converts from the S
// accumulators in registers with no shuffles.
#pragma once

#include "common.cuh"
#include "ptx.cuh"

namespace cupyflash {

using uint64 = unsigned long long;

// Shared tile of ROWS x HEAD_DIM 16-bit elements in the 128-byte swizzle that
// wgmma and its descriptors expect: HEAD_DIM is cut into column blocks of 64
// elements (128 bytes); block c holds every row, 128 bytes per row, at c*ROWS*128;
// within a row, 16-byte chunk k sits at position k ^ (row % 8). The tile base must
// be 1024-byte aligned. Loads (tile_io.cuh) and ldmatrix-free epilogues use offset().
template <typename T, int ROWS, int HEAD_DIM>
struct Swizzle128Tile {
    static_assert(sizeof(T) == 2 && HEAD_DIM % 64 == 0, "128-byte swizzle: 64-element column blocks");
    static_assert(ROWS % 8 == 0, "rows come in 8-row swizzle atoms");
    static constexpr int ELEM = 2;
    static constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per row
    static constexpr int BLOCK_BYTES = ROWS * 128;
    static constexpr int BYTES = ROWS * HEAD_DIM * 2;

    __device__ static __forceinline__ uint32 offset(int row, int chunk) {
        return uint32((chunk / 8) * BLOCK_BYTES + row * 128 + (((chunk % 8) ^ (row % 8)) << 4));
    }
    // Rows first_row .. ROWS-1 of the tile at base set to zero by one warp (whole rows:
    // the swizzle only permutes chunks within a row).
    __device__ static __forceinline__ void warp_zero_rows_from(uint32 base, int first_row, int lane) {
        const int chunks = (ROWS - first_row) * 8;  // 16-byte chunks per column block
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 64; ++c) {
            const uint32 from = base + c * BLOCK_BYTES + first_row * 128;
            for (int i = lane; i < chunks; i += 32) st_shared_zero_16(from + i * 16);
        }
    }
};

// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading
// and stride byte offsets (all >> 4), swizzle mode in bits 62-63 (1 = 128 B).
__device__ __forceinline__ uint64 make_desc_sw128(uint32 smem_address, uint32 leading_bytes, uint32 stride_bytes) {
    return uint64((smem_address & 0x3FFFF) >> 4) | (uint64(leading_bytes >> 4) << 16) |
           (uint64(stride_bytes >> 4) << 32) | (1ull << 62);
}

// K-major operand (rows of the M or N dimension, K contiguous): 8-row atoms of
// 1024 bytes are stacked along M/N; the k16 slice kk of a 64-wide column block
// starts 32 bytes further into the swizzled row (the hardware applies the XOR on
// the final address). The leading offset is unused for swizzled K-major tiles.
template <int ROWS>
__device__ __forceinline__ uint64 desc_k_major(uint32 tile_base, int row0, int kk) {
    const uint32 addr = tile_base + (kk / 4) * (ROWS * 128) + row0 * 128 + (kk % 4) * 32;
    return make_desc_sw128(addr, 16, 1024);
}

// MN-major operand (K rows, the N dimension contiguous, e.g. V as the B of P·V):
// the k16 slice kk is 16 rows = 2048 bytes down; 8-row atoms along K are 1024
// bytes apart (stride offset); 64-wide column blocks along N are ROWS*128 bytes
// apart (leading offset).
template <int ROWS>
__device__ __forceinline__ uint64 desc_mn_major(uint32 tile_base, int kk) {
    return make_desc_sw128(tile_base + kk * 2048, ROWS * 128, 1024);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// wgmma_wait<N>() that stays after the computation of a and b. ptxas places a wait
// just before the first instruction that needs it (one that writes an in-flight
// wgmma's registers) and schedules such instructions as early as their inputs
// allow, so a wait meant to follow work that overlaps the GEMM in flight can rise
// above that work (seen in SASS: the forward's softmax ended up after the wait;
// empty-asm fences are gone by PTX and do not help; PERF.md v14). ptxas keeps
// shared-memory stores on their side of the wait: storing a and b (8 bytes at
// slot, never read) pins the wait after everything they depend on.
template <int N>
__device__ __forceinline__ void wgmma_wait_after(uint32 slot, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" :: "r"(slot), "f"(a), "f"(b) : "memory");
    wgmma_wait<N>();
}

// Keep the compiler from moving accesses of accumulator registers across the
// async window (issue .. wait): the asm "reads and writes" every register.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e]) :: "memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32 (&a)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[j][e]) :: "memory");
}

// Shared memory written by the generic proxy (cp.async, st.shared) must be fenced
// by each writing thread before a barrier that precedes a wgmma reading it.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The register A operands (64x16 each) of K_STEPS k16 steps from an m64nN fp32
// accumulator (N = 16 K_STEPS), rounded to T: step kk takes n8 tiles 2kk, 2kk+1.
template <typename T, int K_STEPS>
__device__ __forceinline__ void acc_to_a_operand(const float (&acc)[2 * K_STEPS][4], uint32 (&a)[K_STEPS][4]) {
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) {
        a[kk][0] = TypeTraits<T>::pack(acc[2 * kk][0], acc[2 * kk][1]);
        a[kk][1] = TypeTraits<T>::pack(acc[2 * kk][2], acc[2 * kk][3]);
        a[kk][2] = TypeTraits<T>::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
        a[kk][3] = TypeTraits<T>::pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
    }
}

// Wgmma<T, N>::ss<TRANS_A, TRANS_B>(d, a_desc, b_desc, accumulate): D (64xN) (+)= A (64x16)
// * B (16xN), both from shared memory; TRANS = 1 reads that operand MN-major (M or N
// contiguous) instead of K-major. Wgmma<T, N>::rs<TRANS_B>(d, a, b_desc): D += A (64x16,
// registers) * B.
template <typename T, int N> struct Wgmma;

// The fp32 accumulator operands of an m64nN tile: N / 2 registers per thread.
#define CUPYFLASH_ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define CUPYFLASH_ACC_32 CUPYFLASH_ACC4(0), CUPYFLASH_ACC4(1), CUPYFLASH_ACC4(2), CUPYFLASH_ACC4(3)
#define CUPYFLASH_ACC_64 CUPYFLASH_ACC_32, CUPYFLASH_ACC4(4), CUPYFLASH_ACC4(5), CUPYFLASH_ACC4(6), CUPYFLASH_ACC4(7)
#define CUPYFLASH_ACC_128 CUPYFLASH_ACC_64, \
    CUPYFLASH_ACC4(8), CUPYFLASH_ACC4(9), CUPYFLASH_ACC4(10), CUPYFLASH_ACC4(11), \
    CUPYFLASH_ACC4(12), CUPYFLASH_ACC4(13), CUPYFLASH_ACC4(14), CUPYFLASH_ACC4(15)
#define CUPYFLASH_ACC_96 CUPYFLASH_ACC_64, CUPYFLASH_ACC4(8), CUPYFLASH_ACC4(9), CUPYFLASH_ACC4(10), CUPYFLASH_ACC4(11)
#define CUPYFLASH_ACC_112 CUPYFLASH_ACC_64, CUPYFLASH_ACC4(8), CUPYFLASH_ACC4(9), CUPYFLASH_ACC4(10), CUPYFLASH_ACC4(11), CUPYFLASH_ACC4(12), CUPYFLASH_ACC4(13)
#define CUPYFLASH_ACC_192 CUPYFLASH_ACC_128, \
    CUPYFLASH_ACC4(16), CUPYFLASH_ACC4(17), CUPYFLASH_ACC4(18), CUPYFLASH_ACC4(19), \
    CUPYFLASH_ACC4(20), CUPYFLASH_ACC4(21), CUPYFLASH_ACC4(22), CUPYFLASH_ACC4(23)
#define CUPYFLASH_ACC_256 CUPYFLASH_ACC_192, \
    CUPYFLASH_ACC4(24), CUPYFLASH_ACC4(25), CUPYFLASH_ACC4(26), CUPYFLASH_ACC4(27), \
    CUPYFLASH_ACC4(28), CUPYFLASH_ACC4(29), CUPYFLASH_ACC4(30), CUPYFLASH_ACC4(31)
#define CUPYFLASH_REGS_32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define CUPYFLASH_REGS_64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CUPYFLASH_REGS_128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define CUPYFLASH_REGS_96 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define CUPYFLASH_REGS_112 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55}"
#define CUPYFLASH_REGS_192 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define CUPYFLASH_REGS_256 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

// One specialisation per (input type, N). The operands after the N / 2
// accumulators are numbered I0.. : ss takes a_desc, b_desc, accumulate (as the
// predicate), TRANS_A, TRANS_B = I0..I4; rs the four A registers, b_desc, the
// predicate, TRANS_B = I0..I6.
#define CUPYFLASH_WGMMA(CTYPE, PTX, N, I0, I1, I2, I3, I4, I5, I6) \
template <> struct Wgmma<CTYPE, N> { \
    template <int TRANS_A, int TRANS_B> \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64 a, uint64 b, int accumulate) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %" #I2 ", 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " CUPYFLASH_REGS_##N ", " \
            "%" #I0 ", %" #I1 ", p, 1, 1, %" #I3 ", %" #I4 ";\n}\n" \
            : CUPYFLASH_ACC_##N \
            : "l"(a), "l"(b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B)); \
    } \
    template <int TRANS_B> \
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32 (&a)[4], uint64 b) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %" #I5 ", 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " CUPYFLASH_REGS_##N ", " \
            "{%" #I0 ", %" #I1 ", %" #I2 ", %" #I3 "}, %" #I4 ", p, 1, 1, %" #I6 ";\n}\n" \
            : CUPYFLASH_ACC_##N \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(TRANS_B)); \
    } \
};
// Both input types at each N: S's (32, 64, 112: D=192's key blocks, 128), O's (64,
// 128, 192, 256: P·V's N at each head_dim) and the backward's half of dQ (96: D=192)
#define CUPYFLASH_WGMMA_F16_BF16(N, I0, I1, I2, I3, I4, I5, I6) \
    CUPYFLASH_WGMMA(__half, "f16", N, I0, I1, I2, I3, I4, I5, I6) \
    CUPYFLASH_WGMMA(__nv_bfloat16, "bf16", N, I0, I1, I2, I3, I4, I5, I6)
CUPYFLASH_WGMMA_F16_BF16(32, 16, 17, 18, 19, 20, 21, 22)
CUPYFLASH_WGMMA_F16_BF16(64, 32, 33, 34, 35, 36, 37, 38)
CUPYFLASH_WGMMA_F16_BF16(96, 48, 49, 50, 51, 52, 53, 54)
CUPYFLASH_WGMMA_F16_BF16(112, 56, 57, 58, 59, 60, 61, 62)
CUPYFLASH_WGMMA_F16_BF16(128, 64, 65, 66, 67, 68, 69, 70)
CUPYFLASH_WGMMA_F16_BF16(192, 96, 97, 98, 99, 100, 101, 102)
CUPYFLASH_WGMMA_F16_BF16(256, 128, 129, 130, 131, 132, 133, 134)
#undef CUPYFLASH_WGMMA_F16_BF16
#undef CUPYFLASH_WGMMA
#undef CUPYFLASH_REGS_256
#undef CUPYFLASH_REGS_192
#undef CUPYFLASH_REGS_128
#undef CUPYFLASH_REGS_112
#undef CUPYFLASH_REGS_96
#undef CUPYFLASH_REGS_64
#undef CUPYFLASH_REGS_32
#undef CUPYFLASH_ACC_256
#undef CUPYFLASH_ACC_192
#undef CUPYFLASH_ACC_128
#undef CUPYFLASH_ACC_112
#undef CUPYFLASH_ACC_96
#undef CUPYFLASH_ACC_64
#undef CUPYFLASH_ACC_32
#undef CUPYFLASH_ACC4


}  // namespace cupyflash
