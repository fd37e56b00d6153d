"""Keys: everything context-parallel attention needs for one (mask, mesh, options), plus
``dispatch`` / ``undispatch`` / ``position_ids``.

A :class:`MagiKey` is a JAX pytree: its leaves are the stacked ``[cp, ...]`` int32 plan arrays
(sharded over the mesh's cp axis) and the dispatch permutation of whole chunks
(``[num_chunks]``, replicated; ``dispatch`` / ``undispatch`` / ``position_ids`` are chunk
gathers); everything else (mesh, axis, stage shapes, transports) is static. It can be closed
over or passed through ``jax.jit``.
Building one is host work, cached by (mask fingerprint, mesh, options).

Cross attention (``total_q != total_k``) keys dispatch the queries like self-attention and
keep the keys either whole on every rank (``key.kv_layout == "replicated"``) or dispatched
by a permutation of their own (``"dispatched"``); ``dispatch(k, key, role="kv")`` puts keys
and values in whichever layout the key chose (self-attention keys: ``"shared"``, one
dispatch for both roles).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from magi_jax.mask import AttnMask
from magi_jax.planning.capacity import PlanCapacity
from magi_jax.planning.cast_table import choose_transport
from magi_jax.planning.defaults import (
    capacity_chunk_size,
    capacity_overlap_degree,
    cast_pieces,
    default_overlap_degree,
)
from magi_jax.planning.solver import ALGORITHMS, KV_LAYOUTS, solve_dispatch
from magi_jax.planning.stages import DistPlan, build_dist_plan, resolve_kv
from magi_jax.planning.work_list import default_block_sizes
from magi_jax.sharding import native
from magi_jax.sharding.collectives import TRANSPORTS, CastRuns, CastSpec
from magi_jax.sharding.ffa_backends import FFA_BACKENDS
from magi_jax.sharding.two_hop import relay_stage as _relay_stage

__all__ = [
    "MagiKey",
    "KeyStatic",
    "StageStatic",
    "CheckedKey",
    "make_flex_key",
    "make_varlen_key",
    "dispatch",
    "undispatch",
    "position_ids",
    "default_overlap_degree",
    "ffa_backend_reason",
    "clear_key_cache",
    "COMM_BACKENDS",
    "MAX_OVERLAP_DEGREE",
    "CHECK_DISPATCH_ENV",
    "KV_LAYOUTS",
    "ROLES",
]

COMM_BACKENDS = ("auto", "xla") + TRANSPORTS
# Largest overlap degree a key accepts (the bound of PlanCapacity.overlap_degree): every stage
# costs a kernel launch, a merge and a collective, and the cost model never picks more than 4.
MAX_OVERLAP_DEGREE = 8
# Environment variable that turns on check_dispatch for every key make_flex_key builds.
CHECK_DISPATCH_ENV = "MAGI_JAX_CHECK_DISPATCH"
# What dispatch / undispatch / position_ids lay out: queries (and outputs), or keys/values.
ROLES = ("q", "kv")


@dataclasses.dataclass(frozen=True)
class StageStatic:
    """Static description of one stage: its KV length, whether its KV is local KV followed
    by the cast buffer (``combined``), the cast spec (``None`` for the host stage) and the
    widths ``(q, k)`` of the item arrays its work lists expand to on the device (they travel
    as runs, :class:`~magi_jax.planning.work_list.FFAPlanRuns`)."""

    kv_len: int
    combined: bool
    cast: CastSpec | None  # or a RelaySpec (two-hop casts, hierarchical=...)
    items: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class KeyStatic:
    """The static part of a :class:`MagiKey` (its pytree aux data: part of every jit cache
    key). For a key built at a :class:`~magi_jax.planning.capacity.PlanCapacity` it depends
    on (mesh, axis, capacity, options) only, so one compilation serves every mask within the
    capacity; for a key of one mask, ``fingerprint`` names the mask and its dispatch."""

    mesh: Mesh
    cp_axis: str | tuple[str, ...]  # a tuple: cp over the flattened axes
    cp: int
    total: int
    padded_total: int
    local_len: int
    chunk_size: int
    overlap_degree: int
    block_q: int
    block_k: int
    stages: tuple[StageStatic, ...]
    ffa_backend: str
    comm_backend: str
    backward_refetch: bool
    capacity: PlanCapacity | None
    fingerprint: tuple | None
    # Where the keys live: "shared" (self-attention: the queries' dispatch), "replicated"
    # (every rank holds all total_k keys) or "dispatched" (their own permutation, kv_*).
    kv_layout: str = "shared"
    total_k: int | None = None
    kv_padded_total: int | None = None
    kv_local_len: int | None = None
    kv_chunk_size: int | None = None  # tokens per key chunk ("dispatched" only)


@jax.tree_util.register_pytree_node_class
class MagiKey:
    """Context-parallel plan of one mask on one mesh (see :func:`make_flex_key`).

    Leaves (data): the dispatch permutation of whole chunks, replicated: ``chunk_order``
    int32 ``[num_chunks]`` (the natural chunk in each dispatched chunk slot: dispatched rows
    ``[i·chunk_size, (i+1)·chunk_size)`` are natural rows ``[chunk_order[i]·chunk_size,
    ...)``; slots ``[r·chunks_per_rank, (r+1)·chunks_per_rank)`` are rank ``r``'s) and
    ``chunk_inverse`` int32 ``[num_chunks]`` (the dispatched slot of each natural chunk); and
    per stage ``stage_arrays[i] = (FFAPlanRuns, CastRuns | None)`` stacked ``[cp, ...]``
    (the work lists and cast tables as runs, expanded on the device right before each FFA
    call and collective; a two-hop stage holds ``RelayRuns``).
    ``num_chunks = padded_total / chunk_size`` is fixed by the capacity. The token-level
    permutation is ``order`` int32 ``[padded_total]`` (global position of each dispatched
    token) and ``inverse`` int32 ``[total]`` (dispatched index of each natural position),
    properties expanded from the chunk leaves on the device when read.
    Static: :class:`KeyStatic` (``key.static``; its fields are also attributes of the key).
    Host only (``None`` on a key rebuilt inside a traced function): ``plan`` (the
    :class:`~magi_jax.planning.stages.DistPlan`) and ``mask``, for pictures and inspection.

    Cross attention with ``kv_layout == "dispatched"`` adds two leaves for the keys,
    ``kv_chunk_order`` and ``kv_chunk_inverse`` int32 ``[kv_padded_total / kv_chunk_size]``
    (their token-level views: ``kv_order`` ``[kv_padded_total]``, ``kv_inverse``
    ``[total_k]``; all ``None`` otherwise: self-attention keys have no key leaves).
    """

    def __init__(
        self,
        static: KeyStatic,
        chunk_order,
        chunk_inverse,
        stage_arrays,
        kv_chunk_order=None,
        kv_chunk_inverse=None,
        *,
        plan=None,
        mask=None,
    ):
        self.static = static
        self.chunk_order = chunk_order
        self.chunk_inverse = chunk_inverse
        self.stage_arrays = stage_arrays
        self.kv_chunk_order = kv_chunk_order
        self.kv_chunk_inverse = kv_chunk_inverse
        self.plan = plan
        self.mask = mask

    def tree_flatten(self):
        children = (self.chunk_order, self.chunk_inverse, self.stage_arrays)
        if self.kv_chunk_order is not None:
            children += (self.kv_chunk_order, self.kv_chunk_inverse)
        return children, self.static

    @property
    def order(self):
        """int32 ``[padded_total]``: the global position of each dispatched token (expanded
        from ``chunk_order``)."""
        return _token_index(self.chunk_order, self.static.chunk_size)

    @property
    def inverse(self):
        """int32 ``[total]``: the dispatched index of each natural position (expanded from
        ``chunk_inverse``)."""
        return _token_index(self.chunk_inverse, self.static.chunk_size)[: self.static.total]

    @property
    def kv_order(self):
        """int32 ``[kv_padded_total]``: the global position of each dispatched key
        (``None`` unless ``kv_layout == "dispatched"``)."""
        if self.kv_chunk_order is None:
            return None
        return _token_index(self.kv_chunk_order, self.static.kv_chunk_size)

    @property
    def kv_inverse(self):
        """int32 ``[total_k]``: the dispatched index of each natural key position (``None``
        unless ``kv_layout == "dispatched"``)."""
        if self.kv_chunk_inverse is None:
            return None
        return _token_index(self.kv_chunk_inverse, self.static.kv_chunk_size)[: self.static.total_k]

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(static, *children)

    mesh = property(lambda self: self.static.mesh)
    cp_axis = property(lambda self: self.static.cp_axis)
    cp = property(lambda self: self.static.cp)
    total = property(lambda self: self.static.total)
    padded_total = property(lambda self: self.static.padded_total)
    local_len = property(lambda self: self.static.local_len)
    chunk_size = property(lambda self: self.static.chunk_size)
    overlap_degree = property(lambda self: self.static.overlap_degree)
    block_q = property(lambda self: self.static.block_q)
    block_k = property(lambda self: self.static.block_k)
    stages = property(lambda self: self.static.stages)
    ffa_backend = property(lambda self: self.static.ffa_backend)
    comm_backend = property(lambda self: self.static.comm_backend)
    backward_refetch = property(lambda self: self.static.backward_refetch)
    capacity = property(lambda self: self.static.capacity)
    kv_layout = property(lambda self: self.static.kv_layout)
    cross = property(lambda self: self.static.kv_layout != "shared")
    total_k = property(
        lambda self: self.static.total if self.static.total_k is None else self.static.total_k
    )
    kv_padded_total = property(
        lambda self: self.padded_total if not self.cross else self.static.kv_padded_total
    )
    kv_local_len = property(
        lambda self: self.local_len if not self.cross else self.static.kv_local_len
    )

    def nbytes(self) -> int:
        """Bytes of the key's device arrays (all ranks together)."""
        return int(sum(a.nbytes for a in jax.tree.leaves(self)))

    def plot(self, path=None, **kwargs):
        """Picture of the plan (PNG at ``path``); see :func:`magi_jax.plot.plot_plan`."""
        if self.plan is None:
            raise ValueError(
                "this key carries no host plan (it was rebuilt inside a traced "
                "function); plot the key make_flex_key returned"
            )
        from magi_jax.plot import plot_key

        return plot_key(self, path, **kwargs)

    def __repr__(self):
        extra = ""
        if self.plan is not None:
            p = self.plan
            extra = (
                f", imbalance={p.meta.imbalance():.4f}, "
                f"max_remote_kv={int(p.remote_tokens.max(initial=0))}"
            )
        cap = "" if self.capacity is None else ", capacity"
        cross = f", total_k={self.total_k}, kv_layout={self.kv_layout!r}" if self.cross else ""
        return (
            f"MagiKey(cp={self.cp}, total={self.total}, padded_total={self.padded_total}, "
            f"chunk_size={self.chunk_size}, overlap_degree={self.overlap_degree}"
            f"{cross}{extra}{cap})"
        )


def _check_mesh(mesh, cp_axis):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    try:
        names = _cp_names(cp_axis)
    except TypeError:  # neither a name nor a tuple of names (e.g. 0, None)
        names = ()
    if (
        not names
        or len(set(names)) != len(names)
        or any(not isinstance(a, str) or a not in mesh.axis_names for a in names)
    ):
        raise ValueError(
            f"cp_axis={cp_axis!r} is not an axis of the mesh (axes: "
            f"{mesh.axis_names}); pass the name of the context-parallel axis, "
            "or a tuple of distinct axis names (e.g. ('node', 'local')) to "
            "spread context parallelism over their flattening"
        )
    return int(np.prod([mesh.shape[a] for a in names]))


# ---- cp over several mesh axes (a tuple cp_axis: the flattened axes, the first major) -------


def _cp_names(cp_axis) -> tuple:
    """The mesh axes a cp axis spans: ``("cp",)`` for ``"cp"``, the tuple itself else."""
    return (cp_axis,) if isinstance(cp_axis, str) else tuple(cp_axis)


def _cp_ranks(mesh: Mesh, cp_axis) -> dict:
    """Each device's cp rank: its index along the flattened cp axes (the first major)."""
    idx = [mesh.axis_names.index(a) for a in _cp_names(cp_axis)]
    sizes = [int(mesh.shape[a]) for a in _cp_names(cp_axis)]
    return {
        d: int(np.ravel_multi_index([pos[i] for i in idx], sizes))
        for pos, d in np.ndenumerate(mesh.devices)
    }


def _normal_cp_axis(cp_axis):
    """A hashable cp axis: a name, or a tuple of two names or more (a 1-tuple is its name)."""
    if isinstance(cp_axis, (tuple, list)):
        cp_axis = tuple(cp_axis)
        return cp_axis[0] if len(cp_axis) == 1 else cp_axis
    return cp_axis


HIERARCHICAL = (True, False, "auto")


def _relay_layout(mesh, cp_axis, hierarchical, comm_backend, capacity):
    """The :class:`~magi_jax.planning.hierarchy.NodeLayout` of a key's two-hop casts and
    whether they are forced (``(layout, forced)``), or ``None`` for flat casts."""
    if not (
        isinstance(hierarchical, bool) or (isinstance(hierarchical, str) and hierarchical == "auto")
    ):
        raise ValueError(
            f"hierarchical={hierarchical!r} must be True, False or 'auto' (two-hop "
            "casts on a mesh of nodes; 'auto': where they move fewer rows between "
            "nodes)"
        )
    names = _cp_names(cp_axis)
    if hierarchical is True:
        if len(names) != 2:
            raise ValueError(
                f"hierarchical=True needs cp_axis=(node_axis, local_axis), two "
                f"mesh axes; got cp_axis={cp_axis!r}: build the mesh with a node "
                "axis and a local axis, e.g. jax.make_mesh((nodes, gpus_per_node)"
                ", ('node', 'local')), or pass hierarchical=False"
            )
        if comm_backend in ("all_to_all", "native"):
            raise ValueError(
                f"hierarchical=True runs on lax.ppermute (comm_backend='xla', "
                f"'ppermute' or 'auto'); got comm_backend={comm_backend!r}: "
                "pass one of those or hierarchical=False"
            )
    if hierarchical is False or len(names) != 2 or comm_backend in ("all_to_all", "native"):
        return None
    from magi_jax.planning.hierarchy import NodeLayout

    layout = NodeLayout(int(mesh.shape[names[0]]), int(mesh.shape[names[1]]))
    if hierarchical == "auto" and (layout.nodes == 1 or layout.local == 1):
        return None
    # At a capacity the choice cannot follow the mask (the static part would): its gated
    # two-hop casts are taken (benchmarks/results/wire/LATEST.md counts them).
    return layout, hierarchical is True or capacity is not None


def make_flex_key(
    mask: AttnMask,
    mesh: Mesh,
    cp_axis: str = "cp",
    *,
    chunk_size: int | None = None,
    overlap_degree: int | None = None,
    comm_backend: str = "auto",
    dispatch_algorithm: str = "magi",
    dispatch_from: MagiKey | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    ffa_backend: str = "auto",
    backward_refetch: bool = True,
    capacity: PlanCapacity | None = None,
    check_dispatch: bool | None = None,
    kv_layout: str = "auto",
    hierarchical: bool | str = "auto",
) -> MagiKey:
    """Plans context-parallel attention of ``mask`` over ``mesh``'s ``cp_axis``.

    Args:
      mask: an :class:`AttnMask` over the packed sequence in natural order: self-attention
        (``total_q == total_k``) or cross attention (``total_q`` queries of one sequence,
        ``total_k`` keys of another, e.g. video tokens attending to text tokens). Lengths
        need not divide anything: the sequences are padded.
      mesh, cp_axis: the mesh and the name of its context-parallel axis (other axes, if any,
        see the same sequence shard: replicated), or a tuple of axis names, e.g.
        ``("node", "local")``: context parallelism over their flattening (rank
        ``node · local_size + local``; shard arrays with ``P(("node", "local"))``).
      chunk_size: dispatch granularity in tokens (default: chosen by the solver, ≥ 8 chunks
        per rank).
      overlap_degree: number of remote stages (0: fetch all remote KV, then one FFA call);
        default from a compute/communication cost model.
      comm_backend: ``"xla"`` (XLA collectives, transport per stage), ``"ppermute"``,
        ``"all_to_all"``, ``"native"`` (the FFI transport of :mod:`magi_jax.sharding.native`)
        or ``"auto"``: ``native`` on GPUs with one process per GPU when its CUDA library was
        built, else ``xla`` (``magi_jax.sharding.native.auto_reason(mesh, cp_axis)`` says
        why).
      dispatch_algorithm: one of :data:`~magi_jax.planning.solver.ALGORITHMS`.
      dispatch_from: reuse this key's dispatch (same chunks on the same ranks) for another
        mask over the same sequence — layers with different masks share one dispatch.
      block_q, block_k: FFA tile sizes (default 128, smaller for short local lengths).
      ffa_backend: per-rank FFA implementation: ``"auto"`` (default: ``"pallas"`` when the
        default device is an sm90 GPU, else ``"xla"``; :func:`ffa_backend_reason` says why),
        ``"xla"`` (portable) or ``"pallas"`` (Mosaic GPU kernels: Hopper, bf16/fp16, D 64/128;
        :func:`~magi_jax.sharding.magi_attention` rejects other inputs, naming the fix).
      backward_refetch: the backward re-fetches each remote stage's KV (one more group-cast
        per stage) instead of keeping every stage's buffer from the forward (memory: local
        KV plus the stage in flight; docs/design.md §3.2). ``False`` keeps the buffers (less
        communication, more memory).
      capacity: a :class:`~magi_jax.planning.capacity.PlanCapacity` over ``total`` tokens:
        the key's arrays and static part then depend on (mesh, axis, capacity, options)
        only, so a jitted step that takes the key as an argument compiles once for every
        mask within the capacity (chunk size and overlap degree come from the capacity). A
        mask that needs more raises :class:`~magi_jax.planning.capacity.CapacityError`
        naming the field. ``None``: a key sized for this mask alone (its static part names
        the mask: a new mask compiles anew).
      check_dispatch: debug mode that makes natural-order inputs of
        :func:`~magi_jax.sharding.magi_attention` impossible to mistake for dispatched ones
        (default: the ``MAGI_JAX_CHECK_DISPATCH`` environment variable, off). Returns a
        :class:`CheckedKey`: same plan, same results, but its dispatched layout carries one
        hidden row at the end of every rank's block (``key.padded_total`` and
        ``key.local_len`` count it), so an array that skipped :func:`dispatch` — even one
        sharded over the cp axis, even under ``jit`` on an Auto mesh — never has the
        dispatched length and is rejected ("dispatch first"). Costs a slice and a pad of
        q/k/v/out per call; for debugging, not for training runs. Self-attention keys only.
      kv_layout: where the keys of a cross-attention mask live (``key.kv_layout`` says what
        was chosen). ``"auto"`` (default): ``"shared"`` for ``total_q == total_k`` (the
        self-attention plan: keys dispatched with the queries), otherwise
        ``"replicated"`` when ``total_k <= ceil(total_q / cp)`` and ``"dispatched"`` beyond
        (:func:`~magi_jax.planning.solver.auto_kv_layout`; the rule reads lengths only).
        ``"replicated"``: every rank holds all ``total_k`` keys; the forward moves no KV and
        the backward sums dK/dV over the ranks. ``"dispatched"``: the keys are padded, cut
        into chunks of their own and spread evenly over the ranks (the chunks most seen by a
        rank's queries go to that rank, :func:`~magi_jax.planning.solver.solve_kv_dispatch`),
        and remote keys are fetched as in self-attention. Either way lay keys and values out
        with ``dispatch(k, key, role="kv")``. Cross keys run on the XLA transports
        (``comm_backend="auto"`` picks ``"xla"`` for them; ``"native"`` is refused).

      hierarchical: two-hop casts on a mesh of nodes, for ``cp_axis=(node_axis,
        local_axis)``: a KV row that several ranks of one node need crosses between nodes
        once, to one of them, which forwards it inside the node; the backward sums inside
        the node first, then sends once (:mod:`magi_jax.planning.hierarchy`). ``"auto"``
        (default): for every stage whose two-hop cast sends fewer rows between nodes (padding
        of the ``ppermute`` slots included), on a
        key of one mask (at a capacity every slot is padded to its width, so it moves no
        fewer; ``True`` turns it on there). ``True``: every stage; needs two cp axes and
        the ``lax.ppermute`` transport. ``False``: flat casts.

    Returns a :class:`MagiKey`; cached by (mask fingerprint, mesh, options, capacity), in a
    cache bounded by the bytes of its keys' arrays (:func:`clear_key_cache`).
    """
    if not isinstance(mask, AttnMask):
        raise TypeError(
            f"mask must be an AttnMask (e.g. AttnMask.varlen(...)); got {type(mask).__name__}"
        )
    cp_axis = _normal_cp_axis(cp_axis)
    cp = _check_mesh(mesh, cp_axis)
    if mask.total_q == 0 and mask.total_k == 0:
        raise ValueError(
            "the mask has no tokens (total_q = total_k = 0): context-parallel "
            "attention needs a packed sequence of at least one token"
        )
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(
            f'kv_layout={kv_layout!r} is not one of {KV_LAYOUTS} ("auto": '
            "shared for self-attention, by the size rule for cross attention)"
        )
    cross = kv_layout != "auto" or mask.total_q != mask.total_k
    if cross and (mask.total_q == 0 or mask.total_k == 0):
        raise ValueError(
            f"the cross-attention mask has total_q={mask.total_q}, total_k="
            f"{mask.total_k}: context parallelism needs at least one query and "
            "one key"
        )
    chunk_size = _check_int("chunk_size", chunk_size, 1, "a positive number of tokens")
    block_q = _check_int("block_q", block_q, 1, "a positive tile size")
    block_k = _check_int("block_k", block_k, 1, "a positive tile size")
    overlap_degree = _check_int(
        "overlap_degree",
        overlap_degree,
        0,
        f"in [0, {MAX_OVERLAP_DEGREE}] (0: fetch all remote KV, then one FFA call; k: the "
        "host stage plus k remote stages, each costing a kernel, a merge and a collective)",
        hi=MAX_OVERLAP_DEGREE,
    )
    check = _check_dispatch_flag(check_dispatch)
    if check and cross:
        raise ValueError(
            "check_dispatch=True is for self-attention keys; this key is cross "
            f"attention (total_q={mask.total_q}, total_k={mask.total_k}, "
            f"kv_layout={kv_layout!r}): build it with check_dispatch=False (and "
            f"unset {CHECK_DISPATCH_ENV})"
        )
    if comm_backend not in COMM_BACKENDS:
        raise ValueError(f"comm_backend={comm_backend!r} is not one of {COMM_BACKENDS}")
    if comm_backend == "native" and cross:
        raise ValueError(
            "comm_backend='native' does not take cross-attention keys (total_q="
            f"{mask.total_q}, total_k={mask.total_k}); use comm_backend='xla' "
            "(or 'auto', which picks it for them)"
        )
    if comm_backend == "native" and not isinstance(cp_axis, str):
        raise ValueError(
            f"comm_backend='native' takes one cp axis; got cp_axis={cp_axis!r}: "
            "use comm_backend='xla' (or 'auto', which picks it here)"
        )
    if comm_backend == "native":
        native.check_mesh(mesh, cp_axis)
    elif (
        comm_backend == "auto"
        and not cross
        and isinstance(cp_axis, str)
        and native.auto_reason(mesh, cp_axis) is None
    ):
        comm_backend = "native"
    relay = _relay_layout(mesh, cp_axis, hierarchical, comm_backend, capacity)
    if ffa_backend not in ("auto",) + FFA_BACKENDS:
        raise ValueError(f"ffa_backend={ffa_backend!r} is not one of {('auto',) + FFA_BACKENDS}")
    if ffa_backend == "auto":
        ffa_backend = "xla" if ffa_backend_reason() else "pallas"
    if capacity is not None:
        chunk_size, overlap_degree = _capacity_options(
            capacity, mask, cp, chunk_size, overlap_degree
        )
    if dispatch_algorithm not in ALGORITHMS:
        raise ValueError(f"dispatch_algorithm={dispatch_algorithm!r} is not one of {ALGORITHMS}")
    if dispatch_from is not None:
        if not isinstance(dispatch_from, MagiKey):
            raise TypeError(f"dispatch_from must be a MagiKey; got {type(dispatch_from).__name__}")
        if (
            dispatch_from.total != mask.total_q
            or dispatch_from.mesh != mesh
            or dispatch_from.cp_axis != cp_axis
        ):
            raise ValueError(
                f"dispatch_from was made for {dispatch_from.total} tokens on axis "
                f"{dispatch_from.cp_axis!r} of its mesh, but this mask has {mask.total_q} "
                f"tokens (axis {cp_axis!r}); a shared dispatch needs the same sequence and mesh"
            )
    if dispatch_from is not None and dispatch_from.plan is None:
        raise ValueError(
            "dispatch_from carries no host plan (it was rebuilt inside a traced "
            "function); pass the key make_flex_key returned"
        )
    if not isinstance(backward_refetch, (bool, np.bool_)):
        raise ValueError(f"backward_refetch={backward_refetch!r} must be True or False")
    args = (
        mask,
        mesh,
        cp_axis,
        chunk_size,
        overlap_degree,
        comm_backend,
        dispatch_algorithm,
        None if dispatch_from is None else _MetaRef(dispatch_from.plan.meta),
        block_q,
        block_k,
        ffa_backend,
        cp,
        bool(backward_refetch),
        capacity,
        kv_layout,
        relay,
    )
    key = _KEYS.get(args, lambda: _make_key(*args))
    return CheckedKey.of(key) if check else key


def _check_int(name, value, lo, what, hi=None):
    """``None`` or an integer in ``[lo, hi]`` (an option of :func:`make_flex_key`)."""
    if value is None:
        return None
    value = value.item() if isinstance(value, np.generic) else value
    ok = not isinstance(value, bool) and (
        isinstance(value, (int, np.integer))
        or (isinstance(value, (float, np.floating)) and float(value).is_integer())
    )
    if not ok or value < lo or (hi is not None and value > hi):
        default = "the cost model's choice" if name == "overlap_degree" else "the default"
        raise ValueError(
            f"{name}={value!r} must be an integer {what} (or None for {default})"
            if hi is not None
            else f"{name}={value!r} must be {what} (or None for {default})"
        )
    return int(value)


def _check_dispatch_flag(value) -> bool:
    if value is not None:
        return bool(value)
    env = os.environ.get(CHECK_DISPATCH_ENV, "").strip().lower()
    if env in ("", "0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    raise ValueError(
        f"{CHECK_DISPATCH_ENV}={os.environ[CHECK_DISPATCH_ENV]!r}: use 1 (check "
        "that magi_attention's inputs were dispatched) or 0"
    )


def ffa_backend_reason() -> str | None:
    """``None`` when ``ffa_backend="auto"`` picks ``"pallas"`` (the default device is an sm90
    GPU), else why it picks ``"xla"``."""
    from magi_jax.pallas.api import device_supported

    ok, why = device_supported()
    return None if ok else f"pallas (Mosaic GPU) not used: {why}"


def _capacity_options(capacity, mask, cp, chunk_size, overlap_degree):
    """Chunk size and overlap degree of a key at ``capacity`` (never from the mask)."""
    if not isinstance(capacity, PlanCapacity):
        raise TypeError(f"capacity must be a PlanCapacity; got {type(capacity).__name__}")
    if (capacity.total_q, capacity.total_k) != (mask.total_q, mask.total_k):
        raise ValueError(
            f"capacity is for total_q={capacity.total_q}, total_k="
            f"{capacity.total_k} but the mask has total_q={mask.total_q}, "
            f"total_k={mask.total_k}; build the capacity for the packed lengths"
        )
    for name, given, fixed in (
        ("chunk_size", chunk_size, capacity.chunk_size),
        ("overlap_degree", overlap_degree, capacity.overlap_degree),
    ):
        if given is not None and fixed is not None and int(given) != fixed:
            raise ValueError(
                f"{name}={given} but capacity.{name}={fixed}; set it in one "
                "place (the capacity fixes the key's static part)"
            )
    chunk = int(chunk_size or capacity.chunk_size or capacity_chunk_size(capacity.total_q, cp))
    if overlap_degree is None:
        overlap_degree = (
            capacity.overlap_degree
            if capacity.overlap_degree is not None
            else capacity_overlap_degree(capacity.total_q, cp, chunk)
        )
    return chunk, int(overlap_degree)


class _KeyCache:
    """Keys by their arguments, least recently used first out, bounded by the bytes of the
    keys' device arrays (each key holds ``[cp, ...]`` plan arrays on every device)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._keys: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, args, build):
        with self._lock:
            key = self._keys.get(args)
            if key is not None:
                self._keys.move_to_end(args)
                return key
        key = build()
        size = key.nbytes()
        with self._lock:
            if args not in self._keys:
                self._keys[args] = key
                self._bytes += size
            while self._bytes > self.max_bytes and len(self._keys) > 1:
                _, old = self._keys.popitem(last=False)
                self._bytes -= old.nbytes()
        return key

    def clear(self):
        with self._lock:
            self._keys.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes


# 1 GiB of key arrays: a few hundred keys of 32k tokens, a handful at 1M.
_KEYS = _KeyCache(1 << 30)


def clear_key_cache(max_bytes: int | None = None):
    """Drops every cached key (and with ``max_bytes``, sets the cache's bound in bytes of
    device arrays; default 1 GiB). Cached host plans are cleared by
    :func:`magi_jax.clear_caches`."""
    _KEYS.clear()
    if max_bytes is not None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        _KEYS.max_bytes = int(max_bytes)


class _MetaRef:
    """Hashable handle of a DispatchMeta (by its content)."""

    def __init__(self, meta):
        self.meta = meta
        self._fp = meta.fingerprint()

    def __hash__(self):
        return hash(self._fp)

    def __eq__(self, other):
        return isinstance(other, _MetaRef) and self._fp == other._fp


def _make_key(
    mask,
    mesh,
    cp_axis,
    chunk_size,
    overlap_degree,
    comm_backend,
    algorithm,
    meta_ref,
    block_q,
    block_k,
    ffa_backend,
    cp,
    backward_refetch,
    capacity,
    kv_layout="auto",
    relay=None,
) -> MagiKey:
    if meta_ref is not None:
        meta = meta_ref.meta
    else:
        meta = solve_dispatch(mask, cp, chunk_size, algorithm)
    # Cross attention: where the keys live (None: self-attention, the queries' dispatch).
    kv = resolve_kv(mask, meta, kv_layout)
    kv_meta = kv if kv is not None and not isinstance(kv, str) else None
    kv_local = (
        meta.local_len if kv is None else mask.total_k if kv_meta is None else kv_meta.local_len
    )
    auto_q, auto_k = default_block_sizes(meta.local_len, kv_local)
    bq, bk = int(block_q or auto_q), int(block_k or auto_k)
    degree = (
        default_overlap_degree(mask, meta, kv) if overlap_degree is None else int(overlap_degree)
    )
    plan: DistPlan = build_dist_plan(mask, meta, degree, bq, bk, ffa_backend, capacity, kv=kv)
    shard = NamedSharding(mesh, P(cp_axis))
    put = lambda a: _put(a, shard)
    statics, arrays = [], []
    for st in plan.stages:
        ffa = type(st.ffa)(*(put(a) for a in st.ffa))
        if st.cast is None:
            statics.append(StageStatic(st.kv_len, False, None, st.items))
            arrays.append((ffa, None))
            continue
        # Two-hop casts on a mesh of nodes (hierarchical=...; see _relay_stage).
        two_hop = None if relay is None else _relay_stage(st.cast, *relay, capacity, cp_axis)
        if two_hop is not None:
            statics.append(
                StageStatic(st.kv_len, st.kv_len != st.cast.buffer_len, two_hop[0], st.items)
            )
            arrays.append((ffa, type(two_hop[1])(*(put(a) for a in two_hop[1]))))
            continue
        transport = (
            choose_transport(st.cast, gated=cast_pieces(capacity) > 1)
            if comm_backend in ("auto", "xla")
            else comm_backend
        )
        runs = None
        if transport == "native":
            native.check_table(st.cast)
            # The started reduce needs the receive table's runs as static data: a key of one
            # mask only.
            runs = native.reduce_runs(st.cast) if capacity is None else None
        spec = CastSpec(
            cp_axis,
            cp,
            st.cast.shifts,
            st.cast.widths,
            transport,
            runs,
            st.cast.slot_len,
            st.cast.buffer_len,
            cast_pieces(capacity) if transport == "ppermute" else 1,
        )
        combined = st.kv_len != st.cast.buffer_len
        statics.append(StageStatic(st.kv_len, combined, spec, st.items))
        # The tables travel as runs; the collectives expand them on the device.
        arrays.append((ffa, CastRuns(put(st.cast.send_runs), put(st.cast.recv_runs))))
    replicated = NamedSharding(mesh, P())
    fingerprint = None if capacity is not None else (mask.fingerprint, meta.fingerprint())
    static = KeyStatic(
        mesh=mesh,
        cp_axis=cp_axis,
        cp=cp,
        total=meta.total,
        padded_total=meta.padded_total,
        local_len=meta.local_len,
        chunk_size=meta.chunk_size,
        overlap_degree=plan.overlap_degree,
        block_q=bq,
        block_k=bk,
        stages=tuple(statics),
        ffa_backend=ffa_backend,
        comm_backend=comm_backend,
        backward_refetch=backward_refetch,
        capacity=capacity,
        fingerprint=fingerprint,
    )
    kv_leaves = ()
    if kv is not None:
        kv_rows = mask.total_k if kv_meta is None else kv_meta.padded_total
        static = dataclasses.replace(
            static,
            kv_layout=plan.kv_layout,
            total_k=mask.total_k,
            kv_padded_total=kv_rows,
            kv_local_len=kv_local,
            kv_chunk_size=None if kv_meta is None else kv_meta.chunk_size,
        )
        if kv_meta is not None:
            kv_leaves = tuple(_put(a, replicated) for a in _chunk_permutation(kv_meta))
    return MagiKey(
        static,
        *(_put(a, replicated) for a in _chunk_permutation(meta)),
        tuple(arrays),
        *kv_leaves,
        plan=plan,
        mask=mask,
    )


def _chunk_permutation(meta) -> tuple[np.ndarray, np.ndarray]:
    """``(chunk_order, chunk_inverse)`` int64 ``[num_chunks]`` of a dispatch: the natural
    chunk in each dispatched slot (rank-major, as ``meta.rank_chunks``) and the slot of each
    natural chunk."""
    chunk_order = meta.rank_chunks.reshape(-1)
    chunk_inverse = np.empty(meta.num_chunks, np.int64)
    chunk_inverse[chunk_order] = np.arange(meta.num_chunks)
    return chunk_order, chunk_inverse


def _token_index(chunks, chunk_size: int):
    """int32 ``[len(chunks)·chunk_size]``: the token-level view of a chunk permutation (row
    ``i`` -> ``chunks[i // chunk_size]·chunk_size + i % chunk_size``), on the device."""
    rows = chunks[:, None] * chunk_size + jnp.arange(chunk_size, dtype=chunks.dtype)
    return rows.reshape(-1)


def _put(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host int32 array every process computed identically -> a global array; each
    process fills only its addressable shards (multi-host safe, no cross-host transfer)."""
    a = np.ascontiguousarray(a, np.int32)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def make_varlen_key(
    cu_seqlens, mesh: Mesh, cp_axis: str = "cp", *, causal: bool = True, window=None, **options
) -> MagiKey:
    """:func:`make_flex_key` for packed documents (``AttnMask.varlen(cu_seqlens, causal,
    window)``; causal by default, like ``AttnMask.varlen``); ``options`` as for
    :func:`make_flex_key`."""
    return make_flex_key(
        AttnMask.varlen(cu_seqlens, causal=causal, window=window), mesh, cp_axis, **options
    )


def _check_key(key):
    if not isinstance(key, MagiKey):
        raise TypeError(
            f"key must be a MagiKey from make_flex_key/make_varlen_key; got {type(key).__name__}"
        )


@jax.tree_util.register_pytree_node_class
class CheckedKey(MagiKey):
    """A :class:`MagiKey` whose dispatched layout cannot be mistaken (``make_flex_key(...,
    check_dispatch=True)`` or ``MAGI_JAX_CHECK_DISPATCH=1``).

    Why a layout and not a check: a natural-order array sharded over the cp axis (and, under
    ``jit`` on an Auto mesh, any array) has the same shape, sharding type and — after the
    model's token-wise layers — no values that tell it from a dispatched one, whenever the
    sequence needs no padding (``padded_total == total``). Only the shape survives every
    token-wise layer, so this key's dispatched arrays carry one hidden row after each rank's
    ``local_len`` rows: ``padded_total + cp`` rows in all, never ``total``. ``dispatch``
    writes zeros there, ``magi_attention`` drops the hidden rows before the per-rank pipeline
    and gives them ``out = 0``, ``lse = -inf`` (like padding), ``undispatch`` skips them and
    ``position_ids`` gives them positions ``>= total``. The plan, the kernels and the results
    in natural order are those of the unchecked key; ``key.padded_total`` / ``key.local_len``
    count the hidden rows (``key.static`` keeps the plan's). A distinct pytree type, so
    ``jit`` caches never mix it with the unchecked key."""

    padded_total = property(lambda self: self.static.padded_total + self.static.cp)
    local_len = property(lambda self: self.static.local_len + 1)

    @classmethod
    def of(cls, key: MagiKey) -> "CheckedKey":
        """The checked view of ``key`` (shares its arrays and host plan; self-attention keys
        only)."""
        if isinstance(key, CheckedKey):
            return key
        if key.cross:
            raise ValueError(
                f"CheckedKey.of: the key is cross attention (kv_layout="
                f"{key.kv_layout!r}); check_dispatch is for self-attention keys"
            )
        return cls(
            key.static,
            key.chunk_order,
            key.chunk_inverse,
            key.stage_arrays,
            plan=key.plan,
            mask=key.mask,
        )

    def __repr__(self):
        return super().__repr__()[:-1] + ", check_dispatch=True)"


def _checked(key) -> bool:
    return isinstance(key, CheckedKey)


def _rows_desc(key) -> str:
    """How the key's dispatched rows add up, for messages."""
    st = key.static
    extra = f" + {st.cp} hidden check rows (check_dispatch=True)" if _checked(key) else ""
    return (
        f"{key.padded_total} rows ({st.total} tokens + {st.padded_total - st.total} padding{extra})"
    )


# Dispatch moves whole chunks (padding sits at the end of the padded sequence, in chunks of
# its own), so both directions are one gather of [num_chunks, chunk_size, ...] blocks by the
# key's [num_chunks] leaves: no token-level index exists, on the host or on the device.


def _split_axis(x, axis: int, *sizes):
    """``x`` with axis ``axis`` split into ``sizes`` (their product is its length)."""
    return x.reshape(x.shape[:axis] + sizes + x.shape[axis + 1 :])


def _merge_axes(x, axis: int, count: int):
    """``x`` with axes ``axis .. axis + count - 1`` merged into one."""
    n = int(np.prod(x.shape[axis : axis + count]))
    return x.reshape(x.shape[:axis] + (n,) + x.shape[axis + count :])


def _take_chunks(x, chunks, chunk_size: int, axis: int):
    """Row block ``i`` (``chunk_size`` rows along ``axis``) of the result is block
    ``chunks[i]`` of ``x`` (``x.shape[axis] == len(chunks) · chunk_size``)."""
    blocks = _split_axis(x, axis, chunks.shape[0], chunk_size)
    return _merge_axes(jnp.take(blocks, chunks, axis=axis), axis, 2)


def _pad_rows(x, axis: int, rows: int):
    """``x`` zero-padded at the end of ``axis`` to ``rows`` rows."""
    pad = rows - x.shape[axis]
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _add_hidden_rows(x, key, axis: int):
    """Checked layout: one zero row after each rank's ``local_len`` rows."""
    st = key.static
    return _merge_axes(
        _pad_rows(_split_axis(x, axis, st.cp, st.local_len), axis + 1, st.local_len + 1), axis, 2
    )


def _drop_hidden_rows(x, key, axis: int):
    """The inverse of :func:`_add_hidden_rows`."""
    st = key.static
    blocks = _split_axis(x, axis, st.cp, st.local_len + 1)
    return _merge_axes(jax.lax.slice_in_dim(blocks, 0, st.local_len, axis=axis + 1), axis, 2)


def _as_array(x, fn):
    if hasattr(x, "ndim") and hasattr(x, "shape"):
        return x
    try:
        return jnp.asarray(x)
    except TypeError:
        raise TypeError(f"{fn}: x must be an array; got {type(x).__name__}") from None


def _length_error(fn, x, axis, seq_axis, want, what, other=None):
    """A ValueError for an array whose ``seq_axis`` does not hold ``want`` rows, with the
    likely fix: another axis that has them, or the other layout."""
    n = x.shape[axis]
    msg = (
        f"{fn}: x has shape {tuple(x.shape)}; its axis {axis} (seq_axis={seq_axis}) has "
        f"{n} rows but {what}"
    )
    fits = [i for i, d in enumerate(x.shape) if d == want and i != axis]
    if fits:
        msg += (
            f". Axis {fits[0]} has {want} rows: pass seq_axis={fits[0]} (the axis of "
            "the packed sequence)"
        )
    elif other is not None and n == other[0]:
        msg += f". {other[1]}"
    else:
        msg += "; x must hold the packed sequence the key was made for"
    return ValueError(msg)


def _check_role(role, fn):
    if role not in ROLES:
        raise ValueError(
            f'{fn}: role={role!r} is not one of {ROLES} ("q": queries and '
            'outputs; "kv": keys and values)'
        )


def _kv_role(key, role) -> bool:
    """Whether ``role`` takes the keys' own layout (cross-attention keys, role ``"kv"``)."""
    return role == "kv" and key.cross


def _kv_length_error(fn, x, axis, seq_axis, key, want, what):
    """A ValueError for keys/values of a cross key whose ``seq_axis`` has the wrong length."""
    err = _length_error(fn, x, axis, seq_axis, want, what)
    if x.shape[axis] == key.total and key.total != want:
        return ValueError(
            f"{err}. That is the queries' length: lay out queries with role='q' (the default)"
        )
    return err


def _dispatch_kv(x, key, axis, seq_axis):
    """Keys/values of a cross key, natural order -> its key layout."""
    if x.shape[axis] != key.total_k:
        raise _kv_length_error(
            "dispatch",
            x,
            axis,
            seq_axis,
            key,
            key.total_k,
            f"the key's keys are {key.total_k} tokens in natural order",
        )
    if key.kv_layout == "replicated":
        return _shard_rows(x, key, axis, replicated=True)
    x = _pad_rows(x, axis, key.kv_padded_total)
    return _shard_rows(
        _take_chunks(x, key.kv_chunk_order, key.static.kv_chunk_size, axis), key, axis
    )


def dispatch(x, key: MagiKey, seq_axis: int = 0, *, role: str = "q"):
    """Natural order -> dispatched order along ``seq_axis`` (``total`` -> ``padded_total``
    rows), sharded over the cp axis: rank ``r`` holds rows ``[r·local_len, (r+1)·local_len)``;
    padding rows are zero. Differentiable (the VJP gathers the cotangent back).

    ``role="kv"`` lays out keys and values (``total_k`` rows): for self-attention keys the
    same as queries; for cross-attention keys the layout ``key.kv_layout`` names:
    ``"replicated"`` returns ``x`` replicated on every rank (``total_k`` rows, no padding),
    ``"dispatched"`` permutes it to ``key.kv_padded_total`` rows, rank ``r`` holding rows
    ``[r·kv_local_len, (r+1)·kv_local_len)``. Call it for k and v whatever the layout."""
    _check_key(key)
    _check_role(role, "dispatch")
    x = _as_array(x, "dispatch")
    axis = _axis(x, seq_axis, "dispatch")
    if _kv_role(key, role):
        return _dispatch_kv(x, key, axis, seq_axis)
    if x.shape[axis] != key.total and key.cross and x.shape[axis] == key.total_k:
        raise ValueError(
            f"dispatch: x has {key.total_k} rows along seq_axis={seq_axis}: the "
            f"key's keys, but role='q' lays out its {key.total} queries; pass "
            "role='kv' for keys and values"
        )
    if x.shape[axis] != key.total:
        raise _length_error(
            "dispatch",
            x,
            axis,
            seq_axis,
            key.total,
            f"the key is for {key.total} tokens in natural order",
            (
                key.padded_total,
                "That is the key's dispatched length: x looks dispatched "
                "already (pass it to magi_attention as it is, or undispatch it first)",
            ),
        )
    st = key.static
    y = _take_chunks(_pad_rows(x, axis, st.padded_total), key.chunk_order, st.chunk_size, axis)
    if _checked(key):
        y = _add_hidden_rows(y, key, axis)
    return _shard_rows(y, key, axis)


def undispatch(x, key: MagiKey, seq_axis: int = 0, *, role: str = "q"):
    """Dispatched -> natural order along ``seq_axis`` (``padded_total`` -> ``total`` rows,
    padding dropped). Differentiable (padding rows get zero cotangent). ``role="kv"``: the
    inverse of ``dispatch(..., role="kv")`` (``key.kv_padded_total`` -> ``total_k`` rows; a
    replicated layout comes back as it is)."""
    _check_key(key)
    _check_role(role, "undispatch")
    x = _as_array(x, "undispatch")
    axis = _axis(x, seq_axis, "undispatch")
    if _kv_role(key, role):
        if x.shape[axis] != key.kv_padded_total:
            raise _kv_length_error(
                "undispatch",
                x,
                axis,
                seq_axis,
                key,
                key.kv_padded_total,
                f"the key lays out keys in {key.kv_padded_total} rows "
                f"(kv_layout={key.kv_layout!r})",
            )
        if key.kv_layout == "replicated":
            return x
        if any(t == jax.sharding.AxisType.Explicit for t in key.mesh.axis_types):
            x = jax.sharding.reshard(x, NamedSharding(key.mesh, P()))
        y = _take_chunks(x, key.kv_chunk_inverse, key.static.kv_chunk_size, axis)
        return jax.lax.slice_in_dim(y, 0, key.total_k, axis=axis)
    if x.shape[axis] != key.padded_total:
        raise _length_error(
            "undispatch",
            x,
            axis,
            seq_axis,
            key.padded_total,
            f"the key dispatches {_rows_desc(key)}",
            (
                key.total,
                "That is the natural-order length: x looks undispatched already "
                "(undispatch takes outputs of dispatch / magi_attention with this key)",
            ),
        )
    if any(t == jax.sharding.AxisType.Explicit for t in key.mesh.axis_types):
        x = jax.sharding.reshard(x, NamedSharding(key.mesh, P()))
    if _checked(key):
        x = _drop_hidden_rows(x, key, axis)
    st = key.static
    y = _take_chunks(x, key.chunk_inverse, st.chunk_size, axis)
    return jax.lax.slice_in_dim(y, 0, st.total, axis=axis)


def _axis(x, seq_axis, fn):
    if isinstance(seq_axis, (bool, np.bool_)) or not isinstance(seq_axis, (int, np.integer)):
        raise TypeError(
            f"{fn}: seq_axis={seq_axis!r} must be an int (the axis of the packed sequence)"
        )
    if not -x.ndim <= seq_axis < x.ndim:
        raise ValueError(
            f"{fn}: seq_axis={seq_axis} is out of range for an array of shape {tuple(x.shape)}"
        )
    return seq_axis % x.ndim


def position_ids(key: MagiKey, *, role: str = "q"):
    """int32 ``[padded_total]``: the global position of every dispatched token (for RoPE);
    padding tokens get positions ``>= total``. Sharded like dispatched arrays: on a mesh
    with Explicit axes it is typed ``P(cp_axis)`` like them (so RoPE's products stay
    sharded), and JAX then asks for an ``out_sharding`` to index it; look at it with
    ``np.asarray(pos)`` or ``jax.sharding.reshard(pos, NamedSharding(key.mesh, P()))``.
    ``role="kv"``: the positions of the keys in ``dispatch(..., role="kv")``'s layout
    (``[kv_padded_total]``; ``arange(total_k)`` replicated for a replicated layout)."""
    _check_key(key)
    _check_role(role, "position_ids")
    if _kv_role(key, role):
        if key.kv_layout == "replicated":
            return _shard_rows(jnp.arange(key.total_k, dtype=jnp.int32), key, replicated=True)
        return _shard_rows(key.kv_order, key)
    order = key.order
    if _checked(key):
        st = key.static
        hidden = st.padded_total + jnp.arange(st.cp, dtype=order.dtype)[:, None]
        order = jnp.concatenate([order.reshape(st.cp, st.local_len), hidden], axis=1)
        order = order.reshape(-1)
    return _shard_rows(order, key)


def _shard_rows(x, key: MagiKey, axis: int = 0, replicated: bool = False):
    """Constrains ``x`` to be sharded along ``axis`` over the cp axis (Auto or Explicit), or
    to be replicated."""
    spec = P() if replicated else P(*([None] * axis), key.cp_axis, *([None] * (x.ndim - axis - 1)))
    explicit = any(t == jax.sharding.AxisType.Explicit for t in key.mesh.axis_types)
    if explicit:
        return jax.sharding.reshard(x, NamedSharding(key.mesh, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(key.mesh, spec))
