"""Slices as arrays: the four slice types and the canonical form every slice shares.

Every slice ``(q_range, k_range, type)``, whatever its type, is one *shape*: the lattice cells

    q ∈ [q0, q1),  k ∈ [k0, k1),  dlo <= k - q <= dhi

(``dlo``/``dhi`` possibly unbounded). That canonical form (:class:`SliceShapes`) is what the
validator, the area, the dense view and every planner downstream work with; constructors
describe masks as shapes and turn them back into typed slices with :func:`shape_to_slices`.
A leaf module (NumPy only): :mod:`magi_jax.masks` re-exports its names.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

__all__ = ["AttnMaskType", "SliceShapes", "shape_to_slices"]

# Sentinels for unbounded diagonal constraints; far outside any int32 token coordinate
# difference, so arithmetic on them in int64 never overflows and never clips a real cell.
_NEG_INF = -(1 << 40)
_POS_INF = 1 << 40


class AttnMaskType(enum.IntEnum):
    """Type of one slice; see docs/masks.md for the exact cells of each."""

    FULL = 0
    CAUSAL = 1
    INV_CAUSAL = 2
    BI_CAUSAL = 3

    @classmethod
    def coerce(cls, value: object) -> "AttnMaskType":
        """Accepts an ``AttnMaskType``, its int value or its name (any case, e.g. ``"causal"``)."""
        if isinstance(value, AttnMaskType):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper().replace("-", "_")]
            except KeyError:
                raise ValueError(
                    f"unknown mask type {value!r}; use one of "
                    f"{[t.name.lower() for t in cls]} or their ints 0-3"
                ) from None
        try:
            if isinstance(value, (bool, np.bool_)) or int(value) != value:
                raise ValueError
            return cls(int(value))
        except (ValueError, TypeError):
            raise ValueError(
                f"unknown mask type {value!r}; use one of "
                f"{[t.name.lower() for t in cls]} or their ints 0-3"
            ) from None


@dataclasses.dataclass(frozen=True)
class SliceShapes:
    """Slices in canonical form, int64 arrays of one length ``N``.

    Slice ``s`` holds the cells ``q ∈ [q0, q1)``, ``k ∈ [k0, k1)`` with
    ``dlo <= k - q <= dhi``. Rows are clipped to the rows that hold at least one cell, so on
    ``[q0, q1)`` every row is non-empty and ``lo(q) = max(k0, q + dlo)``,
    ``hi(q) = min(k1 - 1, q + dhi)`` are both linear (slope 0 or 1: no kink inside).
    Empty slices have ``q0 == q1``.
    """

    q0: np.ndarray
    q1: np.ndarray
    k0: np.ndarray
    k1: np.ndarray
    dlo: np.ndarray
    dhi: np.ndarray

    @property
    def nonempty(self) -> np.ndarray:
        """bool ``[N]``: the slices that hold a cell."""
        return self.q1 > self.q0

    def lo(self, q: np.ndarray, idx: slice | np.ndarray | int = slice(None)) -> np.ndarray:
        """First visible key of rows ``q`` (rows inside the slices ``idx``; int64 arrays that
        broadcast)."""
        return np.maximum(self.k0[idx], q + self.dlo[idx])

    def hi(self, q: np.ndarray, idx: slice | np.ndarray | int = slice(None)) -> np.ndarray:
        """Last visible key (inclusive) of rows ``q`` (rows inside the slices ``idx``; int64
        arrays that broadcast)."""
        return np.minimum(self.k1[idx] - 1, q + self.dhi[idx])

    @staticmethod
    def from_slices(q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray) -> "SliceShapes":
        """The canonical form of slices ``q_ranges``, ``k_ranges`` int ``[N, 2]`` and ``types``
        int ``[N]``."""
        qs, qe = q_ranges[:, 0].astype(np.int64), q_ranges[:, 1].astype(np.int64)
        ks, ke = k_ranges[:, 0].astype(np.int64), k_ranges[:, 1].astype(np.int64)
        types = np.asarray(types)
        n = len(types)
        lower = (types == AttnMaskType.INV_CAUSAL) | (types == AttnMaskType.BI_CAUSAL)
        upper = (types == AttnMaskType.CAUSAL) | (types == AttnMaskType.BI_CAUSAL)
        dlo = np.where(lower, ks - qs, _NEG_INF)
        dhi = np.where(upper, ke - qe, _POS_INF)
        q0, q1 = qs.copy(), qe.copy()
        # Clip rows to those that see a key: lo(q) <= hi(q).
        #   with a diagonal upper bound, rows need q + dhi >= k0;
        #   with a diagonal lower bound, rows need q + dlo <= k1 - 1.
        q0 = np.where(upper, np.maximum(q0, ks - dhi), q0)
        q1 = np.where(lower, np.minimum(q1, ke - 1 - dlo + 1), q1)
        # Band: both bounds diagonal; empty when dhi < dlo (sq > sk).
        empty = (ke <= ks) | (q1 <= q0) | (dhi < dlo)
        q0 = np.where(empty, 0, q0)
        q1 = np.where(empty, 0, q1)
        assert len(q0) == n
        return SliceShapes(q0, q1, ks, ke, dlo, dhi)

    def areas(self) -> np.ndarray:
        """Exact number of cells of every slice (int64), by summing ``hi - lo + 1`` over rows."""
        rows = self.q1 - self.q0
        first = self.hi(self.q0) - self.lo(self.q0) + 1
        last = self.hi(self.q1 - 1) - self.lo(self.q1 - 1) + 1
        # Row widths are linear on [q0, q1), so the sum is rows * (first + last) / 2.
        return np.where(rows > 0, rows * (first + last) // 2, 0)


def shape_to_slices(
    q0: int, q1: int, k0: int, k1: int, dlo: int | None = None, dhi: int | None = None
) -> list[tuple[int, int, int, int, AttnMaskType]]:
    """Typed slices whose union is exactly the shape ``{q ∈ [q0,q1), k ∈ [k0,k1),
    dlo <= k - q <= dhi}`` (``None`` = unbounded): at most three, disjoint by rows —
    CAUSAL on top, BI_CAUSAL (or FULL) in the middle, INV_CAUSAL at the bottom.

    Returns ``[(qs, qe, ks, ke, type), ...]``; empty for an empty shape.

    >>> shape_to_slices(0, 4, 0, 4, dlo=-1, dhi=0)   # causal window of 2 keys
    [(0, 1, 0, 1, <AttnMaskType.CAUSAL: 1>), (1, 4, 0, 4, <AttnMaskType.BI_CAUSAL: 3>)]
    """
    dlo = _NEG_INF if dlo is None else int(dlo)
    dhi = _POS_INF if dhi is None else int(dhi)
    q0, q1, k0, k1 = int(q0), int(q1), int(k0), int(k1)
    # Only rows with at least one cell.
    q0 = max(q0, k0 - dhi)
    q1 = min(q1, k1 - dlo)
    if q1 <= q0 or k1 <= k0 or dhi < dlo:
        return []
    # Rows >= t have a diagonal lower edge (q + dlo > k0); rows >= u a clamped upper edge
    # (q + dhi >= k1 - 1 ... clamps from row k1 - dhi on).
    t = min(max(k0 - dlo, q0), q1)
    u = min(max(k1 - dhi, q0), q1)
    out = []
    if t <= u:
        pieces = [(q0, t, "causal"), (t, u, "band"), (u, q1, "inv")]
    else:
        pieces = [(q0, u, "causal"), (u, t, "full"), (t, q1, "inv")]
    for a, b, kind in pieces:
        if b <= a:
            continue
        if kind == "causal":
            out.append((a, b, k0, b + dhi, AttnMaskType.CAUSAL))
        elif kind == "band":
            out.append((a, b, a + dlo, b + dhi, AttnMaskType.BI_CAUSAL))
        elif kind == "full":
            out.append((a, b, k0, k1, AttnMaskType.FULL))
        else:
            out.append((a, b, a + dlo, k1, AttnMaskType.INV_CAUSAL))
    return out
