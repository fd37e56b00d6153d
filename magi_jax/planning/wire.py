"""What the casts of a plan put on the wire (host NumPy, no JAX): real rows against the rows a
transport really moves, padding included, per rank, per hop (inside a node, between nodes)
and per transport.

A plan asks for *real rows*: every KV row some rank's queries need, sent once from its owner
to that rank (:class:`~magi_jax.planning.cast_table.CastTable`). A transport moves *wire
rows*, the real ones and the padding its fixed shapes carry:

- ``"ppermute"``: one ``lax.ppermute`` per slot; every rank sends the slot's whole width
  (:attr:`CastTable.widths`) to its partner, whatever it really has for it (gating
  ``"slot"``, the slot cut into gated pieces at a capacity: the pieces its fullest rank
  fills). Gating ``"pair"`` follows each (sender, receiver) pair instead: a key of one mask
  moves each pair's exact rows in a few ``ppermute`` levels per slot (:func:`pair_levels`,
  the rows rounded up to a level), a key at a capacity each pair's own gated pieces
  (:func:`pair_rows_moved`);
- ``"all_to_all"``: one padded ``lax.all_to_all``; every rank sends ``slot_len`` rows to
  every other rank;
- ``"native"``: the FFI transport, which sends exactly the real rows;
- ``"relay"``: the two hops of :class:`~magi_jax.planning.relay_table.RelayTable`, a
  ``ppermute`` per slot of each hop at its width.

Counts are per cast (one direction of one stage's collective); the backward's reduce moves
the same rows back (in float32), and with ``backward_refetch`` the forward's cast runs again.
A rank's *send* is counted (a ``ppermute`` sends and receives as much; the busiest sender
bounds a collective). Ring attention, the baseline every context-parallel scheme is compared
with, sends ``(cp - 1) · local_len`` rows per rank: every rank's whole KV to every other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from magi_jax.planning.cast_table import CastTable, choose_transport

if TYPE_CHECKING:  # annotations only (the planners of these import this module)
    from magi_jax.planning.relay_runs import RelayRunsTable
    from magi_jax.planning.relay_table import RelayTable
    from magi_jax.planning.stages import DistPlan

__all__ = [
    "WIRE_TRANSPORTS",
    "WireCount",
    "cast_wire",
    "relay_wire",
    "plan_wire",
    "ring_rows",
    "piece_len",
    "gated_widths",
    "GATINGS",
    "pair_levels",
    "pair_rows_moved",
    "slot_rows",
]

# How a ppermute slot's wire follows the rows: by its fullest rank, or pair by pair.
GATINGS = ("slot", "pair")

# Transports whose wire this module counts ("auto": choose_transport's pick, as the key's).
WIRE_TRANSPORTS = ("ppermute", "all_to_all", "native", "relay", "auto")


@dataclasses.dataclass(frozen=True)
class WireCount:
    """Rows sent per rank, int64 ``[cp]`` each: ``real_intra`` / ``real_inter`` (rows the
    plan needs moved, to a rank of the sender's node / of another node) and ``wire_intra`` /
    ``wire_inter`` (rows the transport moves, padding included). ``transports``: the
    transport of each cast counted. Counts add (:meth:`__add__`: the stages of a plan)."""

    real_intra: np.ndarray
    real_inter: np.ndarray
    wire_intra: np.ndarray
    wire_inter: np.ndarray
    transports: tuple[str, ...] = ()

    @classmethod
    def zeros(cls, cp: int) -> "WireCount":
        """Nothing to move and nothing moved, on ``cp`` ranks."""
        z = np.zeros(int(cp), np.int64)
        return cls(z, z.copy(), z.copy(), z.copy())

    @property
    def cp(self) -> int:
        return len(self.real_intra)

    @property
    def real(self) -> np.ndarray:
        """int64 ``[cp]``: real rows each rank sends, both hops."""
        return self.real_intra + self.real_inter

    @property
    def wire(self) -> np.ndarray:
        """int64 ``[cp]``: rows each rank's transport sends, both hops."""
        return self.wire_intra + self.wire_inter

    def per_rank_ratio(self) -> float:
        """The busiest rank's wire over the busiest rank's real rows (the bottleneck of a
        collective); 1.0 when nothing is needed and nothing moves, ``inf`` when only
        padding moves."""
        return _ratio(int(self.wire.max(initial=0)), int(self.real.max(initial=0)))

    def total_ratio(self) -> float:
        """Wire rows over real rows, summed over ranks."""
        return _ratio(int(self.wire.sum()), int(self.real.sum()))

    def inter_ratio(self) -> float:
        """Wire rows over real rows between nodes, summed over ranks."""
        return _ratio(int(self.wire_inter.sum()), int(self.real_inter.sum()))

    def __add__(self, other: "WireCount") -> "WireCount":
        return WireCount(
            self.real_intra + other.real_intra,
            self.real_inter + other.real_inter,
            self.wire_intra + other.wire_intra,
            self.wire_inter + other.wire_inter,
            self.transports + other.transports,
        )

    def summary(self) -> dict:
        """Plain numbers (for json): totals and per-rank maxima of each count, the ratios."""
        out = {"transports": list(self.transports)}
        for name in ("real", "wire", "real_intra", "real_inter", "wire_intra", "wire_inter"):
            x = getattr(self, name)
            out[name] = {"total": int(x.sum()), "max_rank": int(x.max(initial=0))}
        out["per_rank_ratio"] = self.per_rank_ratio()
        out["total_ratio"] = self.total_ratio()
        out["inter_ratio"] = self.inter_ratio()
        return out


def _ratio(wire: int, real: int) -> float:
    if real == 0:
        return 1.0 if wire == 0 else float("inf")
    return wire / real


def _nodes(cp: int, local: int | None) -> np.ndarray:
    """int64 ``[cp]``: the node of each rank (``local`` ranks per node, node-major)."""
    local = cp if local is None else int(local)
    if local < 1 or cp % local:
        raise ValueError(f"local={local} must divide cp={cp} (ranks per node)")
    return np.arange(cp) // local


def cast_wire(
    table: CastTable,
    transport: str = "auto",
    local: int | None = None,
    pieces: int = 1,
    gating: str = "slot",
    levels: int | None = None,
) -> WireCount:
    """Real and wire rows of the flat cast ``table`` on ``transport`` (``"ppermute"``,
    ``"all_to_all"``, ``"native"``, or ``"auto"``: :func:`choose_transport`'s pick, as a key
    on the ``xla`` backend makes it). ``local``: ranks per node (node-major ranks; default
    all on one node). ``pieces``: a ``ppermute`` slot cut into that many gated pieces
    (:func:`gated_widths`): only the pieces some rank fills move (``"auto"`` then picks
    ``ppermute``, as a key at a capacity does). ``gating``: ``"slot"`` (a slot moves as
    many rows from every rank as its fullest rank needs) or ``"pair"`` (each pair its own:
    with ``pieces = 1`` the exact rows of a key of one mask in at most ``levels``
    ``ppermute`` levels per slot, :func:`pair_levels`, default
    :data:`~magi_jax.planning.cost_model.PAIR_CAST_LEVELS`; with ``pieces > 1`` each pair's
    gated pieces, :func:`pair_rows_moved`)."""
    if gating not in GATINGS:
        raise ValueError(f"gating={gating!r} is not one of {GATINGS}")
    if transport == "auto":
        transport = choose_transport(table, gated=pieces > 1)
    if transport not in ("ppermute", "all_to_all", "native"):
        raise ValueError(
            f"transport={transport!r} is not a flat cast's: one of 'ppermute', "
            "'all_to_all', 'native', 'auto' (two-hop tables: relay_wire)"
        )
    cp = table.cp
    node = _nodes(cp, local)
    if table.n_slots == 0:
        return dataclasses.replace(WireCount.zeros(cp), transports=(transport,))
    per_slot = slot_rows(table)
    shifts = np.asarray(table.shifts, np.int64)
    inter = node[:, None] != node[(np.arange(cp)[:, None] + shifts[None, :]) % cp]  # [cp, n]
    if transport == "ppermute":
        if gating == "pair":
            wire = pair_rows_moved(per_slot, table.widths, pieces, levels)
        else:
            widths = gated_widths(table.widths, per_slot.max(axis=0), pieces)
            wire = np.broadcast_to(widths[None, :], per_slot.shape)
        wire_intra = np.where(inter, 0, wire).sum(axis=1)
        wire_inter = np.where(inter, wire, 0).sum(axis=1)
    elif transport == "all_to_all":
        # Every rank sends a slot_len block to every other rank.
        others = node[:, None] != node[None, :]
        wire_inter = others.sum(axis=1) * table.slot_len
        wire_intra = (cp - 1 - others.sum(axis=1)) * table.slot_len
    else:
        wire_intra = np.where(inter, 0, per_slot).sum(axis=1)
        wire_inter = np.where(inter, per_slot, 0).sum(axis=1)
    return WireCount(
        np.where(inter, 0, per_slot).sum(axis=1),
        np.where(inter, per_slot, 0).sum(axis=1),
        np.asarray(wire_intra, np.int64),
        np.asarray(wire_inter, np.int64),
        (transport,),
    )


def slot_rows(table: CastTable) -> np.ndarray:
    """int64 ``[cp, n_slots]``: the real rows each rank sends in each slot of ``table``
    (from its runs: slot ``j`` holds entries ``[j·S, (j + 1)·S)``)."""
    runs = table.send_runs.astype(np.int64)
    length = runs[..., 1]
    start = np.cumsum(length, axis=1) - length
    real = (runs[..., 0] >= 0) & (length > 0)
    slot = np.minimum(start // max(table.slot_len, 1), max(table.n_slots - 1, 0))
    per_slot = np.zeros((table.cp, table.n_slots), np.int64)
    rank = np.broadcast_to(np.arange(table.cp)[:, None], length.shape)
    np.add.at(per_slot, (rank[real], slot[real]), length[real])
    return per_slot


def piece_len(width: int, pieces: int) -> int:
    """Rows of one gated piece of a slot ``width`` rows wide cut into ``pieces``."""
    return max(1, -(-int(width) // max(int(pieces), 1)))


def gated_widths(widths: ArrayLike, live: ArrayLike, pieces: int = 1) -> np.ndarray:
    """int64 ``[n_slots]``: rows a gated ``ppermute`` slot moves from every rank: its
    ``live`` rows (the most real rows any rank sends in it) rounded up to whole pieces
    (:func:`piece_len`), never more than its width; ``pieces = 1``: the whole width."""
    widths = np.asarray(widths, np.int64)
    if int(pieces) <= 1:
        return widths
    size = np.array([piece_len(w, pieces) for w in widths], np.int64).reshape(widths.shape)
    return np.minimum(widths, -(-np.asarray(live, np.int64) // size) * size)


def pair_levels(rows: ArrayLike, cap: int) -> tuple[int, ...]:
    """The ``ppermute`` levels of one slot moved pair by pair (a key of one mask):
    ``rows [cp]`` are the rows each rank sends in the slot; level ``i`` moves rows
    ``[levels[i - 1], levels[i])`` of every pair whose rows pass ``levels[i - 1]``, so a pair
    moves its rows rounded up to the next level. The distinct positive counts, or, where
    there are more than ``cap``, the ``cap`` of them (the largest always) that move the
    fewest rows in all (dynamic programming over the sorted counts); ``()`` for an empty
    slot."""
    rows = np.asarray(rows, np.int64)
    vals, cnt = np.unique(rows[rows > 0], return_counts=True)
    m, cap = len(vals), max(int(cap), 1)
    if m <= cap:
        return tuple(int(v) for v in vals)
    # cost[i, j]: extra rows when counts vals[i..j] all round up to vals[j].
    csum = np.concatenate([[0], np.cumsum(cnt * vals)])
    ccnt = np.concatenate([[0], np.cumsum(cnt)])
    cost = np.full((m, m), np.inf)
    for i in range(m):
        for j in range(i, m):
            cost[i, j] = vals[j] * (ccnt[j + 1] - ccnt[i]) - (csum[j + 1] - csum[i])
    # best[k, j]: least extra covering vals[0..j] with k + 1 levels, the last vals[j].
    best = np.full((cap, m), np.inf)
    back = np.zeros((cap, m), np.int64)
    best[0] = cost[0]
    for k in range(1, cap):
        for j in range(m):
            for i in range(j):  # previous level vals[i], this one covers vals[i+1..j]
                c = best[k - 1, i] + cost[i + 1, j]
                if c < best[k, j]:
                    best[k, j], back[k, j] = c, i
    k, j, out = cap - 1, m - 1, []
    while True:
        out.append(int(vals[j]))
        if k == 0:
            break
        j, k = int(back[k, j]), k - 1
    return tuple(reversed(out))


def pair_rows_moved(
    per_slot: ArrayLike, widths: ArrayLike, pieces: int = 1, levels: int | None = None
) -> np.ndarray:
    """int64 ``[cp, n_slots]``: rows each rank sends in each slot of a cast moved pair by
    pair, given the real rows ``per_slot [cp, n_slots]``. ``pieces = 1`` (a key of one
    mask): each pair's rows rounded up to the slot's next level (:func:`pair_levels`, at
    most ``levels`` a slot; default :data:`~magi_jax.planning.cost_model.PAIR_CAST_LEVELS`).
    ``pieces > 1`` (a key at a capacity): each pair's rows rounded up to whole pieces of
    :func:`piece_len` rows; a pair that fills its last piece moves the whole piece (up to
    ``piece_len - 1`` rows past the slot's width: the pieces move in power-of-two runs of a
    block padded to whole pieces)."""
    per_slot = np.asarray(per_slot, np.int64)
    if int(pieces) > 1:
        size = np.array([piece_len(w, pieces) for w in widths], np.int64).reshape(1, -1)
        return -(-per_slot // size) * size
    out = np.zeros_like(per_slot)
    if levels is None:
        from magi_jax.planning.cost_model import PAIR_CAST_LEVELS as levels
    for j in range(per_slot.shape[1]):
        lv = np.asarray(pair_levels(per_slot[:, j], levels) or (0,), np.int64)
        out[:, j] = np.where(per_slot[:, j] > 0, lv[np.searchsorted(lv, per_slot[:, j])], 0)
    return out


def relay_wire(rt: RelayTable | RelayRunsTable, pieces: int = 1) -> WireCount:
    """Real and wire rows of two-hop tables ``rt``
    (:class:`~magi_jax.planning.relay_table.RelayTable`, or
    :class:`~magi_jax.planning.relay_runs.RelayRunsTable`): the inter-node hop's rows count
    between nodes, the intra-node hop's inside them; each hop's ``ppermute`` per slot sends
    the slot's width from every rank (``pieces``: its gated pieces, :func:`gated_widths`)."""
    cp = rt.cp
    if hasattr(rt, "inter_runs"):
        inter_real, intra_real = rt.inter_rows(), rt.intra_rows()
        live1, live2 = rt.slot_live()
    else:
        inter_real = (rt.inter_send >= 0).sum(axis=(1, 2)).astype(np.int64)
        intra_real = (rt.intra_send >= 0).sum(axis=(1, 2)).astype(np.int64)
        live1 = (rt.inter_send >= 0).sum(axis=2).max(axis=0, initial=0)
        live2 = (rt.intra_send >= 0).sum(axis=2).max(axis=0, initial=0)
    return WireCount(
        intra_real,
        inter_real,
        np.full(cp, gated_widths(rt.intra_widths, live2, pieces).sum(), np.int64),
        np.full(cp, gated_widths(rt.inter_widths, live1, pieces).sum(), np.int64),
        ("relay",),
    )


def plan_wire(
    plan: DistPlan,
    transport: str | Sequence[str] = "auto",
    local: int | None = None,
    relays: Sequence[RelayTable | RelayRunsTable | None] | None = None,
    pieces: int = 1,
    gating: str = "slot",
    levels: int | None = None,
) -> WireCount:
    """The casts of every stage of ``plan``
    (:class:`~magi_jax.planning.stages.DistPlan`) summed: one cast per remote stage, on
    ``transport`` (one name for every stage, or a sequence with one per remote stage, as a
    key's stages hold them; ``"auto"``: :func:`choose_transport` per stage). ``relays``:
    the stages' :class:`~magi_jax.planning.relay_table.RelayTable` (``None`` where the stage
    stays flat), counted in place of their flat cast. ``local``: ranks per node;
    ``pieces``, ``gating``, ``levels``: how ``ppermute`` slots move (:func:`cast_wire`;
    two-hop casts are gated by slot)."""
    casts = [st.cast for st in plan.stages if st.cast is not None]
    names = [transport] * len(casts) if isinstance(transport, str) else list(transport)
    relays = [None] * len(casts) if relays is None else list(relays)
    if len(names) != len(casts) or len(relays) != len(casts):
        raise ValueError(
            f"the plan has {len(casts)} casts; transport and relays need one entry each "
            f"(got {len(names)} and {len(relays)})"
        )
    total = WireCount.zeros(plan.cp)
    for table, name, rt in zip(casts, names, relays):
        total = total + (
            cast_wire(table, name, local, pieces, gating, levels)
            if rt is None
            else relay_wire(rt, pieces)
        )
    return total


def ring_rows(cp: int, local_len: int) -> int:
    """Rows ring attention sends per rank and step: its whole KV to every other rank."""
    return (int(cp) - 1) * int(local_len)
