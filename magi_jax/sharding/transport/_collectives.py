"""Group collectives: ``group_cast`` (send each needed KV token once to every rank that needs
it) and its adjoint ``group_reduce`` (sum the partial gradients back to the owners, float32).

The contract every transport implements
=======================================
A cast is described by static int32 tables (built on the host,
:func:`magi_jax.planning.cast_table.build_cast_table`) and static metadata (:class:`CastSpec`).
Seen from one rank ``r`` (under ``shard_map`` the stacked ``[cp, ...]`` tables are sharded so
each rank sees its own row):

- ``send_index [n_slots, S]``: slot ``j`` is a block of up to ``S`` rows of the local input
  sent to rank ``(r + shifts[j]) % cp``; entry = local row, ``-1`` = padding (sends zeros).
  Entries are left-packed: only the first ``widths[j]`` columns of slot ``j`` can be real on
  any rank, so a transport may send just those.
- ``recv_index [B]``: output row ``b`` of the cast is entry ``recv_index[b]`` of the received
  blocks flattened as ``[n_slots · S]``, where block ``j`` came from rank
  ``(r - shifts[j]) % cp``; ``-1`` = padding (the row is zero).

So ``out[b] = x_src[send_index_src[j, p]]`` with ``recv_index[b] = j·S + p``.

Keys store and ship the tables as runs (:class:`CastRuns`, :class:`RelayRuns`: rows
``(first value, length)``, value ``-1`` for padding; a few hundred per rank where the tables
hold a row per token): every collective expands them here, inside the traced step, into
exactly the tables above (:func:`~magi_jax.ffa.ragged.expand_index_runs`, O(rows)) right
before it reads them. Shifts (not absolute ranks) index the slots so that one SPMD program
serves every rank. ``group_reduce``
is the exact transpose: rows of the buffer go back to their received slot, the blocks go
back (shift ``-shifts[j]``), and are summed (float32) into the owner's rows. Both directions
move data by gathers through inverted tables (a scatter of int32 positions), never by a
scatter of the data itself, while the slots are few.

Transports: ``"ppermute"`` (one ``lax.ppermute`` per slot, sending only its ``width``
columns; partly overlappable with compute on GPU,
benchmarks/results/overlap/LATEST.md; :class:`CastSpec`'s ``gating="pair"`` moves each
sender-receiver pair's own rows instead, :mod:`magi_jax.sharding.transport._pair`) and
``"all_to_all"`` (one padded ``lax.all_to_all``; fewer launches when nearly every pair
talks). ``ragged_all_to_all`` is not used: ~100x slower than the link on H200 and
unsupported on CPU. ``"native"``: the
C++ XLA FFI custom calls of :mod:`magi_jax.sharding.native` (NVSHMEM on GPU, a rendezvous of
the host devices on CPU) take the same tables and replace the whole gather/exchange/scatter.

Two-hop casts (a :class:`RelaySpec` in place of the :class:`CastSpec`, on a mesh of nodes):
tables of their own (:mod:`magi_jax.planning.relay_table`, which states their contract) move
each row across nodes once, to a relay in the receiving node, then inside the node; the
reduce runs the two hops backwards, summing inside the node before the one inter-node send.
Both hops are ``lax.ppermute``s, one per slot.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.ffa.ragged import expand_index_runs
from magi_jax.planning import GATINGS, PAIR_CAST_LEVELS
from magi_jax.sharding.transport import native
from magi_jax.sharding.transport._all_to_all import exchange
from magi_jax.sharding.transport._gather import acc_dtype, inverse, take
from magi_jax.sharding.transport._pair import pair_counts, pair_gated_ppermute, staircase_ppermute
from magi_jax.sharding.transport._relay import relay_cast, relay_reduce
from magi_jax.sharding.transport._slot import gated_ppermute, slot_live, slot_perm

TRANSPORTS = ("ppermute", "all_to_all", "native")
# The name the device expansion had here before, for one release.
expand_runs = expand_index_runs


# An array [T, ...] or a pytree of them (e.g. (k, v): one collective carries all).
PyTree = Any


class CastArrays(NamedTuple):
    """Device view of one rank's tables: ``send_index [n_slots, S]``, ``recv_index [B]``
    (with a leading ``cp`` axis before sharding)."""

    send_index: jax.Array | np.ndarray
    recv_index: jax.Array | np.ndarray


class CastRuns(NamedTuple):
    """What a key stores of one rank's tables: ``send_runs [Rs, 2]`` and ``recv_runs
    [Rr, 2]``, int32 rows ``(first value, length)``
    (:class:`~magi_jax.planning.cast_table.CastTable`), expanded to :class:`CastArrays` by
    :func:`expand_tables` with the :class:`CastSpec`'s ``slot_len`` and ``buffer_len`` (with
    a leading ``cp`` axis before sharding)."""

    send_runs: jax.Array | np.ndarray
    recv_runs: jax.Array | np.ndarray


@dataclasses.dataclass(frozen=True)
class CastSpec:
    """Static part of a cast: mesh axis, its size, slot shifts/widths and the transport.
    ``runs``: for the native transport, the contiguous runs of every rank's receive table
    (:func:`magi_jax.sharding.native.reduce_runs`), with which its reduce can be started
    (:func:`magi_jax.sharding.native.group_reduce_start`); ``None`` if unknown or too many.
    ``slot_len``, ``buffer_len``: ``S`` and ``B`` of the tables, to expand :class:`CastRuns`
    (0: the tables come as :class:`CastArrays`). ``pieces``: the ``ppermute`` transport cuts
    each slot into that many gated pieces and moves only those some rank fills
    (:func:`gated_ppermute`; keys at a capacity, whose slots are as wide as the capacity
    allows); 1: every slot moves whole. ``gating``: on the ``ppermute`` transport,
    ``"slot"`` (a slot moves as many rows from every rank as its fullest rank needs) or
    ``"pair"`` (each sender-receiver pair its own rows, :mod:`magi_jax.sharding.transport._pair`):
    with ``pieces = 1`` the static ``pair_rows`` (per slot, the rows each rank sends in it:
    a key of one mask) move in at most
    :data:`~magi_jax.planning.cost_model.PAIR_CAST_LEVELS` ``ppermute`` levels a slot, exactly;
    with ``pieces > 1`` each pair moves its own gated pieces, read on the device."""

    axis_name: str
    cp: int
    shifts: tuple[int, ...]
    widths: tuple[int, ...]
    transport: str = "ppermute"
    runs: tuple | None = None
    slot_len: int = 0
    buffer_len: int = 0
    pieces: int = 1
    gating: str = "slot"
    pair_rows: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {TRANSPORTS}")
        if not isinstance(self.pieces, int) or self.pieces < 1:
            raise ValueError(f"pieces={self.pieces!r} must be a positive integer")
        if len(self.shifts) != len(self.widths):
            raise ValueError("shifts and widths must have one entry per slot")
        if self.gating not in GATINGS:
            raise ValueError(f"gating={self.gating!r} is not one of {GATINGS}")
        if self.gating == "pair" and self.transport != "ppermute":
            raise ValueError(
                f"gating='pair' is for the ppermute transport; got transport="
                f"{self.transport!r}: use gating='slot'"
            )
        static = self.gating == "pair" and self.pieces == 1
        if static != (self.pair_rows is not None):
            raise ValueError(
                "pair_rows (the static rows of each pair) go with gating='pair' and pieces=1, "
                f"and only there; got gating={self.gating!r}, pieces={self.pieces}, "
                f"pair_rows {'given' if self.pair_rows is not None else 'None'}"
            )
        if static and (
            len(self.pair_rows) != len(self.shifts)
            or any(
                len(c) != self.cp or max(c, default=0) > w
                for c, w in zip(self.pair_rows, self.widths)
            )
        ):
            raise ValueError(
                "pair_rows must hold, per slot, the rows each of the cp ranks sends in it "
                "(never more than the slot's width)"
            )


class RelayArrays(NamedTuple):
    """Device view of one rank's two-hop tables (:mod:`magi_jax.planning.relay_table`):
    ``inter_send [n_inter, S1]``, ``intra_send [n_intra, S2]``, ``recv_index [B]`` (with a
    leading ``cp`` axis before sharding)."""

    inter_send: jax.Array | np.ndarray
    intra_send: jax.Array | np.ndarray
    recv_index: jax.Array | np.ndarray


class RelayRuns(NamedTuple):
    """What a key stores of one rank's two-hop tables: the runs (as in :class:`CastRuns`)
    of ``inter_send``, ``intra_send`` and ``recv_index``, expanded by :func:`expand_tables`
    with the :class:`RelaySpec`'s slot and buffer lengths."""

    inter_runs: jax.Array | np.ndarray
    intra_runs: jax.Array | np.ndarray
    recv_runs: jax.Array | np.ndarray


@dataclasses.dataclass(frozen=True)
class RelaySpec:
    """Static part of a two-hop cast on a mesh of nodes: the mesh axes ``(node, local)``
    (the cp axis is their flattening), their sizes, the slots' shifts and widths of both
    hops (:class:`~magi_jax.planning.relay_table.RelayTable`). Both hops move by
    ``lax.ppermute``, one per slot: the inter-node hop over both axes, the intra-node hop
    over ``local`` alone. ``group_cast`` / ``group_reduce`` take it in place of a
    :class:`CastSpec`. ``inter_slot_len``, ``intra_slot_len``, ``buffer_len``: ``S1``,
    ``S2`` and ``B`` of the tables, to expand :class:`RelayRuns`. ``pieces``: both hops'
    slots cut into gated pieces, as :class:`CastSpec`'s."""

    axes: tuple[str, str]
    nodes: int
    local: int
    inter_shifts: tuple[tuple[int, int], ...]
    inter_widths: tuple[int, ...]
    intra_shifts: tuple[int, ...]
    intra_widths: tuple[int, ...]
    transport: str = "relay"
    inter_slot_len: int = 0
    intra_slot_len: int = 0
    buffer_len: int = 0
    pieces: int = 1
    runs = None

    def __post_init__(self):
        if len(self.axes) != 2:
            raise ValueError(f"axes={self.axes!r} must name the (node, local) mesh axes")
        if len(self.inter_shifts) != len(self.inter_widths) or len(self.intra_shifts) != len(
            self.intra_widths
        ):
            raise ValueError("shifts and widths must have one entry per slot")

    @property
    def cp(self) -> int:
        return self.nodes * self.local

    @property
    def shifts(self) -> tuple:
        """Every slot of both hops (empty: the cast moves nothing)."""
        return self.inter_shifts + self.intra_shifts


# ---- device code (inside shard_map over spec.axis_name) -------------------------------------


def expand_tables(
    tables: CastArrays | CastRuns | RelayArrays | RelayRuns, spec: CastSpec | RelaySpec
) -> CastArrays | RelayArrays:
    """``tables`` as the collectives read them: :class:`CastRuns` -> :class:`CastArrays`,
    :class:`RelayRuns` -> :class:`RelayArrays` (the expansion is exact: the same int32
    tables the host would have built); tables already expanded pass through."""
    if isinstance(tables, CastRuns):
        n, s = len(spec.shifts), spec.slot_len
        return CastArrays(
            expand_index_runs(tables.send_runs, n * s).reshape(n, s),
            expand_index_runs(tables.recv_runs, spec.buffer_len),
        )
    if isinstance(tables, RelayRuns):
        n1, s1 = len(spec.inter_shifts), spec.inter_slot_len
        n2, s2 = len(spec.intra_shifts), spec.intra_slot_len
        return RelayArrays(
            expand_index_runs(tables.inter_runs, n1 * s1).reshape(n1, s1),
            expand_index_runs(tables.intra_runs, n2 * s2).reshape(n2, s2),
            expand_index_runs(tables.recv_runs, spec.buffer_len),
        )
    return tables


def _slot_mover(send, spec: CastSpec, reverse: bool) -> Callable[[int, tuple], tuple]:
    """``move(j, rows)``: slot ``j``'s block ``rows`` (a tuple of ``[w_j, ...]``) sent to
    ``r + shifts[j]`` (back to ``r - shifts[j]`` when ``reverse``) on the ``ppermute``
    transport as ``spec`` gates it: whole or in gated pieces (:func:`gated_ppermute`,
    gating ``"slot"``), or pair by pair (:mod:`magi_jax.sharding.transport._pair`)."""
    axis, cp = spec.axis_name, spec.cp
    if spec.gating == "pair" and spec.pieces == 1:
        return lambda j, rows: staircase_ppermute(
            rows, axis, cp, spec.shifts[j], spec.pair_rows[j], PAIR_CAST_LEVELS, reverse
        )
    if spec.gating == "pair":
        counts = pair_counts(send, axis)
        return lambda j, rows: pair_gated_ppermute(
            rows, axis, cp, spec.shifts[j], counts[:, j], spec.pieces, reverse
        )
    live = slot_live(send, axis) if spec.pieces > 1 else [None] * len(spec.shifts)
    return lambda j, rows: gated_ppermute(
        rows, axis, slot_perm(spec, spec.shifts[j], reverse), live[j], spec.pieces
    )


def _packed_entry(recv, spec: CastSpec, s: int):
    """``recv`` entries ``j·S + p`` re-expressed in the received blocks packed back to back
    at their widths (``offset_j + p``; ``p < widths[j]`` always); padding -> one past the end."""
    offsets = np.concatenate([[0], np.cumsum(spec.widths)]).astype(np.int32)
    j, p = recv // s, recv % s
    packed = jnp.asarray(offsets[:-1])[jnp.clip(j, 0, len(spec.widths) - 1)] + p
    return jnp.where(recv < 0, int(offsets[-1]), packed)


def _native(fn, leaves, *args):
    """The native transport on several arrays at once: the arrays of one dtype move in one
    collective (their rows side by side, no concatenated copy; at most
    ``native.MAX_ARRAYS`` per call)."""
    got = [None] * len(leaves)
    by_dtype = {}
    for i, a in enumerate(leaves):
        by_dtype.setdefault(jnp.dtype(a.dtype), []).append(i)
    for idx in by_dtype.values():
        for c in range(0, len(idx), native.MAX_ARRAYS):
            part = idx[c : c + native.MAX_ARRAYS]
            for i, g in zip(part, fn([leaves[i] for i in part], *args)):
                got[i] = g
    return got


@jax.named_scope("group_cast")
def cast_rows(x: PyTree, tables: CastArrays, spec: CastSpec, prefix: bool = False) -> PyTree:
    """``x``: an array ``[T, ...]`` or a pytree of them (e.g. ``(k, v)``: one collective
    carries all, with no concatenated copy). ``prefix``: ``[x; cast(x)]`` per array (the
    native transport writes it in one pass, the others concatenate)."""
    leaves, tree = jax.tree.flatten(x)
    tables = expand_tables(tables, spec)
    if spec.transport == "native" and spec.shifts:
        return tree.unflatten(
            _native(functools.partial(native.group_cast, prefix=prefix), leaves, tables, spec)
        )
    if prefix:
        got = jax.tree.leaves(cast_rows(x, tables, spec))
        return tree.unflatten([jnp.concatenate([a, g]) for a, g in zip(leaves, got)])
    if isinstance(spec, RelaySpec):
        return tree.unflatten(relay_cast(leaves, tables, spec))
    send, recv = tables
    buf = recv.shape[0]
    if not spec.shifts:
        return tree.unflatten([jnp.zeros((buf,) + a.shape[1:], a.dtype) for a in leaves])
    n, s = send.shape
    idx = jnp.where(send < 0, leaves[0].shape[0], send)
    if spec.transport == "ppermute":
        # One ppermute per slot carrying only its real width (gated pieces of it at a
        # capacity), or its pairs each moving their own rows; received blocks stay packed.
        move = _slot_mover(send, spec, reverse=False)
        blocks = [
            move(j, tuple(take(a, idx[j, :w]) for a in leaves)) for j, w in enumerate(spec.widths)
        ]
        entry = _packed_entry(recv, spec, s)
        return tree.unflatten(
            [take(jnp.concatenate([blk[i] for blk in blocks]), entry) for i in range(len(leaves))]
        )
    entry = jnp.where(recv < 0, n * s, recv)
    return tree.unflatten(
        [
            take(exchange(take(a, idx), spec, reverse=False).reshape((n * s,) + a.shape[1:]), entry)
            for a in leaves
        ]
    )


# Gathers (one per slot, each over all owner rows) replace the float32 scatter-add of the
# reduce while the slots are few; with many slots the scatter-add does less work.
_GATHER_MAX_SLOTS = 4


@jax.named_scope("group_reduce")
def reduce_rows(
    y: PyTree,
    tables: CastArrays,
    spec: CastSpec,
    num_rows: int,
    prefix: bool = False,
    round_to_input: bool = False,
) -> PyTree:
    """``y``: an array ``[B, ...]`` or a pytree of them; sums in float32 (float64 for
    float64) -> the same structure of ``[num_rows, ...]``. ``prefix``: each array is
    ``[num_rows + B, ...]``, the owner's own rows first, added to the sums (the adjoint of
    ``cast_rows(prefix=True)``). ``round_to_input``: the sums rounded once to y's dtype (else
    float32 / float64)."""
    leaves, tree = jax.tree.flatten(y)
    tables = expand_tables(tables, spec)
    if spec.transport == "native" and spec.shifts:
        fn = functools.partial(
            native.group_reduce,
            prefix=prefix,
            out_dtype=leaves[0].dtype if round_to_input else None,
        )
        return tree.unflatten(_native(fn, leaves, tables, spec, num_rows))
    if prefix or round_to_input:
        bufs = [a[num_rows:] for a in leaves] if prefix else leaves
        got = jax.tree.leaves(reduce_rows(tree.unflatten(bufs), tables, spec, num_rows))
        if prefix:
            got = [g + a[:num_rows].astype(g.dtype) for g, a in zip(got, leaves)]
        return tree.unflatten(
            [g.astype(a.dtype) if round_to_input else g for g, a in zip(got, leaves)]
        )
    if isinstance(spec, RelaySpec):
        return tree.unflatten(relay_reduce(leaves, tables, spec, num_rows))
    send, recv = tables
    if not spec.shifts:
        return tree.unflatten(
            [jnp.zeros((num_rows,) + a.shape[1:], acc_dtype(a.dtype)) for a in leaves]
        )
    n, s = send.shape
    b = leaves[0].shape[0]
    # Buffer rows back into their slot entries: recv is injective, so a gather by its inverse.
    inv_recv = inverse(recv, n * s, b)
    if spec.transport == "ppermute":
        # The cast's slots backwards, gated alike (its entries past the cast's live rows
        # are read by no buffer row: zeros).
        move = _slot_mover(send, spec, reverse=True)
        back = [
            move(
                j,
                tuple(
                    take(a, inv_recv[j * s : j * s + w]).astype(acc_dtype(a.dtype)) for a in leaves
                ),
            )
            for j, w in enumerate(spec.widths)
        ]
    else:
        got = [
            exchange(
                take(a, inv_recv).astype(acc_dtype(a.dtype)).reshape((n, s) + a.shape[1:]),
                spec,
                reverse=True,
            )
            for a in leaves
        ]
        back = [tuple(g[j] for g in got) for j in range(n)]
    widths = [blk[0].shape[0] for blk in back]
    if n <= _GATHER_MAX_SLOTS:
        # Within a slot every owner row appears at most once: sum one gather per slot.
        invs = [inverse(send[j, :w], num_rows, w) for j, w in enumerate(widths)]
        return tree.unflatten(
            [sum(take(blk[i], inv) for blk, inv in zip(back, invs)) for i in range(len(leaves))]
        )
    idx = jnp.concatenate(
        [jnp.where(send[j, :w] < 0, num_rows, send[j, :w]) for j, w in enumerate(widths)]
    )
    return tree.unflatten(
        [
            jnp.zeros((num_rows,) + a.shape[1:], acc_dtype(a.dtype))
            .at[idx]
            .add(jnp.concatenate([blk[i] for blk in back]), mode="drop")
            for i, a in enumerate(leaves)
        ]
    )


@jax.named_scope("group_reduce_start")
def start_reduce_rows(
    y: PyTree,
    tables: CastArrays,
    spec: CastSpec,
    num_rows: int,
    own: PyTree | None = None,
    round_to_input: bool = False,
) -> tuple[jax.Array, Callable[[jax.Array], PyTree]]:
    """:func:`reduce_rows` started (:func:`magi_jax.sharding.native.group_reduce_start`;
    call it where ``spec``'s transport is native and
    :func:`magi_jax.sharding.native.can_start_reduce`): ``(token, done)`` with
    ``done(token)`` giving ``reduce_rows``'s result. ``own``: the owner's
    own rows, y's structure of ``[num_rows, ...]`` arrays, added to the sums (``reduce_rows``'s
    prefix, apart: with ``round_to_input`` the sums are written into them in place)."""
    leaves, tree = jax.tree.flatten(y)
    token, done = native.group_reduce_start(
        leaves,
        expand_tables(tables, spec),
        spec,
        num_rows,
        own=None if own is None else tree.flatten_up_to(own),
        out_dtype=leaves[0].dtype if round_to_input else None,
    )
    return token, lambda t: tree.unflatten(done(t))


def _carrier(x):
    """Zero-size stand-ins remembering each leaf's rows and dtype for a backward."""
    return jax.tree.map(lambda a: jnp.zeros((a.shape[0], 0), a.dtype), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def group_cast(x: PyTree, tables: CastArrays, spec: CastSpec, prefix: bool = False) -> PyTree:
    """Rows of the local ``x [T, ...]`` (or of every array of a pytree, e.g. ``(k, v)``) to
    the ranks that need them -> ``[B, ...]`` (x's dtype); with ``prefix``, ``[x; those rows]``
    (``[T + B, ...]``: a stage's local KV followed by its fetched KV). Call inside
    ``shard_map`` over ``spec.axis_name``. Its VJP is :func:`group_reduce` (float32 sums,
    rounded once to x's dtype)."""
    return cast_rows(x, tables, spec, prefix)


def _cast_fwd(x, tables, spec, prefix):
    return cast_rows(x, tables, spec, prefix), (tables, _carrier(x))


def _cast_bwd(spec, prefix, res, ct):
    tables, carrier = res
    rows = jax.tree.leaves(carrier)[0].shape[0]
    dx = jax.tree.map(
        lambda d, c: d.astype(c.dtype),
        reduce_rows(ct, tables, spec, rows, prefix, round_to_input=True),
        carrier,
    )
    return dx, jax.tree.map(lambda _: None, tables)


group_cast.defvjp(_cast_fwd, _cast_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def group_reduce(y: PyTree, tables: CastArrays, spec: CastSpec, num_rows: int) -> PyTree:
    """Adjoint of :func:`group_cast`: buffer rows ``y [B, ...]`` (or a pytree of such
    arrays) summed (float32; float64 for float64 input) into their owners' rows ->
    ``[num_rows, ...]``. Its VJP is :func:`group_cast`."""
    return reduce_rows(y, tables, spec, num_rows)


def _reduce_fwd(y, tables, spec, num_rows):
    return reduce_rows(y, tables, spec, num_rows), (tables, _carrier(y))


def _reduce_bwd(spec, num_rows, res, ct):
    tables, carrier = res
    back = cast_rows(ct, tables, spec)
    return (
        jax.tree.map(lambda d, c: d.astype(c.dtype), back, carrier),
        jax.tree.map(lambda _: None, tables),
    )


group_reduce.defvjp(_reduce_fwd, _reduce_bwd)
