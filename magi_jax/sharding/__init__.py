"""Context parallelism: dispatch solver, distributed plan, group collectives, ``shard_map``
attention and keys (docs/design.md §3.2, §4.2).

    mesh = jax.make_mesh((8,), ("cp",))
    key = mj.make_flex_key(mask, mesh, "cp")          # host planning, cached
    x = mj.dispatch(tokens_or_activations, key)       # natural -> dispatched, sharded on cp
    pos = mj.position_ids(key)                        # RoPE positions of dispatched tokens
    q, k, v = ...                                     # the model, on dispatched tokens
    out, lse = mj.magi_attention(q, k, v, key)        # [padded_total, H, D], [.., H]
    y = mj.undispatch(out, key)                       # back to natural order

Host planning lives in :mod:`magi_jax.planning`: :mod:`~magi_jax.planning.solver` (which
chunks each rank owns), :mod:`~magi_jax.planning.stages` (per-rank stages and exactly-needed
remote KV), :mod:`~magi_jax.planning.cast_table` (the group-cast tables). Here, on the device:
:mod:`collectives` (``group_cast``/``group_reduce`` over static int32 tables; XLA
transports), :mod:`native` (the C++ FFI transport), :mod:`attention` (the per-rank pipeline
under ``shard_map``), :mod:`key` (keys, dispatch), :mod:`ffa_backends` (per-rank FFA:
``xla`` | ``pallas``), :mod:`calibrate` (overlap degrees chosen by timing on the mesh).
Comm/compute/both timings for overlap measurements are in ``benchmarks/probe.py``.

Dispatch gathers over the whole sequence: dispatch token ids (or the embedding output) once
and keep activations in dispatched order between layers, rather than dispatching large
activations per layer.
"""

from magi_jax.planning.solver import solve_dispatch
from magi_jax.sharding.attention import magi_attention, magi_attention_local
from magi_jax.sharding.batch_key import batch_rows, make_batch_key
from magi_jax.sharding.calibrate import (
    OverlapCalibration,
    calibrate_overlap,
    clear_overlap_calibrations,
    overlap_calibrations,
)
from magi_jax.sharding.collectives import group_cast, group_reduce
from magi_jax.sharding.key import MagiKey
from magi_jax.sharding.layout import dispatch, position_ids, undispatch
from magi_jax.sharding.make_key import make_flex_key, make_varlen_key
from magi_jax.sharding.roll import roll

__all__ = [
    "MagiKey",
    "OverlapCalibration",
    "calibrate_overlap",
    "clear_overlap_calibrations",
    "overlap_calibrations",
    "batch_rows",
    "make_batch_key",
    "dispatch",
    "group_cast",
    "group_reduce",
    "magi_attention",
    "magi_attention_local",
    "make_flex_key",
    "make_varlen_key",
    "position_ids",
    "roll",
    "solve_dispatch",
    "undispatch",
]
