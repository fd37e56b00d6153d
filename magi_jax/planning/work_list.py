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

import heapq
import mmap
from typing import NamedTuple

import numpy as np

from magi_jax.caches import cached
from magi_jax.masks import AttnMask, SliceShapes
from magi_jax.planning.backends import (
    DKV_BLOCK_K,
    DKV_BLOCK_Q,
    FWD_BLOCK_K,
    FWD_BLOCK_Q,
    HOST_SPECS,
    backend_blocks,
    default_block_sizes,
)
from magi_jax.planning.errors import capacity_error
from magi_jax.planning.item_runs import order_runs, slice_runs
from magi_jax.planning.tiling import BAND, EMPTY_ITEM, FULL, GENERAL, ITEM_FIELDS, tile_items

__all__ = [
    "ITEM_FIELDS",
    "NUM_FIELDS",
    "EMPTY_ITEM",
    "WorkList",
    "FFAPlanArrays",
    "RUN_FIELDS",
    "NUM_RUN_FIELDS",
    "EMPTY_RUN",
    "FFAPlanRuns",
    "emit_run_lists",
    "check_runs",
    "expand_plan_runs",
    "plan_runs",
    "count_runs",
    "build_work_list",
    "build_work_lists",
    "work_list_runs",
    "emit_work_lists",
    "check_items",
    "ListRuns",
    "build_plan_arrays",
    "plan_for_mask",
    "pad_work_list",
    "stack_plans",
    "persistent_schedule",
    "backend_blocks",
    "default_block_sizes",
    "FWD_BLOCK_Q",
    "FWD_BLOCK_K",
    "DKV_BLOCK_Q",
    "DKV_BLOCK_K",
    "GENERAL",
    "FULL",
    "BAND",
]

# Items have the columns of magi_jax.planning.tiling.ITEM_FIELDS (the tile on the other side, the
# slice's canonical geometry, the mask kind below); padding items are tiling.EMPTY_ITEM.
NUM_FIELDS = len(ITEM_FIELDS)
_I32 = np.iinfo(np.int32)
# Columns of a run of items (FFAPlanRuns): the fields of its first item, then its length.
# Along a run only ``other_tile`` changes, stepping by one.
RUN_FIELDS = ITEM_FIELDS + ("length",)
NUM_RUN_FIELDS = len(RUN_FIELDS)
_LENGTH = RUN_FIELDS.index("length")
# NumPy advises huge pages for arrays from this size on (numpy/_core/src/multiarray/alloc.c).
_HUGE_PAGE_ADVICE_BYTES = 1 << 22
# The padding of run arrays: no items.
EMPTY_RUN = np.append(EMPTY_ITEM, 0).astype(np.int32)

# The engines' tiles (FWD_BLOCK_Q, ..., backend_blocks) are their host specs'
# (magi_jax.planning.backends); they are named here too, beside the lists built on them.


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
        return FFAPlanArrays(
            *pad_work_list(WorkList(*self[:3]), num_q_items),
            *pad_work_list(WorkList(*self[3:]), num_k_items),
        )


class FFAPlanRuns(NamedTuple):
    """The compact form of :class:`FFAPlanArrays` that keys and plans at a capacity store
    and ship to the device: each list's items as runs. ``q_order``, ``q_offsets``,
    ``k_order``, ``k_offsets`` as in :class:`FFAPlanArrays`; ``q_runs [R, 9]``, ``k_runs
    [R', 9]`` int32 (:data:`RUN_FIELDS`): a run is the first of ``length`` consecutive items
    of one owned tile that differ only in ``other_tile`` (stepping by one); runs are in item
    order, so the items of tile ``t`` are still ``offsets[t]:offsets[t + 1]`` of the runs'
    enumeration. Runs past the last real one are :data:`EMPTY_RUN` (length 0). Under context
    parallelism every array gets a leading ``cp`` axis.

    The widths of the item arrays it stands for are not part of it (the owner's static part
    keeps them): :func:`expand_plan_runs` (host) and :func:`magi_jax.ffa.plan.expand_lists`
    (device, inside the traced step) give exactly the :class:`FFAPlanArrays` of those
    widths."""

    q_order: np.ndarray
    q_offsets: np.ndarray
    q_runs: np.ndarray
    k_order: np.ndarray
    k_offsets: np.ndarray
    k_runs: np.ndarray

    @property
    def fwd(self) -> WorkList:
        """The q-tile list's order and offsets (what persistent schedules read), with its
        runs in place of the items."""
        return WorkList(*self[:3])

    @property
    def bwd(self) -> WorkList:
        """The k-tile list's order and offsets, with its runs in place of the items."""
        return WorkList(*self[3:])


def emit_run_lists(
    runs: ListRuns, num_runs: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(order, offsets, runs [cp, R, 9])`` of the stacked lists of ``runs``
    (:class:`FFAPlanRuns`' columns), runs padded to ``R = num_runs`` (default: the most of
    any call; :func:`check_runs` first when it may hold fewer)."""
    per_call = np.diff(runs.run_bounds)
    cp = len(per_call)
    width = int(per_call.max(initial=0)) if num_runs is None else int(num_runs)
    out = _ordinary_pages((cp, width, NUM_RUN_FIELDS))
    pad = _padding(width - int(per_call.min(initial=width)), EMPTY_RUN)
    for r in range(cp):
        a, b = runs.run_bounds[r], runs.run_bounds[r + 1]
        np.take(runs.table, runs.row[a:b], axis=0, out=out[r, : b - a], mode="clip")
        out[r, b - a :] = pad[: width - (b - a)]
    return runs.order, runs.offsets, out


def _ordinary_pages(shape: tuple[int, ...]) -> np.ndarray:
    """``np.empty(shape, np.int32)``, in memory of ordinary pages where NumPy would ask for
    huge ones (arrays of 4 MiB and more). In a process whose memory is fragmented (a loader
    that has planned many keys), every first touch of a huge page waits for the kernel to
    compact memory: that took most of the host time of the largest keys at a capacity
    (``benchmarks/results/wire/LATEST.md``). Run arrays are written once, front to back, so
    ordinary pages cost them nothing."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * 4
    if nbytes < _HUGE_PAGE_ADVICE_BYTES:
        return np.empty(shape, np.int32)
    # An anonymous mapping of its own, without NumPy's madvise; unmapped with the array.
    return np.frombuffer(mmap.mmap(-1, nbytes), np.int32).reshape(shape)


def check_runs(runs: ListRuns, num_runs: int, field: str = "q_runs") -> None:
    """Raises :class:`~magi_jax.planning.errors.CapacityError` naming ``field`` for the
    first call of ``runs`` with more than ``num_runs`` runs."""
    per_call = np.diff(runs.run_bounds)
    over = np.nonzero(per_call > int(num_runs))[0]
    if len(over):
        have = int(per_call[over[0]])
        raise capacity_error(field, have, num_runs, detail=" runs of work items on one list")


def plan_runs(
    runs_q: ListRuns, runs_k: ListRuns, num_runs: tuple[int, int] | None = None
) -> FFAPlanRuns:
    """The stacked :class:`FFAPlanRuns` of both lists' runs, padded to ``num_runs = (q, k)``
    (default: the most of any call)."""
    nq, nk = (None, None) if num_runs is None else num_runs
    return FFAPlanRuns(*emit_run_lists(runs_q, nq), *emit_run_lists(runs_k, nk))


def _expand_list(order, offsets, runs, num_items: int) -> WorkList:
    """Host expansion of one list (leading axes: stacked calls)."""
    lead = runs.shape[:-2]
    calls = int(np.prod(lead, dtype=np.int64))
    flat = runs.reshape(calls, *runs.shape[-2:])
    ends = np.asarray(offsets).reshape(calls, offsets.shape[-1])[:, -1]
    length = flat[..., _LENGTH].astype(np.int64)
    real = length > 0
    count = real.sum(axis=1)
    bounds = np.concatenate([[0], np.cumsum(count)])
    # Real runs come first on every call (padding runs after them).
    listed = ListRuns(
        flat[real], np.arange(int(bounds[-1])), bounds, ends.astype(np.int64), None, None
    )
    items = emit_work_lists(listed, num_items).items
    return WorkList(order, offsets, items.reshape(*lead, num_items, NUM_FIELDS))


def expand_plan_runs(plan: FFAPlanRuns, num_q_items: int, num_k_items: int) -> FFAPlanArrays:
    """The :class:`FFAPlanArrays` that ``plan`` stands for, item arrays ``num_q_items`` /
    ``num_k_items`` wide (host NumPy; the device does the same with
    :func:`magi_jax.ffa.plan.expand_lists`)."""
    if not isinstance(plan, FFAPlanRuns):
        raise TypeError(f"plan must be FFAPlanRuns; got {type(plan).__name__}")
    return FFAPlanArrays(
        *_expand_list(*plan[:3], int(num_q_items)), *_expand_list(*plan[3:], int(num_k_items))
    )


# The name this function had before it was named for what it expands, for one release.
expand_runs = expand_plan_runs


def pad_work_list(work: WorkList, num_items: int, field: str = "items") -> WorkList:
    """``work`` with its items padded to ``num_items`` by the empty item; raises
    :class:`~magi_jax.planning.errors.CapacityError` naming ``field`` when it holds more."""
    have = len(work.items)
    if have > num_items:
        raise capacity_error(field, have, num_items, detail=" work items on one list")
    extra = np.broadcast_to(EMPTY_ITEM, (num_items - have, NUM_FIELDS))
    items = np.concatenate([work.items, extra]).astype(np.int32)
    return WorkList(work.order.astype(np.int32), work.offsets.astype(np.int32), items)


def build_work_list(
    shapes: SliceShapes, total_q: int, total_k: int, block_q: int, block_k: int, by: str
) -> WorkList:
    """Items of tiles ``block_q x block_k`` owned by q-tiles (``by="q"``) or k-tiles
    (``by="k"``)."""
    _check_blocks(block_q, block_k, by)
    work = build_work_lists(
        shapes, np.zeros(len(shapes.q0), np.int64), 1, total_q, total_k, block_q, block_k, by
    )
    return WorkList(work.order[0], work.offsets[0], work.items[0])


def _check_blocks(block_q, block_k, by):
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q={block_q} and block_k={block_k} must be positive")
    if by not in ("q", "k"):
        raise ValueError(f"by={by!r}: use 'q' or 'k'")


def build_work_lists(
    shapes: SliceShapes,
    slice_rank: np.ndarray,
    cp: int,
    total_q: int,
    total_k: int,
    block_q: int,
    block_k: int,
    by: str,
    num_items: int | None = None,
    field: str = "items",
) -> WorkList:
    """The work lists of ``cp`` calls at once, stacked: ``order [cp, N]``, ``offsets
    [cp, N + 1]``, ``items [cp, W, 8]`` int32 — exactly ``stack_plans`` of
    :func:`build_work_list` of each call's slices, each list padded to ``W = num_items``
    (:func:`pad_work_list`, raising its :class:`~magi_jax.planning.errors.CapacityError`
    naming ``field`` for the first call that holds more) or, without ``num_items``, to the
    longest.

    ``shapes`` holds the slices of every call, grouped by call: ``slice_rank`` (int,
    nondecreasing) says whose each is, and a call's slices keep their order. One pass over
    all calls: every (slice, owned tile) pair is cut into runs of consecutive other tiles of
    one mask kind, the runs are ordered (per call and owned tile: FULL first, then by other
    tile and slice) and only then expanded into items, each call's straight into its row of
    the stacked arrays (:func:`work_list_runs`, :func:`emit_work_lists`)."""
    runs = work_list_runs(shapes, slice_rank, cp, total_q, total_k, block_q, block_k, by)
    if num_items is not None:
        check_items(runs.per_rank, num_items, field)
    return emit_work_lists(runs, num_items)


class ListRuns(NamedTuple):
    """Stacked work lists before their items are written: ``table [M, 9]`` int32 runs
    (:data:`RUN_FIELDS`: the first item of a run and its length; the other tile steps by one
    along a run) and ``row [R]`` int, the list's runs as rows of ``table``, ordered as the
    items (per call: by owned tile, FULL first, by other tile, by slice) and grouped by call
    (``run_bounds [cp + 1]``); ``per_rank [cp]`` items per call; ``order``, ``offsets`` as in
    the stacked :class:`WorkList`."""

    table: np.ndarray
    row: np.ndarray
    run_bounds: np.ndarray
    per_rank: np.ndarray
    order: np.ndarray
    offsets: np.ndarray

    @property
    def rows(self) -> np.ndarray:
        """The runs in list order, int32 ``[R, 9]``."""
        return np.take(self.table, self.row, axis=0)


def check_items(per_rank: np.ndarray, num_items: int, field: str = "items") -> None:
    """:func:`pad_work_list`'s :class:`~magi_jax.planning.errors.CapacityError` for the
    first call whose list holds more than ``num_items`` items."""
    over = np.nonzero(np.asarray(per_rank) > int(num_items))[0]
    if len(over):
        have = int(per_rank[over[0]])
        pad_work_list(
            WorkList(
                np.zeros(0, np.int32), np.zeros(1, np.int32), np.zeros((have, NUM_FIELDS), np.int32)
            ),
            num_items,
            field,
        )


def work_list_runs(
    shapes: SliceShapes,
    slice_rank: np.ndarray,
    cp: int,
    total_q: int,
    total_k: int,
    block_q: int,
    block_k: int,
    by: str,
) -> ListRuns:
    """The runs of :func:`build_work_lists` (its arguments; no items written yet)."""
    _check_blocks(block_q, block_k, by)
    bo, bx = (block_q, block_k) if by == "q" else (block_k, block_q)
    num = -(-(total_q if by == "q" else total_k) // bo)  # owned tiles per call
    n_other = -(-(total_k if by == "q" else total_q) // bx)
    slice_rank = np.asarray(slice_rank, np.int64)
    live = np.nonzero(shapes.nonempty)[0]
    if by == "k" and not _rows_nonempty(shapes, live):
        return _runs_fallback(shapes, slice_rank, cp, total_q, total_k, block_q, block_k, by)
    runs = slice_runs(shapes, live, slice_rank, total_k, block_q, block_k, by)
    # Items per (call, owned tile): each table row adds its length on each of its tiles.
    tile = runs.rank * num
    step = np.bincount(tile + runs.first, runs.length, cp * num + 1).astype(np.int64)
    step -= np.bincount(tile + runs.last + 1, runs.length, cp * num + 1).astype(np.int64)
    counts = np.cumsum(step[: cp * num]).reshape(cp, num)
    # Order: call, owned tile, FULL first, other tile, slice. Full runs of one tile never
    # share an other tile (slices are disjoint), masked runs rarely do: those that share one
    # with another run of their tile are cut into single items, so that sorting runs by their
    # first other tile orders every item.
    runs, row, run_bounds = order_runs(runs, cp, num, n_other)
    # One row per table run: the item its first tile gives (the other tile, the slice, the
    # kind) and its length.
    clip = lambda x: np.clip(x, -_I32.max, _I32.max)
    s = runs.slice
    table = np.empty((len(s), NUM_RUN_FIELDS), np.int32)
    table[:, 0] = runs.start
    for j, f in enumerate((shapes.q0, shapes.q1, shapes.k0, shapes.k1)):
        table[:, 1 + j] = f[s]
    table[:, 5] = clip(shapes.dlo[s])
    table[:, 6] = clip(shapes.dhi[s])
    table[:, 7] = runs.kind
    table[:, _LENGTH] = runs.length
    return _with_tiles(table, row, run_bounds, counts)


def _with_tiles(table, row, run_bounds, counts) -> ListRuns:
    cp, num = counts.shape
    per_rank = counts.sum(axis=1)
    if per_rank.max(initial=0) > _I32.max:
        raise ValueError(
            f"{int(per_rank.max())} work items do not fit int32 offsets; use a "
            "smaller problem per call (e.g. context parallelism)"
        )
    offsets = np.zeros((cp, num + 1), np.int64)
    np.cumsum(counts, axis=1, out=offsets[:, 1:])
    # Heaviest first; ties by tile index (per call).
    launch = np.lexsort(
        (np.tile(np.arange(num), cp), -counts.reshape(-1), np.repeat(np.arange(cp), num))
    ).reshape(cp, num) % max(num, 1)
    order, offsets = launch.astype(np.int32), offsets.astype(np.int32)
    return ListRuns(table, row, run_bounds, per_rank, order, offsets)


def emit_work_lists(runs: ListRuns, num_items: int | None = None) -> WorkList:
    """The stacked :class:`WorkList` of ``runs``, items padded to ``num_items`` (default:
    the longest call's; :func:`check_items` first when it may hold fewer)."""
    rows, run_bounds, per_rank = runs.rows, runs.run_bounds, runs.per_rank
    length = rows[:, _LENGTH].astype(np.int64)
    rows = rows[:, :NUM_FIELDS]
    cp = len(per_rank)
    width = int(per_rank.max(initial=0)) if num_items is None else int(num_items)
    items = np.empty((cp, width, NUM_FIELDS), np.int32)
    pad = _padding(width - int(per_rank.min(initial=width)))
    for r in range(cp):
        a, b = run_bounds[r], run_bounds[r + 1]
        n = int(per_rank[r])
        if n:
            # Every item of a run is its first row; the other tile then steps by one.
            dst = items[r, :n]
            lens = length[a:b]
            if n == b - a:
                dst[...] = rows[a:b]
            else:
                np.take(rows[a:b], np.repeat(np.arange(b - a), lens), axis=0, out=dst, mode="clip")
                first = rows[a:b, 0].astype(np.int64)
                step = np.ones(n, np.int32)
                step[0] = first[0]
                step[(np.cumsum(lens) - lens)[1:]] = np.diff(first) - (lens[:-1] - 1)
                np.cumsum(step, out=dst[:, 0])
        items[r, n:] = pad[: width - n]
    return WorkList(runs.order, runs.offsets, items)


def _padding(n: int, empty: np.ndarray = EMPTY_ITEM) -> np.ndarray:
    """``n`` rows ``empty`` (empty items, or runs), copied by doubling: memcpy speed."""
    pad = np.empty((max(n, 1), len(empty)), np.int32)
    pad[0] = empty
    k = 1
    while k < n:
        m = min(k, n - k)
        pad[k : k + m] = pad[:m]
        k += m
    return pad[:n]


def _rows_nonempty(sh: SliceShapes, live: np.ndarray) -> bool:
    """Whether every row of the live slices sees a key (canonical shapes: the k-tile lists
    enumerate the q-tiles of each (slice, k-tile) pair from it). ``hi - lo`` is concave in
    the row, so its two end rows decide."""
    if not len(live):
        return True
    first, last = sh.q0[live], sh.q1[live] - 1
    return bool(
        np.all(sh.lo(first, live) <= sh.hi(first, live))
        and np.all(sh.lo(last, live) <= sh.hi(last, live))
    )


def _runs_fallback(shapes, slice_rank, cp, total_q, total_k, block_q, block_k, by):
    """Runs of one item each, from the item-by-item lists of every call (shapes that are not
    canonical)."""
    bounds = np.searchsorted(slice_rank, np.arange(cp + 1))
    lists = []
    for r in range(cp):
        sl = slice(bounds[r], bounds[r + 1])
        sub = SliceShapes(*(getattr(shapes, f)[sl] for f in ("q0", "q1", "k0", "k1", "dlo", "dhi")))
        lists.append(_build_work_list_items(sub, total_q, total_k, block_q, block_k, by))
    items = np.concatenate([w.items for w in lists]).reshape(-1, NUM_FIELDS)
    rows = np.concatenate([items, np.ones((len(items), 1), np.int32)], axis=1)
    sizes = np.array([len(w.items) for w in lists], np.int64)
    run_bounds = np.concatenate([[0], np.cumsum(sizes)])
    counts = np.stack([np.diff(w.offsets.astype(np.int64)) for w in lists])
    return _with_tiles(rows, np.arange(len(rows)), run_bounds, counts)


def _build_work_list_items(
    shapes: SliceShapes, total_q: int, total_k: int, block_q: int, block_k: int, by: str
) -> WorkList:
    """:func:`build_work_list` item by item (from :func:`tiling.tile_items`)."""
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
        raise ValueError(
            f"{offsets[-1]} work items do not fit int32 offsets; use a smaller "
            "problem per call (e.g. context parallelism)"
        )
    clip = lambda x: np.clip(x, -_I32.max, _I32.max)
    # A boundary tile inside the slice's query and key ranges is cut only by the diagonals.
    q_tile, k_tile = (own, other) if by == "q" else (other, own)
    inside = (
        (shapes.q0[s] <= q_tile * block_q)
        & ((q_tile + 1) * block_q <= shapes.q1[s])
        & (shapes.k0[s] <= k_tile * block_k)
        & ((k_tile + 1) * block_k <= shapes.k1[s])
    )
    kind = np.where(full, FULL, np.where(inside, BAND, GENERAL))
    items = (
        np.stack(
            [
                other,
                shapes.q0[s],
                shapes.q1[s],
                shapes.k0[s],
                shapes.k1[s],
                clip(shapes.dlo[s]),
                clip(shapes.dhi[s]),
                kind,
            ],
            axis=-1,
        )
        .astype(np.int32)
        .reshape(-1, NUM_FIELDS)
    )
    # Heaviest first; ties by tile index so the order is deterministic.
    launch = np.lexsort((np.arange(num), -counts)).astype(np.int32)
    return WorkList(launch, offsets.astype(np.int32), items)


def count_runs(
    shapes: SliceShapes,
    total_q: int,
    total_k: int,
    xla_blocks: tuple[int, int] | None = None,
    slice_rank: np.ndarray | None = None,
    cp: int = 1,
) -> tuple[int, int]:
    """The most runs (:class:`FFAPlanRuns`) on a q-tile list and on a k-tile list of any
    call, over the tiles of every engine that reads work lists (the ``xla`` engine's:
    ``xla_blocks``, default its own): what
    :attr:`~magi_jax.planning.capacity.PlanCapacity.q_runs` and ``k_runs`` bound.
    ``shapes`` hold the slices of ``cp`` calls grouped by ``slice_rank`` (default: one
    call)."""
    rank = np.zeros(len(shapes.q0), np.int64) if slice_rank is None else slice_rank
    most = {"q": 0, "k": 0}
    for spec in HOST_SPECS.values():
        if not spec.work_lists:
            continue
        blocks = xla_blocks if spec.name == "xla" and xla_blocks is not None else (None, None)
        fwd, bwd = spec.blocks(total_q, total_k, *blocks)
        for block, by in ((fwd, "q"), (bwd, "k")):
            runs = work_list_runs(shapes, rank, cp, total_q, total_k, *block, by)
            most[by] = max(most[by], int(np.diff(runs.run_bounds).max(initial=0)))
    return most["q"], most["k"]


def build_plan_arrays(
    shapes: SliceShapes,
    total_q: int,
    total_k: int,
    fwd_block: tuple[int, int],
    bwd_block: tuple[int, int],
) -> FFAPlanArrays:
    """Both work lists of one call: the q-tile list on ``fwd_block`` tiles and the k-tile
    list on ``bwd_block`` tiles."""
    fwd = build_work_list(shapes, total_q, total_k, *fwd_block, "q")
    bwd = build_work_list(shapes, total_q, total_k, *bwd_block, "k")
    return FFAPlanArrays(*fwd, *bwd)


@cached(256)
def plan_for_mask(
    mask: AttnMask, backend: str, block_q: int | None = None, block_k: int | None = None
) -> FFAPlanArrays:
    """The exact-size work lists of ``mask`` for ``backend``, cached by the mask's
    fingerprint."""
    fwd_block, bwd_block = backend_blocks(backend, mask.total_q, mask.total_k, block_q, block_k)
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
        raise ValueError(
            f"plans cover different numbers of tiles (q {sorted(nq)}, k "
            f"{sorted(nk)}); every rank must hold the same local Tq and Tk"
        )
    wq = max(len(p.q_items) for p in plans)
    wk = max(len(p.k_items) for p in plans)
    padded = [p.pad_to(wq, wk) for p in plans]
    return FFAPlanArrays(*(np.stack(parts) for parts in zip(*padded)))


# What a unit costs a persistent program beyond its items, in items: the epilogue and the
# softmax tail that the next unit's prefetched loads do not hide.
UNIT_OVERHEAD_ITEMS = 1.0


def persistent_schedule(
    work: WorkList, groups: int, num_progs: int, overhead: float = UNIT_OVERHEAD_ITEMS
) -> tuple[np.ndarray, np.ndarray]:
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
    return _schedule(
        work.counts()[work.order].astype(np.float64).tobytes(), groups, num_progs, float(overhead)
    )


@cached(64)
def _schedule(costs_bytes: bytes, groups: int, num_progs: int, overhead: float):
    costs = np.frombuffer(costs_bytes, np.float64) + overhead
    n = len(costs)
    num_units = n * groups
    progs = min(num_progs, num_units)
    head = (groups - -(-groups // 4)) * n  # units before the last quarter of the groups
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
