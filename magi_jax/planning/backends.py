"""The host half of the per-rank FFA backends (pure NumPy, no JAX): for each backend name,
how to plan one rank's stage and how to stack the plans of all ranks.

``build(shapes, total_q, total_k, block_q, block_k) -> plan arrays`` (a NamedTuple of NumPy
int32 arrays) and ``stack([plan arrays per rank]) -> stacked plan arrays`` (a leading ``cp``
axis). The device half (how to run a plan) is :mod:`magi_jax.sharding.ffa_backends`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from magi_jax.planning.work_list import backend_blocks, build_plan_arrays, stack_plans

__all__ = ["HostPlanner", "HOST_PLANNERS", "FFA_BACKENDS", "host_planner"]


class HostPlanner(NamedTuple):
    name: str
    build: Callable  # (shapes, total_q, total_k, block_q, block_k) -> plan arrays
    stack: Callable  # [plan arrays per rank] -> stacked plan arrays


def _build(backend):
    def build(shapes, total_q, total_k, block_q, block_k):
        blocks = backend_blocks(backend, total_q, total_k, block_q, block_k)
        return build_plan_arrays(shapes, total_q, total_k, *blocks)

    return build


# One plan format for both: the work lists, on each backend's own tiles (the Mosaic GPU
# kernels tile with fixed block sizes, so block_q/block_k only reach the xla backend).
HOST_PLANNERS = {
    name: HostPlanner(name, build=_build(name), stack=stack_plans) for name in ("xla", "pallas")
}
FFA_BACKENDS = tuple(HOST_PLANNERS)


def host_planner(name: str) -> HostPlanner:
    if name not in HOST_PLANNERS:
        raise ValueError(f"ffa_backend={name!r} is not one of {FFA_BACKENDS}")
    return HOST_PLANNERS[name]
