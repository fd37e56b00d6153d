"""Keys: the types of a context-parallel plan of one mask (or one mask per batch row) on
one mesh, and the mesh helpers every layer of :mod:`magi_jax.sharding` reads them with.

A :class:`MagiKey` is a JAX pytree: its leaves are the stacked ``[cp, ...]`` int32 plan
arrays (sharded over the mesh's cp axis; ``[B, cp, ...]`` for a batched key, the batch axis
sharded over the key's batch axes) and the dispatch permutation of whole chunks; everything
else (mesh, axes, stage shapes, transports) is static. Keys are built by
:mod:`magi_jax.sharding.make_key`; arrays are laid out for them by
:mod:`magi_jax.sharding.layout`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from magi_jax.planning import PlanCapacity
from magi_jax.sharding.transport import CastSpec

if TYPE_CHECKING:  # annotations only
    from matplotlib.figure import Figure

    from magi_jax.masks import AttnMask
    from magi_jax.planning import DistPlan


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
    # Pods: the mesh axes the batch axis of the inputs is sharded over (each device attends
    # its own rows only) and those their heads are sharded over (tensor parallelism: every
    # head shard runs the same plan). rows: the batch of a batched key (one plan per row,
    # leaves [rows, ...]); None for a key of one mask, which every row shares.
    batch_axes: tuple[str, ...] = ()
    head_axes: tuple[str, ...] = ()
    rows: int | None = None
    # The backward's own stages, where its overlap degree differs from the forward's (None:
    # the backward runs the forward's stages, backward_overlap_degree is overlap_degree).
    backward_overlap_degree: int | None = None
    backward_stages: tuple[StageStatic, ...] | None = None


# The leaves in flattening order, named: JAX's messages about a key passed to a jitted
# function then name the field (``key.chunk_order``), not a position (``key[0]``).
_LEAVES = (
    "chunk_order",
    "chunk_inverse",
    "stage_arrays",
    "kv_chunk_order",
    "kv_chunk_inverse",
    "backward_stage_arrays",
    "plan_id",
)


@jax.tree_util.register_pytree_with_keys_class
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

    ``backward_stage_arrays``: where the backward's overlap degree differs from the
    forward's (``key.backward_overlap_degree``), the backward's own stages, stacked like
    ``stage_arrays`` (static part ``key.static.backward_stages``); ``None`` when the backward
    runs the forward's stages.

    ``plan_id`` int32 ``[cp]`` (``[rows, cp]`` batched), sharded like the plan: a fingerprint
    of the plan each device's process built; :func:`~magi_jax.magi_attention` compares it
    over the cp axis and gives NaN rows where the processes of a CP group planned different
    masks.

    A batched key (:func:`~magi_jax.sharding.make_batch_key`, ``key.rows`` set) holds
    one plan per batch row: every leaf has a leading ``[rows]`` axis sharded over
    ``key.batch_axes``, and ``plan`` / ``mask`` are ``None``.

    Cross attention with ``kv_layout == "dispatched"`` adds two leaves for the keys,
    ``kv_chunk_order`` and ``kv_chunk_inverse`` int32 ``[kv_padded_total / kv_chunk_size]``
    (their token-level views: ``kv_order`` ``[kv_padded_total]``, ``kv_inverse``
    ``[total_k]``; all ``None`` otherwise: self-attention keys have no key leaves).
    """

    def __init__(
        self,
        static: KeyStatic,
        chunk_order: jax.Array,
        chunk_inverse: jax.Array,
        stage_arrays: tuple,
        kv_chunk_order: jax.Array | None = None,
        kv_chunk_inverse: jax.Array | None = None,
        *,
        backward_stage_arrays: tuple | None = None,
        plan_id: jax.Array | None = None,
        plan: DistPlan | None = None,
        mask: AttnMask | None = None,
    ) -> None:
        self.static = static
        self.chunk_order = chunk_order
        self.chunk_inverse = chunk_inverse
        self.stage_arrays = stage_arrays
        self.kv_chunk_order = kv_chunk_order
        self.kv_chunk_inverse = kv_chunk_inverse
        self.backward_stage_arrays = backward_stage_arrays
        self.plan_id = plan_id
        self.plan = plan
        self.mask = mask

    def tree_flatten(self) -> tuple[tuple, KeyStatic]:
        return tuple(getattr(self, name) for name in _LEAVES), self.static

    def tree_flatten_with_keys(self) -> tuple[tuple, KeyStatic]:
        keys = jax.tree_util.GetAttrKey
        return tuple((keys(name), getattr(self, name)) for name in _LEAVES), self.static

    @property
    def order(self) -> jax.Array:
        """int32 ``[padded_total]`` (``[rows, padded_total]`` batched): the global position of
        each dispatched token (expanded from ``chunk_order``)."""
        return token_index(self.chunk_order, self.static.chunk_size)

    @property
    def inverse(self) -> jax.Array:
        """int32 ``[total]`` (``[rows, total]`` batched): the dispatched index of each natural
        position (expanded from ``chunk_inverse``)."""
        return token_index(self.chunk_inverse, self.static.chunk_size)[..., : self.static.total]

    @property
    def kv_order(self) -> jax.Array | None:
        """int32 ``[kv_padded_total]``: the global position of each dispatched key
        (``None`` unless ``kv_layout == "dispatched"``)."""
        if self.kv_chunk_order is None:
            return None
        return token_index(self.kv_chunk_order, self.static.kv_chunk_size)

    @property
    def kv_inverse(self) -> jax.Array | None:
        """int32 ``[total_k]``: the dispatched index of each natural key position (``None``
        unless ``kv_layout == "dispatched"``)."""
        if self.kv_chunk_inverse is None:
            return None
        return token_index(self.kv_chunk_inverse, self.static.kv_chunk_size)[
            ..., : self.static.total_k
        ]

    @classmethod
    def tree_unflatten(cls, static: KeyStatic, children: Sequence) -> MagiKey:
        *leaves, backward, plan_id = children
        return cls(static, *leaves, backward_stage_arrays=backward, plan_id=plan_id)

    mesh = property(lambda self: self.static.mesh)
    cp_axis = property(lambda self: self.static.cp_axis)
    cp = property(lambda self: self.static.cp)
    total = property(lambda self: self.static.total)
    padded_total = property(lambda self: self.static.padded_total)
    local_len = property(lambda self: self.static.local_len)
    chunk_size = property(lambda self: self.static.chunk_size)
    overlap_degree = property(lambda self: self.static.overlap_degree)
    backward_overlap_degree = property(
        lambda self: (
            self.static.overlap_degree
            if self.static.backward_overlap_degree is None
            else self.static.backward_overlap_degree
        )
    )
    block_q = property(lambda self: self.static.block_q)
    block_k = property(lambda self: self.static.block_k)
    stages = property(lambda self: self.static.stages)
    ffa_backend = property(lambda self: self.static.ffa_backend)
    comm_backend = property(lambda self: self.static.comm_backend)
    backward_refetch = property(lambda self: self.static.backward_refetch)
    capacity = property(lambda self: self.static.capacity)
    kv_layout = property(lambda self: self.static.kv_layout)
    batch_axes = property(lambda self: self.static.batch_axes)
    head_axes = property(lambda self: self.static.head_axes)
    rows = property(lambda self: self.static.rows)
    batched = property(lambda self: self.static.rows is not None)
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

    def plot(self, path: str | os.PathLike | None = None, **kwargs: Any) -> Figure:
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
        back = (
            ""
            if self.backward_overlap_degree == self.overlap_degree
            else f", backward_overlap_degree={self.backward_overlap_degree}"
        )
        cross = f", total_k={self.total_k}, kv_layout={self.kv_layout!r}" if self.cross else ""
        pod = "".join(
            f", {name}={value!r}"
            for name, value in (
                ("rows", self.rows),
                ("batch_axes", self.batch_axes),
                ("head_axes", self.head_axes),
            )
            if value
        )
        return (
            f"MagiKey(cp={self.cp}, total={self.total}, padded_total={self.padded_total}, "
            f"chunk_size={self.chunk_size}, overlap_degree={self.overlap_degree}{back}"
            f"{cross}{pod}{extra}{cap})"
        )


def token_index(chunks: jax.Array, chunk_size: int) -> jax.Array:
    """int32 ``[(B,) len(chunks)·chunk_size]``: the token-level view of a chunk permutation
    (row ``i`` -> ``chunks[i // chunk_size]·chunk_size + i % chunk_size``), on the device;
    ``chunks`` ``[(B,) num_chunks]``."""
    rows = chunks[..., None] * chunk_size + jnp.arange(chunk_size, dtype=chunks.dtype)
    return rows.reshape(chunks.shape[:-1] + (-1,))


def check_key(key: object, fn: str = "", *xs: object) -> None:
    """``key`` is a :class:`MagiKey`, and not one closed over by a traced function while its
    arrays span devices of other processes (``xs``: the call's array inputs; a tracer among
    them means a trace)."""
    if not isinstance(key, MagiKey):
        raise TypeError(
            f"key must be a MagiKey from make_flex_key/make_varlen_key; got {type(key).__name__}"
        )
    if not any(isinstance(x, jax.core.Tracer) for x in xs):
        return
    for leaf in jax.tree.leaves(key):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            if not leaf.is_fully_addressable:
                raise ValueError(
                    f"{fn or 'magi-jax'}: the key is closed over by a traced function, but "
                    "its arrays span devices of other processes, which JAX cannot embed "
                    "as constants: pass the key as an argument of the jitted function, "
                    "e.g. jax.jit(step)(params, batch, key) (one compilation serves every "
                    "key of one capacity)"
                )
            return


def device_ids(devices: Any) -> str:
    """Device ids for messages: ``[0, 1, 2, 3]``."""
    return str(sorted(d.id for d in devices))


def check_devices(key: MagiKey, fn: str, name: str, x: object, *, one_device: bool = True) -> None:
    """A concrete array committed to devices other than the key's mesh (a key built on
    another mesh, or, with ``one_device``, an array put on one device): a ``ValueError``
    that says so, where JAX would say "incompatible devices". Traced arrays carry no
    devices: nothing to see."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return
    if not getattr(x, "committed", True):
        return  # JAX moves uncommitted arrays where they are needed
    held, mesh = set(x.sharding.device_set), set(key.mesh.devices.flat)
    if held == mesh or (len(held) == 1 and not one_device):
        return
    if len(held) > 1:
        raise ValueError(
            f"{fn}: {name} lives on devices {device_ids(held)}, but the key was built on a "
            f"mesh of devices {device_ids(mesh)}: a key of another mesh. Build the key on "
            f"the mesh {name} lives on (make_flex_key(mask, mesh, ...) with that mesh), or "
            f"put {name} on the key's mesh: jax.device_put({name}, "
            "NamedSharding(key.mesh, P()))"
        )
    raise ValueError(
        f"{fn}: {name} is committed to device {device_ids(held)}, but the key's mesh holds "
        f"devices {device_ids(mesh)}, and JAX does not move committed arrays between them: "
        f"put {name} on the key's mesh first, jax.device_put({name}, "
        "NamedSharding(key.mesh, P())), or pass it uncommitted (jax.device_put(x) with no "
        "device, or a NumPy array)"
    )


@jax.tree_util.register_pytree_with_keys_class
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
        if key.batched:
            raise ValueError(
                "CheckedKey.of: the key is batched (one plan per row); check_dispatch is "
                "for keys of one mask"
            )
        return cls(
            key.static,
            key.chunk_order,
            key.chunk_inverse,
            key.stage_arrays,
            backward_stage_arrays=key.backward_stage_arrays,
            plan_id=key.plan_id,
            plan=key.plan,
            mask=key.mask,
        )

    def __repr__(self):
        return super().__repr__()[:-1] + ", check_dispatch=True)"


def is_checked(key: MagiKey) -> bool:
    return isinstance(key, CheckedKey)


def rows_desc(key: MagiKey) -> str:
    """How the key's dispatched rows add up, for messages."""
    st = key.static
    extra = f" + {st.cp} hidden check rows (check_dispatch=True)" if is_checked(key) else ""
    return (
        f"{key.padded_total} rows ({st.total} tokens + {st.padded_total - st.total} padding{extra})"
    )


def check_mesh(mesh: Mesh, cp_axis: str | tuple[str, ...]) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    try:
        names = cp_names(cp_axis)
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


def cp_names(cp_axis: str | tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes a cp axis spans: ``("cp",)`` for ``"cp"``, the tuple itself else."""
    return (cp_axis,) if isinstance(cp_axis, str) else tuple(cp_axis)


def cp_ranks(mesh: Mesh, cp_axis: str | tuple[str, ...]) -> dict:
    """Each device's cp rank: its index along the flattened cp axes (the first major)."""
    idx = [mesh.axis_names.index(a) for a in cp_names(cp_axis)]
    sizes = [int(mesh.shape[a]) for a in cp_names(cp_axis)]
    return {
        d: int(np.ravel_multi_index([pos[i] for i in idx], sizes))
        for pos, d in np.ndenumerate(mesh.devices)
    }


def normal_cp_axis(cp_axis: str | tuple[str, ...] | list[str]) -> str | tuple[str, ...]:
    """A hashable cp axis: a name, or a tuple of two names or more (a 1-tuple is its name)."""
    if isinstance(cp_axis, (tuple, list)):
        cp_axis = tuple(cp_axis)
        return cp_axis[0] if len(cp_axis) == 1 else cp_axis
    return cp_axis


def axes_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """A ``PartitionSpec`` entry for mesh axes: ``None`` (none), the name (one), the tuple."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def check_pod_axes(
    mesh: Mesh,
    cp_axis: str | tuple[str, ...],
    batch_axes: str | tuple[str, ...] | list[str] | None,
    head_axes: str | tuple[str, ...] | list[str] | None,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(batch_axes, head_axes)`` as tuples of distinct mesh axes, none of them a cp axis."""
    out = []
    for name, axes in (("batch_axes", batch_axes), ("head_axes", head_axes)):
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        bad = [a for a in axes if not isinstance(a, str) or a not in mesh.axis_names]
        if bad or len(set(axes)) != len(axes):
            raise ValueError(
                f"{name}={axes!r} must name distinct axes of the mesh (axes: "
                f"{mesh.axis_names}), e.g. {name}=('dp',)"
            )
        clash = set(axes) & set(cp_names(cp_axis))
        if clash:
            raise ValueError(
                f"{name}={axes!r} shares {sorted(clash)} with cp_axis={cp_axis!r}: an axis "
                "carries either the sequence or the " + ("batch" if name[0] == "b" else "heads")
            )
        out.append(axes)
    if set(out[0]) & set(out[1]):
        raise ValueError(
            f"batch_axes={out[0]!r} and head_axes={out[1]!r} share an axis: each mesh axis "
            "shards one dimension of q, k, v"
        )
    return out[0], out[1]
