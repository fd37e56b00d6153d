"""Attention masks as lists of slices: what a mask *is* (docs/masks.md).

A mask over packed queries ``[0, total_q)`` and keys ``[0, total_k)`` is the union of slices
``(q_range, k_range, type)``. Every slice, whatever its type, is one *shape*: the lattice cells

    q ∈ [q0, q1),  k ∈ [k0, k1),  dlo <= k - q <= dhi

(``dlo``/``dhi`` possibly unbounded). That canonical form (:class:`SliceShapes`) is what the
validator, the area, the dense view and every planner downstream work with; constructors
describe masks as shapes and turn them back into typed slices with :func:`shape_to_slices`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from collections.abc import Callable

import numpy as np

__all__ = ["AttnMaskType", "AttnMask", "SliceShapes", "shape_to_slices", "window_bounds"]

# Sentinels for unbounded diagonal constraints; far outside any int32 token coordinate
# difference, so arithmetic on them in int64 never overflows and never clips a real cell.
_NEG_INF = -(1 << 40)
_POS_INF = 1 << 40
# Largest dense view to_dense() agrees to build (bool cells).
_MAX_DENSE_CELLS = 1 << 28
# Overlap validation processes (row band, slice) pairs in chunks of this many.
_OVERLAP_CHUNK = 1 << 22


class AttnMaskType(enum.IntEnum):
    """Type of one slice; see docs/masks.md for the exact cells of each."""

    FULL = 0
    CAUSAL = 1
    INV_CAUSAL = 2
    BI_CAUSAL = 3

    @classmethod
    def coerce(cls, value) -> "AttnMaskType":
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
        return self.q1 > self.q0

    def lo(self, q: np.ndarray, idx=slice(None)) -> np.ndarray:
        """First visible key of row ``q`` (rows inside the slice)."""
        return np.maximum(self.k0[idx], q + self.dlo[idx])

    def hi(self, q: np.ndarray, idx=slice(None)) -> np.ndarray:
        """Last visible key (inclusive) of row ``q`` (rows inside the slice)."""
        return np.minimum(self.k1[idx] - 1, q + self.dhi[idx])

    @staticmethod
    def from_slices(q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray) -> "SliceShapes":
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


def _as_ranges(name: str, ranges) -> np.ndarray:
    arr = np.asarray(ranges)
    if arr.size == 0:
        arr = arr.reshape(0, 2)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{name} must have shape [N, 2] (start, end) pairs; got shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"{name} must hold integer token positions; got dtype {arr.dtype}")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError(f"{name} must hold integer token positions; got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        bad = int(np.argmax((arr < 0).any(axis=1) | (arr > np.iinfo(np.int32).max).any(axis=1)))
        raise ValueError(
            f"{name}[{bad}] = {arr[bad].tolist()} is outside [0, 2**31): token "
            "positions must be non-negative int32"
        )
    return arr


def _fmt_slice(i: int, qr, kr, t) -> str:
    return (
        f"slice {i} (q_range=[{int(qr[0])}, {int(qr[1])}), k_range=[{int(kr[0])}, "
        f"{int(kr[1])}), type={AttnMaskType(int(t)).name})"
    )


class AttnMask:
    """An immutable, hashable, validated attention mask made of slices.

    Attributes: ``q_ranges`` int32 ``[N, 2]``, ``k_ranges`` int32 ``[N, 2]``, ``types`` int32
    ``[N]``, ``total_q``, ``total_k``, ``fingerprint`` (hex digest of the content; equal masks
    have equal fingerprints), ``area`` (exact number of attended cells, a Python int).

    >>> m = AttnMask.from_ranges([[0, 4], [4, 6]], [[0, 4], [0, 6]], ["causal", "causal"])
    >>> m.area
    21
    """

    __slots__ = (
        "_q_ranges",
        "_k_ranges",
        "_types",
        "_total_q",
        "_total_k",
        "_fingerprint",
        "__dict__",
    )

    def __init__(
        self, q_ranges, k_ranges, types, total_q: int | None = None, total_k: int | None = None
    ):
        qr = _as_ranges("q_ranges", q_ranges)
        kr = _as_ranges("k_ranges", k_ranges)
        if len(qr) != len(kr):
            raise ValueError(
                f"q_ranges has {len(qr)} slices but k_ranges has {len(kr)}; give "
                "one k_range per q_range"
            )
        types = _as_types(types, len(qr))
        total_q = None if total_q is None else _check_total("total_q", total_q)
        total_k = None if total_k is None else _check_total("total_k", total_k)
        qr, kr, types = _drop_empty_past_end(qr, kr, types, total_q, total_k)
        total_q = int(qr[:, 1].max(initial=0)) if total_q is None else total_q
        total_k = int(kr[:, 1].max(initial=0)) if total_k is None else total_k
        _check_bounds("q_ranges", qr, total_q, "total_q", kr, types)
        _check_bounds("k_ranges", kr, total_k, "total_k", qr, types)
        self._q_ranges = _frozen(qr.astype(np.int32))
        self._k_ranges = _frozen(kr.astype(np.int32))
        self._types = _frozen(types.astype(np.int32))
        self._total_q = total_q
        self._total_k = total_k
        _check_disjoint(self)
        h = hashlib.blake2b(digest_size=16)
        h.update(np.array([total_q, total_k, len(qr)], np.int64).tobytes())
        for a in (self._q_ranges, self._k_ranges, self._types):
            h.update(a.tobytes())
        self._fingerprint = h.hexdigest()

    # ---- basic properties -------------------------------------------------------------------
    q_ranges = property(lambda self: self._q_ranges, doc="int32 [N, 2] query ranges.")
    k_ranges = property(lambda self: self._k_ranges, doc="int32 [N, 2] key ranges.")
    types = property(lambda self: self._types, doc="int32 [N] slice types (AttnMaskType).")
    total_q = property(lambda self: self._total_q, doc="Number of packed query tokens.")
    total_k = property(lambda self: self._total_k, doc="Number of packed key tokens.")
    fingerprint = property(lambda self: self._fingerprint, doc="Hex digest of the content.")

    @property
    def num_slices(self) -> int:
        return len(self._types)

    @functools.cached_property
    def shapes(self) -> SliceShapes:
        """The slices in canonical form (see :class:`SliceShapes`)."""
        return SliceShapes.from_slices(self._q_ranges, self._k_ranges, self._types)

    @functools.cached_property
    def area(self) -> int:
        """Exact number of attended (q, k) cells (docs/masks.md), as a Python int."""
        return int(self.shapes.areas().sum())

    def __hash__(self) -> int:
        return hash(self._fingerprint)

    def __eq__(self, other) -> bool:
        return isinstance(other, AttnMask) and self._fingerprint == other._fingerprint

    def __or__(self, other: "AttnMask") -> "AttnMask":
        """Union: the cells of either mask, as disjoint slices (same totals required)."""
        return self._combine(other, "|")

    def __and__(self, other: "AttnMask") -> "AttnMask":
        """Intersection: the cells of both masks (same totals required)."""
        return self._combine(other, "&")

    def __sub__(self, other: "AttnMask") -> "AttnMask":
        """Difference: the cells of this mask that ``other`` does not hold."""
        return self._combine(other, "-")

    def _combine(self, other, op: str):
        if not isinstance(other, AttnMask):
            return NotImplemented
        from magi_jax.mask_runs import combine

        return combine(self, other, op)

    def __setattr__(self, name, value):
        if name.startswith("_") and not hasattr(self, name):
            object.__setattr__(self, name, value)
            return
        raise AttributeError("AttnMask is immutable")

    def __repr__(self) -> str:
        return (
            f"AttnMask(total_q={self.total_q}, total_k={self.total_k}, "
            f"num_slices={self.num_slices}, area={self.area}, "
            f"fingerprint={self.fingerprint[:12]})"
        )

    def plot(self, path=None, **kwargs):
        """Picture of the mask (PNG at ``path``); see :func:`magi_jax.plot.plot_mask`."""
        from magi_jax.plot import plot_mask

        return plot_mask(self, path, **kwargs)

    def slices(self) -> list[tuple[tuple[int, int], tuple[int, int], AttnMaskType]]:
        """The slices as Python tuples ``((qs, qe), (ks, ke), type)``."""
        return [
            ((int(q[0]), int(q[1])), (int(k[0]), int(k[1])), AttnMaskType(int(t)))
            for q, k, t in zip(self._q_ranges, self._k_ranges, self._types)
        ]

    def to_dense(self, max_cells: int = _MAX_DENSE_CELLS) -> np.ndarray:
        """The mask as a bool array ``[total_q, total_k]`` (True = attend). For tests and
        small problems only: refuses more than ``max_cells`` cells."""
        cells = self.total_q * self.total_k
        if cells > max_cells:
            raise ValueError(
                f"to_dense() would build a {self.total_q} x {self.total_k} array ({cells:,} "
                f"cells > max_cells={max_cells:,}); dense masks are for small problems — use "
                "the slices (mask.shapes, mask.area) or pass a larger max_cells"
            )
        dense = np.zeros((self.total_q, self.total_k), dtype=bool)
        sh = self.shapes
        cols = np.arange(self.total_k)
        for s in np.nonzero(sh.nonempty)[0]:
            rows = np.arange(sh.q0[s], sh.q1[s])
            lo = sh.lo(rows, s)[:, None]
            hi = sh.hi(rows, s)[:, None]
            dense[sh.q0[s] : sh.q1[s]] |= (cols[None, :] >= lo) & (cols[None, :] <= hi)
        return dense

    def save(self, path) -> None:
        """Writes the mask to ``path`` as a ``.npz`` (``q_ranges``, ``k_ranges``, ``types``,
        ``total_q``, ``total_k``); :meth:`load` reads it back, and ``python -m magi_jax.cli
        --slices path`` plans it."""
        np.savez(
            path,
            q_ranges=self._q_ranges,
            k_ranges=self._k_ranges,
            types=self._types,
            total_q=np.int64(self._total_q),
            total_k=np.int64(self._total_k),
        )

    @classmethod
    def load(cls, path) -> "AttnMask":
        """The mask of a ``.npz`` with arrays ``q_ranges`` ``[N, 2]``, ``k_ranges`` ``[N, 2]``
        and ``types`` ``[N]`` (names or :class:`AttnMaskType` values), and optionally
        ``total_q`` / ``total_k`` (default: the largest range end), as :meth:`save` writes."""
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("q_ranges", "k_ranges", "types") if k not in z.files]
            if missing:
                raise ValueError(
                    f"{path}: a mask file needs arrays q_ranges, k_ranges and "
                    f"types; {missing} missing (it holds {z.files})"
                )
            totals = {k: int(z[k]) for k in ("total_q", "total_k") if k in z.files}
            types = z["types"]
            types = types.tolist() if types.dtype.kind in "US" else types
            return cls(
                z["q_ranges"], z["k_ranges"], types, totals.get("total_q"), totals.get("total_k")
            )

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def from_ranges(
        cls, q_ranges, k_ranges, types, total_q: int | None = None, total_k: int | None = None
    ) -> "AttnMask":
        """A mask from explicit slices; ``types`` is one type for all or one per slice.

        >>> AttnMask.from_ranges([[0, 2], [2, 5]], [[0, 2], [0, 5]], "causal").area
        15
        """
        return cls(q_ranges, k_ranges, types, total_q, total_k)

    @classmethod
    def _from_list(cls, slices, total_q: int, total_k: int) -> "AttnMask":
        if not slices:
            return cls(np.zeros((0, 2)), np.zeros((0, 2)), np.zeros((0,)), total_q, total_k)
        arr = np.array([[a, b, c, d, int(t)] for a, b, c, d, t in slices], np.int64)
        return cls(arr[:, 0:2], arr[:, 2:4], arr[:, 4], total_q, total_k)

    @classmethod
    def from_fn(
        cls,
        fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
        total_q: int,
        total_k: int,
        *,
        block: int | tuple[int, int] | None = None,
        blocks: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
        check_blocks: bool = False,
    ) -> "AttnMask":
        """The mask whose cell ``(q, k)`` is ``fn(q_idx, k_idx)``, a vectorised NumPy
        predicate (int64 ``q_idx [bq, 1]``, ``k_idx [1, bk]`` → bool ``[bq, bk]``), evaluated
        block by block and compressed into slices; ``blocks(qb, kb)`` optionally codes the
        blocks (0 empty, 1 full, 2 evaluate). See :func:`magi_jax.mask_runs.mask_from_fn`.

        >>> AttnMask.from_fn(lambda q, k: (k <= q) & (q - k < 2), 4, 4).area
        7
        """
        from magi_jax.mask_runs import DEFAULT_BLOCK, mask_from_fn

        return mask_from_fn(
            fn,
            total_q,
            total_k,
            block=DEFAULT_BLOCK if block is None else block,
            blocks=blocks,
            check_blocks=check_blocks,
        )

    @classmethod
    def from_dense(cls, dense: np.ndarray) -> "AttnMask":
        """The mask of a bool array ``[total_q, total_k]`` (True = attend), as slices (small
        masks; :meth:`from_fn` for large ones).

        >>> AttnMask.from_dense(np.tril(np.ones((4, 4), bool))).slices()
        [((0, 4), (0, 4), <AttnMaskType.CAUSAL: 1>)]
        """
        from magi_jax.mask_runs import mask_from_dense

        return mask_from_dense(dense)

    @classmethod
    def from_block_mask(
        cls,
        block_mask: np.ndarray,
        block_q: int,
        block_k: int,
        total_q: int | None = None,
        total_k: int | None = None,
        fn: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    ) -> "AttnMask":
        """The mask of a block-sparse bool ``block_mask [ceil(total_q / block_q),
        ceil(total_k / block_k)]`` (FlexAttention's ``BlockMask`` / splash form): True
        blocks are FULL rectangles, merged where they line up. With a predicate ``fn``,
        ``block_mask`` holds codes 0 (empty), 1 (full), 2 (partial: ``fn``'s cells); see
        :func:`magi_jax.mask_runs.mask_from_block_mask`.

        >>> AttnMask.from_block_mask(np.array([[1, 0], [1, 1]], bool), 2, 2).slices()
        [((0, 2), (0, 2), <AttnMaskType.FULL: 0>), ((2, 4), (0, 4), <AttnMaskType.FULL: 0>)]
        """
        from magi_jax.mask_runs import mask_from_block_mask

        return mask_from_block_mask(block_mask, block_q, block_k, total_q, total_k, fn)

    @classmethod
    def full(cls, total_q: int, total_k: int | None = None) -> "AttnMask":
        """Every query sees every key.

        >>> AttnMask.full(4, 6).area
        24
        """
        total_q = _check_total("total_q", total_q)
        total_k = total_q if total_k is None else _check_total("total_k", total_k)
        return cls([[0, total_q]], [[0, total_k]], [AttnMaskType.FULL], total_q, total_k)

    @classmethod
    def causal(cls, total_q: int, total_k: int | None = None) -> "AttnMask":
        """Causal, bottom-right aligned when ``total_q != total_k`` (the last query sees
        every key).

        >>> AttnMask.causal(4).area
        10
        """
        total_q = _check_total("total_q", total_q)
        total_k = total_q if total_k is None else _check_total("total_k", total_k)
        return cls([[0, total_q]], [[0, total_k]], [AttnMaskType.CAUSAL], total_q, total_k)

    @classmethod
    def varlen(
        cls, cu_seqlens, causal: bool = True, window: int | tuple[int, int] | None = None
    ) -> "AttnMask":
        """Packed documents, each attending only to itself (FlashAttention's varlen).

        ``cu_seqlens``: 1-D cumulative lengths ``[0, n0, n0+n1, ...]``. ``causal`` (default
        ``True``, as for :func:`magi_jax.make_varlen_key` and :meth:`from_segment_ids`: one
        default for packed documents everywhere): causal inside each document; pass
        ``causal=False`` for bidirectional documents. ``window``: a sliding window inside
        each document, ``(left, right)`` — query ``q`` sees keys ``[q - left, q + right]``
        — or an int ``w``, meaning ``(w, 0)`` when causal and ``(w, w)`` otherwise.

        >>> AttnMask.varlen([0, 3, 5]).area                 # causal documents of 3 and 2
        9
        >>> AttnMask.varlen([0, 3, 5], causal=False).area   # 3*3 + 2*2
        13
        """
        cu = _cu_seqlens(cu_seqlens)
        total = int(cu[-1])
        left, right = window_bounds(window, causal)
        slices = []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if e > s:
                slices += shape_to_slices(s, e, s, e, -left if left is not None else None, right)
        return cls._from_list(slices, total, total)

    @classmethod
    def from_segment_ids(
        cls,
        segment_ids,
        causal: bool = True,
        window: int | tuple[int, int] | None = None,
        *,
        per_row: bool = False,
    ) -> "AttnMask | list[AttnMask]":
        """Packed documents given by per-token segment ids (``jax.nn``'s / Flax's
        ``segment_ids``).

        ``segment_ids``: int ``[T]`` or ``[B, T]``. Every maximal run of one nonzero id is a
        document that attends only to itself; id 0 is padding: its tokens attend nothing and
        are attended by nothing. A ``[B, T]`` array packs its rows into one sequence of
        ``B·T`` tokens (row ``b`` at ``[b·T, (b+1)·T)``, see
        :func:`magi_jax.ffa.segments.pack_rows`); documents never cross rows.
        ``causal`` (default ``True``, like :meth:`varlen` and
        :func:`magi_jax.make_varlen_key`): causal inside each document. ``window``: as in
        :meth:`varlen` — ``(left, right)``, query ``q`` sees keys ``[q - left, q + right]``
        of its document, or an int ``w`` meaning ``(w, 0)`` when causal, ``(w, w)``
        otherwise. Raises ``ValueError`` when one nonzero id appears in two separate runs of
        a row (segment ids must be contiguous runs). ``per_row=True`` with ``[B, T]`` ids:
        a list of ``B`` masks of ``T`` tokens, one per row (each row its own packing, the
        masks of :func:`magi_jax.make_batch_key`).

        >>> AttnMask.from_segment_ids([1, 1, 1, 2, 2, 0]).area
        9
        """
        ids = np.asarray(segment_ids)
        if ids.ndim not in (1, 2):
            raise ValueError(f"segment_ids must be [T] or [B, T]; got shape {ids.shape}")
        if per_row:
            if ids.ndim != 2:
                raise ValueError(
                    f"per_row=True takes [B, T] segment ids (one mask per row); got shape "
                    f"{ids.shape}: drop per_row for a single [T] row"
                )
            return [cls.from_segment_ids(row, causal, window) for row in ids]
        if not (np.issubdtype(ids.dtype, np.integer) or np.issubdtype(ids.dtype, np.bool_)):
            raise ValueError(f"segment_ids must be integers; got dtype {ids.dtype}")
        rows = ids.reshape(1, -1) if ids.ndim == 1 else ids
        batch, t = rows.shape
        left, right = window_bounds(window, causal)
        dlo = None if left is None else -left
        slices = []
        for b in range(batch):
            row = rows[b].astype(np.int64)
            cut = np.flatnonzero(row[1:] != row[:-1]) + 1
            starts = np.concatenate([[0], cut]) if t else np.zeros((0,), np.int64)
            ends = np.concatenate([cut, [t]]) if t else np.zeros((0,), np.int64)
            keep = row[starts] != 0
            starts, ends, vals = starts[keep], ends[keep], row[starts[keep]]
            by_id = np.argsort(vals, kind="stable")
            dup = np.flatnonzero(vals[by_id][1:] == vals[by_id][:-1])
            if dup.size:
                i, j = by_id[dup[0]], by_id[dup[0] + 1]
                where = f" of row {b}" if ids.ndim == 2 else ""
                raise ValueError(
                    f"segment id {int(vals[i])} appears in two separate runs{where}: "
                    f"positions [{int(starts[i])}, {int(ends[i])}) and [{int(starts[j])}, "
                    f"{int(ends[j])}); segment ids must be contiguous runs (packed "
                    "documents) — give every document its own id, or build the mask from "
                    "slices (AttnMask.from_ranges)"
                )
            for s, e in zip((starts + b * t).tolist(), (ends + b * t).tolist()):
                slices += shape_to_slices(s, e, s, e, dlo, right)
        return cls._from_list(slices, batch * t, batch * t)

    @classmethod
    def sliding_window(cls, total: int, left: int, right: int) -> "AttnMask":
        """Query ``q`` sees keys ``[q - left, q + right]`` of one sequence; at most three
        slices (causal top, band middle, inverse-causal bottom).

        >>> AttnMask.sliding_window(5, 1, 0).area
        9
        """
        total = _check_total("total", total)
        left, right = _check_total("left", left), _check_total("right", right)
        return cls.varlen([0, total], causal=False, window=(left, right))

    @classmethod
    def block_causal(cls, doc_lens, block_size: int) -> "AttnMask":
        """Inside each document, the queries of a block see their own block and every
        earlier block of the document fully (video-chunk style); documents do not see
        each other.

        >>> AttnMask.block_causal([5], 2).area  # blocks [0,2) [2,4) [4,5) see 2, 4, 5 keys
        17
        """
        lens = _doc_lens(doc_lens)
        if _check_total("block_size", block_size) == 0:
            raise ValueError(f"block_size={block_size} must be positive")
        slices, start = [], 0
        for n in lens:
            for b in range(0, n, block_size):
                e = min(b + block_size, n)
                slices.append((start + b, start + e, start, start + e, AttnMaskType.FULL))
            start += n
        return cls._from_list(slices, start, start)

    @classmethod
    def prefix_lm(cls, doc_lens, prefix_lens) -> "AttnMask":
        """Prefix-LM: in each document the first ``prefix_len`` tokens see the whole prefix
        bidirectionally, later tokens are causal. ``doc_lens`` is an int (one document) or a
        list; ``prefix_lens`` an int for all documents or one per document.

        >>> AttnMask.prefix_lm(5, 2).area   # 2*2 prefix + rows 2..4 see 3, 4, 5 keys
        16
        """
        lens = _doc_lens(doc_lens)
        prefixes = np.asarray(prefix_lens)
        if (
            prefixes.ndim > 1
            or prefixes.size not in (1, len(lens))
            or not (np.issubdtype(prefixes.dtype, np.integer))
        ):
            raise ValueError(
                f"prefix_lens must be one int or {len(lens)} ints (one per "
                f"document); got {prefix_lens!r}"
            )
        prefixes = np.broadcast_to(prefixes.astype(np.int64).reshape(-1), (len(lens),))
        slices, start = [], 0
        for i, (n, p) in enumerate(zip(lens, prefixes.tolist())):
            if not 0 <= p <= n:
                raise ValueError(f"prefix_lens[{i}]={p} must be in [0, doc_lens[{i}]={n}]")
            if p:
                slices.append((start, start + p, start, start + p, AttnMaskType.FULL))
            if n > p:
                slices.append((start + p, start + n, start, start + n, AttnMaskType.CAUSAL))
            start += n
        return cls._from_list(slices, start, start)

    @classmethod
    def shared_question(cls, doc_lens) -> "AttnMask":
        """Shared question: documents 0 and 1 form one causal block (question + first
        answer); every later document (another answer) is causal within itself and also sees
        document 0 (the question) fully.

        >>> AttnMask.shared_question([2, 1, 2]).area   # causal 3 + (2*2 + 3)
        13
        """
        lens = _doc_lens(doc_lens)
        if len(lens) < 2:
            return cls.varlen([0, sum(lens)], causal=True)
        q_end = lens[0]
        head = lens[0] + lens[1]
        slices = [(0, head, 0, head, AttnMaskType.CAUSAL)] if head else []
        start = head
        for n in lens[2:]:
            if n:
                if q_end:
                    slices.append((start, start + n, 0, q_end, AttnMaskType.FULL))
                slices.append((start, start + n, start, start + n, AttnMaskType.CAUSAL))
            start += n
        return cls._from_list(slices, start, start)

    @classmethod
    def causal_blockwise(cls, doc_lens) -> "AttnMask":
        """Varlen causal, except that the last document attends causally over the whole
        packed prefix (all earlier documents and itself).

        >>> AttnMask.causal_blockwise([2, 2]).area   # 3 + (3 + 4)
        10
        """
        lens = _doc_lens(doc_lens)
        slices, start = [], 0
        for i, n in enumerate(lens):
            if n:
                ks = 0 if i == len(lens) - 1 else start
                slices.append((start, start + n, ks, start + n, AttnMaskType.CAUSAL))
            start += n
        return cls._from_list(slices, start, start)

    @classmethod
    def global_sliding_window(cls, total: int, window: int, num_global: int) -> "AttnMask":
        """Causal sliding window with global "sink" tokens (StreamingLLM style): query ``q``
        sees keys ``[q - window, q]`` and the first ``num_global`` keys (never the future).

        >>> AttnMask.global_sliding_window(6, 1, 1).area   # rows see 1,2,2+1,2+1,2+1,2+1
        15
        """
        total = _check_total("total", total)
        window = _check_total("window", window)
        num_global = _check_total("num_global", num_global)
        slices = shape_to_slices(0, total, 0, total, -window, 0)
        # Global keys not already inside the window: k < num_global and k < q - window.
        slices += shape_to_slices(0, total, 0, min(num_global, total), None, -window - 1)
        return cls._from_list(slices, total, total)


# ---- helpers ------------------------------------------------------------------------------


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def _as_types(types, n: int) -> np.ndarray:
    if isinstance(types, (str, AttnMaskType, int, np.integer)):
        return np.full((n,), int(AttnMaskType.coerce(types)), np.int64)
    try:
        seq = list(types) if not isinstance(types, np.ndarray) else types.reshape(-1).tolist()
    except TypeError:
        raise ValueError(
            f"types={types!r} must be one mask type (a name such as 'causal', an "
            "int 0-3 or an AttnMaskType) or one per slice"
        ) from None
    if len(seq) != n:
        raise ValueError(
            f"types has {len(seq)} entries but there are {n} slices; give one "
            "type per slice or a single type for all"
        )
    out = np.empty((n,), np.int64)
    for i, t in enumerate(seq):
        try:
            out[i] = int(AttnMaskType.coerce(t))
        except ValueError as e:
            raise ValueError(f"types[{i}]: {e}") from None
    return out


def _drop_empty_past_end(qr, kr, types, total_q, total_k):
    """The slices without those that have an empty range (``start == end``) ending past its
    total: they hold no cell, and sub-mask code produces them (``[9, 9)`` with
    ``total_k = 7``). Empty ranges inside ``[0, total]`` stay, as every empty range does
    when the totals are not given."""
    # A reversed range is an error whatever the other range holds (_check_bounds says so).
    drop = np.zeros(len(qr), bool)
    ordered = (qr[:, 0] <= qr[:, 1]) & (kr[:, 0] <= kr[:, 1])
    for ranges, total in ((qr, total_q), (kr, total_k)):
        if total is not None:
            drop |= ordered & (ranges[:, 0] == ranges[:, 1]) & (ranges[:, 1] > total)
    if not drop.any():
        return qr, kr, types
    keep = ~drop
    return qr[keep], kr[keep], types[keep]


def _check_bounds(name, ranges, total, total_name, other, types):
    if not len(ranges):
        return
    rev = ranges[:, 0] > ranges[:, 1]
    if rev.any():
        i = int(np.argmax(rev))
        raise ValueError(
            f"{name}[{i}] = [{ranges[i, 0]}, {ranges[i, 1]}) is reversed (start > "
            f"end) in {_fmt_slice(i, *_order(name, ranges[i], other[i]), types[i])};"
            " ranges are half-open [start, end) with start <= end"
        )
    oob = ranges[:, 1] > total
    if oob.any():
        i = int(np.argmax(oob))
        raise ValueError(
            f"{name}[{i}] = [{ranges[i, 0]}, {ranges[i, 1]}) ends past "
            f"{total_name}={total} in "
            f"{_fmt_slice(i, *_order(name, ranges[i], other[i]), types[i])}; "
            f"raise {total_name} or fix the range"
        )


def _order(name, this, other):
    return (this, other) if name == "q_ranges" else (other, this)


def _check_disjoint(mask: AttnMask) -> None:
    """Raises if two slices share a cell.

    Rows are cut into bands at every slice's first and last row. Inside a band each active
    slice's row interval ``[lo(q), hi(q)]`` moves linearly, so sorting the active slices by
    their interval on the band's first row and checking neighbours on its first and last
    rows is exact. Cost O((N + P) log(N + P)) with P the number of (band, active slice)
    pairs — linear for document-like masks, with no pairwise scan."""
    sh = mask.shapes
    idx = np.nonzero(sh.nonempty)[0]
    if len(idx) < 2:
        return
    q0, q1 = sh.q0[idx], sh.q1[idx]
    bounds = np.unique(np.concatenate([q0, q1]))
    first_band = np.searchsorted(bounds, q0)
    end_band = np.searchsorted(bounds, q1)  # exclusive
    # Active slices per band, to cut the bands into chunks of bounded work.
    active = np.zeros(len(bounds), np.int64)
    np.add.at(active, first_band, 1)
    np.add.at(active, end_band, -1)
    per_band = np.cumsum(active)[:-1]
    cum = np.cumsum(per_band)
    b_lo = 0
    while b_lo < len(per_band):
        base = cum[b_lo - 1] if b_lo else 0
        b_hi = max(int(np.searchsorted(cum, base + _OVERLAP_CHUNK, side="right")), b_lo + 1)
        sel = np.nonzero((first_band < b_hi) & (end_band > b_lo))[0]
        fb = np.maximum(first_band[sel], b_lo)
        n = np.minimum(end_band[sel], b_hi) - fb
        pair_slice = np.repeat(sel, n)
        pair_band = np.repeat(fb, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
        _check_band_pairs(mask, idx, pair_slice, pair_band, bounds)
        b_lo = b_hi


def _check_band_pairs(mask, idx, pair_slice, pair_band, bounds):
    sh = mask.shapes
    s = idx[pair_slice]
    r0 = bounds[pair_band]
    r1 = bounds[pair_band + 1] - 1
    lo0, hi0 = sh.lo(r0, s), sh.hi(r0, s)
    lo1, hi1 = sh.lo(r1, s), sh.hi(r1, s)
    order = np.lexsort((hi0, lo0, pair_band))
    same = pair_band[order][1:] == pair_band[order][:-1]
    a, b = order[:-1], order[1:]
    clash = same & ((hi0[a] >= lo0[b]) | (hi1[a] >= lo1[b]))
    if clash.any():
        j = int(np.argmax(clash))
        i1, i2 = sorted((int(s[a[j]]), int(s[b[j]])))
        row = int(r0[a[j]]) if hi0[a[j]] >= lo0[b[j]] else int(r1[a[j]])
        qr, kr, ty = mask.q_ranges, mask.k_ranges, mask.types
        raise ValueError(
            f"{_fmt_slice(i1, qr[i1], kr[i1], ty[i1])} and "
            f"{_fmt_slice(i2, qr[i2], kr[i2], ty[i2])} overlap (first shared cells near query "
            f"row {row}); slices must cover disjoint cells — split or trim one of them"
        )


def _check_total(name: str, value) -> int:
    """A sequence length argument: a non-negative integer."""
    value = value.item() if isinstance(value, np.generic) else value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        if not (isinstance(value, (float, np.floating)) and float(value).is_integer()):
            raise ValueError(f"{name}={value!r} must be an integer number of tokens")
    if value < 0:
        raise ValueError(f"{name}={int(value)} must be >= 0 (a number of tokens)")
    return int(value)


def _cu_seqlens(cu_seqlens) -> np.ndarray:
    """``cu_seqlens`` as int64 ``[num_docs + 1]``, validated (1-D, integers, starts at 0,
    non-decreasing)."""
    arr = np.asarray(cu_seqlens)
    if arr.ndim != 1:
        raise ValueError(
            f"cu_seqlens must be 1-D [num_docs + 1] cumulative lengths [0, n0, n0+n1, ...]; "
            f"got shape {arr.shape}. For a batch of rows, pack them into one sequence (one "
            "cu_seqlens over all the documents, row after row) or use "
            "AttnMask.from_segment_ids with [B, T] segment ids"
        )
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise ValueError(f"cu_seqlens must hold integers; got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.floating) and not np.all(np.mod(arr, 1) == 0):
        bad = int(np.argmax(np.mod(arr, 1) != 0))
        raise ValueError(
            f"cu_seqlens[{bad}] = {arr[bad].item()!r} is not an integer; "
            "cu_seqlens are token offsets"
        )
    cu = arr.astype(np.int64)
    if cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(
            f"cu_seqlens must start at 0 and be non-decreasing; got {cu.tolist()[:16]}"
        )
    return cu


def _doc_lens(doc_lens) -> list[int]:
    arr = np.asarray(doc_lens)
    if not (
        np.issubdtype(arr.dtype, np.integer)
        or (np.issubdtype(arr.dtype, np.floating) and np.all(np.mod(arr, 1) == 0))
    ):
        raise ValueError(f"doc_lens must be integer document lengths; got {doc_lens!r}")
    lens = arr.astype(np.int64).reshape(-1)
    if np.any(lens < 0):
        raise ValueError(f"doc_lens must be >= 0; got {lens.tolist()[:16]}")
    return lens.tolist()


def window_bounds(
    window: int | tuple[int, int] | None, causal: bool
) -> tuple[int | None, int | None]:
    """The one parser of a ``window=`` argument: ``(left, right)`` extents (``None``:
    unbounded); an int ``w`` is ``(w, 0)`` when causal, ``(w, w)`` otherwise."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal={causal!r} must be True or False")
    if window is None:
        return (None, 0) if causal else (None, None)
    if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
        left, right = int(window), (0 if causal else int(window))
    else:
        try:
            left, right = window
            if any(isinstance(w, bool) or int(w) != w for w in (left, right)):
                raise ValueError
            left, right = int(left), int(right)
        except (TypeError, ValueError):
            raise ValueError(
                f"window must be an int or a (left, right) pair of ints; got {window!r}"
            ) from None
    if left < 0 or right < 0:
        raise ValueError(f"window=(left={left}, right={right}) must be >= 0")
    if causal and right != 0:
        raise ValueError(
            f"window right extent {right} contradicts causal=True; use "
            "causal=False with window=(left, right), or right=0"
        )
    return left, right
