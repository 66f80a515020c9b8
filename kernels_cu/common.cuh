// common.cuh: scalar types, dtype conversions, math constants, warp reductions.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cupyflash {

using int32 = int;
using int64 = long long;
using uint32 = unsigned int;
using uint64 = unsigned long long;
using uint8 = unsigned char;

// NVRTC has no <cmath>/<type_traits>: the few pieces we need, spelled out.
#define NEG_INF (-__int_as_float(0x7f800000))
template <bool B> struct Bool { static constexpr bool value = B; };
template <int N> struct Int { static constexpr int value = N; };

constexpr float LOG2E = 1.4426950408889634f;  // 1 / ln(2)
constexpr float LN2 = 0.6931471805599453f;    // ln(2)

template <typename T> struct TypeTraits;
template <> struct TypeTraits<__half> {
    using pair = __half2;
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
    // Round (lo, hi) to two 16-bit values in one 32-bit register, lo in the low half.
    static __device__ __forceinline__ uint32 pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32*>(&h);
    }
    static __device__ __forceinline__ float2 unpack(uint32 x) {
        return __half22float2(*reinterpret_cast<__half2*>(&x));
    }
    static constexpr uint32 ONE_PAIR = 0x3C003C00u;  // (1.0, 1.0)
};
template <> struct TypeTraits<__nv_bfloat16> {
    using pair = __nv_bfloat162;
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ uint32 pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32*>(&h);
    }
    static __device__ __forceinline__ float2 unpack(uint32 x) {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
    }
    static constexpr uint32 ONE_PAIR = 0x3F803F80u;  // (1.0, 1.0)
};

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Reduce across the 4 lanes of a quad (lanes 4g..4g+3 share one row of an mma fragment).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace cupyflash
