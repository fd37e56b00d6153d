"""Host-side tiling of a slice mask into kernel work items (pure NumPy, no JAX).

A *work item* is one (slice, q-tile, k-tile) triple whose intersection holds at least one
cell. An item is *full* when every cell of the tile belongs to the slice (no in-kernel
predicate needed); otherwise it is a *boundary* item whose predicate is evaluated from the
slice geometry carried in the item. Empty tiles produce no item, so the number of items
follows the mask area, not ``Tq·Tk``.

Items are then packed into *lanes* (:class:`LanePlan`): each lane owns one output tile (a
q-tile for the forward and dQ, a k-tile for dK/dV) and visits at most ``L`` items; a tile
with more items gets several lanes whose partial results are merged once at the end. Lanes
keep the work of uneven rows balanced (a few long rows do not set the length of every row).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from magi_jax.mask import SliceShapes

__all__ = ["TileItems", "tile_items", "LanePlan", "lane_plan", "pack_lanes", "unpack_lanes",
           "choose_lane_len", "ITEM_FIELDS", "EMPTY_ITEM"]

# Columns of one packed work item (int32): the tile on the other side (k-tile for a q-lane,
# q-tile for a k-lane), the slice's canonical geometry, and whether the tile is full.
ITEM_FIELDS = ("other_tile", "q0", "q1", "k0", "k1", "dlo", "dhi", "full")
_I32_MAX = np.iinfo(np.int32).max
# An item that holds no cell: padding for lanes shorter than L and for padded lanes.
EMPTY_ITEM = np.array([0, 0, 0, 0, 0, 0, -1, 0], np.int32)


@dataclasses.dataclass(frozen=True)
class TileItems:
    """All work items of a mask for tiles ``block_q x block_k``; int arrays of length W,
    sorted by (q_tile, slice, k_tile)."""

    q_tile: np.ndarray
    k_tile: np.ndarray
    slice_id: np.ndarray
    full: np.ndarray           # bool
    block_q: int
    block_k: int
    num_q_tiles: int
    num_k_tiles: int

    def __len__(self) -> int:
        return len(self.q_tile)


def _ranges_repeat(start: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each i, the integers [start[i], stop[i]]: returns (owner index, value)."""
    n = np.maximum(stop - start + 1, 0)
    owner = np.repeat(np.arange(len(start)), n)
    value = np.repeat(start, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    return owner, value


def tile_items(shapes: SliceShapes, total_q: int, total_k: int, block_q: int,
               block_k: int) -> TileItems:
    """Enumerates the non-empty (slice, q-tile, k-tile) items of ``shapes``."""
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q={block_q} and block_k={block_k} must be positive")
    live = np.nonzero(shapes.nonempty)[0]
    q0, q1 = shapes.q0[live], shapes.q1[live]
    # (slice, q-tile) pairs.
    owner, qt = _ranges_repeat(q0 // block_q, (q1 - 1) // block_q)
    s = live[owner]
    r_first = np.maximum(shapes.q0[s], qt * block_q)
    r_last = np.minimum(shapes.q1[s], (qt + 1) * block_q) - 1
    # Row intervals move monotonically, so the k extent of the pair is [lo(first), hi(last)]
    # and is contiguous (consecutive rows' intervals touch): every k-tile in it has a cell.
    k_first = shapes.lo(r_first, s)
    k_last = shapes.hi(r_last, s)
    owner2, kt = _ranges_repeat(k_first // block_k, k_last // block_k)
    s, qt = s[owner2], qt[owner2]
    tile_r0, tile_r1 = qt * block_q, (qt + 1) * block_q - 1
    tile_c0, tile_c1 = kt * block_k, (kt + 1) * block_k - 1
    rows_inside = (tile_r0 >= shapes.q0[s]) & (tile_r1 < shapes.q1[s])
    # Within the slice's rows, lo/hi are nondecreasing: check the extreme rows.
    full = (rows_inside & (shapes.lo(tile_r1, s) <= tile_c0) & (shapes.hi(tile_r0, s) >= tile_c1)
            & (tile_c1 < total_k))
    order = np.lexsort((kt, s, qt))
    return TileItems(q_tile=qt[order].astype(np.int64), k_tile=kt[order].astype(np.int64),
                     slice_id=s[order].astype(np.int64), full=full[order], block_q=block_q,
                     block_k=block_k, num_q_tiles=-(-total_q // block_q),
                     num_k_tiles=-(-total_k // block_k))


@dataclasses.dataclass(frozen=True)
class LanePlan:
    """Items packed into lanes. ``lane_tile`` int32 ``[V]``: the output tile each lane owns;
    ``items`` int32 ``[V, L, 8]`` (fields :data:`ITEM_FIELDS`). Padding lanes own tile 0 and
    hold only :data:`EMPTY_ITEM`."""

    lane_tile: np.ndarray
    items: np.ndarray

    @property
    def num_lanes(self) -> int:
        return self.items.shape[0]

    @property
    def lane_len(self) -> int:
        return self.items.shape[1]

    def pad_to(self, num_lanes: int, lane_len: int) -> "LanePlan":
        """The same plan with more (empty) lanes and/or longer lanes, for stacking."""
        v, l = self.items.shape[:2]
        if num_lanes < v or lane_len < l:
            raise ValueError(f"cannot pad a [{v}, {l}] lane plan down to [{num_lanes}, "
                             f"{lane_len}]")
        items = np.broadcast_to(EMPTY_ITEM, (num_lanes, lane_len, len(EMPTY_ITEM))).copy()
        items[:v, :l] = self.items
        lane_tile = np.zeros((num_lanes,), np.int32)
        lane_tile[:v] = self.lane_tile
        return LanePlan(lane_tile, items)


def choose_lane_len(counts_per_plan: list[np.ndarray]) -> int:
    """Lane length L (a power of two) minimising the padded work of the heaviest plan,
    ``max_p V_p(L)·(L + c)`` with ``V_p(L)`` the lanes plan ``p`` needs and ``c`` a per-lane
    cost (the lane's state and its merge). ``counts_per_plan``: items per owned tile, one
    array per plan (one plan, or one per rank when plans are stacked)."""
    counts_per_plan = [c[c > 0] for c in counts_per_plan]
    longest = max((int(c.max()) for c in counts_per_plan if len(c)), default=0)
    if not longest:
        return 1
    best, best_cost = 1, None
    per_lane = 2.0
    length = 1
    while True:
        lanes = max(int(np.sum(-(-c // length))) for c in counts_per_plan)
        cost = lanes * (length + per_lane)
        if best_cost is None or cost < best_cost:
            best, best_cost = length, cost
        if length >= longest:
            break
        length *= 2
    return best


def lane_plan(items: TileItems, shapes: SliceShapes, by: str,
              lane_len: int | None = None) -> LanePlan:
    """Packs ``items`` into lanes owning q-tiles (``by="q"``) or k-tiles (``by="k"``)."""
    if by == "q":
        own, other = items.q_tile, items.k_tile
        order = np.arange(len(items))
        num_tiles = items.num_q_tiles
    elif by == "k":
        own, other = items.k_tile, items.q_tile
        order = np.lexsort((items.q_tile, items.slice_id, items.k_tile))
        num_tiles = items.num_k_tiles
    else:
        raise ValueError(f"by={by!r}: use 'q' or 'k'")
    own, other = own[order], other[order]
    s = items.slice_id[order]
    lo_clip, hi_clip = -_I32_MAX, _I32_MAX
    rows = np.stack([
        other, shapes.q0[s], shapes.q1[s], shapes.k0[s], shapes.k1[s],
        np.clip(shapes.dlo[s], lo_clip, hi_clip), np.clip(shapes.dhi[s], lo_clip, hi_clip),
        items.full[order].astype(np.int64)], axis=-1).astype(np.int32)
    return pack_lanes(own, rows, num_tiles, lane_len)


def pack_lanes(own: np.ndarray, rows: np.ndarray, num_tiles: int,
               lane_len: int | None = None) -> LanePlan:
    """Packs item ``rows`` (int32 ``[W, 8]``, grouped by owned tile ``own``, in visiting
    order) into lanes of ``lane_len`` items (chosen when ``None``)."""
    counts = np.bincount(own, minlength=num_tiles)
    length = choose_lane_len([counts]) if lane_len is None else int(lane_len)
    # Position of every item inside its tile's run, then lane = (tile's first lane + pos // L).
    run_start = np.cumsum(counts) - counts
    pos = np.arange(len(own)) - run_start[own]
    lanes_per_tile = -(-counts // length)
    first_lane = np.cumsum(lanes_per_tile) - lanes_per_tile
    lane = first_lane[own] + pos // length
    slot = pos % length
    num_lanes = max(int(lanes_per_tile.sum()), 1)
    packed = np.broadcast_to(EMPTY_ITEM, (num_lanes, length, len(EMPTY_ITEM))).copy()
    packed[lane, slot] = rows
    lane_tile = np.zeros((num_lanes,), np.int32)
    lane_tile[lane] = own
    return LanePlan(lane_tile, packed)


def unpack_lanes(plan: LanePlan) -> tuple[np.ndarray, np.ndarray]:
    """The real items of a lane plan as ``(own tile [W], rows [W, 8])``, in visiting order."""
    q0, q1 = ITEM_FIELDS.index("q0"), ITEM_FIELDS.index("q1")
    real = plan.items[..., q1] > plan.items[..., q0]
    lanes, slots = np.nonzero(real)          # row-major: lane by lane, slot by slot
    return plan.lane_tile[lanes].astype(np.int64), plan.items[lanes, slots]
