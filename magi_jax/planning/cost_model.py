"""Defaults of context-parallel planning (host NumPy, no JAX): the overlap degree's cost
model and the chunk size and degree of keys at a capacity. One place for them, so that a
key of one mask and a key at a capacity choose by the same rules."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from magi_jax.caches import cached
from magi_jax.masks import AttnMask, SliceShapes
from magi_jax.planning.solver import DispatchMeta, auto_chunk_size, solve_dispatch
from magi_jax.planning.stages import split_areas

if TYPE_CHECKING:  # annotations only: capacity.py imports this module
    from magi_jax.planning.capacity import PlanCapacity

__all__ = [
    "OverlapDegrees",
    "default_overlap_degree",
    "default_overlap_degrees",
    "capacity_chunk_size",
    "capacity_overlap_degree",
    "capacity_needs",
    "sample_needs",
    "cast_pieces",
    "CAPACITY_CAST_PIECES",
    "PAIR_CAST_LEVELS",
    "PAIR_CAST_PIECES",
]

# Cost model of the default overlap degree (H200 figures, bf16, Hq = Hkv = 16,
# D = 128): seconds per attended cell, per fetched KV token, per stage (fixed, and per local
# token: the stage's merge and the second kernel's tail), and the share of the ideal overlap
# that XLA achieves. The last three from benchmarks/results/overlap/overlap_20261130_0800 (2 H200s,
# doc-causal 128k: +0.35 ms of compute per extra stage on 65k local tokens; 30-50 % of the
# communication hidden).
_SEC_PER_CELL = 4 * 16 * 128 / 400e12
_SEC_PER_TOKEN = 2 * 16 * 128 * 2 / 250e9
_SEC_PER_STAGE = 30e-6
_SEC_PER_STAGE_TOKEN = 5e-9
_OVERLAP_EFFICIENCY = 0.5
_MAX_DEGREE = 4


class OverlapDegrees(NamedTuple):
    """The overlap degrees of a key: remote stages of the forward and of the backward
    (each ``0``: fetch all remote KV, then one FFA call)."""

    forward: int
    backward: int


# Gated pieces of a ppermute slot at a capacity (transport._slot.gated_ppermute): counted by
# benchmarks/wire_bench.py at 128k x cp 8 (benchmarks/results/wire/LATEST.md), 8 pieces
# bring the busiest rank's wire from 1.25-9.7x its real rows (whole slots) to 1.09-3.2x;
# 16 would gain 4-10 % more at twice the branches of the slot's one conditional.
CAPACITY_CAST_PIECES = 8
# ppermute levels per slot of a key of one mask moved pair by pair
# (transport._pair.staircase_ppermute): counted by benchmarks/wire_bench.py at 128k x cp 8,
# the busiest rank's wire over its real rows is at most 1.74x with 1 level, 1.31x with 2,
# 1.17x with 3 (total 1.11x), 1.09x with 4 and exact with 8 (one level per distinct
# count): 3 is the fewest within 1.25x.
PAIR_CAST_LEVELS = 3
# Gated pieces per slot of a key at a capacity moved pair by pair (cast_gating="pair";
# transport._pair.pair_gated_ppermute): the worst packing of 16 per generator at 128k x cp 8 is
# within 1.25x per rank with 32 (at most 1.12x, many-docs) and not with 16 (1.26x).
# Binary digits of the piece count: 6 conditionals per pair with 32, 5 with 16.
PAIR_CAST_PIECES = 32


def default_overlap_degree(
    mask: AttnMask, meta: DispatchMeta, kv: DispatchMeta | str | None = None
) -> int:
    """Overlap degree minimising a simple per-rank pipeline model (the constants above,
    measured on one pair of H200s): stage 0 computes the host area while remote stage 0
    arrives; each later stage computes its share while the next arrives — of which ideal
    overlap only a measured share is realised; every stage costs a fixed overhead plus one
    per local token. Degree 0 fetches everything, then computes. Needs no kernel plan (areas
    from the clipped slices). ``kv``: where a cross-attention mask's keys live
    (:func:`~magi_jax.planning.stages.build_dist_plan`).
    :func:`magi_jax.sharding.calibrate.calibrate_overlap` chooses by timing instead."""
    host, rem, tokens = (x.astype(np.float64) for x in split_areas(mask, meta, kv))
    if not tokens.any():
        return 0
    host, rem, comm = host * _SEC_PER_CELL, rem * _SEC_PER_CELL, tokens * _SEC_PER_TOKEN
    stage = _SEC_PER_STAGE + _SEC_PER_STAGE_TOKEN * meta.padded_total / meta.cp
    serial = comm + host + rem
    best, best_t = 0, float(np.max(serial)) + stage
    for k in range(1, _MAX_DEGREE + 1):
        c, r = comm / k, rem / k
        ideal = np.maximum(c, host) + (k - 1) * np.maximum(c, r) + r
        t = serial - _OVERLAP_EFFICIENCY * (serial - ideal) + (k + 1) * stage
        if float(t.max()) < best_t * 0.98:
            best, best_t = k, float(t.max())
    return best


def default_overlap_degrees(
    mask: AttnMask, meta: DispatchMeta, kv: DispatchMeta | str | None = None
) -> OverlapDegrees:
    """The degrees a key takes before any measurement: the cost model's
    (:func:`default_overlap_degree`, a model of the forward's pipeline) for the forward, and
    the same degree for the backward, as keys have always run it; nothing measured yet says
    more about the backward. :func:`magi_jax.sharding.calibrate.calibrate_overlap` measures
    each direction on the machine at hand."""
    degree = default_overlap_degree(mask, meta, kv)
    return OverlapDegrees(degree, degree)


def cast_pieces(capacity: PlanCapacity | None, gating: str = "slot") -> int:
    """Gated pieces per ``ppermute`` slot of a key's casts: :data:`CAPACITY_CAST_PIECES` at a
    capacity (slots as wide as the capacity, most of it padding for most masks;
    :data:`PAIR_CAST_PIECES` with ``gating="pair"``), 1 for a key of one mask (its slots are
    as wide as their widest real block already, and its pairs' rows are static)."""
    if capacity is None:
        return 1
    return PAIR_CAST_PIECES if gating == "pair" else CAPACITY_CAST_PIECES


def capacity_chunk_size(total: int, cp: int) -> int:
    """The dispatch chunk of keys at a capacity: about 16 chunks per rank."""
    return auto_chunk_size(total, cp, 16)


@cached(64)
def capacity_overlap_degree(total: int, cp: int, chunk_size: int) -> OverlapDegrees:
    """The overlap degrees of keys at a capacity: the cost model's choice for a causal mask
    of the packed length (a mask-independent stand-in for document-causal training data)."""
    proxy = AttnMask.causal(total)
    return default_overlap_degrees(proxy, solve_dispatch(proxy, cp, chunk_size, "magi"))


def capacity_needs(
    masks: Iterable[AttnMask],
    cp: int,
    chunk_size: int | None = None,
    overlap_degree: int | None = None,
    backward_overlap_degree: int | None = None,
) -> dict:
    """What keys of ``masks`` (one packed length) over ``cp`` ranks need, per rank and
    stage: ``items`` (the longest q-tile list, on the ``xla`` backend's tiles, which are
    never larger than the kernels'), ``q_runs`` / ``k_runs`` (the most runs of items on a
    q-tile / k-tile list of the stages that read fetched KV, on either backend's tiles),
    ``host_q_runs`` / ``host_k_runs`` (the same on the host stage; ``None`` when the keys
    have none: one combined stage), ``remote_kv`` (remote KV tokens, all
    stages), and ``cast_width`` (tokens one rank sends another in one stage), ``send_runs`` /
    ``recv_runs`` (runs of one rank's cast tables in one stage), with the ``chunk_size``,
    ``overlap_degree`` and ``backward_overlap_degree`` the keys use — the inputs of
    :meth:`PlanCapacity.from_masks`. Where the backward's degree differs, the keys carry a
    second stage plan for it, and both plans are measured. ``backward_overlap_degree=None``
    is ``overlap_degree`` when that is given, else the cost model's."""
    masks = list(masks)
    total = masks[0].total_q
    chunk = int(chunk_size or capacity_chunk_size(total, cp))
    model = capacity_overlap_degree(total, cp, chunk)
    degree = int(overlap_degree if overlap_degree is not None else model.forward)
    if backward_overlap_degree is not None:
        back = int(backward_overlap_degree)
    else:
        back = degree if overlap_degree is not None else model.backward
    need = dict(
        items=1,
        q_runs=1,
        k_runs=1,
        host_q_runs=None,
        host_k_runs=None,
        remote_kv=1,
        cast_width=1,
        send_runs=1,
        recv_runs=1,
        chunk_size=chunk,
        overlap_degree=degree,
        backward_overlap_degree=back,
    )
    for mask in masks:
        for plan_degree in sorted({degree, back}):
            _plan_needs(need, mask, cp, chunk, plan_degree)
    return need


def _plan_needs(need: dict, mask: AttnMask, cp: int, chunk: int, degree: int) -> None:
    """Grows ``need`` (:func:`capacity_needs`' fields) to hold ``mask``'s plan of
    ``degree`` remote stages."""
    from magi_jax.planning.stages import build_dist_plan, resolve_kv
    from magi_jax.planning.work_list import count_runs, default_block_sizes

    meta = solve_dispatch(mask, cp, chunk, "magi")
    kv = resolve_kv(mask, meta)  # cross attention: the automatic key layout
    kv_local = (
        meta.local_len if kv is None else mask.total_k if isinstance(kv, str) else kv.local_len
    )
    bq, bk = default_block_sizes(meta.local_len, kv_local)
    plan = build_dist_plan(mask, meta, degree, bq, bk, "xla", kv=kv)
    stages = max(degree, 1)
    remote = [st for st in plan.stages if st.cast is not None]
    need["items"] = max(need["items"], max(st.items[0] for st in plan.stages))
    # At a capacity a key keeps its host stage, unless one combined stage holds all its KV
    # (overlap degree 0 on fetched keys), whatever this mask fetches.
    combined = degree == 0 and cp > 1 and not isinstance(kv, str)
    for st in plan.stages:
        # Runs on either backend's tiles (the Mosaic GPU k-tile list steps over 64 rows).
        sizes = [len(x.q0) for x in st.shapes]
        flat = SliceShapes(
            *(
                np.concatenate([getattr(x, f) for x in st.shapes])
                for f in ("q0", "q1", "k0", "k1", "dlo", "dhi")
            )
        )
        runs = count_runs(
            flat, meta.local_len, st.kv_len, (bq, bk), np.repeat(np.arange(cp), sizes), cp
        )
        fields = ("q_runs", "k_runs")
        if st.cast is None and not combined:
            fields = ("host_q_runs", "host_k_runs")
        for f, n in zip(fields, runs):
            need[f] = max(need[f] or 0, n)
    if remote:
        # Stages split a rank's remote KV evenly: the longest stage bounds them all.
        longest = max(int(st.cast.rows_received().max()) for st in remote)
        need["remote_kv"] = max(need["remote_kv"], longest * stages)
        need["cast_width"] = max(
            need["cast_width"], max(max(st.cast.widths, default=1) for st in remote)
        )
        for st in remote:
            send_runs, recv_runs = st.cast.run_counts()
            need["send_runs"] = max(need["send_runs"], send_runs)
            need["recv_runs"] = max(need["recv_runs"], recv_runs)


def sample_needs(
    masks: list[AttnMask],
    mesh_size: int | None = None,
    chunk_size: int | None = None,
    overlap_degree: int | None = None,
    backward_overlap_degree: int | None = None,
) -> dict:
    """What a sample of masks (one length) needs, the measuring half of
    :meth:`~magi_jax.planning.capacity.PlanCapacity.from_masks`. Without ``mesh_size``
    (single-device plans): the most ``items`` (on tiles of
    :data:`~magi_jax.planning.capacity.CAPACITY_TILE`), ``q_runs`` and ``k_runs`` of one
    mask, and ``mean_items``, the sample's mean item count; with ``mesh_size=cp``:
    :func:`capacity_needs` over ``cp`` ranks."""
    if mesh_size is not None:
        return capacity_needs(
            masks, int(mesh_size), chunk_size, overlap_degree, backward_overlap_degree
        )
    from magi_jax.planning.tiling import count_items
    from magi_jax.planning.work_list import count_runs

    total_q, total_k = masks[0].total_q, masks[0].total_k
    items = [count_items(m.shapes, total_q, total_k) for m in masks]
    runs = np.max([count_runs(m.shapes, total_q, total_k) for m in masks], axis=0)
    return dict(items=max(items), q_runs=runs[0], k_runs=runs[1], mean_items=np.mean(items))
