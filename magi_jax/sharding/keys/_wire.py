"""What a key's casts put on the wire (:mod:`magi_jax.planning.wire` for the transports the
key chose): real rows and wire rows per rank, per hop and in total, per forward cast."""

from __future__ import annotations

from typing import TYPE_CHECKING

from magi_jax.planning import NodeLayout, WireCount, build_relay_runs, cast_wire, relay_wire
from magi_jax.sharding.transport import RelaySpec

if TYPE_CHECKING:  # annotations only
    from magi_jax.sharding.keys._key import MagiKey


def key_wire(key: MagiKey) -> WireCount:
    """The casts of every remote stage of ``key`` (a :class:`~magi_jax.sharding.MagiKey`
    holding its host plan) on the transports it runs: ``ppermute`` (whole, pair by pair or in
    gated pieces per slot or per pair, as its :class:`CastSpec` gates it; gated pieces at a
    capacity), ``all_to_all``, ``native`` or two-hop (its tables planned again by runs).
    Ranks per node: the local axis of a two-axis cp (else all on one node)."""
    plan = key.plan
    if plan is None:
        raise ValueError(
            "key_wire needs the key's host plan; pass the key make_flex_key returned "
            "(not one rebuilt inside a traced function)"
        )
    specs = [s.cast for s in key.stages if s.cast is not None]
    casts = [st.cast for st in plan.stages if st.cast is not None]
    local = None
    if not isinstance(key.cp_axis, str) and len(key.cp_axis) == 2:
        local = int(key.mesh.shape[key.cp_axis[1]])
    total = WireCount.zeros(plan.cp)
    for spec, table in zip(specs, casts):
        if isinstance(spec, RelaySpec):
            fixed = key.capacity is not None  # as keys._relay.relay_stage plans them
            widths = dict(inter_width=table.slot_len, intra_width=table.buffer_len) if fixed else {}
            rt = build_relay_runs(table, NodeLayout(spec.nodes, spec.local), **widths)
            total = total + relay_wire(rt, spec.pieces)
        else:
            total = total + cast_wire(table, spec.transport, local, spec.pieces, spec.gating)
    return total
