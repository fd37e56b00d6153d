"""Context parallelism: dispatch solver, distributed plan, group collectives, ``shard_map``
attention and keys (DESIGN.md §3).

    mesh = jax.make_mesh((8,), ("cp",))
    key = mj.make_flex_key(mask, mesh, "cp")          # host planning, cached
    x = mj.dispatch(tokens_or_activations, key)       # natural -> dispatched, sharded on cp
    pos = mj.position_ids(key)                        # RoPE positions of dispatched tokens
    q, k, v = ...                                     # the model, on dispatched tokens
    out, lse = mj.magi_attention(q, k, v, key)        # [padded_total, H, D], [.., H]
    y = mj.undispatch(out, key)                       # back to natural order

Layers: :mod:`solver` (which chunks each rank owns), :mod:`dist_plan` (per-rank stages and
exactly-needed remote KV), :mod:`collectives` (``group_cast``/``group_reduce`` over static
int32 tables; XLA transports), :mod:`attention` (the per-rank pipeline under ``shard_map``),
:mod:`key` (keys, dispatch), :mod:`ffa_backends` (per-rank FFA: ``xla`` | ``pallas``),
:mod:`probe` (comm/compute/both timings for overlap measurements).

Dispatch gathers over the whole sequence: dispatch token ids (or the embedding output) once
and keep activations in dispatched order between layers, rather than dispatching large
activations per layer.
"""

from magi_jax.sharding.attention import magi_attention, magi_attention_local
from magi_jax.sharding.collectives import group_cast, group_reduce
from magi_jax.sharding.key import (MagiKey, dispatch, make_flex_key, make_varlen_key,
                                   position_ids, undispatch)
from magi_jax.sharding.solver import solve_dispatch

__all__ = ["MagiKey", "dispatch", "group_cast", "group_reduce", "magi_attention",
           "magi_attention_local", "make_flex_key", "make_varlen_key", "position_ids",
           "solve_dispatch", "undispatch"]
