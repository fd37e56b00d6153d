"""Building keys: :func:`make_flex_key` (one mask), :func:`make_varlen_key`, what their
options mean with a mask and a mesh (:func:`key_args`), the host half of a key
(:func:`host_key`) and the key cache. The options themselves are
:class:`~magi_jax.sharding.key_options.KeyOptions`; keys of a batch of masks are
:mod:`magi_jax.sharding.batch_key`'s.

Building a key is host work (NumPy planning in :mod:`magi_jax.planning`), cached by (mask
fingerprint, mesh, options); the host arrays become global arrays whose shards each process
fills itself (:func:`put_global`), so every process of a multi-host job builds the same key
with nothing exchanged.

Cross attention (``total_q != total_k``) keys dispatch the queries like self-attention and
keep the keys either whole on every rank (``key.kv_layout == "replicated"``) or dispatched
by a permutation of their own (``"dispatched"``).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from magi_jax.caches import Cache
from magi_jax.ffa.backends import auto_backend
from magi_jax.mask import AttnMask
from magi_jax.planning.backends import AUTO
from magi_jax.planning.capacity import PlanCapacity
from magi_jax.planning.cast_table import choose_transport
from magi_jax.planning.defaults import (
    OverlapDegrees,
    capacity_chunk_size,
    capacity_overlap_degree,
    cast_pieces,
    default_overlap_degrees,
)
from magi_jax.planning.solver import KV_LAYOUTS, solve_dispatch
from magi_jax.planning.stages import DistPlan, build_dist_plan, resolve_kv
from magi_jax.planning.wire import slot_rows
from magi_jax.planning.work_list import default_block_sizes
from magi_jax.sharding import native
from magi_jax.sharding.collectives import CastRuns, CastSpec
from magi_jax.sharding.key import (
    CheckedKey,
    KeyStatic,
    MagiKey,
    StageStatic,
    check_mesh,
    check_pod_axes,
    cp_names,
    normal_cp_axis,
)
from magi_jax.sharding.key_options import (
    CHECK_DISPATCH_ENV,
    COMM_BACKENDS,
    HIERARCHICAL,
    MAX_OVERLAP_DEGREE,
    KeyOptions,
)
from magi_jax.sharding.two_hop import relay_stage

if TYPE_CHECKING:  # annotations only (imported lazily where two-hop casts are planned)
    from magi_jax.planning.hierarchy import NodeLayout

__all__ = [
    "make_flex_key",
    "make_varlen_key",
    "KeyOptions",
    "key_args",
    "host_key",
    "HostKey",
    "ffa_backend_reason",
    "clear_key_cache",
    "put_global",
    "COMM_BACKENDS",
    "MAX_OVERLAP_DEGREE",
    "CHECK_DISPATCH_ENV",
    "HIERARCHICAL",
    "KV_LAYOUTS",
]


def _relay_layout(mesh, cp_axis, hierarchical, comm_backend, capacity):
    """The :class:`~magi_jax.planning.hierarchy.NodeLayout` of a key's two-hop casts and
    whether they are forced (``(layout, forced)``), or ``None`` for flat casts
    (``hierarchical`` checked by :class:`KeyOptions`)."""
    names = cp_names(cp_axis)
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
    overlap_degree: int | tuple[int, int] | str | None = None,
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
    batch_axes: str | Sequence[str] = (),
    head_axes: str | Sequence[str] = (),
    cast_gating: str = "auto",
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
      overlap_degree: number of remote stages (0: fetch all remote KV, then one FFA call;
        at most :data:`MAX_OVERLAP_DEGREE`): one integer for the forward and the backward,
        or a pair ``(forward, backward)``: the backward then runs a stage split of its own
        (its ratio of compute to communication differs: ~2.5x the forward's FLOPs against a
        second cast of the KV and a reduce of dK/dV; ``key.overlap_degree`` and
        ``key.backward_overlap_degree`` say what was chosen; a pair of different degrees
        needs ``backward_refetch=True``). ``None`` or ``"auto"`` (default): one degree for
        both, from a compute/communication cost model whose constants were measured on a
        pair of H200s (:func:`~magi_jax.planning.defaults.default_overlap_degree`). To choose by
        timing on the machine at hand, pass the ``degrees`` of
        :func:`~magi_jax.sharding.calibrate.calibrate_overlap`.
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
        ``"xla"`` (portable) or ``"pallas"`` (Mosaic GPU kernels: Hopper, bf16/fp16, D 64,
        128 or 256; :func:`~magi_jax.sharding.magi_attention` rejects other inputs, naming the
        fix).
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

      batch_axes: mesh axes the batch axis of ``[B, T, H, D]`` inputs is sharded over (data
        or fully-sharded data parallelism, e.g. ``("dp",)`` or ``("dp", "fsdp")``): each
        device attends only the rows it holds, with no collective over these axes. Default
        ``()``: the batch is replicated over every non-cp axis (each device computes every
        row). For a different packing per row, see :func:`make_batch_key`.
      head_axes: mesh axes the heads of q, k, v are sharded over (tensor parallelism): every
        head shard runs the same plan on its heads, with no collective over these axes; the
        query and key/value head counts must divide by their size.
      cast_gating: how the ``lax.ppermute`` slots of the ``xla`` transport (one slot per
        shift ``s`` of the ranks, rank ``r`` sending to ``r + s``) follow the rows each
        sender-receiver pair needs (:mod:`magi_jax.sharding.pair_cast`). ``"auto"``
        (default): a key of one mask moves each pair's exact rows (its counts are static: a
        few ``ppermute`` levels per slot, no conditional); a key at a capacity moves each
        slot in gated pieces that its fullest rank fills (one conditional per slot).
        ``"pair"``: a key at a capacity moves each pair's own gated pieces
        (:data:`~magi_jax.planning.defaults.PAIR_CAST_PIECES` a slot): the busiest rank's
        wire stays within 1.25x its real rows on every mask counted
        (benchmarks/results/wire/LATEST.md) against up to 3.2x, at ``cp · (cp − 1) · 6``
        conditional collectives per cast instead of ``cp − 1`` (their cost on GPUs is
        unmeasured; CPU figures in benchmarks/results/wire/LATEST.md). ``"slot"``:
        gated slots at a capacity and whole slots for a key of one mask (as before pairs).
        Two-hop casts (``hierarchical``) are gated by slot whatever this says; the
        ``native`` transport moves exact rows anyway (``"slot"`` and ``"pair"`` need
        ``comm_backend="xla"`` or ``"ppermute"``).

    Returns a :class:`MagiKey`; cached by (mask fingerprint, mesh, options, capacity), in a
    cache bounded by the bytes of its keys' arrays (:func:`clear_key_cache`).
    """
    options = KeyOptions(
        chunk_size=chunk_size,
        overlap_degree=overlap_degree,
        comm_backend=comm_backend,
        dispatch_algorithm=dispatch_algorithm,
        dispatch_from=dispatch_from,
        block_q=block_q,
        block_k=block_k,
        ffa_backend=ffa_backend,
        backward_refetch=backward_refetch,
        capacity=capacity,
        check_dispatch=check_dispatch,
        kv_layout=kv_layout,
        hierarchical=hierarchical,
        batch_axes=batch_axes,
        head_axes=head_axes,
        cast_gating=cast_gating,
    )
    args, check = key_args(mask, mesh, cp_axis, options)
    key = _KEYS.get(args, lambda: _make_key(*args))
    return CheckedKey.of(key) if check else key


def key_args(
    mask: AttnMask, mesh: Mesh, cp_axis: str | Sequence[str], options: KeyOptions
) -> tuple[tuple, bool]:
    """The checked ``options`` resolved for ``mask`` over ``mesh``'s ``cp_axis`` (cross
    attention, the transport, two-hop casts, the FFA backend, the capacity's chunk size and
    overlap degree, a shared dispatch): the arguments of :func:`host_key` (hashable: the
    key cache's key) and whether to return the checked view."""
    o = options
    chunk_size, overlap_degree = o.chunk_size, o.overlap_degree
    comm_backend, ffa_backend = o.comm_backend, o.ffa_backend
    dispatch_from, capacity, kv_layout = o.dispatch_from, o.capacity, o.kv_layout
    if not isinstance(mask, AttnMask):
        raise TypeError(
            f"mask must be an AttnMask (e.g. AttnMask.varlen(...)); got {type(mask).__name__}"
        )
    cp_axis = normal_cp_axis(cp_axis)
    cp = check_mesh(mesh, cp_axis)
    batch_axes, head_axes = check_pod_axes(mesh, cp_axis, o.batch_axes, o.head_axes)
    if mask.total_q == 0 and mask.total_k == 0:
        raise ValueError(
            "the mask has no tokens (total_q = total_k = 0): context-parallel "
            "attention needs a packed sequence of at least one token"
        )
    cross = kv_layout != "auto" or mask.total_q != mask.total_k
    if cross and (mask.total_q == 0 or mask.total_k == 0):
        raise ValueError(
            f"the cross-attention mask has total_q={mask.total_q}, total_k="
            f"{mask.total_k}: context parallelism needs at least one query and "
            "one key"
        )
    check = o.check_dispatch
    if check and cross:
        raise ValueError(
            "check_dispatch=True is for self-attention keys; this key is cross "
            f"attention (total_q={mask.total_q}, total_k={mask.total_k}, "
            f"kv_layout={kv_layout!r}): build it with check_dispatch=False (and "
            f"unset {CHECK_DISPATCH_ENV})"
        )
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
    relay = _relay_layout(mesh, cp_axis, o.hierarchical, comm_backend, capacity)
    if ffa_backend == AUTO:
        ffa_backend = auto_backend(context_parallel=True)[0]
    if capacity is not None:
        chunk_size, overlap_degree = _capacity_options(
            capacity, mask, cp, chunk_size, overlap_degree
        )
        if not o.backward_refetch and overlap_degree.forward != overlap_degree.backward:
            if capacity.overlap_degree is not None:
                raise ValueError(
                    f"capacity.overlap_degree={capacity.overlap_degree} and "
                    f"capacity.backward_overlap_degree={capacity.backward_overlap_degree} "
                    "give the backward its own stages, but backward_refetch=False keeps "
                    "the forward's stage buffers for the backward: pass "
                    "backward_refetch=True, or build the capacity with one degree"
                )
            overlap_degree = OverlapDegrees(overlap_degree.forward, overlap_degree.forward)
    if dispatch_from is not None:
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
    args = (
        mask,
        mesh,
        cp_axis,
        chunk_size,
        overlap_degree,
        comm_backend,
        o.dispatch_algorithm,
        None if dispatch_from is None else _MetaRef(dispatch_from.plan.meta),
        o.block_q,
        o.block_k,
        ffa_backend,
        cp,
        o.backward_refetch,
        capacity,
        kv_layout,
        relay,
        batch_axes,
        head_axes,
        o.cast_gating,
    )
    return args, check


def ffa_backend_reason() -> str | None:
    """``None`` when ``ffa_backend="auto"`` picks ``"pallas"`` (the default device is an sm90
    GPU), else why it picks ``"xla"``."""
    name, why = auto_backend(context_parallel=True)
    return None if name == "pallas" else why


def _capacity_options(capacity, mask, cp, chunk_size, overlap_degree):
    """Chunk size and overlap degrees of a key at ``capacity`` (never from the mask)."""
    if (capacity.total_q, capacity.total_k) != (mask.total_q, mask.total_k):
        raise ValueError(
            f"capacity is for total_q={capacity.total_q}, total_k="
            f"{capacity.total_k} but the mask has total_q={mask.total_q}, "
            f"total_k={mask.total_k}; build the capacity for the packed lengths"
        )
    if chunk_size is not None and capacity.chunk_size is not None:
        if int(chunk_size) != capacity.chunk_size:
            raise ValueError(
                f"chunk_size={chunk_size} but capacity.chunk_size={capacity.chunk_size}; set "
                "it in one place (the capacity fixes the key's static part)"
            )
    fixed = (
        None
        if capacity.overlap_degree is None
        else OverlapDegrees(capacity.overlap_degree, capacity.backward_overlap_degree)
    )
    if overlap_degree is not None and fixed is not None and overlap_degree != fixed:
        one = lambda pair: pair.forward if pair.forward == pair.backward else tuple(pair)
        raise ValueError(
            f"overlap_degree={one(overlap_degree)} but capacity.overlap_degree="
            f"{capacity.overlap_degree}, capacity.backward_overlap_degree="
            f"{capacity.backward_overlap_degree}; set it in one place (the capacity fixes the "
            "key's static part), e.g. PlanCapacity.from_masks(sample, mesh_size=cp, "
            f"overlap_degree={one(overlap_degree)})"
        )
    chunk = int(chunk_size or capacity.chunk_size or capacity_chunk_size(capacity.total_q, cp))
    if overlap_degree is None:
        overlap_degree = (
            fixed if fixed is not None else capacity_overlap_degree(capacity.total_q, cp, chunk)
        )
    return chunk, OverlapDegrees(*map(int, overlap_degree))


# Keys by their arguments, bounded by the bytes of the keys' device arrays (each key holds
# [cp, ...] plan arrays on every device): 1 GiB, a few hundred keys of 32k tokens, a handful
# at 1M.
_KEYS = Cache("keys", max_bytes=1 << 30, size_of=lambda key: key.nbytes())


def clear_key_cache(max_bytes: int | None = None) -> None:
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


class HostKey(NamedTuple):
    """A key on the host, before its arrays become global ones: the static part, the leaves
    as NumPy arrays (``stage_arrays`` and ``plan_id`` ``[cp, ...]``, the chunk permutations
    ``[num_chunks]``) and the host plan."""

    static: KeyStatic
    chunk_order: np.ndarray
    chunk_inverse: np.ndarray
    stage_arrays: tuple
    kv_chunks: tuple  # (kv_chunk_order, kv_chunk_inverse) or ()
    backward_stage_arrays: tuple | None  # the backward's own stages, or None
    plan_id: np.ndarray
    plan: DistPlan
    mask: AttnMask


def host_key(
    mask: AttnMask,
    mesh: Mesh,
    cp_axis: str | tuple[str, ...],
    chunk_size: int | None,
    overlap_degree: OverlapDegrees | None,
    comm_backend: str,
    algorithm: str,
    meta_ref: _MetaRef | None,
    block_q: int | None,
    block_k: int | None,
    ffa_backend: str,
    cp: int,
    backward_refetch: bool,
    capacity: PlanCapacity | None,
    kv_layout: str = "auto",
    relay: tuple[NodeLayout, bool] | None = None,
    batch_axes: tuple[str, ...] = (),
    head_axes: tuple[str, ...] = (),
    cast_gating: str = "auto",
) -> HostKey:
    """The host half of a key: :func:`key_args`' arguments planned (the dispatch, the
    stages, their casts and FFA work lists) into a :class:`HostKey`."""
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
    if overlap_degree is None:  # one degree for both directions until measured
        overlap_degree = default_overlap_degrees(mask, meta, kv)
    degree, back = overlap_degree
    plan: DistPlan = build_dist_plan(mask, meta, degree, bq, bk, ffa_backend, capacity, kv=kv)
    stage_parts = functools.partial(
        _stage_parts,
        cp_axis=cp_axis,
        cp=cp,
        comm_backend=comm_backend,
        capacity=capacity,
        cast_gating=cast_gating,
    )
    statics, arrays = stage_parts(plan, relay=relay)
    back_statics = back_arrays = None
    if back != degree:  # the backward's own stage plan
        back_plan = build_dist_plan(mask, meta, back, bq, bk, ffa_backend, capacity, kv=kv)
        back_statics, back_arrays = stage_parts(back_plan, relay=relay)
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
        stages=statics,
        ffa_backend=ffa_backend,
        comm_backend=comm_backend,
        backward_refetch=backward_refetch,
        capacity=capacity,
        fingerprint=fingerprint,
        batch_axes=batch_axes,
        head_axes=head_axes,
        backward_overlap_degree=None if back_statics is None else back_plan.overlap_degree,
        backward_stages=back_statics,
    )
    kv_chunks = ()
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
            kv_chunks = _chunk_permutation(kv_meta)
    # What this process planned, as one int32 per rank: ranks of one CP group compare it.
    ident = repr((mask.fingerprint, meta.fingerprint(), kv_meta and kv_meta.fingerprint()))
    plan_id = np.full(cp, zlib.crc32(ident.encode()) & 0x7FFFFFFF, np.int64)
    return HostKey(
        static,
        *_chunk_permutation(meta),
        arrays,
        kv_chunks,
        back_arrays,
        plan_id,
        plan,
        mask,
    )


def _stage_parts(
    plan: DistPlan,
    *,
    cp_axis: str | tuple[str, ...],
    cp: int,
    comm_backend: str,
    capacity: PlanCapacity | None,
    relay: tuple[NodeLayout, bool] | None,
    cast_gating: str = "auto",
) -> tuple[tuple[StageStatic, ...], tuple]:
    """A plan's stages as a key holds them: their static parts and their host arrays
    (``(FFAPlanRuns, CastRuns | RelayRuns | None)`` each), each cast on its transport;
    ``ppermute`` slots gated as ``cast_gating`` says (:func:`make_flex_key`)."""
    gating = (
        "slot"
        if cast_gating == "slot" or (cast_gating == "auto" and capacity is not None)
        else "pair"
    )
    statics, arrays = [], []
    for st in plan.stages:
        ffa = st.ffa
        if st.cast is None:
            statics.append(StageStatic(st.kv_len, False, None, st.items))
            arrays.append((ffa, None))
            continue
        # Two-hop casts on a mesh of nodes (hierarchical=...; see two_hop.relay_stage).
        two_hop = (
            None
            if relay is None
            else relay_stage(st.cast, *relay, capacity, cp_axis, flat_gating=gating)
        )
        if two_hop is not None:
            statics.append(
                StageStatic(st.kv_len, st.kv_len != st.cast.buffer_len, two_hop[0], st.items)
            )
            arrays.append((ffa, two_hop[1]))
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
        ppermute = transport == "ppermute"
        pieces = 1 if not ppermute else cast_pieces(capacity, gating)
        pair_rows = None
        if ppermute and gating == "pair" and pieces == 1:  # a key of one mask: static rows
            rows = slot_rows(st.cast)
            pair_rows = tuple(tuple(int(c) for c in rows[:, j]) for j in range(rows.shape[1]))
        spec = CastSpec(
            cp_axis,
            cp,
            st.cast.shifts,
            st.cast.widths,
            transport,
            runs,
            st.cast.slot_len,
            st.cast.buffer_len,
            pieces,
            gating if ppermute else "slot",
            pair_rows,
        )
        combined = st.kv_len != st.cast.buffer_len
        statics.append(StageStatic(st.kv_len, combined, spec, st.items))
        # The tables travel as runs; the collectives expand them on the device.
        arrays.append((ffa, CastRuns(st.cast.send_runs, st.cast.recv_runs)))
    return tuple(statics), tuple(arrays)


def _make_key(*args) -> MagiKey:
    """A key of one mask: :func:`host_key`, its arrays made global (plans sharded over the
    cp axis, replicated over every other axis; the chunk permutations replicated)."""
    hk = host_key(*args)
    mesh, cp_axis = hk.static.mesh, hk.static.cp_axis
    by_rank = NamedSharding(mesh, P(cp_axis))
    replicated = NamedSharding(mesh, P())
    stage_arrays, backward_stage_arrays = jax.tree.map(
        lambda a: put_global(a, by_rank), (hk.stage_arrays, hk.backward_stage_arrays)
    )
    return MagiKey(
        hk.static,
        put_global(hk.chunk_order, replicated),
        put_global(hk.chunk_inverse, replicated),
        stage_arrays,
        *(put_global(a, replicated) for a in hk.kv_chunks),
        backward_stage_arrays=backward_stage_arrays,
        plan_id=put_global(hk.plan_id, by_rank),
        plan=hk.plan,
        mask=hk.mask,
    )


def _chunk_permutation(meta) -> tuple[np.ndarray, np.ndarray]:
    """``(chunk_order, chunk_inverse)`` int64 ``[num_chunks]`` of a dispatch: the natural
    chunk in each dispatched slot (rank-major, as ``meta.rank_chunks``) and the slot of each
    natural chunk."""
    chunk_order = meta.rank_chunks.reshape(-1)
    chunk_inverse = np.empty(meta.num_chunks, np.int64)
    chunk_inverse[chunk_order] = np.arange(meta.num_chunks)
    return chunk_order, chunk_inverse


def put_global(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host int32 array every process computed identically -> a global array; each
    process fills only its addressable shards (multi-host safe, no cross-host transfer)."""
    a = np.ascontiguousarray(a, np.int32)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def make_varlen_key(
    cu_seqlens: Sequence[int] | np.ndarray,
    mesh: Mesh,
    cp_axis: str = "cp",
    *,
    causal: bool = True,
    window: int | tuple[int, int] | None = None,
    **options: Any,
) -> MagiKey:
    """:func:`make_flex_key` for packed documents (``AttnMask.varlen(cu_seqlens, causal,
    window)``; causal by default, like ``AttnMask.varlen``); ``options`` as for
    :func:`make_flex_key`."""
    return make_flex_key(
        AttnMask.varlen(cu_seqlens, causal=causal, window=window), mesh, cp_axis, **options
    )
