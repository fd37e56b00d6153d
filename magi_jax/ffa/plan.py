"""Single-device plans as data: :class:`AttnPlan` and :func:`plan_attention`.

An :class:`AttnPlan` is a JAX pytree. Its leaves are int32 work lists (and, for the Mosaic GPU
kernels, their persistent schedules) of shapes fixed by a :class:`PlanCapacity`; its static
part is the capacity, the backend and the tile sizes. The lists travel as runs of items
(:class:`~magi_jax.planning.work_list.FFAPlanRuns`, a fraction of the items' bytes) and are
expanded on the device, inside the traced step, right before the kernels read them
(:func:`expand_lists`). A jitted function that takes the plan as an argument compiles once
for all masks within the capacity::

    cap = mj.PlanCapacity(total_q=32768)
    step = jax.jit(lambda q, k, v, plan: mj.flex_flash_attention(q, k, v, plan))
    for mask in loader:                      # a new packing every step
        out, lse = step(q, k, v, mj.plan_attention(mask, cap))   # one compilation
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from magi_jax.ffa.backends import auto_backend
from magi_jax.ffa.ragged import expand_item_runs
from magi_jax.ffa.xla import LANE_LEN
from magi_jax.masks import AttnMask
from magi_jax.planning.backends import AUTO, HOST_SPECS, check_backend
from magi_jax.planning.capacity import PlanCapacity
from magi_jax.planning.work_list import (
    FFAPlanArrays,
    FFAPlanRuns,
    backend_blocks,
    check_items,
    check_runs,
    persistent_schedule,
    plan_runs,
    work_list_runs,
)

__all__ = ["AttnPlan", "PlanStatic", "plan_attention", "expand_lists"]


@dataclasses.dataclass(frozen=True)
class PlanStatic:
    """The static part of an :class:`AttnPlan`: depends on the capacity and options only.

    ``fwd_block`` / ``bwd_block``: ``(block_q, block_k)`` of the q-tile and k-tile lists;
    ``groups``: ``(B·Hq, B·Hkv)`` the persistent schedules were built for (``None``: the
    plan has none, the kernels run one program per tile); ``programs``: persistent programs
    of the forward and dK/dV kernels; ``items``: ``(q, k)`` widths of the item arrays that
    runs lists (:class:`~magi_jax.planning.work_list.FFAPlanRuns`) expand to (``None`` for
    lists of items)."""

    capacity: PlanCapacity
    backend: str
    fwd_block: tuple[int, int]
    bwd_block: tuple[int, int]
    lane_len: int = LANE_LEN
    groups: tuple[int, int] | None = None
    programs: int = 0
    items: tuple[int, int] | None = None


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["lists", "schedules"], meta_fields=["static"]
)
@dataclasses.dataclass(frozen=True)
class AttnPlan:
    """Work lists of one mask at a capacity (see the module docstring).

    ``lists``: :class:`~magi_jax.planning.work_list.FFAPlanRuns` (:func:`plan_attention`)
    or :class:`~magi_jax.planning.work_list.FFAPlanArrays` (plans built on the device), the
    q-tile list for the forward and dQ and the k-tile list for dK/dV; items past a list's
    last offset are padding and never visited; ``schedules``: ``()`` or the persistent
    schedules ``(fwd_offsets, fwd_units, dkv_offsets, dkv_units)``; ``static``:
    :class:`PlanStatic`."""

    lists: FFAPlanRuns | FFAPlanArrays
    schedules: tuple
    static: PlanStatic

    def item_lists(self) -> FFAPlanArrays:
        """The work lists as items, what the kernels read (:func:`expand_lists`; traced
        inside a jitted step)."""
        return expand_lists(self.lists, self.static.items)

    @property
    def capacity(self) -> PlanCapacity:
        return self.static.capacity

    @property
    def backend(self) -> str:
        return self.static.backend

    def nbytes(self) -> int:
        return int(sum(np.asarray(a).nbytes for a in jax.tree.leaves(self)))


def _resolve_backend(backend: str) -> tuple[str, str]:
    if check_backend(backend) == AUTO:
        # A plan holds work lists: the engines that read them.
        return auto_backend(context_parallel=True)
    if not HOST_SPECS[backend].work_lists:
        raise ValueError(
            f"backend={backend!r} reads no work lists, so it has no plan: pass the AttnMask "
            "to flex_flash_attention for it, or plan for 'pallas' or 'xla'"
        )
    return backend, "requested explicitly"


def plan_attention(
    mask: AttnMask,
    capacity: PlanCapacity | None = None,
    *,
    backend: str = "auto",
    num_heads: tuple[int, int] | None = None,
    batch: int = 1,
) -> AttnPlan:
    """The work lists of ``mask`` at ``capacity``, for :func:`magi_jax.flex_flash_attention`.

    Args:
      mask: an :class:`AttnMask` over ``capacity.total_q × capacity.total_k``.
      capacity: default ``PlanCapacity(mask.total_q, mask.total_k)``.
      backend: ``"auto"`` (``pallas`` on an sm90 GPU, else ``xla``), ``"xla"`` or
        ``"pallas"``: each backend reads lists built for its own tile sizes.
      num_heads: ``(Hq, Hkv)`` of the inputs; with the ``pallas`` backend and
        ``capacity.persistent``, the persistent kernels' schedules for ``batch·Hq`` /
        ``batch·Hkv`` head groups are built here and travel with the plan (without it the
        kernels run one program per tile).

    Raises :class:`~magi_jax.planning.capacity.CapacityError` (a ``ValueError``) naming the
    field when the mask does not fit. Host work (NumPy), milliseconds at 32k tokens.
    """
    if not isinstance(mask, AttnMask):
        raise TypeError(f"mask must be an AttnMask; got {type(mask).__name__}")
    if capacity is None:
        capacity = PlanCapacity(mask.total_q, mask.total_k)
    if not isinstance(capacity, PlanCapacity):
        raise TypeError(f"capacity must be a PlanCapacity; got {type(capacity).__name__}")
    if (mask.total_q, mask.total_k) != (capacity.total_q, capacity.total_k):
        raise ValueError(
            f"the mask is over total_q={mask.total_q}, total_k={mask.total_k} "
            f"but the capacity is for total_q={capacity.total_q}, total_k="
            f"{capacity.total_k}; plan masks of the capacity's lengths"
        )
    name, _ = _resolve_backend(backend)
    tq, tk = mask.total_q, mask.total_k
    fwd_block, bwd_block = backend_blocks(name, tq, tk)
    items, num_runs = capacity.list_sizes(fwd_block, bwd_block)
    one = np.zeros(len(mask.shapes.q0), np.int64)
    runs_q = work_list_runs(mask.shapes, one, 1, tq, tk, *fwd_block, "q")
    runs_k = work_list_runs(mask.shapes, one, 1, tq, tk, *bwd_block, "k")
    check_items(runs_q.per_rank, items[0])
    check_items(runs_k.per_rank, items[1])
    check_runs(runs_q, num_runs[0], "q_runs")
    check_runs(runs_k, num_runs[1], "k_runs")
    stacked = plan_runs(runs_q, runs_k, num_runs)
    lists = FFAPlanRuns(*(a[0] for a in stacked))
    fwd, bwd = lists.fwd, lists.bwd  # order and offsets: what schedules read
    schedules, groups, programs = (), None, 0
    if name == "pallas" and num_heads is not None and capacity.persistent:
        hq, hkv = (int(h) for h in num_heads)
        if hq < 1 or hkv < 1 or hq % hkv:
            raise ValueError(f"num_heads={num_heads} must be (Hq, Hkv) with Hq % Hkv == 0")
        from magi_jax.pallas.tuning import sm_count

        programs = sm_count()
        if programs:
            groups = (int(batch) * hq, int(batch) * hkv)
            schedules = (
                *persistent_schedule(fwd, groups[0], programs),
                *persistent_schedule(bwd, groups[1], programs),
            )
    static = PlanStatic(capacity, name, fwd_block, bwd_block, LANE_LEN, groups, programs, items)
    return AttnPlan(lists, schedules, static)


def expand_lists(
    lists: FFAPlanArrays | FFAPlanRuns, items: tuple[int, int] | None
) -> FFAPlanArrays:
    """The :class:`~magi_jax.planning.work_list.FFAPlanArrays` that ``lists`` stand for, on
    the device: runs (:class:`~magi_jax.planning.work_list.FFAPlanRuns`) expanded to item
    arrays ``items = (q, k)`` wide, exactly those of
    :func:`~magi_jax.planning.work_list.expand_plan_runs`; lists of items are returned as they
    are. jnp, traceable, O(items) work: a ragged enumeration of the runs (cumulative lengths
    and an unrolled binary search, no device loop) and one gather. Leading axes (stacked
    ranks) are mapped over."""
    if not isinstance(lists, FFAPlanRuns):
        return lists
    if items is None:
        raise ValueError(
            "lists of runs need the widths of their item arrays: items=(q, k) "
            "from the owner's static part (PlanStatic.items, StageStatic.items)"
        )
    return FFAPlanArrays(
        lists.q_order,
        lists.q_offsets,
        expand_item_runs(lists.q_runs, int(items[0])),
        lists.k_order,
        lists.k_offsets,
        expand_item_runs(lists.k_runs, int(items[1])),
    )
