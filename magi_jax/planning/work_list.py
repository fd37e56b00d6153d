"""Work lists of the Mosaic GPU FFA kernels (host NumPy, no JAX inside).

The kernels own one output tile per program (DESIGN.md §2.2): the forward and dQ programs
own a q-tile and walk the key tiles it sees; the dK/dV programs own a k-tile and walk the
query tiles that see it. A :class:`WorkList` stores these runs in CSR form over the tiles,
with every item carrying the slice geometry needed for its in-kernel predicate and its mask
kind (:data:`FULL`: no predicate; :data:`BAND`: only the diagonal bounds cut the tile;
:data:`GENERAL`). Programs are launched heaviest tile first (``order``), so a few long rows
start early instead of finishing last.

All arrays are int32 of shapes fixed by the plan; :meth:`KernelPlanArrays.pad_to` pads them
(empty tiles, empty items) so the plans of several context-parallel ranks can be stacked.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import NamedTuple

import numpy as np

from magi_jax.mask import AttnMask, SliceShapes
from magi_jax.planning.tiling import EMPTY_ITEM as _EMPTY_ITEM, ITEM_FIELDS, tile_items

__all__ = ["ITEM_FIELDS", "NUM_FIELDS", "WorkList", "KernelPlan", "KernelPlanArrays",
           "build_work_list", "build_kernel_plan", "kernel_plan_for_mask",
           "stack_kernel_plans", "persistent_schedule", "FWD_BLOCK_Q", "FWD_BLOCK_K",
           "DKV_BLOCK_Q", "DKV_BLOCK_K", "GENERAL", "FULL", "BAND"]

# Items have the columns of magi_jax.planning.tiling.ITEM_FIELDS (the tile on the other side, the
# slice's canonical geometry, the mask kind below); padding items are tiling.EMPTY_ITEM.
NUM_FIELDS = len(ITEM_FIELDS)
_I32 = np.iinfo(np.int32)

# Tile sizes the kernels are built for. Forward and dQ: a program owns 128 query rows (two
# consumer warpgroups of 64) and steps over 128 keys. dK/dV: a program owns 128 keys (two
# warpgroups of 64) and steps over 64 query rows.
FWD_BLOCK_Q, FWD_BLOCK_K = 128, 128
DKV_BLOCK_Q, DKV_BLOCK_K = 64, 128

# The last item field (``full`` in ITEM_FIELDS) holds the item's mask kind: every cell of the
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


class KernelPlanArrays(NamedTuple):
    """The device view of a kernel plan: the forward/dQ list (q-tiles of
    :data:`FWD_BLOCK_Q`, k-steps of :data:`FWD_BLOCK_K`) and the dK/dV list (k-tiles of
    :data:`DKV_BLOCK_K`, q-steps of :data:`DKV_BLOCK_Q`). Under context parallelism every
    array gets a leading ``cp`` axis."""

    q_order: np.ndarray
    q_offsets: np.ndarray
    q_items: np.ndarray
    k_order: np.ndarray
    k_offsets: np.ndarray
    k_items: np.ndarray

    def pad_to(self, num_q_tiles: int, num_q_items: int, num_k_tiles: int,
               num_k_items: int) -> "KernelPlanArrays":
        """The same plan for more (empty) tiles and more (empty) items, for stacking plans of
        several ranks. Extra tiles own no item; extra items are never visited."""
        def pad(order, offsets, items, n, w):
            if n < len(order) or w < len(items):
                raise ValueError(f"cannot pad a plan of {len(order)} tiles / {len(items)} "
                                 f"items down to {n} / {w}")
            order = np.concatenate([order, np.arange(len(order), n, dtype=np.int32)])
            offsets = np.concatenate([offsets, np.full(n - len(offsets) + 1, offsets[-1],
                                                       np.int32)])
            extra = np.broadcast_to(_EMPTY_ITEM, (w - len(items), NUM_FIELDS))
            return order, offsets, np.concatenate([items, extra]).astype(np.int32)
        return KernelPlanArrays(*pad(self.q_order, self.q_offsets, self.q_items, num_q_tiles,
                                     num_q_items),
                                *pad(self.k_order, self.k_offsets, self.k_items, num_k_tiles,
                                     num_k_items))


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


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """Host plan of the ``pallas`` backend for one mask: forward/dQ and dK/dV lists."""

    fwd: WorkList
    dkv: WorkList
    total_q: int
    total_k: int

    def arrays(self) -> KernelPlanArrays:
        return KernelPlanArrays(*self.fwd, *self.dkv)


def build_kernel_plan(shapes: SliceShapes, total_q: int, total_k: int) -> KernelPlan:
    fwd = build_work_list(shapes, total_q, total_k, FWD_BLOCK_Q, FWD_BLOCK_K, "q")
    dkv = build_work_list(shapes, total_q, total_k, DKV_BLOCK_Q, DKV_BLOCK_K, "k")
    return KernelPlan(fwd, dkv, total_q, total_k)


@functools.lru_cache(maxsize=256)
def kernel_plan_for_mask(mask: AttnMask) -> KernelPlan:
    """The kernel plan of ``mask``, cached by the mask's fingerprint."""
    return build_kernel_plan(mask.shapes, mask.total_q, mask.total_k)


def stack_kernel_plans(plans: list[KernelPlanArrays]) -> KernelPlanArrays:
    """Stacks the plans of several ranks along a new leading axis (for ``shard_map``), padding
    every plan's item lists to the longest. The ranks must hold sequences of one length, so
    their tile counts already agree."""
    if not plans:
        raise ValueError("stack_kernel_plans needs at least one plan")
    nq = {len(p.q_order) for p in plans}
    nk = {len(p.k_order) for p in plans}
    if len(nq) != 1 or len(nk) != 1:
        raise ValueError(f"plans cover different numbers of tiles (q {sorted(nq)}, k "
                         f"{sorted(nk)}); every rank must hold the same local Tq and Tk")
    wq = max(len(p.q_items) for p in plans)
    wk = max(len(p.k_items) for p in plans)
    padded = [p.pad_to(len(p.q_order), wq, len(p.k_order), wk)
              for p in plans]
    return KernelPlanArrays(*(np.stack(parts) for parts in zip(*padded)))


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
