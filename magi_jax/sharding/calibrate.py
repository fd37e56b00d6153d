"""Overlap degrees chosen by measurement on the machine at hand.

The default degrees of a key come from a cost model whose constants were measured once, on a
pair of H200s (:func:`~magi_jax.planning.cost_model.default_overlap_degree`). Elsewhere (other
GPUs, other links, more ranks, CPU devices) the best degree differs, and the forward's and
the backward's differ from each other. :func:`calibrate_overlap` times the key's own
programs instead: for every candidate degree it builds the key, compiles its forward and its
backward (the backward alone, from the forward's residuals), runs them in interleaved
rounds (every candidate once per round, so that load from other jobs falls on all alike)
and keeps, for the forward and for the backward, the fewest stages within ``tolerance`` of
the fastest median. Timing the real step was chosen over fitting the cost model's constants
to probes: it needs no model of how much overlap XLA realises, which is the least
predictable term, and costs two compilations per candidate.

A calibration is cached per (mesh, cp axis, mask — or capacity —, dtype, heads, head dims,
key options, candidates, rounds, tolerance) in one :class:`~magi_jax.caches.Cache`:
:func:`overlap_calibrations` lists what is held, :func:`clear_overlap_calibrations` (or
:func:`magi_jax.clear_caches`) forgets it. Use the result as a key's degrees::

    cal = mj.calibrate_overlap(mask, mesh, "cp", num_heads=16, head_dim=128)
    key = mj.make_flex_key(mask, mesh, "cp", overlap_degree=cal.degrees)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from magi_jax.caches import Cache
from magi_jax.masks import AttnMask
from magi_jax.planning import OverlapDegrees, PlanCapacity, capacity_needs
from magi_jax.sharding.attention import magi_attention
from magi_jax.sharding.keys import (
    MAX_OVERLAP_DEGREE,
    KeyOptions,
    MagiKey,
    check_mesh,
    make_flex_key,
    normal_cp_axis,
)
from magi_jax.sharding.layout import pod_specs

__all__ = [
    "OverlapCalibration",
    "calibrate_overlap",
    "overlap_calibrations",
    "clear_overlap_calibrations",
    "timed_programs",
    "CANDIDATE_DEGREES",
]

# The degrees tried by default: the cost model never picks more than 4.
CANDIDATE_DEGREES = (0, 1, 2, 3, 4)
# Options of a key that calibration sets itself or cannot time.
_NOT_OPTIONS = ("overlap_degree", "capacity", "check_dispatch", "batch_axes")

_CALIBRATIONS = Cache("overlap_calibrations", max_items=256)


@dataclasses.dataclass(frozen=True)
class OverlapCalibration:
    """The overlap degrees :func:`calibrate_overlap` measured as fastest, and what it saw.

    ``degrees``: :class:`~magi_jax.planning.cost_model.OverlapDegrees` ``(forward,
    backward)``, for ``make_flex_key(..., overlap_degree=cal.degrees)`` or
    ``PlanCapacity.from_masks(..., overlap_degree=cal.degrees)``. ``forward_ms`` /
    ``backward_ms``: the median milliseconds of each candidate degree (the backward alone,
    from the forward's residuals); ``setting``: what was measured (mesh, lengths, dtype,
    heads, transport); ``seconds``: the calibration's wall time, compilation included."""

    degrees: OverlapDegrees
    forward_ms: dict[int, float]
    backward_ms: dict[int, float]
    rounds: int
    tolerance: float
    setting: str
    seconds: float

    @property
    def forward(self) -> int:
        """The forward's degree."""
        return self.degrees.forward

    @property
    def backward(self) -> int:
        """The backward's degree."""
        return self.degrees.backward


def calibrate_overlap(
    key_or_mask: MagiKey | AttnMask,
    mesh: Mesh | None = None,
    cp_axis: str | Sequence[str] = "cp",
    *,
    num_heads: int,
    head_dim: int,
    dtype: Any = jnp.bfloat16,
    num_kv_heads: int | None = None,
    value_head_dim: int | None = None,
    capacity: PlanCapacity | None = None,
    candidates: Sequence[int] = CANDIDATE_DEGREES,
    rounds: int = 5,
    tolerance: float = 0.02,
    **options: Any,
) -> OverlapCalibration:
    """Measures the fastest forward and backward overlap degrees of a key on its mesh.

    Args:
      key_or_mask: a key from :func:`~magi_jax.sharding.make_flex_key` (its mask,
        mesh, cp axis, capacity and options are calibrated; pass no ``mesh`` then), or an
        :class:`~magi_jax.masks.AttnMask` with ``mesh`` (and ``cp_axis``, ``capacity``,
        ``options``) as for ``make_flex_key``.
      num_heads, head_dim: the query heads and head dim of the attention calls (the heads
        of the whole call; with ``head_axes`` they are sharded as the key says).
      dtype: of q, k and v (default bfloat16). num_kv_heads: default ``num_heads``;
        value_head_dim: default ``head_dim``.
      capacity: a :class:`~magi_jax.planning.capacity.PlanCapacity`: time keys at it (the
        calibration then holds for the capacity, whatever mask within it; ``key_or_mask``
        is the sample it is measured on). Its own degrees are ignored; where a candidate
        degree needs more per stage than it holds, that candidate's capacity grows to the
        sample's needs (:meth:`~magi_jax.planning.capacity.PlanCapacity.grow`). Build the
        capacity for training with
        ``PlanCapacity.from_masks(sample, mesh_size=cp, overlap_degree=cal.degrees)``.
      candidates: the degrees tried (default 0 to 4), each in ``[0, MAX_OVERLAP_DEGREE]``.
      rounds: timed calls of each program per candidate (their median counts).
      tolerance: the fewest stages whose median is within this share of the fastest win
        (fewer stages: fewer collectives and less memory for the same time).
      options: other options of ``make_flex_key`` (``comm_backend``, ``ffa_backend``,
        ``chunk_size``, ``head_axes``, ...); not ``overlap_degree``, ``check_dispatch`` or
        ``batch_axes`` (calibrate the per-row key: every row runs the same plan shapes).

    Returns an :class:`OverlapCalibration`, cached (a second call with the same arguments
    measures nothing). With ``backward_refetch=False`` the backward runs the forward's
    stages, so one degree is chosen for both, by the sum of the two times. Costs two
    compilations and ``2 · rounds + 3`` calls per candidate.
    """
    mask, mesh, cp_axis, capacity, options = _resolve(key_or_mask, mesh, cp_axis, capacity, options)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    for name, value in (
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("value_head_dim", value_head_dim),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)"
        )
    dtype = jnp.dtype(dtype)
    candidates = _check_candidates(candidates)
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} must be a positive integer (timed calls each)")
    if not 0 <= float(tolerance) < 1:
        raise ValueError(f"tolerance={tolerance!r} must be a share in [0, 1), e.g. 0.02")
    shape = (int(num_heads), int(num_kv_heads), int(head_dim), int(value_head_dim))
    opts = KeyOptions(**options)  # checked before anything is measured
    what = (
        (
            "capacity",
            dataclasses.replace(capacity, overlap_degree=None, backward_overlap_degree=None),
        )
        if capacity is not None
        else ("mask", mask.fingerprint)
    )
    cache_key = (
        mesh,
        cp_axis,
        what,
        dtype.name,
        shape,
        tuple(sorted(options.items(), key=lambda kv: kv[0])),
        candidates,
        int(rounds),
        float(tolerance),
    )
    return _CALIBRATIONS.get(
        cache_key,
        lambda: _measure(
            mask,
            mesh,
            cp_axis,
            capacity,
            options,
            opts,
            dtype,
            shape,
            candidates,
            int(rounds),
            float(tolerance),
        ),
    )


def overlap_calibrations() -> list[OverlapCalibration]:
    """The calibrations held by the cache, oldest first."""
    return _CALIBRATIONS.values()


def clear_overlap_calibrations() -> None:
    """Forgets every calibration (:func:`magi_jax.clear_caches` does too); keys already
    built keep their degrees."""
    _CALIBRATIONS.clear()


def _resolve(key_or_mask, mesh, cp_axis, capacity, options):
    """``(mask, mesh, cp_axis, capacity, options)`` of a calibration, from a key or a
    mask."""
    bad = sorted(set(options) & set(_NOT_OPTIONS))
    if bad:
        raise ValueError(
            f"calibrate_overlap: {bad[0]}= is not an option of a calibration (it measures "
            "every candidate degree, without the dispatch check, on unbatched inputs: "
            "calibrate the per-row key); leave it unset"
        )
    unknown = sorted(set(options) - set(KeyOptions.names()))
    if unknown:
        raise TypeError(f"calibrate_overlap: unknown options {unknown}; see make_flex_key")
    if isinstance(key_or_mask, MagiKey):
        key = key_or_mask
        if mesh is not None or capacity is not None or options:
            raise ValueError(
                "calibrate_overlap: a key brings its mesh, capacity and options; pass the "
                "key alone, or its mask with mesh=, capacity= and options"
            )
        if key.mask is None:
            raise ValueError(
                "calibrate_overlap: the key carries no mask (a batched key, or one rebuilt "
                "inside a traced function); pass a mask of its rows with mesh= and options"
            )
        if key.batched:
            raise ValueError(
                "calibrate_overlap: the key is batched; pass one row's mask with mesh= and "
                "the key's options"
            )
        st = key.static
        options = dict(
            chunk_size=st.chunk_size,
            comm_backend=st.comm_backend,
            ffa_backend=st.ffa_backend,
            block_q=st.block_q,
            block_k=st.block_k,
            backward_refetch=st.backward_refetch,
            head_axes=st.head_axes,
        )
        if key.cross:
            options["kv_layout"] = st.kv_layout
        return key.mask, key.mesh, normal_cp_axis(key.cp_axis), key.capacity, options
    if not isinstance(key_or_mask, AttnMask):
        raise TypeError(
            "calibrate_overlap: key_or_mask must be a MagiKey or an AttnMask; got "
            f"{type(key_or_mask).__name__}"
        )
    if mesh is None:
        raise ValueError("calibrate_overlap: with a mask, pass mesh= (and cp_axis=)")
    if capacity is not None and not isinstance(capacity, PlanCapacity):
        raise TypeError(f"capacity must be a PlanCapacity; got {type(capacity).__name__}")
    return key_or_mask, mesh, normal_cp_axis(cp_axis), capacity, dict(options)


def _check_candidates(candidates) -> tuple[int, ...]:
    try:
        values = tuple(candidates)
    except TypeError:
        values = None
    ok = values is not None and len(values) > 0
    ok = ok and all(
        not isinstance(d, bool)
        and isinstance(d, (int, np.integer))
        and 0 <= d <= MAX_OVERLAP_DEGREE
        for d in values
    )
    if not ok:
        raise ValueError(
            f"candidates={candidates!r} must be a non-empty sequence of degrees in "
            f"[0, {MAX_OVERLAP_DEGREE}], e.g. (0, 1, 2, 3, 4)"
        )
    return tuple(sorted({int(d) for d in values}))


def _candidate_capacity(capacity, mask, cp, degree, chunk_size):
    """``capacity`` at ``degree`` (both directions), its per-stage bounds grown to what
    ``mask`` needs there where it holds less."""
    need = capacity_needs([mask], cp, chunk_size or capacity.chunk_size, degree, degree)
    grown = ("items", "q_runs", "k_runs", "remote_kv", "cast_width", "send_runs", "recv_runs")
    capacity = capacity.grow({f: need[f] for f in grown}, mesh_size=cp)
    return dataclasses.replace(capacity, overlap_degree=degree, backward_overlap_degree=degree)


def timed_programs(
    key: MagiKey,
    *,
    num_heads: int,
    head_dim: int,
    dtype: Any = jnp.bfloat16,
    num_kv_heads: int | None = None,
    value_head_dim: int | None = None,
    seed: int = 0,
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """What :func:`calibrate_overlap` times: two zero-argument callables over random
    dispatched inputs (``[padded_total, H, D]``, sharded as the key says), the key's forward
    as training runs it (outputs and the backward's residuals) and its backward alone (from
    those residuals), each returning arrays to block on. The first call of each compiles."""
    hq, d = num_heads, head_dim
    hkv = num_heads if num_kv_heads is None else num_kv_heads
    dv = head_dim if value_head_dim is None else value_head_dim
    specs = pod_specs(key, 3)
    rows_q, rows_kv = key.padded_total, key.kv_padded_total
    keys = jax.random.split(jax.random.key(seed), 4)
    put = lambda x, spec: jax.device_put(x, NamedSharding(key.mesh, spec))
    q = put(jax.random.normal(keys[0], (rows_q, hq, d), dtype), specs.q)
    k = put(jax.random.normal(keys[1], (rows_kv, hkv, d), dtype), specs.kv)
    v = put(jax.random.normal(keys[2], (rows_kv, hkv, dv), dtype), specs.kv)
    dout = put(jax.random.normal(keys[3], (rows_q, hq, dv), dtype), specs.q)
    # The forward as training runs it: outputs and the backward's residuals (the custom
    # VJP keeps inputs, out and lse: no work beyond the forward's).
    forward = jax.jit(lambda q, k, v, key: jax.vjp(lambda *x: magi_attention(*x, key), q, k, v))
    (_, lse), vjp = forward(q, k, v, key)
    cts = (dout, jnp.zeros_like(lse))
    backward = jax.jit(lambda vjp, cts: vjp(cts))
    return (lambda: forward(q, k, v, key)), (lambda: backward(vjp, cts))


def _measure(
    mask, mesh, cp_axis, capacity, options, opts, dtype, shape, candidates, rounds, tolerance
) -> OverlapCalibration:
    start = time.perf_counter()
    programs = {}
    key = None
    for degree in candidates:
        cap = None
        if capacity is not None:
            cap = _candidate_capacity(
                capacity, mask, check_mesh(mesh, cp_axis), degree, opts.chunk_size
            )
        key = make_flex_key(mask, mesh, cp_axis, overlap_degree=degree, capacity=cap, **options)
        hq, hkv, d, dv = shape
        programs[degree] = timed_programs(
            key,
            num_heads=hq,
            head_dim=d,
            dtype=dtype,
            num_kv_heads=hkv,
            value_head_dim=dv,
            seed=degree,
        )
        for fn in programs[degree]:  # compile and warm up
            jax.block_until_ready(fn())
    times = {degree: ([], []) for degree in candidates}
    for _ in range(rounds):
        for degree in candidates:  # interleaved: load from other jobs falls on all alike
            for fn, out in zip(programs[degree], times[degree]):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                out.append((time.perf_counter() - t0) * 1e3)
    fwd = {d: float(np.median(t[0])) for d, t in times.items()}
    bwd = {d: float(np.median(t[1])) for d, t in times.items()}
    if opts.backward_refetch:
        degrees = OverlapDegrees(_fewest(fwd, tolerance), _fewest(bwd, tolerance))
    else:  # the backward keeps the forward's stage buffers: one degree for both
        both = _fewest({d: fwd[d] + bwd[d] for d in candidates}, tolerance)
        degrees = OverlapDegrees(both, both)
    setting = (
        f"cp={key.cp} over {cp_axis!r} of mesh {dict(mesh.shape)} "
        f"({mesh.devices.flat[0].device_kind}), {mask.total_q}x{mask.total_k} tokens"
        f"{' at a capacity' if capacity is not None else ''}, {dtype.name}, "
        f"heads {shape[0]}/{shape[1]}, head dims {shape[2]}/{shape[3]}, "
        f"ffa {key.ffa_backend}, comm {key.comm_backend}"
    )
    return OverlapCalibration(
        degrees, fwd, bwd, rounds, tolerance, setting, time.perf_counter() - start
    )


def _fewest(ms: dict[int, float], tolerance: float) -> int:
    """The smallest degree whose time is within ``tolerance`` of the fastest."""
    best = min(ms.values())
    return min(d for d, t in ms.items() if t <= best * (1 + tolerance))
