"""The two-hop cast on a mesh of nodes (a ``RelaySpec``): each row crosses nodes once, to a
relay in the receiving node, then moves inside the node; the reduce runs both hops backwards,
summing inside the node before the one inter-node send. Both hops are ``lax.ppermute``s, one
per slot (:func:`~magi_jax.sharding.transport._slot.gated_ppermute`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.sharding.transport._gather import acc_dtype, inverse, take
from magi_jax.sharding.transport._slot import gated_ppermute, slot_live

if TYPE_CHECKING:
    from magi_jax.sharding.transport._collectives import RelayArrays, RelaySpec


def _relay_perms(spec: RelaySpec, reverse: bool):
    """Per slot, the ``ppermute`` pairs of both hops: inter-node over the flattened
    ``(node, local)`` index, intra-node over ``local``."""
    n, l, sign = spec.nodes, spec.local, -1 if reverse else 1
    inter = []
    for dn, dl in spec.inter_shifts:
        pairs = [(a * l + b, ((a + dn) % n) * l + (b + dl) % l) for a in range(n) for b in range(l)]
        inter.append([(t, s) for s, t in pairs] if reverse else pairs)
    intra = [[(b, (b + sign * sh) % l) for b in range(l)] for sh in spec.intra_shifts]
    return inter, intra


def _hop(rows, send, widths, axis, perms, live=None, pieces=1):
    """One hop of every leaf: slot ``j`` sends ``rows[send[j, :w_j]]`` (zeros for padding);
    returns the received blocks packed back to back at their widths. ``live``: the slots'
    :func:`slot_live`, for ``pieces > 1`` (:func:`gated_ppermute`)."""
    idx = jnp.where(send < 0, rows[0].shape[0], send)
    got = [
        gated_ppermute(
            tuple(take(a, idx[j, :w]) for a in rows),
            axis,
            perm,
            None if live is None else live[j],
            pieces,
        )
        for j, (w, perm) in enumerate(zip(widths, perms))
    ]
    return [
        jnp.concatenate([g[i] for g in got]) if got else jnp.zeros((0,) + a.shape[1:], a.dtype)
        for i, a in enumerate(rows)
    ]


def relay_cast(leaves: list[jax.Array], tables: RelayArrays, spec: RelaySpec) -> list[jax.Array]:
    inter_send, intra_send, recv = tables
    inter, intra = _relay_perms(spec, reverse=False)
    live1, live2 = _relay_live(tables, spec)
    relay = _hop(leaves, inter_send, spec.inter_widths, spec.axes, inter, live1, spec.pieces)
    x2 = [jnp.concatenate([r, a]) for r, a in zip(relay, leaves)]
    fwd = _hop(x2, intra_send, spec.intra_widths, spec.axes[1], intra, live2, spec.pieces)
    got = [jnp.concatenate([r, f]) for r, f in zip(relay, fwd)]
    size = sum(spec.inter_widths) + sum(spec.intra_widths)
    return [take(g, jnp.where(recv < 0, size, recv)) for g in got]


def _relay_live(tables: RelayArrays, spec: RelaySpec):
    """``(inter, intra)``: each hop's :func:`slot_live` over every rank of both axes (one
    value everywhere), or ``(None, None)`` without gated pieces."""
    if spec.pieces <= 1:
        return None, None
    return tuple(
        slot_live(send, spec.axes) if send.shape[0] else None
        for send in (tables.inter_send, tables.intra_send)
    )


def _hop_back(ct, send, widths, axis, perms, num_rows, live=None, pieces=1):
    """Transpose of :func:`_hop`: received blocks ``ct`` (packed) go back to their senders
    and are summed into ``num_rows`` rows there (gated alike)."""
    offsets = np.concatenate([[0], np.cumsum(widths)]).astype(int)
    back = [
        gated_ppermute(
            tuple(c[offsets[j] : offsets[j + 1]] for c in ct),
            axis,
            perm,
            None if live is None else live[j],
            pieces,
        )
        for j, perm in enumerate(perms)
    ]
    idx = (
        jnp.concatenate(
            [jnp.where(send[j, :w] < 0, num_rows, send[j, :w]) for j, w in enumerate(widths)]
        )
        if widths
        else None
    )
    out = []
    for i, c in enumerate(ct):
        acc = jnp.zeros((num_rows,) + c.shape[1:], c.dtype)
        if back:
            acc = acc.at[idx].add(jnp.concatenate([b[i] for b in back]), mode="drop")
        out.append(acc)
    return out


def relay_reduce(
    leaves: list[jax.Array], tables: RelayArrays, spec: RelaySpec, num_rows: int
) -> list[jax.Array]:
    """Adjoint of :func:`relay_cast`: sums inside the node first (the intra-node hop
    reversed, at the relays), then one inter-node send back per relayed row."""
    inter_send, intra_send, recv = tables
    inter, intra = _relay_perms(spec, reverse=True)
    live1, live2 = _relay_live(tables, spec)
    r_len = int(sum(spec.inter_widths))
    size = r_len + int(sum(spec.intra_widths))
    inv = inverse(recv, size, leaves[0].shape[0])  # recv is injective: a gather
    got = [take(a, inv).astype(acc_dtype(a.dtype)) for a in leaves]
    x2 = _hop_back(
        [g[r_len:] for g in got],
        intra_send,
        spec.intra_widths,
        spec.axes[1],
        intra,
        r_len + num_rows,
        live2,
        spec.pieces,
    )
    relay = [x[:r_len] + g[:r_len] for x, g in zip(x2, got)]
    back = _hop_back(
        relay, inter_send, spec.inter_widths, spec.axes, inter, num_rows, live1, spec.pieces
    )
    return [x[r_len:] + b for x, b in zip(x2, back)]
