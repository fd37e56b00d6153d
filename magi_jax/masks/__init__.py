"""What a mask is, on the host (NumPy only; [masks.md](../../docs/masks.md) gives the meaning
cell by cell).

:mod:`~magi_jax.masks.slices` (the slice types and their canonical form),
:mod:`~magi_jax.masks._checks` (the checks of a mask's arguments),
:mod:`~magi_jax.masks._mask` (:class:`AttnMask`: building and checking masks, area, dense
view, the named masks), :mod:`~magi_jax.masks._row_runs` (any set of cells as row runs, on
plain arrays: slices from predicates, dense and block masks, exact set algebra),
:mod:`~magi_jax.masks._builders` (the same row runs on masks: ``row_runs``,
``runs_to_mask``, ``canonical``, ``combine``, ``mask_from_fn`` / ``_dense`` /
``_block_mask``), :mod:`~magi_jax.masks._zoo` (the named masks of the benchmarks and
tests) and :mod:`~magi_jax.masks.packings` (public: realistic packings, document lengths
drawn from published corpus statistics, and their masks and segment ids).
"""

from magi_jax.masks._builders import (
    canonical,
    combine,
    mask_from_block_mask,
    mask_from_dense,
    mask_from_fn,
    row_runs,
    runs_to_mask,
)
from magi_jax.masks._mask import (
    AttnMask,
    AttnMaskType,
    SliceShapes,
    refuse_as_jit_argument,
    shape_to_slices,
    window_bounds,
)
from magi_jax.masks._row_runs import DEFAULT_BLOCK, RowRuns
from magi_jax.masks._zoo import (
    DOC_LENGTHS,
    MASKS,
    REFERENCE_TOTAL,
    doc_window_global,
    hstu,
    make_mask,
    random_doc_lengths,
    scaled_doc_lengths,
    zoo,
)

__all__ = [
    "AttnMask",
    "refuse_as_jit_argument",
    "AttnMaskType",
    "SliceShapes",
    "shape_to_slices",
    "window_bounds",
    "RowRuns",
    "DEFAULT_BLOCK",
    "row_runs",
    "runs_to_mask",
    "mask_from_fn",
    "mask_from_dense",
    "mask_from_block_mask",
    "combine",
    "canonical",
    "DOC_LENGTHS",
    "REFERENCE_TOTAL",
    "MASKS",
    "scaled_doc_lengths",
    "random_doc_lengths",
    "make_mask",
    "zoo",
    "hstu",
    "doc_window_global",
]
