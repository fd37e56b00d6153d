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

from magi_jax.mask import AttnMask

__all__ = ["PackedDocs", "PackedArrays", "packed_docs", "packed_arrays", "FULL_DOCS", "CAUSAL_DOCS"]

FULL_DOCS, CAUSAL_DOCS = "full", "causal"


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


def _components(shapes, keep: np.ndarray) -> np.ndarray:
    """Labels of the slices ``keep`` joined when their query rows or their key columns
    overlap (a document's slices share rows or columns; two documents share neither)."""
    idx = np.flatnonzero(keep)
    parent = np.arange(idx.size)

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for lo, hi in ((shapes.q0, shapes.q1), (shapes.k0, shapes.k1)):
        lo, hi = lo[idx], hi[idx]
        order = np.argsort(lo, kind="stable")
        reach, head = -1, -1
        for i in order.tolist():
            if lo[i] < reach:
                a, b = find(i), find(head)
                if a != b:
                    parent[a] = b
            else:
                head = i
            reach = max(reach, int(hi[i]))
    return np.array([find(i) for i in range(idx.size)], np.int64)


def _cell_bounds(shapes, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least and largest ``k - q`` over the cells of the slices ``idx`` (their row bounds
    are linear, so the ends of the rows decide)."""
    first, last = shapes.q0[idx], shapes.q1[idx] - 1
    lo = np.minimum(shapes.lo(first, idx) - first, shapes.lo(last, idx) - last)
    hi = np.maximum(shapes.hi(first, idx) - first, shapes.hi(last, idx) - last)
    return lo, hi


def _band_area(n: np.ndarray, w: int) -> np.ndarray:
    """Cells of a causal ``n x n`` block whose rows see at most ``w`` keys."""
    m = np.minimum(n, w)
    return m * (m + 1) // 2 + (n - m) * w


def packed_docs(mask: AttnMask) -> tuple[PackedDocs | None, str]:
    """``(docs, "")`` when cuDNN's packed layout expresses ``mask`` exactly, else
    ``(None, reason)``.

    It does when the mask is a union of per-document diagonal blocks — each document's
    queries ``[qs, qs + n)`` see only its keys ``[ks, ks + m)`` — in order along queries and
    keys, every block ``FULL``, or every block causal (``n == m``, query ``i`` sees keys up
    to ``i``) with one optional sliding window for all. The check is exact: cells are
    counted, not sampled."""
    if not isinstance(mask, AttnMask):
        raise TypeError(f"mask must be an AttnMask; got {type(mask).__name__}")
    shapes = mask.shapes
    keep = shapes.nonempty
    if not keep.any():
        return None, "the mask holds no cell (cuDNN's packed layout needs a document)"
    idx = np.flatnonzero(keep)
    label = _components(shapes, keep)
    groups = np.unique(label)
    areas = shapes.areas()[idx]
    dlo, dhi = _cell_bounds(shapes, idx)
    q_starts, q_ends, k_starts, k_ends, doc_area, doc_dlo, doc_dhi = ([] for _ in range(7))
    for g in groups.tolist():
        mine = label == g
        sel = idx[mine]
        q_starts.append(shapes.q0[sel].min())
        q_ends.append(shapes.q1[sel].max())
        k_starts.append(shapes.k0[sel].min())
        k_ends.append(shapes.k1[sel].max())
        doc_area.append(areas[mine].sum())
        doc_dlo.append(dlo[mine].min())
        doc_dhi.append(dhi[mine].max())
    qs, qe, ks, ke = (np.array(a, np.int64) for a in (q_starts, q_ends, k_starts, k_ends))
    area, dmin, dmax = (np.array(a, np.int64) for a in (doc_area, doc_dlo, doc_dhi))
    order = np.argsort(qs, kind="stable")
    qs, qe, ks, ke, area, dmin, dmax = (a[order] for a in (qs, qe, ks, ke, area, dmin, dmax))
    if np.any(np.diff(ks) <= 0) or np.any(ks[1:] < ke[:-1]) or np.any(qs[1:] < qe[:-1]):
        return None, (
            "the documents' key ranges are not in the order of their query ranges (or "
            "overlap); cuDNN's packed layout pairs the j-th query block with the j-th key "
            "block"
        )
    n, m = qe - qs, ke - ks
    # Slices inside a block may leave its cells partly uncovered; the counts decide.
    if np.all(area == n * m):
        return PackedDocs(FULL_DOCS, 0, qs, n, ks, m, mask.total_q, mask.total_k), ""
    off = ks - qs  # k - q on a block's main diagonal
    full = (area == n * m) & (n > 1) & (m > 1)
    causal = (n == m) & (dmax <= off)
    if np.any(~causal & ~full):
        j = int(np.flatnonzero(~causal & ~full)[0])
        return None, (
            f"document {j} (queries [{qs[j]}, {qe[j]}), keys [{ks[j]}, {ke[j]})) is neither "
            "a full block nor a square causal one (cuDNN's causal diagonal is top-left "
            "aligned, ours bottom-right: they agree where a document has as many queries as "
            "keys)"
        )
    if np.any(~causal):
        j = int(np.flatnonzero(~causal)[0])
        return None, (
            f"documents mix full blocks (document {j}, queries [{qs[j]}, {qe[j]})) and causal "
            "ones; cuDNN takes one mask type per call"
        )
    # Causal blocks with a window w: every cell has k - q > off - w, and the cells fill it.
    width = (off - dmin + 1).astype(np.int64)  # keys the widest row of a block sees
    cut = width < n  # blocks the window narrows
    window = int(width[cut].max()) if cut.any() else 0
    if cut.any() and np.any(width[cut] != window):
        return None, (
            f"the documents have causal windows of different widths "
            f"({sorted(set(width[cut].tolist()))[:4]}); cuDNN takes one sliding window per call"
        )
    want = _band_area(n, window) if window else n * (n + 1) // 2
    if np.any(area != want):
        j = int(np.flatnonzero(area != want)[0])
        what = f"causal with a window of {window} keys" if window else "causal"
        return None, (
            f"document {j} (queries [{qs[j]}, {qe[j]})) holds {int(area[j])} cells, not the "
            f"{int(want[j])} of a {what} block: it has holes or extra cells"
        )
    return PackedDocs(CAUSAL_DOCS, window, qs, n, ks, m, mask.total_q, mask.total_k), ""


def packed_arrays(docs: PackedDocs, max_docs: int) -> PackedArrays:
    """The documents as cuDNN's packed-layout operands at a capacity of ``max_docs``
    documents (``>= 2``: one row of offsets with a single entry reads as an unpacked call):
    ``q_offsets [M + 1]``, ``kv_offsets [M + 1]`` (each document's first token, then the end
    of the last one), ``q_seqlen [M]``, ``kv_seqlen [M]``; unused entries are -1. int32;
    shapes from ``max_docs`` alone. ``ValueError`` naming ``max_docs`` when the documents
    do not fit."""
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
    q_off[n] = docs.q_starts[-1] + docs.q_lens[-1]
    k_off[n] = docs.k_starts[-1] + docs.k_lens[-1]
    q_len[:n] = docs.q_lens
    k_len[:n] = docs.k_lens
    return PackedArrays((q_off, k_off, q_len, k_len))
