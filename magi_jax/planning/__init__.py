"""Host planning (pure NumPy; nothing here imports JAX, directly or through its imports).

:mod:`~magi_jax.planning.tiling` (work items and lanes), :mod:`~magi_jax.planning.lanes`
(plans of the ``xla`` backend), :mod:`~magi_jax.planning.work_list` (work lists of the
Mosaic GPU kernels), :mod:`~magi_jax.planning.backends` (both by backend name),
:mod:`~magi_jax.planning.solver` (which chunks each rank owns),
:mod:`~magi_jax.planning.cast_table` (group-cast tables) and :mod:`~magi_jax.planning.stages`
(the distributed plan: per-rank stages and exactly-needed remote KV).
"""
