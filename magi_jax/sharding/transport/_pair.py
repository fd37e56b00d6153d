"""The ``ppermute`` transport pair by pair: one slot of a cast (a shift ``s`` of the ranks,
rank ``r`` sending to ``(r + s) % cp``; :mod:`magi_jax.sharding.transport` states the
contract) moved so that each (sender, receiver) pair's wire follows its own rows, rather than
the slot's fullest rank's.

- :func:`staircase_ppermute` (a key of one mask, whose rows per pair are static): the slot's
  distinct row counts, merged into a few levels (:func:`~magi_jax.planning.wire.pair_levels`),
  are its steps; one ``lax.ppermute`` per level over only the pairs that reach it carries the
  rows between the previous level and this one. No conditional; the wire is each pair's rows
  rounded up to its level.
- :func:`pair_gated_ppermute` (a key at a capacity, whose rows per pair are known on the
  device only): the slot cut into pieces; each pair moves its own pieces in power-of-two runs,
  one ``lax.cond`` per run, whose predicate every rank reads from the same gathered counts
  (:func:`pair_counts`). ``ceil(log2(pieces + 1))`` conditionals per pair: ``cp · (cp − 1)``
  pairs per cast.

Both take a slot's block ``[w, ...]`` (the sender's rows, left-packed: rows past a pair's
count are zero) and return the receiver's ``[w, ...]``, exactly what one ``lax.ppermute`` of
the whole block would deliver at every row the receive table reads; ``reverse`` runs the
pairs backwards (the reduce: the receiver's rows go back to their sender).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.planning import pair_levels, piece_len


def _pairs(cp: int, shift: int, senders, reverse: bool) -> list[tuple[int, int]]:
    """``(source, target)`` of the pairs of ``senders`` on the slot of ``shift``; reversed:
    from the receiver back to the sender."""
    pairs = [(r, (r + shift) % cp) for r in senders]
    return [(t, r) for r, t in pairs] if reverse else pairs


def staircase_ppermute(
    rows: tuple,
    axis_name: str | tuple[str, ...],
    cp: int,
    shift: int,
    counts: Sequence[int],
    levels: int,
    reverse: bool = False,
) -> tuple:
    """One slot of equally long ``rows [w, ...]`` moved level by level: ``counts [cp]`` are the
    rows each rank sends in the slot (static), ``levels`` the most ``ppermute`` s it takes
    (:func:`~magi_jax.planning.wire.pair_levels`). Level ``i`` moves rows
    ``[L[i - 1], L[i])`` from the ranks whose count passes ``L[i - 1]`` (the others' partners
    receive zeros); the levels, concatenated and padded with zeros to ``w``, are the received
    block."""
    w = rows[0].shape[0]
    got, lo = [], 0
    for hi in pair_levels(counts, levels):
        senders = [r for r in range(cp) if counts[r] > lo]
        got.append(
            jax.lax.ppermute(
                tuple(a[lo:hi] for a in rows), axis_name, _pairs(cp, shift, senders, reverse)
            )
        )
        lo = hi
    return tuple(
        jnp.concatenate([g[i] for g in got] + [jnp.zeros((w - lo,) + a.shape[1:], a.dtype)])
        for i, a in enumerate(rows)
    )


def pair_counts(send: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """int32 ``[cp, n_slots]``: the real rows every rank sends in each slot of its send table
    ``send [n_slots, S]`` (left-packed), gathered over the axis: the same on every rank, so
    that every rank takes the same branch of each pair's conditionals."""
    return jax.lax.all_gather(jnp.sum(send >= 0, axis=1, dtype=jnp.int32), axis_name)


def pair_gated_ppermute(
    rows: tuple,
    axis_name: str | tuple[str, ...],
    cp: int,
    shift: int,
    counts: jax.Array,
    pieces: int,
    reverse: bool = False,
) -> tuple:
    """One slot of equally long ``rows [w, ...]`` moved pair by pair in gated pieces of
    :func:`~magi_jax.planning.wire.piece_len` rows: ``counts`` int32 ``[cp]`` (the same on
    every rank, :func:`pair_counts`) are the rows each rank sends in the slot. The pair from
    rank ``r`` moves ``k = ceil(counts[r] / piece)`` pieces as the binary digits of ``k``:
    digit ``b`` set, one ``lax.cond`` whose branch moves ``2**b`` pieces (at the offset the
    higher digits leave) by a ``ppermute`` of that one pair and writes them into the
    receiver's block (the other ranks keep theirs). Rows past a pair's count must be zero on
    its sender; past its pieces the receiver's rows are zero."""
    w = rows[0].shape[0]
    if w == 0:
        return rows
    if len({a.dtype for a in rows}) == 1 and len(rows) > 1:
        # One array of the leaves side by side: one collective per move, not one per leaf.
        flat = jnp.concatenate([a.reshape(w, -1) for a in rows], axis=1)
        (got,) = pair_gated_ppermute((flat,), axis_name, cp, shift, counts, pieces, reverse)
        cuts = np.cumsum([int(np.prod(a.shape[1:])) for a in rows])[:-1]
        return tuple(g.reshape(a.shape) for g, a in zip(jnp.split(got, cuts, axis=1), rows))
    size = piece_len(w, pieces)
    n = -(-w // size)  # pieces in the slot; the block is padded to whole pieces
    pad = n * size - w
    src = tuple(jnp.concatenate([a, jnp.zeros((pad,) + a.shape[1:], a.dtype)]) for a in rows)
    me = jax.lax.axis_index(axis_name)
    k = jnp.clip((counts + size - 1) // size, 0, n)
    out = tuple(jnp.zeros_like(a) for a in src)
    for r in range(cp):
        ((a, b),) = _pairs(cp, shift, [r], reverse)
        for bit in reversed(range(n.bit_length())):
            length = (1 << bit) * size
            start = ((k[r] >> (bit + 1)) << (bit + 1)) * size

            def move(out, start=start, length=length, a=a, b=b):
                chunk = tuple(jax.lax.dynamic_slice_in_dim(s, start, length) for s in src)
                got = jax.lax.ppermute(chunk, axis_name, [(a, b)])
                return tuple(
                    jax.lax.dynamic_update_slice_in_dim(
                        o,
                        jnp.where(me == b, g, jax.lax.dynamic_slice_in_dim(o, start, length)),
                        start,
                        0,
                    )
                    for o, g in zip(out, got)
                )

            out = jax.lax.cond(((k[r] >> bit) & 1) == 1, move, lambda out: out, out)
    return tuple(o[:w] for o in out)
