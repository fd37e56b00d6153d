"""The vectorised planning (stages, work lists, cast tables, dispatch solver) against the
implementation it replaced: bit-identical plans, views, areas, tables, dispatches and
capacity errors on the zoo masks and random masks, for several cp, overlap degrees, backends
and capacities (host NumPy only).

The oracle below is the previous code (commit 7c7bada: per-rank loops, item-by-item work
lists, narrow-then-widened cast tables, the swap refinement without incremental sums),
copied verbatim apart from the ``old`` prefixes and the per-rank work lists it calls."""

import functools
import heapq  # noqa: F401  (the oracle's solver)

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from magi_jax.mask import AttnMask, SliceShapes
from magi_jax.mask_zoo import MASKS, make_mask
from magi_jax.planning import cast_table as C
from magi_jax.planning import solver as S
from magi_jax.planning import stages as D
from magi_jax.planning import work_list as W
from magi_jax.planning.capacity import CapacityError, PlanCapacity
from magi_jax.planning.cast_table import CastTable
from magi_jax.planning.solver import (
    _ASSIGN,
    _AUTO_CHUNKS_PER_RANK,
    _AUTO_TARGET,
    _MAX_SWAPS_PER_RANK,
    DispatchMeta,
    _greedy,
    _greedy_affinity,
    _local_enough,
    _meta,
    _refine_comm,
    _row_searchsorted,
    _validate,
    auto_chunk_size,
    chunk_areas,
    merge_intervals,
    ranges_repeat,
    slice_chunk_pairs,
)
from magi_jax.planning.stages import (
    _UNBOUNDED,
    DistPlan,
    RankView,
    StagePlan,
    _split_even,
    cast_width,
    stage_buffer_len,
)
from magi_jax.planning.tiling import TileItems
from magi_jax.planning.work_list import (
    BAND,
    EMPTY_ITEM,
    FULL,
    GENERAL,
    NUM_FIELDS,
    FFAPlanArrays,
    FFAPlanRuns,
    WorkList,
    backend_blocks,
    expand_runs,
)
from tests.sharding.masks import ZOO, self_attention_masks
from tests.strategies import slice_masks

_I32 = np.iinfo(np.int32)
_RUN_WRITE_MIN = 64
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


# ---- the oracle: the previous implementation ------------------------------------------------


def old_tile_items(
    shapes: SliceShapes, total_q: int, total_k: int, block_q: int, block_k: int
) -> TileItems:
    """Enumerates the non-empty (slice, q-tile, k-tile) items of ``shapes``."""
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q={block_q} and block_k={block_k} must be positive")
    live = np.nonzero(shapes.nonempty)[0]
    q0, q1 = shapes.q0[live], shapes.q1[live]
    # (slice, q-tile) pairs.
    owner, qt = old_ranges_repeat(q0 // block_q, (q1 - 1) // block_q)
    s = live[owner]
    r_first = np.maximum(shapes.q0[s], qt * block_q)
    r_last = np.minimum(shapes.q1[s], (qt + 1) * block_q) - 1
    # Row intervals move monotonically, so the k extent of the pair is [lo(first), hi(last)]
    # and is contiguous (consecutive rows' intervals touch): every k-tile in it has a cell.
    k_first = shapes.lo(r_first, s)
    k_last = shapes.hi(r_last, s)
    owner2, kt = old_ranges_repeat(k_first // block_k, k_last // block_k)
    s, qt = s[owner2], qt[owner2]
    tile_r0, tile_r1 = qt * block_q, (qt + 1) * block_q - 1
    tile_c0, tile_c1 = kt * block_k, (kt + 1) * block_k - 1
    rows_inside = (tile_r0 >= shapes.q0[s]) & (tile_r1 < shapes.q1[s])
    # Within the slice's rows, lo/hi are nondecreasing: check the extreme rows.
    full = (
        rows_inside
        & (shapes.lo(tile_r1, s) <= tile_c0)
        & (shapes.hi(tile_r0, s) >= tile_c1)
        & (tile_c1 < total_k)
    )
    order = np.lexsort((kt, s, qt))
    return TileItems(
        q_tile=qt[order].astype(np.int64),
        k_tile=kt[order].astype(np.int64),
        slice_id=s[order].astype(np.int64),
        full=full[order],
        block_q=block_q,
        block_k=block_k,
        num_q_tiles=-(-total_q // block_q),
        num_k_tiles=-(-total_k // block_k),
    )


def old_ranges_repeat(start: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each i, the integers [start[i], stop[i]]: returns (owner index, value)."""
    n = np.maximum(stop - start + 1, 0)
    owner = np.repeat(np.arange(len(start)), n)
    value = np.repeat(start, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    return owner, value


def old_pad_work_list(work: WorkList, num_items: int, field: str = "items") -> WorkList:
    """``work`` with its items padded to ``num_items`` by the empty item; raises
    :class:`~magi_jax.planning.capacity.CapacityError` naming ``field`` when it holds more."""
    have = len(work.items)
    if have > num_items:
        from magi_jax.planning.capacity import CapacityError

        raise CapacityError(
            f"this mask needs PlanCapacity.{field}>={have} work items on one "
            f"list, but the capacity holds {num_items}; build the capacity "
            "with more items (or PlanCapacity.from_masks over a sample of your "
            "masks)"
        )
    extra = np.broadcast_to(EMPTY_ITEM, (num_items - have, NUM_FIELDS))
    items = np.concatenate([work.items, extra]).astype(np.int32)
    return WorkList(work.order.astype(np.int32), work.offsets.astype(np.int32), items)


def old_build_work_list(
    shapes: SliceShapes, total_q: int, total_k: int, block_q: int, block_k: int, by: str
) -> WorkList:
    """Items of tiles ``block_q x block_k`` owned by q-tiles (``by="q"``) or k-tiles
    (``by="k"``)."""
    ti = old_tile_items(shapes, total_q, total_k, block_q, block_k)
    if by == "q":
        own, other, num = ti.q_tile, ti.k_tile, ti.num_q_tiles
    elif by == "k":
        own, other, num = ti.k_tile, ti.q_tile, ti.num_k_tiles
    else:
        raise ValueError(f"by={by!r}: use 'q' or 'k'")
    s = ti.slice_id
    # FULL items of a tile first (the forward runs them in a loop without predicate code),
    # then the masked ones; each group by the other tile.
    order = np.lexsort((other, ~ti.full, own))
    own, other, s, full = own[order], other[order], s[order], ti.full[order]
    counts = np.bincount(own, minlength=num).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    if offsets[-1] > _I32.max:
        raise ValueError(
            f"{offsets[-1]} work items do not fit int32 offsets; use a smaller "
            "problem per call (e.g. context parallelism)"
        )
    clip = lambda x: np.clip(x, -_I32.max, _I32.max)
    # A boundary tile inside the slice's query and key ranges is cut only by the diagonals.
    q_tile, k_tile = (own, other) if by == "q" else (other, own)
    inside = (
        (shapes.q0[s] <= q_tile * block_q)
        & ((q_tile + 1) * block_q <= shapes.q1[s])
        & (shapes.k0[s] <= k_tile * block_k)
        & ((k_tile + 1) * block_k <= shapes.k1[s])
    )
    kind = np.where(full, FULL, np.where(inside, BAND, GENERAL))
    items = (
        np.stack(
            [
                other,
                shapes.q0[s],
                shapes.q1[s],
                shapes.k0[s],
                shapes.k1[s],
                clip(shapes.dlo[s]),
                clip(shapes.dhi[s]),
                kind,
            ],
            axis=-1,
        )
        .astype(np.int32)
        .reshape(-1, NUM_FIELDS)
    )
    # Heaviest first; ties by tile index so the order is deterministic.
    launch = np.lexsort((np.arange(num), -counts)).astype(np.int32)
    return WorkList(launch, offsets.astype(np.int32), items)


def old_build_cast_table(
    meta: DispatchMeta, remote: list[np.ndarray], buffer_len: int
) -> CastTable:
    """Tables of one stage. ``remote[r]``: rank ``r``'s pieces ``[p, 5]`` = (global start,
    global end, owner rank, stage, offset in the stage buffer); ``buffer_len`` >= every
    rank's buffer."""
    cp, c = meta.cp, meta.chunk_size
    # Work per piece first (few), then expand to tokens once: a piece's rows sit in the block
    # (owner -> receiver) after the earlier pieces of that owner, in global-position order.
    pieces = [
        np.column_stack([rem[:, :3], np.full(len(rem), r), rem[:, 4]])
        for r, rem in enumerate(remote)
        if len(rem)
    ]
    pieces = np.concatenate(pieces) if pieces else np.zeros((0, 5), np.int64)
    g0, g1, src, dst, off_b = (pieces[:, i].astype(np.int64) for i in range(5))
    order = np.lexsort((g0, dst, src))
    g0, g1, src, dst, off_b = g0[order], g1[order], src[order], dst[order], off_b[order]
    length = g1 - g0
    pair = src * cp + dst
    first = np.searchsorted(pair, pair, side="left")
    cum = np.concatenate([[0], np.cumsum(length)])
    off_block = cum[:-1] - cum[first]  # piece start inside its block
    block_len = np.zeros(cp * cp, np.int64)
    np.add.at(block_len, pair, length)
    shift = (dst - src) % cp
    shifts = np.unique(shift)
    slot = np.searchsorted(shifts, shift)
    widths = np.zeros(len(shifts), np.int64)
    np.maximum.at(widths, slot, off_block + length)
    s_len = max(int(block_len.max(initial=0)), 1)
    send = np.full((cp, len(shifts), s_len), -1, np.int32)
    recv = np.full((cp, max(int(buffer_len), 1)), -1, np.int32)
    # Every piece lies inside one chunk, so it is one run on both sides: consecutive local
    # rows of the owner into consecutive block positions, consecutive block entries into
    # consecutive buffer rows.
    first_row = meta.chunk_slot[g0 // c] * c + g0 % c
    first_entry = slot * s_len + off_block
    if len(length) and length.sum() >= _RUN_WRITE_MIN * len(length):
        # Long runs: slice writes (no token-sized temporaries).
        for k in range(len(length)):
            n_k = int(length[k])
            send[src[k], slot[k], off_block[k] : off_block[k] + n_k] = np.arange(
                first_row[k], first_row[k] + n_k
            )
            recv[dst[k], off_b[k] : off_b[k] + n_k] = np.arange(
                first_entry[k], first_entry[k] + n_k
            )
    else:
        pi, step = ranges_repeat(np.zeros_like(length), length)
        send[src[pi], slot[pi], off_block[pi] + step] = first_row[pi] + step
        recv[dst[pi], off_b[pi] + step] = first_entry[pi] + step
    return CastTable.from_index(
        send, recv, tuple(int(s) for s in shifts), tuple(int(w) for w in widths)
    )


def old_widen_cast_table(table: CastTable, width: int) -> CastTable:
    """``table`` with a slot for every other rank (shifts ``1 .. cp-1``), each ``width`` rows
    wide, so that its shapes and static part depend on ``(cp, width, buffer_len)`` alone
    (plans at a capacity). Raises :class:`~magi_jax.planning.capacity.CapacityError` when a
    rank sends another more than ``width`` rows."""
    from magi_jax.planning.capacity import CapacityError

    cp = table.cp
    need = max(table.widths, default=0)
    if need > width:
        raise CapacityError(
            f"this mask needs PlanCapacity.cast_width>={need} (KV tokens one "
            f"rank sends another in one stage), but the capacity holds "
            f"{width}; build the capacity with cast_width>={need} (or "
            "PlanCapacity.from_masks over a sample of your masks)"
        )
    shifts = tuple(range(1, cp))
    send = np.full((cp, len(shifts), max(width, 1)), -1, np.int32)
    s_len = table.slot_len
    new_slot = np.array([sh - 1 for sh in table.shifts], np.int64)
    for j, w in enumerate(table.widths):
        send[:, new_slot[j], :w] = table.send_index[:, j, :w]
    recv = table.recv_index.astype(np.int64)
    real = recv >= 0
    j, p = recv // s_len, recv % s_len
    moved = (
        np.where(real, new_slot[np.clip(j, 0, max(len(new_slot) - 1, 0))] * max(width, 1) + p, -1)
        if len(new_slot)
        else np.full_like(recv, -1)
    )
    return CastTable.from_index(send, moved.astype(np.int32), shifts, (int(width),) * len(shifts))


def old_rank_views(mask: AttnMask, meta: DispatchMeta, num_remote_stages: int) -> list[RankView]:
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
        views.append(RankView(p, needed, *old_cut_stages(g0, g1, own, num_remote_stages)))
    return views


def old_cut_stages(g0, g1, own, k):
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


def old_clip_to_segments(sh: SliceShapes, pairs, seg_g0, seg_g1, seg_shift, q_shift_of_chunk):
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
        q0=band_a[keep] + sq,
        q1=band_b[keep] + sq,
        k0=rep(k0)[keep] + sk,
        k1=rep(k1)[keep] + sk,
        dlo=np.where(np.abs(dlo_) >= _UNBOUNDED, dlo_, dlo_ + d),
        dhi=np.where(np.abs(dhi_) >= _UNBOUNDED, dhi_, dhi_ + d),
    )


def old_stage_shapes(mask, meta, views, r, which):
    """Rank ``r``'s local-coordinate shapes for ``which`` = ``"host"`` (local KV),
    ``"combined"`` (local KV then the whole remote buffer) or a remote stage index."""
    c, t_loc = meta.chunk_size, meta.local_len
    q_shift = meta.chunk_slot * c - np.arange(meta.num_chunks) * c  # per chunk
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
    g0, g1, sk = old_merge_runs(g0, g1, sk)
    return old_clip_to_segments(
        mask.shapes, old_merge_pairs(views[r].pairs, q_shift), g0, g1, sk, q_shift
    )


def old_merge_runs(g0, g1, shift):
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


def old_merge_pairs(pairs, q_shift):
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
    return (
        s[first],
        chunk[first],
        a[first],
        b[last],
        np.minimum.reduceat(e0, first),
        np.maximum.reduceat(e1, first),
    )


def old_split_areas(mask: AttnMask, meta: DispatchMeta):
    """Per rank: area on local KV, area on remote KV and remote KV tokens (int64 ``[cp]``
    each) — the inputs of the overlap cost model, without building any kernel plan."""
    views = old_rank_views(mask, meta, 1)
    host = np.array(
        [old_stage_shapes(mask, meta, views, r, "host").areas().sum() for r in range(meta.cp)],
        np.int64,
    )
    remote = np.array(
        [old_stage_shapes(mask, meta, views, r, 0).areas().sum() for r in range(meta.cp)], np.int64
    )
    tokens = np.array([int(v.stage_len.sum()) for v in views], np.int64)
    return host, remote, tokens


def old_build(mask, meta, degree, bq, bk, backend, capacity=None) -> DistPlan:
    cp, t_loc = meta.cp, meta.local_len
    num_remote = max(degree, 1)
    views = old_rank_views(mask, meta, num_remote)
    stage_len = np.array([v.stage_len for v in views]).reshape(cp, num_remote)
    if capacity is None:
        buf_len = np.maximum(stage_len.max(axis=0), 1)  # per remote stage
    else:
        buf_len = np.full(num_remote, stage_buffer_len(capacity, meta, num_remote))
        capacity.check("remote_kv", int(stage_len.max(initial=0)) * num_remote)
    casts = [
        old_build_cast_table(meta, [v.remote[v.remote[:, 3] == s] for v in views], int(buf_len[s]))
        for s in range(num_remote)
    ]
    if capacity is not None and cp > 1:
        casts = [old_widen_cast_table(c, cast_width(capacity, int(buf_len[0]))) for c in casts]
    # At a capacity the stages exist whatever this mask needs (their shapes are static).
    any_remote = bool(stage_len.sum()) or (capacity is not None and cp > 1)
    stage_shapes = functools.partial(old_stage_shapes, mask, meta, views)

    def make_stage(which, kv_len, cast):
        shapes = [stage_shapes(r, which) for r in range(cp)]
        plans = [old_plan_arrays(x, backend.name, t_loc, kv_len, bq, bk) for x in shapes]
        if capacity is not None:
            plans = [old_at_capacity(p, capacity, backend.name, t_loc, kv_len) for p in plans]
        return StagePlan(
            ffa=old_stack(plans),
            kv_len=kv_len,
            cast=cast,
            num_slices=np.array([len(x.q0) for x in shapes], np.int64),
            area=np.array([int(x.areas().sum()) for x in shapes], np.int64),
            shapes=tuple(shapes),
        )

    if degree == 0 or not any_remote:
        if any_remote:
            stages = (make_stage("combined", t_loc + int(buf_len[0]), casts[0]),)
        else:
            stages = (make_stage("host", t_loc, None),)
    else:
        stages = (make_stage("host", t_loc, None),) + tuple(
            make_stage(s, int(buf_len[s]), casts[s]) for s in range(num_remote)
        )
    return DistPlan(
        meta=meta,
        overlap_degree=degree if any_remote else 0,
        block_q=bq,
        block_k=bk,
        stages=stages,
        remote_tokens=stage_len.sum(axis=1),
        needed=tuple(v.needed for v in views),
    )


def old_refine_swaps(assign: np.ndarray, area: np.ndarray, locality=None) -> np.ndarray:
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
    for _ in range(_MAX_SWAPS_PER_RANK * cp):
        top = int(np.argmax(loads))
        gap = loads[top] - loads  # [cp]
        order = np.argsort(area[assign], axis=1, kind="stable")
        b = np.take_along_axis(area[assign], order, axis=1)  # [cp, m] sorted
        a = area[assign[top]]  # [m]
        # Ideal partner area: a_i - gap_r / 2 (the swap then evens the pair).
        target = a[None, :] - gap[:, None] // 2  # [cp, m]
        j = np.stack([_row_searchsorted(b, target), _row_searchsorted(b, target) - 1], -1)
        j = np.clip(j, 0, m - 1)  # [cp, m, 2]
        bj = np.take_along_axis(b[:, None, :].repeat(m, 1), j, axis=2)
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
            hold = (need > 0) | (owner[None, :] == np.arange(cp)[:, None])  # [cp, n]
            # Keys of chunk y already held by the top rank; keys of x held by each rank.
            top_has = np.bincount(seg, weights=hold[top, kc], minlength=n)
            y = np.take_along_axis(
                assign[:, None, :].repeat(m, 1),
                np.take_along_axis(order[:, None, :].repeat(m, 1), j, 2),
                2,
            )
            xs = assign[top]
            r_has = np.stack([hold[:, kc[indptr[x] : indptr[x + 1]]].sum(1) for x in xs], 1)
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
        assign[top, i], assign[r, jj] = assign[r, jj], assign[top, i]
        loads[top] -= d[r, i, t]
        loads[r] += d[r, i, t]
    return assign


def old_chunk_kv_extents(mask: AttnMask, chunk_size: int, n: int):
    """Per chunk, the key chunks its rows see, as a CSR (indptr, key-chunk ids); cached (the
    communication-aware passes of one solve share it)."""
    s, chunk, a, b, k0, k1 = slice_chunk_pairs(mask.shapes, chunk_size)
    owner, kc = ranges_repeat(k0 // chunk_size, (k1 - 1) // chunk_size + 1)
    pairs = np.unique(chunk[owner] * n + kc)
    qc, kc = pairs // n, pairs % n
    indptr = np.searchsorted(qc, np.arange(n + 1))
    return indptr, kc


def old_solve_dispatch(
    mask: AttnMask, cp: int, chunk_size: int | None = None, algorithm: str = "magi"
) -> DispatchMeta:
    """Assigns chunks of the (padded) sequence to ``cp`` ranks; cached by (mask fingerprint,
    cp, chunk_size, algorithm).

    ``chunk_size=None`` chooses it: for ``"magi"`` the fewest of 8/16/32 chunks per rank that
    reach max/mean area ≤ 1.01 (else the best of them), for the baselines 8 per rank.
    Sequences whose length is not a multiple of ``cp·chunk_size`` are padded at the end.
    """
    _validate(mask, cp, chunk_size, algorithm)
    cp = int(cp)
    total = mask.total_q
    if chunk_size is not None:
        return old_solve(mask, cp, int(chunk_size), algorithm)
    if algorithm != "magi":
        return old_solve(mask, cp, auto_chunk_size(total, cp, _AUTO_CHUNKS_PER_RANK[0]), algorithm)
    best = None
    for m in _AUTO_CHUNKS_PER_RANK:
        c = auto_chunk_size(total, cp, m)
        meta = old_solve(mask, cp, c, "balance")
        if best is None or meta.imbalance() < best.imbalance() - 1e-9:
            best = meta
        if best.imbalance() <= _AUTO_TARGET or c == 1:
            break
    # The communication-aware passes once, on the chunking that balanced best.
    return old_solve(mask, cp, best.chunk_size, "magi")


def old_solve(mask: AttnMask, cp: int, chunk_size: int, algorithm: str) -> DispatchMeta:
    total = mask.total_q
    m = max(1, -(-total // (cp * chunk_size)))
    if algorithm == "zigzag" and m % 2:
        m += 1  # two halves per rank
    n = m * cp
    area = chunk_areas(mask, chunk_size, n)
    if algorithm in ("magi", "balance"):
        assign = old_refine_swaps(_greedy(n, cp, area), area)
        if algorithm == "magi":
            alt = _greedy_affinity(n, cp, area, mask, chunk_size)
            indptr, kc = old_chunk_kv_extents(mask, chunk_size, n)
            alt = old_refine_swaps(alt, area, (indptr, kc) if _local_enough(kc, n) else None)
            # Keep the affinity start when it balances as well (within 0.5% of the max).
            if area[alt].sum(1).max() <= area[assign].sum(1).max() * 1.005:
                assign = alt
        if algorithm == "magi":
            assign = _refine_comm(assign, area, mask, chunk_size)
    else:
        assign = _ASSIGN[algorithm](n, cp, area)
    return _meta(mask, cp, chunk_size, assign, area, algorithm)


def old_plan_arrays(shapes, backend, total_q, total_k, block_q, block_k):
    fwd, bwd = backend_blocks(backend, total_q, total_k, block_q, block_k)
    return FFAPlanArrays(
        *old_build_work_list(shapes, total_q, total_k, *fwd, "q"),
        *old_build_work_list(shapes, total_q, total_k, *bwd, "k"),
    )


def old_at_capacity(plan, capacity, backend, t_loc, kv_len):
    fwd_block, bwd_block = backend_blocks(backend, t_loc, kv_len)
    ratio = max(1, fwd_block[0] // bwd_block[0])
    return FFAPlanArrays(
        *old_pad_work_list(plan.fwd, capacity.items),
        *old_pad_work_list(plan.bwd, capacity.items * ratio),
    )


def old_stack(plans):
    wq = max(len(p.q_items) for p in plans)
    wk = max(len(p.k_items) for p in plans)
    padded = [
        FFAPlanArrays(*old_pad_work_list(p.fwd, wq), *old_pad_work_list(p.bwd, wk)) for p in plans
    ]
    return FFAPlanArrays(*(np.stack(parts) for parts in zip(*padded)))


# ---- comparisons -----------------------------------------------------------------------------


def same_array(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(a, b, err_msg=what)


def same_shapes(a, b, what=""):
    for f in ("q0", "q1", "k0", "k1", "dlo", "dhi"):
        same_array(getattr(a, f), getattr(b, f), f"{what} {f}")


def same_table(a, b):
    same_array(a.send_index, b.send_index, "send_index")
    same_array(a.recv_index, b.recv_index, "recv_index")
    assert a.shifts == b.shifts and a.widths == b.widths


def same_plan(p, q):
    assert (p.overlap_degree, p.block_q, p.block_k) == (q.overlap_degree, q.block_q, q.block_k)
    assert p.meta.fingerprint() == q.meta.fingerprint()
    same_array(p.remote_tokens, q.remote_tokens, "remote_tokens")
    assert len(p.needed) == len(q.needed)
    for x, y in zip(p.needed, q.needed):
        same_array(x, y, "needed")
    assert len(p.stages) == len(q.stages)
    for i, (s, t) in enumerate(zip(p.stages, q.stages)):
        assert s.kv_len == t.kv_len
        # The new plan's lists travel as runs: expanded, they are the old item lists.
        assert isinstance(t.ffa, FFAPlanRuns) and isinstance(s.ffa, FFAPlanArrays)
        assert t.items == (s.ffa.q_items.shape[1], s.ffa.k_items.shape[1])
        for f, x, y in zip(s.ffa._fields, s.ffa, expand_runs(t.ffa, *t.items)):
            same_array(x, y, f"stage {i} {f}")
        assert all(y.flags.c_contiguous for y in t.ffa)
        assert (s.cast is None) == (t.cast is None)
        if s.cast is not None:
            same_table(s.cast, t.cast)
        same_array(s.num_slices, t.num_slices, "num_slices")
        same_array(s.area, t.area, "area")
        assert len(s.shapes) == len(t.shapes)
        for r, (a, b) in enumerate(zip(s.shapes, t.shapes)):
            same_shapes(a, b, f"stage {i} rank {r}")


class Raised(tuple):
    """What a call raised: (type, message)."""


def outcome(fn, *args):
    """``fn(*args)``, or the error it raises (type and message)."""
    try:
        return fn(*args)
    except ValueError as e:
        return Raised((type(e), str(e)))


def check_plan(
    mask, cp, degree, backend="xla", capacity=None, algorithm="magi", chunk_size=None, block=8
):
    meta = S.solve_dispatch(mask, cp, chunk_size, algorithm)
    D.clear_cache()
    new = outcome(D.build_dist_plan, mask, meta, degree, block, block, backend, capacity)
    old = outcome(old_build, mask, meta, degree, block, block, D.host_planner(backend), capacity)
    if isinstance(old, Raised):
        assert old == new
        return None
    assert not isinstance(new, Raised), new
    same_plan(old, new)
    return new


def check_views(mask, cp, algorithm="magi"):
    meta = S.solve_dispatch(mask, cp, None, algorithm)
    for k in (0, 1, 2, 3):
        for v, w in zip(old_rank_views(mask, meta, k), D.rank_views(mask, meta, k)):
            for x, y in zip(v.pairs, w.pairs):
                same_array(x, y, "pairs")
            same_array(v.needed, w.needed, "needed")
            same_array(v.remote, w.remote, "remote")
            same_array(v.stage_len, w.stage_len, "stage_len")
    for x, y in zip(old_split_areas(mask, meta), D.split_areas(mask, meta)):
        same_array(x, y, "split_areas")


def capacities(total):
    """No capacity, and capacities that fit some masks and not others (every field)."""
    yield None
    for items in (1, 9, 1000):
        for remote_kv in (None, 2, 40):
            for width in (None, 1, 6):
                yield PlanCapacity(total, items=items, remote_kv=remote_kv, cast_width=width)


CAPS = list(capacities(ZOO["causal"].total_q))


# ---- distributed plans -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zoo_plans_identical(name, cp):
    mask = ZOO[name]
    check_views(mask, cp)
    for degree in (0, 1, 2, 3):
        for backend in ("xla", "pallas"):
            for capacity in CAPS[::5] if cp > 1 else CAPS[:2]:
                check_plan(mask, cp, degree, backend, capacity)


@SETTINGS
@given(
    self_attention_masks(max_len=48),
    st.sampled_from([1, 2, 3, 4]),
    st.sampled_from([0, 1, 2, 3]),
    st.sampled_from(S.ALGORITHMS),
    st.sampled_from(["xla", "pallas"]),
    st.sampled_from(range(len(CAPS))),
    st.sampled_from([4, 8, 16]),
)
def test_random_plans_identical(mask, cp, degree, algorithm, backend, cap, block):
    capacity = CAPS[cap]
    if capacity is not None:
        capacity = PlanCapacity(
            mask.total_q,
            items=capacity.items,
            remote_kv=capacity.remote_kv,
            cast_width=capacity.cast_width,
        )
    check_plan(mask, cp, degree, backend, capacity, algorithm, block=block)
    check_views(mask, cp, algorithm)


@pytest.mark.parametrize(
    "name", ["doc-causal", "many-docs", "shared-question", "prefix-lm", "sliding-window", "causal"]
)
def test_benchmark_masks_identical(name):
    """Longer masks (more chunks, ranks and tiles), at tight capacities too."""
    mask = make_mask(name, 8192, window=512)
    for cp, degree in ((8, 0), (8, 2), (16, 3)):
        plan = check_plan(mask, cp, degree, "pallas", block=128)
        if plan is not None and cp > 1:
            tight = PlanCapacity.from_masks([mask], mesh_size=cp, overlap_degree=degree)
            check_plan(mask, cp, degree, "pallas", tight, chunk_size=tight.chunk_size, block=128)


# ---- cast tables, stored as runs ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["causal", "doc_causal", "shared_question", "full"])
def test_cast_tables_identical(name):
    """The tables the runs expand to are the old builder's, at every width and at run
    capacities from the exact need (same tables) to one below it (CapacityError)."""
    mask = ZOO[name]
    for cp in (2, 3, 4, 8):
        meta = S.solve_dispatch(mask, cp, 2 if cp < 8 else None)
        views = old_rank_views(mask, meta, 2)
        for s in range(2):
            remote = [v.remote[v.remote[:, 3] == s] for v in views]
            old = old_build_cast_table(meta, remote, 50)
            same_table(old, C.build_cast_table(meta, remote, 50))
            for width in (1, 3, max(old.widths, default=0), 64):
                want = outcome(old_widen_cast_table, old, width)
                got = outcome(C.build_cast_table, meta, remote, 50, width)
                if isinstance(want, Raised):
                    assert want == got
                    continue
                same_table(want, got)
                send_need, recv_need = got.run_counts()
                pieces = np.concatenate(
                    [
                        np.column_stack([rem[:, :3], np.full(len(rem), r), rem[:, 4]])
                        for r, rem in enumerate(remote)
                        if len(rem)
                    ]
                    or [np.zeros((0, 5), np.int64)]
                )
                build = lambda a, b: C.cast_table_from_pieces(
                    meta, *pieces.T, buffer_len=50, width=width, send_runs=a, recv_runs=b
                )
                for a, b in ((send_need, recv_need), (send_need + 5, recv_need + 3)):
                    at_cap = build(a, b)
                    same_table(want, at_cap)
                    assert at_cap.send_runs.shape == (cp, min(a + cp - 1, (cp - 1) * width), 2)
                    assert at_cap.recv_runs.shape == (cp, min(b, 50), 2)
                if send_need > 1:
                    with pytest.raises(CapacityError, match="send_runs"):
                        build(send_need - 1, recv_need)
                if recv_need > 1:
                    with pytest.raises(CapacityError, match="recv_runs"):
                        build(send_need, recv_need - 1)


# ---- work lists --------------------------------------------------------------------------------


def check_list(shapes, total_q, total_k, block_q, block_k, by):
    old = outcome(old_build_work_list, shapes, total_q, total_k, block_q, block_k, by)
    new = outcome(W.build_work_list, shapes, total_q, total_k, block_q, block_k, by)
    if isinstance(old, Raised):
        assert old == new
        return
    for f, x, y in zip(WorkList._fields, old, new):
        same_array(x, y, f)


@SETTINGS
@given(
    slice_masks(max_len=60),
    st.sampled_from([(8, 8), (16, 8), (4, 16), (1, 1), (3, 5), (64, 64)]),
    st.sampled_from(["q", "k"]),
)
def test_work_lists_identical(mask, blocks, by):
    check_list(mask.shapes, mask.total_q, mask.total_k, *blocks, by)


def test_work_lists_of_shapes_not_canonical():
    """Shapes with rows that see no key (not what masks give): the item-by-item path."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 6))
        q0 = rng.integers(0, 30, n)
        k0 = rng.integers(0, 30, n)
        dlo = rng.integers(-20, 10, n)
        sh = SliceShapes(
            q0,
            q0 + rng.integers(0, 15, n),
            k0,
            k0 + rng.integers(1, 15, n),
            dlo,
            dlo + rng.integers(-2, 20, n),
        )
        for by in "qk":
            for blocks in ((4, 4), (8, 2), (1, 3)):
                check_list(sh, 50, 50, *blocks, by)


@pytest.mark.parametrize("by", ["q", "k"])
def test_stacked_work_lists_are_stacked_single_lists(by):
    """build_work_lists over several calls = each call's list, padded and stacked; the
    capacity error names the first call over the capacity."""
    lens = [300, 77, 512, 129, 250]
    masks = [
        AttnMask.varlen(np.cumsum([0] + lens), causal=True),
        AttnMask.shared_question(lens),
        AttnMask.sliding_window(1268, 100, 31),
        AttnMask.from_ranges([], [], [], total_q=1268, total_k=1268),
    ]
    flat = SliceShapes(
        *(
            np.concatenate([getattr(m.shapes, f) for m in masks])
            for f in ("q0", "q1", "k0", "k1", "dlo", "dhi")
        )
    )
    rank = np.repeat(np.arange(len(masks)), [m.num_slices for m in masks])
    blocks = (64, 128)
    singles = [old_build_work_list(m.shapes, 1268, 1268, *blocks, by) for m in masks]
    width = max(len(w.items) for w in singles)
    for num in (None, width, width + 7):
        got = W.build_work_lists(flat, rank, len(masks), 1268, 1268, *blocks, by, num)
        want = [old_pad_work_list(w, num or width) for w in singles]
        for f, x, y in zip(WorkList._fields, zip(*want), got):
            same_array(np.stack(x), y, f)
    with pytest.raises(CapacityError, match=f">={len(singles[0].items)} work items"):
        W.build_work_lists(flat, rank, len(masks), 1268, 1268, *blocks, by, 1)


# ---- the dispatch solver -------------------------------------------------------------------------


def check_solve(mask, cp, chunk_size=None, algorithm="magi"):
    old = outcome(old_solve_dispatch, mask, cp, chunk_size, algorithm)
    S.solve_dispatch.cache_clear()
    new = outcome(S.solve_dispatch, mask, cp, chunk_size, algorithm)
    if isinstance(old, Raised):
        assert old == new
        return
    assert old.fingerprint() == new.fingerprint() and old.algorithm == new.algorithm
    same_array(old.chunk_area, new.chunk_area, "chunk_area")


@SETTINGS
@given(
    self_attention_masks(max_len=64),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.sampled_from([None, 1, 2, 3, 5]),
    st.sampled_from(S.ALGORITHMS),
)
def test_random_dispatch_identical(mask, cp, chunk_size, algorithm):
    check_solve(mask, cp, chunk_size, algorithm)


@pytest.mark.parametrize("name", MASKS)
def test_benchmark_dispatch_identical(name):
    """Enough chunks for the communication-aware passes (locality), auto and fixed chunks."""
    for total, cp in ((16384, 8), (32768, 16)):
        mask = make_mask(name, total)
        for chunk in (None, total // (cp * 16)):
            check_solve(mask, cp, chunk)
            n = -(-total // (cp * (chunk or S.auto_chunk_size(total, cp, 8))))
            n = max(n, 1) * cp
            c = chunk or S.auto_chunk_size(total, cp, 8)
            for x, y in zip(old_chunk_kv_extents(mask, c, n), S._chunk_kv_extents(mask, c, n)):
                same_array(x, y, "chunk_kv_extents")


@pytest.mark.parametrize("seed", range(4))
def test_swaps_and_seen_sums(seed, monkeypatch):
    """The swap refinement with locality (incremental key counts), and both ways of summing
    the key chunks held."""
    mask = make_mask("many-docs", 32768, num_docs=10, seed=seed)
    cp, c = 16, 128
    n = 32768 // c
    area = S.chunk_areas(mask, c, n)
    loc = old_chunk_kv_extents(mask, c, n)
    start = _greedy_affinity(n, cp, area, mask, c)
    same_array(old_refine_swaps(start, area, loc), S._refine_swaps(start, area, loc))
    same_array(
        old_refine_swaps(_greedy(n, cp, area), area), S._refine_swaps(_greedy(n, cp, area), area)
    )
    hold = np.random.default_rng(seed).random((cp, n)) > 0.6
    want = np.array(
        [[hold[q, loc[1][loc[0][x] : loc[0][x + 1]]].sum() for x in range(n)] for q in range(cp)]
    )
    same_array(want, S._seen_sums(hold, *loc))
    monkeypatch.setattr(S, "_SEEN_SUMS_MATMUL_MAX", 0)
    same_array(want, S._seen_sums(hold, *loc))
