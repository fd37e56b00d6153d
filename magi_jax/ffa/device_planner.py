"""Masks from segment ids and sequence lengths, with the plan built on the device.

:func:`segment_work_lists` builds, in ``jax.numpy`` under ``jit`` from *traced* segment ids,
exactly the work list that the host builds for
``AttnMask.from_segment_ids(ids, causal, window)``
(:func:`magi_jax.planning.work_list.build_work_list`), padded to a fixed capacity: one
compilation serves every packing of a length. :func:`device_plan` builds the plan of packed
rows from segment ids and/or per-row query and key lengths (``jax.nn``'s
``query_seq_lengths`` / ``key_value_seq_lengths``) the same way; it serves
:func:`magi_jax.ffa.dpa.dot_product_attention`.

How the list is built (memory ``O(T + W_cap)``, nothing of size ``T x T``):

1. runs of one id from the id changes (``jnp.nonzero(size=T)``); a run of a positive id
   is a document (ids 0 and below are padding, as on the host);
2. every document is cut into the (at most three) typed slices of
   :func:`magi_jax.masks.shape_to_slices` (CAUSAL top, BI_CAUSAL or FULL middle, INV_CAUSAL
   bottom) and put in the canonical form of :class:`magi_jax.masks.SliceShapes`;
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
from typing import TYPE_CHECKING, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.ffa.ragged import ragged_enumerate, take_in_bounds
from magi_jax.masks import window_bounds
from magi_jax.planning.tiling import EMPTY_ITEM
from magi_jax.planning.work_list import BAND, FULL, GENERAL

if TYPE_CHECKING:  # annotations only (device_plan imports them when called)
    from magi_jax.ffa.plan import AttnPlan
    from magi_jax.planning.capacity import PlanCapacity

# A NumPy or a JAX array (pack_rows / unpack_rows give back what they take).
ArrayT = TypeVar("ArrayT", np.ndarray, jax.Array)

__all__ = [
    "device_plan",
    "length_items_bound",
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


def pack_rows(x: ArrayT) -> ArrayT:
    """``[B, T, ...] -> [B·T, ...]``: the rows of a batch packed into one sequence, row ``b``
    at ``[b·T, (b+1)·T)`` (a plain reshape; NumPy or JAX arrays)."""
    return x.reshape((x.shape[0] * x.shape[1],) + tuple(x.shape[2:]))


def unpack_rows(x: ArrayT, batch: int) -> ArrayT:
    """The inverse of :func:`pack_rows`: ``[B·T, ...] -> [B, T, ...]`` with ``B = batch``."""
    if x.shape[0] % batch:
        raise ValueError(f"unpack_rows: {x.shape[0]} tokens do not split into {batch} rows")
    return x.reshape((batch, x.shape[0] // batch) + tuple(x.shape[1:]))


def _pieces(q0, q1, k0, k1, dlo, dhi, live):
    """The typed pieces of shapes ``{q in [q0, q1), k in [k0, k1), dlo <= k - q <= dhi}``
    (int32 ``[n]`` each; a bound too wide to cut stands for a missing one), exactly
    :func:`magi_jax.masks.shape_to_slices` on each: three pieces per shape, CAUSAL top,
    BI_CAUSAL or FULL middle, INV_CAUSAL bottom, as ``(qs, qe, ks, ke, type, live)``
    ``[3n]`` (``live`` false for an empty piece)."""
    # Only rows with at least one cell.
    q0 = jnp.maximum(q0, k0 - dhi)
    q1 = jnp.minimum(q1, k1 - dlo)
    live = live & (q1 > q0) & (k1 > k0) & (dhi >= dlo)
    # Rows >= t have a diagonal lower edge, rows >= u a clamped upper one.
    t = jnp.minimum(jnp.maximum(k0 - dlo, q0), q1)
    u = jnp.minimum(jnp.maximum(k1 - dhi, q0), q1)
    band = t <= u
    a, b = jnp.where(band, t, u), jnp.where(band, u, t)  # the middle piece's rows
    top = (q0, a, k0, a + dhi, jnp.full_like(q0, _T_CAUSAL))
    mid = (
        a,
        b,
        jnp.where(band, a + dlo, k0),
        jnp.where(band, b + dhi, k1),
        jnp.where(band, _T_BI, _T_FULL),
    )
    bot = (b, q1, b + dlo, k1, jnp.full_like(q0, _T_INV))
    qs, qe, ks, ke, ty = (jnp.stack(p, axis=1).reshape(-1) for p in zip(top, mid, bot))
    return qs, qe, ks, ke, ty, jnp.repeat(live, 3) & (qe > qs)


def _canonical(qs, qe, ks, ke, ty, live, big: int):
    """Pieces in the form of :class:`magi_jax.masks.SliceShapes`: int32 ``[n, 8]`` rows
    ``(q0, q1, k0, k1, dlo, dhi, dlo_field, dhi_field)`` (``q0 == q1 == 0`` for an empty
    piece). ``dlo``/``dhi`` are the diagonal bounds with a missing one replaced by
    ``-/+big`` (so ``lo``/``hi`` need no special case and nothing overflows); ``*_field``
    are the item fields (a missing bound is ``-/+(2**31 - 1)``, like the host's clipped
    sentinels)."""
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
            jnp.where(has_lo, dlo, -big),
            jnp.where(has_hi, dhi, big),
            jnp.where(has_lo, dlo, -_I32_MAX),
            jnp.where(has_hi, dhi, _I32_MAX),
        ],
        axis=1,
    )


def _slices(ids, left, right, row_len, q_lengths=None, kv_lengths=None):
    """The canonical slices (:func:`_canonical`, ``[3T, 8]``) of the documents of ``ids``
    (int32 ``[T]``): every run of one positive id is a document ``[s, e)`` seeing itself
    through the window ``(left, right)`` (int32 scalars, may be traced, finite: an unbounded
    side is ``T``, which no document exceeds, so the pieces come out as the host's). Runs
    also break every ``row_len`` tokens (packed rows). ``q_lengths``/``kv_lengths`` (int32
    ``[B]``, optional): row ``b``'s queries past its first ``q_lengths[b]`` see nothing,
    its keys past ``kv_lengths[b]`` are seen by nothing."""
    t = ids.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    change = (pos % row_len == 0) | (ids != jnp.roll(ids, 1))
    s = jnp.nonzero(change, size=t, fill_value=t)[0].astype(jnp.int32)
    e = jnp.concatenate([s[1:], jnp.full((1,), t, jnp.int32)])
    live = (s < t) & (take_in_bounds(ids, jnp.minimum(s, t - 1)) > 0)  # ids <= 0: padding
    qe = ke = e
    row = jnp.minimum(s, t - 1) // row_len
    if q_lengths is not None:
        qe = jnp.minimum(e, row * row_len + take_in_bounds(q_lengths, row))
    if kv_lengths is not None:
        ke = jnp.minimum(e, row * row_len + take_in_bounds(kv_lengths, row))
    return _canonical(*_pieces(s, qe, s, ke, -left, right, live), big=2 * t)


def _length_slices(q_lengths, kv_lengths, tq: int, tk: int, left, right):
    """The canonical slices (``[3B, 8]``) of ``B`` packed rows of ``tq`` queries and ``tk``
    keys, row ``b`` at queries ``[b·tq, b·tq + q_lengths[b])`` and keys ``[b·tk, b·tk +
    kv_lengths[b])`` (lengths clipped to ``[0, tq]`` / ``[0, tk]``), query ``i`` of a row
    seeing its keys ``j`` with ``-left <= j - i <= right`` (``jax.nn``'s top-left
    alignment; ``left``/``right`` int32 scalars, ``tq + tk`` or more for no bound)."""
    rows = q_lengths.shape[0]
    b = jnp.arange(rows, dtype=jnp.int32)
    q0, k0 = b * tq, b * tk
    q1 = q0 + jnp.clip(q_lengths.astype(jnp.int32), 0, tq)
    k1 = k0 + jnp.clip(kv_lengths.astype(jnp.int32), 0, tk)
    off = k0 - q0  # row b's diagonal k - q in packed positions is j - i + off
    live = jnp.ones((rows,), bool)
    big = 2 * rows * (tq + tk)
    return _canonical(*_pieces(q0, q1, k0, k1, off - left, off + right, live), big=big)


def _resolve_window(window, causal: bool, total: int) -> tuple[int, int]:
    """``(left, right)`` of :meth:`AttnMask.varlen`'s ``window``/``causal`` with an
    unbounded side as ``total`` (no document is longer)."""
    left, right = window_bounds(window, causal)
    return (
        total if left is None else min(int(left), total),
        total if right is None else min(int(right), total),
    )


def segment_work_lists(
    segment_ids: jax.Array,
    *,
    causal: bool = True,
    window: int | tuple[int, int] | None = None,
    block_q: int,
    block_k: int,
    by: str,
    capacity_items: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The work list of ``AttnMask.from_segment_ids(segment_ids, causal, window)`` for tiles
    ``block_q x block_k`` owned by q-tiles (``by="q"``) or k-tiles (``by="k"``), built with
    ``jax.numpy``: traceable under ``jit`` with ``segment_ids`` a traced int ``[T]`` (or
    ``[B, T]``: rows packed into one sequence of ``B·T`` tokens, documents never crossing
    rows, as :meth:`~magi_jax.masks.AttnMask.from_segment_ids` does); shapes are static.

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
    ids,
    left,
    right,
    *,
    row_len: int,
    block_q: int,
    block_k: int,
    by: str,
    capacity_items: int,
    q_lengths=None,
    kv_lengths=None,
):
    """:func:`segment_work_lists` on packed ids ``[T]`` with the window ``(left, right)`` as
    int32 scalars in ``[0, T]`` (``T`` = unbounded; they may be traced); ``q_lengths`` /
    ``kv_lengths``: optional per-row lengths (:func:`_slices`)."""
    t = ids.shape[0]
    tab = _slices(ids, left, right, row_len, q_lengths, kv_lengths) if t else None
    return _table_work_lists(
        tab, t, t, block_q=block_q, block_k=block_k, by=by, capacity_items=capacity_items
    )


def _table_work_lists(
    tab, tq: int, tk: int, *, block_q: int, block_k: int, by: str, capacity_items: int
):
    """The work list of the canonical slices ``tab`` (:func:`_canonical`; slices hold
    disjoint rows) over ``tq`` queries and ``tk`` keys: ``(order, offsets, items, needed)``
    as :func:`segment_work_lists` returns them."""
    if by not in ("q", "k"):
        raise ValueError(f"by={by!r}: use 'q' or 'k'")
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q={block_q} and block_k={block_k} must be positive")
    if max(tq, tk) >= 1 << 29:
        raise ValueError(
            f"Tq={tq}, Tk={tk} tokens: the device builder computes in int32 and takes T < 2**29"
        )
    cap = int(capacity_items)
    if cap < 0:
        raise ValueError(f"capacity_items={cap} must be >= 0")
    nq, nk = -(-tq // block_q), -(-tk // block_k)
    num_tiles = nq if by == "q" else nk
    empty = jnp.asarray(EMPTY_ITEM, jnp.int32)
    if tq == 0 or tk == 0:
        return (
            jnp.arange(num_tiles, dtype=jnp.int32),
            jnp.zeros((num_tiles + 1,), jnp.int32),
            jnp.broadcast_to(empty, (cap, 8)),
            jnp.zeros((), jnp.int32),
        )
    q0, q1 = tab[:, 0], tab[:, 1]

    def geometry(rows):
        """Columns of slice rows: q0, q1, k0, k1 and the row interval functions."""
        g0, g1, gk0, gk1, gdlo, gdhi = (rows[:, i] for i in range(6))
        lo = lambda r: jnp.maximum(gk0, r + gdlo)  # first key of row r
        hi = lambda r: jnp.minimum(gk1 - 1, r + gdhi)  # last key of row r
        return g0, g1, gk0, gk1, lo, hi

    # (slice, q-tile) pairs; slices hold disjoint rows, so at most Tq + NQ of them.
    qt_first = q0 // block_q
    n_pairs = jnp.where(q1 > q0, (q1 - 1) // block_q - qt_first + 1, 0)
    sl, pos, total_pairs = ragged_enumerate(n_pairs, tq + nq)
    p0, p1, _, _, lo, hi = geometry(take_in_bounds(tab, sl))
    qt = take_in_bounds(qt_first, sl) + pos
    kt_first = lo(jnp.maximum(p0, qt * block_q)) // block_k
    kt_last = hi(jnp.minimum(p1, (qt + 1) * block_q) - 1) // block_k
    pair_ok = jnp.arange(tq + nq) < total_pairs
    n_items = jnp.where(pair_ok, kt_last - kt_first + 1, 0)

    # Items (pair, k-tile), enumerated slice by slice, q-tile by q-tile, k-tile by k-tile.
    pair, pos, needed = ragged_enumerate(n_items, cap)
    ok = jnp.arange(cap) < needed
    per_pair = take_in_bounds(jnp.stack([sl, qt, kt_first], axis=1), pair)
    s, it_q, it_k = per_pair[:, 0], per_pair[:, 1], per_pair[:, 2] + pos
    g0, g1, gk0, gk1, lo, hi = geometry(take_in_bounds(tab, s))
    r0, r1 = it_q * block_q, (it_q + 1) * block_q - 1
    c0, c1 = it_k * block_k, (it_k + 1) * block_k - 1
    rows_inside = (r0 >= g0) & (r1 < g1)
    full = rows_inside & (lo(r1) <= c0) & (hi(r0) >= c1) & (c1 < tk)
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
        kind, s = take_in_bounds(kind, perm), take_in_bounds(s, perm)
        own, other = packed // (2 * num_other), packed % num_other
    else:
        own, _, other, kind, s = jax.lax.sort(
            (own, notfull, other, kind, s), num_keys=3, is_stable=True
        )
    geo = take_in_bounds(tab, s)
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


def noncontiguous_ids(
    segment_ids: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Whether some positive id of ``segment_ids`` (int ``[T]`` or ``[B, T]``, may be traced)
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
    live = change & (ids > 0)  # ids <= 0 are padding, never a document
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
    ok = take_in_bounds(live, start)
    dup = (ok[:, 1:] & ok[:, :-1] & (val[:, 1:] == val[:, :-1])).reshape(-1)
    val, start = val.reshape(-1), start.reshape(-1)
    # Indices into the flat arrays: pair j of row r is (r * row_len + j, ... + 1).
    j = jnp.argmax(dup)
    j = j + j // (row_len - 1)
    return dup.any(), val[j], start[j], start[j + 1]


def segment_items_bound(
    total: int,
    block_q: int,
    block_k: int,
    causal: bool = True,
    window: int | tuple[int, int] | None = None,
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
    "these inputs need PlanCapacity.items={need}, but the capacity holds {cap}; pass "
    "capacity=PlanCapacity({total}, items={need}) or more (capacity=None: a bound that "
    "always fits)"
)


def _check_traced(
    fwd_needed, bwd_needed, bad, bad_id, first, second, *, fwd_cap, bwd_cap, total, row_len
):
    """The check of traced ids: two ``jax.experimental.checkify`` checks with the messages of
    :func:`_raise_if_bad`. Functionalised by ``checkify.checkify``, ``err.throw()`` raises
    them as a ``ValueError`` (``checkify.JaxRuntimeError``); staged without it, JAX refuses
    when it compiles the step and says to use ``checkify``."""
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


def unplannable(
    fwd_needed: jax.Array,
    bwd_needed: jax.Array,
    *,
    fwd_cap: int,
    bwd_cap: int,
    contiguity: tuple[jax.Array, ...] | None = None,
) -> jax.Array:
    """A traced bool: the device lists cannot represent these segment ids — they overflow
    their capacity, or (with ``contiguity``, :func:`noncontiguous_ids`' result) an id sits
    in two runs of a row. No host round trip: :func:`dot_product_attention` turns its output
    into NaN with it. ``fwd_needed``, ``bwd_needed``: int32 scalars (the lists' true item
    counts); returns a bool scalar."""
    bad = (fwd_needed > fwd_cap) | (bwd_needed > bwd_cap)
    return bad if contiguity is None else bad | contiguity[0]


def length_items_bound(
    batch: int,
    tq: int,
    tk: int,
    block_q: int,
    block_k: int,
    window: tuple[int | None, int | None] = (None, None),
) -> int:
    """An upper bound of the work items of ``batch`` packed rows of ``tq`` queries and ``tk``
    keys under any per-row lengths (:func:`_length_slices`) with ``window = (left, right)``
    (``None``: unbounded), on tiles ``block_q x block_k``. Each row gives at most three
    pieces, disjoint in rows, so at most ``NQ + 3·batch`` (piece, q-tile) pairs; each pair
    reaches at most ``min(NK, ceil(tk / block_k) + 1, (block_q + left + right - 1) //
    block_k + 2)`` k-tiles."""
    nq, nk = -(-batch * tq // block_q), -(-batch * tk // block_k)
    left, right = (tq + tk if w is None else min(int(w), tq + tk) for w in window)
    reach = min(nk, -(-tk // block_k) + 1, (block_q + left + right - 1) // block_k + 2)
    return max(1, (nq + 3 * batch) * reach)


def device_plan(
    segment_ids: jax.Array | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    *,
    shape: tuple[int, int, int],
    window: tuple[int | None, int | None] = (None, None),
    backend: str,
    capacity: int | PlanCapacity | None = None,
    check_ids: bool = True,
    raise_now: bool = False,
) -> tuple[AttnPlan, jax.Array]:
    """The :class:`~magi_jax.ffa.plan.AttnPlan` of ``B`` packed rows, built on the device, and
    a traced bool that says the plan cannot represent the inputs (:func:`unplannable`).

    ``shape = (B, T, S)``: row ``b`` holds queries ``[b·T, (b+1)·T)`` and keys ``[b·S,
    (b+1)·S)`` of the packed sequences. ``segment_ids`` (int ``[B, T]``, needs ``T == S``):
    documents as in :func:`segment_work_lists`; ``q_lengths`` / ``kv_lengths`` (int ``[B]``):
    only a row's first ``q_lengths[b]`` queries and ``kv_lengths[b]`` keys take part (with
    ``segment_ids`` too: documents cut there). ``window = (left, right)``: query ``i`` of a
    row sees keys ``j`` with ``-left <= j - i <= right`` (``None``: unbounded). All may be
    traced; the plan's shapes depend on ``shape``, the window, ``backend`` and
    ``capacity`` alone. ``capacity``: work items (an int or a
    :class:`~magi_jax.planning.capacity.PlanCapacity` over ``B·T x B·S``), default a bound
    every input fits (:func:`segment_items_bound`, :func:`length_items_bound`).
    ``raise_now``: inputs the plan cannot represent raise — concrete ones on the host, here
    (a ``ValueError``, or a :class:`~magi_jax.planning.capacity.CapacityError`), traced ones
    through ``jax.experimental.checkify`` (:func:`_check_traced`)."""
    from magi_jax.ffa.plan import AttnPlan, PlanStatic
    from magi_jax.planning.capacity import PlanCapacity
    from magi_jax.planning.work_list import backend_blocks

    batch, t, s = shape
    total_q, total_k = batch * t, batch * s
    fwd_block, bwd_block = backend_blocks(backend, total_q, total_k)
    if segment_ids is not None:
        if t != s:
            raise ValueError(f"segment ids need T == S; got T={t}, S={s}")
        unbounded = total_q
    else:
        unbounded = total_q + total_k
    left, right = (unbounded if w is None else min(int(w), unbounded) for w in window)
    if capacity is None:
        if segment_ids is not None:
            items = segment_items_bound(total_q, *fwd_block, causal=False, window=(left, right))
        else:
            items = length_items_bound(batch, t, s, *fwd_block, window=window)
        capacity = PlanCapacity(total_q, total_k, items=items)
    elif isinstance(capacity, (int, np.integer)):
        capacity = PlanCapacity(total_q, total_k, items=int(capacity))
    elif not isinstance(capacity, PlanCapacity):
        raise TypeError(
            f"capacity must be None, an int (work items) or a PlanCapacity; got "
            f"{type(capacity).__name__}"
        )
    if (capacity.total_q, capacity.total_k) != (total_q, total_k):
        raise ValueError(
            f"capacity is for total_q={capacity.total_q}, total_k={capacity.total_k}, but the "
            f"packed rows hold B·T = {total_q} queries and B·S = {total_k} keys; build it "
            f"with PlanCapacity(total_q={total_q}, total_k={total_k}, items=...)"
        )
    (fwd_cap, bwd_cap), _ = capacity.list_sizes(fwd_block, bwd_block)  # as plan_attention
    lengths = None
    if q_lengths is not None or kv_lengths is not None:
        full = lambda n: np.full((batch,), n, np.int32)
        lengths = (
            full(t) if q_lengths is None else q_lengths,
            full(s) if kv_lengths is None else kv_lengths,
        )
    build = functools.partial(
        _checked_lists,
        segment_ids,
        left,
        right,
        fwd_block=tuple(fwd_block),
        bwd_block=tuple(bwd_block),
        fwd_cap=fwd_cap,
        bwd_cap=bwd_cap,
        check_ids=check_ids or raise_now,
        lengths=lengths,
        dims=(batch, t, s),
    )
    checks = dict(
        fwd_cap=fwd_cap,
        bwd_cap=bwd_cap,
        total=f"total_q={total_q}" + ("" if total_k == total_q else f", total_k={total_k}"),
        row_len=max(t, 1),
    )
    concrete = not any(isinstance(x, jax.core.Tracer) for x in (segment_ids, q_lengths, kv_lengths))
    if raise_now and concrete:
        # Concrete inputs: the lists are built now (constants of an enclosing trace) and the
        # check is a plain host check, at the call.
        with jax.ensure_compile_time_eval():
            lists, bad, diag = build()
        _raise_if_bad(*(np.asarray(x) for x in diag), **checks)
    else:
        lists, bad, diag = build()
        if raise_now:
            _check_traced(*diag, **checks)
    plan = AttnPlan(lists, (), PlanStatic(capacity, backend, tuple(fwd_block), tuple(bwd_block)))
    return plan, bad


@functools.partial(
    jax.jit,
    static_argnums=(1, 2),
    static_argnames=("fwd_block", "bwd_block", "fwd_cap", "bwd_cap", "check_ids", "dims"),
)
def _checked_lists(
    segment_ids,
    left,
    right,
    *,
    fwd_block,
    bwd_block,
    fwd_cap,
    bwd_cap,
    check_ids,
    lengths=None,
    dims=None,
):
    """Both lists of ``segment_ids [B, T]`` (or, without ids, of the rows ``dims = (B, T,
    S)``) cut by ``lengths = (q_lengths, kv_lengths)``, whether they fail to represent the
    inputs, and what the checks report: ``(fwd_needed, bwd_needed, *noncontiguous_ids(...))``;
    compiled once (eager callers do not run the builder op by op; under an outer ``jit`` it
    is inlined)."""
    from magi_jax.planning.work_list import FFAPlanArrays

    ql, kl = (None, None) if lengths is None else lengths
    if segment_ids is not None:
        t = segment_ids.shape[1]
        build = functools.partial(
            _work_lists,
            segment_ids.reshape(-1),
            jnp.int32(left),
            jnp.int32(right),
            row_len=max(t, 1),
            q_lengths=ql,
            kv_lengths=kl,
        )
    else:
        b, t, s = dims
        tab = _length_slices(ql, kl, t, s, jnp.int32(left), jnp.int32(right))
        build = functools.partial(_table_work_lists, tab, b * t, b * s)
    *fwd, fwd_needed = build(
        block_q=fwd_block[0], block_k=fwd_block[1], by="q", capacity_items=fwd_cap
    )
    *bwd, bwd_needed = build(
        block_q=bwd_block[0], block_k=bwd_block[1], by="k", capacity_items=bwd_cap
    )
    z = jnp.zeros((), jnp.int32)
    check = check_ids and segment_ids is not None
    contiguity = noncontiguous_ids(segment_ids) if check else (jnp.zeros((), bool), z, z, z)
    bad = unplannable(
        fwd_needed, bwd_needed, fwd_cap=fwd_cap, bwd_cap=bwd_cap, contiguity=contiguity
    )
    return FFAPlanArrays(*fwd, *bwd), bad, (fwd_needed, bwd_needed, *contiguity)
