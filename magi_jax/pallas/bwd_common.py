"""Pieces the Hopper backward kernels share (:mod:`~magi_jax.pallas.ffa_bwd`,
:mod:`~magi_jax.pallas.ffa_dq_wide`, :mod:`~magi_jax.pallas.ffa_dkv_wide`): the scores in the
log2 domain, the producer's ring, the stores of a unit's outputs, the WGMMA layouts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from magi_jax.pallas.common import COMPUTE_WGS, LOG2E
from magi_jax.planning.work_list import DKV_BLOCK_K

__all__ = [
    "DKV_SPLIT_ALIGN",
    "LAYOUT",
    "ROW",
    "COL",
    "log2_scores",
    "exp2_minus",
    "dkv_out_type",
    "stream",
    "drain",
    "store_outputs",
]

# ffa_dkv's split: a multiple of the rows one warpgroup stores.
DKV_SPLIT_ALIGN = DKV_BLOCK_K // COMPUTE_WGS
# The WGMMA register layout of a tile, and of its rows' and columns' statistics.
LAYOUT = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)


def log2_scores(s: jax.Array, scale: float, softcap: float) -> tuple[jax.Array, Any, Any]:
    """Raw ``q·k`` (float32) -> (scores, scale still to apply in the exponent or None,
    ``1 − tanh²`` for the softcap chain or None); scores in the log2 domain once scaled."""
    if softcap:
        t = jnp.tanh(s * (scale / softcap))
        return t * (softcap * LOG2E), None, 1.0 - t * t
    return s, scale * LOG2E, None


def exp2_minus(s: jax.Array, c: float | None, stat: jax.Array, dim: int) -> jax.Array:
    """``exp2(s·c − stat)`` with the row/column statistic broadcast along ``dim``."""
    b = lax.broadcast_in_dim(stat, s.shape, [dim])
    return jnp.exp2(s - b if c is None else s * c - b)


def dkv_out_type(
    q: jax.Array, k: jax.Array, v: jax.Array, split: int
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The outputs of a dK/dV kernel, in q's dtype: ``(dk, dv)`` ``[B, Tk, Hkv, D]`` and
    ``[B, Tk, Hkv, Dv]``, or, with ``split``, ``(dk[:, :split], dv[:, :split], dk[:, split:],
    dv[:, split:])``."""
    b, d, dtype = q.shape[0], q.shape[-1], q.dtype
    tk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    kv = lambda rows, width: jax.ShapeDtypeStruct((b, rows, hkv, width), dtype)
    if split:
        return kv(split, d), kv(split, dv), kv(tk - split, d), kv(tk - split, dv)
    return kv(tk, d), kv(tk, dv)


def stream(
    num_steps: Any,
    stages: int,
    start_of: Callable,
    streams: Sequence[tuple],
    view: Callable,
    base: Any = None,
) -> None:
    """Producer loop: step ``i`` copies, for every ``(gmem, smem, ready, free)`` stream, the
    block starting at ``start_of(i)`` into slot ``g % stages`` (``g = base + i``, the ring's
    running step count; ``base=None``: the ring's only walk, ``g = i``) once the consumers
    freed it. With ``base=None`` it then drains the ring (:func:`drain`); otherwise the
    caller drains once after its last walk."""

    @pl.loop(0, num_steps)
    def _(i):
        g = i if base is None else base + i
        slot = lax.rem(g, jnp.int32(stages))
        start = start_of(i)
        for gmem, buf, ready, free in streams:

            @pl.when(g >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])

            plgpu.copy_gmem_to_smem(view(gmem, start), buf.at[slot], ready.at[slot])

    if base is None:
        drain(num_steps, stages, streams)


def drain(total: Any, stages: int, streams: Sequence[tuple]) -> None:
    """Waits for the last slots of a ring of ``total`` steps to be freed, so every barrier
    phase is observed before the shared memory is given back."""

    @pl.loop(lax.max(total - stages, jnp.int32(0)), total)
    def _(i):
        slot = lax.rem(i, jnp.int32(stages))
        for _, _, _, free in streams:
            plgpu.barrier_wait(free.at[slot])


def store_outputs(outs: Sequence[tuple], persistent: bool) -> None:
    """Writes a unit's ``(smem buffer, value, gmem destination)`` outputs through shared
    memory; a destination may be a function storing the buffer. Persistent: the buffers are
    the kernel's own, so only the previous unit's stores must have read them and this unit's
    stores run on under the next unit; otherwise the buffers are the unit's inputs and the
    stores complete here."""
    if persistent:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for buf, value, _ in outs:
        buf[...] = value
    plgpu.commit_smem()
    for buf, _, dst in outs:
        if callable(dst):
            dst(buf)
        else:
            plgpu.copy_smem_to_gmem(buf, dst)
    if not persistent:
        plgpu.wait_smem_to_gmem(0)
