"""Host-side tiling of a slice mask into kernel work items (pure NumPy, no JAX).

A *work item* is one (slice, q-tile, k-tile) triple whose intersection holds at least one
cell. An item is *full* when every cell of the tile belongs to the slice (no in-kernel
predicate needed); otherwise it is a *boundary* item whose predicate is evaluated from the
slice geometry carried in the item. Empty tiles produce no item, so the number of items
follows the mask area, not ``Tq·Tk``.

:mod:`magi_jax.planning.work_list` groups the items by the tile that owns them (the plans
the backends read).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from magi_jax.masks import SliceShapes
from magi_jax.planning.intervals import ranges_incl

__all__ = [
    "TileItems",
    "tile_items",
    "count_items",
    "ITEM_FIELDS",
    "EMPTY_ITEM",
    "GENERAL",
    "FULL",
    "BAND",
]

# Columns of one work item (int32): the tile on the other side (k-tile for a q-tile's item,
# q-tile for a k-tile's), the slice's canonical geometry, and the mask kind of the tile.
ITEM_FIELDS = ("other_tile", "q0", "q1", "k0", "k1", "dlo", "dhi", "kind")
# An item that holds no cell: the padding of item arrays.
EMPTY_ITEM = np.array([0, 0, 0, 0, 0, 0, -1, 0], np.int32)
# The last item field (``kind`` in ITEM_FIELDS) holds the item's mask kind: every cell of the
# tile in the slice (FULL, no predicate), only the slice's diagonal bounds cut the tile (BAND:
# it lies inside the slice's query and key ranges; one range check per cell), or any bound
# may cut it (GENERAL: three range checks per cell).
GENERAL, FULL, BAND = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class TileItems:
    """All work items of a mask for tiles ``block_q x block_k``; int arrays of length W,
    sorted by (q_tile, slice, k_tile)."""

    q_tile: np.ndarray
    k_tile: np.ndarray
    slice_id: np.ndarray
    full: np.ndarray  # bool
    block_q: int
    block_k: int
    num_q_tiles: int
    num_k_tiles: int

    def __len__(self) -> int:
        return len(self.q_tile)


def tile_items(
    shapes: SliceShapes, total_q: int, total_k: int, block_q: int, block_k: int
) -> TileItems:
    """Enumerates the non-empty (slice, q-tile, k-tile) items of ``shapes``."""
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q={block_q} and block_k={block_k} must be positive")
    live = np.nonzero(shapes.nonempty)[0]
    q0, q1 = shapes.q0[live], shapes.q1[live]
    # (slice, q-tile) pairs.
    owner, qt = ranges_incl(q0 // block_q, (q1 - 1) // block_q)
    s = live[owner]
    r_first = np.maximum(shapes.q0[s], qt * block_q)
    r_last = np.minimum(shapes.q1[s], (qt + 1) * block_q) - 1
    # Row intervals move monotonically, so the k extent of the pair is [lo(first), hi(last)]
    # and is contiguous (consecutive rows' intervals touch): every k-tile in it has a cell.
    k_first = shapes.lo(r_first, s)
    k_last = shapes.hi(r_last, s)
    owner2, kt = ranges_incl(k_first // block_k, k_last // block_k)
    s, qt = s[owner2], qt[owner2]
    tile_r0, tile_r1 = qt * block_q, (qt + 1) * block_q - 1
    tile_c0, tile_c1 = kt * block_k, (kt + 1) * block_k - 1
    rows_inside = (tile_r0 >= shapes.q0[s]) & (tile_r1 < shapes.q1[s])
    # Within the slice's rows, lo/hi are nondecreasing: check the extreme rows.
    full = (
        rows_inside
        & (shapes.lo(tile_r1, s) <= tile_c0)
        & (shapes.hi(tile_r0, s) >= tile_c1)
        & (tile_c1 < total_k)
    )
    order = np.lexsort((kt, s, qt))
    return TileItems(
        q_tile=qt[order].astype(np.int64),
        k_tile=kt[order].astype(np.int64),
        slice_id=s[order].astype(np.int64),
        full=full[order],
        block_q=block_q,
        block_k=block_k,
        num_q_tiles=-(-total_q // block_q),
        num_k_tiles=-(-total_k // block_k),
    )


def count_items(
    shapes: SliceShapes, total_q: int, total_k: int, block_q: int = 128, block_k: int = 128
) -> int:
    """The number of work items of ``shapes`` on ``block_q x block_k`` tiles (what
    :class:`~magi_jax.planning.capacity.PlanCapacity` bounds)."""
    return len(tile_items(shapes, total_q, total_k, block_q, block_k))
