// tile_scheduler.cuh: which query tiles a thread block of the warp-specialised
// forward (flash_fwd_ws.cu) computes, and in which order. The kernel's mainloop and
// epilogue see one tile at a time (its coordinates and sequence) and know nothing of
// the order (FlashAttention-3's tile_scheduler.hpp split).
//
// A tile is one BLOCK_M-row query block of one (batch, head): num_m_blocks x batch x
// nheads_q of them.
//   * not persistent: one block per tile, numbered as in the other forwards
//     (query_grid.cuh query_tile_coords: one head's query blocks adjacent, for K/V reuse
//     in L2; causal, each head's heaviest first); the hardware hands the blocks out as
//     SMs come free.
//   * persistent (gridDim.x blocks, one per SM: cupyflash/dispatch.py fwd_ws_grid): the
//     work is cut into units, unit k gridDim.x + b going to block b (round-robin), one
//     head's units adjacent (L2 reuse as above). Non-causal, a unit is one tile. Causal
//     tiles weigh their query block's key blocks (m_block + 1), and round-robin over
//     them leaves some blocks with the heavy ones (132 SMs, 4 query blocks at seqlen 512:
//     block b gets the same query block every round; the busiest block 1.6x the mean):
//     there a unit is query blocks M-1-j and j of one head (heaviest first), weighing
//     M + 1 key blocks whatever j, so every block gets the same work but for one unit.
// A packed batch's tiles past the end of their (shorter) sequence are skipped here,
// so the producer and the consumers, which each walk the same sequence of tiles, skip
// the same ones; a block left with none returns before it sets up its barriers.
#pragma once

#include "params.cuh"
#include "query_grid.cuh"
#include "seqlens.cuh"

namespace cupyflash {

struct FwdTile {
    int unit;       // persistent: the block's unit (its place in the walk)
    bool second;    // persistent, causal: the unit's second (light) query block
    TileCoords tc;  // (b, h, h_kv, m_block)
    SeqLens seq;    // the tile's sequence
    int m0;         // its first query row within the sequence
};

template <int BLOCK_M, bool IS_CAUSAL, bool VARLEN, bool PERSISTENT>
struct FwdTileScheduler {
    const FwdParams& p;

    // The block's first tile; false: it has none (every tile it owns lies past its
    // sequence's end), the same answer for every thread.
    __device__ __forceinline__ bool first(FwdTile& tile) const {
        if constexpr (!PERSISTENT) {
            tile.tc = fwd_tile_coords<IS_CAUSAL>(p);
            return visit(tile);
        } else {
            tile.unit = blockIdx.x;
            tile.second = false;
            return settle(tile);
        }
    }
    // Move to the block's next tile; false: it has none left.
    __device__ __forceinline__ bool next(FwdTile& tile) const {
        if constexpr (!PERSISTENT) {
            return false;
        } else {
            advance(tile);
            return settle(tile);
        }
    }

private:
    // Query blocks per unit: 2 causal (M-1-j, then j), 1 otherwise; units per head.
    static constexpr int PAIR = IS_CAUSAL ? 2 : 1;
    __device__ __forceinline__ int units_per_head() const { return ceil_div(p.num_m_blocks, PAIR); }

    // Coordinates known: the tile's sequence and first row; whether it has a query.
    __device__ __forceinline__ bool visit(FwdTile& tile) const {
        tile.seq = seq_lens(p, tile.tc.b);
        tile.m0 = tile.tc.m_block * BLOCK_M;
        return !VARLEN || tile.m0 < tile.seq.seqlen_q;  // past the end of a shorter sequence (uniform)
    }
    // The unit's next query block, or the block's next unit.
    __device__ __forceinline__ void advance(FwdTile& tile) const {
        const int j = tile.unit % units_per_head();
        if (IS_CAUSAL && !tile.second && j != p.num_m_blocks - 1 - j) {
            tile.second = true;
        } else {
            tile.unit += gridDim.x;
            tile.second = false;
        }
    }
    // From the tile the walk is at on: the first one in range with a query, if any.
    __device__ __forceinline__ bool settle(FwdTile& tile) const {
        const int per_head = units_per_head(), num_units = per_head * p.batch * p.nheads_q;
        for (; tile.unit < num_units; advance(tile)) {
            const int bh = tile.unit / per_head, j = tile.unit % per_head, h = bh % p.nheads_q;
            const int m_block = IS_CAUSAL && !tile.second ? p.num_m_blocks - 1 - j : j;
            tile.tc = {bh / p.nheads_q, h, h / (p.nheads_q / p.nheads_kv), m_block};
            if (visit(tile)) return true;
        }
        return false;
    }
};

}  // namespace cupyflash
