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
options). Every process builds the whole plan itself.

``overlap_degree = 0`` makes one stage whose KV is ``concat(local KV, whole remote buffer)``
(one FFA call); ``overlap_degree = k >= 1`` makes the host stage plus ``k`` remote stages.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np

from magi_jax.mask import AttnMask, SliceShapes
from magi_jax.planning.backends import host_planner
from magi_jax.planning.capacity import PlanCapacity
from magi_jax.planning.work_list import backend_blocks
from magi_jax.planning.cast_table import CastTable, build_cast_table, widen_cast_table
from magi_jax.planning.solver import (DispatchMeta, merge_intervals, ranges_repeat,
                                      slice_chunk_pairs)

__all__ = ["DistPlan", "StagePlan", "build_dist_plan", "RankView", "rank_views", "split_areas",
           "clear_cache", "stage_buffer_len", "cast_width"]

# Diagonal bounds beyond this magnitude are "unbounded" sentinels and are never shifted.
_UNBOUNDED = 1 << 39
_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()
_CACHE_MAX = 64


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One FFA call per rank: ``ffa`` stacked ``[cp, ...]`` over ranks, its KV length
    ``kv_len`` (the same on every rank), and the cast table that fills its remote part
    (``None`` for the host stage). For ``overlap_degree = 0`` the stage's KV is local KV
    followed by the cast buffer (``kv_len = local_len + cast.buffer_len``)."""

    ffa: tuple                      # the backend's plan arrays (NamedTuple), stacked
    kv_len: int
    cast: CastTable | None
    num_slices: np.ndarray          # int64 [cp]: canonical pieces in the plan, per rank
    area: np.ndarray                # int64 [cp]: cells per rank
    shapes: tuple[SliceShapes, ...]  # per rank: the local-coordinate shapes planned


@dataclasses.dataclass(frozen=True)
class DistPlan:
    """The whole distributed plan: dispatch + stages. ``stages[0]`` is the host stage when
    ``overlap_degree >= 1``; for degree 0 there is exactly one (combined) stage."""

    meta: DispatchMeta
    overlap_degree: int
    block_q: int
    block_k: int
    stages: tuple[StagePlan, ...]
    remote_tokens: np.ndarray       # int64 [cp]: KV tokens fetched by each rank (all stages)
    needed: tuple[np.ndarray, ...]  # per rank: global key intervals its queries see [n, 2]

    @property
    def cp(self) -> int:
        return self.meta.cp


@dataclasses.dataclass(frozen=True)
class RankView:
    """One rank's geometry (host), for planning and for tests: its query slices in global
    coordinates, the key intervals it needs, the remote pieces ``(g0, g1, owner, stage,
    offset)`` in stage-buffer coordinates."""

    pairs: tuple[np.ndarray, ...]   # (slice, chunk, a, b, e0, e1) of its query chunks
    needed: np.ndarray              # [n, 2] merged global key intervals
    remote: np.ndarray              # [p, 5] (g0, g1, owner, stage, offset in stage buffer)
    stage_len: np.ndarray           # [num_remote_stages] tokens per stage


def _split_even(total: int, parts: int) -> np.ndarray:
    return (np.arange(parts + 1) * total) // parts


def rank_views(mask: AttnMask, meta: DispatchMeta, num_remote_stages: int) -> list[RankView]:
    """Every rank's :class:`RankView`; remote keys cut into ``num_remote_stages`` stages of
    nearly equal token counts (by buffer position)."""
    c = meta.chunk_size
    pairs = slice_chunk_pairs(mask.shapes, c)
    rank = meta.chunk_owner[pairs[1]]
    order = np.lexsort((pairs[4], rank))
    pairs = tuple(p[order] for p in pairs)
    rank = rank[order]
    bounds = np.searchsorted(rank, np.arange(meta.cp + 1))
    views = []
    for r in range(meta.cp):
        sl = slice(bounds[r], bounds[r + 1])
        p = tuple(x[sl] for x in pairs)
        needed = merge_intervals(p[4], p[5])
        # Cut the needed intervals at chunk boundaries; keep the pieces owned elsewhere.
        iv, ch = ranges_repeat(needed[:, 0] // c, (needed[:, 1] - 1) // c + 1)
        g0 = np.maximum(needed[iv, 0], ch * c)
        g1 = np.minimum(needed[iv, 1], (ch + 1) * c)
        own = meta.chunk_owner[ch]
        keep = own != r
        g0, g1, own = g0[keep], g1[keep], own[keep]
        views.append(RankView(p, needed, *_cut_stages(g0, g1, own, num_remote_stages)))
    return views


def _cut_stages(g0, g1, own, k):
    """Splits the remote pieces (in buffer order) into ``k`` stages of nearly equal size."""
    lengths = g1 - g0
    total = int(lengths.sum())
    if k == 0:
        return np.zeros((0, 5), np.int64), np.zeros((0,), np.int64)
    stage_bounds = _split_even(total, k)
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    cuts = np.unique(np.concatenate([start, stage_bounds[:-1]]))
    cuts = cuts[cuts < total]
    ends = np.append(cuts[1:], total)
    piece = np.searchsorted(start, cuts, side="right") - 1
    stage = np.searchsorted(stage_bounds, cuts, side="right") - 1
    a = g0[piece] + (cuts - start[piece])
    b = a + (ends - cuts)
    remote = np.stack([a, b, own[piece], stage, cuts - stage_bounds[stage]], axis=1)
    return remote.astype(np.int64), np.diff(stage_bounds).astype(np.int64)


def _clip_to_segments(sh: SliceShapes, pairs, seg_g0, seg_g1, seg_shift, q_shift_of_chunk):
    """Clips each (slice, query chunk) pair to the key segments ``[g0, g1)`` (sorted,
    disjoint), splits at kinks and shifts into local coordinates: ``q += q_shift``,
    ``k += seg_shift``. Returns a :class:`SliceShapes` (kink-free pieces)."""
    s, chunk, a, b, e0, e1 = pairs
    lo = np.searchsorted(seg_g1, e0, side="right")
    hi = np.searchsorted(seg_g0, e1, side="left")
    pi, si = ranges_repeat(lo, hi)
    s, chunk = s[pi], chunk[pi]
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
        q0=band_a[keep] + sq, q1=band_b[keep] + sq,
        k0=rep(k0)[keep] + sk, k1=rep(k1)[keep] + sk,
        dlo=np.where(np.abs(dlo_) >= _UNBOUNDED, dlo_, dlo_ + d),
        dhi=np.where(np.abs(dhi_) >= _UNBOUNDED, dhi_, dhi_ + d))


def clear_cache():
    """Drops the cached distributed plans."""
    with _CACHE_LOCK:
        _CACHE.clear()


def build_dist_plan(mask: AttnMask, meta: DispatchMeta, overlap_degree: int, block_q: int,
                    block_k: int, ffa_backend: str = "xla",
                    capacity: PlanCapacity | None = None) -> DistPlan:
    """The distributed plan of ``mask`` over the dispatch ``meta``; cached by (mask
    fingerprint, dispatch, overlap_degree, block sizes, FFA backend, capacity).

    With a ``capacity``, every array's shape depends on the capacity alone: each remote
    stage's KV buffer holds ``ceil(capacity.remote_kv / stages)`` tokens, every cast has a
    slot for every other rank of ``capacity.cast_width`` rows, every FFA plan's item lists
    hold the capacity's items, and the stages exist whether or not this mask needs remote
    KV. A mask that needs more raises :class:`~magi_jax.planning.capacity.CapacityError`."""
    if int(overlap_degree) < 0:
        raise ValueError(f"overlap_degree={overlap_degree} must be >= 0 (0: one FFA call "
                         "after fetching all remote KV; k: host stage + k remote stages)")
    backend = host_planner(ffa_backend)
    key = (mask.fingerprint, meta.fingerprint(), int(overlap_degree), int(block_q),
           int(block_k), backend.name, capacity)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    plan = _build(mask, meta, int(overlap_degree), int(block_q), int(block_k), backend,
                  capacity)
    with _CACHE_LOCK:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = plan
    return plan


def _stage_shapes(mask, meta, views, r, which):
    """Rank ``r``'s local-coordinate shapes for ``which`` = ``"host"`` (local KV),
    ``"combined"`` (local KV then the whole remote buffer) or a remote stage index."""
    c, t_loc = meta.chunk_size, meta.local_len
    q_shift = meta.chunk_slot * c - np.arange(meta.num_chunks) * c     # per chunk
    local_g0 = meta.rank_chunks[r] * c
    local_shift = np.arange(meta.chunks_per_rank) * c - local_g0
    if which == "host":
        g0, g1, sk = local_g0, local_g0 + c, local_shift
    else:
        rem = views[r].remote
        if which != "combined":
            rem = rem[rem[:, 3] == which]
        g0, g1, sk = rem[:, 0], rem[:, 1], rem[:, 4] - rem[:, 0]
        if which == "combined":
            g0 = np.concatenate([g0, local_g0])
            g1 = np.concatenate([g1, local_g0 + c])
            sk = np.concatenate([sk + t_loc, local_shift])
        order = np.argsort(g0, kind="stable")
        g0, g1, sk = g0[order], g1[order], sk[order]
    g0, g1, sk = _merge_runs(g0, g1, sk)
    return _clip_to_segments(mask.shapes, _merge_pairs(views[r].pairs, q_shift), g0, g1, sk,
                             q_shift)


def _merge_runs(g0, g1, shift):
    """Merges consecutive segments that abut both globally and locally (same shift), e.g.
    neighbouring chunks a rank owns side by side, so slices are not cut where no cut is
    needed."""
    if len(g0) < 2:
        return g0, g1, shift
    new = np.ones(len(g0), bool)
    new[1:] = (g0[1:] != g1[:-1]) | (shift[1:] != shift[:-1])
    first = np.nonzero(new)[0]
    last = np.append(first[1:], len(g0)) - 1
    return g0[first], g1[last], shift[first]


def _merge_pairs(pairs, q_shift):
    """Merges (slice, query chunk) pairs of one slice whose rows abut globally and locally
    (neighbouring chunks held side by side): one pair, rows ``[a, b)`` and key extent the
    union (still contiguous: rows are consecutive)."""
    s, chunk, a, b, e0, e1 = pairs
    if len(s) < 2:
        return pairs
    order = np.lexsort((a, s))
    s, chunk, a, b, e0, e1 = (x[order] for x in (s, chunk, a, b, e0, e1))
    sh = q_shift[chunk]
    new = np.ones(len(s), bool)
    new[1:] = (s[1:] != s[:-1]) | (a[1:] != b[:-1]) | (sh[1:] != sh[:-1])
    first = np.nonzero(new)[0]
    last = np.append(first[1:], len(s)) - 1
    return (s[first], chunk[first], a[first], b[last], np.minimum.reduceat(e0, first),
            np.maximum.reduceat(e1, first))


def split_areas(mask: AttnMask, meta: DispatchMeta):
    """Per rank: area on local KV, area on remote KV and remote KV tokens (int64 ``[cp]``
    each) — the inputs of the overlap cost model, without building any kernel plan."""
    views = rank_views(mask, meta, 1)
    host = np.array([_stage_shapes(mask, meta, views, r, "host").areas().sum()
                     for r in range(meta.cp)], np.int64)
    remote = np.array([_stage_shapes(mask, meta, views, r, 0).areas().sum()
                       for r in range(meta.cp)], np.int64)
    tokens = np.array([int(v.stage_len.sum()) for v in views], np.int64)
    return host, remote, tokens


def stage_buffer_len(capacity: PlanCapacity, meta: DispatchMeta, num_remote: int) -> int:
    """KV tokens of one remote stage's buffer at ``capacity``."""
    most = max(meta.padded_total - meta.local_len, 1)       # every token the rank does not own
    remote = min(capacity.remote_kv or most, most)
    return max(1, -(-remote // num_remote))


def cast_width(capacity: PlanCapacity, buffer_len: int) -> int:
    """Rows one rank sends one other rank per stage at ``capacity``."""
    return min(capacity.cast_width or buffer_len, buffer_len)


def _build(mask, meta, degree, bq, bk, backend, capacity=None) -> DistPlan:
    cp, t_loc = meta.cp, meta.local_len
    num_remote = max(degree, 1)
    views = rank_views(mask, meta, num_remote)
    stage_len = np.array([v.stage_len for v in views]).reshape(cp, num_remote)
    if capacity is None:
        buf_len = np.maximum(stage_len.max(axis=0), 1)                    # per remote stage
    else:
        buf_len = np.full(num_remote, stage_buffer_len(capacity, meta, num_remote))
        capacity.check("remote_kv", int(stage_len.max(initial=0)) * num_remote)
    casts = [build_cast_table(meta, [v.remote[v.remote[:, 3] == s] for v in views],
                              int(buf_len[s])) for s in range(num_remote)]
    if capacity is not None and cp > 1:
        casts = [widen_cast_table(c, cast_width(capacity, int(buf_len[0]))) for c in casts]
    # At a capacity the stages exist whatever this mask needs (their shapes are static).
    any_remote = bool(stage_len.sum()) or (capacity is not None and cp > 1)
    stage_shapes = functools.partial(_stage_shapes, mask, meta, views)

    def make_stage(which, kv_len, cast):
        shapes = [stage_shapes(r, which) for r in range(cp)]
        plans = [backend.build(x, t_loc, kv_len, bq, bk) for x in shapes]
        if capacity is not None:
            plans = [_at_capacity(p, capacity, backend.name, t_loc, kv_len) for p in plans]
        return StagePlan(ffa=backend.stack(plans), kv_len=kv_len, cast=cast,
                         num_slices=np.array([len(x.q0) for x in shapes], np.int64),
                         area=np.array([int(x.areas().sum()) for x in shapes], np.int64),
                         shapes=tuple(shapes))
    if degree == 0 or not any_remote:
        if any_remote:
            stages = (make_stage("combined", t_loc + int(buf_len[0]), casts[0]),)
        else:
            stages = (make_stage("host", t_loc, None),)
    else:
        stages = (make_stage("host", t_loc, None),) + tuple(
            make_stage(s, int(buf_len[s]), casts[s]) for s in range(num_remote))
    return DistPlan(meta=meta, overlap_degree=degree if any_remote else 0, block_q=bq,
                    block_k=bk, stages=stages, remote_tokens=stage_len.sum(axis=1),
                    needed=tuple(v.needed for v in views))


def _at_capacity(plan, capacity: PlanCapacity, backend: str, t_loc: int, kv_len: int):
    """One rank's stage plan with its item lists padded to the capacity. The k-tile list
    steps over tiles of fewer rows where the backend's two lists differ (the Mosaic GPU
    kernels: 64 against 128), and every q-list item holds at most that ratio of them."""
    fwd_block, bwd_block = backend_blocks(backend, t_loc, kv_len)
    ratio = max(1, fwd_block[0] // bwd_block[0])
    return plan.pad_to(capacity.items, capacity.items * ratio)
