"""Group-cast tables (host NumPy, no JAX): which rows of which rank fill each rank's remote KV
buffer, as static int32 tables, and their NumPy models.

The meaning of the tables (the contract every transport implements) is described in
:mod:`magi_jax.sharding.transport`, which moves the data on the device.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numpy.typing import ArrayLike

from magi_jax.planning.errors import capacity_error
from magi_jax.planning.intervals import ranges_repeat
from magi_jax.planning.solver import DispatchMeta

__all__ = [
    "CastTable",
    "build_cast_table",
    "cast_table_from_pieces",
    "choose_transport",
    "cast_moves",
    "cast_model",
    "reduce_model",
    "index_runs",
    "expand_index_runs",
    "pack_runs",
]


@dataclasses.dataclass(frozen=True)
class CastTable:
    """Host tables of one cast, stacked over ranks (see :mod:`magi_jax.sharding.transport`),
    stored as runs: ``send_runs`` int32 ``[cp, Rs, 2]`` and ``recv_runs`` int32 ``[cp, Rr, 2]``,
    rows ``(first value, length)`` (:func:`expand_index_runs`). They expand to ``send_index`` int32
    ``[cp, n_slots, S]`` (``S = slot_len``) and ``recv_index`` int32 ``[cp, B]``
    (``B = buffer_len``), the tables the transports read; the key ships the runs and the
    device expands them right before a collective
    (:func:`magi_jax.ffa.ragged.expand_index_runs`)."""

    send_runs: np.ndarray
    recv_runs: np.ndarray
    shifts: tuple[int, ...]
    widths: tuple[int, ...]
    slot_len: int
    buffer_len: int

    @classmethod
    def from_index(
        cls, send_index: ArrayLike, recv_index: ArrayLike, shifts: ArrayLike, widths: ArrayLike
    ) -> "CastTable":
        """The table of dense ``send_index [cp, n_slots, S]`` and ``recv_index [cp, B]``."""
        send, recv = np.asarray(send_index), np.asarray(recv_index)
        cp, _, s = send.shape
        return cls(
            index_runs(send.reshape(cp, -1), split=s),
            index_runs(recv, value_split=s),
            tuple(int(x) for x in shifts),
            tuple(int(w) for w in widths),
            int(s),
            int(recv.shape[1]),
        )

    @property
    def cp(self) -> int:
        return self.send_runs.shape[0]

    @property
    def n_slots(self) -> int:
        return len(self.shifts)

    @functools.cached_property
    def send_index(self) -> np.ndarray:
        return expand_index_runs(self.send_runs, self.n_slots * self.slot_len).reshape(
            self.cp, self.n_slots, self.slot_len
        )

    @functools.cached_property
    def recv_index(self) -> np.ndarray:
        return expand_index_runs(self.recv_runs, self.buffer_len)

    @property
    def nbytes(self) -> int:
        """Bytes the key stores and ships (the runs)."""
        return self.send_runs.nbytes + self.recv_runs.nbytes

    def tokens_moved(self) -> int:
        """Real rows moved over the network in total (no padding)."""
        real = self.send_runs[..., 0] >= 0
        return int(self.send_runs[..., 1][real].sum())

    def rows_received(self) -> np.ndarray:
        """int64 ``[cp]``: real rows each rank receives (its buffer rows that are filled)."""
        real = self.recv_runs[..., 0] >= 0
        return np.where(real, self.recv_runs[..., 1], 0).sum(axis=1, dtype=np.int64)

    def run_counts(self) -> tuple[int, int]:
        """``(send, recv)``: the most runs of one rank's tables, as
        :class:`~magi_jax.planning.capacity.PlanCapacity` counts them (``send_runs``: runs
        of real rows; ``recv_runs``: every run, padding gaps included, trailing padding not)."""
        send = ((self.send_runs[..., 0] >= 0) & (self.send_runs[..., 1] > 0)).sum(axis=1)
        recv = (self.recv_runs[..., 1] > 0).sum(axis=1)
        return int(send.max(initial=0)), int(recv.max(initial=0))


def expand_index_runs(runs: np.ndarray, size: int) -> np.ndarray:
    """The index table of ``runs`` (NumPy model of the device expansion): int32
    ``[..., R, 2]`` rows ``(first value, length)`` -> int32 ``[..., size]``. Run ``i`` covers
    the next ``length`` entries with ``value, value + 1, ...``, or with ``-1`` (padding) when
    ``value < 0``; entries past the last run are ``-1``."""
    runs = np.asarray(runs)
    lead, r_len = runs.shape[:-2], runs.shape[-2]
    flat = runs.reshape(-1, r_len, 2).astype(np.int64)
    value, length = flat[..., 0], flat[..., 1]
    start = np.cumsum(length, axis=1) - length
    row, i = np.nonzero((value >= 0) & (length > 0))
    owner, entry = ranges_repeat(start[row, i], start[row, i] + length[row, i])
    out = np.full((flat.shape[0], int(size)), -1, np.int32)
    out[row[owner], entry] = value[row, i][owner] + entry - start[row, i][owner]
    return out.reshape(lead + (int(size),))


# The name this function had before it was named for what it expands, for one release.
expand_runs = expand_index_runs


def index_runs(
    index: np.ndarray,
    split: int | None = None,
    num_runs: int | None = None,
    field: str | None = None,
    value_split: int | None = None,
) -> np.ndarray:
    """Runs of an index table: int ``[cp, N]`` -> int32 ``[cp, R, 2]`` (:func:`expand_index_runs`
    gives ``index`` back). A run is a stretch of consecutive values (or of ``-1``), cut where
    an entry is a multiple of ``split`` or a value one of ``value_split`` (a slot
    boundary: send tables are cut at ``split = S``, receive tables at ``value_split = S``
    so that a run reads one slot). ``num_runs``: ``R`` (else the most
    any rank needs); a rank that needs more raises
    :class:`~magi_jax.planning.capacity.CapacityError` naming ``field``."""
    index = np.asarray(index, np.int64)
    cp, n = index.shape
    real = index >= 0
    new = np.ones((cp, n), bool)
    new[:, 1:] = (real[:, 1:] != real[:, :-1]) | (real[:, 1:] & (index[:, 1:] != index[:, :-1] + 1))
    if split:
        new[:, np.arange(n) % split == 0] = True
    if value_split:
        new |= real & (index % value_split == 0)
    first = np.nonzero(new.reshape(-1))[0]  # every run, real or padding, flat
    length = np.diff(np.append(first, cp * n))  # a rank's first entry starts a run
    keep = real.reshape(-1)[first]
    first, length = first[keep], length[keep]
    return pack_runs(
        cp,
        first // n,
        first % n,
        index.reshape(-1)[first],
        length,
        num_runs,
        field,
        split=split,
        value_split=value_split,
    )


def pack_runs(
    cp: int,
    rank: ArrayLike,
    start: ArrayLike,
    value: ArrayLike,
    length: ArrayLike,
    num_runs: int | None = None,
    field: str | None = None,
    split: int | None = None,
    value_split: int | None = None,
    limit: int | None = None,
) -> np.ndarray:
    """Real runs ``(rank, start entry, first value, length)`` (non-overlapping within a
    rank) -> the packed runs ``[cp, R, 2]``: each rank's runs in entry order, with a padding
    run before each run that does not start where the previous one ended, and adjoining
    runs of consecutive values merged, not across a slot boundary (an entry that is a
    multiple of ``split``, or a value that is a multiple of ``value_split``). ``R`` is
    ``num_runs`` (else the most any rank needs). ``limit``: the capacity ``field``'s value;
    with ``split`` it bounds a rank's real runs (the send table: ``num_runs`` keeps room for
    a padding run per slot), else all its runs; a rank over it (or over ``num_runs``)
    raises :class:`~magi_jax.planning.capacity.CapacityError`."""
    rank, start, value, length = (np.asarray(x, np.int64) for x in (rank, start, value, length))
    keep = length > 0
    order = np.lexsort((start[keep], rank[keep]))
    rank, start, value, length = (x[keep][order] for x in (rank, start, value, length))
    glue = np.zeros(len(rank), bool)
    glue[1:] = (
        (rank[1:] == rank[:-1])
        & (start[1:] == start[:-1] + length[:-1])
        & (value[1:] == value[:-1] + length[:-1])
    )
    if split:
        glue &= start % split != 0
    if value_split:
        glue &= value % value_split != 0
    head = np.nonzero(~glue)[0]
    rank, start, value = rank[head], start[head], value[head]
    length = np.add.reduceat(length, head) if len(head) else length[:0]
    prev_end = np.zeros(len(rank), np.int64)
    prev_end[1:] = np.where(rank[1:] == rank[:-1], (start + length)[:-1], 0)
    gap = start - prev_end
    if np.any(gap < 0):
        raise ValueError("cast table runs overlap (two pieces write one entry)")
    real = np.bincount(rank, minlength=cp)
    count = real + np.bincount(rank[gap > 0], minlength=cp)
    size = max(int(count.max(initial=0)) if num_runs is None else int(num_runs), 1)
    need = int((real if split else count).max(initial=0))
    limit = size if limit is None else int(limit)
    if num_runs is not None and (need > limit or count.max(initial=0) > size):
        detail = " (runs of consecutive rows in one rank's cast table of one stage)"
        raise capacity_error(field, need, limit, detail=detail)
    out = np.zeros((cp, size, 2), np.int32)
    out[:, :, 0] = -1
    # Each real run takes its place after its rank's earlier runs and padding runs.
    emitted = 1 + (gap > 0)
    before = np.cumsum(emitted) - emitted
    place = before - before[np.searchsorted(rank, rank)] + (gap > 0)
    g = gap > 0
    out[rank[g], place[g] - 1, 1] = gap[g]
    out[rank, place, 0] = value
    out[rank, place, 1] = length
    return out


def choose_transport(table: CastTable, gated: bool = False) -> str:
    """``ppermute`` unless nearly every pair of ranks talks with even block sizes, where one
    padded ``all_to_all`` moves little extra and launches once. ``gated``: the ``ppermute``
    slots move in gated pieces (keys at a capacity), never more than the ``all_to_all``
    would, and far less where the mask needs less than the capacity: ``ppermute``."""
    if gated:
        return "ppermute"
    n = len(table.shifts)
    if n >= 8 and table.cp * table.slot_len <= 1.5 * sum(table.widths):
        return "all_to_all"
    return "ppermute"


def build_cast_table(
    meta: DispatchMeta, remote: list[np.ndarray], buffer_len: int, width: int | None = None
) -> CastTable:
    """Tables of one stage. ``remote[r]``: rank ``r``'s pieces ``[p, 5]`` = (global start,
    global end, owner rank, stage, offset in the stage buffer); ``buffer_len`` >= every
    rank's buffer. With ``width`` (keys at a capacity): a slot for every other rank (shifts
    ``1 .. cp-1``), each ``width`` rows wide, so the table's shapes and static part depend on
    ``(cp, width, buffer_len)`` alone; a rank that sends another more rows raises
    :class:`~magi_jax.planning.capacity.CapacityError` naming ``cast_width``."""
    pieces = [
        np.column_stack([rem[:, :3], np.full(len(rem), r), rem[:, 4]])
        for r, rem in enumerate(remote)
        if len(rem)
    ]
    pieces = np.concatenate(pieces) if pieces else np.zeros((0, 5), np.int64)
    return cast_table_from_pieces(
        meta, *(pieces[:, i] for i in range(5)), buffer_len=buffer_len, width=width
    )


def cast_table_from_pieces(
    meta: DispatchMeta,
    g0: np.ndarray,
    g1: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    offset: np.ndarray,
    buffer_len: int,
    width: int | None = None,
    send_runs: int | None = None,
    recv_runs: int | None = None,
) -> CastTable:
    """:func:`build_cast_table` from flat piece arrays: piece ``i`` moves global keys
    ``[g0[i], g1[i])`` from their owner ``src[i]`` to rank ``dst[i]``'s stage buffer at
    ``offset[i]``. ``send_runs`` / ``recv_runs`` (keys at a capacity, with ``width``): the
    runs of each rank's tables (:class:`~magi_jax.planning.capacity.PlanCapacity`'s fields
    of those names), so the run arrays' shapes depend on the capacity alone."""
    cp, c = meta.cp, meta.chunk_size
    g0, g1, src, dst, off_b = (np.asarray(x).astype(np.int64) for x in (g0, g1, src, dst, offset))
    # Work per piece first (few), then per block and per buffer: a piece's rows sit in the
    # block (owner -> receiver) after the earlier pieces of that owner, in global-position
    # order.
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
    if width is None:
        s_len = max(int(block_len.max(initial=0)), 1)
        out_slot, n_slots = slot, len(shifts)
        out_shifts, out_widths = tuple(int(x) for x in shifts), tuple(int(w) for w in widths)
    else:
        need = int(widths.max(initial=0))
        if need > width:
            _width_error(need, width)
        s_len = max(int(width), 1)
        out_slot, n_slots = shift - 1, cp - 1
        out_shifts, out_widths = tuple(range(1, cp)), (int(width),) * (cp - 1)
    b_len = max(int(buffer_len), 1)
    # Runs of each table at a capacity: the send table keeps a padding run per slot besides
    # its real runs; neither ever needs more runs than it has entries.
    send_size = None if send_runs is None else min(int(send_runs) + n_slots, n_slots * s_len)
    recv_size = None if recv_runs is None else min(int(recv_runs), b_len)
    # Every piece lies inside one chunk, so it is one run on both sides: consecutive local
    # rows of the owner into consecutive slot positions, consecutive slot entries into
    # consecutive buffer rows.
    first_row = meta.chunk_slot[g0 // c] * c + g0 % c
    first_entry = out_slot * s_len + off_block
    send = pack_runs(
        cp,
        src,
        first_entry,
        first_row,
        length,
        send_size,
        "send_runs",
        split=s_len,
        limit=send_runs,
    )
    o = np.lexsort((off_b, dst))
    d, ob, ln = dst[o], off_b[o], length[o]
    if np.any((d[1:] == d[:-1]) & (ob[1:] < ob[:-1] + ln[:-1])):  # overlapping pieces
        # A later piece overwrites an earlier one's rows: write them in order, then runs.
        dense = np.full((cp, b_len), -1, np.int64)
        for k in range(len(length)):
            dense[dst[k], off_b[k] : off_b[k] + length[k]] = np.arange(
                first_entry[k], first_entry[k] + length[k]
            )
        recv = index_runs(dense, value_split=s_len, num_runs=recv_size, field="recv_runs")
    else:
        recv = pack_runs(
            cp,
            dst,
            off_b,
            first_entry,
            length,
            recv_size,
            "recv_runs",
            value_split=s_len,
            limit=recv_runs,
        )
    return CastTable(send, recv, out_shifts, out_widths, s_len, b_len)


def _width_error(need: int, width: int):
    detail = " (KV tokens one rank sends another in one stage)"
    raise capacity_error("cast_width", need, width, detail=detail)


def cast_moves(table: CastTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every real move of a cast at once, as int64 arrays ``(dst, dst_row, src, src_row)``:
    rank ``dst``'s buffer row ``dst_row`` is rank ``src``'s local row ``src_row``; ordered
    by ``(dst, dst_row)``, each ``[M]`` for ``M`` moves. The input of the two-hop planner
    (:mod:`magi_jax.planning.relay_table`)."""
    cp, _, s = table.send_index.shape
    dst, row = np.nonzero(table.recv_index >= 0)
    entry = table.recv_index[dst, row].astype(np.int64)
    slot, pos = entry // s, entry % s
    src = (dst - np.asarray(table.shifts, np.int64)[slot]) % cp
    src_row = table.send_index[src, slot, pos].astype(np.int64)
    keep = src_row >= 0
    return dst[keep], row[keep], src[keep], src_row[keep]


# ---- NumPy models (the meaning of the tables; used by tests) ---------------------------------


def _moves(table: CastTable):
    """Every real move of a cast: ``(dst rank, dst buffer row, src rank, src row)``."""
    cp, _, s = table.send_index.shape
    for r in range(cp):
        for b, e in enumerate(table.recv_index[r]):
            if e < 0:
                continue
            j, p = divmod(int(e), s)
            src = (r - table.shifts[j]) % cp
            row = table.send_index[src, j, p]
            if row >= 0:
                yield r, b, src, row


def cast_model(x: np.ndarray, table: CastTable) -> np.ndarray:
    """``x [cp, T, ...]`` (every rank's input) -> ``[cp, B, ...]``, by the table semantics."""
    out = np.zeros((table.cp, table.buffer_len) + x.shape[2:], x.dtype)
    for r, b, src, row in _moves(table):
        out[r, b] = x[src, row]
    return out


def reduce_model(y: np.ndarray, table: CastTable, num_rows: int) -> np.ndarray:
    """Adjoint of :func:`cast_model`: ``y [cp, B, ...]`` -> ``[cp, num_rows, ...]`` float64."""
    out = np.zeros((table.cp, num_rows) + y.shape[2:], np.float64)
    for r, b, src, row in _moves(table):
        out[src, row] += y[r, b]
    return out
