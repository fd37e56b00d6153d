"""Plan capacities: the bounds that fix the shapes of a plan's arrays (host NumPy, no JAX).

A plan built *at a capacity* has arrays whose shapes, and a static part, that depend on the
capacity alone, never on the mask: a jitted step that takes the plan (or the context-parallel
key) as an argument then compiles once for every mask within the capacity. The kernels walk
only the real work of a plan (its CSR offsets say where each tile's items end), so capacity
that a mask does not use costs memory, not time.

A mask that needs more than its capacity holds is rejected with a ``ValueError`` that names
the limit, the value the mask needs and the call that fixes it (:class:`CapacityError`).
:meth:`PlanCapacity.list_sizes` turns a capacity into the sizes of one call's work lists
(every planner sizes its lists there), :meth:`PlanCapacity.grow` is the one rule that
enlarges a capacity (``from_masks``, the calibration and
:class:`~magi_jax.planning.growth.CapacityPolicy` grow by it), and a capacity round-trips
through a small JSON file (:meth:`PlanCapacity.save`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping

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
    "GROWN_FIELDS",
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


# The bounds a capacity measures and grows: each counts something per call (per rank and
# stage under context parallelism), and a plan's array shapes follow from them.
GROWN_FIELDS = (
    "items",
    "q_runs",
    "k_runs",
    "host_q_runs",
    "host_k_runs",
    "remote_kv",
    "cast_width",
    "send_runs",
    "recv_runs",
)


def default_items(
    total_q: int, total_k: int, mesh_size: int | None = None, chunk_size: int | None = None
) -> int:
    """Work items of the default capacity, enough for any mask of ``total_q × total_k``
    whose documents or slices each hold a row or more.

    Single device (``mesh_size=None``): every tile of the dense rectangle, plus one item for
    every query row (a tile cut by ``n`` documents holds ``n`` items) and room for slices
    that cut tiles. Context parallelism over ``mesh_size`` ranks (per rank and stage): a
    rank's rows and keys come in chunks of ``chunk_size`` tokens (default: the capacity
    keys' chunk), and a stage's slices are cut at chunk and tile boundaries, so the dense
    count is (the rank's row pieces) × (the key pieces), plus one item per local row for
    documents; at 1 rank the larger of this and the single-device count."""
    nq, nk = tile_count(total_q), tile_count(total_k)
    single = nq * nk + _BOUNDARY_ITEMS_PER_TILE_ROW * (nq + nk) + int(total_q)
    if mesh_size is None:
        return single
    cp = int(mesh_size)
    if chunk_size is None:
        from magi_jax.planning.defaults import capacity_chunk_size

        chunk_size = capacity_chunk_size(total_q, cp)
    c = int(chunk_size)

    def chunks(total):  # a multiple of cp (every rank owns as many)
        return cp * -(-(-(-int(total) // c)) // cp)

    def pieces(num_chunks, length):
        """Chunk-and-tile pieces of ``length`` tokens cut into ``num_chunks`` chunks: the
        larger count where one size divides the other (aligned), else both cuts."""
        tiles = tile_count(length)
        aligned = c % CAPACITY_TILE == 0 or CAPACITY_TILE % c == 0
        return max(num_chunks, tiles) if aligned else num_chunks + tiles

    n_q, n_k = chunks(total_q), max(chunks(total_q), chunks(total_k))
    local = n_q // cp * c
    per_rank = pieces(n_q // cp, local) * pieces(n_k, n_k * c) + local
    return per_rank if cp > 1 else max(per_rank, single)


def _mesh_sizes(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    values = (value,) if isinstance(value, (int, np.integer)) else value
    try:
        sizes = tuple(values)
    except TypeError:
        sizes = ()
    ok = len(sizes) > 0 and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in sizes
    )
    if not ok:
        raise ValueError(
            f"PlanCapacity.mesh_size={value!r} must be a positive number of context-parallel "
            "ranks (or a tuple of them, or None for any)"
        )
    return tuple(sorted({int(v) for v in sizes}))


@dataclasses.dataclass(frozen=True)
class PlanCapacity:
    """Bounds of a plan. All counts are per call of the attention kernels (for context
    parallelism: per rank and stage).

    Args:
      total_q, total_k: sequence lengths (``total_k`` defaults to ``total_q``). Single-device
        plans are for exactly these lengths; context-parallel keys for this packed total.
      items: work items per call, counted as (slice, q-tile, k-tile) triples on tiles of
        :data:`CAPACITY_TILE` tokens (:func:`magi_jax.planning.tiling.tile_items`); each
        backend sizes its own lists from it (:meth:`list_sizes`). Default ``None``:
        :func:`default_items` at the mesh size the plan is built for, which holds any mask of
        these lengths, dense ones and many short documents included.
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
      mesh_size: the context-parallel mesh size(s) the capacity is built for (an int or a
        tuple; ``1`` or absent: single-device plans too). Measured fields hold per rank of
        one mesh size, so a key at a size not recorded here is refused (``ValueError``
        naming ``mesh_size``). Default ``None``: any size (every field at its default holds
        every mask at every size). :meth:`from_masks` records the size it measured at.
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
    mesh_size: int | tuple[int, ...] | None = None

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
        object.__setattr__(self, "mesh_size", _mesh_sizes(self.mesh_size))
        for name in (*GROWN_FIELDS, "chunk_size"):
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
        grow = lambda x: _grown(x, headroom)
        fields = dict(total_q=total_q, total_k=total_k)
        if mesh_size is not None:
            fields["mesh_size"] = int(mesh_size)
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

    def items_at(self, mesh_size: int | None = None, chunk_size: int | None = None) -> int:
        """Work items per call at ``mesh_size`` ranks (``None``: a single-device plan): the
        ``items`` field, or :func:`default_items` there (``chunk_size``: the keys' chunk,
        default the capacity's)."""
        if self.items is not None:
            return self.items
        return default_items(self.total_q, self.total_k, mesh_size, chunk_size or self.chunk_size)

    def check_mesh_size(self, mesh_size: int) -> None:
        """Raises ``ValueError`` naming ``mesh_size`` when the capacity is not built for
        ``mesh_size`` ranks (its measured fields hold per rank of another mesh)."""
        if self.mesh_size is None or int(mesh_size) in self.mesh_size:
            return
        have = self.mesh_size[0] if len(self.mesh_size) == 1 else self.mesh_size
        raise ValueError(
            f"this PlanCapacity is built for mesh_size={have} but the key's context-parallel "
            f"axis has {int(mesh_size)} ranks: its bounds are per rank, so they do not carry "
            f"to another mesh size. Build one for this mesh: PlanCapacity.from_masks(sample, "
            f"mesh_size={int(mesh_size)}) (or PlanCapacity({self.total_q}, mesh_size="
            f"{int(mesh_size)}))"
        )

    def grow(
        self,
        needs: Mapping[str, int | None] | None = None,
        *,
        headroom: float = HEADROOM,
        mesh_size: int | None = None,
        **more: int | None,
    ) -> PlanCapacity:
        """This capacity with every field of :data:`GROWN_FIELDS` that holds less than
        ``needs`` (a mapping, or keyword arguments: ``capacity.grow(items=600)``) raised to
        the need times ``headroom``; fields that hold enough (:meth:`held` at ``mesh_size``),
        defaults that hold anything, and needs of ``None`` stay.
        The one rule by which capacities grow (:meth:`from_masks`' headroom, the overlap
        calibration, :class:`~magi_jax.planning.growth.CapacityPolicy`)."""
        if headroom < 1:
            raise ValueError(f"headroom={headroom} must be >= 1")
        needs = {**(needs or {}), **more}
        unknown = sorted(set(needs) - set(GROWN_FIELDS))
        if unknown:
            raise ValueError(f"grow: {unknown} are not fields that grow; use {GROWN_FIELDS}")
        fields = {}
        for name, need in needs.items():
            if need is None:
                continue
            have = self.held(name, mesh_size)
            if have is not None and int(need) > have:
                fields[name] = _grown(int(need), headroom)
        return dataclasses.replace(self, **fields) if fields else self

    def held(self, name: str, mesh_size: int | None = None) -> int | None:
        """What field ``name`` holds (its default resolved for ``items``, at ``mesh_size``
        or the largest recorded one); ``None``: unbounded (a default that holds anything,
        e.g. ``remote_kv``: every token a rank does not own)."""
        if name == "items":
            if mesh_size is None and self.mesh_size is not None:
                return max(self.items_at(m) for m in self.mesh_size)
            return self.items_at(mesh_size)
        if name in ("host_q_runs", "host_k_runs") and getattr(self, name) is None:
            return self.q_runs if name == "host_q_runs" else self.k_runs
        return getattr(self, name)

    # ---- a small file beside a checkpoint ----------------------------------------------

    def to_dict(self) -> dict:
        """The fields as JSON-ready values (``mesh_size`` a list or ``None``)."""
        out = dataclasses.asdict(self)
        if self.mesh_size is not None:
            out["mesh_size"] = list(self.mesh_size)
        return out

    @classmethod
    def from_dict(cls, fields: Mapping) -> PlanCapacity:
        """The capacity of :meth:`to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"PlanCapacity fields {unknown} are unknown; known: {sorted(known)}")
        return cls(**fields)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the capacity to ``path`` as JSON (a few hundred bytes), e.g. beside an
        Orbax checkpoint, so a resumed run starts with the capacity it had grown to."""
        with open(path, "w") as f:
            json.dump({"PlanCapacity": self.to_dict()}, f, indent=1, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> PlanCapacity:
        """The capacity :meth:`save` wrote to ``path``."""
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or "PlanCapacity" not in data:
            raise ValueError(f"{os.fspath(path)!r} holds no PlanCapacity (write it with save)")
        return cls.from_dict(data["PlanCapacity"])

    def runs(self, host: bool) -> tuple[int | None, int | None]:
        """``(q, k)`` run bounds of a host stage's lists (``host``) or of any other call's:
        ``host_q_runs`` / ``host_k_runs``, each defaulting to ``q_runs`` / ``k_runs``."""
        if not host:
            return self.q_runs, self.k_runs
        return (
            self.q_runs if self.host_q_runs is None else self.host_q_runs,
            self.k_runs if self.host_k_runs is None else self.host_k_runs,
        )

    def list_sizes(
        self,
        fwd_block: tuple[int, int],
        bwd_block: tuple[int, int],
        *,
        mesh_size: int | None = None,
        chunk_size: int | None = None,
        host: bool = False,
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(items, runs)``: the item and run widths ``(q-tile list, k-tile list)`` of one
        call's work lists at this capacity — the one place a plan's list shapes come from
        (single-device plans, traced segment-id plans and every stage of a key).

        ``fwd_block`` / ``bwd_block``: the backend's ``(block_q, block_k)`` of the two
        lists; the k-tile list steps over tiles of fewer rows where they differ (the Mosaic
        GPU kernels: 64 against 128), and every q-list item holds at most that ratio of
        them. ``mesh_size``: ranks of the key (``None``: a single-device plan),
        ``chunk_size`` its dispatch chunk; ``host``: the host stage's run bounds
        (:meth:`runs`). Runs never exceed a list's items (a run holds one or more)."""
        per_item = max(1, int(fwd_block[0]) // int(bwd_block[0]))
        n = self.items_at(mesh_size, chunk_size)
        items = (n, n * per_item)
        runs = tuple(
            int(width) if bound is None else min(int(bound), int(width))
            for bound, width in zip(self.runs(host), items)
        )
        return items, runs

    def check(self, field: str, needed: int, what: str = "this mask") -> None:
        """Raises :class:`CapacityError` when ``needed`` exceeds the capacity's ``field``."""
        have = getattr(self, field)
        if have is not None and needed > have:
            raise capacity_error(field, needed, have, what=what)


def _grown(need: int, headroom: float) -> int:
    return max(1, int(np.ceil(need * headroom)))
