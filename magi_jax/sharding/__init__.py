"""Context parallelism: dispatch solver, distributed plan, group collectives, ``shard_map``
attention and keys (DESIGN.md §3)."""

from magi_jax.sharding.attention import magi_attention, magi_attention_local
from magi_jax.sharding.collectives import group_cast, group_reduce
from magi_jax.sharding.key import (MagiKey, dispatch, make_flex_key, make_varlen_key,
                                   position_ids, undispatch)
from magi_jax.sharding.solver import solve_dispatch

__all__ = ["MagiKey", "dispatch", "group_cast", "group_reduce", "magi_attention",
           "magi_attention_local", "make_flex_key", "make_varlen_key", "position_ids",
           "solve_dispatch", "undispatch"]
