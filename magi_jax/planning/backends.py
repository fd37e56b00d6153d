"""The FFA backends by name: the one list every entry point checks (host; no JAX).

``xla`` is the portable blockwise implementation, ``pallas`` the Mosaic GPU kernels (Hopper);
``"auto"`` picks between them where a call runs (the device decides, so the pick lives on the
device side: :func:`magi_jax.ffa.backends.auto_backend`). Both read one plan format, the work
lists of :mod:`magi_jax.planning.work_list`, on each backend's own tiles
(:func:`~magi_jax.planning.work_list.backend_blocks`); the device halves are
:mod:`magi_jax.sharding.ffa_backends`.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "AUTO",
    "FFA_BACKENDS",
    "BACKEND_CHOICES",
    "check_backend",
    "HostPlanner",
    "HOST_PLANNERS",
    "host_planner",
]

FFA_BACKENDS = ("xla", "pallas")
AUTO = "auto"
# What an entry point's ``backend`` argument takes.
BACKEND_CHOICES = (AUTO, *FFA_BACKENDS)


def check_backend(backend: str, arg: str = "backend", *, auto: bool = True) -> str:
    """``backend`` if it names a backend (or ``"auto"`` where ``auto``), else a
    ``ValueError`` naming the argument ``arg``, the value and the choices."""
    choices = BACKEND_CHOICES if auto else FFA_BACKENDS
    if backend not in choices:
        raise ValueError(f"{arg}={backend!r} is not one of {choices}")
    return backend


@dataclasses.dataclass(frozen=True)
class HostPlanner:
    """The host half of a backend as the distributed planner carries it: its name (its tiles
    are :func:`~magi_jax.planning.work_list.backend_blocks` of the name)."""

    name: str


# One object per backend (the distributed planner compares them by identity).
HOST_PLANNERS = {name: HostPlanner(name) for name in FFA_BACKENDS}


def host_planner(name: str) -> HostPlanner:
    """The host half of backend ``name`` (``ValueError`` naming ``ffa_backend`` otherwise)."""
    return HOST_PLANNERS[check_backend(name, "ffa_backend", auto=False)]
