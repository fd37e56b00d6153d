"""The host half of the per-rank FFA backends (pure NumPy, no JAX): for each backend name,
how to plan one rank's stage and how to stack the plans of all ranks.

``build(shapes, total_q, total_k, block_q, block_k) -> plan arrays`` (a NamedTuple of NumPy
int32 arrays) and ``stack([plan arrays per rank]) -> stacked plan arrays`` (a leading ``cp``
axis). The device half (how to run a plan) is :mod:`magi_jax.sharding.ffa_backends`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from magi_jax.planning.lanes import build_xla_plan, stack_plans
from magi_jax.planning.work_list import build_kernel_plan, stack_kernel_plans

__all__ = ["HostPlanner", "HOST_PLANNERS", "FFA_BACKENDS", "host_planner"]


class HostPlanner(NamedTuple):
    name: str
    build: Callable       # (shapes, total_q, total_k, block_q, block_k) -> plan arrays
    stack: Callable       # [plan arrays per rank] -> stacked plan arrays


HOST_PLANNERS = {
    "xla": HostPlanner(
        "xla", build=lambda sh, tq, tk, bq, bk: build_xla_plan(sh, tq, tk, bq, bk).arrays(),
        stack=stack_plans),
    # The kernels tile with their own block sizes (bq, bk unused).
    "pallas": HostPlanner(
        "pallas", build=lambda sh, tq, tk, bq, bk: build_kernel_plan(sh, tq, tk).arrays(),
        stack=stack_kernel_plans),
}
FFA_BACKENDS = tuple(HOST_PLANNERS)


def host_planner(name: str) -> HostPlanner:
    if name not in HOST_PLANNERS:
        raise ValueError(f"ffa_backend={name!r} is not one of {FFA_BACKENDS}")
    return HOST_PLANNERS[name]
