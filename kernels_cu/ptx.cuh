// ptx.cuh: inline-PTX wrappers for sm_80+ Tensor Core data movement and math.
// No <mma.h>: pip's CUDA headers lack crt/mma.h, so everything is written as PTX.
#pragma once

#include "common.cuh"

namespace cupyflash {

__device__ __forceinline__ uint32 smem_addr(const void* p) {
    return static_cast<uint32>(__cvta_generic_to_shared(p));
}
// The dynamic shared memory this launch was given, in bytes.
__device__ __forceinline__ uint32 dynamic_smem_bytes() {
    uint32 n;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(n));
    return n;
}

// ldmatrix: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i
// receives matrix i with lane l holding row l/4, columns 2(l%4) and 2(l%4)+1.
__device__ __forceinline__ void ldmatrix_x4(uint32 (&r)[4], uint32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// Transposed: lane l receives column l/4, rows 2(l%4) and 2(l%4)+1 of each matrix.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32 (&r)[4], uint32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// D += A * B for one m16n8k16 tile with fp32 accumulators.
// A (16x16, row-major): a[0]=(g, 2t..2t+1) a[1]=(g+8, 2t..) a[2]=(g, 2t+8..) a[3]=(g+8, 2t+8..)
// B (16x8, "col"):      b[0]=(k 2t..2t+1, n g)  b[1]=(k 2t+8.., n g)
// C (16x8):             c[0..1]=(g, 2t..2t+1)   c[2..3]=(g+8, 2t..2t+1)
// with g = lane/4, t = lane%4.
template <typename T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32 (&a)[4], uint32 b0, uint32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32 (&a)[4], uint32 b0, uint32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32 (&a)[4], uint32 b0, uint32 b1) {
    Mma<T>::run(d, a, b0, b1);
}

// 16-byte global->shared copy that bypasses L1; when !pred nothing is read and
// the 16 bytes are zero-filled (src-size 0), so tails need no separate clear.
__device__ __forceinline__ void cp_async_16(uint32 dst, const void* src, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(pred ? 16 : 0));
}
// 4-byte copy (cached in L1: sizes under 16 bytes have only .ca), zero-filled when !pred.
__device__ __forceinline__ void cp_async_4(uint32 dst, const void* src, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(dst), "l"(src), "r"(pred ? 4 : 0));
}
// 16-byte copy of which the first src_bytes (0..16) are read and the rest zero-filled
// (a row's tail); src 16-byte aligned.
__device__ __forceinline__ void cp_async_16_bytes(uint32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Read-only global loads, issued where they are written (volatile: the compiler keeps
// them in order with the wgmma and barrier asm around them, rather than hoisting
// them and holding their results longer); when !pred nothing is read and the result is 0.
#define CUPYFLASH_LD_NC(NAME, TYPE, PTX, CONSTRAINT)                                          \
    __device__ __forceinline__ TYPE NAME(const void* p, bool pred = true) {                 \
        TYPE x = 0;                                                                         \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p ld.global.nc." PTX " %0, [%1];\n}\n" \
                     : "+" CONSTRAINT(x) : "l"(p), "r"(int(pred)));                         \
        return x;                                                                           \
    }
CUPYFLASH_LD_NC(ld_nc_u8, uint32, "u8", "r")
CUPYFLASH_LD_NC(ld_nc_u16, uint32, "u16", "r")
CUPYFLASH_LD_NC(ld_nc_u32, uint32, "b32", "r")
CUPYFLASH_LD_NC(ld_nc_f32, float, "f32", "f")
#undef CUPYFLASH_LD_NC
__device__ __forceinline__ float2 ld_nc_f32x2(const void* p, bool pred = true) {
    float2 x = make_float2(0.f, 0.f);
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %3, 0;\n@p ld.global.nc.v2.f32 {%0, %1}, [%2];\n}\n"
                 : "+f"(x.x), "+f"(x.y) : "l"(p), "r"(int(pred)));
    return x;
}
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// 16 zero bytes to shared memory at addr (16-byte aligned).
__device__ __forceinline__ void st_shared_zero_16(uint32 addr) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" :: "r"(addr), "r"(0) : "memory");
}

// p[0] += a, p[1] += b in global memory, p 8-byte aligned, nothing returned (RED, not
// ATOM): one two-wide reduction on sm_90 (PTX ISA 8.1), two scalar ones before.
__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

}  // namespace cupyflash

namespace cupyflash {

// 2^x on the special-function unit (one MUFU.EX2); exp2(-inf) = 0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

}  // namespace cupyflash
