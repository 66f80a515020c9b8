// block_traits.cuh: what a kernel's traits struct starts from: the element type, the
// padded head dimension, the block's query rows and keys, and its threads.
#pragma once

namespace cupyflash {

// A traits struct derives from BlockTraits under the same names for its template
// parameters (T, HEAD_DIM, BLOCK_M, BLOCK_N): the kernels read them as Tr::, its own
// definition reads the parameters themselves (a dependent base is not searched there),
// and NUM_THREADS through its own name (Traits::NUM_THREADS).
template <typename T_, int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int NUM_THREADS_>
struct BlockTraits {
    using T = T_;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr int BLOCK_M = BLOCK_M_;
    static constexpr int BLOCK_N = BLOCK_N_;
    static constexpr int NUM_THREADS = NUM_THREADS_;
};

}  // namespace cupyflash
