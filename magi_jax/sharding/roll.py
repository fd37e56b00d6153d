"""``roll``: ``jnp.roll`` of the packed sequence for arrays in dispatched order.

``roll(x, shift, key)`` is ``dispatch(jnp.roll(undispatch(x, key), shift), key)`` without
leaving the dispatched layout: only the tokens whose source lives on another rank travel,
by one ``ppermute`` per rank offset that carries any, and every rank then fills its rows
with one local gather. Nothing is gathered over the whole sequence.

The host half (:func:`roll_tables`) is NumPy: from the dispatch (which chunks each rank
holds) and the static shift it computes, per destination row, the source rank and row, and
packs them into int32 tables of static shape, cached by (dispatch, shift, mesh).

A key built at a ``PlanCapacity`` and passed to a jitted function as an argument carries its
dispatch as traced data, which the host cannot plan from. For it the plan is made on the
device (:func:`_move_edges`): a roll by ``|t| < chunk_size`` (``t``: the shift modulo
``total``, signed, in ``(-total/2, total/2]``) moves only the ``|t|`` rows at one end of each
chunk into its neighbour, plus the ``|t|`` rows that wrap around at ``total``. One
``all_gather`` over the cp axis gives every rank those rows, ``(num_chunks + cp)·|t|`` in all
(tiny for label shifts, never O(total)), and one local gather with indices computed from
``chunk_order`` / ``chunk_inverse`` fills every row.

Semantics of padding: the roll is over the ``total`` real tokens in natural order (position
``p`` receives position ``(p - shift) mod total``), as the definition above says; padding
rows (positions ``>= total``) and the hidden rows of a ``check_dispatch`` key come out zero
whatever they held, and nothing is read from them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from magi_jax.caches import Cache
from magi_jax.sharding.keys import MagiKey, axes_entry, check_key, put_global, rows_desc
from magi_jax.sharding.layout import (
    DispatchedArray,
    check_seq_axis,
    merge_axes,
    open_dispatched,
    poison,
    split_axis,
)

__all__ = ["roll", "roll_tables", "RollTables", "clear_roll_cache"]


@dataclasses.dataclass(frozen=True, eq=False)
class RollTables:
    """Where every dispatched row of a roll comes from, as per-rank int32 tables.

    ``deltas``: the rank offsets ``d > 0`` that carry tokens (rank ``r`` sends to rank
    ``(r + d) % cp``). ``send[j]``: int32 ``[cp, width_j]``, the local rows rank ``r`` sends
    for ``deltas[j]``, in the order the receiver stores them (entries past what a rank sends
    are 0 and never read). ``gather``: int32 ``[cp, rows]``, per destination row its row in
    the rank's buffer ``concat(local rows, received for deltas[0], ..., one zero row)``."""

    deltas: tuple[int, ...]
    send: tuple[np.ndarray, ...]
    gather: np.ndarray

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(int(s.shape[1]) for s in self.send)


def roll_tables(
    rank_chunks: np.ndarray, chunk_size: int, total: int, shift: int, rows: int | None = None
) -> RollTables:
    """Host plan of a roll by ``shift`` over a dispatch (pure NumPy).

    Args:
      rank_chunks: int ``[cp, chunks_per_rank]``, the chunks each rank holds, back to back
        (``DispatchMeta.rank_chunks``); chunk ``c`` is positions ``[c·chunk_size,
        (c+1)·chunk_size)``, positions ``>= total`` are padding.
      chunk_size, total: of the dispatch; shift: any int (taken modulo ``total``).
      rows: local rows of the dispatched array (default ``chunks_per_rank · chunk_size``;
        one more for a ``check_dispatch`` key, whose extra row is zero).

    Destination position ``p < total`` takes the token at ``(p - shift) mod total``; padding
    rows and extra rows take the zero row.
    """
    rank_chunks = np.asarray(rank_chunks, np.int64)
    cp, per_rank = rank_chunks.shape
    c = int(chunk_size)
    local = per_rank * c
    rows = local if rows is None else int(rows)
    owner = np.empty(cp * per_rank, np.int64)
    owner[rank_chunks.reshape(-1)] = np.repeat(np.arange(cp), per_rank)
    slot = np.empty(cp * per_rank, np.int64)
    slot[rank_chunks.reshape(-1)] = np.tile(np.arange(per_rank), cp)

    pos = (rank_chunks[:, :, None] * c + np.arange(c)).reshape(cp, local)
    dst_rank = np.broadcast_to(np.arange(cp)[:, None], pos.shape)
    real = pos < total
    src = (pos[real] - shift) % total
    src_rank = owner[src // c]
    src_row = slot[src // c] * c + src % c
    r = dst_rank[real]
    delta = (r - src_rank) % cp

    # Group the real rows by (delta, destination rank), each group in destination-row order
    # (a stable sort of a row-major scan): a row's place in its group is its place in the
    # received buffer of that delta.
    group = delta * cp + r
    order = np.argsort(group, kind="stable")
    counts = np.bincount(group, minlength=cp * cp)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    place = np.empty_like(group)
    place[order] = np.arange(group.size) - starts[group[order]]
    width = counts.reshape(cp, cp).max(axis=1)

    deltas = tuple(int(d) for d in range(1, cp) if width[d] > 0)
    offset = np.zeros(cp, np.int64)
    send = []
    at = rows
    for d in deltas:
        offset[d] = at
        table = np.zeros((cp, int(width[d])), np.int32)
        sel = delta == d
        table[(r[sel] - d) % cp, place[sel]] = src_row[sel]
        send.append(table)
        at += int(width[d])
    zero_row = at
    gather = np.full((cp, rows), zero_row, np.int64)
    gather_real = np.where(delta == 0, src_row, offset[delta] + place)
    gather[:, :local][real] = gather_real
    gather = gather.astype(np.int32)
    for a in (gather, *send):
        a.setflags(write=False)
    return RollTables(deltas, tuple(send), gather)


# ---- where the host knows the dispatch ----------------------------------------------------


def _dispatch_of(key: MagiKey):
    """``(rank_chunks, fingerprint)`` of the key's dispatch, from host data only.

    A key of one mask names its dispatch in its static part (so a key passed to a jitted
    function as an argument still tells it); otherwise the host plan or concrete arrays of
    the key are read."""
    st = key.static
    if st.fingerprint is not None:
        meta_fp = st.fingerprint[1]
        total, cp, chunk, chunks = meta_fp
        n = st.padded_total // chunk
        itemsize = len(chunks) // n
        rank_chunks = np.frombuffer(chunks, np.dtype(f"<i{itemsize}")).reshape(cp, -1)
        return rank_chunks, meta_fp
    if key.plan is not None:
        meta = key.plan.meta
        return meta.rank_chunks, meta.fingerprint()
    if isinstance(key.chunk_order, jax.core.Tracer):
        # roll() sends such keys down the device-planned path (_edge_route) before this.
        raise ValueError(
            "roll: the key was built at a PlanCapacity and is traced (passed to a jitted "
            "function as an argument), so its dispatch is data the host cannot plan from"
        )
    rank_chunks = np.asarray(key.chunk_order).astype(np.int64).reshape(st.cp, -1)
    return rank_chunks, (st.total, st.cp, st.chunk_size, rank_chunks.tobytes())


_TABLES = Cache("roll tables", 64)  # by (dispatch, shift, mesh, axis, rows)
# The compiled per-rank programs of a route, by (route, deltas or edge shift): without them
# every eager roll would trace and compile its shard_map again.
_PROGRAMS = Cache("roll programs", 64)


def clear_roll_cache() -> None:
    """Drops the cached roll tables (host and device)."""
    _TABLES.clear()


def _device_tables(key: MagiKey, shift: int):
    """``(deltas, send arrays, gather array)`` for ``key`` and ``shift``, sharded over the cp
    axis (rank ``r`` holds row ``r`` of each table)."""
    st = key.static
    rows = key.local_len
    rank_chunks, fp = _dispatch_of(key)

    def build():
        t = roll_tables(rank_chunks, st.chunk_size, st.total, shift, rows)
        shard = NamedSharding(st.mesh, P(st.cp_axis))
        return t.deltas, tuple(put_global(s, shard) for s in t.send), put_global(t.gather, shard)

    return _TABLES.get((fp, shift, st.mesh, st.cp_axis, rows), build)


# ---- the device half ----------------------------------------------------------------------


def _move(x, send, gather, deltas, cp, cp_axis, axis):
    """One rank: send each delta's rows, then fill every row from local + received + zero."""
    parts = [x]
    for d, table in zip(deltas, send):
        out = jnp.take(x, table[0], axis=axis, mode="clip")
        parts.append(jax.lax.ppermute(out, cp_axis, [(r, (r + d) % cp) for r in range(cp)]))
    zero_shape = list(x.shape)
    zero_shape[axis] = 1
    parts.append(jnp.zeros(zero_shape, x.dtype))
    return jnp.take(jnp.concatenate(parts, axis=axis), gather[0], axis=axis, mode="clip")


@dataclasses.dataclass(frozen=True)
class _Route:
    """The static part of one roll: its mesh axis and the rank offsets of the forward
    (``fwd``) and of its transpose, the roll by ``-shift`` (``bwd``)."""

    mesh: jax.sharding.Mesh
    cp_axis: str
    cp: int
    axis: int
    fwd: tuple[int, ...]
    bwd: tuple[int, ...]

    def move(self, x, deltas, send, gather):
        return _PROGRAMS.get((self, deltas), lambda: self._program(deltas))(x, send, gather)

    def _program(self, deltas):
        spec = P(*([None] * self.axis), self.cp_axis)
        table_spec = P(self.cp_axis)

        def body(x, send, gather):
            return _move(x, send, gather, deltas, self.cp, self.cp_axis, self.axis)

        return jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(spec, tuple(table_spec for _ in deltas), table_spec),
                out_specs=spec,
                check_vma=False,
            )
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _roll_linear(route, x, fwd, bwd):
    return route.move(x, route.fwd, *fwd)


def _roll_linear_fwd(route, x, fwd, bwd):
    return route.move(x, route.fwd, *fwd), bwd


def _roll_linear_bwd(route, bwd, ct):
    # The roll is linear; its transpose is the roll by -shift (padding rows: zero both ways).
    return route.move(ct, route.bwd, *bwd), None, None


_roll_linear.defvjp(_roll_linear_fwd, _roll_linear_bwd)


# ---- where the dispatch is traced data (a capacity key passed to jit) ----------------------
#
# The host sees no dispatch, so nothing can be planned per rank pair. A roll by |t| < C moves
# only the |t| rows at one end of every chunk into the neighbouring chunk, plus |t| rows that
# wrap around at ``total``: each rank contributes the edge rows of its chunks and its share
# of the wrap rows, one all_gather gives every rank all of them ((num_chunks + cp)·|t| rows,
# never O(total)), and one gather with indices computed from chunk_order / chunk_inverse
# fills every local row.


def _traced_dispatch(key: MagiKey) -> bool:
    """Whether the key's dispatch is traced data the host cannot read (see _dispatch_of)."""
    return (
        key.static.fingerprint is None
        and key.plan is None
        and isinstance(key.chunk_order, jax.core.Tracer)
    )


def _signed_shift(shift: int, total: int) -> int:
    """``shift mod total`` as the signed shift in ``(-total/2, total/2]``."""
    s = shift % total
    return s if 2 * s <= total else s - total


def _move_edges(x, chunk_order, chunk_inverse, t, route):
    """One rank: gather the edge rows of all chunks and the wrap rows, then fill every row
    from local + gathered + zero (roll by the signed shift ``t``, ``|t| < chunk_size``)."""
    axis, c, total, per_rank = route.axis, route.chunk_size, route.total, route.per_rank
    rows, local, k = x.shape[axis], per_rank * route.chunk_size, abs(t)
    j = jnp.arange(local, dtype=jnp.int32)
    slot = jax.lax.axis_index(route.cp_axis).astype(jnp.int32) * per_rank + j // c
    row_in_chunk = j % c
    chunk = jnp.take(chunk_order, slot, mode="clip")
    src = chunk * c + row_in_chunk - t  # natural source position before wrapping
    real = chunk * c + row_in_chunk < total
    parts = [x]
    idx = j - t
    width = 0
    if k:
        # Edge rows: the last k rows of every chunk (t > 0: they start the next chunk) or
        # its first k (t < 0: they end the previous one), [per_rank·k] from this rank.
        blocks = split_axis(jax.lax.slice_in_dim(x, 0, local, axis=axis), axis, per_rank, c)
        edge = jax.lax.slice_in_dim(blocks, c - k if t > 0 else 0, c if t > 0 else k, axis=axis + 1)
        # Wrap rows: positions [total - k, total) (t > 0) or [0, k) (t < 0), which may span
        # two chunks when the last one is partial; every rank takes the rows at their local
        # places, and the receivers read each from its owner only.
        wrap_start = total - k if t > 0 else 0
        wrap_pos = wrap_start + jnp.arange(k, dtype=jnp.int32)
        wrap_slot = jnp.take(chunk_inverse, wrap_pos // c, mode="clip")
        wrap_rows = jnp.take(x, (wrap_slot % per_rank) * c + wrap_pos % c, axis=axis, mode="clip")
        mine = jnp.concatenate([merge_axes(edge, axis, 2), wrap_rows], axis=axis)
        parts.append(jax.lax.all_gather(mine, route.cp_axis, axis=axis, tiled=True))
        width = (per_rank + 1) * k  # rows each rank contributes

        wraps = (src < 0) | (src >= total)
        same_chunk = (row_in_chunk - t >= 0) & (row_in_chunk - t < c)
        n = route.num_chunks
        near_slot = jnp.take(
            chunk_inverse, jnp.clip(chunk - (1 if t > 0 else -1), 0, n - 1), mode="clip"
        )
        # Row within the neighbour's edge block: t > 0 reads the tail row i (rows i < t),
        # t < 0 the head row i + k - c.
        edge_row = row_in_chunk if t > 0 else row_in_chunk + k - c
        from_edge = rows + (near_slot // per_rank) * width + (near_slot % per_rank) * k + edge_row
        m = jnp.clip(jnp.mod(src, total) - wrap_start, 0, k - 1)
        from_wrap = rows + (jnp.take(wrap_slot, m) // per_rank) * width + per_rank * k + m
        idx = jnp.where(wraps, from_wrap, jnp.where(same_chunk, j - t, from_edge))
    zero_row = rows + route.cp * width
    idx = jnp.where(real, idx, zero_row)
    # Extra rows (the hidden row of a check_dispatch key) take the zero row too.
    idx = jnp.concatenate([idx.astype(jnp.int32), jnp.full((rows - local,), zero_row, jnp.int32)])
    zero_shape = list(x.shape)
    zero_shape[axis] = 1
    parts.append(jnp.zeros(zero_shape, x.dtype))
    return jnp.take(jnp.concatenate(parts, axis=axis), idx, axis=axis, mode="clip")


@dataclasses.dataclass(frozen=True)
class _EdgeRoute:
    """The static part of a roll over a traced dispatch: the mesh axis, the chunk geometry,
    and the signed shifts of the forward (``fwd``) and of its transpose (``bwd = -fwd``).
    Its ``move`` takes ``(chunk_order, chunk_inverse)`` where :class:`_Route` takes tables,
    so both run under :func:`_roll_linear`."""

    mesh: jax.sharding.Mesh
    cp_axis: str
    cp: int
    axis: int
    chunk_size: int
    total: int
    num_chunks: int
    fwd: int
    bwd: int
    # A batched key: x is [B, ...] with the rows over these axes, each its own dispatch.
    batch_axes: tuple[str, ...] | None = None

    @property
    def per_rank(self) -> int:
        return self.num_chunks // self.cp

    def move(self, x, t, chunk_order, chunk_inverse):
        program = _PROGRAMS.get((self, t), lambda: self._program(t))
        return program(x, chunk_order, chunk_inverse)

    def _program(self, t):
        if self.batch_axes is None:
            spec, order_spec = P(*([None] * self.axis), self.cp_axis), P()

            def body(x, chunk_order, chunk_inverse):
                return _move_edges(x, chunk_order, chunk_inverse, t, self)

        else:
            batch = axes_entry(self.batch_axes)
            spec = P(batch, *([None] * (self.axis - 1)), self.cp_axis)
            order_spec = P(batch)
            row = dataclasses.replace(self, axis=self.axis - 1, batch_axes=None)

            def body(x, chunk_order, chunk_inverse):
                parts = [
                    _move_edges(x[i], chunk_order[i], chunk_inverse[i], t, row)
                    for i in range(x.shape[0])
                ]
                return jnp.stack(parts)

        return jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(spec, order_spec, order_spec),
                out_specs=spec,
                check_vma=False,
            )
        )


def _edge_route(key: MagiKey, shift: int, axis: int) -> _EdgeRoute:
    st = key.static
    t = _signed_shift(shift, st.total)
    if abs(t) >= st.chunk_size and key.batched:
        raise ValueError(
            f"roll: shift={shift} (as a signed shift modulo total={st.total}: {t}) is not "
            f"smaller than the chunk size {st.chunk_size} of a batched key: each row's "
            "dispatch is its own, so roll moves only the |shift| edge rows of every chunk "
            f"and takes |shift| < {st.chunk_size}; for larger shifts roll the rows in "
            "natural order before mj.dispatch"
        )
    if abs(t) >= st.chunk_size:
        raise ValueError(
            f"roll: shift={shift} (as a signed shift modulo total={st.total}: {t}) is not "
            f"smaller than the chunk size {st.chunk_size} of a key built at a PlanCapacity "
            "and traced (passed to a jitted function as an argument): with its dispatch "
            "traced data, roll moves only the |shift| edge rows of every chunk, so it takes "
            f"|shift| < {st.chunk_size}. Close over the key instead (jax.jit(lambda x: "
            "mj.roll(x, shift, key))), pass a key built without capacity=, or, for label "
            "shifts, roll the token ids in natural order before mj.dispatch"
        )
    return _EdgeRoute(
        st.mesh,
        st.cp_axis,
        st.cp,
        axis,
        st.chunk_size,
        st.total,
        st.padded_total // st.chunk_size,
        t,
        -t,
        st.batch_axes if key.batched else None,
    )


def _check_shift(shift):
    if isinstance(shift, np.generic):
        shift = shift.item()
    if isinstance(shift, bool) or not isinstance(shift, int):
        if isinstance(shift, jax.core.Tracer) or isinstance(shift, jax.Array):
            raise TypeError(
                f"roll: shift must be a static Python int; got a JAX array "
                f"({getattr(shift, 'dtype', '?')}{tuple(getattr(shift, 'shape', ()))}). The "
                "transfers are planned per shift: pass an int (under jit, mark "
                "it static, e.g. jax.jit(f, static_argnums=...))"
            )
        raise TypeError(
            f"roll: shift={shift!r} must be a Python int (positive or negative, "
            f"any size); got {type(shift).__name__}"
        )
    return shift


@jax.named_scope("magi_roll")
def roll(x: jax.Array, shift: int, key: MagiKey, *, seq_axis: int = 0) -> jax.Array:
    """``jnp.roll`` of the packed sequence, on an array in dispatched order.

    Equals ``dispatch(jnp.roll(undispatch(x, key, seq_axis), shift, axis=seq_axis), key,
    seq_axis)``: the token at natural position ``p`` moves to position ``(p + shift) mod
    total`` (the roll is over the ``total`` real tokens, wrapping around at ``total``);
    padding rows come out zero. Only tokens whose source is on another rank travel, by
    point-to-point ``ppermute`` (one per rank offset that carries tokens), so a rank holds
    its own rows plus what it receives, never the whole sequence.

    Args:
      x: an array in the layout :func:`~magi_jax.sharding.dispatch` returns for ``key``
        (``padded_total`` rows along ``seq_axis``, sharded over ``key.cp_axis``), any dtype:
        activations ``[padded_total, ...]``, a batch ``[B, padded_total, ...]`` with
        ``seq_axis=1``, or int32 token ids.
      shift: a Python int, positive or negative, any size (taken modulo ``total``); 0 gives
        ``x`` with its padding rows zeroed. The transfers are planned per shift (on the host,
        NumPy, cached by dispatch and shift), so under ``jit`` it must be static.
      key: the :class:`~magi_jax.sharding.MagiKey` ``x`` was dispatched with. Eager, closed
        over in ``jit``, or passed to a jitted function as an argument (a key of one mask
        names its dispatch in its static part). A key built at a ``PlanCapacity`` passed as
        an argument carries its dispatch as traced data (one compilation for every packing):
        roll then plans on the device and takes shifts of less than a chunk (``|t| <
        key.chunk_size``, ``t`` the shift modulo ``total`` in ``(-total/2, total/2]``, e.g.
        the label shifts -1..-4), moving the ``|t|`` edge rows of every chunk by one
        ``all_gather`` of ``(num_chunks + cp)·|t|`` rows; a larger shift raises, saying what
        to do.
      seq_axis: the axis of the packed sequence, as for ``dispatch``.

    Returns an array like ``x`` (shape, dtype, dispatched layout). Differentiable: the VJP is
    the roll of the cotangent by ``-shift``.

    Multi-token prediction: the label of the ``k``-th extra head (``k = 1, 2, ...``) at
    position ``p`` is the token at ``p + k + 1``. Dispatch the token ids once, shift them by
    ``-(k + 1)``, and keep the positions whose target lies in the same document (which also
    drops the targets that wrap around and the padding)::

        ids = mj.dispatch(tokens, key)                       # int32 [padded_total]
        pos = mj.position_ids(key)
        cu = jnp.asarray(cu_seqlens)                         # document starts, then total
        doc_end = cu[jnp.searchsorted(cu, pos, side="right").clip(max=cu.size - 1)]
        labels = mj.roll(ids, -(k + 1), key)                 # token at p + k + 1
        valid = pos + k + 1 < doc_end                        # same document, not padding
        loss_k = cross_entropy(head_k(h), labels, where=valid)

    The hidden states of the main model can be shifted the same way
    (``mj.roll(h, -1, key)``), and gradients flow back through the roll.
    """
    check_key(key, "roll", x)
    if isinstance(x, DispatchedArray):  # checked against the key, rolled, still typed
        value, ok = open_dispatched(x, key, "roll", "x")
        rolled = roll(value, shift, key, seq_axis=seq_axis)
        return DispatchedArray(poison(rolled, ok), x.plan_id, x.tag)
    shift = _check_shift(shift)
    if not (hasattr(x, "ndim") and hasattr(x, "shape")):
        try:
            x = jnp.asarray(x)
        except TypeError:
            raise TypeError(f"roll: x must be an array; got {type(x).__name__}") from None
    axis = check_seq_axis(x, seq_axis, "roll")
    if x.shape[axis] != key.padded_total:
        msg = (
            f"roll: x has shape {tuple(x.shape)}; its axis {axis} (seq_axis={seq_axis}) "
            f"has {x.shape[axis]} rows but the key dispatches {rows_desc(key)}"
        )
        if x.shape[axis] == key.total and key.total != key.padded_total:
            msg += (
                "; x looks like natural-order tokens: mj.dispatch(x, key) first, or use "
                "jnp.roll on the natural-order array"
            )
        else:
            fits = [i for i, n in enumerate(x.shape) if n == key.padded_total and i != axis]
            msg += (
                f"; axis {fits[0]} has {key.padded_total} rows: pass seq_axis={fits[0]}"
                if fits
                else "; pass an array dispatched with this key"
            )
        raise ValueError(msg)
    if key.batched and axis == 0:
        raise ValueError(
            f"roll: x has shape {tuple(x.shape)} with the sequence on axis 0, but the key is "
            f"batched ({key.rows} rows): pass [{key.rows}, padded_total, ...] with seq_axis=1"
        )
    if key.batched or _traced_dispatch(key):
        dispatch = (key.chunk_order, key.chunk_inverse)
        return _roll_linear(_edge_route(key, shift, axis), x, dispatch, dispatch)
    s = shift % key.total
    fwd_deltas, fwd_send, fwd_gather = _device_tables(key, s)
    bwd_deltas, bwd_send, bwd_gather = _device_tables(key, (-s) % key.total)
    st = key.static
    route = _Route(st.mesh, st.cp_axis, st.cp, axis, fwd_deltas, bwd_deltas)
    return _roll_linear(route, x, (fwd_send, fwd_gather), (bwd_send, bwd_gather))
