"""Single-device plans as data: :class:`AttnPlan` and :func:`plan_attention`.

An :class:`AttnPlan` is a JAX pytree. Its leaves are int32 work lists (and, for the Mosaic GPU
kernels, their persistent schedules) of shapes fixed by a :class:`PlanCapacity`; its static
part is the capacity, the backend and the tile sizes. A jitted function that takes the plan
as an argument compiles once for all masks within the capacity::

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

from magi_jax.mask import AttnMask
from magi_jax.planning.capacity import PlanCapacity
from magi_jax.planning.work_list import (FFAPlanArrays, backend_blocks, build_work_list,
                                         pad_work_list, persistent_schedule)

__all__ = ["AttnPlan", "PlanStatic", "plan_attention", "PLAN_BACKENDS"]

PLAN_BACKENDS = ("auto", "xla", "pallas")
# Items per lane of the xla backend (its device-side cut of each tile's run).
_XLA_LANE_LEN = 16


@dataclasses.dataclass(frozen=True)
class PlanStatic:
    """The static part of an :class:`AttnPlan`: depends on the capacity and options only.

    ``fwd_block`` / ``bwd_block``: ``(block_q, block_k)`` of the q-tile and k-tile lists;
    ``groups``: ``(B·Hq, B·Hkv)`` the persistent schedules were built for (``None``: the
    plan has none, the kernels run one program per tile); ``programs``: persistent programs
    of the forward and dK/dV kernels."""

    capacity: PlanCapacity
    backend: str
    fwd_block: tuple[int, int]
    bwd_block: tuple[int, int]
    lane_len: int = _XLA_LANE_LEN
    groups: tuple[int, int] | None = None
    programs: int = 0


@functools.partial(jax.tree_util.register_dataclass, data_fields=["lists", "schedules"],
                   meta_fields=["static"])
@dataclasses.dataclass(frozen=True)
class AttnPlan:
    """Work lists of one mask at a capacity (see the module docstring).

    ``lists``: :class:`~magi_jax.planning.work_list.FFAPlanArrays` (q-tile list for the
    forward and dQ, k-tile list for dK/dV; items past a list's last offset are padding and
    never visited); ``schedules``: ``()`` or the persistent schedules ``(fwd_offsets,
    fwd_units, dkv_offsets, dkv_units)``; ``static``: :class:`PlanStatic`."""

    lists: FFAPlanArrays
    schedules: tuple
    static: PlanStatic

    @property
    def capacity(self) -> PlanCapacity:
        return self.static.capacity

    @property
    def backend(self) -> str:
        return self.static.backend

    def nbytes(self) -> int:
        return int(sum(np.asarray(a).nbytes for a in jax.tree.leaves(self)))


def _resolve_backend(backend: str) -> tuple[str, str]:
    if backend not in PLAN_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {PLAN_BACKENDS}")
    if backend != "auto":
        return backend, "requested explicitly"
    from magi_jax.pallas.api import device_supported
    ok, why = device_supported()
    return ("pallas", "sm90 GPU") if ok else ("xla", why)


def plan_attention(mask: AttnMask, capacity: PlanCapacity | None = None, *,
                   backend: str = "auto", num_heads: tuple[int, int] | None = None,
                   batch: int = 1) -> AttnPlan:
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
        raise ValueError(f"the mask is over total_q={mask.total_q}, total_k={mask.total_k} "
                         f"but the capacity is for total_q={capacity.total_q}, total_k="
                         f"{capacity.total_k}; plan masks of the capacity's lengths")
    name, _ = _resolve_backend(backend)
    tq, tk = mask.total_q, mask.total_k
    fwd_block, bwd_block = backend_blocks(name, tq, tk)
    # The k-tile list steps over tiles of bwd_block rows; every item on fwd_block tiles holds
    # at most fwd_block[0] / bwd_block[0] of them.
    bwd_cap = capacity.items * max(1, fwd_block[0] // bwd_block[0])
    fwd = build_work_list(mask.shapes, tq, tk, *fwd_block, "q")
    bwd = build_work_list(mask.shapes, tq, tk, *bwd_block, "k")
    lists = FFAPlanArrays(*pad_work_list(fwd, capacity.items), *pad_work_list(bwd, bwd_cap))
    schedules, groups, programs = (), None, 0
    if name == "pallas" and num_heads is not None and capacity.persistent:
        hq, hkv = (int(h) for h in num_heads)
        if hq < 1 or hkv < 1 or hq % hkv:
            raise ValueError(f"num_heads={num_heads} must be (Hq, Hkv) with Hq % Hkv == 0")
        programs = _sm_count()
        if programs:
            groups = (int(batch) * hq, int(batch) * hkv)
            schedules = (*persistent_schedule(fwd, groups[0], programs),
                         *persistent_schedule(bwd, groups[1], programs))
    static = PlanStatic(capacity, name, fwd_block, bwd_block, _XLA_LANE_LEN, groups, programs)
    return AttnPlan(lists, schedules, static)


def _sm_count() -> int:
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return 0
    return int(getattr(dev, "core_count", 0) or 0)
