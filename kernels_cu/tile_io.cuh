// tile_io.cuh: predicated movement of (rows x HEAD_DIM) tiles between global
// and shared memory.
//
// Shared tiles are row-major in 16-byte chunks with an odd row stride (in
// chunks): the 8 rows one ldmatrix phase touches then fall in 8 different
// 16-byte bank groups, so ldmatrix and the fragment stores are conflict-free
// for every head_dim without a swizzle.
#pragma once

#include "ptx.cuh"

namespace cupyflash {

template <typename T, int ROWS, int HEAD_DIM>
struct SmemTile {
    static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");
    static constexpr int CHUNKS = HEAD_DIM * int(sizeof(T)) / 16;  // 16-byte chunks per row
    static constexpr int STRIDE = CHUNKS | 1;                        // padded row stride, odd
    static constexpr int BYTES = ROWS * STRIDE * 16;

    __device__ static __forceinline__ uint32 offset(int row, int chunk) {
        return uint32((row * STRIDE + chunk) * 16);
    }
};

// Copy rows [0, rows_valid) and columns [0, head_dim) of a global tile into
// shared memory laid out as Tile (padded SmemTile, or wgmma.cuh's Swizzle128Tile); everything outside is zero-filled (so tails add nothing to a
// dot product and never bring NaN into P·V).
//   VEC:  16-byte cp.async (pointer, strides and head_dim are multiples of 8 elements);
//         the caller commits and waits.
//   !VEC: element loads for any alignment, completed before returning.
// The NUM_THREADS threads taking part are the whole block, or (!WHOLE_BLOCK) each
// group of NUM_THREADS (e.g. a warpgroup, with its own smem_base and gmem rows),
// thread threadIdx.x % NUM_THREADS of its group. (The modulo is not free: at the
// edge of the register file it costs the D=64 128x128 mma.sync tile a spill.)
// Thread -> (row, chunk) map shared by loads and stores: THREADS_PER_ROW
// threads cover one row (the largest power of two dividing CHUNKS), each taking
// CHUNKS_PER_THREAD chunks strided by THREADS_PER_ROW.
template <typename T, int ROWS, int HEAD_DIM, int NUM_THREADS>
struct TileMap {
    static constexpr int CHUNKS = SmemTile<T, ROWS, HEAD_DIM>::CHUNKS;
    static constexpr int THREADS_PER_ROW = (CHUNKS & -CHUNKS) < NUM_THREADS ? (CHUNKS & -CHUNKS) : NUM_THREADS;
    static constexpr int CHUNKS_PER_THREAD = CHUNKS / THREADS_PER_ROW;
    static constexpr int ROWS_PER_IT = NUM_THREADS / THREADS_PER_ROW;
    static_assert(ROWS % ROWS_PER_IT == 0, "tile rows must divide evenly among threads");
    static constexpr int ITERS = ROWS / ROWS_PER_IT;
};

// One 16-byte chunk (8 elements, columns 8 chunk ..) of a global row into shared
// memory at dst; zero-filled where !row_valid or past head_dim. VEC: a cp.async
// (src must then be a valid address even when nothing is read: the caller's
// fallback); !VEC: element loads through registers, stored before returning.
template <typename T, bool VEC, bool EVEN_K>
__device__ __forceinline__ void load_chunk(uint32 dst, const T* src, const T* fallback, bool row_valid,
                                           int chunk, int head_dim) {
    if constexpr (VEC) {
        const bool pred = row_valid && (EVEN_K || chunk * 8 < head_dim);
        cp_async_16(dst, pred ? src : fallback, pred);
    } else {
        uint32 packed[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = chunk * 8 + 2 * e;
            unsigned short lo = 0, hi = 0;
            if (row_valid) {
                const unsigned short* s16 = reinterpret_cast<const unsigned short*>(src + 2 * e);
                if (col < head_dim) lo = s16[0];
                if (col + 1 < head_dim) hi = s16[1];
            }
            packed[e] = uint32(lo) | (uint32(hi) << 16);
        }
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(dst), "r"(packed[0]), "r"(packed[1]), "r"(packed[2]), "r"(packed[3]));
    }
}

template <typename T, int ROWS, int HEAD_DIM, int NUM_THREADS, bool VEC, bool EVEN_K,
          typename Tile = SmemTile<T, ROWS, HEAD_DIM>, bool WHOLE_BLOCK = true>
__device__ __forceinline__ void load_tile(uint32 smem_base, const T* gmem, int64 row_stride,
                                          int rows_valid, int head_dim) {
    using Map = TileMap<T, ROWS, HEAD_DIM, NUM_THREADS>;
    const int tid = WHOLE_BLOCK ? int(threadIdx.x) : int(threadIdx.x) % NUM_THREADS;
    const int row0 = tid / Map::THREADS_PER_ROW;
    const int chunk0 = tid % Map::THREADS_PER_ROW;
    const T* src = gmem + row0 * row_stride + chunk0 * 8;
    const int64 step = Map::ROWS_PER_IT * row_stride;
#pragma unroll
    for (int it = 0; it < Map::ITERS; ++it) {
        const int row = row0 + it * Map::ROWS_PER_IT;
#pragma unroll
        for (int c = 0; c < Map::CHUNKS_PER_THREAD; ++c) {
            const int chunk = chunk0 + c * Map::THREADS_PER_ROW;
            load_chunk<T, VEC, EVEN_K>(smem_base + Tile::offset(row, chunk), src + c * Map::THREADS_PER_ROW * 8,
                                       gmem, row < rows_valid, chunk, head_dim);
        }
        src += step;
        // Keep the compiler from hoisting one 64-bit address per row out of the
        // caller's key loop (that costs ~70 registers at HEAD_DIM 128).
        asm volatile("" : "+l"(src));
    }
}

// Copy a shared tile back to global rows [0, rows_valid), columns [0, head_dim).
// thread: this thread's threadIdx.x (a caller in a loop may pass it made opaque, so
// that the per-thread addresses are not hoisted out of that loop).
template <typename T, int ROWS, int HEAD_DIM, int NUM_THREADS, bool VEC, bool EVEN_K,
          typename Tile = SmemTile<T, ROWS, HEAD_DIM>, bool WHOLE_BLOCK = true>
__device__ __forceinline__ void store_tile(T* gmem, int64 row_stride, uint32 smem_base,
                                           int rows_valid, int head_dim, uint32 thread = threadIdx.x) {
    using Map = TileMap<T, ROWS, HEAD_DIM, NUM_THREADS>;
    const int tid = WHOLE_BLOCK ? int(thread) : int(thread) % NUM_THREADS;
    const int row0 = tid / Map::THREADS_PER_ROW;
    const int chunk0 = tid % Map::THREADS_PER_ROW;
#pragma unroll
    for (int it = 0; it < Map::ITERS; ++it) {
        const int row = row0 + it * Map::ROWS_PER_IT;
#pragma unroll
        for (int c = 0; c < Map::CHUNKS_PER_THREAD; ++c) {
            const int chunk = chunk0 + c * Map::THREADS_PER_ROW;
            if (row >= rows_valid || (!EVEN_K && chunk * 8 >= head_dim)) continue;
            uint32 r[4];
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                         : "r"(smem_base + Tile::offset(row, chunk)));
            T* dst = gmem + row * row_stride + chunk * 8;
            if constexpr (VEC) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(r[0], r[1], r[2], r[3]);
            } else {
                unsigned short* d16 = reinterpret_cast<unsigned short*>(dst);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    if (chunk * 8 + e < head_dim) d16[e] = (unsigned short)(r[e / 2] >> (16 * (e % 2)));
                }
            }
        }
    }
}

}  // namespace cupyflash
