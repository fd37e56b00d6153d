"""Any set of cells as row runs, on plain arrays: the algorithms behind masks from
predicates, dense and block-sparse boolean masks, and exact set algebra (docs/masks.md §7).

Everything here goes through one canonical form, :class:`RowRuns`: per query row, the
maximal runs of consecutive visible keys, stored once for a band of identical rows. Slices
become row runs with one run per FULL rectangle and one per row where a diagonal edge
moves (:func:`shape_runs`); a predicate or a dense mask becomes row runs block by block;
two masks combine run by run; and row runs become slices again by :func:`runs_to_slices`,
which chains the runs of consecutive rows whose edges stay put or move by one key per row
into FULL, CAUSAL, INV_CAUSAL and BI_CAUSAL slices. No step builds a ``total_q × total_k``
array. Results are :class:`Slices`, the arguments of :class:`magi_jax.masks.AttnMask`, which
wraps them (:mod:`magi_jax.masks._builders` gives the same on masks). Host-only NumPy; imports
only :mod:`magi_jax.masks.slices`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from magi_jax.masks.slices import AttnMaskType, SliceShapes

# Predicate blocks of (rows, keys): 4M cells, 4 MiB of bools per evaluation.
DEFAULT_BLOCK = (256, 16384)
_OPS = {
    "|": np.logical_or,
    "&": np.logical_and,
    "-": lambda a, b: a & ~b,
}


class RowRuns(NamedTuple):
    """A mask as runs of visible keys over bands of identical rows, int64 arrays of one
    length ``R``: run ``i`` is the keys ``[start[i], end[i])`` of every query row of
    ``[row[i], row[i] + height[i])``. The runs of one band share ``row`` and ``height``;
    bands hold disjoint rows. Canonical form (what every function here returns): sorted by
    ``(row, start)``; in one band runs are disjoint and never touch (``end < next start``);
    two bands on consecutive rows never hold the same runs (bands are maximal). It is unique
    for a set of cells, and a FULL rectangle costs one run whatever its height."""

    row: np.ndarray
    height: np.ndarray
    start: np.ndarray
    end: np.ndarray
    total_q: int
    total_k: int

    def __len__(self) -> int:
        return len(self.row)

    @property
    def area(self) -> int:
        """The number of cells the runs hold."""
        return int(((self.end - self.start) * self.height).sum())


class Slices(NamedTuple):
    """Slices as :class:`magi_jax.masks.AttnMask` takes them (``AttnMask(*slices)``):
    ``q_ranges`` and ``k_ranges`` int ``[N, 2]``, ``types`` int ``[N]`` (or one
    :class:`AttnMaskType` for all), and the totals."""

    q_ranges: np.ndarray
    k_ranges: np.ndarray
    types: np.ndarray | AttnMaskType | list[int]
    total_q: int
    total_k: int


def _check_total(name: str, value) -> int:
    """A token count: an int >= 0."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an integer number of tokens")
    if value < 0:
        raise ValueError(f"{name}={int(value)} must be >= 0 (a number of tokens)")
    return int(value)


def _no_cell(total_q: int, total_k: int) -> Slices:
    return Slices(np.zeros((0, 2)), np.zeros((0, 2)), [], total_q, total_k)


def _empty_runs(total_q: int, total_k: int) -> RowRuns:
    z = np.zeros((0,), np.int64)
    return RowRuns(z, z, z, z, total_q, total_k)


def _ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(which, value)``: every integer of every ``[lo[i], hi[i])``, with its ``i``."""
    n = np.maximum(hi - lo, 0)
    which = np.repeat(np.arange(len(lo)), n)
    value = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + lo[which]
    return which, value


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    # np.unique hashes int arrays in NumPy 2.5: ten times slower than a sort here.
    x = np.sort(x)
    return x[np.r_[True, x[1:] != x[:-1]]]


def _split(row, height, start, end, cuts: np.ndarray):
    """The runs cut at the rows ``cuts`` (sorted): every piece lies between two cuts."""
    first = np.searchsorted(cuts, row, side="right")
    last = np.searchsorted(cuts, row + height, side="left")  # cuts strictly inside
    pieces = np.maximum(last - first, 0) + 1
    if np.all(pieces == 1):
        return row, height, start, end
    i = np.repeat(np.arange(len(row)), pieces)
    k = np.arange(len(i)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    lo = np.where(k == 0, row[i], cuts[np.minimum(first[i] + k - 1, len(cuts) - 1)])
    hi = np.where(
        k == pieces[i] - 1, row[i] + height[i], cuts[np.minimum(first[i] + k, len(cuts) - 1)]
    )
    return lo, hi - lo, start[i], end[i]


def _normalised(row, height, start, end, total_q, total_k) -> RowRuns:
    """The canonical :class:`RowRuns` of disjoint runs given in any order over bands of any
    rows (bands of different runs may overlap in rows; cells never)."""
    row, height, start, end = (np.asarray(a, np.int64) for a in (row, height, start, end))
    keep = (end > start) & (height > 0)
    row, height, start, end = row[keep], height[keep], start[keep], end[keep]
    if not len(row):
        return _empty_runs(total_q, total_k)
    # 1. Cut every band at every band's first and last row: runs on the same rows then
    # share one band.
    if np.any(height > 1):
        cuts = _sorted_unique(np.concatenate([row, row + height]))
        row, height, start, end = _split(row, height, start, end, cuts)
    # 2. Sort by (row, start) (one int64 key; no sort when already in order) and merge
    # runs of one row that touch.
    key = row * (total_k + 1) + start
    if len(key) > 1 and np.any(key[1:] < key[:-1]):
        order = np.argsort(key, kind="stable")
        row, height, start, end = row[order], height[order], start[order], end[order]
    head = np.ones(len(row), bool)
    head[1:] = (row[1:] != row[:-1]) | (start[1:] != end[:-1])
    first = np.flatnonzero(head)
    last = np.r_[first[1:], len(row)] - 1
    row, height, start, end = row[first], height[first], start[first], end[last]
    # 3. Merge consecutive bands that hold the same runs.
    g0 = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])  # first run of each band
    count = np.diff(np.r_[g0, len(row)])
    g_row, g_h = row[g0], height[g0]
    adjacent = np.zeros(len(g0), bool)
    adjacent[1:] = (g_row[:-1] + g_h[:-1] == g_row[1:]) & (count[:-1] == count[1:])
    band = np.repeat(np.arange(len(g0)), count)
    shift = np.where(adjacent[band], count[band], 0)
    j = np.arange(len(row)) - shift
    same_run = adjacent[band] & (start[j] == start) & (end[j] == end)
    same = np.logical_and.reduceat(same_run, g0)
    if not same.any():
        return RowRuns(row, height, start, end, total_q, total_k)
    block = np.cumsum(~same) - 1  # merged band of each band
    block_h = np.add.reduceat(g_h, np.flatnonzero(~same))
    keep = ~same[band]
    height = block_h[block[band]]
    return RowRuns(row[keep], height[keep], start[keep], end[keep], total_q, total_k)


def shape_runs(sh: SliceShapes, total_q: int, total_k: int) -> RowRuns:
    """The canonical :class:`RowRuns` of the slices ``sh`` (a mask's canonical form) over
    ``total_q`` queries and ``total_k`` keys. Rows where a slice's edges are both
    clamped (all of a FULL slice, the bottom of a CAUSAL one) give one band per slice;
    the rows where an edge moves give a run each. Memory and time ``O(slices + rows where
    some edge moves)`` (times the slices on those rows)."""
    idx = np.flatnonzero(sh.nonempty)
    q0, q1, k0, k1 = sh.q0[idx], sh.q1[idx], sh.k0[idx], sh.k1[idx]
    # Rows where lo = k0 (q + dlo <= k0) and hi = k1 - 1 (q + dhi >= k1 - 1).
    a = np.clip(k1 - 1 - sh.dhi[idx], q0, q1)
    b = np.clip(k0 - sh.dlo[idx] + 1, q0, q1)
    band = b > a
    top_end = np.where(band, a, q1)
    bottom_start = np.where(band, b, q1)
    w1, r1 = _ranges(q0, top_end)
    w2, r2 = _ranges(bottom_start, q1)
    s = idx[np.concatenate([w1, w2])]
    q = np.concatenate([r1, r2])
    bi = idx[band]
    return _normalised(
        np.concatenate([q, a[band]]),
        np.concatenate([np.ones(len(q), np.int64), (b - a)[band]]),
        np.concatenate([sh.lo(q, s), sh.k0[bi]]),
        np.concatenate([sh.hi(q, s) + 1, sh.k1[bi]]),
        total_q,
        total_k,
    )


def _dense_runs(block: np.ndarray, row0: int, col0: int):
    """Runs ``(row, height, start, end)`` of a bool block ``[r, c]`` placed at
    ``(row0, col0)``, one per row and run (height 1)."""
    r = block.shape[0]
    pad = np.zeros((r, 1), bool)
    edges = np.concatenate([pad, block, pad], axis=1)
    rows, cols = np.nonzero(edges[:, 1:] != edges[:, :-1])
    # Per row the edges alternate start, end (the padding closes every run).
    return (
        rows[0::2] + row0,
        np.ones(len(rows) // 2, np.int64),
        cols[0::2] + col0,
        cols[1::2] + col0,
    )


def runs_to_slices(runs: RowRuns, diagonals: bool = True) -> Slices:
    """The slices of canonical ``runs``: exactly its cells, disjoint.

    A run continues the run of the band just above (ending on the row before) when its
    start moves by ``ds`` and its end by ``de`` keys, ``ds, de`` in ``{0, 1}`` (in one row
    runs never touch, so a run continues at most one run and is continued by at most one).
    A chain of runs with one ``(ds, de)`` is one slice: ``(0, 0)`` FULL, ``(0, 1)``
    CAUSAL, ``(1, 0)`` INV_CAUSAL, ``(1, 1)`` BI_CAUSAL (the type's value is
    ``2·ds + de``); a band of several rows steps ``(0, 0)`` inside, so it joins FULL chains
    only. Where a chain changes step, the run at the turn ends the earlier slice.
    ``diagonals=False`` chains only ``(0, 0)`` steps (FULL rectangles). Time
    ``O(R log R)`` for ``R`` runs."""
    tq, tk = runs.total_q, runs.total_k
    n = len(runs)
    if n == 0:
        return _no_cell(tq, tk)
    row, height, start, end = runs.row, runs.height, runs.start, runs.end
    band = np.cumsum(np.r_[True, row[1:] != row[:-1]]) - 1
    stride = tk + 2
    key = band * stride + start
    # The run of the band above that this run continues: it starts at start or start - 1.
    pred = np.full(n, -1, np.int64)
    step = np.full(n, -1, np.int64)
    for ds in (0, 1) if diagonals else (0,):
        want = (band - 1) * stride + start - ds
        j = np.minimum(np.searchsorted(key, want), n - 1)
        de = end - end[j]
        ok = (key[j] == want) & (band > 0) & (row[j] + height[j] == row)
        ok &= (de >= 0) & (de <= (1 if diagonals else 0))
        pred = np.where(ok, j, pred)
        step = np.where(ok, 2 * ds + de, step)
    # The step a run's chain already has: 0 inside a band of several rows, else the step
    # into it (-1: a one-row run that continues nothing, any step may follow).
    has_pred = pred >= 0
    own = np.where(height > 1, 0, step)
    p = np.where(has_pred, pred, 0)
    # A run opens a slice when it continues nothing, when it is a band entered by a
    # diagonal step, or when the step into it differs from the step its predecessor has.
    opens = ~has_pred | ((height > 1) & (step != 0)) | ((own[p] >= 0) & (own[p] != step))
    head = np.where(opens, np.arange(n), pred)
    while True:  # pointer jumping: every run to its slice's first run
        nxt = head[head]
        if np.array_equal(nxt, head):
            break
        head = nxt
    # A run that opens no slice is continued at most once, so each slice's last run is the
    # run with the largest index among its runs.
    last = np.full(n, -1, np.int64)
    np.maximum.at(last, head, np.arange(n))
    first = np.flatnonzero(opens)
    tail = last[first]
    types = np.where(tail > first, step[tail], int(AttnMaskType.FULL))
    q = np.stack([row[first], row[tail] + height[tail]], 1)
    k = np.stack([start[first], end[tail]], 1)
    return Slices(q, k, types, tq, tk)


def _block_shape(block) -> tuple[int, int]:
    if isinstance(block, (int, np.integer)) and not isinstance(block, bool):
        block = (int(block), int(block))
    try:
        bq, bk = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(
            f"block={block!r} must be an int or a (rows, keys) pair of positive ints"
        ) from None
    if bq < 1 or bk < 1:
        raise ValueError(f"block={block!r} must be positive (rows, keys)")
    return bq, bk


def slices_from_fn(
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
    total_q: int,
    total_k: int,
    *,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    blocks: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    check_blocks: bool = False,
) -> Slices:
    """The slices of the mask whose cell ``(q, k)`` is ``fn(q, k)``, for a vectorised
    NumPy predicate.

    ``fn`` receives int64 ``q_idx [bq, 1]`` and ``k_idx [1, bk]`` (absolute token
    positions of one block; the last blocks clipped to the totals) and returns a bool
    array broadcastable to ``[bq, bk]`` (FlexAttention's ``mask_mod``, in NumPy). It is
    evaluated block by block, so memory is bounded by the block and by the row runs, never
    by ``total_q · total_k``. Time is one predicate cell per mask cell (tens of millions
    of cells a second on one CPU core), unless ``blocks`` says where the cells are:

    ``blocks(qb, kb)`` (int64 block indices, called once per row of blocks: ``qb [1, 1]``,
    ``kb [1, nk]``) returns int codes broadcastable to ``[1, nk]``, one per block of
    ``block``: 0 the block holds no cell,
    1 every cell, 2 evaluate ``fn`` (FlexAttention's full / partial blocks). Only blocks
    coded 2 are evaluated. The codes are trusted; ``check_blocks=True`` evaluates ``fn`` on
    every block as well and raises ``ValueError`` at the first block whose code is wrong
    (for tests)."""
    tq, tk = _check_total("total_q", total_q), _check_total("total_k", total_k)
    bq, bk = _block_shape(block)
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be a callable fn(q_idx, k_idx) -> bool array")
    nq, nk = -(-tq // bq), -(-tk // bk)
    if blocks is not None and not callable(blocks):
        raise TypeError(f"blocks={blocks!r} must be a callable blocks(qb, kb) -> int codes")
    parts = []
    for r in range(nq):
        r0, r1 = r * bq, min((r + 1) * bq, tq)
        q_idx = np.arange(r0, r1, dtype=np.int64)[:, None]
        if blocks is None:
            spans = [(0, nk)]
        else:
            row_codes = _block_codes(blocks, r, nk)
            if check_blocks:
                _check_codes(fn, q_idx, row_codes, bk, tk, r)
            full = _spans(row_codes == 1)
            spans = _spans(row_codes == 2)
            if len(full):  # full blocks: one band per span, no cell evaluated
                parts.append(
                    (
                        np.full(len(full), r0),
                        np.full(len(full), r1 - r0),
                        full[:, 0] * bk,
                        np.minimum(full[:, 1] * bk, tk),
                    )
                )
        for b0, b1 in spans:
            for b in range(int(b0), int(b1)):  # one block at a time: memory bounded
                c0, c1 = b * bk, min((b + 1) * bk, tk)
                cells = _evaluate(fn, q_idx, c0, c1)
                if cells.any():
                    parts.append(_dense_runs(cells, r0, c0))
    return runs_to_slices(_concat(parts, tq, tk))


def _evaluate(fn, q_idx: np.ndarray, c0: int, c1: int) -> np.ndarray:
    k_idx = np.arange(c0, c1, dtype=np.int64)[None, :]
    shape = (len(q_idx), c1 - c0)
    cells = np.asarray(fn(q_idx, k_idx))
    if cells.dtype != np.bool_:
        raise TypeError(
            f"fn(q_idx, k_idx) returned dtype {cells.dtype}; the predicate must "
            "return a bool array (compare, or cast with .astype(bool))"
        )
    try:
        return np.broadcast_to(cells, shape)
    except ValueError:
        raise ValueError(
            f"fn(q_idx [{shape[0]}, 1], k_idx [1, {shape[1]}]) returned shape {cells.shape}, "
            f"not broadcastable to [{shape[0]}, {shape[1]}]; use elementwise NumPy "
            "operations on q_idx and k_idx"
        ) from None


def _block_codes(blocks, r: int, nk: int) -> np.ndarray:
    """The codes of row ``r`` of blocks, int ``[nk]``, checked."""
    qb = np.full((1, 1), r, dtype=np.int64)
    kb = np.arange(nk, dtype=np.int64)[None, :]
    codes = np.asarray(blocks(qb, kb))
    if not (np.issubdtype(codes.dtype, np.integer) or codes.dtype == np.bool_):
        raise TypeError(f"blocks(qb, kb) returned dtype {codes.dtype}; give int codes 0, 1, 2")
    try:
        codes = np.broadcast_to(codes, (1, nk))[0]
    except ValueError:
        raise ValueError(
            f"blocks(qb [1, 1], kb [1, {nk}]) returned shape {codes.shape}, not "
            f"broadcastable to [1, {nk}]"
        ) from None
    bad = (codes < 0) | (codes > 2)
    if bad.any():
        j = int(np.argmax(bad))
        raise ValueError(
            f"blocks(qb, kb) gave code {int(codes[j])} for block ({r}, {j}); codes are "
            "0 (no cell), 1 (every cell) or 2 (evaluate fn)"
        )
    return codes


def _check_codes(fn, q_idx, row_codes, bk: int, tk: int, r: int) -> None:
    cells = _evaluate(fn, q_idx, 0, tk)
    for j, code in enumerate(row_codes.tolist()):
        if code == 2:
            continue
        blk = cells[:, j * bk : min((j + 1) * bk, tk)]
        if (code == 1 and not blk.all()) or (code == 0 and blk.any()):
            raise ValueError(
                f"blocks(qb, kb) coded block ({r}, {j}) as {code} "
                f"({'every cell' if code else 'no cell'}) but fn holds "
                f"{int(blk.sum())} of its {blk.size} cells; code it 2 (evaluate fn)"
            )


def _spans(flags: np.ndarray) -> np.ndarray:
    """``[n, 2]`` half-open spans of consecutive True in a 1-D bool array."""
    edges = np.flatnonzero(np.diff(np.r_[False, flags, False].astype(np.int8)))
    return edges.reshape(-1, 2)


def _concat(parts, tq, tk) -> RowRuns:
    if not parts:
        return _empty_runs(tq, tk)
    return _normalised(*(np.concatenate([p[i] for p in parts]) for i in range(4)), tq, tk)


def slices_from_dense(dense: np.ndarray) -> Slices:
    """The slices of a bool array ``[total_q, total_k]`` (True = attend), as slices. For
    masks that fit in memory; :func:`slices_from_fn` builds larger ones block by block."""
    arr = np.asarray(dense)
    if arr.ndim != 2:
        raise ValueError(
            f"dense must be a 2-D bool array [total_q, total_k]; got shape {arr.shape}"
        )
    if arr.dtype != np.bool_:
        raise TypeError(
            f"dense must be a bool array (True = attend); got dtype {arr.dtype} — compare "
            "or cast it (dense.astype(bool)) first"
        )
    tq, tk = arr.shape
    return runs_to_slices(_concat([_dense_runs(arr, 0, 0)], tq, tk))


def slices_from_block_mask(
    block_mask: np.ndarray,
    block_q: int,
    block_k: int,
    total_q: int | None = None,
    total_k: int | None = None,
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> Slices:
    """The slices of the mask of a block-sparse bool ``block_mask [ceil(total_q / block_q),
    ceil(total_k / block_k)]``: block ``(i, j)`` True means every query of
    ``[i·block_q, (i+1)·block_q)`` sees every key of ``[j·block_k, (j+1)·block_k)`` (the
    last block of each axis clipped to ``total_q`` / ``total_k``, which default to the
    blocks' full extent). This is the form of FlexAttention's ``BlockMask`` and of splash
    attention's block masks with only full blocks. Blocks are FULL rectangles, merged
    along keys and then along queries where the runs of consecutive block rows agree;
    no cell is evaluated (time ``O(blocks)``).

    With a predicate ``fn`` (as :func:`slices_from_fn` takes it), ``block_mask`` holds int
    codes instead: 0 no cell, 1 every cell, 2 a partial block whose cells are ``fn``'s
    (FlexAttention's full and partial blocks); only partial blocks are evaluated."""
    arr = np.asarray(block_mask)
    if arr.ndim != 2:
        raise ValueError(
            f"block_mask must be a 2-D array [query blocks, key blocks]; got shape {arr.shape}"
        )
    if fn is not None:
        if not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
            raise TypeError(
                f"block_mask with fn must hold int codes 0, 1, 2; got dtype {arr.dtype}"
            )
    elif arr.dtype != np.bool_:
        raise TypeError(
            f"block_mask must be a bool array; got dtype {arr.dtype} (int codes 0, 1, 2 "
            "need the partial blocks' predicate fn)"
        )
    bq, bk = _check_total("block_q", block_q), _check_total("block_k", block_k)
    if bq < 1 or bk < 1:
        raise ValueError(f"block_q={bq}, block_k={bk} must be positive")
    nq, nk = arr.shape
    tq = nq * bq if total_q is None else _check_total("total_q", total_q)
    tk = nk * bk if total_k is None else _check_total("total_k", total_k)
    for name, n, t, b in (("total_q", nq, tq, bq), ("total_k", nk, tk, bk)):
        if -(-t // b) != n:
            raise ValueError(
                f"{name}={t} needs {-(-t // b)} blocks of {b} but block_mask has {n} along "
                f"that axis; give a block_mask of shape [ceil(total_q / block_q), "
                f"ceil(total_k / block_k)]"
            )
    if fn is not None:
        return slices_from_fn(fn, tq, tk, block=(bq, bk), blocks=lambda qb, kb: arr[qb, kb])
    blocks = runs_to_slices(_concat([_dense_runs(arr, 0, 0)], nq, nk), diagonals=False)
    q = np.minimum(blocks.q_ranges.astype(np.int64) * bq, tq)
    k = np.minimum(blocks.k_ranges.astype(np.int64) * bk, tk)
    return Slices(q, k, AttnMaskType.FULL, tq, tk)


def combine_runs(ra: RowRuns, rb: RowRuns, op: str) -> Slices:
    """The slices of ``ra | rb`` (union), ``ra & rb`` (intersection) or ``ra - rb``
    (difference), exactly, for the canonical row runs of two masks over the same
    ``total_q`` and ``total_k``. Time ``O(R log R)`` for ``R`` runs, never per cell."""
    if op not in _OPS:
        raise ValueError(f"op={op!r} must be one of {list(_OPS)}")
    if (ra.total_q, ra.total_k) != (rb.total_q, rb.total_k):
        raise ValueError(
            f"mask {op} mask needs masks over the same tokens; got total_q={ra.total_q}, "
            f"total_k={ra.total_k} and total_q={rb.total_q}, total_k={rb.total_k} — build both "
            "over one (total_q, total_k)"
        )
    tq, tk = ra.total_q, ra.total_k
    if not len(ra) and not len(rb):
        return _no_cell(tq, tk)
    # Bands of both cut at every band's first and last row: band e of the common cut is
    # the rows [cuts[e], cuts[e + 1]), and the sweep runs over (band, key) pairs.
    cuts = _sorted_unique(np.concatenate([ra.row, ra.row + ra.height, rb.row, rb.row + rb.height]))
    ra_row, _, ra_start, ra_end = _split(ra.row, ra.height, ra.start, ra.end, cuts)
    rb_row, _, rb_start, rb_end = _split(rb.row, rb.height, rb.start, rb.end, cuts)
    ea, eb = np.searchsorted(cuts, ra_row), np.searchsorted(cuts, rb_row)
    stride = tk + 1
    keys = np.concatenate(
        [ea * stride + ra_start, ea * stride + ra_end, eb * stride + rb_start, eb * stride + rb_end]
    )
    na, nb = len(ea), len(eb)
    da = np.concatenate([np.ones(na), -np.ones(na), np.zeros(2 * nb)]).astype(np.int8)
    db = np.concatenate([np.zeros(2 * na), np.ones(nb), -np.ones(nb)]).astype(np.int8)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    # Coverage after every event of one key; between consecutive keys it is constant, and
    # at a band's last key both coverages are back to 0 (a segment never spans bands).
    last = np.r_[keys[1:] != keys[:-1], True]
    in_a = np.cumsum(da[order], dtype=np.int64)[last] > 0
    in_b = np.cumsum(db[order], dtype=np.int64)[last] > 0
    at = keys[last]
    keep = _OPS[op](in_a[:-1], in_b[:-1])
    seg_start, seg_end = at[:-1][keep], at[1:][keep]
    e = seg_start // stride
    return runs_to_slices(
        _normalised(
            cuts[e], cuts[e + 1] - cuts[e], seg_start - e * stride, seg_end - e * stride, tq, tk
        )
    )
