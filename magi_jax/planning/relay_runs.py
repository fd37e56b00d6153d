"""Two-hop cast tables planned by runs (host NumPy, no JAX): the tables of
:func:`~magi_jax.planning.relay_table.build_relay_table`, entry for entry, built from the runs
of the flat cast rather than from its rows.

A flat cast moves runs of consecutive rows (a piece of a chunk from its owner into a stretch
of a receiver's buffer), and every step of the two-hop planner keeps runs whole or cuts them
at a few points: where the set of ranks of a node that need a row changes, where a run is
split among its relays, where blocks meet slot boundaries. Working on runs makes planning
cost grow with the runs of the masks (thousands) instead of the rows moved (tens of millions
at 1M tokens over 8 × 8 ranks), and the result comes as runs, the form the key ships
(:class:`~magi_jax.sharding.transport.RelayRuns`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from magi_jax.planning.cast_table import CastTable, expand_index_runs, pack_runs
from magi_jax.planning.intervals import ranges_repeat
from magi_jax.planning.relay_table import (
    NodeLayout,
    RelayTable,
    check_layout,
    relay_width_error,
    slot_code,
    slot_key,
)

__all__ = ["RelayRunsTable", "build_relay_runs", "move_runs", "relay_run_bounds", "pad_runs"]


@dataclasses.dataclass(frozen=True)
class RelayRunsTable:
    """Two-hop tables as runs, stacked over ranks: ``inter_runs`` int32 ``[cp, R1, 2]``,
    ``intra_runs`` int32 ``[cp, R2, 2]``, ``recv_runs`` int32 ``[cp, Rr, 2]`` (rows ``(first
    value, length)``, :func:`~magi_jax.planning.cast_table.expand_index_runs`), expanding to the
    ``inter_send [cp, n_inter, S1]``, ``intra_send [cp, n_intra, S2]`` and ``recv_index [cp,
    B]`` of :class:`~magi_jax.planning.relay_table.RelayTable` (:meth:`dense`)."""

    layout: NodeLayout
    inter_runs: np.ndarray
    intra_runs: np.ndarray
    recv_runs: np.ndarray
    inter_shifts: tuple[tuple[int, int], ...]
    inter_widths: tuple[int, ...]
    intra_shifts: tuple[int, ...]
    intra_widths: tuple[int, ...]
    inter_slot_len: int
    intra_slot_len: int
    buffer_len: int

    @property
    def cp(self) -> int:
        return self.layout.cp

    def _rows(self, runs) -> np.ndarray:
        real = (runs[..., 0] >= 0) & (runs[..., 1] > 0)
        return np.where(real, runs[..., 1], 0).sum(axis=1, dtype=np.int64)

    def inter_rows(self) -> np.ndarray:
        """int64 ``[cp]``: real rows each rank sends across the node boundary."""
        return self._rows(self.inter_runs)

    def intra_rows(self) -> np.ndarray:
        """int64 ``[cp]``: real rows each rank sends inside its node."""
        return self._rows(self.intra_runs)

    def inter_node_rows(self) -> int:
        return int(self.inter_rows().sum())

    def inter_node_wire_rows(self) -> int:
        """Rows a ``ppermute`` per slot sends across node boundaries, padding included."""
        return int(sum(self.inter_widths)) * self.cp

    def slot_live(self) -> tuple[np.ndarray, np.ndarray]:
        """``(inter, intra)`` int64 ``[n_slots]``: the most real rows any rank sends in each
        slot of each hop (what a gated slot moves, before rounding to pieces)."""
        return (
            _slot_fill(self.inter_runs, len(self.inter_shifts), self.inter_slot_len).max(
                axis=0, initial=0
            ),
            _slot_fill(self.intra_runs, len(self.intra_shifts), self.intra_slot_len).max(
                axis=0, initial=0
            ),
        )

    def dense(self) -> RelayTable:
        """The same tables expanded (:class:`~magi_jax.planning.relay_table.RelayTable`)."""
        n1, s1 = len(self.inter_shifts), self.inter_slot_len
        n2, s2 = len(self.intra_shifts), self.intra_slot_len
        cp = self.cp
        return RelayTable(
            layout=self.layout,
            inter_send=expand_index_runs(self.inter_runs, n1 * s1).reshape(cp, n1, s1),
            intra_send=expand_index_runs(self.intra_runs, n2 * s2).reshape(cp, n2, s2),
            recv_index=expand_index_runs(self.recv_runs, self.buffer_len),
            inter_shifts=self.inter_shifts,
            inter_widths=self.inter_widths,
            intra_shifts=self.intra_shifts,
            intra_widths=self.intra_widths,
        )


def _slot_fill(runs: np.ndarray, n_slots: int, slot_len: int) -> np.ndarray:
    """int64 ``[cp, n_slots]``: real entries per rank and slot of a send table's runs (runs
    never cross a slot boundary)."""
    cp = runs.shape[0]
    out = np.zeros((cp, max(n_slots, 1)), np.int64)
    if not n_slots:
        return out[:, :0]
    length = runs[..., 1].astype(np.int64)
    start = np.cumsum(length, axis=1) - length
    real = (runs[..., 0] >= 0) & (length > 0)
    rank = np.broadcast_to(np.arange(cp)[:, None], length.shape)
    slot = np.minimum(start // max(slot_len, 1), n_slots - 1)
    np.add.at(out, (rank[real], slot[real]), length[real])
    return out


def _runs_of(runs: np.ndarray):
    """Real runs of a stacked run table: ``(rank, first entry, value, length)`` int64."""
    length = runs[..., 1].astype(np.int64)
    start = np.cumsum(length, axis=1) - length
    rank, i = np.nonzero((runs[..., 0] >= 0) & (length > 0))
    return rank, start[rank, i], runs[rank, i, 0].astype(np.int64), length[rank, i]


def move_runs(
    table: CastTable,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every real move of a flat cast as runs, int64 arrays ``(dst, dst_row, src, src_row,
    length)``: rank ``dst``'s buffer rows ``[dst_row, dst_row + length)`` are rank ``src``'s
    local rows ``[src_row, src_row + length)``; :func:`~magi_jax.planning.cast_table.
    cast_moves` row by row, without expanding a table."""
    cp, n, s = table.cp, table.n_slots, table.slot_len
    span = max(n * s, 1)
    s_rank, s_entry, s_row, s_len = _runs_of(table.send_runs)
    key0 = s_rank * span + s_entry  # sorted: ranks in order, entries increasing
    key1 = key0 + s_len
    d_rank, d_row, r_entry, r_len = _runs_of(table.recv_runs)
    shifts = np.asarray(table.shifts, np.int64)
    src = (d_rank - shifts[np.minimum(r_entry // max(s, 1), max(n - 1, 0))]) % cp
    g0 = src * span + r_entry
    lo = np.searchsorted(key1, g0, side="right")
    hi = np.searchsorted(key0, g0 + r_len, side="left")
    which, k = ranges_repeat(lo, hi)
    a = np.maximum(g0[which], key0[k])
    b = np.minimum(g0[which] + r_len[which], key1[k])
    keep = b > a
    which, k, a, b = which[keep], k[keep], a[keep], b[keep]
    return (
        d_rank[which],
        d_row[which] + (a - g0[which]),
        src[which],
        s_row[k] + (a - key0[k]),
        b - a,
    )


def _need_runs(group, x0, x1, bit, local: int):
    """Maximal stretches of rows of one ``group`` (sorted by group) needed by the same set of
    a node's ranks: the flat moves ``[x0, x1)`` of ``group`` needed by local rank ``bit``,
    cut where the set changes. Returns ``(group, start, end, need bitmask)``, sorted by
    (group, start)."""
    span = int(max(x1.max(initial=0), 1)) + 1
    pts = np.unique(np.concatenate([group * span + x0, group * span + x1]))
    if not len(pts):
        z = np.zeros(0, np.int64)
        return z, z, z, z
    i0 = np.searchsorted(pts, group * span + x0)
    i1 = np.searchsorted(pts, group * span + x1)
    need = np.zeros(len(pts), np.int64)
    for b in range(local):
        sel = bit == b
        if not sel.any():
            continue
        diff = np.zeros(len(pts) + 1, np.int64)
        np.add.at(diff, i0[sel], 1)
        np.add.at(diff, i1[sel], -1)
        need |= (np.cumsum(diff)[:-1] > 0).astype(np.int64) << b
    # Elementary interval j: [pts[j], pts[j + 1]) within one group.
    e_group = pts[:-1] // span
    same = e_group == pts[1:] // span
    e_need = need[:-1]
    ok = same & (e_need != 0)
    start, end = pts[:-1][ok] - e_group[ok] * span, pts[1:][ok] - e_group[ok] * span
    grp, nd = e_group[ok], e_need[ok]
    if not len(start):
        z = np.zeros(0, np.int64)
        return z, z, z, z
    new = np.ones(len(start), bool)
    new[1:] = (grp[1:] != grp[:-1]) | (start[1:] != end[:-1]) | (nd[1:] != nd[:-1])
    first = np.nonzero(new)[0]
    last = np.append(first[1:], len(start)) - 1
    return grp[first], start[first], end[last], nd[first]


def _split_to_relays(start, end, need, local: int):
    """Each run split into ``m`` (its needing ranks) equal parts, part ``i`` of run ``r`` to
    the ``(i + r) % m``-th needing rank, as :func:`~magi_jax.planning.relay_table._relay_local`
    does row by row: ``(run, part start, part end, relay local index)``."""
    bits = (need[:, None] >> np.arange(local)[None, :]) & 1  # [runs, local]
    m = bits.sum(axis=1)
    run, i = ranges_repeat(np.zeros(len(m), np.int64), m)
    length = (end - start)[run]
    mm = m[run]
    p0 = start[run] + (i * length + mm - 1) // mm
    p1 = start[run] + ((i + 1) * length + mm - 1) // mm
    pick = (i + run) % mm
    relay = np.argmax(np.cumsum(bits[run], axis=1) > pick[:, None], axis=1).astype(np.int64)
    keep = p1 > p0
    return run[keep], p0[keep], p1[keep], relay[keep]


class _RunBlocks:
    """One hop's send runs from distinct move runs ``(src, dst, row, length)``: a block per
    (src, dst) pair in the slot ``slot_of(src, dst)``, rows in order; ``entry``: each run's
    first position among the receiver's blocks packed at the slots' widths (as
    :class:`~magi_jax.planning.relay_table._Blocks`, by runs)."""

    def __init__(self, src, dst, row, length, slot_of, layout, width, all_slots):
        cp = layout.cp
        order = np.lexsort((row, dst, src))
        src, dst, row, length = src[order], dst[order], row[order], length[order]
        code = slot_of(src, dst)
        pair = src * cp + dst
        cum = np.cumsum(length) - length
        first = np.searchsorted(pair, pair, side="left")
        pos = cum - cum[first] if len(pair) else cum
        block = np.zeros(cp * cp, np.int64)
        np.add.at(block, pair, length)
        if width is None:
            codes = np.unique(code)
            slot = np.searchsorted(codes, code)
            widths = np.zeros(len(codes), np.int64)
            np.maximum.at(widths, slot, pos + length)
            s_len = max(int(widths.max(initial=0)), 1)
            keys = [slot_key(int(c), layout, all_slots) for c in codes]
        else:
            keys = all_slots
            codes = np.array([slot_code(k, layout) for k in keys], np.int64)
            slot = np.searchsorted(codes, code)
            need = int(block.max(initial=0))
            if need > width:
                relay_width_error(need, width, all_slots)
            s_len = max(int(width), 1)
            widths = np.full(len(keys), int(width), np.int64)
        self.src, self.start, self.row, self.length = src, slot * s_len + pos, row, length
        self.s_len, self.n_slots = s_len, len(keys)
        offsets = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        self.entry = np.empty(len(order), np.int64)
        self.entry[order] = offsets[:-1][slot] + pos
        self.total = int(offsets[-1])
        self.shifts = tuple(keys)
        self.widths = tuple(int(w) for w in widths)

    def runs(self, cp: int, num_runs: int | None) -> np.ndarray:
        return pack_runs(
            cp, self.src, self.start, self.row, self.length, num_runs, split=self.s_len
        )


def _cut(runs_a, runs_b):
    """Runs ``(key, start, end)`` of ``a`` (disjoint within a key, sorted) cut at the starts
    and ends of the runs of ``b`` of the same key: ``(index into a, start, end)``."""
    ka, a0, a1 = runs_a
    kb, b0, b1 = runs_b
    span = int(max(a1.max(initial=0), b1.max(initial=0), 1)) + 1
    cuts = np.unique(np.concatenate([kb * span + b0, kb * span + b1]))
    ga0, ga1 = ka * span + a0, ka * span + a1
    lo = np.searchsorted(cuts, ga0, side="right")
    hi = np.searchsorted(cuts, ga1, side="left")
    count = hi - lo + 1
    idx = np.repeat(np.arange(len(ka)), count)
    j = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    inner = np.concatenate([cuts, [0]])
    left = np.where(j == 0, ga0[idx], inner[np.minimum(lo[idx] + j - 1, len(cuts) - 1)])
    right = np.where(j == count[idx] - 1, ga1[idx], inner[np.minimum(lo[idx] + j, len(cuts))])
    return idx, left - ka[idx] * span, right - ka[idx] * span


def _all_inter(layout: NodeLayout) -> list[tuple[int, int]]:
    """The inter-node slots ``(dn, dl)`` of ``layout`` (built per call: a few dozen)."""
    return [(dn, dl) for dn in range(1, layout.nodes) for dl in range(layout.local)]


def build_relay_runs(
    table: CastTable,
    layout: NodeLayout,
    inter_width: int | None = None,
    intra_width: int | None = None,
    num_runs: tuple[int, int, int] | None = None,
) -> RelayRunsTable:
    """:func:`~magi_jax.planning.relay_table.build_relay_table` by runs: the same tables
    (:meth:`RelayRunsTable.dense` equals it entry for entry) as runs. ``num_runs``: the runs
    of the ``(inter, intra, recv)`` tables (keys at a capacity: shapes fixed by it; a rank
    that needs more raises :class:`~magi_jax.planning.capacity.CapacityError`); default the
    most any rank needs."""
    check_layout(table, layout)
    nodes, local, cp = layout.nodes, layout.local, layout.cp
    if (inter_width is None) != (intra_width is None):
        raise ValueError(
            "pass both inter_width and intra_width (keys at a capacity) or "
            "neither (tables sized for this cast)"
        )
    dst, brow, src, x, length = move_runs(table)
    cross = dst // local != src // local

    # -- inter-node hop: each (source, destination node, row) once, to a relay that needs it.
    c_dst, c_b, c_src, c_x, c_len = (v[cross] for v in (dst, brow, src, x, length))
    group = c_src * nodes + c_dst // local
    order = np.lexsort((c_x, group))
    g_grp, g_x0, g_x1, g_bit = group[order], c_x[order], (c_x + c_len)[order], c_dst[order] % local
    r_grp, r0, r1, r_need = _need_runs(g_grp, g_x0, g_x1, g_bit, local)
    p_run, p0, p1, p_relay = _split_to_relays(r0, r1, r_need, local)
    p_grp = r_grp[p_run]
    p_src, p_node = p_grp // nodes, p_grp % nodes
    relay = p_node * local + p_relay
    blocks1 = _RunBlocks(
        p_src,
        relay,
        p0,
        p1 - p0,
        lambda s, t: ((t // local - s // local) % nodes) * local + (t % local - s % local) % local,
        layout,
        inter_width,
        _all_inter(layout),
    )
    relay_total = blocks1.total

    # -- each cross move cut at the relay parts of its (source, node): a piece per part.
    m_idx, m0, m1 = _cut((group, c_x, c_x + c_len), (p_grp, p0, p1))
    # The part holding each piece: parts of one group are disjoint and sorted by start.
    span = int(max(p1.max(initial=0), 1)) + 1
    part_key = p_grp * span + p0
    part_order = np.argsort(part_key, kind="stable")
    pk = part_key[part_order]
    part = part_order[np.searchsorted(pk, group[m_idx] * span + m0, side="right") - 1]
    m_dst, m_b = c_dst[m_idx], c_b[m_idx] + (m0 - c_x[m_idx])
    m_len = m1 - m0
    m_entry = blocks1.entry[part] + (m0 - p0[part])  # relay row of the piece's first row
    direct = relay[part] == m_dst

    # -- intra-node hop: relays forward to the node's other needing ranks; owners in the
    # receiver's node send directly (local rows after the relay rows).
    fwd = ~direct
    near = ~cross
    i_src = np.concatenate([relay[part][fwd], src[near]])
    i_dst = np.concatenate([m_dst[fwd], dst[near]])
    i_row = np.concatenate([m_entry[fwd], relay_total + x[near]])
    i_len = np.concatenate([m_len[fwd], length[near]])
    i_b = np.concatenate([m_b[fwd], brow[near]])
    blocks2 = _RunBlocks(
        i_src,
        i_dst,
        i_row,
        i_len,
        lambda s, t: (t - s) % local,
        layout,
        intra_width,
        list(range(1, local)),
    )
    n1, n2, nr = (None, None, None) if num_runs is None else num_runs
    inter_runs = blocks1.runs(cp, n1)
    intra_runs = blocks2.runs(cp, n2)
    r_dst = np.concatenate([m_dst[direct], i_dst])
    r_b = np.concatenate([m_b[direct], i_b])
    r_val = np.concatenate([m_entry[direct], relay_total + blocks2.entry])
    r_len = np.concatenate([m_len[direct], i_len])
    recv_runs = pack_runs(cp, r_dst, r_b, r_val, r_len, nr)
    return RelayRunsTable(
        layout=layout,
        inter_runs=inter_runs,
        intra_runs=intra_runs,
        recv_runs=recv_runs,
        inter_shifts=blocks1.shifts,
        inter_widths=blocks1.widths,
        intra_shifts=blocks2.shifts,
        intra_widths=blocks2.widths,
        inter_slot_len=blocks1.s_len,
        intra_slot_len=blocks2.s_len,
        buffer_len=table.buffer_len,
    )


def relay_run_bounds(
    layout: NodeLayout,
    slot_len: int,
    buffer_len: int,
    send_runs: int | None,
    recv_runs: int | None,
) -> tuple[int, int, int]:
    """Runs per rank of the ``(inter, intra, recv)`` two-hop tables of a key at a capacity
    whose flat casts hold ``send_runs`` / ``recv_runs`` runs per rank
    (:class:`~magi_jax.planning.capacity.PlanCapacity`'s fields; ``None``: a run per row)
    in slots of ``slot_len`` rows and buffers of ``buffer_len``. A relay part cuts a flat
    run at most once per rank of the receiving node, so the bounds grow with those fields
    times ``local`` (plus a padding run per slot), never past one run per entry. Measured at
    64k-1M tokens on 2 x 4, 4 x 4 and 8 x 8 ranks, the tables use a quarter of them or less."""
    n1, n2 = (layout.nodes - 1) * layout.local, layout.local - 1
    entries = (max(n1 * slot_len, 1), max(n2 * buffer_len, 1), max(buffer_len, 1))
    if send_runs is None or recv_runs is None:
        return entries
    loc = layout.local
    return (
        min(entries[0], loc * send_runs + n1),
        min(entries[1], loc * (send_runs + recv_runs) + n2),
        min(entries[2], 2 * recv_runs + loc * send_runs),
    )


def pad_runs(runs: np.ndarray, size: int, what: str) -> np.ndarray:
    """``runs [cp, R, 2]`` padded with empty runs to ``[cp, size, 2]``; more than ``size``
    raises :class:`~magi_jax.planning.capacity.CapacityError` (``what`` names the table)."""
    need = int((runs[..., 1] > 0).sum(axis=1).max(initial=0))
    if need > size:
        from magi_jax.planning.capacity import CapacityError

        raise CapacityError(
            f"this mask's two-hop {what} table needs {need} runs per rank, but keys at this "
            f"capacity hold {size}; build the capacity with larger send_runs and recv_runs "
            "(PlanCapacity.from_masks over a sample of your masks), or pass "
            "hierarchical=False"
        )
    # Keep a rank's runs in order, drop empty ones, pad at the end.
    cp = runs.shape[0]
    out = np.zeros((cp, size, 2), np.int32)
    out[:, :, 0] = -1
    keep = runs[..., 1] > 0
    place = np.cumsum(keep, axis=1) - 1
    r, i = np.nonzero(keep)
    out[r, place[r, i]] = runs[r, i]
    return out
