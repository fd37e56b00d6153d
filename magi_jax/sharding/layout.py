"""The dispatched layout: :func:`dispatch` / :func:`undispatch` move arrays between natural
and dispatched order, :func:`position_ids` gives every dispatched token its global position,
and the row helpers here are what :mod:`~magi_jax.sharding.roll` and
:mod:`~magi_jax.sharding.attention` lay arrays out with.

Dispatch moves whole chunks (padding sits at the end of the padded sequence, in chunks of
its own), so both directions are one gather of ``[num_chunks, chunk_size, ...]`` blocks by
the key's ``[num_chunks]`` leaves: no token-level index exists, on the host or on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from magi_jax.caches import cached
from magi_jax.sharding.keys import (
    ROLES,
    MagiKey,
    axes_entry,
    check_devices,
    check_key,
    device_ids,
    is_checked,
    rows_desc,
)

__all__ = [
    "DispatchedArray",
    "open_dispatched",
    "layout_tag",
    "poison",
    "dispatch",
    "PodSpecs",
    "pod_specs",
    "undispatch",
    "position_ids",
    "split_axis",
    "merge_axes",
    "check_seq_axis",
    "shard_rows",
    "plans_agree",
]


# Dispatch moves whole chunks (padding sits at the end of the padded sequence, in chunks of
# its own), so both directions are one gather of [num_chunks, chunk_size, ...] blocks by the
# key's [num_chunks] leaves: no token-level index exists, on the host or on the device.


def split_axis(x: jax.Array, axis: int, *sizes: int) -> jax.Array:
    """``x`` with axis ``axis`` split into ``sizes`` (their product is its length)."""
    return x.reshape(x.shape[:axis] + sizes + x.shape[axis + 1 :])


def merge_axes(x: jax.Array, axis: int, count: int) -> jax.Array:
    """``x`` with axes ``axis .. axis + count - 1`` merged into one."""
    n = int(np.prod(x.shape[axis : axis + count]))
    return x.reshape(x.shape[:axis] + (n,) + x.shape[axis + count :])


def _take_chunks(x, chunks, chunk_size: int, axis: int):
    """Row block ``i`` (``chunk_size`` rows along ``axis``) of the result is block
    ``chunks[i]`` of ``x`` (``x.shape[axis] == len(chunks) · chunk_size``)."""
    blocks = split_axis(x, axis, chunks.shape[0], chunk_size)
    return merge_axes(jnp.take(blocks, chunks, axis=axis), axis, 2)


def _gather_chunks(x, key: MagiKey, chunks, chunk_size: int, axis: int):
    """:func:`_take_chunks` by the key's permutation; a batched key's rows each by their own
    (``x``'s axis 0 is the batch, ``chunks`` ``[B, num_chunks]``)."""
    if not key.batched:
        return _take_chunks(x, chunks, chunk_size, axis)
    take = lambda xb, cb: _take_chunks(xb, cb, chunk_size, axis - 1)
    return jax.vmap(take)(x, chunks)


def _check_rows(x, key: MagiKey, axis: int, fn: str):
    """A batched key's arrays are ``[B, ...]`` with the sequence on a later axis."""
    if key.batched and (axis == 0 or x.shape[0] != key.rows):
        raise ValueError(
            f"{fn}: x has shape {tuple(x.shape)} (sequence on axis {axis}), but the key is "
            f"batched: one plan for each of {key.rows} rows, so x must be [{key.rows}, ...] "
            "with the sequence on axis 1 (seq_axis=1)"
        )


def _unshard_explicit(x, key: MagiKey, axis: int):
    """On a mesh with Explicit axes, ``x`` resharded to keep only its batch axis split (the
    chunk gathers then run on whole sequences)."""
    if any(t == jax.sharding.AxisType.Explicit for t in key.mesh.axis_types):
        batch = axes_entry(key.batch_axes) if axis > 0 else None
        x = jax.sharding.reshard(x, NamedSharding(key.mesh, P(batch)))
    return x


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
    return merge_axes(
        _pad_rows(split_axis(x, axis, st.cp, st.local_len), axis + 1, st.local_len + 1), axis, 2
    )


def _drop_hidden_rows(x, key, axis: int):
    """The inverse of :func:`_add_hidden_rows`."""
    st = key.static
    blocks = split_axis(x, axis, st.cp, st.local_len + 1)
    return merge_axes(jax.lax.slice_in_dim(blocks, 0, st.local_len, axis=axis + 1), axis, 2)


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
        return shard_rows(x, key, axis, replicated=True)
    x = _pad_rows(x, axis, key.kv_padded_total)
    return shard_rows(
        _gather_chunks(x, key, key.kv_chunk_order, key.static.kv_chunk_size, axis), key, axis
    )


@jax.named_scope("magi_dispatch")
def dispatch(
    x: jax.typing.ArrayLike,
    key: MagiKey,
    seq_axis: int = 0,
    *,
    role: str = "q",
    typed: bool = False,
) -> jax.Array | DispatchedArray:
    """Natural order -> dispatched order along ``seq_axis`` (``total`` -> ``padded_total``
    rows), sharded over the cp axis: rank ``r`` holds rows ``[r·local_len, (r+1)·local_len)``;
    padding rows are zero. Differentiable (the VJP gathers the cotangent back).

    ``role="kv"`` lays out keys and values (``total_k`` rows): for self-attention keys the
    same as queries; for cross-attention keys the layout ``key.kv_layout`` names:
    ``"replicated"`` returns ``x`` replicated on every rank (``total_k`` rows, no padding),
    ``"dispatched"`` permutes it to ``key.kv_padded_total`` rows, rank ``r`` holding rows
    ``[r·kv_local_len, (r+1)·kv_local_len)``. Call it for k and v whatever the layout.

    ``typed=True`` returns a :class:`DispatchedArray`: the array with the key's plan id, so
    that :func:`~magi_jax.magi_attention` and :func:`undispatch` can tell a key other than
    the one it was dispatched with (see there)."""
    check_key(key, "dispatch", x)
    _check_role(role, "dispatch")
    if isinstance(x, DispatchedArray):
        raise ValueError(
            "dispatch: x is a DispatchedArray, already in a key's dispatched layout; "
            "dispatching it again would scramble its rows (pass it to magi_attention as it "
            "is, or undispatch it first)"
        )
    if not isinstance(typed, bool):
        raise TypeError(f"dispatch: typed={typed!r} must be a bool")
    if typed:
        y = dispatch(x, key, seq_axis, role=role)
        tag = layout_tag(key, role, check_seq_axis(y, seq_axis, "dispatch"))
        return DispatchedArray(y, key.plan_id, tag)
    x = _as_array(x, "dispatch")
    check_devices(key, "dispatch", "x", x)
    axis = check_seq_axis(x, seq_axis, "dispatch")
    _check_rows(x, key, axis, "dispatch")
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
    y = _pad_rows(x, axis, st.padded_total)
    y = _gather_chunks(y, key, key.chunk_order, st.chunk_size, axis)
    if is_checked(key):
        y = _add_hidden_rows(y, key, axis)
    return shard_rows(y, key, axis)


@jax.named_scope("magi_undispatch")
def undispatch(
    x: jax.typing.ArrayLike, key: MagiKey, seq_axis: int = 0, *, role: str = "q"
) -> jax.Array:
    """Dispatched -> natural order along ``seq_axis`` (``padded_total`` -> ``total`` rows,
    padding dropped). Differentiable (padding rows get zero cotangent). ``role="kv"``: the
    inverse of ``dispatch(..., role="kv")`` (``key.kv_padded_total`` -> ``total_k`` rows; a
    replicated layout comes back as it is). A :class:`DispatchedArray` is checked against
    the key first (:func:`open_dispatched`)."""
    check_key(key, "undispatch", x)
    _check_role(role, "undispatch")
    if isinstance(x, DispatchedArray):
        x, ok = open_dispatched(x, key, "undispatch", "x", role)
        return poison(undispatch(x, key, seq_axis, role=role), ok)
    x = _as_array(x, "undispatch")
    check_devices(key, "undispatch", "x", x)
    axis = check_seq_axis(x, seq_axis, "undispatch")
    _check_rows(x, key, axis, "undispatch")
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
        x = _unshard_explicit(x, key, axis)
        y = _gather_chunks(x, key, key.kv_chunk_inverse, key.static.kv_chunk_size, axis)
        return jax.lax.slice_in_dim(y, 0, key.total_k, axis=axis)
    if x.shape[axis] != key.padded_total:
        raise _length_error(
            "undispatch",
            x,
            axis,
            seq_axis,
            key.padded_total,
            f"the key dispatches {rows_desc(key)}",
            (
                key.total,
                "That is the natural-order length: x looks undispatched already "
                "(undispatch takes outputs of dispatch / magi_attention with this key)",
            ),
        )
    x = _unshard_explicit(x, key, axis)
    if is_checked(key):
        x = _drop_hidden_rows(x, key, axis)
    st = key.static
    y = _gather_chunks(x, key, key.chunk_inverse, st.chunk_size, axis)
    return _guard(jax.lax.slice_in_dim(y, 0, st.total, axis=axis), key, axis)


def plans_agree(key: MagiKey) -> jax.Array:
    """bool ``[]`` (``[B]`` batched): whether every rank of the CP group (of each row) holds
    the same plan, from the ``plan_id`` each device's process wrote (two scalar collectives
    over the cp axis). The processes of a CP group plan by themselves; a loader bug or
    another seed on one of them would otherwise go unseen."""
    batch = axes_entry(key.batch_axes) if key.batched else None
    spec = P(batch, key.cp_axis) if key.batched else P(key.cp_axis)
    return _agreement(key.mesh, key.cp_axis, spec)(key.plan_id)


@cached(64)
def _agreement(mesh: jax.sharding.Mesh, cp_axis, spec: P):
    """The compiled check of :func:`plans_agree` for one mesh and layout (cached: an eager
    ``undispatch`` would otherwise trace and compile it again at every call)."""

    def body(ids):
        return (jax.lax.pmin(ids, cp_axis) == jax.lax.pmax(ids, cp_axis)).astype(ids.dtype)

    check = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(lambda ids: check(ids).min(axis=-1) > 0)


def _guard(y, key: MagiKey, axis: int):
    """NaN where the CP group's plans disagree: a dispatch permutation that differs between
    processes would gather zeros into some rows, which must not pass for an answer."""
    if key.plan_id is None or not jnp.issubdtype(y.dtype, jnp.inexact):
        return y
    agree = plans_agree(key)
    if key.batched:
        agree = agree.reshape((-1,) + (1,) * (y.ndim - 1))
    return jnp.where(agree, y, jnp.nan)


def check_seq_axis(x: jax.Array, seq_axis: int, fn: str) -> int:
    """``seq_axis`` of ``x`` (any rank) as a non-negative axis; ``TypeError`` / ``ValueError``
    naming ``fn`` when it is not an int or out of range."""
    if isinstance(seq_axis, (bool, np.bool_)) or not isinstance(seq_axis, (int, np.integer)):
        raise TypeError(
            f"{fn}: seq_axis={seq_axis!r} must be an int (the axis of the packed sequence)"
        )
    if not -x.ndim <= seq_axis < x.ndim:
        raise ValueError(
            f"{fn}: seq_axis={seq_axis} is out of range for an array of shape {tuple(x.shape)}"
        )
    return seq_axis % x.ndim


@jax.named_scope("magi_position_ids")
def position_ids(key: MagiKey, *, role: str = "q") -> jax.Array:
    """int32 ``[padded_total]`` (``[B, padded_total]`` for a batched key: each row's own): the
    global position of every dispatched token (for RoPE);
    padding tokens get positions ``>= total``. Sharded like dispatched arrays: on a mesh
    with Explicit axes it is typed ``P(cp_axis)`` like them (so RoPE's products stay
    sharded), and JAX then asks for an ``out_sharding`` to index it; look at it with
    ``np.asarray(pos)`` or ``jax.sharding.reshard(pos, NamedSharding(key.mesh, P()))``.
    ``role="kv"``: the positions of the keys in ``dispatch(..., role="kv")``'s layout
    (``[kv_padded_total]``; ``arange(total_k)`` replicated for a replicated layout)."""
    check_key(key)
    _check_role(role, "position_ids")
    if _kv_role(key, role):
        if key.kv_layout == "replicated":
            pos = jnp.arange(key.total_k, dtype=jnp.int32)
            if key.batched:
                pos = jnp.broadcast_to(pos, (key.rows, key.total_k))
            return shard_rows(pos, key, pos.ndim - 1, replicated=True)
        return shard_rows(key.kv_order, key, key.kv_order.ndim - 1)
    order = key.order
    if is_checked(key):
        st = key.static
        hidden = st.padded_total + jnp.arange(st.cp, dtype=order.dtype)[:, None]
        order = jnp.concatenate([order.reshape(st.cp, st.local_len), hidden], axis=1)
        order = order.reshape(-1)
    return shard_rows(order, key, order.ndim - 1)


def shard_rows(x: jax.Array, key: MagiKey, axis: int = 0, replicated: bool = False) -> jax.Array:
    """Constrains ``x`` to be sharded along ``axis`` over the cp axis (Auto or Explicit), or
    to be replicated along it; an axis 0 before the sequence is the batch, sharded over the
    key's batch axes."""
    entries = [None] * x.ndim
    if axis > 0:
        entries[0] = axes_entry(key.batch_axes)
    if not replicated:
        entries[axis] = key.cp_axis
    spec = P(*entries)
    explicit = any(t == jax.sharding.AxisType.Explicit for t in key.mesh.axis_types)
    if explicit:
        return jax.sharding.reshard(x, NamedSharding(key.mesh, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(key.mesh, spec))


class PodSpecs(NamedTuple):
    """The ``shard_map`` specs of one :func:`~magi_jax.sharding.magi_attention` call: q, k/v and out
    ``[(B,) T, H, D]``, lse ``[(B,) T, H]``, max logits ``[(B,) H]``, and the plan leaves
    (``[cp, ...]``, or ``[B, cp, ...]`` for a batched key)."""

    q: P
    kv: P
    lse: P
    max_logits: P
    plan: P


def pod_specs(key: MagiKey, ndim: int) -> PodSpecs:
    """How ``ndim``-dimensional inputs and the key's plans are sharded: the sequence over the
    cp axis, a batch axis over ``key.batch_axes``, the heads over ``key.head_axes``."""
    batch, heads = axes_entry(key.batch_axes), axes_entry(key.head_axes)
    lead = (batch,) if ndim == 4 else ()
    q = P(*lead, key.cp_axis, heads)
    kv = P(*lead, None, heads) if key.kv_layout == "replicated" else q
    plan = P(batch, key.cp_axis) if key.batched else P(key.cp_axis)
    return PodSpecs(q, kv, P(*lead, key.cp_axis, heads), P(*lead, heads), plan)


# ---- the typed route: arrays that remember their key --------------------------------------
#
# A stale key (arrays dispatched with key A, attended with key B of the same mesh and
# capacity) cannot be seen on plain arrays: the two layouts have the same shape and
# sharding, and values carry nothing that survives the model's token-wise layers. So the
# typed route carries the key with the array: a pytree whose leaves are the array and the
# key's plan id (a fingerprint of the mask and its dispatch, [cp] int32 sharded like the
# plan), its static part the mesh and layout (as splash attention's kernel object carries
# its mask info through jit). Concrete plan ids are compared on the host (an error); traced
# ones on the device, one scalar all-reduce and one select over the output (NaN rows).


class _Tag(NamedTuple):
    """The static part of a :class:`DispatchedArray`: where and how it was laid out."""

    mesh: jax.sharding.Mesh
    cp_axis: str | tuple[str, ...]
    role: str
    seq_axis: int
    checked: bool


def layout_tag(key: MagiKey, role: str, seq_axis: int) -> _Tag:
    """The tag of an array laid out by ``key`` for ``role`` (the keys of a self-attention
    key are laid out like the queries: one role)."""
    return _Tag(key.mesh, key.cp_axis, role if key.cross else "q", seq_axis, is_checked(key))


@jax.tree_util.register_pytree_with_keys_class
class DispatchedArray:
    """An array in a key's dispatched layout, with the key's plan id: what
    ``mj.dispatch(x, key, typed=True)`` returns.

    :func:`~magi_jax.magi_attention`, :func:`undispatch` and :func:`open_dispatched` compare
    its plan id with their key's: a key built for another mask (a batch paired with the
    wrong key) raises ``ValueError`` where the ids are concrete (eager calls, or a key and
    array both closed over) and gives NaN outputs where they are traced (under ``jit``);
    a key of another mesh, another layout (``role``, ``check_dispatch``) or a second
    ``dispatch`` raises at trace time. Keys of one mask (the same plan) agree.

    Token-wise layers run on ``.value`` through :meth:`map`, which keeps the plan id:
    ``h = x.map(embed)``, ``q, k, v = h.map(qkv_proj)``. A pytree (leaves: ``value`` and
    ``plan_id``), so it passes through ``jax.jit`` like the array; differentiate with
    respect to the parameters that ``map`` closes over, or to ``.value`` (the plan id is an
    integer leaf, which ``jax.grad`` refuses)."""

    def __init__(self, value: jax.Array, plan_id: jax.Array | None, tag: _Tag) -> None:
        self.value = value
        self.plan_id = plan_id
        self.tag = tag

    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.ndim)

    def tree_flatten(self) -> tuple[tuple, _Tag]:
        return (self.value, self.plan_id), self.tag

    def tree_flatten_with_keys(self) -> tuple[tuple, _Tag]:
        keys = jax.tree_util.GetAttrKey
        return ((keys("value"), self.value), (keys("plan_id"), self.plan_id)), self.tag

    @classmethod
    def tree_unflatten(cls, tag: _Tag, children: Sequence) -> DispatchedArray:
        return cls(*children, tag)

    def map(self, fn: Callable[..., Any], *others: Any) -> Any:
        """``fn(self.value, *others)`` (other ``DispatchedArray`` arguments passed as their
        values); every array of the result that keeps this array's rows along ``seq_axis``
        is a ``DispatchedArray`` of this layout (others, e.g. a sum, come back plain). Arguments
        dispatched with another key raise (concrete ids) or make the result's plan id
        ``-1``, which no key matches (traced ids)."""
        plan_id = self.plan_id
        args = []
        for i, o in enumerate(others):
            if isinstance(o, DispatchedArray):
                if o.tag != self.tag:
                    raise ValueError(
                        f"DispatchedArray.map: argument {i + 1} was laid out otherwise "
                        f"({_describe(o.tag)}) than this array ({_describe(self.tag)})"
                    )
                plan_id = _combine(plan_id, o.plan_id, i + 1)
                o = o.value
            args.append(o)
        out = fn(self.value, *args)
        axis, rows = self.tag.seq_axis, self.value.shape[self.tag.seq_axis]

        def wrap(y):
            if getattr(y, "ndim", 0) > axis and y.shape[axis] == rows:
                return DispatchedArray(y, plan_id, self.tag)
            return y

        return jax.tree.map(wrap, out)

    def __repr__(self):
        return f"DispatchedArray({_describe(self.tag)}, value={self.value!r})"


def _describe(tag: _Tag) -> str:
    check = ", check_dispatch=True" if tag.checked else ""
    return (
        f"mesh {dict(tag.mesh.shape)} of devices {device_ids(tag.mesh.devices.flat)}, "
        f"cp_axis={tag.cp_axis!r}, role={tag.role!r}, seq_axis={tag.seq_axis}{check}"
    )


def _ids(a: np.ndarray) -> str:
    """Plan ids for messages: one number when every rank holds the same."""
    flat = a.ravel()
    return str(int(flat[0])) if flat.size and (flat == flat[0]).all() else str(flat.tolist())


def _concrete(a) -> bool:
    return a is None or (
        not isinstance(a, jax.core.Tracer)
        and (not isinstance(a, jax.Array) or a.is_fully_addressable)
    )


def _combine(a, b, i):
    """Plan ids of two arrays combined: ``a`` where they agree, ``-1`` elsewhere."""
    if a is None or b is None:
        return a if b is None else b
    if _concrete(a) and _concrete(b):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise ValueError(
                f"DispatchedArray.map: argument {i} was dispatched with another key (plan "
                f"id {_ids(np.asarray(b))} against {_ids(np.asarray(a))}): arrays of "
                "different packings cannot be combined row by row"
            )
        return a
    return jnp.where(a == b, a, -1)


def open_dispatched(
    x: DispatchedArray,
    key: MagiKey,
    fn: str = "open_dispatched",
    name: str = "x",
    role: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``(x.value, ok)`` once ``x`` is checked against ``key``: ``ok`` is ``None`` when the
    check was made on the host (it raised ``ValueError`` if ``x`` was dispatched with
    another key, naming the mistake), or a traced bool ``[]`` to pass to :func:`poison`.
    A layout that differs statically (another mesh or cp axis, the other ``role``, a
    ``check_dispatch`` key against an unchecked one) raises at trace time."""
    if not isinstance(x, DispatchedArray):
        raise TypeError(f"{fn}: {name} must be a DispatchedArray; got {type(x).__name__}")
    check_key(key, fn)
    want = layout_tag(key, x.tag.role if role is None else role, x.tag.seq_axis)
    if x.tag.mesh != key.mesh or x.tag.cp_axis != key.cp_axis:
        raise ValueError(
            f"{fn}: {name} was dispatched with a key of another mesh ({_describe(x.tag)}); "
            f"this key is on mesh {dict(key.mesh.shape)} of devices "
            f"{device_ids(key.mesh.devices.flat)}, cp_axis={key.cp_axis!r}. "
            f"Attend with the key {name} was dispatched with, or build the keys on one mesh"
        )
    if x.tag.checked != want.checked or x.tag.role != want.role:
        raise ValueError(
            f"{fn}: {name} was laid out by another kind of key ({_describe(x.tag)}; this "
            f"call wants {_describe(want)}): dispatch and attend with the same key"
        )
    mine, theirs = key.plan_id, x.plan_id
    if mine is None or theirs is None:
        return x.value, None  # a key built by hand carries no plan id
    if _concrete(mine) and _concrete(theirs):
        a, b = np.asarray(theirs), np.asarray(mine)
        if a.shape != b.shape or not np.array_equal(a, b):
            raise ValueError(
                f"{fn}: {name} was dispatched with another key: its plan id "
                f"{_ids(a)} is not this key's {_ids(b)} (a "
                "key of another mask, or another dispatch): its rows are in another order, "
                f"and attending them with this key gives a wrong answer. Dispatch {name} with "
                "this key (mj.dispatch(x, key, typed=True)), or pass the key it was "
                "dispatched with"
            )
        return x.value, None
    if mine.shape != theirs.shape:
        raise ValueError(
            f"{fn}: {name} was dispatched with another key (plan ids of shape "
            f"{tuple(theirs.shape)}, this key's {tuple(mine.shape)})"
        )
    return x.value, jnp.all(mine == theirs)


def poison(y: Any, ok: jax.Array | None) -> Any:
    """``y`` (any pytree) with NaN in every floating array where ``ok`` is false (``ok``
    ``None``: nothing to do); integer arrays cannot hold NaN and pass unchanged."""
    if ok is None:
        return y

    def put(a):
        if isinstance(a, DispatchedArray):
            return DispatchedArray(put(a.value), a.plan_id, a.tag)
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact):
            return jnp.where(ok, a, jnp.nan)
        return a

    return jax.tree.map(put, y, is_leaf=lambda a: isinstance(a, DispatchedArray))
