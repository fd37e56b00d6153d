"""One switch for the library's caches: :func:`clear_caches`.

Host plans are cached by mask fingerprint (work lists, dispatches, distributed plans) and
keys by their arguments, in a cache bounded by the bytes of its keys' device arrays
(:func:`magi_jax.sharding.make_key.clear_key_cache` sets the bound)."""

from __future__ import annotations

__all__ = ["clear_caches"]


def clear_caches():
    """Drops every cached plan and key (their device arrays are freed once nothing else
    holds them). Compiled functions stay cached by JAX."""
    from magi_jax.planning import defaults, solver, stages, work_list

    work_list.plan_for_mask.cache_clear()
    work_list._schedule.cache_clear()
    solver.solve_dispatch.cache_clear()
    solver._solve_kv.cache_clear()
    defaults.capacity_overlap_degree.cache_clear()
    stages.clear_cache()
    import sys

    key = sys.modules.get("magi_jax.sharding.make_key")
    if key is not None:
        key.clear_key_cache()
    roll = sys.modules.get("magi_jax.sharding.roll")
    if roll is not None:
        roll.clear_roll_cache()
