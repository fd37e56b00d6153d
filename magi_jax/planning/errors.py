"""Errors of host planning: :class:`CapacityError` and the one helper that writes its message
(a leaf: it imports nothing of the package, so every planning module can raise it)."""

from __future__ import annotations

__all__ = ["CapacityError", "capacity_error"]


class CapacityError(ValueError):
    """A mask needs more than its plan capacity holds."""


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
    what to build the capacity with (default ``field>=needed``). The message names the
    field, the value needed and the fix."""
    fix = f"{field}>={needed}" if fix is None else fix
    return CapacityError(
        f"{what} needs PlanCapacity.{field}>={needed}{detail}, but the capacity holds {have}; "
        f"build the capacity with {fix} (or PlanCapacity.from_masks over a sample of your "
        "masks)"
    )
