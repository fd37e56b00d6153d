"""Host planning (pure NumPy; nothing here imports JAX, directly or through its imports).

:mod:`~magi_jax.planning.tiling` (work items), :mod:`~magi_jax.planning.work_list` (the
work lists every FFA backend reads, one format; :mod:`~magi_jax.planning.item_runs` the runs
of items they are built from), :mod:`~magi_jax.planning.capacity` (the
bounds that fix a plan's shapes; :mod:`~magi_jax.planning.errors` the error when a mask
needs more), :mod:`~magi_jax.planning.backends` (the FFA backends' names),
:mod:`~magi_jax.planning.persistence` (when the persistent kernels pay),
:mod:`~magi_jax.planning.intervals` (integer ranges), :mod:`~magi_jax.planning.solver`
(which chunks each rank owns), :mod:`~magi_jax.planning.cast_table` (group-cast tables),
:mod:`~magi_jax.planning.stages` (the distributed plan: per-rank stages and exactly-needed
remote KV) and :mod:`~magi_jax.planning.defaults` (its defaults, and what a sample of masks
needs).
"""
