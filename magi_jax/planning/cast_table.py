"""Group-cast tables (host NumPy, no JAX): which rows of which rank fill each rank's remote KV
buffer, as static int32 tables, and their NumPy models.

The meaning of the tables (the contract every transport implements) is described in
:mod:`magi_jax.sharding.collectives`, which moves the data on the device.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from magi_jax.planning.solver import DispatchMeta, ranges_repeat

# Mean piece length from which cast tables are written block by block and run by run
# (slice writes) rather than token by token (fancy indexing): same tables, no token-sized
# temporaries.
_RUN_WRITE_MIN = 64

__all__ = ["CastTable", "build_cast_table", "cast_table_from_pieces", "choose_transport",
           "cast_moves", "cast_model", "reduce_model"]


@dataclasses.dataclass(frozen=True)
class CastTable:
    """Host tables of one cast, stacked over ranks (see :mod:`magi_jax.sharding.collectives`).
    ``send_index`` int32 ``[cp, n_slots, S]``, ``recv_index`` int32 ``[cp, B]``."""

    send_index: np.ndarray
    recv_index: np.ndarray
    shifts: tuple[int, ...]
    widths: tuple[int, ...]

    @property
    def cp(self) -> int:
        return self.send_index.shape[0]

    @property
    def buffer_len(self) -> int:
        return self.recv_index.shape[1]

    @property
    def slot_len(self) -> int:
        return self.send_index.shape[2]

    def tokens_moved(self) -> int:
        """Real rows moved over the network in total (no padding)."""
        return int((self.send_index >= 0).sum())


def choose_transport(table: CastTable) -> str:
    """``ppermute`` unless nearly every pair of ranks talks with even block sizes, where one
    padded ``all_to_all`` moves little extra and launches once."""
    n = len(table.shifts)
    if n >= 8 and table.cp * table.slot_len <= 1.5 * sum(table.widths):
        return "all_to_all"
    return "ppermute"


def build_cast_table(meta: DispatchMeta, remote: list[np.ndarray], buffer_len: int,
                     width: int | None = None) -> CastTable:
    """Tables of one stage. ``remote[r]``: rank ``r``'s pieces ``[p, 5]`` = (global start,
    global end, owner rank, stage, offset in the stage buffer); ``buffer_len`` >= every
    rank's buffer. With ``width`` (keys at a capacity): a slot for every other rank (shifts
    ``1 .. cp-1``), each ``width`` rows wide, so the table's shapes and static part depend on
    ``(cp, width, buffer_len)`` alone; a rank that sends another more rows raises
    :class:`~magi_jax.planning.capacity.CapacityError` naming ``cast_width``."""
    pieces = [np.column_stack([rem[:, :3], np.full(len(rem), r), rem[:, 4]])
              for r, rem in enumerate(remote) if len(rem)]
    pieces = np.concatenate(pieces) if pieces else np.zeros((0, 5), np.int64)
    return cast_table_from_pieces(meta, *(pieces[:, i] for i in range(5)),
                                  buffer_len=buffer_len, width=width)


def cast_table_from_pieces(meta: DispatchMeta, g0, g1, src, dst, offset, buffer_len: int,
                           width: int | None = None) -> CastTable:
    """:func:`build_cast_table` from flat piece arrays: piece ``i`` moves global keys
    ``[g0[i], g1[i])`` from their owner ``src[i]`` to rank ``dst[i]``'s stage buffer at
    ``offset[i]``."""
    cp, c = meta.cp, meta.chunk_size
    g0, g1, src, dst, off_b = (np.asarray(x).astype(np.int64) for x in (g0, g1, src, dst,
                                                                         offset))
    # Work per piece first (few), then per block and per buffer: a piece's rows sit in the
    # block (owner -> receiver) after the earlier pieces of that owner, in global-position
    # order.
    order = np.lexsort((g0, dst, src))
    g0, g1, src, dst, off_b = g0[order], g1[order], src[order], dst[order], off_b[order]
    length = g1 - g0
    pair = src * cp + dst
    first = np.searchsorted(pair, pair, side="left")
    cum = np.concatenate([[0], np.cumsum(length)])
    off_block = cum[:-1] - cum[first]                         # piece start inside its block
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
    send = np.full((cp, n_slots, s_len), -1, np.int32)
    recv = np.full((cp, max(int(buffer_len), 1)), -1, np.int32)
    if not len(length):
        return CastTable(send, recv, out_shifts, out_widths)
    # Every piece lies inside one chunk, so it is one run on both sides: consecutive local
    # rows of the owner into consecutive block positions, consecutive block entries into
    # consecutive buffer rows.
    first_row = meta.chunk_slot[g0 // c] * c + g0 % c
    first_entry = out_slot * s_len + off_block
    if length.sum() < _RUN_WRITE_MIN * len(length):
        # Short pieces: token by token (fancy indexing).
        pi, step = ranges_repeat(np.zeros_like(length), length)
        send[src[pi], out_slot[pi], off_block[pi] + step] = first_row[pi] + step
        recv[dst[pi], off_b[pi] + step] = first_entry[pi] + step
        return CastTable(send, recv, out_shifts, out_widths)
    # Long pieces: block by block (a block fills its slot from position 0, its pieces back
    # to back) and run by run in the buffers (a rank's pieces fill its buffer).
    src_bounds = np.searchsorted(src, np.arange(cp + 1))
    block_first = np.nonzero(np.diff(pair, prepend=-1))[0]       # first piece of each block
    block_end = np.append(block_first[1:], len(pair))
    src_blocks = np.searchsorted(block_first, src_bounds)
    for r in range(cp):
        a, b = src_bounds[r], src_bounds[r + 1]
        if a == b:
            continue
        rows = _runs_of(first_row[a:b], length[a:b])          # the owner's rows, block order
        base = int(cum[a])
        for i, j in zip(block_first[src_blocks[r]:src_blocks[r + 1]].tolist(),
                        block_end[src_blocks[r]:src_blocks[r + 1]].tolist()):
            send[r, out_slot[i], :cum[j] - cum[i]] = rows[cum[i] - base:cum[j] - base]
    o = np.lexsort((off_b, dst))
    d, ob, ln, fe = dst[o], off_b[o], length[o], first_entry[o]
    if np.any((d[1:] == d[:-1]) & (ob[1:] < ob[:-1] + ln[:-1])):     # overlapping pieces
        for k in range(len(length)):
            recv[dst[k], off_b[k]:off_b[k] + length[k]] = np.arange(
                first_entry[k], first_entry[k] + length[k])
        return CastTable(send, recv, out_shifts, out_widths)
    new = np.ones(len(d), bool)
    new[1:] = (d[1:] != d[:-1]) | (ob[1:] != ob[:-1] + ln[:-1])
    run_first = np.nonzero(new)[0]
    run_end = np.append(run_first[1:], len(d))
    cum_r = np.concatenate([[0], np.cumsum(ln)])
    entries = _runs_of(fe, ln)
    for i, j in zip(run_first.tolist(), run_end.tolist()):
        recv[d[i], ob[i]:ob[i] + cum_r[j] - cum_r[i]] = entries[cum_r[i]:cum_r[j]]
    return CastTable(send, recv, out_shifts, out_widths)


def _runs_of(first: np.ndarray, length: np.ndarray) -> np.ndarray:
    """int32 ``concat(arange(first[i], first[i] + length[i]) for i)``."""
    n = int(length.sum())
    step = np.ones(n, np.int32)
    if n:
        step[0] = first[0]
        nz = length > 0
        f, ln = first[nz], length[nz]
        step[(np.cumsum(ln) - ln)[1:]] = f[1:] - (f[:-1] + ln[:-1] - 1)
    return np.cumsum(step, dtype=np.int32)


def _width_error(need: int, width: int):
    from magi_jax.planning.capacity import CapacityError
    raise CapacityError(f"this mask needs PlanCapacity.cast_width>={need} (KV tokens one "
                        f"rank sends another in one stage), but the capacity holds "
                        f"{width}; build the capacity with cast_width>={need} (or "
                        "PlanCapacity.from_masks over a sample of your masks)")


def cast_moves(table: CastTable):
    """Every real move of a cast at once, as int64 arrays ``(dst, dst_row, src, src_row)``:
    rank ``dst``'s buffer row ``dst_row`` is rank ``src``'s local row ``src_row``; ordered
    by ``(dst, dst_row)``. The input of the two-hop planner
    (:mod:`magi_jax.planning.hierarchy`)."""
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
