"""Kernel selection: the only place that knows the tile tables.

Every function here is pure (shapes in, frozen plans out), needs no GPU, and is
unit-tested in ``tests/test_dispatch.py``. The template-argument order follows
``kernels_cu/flash_fwd.cu``: ``<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS,
IS_CAUSAL, EVEN_K, VEC, IS_SPLIT, VARIANT>``, and ``kernels_cu/flash_fwd_sm90.cu``:
``<T, HEAD_DIM, BLOCK_N, CTAS_PER_SM, IS_CAUSAL, EVEN_K, VARIANT>``, and
``kernels_cu/flash_fwd_ws.cu``: ``<T, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL,
EVEN_K, VARIANT, VARLEN, PERSISTENT>``; every
attention kernel takes the variant bits (``VARIANT``, kernels_cu/variant.cuh) last.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass

#: C++ type for each supported storage dtype.
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}

#: Compiled head-dimension specialisations; other head_dims run on the next one up.
HEAD_DIMS = (32, 64, 96, 128, 192, 256)

#: Compute capabilities the kernels are built and checked for.
ARCHS = ((8, 0), (9, 0))

#: The variant bits of the kernels' VARIANT template argument (kernels_cu/variant.cuh,
#: compared with it in tests/test_dispatch.py).
VAR_WINDOW, VAR_SOFTCAP, VAR_ALIBI, VAR_SINKS, VAR_DROPOUT = 1, 2, 4, 8, 16
#: Issue 14: an additive bias in q's dtype or in float32 (one of the two), a bool mask;
#: VAR_BIAS_STRIDED (with either): they are read element by element, at any strides,
#: instead of in pairs of adjacent columns (which needs column stride 1 and every row's
#: pairs aligned: :func:`score_pairs_ok`).
VAR_BIAS, VAR_BIAS_FP32, VAR_MASK, VAR_BIAS_STRIDED = 32, 64, 128, 256
#: VAR_BIAS_STAGED (forward only, not with VAR_BIAS_STRIDED): every row of the bias and
#: mask is 16-byte aligned (:func:`score_vec_ok`), and the forward copies each key
#: block's tile into shared memory with 16-byte cp.async (variant.cuh StagedScoreTerms)
#: where its kernel does so and the stages fit (:func:`fwd_variant`).
VAR_BIAS_STAGED = 512
#: VAR_BLOCK_MAP (with VAR_MASK): the mask's tile map at the kernel's tile
#: (cupyflash/_blockmask.py) skips the tiles the mask hides wholly and runs those it
#: keeps wholly with no mask code (variant.cuh KeyBlockMap, QueryBlockMap); the wgmma
#: kernels only, for now: the forward's and the backward's dK/dV and dQ kernels
#: (:func:`fwd_variant`, :func:`select_bwd` drop it elsewhere: the mma.sync kernels mask
#: every block).
VAR_BLOCK_MAP = 1024
VARIANT_BITS = {"window": VAR_WINDOW, "softcap": VAR_SOFTCAP, "alibi": VAR_ALIBI, "sinks": VAR_SINKS,
                "dropout": VAR_DROPOUT, "bias": VAR_BIAS, "bias_fp32": VAR_BIAS_FP32, "mask": VAR_MASK,
                "bias_strided": VAR_BIAS_STRIDED, "bias_staged": VAR_BIAS_STAGED, "block_map": VAR_BLOCK_MAP}
#: The bits that are not a variant of their own (each qualifies a bias or mask).
_QUALIFIER_BITS = (VAR_BIAS_STRIDED, VAR_BIAS_STAGED, VAR_BLOCK_MAP)
#: The bits of a bias or mask (the forward reads them a key block ahead, see _FWD_TILES_BIAS).
_SCORE_ARRAY_BITS = VAR_BIAS | VAR_BIAS_FP32 | VAR_MASK


def variant_bits(*, window: bool = False, softcap: bool = False, alibi: bool = False, sinks: bool = False,
                 dropout: bool = False, bias: str | None = None, mask: bool = False, strided: bool = False,
                 staged: bool = False) -> int:
    """The VARIANT template argument for the variants switched on; ``bias``: None, or
    the bias's storage ``"element"`` (q's dtype) or ``"float32"``; ``strided``: the bias
    or mask cannot be read in pairs (:func:`score_pairs_ok`); ``staged``: the forward's,
    whose rows are all 16-byte aligned (:func:`score_vec_ok`)."""
    if bias not in (None, "element", "float32"):
        raise ValueError(f"bias must be None, 'element' or 'float32'; got {bias!r}")
    if (strided or staged) and bias is None and not mask:
        raise ValueError("strided and staged need a bias or a mask")
    if strided and staged:
        raise ValueError("a bias or mask read element by element is not staged")
    return ((VAR_WINDOW if window else 0) | (VAR_SOFTCAP if softcap else 0) | (VAR_ALIBI if alibi else 0)
            | (VAR_SINKS if sinks else 0) | (VAR_DROPOUT if dropout else 0)
            | {None: 0, "element": VAR_BIAS, "float32": VAR_BIAS_FP32}[bias] | (VAR_MASK if mask else 0)
            | (VAR_BIAS_STRIDED if strided else 0) | (VAR_BIAS_STAGED if staged else 0))


def score_pairs_ok(strides: tuple[int, int, int, int], itemsize: int, ptr: int) -> bool:
    """Whether the kernels may read a bias or mask (4-D, ``strides`` in elements, 0 along
    broadcast dimensions) two adjacent columns at a time, as one aligned load: unit
    column stride, even batch, head and row strides, and the pointer aligned to two
    elements. Anything else takes VAR_BIAS_STRIDED."""
    batch, head, row, col = strides
    return col == 1 and not (batch % 2 or head % 2 or row % 2) and ptr % (2 * itemsize) == 0


def score_vec_ok(strides: tuple[int, int, int, int], itemsize: int, ptr: int) -> bool:
    """Whether the forward may copy a bias or mask (as :func:`score_pairs_ok`) into
    shared memory 16 bytes at a time (VAR_BIAS_STAGED): unit column stride, and every
    row 16-byte aligned (batch, head and row strides of 16 bytes, the pointer too); the
    key tail needs no alignment (the copies read only the bytes inside the row)."""
    batch, head, row, col = strides
    return col == 1 and not any(x * itemsize % 16 for x in (batch, head, row)) and ptr % 16 == 0

# Forward tiles per padded head_dim, (BLOCK_M, BLOCK_N, NUM_WARPS), for
# (non-causal, causal). Each warp owns BLOCK_M / NUM_WARPS query rows; two m16
# tiles per warp halve the shared-memory reads of K and V per mma (64-row blocks
# measured 25-35% slower). The widest key tile that compiles with no spills
# wins; at D=64 the causal variant's mask code costs the registers of 128 keys.
# See kernels_cu/PERF.md for the measurements.
_FWD_TILES = {
    32: ((128, 64, 4), (128, 64, 4)),
    64: ((128, 64, 4), (128, 64, 4)),
    96: ((128, 32, 4), (128, 32, 4)),
    128: ((128, 32, 4), (128, 32, 4)),
    192: ((64, 64, 4), (64, 64, 4)),
    256: ((64, 64, 4), (64, 64, 4)),
}
# Unaligned data (VEC=false) loads element by element through registers, which
# costs registers the big tiles do not have: one m16 tile per warp.
_FWD_TILES_UNALIGNED = {
    32: (64, 64, 4),
    64: (64, 64, 4),
    96: (64, 32, 4),
    128: (64, 32, 4),
    192: (64, 32, 4),
    256: (64, 32, 4),
}


# Hopper (cc 9.0, built for sm_90a) runs these padded head_dims on the wgmma kernel
# (kernels_cu/flash_fwd_sm90.cu): BLOCK_M = 128 query rows (two warpgroups of 64),
# a 3-stage K/V ring, and (BLOCK_N, CTAS_PER_SM) for (non-causal, causal): keys per
# tile, and how many blocks per SM the registers must allow.
# Unaligned data and split-KV stay on the mma.sync kernel.
# At D=64 two blocks of 64-key tiles per SM (128 registers, no spill) beat one
# block of 128-key tiles by 1.15-1.33x: one block's softmax overlaps the other's
# wgmma, where a block's own two warpgroups run in lockstep between barriers. At
# D=128 the O accumulators alone take 64 registers: one block per SM
# (kernels_cu/PERF.md, v6).
_FWD_SM90 = {
    64: ((64, 2), (64, 2)),
    128: ((128, 1), (128, 1)),
}
SM90_BLOCK_M = 128
SM90_THREADS = 256
SM90_STAGES = 3


# Issue 15: the warp-specialised forward (kernels_cu/flash_fwd_ws.cu): a producer
# warpgroup copies Q, K and V with TMA, two consumer warpgroups of 64 query rows each
# compute, ping-ponging their GEMMs, S_{n+1} issued with P_n·V_n. Dense and packed
# (varlen: never split, as on the other kernels), aligned batches with no variant or
# those of FWD_WS_VARIANTS at these padded head_dims (at 64 and 128 the variants take
# the plain kernel's tile: their code fits the consumers' 240 registers with no spill,
# nvcc 13.0, and adds no shared memory; at 192 they take _FWD_WS_VARIANT_TILE's, at 256
# not those of _FWD_WS_SPILLS); (BLOCK_N, STAGES) for
# (non-causal, causal). FA3's D=128 tile: 128 x 128. Run 64 (two stages, one release
# of K and V together): 451-478 TFLOP/s at D=128, no gain on the cp.async kernel, and
# 286-316 at D=64 against its 326-379 (kernels_cu/PERF.md); K and V are now released
# apart and D=128 takes three stages (225 KB), D=64 four (145 KB).
# On at the head_dims of FWD_WS_WINS (FWD_WS; CUPYFLASH_FWD_WS=0 turns it off).
_FWD_WS = {
    64: ((128, 4), (128, 4)),
    128: ((128, 3), (128, 3)),
    # O's accumulators take 96 (128) of the consumers' 240 registers. 192: FA3's 112-key
    # blocks, two stages (216 KB with Q); run 130 measured them 0.98-1.12x (median 1.086)
    # the 64-key blocks' three stages, losing only at 1024 causal. 256: 64-key blocks, two
    # stages (193 KB): 80-key blocks spill persistent (44-58 bytes, nvcc 13.0) and one block
    # per tile measured 0.89-1.08x (median 1.00).
    192: ((112, 2), (112, 2)),
    256: ((64, 2), (64, 2)),
}
#: The tile every variant takes where _FWD_WS's is for plain attention only: at 192 the
#: 112-key blocks spill with a window, ALiBi or dropout (check-kernels sm_90, NVRTC 13.0:
#: 40-334 bytes); a mask's block map is coarsened from its 64-key cells to the kernel's
#: 128 x BLOCK_N (cupyflash/_blockmask.py), which 112 keys would straddle (more partial blocks).
_FWD_WS_VARIANT_TILE = {192: ((64, 3), (64, 3))}
FWD_WS_BLOCK_M = 128
#: Query rows per tile of the ws forward at D=64 (FwdWsTraits::BLOCK_M, 64 per consumer
#: warpgroup), one of FWD_WS_BLOCK_MS: 192 (the default), FlashAttention-3's hdim-64 tile
#: (three consumer warpgroups in a ring at 160 registers each: at D=64 a block's GEMMs take
#: half of D=128's time against the same softmax, so two warpgroups leave the tensor cores
#: waiting), or 128 (two). Run 121 (PERF.md v26, .ci/ws_d64_ab.py, kernel time, 16k
#: tokens): plain 1.09-1.25x the cp.async kernel at 4096-16384, against 1.05-1.15x at 128
#: rows. 192 takes plain attention and the variant sets of FWD_WS_WIDE_VARIANTS less
#: FWD_WS_WIDE_SPILLS, one block per tile, and is chosen where it pays (less
#: FWD_WS_WIDE_LOSES); the rest (persistent, a window, a map, which spill there: nvcc
#: 13.0) keep 128.
FWD_WS_D64_BLOCK_M = 192
FWD_WS_BLOCK_MS = (128, 192)
#: The variant bits the 192-row tile takes, and the sets among them that spill at its
#: consumers' 160 registers (nvcc 13.0, every subset compiled, dense and packed, fp16 and
#: bf16, causal or not: ALiBi with softcap 24-124 bytes, ALiBi with dropout 80-124).
FWD_WS_WIDE_VARIANTS = VAR_SOFTCAP | VAR_ALIBI | VAR_SINKS | VAR_DROPOUT
FWD_WS_WIDE_SPILLS = (VAR_ALIBI | VAR_SOFTCAP, VAR_ALIBI | VAR_DROPOUT)
#: The variant bits for which the 192-row tile takes but measured slower than 128 rows
#: (run 121, bf16 causal, speed-up over the cp.async kernel at 4096 / 16384, 128 rows
#: persistent against 192): softcap 1.082 / 1.132 against 1.046 / 1.149, dropout
#: 1.177 / 1.183 against 1.070 / 1.151 (the extra work per score fills the third
#: warpgroup's slack; ALiBi 1.32-1.34 against 1.37-1.63, sinks 1.02-1.08 against
#: 1.04-1.18 gain). The choice (:func:`fwd_ws_block_m`) keeps them at 128.
FWD_WS_WIDE_LOSES = VAR_SOFTCAP | VAR_DROPOUT


def fwd_ws_wide_takes(variant: int) -> bool:
    """Whether the ws forward's 192-row tile compiles these variant bits with no spill."""
    return not variant & ~FWD_WS_WIDE_VARIANTS and not any(variant & s == s for s in FWD_WS_WIDE_SPILLS)


#: The shortest seqlen_q (a packed batch: max_seqlen_q) at which D=64 takes the 192-row
#: tile: run 121 measured it slower than 128 rows at 1024 (0.85-0.99x the cp.async kernel,
#: causal worst: 6 tiles a head, the last a third empty) and faster from 4096 up.
FWD_WS_D64_WIDE_MIN_SEQLEN = 2048


def fwd_ws_block_m(head_dim_padded: int, variant: int, persistent: bool = False,
                   d64_block_m: int | None = None, seqlen_q: int | None = None) -> int:
    """Query rows per tile of the ws forward: FWD_WS_D64_BLOCK_M at D=64 where that tile
    takes the variant (:func:`fwd_ws_wide_takes`), pays (not FWD_WS_WIDE_LOSES, and
    ``seqlen_q`` at least FWD_WS_D64_WIDE_MIN_SEQLEN when given) and the call runs one block
    per tile, else FWD_WS_BLOCK_M. ``d64_block_m`` given: the rows a launch of that many may
    have (what the tile takes, paying or not)."""
    if head_dim_padded == 64 and not persistent and fwd_ws_wide_takes(variant):
        if d64_block_m is not None:
            return d64_block_m
        if not variant & FWD_WS_WIDE_LOSES and (seqlen_q is None or seqlen_q >= FWD_WS_D64_WIDE_MIN_SEQLEN):
            return FWD_WS_D64_BLOCK_M
    return FWD_WS_BLOCK_M


def fwd_ws_threads(block_m: int) -> int:
    """FwdWsTraits::NUM_THREADS: the producer warpgroup and one consumer per 64 rows."""
    return 128 * (1 + block_m // 64)
#: The variant bits the warp-specialised forward takes (kernels_cu/variant.cuh
#: WS_VARIANTS): those whose code is all in the scores and the softmax. A bias stays on the
#: cp.async wgmma kernel; a mask too, but with its map where FWD_WS_BLOCK_MAP says.
FWD_WS_VARIANTS = VAR_WINDOW | VAR_SOFTCAP | VAR_ALIBI | VAR_SINKS | VAR_DROPOUT
#: Issue 14 on the ws forward (kernels_cu/variant.cuh WS_FWD_MAP_VARIANTS): a bool mask with
#: its tile map at the kernel's tile (128 x BLOCK_N; :func:`fwd_block_map_tile`), alone or
#: with those of FWD_WS_VARIANTS not in FWD_WS_MAP_SPILLS (ALiBi, sinks). The kernel walks
#: only the key blocks the map does not mark empty and reads the mask in the partial ones
#: in pairs of columns (variant.cuh ScoreTerms: not with VAR_BIAS_STRIDED, which stays on
#: the cp.async kernel; never staged: the plan's VAR_BIAS_STAGED is dropped,
#: :func:`ws_fwd_variant`).
FWD_WS_MAP_VARIANTS = VAR_MASK | VAR_BLOCK_MAP
#: The variants that, with the map, spill in the ws kernel (check-kernels sm_90, NVRTC, the
#: mask's 32 registers of pairs held across the GEMMs next to S, P and O: PERF.md v24): a
#: window (D=128 8-64 bytes), softcap (causal: D=64 8-20, D=128 varlen 8), dropout (D=64
#: 60-144, D=128 causal 24). With the map such a call stays on the cp.async kernel; the
#: mask alone, with ALiBi or with sinks, compiles with none (the kernel static_asserts the rest).
FWD_WS_MAP_SPILLS = VAR_WINDOW | VAR_SOFTCAP | VAR_DROPOUT
#: Issue 14's additive bias on the ws forward (kernels_cu/variant.cuh WS_FWD_BIAS): a bias of
#: the inputs' dtype read in pairs of columns into registers once a key block's GEMMs are
#: issued (variant.cuh ScoreTerms, as the map's mask: 32 registers at 128 keys; not
#: VAR_BIAS_STRIDED, not fp32; the plan's VAR_BIAS_STAGED, the cp.async kernel's tile
#: staging, dropped: :func:`ws_fwd_variant`), alone or with those of FWD_WS_VARIANTS not in
#: FWD_WS_BIAS_SPILLS, and not where _FWD_WS_SPILLS says it spills. Other bias calls stay on
#: the cp.async wgmma kernel (flash_fwd_sm90.cu) or, at 192 and 256, the mma.sync kernel.
#: (Copied a block ahead into a shared-memory ring by each consumer thread instead, with
#: cp.async, it ran 0.82-0.97x this form: PERF.md v30, run 142; branch ws-bias-async.)
FWD_WS_BIAS_VARIANTS = VAR_BIAS
#: What the ws forward never takes with a bias: dropout (its Philox state beside the bias
#: pairs spills 84-480 bytes at D=128, check-kernels sm_90, NVRTC 13.0) and a mask (the
#: map's path, whose pairs would double the registers): such calls take flash_fwd_sm90.cu.
#: The kernel static_asserts both.
FWD_WS_BIAS_SPILLS = VAR_DROPOUT | VAR_MASK
#: The padded head_dims at which bias calls the ws forward takes (:func:`uses_ws_fwd`) go to
#: it (True: all it has; False: none). Runs 141 and 143 (PERF.md v30, bf16, 16k tokens,
#: 1024-8192, per-head and per-batch biases, one process): D=128 1.02-1.25x the cp.async
#: wgmma kernel, D=256 1.59-2.35x and D=192 1.87-2.19x (4096, 8192) the mma.sync kernel;
#: D=64 0.79-1.00x (that kernel keeps two blocks per SM with the bias staged through shared
#: memory), so D=64 stays there. Read when a call is planned (cupyflash._gpu plan_fwd): set
#: it, then ``_gpu.clear_plans()``.
FWD_WS_BIAS: bool | tuple[int, ...] = (128, 192, 256)
#: The switch that sends those calls (VAR_MASK | VAR_BLOCK_MAP, no bias) to the ws forward:
#: True (the default: at every head_dim the kernel has; 1.08-1.27x the cp.async wgmma kernel
#: at 64 and 128, PERF.md v25, run 116; at 192 and 256, where the mask ran on the mma.sync
#: kernel, since run 132's block-sparse GPU tests there), False (the cp.async kernel), or a
#: tuple of padded head_dims. Independent of FWD_WS (whose D=64 is off for the dense
#: softmax-bound case; a sparse call's cost is its per-tile fixed costs, which the ws kernel
#: cuts). Read when a call is planned (cupyflash._gpu plan_fwd): set it, then
#: ``_gpu.clear_plans()``.
FWD_WS_BLOCK_MAP: bool | tuple[int, ...] = True
#: The padded head_dims the switch (FWD_WS) sends to the warp-specialised forward: where
#: it is expected to beat the wgmma kernel. D=128 since run 69 (1.20-1.23x); D=64 since run
#: 121 (PERF.md v26, run 123: 0.998-1.578x the cp.async kernel, median 1.108, 192 rows
#: where FWD_WS_D64_BLOCK_M takes the call, 128 persistent elsewhere; run 64's 0.8x was
#: two stages, K and V released together); D=192 and 256 since run 128 (PERF.md v28: 1.5-2.1x
#: FA2 where the mma.sync kernel ran 0.78-0.91x, 16k tokens, 1024-16384).
FWD_WS_WINS = (64, 128, 192, 256)
#: What select_fwd's callers (cupyflash._gpu) pass as ``ws``: FWD_WS_WINS (the default:
#: run 69 measured D=128 at 1.20-1.23x the cp.async kernel, PERF.md v19); from the
#: environment when cupyflash is imported (read once): CUPYFLASH_FWD_WS=0: False (off);
#: =all: True, every head_dim of _FWD_WS (to measure and test them). Or set here (then
#: ``cupyflash._gpu.clear_plans()``).
_FWD_WS_ENV = os.environ.get("CUPYFLASH_FWD_WS", "")
FWD_WS: bool | tuple[int, ...] = {"all": True, "0": False}.get(_FWD_WS_ENV, FWD_WS_WINS)


#: The persistent ws forward (issue 15; kernels_cu/tile_scheduler.cuh): one block per SM
#: (FWD_WS_BLOCKS_PER_SM) walking the query tiles, so that the producer copies the next
#: tile's first K while the consumers finish the tile before. "auto": where it measured
#: faster (:func:`persistent_ws_pays`); True: wherever the kernel takes the variant (the
#: tests and .ci/ws_persist_ab.py); False: never. Read when a call is planned
#: (cupyflash._gpu plan_fwd), so set it, then ``cupyflash._gpu.clear_plans()``.
FWD_WS_PERSISTENT: bool | str = "auto"


def persistent_ws_pays(variant: int, varlen: bool) -> bool:
    """Whether the persistent ws forward is the faster one for this call (FWD_WS_PERSISTENT
    "auto"): dense batches without a window. Measured on the H200 (kernels_cu/PERF.md v22,
    run 94, D=128, 16k tokens): dense 1.01-1.11x the one-block-per-tile grid (median
    1.05; 16k causal 0.99-1.01), but a window (4096, 0) at 16k 0.88x and a packed batch
    of 14 sequences 0.97-0.98x: their tiles' unequal costs, which the static walk shares
    out worse than the hardware hands out one-tile blocks."""
    return not varlen and not variant & VAR_WINDOW


#: ws blocks an SM holds at once: one (384 threads at 168 registers at entry take 64512
#: of the SM's 65536; D=128's three stages, 225 KB of shared memory, alone would too).
FWD_WS_BLOCKS_PER_SM = 1
#: The variant bits the persistent form never takes together: a window with dropout, the
#: combination already nearest the consumers' 240 registers (its keep bits drawn before
#: the GEMMs: flash_fwd_ws.cu KEEP_UNDER_S), to which the tile walk's state adds 40-60
#: bytes of spill (nvcc 13.0). Such a call runs one block per tile.
FWD_WS_NOT_PERSISTENT = VAR_WINDOW | VAR_DROPOUT


#: Where the ws forward spills at a padded head_dim beyond the persistent and map rules
#: (check-kernels sm_90, NVRTC 13.0, every FWD_WS_CHECK_VARIANTS launch, and every subset
#: of FWD_WS_VARIANTS dense): head_dim -> (variant bits all set, bits all clear, packed
#: (None: either), persistent (None: either)). At 256 O's
#: 128 accumulators leave the consumers' 240 registers no room for a window's edges next
#: to the tile walk's state (persistent 244-260 bytes) or a packed batch's (64-80), for
#: dropout's Philox rounds when persistent (72-104) or beside a window (8), or for the map's
#: mask pairs beside ALiBi's distances (16, causal). Those calls take the mma.sync kernel
#: (or, the persistent ones, one block per tile); 192 spills nowhere.
#: A bias (FWD_WS_BIAS_VARIANTS; session 20's sweep of every subset of a window, softcap,
#: ALiBi and sinks with it, causal or not, packed or not, persistent or not, NVRTC 13.0:
#: .ci/ws_bias_spills.py): 64 and 192 spill nowhere. At 128 its 32 registers of pairs beside
#: the tile walk's state spill with a window (172-186 bytes) or ALiBi (128-194), and a window
#: with ALiBi spills one block per tile too (64-208). At 256 beside a window it spills
#: always (232-460), and persistent beside softcap (172, non-causal) or ALiBi (130-256).
#: Those calls take the other kernels (the persistent ones: one block per tile).
_FWD_WS_SPILLS = {
    # (persistent, which "auto" never takes with a window: 128 x 128 causal with a window and
    # softcap, or those and sinks, spills; with ALiBi or dropout too it does not, nor one
    # block per tile)
    128: ((VAR_WINDOW | VAR_SOFTCAP, VAR_ALIBI | VAR_DROPOUT, None, True),
          (VAR_BIAS | VAR_WINDOW, 0, None, True), (VAR_BIAS | VAR_ALIBI, 0, None, True),
          (VAR_BIAS | VAR_WINDOW | VAR_ALIBI, 0, None, None)),
    256: ((VAR_WINDOW, 0, None, True), (VAR_DROPOUT, 0, None, True), (VAR_WINDOW, 0, True, None),
          (VAR_WINDOW | VAR_DROPOUT, 0, None, None), (VAR_BLOCK_MAP | VAR_ALIBI, 0, None, None),
          # (every subset: a window with softcap 8-44 bytes, ALiBi with dropout non-causal;
          # their supersets left out too, spilling or not)
          (VAR_WINDOW | VAR_SOFTCAP, 0, None, None), (VAR_ALIBI | VAR_DROPOUT, 0, None, None),
          (VAR_BIAS | VAR_WINDOW, 0, None, None), (VAR_BIAS | VAR_SOFTCAP, 0, None, True),
          (VAR_BIAS | VAR_ALIBI, 0, None, True)),
}


def fwd_ws_spills(head_dim_padded: int, variant: int, varlen: bool, persistent: bool) -> bool:
    """Whether the ws forward at this padded head_dim spills with these variant bits,
    packed or not, persistent or not (_FWD_WS_SPILLS)."""
    return any(variant & bits == bits and not variant & clear and packed in (None, varlen)
               and walk in (None, persistent) for bits, clear, packed, walk in _FWD_WS_SPILLS.get(head_dim_padded, ()))


def uses_persistent_ws(variant: int, varlen: bool = False, head_dim_padded: int | None = None) -> bool:
    """Whether the persistent ws forward takes these variant bits (FWD_WS_NOT_PERSISTENT;
    never the block map's: kernels_cu/flash_fwd_ws.cu, its walk's state spills there, and
    a block-sparse call's tiles differ in cost, which the hardware's hand-out of one-tile
    blocks balances better than the static walk: PERF.md v24), and a packed batch
    (``varlen``): never (the producer's zeroing of a sequence's last V rows next to the
    walk's state spills 40-112 bytes at its 24 registers, nvcc 13.0; and run 94 measured
    packed batches 0.97x one block per tile)."""
    return (variant & FWD_WS_NOT_PERSISTENT != FWD_WS_NOT_PERSISTENT and not variant & VAR_BLOCK_MAP
            and not varlen and not (head_dim_padded and fwd_ws_spills(head_dim_padded, variant, varlen, True)))


def fwd_ws_grid(num_m_blocks: int, batch_heads: int, causal: bool, num_sms: int,
                persistent: bool) -> tuple[int, int, int]:
    """The ws forward's grid over num_m_blocks query tiles of each of ``batch_heads``
    (batch x nheads_q) heads: one block per tile; or, persistent, one per SM slot and
    never more blocks than units of work (kernels_cu/tile_scheduler.cuh: a unit is one
    tile, or causal the pair of query blocks M-1-j and j of a head), each block walking
    units gridDim.x apart."""
    if not persistent:
        return (num_m_blocks * batch_heads, 1, 1)
    units = -(-num_m_blocks // 2) * batch_heads if causal else num_m_blocks * batch_heads
    return (min(units, num_sms * FWD_WS_BLOCKS_PER_SM), 1, 1)


def ws_fwd_variant(variant: int) -> int:
    """The VARIANT the ws forward is compiled with for a plan's ``variant``: with the mask's
    map or a bias, less VAR_BIAS_STAGED (the kernel reads them into registers, never
    through shared memory, whose K/V stages fill it)."""
    if variant & FWD_WS_MAP_VARIANTS == FWD_WS_MAP_VARIANTS or variant & FWD_WS_BIAS_VARIANTS:
        return variant & ~VAR_BIAS_STAGED
    return variant


def uses_ws_fwd(head_dim_padded: int, vec: bool, cc: tuple[int, int], variant: int = 0,
                varlen: bool = False) -> bool:
    """Whether the warp-specialised kernel serves this call (when asked for; before any
    split-KV): dense or packed alike (every variant of FWD_WS_VARIANTS carries over to a
    packed batch, the consumers asking seqlens.cuh for each sequence's lengths as
    flash_fwd_sm90.cu does; the kernel's VARLEN argument: fwd_ws_launch), aligned, on cc
    9.0, with no variant outside FWD_WS_VARIANTS but a mask with its map (FWD_WS_MAP_VARIANTS,
    both bits or neither, read in pairs: not VAR_BIAS_STRIDED; not with FWD_WS_MAP_SPILLS)
    or a bias of the inputs' dtype (FWD_WS_BIAS_VARIANTS, read in pairs; not with
    FWD_WS_BIAS_SPILLS; ``variant`` as :func:`ws_fwd_variant` compiles it), and not where
    it spills one block per tile at this head_dim (:func:`fwd_ws_spills`; ``varlen``: a
    packed batch)."""
    map_bits = variant & FWD_WS_MAP_VARIANTS
    return (cc == (9, 0) and vec and head_dim_padded in _FWD_WS
            and not variant & ~(FWD_WS_VARIANTS | FWD_WS_MAP_VARIANTS | FWD_WS_BIAS_VARIANTS)
            and map_bits in (0, FWD_WS_MAP_VARIANTS)
            and not (map_bits and variant & FWD_WS_MAP_SPILLS)
            and not (variant & FWD_WS_BIAS_VARIANTS and variant & FWD_WS_BIAS_SPILLS)
            and not fwd_ws_spills(head_dim_padded, variant, varlen, False))


def fwd_ws_tile(head_dim_padded: int, causal: bool, variant: int = 0) -> tuple[int, int]:
    """(BLOCK_N, STAGES) of the warp-specialised forward (with any variant bits:
    _FWD_WS_VARIANT_TILE's, where it has the head_dim)."""
    if variant and head_dim_padded in _FWD_WS_VARIANT_TILE:
        return _FWD_WS_VARIANT_TILE[head_dim_padded][int(causal)]
    return _FWD_WS[head_dim_padded][int(causal)]


def fwd_ws_smem_bytes(head_dim_padded: int, block_n: int, stages: int, block_m: int = FWD_WS_BLOCK_M) -> int:
    """kernels_cu/flash_fwd_ws.cu FwdWsTraits::SMEM_BYTES: Q, STAGES x (K, V), the
    mbarriers (full_q, full_k, full_v, empty_k, empty_v, empty_q, tail_v: 8 bytes each),
    1 KB of alignment."""
    return 2 * head_dim_padded * (block_m + 2 * stages * block_n) + 8 * (3 + 4 * stages) + 1024


def fwd_ws_launch(dtype: str, head_dim_padded: int, causal: bool, even_k: bool,
                  grid: tuple[int, int, int] = (1, 1, 1), variant: int = 0, varlen: bool = False,
                  persistent: bool = False, block_m: int = FWD_WS_BLOCK_M) -> Launch:
    """The warp-specialised forward kernel (cc 9.0) for one set of compile-time choices:
    ``<T, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, EVEN_K, VARIANT, VARLEN, PERSISTENT>``;
    ``variant``: bits of FWD_WS_VARIANTS, optionally with FWD_WS_MAP_VARIANTS (:func:`uses_ws_fwd`);
    ``varlen``: a packed batch; ``persistent``: blocks walk the tiles (:func:`fwd_ws_grid`);
    ``block_m``: query rows per tile (:func:`fwd_ws_block_m`)."""
    if not uses_ws_fwd(head_dim_padded, True, (9, 0), variant, varlen) or (
            persistent and not uses_persistent_ws(variant, varlen, head_dim_padded)):
        raise ValueError(f"cupyflash: the warp-specialised forward takes the variant bits {FWD_WS_VARIANTS}, "
                         f"optionally with {FWD_WS_MAP_VARIANTS} (a mask with its map, not with "
                         f"{FWD_WS_MAP_SPILLS}), only, and not where it spills (_FWD_WS_SPILLS); got variant "
                         f"{variant} at head_dim {head_dim_padded}, varlen {varlen}, persistent {persistent}")
    if block_m not in FWD_WS_BLOCK_MS or block_m != fwd_ws_block_m(head_dim_padded, variant, persistent, block_m):
        raise ValueError(f"cupyflash: the warp-specialised forward takes {block_m} query rows per tile only at "
                         f"head_dim 64, one block per tile, with variant bits of {FWD_WS_WIDE_VARIANTS} less the "
                         f"sets {FWD_WS_WIDE_SPILLS}; got head_dim {head_dim_padded}, variant {variant}, "
                         f"persistent {persistent}")
    block_n, stages = fwd_ws_tile(head_dim_padded, causal, variant)
    args = (CTYPES[dtype], str(head_dim_padded), str(block_m), str(block_n), str(stages), _cbool(causal),
            _cbool(even_k), str(variant), _cbool(varlen), _cbool(persistent))
    return Launch("flash_fwd_ws.cu", "cupyflash::flash_fwd_ws_kernel", args, grid, (fwd_ws_threads(block_m), 1, 1),
                  fwd_ws_smem_bytes(head_dim_padded, block_n, stages, block_m))

# Variants whose code does not fit the default tiles' registers (check-kernels,
# NVRTC 13.0: a window's two edges, ALiBi's distances, dropout's Philox rounds) take
# these instead: on the mma.sync kernel at D=128, 16-key tiles (D=256: 32-key tiles
# with dropout); on the wgmma kernel, one block per SM (D=64: ALiBi, dropout).
_FWD_LEAN_VARIANTS = VAR_WINDOW | VAR_ALIBI | VAR_DROPOUT
#: padded head_dim -> (the variant bits that need it, the tile); D=256: dropout only
#: (64 bytes of spill on sm_80 under NVRTC 13.0, run 49).
_FWD_TILES_LEAN = {128: (_FWD_LEAN_VARIANTS, (128, 16, 4)), 256: (VAR_DROPOUT, (64, 32, 4))}


# A bias or mask (issue 14) is read a key block ahead into registers (variant.cuh
# ScoreTerms: two columns a word, 16-64 registers a thread at 64-key tiles), while the
# scores' GEMM runs. Where that does not fit the default tile with a margin
# (check-kernels, NVRTC 13.0), these tiles: BLOCK_N halved, which halves those
# registers and keeps the two m16 tiles per warp.
_FWD_TILES_BIAS = {
    32: (128, 32, 4),
    64: (128, 32, 4),
    128: (128, 16, 4),
    192: (64, 32, 4),
    256: (64, 32, 4),
}


def fwd_tiles(head_dim_padded: int, vec: bool, causal: bool,
              cc: tuple[int, int] = (9, 0), split: bool = False, variant: int = 0) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, NUM_WARPS) of the forward kernel."""
    if not vec:
        return _FWD_TILES_UNALIGNED[head_dim_padded]
    bits, lean = _FWD_TILES_LEAN.get(head_dim_padded, (0, None))
    if variant & bits:
        return lean
    if variant & _SCORE_ARRAY_BITS and head_dim_padded in _FWD_TILES_BIAS:
        return _FWD_TILES_BIAS[head_dim_padded]
    # The split-KV epilogue's fp32 stores cost registers too: splits take the
    # causal column, whose tiles leave that room (NVRTC 13.0 spills otherwise).
    return _FWD_TILES[head_dim_padded][int(causal or split)]


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the template instantiation and its launch shape."""

    source: str                 # file in kernels_cu/ that defines the template
    template: str               # fully qualified template name
    args: tuple[str, ...]       # template arguments, as C++ text
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int             # dynamic shared memory

    @property
    def name_expression(self) -> str:
        return f"{self.template}<{', '.join(self.args)}>"


@dataclass(frozen=True)
class FwdPlan:
    main: Launch
    combine: Launch | None      # set when split-KV is used
    head_dim_padded: int
    num_m_blocks: int
    num_splits: int
    n_blocks_per_split: int
    #: The warp-specialised kernel's TMA boxes: rows of (Q, K and V) per copy; None for
    #: the other kernels (cupyflash/_tma.py builds the maps).
    tma_box_rows: tuple[int, int] | None = None


def padded_head_dim(head_dim: int) -> int:
    """The smallest compiled specialisation that holds ``head_dim``."""
    if head_dim < 1:
        raise ValueError(f"cupyflash: head_dim must be at least 1; got {head_dim}")
    for d in HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"cupyflash: head_dim must be at most {HEAD_DIMS[-1]}; got {head_dim}")


def _smem_tile_bytes(rows: int, head_dim_padded: int) -> int:
    # kernels_cu/tile_io.cuh SmemTile: 16-byte chunks, row stride padded to odd.
    chunks = head_dim_padded * 2 // 16
    return rows * (chunks | 1) * 16


def _cbool(x: bool) -> str:
    return "true" if x else "false"


def fwd_launch(dtype: str, head_dim_padded: int, causal: bool, even_k: bool, vec: bool,
               split: bool, grid: tuple[int, int, int] = (1, 1, 1), cc: tuple[int, int] = (9, 0),
               variant: int = 0) -> Launch:
    """The forward kernel instantiation for one set of compile-time choices."""
    variant = fwd_variant(head_dim_padded, variant, sm90=False)
    block_m, block_n, num_warps = fwd_tiles(head_dim_padded, vec, causal, cc, split, variant)
    # Q, K and V tiles: kernels_cu/flash_fwd.cu FwdTraits::SMEM_BYTES.
    smem = _smem_tile_bytes(block_m, head_dim_padded) + 2 * _smem_tile_bytes(block_n, head_dim_padded)
    args = (CTYPES[dtype], str(head_dim_padded), str(block_m), str(block_n), str(num_warps),
            _cbool(causal), _cbool(even_k), _cbool(vec), _cbool(split), str(variant))
    return Launch("flash_fwd.cu", "cupyflash::flash_fwd_kernel", args, grid, (num_warps * 32, 1, 1), smem)


def fwd_sm90_launch(dtype: str, head_dim_padded: int, causal: bool, even_k: bool,
                    grid: tuple[int, int, int] = (1, 1, 1), variant: int = 0) -> Launch:
    """The wgmma forward kernel (cc 9.0) for one set of compile-time choices."""
    variant = fwd_variant(head_dim_padded, variant, sm90=True)
    block_n, ctas_per_sm = fwd_sm90_tile(head_dim_padded, causal, variant)
    smem = fwd_sm90_smem_bytes(head_dim_padded, block_n, variant)
    args = (CTYPES[dtype], str(head_dim_padded), str(block_n), str(ctas_per_sm), _cbool(causal), _cbool(even_k),
            str(variant))
    return Launch("flash_fwd_sm90.cu", "cupyflash::flash_fwd_sm90_kernel", args, grid, (SM90_THREADS, 1, 1), smem)


def fwd_sm90_smem_bytes(head_dim_padded: int, block_n: int, variant: int = 0) -> int:
    """kernels_cu/flash_fwd_sm90.cu FwdSm90Traits::SMEM_BYTES (the kernel traps on less):
    Q, STAGES x (K, V and, staged, the key block's bias and mask tiles: StageTile, no
    padding), and 1 KB to align the window to the 128-byte swizzle's 1024-byte atom."""
    return (2 * head_dim_padded * (SM90_BLOCK_M + 2 * SM90_STAGES * block_n)
            + SM90_STAGES * _score_stage_bytes(SM90_BLOCK_M, block_n, variant) + 1024)


def _score_stage_bytes(block_m: int, block_n: int, variant: int) -> int:
    """One stage of the staged bias and mask tiles (variant.cuh StagedScoreTerms::STAGE_BYTES)."""
    if not variant & VAR_BIAS_STAGED:
        return 0
    bias = 4 if variant & VAR_BIAS_FP32 else 2 if variant & VAR_BIAS else 0
    return block_m * block_n * (bias + (1 if variant & VAR_MASK else 0))


# With a bias or mask (issue 14) the wgmma kernel takes 64-key tiles. Read into
# registers a block ahead (ScoreTerms; not staged) it runs one block per SM: at D=128
# 128-key tiles spill 8-64 bytes (64 keys: 204-255 registers); at D=64 two blocks' 128
# registers are a coin flip (0-192 bytes of spill as the load moves by one line).
# Staged through shared memory (StagedScoreTerms) it holds no pointers and no loads in
# flight: D=64 keeps its two blocks per SM where both blocks' stages fit (a bf16 bias
# or a mask alone: 113 KB a block with a bf16 bias, exactly half the SM); at D=128 the
# three-stage K/V ring of 128-key tiles already fills the block's 227 KB.
_FWD_SM90_BIAS_BLOCK_N = {64: 64, 128: 64}


def fwd_variant(head_dim_padded: int, variant: int, sm90: bool, cc: tuple[int, int] = (9, 0)) -> int:
    """The VARIANT a forward kernel is compiled with: ``variant`` less VAR_BIAS_STAGED
    where that kernel does not stage (the mma.sync kernel, for now) or its stages do not
    fit one block (the wgmma kernel at D=128 with an fp32 bias and a mask: 249 KB), and
    less VAR_BLOCK_MAP off the wgmma kernel (or without a mask)."""
    if not sm90 or not variant & VAR_MASK:
        variant &= ~VAR_BLOCK_MAP
    if not variant & VAR_BIAS_STAGED:
        return variant
    if sm90:
        block_n = _FWD_SM90_BIAS_BLOCK_N[head_dim_padded]
        if fwd_sm90_smem_bytes(head_dim_padded, block_n, variant) <= max_smem_per_block(cc):
            return variant
    return variant & ~VAR_BIAS_STAGED


def fwd_sm90_tile(head_dim_padded: int, causal: bool, variant: int = 0) -> tuple[int, int]:
    """(BLOCK_N, CTAS_PER_SM) of the wgmma forward (see _FWD_LEAN_VARIANTS, _FWD_SM90_BIAS_BLOCK_N)."""
    block_n, ctas_per_sm = _FWD_SM90[head_dim_padded][int(causal)]
    variant = fwd_variant(head_dim_padded, variant, sm90=True)
    if variant & _SCORE_ARRAY_BITS:
        block_n = _FWD_SM90_BIAS_BLOCK_N[head_dim_padded]
        smem = fwd_sm90_smem_bytes(head_dim_padded, block_n, variant)
        # (the block map's walk at two blocks per SM: 28-88 bytes of spill at 128
        # registers, NVRTC 13.0; one block per SM, 144-198 registers, none)
        if not variant & VAR_BIAS_STAGED or variant & VAR_BLOCK_MAP or 2 * (smem + 1024) > smem_per_sm((9, 0)):
            return block_n, 1
    if variant & (VAR_ALIBI | VAR_DROPOUT):
        return block_n, 1
    return block_n, ctas_per_sm


#: The places of the VARIANT, BLOCK_M and BLOCK_N template arguments in each forward that
#: takes a block map (the kernels' template orders, this module's docstring); BLOCK_M None:
#: the kernel's is fixed, SM90_BLOCK_M.
_FWD_MAP_KERNELS = {"flash_fwd_sm90.cu": (6, None, 2), "flash_fwd_ws.cu": (7, 2, 3)}


def fwd_block_map_tile(plan: FwdPlan) -> tuple[int, int] | None:
    """(BLOCK_M, BLOCK_N) of the tile map ``plan``'s kernel reads (VAR_BLOCK_MAP: the
    wgmma kernels with a mask, cp.async or warp-specialised), or None where its kernel
    takes no map."""
    main = plan.main
    where = _FWD_MAP_KERNELS.get(main.source)
    if where is None or not int(main.args[where[0]]) & VAR_BLOCK_MAP:
        return None
    return (SM90_BLOCK_M if where[1] is None else int(main.args[where[1]])), int(main.args[where[2]])


def uses_sm90_fwd(head_dim_padded: int, vec: bool, cc: tuple[int, int]) -> bool:
    """Whether the wgmma kernel serves this padded head_dim (before any split-KV)."""
    return cc == (9, 0) and vec and head_dim_padded in _FWD_SM90


def combine_launch(dtype: str, head_dim_padded: int, rows: int = 1) -> Launch:
    """The split-KV combine kernel: one warp per (batch, head, query row)."""
    return Launch("flash_fwd.cu", "cupyflash::flash_fwd_combine_kernel",
                  (CTYPES[dtype], str(head_dim_padded)), (max(1, math.ceil(rows / 4)), 1, 1), (128, 1, 1), 0)


def num_splits_heuristic(work_blocks: int, n_blocks: int, num_sms: int) -> int:
    """How many key ranges to split each query block's work into.

    Split only when the (batch, head, query block) grid fills less than most of
    one wave, and give every split at least two key blocks.
    """
    if work_blocks >= 0.8 * num_sms or n_blocks < 4:
        return 1
    want = math.ceil(2 * num_sms / work_blocks)
    return max(1, min(want, n_blocks // 2, 128))


def _check_launch_dims(fn: str, **dims: int) -> None:
    """A plan is for a launch: each of ``dims`` >= 1 (empty problems never reach the
    planners: the API returns their results without launching anything), and a
    ``nheads_kv`` that divides ``nheads_q``."""
    for name, value in dims.items():
        if value < 1:
            raise ValueError(f"cupyflash: {fn} plans a launch and needs {name} >= 1 (an empty problem has "
                             f"nothing to launch); got {value}")
    if "nheads_kv" in dims and dims["nheads_q"] % dims["nheads_kv"]:
        raise ValueError(f"cupyflash: {fn} needs nheads_kv dividing nheads_q ({dims['nheads_q']}); "
                         f"got {dims['nheads_kv']}")


def select_fwd(*, batch: int, seqlen_q: int, seqlen_k: int, nheads_q: int, head_dim: int,
               dtype: str, causal: bool, vec: bool, num_sms: int = 132,
               cc: tuple[int, int] = (9, 0), varlen: bool = False, variant: int = 0,
               ws: bool | tuple[int, ...] = False, persistent: bool | str = False,
               ws_block_map: bool | tuple[int, ...] = False, ws_bias: bool | tuple[int, ...] = False) -> FwdPlan:
    """Choose the forward kernel, its grid and whether to split the keys.

    ``vec`` says 16-byte accesses are legal (data pointers 16-byte aligned,
    batch/row/head strides and head_dim multiples of 8 elements).
    ``varlen``: a packed batch (``cu_seqlens``), with ``seqlen_q``/``seqlen_k``
    the longest lengths (``max_seqlen_q/k``); the grid covers them for every
    sequence and blocks past a shorter sequence return at once. Packed batches
    are never split over keys (the split-KV partials are laid out densely).
    ``variant``: the VARIANT bits (:func:`variant_bits`).
    ``ws``: take the warp-specialised kernel where it serves the call (:func:`uses_ws_fwd`)
    and the keys are not split: True at every head_dim it has, or a tuple of the padded
    head_dims to take it at (:data:`FWD_WS`, :data:`FWD_WS_WINS`); False or () never.
    ``persistent``: that kernel's persistent form (:data:`FWD_WS_PERSISTENT`), on a grid of
    ``num_sms`` blocks at most, where it takes the variant (:func:`uses_persistent_ws`);
    "auto": where it pays (:func:`persistent_ws_pays`).
    ``ws_block_map``: as ``ws``, for a call with a mask and its map (VAR_MASK |
    VAR_BLOCK_MAP, no bias), in place of ``ws`` (:data:`FWD_WS_BLOCK_MAP`).
    ``ws_bias``: as ``ws``, for a call with a bias (VAR_BIAS), in place of ``ws``
    (:data:`FWD_WS_BIAS`).
    """
    if dtype not in CTYPES:
        raise ValueError(f"cupyflash: dtype must be one of {sorted(CTYPES)}; got {dtype}")
    if cc < ARCHS[0]:
        raise NotImplementedError(f"cupyflash: needs compute capability 8.0 or newer; got {cc[0]}.{cc[1]}")
    _check_launch_dims("select_fwd", batch=batch, seqlen_q=seqlen_q, nheads_q=nheads_q)
    d = padded_head_dim(head_dim)
    ws_variant = ws_fwd_variant(variant)
    if ws_variant & FWD_WS_MAP_VARIANTS:
        ws = ws_block_map
    elif ws_variant & FWD_WS_BIAS_VARIANTS:
        ws = ws_bias
    if (ws is True or (ws and d in ws)) and uses_ws_fwd(d, vec, cc, ws_variant, varlen):
        block_n = fwd_ws_tile(d, causal, ws_variant)[0]
        block_m = fwd_ws_block_m(d, ws_variant, seqlen_q=seqlen_q)  # (192 rows: one block per tile)
        num_m_blocks = math.ceil(seqlen_q / block_m)
        n_blocks = math.ceil(seqlen_k / block_n)
        if varlen or num_splits_heuristic(batch * nheads_q * num_m_blocks, n_blocks, num_sms) == 1:
            if persistent == "auto":
                persistent = persistent_ws_pays(ws_variant, varlen)
            persistent = bool(persistent) and uses_persistent_ws(ws_variant, varlen, d) and block_m == FWD_WS_BLOCK_M
            grid = fwd_ws_grid(num_m_blocks, batch * nheads_q, causal, num_sms, persistent)
            main = fwd_ws_launch(dtype, d, causal, head_dim == d, grid, ws_variant, varlen, persistent, block_m)
            return FwdPlan(main, None, d, num_m_blocks, 1, n_blocks, (block_m, block_n))
    if uses_sm90_fwd(d, vec, cc):
        block_m, block_n = SM90_BLOCK_M, fwd_sm90_tile(d, causal, variant)[0]
    else:
        block_m, block_n, _ = fwd_tiles(d, vec, causal, cc, variant=fwd_variant(d, variant, sm90=False))
    splits = 1 if varlen else num_splits_heuristic(batch * nheads_q * math.ceil(seqlen_q / block_m),
                                                   math.ceil(seqlen_k / block_n), num_sms)
    if splits == 1 and uses_sm90_fwd(d, vec, cc):
        num_m_blocks = math.ceil(seqlen_q / block_m)
        main = fwd_sm90_launch(dtype, d, causal, head_dim == d, (num_m_blocks * batch * nheads_q, 1, 1),
                               variant)
        return FwdPlan(main, None, d, num_m_blocks, 1, math.ceil(seqlen_k / block_n))
    if splits > 1:
        block_m, block_n, _ = fwd_tiles(d, vec, causal, cc, split=True, variant=variant)
    num_m_blocks = math.ceil(seqlen_q / block_m)
    n_blocks = math.ceil(seqlen_k / block_n)
    per_split = math.ceil(n_blocks / splits)
    splits = math.ceil(n_blocks / per_split) if n_blocks else 1
    split = splits > 1
    grid = (num_m_blocks * batch * nheads_q, splits, 1)
    main = fwd_launch(dtype, d, causal, head_dim == d, vec, split, grid, cc, variant)
    combine = combine_launch(dtype, d, batch * nheads_q * seqlen_q) if split else None
    return FwdPlan(main, combine, d, num_m_blocks, splits, per_split)


def all_fwd_launches(cc: tuple[int, int] = (9, 0)) -> list[Launch]:
    """Every forward instantiation select_fwd can return on ``cc`` (for check-kernels)."""
    out = []
    for dtype, d, causal, even_k, vec, split in itertools.product(
            CTYPES, HEAD_DIMS, (False, True), (True, False), (True, False), (False, True)):
        out.append(fwd_launch(dtype, d, causal, even_k, vec, split, cc=cc))
    for dtype, d in itertools.product(CTYPES, HEAD_DIMS):
        out.append(combine_launch(dtype, d))
    for dtype, d, causal, even_k in itertools.product(CTYPES, HEAD_DIMS, (False, True), (True, False)):
        if uses_sm90_fwd(d, True, cc):
            out.append(fwd_sm90_launch(dtype, d, causal, even_k))
    for dtype, d, causal, even_k, varlen, persistent in itertools.product(
            CTYPES, HEAD_DIMS, (False, True), (True, False), (False, True), (False, True)):
        if uses_ws_fwd(d, True, cc, 0, varlen) and (uses_persistent_ws(0, varlen, d) or not persistent):
            out.append(fwd_ws_launch(dtype, d, causal, even_k, varlen=varlen, persistent=persistent))
            if not persistent:  # the mask with its map, in every dtype and EVEN_K too (never persistent)
                out.append(fwd_ws_launch(dtype, d, causal, even_k, variant=FWD_WS_MAP_VARIANTS, varlen=varlen))
                # the 192-row tile at D=64, whatever FWD_WS_D64_BLOCK_M selects
                for block_m in FWD_WS_BLOCK_MS[1:]:
                    if fwd_ws_block_m(d, 0, False, block_m) == block_m:
                        out.append(fwd_ws_launch(dtype, d, causal, even_k, varlen=varlen, block_m=block_m))
    # Each variant switched on alone (a bias or mask also read element by element), and
    # the combinations of a bias that users run, on the aligned kernels (one dtype: the
    # other's registers are the same).
    for bit, d, causal, split in itertools.product(FWD_CHECK_VARIANTS, HEAD_DIMS, (False, True), (False, True)):
        out.append(fwd_launch(_VARIANT_CHECK_DTYPE, d, causal, True, True, split, cc=cc, variant=bit))
        if uses_sm90_fwd(d, True, cc) and not split:
            out.append(fwd_sm90_launch(_VARIANT_CHECK_DTYPE, d, causal, True, variant=bit))
    # The warp-specialised forward's variants (FWD_WS_CHECK_VARIANTS) at each head_dim it has.
    for bits, d, causal, varlen, persistent in itertools.product(FWD_WS_CHECK_VARIANTS, HEAD_DIMS, (False, True),
                                                                 (False, True), (False, True)):
        if (uses_ws_fwd(d, True, cc, bits, varlen) and (uses_persistent_ws(bits, varlen, d) or not persistent)
                and bits != FWD_WS_MAP_VARIANTS):  # (the map alone: above)
            out.append(fwd_ws_launch(_VARIANT_CHECK_DTYPE, d, causal, True, variant=bits, varlen=varlen,
                                     persistent=persistent))
            for block_m in FWD_WS_BLOCK_MS[1:]:
                if not persistent and fwd_ws_block_m(d, bits, False, block_m) == block_m:
                    out.append(fwd_ws_launch(_VARIANT_CHECK_DTYPE, d, causal, True, variant=bits, varlen=varlen,
                                             block_m=block_m))
    # The staged bias and mask (the wgmma kernel; where the stages do not fit, the
    # register path it takes instead).
    for bit, d, causal in itertools.product(FWD_STAGED_CHECK_VARIANTS, HEAD_DIMS, (False, True)):
        if uses_sm90_fwd(d, True, cc):
            out.append(fwd_sm90_launch(_VARIANT_CHECK_DTYPE, d, causal, True, variant=bit))
    return out


#: The VARIANT values check-kernels compiles each forward with: each bit alone (the
#: strided bit with each array it reads), and a bias with a mask, softcap or a window.
FWD_CHECK_VARIANTS = (
    *(bit for bit in VARIANT_BITS.values() if bit not in _QUALIFIER_BITS),
    VAR_BIAS | VAR_BIAS_STRIDED, VAR_BIAS_FP32 | VAR_BIAS_STRIDED, VAR_MASK | VAR_BIAS_STRIDED,
    VAR_BIAS | VAR_MASK, VAR_BIAS | VAR_SOFTCAP, VAR_BIAS | VAR_WINDOW,
    # the mask's block map (the wgmma kernel's; the mma.sync kernel drops the bit)
    *(VAR_BLOCK_MAP | VAR_MASK | bits for bits in (0, VAR_BIAS_STRIDED, VAR_BIAS, VAR_WINDOW, VAR_SINKS)),
)
#: ... and staged (VAR_BIAS_STAGED): each array alone, both together, a bias with
#: softcap, a window, ALiBi or dropout.
FWD_STAGED_CHECK_VARIANTS = tuple(VAR_BIAS_STAGED | bits for bits in (
    VAR_BIAS, VAR_BIAS_FP32, VAR_MASK, VAR_BIAS | VAR_MASK, VAR_BIAS_FP32 | VAR_MASK,
    VAR_BIAS | VAR_SOFTCAP, VAR_BIAS | VAR_WINDOW, VAR_BIAS | VAR_ALIBI, VAR_BIAS | VAR_DROPOUT,
    VAR_BLOCK_MAP | VAR_MASK, VAR_BLOCK_MAP | VAR_MASK | VAR_BIAS, VAR_BLOCK_MAP | VAR_MASK | VAR_BIAS_FP32,
    VAR_BLOCK_MAP | VAR_MASK | VAR_WINDOW))


#: ... and the warp-specialised forward's: each of its variants alone, softcap with
#: ALiBi, and a window with sinks, with dropout (the combination that came closest to
#: spilling: kernels_cu/flash_fwd_ws.cu KEEP_UNDER_S) and with all the others; and the
#: largest sets without a window or without dropout, and softcap, ALiBi and sinks together
#: (the largest a persistent call takes with neither, and at 256, where _FWD_WS_SPILLS
#: leaves out the window with dropout, the largest sets the kernel takes).
FWD_WS_CHECK_VARIANTS = (VAR_WINDOW, VAR_SOFTCAP, VAR_ALIBI, VAR_SINKS, VAR_DROPOUT, VAR_SOFTCAP | VAR_ALIBI,
                         VAR_WINDOW | VAR_SINKS, VAR_WINDOW | VAR_DROPOUT, FWD_WS_VARIANTS,
                         FWD_WS_VARIANTS & ~VAR_DROPOUT, FWD_WS_VARIANTS & ~VAR_WINDOW,
                         VAR_SOFTCAP | VAR_ALIBI | VAR_SINKS,
                         # the mask with its map (FWD_WS_BLOCK_MAP): alone, and with the variants
                         # it takes there (not FWD_WS_MAP_SPILLS)
                         *(FWD_WS_MAP_VARIANTS | bits for bits in (0, VAR_ALIBI, VAR_SINKS, VAR_ALIBI | VAR_SINKS)),
                         # the bias (FWD_WS_BIAS): alone, with each variant it takes, and with all of them
                         *(FWD_WS_BIAS_VARIANTS | bits for bits in (0, VAR_WINDOW, VAR_SOFTCAP, VAR_ALIBI, VAR_SINKS,
                                                                    FWD_WS_VARIANTS & ~FWD_WS_BIAS_SPILLS)))

#: The backward's staged bias and mask (VAR_BIAS_STAGED) that check-kernels compiles:
#: each array alone, both, and a bias with softcap (whose dS recomputes the score).
_BWD_STAGED_KERNELS = tuple(f"cupyflash::flash_bwd_{k}_kernel" for k in ("dkdv", "dq", "dkdv_sm90", "dq_sm90"))
BWD_STAGED_CHECK_VARIANTS = tuple(VAR_BIAS_STAGED | bits for bits in (
    VAR_BIAS, VAR_BIAS_FP32, VAR_MASK, VAR_BIAS | VAR_MASK, VAR_BIAS | VAR_SOFTCAP))

#: check-kernels compiles each variant alone in this dtype.
_VARIANT_CHECK_DTYPE = "bfloat16"


# ----------------------------------------------------------------------------
# Backward (kernels_cu/flash_bwd.cu)
# ----------------------------------------------------------------------------

#: Rows each thread of the backward's preprocess kernel loads before it reduces
#: (its ROWS_PER_THREAD template argument; kernels_cu/flash_bwd.cu). At the seed
#: shape (B=1, H=32, seqlen 512, D=128, fp16) on the H200, ncu: 1 row 6.9-7.2 us,
#: 2 rows 6.8-7.0, 4 rows 6.2-6.4, 8 rows 6.5-6.8; FA2's dot_do_o kernel 6.3 us
#: (kernels_cu/PERF.md, session 4).
BWD_PREPROCESS_ROWS_PER_THREAD = 4
_BWD_PREPROCESS_THREADS = 256  # kernels_cu/flash_bwd.cu PREPROCESS_THREADS


def bwd_preprocess_row_lanes(head_dim_padded: int) -> int:
    """Lanes per query row in the preprocess kernel (its ROW_LANES): 8 elements
    each, head_dim_padded / 8 rounded up to a power of two (4, 8, 16, 16, 32, 32
    for head_dim_padded 32, 64, 96, 128, 192, 256)."""
    return max(4, 1 << (math.ceil(head_dim_padded / 8) - 1).bit_length())


def bwd_preprocess_rows(head_dim_padded: int) -> int:
    """Query rows per block of the preprocess kernel (consecutive rows of the row
    buffers): 256 / ROW_LANES threads' worth of rows, BWD_PREPROCESS_ROWS_PER_THREAD
    each (64 at head_dim_padded 96 and 128 with 4 rows per thread)."""
    return _BWD_PREPROCESS_THREADS // bwd_preprocess_row_lanes(head_dim_padded) * BWD_PREPROCESS_ROWS_PER_THREAD


# dK/dV kernel tiles per padded head_dim, best first; select_bwd takes the first
# that fits the GPU's shared memory, double-buffered (Q, dO) if that fits too.
# (BLOCK_M, BLOCK_N, NUM_WARPS, WARPS_M_SDP, WARPS_N_DKV, WARPS_M_DQ): the last
# three split the warps over the query rows of S/dP, the key rows of dK/dV and
# the query rows of dQ. 8 warps keep K, V, dK, dV for BLOCK_N keys on one SM;
# the register file bounds dK + dV (2 * BLOCK_N * HEAD_DIM fp32 over 256
# threads, at most 128 per thread) plus S and dP. Every warp tile is at least
# 16x32 so each ldmatrix feeds two or more mma. The first entry of each pair
# needs ~130-180 KB of shared memory at 2 stages (sm_90; sm_80 runs it with 1
# stage); the second fits 99 KB (sm_86, sm_89, sm_120).
_BWD_TILES = {
    32: ((128, 128, 8, 4, 4, 4), (64, 128, 8, 2, 4, 4)),
    64: ((128, 128, 8, 4, 4, 4), (64, 128, 8, 2, 4, 4)),
    96: ((64, 128, 8, 2, 4, 4), (64, 64, 8, 4, 4, 4)),
    128: ((64, 128, 8, 2, 4, 2), (64, 64, 8, 4, 2, 2)),
    192: ((64, 64, 8, 4, 2, 2), (32, 64, 8, 2, 2, 2)),
    256: ((64, 64, 8, 4, 2, 2), (32, 32, 4, 2, 2, 2)),
}

# Deterministic dQ kernel tiles, best first: (BLOCK_M, BLOCK_N, NUM_WARPS), one
# m16 tile of query rows per warp (dQ, S and dP all live in registers).
_BWD_DQ_TILES = {
    32: ((64, 128, 4),),
    64: ((64, 128, 4),),
    96: ((64, 64, 4),),
    128: ((64, 64, 4),),
    192: ((64, 32, 4),),
    256: ((64, 32, 4), (64, 16, 4)),
}

_BWD_THREADS_AUX = 256  # convert kernels: 8 warps, one row per warp at a time
_SEQLENS_SLOT_BYTES = 16  # dK/dV kernel: the block's SeqLens in shared memory (kernels_cu/seqlens.cuh)


def max_smem_per_block(cc: tuple[int, int]) -> int:
    """Opt-in dynamic shared memory per block (bytes) for a compute capability."""
    if cc in ((8, 0), (8, 7)):
        return 163 * 1024
    if cc[0] in (9, 10):
        return 227 * 1024
    return 99 * 1024  # 8.6, 8.9, 12.x


def bwd_smem_bytes(head_dim_padded: int, tile: tuple[int, ...], stages: int, variant: int = 0) -> int:
    """Shared memory of the dK/dV kernel (kernels_cu/flash_bwd.cu BwdTraits; the kernel
    traps on less when staged): K, V, P, dS, the SeqLens slot, then per stage Q, dO,
    lse_log2, delta and (VAR_BIAS_STAGED) the query block's bias/mask tile."""
    block_m, block_n = tile[:2]
    fixed = (2 * _smem_tile_bytes(block_n, head_dim_padded) + 2 * _smem_tile_bytes(block_m, block_n)
             + _SEQLENS_SLOT_BYTES)
    stage = (2 * _smem_tile_bytes(block_m, head_dim_padded) + 2 * block_m * 4
             + _score_stage_bytes(block_m, block_n, variant))
    return fixed + stages * stage


def bwd_dq_smem_bytes(head_dim_padded: int, tile: tuple[int, int, int], variant: int = 0) -> int:
    """Shared memory of the deterministic dQ kernel (BwdDqTraits::SMEM_BYTES): Q, dO, V,
    two K and (VAR_BIAS_STAGED) two of the key block's bias/mask tile."""
    block_m, block_n, _ = tile
    return (2 * _smem_tile_bytes(block_m, head_dim_padded) + 3 * _smem_tile_bytes(block_n, head_dim_padded)
            + 2 * _score_stage_bytes(block_m, block_n, variant))


def score_stage_ok(block_n: int, variant: int) -> bool:
    """Whether a kernel with ``block_n`` keys per tile can stage the bias and mask
    (variant.cuh StageTile: rows of two 16-byte chunks at least, the mask's 1-byte
    elements included)."""
    itemsize = 1 if variant & VAR_MASK else 2 if variant & VAR_BIAS else 4
    return block_n * itemsize >= 32


def _unstaged(variant: int, keep: bool) -> int:
    """``variant``, less VAR_BIAS_STAGED unless ``keep``."""
    return variant if keep else variant & ~VAR_BIAS_STAGED


@dataclass(frozen=True)
class BwdPlan:
    """The backward's launches and scratch buffers.

    The fp32 row buffers have one row per query row (``lse_log2``, ``delta``:
    ``nheads_q * total_q`` values; ``dq_accum``: as many rows of
    ``head_dim_padded``) or per key row (``dkv_accum``: ``(2, kv_splits,
    nheads_kv * total_k, head_dim_padded)``), with no padding; ``total_q =
    batch * seqlen_q`` for a dense batch (laid out ``(batch, nheads, seqlen)``)
    and ``q.shape[0]`` for a packed one (laid out ``(nheads, total)``).
    """

    launches: tuple[Launch, ...]  # in launch order: preprocess, dK/dV, dQ or convert, [convert dK/dV], [dbias]
    head_dim_padded: int
    num_stages: int               # dK/dV kernel: Q/dO buffers in flight (BwdParams.num_stages)
    dq_accum: bool                # whether dq_accum is used (default mode)
    kv_splits: int                # dK/dV blocks per (key block, KV head); > 1 needs dkv_accum
    #: The warp-specialised dK/dV kernel's TMA boxes: rows of (Q, K, V, dO) per copy; None
    #: for the other kernels (cupyflash/_tma.py builds the maps, BwdTmaParams holds them).
    tma_box_rows: tuple[int, int, int, int] | None = None


def bwd_preprocess_launch(dtype: str, head_dim_padded: int, vec: bool, rows: int = 1) -> Launch:
    """One block per bwd_preprocess_rows(head_dim_padded) consecutive rows of the
    ``rows`` query rows of the row buffers (all heads, all batch entries)."""
    lanes = bwd_preprocess_row_lanes(head_dim_padded)
    return Launch("flash_bwd.cu", "cupyflash::flash_bwd_preprocess_kernel",
                  (CTYPES[dtype], str(lanes), str(BWD_PREPROCESS_ROWS_PER_THREAD), _cbool(vec)),
                  (max(1, math.ceil(rows / bwd_preprocess_rows(head_dim_padded))), 1, 1),
                  (_BWD_PREPROCESS_THREADS, 1, 1), 0)


def bwd_convert_launch(dtype: str, vec: bool, rows: int = 1, swizzled: bool = False) -> Launch:
    """dq = softmax_scale·dq_accum; ``swizzled``: dq_accum in the warp-specialised backward's
    layout (kernels_cu/bwd_rows.cuh dq_accum_piece; aligned data only, as that kernel's)."""
    if swizzled and not vec:
        raise ValueError("cupyflash: the ws backward's dq_accum layout is converted on aligned data only")
    return Launch("flash_bwd.cu", "cupyflash::flash_bwd_convert_dq_kernel",
                  (CTYPES[dtype], _cbool(vec), _cbool(swizzled)),
                  (max(1, math.ceil(rows / (_BWD_THREADS_AUX // 32))), 1, 1), (_BWD_THREADS_AUX, 1, 1), 0)


def bwd_convert_dkv_launch(dtype: str, vec: bool, rows: int = 1) -> Launch:
    return Launch("flash_bwd.cu", "cupyflash::flash_bwd_convert_dkv_kernel", (CTYPES[dtype], _cbool(vec)),
                  (max(1, math.ceil(rows / (_BWD_THREADS_AUX // 32))), 1, 1), (_BWD_THREADS_AUX, 1, 1), 0)


def bwd_kv_splits(blocks: int, group: int, num_sms: int) -> int:
    """Split each GQA group's query heads over this many dK/dV blocks.

    One block per (key block, batch, KV head) loops over the group's query
    heads; with few KV heads that can leave most SMs idle. Take the smallest
    divisor of the group that gives two blocks per SM (the dK/dV kernel runs
    one block per SM), or the whole group.
    """
    for s in range(1, group + 1):
        if group % s == 0 and blocks * s >= 2 * num_sms:
            return s
    return group


def bwd_dkdv_launch(dtype: str, head_dim_padded: int, tile: tuple[int, ...], causal: bool, even_k: bool,
                    vec: bool, deterministic: bool, stages: int = 2,
                    grid: tuple[int, int, int] = (1, 1, 1), variant: int = 0) -> Launch:
    """The dK/dV kernel instantiation for one tile and set of compile-time choices."""
    block_m, block_n, num_warps, wm_sdp, wn_dkv, wm_dq = tile
    args = (CTYPES[dtype], str(head_dim_padded), str(block_m), str(block_n), str(num_warps), str(wm_sdp),
            str(wn_dkv), str(wm_dq), _cbool(causal), _cbool(even_k), _cbool(vec), _cbool(deterministic),
            str(variant))
    return Launch("flash_bwd.cu", "cupyflash::flash_bwd_dkdv_kernel", args, grid, (num_warps * 32, 1, 1),
                  bwd_smem_bytes(head_dim_padded, tile, stages, variant))


def bwd_dq_launch(dtype: str, head_dim_padded: int, tile: tuple[int, int, int], causal: bool, even_k: bool,
                  vec: bool, grid: tuple[int, int, int] = (1, 1, 1), variant: int = 0) -> Launch:
    """The deterministic dQ kernel instantiation."""
    block_m, block_n, num_warps = tile
    args = (CTYPES[dtype], str(head_dim_padded), str(block_m), str(block_n), str(num_warps),
            _cbool(causal), _cbool(even_k), _cbool(vec), str(variant))
    return Launch("flash_bwd.cu", "cupyflash::flash_bwd_dq_kernel", args, grid, (num_warps * 32, 1, 1),
                  bwd_dq_smem_bytes(head_dim_padded, tile, variant))



# The dbias kernel (kernels_cu/flash_bwd_dbias.cu): one block per tile of dbias,
# (BLOCK_M, BLOCK_N, NUM_WARPS, WARPS_M) per padded head_dim, best first;
# bwd_dbias_tile takes the first that fits the GPU's shared memory, with two stages
# if they fit, else one. Each visit loads Q, dO (BLOCK_M rows) and K, V (BLOCK_N keys)
# for two GEMMs over them, so the bytes per MMA fall with the tile's size: 128 x 64
# moves 3/4 of what 64 x 64 does per (query, key) pair. The warp tiles are 32 x 32
# (S, dP and the fp32 dbias accumulator 32 registers each next to the tile's bias);
# 128 x 128 (32 x 64 warp tiles) would need 192 for those three alone.
_BWD_DBIAS_TILES = {
    32: ((128, 64, 8, 4), (64, 64, 4, 2)),
    64: ((128, 64, 8, 4), (64, 64, 4, 2)),
    96: ((128, 64, 8, 4), (64, 64, 4, 2)),
    128: ((128, 64, 8, 4), (64, 64, 4, 2)),
    192: ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 2, 1)),
    256: ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 2, 1)),
}


#: check-kernels compiles the dbias kernel with each bias kind (q's dtype, fp32; read in
#: pairs or element by element: a bias broadcast along keys is always the latter), with
#: and without the mask, causal or not ...
DBIAS_CHECK_VARIANTS = tuple(bias | extra for bias in (VAR_BIAS, VAR_BIAS_FP32)
                             for extra in (0, VAR_MASK, VAR_BIAS_STRIDED))
#: ... and with each other variant beside a bias.
DBIAS_CHECK_WITH = (VAR_WINDOW, VAR_SOFTCAP, VAR_ALIBI, VAR_SINKS, VAR_DROPOUT)


def bwd_dbias_smem_bytes(head_dim_padded: int, tile: tuple[int, int, int, int], stages: int) -> int:
    """kernels_cu/flash_bwd_dbias.cu BwdDbiasTraits::SMEM_BYTES: per stage Q, K, dO, V;
    two slots of (lse_log2, delta) rows; at least the epilogue's fp32 tile (rows padded
    by 4 floats)."""
    block_m, block_n = tile[:2]
    pipe = (stages * 2 * (_smem_tile_bytes(block_m, head_dim_padded) + _smem_tile_bytes(block_n, head_dim_padded))
            + 2 * 2 * block_m * 4)
    return max(pipe, block_m * (block_n + 4) * 4)


def bwd_dbias_tile(head_dim_padded: int, cc: tuple[int, int] = (9, 0)) -> tuple[tuple[int, int, int, int], int]:
    """The dbias kernel's ``(tile, stages)`` on a GPU of compute capability ``cc``:
    the first tile of the table that fits its shared memory, two stages if they fit."""
    limit = max_smem_per_block(cc)
    for tile in _BWD_DBIAS_TILES[head_dim_padded]:
        for stages in (2, 1):
            if bwd_dbias_smem_bytes(head_dim_padded, tile, stages) <= limit:
                return tile, stages
    raise NotImplementedError(
        f"cupyflash: no dbias tile for head_dim {head_dim_padded} fits {limit} bytes of shared memory")


def bwd_dbias_grid(tile: tuple[int, ...], dbias_shape: tuple[int, int, int, int], seqlen_q: int,
                   seqlen_k: int) -> tuple[int, int, int]:
    """One block per tile of dbias over the bias's 4-D shape: a size-1 row (key)
    dimension is one tile that the block sums over every query (key) block."""
    batch_b, heads_b, rows_b, cols_b = dbias_shape
    tiles_m = 1 if rows_b == 1 else math.ceil(seqlen_q / tile[0])
    tiles_n = 1 if cols_b == 1 else math.ceil(seqlen_k / tile[1])
    return (batch_b * heads_b * tiles_m * tiles_n, 1, 1)


# Hopper (cc 9.0) at padded head_dim 64 and 128 with 16-byte loads: the same kernel body
# with S and dP on wgmma (flash_bwd_dbias_sm90_kernel): 128 x 64 tiles, each warpgroup
# 64 rows x 64 keys (m64n64k16), two stages of 128-byte-swizzled Q, dO, K, V. The
# mma.sync kernel issued ~4.6 cycles per instruction at 8 warps per SM (ncu, run 58):
# latency- and issue-bound on its ldmatrix/mma stream, which wgmma replaces by 2·D/16
# instructions per warpgroup and visit.
_BWD_DBIAS_SM90_HEAD_DIMS = (64, 128)
BWD_DBIAS_SM90_TILE = (128, 64, 8)  # BLOCK_M, BLOCK_N, NUM_WARPS (each warp 16 rows x BLOCK_N keys)


def uses_sm90_dbias(head_dim_padded: int, vec: bool, cc: tuple[int, int]) -> bool:
    """Whether the wgmma dbias kernel serves this padded head_dim."""
    return cc == (9, 0) and vec and head_dim_padded in _BWD_DBIAS_SM90_HEAD_DIMS


def bwd_dbias_sm90_smem_bytes(head_dim_padded: int) -> int:
    """BwdDbiasTraits::SMEM_BYTES of the wgmma kernel: two stages of Q, dO (BLOCK_M rows)
    and K, V (BLOCK_N rows), unpadded in the 128-byte swizzle; two slots of (lse_log2,
    delta) rows; 1 KB to align to the swizzle atom."""
    block_m, block_n, _ = BWD_DBIAS_SM90_TILE
    pipe = 2 * 2 * (block_m + block_n) * head_dim_padded * 2 + 2 * 2 * block_m * 4
    return max(pipe, block_m * (block_n + 4) * 4) + 1024


def bwd_dbias_sm90_launch(dtype: str, head_dim_padded: int, causal: bool, even_k: bool,
                          grid: tuple[int, int, int] = (1, 1, 1), variant: int = VAR_BIAS) -> Launch:
    """The wgmma dbias kernel instantiation (cc 9.0; ``variant`` holds a bias bit)."""
    if not variant & (VAR_BIAS | VAR_BIAS_FP32):
        raise ValueError(f"cupyflash: the dbias kernel needs a bias in its variant bits; got {variant}")
    block_m, block_n, num_warps = BWD_DBIAS_SM90_TILE
    args = (CTYPES[dtype], str(head_dim_padded), str(block_m), str(block_n), str(num_warps), _cbool(causal),
            _cbool(even_k), str(variant))
    return Launch("flash_bwd_dbias.cu", "cupyflash::flash_bwd_dbias_sm90_kernel", args, grid,
                  (num_warps * 32, 1, 1), bwd_dbias_sm90_smem_bytes(head_dim_padded))


# Strips (flash_bwd_dbias_strip_sm90_kernel, the same 128 x 64 wgmma tiles): one block
# per strip of 128 query rows of one bias (batch, head) walking every key tile, with Q,
# dO, lse_log2 and delta of the (batch, head) pairs that broadcast onto the bias (its
# "pairs": B with a bias batch of 1, times H with a bias head of 1) resident in shared
# memory, K and V streamed through a three-stage ring (the kernel computes step i+1's S
# and dP while it does step i's elementwise work). For a bias with whole rows and keys
# whose pairs fit beside the ring (padded D=64: 5, D=128: 2, which fill 227 KB exactly)
# and whose strips fill the GPU once (at least num_sms blocks x DBIAS_STRIP_MIN_WAVES);
# otherwise the tile kernel.
_BWD_DBIAS_STRIP_HEAD_DIMS = (64, 128)
#: Strips only when their grid is at least this many waves of num_sms blocks (a strip walks
#: every key tile in one block: a short grid leaves SMs idle). Tests set 0.
DBIAS_STRIP_MIN_WAVES = 1.0


def dbias_strip_pairs(dbias_shape: tuple[int, int, int, int], batch: int, nheads_q: int) -> int:
    """The (batch, head) pairs that broadcast onto one strip of dbias."""
    return (batch if dbias_shape[0] == 1 else 1) * (nheads_q if dbias_shape[1] == 1 else 1)


def bwd_dbias_strip_smem_bytes(head_dim_padded: int, pairs: int) -> int:
    """dbias_strip's shared memory: 1 KB to align to the swizzle atom; three stages of K, V
    (BLOCK_N rows); Q, dO (BLOCK_M rows) and lse_log2, delta rows of each pair."""
    block_m, block_n, _ = BWD_DBIAS_SM90_TILE
    return 1024 + 3 * 2 * block_n * head_dim_padded * 2 + pairs * (2 * block_m * head_dim_padded * 2 + 2 * block_m * 4)


def bwd_dbias_strip_max_pairs(head_dim_padded: int, cc: tuple[int, int] = (9, 0)) -> int:
    """The most pairs per strip that fit the shared memory of ``cc`` (D=64: 5, D=128: 2)."""
    pairs = 0
    while bwd_dbias_strip_smem_bytes(head_dim_padded, pairs + 1) <= max_smem_per_block(cc):
        pairs += 1
    return pairs


def bwd_dbias_strip_grid(dbias_shape: tuple[int, int, int, int], seqlen_q: int) -> tuple[int, int, int]:
    """One block per strip of BLOCK_M query rows of each bias (batch, head)."""
    return (dbias_shape[0] * dbias_shape[1] * math.ceil(seqlen_q / BWD_DBIAS_SM90_TILE[0]), 1, 1)


def uses_sm90_dbias_strips(head_dim_padded: int, vec: bool, cc: tuple[int, int],
                           dbias_shape: tuple[int, int, int, int], batch: int, nheads_q: int, seqlen_q: int,
                           num_sms: int) -> bool:
    """Whether the strip kernel computes dbias: the wgmma dbias kernel's head_dims on sm_90
    with 16-byte loads, a bias with whole rows and keys (no size-1 row or key dim), its
    pairs fit shared memory, and the strips make DBIAS_STRIP_MIN_WAVES waves."""
    if not uses_sm90_dbias(head_dim_padded, vec, cc) or head_dim_padded not in _BWD_DBIAS_STRIP_HEAD_DIMS:
        return False
    if dbias_shape[2] == 1 or dbias_shape[3] == 1:
        return False
    if dbias_strip_pairs(dbias_shape, batch, nheads_q) > bwd_dbias_strip_max_pairs(head_dim_padded, cc):
        return False
    return bwd_dbias_strip_grid(dbias_shape, seqlen_q)[0] >= DBIAS_STRIP_MIN_WAVES * num_sms


def bwd_dbias_strip_launch(dtype: str, head_dim_padded: int, causal: bool, even_k: bool,
                           grid: tuple[int, int, int] = (1, 1, 1), variant: int = VAR_BIAS) -> Launch:
    """The strip dbias kernel (cc 9.0; ``variant`` holds a bias bit). Its shared memory is
    that of the most pairs that fit (one block per SM either way: one function attribute
    for every launch)."""
    if not variant & (VAR_BIAS | VAR_BIAS_FP32):
        raise ValueError(f"cupyflash: the dbias kernel needs a bias in its variant bits; got {variant}")
    block_m, block_n, num_warps = BWD_DBIAS_SM90_TILE
    args = (CTYPES[dtype], str(head_dim_padded), str(block_m), str(block_n), str(num_warps), _cbool(causal),
            _cbool(even_k), str(variant))
    smem = bwd_dbias_strip_smem_bytes(head_dim_padded, bwd_dbias_strip_max_pairs(head_dim_padded))
    return Launch("flash_bwd_dbias.cu", "cupyflash::flash_bwd_dbias_strip_sm90_kernel", args, grid,
                  (num_warps * 32, 1, 1), smem)


def bwd_dbias_launch(dtype: str, head_dim_padded: int, tile: tuple[int, int, int, int], stages: int,
                     causal: bool, even_k: bool, vec: bool, grid: tuple[int, int, int] = (1, 1, 1),
                     variant: int = VAR_BIAS) -> Launch:
    """The dbias kernel instantiation (``variant`` holds a bias bit)."""
    if not variant & (VAR_BIAS | VAR_BIAS_FP32):
        raise ValueError(f"cupyflash: the dbias kernel needs a bias in its variant bits; got {variant}")
    block_m, block_n, num_warps, warps_m = tile
    args = (CTYPES[dtype], str(head_dim_padded), str(block_m), str(block_n), str(num_warps), str(warps_m),
            str(stages), _cbool(causal), _cbool(even_k), _cbool(vec), str(variant))
    return Launch("flash_bwd_dbias.cu", "cupyflash::flash_bwd_dbias_kernel", args, grid, (num_warps * 32, 1, 1),
                  bwd_dbias_smem_bytes(head_dim_padded, tile, stages))

# Hopper (cc 9.0, sm_90a) runs the dK/dV kernel of these padded head_dims on
# wgmma (kernels_cu/flash_bwd_sm90.cu): 128 keys per block (two warpgroups of
# 64), query blocks of BLOCK_M rows double-buffered; the preprocess and convert
# kernels stay those of flash_bwd.cu.
_BWD_SM90_HEAD_DIMS = (64, 128)
BWD_SM90_BLOCK_N = 128
#: Query rows per step (BLOCK_M) of the wgmma dK/dV kernel (kernels_cu/flash_bwd_sm90.cu).
#: 128 at D=64 (twice the MMA per step) was not shown faster than 64 (1.16-1.22x FA2 in
#: run 46, within the 1.06-1.33x of 64 in run 32; kernels_cu/PERF.md, v17): removed.
BWD_SM90_BLOCK_M = 64


# Deterministic dQ on wgmma (kernels_cu/flash_bwd_sm90.cu flash_bwd_dq_sm90_kernel),
# (BLOCK_N, CTAS_PER_SM) per padded head_dim; BLOCK_M = 128. False keeps the
# mma.sync dQ kernel (`bench --bwd-dq mma` A/B).
BWD_DQ_SM90 = True
_BWD_DQ_SM90 = {64: (128, 1), 128: (64, 1)}
# ... in place of _BWD_DQ_SM90 per variant bit: the bias's and mask's per-element reads
# spill 148-444 bytes at D=64 with 128 keys (S and dP 64 registers each); 64 keys take
# 218-228 registers.
_BWD_DQ_SM90_VARIANT = {bit: {64: (64, 1)} for bit in (VAR_BIAS, VAR_BIAS_FP32, VAR_MASK)}
BWD_DQ_SM90_BLOCK_M = 128
# Padded head_dims whose default (non-deterministic) backward on Hopper also
# takes dQ from the wgmma dQ kernel instead of atomics in the dK/dV kernel: at
# D=64 the two-kernel path measured faster in 34 of 40 grid points over two H200
# runs (median 1.03x, worst 0.97x; kernels_cu/PERF.md v12). At D=128 it did not
# (0.94-1.06x).
_BWD_SM90_SEPARATE_DQ = (64,)


def _bwd_sm90_separate_dq(head_dim_padded: int) -> bool:
    """Whether the default mode on Hopper takes dQ from the wgmma dQ kernel (no atomic
    dQ in the dK/dV kernel): where measured faster. (With dropout at D=128 the dK/dV
    kernel with atomic dQ spills 16 bytes under the H200's NVRTC 13.0, run 49, and stays
    selected: its backward took 9.59 ms against 11.34 ms through the dQ kernel at 16k
    tokens, runs 49 and 50; kernels_cu/PERF.md v17.)"""
    return head_dim_padded in _BWD_SM90_SEPARATE_DQ


def bwd_ws_separate_dq(head_dim_padded: int, variant: int) -> bool:
    """Whether the warp-specialised backward runs without dQ, beside the wgmma dQ kernel:
    at the head_dims of :func:`_bwd_sm90_separate_dq`, for plain attention only. With a
    variant it takes dQ itself (its reduce warp's bulk adds into dq_accum): at D=64 that
    measured 1.10-1.48x the cp.async plan over 36 variant points, against 1.01-1.24x
    without dQ (PERF.md v25, run 117); plain, without dQ at 128 rows per step is the faster
    (1.13-1.22x against 1.06-1.25x, run 116)."""
    return _bwd_sm90_separate_dq(head_dim_padded) and not variant


def bwd_dq_sm90_launch(dtype: str, head_dim_padded: int, causal: bool, even_k: bool,
                       grid: tuple[int, int, int] = (1, 1, 1), variant: int = 0) -> Launch:
    """The wgmma deterministic dQ kernel (cc 9.0)."""
    d = head_dim_padded
    block_n, ctas_per_sm = bwd_dq_sm90_tile(d, variant)
    args = (CTYPES[dtype], str(d), str(block_n), str(ctas_per_sm), _cbool(causal), _cbool(even_k), str(variant))
    return Launch("flash_bwd_sm90.cu", "cupyflash::flash_bwd_dq_sm90_kernel", args, grid, (256, 1, 1),
                  bwd_dq_sm90_smem_bytes(d, block_n, variant))


def bwd_dq_sm90_tile(head_dim_padded: int, variant: int = 0) -> tuple[int, int]:
    """(BLOCK_N, CTAS_PER_SM) of the wgmma dQ kernel: _BWD_DQ_SM90, or _BWD_DQ_SM90_VARIANT's
    for a bias or mask read element by element; staged (VAR_BIAS_STAGED), the plain
    kernel's tile where its stages fit (D=64, (1, H, N, N) bf16 bias with dbias, N=4096:
    the backward 11.11 ms at 128 keys against 11.81 at 64; PERF.md v20, run 75)."""
    d = head_dim_padded
    if variant & VAR_BIAS_STAGED and _dq_stages_fit(d, _BWD_DQ_SM90[d], variant):
        return _BWD_DQ_SM90[d]
    return next((table[d] for bit, table in _BWD_DQ_SM90_VARIANT.items() if variant & bit and d in table),
                _BWD_DQ_SM90[d])


def _dq_stages_fit(head_dim_padded: int, tile: tuple[int, int], variant: int, cc: tuple[int, int] = (9, 0)) -> bool:
    """Whether the wgmma dQ kernel's blocks of ``tile`` (BLOCK_N, CTAS_PER_SM) fit an SM with
    ``variant``'s stages."""
    smem = bwd_dq_sm90_smem_bytes(head_dim_padded, tile[0], variant)
    return tile[1] * (smem + 1024) <= smem_per_sm(cc) and smem <= max_smem_per_block(cc)


def bwd_dq_sm90_smem_bytes(head_dim_padded: int, block_n: int, variant: int = 0) -> int:
    """kernels_cu/flash_bwd_sm90.cu BwdDqSm90Traits::SMEM_BYTES (the kernel traps on less
    when staged): Q, dO, 3 stages of (K, V and, staged, the key block's bias and mask
    tiles), 1 KB to align."""
    d = head_dim_padded
    return (2 * BWD_DQ_SM90_BLOCK_M * d * 2
            + 3 * (2 * block_n * d * 2 + _score_stage_bytes(BWD_DQ_SM90_BLOCK_M, block_n, variant)) + 1024)


# Variant bits whose wgmma backward spills, per padded head_dim (check-kernels, NVRTC
# 13, sm_90): those plans run the mma.sync kernels of flash_bwd.cu instead.
#   bias, mask at D=128, not staged: the dK/dV kernel sits at 252-255 registers without
#     variants; the per-element bias/mask reads of the transposed Pᵀ tile spill 36-196
#     bytes (mask alone 36-72), with or without dbias. Staged (VAR_BIAS_STAGED, the
#     tile read transposed from shared memory: StagedScoreTermsT) it still sits at 255:
#     the bf16 bias spills 24-36 bytes (3 of 4), with the mask 56-76, with softcap
#     64-244, the fp32 bias with the mask 16-88; the fp32 bias alone and the mask alone
#     fit at 255 registers (fp16 and bf16, causal or not, with or without atomic dQ;
#     the wgmma dQ kernel, unstaged, too): those two staged plans take the wgmma
#     kernels (_BWD_SM90_STAGED_FITS), the others stay on the mma.sync kernels (which
#     stage the tile too). The staged q-dtype bias alone takes them too, spill and
#     all: with its 24-36 bytes of spill the D=128 backward with dbias took 8.40 ms
#     against the mma.sync plan's 12.44 (PERF.md v19, run 68, fp16, (1,H,N,N), N=4096).
_BWD_SM90_VARIANT_SPILLS = {128: VAR_BIAS | VAR_BIAS_FP32 | VAR_MASK}
_BWD_SM90_STAGED_FITS = {128: (VAR_BIAS_FP32, VAR_MASK, VAR_BIAS)}  # exactly these bits, with VAR_BIAS_STAGED


def bwd_sm90_variant(head_dim_padded: int, variant: int, cc: tuple[int, int] = (9, 0)) -> int:
    """The VARIANT the wgmma dK/dV kernel is compiled with: ``variant`` less
    VAR_BIAS_STAGED where its two stages of the tile do not fit one block."""
    if not variant & VAR_BIAS_STAGED:
        return variant
    fits = bwd_dkdv_sm90_smem_bytes(head_dim_padded, variant=variant) <= max_smem_per_block(cc)
    return _unstaged(variant, fits)


# Variant bits beside which the backward takes no block map (its wgmma kernels visit and
# mask every tile, as without one): a bias with the mask sits at 255 registers in both
# already at D=64 (nvcc 13.0: dK/dV 44-52 bytes of spill read element-wise, dQ 0-24),
# and the map's mask-free step compiled beside the two masked ones spills more (dK/dV
# 44-132 bytes, dQ 108-136 causal; the staged dK/dV kernel alone fits, 211-213 registers).
_BWD_SM90_MAP_DROPS = VAR_BIAS | VAR_BIAS_FP32


def bwd_dq_sm90_variant(head_dim_padded: int, variant: int, cc: tuple[int, int] = (9, 0)) -> int:
    """The VARIANT the wgmma dQ kernel is compiled with: ``variant`` less VAR_BIAS_STAGED
    with softcap (its per-element path reads the bias itself) or where three stages of
    the key block's tiles do not fit one block beside the K/V ring
    (:func:`bwd_dq_sm90_tile`)."""
    if not variant & VAR_BIAS_STAGED:
        return variant
    fits = not variant & VAR_SOFTCAP and _dq_stages_fit(head_dim_padded, bwd_dq_sm90_tile(head_dim_padded, variant),
                                                        variant, cc)
    return _unstaged(variant, fits)


def uses_sm90_bwd(head_dim_padded: int, vec: bool, cc: tuple[int, int], variant: int = 0) -> bool:
    """Whether the wgmma kernels serve this padded head_dim (and VARIANT bits, staged or not)."""
    if not (cc == (9, 0) and vec and head_dim_padded in _BWD_SM90_HEAD_DIMS):
        return False
    if not variant & _BWD_SM90_VARIANT_SPILLS.get(head_dim_padded, 0):
        return True
    return (variant & ~VAR_BIAS_STAGED in _BWD_SM90_STAGED_FITS.get(head_dim_padded, ())
            and bool(bwd_sm90_variant(head_dim_padded, variant, cc) & VAR_BIAS_STAGED))


def bwd_dkdv_sm90_smem_bytes(head_dim_padded: int, block_m: int = BWD_SM90_BLOCK_M, variant: int = 0) -> int:
    """kernels_cu/flash_bwd_sm90.cu BwdSm90Traits::SMEM_BYTES (the kernel traps on less
    when staged): K, V, dSᵀ (keys x BLOCK_M), two stages of (Q, dO), two of (lse_log2,
    delta), the block's SeqLens, (VAR_BIAS_STAGED) two of the query block's bias/mask
    tile from a 128-byte boundary, and 1 KB to align to the swizzle atom."""
    d, n = head_dim_padded, BWD_SM90_BLOCK_N
    end = 2 * n * d * 2 + n * block_m * 2 + 2 * 2 * block_m * d * 2 + 2 * 2 * block_m * 4 + _SEQLENS_SLOT_BYTES
    if variant & VAR_BIAS_STAGED:
        end = -(-end // 128) * 128 + 2 * _score_stage_bytes(block_m, n, variant)
    return end + 1024


def bwd_dkdv_sm90_launch(dtype: str, head_dim_padded: int, causal: bool, even_k: bool, deterministic: bool,
                         grid: tuple[int, int, int] = (1, 1, 1), variant: int = 0) -> Launch:
    """The wgmma dK/dV kernel (cc 9.0) for one set of compile-time choices."""
    d = head_dim_padded
    smem = bwd_dkdv_sm90_smem_bytes(d, variant=variant)
    args = (CTYPES[dtype], str(d), _cbool(causal), _cbool(even_k), _cbool(deterministic), str(variant))
    return Launch("flash_bwd_sm90.cu", "cupyflash::flash_bwd_dkdv_sm90_kernel", args, grid, (256, 1, 1), smem)


# Issue 15: the warp-specialised backward (kernels_cu/flash_bwd_ws.cu): flash_bwd_sm90.cu's
# dK/dV tile and products, with a producer warpgroup that copies Q and dO with TMA and
# adds dQ into dq_accum with bulk reduce-adds, so the two consumer warpgroups issue no
# load and no atomic. Plain attention and the variants of BWD_WS_VARIANTS, default (atomic
# dQ) mode, aligned dense batches, at the padded head_dims where it measured faster than the cp.async
# kernels (kernels_cu/PERF.md v23, run 100, the whole backward at 16k tokens): D=128
# 1.08-1.20x; not D=64 with its own dQ (0.79-0.85x against the cp.async dK/dV with the
# separate dQ kernel) and not a packed batch (D=128, 14 sequences: 0.94x with the rows of
# the next sequence zeroed in shared memory; a tile's tail there is not the map's bound).
# Where the plan takes dQ from the wgmma dQ kernel (bwd_ws_separate_dq: plain attention at
# D=64; a variant there takes dQ in the ws kernel) the ws kernel runs without dQ (WITH_DQ
# false: no dSᵀ tiles, no dQ GEMM, no reduce warp), as the cp.async dK/dV kernel does
# there: at D=64 with 128 query rows per step it measured 1.13-1.22x that plan (PERF.md
# v25, run 116, median 1.17x over 13 points).
# BWD_WS: True takes it there, False keeps the cp.async kernels (CUPYFLASH_BWD_WS=0 at
# import; or set here, then ``cupyflash._gpu.clear_plans()``).
# Above 128 (BWD_WS_ROLES_HEAD_DIMS) the kernel splits its consumers by role, not by keys
# (flash_bwd_ws.cu BwdWsTraits::ROLES): one block of 64 keys, dV in one warpgroup, dK in
# the other (a warpgroup's dK and dV at D=256 would be 256 registers), dQ added into
# dq_accum from registers (its fp32 rows do not fit in shared memory beside the stages),
# in the plain layout; there the backward had only the mma.sync kernels.
BWD_WS_HEAD_DIMS = (64, 128, 192, 256)
#: The padded head_dims the ws kernel is compiled for (check-kernels lists them whatever
#: BWD_WS_HEAD_DIMS selects), each with the dQ mode its plan would take.
BWD_WS_KERNEL_HEAD_DIMS = (64, 128, 192, 256)
BWD_WS_ROLES_HEAD_DIMS = (192, 256)
BWD_WS_THREADS = 384
BWD_WS_BLOCK_M, BWD_WS_STAGES = 64, 2


def bwd_ws_roles(head_dim_padded: int) -> bool:
    """Whether the ws backward splits its consumers by role at this padded head_dim
    (BwdWsTraits::ROLES: HEAD_DIM > 128)."""
    return head_dim_padded in BWD_WS_ROLES_HEAD_DIMS


def bwd_ws_block_n(head_dim_padded: int) -> int:
    """Keys per block of the ws backward (BwdWsTraits::BLOCK_N, the rows of its K and V
    TMA boxes): 128 (64 per consumer warpgroup), 64 where split by roles."""
    return 64 if bwd_ws_roles(head_dim_padded) else 128
#: Query rows per step of the ws kernel without dQ at D=64, one of BWD_WS_D64_BLOCK_MS (the
#: kernel's static_assert): 64 (BWD_WS_BLOCK_M), or 128, FlashAttention-3's hdim-64 backward
#: tile (128 x 128; hopper/flash_bwd_launch_template.h), which halves the per-row share of
#: each step's fixed work (the stage wait and release, the descriptors, the drain after
#: dK) and makes Sᵀ, dPᵀ m64n128: 128 measured 1.13-1.22x the cp.async plan, 64 only
#: 1.01-1.06x (PERF.md v25, run 116). Plain attention only: with a variant the ws kernel
#: takes dQ itself, at 64 rows (:func:`bwd_ws_separate_dq`).
BWD_WS_D64_BLOCK_M = 128
BWD_WS_D64_BLOCK_MS = (64, 128)
BWD_WS: bool = os.environ.get("CUPYFLASH_BWD_WS", "") != "0"
#: The variant bits the warp-specialised backward takes (of the kernel's WS_VARIANTS,
#: FWD_WS_VARIANTS: a window, softcap, ALiBi, sinks, dropout; their code is the cp.async
#: kernel's, bwd_sm90.cuh PtOperands): all five, measured faster than the cp.async kernel in
#: 29 of 30 points (PERF.md v24, run 105: 1.04-1.27x, median 1.14x; one 0.99x). Read when a
#: call is planned: set it, then ``cupyflash._gpu.clear_plans()``.
BWD_WS_VARIANTS = FWD_WS_VARIANTS
#: The variant sets the warp-specialised backward never takes (a call holding all the bits
#: of one stays on the cp.async kernel), where its consumers' 240 registers spill (nvcc
#: 13.0, D=128, every set measured: PERF.md v23): ALiBi with dropout (causal 8-40 bytes;
#: with a window and softcap too, 32 non-causal), softcap with ALiBi and a window with
#: dropout (4 bytes, fp16 non-causal). Each variant alone fits, causal or not, any dtype.
BWD_WS_VARIANT_SPILLS = (VAR_ALIBI | VAR_DROPOUT, VAR_SOFTCAP | VAR_ALIBI, VAR_WINDOW | VAR_DROPOUT)


#: ... and where split by roles (:func:`bwd_ws_roles`), per padded head_dim, from every
#: subset of the five compiled (check-kernels sm_90, NVRTC 13.0, fp16 and bf16, causal or
#: not): at 256 softcap with dropout (causal 24-68 bytes: the step before's dQ, 64 columns,
#: beside dK and dPᵀ in warpgroup 1); 192 takes all five.
_BWD_WS_ROLES_SPILLS: dict[int, tuple[int, ...]] = {256: (VAR_SOFTCAP | VAR_DROPOUT,), 192: ()}


def _bwd_ws_spills(head_dim_padded: int) -> tuple[int, ...]:
    """The variant sets the ws backward spills with at this padded head_dim."""
    return _BWD_WS_ROLES_SPILLS[head_dim_padded] if bwd_ws_roles(head_dim_padded) else BWD_WS_VARIANT_SPILLS


#: Issue 14's additive bias on the ws backward (kernels_cu/variant.cuh WS_BWD_BIAS): a bias of
#: the inputs' dtype that can be staged (VAR_BIAS_STAGED: unit column stride, 16-byte aligned
#: rows, :func:`score_vec_ok`). The producer copies each step's bias tile (the step's query
#: rows by the block's keys) by TMA into the stage of its Q and dO (cupyflash/_tma.py
#: bias_map, which needs non-negative strides: _variant.bias_tma_ok), and the consumers read
#: it transposed, as the cp.async kernel reads its staged tile (variant.cuh
#: StagedScoreTermsT). dbias stays the dbias kernel's. Not an fp32 bias (its stages would
#: not fit beside D=128's), a mask, or a strided bias.
BWD_WS_BIAS_VARIANTS = VAR_BIAS | VAR_BIAS_STAGED
#: The padded head_dims at which a bias call takes the ws backward (:func:`uses_ws_bwd`): all
#: four, measured faster than the cp.async (64, 128) and mma.sync (192, 256) kernels at every
#: point (PERF.md v31, run 145, bf16, 16k tokens, N 1024-8192, causal or not, per-head and
#: per-batch biases: the backward without dbias 1.25-1.90x, with dbias 1.15-1.41x).
BWD_WS_BIAS: tuple[int, ...] = (64, 128, 192, 256)
#: The variant sets beside a bias that the ws backward spills with, per padded head_dim
#: (0: the bias alone), beyond the sets it spills with without one (BWD_WS_VARIANT_SPILLS,
#: _BWD_WS_ROLES_SPILLS). Every subset of the five with the bias compiled (NVRTC 13.0, bf16,
#: causal or not; fp16 for the bias alone): at 128, softcap with dropout (72 bytes
#: non-causal); each other set that spills holds a set already refused; 64, 192 and 256 add
#: none (256's spills all hold softcap with dropout).
_BWD_WS_BIAS_SPILLS: dict[int, tuple[int, ...]] = {64: (), 128: (VAR_SOFTCAP | VAR_DROPOUT,), 192: (), 256: ()}


#: dbias beside the ws backward with a bias (kernels_cu/flash_bwd_dbias_ws.cu: its TMA maps, its
#: products and its Pᵀ; a block of 128 keys by BWD_DBIAS_WS_ROWS query rows of one plane of
#: dbias walks the plane's visits, each visit's K and V copied once for its two query blocks):
#: at these padded head_dims, for the bias alone (BWD_WS_BIAS_VARIANTS, no other variant),
#: with whole rows and keys (:func:`uses_ws_dbias`). Elsewhere the strip or tile kernels.
BWD_DBIAS_WS: tuple[int, ...] = (64, 128)
BWD_DBIAS_WS_HEAD_DIMS = (64, 128)  # the kernel's (check-kernels lists them whatever the switch)
BWD_DBIAS_WS_ROWS, BWD_DBIAS_WS_KEYS = 128, 128


def uses_ws_dbias(head_dim_padded: int, variant: int, dbias_shape: tuple[int, int, int, int], seqlen_q: int,
                  seqlen_k: int) -> bool:
    """Whether the ws dbias kernel computes dbias beside a ws backward (the caller's ``ws``)
    whose dK/dV kernel takes ``variant``: the bias alone, at BWD_DBIAS_WS, dbias's rows and
    keys not broadcast (its row and key dimensions the sequence's)."""
    return (variant == BWD_WS_BIAS_VARIANTS and head_dim_padded in BWD_DBIAS_WS
            and tuple(dbias_shape[2:]) == (seqlen_q, seqlen_k))


def bwd_dbias_ws_smem_bytes(head_dim_padded: int) -> int:
    """kernels_cu/flash_bwd_dbias_ws.cu DbiasWsTraits::SMEM_BYTES: two stages of K, V (128
    rows), two of Q, dO (64 rows), two bias tiles (64 x 128), two of lse_log2 and delta (64
    floats each), the SeqLens slot, 9 mbarriers, 1 KB of alignment."""
    d = head_dim_padded
    return 2 * 2 * 128 * d * 2 + 2 * 2 * 64 * d * 2 + 2 * 64 * 128 * 2 + 2 * 2 * 64 * 4 + _SEQLENS_SLOT_BYTES + 8 * 9 + 1024


def bwd_dbias_ws_grid(dbias_shape: tuple[int, int, int, int], seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
    """One block per (plane of dbias, 128 keys, 128 query rows)."""
    return (dbias_shape[0] * dbias_shape[1] * math.ceil(seqlen_k / BWD_DBIAS_WS_KEYS)
            * math.ceil(seqlen_q / BWD_DBIAS_WS_ROWS), 1, 1)


def bwd_dbias_ws_launch(dtype: str, head_dim_padded: int, causal: bool, grid: tuple[int, int, int] = (1, 1, 1),
                        variant: int = BWD_WS_BIAS_VARIANTS) -> Launch:
    """The ws dbias kernel (cc 9.0): ``<T, HEAD_DIM, IS_CAUSAL, VARIANT>``, VARIANT the bias alone."""
    if variant != BWD_WS_BIAS_VARIANTS or head_dim_padded not in BWD_DBIAS_WS_HEAD_DIMS:
        raise ValueError(f"cupyflash: the ws dbias kernel takes the variant bits {BWD_WS_BIAS_VARIANTS} at head_dim "
                         f"{BWD_DBIAS_WS_HEAD_DIMS}; got {variant} at {head_dim_padded}")
    args = (CTYPES[dtype], str(head_dim_padded), _cbool(causal), str(variant))
    return Launch("flash_bwd_dbias_ws.cu", "cupyflash::flash_bwd_dbias_ws_kernel", args, grid,
                  (BWD_WS_THREADS, 1, 1), bwd_dbias_ws_smem_bytes(head_dim_padded))


def bwd_ws_takes(variant: int, head_dim_padded: int = 128) -> bool:
    """Whether the warp-specialised backward's kernel at this padded head_dim compiles these
    variant bits with no spill (FWD_WS_VARIANTS less BWD_WS_VARIANT_SPILLS, or
    _BWD_WS_ROLES_SPILLS where split by roles; with a bias, BWD_WS_BIAS_VARIANTS both and
    not a set of _BWD_WS_BIAS_SPILLS), whatever BWD_WS_VARIANTS and BWD_WS_BIAS say."""
    bias, rest = variant & BWD_WS_BIAS_VARIANTS, variant & ~BWD_WS_BIAS_VARIANTS
    if bias and (bias != BWD_WS_BIAS_VARIANTS or any(
            rest & s == s for s in _BWD_WS_BIAS_SPILLS.get(head_dim_padded, (0,)))):
        return False
    return not rest & ~FWD_WS_VARIANTS and not any(rest & s == s for s in _bwd_ws_spills(head_dim_padded))


#: The variants of the warp-specialised backward that check-kernels compiles (at D=128,
#: causal or not, head_dim 128 or less), whether or not BWD_WS_VARIANTS switches them on:
#: those of FWD_WS_CHECK_VARIANTS it takes (:func:`bwd_ws_takes`).
BWD_WS_CHECK_VARIANTS = tuple(bits for bits in FWD_WS_CHECK_VARIANTS if bwd_ws_takes(bits))


#: The bias sets of the ws backward that check-kernels compiles (those it takes: :func:`bwd_ws_takes`):
#: the bias alone and with each variant of FWD_WS_VARIANTS.
BWD_WS_BIAS_CHECK_VARIANTS = tuple(BWD_WS_BIAS_VARIANTS | bits for bits in (
    0, VAR_WINDOW, VAR_SOFTCAP, VAR_ALIBI, VAR_SINKS, VAR_DROPOUT))


def uses_ws_bwd(head_dim_padded: int, vec: bool, cc: tuple[int, int], variant: int, deterministic: bool,
                varlen: bool = False, ws: bool | None = None, ws_bias: tuple[int, ...] | None = None) -> bool:
    """Whether the warp-specialised dK/dV kernel serves this backward (``ws``: the switch,
    BWD_WS when None): cc 9.0, aligned, dense, no variant outside BWD_WS_VARIANTS (nor a
    set it spills with: :func:`bwd_ws_takes`), not deterministic, at BWD_WS_HEAD_DIMS; with a
    bias (BWD_WS_BIAS_VARIANTS, staged), at ``ws_bias`` (None: :data:`BWD_WS_BIAS`)."""
    ws = BWD_WS if ws is None else ws
    ws_bias = BWD_WS_BIAS if ws_bias is None else ws_bias
    bias = variant & BWD_WS_BIAS_VARIANTS
    return (ws and cc == (9, 0) and vec and head_dim_padded in BWD_WS_HEAD_DIMS
            and not variant & ~(BWD_WS_VARIANTS | BWD_WS_BIAS_VARIANTS) and (not bias or head_dim_padded in ws_bias)
            and bwd_ws_takes(variant, head_dim_padded) and not deterministic and not varlen)


def bwd_ws_block_m(head_dim_padded: int, with_dq: bool, d64_block_m: int | None = None) -> int:
    """Query rows per step of the ws kernel (BwdWsTraits::BLOCK_M, its template argument, and
    the rows of its Q and dO TMA boxes): ``d64_block_m`` (None: BWD_WS_D64_BLOCK_M) without
    dQ at D=64 (plain attention: :func:`bwd_ws_separate_dq`), else BWD_WS_BLOCK_M."""
    if head_dim_padded == 64 and not with_dq:
        return BWD_WS_D64_BLOCK_M if d64_block_m is None else d64_block_m
    return BWD_WS_BLOCK_M


def bwd_ws_smem_bytes(head_dim_padded: int, block_m: int = BWD_WS_BLOCK_M, with_dq: bool = True,
                      bias: bool = False) -> int:
    """kernels_cu/flash_bwd_ws.cu BwdWsTraits::SMEM_BYTES: K, V, (with dQ) the dSᵀ tiles (two;
    one by roles), (by roles) the Pᵀ tile, STAGES x (Q, dO, (``bias``) the bias tile of
    block_m x BLOCK_N), STAGES x (lse_log2, delta), (with dQ, by keys) the dQ rows
    (unpadded), the SeqLens slot, the mbarriers (full_kv, full_q, empty_q: 8 bytes each),
    1 KB of alignment."""
    d, m, n, stages = head_dim_padded, block_m, bwd_ws_block_n(head_dim_padded), BWD_WS_STAGES
    if bwd_ws_roles(d):
        extra = n * m * 2 + n * m * 2  # one dSᵀ tile, the Pᵀ tile
    else:
        extra = 2 * n * m * 2 + m * d * 4 if with_dq else 0
    return (2 * n * d * 2 + extra + stages * (2 * m * d * 2 + (m * n * 2 if bias else 0)) + stages * 2 * m * 4
            + _SEQLENS_SLOT_BYTES + 8 * (1 + 2 * stages) + 1024)


def bwd_ws_launch(dtype: str, head_dim_padded: int, causal: bool, even_k: bool,
                  grid: tuple[int, int, int] = (1, 1, 1), variant: int = 0, with_dq: bool = True,
                  block_m: int = BWD_WS_BLOCK_M) -> Launch:
    """The warp-specialised dK/dV kernel (cc 9.0): ``<T, HEAD_DIM, BLOCK_M, IS_CAUSAL, EVEN_K,
    WITH_DQ, VARIANT>``; ``variant``: bits the kernel takes (:func:`bwd_ws_takes`);
    ``with_dq``: dQ added into dq_accum by the kernel (False: the wgmma dQ kernel's);
    ``block_m``: query rows per step (:func:`bwd_ws_block_m`)."""
    if not bwd_ws_takes(variant, head_dim_padded):
        raise ValueError(f"cupyflash: the warp-specialised backward at head_dim {head_dim_padded} takes the "
                         f"variant bits {FWD_WS_VARIANTS} less the sets {_bwd_ws_spills(head_dim_padded)}, "
                         f"with or without the bias bits {BWD_WS_BIAS_VARIANTS}; got {variant}")
    if bwd_ws_roles(head_dim_padded) and not with_dq:
        raise ValueError(f"cupyflash: the warp-specialised backward at head_dim {head_dim_padded} computes dQ "
                         f"itself (split by roles); got with_dq False")
    if block_m not in BWD_WS_D64_BLOCK_MS or block_m != bwd_ws_block_m(head_dim_padded, with_dq, block_m) or (
            block_m != BWD_WS_BLOCK_M and variant):
        raise ValueError(f"cupyflash: the warp-specialised backward takes {block_m} query rows per step only "
                         f"without dQ at head_dim 64 for plain attention (variant 0); "
                         f"got head_dim {head_dim_padded}, with_dq {with_dq}, variant {variant}")
    args = (CTYPES[dtype], str(head_dim_padded), str(block_m), _cbool(causal), _cbool(even_k), _cbool(with_dq),
            str(variant))
    return Launch("flash_bwd_ws.cu", "cupyflash::flash_bwd_ws_kernel", args, grid, (BWD_WS_THREADS, 1, 1),
                  bwd_ws_smem_bytes(head_dim_padded, block_m, with_dq, bool(variant & VAR_BIAS)))


def bwd_ws_check_launches(dtype: str, head_dim_padded: int, causal: bool, even_k: bool) -> list[Launch]:
    """The ws kernel's instantiations at this padded head_dim that a plan may take (for
    check-kernels), whatever the switches say: plain and BWD_WS_CHECK_VARIANTS, in the dQ
    mode of the set's plan (:func:`bwd_ws_separate_dq`), and, plain at D=64 (without dQ), at
    each of BWD_WS_D64_BLOCK_MS query rows per step."""
    out = []
    check = BWD_WS_CHECK_VARIANTS if not bwd_ws_roles(head_dim_padded) else tuple(
        bits for bits in FWD_WS_CHECK_VARIANTS if bwd_ws_takes(bits, head_dim_padded))
    check += tuple(bits for bits in BWD_WS_BIAS_CHECK_VARIANTS if bwd_ws_takes(bits, head_dim_padded))
    for bits in (0, *check):
        with_dq = not bwd_ws_separate_dq(head_dim_padded, bits)
        block_ms = {bwd_ws_block_m(head_dim_padded, with_dq, wide) for wide in BWD_WS_D64_BLOCK_MS}
        out.extend(bwd_ws_launch(dtype, head_dim_padded, causal, even_k, variant=bits, with_dq=with_dq, block_m=m)
                   for m in sorted(block_ms))
    return out


# (head_dim, tile, causal, deterministic, vec) combinations never to select:
# the widest atomic-dQ tiles at D=64 and D=128 on unaligned data (VEC=false:
# Q and dO loaded element by element through registers) spill 8 bytes under
# NVRTC 13.5 since the kernels read cu_seqlens (kernels_cu/PERF.md, varlen);
# unaligned data takes the next tile there. The widest D=64 atomic-dQ tile
# spills 8 bytes on aligned data too under NVRTC 13.0's ptxas (the H200's
# check-kernels, session 3), so D=64 atomic dQ on the mma.sync kernel (cc 8.x,
# or unaligned data) always takes the 64x128 tile. (The causal atomic-dQ
# D=128 64x128 tile also spills 8 bytes under NVRTC 13.0's ptxas, but the
# spill-free 64x64 tile measured 35% slower on the H200 (PERF.md, run 7), so it
# stays selected.)
_BWD_TILE_SPILLS: set[tuple[int, tuple[int, ...], bool, bool, bool]] = {
    (d, _BWD_TILES[d][0], causal, False, False) for d in (64, 128) for causal in (False, True)} | {
    (64, _BWD_TILES[64][0], causal, False, True) for causal in (False, True)}


def _bwd_tiles(d: int, causal: bool, deterministic: bool, vec: bool) -> tuple[tuple[int, ...], ...]:
    return tuple(t for t in _BWD_TILES[d] if (d, t, causal, deterministic, vec) not in _BWD_TILE_SPILLS)


# Variants on the mma.sync backward (kernels_cu/flash_bwd.cu): tiles of the tables
# above that spill with a variant switched on (check-kernels, NVRTC 13, sm_80 or
# sm_90), per variant bit: (head_dim, tile, deterministic). A plan whose variant set
# holds such a bit takes the next tile of the table (the lean one). Measured with
# each variant alone; combinations of variants may still spill.
#   softcap, dropout: the D=64 128x128 dK/dV tile of deterministic mode (the default
#     mode already skips it: _BWD_TILE_SPILLS) sits at 255 registers without
#     variants; softcap's 1 − tanh² (dS needs the raw S after dP) spills 8 bytes
#     there, dropout's Philox rounds ~400; the 64x128 tile takes 187-252 registers.
#   dropout: the D=32 128x128 tile of the default mode (causal: 16 bytes on sm_90).
#   softcap: the D=128 64x128 tile of the default mode (causal, sm_80 under NVRTC 13.0:
#     8 bytes at 255 registers; run 52), for the GPUs whose D=128 backward is mma.sync.
# Deterministic dQ tiles per variant bit and head_dim, in place of _BWD_DQ_TILES[d]
# (the first bit of a plan's set found here decides):
#   dropout at D=32 and D=64: 128 keys per tile (S, dP 64 registers each) spill
#     8-32 bytes on sm_80; 64 keys take 163-200 registers. At D=96 64 keys spill 16
#     bytes (causal, sm_80, at 168 registers: a ptxas choice, as the window's); 32 keys.
#   window at D=96: 64 keys spill 4 bytes on sm_90 (causal, at 168 registers: a
#     ptxas choice); 32 keys take ~153.
#   bias, mask (issue 14; the per-element bias/mask reads and dbias's reductions sit
#     beside S and dP): the 128x128 tiles at D=32 and D=64 (116-136 bytes at D=32), and
#     the D=128 64x128 tile (28 bytes at 255 registers, causal fp32 bias on sm_80); D=128
#     matters on Hopper too, whose wgmma kernel these plans skip (_BWD_SM90_VARIANT_SPILLS).
#   bias, mask: the dQ kernel's 128 keys at D=32 (16-44 bytes, as dropout) and 64 keys at
#     D=64 (16-40 bytes at 168 registers, a ptxas choice, as the window's at D=96); D=96's
#     64 keys sit at that same 168 with the fp32 bias: 32 keys there too, for the margin.
_BIAS_MASK_BITS = (VAR_BIAS, VAR_BIAS_FP32, VAR_MASK)
_BWD_VARIANT_TILE_SPILLS: dict[int, set[tuple[int, tuple[int, ...], bool]]] = {
    VAR_SOFTCAP: {(64, _BWD_TILES[64][0], True), (128, _BWD_TILES[128][0], False)},
    VAR_DROPOUT: {(64, _BWD_TILES[64][0], True), (32, _BWD_TILES[32][0], False)},
    **{bit: {(d, _BWD_TILES[d][0], det) for d in (32, 64, 128) for det in (False, True)}
       for bit in _BIAS_MASK_BITS},
}
_BWD_DQ_VARIANT_TILES: dict[int, dict[int, tuple[tuple[int, int, int], ...]]] = {
    VAR_DROPOUT: {32: ((64, 64, 4),), 64: ((64, 64, 4),), 96: ((64, 32, 4),)},
    VAR_WINDOW: {96: ((64, 32, 4),)},
    **{bit: {32: ((64, 64, 4),), 64: ((64, 32, 4),), 96: ((64, 32, 4),)} for bit in _BIAS_MASK_BITS},
}


def _bwd_variant_tiles(d: int, causal: bool, deterministic: bool, vec: bool,
                       variant: int) -> tuple[tuple[int, ...], ...]:
    """The dK/dV tiles (best first) of a plan with the VARIANT bits ``variant``."""
    tiles = _bwd_tiles(d, causal, deterministic, vec)
    spills = set().union(*(v for bit, v in _BWD_VARIANT_TILE_SPILLS.items() if variant & bit))
    return tuple(t for t in tiles if (d, t, deterministic) not in spills) or tiles[-1:]


def _bwd_dq_variant_tiles(d: int, variant: int) -> tuple[tuple[int, int, int], ...]:
    """The deterministic dQ tiles (best first) of a plan with the VARIANT bits ``variant``."""
    for bit, table in _BWD_DQ_VARIANT_TILES.items():
        if variant & bit and d in table:
            return table[d]
    return _BWD_DQ_TILES[d]


def _pick_bwd_tile(d: int, smem_limit: int, causal: bool = False, deterministic: bool = False,
                   vec: bool = True, variant: int = 0) -> tuple[tuple[int, ...], int]:
    for tile in _bwd_variant_tiles(d, causal, deterministic, vec, variant):
        for stages in (2, 1):
            if bwd_smem_bytes(d, tile, stages) <= smem_limit:
                return tile, stages
    raise NotImplementedError(
        f"cupyflash: no backward tile for head_dim {d} fits {smem_limit} bytes of shared memory")


def _pick_bwd_dq_tile(d: int, smem_limit: int, variant: int = 0) -> tuple[int, int, int]:
    for tile in _bwd_dq_variant_tiles(d, variant):
        if bwd_dq_smem_bytes(d, tile) <= smem_limit:
            return tile
    raise NotImplementedError(
        f"cupyflash: no backward dQ tile for head_dim {d} fits {smem_limit} bytes of shared memory")


def select_bwd(*, batch: int, seqlen_q: int, seqlen_k: int, nheads_q: int, nheads_kv: int, head_dim: int,
               dtype: str, causal: bool, deterministic: bool, vec: bool, num_sms: int = 132,
               cc: tuple[int, int] = (9, 0), varlen: bool = False, total_q: int = 0,
               total_k: int = 0, variant: int = 0,
               dbias_shape: tuple[int, int, int, int] | None = None, ws: bool | None = None,
               ws_bias: tuple[int, ...] | None = None) -> BwdPlan:
    """Choose the backward kernels, their grids and the scratch-buffer sizes.

    Launch order: preprocess (delta, lse·log2e, zero dq_accum); dK/dV (one
    block per key block and (batch, KV head), looping over the group's query
    heads; dQ by fp32 atomics unless ``deterministic``); then either the dQ
    kernel (``deterministic``: one block per query block, no atomics) or the
    convert kernel (dq_accum -> dq). On Hopper at padded head_dim 64 the default
    mode takes the dQ kernel too (measured faster there), so it is deterministic
    as well. ``vec`` says 16-byte accesses are legal for
    every tensor (see select_fwd). With GQA, when the grid of dK/dV blocks
    would not fill ``num_sms``, each group's query heads are split over several
    blocks (``BwdPlan.kv_splits``) whose fp32 partials a last kernel sums.

    ``varlen``: a packed batch, with ``seqlen_q``/``seqlen_k`` the longest
    lengths (``max_seqlen_q/k``, which size the dK/dV and dQ grids) and
    ``total_q``/``total_k`` the packed row counts (``q.shape[0]``,
    ``k.shape[0]``), which size the row-wise kernels: those walk a packed
    batch as one sequence of ``total`` rows.

    ``dbias_shape``: the bias's 4-D shape when its gradient is asked for (``variant``
    then has a bias bit): the dbias kernel runs last (it reads the preprocess's
    lse_log2 and delta), one block per tile of that shape (:func:`bwd_dbias_grid`).

    ``variant`` may hold VAR_BIAS_STAGED (``_variant.staged_bits``: the bias and mask
    pass :func:`score_vec_ok`): each kernel that stages the tile keeps it where its
    stages fit the tile and stage count chosen without it (and :func:`score_stage_ok`;
    the wgmma kernels: :func:`bwd_sm90_variant`, :func:`bwd_dq_sm90_variant`), the
    others drop it. It may hold VAR_BLOCK_MAP (``_variant.plan_bits``, with a mask): the
    wgmma dK/dV and dQ kernels keep it (each reads the map at its own tile:
    :func:`bwd_block_map_tiles`) unless a bias is on too (_BWD_SM90_MAP_DROPS), the others
    drop it (the mma.sync kernels mask every block; the dbias kernels visit every tile
    of dbias); it changes no other choice.

    ``ws``: whether the warp-specialised dK/dV kernel may serve the call
    (:func:`uses_ws_bwd`; None: :data:`BWD_WS`), and ``ws_bias`` at which padded head_dims
    it may with a bias (None: :data:`BWD_WS_BIAS`; the caller passes ``()`` for a bias its
    TMA map cannot describe: ``_variant.bias_tma_ok``); the plan then carries its TMA boxes
    (``BwdPlan.tma_box_rows``: :func:`bwd_ws_block_m` query rows) and takes dQ through
    dq_accum (in its layout) and the convert kernel, or, where the plan takes dQ from the wgmma dQ kernel
    (D=64), from that kernel, the ws kernel running without dQ.
    """
    if dtype not in CTYPES:
        raise ValueError(f"cupyflash: dtype must be one of {sorted(CTYPES)}; got {dtype}")
    if cc < ARCHS[0]:
        raise NotImplementedError(f"cupyflash: needs compute capability 8.0 or newer; got {cc[0]}.{cc[1]}")
    # the map's bit, for the kernels that read it (with a mask, no bias); every other choice without it
    block_map = variant & VAR_BLOCK_MAP if variant & VAR_MASK and not variant & _BWD_SM90_MAP_DROPS else 0
    variant &= ~VAR_BLOCK_MAP
    if varlen and (total_q < 1 or total_k < 1):
        raise ValueError(f"cupyflash: a packed batch needs total_q and total_k >= 1; got {total_q} and {total_k}")
    _check_launch_dims("select_bwd", batch=batch, seqlen_q=seqlen_q, nheads_q=nheads_q, nheads_kv=nheads_kv)
    # The row buffers' (batches, rows per head): a packed batch is one sequence of total rows.
    q_rows = (1, total_q) if varlen else (batch, seqlen_q)
    k_rows = (1, total_k) if varlen else (batch, seqlen_k)
    d = padded_head_dim(head_dim)
    even_k = head_dim == d
    smem_limit = max_smem_per_block(cc)
    staged, variant = variant & VAR_BIAS_STAGED, variant & ~VAR_BIAS_STAGED
    sm90 = uses_sm90_bwd(d, vec, cc, variant | staged)
    ws = uses_ws_bwd(d, vec, cc, variant | staged | block_map, deterministic, varlen, ws, ws_bias)
    # dQ by its own kernel (no atomics): always when deterministic, and where measured faster
    # (the ws kernel then runs without dQ)
    separate_dq = deterministic or (sm90 and BWD_DQ_SM90 and (bwd_ws_separate_dq(d, variant) if ws
                                                              else _bwd_sm90_separate_dq(d)))
    ws_block_m = bwd_ws_block_m(d, not separate_dq) if ws else None
    if ws:
        block_n, stages = bwd_ws_block_n(d), BWD_WS_STAGES
    elif sm90:
        block_n, stages = BWD_SM90_BLOCK_N, 2
    else:
        tile, stages = _pick_bwd_tile(d, smem_limit, causal, deterministic, vec, variant)
        block_n = tile[1]

    launches = [bwd_preprocess_launch(dtype, d, vec, q_rows[0] * q_rows[1] * nheads_q)]
    kv_blocks = math.ceil(seqlen_k / block_n) * batch * nheads_kv
    kv_splits = bwd_kv_splits(kv_blocks, nheads_q // nheads_kv, num_sms)
    dkdv_grid = (kv_blocks * kv_splits, 1, 1)
    if ws:
        launches.append(bwd_ws_launch(dtype, d, causal, even_k, dkdv_grid, variant | staged, not separate_dq,
                                      ws_block_m))
    elif sm90:
        launches.append(bwd_dkdv_sm90_launch(dtype, d, causal, even_k, separate_dq, dkdv_grid,
                                             bwd_sm90_variant(d, variant | staged, cc) | block_map))
    else:
        dkdv_variant = _unstaged(variant | staged, bool(staged) and score_stage_ok(tile[1], variant)
                                 and bwd_smem_bytes(d, tile, stages, variant | staged) <= smem_limit)
        launches.append(bwd_dkdv_launch(dtype, d, tile, causal, even_k, vec, deterministic, stages, dkdv_grid,
                                        dkdv_variant))
    if separate_dq and sm90 and BWD_DQ_SM90:
        dq_grid = (math.ceil(seqlen_q / BWD_DQ_SM90_BLOCK_M) * batch * nheads_q, 1, 1)
        launches.append(bwd_dq_sm90_launch(dtype, d, causal, even_k, dq_grid,
                                           bwd_dq_sm90_variant(d, variant | staged, cc) | block_map))
    elif deterministic:
        dq_tile = _pick_bwd_dq_tile(d, smem_limit, variant)
        dq_grid = (math.ceil(seqlen_q / dq_tile[0]) * batch * nheads_q, 1, 1)
        dq_variant = _unstaged(variant | staged, bool(staged) and score_stage_ok(dq_tile[1], variant)
                               and bwd_dq_smem_bytes(d, dq_tile, variant | staged) <= smem_limit)
        launches.append(bwd_dq_launch(dtype, d, dq_tile, causal, even_k, vec, dq_grid, dq_variant))
    else:
        launches.append(bwd_convert_launch(dtype, vec, q_rows[0] * q_rows[1] * nheads_q,
                                           swizzled=ws and not bwd_ws_roles(d)))
    if kv_splits > 1:
        launches.append(bwd_convert_dkv_launch(dtype, vec, k_rows[0] * k_rows[1] * nheads_kv))
    if dbias_shape is not None and ws and uses_ws_dbias(d, variant | staged, dbias_shape, seqlen_q, seqlen_k):
        launches.append(bwd_dbias_ws_launch(dtype, d, causal, bwd_dbias_ws_grid(dbias_shape, seqlen_q, seqlen_k),
                                            variant | staged))
    elif dbias_shape is not None and uses_sm90_dbias_strips(d, vec, cc, dbias_shape, batch, nheads_q, seqlen_q,
                                                            num_sms):
        launches.append(bwd_dbias_strip_launch(dtype, d, causal, even_k, bwd_dbias_strip_grid(dbias_shape, seqlen_q),
                                               variant))
    elif dbias_shape is not None and uses_sm90_dbias(d, vec, cc):
        launches.append(bwd_dbias_sm90_launch(dtype, d, causal, even_k, bwd_dbias_grid(
            BWD_DBIAS_SM90_TILE, dbias_shape, seqlen_q, seqlen_k), variant))
    elif dbias_shape is not None:
        dbias_tile, dbias_stages = bwd_dbias_tile(d, cc)
        launches.append(bwd_dbias_launch(dtype, d, dbias_tile, dbias_stages, causal, even_k, vec,
                                         bwd_dbias_grid(dbias_tile, dbias_shape, seqlen_q, seqlen_k), variant))
    return BwdPlan(tuple(launches), d, stages, not separate_dq, kv_splits,
                   (ws_block_m, bwd_ws_block_n(d), bwd_ws_block_n(d), ws_block_m) if ws else None)


def bwd_block_map_tiles(plan: BwdPlan) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(BLOCK_M, BLOCK_N) of the mask's tile maps ``plan``'s kernels read (VAR_BLOCK_MAP):
    the dK/dV kernel's (VariantParams ``kv_block_map``, read down a key block's column)
    and the dQ kernel's (``block_map``, read along a query block's row), each None where
    that kernel takes no map (or the plan has no dQ kernel: dQ by atomics)."""
    kv_tile = q_tile = None
    for launch in plan.launches:
        if launch.template not in _BWD_BLOCK_MAP_KERNELS or not int(launch.args[-1]) & VAR_BLOCK_MAP:
            continue
        if launch.template == "cupyflash::flash_bwd_dkdv_sm90_kernel":
            kv_tile = (BWD_SM90_BLOCK_M, BWD_SM90_BLOCK_N)
        else:
            q_tile = (BWD_DQ_SM90_BLOCK_M, int(launch.args[2]))
    return kv_tile, q_tile


#: The backward's kernels that read the block map (their VARIANT is their last template argument).
_BWD_BLOCK_MAP_KERNELS = ("cupyflash::flash_bwd_dkdv_sm90_kernel", "cupyflash::flash_bwd_dq_sm90_kernel")


#: The variants with the mask's block map whose wgmma backward kernels check-kernels
#: compiles (those select_bwd plans, from aligned data of 1024 x 1024): the mask read
#: element by element and staged, with a window, with softcap, with sinks.
BWD_BLOCK_MAP_CHECK_VARIANTS = tuple(VAR_BLOCK_MAP | VAR_MASK | bits for bits in (
    0, VAR_BIAS_STAGED, VAR_WINDOW, VAR_SOFTCAP, VAR_SINKS))


def all_bwd_launches(cc: tuple[int, int] | None = None) -> list[Launch]:
    """Every backward instantiation select_bwd can return (for check-kernels).

    The mma.sync kernels' tiles depend on shared memory, not on the architecture:
    they are listed for any ``cc``; the wgmma kernels only for cc 9.0.
    """
    out = []
    if cc is not None:
        for dtype, d, causal, even_k, det in itertools.product(CTYPES, HEAD_DIMS, (False, True), (True, False),
                                                               (False, True)):
            if uses_sm90_bwd(d, True, cc):
                out.append(bwd_dkdv_sm90_launch(dtype, d, causal, even_k, det))
                if det:
                    out.append(bwd_dq_sm90_launch(dtype, d, causal, even_k))
            if cc == (9, 0) and d in BWD_WS_KERNEL_HEAD_DIMS and not det:
                # (in every dtype and EVEN_K: fp16 with head_dim < 128 spilled where bf16 fit)
                out.extend(bwd_ws_check_launches(dtype, d, causal, even_k))
                if d in BWD_DBIAS_WS_HEAD_DIMS and even_k:  # (no EVEN_K: the maps zero-fill columns)
                    out.append(bwd_dbias_ws_launch(dtype, d, causal))
    for dtype, vec in itertools.product(CTYPES, (True, False)):
        lanes = {}  # one preprocess instantiation per ROW_LANES
        for d in HEAD_DIMS:
            lanes.setdefault(bwd_preprocess_row_lanes(d), d)
        out.extend(bwd_preprocess_launch(dtype, d, vec) for d in lanes.values())
        out.append(bwd_convert_launch(dtype, vec))
        if vec:
            out.append(bwd_convert_launch(dtype, vec, swizzled=True))
        out.append(bwd_convert_dkv_launch(dtype, vec))
    for dtype, d in itertools.product(CTYPES, HEAD_DIMS):
        for causal, even_k, vec, det in itertools.product((False, True), (True, False), (True, False),
                                                          (False, True)):
            for tile in _bwd_tiles(d, causal, det, vec):
                out.append(bwd_dkdv_launch(dtype, d, tile, causal, even_k, vec, det))
        for tile, causal, even_k, vec in itertools.product(
                _BWD_DQ_TILES[d], (False, True), (True, False), (True, False)):
            out.append(bwd_dq_launch(dtype, d, tile, causal, even_k, vec))
    # Each variant switched on alone: the kernels a default plan takes on aligned data.
    # (The bias with the mask, causal, is not listed: on sm_80 the mma.sync dK/dV tiles
    # D=64 64x128, D=96 64x128 and D=256 64x64 and the D=256 dQ tile spill 8-64 bytes
    # with both reads, and D=64 has no leaner tile in the table.)
    # (VAR_BIAS_STAGED needs a bias or mask: the staged list below; VAR_BLOCK_MAP is the
    # forward's alone.)
    alone = [bit for bit in VARIANT_BITS.values() if bit not in (VAR_BIAS_STAGED, VAR_BLOCK_MAP)]
    for bit, d, causal, det in itertools.product(alone, HEAD_DIMS, (False, True), (False, True)):
        for tile in _bwd_variant_tiles(d, causal, det, True, bit)[:1]:
            out.append(bwd_dkdv_launch(_VARIANT_CHECK_DTYPE, d, tile, causal, True, True, det, variant=bit))
        if det:
            out.append(bwd_dq_launch(_VARIANT_CHECK_DTYPE, d, _bwd_dq_variant_tiles(d, bit)[0], causal, True, True,
                                     variant=bit))
        if cc is not None and uses_sm90_bwd(d, True, cc, bit):
            no_dq = det or _bwd_sm90_separate_dq(d)
            out.append(bwd_dkdv_sm90_launch(_VARIANT_CHECK_DTYPE, d, causal, True, no_dq, variant=bit))
            if no_dq:
                out.append(bwd_dq_sm90_launch(_VARIANT_CHECK_DTYPE, d, causal, True, variant=bit))
    # The staged bias and mask: the dK/dV and dQ kernels of the plans that take them with the
    # ws backward off (BWD_WS, BWD_WS_BIAS), on each GPU whose shared memory the tables tell apart (cc None: the mma.sync kernels
    # of cc 8.0 and 8.6); the wgmma dQ kernel of those plans, which does not stage (the
    # D=128 plans that only staged take the wgmma kernels: _BWD_SM90_STAGED_FITS).
    staged = []
    for arch in (cc,) if cc is not None else ((8, 0), (8, 6)):
        for bit, d, causal, det in itertools.product(BWD_STAGED_CHECK_VARIANTS, HEAD_DIMS, (False, True),
                                                     (False, True)):
            plan = select_bwd(batch=1, seqlen_q=1024, seqlen_k=1024, nheads_q=16, nheads_kv=16, head_dim=d,
                              dtype=_VARIANT_CHECK_DTYPE, causal=causal, deterministic=det, vec=True, cc=arch,
                              variant=bit, ws=False)  # (the ws kernel's: bwd_ws_check_launches)
            staged.extend(dataclasses.replace(L, grid=(1, 1, 1)) for L in plan.launches
                          if L.template in _BWD_STAGED_KERNELS and (int(L.args[-1]) & VAR_BIAS_STAGED
                                                                    or L.template.endswith("dq_sm90_kernel")))
    out.extend(dict.fromkeys(staged))
    # The block map's wgmma kernels, in the plans that take them (cc 9.0).
    if cc is not None:
        mapped = []
        for bit, d, causal, det in itertools.product(BWD_BLOCK_MAP_CHECK_VARIANTS, (64, 128), (False, True),
                                                     (False, True)):
            plan = select_bwd(batch=1, seqlen_q=1024, seqlen_k=1024, nheads_q=16, nheads_kv=16, head_dim=d,
                              dtype=_VARIANT_CHECK_DTYPE, causal=causal, deterministic=det, vec=True, cc=cc,
                              variant=bit)
            mapped.extend(dataclasses.replace(L, grid=(1, 1, 1)) for L in plan.launches
                          if L.template in _BWD_BLOCK_MAP_KERNELS and int(L.args[-1]) & VAR_BLOCK_MAP)
        out.extend(dict.fromkeys(mapped))
    # The dbias kernel: its tile (and stages) depend on the shared memory of cc; aligned
    # data at D=64 and 128 on cc 9.0 takes the wgmma kernel (cc None: the mma.sync kernels).
    dbias = []
    for arch in (cc,) if cc is not None else ARCHS:
        for d in HEAD_DIMS:
            tile, stages = bwd_dbias_tile(d, arch)
            wgmma = cc is not None and uses_sm90_dbias(d, True, arch)

            def aligned(causal: bool, variant: int) -> Launch:  # the kernel of aligned data on arch
                if wgmma:
                    return bwd_dbias_sm90_launch(_VARIANT_CHECK_DTYPE, d, causal, True, variant=variant)
                return bwd_dbias_launch(_VARIANT_CHECK_DTYPE, d, tile, stages, causal, True, True, variant=variant)
            dbias.extend(aligned(causal, variant)
                         for variant, causal in itertools.product(DBIAS_CHECK_VARIANTS, (False, True)))
            dbias.extend(aligned(False, VAR_BIAS | variant) for variant in DBIAS_CHECK_WITH)
            if wgmma and d in _BWD_DBIAS_STRIP_HEAD_DIMS:  # the strips, where the bias has whole rows and keys
                dbias.extend(bwd_dbias_strip_launch(_VARIANT_CHECK_DTYPE, d, causal, True, variant=variant)
                             for variant, causal in itertools.product(DBIAS_CHECK_VARIANTS, (False, True)))
                dbias.extend(bwd_dbias_strip_launch(_VARIANT_CHECK_DTYPE, d, False, True, variant=VAR_BIAS | variant)
                             for variant in DBIAS_CHECK_WITH)
            dbias.append(bwd_dbias_launch("float16", d, tile, stages, False, False, False))  # unaligned
    return out + list(dict.fromkeys(dbias))


# ----------------------------------------------------------------------------
# Decode: attention against a KV cache (kernels_cu/flash_decode.cu)
# ----------------------------------------------------------------------------

#: Decode kernel tiles per padded head_dim: (BLOCK_N, STAGES), keys per tile and
#: the depth of the cp.async K/V ring. The kernel is bound by memory: a ring of
#: 2-3 tiles of 64 keys keeps 35-70 KB per block in flight, and two blocks fit
#: on an SM at D <= 128 (kernels_cu/PERF.md, decode).
_DECODE_TILES = {32: (64, 4), 64: (64, 4), 96: (64, 3), 128: (64, 3), 192: (64, 2), 256: (64, 2)}
#: Warps per decode block (kernels_cu/flash_decode.cu: WARPS_M x WARPS_N).
DECODE_WARPS = 4
#: The most key splits (the combine kernel's DECODE_MAX_SPLITS).
DECODE_MAX_SPLITS = 128
_DECODE_COMBINE_SPLIT_GROUPS = 8  # flash_decode.cu DECODE_COMBINE_SPLIT_GROUPS


def decode_warps(rows: int) -> tuple[int, int]:
    """(WARPS_M, WARPS_N) for ``rows`` packed rows (seqlen_q * nheads_q / nheads_kv):
    with 16 rows or fewer the four warps split each tile's keys; with more they
    split the rows (16 each), as the prefill kernel does."""
    if rows <= 16:
        return 1, 4
    if rows <= 32:
        return 2, 2
    return 4, 1


#: Padded head dims at which a decode call with a bias or a mask (_SCORE_ARRAY_BITS) on
#: a paged cache runs at most two row warps: the (4, 1) grid spills there (NVRTC 13.0,
#: sm_90: 68 bytes with a bias, 16-128 with a mask; nvcc 13.0: 16-40 with a bias), its
#: 128 O registers per thread next to the page indices and a tile row of bias or mask
#: elements in flight. (2, 2) compiles clean (sm_80, sm_90), at twice the row blocks
#: (each K/V tile read by two blocks).
_DECODE_BIAS_TWO_ROW_WARPS = frozenset((256,))


def decode_variant_warps(warps: tuple[int, int], head_dim_padded: int, paged: bool,
                         variant: int) -> tuple[int, int]:
    """The warp grid a decode call of ``variant`` runs where :func:`decode_warps` chose
    ``warps`` (see _DECODE_BIAS_TWO_ROW_WARPS)."""
    if (variant & _SCORE_ARRAY_BITS and paged and head_dim_padded in _DECODE_BIAS_TWO_ROW_WARPS
            and warps[0] > 2):
        return 2, 2
    return warps


def decode_smem_bytes(head_dim_padded: int, block_n: int, warps_m: int, stages: int) -> int:
    """Dynamic shared memory of the decode kernel (DecodeTraits::SMEM_BYTES): the
    packed Q tile and the K/V ring."""
    return _smem_tile_bytes(16 * warps_m, head_dim_padded) + stages * 2 * _smem_tile_bytes(block_n, head_dim_padded)


def smem_per_sm(cc: tuple[int, int]) -> int:
    """Shared memory of one SM (bytes), of which each resident block also takes 1 KB."""
    if cc in ((8, 0), (8, 7)):
        return 164 * 1024
    if cc[0] in (9, 10):
        return 228 * 1024
    return 100 * 1024


@dataclass(frozen=True)
class DecodePlan:
    main: Launch
    combine: Launch | None      # set when the keys are split
    head_dim_padded: int
    block_m: int                # packed rows per block
    num_m_blocks: int
    num_splits: int


def decode_tile(head_dim_padded: int, warps: tuple[int, int], cc: tuple[int, int] = (9, 0)
                ) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_N, STAGES, warps) of the decode kernel: the table's tile with the
    deepest ring that fits the GPU's shared memory (at least 2 stages), else
    32-key tiles (on a grid of at most 2 key columns: each warp takes 16 keys)."""
    limit = max_smem_per_block(cc)
    block_n, stages = _DECODE_TILES[head_dim_padded]
    for n, w in ((block_n, warps), (32, warps if warps[1] <= 2 else (2, 2))):
        for st in range(stages, 1, -1):
            if decode_smem_bytes(head_dim_padded, n, w[0], st) <= limit:
                return n, st, w
    raise ValueError(f"cupyflash: no decode tile fits {limit} bytes of shared memory at head_dim "
                     f"{head_dim_padded}")


def decode_launch(dtype: str, head_dim_padded: int, warps: tuple[int, int], causal: bool, paged: bool,
                  vec: bool, grid: tuple[int, int, int] = (1, 1, 1), cc: tuple[int, int] = (9, 0),
                  variant: int = 0) -> Launch:
    """The decode kernel instantiation for one set of compile-time choices."""
    block_n, stages, warps = decode_tile(head_dim_padded, warps, cc)
    smem = decode_smem_bytes(head_dim_padded, block_n, warps[0], stages)
    args = (CTYPES[dtype], str(head_dim_padded), str(block_n), str(warps[0]), str(warps[1]), str(stages),
            _cbool(causal), _cbool(paged), _cbool(vec), str(variant))
    return Launch("flash_decode.cu", "cupyflash::flash_decode_kernel", args, grid, (DECODE_WARPS * 32, 1, 1), smem)


def decode_combine_launch(dtype: str, head_dim_padded: int, rows: int = 1) -> Launch:
    """The decode combine kernel: one block per (sequence, query head, query row)."""
    threads = head_dim_padded // 4 * _DECODE_COMBINE_SPLIT_GROUPS
    return Launch("flash_decode.cu", "cupyflash::flash_decode_combine_kernel", (CTYPES[dtype], str(head_dim_padded)),
                  (max(1, rows), 1, 1), (threads, 1, 1), 0)


#: The split-count model (decode_num_splits): each block also costs this many
#: tiles' time (the ring's first loads, the epilogue), and so does the combine.
DECODE_BLOCK_OVERHEAD_TILES = 2
#: Blocks per SM the split count aims at: two blocks (8 warps, 2 x 2 tiles of
#: K/V in flight at D=128) are needed to hide a paged cache's scattered loads.
DECODE_BLOCKS_PER_SM = 2


def decode_num_splits(blocks: int, n_tiles: int, num_sms: int) -> int:
    """Key splits for ``blocks`` (sequence, KV head, row block) blocks of at most
    ``n_tiles`` key tiles each, on ``num_sms`` SMs.

    The kernel is bound by each SM's share of the memory bandwidth, so the
    time of ``s`` splits is that of the busiest of ``num_sms *
    DECODE_BLOCKS_PER_SM`` block slots: ``ceil(blocks * s / slots)`` blocks,
    each of its tiles plus DECODE_BLOCK_OVERHEAD_TILES; splitting adds the
    combine.  The cheapest ``s`` wins, the fewest splits on a tie.  Measured on
    the H200 (kernels_cu/PERF.md, decode): an uneven grid costs what its
    busiest SM costs (144 blocks on 132 SMs: 202 us, 128 blocks: 157 us, B=1,
    128k keys, 8 KV heads); with one block per SM a paged cache streams 1.8x
    slower than a contiguous one, with two 1.13x.
    """
    slots = num_sms * DECODE_BLOCKS_PER_SM
    best, best_cost = 1, None
    for s in range(1, min(n_tiles, DECODE_MAX_SPLITS) + 1):
        cost = math.ceil(blocks * s / slots) * (math.ceil(n_tiles / s) + DECODE_BLOCK_OVERHEAD_TILES)
        if s > 1:
            cost += DECODE_BLOCK_OVERHEAD_TILES
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def select_decode(*, batch: int, seqlen_q: int, nheads_q: int, nheads_kv: int, head_dim: int, max_seqlen_k: int,
                  dtype: str, causal: bool, paged: bool, vec: bool, num_splits: int = 0, num_sms: int = 132,
                  cc: tuple[int, int] = (9, 0), variant: int = 0, window_left: int = -1) -> DecodePlan:
    """Choose the decode kernel's warp grid, grid and key splits.

    ``max_seqlen_k`` bounds every sequence's key count (cache plus appended
    keys): the capacity of the cache when the lengths live on the GPU.
    ``num_splits`` > 0 asks for that many splits (clipped to the key tiles and
    to DECODE_MAX_SPLITS); 0 chooses.  ``variant``: the VARIANT bits
    (:func:`variant_bits`; no dropout; a bias and mask with none of their qualifier
    bits: the kernel reads them element by element at any strides); ``window_left``:
    a window's left size (-1: unbounded), which bounds the key tiles a block visits
    (:func:`decode_visible_tiles`) and so its splits.
    """
    if dtype not in CTYPES:
        raise ValueError(f"cupyflash: dtype must be one of {sorted(CTYPES)}; got {dtype}")
    if cc < ARCHS[0]:
        raise NotImplementedError(f"cupyflash: needs compute capability 8.0 or newer; got {cc[0]}.{cc[1]}")
    _check_launch_dims("select_decode", batch=batch, nheads_q=nheads_q, nheads_kv=nheads_kv)
    if variant & (VAR_DROPOUT | sum(_QUALIFIER_BITS)):
        raise ValueError(f"cupyflash: the decode kernel takes no dropout, and reads a bias or mask element by "
                         f"element (no VAR_BIAS_STRIDED, VAR_BIAS_STAGED or VAR_BLOCK_MAP); got variant {variant}")
    d = padded_head_dim(head_dim)
    rows = seqlen_q * (nheads_q // nheads_kv)
    block_n, stages, warps = decode_tile(d, decode_variant_warps(decode_warps(rows), d, paged, variant), cc)
    block_m = 16 * warps[0]
    num_m_blocks = max(1, math.ceil(rows / block_m))  # one block still appends when seqlen_q = 0
    n_tiles = decode_visible_tiles(max_seqlen_k, seqlen_q, block_n, window_left)
    blocks = batch * nheads_kv * num_m_blocks
    if rows == 0:
        splits = 1
    elif num_splits > 0:
        splits = min(num_splits, n_tiles, DECODE_MAX_SPLITS)
    else:
        splits = decode_num_splits(blocks, n_tiles, num_sms)
    main = decode_launch(dtype, d, warps, causal, paged, vec, (num_m_blocks * splits, nheads_kv, batch), cc,
                         variant)
    combine = decode_combine_launch(dtype, d, batch * nheads_q * seqlen_q) if splits > 1 else None
    return DecodePlan(main, combine, d, block_m, num_m_blocks, splits)


#: The variant bits the decode kernel takes (select_decode): no dropout, and a bias or
#: mask read element by element (none of _QUALIFIER_BITS).
DECODE_VARIANT_BITS = tuple(b for b in VARIANT_BITS.values() if not b & (VAR_DROPOUT | sum(_QUALIFIER_BITS)))


def decode_visible_tiles(max_seqlen_k: int, seqlen_q: int, block_n: int, window_left: int = -1) -> int:
    """The most key tiles of ``block_n`` keys that one decode block visits (at least 1).

    Every tile of the longest sequence, or with a window of ``window_left`` keys
    (>= 0) fewer: query row ``i`` sees no key before ``i + seqlen_k - seqlen_q -
    left``, so a block's rows see at most ``left + seqlen_q`` keys between them
    (none past ``seqlen_k``), which start anywhere in a tile: one tile more.
    """
    n_tiles = max(1, math.ceil(max_seqlen_k / block_n))
    if window_left >= 0:
        n_tiles = min(n_tiles, math.ceil((window_left + seqlen_q) / block_n) + 1)
    return n_tiles


#: Chunks of at least this many new queries on a dense cache (no block_table, no
#: cache_batch_idx) run the wgmma forward, reading the cache in place with each
#: sequence's length as seqused_k, after an append-only decode launch: against
#: a 32k cache (B=1, 32/8 heads, D=128) the decode kernel took 0.64x the dense
#: forward's time at seqlen_q 64 and 2.5x at 512 (kernels_cu/PERF.md, v16).
DECODE_DENSE_MIN_SEQLEN_Q = 256


def decode_uses_dense_fwd(*, seqlen_q: int, head_dim: int, paged: bool, cache_batch_idx: bool, vec: bool,
                          cc: tuple[int, int]) -> bool:
    """Whether a flash_attn_with_kvcache call runs the dense (wgmma) forward
    instead of the decode kernel's attention (see DECODE_DENSE_MIN_SEQLEN_Q)."""
    return (not paged and not cache_batch_idx and seqlen_q >= DECODE_DENSE_MIN_SEQLEN_Q
            and uses_sm90_fwd(padded_head_dim(head_dim), vec, cc))


def all_decode_launches(cc: tuple[int, int] = (9, 0)) -> list[Launch]:
    """Every decode instantiation select_decode can return on ``cc`` (for check-kernels)."""
    out = []
    for dtype, d in itertools.product(CTYPES, HEAD_DIMS):
        for warps, causal, paged, vec in itertools.product(((1, 4), (2, 2), (4, 1)), (False, True),
                                                           (False, True), (True, False)):
            out.append(decode_launch(dtype, d, warps, causal, paged, vec, cc=cc))
        out.append(decode_combine_launch(dtype, d))
    # Each variant but dropout switched on alone (aligned, contiguous and paged).
    for bit, d, warps, causal, paged in itertools.product(
            DECODE_VARIANT_BITS, HEAD_DIMS, ((1, 4), (2, 2), (4, 1)), (False, True), (False, True)):
        out.append(decode_launch(_VARIANT_CHECK_DTYPE, d, decode_variant_warps(warps, d, paged, bit), causal, paged,
                                 True, cc=cc, variant=bit))
    return list({L.name_expression: L for L in out}.values())
