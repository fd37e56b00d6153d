"""Batched keys: one plan per batch row, rows sharded over the batch axes
(:func:`make_batch_key`), and the rows a process plans (:func:`batch_rows`). Every row is
planned as :func:`~magi_jax.sharding.make_flex_key` plans one mask (its
:func:`~magi_jax.sharding.keys._resolve.resolve_options` and
:func:`~magi_jax.sharding.keys._host.host_key`), at one capacity, and the rows' arrays stack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from magi_jax.masks import AttnMask
from magi_jax.planning import PlanCapacity
from magi_jax.sharding.keys._host import HostKey, host_key
from magi_jax.sharding.keys._key import (
    KeyStatic,
    MagiKey,
    axes_entry,
    check_mesh,
    check_pod_axes,
    normal_cp_axis,
)
from magi_jax.sharding.keys._options import KeyOptions
from magi_jax.sharding.keys._resolve import resolve_options


def batch_rows(mesh: Mesh, batch_axes: str | Sequence[str], batch: int) -> np.ndarray:
    """int ``[n]``: the global batch rows (of ``batch``) that this process's devices hold
    when the batch axis is sharded over ``batch_axes``, ascending — the rows a process
    plans for :func:`make_batch_key`, and the order of its rows in
    ``jax.make_array_from_process_local_data``."""
    axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    shards = int(np.prod([mesh.shape[a] for a in axes]))
    if batch < 1 or batch % shards:
        raise ValueError(
            f"batch={batch} rows cannot be split evenly over batch_axes={axes!r} "
            f"({shards} shards): use a multiple of {shards}"
        )
    held = NamedSharding(mesh, P(axes_entry(axes))).addressable_devices_indices_map((batch,))
    rows = set()
    for (index,) in held.values():
        rows.update(range(*index.indices(batch)))
    return np.array(sorted(rows), np.int64)


def make_batch_key(
    masks: Sequence[AttnMask | None] | Callable[[int], AttnMask],
    mesh: Mesh,
    cp_axis: str = "cp",
    *,
    batch_axes: str | Sequence[str],
    capacity: PlanCapacity,
    batch: int | None = None,
    **options: Any,
) -> MagiKey:
    """One plan per batch row, at one capacity: a key for ``[B, T, H, D]`` inputs whose rows
    each have their own packing (every data-parallel replica, and every row of it, its own
    documents), with the rows sharded over ``batch_axes``.

    Args:
      masks: the rows' masks: a sequence of ``B`` masks (entries of rows this process does
        not hold are never read and may be ``None``), or a function ``row -> AttnMask``
        called for this process's rows only (:func:`batch_rows`).
      mesh, cp_axis: as for :func:`make_flex_key`.
      batch_axes: the mesh axes the batch is sharded over (e.g. ``("dp",)`` or ``("dp",
        "fsdp")``); ``B`` must divide by their size.
      capacity: a :class:`~magi_jax.planning.capacity.PlanCapacity` every row's mask fits
        (it fixes the shapes, so the rows stack; a row that needs more raises
        :class:`~magi_jax.planning.capacity.CapacityError`).
      batch: ``B`` (default ``len(masks)``; needed when ``masks`` is a function).
      options: the other options of :func:`make_flex_key` (``head_axes``, ``comm_backend``,
        ``ffa_backend``, ...); ``dispatch_from`` and ``check_dispatch`` are for keys of one
        mask.

    Each process plans only the rows its devices hold (host time grows with its local rows,
    not with ``B``), and fills only its own shards (``jax.make_array_from_callback``). The
    key's leaves have a leading ``[B]`` axis sharded over ``batch_axes``; its static part
    depends on (mesh, axes, capacity, options, ``B``) only, so a jitted step taking the key
    as an argument compiles once for every batch of packings. Lay arrays out with
    ``dispatch(x, key, seq_axis=1)`` (``x`` ``[B, total, ...]``), attend with
    :func:`~magi_jax.magi_attention`, and ``position_ids(key)`` is ``[B, padded_total]``.
    """
    if capacity is None or not isinstance(capacity, PlanCapacity):
        raise ValueError(
            f"make_batch_key: capacity={capacity!r}; a batched key needs a PlanCapacity "
            "(its rows' plans stack into arrays of the capacity's shapes): e.g. "
            "capacity=mj.PlanCapacity.from_masks(sample, mesh_size=cp)"
        )
    for name in ("dispatch_from", "check_dispatch"):
        if options.get(name) is not None:
            raise ValueError(
                f"make_batch_key: {name}= is for keys of one mask (make_flex_key); "
                "leave it unset here"
            )
    unknown = sorted(set(options) - set(KeyOptions.names()))
    if unknown:
        raise TypeError(f"make_batch_key: unknown options {unknown}; see make_flex_key")
    if isinstance(masks, AttnMask):
        raise TypeError(
            f"make_batch_key: masks is one AttnMask ({masks.total_q} tokens); a batched key "
            "takes one mask per batch row: masks=[mask_0, ..., mask_{B-1}] (or [mask] * B for "
            "the same packing in every row), or a function row -> AttnMask with batch=B. For "
            "one mask shared by every row, make_flex_key(mask, mesh, cp_axis, "
            "batch_axes=...) makes a key of one plan"
        )
    if callable(masks):
        if batch is None:
            raise ValueError(
                "make_batch_key: masks is a function, so pass batch= (the global batch size)"
            )
        mask_of = masks
    else:
        try:
            masks = list(masks)
        except TypeError:
            raise TypeError(
                f"make_batch_key: masks must be a sequence of AttnMask (one per batch row) or "
                f"a function row -> AttnMask; got {type(masks).__name__}"
            ) from None
        if batch is not None and batch != len(masks):
            raise ValueError(f"make_batch_key: batch={batch} but {len(masks)} masks were given")
        batch = len(masks)
        mask_of = masks.__getitem__
    cp_axis = normal_cp_axis(cp_axis)
    check_mesh(mesh, cp_axis)
    axes, _ = check_pod_axes(mesh, cp_axis, batch_axes, options.get("head_axes", ()))
    if not axes:
        raise ValueError(
            "make_batch_key: batch_axes=() names no mesh axis; name the data-parallel "
            "axes the batch is sharded over, e.g. batch_axes=('dp',) (a mesh with no such "
            "axis: batch_axes of a size-1 axis, or make_flex_key for one mask)"
        )
    opts = KeyOptions(**{**options, "capacity": capacity, "batch_axes": axes})
    hosts = {}
    for row in batch_rows(mesh, axes, batch):
        mask = mask_of(int(row))
        if mask is None:
            raise ValueError(
                f"make_batch_key: row {row} is held by this process but its mask is None"
            )
        hosts[int(row)] = host_key(resolve_options(mask, mesh, cp_axis, opts))
    first = next(iter(hosts.values()))
    for row, hk in hosts.items():
        if hk.static != first.static:
            raise ValueError(
                f"make_batch_key: row {row}'s plan has another static part than row "
                f"{next(iter(hosts))}'s at this capacity ({_static_diff(first.static, hk.static)}"
                "); build the capacity with the fields fixed (chunk_size, overlap_degree)"
            )
    static = dataclasses.replace(first.static, rows=batch)
    entry = axes_entry(axes)
    by_row = NamedSharding(mesh, P(entry))
    by_row_rank = NamedSharding(mesh, P(entry, cp_axis))

    def parts(hk: HostKey) -> tuple:
        return (
            hk.chunk_order,
            hk.chunk_inverse,
            hk.stage_arrays,
            hk.kv_chunks,
            hk.backward_stage_arrays,
            hk.plan_id,
        )

    # Leaf i of the key is the rows' leaves i stacked, [B, ...]: each process fills only
    # the rows its devices hold (the other rows are never planned here).
    leaves = {row: jax.tree.leaves(parts(hk)) for row, hk in hosts.items()}
    mine = leaves[next(iter(hosts))]
    shardings = jax.tree.leaves(
        (by_row, by_row, jax.tree.map(lambda _: by_row_rank, first.stage_arrays))
        + (tuple(by_row for _ in first.kv_chunks),)
        + (jax.tree.map(lambda _: by_row_rank, first.backward_stage_arrays), by_row_rank)
    )

    def stacked(i: int, sharding: NamedSharding) -> jax.Array:
        def fill(index):
            rows = range(*index[0].indices(batch))
            block = np.stack([np.asarray(leaves[r][i], np.int32) for r in rows])
            return block[(slice(None),) + tuple(index[1:])]

        return jax.make_array_from_callback((batch,) + mine[i].shape, sharding, fill)

    tree = jax.tree.structure(parts(first))
    order, inverse, stage_arrays, kv, backward, plan_id = jax.tree.unflatten(
        tree, [stacked(i, sh) for i, sh in enumerate(shardings)]
    )
    return MagiKey(
        static, order, inverse, stage_arrays, *kv, backward_stage_arrays=backward, plan_id=plan_id
    )


def _static_diff(a: KeyStatic, b: KeyStatic) -> str:
    diff = [
        f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
        for f in dataclasses.fields(a)
        if getattr(a, f.name) != getattr(b, f.name)
    ]
    return "; ".join(diff)[:400]
