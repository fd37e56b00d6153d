"""Work lists: the one host plan format of every FFA backend (host NumPy, no JAX inside).

An attention call is cut into tiles; a program owns one output tile. The forward and dQ
own a q-tile and walk the key tiles it sees; dK/dV own a k-tile and walk the query tiles
that see it. A :class:`WorkList` stores these runs in CSR form over the tiles, every item
carrying the slice geometry of its in-kernel predicate and its mask kind (:data:`FULL`: no
predicate; :data:`BAND`: only the diagonal bounds cut the tile; :data:`GENERAL`). Tiles are
launched heaviest first (``order``), so a few long rows start early instead of finishing
last.

The Mosaic GPU kernels read the lists as they are; the ``xla`` backend cuts each tile's run
into lanes on the device. Both take :class:`FFAPlanArrays`, built for their own tile sizes
(:func:`backend_blocks`). Item arrays may be padded (to a plan capacity, or to stack the
plans of several context-parallel ranks): padding sits past ``offsets[-1]`` and is never
visited.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import NamedTuple

import numpy as np

from magi_jax.mask import AttnMask, SliceShapes
from magi_jax.planning.tiling import EMPTY_ITEM, ITEM_FIELDS, tile_items

__all__ = ["ITEM_FIELDS", "NUM_FIELDS", "EMPTY_ITEM", "WorkList", "FFAPlanArrays",
           "build_work_list", "build_plan_arrays", "plan_for_mask", "pad_work_list",
           "stack_plans", "persistent_schedule", "backend_blocks", "default_block_sizes",
           "FWD_BLOCK_Q", "FWD_BLOCK_K", "DKV_BLOCK_Q", "DKV_BLOCK_K", "GENERAL", "FULL",
           "BAND"]

# Items have the columns of magi_jax.planning.tiling.ITEM_FIELDS (the tile on the other side, the
# slice's canonical geometry, the mask kind below); padding items are tiling.EMPTY_ITEM.
NUM_FIELDS = len(ITEM_FIELDS)
_I32 = np.iinfo(np.int32)

# Tile sizes the kernels are built for. Forward and dQ: a program owns 128 query rows (two
# consumer warpgroups of 64) and steps over 128 keys. dK/dV: a program owns 128 keys (two
# warpgroups of 64) and steps over 64 query rows.
FWD_BLOCK_Q, FWD_BLOCK_K = 128, 128
DKV_BLOCK_Q, DKV_BLOCK_K = 64, 128
# Tiles of the xla backend (its vectorised tile loop is the same at any size).
_XLA_BLOCK, _XLA_MIN_BLOCK = 128, 8

# The last item field (``kind`` in ITEM_FIELDS) holds the item's mask kind: every cell of the
# tile in the slice (FULL, no predicate), only the slice's diagonal bounds cut the tile (BAND:
# it lies inside the slice's query and key ranges; one range check per cell), or any bound
# may cut it (GENERAL: three range checks per cell).
GENERAL, FULL, BAND = 0, 1, 2


class WorkList(NamedTuple):
    """Items grouped by the tile that owns them.

    ``order [N]``: owned tiles, heaviest first (the launch order); ``offsets [N + 1]``: the
    items of tile ``t`` are ``items[offsets[t]:offsets[t + 1]]``; ``items [W, 8]``
    (:data:`ITEM_FIELDS`), sorted by (owned tile, FULL items first, other tile).
    """

    order: np.ndarray
    offsets: np.ndarray
    items: np.ndarray

    @property
    def num_tiles(self) -> int:
        return int(self.order.shape[0])

    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)


class FFAPlanArrays(NamedTuple):
    """The device view of one attention call's plan, for every backend: the q-tile list
    (forward and dQ) and the k-tile list (dK/dV), each ``order [N]``, ``offsets [N + 1]``,
    ``items [W, 8]`` int32 (:class:`WorkList`). Each backend builds them for its own tile
    sizes (:func:`backend_blocks`). Items past ``offsets[-1]`` are padding (capacity, or
    stacking) and are never visited. Under context parallelism every array gets a leading
    ``cp`` axis."""

    q_order: np.ndarray
    q_offsets: np.ndarray
    q_items: np.ndarray
    k_order: np.ndarray
    k_offsets: np.ndarray
    k_items: np.ndarray

    @property
    def fwd(self) -> WorkList:
        """The q-tile list (forward and dQ)."""
        return WorkList(*self[:3])

    @property
    def bwd(self) -> WorkList:
        """The k-tile list (dK/dV)."""
        return WorkList(*self[3:])

    def pad_to(self, num_q_items: int, num_k_items: int) -> "FFAPlanArrays":
        """The same plan with its item arrays padded to ``num_q_items`` / ``num_k_items``."""
        return FFAPlanArrays(*pad_work_list(WorkList(*self[:3]), num_q_items),
                             *pad_work_list(WorkList(*self[3:]), num_k_items))


def pad_work_list(work: WorkList, num_items: int, field: str = "items") -> WorkList:
    """``work`` with its items padded to ``num_items`` by the empty item; raises
    :class:`~magi_jax.planning.capacity.CapacityError` naming ``field`` when it holds more."""
    have = len(work.items)
    if have > num_items:
        from magi_jax.planning.capacity import CapacityError
        raise CapacityError(f"this mask needs PlanCapacity.{field}>={have} work items on one "
                            f"list, but the capacity holds {num_items}; build the capacity "
                            "with more items (or PlanCapacity.from_masks over a sample of your "
                            "masks)")
    extra = np.broadcast_to(EMPTY_ITEM, (num_items - have, NUM_FIELDS))
    items = np.concatenate([work.items, extra]).astype(np.int32)
    return WorkList(work.order.astype(np.int32), work.offsets.astype(np.int32), items)


def build_work_list(shapes: SliceShapes, total_q: int, total_k: int, block_q: int,
                    block_k: int, by: str) -> WorkList:
    """Items of tiles ``block_q x block_k`` owned by q-tiles (``by="q"``) or k-tiles
    (``by="k"``)."""
    ti = tile_items(shapes, total_q, total_k, block_q, block_k)
    if by == "q":
        own, other, num = ti.q_tile, ti.k_tile, ti.num_q_tiles
    elif by == "k":
        own, other, num = ti.k_tile, ti.q_tile, ti.num_k_tiles
    else:
        raise ValueError(f"by={by!r}: use 'q' or 'k'")
    s = ti.slice_id
    # FULL items of a tile first (the forward runs them in a loop without predicate code),
    # then the masked ones; each group by the other tile.
    order = np.lexsort((other, ~ti.full, own))
    own, other, s, full = own[order], other[order], s[order], ti.full[order]
    counts = np.bincount(own, minlength=num).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    if offsets[-1] > _I32.max:
        raise ValueError(f"{offsets[-1]} work items do not fit int32 offsets; use a smaller "
                         "problem per call (e.g. context parallelism)")
    clip = lambda x: np.clip(x, -_I32.max, _I32.max)
    # A boundary tile inside the slice's query and key ranges is cut only by the diagonals.
    q_tile, k_tile = (own, other) if by == "q" else (other, own)
    inside = ((shapes.q0[s] <= q_tile * block_q) & ((q_tile + 1) * block_q <= shapes.q1[s])
              & (shapes.k0[s] <= k_tile * block_k) & ((k_tile + 1) * block_k <= shapes.k1[s]))
    kind = np.where(full, FULL, np.where(inside, BAND, GENERAL))
    items = np.stack([other, shapes.q0[s], shapes.q1[s], shapes.k0[s], shapes.k1[s],
                      clip(shapes.dlo[s]), clip(shapes.dhi[s]), kind],
                     axis=-1).astype(np.int32).reshape(-1, NUM_FIELDS)
    # Heaviest first; ties by tile index so the order is deterministic.
    launch = np.lexsort((np.arange(num), -counts)).astype(np.int32)
    return WorkList(launch, offsets.astype(np.int32), items)


def default_block_sizes(total_q: int, total_k: int) -> tuple[int, int]:
    """Tiles of the ``xla`` backend: 128 x 128, shrunk (to a power of two >= 8) for short
    sequences."""
    def pick(t):
        return int(min(_XLA_BLOCK, max(_XLA_MIN_BLOCK, 1 << max(int(t) - 1, 0).bit_length())))
    return pick(total_q), pick(total_k)


def backend_blocks(backend: str, total_q: int, total_k: int, block_q: int | None = None,
                   block_k: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(q-list tiles, k-list tiles)`` as ``(block_q, block_k)`` pairs for ``backend``:
    the Mosaic GPU kernels' fixed tiles, or the ``xla`` backend's (``block_q``/``block_k``
    override its defaults)."""
    if backend.startswith("pallas"):
        return (FWD_BLOCK_Q, FWD_BLOCK_K), (DKV_BLOCK_Q, DKV_BLOCK_K)
    if backend != "xla":
        raise ValueError(f"backend={backend!r}: use 'xla' or 'pallas'")
    auto_q, auto_k = default_block_sizes(total_q, total_k)
    block = (int(block_q or auto_q), int(block_k or auto_k))
    return block, block


def build_plan_arrays(shapes: SliceShapes, total_q: int, total_k: int,
                      fwd_block: tuple[int, int], bwd_block: tuple[int, int]) -> FFAPlanArrays:
    """Both work lists of one call: the q-tile list on ``fwd_block`` tiles and the k-tile
    list on ``bwd_block`` tiles."""
    fwd = build_work_list(shapes, total_q, total_k, *fwd_block, "q")
    bwd = build_work_list(shapes, total_q, total_k, *bwd_block, "k")
    return FFAPlanArrays(*fwd, *bwd)


@functools.lru_cache(maxsize=256)
def plan_for_mask(mask: AttnMask, backend: str, block_q: int | None = None,
                  block_k: int | None = None) -> FFAPlanArrays:
    """The exact-size work lists of ``mask`` for ``backend``, cached by the mask's
    fingerprint."""
    fwd_block, bwd_block = backend_blocks(backend, mask.total_q, mask.total_k, block_q,
                                          block_k)
    return build_plan_arrays(mask.shapes, mask.total_q, mask.total_k, fwd_block, bwd_block)


def stack_plans(plans: list[FFAPlanArrays]) -> FFAPlanArrays:
    """Stacks the plans of several ranks along a new leading axis (for ``shard_map``), padding
    every plan's item lists to the longest. The ranks must hold sequences of one length, so
    their tile counts already agree."""
    if not plans:
        raise ValueError("stack_plans needs at least one plan")
    nq = {len(p.q_order) for p in plans}
    nk = {len(p.k_order) for p in plans}
    if len(nq) != 1 or len(nk) != 1:
        raise ValueError(f"plans cover different numbers of tiles (q {sorted(nq)}, k "
                         f"{sorted(nk)}); every rank must hold the same local Tq and Tk")
    wq = max(len(p.q_items) for p in plans)
    wk = max(len(p.k_items) for p in plans)
    padded = [p.pad_to(wq, wk) for p in plans]
    return FFAPlanArrays(*(np.stack(parts) for parts in zip(*padded)))


# What a unit costs a persistent program beyond its items, in items: the epilogue and the
# softmax tail that the next unit's prefetched loads do not hide.
UNIT_OVERHEAD_ITEMS = 1.0


def persistent_schedule(work: WorkList, groups: int, num_progs: int,
                        overhead: float = UNIT_OVERHEAD_ITEMS) -> tuple[np.ndarray, np.ndarray]:
    """Which units each program of a persistent kernel walks, fixed on the host.

    Units are numbered in the launch order of the head-major grid: ``u = g * N + r`` for
    group ``g`` (a (head, batch) pair) and rank ``r`` of ``work.order`` (heaviest first), so
    unit ``u`` owns tile ``work.order[u % N]``. They are handed out one by one, each to the
    program that would be free first (list scheduling with a unit costing its item count plus
    ``overhead``): first the units of all groups but the last quarter in that order, so
    programs running together share one head's K/V through L2; then the units of the last
    quarter of the groups heaviest first, so the schedule does not end on one group's
    heaviest tiles (on doc-causal 32k, 16 heads, 132 programs the last program ends 2 % after
    the mean in head-major order, 0.2 % with the tail sorted). Fixed in advance, a program
    can load its next unit while it finishes the current one.

    Returns ``(offsets [P + 1], units [U])`` int32, ``P = min(num_progs, U)``: program ``p``
    walks ``units[offsets[p]:offsets[p + 1]]`` in order."""
    if num_progs < 1 or groups < 1:
        raise ValueError(f"num_progs={num_progs} and groups={groups} must be >= 1")
    return _schedule(work.counts()[work.order].astype(np.float64).tobytes(), groups,
                     num_progs, float(overhead))


@functools.lru_cache(maxsize=64)
def _schedule(costs_bytes: bytes, groups: int, num_progs: int, overhead: float):
    costs = np.frombuffer(costs_bytes, np.float64) + overhead
    n = len(costs)
    num_units = n * groups
    progs = min(num_progs, num_units)
    head = (groups - -(-groups // 4)) * n   # units before the last quarter of the groups
    tail = np.arange(head, num_units)
    tail = tail[np.argsort(-costs[tail % n], kind="stable")]
    mine = [[] for _ in range(progs)]
    free = [(0.0, p) for p in range(progs)]
    for u in np.concatenate([np.arange(head), tail]).tolist():
        t, p = heapq.heappop(free)
        mine[p].append(u)
        heapq.heappush(free, (t + costs[u % n], p))
    units = np.fromiter((u for m in mine for u in m), np.int32, num_units)
    offsets = np.concatenate([[0], np.cumsum([len(m) for m in mine])])
    return offsets.astype(np.int32), units
