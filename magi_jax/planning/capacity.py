"""Plan capacities: the bounds that fix the shapes of a plan's arrays (host NumPy, no JAX).

A plan built *at a capacity* has arrays whose shapes, and a static part, that depend on the
capacity alone, never on the mask: a jitted step that takes the plan (or the context-parallel
key) as an argument then compiles once for every mask within the capacity. The kernels walk
only the real work of a plan (its CSR offsets say where each tile's items end), so capacity
that a mask does not use costs memory, not time.

A mask that needs more than its capacity holds is rejected with a ``ValueError`` that names
the field and the value the mask needs (:class:`CapacityError`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from magi_jax.masks import AttnMask
from magi_jax.planning.errors import CapacityError, capacity_error
from magi_jax.planning.persistent_kernels import persistent_pays

__all__ = [
    "PlanCapacity",
    "CapacityError",
    "CAPACITY_TILE",
    "HEADROOM",
    "tile_count",
    "default_items",
]

# Work items are counted on tiles of this size (the forward list of the Mosaic GPU kernels):
# a (slice, q-tile, k-tile) triple whose intersection holds a cell.
CAPACITY_TILE = 128
# Default headroom of PlanCapacity.from_masks over the largest sample (and of the capacities
# calibrate_overlap grows).
HEADROOM = 1.25
# Per row of tiles, boundary items the default item count allows beyond the dense tile count
# (tiles cut by several slices give one item per slice).
_BOUNDARY_ITEMS_PER_TILE_ROW = 32


def tile_count(tokens: int, block: int = CAPACITY_TILE) -> int:
    return max(1, -(-int(tokens) // block))


def default_items(total_q: int, total_k: int) -> int:
    """Work items of the default capacity: every tile of the dense ``Tq × Tk`` rectangle plus
    room for slices that cut tiles (a tile cut by ``n`` slices holds ``n`` items)."""
    nq, nk = tile_count(total_q), tile_count(total_k)
    return nq * nk + _BOUNDARY_ITEMS_PER_TILE_ROW * (nq + nk)


@dataclasses.dataclass(frozen=True)
class PlanCapacity:
    """Bounds of a plan. All counts are per call of the attention kernels (for context
    parallelism: per rank and stage).

    Args:
      total_q, total_k: sequence lengths (``total_k`` defaults to ``total_q``). Single-device
        plans are for exactly these lengths; context-parallel keys for this packed total.
      items: work items per call, counted as (slice, q-tile, k-tile) triples on tiles of
        :data:`CAPACITY_TILE` tokens (:func:`magi_jax.planning.tiling.tile_items`); each
        backend sizes its own lists from it. Default :func:`default_items`: any mask whose
        slices cut few tiles fits, dense ones included.
      remote_kv: context parallelism: KV tokens one rank fetches from the others, all remote
        stages together (default: every token it does not own).
      cast_width: context parallelism: KV tokens one rank sends to one other rank in one
        stage (default: a whole stage's buffer). The ``xla`` transports move this many rows
        per pair and stage whatever the mask needs; tighten it with :meth:`from_masks`.
      send_runs: context parallelism: runs of consecutive local rows one rank sends in one
        stage, all its slots together (the cast tables are stored and shipped as runs and
        expanded on the device). Default: every row a run of its own.
      recv_runs: context parallelism: runs of one rank's receive table in one stage (buffer
        rows filled by consecutive rows of one slot, padding between them counted).
        Default: every buffer row a run of its own.
      overlap_degree: context parallelism: remote stages of the forward (default: the cost
        model's choice for a causal mask of this length).
      backward_overlap_degree: context parallelism: remote stages of the backward (default:
        the forward's degree); where
        it differs from the forward's, keys carry a second stage plan for the backward, and
        the other fields must hold both plans (:meth:`from_masks` measures both).
      chunk_size: context parallelism: dispatch granularity in tokens (default: 16 chunks
        per rank).
      persistent: let the Mosaic GPU forward and dK/dV kernels run persistent programs over
        a host schedule that travels with the plan (faster on short rows: documents of a
        few thousand tokens; slightly slower on long ones).
      q_runs, k_runs: runs of work items per q-tile list (forward, dQ) and per k-tile list
        (dK/dV) of one call, on each backend's own tiles: the compact form lists are stored
        and shipped in (consecutive items of one owned tile, slice and mask kind,
        :class:`~magi_jax.planning.work_list.FFAPlanRuns`). Under context parallelism they
        bound the stages that read fetched KV (every remote stage, and the one stage of
        ``overlap_degree=0``). Default ``None``: the list's item bound (always fits, saves
        nothing); a mask of few slices needs far fewer (:meth:`from_masks` measures them).
      host_q_runs, host_k_runs: context parallelism: the same bounds for the host stage
        (a rank's queries on its own KV), whose lists hold far fewer runs than the remote
        stages' (a rank's own diagonal block against every other rank's keys). Default
        ``None``: ``q_runs`` / ``k_runs``; :meth:`from_masks` measures them apart.
    """

    total_q: int
    total_k: int | None = None
    items: int | None = None
    remote_kv: int | None = None
    cast_width: int | None = None
    send_runs: int | None = None
    recv_runs: int | None = None
    overlap_degree: int | None = None
    chunk_size: int | None = None
    persistent: bool = True
    q_runs: int | None = None
    k_runs: int | None = None
    backward_overlap_degree: int | None = None
    host_q_runs: int | None = None
    host_k_runs: int | None = None

    def __post_init__(self):
        if self.total_k is None:
            object.__setattr__(self, "total_k", self.total_q)
        for name in ("total_q", "total_k"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(
                    f"PlanCapacity.{name}={value!r} must be a positive number of tokens"
                )
            object.__setattr__(self, name, int(value))
        if self.items is None:
            object.__setattr__(self, "items", default_items(self.total_q, self.total_k))
        for name in (
            "items",
            "q_runs",
            "k_runs",
            "host_q_runs",
            "host_k_runs",
            "remote_kv",
            "cast_width",
            "send_runs",
            "recv_runs",
            "chunk_size",
        ):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(
                    f"PlanCapacity.{name}={value!r} must be a positive integer "
                    "(or None for the default)"
                )
            object.__setattr__(self, name, int(value))
        for name in ("overlap_degree", "backward_overlap_degree"):
            value = getattr(self, name)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, np.integer))
                or not 0 <= value <= 8
            ):
                raise ValueError(
                    f"PlanCapacity.{name}={value!r} must be an integer in [0, 8] (or None "
                    "for the cost model's)"
                )
            object.__setattr__(self, name, int(value))
        if self.backward_overlap_degree is None and self.overlap_degree is not None:
            object.__setattr__(self, "backward_overlap_degree", self.overlap_degree)
        object.__setattr__(self, "persistent", bool(self.persistent))

    @classmethod
    def from_masks(
        cls,
        masks: Iterable[AttnMask],
        *,
        headroom: float = HEADROOM,
        mesh_size: int | None = None,
        **fixed: int | bool | None,
    ) -> PlanCapacity:
        """The tightest capacity that holds every mask of a sample, times ``headroom``.

        ``masks``: a sample of the masks a loader produces (same lengths). Without
        ``mesh_size`` it bounds single-device plans; with ``mesh_size=cp`` it also plans
        each mask for ``cp`` ranks (:func:`magi_jax.planning.cost_model.capacity_needs`) and
        bounds the per-rank fields. ``fixed``: fields to set rather than measure;
        ``overlap_degree`` may be a pair ``(forward, backward)`` (e.g. the ``degrees`` of
        :func:`~magi_jax.sharding.calibrate.calibrate_overlap`), which sets both degrees."""
        masks = list(masks)
        if not masks:
            raise ValueError("PlanCapacity.from_masks needs at least one mask")
        if headroom < 1:
            raise ValueError(f"headroom={headroom} must be >= 1")
        tq = {m.total_q for m in masks}
        tk = {m.total_k for m in masks}
        if len(tq) != 1 or len(tk) != 1:
            raise ValueError(
                f"masks cover different lengths (total_q {sorted(tq)}, total_k "
                f"{sorted(tk)}); a capacity is for one length"
            )
        total_q, total_k = tq.pop(), tk.pop()
        if isinstance(fixed.get("overlap_degree"), (tuple, list)):
            pair = tuple(fixed["overlap_degree"])
            if len(pair) != 2 or "backward_overlap_degree" in fixed:
                raise ValueError(
                    f"overlap_degree={pair!r}: a pair is (forward, backward); give it alone "
                    "(without backward_overlap_degree), or two integer fields"
                )
            fixed = {**fixed, "overlap_degree": pair[0], "backward_overlap_degree": pair[1]}
        grow = lambda x: max(1, int(np.ceil(x * headroom)))
        fields = dict(total_q=total_q, total_k=total_k)
        # The measuring half lives beside capacity_needs (it plans the masks).
        from magi_jax.planning.cost_model import sample_needs

        need = sample_needs(
            masks,
            None if mesh_size is None else int(mesh_size),
            fixed.get("chunk_size"),
            fixed.get("overlap_degree"),
            fixed.get("backward_overlap_degree"),
        )
        grown = ("items", "q_runs", "k_runs")
        if mesh_size is not None:
            grown += ("host_q_runs", "host_k_runs")
            grown += ("remote_kv", "cast_width", "send_runs", "recv_runs")
        # A field the sample never reaches (no host stage when every key has one combined
        # stage) keeps its default.
        fields.update({f: grow(need[f]) for f in grown if need[f] is not None})
        if mesh_size is None:
            # Persistent programs pay on short rows (the forward kernel's rule).
            fields["persistent"] = persistent_pays(need["mean_items"], tile_count(total_q))
        else:
            fields.update(
                overlap_degree=need["overlap_degree"],
                backward_overlap_degree=need["backward_overlap_degree"],
                chunk_size=need["chunk_size"],
            )
        fields.update(fixed)
        return cls(**fields)

    def runs(self, host: bool) -> tuple[int | None, int | None]:
        """``(q, k)`` run bounds of a host stage's lists (``host``) or of any other call's:
        ``host_q_runs`` / ``host_k_runs``, each defaulting to ``q_runs`` / ``k_runs``."""
        if not host:
            return self.q_runs, self.k_runs
        return (
            self.q_runs if self.host_q_runs is None else self.host_q_runs,
            self.k_runs if self.host_k_runs is None else self.host_k_runs,
        )

    def check(self, field: str, needed: int, what: str = "this mask") -> None:
        """Raises :class:`CapacityError` when ``needed`` exceeds the capacity's ``field``."""
        have = getattr(self, field)
        if have is not None and needed > have:
            raise capacity_error(field, needed, have, what=what)
