"""Host plans of the ``xla`` backend (pure NumPy, no JAX): lanes of work items.

The portable backend (:mod:`magi_jax.ffa.xla`) is driven by a host-built plan
(:class:`XlaFFAPlan`): lanes of work items (see :mod:`magi_jax.planning.tiling`), so the work
follows the mask area and the memory ``T·H·D``. The device entry point
:func:`magi_jax.ffa.xla.xla_ffa` takes the plan as int32 arrays of static shape
(:class:`FFAPlanArrays`), never a mask, so context parallelism can feed it each rank's own
plan, stacked and sharded, under ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from magi_jax.mask import AttnMask, SliceShapes
from magi_jax.planning.tiling import (EMPTY_ITEM, LanePlan, choose_lane_len, lane_plan,
                                      pack_lanes, tile_items, unpack_lanes)

if TYPE_CHECKING:
    import jax

__all__ = ["FFAPlanArrays", "XlaFFAPlan", "build_xla_plan", "plan_for_mask",
           "default_block_sizes", "stack_plans"]

_DEFAULT_BLOCK = 128
_MIN_BLOCK = 8


class FFAPlanArrays(NamedTuple):
    """The device view of an FFA plan: int32 arrays of static shape.

    ``q_lane_tile [V]``, ``q_items [V, L, 8]``: lanes over q-tiles (forward and dQ);
    ``k_lane_tile [V']``, ``k_items [V', L', 8]``: lanes over k-tiles (dK/dV).
    Under context parallelism every array gets a leading ``cp`` axis.
    """

    q_lane_tile: jax.Array | np.ndarray
    q_items: jax.Array | np.ndarray
    k_lane_tile: jax.Array | np.ndarray
    k_items: jax.Array | np.ndarray


@dataclasses.dataclass(frozen=True)
class XlaFFAPlan:
    """Host plan of the ``xla`` backend for one (mask, tile size)."""

    fwd: LanePlan
    bwd: LanePlan
    block_q: int
    block_k: int
    total_q: int
    total_k: int
    num_items: int
    num_full_items: int

    def arrays(self) -> FFAPlanArrays:
        return FFAPlanArrays(self.fwd.lane_tile, self.fwd.items, self.bwd.lane_tile,
                             self.bwd.items)


def default_block_sizes(total_q: int, total_k: int) -> tuple[int, int]:
    """128 x 128 tiles, shrunk (to a power of two >= 8) for short sequences."""
    def pick(t):
        return int(min(_DEFAULT_BLOCK, max(_MIN_BLOCK, 1 << max(int(t) - 1, 0).bit_length())))
    return pick(total_q), pick(total_k)


def build_xla_plan(shapes: SliceShapes, total_q: int, total_k: int, block_q: int,
                   block_k: int) -> XlaFFAPlan:
    """Tiles ``shapes`` and packs the items into q-lanes and k-lanes."""
    items = tile_items(shapes, total_q, total_k, block_q, block_k)
    return XlaFFAPlan(fwd=lane_plan(items, shapes, "q"), bwd=lane_plan(items, shapes, "k"),
                      block_q=block_q, block_k=block_k, total_q=total_q, total_k=total_k,
                      num_items=len(items), num_full_items=int(items.full.sum()))


@functools.lru_cache(maxsize=256)
def plan_for_mask(mask: AttnMask, block_q: int, block_k: int) -> XlaFFAPlan:
    """The plan of ``mask``, cached by the mask's fingerprint and the tile size."""
    return build_xla_plan(mask.shapes, mask.total_q, mask.total_k, block_q, block_k)


def stack_plans(plans: list[FFAPlanArrays]) -> FFAPlanArrays:
    """Stacks several plans (e.g. one per rank) along a new leading axis.

    The plans' items are re-packed with one lane length chosen for all of them, so that one
    plan's long rows do not pad every other plan's lanes (padding the lane count and the lane
    length to their maxima separately can multiply the work and the memory of the stack)."""
    def stack(tiles, items):
        unpacked = [unpack_lanes(LanePlan(np.asarray(t), np.asarray(i)))
                    for t, i in zip(tiles, items)]
        length = choose_lane_len([np.bincount(own) for own, _ in unpacked])
        packed = [pack_lanes(own, rows, int(own.max(initial=-1)) + 1, length)
                  for own, rows in unpacked]
        num_lanes = max(p.num_lanes for p in packed)
        out_items = np.broadcast_to(EMPTY_ITEM, (len(packed), num_lanes, length,
                                                 len(EMPTY_ITEM))).copy()
        out_tiles = np.zeros((len(packed), num_lanes), np.int32)
        for r, p in enumerate(packed):
            out_items[r, :p.num_lanes] = p.items
            out_tiles[r, :p.num_lanes] = p.lane_tile
        return out_tiles, out_items
    qt, qi = stack([p.q_lane_tile for p in plans], [p.q_items for p in plans])
    kt, ki = stack([p.k_lane_tile for p in plans], [p.k_items for p in plans])
    return FFAPlanArrays(qt, qi, kt, ki)
