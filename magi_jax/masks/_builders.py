"""Any mask as slices: masks from predicates, dense and block-sparse boolean masks, and
exact set algebra (docs/masks.md §7), on :class:`magi_jax.masks.AttnMask`.

Everything goes through one canonical form, :class:`RowRuns`: per query row, the maximal
runs of consecutive visible keys, stored once for a band of identical rows. A mask of
slices becomes row runs with one run per FULL rectangle and one per row where a diagonal
edge moves (:func:`row_runs`); a predicate or a dense mask becomes row runs block by block;
two masks combine run by run; and row runs become slices again by :func:`runs_to_mask`,
which chains the runs of consecutive rows whose edges stay put or move by one key per row
into FULL, CAUSAL, INV_CAUSAL and BI_CAUSAL slices. No step builds a ``total_q × total_k``
array. The algorithms work on plain arrays in :mod:`magi_jax.masks._row_runs`; the functions here
take and give masks. Host-only NumPy.

>>> m = mask_from_fn(lambda q, k: k <= q, 6, 6)   # a causal predicate: one CAUSAL slice
>>> m.slices()
[((0, 6), (0, 6), <AttnMaskType.CAUSAL: 1>)]
"""

from __future__ import annotations

from magi_jax.masks._mask import AttnMask
from magi_jax.masks._row_runs import (
    RowRuns,
    combine_runs,
    runs_to_slices,
    shape_runs,
)


def row_runs(mask: AttnMask) -> RowRuns:
    """The canonical :class:`RowRuns` of ``mask``. Rows where a slice's edges are both
    clamped (all of a FULL slice, the bottom of a CAUSAL one) give one band per slice;
    the rows where an edge moves give a run each. Memory and time ``O(slices + rows where
    some edge moves)`` (times the slices on those rows)."""
    return shape_runs(mask.shapes, mask.total_q, mask.total_k)


def runs_to_mask(runs: RowRuns, diagonals: bool = True) -> AttnMask:
    """The mask of canonical ``runs``: exactly its cells, as disjoint slices (see
    :func:`magi_jax.masks._row_runs.runs_to_slices`; ``diagonals=False`` makes FULL rectangles
    only). Time ``O(R log R)`` for ``R`` runs."""
    return AttnMask(*runs_to_slices(runs, diagonals))


# The constructors of AttnMask as functions of this module (the same methods, bound to the
# class): the mask of a predicate, of a dense bool array, of a block-sparse bool array.
mask_from_fn = AttnMask.from_fn
mask_from_dense = AttnMask.from_dense
mask_from_block_mask = AttnMask.from_block_mask


def combine(a: AttnMask, b: AttnMask, op: str) -> AttnMask:
    """``a | b`` (union), ``a & b`` (intersection) or ``a - b`` (difference), exactly, as
    slices. Both masks must be over the same ``total_q`` and ``total_k``. Works on the row
    runs of both (time ``O(R log R)`` for ``R`` runs), never on cells."""
    if not isinstance(a, AttnMask) or not isinstance(b, AttnMask):
        raise TypeError(
            f"mask {op} mask needs two AttnMask; got {type(a).__name__} and {type(b).__name__}"
        )
    return AttnMask(*combine_runs(row_runs(a), row_runs(b), op))


def canonical(mask: AttnMask) -> AttnMask:
    """The slices of ``mask``'s cells as :func:`runs_to_mask` writes them: the mask that
    :func:`mask_from_fn` returns for a predicate with the same cells (two masks hold the
    same cells exactly when their canonical forms are equal)."""
    return runs_to_mask(row_runs(mask))
