"""Masks that cuDNN's packed layout expresses, and the per-document offsets it reads (host
NumPy, no JAX).

cuDNN's fused attention runs packed documents (the "THD" layout) from four int32 arrays:
where each document's queries and keys start (``q_offsets``, ``kv_offsets``) and how many
there are (``q_seqlen``, ``kv_seqlen``). Document ``j``'s queries see document ``j``'s keys
only: all of them (``FULL``) or, with a causal mask, key ``i`` of query ``i`` and those
before, optionally only the last ``window`` of them (a causal sliding window, query ``i``
sees keys ``(i - window, i]``). Tokens outside every document are padding: their rows see
no key.

cuDNN aligns its causal diagonal top-left (query ``i`` sees key ``i``) while our
``CAUSAL`` is bottom-right aligned (docs/masks.md); the two agree on square blocks, so a
causal document here has as many queries as keys. :func:`packed_docs` recognises such a
mask from its slices, cell for cell, or says why not; :func:`packed_arrays` lays the
documents out at a capacity of documents, so the arrays' shapes come from the capacity,
never from the mask.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from magi_jax.masks import AttnMask

__all__ = ["PackedDocs", "PackedArrays", "packed_docs", "packed_arrays", "FULL_DOCS", "CAUSAL_DOCS"]

FULL_DOCS, CAUSAL_DOCS = "full", "causal"
_ORDER = (
    "the documents' key ranges are not in the order of their query ranges (or overlap); "
    "cuDNN's packed layout pairs the j-th query block with the j-th key block"
)


@dataclasses.dataclass(frozen=True)
class PackedDocs:
    """Documents of a mask in cuDNN's packed layout.

    ``kind``: :data:`FULL_DOCS` or :data:`CAUSAL_DOCS`; ``window``: the causal sliding
    window (keys a query sees, itself included; 0: none); ``q_starts``, ``q_lens``,
    ``k_starts``, ``k_lens``: int64 ``[n]``, documents in order along the queries and the
    keys alike; ``total_q``, ``total_k``."""

    kind: str
    window: int
    q_starts: np.ndarray
    q_lens: np.ndarray
    k_starts: np.ndarray
    k_lens: np.ndarray
    total_q: int
    total_k: int

    @property
    def num_docs(self) -> int:
        return int(self.q_starts.size)

    @property
    def dense(self) -> bool:
        """One document over every query and key: cuDNN's unpacked call runs it."""
        return (
            self.num_docs == 1
            and (self.q_starts[0], self.k_starts[0]) == (0, 0)
            and (self.q_lens[0], self.k_lens[0]) == (self.total_q, self.total_k)
        )


class PackedArrays(tuple):
    """``(q_offsets [M + 1], kv_offsets [M + 1], q_seqlen [M], kv_seqlen [M])`` int32 at a
    capacity of ``M`` documents (as :func:`packed_arrays` builds them)."""


def _row_intervals(mask: AttnMask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lo, hi, count)`` int64 ``[total_q]``: each row's first and last visible key and its
    number of cells (slices never share a cell, so the counts add up); ``count = 0`` for a
    row that sees no key."""
    shapes = mask.shapes
    t = mask.total_q
    lo = np.full(t, np.iinfo(np.int64).max, np.int64)
    hi = np.full(t, -1, np.int64)
    count = np.zeros(t, np.int64)
    for s in np.flatnonzero(shapes.nonempty).tolist():
        q = np.arange(shapes.q0[s], shapes.q1[s])
        a, b = shapes.lo(q, s), shapes.hi(q, s)
        rows = slice(int(q[0]), int(q[-1]) + 1)
        np.minimum(lo[rows], a, out=lo[rows])
        np.maximum(hi[rows], b, out=hi[rows])
        count[rows] += b - a + 1
    return lo, hi, count


def _runs(starts: np.ndarray, used: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, end)``: the runs of consecutive ``used`` rows, cut before every ``starts``
    row."""
    prev = np.concatenate([[False], used[:-1]])
    first = np.flatnonzero(used & (starts | ~prev))
    stops = np.flatnonzero(prev & ~used)  # first unused row after a used one
    bounds = np.sort(np.concatenate([first, stops, [used.size]]))
    return first, bounds[np.searchsorted(bounds, first, side="right")]


def packed_docs(mask: AttnMask) -> tuple[PackedDocs | None, str]:
    """``(docs, "")`` when cuDNN's packed layout expresses ``mask`` exactly, else
    ``(None, reason)``.

    It does when the mask is a union of per-document diagonal blocks — each document's
    queries ``[qs, qs + n)`` see only its keys ``[ks, ks + m)`` — in order along queries and
    keys, every block ``FULL``, or every block causal (``n == m``, query ``i`` sees keys up
    to ``i``) with one optional sliding window for all. The check is exact, row by row:
    every row's keys are recomputed from the documents found and compared."""
    if not isinstance(mask, AttnMask):
        raise TypeError(f"mask must be an AttnMask; got {type(mask).__name__}")
    lo, hi, count = _row_intervals(mask)
    used = count > 0
    if not used.any():
        return None, "the mask holds no cell (cuDNN's packed layout needs a document)"
    width = np.where(used, hi - lo + 1, 0)
    if np.any(count != width):
        q = int(np.flatnonzero(count != width)[0])
        return None, (
            f"query {q} sees keys in more than one range (within [{lo[q]}, {hi[q]}]); in "
            "cuDNN's packed layout a query sees one range of its document's keys"
        )
    rows = np.arange(mask.total_q)
    # Full documents: runs of rows that see one same range, the ranges in order.
    same = np.concatenate([[False], (lo[1:] == lo[:-1]) & (hi[1:] == hi[:-1])])
    first, end = _runs(~same, used)
    ks, ke = lo[first], hi[first] + 1
    t = (mask.total_q, mask.total_k)
    if np.all(ks[1:] >= ke[:-1]):
        return PackedDocs(FULL_DOCS, 0, first, end - first, ks, ke - ks, *t), ""
    by_key = np.argsort(ks, kind="stable")
    if np.all(ks[by_key][1:] >= ke[by_key][:-1]):  # full blocks, keys out of order
        return None, _ORDER
    # Causal documents: each starts where a row sees one key (its first key), the rows after
    # it see one more key each (up to the window).
    off = hi - rows
    first, end = _runs((width == 1) | np.concatenate([[True], off[1:] != off[:-1]]), used)
    n = end - first
    ks = lo[first]
    doc_of = np.full(mask.total_q, -1, np.int64)
    for j, (a, b) in enumerate(zip(first.tolist(), end.tolist())):
        doc_of[a:b] = j
    inside = doc_of >= 0
    i = np.where(inside, rows - first[np.maximum(doc_of, 0)], 0)
    base = np.where(inside, ks[np.maximum(doc_of, 0)], 0)
    narrowed = inside & (width < i + 1)
    windows = np.unique(width[narrowed])
    if windows.size > 1:
        return None, (
            f"the documents have causal windows of different widths ({windows[:4].tolist()}); "
            "cuDNN takes one sliding window per call"
        )
    window = int(windows[0]) if windows.size else 0
    want_hi = base + i
    want_lo = np.maximum(base, want_hi - window + 1) if window else base
    bad = inside & ((hi != want_hi) | (lo != want_lo))
    if bad.any():
        q = int(np.flatnonzero(bad)[0])
        j = int(doc_of[q])
        full_rows = np.any(same & inside & (width > 1))
        if full_rows and np.any(width[inside] == 1):
            return None, (
                "documents mix full blocks and causal ones (or a block is neither); cuDNN "
                "takes one mask type per call"
            )
        return None, (
            f"query {q} sees keys [{lo[q]}, {hi[q]}]: neither a full block nor a square causal "
            f"one (as document {j} from query {first[j]}, key {ks[j]} it would see "
            f"[{want_lo[q]}, {want_hi[q]}]); cuDNN's causal diagonal is top-left aligned, ours "
            "bottom-right: they agree where a document has as many queries as keys"
        )
    if np.any(ks[1:] < ks[:-1] + n[:-1]):
        return None, _ORDER
    return PackedDocs(CAUSAL_DOCS, window, first, n, ks, n.copy(), *t), ""


def packed_arrays(docs: PackedDocs, max_docs: int) -> PackedArrays:
    """The documents as the operands of JAX's cuDNN call for one batch row, at a capacity of
    ``max_docs`` documents (``>= 2``: offsets of one entry would read as an unpacked call):
    ``q_offsets [M + 1]``, ``kv_offsets [M + 1]`` (each document's first query and key),
    ``q_seqlen [M]``, ``kv_seqlen [M]`` (their counts); unused entries are -1 (JAX shifts
    the documents of every batch row to the front and ends them with the batch's size, so
    a row lists starts only). int32; shapes from ``max_docs`` alone. ``ValueError`` naming
    ``max_docs`` when the documents do not fit."""
    if isinstance(max_docs, bool) or int(max_docs) != max_docs or int(max_docs) < 2:
        raise ValueError(f"max_docs={max_docs!r} must be an integer >= 2")
    cap = int(max_docs)
    n = docs.num_docs
    if n > cap:
        raise ValueError(
            f"the mask has {n} documents but max_docs={cap}; raise max_docs to at least {n}"
        )
    q_off = np.full(cap + 1, -1, np.int32)
    k_off = np.full(cap + 1, -1, np.int32)
    q_len = np.full(cap, -1, np.int32)
    k_len = np.full(cap, -1, np.int32)
    q_off[:n] = docs.q_starts
    k_off[:n] = docs.k_starts
    q_len[:n] = docs.q_lens
    k_len[:n] = docs.k_lens
    return PackedArrays((q_off, k_off, q_len, k_len))
