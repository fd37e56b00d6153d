"""Distributed plan: what every rank computes and which KV tokens travel (host NumPy).

Given a dispatch (:class:`~magi_jax.planning.solver.DispatchMeta`), every rank's queries see
a set of global key intervals. The keys it owns form the *host stage* (its local KV); the
others — exactly the keys some local query needs, each fetched once — form the *remote
buffer*, ordered by global position and cut into ``overlap_degree`` stages of nearly equal
size. Per stage, the rank's slices are clipped to the stage's key segments, split at kinks
(canonical, kink-free shapes) and re-expressed in local coordinates: query ``i`` = local
token ``i``, key ``j`` = position ``j`` in that stage's KV buffer. Each stage then gets an FFA
plan (of the chosen backend, :mod:`magi_jax.planning.backends`) and a group-cast table
(:class:`~magi_jax.planning.cast_table.CastTable`). Everything is stacked over ranks into
``[cp, ...]`` int32 arrays padded to the maxima, and cached by (mask fingerprint, dispatch,
options; bounded by count and bytes). Every process builds the whole plan itself.

Planning is per training step when masks are data, so it works on all ranks at once: each
rank's arrays lie back to back in one array grouped by rank (positions offset by rank, so
one sort or search serves every rank), what the stages and the overlap cost model share is
derived once per (mask, dispatch), work lists are ordered as runs of items before any item
is written, and items and cast rows are written once, straight into the stacked arrays.

``overlap_degree = 0`` makes one stage whose KV is ``concat(local KV, whole remote buffer)``
(one FFA call); ``overlap_degree = k >= 1`` makes the host stage plus ``k`` remote stages.

Cross attention (``total_q != total_k``) plans the queries' dispatch the same way; where the
keys live is the ``kv`` argument of :func:`build_dist_plan`: a dispatch of their own (a
:class:`~magi_jax.planning.solver.DispatchMeta` over ``total_k`` keys, from
:func:`~magi_jax.planning.solver.solve_kv_dispatch`), which makes remote stages and casts
exactly as above with the keys' chunks and owners, or ``"replicated"``: every rank's local
KV is the whole key sequence, so there is one host stage and nothing to fetch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from magi_jax.caches import Cache
from magi_jax.masks import AttnMask, SliceShapes
from magi_jax.planning.backends import host_spec
from magi_jax.planning.cast_table import CastTable, cast_table_from_pieces
from magi_jax.planning.solver import (
    KV_LAYOUTS,
    DispatchMeta,
    auto_kv_layout,
    ranges_repeat,
    slice_chunk_pairs,
    solve_kv_dispatch,
)
from magi_jax.planning.work_list import (
    check_items,
    check_runs,
    plan_runs,
    work_list_runs,
)

if TYPE_CHECKING:
    from magi_jax.planning.capacity import PlanCapacity

__all__ = [
    "DistPlan",
    "StagePlan",
    "build_dist_plan",
    "RankView",
    "rank_views",
    "split_areas",
    "clear_cache",
    "stage_buffer_len",
    "cast_width",
    "cast_runs",
    "phase_times",
    "PHASES",
    "REPLICATED_KV",
    "resolve_kv",
]

# The ``kv`` of build_dist_plan for keys that every rank holds whole.
REPLICATED_KV = "replicated"

# Diagonal bounds beyond this magnitude are "unbounded" sentinels and are never shifted.
_UNBOUNDED = 1 << 39
# Distributed plans by their arguments: at most 64, and at most 2 GiB of host plan arrays
# (but always the newest plan): a key at a capacity over 1M tokens and 64 ranks holds ~2.6 GB.
_PLANS = Cache(
    "planning.stages.plans", max_items=64, max_bytes=2 << 30, size_of=lambda p: _plan_bytes(p)
)
# Phases of build_dist_plan that phase_times() reports (seconds each).
PHASES = ("rank_views", "stage_shapes", "work_lists", "cast_tables", "stack_pad")
_TIMES = threading.local()


@contextlib.contextmanager
def phase_times() -> Iterator[dict[str, float]]:
    """Seconds spent in each of :data:`PHASES` by the :func:`build_dist_plan` calls of this
    thread inside the block (for benchmarks; cached plans cost nothing)::

        with phase_times() as t:
            build_dist_plan(...)
        t["work_lists"]
    """
    times = dict.fromkeys(PHASES, 0.0)
    prev = getattr(_TIMES, "times", None)
    _TIMES.times = times
    try:
        yield times
    finally:
        _TIMES.times = prev


@contextlib.contextmanager
def _phase(name):
    times = getattr(_TIMES, "times", None)
    if times is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[name] += time.perf_counter() - t0


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One FFA call per rank: ``ffa`` stacked ``[cp, ...]`` over ranks, its KV length
    ``kv_len`` (the same on every rank), and the cast table that fills its remote part
    (``None`` for the host stage). For ``overlap_degree = 0`` the stage's KV is local KV
    followed by the cast buffer (``kv_len = local_len + cast.buffer_len``).

    ``ffa`` holds the work lists as runs
    (:class:`~magi_jax.planning.work_list.FFAPlanRuns`) and ``items`` the widths ``(q, k)``
    of the item arrays they stand for (expanded on the device right before the FFA call;
    :func:`~magi_jax.planning.work_list.expand_plan_runs` on the host)."""

    ffa: tuple  # the backend's plan arrays (NamedTuple), stacked
    kv_len: int
    cast: CastTable | None
    num_slices: np.ndarray  # int64 [cp]: canonical pieces in the plan, per rank
    area: np.ndarray  # int64 [cp]: cells per rank
    shapes: tuple[SliceShapes, ...]  # per rank: the local-coordinate shapes planned
    items: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class DistPlan:
    """The whole distributed plan: dispatch + stages. ``stages[0]`` is the host stage when
    ``overlap_degree >= 1``; for degree 0 there is exactly one (combined) stage."""

    meta: DispatchMeta
    overlap_degree: int
    block_q: int
    block_k: int
    stages: tuple[StagePlan, ...]
    remote_tokens: np.ndarray  # int64 [cp]: KV tokens fetched by each rank (all stages)
    needed: tuple[np.ndarray, ...]  # per rank: global key intervals its queries see [n, 2]
    # Where the keys live: "shared" (self-attention: the queries' dispatch), "dispatched"
    # (cross attention, keys dispatched by kv_meta) or "replicated" (every rank holds all).
    kv_layout: str = "shared"
    kv_meta: DispatchMeta | None = None

    @property
    def cp(self) -> int:
        return self.meta.cp


@dataclasses.dataclass(frozen=True)
class RankView:
    """One rank's geometry (host), for planning and for tests: its query slices in global
    coordinates, the key intervals it needs, the remote pieces ``(g0, g1, owner, stage,
    offset)`` in stage-buffer coordinates."""

    pairs: tuple[np.ndarray, ...]  # (slice, chunk, a, b, e0, e1) of its query chunks
    needed: np.ndarray  # [n, 2] merged global key intervals
    remote: np.ndarray  # [p, 5] (g0, g1, owner, stage, offset in stage buffer)
    stage_len: np.ndarray  # [num_remote_stages] tokens per stage


def _split_even(total: int, parts: int) -> np.ndarray:
    return (np.arange(parts + 1) * total) // parts


class _Flat:
    """Per-rank arrays of one kind back to back, grouped by rank (``rank`` nondecreasing,
    ``bounds [cp + 1]``): every rank's planning in one pass of NumPy over all ranks."""

    def __init__(self, rank: np.ndarray, cp: int):
        self.rank = rank
        self.bounds = np.searchsorted(rank, np.arange(cp + 1))

    def split(self, x):
        """``x`` (flat, grouped like ``rank``) as one view per rank."""
        b = self.bounds
        return tuple(x[b[r] : b[r + 1]] for r in range(len(b) - 1))


class _Geometry:
    """What every stage and every overlap degree of one (mask, dispatch) share, flat over
    ranks: each rank's (slice, query chunk) pairs, the key intervals they see, the remote
    pieces (owned elsewhere, in buffer order), the merged pairs the stages clip, and the
    host stage's shapes. Built once per (mask fingerprint, dispatch) and cached, so the
    overlap cost model (:func:`split_areas`) and :func:`build_dist_plan` derive it once."""

    def __init__(self, mask: AttnMask, meta: DispatchMeta, kv=None):
        cp, c = meta.cp, meta.chunk_size
        self.mask, self.meta = mask, meta
        # The keys' side: their dispatch (None when every rank holds them all) and the rows
        # of a rank's local KV.
        self.kv_meta = meta if kv is None else None if kv == REPLICATED_KV else kv
        self.kv_local_len = mask.total_k if self.kv_meta is None else self.kv_meta.local_len
        kv_rows = mask.total_k if self.kv_meta is None else self.kv_meta.padded_total
        # Offsets that keep the ranks apart in one sorted array: rank r's positions live in
        # [r * big, (r + 1) * big).
        self.big = big = int(max(meta.padded_total, kv_rows)) + 1
        pairs = slice_chunk_pairs(mask.shapes, c)
        rank = meta.chunk_owner[pairs[1]]
        order = np.lexsort((pairs[4], rank))
        self.pairs = tuple(p[order] for p in pairs)
        self.pair_rank = _Flat(rank[order], cp)
        rank = self.pair_rank.rank
        # Needed keys per rank: the union of its pairs' key extents (sorted by start).
        e0, e1 = self.pairs[4], self.pairs[5]
        if len(e0):
            run_end = np.maximum.accumulate(e1 + rank * big)
            new = np.ones(len(e0), bool)
            new[1:] = e0[1:] + rank[1:] * big > run_end[:-1]
            first = np.nonzero(new)[0]
            last = np.append(first[1:], len(e0)) - 1
            need_rank = rank[first]
            self.needed = np.stack([e0[first], run_end[last] - need_rank * big], axis=1).astype(
                np.int64
            )
        else:
            need_rank = np.zeros(0, np.int64)
            self.needed = np.zeros((0, 2), np.int64)
        self.need_rank = _Flat(need_rank, cp)
        # Cut the needed intervals at key-chunk boundaries; keep the pieces owned elsewhere.
        nd = self.needed
        kc = c if self.kv_meta is None else self.kv_meta.chunk_size
        iv, ch = ranges_repeat(nd[:, 0] // kc, (nd[:, 1] - 1) // kc + 1)
        g0 = np.maximum(nd[iv, 0], ch * kc)
        g1 = np.minimum(nd[iv, 1], (ch + 1) * kc)
        if self.kv_meta is None:  # replicated: every key is local
            keep = np.zeros(len(iv), bool)
            own = np.zeros(len(iv), np.int64)
        else:
            own = self.kv_meta.chunk_owner[ch]
            keep = own != need_rank[iv]
        self.pieces = (g0[keep], g1[keep], own[keep])
        self.piece_rank = _Flat(need_rank[iv][keep], cp)
        # Query chunk -> local rows: local index minus global position.
        self.q_shift = meta.chunk_slot * c - np.arange(meta.num_chunks) * c
        self.merged, self.merged_rank = _merge_pairs_flat(self.pairs, rank, self.q_shift)
        self._cuts = {}
        self._shapes = {}

    def cut(self, k: int):
        """The remote pieces cut into ``k`` stages: ``(remote [p, 5] (g0, g1, owner, stage,
        offset), its ranks (:class:`_Flat`), stage_len [cp, k])``; cached per ``k``."""
        if k not in self._cuts:
            self._cuts[k] = _cut_stages_flat(
                *self.pieces, self.piece_rank, self.meta.cp, k, self.big
            )
        return self._cuts[k]

    def stage_shapes(self, which, k: int = 1):
        """Local-coordinate shapes of every rank for ``which`` = ``"host"``, ``"combined"``
        or a remote stage index (of ``k`` stages): ``(SliceShapes, ranks)``; cached."""
        key = (which, 1 if which == "host" else k)
        if key not in self._shapes:
            self._shapes[key] = self._stage_shapes(which, k)
        return self._shapes[key]

    def _stage_shapes(self, which, k):
        cp, t_loc, kv = self.meta.cp, self.kv_local_len, self.kv_meta
        if kv is None:  # replicated: local key j is global key j
            local_g0, local_shift = np.zeros(cp, np.int64), np.zeros(cp, np.int64)
            c, local_rank = self.mask.total_k, np.arange(cp)
        else:
            c = kv.chunk_size
            local_g0 = (kv.rank_chunks * c).reshape(-1)
            local_shift = np.tile(np.arange(kv.chunks_per_rank) * c, cp) - local_g0
            local_rank = np.repeat(np.arange(cp), kv.chunks_per_rank)
        if which == "host":
            g0, g1, sk, rank = local_g0, local_g0 + c, local_shift, local_rank
        else:
            rem, rem_rank, _ = self.cut(k)
            rank = rem_rank.rank
            if which != "combined":
                sel = rem[:, 3] == which
                rem, rank = rem[sel], rank[sel]
            g0, g1, sk = rem[:, 0], rem[:, 1], rem[:, 4] - rem[:, 0]
            if which == "combined":
                g0 = np.concatenate([g0, local_g0])
                g1 = np.concatenate([g1, local_g0 + c])
                sk = np.concatenate([sk + t_loc, local_shift])
                rank = np.concatenate([rank, local_rank])
            order = np.lexsort((g0, rank))
            g0, g1, sk, rank = g0[order], g1[order], sk[order], rank[order]
        g0, g1, sk, rank = _merge_runs_flat(g0, g1, sk, rank)
        shapes, shape_rank = _clip_flat(
            self.mask.shapes,
            self.merged,
            self.merged_rank,
            g0,
            g1,
            sk,
            rank,
            self.q_shift,
            self.big,
        )
        return shapes, _Flat(shape_rank, cp)


_GEOMETRY = Cache("planning.stages.geometry", max_items=4)


def resolve_kv(
    mask: AttnMask, meta: DispatchMeta, kv_layout: str = "auto", kv_chunk_size: int | None = None
) -> DispatchMeta | str | None:
    """The ``kv`` of :func:`build_dist_plan` for a key layout of
    :data:`~magi_jax.planning.solver.KV_LAYOUTS`: ``"auto"`` gives ``None`` (self-attention)
    for a mask with ``total_q == total_k`` and
    :func:`~magi_jax.planning.solver.auto_kv_layout`'s choice otherwise; ``"replicated"``
    gives :data:`REPLICATED_KV`; ``"dispatched"`` the keys' own dispatch
    (:func:`~magi_jax.planning.solver.solve_kv_dispatch`, chunks of ``kv_chunk_size``)."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r} is not one of {KV_LAYOUTS}")
    if kv_layout == "auto":
        if mask.total_q == mask.total_k:
            return None
        kv_layout = auto_kv_layout(mask.total_q, mask.total_k, meta.cp)
    if kv_layout == "replicated":
        return REPLICATED_KV
    return solve_kv_dispatch(mask, meta, kv_chunk_size)


def _kv_part(mask: AttnMask, meta: DispatchMeta, kv):
    """Checks ``kv`` (see :func:`build_dist_plan`) and returns its part of cache keys."""
    if kv is None:
        if mask.total_q != mask.total_k:
            raise ValueError(
                f"the mask is cross attention (total_q={mask.total_q} != total_k="
                f"{mask.total_k}): say where its keys live, kv=solve_kv_dispatch(mask, meta) "
                f"or kv={REPLICATED_KV!r}"
            )
        return None
    if isinstance(kv, str):
        if kv != REPLICATED_KV:
            raise ValueError(
                f"kv={kv!r} must be None, {REPLICATED_KV!r} or a DispatchMeta of the keys"
            )
        return kv
    if not isinstance(kv, DispatchMeta) or kv.total != mask.total_k or kv.cp != meta.cp:
        raise ValueError(
            f"kv must be a DispatchMeta over the mask's total_k={mask.total_k} "
            f"keys on the queries' {meta.cp} ranks (solve_kv_dispatch)"
        )
    return ("dispatched", kv.fingerprint())


def _geometry(mask: AttnMask, meta: DispatchMeta, kv=None) -> _Geometry:
    key = (mask.fingerprint, meta.fingerprint(), _kv_part(mask, meta, kv))
    return _GEOMETRY.get(key, lambda: _Geometry(mask, meta, kv))


def rank_views(
    mask: AttnMask, meta: DispatchMeta, num_remote_stages: int, kv: DispatchMeta | str | None = None
) -> list[RankView]:
    """Every rank's :class:`RankView`; remote keys cut into ``num_remote_stages`` stages of
    nearly equal token counts (by buffer position); ``kv`` as for :func:`build_dist_plan`."""
    geo = _geometry(mask, meta, kv)
    cp, k = meta.cp, int(num_remote_stages)
    pairs = [geo.pair_rank.split(p) for p in geo.pairs]
    needed = geo.need_rank.split(geo.needed)
    if k == 0:
        return [
            RankView(
                tuple(p[r] for p in pairs),
                needed[r],
                np.zeros((0, 5), np.int64),
                np.zeros((0,), np.int64),
            )
            for r in range(cp)
        ]
    remote, remote_rank, stage_len = geo.cut(k)
    remote = remote_rank.split(remote)
    return [
        RankView(tuple(p[r] for p in pairs), needed[r], remote[r], stage_len[r]) for r in range(cp)
    ]


def _cut_stages_flat(g0, g1, own, piece_rank: _Flat, cp: int, k: int, big: int):
    """Every rank's remote pieces (in buffer order) split into ``k`` stages of nearly equal
    size, at once: ``(remote [p, 5], ranks, stage_len [cp, k])``."""
    rank = piece_rank.rank
    lengths = g1 - g0
    cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    base = cum[piece_rank.bounds[:-1]]  # per rank
    total = cum[piece_rank.bounds[1:]] - base  # remote tokens per rank
    if k == 0:
        return (
            np.zeros((0, 5), np.int64),
            _Flat(np.zeros(0, np.int64), cp),
            np.zeros((cp, 0), np.int64),
        )
    stage_bounds = (np.arange(k + 1)[None, :] * total[:, None]) // k  # [cp, k + 1]
    start = cum[:-1] - base[rank]  # piece start in its buffer
    # Cuts: piece starts and stage starts, per rank, below the rank's total.
    sb_rank = np.repeat(np.arange(cp), k)
    keys = np.unique(
        np.concatenate([start + rank * big, stage_bounds[:, :-1].reshape(-1) + sb_rank * big])
    )
    cut_rank = keys // big
    cuts = keys - cut_rank * big
    keep = cuts < total[cut_rank]
    keys, cut_rank, cuts = keys[keep], cut_rank[keep], cuts[keep]
    last = np.ones(len(keys), bool)
    last[:-1] = cut_rank[1:] != cut_rank[:-1]
    ends = np.where(last, total[cut_rank], np.append(cuts[1:], 0))
    piece = np.searchsorted(start + rank * big, keys, side="right") - 1
    sb_keys = (stage_bounds + (np.arange(cp) * big)[:, None]).reshape(-1)
    stage = np.searchsorted(sb_keys, keys, side="right") - 1 - cut_rank * (k + 1)
    a = g0[piece] + (cuts - start[piece])
    b = a + (ends - cuts)
    remote = np.stack([a, b, own[piece], stage, cuts - stage_bounds[cut_rank, stage]], axis=1)
    return (
        remote.astype(np.int64),
        _Flat(cut_rank.astype(np.int64), cp),
        np.diff(stage_bounds, axis=1).astype(np.int64),
    )


def _clip_to_segments(sh: SliceShapes, pairs, seg_g0, seg_g1, seg_shift, q_shift_of_chunk):
    """Clips each (slice, query chunk) pair to the key segments ``[g0, g1)`` (sorted,
    disjoint), splits at kinks and shifts into local coordinates: ``q += q_shift``,
    ``k += seg_shift``. Returns a :class:`SliceShapes` (kink-free pieces)."""
    shapes, _ = _clip_flat(
        sh,
        pairs,
        np.zeros(len(pairs[0]), np.int64),
        seg_g0,
        seg_g1,
        seg_shift,
        np.zeros(len(seg_g0), np.int64),
        q_shift_of_chunk,
        0,
    )
    return shapes


def _clip_flat(
    sh: SliceShapes, pairs, pair_rank, seg_g0, seg_g1, seg_shift, seg_rank, q_shift_of_chunk, big
):
    """:func:`_clip_to_segments` of every rank at once: pairs and segments grouped by rank
    (each rank's segments sorted, disjoint), a pair clipped to its rank's segments only.
    Returns ``(SliceShapes, rank of each piece)``, ranks in order."""
    s, chunk, a, b, e0, e1 = pairs
    lo = np.searchsorted(seg_g1 + seg_rank * big, e0 + pair_rank * big, side="right")
    hi = np.searchsorted(seg_g0 + seg_rank * big, e1 + pair_rank * big, side="left")
    pi, si = ranges_repeat(lo, hi)
    s, chunk, rank = s[pi], chunk[pi], pair_rank[pi]
    q0, q1 = a[pi], b[pi]
    k0 = np.maximum(sh.k0[s], seg_g0[si])
    k1 = np.minimum(sh.k1[s], seg_g1[si])
    dlo, dhi = sh.dlo[s], sh.dhi[s]
    # Rows that see a key, then the kinks t (lower edge turns diagonal) and u (upper edge
    # clamps): inside each of the three row bands lo(q) and hi(q) are linear.
    qa = np.maximum(q0, k0 - dhi)
    qb = np.minimum(q1, k1 - dlo)
    ok = (qb > qa) & (k1 > k0) & (dhi >= dlo)
    t = np.clip(k0 - dlo, qa, qb)
    u = np.clip(k1 - dhi, qa, qb)
    cuts = np.stack([qa, np.minimum(t, u), np.maximum(t, u), qb], axis=1)
    band_a, band_b = cuts[:, :3].reshape(-1), cuts[:, 1:].reshape(-1)
    rep = lambda x: np.repeat(x, 3)
    keep = rep(ok) & (band_b > band_a)
    sq = rep(q_shift_of_chunk[chunk])[keep]
    sk = rep(seg_shift[si])[keep]
    d = sk - sq
    dlo_, dhi_ = rep(dlo)[keep], rep(dhi)[keep]
    return SliceShapes(
        q0=band_a[keep] + sq,
        q1=band_b[keep] + sq,
        k0=rep(k0)[keep] + sk,
        k1=rep(k1)[keep] + sk,
        dlo=np.where(np.abs(dlo_) >= _UNBOUNDED, dlo_, dlo_ + d),
        dhi=np.where(np.abs(dhi_) >= _UNBOUNDED, dhi_, dhi_ + d),
    ), rep(rank)[keep]


def _merge_runs_flat(g0, g1, shift, rank):
    """Merges consecutive segments of one rank that abut both globally and locally (same
    shift), e.g. neighbouring chunks a rank owns side by side, so slices are not cut where no
    cut is needed."""
    if len(g0) < 2:
        return g0, g1, shift, rank
    new = np.ones(len(g0), bool)
    new[1:] = (g0[1:] != g1[:-1]) | (shift[1:] != shift[:-1]) | (rank[1:] != rank[:-1])
    first = np.nonzero(new)[0]
    last = np.append(first[1:], len(g0)) - 1
    return g0[first], g1[last], shift[first], rank[first]


def _merge_pairs_flat(pairs, rank, q_shift):
    """Merges (slice, query chunk) pairs of one rank and slice whose rows abut globally and
    locally (neighbouring chunks held side by side): one pair, rows ``[a, b)`` and key extent
    the union (still contiguous: rows are consecutive). Pairs come out sorted by (rank,
    slice, first row)."""
    s, chunk, a, b, e0, e1 = pairs
    if len(s) < 2:
        return pairs, rank
    order = np.lexsort((a, s, rank))
    s, chunk, a, b, e0, e1, rank = (x[order] for x in (s, chunk, a, b, e0, e1, rank))
    sh = q_shift[chunk]
    new = np.ones(len(s), bool)
    new[1:] = (s[1:] != s[:-1]) | (a[1:] != b[:-1]) | (sh[1:] != sh[:-1]) | (rank[1:] != rank[:-1])
    first = np.nonzero(new)[0]
    last = np.append(first[1:], len(s)) - 1
    return (
        s[first],
        chunk[first],
        a[first],
        b[last],
        np.minimum.reduceat(e0, first),
        np.maximum.reduceat(e1, first),
    ), rank[first]


def _rank_sums(x: np.ndarray, flat: _Flat) -> np.ndarray:
    """int64 [cp]: exact sums of ``x`` (grouped like ``flat``) per rank."""
    cum = np.concatenate([[0], np.cumsum(x)]).astype(np.int64)
    return cum[flat.bounds[1:]] - cum[flat.bounds[:-1]]


def clear_cache() -> None:
    """Drops the cached distributed plans (and the geometry they were derived from)."""
    _PLANS.clear()
    _GEOMETRY.clear()


def _plan_bytes(plan: "DistPlan") -> int:
    """Bytes of a plan's stacked arrays (work lists and cast tables)."""
    total = 0
    for st in plan.stages:
        total += sum(a.nbytes for a in st.ffa)
        if st.cast is not None:
            total += st.cast.nbytes
    return total


def build_dist_plan(
    mask: AttnMask,
    meta: DispatchMeta,
    overlap_degree: int,
    block_q: int,
    block_k: int,
    ffa_backend: str = "xla",
    capacity: PlanCapacity | None = None,
    kv: DispatchMeta | str | None = None,
) -> DistPlan:
    """The distributed plan of ``mask`` over the dispatch ``meta``; cached by (mask
    fingerprint, dispatch, overlap_degree, block sizes, FFA backend, capacity, kv).

    ``kv`` says where the keys live: ``None`` for self-attention (the keys are the queries'
    tokens, dispatched by ``meta``); for cross attention (any ``total_k``) a
    :class:`~magi_jax.planning.solver.DispatchMeta` of the keys
    (:func:`~magi_jax.planning.solver.solve_kv_dispatch`: remote stages fetch what each rank
    lacks) or :data:`REPLICATED_KV` (every rank holds all ``total_k`` keys: one host stage,
    no casts, at a capacity too).

    With a ``capacity``, every array's shape depends on the capacity alone: each remote
    stage's KV buffer holds ``ceil(capacity.remote_kv / stages)`` tokens, every cast has a
    slot for every other rank of ``capacity.cast_width`` rows, every FFA plan's item lists
    hold the capacity's items, and the stages exist whether or not this mask needs remote
    KV. A mask that needs more raises :class:`~magi_jax.planning.capacity.CapacityError`."""
    if int(overlap_degree) < 0:
        raise ValueError(
            f"overlap_degree={overlap_degree} must be >= 0 (0: one FFA call "
            "after fetching all remote KV; k: host stage + k remote stages)"
        )
    backend = host_spec(ffa_backend, "ffa_backend", context_parallel=True)
    key = (
        mask.fingerprint,
        meta.fingerprint(),
        int(overlap_degree),
        int(block_q),
        int(block_k),
        backend.name,
        capacity,
        _kv_part(mask, meta, kv),
    )
    return _PLANS.get(
        key,
        lambda: _build(
            mask, meta, int(overlap_degree), int(block_q), int(block_k), backend, capacity, kv
        ),
    )


def split_areas(
    mask: AttnMask, meta: DispatchMeta, kv: DispatchMeta | str | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank: area on local KV, area on remote KV and remote KV tokens (int64 ``[cp]``
    each) — the inputs of the overlap cost model, without building any kernel plan; ``kv``
    as for :func:`build_dist_plan`."""
    geo = _geometry(mask, meta, kv)
    host, host_rank = geo.stage_shapes("host")
    remote, remote_rank = geo.stage_shapes(0, 1)
    tokens = geo.cut(1)[2].sum(axis=1).astype(np.int64)
    return (_rank_sums(host.areas(), host_rank), _rank_sums(remote.areas(), remote_rank), tokens)


def stage_buffer_len(capacity: PlanCapacity, meta: DispatchMeta, num_remote: int) -> int:
    """KV tokens of one remote stage's buffer at ``capacity``."""
    most = max(meta.padded_total - meta.local_len, 1)  # every token the rank does not own
    remote = min(capacity.remote_kv or most, most)
    return max(1, -(-remote // num_remote))


def cast_width(capacity: PlanCapacity, buffer_len: int) -> int:
    """Rows one rank sends one other rank per stage at ``capacity``."""
    return min(capacity.cast_width or buffer_len, buffer_len)


def cast_runs(
    capacity: PlanCapacity, cp: int, width: int, buffer_len: int, local_len: int
) -> tuple[int, int]:
    """``(send_runs, recv_runs)`` of a cast at ``capacity``: the capacity's fields, or by
    default what always fits (every row a run of its own: a slot of ``width`` rows holds at
    most ``min(width, local_len)`` of one owner's rows, a buffer ``buffer_len``)."""
    return (
        capacity.send_runs or (cp - 1) * min(width, local_len),
        capacity.recv_runs or buffer_len,
    )


def _build(mask, meta, degree, bq, bk, backend, capacity=None, kv=None) -> DistPlan:
    cp, t_loc, chunk = meta.cp, meta.local_len, meta.chunk_size
    num_remote = max(degree, 1)
    with _phase("rank_views"):
        geo = _geometry(mask, meta, kv)
        remote, remote_rank, stage_len = geo.cut(num_remote)
        needed = geo.need_rank.split(geo.needed)
    kv_meta, kv_loc = geo.kv_meta, geo.kv_local_len
    # Replicated keys: nothing is remote, at a capacity too (no stages to hold the place of).
    fetches = kv_meta is not None
    if capacity is None or not fetches:
        buf_len = np.maximum(stage_len.max(axis=0), 1)  # per remote stage
    else:
        buf_len = np.full(num_remote, stage_buffer_len(capacity, kv_meta, num_remote))
        capacity.check("remote_kv", int(stage_len.max(initial=0)) * num_remote)
    with _phase("cast_tables"):
        # At a capacity (cp > 1) every cast has a slot for every other rank.
        width = cast_width(capacity, int(buf_len[0])) if capacity is not None and cp > 1 else None
        casts = []
        for s in range(num_remote if fetches else 0):
            sel = remote[:, 3] == s
            runs = (
                (None, None)
                if width is None
                else cast_runs(capacity, cp, width, int(buf_len[s]), kv_meta.local_len)
            )
            casts.append(
                cast_table_from_pieces(
                    kv_meta,
                    remote[sel, 0],
                    remote[sel, 1],
                    remote[sel, 2],
                    remote_rank.rank[sel],
                    remote[sel, 4],
                    buffer_len=int(buf_len[s]),
                    width=width,
                    send_runs=runs[0],
                    recv_runs=runs[1],
                )
            )
    # At a capacity the stages exist whatever this mask needs (their shapes are static).
    any_remote = bool(stage_len.sum()) or (capacity is not None and cp > 1 and fetches)

    def make_stage(which, kv_len, cast):
        with _phase("stage_shapes"):
            flat, rank = geo.stage_shapes(which, num_remote)
            shapes = tuple(
                SliceShapes(*x) for x in zip(*(rank.split(getattr(flat, f)) for f in _SHAPE_FIELDS))
            )
            num_slices = np.diff(rank.bounds).astype(np.int64)
            area = _rank_sums(flat.areas(), rank)
        ffa, items = _stage_lists(
            flat, rank, cp, t_loc, kv_len, bq, bk, backend, capacity, which == "host", chunk
        )
        return StagePlan(
            ffa=ffa,
            kv_len=kv_len,
            cast=cast,
            num_slices=num_slices,
            area=area,
            shapes=shapes,
            items=items,
        )

    if degree == 0 or not any_remote:
        if any_remote:
            stages = (make_stage("combined", kv_loc + int(buf_len[0]), casts[0]),)
        else:
            stages = (make_stage("host", kv_loc, None),)
    else:
        stages = (make_stage("host", kv_loc, None),) + tuple(
            make_stage(s, int(buf_len[s]), casts[s]) for s in range(num_remote)
        )
    layout = "shared" if kv is None else "replicated" if kv_meta is None else "dispatched"
    return DistPlan(
        meta=meta,
        overlap_degree=degree if any_remote else 0,
        block_q=bq,
        block_k=bk,
        stages=stages,
        remote_tokens=stage_len.sum(axis=1),
        needed=needed,
        kv_layout=layout,
        kv_meta=None if kv is None else kv_meta,
    )


_SHAPE_FIELDS = ("q0", "q1", "k0", "k1", "dlo", "dhi")


def _stage_lists(flat, rank, cp, t_loc, kv_len, bq, bk, backend, capacity, host, chunk):
    """One stage's FFA plan of every rank, stacked ``[cp, ...]``, and the widths of its item
    arrays: runs (:class:`~magi_jax.planning.work_list.FFAPlanRuns`) standing for lists of
    the capacity's items (at ``capacity``; runs padded to its bounds, the host stage's
    (``host``) to its own: :meth:`~magi_jax.planning.capacity.PlanCapacity.list_sizes`) or
    of the longest rank's."""
    fwd_block, bwd_block = backend.blocks(t_loc, kv_len, bq, bk)
    with _phase("work_lists"):
        runs_q = work_list_runs(flat, rank.rank, cp, t_loc, kv_len, *fwd_block, "q")
        runs_k = work_list_runs(flat, rank.rank, cp, t_loc, kv_len, *bwd_block, "k")
    if capacity is None:
        items = (int(runs_q.per_rank.max(initial=0)), int(runs_k.per_rank.max(initial=0)))
        num_runs = None
    else:
        items, num_runs = capacity.list_sizes(
            fwd_block, bwd_block, mesh_size=cp, chunk_size=chunk, host=host
        )
        for r in range(cp):  # the first rank and list over the capacity, as padding
            check_items(runs_q.per_rank[r : r + 1], items[0])
            check_items(runs_k.per_rank[r : r + 1], items[1])
        fields = ("host_q_runs", "host_k_runs") if host else ("q_runs", "k_runs")
        check_runs(runs_q, num_runs[0], fields[0])
        check_runs(runs_k, num_runs[1], fields[1])
    with _phase("stack_pad"):
        return plan_runs(runs_q, runs_k, num_runs), items
