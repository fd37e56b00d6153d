"""Per-rank FFA implementations behind one descriptor, so context parallelism can swap them.

Each backend says how to plan (host: canonical shapes of one rank's stage -> int32 plan
arrays), how to stack the plans of all ranks along a leading ``cp`` axis, and how to run
(device: ``call(q, k, v, plan, softmax_scale=, softcap=, block_q=, block_k=) -> (out, lse)``,
differentiable, ``lse`` float32). ``xla`` is the portable blockwise implementation
(:mod:`magi_jax.xla_ffa`); ``pallas`` the Mosaic GPU kernels (:mod:`magi_jax.pallas`, Hopper,
bf16/fp16, D 64/128), imported only when asked for. (The kernels' Mosaic GPU interpret mode
does not run under a multi-device ``shard_map`` on CPU — its barrier bookkeeping is per
device — so the pallas path is planned and checked on CPU but run only on GPUs.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from magi_jax.xla_ffa import build_xla_plan, stack_plans, xla_ffa

__all__ = ["FFABackend", "FFA_BACKENDS", "get_backend"]


@dataclasses.dataclass(frozen=True)
class FFABackend:
    name: str
    build: Callable       # (shapes, total_q, total_k, block_q, block_k) -> plan arrays
    stack: Callable       # [plan arrays per rank] -> stacked plan arrays
    call: Callable        # (q, k, v, plan, *, softmax_scale, softcap, block_q, block_k)


def _xla() -> FFABackend:
    return FFABackend(
        "xla",
        build=lambda sh, tq, tk, bq, bk: build_xla_plan(sh, tq, tk, bq, bk).arrays(),
        stack=stack_plans,
        call=xla_ffa)


def _pallas() -> FFABackend:
    from magi_jax.pallas import ffa_pallas
    from magi_jax.pallas.plan import build_kernel_plan, stack_kernel_plans

    def call(q, k, v, plan, *, softmax_scale, softcap, block_q, block_k):
        del block_q, block_k            # the kernels tile with their own block sizes
        return ffa_pallas(q, k, v, plan, softmax_scale=softmax_scale, softcap=softcap)

    return FFABackend(
        "pallas",
        build=lambda sh, tq, tk, bq, bk: build_kernel_plan(sh, tq, tk).arrays(),
        stack=stack_kernel_plans,
        call=call)


_FACTORIES = {"xla": _xla, "pallas": _pallas}
FFA_BACKENDS = tuple(_FACTORIES)


@functools.cache
def get_backend(name: str) -> FFABackend:
    if name not in _FACTORIES:
        raise ValueError(f"ffa_backend={name!r} is not one of {FFA_BACKENDS}")
    return _FACTORIES[name]()
