"""Masks from segment ids, with the plan built on the device.

:func:`segment_work_lists` builds, in ``jax.numpy`` under ``jit`` from *traced* segment ids,
exactly the work list that the host builds for
``AttnMask.from_segment_ids(ids, causal, window)``
(:func:`magi_jax.planning.work_list.build_work_list`), padded to a fixed capacity: one
compilation serves every packing of a length. :func:`dot_product_attention` is
``jax.nn.dot_product_attention``'s interface (``[B, T, N, H]``, ``segment_ids``,
``is_causal``, ``local_window_size``) on top of it.

How the list is built (memory ``O(T + W_cap)``, nothing of size ``T x T``):

1. runs of one id from the id changes (``jnp.nonzero(size=T)``); a nonzero run is a
   document;
2. every document is cut into the (at most three) typed slices of
   :func:`magi_jax.mask.shape_to_slices` (CAUSAL top, BI_CAUSAL or FULL middle, INV_CAUSAL
   bottom) and put in the canonical form of :class:`magi_jax.mask.SliceShapes`;
3. (slice, q-tile) pairs: a ragged enumeration (cumsum + searchsorted) into ``T + NQ``
   slots (slices hold disjoint rows, so there are at most that many);
4. per pair the k-tiles ``[lo(first row), hi(last row)]`` (rows' key intervals move
   monotonically inside a slice), enumerated the same way into ``W_cap`` item slots, with
   each item's kind (FULL / BAND / GENERAL, as the host decides it);
5. a stable sort by (owned tile, not FULL, other tile) — the enumeration is already in
   slice order, which breaks the remaining ties as the host does — then offsets from the
   per-tile counts and the launch order (heaviest first, ties by tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.mask import _window
from magi_jax.planning.tiling import EMPTY_ITEM
from magi_jax.planning.work_list import BAND, FULL, GENERAL

__all__ = [
    "dot_product_attention",
    "segment_work_lists",
    "segment_items_bound",
    "noncontiguous_ids",
    "unplannable",
    "pack_rows",
    "unpack_rows",
]

_I32_MAX = int(np.iinfo(np.int32).max)
# Slices' typed pieces (AttnMaskType values).
_T_FULL, _T_CAUSAL, _T_INV, _T_BI = 0, 1, 2, 3


def pack_rows(x):
    """``[B, T, ...] -> [B·T, ...]``: the rows of a batch packed into one sequence, row ``b``
    at ``[b·T, (b+1)·T)`` (a plain reshape; NumPy or JAX arrays)."""
    return x.reshape((x.shape[0] * x.shape[1],) + tuple(x.shape[2:]))


def unpack_rows(x, batch: int):
    """The inverse of :func:`pack_rows`: ``[B·T, ...] -> [B, T, ...]`` with ``B = batch``."""
    if x.shape[0] % batch:
        raise ValueError(f"unpack_rows: {x.shape[0]} tokens do not split into {batch} rows")
    return x.reshape((batch, x.shape[0] // batch) + tuple(x.shape[1:]))


def _take(table, idx):
    """Rows ``table[idx]`` of an int32 table (indices known to be in bounds)."""
    return table.at[idx].get(mode="promise_in_bounds")


def _ragged(counts, size):
    """A ragged enumeration of ``counts`` (int32 ``[n]``, >= 0) into ``size`` slots: the
    owner of each slot, the slot's position inside its owner and the total. Slots past the
    total get an in-bounds owner and are to be masked by the caller."""
    ends = jnp.cumsum(counts)
    slot = jnp.arange(size, dtype=jnp.int32)
    # Unrolled binary search: no device loop (on GPUs a while loop syncs with the host).
    owner = jnp.minimum(
        jnp.searchsorted(ends, slot, side="right", method="scan_unrolled").astype(jnp.int32),
        counts.shape[0] - 1,
    )
    return owner, slot - _take(ends - counts, owner), ends[-1]


def _slices(ids, left, right, row_len):
    """The canonical slices of the documents of ``ids`` (int32 ``[T]``), three pieces per
    run in the order of :func:`magi_jax.mask.shape_to_slices` (CAUSAL top, BI_CAUSAL or FULL
    middle, INV_CAUSAL bottom), in the form of :class:`magi_jax.mask.SliceShapes`: int32
    ``[3T, 8]`` rows ``(q0, q1, k0, k1, dlo, dhi, dlo_field, dhi_field)`` (``q0 == q1 == 0``
    for an empty piece). ``dlo``/``dhi`` are the diagonal bounds with a missing one replaced
    by ``-/+2T`` (so ``lo``/``hi`` need no special case and nothing overflows);
    ``*_field`` are the item fields (a missing bound is ``-/+(2**31 - 1)``, like the host's
    clipped sentinels). ``left``/``right`` (int32 scalars, may be traced) are finite here
    (an unbounded side is ``T``, which no document exceeds, so the pieces come out as the
    host's). Runs also break every ``row_len`` tokens (packed rows)."""
    t = ids.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    change = (pos % row_len == 0) | (ids != jnp.roll(ids, 1))
    s = jnp.nonzero(change, size=t, fill_value=t)[0].astype(jnp.int32)
    e = jnp.concatenate([s[1:], jnp.full((1,), t, jnp.int32)])
    live = (s < t) & (_take(ids, jnp.minimum(s, t - 1)) != 0)
    # shape_to_slices(s, e, s, e, -left, right): rows >= tt have a diagonal lower edge, rows
    # >= u a clamped upper one.
    tt = jnp.minimum(s + left, e)
    u = jnp.maximum(e - right, s)
    band = tt <= u
    a, b = jnp.where(band, tt, u), jnp.where(band, u, tt)  # the middle piece's rows
    # Pieces (qs, qe, ks, ke, type): top / middle / bottom.
    top = (s, a, s, a + right, jnp.full_like(s, _T_CAUSAL))
    mid = (
        a,
        b,
        jnp.where(band, tt - left, s),
        jnp.where(band, u + right, e),
        jnp.where(band, _T_BI, _T_FULL),
    )
    bot = (b, e, b - left, e, jnp.full_like(s, _T_INV))
    qs, qe, ks, ke, ty = (jnp.stack(p, axis=1).reshape(-1) for p in zip(top, mid, bot))
    live = jnp.repeat(live, 3) & (qe > qs)
    # SliceShapes.from_slices: the diagonal bounds of the type, rows clipped to those that
    # see a key.
    has_lo = (ty == _T_INV) | (ty == _T_BI)
    has_hi = (ty == _T_CAUSAL) | (ty == _T_BI)
    dlo, dhi = ks - qs, ke - qe
    q0 = jnp.where(has_hi, jnp.maximum(qs, ks - dhi), qs)
    q1 = jnp.where(has_lo, jnp.minimum(qe, ke - dlo), qe)
    live = live & (ke > ks) & (q1 > q0) & ~(has_lo & has_hi & (dhi < dlo))
    return jnp.stack(
        [
            jnp.where(live, q0, 0),
            jnp.where(live, q1, 0),
            ks,
            ke,
            jnp.where(has_lo, dlo, -2 * t),
            jnp.where(has_hi, dhi, 2 * t),
            jnp.where(has_lo, dlo, -_I32_MAX),
            jnp.where(has_hi, dhi, _I32_MAX),
        ],
        axis=1,
    )


def _resolve_window(window, causal: bool, total: int) -> tuple[int, int]:
    """``(left, right)`` of :meth:`AttnMask.varlen`'s ``window``/``causal`` with an
    unbounded side as ``total`` (no document is longer)."""
    left, right = _window(window, causal)
    return (
        total if left is None else min(int(left), total),
        total if right is None else min(int(right), total),
    )


def segment_work_lists(
    segment_ids,
    *,
    causal: bool = True,
    window=None,
    block_q: int,
    block_k: int,
    by: str,
    capacity_items: int,
):
    """The work list of ``AttnMask.from_segment_ids(segment_ids, causal, window)`` for tiles
    ``block_q x block_k`` owned by q-tiles (``by="q"``) or k-tiles (``by="k"``), built with
    ``jax.numpy``: traceable under ``jit`` with ``segment_ids`` a traced int ``[T]`` (or
    ``[B, T]``: rows packed into one sequence of ``B·T`` tokens, documents never crossing
    rows, as :meth:`~magi_jax.mask.AttnMask.from_segment_ids` does); shapes are static.

    Returns ``(order [N], offsets [N + 1], items [capacity_items, 8], needed)`` int32, ``N``
    the number of owned tiles: exactly the arrays of
    :func:`magi_jax.planning.work_list.build_work_list` on that mask, the items padded with
    :data:`~magi_jax.planning.tiling.EMPTY_ITEM` up to ``capacity_items``; ``needed`` (a
    scalar) is the true item count. When ``needed > capacity_items`` the list is truncated,
    hence wrong: check it (:func:`unplannable`). Output shapes depend on ``T``, the blocks
    and ``capacity_items`` alone; memory ``O(T + capacity_items)``, nothing ``T x T``.

    Unlike the host, the device does not check that an id's tokens form one run: every
    maximal run is a document (two runs of one id are two documents; see
    :func:`noncontiguous_ids`)."""
    ids = jnp.asarray(segment_ids)
    if ids.ndim not in (1, 2):
        raise ValueError(f"segment_ids must be [T] or [B, T]; got shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"segment ids must be integers; got dtype {ids.dtype}")
    row_len = ids.shape[-1]
    ids = ids.reshape(-1)
    left, right = _resolve_window(window, causal, ids.shape[0])
    return _work_lists(
        ids,
        jnp.int32(left),
        jnp.int32(right),
        row_len=max(row_len, 1),
        block_q=block_q,
        block_k=block_k,
        by=by,
        capacity_items=capacity_items,
    )


def _work_lists(
    ids, left, right, *, row_len: int, block_q: int, block_k: int, by: str, capacity_items: int
):
    """:func:`segment_work_lists` on packed ids ``[T]`` with the window ``(left, right)`` as
    int32 scalars in ``[0, T]`` (``T`` = unbounded; they may be traced)."""
    if by not in ("q", "k"):
        raise ValueError(f"by={by!r}: use 'q' or 'k'")
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q={block_q} and block_k={block_k} must be positive")
    t = ids.shape[0]
    if t >= 1 << 29:
        raise ValueError(f"T={t} tokens: the device builder computes in int32 and takes T < 2**29")
    cap = int(capacity_items)
    if cap < 0:
        raise ValueError(f"capacity_items={cap} must be >= 0")
    nq, nk = -(-t // block_q), -(-t // block_k)
    num_tiles = nq if by == "q" else nk
    empty = jnp.asarray(EMPTY_ITEM, jnp.int32)
    if t == 0:
        return (
            jnp.zeros((0,), jnp.int32),
            jnp.zeros((1,), jnp.int32),
            jnp.broadcast_to(empty, (cap, 8)),
            jnp.zeros((), jnp.int32),
        )
    tab = _slices(ids, left, right, row_len)  # [3T, 8]
    q0, q1 = tab[:, 0], tab[:, 1]

    def geometry(rows):
        """Columns of slice rows: q0, q1, k0, k1 and the row interval functions."""
        g0, g1, gk0, gk1, gdlo, gdhi = (rows[:, i] for i in range(6))
        lo = lambda r: jnp.maximum(gk0, r + gdlo)  # first key of row r
        hi = lambda r: jnp.minimum(gk1 - 1, r + gdhi)  # last key of row r
        return g0, g1, gk0, gk1, lo, hi

    # (slice, q-tile) pairs; slices hold disjoint rows, so at most T + NQ of them.
    qt_first = q0 // block_q
    n_pairs = jnp.where(q1 > q0, (q1 - 1) // block_q - qt_first + 1, 0)
    sl, pos, total_pairs = _ragged(n_pairs, t + nq)
    p0, p1, _, _, lo, hi = geometry(_take(tab, sl))
    qt = _take(qt_first, sl) + pos
    kt_first = lo(jnp.maximum(p0, qt * block_q)) // block_k
    kt_last = hi(jnp.minimum(p1, (qt + 1) * block_q) - 1) // block_k
    pair_ok = jnp.arange(t + nq) < total_pairs
    n_items = jnp.where(pair_ok, kt_last - kt_first + 1, 0)

    # Items (pair, k-tile), enumerated slice by slice, q-tile by q-tile, k-tile by k-tile.
    pair, pos, needed = _ragged(n_items, cap)
    ok = jnp.arange(cap) < needed
    per_pair = _take(jnp.stack([sl, qt, kt_first], axis=1), pair)
    s, it_q, it_k = per_pair[:, 0], per_pair[:, 1], per_pair[:, 2] + pos
    g0, g1, gk0, gk1, lo, hi = geometry(_take(tab, s))
    r0, r1 = it_q * block_q, (it_q + 1) * block_q - 1
    c0, c1 = it_k * block_k, (it_k + 1) * block_k - 1
    rows_inside = (r0 >= g0) & (r1 < g1)
    full = rows_inside & (lo(r1) <= c0) & (hi(r0) >= c1) & (c1 < t)
    inside = rows_inside & (gk0 <= c0) & (c1 < gk1)
    kind = jnp.where(full, FULL, jnp.where(inside, BAND, GENERAL)).astype(jnp.int32)
    own, other = (it_q, it_k) if by == "q" else (it_k, it_q)
    own = jnp.where(ok, own, num_tiles)

    # CSR order: (owned tile, FULL first, other tile), ties in slice order (a stable sort of
    # an enumeration that is already in slice order, as the host breaks them). The three
    # keys fit one int32 below 2**31: a (key, index) sort, which XLA runs as one radix sort
    # on GPUs, instead of a comparison sort of five operands.
    num_other = nk if by == "q" else nq
    notfull = (kind != FULL).astype(jnp.int32)
    if (2 * num_tiles + 2) * num_other < 1 << 31:
        packed = (own * 2 + notfull) * num_other + other
        packed, perm = jax.lax.sort(
            (packed, jnp.arange(cap, dtype=jnp.int32)), num_keys=1, is_stable=True
        )
        kind, s = _take(kind, perm), _take(s, perm)
        own, other = packed // (2 * num_other), packed % num_other
    else:
        own, _, other, kind, s = jax.lax.sort(
            (own, notfull, other, kind, s), num_keys=3, is_stable=True
        )
    geo = _take(tab, s)
    fields = jnp.concatenate([other[:, None], geo[:, 0:4], geo[:, 6:8], kind[:, None]], axis=1)
    items = jnp.where((own < num_tiles)[:, None], fields, empty)
    counts = jnp.zeros((num_tiles + 1,), jnp.int32).at[own].add(1)[:num_tiles]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)])
    # Launch order: heaviest first, ties by tile; one int32 key when it fits.
    if (cap + 1) * num_tiles < 1 << 31:
        order = (
            jax.lax.sort((cap - counts) * num_tiles + jnp.arange(num_tiles, dtype=jnp.int32))
            % num_tiles
        )
    else:
        order = jax.lax.sort(
            (-counts, jnp.arange(num_tiles, dtype=jnp.int32)), num_keys=2, is_stable=True
        )[1]
    return order, offsets, items, needed.astype(jnp.int32)


def noncontiguous_ids(segment_ids):
    """Whether some nonzero id of ``segment_ids`` (int ``[T]`` or ``[B, T]``, may be traced)
    appears in two separate runs of one row, which :meth:`AttnMask.from_segment_ids`
    rejects: ``(bad, id, first, second)`` int32 scalars (``bad`` bool), ``first``/``second``
    the starts of two runs of ``id`` (packed positions) when ``bad``. One sort of ``T``."""
    ids = jnp.asarray(segment_ids)
    row_len = max(ids.shape[-1], 1)
    ids = ids.reshape(-1)
    t = ids.shape[0]
    if t == 0:
        z = jnp.zeros((), jnp.int32)
        return jnp.zeros((), bool), z, z, z
    pos = jnp.arange(t, dtype=jnp.int32)
    change = (pos % row_len == 0) | (ids != jnp.roll(ids, 1))
    live = change & (ids != 0)
    if row_len == 1:  # one-token rows: one run each
        z = jnp.zeros((), jnp.int32)
        return jnp.zeros((), bool), z, z, z
    # Per row, run starts sorted by id (a (key, index) sort along rows: a radix sort on
    # GPUs); positions that start no run carry the largest key and are told apart by `live`.
    rows = t // row_len
    key = jnp.where(live, ids, jnp.iinfo(jnp.int32).max).astype(jnp.int32)
    val, start = jax.lax.sort(
        (key.reshape(rows, row_len), pos.reshape(rows, row_len)), num_keys=1, is_stable=True
    )
    ok = _take(live, start)
    dup = (ok[:, 1:] & ok[:, :-1] & (val[:, 1:] == val[:, :-1])).reshape(-1)
    val, start = val.reshape(-1), start.reshape(-1)
    # Indices into the flat arrays: pair j of row r is (r * row_len + j, ... + 1).
    j = jnp.argmax(dup)
    j = j + j // (row_len - 1)
    return dup.any(), val[j], start[j], start[j + 1]


def segment_items_bound(
    total: int, block_q: int, block_k: int, causal: bool = True, window=None
) -> int:
    """An upper bound of the work items of any ``AttnMask.from_segment_ids`` mask of
    ``total`` tokens (with these ``causal``/``window``) on tiles ``block_q x block_k``:
    the capacity at which :func:`segment_work_lists` can never overflow.

    A q-tile sees keys in a window of ``K = min(NK, (block_q + left + right - 1) // block_k
    + 2)`` k-tiles; the ``m`` documents it holds have disjoint key ranges, so they hit at most
    ``K + m - 1`` (document, k-tile) pairs, each a work item of at most ``c`` of the
    document's slices (``c`` = 1 without a window, up to 3 with one). Summed over q-tiles:
    ``c·(NQ·K + T)``."""
    t = int(total)
    left, right = _resolve_window(window, causal, t)
    nq, nk = -(-t // block_q), -(-t // block_k)
    pieces = 1 + (left < t) + (0 < right < t)
    reach = min(nk, (block_q + left + right - 1) // block_k + 2)
    return max(1, pieces * (nq * reach + t))


def _raise_if_bad(
    fwd_needed, bwd_needed, bad, bad_id, first, second, *, fwd_cap, bwd_cap, total, row_len
):
    """The host check of concrete ids: raises what :func:`_check_traced` reports."""
    from magi_jax.planning.capacity import CapacityError

    if bool(bad):
        row = int(first) // row_len
        raise ValueError(
            _SPLIT_MESSAGE.format(
                id=int(bad_id),
                row=row,
                first=int(first) - row * row_len,
                second=int(second) - row * row_len,
            )
        )
    per_item = bwd_cap // fwd_cap
    need = max(int(fwd_needed), -(-int(bwd_needed) // per_item))
    if need > fwd_cap:
        raise CapacityError(_CAPACITY_MESSAGE.format(need=need, cap=fwd_cap, total=total))


_SPLIT_MESSAGE = (
    "segment id {id} appears in two separate runs of row {row} (positions {first} and "
    "{second}); segment ids must be contiguous runs (packed documents): give every "
    "document its own id"
)
_CAPACITY_MESSAGE = (
    "these segment ids need PlanCapacity.items={need}, but the capacity holds {cap}; pass "
    "capacity=PlanCapacity(total_q={total}, items={need}) or more (capacity=None: a bound "
    "that always fits)"
)


def _check_traced(
    fwd_needed, bwd_needed, bad, bad_id, first, second, *, fwd_cap, bwd_cap, total, row_len
):
    """The check of traced ids: two ``jax.experimental.checkify`` checks with the messages of
    :func:`_raise_if_bad`. Functionalised by ``checkify.checkify``, ``err.throw()`` raises
    them as a ``ValueError`` (``checkify.JaxRuntimeError``); staged without it, JAX refuses
    at trace time and says to use ``checkify``."""
    from jax.experimental import checkify

    row = first // row_len
    checkify.check(
        ~bad,
        _SPLIT_MESSAGE,
        id=bad_id,
        row=row,
        first=first - row * row_len,
        second=second - row * row_len,
    )
    per_item = bwd_cap // fwd_cap
    need = jnp.maximum(fwd_needed, (bwd_needed + per_item - 1) // per_item)
    checkify.check(
        need <= fwd_cap,
        _CAPACITY_MESSAGE.replace("{cap}", str(fwd_cap)).replace("{total}", str(total)),
        need=need,
    )


def unplannable(fwd_needed, bwd_needed, *, fwd_cap: int, bwd_cap: int, contiguity=None):
    """A traced bool: the device lists cannot represent these segment ids — they overflow
    their capacity, or (with ``contiguity``, :func:`noncontiguous_ids`' result) an id sits
    in two runs of a row. No host round trip: :func:`dot_product_attention` turns its output
    into NaN with it."""
    bad = (fwd_needed > fwd_cap) | (bwd_needed > bwd_cap)
    return bad if contiguity is None else bad | contiguity[0]


def _window_of(is_causal: bool, local_window_size):
    """jax.nn's ``local_window_size`` as ``(left, right)`` (``None`` = unbounded)."""
    if local_window_size is None:
        return None, (0 if is_causal else None)
    if isinstance(local_window_size, (int, np.integer)):
        left = right = int(local_window_size)
    else:
        try:
            left, right = (int(w) for w in local_window_size)
        except (TypeError, ValueError):
            raise ValueError(
                f"local_window_size must be an int or a (left, right) pair; got "
                f"{local_window_size!r}"
            ) from None
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size=({left}, {right}) must be >= 0")
    return left, (0 if is_causal else right)


def _segment_plan(
    segment_ids, left, right, name: str, capacity, check_ids: bool = True, raise_now: bool = False
):
    """The :class:`~magi_jax.ffa.plan.AttnPlan` of ``segment_ids [B, T]`` (packed), built on
    the device, and a traced bool that says the plan cannot represent the ids
    (:func:`unplannable`). ``raise_now``: ids the plan cannot represent raise — concrete ids
    on the host, here (a ``ValueError``, or a
    :class:`~magi_jax.planning.capacity.CapacityError`), traced ids through
    ``jax.experimental.checkify`` (:func:`_check_traced`)."""
    from magi_jax.ffa.plan import AttnPlan, PlanStatic
    from magi_jax.planning.capacity import PlanCapacity
    from magi_jax.planning.work_list import backend_blocks

    batch, t = segment_ids.shape
    total = batch * t
    fwd_block, bwd_block = backend_blocks(name, total, total)
    # As plan_attention: every item on fwd_block tiles holds at most fwd_block[0] /
    # bwd_block[0] items of the k-tile list.
    per_item = max(1, fwd_block[0] // bwd_block[0])
    window = (total if left is None else left, total if right is None else right)
    if capacity is None:
        capacity = PlanCapacity(
            total, total, items=segment_items_bound(total, *fwd_block, causal=False, window=window)
        )
    elif isinstance(capacity, (int, np.integer)):
        capacity = PlanCapacity(total, total, items=int(capacity))
    elif not isinstance(capacity, PlanCapacity):
        raise TypeError(
            f"capacity must be None, an int (work items) or a PlanCapacity; got "
            f"{type(capacity).__name__}"
        )
    if (capacity.total_q, capacity.total_k) != (total, total):
        raise ValueError(
            f"capacity is for total_q={capacity.total_q}, total_k="
            f"{capacity.total_k}, but the packed rows hold B·T = {total} "
            "tokens; build it with PlanCapacity(total_q=B*T)"
        )
    build = functools.partial(
        _checked_lists,
        segment_ids,
        min(window[0], total),
        min(window[1], total),
        fwd_block=tuple(fwd_block),
        bwd_block=tuple(bwd_block),
        fwd_cap=capacity.items,
        bwd_cap=per_item * capacity.items,
        check_ids=check_ids or raise_now,
    )
    checks = dict(
        fwd_cap=capacity.items, bwd_cap=per_item * capacity.items, total=total, row_len=max(t, 1)
    )
    if raise_now and not isinstance(segment_ids, jax.core.Tracer):
        # Concrete ids: the lists are built now (constants of an enclosing trace) and the
        # check is a plain host check, at the call.
        with jax.ensure_compile_time_eval():
            lists, bad, diag = build()
        _raise_if_bad(*(np.asarray(x) for x in diag), **checks)
    else:
        lists, bad, diag = build()
        if raise_now:
            _check_traced(*diag, **checks)
    plan = AttnPlan(lists, (), PlanStatic(capacity, name, tuple(fwd_block), tuple(bwd_block)))
    return plan, bad


@functools.partial(
    jax.jit,
    static_argnums=(1, 2),
    static_argnames=("fwd_block", "bwd_block", "fwd_cap", "bwd_cap", "check_ids"),
)
def _checked_lists(segment_ids, left, right, *, fwd_block, bwd_block, fwd_cap, bwd_cap, check_ids):
    """Both lists of ``segment_ids [B, T]``, whether they fail to represent the ids, and what
    the checks report: ``(fwd_needed, bwd_needed, *noncontiguous_ids(...))``; compiled once
    (eager callers do not run the builder op by op; under an outer ``jit`` it is
    inlined)."""
    from magi_jax.planning.work_list import FFAPlanArrays

    t = segment_ids.shape[1]
    build = functools.partial(
        _work_lists, segment_ids.reshape(-1), jnp.int32(left), jnp.int32(right), row_len=max(t, 1)
    )
    *fwd, fwd_needed = build(
        block_q=fwd_block[0], block_k=fwd_block[1], by="q", capacity_items=fwd_cap
    )
    *bwd, bwd_needed = build(
        block_q=bwd_block[0], block_k=bwd_block[1], by="k", capacity_items=bwd_cap
    )
    z = jnp.zeros((), jnp.int32)
    contiguity = noncontiguous_ids(segment_ids) if check_ids else (jnp.zeros((), bool), z, z, z)
    bad = unplannable(
        fwd_needed, bwd_needed, fwd_cap=fwd_cap, bwd_cap=bwd_cap, contiguity=contiguity
    )
    return FFAPlanArrays(*fwd, *bwd), bad, (fwd_needed, bwd_needed, *contiguity)


def dot_product_attention(
    query,
    key,
    value,
    *,
    segment_ids=None,
    is_causal: bool = False,
    local_window_size=None,
    scale: float | None = None,
    softcap: float = 0.0,
    capacity=None,
    backend: str = "auto",
    check_segment_ids: bool = False,
):
    """``jax.nn.dot_product_attention``'s interface on the exact flexible-mask kernels.

    Args:
      query: ``[B, T, N, H]``; key, value: ``[B, S, K, H]`` with ``N % K == 0`` (GQA).
      segment_ids: optional int ``[B, T]`` (may be traced: one compilation serves every
        packing). Each maximal run of one nonzero id in a row is a document that attends
        only to itself; id 0 is padding (attends nothing, attended by nothing). One id must
        not appear in two separate runs of a row (see ``check_segment_ids``). Needs
        ``T == S``.
        The rows are packed into one ``B·T`` sequence and the plan is built on the device
        (:func:`segment_work_lists`). Without ``segment_ids`` every row is one document and
        the plan is built once on the host.
      is_causal: causal as in ``jax.nn``: top-left aligned (query ``i`` sees keys
        ``j <= i``), so with ``T == S`` rows and columns align.
      local_window_size: an int ``w`` or ``(left, right)`` as in ``jax.nn``: query ``i``
        sees keys ``i - left <= j <= i + right`` (and ``j <= i`` if causal); ``w`` means
        ``(w, w)``.
      scale: defaults to ``H ** -0.5``. softcap: tanh soft-capping (0: off).
      capacity: work items the device-built lists hold (an int or a
        :class:`~magi_jax.planning.capacity.PlanCapacity` over ``B·T`` tokens); default
        :func:`segment_items_bound`, which every packing fits. Unused without
        ``segment_ids``.
      backend: ``"auto"``, ``"xla"`` or ``"pallas"``, as
        :func:`magi_jax.flex_flash_attention`.
      check_segment_ids: ids the device plan cannot represent — an id in two separate runs
        of a row, or more work items than ``capacity`` holds — make the whole output NaN
        (never a wrong finite answer). With ``True`` they raise instead, naming the id and
        positions or ``PlanCapacity.items`` and the value needed: concrete ids (NumPy or
        committed arrays, also inside a ``jit`` that closes over them) are checked on the
        host at the call, a ``ValueError`` (``CapacityError`` for the capacity); traced ids
        through ``jax.experimental.checkify``, JAX's way of raising from compiled code:
        ``err, out = checkify.checkify(step)(...)`` then ``err.throw()`` raises a
        ``ValueError`` (``checkify.JaxRuntimeError``) with the message (staged by ``jit``
        without ``checkify``, JAX refuses at trace time and says so). The traced check costs
        a few reductions and a flag the caller reads.

    Returns the output ``[B, T, N, H]`` in ``query``'s dtype. Rows that see no key (padding
    tokens, id 0) give 0 — ``jax.nn`` may return something else for fully masked rows.
    """
    from magi_jax.ffa.api import flex_flash_attention, select_backend

    q, k, v = query, key, value
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"query, key and value must be [B, T, N, H] / [B, S, K, H]; got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"shapes do not match: query {q.shape}, key {k.shape}, value "
            f"{v.shape} (want [B, T, N, H], [B, S, K, H], [B, S, K, H])"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"N={q.shape[2]} query heads are not a multiple of K={k.shape[2]} key/value heads"
        )
    batch, tq, _, h = q.shape
    tk = k.shape[1]
    from magi_jax.ffa.api import _finite

    if scale is not None and _finite(scale) is None:
        raise ValueError(f"scale={scale!r} must be a finite number (or None for H ** -0.5)")
    scale = h**-0.5 if scale is None else float(scale)
    left, right = _window_of(is_causal, local_window_size)
    name, _ = select_backend(backend, q, k, v)
    if segment_ids is None:
        from magi_jax.mask import AttnMask, shape_to_slices

        mask = AttnMask._from_list(
            shape_to_slices(0, tq, 0, tk, None if left is None else -left, right), tq, tk
        )
        return flex_flash_attention(
            q, k, v, mask, softmax_scale=scale, softcap=softcap, backend=name
        )[0]
    if tq != tk:
        raise ValueError(
            f"segment_ids need self-attention over packed rows (T == S); got "
            f"T={tq}, S={tk}: for other masks build an AttnMask and call "
            "magi_jax.flex_flash_attention"
        )
    # Concrete ids stay NumPy, so that they can be checked on the host (inside a trace
    # jnp.asarray would stage them).
    segment_ids = (
        segment_ids if isinstance(segment_ids, jax.core.Tracer) else np.asarray(segment_ids)
    )
    if segment_ids.shape != (batch, tq):
        raise ValueError(
            f"segment_ids must be [B, T] = {(batch, tq)}; got shape {segment_ids.shape}"
        )
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integers; got dtype {segment_ids.dtype}")
    plan, bad = _segment_plan(
        segment_ids, left, right, name, capacity, raise_now=bool(check_segment_ids)
    )
    out = flex_flash_attention(
        pack_rows(q), pack_rows(k), pack_rows(v), plan, softmax_scale=scale, softcap=softcap
    )[0]
    out = jnp.where(jax.lax.stop_gradient(bad), jnp.asarray(jnp.nan, out.dtype), out)
    return unpack_rows(out, batch)
