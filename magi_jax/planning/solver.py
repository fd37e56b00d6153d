"""Dispatch solver: which chunks of the packed sequence each context-parallel rank owns.

Host-only NumPy, pure and deterministic (docs/design.md). The packed sequence (queries and
keys share positions: self-attention) is padded to ``num_chunks · chunk_size`` tokens and cut
into equal chunks; every rank gets the same number of chunks (hence of tokens). The compute of
a rank is the mask area of its *query* rows, so each chunk's weight is the exact area of the
mask restricted to its rows (slices clipped in canonical form, so a clipped bottom-right
CAUSAL slice keeps its alignment).

Algorithms (``algorithm=``):

- ``"magi"`` (default): two starts — ``"greedy"`` and a communication-aware greedy (a chunk
  goes to the rank that already holds most of the keys it sees, among those where it fits
  under the mean load) — each followed by a pairwise-swap refinement that moves area from the
  most loaded rank to another until no swap lowers the maximum (for the affinity start,
  among the good swaps the one that keeps chunks near the keys they see); the affinity start
  is kept when it balances as well. Then a communication pass swaps chunks between ranks when that
  lowers the remote-KV volume (chunk-level proxy) without raising the maximum area. The chunk
  count per rank is chosen automatically (8, 16, 32 or 64 chunks per rank; the fewest that
  reach max/mean ≤ 1.01).
- ``"greedy"``: chunks sorted by area (descending) go one by one to the least loaded rank
  that still has room (min-heap, equal cardinality) — the MagiAttention baseline.
- ``"contiguous"``: rank ``r`` holds the ``r``-th contiguous block.
- ``"zigzag"``: dual-chunk swap (ring/zigzag attention): rank ``r`` holds block ``r`` and block
  ``2·cp − 1 − r`` of ``2·cp`` blocks.
- ``"striped"``: chunk ``i`` goes to rank ``i mod cp``.

Cross-attention (``total_q != total_k``: queries of one sequence, keys of another) dispatches
the queries the same way, by the area of their rows; the communication-aware passes of
``"magi"`` compare query chunks with the key chunks they see, which only means something when
both are chunks of one sequence, so on a cross mask ``"magi"`` balances the area alone. The
keys then take one of two layouts (:func:`auto_kv_layout`): every rank holds all of them
(``"replicated"``), or they are cut into chunks of their own that go to the ranks whose
queries see them most (``"dispatched"``, :func:`solve_kv_dispatch`).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import numpy as np

from magi_jax.caches import cached
from magi_jax.masks import AttnMask, SliceShapes
from magi_jax.planning.intervals import merge_intervals, ranges_repeat

__all__ = [
    "ALGORITHMS",
    "DispatchMeta",
    "solve_dispatch",
    "chunk_areas",
    "needed_kv",
    "remote_kv_tokens",
    "auto_chunk_size",
    "KV_LAYOUTS",
    "auto_kv_layout",
    "solve_kv_dispatch",
    "kv_chunk_size",
]

ALGORITHMS = ("magi", "greedy", "contiguous", "zigzag", "striped")
# Where the keys of a cross-attention plan live (``"auto"``: :func:`auto_kv_layout`).
KV_LAYOUTS = ("auto", "replicated", "dispatched")
# Cross attention replicates the keys when total_k <= this times a rank's share of the
# queries: the copy of K and V then costs each rank no more memory than its own queries' K/V
# would, and the forward moves nothing.
_REPLICATE_KV_RATIO = 1.0
# Key chunks per rank of a dispatched key sequence: finer chunks follow the query chunks
# that see them more closely (less to fetch) at the price of more, shorter cast pieces.
_KV_CHUNKS_PER_RANK = 16
# Candidate chunks per rank for the automatic chunk size, fewest first.
_AUTO_CHUNKS_PER_RANK = (8, 16, 32, 64)
# Imbalance (max/mean area) the automatic chunk size is content with.
_AUTO_TARGET = 1.01
# Upper bound on the swap-refinement iterations (each one strictly lowers the objective).
_MAX_SWAPS_PER_RANK = 64
# Candidate swaps the communication pass may score, per chunk (bounds planning time).
_COMM_EVALS_PER_CHUNK = 8
# Chunk counts (squared) up to which held key counts are summed by a product with the
# incidence matrix (float32, exact) rather than by cumulative sums over the CSR.
_SEEN_SUMS_MATMUL_MAX = 1 << 22


@dataclasses.dataclass(frozen=True)
class DispatchMeta:
    """Where every token lives. Chunk ``c`` holds global positions
    ``[c·chunk_size, (c+1)·chunk_size)``; rank ``r`` holds chunks ``rank_chunks[r]`` (sorted
    ascending) back to back, so its local token ``i`` is global position
    ``rank_chunks[r, i // chunk_size]·chunk_size + i % chunk_size``. Positions ``>= total``
    are padding (their queries attend to nothing, nothing attends to their keys)."""

    total: int
    cp: int
    chunk_size: int
    rank_chunks: np.ndarray  # int64 [cp, chunks_per_rank]
    algorithm: str
    chunk_area: np.ndarray  # int64 [num_chunks]

    @property
    def chunks_per_rank(self) -> int:
        return self.rank_chunks.shape[1]

    @property
    def num_chunks(self) -> int:
        return self.rank_chunks.size

    @property
    def padded_total(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def local_len(self) -> int:
        """Tokens per rank (equal on every rank)."""
        return self.chunks_per_rank * self.chunk_size

    @functools.cached_property
    def chunk_owner(self) -> np.ndarray:
        """int64 [num_chunks]: the rank that owns each chunk."""
        owner = np.empty(self.num_chunks, np.int64)
        owner[self.rank_chunks.reshape(-1)] = np.repeat(np.arange(self.cp), self.chunks_per_rank)
        return owner

    @functools.cached_property
    def chunk_slot(self) -> np.ndarray:
        """int64 [num_chunks]: the position of each chunk inside its owner's local tokens."""
        slot = np.empty(self.num_chunks, np.int64)
        slot[self.rank_chunks.reshape(-1)] = np.tile(np.arange(self.chunks_per_rank), self.cp)
        return slot

    @functools.cached_property
    def positions(self) -> np.ndarray:
        """int64 [cp, local_len]: global position of every local token of every rank."""
        c = self.chunk_size
        return (self.rank_chunks[:, :, None] * c + np.arange(c)).reshape(self.cp, -1)

    def rank_area(self) -> np.ndarray:
        """int64 [cp]: mask area of each rank's queries."""
        return self.chunk_area[self.rank_chunks].sum(axis=1)

    def imbalance(self) -> float:
        """max / mean of the per-rank area (1.0 for an empty mask)."""
        a = self.rank_area()
        return float(a.max() / a.mean()) if a.sum() else 1.0

    def fingerprint(self) -> tuple:
        return (self.total, self.cp, self.chunk_size, self.rank_chunks.tobytes())


def _shape_rows_area(sh: SliceShapes, s: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Area of (kink-free, canonical) slices ``s`` restricted to rows ``[a, b)``."""
    rows = b - a
    first = sh.hi(a, s) - sh.lo(a, s) + 1
    last = sh.hi(b - 1, s) - sh.lo(b - 1, s) + 1
    return np.where(rows > 0, rows * (first + last) // 2, 0)


def slice_chunk_pairs(sh: SliceShapes, chunk_size: int) -> tuple[np.ndarray, ...]:
    """Every (slice, query chunk) pair with cells: ``(slice, chunk, row_a, row_b, k_first,
    k_end)`` — the slice's rows inside the chunk and the (contiguous) key extent they see."""
    live = np.nonzero(sh.nonempty)[0]
    owner, chunk = ranges_repeat(sh.q0[live] // chunk_size, (sh.q1[live] - 1) // chunk_size + 1)
    s = live[owner]
    a = np.maximum(sh.q0[s], chunk * chunk_size)
    b = np.minimum(sh.q1[s], (chunk + 1) * chunk_size)
    # Row intervals move monotonically and consecutive rows' intervals touch, so the keys seen
    # by rows [a, b) are exactly [lo(a), hi(b - 1)].
    return s, chunk, a, b, sh.lo(a, s), sh.hi(b - 1, s) + 1


def chunk_areas(mask: AttnMask, chunk_size: int, num_chunks: int) -> np.ndarray:
    """int64 [num_chunks]: exact mask area of each chunk's query rows."""
    sh = mask.shapes
    s, chunk, a, b, _, _ = slice_chunk_pairs(sh, chunk_size)
    return np.bincount(chunk, weights=_shape_rows_area(sh, s, a, b), minlength=num_chunks).astype(
        np.int64
    )[:num_chunks]


def needed_kv(mask: AttnMask, meta: DispatchMeta) -> list[np.ndarray]:
    """Per rank, the merged global key intervals ``int64 [n, 2]`` its queries see."""
    s, chunk, a, b, k0, k1 = slice_chunk_pairs(mask.shapes, meta.chunk_size)
    rank = meta.chunk_owner[chunk]
    out = []
    order = np.lexsort((k0, rank))
    rank, k0, k1 = rank[order], k0[order], k1[order]
    bounds = np.searchsorted(rank, np.arange(meta.cp + 1))
    for r in range(meta.cp):
        out.append(merge_intervals(k0[bounds[r] : bounds[r + 1]], k1[bounds[r] : bounds[r + 1]]))
    return out


def _coverage(intervals: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Number of tokens of the disjoint sorted ``intervals`` below each ``x``."""
    if not len(intervals):
        return np.zeros_like(x)
    lengths = intervals[:, 1] - intervals[:, 0]
    cum = np.concatenate([[0], np.cumsum(lengths)])
    i = np.searchsorted(intervals[:, 0], x, side="right")  # intervals starting <= x
    inside = np.where(
        i > 0,
        np.minimum(x, intervals[np.maximum(i - 1, 0), 1]) - intervals[np.maximum(i - 1, 0), 0],
        0,
    )
    return cum[np.maximum(i - 1, 0)] * (i > 0) + inside


def remote_kv_tokens(mask: AttnMask, meta: DispatchMeta) -> np.ndarray:
    """int64 [cp]: key tokens each rank needs from other ranks (each counted once)."""
    need = needed_kv(mask, meta)
    c = meta.chunk_size
    out = np.zeros(meta.cp, np.int64)
    for r in range(meta.cp):
        iv = need[r]
        total = int((iv[:, 1] - iv[:, 0]).sum())
        ch = meta.rank_chunks[r]
        local = _coverage(iv, (ch + 1) * c) - _coverage(iv, ch * c)
        out[r] = total - int(local.sum())
    return out


# ---- assignment algorithms -------------------------------------------------------------------


def _contiguous(n: int, cp: int, area: np.ndarray) -> np.ndarray:
    return np.arange(n).reshape(cp, -1)


def _striped(n: int, cp: int, area: np.ndarray) -> np.ndarray:
    return np.arange(n).reshape(-1, cp).T.copy()


def _zigzag(n: int, cp: int, area: np.ndarray) -> np.ndarray:
    blocks = np.arange(n).reshape(2 * cp, -1)
    return np.concatenate([blocks[:cp], blocks[::-1][:cp]], axis=1)


def _greedy(n: int, cp: int, area: np.ndarray) -> np.ndarray:
    """Longest-processing-time first with equal cardinality: a min-heap of (load, rank) over
    the ranks that still have room; ties go to the lower chunk id / lower rank."""
    m = n // cp
    order = np.lexsort((np.arange(n), -area))
    heap = [(0, r) for r in range(cp)]
    assign = [[] for _ in range(cp)]
    for c in order.tolist():
        load, r = heapq.heappop(heap)
        assign[r].append(c)
        if len(assign[r]) < m:
            heapq.heappush(heap, (load + int(area[c]), r))
    return np.array(assign, np.int64)


def _greedy_affinity(
    n: int, cp: int, area: np.ndarray, mask: AttnMask, chunk_size: int
) -> np.ndarray:
    """Communication-aware greedy: chunks by decreasing area; a chunk goes to the rank that
    already holds (owns or needs) most of the key chunks it sees, among the ranks with room
    where it still fits under the mean load; when it fits nowhere, to the least loaded rank
    with room (plain greedy). Chunks that see each other's keys end up together, so ranks
    fetch less; the swap pass then restores the balance the tie-break gave up."""
    m = n // cp
    indptr, kc = _chunk_kv_extents(mask, chunk_size, n)
    if not _local_enough(kc, n):  # dense: every rank needs nearly everything anyway
        return _greedy(n, cp, area)
    order = np.lexsort((np.arange(n), -area))
    target = area.sum() / cp
    loads = np.zeros(cp, np.int64)
    counts = np.zeros(cp, np.int64)
    have = np.zeros((cp, n), np.int32)
    assign = [[] for _ in range(cp)]
    for x in order.tolist():
        seen = kc[indptr[x] : indptr[x + 1]]
        room = counts < m
        fits = room & (loads + area[x] <= target)
        if fits.any():
            score = have[:, seen].sum(axis=1) + have[:, x]
            # Highest affinity, then lowest load, then lowest rank.
            key = np.where(
                fits, score * (1 << 20) - np.argsort(np.argsort(loads, kind="stable")), -1 << 62
            )
            r = int(np.argmax(key))
        else:
            r = int(np.argmin(np.where(room, loads, np.iinfo(np.int64).max)))
        assign[r].append(x)
        loads[r] += area[x]
        counts[r] += 1
        have[r, seen] = 1
        have[r, x] = 1
    return np.array(assign, np.int64)


def _refine_swaps(assign: np.ndarray, area: np.ndarray, locality=None) -> np.ndarray:
    """Pairwise swaps between the most loaded rank and any other rank, each one strictly
    lowering the larger of the two loads below the current maximum; stops at a local optimum.
    Keeps the number of chunks per rank. For every (other rank, chunk of the top rank) only
    the two chunks nearest to the ideal exchange are tried (sorted search), so an iteration
    costs O(cp·m·log m).

    ``locality = (indptr, key_chunks)`` (the CSR of which key chunks each chunk's rows see)
    makes the choice communication-aware: among the swaps that achieve at least half of the
    best possible reduction, the one whose chunks land where most of the keys they see
    already are (owned or already needed) wins."""
    assign = assign.copy()
    cp, m = assign.shape
    n = assign.size
    loads = area[assign].sum(axis=1)
    if locality is not None:
        indptr, kc = locality
        owner = np.empty(n, np.int64)
        owner[assign.reshape(-1)] = np.repeat(np.arange(cp), m)
        slot = np.empty(n, np.int64)
        slot[assign.reshape(-1)] = np.tile(np.arange(m), cp)
        need = np.zeros((cp, n), np.int64)
        np.add.at(need, (owner[np.repeat(np.arange(n), np.diff(indptr))], kc), 1)
        seg = np.repeat(np.arange(n), np.diff(indptr))  # chunk of each CSR entry
        # Which chunks' keys each rank holds (owns or needs); a swap changes two rows.
        hold = (need > 0) | (owner[None, :] == np.arange(cp)[:, None])  # [cp, n]
        # has[q, x]: keys of chunk x that rank q holds; kept up to date through the key
        # chunks -> query chunks CSR (those whose rows see each key chunk).
        has = _seen_sums(hold, indptr, kc)
        by_key = np.argsort(kc, kind="stable")
        key_ptr = np.searchsorted(kc[by_key], np.arange(n + 1))
        key_of = seg[by_key]  # query chunk of each entry
    for _ in range(_MAX_SWAPS_PER_RANK * cp):
        top = int(np.argmax(loads))
        gap = loads[top] - loads  # [cp]
        order = np.argsort(area[assign], axis=1, kind="stable")
        b = np.take_along_axis(area[assign], order, axis=1)  # [cp, m] sorted
        a = area[assign[top]]  # [m]
        # Ideal partner area: a_i - gap_r / 2 (the swap then evens the pair).
        target = a[None, :] - gap[:, None] // 2  # [cp, m]
        above = _row_searchsorted(b, target)
        j = np.stack([above, above - 1], -1)
        j = np.clip(j, 0, m - 1)  # [cp, m, 2]
        rows = np.arange(cp)[:, None, None]
        bj = b[rows, j]  # [cp, m, 2]
        d = a[None, :, None] - bj
        new_max = np.maximum(loads[top] - d, loads[:, None, None] + d)
        ok = (d > 0) & (new_max < loads[top])
        ok[top] = False
        if not ok.any():
            break
        big = np.iinfo(np.int64).max
        if locality is None:
            flat = np.where(ok, new_max, big).reshape(-1)
            r, i, t = np.unravel_index(int(np.argmin(flat)), d.shape)
        else:
            best = new_max[ok].min()
            good = ok & (new_max <= best + (loads[top] - best) // 2)
            # Keys of chunk y already held by the top rank; keys of x held by each rank.
            top_has = has[top]
            y = assign[rows, order[rows, j]]
            r_has = has[:, assign[top]]
            gain = top_has[y] + r_has[:, :, None]
            score = np.where(good, gain * 2.0**40 - new_max / max(loads[top], 1), -np.inf)
            r, i, t = np.unravel_index(int(np.argmax(score)), d.shape)
        jj = order[r, j[r, i, t]]
        if locality is not None:
            x, y_ = int(assign[top, i]), int(assign[r, jj])
            sx, sy = kc[indptr[x] : indptr[x + 1]], kc[indptr[y_] : indptr[y_ + 1]]
            np.add.at(need[top], sx, -1)
            np.add.at(need[r], sx, 1)
            np.add.at(need[r], sy, -1)
            np.add.at(need[top], sy, 1)
            owner[x], owner[y_] = r, top
            for q in (top, r):
                row = (need[q] > 0) | (owner == q)
                changed = np.nonzero(row != hold[q])[0]
                if len(changed):
                    step = np.where(row[changed], 1, -1)
                    i_, pos = ranges_repeat(key_ptr[changed], key_ptr[changed + 1])
                    has[q] += np.bincount(key_of[pos], weights=step[i_], minlength=n).astype(
                        np.int64
                    )
                    hold[q] = row
        assign[top, i], assign[r, jj] = assign[r, jj], assign[top, i]
        loads[top] -= d[r, i, t]
        loads[r] += d[r, i, t]
    return assign


def _seen_sums(hold: np.ndarray, indptr: np.ndarray, kc: np.ndarray) -> np.ndarray:
    """int64 ``[R, n]``: per row of ``hold`` (bool ``[R, n]``) and chunk ``x``, how many of
    the key chunks ``kc[indptr[x]:indptr[x + 1]]`` it holds."""
    n = len(indptr) - 1
    if n * n <= _SEEN_SUMS_MATMUL_MAX:
        # hold @ incidence (exact: sums of ones below 2**24 in float32).
        incidence = np.zeros((hold.shape[1], n), np.float32)
        incidence[kc, np.repeat(np.arange(n), np.diff(indptr))] = 1
        return (hold.astype(np.float32) @ incidence).astype(np.int64)
    cum = np.zeros((hold.shape[0], len(kc) + 1), np.int32)
    np.cumsum(hold[:, kc], axis=1, dtype=np.int32, out=cum[:, 1:])
    return (cum[:, indptr[1:]] - cum[:, indptr[:-1]]).astype(np.int64)


def _row_searchsorted(b: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Row-wise ``searchsorted(b[r], x[r])`` for sorted rows ``b`` [R, m], ``x`` [R, k]."""
    return (b[:, None, :] < x[:, :, None]).sum(-1)


def _local_enough(kc: np.ndarray, n: int) -> bool:
    """Whether chunks see few enough key chunks (on average at most a quarter of them, and at
    most 128) for the communication-aware passes to be worth their cost."""
    return len(kc) <= min(n * n // 4, 128 * n)


@cached(16)
def _chunk_kv_extents(mask: AttnMask, chunk_size: int, n: int):
    """Per chunk, the key chunks its rows see, as a CSR (indptr, key-chunk ids); cached (the
    communication-aware passes of one solve share it)."""
    s, chunk, a, b, k0, k1 = slice_chunk_pairs(mask.shapes, chunk_size)
    # (query chunk, key chunk) pairs as keys qc * n + kc: each (slice, chunk) pair sees a
    # range of them; their union, sorted, is np.unique of every range's keys.
    lo = chunk * n + k0 // chunk_size
    hi = chunk * n + (k1 - 1) // chunk_size + 1
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    if len(lo):
        reach = np.maximum.accumulate(hi)
        new = np.ones(len(lo), bool)
        new[1:] = lo[1:] > reach[:-1]
        first = np.nonzero(new)[0]
        last = np.append(first[1:], len(lo)) - 1
        lo, hi = lo[first], reach[last]
    _, pairs = ranges_repeat(lo, hi)
    qc, kc = pairs // n, pairs % n
    indptr = np.searchsorted(qc, np.arange(n + 1))
    return indptr, kc


def _refine_comm(
    assign: np.ndarray, area: np.ndarray, mask: AttnMask, chunk_size: int, rounds: int = 2
) -> np.ndarray:
    """Swaps that keep every rank's area under the current maximum and lower the number of
    (rank, key chunk) pairs ranks must fetch remotely — a chunk-level proxy of the remote-KV
    volume that pulls chunks attending to one another onto one rank. First-improvement over
    chunks; for chunk ``x`` the partner ranks are the two whose queries need ``x`` most and the
    partner chunks the four of theirs that ``x``'s rank needs most. Every candidate is scored
    by its local delta (only the touched columns), so a round is O(n · |extent|)."""
    cp, m = assign.shape
    n = assign.size
    indptr, kc = _chunk_kv_extents(mask, chunk_size, n)
    if not _local_enough(kc, n):  # dense masks (every chunk sees most chunks): little to gain
        return assign
    assign = assign.copy()
    owner = np.empty(n, np.int64)
    owner[assign.reshape(-1)] = np.repeat(np.arange(cp), m)
    slot = np.empty(n, np.int64)
    slot[assign.reshape(-1)] = np.tile(np.arange(m), cp)
    loads = area[assign].sum(axis=1)
    cap = loads.max()
    need = np.zeros((cp, n), np.int64)  # need[r, c]: rank r's query chunks that see c
    qc_of = np.repeat(np.arange(n), np.diff(indptr))
    np.add.at(need, (owner[qc_of], kc), 1)
    seen = [kc[indptr[c] : indptr[c + 1]] for c in range(n)]

    def remote(rank_need, own_mask_cols, cols):
        return int(((rank_need[cols] > 0) & ~own_mask_cols).sum())

    def delta(x, y):
        rx, ry = owner[x], owner[y]
        sx, sy = seen[x], seen[y]
        cols = np.unique(np.concatenate([sx, sy, [x, y]]))
        before = 0
        after = 0
        for r, gain, lose, gets, gives in ((rx, sy, sx, y, x), (ry, sx, sy, x, y)):
            own = owner[cols] == r
            before += remote(need[r], own, cols)
            nr = need[r][cols].copy()
            nr[np.searchsorted(cols, lose)] -= 1
            nr[np.searchsorted(cols, gain)] += 1
            own2 = own.copy()
            own2[np.searchsorted(cols, gives)] = False
            own2[np.searchsorted(cols, gets)] = True
            after += int(((nr > 0) & ~own2).sum())
        return after - before

    budget = _COMM_EVALS_PER_CHUNK * n  # deterministic bound on the work
    for _ in range(rounds):
        improved = False
        for x in range(n):
            if budget <= 0:
                break
            rx = owner[x]
            partners = np.argsort(-need[:, x], kind="stable")[:2]
            for ry in partners.tolist():
                if ry == rx or need[ry, x] == 0:
                    continue
                ys = assign[ry]
                feasible = (loads[rx] - area[x] + area[ys] <= cap) & (
                    loads[ry] - area[ys] + area[x] <= cap
                )
                ys = ys[feasible]
                if not len(ys):
                    continue
                ys = ys[np.argsort(-need[rx, ys], kind="stable")[:4]]
                scores = [delta(x, y) for y in ys.tolist()]
                budget -= len(scores)
                k = int(np.argmin(scores))
                if scores[k] >= 0:
                    continue
                y = int(ys[k])
                np.add.at(need[rx], seen[x], -1)
                np.add.at(need[ry], seen[x], 1)
                np.add.at(need[ry], seen[y], -1)
                np.add.at(need[rx], seen[y], 1)
                assign[rx, slot[x]], assign[ry, slot[y]] = y, x
                owner[x], owner[y] = ry, rx
                slot[x], slot[y] = slot[y], slot[x]
                loads[rx] += area[y] - area[x]
                loads[ry] += area[x] - area[y]
                improved = True
                break
        if not improved:
            break
    return assign


_ASSIGN = {"contiguous": _contiguous, "striped": _striped, "zigzag": _zigzag, "greedy": _greedy}


def auto_chunk_size(total: int, cp: int, chunks_per_rank: int) -> int:
    """Chunk size giving about ``chunks_per_rank`` chunks per rank, rounded up to a power of
    two that keeps the padding under ~1.6% (``align <= chunk / 64``)."""
    c = max(1, -(-total // (cp * chunks_per_rank)))
    align = 1 << max(0, min(7, (c // 64).bit_length() - 1)) if c >= 64 else 1
    return -(-c // align) * align


def _validate(mask, cp, chunk_size, algorithm):
    if not isinstance(mask, AttnMask):
        raise TypeError(f"mask must be an AttnMask; got {type(mask).__name__}")
    if int(cp) < 1:
        raise ValueError(f"cp={cp} must be >= 1 (the size of the context-parallel mesh axis)")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(
            f"chunk_size={chunk_size} must be a positive number of tokens, or None for automatic"
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS}")


@cached(128)
def solve_dispatch(
    mask: AttnMask, cp: int, chunk_size: int | None = None, algorithm: str = "magi"
) -> DispatchMeta:
    """Assigns chunks of the (padded) sequence — of the queries, for a cross-attention mask —
    to ``cp`` ranks; cached by (mask fingerprint, cp, chunk_size, algorithm).

    ``chunk_size=None`` chooses it: for ``"magi"`` the fewest of 8/16/32 chunks per rank that
    reach max/mean area ≤ 1.01 (else the best of them), for the baselines 8 per rank.
    Sequences whose length is not a multiple of ``cp·chunk_size`` are padded at the end.
    """
    _validate(mask, cp, chunk_size, algorithm)
    cp = int(cp)
    total = mask.total_q
    if chunk_size is not None:
        return _solve(mask, cp, int(chunk_size), algorithm)
    if algorithm != "magi":
        return _solve(mask, cp, auto_chunk_size(total, cp, _AUTO_CHUNKS_PER_RANK[0]), algorithm)
    best = None
    for m in _AUTO_CHUNKS_PER_RANK:
        c = auto_chunk_size(total, cp, m)
        meta = _solve(mask, cp, c, "balance")
        if best is None or meta.imbalance() < best.imbalance() - 1e-9:
            best = meta
        if best.imbalance() <= _AUTO_TARGET or c == 1:
            break
    # The communication-aware passes once, on the chunking that balanced best.
    return _solve(mask, cp, best.chunk_size, "magi")


def _solve(mask: AttnMask, cp: int, chunk_size: int, algorithm: str) -> DispatchMeta:
    total = mask.total_q
    m = max(1, -(-total // (cp * chunk_size)))
    if algorithm == "zigzag" and m % 2:
        m += 1  # two halves per rank
    n = m * cp
    area = chunk_areas(mask, chunk_size, n)
    if algorithm in ("magi", "balance"):
        assign = _balanced(n, cp, area)
        # Key chunks of a cross mask are not chunks of the query sequence: balance only.
        if algorithm == "magi" and mask.total_q == mask.total_k:
            alt = _greedy_affinity(n, cp, area, mask, chunk_size)
            indptr, kc = _chunk_kv_extents(mask, chunk_size, n)
            alt = _refine_swaps(alt, area, (indptr, kc) if _local_enough(kc, n) else None)
            # Keep the affinity start when it balances as well (within 0.5% of the max).
            if area[alt].sum(1).max() <= area[assign].sum(1).max() * 1.005:
                assign = alt
        if algorithm == "magi" and mask.total_q == mask.total_k:
            assign = _refine_comm(assign, area, mask, chunk_size)
    else:
        assign = _ASSIGN[algorithm](n, cp, area)
    return _meta(mask.total_q, cp, chunk_size, assign, area, algorithm)


def _balanced(n: int, cp: int, area: np.ndarray) -> np.ndarray:
    """``_refine_swaps(_greedy(n, cp, area), area)``, cached by the areas (the automatic chunk
    size's balance solve and the magi solve of the chunking it picks share it)."""
    return _balanced_cached(n, cp, np.ascontiguousarray(area, np.int64).tobytes())


@cached(32)
def _balanced_cached(n: int, cp: int, area_bytes: bytes) -> np.ndarray:
    area = np.frombuffer(area_bytes, np.int64)
    assign = _refine_swaps(_greedy(n, cp, area), area)
    assign.setflags(write=False)
    return assign


# ---- cross attention: where the keys live ----------------------------------------------------


def kv_chunk_size(total_k: int, cp: int) -> int:
    """The chunk of a dispatched key sequence: about 16 key chunks per rank."""
    return auto_chunk_size(total_k, cp, _KV_CHUNKS_PER_RANK)


def auto_kv_layout(total_q: int, total_k: int, cp: int) -> str:
    """The key layout ``kv_layout="auto"`` picks for a cross-attention mask.

    ``"replicated"`` when ``total_k <= ceil(total_q / cp)`` (the key sequence is no longer
    than one rank's share of the queries): every rank then holds all of K and V, at a memory
    cost no larger than its own share of a self-attention K/V, the forward moves nothing and
    the backward sums dK/dV over the ranks once. Otherwise ``"dispatched"``: the keys are cut
    into chunks spread evenly over the ranks (:func:`solve_kv_dispatch`) and every rank fetches
    the remote keys its queries see, as self-attention does, so no rank holds the whole key
    sequence. The rule reads the lengths only, never the mask, so keys at one capacity all
    choose alike."""
    local_q = -(-int(total_q) // int(cp))
    return "replicated" if int(total_k) <= _REPLICATE_KV_RATIO * local_q else "dispatched"


def solve_kv_dispatch(
    mask: AttnMask, meta: DispatchMeta, chunk_size: int | None = None
) -> DispatchMeta:
    """Dispatch of the *keys* of a cross-attention ``mask`` whose queries are dispatched by
    ``meta``; cached by (mask fingerprint, query dispatch, chunk size).

    The key sequence is padded to ``num_chunks · chunk_size`` tokens (default
    :func:`kv_chunk_size`) and every rank gets the same number of key chunks, so K/V memory
    is even. A key owner does no attention work of its own (the ranks whose queries see a key
    compute its dK/dV partials and send them back), so there is no area to balance; the
    assignment minimises what travels instead: key chunks go, most demanded first, to the
    rank whose queries see most of their tokens, while it has room, and chunks no query sees
    fill the remaining room in order. The returned meta's ``chunk_area`` holds each key
    chunk's demand (tokens seen, summed over ranks) and its algorithm is ``"affinity"``."""
    if not isinstance(mask, AttnMask):
        raise TypeError(f"mask must be an AttnMask; got {type(mask).__name__}")
    if not isinstance(meta, DispatchMeta) or meta.total != mask.total_q:
        raise ValueError(
            "meta must be the DispatchMeta of the mask's queries (solve_dispatch "
            f"of a mask with total_q={mask.total_q})"
        )
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(
            f"chunk_size={chunk_size} must be a positive number of tokens, or None for automatic"
        )
    chunk = int(chunk_size or kv_chunk_size(mask.total_k, meta.cp))
    return _solve_kv(
        mask,
        meta.total,
        meta.cp,
        meta.chunk_size,
        meta.rank_chunks.tobytes(),
        meta.rank_chunks.shape,
        chunk,
    )


@cached(64)
def _solve_kv(mask, total_q, cp, q_chunk, rank_chunks_bytes, shape, chunk) -> DispatchMeta:
    rank_chunks = np.frombuffer(rank_chunks_bytes, np.int64).reshape(shape)
    q_meta = DispatchMeta(
        total=total_q,
        cp=cp,
        chunk_size=q_chunk,
        rank_chunks=rank_chunks,
        algorithm="",
        chunk_area=np.zeros(rank_chunks.size, np.int64),
    )
    m = max(1, -(-mask.total_k // (cp * chunk)))
    n = m * cp
    edges = np.arange(n + 1) * chunk
    # demand[r, c]: tokens of key chunk c that rank r's queries see.
    demand = np.stack([np.diff(_coverage(iv, edges)) for iv in needed_kv(mask, q_meta)])
    owner = np.full(n, -1, np.int64)
    room = np.full(cp, m, np.int64)
    flat = np.nonzero(demand.reshape(-1) > 0)[0]
    r_of, c_of = flat // n, flat % n
    order = np.lexsort((r_of, c_of, -demand.reshape(-1)[flat]))
    for r, c in zip(r_of[order].tolist(), c_of[order].tolist()):
        if owner[c] < 0 and room[r] > 0:
            owner[c] = r
            room[r] -= 1
    for c in np.nonzero(owner < 0)[0].tolist():
        r = int(np.argmax(room))  # the most room left, lowest rank first
        owner[c] = r
        room[r] -= 1
    assign = np.stack([np.nonzero(owner == r)[0] for r in range(cp)])
    return _meta(mask.total_k, cp, chunk, assign, demand.sum(axis=0).astype(np.int64), "affinity")


def _meta(total, cp, chunk_size, assign, area, algorithm) -> DispatchMeta:
    assign = np.sort(assign, axis=1).astype(np.int64)
    assign.setflags(write=False)
    area.setflags(write=False)
    return DispatchMeta(
        total=total,
        cp=cp,
        chunk_size=chunk_size,
        rank_chunks=assign,
        algorithm=algorithm,
        chunk_area=area,
    )
