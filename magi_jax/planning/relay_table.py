"""Two-hop group-cast tables for a mesh of nodes (host NumPy, no JAX).

On a mesh whose context-parallel ranks span several nodes (mesh axes ``("node", "local")``,
rank ``r = node · local + local_index``), a flat group-cast sends a KV row once to every rank
that needs it, so a row that several ranks of one node need crosses the slow link between
nodes several times. The two-hop cast sends it across once:

1. **inter-node hop**: every distinct (source row, destination node) pair crosses once, to a
   *relay* rank of that node chosen among the ranks that need the row. Consecutive source
   rows needed by the same ranks form a run; a run is split into equal parts, one per rank
   that needs it, so the rows received across the node boundary are spread evenly over the
   node's ranks;
2. **intra-node hop**: each relay forwards the rows it received to the other ranks of its
   node that need them, and rows whose owner is in the destination's own node go straight
   from the owner, all over the fast local links.

Every rank then reads its stage buffer from the rows it received as a relay and those of
the intra-node hop. The reverse (the reduce of the backward) sums the partial gradients
inside the node first (intra-node hop reversed, summed at the relay) and sends one row back
across the node boundary per (source row, destination node).

Tables (stacked over ranks; the contract the device code of
:mod:`magi_jax.sharding.transport` implements), seen from rank ``r`` of node ``n`` and local
index ``l``:

- ``inter_send [n_inter, S1]``: slot ``j`` sends local rows to rank
  ``((n + dn_j) % nodes, (l + dl_j) % local)`` with ``(dn_j, dl_j) = inter_shifts[j]``,
  ``dn_j >= 1`` (always another node); ``-1`` is padding. Left-packed: only the first
  ``inter_widths[j]`` columns can be real. The blocks a rank receives, packed back to back at
  their widths (``R = sum(inter_widths)`` rows), are its *relay rows*.
- ``intra_send [n_intra, S2]``: slot ``j`` sends rows of ``[relay rows; local rows]``
  (entries ``< R`` are relay rows, ``R + i`` is local row ``i``) to the rank of the same node
  at local index ``(l + intra_shifts[j]) % local``; ``-1`` is padding, left-packed as above.
- ``recv_index [B]``: buffer row ``b`` is entry ``recv_index[b]`` of ``[relay rows; the
  intra-node blocks received, packed at their widths]``; ``-1``: the row is zero.

The result of the two hops equals the flat cast the tables were built from, row for row
(:func:`relay_cast_model` against :func:`~magi_jax.planning.cast_table.cast_model`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from magi_jax.planning.cast_table import CastTable, cast_moves

__all__ = [
    "NodeLayout",
    "RelayTable",
    "build_relay_table",
    "inter_node_rows",
    "inter_node_wire_rows",
    "relay_cast_model",
    "relay_reduce_model",
    "check_layout",
    "slot_code",
    "slot_key",
    "relay_width_error",
]

# The relay choice keeps the set of ranks that need a row as a bitmask.
_MAX_LOCAL = 62


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """Ranks grouped in nodes: ``cp = nodes · local``, rank ``r`` sits in node
    ``r // local`` at local index ``r % local`` (the order of a mesh axis tuple
    ``("node", "local")``)."""

    nodes: int
    local: int

    def __post_init__(self):
        for name in ("nodes", "local"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"NodeLayout.{name}={v!r} must be a positive integer")
        if self.local > _MAX_LOCAL:
            raise ValueError(
                f"NodeLayout.local={self.local} must be at most {_MAX_LOCAL} ranks per node"
            )

    @property
    def cp(self) -> int:
        return self.nodes * self.local


@dataclasses.dataclass(frozen=True)
class RelayTable:
    """Two-hop cast tables stacked over ranks (module docstring): ``inter_send`` int32
    ``[cp, n_inter, S1]``, ``intra_send`` int32 ``[cp, n_intra, S2]``, ``recv_index`` int32
    ``[cp, B]``; the slots' shifts and widths are static."""

    layout: NodeLayout
    inter_send: np.ndarray
    intra_send: np.ndarray
    recv_index: np.ndarray
    inter_shifts: tuple[tuple[int, int], ...]
    inter_widths: tuple[int, ...]
    intra_shifts: tuple[int, ...]
    intra_widths: tuple[int, ...]

    @property
    def cp(self) -> int:
        return self.recv_index.shape[0]

    @property
    def buffer_len(self) -> int:
        return self.recv_index.shape[1]

    @property
    def relay_rows(self) -> int:
        """Rows every rank receives in the inter-node hop (with padding): ``R``."""
        return int(sum(self.inter_widths))

    def inter_node_rows(self) -> int:
        """Real rows crossing a node boundary in total (no padding)."""
        return int((self.inter_send >= 0).sum())

    def inter_node_wire_rows(self) -> int:
        """Rows a ``ppermute`` per slot sends across node boundaries, padding included:
        every rank sends every inter-node slot at its width."""
        return self.relay_rows * self.cp

    def intra_node_rows(self) -> int:
        """Real rows moved inside nodes in total (no padding)."""
        return int((self.intra_send >= 0).sum())


def inter_node_rows(table: CastTable, layout: NodeLayout) -> int:
    """Real rows of the flat cast ``table`` whose owner and receiver sit in different nodes
    (each crossing counted: a row two ranks of one node need counts twice)."""
    check_layout(table, layout)
    dst, _, src, _ = cast_moves(table)
    return int((dst // layout.local != src // layout.local).sum())


def inter_node_wire_rows(table: CastTable, layout: NodeLayout) -> int:
    """Rows the flat cast's ``ppermute`` per slot sends across node boundaries, padding
    included: slot ``j``'s width from every rank whose receiver sits in another node."""
    check_layout(table, layout)
    r = np.arange(table.cp)
    return int(
        sum(
            w * int((r // layout.local != ((r + shift) % table.cp) // layout.local).sum())
            for shift, w in zip(table.shifts, table.widths)
        )
    )


def check_layout(table: CastTable, layout: NodeLayout) -> None:
    """Raises unless ``layout`` is a :class:`NodeLayout` covering the cast's ranks."""
    if not isinstance(layout, NodeLayout):
        raise TypeError(f"layout must be a NodeLayout; got {type(layout).__name__}")
    if layout.cp != table.cp:
        raise ValueError(
            f"layout {layout.nodes} x {layout.local} = {layout.cp} ranks, but "
            f"the cast table has {table.cp}; the layout must cover every rank"
        )


def build_relay_table(
    table: CastTable,
    layout: NodeLayout,
    inter_width: int | None = None,
    intra_width: int | None = None,
) -> RelayTable:
    """The two-hop tables that deliver exactly the rows of the flat cast ``table``.

    Without widths, every slot is as wide as its widest real block and only the slots some
    rank uses exist (the shapes follow the mask). With ``inter_width`` and ``intra_width``
    (keys at a capacity), there is an inter-node slot for every ``(dn, dl)`` with
    ``dn in 1..nodes-1``, ``dl in 0..local-1`` and an intra-node slot for every local shift
    ``1..local-1``, of those widths, so the shapes depend on ``(layout, widths,
    buffer_len)`` alone; a block wider than its width raises
    :class:`~magi_jax.planning.capacity.CapacityError`. A relay receives only rows it needs
    itself, so the inter-node blocks are never wider than the flat cast's.

    This planner works row by row, the literal statement of the tables; keys plan them by
    runs (:func:`~magi_jax.planning.relay_runs.build_relay_runs`, the same tables, entry
    for entry, in a small fraction of the time), which the tests check against this one."""
    check_layout(table, layout)
    nodes, local = layout.nodes, layout.local
    fixed = inter_width is not None or intra_width is not None
    if fixed and (inter_width is None or intra_width is None):
        raise ValueError(
            "pass both inter_width and intra_width (keys at a capacity) or "
            "neither (tables sized for this cast)"
        )
    dst, row, src, x = cast_moves(table)
    cross = dst // local != src // local
    num_rows = int(table.send_index.max(initial=-1)) + 1

    # -- inter-node hop: distinct (source, destination node, row), relay among the ranks
    # that need it.
    d_in, s_in, x_in = dst[cross], src[cross], x[cross]
    node_in = d_in // local
    code = (s_in * nodes + node_in) * max(num_rows, 1) + x_in
    uniq, which = np.unique(code, return_inverse=True)
    need = np.zeros(len(uniq), np.int64)
    np.bitwise_or.at(need, which, np.left_shift(1, d_in % local).astype(np.int64))
    u_x = uniq % max(num_rows, 1)
    u_sn = uniq // max(num_rows, 1)
    u_src, u_node = u_sn // nodes, u_sn % nodes
    relay = u_node * local + _relay_local(u_sn, u_x, need, local)

    blocks1 = _Blocks(
        u_src,
        relay,
        u_x,
        lambda s, t: _inter_slot(s, t, layout),
        layout,
        inter_width,
        [(dn, dl) for dn in range(1, nodes) for dl in range(local)],
    )
    u_entry = blocks1.entry  # relay-row entry at the relay
    relay_total = blocks1.total

    # -- intra-node hop: relays forward to the other ranks of the node that need the row;
    # owners in the receiver's node send directly (local rows after the relay rows).
    u_of = which  # inter move -> its distinct row
    fwd = relay[u_of] != d_in
    i_src = np.concatenate([relay[u_of][fwd], src[~cross]])
    i_dst = np.concatenate([d_in[fwd], dst[~cross]])
    i_row = np.concatenate([u_entry[u_of][fwd], relay_total + x[~cross]])
    code2 = (i_src * layout.cp + i_dst) * (relay_total + max(num_rows, 1)) + i_row
    uniq2, which2 = np.unique(code2, return_inverse=True)
    span = relay_total + max(num_rows, 1)
    v_row = uniq2 % span
    v_pair = uniq2 // span
    v_src, v_dst = v_pair // layout.cp, v_pair % layout.cp
    blocks2 = _Blocks(
        v_src,
        v_dst,
        v_row,
        lambda s, t: (t - s) % local,
        layout,
        intra_width,
        list(range(1, local)),
    )

    recv = np.full(table.recv_index.shape, -1, np.int32)
    d_cross, b_cross = dst[cross], row[cross]
    direct = ~fwd
    recv[d_cross[direct], b_cross[direct]] = u_entry[u_of][direct]
    b_via = np.concatenate([b_cross[fwd], row[~cross]])
    recv[i_dst, b_via] = relay_total + blocks2.entry[which2]
    return RelayTable(
        layout=layout,
        inter_send=blocks1.send,
        intra_send=blocks2.send,
        recv_index=recv,
        inter_shifts=blocks1.shifts,
        inter_widths=blocks1.widths,
        intra_shifts=blocks2.shifts,
        intra_widths=blocks2.widths,
    )


def _relay_local(group, x, need, local):
    """Local index of the relay of each distinct row: consecutive rows of one (source,
    node) ``group`` needed by the same ranks form a run; part ``i`` of ``m`` equal parts of
    a run goes to the ``(i + run) % m``-th rank that needs it (rotating, so that short runs
    spread too)."""
    n = len(x)
    if not n:
        return np.zeros(0, np.int64)
    new = np.ones(n, bool)
    new[1:] = (group[1:] != group[:-1]) | (x[1:] != x[:-1] + 1) | (need[1:] != need[:-1])
    run = np.cumsum(new) - 1
    first = np.nonzero(new)[0]
    length = np.diff(np.append(first, n))
    k = np.arange(n) - first[run]
    bits = (need[:, None] >> np.arange(local)[None, :]) & 1  # [n, local]
    m = bits.sum(axis=1)
    part = (k * m) // length[run]
    pick = (part + run) % m
    # The pick-th set bit: the first index whose running count of set bits passes pick.
    return np.argmax(np.cumsum(bits, axis=1) > pick[:, None], axis=1).astype(np.int64)


def _inter_slot(s, t, layout):
    """Code ``dn · local + dl`` of the inter-node slot from rank ``s`` to rank ``t``."""
    dn = (t // layout.local - s // layout.local) % layout.nodes
    dl = (t % layout.local - s % layout.local) % layout.local
    return dn * layout.local + dl


class _Blocks:
    """One hop's send table from distinct moves ``(src, dst, row)`` (sorted by src, dst,
    row): a block per (src, dst) pair, in a slot named by ``slot_of(src, dst)``; ``entry``:
    each move's position among the receiver's blocks packed at the slots' widths."""

    def __init__(self, src, dst, row, slot_of, layout, width, all_slots):
        cp = layout.cp
        code = slot_of(src, dst)
        order = np.lexsort((row, dst, src))
        src, dst, row, code = src[order], dst[order], row[order], code[order]
        pair = src * cp + dst
        pos = np.arange(len(pair)) - np.searchsorted(pair, pair, side="left")
        if width is None:
            codes = np.unique(code)
            slot = np.searchsorted(codes, code)
            widths = np.zeros(len(codes), np.int64)
            np.maximum.at(widths, slot, pos + 1)
            s_len = max(int(widths.max(initial=0)), 1)
            keys = [slot_key(int(c), layout, all_slots) for c in codes]
        else:
            keys = all_slots
            codes = np.array([slot_code(k, layout) for k in keys], np.int64)
            slot = np.searchsorted(codes, code)
            need = int(pos.max(initial=-1)) + 1
            if need > width:
                relay_width_error(need, width, all_slots)
            s_len = max(int(width), 1)
            widths = np.full(len(keys), int(width), np.int64)
        self.send = np.full((cp, len(keys), s_len), -1, np.int32)
        self.send[src, slot, pos] = row
        offsets = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        entry = offsets[:-1][slot] + pos
        self.entry = np.empty(len(order), np.int64)
        self.entry[order] = entry
        self.total = int(offsets[-1])
        self.shifts = tuple(keys)
        self.widths = tuple(int(w) for w in widths)


def slot_code(key: int | tuple[int, int], layout: NodeLayout) -> int:
    """The integer code of a slot's shift: ``dn · local + dl`` for an inter-node slot
    ``(dn, dl)``, the shift itself for an intra-node slot."""
    if isinstance(key, tuple):
        return key[0] * layout.local + key[1]
    return key


def slot_key(
    code: int, layout: NodeLayout, all_slots: Sequence[int | tuple[int, int]]
) -> int | tuple[int, int]:
    """The shift of a slot from its :func:`slot_code` (``all_slots`` tells the hop)."""
    if all_slots and isinstance(all_slots[0], tuple):
        return divmod(code, layout.local)
    return code


def relay_width_error(
    need: int, width: int, all_slots: Sequence[int | tuple[int, int]]
) -> NoReturn:
    """Raises the :class:`~magi_jax.planning.capacity.CapacityError` of a block of ``need``
    rows in a hop whose slots hold ``width``."""
    from magi_jax.planning.errors import CapacityError

    hop = "inter-node" if all_slots and isinstance(all_slots[0], tuple) else "intra-node"
    raise CapacityError(
        f"this mask needs {need} rows in one {hop} block of the two-hop "
        f"cast, but its tables hold {width}; build the capacity with a "
        "larger cast_width (inter-node blocks) or remote_kv (intra-node "
        "blocks), or use hierarchical=False"
    )


# ---- NumPy models (the meaning of the tables; used by tests) ---------------------------------


def _hop(src_rows: list, send: np.ndarray, widths, dest, cp: int):
    """One hop: rank ``r`` sends ``src_rows[r][send[r, j, :w_j]]`` (zero rows for padding)
    to ``dest(r, j)``; returns each rank's received blocks packed at the widths."""
    got = [[None] * len(widths) for _ in range(cp)]
    for r in range(cp):
        for j, w in enumerate(widths):
            idx = send[r, j, :w]
            block = np.zeros((w,) + src_rows[r].shape[1:], src_rows[r].dtype)
            block[idx >= 0] = src_rows[r][idx[idx >= 0]]
            got[dest(r, j)][j] = block
    trail = src_rows[0].shape[1:]
    return [np.concatenate(g) if g else np.zeros((0,) + trail, src_rows[0].dtype) for g in got]


def _unhop(dst: np.ndarray, src: np.ndarray, send: np.ndarray, widths, dest, start: int):
    """Adjoint of one hop: the row rank ``dest(r, j)`` received in block ``j`` (``src``, its
    blocks packed at the widths from row ``start``) added back at its entry of ``dst[r]``."""
    off = start + np.concatenate([[0], np.cumsum(widths)]).astype(int)
    for r in range(len(dst)):
        for j, w in enumerate(widths):
            peer = dest(r, j)
            for p in range(w):
                e = send[r, j, p]
                if e >= 0:
                    dst[r, e] += src[peer, off[j] + p]


def _dests(rt: RelayTable):
    lay = rt.layout

    def inter(r, j):
        dn, dl = rt.inter_shifts[j]
        return ((r // lay.local + dn) % lay.nodes) * lay.local + (r % lay.local + dl) % lay.local

    def intra(r, j):
        return (r // lay.local) * lay.local + (r % lay.local + rt.intra_shifts[j]) % lay.local

    return inter, intra


def relay_cast_model(x: np.ndarray, rt: RelayTable) -> np.ndarray:
    """``x [cp, T, ...]`` -> ``[cp, B, ...]`` by the two hops of the tables, literally."""
    inter, intra = _dests(rt)
    relay = _hop(list(x), rt.inter_send, rt.inter_widths, inter, rt.cp)
    x2 = [np.concatenate([relay[r], x[r]]) for r in range(rt.cp)]
    fwd = _hop(x2, rt.intra_send, rt.intra_widths, intra, rt.cp)
    out = np.zeros((rt.cp, rt.buffer_len) + x.shape[2:], x.dtype)
    for r in range(rt.cp):
        got = np.concatenate([relay[r], fwd[r]])
        ok = rt.recv_index[r] >= 0
        out[r, ok] = got[rt.recv_index[r, ok]]
    return out


def relay_reduce_model(y: np.ndarray, rt: RelayTable, num_rows: int) -> np.ndarray:
    """Adjoint of :func:`relay_cast_model` (``y [cp, B, ...]`` -> ``[cp, num_rows, ...]``,
    float64), hop by hop in reverse: buffer rows back to their entries, the intra-node
    blocks summed at their senders, then the relay rows back across the node boundary."""
    inter, intra = _dests(rt)
    cp, trail = rt.cp, y.shape[2:]
    r_len, w2 = rt.relay_rows, int(sum(rt.intra_widths))
    got = np.zeros((cp, r_len + w2) + trail)
    for r in range(cp):
        for b, e in enumerate(rt.recv_index[r]):
            if e >= 0:
                got[r, e] += y[r, b]
    x2 = np.zeros((cp, r_len + num_rows) + trail)
    x2[:, :r_len] = got[:, :r_len]
    _unhop(x2, got, rt.intra_send, rt.intra_widths, intra, r_len)
    out = x2[:, r_len:].copy()
    _unhop(out, x2, rt.inter_send, rt.inter_widths, inter, 0)
    return out
