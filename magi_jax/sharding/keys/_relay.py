"""The two-hop cast of one stage of a key on a mesh of nodes: its static part
(:class:`~magi_jax.sharding.transport.RelaySpec`) and its tables as runs
(:class:`~magi_jax.sharding.transport.RelayRuns`), planned by runs
(:func:`~magi_jax.planning.relay_runs.build_relay_runs`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from magi_jax.planning import (
    CastTable,
    NodeLayout,
    build_relay_runs,
    cast_pieces,
    cast_wire,
    pad_runs,
    relay_run_bounds,
)
from magi_jax.sharding.transport import RelayRuns, RelaySpec

if TYPE_CHECKING:  # annotations only
    from magi_jax.planning import PlanCapacity


def relay_stage(
    cast: CastTable,
    layout: NodeLayout,
    forced: bool,
    capacity: PlanCapacity | None,
    cp_axis: str | tuple[str, ...],
    flat_gating: str = "slot",
) -> tuple[RelaySpec, RelayRuns] | None:
    """``(RelaySpec, RelayRuns of host tables)`` of a stage's flat ``cast``, or ``None`` where
    the flat cast stays: not ``forced`` and the two hops send no fewer rows between nodes,
    padding included (a key of one mask: each slot as wide as its widest block, or, with
    ``flat_gating="pair"``, each pair's rows up to its level). At a
    ``capacity`` the slots are as wide as the capacity allows and move in gated pieces
    (:func:`~magi_jax.planning.cost_model.cast_pieces`), and the tables hold the runs
    :func:`~magi_jax.planning.relay_runs.relay_run_bounds` allows, so the shapes depend on
    the capacity alone."""
    widths = (
        {} if capacity is None else dict(inter_width=cast.slot_len, intra_width=cast.buffer_len)
    )
    rt = build_relay_runs(cast, layout, **widths)
    if not forced:
        flat = cast_wire(cast, "ppermute", layout.local, gating=flat_gating)
        if rt.inter_node_wire_rows() >= int(flat.wire_inter.sum()):
            return None
    spec = RelaySpec(
        tuple(cp_axis),
        layout.nodes,
        layout.local,
        rt.inter_shifts,
        rt.inter_widths,
        rt.intra_shifts,
        rt.intra_widths,
        inter_slot_len=rt.inter_slot_len,
        intra_slot_len=rt.intra_slot_len,
        buffer_len=rt.buffer_len,
        pieces=cast_pieces(capacity),
    )
    runs = (rt.inter_runs, rt.intra_runs, rt.recv_runs)
    if capacity is not None:
        # Shapes from the capacity alone (relay_run_bounds), whatever this mask needs.
        bounds = relay_run_bounds(
            layout, cast.slot_len, cast.buffer_len, capacity.send_runs, capacity.recv_runs
        )
        runs = tuple(
            pad_runs(a, b, what)
            for a, b, what in zip(runs, bounds, ("inter-node", "intra-node", "receive"))
        )
    return spec, RelayRuns(*runs)
