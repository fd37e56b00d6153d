"""Runs of work items: which other tiles each (slice, owned tile) pair's items cover, cut
where the mask kind changes, ordered as the work lists hold them (host NumPy, no JAX).

:mod:`magi_jax.planning.work_list` builds its lists from these runs. A slice's pairs on a
steady stretch of owned tiles all cut into the same runs, and the owned tiles fall into
segments on which the same runs run, so the work follows the slices and segments, not the
runs: a causal key of 1M tokens on 64 ranks lists 3M runs on one stage's k-tile lists.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from magi_jax.masks import SliceShapes
from magi_jax.planning.intervals import ranges_incl, ranges_repeat
from magi_jax.planning.tiling import BAND, FULL, GENERAL

__all__ = ["ItemRuns", "slice_runs", "steady_tiles", "pair_bounds", "pair_runs", "order_runs"]

_I32_MAX = np.iinfo(np.int32).max


def _ceil_div(a, b):
    return -((-a) // b)


class ItemRuns(NamedTuple):
    """A table of runs of items: row ``i`` is a run of ``length[i]`` other tiles from
    ``start[i]``, of mask kind ``kind[i]``, in slice ``slice[i]`` of call ``rank[i]``, on
    each owned tile of ``[first[i], last[i]]`` (int64 ``[M]`` each): a pair's run on one
    tile, or the run of every pair of a steady stretch (:func:`steady_tiles`)."""

    rank: np.ndarray
    start: np.ndarray
    length: np.ndarray
    kind: np.ndarray
    slice: np.ndarray
    first: np.ndarray
    last: np.ndarray


def slice_runs(
    sh: SliceShapes,
    live: np.ndarray,
    slice_rank: np.ndarray,
    total_k: int,
    bq: int,
    bk: int,
    by: str,
) -> ItemRuns:
    """Runs of items on tiles ``bq x bk`` owned by q-tiles (``by="q"``) or k-tiles
    (``by="k"``): every (slice, owned tile) pair of the slices ``live`` (those with cells;
    ``slice_rank``: each slice's call), its other tiles cut where the mask kind changes
    (:func:`pair_runs`). Pairs of a slice's steady stretch (:func:`steady_tiles`) all have
    the runs of its first tile: those are cut once and stand for the whole stretch; the
    other pairs are cut one by one."""
    if by == "q":
        first, last = sh.q0[live] // bq, (sh.q1[live] - 1) // bq
    else:
        first, last = sh.lo(sh.q0[live], live) // bk, sh.hi(sh.q1[live] - 1, live) // bk
    sa, sb, steady = steady_tiles(sh, live, first, last, total_k, bq, bk, by)
    # The pairs outside the steady stretches, one by one.
    owner, own = ranges_repeat(
        np.concatenate([first, sb[steady] + 1]),
        np.concatenate([np.where(steady, sa, last + 1), last[steady] + 1]),
    )
    s = np.concatenate([live, live[steady]])[owner]
    pair, start, length, kind = pair_runs(sh, s, own, total_k, bq, bk, by)
    # The runs of each steady stretch's first tile, for every tile of the stretch.
    ls, sa, sb = live[steady], sa[steady], sb[steady]
    t_pair, t_start, t_length, t_kind = pair_runs(sh, ls, sa, total_k, bq, bk, by)
    table_slice = np.concatenate([s[pair], ls[t_pair]])
    return ItemRuns(
        rank=slice_rank[table_slice],
        start=np.concatenate([start, t_start]),
        length=np.concatenate([length, t_length]),
        kind=np.concatenate([kind, t_kind]),
        slice=table_slice,
        first=np.concatenate([own[pair], sa[t_pair]]),
        last=np.concatenate([own[pair], sb[t_pair]]),
    )


def steady_tiles(
    sh: SliceShapes,
    live: np.ndarray,
    first: np.ndarray,
    last: np.ndarray,
    total_k: int,
    bq: int,
    bk: int,
    by: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per live slice (owned tiles ``[first, last]``), a stretch ``[sa, sb]`` of owned tiles
    whose pairs all cut into the same runs, and ``steady`` (bool): whether it holds one.

    On the stretch every bound of :func:`pair_bounds` takes the slice's own edge rather
    than a diagonal, and FULL items are allowed. For q-tiles: the tile's rows lie in the
    slice's, its first row's last key is the slice's last (``t0 + dhi >= k1 - 1``) and its
    last row's first key the slice's first (``t0 + bq - 1 + dlo <= k0``). For k-tiles: the
    tile lies in the slice's keys (so in the sequence), its last column is seen by the
    slice's first row (``c1 - dhi <= q0``) and its first column by the slice's last row
    (``c0 - dlo >= q1 - 1``). Each is a bound on the tile index."""
    q0, q1, k0, k1, dlo, dhi = (f[live] for f in (sh.q0, sh.q1, sh.k0, sh.k1, sh.dlo, sh.dhi))
    if by == "q":
        sa = np.maximum(np.maximum(first, _ceil_div(q0, bq)), _ceil_div(k1 - 1 - dhi, bq))
        sb = np.minimum(np.minimum(last, (q1 - bq) // bq), (k0 - dlo - bq + 1) // bq)
    else:
        sa = np.maximum(np.maximum(first, _ceil_div(k0, bk)), _ceil_div(q1 - 1 + dlo, bk))
        sb = np.minimum(np.minimum(last, (k1 - bk) // bk), (q0 + dhi - bk + 1) // bk)
    return sa, sb, sa <= sb


def pair_bounds(
    sh: SliceShapes, s: np.ndarray, own: np.ndarray, total_k: int, bq: int, bk: int, by: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of every (slice ``s``, owned tile ``own``) pair: the other tiles ``[oa, ob)`` with
    cells, the FULL ones ``[fa, fb)``, those inside the slice's row and key ranges ``[ia,
    ib)`` (int64 ``[n, 6]``: ``oa, fa, fb, ia, ib, ob``, the inner ones clipped into
    ``[oa, ob]``); whether the owned tile lies inside the slice's (row or key) range and
    whether FULL items are allowed (it also lies inside the sequence), bool ``[n]`` each.

    An item (slice, q-tile, k-tile) holds a cell when the tile's rows see a key of its
    columns (:func:`magi_jax.planning.tiling.tile_items`); it is FULL when the q-tile's rows
    lie in the slice's, the last row's first key is at most the tile's first column and the
    first row's last key at least its last column (inside the sequence); BAND when the tile
    lies inside the slice's row and key ranges
    (:func:`magi_jax.planning.work_list.build_work_list`). Along the other
    tile each of these holds on one interval."""
    q0, q1, k0, k1, dlo, dhi = (f[s] for f in (sh.q0, sh.q1, sh.k0, sh.k1, sh.dlo, sh.dhi))
    if by == "q":
        lo = lambda r: np.maximum(k0, r + dlo)
        hi = lambda r: np.minimum(k1 - 1, r + dhi)
        t0 = own * bq
        oa = lo(np.maximum(q0, t0)) // bk
        ob = hi(np.minimum(q1, t0 + bq) - 1) // bk + 1
        own_in = (q0 <= t0) & (t0 + bq <= q1)
        fa = _ceil_div(lo(t0 + bq - 1), bk)
        fb = (np.minimum(hi(t0), total_k - 1) + 1) // bk
        full_ok = own_in
        ia, ib = _ceil_div(k0, bk), k1 // bk
    else:
        c0 = own * bk
        c1 = c0 + bk - 1
        # Rows that see a column of the k-tile: hi(r) >= c0 and lo(r) <= c1.
        oa = np.maximum(q0, c0 - dhi) // bq
        ob = np.minimum(q1 - 1, c1 - dlo) // bq + 1
        own_in = (k0 <= c0) & (c0 + bk <= k1)
        full_ok = own_in & (c1 < total_k)
        fa = np.maximum(_ceil_div(q0, bq), _ceil_div(c1 - dhi, bq))
        fb = np.minimum(q1 // bq, (c0 - dlo + 1) // bq)
        ia, ib = _ceil_div(q0, bq), q1 // bq
    ob = np.maximum(ob, oa)  # rows that see no key (shapes not canonical)
    fa = np.where(full_ok, np.clip(fa, oa, ob), oa)
    fb = np.where(full_ok, np.clip(fb, oa, ob), oa)
    fb = np.maximum(fa, fb)
    ia, ib = np.clip(ia, oa, ob), np.clip(ib, oa, ob)
    return np.stack([oa, fa, fb, ia, ib, ob], axis=1), own_in, full_ok


def pair_runs(
    sh: SliceShapes, s: np.ndarray, own: np.ndarray, total_k: int, bq: int, bk: int, by: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The runs of every (slice ``s``, owned tile ``own``) pair: its other tiles with cells
    cut where the mask kind changes (at most five runs). Int64 arrays ``(pair, start,
    length, kind)``, runs in pair order, then in tile order."""
    b, own_in, _ = pair_bounds(sh, s, own, total_k, bq, bk, by)
    fa, fb, ia, ib = b[:, 1], b[:, 2], b[:, 3], b[:, 4]
    bounds = np.sort(b, axis=1)
    start, stop = bounds[:, :-1], bounds[:, 1:]
    keep = stop > start
    pair = np.broadcast_to(np.arange(len(s))[:, None], keep.shape)[keep]
    start, length = start[keep], (stop - start)[keep]
    full = (start >= fa[pair]) & (start < fb[pair])
    inside = own_in[pair] & (start >= ia[pair]) & (start < ib[pair])
    kind = np.where(full, FULL, np.where(inside, BAND, GENERAL)).astype(np.int64)
    return pair, start, length, kind


def order_runs(
    runs: ItemRuns, cp: int, num: int, n_other: int
) -> tuple[ItemRuns, np.ndarray, np.ndarray]:
    """Every run of the table on each of its owned tiles, in list order (per call and owned
    tile: FULL first, then by other tile and slice): ``(runs, row, run_bounds)``, the list's
    runs as rows ``row [R]`` (int64) of the table ``runs`` returned, grouped by call
    (``run_bounds [cp + 1]``). Runs that share an other tile with an earlier run of their
    (call, tile, FULL or not) group are first cut into single items (new rows of the
    table), as are those they share it with.

    The table's tile ranges cut the owned tiles (numbered over all calls) into segments on
    which the same rows run, so a segment's runs are ordered (and cut) once, as a list, and
    that list is the segment's runs on each of its tiles."""
    masked = (runs.kind != FULL).astype(np.int64)
    o = np.lexsort((runs.slice, runs.start, masked, runs.rank))  # a tile's order
    runs, masked = ItemRuns(*(x[o] for x in runs)), masked[o]
    lo = runs.rank * num + runs.first
    hi = runs.rank * num + runs.last + 1
    edges = np.unique(np.concatenate([lo, hi]))
    # (row, segment) pairs: each row on every segment of its tiles, then by segment (rows
    # stay in a tile's order).
    pair, seg = ranges_repeat(np.searchsorted(edges, lo), np.searchsorted(edges, hi))
    o = np.argsort(seg, kind="stable")
    pair, seg = pair[o], seg[o]
    if len(pair) > 1:
        # A run shares a tile when it starts before an earlier run of its (segment, FULL or
        # not) group ends; the places of different groups never meet.
        span = 2 * n_other
        place = seg * span + (masked * n_other + runs.start)[pair]
        reach = np.maximum.accumulate(place + (runs.length - 1)[pair])
        shared = np.zeros(len(pair), bool)
        shared[1:] = place[1:] <= reach[:-1]
        if shared.any():
            runs, pair, seg = _cut_shared(runs, masked, pair, seg, shared)
    # Each segment's list on every tile of the segment (indices into ``pair``; int32 where
    # they fit: the lists' rows are the plan's largest temporaries).
    size = np.bincount(seg, minlength=max(len(edges) - 1, 0))
    width = np.diff(edges)
    tile_size = np.repeat(size, width)
    tile_first = np.repeat(np.cumsum(size) - size, width)
    total = int(tile_size.sum())
    dtype = np.int32 if max(total, len(pair)) <= _I32_MAX else np.int64
    idx = np.arange(total, dtype=dtype)
    idx += np.repeat((tile_first - (np.cumsum(tile_size) - tile_size)).astype(dtype), tile_size)
    per_call = np.bincount(np.repeat(edges[:-1] // max(num, 1), width), tile_size, cp)
    run_bounds = np.concatenate([[0], np.cumsum(per_call[:cp].astype(np.int64))])
    return runs, pair.astype(dtype)[idx], run_bounds


def _cut_shared(runs: ItemRuns, masked, pair, seg, shared):
    """The (row, segment) pairs with the runs in clusters of ``shared`` cut into single
    items (new rows of the table), reordered by (segment, FULL first, other tile, slice)."""
    cluster = np.cumsum(~shared)
    cut = np.bincount(cluster)[cluster] > 1
    i, step = ranges_incl(np.zeros(int(cut.sum()), np.int64), runs.length[pair[cut]] - 1)
    idx = np.nonzero(cut)[0][i]
    piece = pair[idx]  # each item's run
    m = len(runs.rank)
    runs = ItemRuns(
        rank=np.concatenate([runs.rank, runs.rank[piece]]),
        start=np.concatenate([runs.start, runs.start[piece] + step]),
        length=np.concatenate([runs.length, np.ones(len(idx), np.int64)]),
        kind=np.concatenate([runs.kind, runs.kind[piece]]),
        slice=np.concatenate([runs.slice, runs.slice[piece]]),
        first=np.concatenate([runs.first, runs.first[piece]]),
        last=np.concatenate([runs.last, runs.last[piece]]),
    )
    masked = np.concatenate([masked, masked[piece]])
    pair = np.concatenate([pair[~cut], m + np.arange(len(idx))])
    seg = np.concatenate([seg[~cut], seg[idx]])
    o = np.lexsort((runs.slice[pair], runs.start[pair], masked[pair], seg))
    return runs, pair[o], seg[o]
