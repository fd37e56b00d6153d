"""Any mask as slices: masks from predicates, dense and block-sparse boolean masks, and
exact set algebra (docs/masks.md §7).

Everything here goes through one canonical form, :class:`RowRuns`: per query row, the
maximal runs of consecutive visible keys. A mask of slices becomes row runs in
``O(rows · slices per row)``; a predicate or a dense mask becomes row runs block by block;
two masks combine run by run; and row runs become slices again by :func:`runs_to_mask`,
which chains the runs of consecutive rows whose edges stay put or move by one key per row
into FULL, CAUSAL, INV_CAUSAL and BI_CAUSAL slices. No step builds a ``total_q × total_k``
array. Host-only NumPy; imports only :mod:`magi_jax.mask`.

>>> m = mask_from_fn(lambda q, k: k <= q, 6, 6)   # a causal predicate: one CAUSAL slice
>>> m.slices()
[((0, 6), (0, 6), <AttnMaskType.CAUSAL: 1>)]
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from magi_jax.mask import AttnMask, AttnMaskType, _check_total

__all__ = [
    "RowRuns",
    "row_runs",
    "runs_to_mask",
    "mask_from_fn",
    "mask_from_dense",
    "mask_from_block_mask",
    "combine",
    "canonical",
    "DEFAULT_BLOCK",
]

# Predicate blocks of (rows, keys): 4M cells, 4 MiB of bools per evaluation.
DEFAULT_BLOCK = (256, 16384)
_OPS = {
    "|": np.logical_or,
    "&": np.logical_and,
    "-": lambda a, b: a & ~b,
}


class RowRuns(NamedTuple):
    """A mask as runs of visible keys, int64 arrays of one length ``R``: run ``i`` is the
    keys ``[start[i], end[i])`` of query row ``row[i]``. Sorted by ``(row, start)``; in one
    row the runs are disjoint and never touch (``end < next start``), so the form is unique
    for a set of cells."""

    row: np.ndarray
    start: np.ndarray
    end: np.ndarray
    total_q: int
    total_k: int

    def __len__(self) -> int:
        return len(self.row)

    @property
    def area(self) -> int:
        return int((self.end - self.start).sum())


def _empty_runs(total_q: int, total_k: int) -> RowRuns:
    z = np.zeros((0,), np.int64)
    return RowRuns(z, z, z, total_q, total_k)


def _normalised(row, start, end, total_q, total_k) -> RowRuns:
    """Row runs from disjoint runs in any order: sorted, touching runs merged."""
    row, start, end = (np.asarray(a, np.int64) for a in (row, start, end))
    keep = end > start
    row, start, end = row[keep], start[keep], end[keep]
    if not len(row):
        return _empty_runs(total_q, total_k)
    key = row * (total_k + 1) + start  # (row, start) in one int64: one sort, or none
    if len(key) > 1 and np.any(key[1:] < key[:-1]):
        order = np.argsort(key, kind="stable")
        row, start, end = row[order], start[order], end[order]
    head = np.ones(len(row), bool)
    head[1:] = (row[1:] != row[:-1]) | (start[1:] != end[:-1])
    first = np.flatnonzero(head)
    last = np.r_[first[1:], len(row)] - 1
    return RowRuns(row[first], start[first], end[last], total_q, total_k)


def row_runs(mask: AttnMask) -> RowRuns:
    """The :class:`RowRuns` of ``mask``: one run per (slice, row it holds), merged where runs
    of one row touch. Memory and time ``O(sum over slices of their rows)``."""
    sh = mask.shapes
    idx = np.flatnonzero(sh.nonempty)
    rows_per = (sh.q1 - sh.q0)[idx]
    s = np.repeat(idx, rows_per)
    offsets = np.arange(int(rows_per.sum())) - np.repeat(np.cumsum(rows_per) - rows_per, rows_per)
    q = sh.q0[s] + offsets
    return _normalised(q, sh.lo(q, s), sh.hi(q, s) + 1, mask.total_q, mask.total_k)


def _dense_runs(block: np.ndarray, row0: int, col0: int):
    """Runs ``(row, start, end)`` of a bool block ``[r, c]`` placed at ``(row0, col0)``."""
    r = block.shape[0]
    pad = np.zeros((r, 1), bool)
    edges = np.concatenate([pad, block, pad], axis=1)
    rows, cols = np.nonzero(edges[:, 1:] != edges[:, :-1])
    # Per row the edges alternate start, end (the padding closes every run).
    return rows[0::2] + row0, cols[0::2] + col0, cols[1::2] + col0


def runs_to_mask(runs: RowRuns, diagonals: bool = True) -> AttnMask:
    """The slices of ``runs``: exactly its cells, disjoint.

    A run continues the run of the row above when its start moves by ``ds`` and its end by
    ``de`` keys, ``ds, de`` in ``{0, 1}`` (in one row runs never touch, so a run continues at
    most one run and is continued by at most one). A chain of runs with one ``(ds, de)`` is
    one slice: ``(0, 0)`` FULL, ``(0, 1)`` CAUSAL, ``(1, 0)`` INV_CAUSAL, ``(1, 1)``
    BI_CAUSAL (the type's value is ``2·ds + de``). Where a chain changes step, the run at
    the turn ends the earlier slice. ``diagonals=False`` chains only ``(0, 0)`` steps (FULL
    rectangles). Time ``O(R log R)`` for ``R`` runs."""
    tq, tk = runs.total_q, runs.total_k
    n = len(runs)
    if n == 0:
        return AttnMask._from_list([], tq, tk)
    row, start, end = runs.row, runs.start, runs.end
    stride = tk + 2
    key = row * stride + start
    # The run of the row above that this run continues: it starts at start or start - 1.
    pred = np.full(n, -1, np.int64)
    step = np.full(n, -1, np.int64)
    for ds in (0, 1) if diagonals else (0,):
        want = (row - 1) * stride + start - ds
        j = np.minimum(np.searchsorted(key, want), n - 1)
        de = end - end[j]
        ok = (key[j] == want) & (row > 0) & (de >= 0) & (de <= (1 if diagonals else 0))
        pred = np.where(ok, j, pred)
        step = np.where(ok, 2 * ds + de, step)
    # A run opens a slice when it continues nothing, or when the run it continues was
    # itself reached by another step (that run ends the earlier slice).
    has_pred = pred >= 0
    p = np.where(has_pred, pred, 0)
    opens = ~has_pred | ((pred[p] >= 0) & (step[p] != step) & has_pred)
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
    q = np.stack([row[first], row[tail] + 1], 1)
    k = np.stack([start[first], end[tail]], 1)
    return AttnMask(q, k, types, tq, tk)


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


def mask_from_fn(
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
    total_q: int,
    total_k: int,
    *,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    blocks: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    check_blocks: bool = False,
) -> AttnMask:
    """The mask whose cell ``(q, k)`` is ``fn(q, k)``, for a vectorised NumPy predicate.

    ``fn`` receives int64 ``q_idx [bq, 1]`` and ``k_idx [1, bk]`` (absolute token
    positions of one block; the last blocks clipped to the totals) and returns a bool
    array broadcastable to ``[bq, bk]`` (FlexAttention's ``mask_mod``, in NumPy). It is
    evaluated block by block, so memory is bounded by the block and by the row runs, never
    by ``total_q · total_k``. Time is one predicate cell per mask cell (tens of millions
    of cells a second on one CPU core), unless ``blocks`` says where the cells are:

    ``blocks(qb [nq, 1], kb [1, nk])`` (block indices, int64) returns int codes
    broadcastable to ``[nq, nk]``, one per block of ``block``: 0 the block holds no cell,
    1 every cell, 2 evaluate ``fn`` (FlexAttention's full / partial blocks). Only blocks
    coded 2 are evaluated. The codes are trusted; ``check_blocks=True`` evaluates ``fn`` on
    every block as well and raises ``ValueError`` at the first block whose code is wrong
    (for tests)."""
    tq, tk = _check_total("total_q", total_q), _check_total("total_k", total_k)
    bq, bk = _block_shape(block)
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be a callable fn(q_idx, k_idx) -> bool array")
    nq, nk = -(-tq // bq), -(-tk // bk)
    codes = None if blocks is None else _block_codes(blocks, nq, nk)
    parts = []
    for r in range(nq):
        r0, r1 = r * bq, min((r + 1) * bq, tq)
        q_idx = np.arange(r0, r1, dtype=np.int64)[:, None]
        if codes is None:
            spans = [(0, nk)]
        else:
            row_codes = codes[r]
            if check_blocks:
                _check_codes(fn, q_idx, row_codes, bk, tk, r)
            full = _spans(row_codes == 1)
            spans = _spans(row_codes == 2)
            if len(full):  # full blocks: one run per row and span, no cell evaluated
                rows = np.repeat(np.arange(r0, r1), len(full))
                parts.append(
                    (
                        rows,
                        np.tile(full[:, 0] * bk, r1 - r0),
                        np.tile(np.minimum(full[:, 1] * bk, tk), r1 - r0),
                    )
                )
        for b0, b1 in spans:
            for b in range(int(b0), int(b1)):  # one block at a time: memory bounded
                c0, c1 = b * bk, min((b + 1) * bk, tk)
                cells = _evaluate(fn, q_idx, c0, c1)
                if cells.any():
                    parts.append(_dense_runs(cells, r0, c0))
    return runs_to_mask(_concat(parts, tq, tk))


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


def _block_codes(blocks, nq: int, nk: int) -> np.ndarray:
    if not callable(blocks):
        raise TypeError(f"blocks={blocks!r} must be a callable blocks(qb, kb) -> int codes")
    qb = np.arange(nq, dtype=np.int64)[:, None]
    kb = np.arange(nk, dtype=np.int64)[None, :]
    codes = np.asarray(blocks(qb, kb))
    if not (np.issubdtype(codes.dtype, np.integer) or codes.dtype == np.bool_):
        raise TypeError(f"blocks(qb, kb) returned dtype {codes.dtype}; give int codes 0, 1, 2")
    try:
        codes = np.broadcast_to(codes, (nq, nk))
    except ValueError:
        raise ValueError(
            f"blocks(qb [{nq}, 1], kb [1, {nk}]) returned shape {codes.shape}, not "
            f"broadcastable to [{nq}, {nk}]"
        ) from None
    bad = (codes < 0) | (codes > 2)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(
            f"blocks(qb, kb) gave code {int(codes[i, j])} for block ({i}, {j}); codes are "
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
    row, start, end = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return _normalised(row, start, end, tq, tk)


def mask_from_dense(dense) -> AttnMask:
    """The mask of a bool array ``[total_q, total_k]`` (True = attend), as slices. For
    masks that fit in memory; :func:`mask_from_fn` builds larger ones block by block."""
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
    return runs_to_mask(_concat([_dense_runs(arr, 0, 0)], tq, tk))


def mask_from_block_mask(
    block_mask,
    block_q: int,
    block_k: int,
    total_q: int | None = None,
    total_k: int | None = None,
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> AttnMask:
    """The mask of a block-sparse bool ``block_mask [ceil(total_q / block_q),
    ceil(total_k / block_k)]``: block ``(i, j)`` True means every query of
    ``[i·block_q, (i+1)·block_q)`` sees every key of ``[j·block_k, (j+1)·block_k)`` (the
    last block of each axis clipped to ``total_q`` / ``total_k``, which default to the
    blocks' full extent). This is the form of FlexAttention's ``BlockMask`` and of splash
    attention's block masks with only full blocks. Blocks are FULL rectangles, merged
    along keys and then along queries where the runs of consecutive block rows agree;
    no cell is evaluated (time ``O(blocks)``).

    With a predicate ``fn`` (as :func:`mask_from_fn` takes it), ``block_mask`` holds int
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
        return mask_from_fn(fn, tq, tk, block=(bq, bk), blocks=lambda qb, kb: arr[qb, kb])
    blocks = runs_to_mask(_concat([_dense_runs(arr, 0, 0)], nq, nk), diagonals=False)
    q = np.minimum(blocks.q_ranges.astype(np.int64) * bq, tq)
    k = np.minimum(blocks.k_ranges.astype(np.int64) * bk, tk)
    return AttnMask(q, k, AttnMaskType.FULL, tq, tk)


def combine(a: AttnMask, b: AttnMask, op: str) -> AttnMask:
    """``a | b`` (union), ``a & b`` (intersection) or ``a - b`` (difference), exactly, as
    slices. Both masks must be over the same ``total_q`` and ``total_k``. Works on the row
    runs of both (time ``O(R log R)`` for ``R`` runs), never on cells."""
    if not isinstance(a, AttnMask) or not isinstance(b, AttnMask):
        raise TypeError(
            f"mask {op} mask needs two AttnMask; got {type(a).__name__} and {type(b).__name__}"
        )
    if op not in _OPS:
        raise ValueError(f"op={op!r} must be one of {list(_OPS)}")
    if (a.total_q, a.total_k) != (b.total_q, b.total_k):
        raise ValueError(
            f"mask {op} mask needs masks over the same tokens; got total_q={a.total_q}, "
            f"total_k={a.total_k} and total_q={b.total_q}, total_k={b.total_k} — build both "
            "over one (total_q, total_k)"
        )
    ra, rb = row_runs(a), row_runs(b)
    tq, tk = a.total_q, a.total_k
    stride = tk + 1
    keys = np.concatenate(
        [ra.row * stride + ra.start, ra.row * stride + ra.end]
        + [rb.row * stride + rb.start, rb.row * stride + rb.end]
    )
    if not len(keys):
        return AttnMask._from_list([], tq, tk)
    na, nb = len(ra), len(rb)
    da = np.concatenate([np.ones(na), -np.ones(na), np.zeros(2 * nb)]).astype(np.int8)
    db = np.concatenate([np.zeros(2 * na), np.ones(nb), -np.ones(nb)]).astype(np.int8)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    # Coverage after every event of one key; between consecutive keys it is constant, and
    # at a row's last key both coverages are back to 0 (a segment never spans rows).
    last = np.r_[keys[1:] != keys[:-1], True]
    in_a = np.cumsum(da[order], dtype=np.int64)[last] > 0
    in_b = np.cumsum(db[order], dtype=np.int64)[last] > 0
    at = keys[last]
    keep = _OPS[op](in_a[:-1], in_b[:-1])
    seg_start, seg_end = at[:-1][keep], at[1:][keep]
    return runs_to_mask(
        _normalised(
            seg_start // stride,
            seg_start % stride,
            seg_end - (seg_start // stride) * stride,
            tq,
            tk,
        )
    )


def canonical(mask: AttnMask) -> AttnMask:
    """The slices of ``mask``'s cells as :func:`runs_to_mask` writes them: the mask that
    :func:`mask_from_fn` returns for a predicate with the same cells (two masks hold the
    same cells exactly when their canonical forms are equal)."""
    return runs_to_mask(row_runs(mask))
