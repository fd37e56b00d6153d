"""Host planning of a key: :func:`host_key` plans resolved options
(:class:`~magi_jax.sharding.keys._resolve.ResolvedOptions`) into a :class:`HostKey` (the
dispatch, the stages, their casts on their transports and FFA work lists, as NumPy arrays
and a static part), before its arrays become global ones.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from magi_jax.masks import AttnMask
from magi_jax.planning import (
    DistPlan,
    PlanCapacity,
    build_dist_plan,
    cast_pieces,
    choose_transport,
    default_block_sizes,
    default_overlap_degrees,
    resolve_kv,
    slot_rows,
    solve_dispatch,
)
from magi_jax.sharding.keys._key import KeyStatic, StageStatic
from magi_jax.sharding.keys._relay import relay_stage
from magi_jax.sharding.keys._resolve import ResolvedOptions
from magi_jax.sharding.transport import CastRuns, CastSpec, native

if TYPE_CHECKING:  # annotations only
    from magi_jax.planning import NodeLayout


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


def host_key(resolved: ResolvedOptions) -> HostKey:
    """The host half of a key: ``resolved`` planned (the dispatch, the stages, their casts
    and FFA work lists) into a :class:`HostKey`."""
    r = resolved
    mask, mesh, cp_axis, cp, capacity = r.mask, r.mesh, r.cp_axis, r.cp, r.capacity
    overlap_degree, ffa_backend, relay = r.overlap_degree, r.ffa_backend, r.relay
    if r.dispatch_from is not None:
        meta = r.dispatch_from.meta
    else:
        meta = solve_dispatch(mask, cp, r.chunk_size, r.algorithm)
    # Cross attention: where the keys live (None: self-attention, the queries' dispatch).
    kv = resolve_kv(mask, meta, r.kv_layout)
    kv_meta = kv if kv is not None and not isinstance(kv, str) else None
    kv_local = (
        meta.local_len if kv is None else mask.total_k if kv_meta is None else kv_meta.local_len
    )
    auto_q, auto_k = default_block_sizes(meta.local_len, kv_local)
    bq, bk = int(r.block_q or auto_q), int(r.block_k or auto_k)
    if overlap_degree is None:  # one degree for both directions until measured
        overlap_degree = default_overlap_degrees(mask, meta, kv)
    degree, back = overlap_degree
    plan: DistPlan = build_dist_plan(mask, meta, degree, bq, bk, ffa_backend, capacity, kv=kv)
    stage_parts = functools.partial(
        _stage_parts,
        cp_axis=cp_axis,
        cp=cp,
        comm_backend=r.comm_backend,
        capacity=capacity,
        cast_gating=r.cast_gating,
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
        comm_backend=r.comm_backend,
        backward_refetch=r.backward_refetch,
        capacity=capacity,
        fingerprint=fingerprint,
        batch_axes=r.batch_axes,
        head_axes=r.head_axes,
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
        # Two-hop casts on a mesh of nodes (hierarchical=...; see keys._relay.relay_stage).
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


def _chunk_permutation(meta) -> tuple[np.ndarray, np.ndarray]:
    """``(chunk_order, chunk_inverse)`` int64 ``[num_chunks]`` of a dispatch: the natural
    chunk in each dispatched slot (rank-major, as ``meta.rank_chunks``) and the slot of each
    natural chunk."""
    chunk_order = meta.rank_chunks.reshape(-1)
    chunk_inverse = np.empty(meta.num_chunks, np.int64)
    chunk_inverse[chunk_order] = np.arange(meta.num_chunks)
    return chunk_order, chunk_inverse
