// variant.cuh: the attention variants, written once for every kernel (issue 13).
//
// A kernel takes one template argument VARIANT, a set of the VAR_* bits below,
// and asks this header three things:
//   * block level (Mask::key_blocks, Mask::query_blocks): which blocks of the
//     other side a block visits, and which of those need no mask code at all;
//   * element level (Mask::visible, ScoreMod::operator()): whether query row i
//     sees key j, and the score of (i, j) in log2 units;
//   * the backward's pieces (ScoreMod::dscore, the softcap derivative; the
//     probability recompute prob()).
// Nothing else in a kernel knows which variant it runs.
//
// Semantics (flash-attention's; cupyflash/reference.py is the specification).
// With s = q·k (raw) and off = seqlen_k - seqlen_q (bottom-right alignment):
//   softcap  u = softcap · tanh(softmax_scale · s / softcap), else u = softmax_scale · s
//   alibi    u -= slope[b, h] · |i + off - j|
//   window   row i sees key j iff i + off - left <= j <= i + off + right (-1: unbounded);
//            causal is right = 0; every row sees only j < seqlen_k
//   sinks    a logit sinks[h] that joins each row's denominator with no value
//   dropout  each probability kept iff its Philox half-word >= threshold, scaled by 1/(1-p)
//   bias     u += attn_bias[b, h, i, j] (after softcap and ALiBi; -inf masks)
//   mask     row i sees key j only where attn_mask[b, h, i, j] (and the rules above)
// Scores are kept in log2 units, x = u · log2(e), computed once per element; the
// online softmax subtracts the row maximum of those same rounded values, so the
// largest term of a row is exactly exp2(0) = 1 at any logit magnitude.
#pragma once

#include "ptx.cuh"

namespace cupyflash {

constexpr int VAR_WINDOW = 1;   // window_size (left, right)
constexpr int VAR_SOFTCAP = 2;  // tanh logit softcap
constexpr int VAR_ALIBI = 4;    // ALiBi slopes
constexpr int VAR_SINKS = 8;    // attention sinks
constexpr int VAR_DROPOUT = 16; // Philox dropout
constexpr int VAR_BIAS = 32;     // additive bias in the kernel's element type (issue 14)
constexpr int VAR_BIAS_FP32 = 64; // additive bias in float32 (not with VAR_BIAS)
constexpr int VAR_MASK = 128;    // boolean keep-mask
constexpr int VAR_BIAS_STRIDED = 256;  // bias/mask read element by element (else: pairs, see ScoreTerms)
constexpr int VAR_BIAS_STAGED = 512;   // forward: bias/mask tiles staged through shared memory (StagedScoreTerms)
constexpr int VAR_BLOCK_MAP = 1024;    // forward, with VAR_MASK: the mask's tile map skips empty key blocks
                                       // and runs full ones with no mask (KeyBlockMap)
// The variants the warp-specialised kernels take (flash_fwd_ws.cu, flash_bwd_ws.cu;
// cupyflash/dispatch.py FWD_WS_VARIANTS, BWD_WS_VARIANTS): those whose code lives in the
// scores and the softmax, not in extra shared-memory streams (a bias, a mask, a block map).
constexpr int WS_VARIANTS = VAR_WINDOW | VAR_SOFTCAP | VAR_ALIBI | VAR_SINKS | VAR_DROPOUT;
// ... and, the forward only, a bool mask with its tile map (the map's walk skips the empty
// key blocks; cupyflash/dispatch.py FWD_WS_MAP_VARIANTS, FWD_WS_BLOCK_MAP).
constexpr int WS_FWD_MAP_VARIANTS = VAR_MASK | VAR_BLOCK_MAP;
// ... or a bias of the kernel's element type read in pairs into registers (ScoreTerms, a
// block's once its GEMMs are issued; no fp32, strided or masked bias):
// cupyflash/dispatch.py FWD_WS_BIAS_VARIANTS
constexpr int WS_FWD_BIAS = VAR_BIAS;
// ... and the backward's dK/dV kernel a bias of the kernel's element type staged (VAR_BIAS |
// VAR_BIAS_STAGED: 16-byte rows), which its producer copies by TMA beside each step's Q and
// dO (StagedScoreTermsT reads it): cupyflash/dispatch.py BWD_WS_BIAS_VARIANTS
constexpr int WS_BWD_BIAS = VAR_BIAS | VAR_BIAS_STAGED;

// The variants' runtime arguments, one member `var` of every params struct
// (mirrored as VARIANT_PARAMS in cupyflash/_params.py). Fields of a variant that
// is off are never read.
struct VariantParams {
    // per call (the first fields: written at each launch)
    const float* alibi_slopes;  // (batch, nheads_q) fp32, batch stride alibi_batch_stride (0: (nheads_q,))
    const float* sinks;         // (nheads_q,) fp32, natural-log units
    float* dsinks;              // backward: (nheads_q,) fp32, zeroed, summed into; null otherwise
    const void* attn_bias;      // (batch, nheads_q, seqlen_q, seqlen_k) at the bias strides (0: broadcast),
                                // the kernel's element type (VAR_BIAS) or fp32 (VAR_BIAS_FP32)
    const uint8* attn_mask;     // bool, the same form at the mask strides; 0 = masked
    void* dbias;                // backward: the bias's element type (T or fp32) at the dbias strides,
                                // written by flash_bwd_dbias_kernel only; null otherwise
    const uint8* block_map;     // VAR_BLOCK_MAP: the mask's state per (batch, head, query block, key block)
                                // of the kernel's tile (0 empty, 1 partial, 2 full; cupyflash/_blockmask.py),
                                // for the kernels that walk key blocks (KeyBlockMap: the forward, the
                                // backward's dQ kernel)
    const uint8* kv_block_map;  // the same at the tile of the backward's dK/dV kernel, which walks query
                                // blocks (QueryBlockMap; its tile is not the dQ kernel's)
    uint64 dropout_seed;        // Philox key: (seed & 0xffffffff, seed >> 32)
    uint32 dropout_offset;      // Philox counter word 3
    // per plan
    uint32 dropout_threshold;   // keep iff half-word >= threshold (floor(p * 2^16))
    int64 alibi_batch_stride;   // in elements
    // (batch, head, row, col) strides in elements of attn_bias, attn_mask and dbias;
    // a broadcast dimension has stride 0
    int64 bias_batch_stride, bias_head_stride, bias_row_stride, bias_col_stride;
    int64 mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
    int64 dbias_batch_stride, dbias_head_stride, dbias_row_stride, dbias_col_stride;
    int64 block_map_batch_stride, block_map_head_stride, block_map_row_stride, block_map_col_stride;
    int64 kv_block_map_batch_stride, kv_block_map_head_stride, kv_block_map_row_stride, kv_block_map_col_stride;
    int32 window_left;          // keys before the diagonal a row sees; -1: unbounded
    int32 window_right;         // keys after it; -1: unbounded (causal forces 0)
    float softcap_log2;         // softcap·log2(e), softcap > 0
    float softcap_scale;        // softmax_scale / softcap
    float dropout_scale;        // 1 / (1 - p)
};
__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((b - 1 - a) / b); }

// Blocks [begin, end) are visited; those in [unmasked_begin, unmasked_end) need
// no mask; begin <= unmasked_begin <= unmasked_end <= end. Kernels walk them from
// end - 1 down: masked, unmasked, masked again (the window's far edge: a loop
// compiled only with a window, since a dead loop still costs registers).
struct BlockRange {
    int begin, end, unmasked_begin, unmasked_end;

    __device__ __forceinline__ void clamp() {
        end = max(end, 0);
        begin = min(max(begin, 0), end);
        unmasked_end = min(max(unmasked_end, begin), end);
        unmasked_begin = min(max(unmasked_begin, begin), unmasked_end);
    }
    __device__ __forceinline__ bool masked(int n) const { return n < unmasked_begin || n >= unmasked_end; }
};

// The last (DIR = -1) or first (DIR = +1) block c of [lo, hi) whose state states[c ·
// stride] is not EMPTY; lo - 1 (down) or hi (up) if none. Every lane of the warp calls
// it with the same arguments (the block loops are uniform): 32 blocks' states are read
// at once and a ballot picks the first kept one, so a run of empty blocks costs one
// load each 32 of them. (stride: the params' field itself, a constant-bank operand, not
// a register pair held across the loop.)
constexpr int BLOCK_EMPTY = 0, BLOCK_PARTIAL = 1, BLOCK_FULL = 2;
template <int DIR>
__device__ __forceinline__ int first_kept_block(const uint8* states, const int64& stride, int lo, int hi) {
    const int lane = threadIdx.x % 32;
    for (int top = DIR < 0 ? hi - 1 : lo; DIR < 0 ? top >= lo : top < hi; top += 32 * DIR) {
        const int c = top + DIR * lane;
        const bool kept = (DIR < 0 ? c >= lo : c < hi) && __ldg(states + int64(c) * stride) != BLOCK_EMPTY;
        const uint32 hits = __ballot_sync(0xffffffffu, kept);
        if (hits) return top + DIR * (__ffs(hits) - 1);
    }
    return DIR < 0 ? lo - 1 : hi;
}

// The mask's tile map (VAR_BLOCK_MAP) seen from one query block of one (batch, head):
// which of its key blocks the kernel visits, and which of those need no mask. A
// block whose tile no row of the mask keeps (EMPTY) is never visited: it would
// add exp2(-inf) = 0 to every sum, so the online softmax is as if it had run (a
// row whose every block is skipped ends with sum 0: out 0, lse -inf, as a row
// that sees no key); in the backward its P, and so its dS, is 0. A FULL tile keeps
// every element: its scores take no mask.
// Without the bit, every block of the range is visited and masked as the variant
// says (prev(n) = n - 1, state PARTIAL: compiled away).
template <int VARIANT>
struct KeyBlockMap {
    static constexpr bool ON = (VARIANT & VAR_BLOCK_MAP) != 0;
    static_assert(!ON || (VARIANT & VAR_MASK) != 0, "a block map needs the mask");
    const VariantParams& v;
    const uint8* row;  // this query block's states (ON only)

    __device__ __forceinline__ KeyBlockMap(const VariantParams& v_, int b, int h, int m_block)
        : v(v_), row(ON ? v_.block_map + b * v_.block_map_batch_stride + h * v_.block_map_head_stride +
                              int64(m_block) * v_.block_map_row_stride
                        : nullptr) {}

    __device__ __forceinline__ int state(int n) const {
        return ON ? int(__ldg(row + int64(n) * v.block_map_col_stride)) : BLOCK_PARTIAL;
    }
    // The visited block below n: the largest n' in [begin, n) whose tile is not
    // empty, or begin - 1 if none (warp-uniform: first_kept_block).
    __device__ __forceinline__ int prev(int n, int begin) const {
        if constexpr (!ON) return n - 1;
        else return first_kept_block<-1>(row, v.block_map_col_stride, begin, n);
    }
};

// The same map seen from one key block of one batch entry (the backward's dK/dV
// kernel, whose block loops over the query blocks of several query heads): the map at
// that kernel's tile (kv_block_map), read down a column.
template <int VARIANT>
struct QueryBlockMap {
    static constexpr bool ON = (VARIANT & VAR_BLOCK_MAP) != 0;
    static_assert(!ON || (VARIANT & VAR_MASK) != 0, "a block map needs the mask");
    const VariantParams& v;
    const uint8* col;  // this key block's states of head 0 (ON only)

    __device__ __forceinline__ QueryBlockMap(const VariantParams& v_, int b, int n_block)
        : v(v_), col(ON ? v_.kv_block_map + b * v_.kv_block_map_batch_stride +
                              int64(n_block) * v_.kv_block_map_col_stride
                        : nullptr) {}

    __device__ __forceinline__ const uint8* head(int h) const { return col + h * v.kv_block_map_head_stride; }
    __device__ __forceinline__ int state(int h, int m) const {
        return ON ? int(__ldg(head(h) + int64(m) * v.kv_block_map_row_stride)) : BLOCK_PARTIAL;
    }
    // (h, m) moved on to the first visited (head, query block) at or after it, in the
    // order heads h .. h_end - 1, each its blocks [begin, end) (m < end or m = begin on
    // a new head): the first whose tile is not empty; h = h_end if none is left.
    // Without the bit every block is visited: (h, m) stays. Warp-uniform (first_kept_block).
    __device__ __forceinline__ void seek(int& h, int& m, int h_end, int begin, int end) const {
        if constexpr (ON) {
            for (; h < h_end; ++h, m = begin) {
                m = first_kept_block<1>(head(h), v.kv_block_map_row_stride, m, end);
                if (m < end) return;
            }
        }
    }
};

// Which keys each query row of one sequence sees.
template <bool IS_CAUSAL, int VARIANT>
struct Mask {
    static constexpr bool WINDOW = (VARIANT & VAR_WINDOW) != 0;
    static constexpr bool HAS_RIGHT = IS_CAUSAL || WINDOW;  // a right edge may exist
    int seqlen_k, off;  // off = seqlen_k - seqlen_q
    int left, right;    // window edges clamped to seqlen_q + seqlen_k (= unbounded)

    __device__ __forceinline__ Mask(const VariantParams& v, int seqlen_q, int seqlen_k_)
        : seqlen_k(seqlen_k_), off(seqlen_k_ - seqlen_q) {
        const int far = seqlen_q + seqlen_k_;
        left = WINDOW && v.window_left >= 0 ? min(v.window_left, far) : far;
        right = IS_CAUSAL ? 0 : WINDOW && v.window_right >= 0 ? min(v.window_right, far) : far;
    }

    // Row i sees keys [col_begin(i), col_end(i)).
    __device__ __forceinline__ int col_begin(int row) const { return WINDOW ? max(0, row + off - left) : 0; }
    __device__ __forceinline__ int col_end(int row) const {
        return HAS_RIGHT ? min(seqlen_k, max(0, row + off + right + 1)) : seqlen_k;
    }
    __device__ __forceinline__ bool visible(int row, int col) const {
        return col < col_end(row) && (!WINDOW || col >= col_begin(row));
    }

    // Whether rows [row_first, row_last] see none of keys [col_first, col_last] (each
    // row sees some key of the block range being visited).
    __device__ __forceinline__ bool none_visible(int row_first, int row_last, int col_first, int col_last) const {
        return (HAS_RIGHT && col_first > row_last + off + right) || (WINDOW && col_last < row_first + off - left);
    }

    // Key blocks of block_n keys that rows [m0, m0 + block_m) see.
    __device__ __forceinline__ BlockRange key_blocks(int m0, int block_m, int block_n) const {
        BlockRange r;
        r.end = ceil_div(col_end(m0 + block_m - 1), block_n);
        r.unmasked_end = col_end(m0) / block_n;  // whole blocks before the first row's right edge
        if (WINDOW) {
            r.begin = col_begin(m0) / block_n;
            r.unmasked_begin = ceil_div(col_begin(m0 + block_m - 1), block_n);
            r.clamp();
        } else {  // ends >= 0 as computed; the beginnings known to be 0
            r.begin = r.unmasked_begin = 0;
            r.unmasked_end = min(r.unmasked_end, r.end);
        }
        return r;
    }

    // Query blocks of block_m rows (num_m_blocks of them) that see keys [n0, n0 + block_n);
    // keys_valid < block_n (the key tail) masks every one.
    __device__ __forceinline__ BlockRange query_blocks(int n0, int block_n, int keys_valid, int block_m,
                                                       int num_m_blocks) const {
        BlockRange r;
        r.begin = HAS_RIGHT ? max(0, n0 - off - right) / block_m : 0;
        r.end = WINDOW ? min(num_m_blocks, floor_div(n0 + block_n - 1 - off + left, block_m) + 1) : num_m_blocks;
        if (keys_valid <= 0) r.end = 0;
        r.unmasked_begin = HAS_RIGHT ? ceil_div(max(0, n0 + block_n - 1 - off - right), block_m) : 0;
        r.unmasked_end = WINDOW ? floor_div(n0 - off + left + 1, block_m) : num_m_blocks;
        if (keys_valid < block_n) r.unmasked_end = r.unmasked_begin = 0;
        r.clamp();
        return r;
    }
};

// tanh on the special-function unit (sm_75+), as flash-attention's softcap.
__device__ __forceinline__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

template <bool C, typename A, typename B> struct Select { using type = A; };
template <typename A, typename B> struct Select<false, A, B> { using type = B; };

__device__ __forceinline__ float load_float(const float* p) { return __ldg(p); }
__device__ __forceinline__ float load_float(const __half* p) { return __half2float(__ldg(p)); }
__device__ __forceinline__ float load_float(const __nv_bfloat16* p) {
    return __uint_as_float(uint32(__ldg(reinterpret_cast<const unsigned short*>(p))) << 16);
}
// Element e of a pair of T in one word (element 0 in the low half).
template <typename T> __device__ __forceinline__ float pair_float(uint32 u, int e);
template <> __device__ __forceinline__ float pair_float<__half>(uint32 u, int e) {
    return __half2float(__ushort_as_half((unsigned short)(e ? u >> 16 : u)));
}
template <> __device__ __forceinline__ float pair_float<__nv_bfloat16>(uint32 u, int e) {
    return __uint_as_float(e ? u & 0xffff0000u : u << 16);
}

// Raw q·k -> the score in log2 units, for the rows of one (batch, head). The
// scales and strides stay references to the kernel's params (constant-bank
// operands, no registers); only ALiBi's per-head slope and the bias/mask
// pointers of this (batch, head) are held. T: the kernel's element type (a
// VAR_BIAS bias has it).
//
// Bias and mask are read at (row, col) clamped into the sequence: rows past
// seqlen_q (a tail block's, never stored) and keys past seqlen_k (masked by Mask)
// read a valid element instead of branching.
template <int VARIANT, typename T>
struct ScoreMod {
    static constexpr bool SOFTCAP = (VARIANT & VAR_SOFTCAP) != 0;
    static constexpr bool ALIBI = (VARIANT & VAR_ALIBI) != 0;
    static constexpr bool BIAS = (VARIANT & (VAR_BIAS | VAR_BIAS_FP32)) != 0;
    static constexpr bool MASK = (VARIANT & VAR_MASK) != 0;
    static constexpr bool BIAS_OR_MASK = BIAS || MASK;
    using BiasT = typename Select<(VARIANT & VAR_BIAS_FP32) != 0, float, T>::type;
    const VariantParams& v;
    const float& softmax_scale_log2;
    float slope_log2;      // alibi slope·log2(e) (alibi only)
    int off;               // seqlen_k - seqlen_q (alibi only)
    int last_row, last_col;  // seqlen_q - 1, seqlen_k - 1 (bias, mask only)
    const BiasT* bias;     // this (batch, head)'s bias (bias only)
    const uint8* keep;     // this (batch, head)'s mask (mask only)

    __device__ __forceinline__ ScoreMod(const VariantParams& v_, const float& softmax_scale_log2_, int b, int h,
                                        int seqlen_q, int seqlen_k)
        : v(v_), softmax_scale_log2(softmax_scale_log2_),
          slope_log2(ALIBI ? __ldg(v_.alibi_slopes + b * v_.alibi_batch_stride + h) * LOG2E : 0.f),
          off(seqlen_k - seqlen_q), last_row(seqlen_q - 1), last_col(seqlen_k - 1),
          bias(BIAS ? static_cast<const BiasT*>(v_.attn_bias) + b * v_.bias_batch_stride + h * v_.bias_head_stride
                    : nullptr),
          keep(MASK ? v_.attn_mask + b * v_.mask_batch_stride + h * v_.mask_head_stride : nullptr) {}

    // The score before the bias and mask (softcap, ALiBi), log2 units.
    __device__ __forceinline__ float scaled(float s, int row, int col) const {
        const float x = SOFTCAP ? v.softcap_log2 * fast_tanh(s * v.softcap_scale) : s * softmax_scale_log2;
        return ALIBI ? fmaf(-slope_log2, float(abs(row + off - col)), x) : x;
    }

    // ALiBi along a line of elements (one fragment row of a tile) whose distances
    // d = row + off - col are d0 - c, c a compile-time offset of each element (8 j + e
    // in score_tile's layout). scaled() above pays IADD3, IABS, I2FP and FFMA per score
    // for -slope·|d|. Where every element of the line that the mask shows lies on one
    // side of the diagonal (side = +1: d >= 0; -1: d <= 0; alibi_side), the term is
    // linear in c: -side·slope·(d0 - c) = base + side·slope·c, base = -side·slope·d0 once
    // per line; the score is then scaled's own FFMA with base as its addend and one
    // FFMA with c an immediate (LINEAR). Else each element keeps scaled()'s abs.
    struct AlibiLine {
        float base, slope;  // LINEAR: -side·slope·d0 and side·slope (slope·log2(e) units)
    };
    template <bool LINEAR>
    __device__ __forceinline__ AlibiLine alibi_line(int d0, float side_slope) const {
        return {LINEAR ? -side_slope * float(d0) : 0.f, side_slope};
    }
    // scaled() of (row, col), element c of line a: the linear form with ALiBi and LINEAR,
    // else scaled(s, row, col).
    template <bool LINEAR>
    __device__ __forceinline__ float scaled(float s, const AlibiLine& a, int c, int row, int col) const {
        if constexpr (ALIBI && LINEAR) {
            const float x = SOFTCAP ? fmaf(v.softcap_log2, fast_tanh(s * v.softcap_scale), a.base)
                                    : fmaf(s, softmax_scale_log2, a.base);
            return c == 0 ? x : fmaf(a.slope, float(c), x);
        } else {
            return scaled(s, row, col);
        }
    }

    // The whole score, the bias and mask read here element by element (the forward
    // reads them a key block ahead instead: ScoreTerms). ATTN_MASK false: the mask
    // keeps the whole tile (the block map's FULL) and is not read.
    template <bool ATTN_MASK = true>
    __device__ __forceinline__ float score(float s, int row, int col) const {
        return with_terms<ATTN_MASK>(scaled(s, row, col), row, col);
    }
    // x (scaled()'s) with the bias and mask of (row, col) read here (ATTN_MASK as score's).
    template <bool ATTN_MASK = true>
    __device__ __forceinline__ float with_terms(float x, int row, int col) const {
        if constexpr (BIAS) {
            const int64 r = min(row, last_row), c = min(col, last_col);
            x = fmaf(load_float(bias + r * v.bias_row_stride + c * v.bias_col_stride), LOG2E, x);
        }
        return ATTN_MASK ? keep_masked(x, row, col) : x;
    }
    __device__ __forceinline__ float operator()(float s, int row, int col) const { return score(s, row, col); }
    // d(score)/d(softmax_scale·s) relative to the plain one: 1 - tanh² with softcap
    // (the kernels multiply dS by softmax_scale at the end, as without variants).
    __device__ __forceinline__ float dscore(float s) const {
        if (!SOFTCAP) return 1.f;
        const float th = fast_tanh(s * v.softcap_scale);
        return fmaf(-th, th, 1.f);
    }
    // x, or -inf where the mask hides (row, col) (read clamped, as operator()'s).
    __device__ __forceinline__ float keep_masked(float x, int row, int col) const {
        if constexpr (MASK) {
            const int64 r = min(row, last_row), c = min(col, last_col);
            if (!__ldg(keep + r * v.mask_row_stride + c * v.mask_col_stride)) x = NEG_INF;
        }
        return x;
    }
};

// The backward's P = exp2(x - lse_log2), never above 1 (at extreme logits lse_log2
// differs from the forward's row maximum by its rounding).
__device__ __forceinline__ float prob(float x, float lse_log2) { return fast_exp2(fminf(x - lse_log2, 0.f)); }

// One fragment row of an mma accumulator tile (s[j][2 half + e]: n-tile j, columns
// col0 + 8 j + e) in log2 units, masked (MASKED: the block needs it); row is its query
// row in the sequence; score(x, j, e): the raw score of (j, e) in log2 units.
template <bool MASKED, bool IS_CAUSAL, int VARIANT, int N_TILES, typename Score>
__device__ __forceinline__ void score_row_by(float (&s)[N_TILES][4], int half, const Mask<IS_CAUSAL, VARIANT>& mask,
                                             int row, int col0, const Score& score) {
    int begin = 0, end = 0;
    if (MASKED) { begin = mask.col_begin(row); end = mask.col_end(row); }
#pragma unroll
    for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = col0 + j * 8 + e;
            float& x = s[j][half * 2 + e];
            x = score(x, j, e);
            if (MASKED && (col >= end || (Mask<IS_CAUSAL, VARIANT>::WINDOW && col < begin))) x = NEG_INF;
        }
    }
}

// The side of the diagonal on which the elements of rows [row_first, row_last] x columns
// [col_first, col_last] lie, for ALiBi's linear form (ScoreMod::AlibiLine): +1 where
// every one that the mask shows has row + off - col >= 0, -1 where every one has <= 0,
// 0 where they straddle. off is the ScoreMod's (the one alibi_line's base is taken
// with), never the mask's: a kernel may build its Mask from zero lengths for a block
// without mask code (flash_bwd_sm90.cu's dQ kernel), whose off and edges are then not
// the sequence's. The elements the mask hides do not count (MASKED: the window's and
// right edge's clamps): their scores become -inf. A block run without mask code
// (!MASKED) shows every element of its rows < seqlen_q, so the clamps change nothing
// there and are not applied (its rows past seqlen_q, whose scores need only be finite,
// count with the rest). With causal every shown element has col <= row + off: +1 with
// no test.
template <bool MASKED, bool IS_CAUSAL, int VARIANT>
__device__ __forceinline__ int alibi_side(const Mask<IS_CAUSAL, VARIANT>& mask, int off, int row_first,
                                          int row_last, int col_first, int col_last) {
    using MaskT = Mask<IS_CAUSAL, VARIANT>;
    if constexpr (IS_CAUSAL) {
        return 1;
    } else {
        int lo = row_first + off - col_last, hi = row_last + off - col_first;
        if (MASKED && MaskT::HAS_RIGHT) lo = max(lo, -mask.right);  // shown: col <= row + off + right
        if (MASKED && MaskT::WINDOW) hi = min(hi, mask.left);       // shown: col >= row + off - left
        return lo >= 0 ? 1 : hi <= 0 ? -1 : 0;
    }
}

// score_row_by with ALiBi on the row's line (LINEAR: side_slope = side·slope_log2 of
// alibi_side), then terms(x, j, e): x with the bias and mask of (j, e).
template <bool MASKED, bool LINEAR, int N_TILES, typename Mod, typename MaskT, typename Terms>
__device__ __forceinline__ void alibi_score_row(float (&s)[N_TILES][4], int half, const Mod& mod, const MaskT& mask,
                                                int row, int col0, float side_slope, const Terms& terms) {
    const auto line = mod.template alibi_line<LINEAR>(row + mod.off - col0, side_slope);
    score_row_by<MASKED>(s, half, mask, row, col0, [&](float x, int j, int e) {
        return terms(mod.template scaled<LINEAR>(x, line, j * 8 + e, row, col0 + j * 8 + e), j, e);
    });
}

template <bool MASKED, bool ATTN_MASK = true, bool IS_CAUSAL, int VARIANT, int N_TILES, typename T>
__device__ __forceinline__ void score_row(float (&s)[N_TILES][4], int half, const ScoreMod<VARIANT, T>& mod,
                                          const Mask<IS_CAUSAL, VARIANT>& mask, int row, int col0) {
    if constexpr (ScoreMod<VARIANT, T>::ALIBI) {
        const auto terms = [&](float x, int j, int e) {
            return mod.template with_terms<ATTN_MASK>(x, row, col0 + j * 8 + e);
        };
        const int side = alibi_side<MASKED>(mask, mod.off, row, row, col0, col0 + 8 * (N_TILES - 1) + 1);
        if (side != 0) {
            alibi_score_row<MASKED, true>(s, half, mod, mask, row, col0, side > 0 ? mod.slope_log2 : -mod.slope_log2,
                                          terms);
        } else {
            alibi_score_row<MASKED, false>(s, half, mod, mask, row, col0, 0.f, terms);
        }
    } else {
        score_row_by<MASKED>(s, half, mask, row, col0, [&](float x, int j, int e) {
            return mod.template score<ATTN_MASK>(x, row, col0 + j * 8 + e);
        });
    }
}

// The rows of a tile set in score_tile's layout through alibi_score_row (LINEAR as
// there); terms(x, i, half, j, e, row, col): x with the bias and mask of the element.
template <bool MASKED, bool LINEAR, int M_TILES, int N_TILES, typename Mod, typename MaskT, typename Terms>
__device__ __forceinline__ void alibi_tile_rows(float (&s)[M_TILES][N_TILES][4], const Mod& mod, const MaskT& mask,
                                                int row0, int col0, float side_slope, const Terms& terms) {
#pragma unroll
    for (int i = 0; i < M_TILES; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + i * 16 + half * 8;
            alibi_score_row<MASKED, LINEAR>(s[i], half, mod, mask, row, col0, side_slope,
                                            [&](float x, int j, int e) {
                                                return terms(x, i, half, j, e, row, col0 + j * 8 + e);
                                            });
        }
}

// score_tile with ALiBi: the linear form where this thread's part of the block lies on
// one side of the diagonal (alibi_side: one test per block and thread, none with
// causal), else the abs; terms as alibi_tile_rows'.
template <bool MASKED, int M_TILES, int N_TILES, typename Mod, typename MaskT, typename Terms>
__device__ __forceinline__ void alibi_score_tile(float (&s)[M_TILES][N_TILES][4], const Mod& mod, const MaskT& mask,
                                                 int row0, int col0, const Terms& terms) {
    const int side = alibi_side<MASKED>(mask, mod.off, row0, row0 + 16 * (M_TILES - 1) + 8, col0,
                                        col0 + 8 * (N_TILES - 1) + 1);
    if (side != 0) {
        alibi_tile_rows<MASKED, true>(s, mod, mask, row0, col0, side > 0 ? mod.slope_log2 : -mod.slope_log2, terms);
    } else {
        alibi_tile_rows<MASKED, false>(s, mod, mask, row0, col0, 0.f, terms);
    }
}

// Scores of an mma accumulator tile set -> log2 units, masked (MASKED: the block
// needs it). s[i][j][e]: m-tile i, n-tile j, element e (rows row0 + 16 i (+ 8 for
// e >= 2), columns col0 + 8 j + (e & 1)); row0, col0 are this lane's in the sequence.
// ATTN_MASK false: the block's mask is all True (not read).
template <bool MASKED, bool ATTN_MASK = true, bool IS_CAUSAL, int VARIANT, int M_TILES, int N_TILES, typename T>
__device__ __forceinline__ void score_tile(float (&s)[M_TILES][N_TILES][4], const ScoreMod<VARIANT, T>& mod,
                                           const Mask<IS_CAUSAL, VARIANT>& mask, int row0, int col0) {
    if constexpr (ScoreMod<VARIANT, T>::ALIBI) {
        alibi_score_tile<MASKED>(s, mod, mask, row0, col0, [&](float x, int, int, int, int, int row, int col) {
            return mod.template with_terms<ATTN_MASK>(x, row, col);
        });
    } else {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                score_row<MASKED, ATTN_MASK>(s[i], half, mod, mask, row0 + i * 16 + half * 8, col0);
    }
}

// Plain scores: a variant that leaves q·k as it is up to softmax_scale (a window and
// sinks act on the mask and the denominator, not on the score). The ws forward keeps them
// raw through the mask (fwd_score_tile) and folds the scale into the softmax's exp2s
// (online_softmax.cuh's RAW): one FFMA a score instead of an FMUL and an FADD (PERF.md
// v27). Not dropout: the Philox state beside it spills at 192 rows (16-44 bytes).
template <int VARIANT>
constexpr bool RAW_SCORES =
    (VARIANT & (VAR_SOFTCAP | VAR_ALIBI | VAR_BIAS | VAR_BIAS_FP32 | VAR_MASK | VAR_DROPOUT)) == 0;

// The scores a forward's softmax takes: with RAW, raw q·k with only the mask applied
// (MASKED: the block needs it; a hidden score becomes -inf); else score_tile's (with
// terms, the bias and mask of a key block, when given; ATTN_MASK as score_tile's).
template <bool MASKED, bool RAW, bool ATTN_MASK = true, bool IS_CAUSAL, int VARIANT, int M_TILES, int N_TILES,
          typename T, typename... Terms>
__device__ __forceinline__ void fwd_score_tile(float (&s)[M_TILES][N_TILES][4], const ScoreMod<VARIANT, T>& mod,
                                               const Mask<IS_CAUSAL, VARIANT>& mask, int row0, int col0,
                                               const Terms&... terms) {
    if constexpr (RAW) {
        static_assert(RAW_SCORES<VARIANT>, "raw scores are plain scores");
        if constexpr (MASKED) {
#pragma unroll
            for (int i = 0; i < M_TILES; ++i)
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    score_row_by<true>(s[i], half, mask, row0 + i * 16 + half * 8, col0,
                                       [](float x, int, int) { return x; });
        }
    } else {
        score_tile<MASKED, ATTN_MASK>(s, mod, mask, row0, col0, terms...);
    }
}

// The bias and mask of one key block at a thread's fragment rows (score_tile's layout:
// rows row0 + 16 i + 8 half, columns col0 + 8 j + e), read into registers by load()
// before the block's scores exist, so that the loads' latency hides under the S GEMM
// (the bias stream is as long as the GEMM's at D=64). Each fragment row's pointer is
// set once (its row clamped as ScoreMod's), and a block's columns are 32-bit offsets
// from it. Unless VAR_BIAS_STRIDED, the plan has found the column stride 1 and every
// row's element pairs aligned: a fragment's two adjacent columns are one 4-byte load
// (8 with an fp32 bias; 2 for the mask). Keys past seqlen_k (MASKED blocks only; Mask
// hides them) are not read.
template <int VARIANT, typename T, int M_TILES, int N_TILES>
struct ScoreTerms {
    using Mod = ScoreMod<VARIANT, T>;
    using BiasT = typename Mod::BiasT;
    static constexpr bool BIAS = Mod::BIAS, MASK = Mod::MASK, ANY = Mod::BIAS_OR_MASK;
    static constexpr bool PAIRED = (VARIANT & VAR_BIAS_STRIDED) == 0;
    static constexpr bool FP32 = sizeof(BiasT) == 4;
    // a bias pair: two T in one word, or two floats
    using BiasPair = typename Select<FP32, float2, uint32>::type;

    static constexpr int STAGE_BYTES = 0;  // no shared memory (StagedScoreTerms' interface)

    const Mod& mod;
    const BiasT* bias_row[M_TILES][2];
    const uint8* keep_row[M_TILES][2];
    // one key block's values: pairs (PAIRED) or elements
    BiasPair bias_pair[M_TILES][2][N_TILES];
    uint32 keep_pair[M_TILES][2][N_TILES];
    float bias_elem[M_TILES][2][N_TILES][2];
    uint32 keep_elem[M_TILES][2][N_TILES][2];

    // (KeyBlockTerms' form: the (batch, head), the block's first row m0, this lane's first
    // fragment row r0 in the block, a shared window it does not use)
    __device__ __forceinline__ ScoreTerms(const Mod& mod_, int, int, int m0, int r0, uint32)
        : ScoreTerms(mod_, m0 + r0) {}
    __device__ __forceinline__ ScoreTerms(const Mod& mod_, int row0) : mod(mod_) {
        if constexpr (ANY) {
#pragma unroll
            for (int i = 0; i < M_TILES; ++i)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int64 r = min(row0 + i * 16 + half * 8, mod.last_row);
                    if (BIAS) bias_row[i][half] = mod.bias + r * mod.v.bias_row_stride;
                    if (MASK) keep_row[i][half] = mod.keep + r * mod.v.mask_row_stride;
                }
        }
    }

    // StagedScoreTerms' copy into shared memory: nothing to do here.
    __device__ __forceinline__ void stage_in(int, int, bool = true) {}

    // Read the key block whose fragment columns start at col0 (even); (the stage: unused).
    // ATTN_MASK false: the block's mask is all True (KeyBlockMap's FULL): not read.
    template <bool MASKED, bool ATTN_MASK = true>
    __device__ __forceinline__ void load(int col0, int = 0) {
        if constexpr (BIAS || (MASK && ATTN_MASK)) {
#pragma unroll
            for (int i = 0; i < M_TILES; ++i)
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                    for (int j = 0; j < N_TILES; ++j) {
                        const int c = col0 + j * 8;
                        if constexpr (PAIRED) load_pair<MASKED, ATTN_MASK>(i, half, j, c);
                        else {
#pragma unroll
                            for (int e = 0; e < 2; ++e)
                                load_elem<ATTN_MASK>(i, half, j, e, min(c + e, mod.last_col));
                        }
                    }
        }
    }

    // x (the score before the bias and mask, log2 units) with the loaded block's terms
    // (ATTN_MASK as for load()).
    template <bool ATTN_MASK = true>
    __device__ __forceinline__ float apply(float x, int i, int half, int j, int e) const {
        if constexpr (BIAS) x = fmaf(bias(i, half, j, e), LOG2E, x);
        if constexpr (MASK && ATTN_MASK) {
            const bool keep = PAIRED ? (keep_pair[i][half][j] >> (8 * e)) & 0xffu : keep_elem[i][half][j][e];
            if (!keep) x = NEG_INF;
        }
        return x;
    }

  private:
    template <bool MASKED, bool ATTN_MASK>
    __device__ __forceinline__ void load_pair(int i, int half, int j, int c) {
        // The key tail (MASKED blocks): column c alone if it exists; c + 1 is hidden.
        const bool pair = !MASKED || c < mod.last_col;
        if constexpr (BIAS) {
            const BiasT* p = bias_row[i][half] + c;
            if constexpr (FP32) {
                bias_pair[i][half][j] = ld_nc_f32x2(p, pair);
                if (MASKED) bias_pair[i][half][j].x += ld_nc_f32(p, c == mod.last_col);
            } else {
                bias_pair[i][half][j] = ld_nc_u32(p, pair);
                if (MASKED) bias_pair[i][half][j] |= ld_nc_u16(p, c == mod.last_col);
            }
        }
        if constexpr (MASK && ATTN_MASK) {
            const uint8* p = keep_row[i][half] + c;
            keep_pair[i][half][j] = ld_nc_u16(p, pair);
            if (MASKED) keep_pair[i][half][j] |= ld_nc_u8(p, c == mod.last_col);
        }
    }
    template <bool ATTN_MASK>
    __device__ __forceinline__ void load_elem(int i, int half, int j, int e, int c) {
        if (BIAS) bias_elem[i][half][j][e] = load_float(bias_row[i][half] + int64(c) * mod.v.bias_col_stride);
        if (MASK && ATTN_MASK) keep_elem[i][half][j][e] = __ldg(keep_row[i][half] + int64(c) * mod.v.mask_col_stride);
    }
    __device__ __forceinline__ float bias(int i, int half, int j, int e) const {
        if constexpr (!PAIRED) return bias_elem[i][half][j][e];
        else if constexpr (FP32) return e ? bias_pair[i][half][j].y : bias_pair[i][half][j].x;
        else return pair_float<T>(bias_pair[i][half][j], e);
    }
};

// score_tile with the bias and mask of terms (ScoreTerms or StagedScoreTerms, loaded
// for this key block); ATTN_MASK false: the block's mask is all True (not applied).
template <bool MASKED, bool ATTN_MASK = true, bool IS_CAUSAL, int VARIANT, int M_TILES, int N_TILES, typename T,
          typename Terms>
__device__ __forceinline__ void score_tile(float (&s)[M_TILES][N_TILES][4], const ScoreMod<VARIANT, T>& mod,
                                           const Mask<IS_CAUSAL, VARIANT>& mask, int row0, int col0,
                                           const Terms& terms) {
    if constexpr (ScoreMod<VARIANT, T>::ALIBI) {
        alibi_score_tile<MASKED>(s, mod, mask, row0, col0, [&](float x, int i, int half, int j, int e, int, int) {
            return terms.template apply<ATTN_MASK>(x, i, half, j, e);
        });
    } else {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + i * 16 + half * 8;
                score_row_by<MASKED>(s[i], half, mask, row, col0, [&](float x, int j, int e) {
                    return terms.template apply<ATTN_MASK>(mod.scaled(x, row, col0 + j * 8 + e), i, half, j, e);
                });
            }
    }
}

// One key block's bias or mask in shared memory (StagedScoreTerms): ROWS x COLS
// elements of E bytes, rows of 16-byte chunks with no padding (the D=64 wgmma kernel
// keeps its two blocks per SM with three stages of a bf16 bias only so), chunk c of
// row r stored at chunk c ^ key(r). In score_tile's layout the 4 lanes of a fragment
// row read 8 E bytes of it at once (SPAN chunks, or half of one) and the 8 rows of a
// warp's phase must fall in 8 different 16-byte bank groups of the 128-byte bank line:
// ROWS_PER_LINE rows share a line (short rows), the others differ in key(r). key is
// the same for rows r and r + 8 (every fragment row of a lane: one key per lane).
template <int E, int ROWS, int COLS>
struct StageTile {
    static constexpr int ELEM = E;
    static constexpr int ROW_BYTES = COLS * E;
    static constexpr int CHUNKS = ROW_BYTES / 16;
    static constexpr int BYTES = ROWS * ROW_BYTES;
    static constexpr int ROWS_PER_LINE = CHUNKS >= 8 ? 1 : 8 / CHUNKS;
    static constexpr int SPAN = E == 4 ? 2 : 1;  // chunks one fragment row's lanes read (fp32: 8-byte lanes)
    static constexpr int KEYS = CHUNKS < 8 ? CHUNKS : 8;
    static_assert(ROW_BYTES % 16 == 0 && CHUNKS >= 2, "a stage row is whole 16-byte chunks, at least two");
    static_assert(ROW_BYTES % 16 == 0 && CHUNKS >= 2, "a stage row is whole 16-byte chunks, at least two");
    static_assert(8 / ROWS_PER_LINE * SPAN % KEYS == 0, "key(r + 8) == key(r)");

    __device__ static __forceinline__ uint32 key(int row) { return uint32(row / ROWS_PER_LINE * SPAN % KEYS); }
    __device__ static __forceinline__ uint32 offset(int row, int chunk) {
        return uint32(row * ROW_BYTES) + ((uint32(chunk) ^ key(row)) << 4);
    }
    // Byte offset of fragment column 8 j (+ 2 t, added by the caller) in a row whose
    // key, shifted to bytes, is key16 (chunk bits only: the lane's offset 2 E t never
    // carries into them, since key is a multiple of SPAN).
    __device__ static __forceinline__ uint32 column(int j, uint32 key16) {
        return ((uint32(8 * E * j) & ~15u) ^ key16) + (uint32(8 * E * j) & 15u);
    }
};

// The bias and mask tile of BLOCK_M query rows x BLOCK_N keys in shared memory: one
// stage of it (the bias's StageTile, then the mask's) and its copy. copy() moves the
// tile of rows m0 .. and keys n0 .. with coalesced 16-byte cp.async (the NUM_THREADS
// threads of the block all call it; the caller commits it in the group of the GEMM
// operands of the same block, waits and synchronises). The plan has found the column
// stride 1 and every row 16-byte aligned (dispatch.score_vec_ok). Rows past seqlen_q
// read row seqlen_q - 1 (as ScoreMod's clamp); keys past seqlen_k are zero-filled
// (cp.async's src-size: nothing past the row is read; Mask hides them). A
// row-broadcast array (row stride 0: a (B, 1, 1, N) padding mask) is copied as its one
// row, and every reader reads that row. Shared by the forward (a key block per stage,
// issued with K) and the backward (the dK/dV kernels: a query block per stage, issued
// with Q and dO; the dQ kernels: a key block, with K).
template <int VARIANT, typename T, int BLOCK_M, int BLOCK_N, int NUM_THREADS>
struct ScoreTileStage {
    using Mod = ScoreMod<VARIANT, T>;
    using BiasT = typename Mod::BiasT;
    static constexpr bool BIAS = Mod::BIAS, MASK = Mod::MASK;
    using BiasTile = StageTile<int(sizeof(BiasT)), BLOCK_M, BLOCK_N>;
    using KeepTile = StageTile<1, BLOCK_M, BLOCK_N>;
    static constexpr int KEEP_OFFSET = BIAS ? BiasTile::BYTES : 0;  // in a stage: the bias tile, then the mask's
    static constexpr int STAGE_BYTES = KEEP_OFFSET + (MASK ? KeepTile::BYTES : 0);
    static_assert(Mod::BIAS_OR_MASK && (VARIANT & VAR_BIAS_STRIDED) == 0, "staged: a bias or mask, in 16-byte rows");

    // Copy (batch b, head h)'s tile at (m0, n0) into the stage at `base`; last_row,
    // last_col: seqlen_q - 1, seqlen_k - 1; keep false: the mask's tile is not copied
    // (all True: its reader skips it).
    __device__ static __forceinline__ void copy(uint32 base, const VariantParams& v, int b, int h, int m0, int n0,
                                                int last_row, int last_col, bool keep = true) {
        const int keys_valid = last_col + 1 - n0;
        if constexpr (BIAS) {
            copy_tile<BiasTile>(base, static_cast<const BiasT*>(v.attn_bias) + b * v.bias_batch_stride +
                                          h * v.bias_head_stride + n0, v.bias_row_stride, m0, last_row, keys_valid);
        }
        if constexpr (MASK) {
            if (keep) {
                copy_tile<KeepTile>(base + KEEP_OFFSET, v.attn_mask + b * v.mask_batch_stride +
                                                            h * v.mask_head_stride + n0,
                                    v.mask_row_stride, m0, last_row, keys_valid);
            }
        }
    }

  private:
    // The tile's chunks, NUM_THREADS at a time: chunk c of row r from global row
    // min(m0 + r, last_row) at keys 16 / E c ..; the bytes past the key tail zero-filled.
    template <typename Tile, typename E>
    __device__ static __forceinline__ void copy_tile(uint32 dst, const E* src, int64 row_stride, int m0,
                                                     int last_row, int keys_valid) {
        constexpr int CHUNKS = Tile::CHUNKS, PER_CHUNK = 16 / int(sizeof(E));
        constexpr int ROWS_PER_PASS = NUM_THREADS / CHUNKS;
        static_assert(NUM_THREADS % CHUNKS == 0, "whole rows of chunks per pass of the threads");
        int tid = threadIdx.x;
        asm volatile("" : "+r"(tid));  // (the rows' offsets recomputed per block, not held across the loop)
        const int c = tid % CHUNKS;
        const int bytes = min(max((keys_valid - c * PER_CHUNK) * int(sizeof(E)), 0), 16);
        const int rows = row_stride == 0 ? 1 : BLOCK_M;  // a broadcast row once
#pragma unroll
        for (int it = 0; it < (BLOCK_M + ROWS_PER_PASS - 1) / ROWS_PER_PASS; ++it) {
            const int r = tid / CHUNKS + it * ROWS_PER_PASS;
            if (r >= rows) break;
            const E* row = src + int64(min(m0 + r, last_row)) * row_stride;
            cp_async_16_bytes(dst + Tile::offset(r, c), bytes > 0 ? row + c * PER_CHUNK : row, bytes);
        }
    }
};

// One stage's bytes of a kernel's staged bias/mask tile: ScoreTileStage's where the
// plan stages it (VAR_BIAS_STAGED), else 0 (nothing instantiated).
template <bool STAGED, int VARIANT, typename T, int BLOCK_M, int BLOCK_N, int NUM_THREADS>
struct ScoreStageBytes { static constexpr int value = 0; };
template <int VARIANT, typename T, int BLOCK_M, int BLOCK_N, int NUM_THREADS>
struct ScoreStageBytes<true, VARIANT, T, BLOCK_M, BLOCK_N, NUM_THREADS> {
    static constexpr int value = ScoreTileStage<VARIANT, T, BLOCK_M, BLOCK_N, NUM_THREADS>::STAGE_BYTES;
};

// The bias and mask of one block, as ScoreTerms (same layout, same apply()), but read
// from a ScoreTileStage (ld.shared, conflict-free: StageTile): load() takes the stage
// whose copies landed, apply() reads this lane's pairs of it as the scores need them.
// The lane's fragment rows are r0 + 16 i + 8 half of the tile, its columns c0 + 8 j +
// 2 t (c0: its warp's first column in the tile, a multiple of the warp's 8 N_TILES
// columns, which are a power of two: the warp's chunks are XORed into the swizzle key,
// not added). The forward's form stages a key block of its own rows with stage_in().
template <int VARIANT, typename T, int M_TILES, int N_TILES, int BLOCK_M, int NUM_THREADS, int BLOCK_N = 8 * N_TILES>
struct StagedScoreTerms {
    using Stage = ScoreTileStage<VARIANT, T, BLOCK_M, BLOCK_N, NUM_THREADS>;
    using Mod = ScoreMod<VARIANT, T>;
    using BiasT = typename Mod::BiasT;
    static constexpr bool BIAS = Mod::BIAS, MASK = Mod::MASK;
    static constexpr bool FP32 = sizeof(BiasT) == 4;
    using BiasTile = typename Stage::BiasTile;
    using KeepTile = typename Stage::KeepTile;
    static constexpr int KEEP_OFFSET = Stage::KEEP_OFFSET;
    static constexpr int STAGE_BYTES = Stage::STAGE_BYTES;
    static_assert((8 * N_TILES & (8 * N_TILES - 1)) == 0 && BLOCK_N % (8 * N_TILES) == 0,
                  "a warp's columns: a power of two dividing the tile's");

    const Mod& mod;
    int b, h;                      // the (batch, head): its arrays' offsets are recomputed per copy
    int m0, r0;                    // the block's first row (forward); this lane's first fragment row in the tile
    int c0;                        // this warp's first column in the tile
    uint32 smem;                   // stage 0
    // set by load() for its block (recomputed there: the compiler would hold their
    // per-column sums across the key loop, 16-32 registers the D=64 kernel's two blocks
    // per SM do not have)
    uint32 bias_at[M_TILES][2];    // this lane's fragment rows in the block's bias tile, at its column 2 t
    uint32 keep_at[M_TILES][2];
    uint32 bias_key, keep_key;     // StageTile::key of those rows and the warp's chunks, in bytes

    __device__ __forceinline__ StagedScoreTerms(const Mod& mod_, int b_, int h_, int m0_, int r0_, uint32 smem_,
                                                int c0_ = 0)
        : mod(mod_), b(b_), h(h_), m0(m0_), r0(r0_), c0(c0_), smem(smem_) {}

    // Copy key block n of rows m0 .. into stage `stage` (the forward's; keep false: its
    // mask is all True, KeyBlockMap's FULL, and not copied).
    __device__ __forceinline__ void stage_in(int n, int stage, bool keep = true) {
        // (from the params, not ScoreMod's pointers: two registers fewer across the key loop)
        Stage::copy(smem + uint32(stage * STAGE_BYTES), mod.v, b, h, m0, n * BLOCK_N, mod.last_row, mod.last_col,
                    keep);
    }

    // Take the block in stage `stage` (its copies landed and are visible: the caller's
    // wait and barrier); apply() reads this lane's pairs of it as the scores need them
    // (no registers held across the S GEMM). (col0: ScoreTerms' interface.)
    template <bool MASKED, bool ATTN_MASK = true>
    __device__ __forceinline__ void load(int, int stage) {
        int row = r0;
        asm volatile("" : "+r"(row));  // opaque: recomputed per block
        const uint32 block = smem + uint32(stage * STAGE_BYTES);
        const int t = threadIdx.x % 4;
        if constexpr (BIAS) set_rows<BiasTile>(bias_at, bias_key, mod.v.bias_row_stride == 0, row, t, block);
        if constexpr (MASK && ATTN_MASK) set_rows<KeepTile>(keep_at, keep_key, mod.v.mask_row_stride == 0, row, t, block + KEEP_OFFSET);
    }

    // x (the score before the bias and mask, log2 units) with the taken block's terms.
    template <bool ATTN_MASK = true>
    __device__ __forceinline__ float apply(float x, int i, int half, int j, int e) const {
        // (Not volatile: the two elements of a pair share one load, and the loads
        // depend on load()'s opaque values, so they stay behind the caller's barrier.)
        if constexpr (BIAS) {
            const uint32 a = bias_at[i][half] + BiasTile::column(j, bias_key);
            if constexpr (FP32) {
                float2 b;
                asm("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(b.x), "=f"(b.y) : "r"(a));
                x = fmaf(e ? b.y : b.x, LOG2E, x);
            } else {
                uint32 u;
                asm("ld.shared.b32 %0, [%1];\n" : "=r"(u) : "r"(a));
                x = fmaf(pair_float<T>(u, e), LOG2E, x);
            }
        }
        if constexpr (MASK && ATTN_MASK) {
            uint32 u;
            asm("ld.shared.u16 %0, [%1];\n" : "=r"(u) : "r"(keep_at[i][half] + KeepTile::column(j, keep_key)));
            if (!((u >> (8 * e)) & 0xffu)) x = NEG_INF;
        }
        return x;
    }

  private:
    template <typename Tile>
    __device__ __forceinline__ void set_rows(uint32 (&at)[M_TILES][2], uint32& key16, bool broadcast,
                                                    int r0, int t, uint32 tile) const {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = broadcast ? 0 : r0 + i * 16 + half * 8;
                at[i][half] = tile + uint32(row * Tile::ROW_BYTES + 2 * Tile::ELEM * t);
            }
        // the warp's first chunk c0 E / 16 has no bits in common with the chunks of its
        // columns (a power of two span at a multiple of it): XORed, not added
        key16 = (broadcast ? 0u : Tile::key(r0) << 4) ^ uint32(c0 * Tile::ELEM);
    }
};

// A ScoreTileStage read transposed, for the wgmma dK/dV kernel, which computes Sᵀ (keys
// as rows): element (j, e) of its accumulator is key k0 + g + 8 (e / 2), query 8 j + 2 t
// + (e & 1) of the tile (k0: the warp's first key in the tile). One element per load:
// for each (j, e) the warp reads 4 query rows (2 t + (e & 1), whose StageTile keys are
// 2 t + (e & 1) apart: distinct chunks) of 8 adjacent keys, conflict-free for the
// 16-bit bias and the mask; fp32 rows (SPAN 2) pair up: 2-way. Each lane's four
// (e & 1, e / 2) addresses are set by load(); rows 8 j on are a fixed step (the
// StageTile key of rows r and r + 8 is the same), 0 for a row-broadcast array.
// BiasLayout: the bias tile's layout, the stage's StageTile (void), or (flash_bwd_ws.cu, whose
// producer copies it by TMA) its Swizzle128Tile (wgmma.cuh: 64-key column blocks, the
// same XOR of a row's 16-byte chunks by row % 8, so the same conflict-free reads).
template <typename Layout, typename Default> struct LayoutOr { using type = Layout; };
template <typename Default> struct LayoutOr<void, Default> { using type = Default; };
template <int VARIANT, typename T, int BLOCK_M, int BLOCK_N, int NUM_THREADS, typename BiasLayout = void>
struct StagedScoreTermsT {
    using Stage = ScoreTileStage<VARIANT, T, BLOCK_M, BLOCK_N, NUM_THREADS>;
    using Mod = ScoreMod<VARIANT, T>;
    using BiasT = typename Mod::BiasT;
    static constexpr bool BIAS = Mod::BIAS, MASK = Mod::MASK;
    static constexpr bool FP32 = sizeof(BiasT) == 4;
    using BiasTile = typename LayoutOr<BiasLayout, typename Stage::BiasTile>::type;
    static_assert(BiasTile::ELEM == int(sizeof(BiasT)), "the bias layout's element is the bias's");
    using KeepTile = typename Stage::KeepTile;

    uint32 bias_at[2][2], keep_at[2][2];  // [e & 1][e / 2]: the element of row j = 0
    uint32 bias_step, keep_step;          // bytes from row j to row j + 1 (8 query rows)

    // The stage at `tile` (its copies landed and are visible); k0: the warp's first key.
    // ATTN_MASK false: the tile's mask is all True (the block map's FULL; not copied, not read).
    template <bool ATTN_MASK = true>
    __device__ __forceinline__ void load(const VariantParams& v, uint32 tile, int k0) {
        int lane = threadIdx.x % 32;
        asm volatile("" : "+r"(lane));  // opaque: recomputed per block
        const int g = lane / 4, t = lane % 4;
        if constexpr (BIAS) set<BiasTile>(bias_at, bias_step, v.bias_row_stride == 0, tile, k0, g, t);
        if constexpr (MASK && ATTN_MASK) {
            set<KeepTile>(keep_at, keep_step, v.mask_row_stride == 0, tile + Stage::KEEP_OFFSET, k0, g, t);
        }
    }

    // x (the score before the bias and mask, log2 units) with element (j, e)'s terms
    // (ATTN_MASK as for load()).
    template <bool ATTN_MASK = true>
    __device__ __forceinline__ float apply(float x, int j, int e) const {
        if constexpr (BIAS) {
            const uint32 a = bias_at[e & 1][e / 2] + uint32(j) * bias_step;
            if constexpr (FP32) {
                float b;
                asm("ld.shared.f32 %0, [%1];\n" : "=f"(b) : "r"(a));
                x = fmaf(b, LOG2E, x);
            } else {
                uint32 u;
                asm("ld.shared.u16 %0, [%1];\n" : "=r"(u) : "r"(a));
                x = fmaf(pair_float<T>(u, 0), LOG2E, x);
            }
        }
        if constexpr (MASK && ATTN_MASK) {
            uint32 u;
            asm("ld.shared.u8 %0, [%1];\n" : "=r"(u) : "r"(keep_at[e & 1][e / 2] + uint32(j) * keep_step));
            if (!u) x = NEG_INF;
        }
        return x;
    }

  private:
    template <typename Tile>
    __device__ static __forceinline__ void set(uint32 (&at)[2][2], uint32& step, bool broadcast, uint32 tile,
                                               int k0, int g, int t) {
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = broadcast ? 0 : 2 * t + e1;
                const int byte = (k0 + 8 * h + g) * Tile::ELEM;  // the key's byte in its row
                at[e1][h] = tile + Tile::offset(row, byte / 16) + uint32(byte % 16);
            }
        step = broadcast ? 0u : Tile::offset(8, 0);  // (row 8 shares row 0's swizzle key)
    }
};

// The bias and mask of one key block for a forward kernel: staged through shared
// memory where the plan allows (VAR_BIAS_STAGED), else read into registers (ScoreTerms).
template <int VARIANT, typename T, int M_TILES, int N_TILES, int BLOCK_M, int NUM_THREADS>
using KeyBlockTerms = typename Select<(VARIANT & VAR_BIAS_STAGED) != 0,
                                      StagedScoreTerms<VARIANT, T, M_TILES, N_TILES, BLOCK_M, NUM_THREADS>,
                                      ScoreTerms<VARIANT, T, M_TILES, N_TILES>>::type;

// Set to -inf the scores at or past a per-row column limit: col_limit[i][half]
// is the first invisible key of fragment row (i, half). For kernels whose rows
// are not one query row each (the decode kernel's packed query heads).
template <int M_TILES, int N_TILES>
__device__ __forceinline__ void apply_col_limits(float (&s)[M_TILES][N_TILES][4], int col0,
                                                 const int (&col_limit)[M_TILES][2]) {
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (col0 + j * 8 + e >= col_limit[i][half]) s[i][j][half * 2 + e] = NEG_INF;
                }
            }
        }
    }
}

// The sink of head h in log2 units, or -inf (no sink: the running max starts there).
template <int VARIANT>
__device__ __forceinline__ float sink_log2(const VariantParams& v, int h) {
    return (VARIANT & VAR_SINKS) ? __ldg(v.sinks + h) * LOG2E : NEG_INF;
}

// ---------------------------------------------------------------------------
// Dropout: Philox4x32-7 (Salmon et al. 2011) exactly as cupyflash/_philox.py:
// key (seed lo, seed hi), counter (j >> 3, i, b·nheads_q + h, offset); 16-bit half
// j & 1 (low first) of word (j >> 1) & 3 decides column j, so one call decides the
// 8 columns of an n8 tile.
// ---------------------------------------------------------------------------
constexpr int PHILOX_ROUNDS = 7;  // cupyflash/_philox.py ROUNDS

__device__ __forceinline__ uint4 philox4x32(uint4 c, uint32 k0, uint32 k1) {
#pragma unroll
    for (int r = 0; r < PHILOX_ROUNDS; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const uint32 lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const uint32 lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

struct Dropout {
    uint32 k0, k1, bh, offset, threshold_hi;  // threshold_hi: the 16-bit threshold << 16
    float scale;  // 1 / (1 - p)

    __device__ __forceinline__ Dropout(const VariantParams& v, int b, int h, int nheads_q)
        : k0(uint32(v.dropout_seed)), k1(uint32(v.dropout_seed >> 32)), bh(uint32(b * nheads_q + h)),
          offset(v.dropout_offset), threshold_hi(v.dropout_threshold << 16), scale(v.dropout_scale) {}

    // The Philox words of columns 8c .. 8c + 7 of row i.
    __device__ __forceinline__ uint4 words(int row, int col8) const {
        // The round keys are rebuilt each call (12 adds): hoisted out of the loops
        // by the compiler, they would hold 12 registers.
        uint32 a = k0, b = k1;
        asm volatile("" : "+r"(a), "+r"(b));
        return philox4x32(make_uint4(uint32(col8), uint32(row), bh, offset), a, b);
    }
    // bit 0: the low half-word is kept, bit 1: the high one (h >= t iff h·2^16 >= t·2^16)
    __device__ __forceinline__ uint32 keep2(uint32 word) const {
        return uint32((word << 16) >= threshold_hi) | uint32(word >= threshold_hi) << 1;
    }
    // The keep bits of columns 8c .. 8c + 7 of row i (bit e: column 8c + e).
    __device__ __forceinline__ uint32 keep8(int row, int col8) const {
        const uint4 w = words(row, col8);
        return keep2(w.x) | keep2(w.y) << 2 | keep2(w.z) << 4 | keep2(w.w) << 6;
    }
    // The keep bits of columns col, col + 1 (col even) of row i: bits 0 and 1.
    __device__ __forceinline__ uint32 keep_pair(int row, int col) const {
        const uint4 w = words(row, col >> 3);
        const int q = (col >> 1) & 3;
        return keep2(q < 2 ? (q == 0 ? w.x : w.y) : (q == 2 ? w.z : w.w));
    }

    // Zero the dropped probabilities of an accumulator tile set (score_tile's layout),
    // with DropoutBits' shared Philox calls (below); every lane of the warp calls it.
    template <int M_TILES, int N_TILES>
    __device__ __forceinline__ void apply(float (&p)[M_TILES][N_TILES][4], int row0, int col0) const;
};

// ---------------------------------------------------------------------------
// Rows that are not one query row of one head each: the decode kernel's packed
// GQA rows (flash_decode.cu), where the two fragment rows g and g + 8 of an m16
// tile are each some query row of some head.
// ---------------------------------------------------------------------------

// score_tile for one m16 tile whose fragment rows g and g + 8 are query rows
// row_q[0] and row_q[1], each with its own head's score modifier (mod_lo, mod_hi:
// ALiBi slopes) and its own key range. Columns col0 + 8 j + (e & 1).
template <bool MASKED, bool IS_CAUSAL, int VARIANT, int N_TILES, typename T>
__device__ __forceinline__ void score_tile_rows(float (&s)[1][N_TILES][4], const ScoreMod<VARIANT, T>& mod_lo,
                                                const ScoreMod<VARIANT, T>& mod_hi,
                                                const Mask<IS_CAUSAL, VARIANT>& mask, const int (&row_q)[2],
                                                int col0) {
    score_row<MASKED>(s[0], 0, mod_lo, mask, row_q[0], col0);
    score_row<MASKED>(s[0], 1, mod_hi, mask, row_q[1], col0);
}

// The sinks of fragment rows g and g + 8 (heads head_lo, head_hi) joined to their
// row sums: acc_l is one m-tile's P·1 accumulator (elements 0, 1: row g; 2, 3: row
// g + 8) and row_max its running max, which started at those sinks
// (online_softmax.cuh); finalize then runs with no sink of its own. For rows whose
// heads differ, where OnlineSoftmax's one sink per tile does not apply.
template <int VARIANT>
__device__ __forceinline__ void add_sink_term(float (&acc_l)[1][4], const float (&row_max)[1][2],
                                              const VariantParams& v, int head_lo, int head_hi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float sink = sink_log2<VARIANT>(v, h ? head_hi : head_lo);
        if (sink != NEG_INF) {  // row_max >= sink: no -inf - -inf
            const float term = fast_exp2(sink - row_max[0][h]);
            acc_l[0][2 * h] += term;
            acc_l[0][2 * h + 1] += term;
        }
    }
}

// ---------------------------------------------------------------------------
// The backward's element pipeline (the mma.sync kernels of flash_bwd.cu), on S and
// dP accumulator tiles in score_tile's layout: s[i][j][e] at row row0 + 16 i (+ 8
// for e >= 2), column col0 + 8 j + (e & 1), row0 and col0 this lane's in the
// sequence, col0 even. With x the variant's masked score (log2 units), Z the
// dropout keep mask and rp = 1/(1-p) (cupyflash/reference.py):
//   P = prob(x, lse·log2e),  dV += (P∘Z·rp)ᵀ·dO,
//   dS = P∘(dP∘Z·rp − delta) (∘ (1 − tanh²) with softcap),  dK, dQ from dS
// (dbias, dS before the softcap factor, is flash_bwd_dbias.cu's: DbiasScores below).
// Without softcap, probs() turns S into P before dP = dO·Vᵀ (as without variants),
// and with dropout it also draws Z there, while fewer registers are live: Z rides
// in P's sign bit (P >= 0, so the bit is free) until dscores(), set where dropped.
// With softcap (DEFER), S stays raw until dscores(), which needs it for 1 − tanh²
// and draws Z itself.
// ---------------------------------------------------------------------------
// The backward's bias and mask read element by element by ScoreMod (the register
// path: no staged tile); the staged path passes a StagedScoreTerms instead.
struct ElementTerms {
    __device__ __forceinline__ ElementTerms() {}
    template <typename... A> __device__ __forceinline__ ElementTerms(const A&...) {}  // StagedScoreTerms' arguments
};
template <typename A, typename B> struct IsSame { static constexpr bool value = false; };
template <typename A> struct IsSame<A, A> { static constexpr bool value = true; };

// The backward's P of one fragment row (half) of an m16 tile in score_tile's layout:
// log2 scores -> prob(x, l), l = lse·log2(e) of row `row`, columns col0 + 8 j + e; with
// dropout the sign bit is set where the keep bit drops the element (dS reads P and
// the bit from it).
template <bool DROPOUT, int N_TILES>
__device__ __forceinline__ void probs_row(float (&s)[N_TILES][4], int half, float l, const Dropout& drop, int row,
                                          int col0) {
#pragma unroll
    for (int j = 0; j < N_TILES; ++j) {
        const uint32 bits = DROPOUT ? drop.keep_pair(row, col0 + j * 8) : 3u;  // columns col, col + 1
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float& x = s[j][half * 2 + e];
            x = prob(x, l);
            if (DROPOUT && !((bits >> e) & 1u)) x = __uint_as_float(__float_as_uint(x) | 0x80000000u);
        }
    }
}

template <bool IS_CAUSAL, int VARIANT, typename T>
struct BwdScores {
    static constexpr bool SOFTCAP = (VARIANT & VAR_SOFTCAP) != 0;
    static constexpr bool DROPOUT = (VARIANT & VAR_DROPOUT) != 0;
    static constexpr bool DEFER = SOFTCAP;  // P computed in dscores() from the raw S
    // Whether the scores of unmasked blocks read the sequence's lengths (ALiBi's
    // offset; the bias's and mask's clamped reads; masked blocks always do).
    // (A staged bias or mask is clamped by its copy, not here.)
    static constexpr bool STAGED = (VARIANT & VAR_BIAS_STAGED) != 0;
    static constexpr bool UNMASKED_LENGTHS =
        (VARIANT & VAR_ALIBI) != 0 || (ScoreMod<VARIANT, T>::BIAS_OR_MASK && !STAGED);
    using MaskT = Mask<IS_CAUSAL, VARIANT>;
    MaskT mask;
    ScoreMod<VARIANT, T> mod;
    Dropout drop;  // (its fields are read only with dropout)

    __device__ __forceinline__ BwdScores(const VariantParams& v, const float& softmax_scale_log2, int b, int h,
                                         int nheads_q, int seqlen_q, int seqlen_k)
        : mask(v, seqlen_q, seqlen_k), mod(v, softmax_scale_log2, b, h, seqlen_q, seqlen_k),
          drop(v, b, h, nheads_q) {}

    // The score of element (i, half, j, e) at (row, col0 + 8 j + e), raw q·k s, log2 units,
    // unmasked: the bias and mask from terms (ElementTerms: ScoreMod's own reads). With
    // ALiBi, line is the row's (alibi_line: the linear form with causal, where every
    // element the mask shows has row + off >= col; else the abs).
    template <typename Terms>
    __device__ __forceinline__ float score(const Terms& terms, const typename ScoreMod<VARIANT, T>::AlibiLine& line,
                                           float s, int row, int col0, int i, int half, int j, int e) const {
        const int col = col0 + 8 * j + e;
        const float x = mod.template scaled<IS_CAUSAL>(s, line, 8 * j + e, row, col);
        if constexpr (IsSame<Terms, ElementTerms>::value) return mod.with_terms(x, row, col);
        else return terms.apply(x, i, half, j, e);
    }

    // s: raw q·k -> P, its sign bit set where dropout drops (not with DEFER).
    // lse2(i, half): lse·log2(e) of row (i, half); terms: the block's bias and mask.
    template <bool MASKED, int M_TILES, int N_TILES, typename Lse2, typename Terms = ElementTerms>
    __device__ __forceinline__ void probs(float (&s)[M_TILES][N_TILES][4], int row0, int col0, const Lse2& lse2,
                                          const Terms& terms = Terms{}) const {
        static_assert(!DEFER, "with softcap, dscores() computes P");
        if constexpr (IsSame<Terms, ElementTerms>::value) score_tile<MASKED>(s, mod, mask, row0, col0);
        else score_tile<MASKED>(s, mod, mask, row0, col0, terms);
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + i * 16 + half * 8;
                const float l = lse2(i, half);
                probs_row<DROPOUT>(s[i], half, l, drop, row, col0);
            }
        }
    }

    // s: P from probs() (DEFER: the raw q·k), dp: dO·Vᵀ  ->  s = P∘Z·rp (dV's operand), dp = dS
    // (before softmax_scale). delta(i, half): rowsum(dO∘O) of row (i, half); lse2, terms as for probs.
    template <bool MASKED, int M_TILES, int N_TILES, typename Lse2, typename Delta, typename Terms = ElementTerms>
    __device__ __forceinline__ void dscores(float (&s)[M_TILES][N_TILES][4], float (&dp)[M_TILES][N_TILES][4],
                                            int row0, int col0, const Lse2& lse2, const Delta& delta,
                                            const Terms& terms = Terms{}) const {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + i * 16 + half * 8;
                const float dl = delta(i, half);
                float l = 0.f;
                int begin = 0, end = 0;
                [[maybe_unused]] typename ScoreMod<VARIANT, T>::AlibiLine line;
                if constexpr (DEFER) {
                    l = lse2(i, half);
                    if constexpr (MASKED) { begin = mask.col_begin(row); end = mask.col_end(row); }
                    if constexpr (ScoreMod<VARIANT, T>::ALIBI) {
                        line = mod.template alibi_line<IS_CAUSAL>(row + mod.off - col0, mod.slope_log2);
                    }
                }
#pragma unroll
                for (int j = 0; j < N_TILES; ++j) {
                    const int col = col0 + j * 8;
                    // DEFER: keep bits of columns col, col + 1 (col is even)
                    const uint32 bits = DROPOUT && DEFER ? drop.keep_pair(row, col) : 3u;
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& ps = s[i][j][half * 2 + e];
                        float& d = dp[i][j][half * 2 + e];
                        float P = ps;
                        float dtanh = 1.f;
                        bool kept = true;
                        if constexpr (DEFER) {  // ps is the raw score: score_tile and prob, element-wise
                            dtanh = mod.dscore(ps);
                            float x = score(terms, line, ps, row, col0, i, half, j, e);
                            if (MASKED && (col + e >= end || (MaskT::WINDOW && col + e < begin))) x = NEG_INF;
                            P = prob(x, l);
                            kept = (bits >> e) & 1u;
                        } else if constexpr (DROPOUT) {  // probs() set the sign bit of dropped entries
                            const uint32 u = __float_as_uint(ps);
                            P = __uint_as_float(u & 0x7fffffffu);
                            kept = (u >> 31) == 0u;
                        }
                        if constexpr (DROPOUT) {
                            const float z = kept ? drop.scale : 0.f;  // Z·rp
                            d = P * (d * z - dl);
                            ps = P * z;
                        } else {
                            d = P * (d - dl);
                            ps = P;
                        }
                        if constexpr (SOFTCAP) d *= dtanh;
                    }
                }
            }
        }
    }
};

// ---------------------------------------------------------------------------
// The dbias kernel's element pipeline (flash_bwd_dbias.cu), on S and dP tiles in
// score_tile's layout. A block owns one tile of dbias and sums
//   dbias += P∘(dP∘Z·rp − delta)   (dS before softcap's factor and softmax_scale)
// over the (batch, head) pairs, and for a bias broadcast along rows or keys the query
// or key blocks, that broadcast onto the tile. The bias there is the same for each of
// them, so the block reads it once (Terms, ScoreTerms without the mask, built on a
// ScoreMod of the tile's bias); the mask, ALiBi's slope, dropout's key and the lengths
// are each (batch, head)'s (this struct, built per pair). As in BwdScores, probs()
// turns S into P (the dropped entries' sign bit set) before dP = dO·Vᵀ, so that S and
// dP are not live at once next to the dbias accumulator.
// ---------------------------------------------------------------------------
template <bool IS_CAUSAL, int VARIANT, typename T, int M_TILES, int N_TILES>
struct DbiasScores {
    static_assert((VARIANT & (VAR_BIAS | VAR_BIAS_FP32)) != 0, "dbias needs a bias");
    static constexpr bool DROPOUT = (VARIANT & VAR_DROPOUT) != 0;
    using BiasMod = ScoreMod<VARIANT & ~VAR_MASK, T>;                      // the tile's bias
    using Terms = ScoreTerms<VARIANT & ~VAR_MASK, T, M_TILES, N_TILES>;    // ... in registers
    using PairMod = ScoreMod<VARIANT & ~(VAR_BIAS | VAR_BIAS_FP32), T>;    // softcap, ALiBi, mask
    using MaskT = Mask<IS_CAUSAL, VARIANT>;
    MaskT mask;
    PairMod mod;
    Dropout drop;  // (its fields are read only with dropout)
    const Terms& bias;

    __device__ __forceinline__ DbiasScores(const VariantParams& v, const float& softmax_scale_log2, int b, int h,
                                           int nheads_q, int seqlen_q, int seqlen_k, const Terms& bias_)
        : mask(v, seqlen_q, seqlen_k), mod(v, softmax_scale_log2, b, h, seqlen_q, seqlen_k),
          drop(v, b, h, nheads_q), bias(bias_) {}

    // s: raw q·k -> P, its sign bit set where dropout drops. lse2(i, half): lse·log2(e)
    // of row (i, half) (+inf: P = 0).
    template <bool MASKED, typename Lse2>
    __device__ __forceinline__ void probs(float (&s)[M_TILES][N_TILES][4], int row0, int col0,
                                          const Lse2& lse2) const {
        if constexpr (PairMod::ALIBI) {  // (the scores, then P)
            alibi_score_tile<MASKED>(s, mod, mask, row0, col0, [&](float x, int i, int half, int j, int e, int row,
                                                                   int col) {
                return mod.keep_masked(bias.apply(x, i, half, j, e), row, col);
            });
        }
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + i * 16 + half * 8;
                if constexpr (!PairMod::ALIBI) {
                    score_row_by<MASKED>(s[i], half, mask, row, col0, [&](float x, int j, int e) {
                        const int col = col0 + j * 8 + e;
                        return mod.keep_masked(bias.apply(mod.scaled(x, row, col), i, half, j, e), row, col);
                    });
                }
                const float l = lse2(i, half);
                probs_row<DROPOUT>(s[i], half, l, drop, row, col0);
            }
        }
    }

    // acc += P∘(dP∘Z·rp − delta): p from probs(), dp = dO·Vᵀ; delta(i, half) as lse2.
    template <typename Delta>
    __device__ __forceinline__ void accumulate(float (&acc)[M_TILES][N_TILES][4],
                                               const float (&p)[M_TILES][N_TILES][4],
                                               const float (&dp)[M_TILES][N_TILES][4], const Delta& delta) const {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float dl = delta(i, half);
#pragma unroll
                for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int k = half * 2 + e;
                        if constexpr (DROPOUT) {
                            const uint32 u = __float_as_uint(p[i][j][k]);
                            const float z = (u >> 31) == 0u ? drop.scale : 0.f;  // Z·rp
                            acc[i][j][k] += __uint_as_float(u & 0x7fffffffu) * (dp[i][j][k] * z - dl);
                        } else {
                            acc[i][j][k] += p[i][j][k] * (dp[i][j][k] - dl);
                        }
                    }
                }
            }
        }
    }
};

// ---------------------------------------------------------------------------
// Mask::visible solved for the row, for tiles whose rows are keys (the wgmma dK/dV
// kernel computes Sᵀ): key col (col >= 0) is seen by query rows first <= row <= last
// iff it exists (col < seqlen_k); first and last are not clamped. Per element this
// is one comparison per edge instead of col_end/col_begin of each row.
// ---------------------------------------------------------------------------
template <bool IS_CAUSAL, int VARIANT>
struct KeyRows {
    using MaskT = Mask<IS_CAUSAL, VARIANT>;
    int first, last;  // col <= row + off + right  <=>  row >= first;  col >= row + off - left  <=>  row <= last
    bool exists;

    __device__ __forceinline__ KeyRows(const MaskT& m, int col)
        : first(col - m.off - m.right), last(col - m.off + m.left), exists(col < m.seqlen_k) {}
    __device__ __forceinline__ bool sees(int row) const {
        return exists && (!MaskT::HAS_RIGHT || row >= first) && (!MaskT::WINDOW || row <= last);
    }
};

// Dropout's keep bits of an accumulator tile set in score_tile's layout (rows row0 +
// 16 i (+ 8), columns col0 + 8 j + (e & 1), col0 = 2 q modulo 8 for lane q of its
// quad), drawn with a quarter of the calls of one per lane and n8 tile: one Philox
// call decides the 8 columns of one row of an n8 tile, which the quad's 4 lanes
// share. Lane q draws row half q & 1 of the n8 tiles j with j & 1 == q >> 1, and
// takes its own 2 columns of every call from the quad's 4 lanes. Every lane of the
// warp must call draw().
template <int M_TILES, int N_TILES>
struct DropoutBits {
    static_assert(N_TILES % 2 == 0, "n8 tiles are drawn in pairs");
    static constexpr int PAIRS = N_TILES / 2;
    static constexpr int WORDS = (PAIRS + 3) / 4;  // a byte per pair of n8 tiles
    // element (i, half, j, e) kept iff bit 8 (m & 3) + 2 s + e of w[i][m / 4],
    // m = j / 2 and s = 2 (j & 1) + half (the lane that drew it)
    uint32 w[M_TILES][WORDS];

    __device__ __forceinline__ void draw(const Dropout& drop, int row0, int col0) {
        const int q = (col0 >> 1) & 3, half = q & 1, parity = q >> 1;
        const int tile0 = col0 & ~7;  // the first column of n8 tile 0
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int wd = 0; wd < WORDS; ++wd) {
                uint32 mine = 0;  // byte m & 3: n8 tile 2 m + parity (m = 4 wd + 0 .. 3), row half `half`
#pragma unroll
                for (int m = 4 * wd; m < 4 * wd + 4 && m < PAIRS; ++m) {
                    mine |= drop.keep8(row0 + i * 16 + half * 8, (tile0 + (2 * m + parity) * 8) >> 3) << (8 * (m & 3));
                }
                uint32 bits = 0;
#pragma unroll
                for (int src = 0; src < 4; ++src) {  // lane src of the quad: its columns 2 q, 2 q + 1
                    const uint32 other = __shfl_sync(0xffffffffu, mine, src, 4);
                    bits |= ((other >> (2 * q)) & 0x03030303u) << (2 * src);
                }
                w[i][wd] = bits;
            }
        }
    }
    __device__ __forceinline__ bool operator()(int i, int half, int j, int e) const {
        const int m = j / 2, src = 2 * (j & 1) + half;
        return (w[i][m / 4] >> (8 * (m & 3) + 2 * src + e)) & 1u;
    }
    // Zero the dropped entries of p (the layout draw() was given).
    __device__ __forceinline__ void zero_dropped(float (&p)[M_TILES][N_TILES][4]) const {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i)
#pragma unroll
            for (int j = 0; j < N_TILES; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!(*this)(i, e / 2, j, e & 1)) p[i][j][e] = 0.f;
    }
};

template <int M_TILES, int N_TILES>
__device__ __forceinline__ void Dropout::apply(float (&p)[M_TILES][N_TILES][4], int row0, int col0) const {
    DropoutBits<M_TILES, N_TILES> keep;
    keep.draw(*this, row0, col0);
    keep.zero_dropped(p);
}

}  // namespace cupyflash
