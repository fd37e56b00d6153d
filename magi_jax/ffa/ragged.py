"""Ragged lists on the device: enumerating counts into fixed slots, and the expansions of
runs built on it (jnp, traceable, int32 arrays of static shape, no device loop).

A list stored as *runs* (a value and a length each) is compact on the host and in transit; the
device expands it into a table of static size by a ragged enumeration — one cumulative sum
and an unrolled binary search per slot (:func:`ragged_enumerate`) — and gathers. The host
twins of the expansions are :func:`magi_jax.planning.cast_table.expand_index_runs` (index tables,
here :func:`expand_index_runs`) and :func:`magi_jax.planning.work_list.expand_plan_runs` (work
items, here :func:`expand_item_runs`); each expansion here gives exactly its twin's arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from magi_jax.planning.tiling import EMPTY_ITEM
from magi_jax.planning.work_list import NUM_FIELDS, RUN_FIELDS

__all__ = ["take_in_bounds", "ragged_enumerate", "expand_index_runs", "expand_item_runs"]

_LENGTH = RUN_FIELDS.index("length")
_OTHER = RUN_FIELDS.index("other_tile")


def take_in_bounds(table: jax.Array, idx: jax.Array) -> jax.Array:
    """Rows ``table[idx]`` of a table whose indices ``idx`` (int32) are known to be in
    bounds (no clamping, no fill)."""
    return table.at[idx].get(mode="promise_in_bounds")


def ragged_enumerate(counts: jax.Array, size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A ragged enumeration of ``counts`` (int32 ``[n]``, ``n >= 1``, entries >= 0) into
    ``size`` slots: ``(owner, pos, total)``, the owner of each slot (int32 ``[size]``), the
    slot's position inside its owner (int32 ``[size]``) and the total (int32 scalar). Slots
    past the total get an in-bounds owner and are to be masked by the caller."""
    ends = jnp.cumsum(counts)
    slot = jnp.arange(size, dtype=jnp.int32)
    # Unrolled binary search: no device loop (on GPUs a while loop syncs with the host).
    owner = jnp.minimum(
        jnp.searchsorted(ends, slot, side="right", method="scan_unrolled").astype(jnp.int32),
        counts.shape[0] - 1,
    )
    return owner, slot - take_in_bounds(ends - counts, owner), ends[-1]


def expand_index_runs(runs: jax.Array, size: int) -> jax.Array:
    """The index table of ``runs`` (int32 ``[R, 2]`` rows ``(first value, length)``, in
    order): int32 ``[size]``, run ``i`` filling its ``length`` entries with ``value,
    value + 1, ...`` (``-1`` for ``value < 0``: padding) and ``-1`` past the last run. The
    device twin of :func:`magi_jax.planning.cast_table.expand_index_runs`."""
    runs = jnp.asarray(runs, jnp.int32)
    owner, pos, total = ragged_enumerate(runs[:, 1], size)
    value = take_in_bounds(runs[:, 0], owner)
    real = (jnp.arange(size, dtype=jnp.int32) < total) & (value >= 0)
    return jnp.where(real, value + pos, -1).astype(jnp.int32)


def expand_item_runs(runs: jax.Array, num_items: int) -> jax.Array:
    """Work items ``[..., num_items, 8]`` int32 of runs of items ``[..., R, 9]``
    (:data:`~magi_jax.planning.work_list.RUN_FIELDS`: consecutive items of one owned tile,
    slice and mask kind); slots past the real items are the empty item. The device twin of
    :func:`magi_jax.planning.work_list.expand_plan_runs` for one list. Leading axes are mapped
    over."""
    runs = jnp.asarray(runs, jnp.int32)
    if runs.ndim > 2:
        return jax.vmap(lambda r: expand_item_runs(r, num_items))(runs)
    empty = jnp.asarray(EMPTY_ITEM)
    if runs.shape[0] == 0 or num_items == 0:
        return jnp.broadcast_to(empty, (num_items, NUM_FIELDS))
    run, step, total = ragged_enumerate(runs[:, _LENGTH], num_items)
    first = take_in_bounds(runs, run)
    item = first[:, :NUM_FIELDS].at[:, _OTHER].add(step)
    slot = jnp.arange(num_items, dtype=jnp.int32)
    return jnp.where((slot < total)[:, None], item, empty)
