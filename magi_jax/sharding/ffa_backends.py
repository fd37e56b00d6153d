"""Per-rank FFA implementations behind one descriptor, so context parallelism can swap them.

Each backend runs one rank's stage on the device as a split VJP (:class:`FFABackend`):
``xla`` the portable blockwise implementation (:mod:`magi_jax.ffa.xla`), ``pallas`` the
Mosaic GPU kernels (:mod:`magi_jax.pallas`: Hopper, bf16/fp16, D 64, 128 or 256), imported
only when asked for. Plans are built on the host by the planner
(:mod:`magi_jax.planning.stages`), one format for both. (The kernels' Mosaic GPU interpret
mode does not run under a multi-device ``shard_map`` on CPU — its barrier bookkeeping is per
device — so the pallas path is planned and checked on CPU but run only on GPUs.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from magi_jax.planning.backends import FFA_BACKENDS, check_backend

__all__ = ["FFABackend", "FFA_BACKENDS", "get_backend"]


@dataclasses.dataclass(frozen=True)
class FFABackend:
    """One backend's device half. ``split_fwd``/``split_bwd`` split the FFA VJP so that K and
    V need not be kept between forward and backward (context parallelism re-fetches remote KV
    instead):
    ``split_fwd(q, k, v, plan, **cfg) -> ((out, lse), saved)`` (``((out, lse, max_logits
    [Hq]), saved)`` with ``return_max_logits=True``) and
    ``split_bwd(saved, q, k, v, plan, (dout, dlse), **cfg) -> (dq, dk, dv)``, for
    ``[T, H, D]`` inputs; ``cfg`` = ``softmax_scale, softcap, block_q, block_k``. ``saved``
    is ``(out [T, H, D], lse [T, H])``, and ``split_bwd`` takes any such pair — also the
    merged result of several calls, whose backward each call can then run on its own. With
    ``between_dkv_dq=fn`` it returns ``(dq, dk, dv, token)``, ``token = fn(dk, dv)``: the
    pallas backend computes dK/dV, calls ``fn``, then runs its dQ kernel and orders the token
    after it, so that a collective started in ``fn`` moves beside the dQ kernel. With
    ``split_kv_at=n`` too, ``fn`` gets (and the call returns) dK and dV each as a pair of
    arrays, rows ``[:n]`` and ``[n:]`` (the pallas kernel stores them apart)."""

    name: str
    split_fwd: Callable
    split_bwd: Callable


def _xla() -> FFABackend:
    # The split VJP is xla_ffa's own forward and backward (xla_ffa_forward/_backward), so the
    # arithmetic is exactly that of xla_ffa; tests/sharding checks it end to end.
    from magi_jax.ffa import xla as X

    def split_fwd(q, k, v, plan, **kw):
        res = X.xla_ffa_forward(q, k, v, plan, **kw)
        return res, res[:2]

    def split_bwd(saved, q, k, v, plan, cts, *, between_dkv_dq=None, split_kv_at=0, **kw):
        out, lse = saved
        dq, dk, dv = X.xla_ffa_backward(q, k, v, out, lse, *cts, plan, **kw)
        if between_dkv_dq is None:
            return dq, dk, dv
        if split_kv_at:
            dk, dv = (dk[:split_kv_at], dk[split_kv_at:]), (dv[:split_kv_at], dv[split_kv_at:])
        return dq, dk, dv, between_dkv_dq(dk, dv)

    return FFABackend("xla", split_fwd=split_fwd, split_bwd=split_bwd)


def _pallas(interpret: bool = False) -> FFABackend:
    from magi_jax.pallas import ffa_pallas, ffa_pallas_backward

    # Split VJP: the forward saves its (out, lse); each stage's backward runs against the
    # merged (out, lse). Plans are traced here, so the kernels run one program per unit.
    def split_fwd(
        q, k, v, plan, *, softmax_scale, softcap, block_q, block_k, return_max_logits=False
    ):
        del block_q, block_k
        res = ffa_pallas(
            q,
            k,
            v,
            plan,
            softmax_scale=softmax_scale,
            softcap=softcap,
            interpret=interpret,
            persistent=0,
            return_max_logits=return_max_logits,
        )
        return res, res[:2]

    def split_bwd(
        saved,
        q,
        k,
        v,
        plan,
        cts,
        *,
        softmax_scale,
        softcap,
        block_q,
        block_k,
        between_dkv_dq=None,
        split_kv_at=0,
    ):
        del block_q, block_k
        return ffa_pallas_backward(
            q,
            k,
            v,
            plan,
            *saved,
            *cts,
            softmax_scale=softmax_scale,
            softcap=softcap,
            interpret=interpret,
            between_dkv_dq=between_dkv_dq,
            split_kv_at=split_kv_at,
        )

    name = "pallas_interpret" if interpret else "pallas"
    return FFABackend(name, split_fwd=split_fwd, split_bwd=split_bwd)


_FACTORIES = {"xla": _xla, "pallas": _pallas}
assert tuple(_FACTORIES) == FFA_BACKENDS, FFA_BACKENDS


@functools.cache
def get_backend(name: str) -> FFABackend:
    """The device half of backend ``name`` (one of :data:`FFA_BACKENDS`)."""
    return _FACTORIES[check_backend(name, "ffa_backend", auto=False)]()
