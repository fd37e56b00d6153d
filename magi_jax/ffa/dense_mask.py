"""A small dense boolean mask as rectangles: the conversion behind a concrete ``mask=`` of
:func:`magi_jax.ffa.dpa.dot_product_attention`.

Each row's runs of ``True`` are merged with the same run on the rows below into one
rectangle, so a block-structured mask gives few rectangles and any mask at most one per run
of a row. Host NumPy, ``O(Tq·Tk)`` time and memory: for the masks ``jax.nn`` takes (it builds
the ``[T, S]`` scores itself), not for long sequences — build those as an
:class:`~magi_jax.masks.AttnMask` from its constructors.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["dense_rectangles"]


def dense_rectangles(dense: ArrayLike) -> np.ndarray:
    """The ``True`` cells of ``dense`` (bool ``[Tq, Tk]``) as disjoint rectangles: int64
    ``[R, 4]`` rows ``(q0, q1, k0, k1)``, sorted by ``q0`` then ``k0``; their union is exactly
    the ``True`` cells."""
    d = np.asarray(dense)
    if d.ndim != 2 or d.dtype != np.bool_:
        raise ValueError(f"dense must be a bool [Tq, Tk] array; got {d.dtype} {d.shape}")
    edge = np.zeros((d.shape[0], 1), np.int8)
    step = np.diff(np.concatenate([edge, d.astype(np.int8), edge], axis=1), axis=1)
    rows, k0 = np.nonzero(step == 1)  # row-major: starts and ends of the runs align
    _, k1 = np.nonzero(step == -1)
    if not len(rows):
        return np.zeros((0, 4), np.int64)
    # One run (k0, k1) on consecutive rows is one rectangle.
    order = np.lexsort((rows, k1, k0))
    rows, k0, k1 = rows[order], k0[order], k1[order]
    first = np.ones(len(rows), bool)
    first[1:] = (k0[1:] != k0[:-1]) | (k1[1:] != k1[:-1]) | (rows[1:] != rows[:-1] + 1)
    start = np.flatnonzero(first)
    end = np.append(start[1:], len(rows)) - 1
    rect = np.stack([rows[start], rows[end] + 1, k0[start], k1[start]], axis=1).astype(np.int64)
    return rect[np.lexsort((rect[:, 2], rect[:, 0]))]
