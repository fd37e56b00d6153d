"""Attention masks as lists of slices: what a mask *is* (docs/masks.md).

A mask over packed queries ``[0, total_q)`` and keys ``[0, total_k)`` is the union of slices
``(q_range, k_range, type)``. Every slice, whatever its type, is one *shape*: the lattice cells

    q ∈ [q0, q1),  k ∈ [k0, k1),  dlo <= k - q <= dhi

(``dlo``/``dhi`` possibly unbounded). That canonical form (:class:`SliceShapes`) is what the
validator, the area, the dense view and every planner downstream work with; constructors
describe masks as shapes and turn them back into typed slices with :func:`shape_to_slices`.

The pieces live below this module and are re-exported here: the slice types and the
canonical form in :mod:`magi_jax.masks.slices`, the checks of every argument in
:mod:`magi_jax.masks._checks`, and the row-run algorithms behind :meth:`AttnMask.from_fn`,
:meth:`AttnMask.from_dense`, :meth:`AttnMask.from_block_mask` and ``|``, ``&``, ``-`` in
:mod:`magi_jax.masks._row_runs`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from magi_jax.masks._checks import (
    as_ranges,
    as_types,
    check_bounds,
    check_cu_seqlens,
    check_disjoint,
    check_doc_lens,
    check_total,
    drop_empty_past_end,
    window_bounds,
)
from magi_jax.masks._row_runs import (
    DEFAULT_BLOCK,
    combine_runs,
    shape_runs,
    slices_from_block_mask,
    slices_from_dense,
    slices_from_fn,
)
from magi_jax.masks.slices import AttnMaskType, SliceShapes, shape_to_slices

if TYPE_CHECKING:  # annotations only (matplotlib is the plot extra)
    from matplotlib.figure import Figure


# Largest dense view to_dense() agrees to build (bool cells).
_MAX_DENSE_CELLS = 1 << 28


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
        self,
        q_ranges: ArrayLike,
        k_ranges: ArrayLike,
        types: str | AttnMaskType | ArrayLike,
        total_q: int | None = None,
        total_k: int | None = None,
    ) -> None:
        qr = as_ranges("q_ranges", q_ranges)
        kr = as_ranges("k_ranges", k_ranges)
        if len(qr) != len(kr):
            raise ValueError(
                f"q_ranges has {len(qr)} slices but k_ranges has {len(kr)}; give "
                "one k_range per q_range"
            )
        types = as_types(types, len(qr))
        total_q = None if total_q is None else check_total("total_q", total_q)
        total_k = None if total_k is None else check_total("total_k", total_k)
        qr, kr, types = drop_empty_past_end(qr, kr, types, total_q, total_k)
        total_q = int(qr[:, 1].max(initial=0)) if total_q is None else total_q
        total_k = int(kr[:, 1].max(initial=0)) if total_k is None else total_k
        check_bounds("q_ranges", qr, total_q, "total_q", kr, types)
        check_bounds("k_ranges", kr, total_k, "total_k", qr, types)
        self._q_ranges = _frozen(qr.astype(np.int32))
        self._k_ranges = _frozen(kr.astype(np.int32))
        self._types = _frozen(types.astype(np.int32))
        self._total_q = total_q
        self._total_k = total_k
        check_disjoint(self.shapes, self._q_ranges, self._k_ranges, self._types)
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
        runs = [shape_runs(m.shapes, m.total_q, m.total_k) for m in (self, other)]
        return AttnMask(*combine_runs(*runs, op))

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

    def plot(self, path: str | os.PathLike | None = None, **kwargs: Any) -> Figure:
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

    def save(self, path: str | os.PathLike) -> None:
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
    def load(cls, path: str | os.PathLike) -> "AttnMask":
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
        cls,
        q_ranges: ArrayLike,
        k_ranges: ArrayLike,
        types: str | AttnMaskType | ArrayLike,
        total_q: int | None = None,
        total_k: int | None = None,
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
        blocks (0 empty, 1 full, 2 evaluate). See :func:`magi_jax.masks._row_runs.slices_from_fn`.

        >>> AttnMask.from_fn(lambda q, k: (k <= q) & (q - k < 2), 4, 4).area
        7
        """
        return AttnMask(
            *slices_from_fn(
                fn,
                total_q,
                total_k,
                block=DEFAULT_BLOCK if block is None else block,
                blocks=blocks,
                check_blocks=check_blocks,
            )
        )

    @classmethod
    def from_dense(cls, dense: np.ndarray) -> "AttnMask":
        """The mask of a bool array ``[total_q, total_k]`` (True = attend), as slices (small
        masks; :meth:`from_fn` for large ones).

        >>> AttnMask.from_dense(np.tril(np.ones((4, 4), bool))).slices()
        [((0, 4), (0, 4), <AttnMaskType.CAUSAL: 1>)]
        """
        return AttnMask(*slices_from_dense(dense))

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
        :func:`magi_jax.masks._row_runs.slices_from_block_mask`.

        >>> AttnMask.from_block_mask(np.array([[1, 0], [1, 1]], bool), 2, 2).slices()
        [((0, 2), (0, 2), <AttnMaskType.FULL: 0>), ((2, 4), (0, 4), <AttnMaskType.FULL: 0>)]
        """
        return AttnMask(*slices_from_block_mask(block_mask, block_q, block_k, total_q, total_k, fn))

    @classmethod
    def full(cls, total_q: int, total_k: int | None = None) -> "AttnMask":
        """Every query sees every key.

        >>> AttnMask.full(4, 6).area
        24
        """
        total_q = check_total("total_q", total_q)
        total_k = total_q if total_k is None else check_total("total_k", total_k)
        return cls([[0, total_q]], [[0, total_k]], [AttnMaskType.FULL], total_q, total_k)

    @classmethod
    def causal(cls, total_q: int, total_k: int | None = None) -> "AttnMask":
        """Causal, bottom-right aligned when ``total_q != total_k`` (the last query sees
        every key).

        >>> AttnMask.causal(4).area
        10
        """
        total_q = check_total("total_q", total_q)
        total_k = total_q if total_k is None else check_total("total_k", total_k)
        return cls([[0, total_q]], [[0, total_k]], [AttnMaskType.CAUSAL], total_q, total_k)

    @classmethod
    def varlen(
        cls,
        cu_seqlens: ArrayLike,
        causal: bool = True,
        window: int | tuple[int, int] | None = None,
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
        cu = check_cu_seqlens(cu_seqlens)
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
        segment_ids: ArrayLike,
        causal: bool = True,
        window: int | tuple[int, int] | None = None,
        *,
        per_row: bool = False,
    ) -> "AttnMask | list[AttnMask]":
        """Packed documents given by per-token segment ids (``jax.nn``'s / Flax's
        ``segment_ids``).

        ``segment_ids``: int ``[T]`` or ``[B, T]``. Every maximal run of one positive id is
        a document that attends only to itself; ids 0 and below are padding (pipelines pad
        with 0 or -1): their tokens attend nothing and are attended by nothing. A ``[B, T]``
        array packs its rows into one sequence of ``B·T`` tokens (row ``b`` at ``[b·T,
        (b+1)·T)``, see :func:`magi_jax.ffa.device_planner.pack_rows`); documents never cross rows.
        ``causal`` (default ``True``, like :meth:`varlen` and
        :func:`magi_jax.make_varlen_key`): causal inside each document. ``window``: as in
        :meth:`varlen` — ``(left, right)``, query ``q`` sees keys ``[q - left, q + right]``
        of its document, or an int ``w`` meaning ``(w, 0)`` when causal, ``(w, w)``
        otherwise. Raises ``ValueError`` when one positive id appears in two separate runs of
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
            keep = row[starts] > 0  # ids <= 0: padding
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
        total = check_total("total", total)
        left, right = check_total("left", left), check_total("right", right)
        return cls.varlen([0, total], causal=False, window=(left, right))

    @classmethod
    def block_causal(cls, doc_lens: int | ArrayLike, block_size: int) -> "AttnMask":
        """Inside each document, the queries of a block see their own block and every
        earlier block of the document fully (video-chunk style); documents do not see
        each other.

        >>> AttnMask.block_causal([5], 2).area  # blocks [0,2) [2,4) [4,5) see 2, 4, 5 keys
        17
        """
        lens = check_doc_lens(doc_lens)
        if check_total("block_size", block_size) == 0:
            raise ValueError(f"block_size={block_size} must be positive")
        slices, start = [], 0
        for n in lens:
            for b in range(0, n, block_size):
                e = min(b + block_size, n)
                slices.append((start + b, start + e, start, start + e, AttnMaskType.FULL))
            start += n
        return cls._from_list(slices, start, start)

    @classmethod
    def prefix_lm(cls, doc_lens: int | ArrayLike, prefix_lens: int | ArrayLike) -> "AttnMask":
        """Prefix-LM: in each document the first ``prefix_len`` tokens see the whole prefix
        bidirectionally, later tokens are causal. ``doc_lens`` is an int (one document) or a
        list; ``prefix_lens`` an int for all documents or one per document.

        >>> AttnMask.prefix_lm(5, 2).area   # 2*2 prefix + rows 2..4 see 3, 4, 5 keys
        16
        """
        lens = check_doc_lens(doc_lens)
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
    def shared_question(cls, doc_lens: int | ArrayLike) -> "AttnMask":
        """Shared question: documents 0 and 1 form one causal block (question + first
        answer); every later document (another answer) is causal within itself and also sees
        document 0 (the question) fully.

        >>> AttnMask.shared_question([2, 1, 2]).area   # causal 3 + (2*2 + 3)
        13
        """
        lens = check_doc_lens(doc_lens)
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
    def causal_blockwise(cls, doc_lens: int | ArrayLike) -> "AttnMask":
        """Varlen causal, except that the last document attends causally over the whole
        packed prefix (all earlier documents and itself).

        >>> AttnMask.causal_blockwise([2, 2]).area   # 3 + (3 + 4)
        10
        """
        lens = check_doc_lens(doc_lens)
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
        total = check_total("total", total)
        window = check_total("window", window)
        num_global = check_total("num_global", num_global)
        slices = shape_to_slices(0, total, 0, total, -window, 0)
        # Global keys not already inside the window: k < num_global and k < q - window.
        slices += shape_to_slices(0, total, 0, min(num_global, total), None, -window - 1)
        return cls._from_list(slices, total, total)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def _refuse(mask: AttnMask):
    raise TypeError(
        f"an AttnMask ({mask!r}) cannot be an argument of a jitted function: a mask is a "
        "compile-time constant (host slices), not an array. Close over it (jax.jit(lambda "
        "q, k, v: mj.flex_flash_attention(q, k, v, mask))), mark it static "
        "(jax.jit(f, static_argnames='mask'); each new mask compiles anew), or pass it as "
        "data: an AttnPlan, mj.plan_attention(mask, mj.PlanCapacity(...)), whose arrays "
        "serve every mask of one capacity with one compilation (under CP: a key built at "
        "a capacity, make_flex_key(..., capacity=cap))"
    )


def refuse_as_jit_argument() -> None:
    """Makes JAX's refusal of an :class:`AttnMask` passed to a jitted function say what to
    do instead (JAX raises its own ``TypeError`` with this one as its cause, as it does for
    a ``str``). Installed when JAX is imported (here if it already is, else by
    :mod:`magi_jax.ffa`), so that importing the masks alone does not import JAX."""
    import jax._src.core as jax_core  # the table JAX reads an argument's type from

    jax_core.pytype_aval_mappings.setdefault(AttnMask, _refuse)


if "jax" in sys.modules:
    refuse_as_jit_argument()
