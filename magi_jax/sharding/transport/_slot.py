"""The ``ppermute`` transport slot by slot: one ``lax.ppermute`` per slot of a cast, sending
only the slot's real width, whole or in gated pieces of it at a capacity."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from magi_jax.planning import piece_len

if TYPE_CHECKING:
    from magi_jax.sharding.transport._collectives import CastSpec


def slot_perm(spec: CastSpec, shift: int, reverse: bool) -> list[tuple[int, int]]:
    sign = -1 if reverse else 1
    return [(r, (r + sign * shift) % spec.cp) for r in range(spec.cp)]


def slot_live(send: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """int32 ``[n_slots]``: the most real entries any rank has in each slot of its send
    table ``send [n_slots, S]`` (left-packed: entries at or past it are padding on every
    rank), the same on every rank (a ``pmax`` over the axis)."""
    return jax.lax.pmax(jnp.sum(send >= 0, axis=1, dtype=jnp.int32), axis_name)


def gated_ppermute(
    rows: tuple,
    axis_name: str | tuple[str, ...],
    perm: list[tuple[int, int]],
    live: jax.Array | None,
    pieces: int,
) -> tuple:
    """``lax.ppermute(rows, axis_name, perm)`` of equally long ``rows [w, ...]`` that moves
    only the first ``live`` rows (a scalar equal on every rank) rounded up to whole pieces
    of :func:`~magi_jax.planning.wire.piece_len` rows, zeros past them: one conditional
    whose branch ``k`` is a ``ppermute`` of ``k`` pieces. Exact when rows at or past
    ``live`` are zero on every rank; the wire follows ``live`` rather than ``w`` (counted
    by :func:`magi_jax.planning.wire.gated_widths`)."""
    w = rows[0].shape[0]
    if pieces <= 1 or w == 0:
        return jax.lax.ppermute(rows, axis_name, perm)
    size = piece_len(w, pieces)
    count = -(-w // size)

    def branch(k):
        def moved(part):
            head = jax.lax.ppermute(tuple(r[: min(w, k * size)] for r in part), axis_name, perm)
            return tuple(
                jnp.concatenate([h, jnp.zeros((w - h.shape[0],) + h.shape[1:], h.dtype)])
                for h in head
            )

        return moved if k else (lambda part: jax.tree.map(jnp.zeros_like, part))

    index = jnp.clip((live + size - 1) // size, 0, count)
    return jax.lax.switch(index, [branch(k) for k in range(count + 1)], tuple(rows))
