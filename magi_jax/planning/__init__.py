"""Host planning (pure NumPy; nothing here imports JAX, directly or through its imports).

:mod:`~magi_jax.planning.tiling` (work items), :mod:`~magi_jax.planning.work_list` (the
work lists every FFA backend reads, one format), :mod:`~magi_jax.planning.capacity` (the
bounds that fix a plan's shapes), :mod:`~magi_jax.planning.backends` (planning by backend
name), :mod:`~magi_jax.planning.solver` (which chunks each rank owns),
:mod:`~magi_jax.planning.cast_table` (group-cast tables) and :mod:`~magi_jax.planning.stages`
(the distributed plan: per-rank stages and exactly-needed remote KV).
"""
