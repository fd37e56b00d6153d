"""Option resolution: what a key's options (:class:`~magi_jax.sharding.keys._options.KeyOptions`)
mean with one mask and one mesh (cross attention, the transport, two-hop casts, the FFA
backend, the capacity's chunk size and overlap degree, a shared dispatch), checked and
resolved into a frozen :class:`ResolvedOptions`: what host planning
(:mod:`~magi_jax.sharding.keys._host`) reads, and the key cache's key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.sharding import Mesh

from magi_jax.ffa.backends import auto_backend
from magi_jax.masks import AttnMask
from magi_jax.planning import (
    NodeLayout,
    OverlapDegrees,
    PlanCapacity,
    capacity_chunk_size,
    capacity_overlap_degree,
)
from magi_jax.planning.backends import AUTO
from magi_jax.sharding.keys._key import check_mesh, check_pod_axes, cp_names, normal_cp_axis
from magi_jax.sharding.keys._options import CHECK_DISPATCH_ENV, KeyOptions
from magi_jax.sharding.transport import native


class _MetaRef:
    """Hashable handle of a DispatchMeta (by its content)."""

    def __init__(self, meta):
        self.meta = meta
        self._fp = meta.fingerprint()

    def __hash__(self):
        return hash(self._fp)

    def __eq__(self, other):
        return isinstance(other, _MetaRef) and self._fp == other._fp


@dataclasses.dataclass(frozen=True)
class ResolvedOptions:
    """A key's options resolved for one mask over one mesh: every field a value (no
    ``"auto"`` left but where host planning decides: ``overlap_degree=None`` is the cost
    model's, ``kv_layout="auto"`` the length rule's, ``cast_gating="auto"`` the key's kind).
    Hashable and compared field by field, so it is also the key cache's key; ``check``
    (whether :func:`~magi_jax.sharding.make_flex_key` returns the checked view, a view of the
    same plan) is neither hashed nor compared."""

    mask: AttnMask
    mesh: Mesh
    cp_axis: str | tuple[str, ...]
    cp: int
    chunk_size: int | None
    overlap_degree: OverlapDegrees | None
    comm_backend: str
    algorithm: str
    dispatch_from: _MetaRef | None  # the shared dispatch of dispatch_from=, by its content
    block_q: int | None
    block_k: int | None
    ffa_backend: str
    backward_refetch: bool
    capacity: PlanCapacity | None
    kv_layout: str = "auto"
    relay: tuple[NodeLayout, bool] | None = None  # two-hop casts: (layout, forced)
    batch_axes: tuple[str, ...] = ()
    head_axes: tuple[str, ...] = ()
    cast_gating: str = "auto"
    check: bool = dataclasses.field(default=False, compare=False)


def resolve_options(
    mask: AttnMask, mesh: Mesh, cp_axis: str | Sequence[str], options: KeyOptions
) -> ResolvedOptions:
    """The checked ``options`` resolved for ``mask`` over ``mesh``'s ``cp_axis`` (cross
    attention, the transport, two-hop casts, the FFA backend, the capacity's chunk size and
    overlap degree, a shared dispatch): what :func:`~magi_jax.sharding.keys._host.host_key`
    plans from, and the key cache's key."""
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
    return ResolvedOptions(
        mask=mask,
        mesh=mesh,
        cp_axis=cp_axis,
        cp=cp,
        chunk_size=chunk_size,
        overlap_degree=overlap_degree,
        comm_backend=comm_backend,
        algorithm=o.dispatch_algorithm,
        dispatch_from=None if dispatch_from is None else _MetaRef(dispatch_from.plan.meta),
        block_q=o.block_q,
        block_k=o.block_k,
        ffa_backend=ffa_backend,
        backward_refetch=o.backward_refetch,
        capacity=capacity,
        kv_layout=kv_layout,
        relay=relay,
        batch_axes=batch_axes,
        head_axes=head_axes,
        cast_gating=o.cast_gating,
        check=bool(check),
    )


def ffa_backend_reason() -> str | None:
    """``None`` when ``ffa_backend="auto"`` picks ``"pallas"`` (the default device is an sm90
    GPU), else why it picks ``"xla"``."""
    name, why = auto_backend(context_parallel=True)
    return None if name == "pallas" else why


def _relay_layout(mesh, cp_axis, hierarchical, comm_backend, capacity):
    """The :class:`~magi_jax.planning.relay_table.NodeLayout` of a key's two-hop casts and
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
    layout = NodeLayout(int(mesh.shape[names[0]]), int(mesh.shape[names[1]]))
    if hierarchical == "auto" and (layout.nodes == 1 or layout.local == 1):
        return None
    # At a capacity the choice cannot follow the mask (the static part would): its gated
    # two-hop casts are taken (benchmarks/results/wire/LATEST.md counts them).
    return layout, hierarchical is True or capacity is not None


def _capacity_options(capacity, mask, cp, chunk_size, overlap_degree):
    """Chunk size and overlap degrees of a key at ``capacity`` (never from the mask)."""
    capacity.check_mesh_size(cp)
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
