"""Block sparsity (issue 14): a boolean keep-mask reduced to a map of its tiles.

A mask broadcastable to ``(batch, nheads_q, seqlen_q, seqlen_k)`` is cut into
cells of ``CELL_ROWS x CELL_COLS`` (64 x 64) elements, and each cell gets one
state::

    EMPTY   = 0   no element of the cell is True: the tile is skipped
    PARTIAL = 1   some are: the tile reads the mask
    FULL    = 2   every element is True: the tile runs with no mask code

The reduction runs on the mask's own (broadcast) shape with array reductions of
its module (CuPy on the GPU, NumPy on the CPU), never on the expanded one: a
size-1 dimension of the mask stays a size-1 dimension of the map (its one cell
covers the whole axis).  Tail cells hold only the elements that exist.

A kernel (or the CPU path) whose tile is ``(tile_m, tile_n)`` takes
:meth:`BlockMask.tiles`: the cell map coarsened to its tiles, where a tile
overlapping several cells is EMPTY iff all of them are, FULL iff all of them
are, else PARTIAL; a tile inside one cell takes that cell's state (every kernel
tile is a multiple of 64 or divides it, so tiles never straddle cells
partially; any other tile is still correct, only coarser).  Tile maps are computed once per tile
shape and kept in the BlockMask, so a BlockMask passed to many calls is reduced
once.

A map of a larger region is conservative for any sub-region (a varlen
sequence's rows and keys inside ``max_seqlen``): a cell EMPTY or FULL is so in
every part of it.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["BlockMask", "EMPTY", "PARTIAL", "FULL", "CELL_ROWS", "CELL_COLS"]

EMPTY, PARTIAL, FULL = 0, 1, 2
#: The map's cell: rows x keys. Every kernel tile is a multiple of it or divides it.
CELL_ROWS = 64
CELL_COLS = 64


def _module(x):
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and isinstance(x, cupy.ndarray) else np


def _ceil_div(a, b):
    return -(-a // b)


def cell_map(mask, cell_rows=CELL_ROWS, cell_cols=CELL_COLS):
    """The uint8 state map of a 4-D bool mask (numpy or cupy; any strides).

    Shape ``(B', H', R, C)``: the mask's batch and head dimensions, and along its
    row (key) axis ``ceil(rows / cell_rows)`` cells, or 1 where the mask's axis is
    1 (broadcast).  One copy of the mask in its own shape (padded to whole cells)
    and one count per cell; never the broadcast shape."""
    xp = _module(mask)
    bm, hm, rows, cols = mask.shape
    gr = cell_rows if rows > 1 else 1
    gc = cell_cols if cols > 1 else 1
    nr, nc = _ceil_div(rows, gr), _ceil_div(cols, gc)
    if rows == nr * gr and cols == nc * gc:
        padded = mask
    else:
        padded = xp.zeros((bm, hm, nr * gr, nc * gc), dtype=bool)
        padded[:, :, :rows, :cols] = mask
    count = padded.reshape(bm, hm, nr, gr, nc, gc).sum(axis=(3, 5), dtype=np.int32)
    # elements of each cell that exist (the tails' cells are smaller)
    rlen = np.minimum(gr, rows - gr * np.arange(nr))
    clen = np.minimum(gc, cols - gc * np.arange(nc))
    size = xp.asarray((rlen[:, None] * clen[None, :]).astype(np.int32))
    out = xp.where(count == 0, EMPTY, xp.where(count == size, FULL, PARTIAL))
    return xp.ascontiguousarray(out.astype(np.uint8))


def coarsen(cells, cell_shape, tile_m, tile_n, rows, cols):
    """The state map of tiles ``(tile_m, tile_n)`` from a cell map of cells ``cell_shape``
    over ``rows x cols`` elements (the mask's row and key lengths): a size-1 axis of
    ``cells`` stays 1; along the others ``ceil(rows / tile_m)`` tiles, each EMPTY iff
    every cell it overlaps is, FULL iff every one is, else PARTIAL (any tile size: a
    tile inside one cell takes its state)."""
    xp = _module(cells)
    out = cells
    for axis, tile, cell, length in ((2, tile_m, cell_shape[0], rows), (3, tile_n, cell_shape[1], cols)):
        if length == 1 or tile == cell:  # a broadcast axis (one cell), or cells that are the tiles
            continue
        starts = np.arange(_ceil_div(length, tile)) * tile
        lo = starts // cell                                           # first cell of each tile
        hi = (np.minimum(starts + tile, length) - 1) // cell + 1      # one past its last
        # per-tile counts of nonempty and of full cells, from prefix sums along the axis
        moved = xp.moveaxis(out, axis, -1)
        zero = xp.zeros(moved.shape[:-1] + (1,), dtype=np.int32)
        counts = []
        for hit in (moved != EMPTY, moved == FULL):
            prefix = xp.concatenate([zero, xp.cumsum(hit, axis=-1, dtype=np.int32)], axis=-1)
            counts.append(prefix[..., xp.asarray(hi)] - prefix[..., xp.asarray(lo)])
        nonempty, full = counts
        span = xp.asarray((hi - lo).astype(np.int32))
        state = xp.where(nonempty == 0, EMPTY, xp.where(full == span, FULL, PARTIAL)).astype(np.uint8)
        out = xp.moveaxis(state, -1, axis)
    return xp.ascontiguousarray(out)


def combine_heads(tiles):
    """A tile map ``(B', H', R, C)`` reduced over its batch and head axes to ``(R, C)``:
    EMPTY iff empty for every (batch, head), FULL iff full for every one (the CPU path's
    tiles hold every batch and head at once)."""
    xp = _module(tiles)
    flat = tiles.reshape((-1,) + tiles.shape[2:])
    hi, lo = flat.max(axis=0), flat.min(axis=0)
    return xp.where(hi == EMPTY, EMPTY, xp.where(lo == FULL, FULL, PARTIAL)).astype(np.uint8)


class BlockMask:
    """A boolean keep-mask with its block map, for block-sparse attention.

    Pass it wherever ``attn_mask=`` is taken (:func:`cupyflash.flash_attn_fwd`,
    :func:`cupyflash.flash_attn_bwd`, :func:`cupyflash.flash_attn`, the varlen
    functions): the mask is applied exactly as the plain mask would be, and the map
    decides which tiles are skipped (no True element: they contribute nothing),
    which run with no mask code (every element True) and which read the mask.  A
    plain bool mask is reduced to its map on every call; a BlockMask is reduced
    once, when built, and its per-tile maps are kept for later calls.

    Build it with :meth:`from_mask`.  The mask must not change while the
    BlockMask is used (the map would then be stale and the results wrong).

    Attributes
    ----------
    mask : numpy.ndarray or cupy.ndarray of bool
        The mask as given (rank <= 4, broadcastable to
        ``(batch, nheads_q, seqlen_q, seqlen_k)``), read in place.
    block_map : numpy.ndarray or cupy.ndarray of uint8, shape (B', H', R, C)
        The state of each ``CELL_ROWS x CELL_COLS`` (64 x 64) cell of the mask
        left-padded to 4-D: 0 empty, 1 partial, 2 full.  B', H' are the mask's
        batch and head dimensions; R is ``ceil(seqlen_q / 64)`` (1 if the mask's row
        dimension is 1), C likewise over the keys.  On the mask's device.

    Notes
    -----
    FlexAttention's ``BlockMask`` (``create_block_mask``) holds the same
    information as per-row lists of block indices at one block size; this one
    holds dense per-cell states at 64 x 64 and coarsens them to each kernel's
    tile on demand (:meth:`tiles`).

    Examples
    --------
    A local pattern whose 128 x 128 blocks are mostly empty:

    >>> import numpy as np, cupyflash
    >>> n = 512
    >>> i = np.arange(n)
    >>> keep = np.abs(i[:, None] // 128 - i[None, :] // 128) <= 0
    >>> bm = cupyflash.BlockMask.from_mask(keep)
    >>> bm.block_map.shape
    (1, 1, 8, 8)
    >>> q = np.ones((1, n, 2, 64), dtype=np.float32)
    >>> out, lse = cupyflash.flash_attn_fwd(q, q, q, attn_mask=bm)
    """

    __slots__ = ("mask", "block_map", "_mask4", "_tiles")

    def __init__(self, mask, block_map, *, _mask4=None):
        self.mask = mask
        self.block_map = block_map
        self._mask4 = _mask4
        self._tiles = {}

    @classmethod
    def from_mask(cls, mask):
        """A BlockMask of ``mask``: a numpy or cupy bool array of rank 1 to 4.

        Raises
        ------
        TypeError
            ``mask`` is not a numpy or cupy array, or its dtype is not bool.
        ValueError
            It has no dimension or more than 4, or a dimension of size 0.
        """
        fn = "BlockMask.from_mask"
        if isinstance(mask, BlockMask):
            return mask
        xp_kind = "numpy" if isinstance(mask, np.ndarray) else (
            "cupy" if _module(mask) is not np else None)
        if xp_kind is None:
            raise TypeError(f"cupyflash.{fn}: mask must be a numpy.ndarray or cupy.ndarray of bool; got "
                            f"{type(mask).__module__}.{type(mask).__name__}.")
        if mask.dtype != np.bool_:
            raise TypeError(f"cupyflash.{fn}: mask must have dtype bool (True = attend); got {mask.dtype}.")
        if not 1 <= mask.ndim <= 4:
            raise ValueError(f"cupyflash.{fn}: mask must have 1 to 4 dimensions, broadcastable to "
                             f"(batch, nheads_q, seqlen_q, seqlen_k); got {mask.ndim} with shape "
                             f"{tuple(mask.shape)}.")
        if 0 in mask.shape:
            raise ValueError(f"cupyflash.{fn}: mask must have no dimension of size 0; got shape "
                             f"{tuple(mask.shape)}.")
        mask4 = mask if mask.ndim == 4 else mask[(None,) * (4 - mask.ndim) + (Ellipsis,)]
        if xp_kind == "cupy":
            with mask.device:
                cells = cell_map(mask4)
        else:
            cells = cell_map(mask4)
        return cls(mask, cells, _mask4=mask4)

    @property
    def shape(self):
        """The mask's shape."""
        return tuple(self.mask.shape)

    def tiles(self, tile_m, tile_n):
        """The map coarsened to tiles of ``tile_m`` rows x ``tile_n`` keys (uint8,
        C-contiguous, ``(B', H', ceil(rows / tile_m), ceil(keys / tile_n))``, size-1
        axes kept); computed once per tile shape."""
        key = (int(tile_m), int(tile_n))
        got = self._tiles.get(key)
        if got is None:
            rows, cols = self._mask4.shape[2:]

            def make():
                return coarsen(self.block_map, (CELL_ROWS, CELL_COLS), key[0], key[1], rows, cols)

            if _module(self.block_map) is np:
                got = make()
            else:
                with self.block_map.device:
                    got = make()
            self._tiles[key] = got
        return got

    def __repr__(self):
        states = self.block_map
        n = int(states.size)
        empty = int((states == EMPTY).sum())
        full = int((states == FULL).sum())
        return (f"BlockMask(shape={self.shape}, cells={tuple(states.shape)}, empty={empty}/{n}, "
                f"full={full}/{n})")
