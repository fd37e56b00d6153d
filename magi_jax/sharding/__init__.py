"""Context parallelism: dispatch solver, distributed plan, group collectives, ``shard_map``
attention and keys (docs/design.md §3.2, §4.2).

    mesh = jax.make_mesh((8,), ("cp",))
    key = mj.make_flex_key(mask, mesh, "cp")          # host planning, cached
    x = mj.dispatch(tokens_or_activations, key)       # natural -> dispatched, sharded on cp
    pos = mj.position_ids(key)                        # RoPE positions of dispatched tokens
    q, k, v = ...                                     # the model, on dispatched tokens
    out, lse = mj.magi_attention(q, k, v, key)        # [padded_total, H, D], [.., H]
    y = mj.undispatch(out, key)                       # back to natural order

Host planning lives in :mod:`magi_jax.planning` (its front door names what this layer uses).
Here, on the device, four wings: :mod:`~magi_jax.sharding.keys` (keys: their options, their
planning, a batch of them, what they put on the wire), :mod:`~magi_jax.sharding.transport`
(``group_cast``/``group_reduce`` over static int32 tables, one module per transport, the
native C++ FFI transport among them), the dispatched layout (:mod:`layout`, :mod:`roll`) and
attention (:mod:`attention` the per-rank pipeline under ``shard_map``, :mod:`attention_checks`
its inputs checked at the door, :mod:`ffa_backends` per-rank FFA: ``xla`` | ``pallas``,
:mod:`calibrate` overlap degrees chosen by timing on the mesh).
Comm/compute/both timings for overlap measurements are in ``benchmarks/probe.py``.

Dispatch gathers over the whole sequence: dispatch token ids (or the embedding output) once
and keep activations in dispatched order between layers, rather than dispatching large
activations per layer.
"""

from magi_jax import _moved
from magi_jax.planning import solve_dispatch
from magi_jax.sharding.attention import magi_attention, magi_attention_local
from magi_jax.sharding.calibrate import (
    OverlapCalibration,
    calibrate_overlap,
    clear_overlap_calibrations,
    overlap_calibrations,
)
from magi_jax.sharding.keys import (
    MagiKey,
    batch_rows,
    make_batch_key,
    make_flex_key,
    make_varlen_key,
)
from magi_jax.sharding.layout import DispatchedArray, dispatch, position_ids, undispatch
from magi_jax.sharding.roll import roll
from magi_jax.sharding.transport import group_cast, group_reduce, native

__all__ = [
    "DispatchedArray",
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
    "native",
    "position_ids",
    "roll",
    "solve_dispatch",
    "undispatch",
]

# The modules that moved away, by their old names.
__getattr__ = _moved.old_children(__name__)
