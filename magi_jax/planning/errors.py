"""Errors of host planning: :class:`CapacityError` and the one helper that writes its message
(a leaf: it imports nothing of the package, so every planning module can raise it)."""

from __future__ import annotations

__all__ = ["CapacityError", "capacity_error", "LIMITS"]

# What each bound of a PlanCapacity limits, in a user's words (the messages say it).
LIMITS = {
    "items": "attention work per call: (document piece, query tile, key tile) triples on one "
    "rank's work list in one stage; many short documents and small dispatch chunks need more",
    "q_runs": "runs of consecutive work items on one query-tile list (roughly: documents "
    "times tiles a rank meets in one stage)",
    "k_runs": "runs of consecutive work items on one key-tile list (roughly: documents "
    "times tiles a rank meets in one stage)",
    "host_q_runs": "runs of work items on one query-tile list of the stage over a rank's own keys",
    "host_k_runs": "runs of work items on one key-tile list of the stage over a rank's own keys",
    "remote_kv": "key/value tokens one rank fetches from the others (all stages)",
    "cast_width": "key/value tokens one rank sends one other rank in one stage",
    "send_runs": "separate row ranges one rank sends in one stage",
    "recv_runs": "separate row ranges one rank receives in one stage",
}


class CapacityError(ValueError):
    """A mask needs more than its plan capacity holds. The message names the limit, says
    what it counts, and gives the call that fixes it (``capacity.grow(field=need)``)."""


def capacity_error(
    field: str,
    needed: int,
    have: int,
    *,
    what: str = "this mask",
    detail: str = "",
    fix: str | None = None,
) -> CapacityError:
    """The :class:`CapacityError` of ``what`` needing ``needed`` of
    :class:`~magi_jax.planning.capacity.PlanCapacity`'s ``field`` where the capacity holds
    ``have``; ``detail`` (e.g. ``" work items on one list"``) says what is counted, ``fix``
    the call that fixes it (default ``capacity = capacity.grow(field=needed)``). The
    message names the field, the value needed, what the limit means and the fix."""
    fix = f"capacity = capacity.grow({field}={needed})" if fix is None else fix
    words = LIMITS.get(field, f"PlanCapacity.{field}")
    return CapacityError(
        f"{what} needs PlanCapacity.{field}>={needed}{detail}, but the capacity holds {have}; "
        f"{field} is the limit on {words}. Fix: {fix} (it adds headroom; the key's shapes "
        "change, so a jitted step compiles once more), or let magi_jax.CapacityPolicy grow it "
        "as the run goes, or size every field at once with PlanCapacity.from_masks over a "
        "sample of your masks"
    )
